"""Typed reads of a foreign config.json (Hugging Face's or DeepSeek's), and what the two
readers (``hf_config``, ``deepseek_config``) share: the MTP count, token ids, the legacy
per-layer ratios, the fields both spell alike, and validation that names the source key."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from branchspec.checkpoint.fp8 import FP8_BLOCK
from branchspec.config import ConfigError, ModelConfig, check_float, check_int

_MISSING = object()


# Defaults taken for these go unsaid: ids that name tokens, and the MTP count, which the
# weights settle (`read_num_mtp_layers`); neither changes the arithmetic.
_QUIET_DEFAULTS = ("bos_token_id", "eos_token_id", "pad_token_id", "num_nextn_predict_layers", "n_mtp_layers")


class Fields:
    """Typed reads of a foreign config dict; every error names the file and the key. The
    keys read with a default that were absent are kept (`defaulted`), for `warn_defaults`."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source
        self.defaulted: dict[str, object] = {}

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def raw(self, key: str, default=_MISSING):
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is _MISSING:
            raise self.error(f"{key} is missing; branchspec needs it to build the model")
        if key not in _QUIET_DEFAULTS:
            self.defaulted[key] = default
        return default

    def warn_defaults(self, who: str) -> None:
        """One warning naming every setting the config left out and the default taken
        for it: what `who` (transformers, DeepSeek's reference) would take too, but a real
        checkpoint whose config lost a key would otherwise compute another model unsaid."""
        if self.defaulted:
            import warnings

            taken = ", ".join(f"{k}={v!r}" for k, v in self.defaulted.items())
            warnings.warn(f"{self.source}: not given, so {who}'s defaults are taken: {taken}", stacklevel=3)

    def int(self, key: str, default=_MISSING) -> int:
        try:
            return check_int(None, key, self.raw(key, default))
        except ConfigError as e:
            raise self.error(str(e)) from None

    def float(self, key: str, default=_MISSING) -> float:
        try:
            return check_float(None, key, self.raw(key, default))
        except ConfigError as e:
            raise self.error(str(e)) from None

    def bool(self, key: str, default=_MISSING) -> bool:
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.error(f"{key} must be true or false, got {value!r}")
        return value

    def str(self, key: str, default=_MISSING) -> str:
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.error(f"{key} must be a string, got {type(value).__name__} {value!r}")
        return value

    def list(self, key: str, default=_MISSING) -> list:
        value = self.raw(key, default)
        if not isinstance(value, (list, tuple)):
            raise self.error(f"{key} must be a list, got {type(value).__name__} {value!r}")
        return list(value)


@dataclass(frozen=True)
class ConfigExtras:
    """What a foreign config says beyond ModelConfig's fields."""

    extra_stop_ids: tuple[int, ...] = ()     # eos ids after the first (HF eos lists)
    tie_word_embeddings: bool = False        # head.weight = embed.weight when absent
    fp8_block: tuple[int, int] = (FP8_BLOCK, FP8_BLOCK)
    fp4_experts: bool = False                # the config declares FP4 expert weights


def _has_mtp(tensor_names: Iterable[str] | None) -> bool | None:
    if tensor_names is None:
        return None
    return any(re.match(r"^(model\.)?mtp\.\d+\.", n) for n in tensor_names)


def read_num_mtp_layers(f: Fields, key: str, default: int, tensor_names) -> int:
    n = f.int(key, default)
    if n < 0:
        raise f.error(f"{key} must be >= 0, got {n}")
    if n > 1:
        raise f.error(f"{key} = {n}: branchspec drafts with one MTP layer (0 or 1 supported)")
    if n == 1 and _has_mtp(tensor_names) is False:
        return 0   # transformers' save_pretrained drops the MTP layer's tensors
    return n


def read_token_ids(f: Fields) -> tuple[dict, tuple[int, ...]]:
    """bos/eos/pad ids (HF defaults 0 and 1; pad falls back to eos) and extra stop ids."""
    bos = f.int("bos_token_id", 0)
    eos_raw = f.raw("eos_token_id", 1)
    if isinstance(eos_raw, (list, tuple)):
        if not eos_raw:
            raise f.error("eos_token_id is an empty list")
        try:
            eos_ids = [check_int(None, f"eos_token_id[{i}]", e) for i, e in enumerate(eos_raw)]
        except ConfigError as e:
            raise f.error(str(e)) from None
    else:
        eos_ids = [f.int("eos_token_id", 1)]
    pad = f.int("pad_token_id", eos_ids[0])
    extra = tuple(dict.fromkeys(e for e in eos_ids[1:] if e != eos_ids[0]))
    return dict(bos_token_id=bos, eos_token_id=eos_ids[0], pad_token_id=pad), extra


def read_legacy_ratios(f: Fields, key: str, num_layers: int, num_mtp: int) -> list[int]:
    raw = f.list(key)
    ratios = []
    for i, r in enumerate(raw):
        try:
            ratios.append(check_int(None, f"{key}[{i}]", r))
        except ConfigError as e:
            raise f.error(str(e)) from None
    # DeepSeek writes one more entry for each MTP layer; it must be 0 (sliding only).
    if len(ratios) > num_layers:
        tail = ratios[num_layers:]
        if len(tail) > max(num_mtp, 1) or any(tail):
            raise f.error(f"{key} has {len(ratios)} entries for {num_layers} layers; the entries after "
                          f"the last layer (MTP layers) must be 0, got {tail}")
        ratios = ratios[:num_layers]
    if len(ratios) != num_layers:
        raise f.error(f"{key} has {len(ratios)} entries but the model has {num_layers} layers")
    for i, r in enumerate(ratios):
        if r not in (0, 4, 128):
            raise f.error(f"{key}[{i}] = {r} is not one of (0, 4, 128)")
    return ratios


def checked_kwargs(f: Fields, kw: dict, origin: Mapping[str, str]) -> dict:
    """Build the ModelConfig once to validate; errors name the file and the source key."""
    try:
        ModelConfig(**kw)
    except ConfigError as e:
        message = str(e)
        field_name = re.match(r"[a-z_]+", message)
        hint = ""
        if field_name and field_name.group(0) in origin and origin[field_name.group(0)] != field_name.group(0):
            hint = f" (branchspec's {field_name.group(0)} is read from {origin[field_name.group(0)]})"
        raise f.error(message + hint) from None
    return kw


def read_shared_v4_fields(f: Fields, kw: dict) -> None:
    """The fields both formats spell alike: grouped output, hyper-connections, expert count."""
    kw["o_groups"] = f.int("o_groups")
    kw["o_lora_rank"] = f.int("o_lora_rank")
    kw["hc_mult"] = f.int("hc_mult")
    kw["hc_sinkhorn_iters"] = f.int("hc_sinkhorn_iters", 20)
    kw["hc_eps"] = f.float("hc_eps", 1e-6)
    kw["num_experts"] = f.int("n_routed_experts")
    if kw["num_experts"] < 1:
        raise f.error(f"n_routed_experts must be >= 1 (every DeepSeek-V4 layer is MoE), got {kw['num_experts']}")
