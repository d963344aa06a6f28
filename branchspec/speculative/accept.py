"""Acceptance: the path through the draft tree that the target's own choices take.

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


def accept(tokens: torch.Tensor, parents: torch.Tensor, ancestor: torch.Tensor, target: torch.Tensor,
           max_path_len: torch.Tensor | None = None) -> Acceptance:
    """tokens, parents: [B, D]; ancestor: [B, D, D] bool, m is n or an ancestor of n (the
    verify plan's `ForwardMeta.ancestor`); target: [B, D] the target's token at every node
    (`sampling.target_tokens` of the verify logits); max_path_len: [B] optional cap on
    path nodes (a request near its token budget).

    No walk: a node *matches* when its token is the target's at its parent (the root
    always does), and is accepted when it and all its ancestors match. Siblings carry
    distinct tokens, so at most one child of an accepted node matches and the accepted
    nodes form one path from the root, a node per depth. A dozen tensor ops, with no
    sizes that depend on the data."""
    B, D = tokens.shape
    match = tokens == target.gather(1, parents.clamp(min=0))                   # [B, D]
    match[:, 0] = True
    accepted = ~(ancestor & ~match[:, None, :]).any(dim=2)                      # [B, D]
    depth = ancestor.sum(dim=2) - 1                                             # [B, D]
    if max_path_len is not None:
        accepted &= depth < max_path_len[:, None]
    path_len = accepted.sum(dim=1)                                              # [B]
    # The accepted node at each depth (node 0, the root, past the path's end): at most one
    # node per depth is accepted, so a sum picks it. (Not an argmax over the depth's nodes:
    # compiled for an AVX2 CPU, that argmax left the entries past the path's end unset.)
    nodes = torch.arange(D, device=tokens.device)
    at_depth = accepted[:, None, :] & (depth[:, None, :] == nodes[None, :, None])      # [B, depth, node]
    path = (at_depth.to(torch.long) * nodes).sum(dim=2)                        # [B, D]
    last = path.gather(1, (path_len - 1)[:, None])                              # [B, 1]
    return Acceptance(path=path, path_len=path_len, keep=accepted, bonus=target.gather(1, last)[:, 0])
