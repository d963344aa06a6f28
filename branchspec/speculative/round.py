"""One speculative round over a batch, top to bottom.

    draft  -> the drafter grows one tree per request from its root        (drafter.propose)
    verify -> the trees become attention metadata (positions, ancestors, and
              where each completing node's pooled rows come from:
              metadata.tree_meta), then one target forward over every
              node of every tree, all it produces in scratch; then every
              request's accepted path (the target's own token at each node,
              argmax or draw) and the commit of only that path's state     (verify.verify_trees)
    extend -> the drafter follows the accepted path, and computes its
              output at the next root for the next round                  (drafter.extend)
    learn  -> what the round says about acceptance, for the calibrated
              selection and an adaptive policy                             (drafter.learn)

Before drafting, the drafter catches up on positions committed without it (plain rounds
of an adaptive policy, a deferred prompt); that time is charged to `draft_extend` and
reported apart, since it is a cost of having switched, not of this round's shape.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import SpecConfig
from branchspec.execution import Executor
from branchspec.execution.timing import PhaseClock
from branchspec.sampling import SamplingBatch, emitted_logprobs
from branchspec.speculative.drafter import Drafter
from branchspec.speculative.outcome import RoundResult
from branchspec.speculative.selection import selection_of
from branchspec.speculative.verify import verify_trees



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

        verified = verify_trees(self.executor, tree.tokens, tree.parents, ids, L, batch.sampling,
                                max_path_len=batch.budget + 1)
        out, acc = verified.out, verified.acceptance                                   # logits [B, D, V]
        path_tokens = tree.tokens.gather(1, acc.path)                                  # [B, D]
        path_len = acc.path_len.tolist()
        emitted = [(toks[1:n] + [b])[:left] for toks, n, b, left
                   in zip(path_tokens.tolist(), path_len, acc.bonus.tolist(), batch.budget.tolist())]
        # Emitted token i comes from path node i's distribution (as plain decoding's would).
        logprobs = emitted_logprobs(out.logits, acc.path, emitted, batch.sampling.num_logprobs)
        clock.lap("verify")

        self.drafter.extend(ids, L, path_tokens, out.hidden, acc.path, acc.path_len, acc.bonus, spec.num_draft_tokens)
        clock.lap("draft_extend")

        # What the round says about acceptance, for the calibrated selection's next trees and
        # an adaptive policy's next choices alike (a fixed EAGLE-2 tree or chain needs none).
        learnt = (learn or selection_of(spec).learns) and tree.children is not None
        if learnt:
            self.drafter.learn(ids, temperature, tree.children, tree.children_logp, acc.path, acc.path_len,
                               acc.bonus, path_tokens)
        clock.lap("learn")
        return RoundResult(spec=spec, emitted=emitted, path_len=path_len, logprobs=logprobs,
                           learnt=learnt, phase_seconds=clock.seconds,
                           seconds=time.perf_counter() - t0 - catch_up, catch_up_seconds=catch_up)
