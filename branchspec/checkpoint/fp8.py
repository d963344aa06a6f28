"""Block-FP8 weights (float8_e4m3fn, one scale per 128x128 block) dequantised at load;
FP4 weights are told apart to be refused."""

from __future__ import annotations

import torch

FP8_BLOCK = 128
FP4_TAGS = ("F4", "float4_e2m1fn_x2")


def is_fp8(tag: str) -> bool:
    return tag in ("F8_E4M3", "float8_e4m3fn")


def dequantize_fp8_blocks(weight: torch.Tensor, scale: torch.Tensor,
                          block: int | tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Block-FP8 to float32: ``W[i, j] = weight[i, j] * scale[i // bh, j // bw]``.

    ``scale`` holds one factor per ``bh x bw`` block of the last two dims (ceil division at
    the edges), as float32 or float8_e8m0fnu; leading dims (stacked experts) are matched
    one to one. ValueError if the scale's shape does not fit.
    """
    bh, bw = (block, block) if isinstance(block, int) else block
    if weight.dim() < 2:
        raise ValueError(f"a block-FP8 weight needs at least 2 dims, got shape {tuple(weight.shape)}")
    rows, cols = weight.shape[-2:]
    want = (*weight.shape[:-2], -(-rows // bh), -(-cols // bw))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not fit weight {tuple(weight.shape)} "
                         f"in {bh}x{bw} blocks (expected {want})")
    s = scale.float().repeat_interleave(bh, dim=-2)[..., :rows, :].repeat_interleave(bw, dim=-1)[..., :cols]
    return weight.float() * s
