"""The reference execution: the model's own forwards, in eager PyTorch."""

from __future__ import annotations

import torch

from branchspec.cache.paged import PagedState, read_states
from branchspec.model.attention import LayerScratch, LayerState
from branchspec.model.metadata import ForwardMeta, chain_meta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.sampling import NodeDraws, step_tokens


class EagerExecutor:
    """Runs every forward eagerly on the engine's paged state: the committed state a
    forward builds on is gathered out of the pools first (`PagedState.gather`). Shapes may
    vary from call to call; this is the ground truth the compiled path is tested against.

    The forwards (see `execution.Executor`): `prefill` and `drafter_prefill` over chunks of
    any length; `decode` (one node per sequence), building its own metadata; `drafter`
    (the MTP block at a round's root or over a draft extend); `graph`, a whole function of
    tensors (a draft tree's growth, the verify pass over draft trees).
    """

    name = "eager"
    addressing: str | None = None    # how many committed entries a step addresses (`cache.paged.Addressing`)

    def __init__(self, model: Transformer, cache: PagedState):
        self.model, self.cache = model, cache
        self.kinds = model.cfg.compressed_kinds
        # On a CPU shapes may follow the data: a plan's completing-node slots by the trees,
        # committed entries as many as there are. On a GPU reading such a size back would
        # stall the host behind the device at every step, so every size is its bound there.
        if self.addressing is None:
            self.addressing = "bound" if cache.device.type == "cuda" else "exact"

    @property
    def static_shapes(self) -> bool:
        """Whether plans size their slots by their bounds rather than by the data
        (`tree_meta(static=True)`), as addressing other than "exact" needs."""
        return self.addressing != "exact"

    def batch_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        """The batch sizes a warm-up runs to meet every shape this execution has: batch 1
        and one larger batch (a compiled step's two shape classes)."""
        return tuple(sorted({1, min(2, max_batch_size)}))

    def over(self, cache: PagedState) -> "EagerExecutor":
        """The same execution over another paged state (the cost model's private one)."""
        return type(self)(self.model, cache)

    # -- target -------------------------------------------------------------------------
    def prefill(self, input_ids: torch.Tensor, meta: ForwardMeta, seq_ids: list[int],
                lengths: torch.Tensor, logits_at: torch.Tensor | None = None) -> ForwardOutput:
        """input_ids [B, N] on top of each sequence's lengths [B] committed tokens; logits
        at every position, or only at each row's logits_at [B] (logits [B, 1, V])."""
        return self.model(input_ids, meta, self.cache.gather(seq_ids, lengths), logits_at=logits_at)

    def decode(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor) -> ForwardOutput:
        """One plain decode step: roots [B, 1] at positions lengths [B], fed through the
        target and committed (its pages reserved first)."""
        meta = chain_meta(lengths, 1, self.kinds, max_new=1, static=self.static_shapes)
        addresses = self.cache.addresses(seq_ids, lengths, self.addressing)
        out = self.model(roots, meta, read_states(self.model.cfg, self.cache.storage, addresses))
        self.cache.commit(seq_ids, meta, out.scratch, meta.valid)
        return out

    def decode_and_draw(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor, draws: NodeDraws
                        ) -> tuple[ForwardOutput, torch.Tensor]:
        """`decode`, and each request's next token [B, 1]: the argmax, or for the rows in
        `draws` (sampled at their temperature alone) the seeded draw (`sampling.step_tokens`),
        as one function on the fast path."""
        out = self.decode(roots, seq_ids, lengths)
        return out, step_tokens(out.logits, draws)

    def commit(self, seq_ids: list[int], meta: ForwardMeta, scratch: list[LayerScratch], keep: torch.Tensor) -> None:
        """Write the scratch of a verify pass's kept nodes (keep: [B, D], the accepted
        paths of the rows it did not commit itself) into the pools (`PagedState.commit`)."""
        self.cache.commit(seq_ids, meta, scratch, keep)

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

    def graph(self, fn, plan, batched, shared: dict[str, torch.Tensor], pools: bool = False):
        """fn(model, plan, batched, shared): a pure function of tensors whose shapes follow
        from `plan` (a hashable value), the batch and the model, such as a whole draft-tree
        growth; `batched` holds the batch's tensors (dim 0 the request), `shared` those
        every request shares. With `pools`, fn(model, plan, batched, shared, storage) also
        gets the paged state's storage ({kind: [layers of kind, slots, width]}), which it
        may write (a commit). Run as it is here; one compiled graph per plan on the fast
        path."""
        if pools:
            return fn(self.model, plan, batched, shared, self.cache.storage)
        return fn(self.model, plan, batched, shared)

    def extend_width(self, needed: int, bound: int) -> int:
        """Nodes a draft extend runs: `needed` (the longest accepted path plus its next
        root) of at most `bound`."""
        return needed
