"""Steps replayed from static buffers: the engine's own CUDA graphs.

On a GPU a small model's step is bound by launching its kernels one by one, not by its
arithmetic. A CUDA graph records a step's kernels once and replays them with one launch,
as long as every replay reads and writes the memory the capture saw and has the shapes it
had. So a step (`execution/steps.py`) is captured once per (step, plan, batch *bucket*),
and a call:

1. copies its arguments into the graph's *static inputs*, allocated at capture, with the
   batch padded up to the bucket. A padding row is a copy of row 0 whose block tables
   point at the sink page (`cache.paged`), so whatever it reads is never used and whatever
   it writes lands where no sequence reads. Tensors every request shares (`Shared`) are
   copied only when the caller passes another tensor, or changed it in place. The pools
   (`Pools`) are the engine's storage, at fixed addresses, and the graph writes them in
   place;
2. replays the graph;
3. returns its rows of the graph's *static outputs*, copied out: the next replay of this
   graph, or of another one sharing its memory pool, may overwrite them.

Shapes that would follow the context do not: committed entries and block tables are sized
by max_model_len ("bound" addressing), masked beyond each sequence's own. Nothing inside a
captured step reads a value back to the host.

`CudaGraphs` captures with `torch.cuda.graph`, every graph of an engine in one memory
pool. `StaticCalls` plays the same part on any device without recording anything: it
runs the step again over the static inputs and copies its outputs into the static
outputs, so the runner's buffer logic (padding, copying in, copying out, outputs that a
later replay overwrites) is exercised and tested on a CPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import torch

from branchspec.cache.paged import BlockTables
from branchspec.execution.arguments import Pools, Shared, batch_size, fields, map_batch

# The batch buckets a step is captured at, up to the engine's largest batch.
BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Eager calls of a step before it is captured: lazy initialisation (the BLAS handles and
# workspaces, a compiled step's first guards) must happen outside the capture.
WARMUP_CALLS = 2


def graph_buckets(max_batch_size: int) -> tuple[int, ...]:
    """The buckets for batches up to max_batch_size: 1, 2, 4, ... below it, then itself."""
    sizes = [b for b in BUCKETS if b < max_batch_size]
    while sizes and sizes[-1] * 2 < max_batch_size:
        sizes.append(sizes[-1] * 2)
    return (*sizes, max_batch_size)


class Replay(Protocol):
    """How a step over static buffers is recorded and replayed."""

    name: str

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        """Record run() (the step over its static inputs): its static outputs, and a
        function that replays it, writing them again."""


class CudaGraphs:
    """Capture with `torch.cuda.graph` on a side stream, after `WARMUP_CALLS` eager calls
    on that stream; every graph of the engine allocates from one memory pool (a call
    copies its outputs out at once, so graphs may reuse each other's memory)."""

    name = "cuda"

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.pool = None
        self.stream: torch.cuda.Stream | None = None

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        if self.stream is None:
            self.stream = torch.cuda.Stream(self.device)
            self.pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            for _ in range(WARMUP_CALLS):
                run()
        current.wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            outputs = run()
        return outputs, graph.replay


class StaticCalls:
    """A CUDA graph's memory behaviour without one: "capturing" runs the step once and
    keeps its outputs as the static outputs; a replay runs it again over the static inputs
    and copies the new outputs into them."""

    name = "static-calls"

    def capture(self, run: Callable[[], Any]) -> tuple[Any, Callable[[], None]]:
        outputs = run()
        static = _tensors(outputs)

        def replay() -> None:
            for out, new in zip(static, _tensors(run())):
                if out.data_ptr() != new.data_ptr():
                    out.copy_(new)

        return outputs, replay


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside a step's outputs, in a fixed order."""
    found: list[torch.Tensor] = []
    map_batch(obj, lambda t: found.append(t) or t, every=True)
    return found


def _rebuild(obj: Any, fn: Callable[[torch.Tensor, str], torch.Tensor], role: str = "batch") -> Any:
    """obj with every tensor t replaced by fn(t, role), role naming what the tensor is:
    "batch" (dim 0 the request), "table:KIND" (a block table of KIND), "unbatched" (a
    dataclass field marked so), "shared" (inside a `Shared`), "pools" (inside `Pools`).
    The same walk, in the same order, for the arguments and for the static inputs."""
    if isinstance(obj, torch.Tensor):
        return fn(obj, role if obj.dim() > 0 else "unbatched")
    if isinstance(obj, Shared):
        inner = "pools" if isinstance(obj, Pools) else "shared"
        return type(obj)({k: _rebuild(v, fn, inner) for k, v in obj.storage.items()})
    if isinstance(obj, BlockTables):
        return BlockTables({k: _rebuild(v, fn, f"table:{k}") for k, v in obj.tables.items()}, obj.page_size)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, fn, role) for v in obj)
    if isinstance(obj, dict):
        return {k: _rebuild(v, fn, role) for k, v in obj.items()}
    names = fields(type(obj))
    if names is None:
        return obj
    return dataclasses.replace(obj, **{n: _rebuild(getattr(obj, n), fn, role if batched else "unbatched")
                                       for n, batched in names})


def walk(obj: Any, leaves: list, shape: list, role: str = "batch") -> None:
    """Append obj's tensors to `leaves` as (tensor, role) in `_rebuild`'s order, and to
    `shape` what a captured graph depends on besides the batch: every tensor's role, shape
    (beyond the batch for batched ones and tables), dtype and device, the pools' addresses,
    the containers' structure and every other leaf's value (a page size, a None where a
    tensor may be). One walk, no containers rebuilt: a call pays it every time."""
    if isinstance(obj, torch.Tensor):
        role = role if obj.dim() > 0 else "unbatched"
        rows = role == "batch" or role.startswith("table")
        leaves.append((obj, role))
        shape.append((role, tuple(obj.shape[1:] if rows else obj.shape), obj.dtype, obj.device,
                      obj.data_ptr() if role == "pools" else None))
    elif isinstance(obj, Shared):
        inner = "pools" if isinstance(obj, Pools) else "shared"
        shape.append((type(obj), tuple(obj.storage)))
        for v in obj.storage.values():
            walk(v, leaves, shape, inner)
    elif isinstance(obj, BlockTables):
        shape.append((BlockTables, obj.page_size, tuple(obj.tables)))
        for k, v in obj.tables.items():
            walk(v, leaves, shape, f"table:{k}")
    elif isinstance(obj, (list, tuple)):
        shape.append((type(obj), len(obj)))
        for v in obj:
            walk(v, leaves, shape, role)
    elif isinstance(obj, dict):
        shape.append((dict, tuple(obj)))
        for v in obj.values():
            walk(v, leaves, shape, role)
    elif (names := fields(type(obj))) is not None:
        shape.append(type(obj))
        for n, batched in names:
            walk(getattr(obj, n), leaves, shape, role if batched else "unbatched")
    else:
        shape.append((type(obj), obj))


class CapturedStep:
    """One step captured at one bucket: its static inputs, its replay and its static
    outputs (see the module's docstring)."""

    def __init__(self, fn: Callable, model, args: tuple, bucket: int, backend: Replay, sink_page: dict[str, int]):
        self.bucket, self.sink_page = bucket, sink_page

        def allocate(t: torch.Tensor, role: str) -> torch.Tensor:
            if role == "pools":
                return t                                        # written in place by the graph
            if role == "batch" or role.startswith("table"):
                return t.new_empty((bucket, *t.shape[1:]))
            return t.clone()                                    # shared, unbatched: own copies

        self.inputs = _rebuild(args, allocate)
        self.static: list[tuple[torch.Tensor, str]] = []
        walk(self.inputs, self.static, [])
        self.loaded: list[tuple | None] = [None] * len(self.static)   # (source, version) each shared buffer holds
        given: list[tuple[torch.Tensor, str]] = []
        walk(args, given, [])
        self.load(given, 0)     # every row padding while it warms up and is captured
        self.outputs, self.replay = backend.capture(lambda: fn(model, *self.inputs))
        for t in _tensors(self.outputs):
            if t.dim() == 0 or t.shape[0] != bucket:
                raise RuntimeError(f"a captured step's outputs must all be batched: one has shape {tuple(t.shape)} "
                                   f"at bucket {bucket}")

    def load(self, leaves: list[tuple[torch.Tensor, str]], batch: int) -> None:
        """Copy a call's arguments (their tensors, `walk`'s leaves; batch rows) into the
        static inputs; rows past them are padding. batch 0: every row is padding (a copy of
        row 0 of the arguments)."""
        for i, ((static, role), (given, _)) in enumerate(zip(self.static, leaves)):
            if role == "pools":
                if static.data_ptr() != given.data_ptr():
                    raise RuntimeError("the paged state's storage moved after its graphs were captured")
            elif role == "batch":
                if batch:
                    static[:batch].copy_(given)
                if batch < self.bucket:
                    static[batch:].copy_(given[:1].expand(self.bucket - batch, *given.shape[1:]))
            elif role.startswith("table"):
                if batch:
                    static[:batch].copy_(given)
                static[batch:].fill_(self.sink_page[role[len("table:"):]])
            else:
                # The tensor last copied in, held so that its identity cannot pass to another
                # one, and its version then: another tensor, or this one changed in place
                # (an inference tensor keeps no version: always copied), is copied in again.
                version = None if given.is_inference() else given._version
                last = self.loaded[i]
                if last is None or last[0] is not given or last[1] != version or version is None:
                    static.copy_(given)
                    self.loaded[i] = (given, version)

    def read(self, batch: int) -> Any:
        """This call's rows of the static outputs, copied out."""
        return map_batch(self.outputs, lambda t: t[:batch].clone(), every=True)


class GraphRunner:
    """Runs steps as captured graphs, one per (key, bucket, argument structure), captured
    at a step's first call in that bucket (`warmup` does it ahead)."""

    def __init__(self, model, backend: Replay, buckets: tuple[int, ...], sink_page: dict[str, int]):
        self.model, self.backend, self.buckets, self.sink_page = model, backend, tuple(buckets), sink_page
        self.graphs: dict[tuple, CapturedStep] = {}
        self.captures = 0

    def bucket(self, batch: int) -> int:
        for b in self.buckets:
            if batch <= b:
                return b
        raise ValueError(f"a batch of {batch} exceeds the largest graph bucket {self.buckets[-1]}")

    def __call__(self, key: Any, fn: Callable, args: tuple) -> Any:
        """fn(model, *args) for the step `key` names, as its graph's replay."""
        batch = batch_size(args)
        bucket = self.bucket(batch)
        leaves: list[tuple[torch.Tensor, str]] = []
        shape: list = []
        walk(args, leaves, shape)
        at = (key, bucket, tuple(shape))
        graph = self.graphs.get(at)
        if graph is None:
            graph = self.graphs[at] = CapturedStep(fn, self.model, args, bucket, self.backend, self.sink_page)
            self.captures += 1
        graph.load(leaves, batch)
        graph.replay()
        return graph.read(batch)
