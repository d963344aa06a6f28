"""The steps the fast paths run: plain functions of the model and tensors.

The model is an argument, so one compiled step or one captured graph serves any weights
of the same configuration. Each step does all of its work on the device, with no value
read back to the host and no shape that follows the data: what the compiler traces into
one graph and what a CUDA graph captures. Whole functions of a round (a draft tree's
growth, the verify pass, the draft extend) become steps per plan (`plan_step`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from branchspec.cache.paged import AddressInputs, locate, read_states, write_nodes
from branchspec.execution.arguments import Pools, Shared
from branchspec.model.attention import LayerState
from branchspec.model.metadata import ForwardMeta, chain_meta
from branchspec.model.model import ForwardOutput, Transformer
from branchspec.sampling import NodeDraws, step_tokens


def decode_step(model: Transformer, input_ids: torch.Tensor, pools: Pools, state: AddressInputs) -> ForwardOutput:
    """Plain decoding's step, one node per sequence (input_ids [B, 1]) after state.lengths
    [B] tokens, with all its work in its graph: the committed state's addresses (`locate`),
    the reads from the pools (where they fuse into the kernels that consume them instead of
    being copied out first), its metadata (a function of the committed lengths alone), and
    the commit: its one node per sequence is always kept, so the step writes its state into
    the pools (`write_nodes`). Returns the output, scratch dropped."""
    meta = chain_meta(state.lengths, 1, model.cfg.compressed_kinds, max_new=1, static=True)
    out = model.forward(input_ids, meta, read_states(model.cfg, pools.storage, locate(model.cfg, state)))
    write_nodes(model.cfg, pools.storage, state.tables, meta, out.scratch, meta.valid)
    return dataclasses.replace(out, scratch=[])


def decode_draw_step(model: Transformer, input_ids: torch.Tensor, pools: Pools, state: AddressInputs,
                     draws: NodeDraws) -> tuple[ForwardOutput, torch.Tensor]:
    """`decode_step` and each sequence's next token [B, 1] in the same graph: the argmax,
    or for the rows sampled at their temperature alone a seeded draw (`sampling.step_tokens`)."""
    out = decode_step(model, input_ids, pools, state)
    return out, step_tokens(out.logits, draws)


def drafter_step(model: Transformer, input_ids: torch.Tensor, prev_hidden: torch.Tensor, meta: ForwardMeta,
                 state: LayerState) -> ForwardOutput:
    """The MTP block's forward, without its LM head (see `Transformer.mtp_forward`)."""
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
