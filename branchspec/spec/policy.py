"""Speculation that never loses: pick the draft shape, or none, before every round.

For each candidate c (a SpecConfig, or None for a plain decode step) and the running batch
of B requests, the policy estimates

    throughput(c) = sum over requests of E[tokens emitted by one round of c] / T(c, B)

and runs the argmax. Both factors are measured, not assumed:

* **Acceptance** (`AcceptanceStats`): for every request, decayed counts of how often the
  drafter's rank-r proposal after an accepted depth-d node was the target's token there,
  kept apart on and off the drafter's main line (rank = order of the drafter's
  probability). The proposals are compared whether or not the tree kept them, so the
  counts are not biased towards the nodes a tree happened to keep. Under this positional
  model a node reached by ranks r_1..r_j is accepted with probability q(1, r_1) ...
  q(j, r_j), and a candidate's expected accept length is 1 (the bonus token) plus the sum
  of its best D-1 node values within its depth and branching. That is the tree EAGLE-2's
  selection aims for. What the model still misses (EAGLE-2 picks each round's tree from
  that round's draft confidence) is measured as observed / predicted accepted tokens, per
  kind (chain, tree) and refined per candidate, and corrected for; evidence of what did
  not run fades, so a calibration that unlucky rounds set low is tried again. A request's
  counts start from the engine-wide
  ones (worth `prior_weight` observations), which start from an optimistic prior, so
  depths no round has tried yet get tried. Plain rounds let that evidence fade, so a few
  unlucky rounds do not rule speculation out for good.
* **Round time** (`CostModel`): the target's and the drafter's forward time at (batch,
  tokens per request, committed context), measured once on this machine at start-up and
  cached on disk, then composed per candidate (draft steps + verify + draft-extend, or one
  decode step) at the batch's mean context, plus each candidate's per-round overhead
  learned online from its measured round times.
* **Margins**: the choice is the largest of many noisy estimates, so it is biased high.
  Speculation must look `PLAIN_MARGIN` better than plain decoding, a new best must beat
  the standing choice by `SWITCH_MARGIN`, and a switch between plain decoding and
  speculation is judged again after `PROBE_ROUNDS` rounds.
* **Catch-up**: plain rounds do not feed the drafter, and the prompts' drafter prefill
  waits when the engine-wide statistics expect plain decoding to win
  (`expects_speculation`), so speculating after them first costs one drafter pass over
  what it missed. That is paid once, so it is spread over the rounds the batch has left.

Every candidate is an ordinary lossless round, so whatever the policy picks, the output is
the target model's. The decision is a few small numpy operations every few rounds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import platform
import statistics
import time
from collections import Counter, deque
from pathlib import Path

import numpy as np
import torch

from branchspec.config import AutoPolicy, SpecConfig, spec_label

# Depth/rank grid of the acceptance statistics.
MAX_DEPTH = 16
# A request id no request has: its statistics are the engine-wide ones.
NEW_REQUEST = -1
# Before anything is observed: the rank-1 child is accepted 60% of the time, each lower
# rank half as often. Optimistic on purpose (deep drafts get tried, then measured).
PRIOR_RANK1 = 0.6


# The engine-wide acceptance statistics remember at least about this many rounds.
GLOBAL_MEMORY = 100

# Acceptance is kept apart for nodes whose parent is on the drafter's main line (every
# node above it was its parent's top proposal: the chain) and for the others: after the
# drafter was wrong once, its later proposals are right less often, and a chain's
# estimate must not be diluted by what trees see off its line.
MAIN, OFF = 0, 1


def _prior(max_rank: int) -> np.ndarray:
    """[2, MAX_DEPTH, R] prior acceptance probabilities (main line, off it)."""
    ranks = PRIOR_RANK1 * 0.5 ** np.arange(max_rank)
    return np.stack([np.tile(ranks, (MAX_DEPTH, 1)), np.tile(ranks * 0.75, (MAX_DEPTH, 1))])


# -- expected accept length ---------------------------------------------------------------

def candidate_paths(spec: SpecConfig) -> list[tuple[tuple[int, int], ...]]:
    """Every node a candidate could verify, as its path of (depth, rank) edges from the
    root: depth below num_steps, rank below topk."""
    out: list[tuple[tuple[int, int], ...]] = []
    frontier: list[tuple[tuple[int, int], ...]] = [()]
    for depth in range(spec.num_steps):
        frontier = [path + ((depth, rank),) for path in frontier for rank in range(spec.topk)]
        out.extend(frontier)
    return out


class AcceptanceStats:
    """Decayed per-request (and engine-wide) counts of accepted / tried draft nodes, by
    depth and sibling rank, and the expected accept length of each candidate."""

    def __init__(self, policy: AutoPolicy):
        self.policy = policy
        self.R = max((c.topk for c in policy.speculative), default=1)
        shape = (2, MAX_DEPTH, self.R)
        # Engine-wide counts start as 4 pseudo-observations of the prior.
        self.prior_hits, self.prior_tries = _prior(self.R) * 4.0, np.full(shape, 4.0)
        self.global_hits, self.global_tries = self.prior_hits.copy(), self.prior_tries.copy()
        # Per-request counts, one row per request (row 0 stays zero: a request with none yet).
        self._rows: dict[int, int] = {}
        self._free: list[int] = []
        self._hits = np.zeros((1, *shape))
        self._tries = np.zeros((1, *shape))
        self.specs = policy.speculative
        # Every node any candidate could verify, once: [N, P] the columns of its path's
        # edges in the flattened [2 * MAX_DEPTH * R] acceptance (padded with one past the
        # end, a zero column), and which candidates may use each node [C, N]. A gather and
        # a sum, not a matrix product: numpy's BLAS threads would spin on the cores the
        # model's forwards run on.
        paths: dict[tuple, int] = {}
        members: list[list[int]] = []
        for spec in self.specs:
            mine = []
            for path in candidate_paths(spec):
                mine.append(paths.setdefault(path, len(paths)))
            members.append(mine)
        self.num_edges = 2 * MAX_DEPTH * self.R
        self.path_edges = np.full((len(paths), max((len(p) for p in paths), default=1)), self.num_edges)
        for path, i in paths.items():
            line = MAIN
            for j, (depth, rank) in enumerate(path):
                self.path_edges[i, j] = (line * MAX_DEPTH + depth) * self.R + rank
                if rank:
                    line = OFF
        # Candidates that differ only in D draw from the same nodes (those within their
        # depth and branching): one [S, n] row of node columns per distinct node set,
        # padded with len(paths), a node of value 0, and each candidate's set and count.
        sets: dict[tuple[int, ...], int] = {}
        self.member_set = np.array([sets.setdefault(tuple(m), len(sets)) for m in members], dtype=np.intp)
        self.set_nodes = np.full((len(sets), max((len(m) for m in sets), default=1)), len(paths))
        for nodes, i in sets.items():
            self.set_nodes[i, :len(nodes)] = nodes
        # [C] where each candidate's best D-1 end in its set's cumulative sum
        self.keep_at = np.minimum(np.array([c.num_draft_tokens - 1 for c in self.specs], dtype=np.intp),
                                  self.set_nodes.shape[1]) - 1

    def relax(self, seq_ids: list[int], rounds: int = 1, rate: float = 0.01) -> None:
        """`rounds` rounds without drafts over these requests. Each one's own counts decay
        as in a speculative round (its estimate returns towards the engine-wide one) and
        the engine-wide counts drift back towards the optimistic prior by `rate` a round:
        a few unlucky rounds do not rule speculation out for good, and after a run of plain
        rounds a speculative one is tried again (the text, or the batch, may have changed)."""
        keep, drift = self.policy.decay ** rounds, (1.0 - rate) ** rounds
        rows = self._lookup(seq_ids)
        self._hits[rows] *= keep
        self._tries[rows] *= keep
        self.global_hits = drift * self.global_hits + (1.0 - drift) * self.prior_hits
        self.global_tries = drift * self.global_tries + (1.0 - drift) * self.prior_tries

    def _lookup(self, seq_ids: list[int]) -> np.ndarray:
        """Each request's row, 0 (all zero) for one without counts."""
        return np.fromiter((self._rows.get(s, 0) for s in seq_ids), dtype=np.intp, count=len(seq_ids))

    def _rows_for(self, seq_ids: list[int]) -> np.ndarray:
        """Each request's row, a fresh zero one for a request without counts."""
        for sid in seq_ids:
            if sid not in self._rows:
                if not self._free:
                    n = len(self._hits)
                    self._hits = np.concatenate([self._hits, np.zeros_like(self._hits)])
                    self._tries = np.concatenate([self._tries, np.zeros_like(self._tries)])
                    self._free = list(range(2 * n - 1, n - 1, -1))
                self._rows[sid] = self._free.pop()
        return self._lookup(seq_ids)

    def counts(self, seq_id: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A request's own (hits, tries) [2, MAX_DEPTH, R], None before its first round."""
        row = self._rows.get(seq_id)
        return None if row is None else (self._hits[row], self._tries[row])

    def forget(self, seq_id: int) -> None:
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._hits[row] = 0.0
            self._tries[row] = 0.0
            self._free.append(row)

    def acceptance(self, seq_ids: list[int]) -> np.ndarray:
        """[B, 2, MAX_DEPTH, R] estimated P(rank-r child at depth d accepted | parent accepted),
        for parents on the drafter's main line and off it."""
        w = self.policy.prior_weight
        g = self.global_hits / self.global_tries
        rows = self._lookup(seq_ids)
        return np.clip((self._hits[rows] + w * g) / (self._tries[rows] + w), 1e-4, 1.0)

    def expected_accept(self, seq_ids: list[int]) -> np.ndarray:
        """[B, C] expected tokens one round of each speculative candidate emits (bonus
        included) for each request: 1 + its best D-1 node values, all candidates at once.
        A node's value is at most its parent's, so the best D-1 always form a tree."""
        B = len(seq_ids)
        logq = np.zeros((B, self.num_edges + 1))                              # [B, 2 * MAX_DEPTH * R + 1]
        logq[:, :-1] = np.log(self.acceptance(seq_ids)).reshape(B, -1)
        values = np.zeros((B, len(self.path_edges) + 1))                     # [B, N + 1], last: padding
        values[:, :-1] = np.exp(logq[:, self.path_edges].sum(axis=2))
        ranked = -np.sort(-values[:, self.set_nodes], axis=2)                # [B, S, n] best first
        best = np.cumsum(ranked, axis=2)                                     # [B, S, n]
        return 1.0 + best[:, self.member_set, self.keep_at]

    def observe(self, seq_ids: list[int], children: torch.Tensor, targets: torch.Tensor) -> None:
        """One verified round. children: [B, D, k] the drafter's proposals after each node
        of the accepted path (-1 where it did not expand the node); targets: [B, D] the
        target's token at each path node (-1 past the path's end).

        At every path node the drafter expanded, each rank r is one try at that depth, and
        a hit when its proposal is the target's token: an unbiased sample of "the rank-r
        child is accepted given its parent was", whichever nodes the tree happened to keep.
        """
        ch = children.cpu().numpy()                                         # [B, D, k]
        tg = targets.cpu().numpy()[..., None]                              # [B, D, 1]
        D, k = min(ch.shape[1], MAX_DEPTH), min(ch.shape[2], self.R)
        ch, tg = ch[:, :D, :k], tg[:, :D]
        valid = (ch >= 0) & (tg >= 0)
        hit = valid & (ch == tg)                                            # [B, D, k]
        # Path node i is on the main line when every path node up to it was its parent's
        # top proposal (the root always is).
        main = np.ones(hit.shape[:2], dtype=bool)
        main[:, 1:] = np.logical_and.accumulate(hit[:, :-1, 0], axis=1)
        on = main[..., None]
        tries = np.stack([valid & on, valid & ~on], axis=1)                # [B, 2, D, k]
        hits = np.stack([hit & on, hit & ~on], axis=1)
        decay = self.policy.decay
        rows = self._rows_for(seq_ids)                                      # distinct requests
        self._hits[rows] *= decay
        self._tries[rows] *= decay
        self._hits[rows, :, :D, :k] += hits
        self._tries[rows, :, :D, :k] += tries
        # Engine-wide: one decay every batch-size rounds, and a memory of at least
        # GLOBAL_MEMORY rounds (at batch 1 the one request's last ten rounds are too few).
        gd = max(decay ** (1.0 / max(1, len(seq_ids))), 1.0 - 1.0 / GLOBAL_MEMORY)
        self.global_hits *= gd
        self.global_tries *= gd
        self.global_hits[:, :D, :k] += hits.sum(axis=0)
        self.global_tries[:, :D, :k] += tries.sum(axis=0)


# -- round time ---------------------------------------------------------------------------

TARGET, DRAFTER = 0, 1     # the forwards a CostModel times


class CostModel:
    """Forward time of the target and the drafter on a (batch, tokens per request, context)
    grid, and the round time of each candidate composed from them.

    target[i, j, k] / mtp[i, j, k]: seconds of one forward at batch BATCHES[i] with
    TOKENS[j] new tokens per request over CONTEXTS[k] committed ones. Off-grid points
    interpolate linearly in log(batch), in tokens and in context (beyond the longest
    context: linearly, on the slope between the last two). The context matters: attention
    reads the window and every compressed entry, so a step over 500 committed tokens costs
    about a third more than one over 128 at batch 64 on the default model.

    Per (candidate label, batch bucket) it also keeps the last `HISTORY` measured overheads
    (measured - predicted round time: plan, accept, commit, sampling, Python), and adds
    their median: the per-round cost the grid does not see, learned as rounds run, robust
    to a round slowed by something else.
    """

    # Up to a tree's verify (16) and a catch-up chunk (64: a deferred prompt, plain rounds).
    TOKENS = (1, 2, 4, 8, 16, 64)
    # Committed tokens the grid is measured over: a short context and a long one.
    CONTEXTS = (128, 512)
    HISTORY = 8
    # Predictions are kept per context rounded to this many tokens.
    CONTEXT_STEP = 32

    def __init__(self, batches: tuple[int, ...], target: np.ndarray, mtp: np.ndarray,
                 contexts: tuple[int, ...] = CONTEXTS):
        self.batches, self.contexts = tuple(batches), tuple(contexts)
        self.target, self.mtp = np.asarray(target, float), np.asarray(mtp, float)
        shape = (len(self.batches), len(self.TOKENS), len(self.contexts))
        if self.target.shape != shape or self.mtp.shape != shape:
            raise ValueError(f"cost grids must have shape {shape}, got {self.target.shape} and {self.mtp.shape}")
        if list(self.contexts) != sorted(set(self.contexts)):
            raise ValueError(f"contexts must be increasing, got {self.contexts}")
        self.overheads: dict[tuple[str, int], deque[float]] = {}
        self._predicted: dict[tuple[SpecConfig | None, int, int], float] = {}
        self._rows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
        self._settled: dict[tuple[str, int], float] = {}
        self._least_seen: dict[tuple[bool, int], float] = {}
        self._warm: set[tuple[str, int]] = set()

    def _context(self, context: float | None) -> int:
        """The context a prediction is kept under: rounded to CONTEXT_STEP (None: the
        shortest measured)."""
        if context is None:
            return self.contexts[0]
        return max(1, int(round(context / self.CONTEXT_STEP))) * self.CONTEXT_STEP

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

    def _row(self, forward: int, batch: int, context: int) -> np.ndarray:
        """[len(TOKENS)] forward seconds of the TARGET or the DRAFTER at
        `batch` over `context`, interpolated once per (batch, context)."""
        key = (batch, context)
        if key not in self._rows:
            lb, x = np.log2(np.asarray(self.batches, float)), math.log2(batch)
            scale = batch / self.batches[-1] if batch > self.batches[-1] else 1.0   # beyond the grid
            self._rows[key] = tuple(
                scale * np.array([np.interp(x, lb, col) for col in self._over_context(grid, context).T])
                for grid in (self.target, self.mtp))
        return self._rows[key][forward]

    def _at(self, forward: int, batch: int, tokens: int, context: int) -> float:
        t = float(np.interp(min(tokens, self.TOKENS[-1]), self.TOKENS, self._row(forward, batch, context)))
        if tokens > self.TOKENS[-1]:
            t *= tokens / self.TOKENS[-1]
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
            return self._at(TARGET, batch, 1, context)
        # The root's drafter slot comes with the previous round's draft extend, which runs
        # D + 1 nodes (the path and the next root): one drafter forward per later step.
        draft = (spec.num_steps - 1) * self._at(DRAFTER, batch, spec.topk, context)
        verify = self._at(TARGET, batch, spec.num_draft_tokens, context)
        extend = self._at(DRAFTER, batch, spec.num_draft_tokens + 1, context)
        return draft + verify + extend

    def catch_up_seconds(self, batch: int, lag: int, context: float | None = None) -> float:
        """One drafter pass over `lag` positions per request: the price of speculating
        after rounds (or a prefill) the drafter did not follow."""
        return self._at(DRAFTER, batch, lag, self._context(context)) if lag > 0 else 0.0

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def round_seconds(self, spec: SpecConfig | None, batch: int, context: float | None = None) -> float:
        """Predicted forward seconds plus the round's overhead beyond them, as measured for
        this candidate at this batch bucket. A candidate's first round is not counted (it
        pays one-time costs: allocation, metadata for a new shape), and until it has one
        counted round it is given the least overhead measured for its kind (speculative or
        plain), so it gets tried rather than inheriting another shape's overhead."""
        return float(self.round_seconds_of((spec,), batch, context)[0])

    def round_seconds_of(self, specs: tuple[SpecConfig | None, ...], batch: int,
                         context: float | None = None) -> np.ndarray:
        """`round_seconds` of several candidates: [len(specs)]."""
        bucket = self.bucket(batch)
        least: dict[bool, float] = {}
        out = np.empty(len(specs))
        for i, spec in enumerate(specs):
            extra = self.overhead((_label(spec), bucket))
            if extra is None:
                speculative = spec is not None
                if speculative not in least:
                    least[speculative] = self._least(speculative, bucket)
                extra = least[speculative]
            out[i] = self.predict(spec, batch, context) + extra
        return out

    def overhead(self, key: tuple[str, int]) -> float | None:
        """Median of the counted overheads of (label, bucket), for plain decoding their lower
        quartile; None before any. Erring high on plain decoding's cost, as a few slow
        rounds after a large prefill make it, would pick speculation where it loses."""
        if key not in self._settled:
            seen = self.overheads.get(key)
            if not seen:
                return None
            self._settled[key] = sorted(seen)[(len(seen) - 1) // 4] if key[0] == "none" else statistics.median(seen)
        return self._settled[key]

    def _least(self, speculative: bool, bucket: int) -> float:
        if (speculative, bucket) not in self._least_seen:
            seen = [v for key in self.overheads
                    if key[1] == bucket and (key[0] != "none") == speculative
                    and (v := self.overhead(key)) is not None]
            self._least_seen[(speculative, bucket)] = min(seen, default=0.0)
        return self._least_seen[(speculative, bucket)]

    def observe(self, spec: SpecConfig | None, batch: int, seconds: float, context: float | None = None) -> None:
        """A measured round over `context` committed tokens on average: its overhead beyond
        the predicted forwards joins its history."""
        key = (_label(spec), self.bucket(batch))
        if key not in self._warm:          # its first round: one-time costs, not counted
            self._warm.add(key)
            return
        predicted = self.predict(spec, batch, context)
        history = self.overheads.setdefault(key, deque(maxlen=self.HISTORY))
        history.append(min(max(seconds - predicted, -0.5 * predicted), 3.0 * predicted))
        self._settled.pop(key, None)
        self._least_seen.pop((spec is not None, key[1]), None)

    def to_dict(self) -> dict:
        return {"batches": list(self.batches), "tokens": list(self.TOKENS), "contexts": list(self.contexts),
                "target": self.target.tolist(), "mtp": self.mtp.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        if tuple(d["tokens"]) != cls.TOKENS:
            raise ValueError("calibration grid changed")
        return cls(tuple(d["batches"]), np.array(d["target"]), np.array(d["mtp"]), tuple(d["contexts"]))


def calibration_batches(max_batch_size: int) -> tuple[int, ...]:
    out, b = [], 1
    while b < max_batch_size:
        out.append(b)
        b *= 4
    out.append(max_batch_size)
    return tuple(out)


def calibration_contexts(max_position: int) -> tuple[int, ...]:
    """The CONTEXTS a model of `max_position` positions can be measured over (each leaves
    room for the largest token count on top)."""
    room = max_position - CostModel.TOKENS[-1] - 1
    return tuple(sorted({max(1, min(c, room)) for c in CostModel.CONTEXTS}))


@torch.no_grad()
def calibrate(model, max_batch_size: int, repeats: int = 3, progress: bool = False) -> CostModel:
    """Time the target's and the drafter's forward over the (batch, tokens, context) grid,
    in a private cache (the engine's pages are untouched). At each batch size the context
    grows by prefill from one measured length to the next."""
    from branchspec.cache.paged import PagedState
    from branchspec.model.metadata import chain_meta

    cfg = model.cfg
    p = model.embed.weight
    batches = calibration_batches(max_batch_size)
    T = CostModel.TOKENS
    contexts = calibration_contexts(cfg.max_position)
    target = np.zeros((len(batches), len(T), len(contexts)))
    mtp = np.zeros_like(target)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=target.size, desc="calibrating round costs", unit="shape", leave=False)
    gen = torch.Generator().manual_seed(0)
    for i, B in enumerate(batches):
        cache = PagedState(cfg, max_seqs=B, max_len=contexts[-1] + T[-1] + 1, page_size=16, dtype=p.dtype,
                           device=p.device)
        ids = list(range(B))
        for sid in ids:
            cache.add(sid)
            cache.reserve(sid, contexts[-1] + T[-1])
        L = torch.zeros(B, dtype=torch.long, device=p.device)
        for k, context in enumerate(contexts):
            grow = context - int(L[0])
            tokens = torch.randint(3, cfg.vocab_size, (B, grow), generator=gen).to(p.device)
            meta = chain_meta(L, grow, cfg.compressed_ratios)
            out = model(tokens, meta, cache.gather(ids, L))
            cache.commit(ids, meta, out.scratch, meta.valid)
            L = L + grow
            hidden = out.hidden[:, -1:]
            for j, n in enumerate(T):
                new = torch.randint(3, cfg.vocab_size, (B, n), generator=gen).to(p.device)
                times_t, times_m = [], []
                for _ in range(repeats + 1):
                    t0 = time.perf_counter()
                    m = chain_meta(L, n, cfg.compressed_ratios)
                    model(new, m, cache.gather(ids, L))
                    t1 = time.perf_counter()
                    mm = chain_meta(L, n, ())
                    model.mtp_forward(new, hidden.expand(B, n, hidden.shape[-1]), mm, cache.gather_mtp(ids, L))
                    t2 = time.perf_counter()
                    times_t.append(t1 - t0)
                    times_m.append(t2 - t1)
                target[i, j, k] = float(np.median(times_t[1:]))
                mtp[i, j, k] = float(np.median(times_m[1:]))
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    return CostModel(batches, target, mtp, contexts)


def calibration_key(model, max_batch_size: int) -> str:
    """What a calibration depends on: the model's shape and dtype, the batch grid, the
    machine and its thread count, and the torch build."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    blob = json.dumps({"model": model.cfg.to_dict(), "dtype": str(model.embed.weight.dtype),
                       "device": str(model.embed.weight.device), "batches": calibration_batches(max_batch_size),
                       "tokens": CostModel.TOKENS, "contexts": CostModel.CONTEXTS, "threads": torch.get_num_threads(), "cpu": cpu,
                       "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def cache_dir() -> Path:
    root = os.environ.get("BRANCHSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "branchspec")
    return Path(root)


def load_or_calibrate(model, max_batch_size: int, progress: bool = False) -> CostModel:
    """The cached calibration for this model and machine, else a fresh one (then cached;
    an unwritable cache folder only costs the next start another calibration)."""
    path = cache_dir() / f"round-costs-{calibration_key(model, max_batch_size)}.json"
    try:
        return CostModel.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = calibrate(model, max_batch_size, progress=progress)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(costs.to_dict()))
        tmp.replace(path)
    except OSError:
        pass
    return costs


# -- the policy ----------------------------------------------------------------------------

# Pseudo-tokens both sides of a kind's (chain, tree) accept calibration start with, so a
# few unlucky rounds do not condemn it.
CALIBRATION_PRIOR = 16.0
# A candidate's own calibration is shrunk towards its kind's with this many predicted
# tokens' weight. In every speculative round, the evidence of the shapes and of the kind
# that did not run fades by CALIBRATION_FADE (a kind's back towards level): the rounds a
# policy runs are the ones whose estimates were high, partly by chance, so what they
# measure is biased low, and a shape or kind set low that way, no longer chosen and so
# never measured again, would otherwise stay low for good.
LABEL_WEIGHT = 8.0
CALIBRATION_FADE = 0.98
# In a plain round every calibration drifts this much of the way back towards level.
PLAIN_FADE = 0.97
# The estimates are recomputed every this many rounds while the batch stays the same, or
# every batch / REDECIDE_PER_REQUESTS rounds if that is more: a large batch's estimate
# moves slowly and costs more to recompute.
REDECIDE_EVERY = 4
REDECIDE_PER_REQUESTS = 8
# A better estimate must beat the standing choice by this much to replace it.
SWITCH_MARGIN = 0.03
# Speculation must beat plain decoding's estimate by this much to be chosen over it: a
# speculative estimate has more ways to be wrong (acceptance, four phases' costs, the
# drafter's catch-up), and losing to plain decoding is the one outcome the policy exists
# to prevent.
PLAIN_MARGIN = 0.08
# A choice whose estimate leads every other by this much is judged again 4 times less often.
CLEAR_LEAD = 1.15
# After a switch between plain decoding and speculation the new choice is judged again
# this soon, with its first measured rounds: a switch made on a wrong estimate costs two
# rounds, not a full decision period.
PROBE_ROUNDS = 2


@functools.lru_cache(maxsize=None)
def _label(spec: SpecConfig | None) -> str:
    return spec_label(spec)


KINDS = ("chain", "tree")


def _kind(spec: SpecConfig) -> str:
    return "chain" if spec.is_chain else "tree"


class SpecPolicyRunner:
    """Chooses each round's configuration and learns from its outcome."""

    def __init__(self, policy: AutoPolicy, costs: CostModel):
        self.policy, self.costs = policy, costs
        self.stats = AcceptanceStats(policy)
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
        self._plain_rounds = 0
        self._period_scale = 1

    def choose(self, seq_ids: list[int], lag: list[int] | None = None,
               remaining: list[int] | None = None, context: float | None = None) -> SpecConfig | None:
        """The configuration for the next round over these requests. lag: per request, the
        committed positions the drafter has not followed (a speculative round first feeds
        them to it); remaining: per request, the tokens it may still emit; context: their
        mean committed length (forwards over a longer context cost more).

        The estimates are recomputed every `REDECIDE_EVERY` rounds (more at large
        batches), or at once when the batch changed; in between the last choice stands. A new best must beat the
        standing choice by `SWITCH_MARGIN`: near-ties are within the estimates' noise."""
        t0 = time.perf_counter()
        batch = tuple(seq_ids)
        every = PROBE_ROUNDS if self._switched else \
            self._period_scale * max(REDECIDE_EVERY, len(seq_ids) // REDECIDE_PER_REQUESTS)
        if batch == self._last_batch and self._rounds_since < every - 1:
            self._rounds_since += 1
            best = self.last_choice
        else:
            best = self._decide(seq_ids, lag, remaining, context)
            self._last_batch, self._rounds_since = batch, 0
        self.counts[_label(best)] += 1
        self.decide_seconds += time.perf_counter() - t0
        return best

    def expects_speculation(self, batch: int, context: float | None = None) -> bool:
        """Would a round over `batch` requests the engine knows nothing about yet speculate?
        Judged from the engine-wide statistics alone, with no catch-up to pay: the engine
        asks at admission whether to feed the drafter the prompts now, with the target's
        prefill, or only if a speculative round comes."""
        if not self.stats.specs:
            return False
        self._settle_plain()
        B = max(1, batch)
        plain = B / self.costs.round_seconds(None, B, context) if None in self.policy.candidates else 0.0
        tokens, seconds = self._speculative(B * self.stats.expected_accept([NEW_REQUEST])[0], B, context)
        return bool((tokens / seconds).max() > (1 + PLAIN_MARGIN) * plain)

    def _decide(self, seq_ids: list[int], lag: list[int] | None = None,
                remaining: list[int] | None = None, context: float | None = None) -> SpecConfig | None:
        self._settle_plain()
        B = len(seq_ids)
        specs = self.stats.specs
        options: list[SpecConfig | None] = ([None] if None in self.policy.candidates else []) + list(specs)
        rates = np.empty(len(options))
        if options[0] is None:
            rates[0] = B / self.costs.round_seconds(None, B, context)
        emitted = None
        if specs:
            per_request = self.stats.expected_accept(seq_ids)                 # [B, C]
            if remaining:     # a request near its budget cannot emit more than it has left
                per_request = np.minimum(per_request, np.maximum(np.asarray(remaining, float), 1.0)[:, None])
            emitted = per_request.sum(axis=0)                                # [C], the model's own estimate
            tokens, seconds = self._speculative(emitted, B, context)
            # Speculating now first feeds the drafter what it has not followed (a deferred
            # prompt, plain rounds): paid once, so spread over the rounds the batch has left.
            if lag and max(lag) > 0:
                left = float(np.mean(remaining)) if remaining else 0.0
                seconds = seconds + self.costs.catch_up_seconds(B, max(lag), context) / np.maximum(1.0, left * B / tokens)
            rates[len(options) - len(specs):] = tokens / seconds
        estimate = {_label(spec): float(rate) for spec, rate in zip(options, rates)}
        judged = rates.copy()
        if options[0] is None:
            judged[0] *= 1 + PLAIN_MARGIN
        i = int(np.argmax(judged))
        best, best_rate = options[i], judged[i]
        if self._last_batch is not None and self.last_choice in self.policy.candidates:
            standing = judged[options.index(self.last_choice)]
            if best_rate < (1 + SWITCH_MARGIN) * standing:
                best = self.last_choice
        self._switched = (best is None) != (self.last_choice is None)
        # A clear winner is checked less often: the estimates move by a few percent a round.
        runner_up = np.partition(judged, -2)[-2] if len(judged) > 1 else 0.0
        lead = judged[options.index(best)] / runner_up if runner_up > 0 else math.inf
        self._period_scale = 4 if lead > CLEAR_LEAD else 1
        self.last_choice, self.last_estimate = best, estimate
        self._predicted_per_request = None if best is None else float(emitted[specs.index(best)]) / B
        return best

    def _speculative(self, emitted: np.ndarray, B: int, context: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Each speculative candidate's calibrated tokens per round and round seconds [C],
        for B requests whose positional model expects `emitted` [C] tokens a round in all."""
        calibration = np.array([self.calibration(spec) for spec in self.stats.specs])
        return B + calibration * (emitted - B), self.costs.round_seconds_of(self.stats.specs, B, context)

    def observe(self, spec: SpecConfig | None, seq_ids: list[int], seconds: float,
                children: torch.Tensor | None = None, targets: torch.Tensor | None = None,
                path_len: list[int] | None = None, context: float | None = None) -> None:
        """The outcome of the round `choose` picked: its wall time, and for a speculative
        round the drafter's proposals against the target's tokens along each accepted path
        and the path lengths. context: the requests' mean committed length before it."""
        t0 = time.perf_counter()
        self.costs.observe(spec, len(seq_ids), seconds, context)
        if spec is None:
            batch = tuple(seq_ids)
            if batch != self._plain_batch:
                self._settle_plain()
                self._plain_batch = batch
            self._plain_rounds += 1
        elif children is not None:
            self._settle_plain()
            self.stats.observe(seq_ids, children, targets)
            if self._predicted_per_request is not None and spec is self.last_choice:
                self._calibrate(spec, float(sum(path_len)), self._predicted_per_request * len(seq_ids),
                                len(seq_ids))
        self.decide_seconds += time.perf_counter() - t0

    def _settle_plain(self) -> None:
        """Apply the plain rounds seen since the last estimate: each request's acceptance
        decays, the engine-wide acceptance drifts towards the prior and every calibration
        towards level (by `PLAIN_FADE` a round), exactly as one round at a time would."""
        if self._plain_rounds:
            batch, n = self._plain_batch, self._plain_rounds
            self.stats.relax(list(batch), rounds=n)
            self._fade_calibration(PLAIN_FADE ** n)
        self._plain_batch, self._plain_rounds = None, 0

    def calibration(self, spec: SpecConfig) -> float:
        """Observed / predicted drafted tokens accepted: the kind's (chain or tree) ratio of
        decayed sums that start level (CALIBRATION_PRIOR tokens each), refined by this
        candidate's own evidence (`LABEL_WEIGHT`). It absorbs what the positional model
        misses: EAGLE-2 picks each round's tree by that round's draft confidence, and
        acceptance at one depth is not independent of the next."""
        self._settle_plain()
        seen, predicted = self.accept_sums.get(_kind(spec), (1.0, 1.0))
        level = seen / predicted
        own = self.accept_sums.get(_label(spec))
        if own is None:
            return level
        return (own[0] + LABEL_WEIGHT * level) / (own[1] + LABEL_WEIGHT)

    def _calibrate(self, spec: SpecConfig, observed: float, predicted: float, batch: int,
                   keep: float = 0.9) -> None:
        drafted_pred, drafted_seen = max(predicted - batch, 0.0), max(observed - batch, 0.0)
        label, kind = _label(spec), _kind(spec)
        self._fade_calibration(CALIBRATION_FADE, skip=(label, kind))
        seen, pred = self.accept_sums.get(label, (0.0, 0.0))
        self.accept_sums[label] = (keep * seen + drafted_seen, keep * pred + drafted_pred)
        seen, pred = self.accept_sums.get(kind, (CALIBRATION_PRIOR, CALIBRATION_PRIOR))
        self.accept_sums[kind] = (keep * seen + drafted_seen, keep * pred + drafted_pred)

    def _fade_calibration(self, keep: float, skip: tuple[str, ...] = ()) -> None:
        """Each kind's sums drift towards level by 1 - keep, and each shape's own evidence
        fades by `keep`; those named in `skip` (the ones that just ran) excepted."""
        for key, (seen, predicted) in self.accept_sums.items():
            if key in skip:
                continue
            if key in KINDS:
                self.accept_sums[key] = (keep * seen + (1 - keep) * CALIBRATION_PRIOR,
                                         keep * predicted + (1 - keep) * CALIBRATION_PRIOR)
            else:
                self.accept_sums[key] = (keep * seen, keep * predicted)

    def forget(self, seq_id: int) -> None:
        self._settle_plain()
        self.stats.forget(seq_id)
