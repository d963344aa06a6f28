"""The seeded draw: Philox4x32-10 against Random123's known answers, uniforms that depend
on (seed, position) alone, and a token drawn at a position that does not depend on the
batch or on the other nodes drawn beside it."""

import numpy as np
import torch

from branchspec.sampling import (SamplingBatch, draw_tokens, inverse_cdf, node_draws, philox4x32, seeded_uniforms,
                                 step_tokens, target_tokens)

# Random123's kat_vectors: counter (4 words), key (2 words) -> output (4 words).
KNOWN_ANSWERS = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def test_philox_known_answers():
    for counter, key, expected in KNOWN_ANSWERS:
        words = philox4x32(tuple(np.array([c], dtype=np.uint64) for c in counter),
                           tuple(np.array([k], dtype=np.uint64) for k in key))
        assert [int(w[0]) for w in words] == expected


def test_uniforms_are_a_function_of_seed_and_position():
    seeds = [0, 7, 2**64 - 1]
    positions = np.array([[0, 1, 2, 3], [5, 5, 9, 2**40], [3, 2, 1, 0]])
    u = seeded_uniforms(seeds, positions)
    assert u.shape == (3, 4) and ((0 <= u) & (u < 1)).all()
    for b, seed in enumerate(seeds):           # one at a time, in another layout: the same
        for n in range(4):
            assert seeded_uniforms([seed], positions[b:b + 1, n:n + 1])[0, 0] == u[b, n]
    assert u[1, 0] == u[1, 1]                  # same seed and position
    assert len(set(u.flatten().tolist())) == 11
    many = seeded_uniforms([3], np.arange(200_000)[None])[0]
    assert abs(many.mean() - 0.5) < 0.005 and abs(many.var() - 1 / 12) < 0.002
    counts = np.histogram(many, bins=20, range=(0, 1))[0]
    assert counts.min() > 9500 and counts.max() < 10500


def test_a_draw_depends_on_its_own_position_only():
    """Rows of a batch and nodes of a tree at the same position draw the same token from
    the same distribution; nothing else in the call changes it."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 1, 50, generator=g, dtype=torch.float64)
    one = SamplingBatch(torch.tensor([1.0], dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64), [99],
                        [None])
    alone = target_tokens(logits, one, torch.tensor([[17]]))[0, 0]
    others = torch.randn(3, 6, 50, generator=g, dtype=torch.float64)
    others[1, 4] = logits[0, 0]
    batch = SamplingBatch(torch.tensor([0.8, 1.0, 0.0], dtype=torch.float64),
                          torch.tensor([0.9, 1.0, 1.0], dtype=torch.float64), [5, 99, 99], [None] * 3)
    positions = torch.tensor([[17] * 6, [11, 12, 13, 14, 17, 16], [17] * 6])
    drawn = target_tokens(others, batch, positions)
    assert drawn[1, 4] == alone
    assert (drawn[2] == others[2].argmax(-1)).all()       # greedy rows take the argmax
    # over many positions the draws follow the distribution
    probs = torch.softmax(logits[0, 0], -1)
    many = target_tokens(logits.expand(1, 20_000, 50), one, torch.arange(20_000)[None])[0]
    freq = torch.bincount(many, minlength=50).double() / 20_000
    assert (freq - probs).abs().max() < 0.015


def test_the_verify_calls_draws_are_target_tokens_draws():
    """A verify pass draws the tokens of rows sampled at their temperature alone inside its
    own call (`node_draws`, `draw_tokens`), from uniforms indexed by each node's depth: the
    same tokens `target_tokens` draws for those rows after the call, whatever the tree's
    shape (and a plain step's, `step_tokens`, at its one node); rows with a cut (top-p,
    top-k, min-p) or rules are left to `target_tokens`, and
    greedy rows keep the argmax. Negative control: a node read at its parent's depth draws
    other tokens."""
    g = torch.Generator().manual_seed(1)
    B, N, V = 5, 7, 40
    logits = torch.randn(B, N, V, generator=g, dtype=torch.float64) * 2
    temperature = torch.tensor([0.7, 0.0, 1.3, 1.0, 0.5], dtype=torch.float64)
    top_p = torch.tensor([1.0, 0.5, 1.0, 0.9, 1.0], dtype=torch.float64)
    top_k = torch.tensor([0, 0, 0, 0, 3])
    batch = SamplingBatch(temperature, top_p, [3, 4, 5, 6, 2**64 - 1], [None] * B, top_k=top_k)
    assert batch.untouched().tolist() == [True, True, True, False, False]
    lengths = torch.tensor([9, 0, 130, 4, 17])
    depth = torch.tensor([[0, 1, 1, 2, 3, 2, 4]] * B)              # a tree's nodes, root first
    draws = node_draws(batch, batch.untouched(), lengths, N, logits.device)
    assert draws.rows.tolist() == [True, False, True, False, False]
    argmax = logits.argmax(-1)
    in_call = draw_tokens(logits, draws, depth, argmax)
    after = target_tokens(logits, batch, lengths[:, None] + depth + 1)
    for b in (0, 1, 2):
        assert in_call[b].tolist() == after[b].tolist()
    assert (in_call[3:] == argmax[3:]).all()                         # not drawn in the call
    assert (draw_tokens(logits, draws, (depth - 1).clamp(min=0), argmax) != after).any(), \
        "a node drawn at another position's uniform went unnoticed"
    # A plain step's draw in its call (one node per row, at position L + 1) likewise.
    one = node_draws(batch, batch.untouched(), lengths, 1, logits.device)
    step = step_tokens(logits[:, :1], one)
    assert step[:3].tolist() == target_tokens(logits[:3, :1], batch.rows([0, 1, 2]), lengths[:3, None] + 1).tolist()
    assert node_draws(SamplingBatch(torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64),
                                    [1, 2], [None] * 2), torch.ones(2, dtype=torch.bool), lengths[:2], N,
                      logits.device) is None                        # nothing to draw: the greedy graph


def test_inverse_cdf_is_the_sorted_search():
    """The count of cumulative masses at or below u is the search's first index above it,
    ties and zero-probability tokens included (never drawn)."""
    g = torch.Generator().manual_seed(2)
    probs = torch.rand(64, 30, generator=g, dtype=torch.float64)
    probs[probs < 0.3] = 0.0
    probs[:, -1] = 0.0
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[0] = 0.0
    cdf = probs.cumsum(-1)
    searched = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=29)
    drawn = inverse_cdf(probs, u)
    assert drawn.tolist() == searched.tolist()
    assert (probs.gather(1, drawn[:, None]) > 0).all()
