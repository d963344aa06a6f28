"""Small building blocks: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Scale each vector (last dim) to unit RMS, no learned gain (V4's query normalisation)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, positions: torch.Tensor, rope_dim: int, theta: float,
         inverse: bool = False) -> torch.Tensor:
    """Rotate the last `rope_dim` dims of x by angles positions * theta^(-2i/rope_dim).

    x: [..., N, (H,) dim]; positions: [..., N] broadcastable to x without its head/feature dims.
    The rotation pairs dim i with dim i + rope_dim/2 of the rotary part (rotate-half form).
    `inverse` rotates by -position: V4 un-rotates the attention output, whose values carry
    their keys' rotations, back to the query's frame.
    """
    half = rope_dim // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float64) * 2.0 / rope_dim)
    angles = positions.to(torch.float64).unsqueeze(-1) * freqs  # [..., N, half]
    if inverse:
        angles = -angles
    extra = x.dim() - angles.dim()  # head dims between N and features
    for _ in range(extra):
        angles = angles.unsqueeze(-2)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x_pass, x_rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim:]
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([x_pass, rotated], dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
