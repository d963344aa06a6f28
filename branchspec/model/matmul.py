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
"""

from __future__ import annotations

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
_LIB.impl("linear", _packed_linear, "CPU")


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
