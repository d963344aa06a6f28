"""A deliberately naive implementation of the model, one position at a time, written from
DESIGN section 2 without the engine's metadata, pooling plans or paged state. It shares the
weights of a `Transformer` and is the ground truth the fast paths are checked against.
It covers the plain model (one residual stream, dense FFN, one W_o); the real
architecture's per-token parts are checked against transformers instead."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from branchspec.model.layers import rope


def _norm(mod, x):
    return F.rms_norm(x, (x.shape[-1],), mod.weight, mod.eps)


def _entries(comp, x, T, r, dim, cfg, inv_freq):
    """Entries i < T // r of one compressor, straight from the definition."""
    a = x @ comp.wkv.weight.T                                       # [T, c*dim]
    g = x @ comp.wgate.weight.T + comp.ape[torch.arange(T) % r]
    out = []
    for i in range(T // r):
        if r == 4:
            cur_a, cur_g = a[4 * i:4 * i + 4, dim:], g[4 * i:4 * i + 4, dim:]
            if i == 0:
                prev_a = torch.zeros(4, dim, dtype=x.dtype)
                prev_g = torch.full((4, dim), float("-inf"), dtype=x.dtype)
            else:
                prev_a, prev_g = a[4 * i - 4:4 * i, :dim], g[4 * i - 4:4 * i, :dim]
            rows_a, rows_g = torch.cat([prev_a, cur_a]), torch.cat([prev_g, cur_g])
        else:
            rows_a, rows_g = a[r * i:r * i + r], g[r * i:r * i + r]
        pooled = (torch.softmax(rows_g, dim=0) * rows_a).sum(0)
        out.append(rope(_norm(comp.norm, pooled)[None], torch.tensor([r * i]), inv_freq)[0])
    return torch.stack(out) if out else torch.zeros(0, dim, dtype=x.dtype)


def oracle_block(block, h: torch.Tensor, cfg, inv_freq: torch.Tensor) -> torch.Tensor:
    """One transformer block over a whole sequence h: [T, d], positions 0..T-1, rotating
    with RoPE inverse frequencies inv_freq."""
    attn, r = block.attn, block.ratio
    T = h.shape[0]
    H, dh, W = cfg.num_heads, cfg.head_dim, cfg.window
    x = _norm(block.attn_norm, h)
    pos = torch.arange(T)
    c_q = _norm(attn.q_norm, x @ attn.wq_a.weight.T)
    q = (c_q @ attn.wq_b.weight.T).view(T, H, dh)
    q = q / torch.sqrt(q.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    q = rope(q, pos, inv_freq)
    k = rope(_norm(attn.kv_norm, x @ attn.wkv.weight.T), pos, inv_freq)
    ent = _entries(attn.compressor, x, T, r, dh, cfg, inv_freq) if r > 0 else None
    if r == 4:
        idx = attn.indexer
        ikeys = _entries(idx.compressor, x, T, 4, cfg.index_head_dim, cfg, inv_freq)
        iq = rope((c_q @ idx.wq_b.weight.T).view(T, cfg.index_num_heads, cfg.index_head_dim), pos,
                  inv_freq)
        iw = (x @ idx.weights_proj.weight.T) * (cfg.index_num_heads * cfg.index_head_dim) ** -0.5
    outs = []
    for t in range(T):
        keys = [k[j] for j in range(max(0, t - W + 1), t + 1)]
        if r > 0:
            n_vis = (t + 1) // r
            chosen = list(range(n_vis))
            if r == 4 and n_vis > cfg.index_topk:
                score = [(iw[t] * (iq[t] @ ikeys[i]).relu()).sum().item() for i in range(n_vis)]
                # highest score first; equal scores: lower entry number first
                chosen = sorted(range(n_vis), key=lambda i: (-score[i], i))[: cfg.index_topk]
            keys += [ent[i] for i in sorted(chosen)]
        K = torch.stack(keys)                                        # [n, dh]
        o = []
        for head in range(H):
            logit = K @ q[t, head] / dh ** 0.5
            p = torch.softmax(torch.cat([logit, attn.attn_sink[head].reshape(1).to(logit.dtype)]), 0)[:-1]
            o.append(p @ K)
        o = rope(torch.stack(o)[None], torch.tensor([t]), inv_freq, inverse=True)[0]
        outs.append(o.reshape(-1) @ attn.wo.weight.T)
    h = h + torch.stack(outs)
    return h + block.ffn(_norm(block.ffn_norm, h))


@torch.no_grad()
def oracle_logits(model, ids: list[int]) -> torch.Tensor:
    """ids: T tokens from position 0 -> logits [T, V]."""
    h = model.embed.weight[torch.tensor(ids)]
    for block in model.layers:
        h = oracle_block(block, h, model.cfg, model.rope["compress" if block.ratio else "main"])
    return _norm(model.norm, h) @ model.head.weight.T
