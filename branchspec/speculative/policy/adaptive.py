"""Speculation that never loses: pick the draft shape, or none, before every round.

For each candidate c (a SpecConfig, or None for a plain decode step) and the running batch
of B requests, the policy estimates

    throughput(c) = sum over requests of E[tokens emitted by one round of c] / T(c, B)

and runs the argmax. Both factors are measured, not assumed:

* **Acceptance**: the engine's measured acceptance (`calibration.AcceptanceModel`, the
  very counts the calibrated selection values nodes by), read per request as how often
  the drafter's rank-r proposal after an accepted depth-d node was the target's token
  there, on and off the drafter's main line, kept apart for greedy and sampled requests.
  Every verified round teaches it (the round does, whichever policy chose the round); the
  policy only reads it. A candidate's expected accept length is 1 (the bonus token) plus
  the sum of its best D-1 node values under that positional model
  (`acceptance.ExpectedAccept`). What the model still misses (a selection picks each
  round's tree from that round's draft probabilities) is measured as observed / predicted
  accepted tokens, per kind (chain, tree) and refined per candidate, and corrected for;
  evidence of what did not run fades, so a calibration that unlucky rounds set low is
  tried again. Plain rounds let the acceptance evidence fade too, so a few unlucky rounds
  do not rule speculation out for good.
* **Round time** (`costs.CostModel`): the time of each call a round makes (the decode
  step, the verify pass at D nodes, each candidate's drafting, the draft extend) at
  (batch, tokens or growth, committed context), measured once on this machine at start-up,
  through the execution path the engine runs (eager or compiled), and cached on disk,
  then summed per candidate (drafting + verify + draft extend, or one decode step) at the
  batch's mean context, and scaled by two factors learnt online from measured round
  times: the machine's present load, common to every candidate (a loaded server runs
  every call slower than the idle grids), and each candidate's own overhead.
* **Margins**: the choice is the largest of many noisy estimates, so it is biased high.
  Speculation must look `plain_margin` better than plain decoding, a new best must beat
  the standing choice by `switch_margin`, and a switch between plain decoding and
  speculation is judged again after `probe_rounds` rounds (`tuning.Tuning`).
* **Catch-up**: plain rounds do not feed the drafter, so speculating after them first
  costs one drafter pass over what it missed. That is paid once, so it is spread over the
  rounds the batch has left. A prompt's drafter prefill is priced the same way at
  admission (`defer_drafter`): it runs with the target's only where speculation is
  expected to win with it paid, else it waits as lag.

Every candidate is an ordinary lossless round, so whatever the policy picks, the output is
the target model's. The decision is a few small numpy operations every few rounds.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable

import numpy as np

from branchspec.config import AutoPolicy, ModelConfig, SpecConfig, spec_label
from branchspec.speculative.calibration import GREEDY, AcceptanceModel
from branchspec.speculative.policy.acceptance import ExpectedAccept
from branchspec.speculative.footprint import RoundLimits
from branchspec.speculative.policy.base import BatchView, check_speculation
from branchspec.speculative.policy.costs import CostModel
from branchspec.speculative.policy.tuning import TUNING, Tuning
from branchspec.speculative.outcome import RoundResult

KINDS = ("chain", "tree")


def _kind(spec: SpecConfig) -> str:
    return "chain" if spec.is_chain else "tree"


class AdaptivePolicy:
    """`SpecConfig.auto(...)`: chooses each round's configuration among the candidates and
    learns from its outcome (a `SpecPolicy`)."""

    name = "auto"

    def __init__(self, policy: AutoPolicy, costs: CostModel | Callable[..., CostModel], tuning: Tuning = TUNING,
                 acceptance: AcceptanceModel | None = None):
        """costs: the round-cost model, or what makes it (called with the policy on first
        need, or by `prepare`: measuring takes a while); acceptance: the engine's
        measured acceptance, which its rounds teach (its drafter's; None: a fresh one)."""
        self.policy, self.tuning = policy, tuning
        self._costs, self._make_costs = (costs, None) if isinstance(costs, CostModel) else (None, costs)
        self.configurations = policy.candidates
        self.description = (f"adaptive speculation (SpecConfig.auto: {len(policy.candidates)} candidates, "
                            f"D up to {policy.max_draft_tokens})")
        self.max_draft_tokens = policy.max_draft_tokens
        self.uses_drafter = bool(policy.speculative)
        self.reads_acceptance = True
        self.acceptance = acceptance if acceptance is not None else AcceptanceModel()
        self.specs = policy.speculative
        self.expected = ExpectedAccept(self.specs, self.acceptance.R)
        # [C] each speculative candidate's longest accepted path, the bonus included
        self._longest_path = np.array([1.0 + min(s.num_steps, s.num_draft_tokens - 1) for s in self.specs])
        self.counts: Counter[str] = Counter()        # rounds per configuration label
        self.decide_seconds = 0.0
        self.last_choice: SpecConfig | None = None
        self.last_estimate: dict[str, float] = {}
        # (accepted, predicted) drafted tokens, decayed sums per candidate label and per kind
        self.accept_sums: dict[str, tuple[float, float]] = {}
        self._predicted_per_request: float | None = None
        self._last_batch: tuple[int, ...] | None = None
        self._rounds_since = 0
        self._switched = False
        # Plain rounds over one batch not yet applied to the statistics: they only make
        # estimates drift, so they are applied together when an estimate is next needed.
        self._plain_batch: tuple[int, ...] | None = None
        self._plain_modes: list[int] = []
        self._plain_rounds = 0
        self._period_scale = 1

    @property
    def costs(self) -> CostModel:
        if self._costs is None:
            self._costs = self._make_costs(self.policy)
        return self._costs

    def prepare(self, progress: bool = False) -> None:
        """Measure (or load) the round costs now, showing progress if asked."""
        if self._costs is None:
            self._costs = self._make_costs(self.policy, progress)

    def check(self, cfg: ModelConfig, has_drafter: bool, limits: RoundLimits | None = None) -> None:
        if self.uses_drafter:
            check_speculation(self.policy.speculative, cfg, has_drafter, limits)

    def expected_accept(self, seq_ids: list[int], modes: list[int] | None = None) -> np.ndarray:
        """[B, C] each speculative candidate's expected tokens per round for each request
        (greedy ones where `modes` is None), before calibration."""
        modes = modes if modes is not None else [GREEDY] * len(seq_ids)
        q = self.acceptance.acceptance(seq_ids, modes, self.tuning.acceptance_floor, self.expected.depth,
                                       self.expected.R)
        return self.expected(q.numpy())

    def defer_drafter(self, batch: BatchView) -> bool:
        """At admission, over the running batch with the new prompts as lag: the drafter's
        prefill runs with the target's, as a fixed configuration's does, unless plain
        decoding may run and is expected to win even before that prefill is paid, the
        prefill priced like any catch-up, spread over the tokens the batch has left (a
        chat of a hundred tokens earns it back, a burst of long prompts with a few tokens
        each to go may not). Then each prompt joins its request's drafter lag, fed only if
        a speculative round comes."""
        if None not in self.policy.candidates:
            return False
        if not self.specs:
            return True
        self._settle_plain()
        options, rates, _ = self._rates(batch.seq_ids, batch.lag, batch.remaining, batch.context, batch.modes)
        rates[0] *= 1 + self.tuning.plain_margin
        return int(np.argmax(rates)) == 0

    def choose(self, batch: BatchView) -> SpecConfig | None:
        """The configuration for the next round over these requests (see `BatchView`:
        the drafter's lag, which a speculative round first feeds to it; the tokens each
        may still emit; their mean committed length, since forwards over a longer context
        cost more).

        The estimates are recomputed every `redecide_every` rounds (more at large
        batches), or at once when the batch changed; in between the last choice stands. A
        new best must beat the standing choice by `switch_margin`: near-ties are within
        the estimates' noise."""
        t0 = time.perf_counter()
        seq_ids, t = batch.seq_ids, self.tuning
        key = tuple(seq_ids)
        every = t.probe_rounds if self._switched else \
            self._period_scale * max(t.redecide_every, len(seq_ids) // t.redecide_per_requests)
        if key == self._last_batch and self._rounds_since < every - 1:
            self._rounds_since += 1
            best = self.last_choice
        else:
            best = self._decide(seq_ids, batch.lag, batch.remaining, batch.context, batch.modes)
            self._last_batch, self._rounds_since = key, 0
        self.counts[spec_label(best)] += 1
        self.decide_seconds += time.perf_counter() - t0
        return best

    def _decide(self, seq_ids: list[int], lag: list[int] | None = None,
                remaining: list[int] | None = None, context: float | None = None,
                modes: list[int] | None = None) -> SpecConfig | None:
        self._settle_plain()
        B = len(seq_ids)
        specs = self.specs
        options, rates, emitted = self._rates(seq_ids, lag, remaining, context, modes)
        estimate = {spec_label(spec): float(rate) for spec, rate in zip(options, rates)}
        judged = rates.copy()
        if options[0] is None:
            judged[0] *= 1 + self.tuning.plain_margin
        i = int(np.argmax(judged))
        best, best_rate = options[i], judged[i]
        if self._last_batch is not None and self.last_choice in self.policy.candidates:
            standing = judged[options.index(self.last_choice)]
            if best_rate < (1 + self.tuning.switch_margin) * standing:
                best = self.last_choice
        self._switched = (best is None) != (self.last_choice is None)
        # A clear winner is checked less often: the estimates move by a few percent a round.
        runner_up = np.partition(judged, -2)[-2] if len(judged) > 1 else 0.0
        lead = judged[options.index(best)] / runner_up if runner_up > 0 else math.inf
        self._period_scale = self.tuning.clear_lead_period if lead > self.tuning.clear_lead else 1
        self.last_choice, self.last_estimate = best, estimate
        self._predicted_per_request = None if best is None else float(emitted[specs.index(best)]) / B
        return best

    def _rates(self, seq_ids: list[int], lag: list[int] | None, remaining: list[int] | None,
               context: float | None, modes: list[int] | None
               ) -> tuple[list[SpecConfig | None], np.ndarray, np.ndarray | None]:
        """Every option (plain decoding first, where a candidate), its expected emitted
        tokens per second over these requests [options], and each speculative candidate's
        expected tokens per round by the positional model [C] (None without any)."""
        B = len(seq_ids)
        specs = self.specs
        options: list[SpecConfig | None] = ([None] if None in self.policy.candidates else []) + list(specs)
        rates = np.empty(len(options))
        if options[0] is None:
            rates[0] = B / self.costs.round_seconds(None, B, context)
        emitted = None
        if specs:
            per_request = self.expected_accept(seq_ids, modes)                # [B, C]
            # A round emits at most its deepest path plus the bonus, and never more than a
            # request has left: the most each request can emit [B, C].
            most = np.broadcast_to(self._longest_path, per_request.shape)
            if remaining:
                most = np.minimum(most, np.maximum(np.asarray(remaining, float), 1.0)[:, None])
            per_request = np.minimum(per_request, most)
            emitted = per_request.sum(axis=0)                                # [C], the model's own estimate
            tokens, seconds = self._speculative(emitted, B, context)
            # Calibrated (observed / predicted, learnt over the kind's other shapes too), an
            # estimate may not pass what the round can emit either.
            tokens = np.minimum(tokens, most.sum(axis=0))
            # Speculating now first feeds the drafter what it has not followed (a deferred
            # prompt, plain rounds): paid once, so spread over the rounds the batch has left.
            if lag and max(lag) > 0:
                left = float(np.mean(remaining)) if remaining else 0.0
                seconds = seconds + self.costs.catch_up_seconds(B, max(lag), context) / np.maximum(1.0, left * B / tokens)
            rates[len(options) - len(specs):] = tokens / seconds
        return options, rates, emitted

    def _speculative(self, emitted: np.ndarray, B: int, context: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each speculative candidate's calibrated tokens per round and round seconds [C],
        for B requests whose positional model expects `emitted` [C] tokens a round in all."""
        calibration = np.array([self.calibration(spec) for spec in self.specs])
        return B + calibration * (emitted - B), self.costs.round_seconds_of(self.specs, B, context)

    def observe(self, batch: BatchView, result: RoundResult) -> None:
        """The outcome of the round `choose` picked over `batch`: its wall time, and for a
        speculative round its accepted path lengths against the prediction. (What it says
        about acceptance, the round itself taught the engine's `AcceptanceModel`.)"""
        t0 = time.perf_counter()
        spec, seq_ids = result.spec, batch.seq_ids
        self.costs.observe(spec, len(seq_ids), result.seconds, batch.context)
        if spec is None:
            key = tuple(seq_ids)
            if key != self._plain_batch:
                self._settle_plain()
                self._plain_batch, self._plain_modes = key, list(batch.modes or [GREEDY] * len(key))
            self._plain_rounds += 1
        elif result.learnt:
            self._settle_plain()
            if self._predicted_per_request is not None and spec is self.last_choice:
                self._calibrate(spec, float(sum(result.path_len)), self._predicted_per_request * len(seq_ids),
                                len(seq_ids))
        self.decide_seconds += time.perf_counter() - t0

    def _settle_plain(self) -> None:
        """Apply the plain rounds seen since the last estimate: each request's acceptance
        decays, the engine-wide acceptance drifts towards the prior and every calibration
        towards level (by `plain_fade` a round), exactly as one round at a time would."""
        if self._plain_rounds:
            batch, n = self._plain_batch, self._plain_rounds
            self.acceptance.relax(list(batch), self._plain_modes, n, self.tuning.relax_rate)
            self._fade_calibration(self.tuning.plain_fade ** n)
        self._plain_batch, self._plain_rounds = None, 0

    def calibration(self, spec: SpecConfig) -> float:
        """Observed / predicted drafted tokens accepted: the kind's (chain or tree) ratio of
        decayed sums that start level (`calibration_prior` tokens each), refined by this
        candidate's own evidence (`label_weight`). It absorbs what the positional model
        misses: EAGLE-2 picks each round's tree by that round's draft confidence, and
        acceptance at one depth is not independent of the next."""
        self._settle_plain()
        seen, predicted = self.accept_sums.get(_kind(spec), (1.0, 1.0))
        level = seen / predicted
        own = self.accept_sums.get(spec_label(spec))
        if own is None:
            return level
        w = self.tuning.label_weight
        return (own[0] + w * level) / (own[1] + w)

    def _calibrate(self, spec: SpecConfig, observed: float, predicted: float, batch: int) -> None:
        t = self.tuning
        keep = t.calibration_keep
        drafted_pred, drafted_seen = max(predicted - batch, 0.0), max(observed - batch, 0.0)
        label, kind = spec_label(spec), _kind(spec)
        self._fade_calibration(t.calibration_fade, skip=(label, kind))
        seen, pred = self.accept_sums.get(label, (0.0, 0.0))
        self.accept_sums[label] = (keep * seen + drafted_seen, keep * pred + drafted_pred)
        seen, pred = self.accept_sums.get(kind, (t.calibration_prior, t.calibration_prior))
        self.accept_sums[kind] = (keep * seen + drafted_seen, keep * pred + drafted_pred)

    def _fade_calibration(self, keep: float, skip: tuple[str, ...] = ()) -> None:
        """Each kind's sums drift towards level by 1 - keep, and each shape's own evidence
        fades by `keep`; those named in `skip` (the ones that just ran) excepted."""
        for key, (seen, predicted) in self.accept_sums.items():
            if key in skip:
                continue
            if key in KINDS:
                prior = self.tuning.calibration_prior
                self.accept_sums[key] = (keep * seen + (1 - keep) * prior, keep * predicted + (1 - keep) * prior)
            else:
                self.accept_sums[key] = (keep * seen, keep * predicted)

    def forget(self, seq_id: int) -> None:
        self._settle_plain()
        self.acceptance.forget(seq_id)
