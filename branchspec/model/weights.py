"""Checkpoints as Hugging Face-style folders: config.json + model.safetensors (+ tokenizer)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from branchspec.config import ModelConfig
from branchspec.model.model import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor."""


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
    tensors = {k: (v.to(target) if target is not None else v).contiguous()
               for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"),
              metadata={"format": "pt", **{k: json.dumps(v) for k, v in (metadata or {}).items()}})
    return folder


def load_checkpoint(folder: str | Path, dtype: str | torch.dtype = "float32") -> Transformer:
    """Load a folder; every missing, unexpected, mis-shaped, non-float or non-finite tensor
    is named in the error (CheckpointError), and a bad config.json field in a ConfigError.

    Everything is checked before a weight is copied into the model; the dtype argument
    before anything is read.
    """
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"folder must be a str or path, got {type(folder).__name__} {folder!r}")
    target = resolve_dtype(dtype)
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    cfg = ModelConfig.load(folder)
    weights_path = folder / "model.safetensors"
    if not weights_path.is_file():
        raise FileNotFoundError(f"no model.safetensors in {folder}")
    if weights_path.stat().st_size == 0:
        raise CheckpointError(f"{weights_path} is empty (0 bytes)")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{weights_path} is not a readable safetensors file: {e}") from e
    model = Transformer(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    bad_shape = sorted(f"{k}: expected {tuple(expected[k])}, found {tuple(tensors[k].shape)}"
                       for k in set(expected) & set(tensors) if tensors[k].shape != expected[k])
    problems = []
    if missing:
        problems.append(f"missing tensors {missing}")
    if extra:
        problems.append(f"unexpected tensors {extra}")
    if bad_shape:
        problems.append(f"mis-shaped tensors {bad_shape}")
    if problems:
        raise CheckpointError(f"checkpoint {folder} does not match its config.json: " + "; ".join(problems))
    # load_state_dict would silently cast an integer or bool tensor to the float a weight needs.
    floating = {k for k, v in model.state_dict().items() if v.is_floating_point()}
    not_float = sorted(f"{k} ({v.dtype})" for k, v in tensors.items()
                       if k in floating and not v.is_floating_point())
    if not_float:
        raise CheckpointError(f"{weights_path}: tensors must be floating point, found {not_float}")
    for k, v in tensors.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise CheckpointError(f"checkpoint {folder}: tensor {k} contains NaN or Inf")
    model = model.to(target)
    model.load_state_dict({k: v.to(target) for k, v in tensors.items()})
    return model.eval()


def checkpoint_metadata(folder: str | Path) -> dict:
    from safetensors import safe_open
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        meta = f.metadata() or {}
    return {k: json.loads(v) for k, v in meta.items() if k != "format"}
