"""The reference execution: the model's own forwards, in eager PyTorch."""

from __future__ import annotations

import torch

from branchspec.cache.paged import PagedState
from branchspec.model.attention import LayerState
from branchspec.model.metadata import ForwardMeta, chain_meta, tree_meta
from branchspec.model.model import ForwardOutput, Transformer


class EagerExecutor:
    """Runs every forward eagerly on the engine's paged state: the committed state a
    forward builds on is gathered out of the pools first (`PagedState.gather`). Shapes may
    vary from call to call; this is the ground truth the compiled path is tested against.

    The forwards (see `execution.Executor`): `prefill` and `drafter_prefill` over chunks of
    any length; `decode` (one node per sequence), `target` (a verify pass over D nodes),
    `drafter` (the MTP block over a tree's frontier or a draft extend), each with the
    metadata helpers whose sizing the compiled path needs fixed.
    """

    name = "eager"
    # MoE models: the dispatch the model must be built with (`Transformer.expert_dispatch`).
    expert_dispatch = "grouped"

    def __init__(self, model: Transformer, cache: PagedState):
        self.model, self.cache = model, cache
        self.kinds = model.cfg.compressed_kinds

    def over(self, cache: PagedState) -> "EagerExecutor":
        """The same execution over another paged state (the cost model's private one)."""
        return type(self)(self.model, cache)

    # -- target -------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, meta: ForwardMeta, seq_ids: list[int],
                lengths: torch.Tensor) -> ForwardOutput:
        """input_ids [B, N] on top of each sequence's lengths [B] committed tokens."""
        return self.model(input_ids, meta, self.cache.gather(seq_ids, lengths))

    def target(self, input_ids: torch.Tensor, meta: ForwardMeta, seq_ids: list[int],
               lengths: torch.Tensor) -> ForwardOutput:
        """A verify pass: input_ids [B, D] with `verify_meta` metadata."""
        return self.prefill(input_ids, meta, seq_ids, lengths)

    def decode(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor
               ) -> tuple[ForwardOutput, ForwardMeta]:
        """One plain decode step: roots [B, 1] at positions lengths [B]; returns the
        output and the metadata its commit needs."""
        meta = chain_meta(lengths, 1, self.kinds)
        return self.target(roots, meta, seq_ids, lengths), meta

    def verify_meta(self, parents: torch.Tensor, lengths: torch.Tensor) -> ForwardMeta:
        """The verify plan of draft trees parents [B, D] (`metadata.tree_meta`)."""
        return tree_meta(parents, lengths, self.kinds)

    # -- drafter ------------------------------------------------------------------------
    def drafter_prefill(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                        state: LayerState) -> ForwardOutput:
        """The MTP block over a chunk of committed positions, without its LM head."""
        return self.model.mtp_forward(input_ids, prev_hidden, meta, state, logits=False)

    def drafter(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                state: LayerState) -> ForwardOutput:
        """The MTP block over a round's nodes (a tree's root or frontier, a draft extend),
        without its LM head."""
        return self.drafter_prefill(input_ids, prev_hidden, meta, state)

    def extend_width(self, needed: int, bound: int) -> int:
        """Nodes a draft extend runs: `needed` (the longest accepted path plus its next
        root) of at most `bound`."""
        return needed
