"""The verify pass: one target forward over every node of every draft tree, and the
round's acceptance and commit for every request (`verify_trees`: the one place a round
accepts).

A request whose token at a node is the argmax of the raw logits (temperature 0), or a
draw from them at its temperature alone (no top-p, top-k or min-p cut), needs nothing but
the verify's own logits and its seeded uniforms (`sampling.node_draws`), so it is accepted
and committed inside the forward's own call (`verify_pass`; `SamplingBatch.untouched`): on
the fast path that is one compiled graph. The others (a cut, or logits rules) get the same
forward; their tokens are drawn from its logits afterwards (`sampling.target_tokens`) and
their paths committed by `Executor.commit`. Nothing a tree produces reaches the pools
unless it is on its request's accepted path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchspec.cache.paged import AddressInputs, locate, read_states, write_nodes
from branchspec.execution import Executor
from branchspec.model.metadata import ForwardMeta, tree_meta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.logits_process import NodePaths, process_logits
from branchspec.sampling import NodeDraws, SamplingBatch, draw_tokens, node_draws, target_tokens
from branchspec.speculative.accept import Acceptance, accept


@dataclass(frozen=True)
class VerifyPlan:
    """A verify pass's static shape: D nodes per tree, whether the plan's sizes are fixed
    by their bounds rather than by the trees (`Executor.static_shapes`), and whether some
    rows draw their tokens in the call (a graph of its own: an all-greedy batch pays
    nothing for sampling)."""

    num_draft_tokens: int
    static: bool = False
    draws: bool = False

    @property
    def label(self) -> str:
        return f"d{self.num_draft_tokens}" + ("-static" if self.static else "") + ("-draws" if self.draws else "")


@dataclass
class VerifyInputs:
    tokens: torch.Tensor          # [B, D] the trees' tokens, root first
    parents: torch.Tensor         # [B, D] each node's parent (-1: the root)
    num_committed: torch.Tensor   # [B] L: tokens committed before the round
    state: AddressInputs          # where each request's committed state lies, and a kept node's goes
    in_call: torch.Tensor         # [B] bool: accepted and committed in the call
    max_path_len: torch.Tensor    # [B] most path nodes a request may commit (its budget + 1)
    draws: NodeDraws | None = None   # the rows whose tokens are drawn in the call (None: all argmax)


@dataclass
class Verified:
    out: ForwardOutput            # logits [B, D, V], hidden [B, D, n*d], scratch
    meta: ForwardMeta             # the trees' plan (positions, ancestors, completions)
    # From `verify_trees`: every row's accepted path, committed. From `verify_pass` alone:
    # every row's path by the call's own token at each node (the argmax, or the draw of a
    # row in `draws`), committed for the rows in the call.
    acceptance: Acceptance


def verify_forward(model: Transformer, plan: VerifyPlan, x: VerifyInputs, shared: dict[str, torch.Tensor],
                   storage: dict[str, torch.Tensor]) -> Verified:
    """The trees' plan (`tree_meta`), the target's forward over their nodes reading the
    committed state from the pools' storage (at addresses computed here, `locate`), the
    target's token at every node (the argmax, or a seeded draw for the rows in `x.draws`),
    the path it takes through each tree (`accept`), and the paths of the rows accepted in
    the call written into the pools (`write_nodes`; the other rows' writes go to the sink).
    A pure function of tensors: one compiled graph per (D, batch class, draws or not) on
    the fast path."""
    meta = tree_meta(x.parents, x.num_committed, model.cfg.compressed_kinds, static=plan.static)
    out = model.forward(x.tokens, meta, read_states(model.cfg, storage, locate(model.cfg, x.state)))
    target = out.logits.argmax(dim=-1)                                                  # [B, D]
    if plan.draws:
        # A node at depth d sits at L + d and draws the token at L + d + 1.
        target = draw_tokens(out.logits, x.draws, meta.positions - x.num_committed[:, None], target)
    acc = accept(x.tokens, x.parents, meta.ancestor, target, x.max_path_len)
    write_nodes(model.cfg, storage, x.state.tables, meta, out.scratch, acc.keep & x.in_call[:, None])
    return Verified(out=out, meta=meta, acceptance=acc)


def verify_pass(executor: Executor, tokens: torch.Tensor, parents: torch.Tensor, seq_ids: list[int],
                lengths: torch.Tensor, in_call: torch.Tensor, max_path_len: torch.Tensor,
                draws: NodeDraws | None = None) -> Verified:
    """`verify_forward` over draft trees tokens, parents [B, D] on top of lengths [B]
    committed tokens, through `executor` on its paged state (their pages reserved first);
    in_call [B] bool: the rows to accept and commit in the call; max_path_len [B]; draws:
    the rows of in_call that draw their tokens (`sampling.node_draws`), the others of
    in_call take the argmax."""
    plan = VerifyPlan(tokens.shape[1], static=executor.static_shapes, draws=draws is not None)
    inputs = VerifyInputs(tokens=tokens, parents=parents, num_committed=lengths,
                          state=executor.cache.address_inputs(seq_ids, lengths, executor.addressing), in_call=in_call,
                          max_path_len=max_path_len, draws=draws)
    return executor.graph(verify_forward, plan, inputs, {}, pools=True)


def verify_trees(executor: Executor, tokens: torch.Tensor, parents: torch.Tensor, seq_ids: list[int],
                 lengths: torch.Tensor, sampling: SamplingBatch, max_path_len: torch.Tensor) -> Verified:
    """Verify draft trees tokens, parents [B, D] on top of lengths [B] committed tokens, and
    accept and commit every request's path: the target's token at each node (the argmax,
    or a draw by `sampling`, so the output is exactly the target's distribution), the path
    those tokens take through its tree (at most max_path_len [B] nodes: a round never
    commits past a request's token budget), and that path's state written to the pools.
    Rows decoded by the argmax or their temperature alone are accepted and committed in the
    forward's own call (`verify_pass`); the others' tokens are drawn from its logits
    through their rules (bias, min_tokens, penalties, cuts) and their paths committed
    after it. Returns the forward's outputs, the trees' plan and the final acceptance."""
    device = lengths.device
    untouched = sampling.untouched()                                                    # [B]
    in_call = untouched.to(device)
    draws = node_draws(sampling, untouched, lengths, tokens.shape[1], device)
    verified = verify_pass(executor, tokens, parents, seq_ids, lengths, in_call, max_path_len, draws)
    if bool(untouched.all()):
        return verified
    out, meta, by_call = verified.out, verified.meta, verified.acceptance
    # Each node's own rules see only its own prefix: the committed output and its path in
    # the tree. Logprobs stay the raw logits'.
    logits = process_logits(out.logits, sampling.rules, NodePaths.tree(tokens, meta.ancestor))
    # Each node sits at L + its depth and draws the token one further.
    drawn = accept(tokens, parents, meta.ancestor, target_tokens(logits, sampling, meta.positions + 1), max_path_len)
    rows = in_call[:, None]
    acc = Acceptance(path=torch.where(rows, by_call.path, drawn.path),
                     path_len=torch.where(in_call, by_call.path_len, drawn.path_len),
                     keep=torch.where(rows, by_call.keep, drawn.keep),
                     bonus=torch.where(in_call, by_call.bonus, drawn.bonus))
    executor.commit(seq_ids, meta, out.scratch, acc.keep & ~rows)
    return Verified(out=out, meta=meta, acceptance=acc)
