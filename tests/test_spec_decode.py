"""Speculative decoding is lossless: greedy output equals plain greedy token for token, and
sampled output follows the target distribution. Drafter trees are well formed."""

import itertools

import pytest
import torch

from branchspec.cache.paged import read_mtp
from branchspec.checkpoint import save_checkpoint
from branchspec.config import SamplingParams, SpecConfig, tiny_config
from branchspec.sampling import sampling_probs
from branchspec.llm import LLM
from branchspec.model.init import random_model
from branchspec.model.metadata import chain_meta
from branchspec.speculative.tree import select_tree
from conftest import markov_batches

SPECS = [SpecConfig.chain(d) for d in (5, 6, 7, 8)] + [
    SpecConfig(3, 2, 5), SpecConfig(3, 2, 6), SpecConfig(2, 3, 6), SpecConfig(2, 4, 7),
    SpecConfig(4, 2, 7), SpecConfig(4, 3, 8), SpecConfig(3, 4, 8)]


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution: Q(dof/2, x/2)."""
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(x / 2, dtype=torch.float64)).item()


@pytest.fixture(scope="module")
def llm(trained_ckpt):
    return LLM(trained_ckpt, dtype="float64", max_batch_size=8)


@pytest.fixture(scope="module")
def prompts():
    lengths = [5, 126, 127, 40, 3, 250, 64, 9]     # C128 boundaries land in the first rounds
    data = next(markov_batches(64, 1, batch=len(lengths), length=260, seed=5))
    return [data[i, :n].tolist() for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def params():
    # Different budgets: requests finish in different rounds while others keep going.
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 37, 5, 60, 11, 30, 1, 44)]


@pytest.fixture(scope="module")
def plain(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"steps{s.num_steps}-topk{s.topk}-D{s.num_draft_tokens}")
def test_greedy_speculative_equals_plain_batch_of_8(llm, prompts, params, plain, spec):
    outs = llm.generate(prompts, params, spec=spec)
    assert [o.token_ids for o in outs] == plain
    assert llm.last_stats.accept_length > 1.2, "drafts were hardly accepted: the test would prove little"


@pytest.mark.parametrize("spec", [SpecConfig.chain(6), SpecConfig(3, 2, 6)], ids=["chain6", "tree326"])
def test_draft_extend_computes_the_next_root(llm, prompts, params, plain, spec, monkeypatch):
    """Each round's draft extend also feeds the next root, and the next round grows its tree
    from that instead of a forward of its own: what it reuses equals the root's own forward
    (same keys attended, in another order), and only a batch's first round computes it. A
    batch that did not change takes the extend's outputs as they are; one that lost a
    request takes its remaining rows."""
    from branchspec.speculative import drafter as drafter_module

    drafter = llm.engine.drafter
    original = drafter._grow
    rounds = {"reused": 0, "computed": 0, "stacked": 0}
    stack = drafter_module.DraftRoot.stack

    def counted(rows):
        rounds["stacked"] += 1
        return stack(rows)

    monkeypatch.setattr(drafter_module.DraftRoot, "stack", staticmethod(counted))

    def checked(root_ids, prev_hidden, L, tables, spec, root, log_q=None, scale=None):
        if root is None:
            rounds["computed"] += 1
        else:
            rounds["reused"] += 1
            committed = read_mtp(drafter.model.cfg, drafter.cache.storage, tables, L)
            own = drafter.executor.drafter(root_ids[:, None], prev_hidden[:, None], chain_meta(L, 1, (), max_new=1),
                                           committed)
            torch.testing.assert_close(root.k, own.scratch[0].k, atol=1e-10, rtol=0)
            torch.testing.assert_close(root.hidden, own.hidden, atol=1e-10, rtol=0)
            torch.testing.assert_close(root.logits, drafter.model.mtp_logits(own.hidden[:, 0]), atol=1e-10, rtol=0)
        return original(root_ids, prev_hidden, L, tables, spec, root, log_q, scale)

    monkeypatch.setattr(drafter, "_grow", checked)
    assert [o.token_ids for o in llm.generate(prompts, params, spec=spec)] == plain
    assert rounds["computed"] == 1 and rounds["reused"] >= 5
    # requests finish in different rounds (their budgets differ), so both ways are taken
    assert 1 <= rounds["stacked"] < rounds["reused"]


@pytest.mark.parametrize("spec", [SpecConfig.chain(6), SpecConfig(3, 2, 6), SpecConfig(4, 3, 8)],
                         ids=["chain6", "tree326", "tree438"])
def test_greedy_speculative_equals_plain_batch_of_1(llm, prompts, params, plain, spec):
    for i in (1, 5):
        out = llm.generate([prompts[i]], params[i], spec=spec)[0]
        assert out.token_ids == plain[i]
        assert out.num_rounds > 0 and out.accept_length >= 1.0


def test_outputs_carry_stats(llm, prompts, params):
    spec = SpecConfig(3, 2, 6)
    outs = llm.generate(prompts, params, spec=spec)
    for o, p in zip(outs, params):
        assert len(o.token_ids) == p.max_tokens and o.finish_reason == "length"
        if o.num_rounds:
            assert 1.0 <= o.accept_length <= spec.num_draft_tokens
            assert len(o.accepted_per_depth) == spec.num_draft_tokens - 1
            assert all(a >= b for a, b in zip(o.accepted_per_depth, o.accepted_per_depth[1:]))
    stats = llm.last_stats
    assert set(stats.phase_seconds) >= {"draft", "verify", "draft_extend", "learn"}


SEEDED_SPECS = [SpecConfig.chain(2), SpecConfig.chain(5), SpecConfig.chain(8), SpecConfig(3, 2, 6),
                SpecConfig(2, 4, 7), SpecConfig(4, 3, 8)]


def seeded_params() -> list[SamplingParams]:
    """Sampled requests with their own seeds (two share one), temperatures and top-p cuts,
    and one greedy request among them; budgets differ so that requests leave mid-batch."""
    temps = (1.0, 0.7, 1.0, 1.3, 0.0, 1.0, 0.9, 1.0)
    tops = (1.0, 0.9, 1.0, 1.0, 1.0, 0.8, 1.0, 0.95)
    seeds = (7, 11, 7, 2**64 - 1, None, 0, 123456789, 42)
    return [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=m, ignore_eos=True)
            for t, p, s, m in zip(temps, tops, seeds, (20, 37, 5, 60, 11, 30, 1, 44))]


def test_seeded_sampling_gives_the_same_tokens_whatever_runs(llm, prompts):
    """Token for token, not just in distribution: a seeded sampled request draws the token
    at each position from (seed, position) alone, so plain decoding, every chain and tree,
    alone or in a mixed batch, emit the same tokens (float64: the logits agree exactly)."""
    params = seeded_params()
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    accepted = 0.0
    for spec in SEEDED_SPECS:
        outs = llm.generate(prompts, params, spec=spec)
        assert [o.token_ids for o in outs] == plain, spec
        accepted = max(accepted, llm.last_stats.accept_length)
    assert accepted > 1.3, "sampled drafts were hardly accepted: the test would prove little"
    for i in (1, 3, 5):          # alone, under speculation and plain
        for spec in (None, SpecConfig(3, 2, 6), SpecConfig.chain(5)):
            assert llm.generate([prompts[i]], params[i], spec=spec)[0].token_ids == plain[i], (i, spec)


def test_select_tree_keeps_ancestors_and_orders_parents_first():
    # Candidates: 0,1 children of root; 2,3 of cand 0; 4,5 of cand 1; 6,7 of cand 2.
    parent = torch.tensor([[-1, -1, 0, 0, 1, 1, 2, 2]])
    score = torch.tensor([[-0.1, -0.5, -0.3, -2.0, -0.6, -0.9, -0.35, -3.0]])
    tok = torch.arange(10, 18)[None]
    tree = select_tree(torch.tensor([99]), tok, parent, score, num_draft_tokens=6)
    assert tree.tokens[0].tolist() == [99, 10, 11, 12, 14, 16]
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 2, 3]


def test_sampling_probs_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    p = sampling_probs(logits, torch.tensor([1.0]), torch.tensor([0.7]))[0, 0]
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=p.dtype))
    p = sampling_probs(logits, torch.tensor([1.0]), torch.tensor([1.0]))[0, 0]
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=p.dtype))


def test_sampled_speculative_follows_target_distribution(tmp_path):
    """Chi-square goodness of fit of (x2, x3) against the exact target marginal.

    A tiny vocabulary (8) keeps the 64 cells well filled; the drafter's top-2 tree covers
    a large share of them so acceptance happens often. With the fixed seed the test is
    deterministic; by construction its false-alarm rate is 0.1% (p < 0.001 fails)."""
    cfg = tiny_config(vocab_size=8, compress_ratios=(0, 4, 0, 4), index_topk=2)
    model = random_model(cfg, seed=4, dtype="float64", std=0.25)
    save_checkpoint(model, tmp_path)
    llm = LLM(tmp_path, dtype="float64", max_batch_size=64)
    prompt = [3, 5, 7, 6, 4, 5, 3]          # crosses a C4 boundary inside the round
    n = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=1000 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, spec=SpecConfig(2, 2, 4))
    assert sum(o.num_rounds for o in outs) < 2 * n, "no round accepted a draft"
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[1], o.token_ids[2]] += 1

    # Exact P(x2, x3) = sum over x1 of P(x1) P(x2 | x1) P(x3 | x1, x2).
    seqs = torch.tensor([prompt + list(t) for t in itertools.product(range(8), repeat=2)])
    with torch.no_grad():
        lp = torch.log_softmax(model.full_forward(seqs)[0].logits, -1)   # [64, T+2, 8]
        P = len(prompt)
        p_x1 = lp[0, P - 1].exp()                                        # [8]
        p_x2 = lp[:, P, :].exp().view(8, 8, 8)[:, 0]                     # [x1, x2]
        p_x3 = lp[:, P + 1, :].exp().view(8, 8, 8)                       # [x1, x2, x3]
    expected = torch.einsum("a,ab,abc->bc", p_x1, p_x2, p_x3) * n
    mask = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[mask]).sum().item()
    dof = int(mask.sum()) - 1
    p_value = chi2_sf(chi2, dof)
    assert p_value > 1e-3, f"chi2={chi2:.1f} dof={dof} p={p_value:.2g}"
    # The counts must also be far from a distribution the engine would produce if it
    # emitted draft tokens unchecked: the uniform one is a crude stand-in with power here.
    uniform = torch.full_like(expected, n / 64)
    chi2_u = ((counts - uniform) ** 2 / uniform).sum().item()
    assert chi2_sf(chi2_u, 63) < 1e-6


@pytest.mark.parametrize("spec", [SpecConfig.chain(6), SpecConfig(3, 2, 6), SpecConfig(3, 2, 6, selection="calibrated"),
                                  SpecConfig(5, 2, 6, selection="calibrated")],
                         ids=["chain6", "tree326", "calibrated326", "calibrated526"])
def test_state_after_speculative_rounds_equals_sequential(trained_ckpt, prompts, spec):
    """Invariant S through the engine: after several rounds, the target state and the
    drafter KV (rebuilt with the target's hidden states by draft-extend) equal what a
    sequential pass over the committed tokens builds."""
    from branchspec.checkpoint import load_checkpoint
    from branchspec.config import EngineConfig
    from branchspec.engine.engine import Engine
    from helpers import assert_same_state, sequential, sequential_drafter

    model = load_checkpoint(trained_ckpt, "float64")
    engine = Engine(model, EngineConfig(max_batch_size=2, page_size=4))
    seqs = [engine.add_request(prompts[i], SamplingParams(max_tokens=40, ignore_eos=True)) for i in (1, 6)]
    for _ in range(5):
        engine.step(spec)
    for seq in seqs:
        L = seq.num_committed
        assert not seq.finished and L > len(seq.prompt_ids)
        committed = seq.token_ids[:L]
        ref, _ = sequential(model, committed, chunk=1)
        drafter, last_hidden = sequential_drafter(model, committed)
        got = engine.cache.snapshot(seq.seq_id, L, mtp_length=L)
        assert_same_state(got, {**ref.snapshot(0, L), **drafter})
        torch.testing.assert_close(engine.drafter.state(seq.seq_id).last_hidden, last_hidden, atol=1e-10, rtol=0)


@pytest.mark.parametrize("spec", [SpecConfig(3, 2, 6), SpecConfig(2, 4, 7), SpecConfig.chain(5)],
                         ids=["3x2", "2x4", "chain5"])
def test_drafted_tree_matches_a_sequential_drafter(trained_ckpt, prompts, spec):
    """Every drafted node's score is the sum of the drafter's log-probabilities along its
    path, computed by running the MTP block one slot at a time (chained on its own hidden
    state, its KV committed as it goes), and siblings are that distribution's top-k."""
    import copy

    from branchspec.checkpoint import load_checkpoint
    from branchspec.engine.request import Sequence
    from branchspec.model.metadata import chain_meta
    from helpers import new_cache, new_runner

    model = load_checkpoint(trained_ckpt, "float64")
    cache = new_cache(model, max_seqs=1)
    seq = Sequence(seq_id=0, prompt_ids=prompts[1], params=SamplingParams())
    cache.add(0)
    cache.reserve(0, len(seq.prompt_ids))
    runner = new_runner(model, cache)
    root = runner.prefill([seq], follow=True).first_ids[0]
    seq.num_committed = len(seq.prompt_ids)
    L = torch.tensor([seq.num_committed])
    last_hidden = runner.drafter.state(0).last_hidden
    tree = runner.drafter.propose([0], L, torch.tensor([root]), spec)
    parents, tokens, scores = tree.parents[0].tolist(), tree.tokens[0].tolist(), tree.scores[0]
    assert tokens[0] == root and parents[0] == -1
    for node in range(1, len(parents)):
        path = [node]
        while parents[path[-1]] > 0:
            path.append(parents[path[-1]])
        path = [0] + path[::-1]
        ref = copy.deepcopy(cache)
        hidden, total = last_hidden, 0.0
        with torch.no_grad():
            for depth, (a, b) in enumerate(zip(path, path[1:])):
                pos = torch.tensor([seq.num_committed + depth])
                meta = chain_meta(pos, 1, ())
                out = model.mtp_forward(torch.tensor([[tokens[a]]]), hidden[None, None], meta,
                                        ref.gather_mtp([0], pos))
                ref.commit_mtp([0], meta, out.scratch[0], meta.valid)
                logp = torch.log_softmax(out.logits[0, 0].float(), -1)
                assert tokens[b] in logp.topk(spec.topk).indices.tolist()
                # The drafter's recorded proposals after node a are this distribution's top-k.
                assert tree.children[0, a].tolist() == logp.topk(spec.topk).indices.tolist()
                total += float(logp[tokens[b]])
                hidden = out.hidden[0, 0]
        assert abs(float(scores[node]) - total) < 1e-4, (node, path)
