"""Full forward == chunked prefill == token-by-token decode, logits and persistent state
(invariant S), on sequences crossing many C4 and two C128 boundaries (float64)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from branchspec.config import tiny_config
from branchspec.model.init import random_model
from branchspec.model.metadata import chain_meta
from helpers import assert_same_state, feed, new_cache, new_runner, sequential
from oracle import oracle_logits

T = 300  # C128 boundaries at 128 and 256, C4 boundaries every 4 tokens


def _ids(n, seed=1, vocab=64):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def full_logits(tiny64):
    with torch.no_grad():
        out, _ = tiny64.full_forward(torch.tensor([_ids(T)]))
    return out.logits[0]


def test_full_forward_matches_naive_oracle(tiny64):
    if tiny64.cfg.hc_mult or tiny64.cfg.num_experts or tiny64.cfg.o_groups:
        pytest.skip("the oracle covers the plain model; the real architecture is checked against transformers")
    ids = _ids(140, seed=5)
    with torch.no_grad():
        fast, _ = tiny64.full_forward(torch.tensor([ids]))
    torch.testing.assert_close(fast.logits[0], oracle_logits(tiny64, ids), atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk", [1, 3, 5, 64, T])
def test_chunked_prefill_matches_full_forward(tiny64, full_logits, chunk):
    _, logits = sequential(tiny64, _ids(T), chunk=chunk)
    torch.testing.assert_close(logits, full_logits, atol=1e-10, rtol=0)


@pytest.fixture(scope="module")
def token_by_token_state(tiny64):
    cache, _ = sequential(tiny64, _ids(T), chunk=1)
    return cache.snapshot(0, T)


@pytest.mark.parametrize("chunk", [3, 5, 64, T])
def test_state_after_chunked_prefill_equals_token_by_token(tiny64, token_by_token_state, chunk):
    cache, _ = sequential(tiny64, _ids(T), chunk=chunk)
    assert_same_state(cache.snapshot(0, T), token_by_token_state)


def test_state_parts_are_all_present(tiny64):
    cache, _ = sequential(tiny64, _ids(T), chunk=64)
    snap = cache.snapshot(0, T)
    # tiny config: layers (0, 4, 128, 4)
    assert {"raw/0", "raw/1", "buf4/1", "ent4/1", "ibuf/1", "ikey/1", "buf128/2", "ent128/2"} <= snap.keys()
    assert snap["ent4/1"].shape[0] == T // 4 and snap["ent128/2"].shape[0] == T // 128
    assert snap["raw/0"].shape[0] == tiny64.cfg.window - 1
    assert snap["buf128/2"].shape[0] == T % 128
    assert snap["buf4/1"].shape[0] == 4 + T % 4


def test_mixed_length_batch_decodes_like_each_alone(tiny64):
    lengths = [3, 130, 257, 64, 127]
    prompts = [_ids(n, seed=10 + i) for i, n in enumerate(lengths)]
    steps = 6
    cont = [_ids(steps, seed=50 + i) for i in range(len(lengths))]
    cache = new_cache(tiny64, max_seqs=len(lengths))
    for sid, p in enumerate(prompts):
        cache.add(sid)
        feed(tiny64, cache, sid, p, 0, chunk=64)
    batch_logits = []
    L = torch.tensor(lengths)
    with torch.no_grad():
        for step in range(steps):
            for sid in range(len(lengths)):
                cache.reserve(sid, int(L[sid]) + 1)
            meta = chain_meta(L, 1, tiny64.cfg.compressed_kinds)
            toks = torch.tensor([[c[step]] for c in cont])
            out = tiny64(toks, meta, cache.gather(list(range(len(lengths))), L))
            cache.commit(list(range(len(lengths))), meta, out.scratch, meta.valid)
            batch_logits.append(out.logits[:, 0])
            L = L + 1
    batch_logits = torch.stack(batch_logits, dim=1)               # [B, steps, V]
    for sid, (p, c) in enumerate(zip(prompts, cont)):
        alone_cache, alone = sequential(tiny64, p + c, chunk=1)
        torch.testing.assert_close(batch_logits[sid], alone[len(p):], atol=1e-10, rtol=0)
        assert_same_state(cache.snapshot(sid, len(p) + steps), alone_cache.snapshot(0, len(p) + steps))


def test_indexer_top_k_limits_attention():
    """With more C4 entries than top-k, the result must depend on top-k: a model that
    ignored it would match the unlimited variant and miss the oracle."""
    ids = _ids(140, seed=7)
    limited = random_model(tiny_config(index_topk=3), seed=3, dtype="float64", std=0.3)
    unlimited = random_model(tiny_config(index_topk=1000), seed=3, dtype="float64", std=0.3)
    with torch.no_grad():
        a, _ = limited.full_forward(torch.tensor([ids]))
        b, _ = unlimited.full_forward(torch.tensor([ids]))
    late = slice(4 * 4, None)  # positions with more than 3 visible entries
    assert (a.logits[0, late] - b.logits[0, late]).abs().max() > 1e-3
    torch.testing.assert_close(a.logits[0], oracle_logits(limited, ids), atol=1e-10, rtol=0)
    # Before the 4th entry exists, top-3 selects everything: both agree.
    torch.testing.assert_close(a.logits[0, :15], b.logits[0, :15], atol=1e-12, rtol=0)


def test_mtp_prefill_state_matches_token_by_token(tiny64):
    """The drafter's KV after a chunked MTP pass equals a token-by-token one."""
    ids = _ids(90, seed=2)
    with torch.no_grad():
        out, mtp_full = tiny64.full_forward(torch.tensor([ids]), with_mtp=True)
        prev = torch.cat([torch.zeros_like(out.hidden[:, :1]), out.hidden[:, :-1]], dim=1)
        caches = []
        for chunk in (1, 7):
            cache = new_cache(tiny64, max_seqs=1)
            cache.add(0)
            L, logits = 0, []
            while L < len(ids):
                n = min(chunk, len(ids) - L)
                meta = chain_meta(torch.tensor([L]), n, ())
                o = tiny64.mtp_forward(torch.tensor([ids[L:L + n]]), prev[:, L:L + n], meta,
                                       cache.gather_mtp([0], torch.tensor([L])))
                cache.commit_mtp([0], meta, o.scratch[0], meta.valid)
                logits.append(o.logits[0])
                L += n
            torch.testing.assert_close(torch.cat(logits), mtp_full.logits[0], atol=1e-10, rtol=0)
            caches.append(cache.snapshot(0, 0, mtp_length=len(ids))["mtp/0"])
    torch.testing.assert_close(caches[0], caches[1], atol=1e-10, rtol=0)


@pytest.mark.parametrize("call_tokens", [10**9, 0], ids=["one-padded-group", "a-group-each"])
def test_batched_prefill_state_equals_token_by_token(tiny64, call_tokens):
    """The runner prefills admitted requests together, padded to the longest chunk of
    their group (`prefill_groups`): all in one group, or each alone."""
    from branchspec.config import SamplingParams
    from branchspec.engine.request import Sequence

    lengths = [5, 131, 300]
    prompts = [_ids(n, seed=20 + i) for i, n in enumerate(lengths)]
    cache = new_cache(tiny64, max_seqs=len(lengths))
    seqs = [Sequence(seq_id=i, prompt_ids=p, params=SamplingParams()) for i, p in enumerate(prompts)]
    for s in seqs:
        cache.add(s.seq_id)
        cache.reserve(s.seq_id, len(s.prompt_ids))
    runner = new_runner(tiny64, cache)
    runner.prefill_call_tokens = call_tokens
    logits = runner.prefill(seqs, follow=True).last_logits
    for s, p, lg in zip(seqs, prompts, logits):
        ref_cache, ref_logits = sequential(tiny64, p, chunk=1)
        torch.testing.assert_close(lg, ref_logits[-1], atol=1e-10, rtol=0)
        assert_same_state(cache.snapshot(s.seq_id, len(p)), ref_cache.snapshot(0, len(p)))


def _partitions(items):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=6), st.sampled_from([0, 1, 16, 128, 10**6]))
def test_prefill_groups_pad_least(lengths, call_tokens):
    """Prefill groups cost their padded tokens plus `call_tokens` each: the split chosen
    costs no more than the best of every partition of the rows, covers each row with
    tokens to feed exactly once, and leaves out rows with none."""
    from branchspec.engine.runner import prefill_groups

    def cost(groups):
        return sum(len(g) * max(lengths[i] for i in g) + call_tokens for g in groups)

    groups = prefill_groups(lengths, call_tokens)
    rows = [i for i, n in enumerate(lengths) if n > 0]
    assert sorted(i for g in groups for i in g) == rows
    assert all(g for g in groups)
    assert cost(groups) == min(cost(p) for p in _partitions(rows))


def test_both_expert_dispatches_compute_the_same_model():
    """The grouped MoE dispatch (eager's) and the dense one (the compiled path's) are the
    same function of the same weights, at decode-sized and prefill-sized inputs."""
    from branchspec.config import tiny_v4_config

    cfg = tiny_v4_config()
    grouped = random_model(cfg, seed=3, dtype="float64", std=0.3)
    dense = random_model(cfg, seed=3, dtype="float64", std=0.3, expert_dispatch="dense")
    for T in (1, 2, 37):
        ids = torch.tensor([_ids(T, seed=T)])
        with torch.no_grad():
            a, b = grouped.full_forward(ids, with_mtp=True), dense.full_forward(ids, with_mtp=True)
        torch.testing.assert_close(a[0].logits, b[0].logits, atol=1e-10, rtol=0)
        torch.testing.assert_close(a[1].logits, b[1].logits, atol=1e-10, rtol=0)
