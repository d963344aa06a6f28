"""The model's shape: `ModelConfig` (a DeepSeek-V4-style model, round-tripping through
config.json), each layer's `Compression`, and the preset shapes."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from branchspec.config.checks import ConfigError, check_bool, check_float, check_int, require

SUPPORTED_RATIOS = (0, 4, 128)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


@dataclass(frozen=True)
class Compression:
    """How one layer compresses its history, the one place DeepSeek-V4's rule is written:
    ratio 4 (CSA) pools overlapping windows of two blocks and has a lightning indexer over
    its entries; other ratios (128, HCA) pool one block each, and every entry is visible;
    ratio 0 keeps only the sliding window. Build it with `Compression.of(ratio)`."""

    ratio: int          # tokens per entry; 0: no compression
    overlap: bool       # each entry pools the previous block too (2 * ratio rows)
    indexer: bool       # a lightning indexer picks the top-k visible entries

    @classmethod
    def of(cls, ratio: int) -> "Compression":
        csa = ratio == 4
        return cls(ratio=ratio, overlap=csa, indexer=csa)

    @property
    def span(self) -> int:
        """Rows pooled into one entry."""
        return 2 * self.ratio if self.overlap else self.ratio

    @property
    def buffer_rows(self) -> int:
        """Committed compressor rows a forward may need: the last span - 1 positions."""
        return self.span - 1

    @property
    def row_groups(self) -> int:
        """Channel groups per compressor row: two (previous block, current block) when
        overlapping, else one; a row holds row_groups * head_dim values of a and of g."""
        return 2 if self.overlap else 1


_JSON_TYPE_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
                    type(None): "null"}



@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V4-style model, scaled down.

    Every layer has a sliding window over raw keys; layers with compress ratio 4 add the
    overlapping C4 compressor and a lightning indexer, layers with ratio 128 the C128
    compressor. `compress_ratios[l] == 0` means window only.

    The real V4 architecture's per-token parts are switched on by their fields, and the
    zero defaults give the plain model (v4-mini): `compress_rope_theta` and `yarn_*` (RoPE
    of compressed layers), `o_groups` (grouped low-rank output), `hc_mult` (hyper-
    connections), `num_experts` (MoE instead of a dense SwiGLU of `ffn_hidden`).

    Every bad value raises ConfigError (a ValueError) naming the field; a wrong type
    (`ModelConfig(d_model="256")`, `d_model=256.0`, `num_layers=True`) raises its subclass
    ConfigTypeError, which is also a TypeError (`config.checks`). `ModelConfig.load` adds
    the file's name.

    Derived once at construction (not fields, so not in config.json): `layer_compression`,
    each layer's `Compression`, and `compressed_kinds`, the distinct compressing ones by
    ratio.
    """

    _INT_FIELDS = ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim", "rope_dim",
                   "q_lora_rank", "window", "index_num_heads", "index_head_dim", "index_topk",
                   "ffn_hidden", "max_position", "num_mtp_layers", "bos_token_id", "eos_token_id",
                   "pad_token_id", "yarn_original_max_position", "o_groups", "o_lora_rank", "hc_mult",
                   "hc_sinkhorn_iters", "num_experts", "num_experts_per_tok", "num_shared_experts",
                   "moe_hidden", "num_hash_layers")
    _FLOAT_FIELDS = ("rope_theta", "norm_eps", "yarn_factor", "yarn_beta_fast", "yarn_beta_slow", "hc_eps",
                     "routed_scaling_factor", "swiglu_limit")

    vocab_size: int = 8192
    d_model: int = 256
    num_layers: int = 6
    compress_ratios: tuple[int, ...] = (0, 4, 128, 4, 128, 4)
    num_heads: int = 4
    head_dim: int = 64
    rope_dim: int = 32
    q_lora_rank: int = 128
    window: int = 64
    index_num_heads: int = 4
    index_head_dim: int = 32
    index_topk: int = 32
    ffn_hidden: int = 1024
    max_position: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    num_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    # RoPE of CSA/HCA layers (queries, keys, entries, indexer): its own base and YaRN.
    # Sliding-only layers and the MTP block use plain `rope_theta`.
    compress_rope_theta: float | None = None     # None: rope_theta
    yarn_factor: float = 1.0                     # 1: no YaRN
    yarn_original_max_position: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # Grouped low-rank output: heads in o_groups groups, each to o_lora_rank, then to d_model.
    o_groups: int = 0                            # 0: one W_o
    o_lora_rank: int = 0
    # Manifold-constrained hyper-connections: hc_mult residual streams.
    hc_mult: int = 0                             # 0: one plain residual stream
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # MoE: routed experts (top-k by score, or by a token-id hash in the first layers) plus
    # shared experts, each a SwiGLU of moe_hidden.
    num_experts: int = 0                         # 0: dense SwiGLU of ffn_hidden
    num_experts_per_tok: int = 0
    num_shared_experts: int = 1
    moe_hidden: int = 0
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    num_hash_layers: int = 0
    swiglu_limit: float = 0.0                    # 0: no clamp
    # Ratios outside {0, 4, 128} change the pooling schedule; only tests should need them.
    allow_any_ratio: bool = False

    def __post_init__(self) -> None:
        # Types first, so the range checks below compare numbers, and a JSON 256.5 or "256"
        # is refused rather than truncated or compared as a string.
        for name in self._INT_FIELDS:
            object.__setattr__(self, name, check_int(None, name, getattr(self, name)))
        for name in self._FLOAT_FIELDS:
            object.__setattr__(self, name, check_float(None, name, getattr(self, name)))
        if self.compress_rope_theta is not None:
            object.__setattr__(self, "compress_rope_theta", check_float(None, "compress_rope_theta",
                                                                          self.compress_rope_theta))
        for name in ("allow_any_ratio", "norm_topk_prob"):
            check_bool(None, name, getattr(self, name))
        ratios = self.compress_ratios
        require(isinstance(ratios, (list, tuple)),
                 f"compress_ratios must be a list of integers (one per layer), got "
                 f"{type(ratios).__name__} {ratios!r}")
        # JSON gives lists; keep the dataclass hashable and immutable.
        object.__setattr__(self, "compress_ratios",
                           tuple(check_int(None, f"compress_ratios[{i}]", r) for i, r in enumerate(ratios)))
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim",
                     "q_lora_rank", "window", "ffn_hidden", "max_position"):
            require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        require(len(self.compress_ratios) == self.num_layers,
                 f"compress_ratios has {len(self.compress_ratios)} entries but num_layers is "
                 f"{self.num_layers}; give one ratio per layer")
        for i, r in enumerate(self.compress_ratios):
            if self.allow_any_ratio:
                require(r >= 0, f"compress_ratios[{i}] = {r} must be >= 0")
            else:
                require(r in SUPPORTED_RATIOS,
                         f"compress_ratios[{i}] = {r} is not one of {SUPPORTED_RATIOS} "
                         "(set allow_any_ratio=true to use other ratios)")
        require(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
                 f"rope_dim must be even and in (0, head_dim={self.head_dim}], got {self.rope_dim}")
        if any(Compression.of(r).indexer for r in self.compress_ratios):
            require(self.index_num_heads > 0 and self.index_head_dim > 0,
                     "index_num_heads and index_head_dim must be positive when a layer has ratio 4")
            require(self.index_head_dim % 2 == 0 and self.index_head_dim >= self.rope_dim,
                     f"index_head_dim ({self.index_head_dim}) must be even and >= rope_dim "
                     f"({self.rope_dim}): the indexer applies RoPE to its last rope_dim dims")
            require(self.index_topk > 0, f"index_topk must be positive, got {self.index_topk}")
        require(self.num_mtp_layers in (0, 1), f"num_mtp_layers must be 0 or 1, got {self.num_mtp_layers}")
        require(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        require(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self, name)
            require(0 <= tid < self.vocab_size, f"{name} = {tid} is outside the vocabulary [0, {self.vocab_size})")
        self._check_v4_parts()
        # Derived once: each layer's compression, and the distinct compressed kinds.
        layers = tuple(Compression.of(r) for r in self.compress_ratios)
        object.__setattr__(self, "layer_compression", layers)
        object.__setattr__(self, "compressed_kinds",
                           tuple(sorted({c for c in layers if c.ratio > 0}, key=lambda c: c.ratio)))

    def _check_v4_parts(self) -> None:
        require(self.compress_rope_theta is None or self.compress_rope_theta > 0,
                 f"compress_rope_theta must be positive (or null for rope_theta), got {self.compress_rope_theta}")
        require(self.yarn_factor >= 1.0, f"yarn_factor must be >= 1 (1 = no YaRN), got {self.yarn_factor}")
        if self.yarn_factor > 1.0:
            require(self.yarn_original_max_position > 0,
                     "yarn_original_max_position must be positive when yarn_factor > 1")
            require(self.yarn_beta_fast > 0 and self.yarn_beta_slow > 0,
                     "yarn_beta_fast and yarn_beta_slow must be positive")
        require(self.o_groups >= 0, f"o_groups must be >= 0 (0 = one output projection), got {self.o_groups}")
        if self.o_groups > 0:
            require((self.num_heads * self.head_dim) % self.o_groups == 0,
                     f"o_groups ({self.o_groups}) must divide num_heads * head_dim "
                     f"({self.num_heads * self.head_dim})")
            require(self.o_lora_rank > 0, "o_lora_rank must be positive when o_groups > 0")
        require(self.hc_mult >= 0, f"hc_mult must be >= 0 (0 = plain residual), got {self.hc_mult}")
        require(self.hc_sinkhorn_iters >= 1, f"hc_sinkhorn_iters must be >= 1, got {self.hc_sinkhorn_iters}")
        require(self.hc_eps > 0, f"hc_eps must be positive, got {self.hc_eps}")
        require(self.swiglu_limit >= 0, f"swiglu_limit must be >= 0 (0 = no clamp), got {self.swiglu_limit}")
        require(self.num_experts >= 0, f"num_experts must be >= 0 (0 = dense SwiGLU), got {self.num_experts}")
        if self.num_experts == 0:
            require(self.num_hash_layers == 0, "num_hash_layers needs MoE layers (num_experts > 0)")
            return
        require(1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                 f"{self.num_experts_per_tok}")
        require(self.moe_hidden > 0, f"moe_hidden must be positive when num_experts > 0, got {self.moe_hidden}")
        require(self.num_shared_experts in (0, 1), f"num_shared_experts must be 0 or 1, got {self.num_shared_experts}")
        require(self.scoring_func in SCORING_FUNCS,
                 f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        require(self.routed_scaling_factor > 0,
                 f"routed_scaling_factor must be positive, got {self.routed_scaling_factor}")
        require(0 <= self.num_hash_layers <= self.num_layers,
                 f"num_hash_layers must be in [0, num_layers={self.num_layers}], got {self.num_hash_layers}")

    @property
    def has_indexer(self) -> bool:
        return any(c.indexer for c in self.compressed_kinds)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["architecture"] = "branchspec-v4"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        require(isinstance(d, dict),
                 f"a model config must be a JSON object (a dict), got {type(d).__name__}")
        d = dict(d)
        architecture = d.pop("architecture", "branchspec-v4")
        require(architecture == "branchspec-v4",
                 f"architecture is {architecture!r}; only 'branchspec-v4' checkpoints can be loaded")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(d) - known))
        require(not unknown, f"unknown model config keys: {unknown}")
        try:
            return cls(**d)
        except TypeError as e:  # wrong value types surface as TypeError in comparisons
            raise ConfigError(f"bad model config: {e}") from e

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    # The keys every branchspec config.json has held (`to_dict` writes all fields), and the
    # V4 parts' keys, added together: a file from before them names none of those, and their
    # defaults are that plain model; any other file naming only some of them lost the rest.
    _CORE_KEYS = ("vocab_size", "d_model", "num_layers", "compress_ratios", "num_heads", "head_dim", "rope_dim",
                  "q_lora_rank", "window", "index_num_heads", "index_head_dim", "index_topk", "ffn_hidden",
                  "max_position", "rope_theta", "norm_eps", "num_mtp_layers", "bos_token_id", "eos_token_id",
                  "pad_token_id")
    _V4_KEYS = ("compress_rope_theta", "yarn_factor", "yarn_original_max_position", "yarn_beta_fast",
                "yarn_beta_slow", "o_groups", "o_lora_rank", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "num_experts",
                "num_experts_per_tok", "num_shared_experts", "moe_hidden", "scoring_func", "norm_topk_prob",
                "routed_scaling_factor", "num_hash_layers", "swiglu_limit")

    @classmethod
    def missing_keys(cls, d: dict) -> list[str]:
        """The keys a config.json dict lacks that the model it describes needs: any of
        `_CORE_KEYS`, and of `_V4_KEYS` unless it names none (a plain model's, from before
        the V4 parts). Taking a default for them would build another model than the one
        the weights were trained as, without a word (a missing yarn_factor: no YaRN)."""
        missing = [k for k in cls._CORE_KEYS if k not in d]
        if any(k in d for k in cls._V4_KEYS):
            missing += [k for k in cls._V4_KEYS if k not in d]
        return missing

    @classmethod
    def load(cls, folder: str | Path) -> "ModelConfig":
        """Read `folder/config.json`; every ConfigError names that file, a missing key the
        model needs (`missing_keys`) included."""
        d = read_config_json(folder)
        try:
            config = cls.from_dict(d)
            missing = cls.missing_keys(d)
            require(not missing, f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing; "
                                 "branchspec writes every key, and a default would build another model than "
                                 "the one these weights belong to: restore the checkpoint's own values")
            return config
        except ConfigError as e:
            raise ConfigError(f"{Path(folder) / 'config.json'}: {e}") from e


def read_config_json(folder: str | Path) -> dict:
    """`folder/config.json` as a dict, whatever format it describes: FileNotFoundError when
    absent, ConfigError naming the file when it is not JSON or not a JSON object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {folder}")
    try:
        d = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
    require(isinstance(d, dict),
             f"{path} must hold a JSON object ({{\"vocab_size\": ..., ...}}), got a JSON "
             f"{_JSON_TYPE_NAMES.get(type(d), type(d).__name__)}")
    return d


def tiny_config(**overrides) -> ModelConfig:
    """A small model for unit tests: every mechanism present, ratios 4 and 128 real.

    Four layers cover window-only, C4 with indexer, and C128; the indexer's top-k is small
    so that it actually prunes in sequences of a few hundred tokens.
    """
    base = dict(vocab_size=64, d_model=32, num_layers=4, compress_ratios=(0, 4, 128, 4),
                num_heads=2, head_dim=16, rope_dim=8, q_lora_rank=16, window=8,
                index_num_heads=2, index_head_dim=8, index_topk=3, ffn_hidden=64,
                max_position=1024)
    base.update(overrides)
    return ModelConfig(**base)


def tiny_v4_config(**overrides) -> ModelConfig:
    """`tiny_config` with every part of the real architecture on: YaRN on the compressed
    layers, grouped output, 2 hyper-connection streams, MoE (4 experts, top 2, a hash
    layer first, a shared expert, the swiglu clamp)."""
    base = dict(compress_rope_theta=160000.0, yarn_factor=16.0, yarn_original_max_position=64,
                o_groups=2, o_lora_rank=8, hc_mult=2, hc_sinkhorn_iters=20,
                num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_hidden=24,
                scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_hash_layers=1,
                swiglu_limit=10.0)
    base.update(overrides)
    return tiny_config(**base)


def v4_mini_config(**overrides) -> ModelConfig:
    """The default model's shape: sized to train on two CPU cores in about an hour."""
    base = dict(vocab_size=8192, d_model=256, num_layers=6, compress_ratios=(0, 4, 128, 4, 128, 4),
                num_heads=4, head_dim=64, rope_dim=32, q_lora_rank=128, window=64,
                index_num_heads=4, index_head_dim=32, index_topk=32, ffn_hidden=1024,
                max_position=2048)
    base.update(overrides)
    return ModelConfig(**base)


def v4_mini_v2_config(**overrides) -> ModelConfig:
    """v4-mini in DeepSeek-V4's full architecture, sized to decode on a CPU at batch 1 within
    1.5x of v4-mini: YaRN on the compressed layers' RoPE, grouped output projection (2
    groups), two mHC streams, and a small MoE (4 routed experts, top 2, one shared expert,
    hash routing in the first layer, the swiglu clamp) in place of the dense FFN.

    Sinkhorn runs 4 iterations instead of V4's 20: with two streams the mixing matrix is
    2 x 2 and settles within a few, and at decode each iteration is six tensor ops at each
    of the 13 mHC sites.
    """
    base = dict(compress_rope_theta=160000.0, yarn_factor=16.0, yarn_original_max_position=128,
                o_groups=2, o_lora_rank=128, hc_mult=2, hc_sinkhorn_iters=4,
                num_experts=4, num_experts_per_tok=2, num_shared_experts=1, moe_hidden=256,
                scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_hash_layers=1,
                swiglu_limit=10.0)
    base.update(overrides)
    return v4_mini_config(**base)


# DeepSeek-V4-Flash: 43 layers, [0, 0, (4, 128) x 20, 4].
V4_FLASH_LAYERS = 43
V4_FLASH_PAIRS = 20


def v4_flash_slice_config(pairs: int = 1, **overrides) -> ModelConfig:
    """DeepSeek-V4-Flash's per-layer shapes at reduced depth, for measuring what its rounds
    cost (random weights; no checkpoint has this shape): the layer pattern [0, 0, (4, 128)
    x pairs, 4] and the MTP block, each layer exactly as wide as V4-Flash's (hidden 4096,
    64 query heads over one 512-wide KV head, rope 64, q_lora 1024, 8 output groups to
    o_lora 1024, window 128, a 64 x 128 indexer keeping 512 entries, 4 mHC streams, MoE of
    2048-wide experts, top 6, plus a shared one; vocabulary 129,280).

    What it changes (docs/results.md, "The paper's regime"): 6 routed experts instead of
    256, so every token runs all 6, as many as it would choose: a token's arithmetic is
    V4-Flash's, but a batch reads 6 experts' weights where V4-Flash's tokens, choosing
    among 256, read more the more tokens there are. No hash-routed layers (a routing
    rule, the same work). Positions up to 65,536.
    """
    require(isinstance(pairs, int) and not isinstance(pairs, bool) and pairs >= 0,
            f"pairs (of C4 and C128 layers) must be an integer >= 0, got {pairs!r}")
    base = dict(vocab_size=129280, d_model=4096, num_layers=3 + 2 * pairs,
                compress_ratios=(0, 0) + (4, 128) * pairs + (4,),
                num_heads=64, head_dim=512, rope_dim=64, q_lora_rank=1024, window=128,
                index_num_heads=64, index_head_dim=128, index_topk=512, ffn_hidden=2048,
                max_position=65536, rope_theta=10000.0, compress_rope_theta=160000.0,
                yarn_factor=16.0, yarn_original_max_position=65536,
                o_groups=8, o_lora_rank=1024, hc_mult=4, hc_sinkhorn_iters=20,
                num_experts=6, num_experts_per_tok=6, num_shared_experts=1, moe_hidden=2048,
                scoring_func="sqrtsoftplus", routed_scaling_factor=1.5, num_hash_layers=0,
                swiglu_limit=10.0)
    base.update(overrides)
    return ModelConfig(**base)
