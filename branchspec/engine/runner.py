"""The model runner: the only place where request lists become tensors.

It owns the model, the paged state and the drafter, and runs the three kinds of work:
chunked prefill of one request, a plain decode step, and a speculative round (draft,
plan, verify, accept, commit, draft-extend) over a batch.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import SpecConfig
from branchspec.engine.request import Sequence
from branchspec.engine.sampler import logprob_dicts, target_tokens
from branchspec.model.metadata import chain_meta
from branchspec.model.model import Transformer
from branchspec.spec.accept import accept
from branchspec.spec.drafter import Drafter, DraftRoot
from branchspec.spec.tree import build_verify_plan

ROUND_PHASES = ("draft", "plan", "verify", "accept", "commit", "draft_extend")


@dataclass
class PhaseTimer:
    """Wall time per phase, summed over calls. CPU work is synchronous; on a GPU each
    reading waits for the queued kernels first (`sync`), so a phase is charged its own."""

    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    sync: bool = False

    def record(self, phase: str, start: float) -> float:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[phase] += now - start
        return now

    def reset(self) -> None:
        self.seconds.clear()


@dataclass
class RoundResult:
    emitted: list[list[int]]     # per sequence, the tokens this round adds to the output
    path_len: list[int]          # per sequence, accepted nodes incl. root (committed tokens)
    # per sequence, one {token_id: logprob} per emitted token, or None where not asked for
    logprobs: list[list[dict[int, float]] | None] | None = None
    # speculative rounds, along each accepted path (root first, padded past its end): the
    # drafter's top-k proposals after each path node [B, D, k] (-1: not expanded) and the
    # target's token there [B, D] (the next path token, then the bonus; -1 past the end)
    path_children: torch.Tensor | None = None
    path_targets: torch.Tensor | None = None


def emitted_logprobs(seqs: list[Sequence], logits: torch.Tensor, nodes: torch.Tensor,
                     emitted: list[list[int]]) -> list[list[dict[int, float]] | None] | None:
    """Raw logprobs of the emitted tokens of the requests that asked for them.

    logits: [B, N, V] target logits at every node; nodes: [B, >= max emitted] the node whose
    output distribution produced each emitted token (emitted token i of a speculative round
    comes from accepted-path node i: an accepted child from its parent, the bonus token from
    the last path node). None, with no work done, when no request asked.
    """
    want = [b for b, s in enumerate(seqs) if s.params.logprobs is not None and emitted[b]]
    if not want:
        return None
    rows_b = torch.tensor([b for b in want for _ in emitted[b]], dtype=torch.long, device=logits.device)
    rows_n = torch.cat([nodes[b, :len(emitted[b])] for b in want]).to(logits.device)
    dicts = logprob_dicts(logits[rows_b, rows_n], [t for b in want for t in emitted[b]],
                          [seqs[b].params.logprobs for b in want for _ in emitted[b]])
    out: list[list[dict[int, float]] | None] = [None] * len(seqs)
    start = 0
    for b in want:
        out[b] = dicts[start:start + len(emitted[b])]
        start += len(emitted[b])
    return out


class ModelRunner:
    """Runs prefill, decode steps and speculative rounds. With `compile`, decode, verify and
    every drafter forward run compiled (`engine/compiled.py`) on stable shapes; prefill
    stays eager, and eager is always the reference."""

    def __init__(self, model: Transformer, cache: PagedState, drafter: Drafter | None,
                 prefill_chunk_size: int = 256, compile: bool = False):
        self.model, self.cache, self.drafter = model, cache, drafter
        self.cfg = model.cfg
        self.chunk = prefill_chunk_size
        self.device = model.embed.weight.device
        self.timer = PhaseTimer(sync=self.device.type == "cuda")
        self.last_catch_up_seconds = 0.0    # of the last speculative round (drafter lag fed first)
        self.static = compile
        # The drafter's forward without its LM head: the extend needs logits at the new root only.
        self.target, self.mtp_forward = model.forward, functools.partial(model.mtp_forward, logits=False)
        self.pools = self.decode = None
        if compile:
            from branchspec.engine.compiled import Pools, compile_steps
            from branchspec.model.layers import build_stacked

            build_stacked(model)     # compiled steps read the stacked projections built now
            self.target, self.decode, self.mtp_forward = compile_steps(model)
            self.pools = Pools(cache.storage)     # read inside the compiled target step
            cache.pad_entries = True
            if drafter is not None:
                drafter.mtp_forward = self.mtp_forward

    def _target_forward(self, input_ids: torch.Tensor, meta, seq_ids: list[int], lengths: torch.Tensor):
        """The target over new nodes on top of each sequence's committed state: eager reads
        that state out of the pools first; the compiled step reads it in its graph."""
        if self.static:
            return self.target(input_ids, meta, self.pools, self.cache.addresses(seq_ids, lengths))
        return self.target(input_ids, meta, self.cache.gather(seq_ids, lengths))

    def _lengths(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.num_committed for s in seqs], dtype=torch.long, device=self.device)

    def sampling(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor, list]:
        """Per-request (temperature [B], top_p [B], generators); temperature 0 = greedy."""
        temp = torch.tensor([s.params.sampling_temperature for s in seqs], dtype=torch.float64)
        top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float64)
        return temp, top_p, [s.generator for s in seqs]

    # -- prefill ----------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, seqs: list[Sequence], with_mtp: bool, lag_mtp: bool = False) -> list[torch.Tensor]:
        """Feed every token before each root through the target (and the drafter), in
        chunks, all sequences of the batch together (padded to the longest chunk).

        `lag_mtp` (instead of `with_mtp`): the drafter may never be needed (an adaptive
        policy that may decode plainly), so what it would be fed goes to each request's
        drafter lag; the first speculative round catches up on it.

        A new request has no root yet: all prompt tokens are fed and its returned logits
        [V] at the last one choose the first output token. A recomputed (preempted) request
        feeds everything but its root. Pages must have been reserved.

        A request that asked for prompt_logprobs and has none yet gets them here, chunk by
        chunk, from the logits at every prompt position (the others' are never touched); a
        recomputed request already has them.
        """
        t0 = time.perf_counter()
        ends = [len(s.token_ids) - (1 if s.output_ids else 0) for s in seqs]
        logits: list[torch.Tensor | None] = [None] * len(seqs)
        prompt_lps = {i: [None] for i, s in enumerate(seqs)
                      if s.params.prompt_logprobs is not None and s.prompt_logprobs is None}
        while active := [i for i, s in enumerate(seqs) if s.num_committed < ends[i]]:
            group = [seqs[i] for i in active]
            ids = [s.seq_id for s in group]
            L = self._lengths(group)
            counts = [min(self.chunk, ends[i] - seqs[i].num_committed) for i in active]
            N = max(counts)
            tokens = torch.full((len(group), N), self.cfg.pad_token_id, dtype=torch.long)
            for j, (s, n) in enumerate(zip(group, counts)):
                tokens[j, :n] = torch.tensor(s.token_ids[s.num_committed:s.num_committed + n])
            tokens = tokens.to(self.device)
            num_new = torch.tensor(counts, device=self.device)
            meta = chain_meta(L, num_new, self.cfg.compressed_ratios, max_new=N)
            out = self.model(tokens, meta, self.cache.gather(ids, L))
            self.cache.commit(ids, meta, out.scratch, meta.valid)
            if with_mtp or lag_mtp:
                first = torch.stack([s.last_hidden if s.last_hidden is not None
                                     else torch.zeros_like(out.hidden[0, 0]) for s in group])
                prev = torch.cat([first[:, None], out.hidden[:, :-1]], dim=1)   # [B, N, d]
            if lag_mtp:
                for j, (s, n) in enumerate(zip(group, counts)):
                    s.drafter_lag.append(tokens[j, :n], prev[j, :n])
            elif with_mtp:
                mtp_meta = chain_meta(L, num_new, (), max_new=N)
                mtp = self.model.mtp_forward(tokens, prev, mtp_meta, self.cache.gather_mtp(ids, L), logits=False)
                self.cache.commit_mtp(ids, mtp_meta, mtp.scratch[0], mtp_meta.valid)
            if prompt_lps:
                self._collect_prompt_logprobs(seqs, active, counts, out.logits, prompt_lps)
            for j, (i, n) in enumerate(zip(active, counts)):
                seqs[i].last_hidden = out.hidden[j, n - 1]
                seqs[i].num_committed += n
                logits[i] = out.logits[j, n - 1]
        for i, lps in prompt_lps.items():
            seqs[i].prompt_logprobs = lps
        self.timer.record("prefill", t0)
        return logits

    @staticmethod
    def _collect_prompt_logprobs(seqs: list[Sequence], active: list[int], counts: list[int],
                                 logits: torch.Tensor, prompt_lps: dict[int, list]) -> None:
        """Extend prompt_lps[i] with this chunk's prompt positions: logits [B, N, V] at
        position p (of seqs[active[j]], before num_committed moves) score prompt token p + 1."""
        rows, targets, num_top, owners = [], [], [], []
        for j, (i, n) in enumerate(zip(active, counts)):
            if i not in prompt_lps:
                continue
            s = seqs[i]
            c = s.num_committed
            m = min(n, len(s.prompt_ids) - 1 - c)   # the last prompt position scores an output token
            if m <= 0:
                continue
            rows.append(logits[j, :m])
            targets.extend(s.prompt_ids[c + 1:c + 1 + m])
            num_top.extend([s.params.prompt_logprobs] * m)
            owners.append((i, m))
        if not rows:
            return
        dicts = logprob_dicts(torch.cat(rows), targets, num_top)
        start = 0
        for i, m in owners:
            prompt_lps[i].extend(dicts[start:start + m])
            start += m

    # -- plain decoding ---------------------------------------------------------------
    @torch.no_grad()
    def decode_step(self, seqs: list[Sequence], track_drafter: bool = False) -> RoundResult:
        """Feed each root through the target; emit the next token of each sequence.

        `track_drafter`: the drafter will be needed again (an adaptive policy), so each
        root, with the target hidden state before it, joins the request's drafter lag."""
        t0 = time.perf_counter()
        ids = [s.seq_id for s in seqs]
        L = self._lengths(seqs)
        roots = torch.tensor([[s.root_id] for s in seqs], device=self.device)
        if self.static:   # compiled: the step builds its metadata in its graph
            out, meta = self.decode(roots, L, self.pools, self.cache.addresses(ids, L))
        else:
            meta = chain_meta(L, 1, self.cfg.compressed_ratios)
            out = self._target_forward(roots, meta, ids, L)
        t0 = self.timer.record("verify", t0)
        self.cache.commit(ids, meta, out.scratch, meta.valid)
        t0 = self.timer.record("commit", t0)
        nxt = target_tokens(out.logits, *self.sampling(seqs))[:, 0].tolist()
        for b, s in enumerate(seqs):
            if track_drafter:
                s.drafter_lag.append(roots[b], s.last_hidden[None])
            s.last_hidden = out.hidden[b, 0]
            s.num_committed += 1
        emitted = [[t] for t in nxt]
        logprobs = emitted_logprobs(seqs, out.logits, torch.zeros(len(seqs), 1, dtype=torch.long), emitted)
        self.timer.record("accept", t0)
        return RoundResult(emitted=emitted, path_len=[1] * len(seqs), logprobs=logprobs)

    # -- speculative round ------------------------------------------------------------
    @torch.no_grad()
    def catch_up_drafter(self, seqs: list[Sequence]) -> None:
        """Feed the drafter the positions committed without it (a deferred prompt, plain
        decode steps), all lagging requests together in prefill-sized chunks, so its KV
        again covers every committed position."""
        self.last_catch_up_seconds = 0.0
        lagging = [s for s in seqs if s.drafter_lag]
        if not lagging:
            return
        t0 = time.perf_counter()
        lag = [(torch.cat([t for t, _ in s.drafter_lag]), torch.cat([h for _, h in s.drafter_lag]))
               for s in lagging]                                      # per request: [n], [n, d]
        start = [s.num_committed - len(tokens) for s, (tokens, _) in zip(lagging, lag)]
        done = [0] * len(lagging)
        while active := [j for j, (tokens, _) in enumerate(lag) if done[j] < len(tokens)]:
            counts = [min(self.chunk, len(lag[j][0]) - done[j]) for j in active]
            N = max(counts)
            d = lag[active[0]][1].shape[-1]
            tokens = torch.full((len(active), N), self.cfg.pad_token_id, dtype=torch.long, device=self.device)
            prev = torch.zeros(len(active), N, d, dtype=lag[active[0]][1].dtype, device=self.device)
            for r, (j, n) in enumerate(zip(active, counts)):
                tokens[r, :n] = lag[j][0][done[j]:done[j] + n]
                prev[r, :n] = lag[j][1][done[j]:done[j] + n]
            ids = [lagging[j].seq_id for j in active]
            L = torch.tensor([start[j] + done[j] for j in active], dtype=torch.long, device=self.device)
            meta = chain_meta(L, torch.tensor(counts, device=self.device), (), max_new=N)
            mtp = self.model.mtp_forward(tokens, prev, meta, self.cache.gather_mtp(ids, L), logits=False)
            self.cache.commit_mtp(ids, meta, mtp.scratch[0], meta.valid)
            for j, n in zip(active, counts):
                done[j] += n
        for s in lagging:
            s.drafter_lag.clear()
        self.last_catch_up_seconds = time.perf_counter() - t0
        self.timer.record("draft_extend", t0)

    @staticmethod
    def _draft_root(seqs: list[Sequence]) -> DraftRoot | None:
        """The batch's roots as the last rounds' draft extends computed them, when every
        request has its own current (its drafter saw exactly its committed positions since);
        else None, and the round computes them all."""
        rows = []
        for s in seqs:
            if s.draft_root is None or s.draft_root[0] != s.num_committed or s.drafter_lag:
                return None
            rows.append(s.draft_root[1])
        return DraftRoot.stack(rows)

    @torch.no_grad()
    def spec_round(self, seqs: list[Sequence], spec: SpecConfig) -> RoundResult:
        self.catch_up_drafter(seqs)
        t0 = time.perf_counter()
        cfg, dev = self.cfg, self.device
        ids = [s.seq_id for s in seqs]
        B = len(seqs)
        L = self._lengths(seqs)
        roots = torch.tensor([s.root_id for s in seqs], device=dev)
        prev_hidden = torch.stack([s.last_hidden for s in seqs])            # [B, d]

        tree = self.drafter.draft(roots, prev_hidden, L, self.cache.gather_mtp(ids, L), spec,
                                  root=self._draft_root(seqs))
        t0 = self.timer.record("draft", t0)

        plan = build_verify_plan(tree.parents, L, cfg.compressed_ratios, static=self.static)
        t0 = self.timer.record("plan", t0)

        out = self._target_forward(tree.tokens, plan.meta, ids, L)             # [B, D, V]
        t0 = self.timer.record("verify", t0)

        # A round never commits past a request's token budget (its pages were sized for it).
        limit = torch.tensor([s.num_remaining + 1 for s in seqs], device=dev)
        acc = accept(tree.tokens, tree.parents, out.logits, *self.sampling(seqs), max_path_len=limit)
        path_tokens = tree.tokens.gather(1, acc.path)                         # [B, D]
        path_len = acc.path_len.tolist()
        emitted = []
        for b, s in enumerate(seqs):
            n = path_len[b]
            toks = path_tokens[b, 1:n].tolist() + [int(acc.bonus[b])]
            emitted.append(toks[: s.num_remaining])
            s.stats.num_rounds += 1
            s.stats.num_emitted += n
            depth_hits = s.stats.accepted_per_depth
            while len(depth_hits) < spec.num_draft_tokens - 1:
                depth_hits.append(0)
            for d in range(n - 1):
                depth_hits[d] += 1
        # Emitted token i comes from path node i's distribution (same as plain decoding's).
        logprobs = emitted_logprobs(seqs, out.logits, acc.path, emitted)
        t0 = self.timer.record("accept", t0)

        self.cache.commit(ids, plan.meta, out.scratch, acc.keep)
        t0 = self.timer.record("commit", t0)

        # Draft extend: drafter slots L .. L+n-1 for the committed path, now with the
        # target's hidden states instead of the drafter's own, and one node further the
        # next root (the bonus token), whose output the next round starts from.
        bidx = torch.arange(B, device=dev)[:, None]
        path_hidden = out.hidden[bidx, acc.path]                             # [B, D, d]
        prev = torch.cat([prev_hidden[:, None], path_hidden], dim=1)         # [B, D+1, d]: node i's is node i-1's
        tokens = torch.cat([path_tokens, path_tokens[:, :1]], dim=1)         # [B, D+1]
        tokens[torch.arange(B, device=dev), acc.path_len] = acc.bonus
        # Compiled: always D+1 slots (padding masked by meta.valid), so no accept length recompiles.
        Nmax = spec.num_draft_tokens + 1 if self.static else int(acc.path_len.max()) + 1
        meta = chain_meta(L, acc.path_len + 1, (), max_new=Nmax)
        committed = self.cache.gather_mtp(ids, L)
        if self.static:   # per-node visibility, as the drafter's frontier steps have: one graph for both
            committed.raw_valid = committed.raw_valid.expand(B, Nmax, committed.raw_valid.shape[-1])
        mtp = self.mtp_forward(tokens[:, :Nmax], prev[:, :Nmax], meta, committed)
        on_path = meta.valid & (torch.arange(Nmax, device=dev)[None] < acc.path_len[:, None])
        self.cache.commit_mtp(ids, meta, mtp.scratch[0], on_path)            # the root stays uncommitted
        last = path_hidden[torch.arange(B, device=dev), acc.path_len - 1]    # [B, d]
        at_root = (torch.arange(B, device=dev), acc.path_len)
        ahead = DraftRoot(k=mtp.scratch[0].k[at_root][:, None], hidden=mtp.hidden[at_root][:, None],
                          logits=self.model.mtp_logits(mtp.hidden[at_root]))
        for b, s in enumerate(seqs):
            s.num_committed += path_len[b]
            s.last_hidden = last[b]
            s.draft_root = (s.num_committed, ahead.row(b))
        self.timer.record("draft_extend", t0)
        path_children = path_targets = None
        if tree.children is not None:
            D, k = tree.children.shape[1:]
            path_children = tree.children.gather(1, acc.path[..., None].expand(B, D, k))
            ahead = torch.cat([path_tokens[:, 1:], path_tokens[:, :1]], dim=1)          # next path token
            steps = torch.arange(D, device=dev)[None]
            path_targets = torch.where(steps < (acc.path_len - 1)[:, None], ahead, -1)
            path_targets[torch.arange(B, device=dev), acc.path_len - 1] = acc.bonus
        return RoundResult(emitted=emitted, path_len=path_len, logprobs=logprobs, path_children=path_children,
                           path_targets=path_targets)
