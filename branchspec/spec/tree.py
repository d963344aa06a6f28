"""Draft trees as parent arrays, and the verify plan derived from them.

A draft tree of one sequence has D nodes: node 0 is the *root* (the last emitted token, not
yet fed through the target), nodes 1..D-1 are drafted tokens, and `parents[j] < j` for
j > 0 (parents precede children). The plan is computed once per round with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchspec.model.metadata import ForwardMeta, build_meta


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents: [B, D] with parents[:, 0] = -1 -> ancestor-or-self [B, D, D] bool.

    Transitive closure by repeated squaring of the parent relation: ceil(log2 D) matmuls.
    """
    B, D = parents.shape
    eye = torch.eye(D, dtype=torch.bool, device=parents.device).expand(B, D, D)
    step = torch.zeros(B, D, D + 1, dtype=torch.bool, device=parents.device)
    step.scatter_(2, torch.where(parents >= 0, parents, D)[..., None], True)
    reach = step[..., :D] | eye                                 # self or parent
    hops = 1
    while hops < D:
        r = reach.to(torch.float32)
        reach = torch.bmm(r, r) > 0
        hops *= 2
    return reach


@dataclass
class VerifyPlan:
    """Everything a verify round needs about the trees of a batch."""

    parents: torch.Tensor         # [B, D]
    ancestor: torch.Tensor        # [B, D, D] bool, ancestor-or-self
    depth: torch.Tensor           # [B, D], root = 0
    meta: ForwardMeta             # attention metadata (positions L + depth, pooling plans)


def build_verify_plan(parents: torch.Tensor, num_committed: torch.Tensor,
                      ratios: tuple[int, ...], static: bool = False) -> VerifyPlan:
    ancestor = ancestor_matrix(parents)
    depth = ancestor.sum(-1) - 1                                 # [B, D]
    positions = num_committed[:, None] + depth
    valid = torch.ones_like(parents, dtype=torch.bool)
    meta = build_meta(positions, num_committed, ancestor, valid, ratios, static=static)
    return VerifyPlan(parents=parents, ancestor=ancestor, depth=depth, meta=meta)
