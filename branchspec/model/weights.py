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

from branchspec.model.formats import CheckpointError, open_checkpoint  # noqa: F401 - CheckpointError re-exported
from branchspec.model.dtypes import DTYPES, resolve_dtype  # noqa: F401 - re-exported
from branchspec.model.model import Transformer


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
