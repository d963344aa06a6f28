"""How the model's forwards run, chosen once when an engine is built: eagerly (the
reference, `eager.py`), compiled (the CPU fast path, `compiled.py`, its steps from
`compiled_step.py`), or replayed as CUDA graphs (the GPU fast path, `graphed.py` over
`graphs.py`). Everything above this package calls the forwards through the `Executor`
interface and never asks which one it has."""

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

    name: str              # "eager", "compiled", "eager+graphs", "compiled+graphs": what a measured cost belongs to
    # How many committed entries a step addresses (`cache.paged.Addressing`): "exact" where
    # shapes may follow the data, "pages" for compiled steps, "bound" for captured graphs
    # (and anything on a GPU, where no size may be read back to the host).
    addressing: str
    # Whether plans size their slots by their bounds (`tree_meta(static=True)`): every
    # addressing but "exact".
    static_shapes: bool
    model: Transformer
    cache: PagedState

    def over(self, cache: PagedState) -> "Executor": ...

    def batch_sizes(self, max_batch_size: int) -> tuple[int, ...]: ...

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


def expert_dispatch(compile: bool, device: str | torch.device = "cpu") -> str:
    """The MoE dispatch a model for this execution must be built with: "grouped" for eager
    steps on a CPU (the least work; its shapes follow the routing, read back to the host),
    "dense" for compiled steps and anything on a GPU (no shape follows the routing, and
    nothing waits for the device)."""
    return "dense" if compile or torch.device(device).type == "cuda" else "grouped"


def make_executor(model: Transformer, cache: PagedState, compile: bool, cuda_graphs: bool = False) -> Executor:
    """The execution an engine runs, chosen once: eager (the reference), compiled, or
    captured as CUDA graphs (of the compiled steps or of the eager ones). Imports the
    compiler only when asked for."""
    if cuda_graphs:
        from branchspec.execution.graphed import GraphExecutor
        return GraphExecutor(model, cache, compiled=compile)
    if compile:
        from branchspec.execution.compiled import CompiledExecutor
        return CompiledExecutor(model, cache)
    from branchspec.execution.eager import EagerExecutor
    return EagerExecutor(model, cache)
