"""The CPU fast path: the target's and drafter's steps compiled with torch.compile.

Eager PyTorch is the reference; compiling removes the per-op overhead that dominates small
steps. Compiled code is specialised to the shapes it saw, so every step the engine runs
comes in a few stable shapes: decode and verify keep their node counts (1 and D), the
drafter's extend is padded to D + 1 nodes, completing-node slots are sized by their bound
(`metadata.max_completions`), and committed entries are addressed in whole pages
("pages" addressing, `PagedState.address_inputs`). The sizes that still vary (batch >= 2,
entries, the pools' slot counts, the drafter's node count) are symbolic and every other
size is a constant (`compiled_step.mark_varying_sizes`), so a growing context or a
different accept length reuses the same graphs: a speculative configuration needs four
at batch 1 and four more for any larger batch (the verify pass at D nodes, which accepts
and commits its greedy rows too; the drafter at 1 node; its whole growth; its draft
extend), plain decoding one each. Each step is one graph with no breaks (`fullgraph`),
and the target's steps read their committed state from the pools inside the graph.
Prefill chunks vary in length and stay eager. On a GPU the same compiled steps run inside
captured CUDA graphs (`execution/graphed.py`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from branchspec.execution.arguments import Pools, Shared
from branchspec.execution.compiled_step import CompiledStep
from branchspec.execution.eager import EagerExecutor
from branchspec.execution.steps import decode_draw_step, decode_step, drafter_step, plan_step
from branchspec.model.attention import LayerState
from branchspec.model.layers import build_stacked
from branchspec.model.matmul import native_kernel
from branchspec.model.metadata import ForwardMeta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.sampling import NodeDraws


class CompiledSteps:
    """One model's compiled steps, shared by every executor over it (`over`): the plain
    decode step, the drafter's forward, the plain step drawing its tokens, and one step per
    (function, plan) of a round (`plan`)."""

    def __init__(self, model: Transformer):
        if model.embed.weight.device.type == "cpu":
            native_kernel()      # packed products called from the graphs without a trip through Python
        build_stacked(model)     # the compiled steps read the stacked projections built now
        self.model = model
        self.decode = CompiledStep(model, decode_step)
        self.drafter = CompiledStep(model, drafter_step, drafter=True)
        self.decode_draw = CompiledStep(model, decode_draw_step)
        self.plans: dict = {}    # (fn, plan) -> its compiled step

    def plan(self, fn: Callable, plan, pools: bool) -> CompiledStep:
        step = self.plans.get((fn, plan))
        if step is None:
            step = self.plans[(fn, plan)] = CompiledStep(self.model, plan_step(fn, plan, pools), one_shape=True)
        return step


def check_dense_dispatch(model: Transformer, executor: str) -> None:
    """No shape of a compiled step or captured graph may follow the MoE routing, and no
    forward inside one may read the routing back to the host."""
    if model.cfg.num_experts and model.expert_dispatch != "dense":
        raise ValueError(f"a {executor} engine needs a model built with expert_dispatch='dense' (got "
                         f"{model.expert_dispatch!r}): no shape of its steps may follow the routing; LLM builds it so")


class CompiledExecutor(EagerExecutor):
    """The CPU fast path: decode, the drafter's round forwards and whole functions of
    tensors (a tree's growth, the verify pass, the draft extend: `graph`) run as compiled
    steps (`CompiledStep`) in a few stable shapes; prefill chunks, whose lengths vary, run
    eagerly (`EagerExecutor.prefill`).

    What the fixed shapes need is decided here and nowhere else (`addressing`, read by the
    plans it runs): completing-node slots sized by their bound (`tree_meta(static=True)`),
    committed entries read in whole pages, a draft extend always `bound` nodes wide, and
    the drafter's visibility given per node so that a tree's frontier and a draft extend
    share one graph. The model must be built with the dense expert dispatch.

    A plain decode step, a draft extend and a verify pass's greedy rows and rows sampled
    at their temperature alone commit inside their graphs (the sampled ones drawn there
    too). The commit of a verify pass's other rows (a top-p, top-k or min-p cut, logits
    rules: drawn outside any graph) runs eagerly, as on the eager path.
    """

    name = "compiled"
    addressing = "pages"

    def __init__(self, model: Transformer, cache, steps: CompiledSteps | None = None):
        check_dense_dispatch(model, "compiled")
        super().__init__(model, cache)
        self.steps = steps if steps is not None else CompiledSteps(model)

    def over(self, cache) -> "CompiledExecutor":
        return CompiledExecutor(self.model, cache, self.steps)

    def graph(self, fn: Callable, plan, batched, shared: dict[str, torch.Tensor], pools: bool = False):
        step = self.steps.plan(fn, plan, pools)
        if pools:
            return step(batched, Shared(shared), Pools(self.cache.storage))
        return step(batched, Shared(shared))

    def decode(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor) -> ForwardOutput:
        # The step addresses its state, builds its metadata and commits in its graph.
        return self.steps.decode(roots, Pools(self.cache.storage),
                                 self.cache.address_inputs(seq_ids, lengths, self.addressing))

    def decode_and_draw(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor, draws: NodeDraws
                        ) -> tuple[ForwardOutput, torch.Tensor]:
        return self.steps.decode_draw(roots, Pools(self.cache.storage),
                                      self.cache.address_inputs(seq_ids, lengths, self.addressing), draws)

    def drafter(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                state: LayerState) -> ForwardOutput:
        N = input_ids.shape[1]
        if N > 1 and state.raw_valid.shape[1] == 1:   # per-node visibility, as a frontier step has
            state = dataclasses.replace(state, raw_valid=state.raw_valid.expand(-1, N, -1))
        return self.steps.drafter(input_ids, prev_hidden, meta, state)

    def extend_width(self, needed: int, bound: int) -> int:
        return bound     # every accept length runs the same graph; padding is masked by meta.valid
