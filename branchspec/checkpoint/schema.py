"""The names and shapes of branchspec's state_dict for a config: what a checkpoint of any
format must give, and what an export must cover.

They are the model's own, read from a ``Transformer`` built on the meta device (shapes
and dtypes only: no memory, no init, no random draws), so they cannot drift from the
modules' constructors.
"""

from __future__ import annotations

import torch

from branchspec.config import ModelConfig
from branchspec.model.model import Transformer


def _meta_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The state_dict of a model of ``cfg`` on the meta device. The model is local and
    dropped on return: no meta tensor is left behind (``Transformer.__init__`` fills no
    module-level cache)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return model.state_dict()


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The names and shapes of branchspec's state_dict for ``cfg``, in its order.

    Integer tensors (``*.gate.tid2eid``) are told by ``is_integer_tensor``.
    """
    return {k: tuple(v.shape) for k, v in _meta_state(cfg).items()}


def expected_tensors(cfg: ModelConfig, float_dtype: torch.dtype = torch.float32
                     ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Each state_dict name's (shape, dtype): floating tensors in ``float_dtype``, integer
    ones (the hash-routing table) in the model's own integer dtype (int64)."""
    return {k: (tuple(v.shape), float_dtype if v.is_floating_point() else v.dtype)
            for k, v in _meta_state(cfg).items()}


def is_integer_tensor(name: str) -> bool:
    """Whether branchspec keeps this tensor as integers (the hash routing table)."""
    return name.endswith(".gate.tid2eid")
