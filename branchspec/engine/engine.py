"""The engine loop: admit and prefill requests, then one decode step or speculative round
over the running batch (continuous batching), until every request finishes.

`step` has nano-vllm's shape: schedule (admit what fits, reserve pages, the policy
chooses the round's configuration), run (the runner), postprocess (apply what the step
produced to each request, release the finished ones).
"""

from __future__ import annotations

import itertools
import secrets
from collections import defaultdict
from typing import Callable

import torch

from branchspec.cache.paged import PagedState
from branchspec.cache.pool import OutOfPages
from branchspec.config import AutoPolicy, EngineConfig, SamplingParams, SpecConfig
from branchspec.engine.request import FinishReason, Sequence
from branchspec.engine.runner import ModelRunner
from branchspec.engine.scheduler import Scheduler
from branchspec.execution import Executor, make_executor
from branchspec.model.model import Transformer
from branchspec.speculative.calibration import GREEDY, SAMPLED
from branchspec.speculative.draft_vocab import DraftVocab
from branchspec.speculative.drafter import MTPDrafter
from branchspec.speculative.footprint import RoundLimits, available_memory, check_pool_memory
from branchspec.speculative.policy import BatchView, SpecPolicy, make_policy
from branchspec.speculative.outcome import RoundResult


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None,
                 decode: Callable[[list[int], bool], str] | None = None, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = (), draft_vocab: DraftVocab | None = None,
                 executor: Callable[[Transformer, PagedState], Executor] | None = None):
        """draft_vocab: the tokens the drafter may propose (a reduced draft vocabulary);
        None: all of them. executor: builds the execution over the engine's paged state
        (None: the one `config` asks for, `execution.make_executor`)."""
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.cfg = model.cfg
        self.max_len = self.config.max_model_len if self.config.max_model_len is not None else self.cfg.max_position
        if self.max_len > self.cfg.max_position:
            raise ValueError(f"max_model_len {self.max_len} exceeds the model's max_position {self.cfg.max_position}")
        p = model.embed.weight
        # Sized by the user (max_batch_size, max_model_len): refused by name before allocating.
        check_pool_memory(self.cfg, max_batch_size=self.config.max_batch_size, max_len=self.max_len,
                          page_size=self.config.page_size, dtype_bytes=p.element_size(),
                          num_pages=dict(self.config.num_pages), available_bytes=available_memory(p.device),
                          device=str(p.device), max_len_given=self.config.max_model_len is not None)
        self.cache = PagedState(self.cfg, max_seqs=self.config.max_batch_size, max_len=self.max_len,
                                page_size=self.config.page_size, dtype=p.dtype, device=p.device,
                                num_pages=dict(self.config.num_pages))
        chunk = self.config.prefill_chunk_size
        self.executor = (executor(model, self.cache) if executor is not None
                         else make_executor(model, self.cache, self.config.compile, self.config.uses_cuda_graphs))
        self.drafter = MTPDrafter(model, self.cache, self.executor, chunk, draft_vocab) if model.mtp else None
        self.runner = ModelRunner(model, self.cache, self.executor, self.drafter, chunk)
        self.scheduler = Scheduler(self.config.max_batch_size)
        self.decode = decode
        # EOS always ends a request (unless ignore_eos); a tokenizer may add its turn-end token.
        self.stop_token_ids = {self.cfg.eos_token_id, *stop_token_ids}
        self._ids = itertools.count()
        self.num_steps = 0          # decode steps and speculative rounds run over the batch
        self.num_spec_rounds = 0    # of them, speculative rounds
        self.num_preemptions = 0    # requests put back to make room (recomputed later)
        # Wall time per phase (prefill, then `ROUND_PHASES`), summed until reset.
        self.phase_seconds: defaultdict[str, float] = defaultdict(float)
        # Unseeded requests draw their seeds from here: a fixed engine seed makes a whole run
        # reproducible, None (the default) makes every run differ.
        self._seed_rng = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        # One policy per spec value, kept for the engine's life, so an adaptive one's
        # acceptance and cost estimates carry over from call to call.
        self._policies: dict = {}

    def policy(self, spec: SpecConfig | AutoPolicy | None, progress: bool = False) -> SpecPolicy:
        """The policy `spec` asks for on this engine, checked against the model first
        (TypeError or ValueError naming what is wrong). An adaptive policy measures (or
        loads) its round costs when it is made; `progress` shows that measurement."""
        try:
            policy = self._policies.get(spec)
        except TypeError:     # unhashable: not a spec at all, and make_policy says so
            policy = None
        if policy is None:
            from branchspec.speculative.profiling import load_or_calibrate

            def costs(auto: AutoPolicy, show: bool = progress):
                return load_or_calibrate(self.executor, self.config.max_batch_size, auto.candidates, progress=show,
                                         vocab=self.drafter.vocab if self.drafter is not None else None)

            policy = make_policy(spec, costs, self.drafter.calibration if self.drafter is not None else None)
            policy.check(self.cfg, self.drafter is not None, self.round_limits())
            for c in policy.configurations:
                if c is not None:
                    self.drafter.check(c)
            policy.prepare(progress)
            self._policies[spec] = policy
        return policy

    def round_limits(self) -> RoundLimits:
        """What a speculative round may use here: the largest batch, the longest request,
        the model's float size and the device's free memory now."""
        p = self.model.embed.weight
        return RoundLimits(max_batch_size=self.config.max_batch_size, max_len=self.max_len,
                           dtype_bytes=p.element_size(), available_bytes=available_memory(p.device),
                           device=str(p.device))

    # -- requests ---------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        """Refuse a request that can never run, naming it (`name`) and what is allowed."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params for {name} must be a SamplingParams, got {type(params).__name__}")
        if len(prompt_ids) == 0:
            raise ValueError(f"{name} is empty: give at least one token")
        V = self.cfg.vocab_size
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"{name} has token ids outside the vocabulary [0, {V}): {bad[:5]}")
        for param in ("logprobs", "prompt_logprobs"):
            k = getattr(params, param)
            if k is not None and k > V:
                raise ValueError(f"SamplingParams.{param}={k} for {name} exceeds the model's vocabulary of "
                                 f"{V} tokens; use {param} <= {V}")
        for param, ids in (("stop_token_ids", params.stop_token_ids),
                           ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if t >= V]
            if bad:
                raise ValueError(f"SamplingParams.{param} for {name} has token ids outside the vocabulary "
                                 f"[0, {V}): {bad[:5]}")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_len:
            raise ValueError(f"{name} of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {self.max_len}")
        if not self.cache.fits_alone(total):
            raise ValueError(f"{name}: a request of {total} tokens needs more pages than the cache has "
                             f"({self.cache.pages_needed(total)} needed, pools hold "
                             f"{ {n: p.num_pages for n, p in self.cache.pools.items()} }); raise num_pages")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        """Queue one single-sample request (params.n == 1: expand n with `params.choices()`)."""
        self.validate(prompt_ids, params)
        if params.n != 1:
            raise ValueError(f"SamplingParams.n={params.n}: the engine runs one sample per request; add "
                             "each of params.choices() (LLM.generate does)")
        # An unseeded request takes its seed from the engine's stream, once, here.
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.stop_token_ids
        seq = Sequence(seq_id=next(self._ids), prompt_ids=list(prompt_ids), params=params, seed=seed,
                       stop_ids=stop_ids)
        seq.arrival = seq.seq_id
        self.scheduler.add(seq)
        return seq

    # -- loop -------------------------------------------------------------------------
    def step(self, spec: SpecConfig | AutoPolicy | None) -> list[Sequence]:
        """Admit what fits, then one decode step or speculative round. Returns the requests
        that finished in this step (their pages are already back in the pools)."""
        policy = self.policy(spec)
        done = self._admit(policy)
        if not self.scheduler.running:
            return done
        # Pages for the most a round of this policy commits, before it chooses: preemption
        # must settle the batch first, since the choice depends on it.
        self._reserve_round(policy.max_draft_tokens)
        running = list(self.scheduler.running)
        batch = self._view(running)
        chosen = policy.choose(batch)
        self.num_steps += 1
        result = self.runner.step(running, chosen, follow=policy.uses_drafter, learn=policy.reads_acceptance)
        policy.observe(batch, result)
        self.num_spec_rounds += result.spec is not None
        return done + self._postprocess(running, result)

    def _admission_view(self, admitted: list[Sequence]) -> BatchView:
        """The running batch as the next round will see it, with each admitted request's
        prompt (prefilled now) as the drafter's lag, were it not fed with the prefill."""
        running = list(self.scheduler.running)
        view = self._view(running)
        new = {s.seq_id: len(s.token_ids) for s in admitted}
        lag = [new.get(s.seq_id, n) for s, n in zip(running, view.lag)]
        context = sum(len(s.token_ids) for s in running) / len(running)
        return BatchView(seq_ids=view.seq_ids, lag=lag, remaining=view.remaining, context=context, modes=view.modes)

    def _view(self, running: list[Sequence]) -> BatchView:
        lag = self.drafter.lag if self.drafter is not None else (lambda seq_id: 0)
        return BatchView(seq_ids=[s.seq_id for s in running], lag=[lag(s.seq_id) for s in running],
                         remaining=[s.num_remaining for s in running],
                         context=sum(s.num_committed for s in running) / len(running),
                         modes=[SAMPLED if s.params.sampling_temperature > 0 else GREEDY for s in running])

    def _postprocess(self, running: list[Sequence], result: RoundResult) -> list[Sequence]:
        """Apply a step to its requests: committed lengths, speculative statistics, emitted
        tokens (up to a stop); release those that finished."""
        for phase, seconds in result.phase_seconds.items():
            self.phase_seconds[phase] += seconds
        done = []
        logprobs = result.logprobs or [None] * len(running)
        for seq, n, toks, lps in zip(running, result.path_len, result.emitted, logprobs):
            seq.num_committed += n
            if result.spec is not None:
                seq.stats.record(n, result.spec.num_draft_tokens)
            self._append(seq, toks, lps)
            if seq.finished:
                self._release(seq)
                done.append(seq)
        return done

    def _admit(self, policy: SpecPolicy) -> list[Sequence]:
        """Admit waiting requests while pages and batch slots last; prefill them together."""
        admitted = []
        while (seq := self.scheduler.next_admission()) is not None:
            need = len(seq.token_ids) - (1 if seq.output_ids else 0)
            try:
                self.cache.add(seq.seq_id)
            except OutOfPages:
                if not self.scheduler.running:
                    raise
                break
            try:
                self.cache.reserve(seq.seq_id, need)
            except OutOfPages:
                self.cache.free(seq.seq_id)
                if not self.scheduler.running:  # nothing will ever free pages for it
                    raise
                break
            self.scheduler.admitted(seq)
            admitted.append(seq)
        if not admitted:
            return []
        defer = policy.uses_drafter and policy.defer_drafter(self._admission_view(admitted))
        out = self.runner.prefill(admitted, follow=policy.uses_drafter, defer=defer)
        self.phase_seconds["prefill"] += out.seconds
        done = []
        for seq, first, lps in zip(admitted, out.first_ids, out.first_logprobs):
            seq.num_committed = len(seq.token_ids) - (1 if seq.output_ids else 0)
            if seq.params.max_tokens == 0:     # it only scored its prompt
                seq.finish_reason = FinishReason.LENGTH
                self._release(seq)
                done.append(seq)
                continue
            if first is None:     # recomputed after preemption: its root is already there
                continue
            self._append(seq, [first], lps)
            if seq.finished:
                self._release(seq)
                done.append(seq)
        return done

    def _reserve_round(self, num_nodes: int) -> None:
        """Pages for every running request's round; preempt the newest until they fit.

        A round commits at most `num_nodes` tokens and never past the request's own budget
        (prompt + max_tokens, which `validate` checked fits alone), so any request that fits
        without speculation also fits with it.
        """
        while True:
            try:
                for seq in self.scheduler.running:
                    self.cache.reserve(seq.seq_id, min(seq.num_committed + num_nodes, seq.max_len))
                return
            except OutOfPages:
                if len(self.scheduler.running) == 1:
                    raise
                victim = self.scheduler.preempt()
                self.num_preemptions += 1
                self._drop_state(victim)

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None = None) -> None:
        """Add emitted tokens (with their logprob dicts, when asked for) up to the first stop.

        A stop id ends the output, kept in output_ids but not in the text (vLLM v1). Stop
        strings are looked for once min_tokens tokens are out, and never cut into their
        text. (No stop id comes before min_tokens: the sampler bans them.)
        """
        params = seq.params
        for i, t in enumerate(tokens):
            seq.output_ids.append(t)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if t in seq.stop_ids and len(seq.output_ids) > params.min_tokens:
                seq.finish_reason = FinishReason.STOP
                seq.stop_reason = t if t in params.stop_token_ids else None
                if self.decode is not None:
                    kept = seq.output_ids if params.include_stop_str_in_output else seq.output_ids[:-1]
                    seq.output_text = self._text(seq, kept)
                return
            if params.stop and self.decode is not None and len(seq.output_ids) >= params.min_tokens:
                text = self._text(seq, seq.output_ids)
                start = len(self._text(seq, seq.output_ids[:params.min_tokens])) if params.min_tokens else 0
                hits = sorted((at, s) for s in params.stop if (at := text.find(s, start)) >= 0)
                if hits:
                    at, stop = hits[0]
                    seq.output_text = text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                    seq.finish_reason = FinishReason.STOP
                    seq.stop_reason = hits[0][1]
                    return
            if seq.num_remaining <= 0:
                seq.finish_reason = FinishReason.LENGTH
                return

    def _text(self, seq: Sequence, ids: list[int]) -> str:
        """The text of a request's output ids, special tokens included only if it asked."""
        return self.decode(ids, seq.params.skip_special_tokens)

    def _free(self, seq: Sequence) -> None:
        """Return a request's pages; its drafter state goes with them."""
        if seq.seq_id in self.cache.tables:
            self.cache.free(seq.seq_id)
        if self.drafter is not None:
            self.drafter.forget(seq.seq_id)

    def _drop_state(self, seq: Sequence) -> None:
        """`_free`, and forget everything derived from the cached state: the request is
        recomputed from its tokens when it runs again (preemption, a failed step)."""
        self._free(seq)
        seq.forget_state()

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finished(seq)
        self._free(seq)
        for policy in self._policies.values():
            policy.forget(seq.seq_id)
        if self.decode is not None and seq.output_text is None:
            seq.output_text = self._text(seq, seq.output_ids)

    def abort(self, seq: Sequence) -> None:
        """Take a request out wherever it is (queued or running) and return its pages.
        Finished requests are left as they are."""
        if seq.finished:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        elif seq in self.scheduler.running:
            self.scheduler.finished(seq)
        self._free(seq)
        for policy in self._policies.values():
            policy.forget(seq.seq_id)
        seq.finish_reason = FinishReason.ABORT
        if self.decode is not None and seq.output_text is None:
            seq.output_text = self._text(seq, seq.output_ids)

    def requeue(self, seq: Sequence) -> None:
        """Put an unfinished request back at the front of the queue with no cached state,
        as preemption does: its pages return to the pools and it is recomputed from its
        tokens when admitted again. After a step that raised part-way, this makes a request
        safe to run again (the server retries each one alone to find which one failed)."""
        if seq.finished:
            return
        if seq in self.scheduler.running:
            self.scheduler.running.remove(seq)
        if seq not in self.scheduler.waiting:
            self.scheduler.waiting.appendleft(seq)
        self._drop_state(seq)

    def run(self, spec: SpecConfig | AutoPolicy | None, progress: Callable[[int], None] | None = None) -> list[Sequence]:
        finished = []
        while self.scheduler.has_work():
            done = self.step(spec)
            finished.extend(done)
            if progress is not None and done:
                progress(len(done))
        return finished
