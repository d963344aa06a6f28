"""The fast path: the target and drafter steps compiled with torch.compile.

Eager PyTorch is the reference; compiling removes the per-op overhead that dominates small
steps. Compiled code is specialised to the shapes it saw, so every step the engine runs
must come in a few stable shapes: decode and verify keep their node counts (1 and D), the
drafter's extend is padded to D + 1 nodes, completing-node slots are sized by their bound
(`metadata.max_completions`), and committed entries are gathered in whole pages
(`PagedState.address_inputs(whole_pages=True)`). The sizes that still vary (batch >= 2, entries, the pools'
slot counts, the drafter's node count) are marked dynamic and every other size is a
constant, so a growing context or a different accept length reuses the same graphs: a
speculative configuration needs four at batch 1 and four more for any larger batch (the
verify pass at D nodes, which accepts and commits its greedy rows too; the drafter at 1 node; its whole growth; its draft extend), plain
decoding one each (the target at 1 node). Each step is one graph with no breaks
(`fullgraph`), and the target's steps read their committed state from the pools inside
the graph (`Pools`, `paged.locate`). Prefill chunks vary in length and stay eager.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from typing import Any, Callable

import torch
import torch._dynamo

from branchspec.cache.paged import AddressInputs, BlockTables, locate, read_states, write_nodes
from branchspec.disk_cache import cache_dir, source_digest
from branchspec.execution.eager import EagerExecutor
from branchspec.model.attention import LayerState
from branchspec.model.layers import build_stacked, packed_products
from branchspec.model.matmul import native_kernel
from branchspec.model.metadata import ForwardMeta, chain_meta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.sampling import NodeDraws, step_tokens


class Shared:
    """Tensors passed whole into a compiled step, the same for every request (a reduced
    vocabulary's head rows, say): not batched, so canonicalising leaves them alone."""

    def __init__(self, storage: dict[str, torch.Tensor]):
        self.storage = storage


class Pools(Shared):
    """The paged state's storage ({kind: [layers of kind, slots, width]}) passed whole into
    a compiled step, which reads it at the batch's addresses inside its graph."""


_FIELDS: dict[type, tuple[str, ...] | None] = {}   # a dataclass's init fields (None: not a dataclass)


def _fields(cls: type) -> tuple[str, ...] | None:
    if cls not in _FIELDS:
        _FIELDS[cls] = (tuple(f.name for f in dataclasses.fields(cls) if f.init)
                        if dataclasses.is_dataclass(cls) else None)
    return _FIELDS[cls]


def _map_batch(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply fn to every tensor with a batch dimension inside obj (dataclasses, dicts,
    lists, tuples): the forward's inputs (ids, metadata, committed state) and its output.
    A container none of whose tensors fn replaced is returned as it is (a step's
    arguments are mapped on every call, and rebuilding them cost more than some steps'
    kernels)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.dim() > 0 else obj
    if isinstance(obj, (list, tuple)):
        new = [_map_batch(v, fn) for v in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
    if isinstance(obj, dict):
        new = {k: _map_batch(v, fn) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    names = _fields(type(obj))
    if names is None:
        return obj
    new = {n: _map_batch(getattr(obj, n), fn) for n in names}
    return obj if all(new[n] is getattr(obj, n) for n in names) else dataclasses.replace(obj, **new)


def _signature(obj: Any, out: list, order: dict[int, int], loose: list | None = None) -> None:
    """Append to `out` everything about obj that a compiled step's guards can check and a
    call can change: each tensor's shape, strides, dtype and device, with which earlier
    argument it is (`order`: object id -> first position, so that one tensor passed twice
    differs from two tensors), each other leaf's type and value, and the containers'
    structure. Tensor values are not part of it: guards never read them. With `loose`, also
    append to it every tensor with a batch dimension that is not contiguous (what
    `CompiledStep` would replace by a contiguous copy; not the tensors passed whole, in a
    `Shared`), in the same walk."""
    if isinstance(obj, torch.Tensor):
        out.append((order.setdefault(id(obj), len(order)), obj.shape, obj.stride(), obj.dtype, obj.device))
        if loose is not None and obj.dim() > 0 and not obj.is_contiguous():
            loose.append(obj)
    elif isinstance(obj, (list, tuple)):
        out.append((type(obj), len(obj)))
        for v in obj:
            _signature(v, out, order, loose)
    elif isinstance(obj, dict):
        out.append((dict, tuple(obj)))
        for v in obj.values():
            _signature(v, out, order, loose)
    elif isinstance(obj, Shared):
        out.append(type(obj))
        _signature(obj.storage, out, order)
    elif (names := _fields(type(obj))) is not None:
        out.append(type(obj))
        for n in names:
            _signature(getattr(obj, n), out, order, loose)
    else:
        out.append((type(obj), obj))


def _tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor with a batch dimension inside obj (what `_map_batch` visits)."""
    found: list[torch.Tensor] = []
    _map_batch(obj, lambda t: found.append(t) or t)
    return found


def _found(obj: Any, cls: type):
    """Every instance of cls inside obj (dataclasses, dicts, lists, tuples)."""
    if isinstance(obj, cls):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _found(v, cls)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _found(v, cls)
    elif not isinstance(obj, torch.Tensor) and (names := _fields(type(obj))) is not None:
        for n in names:
            yield from _found(getattr(obj, n), cls)


def _states(obj: Any):
    """Every LayerState inside the step's arguments."""
    if isinstance(obj, LayerState):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _states(v)


def mark_varying_sizes(args: tuple, drafter: bool, batch: bool = True) -> None:
    """Name the sizes that vary between calls of one step; every other size is a constant
    of the configuration and the step, which the compiler specialises on (far faster to
    compile than treating every size as symbolic: 103 s against 147 s cold for a v4-mini-v2
    decode step, and 4.5 ms against 7.4 ms a call at batch 1).

    Varying: the batch (dim 0 of every input; not in a batch-1 step's own graph,
    `batch=False`), the committed entries of compressed
    layers (a whole page more every page_size entries) and the block tables of their
    entries (a page more at a time). For the drafter also the window
    rows (a tree's own slots are appended to the committed window, more at every step)
    and, from 2 up, the node count: a tree's frontier (topk nodes) and the draft extend
    (D + 1 nodes) then share one graph."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in _tensors(args) if batch else ():
        mark(t, 0)
    for arg in args:
        if isinstance(arg, Pools):        # the pools' slot counts follow the engine's limits
            for t in arg.storage.values():
                mark(t, 1)
    for state in _found(args, AddressInputs):
        for t in state.entries.values():     # the entry numbers addressed (a whole page more at a time)
            mark(t, 0)
    for tables in _found(args, BlockTables):
        for kind, t in tables.tables.items():
            if kind.startswith(("ent", "ikey")):
                mark(t, 1)
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


def _example(args: tuple) -> tuple:
    """The arguments to trace a step with: fresh tensor objects over the same memory
    (identity kept), so that marking their varying sizes leaves the caller's tensors
    unmarked (a tensor marked at run time but not when a step was compiled fails that
    step's guards, and the pools' storage and the shape metadata outlive a call). Detached
    copies of the handle, not views: the compiler would guard on a view's base, which the
    step's real inputs do not have."""
    fresh_of: dict[int, torch.Tensor] = {}

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fresh_of:
            fresh_of[id(t)] = t.detach()
        return fresh_of[id(t)]

    return tuple(type(a)({k: fresh(v) for k, v in a.storage.items()}) if isinstance(a, Shared) else _map_batch(a, fresh)
                 for a in args)


def decode_step(model: Transformer, input_ids: torch.Tensor, pools: Pools, state: AddressInputs) -> ForwardOutput:
    """Plain decoding's step as a plain function of the model (what gets compiled: the
    model is an input, so one compiled step serves any weights of the same configuration),
    one node per sequence (input_ids [B, 1]) after state.lengths [B] tokens, with all its
    eager work in its graph: the committed state's addresses (`locate`, about 0.2 ms of
    eager ops a step at batch 1), the reads from the pools (where they fuse into the
    kernels that consume them instead of being copied out first), its metadata, a function
    of the committed lengths alone (about 0.3 ms), and the commit: its one node per
    sequence is always kept, so the graph writes its state into the pools (`write_nodes`;
    about 0.4 ms). Returns the output, scratch dropped."""
    meta = chain_meta(state.lengths, 1, model.cfg.compressed_kinds, max_new=1, static=True)
    out = model.forward(input_ids, meta, read_states(model.cfg, pools.storage, locate(model.cfg, state)))
    write_nodes(model.cfg, pools.storage, state.tables, meta, out.scratch, meta.valid)
    return dataclasses.replace(out, scratch=[])


def decode_draw_step(model: Transformer, input_ids: torch.Tensor, pools: Pools, state: AddressInputs,
                     draws: NodeDraws) -> tuple[ForwardOutput, torch.Tensor]:
    """`decode_step` and each sequence's next token [B, 1] in the same graph: the argmax,
    or for the rows sampled at their temperature alone a seeded draw (`sampling.step_tokens`).
    After the graph such a step had about 0.7 ms of eager ops at batch 1 (1.1 ms at
    batch 4) drawing one token per request."""
    out = decode_step(model, input_ids, pools, state)
    return out, step_tokens(out.logits, draws)


def drafter_step(model: Transformer, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta,
                 state: LayerState):
    """The MTP block's forward, likewise, without its LM head (see `Transformer.mtp_forward`)."""
    return model.mtp_forward(input_ids, prev_hidden, meta, state, logits=False)


def plan_step(fn: Callable, plan, pools: bool = False) -> Callable:
    """fn(model, plan, batched, shared) as a step of its own for one plan (a hashable value
    of Python scalars its shapes and branches follow from): fn(model, batched, Shared);
    with `pools`, fn(model, plan, batched, shared, storage) as fn(model, batched, Shared,
    Pools)."""

    if pools:
        def step(model: Transformer, batched, shared: Shared, pools: Pools):
            return fn(model, plan, batched, shared.storage, pools.storage)
    else:
        def step(model: Transformer, batched, shared: Shared):
            return fn(model, plan, batched, shared.storage)

    step.__name__ = f"{fn.__name__}-{plan.label}"
    return step


def _guards_to_keep(entries) -> list[bool]:
    """Keep the guards on the step's inputs and on the model's configuration; drop two
    kinds. Shape and stride checks on the weights: a model's weights keep their shapes
    after loading, and checking a few hundred of them cost 0.3 ms a call, more than many of
    the step's kernels. Guards on globals (imported modules and functions), which never
    change within a process and which a saved step cannot carry (what `aot_compile` drops
    by default)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return [not (e.is_global or e.guard_type in unsaveable
                 or (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter)))
            for e in entries]


_LOADED = [0]   # compiled steps this process loaded from the cache folder
MAX_SIGNATURES = 4096   # argument signatures remembered per step as having passed its guards
log = logging.getLogger("branchspec.compiled")


def global_state() -> str:
    """Everything a compiled step guards on besides its inputs: the process-wide torch
    settings of dynamo's global-state guard (grad mode, thread count, default dtype,
    deterministic algorithms, autocast, reduced-precision matmuls, ...), as a stable string.
    A step compiled under other settings fails its guards, so the settings are part of its
    key, on disk and in memory."""
    import json

    guard = getattr(torch._C._dynamo.guards, "GlobalStateGuard", None)
    if guard is not None:
        try:
            return guard().__getstate__()
        except (AttributeError, RuntimeError, TypeError):   # another torch: the fields we know
            pass
    return json.dumps({"grad_mode": torch.is_grad_enabled(), "num_threads": torch.get_num_threads(),
                       "default_dtype": str(torch.get_default_dtype()),
                       "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
                       "float32_matmul_precision": torch.get_float32_matmul_precision()})


class _SettingsNow:
    """`global_state()` as of now, recomputed only when the settings changed. Building the
    string takes about 5 µs alone, and several times that right after a graph has streamed
    the weights through the caches; asking dynamo's own guard object whether anything
    changed since takes a fraction of a microsecond."""

    def __init__(self) -> None:
        self.guard = None           # a GlobalStateGuard taken when `text` was computed
        self.text: str | None = None

    def __call__(self) -> str:
        if self.text is not None and self.guard is not None and self.guard.check():
            return self.text
        guard = getattr(torch._C._dynamo.guards, "GlobalStateGuard", None)
        self.guard = guard() if guard is not None else None   # without one, computed every time
        self.text = global_state()
        return self.text


settings_now = _SettingsNow()


# What a failed compilation raises (a recompile limit hit, a backend failure): the step then
# runs eagerly, which is always correct, instead of failing the request.
COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                   getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException))


def report_progress() -> None:
    """Print a line to stderr as each graph starts and ends compiling (each takes a minute
    or two on a few cores), for command-line runs that do not configure logging."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


class CompiledStep:
    """One compiled step (the target's or the drafter's forward), called on canonical inputs.

    Canonical: contiguous, aliasing kept (the compiler guards on strides and on which
    inputs alias each other). Batch 1 is a shape class of its own: the compiler
    specialises a size of 1, and padding it to 2 instead (as this once did) doubled the
    verify pass's matmuls, which are compute-bound on a CPU at D nodes already (the LM head
    over 16 rows took 0.7 ms of a 6.5 ms 4x2 D=8 verify); batch-1 graphs made a 4x2 D=8
    round about 30% faster and a plain step about 15%.

    Each shape class (the node count, the drafter's counts from 2 up sharing one; batch 1
    or more) is compiled
    ahead of time (`aot_compile`) on its first call, and saved under the branchspec cache
    folder, keyed by the model's configuration, dtype, device (with its index), the source of the model code,
    torch, the CPU and the torch settings its guards check (`global_state`: the thread count
    among them); a later process loads it in about a second instead of tracing and
    compiling it again (tracing alone takes 5-10 s a graph on two cores). Set
    BRANCHSPEC_COMPILE_CACHE=0 to neither read nor write it. Where ahead-of-time compiling
    is refused, or a step's guards still fail, the step falls back to plain `torch.compile`;
    and where that fails too (a recompile limit hit, say), to the same function run
    eagerly, with one warning: a compiled step is only ever slower than it should be, never
    the cause of a failed request.
    """

    def __init__(self, model: Transformer, fn: Callable, drafter: bool = False, one_shape: bool = False):
        """drafter: the MTP forward (its node counts from 2 up share a graph); one_shape:
        a step whose shapes follow from its function alone (`plan_step`)."""
        self.model, self.fn, self.drafter, self.one_shape = model, fn, drafter, one_shape
        self.steps: dict[tuple[str, str], Callable] = {}   # (shape class, global_state()) -> step
        # Per step (by id: steps are kept for the process), the argument signatures
        # (`_signature`) its guards have passed.
        self.passed: dict[int, set[tuple]] = {}
        self.fallback: Callable | None = None
        self.eager = False          # the fallback failed to compile: run `fn` as it is
        # Whether its calls replay CUDA graphs, decided once (read on every call otherwise)
        self.cuda_graphs = self._inductor_options().get("triton.cudagraphs", False)

    def shape_class(self, args: tuple) -> str:
        first = next(t for t in _found(args[0], torch.Tensor) if t.dim() > 0)
        single = "-batch1" if first.shape[0] == 1 else ""   # the batch: dim 0 of every tensor
        # A step that writes the pools computes slots in pages of a size it is compiled for.
        tables = next(_found(args, BlockTables), None)
        single += f"-page{tables.page_size}" if tables is not None else ""
        if self.one_shape:
            return "plan" + single
        n = args[0].shape[1]
        return ("nodes2+" if self.drafter and n >= 2 else f"nodes{n}") + single

    def key(self, shape_class: str, state: str | None = None) -> str:
        """The saved step's name: everything its graph and its guards depend on (state:
        `global_state()`, now's by default)."""
        import hashlib
        import json

        w = self.model.embed.weight
        # The device with its index: a step guards on its tensors' devices (cuda:0 is not cuda:1).
        blob = json.dumps({"model": self.model.cfg.to_dict(), "dtype": str(w.dtype), "device": str(w.device),
                           "step": self.fn.__name__, "shape": shape_class, "source": source_digest(),
                           "packed": packed_products(self.model),
                           "inductor": self._inductor_options(),
                           "global_state": state if state is not None else global_state(),
                           "torch": torch.__version__, "cpu": torch.backends.cpu.get_cpu_capability()},
                          sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:20]

    def __call__(self, *args):
        seen: dict[int, torch.Tensor] = {}

        def canonical(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in seen:   # tensors shared between layers stay shared
                seen[id(t)] = t.contiguous()
            return seen[id(t)]

        # One walk gives the arguments' signature (`_call`) and whether any needs a
        # contiguous copy; only then are they mapped, and the signature taken again.
        signature: list | None = []
        loose: list[torch.Tensor] = []
        _signature(args, signature, {}, loose)
        if loose:
            args = _map_batch(args, canonical)
            signature = None
        cls = self.shape_class(args)
        graphs = self.cuda_graphs
        if graphs:   # a new step: the last replay's outputs may be overwritten now
            torch.compiler.cudagraph_mark_step_begin()
        if self.eager:
            out = self.fn(self.model, *args)
        else:
            state = settings_now()   # settings changed since (threads, say): that step's own graph
            step = self.steps.get((cls, state)) or self._prepare(cls, state, args)
            try:
                out = self._call(step, args, signature)
            except COMPILER_ERRORS as e:       # a plain torch.compile step that cannot recompile
                out = self._run_eagerly(e, args)
            except RuntimeError as e:
                if "GuardManager check failed" not in str(e):
                    raise
                out = self._recompiled(cls, args, str(e))
        if graphs:   # a replay's outputs live in the graph's memory, which the next replay reuses
            out = _map_batch(out, lambda t: t.clone())
        return out

    def _call(self, step: Callable, args: tuple, signature: list | None = None):
        """Run a saved step, checking its guards only for argument signatures they have not
        passed yet.

        A saved step checks its guards before every call: the inputs' shapes, strides,
        dtypes and aliasing, the model's configuration. Isolated, that takes a few
        microseconds; after a graph has streamed the weights through the caches it took
        0.1-0.35 ms a call on the AMD EPYC of docs/fast-path.md, about a tenth of a
        batch-1 plain step. Guards are a function of the arguments' signature
        (`_signature`), the model (fixed for the step) and torch's settings (part of the
        step's key, `global_state`), so a signature that passed once passes again. A new
        signature goes through the guards as before; one they refuse raises as before
        (then `_recompiled`). Steps without a separate check (the fallback) run as they are.
        `signature`: the arguments' own, when the caller took it already."""
        run, check = getattr(step, "fn", None), getattr(step, "guard_check", None)
        if run is None or check is None:
            return step(self.model, *args)
        if signature is None:
            signature = []
            _signature(args, signature, {})
        key = tuple(signature)
        passed = self.passed.setdefault(id(step), set())
        try:
            known = key in passed
        except TypeError:     # an unhashable leaf: no signature, the guards every time
            return step(self.model, *args)
        if not known:
            if not check(self.model, *args):
                return step(self.model, *args)     # raises, naming the guard that failed
            if len(passed) >= MAX_SIGNATURES:      # a long-lived engine meets many entry counts
                passed.clear()
            passed.add(key)
        return run(self.model, *args)

    def _recompiled(self, cls: str, args: tuple, why: str):
        """Inputs the step's guards refuse: plain torch.compile for them, which traces at its
        first call and again for each new shape; where it fails (its recompile limit hit,
        say), `fn` eagerly from now on."""
        if self.fallback is None:
            warnings.warn(f"{self.fn.__name__}: inputs its {cls} step was not compiled for; compiling "
                          f"them separately ({why[:300]})", stacklevel=3)
        try:
            with tracing_settings():
                return self._fallback()(self.model, *args)
        except COMPILER_ERRORS as e:
            return self._run_eagerly(e, args)

    def _run_eagerly(self, error: Exception, args: tuple):
        warnings.warn(f"{self.fn.__name__}: compiling failed ({type(error).__name__}: {str(error)[:200]}); "
                      "running this step eagerly from now on (same results, slower)", stacklevel=4)
        self.eager = True
        return self.fn(self.model, *args)

    def _inductor_options(self) -> dict:
        """On CPU the generated wrapper is C++ (`cpp_wrapper`): a Python wrapper calls each of
        a step's few hundred kernels from Python, which cost about a millisecond of a 5 ms
        decode step at batch 1 (3.6 against 2.7 ms for the graph). On a GPU each step replays
        as a CUDA graph, one per batch size it meets (BRANCHSPEC_CUDA_GRAPHS=0: launch its
        kernels one by one)."""
        if self.model.embed.weight.device.type == "cpu":
            return {"cpp_wrapper": True}
        return {"triton.cudagraphs": os.environ.get("BRANCHSPEC_CUDA_GRAPHS", "1") != "0"}

    def _options(self) -> dict:
        return dict(dynamic=False, fullgraph=True,
                    options={"guard_filter_fn": _guards_to_keep, **self._inductor_options()})

    def _fallback(self) -> Callable:
        if self.fallback is None:
            self.fallback = torch.compile(self.fn, **self._options())
        return self.fallback

    def _prepare(self, cls: str, state: str, args: tuple) -> Callable:
        """Load the shape class's compiled step for these torch settings (`global_state`)
        from the cache folder, else compile it now (then save it). Compiling traces the
        example with a scratch copy of its metadata."""

        use_cache = os.environ.get("BRANCHSPEC_COMPILE_CACHE", "1") != "0"
        path = cache_dir() / "compiled" / f"{self.fn.__name__}-{cls}-{self.key(cls, state)}.bin"
        step = None
        if use_cache and path.exists():
            try:
                with open(path, "rb") as f:
                    step = torch.compiler.load_compiled_function(f)
                _LOADED[0] += 1
            except Exception:   # noqa: BLE001 - unreadable or from another build: compile anew
                step = None
        if step is None:
            example = _example(args)
            mark_varying_sizes(example, self.drafter, batch=not cls.endswith("-batch1"))
            log.info("compiling %s for %s (once per machine; a minute or two on a few cores)", self.fn.__name__, cls)
            t0 = time.perf_counter()
            try:
                with tracing_settings():
                    step = torch.compile(self.fn, **self._options()).aot_compile(((self.model, *example), {}))
            except Exception as e:   # noqa: BLE001 - ahead-of-time compiling refused: plain torch.compile
                warnings.warn(f"{self.fn.__name__} could not be compiled ahead of time ({type(e).__name__}: "
                              f"{str(e)[:200]}); using plain torch.compile", stacklevel=2)
                step = self._fallback()
            else:
                log.info("compiled %s for %s in %.0f s", self.fn.__name__, cls, time.perf_counter() - t0)
                if use_cache:
                    try:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        tmp = path.with_suffix(".tmp")
                        step.save_compiled_function(str(tmp))
                        tmp.replace(path)
                    except Exception:   # noqa: BLE001 - an unwritable cache only costs the next start
                        pass
        self.steps[(cls, state)] = step
        return step


def tracing_settings():
    """The compiler settings every step is traced under, scoped to the tracing: two
    unrelated varying sizes that happen to be equal (the batch and the drafter's node
    count) must not be assumed equal forever (`use_duck_shape`), or that guard fails
    later and the step recompiles."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False)


def compile_steps(model: Transformer) -> tuple["CompiledStep", "CompiledStep", "CompiledStep"]:
    """(plain decode step, MTP forward, plain decode step drawing its tokens), compiled
    (see `CompiledStep`); whole functions (a tree's growth, the verify pass) get theirs
    per plan (`CompiledExecutor.graph`)."""
    return (CompiledStep(model, decode_step), CompiledStep(model, drafter_step, drafter=True),
            CompiledStep(model, decode_draw_step))


def compilations() -> int:
    """Graphs compiled so far in this process, ahead of time or by a fallback (dynamo's
    counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def steps_loaded() -> int:
    """Compiled steps this process loaded from the cache folder instead of compiling."""
    return _LOADED[0]


class CompiledExecutor(EagerExecutor):
    """The fast path: decode, the drafter's round forwards and whole functions of tensors
    (a tree's growth, the verify pass, the draft extend: `graph`) run as compiled steps
    (`CompiledStep`) in a few stable shapes; prefill chunks, whose lengths vary, run
    eagerly (`EagerExecutor.prefill`).

    What the fixed shapes need is decided here and nowhere else (`static_shapes`, read
    by the plans it runs): completing-node slots sized by their bound
    (`tree_meta(static=True)`), committed entries read in whole pages, a draft extend
    always `bound` nodes wide, and the drafter's visibility given per node so that a
    tree's frontier and a draft extend share one graph. The model must be built with the
    dense expert dispatch (no shape may follow the routing).

    A plain decode step, a draft extend and a verify pass's greedy rows and rows sampled
    at their temperature alone commit inside their graphs (the sampled ones drawn there
    too, as a plain step's tokens can be: `decode_and_draw`). The commit of a verify
    pass's other rows (a top-p, top-k or min-p cut, logits rules: drawn outside any graph)
    runs eagerly, as on the eager path: as a graph of its own it took as long as the eager
    writes (0.6-0.7 ms a round at batch 1 either way, most of it the call's argument
    handling and guards).
    """

    name = "compiled"
    expert_dispatch = "dense"
    static_shapes = True

    def __init__(self, model: Transformer, cache, steps: tuple["CompiledStep", ...] | None = None,
                 graphs: dict | None = None):
        if model.cfg.num_experts and model.expert_dispatch != self.expert_dispatch:
            raise ValueError(f"a compiled engine needs a model built with expert_dispatch="
                             f"{self.expert_dispatch!r} (got {model.expert_dispatch!r}): no shape of a compiled "
                             f"step may follow the routing; LLM(compile=True) builds it so")
        super().__init__(model, cache)
        if steps is None:
            native_kernel()          # packed products called from the graphs without a trip through Python
            build_stacked(model)     # the compiled steps read the stacked projections built now
            steps = compile_steps(model)
        self.steps = steps
        self._decode, self._drafter, self._decode_draw = steps
        # (fn, plan) -> its compiled step (`graph`), shared with `over`'s executors
        self.graphs: dict = {} if graphs is None else graphs

    def over(self, cache) -> "CompiledExecutor":
        return CompiledExecutor(self.model, cache, self.steps, self.graphs)

    def graph(self, fn: Callable, plan, batched, shared: dict[str, torch.Tensor], pools: bool = False):
        step = self.graphs.get((fn, plan))
        if step is None:
            step = self.graphs[(fn, plan)] = CompiledStep(self.model, plan_step(fn, plan, pools), one_shape=True)
        if pools:
            return step(batched, Shared(shared), Pools(self.cache.storage))
        return step(batched, Shared(shared))

    def decode(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor) -> ForwardOutput:
        # The step addresses its state, builds its metadata and commits in its graph.
        return self._decode(roots, Pools(self.cache.storage), self.cache.address_inputs(seq_ids, lengths, whole_pages=True))

    def decode_and_draw(self, roots: torch.Tensor, seq_ids: list[int], lengths: torch.Tensor, draws: NodeDraws
                        ) -> tuple[ForwardOutput, torch.Tensor]:
        return self._decode_draw(roots, Pools(self.cache.storage),
                                 self.cache.address_inputs(seq_ids, lengths, whole_pages=True), draws)

    def drafter(self, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                state: LayerState) -> ForwardOutput:
        N = input_ids.shape[1]
        if N > 1 and state.raw_valid.shape[1] == 1:   # per-node visibility, as a frontier step has
            state = dataclasses.replace(state, raw_valid=state.raw_valid.expand(-1, N, -1))
        return self._drafter(input_ids, prev_hidden, meta, state)

    def extend_width(self, needed: int, bound: int) -> int:
        return bound     # every accept length runs the same graph; padding is masked by meta.valid
