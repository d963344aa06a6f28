"""One speculative round over a batch, top to bottom.

    draft  -> the drafter grows one tree per request from its root        (drafter.propose)
    verify -> the trees become attention metadata (positions, ancestors, and
              where each completing node's pooled rows come from:
              metadata.tree_meta), then one target forward over every
              node of every tree, all it produces in scratch; for the
              requests decoded by argmax or temperature alone also
              accept and commit, in the same call                         (verify.verify_trees)
    accept -> the path of nodes whose tokens are the target's own         (accept.accept)
    commit -> copy only the accepted path's scratch into the pools        (executor.commit)
    extend -> the drafter follows the accepted path, and computes its
              output at the next root for the next round                  (drafter.extend)

Before drafting, the drafter catches up on positions committed without it (plain rounds
of an adaptive policy, a deferred prompt); that time is charged to `draft_extend` and
reported apart, since it is a cost of having switched, not of this round's shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import SpecConfig
from branchspec.execution import Executor
from branchspec.execution.timing import PhaseClock
from branchspec.logits_process import NodePaths, process_logits
from branchspec.sampling import SamplingBatch, emitted_logprobs, node_draws, target_tokens
from branchspec.speculative.accept import Acceptance, accept
from branchspec.speculative.drafter import Drafter
from branchspec.speculative.verify import verify_trees

ROUND_PHASES = ("draft", "verify", "accept", "commit", "draft_extend")


@dataclass(frozen=True)
class RoundBatch:
    """The running requests of one step, as tensors (the engine's runner builds it).

    Terms: request b has committed lengths[b] = L tokens (their target state is in the
    pools); its *root* is the last emitted token, at position L, not yet fed through the
    target."""

    seq_ids: list[int]
    lengths: torch.Tensor        # [B] committed L
    roots: torch.Tensor          # [B] root token ids
    budget: torch.Tensor         # [B] tokens each request may still emit (>= 1)
    sampling: SamplingBatch

    @property
    def size(self) -> int:
        return len(self.seq_ids)


@dataclass
class RoundResult:
    """What one step (a plain decode step or a speculative round) produced."""

    spec: SpecConfig | None      # the configuration that ran (None: a plain decode step)
    emitted: list[list[int]]     # per request, the tokens this step adds to its output
    path_len: list[int]          # per request, accepted nodes incl. the root (= tokens committed)
    # per request, one {token_id: logprob} per emitted token, or None where not asked for
    logprobs: list[list[dict[int, float]] | None] | None = None
    # Whether the round taught the engine's measured acceptance (what an adaptive policy
    # reads); a fixed EAGLE-2 configuration's rounds teach nothing.
    learnt: bool = False
    phase_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0             # the step's own wall time, catch-up excluded
    catch_up_seconds: float = 0.0    # feeding the drafter what it had not followed


class SpeculativeRound:
    """Runs speculative rounds with one drafter, one execution path and one paged state."""

    def __init__(self, executor: Executor, cache: PagedState, drafter: Drafter):
        self.executor, self.cache, self.drafter = executor, cache, drafter
        self.sync = cache.device.type == "cuda"

    @torch.no_grad()
    def run(self, batch: RoundBatch, spec: SpecConfig, learn: bool = False) -> RoundResult:
        """One round of `spec`. What it says about acceptance teaches the drafter's
        measured acceptance when `learn` (an adaptive policy reads it) or when the
        calibrated selection chose its trees (its next trees are valued by it)."""
        t0 = time.perf_counter()
        clock = PhaseClock(self.sync)
        ids, L = batch.seq_ids, batch.lengths

        self.drafter.catch_up(ids, L)
        clock.lap("draft_extend")
        catch_up = clock.seconds["draft_extend"]

        temperature = batch.sampling.temperature.tolist()
        tree = self.drafter.propose(ids, L, batch.roots, spec, temperature)  # tokens, parents: [B, D]
        clock.lap("draft")

        # Rows decoded by the argmax or by their temperature alone are accepted and committed
        # inside the verify call; rows with a cut or logits rules after it.
        untouched = batch.sampling.untouched()                                         # [B]
        all_in_call = bool(untouched.all())
        draws = node_draws(batch.sampling, untouched, L, spec.num_draft_tokens, L.device)
        in_call = untouched.to(L.device)
        max_path_len = batch.budget + 1     # a round never commits past a request's token budget
        verified = verify_trees(self.executor, tree.tokens, tree.parents, ids, L, in_call, max_path_len, draws)
        out, meta, acc = verified.out, verified.meta, verified.acceptance            # logits [B, D, V]
        clock.lap("verify")

        if not all_in_call:
            acc = self._accept_drawn(batch, tree, out, meta, in_call, acc, max_path_len)
        path_tokens = tree.tokens.gather(1, acc.path)                       # [B, D]
        path_len = acc.path_len.tolist()
        budget = batch.budget.tolist()
        emitted = [(toks[1:n] + [b])[:left] for toks, n, b, left
                   in zip(path_tokens.tolist(), path_len, acc.bonus.tolist(), budget)]
        # Emitted token i comes from path node i's distribution (as plain decoding's would).
        logprobs = emitted_logprobs(out.logits, acc.path, emitted, batch.sampling.num_logprobs)
        clock.lap("accept")

        if not all_in_call:
            self.executor.commit(ids, meta, out.scratch, acc.keep & ~in_call[:, None])
        clock.lap("commit")

        self.drafter.extend(ids, L, path_tokens, out.hidden, acc.path, acc.path_len, acc.bonus, spec.num_draft_tokens)
        clock.lap("draft_extend")

        # What the round says about acceptance, for the calibrated selection's next trees and
        # an adaptive policy's next choices alike (a fixed EAGLE-2 tree or chain needs none).
        learnt = (learn or spec.selection == "calibrated") and tree.children is not None
        if learnt:
            self.drafter.learn(ids, temperature, tree.children, tree.children_logp, acc.path, acc.path_len,
                               acc.bonus, path_tokens)
        return RoundResult(spec=spec, emitted=emitted, path_len=path_len, logprobs=logprobs,
                           learnt=learnt, phase_seconds=clock.seconds,
                           seconds=time.perf_counter() - t0 - catch_up, catch_up_seconds=catch_up)

    @staticmethod
    def _accept_drawn(batch: RoundBatch, tree, out, meta, in_call: torch.Tensor, by_call: Acceptance,
                      max_path_len: torch.Tensor) -> Acceptance:
        """The accepted paths where the verify call did not accept them (rows with a top-p,
        top-k or min-p cut, rows with logits rules): the target's token at every node drawn
        from its processed logits, and the path they take; the rows accepted in the call
        keep the path it committed."""
        # Each node's own rules (bias, min_tokens, penalties) see only its own prefix: the
        # committed output and its path in the tree. Logprobs stay the raw logits'.
        logits = process_logits(out.logits, batch.sampling.rules, NodePaths.tree(tree.tokens, meta.ancestor))
        # Each node sits at L + its depth and draws the token one further.
        target = target_tokens(logits, batch.sampling, meta.positions + 1)   # [B, D]
        drawn = accept(tree.tokens, tree.parents, meta.ancestor, target, max_path_len=max_path_len)
        rows = in_call[:, None]
        return Acceptance(path=torch.where(rows, by_call.path, drawn.path),
                          path_len=torch.where(in_call, by_call.path_len, drawn.path_len),
                          keep=torch.where(rows, by_call.keep, drawn.keep),
                          bonus=torch.where(in_call, by_call.bonus, drawn.bonus))
