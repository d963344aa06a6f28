"""Bad requests are refused up front with a clear error and leave nothing behind; the
engine leaks neither pages nor state across requests, preemption included."""

from __future__ import annotations

import pytest

from branchspec.checkpoint import save_checkpoint
from branchspec.config import EngineConfig, SamplingParams, SpecConfig, tiny_config
from branchspec.engine.engine import Engine
from branchspec.llm import LLM
from branchspec.model.init import random_model

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
CHAIN = SpecConfig.chain(4)
PROMPTS = [[5, 9, 13, 2, 40], [7, 7, 21], list(range(3, 20)), [33]]


# Tiny matmuls: a second thread only adds contention on shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(random_model(tiny_config(), seed=0), tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def model64():
    return random_model(tiny_config(), seed=0, dtype="float64")


def make_llm(ckpt, **kw) -> LLM:
    kw = {"dtype": "float64", "max_batch_size": 8, "page_size": 4, **kw}
    return LLM(ckpt, **kw)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


class Watch:
    """The one engine an LLM keeps: its free pages when watching began, and the requests
    its prefill has run since the last `reset`."""

    def __init__(self, llm: LLM):
        self.engine = llm.engine
        self.initial = self.engine.cache.num_free_pages()
        self.prefills: list[int] = []
        prefill = self.engine.runner.prefill

        def counting_prefill(seqs, *a, **k):
            self.prefills.extend(s.seq_id for s in seqs)
            return prefill(seqs, *a, **k)

        self.engine.runner.prefill = counting_prefill

    def reset(self) -> None:
        self.prefills.clear()

    def idle(self) -> bool:
        """Nothing queued or running, every page back in its pool."""
        e = self.engine
        return not e.scheduler.has_work() and e.cache.tables == {} and e.cache.num_free_pages() == self.initial


# -- refused requests ------------------------------------------------------------------------


def test_empty_prompt(ckpt):
    llm = make_llm(ckpt)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(2))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[4, 5], []], greedy(2))


@pytest.mark.parametrize("bad", [64, 1000, -1])
def test_token_outside_vocab(ckpt, bad):
    llm = make_llm(ckpt)
    with pytest.raises(ValueError, match="vocabulary") as info:
        llm.generate([[3, bad, 4]], greedy(2))
    # the id itself is named (not just the vocabulary bound [0, 64))
    assert str(bad) in str(info.value).replace("[0, 64)", "")


def test_non_int_token_rejected(ckpt):
    llm = make_llm(ckpt)
    with pytest.raises(TypeError, match=r"prompts\[0\]\[1\]"):
        llm.generate([[3, 4.0, 5]], greedy(2))


def test_prompt_plus_max_tokens_beyond_max_model_len(ckpt):
    llm = make_llm(ckpt, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len 32") as info:
        llm.generate([list(range(3, 13))], greedy(23))
    assert "10 tokens" in str(info.value) and "23" in str(info.value)
    # exactly at the limit is fine, with and without speculation
    for spec in (None, TREE):
        out = llm.generate([list(range(3, 13))], greedy(22), spec=spec)
        assert len(out[0].token_ids) == 22


def test_max_model_len_beyond_model(ckpt):
    with pytest.raises(ValueError, match="max_position"):
        make_llm(ckpt, max_model_len=4096).generate([[3, 4]], greedy(2))


def test_text_prompt_without_tokenizer(ckpt):
    llm = make_llm(ckpt)
    assert llm.tokenizer is None
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello there"], greedy(2))
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello there", greedy(2))


@pytest.mark.parametrize("spec", [{"num_steps": 3, "topk": 2, "num_draft_tokens": 6}, (3, 2, 6), 6, "tree"])
def test_spec_must_be_spec_config(ckpt, spec):
    llm = make_llm(ckpt)
    with pytest.raises(TypeError, match="SpecConfig"):
        llm.generate([[3, 4, 5]], greedy(2), spec=spec)


def test_params_count_must_match_prompts(ckpt):
    llm = make_llm(ckpt)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[3, 4], [5, 6]], [greedy(2)] * 3)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_failing_request_in_batch_runs_nothing(ckpt, position):
    llm = make_llm(ckpt)
    watch = Watch(llm)
    prompts = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
    prompts[position] = [3, 77, 5]
    with pytest.raises(ValueError, match="77"):
        llm.generate(prompts, greedy(4), spec=TREE)
    assert watch.prefills == []                              # no request ran
    assert watch.idle()                                      # none was queued, pages untouched

    # a bad sampling param for one request of the batch: same
    good = [[3, 4, 5], [6, 7, 8, 9], [10, 11]]
    params = [greedy(4), greedy(4), greedy(4)]
    params[position] = greedy(2000)
    with pytest.raises(ValueError, match=f"prompts\\[{position}\\].*max_model_len"):
        llm.generate(good, params)
    assert watch.prefills == [] and watch.idle()

    # and the LLM still generates, equal to a fresh LLM
    out = llm.generate(good, greedy(6), spec=TREE)
    fresh = make_llm(ckpt).generate(good, greedy(6), spec=TREE)
    assert [o.token_ids for o in out] == [o.token_ids for o in fresh]
    assert all(len(o.token_ids) == 6 for o in out)
    assert len(watch.prefills) == 3
    assert watch.idle()


# -- no leaked state -----------------------------------------------------------------------------


def test_no_state_leaks_across_generates(ckpt):
    llm = make_llm(ckpt)
    watch = Watch(llm)
    ref = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
    assert all(len(t) == 12 for t in ref)

    # a mix of lengths, max_tokens=1, eos allowed, speculation on and off
    for spec in (None, TREE, CHAIN, None, TREE):
        for n in (1, 2, 5, 9):
            outs = llm.generate(PROMPTS, greedy(n), spec=spec)
            # greedy: a shorter budget yields a prefix of the longer output
            assert [o.token_ids for o in outs] == [t[:n] for t in ref], (spec, n)
            if spec is not None and n > 1:
                assert all(o.num_rounds >= 1 for o in outs)
        mixed = [SamplingParams(max_tokens=m, ignore_eos=e) for m, e in zip((1, 7, 3, 12), (True, False, True, False))]
        outs = llm.generate(PROMPTS, mixed, spec=spec)
        assert len(outs[0].token_ids) == 1 and outs[0].finish_reason == "length"
        for o, t in zip(outs, ref):
            assert o.token_ids == t[: len(o.token_ids)]
        assert watch.idle()

    again = [o.token_ids for o in llm.generate(PROMPTS, greedy(12))]
    assert again == ref
    spec_again = [o.token_ids for o in llm.generate(PROMPTS, greedy(12), spec=TREE)]
    assert spec_again == ref


def test_batch_equals_one_at_a_time(ckpt):
    llm = make_llm(ckpt)
    batch = [o.token_ids for o in llm.generate(PROMPTS, greedy(8), spec=TREE)]
    alone = [llm.generate([p], greedy(8), spec=TREE)[0].token_ids for p in PROMPTS]
    assert batch == alone


# -- Engine directly: pages come back, preemption included -------------------------------------


def run_engine(model, spec, num_pages=None, max_batch_size=4, prompts=None, max_tokens=24):
    engine = Engine(model, EngineConfig(max_batch_size=max_batch_size, page_size=4, max_model_len=128,
                                        num_pages=num_pages or {}))
    initial = engine.cache.num_free_pages()
    preempted = []
    preempt = engine.scheduler.preempt

    def counting_preempt():
        seq = preempt()
        preempted.append(seq.seq_id)
        return seq

    engine.scheduler.preempt = counting_preempt
    prompts = prompts or [[(7 * i + 3 * j) % 60 + 3 for j in range(12)] for i in range(4)]
    seqs = [engine.add_request(p, greedy(max_tokens)) for p in prompts]
    finished = engine.run(spec)
    assert sorted(s.seq_id for s in finished) == sorted(s.seq_id for s in seqs)
    assert not engine.scheduler.has_work()
    assert engine.cache.tables == {}
    assert engine.cache.num_free_pages() == initial, "pages leaked"
    return [s.output_ids for s in seqs], preempted, engine


@pytest.mark.parametrize("spec", [None, TREE, CHAIN], ids=["plain", "tree", "chain"])
def test_engine_returns_every_page(model64, spec):
    prompts = [[3, 4, 5, 6, 7], list(range(10, 40)), [9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
    engine = Engine(model64, EngineConfig(max_batch_size=2, page_size=4, max_model_len=128))
    initial = engine.cache.num_free_pages()
    seqs = [engine.add_request(p, SamplingParams(max_tokens=m))
            for p, m in zip(prompts, (1, 17, 6, 30))]
    engine.run(spec)
    assert all(s.finished for s in seqs)
    assert len(seqs[0].output_ids) == 1
    assert engine.cache.num_free_pages() == initial
    assert engine.cache.tables == {}
    # and the same engine serves a second wave from a clean pool
    more = [engine.add_request(p, greedy(5)) for p in prompts]
    engine.run(spec)
    assert all(len(s.output_ids) == 5 for s in more)
    assert engine.cache.num_free_pages() == initial


@pytest.mark.parametrize("spec", [None, TREE], ids=["plain", "tree"])
def test_preemption_keeps_outputs_and_returns_pages(model64, spec):
    # 4 requests of 12 + 24 tokens each grow to 9 ent4 entries = 3 pages of 4: 12 pages for
    # all four at once. 4 pages hold only one long request (plus a short one), so the engine
    # must preempt and recompute.
    big, no_preempt, _ = run_engine(model64, spec)
    assert no_preempt == []
    small, preempted, engine = run_engine(model64, spec, num_pages={"ent4": 4})
    assert engine.cache.pools["ent4"].num_pages == 4
    assert len(preempted) > 0, "the small pool did not force a preemption"
    assert small == big
    assert all(len(t) == 24 for t in small)


def test_preempted_spec_equals_plain(model64):
    plain, _, _ = run_engine(model64, None)
    tree, preempted, _ = run_engine(model64, TREE, num_pages={"ent4": 4})
    assert preempted
    assert tree == plain


def test_unadmittable_request_raises_instead_of_spinning(model64):
    # 20 prompt tokens = 5 ent4 entries = 2 pages; the pool has 1.
    engine = Engine(model64, EngineConfig(max_batch_size=2, page_size=4, num_pages={"ent4": 1}))
    with pytest.raises((ValueError, RuntimeError)):
        engine.add_request(list(range(3, 23)), greedy(4))
        for _ in range(3):   # run() would call step() forever; three calls are enough to tell
            engine.step(None)
