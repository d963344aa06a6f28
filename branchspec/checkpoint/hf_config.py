"""A Hugging Face ``deepseek_v4`` config.json (transformers' ``DeepseekV4Config``) as
ModelConfig kwargs, with what it says beyond them (``ConfigExtras``)."""

from __future__ import annotations

from collections.abc import Iterable

from branchspec.checkpoint.folder import HF_MODEL_TYPE
from branchspec.checkpoint.foreign_config import (
    ConfigExtras, Fields, checked_kwargs, read_legacy_ratios, read_num_mtp_layers, read_shared_v4_fields,
    read_token_ids,
)
from branchspec.checkpoint.fp8 import FP8_BLOCK


def _check_rope_dim(f: Fields, head_dim: int, rope_dim_exact: float, key: str) -> int:
    rope_dim = int(round(rope_dim_exact))
    if abs(rope_dim - rope_dim_exact) > 1e-6 or rope_dim <= 0 or rope_dim % 2:
        raise f.error(f"{key} gives {rope_dim_exact:g} rotary channels of head_dim {head_dim}; "
                      "it must be a positive even integer")
    return rope_dim


def _hf_rope(f: Fields, kw: dict) -> None:
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
                rope_theta = Fields(main, f"{f.source}: {key}.main").float("rope_theta")
            if compress.get("rope_theta") is not None:
                compress_theta = Fields(compress, f"{f.source}: {key}.compress").float("rope_theta")
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
    c = Fields(compress, f"{f.source}: {ckey}")
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


HF_LAYER_TYPES = {"sliding_attention": None, "compressed_sparse_attention": 4,
                  "heavily_compressed_attention": 128}


def _hf_ratios(f: Fields, num_layers: int, num_mtp: int) -> list[int]:
    if f.d.get("layer_types") is not None:
        types = f.list("layer_types")
        rates = f.d.get("compress_rates") or {}
        if not isinstance(rates, dict):
            raise f.error(f"compress_rates must be an object, got {type(rates).__name__}")
        ratios = []
        for i, t in enumerate(types[:num_layers]):
            if t not in HF_LAYER_TYPES:
                raise f.error(f"layer_types[{i}] = {t!r} is not one of {sorted(HF_LAYER_TYPES)}")
            if t == "sliding_attention":
                ratios.append(0)
                continue
            want = HF_LAYER_TYPES[t]
            rate = rates.get(t, want)
            if rate != want:
                raise f.error(f"compress_rates[{t!r}] = {rate!r}: branchspec builds "
                              f"{t} (overlapping={want == 4}) only with ratio {want}")
            ratios.append(want)
        if len(ratios) != num_layers:
            raise f.error(f"layer_types has {len(types)} entries but num_hidden_layers is {num_layers}")
        return ratios
    if f.d.get("compress_ratios") is not None:
        return read_legacy_ratios(f, "compress_ratios", num_layers, num_mtp)
    raise f.error("layer_types (or legacy compress_ratios) is missing; branchspec needs the per-layer "
                  "attention schedule")


def _hf_hash_layers(f: Fields, num_layers: int) -> int:
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


def read_hf_config(d: dict, source: str = "config.json",
                   tensor_names: Iterable[str] | None = None) -> tuple[dict, ConfigExtras]:
    """(ModelConfig kwargs, ConfigExtras) for an HF config dict (see ``hf_config_to_branchspec``)."""
    f = Fields(d, source)
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
    kw["num_mtp_layers"] = read_num_mtp_layers(f, "num_nextn_predict_layers", 1, tensor_names)
    kw["compress_ratios"] = _hf_ratios(f, num_layers, kw["num_mtp_layers"])
    _hf_rope(f, kw)
    read_shared_v4_fields(f, kw)
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
    ids, extra = read_token_ids(f)
    kw.update(ids)
    tie = f.bool("tie_word_embeddings", False)
    block, fp4 = _hf_quantization(f)
    kw = checked_kwargs(f, kw, _HF_ORIGIN)
    f.warn_defaults("transformers' DeepseekV4Config")
    return kw, ConfigExtras(extra, tie, block, fp4)


def _hf_quantization(f: Fields) -> tuple[tuple[int, int], bool]:
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
    return read_hf_config(d, source, tensor_names)[0]


def hf_config_extras(d: dict, *, source: str = "config.json") -> ConfigExtras:
    """Extra stop ids (an eos list's tail), tie_word_embeddings and FP8 block size."""
    return read_hf_config(d, source)[1]
