"""The floating dtypes branchspec builds, loads and stores models in, by name."""

from __future__ import annotations

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """The torch dtype for a name or dtype; ValueError if unsupported, TypeError if neither."""
    if not isinstance(dtype, (str, torch.dtype)):
        raise TypeError(f"dtype must be a str or torch.dtype (one of {sorted(DTYPES)}), "
                        f"got {type(dtype).__name__} {dtype!r}")
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use one of {sorted(DTYPES)}")
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]
