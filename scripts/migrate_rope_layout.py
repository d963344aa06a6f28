"""Rewrite a branchspec checkpoint from the first layout to the current one.

The first layout rotated RoPE pairs (i, i + rope_dim/2) of the trailing rope dims and kept
the MTP block's layers under `mtp.0.block.*`. The current layout rotates interleaved pairs
(2i, 2i + 1), as DeepSeek-V4 does, and keeps them directly under `mtp.0.*`, as DeepSeek's
MTP block does. Moving channel i to 2i and channel i + rope_dim/2 to 2i + 1 in every
tensor that produces or consumes rotated channels leaves the model's function unchanged
(only the order of sums inside dot products changes).

    python scripts/migrate_rope_layout.py SRC [DST]     # DST defaults to SRC (in place)
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def interleave_perm(rope_dim: int) -> torch.Tensor:
    """New channel j takes old channel perm[j]: [0, h, 1, h+1, ...] with h = rope_dim / 2."""
    half = rope_dim // 2
    return torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()


def permute_trailing(t: torch.Tensor, dim: int, width: int, rope_dim: int) -> torch.Tensor:
    """Permute the trailing rope_dim channels of every `width`-sized chunk along `dim`."""
    perm = interleave_perm(rope_dim)
    t = t.movedim(dim, 0)
    chunks = t.reshape(-1, width, *t.shape[1:]).clone()
    chunks[:, width - rope_dim:] = chunks[:, width - rope_dim:][:, perm]
    return chunks.reshape(t.shape).movedim(0, dim)


def migrate(tensors: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    rd, dh, di = cfg["rope_dim"], cfg["head_dim"], cfg["index_head_dim"]
    out = {}
    for name, t in tensors.items():
        name = name.replace("mtp.0.block.", "mtp.0.")
        if name.endswith(("attn.wq_b.weight", "attn.wkv.weight")) and "indexer" not in name:
            t = permute_trailing(t, 0, dh, rd)                      # output rows per head
        elif name.endswith("attn.kv_norm.weight"):
            t = permute_trailing(t, 0, dh, rd)
        elif name.endswith("attn.wo.weight"):
            t = permute_trailing(t, 1, dh, rd)                      # input columns per head
        elif ".indexer.compressor." in name:
            if name.endswith(("wkv.weight", "wgate.weight", "norm.weight")):
                t = permute_trailing(t, 0, di, rd)
            elif name.endswith("ape"):
                t = permute_trailing(t, 1, di, rd)
        elif name.endswith("indexer.wq_b.weight"):
            t = permute_trailing(t, 0, di, rd)
        elif ".attn.compressor." in name:
            if name.endswith(("wkv.weight", "wgate.weight", "norm.weight")):
                t = permute_trailing(t, 0, dh, rd)
            elif name.endswith("ape"):
                t = permute_trailing(t, 1, dh, rd)
        out[name] = t.contiguous()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("src")
    parser.add_argument("dst", nargs="?")
    args = parser.parse_args()
    src = Path(args.src)
    dst = Path(args.dst) if args.dst else src
    cfg = json.loads((src / "config.json").read_text())
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if not any(k.startswith("mtp.0.block.") for k in tensors) and cfg.get("num_mtp_layers", 1):
        raise SystemExit(f"{src} is already in the current layout")
    new = migrate(tensors, cfg)
    if dst != src:
        shutil.copytree(src, dst, dirs_exist_ok=True)
    save_file(new, str(dst / "model.safetensors"), metadata=metadata)
    print(f"wrote {dst / 'model.safetensors'} ({len(new)} tensors)")


if __name__ == "__main__":
    main()
