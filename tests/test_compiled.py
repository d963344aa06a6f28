"""The compiled fast path gives the same greedy tokens as eager, on a small grid, and
compiles nothing after its warm-up: a growing context, new requests, other batch sizes and
other accept lengths reuse the warm-up's graphs. A second LLM loads the saved steps
instead of compiling them.

Compiling takes tens of seconds per graph on two cores, so one compiled LLM serves the
whole module (with a cache folder of its own, so it compiles from scratch); eager stays
the reference (and the default everywhere else)."""

from __future__ import annotations

import pytest
import torch

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.checkpoint import save_checkpoint
from branchspec.config import tiny_config
from branchspec.execution.compiled_step import compilations, steps_loaded
from branchspec.model.init import random_model

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
CHAIN = SpecConfig.chain(6)
CALIBRATED = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, selection="calibrated")
PROMPTS = [[0] + [3 + (7 * j + i) % 60 for j in range(20 + 9 * i)] for i in range(5)]
# Saving compiled steps, loading them and checking their guards apart need ahead-of-time
# compiling, which torch 2.11 lacks (there every step compiles through torch.compile:
# tests/test_compiled_fallback.py).
needs_aot = pytest.mark.skipif(not hasattr(torch.compile(lambda x: x), "aot_compile"),
                               reason="this torch cannot compile ahead of time")
pytestmark = pytest.mark.compiles     # run first: tests/conftest.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Three layers, one of each kind (window only, C4 with its indexer, C128): a fourth
    adds nothing the graphs do differently, only compiling time."""
    cfg = tiny_config(num_layers=3, compress_ratios=(0, 4, 128))
    return save_checkpoint(random_model(cfg, seed=0, std=0.3), tmp_path_factory.mktemp("tiny_c"))


@pytest.fixture(scope="module")
def llms(ckpt, tmp_path_factory):
    """(eager, compiled, warm-up report); both LLMs seeded alike."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRANCHSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        eager = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0)
        fast = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0, compile=True)
        loaded = steps_loaded()
        greedy = ("greedy",)
        warm = {"tree": fast.warmup(TREE, batch_sizes=(1, 2)),
                "chain": fast.warmup(CHAIN, batch_sizes=(1, 2), sampling=greedy),
                "calibrated": fast.warmup(CALIBRATED, batch_sizes=(1, 2), sampling=greedy),
                "plain": fast.warmup(None, batch_sizes=(1, 2)), "loaded": steps_loaded() - loaded}
        yield eager, fast, warm
    torch.set_num_threads(n)


def test_warmup_compiles_a_few_graphs(llms):
    _, _, warm = llms
    # A configuration compiles what it runs and nothing else, once at batch 1 and once for
    # any larger batch. The tree: the target at D nodes (verify), the drafter at one node
    # (first root), its growth and its draft extend (D + 1 nodes, the path's commit in the
    # same graph); and for requests sampled at their temperature alone, the verify pass
    # that draws their tokens in its graph. The chain of the same D, and the calibrated tree
    # of the same shape, warmed for greedy requests, then need only their own growth; plain
    # decoding, the target at one node (its commit in the same graph), and the same step
    # drawing its tokens.
    assert warm["tree"]["graphs"] == 2 * 5
    assert warm["chain"]["graphs"] == 2 * 1
    assert warm["calibrated"]["graphs"] == 2 * 1
    assert warm["plain"]["graphs"] == 2 * 2
    assert warm["loaded"] == 0, "the module's cache folder starts empty"


@needs_aot
def test_a_second_llm_loads_the_compiled_steps(llms, ckpt):
    eager, fast, _ = llms
    before, loaded = compilations(), steps_loaded()
    again = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0, compile=True)
    again.warmup(TREE, batch_sizes=(1,))
    assert steps_loaded() - loaded == 5
    assert compilations() == before
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ours = [o.token_ids for o in again.generate(PROMPTS[:3], params, spec=TREE)]
    assert ours == [o.token_ids for o in eager.generate(PROMPTS[:3], params, spec=TREE)]


@pytest.mark.parametrize("spec", [None, TREE, CHAIN, CALIBRATED], ids=["plain", "tree", "chain", "calibrated"])
@pytest.mark.parametrize("batch", [1, 5])
def test_compiled_greedy_equals_eager_without_recompiling(llms, spec, batch):
    eager, fast, _ = llms
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = compilations()
    ours = [o.token_ids for o in fast.generate(PROMPTS[:batch], params, spec=spec)]
    ref = [o.token_ids for o in eager.generate(PROMPTS[:batch], params, spec=spec)]
    assert ours == ref
    assert compilations() == before, "a compiled step recompiled after warm-up"
    assert fast.engine.cache.tables == {}


@needs_aot
def test_guards_run_once_per_argument_signature(llms, monkeypatch):
    """After warm-up, a compiled step checks its guards only for argument signatures it
    has not passed yet: over a request, most calls skip them, the tokens stay the eager
    engine's, and nothing recompiles."""
    from torch._dynamo.aot_compile import AOTCompiledFunction

    from branchspec.execution.compiled_step import CompiledStep

    eager, fast, _ = llms
    counts = {"calls": 0, "checks": 0}
    call, check = CompiledStep._call, AOTCompiledFunction.guard_check

    def counted_call(self, step, args, signature=None):
        counts["calls"] += 1
        return call(self, step, args, signature)

    def counted_check(self, *args, **kwargs):
        counts["checks"] += 1
        return check(self, *args, **kwargs)

    monkeypatch.setattr(CompiledStep, "_call", counted_call)
    monkeypatch.setattr(AOTCompiledFunction, "guard_check", counted_check)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    before = compilations()
    for spec in (TREE, None):
        ours = [o.token_ids for o in fast.generate(PROMPTS[3:5], params, spec=spec)]
        assert ours == [o.token_ids for o in eager.generate(PROMPTS[3:5], params, spec=spec)]
    assert compilations() == before
    assert counts["calls"] > 20 and counts["checks"] < counts["calls"] / 2, counts


class _Step:
    """A stand-in for a saved step: its guards accept what `accepts` says, and it records
    what it checked and ran."""

    def __init__(self, accepts):
        self.accepts, self.checked, self.ran = accepts, 0, 0

    def guard_check(self, model, *args):
        self.checked += 1
        return self.accepts(*args)

    def fn(self, model, *args):
        self.ran += 1
        return args[0] + 1

    def __call__(self, model, *args):
        if not self.guard_check(model, *args):
            raise RuntimeError("GuardManager check failed: a stand-in's guard")
        return self.fn(model, *args)


def test_a_new_signature_goes_through_the_guards(monkeypatch):
    """What can change a guard's verdict changes the signature: a shape, a dtype, one
    tensor passed twice instead of two, a shared tensor's shape, a scalar. A tensor that is
    not contiguous runs as its contiguous copy, with the copy's signature. A signature the
    guards refused is not remembered, and its call goes where a refused call always went
    (`_recompiled`, here a stand-in fallback)."""
    from types import SimpleNamespace

    from branchspec.execution.arguments import Shared
    from branchspec.execution.compiled_step import CompiledStep

    model = SimpleNamespace(embed=SimpleNamespace(weight=torch.zeros(1)))
    saved = _Step(lambda x, y, shared, n: x.dtype == torch.float32 and x.is_contiguous())
    step = CompiledStep(model, lambda model, *args: None, one_shape=True)
    monkeypatch.setattr(step, "_prepare", lambda cls, state, args: step.steps.setdefault((cls, state), saved))
    fallback = []
    monkeypatch.setattr(step, "_fallback", lambda cls: lambda model, *args: fallback.append(args) or "fallback")
    x, y, table = torch.zeros(2, 3), torch.zeros(2, 3), Shared({"a": torch.zeros(4)})

    def run(*args):
        before = saved.checked
        out = step(*args)
        return saved.checked - before, out

    assert run(x, y, table, 1)[0] == 1
    assert run(torch.ones(2, 3), torch.ones(2, 3), table, 1)[0] == 0     # values are not part of it
    assert run(torch.zeros(5, 3), y, table, 1)[0] == 1                   # a shape
    assert run(x, x, table, 1)[0] == 1                                   # one tensor twice
    assert run(x, y, Shared({"a": torch.zeros(8)}), 1)[0] == 1           # a shared tensor's shape
    assert run(x, y, table, 2)[0] == 1                                   # a scalar
    assert run(x, y, table, 1)[0] == 0
    assert run(torch.zeros(3, 2).t(), y, table, 1)[0] == 0               # loose: as its contiguous copy
    assert saved.ran == 8 and not fallback
    # Refused: the guards run again (the saved step's own call), then the fallback.
    wrong = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.warns(UserWarning, match="not compiled for"):
        assert run(wrong, y, table, 1) == (2, "fallback")
    assert run(wrong, y, table, 1) == (2, "fallback")                    # not remembered
    assert len(fallback) == 2 and saved.ran == 8


def test_compiled_mixed_batches_equal_eager(llms):
    """Greedy rows, and rows sampled at their temperature alone, are accepted and committed
    inside the compiled verify graph (the sampled ones in the graph that draws), rows with
    a top-p cut after it, and where any row has logits rules every row after it; plain
    decoding draws in its step's graph where every row is greedy or sampled alone: batches
    of each mix give the eager engine's tokens, row for row, on warm graphs."""
    eager, fast, _ = llms
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=5),
               SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, top_p=0.9, seed=9)]
    biased = SamplingParams(max_tokens=30, ignore_eos=True, logit_bias={7: 2.0, 11: -1.5})
    before = compilations()
    for spec in (TREE, None):
        for params in ([greedy, sampled[0], greedy, sampled[1]], [greedy, biased, sampled[0]], [sampled[0]],
                       [sampled[0], greedy]):
            prompts = PROMPTS[:len(params)]
            ours = [o.token_ids for o in fast.generate(prompts, params, spec=spec)]
            assert ours == [o.token_ids for o in eager.generate(prompts, params, spec=spec)]
    assert compilations() == before, "a compiled step recompiled after warm-up"
    assert fast.engine.cache.tables == {}


def test_callers_in_inference_mode_run_the_same_graphs(llms, ckpt):
    """An LLM used (or even built) under torch.inference_mode runs its calls outside it:
    the compiled steps' guards hold, nothing recompiles, and an LLM built inside still
    runs outside, where inference tensors could not be written in place."""
    eager, fast, _ = llms
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in eager.generate(PROMPTS[:2], params, spec=TREE)]
    before = compilations()
    with torch.inference_mode():
        assert [o.token_ids for o in fast.generate(PROMPTS[:2], params, spec=TREE)] == ref
        built_inside = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0)
        assert [o.token_ids for o in built_inside.generate(PROMPTS[:2], params, spec=TREE)] == ref
    assert compilations() == before, "a compiled step recompiled for a caller in inference mode"
    assert [o.token_ids for o in built_inside.generate(PROMPTS[:2], params, spec=TREE)] == ref


def test_compile_flag_is_checked():
    from branchspec.config import EngineConfig

    with pytest.raises(TypeError, match="EngineConfig.compile"):
        EngineConfig(compile="yes")


@needs_aot
def test_an_unreadable_saved_step_is_compiled_again(llms, ckpt, caplog):
    import logging
    import os
    from pathlib import Path

    eager, _, _ = llms
    folder = Path(os.environ["BRANCHSPEC_CACHE"]) / "compiled"
    victim = sorted(folder.glob("verify_forward-d6-static-plan-batch1-*.bin"))[0]
    victim.write_bytes(b"not a compiled step")
    before, loaded = compilations(), steps_loaded()
    again = LLM(ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0, compile=True)
    with caplog.at_level(logging.INFO, logger="branchspec.compiled"):
        again.warmup(TREE, batch_sizes=(1,), sampling=("greedy",))
    assert (compilations() - before, steps_loaded() - loaded) == (1, 3)
    # The one compilation says when it starts and ends (long work shows progress).
    assert "compiling verify_forward-d6-static for plan-batch1-page4 (" in caplog.text
    assert "compiled verify_forward-d6-static for plan-batch1-page4 in" in caplog.text
    assert victim.read_bytes() != b"not a compiled step", "the step was saved again"
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    assert ([o.token_ids for o in again.generate(PROMPTS[:2], params)]
            == [o.token_ids for o in eager.generate(PROMPTS[:2], params)])



def test_a_compiled_engine_needs_the_dense_expert_dispatch():
    """No shape of a compiled step may follow the MoE routing: the model is built with
    the dense dispatch (LLM(compile=True) does it), and a grouped one is refused."""
    from branchspec.cache.paged import PagedState
    from branchspec.config import tiny_v4_config
    from branchspec.execution.compiled import CompiledExecutor
    from branchspec.model.init import random_model

    cfg = tiny_v4_config()
    cache = PagedState(cfg, max_seqs=1, max_len=64)
    with pytest.raises(ValueError, match="expert_dispatch='dense'"):
        CompiledExecutor(random_model(cfg), cache)
    CompiledExecutor(random_model(cfg, expert_dispatch="dense"), cache)    # compiles nothing until called


def test_steps_are_keyed_by_every_setting_their_guards_check(ckpt):
    """The thread count, grad mode and default dtype are checked by a compiled step's
    guards: a step saved under other settings must have another name (compiles nothing)."""
    from branchspec.execution.compiled_step import CompiledStep, global_state
    from branchspec.execution.steps import decode_step

    step = CompiledStep(random_model(tiny_config(), seed=0), decode_step)
    n = torch.get_num_threads()
    keys = {step.key("nodes1")}
    try:
        torch.set_num_threads(1 if n != 1 else 2)
        keys.add(step.key("nodes1"))
    finally:
        torch.set_num_threads(n)
    with torch.no_grad():
        keys.add(step.key("nodes1"))
    assert len(keys) == 3
    assert step.key("nodes1", global_state()) == step.key("nodes1")


def test_a_step_whose_compilation_fails_runs_eagerly(ckpt, monkeypatch, tmp_path):
    """A saved step whose guards refuse the inputs, then a fallback that cannot recompile
    (FailOnRecompileLimitHit, as a process with another thread count once met): the
    request still gets the eager engine's tokens, each step warns once, and later calls
    run eagerly without trying again. Nothing is compiled (the steps are stand-ins)."""
    import warnings

    from branchspec.execution.compiled_step import CompiledStep

    monkeypatch.setenv("BRANCHSPEC_CACHE", str(tmp_path))
    calls = {"saved": 0, "fallback": 0}

    def saved_step(*args):
        calls["saved"] += 1
        raise RuntimeError("GuardManager check failed: num_threads")

    def fallback(*args):
        calls["fallback"] += 1
        raise torch._dynamo.exc.FailOnRecompileLimitHit("recompile_limit reached")

    monkeypatch.setattr(CompiledStep, "_prepare", lambda self, cls, state, args: saved_step)
    monkeypatch.setattr(CompiledStep, "_fallback", lambda self, cls: fallback)
    eager = LLM(ckpt, max_batch_size=4, page_size=4, max_model_len=256, seed=0)
    fast = LLM(ckpt, max_batch_size=4, page_size=4, max_model_len=256, seed=0, compile=True)
    params = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=12, temperature=1.0, seed=3)]
    for spec in (TREE, None):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = [o.token_ids for o in fast.generate(PROMPTS[:2], params, spec=spec)]
        assert ours == [o.token_ids for o in eager.generate(PROMPTS[:2], params, spec=spec)]
        eagerly = [str(w.message) for w in caught if "running this step eagerly" in str(w.message)]
        # the tree runs five compiled functions (the verify pass that draws while the sampled
        # request runs, the one that does not once only the greedy one is left, the
        # drafter's forward at the root, the growth and the draft extend), plain decoding
        # two more (its step drawing the tokens, then the greedy one's alone)
        assert len(eagerly) == (5 if spec is TREE else 2), eagerly
    assert calls == {"saved": 7, "fallback": 7}
    assert fast.engine.cache.tables == {}


def test_settings_now_is_rebuilt_exactly_when_torch_settings_change():
    """A compiled step keys its graphs by torch's settings (`global_state`); the string it
    reads on every call is kept until dynamo's global-state guard sees a change, and then
    rebuilt (kept regardless, a step would run a graph traced under other settings)."""
    from branchspec.execution.compiled_step import global_state, settings_now

    first = settings_now()
    assert first == global_state() and settings_now() is first
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        changed = settings_now()
        assert changed != first and changed == global_state()
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        assert settings_now() == global_state() != first
    assert settings_now() == first
