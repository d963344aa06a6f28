"""The verify pass: one target forward over every node of every draft tree and, for the
requests decoded greedily, their acceptance and commit in the same call.

Greedy acceptance needs nothing but the verify's own logits (each node's argmax), so a
request whose token is the argmax of the raw logits (temperature 0 and no logits rules)
is accepted and committed inside the call: on the fast path that is one compiled graph,
where accepting and committing were about a millisecond of eager ops between graphs at
batch 1. The others (sampled, or with rules) get the same forward; their tokens are drawn
from its logits afterwards (`sampling.target_tokens`) and their paths committed by
`Executor.commit`. Nothing a tree produces reaches the pools unless it is on its
request's accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchspec.cache.paged import AddressInputs, locate, read_states, write_nodes
from branchspec.execution import Executor
from branchspec.model.metadata import ForwardMeta, tree_meta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.speculative.accept import Acceptance, accept


@dataclass(frozen=True)
class VerifyPlan:
    """A verify pass's static shape: D nodes per tree, and whether the plan's sizes are
    fixed by their bounds rather than by the trees (`Executor.static_shapes`)."""

    num_draft_tokens: int
    static: bool = False

    @property
    def label(self) -> str:
        return f"d{self.num_draft_tokens}" + ("-static" if self.static else "")


@dataclass
class VerifyInputs:
    tokens: torch.Tensor          # [B, D] the trees' tokens, root first
    parents: torch.Tensor         # [B, D] each node's parent (-1: the root)
    num_committed: torch.Tensor   # [B] L: tokens committed before the round
    state: AddressInputs          # where each request's committed state lies, and a kept node's goes
    greedy: torch.Tensor          # [B] bool: accepted by the argmax and committed in the call
    max_path_len: torch.Tensor    # [B] most path nodes a request may commit (its budget + 1)


@dataclass
class Verified:
    out: ForwardOutput            # logits [B, D, V], hidden [B, D, n*d], scratch
    meta: ForwardMeta             # the trees' plan (positions, ancestors, completions)
    # Every row's path by the argmax at each node: for the greedy rows the accepted path,
    # already committed; for the others only a by-product, replaced by their draws.
    greedy: Acceptance


def verify_forward(model: Transformer, plan: VerifyPlan, x: VerifyInputs, shared: dict[str, torch.Tensor],
                   storage: dict[str, torch.Tensor]) -> Verified:
    """The trees' plan (`tree_meta`), the target's forward over their nodes reading the
    committed state from the pools' storage (at addresses computed here, `locate`), the argmax path through each tree
    (`accept`), and the greedy rows' paths written into the pools (`write_nodes`; the
    other rows' writes go to the sink). A pure function of tensors: one compiled graph
    per (D, batch class) on the fast path."""
    meta = tree_meta(x.parents, x.num_committed, model.cfg.compressed_kinds, static=plan.static)
    out = model.forward(x.tokens, meta, read_states(model.cfg, storage, locate(model.cfg, x.state)))
    acc = accept(x.tokens, x.parents, meta.ancestor, out.logits.argmax(dim=-1), x.max_path_len)
    write_nodes(model.cfg, storage, x.state.tables, meta, out.scratch, acc.keep & x.greedy[:, None])
    return Verified(out=out, meta=meta, greedy=acc)


def verify_trees(executor: Executor, tokens: torch.Tensor, parents: torch.Tensor, seq_ids: list[int],
                 lengths: torch.Tensor, greedy: torch.Tensor, max_path_len: torch.Tensor) -> Verified:
    """`verify_forward` over draft trees tokens, parents [B, D] on top of lengths [B]
    committed tokens, through `executor` on its paged state (their pages reserved first);
    greedy [B] bool: the rows to accept and commit in the call; max_path_len [B]."""
    static, cache = executor.static_shapes, executor.cache
    plan = VerifyPlan(tokens.shape[1], static=static)
    inputs = VerifyInputs(tokens=tokens, parents=parents, num_committed=lengths,
                          state=cache.address_inputs(seq_ids, lengths, whole_pages=static), greedy=greedy,
                          max_path_len=max_path_len)
    return executor.graph(verify_forward, plan, inputs, {}, pools=True)
