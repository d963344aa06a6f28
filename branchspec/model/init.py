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
    n_layers = model.cfg.num_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("_scale"):
                p.fill_(1.0)
            elif name.endswith(("ape", "attn_sink", "_base", "gate.bias")):
                p.zero_()
            else:
                out_proj = name.endswith(("wo.weight", "wo_b.weight", "w2.weight", "experts.w2"))
                scale = std / (2 * n_layers) ** 0.5 if out_proj else std
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * scale)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):   # k distinct experts per token id
                V, k = b.shape
                b.copy_(torch.rand(V, model.cfg.num_experts, generator=g).argsort(dim=-1)[:, :k])
    return model


def random_model(cfg: ModelConfig, seed: int = 0, dtype: str | torch.dtype = "float32",
                 std: float = 0.02, expert_dispatch: str = "grouped") -> Transformer:
    """A model of ``cfg`` with ``init_weights(seed, std)``, drawn in float64 (so every
    dtype gets the same weights, rounded) and returned in ``dtype``, in eval mode."""
    model = init_weights(Transformer(cfg, expert_dispatch=expert_dispatch).to(torch.float64), seed, std)
    return model.to(resolve_dtype(dtype)).eval()
