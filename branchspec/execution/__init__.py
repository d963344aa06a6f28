"""How the model's forwards run: eagerly (the reference) or compiled (the fast path),
chosen once when an engine is built. Everything above this package calls the forwards
through the `Executor` interface and never asks which one it has."""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from branchspec.cache.paged import PagedState
from branchspec.model.attention import LayerScratch, LayerState
from branchspec.model.metadata import ForwardMeta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.sampling import NodeDraws


class Executor(Protocol):
    """The forwards an engine runs, over one paged state (see `EagerExecutor` for each)."""

    name: str              # "eager" or "compiled": what a measured cost belongs to
    expert_dispatch: str   # the MoE dispatch the model must be built with
    # Whether its graphs need shapes that do not follow the data: a tree plan's
    # completing-node slots sized by their bound (`tree_meta(static=True)`), committed
    # entries addressed in whole pages (`PagedState.addresses(whole_pages=True)`).
    static_shapes: bool
    model: Transformer
    cache: PagedState

    def over(self, cache: PagedState) -> "Executor": ...

    def prefill(self, input_ids: torch.Tensor, meta: ForwardMeta, seq_ids: list[int],
                lengths: torch.Tensor, logits_at: torch.Tensor | None = None) -> ForwardOutput: ...

    def decode(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor) -> ForwardOutput: ...

    def decode_and_draw(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor, draws: NodeDraws
                        ) -> tuple[ForwardOutput, torch.Tensor]: ...

    def commit(self, seq_ids: list[int], meta: ForwardMeta, scratch: list[LayerScratch], keep: torch.Tensor
               ) -> None: ...

    def drafter_prefill(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                        state: LayerState) -> ForwardOutput: ...

    def drafter(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                state: LayerState) -> ForwardOutput: ...

    def graph(self, fn: Callable, plan: Any, batched: Any, shared: dict[str, torch.Tensor], pools: bool = False
              ) -> Any: ...

    def extend_width(self, needed: int, bound: int) -> int: ...


def executor_class(compile: bool) -> type:
    """The executor an engine with this `compile` setting runs (imports the compiler only
    when asked for)."""
    if compile:
        from branchspec.execution.compiled import CompiledExecutor
        return CompiledExecutor
    from branchspec.execution.eager import EagerExecutor
    return EagerExecutor


def expert_dispatch(compile: bool) -> str:
    """The MoE dispatch a model for this execution must be built with."""
    return executor_class(compile).expert_dispatch


def make_executor(model: Transformer, cache: PagedState, compile: bool) -> Executor:
    return executor_class(compile)(model, cache)
