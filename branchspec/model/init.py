"""Deterministic random weights for a branchspec model (tests, benchmarks, training's start)."""

from __future__ import annotations

import torch

from branchspec.config import ModelConfig
from branchspec.model.dtypes import resolve_dtype
from branchspec.model.model import Transformer


def init_weights(model: Transformer, seed: int = 0, std: float = 0.02) -> Transformer:
    """Deterministic random init: normal(0, std) matrices, unit norms and mHC scales, zero
    APE, sinks, mHC biases and routing biases, and a random token -> experts hash table.

    Output projections are scaled down by depth (GPT-2 style) so the residual stream stays
    near unit scale at init.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = _init_scale(name, model.cfg.num_layers, std)
            if scale is None:
                _fill_fixed(name, p)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
        _fill_hash_tables(model, g)
    return model


def _init_scale(name: str, num_layers: int, std: float) -> float | None:
    """The standard deviation parameter `name` is drawn with, None for a fixed value."""
    if name.endswith(("norm.weight", "_scale", "ape", "attn_sink", "_base", "gate.bias")):
        return None
    out_proj = name.endswith(("wo.weight", "wo_b.weight", "w2.weight", "experts.w2"))
    return std / (2 * num_layers) ** 0.5 if out_proj else std


def _fill_fixed(name: str, p: torch.Tensor) -> None:
    """Norms and mHC scales start at one; APE, sinks, mHC biases and routing biases at zero."""
    p.fill_(1.0) if name.endswith(("norm.weight", "_scale")) else p.zero_()


def _fill_hash_tables(model: Transformer, g: torch.Generator) -> None:
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):   # k distinct experts per token id
            V, k = b.shape
            b.copy_(torch.rand(V, model.cfg.num_experts, generator=g).argsort(dim=-1)[:, :k])


def allocated_random_model(cfg: ModelConfig, dtype: str | torch.dtype, device: torch.device | str,
                           seed: int = 0, std: float = 0.02, expert_dispatch: str = "grouped") -> Transformer:
    """A model of `cfg` with `init_weights`' kind of weights, built without a float64 or
    float32 copy: its modules are made on the meta device and their storage allocated
    once, in `dtype` on `device`, then drawn there. For models too large for `random_model`
    (V4-Flash's layer shapes: a float64 draw of a few of its layers fills a machine); its
    weights are not `random_model`'s at the same seed."""
    from branchspec.model.layers import hc_scale_index, rope_tables

    with torch.device("meta"):
        model = Transformer(cfg, expert_dispatch=expert_dispatch)
    model = model.to(resolve_dtype(dtype))
    model.rope = rope_tables(cfg)           # float64 tables, computed (not on meta), moved by to_empty
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = _init_scale(name, cfg.num_layers, std)
            if scale is None:
                _fill_fixed(name, p)
            else:
                p.normal_(0.0, scale, generator=g)
        for name, b in model.named_buffers():
            if name.endswith("hc_scale_index"):
                b.copy_(hc_scale_index(cfg.hc_mult))
        _fill_hash_tables(model, torch.Generator().manual_seed(seed))
    return model.eval()


def random_model(cfg: ModelConfig, seed: int = 0, dtype: str | torch.dtype = "float32",
                 std: float = 0.02, expert_dispatch: str = "grouped") -> Transformer:
    """A model of ``cfg`` with ``init_weights(seed, std)``, drawn in float64 (so every
    dtype gets the same weights, rounded) and returned in ``dtype``, in eval mode."""
    model = init_weights(Transformer(cfg, expert_dispatch=expert_dispatch).to(torch.float64), seed, std)
    return model.to(resolve_dtype(dtype)).eval()
