"""Expected accept length of each candidate configuration under measured acceptance.

The acceptance itself is the engine's (`calibration.AcceptanceModel.acceptance`: for each
depth, sibling rank and whether the parent is on the drafter's main line, how often such
a child was the target's token, from the same verified rounds the calibrated selection
learns from). Under this positional model a node reached by ranks r_1..r_j is accepted
with probability q(1, r_1) ... q(j, r_j), and a candidate's expected accept length is 1
(the bonus token) plus the sum of its best D-1 node values within its depth and branching.
"""

from __future__ import annotations

import numpy as np

from branchspec.config import SpecConfig

# A parent on the drafter's main line (every node above it its parent's first proposal:
# the chain), or off it: after the drafter was wrong once, its proposals are right less often.
MAIN, OFF = 0, 1


def candidate_paths(spec: SpecConfig) -> list[tuple[tuple[int, int], ...]]:
    """Every node a candidate could verify, as its path of (depth, rank) edges from the
    root: depth below num_steps, rank below topk."""
    out: list[tuple[tuple[int, int], ...]] = []
    frontier: list[tuple[tuple[int, int], ...]] = [()]
    for depth in range(spec.num_steps):
        frontier = [path + ((depth, rank),) for path in frontier for rank in range(spec.topk)]
        out.extend(frontier)
    return out


class ExpectedAccept:
    """The expected accept length of every candidate, for a batch's acceptance at once.

    Every node any candidate could verify is enumerated once: [N, P] the columns of its
    path's edges in the flattened [2 * depth * R] acceptance (depth and R: the candidates'
    most steps and largest topk) (padded with one past the
    end, a zero column), and which candidates may use each node. A gather and a sum, not a
    matrix product: numpy's BLAS threads would spin on the cores the model's forwards run on.
    """

    def __init__(self, specs: tuple[SpecConfig, ...], max_rank: int):
        """max_rank: the sibling ranks the acceptance tells apart; lower ones share the last's."""
        self.specs = specs
        self.depth = max((c.num_steps for c in specs), default=1)
        self.R = min(max((c.topk for c in specs), default=1), max_rank)
        paths: dict[tuple, int] = {}
        members: list[list[int]] = []
        for spec in specs:
            members.append([paths.setdefault(path, len(paths)) for path in candidate_paths(spec)])
        self.num_edges = 2 * self.depth * self.R
        self.path_edges = np.full((len(paths), max((len(p) for p in paths), default=1)), self.num_edges)
        for path, i in paths.items():
            line = MAIN
            for j, (depth, rank) in enumerate(path):
                self.path_edges[i, j] = (line * self.depth + depth) * self.R + min(rank, self.R - 1)
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
        self.keep_at = np.minimum(np.array([c.num_draft_tokens - 1 for c in specs], dtype=np.intp),
                                  self.set_nodes.shape[1]) - 1

    def __call__(self, acceptance: np.ndarray) -> np.ndarray:
        """acceptance [B, 2, depth, R] (`AcceptanceModel.acceptance`) -> [B, C] expected
        tokens one round of each candidate emits (bonus included) for each request: 1 + its
        best D-1 node values. A node's value is at most its parent's, so the best D-1
        always form a tree."""
        B = acceptance.shape[0]
        logq = np.zeros((B, self.num_edges + 1))                              # [B, 2 * depth * R + 1]
        logq[:, :-1] = np.log(acceptance).reshape(B, -1)
        values = np.zeros((B, len(self.path_edges) + 1))                     # [B, N + 1], last: padding
        values[:, :-1] = np.exp(logq[:, self.path_edges].sum(axis=2))
        ranked = -np.sort(-values[:, self.set_nodes], axis=2)                # [B, S, n] best first
        best = np.cumsum(ranked, axis=2)                                     # [B, S, n]
        return 1.0 + best[:, self.member_set, self.keep_at]
