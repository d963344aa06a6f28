"""The MTP drafter: it grows each round's draft tree, and follows the committed text.

**Growth** (EAGLE-2, with SGLang's three knobs). Step 1 runs the MTP block on the root (the
last emitted token, with the target's hidden state before it) and takes its top-k
children. Every later step runs the block on the current frontier, chained on each node's
parent's MTP hidden state, scores the top-k children of every frontier node by cumulative
draft log-probability, and keeps the best `topk` of them as the next frontier. At the end
the best D-1 candidates are kept (`tree.select_tree`). Since a child's score never
exceeds its parent's and a stable sort keeps earlier-created nodes first among ties, the
kept set is closed under ancestors; ordering it by creation puts parents before children.
The calibrated selection ranks frontier and kept nodes by measured acceptance instead
(`calibration.py`), which never exceeds the parent's either.

The drafter's attention is tree-masked: a frontier node sees the committed drafter KV plus
the MTP keys of its own ancestors (root slot included), never a sibling's. Everything after
the root's output is one function of tensors (`growth.grow_trees`), which the executor runs
as it is or, on the fast path, as one compiled graph per configuration.

**Following.** The drafter's KV must hold every committed position, fed with the target's
hidden states (not its own). Three ways in, all here: `follow` (the prompt's prefill, and
plain decode steps: at once, or deferred as *lag* when speculation may never come),
`catch_up` (the lag, fed before a speculative round), and `extend` (after a round: the
accepted path, and one node further the next root, whose output the next round starts
from, so growth needs one forward fewer, as SGLang fuses them). Its per-request state is
`DrafterState`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from branchspec.cache.paged import BlockTables, PagedState, read_mtp, write_mtp
from branchspec.config import SpecConfig
from branchspec.model.metadata import chain_meta
from branchspec.model.model import Transformer
from branchspec.speculative.calibration import GREEDY, SAMPLED, AcceptanceModel
from branchspec.speculative.draft_vocab import DraftVocab
from branchspec.speculative.selection import selection_of
from branchspec.speculative.growth import GrowthInputs, GrowthPlan, grow_trees
from branchspec.speculative.tree import DraftTree


@dataclass
class DraftRoot:
    """The drafter's output at a round's root, computed ahead by the previous round's
    draft extend (the new root is the bonus token, after the last accepted node's target
    hidden state)."""

    k: torch.Tensor        # [B, 1, d_h] the root's MTP key (at position L, not committed)
    hidden: torch.Tensor   # [B, 1, n*d] its MTP hidden state
    logits: torch.Tensor   # [B, N] over the drafted vocabulary (N = V without a reduced one)

    def row(self, b: int) -> "DraftRoot":
        return DraftRoot(self.k[b:b + 1], self.hidden[b:b + 1], self.logits[b:b + 1])

    @staticmethod
    def stack(rows: list["DraftRoot"]) -> "DraftRoot":
        return DraftRoot(torch.cat([r.k for r in rows]), torch.cat([r.hidden for r in rows]),
                         torch.cat([r.logits for r in rows]))


class DrafterLag:
    """Committed positions the drafter has not followed, kept as the target step that
    committed them left them: chunks of (tokens [B, N], hidden states [B, N, d], row, count),
    sliced only when a catch-up feeds them (a plain decode step adds one reference per
    request, no tensor work), and the hidden state before the first of them. len() is the
    number of positions, kept as a count so that reading it each round costs nothing
    however many chunks plain rounds added."""

    def __init__(self) -> None:
        self.chunks: list[tuple[torch.Tensor, torch.Tensor, int, int]] = []
        self.before: torch.Tensor | None = None   # [d] the target's hidden state before the lag
        self.length = 0

    def append(self, tokens: torch.Tensor, hidden: torch.Tensor, row: int, count: int) -> None:
        self.chunks.append((tokens, hidden, row, count))
        self.length += count

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The lag's tokens [n] and, for each, the target's hidden state one position
        earlier [n, d] (what the drafter's position there starts from)."""
        tokens = torch.cat([t[row, :n] for t, _, row, n in self.chunks])
        hidden = torch.cat([h[row, :n] for _, h, row, n in self.chunks])
        before = self.before if self.before is not None else torch.zeros_like(hidden[0])
        return tokens, torch.cat([before[None], hidden[:-1]])

    def clear(self) -> None:
        self.chunks.clear()
        self.before = None
        self.length = 0

    def __len__(self) -> int:
        return self.length


class DrafterState:
    """What the drafter keeps for one request between rounds."""

    def __init__(self, last_hidden: torch.Tensor | None = None):
        # [n*d] the target's hidden state at the last committed position (L - 1): the
        # residual the drafter's next position (the root, at L) starts from; or where the
        # step that committed it left it, (hidden [B, N, d], row, column), sliced on first read
        self._last: torch.Tensor | tuple[torch.Tensor, int, int] | None = last_hidden
        self.lag = DrafterLag()
        # The output at the next root, with the committed length it belongs to, as (length,
        # the batch's extend outputs, this request's row); a round that finds it current
        # skips the root's own forward.
        self.root: tuple[int, "ExtendOutputs", int] | None = None

    @property
    def last_hidden(self) -> torch.Tensor | None:
        if isinstance(self._last, tuple):
            hidden, row, column = self._last
            self._last = hidden[row, column]
        return self._last

    @last_hidden.setter
    def last_hidden(self, value: torch.Tensor | None) -> None:
        self._last = value

    def last_at(self, hidden: torch.Tensor, row: int, column: int) -> None:
        """The last committed position's hidden state is hidden[row, column] (not sliced yet)."""
        self._last = (hidden, row, column)


class Drafter(Protocol):
    """Proposes draft trees, and follows what the target commits (see `MTPDrafter`)."""

    def follow(self, seq_ids: list[int], lengths: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
               counts: list[int], now: bool) -> None: ...

    def catch_up(self, seq_ids: list[int], lengths: torch.Tensor) -> None: ...

    def propose(self, seq_ids: list[int], lengths: torch.Tensor, roots: torch.Tensor, spec: SpecConfig,
                temperature: list[float] | None = None) -> DraftTree: ...

    def learn(self, seq_ids: list[int], temperature: list[float], children: torch.Tensor,
              children_logp: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor, bonus: torch.Tensor,
              path_tokens: torch.Tensor) -> None: ...

    def extend(self, seq_ids: list[int], lengths: torch.Tensor, path_tokens: torch.Tensor, hidden: torch.Tensor,
               path: torch.Tensor, path_len: torch.Tensor, bonus: torch.Tensor, num_draft_tokens: int) -> None: ...

    def lag(self, seq_id: int) -> int: ...

    def forget(self, seq_id: int) -> None: ...


class MTPDrafter:
    """Grows draft trees with the model's own MTP block, whose KV lives in the paged
    state's "mtp" pool. Round forwards go through the executor (compiled or not); chunks
    of committed positions (prefill, catch-up) run eagerly, as the target's prefill does."""

    def __init__(self, model: Transformer, cache: PagedState, executor, chunk_size: int = 256,
                 vocab: DraftVocab | None = None):
        """vocab: draft only these tokens (`draft_vocab.DraftVocab`); None: the whole vocabulary."""
        if not model.mtp:
            raise ValueError("the checkpoint has no MTP block (num_mtp_layers = 0); it cannot draft")
        self.model, self.cache, self.executor = model, cache, executor
        self.chunk = chunk_size
        self.states: dict[int, DrafterState] = {}
        w = model.head.weight
        # The drafted tokens [N] and their LM-head rows [N, d] (a copy: the drafter reads
        # N rows, not the whole head); None: every token.
        self.vocab = vocab
        self.vocab_ids = vocab.token_ids.to(w.device) if vocab is not None else None
        self.head_rows = w.detach()[self.vocab_ids].contiguous() if vocab is not None else None
        self.vocab_size = vocab.size if vocab is not None else model.cfg.vocab_size
        # The calibrated selection's measured acceptance (per request and engine-wide).
        self.calibration = AcceptanceModel()

    def check(self, spec: SpecConfig) -> None:
        """Each step takes topk distinct tokens of the drafted vocabulary."""
        if spec.topk > self.vocab_size:
            raise ValueError(f"SpecConfig.topk={spec.topk} exceeds the drafter's vocabulary of {self.vocab_size} "
                             f"tokens; use topk <= {self.vocab_size}")

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter logits [..., N] over the drafted vocabulary at hidden states [..., n*d]."""
        return self.model.mtp_logits(hidden, self.head_rows)

    def state(self, seq_id: int) -> DrafterState:
        if seq_id not in self.states:
            self.states[seq_id] = DrafterState()
        return self.states[seq_id]

    def lag(self, seq_id: int) -> int:
        st = self.states.get(seq_id)
        return len(st.lag) if st is not None else 0

    def forget(self, seq_id: int) -> None:
        """The request finished, or its cached state was dropped (preemption)."""
        self.states.pop(seq_id, None)
        self.calibration.forget(seq_id)

    # -- following the committed text ---------------------------------------------------
    @torch.no_grad()
    def follow(self, seq_ids: list[int], lengths: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
               counts: list[int], now: bool) -> None:
        """The target just committed tokens [B, N] (counts[b] of row b valid) at positions
        lengths[b] ..., with its hidden states there [B, N, d]. Feed them to the drafter
        `now` (one batched forward, the drafter's pages reserved like the target's), or
        keep them as lag for the next speculative round."""
        states = [self.state(s) for s in seq_ids]
        if not now:      # references only: a plain decode step stays as cheap as it can be
            for j, (st, n) in enumerate(zip(states, counts)):
                if not st.lag:
                    st.lag.before = st.last_hidden
                st.lag.append(tokens, hidden, j, n)
                st.last_at(hidden, j, n - 1)
            return
        first = torch.stack([st.last_hidden if st.last_hidden is not None else torch.zeros_like(hidden[0, 0])
                             for st in states])
        prev = torch.cat([first[:, None], hidden[:, :-1]], dim=1)            # [B, N, d]: node i's is node i-1's
        N = tokens.shape[1]
        meta = chain_meta(lengths, torch.tensor(counts, device=tokens.device), (), max_new=N)
        out = self.executor.drafter_prefill(tokens, prev, meta, self.cache.gather_mtp(seq_ids, lengths))
        self.cache.commit_mtp(seq_ids, meta, out.scratch[0], meta.valid)
        for j, (st, n) in enumerate(zip(states, counts)):
            st.last_at(hidden, j, n - 1)

    @torch.no_grad()
    def catch_up(self, seq_ids: list[int], lengths: torch.Tensor) -> None:
        """Feed the drafter the positions committed without it (a deferred prompt, plain
        decode steps), all lagging requests together in prefill-sized chunks, so its KV
        again covers every committed position. lengths: [B] committed L (the lag ends at
        position L - 1)."""
        lagging = [(sid, self.states[sid], L) for sid, L in zip(seq_ids, lengths.tolist())
                   if sid in self.states and self.states[sid].lag]
        if not lagging:
            return
        lag = [st.lag.tensors() for _, st, _ in lagging]
        start = [L - len(tokens) for (_, _, L), (tokens, _) in zip(lagging, lag)]
        done = [0] * len(lagging)
        device = lag[0][0].device
        while active := [j for j, (tokens, _) in enumerate(lag) if done[j] < len(tokens)]:
            counts = [min(self.chunk, len(lag[j][0]) - done[j]) for j in active]
            N = max(counts)
            d = lag[active[0]][1].shape[-1]
            tokens = torch.full((len(active), N), self.model.cfg.pad_token_id, dtype=torch.long, device=device)
            prev = torch.zeros(len(active), N, d, dtype=lag[active[0]][1].dtype, device=device)
            for r, (j, n) in enumerate(zip(active, counts)):
                tokens[r, :n] = lag[j][0][done[j]:done[j] + n]
                prev[r, :n] = lag[j][1][done[j]:done[j] + n]
            ids = [lagging[j][0] for j in active]
            L = torch.tensor([start[j] + done[j] for j in active], dtype=torch.long, device=device)
            meta = chain_meta(L, torch.tensor(counts, device=device), (), max_new=N)
            out = self.executor.drafter_prefill(tokens, prev, meta, self.cache.gather_mtp(ids, L))
            self.cache.commit_mtp(ids, meta, out.scratch[0], meta.valid)
            for j, n in zip(active, counts):
                done[j] += n
        for _, st, _ in lagging:
            st.lag.clear()

    # -- a round ---------------------------------------------------------------------
    def _roots_ahead(self, seq_ids: list[int], lengths: list[int]) -> DraftRoot | None:
        """The batch's roots as the last rounds' draft extends computed them, when every
        request has its own current (its drafter saw exactly its committed positions since);
        else None, and the round computes them all. Where one extend computed them all, in
        this order (a batch that did not change since the last round), its outputs are the
        roots as they are."""
        ahead = []
        for sid, L in zip(seq_ids, lengths):
            st = self.states.get(sid)
            if st is None or st.root is None or st.root[0] != L or st.lag:
                return None
            ahead.append(st.root[1:])
        out = ahead[0][0]
        if out.root_k.shape[0] == len(ahead) and all(o is out and row == j for j, (o, row) in enumerate(ahead)):
            return DraftRoot(k=out.root_k, hidden=out.root_hidden, logits=out.root_logits)
        return DraftRoot.stack([DraftRoot(o.root_k, o.root_hidden, o.root_logits).row(row) for o, row in ahead])

    @torch.no_grad()
    def propose(self, seq_ids: list[int], lengths: torch.Tensor, roots: torch.Tensor, spec: SpecConfig,
                temperature: list[float] | None = None) -> DraftTree:
        """Grow one draft tree per request. lengths: [B] committed L; roots: [B] the root
        tokens (at position L); temperature: per request, its sampling temperature (0:
        greedy; the calibrated selection keeps greedy and sampled acceptance apart, and
        values a sampled request's nodes by the drafter's distribution at its temperature,
        since its target draws at that temperature). The drafter must have followed every
        committed position (`catch_up` first)."""
        missing = [sid for sid in seq_ids if sid not in self.states or self.states[sid].last_hidden is None]
        if missing:
            raise RuntimeError(f"the drafter has not followed requests {missing}: no target hidden state to start from")
        prev_hidden = torch.stack([self.states[sid].last_hidden for sid in seq_ids])   # [B, d]
        root = self._roots_ahead(seq_ids, lengths.tolist())
        temps = temperature or [0.0] * len(seq_ids)
        log_q = selection_of(spec).log_factors(self.calibration, seq_ids, temps, spec)
        scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=roots.device)   # [B]
        tables = self.cache.block_tables(seq_ids, ("mtp",), self.executor.addressing)
        return self._grow(roots, prev_hidden, lengths, tables, spec, root, log_q, scale)

    def learn(self, seq_ids: list[int], temperature: list[float], children: torch.Tensor,
              children_logp: torch.Tensor, path: torch.Tensor, path_len: torch.Tensor, bonus: torch.Tensor,
              path_tokens: torch.Tensor) -> None:
        """What a verified round says about acceptance (`calibration.AcceptanceModel.observe_round`):
        every tree node's proposals [B, N, k] and their log-probabilities, the accepted
        path's nodes [B, D] (path_len [B] of them), the bonus token [B] and the path's
        tokens [B, D]."""
        self.calibration.observe_round(seq_ids, [SAMPLED if t > 0 else GREEDY for t in temperature], children,
                                       children_logp, path, path_len, bonus, path_tokens)

    def _grow(self, root_ids: torch.Tensor, prev_hidden: torch.Tensor, num_committed: torch.Tensor,
              tables: BlockTables, spec: SpecConfig, root: DraftRoot | None,
              log_q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> DraftTree:
        """root_ids: [B]; prev_hidden: [B, d] target hidden at L-1; num_committed: [B] L;
        tables: the batch's "mtp" block tables (where the drafter's KV for positions < L
        lies in the paged pool; the growth reads it there); root: the
        drafter's output at the root when already computed (`DraftRoot`), else computed
        here; log_q: the calibrated selection's log calibration factors
        (`AcceptanceModel.log_factors`), None for EAGLE-2; scale: the temperature [B] each
        request's children are valued and learnt at (1: greedy; None: 1 for all). The
        growth itself is one call of the executor (`growth.grow_trees`)."""
        if root is None:   # step 1: the root's MTP slot at position L
            committed = read_mtp(self.model.cfg, self.cache.storage, tables, num_committed)
            out = self.executor.drafter(root_ids[:, None], prev_hidden[:, None],
                                        chain_meta(num_committed, 1, (), max_new=1), committed)
            root = DraftRoot(k=out.scratch[0].k, hidden=out.hidden, logits=self._logits(out.hidden[:, 0]))
        plan = GrowthPlan(spec.num_steps, spec.topk, spec.num_draft_tokens, calibrated=log_q is not None,
                          reduced_vocab=self.vocab_ids is not None)
        device = root_ids.device
        inputs = GrowthInputs(root_ids=root_ids, root_k=root.k, root_hidden=root.hidden, root_logits=root.logits,
                              num_committed=num_committed, tables=tables,
                              log_q=None if log_q is None else log_q.to(device),
                              scale=torch.ones(len(root_ids), device=device) if scale is None else scale.to(device))
        shared = {"prob_edges": self.calibration.edges.to(device)} if plan.calibrated else {}
        if plan.reduced_vocab:
            shared.update(head_rows=self.head_rows, vocab_ids=self.vocab_ids)
        return self.executor.graph(grow_trees, plan, inputs, shared, pools=True)

    @torch.no_grad()
    def extend(self, seq_ids: list[int], lengths: torch.Tensor, path_tokens: torch.Tensor, hidden: torch.Tensor,
               path: torch.Tensor, path_len: torch.Tensor, bonus: torch.Tensor, num_draft_tokens: int) -> None:
        """After a round committed each accepted path: drafter slots L .. L+n-1 for the
        path, now with the target's hidden states instead of the drafter's own, and one
        node further the next root (the bonus token [B]), whose output the next round starts
        from. path_tokens: [B, D] (root first, padded past path_len [B]); hidden: [B, N, d]
        the target's hidden states at the verified nodes, and path [B, D] the path's nodes
        among them. The inputs' assembly, the forward, the path's commit and the root's
        logits are one call of the executor (`extend_forward`)."""
        width = self.executor.extend_width(int(path_len.max()) + 1, num_draft_tokens + 1)
        plan = ExtendPlan(width=width, reduced_vocab=self.vocab_ids is not None)
        last = torch.stack([self.states[sid].last_hidden for sid in seq_ids])            # [B, d]
        inputs = ExtendInputs(path_tokens=path_tokens, hidden=hidden, path=path, path_len=path_len, bonus=bonus,
                              last_hidden=last, num_committed=lengths,
                              tables=self.cache.block_tables(seq_ids, ("mtp",), self.executor.addressing))
        shared = {"head_rows": self.head_rows} if plan.reduced_vocab else {}
        out = self.executor.graph(extend_forward, plan, inputs, shared, pools=True)   # commits the path
        new_lengths = (lengths + path_len).tolist()
        for b, sid in enumerate(seq_ids):
            st = self.states[sid]
            st.last_at(out.path_last, b, 0)
            st.root = (new_lengths[b], out, b)


@dataclass(frozen=True)
class ExtendPlan:
    """A draft extend's static shape: `width` nodes (the path and the next root, padded),
    and whether the root's logits are over a reduced vocabulary."""

    width: int
    reduced_vocab: bool = False

    @property
    def label(self) -> str:
        return f"w{self.width}" + ("-rv" if self.reduced_vocab else "")


@dataclass
class ExtendInputs:
    path_tokens: torch.Tensor     # [B, D] the accepted path's tokens, root first (padded past path_len)
    hidden: torch.Tensor          # [B, N, n*d] the target's hidden states at the verified nodes
    path: torch.Tensor            # [B, D] the path's nodes among them
    path_len: torch.Tensor        # [B] accepted path nodes (the next root sits at index path_len)
    bonus: torch.Tensor           # [B] the next root's token
    last_hidden: torch.Tensor     # [B, n*d] the target's hidden state at L - 1, before the path
    num_committed: torch.Tensor   # [B] L: the drafter's committed length before the extend
    tables: BlockTables           # the batch's "mtp" block tables (its KV for positions < L; the path's slots)


@dataclass
class ExtendOutputs:
    root_k: torch.Tensor          # [B, 1, d_h] the next root's MTP key
    root_hidden: torch.Tensor     # [B, 1, n*d] its MTP hidden state
    root_logits: torch.Tensor     # [B, N] its drafter logits over the drafted vocabulary
    path_last: torch.Tensor       # [B, 1, n*d] the target's hidden state at the path's last node


def extend_forward(model: Transformer, plan: ExtendPlan, x: ExtendInputs, shared: dict[str, torch.Tensor],
                   storage: dict[str, torch.Tensor]) -> ExtendOutputs:
    """The draft extend's inputs (the path's tokens then the next root, each after the
    target's hidden state one position earlier), its MTP forward over them (the drafter's
    committed KV read from the pools' storage), the path's keys committed there (the root's
    stay out: the next round drafts from it), and the root's output (a pure function of
    tensors: one compiled graph per width on the fast path)."""
    B, W = x.path_tokens.shape[0], plan.width
    nd = x.hidden.shape[-1]
    path_hidden = x.hidden.gather(1, x.path[..., None].expand(-1, -1, nd))              # [B, D, n*d]
    tokens = torch.cat([x.path_tokens, x.path_tokens[:, :1]], dim=1)                      # [B, D+1]
    tokens = tokens.scatter(1, x.path_len[:, None], x.bonus[:, None])[:, :W]              # the root after the path
    prev = torch.cat([x.last_hidden[:, None], path_hidden], dim=1)[:, :W]                # node i's is node i-1's
    meta = chain_meta(x.num_committed, x.path_len + 1, (), max_new=W)
    committed = read_mtp(model.cfg, storage, x.tables, x.num_committed)
    out = model.mtp_forward(tokens, prev, meta, committed, logits=False)
    on_path = meta.valid & (torch.arange(W, device=tokens.device)[None] < x.path_len[:, None])
    write_mtp(model.cfg, storage, x.tables, meta, out.scratch[0], on_path)
    at_root = (torch.arange(B, device=tokens.device), x.path_len)
    hidden = out.hidden[at_root]                                         # [B, n*d]
    logits = model.mtp_logits(hidden, shared["head_rows"] if plan.reduced_vocab else None)
    path_last = path_hidden.gather(1, (x.path_len - 1)[:, None, None].expand(-1, 1, nd))  # [B, 1, n*d]
    return ExtendOutputs(root_k=out.scratch[0].k[at_root][:, None], root_hidden=hidden[:, None], root_logits=logits,
                         path_last=path_last)
