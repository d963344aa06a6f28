"""The fast path: the target and drafter steps compiled with torch.compile.

Eager PyTorch is the reference; compiling removes the per-op overhead that dominates small
steps. Compiled code is specialised to the shapes it saw, so every step the engine runs
must come in a few stable shapes: decode and verify keep their node counts (1 and D), the
drafter's extend is padded to D nodes, completing-node slots are sized by their bound
(`metadata.max_completions`), and committed entries are gathered in whole pages
(`PagedState.pad_entries`). The sizes that still vary (batch >= 2, entries, the drafter's
window slots and node count) are marked dynamic and every other size is a constant, so a
growing context or a different accept length reuses the same graphs: one configuration
needs four (target: 1 and D nodes; drafter: 1 and 2 or more). Each step is one graph with
no breaks (`fullgraph`). Prefill chunks vary in length and stay eager.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch._dynamo

from branchspec.model.attention import LayerState
from branchspec.model.model import Transformer


def _map_batch(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every tensor with a batch dimension inside obj (dataclasses, dicts,
    lists, tuples): the forward's inputs (ids, metadata, committed state) and its output."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.dim() > 0 else obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_batch(getattr(obj, f.name), fn)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, dict):
        return {k: _map_batch(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_batch(v, fn) for v in obj)
    return obj


def _tensors(obj: Any):
    """Every tensor inside obj (dataclasses, dicts, lists, tuples)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name))
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _states(obj: Any):
    """Every LayerState inside the step's arguments."""
    if isinstance(obj, LayerState):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _states(v)


def mark_varying_sizes(args: tuple, drafter: bool) -> None:
    """Name the sizes that vary between calls of one step; every other size is a constant
    of the configuration and the step, which the compiler specialises on (far faster to
    compile than treating every size as symbolic: 103 s against 147 s cold for a v4-mini-v2
    decode step, and 4.5 ms against 7.4 ms a call at batch 1).

    Varying: the batch (dim 0 of every input) and the committed entries of compressed
    layers (a whole page more every page_size entries). For the drafter also the window
    rows (a tree's own slots are appended to the committed window, more at every step)
    and, from 2 up, the node count: a tree's frontier (topk nodes) and the draft extend (D
    nodes) then share one graph."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in _tensors(args):
        if t.dim() > 0:
            mark(t, 0)
    for st in _states(args):
        for t in (st.entries, st.entries_valid, st.index_keys):
            if t is not None:
                mark(t, 1)
        if drafter:
            mark(st.raw_k, 1)
            mark(st.raw_pos, 1)
            mark(st.raw_valid, 2)
    if drafter and args[0].shape[1] >= 2:
        input_ids, prev_hidden, meta, state = args
        for t, dims in ((input_ids, (1,)), (prev_hidden, (1,)), (meta.positions, (1,)), (meta.valid, (1,)),
                        (meta.ancestor, (1, 2)), (state.raw_valid, (1,) if state.raw_valid.shape[1] > 1 else ())):
            for d in dims:
                mark(t, d)


class BatchPadded:
    """Call a compiled step on canonical inputs: contiguous, aliasing kept, and batch 1
    padded to 2 (the one row twice) with row 0 of the output kept.

    The compiler guards on strides, on which inputs alias each other, and specialises a
    size of 1; each of those would otherwise cost a graph of its own. At batch 1 a step is
    overhead-bound, so a second row costs little next to compiling every graph twice."""

    def __init__(self, fn: Callable, drafter: bool = False):
        self.fn, self.drafter = fn, drafter

    def __call__(self, *args):
        pad = args[0].shape[0] == 1
        seen: dict[int, torch.Tensor] = {}

        def canonical(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in seen:   # tensors shared between layers stay shared
                seen[id(t)] = (t.expand(2, *t.shape[1:]) if pad else t).contiguous()
            return seen[id(t)]

        args = _map_batch(args, canonical)
        mark_varying_sizes(args, self.drafter)
        out = self.fn(*args)
        return _map_batch(out, lambda t: t[:1]) if pad else out


def _skip_weight_guards(entries) -> list[bool]:
    """Keep every guard but the shape and stride checks on the weights: a model's weights
    keep their shapes after loading, and checking a few hundred of them cost 0.3 ms a call,
    more than many of the step's kernels. Guards on the model's configuration and on the
    step's inputs stay, so another model, or another step, still gets its own graph."""
    return [not (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter)) for e in entries]


def compile_steps(model: Transformer) -> tuple[Callable, Callable]:
    """(target forward, MTP forward), compiled with dynamic shapes."""
    import torch.fx.experimental._config as fx_config

    # Two unrelated sizes that happen to be equal (64 entries, a 64-token window) must not
    # be assumed equal forever: that guard fails as the context grows and recompiles.
    fx_config.use_duck_shape = False
    # Enough room for the few graphs one configuration needs (per node count, batch 1 vs
    # more); past the limit dynamo silently falls back to eager, which `compilations`
    # makes visible.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    options = dict(dynamic=False, fullgraph=True, options={"guard_filter_fn": _skip_weight_guards})
    return (BatchPadded(torch.compile(model.forward, **options)),
            BatchPadded(torch.compile(model.mtp_forward, **options), drafter=True))


def compilations() -> int:
    """Graphs compiled so far in this process (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
