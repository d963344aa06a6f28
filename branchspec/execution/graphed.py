"""The GPU fast path: every step of a round, and plain decoding's, replayed as a CUDA graph.

On a GPU a small step costs what launching its kernels costs, so each step kind (plain
decoding with its draw, the drafter at a round's root, a whole draft growth, the verify
pass with its accept and commit, the draft extend) is captured once per batch bucket and
replayed (`execution/graphs.py`). Inside a graph runs the compiled step (`compile=True`:
inductor's fused kernels, its own cudagraphs off) or the eager one (the same functions,
launched from the graph instead of from Python). Committed entries and block tables are
sized by max_model_len ("bound" addressing), so a graph's shapes never follow the
context; prefill chunks, whose lengths vary, run eagerly.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from branchspec.execution.arguments import Pools, Shared
from branchspec.execution.compiled import CompiledSteps, check_dense_dispatch
from branchspec.execution.eager import EagerExecutor
from branchspec.execution.graphs import CudaGraphs, GraphRunner, Replay, graph_buckets
from branchspec.execution.steps import decode_draw_step, decode_step, drafter_step, plan_step
from branchspec.model.attention import LayerState
from branchspec.model.layers import build_stacked
from branchspec.model.metadata import ForwardMeta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.sampling import NodeDraws


class GraphExecutor(EagerExecutor):
    """Runs decode, the drafter's root forward and the round's whole functions (`graph`)
    through a `GraphRunner`; prefill and the commit of rows accepted outside the verify
    pass run eagerly. `compiled`: the graphs replay compiled steps (`CompiledSteps`), else
    the eager step functions. `backend`: how graphs are recorded (`CudaGraphs` on a GPU;
    `graphs.StaticCalls` runs the same buffer logic on any device)."""

    addressing = "bound"

    def __init__(self, model: Transformer, cache, compiled: bool = False, backend: Replay | None = None,
                 steps: CompiledSteps | None = None):
        check_dense_dispatch(model, "CUDA-graph")
        # The joined projections' copies built now, outside any capture, and frozen: a copy
        # rebuilt inside one would live in the graphs' memory pool.
        build_stacked(model)
        super().__init__(model, cache)
        self.compiled = compiled
        self.name = "compiled+graphs" if compiled else "eager+graphs"
        self.steps = steps if steps is not None or not compiled else CompiledSteps(model)
        self.backend = backend if backend is not None else CudaGraphs(cache.device)
        self.runner = GraphRunner(model, self.backend, graph_buckets(cache.max_seqs), cache.sink_page)
        self._plans: dict = {}   # (fn, plan) -> the step the runner captures

    def over(self, cache) -> "GraphExecutor":
        """The same execution over another paged state, sharing the compiled steps and the
        graphs' memory pool (its graphs are its own: they write its pools)."""
        return GraphExecutor(self.model, cache, self.compiled, self.backend, self.steps)

    def batch_sizes(self, max_batch_size: int) -> tuple[int, ...]:
        """The batch sizes a warm-up runs so that every graph is captured: every bucket,
        largest first (smaller graphs then reuse its memory)."""
        return tuple(sorted((b for b in self.runner.buckets if b <= max_batch_size), reverse=True))

    @property
    def captures(self) -> int:
        return self.runner.captures

    def _step(self, name: str, fn: Callable) -> Callable:
        """The function a graph records for step `name`: the compiled step, or fn itself."""
        if not self.compiled:
            return fn
        compiled = getattr(self.steps, name)
        return lambda model, *args: compiled(*args)

    def decode(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor) -> ForwardOutput:
        args = (roots, Pools(self.cache.storage), self.cache.address_inputs(seq_ids, lengths, self.addressing))
        return self.runner("decode", self._step("decode", decode_step), args)

    def decode_and_draw(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor, draws: NodeDraws
                        ) -> tuple[ForwardOutput, torch.Tensor]:
        args = (roots, Pools(self.cache.storage), self.cache.address_inputs(seq_ids, lengths, self.addressing), draws)
        return self.runner("decode_draw", self._step("decode_draw", decode_draw_step), args)

    def drafter(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                state: LayerState) -> ForwardOutput:
        N = input_ids.shape[1]
        if N > 1 and state.raw_valid.shape[1] == 1:   # per-node visibility, as the compiled step takes it
            state = dataclasses.replace(state, raw_valid=state.raw_valid.expand(-1, N, -1).contiguous())
        return self.runner(("drafter", N), self._step("drafter", drafter_step), (input_ids, prev_hidden, meta, state))

    def graph(self, fn: Callable, plan, batched, shared: dict[str, torch.Tensor], pools: bool = False):
        step = self._plans.get((fn, plan))
        if step is None:
            if self.compiled:
                compiled = self.steps.plan(fn, plan, pools)
                step = self._plans[(fn, plan)] = lambda model, *args: compiled(*args)
            else:
                step = self._plans[(fn, plan)] = plan_step(fn, plan, pools)
        args = (batched, Shared(shared), Pools(self.cache.storage)) if pools else (batched, Shared(shared))
        return self.runner((fn, plan), step, args)

    def extend_width(self, needed: int, bound: int) -> int:
        return bound     # every accept length replays the same graph; padding is masked by meta.valid
