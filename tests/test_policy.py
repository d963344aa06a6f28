"""Adaptive speculation (SpecConfig.auto): lossless whatever it picks, the drafter's state
stays exact across plain rounds, and its estimates and choices respond to what it sees."""

import itertools
import math

import numpy as np
import pytest
import torch

from branchspec.config import (AutoPolicy, EngineConfig, SamplingParams, SpecConfig, default_candidates,
                               fast_path_candidates, spec_label)
from branchspec.llm import LLM
from branchspec.speculative.policy import BatchView
from branchspec.speculative.calibration import (GREEDY, HITS, NEW_REQUEST, SAMPLED, TRIES,
                                                AcceptanceModel)
from branchspec.speculative.policy.acceptance import OFF, ExpectedAccept, candidate_paths
from branchspec.speculative.policy.adaptive import AdaptivePolicy
from branchspec.speculative.policy.costs import CATCH_UP_TOKENS, DRAW_ROWS, CostModel, grid_keys
from branchspec.speculative.profiling import calibration_batches, load_or_calibrate
from branchspec.speculative.policy.tuning import TUNING
from branchspec.speculative.outcome import RoundResult
from conftest import markov_batches
from test_spec_decode import chi2_sf


@pytest.fixture(scope="module", autouse=True)
def private_cache(tmp_path_factory):
    """A cache of this module's own, shared by its tests: the round prices of a model and
    candidate set are measured once, as an engine's are once per machine (a test of the
    caching itself points it elsewhere)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BRANCHSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield


def choose(policy, seq_ids, lag=None, remaining=None, context=None):
    """policy.choose over requests `seq_ids` (no drafter lag, no budget cap unless given)."""
    return policy.choose(BatchView(seq_ids, lag or [0] * len(seq_ids), remaining or [], context))


def teach(model: AcceptanceModel, seq_ids, children, targets, mode=GREEDY):
    """What a verified round teaches the engine's acceptance (every proposal at p = 0.5)."""
    logp = torch.full(children.shape, math.log(0.5), dtype=torch.float64)
    model.observe(seq_ids, [mode] * len(seq_ids), children, logp, targets)


def observe(policy, spec, seq_ids, seconds, children=None, targets=None, path_len=None, context=None, modes=None):
    """A round of `spec` that took `seconds`, with its path observations, as the engine
    runs one: the round teaches the acceptance, then policy.observe."""
    if spec is not None and children is not None:
        teach(policy.acceptance, seq_ids, children, targets)
    result = RoundResult(spec=spec, emitted=[], path_len=path_len or [1] * len(seq_ids),
                         learnt=spec is not None and children is not None, seconds=seconds)
    policy.observe(BatchView(seq_ids, [0] * len(seq_ids), [], context, modes), result)


CYCLE = (None, SpecConfig.chain(4), None, None, SpecConfig(3, 2, 6), SpecConfig(2, 3, 5, selection="calibrated"), None,
         SpecConfig.chain(8))


def force_cycle(llm: LLM, policy: AutoPolicy, order=CYCLE):
    """Make the policy run `order` round after round (each rounds' outcome still observed)."""
    runner = llm.engine.policy(policy)
    choices = itertools.cycle(order)

    def forced(batch):
        pick = next(choices)
        runner.counts[spec_label(pick)] += 1
        return pick
    runner.choose = forced
    return runner


@pytest.fixture(scope="module")
def prompts():
    lengths = [5, 126, 127, 40, 3, 250, 64, 9]
    data = next(markov_batches(64, 1, batch=len(lengths), length=260, seed=5))
    return [data[i, :n].tolist() for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def params():
    return [SamplingParams(max_tokens=m, ignore_eos=True) for m in (20, 37, 5, 60, 11, 30, 1, 44)]


def test_auto_policy_is_lossless_greedy(trained_ckpt, prompts, params):
    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=8)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    policy = SpecConfig.auto()
    outs = llm.generate(prompts, params, spec=policy)
    assert [o.token_ids for o in outs] == plain
    stats = llm.last_stats
    assert sum(stats.spec_choices.values()) == stats.num_steps
    assert stats.policy_seconds > 0


def test_switching_between_plain_and_speculative_rounds_is_lossless(trained_ckpt, prompts, params):
    """Every kind of switch (plain -> chain, tree -> plain, plain -> plain -> tree) happens
    in this run; the drafter catches up on the positions plain rounds committed."""
    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=8)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    policy = SpecConfig.auto()
    force_cycle(llm, policy)
    outs = llm.generate(prompts, params, spec=policy)
    assert [o.token_ids for o in outs] == plain
    assert llm.last_stats.spec_choices.get("none", 0) >= 3
    assert llm.last_stats.accept_length > 1.2, "drafts were hardly accepted: the test would prove little"
    assert llm.engine.cache.tables == {}, "pages leaked"


def test_seeded_sampling_is_the_same_whatever_the_policy_picks(trained_ckpt, prompts):
    """A seeded sampled request gives plain decoding's tokens under the adaptive policy,
    left to choose and forced through every kind of switch (float64)."""
    from test_spec_decode import seeded_params

    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=8)
    params = seeded_params()
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params, spec=SpecConfig.auto())] == plain
    forced = SpecConfig.auto(default_candidates()[::-1])     # another policy value: its own runner
    force_cycle(llm, forced)
    assert [o.token_ids for o in llm.generate(prompts, params, spec=forced)] == plain
    assert llm.last_stats.spec_choices.get("none", 0) >= 3 and len(llm.last_stats.spec_choices) >= 4
    assert llm.engine.cache.tables == {}, "pages leaked"


def run_mixed_rounds_and_compare_drafter(trained_ckpt, prompts, skip_lag: bool = False) -> None:
    """Plain rounds, then speculative ones, then compare each request's drafter KV with a
    sequential MTP pass over its committed tokens (with the target's hidden states).
    AssertionError on any difference."""
    from branchspec.checkpoint import load_checkpoint
    from branchspec.engine.engine import Engine
    from helpers import assert_same_state, sequential_drafter

    model = load_checkpoint(trained_ckpt, "float64")
    engine = Engine(model, EngineConfig(max_batch_size=2, page_size=4))
    if skip_lag:    # a drafter that forgets what plain rounds committed
        engine.drafter.catch_up = lambda seq_ids, lengths: [engine.drafter.state(s).lag.clear() for s in seq_ids]
    policy = SpecConfig.auto()
    runner = engine.policy(policy)
    order = iter([None, None, None, SpecConfig(3, 2, 6), None, SpecConfig.chain(5)])
    runner.choose = lambda batch: next(order)
    seqs = [engine.add_request(prompts[i], SamplingParams(max_tokens=40, ignore_eos=True)) for i in (1, 6)]
    for _ in range(6):
        engine.step(policy)
    for seq in seqs:
        L = seq.num_committed
        assert not seq.finished and not engine.drafter.lag(seq.seq_id)
        drafter, last_hidden = sequential_drafter(model, seq.token_ids[:L])
        got = engine.cache.snapshot(seq.seq_id, L, mtp_length=L)
        assert_same_state({"mtp/0": got["mtp/0"]}, drafter)
        torch.testing.assert_close(engine.drafter.state(seq.seq_id).last_hidden, last_hidden, atol=1e-10, rtol=0)


def test_drafter_state_after_plain_rounds_equals_sequential(trained_ckpt, prompts):
    """Invariant S for the drafter across plain rounds chosen by the policy."""
    run_mixed_rounds_and_compare_drafter(trained_ckpt, prompts)


def test_drafter_state_check_catches_a_skipped_lag(trained_ckpt, prompts):
    """Negative control: the same check fails when the drafter skips the positions plain
    rounds committed."""
    with pytest.raises(AssertionError):
        run_mixed_rounds_and_compare_drafter(trained_ckpt, prompts, skip_lag=True)


def test_auto_policy_sampled_follows_target_distribution(tmp_path):
    """The chi-square test of test_spec_decode, with rounds cycling between plain decoding,
    a chain and a tree."""
    from branchspec.checkpoint import save_checkpoint
    from branchspec.config import tiny_config
    from branchspec.model.init import random_model

    cfg = tiny_config(vocab_size=8, compress_ratios=(0, 4, 0, 4), index_topk=2)
    model = random_model(cfg, seed=4, dtype="float64", std=0.25)
    save_checkpoint(model, tmp_path)
    llm = LLM(tmp_path, dtype="float64", max_batch_size=64)
    policy = SpecConfig.auto([None, SpecConfig.chain(3), SpecConfig(2, 2, 4)])
    force_cycle(llm, policy, order=(SpecConfig(2, 2, 4), None, SpecConfig.chain(3)))
    prompt = [3, 5, 7, 6, 4, 5, 3]
    n = 1500
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=2000 + i) for i in range(n)]
    outs = llm.generate([prompt] * n, params, spec=policy)
    assert set(llm.last_stats.spec_choices) == {"none", "chain D=3", "tree 2x2 D=4"}
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for o in outs:
        counts[o.token_ids[2], o.token_ids[3]] += 1
    # Exact P(x3, x4) by enumerating x1, x2.
    seqs = torch.tensor([prompt + list(t) for t in itertools.product(range(8), repeat=3)])
    with torch.no_grad():
        lp = torch.log_softmax(model.full_forward(seqs)[0].logits, -1)
        P = len(prompt)
        p1 = lp[0, P - 1].exp()
        p2 = lp[:, P, :].exp().view(8, 8, 8, 8)[:, 0, 0]            # [x1, x2]
        p3 = lp[:, P + 1, :].exp().view(8, 8, 8, 8)[:, :, 0]         # [x1, x2, x3]
        p4 = lp[:, P + 2, :].exp().view(8, 8, 8, 8)                  # [x1, x2, x3, x4]
    expected = torch.einsum("a,ab,abc,abcd->cd", p1, p2, p3, p4) * n
    mask = expected >= 5
    chi2 = (((counts - expected) ** 2 / expected)[mask]).sum().item()
    assert chi2_sf(chi2, int(mask.sum()) - 1) > 1e-3, chi2
    uniform = torch.full_like(expected, n / 64)
    assert chi2_sf(((counts - uniform) ** 2 / uniform).sum().item(), 63) < 1e-6


# -- the estimates ---------------------------------------------------------------------

def test_expected_accept_of_a_chain_is_the_sum_of_acceptance_products():
    chain = SpecConfig.chain(4)
    expected = ExpectedAccept((chain, SpecConfig(2, 2, 4)), max_rank=8)
    assert (expected.depth, expected.R) == (3, 2)          # the most steps, the largest topk
    q = np.full((2, 3, 2), 0.1)
    q[0, 0, 0], q[0, 1, 0], q[0, 2, 0] = 0.9, 0.5, 0.2          # main line, rank 1
    q[1, 1, 0] = 0.3                                              # off the main line, rank 1
    e = expected(q[None])
    assert e[0, 0] == pytest.approx(1 + 0.9 + 0.9 * 0.5 + 0.9 * 0.5 * 0.2)
    # The 2x2 tree at D=4 keeps the best three of: 0.9, 0.1 (rank 2), 0.45, 0.09 (main line)
    # and, under the rank-2 child (off the line), 0.1 * 0.3 and 0.1 * 0.1.
    assert e[0, 1] == pytest.approx(1 + 0.9 + 0.45 + 0.1)


def test_expected_accept_is_the_best_nodes_of_each_candidate_by_brute_force():
    """Every default candidate, random acceptance for three requests: 1 + the sum of the
    D-1 largest path products among the nodes within its depth and branching."""
    policy = SpecConfig.auto()
    rng = np.random.default_rng(0)
    expected = ExpectedAccept(policy.speculative, max_rank=8)
    q = rng.uniform(0.05, 1.0, size=(3, 2, expected.depth, expected.R))
    e = expected(q)
    for c, spec in enumerate(policy.speculative):
        for b in range(3):
            values = []
            for path in candidate_paths(spec):
                value, line = 1.0, 0
                for depth, rank in path:
                    value *= q[b, line, depth, rank]
                    line = OFF if rank else line
                values.append(value)
            best = sorted(values, reverse=True)[: spec.num_draft_tokens - 1]
            assert e[b, c] == pytest.approx(1.0 + sum(best)), spec_label(spec)


def test_ranks_past_the_measured_ones_share_the_last_ones_estimate():
    wide = SpecConfig(2, 12, 13)
    expected = ExpectedAccept((wide,), max_rank=8)
    q = np.full((1, 2, 2, 8), 0.01)
    q[0, 0, 0, :] = np.linspace(0.5, 0.15, 8)      # the root's children, by rank
    # 12 children of the root: ranks 1-8 measured, 9-12 valued as rank 8; 12 more nodes fit
    # nowhere better (their values are products below 0.01)
    assert expected(q)[0, 0] == pytest.approx(1 + q[0, 0, 0].sum() + 4 * q[0, 0, 0, 7])


def test_observe_counts_tries_and_hits_by_depth_and_rank():
    model = AcceptanceModel(decay=0.5)
    # Path: root (proposals 7, 8; target 8: the rank-2 child) -> node with proposals 4, 5
    # (target 6, the bonus) -> padding. That node is off the drafter's main line.
    children = torch.tensor([[[7, 8], [4, 5], [-1, -1], [-1, -1], [-1, -1]]])
    targets = torch.tensor([[8, 6, -1, -1, -1]])
    teach(model, [3], children, targets)

    def counts():
        c = model.counts(3).sum(dim=-1)          # over the probability buckets
        return c[HITS], c[TRIES]
    h, t = counts()
    assert t[0, :2, :2].tolist() == [[1, 1], [0, 0]] and h[0, :2, :2].tolist() == [[0, 1], [0, 0]]   # main line
    assert t[1, :2, :2].tolist() == [[0, 0], [1, 1]] and h[1, :2, :2].tolist() == [[0, 0], [0, 0]]   # off it
    # A chain path stays on the main line; a node the drafter did not expand is not a try.
    teach(model, [3], torch.tensor([[[7, -1], [9, -1], [-1, -1]]]), torch.tensor([[7, 9, 2]]))
    h, t = counts()
    assert t[0, :2, :2].tolist() == [[1.5, 0.5], [1.0, 0.0]] and h[0, :2, :2].tolist() == [[1.0, 0.5], [1.0, 0.0]]
    assert t[1, 1, :2].tolist() == [0.5, 0.5]
    model.forget(3)
    assert model.counts(3) is None


def test_a_forgotten_requests_counts_do_not_reach_a_new_one():
    """Per-request counts live in rows of one array; a finished request's row is cleared
    and reused, and the array grows as more requests run at once."""
    model = AcceptanceModel()
    ids = list(range(10, 15))
    teach(model, ids, torch.tensor([[[7], [8], [-1]]] * 5), torch.tensor([[7, 8, 1]] * 5))
    assert all(model.counts(i)[HITS].sum(-1)[0, :2, 0].tolist() == [1.0, 1.0] for i in ids)
    model.forget(12)
    teach(model, [99], torch.tensor([[[7], [8], [-1]]]), torch.tensor([[5, -1, -1]]))
    c = model.counts(99).sum(-1)
    assert c[HITS, 0, :2, 0].tolist() == [0.0, 0.0] and c[TRIES, 0, :2, 0].tolist() == [1.0, 0.0]
    assert model.counts(12) is None and model.counts(11)[HITS, 0, 0, 0].sum() == 1.0
    fresh = model.acceptance([12], [GREEDY])          # unknown again: the engine-wide estimate
    assert np.array_equal(fresh, model.acceptance([NEW_REQUEST], [GREEDY]))


def test_greedy_and_sampled_acceptance_are_kept_apart():
    """A sampled request accepts the target's draw, a greedy one its argmax: what sampled
    rounds teach moves the sampled estimate only, for the policy as for the selection."""
    model = AcceptanceModel()
    before = model.acceptance([NEW_REQUEST], [GREEDY])
    for _ in range(20):
        teach(model, [1], *chain_outcome(0), mode=SAMPLED)
    assert np.array_equal(model.acceptance([NEW_REQUEST], [GREEDY]), before)
    assert model.acceptance([NEW_REQUEST], [SAMPLED])[0, 0, 0, 0] < 0.5 * before[0, 0, 0, 0]


def test_a_batch_of_both_modes_reads_each_requests_own_estimate():
    """Greedy and sampled requests in one batch: each row is what that request reads
    alone (the engine-wide part of its own mode), whichever mode comes first."""
    model = AcceptanceModel()
    for _ in range(20):
        teach(model, [1], *chain_outcome(0), mode=SAMPLED)
        teach(model, [2], *chain_outcome(2), mode=GREEDY)
    ids, modes = [2, 1, NEW_REQUEST, NEW_REQUEST], [GREEDY, SAMPLED, SAMPLED, GREEDY]
    alone = np.concatenate([model.acceptance([i], [m]) for i, m in zip(ids, modes)])
    assert np.array_equal(model.acceptance(ids, modes), alone)
    assert not np.array_equal(alone[2], alone[3]), "the modes' engine-wide estimates should differ here"


def test_the_policy_reads_the_acceptance_its_rounds_teach(trained_ckpt, prompts):
    """One measured acceptance per engine: an adaptive policy reads the drafter's, which
    its rounds teach, EAGLE-2 trees and chains as well as calibrated trees; a fixed
    EAGLE-2 configuration's rounds do not pay for learning what nobody reads."""
    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=8)
    policy = SpecConfig.auto()
    runner = force_cycle(llm, policy, order=(SpecConfig(3, 2, 6), SpecConfig.chain(4)))
    assert runner.acceptance is llm.engine.drafter.calibration
    before = runner.acceptance.acceptance([NEW_REQUEST], [GREEDY]).copy()
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm.generate(prompts[:2], params, spec=SpecConfig(3, 2, 6))
    assert np.array_equal(runner.acceptance.acceptance([NEW_REQUEST], [GREEDY]), before)
    llm.generate(prompts[:2], params, spec=policy)
    assert not np.array_equal(runner.acceptance.acceptance([NEW_REQUEST], [GREEDY]), before)


def chain_outcome(accepted: int, depth: int = 2):
    """children/targets of a chain round over `depth` drafts where the first `accepted`
    proposals were right."""
    children = torch.tensor([[[10 + i] for i in range(depth)] + [[-1]]])
    targets = torch.tensor([[10 + i if i < accepted else 99 for i in range(depth)] + [-1]])
    return children, targets


def test_requests_learn_their_own_acceptance():
    chain = SpecConfig.chain(3)
    runner = AdaptivePolicy(AutoPolicy(candidates=(chain,)), flat_costs(10.0, 0.5))
    for _ in range(30):
        teach(runner.acceptance, [1], *chain_outcome(2))
        teach(runner.acceptance, [2], *chain_outcome(0))
    q = runner.acceptance.acceptance([1, 2], [GREEDY] * 2)
    assert q[0, 0, 0, 0] > 0.8 and q[1, 0, 0, 0] < 0.2
    assert runner.expected_accept([1])[0, 0] > 2.5 > 1.5 > runner.expected_accept([2])[0, 0]


def flat_costs(target_ms: float, mtp_ms: float) -> CostModel:
    return CostModel.flat(target_ms / 1e3, mtp_ms / 1e3, candidates=SpecConfig.auto().candidates)


def test_policy_speculates_when_drafts_are_cheap_and_accepted_and_not_otherwise():
    policy = SpecConfig.auto()
    chain8 = SpecConfig.chain(8)
    # Cheap drafts, everything accepted: the deepest candidate wins.
    runner = AdaptivePolicy(policy, flat_costs(10.0, 0.1))
    for _ in range(20):
        observe(runner, chain8, [0], 0.011, *chain_outcome(7, depth=7), [8])
    assert choose(runner, [0]).num_draft_tokens == 8
    # Drafts as dear as the target, nothing accepted: plain decoding.
    runner = AdaptivePolicy(policy, flat_costs(10.0, 10.0))
    for _ in range(20):
        observe(runner, chain8, [0], 0.1, *chain_outcome(0, depth=7), [1])
    assert choose(runner, [0]) is None
    assert runner.counts == {"none": 1}


def test_no_estimate_passes_what_a_round_can_emit():
    """A kind's calibration (observed / predicted, learnt on its other shapes) may lift a
    shallow shape's estimate past its deepest path plus the bonus; the estimate stops there,
    and at what a request has left."""
    shallow, deep = SpecConfig(2, 3, 6), SpecConfig(5, 2, 6)
    runner = AdaptivePolicy(AutoPolicy(candidates=(shallow, deep)), flat_costs(10.0, 0.5))
    for _ in range(40):        # every drafted node accepted: the positional model is near its cap
        observe(runner, deep, [0], 0.02, *chain_outcome(5, depth=5), [6])
    for _ in range(20):        # trees accept twice what it predicts
        runner._calibrate(deep, observed=4.0, predicted=2.5, batch=1)
    assert runner.calibration(shallow) > 1.5
    options, *_ = runner._values([0], None, None, None, None)
    tokens = dict(zip(options, runner._tokens))
    assert tokens[shallow] == pytest.approx(3.0) and tokens[deep] == pytest.approx(6.0)
    runner._values([0], None, [2], None, None)
    assert runner._tokens == pytest.approx([2.0, 2.0])


def first_retry(lost_by: float, drift_noise: float = TUNING.drift_noise, rounds: int = 2000) -> int | None:
    """Plain rounds until a policy that measured speculation losing retries it: chain D=4
    measured (its calibration) at `lost_by` of the plain step's speed, then plain rounds
    over one long request; None if never within `rounds`."""
    from dataclasses import replace
    chain4 = SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5),
                            tuning=replace(TUNING, drift_noise=drift_noise))
    runner.expected_accept = lambda ids, modes=None: np.full((len(ids), 1), 3.0)
    set_prices(runner, {"none": 1.0, "chain D=4": 1.5}, noise=0.01)
    # measured: tokens a round / price = lost_by, so 1.5 * lost_by tokens for 3 predicted
    seen = 1.5 * lost_by - 1.0
    for _ in range(600):             # long enough for the long-run ratio to be the same
        runner._calibrate(chain4, observed=1.0 + seen, predicted=3.0, batch=1)
    for i in range(rounds):
        if choose(runner, [5], remaining=[10_000]) is not None:
            return i
        observe(runner, None, [5], 0.010)
    return None


def test_unlucky_rounds_do_not_rule_speculation_out_for_good():
    """Six rounds with nothing accepted make plain decoding look better; while plain
    rounds run, the estimate keeps what was measured and widens, so speculation is
    explored again before long."""
    chain4 = SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    assert choose(runner, [5]) == chain4                       # the optimistic prior
    for _ in range(6):
        observe(runner, chain4, [5], 0.013, *chain_outcome(0, depth=3), [1])
    runner._last_batch = None
    assert choose(runner, [5]) is None
    low = runner.acceptance.acceptance([5], [GREEDY])[0, 0, 0, 0]
    assert low < 0.5 and runner.calibration(chain4) < 0.9
    calibration = runner.calibration(chain4)
    picks = []
    for _ in range(200):
        observe(runner, None, [5], 0.010)
        picks.append(choose(runner, [5], remaining=[10_000]))
    assert chain4 in picks
    # Plain rounds: the request's own counts decay towards the engine-wide ones (which stay
    # put), the calibration returns to its kind's long-run ratio, and the estimates widen.
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    for _ in range(2):
        observe(runner, chain4, [5], 0.013, *chain_outcome(0, depth=3), [1])
    runner._calibrate(chain4, observed=1.0, predicted=3.0, batch=1)
    other = float(runner.acceptance.acceptance([6], [GREEDY])[0, 0, 0, 0])   # a new request: engine-wide only
    runner._values([5], None, None, None, None)
    assert runner._drift[1] == 0.0
    for _ in range(200):
        observe(runner, None, [5], 0.010)
    runner._settle()                                 # (plain rounds are applied when next needed)
    assert float(runner.acceptance.acceptance([5], [GREEDY])[0, 0, 0, 0]) == pytest.approx(other, abs=0.02)
    assert float(runner.acceptance.acceptance([6], [GREEDY])[0, 0, 0, 0]) == other
    seen, predicted = runner._long_sums[(False, "chain")]
    assert runner.calibration(chain4) == pytest.approx(seen / predicted, abs=0.01)
    runner._values([5], None, None, None, None)
    assert runner._drift[1] > 0.0


def test_plain_rounds_bring_a_calibration_back_to_its_long_run_not_to_level():
    """The rounds just before plain decoding takes over are biased low (their bad luck is
    why it took over): plain rounds bring the kind's calibration back to its long-run
    ratio, and no further. Negative control: with a long run as short as the calibration's
    own memory, it stays where the unlucky rounds left it."""
    from dataclasses import replace
    chain4 = SpecConfig.chain(4)

    def after_plain(tuning):
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5), tuning=tuning)
        for _ in range(200):
            runner._calibrate(chain4, observed=1.0 + 1.2, predicted=3.0, batch=1)      # 0.6 of the prediction
        for _ in range(10):
            runner._calibrate(chain4, observed=1.0 + 0.2, predicted=3.0, batch=1)      # an unlucky stretch
        low = runner.calibration(chain4)
        for _ in range(200):
            observe(runner, None, [5], 0.010)
        return low, runner.calibration(chain4)

    low, back = after_plain(TUNING)
    assert low < 0.4 and back == pytest.approx(0.6, abs=0.08)
    low, stays = after_plain(replace(TUNING, long_keep=TUNING.calibration_keep))
    assert stays < 0.4


def test_speculation_that_lost_narrowly_is_retried_sooner_than_one_that_lost_by_far():
    """How soon plain decoding gives speculation another round follows from how far it
    lost and how long ago (`drift_noise`): here, with no drafter catch-up to pay, within
    about 60 plain rounds after a narrow loss and twice that after a wide one (decisions
    come every 64 rounds at most while plain decoding holds). Negative control: with no
    drift, neither is retried."""
    narrow, wide = first_retry(0.9), first_retry(0.6)
    assert narrow is not None and wide is not None
    assert narrow <= 64 < wide <= 200
    assert first_retry(0.9, drift_noise=0.0, rounds=600) is None
    assert first_retry(0.6, drift_noise=0.0, rounds=600) is None


def test_speculation_retried_while_plain_decoding_holds_runs_on_while_it_measures_well():
    """Speculation lost narrowly (0.9x plain decoding), then the text changed: its rounds
    now accept one drafted token each (1.33x). The first retry after plain rounds measures
    part of what the text became (one round is a noisy reading of a random walk, a Kalman
    update, `_measured`), so it is decided on again at once and explored on, and the policy
    switches to it with no plain round in between. Negative control: as if one round
    measured the drift whole, the policy returns to plain decoding for another period."""
    chain4 = SpecConfig.chain(4)

    def rounds(one_round_measures_all: bool) -> str:
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
        runner.expected_accept = lambda ids, modes=None: np.full((len(ids), 1), 3.0)
        set_prices(runner, {"none": 1.0, "chain D=4": 1.5}, noise=0.01)
        for _ in range(600):                       # measured at 0.9x: 1.35 tokens a round for 1.5 steps
            runner._calibrate(chain4, observed=1.35, predicted=3.0, batch=1)
        if one_round_measures_all:
            runner._measured = lambda spec: setattr(runner, "_unmeasured", 0.0)
        picks = []
        for _ in range(200):
            spec = choose(runner, [5], remaining=[10_000])
            picks.append("." if spec is None else "c")
            if spec is None:
                observe(runner, None, [5], 0.010)
            else:
                observe(runner, chain4, [5], 0.015, *chain_outcome(1, depth=3), [2])
        return "".join(picks)

    kalman, reset = rounds(False), rounds(True)
    retry = kalman.index("c")
    assert 0 < retry <= 64 and reset.index("c") == retry
    assert kalman[retry:] == "c" * (len(kalman) - retry)
    assert reset[retry + 1] == "."


def test_greedy_and_sampled_rounds_calibrate_apart():
    """The positional model misses differently where the verify pass draws (as the
    acceptance it reads is kept apart by mode): greedy rounds calibrate greedy estimates
    only, and sampled rounds sampled ones."""
    chain4 = SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    for _ in range(50):
        runner._calibrate(chain4, observed=1.5, predicted=3.0, batch=1)     # a quarter of the drafted
    assert runner.calibration(chain4) < 0.4
    assert runner.calibration(chain4, sampled=True) == 1.0
    for _ in range(50):
        runner._calibrate(chain4, observed=3.0, predicted=3.0, batch=1, sampled=True)
    assert runner.calibration(chain4, sampled=True) > 0.95 and runner.calibration(chain4) < 0.4


def test_a_shape_is_judged_by_its_kind_until_its_own_evidence_adds_up():
    """One unlucky round of a tree shape lowers its accept calibration only part of the
    way (shrunk towards the trees' as a whole); that evidence fades while other shapes run;
    many unlucky rounds do condemn it."""
    tree_a, tree_b = SpecConfig(3, 2, 6), SpecConfig(2, 3, 6)
    runner = AdaptivePolicy(AutoPolicy(candidates=(tree_a, tree_b)), flat_costs(10.0, 0.5))
    for _ in range(20):
        runner._calibrate(tree_b, observed=4.0, predicted=4.0, batch=1)     # as predicted
    runner._calibrate(tree_a, observed=1.0, predicted=4.0, batch=1)         # nothing accepted
    assert runner.calibration(tree_b) > 0.85
    assert 0.6 < runner.calibration(tree_a) < 0.8
    for _ in range(100):
        runner._calibrate(tree_b, observed=4.0, predicted=4.0, batch=1)
    assert runner.calibration(tree_a) == pytest.approx(runner.calibration(tree_b), abs=0.05)
    for _ in range(30):
        runner._calibrate(tree_a, observed=1.0, predicted=4.0, batch=1)
    assert runner.calibration(tree_a) < 0.3


def test_plain_rounds_applied_together_equal_one_at_a_time():
    """Plain rounds are only counted as they come and applied when an estimate is next
    needed: the result is that of applying them one by one, also across a batch change."""
    chain4, tree = SpecConfig.chain(4), SpecConfig(3, 2, 6)
    policy = AutoPolicy(candidates=(None, chain4, tree))

    def trained():
        runner = AdaptivePolicy(policy, flat_costs(10.0, 0.5))
        for sid in (5, 6):
            runner._predicted, runner._last_batch = {chain4: 3.0}, (sid,)
            observe(runner, chain4, [sid], 0.013, *chain_outcome(1, depth=3), [2])
        runner._flush()                         # those rounds applied: what follows is about plain ones
        return runner

    lazy, eager = trained(), trained()
    for batch, rounds in (([5, 6], 7), ([5], 3)):
        for _ in range(rounds):
            observe(lazy, None, batch, 0.010)
            eager.acceptance.relax(batch, 1)
            eager._fade_calibration(TUNING.plain_fade, long_run=True)
            eager._unmeasured += 1
    assert lazy.calibration(chain4) == pytest.approx(eager.calibration(chain4), rel=1e-12)
    assert lazy.calibration(tree) == pytest.approx(eager.calibration(tree), rel=1e-12)
    np.testing.assert_allclose(lazy.acceptance.acceptance([5, 6, NEW_REQUEST], [GREEDY] * 3),
                               eager.acceptance.acceptance([5, 6, NEW_REQUEST], [GREEDY] * 3), rtol=1e-12)
    lazy._settle()
    assert lazy._unmeasured == eager._unmeasured == 10
    assert not np.allclose(lazy.acceptance.acceptance([5, 6], [GREEDY] * 2),
                           trained().acceptance.acceptance([5, 6], [GREEDY] * 2), rtol=1e-3)


def test_a_round_is_priced_in_plain_steps_from_its_measured_rounds():
    """A candidate's price is its calibrated ratio to the plain step, corrected by its
    measured rounds (their median: one slow round does not move it; its first round, which
    pays one-time costs, is not counted); a candidate not yet measured takes its kind's
    correction, or the speculative rounds' while its kind has none; plain decoding is
    priced by its own rounds."""
    costs = flat_costs(10.0, 1.0)
    chain, chain6, tree = SpecConfig.chain(4), SpecConfig.chain(6), SpecConfig(3, 2, 6)
    forwards = costs.calibrated(chain, 8)
    assert costs.price(chain, 8) == pytest.approx(forwards)             # nothing measured: as calibrated
    for _ in range(40):
        costs.observe(chain, 8, 1.2 * costs.predict(chain, 8))
    assert costs.price(chain, 8) == pytest.approx(1.2 * forwards, rel=0.01)
    # Untried shapes take what their kind measured; another kind with nothing of its own
    # measured takes the speculative rounds' correction; plain decoding stays at 1.
    assert costs.price(chain6, 8) == pytest.approx(1.2 * costs.calibrated(chain6, 8), rel=0.01)
    assert costs.price(tree, 8) == pytest.approx(1.2 * costs.calibrated(tree, 8), rel=0.01)
    assert costs.price(None, 8) == pytest.approx(1.0)
    # ... and their prices are less certain than the measured one's.
    _, var, weight = costs.prices((chain, chain6, None), 8)
    assert var[0] < var[1] and weight[0] > weight[1]
    # A batch bucket is measured on its own.
    assert costs.price(chain, 64) == pytest.approx(costs.calibrated(chain, 64))
    # First round not counted, then the median of the rounds, shrunk towards the kind.
    costs.observe(tree, 8, 5.0 * costs.predict(tree, 8))
    assert costs.price(tree, 8) == pytest.approx(1.2 * costs.calibrated(tree, 8), rel=0.01)
    for scale in (1.5, 1.5, 9.0, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5, 1.5):
        costs.observe(tree, 8, scale * costs.predict(tree, 8))
    assert costs.price(tree, 8) == pytest.approx(1.5 * costs.calibrated(tree, 8), rel=0.01)
    assert costs.price(chain, 8) == pytest.approx(1.2 * forwards, rel=0.01)     # the chains keep their own
    for _ in range(20):
        costs.observe(None, 8, 1.1 * costs.predict(None, 8))
    assert costs.price(None, 8) == pytest.approx(1.1, rel=0.01)


def test_a_sampled_batch_prices_the_draw_at_every_verify_node():
    """Over sampled requests a verify pass draws the target's token at every node (a plain
    step at every request) inside the forward's own call. Prices are then in the sampled
    batch's own plain steps: (round + draw over B x D nodes) / (plain step + draw over B),
    and a sampled round that costs that, read against its forward (which the draw slows
    too), corrects nothing. Negative control: without the draws, rounds read that way
    price the chain a quarter below what it costs."""
    chain, B = SpecConfig.chain(4), 8
    costs, control = flat_costs(10.0, 1.0), flat_costs(10.0, 1.0)
    costs.draws = 0.2e-3 * np.asarray(DRAW_ROWS, float)             # 0.2 ms a node: 0.02 plain steps
    at_nodes, at_roots = 0.02 * B * chain.num_draft_tokens, 0.02 * B
    rounds = costs.calibrated(chain, B)
    truth = (rounds + at_nodes) / (1.0 + at_roots)
    assert costs.price(chain, B) == pytest.approx(rounds)                        # a greedy batch
    price, _, _ = costs.prices((chain, None), B, None, sampled=True)
    assert price == pytest.approx([truth, 1.0])
    step, verify = costs.plain_seconds(B), costs._price_of("verify", chain, B, None)
    for _ in range(10):
        for c, sampled in ((costs, True), (control, False)):
            c.observe(chain, B, (rounds + at_nodes) * step, forward_seconds=(verify + at_nodes) * step,
                      sampled=sampled)
    assert costs.prices((chain,), B, None, sampled=True)[0][0] == pytest.approx(truth, rel=1e-6)
    assert costs.prices((None,), B, None, sampled=True)[0][0] == pytest.approx(1.0)
    assert control.prices((chain,), B, None, sampled=True)[0][0] < 0.8 * truth


def test_a_draw_timed_slower_at_fewer_nodes_is_priced_as_the_larger_draw():
    """Drawing at fewer nodes never costs more, so a slow sample at a small count (seen: a
    single-node draw timed at 3.9 ms beside 0.5 ms for 16 nodes) is read as the larger
    count's time; the draws saved and loaded keep that. Negative control: interpolated as
    timed, a sampled batch-4 plain step would be priced at 1.3 greedy ones, every
    speculative round a quarter cheaper against it."""
    timed = np.array([3.9e-3, 0.5e-3, 1.4e-3, 17.8e-3, 104e-3])     # seconds at DRAW_ROWS nodes
    costs = flat_costs(10.0, 1.0)
    costs.draws = timed
    assert costs.draws.tolist() == [0.5e-3, 0.5e-3, 1.4e-3, 17.8e-3, 104e-3]
    step = costs.plain_seconds(4)
    assert costs.draw_steps(4, 4) == pytest.approx(0.5e-3 / step)
    assert CostModel.from_dict(costs.to_dict()).draws.tolist() == costs.draws.tolist()
    as_timed = float(np.interp(4, DRAW_ROWS, timed)) / step
    assert as_timed > 6 * costs.draw_steps(4, 4) and 1.0 + as_timed > 1.3
    with pytest.raises(ValueError, match="draw seconds must have shape"):
        costs.draws = timed[:3]


def test_a_slow_spell_of_the_machine_cancels_out_of_a_price():
    """A measured round is read against the target forward inside it: when the machine
    runs three times slower during a candidate's rounds, its forward does too, and its
    price in plain steps stays. Negative control: read against the calibrated plain step
    alone (no forward time), the slow spell lands on the candidate, three times dearer."""
    chain = SpecConfig.chain(4)
    costs, control = flat_costs(10.0, 1.0), flat_costs(10.0, 1.0)
    verify = costs._price_of("verify", chain, 8, None) * costs.plain_seconds(8)
    for _ in range(10):
        costs.observe(chain, 8, 3.0 * 1.1 * costs.predict(chain, 8), forward_seconds=3.0 * verify)
        control.observe(chain, 8, 3.0 * 1.1 * costs.predict(chain, 8))
    assert costs.price(chain, 8) == pytest.approx(1.1 * costs.calibrated(chain, 8), rel=0.01)
    assert control.price(chain, 8) == pytest.approx(3.3 * costs.calibrated(chain, 8), rel=0.01)
    # What that changes: plain decoding measured at idle speed against a chain emitting 2
    # tokens a round for 1.3 plain steps, measured during a slow spell.
    for runner_costs, expected in ((costs, chain), (control, None)):
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain)), runner_costs)
        runner.expected_accept = lambda ids, modes=None: np.full((len(ids), 1), 2.0)
        assert choose(runner, list(range(8))) == expected


def test_a_round_is_read_against_the_plain_steps_served_beside_it():
    """Where plain decoding ran lately (`pair_rounds`), a round is priced against those
    plain steps themselves, not through its forward's calibrated price: a verify forward
    served 30% dearer against the plain step than calibrated shows, and a slow spell
    still cancels (it slows the plain steps beside the round too). Negative control: with
    the plain steps further back than `pair_rounds`, the round is read against its own
    forward, whose calibrated price hides the 30%."""
    chain, tree, B = SpecConfig.chain(4), SpecConfig(3, 2, 6), 8
    paired, control = flat_costs(10.0, 1.0), flat_costs(10.0, 1.0)
    step = paired.plain_seconds(B)
    forward = paired._price_of("verify", chain, B, None) * step
    for slow in [1.0] * 10 + [3.0] * 10:          # idle, then a slow spell: every call 3x slower
        for costs, between in ((paired, 0), (control, TUNING.pair_rounds)):
            for _ in range(2):
                costs.observe(None, B, slow * step, forward_seconds=slow * step)
            for _ in range(between):             # rounds of another shape in between
                costs.observe(tree, B, slow * costs.predict(tree, B))
            # Its forward 30% dearer than calibrated, and the round's other calls with it.
            costs.observe(chain, B, slow * 1.3 * costs.predict(chain, B), forward_seconds=slow * 1.3 * forward)
    assert paired.price(chain, B) == pytest.approx(1.3 * paired.calibrated(chain, B), rel=0.01)
    assert paired.price(None, B) == pytest.approx(1.0, rel=0.01)
    assert control.price(chain, B) == pytest.approx(control.calibrated(chain, B), rel=0.01)


def test_a_sampled_round_is_read_against_the_sampled_plain_steps_beside_it():
    """Over sampled requests the plain steps beside a round drew at every request, and the
    round at every node: a round that costs what the calibration and the draws say is
    priced as calibrated, in the sampled batch's own plain steps, during a slow spell too.
    Negative control: with no plain steps beside it (and no forward time) it is read
    against the calibrated plain step, and the slow spell lands on it."""
    chain, B = SpecConfig.chain(4), 8
    costs, control = flat_costs(10.0, 1.0), flat_costs(10.0, 1.0)
    costs.draws = control.draws = 0.2e-3 * np.asarray(DRAW_ROWS, float)     # 0.2 ms a node: 0.02 plain steps
    at_nodes, at_roots = 0.02 * B * chain.num_draft_tokens, 0.02 * B
    rounds, step = costs.calibrated(chain, B), costs.plain_seconds(B)
    slow = 2.0                    # a slow spell the calibrated plain step knows nothing of
    for _ in range(10):
        costs.observe(None, B, slow * (1.0 + at_roots) * step, forward_seconds=slow * (1.0 + at_roots) * step,
                      sampled=True)
        for c in (costs, control):
            c.observe(chain, B, slow * (rounds + at_nodes) * step, forward_seconds=None, sampled=True)
    truth = (rounds + at_nodes) / (1.0 + at_roots)
    assert costs.prices((chain, None), B, None, sampled=True)[0] == pytest.approx([truth, 1.0], rel=1e-6)
    assert control.prices((chain,), B, None, sampled=True)[0][0] > 1.9 * truth


def test_a_pending_drafter_catch_up_is_paid_for_by_the_rounds_left():
    """Speculating after the drafter fell behind (a deferred prompt) first costs one
    drafter pass over the lag: worth it for a long generation, not for a few tokens."""
    chain4 = SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    runner.expected_accept = lambda ids, modes=None: np.full((len(ids), 1), 2.0)     # 2 tokens a round
    assert choose(runner, [1], lag=[0], remaining=[100]) == chain4
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    runner.expected_accept = lambda ids, modes=None: np.full((len(ids), 1), 2.0)
    runner.costs.catch_up_steps = lambda batch, lag, context=None, sampled=False: 0.05 * lag
    assert choose(runner, [1], lag=[600], remaining=[1000]) == chain4
    runner._last_batch = None
    assert choose(runner, [1], lag=[600], remaining=[8]) is None


def test_a_policy_that_never_speculates_never_runs_the_drafter(trained_ckpt, prompts, params):
    """When the engine-wide statistics say plain decoding wins, the drafter's prefill is
    deferred: plain rounds alone never pay for it."""
    llm = LLM(trained_ckpt, dtype="float64", max_batch_size=8)
    plain = [o.token_ids for o in llm.generate(prompts, params)]
    policy = SpecConfig.auto()
    runner = force_cycle(llm, policy, order=(None,))
    runner.acceptance.global_counts[:, HITS] = 0.0          # drafts are never accepted
    # Fixed costs, not this machine's: whether the prompts' drafter prefill is deferred must
    # not depend on how busy the cores were while the costs were measured.
    runner._costs = flat_costs(10.0, 5.0)
    calls = []
    mtp = llm.engine.model.mtp_forward
    llm.engine.model.mtp_forward = lambda *a, **k: calls.append(1) or mtp(*a, **k)
    outs = llm.generate(prompts, params, spec=policy)
    assert [o.token_ids for o in outs] == plain and calls == []
    assert llm.last_stats.spec_choices == {"none": llm.last_stats.num_steps}


def test_the_drafter_is_prefilled_with_the_target_when_speculation_earns_it_back(trained_ckpt, prompts):
    """At admission the prompts go through the drafter with the target's prefill where the
    policy expects to speculate with that prefill paid (the first round then has nothing to
    catch up); with statistics that say drafts fail, they wait."""
    from branchspec.checkpoint import load_checkpoint
    from branchspec.engine.engine import Engine

    engine = Engine(load_checkpoint(trained_ckpt, "float64"), EngineConfig(max_batch_size=2))
    runner = engine.policy(SpecConfig.auto())
    # Fixed costs: the decision must not depend on how fast this machine was just now.
    runner._costs = flat_costs(10.0, 0.5)
    runner.costs.catch_up_steps = lambda batch, lag, context=None, sampled=False: 1e-3 * lag * batch
    seq = engine.add_request(prompts[1], SamplingParams(max_tokens=64, ignore_eos=True))
    engine._admit(runner)
    assert not engine.drafter.lag(seq.seq_id)

    runner.acceptance.global_counts[:, HITS] = 0.0
    late = engine.add_request(prompts[3], SamplingParams(max_tokens=64, ignore_eos=True))
    engine._admit(runner)
    assert engine.drafter.lag(late.seq_id) == len(prompts[3])


def test_a_prompts_drafter_prefill_waits_unless_speculation_earns_it_back():
    """The prompts' drafter pass, priced like a catch-up and spread over the rounds the
    batch has left: worth it for a long generation, not for a burst of short ones, never
    where drafts fail; without plain decoding among the candidates it always runs."""
    chain4 = SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    runner.expected_accept = lambda ids, modes=None: np.full((len(ids), 1), 2.5)
    runner.costs.catch_up_steps = lambda batch, lag, context=None, sampled=False: 0.02 * lag * batch
    assert not runner.defer_drafter(BatchView([1], [200], [256], 200.0))
    burst = list(range(32))
    assert runner.defer_drafter(BatchView(burst, [200] * 32, [16] * 32, 200.0))
    runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
    assert runner.defer_drafter(BatchView([1], [200], [256], 200.0))
    always = AdaptivePolicy(AutoPolicy(candidates=(chain4,)), flat_costs(10.0, 0.5))
    always.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
    assert not always.defer_drafter(BatchView([1], [200], [256], 200.0))


def test_calibration_is_measured_once_and_cached(trained_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("BRANCHSPEC_CACHE", str(tmp_path / "cache"))          # empty: the first call measures
    from branchspec.checkpoint import load_checkpoint
    import branchspec.speculative.profiling as costs_mod
    from branchspec.cache.paged import PagedState
    from branchspec.execution.eager import EagerExecutor

    model = load_checkpoint(trained_ckpt, "float32")
    executor = EagerExecutor(model, PagedState(model.cfg, max_seqs=1, max_len=256))
    candidates = (None, SpecConfig.chain(3), SpecConfig(2, 2, 4))
    first = load_or_calibrate(executor, 4, candidates)
    assert first.batches == calibration_batches(4) == (1, 4)
    # Every candidate's whole round priced against the plain steps beside it: a round
    # drafts, verifies D nodes and extends the drafter, so it costs more than a plain step,
    # its verify forward less than the whole round. (Timed on a shared machine, one cell
    # may read otherwise: the medians over the grid are compared.)
    assert first.keys == ("chain D=3", "none", "tree 2x2 D=4")
    rounds, verify = first.grids["round"], first.grids["verify"]
    assert np.isfinite(rounds).all() and (rounds > 0).all()
    assert np.median(rounds[:, [0, 2]]) > 1.0
    assert np.median(verify[:, [0, 2]] / rounds[:, [0, 2]]) < 1.0
    assert (first.grids["catch_up"] > 0).all() and (first.plain > 0).all()
    monkeypatch.setattr(costs_mod, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    again = load_or_calibrate(executor, 4, candidates)
    np.testing.assert_array_equal(again.grids["round"], first.grids["round"])


def test_a_verify_forward_is_priced_by_its_node_count_not_its_shape():
    """Three candidates verify 8 nodes and one 4; one of the 8-node shapes drew slow
    verify samples (a noisy spell of the machine). Pooled, every 8-node shape gets the
    same verify price (the median of all their samples), and each round is that price
    plus its own drafting remainder, so the slow samples do not make that shape dearer."""
    from branchspec.speculative.profiling import pooled_verify

    verify = [[1.10, 1.12, 1.11], [1.30, 1.32, 1.31], [1.09, 1.13, 1.12], [1.02, 1.03, 1.01]]
    remainder = [0.50, 0.50, 0.90, 0.40]                     # drafting and extending, per shape
    rounds = [[v + r for v in vs] for vs, r in zip(verify, remainder)]
    round_price, verify_price = pooled_verify(rounds, verify, [8, 8, 8, 4])
    pooled = float(np.median(verify[0] + verify[1] + verify[2]))
    assert verify_price[:3] == pytest.approx([pooled] * 3) and verify_price[3] == pytest.approx(1.02)
    assert round_price == pytest.approx([pooled + 0.5, pooled + 0.5, pooled + 0.9, 1.02 + 0.4])
    # Negative control: priced from its own samples alone, the slow shape is 18% dearer
    # than its twin with the same drafting.
    own = [float(np.median(r)) for r in rounds]
    assert own[1] / own[0] > 1.1 and round_price[1] == pytest.approx(round_price[0])
    # A candidate without samples stays unpriced.
    assert pooled_verify([[], [1.5]], [[], [1.1]], [8, 8]) == ([None, pytest.approx(1.5)], [None, 1.1])


@pytest.mark.parametrize("bad, message", [
    (dict(candidates=()), "non-empty"),
    (dict(candidates=(SpecConfig.chain(3), "chain")), "candidates\\[1\\]"),
    (dict(candidates=(None, None)), "duplicates"),
])
def test_bad_policies_are_refused(bad, message):
    with pytest.raises((TypeError, ValueError), match=message):
        AutoPolicy(**bad)


def test_default_candidates():
    c = default_candidates(8)
    assert c[0] is None and SpecConfig.chain(2) in c and SpecConfig.chain(8) in c
    assert all(s is None or s.num_draft_tokens <= 8 for s in c)
    assert SpecConfig(3, 2, 6, selection="calibrated") in c and SpecConfig(7, 2, 8, selection="calibrated") in c
    eagle = default_candidates(8, "eagle2")
    assert SpecConfig(3, 2, 6) in eagle and SpecConfig(7, 2, 8) not in eagle
    assert SpecConfig.auto().candidates == c
    with pytest.raises(ValueError, match="max_draft_tokens"):
        default_candidates(1)
    with pytest.raises(ValueError, match="selection"):
        default_candidates(8, "best")


def test_fast_path_candidates():
    """The compact set compiled engines choose among: plain decoding, two chains, and the
    trees that were fastest compiled, each within the budget cap and valid at its D."""
    c = fast_path_candidates(8)
    assert c == (None, SpecConfig.chain(4), SpecConfig.chain(6), SpecConfig(3, 2, 6, selection="calibrated"),
                 SpecConfig(5, 2, 6, selection="calibrated"), SpecConfig(4, 2, 8, selection="calibrated"))
    assert SpecConfig(2, 3, 6) in fast_path_candidates(8, "eagle2")
    for top in range(2, 17):
        got = fast_path_candidates(top)
        assert got[0] is None and len(set(got)) == len(got)
        assert all(s.num_draft_tokens <= top for s in got[1:]) and SpecConfig.chain(min(4, top)) in got
    with pytest.raises(ValueError, match="max_draft_tokens"):
        fast_path_candidates(1)
    with pytest.raises(ValueError, match="selection"):
        fast_path_candidates(8, "best")


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_auto_policy_on_the_fast_path_chooses_among_the_compact_set(command):
    """`--compile --speculative-policy auto` compiles every candidate before it runs, so the
    CLI gives it `fast_path_candidates` (capped by --speculative-num-draft-tokens); eager
    runs keep every default candidate."""
    from branchspec.cli import _spec_from_args, build_parser

    parser = build_parser()
    head = [command, "prompt"] if command == "generate" else [command]
    for flags, want in (([], default_candidates(8)), (["--compile"], fast_path_candidates(8)),
                        (["--compile", "--speculative-num-draft-tokens", "6"], fast_path_candidates(6))):
        args = parser.parse_args([*head, "--speculative-policy", "auto", *flags])
        if args.speculative_algorithm is None:      # serve's default: resolved by _serve_spec
            args.speculative_algorithm = "EAGLE"
        assert _spec_from_args(args, parser).candidates == want


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("budget", ["0", "1", "17"])
def test_cli_auto_policy_refuses_a_bad_budget_naming_the_flag(compiled, budget, capsys):
    """A budget cap out of range is refused with the flag's name on either path (0 is
    not taken for "unset")."""
    from branchspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "x", "--speculative-policy", "auto", "--speculative-num-draft-tokens", budget,
              *(["--compile"] if compiled else [])])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--speculative-num-draft-tokens" in err and f"got {budget}" in err


def test_cli_generate_with_the_auto_policy(capsys):
    """The embedded model through the CLI: the policy's output equals plain decoding's and
    it says which configurations ran."""
    import json

    from branchspec.cli import main

    prompt = ["generate", "Question: Tom has 3 apples and buys 4 more. How many now?\nAnswer:", "--max-tokens", "24",
              "--json"]
    assert main([*prompt, "--speculative-policy", "auto"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert main([*prompt, "--speculative-algorithm", "NONE"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert auto["token_ids"] == plain["token_ids"] and auto["spec"] == "auto"
    assert sum(auto["rounds_by_configuration"].values()) >= 1


@pytest.mark.parametrize("argv, message", [
    (["--speculative-policy", "auto", "--speculative-algorithm", "NONE"], "needs speculation"),
    (["--speculative-policy", "auto", "--speculative-eagle-topk", "2"], "fixes what"),
    (["--speculative-policy", "auto", "--speculative-num-draft-tokens", "1"], "--speculative-num-draft-tokens"),
])
def test_cli_refuses_contradicting_policy_flags(argv, message, capsys):
    from branchspec.cli import main

    with pytest.raises(SystemExit) as e:
        main(["generate", "hello", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def set_prices(runner, prices: dict[str, float], noise: float = 0.01) -> None:
    """Price the runner's options (by label, in plain steps) with a known variance."""
    runner.costs.prices = lambda specs, b, context=None, sampled=False: (
        np.array([prices[spec_label(s)] for s in specs]), np.full(len(specs), noise ** 2), np.full(len(specs), 10.0))
    runner.costs.round_noise = lambda b: noise


def test_near_ties_do_not_flip_the_choice_and_the_batch_change_redecides():
    """A challenger displaces the standing choice only once its lead exceeds the noise of
    the two estimates (`lead_noise` deviations of their difference)."""
    chain3, chain4 = SpecConfig.chain(3), SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(chain3, chain4)), flat_costs(10.0, 0.5))
    prices = {"chain D=3": 1.0, "chain D=4": 0.99}
    runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 2))
    set_prices(runner, prices, noise=0.02)
    assert choose(runner, [1]) == chain4
    prices["chain D=3"] = 0.98                       # better by 1%, inside the noise (2.8%)
    for _ in range(3 * TUNING.redecide_every):
        choose(runner, [1])                          # (it may explore it: that is free)
        assert runner.last_choice == chain4
    prices["chain D=3"] = 0.90                       # clearly better: switch at the next decision,
    picks = [choose(runner, [1]) for _ in range(TUNING.redecide_most)]   # the period grown while it held
    assert picks[-1] == chain3 == runner.last_choice
    prices["chain D=3"] = 1.2
    assert choose(runner, [1, 2]) == chain4           # a new batch decides at once


def test_requests_leaving_keep_the_schedule_and_their_rounds_still_calibrate():
    """A request that leaves the batch does not force a decision (one that joins, or a
    batch size past a power of two, does), and the rounds over what is left still teach
    the accept calibration, against the prediction for the requests still there."""
    chain3, chain4 = SpecConfig.chain(3), SpecConfig.chain(4)
    runner = AdaptivePolicy(AutoPolicy(candidates=(chain3, chain4)), flat_costs(10.0, 0.5))
    runner.expected_accept = lambda ids, modes=None: np.tile([[2.0, 2.5]], (len(ids), 1))
    prices = {"chain D=3": 1.0, "chain D=4": 0.9}
    set_prices(runner, prices, noise=0.01)
    assert choose(runner, [1, 2, 3, 4]) == chain4
    prices["chain D=4"] = 2.0                        # now clearly worse
    choose(runner, [1, 2, 3])                          # a request left (it may explore: free)
    assert runner.last_choice == chain4                # the standing choice stays
    before = runner.calibration(chain4)
    children, targets = (t.repeat(3, 1, 1) if t.dim() == 3 else t.repeat(3, 1) for t in chain_outcome(0, depth=3))
    observe(runner, chain4, [1, 2, 3], 0.01, children, targets, path_len=[1, 1, 1])   # nothing accepted
    # predicted 3 x 2.5 tokens, 4.5 drafted; observed 3, none drafted: the calibration drops
    assert runner.calibration(chain4) < before
    choose(runner, [1, 2, 3, 5])
    assert runner.last_choice == chain3                # a request joined: decided at once
    # Negative control: the same departure decides at once when the size bucket changes.
    runner = AdaptivePolicy(AutoPolicy(candidates=(chain3, chain4)), flat_costs(10.0, 0.5))
    runner.expected_accept = lambda ids, modes=None: np.tile([[2.0, 2.5]], (len(ids), 1))
    prices["chain D=4"] = 0.9
    set_prices(runner, prices, noise=0.01)
    assert choose(runner, [1, 2, 3, 4]) == chain4
    prices["chain D=4"] = 2.0
    choose(runner, [1, 2])                             # batch 4 -> 2
    assert runner.last_choice == chain3


def count_decisions(runner) -> list[int]:
    """Record the round (a count of `choose` calls, kept as `runner.rounds_chosen[0]`) at
    which each decision is taken."""
    at, rounds, decide, choose_ = [], [0], runner._decide, runner.choose
    runner.rounds_chosen = rounds

    def decided(batch):
        at.append(rounds[0])
        decide(batch)

    def counted(batch):
        out = choose_(batch)
        rounds[0] += 1
        return out
    runner._decide, runner.choose = decided, counted
    return at


def test_the_decision_period_grows_while_the_choice_holds_and_shrinks_when_it_changes():
    """A decision that keeps the standing choice doubles the period to the next, up to
    `redecide_most` rounds; a switch brings it back to `redecide_every`, and a request
    joining to `redecide_every` x B / newcomers (here one of two: twice that).
    Negative control: with `redecide_most` at `redecide_every` the schedule is fixed."""
    from dataclasses import replace
    chain3, chain4 = SpecConfig.chain(3), SpecConfig.chain(4)

    def decisions(tuning, rounds: int = 64):
        runner = AdaptivePolicy(AutoPolicy(candidates=(chain3, chain4)), flat_costs(10.0, 0.5), tuning=tuning)
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 2))
        prices = {"chain D=3": 1.0, "chain D=4": 1.5}            # far apart: nothing worth exploring
        set_prices(runner, prices, noise=0.01)
        at = count_decisions(runner)
        picks = [choose(runner, [1]) for _ in range(rounds)]
        return runner, prices, at, picks

    every, most = TUNING.redecide_every, TUNING.redecide_most
    runner, prices, at, picks = decisions(TUNING)
    assert set(picks) == {chain3}
    periods = np.diff(at).tolist()
    assert periods[:3] == [every, 2 * every, 4 * every] and max(periods) == most
    prices["chain D=4"] = 0.5                                    # now clearly better
    for _ in range(most):
        choose(runner, [1])
    assert runner.last_choice == chain4
    switched = len(at) - 1
    for _ in range(2 * every):
        choose(runner, [1])
    assert at[switched + 1] - at[switched] == every            # the period is back to its start
    prices["chain D=3"] = 2.0                                    # the choice holds from here on
    for _ in range(2 * most):
        choose(runner, [1])
    assert at[-1] - at[-2] == most
    joined, now = len(at), runner.rounds_chosen[0]
    for _ in range(3 * every):
        choose(runner, [1, 2])                                   # a request joins: decided at once,
    assert at[joined] == now and at[joined + 1] - at[joined] == 2 * every     # then watched closer
    _, _, fixed, _ = decisions(replace(TUNING, redecide_most=every))
    assert set(np.diff(fixed).tolist()) == {every} and len(fixed) > len(at) - 2


def test_while_plain_decoding_holds_decisions_thin_out_further():
    """Plain rounds teach nothing of acceptance, so while plain decoding is the standing
    choice the period keeps doubling up to `redecide_most_plain` rounds; a speculative
    choice stops at `redecide_most`. Negative control: with the two equal, plain decoding
    is decided for as often as speculation."""
    from dataclasses import replace
    chain4 = SpecConfig.chain(4)

    def periods(tuning, plain_wins: bool):
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5), tuning=tuning)
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
        set_prices(runner, {"none": 1.0, "chain D=4": 3.0 if plain_wins else 0.3}, noise=0.01)
        at = count_decisions(runner)
        picks = [choose(runner, [1]) for _ in range(512)]
        assert set(picks) == {None if plain_wins else chain4}
        return np.diff(at).tolist()

    assert max(periods(TUNING, plain_wins=True)) == TUNING.redecide_most_plain > TUNING.redecide_most
    assert max(periods(TUNING, plain_wins=False)) == TUNING.redecide_most
    same = replace(TUNING, redecide_most_plain=TUNING.redecide_most)
    assert max(periods(same, plain_wins=True)) == TUNING.redecide_most


def test_a_request_joining_is_decided_for_once_and_restarts_the_period_by_its_share():
    """A joining request is decided for at its admission (`defer_drafter`), not again at
    the round after it. While plain decoding holds, the join keeps the grown period (plain
    rounds measure nothing of the newcomer); a speculative choice starts it over at
    `redecide_every` x B / newcomers: at once for a batch all new, twice that for one
    request of two. Negative control: a join that restarted the period under plain
    decoding would bring the next decision back within `redecide_every` rounds."""
    chain4 = SpecConfig.chain(4)

    def after_join(plain_wins: bool, joined: list[int]):
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
        set_prices(runner, {"none": 1.0, "chain D=4": 3.0 if plain_wins else 0.3}, noise=0.01)
        at = count_decisions(runner)
        for _ in range(200):
            choose(runner, [1])
        before = len(at)
        lag = [0 if s == 1 else 100 for s in joined]
        deferred = runner.defer_drafter(BatchView(joined, lag, [], None))       # request 2 joins
        assert len(at) == before + 1 and deferred == plain_wins
        start = runner.rounds_chosen[0]
        for _ in range(3 * TUNING.redecide_most_plain):
            choose(runner, joined)
        return [a - start for a in at[before + 1:]]

    plain = after_join(plain_wins=True, joined=[1, 2])
    assert plain[0] > TUNING.redecide_every          # the period it had grown to, not a fresh one
    assert after_join(plain_wins=False, joined=[2])[0] == TUNING.redecide_every - 1      # all new
    assert after_join(plain_wins=False, joined=[1, 2])[0] == 2 * TUNING.redecide_every - 1    # half new
    # the control: the same join with the period started over
    runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
    runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
    set_prices(runner, {"none": 1.0, "chain D=4": 3.0}, noise=0.01)
    for _ in range(200):
        choose(runner, [1])
    runner.defer_drafter(BatchView([1, 2], [0, 100], [], None))
    runner._steady = 0
    at = count_decisions(runner)
    for _ in range(2 * TUNING.redecide_every):
        choose(runner, [1, 2])
    assert at and at[0] < TUNING.redecide_every


def test_an_exploring_round_does_not_start_the_decision_period_over():
    """Every decision here keeps the choice and asks for one round of the other candidate:
    the period still doubles up to `redecide_most`, with one exploring round in each, so
    exploration thins out while the choice holds (each decision was a few hundred
    microseconds at batch 16 and more, cache-cold). Negative control: exploring as if it
    started the period over, it stays at `redecide_every`."""
    chain3, chain4 = SpecConfig.chain(3), SpecConfig.chain(4)

    def run(explore_restarts: bool):
        runner = AdaptivePolicy(AutoPolicy(candidates=(chain3, chain4)), flat_costs(10.0, 0.5))
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 2))
        set_prices(runner, {"chain D=3": 1.0, "chain D=4": 1.5}, noise=0.01)
        runner._worth_exploring = lambda *args: chain4
        if explore_restarts:
            decide = runner._decide

            def restarting(batch):
                decide(batch)
                runner._steady = 0
            runner._decide = restarting
        at = count_decisions(runner)
        picks = [choose(runner, [1]) for _ in range(96)]
        return np.diff(at).tolist(), picks, at

    periods, picks, at = run(explore_restarts=False)
    assert max(periods) == TUNING.redecide_most
    assert len(at) - 1 <= picks.count(chain4) <= len(at)     # one round a period (the last may not come)
    fixed, _, _ = run(explore_restarts=True)
    assert set(fixed) == {TUNING.redecide_every}


def test_observed_rounds_apply_in_order_when_an_estimate_is_next_needed():
    """Rounds are observed cheaply and applied together before the next estimate: the
    accept calibration, the round prices (corrections, the plain steps kept for pairing
    and the round counts they are paired by) and the relaxed acceptance come out as if each
    round had been applied as it came, long runs of plain rounds included (all but their
    last `plain_memory` are only counted). Negative controls: applied out of order they do
    not, nor with plain rounds counted but not applied beyond what the prices remember."""
    chain3 = SpecConfig.chain(3)

    def served(settle_each: bool, reverse: bool = False):
        """settle_each: each round applied as it is observed."""
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain3)), flat_costs(10.0, 0.5))
        choose(runner, [1, 2])
        for i in range(14):                                      # the last two: speculative rounds
            if i % 3 == 2:                                       # a plain round, over a batch that changes
                observe(runner, None, [1, 2] if i < 6 else [1], 0.010 + 1e-4 * i)
            else:
                children, targets = (t.repeat(2, 1, 1) if t.dim() == 3 else t.repeat(2, 1)
                                     for t in chain_outcome(i % 3, depth=2))
                observe(runner, chain3, [1, 2], 0.012 + 1e-4 * i, children, targets, path_len=[1 + i % 3] * 2)
            if i in (4, 9):      # long runs of plain rounds: greedy, then sampled, then greedy again
                for j in range(50):
                    modes = [SAMPLED] * 2 if 20 <= j < 45 else None
                    observe(runner, None, [1, 2], 0.010 + 1e-5 * j, context=100.0 + j, modes=modes)
                    if settle_each:
                        runner._flush()
            if settle_each:
                runner._flush()
        if reverse:
            runner._pending.reverse()
        costs = runner.costs
        return (runner.accept_sums, {k: list(v) for k, v in costs.corrections.items()},
                {k: list(v) for k, v in costs._plain_steps.items()}, dict(costs._rounds),
                runner.acceptance.acceptance([1, 2], [GREEDY] * 2).tolist())

    one_by_one = served(settle_each=True)
    assert served(settle_each=False) == one_by_one
    assert one_by_one[0][(False, "chain")] != (TUNING.calibration_prior,) * 2 and one_by_one[1]   # something was applied
    assert served(settle_each=False, reverse=True) != one_by_one
    with pytest.MonkeyPatch.context() as mp:           # more plain rounds only counted than it may
        mp.setattr(CostModel, "plain_memory", property(lambda self: 4))
        assert served(settle_each=False) != one_by_one

def test_round_costs_follow_the_context():
    """Prices are measured from a short and a long context: a price interpolates between
    them and keeps the longer one's slope beyond it; the plain step's seconds too; a
    round's correction is a ratio, so what it measured at one context carries to another."""
    keys = grid_keys((None, SpecConfig.chain(4)))                      # ("chain D=4", "none")
    rounds = np.empty((2, 2, 2))
    rounds[:, 0, 0], rounds[:, 0, 1], rounds[:, 1] = 1.6, 1.4, 1.0      # the chain cheaper over 512
    grids = {"round": rounds, "verify": np.ones((2, 2, 2)), "catch_up": np.full((2, len(CATCH_UP_TOKENS), 2), 0.1)}
    plain = np.array([[0.010, 0.014], [0.020, 0.030]])                 # 10 ms over 128, 14 ms over 512 at batch 1
    costs = CostModel((1, 64), keys, grids, plain, contexts=(128, 512))
    chain = SpecConfig.chain(4)
    assert costs.plain_seconds(1, 128) == pytest.approx(0.010)
    assert costs.plain_seconds(1, 320) == pytest.approx(0.012)
    assert costs.plain_seconds(1, 896) == pytest.approx(0.018)
    assert costs.plain_seconds(1, 40) == pytest.approx(0.010)
    assert costs.plain_seconds(1) == costs.plain_seconds(1, 128)       # no context: the shortest
    assert costs.price(chain, 1, 320) == pytest.approx(1.5)
    assert costs.price(chain, 8, 128) == pytest.approx(1.6)            # between batches: the same ratio here
    assert costs.predict(chain, 1, 512) == pytest.approx(1.4 * 0.014)
    for _ in range(40):
        costs.observe(None, 1, 0.0145, context=512)                    # 3.6% over the plain step there
    assert costs.price(None, 1, 512) == pytest.approx(0.0145 / 0.014, rel=1e-3)
    assert costs.price(None, 1, 128) == pytest.approx(0.0145 / 0.014, rel=1e-3)
    again = CostModel.from_dict(costs.to_dict())
    assert again.contexts == (128, 512) and again.price(chain, 1, 320) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="shape"):
        CostModel((1, 64), keys, {**grids, "round": rounds[..., :1]}, plain, contexts=(128, 512))
    with pytest.raises(ValueError, match="no calibrated price for chain D=6"):
        costs.price(SpecConfig.chain(6), 1)


def test_speculation_must_beat_plain_decoding_by_more_than_its_noise():
    """Plain decoding standing, speculation whose estimate leads by less than the noise of
    the difference does not displace it; by more, it does. The noise is what the estimates
    carry: with the same lead, a noisier estimate does not switch."""
    chain3 = SpecConfig.chain(3)
    for noise, lead, switches in ((0.02, 0.02, False), (0.02, 0.06, True), (0.06, 0.06, False)):
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain3)), flat_costs(10.0, 0.5))
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
        prices = {"none": 1.0, "chain D=3": 1.5}
        set_prices(runner, prices, noise)
        assert choose(runner, [1]) is None
        prices["chain D=3"] = math.exp(-lead)
        runner._last_batch = None
        choose(runner, [1])                  # (a close one may be explored: what stands is the choice)
        assert (runner.last_choice == chain3) is switches, (noise, lead)


def test_exploring_is_for_close_candidates_whose_estimate_could_still_change_the_choice():
    """A candidate just behind the choice whose price is a guess is explored once in a
    while (at once, when a decision asks for it), for one round, then the choice runs
    again; one far behind, or already measured
    as well as the choice, is not; nor is anything when the batch has no rounds left to use
    what exploring would tell."""
    chain3, chain4 = SpecConfig.chain(3), SpecConfig.chain(4)

    def picks(own_noise: float, price: float, remaining: int | None = None, rounds: int = 4 * TUNING.redecide_every):
        runner = AdaptivePolicy(AutoPolicy(candidates=(chain3, chain4)), flat_costs(10.0, 0.5))
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 2))
        prices = {"chain D=3": 1.0, "chain D=4": price}
        runner.costs.prices = lambda specs, b, context=None, sampled=False: (
            np.array([prices[spec_label(s)] for s in specs]), np.array([0.01 ** 2, own_noise ** 2]), np.ones(2))
        runner.costs.round_noise = lambda b: 0.01
        return [spec_label(choose(runner, [1], remaining=None if remaining is None else [remaining]))
                for _ in range(rounds)]

    close = picks(own_noise=0.15, price=1.02)
    assert close.count("chain D=3") > close.count("chain D=4") > 0
    assert close.count("chain D=4") <= len(close) // TUNING.redecide_every      # at most once a decision
    assert all(a != "chain D=4" or b == "chain D=3" for a, b in zip(close, close[1:]))   # one round at a time
    assert "chain D=4" not in picks(own_noise=0.15, price=1.5)           # far behind
    assert "chain D=4" not in picks(own_noise=0.01, price=1.02)          # as well measured as the choice
    assert "chain D=4" not in picks(own_noise=0.15, price=1.02, remaining=1)   # nothing left to use it for


def test_an_exploring_round_pays_the_drafters_whole_catch_up():
    """Speculating after plain rounds first feeds the drafter what it did not follow. A
    chosen option spreads that over the rounds left, but a single exploring round pays it
    all: next to plain decoding, a close chain whose price is a guess is explored when the
    drafter has followed everything (the negative control), and not when its one round
    would first pay a catch-up of two plain steps."""
    chain4 = SpecConfig.chain(4)

    def picks(lag: int) -> list[str]:
        runner = AdaptivePolicy(AutoPolicy(candidates=(None, chain4)), flat_costs(10.0, 0.5))
        runner.expected_accept = lambda ids, modes=None: np.ones((len(ids), 1))
        runner.costs.prices = lambda specs, b, context=None, sampled=False: (
            np.array([1.0 if s is None else 1.02 for s in specs]), np.array([0.01 ** 2, 0.15 ** 2]), np.ones(2))
        runner.costs.round_noise = lambda b: 0.01
        runner.costs.catch_up_steps = lambda batch, lag, context=None, sampled=False: 2.0 if lag else 0.0
        return [spec_label(choose(runner, [1], lag=[lag], remaining=[1000])) for _ in range(4 * TUNING.redecide_every)]

    followed, behind = picks(lag=0), picks(lag=16)
    assert "chain D=4" in followed
    assert set(behind) == {"none"}


def test_engine_wide_acceptance_remembers_more_than_one_requests_last_rounds():
    """At batch 1 the engine-wide statistics are that one request's rounds: they keep about
    GLOBAL_MEMORY of them, not the request's own last ten, so a few misses after many hits
    move the estimate a new request starts from only part of the way."""
    model = AcceptanceModel()
    for _ in range(30):
        teach(model, [1], *chain_outcome(2))
    for _ in range(10):
        teach(model, [1], *chain_outcome(0))
    assert model.acceptance([NEW_REQUEST], [GREEDY])[0, 0, 0, 0] > 0.6
    assert model.acceptance([1], [GREEDY])[0, 0, 0, 0] < 0.6           # the request's own, shorter memory


def test_round_costs_are_kept_per_execution_path(trained_ckpt):
    """The cost model times the forwards the engine really runs: an eager and a compiled
    engine over the same model keep separate calibrations."""
    from branchspec.cache.paged import PagedState
    from branchspec.checkpoint import load_checkpoint
    from branchspec.execution.compiled import CompiledExecutor
    from branchspec.execution.eager import EagerExecutor
    from branchspec.speculative.profiling import calibration_key

    model = load_checkpoint(trained_ckpt, "float32", expert_dispatch="dense")
    cache = PagedState(model.cfg, max_seqs=1, max_len=256)
    tokens = grid_keys(SpecConfig.auto().candidates)
    eager, compiled = EagerExecutor(model, cache), CompiledExecutor(model, cache)   # compiles nothing yet
    assert calibration_key(eager, 4, tokens) != calibration_key(compiled, 4, tokens)
    assert calibration_key(eager, 4, tokens) == calibration_key(EagerExecutor(model, cache), 4, tokens)


def test_round_costs_are_kept_per_source(trained_ckpt, monkeypatch):
    """A calibration times this code's calls: other source (what compiled steps are keyed
    by too) gets a calibration of its own."""
    from branchspec import disk_cache
    from branchspec.cache.paged import PagedState
    from branchspec.checkpoint import load_checkpoint
    from branchspec.execution.eager import EagerExecutor
    from branchspec.speculative import profiling as costs

    model = load_checkpoint(trained_ckpt, "float32")
    executor = EagerExecutor(model, PagedState(model.cfg, max_seqs=1, max_len=256))
    tokens = grid_keys(SpecConfig.auto().candidates)
    here = costs.calibration_key(executor, 4, tokens)
    assert here == costs.calibration_key(executor, 4, tokens)
    monkeypatch.setattr(costs, "source_digest", lambda: "other" + disk_cache.source_digest())
    assert costs.calibration_key(executor, 4, tokens) != here
