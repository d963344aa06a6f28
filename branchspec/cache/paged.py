"""Paged persistent state for every sequence: the target's layers and the drafter's KV.

Each *kind* of state lives in its own page pool, with its own storage tensor
`[num_layers_of_kind, num_pages * page_size, width]` and per-sequence block tables:

| kind     | layers    | slot addressed by              | width       |
|----------|-----------|--------------------------------|-------------|
| raw      | all       | position, ring of >= W-1       | d_h         |
| buf4     | ratio 4   | position, ring of >= 7         | 4 d_h (a|g) |
| buf128   | ratio 128 | position, ring of >= 127       | 2 d_h (a|g) |
| ent4     | ratio 4   | entry number (grows)           | d_h         |
| ent128   | ratio 128 | entry number (grows)           | d_h         |
| ibuf     | ratio 4   | position, ring of >= 7         | 4 d_I       |
| ikey     | ratio 4   | entry number (grows)           | d_I         |
| mtp      | drafter   | position, ring of >= W-1       | d_h         |

Ring kinds hold a fixed number of pages from admission; growing kinds take a page per
page_size entries as the sequence grows (`reserve`). Reads gather what a forward needs
into dense `LayerState`s; writes (`commit`) scatter the chosen nodes' scratch into the
slots of their positions. Visibility is by committed length, so a slot is only read once
the position it holds is committed.

Writes have static shapes: every node of a forward is written, and a node not kept (a
rejected branch, a padding node, a position already out of its ring) goes to the storage's
last row. That row lies in the *sink page*, one page past the pool's own, which no
sequence holds and nothing reads as committed state. So a commit has no data-dependent
sizes and runs inside a compiled step or a captured graph as well as eagerly
(`write_nodes`). A block table's unused entries point at the sink page too, and so do all
of a padding row's (a captured graph's batch padded up to its bucket): whatever such a row
reads is never used, and whatever it writes lands where no sequence reads.

How many committed entries a batch addresses (`Addressing`): as many as its longest
sequence has ("exact": eager steps, whose shapes may follow the data), a whole page more
at a time ("pages": compiled steps, one graph for every context), or every entry
`max_model_len` tokens can have, with block tables as wide as such a sequence needs
("bound": captured graphs, whose shapes may not follow the context at all).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from branchspec.cache.pool import BlockPool, OutOfPages
from branchspec.config import ModelConfig
from branchspec.model.attention import LayerScratch, LayerState
from branchspec.model.metadata import ForwardMeta


@dataclass
class StateAddresses:
    """Where a batch's committed target state lives in the pools: every slot to read, by
    kind, and the masks that go with them. Small index tensors, cheap to build; reading
    the storage at them (`read_states`) is the large part of a gather, and a compiled step
    does it inside its graph."""

    slots: dict[str, torch.Tensor]            # kind -> [B, X] flat slots (X: window rows, buffer rows, entries)
    raw_pos: torch.Tensor                     # [B, W-1] positions of the window rows
    raw_valid: torch.Tensor                   # [B, 1, W-1] which of them exist
    entries_valid: dict[int, torch.Tensor]    # ratio -> [B, E] which entries exist


@dataclass
class BlockTables:
    """A batch's padded block tables, by kind ({kind: [B, pages]}, at least two pages wide
    so that a compiled step never specialises a growing table's width to 1), and the page
    size they count in: what a commit addresses its slots with."""

    tables: dict[str, torch.Tensor]
    page_size: int


Addressing = Literal["exact", "pages", "bound"]   # see the module's docstring
ADDRESSING = ("exact", "pages", "bound")


@dataclass
class AddressInputs:
    """What a batch's state addresses follow from (`locate`): its block tables, its
    committed lengths, and how many entries of each compressed ratio to address, carried
    as the entry numbers themselves so that a compiled step computes the addresses in its
    graph (where they fuse into the reads) with the count as a size."""

    tables: BlockTables                 # every kind's block tables (also where a commit writes)
    lengths: torch.Tensor               # [B] committed L
    # ratio -> [E] entry numbers 0 .. E-1, the same for every request (E: see `PagedState.address_inputs`)
    entries: dict[int, torch.Tensor] = field(metadata={"batched": False})


def locate(cfg: ModelConfig, x: AddressInputs) -> StateAddresses:
    """Every slot of a batch's committed target state and the masks that go with them (see
    `StateAddresses`): the window and the compressors' buffers by position in their rings,
    the entries and index keys by entry number. A pure function of tensors, run eagerly
    (`PagedState.addresses`) and inside compiled steps alike."""
    page_size, tables = x.tables.page_size, x.tables.tables
    specs = {s.name: s for s in kind_specs(cfg, page_size)}
    lengths = x.lengths
    B = lengths.shape[0]
    raw_slots, raw_pos, raw_valid = ring_read(specs["raw"], page_size, tables["raw"], lengths, cfg.window - 1)
    slots, entries_valid = {"raw": raw_slots}, {}
    for c in cfg.compressed_kinds:
        r = c.ratio
        slots[f"buf{r}"] = ring_read(specs[f"buf{r}"], page_size, tables[f"buf{r}"], lengths, c.buffer_rows)[0]
        e = x.entries[r].expand(B, -1)                                  # [B, E] entry numbers
        slots[f"ent{r}"] = flat_slots(specs[f"ent{r}"], page_size, tables[f"ent{r}"], e)
        entries_valid[r] = e < (lengths // r)[:, None]
        if c.indexer:
            slots["ibuf"] = ring_read(specs["ibuf"], page_size, tables["ibuf"], lengths, c.buffer_rows)[0]
            slots["ikey"] = flat_slots(specs["ikey"], page_size, tables["ikey"], e)
    return StateAddresses(slots=slots, raw_pos=raw_pos, raw_valid=raw_valid, entries_valid=entries_valid)


def read_states(cfg: ModelConfig, storage: dict[str, torch.Tensor], addr: StateAddresses) -> list[LayerState]:
    """The dense committed state of every target layer, read from the pools' storage
    ({kind: [layers of kind, slots, width]}) at `addr`: one read per kind, for all its
    layers ([layers of kind, B, X, width]), split by layer."""
    read = {kind: storage[kind][:, slots] for kind, slots in addr.slots.items()}
    seen: dict[str, int] = {}

    def next_of(kind: str) -> torch.Tensor:    # layers of a kind are stored in model order
        i = seen[kind] = seen.get(kind, -1) + 1
        return read[kind][i]

    states = []
    for c in cfg.layer_compression:
        st = LayerState(raw_k=next_of("raw"), raw_valid=addr.raw_valid, raw_pos=addr.raw_pos)
        if c.ratio > 0:
            r = c.ratio
            st.buf, st.entries, st.entries_valid = next_of(f"buf{r}"), next_of(f"ent{r}"), addr.entries_valid[r]
            if c.indexer:
                st.index_buf, st.index_keys = next_of("ibuf"), next_of("ikey")
        states.append(st)
    return states


@dataclass(frozen=True)
class KindSpec:
    name: str
    layers: tuple[int, ...]     # model layer indices (the drafter counts as layer 0 of "mtp")
    width: int
    ring: int | None            # ring capacity in positions (a multiple of page_size); None: growing
    ratio: int = 1              # growing kinds: one slot per `ratio` tokens


def _round_up(x: int, m: int) -> int:
    return max(m, -(-x // m) * m)


def kind_specs(cfg: ModelConfig, page_size: int) -> list[KindSpec]:
    dh, dI = cfg.head_dim, cfg.index_head_dim
    layers_of = lambda r: tuple(i for i, x in enumerate(cfg.compress_ratios) if x == r)  # noqa: E731
    P = page_size
    specs = [KindSpec("raw", tuple(range(cfg.num_layers)), dh, _round_up(cfg.window - 1, P))]
    for c in cfg.compressed_kinds:
        r = c.ratio
        specs.append(KindSpec(f"buf{r}", layers_of(r), 2 * c.row_groups * dh, _round_up(c.buffer_rows, P)))
        specs.append(KindSpec(f"ent{r}", layers_of(r), dh, None, r))
        if c.indexer:   # the indexer's buffer and keys ("ibuf", "ikey"): one indexed kind per model
            specs.append(KindSpec("ibuf", layers_of(r), 2 * c.row_groups * dI, _round_up(c.buffer_rows, P)))
            specs.append(KindSpec("ikey", layers_of(r), dI, None, r))
    if cfg.num_mtp_layers:
        specs.append(KindSpec("mtp", (0,), dh, _round_up(cfg.window - 1, P)))
    return specs


def default_num_pages(spec: KindSpec, max_seqs: int, max_len: int, page_size: int) -> int:
    if spec.ring is not None:
        return max_seqs * spec.ring // page_size
    return max(1, max_seqs * (-(-(max_len // spec.ratio) // page_size)))


class PagedState:
    def __init__(self, cfg: ModelConfig, *, max_seqs: int, max_len: int, page_size: int = 16,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 num_pages: dict[str, int] | None = None):
        self.cfg, self.page_size, self.max_len, self.max_seqs = cfg, page_size, max_len, max_seqs
        self.dtype, self.device = dtype, torch.device(device)
        self.specs = {s.name: s for s in kind_specs(cfg, page_size)}
        num_pages = num_pages or {}
        unknown = set(num_pages) - set(self.specs)
        if unknown:
            raise ValueError(f"num_pages names unknown state kinds {sorted(unknown)}; kinds are {sorted(self.specs)}")
        self.pools: dict[str, BlockPool] = {}
        self.storage: dict[str, torch.Tensor] = {}
        self.sink_page: dict[str, int] = {}     # kind -> its sink page's number (its pool's page count)
        for name, spec in self.specs.items():
            n = num_pages.get(name, default_num_pages(spec, max_seqs, max_len, page_size))
            if n < 1:
                raise ValueError(f"num_pages[{name!r}] must be >= 1, got {n}")
            self.pools[name] = BlockPool(n, name)
            # n pages of page_size slots, then the sink page (see the module's docstring)
            self.storage[name] = torch.zeros(len(spec.layers), (n + 1) * page_size, spec.width,
                                             dtype=dtype, device=self.device)
            self.sink_page[name] = n
        # The most pages one sequence of max_len tokens holds, per kind: the width of a
        # block table under "bound" addressing (at least two, see BlockTables).
        self.max_pages = {n: max(2, k) for n, k in self.pages_needed(max_len).items()}
        self.tables: dict[int, dict[str, list[int]]] = {}
        # Padded block-table tensors per (kind, batch, bound), rebuilt only after an
        # allocation changed some table: most steps allocate nothing, and building them
        # from Python lists row by row was a large share of a batch-64 step.
        self._table_cache: dict[tuple[str, tuple[int, ...], bool], torch.Tensor] = {}
        self._entry_numbers: dict[tuple[int, int], torch.Tensor] = {}   # (ratio, count) -> [count] arange

    # -- allocation -----------------------------------------------------------------------
    def add(self, seq_id: int) -> None:
        """Admit a sequence: allocate its ring pages (atomic)."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} is already in the cache")
        need = {n: k for n, k in self.pages_needed(0).items() if self.specs[n].ring is not None}
        self._check_free(need)
        self._table_cache.clear()
        self.tables[seq_id] = {n: self.pools[n].allocate(need[n]) if n in need else []
                               for n in self.specs}

    def reserve(self, seq_id: int, length: int) -> None:
        """Make room for committing up to `length` tokens (atomic: all kinds or none)."""
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_model_len {self.max_len}")
        table = self.tables[seq_id]
        need = {n: k - len(table[n]) for n, k in self.pages_needed(length).items() if k > len(table[n])}
        self._check_free(need)
        if need:
            self._table_cache.clear()
        for n, k in need.items():
            table[n].extend(self.pools[n].allocate(k))

    def _check_free(self, need: dict[str, int]) -> None:
        short = {n: (k, self.pools[n].num_free) for n, k in need.items() if k > self.pools[n].num_free}
        if short:
            detail = ", ".join(f"{n}: need {k}, free {f}" for n, (k, f) in short.items())
            raise OutOfPages(f"not enough free pages ({detail})")

    def pages_needed(self, length: int) -> dict[str, int]:
        """Pages one sequence of `length` committed tokens holds, per kind."""
        return {n: (s.ring // self.page_size if s.ring is not None
                    else -(-(length // s.ratio) // self.page_size)) for n, s in self.specs.items()}

    def fits_alone(self, length: int) -> bool:
        """Could a sequence of this length be held if it were the only one?"""
        return all(k <= self.pools[n].num_pages for n, k in self.pages_needed(length).items())

    def free(self, seq_id: int) -> None:
        self._table_cache.clear()
        for n, pages in self.tables.pop(seq_id).items():
            self.pools[n].free(pages)

    def num_free_pages(self) -> dict[str, int]:
        return {n: p.num_free for n, p in self.pools.items()}

    # -- addressing -----------------------------------------------------------------------
    def _table(self, kind: str, seq_ids: list[int], bound: bool) -> torch.Tensor:
        """Block tables [B, pages] for one kind, padded with its sink page (memoised until
        the next allocation): as wide as the batch's longest (at least two pages), or with
        `bound` as wide as a sequence of max_len tokens needs."""
        key = (kind, tuple(seq_ids), bound)
        if (hit := self._table_cache.get(key)) is not None:
            return hit
        rows = [self.tables[s][kind] for s in seq_ids]
        width = self.max_pages[kind] if bound else max(2, max(len(r) for r in rows))     # see BlockTables
        t = torch.full((len(rows), width), self.sink_page[kind], dtype=torch.long)
        for i, r in enumerate(rows):
            t[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        self._table_cache[key] = table = t.to(self.device)
        return table

    def block_tables(self, seq_ids: list[int], kinds: tuple[str, ...] | None = None,
                     addressing: Addressing = "exact") -> BlockTables:
        """The batch's block tables of `kinds` (default: every kind), as wide as
        `addressing` asks (see the module's docstring)."""
        bound = addressing == "bound"
        return BlockTables({n: self._table(n, seq_ids, bound) for n in (kinds or self.specs)}, self.page_size)

    def padding_tables(self, tables: BlockTables) -> BlockTables:
        """Tables of the same shapes whose every entry is its kind's sink page: what a
        padding row of a captured graph addresses."""
        return BlockTables({n: torch.full_like(t, self.sink_page[n]) for n, t in tables.tables.items()},
                           tables.page_size)

    # -- gather ---------------------------------------------------------------------------
    def address_inputs(self, seq_ids: list[int], lengths: torch.Tensor, addressing: Addressing = "exact"
                       ) -> AddressInputs:
        """What `locate` computes a batch's addresses from. lengths: [B] committed L.

        `addressing` (see the module's docstring): "pages" addresses committed entries in
        whole pages (the padding masked by entries_valid), for compiled steps whose shapes
        must not change with every entry; "bound" every entry a sequence of max_len tokens
        can have, with block tables to match, for captured graphs (and no value read back
        from the device)."""
        if addressing not in ADDRESSING:
            raise ValueError(f"addressing must be one of {ADDRESSING}, got {addressing!r}")
        lengths = lengths.to(self.device)
        most = self.max_len if addressing == "bound" else int(lengths.max()) if len(seq_ids) else 0
        entries = {}
        for c in self.cfg.compressed_kinds:
            E = most // c.ratio
            if addressing != "exact":
                # Whole pages, at least one, and under an indexer at least its top-k: the
                # shape changes every page_size entries, and top-k never has fewer entries
                # than k to choose from (which the compiler would guard on).
                least = self.cfg.index_topk if c.indexer else 1
                E = -(-max(E, least) // self.page_size) * self.page_size
            # One tensor per (ratio, count), reused: never the same object for two ratios,
            # since a compiled step guards on which of its inputs alias each other.
            if (numbers := self._entry_numbers.get((c.ratio, E))) is None:
                numbers = self._entry_numbers[(c.ratio, E)] = torch.arange(E, device=self.device)
            entries[c.ratio] = numbers
        return AddressInputs(tables=self.block_tables(seq_ids, addressing=addressing), lengths=lengths,
                             entries=entries)

    def addresses(self, seq_ids: list[int], lengths: torch.Tensor, addressing: Addressing = "exact"
                  ) -> StateAddresses:
        """Where a batch's committed state lives (small index tensors; `locate`). lengths:
        [B] committed L; `addressing` as in `address_inputs`."""
        return locate(self.cfg, self.address_inputs(seq_ids, lengths, addressing))

    def gather(self, seq_ids: list[int], lengths: torch.Tensor) -> list[LayerState]:
        """Dense committed state of every target layer for a batch. lengths: [B] committed L."""
        return read_states(self.cfg, self.storage, self.addresses(seq_ids, lengths))

    def gather_mtp(self, seq_ids: list[int], lengths: torch.Tensor) -> LayerState:
        """Drafter KV for positions < lengths (its own committed length; `read_mtp`)."""
        return read_mtp(self.cfg, self.storage, self.block_tables(seq_ids, ("mtp",)), lengths.to(self.device))

    def snapshot(self, seq_id: int, length: int, mtp_length: int | None = None) -> dict[str, torch.Tensor]:
        """The logical persistent state of one sequence with committed length `length`, part
        by part (what invariant S compares): raw window keys, compressor buffers (C4: last
        complete block + partial block; C128: partial block), entries and index keys, and
        the drafter KV when `mtp_length` is given. Keys look like "raw/3", "ent4/1"."""
        L = torch.tensor([length], device=self.device)
        states = self.gather([seq_id], L)
        out = {}
        for l, (c, st) in enumerate(zip(self.cfg.layer_compression, states)):
            keep = st.raw_valid[0, 0]
            out[f"raw/{l}"] = st.raw_k[0, keep]
            if c.ratio > 0:
                r = c.ratio
                start = (length // r) * r - (r if c.overlap else 0)  # first logical buffer position
                S = st.buf.shape[1]
                first = max(start, 0) - (length - S)                 # row of `start` in the gathered window
                out[f"buf{r}/{l}"] = st.buf[0, first:]
                out[f"ent{r}/{l}"] = st.entries[0, st.entries_valid[0]]
                if c.indexer:
                    out[f"ibuf/{l}"] = st.index_buf[0, first:]
                    out[f"ikey/{l}"] = st.index_keys[0, st.entries_valid[0]]
        if mtp_length is not None:
            m = self.gather_mtp([seq_id], torch.tensor([mtp_length], device=self.device))
            out["mtp/0"] = m.raw_k[0, m.raw_valid[0, 0]]
        return out

    # -- commit ---------------------------------------------------------------------------
    def commit(self, seq_ids: list[int], meta: ForwardMeta, scratch: list[LayerScratch],
               keep: torch.Tensor) -> None:
        """Write the scratch of the nodes in `keep` [B, N] (a root-to-node path, or every node
        of a prefill chunk) into the persistent pools at their positions (`write_nodes`).

        `keep` must be a prefix-closed path starting at depth 0; the new committed length is
        L + keep.sum(1). Reserve pages first.
        """
        write_nodes(self.cfg, self.storage, self.block_tables(seq_ids), meta, scratch, keep)

    def commit_mtp(self, seq_ids: list[int], meta: ForwardMeta, scratch: LayerScratch,
                   keep: torch.Tensor) -> None:
        write_mtp(self.cfg, self.storage, self.block_tables(seq_ids, ("mtp",)), meta, scratch, keep)


# -- writes (static shapes: the same code eagerly and inside a compiled step) ---------------
def flat_slots(spec: KindSpec, page_size: int, table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """index: [B, X] position (ring kinds) or entry number (growing kinds), >= 0 -> flat
    slot [B, X] through the block table [B, pages]."""
    logical = index % spec.ring if spec.ring is not None else index
    page = torch.gather(table, 1, (logical // page_size).clamp(max=table.shape[1] - 1))
    return page * page_size + logical % page_size


def ring_read(spec: KindSpec, page_size: int, table: torch.Tensor, lengths: torch.Tensor, count: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Slots of positions L-count .. L-1 of a ring kind -> (slots [B, count], positions
    [B, count], valid [B, 1, count], the same for every query)."""
    pos = lengths[:, None] - count + torch.arange(count, device=lengths.device)
    valid = (pos >= 0)[:, None, :]                                      # [B, 1, count]
    return flat_slots(spec, page_size, table, pos.clamp(min=0)), pos, valid


def _sunk(store: torch.Tensor, written: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Flat slots [M] for the rows [B, X] of `slots`, those not `written` sent to the sink."""
    return torch.where(written, slots, store.shape[1] - 1).reshape(-1)


def _put(store: torch.Tensor, slots: torch.Tensor, values: list[torch.Tensor]) -> None:
    """values: one [B, X, width] per layer of the kind -> slots [B * X] of every layer."""
    v = torch.stack(values)                                           # [layers, B, X, width]
    store[:, slots] = v.reshape(v.shape[0], -1, v.shape[-1]).to(store.dtype)


def write_nodes(cfg: ModelConfig, storage: dict[str, torch.Tensor], tables: BlockTables, meta: ForwardMeta,
                scratch: list[LayerScratch], keep: torch.Tensor) -> None:
    """Write the kept nodes' scratch (keep: [B, N], a prefix-closed path or a chunk's valid
    nodes) into the target's pools: each node's rows at the slot of its position, in every
    ring that still holds that position once L + keep.sum(1) tokens are committed, and each
    kept completing node's entry at the slot of its entry number. Every other node and
    completion goes to the sink. One write per kind for all its layers."""
    page_size = tables.page_size
    specs = {s.name: s for s in kind_specs(cfg, page_size)}
    pos = meta.positions                                              # [B, N]
    new_len = meta.num_committed + keep.sum(1)                        # [B]

    def ring_slots(kind: str) -> torch.Tensor:                        # [B * N]
        spec = specs[kind]
        kept = keep & (pos >= new_len[:, None] - spec.ring)
        return _sunk(storage[kind], kept, flat_slots(spec, page_size, tables.tables[kind], pos))

    _put(storage["raw"], ring_slots("raw"), [s.k for s in scratch])
    for c in cfg.compressed_kinds:
        r = c.ratio
        of_r = [s for s, x in zip(scratch, cfg.layer_compression) if x == c]
        plan = meta.pools[r]
        kept = plan.complete_valid & torch.gather(keep, 1, plan.complete_idx)         # [B, K]
        entry = plan.entry_index.clamp(min=0)

        def entry_slots(kind: str) -> torch.Tensor:                   # [B * K]
            return _sunk(storage[kind], kept, flat_slots(specs[kind], page_size, tables.tables[kind], entry))

        _put(storage[f"buf{r}"], ring_slots(f"buf{r}"), [s.rows for s in of_r])
        _put(storage[f"ent{r}"], entry_slots(f"ent{r}"), [s.entries for s in of_r])
        if c.indexer:   # the indexer's own pools (their pages are not the compressor's)
            _put(storage["ibuf"], ring_slots("ibuf"), [s.index_rows for s in of_r])
            _put(storage["ikey"], entry_slots("ikey"), [s.index_keys for s in of_r])


def write_mtp(cfg: ModelConfig, storage: dict[str, torch.Tensor], tables: BlockTables, meta: ForwardMeta,
              scratch: LayerScratch, keep: torch.Tensor) -> None:
    """The drafter's keys of the kept nodes (keep: [B, N]) into its "mtp" ring, likewise
    (tables: at least the "mtp" kind's)."""
    spec = next(s for s in kind_specs(cfg, tables.page_size) if s.name == "mtp")
    pos = meta.positions
    kept = keep & (pos >= (meta.num_committed + keep.sum(1))[:, None] - spec.ring)
    slots = flat_slots(spec, tables.page_size, tables.tables["mtp"], pos)
    _put(storage["mtp"], _sunk(storage["mtp"], kept, slots), [scratch.k])


def read_mtp(cfg: ModelConfig, storage: dict[str, torch.Tensor], tables: BlockTables, lengths: torch.Tensor
             ) -> LayerState:
    """The drafter's committed keys for positions < lengths [B] (the last window - 1 of them,
    from its "mtp" ring; tables: at least the "mtp" kind's), with their positions and which
    exist: the same code eagerly and inside a compiled step (a tree's growth, a draft
    extend), where the read fuses into the attention that uses it."""
    spec = next(s for s in kind_specs(cfg, tables.page_size) if s.name == "mtp")
    slots, pos, valid = ring_read(spec, tables.page_size, tables.tables["mtp"], lengths, cfg.window - 1)
    return LayerState(raw_k=storage["mtp"][0][slots], raw_valid=valid, raw_pos=pos)
