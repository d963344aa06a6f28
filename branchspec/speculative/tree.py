"""Draft trees as parent arrays, and which drafted candidates a tree keeps.

A draft tree of one sequence has D nodes: node 0 is the *root* (the last emitted token, not
yet fed through the target), nodes 1..D-1 are drafted tokens, and `parents[j] < j` for
j > 0 (parents precede children). Its verify plan (depths, positions, the ancestor-or-self
matrix and where each completing node's pooled rows come from) is attention metadata,
`model.metadata.tree_meta`, computed once per round with tensor ops.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """The trees of a batch: node 0 is the root, parents precede children."""

    tokens: torch.Tensor      # [B, D] token ids, tokens[:, 0] = root
    parents: torch.Tensor     # [B, D] parent node index, -1 for the root
    # [B, D] what the selection ranked by, 0 for the root: the cumulative draft
    # log-probability (EAGLE-2), or the log of the path's measured acceptance (calibrated)
    scores: torch.Tensor
    # [B, D, topk] the drafter's top-k proposals after each node, best first, whether or not
    # they were kept; -1 for nodes the drafter did not expand. A policy or the calibrated
    # selection compares them with the target's tokens to learn acceptance by depth and
    # rank without bias; children_logp [B, D, topk] are their draft log-probabilities (for
    # the calibrated selection, at each request's sampling temperature).
    children: torch.Tensor | None = None
    children_logp: torch.Tensor | None = None


def select_tree(root_ids: torch.Tensor, cand_tok: torch.Tensor, cand_parent: torch.Tensor,
                cand_score: torch.Tensor, num_draft_tokens: int, root_children: torch.Tensor | None = None,
                cand_children: torch.Tensor | None = None, root_children_logp: torch.Tensor | None = None,
                cand_children_logp: torch.Tensor | None = None) -> DraftTree:
    """Keep the best D-1 candidates by score (ancestor-closed: a child never scores above
    its parent, and a stable sort keeps the earlier-created first among ties), ordered by
    creation (parents first).

    cand_*: [B, C] with cand_parent = -1 for children of the root; root_children [B, k]
    and cand_children [B, C, k] (-1 rows where not expanded), when given, become the
    tree's `children`, and their log-probabilities its `children_logp`.
    """
    B, C = cand_tok.shape
    keep_n = num_draft_tokens - 1
    kept = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :keep_n]
    kept = kept.sort(dim=1).values                                   # creation order
    node_of = torch.full((B, C), -1, dtype=torch.long, device=cand_tok.device)
    node_of = node_of.scatter(1, kept, torch.arange(1, keep_n + 1, device=cand_tok.device).expand(B, keep_n))
    par_cand = cand_parent.gather(1, kept)
    parents = torch.where(par_cand < 0, torch.zeros_like(par_cand), node_of.gather(1, par_cand.clamp(min=0)))
    tokens = torch.cat([root_ids[:, None], cand_tok.gather(1, kept)], dim=1)
    parents = torch.cat([torch.full((B, 1), -1, dtype=torch.long, device=cand_tok.device), parents], dim=1)
    scores = torch.cat([torch.zeros(B, 1, dtype=cand_score.dtype, device=cand_score.device),
                        cand_score.gather(1, kept)], dim=1)
    children = None
    if cand_children is not None:
        k = cand_children.shape[2]
        kept_children = cand_children.gather(1, kept[..., None].expand(B, keep_n, k))
        children = torch.cat([root_children[:, None], kept_children], dim=1)      # [B, D, k]
    children_logp = None
    if cand_children_logp is not None:
        k = cand_children_logp.shape[2]
        kept_logp = cand_children_logp.gather(1, kept[..., None].expand(B, keep_n, k))
        children_logp = torch.cat([root_children_logp[:, None], kept_logp], dim=1)  # [B, D, k]
    return DraftTree(tokens=tokens, parents=parents, scores=scores, children=children, children_logp=children_logp)
