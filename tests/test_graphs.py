"""The engine's own CUDA graphs, their buffer logic exercised on a CPU.

A CUDA-graph engine (`execution/graphed.py`) captures every step kind once per batch
bucket and replays it from static buffers: a call copies its arguments in (the batch
padded up to the bucket, padding rows addressing the sink page), and copies its rows of
the static outputs out. `graphs.StaticCalls` gives a CPU the same memory behaviour (a
replay reads the static inputs and overwrites the static outputs) without recording
anything, so these tests check, without a GPU:

- tokens: greedy and seeded sampled outputs equal the eager engine's, for plain decoding,
  trees, chains and calibrated trees, at batches that fill their bucket and that do not;
- invariant S: after rounds with padding rows, every sequence's state equals sequential
  decoding's (float64), so padding never writes where a sequence reads;
- no capture after warm-up, whatever the batch, context or accept length;
- outputs are copies (a later replay does not change them; the negative control returns
  the static outputs themselves, and a later replay does), and shared inputs changed
  in place are copied in again;
- nothing inside a captured step reads a value back to the host or copies one over from
  it: every step, run on the meta device, makes no such call.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from branchspec import LLM, SamplingParams, SpecConfig
from branchspec.checkpoint import load_checkpoint
from branchspec.config import EngineConfig
from branchspec.config.checks import ConfigError
from branchspec.engine.engine import Engine
from branchspec.execution.graphed import GraphExecutor
from branchspec.execution.graphs import GraphRunner, StaticCalls, graph_buckets

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
SPECS = {"plain": None, "tree": TREE, "chain": SpecConfig.chain(5),
         "calibrated": SpecConfig(num_steps=3, topk=2, num_draft_tokens=6, selection="calibrated")}


def graph_llm(ckpt, dtype: str = "float32", max_batch_size: int = 8) -> LLM:
    """An LLM whose engine replays its steps through the graph runner, with `StaticCalls`
    standing in for CUDA graphs (the model built with the dense expert dispatch, as on a GPU)."""
    llm = LLM(ckpt, dtype=dtype, max_batch_size=max_batch_size, page_size=4, max_model_len=256, seed=0)
    llm.model = load_checkpoint(ckpt, dtype, expert_dispatch="dense")
    llm.engine = Engine(llm.model, llm.engine_config, decode=llm.engine.decode, seed=0,
                        stop_token_ids=tuple(llm.engine.stop_token_ids), draft_vocab=llm.draft_vocab,
                        executor=lambda model, cache: GraphExecutor(model, cache, backend=StaticCalls()))
    return llm


@pytest.fixture(scope="module")
def llms(trained_ckpt):
    """(eager, graphs) over the same checkpoint, seeded alike."""
    eager = LLM(trained_ckpt, max_batch_size=8, page_size=4, max_model_len=256, seed=0)
    return eager, graph_llm(trained_ckpt)


@pytest.fixture(scope="module")
def prompts():
    return [[0] + [3 + (7 * j + i) % 60 for j in range(5 + 23 * i)] for i in range(8)]


def test_buckets():
    assert graph_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert graph_buckets(8) == (1, 2, 4, 8)
    assert graph_buckets(5) == (1, 2, 4, 5)
    assert graph_buckets(1) == (1,)
    assert graph_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 300)
    runner = GraphRunner(None, StaticCalls(), graph_buckets(8), {})
    assert [runner.bucket(b) for b in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest graph bucket 8"):
        runner.bucket(9)


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ConfigError, match="cuda_graphs=True needs a CUDA device"):
        EngineConfig(cuda_graphs=True)
    assert not EngineConfig().uses_cuda_graphs and not EngineConfig(cuda_graphs=False).uses_cuda_graphs


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_graphs_give_the_eager_engines_tokens(llms, prompts, spec, batch):
    """Greedy, sampled at a temperature alone (drawn in the graphs), and with a top-p cut
    (drawn after the verify graph): row for row the eager engine's tokens and rounds."""
    eager, graphs = llms
    kinds = [SamplingParams(max_tokens=24, ignore_eos=True),
             SamplingParams(max_tokens=31, ignore_eos=True, temperature=0.8, seed=5),
             SamplingParams(max_tokens=17, ignore_eos=True, temperature=1.0, top_p=0.9, seed=9)]
    params = [kinds[i % 3] for i in range(batch)]
    ours = graphs.generate(prompts[:batch], params, spec=spec)
    ref = eager.generate(prompts[:batch], params, spec=spec)
    assert [o.token_ids for o in ours] == [o.token_ids for o in ref]
    assert [o.num_rounds for o in ours] == [o.num_rounds for o in ref]
    assert graphs.engine.cache.tables == {}


def test_nothing_is_captured_after_warmup(trained_ckpt, prompts):
    """Warm-up captures every graph of the configuration at every bucket; then other
    batches, contexts and accept lengths replay them."""
    llm = graph_llm(trained_ckpt, max_batch_size=4)
    runner = llm.engine.executor.runner
    warm = llm.warmup(TREE, sampling=("greedy",), progress=False)
    warm_plain = llm.warmup(None, sampling=("greedy",), progress=False)
    # The tree: the drafter at the root, the growth, the verify pass and the draft extend at
    # each of the buckets 4, 2, 1; plain decoding one step at each.
    assert (warm["captured"], warm_plain["captured"]) == (4 * 3, 3)
    before = runner.captures
    for batch in (1, 2, 3, 4):
        for spec in (TREE, None):
            llm.generate(prompts[:batch], SamplingParams(max_tokens=45, ignore_eos=True), spec=spec)
    assert runner.captures == before, "a step was captured after warm-up"


def test_state_after_graph_rounds_equals_sequential(trained_ckpt, prompts):
    """Invariant S through padded graphs: three requests in a bucket of four, five tree
    rounds; every sequence's target state and drafter KV equal a sequential pass's
    (float64), so no padding row wrote where a sequence reads."""
    from helpers import assert_same_state, sequential, sequential_drafter

    model = load_checkpoint(trained_ckpt, "float64", expert_dispatch="dense")
    engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4),
                    executor=lambda m, cache: GraphExecutor(m, cache, backend=StaticCalls()))
    seqs = [engine.add_request(prompts[i], SamplingParams(max_tokens=40, ignore_eos=True)) for i in (1, 4, 6)]
    for _ in range(5):
        engine.step(TREE)
    assert engine.executor.runner.graphs and all(g.bucket == 4 for g in engine.executor.runner.graphs.values())
    for seq in seqs:
        L = seq.num_committed
        assert not seq.finished and L > len(seq.prompt_ids)
        committed = seq.token_ids[:L]
        ref, _ = sequential(model, committed, chunk=1)
        drafter, _ = sequential_drafter(model, committed)
        assert_same_state(engine.cache.snapshot(seq.seq_id, L, mtp_length=L), {**ref.snapshot(0, L), **drafter})


def _double(model, x: torch.Tensor, shared):
    return {"y": x * 2 + shared.storage["w"]}


@pytest.mark.parametrize("copies", [True, False], ids=["copies", "negative-control-views"])
def test_outputs_are_copies_and_shared_inputs_follow_changes(copies, monkeypatch):
    """A call's outputs are its own: the next replay of the same graph leaves them as they
    were (the negative control hands out the static outputs themselves, which it
    overwrites). A shared input changed in place between calls is copied in again."""
    from branchspec.execution.arguments import Shared
    from branchspec.execution.graphs import CapturedStep

    if not copies:
        monkeypatch.setattr(CapturedStep, "read", lambda self, batch: self.outputs)
    runner = GraphRunner(None, StaticCalls(), (1, 2, 4), {})
    w = torch.zeros(3)
    first = runner("double", _double, (torch.ones(3, 3), Shared({"w": w})))["y"]
    assert torch.equal(first[:3], torch.full((3, 3), 2.0))
    w += 1                                     # changed in place: copied in again
    second = runner("double", _double, (torch.full((2, 3), 5.0), Shared({"w": w})))["y"]
    assert torch.equal(second[:2], torch.full((2, 3), 11.0))
    assert runner.captures == 2                # bucket 4, then bucket 2
    third = runner("double", _double, (torch.full((3, 3), 7.0), Shared({"w": w})))["y"]
    assert torch.equal(third[:3], torch.full((3, 3), 15.0))
    assert runner.captures == 2
    assert torch.equal(first[:3], torch.full((3, 3), 2.0)) == copies


class HostTraffic(TorchDispatchMode):
    """Records every op that would read a value back to the host, or take a tensor from
    it, were the step's tensors on a GPU: here they are on the meta device, which holds no
    values, so such an op either fails or shows a CPU tensor meeting meta ones."""

    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket.__name__)
        if name in ("_local_scalar_dense", "item", "nonzero", "masked_select", "_assert_async"):
            self.found.append(name)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "meta" for t in tensors) and any(t.device.type == "cpu" for t in tensors):
            self.found.append(f"{name} with a host tensor")
        if name in ("_to_copy", "to", "copy_") and any(t.device.type == "cpu" for t in tensors) \
                and kwargs.get("device", None) not in (None, torch.device("cpu")):
            self.found.append(f"{name} from the host")
        return func(*args, **kwargs)


def _to_meta(obj):
    """obj with every tensor (0-dim ones too) moved to the meta device."""
    import dataclasses

    from branchspec.execution.arguments import Shared, fields

    if isinstance(obj, torch.Tensor):
        return obj.to("meta")
    if isinstance(obj, Shared):
        return type(obj)({k: v.to("meta") for k, v in obj.storage.items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_meta(v) for v in obj)
    if isinstance(obj, dict):
        return {k: _to_meta(v) for k, v in obj.items()}
    if fields(type(obj)) is None:
        return obj
    return dataclasses.replace(obj, **{n: _to_meta(getattr(obj, n)) for n, _ in fields(type(obj))})


def test_captured_steps_read_nothing_back_to_the_host(trained_ckpt, prompts):
    """Every step a graph captures (plain decoding with and without its draw, the drafter
    at the root, a plain and a calibrated growth, the verify pass with and without draws,
    the draft extend) runs on the meta device with no op that reads a value back to the
    host or copies one from it: inside a CUDA graph such an op would fail the capture, or
    stall the host behind the device at every step."""
    llm = graph_llm(trained_ckpt, max_batch_size=4)
    calls: dict = {}
    call = GraphRunner.__call__

    def record(self, key, fn, args):
        calls.setdefault(str(key) if not isinstance(key, tuple) else f"{key[0]}-{key[1]}", (fn, args))
        return call(self, key, fn, args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphRunner, "__call__", record)
        for spec in (None, TREE, SPECS["calibrated"]):
            for temperature in (0.0, 0.7):
                llm.generate(prompts[:2], SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature,
                                                         seed=1), spec=spec)
    assert len(calls) >= 8, sorted(calls)
    meta_model = copy.deepcopy(llm.model).to("meta")
    for key, (fn, args) in calls.items():
        assert host_traffic(fn, meta_model, args) == [], key


def host_traffic(fn, meta_model, args) -> list[str]:
    """What fn(meta_model, *args), its arguments moved to the meta device, reads back to
    the host or takes from it: the ops `HostTraffic` records, or the error an op that
    needs a value raised."""
    mode, meta_args = HostTraffic(), _to_meta(args)
    try:
        with torch.no_grad(), mode:
            fn(meta_model, *meta_args)
    except (RuntimeError, NotImplementedError) as e:
        mode.found.append(f"{type(e).__name__}: {str(e)[:120]}")
    return sorted(set(mode.found))


def test_host_traffic_is_seen(trained_ckpt, prompts):
    """The check above can fail: a value read back (`.item()`, `.tolist()`), an index or a
    tensor made on the host, and the eager engine's own grouped MoE dispatch (which reads
    the routing back, and which a GPU engine therefore never uses) are each found."""
    from branchspec.execution.steps import decode_step

    x = torch.ones(2, 3)
    assert host_traffic(lambda m, t: t * t.sum().item(), None, (x,))
    assert host_traffic(lambda m, t: t[torch.tensor([1, 0])], None, (x,))
    assert host_traffic(lambda m, t: t + torch.arange(3), None, (x,))
    assert host_traffic(lambda m, t: t * 2, None, (x,)) == []
    model = load_checkpoint(trained_ckpt, "float32")      # the eager CPU engine's dispatch
    if not model.cfg.num_experts:
        return
    llm = graph_llm(trained_ckpt, max_batch_size=4)
    calls = []
    call = GraphRunner.__call__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GraphRunner, "__call__", lambda self, key, fn, args: calls.append(args) or call(self, key, fn, args))
        llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))
    assert host_traffic(decode_step, copy.deepcopy(model).to("meta"), calls[0])
