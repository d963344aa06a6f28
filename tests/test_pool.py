"""Page pools: a free list that never hands out a page twice, and paged state whose
allocations are atomic across kinds and all come back on free."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchspec.cache.paged import PagedState
from branchspec.cache.pool import BlockPool, OutOfPages
from branchspec.config import tiny_config

P = 4          # page size
MAX_LEN = 64
CFG = tiny_config()


# -- BlockPool -------------------------------------------------------------------------------


def test_allocate_and_free():
    pool = BlockPool(6, "t")
    a = pool.allocate(2)
    b = pool.allocate(3)
    assert len(a) == 2 and len(b) == 3
    assert len(set(a) | set(b)) == 5 and set(a) | set(b) <= set(range(6))
    assert pool.num_free == 1
    assert pool.allocate(0) == [] and pool.num_free == 1
    pool.free(a)
    assert pool.num_free == 3
    c = pool.allocate(3)
    assert not set(c) & set(b)          # never hands out a page still in use
    pool.free(b)
    pool.free(c)
    assert pool.num_free == 6
    assert sorted(pool.allocate(6)) == list(range(6))


def test_exhaustion_allocates_nothing():
    pool = BlockPool(5, "ent4")
    held = pool.allocate(3)
    with pytest.raises(OutOfPages, match="ent4") as info:
        pool.allocate(3)
    assert "need 3" in str(info.value)
    assert pool.num_free == 2
    assert sorted(pool.allocate(2) + held) == list(range(5))
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    assert pool.num_free == 0


def test_out_of_pages_is_recoverable_runtime_error():
    assert issubclass(OutOfPages, RuntimeError)


def test_double_free_raises():
    pool = BlockPool(4, "raw")
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free(pages[:1])
    assert pool.num_free == 3
    with pytest.raises(RuntimeError, match="raw"):
        pool.free([3])  # never allocated
    assert pool.num_free == 3


@pytest.mark.parametrize("n", [0, -1])
def test_pool_size_positive(n):
    with pytest.raises(ValueError, match="num_pages"):
        BlockPool(n)


# -- PagedState --------------------------------------------------------------------------------


def make_state(max_seqs=3, num_pages=None) -> PagedState:
    return PagedState(CFG, max_seqs=max_seqs, max_len=MAX_LEN, page_size=P, num_pages=num_pages)


def expected_pages(state: PagedState, kind: str, reserved: int) -> int:
    spec = state.specs[kind]
    if spec.ring is not None:
        return spec.ring // P
    return -(-(reserved // spec.ratio) // P)


def check_invariants(state: PagedState, initial: dict[str, int], reserved: dict[int, int]) -> None:
    """No page shared between live sequences, pages conserved, table sizes as reserved."""
    assert set(state.tables) == set(reserved)
    for kind, pool in state.pools.items():
        tables = {s: state.tables[s][kind] for s in state.tables}
        for s, pages in tables.items():
            assert len(pages) == len(set(pages)), (kind, s)
            assert all(0 <= p < pool.num_pages for p in pages), (kind, s)
            assert len(pages) == expected_pages(state, kind, reserved[s]), (kind, s, reserved[s])
        for (s1, t1), (s2, t2) in itertools.combinations(tables.items(), 2):
            assert not set(t1) & set(t2), f"{kind}: sequences {s1} and {s2} share pages {set(t1) & set(t2)}"
        used = sum(len(t) for t in tables.values())
        assert pool.num_free + used == initial[kind], kind


def test_kinds_of_tiny_config():
    state = make_state()
    assert set(state.specs) == {"raw", "buf4", "ent4", "buf128", "ent128", "ibuf", "ikey", "mtp"}
    for kind, spec in state.specs.items():
        # the pool's pages, then the sink page, which no sequence holds
        assert state.storage[kind].shape == (len(spec.layers), (state.pools[kind].num_pages + 1) * P, spec.width)
        assert state.sink_page[kind] == state.pools[kind].num_pages
        if spec.ring is not None:
            assert spec.ring % P == 0


def test_no_page_shared_and_all_back():
    state = make_state(max_seqs=3)
    initial = state.num_free_pages()
    reserved = {}
    for sid, length in [(10, 7), (11, 33), (12, MAX_LEN)]:
        state.add(sid)
        state.reserve(sid, length)
        reserved[sid] = length
        check_invariants(state, initial, reserved)
    # growing a sequence keeps its pages and adds new ones
    before = {k: list(v) for k, v in state.tables[10].items()}
    state.reserve(10, 40)
    reserved[10] = 40
    for k, pages in before.items():
        assert state.tables[10][k][: len(pages)] == pages
    # reserving less never shrinks
    state.reserve(11, 5)
    check_invariants(state, initial, reserved)
    assert any(state.num_free_pages()[k] < initial[k] for k in initial)
    for sid in list(reserved):
        state.free(sid)
        del reserved[sid]
        check_invariants(state, initial, reserved)
    assert state.num_free_pages() == initial
    assert state.tables == {}


def test_default_pool_fits_max_seqs_at_max_len():
    state = make_state(max_seqs=3)
    for sid in range(3):
        state.add(sid)
        state.reserve(sid, MAX_LEN)
    with pytest.raises(OutOfPages):
        state.add(99)
    assert 99 not in state.tables


def test_add_is_atomic():
    # room for two sequences' raw rings (2 pages each), plenty of everything else
    state = make_state(max_seqs=3, num_pages={"raw": 5})
    initial = state.num_free_pages()
    state.add(0)
    state.add(1)
    before = state.num_free_pages()
    with pytest.raises(OutOfPages, match="raw"):
        state.add(2)
    assert state.num_free_pages() == before
    assert 2 not in state.tables
    check_invariants(state, initial, {0: 0, 1: 0})


def test_reserve_is_atomic():
    state = make_state(max_seqs=2, num_pages={"ent4": 1})
    initial = state.num_free_pages()
    state.add(0)
    state.reserve(0, 16)                      # 4 entries: one ent4 page, one ikey page
    before = state.num_free_pages()
    tables_before = {k: list(v) for k, v in state.tables[0].items()}
    with pytest.raises(OutOfPages, match="ent4"):
        state.reserve(0, 40)                  # needs 3 ent4 pages; ikey alone would fit
    assert state.num_free_pages() == before
    assert state.num_free_pages()["ikey"] == initial["ikey"] - 1
    assert state.tables[0] == tables_before
    check_invariants(state, initial, {0: 16})
    state.free(0)
    assert state.num_free_pages() == initial


def test_add_twice_raises():
    state = make_state()
    state.add(5)
    before = state.num_free_pages()
    with pytest.raises(ValueError, match="5"):
        state.add(5)
    assert state.num_free_pages() == before


def test_reserve_beyond_max_len_raises():
    state = make_state()
    initial = state.num_free_pages()
    state.add(0)
    before = state.num_free_pages()
    with pytest.raises(ValueError, match="max_model_len"):
        state.reserve(0, MAX_LEN + 1)
    assert state.num_free_pages() == before
    state.reserve(0, MAX_LEN)  # exactly max_len is fine
    check_invariants(state, initial, {0: MAX_LEN})


def test_unknown_kind_in_num_pages():
    with pytest.raises(ValueError, match="ent64"):
        make_state(num_pages={"ent64": 3})


def test_zero_pages_for_a_kind_rejected():
    with pytest.raises(ValueError, match="ent4"):
        make_state(num_pages={"ent4": 0})


# -- property: random add / reserve / free -------------------------------------------------

ops = st.lists(
    st.tuples(st.sampled_from(["add", "add", "reserve", "reserve", "reserve", "free"]),
              st.integers(0, 3), st.integers(0, MAX_LEN + 4)),
    min_size=8, max_size=40)


@settings(max_examples=20, deadline=None)
@given(ops=ops, tight=st.booleans())
def test_random_operations_keep_invariants(ops, tight):
    # tight pools make both add (raw) and reserve (ent4, ikey) run out now and then
    num_pages = {"raw": 5, "ent4": 3, "ikey": 5} if tight else None
    state = make_state(max_seqs=3, num_pages=num_pages)
    initial = state.num_free_pages()
    reserved: dict[int, int] = {}
    for op, sid, length in ops:
        before = state.num_free_pages()
        if op == "add":
            if sid in reserved:
                with pytest.raises(ValueError):
                    state.add(sid)
            else:
                try:
                    state.add(sid)
                    reserved[sid] = 0
                except OutOfPages:
                    assert state.num_free_pages() == before
        elif op == "reserve" and sid in reserved:
            if length > MAX_LEN:
                with pytest.raises(ValueError):
                    state.reserve(sid, length)
            else:
                try:
                    state.reserve(sid, length)
                    reserved[sid] = max(reserved[sid], length)
                except OutOfPages:
                    assert state.num_free_pages() == before
        elif op == "free" and sid in reserved:
            state.free(sid)
            del reserved[sid]
        check_invariants(state, initial, reserved)
    for sid in list(reserved):
        state.free(sid)
    assert state.num_free_pages() == initial
