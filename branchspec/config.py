"""Frozen configuration dataclasses, validated at construction.

`ModelConfig` describes a V4-style model and round-trips through `config.json`.
`SpecConfig` holds SGLang's three speculative knobs. `SamplingParams` follows vLLM.
`EngineConfig` sizes the batch and the page pools.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import operator
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_RATIOS = (0, 4, 128)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


_JSON_TYPE_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
                    type(None): "null"}


def _config_int(name: str, value) -> int:
    """A ModelConfig integer as a plain int; ConfigError naming the field otherwise.

    Bools and floats are refused, 256.0 included: sizes written by `save` are always ints,
    so a float means a hand edit, and truncating 256.5 would build a different model.
    numpy integers are accepted (and stored as int, so the config stays JSON-serialisable).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        hint = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__} {value!r}{hint}")
    return int(value)


def _config_float(name: str, value) -> float:
    """A finite ModelConfig real number as a float (ints accepted, bools and NaN/inf refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        raise ConfigError(f"{name} must be a finite number, got an integer too large for a float") from None
    if not math.isfinite(value):  # json.loads accepts NaN and Infinity
        raise ConfigError(f"{name} must be a finite number, got {value}")
    return value


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

    Every bad value, a wrong type included (`ModelConfig(d_model="256")`, `d_model=256.0`,
    `num_layers=True`, NaN `rope_theta`), raises ConfigError (a ValueError) naming the
    field, never TypeError: a config is data, usually read from `config.json`, and one
    exception type covers it wherever it came from.
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
            object.__setattr__(self, name, _config_int(name, getattr(self, name)))
        for name in self._FLOAT_FIELDS:
            object.__setattr__(self, name, _config_float(name, getattr(self, name)))
        if self.compress_rope_theta is not None:
            object.__setattr__(self, "compress_rope_theta", _config_float("compress_rope_theta",
                                                                          self.compress_rope_theta))
        for name in ("allow_any_ratio", "norm_topk_prob"):
            _require(isinstance(getattr(self, name), bool),
                     f"{name} must be true or false, got {getattr(self, name)!r}")
        ratios = self.compress_ratios
        _require(isinstance(ratios, (list, tuple)),
                 f"compress_ratios must be a list of integers (one per layer), got "
                 f"{type(ratios).__name__} {ratios!r}")
        # JSON gives lists; keep the dataclass hashable and immutable.
        object.__setattr__(self, "compress_ratios",
                           tuple(_config_int(f"compress_ratios[{i}]", r) for i, r in enumerate(ratios)))
        for name in ("vocab_size", "d_model", "num_layers", "num_heads", "head_dim",
                     "q_lora_rank", "window", "ffn_hidden", "max_position"):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(len(self.compress_ratios) == self.num_layers,
                 f"compress_ratios has {len(self.compress_ratios)} entries but num_layers is "
                 f"{self.num_layers}; give one ratio per layer")
        for i, r in enumerate(self.compress_ratios):
            if self.allow_any_ratio:
                _require(r >= 0, f"compress_ratios[{i}] = {r} must be >= 0")
            else:
                _require(r in SUPPORTED_RATIOS,
                         f"compress_ratios[{i}] = {r} is not one of {SUPPORTED_RATIOS} "
                         "(set allow_any_ratio=true to use other ratios)")
        _require(self.rope_dim % 2 == 0 and 0 < self.rope_dim <= self.head_dim,
                 f"rope_dim must be even and in (0, head_dim={self.head_dim}], got {self.rope_dim}")
        if self.has_indexer:
            _require(self.index_num_heads > 0 and self.index_head_dim > 0,
                     "index_num_heads and index_head_dim must be positive when a layer has ratio 4")
            _require(self.index_head_dim % 2 == 0 and self.index_head_dim >= self.rope_dim,
                     f"index_head_dim ({self.index_head_dim}) must be even and >= rope_dim "
                     f"({self.rope_dim}): the indexer applies RoPE to its last rope_dim dims")
            _require(self.index_topk > 0, f"index_topk must be positive, got {self.index_topk}")
        _require(self.num_mtp_layers in (0, 1), f"num_mtp_layers must be 0 or 1, got {self.num_mtp_layers}")
        _require(self.norm_eps > 0, f"norm_eps must be positive, got {self.norm_eps}")
        _require(self.rope_theta > 0, f"rope_theta must be positive, got {self.rope_theta}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            tid = getattr(self, name)
            _require(0 <= tid < self.vocab_size, f"{name} = {tid} is outside the vocabulary [0, {self.vocab_size})")
        self._check_v4_parts()

    def _check_v4_parts(self) -> None:
        _require(self.compress_rope_theta is None or self.compress_rope_theta > 0,
                 f"compress_rope_theta must be positive (or null for rope_theta), got {self.compress_rope_theta}")
        _require(self.yarn_factor >= 1.0, f"yarn_factor must be >= 1 (1 = no YaRN), got {self.yarn_factor}")
        if self.yarn_factor > 1.0:
            _require(self.yarn_original_max_position > 0,
                     "yarn_original_max_position must be positive when yarn_factor > 1")
            _require(self.yarn_beta_fast > 0 and self.yarn_beta_slow > 0,
                     "yarn_beta_fast and yarn_beta_slow must be positive")
        _require(self.o_groups >= 0, f"o_groups must be >= 0 (0 = one output projection), got {self.o_groups}")
        if self.o_groups > 0:
            _require((self.num_heads * self.head_dim) % self.o_groups == 0,
                     f"o_groups ({self.o_groups}) must divide num_heads * head_dim "
                     f"({self.num_heads * self.head_dim})")
            _require(self.o_lora_rank > 0, "o_lora_rank must be positive when o_groups > 0")
        _require(self.hc_mult >= 0, f"hc_mult must be >= 0 (0 = plain residual), got {self.hc_mult}")
        _require(self.hc_sinkhorn_iters >= 1, f"hc_sinkhorn_iters must be >= 1, got {self.hc_sinkhorn_iters}")
        _require(self.hc_eps > 0, f"hc_eps must be positive, got {self.hc_eps}")
        _require(self.swiglu_limit >= 0, f"swiglu_limit must be >= 0 (0 = no clamp), got {self.swiglu_limit}")
        _require(self.num_experts >= 0, f"num_experts must be >= 0 (0 = dense SwiGLU), got {self.num_experts}")
        if self.num_experts == 0:
            _require(self.num_hash_layers == 0, "num_hash_layers needs MoE layers (num_experts > 0)")
            return
        _require(1 <= self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                 f"{self.num_experts_per_tok}")
        _require(self.moe_hidden > 0, f"moe_hidden must be positive when num_experts > 0, got {self.moe_hidden}")
        _require(self.num_shared_experts in (0, 1), f"num_shared_experts must be 0 or 1, got {self.num_shared_experts}")
        _require(self.scoring_func in SCORING_FUNCS,
                 f"scoring_func must be one of {SCORING_FUNCS}, got {self.scoring_func!r}")
        _require(self.routed_scaling_factor > 0,
                 f"routed_scaling_factor must be positive, got {self.routed_scaling_factor}")
        _require(0 <= self.num_hash_layers <= self.num_layers,
                 f"num_hash_layers must be in [0, num_layers={self.num_layers}], got {self.num_hash_layers}")

    @property
    def has_indexer(self) -> bool:
        return 4 in self.compress_ratios

    @property
    def num_streams(self) -> int:
        """Residual streams per token: hc_mult with hyper-connections, else 1."""
        return max(self.hc_mult, 1)

    @property
    def compressed_ratios(self) -> tuple[int, ...]:
        """The distinct nonzero ratios, in ascending order."""
        return tuple(sorted({r for r in self.compress_ratios if r > 0}))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["architecture"] = "branchspec-v4"
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        _require(isinstance(d, dict),
                 f"a model config must be a JSON object (a dict), got {type(d).__name__}")
        d = dict(d)
        architecture = d.pop("architecture", "branchspec-v4")
        _require(architecture == "branchspec-v4",
                 f"architecture is {architecture!r}; only 'branchspec-v4' checkpoints can be loaded")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(d) - known))
        _require(not unknown, f"unknown model config keys: {unknown}")
        try:
            return cls(**d)
        except TypeError as e:  # wrong value types surface as TypeError in comparisons
            raise ConfigError(f"bad model config: {e}") from e

    def save(self, folder: str | Path) -> None:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> "ModelConfig":
        """Read `folder/config.json`; every ConfigError names that file."""
        d = read_config_json(folder)
        try:
            return cls.from_dict(d)
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
    _require(isinstance(d, dict),
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


def check_int(owner: str, name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer argument (bools and floats refused, numpy integers accepted) within bounds.

    TypeError for the wrong type, ValueError for a value out of range; both name
    ``owner.name``. Returns the value as a plain int.
    """
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{owner}.{name} must be an integer, got {type(value).__name__} {value!r}")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}.{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}.{name} must be <= {maximum}, got {value}")
    return value


def check_float(owner: str, name: str, value) -> float:
    """A finite real number (ints accepted, bools refused); TypeError or ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
        raise TypeError(f"{owner}.{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{owner}.{name} must be finite, got {value}")
    return value


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding knobs, named as in SGLang.

    num_steps: draft depth; topk: branching per step (1 = chain);
    num_draft_tokens: verify budget D per sequence, the root included.
    """

    num_steps: int = 3
    topk: int = 2
    num_draft_tokens: int = 6

    def __post_init__(self) -> None:
        for name in ("num_steps", "topk", "num_draft_tokens"):
            object.__setattr__(self, name, check_int("SpecConfig", name, getattr(self, name), minimum=1))
        s, k, d = self.num_steps, self.topk, self.num_draft_tokens
        if d < 2:
            raise ValueError(f"SpecConfig.num_draft_tokens={d} leaves no draft token (the root counts as "
                             "one); use >= 2")
        # EAGLE-2 growth yields topk candidates at step 1 and topk^2 at every later step;
        # the best D-1 of them are kept, so there must be at least that many.
        max_candidates = k + (s - 1) * k * k
        if max_candidates < d - 1:
            need = 1 + -(-(d - 1 - k) // (k * k)) if d - 1 > k else 1
            raise ValueError(
                f"SpecConfig: num_steps={s}, topk={k} draft at most {max_candidates} candidates, fewer "
                f"than num_draft_tokens-1={d - 1}; use num_steps >= {need} or a larger topk")
        # Kept nodes are at most D-1 deep, so deeper steps would be drafted and thrown away.
        if s > d - 1:
            raise ValueError(f"SpecConfig.num_steps={s} exceeds num_draft_tokens-1={d - 1}, the deepest "
                             f"a kept node can be; use num_steps <= {d - 1}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    def check_model(self, vocab_size: int) -> None:
        """What only a model can tell: each step takes topk distinct tokens of the vocabulary."""
        if self.topk > vocab_size:
            raise ValueError(f"SpecConfig.topk={self.topk} exceeds the model's vocabulary of {vocab_size} "
                             f"tokens; use topk <= {vocab_size}")

    @classmethod
    def chain(cls, num_draft_tokens: int) -> "SpecConfig":
        d = check_int("SpecConfig", "num_draft_tokens", num_draft_tokens)
        if d < 2:
            raise ValueError(f"a chain needs num_draft_tokens >= 2 (the root plus at least one draft), "
                             f"got {num_draft_tokens!r}")
        return cls(num_steps=d - 1, topk=1, num_draft_tokens=d)


    @classmethod
    def auto(cls, candidates=None, *, max_draft_tokens: int = 8, decay: float = 0.9,
             prior_weight: float = 4.0) -> "AutoPolicy":
        """Adaptive speculation: before each round the engine picks, from `candidates`
        (SpecConfigs and None for plain decoding), the one with the most expected emitted
        tokens per second for the running batch. None takes `default_candidates`."""
        if candidates is None:
            candidates = default_candidates(max_draft_tokens)
        return AutoPolicy(candidates=tuple(candidates), decay=decay, prior_weight=prior_weight)


# Tree shapes (num_steps, topk) the default candidate set holds at each budget D >= 4: the
# study's default grid (bench/grid.py), so the policy can pick whatever a fixed run could.
AUTO_TREE_SHAPES = ((3, 2), (2, 3), (4, 2), (3, 3))


def default_candidates(max_draft_tokens: int = 8) -> tuple["SpecConfig | None", ...]:
    """No speculation, chains with D = 2..max_draft_tokens, and the trees of
    `AUTO_TREE_SHAPES` at every D from 4 up (those valid at that D)."""
    top = check_int("SpecConfig.auto", "max_draft_tokens", max_draft_tokens, minimum=2, maximum=16)
    out: list[SpecConfig | None] = [None] + [SpecConfig.chain(d) for d in range(2, top + 1)]
    for d in range(4, top + 1):
        for steps, topk in AUTO_TREE_SHAPES:
            try:
                out.append(SpecConfig(num_steps=steps, topk=topk, num_draft_tokens=d))
            except ValueError:
                pass
    return tuple(out)


def spec_label(spec: "SpecConfig | None") -> str:
    """A short, stable name: ``none``, ``chain D=5``, ``tree 3x2 D=6``."""
    if spec is None:
        return "none"
    if spec.is_chain:
        return f"chain D={spec.num_draft_tokens}"
    return f"tree {spec.num_steps}x{spec.topk} D={spec.num_draft_tokens}"


@dataclass(frozen=True)
class AutoPolicy:
    """Speculation chosen per round (`SpecConfig.auto`). See `spec/policy.py`.

    candidates: SpecConfigs, and None for a plain decode step; decay: how much of a
    request's acceptance history one of its rounds keeps (0.9: about the last ten rounds);
    prior_weight: how many of its own observations a request needs before they outweigh
    the engine-wide acceptance statistics it starts from.
    """

    candidates: tuple[SpecConfig | None, ...]
    decay: float = 0.9
    prior_weight: float = 4.0

    def __post_init__(self) -> None:
        own = "SpecConfig.auto"
        if not isinstance(self.candidates, tuple) or not self.candidates:
            raise ValueError(f"{own}: candidates must be a non-empty list of SpecConfig or None")
        for i, c in enumerate(self.candidates):
            if c is not None and not isinstance(c, SpecConfig):
                raise TypeError(f"{own}: candidates[{i}] must be a SpecConfig or None, got {type(c).__name__}")
        if len(set(self.candidates)) != len(self.candidates):
            raise ValueError(f"{own}: candidates hold duplicates")
        decay = check_float(own, "decay", self.decay)
        if not 0.0 < decay < 1.0:
            raise ValueError(f"{own}.decay must be in (0, 1), got {decay}")
        weight = check_float(own, "prior_weight", self.prior_weight)
        if weight <= 0.0:
            raise ValueError(f"{own}.prior_weight must be positive, got {weight}")
        object.__setattr__(self, "decay", decay)
        object.__setattr__(self, "prior_weight", weight)

    @property
    def speculative(self) -> tuple[SpecConfig, ...]:
        return tuple(c for c in self.candidates if c is not None)

    @property
    def max_draft_tokens(self) -> int:
        """The largest verify budget among the candidates (1: plain decoding only)."""
        return max((c.num_draft_tokens for c in self.speculative), default=1)

    def check_model(self, vocab_size: int) -> None:
        for c in self.speculative:
            c.check_model(vocab_size)


# Temperatures below this sample from a distribution indistinguishable from the argmax, and
# dividing logits by them overflows: they decode greedily (vLLM's rule).
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1   # the range torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as in vLLM. temperature 0 (or below 1e-5) means greedy.

    seed: None draws a fresh seed per request; an integer in [0, 2**64) makes the request
    reproducible whatever else runs in its batch. stop: strings that end the output, which
    is cut before the first one found (the stop string itself is not returned).

    logprobs: None (the default) returns none; k >= 0 returns, for every generated token, a
    {token_id: logprob} dict holding the chosen token and the k most likely ones (k or k + 1
    entries). prompt_logprobs: the same for every prompt token after the first (position 0
    gets None). Both are vLLM's default "raw" logprobs: log_softmax, in float64, of the
    target model's logits, before temperature and top-p; under speculation they come from the
    verify pass and equal plain decoding's. k may not exceed the model's vocabulary.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        own = "SamplingParams"
        temperature = check_float(own, "temperature", self.temperature)
        if temperature < 0.0:
            raise ValueError(f"{own}.temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = check_float(own, "top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"{own}.top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "max_tokens", check_int(own, "max_tokens", self.max_tokens, minimum=1))
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int(own, "seed", self.seed, minimum=0, maximum=MAX_SEED))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise TypeError(f"{own}.stop must be a string or a list of strings, got {type(stop).__name__}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise TypeError(f"{own}.stop[{i}] must be a string, got {type(s).__name__} {s!r}")
            if not s:
                raise ValueError(f"{own}.stop[{i}] is empty: stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"{own}.ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(own, name, getattr(self, name), minimum=0))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def sampling_temperature(self) -> float:
        """The temperature the sampler uses: 0.0 for greedy requests."""
        return 0.0 if self.greedy else self.temperature


def check_device(owner: str, value) -> str:
    """A device name the engine can run on, as given: "cpu", "cuda" or "cuda:N" (CUDA must
    be available and N one of its devices)."""
    if not isinstance(value, str):
        raise TypeError(f"{owner}.device must be a string such as 'cpu' or 'cuda', got {type(value).__name__}")
    import torch

    try:
        dev = torch.device(value)
    except RuntimeError:
        raise ValueError(f"{owner}.device={value!r} is not a device name; use 'cpu', 'cuda' or 'cuda:N'") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{owner}.device={value!r}: only 'cpu' and 'cuda' are supported")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{owner}.device={value!r} but CUDA is not available here "
                             f"(torch {torch.__version__}, torch.cuda.is_available() is False); use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{owner}.device={value!r} but this machine has {torch.cuda.device_count()} "
                             f"CUDA device(s)")
    return value


@dataclass(frozen=True)
class EngineConfig:
    """Batch and memory sizing. page_size counts slots (tokens or entries) per page.

    num_pages: pages per state kind ("raw", "buf4", "ent4", ...; the kinds a model has are
    checked when the engine is built); kinds not named get room for max_batch_size requests
    of max_model_len tokens.
    """

    max_batch_size: int = 64
    page_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position
    num_pages: dict = field(default_factory=dict)
    prefill_chunk_size: int = 256
    compile: bool = False             # the compiled fast path (engine/compiled.py); eager is the reference
    device: str = "cpu"               # "cpu", "cuda" or "cuda:N": where the model, its state and its steps run

    def __post_init__(self) -> None:
        own = "EngineConfig"
        for name in ("max_batch_size", "page_size", "prefill_chunk_size"):
            object.__setattr__(self, name, check_int(own, name, getattr(self, name), minimum=1))
        if self.max_model_len is not None:
            object.__setattr__(self, "max_model_len",
                               check_int(own, "max_model_len", self.max_model_len, minimum=1))
        if not isinstance(self.compile, bool):
            raise TypeError(f"{own}.compile must be a bool, got {type(self.compile).__name__}")
        object.__setattr__(self, "device", check_device(own, self.device))
        if not isinstance(self.num_pages, dict):
            raise TypeError(f"{own}.num_pages must be a dict of state kind -> page count, "
                            f"got {type(self.num_pages).__name__}")
        for kind, n in self.num_pages.items():
            if not isinstance(kind, str):
                raise TypeError(f"{own}.num_pages keys must be state kind names, got {kind!r}")
            check_int(own, f"num_pages[{kind!r}]", n, minimum=1)
