"""DeepSeek's original V4 config.json (``inference/model.py``'s ``ModelArgs`` keys) as
ModelConfig kwargs, with what it says beyond them (``ConfigExtras``)."""

from __future__ import annotations

from collections.abc import Iterable

from branchspec.checkpoint.foreign_config import (
    ConfigExtras, Fields, checked_kwargs, read_legacy_ratios, read_num_mtp_layers, read_shared_v4_fields,
    read_token_ids,
)
from branchspec.checkpoint.fp8 import FP8_BLOCK

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


def read_deepseek_config(d: dict, source: str = "config.json",
                         tensor_names: Iterable[str] | None = None) -> tuple[dict, ConfigExtras]:
    """(ModelConfig kwargs, ConfigExtras) for a DeepSeek config dict (see
    ``deepseek_config_to_branchspec``)."""
    f = Fields(d, source)
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
    kw["num_mtp_layers"] = read_num_mtp_layers(f, "n_mtp_layers", 1, tensor_names)
    kw["compress_ratios"] = read_legacy_ratios(f, "compress_ratios", num_layers, f.int("n_mtp_layers", 1))
    kw["rope_theta"] = f.float("rope_theta", 10000.0)
    kw["compress_rope_theta"] = f.float("compress_rope_theta", 40000.0)
    original = f.int("original_seq_len", 0)
    if original > 0:   # DeepSeek applies YaRN to compressed layers iff original_seq_len > 0
        kw["yarn_factor"] = f.float("rope_factor", 40.0)
        kw["yarn_original_max_position"] = original
        kw["yarn_beta_fast"] = f.float("beta_fast", 32.0)
        kw["yarn_beta_slow"] = f.float("beta_slow", 1.0)
    read_shared_v4_fields(f, kw)
    kw["num_experts_per_tok"] = f.int("n_activated_experts")
    kw["num_shared_experts"] = f.int("n_shared_experts", 1)
    kw["scoring_func"] = f.str("score_func", "sqrtsoftplus")
    # DeepSeek's Gate renormalises the top-k weights for every score function but softmax.
    kw["norm_topk_prob"] = kw["scoring_func"] != "softmax"
    kw["routed_scaling_factor"] = f.float("route_scale", 1.0)
    kw["num_hash_layers"] = f.int("n_hash_layers", 0)
    kw["swiglu_limit"] = f.float("swiglu_limit", 0.0)
    ids, extra = read_token_ids(f)
    kw.update(ids)
    fp4 = d.get("expert_dtype") == "fp4"
    kw = checked_kwargs(f, kw, _DS_ORIGIN)
    f.warn_defaults("DeepSeek's ModelArgs")
    return kw, ConfigExtras(extra, False, (FP8_BLOCK, FP8_BLOCK), fp4)


def deepseek_config_to_branchspec(d: dict, *, source: str = "config.json",
                                  tensor_names: Iterable[str] | None = None) -> dict:
    """ModelConfig kwargs for DeepSeek's original ``ModelArgs`` config.json dict.

    Keys DeepSeek's ``ModelArgs`` gives defaults for (norm_eps, route_scale, n_hash_layers,
    the YaRN keys, ...) take those defaults; sizes must be present. ``compress_ratios`` may
    hold one trailing 0 for the MTP layer. Token ids are ``bos_token_id``/``eos_token_id``
    when present, else 0 and 1 (DeepSeek's tokenizer).
    """
    return read_deepseek_config(d, source, tensor_names)[0]
