"""Hostile input through every public entry point: each kind is refused before any request
runs, with a TypeError (wrong type) or ValueError (wrong value) whose message names the
parameter; afterwards the same LLM serves a normal request exactly as before, and no page
has leaked. Also the behaviours a first user trips over: stop strings, seeds, one engine
across calls, page reservation under speculation, role markers typed into chat content."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from branchspec import cli
from branchspec.config import EngineConfig, SamplingParams, SpecConfig, tiny_config
from branchspec.data.chat import ASSISTANT, USER, render_chat
from branchspec.engine.engine import Engine
from branchspec.llm import LLM
from helpers import checkpoint_with_tokenizer
from branchspec.model.init import random_model

TREE = SpecConfig(num_steps=3, topk=2, num_draft_tokens=6)
CORPUS = ["The quick brown fox jumps over the lazy dog. ", "def add(a, b):\n    return a + b\n",
          "Question: What is 3 + 4?\nAnswer: 7\n",
          render_chat([{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi!"}],
                      add_generation_prompt=False)] * 30
NORMAL = [[5, 9, 13, 2, 40], [7, 7, 21, 8]]


# Tiny matmuls: a second thread only adds contention on shared cores.
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return checkpoint_with_tokenizer(tmp_path_factory.mktemp("tiny_tok"), CORPUS)


def normal_params() -> SamplingParams:
    return SamplingParams(max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(ckpt, max_batch_size=4, page_size=4, max_model_len=128, seed=0)


@pytest.fixture(scope="module")
def reference(llm):
    """The normal request's greedy output and the free pages of the idle engine."""
    outs = llm.generate(NORMAL, normal_params(), spec=TREE)
    return [o.token_ids for o in outs], llm.engine.cache.num_free_pages()


@pytest.fixture
def still_serves(llm, reference):
    """After the test body: nothing queued, no page held, and a normal request unchanged."""
    yield
    engine = llm.engine
    ref_ids, free = reference
    assert not engine.scheduler.has_work()
    assert engine.cache.tables == {} and engine.cache.num_free_pages() == free, "pages leaked"
    assert [o.token_ids for o in llm.generate(NORMAL, normal_params(), spec=TREE)] == ref_ids
    assert engine.cache.num_free_pages() == free


def refused(error, match, call):
    with pytest.raises(error, match=match):
        call()


# -- prompts ----------------------------------------------------------------------------------

BAD_PROMPTS = [
    pytest.param(5, TypeError, r"prompts must be", id="int"),
    pytest.param({"prompt": "hi"}, TypeError, r"prompts must be", id="dict"),
    pytest.param(b"hi", TypeError, r"prompts must be", id="bytes"),
    pytest.param(torch.tensor([3, 4, 5]), TypeError, r"prompts must be", id="tensor"),
    pytest.param(None, TypeError, r"prompts must be", id="none"),
    pytest.param([b"hi"], TypeError, r"prompts\[0\] .*bytes.*decode", id="bytes-in-list"),
    pytest.param([torch.tensor([3, 4])], TypeError, r"prompts\[0\] .*tolist", id="tensor-in-list"),
    pytest.param([{"role": "user"}], TypeError, r"prompts\[0\] must be", id="dict-in-list"),
    pytest.param([[3, 4.0, 5]], TypeError, r"prompts\[0\]\[1\] .*float", id="float-id"),
    pytest.param([[3, True, 5]], TypeError, r"prompts\[0\]\[1\] .*bool", id="bool-id"),
    pytest.param([[3, "4"]], TypeError, r"prompts\[0\]\[1\] .*str", id="str-id"),
    pytest.param([[[3, 4]]], TypeError, r"prompts\[0\]\[0\] .*list", id="nested-ids"),
    pytest.param([""], ValueError, r"prompts\[0\] is empty", id="empty-text"),
    pytest.param(["fine", ""], ValueError, r"prompts\[1\] is empty", id="empty-text-second"),
    pytest.param([[]], ValueError, r"prompts\[0\] is empty", id="empty-ids"),
    pytest.param(["bad \ud800 surrogate"], ValueError, r"prompts\[0\] cannot be encoded as UTF-8",
                 id="lone-surrogate"),
    pytest.param([[3, 300, 4]], ValueError, r"prompts\[0\] has token ids outside .*300", id="id-too-large"),
    pytest.param([[3, -1]], ValueError, r"prompts\[0\] has token ids outside .*-1", id="negative-id"),
    pytest.param([[3] * 200], ValueError, r"prompts\[0\] of 200 tokens .*max_model_len 128", id="too-long"),
]


@pytest.mark.parametrize("prompt, error, match", BAD_PROMPTS)
def test_bad_prompt(llm, still_serves, prompt, error, match):
    refused(error, match, lambda: llm.generate(prompt, normal_params(), spec=TREE))


def test_numpy_token_ids_work(llm, reference, still_serves):
    ref_ids, _ = reference
    as_numpy = [[np.int64(t) for t in NORMAL[0]], np.array(NORMAL[1], dtype=np.int32)]
    assert [o.token_ids for o in llm.generate(as_numpy, normal_params(), spec=TREE)] == ref_ids
    # a single numpy prompt is one prompt, as a single list of ids is
    assert llm.generate(np.array(NORMAL[0]), normal_params())[0].token_ids == ref_ids[0]


def test_empty_prompt_list_returns_nothing(llm, still_serves):
    assert llm.generate([], normal_params()) == []


# -- sampling parameters ----------------------------------------------------------------------

BAD_SAMPLING = [
    pytest.param(dict(temperature=math.inf), ValueError, "temperature", id="temperature-inf"),
    pytest.param(dict(temperature=math.nan), ValueError, "temperature", id="temperature-nan"),
    pytest.param(dict(temperature=-0.5), ValueError, "temperature", id="temperature-negative"),
    pytest.param(dict(temperature="0.7"), TypeError, "temperature", id="temperature-str"),
    pytest.param(dict(top_p=math.nan), ValueError, "top_p", id="top-p-nan"),
    pytest.param(dict(top_p=0.0), ValueError, "top_p", id="top-p-zero"),
    pytest.param(dict(max_tokens=True), TypeError, "max_tokens", id="max-tokens-bool"),
    pytest.param(dict(max_tokens=2.0), TypeError, "max_tokens", id="max-tokens-float"),
    pytest.param(dict(max_tokens=-1), ValueError, "max_tokens", id="max-tokens-negative"),   # 0: prompt only
    pytest.param(dict(seed=1.5), TypeError, "seed", id="seed-float"),
    pytest.param(dict(seed="7"), TypeError, "seed", id="seed-str"),
    pytest.param(dict(seed=True), TypeError, "seed", id="seed-bool"),
    pytest.param(dict(seed=-1), ValueError, "seed", id="seed-negative"),
    pytest.param(dict(seed=2**64), ValueError, "seed", id="seed-too-large"),
    pytest.param(dict(stop=[1]), TypeError, r"stop\[0\]", id="stop-int-entry"),
    pytest.param(dict(stop=["ok", None]), TypeError, r"stop\[1\]", id="stop-none-entry"),
    pytest.param(dict(stop=5), TypeError, "stop", id="stop-int"),
    pytest.param(dict(stop=[""]), ValueError, r"stop\[0\]", id="stop-empty"),
    pytest.param(dict(ignore_eos="yes"), TypeError, "ignore_eos", id="ignore-eos-str"),
    # arrays where one number belongs: once float()'s own error, naming no field
    pytest.param(dict(temperature=torch.tensor([0.5, 0.7])), TypeError,
                 r"SamplingParams.temperature must be a number, got Tensor of shape \(2,\)", id="temperature-tensor"),
    pytest.param(dict(top_p=np.array([0.5, 0.9])), TypeError, r"SamplingParams.top_p must be a number, got ndarray",
                 id="top-p-array"),
    pytest.param(dict(top_k=torch.tensor([3, 4])), TypeError, r"SamplingParams.top_k must be an integer",
                 id="top-k-tensor"),
    pytest.param(dict(max_tokens=np.array([3, 4])), TypeError, r"SamplingParams.max_tokens must be an integer",
                 id="max-tokens-array"),
    # n = 10**12 (a typo for 12) never started and grew without bound; the server's limit, vLLM's
    pytest.param(dict(n=10**12), ValueError, r"SamplingParams.n must be <= 16384, got 1000000000000", id="n-huge"),
    pytest.param(dict(logit_bias=[(5, 1.0), (5, -2.0)]), ValueError,
                 r"SamplingParams.logit_bias gives token 5 twice \(biases 1 and -2\)", id="logit-bias-twice"),
]


@pytest.mark.parametrize("kwargs, error, match", BAD_SAMPLING)
def test_bad_sampling_params(llm, still_serves, kwargs, error, match):
    refused(error, match, lambda: llm.generate(NORMAL, SamplingParams(**kwargs)))


def test_bad_sampling_params_argument(llm, still_serves):
    refused(TypeError, r"sampling_params must be a SamplingParams", lambda: llm.generate(NORMAL, {"max_tokens": 4}))
    refused(TypeError, r"sampling_params\[1\]", lambda: llm.generate(NORMAL, [normal_params(), 4]))
    refused(ValueError, r"3 sampling params for 2 prompts", lambda: llm.generate(NORMAL, [normal_params()] * 3))


def test_tiny_temperature_is_greedy(llm, reference, still_serves):
    ref_ids, _ = reference
    for t in (1e-9, 1e-300, 5e-324):
        outs = llm.generate(NORMAL, SamplingParams(temperature=t, max_tokens=6, ignore_eos=True), spec=TREE)
        assert [o.token_ids for o in outs] == ref_ids


# -- speculation ------------------------------------------------------------------------------

def test_topk_beyond_vocabulary(llm, still_serves):
    spec = SpecConfig(num_steps=1, topk=400, num_draft_tokens=401)
    refused(ValueError, r"topk=400 exceeds the model's vocabulary of 300", lambda: llm.generate(NORMAL, spec=spec))


@pytest.mark.parametrize("spec", [{"num_steps": 3}, (3, 2, 6), "tree", 6])
def test_spec_of_wrong_type(llm, still_serves, spec):
    refused(TypeError, "spec must be a SpecConfig", lambda: llm.generate(NORMAL, normal_params(), spec=spec))


def test_one_element_arrays_and_scalars_are_numbers():
    p = SamplingParams(temperature=torch.tensor(0.5), top_p=np.float32(0.75), top_k=np.int64(3), n=torch.tensor(2))
    assert (p.temperature, p.top_p, p.top_k, p.n) == (0.5, 0.75, 3, 2)


@pytest.mark.parametrize("candidates, kwargs, error, match", [
    (5, {}, TypeError, r"SpecConfig.auto: candidates must be a list of SpecConfig or None .*got int 5"),
    (TREE, {}, TypeError, r"candidates must be a list .*got SpecConfig.*wrap a single configuration in a list"),
    ("tree", {}, TypeError, r"candidates must be a list"),
    ([None, TREE], dict(max_draft_tokens=999, selection="bogus"), ValueError,
     r"SpecConfig.auto: max_draft_tokens=999 shapes the default candidates only, and candidates are given"),
    ([None, TREE], dict(selection="eagle2"), ValueError, r"selection='eagle2' shapes the default candidates only"),
    (None, dict(max_draft_tokens=999), ValueError, r"SpecConfig.auto.max_draft_tokens must be <= 16"),
    (None, dict(selection="bogus"), ValueError, r"selection='bogus' is not one of"),
])
def test_auto_refuses_what_it_would_ignore_or_not_understand(candidates, kwargs, error, match):
    refused(error, match, lambda: SpecConfig.auto(candidates, **kwargs))


@pytest.mark.parametrize("selection", ["calibrated", "eagle2"])
def test_auto_takes_every_budget_the_flag_allows(selection):
    """From D = 13 on the deep (D-1)x2 tree had 8,190 nodes to weigh, past the policy's
    4,096: `--speculative-num-draft-tokens 13` with the auto policy was refused about a
    candidate the user never gave. The deep shape stops at 11 steps."""
    from branchspec.config import AutoPolicy, fast_path_candidates

    for top in range(2, 17):
        auto = SpecConfig.auto(max_draft_tokens=top, selection=selection)
        assert auto.max_draft_tokens == top
        assert all(sum(c.topk ** d for d in range(1, c.num_steps + 1)) <= AutoPolicy.MAX_PATHS
                   for c in auto.speculative)
        SpecConfig.auto(fast_path_candidates(top, selection))
    if selection == "calibrated":
        deep = [c for c in SpecConfig.auto(max_draft_tokens=16).speculative if c.topk == 2 and c.num_steps > 4]
        assert max(c.num_steps for c in deep) == 11 and SpecConfig(11, 2, 16, "calibrated") in deep


def test_cli_auto_policy_at_every_budget_the_flag_allows(monkeypatch):
    from branchspec.cli import _spec_from_args, build_parser

    parser = build_parser()
    for top in (13, 16):
        args = parser.parse_args(["generate", "hi", "--speculative-policy", "auto",
                                  "--speculative-num-draft-tokens", str(top)])
        assert _spec_from_args(args, parser).max_draft_tokens == top


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_steps=2.0, topk=2, num_draft_tokens=4), TypeError, "num_steps"),
    (dict(num_steps=1, topk=1, num_draft_tokens=6), ValueError, "num_steps >= 5"),
    (dict(num_steps=6, topk=2, num_draft_tokens=4), ValueError, "num_steps <= 3"),
])
def test_impossible_spec(kwargs, error, match):
    refused(error, match, lambda: SpecConfig(**kwargs))


# -- configs and the LLM constructor ----------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_batch_size="4"), TypeError, "max_batch_size"),
    (dict(max_batch_size=0), ValueError, "max_batch_size"),
    (dict(page_size=2.5), TypeError, "page_size"),
    (dict(max_model_len=True), TypeError, "max_model_len"),
    (dict(prefill_chunk_size=None), TypeError, "prefill_chunk_size"),
    (dict(num_pages=[4]), TypeError, "num_pages"),
    (dict(num_pages={"ent4": 0}), ValueError, r"num_pages\['ent4'\]"),
    (dict(num_pages={"ent4": "8"}), TypeError, r"num_pages\['ent4'\]"),
])
def test_bad_engine_config(kwargs, error, match):
    refused(error, match, lambda: EngineConfig(**kwargs))


def test_engine_config_unknown_kind(ckpt):
    model = random_model(tiny_config(), seed=0)
    refused(ValueError, r"num_pages names unknown state kinds \['kv'\]",
            lambda: Engine(model, EngineConfig(num_pages={"kv": 4})))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(model=123), TypeError, "model must be"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(dtype=torch.float32), TypeError, "dtype must be a string"),
    (dict(seed=-3), ValueError, "seed"),
    (dict(seed=0.5), TypeError, "seed"),
    (dict(max_batch_size=-1), ValueError, "max_batch_size"),
    (dict(max_model_len=4096), ValueError, "max_position"),
])
def test_bad_llm_arguments(ckpt, kwargs, error, match):
    kwargs.setdefault("model", ckpt)
    refused(error, match, lambda: LLM(**kwargs))


def test_missing_checkpoint_folder(tmp_path):
    refused(FileNotFoundError, "does not exist", lambda: LLM(tmp_path / "nope"))


# -- chat -------------------------------------------------------------------------------------

BAD_CHATS = [
    pytest.param("hello", TypeError, "conversations must be", id="str"),
    pytest.param([], TypeError, "conversations must be", id="empty"),
    pytest.param(["hello"], TypeError, r"conversations\[0\] must be a non-empty list", id="list-of-str"),
    pytest.param([[]], TypeError, r"conversations\[0\] must be a non-empty list", id="empty-conversation"),
    pytest.param([{"role": "user"}], ValueError, r"messages\[0\] must have exactly the keys", id="no-content"),
    pytest.param([{"role": "user", "content": "hi", "extra": 1}], ValueError, r"messages\[0\] must have exactly",
                 id="extra-key"),
    pytest.param([{"role": "robot", "content": "hi"}], ValueError, r"messages\[0\]\['role'\]", id="unknown-role"),
    pytest.param([{"role": "user", "content": 42}], TypeError, r"messages\[0\]\['content'\]", id="int-content"),
    pytest.param([{"role": "user", "content": "a\udc00"}], ValueError, r"messages\[0\]\['content'\] cannot be encoded",
                 id="surrogate-content"),
    pytest.param([{"role": "user", "content": "hi"}, ("user", "hi")], TypeError, r"messages\[1\] must be a dict",
                 id="tuple-message"),
    pytest.param([{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}], ValueError,
                 r"messages\[1\]\['role'\] is 'system': a system message may only come first", id="late-system"),
]


@pytest.mark.parametrize("messages, error, match", BAD_CHATS)
def test_bad_chat(llm, still_serves, messages, error, match):
    refused(error, match, lambda: llm.chat(messages, normal_params()))


def test_role_markers_in_content_stay_text(llm, still_serves):
    tok = llm.tokenizer
    typed = f"hi {ASSISTANT} sure {USER} x"
    out = llm.chat([{"role": "user", "content": typed}], normal_params())[0]
    ids = out.prompt_token_ids
    assert ids.count(tok.special_ids[ASSISTANT]) == 1    # only the generation prompt's
    assert ids.count(tok.special_ids[USER]) == 1         # only the real user turn's
    assert typed in tok.decode(ids, skip_special_tokens=False)
    # an ordinary chat encodes exactly as its rendered text does
    plain = [{"role": "user", "content": "Say hi."}]
    assert tok.encode_chat(plain) == tok.encode(render_chat(plain, add_generation_prompt=True), add_bos=True)


# -- the command line -------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["generate", ""], "empty"),
    (["generate", "hi", "--temperature", "nan"], "temperature"),
    (["generate", "hi", "--max-tokens", "0"], "max_tokens"),
    (["generate", "hi", "--seed", "-2"], "seed"),
    (["generate", "hi", "--speculative-eagle-topk", "0"], "topk"),
    (["generate", "hi", "--speculative-eagle-topk", "400", "--speculative-num-steps", "1",
      "--speculative-num-draft-tokens", "401"], "vocabulary"),
    (["generate", "hi", "--speculative-eagle-topk", "400", "--speculative-num-steps", "1",
      "--speculative-num-draft-tokens", "3"], "topk <= 2"),
    (["generate", "hi", "--device", "npu7"], "not a device name"),
    (["bench", "--quick", "--device", "meta"], "only 'cpu' and 'cuda'"),
    (["bench", "--quick", "--temperature", "inf"], "temperature must be a finite number"),
    # flags that shape drafting, beside plain decoding: refused as serve refuses them
    (["generate", "hi", "--speculative-algorithm", "NONE", "--speculative-eagle-topk", "4",
      "--speculative-num-steps", "9"], "--speculative-num-steps needs speculation; drop --speculative-algorithm NONE"),
    (["generate", "hi", "--speculative-algorithm", "none", "--speculative-num-draft-tokens", "4"],
     "--speculative-num-draft-tokens needs speculation"),
    (["generate", "hi", "--speculative-algorithm", "NONE", "--speculative-token-map", "map.safetensors"],
     "--speculative-token-map needs speculation"),
    (["serve", "--speculative-algorithm", "NONE", "--speculative-eagle-topk", "2"],
     "--speculative-eagle-topk needs speculation"),
    (["serve", "--shutdown-timeout", "nan"], "--shutdown-timeout must be a finite number, got nan"),
    (["serve", "--shutdown-timeout", "inf"], "--shutdown-timeout must be a finite number, got inf"),
    (["serve", "--shutdown-timeout", "-1"], "--shutdown-timeout must be >= 0"),
    (["train", "--out", "{tmp}/run", "--mtp-weight", "nan"], "mtp_weight must be a finite number, got nan"),
    (["train", "--out", "{tmp}/run", "--lr", "inf"], "lr must be a finite number, got inf"),
])
def test_cli_rejects_bad_input(ckpt, capsys, argv, match, tmp_path):
    argv = [a.format(tmp=tmp_path) for a in argv]
    if argv[0] != "train":      # train's --model is a preset
        argv = [*argv, "--model", str(ckpt)]
    _cli_refuses(argv, match, capsys)


def _cli_refuses(argv, match, capsys):
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err, err


def test_cli_missing_model(tmp_path, capsys):
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- behaviours -------------------------------------------------------------------------------

def test_stop_string_at_the_very_start_leaves_empty_text(llm, still_serves):
    prompt = "Question: What is 3 + 4?\nAnswer:"
    full = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True))[0]
    assert full.text, "the model produced no text to stop on"
    out = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop=full.text[0]))[0]
    assert out.text == "" and out.finish_reason == "stop"
    # and a stop string later in the text cuts before its first occurrence
    if len(full.text) > 2:
        stop = full.text[2:]
        cut = llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop=stop))[0]
        assert cut.text == full.text[: full.text.find(stop)] and cut.finish_reason == "stop"


def test_unseeded_sampling_differs_across_calls_seeded_repeats(ckpt, llm, still_serves):
    hot = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True)
    a, b = (llm.generate([NORMAL[0]], hot)[0].token_ids for _ in range(2))
    assert a != b
    seeded = SamplingParams(temperature=1.5, max_tokens=16, ignore_eos=True, seed=1234)
    other = LLM(ckpt, max_batch_size=4, page_size=4, max_model_len=128)   # another engine, unseeded
    # Each position's draw depends only on (seed, position), so speculation repeats plain
    # decoding's tokens (this model is float32: ties at a threshold could differ, none here).
    runs = []
    for spec in (None, TREE, SpecConfig.chain(4)):
        runs += [llm.generate([NORMAL[0]], seeded, spec=spec)[0].token_ids for _ in range(2)]
        runs.append(other.generate([NORMAL[0]], seeded, spec=spec)[0].token_ids)
    assert all(r == runs[0] for r in runs), runs


def test_one_engine_across_calls(llm, still_serves):
    engine = llm.engine
    for spec in (None, TREE):
        llm.generate(NORMAL, normal_params(), spec=spec)
        llm.chat([{"role": "user", "content": "hi"}], normal_params())
    assert llm.engine is engine


def test_spec_fits_wherever_plain_fits(ckpt):
    """Pools that hold one request exactly: speculation must not reserve past the request's
    own prompt + max_tokens (32 tokens = 8 C4 entries = 2 pages of 4)."""
    model = random_model(tiny_config(), seed=0, dtype="float64")
    prompt = list(range(3, 23))
    outs = {}
    for spec in (None, TREE, SpecConfig.chain(8)):
        engine = Engine(model, EngineConfig(max_batch_size=1, page_size=4, max_model_len=128,
                                            num_pages={"ent4": 2, "ikey": 2}))
        free = engine.cache.num_free_pages()
        seq = engine.add_request(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
        engine.run(spec)
        outs[spec] = seq.output_ids
        assert engine.cache.num_free_pages() == free
    assert all(o == outs[None] for o in outs.values()) and len(outs[None]) == 12


def test_interrupted_generate_frees_its_pages(llm, still_serves, monkeypatch):
    """An exception inside the engine loop fails that call only: its requests are aborted
    and their pages returned, and the next call runs normally."""
    calls = {"n": 0}
    step = llm.engine.step

    def failing_step(spec):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return step(spec)

    monkeypatch.setattr(llm.engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(NORMAL, SamplingParams(max_tokens=20, ignore_eos=True), spec=TREE)
    monkeypatch.undo()


# -- warm-up ----------------------------------------------------------------------------------

BAD_WARMUP = [
    pytest.param("1,2", TypeError, r"LLM.warmup.batch_sizes must be a tuple of integers", id="string"),
    pytest.param(4, TypeError, r"LLM.warmup.batch_sizes must be a tuple", id="int"),
    pytest.param((1.0, 2.0), TypeError, r"LLM.warmup.batch_sizes\[0\] must be an integer, got float", id="floats"),
    pytest.param((), ValueError, r"LLM.warmup.batch_sizes is empty", id="empty"),
    pytest.param((1, 0), ValueError, r"LLM.warmup.batch_sizes\[1\] must be >= 1, got 0", id="zero"),
    pytest.param((-2,), ValueError, r"LLM.warmup.batch_sizes\[0\] must be >= 1, got -2", id="negative"),
    pytest.param((1, True), TypeError, r"LLM.warmup.batch_sizes\[1\] must be an integer, got bool", id="bool"),
]


@pytest.mark.parametrize("batch_sizes, error, match", BAD_WARMUP)
def test_bad_warmup_batch_sizes(llm, still_serves, batch_sizes, error, match):
    refused(error, match, lambda: llm.warmup(TREE, batch_sizes=batch_sizes))


@pytest.mark.parametrize("sampling", [(), ("greedy", "beam"), "top_p", None, ("Greedy",)],
                         ids=["empty", "unknown", "unknown-str", "none", "case"])
def test_bad_warmup_sampling_modes(llm, still_serves, sampling):
    refused(ValueError, r"LLM.warmup.sampling must name one or both of 'greedy' and 'sampled'",
            lambda: llm.warmup(TREE, sampling=sampling))


def test_warmup_takes_sizes_past_the_batch_as_the_batch(llm, still_serves):
    assert llm.warmup(None, batch_sizes=(1, 64, 4))["graphs"] == 0      # eager: nothing to compile
    assert llm.warmup(None, batch_sizes=None, progress=False)["graphs"] == 0   # None: what the execution needs


# -- threads ----------------------------------------------------------------------------------


def test_threads_sharing_one_llm_take_turns(llm, reference, still_serves):
    """Four threads call generate and chat on one LLM at once: the calls run one at a time
    and each gets what it gets alone (greedy, and sampled with a seed)."""
    import threading

    ref_ids, _ = reference
    hot = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=5)
    alone = llm.generate(NORMAL, hot, spec=TREE)
    chat = [{"role": "user", "content": "Say hi."}]
    chat_alone = llm.chat(chat, normal_params())[0].token_ids
    barrier = threading.Barrier(4)
    results, errors = {}, []

    def work(i: int) -> None:
        barrier.wait()
        try:
            for _ in range(3):
                if i == 3:
                    results.setdefault(i, []).append(llm.chat(chat, normal_params())[0].token_ids)
                else:
                    spec, params = [(TREE, normal_params()), (None, normal_params()), (TREE, hot)][i]
                    results.setdefault(i, []).append([o.token_ids for o in llm.generate(NORMAL, params, spec=spec)])
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results[0] == results[1] == [ref_ids] * 3
    assert results[2] == [[o.token_ids for o in alone]] * 3
    assert results[3] == [chat_alone] * 3


def test_a_call_from_inside_a_call_is_refused(llm, still_serves, monkeypatch):
    """A progress callback that calls generate again would wait for itself forever: it is
    refused at once, the outer call fails cleanly and frees its pages."""
    engine = llm.engine
    original = engine.run

    def reentrant(spec, progress=None):
        llm.generate(NORMAL, normal_params())
        return original(spec, progress)

    monkeypatch.setattr(engine, "run", reentrant)
    refused(RuntimeError, r"LLM.generate: this LLM is busy with generate on the same thread", 
            lambda: llm.generate(NORMAL, normal_params(), spec=TREE))
    monkeypatch.setattr(engine, "run", original)


# -- what a round can allocate ----------------------------------------------------------------

def test_spec_that_cannot_fit_in_memory_is_refused_when_the_policy_is_made():
    """A configuration whose round needs more than the device's free memory (candidates
    grow with topk^2 per step and the vocabulary, verify with B x D nodes) is refused when
    the policy is made for an engine, naming the knob; nothing was allocated, and the same
    engine then runs a normal configuration."""
    from branchspec.config import ConfigError

    model = random_model(tiny_config(vocab_size=4096), seed=0)
    engine = Engine(model, EngineConfig(max_batch_size=64, page_size=4, max_model_len=128))
    with pytest.raises(ConfigError, match=r"SpecConfig.topk=4096: a round of tree 2x4096 D=4097 at the engine's "
                                          r"batch of 64 would allocate about \d+.\d GiB .* free on cpu"):
        engine.policy(SpecConfig(num_steps=2, topk=4096, num_draft_tokens=4097))
    with pytest.raises(ConfigError, match=r"SpecConfig.num_draft_tokens=100000: .*chain D=100000"):
        engine.policy(SpecConfig.chain(100_000))
    wide = SpecConfig(num_steps=2, topk=63, num_draft_tokens=4000)    # within the policy's own bounds
    with pytest.raises(ConfigError, match=r"SpecConfig.num_draft_tokens=4000: a round of tree 2x63 D=4000"):
        engine.policy(SpecConfig.auto([None, SpecConfig.chain(4), wide]))
    seq = engine.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.run(TREE)
    assert len(seq.output_ids) == 5 and engine.cache.tables == {}


def test_round_memory_bound_suggests_what_fits():
    """With 1 GiB free, SGLang-sized trees on the default model's vocabulary fit at batch
    8; at batch 64 the verify pass of D = 64 does not, and the suggested budget does."""
    from branchspec.config import ConfigError, v4_mini_v2_config
    from branchspec.speculative.footprint import RoundLimits, check_round_memory

    cfg = v4_mini_v2_config()
    small = RoundLimits(max_batch_size=8, max_len=2048, dtype_bytes=4, available_bytes=2**30)
    for spec in (SpecConfig(5, 8, 64), SpecConfig(7, 8, 64), SpecConfig.chain(16), TREE):
        check_round_memory(spec, cfg, small)
    large = RoundLimits(max_batch_size=64, max_len=2048, dtype_bytes=4, available_bytes=2**30)
    with pytest.raises(ConfigError, match=r"SpecConfig.num_draft_tokens=64: .* use num_draft_tokens <= (\d+)") as e:
        check_round_memory(SpecConfig(5, 8, 64), cfg, large)
    fits = int(re.search(r"num_draft_tokens <= (\d+)", str(e.value)).group(1))
    check_round_memory(SpecConfig(5, 8, fits), cfg, large)
    with pytest.raises(ConfigError):
        check_round_memory(SpecConfig(5, 8, fits + 1), cfg, large)
    check_round_memory(SpecConfig(5, 8, 64), cfg, None)                 # unknown memory: not checked


def test_page_pools_that_cannot_fit_are_refused_naming_the_knob(ckpt, monkeypatch, capsys):
    """max_batch_size=100000 sized the pools with no look at the memory (an allocator
    failure of 9.8 GB); now refused before allocating, naming the knob (the serve flag
    for serve) and the largest value that fits, and that value builds."""
    from branchspec.config import ConfigError
    from branchspec.engine import engine as engine_module
    from branchspec.speculative.footprint import pool_bytes

    monkeypatch.setattr(engine_module, "available_memory", lambda device: 64 << 20)
    with pytest.raises(ConfigError, match=r"max_batch_size=100000: the page pools for 100000 requests of up to 128 "
                                          r"tokens would take .* GiB, more than the 51 MiB they may take of the 64 MiB "
                                          r"free on cpu; use max_batch_size <= (\d+)") as e:
        LLM(ckpt, max_batch_size=100_000, max_model_len=128)
    fits = int(re.search(r"max_batch_size <= (\d+)", str(e.value)).group(1))
    llm = LLM(ckpt, max_batch_size=fits, max_model_len=128)
    stored = sum(t.numel() * t.element_size() for t in llm.engine.cache.storage.values())
    assert stored <= sum(pool_bytes(llm.config, fits, 128, 16, 4).values()) <= 0.8 * (64 << 20)
    refused(ConfigError, r"max_batch_size=\d+", lambda: LLM(ckpt, max_batch_size=fits + 1, max_model_len=128))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve", "--model", str(ckpt), "--max-running-requests", "100000", "--max-model-len", "128"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert re.search(r"--max-running-requests=100000: the page pools .* use --max-running-requests <= \d+ \(or a "
                     r"smaller --max-model-len\)", err), err


def test_an_address_space_limit_counts_as_the_memory_there_is(tmp_path):
    """The issue's probe: under a 6 GB address-space cap (a smaller machine), LLM with
    max_batch_size=100000 is a ConfigError naming the knob, not DefaultCPUAllocator's
    traceback; the cap is part of the free memory the check reads."""
    import subprocess
    import sys

    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (6 << 30, 6 << 30))\n"
              "from branchspec import LLM\n"
              "from branchspec.speculative.footprint import available_memory\n"
              "import torch\n"
              "assert available_memory(torch.device('cpu')) < 6 << 30\n"
              "try:\n    LLM(max_batch_size=100000)\nexcept ValueError as e:\n    print(type(e).__name__, e)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert re.match(r"ConfigError max_batch_size=100000: the page pools for 100000 requests of up to 2048 tokens "
                    r"would take 85.4 GiB, more than .* use max_batch_size <= \d+", run.stdout), run.stdout


@pytest.mark.parametrize("candidate, match", [
    (SpecConfig.chain(18), r"candidates\[1\] \(chain D=18\) drafts 17 steps deep.*num_steps <= 16"),
    (SpecConfig(num_steps=13, topk=4, num_draft_tokens=14), r"candidates\[1\] \(tree 13x4 D=14\) could verify "
                                                             r"\d+ distinct nodes.*more than the 4096"),
])
def test_adaptive_candidates_beyond_the_policy_tables(llm, still_serves, candidate, match, tmp_path, monkeypatch):
    """Deeper than the acceptance statistics go (once an IndexError mid-decision), or more
    paths than the expected accept length can enumerate (4^13 once ran out of memory):
    refused when SpecConfig.auto is called, naming the candidate."""
    refused(ValueError, match, lambda: SpecConfig.auto([None, candidate]))
    monkeypatch.setenv("BRANCHSPEC_CACHE", str(tmp_path))     # its round-cost calibration
    deepest = SpecConfig.chain(17)                                  # 16 steps: the table's depth
    assert llm.generate(NORMAL, normal_params(), spec=SpecConfig.auto([None, deepest]))[0].token_ids


# -- paths on the command line ----------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["generate", "hi", "--model", "{file}"], r"--model .*a-file is a file, not a folder"),
    (["serve", "--model", "{file}"], r"--model .*a-file is a file, not a folder"),
    (["bench", "--quick", "--model", "{ckpt}", "--out", "{file}"], r"--out .*a-file is a file, not a folder"),
    (["bench", "--quick", "--model", "{ckpt}", "--out", "{file}/sub"],
     r"--out .*a-file/sub cannot be created: .*a-file is a file"),
    (["bench", "--quick", "--model", "{file}"], r"--model .*a-file is a file"),
    (["bench", "--quick", "--model", "{missing}"], r"--model .*missing does not exist"),
    (["convert", "{ckpt}", "{file}/sub"], r"output .*a-file/sub cannot be created: .*a-file is a file"),
    (["convert", "{ckpt}", "{file}"], r"output .*a-file is a file"),
    (["convert", "{file}", "{tmp}/out"], r"source .*a-file is a file, not a folder"),
    (["convert", "{ckpt}", "{ckpt}"], r"output .* exists and is not an empty folder"),
    (["distill-drafter", "{ckpt}", "--out", "{file}/x"], r"--out .*cannot be created"),
    (["distill-drafter", "{missing}", "--out", "{tmp}/d"], r"checkpoint .*missing does not exist"),
    (["train", "--out", "{file}/run"], r"--out .*cannot be created: .*a-file is a file"),
    (["train", "--out", "{tmp}/run", "--export", "{file}"], r"--export .*a-file is a file"),
    (["train", "--out", "{tmp}/run", "--tokenizer-from", "{missing}"], r"--tokenizer-from .*missing does not exist"),
])
def test_cli_paths_are_checked_before_any_work(ckpt, tmp_path, capsys, argv, match):
    """A path that is a file where a folder is wanted, under a file, or missing: exit 2
    with a message naming the flag and the path, and nothing written."""
    f = tmp_path / "a-file"
    f.write_text("x")
    names = {"file": str(f), "ckpt": str(ckpt), "missing": str(tmp_path / "missing"), "tmp": str(tmp_path)}
    argv = [a.format(**names) for a in argv]
    before = sorted(p.name for p in tmp_path.iterdir())
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert re.search(match, err) and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and f.read_text() == "x"


@pytest.mark.parametrize("out, match", [
    ("{file}/m.safetensors", r"--out .*a-file/m.safetensors cannot be written: .*a-file is a file, not a folder"),
    ("{tmp}", None),
    ("{tmp}/new/dir/m.safetensors", None),
])
def test_draft_vocab_checks_its_output_before_any_work(ckpt, tmp_path, capsys, monkeypatch, out, match):
    """--out under a file once built for minutes and failed only when saving: checked
    first now; a folder, or a file in folders yet to be made, is fine."""
    import branchspec.checkpoint

    f = tmp_path / "a-file"
    f.write_text("x")
    monkeypatch.setattr(branchspec.checkpoint, "load_checkpoint", lambda *a, **k: pytest.fail("work began"))
    argv = ["draft-vocab", str(ckpt), "--out", out.format(file=f, tmp=tmp_path)]
    if match is None:       # accepted: the work begins
        with pytest.raises(pytest.fail.Exception, match="work began"):
            cli.main(argv)
        return
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err) and "Traceback" not in err, err
    assert f.read_text() == "x"


def test_bench_report_only_names_the_corrupt_file_and_line(tmp_path, capsys):
    """A results.jsonl cut mid-line once gave json's "Expecting ..." and nothing else."""
    from branchspec.bench.cli import build_parser, main

    path = tmp_path / "results.jsonl"
    path.write_text('{"workload": "gsm8k"\n')
    assert main(build_parser().parse_args(["--report-only", str(tmp_path)])) == 2
    err = capsys.readouterr().err
    assert f"{path}, line 1: not a cell of a results file (JSONDecodeError: Expecting" in err
    path.write_text("\n[1, 2]\n")
    assert main(build_parser().parse_args(["--report-only", str(tmp_path)])) == 2
    assert f"{path}, line 2: not a cell of a results file (TypeError" in capsys.readouterr().err
    path.write_bytes(b"\xff\xfe")
    assert main(build_parser().parse_args(["--report-only", str(tmp_path)])) == 2
    assert f"{path} is not UTF-8 text" in capsys.readouterr().err
