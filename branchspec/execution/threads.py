"""How many threads MKL multiplies with in a step over a single row.

The products the model does not pack (`model/matmul.py`: the weights under 2^18
elements) run through MKL, which splits even a one-row product, a matrix-vector product,
over every thread; the calling thread then spends most of it waiting at OpenMP's barrier
for the others (docs/fast-path.md, "Where a compiled batch-1 step's time goes"). So a
plain decode step at batch 1 runs MKL on one thread (`one_row_products`), through MKL's
thread-local setting: the packed products (oneDNN), the compiled kernels and every other
step keep all their threads. Measured on 2 vCPUs of an AMD EPYC, compiled, the two
settings called in turn: a batch-1 plain step took 1-10% less with MKL on one thread, in
each of four runs (docs/fast-path.md, "MKL on one thread for one row"); over the 6-8 rows
of a verify pass, or a drafter's frontier of two, two threads were faster, and at batch 2
and 4 the two were level or two faster, so only single-row steps switch.

Where torch was built without MKL, or its thread-local setting cannot be found, nothing
changes.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator
from pathlib import Path

import torch

# Steps multiplying at most this many rows per product run MKL on one thread (0: none do;
# a benchmark sets it to compare).
ONE_THREAD_MAX_ROWS = 1


@functools.lru_cache(maxsize=None)
def _mkl(name: str, argtypes: tuple = ()):
    """One of MKL's C functions from the library torch links MKL into, None where there is
    none."""
    if not torch.backends.mkl.is_available():
        return None
    for path in sorted((Path(torch.__file__).parent / "lib").glob("*torch_cpu*")):
        try:
            fn = getattr(ctypes.CDLL(str(path)), name)
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        return fn
    return None


def _set_local_threads():
    """`MKL_Set_Num_Threads_Local(int) -> int`: the calling thread's count (by value: its C
    interface), the previous one back (0: the process-wide one)."""
    return _mkl("MKL_Set_Num_Threads_Local", (ctypes.c_int,))


def mkl_local_threads_available() -> bool:
    return _set_local_threads() is not None


def mkl_max_threads() -> int | None:
    """How many threads the calling thread's MKL products would use now (None: no MKL)."""
    fn = _mkl("MKL_Get_Max_Threads")
    return None if fn is None else fn()


@contextlib.contextmanager
def one_row_products(rows: int, device: torch.device | str = "cpu") -> Iterator[None]:
    """Within the block, the calling thread's MKL products run on one thread when the step
    multiplies `rows` <= ONE_THREAD_MAX_ROWS rows on a CPU; else nothing changes."""
    fn = _set_local_threads() if rows <= ONE_THREAD_MAX_ROWS and torch.device(device).type == "cpu" else None
    if fn is None:
        yield
        return
    before = fn(1)
    try:
        yield
    finally:
        fn(before)
