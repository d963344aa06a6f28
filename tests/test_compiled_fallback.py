"""The compiled path on a torch without ahead-of-time compiling (torch 2.11 has no
`aot_compile`): every step compiles through plain `torch.compile`, with the same symbolic
sizes, so that after warm-up nothing recompiles and nothing falls back to eager, whatever
the batch, the prompt lengths or the accept lengths; and the tokens are the eager
engine's. Here ahead-of-time compiling is switched off by wrapping torch.compile's result
in an object without `aot_compile`, as such a torch returns it.

A two-layer model (C4 with its indexer, then C128) keeps the compiling to about a minute
and a half on two cores."""

from __future__ import annotations

import warnings

import pytest
import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.execution import compiled_step
from branchspec.execution.compiled_step import compilations
from branchspec.model.init import random_model

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
PROMPTS = [[0] + [3 + (5 * j + 3 * i) % 60 for j in range(7 + 31 * i)] for i in range(5)]
pytestmark = pytest.mark.compiles     # run first: tests/conftest.py


class _NoAot:
    """torch.compile's result as a torch without ahead-of-time compiling returns it."""

    def __init__(self, compiled):
        self._compiled = compiled

    def __call__(self, *args, **kwargs):
        return self._compiled(*args, **kwargs)


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    """(eager, compiled without aot_compile, warm-up reports); compiled from empty caches."""
    ckpt = save_checkpoint(random_model(tiny_config(num_layers=2, compress_ratios=(4, 128)), seed=1, std=0.3),
                           tmp_path_factory.mktemp("two_layers"))
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    compile_ = torch.compile
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "compile", lambda *a, **k: _NoAot(compile_(*a, **k)))
        # said once a process: forget an earlier test's saying it (on a torch that has no
        # aot_compile of its own, any compiled test before this one does)
        mp.setattr(compiled_step, "_NO_AOT_WARNED", [])
        mp.setenv("BRANCHSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        eager = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0)
        fast = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0, compile=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warm = {"plain": fast.warmup(None, batch_sizes=(1,), sampling=("greedy",), progress=False),
                    "tree": fast.warmup(TREE, batch_sizes=(2,), sampling=("greedy",), progress=False)}
        warm["warnings"] = [str(w.message) for w in caught]
        yield eager, fast, warm
    torch.set_num_threads(n)


def test_warmup_compiles_through_torch_compile(llms):
    _, fast, warm = llms
    # Plain decoding at batch 1 (greedy); the greedy tree at 2 or more: the drafter at the
    # root, its growth, the verify pass and the extend. (The sampled graphs compile the
    # same way; tests/test_compiled.py runs them.)
    assert [warm[k]["graphs"] for k in ("plain", "tree")] == [1, 4]
    assert warm["tree"]["loaded"] == 0
    said = [w for w in warm["warnings"] if "cannot compile ahead of time" in w]
    assert len(said) == 1, warm["warnings"]          # said once, not per step
    assert not any("eagerly" in w or "not compiled for" in w for w in warm["warnings"]), warm["warnings"]


def test_nothing_recompiles_or_runs_eagerly_after_warmup(llms):
    """Several batch sizes and prompt lengths (a C128 block completes in some rounds and
    not in others): greedy trees at batch 2, 3 and 5 over contexts of several lengths (a
    batch's requests alike, so that they finish in the same round and the tree stays in
    its warmed batch class), plain decoding at batch 1 over every prompt. No compilation,
    no warning, no step left to eager, and the eager engine's tokens."""
    eager, fast, _ = llms
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = compilations()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs = [([PROMPTS[i]] * batch, TREE) for batch, i in ((2, 1), (3, 3), (5, 4), (2, 0))]
        runs += [([prompt], None) for prompt in PROMPTS]
        for prompts, spec in runs:
            ours = [o.token_ids for o in fast.generate(prompts, params, spec=spec)]
            assert ours == [o.token_ids for o in eager.generate(prompts, params, spec=spec)], (len(prompts), spec)
    assert compilations() == before, "a step recompiled after warm-up"
    assert not [str(w.message) for w in caught]
    steps = fast.engine.executor.steps
    assert not any(s.eager for s in (steps.decode, steps.drafter, steps.decode_draw, *steps.plans.values()))
    assert fast.engine.cache.tables == {}
