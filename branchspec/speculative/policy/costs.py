"""Round costs: how long each candidate configuration's round takes at a batch size.

The calls a round makes are timed once per machine (`speculative.profiling.calibrate`,
outside the policy: it runs the engine's execution code), and a candidate's round time is
composed from them here, plus an overhead learned online from its measured rounds.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import numpy as np

from branchspec.config import SpecConfig, spec_label
from branchspec.speculative.policy.tuning import TUNING, Tuning

# The calls a round makes, each timed on its own grid: "target" the plain decode step (1
# token) and the verify pass (D nodes), by new tokens per request; "draft" a candidate's
# whole drafting (the drafter's `propose`: its growth, one graph when compiled, and for a
# calibrated selection the factors it reads), by growth (the candidate's label: steps, topk, D and selection); "extend" the draft
# extend over the path and the next root (D + 1 nodes); "catch_up" the drafter over
# positions it did not follow (a deferred prompt, plain rounds), in chunks of tokens.
FORWARDS = ("target", "draft", "extend", "catch_up")
# The grids keyed by growth rather than by a token count (looked up, not interpolated).
BY_GROWTH = ("draft",)
CATCH_UP_TOKENS = (1, 16, 64)
# Committed tokens the grids are measured over: a short context and a long one.
CONTEXTS = (128, 512)


def grid_tokens(candidates: tuple[SpecConfig | None, ...]) -> dict[str, tuple]:
    """What each call is timed at under these candidates: node counts, or growth keys."""
    specs = [c for c in candidates if c is not None]
    return {"target": tuple(sorted({1} | {c.num_draft_tokens for c in specs})),
            "draft": tuple(sorted({c.label for c in specs})),
            "extend": tuple(sorted({c.num_draft_tokens + 1 for c in specs})),
            "catch_up": CATCH_UP_TOKENS}


def _label(spec: SpecConfig | None) -> str:
    return spec_label(spec)


class CostModel:
    """Call times on a (batch, tokens per request or growth, context) grid per call, and
    the round time of each candidate composed from them.

    grids[f] = (keys, seconds): seconds[i, j, k] of one call f at batch batches[i] with
    keys[j] new tokens per request (a growth key for "draft") over contexts[k] committed
    ones. Off-grid points interpolate linearly in log(batch), in tokens and in context
    (beyond the longest context: linearly, on the slope between the last two; beyond the
    most tokens: in proportion). A growth that was not timed (a model made by `flat`, a
    configuration outside the candidates) is priced as num_steps - 1 extend-sized
    forwards of topk nodes. The context matters: attention reads the window and every compressed
    entry, so a step over 500 committed tokens costs about a third more than one over 128
    at batch 64 on the default model.

    Per (candidate label, batch bucket) it also keeps the last `overhead_history` measured
    overheads (measured - predicted round time: plan, accept, commit, sampling, Python),
    and adds their median: the per-round cost the grid does not see, learned as rounds
    run, robust to a round slowed by something else.

    And it follows the machine's present **load**: the median over the last
    `load_history` rounds, whatever ran, of measured / predicted time. The grids are timed
    on idle cores; a server whose cores its HTTP side and its clients share runs every
    call two to four times slower (docs/fast-path.md). A candidate with nothing of its kind
    measured at a batch bucket is priced under that load, not at idle speed: at idle
    prices an untried chain once looked three times cheaper than plain decoding measured
    under the load, and lost to it.
    """

    def __init__(self, batches: tuple[int, ...], grids: dict[str, tuple[tuple[int, ...], np.ndarray]],
                 contexts: tuple[int, ...] = CONTEXTS, tuning: Tuning = TUNING):
        self.batches, self.contexts, self.tuning = tuple(batches), tuple(contexts), tuning
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"contexts must be increasing, got {self.contexts}")
        if set(grids) != set(FORWARDS):
            raise ValueError(f"cost grids must be given for {FORWARDS}, got {sorted(grids)}")
        self.grids: dict[str, tuple[tuple[int, ...], np.ndarray]] = {}
        for name, (tokens, seconds) in grids.items():
            tokens = tuple(str(t) for t in tokens) if name in BY_GROWTH else tuple(int(t) for t in tokens)
            seconds = np.asarray(seconds, float)
            shape = (len(self.batches), len(tokens), len(self.contexts))
            if seconds.shape != shape or list(tokens) != sorted(set(tokens)):
                raise ValueError(f"the {name} grid must have increasing, distinct keys and shape {shape}, got "
                                 f"{tokens} and {seconds.shape}")
            self.grids[name] = (tokens, seconds)
        self.overheads: dict[tuple[str, int], deque[float]] = {}
        self._recent: deque[float] = deque(maxlen=tuning.load_history)    # measured / predicted
        self._load: float | None = None
        self._predicted: dict[tuple[SpecConfig | None, int, int], float] = {}
        self._rows: dict[tuple[str, int, int], np.ndarray] = {}
        self._settled: dict[tuple[str, int], float] = {}
        self._least_seen: dict[tuple[bool, int], float | None] = {}
        self._warm: set[tuple[str, int]] = set()

    @classmethod
    def flat(cls, target: float, drafter: float, batches: tuple[int, ...] = (1, 64),
             candidates: tuple[SpecConfig | None, ...] = (), tuning: Tuning = TUNING) -> "CostModel":
        """Every forward of the target costs `target` seconds and every drafter forward
        `drafter` (a growth of s steps s - 1 of them), whatever the batch, tokens and context
        (for reasoning about decisions)."""
        grids = {}
        for name, tokens in grid_tokens(candidates).items():
            if name in BY_GROWTH:
                tokens = ()            # priced from the extend grid, as an untimed growth is
            grids[name] = (tokens, np.full((len(batches), len(tokens), 1), target if name == "target" else drafter))
        return cls(batches, grids, contexts=(CONTEXTS[0],), tuning=tuning)

    def _context(self, context: float | None) -> int:
        """The context a prediction is kept under: rounded to `context_step` (None: the
        shortest measured)."""
        if context is None:
            return self.contexts[0]
        step = self.tuning.context_step
        return max(1, int(round(context / step))) * step

    def _over_context(self, grid: np.ndarray, context: int) -> np.ndarray:
        """[batches, tokens] forward seconds over `context` committed tokens."""
        c = self.contexts
        if len(c) == 1 or context <= c[0]:
            return grid[:, :, 0]
        k = min(int(np.searchsorted(c, context)), len(c) - 1)
        lo, hi = grid[:, :, k - 1], grid[:, :, k]
        t = (context - c[k - 1]) / (c[k] - c[k - 1])
        if t <= 1.0:
            return lo + t * (hi - lo)
        return hi + (t - 1.0) * np.maximum(hi - lo, 0.0)     # beyond: never cheaper than measured

    def _row(self, forward: str, batch: int, context: int) -> np.ndarray:
        """[tokens] seconds of `forward` at `batch` over `context`, interpolated once per
        (forward, batch, context)."""
        key = (forward, batch, context)
        if key not in self._rows:
            lb, x = np.log2(np.asarray(self.batches, float)), math.log2(batch)
            scale = batch / self.batches[-1] if batch > self.batches[-1] else 1.0   # beyond the grid
            grid = self.grids[forward][1]
            self._rows[key] = scale * np.array([np.interp(x, lb, col) for col in self._over_context(grid, context).T])
        return self._rows[key]

    def _at(self, forward: str, batch: int, tokens: int, context: int) -> float:
        grid_tokens_ = self.grids[forward][0]
        if not grid_tokens_:
            raise ValueError(f"the {forward} grid holds no token counts")
        t = float(np.interp(min(tokens, grid_tokens_[-1]), grid_tokens_, self._row(forward, batch, context)))
        if tokens > grid_tokens_[-1]:
            t *= tokens / grid_tokens_[-1]
        return t

    def predict(self, spec: SpecConfig | None, batch: int, context: float | None = None) -> float:
        """Seconds of one round of `spec` over `batch` requests with `context` committed
        tokens on average, without its measured overhead."""
        key = (spec, batch, self._context(context))
        if key not in self._predicted:
            self._predicted[key] = self._compose(spec, batch, key[2])
        return self._predicted[key]

    def _compose(self, spec: SpecConfig | None, batch: int, context: int) -> float:
        if spec is None:
            return self._at("target", batch, 1, context)
        # The root's drafter slot comes with the previous round's draft extend, which runs
        # D + 1 nodes (the path and the next root).
        verify = self._at("target", batch, spec.num_draft_tokens, context)
        extend = self._at("extend", batch, spec.num_draft_tokens + 1, context)
        return self._draft(spec, batch, context) + verify + extend

    def _draft(self, spec: SpecConfig, batch: int, context: int) -> float:
        keys = self.grids["draft"][0]
        key = spec.label
        if key not in keys:           # not timed: its frontier steps as extend-sized forwards
            return (spec.num_steps - 1) * self._at("extend", batch, spec.topk, context)
        return float(self._row("draft", batch, context)[keys.index(key)])

    def catch_up_seconds(self, batch: int, lag: int, context: float | None = None) -> float:
        """One drafter pass over `lag` positions per request, under the present load: the
        price of speculating after rounds (or a prefill) the drafter did not follow."""
        return self._at("catch_up", batch, lag, self._context(context)) * self.load() if lag > 0 else 0.0

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def load(self) -> float:
        """How much slower than the grids the machine runs now: the median of measured /
        predicted time over the last counted rounds, whatever ran (1 before any)."""
        if self._load is None:
            self._load = statistics.median(self._recent) if self._recent else 1.0
        return self._load

    def round_seconds(self, spec: SpecConfig | None, batch: int, context: float | None = None) -> float:
        """Predicted forward seconds plus the round's overhead beyond them, as measured for
        this candidate at this batch bucket. A candidate's first round is not counted (it
        pays one-time costs: allocation, metadata for a new shape), and until it has one
        counted round it is given the least overhead measured for its kind (speculative or
        plain), so it gets tried rather than inheriting another shape's overhead. With none
        of its kind measured at this bucket, a speculative candidate is priced under the
        present `load`; plain decoding at its idle price, since erring high on plain
        decoding's cost would pick speculation where it loses."""
        return float(self.round_seconds_of((spec,), batch, context)[0])

    def round_seconds_of(self, specs: tuple[SpecConfig | None, ...], batch: int,
                         context: float | None = None) -> np.ndarray:
        """`round_seconds` of several candidates: [len(specs)]."""
        bucket = self.bucket(batch)
        least: dict[bool, float | None] = {}
        out = np.empty(len(specs))
        for i, spec in enumerate(specs):
            predicted = self.predict(spec, batch, context)
            extra = self.overhead((_label(spec), bucket))
            if extra is None:
                speculative = spec is not None
                if speculative not in least:
                    least[speculative] = self._least(speculative, bucket)
                extra = least[speculative]
                if extra is None:
                    extra = (self.load() - 1.0) * predicted if speculative else 0.0
            out[i] = predicted + extra
        return out

    def overhead(self, key: tuple[str, int]) -> float | None:
        """Median of the counted overheads of (label, bucket), for plain decoding a lower
        quantile; None before any. Erring high on plain decoding's cost, as a few slow
        rounds after a large prefill make it, would pick speculation where it loses."""
        if key not in self._settled:
            seen = self.overheads.get(key)
            if not seen:
                return None
            if key[0] == "none":
                self._settled[key] = sorted(seen)[int((len(seen) - 1) * self.tuning.plain_overhead_quantile)]
            else:
                self._settled[key] = statistics.median(seen)
        return self._settled[key]

    def _least(self, speculative: bool, bucket: int) -> float | None:
        if (speculative, bucket) not in self._least_seen:
            seen = [v for key in self.overheads
                    if key[1] == bucket and (key[0] != "none") == speculative
                    and (v := self.overhead(key)) is not None]
            self._least_seen[(speculative, bucket)] = min(seen, default=None)
        return self._least_seen[(speculative, bucket)]

    def observe(self, spec: SpecConfig | None, batch: int, seconds: float, context: float | None = None) -> None:
        """A measured round over `context` committed tokens on average: its overhead beyond
        the predicted forwards joins its history, its measured / predicted time the load."""
        key = (_label(spec), self.bucket(batch))
        if key not in self._warm:          # its first round: one-time costs, not counted
            self._warm.add(key)
            return
        predicted = self.predict(spec, batch, context)
        history = self.overheads.setdefault(key, deque(maxlen=self.tuning.overhead_history))
        t = self.tuning
        history.append(min(max(seconds - predicted, t.overhead_low * predicted), t.overhead_high * predicted))
        self._recent.append(1.0 + history[-1] / predicted)
        self._load = None
        self._settled.pop(key, None)
        self._least_seen.pop((spec is not None, key[1]), None)

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "contexts": list(self.contexts),
                "grids": {name: {"tokens": list(tokens), "seconds": seconds.tolist()}
                          for name, (tokens, seconds) in self.grids.items()}}

    @classmethod
    def from_dict(cls, d: dict, tuning: Tuning = TUNING) -> "CostModel":
        grids = {name: (tuple(g["tokens"]), np.array(g["seconds"])) for name, g in d["grids"].items()}
        return cls(tuple(d["batches"]), grids, tuple(d["contexts"]), tuning)
