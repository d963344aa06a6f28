"""The calibrated draft-tree selection: lossless like every tree (greedy equal to plain,
sampled following the target's distribution; invariant S is checked with the other trees in
test_spec_decode), and the trees it keeps follow the acceptance it measured."""

import numpy as np
import pytest
import torch

from branchspec.checkpoint import save_checkpoint
from branchspec.config import SamplingParams, SpecConfig, tiny_config
from branchspec.llm import LLM
from branchspec.model.init import random_model
from branchspec.speculative.calibration import GREEDY, HITS, MASS, MAX_DEPTH, TRIES, AcceptanceModel
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


def _random_rounds(seed: int, n: int = 300):
    """Rounds as an engine observes them: batches of distinct requests (some met again),
    greedy and sampled mixed, trees of different depth and width, paths of every length."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n):
        B, D, k = int(rng.integers(1, 5)), int(rng.integers(2, 9)), int(rng.integers(1, 4))
        ids = [int(i) for i in rng.choice(9, size=B, replace=False)]
        modes = [int(m) for m in rng.integers(0, 2, size=B)]
        children = rng.integers(0, 4, size=(B, D, k))
        children[rng.random((B, D, k)) < 0.2] = -1
        logp = np.log(rng.uniform(0.01, 1.0, size=(B, D, k)))
        targets = rng.integers(0, 4, size=(B, D))
        for b, n_path in enumerate(rng.integers(1, D + 1, size=B)):
            targets[b, n_path:] = -1
        rounds.append((ids, modes, children, logp, targets))
    return rounds


def _learnt(rounds, refresh: int) -> AcceptanceModel:
    model = AcceptanceModel(decay=0.002)       # fast decay: the rows' scales fold back in
    model.REFRESH_ROUNDS = refresh
    for r in rounds:
        model.observe(*r)
    return model


def test_rounds_learnt_together_equal_one_at_a_time():
    """Rounds are learnt `REFRESH_ROUNDS` at a time in one pass; that gives what learning
    each round alone gives (request and engine-wide counts alike, including rows whose
    scale fell under 1e-100 and was folded back in); learning them in another order
    does not (the negative control: the comparison can tell)."""
    rounds = _random_rounds(seed=3)
    alone, together = _learnt(rounds, refresh=1), _learnt(rounds, refresh=4)
    np.testing.assert_allclose(together.global_counts.numpy(), alone.global_counts.numpy(), rtol=1e-9)
    for sid in range(9):
        if alone.counts(sid) is None:
            continue
        np.testing.assert_allclose(together.counts(sid).numpy(), alone.counts(sid).numpy(), rtol=1e-9, atol=1e-300)
    # some request's scale fell under 1e-100 and was folded back in (else it would be decay ** rounds)
    seen = {sid: sum(sid in r[0] for r in rounds) for sid in alone._rows}
    assert any(together._scale.numpy()[together._rows[sid]] > 1e6 * together.decay ** n for sid, n in seen.items())
    shuffled = _learnt(rounds[::-1], refresh=4)
    assert not np.allclose(shuffled.global_counts.numpy(), alone.global_counts.numpy(), rtol=1e-9)


def test_rounds_inside_unchanged_teach_nothing():
    """What rounds observed inside `unchanged()` taught is gone on leaving: engine-wide
    counts, request rows (new and already present) and the selection's factors read as
    before; the same rounds outside teach (the negative control)."""
    rounds = _random_rounds(seed=4, n=60)
    model = _learnt(rounds[:30], refresh=4)
    before = model.global_counts.numpy().copy()
    counts = {sid: model.counts(sid).numpy().copy() for sid in model._rows}
    factors = model.log_factors([0, 1], [GREEDY, GREEDY]).numpy().copy()
    with model.unchanged():
        for r in rounds[30:]:
            model.observe(*r)
        model.learn()
        assert not np.allclose(model.global_counts.numpy(), before), "inside, the rounds are learnt as ever"
    np.testing.assert_array_equal(model.global_counts.numpy(), before)
    assert set(model._rows) == set(counts)
    for sid, c in counts.items():
        np.testing.assert_array_equal(model.counts(sid).numpy(), c)
    np.testing.assert_array_equal(model.log_factors([0, 1], [GREEDY, GREEDY]).numpy(), factors)
    for r in rounds[30:]:
        model.observe(*r)
    assert not np.allclose(model.global_counts.numpy(), before)


def test_a_warmup_leaves_the_measured_acceptance_as_it_was(trained_ckpt):
    """Warm-up rounds run a dummy prompt: a fresh engine reads the prior after them, as
    before; the same runs outside a warm-up teach the acceptance (the negative control)."""
    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=2)
    model = llm.engine.drafter.calibration
    fresh = model.global_counts.numpy().copy()
    llm.warmup(SpecConfig.auto([None, SpecConfig(3, 2, 6, selection="calibrated")]), batch_sizes=(1,),
               progress=False)
    np.testing.assert_array_equal(model.global_counts.numpy(), fresh)
    prompt = [llm.config.bos_token_id] + list(range(3, 43))
    llm.generate([prompt], SamplingParams(max_tokens=14, ignore_eos=True),
                 spec=SpecConfig(3, 2, 6, selection="calibrated"), use_tqdm=False)
    assert not np.allclose(model.global_counts.numpy(), fresh)


def test_a_round_observed_as_it_is_equals_its_path_observations():
    """`observe_round` (a round's own tensors, gathered along its paths when learnt) teaches
    what `observe` does with the path observations written out one by one."""
    rng = np.random.default_rng(5)
    B, N, k = 3, 7, 2
    children = torch.from_numpy(rng.integers(0, 5, size=(B, N, k)))
    logp = torch.from_numpy(np.log(rng.uniform(0.05, 1.0, size=(B, N, k))))
    tokens = torch.from_numpy(rng.integers(0, 5, size=(B, N)))
    path = torch.tensor([[0, 2, 5, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0, 0], [0, 1, 3, 4, 6, 0, 0]])
    path_len, bonus = torch.tensor([3, 1, 5]), torch.tensor([4, 1, 0])
    path_tokens = tokens.gather(1, path)
    by_round, by_hand = AcceptanceModel(), AcceptanceModel()
    by_round.observe_round([1, 2, 3], [GREEDY] * B, children, logp, path, path_len, bonus, path_tokens)
    targets = torch.full((B, N), -1)
    for b in range(B):
        n = int(path_len[b])
        for i in range(n):
            targets[b, i] = path_tokens[b, i + 1] if i < n - 1 else bonus[b]
    rows = torch.arange(B)[:, None]
    by_hand.observe([1, 2, 3], [GREEDY] * B, children[rows, path], logp[rows, path], targets)
    for sid in (1, 2, 3):
        assert torch.equal(by_round.counts(sid), by_hand.counts(sid))
    assert sum(float(by_round.counts(s)[TRIES].sum()) for s in (1, 2, 3)) > 0, "the round was learnt"
    # negative control: another path teaches otherwise
    other = AcceptanceModel()
    other.observe_round([1, 2, 3], [GREEDY] * B, children, logp, path.roll(1, dims=1), path_len, bonus, path_tokens)
    assert not all(torch.equal(other.counts(s), by_hand.counts(s)) for s in (1, 2, 3))
