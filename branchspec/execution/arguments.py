"""A step's arguments, walked.

A step (`execution/steps.py`) takes a model and a few arguments: dataclasses, dicts, lists
and tuples of tensors whose dim 0 is the request (*batched*), tensors every request
shares (`Shared`), and the paged state's storage (`Pools`). The fast paths walk them to
make them canonical, to take what a compiled step's guards check (`signature`), and to
copy them into a captured graph's static buffers, always in the same order.

A dataclass field whose tensors are not batched says so in its metadata
(`field(metadata={"batched": False})`): the entry numbers a batch addresses, say, are one
range for every request.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch

class Shared:
    """Tensors passed whole into a step, the same for every request (a reduced vocabulary's
    head rows, say): not batched, so canonicalising and padding leave them alone."""

    def __init__(self, storage: dict[str, torch.Tensor]):
        self.storage = storage


class Pools(Shared):
    """The paged state's storage ({kind: [layers of kind, slots, width]}) passed whole into
    a step, which reads it at the batch's addresses inside its graph (and may write it)."""


_FIELDS: dict[type, tuple[tuple[str, bool], ...] | None] = {}


def fields(cls: type) -> tuple[tuple[str, bool], ...] | None:
    """A dataclass's init fields as (name, batched) pairs; None for anything else."""
    if cls not in _FIELDS:
        _FIELDS[cls] = (tuple((f.name, f.metadata.get("batched", True)) for f in dataclasses.fields(cls) if f.init)
                        if dataclasses.is_dataclass(cls) else None)
    return _FIELDS[cls]


def map_batch(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor], every: bool = False) -> Any:
    """Apply fn to every batched tensor inside obj (dataclasses, dicts, lists, tuples; with
    `every`, to the unbatched fields' tensors too, never to a `Shared`'s). A container none
    of whose tensors fn replaced is returned as it is (a step's arguments are mapped on
    every call, and rebuilding them cost more than some steps' kernels)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj) if obj.dim() > 0 else obj
    if isinstance(obj, (list, tuple)):
        new = [map_batch(v, fn, every) for v in obj]
        return obj if all(a is b for a, b in zip(new, obj)) else type(obj)(new)
    if isinstance(obj, dict):
        new = {k: map_batch(v, fn, every) for k, v in obj.items()}
        return obj if all(new[k] is v for k, v in obj.items()) else new
    names = fields(type(obj))
    if names is None:
        return obj
    new = {n: map_batch(getattr(obj, n), fn, every) if batched or every else getattr(obj, n) for n, batched in names}
    return obj if all(new[n] is getattr(obj, n) for n, _ in names) else dataclasses.replace(obj, **new)


def batched_tensors(obj: Any) -> list[torch.Tensor]:
    """Every batched tensor inside obj, in `map_batch`'s order."""
    found: list[torch.Tensor] = []
    map_batch(obj, lambda t: found.append(t) or t)
    return found


def found(obj: Any, cls: type) -> Iterator[Any]:
    """Every instance of cls inside obj (dataclasses, dicts, lists, tuples)."""
    if isinstance(obj, cls):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from found(v, cls)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from found(v, cls)
    elif not isinstance(obj, torch.Tensor) and (names := fields(type(obj))) is not None:
        for n, _ in names:
            yield from found(getattr(obj, n), cls)


def batch_size(args: tuple) -> int:
    """The batch of a step's arguments: dim 0 of the first batched tensor of the first one."""
    return next(t for t in found(args[0], torch.Tensor) if t.dim() > 0).shape[0]


def signature(obj: Any, out: list, order: dict[int, int], loose: list | None = None) -> None:
    """Append to `out` everything about obj that a compiled step's guards can check and a
    call can change: each tensor's shape, strides, dtype and device, with which earlier
    argument it is (`order`: object id -> first position, so that one tensor passed twice
    differs from two tensors), each other leaf's type and value, and the containers'
    structure. Tensor values are not part of it: guards never read them. With `loose`, also
    append to it every batched tensor that is not contiguous (what `CompiledStep` would
    replace by a contiguous copy; not the tensors passed whole, in a `Shared`), in the same
    walk."""
    if isinstance(obj, torch.Tensor):
        out.append((order.setdefault(id(obj), len(order)), obj.shape, obj.stride(), obj.dtype, obj.device))
        if loose is not None and obj.dim() > 0 and not obj.is_contiguous():
            loose.append(obj)
    elif isinstance(obj, (list, tuple)):
        out.append((type(obj), len(obj)))
        for v in obj:
            signature(v, out, order, loose)
    elif isinstance(obj, dict):
        out.append((dict, tuple(obj)))
        for v in obj.values():
            signature(v, out, order, loose)
    elif isinstance(obj, Shared):
        out.append(type(obj))
        signature(obj.storage, out, order)
    elif (names := fields(type(obj))) is not None:
        out.append(type(obj))
        for n, batched in names:
            signature(getattr(obj, n), out, order, loose if batched else None)
    else:
        out.append((type(obj), obj))
