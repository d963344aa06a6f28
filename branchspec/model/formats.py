"""How other checkpoint formats map onto branchspec's.

Three folder formats are read, told apart by their ``config.json``:

- **branchspec**: ``"architecture": "branchspec-v4"`` (or no marker of another format);
  tensors already carry branchspec's names.
- **Hugging Face** (transformers' ``deepseek_v4``): ``"model_type": "deepseek_v4"``. Its
  tensors come in any of three spellings, all read: transformers' module names
  (``model.layers.0.self_attn.q_a_proj.weight``, ``mlp.experts.gate_up_proj``), what
  ``save_pretrained`` writes by default (DeepSeek's names under ``model.``, experts one by
  one, the attention's kv norm as ``attn.norm``), and DeepSeek's own names (hub releases).
- **DeepSeek original** (``inference/model.py``): a config.json of ``ModelArgs`` keys
  (``dim``, ``n_layers``, ...) beside ``model*-mp1.safetensors``-style files.

Weights are ``model.safetensors``, or ``model.safetensors.index.json`` and its shards, or
any ``*.safetensors`` in the folder, opened lazily (``SafetensorsFolder``). Block-FP8
weights (float8_e4m3fn with a ``.scale`` or ``.weight_scale_inv`` companion, one scale
per 128x128 block) are dequantised at load; FP4 expert weights are refused.

The mapping works on plain dicts of tensors (``to_branchspec_tensors``) and on the names
and shapes of branchspec's state_dict (``expected_shapes``), so it needs no model.
RoPE needs no permutation: HF, DeepSeek and branchspec all rotate the trailing
``rope_dim`` channels in interleaved pairs.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from branchspec.config import ConfigError, ModelConfig, _config_float, _config_int, read_config_json

FORMAT_BRANCHSPEC = "branchspec"
FORMAT_HF = "huggingface"
FORMAT_DEEPSEEK = "deepseek"
FORMATS = (FORMAT_BRANCHSPEC, FORMAT_HF, FORMAT_DEEPSEEK)

HF_MODEL_TYPE = "deepseek_v4"
FP8_BLOCK = 128

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files `convert` carries over beside the weights (the tokenizer and HF's generation
# defaults, whose eos list the foreign tokenizer reads).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


# -- folder and config.json ---------------------------------------------------------------


def config_format(d: dict) -> str:
    """Which format a parsed config.json belongs to; ConfigError for a foreign model type."""
    if "architecture" in d:
        return FORMAT_BRANCHSPEC     # ModelConfig refuses a wrong architecture by name
    model_type = d.get("model_type")
    if model_type == HF_MODEL_TYPE or (model_type is None and d.get("architectures") == ["DeepseekV4ForCausalLM"]):
        return FORMAT_HF
    if model_type is not None:
        raise ConfigError(f"config.json: model_type {model_type!r} is not supported; branchspec reads "
                          f"Hugging Face {HF_MODEL_TYPE!r} folders, DeepSeek's original V4 folders and "
                          "its own ('architecture': 'branchspec-v4')")
    if "dim" in d and "n_layers" in d:
        return FORMAT_DEEPSEEK
    return FORMAT_BRANCHSPEC


def detect_format(folder: str | Path) -> str:
    """``"branchspec"``, ``"huggingface"`` or ``"deepseek"``, from ``folder/config.json``."""
    d = read_config_json(folder)
    try:
        return config_format(d)
    except ConfigError as e:
        raise ConfigError(f"{Path(folder) / 'config.json'}{str(e)[len('config.json'):]}") from None


# -- config mapping -----------------------------------------------------------------------

_MISSING = object()


class _Fields:
    """Typed reads of a foreign config dict; every error names the file and the key."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def error(self, message: str) -> ConfigError:
        return ConfigError(f"{self.source}: {message}")

    def raw(self, key: str, default=_MISSING):
        if key in self.d and self.d[key] is not None:
            return self.d[key]
        if default is _MISSING:
            raise self.error(f"{key} is missing; branchspec needs it to build the model")
        return default

    def int(self, key: str, default=_MISSING) -> int:
        try:
            return _config_int(key, self.raw(key, default))
        except ConfigError as e:
            raise self.error(str(e)) from None

    def float(self, key: str, default=_MISSING) -> float:
        try:
            return _config_float(key, self.raw(key, default))
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


def _num_mtp_layers(f: _Fields, key: str, default: int, tensor_names) -> int:
    n = f.int(key, default)
    if n < 0:
        raise f.error(f"{key} must be >= 0, got {n}")
    if n > 1:
        raise f.error(f"{key} = {n}: branchspec drafts with one MTP layer (0 or 1 supported)")
    if n == 1 and _has_mtp(tensor_names) is False:
        return 0   # transformers' save_pretrained drops the MTP layer's tensors
    return n


def _token_ids(f: _Fields) -> tuple[dict, tuple[int, ...]]:
    """bos/eos/pad ids (HF defaults 0 and 1; pad falls back to eos) and extra stop ids."""
    bos = f.int("bos_token_id", 0)
    eos_raw = f.raw("eos_token_id", 1)
    if isinstance(eos_raw, (list, tuple)):
        if not eos_raw:
            raise f.error("eos_token_id is an empty list")
        try:
            eos_ids = [_config_int(f"eos_token_id[{i}]", e) for i, e in enumerate(eos_raw)]
        except ConfigError as e:
            raise f.error(str(e)) from None
    else:
        eos_ids = [f.int("eos_token_id", 1)]
    pad = f.int("pad_token_id", eos_ids[0])
    extra = tuple(dict.fromkeys(e for e in eos_ids[1:] if e != eos_ids[0]))
    return dict(bos_token_id=bos, eos_token_id=eos_ids[0], pad_token_id=pad), extra


def _check_rope_dim(f: _Fields, head_dim: int, rope_dim_exact: float, key: str) -> int:
    rope_dim = int(round(rope_dim_exact))
    if abs(rope_dim - rope_dim_exact) > 1e-6 or rope_dim <= 0 or rope_dim % 2:
        raise f.error(f"{key} gives {rope_dim_exact:g} rotary channels of head_dim {head_dim}; "
                      "it must be a positive even integer")
    return rope_dim


def _hf_rope(f: _Fields, kw: dict) -> None:
    """rope_theta, compress_rope_theta and the YaRN fields from HF's rope parameters."""
    d = f.d
    rope_theta = f.float("rope_theta", 10000.0)
    compress_theta = f.float("compress_rope_theta", 160000.0)
    params = d.get("rope_parameters")
    key = "rope_parameters"
    if params is None and d.get("rope_scaling") is not None:
        params, key = d["rope_scaling"], "rope_scaling"
    compress: dict = {}
    nested = False
    if params is not None:
        if not isinstance(params, dict):
            raise f.error(f"{key} must be an object, got {type(params).__name__}")
        if isinstance(params.get("main"), dict) or isinstance(params.get("compress"), dict):
            nested = True
            main = params.get("main") or {}
            compress = params.get("compress") or {}
            if not isinstance(main, dict) or not isinstance(compress, dict):
                raise f.error(f"{key}.main and {key}.compress must be objects")
            main_type = main.get("rope_type", main.get("type", "default"))
            if main_type != "default":
                raise f.error(f"{key}.main.rope_type is {main_type!r}; branchspec's sliding-window layers "
                              "use plain RoPE ('default')")
            if main.get("rope_theta") is not None:
                rope_theta = _Fields(main, f"{f.source}: {key}.main").float("rope_theta")
            if compress.get("rope_theta") is not None:
                compress_theta = _Fields(compress, f"{f.source}: {key}.compress").float("rope_theta")
        else:
            compress = {k: v for k, v in params.items() if k not in ("main", "compress")}
    ckey = f"{key}.compress" if nested else key
    rope_type = compress.get("rope_type", compress.get("type", "default"))
    kw["rope_theta"] = rope_theta
    kw["compress_rope_theta"] = compress_theta
    if rope_type == "default":
        return
    if rope_type != "yarn":
        raise f.error(f"{ckey}.rope_type is {rope_type!r}; branchspec supports 'default' and 'yarn'")
    c = _Fields(compress, f"{f.source}: {ckey}")
    # transformers' V4 config sets attention_factor = 1 (the reference does not scale cos/sin
    # by YaRN's mscale) when it builds the nested form itself; a nested dict without it
    # would get the derived 0.1 ln(factor) + 1.
    if compress.get("attention_factor") is not None:
        attention_factor = c.float("attention_factor")
    else:
        attention_factor = None if nested else 1.0
    if attention_factor is None or abs(attention_factor - 1.0) > 1e-12:
        shown = "missing (transformers would derive 0.1 * ln(factor) + 1)" if attention_factor is None \
            else f"{attention_factor:g}"
        raise f.error(f"{ckey}.attention_factor is {shown}; branchspec, like DeepSeek-V4, uses 1 "
                      "(no YaRN attention scaling)")
    if compress.get("truncate", True) is not True:
        raise f.error(f"{ckey}.truncate must be true (branchspec rounds YaRN's correction range, as "
                      "DeepSeek does)")
    original = c.int("original_max_position_embeddings")
    factor = c.float("factor", None) if compress.get("factor") is not None else None
    if factor is None:
        factor = kw["max_position"] / original
    kw["yarn_factor"] = factor
    kw["yarn_original_max_position"] = original
    kw["yarn_beta_fast"] = c.float("beta_fast", 32.0)
    kw["yarn_beta_slow"] = c.float("beta_slow", 1.0)


_HF_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": 4,
                   "heavily_compressed_attention": 128}


def _hf_ratios(f: _Fields, num_layers: int, num_mtp: int) -> list[int]:
    if f.d.get("layer_types") is not None:
        types = f.list("layer_types")
        rates = f.d.get("compress_rates") or {}
        if not isinstance(rates, dict):
            raise f.error(f"compress_rates must be an object, got {type(rates).__name__}")
        ratios = []
        for i, t in enumerate(types[:num_layers]):
            if t not in _HF_LAYER_TYPES:
                raise f.error(f"layer_types[{i}] = {t!r} is not one of {sorted(_HF_LAYER_TYPES)}")
            if t == "sliding_attention":
                ratios.append(0)
                continue
            want = _HF_LAYER_TYPES[t]
            rate = rates.get(t, want)
            if rate != want:
                raise f.error(f"compress_rates[{t!r}] = {rate!r}: branchspec builds "
                              f"{t} (overlapping={want == 4}) only with ratio {want}")
            ratios.append(want)
        if len(ratios) != num_layers:
            raise f.error(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
        return ratios
    if f.d.get("compress_ratios") is not None:
        return _legacy_ratios(f, "compress_ratios", num_layers, num_mtp)
    raise f.error("layer_types (or legacy compress_ratios) is missing; branchspec needs the per-layer "
                  "attention schedule")


def _legacy_ratios(f: _Fields, key: str, num_layers: int, num_mtp: int) -> list[int]:
    raw = f.list(key)
    ratios = []
    for i, r in enumerate(raw):
        try:
            ratios.append(_config_int(f"{key}[{i}]", r))
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


def _hf_hash_layers(f: _Fields, num_layers: int) -> int:
    if f.d.get("mlp_layer_types") is not None:
        types = f.list("mlp_layer_types")[:num_layers]
        for i, t in enumerate(types):
            if t not in ("hash_moe", "moe"):
                raise f.error(f"mlp_layer_types[{i}] = {t!r} is not 'hash_moe' or 'moe'")
        n_hash = 0
        while n_hash < len(types) and types[n_hash] == "hash_moe":
            n_hash += 1
        if "hash_moe" in types[n_hash:]:
            raise f.error(f"mlp_layer_types must start with its 'hash_moe' layers, then only 'moe': "
                          f"layer {types.index('hash_moe', n_hash)} is 'hash_moe' after a 'moe' layer")
        return n_hash
    # transformers' default: 3 hash layers (capped at the layer count)
    return min(f.int("num_hash_layers", 3), num_layers)


def _finish(f: _Fields, kw: dict, origin: Mapping[str, str]) -> dict:
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


_HF_ORIGIN = {"vocab_size": "vocab_size", "d_model": "hidden_size", "num_layers": "num_hidden_layers",
              "num_heads": "num_attention_heads", "head_dim": "head_dim",
              "rope_dim": "partial_rotary_factor * head_dim", "q_lora_rank": "q_lora_rank",
              "window": "sliding_window", "index_num_heads": "index_n_heads", "index_head_dim": "index_head_dim",
              "index_topk": "index_topk", "ffn_hidden": "moe_intermediate_size", "moe_hidden": "moe_intermediate_size",
              "max_position": "max_position_embeddings", "norm_eps": "rms_norm_eps",
              "num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts",
              "num_hash_layers": "mlp_layer_types", "compress_ratios": "layer_types",
              "num_mtp_layers": "num_nextn_predict_layers", "yarn_factor": "rope_parameters.compress.factor",
              "yarn_original_max_position": "rope_parameters.compress.original_max_position_embeddings",
              "bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "pad_token_id": "pad_token_id"}


def _shared_v4_fields(f: _Fields, kw: dict) -> None:
    """The fields both formats spell alike: grouped output, hyper-connections, expert count."""
    kw["o_groups"] = f.int("o_groups")
    kw["o_lora_rank"] = f.int("o_lora_rank")
    kw["hc_mult"] = f.int("hc_mult")
    kw["hc_sinkhorn_iters"] = f.int("hc_sinkhorn_iters", 20)
    kw["hc_eps"] = f.float("hc_eps", 1e-6)
    kw["num_experts"] = f.int("n_routed_experts")
    if kw["num_experts"] < 1:
        raise f.error(f"n_routed_experts must be >= 1 (every DeepSeek-V4 layer is MoE), got {kw['num_experts']}")


def _hf_config(d: dict, source: str = "config.json",
               tensor_names: Iterable[str] | None = None) -> tuple[dict, ConfigExtras]:
    f = _Fields(d, source)
    if d.get("model_type", HF_MODEL_TYPE) != HF_MODEL_TYPE:
        raise f.error(f"model_type is {d.get('model_type')!r}, not {HF_MODEL_TYPE!r}")
    for key, want in (("num_key_value_heads", 1), ("attention_bias", False), ("mlp_bias", False),
                      ("hidden_act", "silu")):
        if key in d and d[key] != want:
            raise f.error(f"{key} = {d[key]!r} is not supported (DeepSeek-V4 uses {want!r})")
    kw: dict = {}
    kw["vocab_size"] = f.int("vocab_size")
    kw["d_model"] = f.int("hidden_size")
    kw["num_layers"] = num_layers = f.int("num_hidden_layers")
    kw["num_heads"] = f.int("num_attention_heads")
    kw["head_dim"] = head_dim = f.int("head_dim")
    if d.get("partial_rotary_factor") is not None:
        kw["rope_dim"] = _check_rope_dim(f, head_dim, head_dim * f.float("partial_rotary_factor"),
                                         "partial_rotary_factor")
    elif d.get("qk_rope_head_dim") is not None:
        kw["rope_dim"] = f.int("qk_rope_head_dim")
    else:
        raise f.error("partial_rotary_factor (or legacy qk_rope_head_dim) is missing; branchspec needs "
                      "the rotary width")
    kw["q_lora_rank"] = f.int("q_lora_rank")
    kw["window"] = f.int("sliding_window")
    kw["index_num_heads"] = f.int("index_n_heads")
    kw["index_head_dim"] = f.int("index_head_dim")
    kw["index_topk"] = f.int("index_topk")
    kw["moe_hidden"] = f.int("moe_intermediate_size")
    kw["ffn_hidden"] = kw["moe_hidden"]          # placeholder: no dense FFN with experts
    kw["max_position"] = f.int("max_position_embeddings")
    kw["norm_eps"] = f.float("rms_norm_eps", 1e-6)
    kw["num_mtp_layers"] = _num_mtp_layers(f, "num_nextn_predict_layers", 1, tensor_names)
    kw["compress_ratios"] = _hf_ratios(f, num_layers, kw["num_mtp_layers"])
    _hf_rope(f, kw)
    _shared_v4_fields(f, kw)
    kw["num_experts_per_tok"] = f.int("num_experts_per_tok")
    n_shared = f.int("n_shared_experts", 1)
    if n_shared != 1:
        raise f.error(f"n_shared_experts = {n_shared}: transformers' DeepseekV4 (and branchspec) build "
                      "exactly one shared expert")
    kw["num_shared_experts"] = 1
    kw["scoring_func"] = f.str("scoring_func", "sqrtsoftplus")
    kw["norm_topk_prob"] = f.bool("norm_topk_prob", True)
    kw["routed_scaling_factor"] = f.float("routed_scaling_factor", 1.5)
    kw["num_hash_layers"] = _hf_hash_layers(f, num_layers)
    kw["swiglu_limit"] = f.float("swiglu_limit", 10.0)
    ids, extra = _token_ids(f)
    kw.update(ids)
    tie = f.bool("tie_word_embeddings", False)
    block, fp4 = _hf_quantization(f)
    return _finish(f, kw, _HF_ORIGIN), ConfigExtras(extra, tie, block, fp4)


def _hf_quantization(f: _Fields) -> tuple[tuple[int, int], bool]:
    q = f.d.get("quantization_config")
    fp4 = f.d.get("expert_dtype") == "fp4"
    if q is None:
        return (FP8_BLOCK, FP8_BLOCK), fp4
    if not isinstance(q, dict):
        raise f.error(f"quantization_config must be an object, got {type(q).__name__}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise f.error(f"quantization_config.quant_method is {method!r}; branchspec dequantises block "
                      "FP8 only")
    block = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise f.error(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    return (block[0], block[1]), fp4 or q.get("expert_dtype") == "fp4"


def hf_config_to_branchspec(d: dict, *, source: str = "config.json",
                            tensor_names: Iterable[str] | None = None) -> dict:
    """ModelConfig kwargs for a Hugging Face ``deepseek_v4`` config.json dict.

    ``tensor_names`` (the checkpoint's tensor names), when given, sets num_mtp_layers to 0
    if no ``mtp.*`` tensor is present (transformers' save_pretrained drops them). The
    eos ids after the first and ``tie_word_embeddings`` are in ``hf_config_extras``.

    Sizes and the layer schedule must be present; a missing behaviour setting (norm eps,
    routing, Sinkhorn iterations, token ids, the hash-layer count, ...) takes
    ``DeepseekV4Config``'s default, as transformers would. Legacy keys (compress_ratios,
    num_hash_layers, qk_rope_head_dim, rope_scaling) are read like their modern forms.
    ConfigError naming ``source`` and the key for anything missing or unsupported.
    """
    return _hf_config(d, source, tensor_names)[0]


def hf_config_extras(d: dict, *, source: str = "config.json") -> ConfigExtras:
    """Extra stop ids (an eos list's tail), tie_word_embeddings and FP8 block size."""
    return _hf_config(d, source)[1]


_DS_ORIGIN = {"vocab_size": "vocab_size", "d_model": "dim", "num_layers": "n_layers", "num_heads": "n_heads",
              "head_dim": "head_dim", "rope_dim": "rope_head_dim", "q_lora_rank": "q_lora_rank",
              "window": "window_size", "index_num_heads": "index_n_heads", "index_head_dim": "index_head_dim",
              "index_topk": "index_topk", "ffn_hidden": "moe_inter_dim", "moe_hidden": "moe_inter_dim",
              "max_position": "max_seq_len", "norm_eps": "norm_eps", "num_experts": "n_routed_experts",
              "num_experts_per_tok": "n_activated_experts", "num_shared_experts": "n_shared_experts",
              "num_hash_layers": "n_hash_layers", "num_mtp_layers": "n_mtp_layers",
              "scoring_func": "score_func", "routed_scaling_factor": "route_scale",
              "yarn_factor": "rope_factor", "yarn_original_max_position": "original_seq_len",
              "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def _deepseek_config(d: dict, source: str = "config.json",
                     tensor_names: Iterable[str] | None = None) -> tuple[dict, ConfigExtras]:
    f = _Fields(d, source)
    kw: dict = {}
    kw["vocab_size"] = f.int("vocab_size")
    kw["d_model"] = f.int("dim")
    kw["num_layers"] = num_layers = f.int("n_layers")
    kw["num_heads"] = f.int("n_heads")
    kw["head_dim"] = f.int("head_dim")
    kw["rope_dim"] = f.int("rope_head_dim")
    kw["q_lora_rank"] = f.int("q_lora_rank")
    kw["window"] = f.int("window_size")
    kw["index_num_heads"] = f.int("index_n_heads")
    kw["index_head_dim"] = f.int("index_head_dim")
    kw["index_topk"] = f.int("index_topk")
    kw["moe_hidden"] = f.int("moe_inter_dim")
    kw["ffn_hidden"] = kw["moe_hidden"]
    kw["max_position"] = f.int("max_seq_len", 4096)
    kw["norm_eps"] = f.float("norm_eps", 1e-6)
    kw["num_mtp_layers"] = _num_mtp_layers(f, "n_mtp_layers", 1, tensor_names)
    kw["compress_ratios"] = _legacy_ratios(f, "compress_ratios", num_layers, f.int("n_mtp_layers", 1))
    kw["rope_theta"] = f.float("rope_theta", 10000.0)
    kw["compress_rope_theta"] = f.float("compress_rope_theta", 40000.0)
    original = f.int("original_seq_len", 0)
    if original > 0:   # DeepSeek applies YaRN to compressed layers iff original_seq_len > 0
        kw["yarn_factor"] = f.float("rope_factor", 40.0)
        kw["yarn_original_max_position"] = original
        kw["yarn_beta_fast"] = f.float("beta_fast", 32.0)
        kw["yarn_beta_slow"] = f.float("beta_slow", 1.0)
    _shared_v4_fields(f, kw)
    kw["num_experts_per_tok"] = f.int("n_activated_experts")
    kw["num_shared_experts"] = f.int("n_shared_experts", 1)
    kw["scoring_func"] = f.str("score_func", "sqrtsoftplus")
    # DeepSeek's Gate renormalises the top-k weights for every score function but softmax.
    kw["norm_topk_prob"] = kw["scoring_func"] != "softmax"
    kw["routed_scaling_factor"] = f.float("route_scale", 1.0)
    kw["num_hash_layers"] = f.int("n_hash_layers", 0)
    kw["swiglu_limit"] = f.float("swiglu_limit", 0.0)
    ids, extra = _token_ids(f)
    kw.update(ids)
    fp4 = d.get("expert_dtype") == "fp4"
    return _finish(f, kw, _DS_ORIGIN), ConfigExtras(extra, False, (FP8_BLOCK, FP8_BLOCK), fp4)


def deepseek_config_to_branchspec(d: dict, *, source: str = "config.json",
                                  tensor_names: Iterable[str] | None = None) -> dict:
    """ModelConfig kwargs for DeepSeek's original ``ModelArgs`` config.json dict.

    Keys DeepSeek's ``ModelArgs`` gives defaults for (norm_eps, route_scale, n_hash_layers,
    the YaRN keys, ...) take those defaults; sizes must be present. ``compress_ratios`` may
    hold one trailing 0 for the MTP layer. Token ids are ``bos_token_id``/``eos_token_id``
    when present, else 0 and 1 (DeepSeek's tokenizer).
    """
    return _deepseek_config(d, source, tensor_names)[0]


# -- branchspec's state_dict --------------------------------------------------------------


def _block_shapes(cfg: ModelConfig, prefix: str, ratio: int, hash_layer: bool) -> dict[str, tuple[int, ...]]:
    d, H, dh, q = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank
    s: dict[str, tuple[int, ...]] = {}
    n = cfg.hc_mult
    if n > 0:
        for part in ("attn", "ffn"):
            s[f"{prefix}.hc_{part}_fn"] = ((2 + n) * n, n * d)
            s[f"{prefix}.hc_{part}_base"] = ((2 + n) * n,)
            s[f"{prefix}.hc_{part}_scale"] = (3,)
    s[f"{prefix}.attn_norm.weight"] = (d,)
    a = f"{prefix}.attn"
    s[f"{a}.attn_sink"] = (H,)
    s[f"{a}.wq_a.weight"] = (q, d)
    s[f"{a}.q_norm.weight"] = (q,)
    s[f"{a}.wq_b.weight"] = (H * dh, q)
    s[f"{a}.wkv.weight"] = (dh, d)
    s[f"{a}.kv_norm.weight"] = (dh,)
    if cfg.o_groups > 0:
        g, r = cfg.o_groups, cfg.o_lora_rank
        s[f"{a}.wo_a.weight"] = (g * r, H * dh // g)
        s[f"{a}.wo_b.weight"] = (d, g * r)
    else:
        s[f"{a}.wo.weight"] = (d, H * dh)
    if ratio > 0:
        c = 2 if ratio == 4 else 1
        s[f"{a}.compressor.ape"] = (ratio, c * dh)
        s[f"{a}.compressor.wkv.weight"] = (c * dh, d)
        s[f"{a}.compressor.wgate.weight"] = (c * dh, d)
        s[f"{a}.compressor.norm.weight"] = (dh,)
    if ratio == 4:
        hi, di = cfg.index_num_heads, cfg.index_head_dim
        s[f"{a}.indexer.wq_b.weight"] = (hi * di, q)
        s[f"{a}.indexer.weights_proj.weight"] = (hi, d)
        s[f"{a}.indexer.compressor.ape"] = (4, 2 * di)
        s[f"{a}.indexer.compressor.wkv.weight"] = (2 * di, d)
        s[f"{a}.indexer.compressor.wgate.weight"] = (2 * di, d)
        s[f"{a}.indexer.compressor.norm.weight"] = (di,)
    s[f"{prefix}.ffn_norm.weight"] = (d,)
    m = f"{prefix}.ffn"
    if cfg.num_experts == 0:
        s[f"{m}.w1.weight"] = (cfg.ffn_hidden, d)
        s[f"{m}.w2.weight"] = (d, cfg.ffn_hidden)
        s[f"{m}.w3.weight"] = (cfg.ffn_hidden, d)
        return s
    E, k, i = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_hidden
    s[f"{m}.gate.weight"] = (E, d)
    if hash_layer:
        s[f"{m}.gate.tid2eid"] = (cfg.vocab_size, k)
    else:
        s[f"{m}.gate.bias"] = (E,)
    s[f"{m}.experts.w1"] = (E, i, d)
    s[f"{m}.experts.w2"] = (E, d, i)
    s[f"{m}.experts.w3"] = (E, i, d)
    if cfg.num_shared_experts == 1:
        s[f"{m}.shared_experts.w1.weight"] = (i, d)
        s[f"{m}.shared_experts.w2.weight"] = (d, i)
        s[f"{m}.shared_experts.w3.weight"] = (i, d)
    return s


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of branchspec's state_dict for ``cfg``, without building a model.

    Integer tensors (``*.gate.tid2eid``) are told by ``is_integer_tensor``.
    """
    d, V, n = cfg.d_model, cfg.vocab_size, cfg.hc_mult
    s: dict[str, tuple[int, ...]] = {"embed.weight": (V, d), "norm.weight": (d,), "head.weight": (V, d)}
    if n > 0:
        s.update({"hc_head_fn": (n, n * d), "hc_head_base": (n,), "hc_head_scale": (1,)})
    for layer, ratio in enumerate(cfg.compress_ratios):
        s.update(_block_shapes(cfg, f"layers.{layer}", ratio, layer < cfg.num_hash_layers))
    if cfg.num_mtp_layers:
        p = "mtp.0"
        s.update({f"{p}.e_proj.weight": (d, d), f"{p}.h_proj.weight": (d, d), f"{p}.enorm.weight": (d,),
                  f"{p}.hnorm.weight": (d,), f"{p}.norm.weight": (d,)})
        if n > 0:
            s.update({f"{p}.hc_head_fn": (n, n * d), f"{p}.hc_head_base": (n,), f"{p}.hc_head_scale": (1,)})
        s.update(_block_shapes(cfg, p, 0, False))
    return s


def is_integer_tensor(name: str) -> bool:
    """Whether branchspec keeps this tensor as integers (the hash routing table)."""
    return name.endswith(".gate.tid2eid")


# -- tensor names -------------------------------------------------------------------------

# Foreign spellings -> branchspec's (DeepSeek's), applied in order to the whole name after
# a leading "model." is dropped. Per-expert and packed expert tensors are handled apart.
_RENAMES: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.q_a_proj\.", ".attn.wq_a."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.attn\.norm\.", ".attn.kv_norm."),        # save_pretrained's reverse of kv_norm
    (r"\.attn\.o_a_proj\.", ".attn.wo_a."),
    (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.o_proj\.", ".attn.wo."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.(shared_experts|experts\.\d+|ffn)\.gate_proj\.", r".\1.w1."),
    (r"\.(shared_experts|experts\.\d+|ffn)\.up_proj\.", r".\1.w3."),
    (r"\.(shared_experts|experts\.\d+|ffn)\.down_proj\.", r".\1.w2."),
    (r"\.experts\.down_proj$", ".experts.w2"),
))
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")
_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
# DeepSeek's MTP block holds references to the shared embedding and head.
_MTP_ALIAS = re.compile(r"^mtp\.\d+\.(embed|head)\.weight$")


def canonical_name(name: str) -> str:
    """A tensor name in DeepSeek's / branchspec's spelling (experts not yet stacked)."""
    if name.startswith("model."):
        name = name[len("model."):]
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


@dataclass
class Recipe:
    """How one branchspec tensor is built from source tensors.

    op: "copy" (sources[0]), "stack" (sources in expert order, along a new dim 0), or
    "half0" / "half1" (the first / second half of sources[0] along dim 1, for
    transformers' packed gate_up_proj: gate first, then up).
    """

    op: str
    sources: list[str]


@dataclass
class NamePlan:
    recipes: dict[str, Recipe]                  # branchspec name -> recipe
    scales: dict[str, str]                      # FP8 weight (source name) -> its scale tensor
    duplicates: list[str] = field(default_factory=list)     # "a and b both give c"
    expert_gaps: list[str] = field(default_factory=list)    # missing per-expert sources


def _scale_companion(name: str, names: set[str]) -> str | None:
    """The weight a block-FP8 scale tensor belongs to, if ``name`` is one."""
    if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in names:
        return name[: -len("_scale_inv")]
    if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in names:
        return name[: -len(".scale")] + ".weight"
    return None


def plan_names(names: Iterable[str], rename: bool = True) -> NamePlan:
    """Map source tensor names (any supported spelling) to branchspec names.

    ``rename=False`` takes names as branchspec's own (FP8 scales still recognised): a
    branchspec checkpoint must spell every tensor exactly."""
    names = list(names)
    name_set = set(names)
    scales: dict[str, str] = {}
    for n in names:
        owner = _scale_companion(n, name_set)
        if owner is not None:
            scales[owner] = n
    scale_names = set(scales.values())
    recipes: dict[str, Recipe] = {}
    origin: dict[str, str] = {}
    plan = NamePlan(recipes, scales)
    stacks: dict[str, dict[int, str]] = {}

    def add(target: str, recipe: Recipe, source: str) -> None:
        if target in recipes:
            plan.duplicates.append(f"{origin[target]} and {source} both give {target}")
            return
        recipes[target] = recipe
        origin[target] = source

    for n in sorted(names):
        if n in scale_names:
            continue
        if not rename:
            add(n, Recipe("copy", [n]), n)
            continue
        c = canonical_name(n)
        if _MTP_ALIAS.match(c):
            continue
        m = _PER_EXPERT.match(c)
        if m:
            target = f"{m.group(1)}.{m.group(3)}"
            slot = stacks.setdefault(target, {})
            index = int(m.group(2))
            if index in slot:
                plan.duplicates.append(f"{slot[index]} and {n} both give expert {index} of {target}")
            slot[index] = n
            continue
        m = _GATE_UP.match(c)
        if m:
            add(f"{m.group(1)}.w1", Recipe("half0", [n]), n)
            add(f"{m.group(1)}.w3", Recipe("half1", [n]), n)
            continue
        add(c, Recipe("copy", [n]), n)
    for target, slot in sorted(stacks.items()):
        count = max(slot) + 1
        gaps = [i for i in range(count) if i not in slot]
        if gaps:
            some = slot[min(slot)]
            plan.expert_gaps += [re.sub(r"\.experts\.\d+\.", f".experts.{i}.", some) for i in gaps]
            continue
        add(target, Recipe("stack", [slot[i] for i in range(count)]), f"{slot[0]} ...")
    return plan


# -- tensor sources -----------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None), "F4": getattr(torch, "float4_e2m1fn_x2", None),
}
_FP4_TAGS = ("F4", "float4_e2m1fn_x2")


class SafetensorsFolder(Mapping):
    """The tensors of one or more safetensors files as a lazy, read-only mapping.

    Shapes and dtypes come from the headers (``shape``, ``dtype_name``); a tensor is read
    only when indexed. Every unreadable file is a CheckpointError naming it.
    """

    def __init__(self, files: Iterable[str | Path], weight_map: Mapping[str, str] | None = None,
                 where: str | Path | None = None):
        from safetensors import safe_open

        self.files = [Path(p) for p in files]
        self.where = str(where) if where is not None else str(self.files[0] if len(self.files) == 1 else
                                                               self.files[0].parent)
        self._handles = {}
        self._file_of: dict[str, Path] = {}
        for path in self.files:
            if not path.is_file():
                raise FileNotFoundError(f"no {path.name} in {path.parent}")
            if path.stat().st_size == 0:
                raise CheckpointError(f"{path} is empty (0 bytes)")
            try:
                handle = safe_open(str(path), "pt")
                keys = list(handle.keys())
            except Exception as e:  # noqa: BLE001 - SafetensorError, OSError, ValueError alike
                raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e
            self._handles[path] = handle
            for k in keys:
                if k in self._file_of:
                    raise CheckpointError(
                        f"tensor {k} is in both {self._file_of[k].name} and {path.name} (model-parallel "
                        "shards cannot be merged; convert DeepSeek's checkpoint with mp=1)")
                self._file_of[k] = path
        if weight_map is not None:
            absent = sorted(k for k, fname in weight_map.items() if self._file_of.get(k, Path()).name != fname)
            if absent:
                raise CheckpointError(f"{self.where}: tensors listed in the index are not in their shard: "
                                      f"{absent[:20]}{' ...' if len(absent) > 20 else ''}")

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._file_of[name]
        try:
            return self._handles[path].get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name}: {e}") from e

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def file_of(self, name: str) -> Path:
        return self._file_of[name]

    def _slice(self, name: str):
        path = self._file_of[name]
        try:
            return self._handles[path].get_slice(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path} is not a readable safetensors file: tensor {name}: {e}") from e

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype_name(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def close(self) -> None:
        self._handles.clear()

    @classmethod
    def open(cls, folder: str | Path) -> "SafetensorsFolder":
        """``model.safetensors``, else the index and its shards, else every ``*.safetensors``."""
        folder = Path(folder)
        single = folder / WEIGHTS_FILE
        if single.is_file():
            return cls([single])
        index = folder / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_bytes())["weight_map"]
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise TypeError("weight_map must map tensor names to file names")
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index: {e!r}") from e
            shards = sorted(set(weight_map.values()))
            for shard in shards:
                if not (folder / shard).is_file():
                    raise FileNotFoundError(f"{index} names the shard {shard}, which is not in {folder}")
            return cls([folder / s for s in shards], weight_map, where=index)
        found = sorted(p for p in folder.glob("*.safetensors") if p.is_file())
        if not found:
            raise FileNotFoundError(f"no {WEIGHTS_FILE} (nor {INDEX_FILE}, nor any *.safetensors) in {folder}")
        return cls(found)


def _shape(source: Mapping, name: str) -> tuple[int, ...]:
    if isinstance(source, SafetensorsFolder):
        return source.shape(name)
    return tuple(source[name].shape)


def _dtype_tag(source: Mapping, name: str) -> str:
    """A dtype's name: safetensors' (``F8_E4M3``) for files, torch's for tensors."""
    if isinstance(source, SafetensorsFolder):
        return source.dtype_name(name)
    return str(source[name].dtype).removeprefix("torch.")


def _torch_dtype(tag: str) -> torch.dtype | None:
    if tag in _SAFETENSORS_DTYPES:
        return _SAFETENSORS_DTYPES[tag]
    return getattr(torch, tag, None)


def _kind(tag: str) -> str:
    dtype = _torch_dtype(tag)
    if dtype is None:
        return "other"
    if dtype.is_floating_point:
        return "float"
    if dtype == torch.bool or dtype.is_complex:
        return "other"
    return "int"


def _is_fp8(tag: str) -> bool:
    return tag in ("F8_E4M3", "float8_e4m3fn")


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor,
                          block: int | tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Block-FP8 to float32: ``W[i, j] = weight[i, j] * scale[i // bh, j // bw]``.

    ``scale`` holds one factor per ``bh x bw`` block of the last two dims (ceil division at
    the edges), as float32 or float8_e8m0fnu; leading dims (stacked experts) are matched
    one to one. ValueError if the scale's shape does not fit.
    """
    bh, bw = (block, block) if isinstance(block, int) else block
    if weight.dim() < 2:
        raise ValueError(f"a block-FP8 weight needs at least 2 dims, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-rows // bh), -(-cols // bw))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                         f"in {bh}x{bw} blocks (expected {want})")
    s = scale.float().repeat_interleave(bh, dim=-2)[..., :rows, :].repeat_interleave(bw, dim=-1)[..., :cols]
    return weight.float() * s


# -- mapping tensors ----------------------------------------------------------------------


def _shown(names: list[str], limit: int = 40) -> str:
    return str(names[:limit]) + (f" ... ({len(names) - limit} more)" if len(names) > limit else "")


def to_branchspec_tensors(source: Mapping[str, torch.Tensor], cfg: ModelConfig, *,
                          expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                          dtype: torch.dtype | None = None, tie_word_embeddings: bool = False,
                          fp8_block: int | tuple[int, int] = FP8_BLOCK, fp4_experts: bool = False,
                          rename: bool = True, where: str = "checkpoint", file_label: str | None = None,
                          config_name: str = "its config.json") -> dict[str, torch.Tensor]:
    """Branchspec's state_dict from a source's tensors, in any supported spelling.

    ``source`` is a dict of tensors or a ``SafetensorsFolder`` (read lazily, one target
    tensor at a time). ``expected`` maps each branchspec name to its (shape, dtype), by
    default ``expected_shapes(cfg)`` with int64 for integer tensors and ``dtype`` (or
    float32) for the rest. Block-FP8 weights are dequantised; floating tensors are cast to
    ``dtype`` (kept as read when None), integer ones to the expected integer dtype.
    ``rename=False`` reads names as branchspec's own, with no foreign spelling accepted.

    Every problem is checked before a tensor is read, and reported together in one
    CheckpointError: FP4 weights, FP8 weights without a fitting scale, missing, unexpected
    and mis-shaped tensors, then tensors of the wrong kind (float vs integer), then NaN or
    Inf values. Messages name ``where`` (the folder) or ``file_label`` (the weights file;
    default: the source's file for a ``SafetensorsFolder``, else ``where``).
    """
    if file_label is None:
        file_label = source.where if isinstance(source, SafetensorsFolder) else where
    if expected is None:
        float_dtype = dtype or torch.float32
        expected = {k: (shape, torch.int64 if is_integer_tensor(k) else float_dtype)
                    for k, shape in expected_shapes(cfg).items()}
    names = list(source.keys())
    plan = plan_names(names, rename)
    tags = {n: _dtype_tag(source, n) for n in names}

    fp4 = sorted(n for n, t in tags.items() if t in _FP4_TAGS)
    if fp4 or (fp4_experts and any(".experts." in n for n in names)):
        shown = fp4 or sorted(n for n in names if ".experts." in n)[:5]
        raise CheckpointError(f"{where}: FP4 (float4_e2m1fn_x2) weights are not supported, found {_shown(shown, 10)}; "
                              "use a checkpoint with FP8 or BF16 experts")
    block = (fp8_block, fp8_block) if isinstance(fp8_block, int) else tuple(fp8_block)
    fp8_problems = []
    for n, t in tags.items():
        if _is_fp8(t) and n not in plan.scales:
            fp8_problems.append(f"{n} is float8_e4m3fn but has no .scale or _scale_inv companion")
    for w, s in plan.scales.items():
        if not _is_fp8(tags[w]):
            fp8_problems.append(f"{s} scales {w}, which is {tags[w]}, not float8_e4m3fn")
            continue
        shape, sshape = _shape(source, w), _shape(source, s)
        want = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1])) if len(shape) >= 2 else None
        if sshape != want:
            fp8_problems.append(f"{s}: shape {sshape} does not give one scale per {block[0]}x{block[1]} "
                                f"block of {w} {shape} (expected {want})")
    if fp8_problems:
        raise CheckpointError(f"{where}: block-FP8 weights that cannot be dequantised: {_shown(sorted(fp8_problems))}")

    recipes = dict(plan.recipes)
    if tie_word_embeddings and "head.weight" not in recipes and "embed.weight" in recipes:
        recipes["head.weight"] = recipes["embed.weight"]

    def shape_of(recipe: Recipe) -> tuple[int, ...]:
        first = _shape(source, recipe.sources[0])
        if recipe.op == "stack":
            shapes = {_shape(source, s) for s in recipe.sources}
            return (len(recipe.sources), *first) if len(shapes) == 1 else (len(recipe.sources), -1)
        if recipe.op in ("half0", "half1"):
            if len(first) < 2 or first[1] % 2:
                return first
            return (first[0], first[1] // 2, *first[2:])
        return first

    missing = sorted(set(expected) - set(recipes))
    extra = sorted(set(recipes) - set(expected))
    unexpected_shown = [n if n == k else f"{n} (as {k})" for k in extra for n in recipes[k].sources[:1]]
    bad_shape = sorted(f"{k}: expected {tuple(expected[k][0])}, found {shape_of(recipes[k])}"
                       for k in set(expected) & set(recipes) if shape_of(recipes[k]) != tuple(expected[k][0]))
    problems = []
    if missing or plan.expert_gaps:
        problems.append(f"missing tensors {_shown(missing + sorted(plan.expert_gaps))}")
    if extra:
        problems.append(f"unexpected tensors {_shown(sorted(unexpected_shown))}")
    if plan.duplicates:
        problems.append(f"tensors given twice: {_shown(plan.duplicates)}")
    if bad_shape:
        problems.append(f"mis-shaped tensors {bad_shape}")
    if problems:
        raise CheckpointError(f"checkpoint {where} does not match {config_name}: " + "; ".join(problems))

    # A tensor's kind must be the model's: floating for weights (FP8 dequantises to one),
    # integer for the hash table; load_state_dict would silently cast otherwise.
    def described(k: str) -> str:
        name = recipes[k].sources[0]
        return f"{name} ({_torch_dtype(tags[name]) or tags[name]})"

    kinds = {k: _kind(tags[r.sources[0]]) for k, r in recipes.items()}   # FP8 counts as float
    want_float = sorted(described(k) for k in recipes if expected[k][1].is_floating_point and kinds[k] != "float")
    want_int = sorted(described(k) for k in recipes if not expected[k][1].is_floating_point and kinds[k] != "int")
    if want_float:
        raise CheckpointError(f"{file_label}: tensors must be floating point, found {want_float}")
    if want_int:
        raise CheckpointError(f"{file_label}: tensors must be integers, found {want_int}")

    def read(name: str) -> torch.Tensor:
        t = source[name]
        if name in plan.scales:
            t = dequantize_fp8_blocks(t, source[plan.scales[name]], block)
        return t

    out: dict[str, torch.Tensor] = {}
    for k in expected:
        recipe = recipes[k]
        if recipe.op == "stack":
            t = torch.stack([read(s) for s in recipe.sources])
        else:
            t = read(recipe.sources[0])
            if recipe.op in ("half0", "half1"):
                half = t.shape[1] // 2
                t = t[:, :half] if recipe.op == "half0" else t[:, half:]
        if t.is_floating_point():
            if not torch.isfinite(t).all():
                raise CheckpointError(f"checkpoint {where}: tensor {k} contains NaN or Inf")
            target = dtype if dtype is not None else t.dtype
        else:
            target = expected[k][1]
            if is_integer_tensor(k) and t.numel() and (int(t.min()) < 0 or int(t.max()) >= max(cfg.num_experts, 1)):
                raise CheckpointError(f"checkpoint {where}: {k} holds expert ids outside [0, {cfg.num_experts})")
        out[k] = t.to(target).contiguous()
    return out


# -- whole folders ------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """An opened checkpoint folder of any supported format."""

    folder: Path
    format: str
    config: ModelConfig
    extras: ConfigExtras
    source: SafetensorsFolder

    @property
    def where(self) -> str:
        return self.source.where

    def tensors(self, expected: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
                dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Branchspec's state_dict (see ``to_branchspec_tensors``)."""
        return to_branchspec_tensors(
            self.source, self.config, expected=expected, dtype=dtype,
            tie_word_embeddings=self.extras.tie_word_embeddings, fp8_block=self.extras.fp8_block,
            fp4_experts=self.extras.fp4_experts, rename=self.format != FORMAT_BRANCHSPEC,
            where=str(self.folder), file_label=self.where)

    def close(self) -> None:
        self.source.close()


def open_checkpoint(folder: str | Path) -> Checkpoint:
    """Detect the folder's format, build its ModelConfig and open its weights lazily.

    FileNotFoundError for a missing folder, config.json or weights; ConfigError naming
    config.json and the field; CheckpointError naming an unreadable weights file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    d = read_config_json(folder)
    config_path = folder / "config.json"
    try:
        fmt = config_format(d)
    except ConfigError as e:
        raise ConfigError(f"{config_path}{str(e)[len('config.json'):]}") from None
    if fmt == FORMAT_BRANCHSPEC:
        cfg = ModelConfig.load(folder)       # its own errors, naming the file
        source = SafetensorsFolder.open(folder)
        return Checkpoint(folder, fmt, cfg, ConfigExtras(), source)
    source = SafetensorsFolder.open(folder)
    convert = _hf_config if fmt == FORMAT_HF else _deepseek_config
    kw, extras = convert(d, str(config_path), list(source.keys()))
    return Checkpoint(folder, fmt, ModelConfig(**kw), extras, source)


def checkpoint_stop_ids(folder: str | Path) -> tuple[int, ...]:
    """Every id that ends generation per the folder's config.json: eos, then an HF eos
    list's other entries."""
    ckpt_cfg = read_config_json(folder)
    fmt = config_format(ckpt_cfg)
    if fmt == FORMAT_BRANCHSPEC:
        return (ModelConfig.load(folder).eos_token_id,)
    convert = _hf_config if fmt == FORMAT_HF else _deepseek_config
    kw, extras = convert(ckpt_cfg, str(Path(folder) / "config.json"))
    return (kw["eos_token_id"], *extras.extra_stop_ids)


def _record_stop_ids(out: Path, stop_ids: tuple[int, ...]) -> None:
    """Keep an HF eos list, which branchspec's config.json (one eos id) cannot hold, in
    ``generation_config.json``'s ``eos_token_id``, where the foreign tokenizer reads it."""
    path = out / "generation_config.json"
    generation = {}
    if path.is_file():
        try:
            generation = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            generation = {}
        if not isinstance(generation, dict):
            generation = {}
    old = generation.get("eos_token_id")
    old = old if isinstance(old, list) else [old] if isinstance(old, int) else []
    generation["eos_token_id"] = list(dict.fromkeys([*stop_ids, *old]))
    path.write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")


def _write_foreign_tokenizer_config(src: Path, out: Path) -> None:
    """A foreign tokenizer.json without tokenizer_config.json is recognised by the HF or
    DeepSeek config.json beside it, which conversion replaces: write the config it needs
    (its bos/eos tokens) so the converted folder still loads it."""
    if not (src / "tokenizer.json").is_file() or (src / "tokenizer_config.json").is_file():
        return
    from branchspec.data.tokenizer import ForeignTokenizer, Tokenizer

    try:
        tok = Tokenizer.from_dir(src)
    except ValueError:
        return   # copied as is; loading the converted folder reports the problem
    if isinstance(tok, ForeignTokenizer):
        tok.save(out)


def convert_checkpoint(src: str | Path, out: str | Path, dtype: str | torch.dtype = "float32") -> Path:
    """Write ``src`` (any supported format) as a branchspec folder at ``out``.

    ``out`` gets config.json, model.safetensors (floats in ``dtype``) and the tokenizer
    files present in ``src``. ``out`` must not exist or be an empty folder. Nothing is
    left at ``out`` if the conversion fails.
    """
    from safetensors.torch import save_file

    from branchspec.model.weights import resolve_dtype

    target = resolve_dtype(dtype)
    src, out = Path(src), Path(out)
    if not src.exists():
        raise FileNotFoundError(f"source checkpoint {src} does not exist")
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint {src} is not a folder")
    check_new_folder(out)
    ckpt = open_checkpoint(src)
    try:
        tensors = ckpt.tensors(dtype=target)
    finally:
        ckpt.close()
    with new_folder(out) as tmp:
        ckpt.config.save(tmp)
        meta = {"format": "pt", "converted_from": json.dumps(ckpt.format)}
        if ckpt.extras.extra_stop_ids:
            meta["extra_stop_ids"] = json.dumps(list(ckpt.extras.extra_stop_ids))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata=meta)
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        _write_foreign_tokenizer_config(src, tmp)
        if ckpt.extras.extra_stop_ids:
            _record_stop_ids(tmp, (ckpt.config.eos_token_id, *ckpt.extras.extra_stop_ids))
    return out


def check_new_folder(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"output {out} already exists and is not an empty folder; choose a new path")


@contextmanager
def new_folder(out: Path):
    """Write a checkpoint folder all or nothing: the block fills a temporary sibling of
    ``out`` (which must not exist, or be empty), renamed into place when the block ends;
    on any error the sibling is removed and ``out`` is left as it was."""
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


__all__ = [
    "CheckpointError", "Checkpoint", "ConfigExtras", "FORMATS", "FORMAT_BRANCHSPEC", "FORMAT_DEEPSEEK",
    "FORMAT_HF", "NamePlan", "Recipe", "SafetensorsFolder", "canonical_name", "checkpoint_stop_ids",
    "config_format", "convert_checkpoint", "deepseek_config_to_branchspec", "dequantize_fp8_blocks",
    "detect_format", "expected_shapes", "hf_config_extras", "hf_config_to_branchspec", "is_integer_tensor",
    "open_checkpoint", "plan_names", "read_config_json", "to_branchspec_tensors",
]
