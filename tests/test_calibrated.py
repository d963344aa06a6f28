"""The calibrated draft-tree selection: lossless like every tree (greedy equal to plain,
sampled following the target's distribution; invariant S is checked with the other trees in
test_spec_decode), and the trees it keeps follow the acceptance it measured."""

import pytest
import torch

from branchspec.checkpoint import save_checkpoint
from branchspec.config import SamplingParams, SpecConfig, tiny_config
from branchspec.llm import LLM
from branchspec.model.init import random_model
from branchspec.speculative.calibration import GREEDY, HITS, MASS, MAX_DEPTH, AcceptanceModel
from conftest import markov_batches
from helpers import chi2_p_value, second_and_third_token_counts

CALIBRATED = [SpecConfig(3, 2, 6, selection="calibrated"), SpecConfig(5, 2, 6, selection="calibrated"),
              SpecConfig(2, 4, 7, selection="calibrated"), SpecConfig(7, 2, 8, selection="calibrated")]


@pytest.fixture(scope="module")
def llm(trained_ckpt):
    return LLM(trained_ckpt, dtype="float64", max_batch_size=8)


@pytest.fixture(scope="module")
def prompts():
    lengths = [5, 126, 127, 40, 3, 250, 64, 9]
    data = next(markov_batches(64, 1, batch=len(lengths), length=260, seed=5))
    return [data[i, :n].tolist() for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def params():
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 37, 5, 60, 11, 30, 1, 44)]


@pytest.mark.parametrize("spec", CALIBRATED, ids=lambda s: f"{s.num_steps}x{s.topk}-D{s.num_draft_tokens}")
def test_greedy_calibrated_equals_plain_batch_of_8(llm, prompts, params, spec):
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    for _ in range(2):          # the second call selects on what the first measured
        outs = llm.generate(prompts, params, spec=spec)
        assert [o.token_ids for o in outs] == plain
    assert llm.last_stats.accept_length > 1.2, "drafts were hardly accepted: the test would prove little"


def test_sampled_calibrated_follows_target_distribution(tmp_path):
    """The chi-square test of test_spec_decode with the calibrated selection, which by then
    has learnt from the sampled rounds before it."""
    cfg = tiny_config(vocab_size=8, compress_ratios=(0, 4, 0, 4), index_topk=2)
    model = random_model(cfg, seed=4, dtype="float64", std=0.25)
    save_checkpoint(model, tmp_path)
    llm = LLM(tmp_path, dtype="float64", max_batch_size=64)
    prompt = [3, 5, 7, 6, 4, 5, 3]
    n = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=4000 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, spec=SpecConfig(3, 2, 4, selection="calibrated"))
    assert sum(o.num_rounds for o in outs) < 2 * n, "no round accepted a draft"
    counts, expected = second_and_third_token_counts(model, prompt, outs)
    assert chi2_p_value(counts, expected) > 1e-3
    model = llm.engine.drafter.calibration
    prior = model.prior_hits / model.prior_mass
    greedy, sampled = (g[HITS] / g[MASS] for g in model.global_counts)
    assert torch.allclose(greedy, prior), "sampled rounds must not teach the greedy estimates"
    assert not torch.allclose(sampled, prior), "the sampled rounds taught it nothing"


def _taught(model: AcceptanceModel, c_main_first: float, c_others: float) -> None:
    """Set the engine-wide greedy calibration: the drafter's first guess on its main line is
    accepted c_main_first times as often as its probability says, every other edge
    c_others times."""
    counts = model.global_counts[GREEDY]
    counts[MASS].fill_(1000.0)
    counts[HITS].fill_(1000.0 * c_others)
    counts[HITS, 0, :, 0] = 1000.0 * c_main_first


def _tree_of(llm: LLM, prompt: list[int], spec: SpecConfig):
    """The tree the drafter grows for `prompt` right after its prefill."""
    engine = llm.engine
    seq = engine.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine._admit(engine.policy(spec))
    try:
        L = torch.tensor([seq.num_committed])
        return engine.drafter.propose([seq.seq_id], L, torch.tensor([seq.root_id]), spec, [0.0])
    finally:
        engine.abort(seq)


def test_the_selection_keeps_the_chain_or_widens_as_acceptance_says(trained_ckpt, prompts):
    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=2)
    spec = SpecConfig(5, 2, 6, selection="calibrated")
    _taught(llm.engine.drafter.calibration, c_main_first=100.0, c_others=0.01)
    tree = _tree_of(llm, prompts[1], spec)
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4], "first guesses always accepted: the chain"
    _taught(llm.engine.drafter.calibration, c_main_first=0.001, c_others=100.0)
    tree = _tree_of(llm, prompts[1], spec)
    depth1 = (tree.parents[0] == 0).nonzero().flatten().tolist()
    assert len(depth1) == 1 and tree.tokens[0, depth1[0]] == tree.children[0, 0, 1], \
        "first guesses never accepted, second ones always: the tree follows the root's second proposal"
    # No evidence: the calibrated selection is EAGLE-2's.
    llm.engine.drafter.calibration = AcceptanceModel()
    eagle = _tree_of(llm, prompts[1], SpecConfig(5, 2, 6))
    assert _tree_of(llm, prompts[1], spec).parents.tolist() == eagle.parents.tolist()


def test_observe_counts_tries_and_hits_by_line_depth_rank_and_bucket():
    model = AcceptanceModel(decay=0.5)
    # Root proposals 7 (p=0.6) and 8 (p=0.3); the target took 8 (rank 2). Below it, off
    # the main line, proposals 4 and 5; the target's token 6 is neither.
    children = torch.tensor([[[7, 8], [4, 5], [-1, -1]]])
    logp = torch.tensor([[[0.6, 0.3], [0.45, 0.25], [0.0, 0.0]]], dtype=torch.float64).log()
    targets = torch.tensor([[8, 6, -1]])
    model.observe([3], [GREEDY], children, logp, targets)
    h, m = model.counts(3)[HITS], model.counts(3)[MASS]
    b = model.bucket(torch.tensor([0.6, 0.3, 0.45, 0.25])).tolist()
    assert m[0, 0, 0, b[0]] == pytest.approx(0.6) and h[0, 0, 0, b[0]] == 0   # main line, depth 1, rank 1: a miss
    assert m[0, 0, 1, b[1]] == pytest.approx(0.3) and h[0, 0, 1, b[1]] == 1   # rank 2: the hit
    assert m[1, 1, 0, b[2]] == pytest.approx(0.45) and m[1, 1, 1, b[3]] == pytest.approx(0.25)   # off the line
    assert h[1].sum() == 0 and m.sum() == pytest.approx(1.6) and h.sum() == 1
    log_c = model.log_factors([3], [GREEDY])
    assert log_c.shape == (1, 2, MAX_DEPTH, model.R, len(model.edges) + 1)
    assert log_c[0, 0, 0, 1, b[1]] > 0 > log_c[0, 0, 0, 0, b[0]], "the hit raises its cell's factor, the miss lowers"
    values = model.edge_log_values(log_c, 1, torch.ones(1, 1, dtype=torch.bool), logp[:, :1])
    assert (values <= 0).all()
    assert torch.equal(model.edge_log_values(log_c, 1, None, logp[:, :1]), values), "None: the root, on the main line"
    assert not torch.equal(model.edge_log_values(log_c, 1, torch.zeros(1, 1, dtype=torch.bool), logp[:, :1]), values)
    model.forget(3)
    assert model.counts(3) is None
