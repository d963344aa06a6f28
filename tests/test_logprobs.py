"""Logprobs as vLLM returns them ("raw": log_softmax of the target's logits in float64,
before temperature and top-p), checked against a full forward over prompt + output, and
lossless under speculation: a verify round gives each emitted token the logprobs of the
node whose distribution produced it, equal to plain decoding's in float64."""

from __future__ import annotations

import pytest
import torch

import branchspec.sampling as sampling_module
import branchspec.engine.runner as runner_module
from branchspec.checkpoint import load_checkpoint, save_checkpoint
from branchspec.config import EngineConfig, SamplingParams, SpecConfig, tiny_config
from branchspec.engine.engine import Engine
from branchspec.llm import LLM
from branchspec.model.init import random_model
from conftest import markov_batches

TREE = SpecConfig(3, 2, 6)
CHAIN = SpecConfig.chain(5)
ATOL = 1e-9
NORMAL = [[5, 9, 13, 2, 40], [7, 7, 21, 8]]


# Tiny matmuls: a second thread only adds contention on shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random float64 model with weights large enough for peaked, tie-free logprobs."""
    return save_checkpoint(random_model(tiny_config(), seed=3, dtype="float64", std=0.3),
                           tmp_path_factory.mktemp("tiny_lp"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, dtype="float64", max_batch_size=8, page_size=4)


@pytest.fixture(scope="module")
def trained_llm(trained_ckpt):
    """Drafts are accepted often with this one, so rounds emit several tokens."""
    return LLM(trained_ckpt, dtype="float64", max_batch_size=8, page_size=4)


@pytest.fixture(scope="module")
def prompts():
    lengths = [5, 126, 40, 3, 1, 64, 9]     # a C128 boundary lands in the first rounds
    data = next(markov_batches(64, 1, batch=len(lengths), length=140, seed=5))
    return [data[i, :n].tolist() for i, n in enumerate(lengths)]


def reference(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log_softmax of the full forward's logits over prompt + output: row p scores token p+1."""
    with torch.no_grad():
        out, _ = model.full_forward(torch.tensor([prompt + output]))
    return torch.log_softmax(out.logits[0].double(), dim=-1)                 # [T, V]


def assert_dicts(dicts, rows: torch.Tensor, chosen: list[int], k: int, atol: float = ATOL) -> None:
    """Each dict: the chosen token first, then exactly the reference's top k, values equal."""
    assert len(dicts) == len(chosen) == rows.shape[0]
    for d, row, t in zip(dicts, rows, chosen):
        assert isinstance(d, dict) and next(iter(d)) == t
        top = set(row.topk(k).indices.tolist()) if k else set()
        assert set(d) == top | {t}
        assert len(d) in (k, k + 1)
        for tok, v in d.items():
            assert type(tok) is int and type(v) is float
            assert abs(v - row[tok].item()) <= atol, (tok, v, row[tok].item())


def assert_same_logprobs(a, b, atol: float = ATOL) -> None:
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for da, db in zip(a, b):
        assert (da is None) == (db is None)
        if da is None:
            continue
        assert list(da) == list(db)
        assert max(abs(da[t] - db[t]) for t in da) <= atol


# -- plain decoding ---------------------------------------------------------------------------


@pytest.mark.parametrize("k", [0, 1, 5])
def test_plain_logprobs_equal_full_forward(llm, k):
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k)
    outs = llm.generate(NORMAL, params)
    for prompt, o in zip(NORMAL, outs):
        assert o.prompt_logprobs is None
        assert len(o.logprobs) == len(o.token_ids) == 12
        lp = reference(llm.model, prompt, o.token_ids)
        P = len(prompt)
        assert_dicts(o.logprobs, lp[P - 1:P - 1 + 12], o.token_ids, k)
        if k == 0:
            assert all(len(d) == 1 for d in o.logprobs)


def test_nothing_unless_asked_and_no_work(llm, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("logprobs computed although no request asked")

    monkeypatch.setattr(runner_module, "logprob_dicts", boom)
    monkeypatch.setattr(sampling_module, "logprob_dicts", boom)
    monkeypatch.setattr(llm.engine.runner, "_collect_prompt_logprobs", boom)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for spec in (None, TREE):
        for o in llm.generate(NORMAL, params, spec=spec):
            assert o.logprobs is None and o.prompt_logprobs is None


def test_mixed_requests_in_one_batch(llm):
    """Only the requests that asked get logprobs, each with its own k."""
    params = [SamplingParams(max_tokens=7, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=9, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(max_tokens=4, ignore_eos=True),
              SamplingParams(max_tokens=5, ignore_eos=True, logprobs=0, prompt_logprobs=0)]
    batch = [[5, 9, 13, 2, 40], [7, 7, 21, 8], [11, 12], [30, 31, 32]]
    outs = llm.generate(batch, params)
    assert outs[0].logprobs is not None and outs[0].prompt_logprobs is None
    assert outs[1].logprobs is None and outs[1].prompt_logprobs is not None
    assert outs[2].logprobs is None and outs[2].prompt_logprobs is None
    for prompt, o, p in zip(batch, outs, params):
        lp = reference(llm.model, prompt, o.token_ids)
        P = len(prompt)
        if p.logprobs is not None:
            assert_dicts(o.logprobs, lp[P - 1:P - 1 + len(o.token_ids)], o.token_ids, p.logprobs)
        if p.prompt_logprobs is not None:
            assert len(o.prompt_logprobs) == P and o.prompt_logprobs[0] is None
            assert_dicts(o.prompt_logprobs[1:], lp[:P - 1], prompt[1:], p.prompt_logprobs)


def test_whole_vocabulary(llm):
    V = llm.config.vocab_size
    o = llm.generate(NORMAL[0], SamplingParams(max_tokens=3, ignore_eos=True, logprobs=V, prompt_logprobs=V))[0]
    assert all(len(d) == V for d in o.logprobs)
    assert all(len(d) == V for d in o.prompt_logprobs[1:])
    for d in o.logprobs:   # a full distribution
        assert abs(torch.tensor(list(d.values()), dtype=torch.float64).exp().sum().item() - 1.0) < 1e-9


# -- prompt logprobs --------------------------------------------------------------------------


def test_prompt_logprobs_longer_than_a_prefill_chunk(llm):
    chunk = llm.engine_config.prefill_chunk_size
    prompt = [(7 * j + 3) % 61 + 3 for j in range(chunk + 45)]
    o = llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2, prompt_logprobs=3))[0]
    lp = reference(llm.model, prompt, o.token_ids)
    P = len(prompt)
    assert len(o.prompt_logprobs) == P and o.prompt_logprobs[0] is None
    assert_dicts(o.prompt_logprobs[1:], lp[:P - 1], prompt[1:], 3)
    assert_dicts(o.logprobs, lp[P - 1:P + 3], o.token_ids, 2)


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_prompt_logprobs_across_small_chunks(ckpt, spec):
    """Several requests prefilled together in chunks of 7: every chunk boundary, prompts of
    one token (only None) and of exactly one chunk."""
    model = load_checkpoint(ckpt, "float64")
    engine = Engine(model, EngineConfig(max_batch_size=8, page_size=4, max_model_len=128, prefill_chunk_size=7))
    batch = [[9], list(range(3, 10)), list(range(10, 18)), [(5 * j) % 60 + 3 for j in range(23)],
             [(11 * j) % 60 + 3 for j in range(15)]]
    ks = [4, 0, 2, 6, None]
    seqs = [engine.add_request(p, SamplingParams(max_tokens=5, ignore_eos=True, prompt_logprobs=k, logprobs=1))
            for p, k in zip(batch, ks)]
    engine.run(spec)
    for s, p, k in zip(seqs, batch, ks):
        lp = reference(model, p, s.output_ids)
        assert_dicts(s.logprobs, lp[len(p) - 1:len(p) + 4], s.output_ids, 1)
        if k is None:
            assert s.prompt_logprobs is None
            continue
        assert len(s.prompt_logprobs) == len(p) and s.prompt_logprobs[0] is None
        assert_dicts(s.prompt_logprobs[1:], lp[:len(p) - 1], p[1:], k)


# -- speculation ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_params():
    return [SamplingParams(max_tokens=m, ignore_eos=True, logprobs=k, prompt_logprobs=pk)
            for m, k, pk in zip((20, 31, 5, 26, 11, 1, 17), (3, 0, 2, 5, 1, 4, 2), (2, None, 1, 0, 3, 2, None))]


@pytest.fixture(scope="module")
def plain_outs(trained_llm, prompts, greedy_params):
    return trained_llm.generate(prompts, greedy_params)


def test_plain_reference_on_the_trained_model(trained_llm, prompts, greedy_params, plain_outs):
    for prompt, o, p in zip(prompts, plain_outs, greedy_params):
        lp = reference(trained_llm.model, prompt, o.token_ids)
        P = len(prompt)
        assert_dicts(o.logprobs, lp[P - 1:P - 1 + len(o.token_ids)], o.token_ids, p.logprobs)
        if p.prompt_logprobs is not None:
            assert_dicts(o.prompt_logprobs[1:], lp[:P - 1], prompt[1:], p.prompt_logprobs)


@pytest.mark.parametrize("spec", [TREE, CHAIN], ids=["tree326", "chain5"])
def test_speculative_logprobs_equal_plain(trained_llm, prompts, greedy_params, plain_outs, spec):
    outs = trained_llm.generate(prompts, greedy_params, spec=spec)
    assert trained_llm.last_stats.accept_length > 1.2, "drafts were hardly accepted: the test would prove little"
    for o, ref in zip(outs, plain_outs):
        assert o.token_ids == ref.token_ids
        assert len(o.logprobs) == len(o.token_ids)
        assert_same_logprobs(o.logprobs, ref.logprobs)
        assert_same_logprobs(o.prompt_logprobs, ref.prompt_logprobs)


@pytest.mark.parametrize("spec", [None, TREE, CHAIN], ids=["plain", "tree326", "chain5"])
def test_sampled_logprobs_are_raw_target_logprobs(trained_llm, prompts, spec):
    """Sampled tokens (temperature, top-p, seeds): each chosen token is in its dict, and the
    values are the raw target logprobs, not the tempered or truncated ones."""
    params = [SamplingParams(temperature=t, top_p=tp, seed=100 + i, max_tokens=15, ignore_eos=True, logprobs=2)
              for i, (t, tp) in enumerate(zip((0.7, 1.0, 1.3, 0.9, 1.0, 0.5, 1.1), (0.9, 1.0, 0.8, 1.0, 0.95, 1.0, 1.0)))]
    outs = trained_llm.generate(prompts, params, spec=spec)
    again = trained_llm.generate(prompts, params, spec=spec)
    for prompt, o, a in zip(prompts, outs, again):
        assert o.token_ids == a.token_ids           # seeded: reproducible, logprobs included
        assert_same_logprobs(o.logprobs, a.logprobs, atol=0.0)
        lp = reference(trained_llm.model, prompt, o.token_ids)
        P = len(prompt)
        assert_dicts(o.logprobs, lp[P - 1:P - 1 + len(o.token_ids)], o.token_ids, 2)
    if spec is not None:
        assert sum(o.num_rounds for o in outs) < sum(len(o.token_ids) - 1 for o in outs), "no draft accepted"


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_stop_token_cuts_logprobs_with_the_output(trained_ckpt, prompts, spec):
    """A round that emits several tokens and stops at one of them keeps one dict per token."""
    model = load_checkpoint(trained_ckpt, "float64")
    config = EngineConfig(max_batch_size=8, page_size=4, max_model_len=256)
    params = SamplingParams(max_tokens=30, logprobs=1)
    free = Engine(model, config)
    full = [free.add_request(p, params) for p in prompts[:4]]
    free.run(spec)
    stop = full[0].output_ids[6]
    engine = Engine(model, config, stop_token_ids=(stop,))
    seqs = [engine.add_request(p, params) for p in prompts[:4]]
    engine.run(spec)
    assert seqs[0].finish_reason == "stop" and seqs[0].output_ids[-1] == stop
    for s, f in zip(seqs, full):
        n = len(s.output_ids)
        assert s.output_ids == f.output_ids[:n] and len(s.logprobs) == n
        assert_same_logprobs(s.logprobs, f.logprobs[:n])


# -- preemption -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_preemption_keeps_prompt_logprobs_single_and_correct(ckpt, spec):
    model = load_checkpoint(ckpt, "float64")
    prompts = [[(7 * i + 3 * j) % 60 + 3 for j in range(12)] for i in range(4)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2, prompt_logprobs=3)

    def run(num_pages):
        engine = Engine(model, EngineConfig(max_batch_size=4, page_size=4, max_model_len=128, num_pages=num_pages))
        initial = engine.cache.num_free_pages()
        preempted, collected = [], []
        preempt, collect = engine.scheduler.preempt, engine.runner._collect_prompt_logprobs

        def counting_preempt():
            preempted.append(preempt())
            return preempted[-1]

        def counting_collect(seqs, active, done, counts, logits, prompt_lps, *ranks):
            before = {i: len(v) for i, v in prompt_lps.items()}
            collect(seqs, active, done, counts, logits, prompt_lps, *ranks)
            collected.extend(len(v) - before[i] for i, v in prompt_lps.items())

        engine.scheduler.preempt = counting_preempt
        engine.runner._collect_prompt_logprobs = counting_collect
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run(spec)
        assert engine.cache.num_free_pages() == initial
        assert sum(collected) == sum(len(p) - 1 for p in prompts), "prompt logprobs recomputed"
        return seqs, preempted

    big, none = run({})
    assert none == []
    small, preempted = run({"ent4": 4})
    assert preempted, "the small pool did not force a preemption"
    for s, b, p in zip(small, big, prompts):
        assert s.output_ids == b.output_ids and len(s.output_ids) == 24
        assert len(s.prompt_logprobs) == len(p) and s.prompt_logprobs[0] is None
        assert len(s.logprobs) == 24
        lp = reference(model, p, s.output_ids)
        assert_dicts(s.prompt_logprobs[1:], lp[:len(p) - 1], p[1:], 3)
        assert_dicts(s.logprobs, lp[len(p) - 1:len(p) + 23], s.output_ids, 2)
        assert_same_logprobs(s.logprobs, b.logprobs)


# -- refused values ---------------------------------------------------------------------------

BAD = [
    pytest.param(dict(logprobs=-1), ValueError, r"SamplingParams\.logprobs must be >= 0", id="logprobs-negative"),
    pytest.param(dict(logprobs=True), TypeError, r"SamplingParams\.logprobs must be an integer", id="logprobs-bool"),
    pytest.param(dict(logprobs=2.0), TypeError, r"SamplingParams\.logprobs must be an integer", id="logprobs-float"),
    pytest.param(dict(logprobs="3"), TypeError, r"SamplingParams\.logprobs must be an integer", id="logprobs-str"),
    pytest.param(dict(prompt_logprobs=-2), ValueError, r"SamplingParams\.prompt_logprobs must be >= 0",
                 id="prompt-logprobs-negative"),
    pytest.param(dict(prompt_logprobs=False), TypeError, r"SamplingParams\.prompt_logprobs must be an integer",
                 id="prompt-logprobs-bool"),
    pytest.param(dict(prompt_logprobs=[1]), TypeError, r"SamplingParams\.prompt_logprobs must be an integer",
                 id="prompt-logprobs-list"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD)
def test_bad_values_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_numpy_int_accepted():
    import numpy as np
    p = SamplingParams(logprobs=np.int64(3), prompt_logprobs=np.int32(0))
    assert p.logprobs == 3 and type(p.logprobs) is int and p.prompt_logprobs == 0


@pytest.mark.parametrize("param", ["logprobs", "prompt_logprobs"])
def test_beyond_vocabulary_refused_before_any_request_and_llm_still_serves(llm, param):
    V = llm.config.vocab_size
    normal = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(NORMAL, normal, spec=TREE)]
    free = llm.engine.cache.num_free_pages()
    prefills = []
    prefill = llm.engine.runner.prefill
    llm.engine.runner.prefill = lambda seqs, *a, **k: prefills.append(len(seqs)) or prefill(seqs, *a, **k)
    try:
        bad = [normal, SamplingParams(max_tokens=6, **{param: V + 1})]
        with pytest.raises(ValueError, match=rf"SamplingParams\.{param}={V + 1} for prompts\[1\] exceeds "
                                             rf"the model's vocabulary of {V}"):
            llm.generate(NORMAL, bad, spec=TREE)
        assert prefills == []                                      # nothing ran
    finally:
        llm.engine.runner.prefill = prefill
    engine = llm.engine
    assert not engine.scheduler.has_work() and engine.cache.tables == {}
    assert engine.cache.num_free_pages() == free
    assert [o.token_ids for o in llm.generate(NORMAL, normal, spec=TREE)] == ref
    ok = llm.generate(NORMAL, SamplingParams(max_tokens=6, ignore_eos=True, **{param: V}), spec=TREE)
    assert [o.token_ids for o in ok] == ref
