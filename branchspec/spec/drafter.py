"""The MTP drafter and EAGLE-2-style tree growth with SGLang's three knobs.

Step 1 runs the MTP block on the root (the last emitted token, with the target's hidden
state before it) and takes its top-k children. Every later step runs the block on the
current frontier, chained on each node's parent's MTP hidden state, scores the top-k
children of every frontier node by cumulative draft log-probability, and keeps the best
`topk` of them as the next frontier. At the end the best D-1 candidates are kept. Since a
child's score never exceeds its parent's and a stable sort keeps earlier-created nodes
first among ties, the kept set is closed under ancestors; ordering it by creation puts
parents before children.

The drafter's attention is tree-masked: a frontier node sees the committed drafter KV plus
the MTP keys of its own ancestors (root slot included), never a sibling's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Protocol

import torch

from branchspec.config import SpecConfig
from branchspec.model.attention import LayerState
from branchspec.model.metadata import build_meta, chain_meta
from branchspec.model.model import Transformer


@dataclass
class DraftTree:
    """The trees of a batch: node 0 is the root, parents precede children."""

    tokens: torch.Tensor      # [B, D] token ids, tokens[:, 0] = root
    parents: torch.Tensor     # [B, D] parent node index, -1 for the root
    scores: torch.Tensor      # [B, D] cumulative draft log-probability, 0 for the root
    # [B, D, topk] the drafter's top-k proposals after each node, best first, whether or not
    # they were kept; -1 for nodes the drafter did not expand. An adaptive policy compares
    # them with the target's tokens to learn acceptance by depth and rank without bias.
    children: torch.Tensor | None = None


@dataclass
class DraftRoot:
    """The drafter's output at a round's root, computed ahead: the previous round's draft
    extend feeds the committed path and, one node further, the new root (the bonus token,
    after the last accepted node's target hidden state), so the next round grows its tree
    from here with one drafter forward fewer (as SGLang fuses them)."""

    k: torch.Tensor        # [B, 1, d_h] the root's MTP key (at position L, not committed)
    hidden: torch.Tensor   # [B, 1, n*d] its MTP hidden state
    logits: torch.Tensor   # [B, V]

    def row(self, b: int) -> "DraftRoot":
        return DraftRoot(self.k[b:b + 1], self.hidden[b:b + 1], self.logits[b:b + 1])

    @staticmethod
    def stack(rows: list["DraftRoot"]) -> "DraftRoot":
        return DraftRoot(torch.cat([r.k for r in rows]), torch.cat([r.hidden for r in rows]),
                         torch.cat([r.logits for r in rows]))


class Drafter(Protocol):
    def draft(self, root_ids: torch.Tensor, prev_hidden: torch.Tensor, num_committed: torch.Tensor,
              committed: LayerState, spec: SpecConfig, root: DraftRoot | None = None) -> DraftTree: ...


class MTPDrafter:
    """Grows draft trees with the model's own MTP block."""

    def __init__(self, model: Transformer):
        if not model.mtp:
            raise ValueError("the checkpoint has no MTP block (num_mtp_layers = 0); it cannot draft")
        self.model = model
        # Without the LM head: the drafter applies it (`mtp_logits`) where it needs logits.
        # The runner swaps in a compiled one.
        self.mtp_forward = functools.partial(model.mtp_forward, logits=False)

    @torch.no_grad()
    def draft(self, root_ids: torch.Tensor, prev_hidden: torch.Tensor, num_committed: torch.Tensor,
              committed: LayerState, spec: SpecConfig, root: DraftRoot | None = None) -> DraftTree:
        """root_ids: [B]; prev_hidden: [B, d] target hidden at L-1; num_committed: [B] L;
        committed: the drafter's KV for positions < L (from the paged pool); root: the
        drafter's output at the root when already computed (`DraftRoot`)."""
        k, D = spec.topk, spec.num_draft_tokens
        B = root_ids.shape[0]
        device = root_ids.device
        bidx = torch.arange(B, device=device)[:, None]

        # Step 1: the root's MTP slot at position L.
        if root is None:
            out = self.mtp_forward(root_ids[:, None], prev_hidden[:, None],
                                   chain_meta(num_committed, 1, (), max_new=1), committed)
            root = DraftRoot(k=out.scratch[0].k, hidden=out.hidden, logits=self.model.mtp_logits(out.hidden[:, 0]))
        slot_k = root.k                                             # [B, X, d_h] keys of expanded nodes
        slot_pos = num_committed[:, None].clone()                   # [B, X]
        slot_hidden = root.hidden                                   # [B, X, d]
        logp = torch.log_softmax(root.logits.float(), dim=-1)
        cand_score, cand_tok = logp.topk(k, dim=-1)                 # [B, k]
        cand_parent = torch.full((B, k), -1, dtype=torch.long, device=device)   # candidate index, -1 root
        cand_slot_parent = torch.zeros(B, k, dtype=torch.long, device=device)   # parent's expanded slot
        cand_anc = torch.ones(B, k, 1, dtype=torch.bool, device=device)         # [B, C, X] ancestor slots
        frontier = torch.arange(k, device=device).expand(B, k)      # candidate indices
        root_children = cand_tok
        cand_children = torch.full((B, k, k), -1, dtype=torch.long, device=device)   # [B, C, k]

        for step in range(1, spec.num_steps):
            X = slot_k.shape[1]
            tokens = cand_tok.gather(1, frontier)                   # [B, k]
            prev = slot_hidden[bidx, cand_slot_parent.gather(1, frontier)]      # [B, k, d]
            anc = cand_anc[bidx, frontier]                          # [B, k, X]
            # Frontier nodes sit at depth `step`; among themselves they are siblings.
            positions = (num_committed + step)[:, None].expand(B, k).contiguous()
            meta = build_meta(positions, num_committed,
                              torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k),
                              torch.ones(B, k, dtype=torch.bool, device=device), ())
            Wc = committed.raw_k.shape[1]
            state = LayerState(
                raw_k=torch.cat([committed.raw_k, slot_k], dim=1),
                raw_pos=torch.cat([committed.raw_pos, slot_pos], dim=1),
                raw_valid=torch.cat([committed.raw_valid.expand(B, k, Wc), anc], dim=2))
            out = self.mtp_forward(tokens, prev, meta, state)
            new_slots = X + torch.arange(k, device=device)           # slots of the expanded frontier
            slot_k = torch.cat([slot_k, out.scratch[0].k], dim=1)
            slot_pos = torch.cat([slot_pos, positions], dim=1)
            slot_hidden = torch.cat([slot_hidden, out.hidden], dim=1)

            # Children: k per frontier node, scored by cumulative log-probability.
            logp = torch.log_softmax(self.model.mtp_logits(out.hidden).float(), dim=-1)   # [B, k, V]
            child_lp, child_tok = logp.topk(k, dim=-1)               # [B, k, k]
            child_score = (cand_score.gather(1, frontier)[..., None] + child_lp).reshape(B, k * k)
            child_parent = frontier[..., None].expand(B, k, k).reshape(B, k * k)
            child_slot_parent = new_slots[None, :, None].expand(B, k, k).reshape(B, k * k)
            own = torch.zeros(B, k, X + k, dtype=torch.bool, device=device)
            own[..., X:] = torch.eye(k, dtype=torch.bool, device=device)
            child_anc = torch.cat([anc, torch.zeros(B, k, k, dtype=torch.bool, device=device)], 2) | own
            child_anc = child_anc[:, :, None, :].expand(B, k, k, X + k).reshape(B, k * k, X + k)

            C = cand_tok.shape[1]
            cand_children = cand_children.scatter(1, frontier[..., None].expand(B, k, k), child_tok)
            cand_children = torch.cat([cand_children, torch.full((B, k * k, k), -1, dtype=torch.long,
                                                                 device=device)], dim=1)
            cand_tok = torch.cat([cand_tok, child_tok.reshape(B, k * k)], dim=1)
            cand_score = torch.cat([cand_score, child_score], dim=1)
            cand_parent = torch.cat([cand_parent, child_parent], dim=1)
            cand_slot_parent = torch.cat([cand_slot_parent, child_slot_parent], dim=1)
            cand_anc = torch.cat([torch.cat([cand_anc, torch.zeros(B, C, k, dtype=torch.bool, device=device)], 2),
                                  child_anc], dim=1)
            best = torch.sort(child_score, dim=1, descending=True, stable=True).indices[:, :k]
            frontier = C + best

        return select_tree(root_ids, cand_tok, cand_parent, cand_score, D, root_children, cand_children)


def select_tree(root_ids: torch.Tensor, cand_tok: torch.Tensor, cand_parent: torch.Tensor,
                cand_score: torch.Tensor, num_draft_tokens: int, root_children: torch.Tensor | None = None,
                cand_children: torch.Tensor | None = None) -> DraftTree:
    """Keep the best D-1 candidates (ancestor-closed), ordered by creation (parents first).

    cand_*: [B, C] with cand_parent = -1 for children of the root; root_children [B, k]
    and cand_children [B, C, k] (-1 rows where not expanded), when given, become the
    tree's `children`.
    """
    B, C = cand_tok.shape
    keep_n = num_draft_tokens - 1
    kept = torch.sort(cand_score, dim=1, descending=True, stable=True).indices[:, :keep_n]
    kept = kept.sort(dim=1).values                                   # creation order
    node_of = torch.full((B, C), -1, dtype=torch.long, device=cand_tok.device)
    node_of.scatter_(1, kept, torch.arange(1, keep_n + 1, device=cand_tok.device).expand(B, keep_n))
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
    return DraftTree(tokens=tokens, parents=parents, scores=scores, children=children)
