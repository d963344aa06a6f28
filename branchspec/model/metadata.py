"""Attention metadata for one forward over *new nodes* appended to committed state.

Every execution path is the same computation: N new nodes per sequence, each at an
absolute position, each seeing committed state plus its ancestors-or-self among the new
nodes. Prefill is a chain of nodes, decode is one node, verify is a tree, training is a
chain from an empty state. This module turns (positions, ancestor matrix, committed
lengths) into everything attention needs, once per forward, with tensor ops:

* window visibility among new nodes;
* for each compress ratio r, the nodes that complete a block ((pos + 1) % r == 0) and,
  for each pooled row of such a node's entry, where the row comes from: the committed
  compressor buffer (position < L) or an ancestor-or-self node (position >= L).
  An entry is computed once per completing *node*, so branches share their common prefix.

Terms: *committed* state describes positions < L (L = num_committed); the new nodes are at
positions >= L; node depth = position - L.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from branchspec.config import Compression


@dataclass(frozen=True)
class PoolPlan:
    """Where each completing node's pooled rows come from, for one compress ratio.

    Row sources index the per-sequence concatenation [committed buffer rows (S = span - 1,
    positions L-S .. L-1) ; new-node rows (N)]; `pad` marks rows before position 0.
    """

    ratio: int
    complete_idx: torch.Tensor    # [B, K] node index of the k-th completing node (0 where invalid)
    complete_valid: torch.Tensor  # [B, K] bool
    row_src: torch.Tensor         # [B, K, span] index into [S + N]
    row_pad: torch.Tensor         # [B, K, span] bool, row position < 0
    entry_pos: torch.Tensor       # [B, K] block-start position r * i of the entry (for RoPE)
    entry_index: torch.Tensor     # [B, K] entry number i = (pos + 1) / r - 1
    visible: torch.Tensor         # [B, N, K] bool: node n sees the entry completed by slot k


@dataclass(frozen=True)
class ForwardMeta:
    positions: torch.Tensor       # [B, N] absolute position of every new node
    num_committed: torch.Tensor   # [B] L, committed length of each sequence
    ancestor: torch.Tensor        # [B, N, N] bool, ancestor[b, n, m]: m is n or an ancestor of n
    valid: torch.Tensor           # [B, N] bool, False for padding nodes
    pools: dict[int, PoolPlan]    # per compress ratio

    @property
    def batch_size(self) -> int:
        return self.positions.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.positions.shape[1]


def max_completions(num_nodes: int, ratio: int, chain: bool) -> int:
    """An upper bound on the nodes of one forward that complete a block of `ratio`: a chain
    of N consecutive positions completes at most ceil(N / r); tree nodes may all do."""
    return -(-num_nodes // ratio) if chain else num_nodes


def build_meta(positions: torch.Tensor, num_committed: torch.Tensor, ancestor: torch.Tensor,
               valid: torch.Tensor, kinds: tuple[Compression, ...], chain: bool = False,
               static: bool = False) -> ForwardMeta:
    """Derive the pooling plans of `kinds` (the model's `compressed_kinds`; () for the
    drafter's window-only block). `chain=True` promises node n's ancestors are nodes 0..n,
    which lets row sources be computed arithmetically instead of from the ancestor matrix.

    `static=True` sizes the completing-node slots K by `max_completions` rather than by
    this forward's count (the unused slots are masked by complete_valid), so a compiled
    step sees the same shapes whether or not a block completes this time."""
    B, N = positions.shape
    device = positions.device
    depth = positions - num_committed[:, None]  # [B, N]
    pools = {}
    if not chain and N > 0 and kinds:
        # anc_at_depth[b, n, d] = the ancestor-or-self of n at depth d (or 0 if none).
        max_depth = N if static else int(depth.max()) + 1    # static: no value read back
        anc_at_depth = torch.zeros(B, N, max_depth + 1, dtype=torch.long, device=device)
        d_idx = torch.where(ancestor, depth[:, None, :], torch.full_like(depth[:, None, :], max_depth))
        node_ids = torch.arange(N, device=device).expand(B, N, N)
        anc_at_depth.scatter_(2, d_idx, node_ids)
        anc_at_depth = anc_at_depth[..., :max_depth]
    for kind in kinds:
        r, span, S = kind.ratio, kind.span, kind.buffer_rows
        completes = valid & ((positions + 1) % r == 0)                      # [B, N]
        if static:
            K = max_completions(N, r, chain)
        else:
            K = int(completes.sum(1).max()) if N > 0 else 0
        # Stable order: completing nodes first, in node order.
        order = torch.sort((~completes).to(torch.int8), dim=1, stable=True).indices[:, :K]
        complete_idx = order                                                 # [B, K]
        complete_valid = torch.gather(completes, 1, complete_idx)            # [B, K]
        node_pos = torch.gather(positions, 1, complete_idx)                  # [B, K]
        offsets = torch.arange(span, device=device) - (span - 1)             # [span] -(span-1) .. 0
        row_pos = node_pos[..., None] + offsets                              # [B, K, span]
        L = num_committed[:, None, None]
        row_pad = row_pos < 0
        from_buffer = row_pos < L
        buf_src = (row_pos - (L - S)).clamp(0, max(S - 1, 0))
        row_depth = (row_pos - L).clamp(min=0)
        if chain:
            node_src = row_depth  # in a chain, node index == depth
        else:
            node_anc = torch.gather(anc_at_depth, 1,
                                    complete_idx[..., None].expand(B, K, anc_at_depth.shape[-1]))
            node_src = torch.gather(node_anc, 2, row_depth.clamp(max=anc_at_depth.shape[-1] - 1))
        row_src = torch.where(from_buffer, buf_src, S + node_src)
        row_src = torch.where(row_pad, torch.zeros_like(row_src), row_src)
        visible = torch.gather(ancestor, 2, complete_idx[:, None, :].expand(B, N, K)) & complete_valid[:, None, :]
        pools[r] = PoolPlan(
            ratio=r, complete_idx=complete_idx, complete_valid=complete_valid,
            row_src=row_src, row_pad=row_pad, entry_pos=node_pos + 1 - r,
            entry_index=(node_pos + 1) // r - 1, visible=visible)
    return ForwardMeta(positions=positions, num_committed=num_committed, ancestor=ancestor,
                       valid=valid, pools=pools)


def chain_meta(num_committed: torch.Tensor, num_new: torch.Tensor | int, kinds: tuple[Compression, ...],
               max_new: int | None = None, static: bool = False) -> ForwardMeta:
    """Metadata for appending a chain of tokens (prefill chunk, decode step, training).

    num_committed: [B]; num_new: [B] or int, tokens appended per sequence (padded to max_new).
    """
    B = num_committed.shape[0]
    device = num_committed.device
    if isinstance(num_new, int):
        num_new = torch.full((B,), num_new, dtype=torch.long, device=device)
    N = int(num_new.max()) if max_new is None else max_new
    idx = torch.arange(N, device=device)
    positions = num_committed[:, None] + idx                   # [B, N]
    valid = idx[None, :] < num_new[:, None]                    # [B, N]
    causal = idx[:, None] >= idx[None, :]                      # [N, N]
    # Padding nodes see only themselves so their softmax stays finite.
    ancestor = (causal[None] & valid[:, None, :]) | torch.eye(N, dtype=torch.bool, device=device)[None]
    return build_meta(positions, num_committed, ancestor, valid, kinds, chain=True, static=static)


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents: [B, D] with parents[:, 0] = -1 -> ancestor-or-self [B, D, D] bool.

    Transitive closure by repeated squaring of the parent relation: ceil(log2 D) matmuls.
    """
    B, D = parents.shape
    eye = torch.eye(D, dtype=torch.bool, device=parents.device).expand(B, D, D)
    step = torch.zeros(B, D, D + 1, dtype=torch.bool, device=parents.device)
    step.scatter_(2, torch.where(parents >= 0, parents, D)[..., None], True)
    reach = step[..., :D] | eye                                 # self or parent
    hops = 1
    while hops < D:
        r = reach.to(torch.float32)
        reach = torch.bmm(r, r) > 0
        hops *= 2
    return reach


def tree_meta(parents: torch.Tensor, num_committed: torch.Tensor, kinds: tuple[Compression, ...],
              static: bool = False) -> ForwardMeta:
    """Metadata for verifying a batch of draft trees (the verify plan): parents [B, D]
    (node 0 the root, parents[:, 0] = -1, parents precede children) on top of
    num_committed [B] tokens. A node sits at position L + its depth and sees its
    ancestors-or-self; every node is valid. `static` as in `build_meta`."""
    ancestor = ancestor_matrix(parents)
    depth = ancestor.sum(-1) - 1                                 # [B, D], root = 0
    positions = num_committed[:, None] + depth
    valid = torch.ones_like(parents, dtype=torch.bool)
    return build_meta(positions, num_committed, ancestor, valid, kinds, static=static)
