"""The fast path: the target and drafter steps compiled with torch.compile.

Eager PyTorch is the reference; compiling removes the per-op overhead that dominates small
steps. Compiled code is specialised to the shapes it saw, so every step the engine runs
must come in a few stable shapes: decode and verify keep their node counts (1 and D), the
drafter's extend is padded to D nodes, completing-node slots are sized by their bound
(`metadata.max_completions`), and committed entries are gathered in whole pages
(`PagedState.pad_entries`). Remaining sizes (batch >= 2, entries, draft slots) are marked
dynamic, so a growing context or a different accept length reuses the same graphs.
Prefill chunks vary in length and stay eager.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

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


class BatchPadded:
    """Call a compiled step on canonical inputs: contiguous, aliasing kept, and batch 1
    padded to 2 (the one row twice) with row 0 of the output kept.

    The compiler guards on strides, on which inputs alias each other, and specialises a
    size of 1; each of those would otherwise cost a graph of its own. At batch 1 a step is
    overhead-bound, so a second row costs little next to compiling every graph twice."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *args):
        pad = args[0].shape[0] == 1
        seen: dict[int, torch.Tensor] = {}

        def canonical(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in seen:   # tensors shared between layers stay shared
                seen[id(t)] = (t.expand(2, *t.shape[1:]) if pad else t).contiguous()
            return seen[id(t)]

        out = self.fn(*_map_batch(args, canonical))
        return _map_batch(out, lambda t: t[:1]) if pad else out


def compile_steps(model: Transformer) -> tuple[Callable, Callable]:
    """(target forward, MTP forward), compiled with dynamic shapes."""
    import torch._dynamo
    import torch.fx.experimental._config as fx_config

    # Two unrelated sizes that happen to be equal (64 entries, a 64-token window) must not
    # be assumed equal forever: that guard fails as the context grows and recompiles.
    fx_config.use_duck_shape = False
    # Enough room for the few graphs one configuration needs (per node count, batch 1 vs
    # more); past the limit dynamo silently falls back to eager, which `compilations`
    # makes visible.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    options = dict(dynamic=True, fullgraph=False)
    return (BatchPadded(torch.compile(model.forward, **options)),
            BatchPadded(torch.compile(model.mtp_forward, **options)))


def compilations() -> int:
    """Graphs compiled so far in this process (dynamo's counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
