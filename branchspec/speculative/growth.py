"""Growing a round's draft trees: one function of tensors, so that the compiled path can
run a whole growth (every frontier forward, top-k, scoring and the final selection) as a
single graph, and the eager path runs the very same code.

EAGLE-2's growth with SGLang's three knobs (see `drafter.py` for the method). Every shape
here follows from the configuration (`GrowthPlan`), the batch and the drafter's committed
window, so nothing in it reads a tensor's value back to Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchspec.cache.paged import BlockTables, read_mtp
from branchspec.config import SpecConfig
from branchspec.model.attention import LayerState
from branchspec.model.metadata import build_meta
from branchspec.model.model import Transformer
from branchspec.speculative.calibration import edge_log_values
from branchspec.speculative.tree import DraftTree, select_tree


@dataclass(frozen=True)
class GrowthPlan:
    """What a growth's shapes and branches depend on (a compiled growth is one graph per plan)."""

    num_steps: int
    topk: int
    num_draft_tokens: int
    # rank by measured acceptance, valuing each request's children at its temperature
    # (else by EAGLE-2's cumulative draft log-probability)
    calibrated: bool = False
    reduced_vocab: bool = False  # draft over a reduced vocabulary (head rows and token ids given)

    @property
    def label(self) -> str:
        """Its configuration's label (`SpecConfig.label`), and whether it drafts a reduced vocabulary."""
        spec = SpecConfig(self.num_steps, self.topk, self.num_draft_tokens,
                          selection="calibrated" if self.calibrated else "eagle2")
        return spec.label + (" reduced vocab" if self.reduced_vocab else "")


@dataclass
class GrowthInputs:
    """The batch's tensors a growth starts from (B requests; N drafted tokens)."""

    root_ids: torch.Tensor        # [B] the root tokens, at position L
    root_k: torch.Tensor          # [B, 1, d_h] the root's MTP key
    root_hidden: torch.Tensor     # [B, 1, n*d] its MTP hidden state
    root_logits: torch.Tensor     # [B, N] its drafter logits
    num_committed: torch.Tensor   # [B] L
    tables: BlockTables           # the batch's "mtp" block tables (its KV for positions < L)
    # The temperature each request's children are valued (calibrated selection) and learnt
    # (`AcceptanceModel.observe`) at [B] (1: greedy).
    scale: torch.Tensor
    # The calibrated selection's log calibration factors [B, 2, depths, ranks, buckets]
    # (`AcceptanceModel.log_factors`).
    log_q: torch.Tensor | None = None


# What every request shares (`grow_trees`'s `shared`, not batched): "head_rows" [N, n*d]
# and "vocab_ids" [N], a reduced vocabulary's LM-head rows and token ids; "prob_edges",
# the calibration's probability buckets' upper edges.
SHARED = ("head_rows", "vocab_ids", "prob_edges")


def grow_trees(model: Transformer, plan: GrowthPlan, x: GrowthInputs, shared: dict[str, torch.Tensor],
               storage: dict[str, torch.Tensor]) -> DraftTree:
    """Grow one tree per request from its root's drafter output (`GrowthInputs`), with
    the tensors every request shares (`SHARED`; those the plan does not use may be absent)
    and the paged state's storage, which it only reads (the drafter's committed KV).

    Candidates carry two scores: `cand_score`, the cumulative draft log-probability, and
    `cand_value`, what the selection ranks by (the same score for EAGLE-2; the sum of log q
    along the path for the calibrated selection). The drafter's attention is tree-masked:
    a frontier node sees the committed drafter KV plus its own ancestors' MTP keys."""
    k = plan.topk
    B = x.root_ids.shape[0]
    device = x.root_ids.device
    bidx = torch.arange(B, device=device)[:, None]
    arange_k = torch.arange(k, device=device)

    def logits_of(hidden: torch.Tensor) -> torch.Tensor:            # [..., n*d] -> [..., N]
        return model.mtp_logits(hidden, shared["head_rows"] if plan.reduced_vocab else None)

    def token_ids(index: torch.Tensor) -> torch.Tensor:             # drafted-vocabulary index -> token id
        return shared["vocab_ids"][index] if plan.reduced_vocab else index

    def value_logp(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of the chosen children at each request's temperature."""
        view = x.scale.view(-1, *([1] * (logits.dim() - 1)))
        return torch.log_softmax(logits.float() / view, dim=-1).gather(-1, index)

    def edge_values(depth: int, parent_main: torch.Tensor | None, logp: torch.Tensor) -> torch.Tensor:
        return edge_log_values(x.log_q, shared["prob_edges"], depth, parent_main, logp)

    slot_k = x.root_k                                               # [B, X, d_h] keys of expanded nodes
    slot_pos = x.num_committed[:, None]                             # [B, X]
    slot_hidden = x.root_hidden                                     # [B, X, n*d]
    logp = torch.log_softmax(x.root_logits.float(), dim=-1)
    cand_score, cand_index = logp.topk(k, dim=-1)                   # [B, k]
    cand_tok = token_ids(cand_index)
    root_lp = value_logp(x.root_logits, cand_index)                 # [B, k]
    cand_value = edge_values(1, None, root_lp[:, None])[:, 0] if plan.calibrated else cand_score   # the root: main line
    cand_main = (arange_k == 0).expand(B, k)                        # [B, C] on the main line
    cand_parent = torch.full((B, k), -1, dtype=torch.long, device=device)   # candidate index, -1 root
    cand_slot_parent = torch.zeros(B, k, dtype=torch.long, device=device)   # parent's expanded slot
    cand_anc = torch.ones(B, k, 1, dtype=torch.bool, device=device)         # [B, C, X] ancestor slots
    frontier = arange_k.expand(B, k)                                # candidate indices
    cand_children = torch.full((B, k, k), -1, dtype=torch.long, device=device)   # [B, C, k]
    cand_children_logp = torch.zeros(B, k, k, device=device)                      # their log-probabilities
    committed = read_mtp(model.cfg, storage, x.tables, x.num_committed)   # the drafter's KV, read in the graph
    Wc = committed.raw_k.shape[1]
    eye_k = torch.eye(k, dtype=torch.bool, device=device)

    for step in range(1, plan.num_steps):
        X = slot_k.shape[1]
        tokens = cand_tok.gather(1, frontier)                       # [B, k]
        prev = slot_hidden[bidx, cand_slot_parent.gather(1, frontier)]          # [B, k, n*d]
        anc = cand_anc[bidx, frontier]                              # [B, k, X]
        # Frontier nodes sit at depth `step`; among themselves they are siblings.
        positions = (x.num_committed + step)[:, None].expand(B, k).contiguous()
        meta = build_meta(positions, x.num_committed, eye_k.expand(B, k, k),
                          torch.ones(B, k, dtype=torch.bool, device=device), ())
        state = LayerState(raw_k=torch.cat([committed.raw_k, slot_k], dim=1),
                           raw_pos=torch.cat([committed.raw_pos, slot_pos], dim=1),
                           raw_valid=torch.cat([committed.raw_valid.expand(B, k, Wc), anc], dim=2))
        out = model.mtp_forward(tokens, prev, meta, state, logits=False)
        new_slots = X + arange_k                                    # slots of the expanded frontier
        slot_k = torch.cat([slot_k, out.scratch[0].k], dim=1)
        slot_pos = torch.cat([slot_pos, positions], dim=1)
        slot_hidden = torch.cat([slot_hidden, out.hidden], dim=1)

        # Children: k per frontier node, scored by cumulative log-probability (and valued
        # by the calibrated selection's measured acceptance).
        logits = logits_of(out.hidden)                                          # [B, k, N]
        child_lp, child_index = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)   # [B, k, k]
        child_tok = token_ids(child_index)
        child_vlp = value_logp(logits, child_index)
        child_score = (cand_score.gather(1, frontier)[..., None] + child_lp).reshape(B, k * k)
        parent_main = cand_main.gather(1, frontier)                             # [B, k]
        if plan.calibrated:
            edge = edge_values(step + 1, parent_main, child_vlp)
            child_value = (cand_value.gather(1, frontier)[..., None] + edge).reshape(B, k * k)
        else:
            child_value = child_score
        child_main = (parent_main[..., None] & (arange_k == 0)).reshape(B, k * k)
        child_parent = frontier[..., None].expand(B, k, k).reshape(B, k * k)
        child_slot_parent = new_slots[None, :, None].expand(B, k, k).reshape(B, k * k)
        own = torch.cat([torch.zeros(k, X, dtype=torch.bool, device=device), eye_k], dim=1)   # [k, X + k]
        child_anc = torch.cat([anc, torch.zeros(B, k, k, dtype=torch.bool, device=device)], 2) | own
        child_anc = child_anc[:, :, None, :].expand(B, k, k, X + k).reshape(B, k * k, X + k)

        C = cand_tok.shape[1]
        at_frontier = frontier[..., None].expand(B, k, k)
        cand_children = torch.cat([cand_children.scatter(1, at_frontier, child_tok),
                                   torch.full((B, k * k, k), -1, dtype=torch.long, device=device)], dim=1)
        cand_children_logp = torch.cat([cand_children_logp.scatter(1, at_frontier, child_vlp),
                                        torch.zeros(B, k * k, k, device=device)], dim=1)
        cand_value = torch.cat([cand_value, child_value], dim=1)
        cand_main = torch.cat([cand_main, child_main], dim=1)
        cand_tok = torch.cat([cand_tok, child_tok.reshape(B, k * k)], dim=1)
        cand_score = torch.cat([cand_score, child_score], dim=1)
        cand_parent = torch.cat([cand_parent, child_parent], dim=1)
        cand_slot_parent = torch.cat([cand_slot_parent, child_slot_parent], dim=1)
        cand_anc = torch.cat([torch.cat([cand_anc, torch.zeros(B, C, k, dtype=torch.bool, device=device)], 2),
                              child_anc], dim=1)
        best = torch.sort(child_value, dim=1, descending=True, stable=True).indices[:, :k]
        frontier = C + best

    return select_tree(x.root_ids, cand_tok, cand_parent, cand_value, plan.num_draft_tokens, cand_tok[:, :k],
                       cand_children, root_lp, cand_children_logp)

