"""Projections that read the same input run as one stacked matmul at inference, and the
dense MoE's down projections as one joined matmul; the separate weights stay the
parameters. The joined copies follow the weights (in-place changes, dtype moves, deep
copies), and training never uses them. Both expert dispatches: the dense one (the
compiled path's) has both kinds of copy."""

from __future__ import annotations

import copy

import pytest
import torch

from branchspec.config import v4_mini_v2_config
from branchspec.model.init import random_model
from branchspec.model.layers import build_stacked
from branchspec.model.metadata import chain_meta


@pytest.fixture(scope="module", params=["grouped", "dense"])
def model(request):
    return random_model(v4_mini_v2_config(), seed=0, dtype=torch.float64, expert_dispatch=request.param)


def forward(model, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.cfg.vocab_size, (2, 40), generator=gen)
    meta = chain_meta(torch.zeros(2, dtype=torch.long), 40, model.cfg.compressed_kinds)
    return model(ids, meta).logits


def test_stacked_equals_separate(model):
    separate = forward(model)                  # autograd on: the separate matmuls
    with torch.no_grad():
        stacked = forward(model)
    torch.testing.assert_close(stacked, separate.detach(), atol=1e-12, rtol=0)


def test_stacked_copy_follows_in_place_changes(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        before = forward(m)
        m.layers[1].attn.indexer.weights_proj.weight.mul_(3.0)   # one weight of a stacked set
        m.layers[2].ffn.gate.weight.add_(0.5)
        m.layers[3].ffn.experts.w2.mul_(2.0)                      # joined with the shared expert's (dense)
        after = forward(m)
    assert not torch.equal(before, after)
    torch.testing.assert_close(after, forward(m).detach(), atol=1e-12, rtol=0)


def test_deep_copy_reads_its_own_weights(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        reference = forward(model)
        for p in m.parameters():
            p.mul_(1.01)
        assert not torch.equal(forward(m), reference)
        assert torch.equal(forward(model), reference)


def test_training_reaches_every_weight(model):
    m = copy.deepcopy(model)
    with torch.no_grad():
        forward(m)                             # a stacked copy exists
    build_stacked(m)                           # even frozen for compiled inference
    forward(m).square().mean().backward()
    # (40 tokens: the indexer keeps every C4 entry, so its own weights get no gradient)
    attn, ffn = m.layers[1].attn, m.layers[1].ffn
    for w in (attn.wq_a.weight, attn.wkv.weight, attn.compressor.wkv.weight, attn.compressor.wgate.weight,
              ffn.gate.weight, ffn.shared_experts.w1.weight, ffn.shared_experts.w3.weight, ffn.shared_experts.w2.weight,
              ffn.experts.w2):
        assert w.grad is not None and w.grad.abs().sum() > 0
