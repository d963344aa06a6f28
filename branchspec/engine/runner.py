"""The model runner: the only place where request lists become tensors.

It runs the two kinds of work on a batch of requests: chunked prefill (admitted prompts,
with their first sampled token), and one step: a plain decode step, or a speculative
round (`speculative.round.SpeculativeRound`). It never changes a request's counters; the
engine applies what a step returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from branchspec.cache.paged import PagedState
from branchspec.config import SpecConfig
from branchspec.engine.request import Sequence
from branchspec.execution import Executor
from branchspec.execution.threads import one_row_products
from branchspec.execution.timing import PhaseClock
from branchspec.logits_process import LogitsRules, NodePaths, process_logits
from branchspec.model.metadata import chain_meta
from branchspec.model.model import Transformer
from branchspec.sampling import SamplingBatch, emitted_logprobs, logprob_dicts, node_draws, target_tokens
from branchspec.speculative.drafter import Drafter
from branchspec.speculative.outcome import RoundResult
from branchspec.speculative.round import RoundBatch, SpeculativeRound


# What one more prefill call costs beyond its tokens, in padded tokens' worth: the price
# `prefill_groups` weighs padding against (docs/serving.md).
PREFILL_CALL_TOKENS = 128


def prefill_groups(lengths: list[int], call_tokens: int = PREFILL_CALL_TOKENS) -> list[list[int]]:
    """Split rows with lengths[i] tokens to feed into groups prefilled together, each padded
    to its longest row, so that padded tokens plus `call_tokens` per group are fewest.
    Rows are grouped in length order (an optimal split of sorted lengths is contiguous);
    rows with nothing to feed are left out. Returns lists of row indices, shortest first."""
    order = sorted((i for i, n in enumerate(lengths) if n > 0), key=lambda i: lengths[i])
    n = len(order)
    # best[k]: the least cost of the first k sorted rows; cut[k]: where its last group starts
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)
    for k in range(1, n + 1):
        longest = lengths[order[k - 1]]
        for j in range(k):
            cost = best[j] + (k - j) * longest + call_tokens
            if cost < best[k]:
                best[k], cut[k] = cost, j
    groups, k = [], n
    while k > 0:
        groups.append(order[cut[k]:k])
        k = cut[k]
    return groups[::-1]


@dataclass
class Prefilled:
    """What a prefill produced, per request of its batch."""

    first_ids: list[int | None]                      # the first output token (None: recomputed)
    first_logprobs: list[list[dict[int, float]] | None]   # its logprob dict, where asked for
    last_logits: list[torch.Tensor]                  # [V] the target's logits after the last fed token
    seconds: float


class ModelRunner:
    def __init__(self, model: Transformer, cache: PagedState, executor: Executor, drafter: Drafter | None,
                 prefill_chunk_size: int = 256):
        self.model, self.cache, self.executor, self.drafter = model, cache, executor, drafter
        self.cfg = model.cfg
        self.chunk = prefill_chunk_size
        self.prefill_call_tokens = PREFILL_CALL_TOKENS
        self.device = model.embed.weight.device
        self.sync = self.device.type == "cuda"
        self.speculative = SpeculativeRound(executor, cache, drafter) if drafter is not None else None

    # -- lists -> tensors ---------------------------------------------------------------
    def _lengths(self, seqs: list[Sequence]) -> torch.Tensor:
        return torch.tensor([s.num_committed for s in seqs], dtype=torch.long, device=self.device)

    def sampling(self, seqs: list[Sequence]) -> SamplingBatch:
        """Each request's temperature [B] (0 = greedy), top-p, top-k and min-p [B], seed,
        logprobs, and the rules its logits go through first (`logits_process`)."""
        params = [s.params for s in seqs]
        rules = LogitsRules.build(
            self.cfg.vocab_size, num_output=[len(s.output_ids) for s in seqs],
            logit_bias=[p.logit_bias for p in params], min_tokens=[p.min_tokens for p in params],
            stop_ids=[s.stop_ids for s in seqs],
            penalties=[(p.presence_penalty, p.frequency_penalty, p.repetition_penalty) for p in params],
            output_ids=[s.output_ids for s in seqs], prompt_ids=[s.prompt_ids for s in seqs])
        top_k = [max(p.top_k, 0) for p in params]
        min_p = [p.min_p for p in params]
        return SamplingBatch(temperature=torch.tensor([p.sampling_temperature for p in params], dtype=torch.float64),
                             top_p=torch.tensor([p.top_p for p in params], dtype=torch.float64),
                             seeds=[s.seed for s in seqs],
                             num_logprobs=[p.logprobs for p in params],
                             top_k=torch.tensor(top_k, dtype=torch.long) if any(top_k) else None,
                             min_p=torch.tensor(min_p, dtype=torch.float64) if any(min_p) else None,
                             rules=rules)

    def batch(self, seqs: list[Sequence]) -> RoundBatch:
        return RoundBatch(seq_ids=[s.seq_id for s in seqs], lengths=self._lengths(seqs),
                          roots=torch.tensor([s.root_id for s in seqs], device=self.device),
                          budget=torch.tensor([s.num_remaining for s in seqs], device=self.device),
                          sampling=self.sampling(seqs))

    # -- prefill ------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, seqs: list[Sequence], follow: bool, defer: bool = False) -> Prefilled:
        """Feed every token before each root through the target, in chunks, sequences of
        similar lengths together (`prefill_groups`: each group padded to its longest
        chunk; one group for all of them pads a 13-token prompt to a 157-token one's
        length). Pages must have been reserved.

        follow: the drafter follows (speculative rounds may come): each chunk goes through
        it too, or, with `defer`, joins its lag (fed only if a speculative round comes).

        A new request has no root yet: all its prompt tokens are fed and its first output
        token is sampled from the logits at the last one. A recomputed (preempted) request
        feeds everything but its root, and gets None. A request that asked for
        prompt_logprobs and has none yet gets them here, chunk by chunk, from the logits at
        every prompt position (the others' are never touched); a recomputed request
        already has them.

        """
        t0 = time.perf_counter()
        ends = [len(s.token_ids) - (1 if s.output_ids else 0) for s in seqs]
        done = [s.num_committed for s in seqs]       # committed so far (the counters move later)
        last_logits: list[torch.Tensor | None] = [None] * len(seqs)
        prompt_lps = {i: [None] for i, s in enumerate(seqs)
                      if s.params.prompt_logprobs is not None and s.prompt_logprobs is None}
        prompt_ranks = {i: [None] for i in prompt_lps}
        for group in prefill_groups([e - d for e, d in zip(ends, done)], self.prefill_call_tokens):
            self._prefill_group(seqs, group, ends, done, follow, defer, last_logits, prompt_lps, prompt_ranks)
        for i, lps in prompt_lps.items():
            seqs[i].prompt_logprobs, seqs[i].prompt_ranks = lps, prompt_ranks[i]
        firsts, first_lps = self._first_tokens(seqs, last_logits)
        return Prefilled(firsts, first_lps, last_logits, time.perf_counter() - t0)

    def _prefill_group(self, seqs: list[Sequence], group: list[int], ends: list[int], done: list[int], follow: bool,
                       defer: bool, last_logits: list, prompt_lps: dict[int, list], prompt_ranks: dict[int, list]
                       ) -> None:
        """Feed seqs[i] for i in `group` from done[i] to ends[i], chunk by chunk (moving
        done, filling last_logits and the prompt logprobs asked for)."""
        while active := [i for i in group if done[i] < ends[i]]:
            fed = [seqs[i] for i in active]
            ids = [s.seq_id for s in fed]
            L = torch.tensor([done[i] for i in active], dtype=torch.long, device=self.device)
            counts = [min(self.chunk, ends[i] - done[i]) for i in active]
            N = max(counts)
            tokens = torch.full((len(fed), N), self.cfg.pad_token_id, dtype=torch.long)
            for j, (i, n) in enumerate(zip(active, counts)):
                tokens[j, :n] = torch.tensor(seqs[i].token_ids[done[i]:done[i] + n])
            tokens = tokens.to(self.device)
            meta = chain_meta(L, torch.tensor(counts, device=self.device), self.cfg.compressed_kinds, max_new=N)
            # Logits at every position only where prompt logprobs are asked for; else at
            # each row's last fed token.
            every = any(i in prompt_lps for i in active)
            at = None if every else torch.tensor([n - 1 for n in counts], device=self.device)
            out = self.executor.prefill(tokens, meta, ids, L, logits_at=at)
            self.cache.commit(ids, meta, out.scratch, meta.valid)
            if follow:
                self.drafter.follow(ids, L, tokens, out.hidden, counts, now=not defer)
            if prompt_lps:
                self._collect_prompt_logprobs(seqs, active, done, counts, out.logits, prompt_lps, prompt_ranks)
            for j, (i, n) in enumerate(zip(active, counts)):
                done[i] += n
                last_logits[i] = out.logits[j, n - 1 if every else 0]

    def _first_tokens(self, seqs: list[Sequence], logits: list[torch.Tensor | None]
                      ) -> tuple[list[int | None], list[list[dict[int, float]] | None]]:
        """Sample each new request's first output token from its prompt's last logits [V]
        (recomputed requests already have their root, and max_tokens 0 asks for none: None)."""
        fresh = [i for i, s in enumerate(seqs) if not s.output_ids and s.params.max_tokens > 0]
        firsts: list[int | None] = [None] * len(seqs)
        lps: list[list[dict[int, float]] | None] = [None] * len(seqs)
        if not fresh:
            return firsts, lps
        rows = torch.stack([logits[i] for i in fresh])                       # [F, V]
        sampling = self.sampling([seqs[i] for i in fresh])
        # The first output token sits at the prompt's length.
        positions = torch.tensor([[len(seqs[i].prompt_ids)] for i in fresh])  # [F, 1]
        drawn = target_tokens(process_logits(rows[:, None], sampling.rules, NodePaths.single(len(fresh))),
                              sampling, positions)[:, 0].tolist()
        for i, t in zip(fresh, drawn):
            firsts[i] = t
        want = [r for r, i in enumerate(fresh) if seqs[i].params.logprobs is not None]
        if want:
            dicts = logprob_dicts(rows[want], [drawn[r] for r in want], [seqs[fresh[r]].params.logprobs for r in want])
            for r, d in zip(want, dicts):
                lps[fresh[r]] = [d]
        return firsts, lps

    @staticmethod
    def _collect_prompt_logprobs(seqs: list[Sequence], active: list[int], done: list[int], counts: list[int],
                                 logits: torch.Tensor, prompt_lps: dict[int, list], prompt_ranks: dict[int, list]
                                 ) -> None:
        """Extend prompt_lps[i] with this chunk's prompt positions: logits [B, N, V] at
        position p (of seqs[active[j]], chunk starting at done[i]) score prompt token p + 1.
        prompt_ranks[i] gets each prompt token's vocabulary rank there (vLLM's: 1 + the
        number of other tokens at least as likely)."""
        rows, targets, num_top, owners = [], [], [], []
        for j, (i, n) in enumerate(zip(active, counts)):
            if i not in prompt_lps:
                continue
            s = seqs[i]
            c = done[i]
            m = min(n, len(s.prompt_ids) - 1 - c)   # the last prompt position scores an output token
            if m <= 0:
                continue
            rows.append(logits[j, :m])
            targets.extend(s.prompt_ids[c + 1:c + 1 + m])
            num_top.extend([s.params.prompt_logprobs] * m)
            owners.append((i, m))
        if not rows:
            return
        rows = torch.cat(rows)                                                    # [M, V]
        dicts = logprob_dicts(rows, targets, num_top)
        chosen = rows.gather(-1, torch.tensor(targets, device=rows.device)[:, None])   # [M, 1]
        ranks = (rows >= chosen).sum(-1).tolist()
        start = 0
        for i, m in owners:
            prompt_lps[i].extend(dicts[start:start + m])
            prompt_ranks[i].extend(ranks[start:start + m])
            start += m

    # -- one step -----------------------------------------------------------------------
    def step(self, seqs: list[Sequence], spec: SpecConfig | None, follow: bool, learn: bool = False) -> RoundResult:
        """A plain decode step (spec None) or a speculative round of `spec` over the batch.
        follow: plain steps feed the drafter's lag (speculative rounds may come later);
        learn: a speculative round teaches the measured acceptance (see `SpeculativeRound.run`)."""
        batch = self.batch(seqs)
        if spec is None:
            return self.decode(batch, follow)
        return self.speculative.run(batch, spec, learn)

    @torch.no_grad()
    def decode(self, batch: RoundBatch, follow: bool) -> RoundResult:
        """Feed each root through the target; emit the next token of each request."""
        t0 = time.perf_counter()
        clock = PhaseClock(self.sync)
        ids, L = batch.seq_ids, batch.lengths
        roots = batch.roots[:, None]                                          # [B, 1]
        # Where some request samples and every one is decoded by the argmax or its
        # temperature alone, the step draws the tokens in its own call.
        untouched = batch.sampling.untouched()
        draws = node_draws(batch.sampling, untouched, L, 1, L.device) if bool(untouched.all()) else None
        with one_row_products(batch.size, L.device):     # one row a product: MKL on one thread
            if draws is None:
                out = self.executor.decode(roots, ids, L)      # fed through the target and committed
            else:
                out, tokens = self.executor.decode_and_draw(roots, ids, L, draws)
        if draws is None:
            logits = process_logits(out.logits, batch.sampling.rules, NodePaths.single(batch.size))   # [B, 1, V]
            # The root sits at position L: the token drawn is at L + 1.
            tokens = target_tokens(logits, batch.sampling, L[:, None] + 1)
        emitted = [[t] for t in tokens[:, 0].tolist()]
        if follow:
            self.drafter.follow(ids, L, roots, out.hidden, [1] * batch.size, now=False)
        nodes = torch.zeros(batch.size, 1, dtype=torch.long)
        logprobs = emitted_logprobs(out.logits, nodes, emitted, batch.sampling.num_logprobs)
        clock.lap("verify")     # a plain step is its target forward and its tokens, as a round's verify is
        return RoundResult(spec=None, emitted=emitted, path_len=[1] * batch.size, logprobs=logprobs,
                           phase_seconds=clock.seconds, seconds=time.perf_counter() - t0)
