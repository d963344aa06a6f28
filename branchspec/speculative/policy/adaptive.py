"""Speculation that never loses: pick the draft shape, or none, before every round.

For each candidate c (a SpecConfig, or None for a plain decode step) and the running batch
of B requests, the policy estimates its speed over plain decoding,

    value(c) = (E[tokens one round of c emits] / B) / (c's round in plain decode steps),

as a mean and a variance (of its log), and chooses with the uncertainty it has. Both
factors are measured, not assumed:

* **Acceptance**: the engine's measured acceptance (`calibration.AcceptanceModel`, the
  very counts the calibrated selection values nodes by), read per request as how often
  the drafter's rank-r proposal after an accepted depth-d node was the target's token
  there, on and off the drafter's main line, kept apart for greedy and sampled requests.
  Every verified round teaches it (the round does, whichever policy chose the round); the
  policy only reads it. A candidate's expected accept length is 1 (the bonus token) plus
  the sum of its best D-1 node values under that positional model
  (`acceptance.ExpectedAccept`), so D, and whether to speculate at all, follow from the
  measured acceptance. What the model still misses (a selection picks each round's tree
  from that round's draft probabilities) is measured as observed / predicted accepted
  tokens, per kind (chain, tree) and refined per candidate, and corrected for; its
  variance is that of a count of that many tokens. Evidence of what did not run fades.
  While plain rounds run, each kind's calibration returns to its long-run ratio (the
  rounds just before plain decoding took over are biased low), and what speculation
  would now accept goes unmeasured: what a round of it could reveal widens
  (`drift_noise`), and exploring retries it once it could have caught up. A retried
  round measures part of that (a Kalman update: a noisy sampled round little), so
  exploring goes on, round after round, while it is still worth it. So a few unlucky
  rounds do not rule speculation out for good, nor does one unlucky retry.
* **Round price** (`costs.CostModel.prices`): a candidate's forwards over the plain step's,
  timed side by side at start-up through the execution path the engine runs, corrected by
  its measured rounds, each read against the target forward inside it, so that the
  machine's speed cancels out. A candidate not yet measured takes its forwards' price and
  its kind's correction, with the variance of not knowing its own.

**Choosing** (`_decide`, every few rounds or when the batch changes; the period doubles,
up to `redecide_most` rounds, or `redecide_most_plain` for plain decoding, while
decisions keep the choice):

* the standing choice stays unless a challenger's estimated lead exceeds `lead_noise`
  standard deviations of the difference: the best of many noisy estimates is biased high,
  and near-ties are noise (plain decoding is one more option, judged the same way);
* one round of another candidate is explored (while plain decoding holds, decided on
  again right after; else at most once a decision period) when what
  it could gain exceeds what it loses: the expected improvement over the choice that one
  more round of evidence could reveal (the knowledge gradient of a normal estimate), times
  the rounds the batch has left to use it (at most `explore_horizon`), against the value
  that round gives up (after plain rounds, with the drafter's whole catch-up: one round
  pays it all). A candidate far behind, or already well measured, is not explored; a
  close one whose price is still a guess is, once or twice;
* plain rounds do not feed the drafter, so speculating after them first costs one drafter
  pass over what it missed: paid once, spread over the rounds the batch has left. A
  prompt's drafter prefill is priced the same way at admission (`defer_drafter`).

Every candidate is an ordinary lossless round, so whatever the policy picks, the output is
the target model's. A decision is a few small numpy operations every few rounds.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Callable

import numpy as np

from branchspec.config import AutoPolicy, ModelConfig, SpecConfig, spec_label
from branchspec.speculative.calibration import GREEDY, SAMPLED, AcceptanceModel
from branchspec.speculative.policy.acceptance import ExpectedAccept
from branchspec.speculative.footprint import RoundLimits
from branchspec.speculative.policy.base import BatchView, check_speculation
from branchspec.speculative.policy.costs import CostModel
from branchspec.speculative.policy.tuning import TUNING, Tuning
from branchspec.speculative.outcome import RoundResult

KINDS = ("chain", "tree")
_NOTHING = object()            # no option to explore


def _normal_pdf(z: float) -> float:
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _samples(modes: list[int] | None) -> bool:
    """Whether some request of a batch samples (its verify passes then draw at every node)."""
    return bool(modes) and SAMPLED in modes


def _kind(spec: SpecConfig) -> str:
    return "chain" if spec.is_chain else "tree"


def _option_kind(option: SpecConfig | None) -> str:
    return "none" if option is None else _kind(option)


def _mean(values: list[int]) -> float:
    """A short list's mean (numpy's costs several microseconds a call)."""
    return sum(values) / len(values)


def _difference_var(own: np.ndarray, shared: np.ndarray, kinds: np.ndarray, i: int, j: int) -> float:
    """Variance of the difference of two options' log estimates: their own parts, and
    their kinds' shared parts unless the kind is the same (then it cancels)."""
    var = own[i] + own[j]
    if kinds[i] != kinds[j]:
        var += shared[i] + shared[j]
    return float(var)


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
        self._labels = [spec_label(s) for s in self.specs]
        self._kinds = np.array([KINDS.index(_kind(s)) for s in self.specs], dtype=np.intp)
        self._options: tuple[SpecConfig | None, ...] = (
            ((None,) if None in policy.candidates else ()) + tuple(self.specs))
        # [O] each option's kind as a code (comparing codes costs less than strings)
        self._option_kinds = np.array([("none", *KINDS).index(_option_kind(o)) for o in self._options])
        self._option_labels = [spec_label(o) for o in self._options]
        self.counts: Counter[str] = Counter()        # rounds per configuration label
        self.decide_seconds = 0.0
        self.last_choice: SpecConfig | None = None    # the standing choice (meaningful once decided)
        self.last_estimate: dict[str, float] = {}     # each option's estimated speed over plain decoding
        # (accepted, predicted) drafted tokens, decayed sums per candidate label and per kind
        # keyed by (sampled, label or kind): the positional model misses differently where
        # the verify pass draws, as the acceptance it reads is kept apart by mode
        self._accept_sums: dict[tuple[bool, str], tuple[float, float]] = {}
        # the same per kind with a long memory (`long_keep`): what plain rounds bring the
        # kind's calibration back to
        self._long_sums: dict[tuple[bool, str], tuple[float, float]] = {}
        self._decided = False
        self._steady = 0        # decisions in a row that kept the choice
        # Rounds observed since the estimates were last needed, applied in order when they
        # are (`_settle`): right after a forward the policy's code and data are out of the
        # CPU's caches, so one pass over a few rounds costs about what one round did.
        self._pending: list[tuple] = []
        self._explore = _NOTHING                      # an option a decision asked to run once, at once
        self._explored = False                        # it ran while plain decoding stood: decide again next
        self._predicted: dict[SpecConfig, float] = {}   # positional model's tokens a round, at the last decision
        self._per_request = np.zeros((0, len(self.specs)))    # [B, C] the same, per request of that batch
        self._request_rows: dict[int, int] = {}
        self._spec_index = {spec: i for i, spec in enumerate(self.specs)}
        self._tokens = np.zeros(0)
        self._drift = np.zeros(0)
        self._once = np.zeros(0)
        self._last_batch: tuple[int, ...] | None = None
        self._rounds_since = 0
        # Plain rounds over one batch not yet applied to the statistics: they only make
        # estimates drift, so they are applied together when an estimate is next needed.
        self._plain_batch: tuple[int, ...] | None = None
        self._plain_rounds = 0
        # Plain rounds since a speculative round last measured acceptance: what the text
        # may have become since then is unknown, more so the longer ago (`drift_noise`).
        # A learnt round measures part of it (`_measured`); a real number of rounds' worth.
        self._unmeasured = 0.0
        # per speculative candidate, at the last decision: the drift variance (of its log
        # value) one unmeasured round adds, and what one of its rounds measures it with
        self._drift_rate: dict[SpecConfig, float] = {}
        self._round_var: dict[SpecConfig, float] = {}

    @property
    def costs(self) -> CostModel:
        """The round-cost model, with every observed round applied."""
        self._flush()
        return self._cost_model()

    @property
    def accept_sums(self) -> dict[tuple[bool, str], tuple[float, float]]:
        """(accepted, predicted) drafted tokens, decayed sums per (sampled, candidate label)
        and per (sampled, kind), with every observed round applied."""
        self._settle()
        return self._accept_sums

    def _cost_model(self) -> CostModel:
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
        return self.expected(q)

    def defer_drafter(self, batch: BatchView) -> bool:
        """At admission, over the running batch with the new prompts as lag: the drafter's
        prefill runs with the target's, as a fixed configuration's does, unless plain
        decoding may run and is what the policy decides for the batch even before that
        prefill is paid, the prefill priced like any catch-up, spread over the tokens the
        batch has left (a chat of a hundred tokens earns it back, a burst of long prompts
        with a few tokens each to go may not). Then each prompt joins its request's drafter
        lag, fed only if a speculative round comes. This is the decision a request joining
        asks for (`choose` does not take it again for the same batch)."""
        if None not in self.policy.candidates:
            return False
        if not self.specs:
            return True
        self._decide_now(batch, changed=True)
        return self.last_choice is None

    def choose(self, batch: BatchView) -> SpecConfig | None:
        """The configuration for the next round over these requests (see `BatchView`:
        the drafter's lag, which a speculative round first feeds to it; the tokens each
        may still emit; their mean committed length, since forwards over a longer context
        cost more).

        The estimates are recomputed every `redecide_every` rounds (more at large
        batches; up to `redecide_most` while the choice holds, `redecide_most_plain`
        while plain decoding does), or at once when the batch
        changed, or right after a round that explored; in between the choice stands. A
        decision that asks for an exploring round gets it at once."""
        seq_ids, t = batch.seq_ids, self.tuning
        key = tuple(seq_ids)
        every = max(t.redecide_every, len(seq_ids) // t.redecide_per_requests)
        most = t.redecide_most_plain if self._decided and self.last_choice is None else t.redecide_most
        every = min(every << self._steady, max(every, most))
        changed = self._must_decide(key)
        if changed or self._explored or self._rounds_since >= every - 1:
            self._decide_now(batch, changed)
        else:
            self._rounds_since += 1
        t0 = time.perf_counter()
        run = self.last_choice
        if self._explore is not _NOTHING:
            # Explored at once (right after the decision that asked for it, or the admission's).
            # Speculation explored while plain decoding holds is decided on again right
            # after: one round tells a sampled batch little, the drafter's catch-up is paid,
            # and while it is still worth it the next round explores on without paying it
            # again. (Shapes explored while another stands share its kind's acceptance: one
            # round a period tells most of what they would.)
            run, self._explore = self._explore, _NOTHING
            self._explored = self.last_choice is None
        self.counts[spec_label(run)] += 1
        self.decide_seconds += time.perf_counter() - t0
        return run

    def _decide_now(self, batch: BatchView, changed: bool) -> None:
        """A decision for this batch (`changed`: a request joined it, or its size bucket
        moved), from which the period runs. After a join a speculative choice is watched
        more closely again, as closely as the newcomers weigh in the batch's estimate
        (its rounds measure their acceptance): a batch all new starts the period over at
        `redecide_every` rounds, one newcomer among B at B times that (or the period it
        had, if shorter). Plain rounds measure nothing, so a plain choice that holds keeps
        its period (a batch of four with requests of a hundred tokens takes one in every
        25 rounds)."""
        self.acceptance.learn()      # the rounds' own learning, not the policy's (`decide_seconds`)
        t0 = time.perf_counter()
        last = self._last_batch
        self._decide(batch)
        self._last_batch, self._rounds_since, self._explored = tuple(batch.seq_ids), 0, False
        if changed and self.last_choice is not None:
            B = len(batch.seq_ids)
            new = B - len(set(batch.seq_ids) & set(last)) if last is not None else B
            if new:      # (a batch that only shrank to another size bucket keeps its period)
                self._steady = min(self._steady, (B // new).bit_length() - 1)
        self.decide_seconds += time.perf_counter() - t0

    def _must_decide(self, key: tuple[int, ...]) -> bool:
        """Whether the batch changed enough to decide at once: a request joined (its
        acceptance is not in the estimate), or its size moved to another power of two
        (round prices are kept per such bucket). Requests that leave a batch barely move
        its estimate; the next scheduled decision sees them."""
        last = self._last_batch
        if key == last:
            return False
        if last is None or not set(key) <= set(last):
            return True
        return CostModel.bucket(len(key)) != CostModel.bucket(len(last))

    def _decide(self, batch: BatchView) -> None:
        """Sets the standing choice and, where it is worth a round, one to explore; a
        decision that keeps the choice lengthens the period to the next (`redecide_most`)."""
        seq_ids = batch.seq_ids
        options, value, own, shared, step = self._values(seq_ids, batch.lag, batch.remaining, batch.context,
                                                         batch.modes)
        self.last_estimate = dict(zip(self._option_labels, np.exp(value).tolist()))
        kinds = self._option_kinds
        best = int(value.argmax())
        if self._decided and self.last_choice in options:
            standing = options.index(self.last_choice)
            if value[best] - value[standing] <= self.tuning.lead_noise * math.sqrt(
                    _difference_var(own, shared, kinds, best, standing)):
                best = standing
        self._explore = self._worth_exploring(options, value, own, shared, step, kinds, best, batch.remaining,
                                              len(seq_ids))
        # An exploring round is part of holding a choice: only a switch starts the period over
        # (one exploring round a period, so fewer once the choice holds).
        kept = self._decided and options[best] == self.last_choice
        # (no more doublings than reach the longest period from a period of one round)
        most = max(self.tuning.redecide_most, self.tuning.redecide_most_plain)
        self._steady = min(self._steady + 1, most.bit_length()) if kept else 0
        self.last_choice, self._decided = options[best], True

    def _worth_exploring(self, options: list, value: np.ndarray, own: np.ndarray, shared: np.ndarray,
                         step: np.ndarray, kinds: np.ndarray, best: int, remaining: list[int] | None, B: int):
        """The option one round of which is worth most beyond what it costs, or _NOTHING.

        One more round of option j would shrink the variance of its own part (`own`, what
        sets it apart from its kind, and its kind's where that is not the choice's) from v
        to 1 / (1 / v + 1 / step); the change of its
        estimate has the standard deviation s = sqrt of the difference, and the choice
        improves by E[max(0, change - gap)], gap = how far j's estimate lies below the
        choice's, for every round left to use it. The round itself gives up
        1 - exp(-gap) of a round's value, where a round of j after rounds the drafter did
        not follow pays that whole catch-up (about one plain step at batch 1 compiled): in
        a cell where plain decoding and speculation are level, that is what exploring
        costs."""
        other = kinds != kinds[best]                                                        # [O]
        # Only a lead past the noise changes the choice (`lead_noise`): that much more to go.
        gap = value[best] - value + self.tuning.lead_noise * np.sqrt(own + own[best] + other * (shared + shared[best]))
        # Another kind's round also tells what that kind shares (plain decoding's kind: nil),
        # and any speculative round what the text has become since the last one.
        var = own + other * shared + self._drift
        s = np.sqrt(var * var / (var + step))         # v - 1 / (1 / v + 1 / step), and 0 at v = 0
        tokens = float(self._tokens[best]) / B
        left = _mean(remaining) / tokens if remaining else float(self.tuning.explore_horizon)
        horizon = min(float(self.tuning.explore_horizon), max(left - 1.0, 0.0))
        if horizon <= 0:
            return _NOTHING
        worth = np.full(len(options), -np.inf)
        for j in (gap < 4.0 * s).nonzero()[0]:      # further behind, the gain is nil
            if j == best:
                continue
            z = -gap[j] / s[j]
            gain = s[j] * (_normal_pdf(z) + z * _normal_cdf(z))
            worth[j] = horizon * gain - (1.0 - math.exp(value[j] + self._once[j] - value[best]))
        j = int(worth.argmax())
        return options[j] if worth[j] > 0 else _NOTHING

    def _values(self, seq_ids: list[int], lag: list[int] | None, remaining: list[int] | None,
                context: float | None, modes: list[int] | None
                ) -> tuple[list[SpecConfig | None], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every option (plain decoding first, where a candidate) with its estimated speed
        over plain decoding, as a log [O]; the variance of that log in two parts: its own
        [O] (its price, and its acceptance's departure from its kind's) and its kind's
        [O] (the acceptance its kind shares, nil for plain decoding); and the variance of
        what one more round of it measures of its own part [O]. Sets `_tokens` [O]: each
        option's expected tokens a round over these requests, and `_once` [O]: what its
        log value loses for a single round, which pays the drafter's whole catch-up
        rather than a share of it (an exploring round, `_worth_exploring`)."""
        self._settle()
        B = len(seq_ids)
        specs = self.specs
        options = self._options
        sampled = _samples(modes)
        price, own, _ = self._cost_model().prices(options, B, context, sampled)           # [O] plain steps
        tokens, shared = np.full(len(options), float(B)), np.zeros(len(options))
        unpaid = np.zeros(len(options))       # a catch-up's part that the rounds left do not share
        drift = np.zeros(len(options))
        step = np.full(len(options), self._cost_model().round_noise(B) ** 2)
        self._predicted = {}
        if specs:
            k = len(options) - len(specs)
            per_request = self.expected_accept(seq_ids, modes)                # [B, C]
            # A round emits at most its deepest path plus the bonus, and never more than a
            # request has left: the most each request can emit ([B, C], or [C] for every one).
            most = self._longest_path
            if remaining:
                most = np.minimum(most, np.maximum(np.asarray(remaining, float), 1.0)[:, None])
            per_request = np.minimum(per_request, most)
            most = most.sum(axis=0) if most.ndim == 2 else B * most          # [C] over the batch
            emitted = per_request.sum(axis=0)                                # [C], the model's own estimate
            self._predicted = dict(zip(specs, emitted.tolist()))
            self._per_request, self._request_rows = per_request, {sid: i for i, sid in enumerate(seq_ids)}
            calibration, own_tokens, kind_tokens = self._calibrations(sampled)       # [C]
            drafted = np.maximum(calibration * (emitted - B), 0.0)
            # Calibrated, an estimate may not pass what the round can emit either.
            spec_tokens = tokens[k:] = np.minimum(B + drafted, most)                 # [C]
            # The calibration's relative variance: a count of the tokens behind it, its own
            # departure from its kind's starting within `accept_spread`.
            weight = (drafted / spec_tokens) ** 2
            own[k:] += weight / (1.0 / self.tuning.accept_spread ** 2 + own_tokens)
            shared[k:] = weight / kind_tokens
            # What the text may have become since the last speculative round: a random walk
            # of the tokens a request's round accepts, as a part of the estimated tokens
            # (one for every shape). It is what a round would measure, so it makes
            # exploring worth more; it is not noise in what was measured, so a lead need
            # not pass it (`_decide`).
            rate = self.tuning.drift_noise ** 2 / (spec_tokens / B) ** 2
            drift[k:] = rate * self._unmeasured
            step[k:] += weight / np.maximum(emitted - B, 0.5)
            self._drift_rate, self._round_var = dict(zip(specs, rate.tolist())), dict(zip(specs, step[k:].tolist()))
            # Speculating now first feeds the drafter what it has not followed (a deferred
            # prompt, plain rounds): paid once, so spread over the rounds the batch has left.
            if lag and max(lag) > 0:
                left = _mean(remaining) if remaining else 0.0
                catch_up = self._cost_model().catch_up_steps(B, max(lag), context, sampled)
                share = catch_up / np.maximum(1.0, left * B / spec_tokens)
                price[k:] = price[k:] + share
                unpaid[k:] = catch_up - share
        self._tokens, self._drift = tokens, drift
        self._once = -np.log1p(unpaid / price)
        return options, np.log(tokens / B) - np.log(price), own, shared, step

    def observe(self, batch: BatchView, result: RoundResult) -> None:
        """The outcome of the round `choose` picked over `batch`: its wall time against the
        target forward inside it, and for a speculative round its accepted path lengths
        against the prediction. (What it says about acceptance, the round itself taught
        the engine's `AcceptanceModel`.)

        Right after a round's forwards the policy's code and data are out of the CPU's
        caches, so what a round says is kept as it comes and applied, in order, when an
        estimate is next needed (`_flush`): one pass over a few rounds costs about what
        one round did. Plain rounds are counted now, and applied to the acceptance at the
        same moments as ever (the next learnt round, another batch, an estimate)."""
        t0 = time.perf_counter()
        spec, seq_ids = result.spec, batch.seq_ids
        accepted = predicted = None
        if spec is None:
            key = tuple(seq_ids)
            if key != self._plain_batch:
                self._settle()
                self._plain_batch = key
            self._plain_rounds += 1
        elif result.learnt:
            if self._plain_rounds:
                self._settle()
            predicted = self._prediction(spec, seq_ids)
            accepted = float(sum(result.path_len))
        self._pending.append((spec, seq_ids, batch.modes, batch.context, result.seconds,
                              result.phase_seconds.get("verify"), accepted, predicted))
        self.decide_seconds += time.perf_counter() - t0

    def _flush(self) -> None:
        """Apply the rounds observed since the last flush, in order: each to the round
        prices, and each learnt speculative one to the accept calibration (against what the
        decision standing when it ran predicted)."""
        if self._pending:
            pending, self._pending = self._pending, []
            costs = self._cost_model()
            plain: list[tuple] = []       # the run of plain rounds over one bucket and sampling
            for spec, seq_ids, modes, context, seconds, verify, accepted, predicted in pending:
                sampled = _samples(modes)
                if spec is None:
                    clock = (CostModel.bucket(len(seq_ids)), sampled)
                    if plain and plain[-1][0] != clock:
                        self._observe_plain(costs, plain)
                    plain.append((clock, len(seq_ids), seconds, verify, context))
                    continue
                self._observe_plain(costs, plain)
                costs.observe(spec, len(seq_ids), seconds, verify, context, sampled=sampled)
                if accepted is not None:
                    self._measured(spec)
                if predicted is not None:
                    self._calibrate(spec, accepted, predicted, len(seq_ids), sampled)
            self._observe_plain(costs, plain)

    @staticmethod
    def _observe_plain(costs: CostModel, run: list[tuple]) -> None:
        """Apply a run of plain rounds (one batch bucket and sampling, in order) to the
        prices, and empty it. What all but the last `plain_memory` of them would leave,
        the later ones replace (a plain step's pairing and correction are kept for that
        many): those are only counted. While plain decoding holds, 64 rounds come
        together."""
        if run:
            (bucket, sampled), counted = run[0][0], max(0, len(run) - costs.plain_memory)
            if counted:
                costs.count_plain(bucket, sampled, counted)
            for _, batch, seconds, verify, context in run[counted:]:
                costs.observe(None, batch, seconds, verify, context, sampled=sampled)
            run.clear()

    def _measured(self, spec: SpecConfig) -> None:
        """A learnt round of `spec` measured what the text became while plain rounds ran,
        as one noisy reading measures a random walk's position: the unmeasured variance d
        left is d * v / (d + v), v that of the round's own reading (a Kalman update). One
        greedy round at batch 16 all but settles it; one sampled round at batch 1, whose
        accept length varies widely, leaves most of it."""
        rate, var = self._drift_rate.get(spec), self._round_var.get(spec)
        if rate is None or var is None or self._unmeasured <= 0:
            self._unmeasured = 0.0
            return
        drift = rate * self._unmeasured
        self._unmeasured *= var / (drift + var)

    def _settle(self) -> None:
        """Everything observed applied: the pending rounds, then the plain rounds since."""
        self._flush()
        self._apply_plain()

    def _prediction(self, spec: SpecConfig, seq_ids: list[int]) -> float | None:
        """The tokens the last decision predicted a round of `spec` emits over these
        requests (the batch it decided for, or part of it), None if it did not."""
        if self._last_batch == tuple(seq_ids):
            return self._predicted.get(spec)
        c, rows = self._spec_index.get(spec), [self._request_rows.get(s) for s in seq_ids]
        if c is None or None in rows:
            return None
        return float(self._per_request[rows, c].sum())

    def _apply_plain(self) -> None:
        """Apply the plain rounds seen since the last estimate, exactly as one round at a
        time would: each request's own acceptance counts decay (towards the engine-wide
        estimate, as in a speculative round), each kind's calibration returns towards its
        long-run ratio and each shape's own evidence fades (by `plain_fade` a round), and
        the rounds count as unmeasured. A plain round is no evidence that drafts would now
        be accepted more, only time in which they might be: what a speculative round could
        reveal widens instead (`_values`), so that exploring brings speculation back soon
        after it lost narrowly and late after it lost by far."""
        if self._plain_rounds:
            batch, n = self._plain_batch, self._plain_rounds
            self.acceptance.relax(list(batch), n)
            self._fade_calibration(self.tuning.plain_fade ** n, long_run=True)
            self._unmeasured += n
        self._plain_batch, self._plain_rounds = None, 0

    def calibration(self, spec: SpecConfig, sampled: bool = False) -> float:
        """Observed / predicted drafted tokens accepted: the kind's (chain or tree) ratio of
        decayed sums that start level (`calibration_prior` tokens each), refined by this
        candidate's own evidence (`label_weight`). It absorbs what the positional model
        misses: EAGLE-2 picks each round's tree by that round's draft confidence, and
        acceptance at one depth is not independent of the next."""
        self._settle()
        seen, predicted = self._accept_sums.get((sampled, _kind(spec)), (1.0, 1.0))
        level = seen / predicted
        own = self._accept_sums.get((sampled, spec_label(spec)))
        if own is None:
            return level
        w = self.tuning.label_weight
        return (own[0] + w * level) / (own[1] + w)

    def _calibrations(self, sampled: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every speculative candidate's `calibration` [C], the decayed predicted tokens
        of its own behind it [C] and of its kind's [C] (the prior's included)."""
        self._settle()
        prior = self.tuning.calibration_prior
        levels = np.array([self._accept_sums.get((sampled, kind), (prior, prior)) for kind in KINDS])    # [2, 2]
        own = np.array([self._accept_sums.get((sampled, label), (0.0, 0.0)) for label in self._labels])  # [C, 2]
        kind = levels[self._kinds]                                                          # [C, 2]
        w = self.tuning.label_weight
        calibration = (own[:, 0] + w * kind[:, 0] / kind[:, 1]) / (own[:, 1] + w)
        return calibration, own[:, 1], kind[:, 1]

    def _calibrate(self, spec: SpecConfig, observed: float, predicted: float, batch: int,
                   sampled: bool = False) -> None:
        t = self.tuning
        keep = t.calibration_keep
        drafted_pred, drafted_seen = max(predicted - batch, 0.0), max(observed - batch, 0.0)
        label, kind = (sampled, spec_label(spec)), (sampled, _kind(spec))
        self._fade_calibration(t.calibration_fade, skip=(label, kind), mode=sampled)
        seen, pred = self._accept_sums.get(label, (0.0, 0.0))
        self._accept_sums[label] = (keep * seen + drafted_seen, keep * pred + drafted_pred)
        seen, pred = self._accept_sums.get(kind, (t.calibration_prior, t.calibration_prior))
        self._accept_sums[kind] = (keep * seen + drafted_seen, keep * pred + drafted_pred)
        seen, pred = self._long_sums.get(kind, (t.calibration_prior, t.calibration_prior))
        self._long_sums[kind] = (t.long_keep * seen + drafted_seen, t.long_keep * pred + drafted_pred)

    def _fade_calibration(self, keep: float, skip: tuple = (), long_run: bool = False,
                          mode: bool | None = None) -> None:
        """Each kind's sums drift by 1 - keep towards level (`calibration_prior` tokens of
        ratio 1), or with `long_run` towards its long-run ratio, and each shape's own
        evidence fades by `keep`: of one mode (`mode`: sampled or not), or of both; those
        named in `skip` (the ones that just ran) excepted."""
        prior = self.tuning.calibration_prior
        for key, (seen, predicted) in self._accept_sums.items():
            if key in skip or (mode is not None and key[0] != mode):
                continue
            if key[1] in KINDS:
                level = 1.0
                if long_run and key in self._long_sums:
                    long_seen, long_predicted = self._long_sums[key]
                    level = long_seen / long_predicted
                self._accept_sums[key] = (keep * seen + (1 - keep) * prior * level, keep * predicted + (1 - keep) * prior)
            else:
                self._accept_sums[key] = (keep * seen, keep * predicted)

    def forget(self, seq_id: int) -> None:
        self._settle()
        self.acceptance.forget(seq_id)
