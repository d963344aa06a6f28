"""Measured acceptance, for the calibrated draft-tree selection and the adaptive policy.

EAGLE-2 keeps the D - 1 nodes with the highest cumulative *draft* probability: it takes
the drafter's probability p of a child as its chance of being accepted. Whether the
target accepts it is another quantity: a well distilled drafter's first guess is right
far more often than its probability says, and a sibling's probability overstates its
chance. The calibrated selection (`SpecConfig(selection="calibrated")`) values a node by
the product, along its path, of

    q(edge) = min(1, p * c(cell)),    c(cell) = accepted / sum of p, over the cell's tries,

an estimate of P(the child is accepted | its parent was accepted): the drafter's own
probability, corrected by how often children like it were really accepted. A cell is
what is known when drafting: the child's depth, its rank among its siblings (order of
the drafter's probability), a bucket of p, and whether its parent is on the drafter's
main line (every node above it its parent's first proposal). Within a cell p keeps its
resolution, so with no evidence (c = 1) the selection is EAGLE-2's. Greedy and sampled
requests are kept apart (sampling accepts the target's draw, greedy its argmax), counts
decay, and each request's own counts start from the engine-wide ones.

Every verified round is an unbiased sample: at each node of the accepted path that the
drafter expanded, each of its k proposals was a try, and a hit when it is the target's
token there, whether or not the tree kept it. Selection depends on the drafter and past
rounds only, never on this round's target draws, so decoding stays lossless.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from branchspec.config import AutoPolicy

# The probability buckets' upper edges (the last bucket is (0.9, 1]).
PROB_EDGES = (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.9)
MAX_DEPTH = AutoPolicy.MAX_DEPTH     # deeper edges share the last depth's estimates
GREEDY, SAMPLED = 0, 1
NEW_REQUEST = -1         # a request id no request has: it reads the engine-wide counts


def bucket_of(prob: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """The probability bucket (by upper edges `edges`) of each drafter probability (same shape)."""
    return torch.bucketize(prob.to(torch.float64).contiguous(), edges.to(prob.device))


def edge_log_values(log_c: torch.Tensor, edges: torch.Tensor, depth: int, parent_main: torch.Tensor | None,
                    logp: torch.Tensor) -> torch.Tensor:
    """log q of the children of one step's parents: log_c [B, 2, depths, R, buckets]
    (`AcceptanceModel.log_factors`, at least `depth` deep); edges the buckets' upper edges;
    depth the children's depth (1 = the root's children); parent_main [B, P] bool, or None
    where every parent is on the main line (the root: a line of constants there would be
    folded by the compiler, whose folding then fixed a compiled growth's batch); logp
    [B, P, k] the drafter's log-probabilities of each parent's top-k children, best first
    -> [B, P, k], never above 0. A pure function of tensors (the compiled growth runs it in
    its graph), one gather from the flattened table."""
    B, P, k = logp.shape
    depths, R, buckets = log_c.shape[2:]
    d = min(depth, depths) - 1
    rank = torch.arange(k, device=logp.device).clamp(max=R - 1)                   # [k]
    row = d if parent_main is None else (~parent_main).long()[..., None] * depths + d   # [B, P, 1]
    cell = (row * R + rank) * buckets + bucket_of(logp.exp(), edges)             # [B, P, k]
    table = log_c.reshape(B, -1).to(logp.device)
    return (logp + table.gather(1, cell.reshape(B, P * k)).view(B, P, k).to(logp.dtype)).clamp(max=0.0)


# Before any round, a child of rank r is accepted (given its parent was) this often,
# whatever its probability: the marginal estimate an adaptive policy starts from
# (`AcceptanceModel.acceptance`). Optimistic, so that speculation is tried and then
# measured, at the price of a round or two where it fails: a first guess as good as a
# well trained drafter's (the embedded model's is right 0.75-0.85 of the time greedy,
# 0.4-0.6 at T = 0.7). A prior below the truth is not corrected at large batches, where a
# round costs more plain steps: at 0.6, a fresh engine never tried speculating on GSM8K
# at batch 64, where chains of D = 3-5 decode 1.03-1.14x as fast as plain decoding (side
# by side, AMD EPYC). Each lower rank is accepted PRIOR_RANK_DECAY times as often as the
# one above it (measured: 0.1-0.2 for the second); off the drafter's main line
# PRIOR_OFF_LINE times as often as on it.
PRIOR_RANK1, PRIOR_RANK_DECAY, PRIOR_OFF_LINE = 0.8, 0.25, 0.75
HITS, MASS, TRIES = 0, 1, 2      # the count tables, in this order


def marginal_prior(max_rank: int) -> torch.Tensor:
    """[2 main/off, MAX_DEPTH, max_rank] the prior P(accepted | parent accepted)."""
    ranks = PRIOR_RANK1 * PRIOR_RANK_DECAY ** torch.arange(max_rank, dtype=torch.float64)
    main = ranks.expand(MAX_DEPTH, max_rank)
    return torch.stack([main, main * PRIOR_OFF_LINE])


def _along_path(children: torch.Tensor, children_logp: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor,
                bonus: torch.Tensor, path_tokens: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A round's observations along its accepted paths (`AcceptanceModel.observe_round`):
    the proposals after each path node [B, D, k], their log-probabilities [B, D, k], and
    the target's token there [B, D] (the next path token, then the bonus; -1 past it)."""
    path, n = path.cpu().numpy(), path_len.cpu().numpy()                 # [B, D], [B]
    B, D = path.shape
    rows = np.arange(B)[:, None]
    targets = np.full((B, D), -1, dtype=np.int64)
    targets[:, :-1] = path_tokens.cpu().numpy()[:, 1:]
    targets[np.arange(D)[None] >= (n - 1)[:, None]] = -1
    targets[np.arange(B), n - 1] = bonus.cpu().numpy()
    return children.cpu().numpy()[rows, path], children_logp.cpu().numpy()[rows, path], targets


def _stacked(arrays: list[np.ndarray], fill) -> np.ndarray:
    """Rounds' arrays [B_i, D_i(, k_i)] one above another [sum of B_i, max D(, max k)],
    shorter ones padded with `fill` (a proposal or target of -1 is no try)."""
    shape = tuple(max(a.shape[d] for a in arrays) for d in range(1, arrays[0].ndim))
    if all(a.shape[1:] == shape for a in arrays):
        return np.concatenate(arrays)
    out = np.full((sum(len(a) for a in arrays), *shape), fill, dtype=arrays[0].dtype)
    start = 0
    for a in arrays:
        out[(slice(start, start + len(a)), *(slice(0, n) for n in a.shape[1:]))] = a
        start += len(a)
    return out


class AcceptanceModel:
    """The engine's measured acceptance: decayed counts by (mode, request, main line,
    depth, rank, probability bucket), read two ways.

    Three tables share the cells [2 main/off, MAX_DEPTH, ranks, buckets]: hits (accepted
    tries), mass (the drafter's probability summed over the tries) and tries.
    - The calibrated selection reads each cell's factor c = hits / mass (`log_factors`).
    - An adaptive policy reads each (line, depth, rank)'s acceptance, hits / tries over
      every bucket (`acceptance`): what a node of that kind is worth before this round's
      draft probabilities are known, to weigh budgets D (or no speculation) against their
      round times.
    Both come from the same verified rounds, so the policy and the selection never disagree
    about what was accepted.

    Before any round every cell's factor is 1 (the drafter taken at its word: the
    calibrated selection starts as EAGLE-2's), with the weight of `prior_observations`
    tries at the bucket's middle probability, and the marginal acceptance is
    `marginal_prior`'s. Per-request counts live in rows of one array (row 0 stays zero: a
    request without counts reads the engine-wide ones), each row stored divided by its
    own scale: decaying a request's counts multiplies its scale, so a round costs work in
    proportion to its proposals, not to the tables' size.

    Rounds are learnt `REFRESH_ROUNDS` at a time, and the selection's factors for a batch
    are read again only when that batch changes or new rounds were learnt: the estimates
    move slowly (each round weighs a tenth), so a few rounds' lag costs the selection next
    to nothing, while each learning and reading is a string of small operations that run
    slowly between a round's large ones. Whatever else reads the model (the policy's
    `acceptance`, `counts`, ...) learns every round seen first.
    """

    REFRESH_ROUNDS = 4

    def __init__(self, max_rank: int = AutoPolicy.MAX_RANK, decay: float = 0.9, prior_weight: float = 4.0,
                 prior_observations: float = 4.0, global_memory: int = 100):
        self.R, self.decay, self.prior_weight, self.prior_observations = max_rank, decay, prior_weight, \
            prior_observations
        self.global_memory = global_memory
        edges = torch.tensor((0.0, *PROB_EDGES, 1.0), dtype=torch.float64)
        self.edges = torch.tensor(PROB_EDGES, dtype=torch.float64)
        self._edges_np = self.edges.numpy()
        middle = (edges[:-1] + edges[1:]) / 2                                # [buckets]
        shape = (2, MAX_DEPTH, self.R, len(middle))
        hits = middle.expand(shape) * prior_observations
        # tries such that each (line, depth, rank)'s prior hits / tries is the marginal prior
        tries = hits / marginal_prior(self.R)[..., None]
        self.prior = torch.stack([hits, hits, tries])                        # [3, *shape]: hits, mass, tries
        self._cells = self.prior[0].numel()                                 # cells in one table
        self._global = self.prior.expand(2, *self.prior.shape).clone()  # [modes, 3, *shape]
        self._rows: dict[int, int] = {}
        self._free: list[int] = []
        self._tables = torch.zeros(1, *self.prior.shape, dtype=torch.float64)    # [rows, 3, *shape] / scale
        self._scale = torch.ones(1, dtype=torch.float64)                           # [rows]
        # rounds observed, not yet learnt: (ids, modes, children, logp, targets) as `observe`
        # takes them, or (ids, modes, the round's own tensors) from `observe_round`
        self._pending: list[tuple] = []
        self._factors: tuple | None = None   # (key, log factors) the selection read last
        self._wide: dict[tuple[int, int], np.ndarray] = {}   # (depth, ranks) -> [modes, 2, depth, ranks]

    @property
    def global_counts(self) -> torch.Tensor:
        """[modes, 3, 2, MAX_DEPTH, R, buckets] the engine-wide counts (hits, mass, tries),
        every round seen learnt; writing into them at once is seen by the next read."""
        self._learn_pending()
        self._changed()
        return self._global

    @property
    def prior_hits(self) -> torch.Tensor:
        return self.prior[HITS]

    @property
    def prior_mass(self) -> torch.Tensor:
        return self.prior[MASS]

    # -- rows ----------------------------------------------------------------------------
    def _lookup(self, seq_ids: list[int]) -> np.ndarray:
        """Each request's row, 0 (all zero) for one without counts."""
        return np.fromiter((self._rows.get(s, 0) for s in seq_ids), dtype=np.int64, count=len(seq_ids))

    def _rows_for(self, seq_ids: list[int]) -> np.ndarray:
        """Each request's row, a fresh zero one for a request without counts."""
        for sid in seq_ids:
            if sid not in self._rows:
                if not self._free:
                    n = len(self._tables)
                    self._tables = torch.cat([self._tables, torch.zeros_like(self._tables)])
                    self._scale = torch.cat([self._scale, torch.ones_like(self._scale)])
                    self._free = list(range(2 * n - 1, n - 1, -1))
                self._rows[sid] = self._free.pop()
        return self._lookup(seq_ids)

    def counts(self, seq_id: int) -> torch.Tensor | None:
        """A request's own [3, 2, MAX_DEPTH, R, buckets] (hits, mass, tries), None before
        its first round."""
        self._learn_pending()
        row = self._rows.get(seq_id)
        return None if row is None else self._tables[row] * self._scale[row]

    @contextlib.contextmanager
    def unchanged(self) -> Iterator[None]:
        """Rounds run inside teach nothing: on leaving, every count is as it was on entering
        (a warm-up's dummy prompt says nothing of what real requests accept; learnt, it
        read a fresh engine's sampled first proposal as right 27% of the time, against the
        prior's 80%, and the policy then decoded a first request plainly throughout)."""
        self._learn_pending()
        saved = (self._global.clone(), self._tables.clone(), self._scale.clone(), dict(self._rows), list(self._free))
        try:
            yield
        finally:
            self._pending.clear()
            self._global.copy_(saved[0])      # in place: `global_counts` hands out this tensor
            self._tables, self._scale, self._rows, self._free = saved[1:]
            self._changed()

    def _changed(self) -> None:
        """The counts changed: what was read from them is read again."""
        self._factors = None
        self._wide.clear()

    def forget(self, seq_id: int) -> None:
        self._learn_pending()
        self._changed()
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._tables[row] = 0.0
            self._scale[row] = 1.0
            self._free.append(row)

    # -- reading -------------------------------------------------------------------------
    # The tables are small and every round reads and updates a few of their cells, so the
    # arithmetic runs in numpy on views of the same memory: a few microseconds an operation
    # where torch's dispatch takes several.
    def _counts(self, seq_ids: list[int], modes: list[int], tables: list[int], depth: int, ranks: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The first `depth` depths and `ranks` ranks of `tables`: each request's own
        counts [B, T, 2, depth, ranks, buckets] as stored (zero for a request without), the
        scale [B, 1, 1, 1, 1] they are stored divided by, the engine-wide counts of its mode
        [B, T, ...] (never 0 / 0, however long a cell went unseen) and the prior [T, ...]."""
        rows = self._lookup(seq_ids)
        t = np.array(tables)
        own = self._tables.numpy()[:, :, :, :depth, :ranks][rows[:, None], t]
        prior = self.prior.numpy()[t][..., :depth, :ranks, :]
        wide = self._global.numpy()[:, :, :, :depth, :ranks][np.array(modes, dtype=np.int64)[:, None], t]
        return own, self._scale.numpy()[rows].reshape(-1, 1, 1, 1, 1), wide + 1e-3 * prior, prior

    def log_factors(self, seq_ids: list[int], modes: list[int], depth: int = MAX_DEPTH,
                    ranks: int | None = None) -> torch.Tensor:
        """[B, 2, depth, ranks, buckets] log c of each request's cells (the first `depth`
        depths and `ranks` ranks; all by default): its own counts shrunk towards the
        engine-wide ratio with `prior_weight` tries' mass. Up to `REFRESH_ROUNDS` - 1
        rounds behind (see the class)."""
        key = (tuple(seq_ids), tuple(modes), depth, ranks)
        if self._factors is not None and self._factors[0] == key:
            return self._factors[1]
        own, scale, wide, prior = self._counts(seq_ids, modes, [HITS, MASS], depth, ranks or self.R)
        g = wide[:, 0] / wide[:, 1]
        # the mass of prior_weight tries, in the units the counts are stored in
        w = prior[1] * (self.prior_weight / self.prior_observations) / scale
        factors = torch.from_numpy(np.log(np.maximum((own[:, 0] + w * g) / (own[:, 1] + w), 1e-3)))
        self._factors = (key, factors)
        return factors

    def acceptance(self, seq_ids: list[int], modes: list[int], floor: float = 1e-4, depth: int = MAX_DEPTH,
                   ranks: int | None = None) -> np.ndarray:
        """[B, 2, depth, ranks] estimated P(rank-r child at depth d accepted | parent
        accepted), whatever its probability, for parents on the drafter's main line and
        off it (the first `depth` depths and `ranks` ranks; all by default): each
        request's own hits / tries shrunk towards the engine-wide ratio with
        `prior_weight` tries, never below `floor`. A numpy array: the adaptive policy reads
        it at every decision (a few small numpy operations; the engine-wide part is kept
        until the counts change)."""
        self._learn_pending()
        ranks = ranks or self.R
        rows = self._lookup(seq_ids)
        own = self._tables.numpy()[:, HITS::TRIES - HITS, :, :depth, :ranks][rows].sum(axis=-1)  # [B, 2, 2, depth, ranks]
        # the engine-wide ratio once per mode (one mode, most batches), not once per request
        mode = modes[0] if modes.count(modes[0]) == len(modes) else np.asarray(modes, dtype=np.int64)
        g = self._wide_ratio(depth, ranks)[mode]                                 # [(B,) 2, depth, ranks]
        w = self.prior_weight / self._scale.numpy()[rows].reshape(-1, 1, 1, 1)
        ratio = own[:, 0] + w * g
        ratio /= own[:, 1] + w
        return ratio.clip(floor, 1.0, out=ratio)

    def _wide_ratio(self, depth: int, ranks: int) -> np.ndarray:
        """[modes, 2, depth, ranks] the engine-wide hits / tries of each mode (a thousandth
        of the prior's mass added: never 0 / 0, however long a cell went unseen)."""
        ratio = self._wide.get((depth, ranks))
        if ratio is None:
            t = slice(HITS, TRIES + 1, TRIES - HITS)
            wide = (self._global.numpy()[:, t, :, :depth, :ranks] + 1e-3 * self.prior.numpy()[t, :, :depth, :ranks])
            wide = wide.sum(axis=-1)                                             # [modes, 2, 2, depth, ranks]
            ratio = self._wide[(depth, ranks)] = wide[:, 0] / wide[:, 1]
        return ratio

    def bucket(self, prob: torch.Tensor) -> torch.Tensor:
        """The probability bucket of each drafter probability (same shape)."""
        return bucket_of(prob, self.edges)

    def edge_log_values(self, log_c: torch.Tensor, depth: int, parent_main: torch.Tensor | None,
                        logp: torch.Tensor) -> torch.Tensor:
        """`edge_log_values` with this model's buckets."""
        return edge_log_values(log_c, self.edges, depth, parent_main, logp)

    # -- learning ------------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, seq_ids: list[int], modes: list[int], children: torch.Tensor | np.ndarray,
                children_logp: torch.Tensor | np.ndarray, targets: torch.Tensor | np.ndarray) -> None:
        """One verified round over distinct requests: children [B, D, k] the drafter's
        proposals after each accepted-path node (-1: not expanded), children_logp [B, D, k]
        their drafter log-probabilities (at each request's temperature), targets [B, D] the
        target's token at each path node (-1 past the path); tensors or numpy arrays, copied.
        Learnt with the next `REFRESH_ROUNDS` - 1 rounds, or when something reads the model."""
        arrays = (t.cpu().numpy().copy() if isinstance(t, torch.Tensor) else np.array(t)
                  for t in (children, children_logp, targets))
        self._pending.append((list(seq_ids), list(modes), *arrays))
        if len(self._pending) >= self.REFRESH_ROUNDS:
            self._learn_pending()

    def observe_round(self, seq_ids: list[int], modes: list[int], children: torch.Tensor,
                      children_logp: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor, bonus: torch.Tensor,
                      path_tokens: torch.Tensor) -> None:
        """One verified round as the round holds it: every tree node's proposals children
        [B, N, k] (-1: not expanded) and their log-probabilities, the accepted path's node
        indices path [B, D] (path_len [B] of them valid, root first), the bonus token [B]
        and the path's tokens [B, D]. The same observations as `observe`'s (the proposals
        after each path node, the target's token there: the next path token, then the
        bonus), gathered along the path when the round is learnt. A round's own share is
        then no work at all: between a round's compiled graphs a few small gathers cost
        several times what they cost alone (about 0.2 ms a round at batch 1, AMD EPYC).
        The tensors are kept, not copied: a round's outputs are its own."""
        raw = (children, children_logp, path, path_len, bonus, path_tokens)
        self._pending.append((list(seq_ids), list(modes), raw))
        if len(self._pending) >= self.REFRESH_ROUNDS:
            self._learn_pending()

    def learn(self) -> None:
        """Learn every round observed so far now (reads do it anyway): lets a reader keep
        the rounds' learning apart from its own work when it times itself."""
        self._learn_pending()

    def _learn_pending(self) -> None:
        """Learn the rounds observed so far (`_learn_rounds`)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._learn_rounds([(r[0], r[1], *_along_path(*r[2])) if isinstance(r[2], tuple) else r for r in pending])
        self._changed()

    def _round_cells(self, children: np.ndarray, children_logp: np.ndarray, targets: np.ndarray
                     ) -> tuple[np.ndarray, np.ndarray]:
        """What one round adds, (hits, mass, tries) in turn: where in a [3, *cells] block
        each addition goes [3, B, n] and what it adds [3, B, n] (a hit 1, mass p, a try 1;
        0 where the child was not a try: adding zeros costs less than selecting the tries
        out first)."""
        D, k = min(children.shape[1], MAX_DEPTH), min(children.shape[2], self.R)
        ch = children[:, :D, :k]
        p = np.exp(children_logp[:, :D, :k].astype(np.float64))
        tg = targets[:, :D, None]
        B = ch.shape[0]
        valid = (ch >= 0) & (tg >= 0)                                       # [B, D, k]
        hit = valid & (ch == tg)
        main = np.ones((B, D), dtype=bool)                                  # path node i on the main line
        main[:, 1:] = np.cumprod(hit[:, :-1, 0], axis=1).astype(bool)
        line = (~main).astype(np.int64)[..., None]
        depth = np.arange(D)[None, :, None]
        rank = np.arange(k)[None, None]
        buckets = len(self.edges) + 1
        bucket = np.searchsorted(self._edges_np, p, side="left")            # as `bucket_of`
        cell = ((line * MAX_DEPTH + depth) * self.R + rank) * buckets + bucket   # [B, D, k] in a table
        where = (np.array([HITS, MASS, TRIES]).reshape(3, 1, 1, 1) * self._cells + cell).reshape(3, B, -1)
        amount = np.stack([hit, np.where(valid, p, 0.0), valid]).astype(np.float64).reshape(3, B, -1)
        return where, amount

    def _learn_rounds(self, rounds: list[tuple]) -> None:
        """Learn `rounds` (as `observe` queued them) in one pass, with what learning them one
        after another would give (up to rounding): each round decays its requests' own
        counts by `decay` and then adds to them, and decays its modes' engine-wide counts by
        one batch-size-th of that (at least `global_memory` rounds of memory: at batch 1 the
        one request's last ten rounds are too few) and then adds to them. Each round costs
        a string of small numpy operations, so a round's fixed share of them is paid once
        for all."""
        rows = [self._rows_for(r[0]) for r in rounds]     # may grow the tables: views after
        modes = [np.asarray(r[1], dtype=np.int64) for r in rounds]
        present = [sorted(set(r[1])) for r in rounds]     # each round's modes
        tables, scale, wide = self._tables.numpy(), self._scale.numpy(), self._global.numpy()
        block = 3 * self._cells
        where, amount = self._round_cells(*(_stacked([r[i] for r in rounds], fill) for i, fill in
                                            ((2, -1), (3, 0.0), (4, -1))))          # [3, sum of B, n]

        # A request's counts are stored divided by its row's scale, which each of its rounds
        # multiplies by `decay`: a round's additions are divided by the scale after it. A
        # long-lived row whose scale fell under 1e-100 has it folded back in afterwards.
        divisors = []
        for r in rows:                     # a round's requests are distinct
            scale[r] *= self.decay
            divisors.append(scale[r])
        every = np.concatenate(rows)
        np.add.at(tables.reshape(-1), every.reshape(1, -1, 1) * block + where,
                  amount / np.concatenate(divisors).reshape(1, -1, 1))
        tiny = every[scale[every] < 1e-100]
        if len(tiny):
            tiny = np.unique(tiny)
            tables[tiny] *= scale[tiny].reshape(-1, *([1] * (tables.ndim - 1)))
            scale[tiny] = 1.0

        # Engine-wide: a round's additions are decayed by the later rounds of their mode.
        decays = [max(self.decay ** (1.0 / len(r)), 1.0 - 1.0 / self.global_memory) for r in rows]
        later = np.ones((len(rounds), wide.shape[0]))                      # [rounds, modes]
        for i in range(len(rounds) - 2, -1, -1):
            later[i] = later[i + 1]
            later[i, present[i + 1]] *= decays[i + 1]
        whole = later[0].copy()
        whole[present[0]] *= decays[0]
        wide *= whole.reshape(-1, *([1] * (wide.ndim - 1)))
        mode = np.concatenate(modes)
        np.add.at(wide.reshape(-1), mode.reshape(1, -1, 1) * block + where,
                  amount * np.concatenate([later[i, m] for i, m in enumerate(modes)]).reshape(1, -1, 1))

    def relax(self, seq_ids: list[int], rounds: int) -> None:
        """`rounds` rounds without drafts over these requests: each one's own counts decay
        as in a speculative round, so its estimate returns towards the engine-wide one (a
        few unlucky rounds of its own do not rule speculation out for it for good). The
        engine-wide counts keep what they measured: plain rounds measure nothing."""
        self._learn_pending()
        self._changed()
        rows = self._lookup(seq_ids)
        self._scale.numpy()[rows[rows > 0]] *= self.decay ** rounds
