"""Acceptance statistics: how often the drafter's proposals are the target's tokens, and
the expected accept length of a candidate configuration under them.

For every request, decayed counts of how often the drafter's rank-r proposal after an
accepted depth-d node was the target's token there, kept apart on and off the drafter's
main line (rank = order of the drafter's probability). The proposals are compared
whether or not the tree kept them, so the counts are not biased towards the nodes a tree
happened to keep. Under this positional model a node reached by ranks r_1..r_j is
accepted with probability q(1, r_1) ... q(j, r_j), and a candidate's expected accept
length is 1 (the bonus token) plus the sum of its best D-1 node values within its depth
and branching. A request's counts start from the engine-wide ones (worth `prior_weight`
observations), which start from an optimistic prior, so depths no round has tried yet
get tried.
"""

from __future__ import annotations

import numpy as np
import torch

from branchspec.config import AutoPolicy, SpecConfig
from branchspec.speculative.policy.tuning import TUNING, Tuning

# Depth grid of the statistics: the deepest draft a candidate may have.
MAX_DEPTH = AutoPolicy.MAX_DEPTH
# A request id no request has: its statistics are the engine-wide ones.
NEW_REQUEST = -1

# Acceptance is kept apart for nodes whose parent is on the drafter's main line (every
# node above it was its parent's top proposal: the chain) and for the others: after the
# drafter was wrong once, its later proposals are right less often, and a chain's
# estimate must not be diluted by what trees see off its line.
MAIN, OFF = 0, 1


def _prior(max_rank: int, tuning: Tuning) -> np.ndarray:
    """[2, MAX_DEPTH, R] prior acceptance probabilities (main line, off it)."""
    ranks = tuning.prior_rank1 * tuning.prior_rank_decay ** np.arange(max_rank)
    return np.stack([np.tile(ranks, (MAX_DEPTH, 1)), np.tile(ranks * tuning.prior_off_line, (MAX_DEPTH, 1))])


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

    def __init__(self, policy: AutoPolicy, tuning: Tuning = TUNING):
        self.policy, self.tuning = policy, tuning
        self.R = max((c.topk for c in policy.speculative), default=1)
        shape = (2, MAX_DEPTH, self.R)
        # Engine-wide counts start as a few pseudo-observations of the prior.
        n = tuning.prior_observations
        self.prior_hits, self.prior_tries = _prior(self.R, tuning) * n, np.full(shape, n)
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

    def relax(self, seq_ids: list[int], rounds: int = 1) -> None:
        """`rounds` rounds without drafts over these requests. Each one's own counts decay
        as in a speculative round (its estimate returns towards the engine-wide one) and
        the engine-wide counts drift back towards the optimistic prior by `relax_rate` a round:
        a few unlucky rounds do not rule speculation out for good, and after a run of plain
        rounds a speculative one is tried again (the text, or the batch, may have changed)."""
        keep, drift = self.policy.decay ** rounds, (1.0 - self.tuning.relax_rate) ** rounds
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
        return np.clip((self._hits[rows] + w * g) / (self._tries[rows] + w), self.tuning.acceptance_floor, 1.0)

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
        # `global_memory` rounds (at batch 1 the one request's last ten rounds are too few).
        gd = max(decay ** (1.0 / max(1, len(seq_ids))), 1.0 - 1.0 / self.tuning.global_memory)
        self.global_hits *= gd
        self.global_tries *= gd
        self.global_hits[:, :D, :k] += hits.sum(axis=0)
        self.global_tries[:, :D, :k] += tries.sum(axis=0)
