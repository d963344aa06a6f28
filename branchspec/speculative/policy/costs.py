"""Round prices: what each candidate configuration's round costs, in plain decode steps.

Whole rounds of every candidate are run once per machine through the engine's own runner
(`speculative.profiling.calibrate`, outside the policy: it runs execution code), each
between two plain decode steps, and priced as its ratio to them. Rounds measured as they
serve correct that ratio, each read against the plain steps served beside it or, where
there are none, against the target forward inside it: a slow spell of the machine slows
every call alike, so it cancels out of the ratio instead of landing on whichever
candidate ran during it.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from branchspec.config import SpecConfig, spec_label
from branchspec.speculative.policy.tuning import TUNING, Tuning

PLAIN = "none"
# The grids: "round" a whole round of a candidate (catch-up excluded) and "verify" its
# target forward (the verify phase; a plain step's is the step), per candidate label, and
# "catch_up" the drafter over positions it did not follow (a deferred prompt, plain rounds)
# per lag; each in plain decode steps measured beside it. "plain" the plain step's seconds.
GRIDS = ("round", "verify", "catch_up")
CATCH_UP_TOKENS = (1, 16, 64)
# Committed tokens the grids are measured from: a short context and a long one.
CONTEXTS = (128, 512)
# Nodes (over all requests) at which drawing the target's token by its seeded inverse CDF
# is timed: what a verify pass or plain step over sampled requests does beyond the argmax
# the grids were measured with.
DRAW_ROWS = (1, 16, 64, 256, 1024)


def grid_keys(candidates: tuple[SpecConfig | None, ...]) -> tuple[str, ...]:
    """The labels a calibration of these candidates prices: plain decoding's and theirs."""
    return tuple(sorted({PLAIN} | {spec_label(c) for c in candidates}))


def _median(values) -> float:
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def _kind(label: str) -> str:
    return PLAIN if label == PLAIN else ("chain" if label.startswith("chain") else "tree")


class CostModel:
    """Measured round prices on a (batch, candidate, context) grid, corrected by the rounds
    that run.

    grids["round"][i, j, k]: a round of keys[j] at batch batches[i] from contexts[k]
    committed tokens, in plain decode steps; grids["verify"] the target forward inside
    it, the same way; grids["catch_up"][i, j, k] a drafter catch-up over
    CATCH_UP_TOKENS[j] positions; plain[i, k] the plain step's seconds. Off-grid points
    interpolate linearly in log(batch) and in context (beyond the longest context: on the
    slope between the last two; beyond the largest batch: the largest's ratio), and in
    lag (beyond the longest: in proportion). A candidate outside the grid is priced by
    `unmeasured` (ValueError here; `flat` models price any).

    **Sampled batches.** Where a request samples, a verify pass draws the target's token
    at every node of every request (a plain step at every request), inside the forward's
    own call: `draws[r]` is that draw's seconds over DRAW_ROWS[r] nodes. Prices are then
    in the sampled batch's own plain steps, (round + draw over B x D nodes) over (plain
    step + draw over B), the draw in the grids' plain steps (`draw_steps`). Without it a
    tree of D nodes would look as cheap as in a greedy batch, and its measured rounds
    could not say otherwise: they are read against a forward that the draw slows too.

    **Corrections.** A round measured as it serves is converted to plain steps at the
    speed the machine had during that very round: over the plain steps served beside it
    (the median of the latest within `pair_rounds` rounds before it, at the same batch
    bucket and sampling), or, where plain decoding has not run lately, (its seconds / its
    target forward's) x the forward's calibrated price. The first reading needs no
    calibrated ratio at all: served verify forwards cost 3-18% more against a plain step
    than the calibration's (docs/policy.md), which the second cannot see and which tips a
    level cell towards speculating. Per (candidate, batch bucket) the last `ratio_history`
    log-corrections (measured over calibrated) are kept; a candidate's correction is their
    median, shrunk towards its kind's (chain, tree, plain) with `ratio_prior_rounds`
    rounds' weight, so a candidate not yet measured is priced by its calibrated round and
    what its kind's other shapes measured, neither cheaper nor dearer than them. With each
    price comes its variance (of the log ratio): what the adaptive policy weighs its
    choices by.
    """

    def __init__(self, batches: tuple[int, ...], keys: tuple[str, ...], grids: dict[str, np.ndarray],
                 plain: np.ndarray, contexts: tuple[int, ...] = CONTEXTS, tuning: Tuning = TUNING,
                 draws: np.ndarray | None = None):
        self.batches, self.keys, self.contexts, self.tuning = tuple(batches), tuple(keys), tuple(contexts), tuning
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"contexts must be increasing, got {self.contexts}")
        if list(self.keys) != sorted(set(self.keys)):
            raise ValueError(f"candidate keys must be sorted and distinct, got {self.keys}")
        if set(grids) != set(GRIDS):
            raise ValueError(f"cost grids must be given for {GRIDS}, got {sorted(grids)}")
        self.grids = {name: np.asarray(g, float) for name, g in grids.items()}
        self.plain = np.asarray(plain, float)
        for name, width in (("round", len(self.keys)), ("verify", len(self.keys)), ("catch_up", len(CATCH_UP_TOKENS))):
            shape = (len(self.batches), width, len(self.contexts))
            if self.grids[name].shape != shape:
                raise ValueError(f"the {name} grid must have shape {shape}, got {self.grids[name].shape}")
        if self.plain.shape != (len(self.batches), len(self.contexts)):
            raise ValueError(f"the plain step's seconds must have shape {(len(self.batches), len(self.contexts))}, "
                             f"got {self.plain.shape}")
        self.draws = draws
        self._index = {key: j for j, key in enumerate(self.keys)}
        # log(measured / calibrated price) of the counted rounds, per (label, batch bucket)
        self.corrections: dict[tuple[str, int], deque[float]] = {}
        self._cells: dict[tuple[str, int, int], np.ndarray] = {}
        self._settled: dict[int, tuple[dict[str, tuple[float, int]], dict[str, tuple[float, float]], float]] = {}
        # per (id of a candidate tuple, bucket): the tuple, and its corrections' scale,
        # variance and weight; per (id, batch, context): the tuple and its calibrated prices
        self._priced: dict[tuple, tuple] = {}
        self._calibrated: dict[tuple, tuple] = {}
        self._warm: set[tuple[str, int]] = set()
        # per (batch bucket, sampled): rounds observed, and the latest plain steps' seconds
        # with the round count each came at (what a round is read against, `observe`)
        self._rounds: dict[tuple[int, bool], int] = {}
        self._plain_steps: dict[tuple[int, bool], deque[tuple[int, float]]] = {}
        self._labels: dict[int, tuple] = {}     # per id of a candidate tuple: the tuple, its labels

    @classmethod
    def flat(cls, target: float, drafter: float, batches: tuple[int, ...] = (1, 64),
             candidates: tuple[SpecConfig | None, ...] = (), tuning: Tuning = TUNING) -> "CostModel":
        """Every forward of the target costs `target` seconds and every drafter forward
        `drafter`, whatever the batch, tokens and context: a round of s steps is its verify
        pass and s drafter forwards (s - 1 growing the tree, one extending the path), and
        a catch-up one drafter forward (for reasoning about decisions)."""
        return FlatCosts(target, drafter, batches, tuning)

    def _context(self, context: float | None) -> int:
        """The context a price is kept under: rounded to `context_step` (None: the
        shortest measured)."""
        if context is None:
            return self.contexts[0]
        step = self.tuning.context_step
        return max(1, int(round(context / step))) * step

    def _interpolated(self, grid: np.ndarray, batch: int, context: int) -> np.ndarray:
        """grid [batches, n, contexts] at `batch` and `context`: [n]."""
        c = self.contexts
        if len(c) == 1 or context <= c[0]:
            over = grid[:, :, 0]
        else:
            k = min(int(np.searchsorted(c, context)), len(c) - 1)
            lo, hi = grid[:, :, k - 1], grid[:, :, k]
            t = (context - c[k - 1]) / (c[k] - c[k - 1])
            over = lo + t * (hi - lo) if t <= 1.0 else hi + (t - 1.0) * (hi - lo)
        lb, x = np.log2(np.asarray(self.batches, float)), math.log2(batch)
        return np.array([np.interp(x, lb, col) for col in over.T])

    def _cell(self, name: str, batch: int, context: int) -> np.ndarray:
        key = (name, batch, context)
        if key not in self._cells:
            if name == "plain":
                self._cells[key] = self._interpolated(self.plain[:, None, :], batch, context)
                if batch > self.batches[-1]:
                    self._cells[key] = self._cells[key] * batch / self.batches[-1]
            else:
                self._cells[key] = np.maximum(self._interpolated(self.grids[name], batch, context), 1e-3)
        return self._cells[key]

    def knows(self, spec: SpecConfig | None) -> bool:
        """Whether `spec`'s rounds have a calibrated price."""
        label = spec_label(spec)
        return label == PLAIN or label in self._index

    def unmeasured(self, spec: SpecConfig | None, name: str) -> float:
        raise ValueError(f"no calibrated price for {spec_label(spec)}: the round costs were measured for "
                         f"{', '.join(self.keys)}")

    def _price_of(self, name: str, spec: SpecConfig | None, batch: int, context: float | None) -> float:
        label = spec_label(spec)
        if label == PLAIN:
            return 1.0
        j = self._index.get(label)
        if j is None:
            return self.unmeasured(spec, name)
        return float(self._cell(name, batch, self._context(context))[j])

    def calibrated(self, spec: SpecConfig | None, batch: int, context: float | None = None) -> float:
        """A round of `spec` over `batch` requests with `context` committed tokens on
        average, in plain decode steps, as calibrated."""
        return self._price_of("round", spec, batch, context)

    def plain_seconds(self, batch: int, context: float | None = None) -> float:
        """The plain decode step's seconds, as calibrated."""
        return float(self._cell("plain", batch, self._context(context))[0])

    def predict(self, spec: SpecConfig | None, batch: int, context: float | None = None) -> float:
        """Seconds of one round of `spec`, as calibrated."""
        return self.calibrated(spec, batch, context) * self.plain_seconds(batch, context)

    def catch_up_steps(self, batch: int, lag: int, context: float | None = None, sampled: bool = False) -> float:
        """One drafter pass over `lag` positions per request, in plain decode steps (a
        sampled batch's own, where `sampled`): the price of speculating after rounds (or a
        prefill) the drafter did not follow."""
        if lag <= 0:
            return 0.0
        row = self._cell("catch_up", batch, self._context(context))
        top = CATCH_UP_TOKENS[-1]
        steps = float(np.interp(min(lag, top), CATCH_UP_TOKENS, row))
        steps = steps * lag / top if lag > top else steps
        return steps / (1.0 + self.draw_steps(batch, batch, context)) if sampled else steps

    @property
    def draws(self) -> np.ndarray | None:
        """[len(DRAW_ROWS)] seconds of drawing at DRAW_ROWS nodes, each at most the next's."""
        return self._draws

    @draws.setter
    def draws(self, seconds) -> None:
        if seconds is None:
            self._draws = None
            return
        seconds = np.asarray(seconds, float)
        if seconds.shape != (len(DRAW_ROWS),):
            raise ValueError(f"the draw seconds must have shape {(len(DRAW_ROWS),)}, got {seconds.shape}")
        # Drawing at fewer nodes never costs more. One slow sample at a small count (a
        # single-node draw timed at 3.9 ms beside 0.5 ms for 16 nodes, on a 2-core machine
        # right after compiling) would otherwise price a sampled batch-4 plain step at 1.5
        # greedy ones, and every speculative round a third cheaper against it.
        self._draws = np.minimum.accumulate(seconds[::-1])[::-1].copy()
        self._calibrated = {}

    def draw_steps(self, nodes: int, batch: int, context: float | None = None) -> float:
        """Drawing the target's token at `nodes` nodes (sampled requests), in the grids'
        (greedy) plain steps at `batch`; nil without measured draws."""
        if self.draws is None or nodes <= 0:
            return 0.0
        top = DRAW_ROWS[-1]
        seconds = float(np.interp(min(nodes, top), DRAW_ROWS, self.draws)) * max(1.0, nodes / top)
        return seconds / self.plain_seconds(batch, context)

    def _sampled(self, spec: SpecConfig | None, batch: int, context: float | None) -> tuple[float, float]:
        """A sampled batch's draw at `spec`'s verify nodes and at a plain step's, in the
        grids' plain steps."""
        nodes = spec.num_draft_tokens if spec is not None else 1
        return self.draw_steps(batch * nodes, batch, context), self.draw_steps(batch, batch, context)

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def observe(self, spec: SpecConfig | None, batch: int, seconds: float, forward_seconds: float | None = None,
                context: float | None = None, sampled: bool = False) -> None:
        """A measured round of `seconds` over `context` committed tokens on average, whose
        target forward (its verify phase; a plain step's forward) took `forward_seconds`.
        In plain steps at the speed of that moment it is its seconds over the plain steps
        served beside it (`pair_rounds`), or without those (seconds / forward_seconds) x
        the forward's calibrated price; without a forward time either, seconds over the
        calibrated plain step (as if the machine ran at calibration speed). A candidate's
        first round at a batch bucket pays one-time costs (allocation, a new shape's
        metadata) and is not counted, nor is a round of a configuration without a
        calibrated price (one a caller forced outside the candidates): there is nothing to
        correct. `sampled`: some request of the batch samples, so its forward also drew a
        token at every node."""
        key = (spec_label(spec), self.bucket(batch))
        if not self.knows(spec):
            return
        t = self.tuning
        clock = (key[1], sampled)
        self._rounds[clock] = count = self._rounds.get(clock, 0) + 1
        if key not in self._warm:
            self._warm.add(key)
            return
        draw = self._sampled(spec, batch, context)[0] if sampled else 0.0
        beside = [] if spec is None else [
            step for at, step in self._plain_steps.get(clock, ()) if count - at <= t.pair_rounds]
        if beside:        # in the sampled batch's plain steps, (1 + their draw) grid steps each
            steps = seconds / _median(beside) * (1.0 + (self._sampled(None, batch, context)[0] if sampled else 0.0))
        elif forward_seconds is not None and forward_seconds > 0:
            steps = seconds / forward_seconds * (self._price_of("verify", spec, batch, context) + draw)
        else:
            steps = seconds / self.plain_seconds(batch, context)
        if spec is None:
            self._plain_steps.setdefault(clock, deque(maxlen=t.pair_steps)).append((count, seconds))
        correction = math.log(max(steps, 1e-9) / (self.calibrated(spec, batch, context) + draw))
        history = self.corrections.setdefault(key, deque(maxlen=t.ratio_history))
        history.append(min(max(correction, -t.ratio_clamp), t.ratio_clamp))
        self._settled.pop(key[1], None)

    @property
    def plain_memory(self) -> int:
        """How many of the latest plain steps at a batch bucket (and sampling) the prices
        remember: the ones paired with speculative rounds and the plain step's
        corrections. Older ones among a run of plain steps change nothing but the count."""
        return max(self.tuning.pair_steps, self.tuning.ratio_history)

    def count_plain(self, batch: int, sampled: bool, rounds: int) -> None:
        """`rounds` plain steps observed as `observe` would, at a point where at least
        `plain_memory` more of them, at the same batch bucket and sampling, follow before
        any other round: everything they would leave the newer ones replace, but the
        count of rounds the pairing reads ages by."""
        bucket = self.bucket(batch)
        clock = (bucket, sampled)
        self._rounds[clock] = self._rounds.get(clock, 0) + rounds
        self._warm.add((PLAIN, bucket))

    def _settle(self, bucket: int) -> tuple[dict[str, tuple[float, int]], dict[str, tuple[float, float]], float]:
        """Per label its median correction and count, per kind the mean and spread of its
        labels' corrections, and the pooled noise of one round's correction, at `bucket`.
        (Plain Python: a few dozen short lists, where each numpy call would cost more than
        its arithmetic.)"""
        if bucket not in self._settled:
            t = self.tuning
            own: dict[str, tuple[float, int]] = {}
            within, pairs = 0.0, 0
            for (label, b), seen in self.corrections.items():
                if b != bucket or not seen:
                    continue
                own[label] = (_median(seen), len(seen))
                if len(seen) > 2:
                    mean = sum(seen) / len(seen)
                    within += sum((x - mean) ** 2 for x in seen)
                    pairs += len(seen) - 1
            noise = math.sqrt((within + t.ratio_noise ** 2 * t.ratio_prior_rounds) / (pairs + t.ratio_prior_rounds))
            kinds: dict[str, tuple[float, float]] = {}
            speculative = [m for label, (m, _) in own.items() if label != PLAIN]
            for kind in ("chain", "tree", PLAIN):
                means = [m for label, (m, _) in own.items() if _kind(label) == kind] or \
                    ([] if kind == PLAIN else speculative)
                mean = sum(means) / len(means) if means else 0.0
                spread = math.sqrt(sum((m - mean) ** 2 for m in means) / len(means)) if len(means) > 1 else 0.0
                kinds[kind] = (mean, spread if kind == PLAIN else max(spread, t.shape_spread))
            self._settled[bucket] = (own, kinds, noise)
            self._priced = {key: v for key, v in self._priced.items() if key[1] != bucket}
        return self._settled[bucket]

    def prices(self, specs: tuple[SpecConfig | None, ...], batch: int, context: float | None = None,
               sampled: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each candidate's round in plain decode steps [C] (a sampled batch's own, where
        `sampled`), the variance of its log [C], and the rounds of evidence behind it [C]
        (its own, plus the prior's weight)."""
        bucket = self.bucket(batch)
        own, kinds, noise = self._settle(bucket)
        key = (id(specs), bucket)           # hashing every SpecConfig of a tuple costs more than pricing
        if key not in self._priced or self._priced[key][0] is not specs:
            n0 = self.tuning.ratio_prior_rounds
            correction, var, weight = np.empty(len(specs)), np.empty(len(specs)), np.empty(len(specs))
            for i, label in enumerate(self._labels_of(specs)):
                kind_mean, spread = kinds[_kind(label)]
                mean, n = own.get(label, (0.0, 0))
                prior = n0 / (n + n0)
                correction[i] = (1 - prior) * mean + prior * kind_mean
                var[i] = noise ** 2 / (n + n0) + (prior * spread) ** 2
                weight[i] = n + n0
            self._priced[key] = (specs, np.exp(correction), var, weight)
        _, scale, var, weight = self._priced[key]
        at = (id(specs), batch, self._context(context), sampled and self.draws is not None)
        if at not in self._calibrated or self._calibrated[at][0] is not specs:
            calibrated = np.array([self.calibrated(s, batch, context) for s in specs])
            if at[3]:
                draws = np.array([self._sampled(s, batch, context) for s in specs])     # [C, 2]
                calibrated = (calibrated + draws[:, 0]) / (1.0 + draws[:, 1])
            self._calibrated[at] = (specs, calibrated)
        return self._calibrated[at][1] * scale, var.copy(), weight

    def _labels_of(self, specs: tuple[SpecConfig | None, ...]) -> list[str]:
        key = id(specs)
        if key not in self._labels or self._labels[key][0] is not specs:
            self._labels[key] = (specs, [spec_label(s) for s in specs])
        return self._labels[key][1]

    def round_noise(self, batch: int) -> float:
        """The standard deviation of one measured round's log correction at this batch."""
        return self._settle(self.bucket(batch))[2]

    def price(self, spec: SpecConfig | None, batch: int, context: float | None = None) -> float:
        """One candidate's round in plain decode steps (`prices`)."""
        return float(self.prices((spec,), batch, context)[0][0])

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "keys": list(self.keys), "contexts": list(self.contexts),
                "grids": {name: g.tolist() for name, g in self.grids.items()}, "plain": self.plain.tolist(),
                "draws": None if self.draws is None else self.draws.tolist()}

    @classmethod
    def from_dict(cls, d: dict, tuning: Tuning = TUNING) -> "CostModel":
        draws = d.get("draws")
        return cls(tuple(d["batches"]), tuple(d["keys"]), {name: np.array(g) for name, g in d["grids"].items()},
                   np.array(d["plain"]), tuple(d["contexts"]), tuning, None if draws is None else np.array(draws))


class FlatCosts(CostModel):
    """`CostModel.flat`: prices from fixed forward times, for any candidate."""

    def __init__(self, target: float, drafter: float, batches: tuple[int, ...], tuning: Tuning):
        grids = {"round": np.ones((len(batches), 1, 1)), "verify": np.ones((len(batches), 1, 1)),
                 "catch_up": np.full((len(batches), len(CATCH_UP_TOKENS), 1), drafter / target)}
        super().__init__(batches, (PLAIN,), grids, np.full((len(batches), 1), target), (CONTEXTS[0],), tuning)
        self.target, self.drafter = target, drafter

    def knows(self, spec: SpecConfig | None) -> bool:
        return True

    def unmeasured(self, spec: SpecConfig | None, name: str) -> float:
        if name == "verify":
            return 1.0
        return (self.target + spec.num_steps * self.drafter) / self.target
