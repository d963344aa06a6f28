"""The names and shapes of branchspec's state_dict for a config: what a checkpoint of any
format must give, and what an export must cover."""

from __future__ import annotations

from branchspec.config import ModelConfig


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
