"""Checkpoints as Hugging Face-style folders: config.json + model.safetensors (+ tokenizer).

Other formats (Hugging Face ``deepseek_v4``, DeepSeek's original) are mapped on load by
``formats.py``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from branchspec.config import ModelConfig
from branchspec.model.formats import CheckpointError, open_checkpoint  # noqa: F401 - CheckpointError re-exported
from branchspec.model.model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name or dtype; ValueError if unsupported, TypeError if neither."""
    if not isinstance(dtype, (str, torch.dtype)):
        raise TypeError(f"dtype must be a str or torch.dtype (one of {sorted(DTYPES)}), "
                        f"got {type(dtype).__name__} {dtype!r}")
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


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
                 std: float = 0.02) -> Transformer:
    model = init_weights(Transformer(cfg).to(torch.float64), seed, std)
    return model.to(resolve_dtype(dtype)).eval()


def save_checkpoint(model: Transformer, folder: str | Path, dtype: str | torch.dtype | None = None,
                    metadata: dict | None = None) -> Path:
    target = resolve_dtype(dtype) if dtype is not None else None   # fail before writing anything
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.cfg.save(folder)
    # Only floating tensors change dtype: integer buffers (the hash-routing table) stay integer.
    tensors = {k: (v.to(target) if target is not None and v.is_floating_point() else v).contiguous()
               for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"),
              metadata={"format": "pt", **{k: json.dumps(v) for k, v in (metadata or {}).items()}})
    return folder


def load_checkpoint(folder: str | Path, dtype: str | torch.dtype = "float32") -> Transformer:
    """Load a checkpoint folder: branchspec's own, a Hugging Face ``deepseek_v4`` one or
    DeepSeek's original one (see ``formats.py``; FP8 weights are dequantised).

    Every missing, unexpected, mis-shaped, wrong-kind (float vs integer) or non-finite
    tensor is named in the error (CheckpointError), and a bad config.json field in a
    ConfigError. Everything is checked before a weight is copied into the model; the dtype
    argument before anything is read. Floating tensors are cast to ``dtype``; integer
    buffers (the hash-routing table) stay integer.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a str or path, got {type(folder).__name__} {folder!r}")
    target = resolve_dtype(dtype)
    ckpt = open_checkpoint(Path(folder))
    try:
        model = Transformer(ckpt.config)
        expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
        tensors = ckpt.tensors(expected, dtype=target)
    finally:
        ckpt.close()
    model = model.to(target)
    model.load_state_dict(tensors)
    return model.eval()


def checkpoint_metadata(folder: str | Path) -> dict:
    from safetensors import safe_open
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        meta = f.metadata() or {}
    return {k: json.loads(v) for k, v in meta.items() if k != "format"}
