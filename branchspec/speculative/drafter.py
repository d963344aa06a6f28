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
the MTP keys of its own ancestors (root slot included), never a sibling's.

**Following.** The drafter's KV must hold every committed position, fed with the target's
hidden states (not its own). Three ways in, all here: `follow` (the prompt's prefill, and
plain decode steps: at once, or deferred as *lag* when speculation may never come),
`catch_up` (the lag, fed before a speculative round), and `extend` (after a round: the
accepted path, and one node further the next root, whose output the next round starts
from, so growth needs one forward fewer, as SGLang fuses them). Its per-request state is
`DrafterState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import SpecConfig
from branchspec.model.attention import LayerState
from branchspec.model.metadata import build_meta, chain_meta
from branchspec.model.model import Transformer
from branchspec.speculative.calibration import GREEDY, SAMPLED, AcceptanceModel
from branchspec.speculative.draft_vocab import DraftVocab
from branchspec.speculative.tree import DraftTree, select_tree


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
    """Committed positions the drafter has not followed: chunks of (tokens [n], the target's
    hidden state before each [n, d]); len() is the number of positions, kept as a count so
    that reading it each round costs nothing however many chunks plain rounds added."""

    def __init__(self) -> None:
        self.chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.length = 0

    def append(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.chunks.append((tokens, hidden))
        self.length += len(tokens)

    def clear(self) -> None:
        self.chunks.clear()
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        return iter(self.chunks)


@dataclass
class DrafterState:
    """What the drafter keeps for one request between rounds."""

    # [n*d] the target's hidden state at the last committed position (L - 1): the residual
    # the drafter's next position (the root, at L) starts from
    last_hidden: torch.Tensor | None = None
    lag: DrafterLag = field(default_factory=DrafterLag)
    # The output at the next root, with the committed length it belongs to; a round that
    # finds it current skips the root's own forward.
    root: tuple[int, DraftRoot] | None = None


class Drafter(Protocol):
    """Proposes draft trees, and follows what the target commits (see `MTPDrafter`)."""

    def follow(self, seq_ids: list[int], lengths: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor,
               counts: list[int], now: bool) -> None: ...

    def catch_up(self, seq_ids: list[int], lengths: torch.Tensor) -> None: ...

    def propose(self, seq_ids: list[int], lengths: torch.Tensor, roots: torch.Tensor, spec: SpecConfig,
                temperature: list[float] | None = None) -> DraftTree: ...

    def learn(self, seq_ids: list[int], temperature: list[float], children: torch.Tensor,
              children_logp: torch.Tensor, targets: torch.Tensor) -> None: ...

    def extend(self, seq_ids: list[int], lengths: torch.Tensor, path_tokens: torch.Tensor, path_hidden: torch.Tensor,
               path_len: torch.Tensor, bonus: torch.Tensor, num_draft_tokens: int) -> None: ...

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

    @staticmethod
    def _value_logp(logits: torch.Tensor, index: torch.Tensor, scale: torch.Tensor | None,
                    logp: torch.Tensor) -> torch.Tensor:
        """The drafter's log-probabilities of the chosen children (index [..., k] into the
        logits' last dim) at each request's temperature (scale [B]); `logp` (already at
        temperature 1) when no scale is given."""
        if scale is None:
            return logp
        view = scale.view(-1, *([1] * (logits.dim() - 1)))
        return torch.log_softmax(logits.float() / view, dim=-1).gather(-1, index)

    def _token_ids(self, index: torch.Tensor) -> torch.Tensor:
        """Positions in the drafted vocabulary -> target token ids (same shape)."""
        return index if self.vocab_ids is None else self.vocab_ids[index]

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
        first = torch.stack([st.last_hidden if st.last_hidden is not None else torch.zeros_like(hidden[0, 0])
                             for st in states])
        prev = torch.cat([first[:, None], hidden[:, :-1]], dim=1)            # [B, N, d]: node i's is node i-1's
        if now:
            N = tokens.shape[1]
            meta = chain_meta(lengths, torch.tensor(counts, device=tokens.device), (), max_new=N)
            out = self.executor.drafter_prefill(tokens, prev, meta, self.cache.gather_mtp(seq_ids, lengths))
            self.cache.commit_mtp(seq_ids, meta, out.scratch[0], meta.valid)
        for j, (st, n) in enumerate(zip(states, counts)):
            if not now:
                st.lag.append(tokens[j, :n], prev[j, :n])
            st.last_hidden = hidden[j, n - 1]

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
        lag = [(torch.cat([t for t, _ in st.lag]), torch.cat([h for _, h in st.lag])) for _, st, _ in lagging]
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
        else None, and the round computes them all."""
        rows = []
        for sid, L in zip(seq_ids, lengths):
            st = self.states.get(sid)
            if st is None or st.root is None or st.root[0] != L or st.lag:
                return None
            rows.append(st.root[1])
        return DraftRoot.stack(rows)

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
        log_q = scale = None
        if spec.selection == "calibrated":
            temps = temperature or [0.0] * len(seq_ids)
            log_q = self.calibration.log_factors(seq_ids, [SAMPLED if t > 0 else GREEDY for t in temps])
            scale = torch.tensor([t if t > 0 else 1.0 for t in temps], device=roots.device)   # [B]
        return self._grow(roots, prev_hidden, lengths, self.cache.gather_mtp(seq_ids, lengths), spec, root, log_q,
                          scale)

    def learn(self, seq_ids: list[int], temperature: list[float], children: torch.Tensor,
              children_logp: torch.Tensor, targets: torch.Tensor) -> None:
        """What a verified round says about acceptance (`calibration.AcceptanceModel.observe`):
        the proposals after each accepted-path node [B, D, k], their log-probabilities, and
        the target's token there [B, D]."""
        self.calibration.observe(seq_ids, [SAMPLED if t > 0 else GREEDY for t in temperature], children,
                                 children_logp, targets)

    def _grow(self, root_ids: torch.Tensor, prev_hidden: torch.Tensor, num_committed: torch.Tensor,
              committed: LayerState, spec: SpecConfig, root: DraftRoot | None,
              log_q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> DraftTree:
        """root_ids: [B]; prev_hidden: [B, d] target hidden at L-1; num_committed: [B] L;
        committed: the drafter's KV for positions < L (from the paged pool); root: the
        drafter's output at the root when already computed (`DraftRoot`); log_q: the
        calibrated selection's log calibration factors (`AcceptanceModel.log_factors`),
        None for EAGLE-2's cumulative draft log-probability; scale: [B] the temperature
        the calibrated selection reads each request's drafter distribution at (1: greedy).

        Candidates carry two scores: `cand_score`, the cumulative draft log-probability,
        and `cand_value`, what the selection ranks by (the same score for EAGLE-2; the sum
        of log q along the path for the calibrated selection)."""
        k, D = spec.topk, spec.num_draft_tokens
        B = root_ids.shape[0]
        device = root_ids.device
        bidx = torch.arange(B, device=device)[:, None]

        # Step 1: the root's MTP slot at position L.
        if root is None:
            out = self.executor.drafter(root_ids[:, None], prev_hidden[:, None],
                                   chain_meta(num_committed, 1, (), max_new=1), committed)
            root = DraftRoot(k=out.scratch[0].k, hidden=out.hidden, logits=self._logits(out.hidden[:, 0]))
        slot_k = root.k                                             # [B, X, d_h] keys of expanded nodes
        slot_pos = num_committed[:, None].clone()                   # [B, X]
        slot_hidden = root.hidden                                   # [B, X, d]
        logp = torch.log_softmax(root.logits.float(), dim=-1)
        cand_score, cand_index = logp.topk(k, dim=-1)               # [B, k]
        cand_tok = self._token_ids(cand_index)
        root_main = torch.ones(B, 1, dtype=torch.bool, device=device)
        root_lp = self._value_logp(root.logits, cand_index, scale, cand_score)          # [B, k]
        cand_value = cand_score if log_q is None else \
            self.calibration.edge_log_values(log_q, 1, root_main, root_lp[:, None])[:, 0]
        cand_main = (torch.arange(k, device=device) == 0).expand(B, k)         # [B, C] on the main line
        cand_parent = torch.full((B, k), -1, dtype=torch.long, device=device)   # candidate index, -1 root
        cand_slot_parent = torch.zeros(B, k, dtype=torch.long, device=device)   # parent's expanded slot
        cand_anc = torch.ones(B, k, 1, dtype=torch.bool, device=device)         # [B, C, X] ancestor slots
        frontier = torch.arange(k, device=device).expand(B, k)      # candidate indices
        root_children, root_children_logp = cand_tok, root_lp
        cand_children = torch.full((B, k, k), -1, dtype=torch.long, device=device)   # [B, C, k]
        cand_children_logp = torch.zeros(B, k, k, device=device)                      # their log-probabilities

        for step in range(1, spec.num_steps):
            X = slot_k.shape[1]
            tokens = cand_tok.gather(1, frontier)                   # [B, k]
            prev = slot_hidden[bidx, cand_slot_parent.gather(1, frontier)]      # [B, k, d]
            anc = cand_anc[bidx, frontier]                          # [B, k, X]
            # Frontier nodes sit at depth `step`; among themselves they are siblings.
            positions = (num_committed + step)[:, None].expand(B, k).contiguous()
            meta = build_meta(positions, num_committed,
                              torch.eye(k, dtype=torch.bool, device=device).expand(B, k, k),
                              torch.ones(B, k, dtype=torch.bool, device=device), ())
            Wc = committed.raw_k.shape[1]
            state = LayerState(
                raw_k=torch.cat([committed.raw_k, slot_k], dim=1),
                raw_pos=torch.cat([committed.raw_pos, slot_pos], dim=1),
                raw_valid=torch.cat([committed.raw_valid.expand(B, k, Wc), anc], dim=2))
            out = self.executor.drafter(tokens, prev, meta, state)
            new_slots = X + torch.arange(k, device=device)           # slots of the expanded frontier
            slot_k = torch.cat([slot_k, out.scratch[0].k], dim=1)
            slot_pos = torch.cat([slot_pos, positions], dim=1)
            slot_hidden = torch.cat([slot_hidden, out.hidden], dim=1)

            # Children: k per frontier node, scored by cumulative log-probability (and
            # valued by the calibrated selection's measured acceptance).
            logits = self._logits(out.hidden)                                   # [B, k, N]
            child_lp, child_index = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)   # [B, k, k]
            child_tok = self._token_ids(child_index)
            value_lp = self._value_logp(logits, child_index, scale, child_lp)
            child_score = (cand_score.gather(1, frontier)[..., None] + child_lp).reshape(B, k * k)
            parent_main = cand_main.gather(1, frontier)                          # [B, k]
            if log_q is None:
                child_value = child_score
            else:
                edge = self.calibration.edge_log_values(log_q, step + 1, parent_main, value_lp)
                child_value = (cand_value.gather(1, frontier)[..., None] + edge).reshape(B, k * k)
            child_main = (parent_main[..., None] & (torch.arange(k, device=device) == 0)).reshape(B, k * k)
            child_parent = frontier[..., None].expand(B, k, k).reshape(B, k * k)
            child_slot_parent = new_slots[None, :, None].expand(B, k, k).reshape(B, k * k)
            own = torch.zeros(B, k, X + k, dtype=torch.bool, device=device)
            own[..., X:] = torch.eye(k, dtype=torch.bool, device=device)
            child_anc = torch.cat([anc, torch.zeros(B, k, k, dtype=torch.bool, device=device)], 2) | own
            child_anc = child_anc[:, :, None, :].expand(B, k, k, X + k).reshape(B, k * k, X + k)

            C = cand_tok.shape[1]
            cand_children = cand_children.scatter(1, frontier[..., None].expand(B, k, k), child_tok)
            cand_children = torch.cat([cand_children, torch.full((B, k * k, k), -1, dtype=torch.long,
                                                                 device=device)], dim=1)
            cand_children_logp = cand_children_logp.scatter(1, frontier[..., None].expand(B, k, k), value_lp)
            cand_children_logp = torch.cat([cand_children_logp, torch.zeros(B, k * k, k, device=device)], dim=1)
            cand_value = torch.cat([cand_value, child_value], dim=1)
            cand_main = torch.cat([cand_main, child_main], dim=1)
            cand_tok = torch.cat([cand_tok, child_tok.reshape(B, k * k)], dim=1)
            cand_score = torch.cat([cand_score, child_score], dim=1)
            cand_parent = torch.cat([cand_parent, child_parent], dim=1)
            cand_slot_parent = torch.cat([cand_slot_parent, child_slot_parent], dim=1)
            cand_anc = torch.cat([torch.cat([cand_anc, torch.zeros(B, C, k, dtype=torch.bool, device=device)], 2),
                                  child_anc], dim=1)
            best = torch.sort(child_value, dim=1, descending=True, stable=True).indices[:, :k]
            frontier = C + best

        return select_tree(root_ids, cand_tok, cand_parent, cand_value, D, root_children, cand_children,
                           root_children_logp, cand_children_logp)

    @torch.no_grad()
    def extend(self, seq_ids: list[int], lengths: torch.Tensor, path_tokens: torch.Tensor, path_hidden: torch.Tensor,
               path_len: torch.Tensor, bonus: torch.Tensor, num_draft_tokens: int) -> None:
        """After a round committed each accepted path: drafter slots L .. L+n-1 for the
        path, now with the target's hidden states (path_hidden [B, D, d], path node i's)
        instead of the drafter's own, and one node further the next root (the bonus token
        [B]), whose output the next round starts from. path_tokens: [B, D] (root first,
        padded past path_len [B])."""
        B = len(seq_ids)
        dev = path_tokens.device
        rows = torch.arange(B, device=dev)
        prev_hidden = torch.stack([self.states[sid].last_hidden for sid in seq_ids])      # [B, d]
        prev = torch.cat([prev_hidden[:, None], path_hidden], dim=1)         # [B, D+1, d]: node i's is node i-1's
        tokens = torch.cat([path_tokens, path_tokens[:, :1]], dim=1)         # [B, D+1]
        tokens[rows, path_len] = bonus
        width = self.executor.extend_width(int(path_len.max()) + 1, num_draft_tokens + 1)
        meta = chain_meta(lengths, path_len + 1, (), max_new=width)
        out = self.executor.drafter(tokens[:, :width], prev[:, :width], meta, self.cache.gather_mtp(seq_ids, lengths))
        on_path = meta.valid & (torch.arange(width, device=dev)[None] < path_len[:, None])
        self.cache.commit_mtp(seq_ids, meta, out.scratch[0], on_path)       # the root stays uncommitted
        last = path_hidden[rows, path_len - 1]                               # [B, d]
        at_root = (rows, path_len)
        ahead = DraftRoot(k=out.scratch[0].k[at_root][:, None], hidden=out.hidden[at_root][:, None],
                          logits=self._logits(out.hidden[at_root]))
        new_lengths = (lengths + path_len).tolist()
        for b, sid in enumerate(seq_ids):
            st = self.states[sid]
            st.last_hidden = last[b]
            st.root = (new_lengths[b], ahead.row(b))
