"""Tree verification with temporary state isolation (float64).

For random trees and committed lengths that put C4 and C128 boundaries at every depth:
every node's verify logits equal a token-by-token decode of its root-to-node path, and
committing any root-to-node path leaves exactly the sequential state (invariant S).
A negative control shows the state comparison catches an unisolated variant.
"""

import copy

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from branchspec.model.metadata import ancestor_matrix, tree_meta
from helpers import assert_same_state, feed, new_cache, state_diff

PREFIX = torch.randint(0, 64, (300,), generator=torch.Generator().manual_seed(11)).tolist()
# Committed lengths around C128 boundaries (128, 256) and at every C4 phase near the start.
LENGTHS = list(range(0, 9)) + list(range(119, 132)) + list(range(250, 258))


@st.composite
def trees(draw, max_nodes=12, max_depth=8, max_width=4):
    """parents[j] < j, depth <= max_depth, at most max_width children per node."""
    n = draw(st.integers(1, max_nodes))
    parents, depth, kids = [-1], [0], [0]
    for j in range(1, n):
        options = [i for i in range(j) if depth[i] < max_depth and kids[i] < max_width]
        p = draw(st.sampled_from(options))
        parents.append(p)
        depth.append(depth[p] + 1)
        kids[p] += 1
        kids.append(0)
    tokens = draw(st.lists(st.integers(0, 63), min_size=n, max_size=n))
    return parents, tokens


def _prefilled(model, L):
    cache = new_cache(model, max_seqs=1)
    cache.add(0)
    feed(model, cache, 0, PREFIX[:L], 0, chunk=128)
    return cache


def _verify(model, cache, L, parents, tokens):
    meta = tree_meta(torch.tensor([parents]), torch.tensor([L]), model.cfg.compressed_kinds)
    cache.reserve(0, L + len(parents))
    with torch.no_grad():
        out = model(torch.tensor([tokens]), meta, cache.gather([0], torch.tensor([L])))
    return meta, out


def _path(parents, node):
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_ancestor_matrix_small_tree():
    anc = ancestor_matrix(torch.tensor([[-1, 0, 0, 1, 3, 2]]))[0]
    expected = {0: {0}, 1: {0, 1}, 2: {0, 2}, 3: {0, 1, 3}, 4: {0, 1, 3, 4}, 5: {0, 2, 5}}
    for n, ancestors in expected.items():
        assert set(anc[n].nonzero().flatten().tolist()) == ancestors


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees(), L=st.sampled_from(LENGTHS), data=st.data())
def test_tree_verify_equals_sequential_and_commit_preserves_state(tiny64, tree, L, data):
    parents, tokens = tree
    base = _prefilled(tiny64, L)
    cache = copy.deepcopy(base)
    meta, out = _verify(tiny64, cache, L, parents, tokens)
    refs = {}
    for node in range(len(parents)):
        path = _path(parents, node)
        ref = copy.deepcopy(base)
        logits = feed(tiny64, ref, 0, [tokens[i] for i in path], L, chunk=1)   # token by token
        torch.testing.assert_close(out.logits[0, node], logits[-1], atol=1e-10, rtol=0,
                                   msg=lambda m: f"node {node} (path {path}, L={L}): {m}")
        refs[node] = (ref, len(path))
    # Commit one root-to-node path, as acceptance would, and compare the whole state.
    node = data.draw(st.integers(0, len(parents) - 1), label="accepted node")
    keep = torch.zeros(1, len(parents), dtype=torch.bool)
    keep[0, _path(parents, node)] = True
    cache.commit([0], meta, out.scratch, keep)
    ref, n = refs[node]
    assert_same_state(cache.snapshot(0, L + n), ref.snapshot(0, L + n))


def _unisolated_scratch(meta, scratch):
    """Negative control: branches share position-keyed scratch, as with a plain tree mask.

    Each compressed-entry slot is keyed by the entry's position only, so sibling branches
    that complete the same block overwrite each other: the last writer wins and commit
    reads whatever is there."""
    bad = []
    for s in scratch:
        s = copy.copy(s)
        if s.entries is not None:
            for r, p in meta.pools.items():
                if s.entries.shape[1] != p.complete_idx.shape[1]:
                    continue
                entries = s.entries.clone()
                index_keys = s.index_keys.clone() if s.index_keys is not None else None
                pos = meta.positions.gather(1, p.complete_idx)[0]        # [K]
                for k in range(len(pos)):
                    last = int((pos == pos[k]).nonzero().max())
                    entries[0, k] = s.entries[0, last]
                    if index_keys is not None:
                        index_keys[0, k] = s.index_keys[0, last]
                s.entries, s.index_keys = entries, index_keys
                break
        bad.append(s)
    return bad


def test_negative_control_unisolated_state_fails(tiny64):
    """Siblings at depth 1 both complete a C4 block (L = 2 mod 4 puts their position at
    3 mod 4). Committing the first sibling from shared position-keyed scratch stores the
    second sibling's C4 entry: the state test must fail, on the compressed parts only,
    while the isolated commit passes."""
    L = 130
    parents, tokens = [-1, 0, 0, 2], [5, 17, 42, 9]
    assert (L + 1 + 1) % 4 == 0
    base = _prefilled(tiny64, L)
    ref = copy.deepcopy(base)
    feed(tiny64, ref, 0, [tokens[0], tokens[1]], L, chunk=1)
    expected = ref.snapshot(0, L + 2)

    keep = torch.tensor([[True, True, False, False]])
    isolated = copy.deepcopy(base)
    meta, out = _verify(tiny64, isolated, L, parents, tokens)
    isolated.commit([0], meta, out.scratch, keep)
    assert_same_state(isolated.snapshot(0, L + 2), expected)

    shared = copy.deepcopy(base)
    meta, out = _verify(tiny64, shared, L, parents, tokens)
    shared.commit([0], meta, _unisolated_scratch(meta, out.scratch), keep)
    diff = state_diff(shared.snapshot(0, L + 2), expected)
    broken = {k for k, v in diff.items() if v > 1e-6}
    assert broken, "the state comparison failed to notice a rejected branch's entry"
    assert broken <= {k for k in diff if k.startswith(("ent4", "ikey"))}, broken
    try:
        assert_same_state(shared.snapshot(0, L + 2), expected)
    except AssertionError as e:
        assert "ent4" in str(e) or "ikey" in str(e)
    else:
        raise AssertionError("assert_same_state accepted an unisolated state")


def _walk(tokens: list[int], parents: list[int], target: list[int], cap: int) -> tuple[list[int], int]:
    """The accepted path and bonus token by walking the tree one node at a time: from the
    root, descend into the child carrying the target's token while one does."""
    path = [0]
    while len(path) < cap:
        child = [j for j, p in enumerate(parents) if p == path[-1] and tokens[j] == target[path[-1]]]
        if not child:
            break
        path.append(child[0])
    return path, target[path[-1]]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_accept_finds_the_path_a_walk_finds(data):
    """`accept` (tensor ops over the whole tree at once) keeps exactly the path, bonus token
    and keep mask that walking the tree along the target's tokens gives, under a cap on
    path nodes too; a batch's rows do not interact."""
    from branchspec.speculative.accept import accept

    rows = []
    for _ in range(data.draw(st.integers(1, 3))):
        parents, _ = data.draw(trees(max_nodes=8))
        n = len(parents)
        # Siblings carry distinct tokens (a drafter's top-k), drawn from few values so that
        # the target often agrees; the target's token at each node likewise.
        tokens = [0] * n
        for j in range(1, n):
            used = {tokens[i] for i in range(1, j) if parents[i] == parents[j]}
            tokens[j] = data.draw(st.sampled_from([t for t in range(6) if t not in used]))
        target = data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
        rows.append((parents, tokens, target, data.draw(st.integers(1, n + 1))))
    D = max(len(r[0]) for r in rows)
    # Pad every tree to D nodes with a chain of nodes that never match (token -1).
    pad = lambda r: (r[0] + list(range(len(r[0]) - 1, D - 1)), r[1] + [-1] * (D - len(r[1])),  # noqa: E731
                     r[2] + [0] * (D - len(r[2])))
    padded = [pad(r) for r in rows]
    parents = torch.tensor([p for p, _, _ in padded])
    tokens, target = torch.tensor([t for _, t, _ in padded]), torch.tensor([g for _, _, g in padded])
    acc = accept(tokens, parents, ancestor_matrix(parents), target, torch.tensor([r[3] for r in rows]))
    for b, (p, t, g, cap) in enumerate(rows):
        path, bonus = _walk(t, p, g, cap)
        assert acc.path_len[b] == len(path)
        assert acc.path[b, :len(path)].tolist() == path
        assert acc.bonus[b] == bonus
        assert acc.keep[b].nonzero()[:, 0].tolist() == sorted(path)


def _greedy_chain(model, cache, seq_id, L, root, n):
    """The model's own greedy continuation of `root` after L committed tokens, n tokens
    (root first), on a copy of `cache`: a chain every node of which the argmax accepts."""
    probe = copy.deepcopy(cache)
    chain = [root]
    for i in range(n - 1):
        logits = feed(model, probe, seq_id, [chain[-1]], L + i, chunk=1)
        chain.append(int(logits[-1].argmax()))
    return chain


def _storage_diff(a, b) -> float:
    """Largest difference between two paged states' pools, their sinks (the last slot of
    every kind, where unkept writes go) left out."""
    return max((a.storage[k][:, :-1] - b.storage[k][:, :-1]).abs().max().item() for k in a.storage)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(L=st.sampled_from([2, 5, 126, 129]), data=st.data())
def test_verify_commits_the_greedy_rows_argmax_path_and_nothing_else(tiny64, L, data):
    """`verify_pass` accepts every row by its argmax and commits the rows marked
    greedy: such a row's state is then exactly the sequential state of its accepted path
    (invariant S), and the pools hold nothing else (as if only that path had been
    committed by `PagedState.commit`). Both rows' trees are a greedy chain with a sibling
    off its root, so the argmax accepts the whole chain. Negative controls: with neither
    row marked the state comparison fails, and with both marked the pools differ."""
    from branchspec.execution.eager import EagerExecutor
    from branchspec.speculative.verify import verify_pass

    D = 5
    base = new_cache(tiny64, max_seqs=2)
    for sid in (0, 1):
        base.add(sid)
        feed(tiny64, base, sid, PREFIX[sid * 7:sid * 7 + L], 0, chunk=128)
        base.reserve(sid, L + D)
    rows = []
    for sid in (0, 1):
        root = data.draw(st.integers(3, 63), label=f"root {sid}")
        chain = _greedy_chain(tiny64, base, sid, L, root, D - 1)
        rows.append(chain + [(chain[1] + 1) % 64])                    # a sibling of node 1
    parents = torch.tensor([[-1, 0, 1, 2, 0]] * 2)
    tokens = torch.tensor(rows)
    lengths = torch.tensor([L, L])

    def verified(marked):
        cache = copy.deepcopy(base)
        with torch.no_grad():
            v = verify_pass(EagerExecutor(tiny64, cache), tokens, parents, [0, 1], lengths,
                             torch.tensor(marked), torch.tensor([D, D]))
        return cache, v

    cache, v = verified([True, False])
    assert v.acceptance.path_len.tolist() == [D - 1, D - 1]                # the whole chain, not the sibling
    ref = copy.deepcopy(base)
    feed(tiny64, ref, 0, rows[0][:D - 1], L, chunk=1)
    assert_same_state(cache.snapshot(0, L + D - 1), ref.snapshot(0, L + D - 1))
    only_row0, v0 = verified([False, False])
    assert max(state_diff(only_row0.snapshot(0, L + D - 1), ref.snapshot(0, L + D - 1)).values()) > 1e-6, \
        "an uncommitted path went unnoticed"                           # negative control
    only_row0.commit([0, 1], v0.meta, v0.out.scratch, v0.acceptance.keep & torch.tensor([[True], [False]]))
    assert _storage_diff(cache, only_row0) == 0.0
    both, _ = verified([True, True])
    assert _storage_diff(both, only_row0) > 1e-6, "committing the unmarked row went unnoticed"
