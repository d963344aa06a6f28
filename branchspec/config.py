"""Frozen configuration dataclasses, validated at construction.

`ModelConfig` describes a V4-style model and round-trips through `config.json`.
`SpecConfig` holds SGLang's three speculative knobs. `SamplingParams` follows vLLM.
`EngineConfig` sizes the batch and the page pools.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_RATIOS = (0, 4, 128)


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the field."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V4-style model, scaled down.

    Every layer has a sliding window over raw keys; layers with compress ratio 4 add the
    overlapping C4 compressor and a lightning indexer, layers with ratio 128 the C128
    compressor. `compress_ratios[l] == 0` means window only.
    """

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
    # Ratios outside {0, 4, 128} change the pooling schedule; only tests should need them.
    allow_any_ratio: bool = False

    def __post_init__(self) -> None:
        # JSON gives lists; keep the dataclass hashable and immutable.
        object.__setattr__(self, "compress_ratios", tuple(int(r) for r in self.compress_ratios))
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

    @property
    def has_indexer(self) -> bool:
        return 4 in self.compress_ratios

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
        d = dict(d)
        d.pop("architecture", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
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
        path = Path(folder) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {folder}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(d)


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


def v4_mini_config(**overrides) -> ModelConfig:
    """The default model's shape: sized to train on two CPU cores in about an hour."""
    base = dict(vocab_size=8192, d_model=256, num_layers=6, compress_ratios=(0, 4, 128, 4, 128, 4),
                num_heads=4, head_dim=64, rope_dim=32, q_lora_rank=128, window=64,
                index_num_heads=4, index_head_dim=32, index_topk=32, ffn_hidden=1024,
                max_position=2048)
    base.update(overrides)
    return ModelConfig(**base)


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
        s, k, d = self.num_steps, self.topk, self.num_draft_tokens
        for name, v in (("num_steps", s), ("topk", k), ("num_draft_tokens", d)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SpecConfig.{name} must be a positive integer, got {v!r}")
        if d < 2:
            raise ValueError(f"num_draft_tokens={d} leaves no draft token (the root counts as one); use >= 2")
        # EAGLE-2 growth yields topk candidates at step 1 and topk^2 at every later step;
        # the best D-1 of them are kept, so there must be at least that many.
        max_candidates = k + (s - 1) * k * k
        if max_candidates < d - 1:
            need = 1 + -(-(d - 1 - k) // (k * k)) if d - 1 > k else 1
            raise ValueError(
                f"num_steps={s}, topk={k} draft at most {max_candidates} candidates, fewer than "
                f"num_draft_tokens-1={d - 1}; use num_steps >= {need} or a larger topk")
        # Kept nodes are at most D-1 deep, so deeper steps would be drafted and thrown away.
        if s > d - 1:
            raise ValueError(f"num_steps={s} exceeds num_draft_tokens-1={d - 1}, the deepest a kept "
                             f"node can be; use num_steps <= {d - 1}")

    @property
    def is_chain(self) -> bool:
        return self.topk == 1

    @classmethod
    def chain(cls, num_draft_tokens: int) -> "SpecConfig":
        if not isinstance(num_draft_tokens, int) or num_draft_tokens < 2:
            raise ValueError(f"a chain needs num_draft_tokens >= 2 (the root plus at least one draft), "
                             f"got {num_draft_tokens!r}")
        return cls(num_steps=num_draft_tokens - 1, topk=1, num_draft_tokens=num_draft_tokens)


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as in vLLM. temperature 0 means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class EngineConfig:
    """Batch and memory sizing. page_size counts slots (tokens or entries) per page."""

    max_batch_size: int = 64
    page_size: int = 16
    max_model_len: int | None = None  # default: the model's max_position
    num_pages: dict = field(default_factory=dict)  # per state kind; default sized for max_batch_size
    prefill_chunk_size: int = 256

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None for the model's max_position), "
                             f"got {self.max_model_len}")
        if self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
