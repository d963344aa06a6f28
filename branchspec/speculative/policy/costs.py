"""Round costs: how long each candidate configuration's round takes at a batch size.

The calls a round makes are timed once per machine, through the engine's own execution
path (eager or compiled: the very graphs the rounds replay), for the policy's candidates,
and cached on disk; a candidate's round time is composed from them, plus an overhead
learned online from its measured rounds.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import statistics
from collections import deque
from pathlib import Path

import numpy as np
import torch

from branchspec.config import SpecConfig, spec_label
from branchspec.disk_cache import cache_dir, source_digest
from branchspec.speculative.round_calls import RoundCalls, median_seconds
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


# -- measuring ---------------------------------------------------------------------------

def calibration_batches(max_batch_size: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 4
    out.append(max_batch_size)
    return tuple(out)


def calibration_contexts(max_position: int, most_tokens: int) -> tuple[int, ...]:
    """The CONTEXTS a model of `max_position` positions can be measured over (each leaves
    room for the largest token count on top)."""
    room = max_position - most_tokens - 1
    return tuple(sorted({max(1, min(c, room)) for c in CONTEXTS}))


@torch.no_grad()
def calibrate(executor, max_batch_size: int, candidates: tuple[SpecConfig | None, ...], repeats: int = 3,
              progress: bool = False, vocab=None) -> CostModel:
    """Time each call a round of these candidates makes (`grid_tokens`), through `executor`
    (the engine's own execution path) over a private paged state and a private drafter
    drafting over `vocab` (the engine's pages and statistics are untouched), at each batch
    of `calibration_batches` and each context of `calibration_contexts`. At each batch
    size the context grows by prefill from one measured length to the next."""
    from branchspec.cache.paged import PagedState
    from branchspec.model.metadata import chain_meta
    from branchspec.speculative.drafter import DrafterState, MTPDrafter

    model = executor.model
    cfg = model.cfg
    p = model.embed.weight
    tokens = grid_tokens(candidates)
    growths = {c.label: c for c in candidates if c is not None}
    batches = calibration_batches(max_batch_size)
    most = max(max(t) for name, t in tokens.items() if name not in BY_GROWTH and t)
    contexts = calibration_contexts(cfg.max_position, most)
    grids = {name: np.zeros((len(batches), len(t), len(contexts))) for name, t in tokens.items()}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(g.size for g in grids.values()), desc=f"calibrating round costs ({executor.name})",
                   unit="shape", leave=False)
    gen = torch.Generator().manual_seed(0)
    for i, B in enumerate(batches):
        cache = PagedState(cfg, max_seqs=B, max_len=contexts[-1] + most + 1, page_size=16, dtype=p.dtype,
                           device=p.device)
        ex = executor.over(cache)
        drafter = MTPDrafter(model, cache, ex, vocab=vocab) if growths else None
        ids = list(range(B))
        for sid in ids:
            cache.add(sid)
            cache.reserve(sid, contexts[-1] + most)
        L = torch.zeros(B, dtype=torch.long, device=p.device)
        for k, context in enumerate(contexts):
            grow = context - int(L[0])
            prompt = torch.randint(3, cfg.vocab_size, (B, grow), generator=gen).to(p.device)
            meta = chain_meta(L, grow, cfg.compressed_kinds)
            out = ex.prefill(prompt, meta, ids, L)
            cache.commit(ids, meta, out.scratch, meta.valid)
            L = L + grow
            if drafter is not None:
                for b, sid in enumerate(ids):
                    drafter.states[sid] = DrafterState(last_hidden=out.hidden[b, -1])
            call = RoundCalls(ex, drafter, out.hidden[:, -1:], ids, L, gen)
            cells = [(name, j, call.draft(growths[key]) if name == "draft" else call.of(name, int(key)))
                     for name, keys in tokens.items() for j, key in enumerate(keys)]
            for (name, j, _), seconds in zip(cells, median_seconds([run for *_, run in cells], repeats, p.device)):
                grids[name][i, j, k] = seconds
            if bar is not None:
                bar.update(len(cells))
    if bar is not None:
        bar.close()
    return CostModel(batches, {name: (tokens[name], g) for name, g in grids.items()}, contexts)


def calibration_key(executor, max_batch_size: int, tokens: dict[str, tuple], vocab_size: int | None = None) -> str:
    """What a calibration depends on: the model's shape and dtype, the execution path, the
    grids, the drafted vocabulary, the machine and its thread count, the torch build, and
    the code whose calls it times (`source_digest`) and this module, which times them."""
    model = executor.model
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blob = json.dumps({"model": model.cfg.to_dict(), "dtype": str(model.embed.weight.dtype),
                       "device": str(model.embed.weight.device), "execution": executor.name,
                       "batches": calibration_batches(max_batch_size), "tokens": tokens, "contexts": CONTEXTS,
                       "draft_vocab": vocab_size, "threads": torch.get_num_threads(), "cpu": cpu,
                       "torch": torch.__version__, "source": source_digest(),
                       "timing": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def load_or_calibrate(executor, max_batch_size: int, candidates: tuple[SpecConfig | None, ...],
                      progress: bool = False, vocab=None) -> CostModel:
    """The cached calibration for this model, execution path, drafted vocabulary (`vocab`,
    a `DraftVocab`, None for the whole) and machine, else a fresh one (then cached; an
    unwritable cache folder only costs the next start another one)."""
    tokens = grid_tokens(candidates)
    key = calibration_key(executor, max_batch_size, tokens, vocab.size if vocab is not None else None)
    path = cache_dir() / f"round-costs-{key}.json"
    try:
        return CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = calibrate(executor, max_batch_size, candidates, progress=progress, vocab=vocab)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(costs.to_dict()))
        tmp.replace(path)
    except OSError:
        pass
    return costs
