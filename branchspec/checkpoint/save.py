"""Writing branchspec's own checkpoint folder: config.json + model.safetensors, with
metadata (a training record, say) in the safetensors header."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from branchspec.atomic import save_safetensors, write_atomically, write_text
from branchspec.model.dtypes import resolve_dtype
from branchspec.model.model import Transformer


def save_checkpoint(model: Transformer, folder: str | Path, dtype: str | torch.dtype | None = None,
                    metadata: dict | None = None) -> Path:
    """Write ``model`` as a branchspec folder: config.json and model.safetensors (floats in
    ``dtype``; None keeps the model's), each ``metadata`` value JSON-encoded in the
    safetensors header. ``folder`` is created if needed; files already there are replaced,
    each in one rename (an interrupted write leaves the old file, never half a new one)."""
    target = resolve_dtype(dtype) if dtype is not None else None   # fail before writing anything
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} is a file")
    folder.mkdir(parents=True, exist_ok=True)
    # Only floating tensors change dtype: integer buffers (the hash-routing table) stay integer.
    tensors = {k: (v.to(target) if target is not None and v.is_floating_point() else v).contiguous()
               for k, v in model.state_dict().items()}
    meta = {"format": "pt", **{k: json.dumps(v) for k, v in (metadata or {}).items()}}
    # The weights first: a folder whose config.json is new always has the weights it describes.
    write_atomically(folder / "model.safetensors", lambda tmp: save_safetensors(tensors, tmp, meta))
    write_text(folder / "config.json", json.dumps(model.cfg.to_dict(), indent=2) + "\n")
    return folder


def checkpoint_metadata(folder: str | Path) -> dict:
    """The metadata of a folder's model.safetensors (``save_checkpoint``'s, or ``convert``'s
    ``converted_from``), decoded from JSON."""
    from safetensors import safe_open
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        meta = f.metadata() or {}
    return {k: json.loads(v) for k, v in meta.items() if k != "format"}
