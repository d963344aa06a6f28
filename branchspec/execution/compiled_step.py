"""Compiling a step, and keeping it: `CompiledStep`.

A step (`execution/steps.py`) is compiled once per *shape class* (its node count, and
batch 1 apart from every larger batch) with the sizes that vary between calls marked
symbolic and every other size a constant, so that a growing context, a new batch size or
another accept length reuses the same graph. Ahead-of-time compiled steps are saved in
the cache folder and loaded by later processes. Where ahead-of-time compiling does not
exist (torch 2.11) or is refused, the step compiles the same graph with the same symbolic
sizes through plain `torch.compile`, in a code object of its own per shape class, so
that nothing recompiles after warm-up there either. Measured costs behind these choices:
docs/fast-path.md, "Why the compiled steps are built as they are".
"""

from __future__ import annotations

import logging
import os
import time
import types
import warnings
from typing import Any, Callable

import torch
import torch._dynamo

from branchspec.atomic import write_atomically
from branchspec.cache.paged import AddressInputs, BlockTables
from branchspec.disk_cache import cache_dir, source_digest
from branchspec.execution.arguments import Pools, Shared, batched_tensors, found, map_batch, signature
from branchspec.model.attention import LayerState
from branchspec.model.layers import packed_products
from branchspec.model.model import Transformer

log = logging.getLogger("branchspec.compiled")
_LOADED = [0]   # compiled steps this process loaded from the cache folder
MAX_SIGNATURES = 4096   # argument signatures remembered per step as having passed its guards
_NO_AOT_WARNED: list[str] = []   # why ahead-of-time compiling is unavailable, once warned

# What a failed compilation raises (a recompile limit hit, a backend failure): the step then
# runs eagerly, which is always correct, instead of failing the request.
COMPILER_ERRORS = (torch._dynamo.exc.TorchDynamoException,
                   getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", torch._dynamo.exc.TorchDynamoException))


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
    compile and to run than treating every size as symbolic).

    Varying: the batch (dim 0 of every batched input; not in a batch-1 step's own graph,
    `batch=False`), the pools' slot counts, the committed entries of compressed layers (a
    whole page more every page_size entries) and the block tables of their entries (a page
    more at a time). For the drafter also the window rows (a tree's own slots are appended
    to the committed window, more at every step) and, from 2 up, the node count: a tree's
    frontier (topk nodes) and the draft extend (D + 1 nodes) then share one graph."""
    mark = torch._dynamo.maybe_mark_dynamic
    for t in batched_tensors(args) if batch else ():
        mark(t, 0)
    for arg in args:
        if isinstance(arg, Pools):        # the pools' slot counts follow the engine's limits
            for t in arg.storage.values():
                mark(t, 1)
    for state in found(args, AddressInputs):
        for t in state.entries.values():     # the entry numbers addressed (a whole page more at a time)
            mark(t, 0)
    for tables in found(args, BlockTables):
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

    return tuple(type(a)({k: fresh(v) for k, v in a.storage.items()}) if isinstance(a, Shared)
                 else map_batch(a, fresh, every=True) for a in args)


def _guards_to_keep(entries) -> list[bool]:
    """Keep the guards on the step's inputs and on the model's configuration; drop two
    kinds. Shape and stride checks on the weights: a model's weights keep their shapes
    after loading, and checking a few hundred of them cost more than many of the step's
    kernels. Guards on globals (imported modules and functions), which never change within
    a process and which a saved step cannot carry (what `aot_compile` drops by default)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaveable = getattr(CheckFunctionManager, "UNSUPPORTED_SERIALIZATION_GUARD_TYPES", ())
    return [not (e.is_global or e.guard_type in unsaveable
                 or (e.guard_type == "TENSOR_MATCH" and isinstance(e.value, torch.nn.Parameter)))
            for e in entries]


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
    """`global_state()` as of now, recomputed only when the settings changed: asking
    dynamo's own guard object whether anything changed since costs a fraction of a
    microsecond, building the string several."""

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


def tracing_settings():
    """The compiler settings every step is traced under, scoped to the tracing: two
    unrelated varying sizes that happen to be equal (the batch and the drafter's node
    count) must not be assumed equal forever (`use_duck_shape`), or that guard fails
    later and the step recompiles."""
    import torch.fx.experimental._config as fx_config

    return fx_config.patch(use_duck_shape=False)


def report_progress() -> None:
    """Print a line to stderr as each graph starts and ends compiling (each takes a minute
    or two on a few cores), for command-line runs that do not configure logging."""
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def compilations() -> int:
    """Graphs compiled so far in this process, ahead of time or by a fallback (dynamo's
    counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def steps_loaded() -> int:
    """Compiled steps this process loaded from the cache folder instead of compiling."""
    return _LOADED[0]


def _batched(shape_class: str) -> bool:
    """Whether a shape class's batch varies (every class but batch 1's)."""
    return "-batch1" not in shape_class


def _own_code(fn: Callable, name: str) -> Callable:
    """fn with a code object of its own. Dynamo keeps a function's graphs, and counts them
    against its recompile limit, on the code object: every plan's step (`plan_step`) shares
    one, and so would each shape class of a step, so that their graphs would evict each
    other's guards and hit the limit together."""
    code = fn.__code__.replace(co_name=name, co_qualname=name) if hasattr(fn.__code__, "co_qualname") \
        else fn.__code__.replace(co_name=name)
    own = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = fn.__kwdefaults__
    return own


class TracedStep:
    """A step through plain `torch.compile` (where ahead-of-time compiling is unavailable or
    refused), compiled like the ahead-of-time one: one code object per shape class, traced
    at its first call on a copy of that call's arguments with the same sizes marked
    symbolic (`mark_varying_sizes`), under the same settings. Later calls with other
    contexts, batches (in its class) or accept lengths pass its guards and reuse its graph.

    The first call runs the step on the marked copy, which shares the arguments' memory,
    so it is the call itself (a step that writes the pools writes them once)."""

    def __init__(self, fn: Callable, name: str, options: dict, drafter: bool, batch: bool):
        self.compiled = torch.compile(_own_code(fn, name), **options)
        self.name, self.drafter, self.batch = name, drafter, batch
        self.traced = False

    def __call__(self, model: Transformer, *args):
        if self.traced:
            return self.compiled(model, *args)
        example = _example(args)
        mark_varying_sizes(example, self.drafter, batch=self.batch)
        log.info("compiling %s (through torch.compile; a minute or two on a few cores)", self.name)
        t0 = time.perf_counter()
        with tracing_settings():
            out = self.compiled(model, *example)
        log.info("compiled %s in %.0f s", self.name, time.perf_counter() - t0)
        self.traced = True
        return out


class CompiledStep:
    """One compiled step (a target's or the drafter's forward, or a whole function of a
    round), called on canonical inputs.

    Canonical: contiguous, aliasing kept (the compiler guards on strides and on which
    inputs alias each other). Batch 1 is a shape class of its own: the compiler
    specialises a size of 1, and padding batch 1 to 2 instead doubles a verify pass's
    rows where a CPU is compute-bound on them.

    Each shape class (the node count, the drafter's counts from 2 up sharing one; batch 1
    or more) is compiled ahead of time (`aot_compile`) on its first call, and saved under
    the branchspec cache folder, keyed by the model's configuration, dtype, device (with its
    index), the source of the model code, torch, the CPU and the torch settings its guards
    check (`global_state`: the thread count among them); a later process loads it in about
    a second instead of tracing and compiling it again. Set BRANCHSPEC_COMPILE_CACHE=0 to
    neither read nor write it. Where ahead-of-time compiling is unavailable or refused, the
    class compiles through plain `torch.compile` the same way (`TracedStep`; not saved);
    where a saved step's guards still fail, its inputs go to such a step too; and where
    compiling fails altogether (a recompile limit hit, say), the function runs eagerly, with
    one warning: a compiled step is only ever slower than it should be, never the cause of
    a failed request.
    """

    def __init__(self, model: Transformer, fn: Callable, drafter: bool = False, one_shape: bool = False):
        """drafter: the MTP forward (its node counts from 2 up share a graph); one_shape:
        a step whose shapes follow from its function alone (`plan_step`)."""
        self.model, self.fn, self.drafter, self.one_shape = model, fn, drafter, one_shape
        self.steps: dict[tuple[str, str], Callable] = {}   # (shape class, global_state()) -> step
        # Per step (by id: steps are kept for the process), the argument signatures
        # (`signature`) its guards have passed.
        self.passed: dict[int, set[tuple]] = {}
        self.fallbacks: dict[str, TracedStep] = {}   # shape class -> the plain torch.compile step
        self.eager = False          # compiling failed: run `fn` as it is

    def shape_class(self, args: tuple) -> str:
        first = next(t for t in found(args[0], torch.Tensor) if t.dim() > 0)
        single = "-batch1" if first.shape[0] == 1 else ""   # the batch: dim 0 of every tensor
        # A step that writes the pools computes slots in pages of a size it is compiled for.
        tables = next(found(args, BlockTables), None)
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
        sig: list | None = []
        loose: list[torch.Tensor] = []
        signature(args, sig, {}, loose)
        if loose:
            args = map_batch(args, canonical)
            sig = None
        if self.eager:
            return self.fn(self.model, *args)
        cls = self.shape_class(args)
        state = settings_now()   # settings changed since (threads, say): that step's own graph
        step = self.steps.get((cls, state)) or self._prepare(cls, state, args)
        try:
            return self._call(step, args, sig)
        except COMPILER_ERRORS as e:       # a plain torch.compile step that cannot recompile
            return self._run_eagerly(e, args)
        except RuntimeError as e:
            if "GuardManager check failed" not in str(e):
                raise
            return self._recompiled(cls, args, str(e))

    def _call(self, step: Callable, args: tuple, sig: list | None = None):
        """Run a step, checking a saved step's guards only for argument signatures they have
        not passed yet.

        A saved step checks its guards before every call: the inputs' shapes, strides,
        dtypes and aliasing, the model's configuration; right after a graph has streamed
        the weights through the caches that took a tenth of a small step. Guards are a
        function of the arguments' signature (`signature`), the model (fixed for the step)
        and torch's settings (part of the step's key, `global_state`), so a signature that
        passed once passes again. A new signature goes through the guards as before; one
        they refuse raises as before (then `_recompiled`). Steps without a separate check
        (`TracedStep`) run as they are. `sig`: the arguments' own, when the caller took it
        already."""
        run, check = getattr(step, "fn", None), getattr(step, "guard_check", None)
        if run is None or check is None:
            return step(self.model, *args)
        if sig is None:
            sig = []
            signature(args, sig, {})
        key = tuple(sig)
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
        """Inputs a saved step's guards refuse: the class's plain torch.compile step for
        them; where compiling fails (its recompile limit hit, say), `fn` eagerly from now on."""
        if cls not in self.fallbacks:
            warnings.warn(f"{self.fn.__name__}: inputs its {cls} step was not compiled for; compiling "
                          f"them separately ({why[:300]})", stacklevel=3)
        try:
            return self._fallback(cls)(self.model, *args)
        except COMPILER_ERRORS as e:
            return self._run_eagerly(e, args)

    def _run_eagerly(self, error: Exception, args: tuple):
        warnings.warn(f"{self.fn.__name__}: compiling failed ({type(error).__name__}: {str(error)[:200]}); "
                      "running this step eagerly from now on (same results, slower)", stacklevel=4)
        self.eager = True
        return self.fn(self.model, *args)

    def _inductor_options(self) -> dict:
        """On a CPU the generated wrapper is C++ (`cpp_wrapper`): a Python wrapper calls each
        of a step's few hundred kernels from Python. On a GPU the engine captures its steps
        as CUDA graphs itself (`execution/graphs.py`), so inductor's own cudagraph trees stay
        off: they refuse steps that write their inputs (the pools) and manage a memory pool
        of their own."""
        if self.model.embed.weight.device.type == "cpu":
            return {"cpp_wrapper": True}
        return {"triton.cudagraphs": False}

    def _options(self) -> dict:
        return dict(dynamic=False, fullgraph=True,
                    options={"guard_filter_fn": _guards_to_keep, **self._inductor_options()})

    def _fallback(self, cls: str) -> TracedStep:
        if cls not in self.fallbacks:
            name = f"{self.fn.__name__}-{cls}".replace("-", "_").replace("+", "plus")
            self.fallbacks[cls] = TracedStep(self.fn, name, self._options(), self.drafter, batch=_batched(cls))
        return self.fallbacks[cls]

    def _prepare(self, cls: str, state: str, args: tuple) -> Callable:
        """Load the shape class's compiled step for these torch settings (`global_state`)
        from the cache folder, else compile it now (then save it); where ahead-of-time
        compiling is unavailable or refused, the class's plain torch.compile step
        (`TracedStep`), traced at its first call."""

        use_cache = os.environ.get("BRANCHSPEC_COMPILE_CACHE", "1") != "0"
        path = cache_dir() / "compiled" / f"{self.fn.__name__}-{cls}-{self.key(cls, state)}.bin"
        step = None
        if use_cache and path.exists():
            try:
                with open(path, "rb") as f:
                    step = torch.compiler.load_compiled_function(f)
                _LOADED[0] += 1
            except Exception:   # noqa: BLE001 - unreadable, from another build, or no loader: compile anew
                step = None
        if step is None:
            step = self._compile_ahead(cls, args)
            if step is None:
                step = self._fallback(cls)
            elif use_cache:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    # (under a name of this process's own: another one may be saving the same step)
                    write_atomically(path, lambda tmp: step.save_compiled_function(str(tmp)))
                except Exception:   # noqa: BLE001 - an unwritable cache only costs the next start
                    pass
        self.steps[(cls, state)] = step
        return step

    def _compile_ahead(self, cls: str, args: tuple) -> Callable | None:
        """The class's step compiled ahead of time on a marked copy of `args`, or None where
        this torch cannot (no `aot_compile`: warned once per process) or refuses (warned)."""
        compiled = torch.compile(self.fn, **self._options())
        if not hasattr(compiled, "aot_compile"):
            if not _NO_AOT_WARNED:
                _NO_AOT_WARNED.append(torch.__version__)
                warnings.warn(f"torch {torch.__version__} cannot compile ahead of time; every step compiles through "
                              "torch.compile instead (the same graphs, compiled again by each process)", stacklevel=4)
            return None
        log.info("compiling %s for %s (once per machine; a minute or two on a few cores)", self.fn.__name__, cls)
        t0 = time.perf_counter()
        example = _example(args)
        mark_varying_sizes(example, self.drafter, batch=_batched(cls))
        try:
            with tracing_settings():
                step = compiled.aot_compile(((self.model, *example), {}))
        except Exception as e:   # noqa: BLE001 - ahead-of-time compiling refused: plain torch.compile
            warnings.warn(f"{self.fn.__name__} could not be compiled ahead of time ({type(e).__name__}: "
                          f"{str(e)[:200]}); using plain torch.compile", stacklevel=4)
            return None
        log.info("compiled %s for %s in %.0f s", self.fn.__name__, cls, time.perf_counter() - t0)
        return step
