"""Acceptance: walk the draft tree along the target's own choices.

At the current node (starting at the root) the target's token is taken: its argmax when
greedy, a draw from its (temperature, top-p) distribution when sampling. If a child of the
node carries that token, the walk descends into it (the child is *accepted*); otherwise the
target's token is the *bonus* token and the round ends. Every emitted token is a target
token drawn at its own prefix, so the output distribution is exactly the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Acceptance:
    path: torch.Tensor         # [B, D] node indices of the accepted path (root first), padded with 0
    path_len: torch.Tensor     # [B] nodes on the path, root included (>= 1)
    keep: torch.Tensor         # [B, D] bool, node is on the accepted path
    bonus: torch.Tensor        # [B] the target's token after the last path node


def accept(tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor,
           max_path_len: torch.Tensor | None = None) -> Acceptance:
    """tokens, parents: [B, D]; target: [B, D] the target's token at every node
    (`sampling.target_tokens` of the verify logits); max_path_len: [B] optional cap on
    path nodes (a request near its token budget)."""
    B, D = tokens.shape
    bidx = torch.arange(B, device=tokens.device)
    cur = torch.zeros(B, dtype=torch.long, device=tokens.device)
    active = torch.ones(B, dtype=torch.bool, device=tokens.device)
    path = torch.zeros(B, D, dtype=torch.long, device=tokens.device)
    path_len = torch.ones(B, dtype=torch.long, device=tokens.device)
    # One iteration per depth, vectorised over the batch (siblings carry distinct tokens).
    for _ in range(D - 1):
        want = target[bidx, cur]                                     # [B]
        match = (parents == cur[:, None]) & (tokens == want[:, None])
        active = active & match.any(dim=1)
        if max_path_len is not None:
            active = active & (path_len < max_path_len)
        if not active.any():
            break
        cur = torch.where(active, match.to(torch.int8).argmax(dim=1), cur)
        path[bidx[active], path_len[active]] = cur[active]
        path_len = path_len + active.long()
    on_path = torch.arange(D, device=tokens.device)[None] < path_len[:, None]   # [B, D]
    keep = torch.zeros(B, D, dtype=torch.bool, device=tokens.device)
    keep[bidx[:, None].expand(B, D)[on_path], path[on_path]] = True
    return Acceptance(path=path, path_len=path_len, keep=keep, bonus=target[bidx, cur])
