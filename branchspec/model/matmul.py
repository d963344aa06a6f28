"""Products with a packed weight: `linear(x, w, packed)` = x @ w.T.

Unpacked (`packed=False`), and wherever packing does not apply (float64, a GPU, autograd
on), it is `F.linear`, which on a CPU in float32 goes to MKL. Packed, it runs through
oneDNN on a copy of the weight reordered once into oneDNN's own blocked layout. On the
CPUs measured, MKL's products over a few rows (a verify pass's D nodes, a drafter's
frontier) cost several times one row's, and oneDNN's packed products take a fraction of
MKL's time for the large weights (an LM head, the stacked input projections), one row
included; for small weights oneDNN's fixed cost per call is larger than MKL's whole
product (docs/fast-path.md, "Packed products"). So only weights of at least
`PACK_MIN_ELEMENTS` are packed (`layers.pack_products`).

A compiled step takes the model's weights as inputs, and a packed weight is an opaque
tensor that no compiled graph can take, so the packed product is an operator of its own
(`branchspec::linear`) that a graph calls with the dense weight. The operator finds that
weight's packed copy in a table keyed by the weight's memory, packing it on first use, and
again if the weight was changed in place or its memory freed and reused.

The operator's CPU kernel is Python (`_packed_linear`), or the same kernel in C++
(`packed_linear.cpp`, built once per machine and torch version with the C++ compiler a
compiled step needs anyway: `native_kernel`). A compiled step calls the operator through
the dispatcher from its C++ wrapper, so with the Python kernel every call crossed into
Python and back: 15-20 µs a call on 2 cores, about a dozen calls a batch-1 decode step.
The compiled path puts the C++ kernel in; a graph runs whichever is in place.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef

PACKED_DTYPES = (torch.float32, torch.bfloat16)
# Weights this large or larger are packed (`layers.pack_products`): on 2 cores a one-row
# product with a [256, 256] weight took 15-35 µs through oneDNN against 4-6 through MKL,
# with a [2564, 256] one 40 against 70, and at 8 rows every weight from [256, 256] up was
# faster through oneDNN.
PACK_MIN_ELEMENTS = 1 << 18


def packed_products_available() -> bool:
    """Whether this torch can run packed products (it was built with oneDNN, on)."""
    return torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled


def weight_version(w: torch.Tensor) -> int | None:
    """w's version counter, which every in-place change bumps; None for an inference tensor
    (made under `torch.inference_mode`), which keeps none, so that a copy of it is taken as
    current for as long as its memory holds it."""
    return None if w.is_inference() else w._version


class _Packed:
    """One weight's packed copy, and what tells that it is still that weight's."""

    __slots__ = ("storage", "version", "shape", "stride", "offset", "packed")

    def __init__(self, w: torch.Tensor):
        self.storage = StorageWeakRef(w.untyped_storage())
        self.version = weight_version(w)
        self.shape, self.stride, self.offset = w.shape, w.stride(), w.storage_offset()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w.contiguous())

    def holds(self, w: torch.Tensor) -> bool:
        return (not self.storage.expired() and self.version == weight_version(w) and self.shape == w.shape
                and self.stride == w.stride() and self.offset == w.storage_offset())


# w.data_ptr() -> its packed copy. Process-wide, as the weights it mirrors are: a compiled
# step calls the operator with nothing but tensors. An entry whose weight is gone is
# replaced when another weight comes to lie at its address.
_PACKED: dict[int, _Packed] = {}


def packed_weight(w: torch.Tensor) -> torch.Tensor:
    """w's packed copy (packed now if it has none yet, or its copy is stale)."""
    entry = _PACKED.get(w.data_ptr())
    if entry is None or not entry.holds(w):
        for ptr in [p for p, e in _PACKED.items() if e.storage.expired()]:   # weights since freed
            del _PACKED[ptr]
        entry = _PACKED[w.data_ptr()] = _Packed(w)
    return entry.packed


def _packed_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in] @ w.T through oneDNN with w's packed copy."""
    flat = x.reshape(-1, x.shape[-1])                              # [M, in]
    out = torch.ops.mkldnn._linear_pointwise(flat.contiguous(), packed_weight(w), None, "none", [], "")
    return out.view(*x.shape[:-1], w.shape[0])


_LIB = torch.library.Library("branchspec", "DEF")
_LIB.define("linear(Tensor x, Tensor w) -> Tensor")


def _python_kernel() -> torch.library.Library:
    """Register `_packed_linear` as the operator's CPU kernel; the returned handle's
    `_destroy()` takes it out again."""
    lib = torch.library.Library("branchspec", "IMPL")
    lib.impl("linear", _packed_linear, "CPU")
    return lib


class _Kernels:
    """Which of the operator's CPU kernels is in place, and what became of the C++ one."""

    def __init__(self) -> None:
        self.python: torch.library.Library | None = _python_kernel()   # its registration, while in place
        self.native = False              # whether the C++ kernel is in place
        self.library: Path | None = None  # the C++ kernel's shared library, once loaded
        self.failed: str | None = None   # why it could not be built or loaded (then not tried again)


_KERNEL = _Kernels()
NATIVE_SOURCE = Path(__file__).with_name("packed_linear.cpp")


def _native_library() -> Path:
    """The C++ kernel's shared library, compiled into the cache folder on first use (keyed
    by its source, torch's version and the compiler, so any of them changing builds anew)."""
    from branchspec.atomic import write_atomically
    from branchspec.disk_cache import cache_dir
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "g++")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    key = hashlib.sha256(b"\0".join([NATIVE_SOURCE.read_bytes(), torch.__version__.encode(), compiler.encode(),
                                      abi.encode()])).hexdigest()[:20]
    path = cache_dir() / "native" / f"packed_linear-{key}.so"
    if path.is_file():
        return path
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C++ compiler {compiler!r} found (set $CXX to one)")
    path.parent.mkdir(parents=True, exist_ok=True)

    def build(out: Path) -> None:
        includes = [f"-I{p}" for p in cpp_extension.include_paths()]
        libraries = [f"-L{p}" for p in cpp_extension.library_paths()]
        cmd = [compiler, "-O2", "-std=c++20", "-shared", "-fPIC", abi, *includes, str(NATIVE_SOURCE), *libraries,
               "-lc10", "-ltorch_cpu", "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:2])} ... failed ({done.returncode}): {done.stderr[-2000:]}")

    write_atomically(path, build)
    return path


def native_kernel(on: bool = True) -> bool:
    """Put the C++ kernel in place of the Python one as `branchspec::linear`'s CPU kernel
    (`on`), or the Python one back (not `on`); process-wide, for eager and compiled calls
    alike (the products are the same). Returns whether the C++ kernel is in place: where
    it cannot be built or loaded (no C++ compiler, say) the Python kernel stays, with one
    warning saying why. Not meant to race running steps: the engine calls it while it is
    being built."""
    if on == _KERNEL.native:
        return on
    if on:
        if _KERNEL.library is None:
            if _KERNEL.failed is not None:
                return False
            try:
                path = _native_library()
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    torch.ops.load_library(str(path))
                _KERNEL.library = path
            except Exception as e:          # a missing or failing compiler: the Python kernel serves
                _KERNEL.failed = str(e)
                warnings.warn(f"packed products keep their Python kernel: the C++ one could not be built ({e})",
                              stacklevel=2)
                return False
        _KERNEL.python._destroy()
        _KERNEL.python = None
        torch.ops.branchspec_native.use(True)
    else:
        torch.ops.branchspec_native.use(False)
        _KERNEL.python = _python_kernel()
    _KERNEL.native = on
    return on


@torch.library.register_fake("branchspec::linear")
def _linear_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """x [..., in] @ w.T with w [out, in] -> [..., out]; through the packed operator when
    `packed` and it applies (a CPU tensor of a packed dtype, autograd off)."""
    if (packed and x.device.type == "cpu" and x.dtype in PACKED_DTYPES and w.dtype == x.dtype
            and not torch.is_grad_enabled()):
        return torch.ops.branchspec.linear(x, w)
    return F.linear(x, w)
