"""Expected accept length of each candidate configuration under measured acceptance.

The acceptance itself is the engine's (`calibration.AcceptanceModel.acceptance`: for each
depth, sibling rank and whether the parent is on the drafter's main line, how often such
a child was the target's token, from the same verified rounds the calibrated selection
learns from). Under this positional model a node reached by ranks r_1..r_j is accepted
with probability q(1, r_1) ... q(j, r_j), and a candidate's expected accept length is 1
(the bonus token) plus the sum of its best D-1 node values within its depth and branching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from branchspec.config import SpecConfig

# A parent on the drafter's main line (every node above it its parent's first proposal:
# the chain), or off it: after the drafter was wrong once, its proposals are right less often.
MAIN, OFF = 0, 1
# Node sets of up to this many nodes share one block (`ExpectedAccept`): the default
# candidates' (chains, trees of up to 62 nodes) are then one partition and one sort.
SHARED_WIDTH = 64


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

    Every node any candidate could verify is enumerated once, with its path's edges as
    columns of the flattened [2 * depth * R] acceptance (depth and R: the candidates' most
    steps and largest topk), so that a node's value is the product of what one gather
    reads; and which candidates may use each node. Gathers and products, not a matrix
    product: numpy's BLAS threads would spin on the cores the model's forwards run on.
    """

    def __init__(self, specs: tuple[SpecConfig, ...], max_rank: int):
        """max_rank: the sibling ranks the acceptance tells apart; lower ones share the last's."""
        self.specs = specs
        self.depth = max((c.num_steps for c in specs), default=1)
        self.R = min(max((c.topk for c in specs), default=1), max_rank)
        members = [candidate_paths(spec) for spec in specs]
        every = sorted({path for m in members for path in m}, key=lambda p: (len(p), p))
        paths = {path: i for i, path in enumerate(every)}
        members = [[paths[path] for path in m] for m in members]
        self.num_nodes = N = len(every)
        # A node's value is the product of its edges' acceptance: the acceptance row gets
        # two more columns, a 1 (no edge: a path shorter than the deepest) and a 0 (the
        # padding node N, of value 0), and each node lists its path's columns [N + 1, depth].
        one, zero = 2 * self.depth * self.R, 2 * self.depth * self.R + 1
        columns = np.full((N + 1, self.depth), one, dtype=np.intp)
        columns[N, 0] = zero
        self.columns = columns
        for i, path in enumerate(every):
            line = MAIN
            for step, (depth, rank) in enumerate(path):
                columns[i, step] = (line * self.depth + depth) * self.R + min(rank, self.R - 1)
                line = OFF if rank else line
        # Candidates that differ only in D draw from the same nodes (those within their
        # depth and branching): one row of node indices per distinct node set. Sets of
        # like size share a [S, n] block, padded with N (a node of value 0): those of up to
        # `SHARED_WIDTH` nodes one block (every call is one more numpy call), so that the
        # few wide sets (a 7x2 tree has 254 nodes) do not widen the chains' and small trees'.
        sets: dict[tuple[int, ...], int] = {}
        member_set = [sets.setdefault(tuple(m), len(sets)) for m in members]
        self.keep = max((c.num_draft_tokens - 1 for c in specs), default=1)   # the most nodes a candidate keeps
        blocks: dict[int, list[tuple[int, ...]]] = {}
        for nodes in sets:
            width = max(SHARED_WIDTH, 4 ** math.ceil(math.log(len(nodes), 4)))
            blocks.setdefault(width, []).append(nodes)
        self.blocks: list[_Block] = []
        for block in blocks.values():
            rows = {sets[nodes]: i for i, nodes in enumerate(block)}
            nodes = np.full((len(block), max(map(len, block))), self.num_nodes)
            for i, row in enumerate(block):
                nodes[i, :len(row)] = row
            used = [c for c, m in enumerate(member_set) if m in rows]
            width = min(nodes.shape[1], self.keep)
            self.blocks.append(_Block(
                nodes=nodes, candidates=np.array(used, dtype=np.intp),
                rows=np.array([rows[member_set[c]] for c in used], dtype=np.intp),
                keep_at=np.array([min(specs[c].num_draft_tokens - 1, width) - 1 for c in used], dtype=np.intp)))

    def __call__(self, acceptance: np.ndarray) -> np.ndarray:
        """acceptance [B, 2, depth, R] (`AcceptanceModel.acceptance`) -> [B, C] expected
        tokens one round of each candidate emits (bonus included) for each request: 1 + its
        best D-1 node values. A node's value is at most its parent's, so the best D-1
        always form a tree.

        In float32: every node's value one gather and one product, then block by block
        only the best `keep` of a set ordered (a partition first). A decision runs this
        right after a round's forwards, when every numpy call costs several times its warm
        cost, so the calls are few (at batch 64 one full float64 sort of every set padded
        to the widest took 4 ms, this a fraction of a millisecond; AMD EPYC)."""
        B = acceptance.shape[0]
        q = np.empty((B, 2 * self.depth * self.R + 2), np.float32)          # [B, 2 * depth * R + 2]
        q[:, :-2] = acceptance.reshape(B, -1)
        q[:, -2:] = (1.0, 0.0)                                               # no edge; the padding node
        values = -q[:, self.columns].prod(axis=2)                           # [B, N + 1], negated
        out = np.empty((B, len(self.specs)))
        for block in self.blocks:
            negated = values[:, block.nodes]                                  # [B, S, n]
            if self.keep < negated.shape[2]:
                negated = np.partition(negated, self.keep - 1, axis=2)[..., :self.keep]
            negated.sort(axis=2)                                              # [B, S, <= keep] best first
            best = np.cumsum(negated, axis=2, dtype=np.float64)
            out[:, block.candidates] = 1.0 - best[:, block.rows, block.keep_at]
        return out


@dataclass(frozen=True)
class _Block:
    """Node sets of like size: nodes [S, n] (padded), and the candidates drawing from them
    [M] with each one's row [M] and where its best D-1 end in the row's running sum [M]."""
    nodes: np.ndarray
    candidates: np.ndarray
    rows: np.ndarray
    keep_at: np.ndarray
