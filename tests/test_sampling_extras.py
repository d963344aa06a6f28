"""vLLM's sampling extras keep speculation lossless: top_k, min_p, min_tokens,
stop_token_ids, logit_bias, the three penalties, n > 1 and prompt-only requests.

Greedy speculative output equals plain greedy output token for token (chain and tree,
batch 1 and a mixed batch) with every rule on; plain greedy with penalties equals a
reference written straight from vLLM's definitions over full-sequence forwards; sampled
speculative output follows the exact transformed target distribution (chi-square), with
zero counts wherever a cut leaves zero probability. Tiny models in float64.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from branchspec.checkpoint import save_checkpoint
from branchspec.config import SamplingParams, SpecConfig, tiny_config
from branchspec.llm import LLM
from branchspec.model.init import random_model
from branchspec.sampling import sampling_probs
from branchspec.train.losses import train_steps
from conftest import markov_batches
from test_spec_decode import chi2_sf

pytestmark = pytest.mark.usefixtures("one_thread")

TREE, CHAIN = SpecConfig(3, 2, 6), SpecConfig.chain(5)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny plain model trained briefly on a Markov chain (its drafter agrees often)."""
    cfg = tiny_config()
    model = random_model(cfg, seed=0, std=0.1)
    train_steps(model, markov_batches(cfg.vocab_size, 60), lr=1e-2)
    folder = tmp_path_factory.mktemp("extras")
    save_checkpoint(model.double(), folder)
    return folder, model.double().eval()


@pytest.fixture(scope="module")
def llm(trained):
    return LLM(trained[0], dtype="float64", max_batch_size=8)


@pytest.fixture(scope="module")
def prompts():
    lengths = [5, 40, 3, 17, 9, 30]
    data = next(markov_batches(64, 1, batch=len(lengths), length=60, seed=7))
    return [data[i, :n].tolist() for i, n in enumerate(lengths)]


# -- the distribution's cuts -------------------------------------------------------------
def test_sampling_probs_top_k_and_min_p():
    logits = torch.log(torch.tensor([[[0.4, 0.3, 0.15, 0.1, 0.05]]], dtype=torch.float64))
    one, all_ = torch.tensor([1.0]), torch.tensor([1.0])

    def probs(**kw):
        return sampling_probs(logits, one, kw.pop("top_p", all_), **kw)[0, 0]

    def t(*values):
        return torch.tensor(values, dtype=torch.float64)

    torch.testing.assert_close(probs(top_k=torch.tensor([2])), t(4 / 7, 3 / 7, 0, 0, 0))
    torch.testing.assert_close(probs(top_k=torch.tensor([0])), logits.exp()[0, 0])      # 0: every token
    torch.testing.assert_close(probs(top_k=torch.tensor([99])), logits.exp()[0, 0])     # more than V: every token
    # min_p 0.3: below 0.3 * 0.4 = 0.12 goes
    torch.testing.assert_close(probs(min_p=torch.tensor([0.3])), t(0.4, 0.3, 0.15, 0, 0) / 0.85)
    # top-p after the others, on the renormalised mass: top-3 leaves (8, 6, 3) / 17, top_p 0.8 keeps two
    torch.testing.assert_close(probs(top_k=torch.tensor([3]), top_p=torch.tensor([0.8])), t(4 / 7, 3 / 7, 0, 0, 0))
    tied = torch.log(torch.tensor([[[0.3, 0.3, 0.3, 0.1]]], dtype=torch.float64))
    p = sampling_probs(tied, one, all_, top_k=torch.tensor([2]))[0, 0]
    torch.testing.assert_close(p, t(1 / 3, 1 / 3, 1 / 3, 0))   # ties with the k-th kept, as vLLM
    # rows are independent: one row's settings never touch another's
    two = sampling_probs(logits.expand(2, 1, 5), torch.ones(2), torch.ones(2), top_k=torch.tensor([2, 0]),
                         min_p=torch.tensor([0.0, 0.3]))
    torch.testing.assert_close(two[0, 0], probs(top_k=torch.tensor([2])))
    torch.testing.assert_close(two[1, 0], probs(min_p=torch.tensor([0.3])))


# -- a reference written from vLLM's definitions --------------------------------------------
def reference_logits(raw: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams,
                     stop_ids: set[int]) -> torch.Tensor:
    """One row, token by token: bias, min_tokens ban, repetition, frequency, presence."""
    x = raw.double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(output) < p.min_tokens:
        for t in stop_ids:
            x[t] = float("-inf")
    for v in range(x.shape[0]):
        count = output.count(v)
        if v in prompt or count:
            x[v] = x[v] / p.repetition_penalty if x[v] > 0 else x[v] * p.repetition_penalty
        x[v] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return x


def reference_probs(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """temperature, then min-p, top-k (ties kept), top-p on what is left."""
    probs = torch.softmax(x / p.temperature, -1)
    probs = torch.where(probs >= p.min_p * probs.max(), probs, 0.0)
    if p.top_k > 0:
        kth = probs.sort(descending=True).values[p.top_k - 1]
        probs = torch.where(probs >= kth, probs, 0.0)
    probs = probs / probs.sum()
    kept, mass = torch.zeros_like(probs), 0.0
    for v in probs.argsort(descending=True).tolist():
        if mass >= p.top_p:
            break
        kept[v], mass = probs[v], mass + probs[v].item()
    return kept / kept.sum()


def reference_greedy(model, prompt: list[int], p: SamplingParams, stop_ids: set[int]) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        while len(out) < p.max_tokens:
            raw = model.full_forward(torch.tensor([prompt + out]))[0].logits[0, -1]
            out.append(int(reference_logits(raw, prompt, out, p, stop_ids).argmax()))
            if out[-1] in stop_ids and not p.ignore_eos:
                break
    return out


PENALISED = [SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=1.5),
             SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=0.7),
             SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.8),
             SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=0.6, frequency_penalty=-0.4,
                            presence_penalty=0.3, logit_bias={7: 2.5, 9: -1.0})]


def test_penalties_match_vllms_definitions(trained, llm, prompts):
    """Plain greedy decoding with penalties and a logit bias equals the token-by-token
    reference, and the rules really change the output."""
    model = trained[1]
    plain = [o.token_ids for o in llm.generate(prompts[:4], SamplingParams(max_tokens=24, ignore_eos=True))]
    got = [o.token_ids for o in llm.generate(prompts[:4], PENALISED)]
    want = [reference_greedy(model, q, p, set()) for q, p in zip(prompts, PENALISED)]
    assert got == want
    assert all(g != w for g, w in zip(got, plain)), "a penalty changed nothing: the test would prove little"


def extras_batch(llm) -> list[SamplingParams]:
    """Every rule, one request each, beside a plain one: greedy throughout."""
    eos = llm.config.eos_token_id
    return [SamplingParams(max_tokens=30, ignore_eos=True),
            *PENALISED[:3],
            dataclasses.replace(PENALISED[3], max_tokens=30),
            # EOS made the argmax everywhere: min_tokens alone holds it off for 6 tokens
            SamplingParams(max_tokens=30, min_tokens=6, logit_bias={eos: 50.0}),
            SamplingParams(max_tokens=30, temperature=1.0, top_k=1, seed=3, ignore_eos=True),   # greedy-like
            SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[11, 12], min_tokens=4)]


@pytest.mark.parametrize("spec", [CHAIN, TREE], ids=["chain5", "tree326"])
def test_greedy_with_every_rule_speculative_equals_plain(llm, prompts, spec):
    params = extras_batch(llm)
    batch = [prompts[i % len(prompts)] for i in range(len(params))]
    plain = llm.generate(batch, params)
    mixed = llm.generate(batch, params, spec=spec)
    assert [o.token_ids for o in mixed] == [o.token_ids for o in plain]
    assert llm.last_stats.accept_length > 1.3, "drafts were hardly accepted: the test would prove little"
    alone = [llm.generate([q], p, spec=spec)[0].token_ids for q, p in zip(batch, params)]
    assert alone == [o.token_ids for o in plain]
    eos = llm.config.eos_token_id
    banned = plain[5]
    assert len(banned.token_ids) == 7 and banned.token_ids[-1] == eos and eos not in banned.token_ids[:6]
    assert (banned.finish_reason, banned.stop_reason) == ("stop", None)
    assert plain[6].token_ids == plain[0].token_ids          # top_k=1 at temperature 1 is greedy
    stopped = plain[7]
    if stopped.finish_reason == "stop":                      # a stop id ends it, kept in token_ids
        assert stopped.token_ids[-1] in (11, 12) and stopped.stop_reason == stopped.token_ids[-1]
        assert not set(stopped.token_ids[4:-1]) & {11, 12} and len(stopped.token_ids) > 4
    else:
        assert not set(stopped.token_ids[4:]) & {11, 12}


def test_stop_token_ids_stop_even_with_ignore_eos(llm, prompts):
    free = llm.generate([prompts[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop = free[5]
    for spec in (None, TREE):
        o = llm.generate([prompts[1]], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop]),
                         spec=spec)[0]
        assert o.token_ids == free[:free.index(stop) + 1]
        assert (o.finish_reason, o.stop_reason) == ("stop", stop)
        # with min_tokens past its first place the id cannot come there (banned), and the
        # output runs on from a different token
        late = llm.generate([prompts[1]], SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[stop],
                                                         min_tokens=free.index(stop) + 1), spec=spec)[0]
        assert stop not in late.token_ids[:free.index(stop) + 1]


# -- sampled: the exact transformed distribution ----------------------------------------------
def test_sampled_speculative_with_every_cut_follows_the_target(tmp_path):
    """Chi-square of (x2, x3) against P computed by the reference with temperature, min_p,
    top_k, top_p, all three penalties and a logit bias: each node of the tree is
    transformed by its own prefix. Cells the cuts empty must stay empty."""
    cfg = tiny_config(vocab_size=8, compress_ratios=(0, 4, 0, 4), index_topk=2)
    model = random_model(cfg, seed=4, dtype="float64", std=0.25)
    save_checkpoint(model, tmp_path)
    llm = LLM(tmp_path, dtype="float64", max_batch_size=64)
    prompt = [3, 5, 7, 6, 4, 5, 3]
    rule = SamplingParams(temperature=0.9, top_k=5, min_p=0.02, top_p=0.97, presence_penalty=0.6,
                          frequency_penalty=0.4, repetition_penalty=1.4, logit_bias={2: 0.7},
                          max_tokens=3, ignore_eos=True)
    n = 1500
    params = [dataclasses.replace(rule, seed=2000 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, spec=SpecConfig(2, 2, 4))
    assert sum(o.num_rounds for o in outs) < 2 * n, "no round accepted a draft"
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1

    with torch.no_grad():
        def dist(output: list[int]) -> torch.Tensor:
            raw = model.full_forward(torch.tensor([prompt + output]))[0].logits[0, -1]
            return reference_probs(reference_logits(raw, prompt, output, rule, set()), rule)

        expected = torch.zeros(8, 8, dtype=torch.float64)
        p1 = dist([])
        for a in range(8):
            if p1[a] == 0:
                continue
            p2 = dist([a])
            for b in range(8):
                if p2[b] > 0:
                    expected[b] += p1[a] * p2[b] * dist([a, b])
    expected *= n
    assert counts[expected == 0].sum() == 0, "a token the cuts rule out was emitted"
    assert (expected == 0).any(), "no cut bit: the test would prove little"
    mask = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[mask]).sum().item()
    dof = int(mask.sum()) - 1
    assert chi2_sf(chi2, dof) > 1e-3, f"chi2={chi2:.1f} dof={dof}"
    # power: the distribution without the rules is far from what came out
    plain = torch.zeros(8, 8, dtype=torch.float64)
    with torch.no_grad():
        lp = torch.softmax(model.full_forward(torch.tensor([prompt + list(t) for t in itertools.product(range(8),
                                                                                                      repeat=2)]))[0]
                           .logits.double() / 0.9, -1)
        P = len(prompt)
        plain = torch.einsum("a,ab,abc->bc", lp[0, P - 1], lp[:, P].view(8, 8, 8)[:, 0], lp[:, P + 1].view(8, 8, 8)) * n
    chi2_plain = ((counts - plain) ** 2 / plain).sum().item()
    assert chi2_sf(chi2_plain, 63) < 1e-6


# -- n samples and prompt-only requests --------------------------------------------------------
def test_n_samples_are_seeded_requests_of_one_batch(llm, prompts):
    p = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7, n=3, logprobs=1)
    out = llm.generate([prompts[0], prompts[2]], p, spec=TREE)
    assert len(out) == 2 and [len(o.outputs) for o in out] == [3, 3]
    for q, o in zip([prompts[0], prompts[2]], out):
        assert [c.index for c in o.outputs] == [0, 1, 2] and o.prompt_token_ids == q
        for i, c in enumerate(o.outputs):
            alone = llm.generate([q], SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7 + i,
                                                     logprobs=1), spec=TREE)[0]
            assert c.token_ids == alone.token_ids      # sample i is seed + i, whatever runs beside it
            assert c.cumulative_logprob == pytest.approx(sum(d[t] for d, t in zip(alone.logprobs, alone.token_ids)))
        assert len({tuple(c.token_ids) for c in o.outputs}) > 1
        # the first sample's fields, read off the request as before n existed
        assert (o.token_ids, o.text, o.finish_reason, o.accept_length, o.logprobs) == (
            o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason, o.outputs[0].accept_length,
            o.outputs[0].logprobs)
    with pytest.raises(ValueError, match="n=2"):
        llm.engine.add_request(prompts[0], SamplingParams(n=2))


def test_max_tokens_0_scores_the_prompt_only(llm, prompts):
    want = llm.generate(prompts[:3], SamplingParams(max_tokens=1, prompt_logprobs=2))
    free = llm.engine.cache.num_free_pages()
    for spec in (None, TREE):
        got = llm.generate(prompts[:3], SamplingParams(max_tokens=0, prompt_logprobs=2), spec=spec)
        assert [g.token_ids for g in got] == [[], [], []] and {g.finish_reason for g in got} == {"length"}
        assert [g.prompt_logprobs for g in got] == [w.prompt_logprobs for w in want]
        assert got[1].prompt_logprobs[0] is None and len(got[1].prompt_logprobs) == len(prompts[1])
    assert llm.engine.cache.num_free_pages() == free
