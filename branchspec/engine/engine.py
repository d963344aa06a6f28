"""The engine loop: admit and prefill requests, then run decode or speculative rounds over
the running batch (continuous batching) until every request finishes."""

from __future__ import annotations

import itertools
import secrets
import time
from typing import TYPE_CHECKING, Callable

import torch

from branchspec.cache.paged import PagedState
from branchspec.cache.pool import OutOfPages
from branchspec.config import AutoPolicy, EngineConfig, SamplingParams, SpecConfig
from branchspec.engine.request import FinishReason, Sequence
from branchspec.engine.runner import ModelRunner
from branchspec.engine.sampler import logprob_dicts, target_tokens
from branchspec.engine.scheduler import Scheduler
from branchspec.model.model import Transformer
from branchspec.spec.drafter import MTPDrafter

if TYPE_CHECKING:
    from branchspec.spec.policy import SpecPolicyRunner


class Engine:
    def __init__(self, model: Transformer, config: EngineConfig | None = None,
                 decode: Callable[[list[int]], str] | None = None, seed: int | None = None,
                 stop_token_ids: tuple[int, ...] = ()):
        self.model = model.eval()
        self.config = config or EngineConfig()
        self.cfg = model.cfg
        self.max_len = self.config.max_model_len if self.config.max_model_len is not None else self.cfg.max_position
        if self.max_len > self.cfg.max_position:
            raise ValueError(f"max_model_len {self.max_len} exceeds the model's max_position {self.cfg.max_position}")
        p = model.embed.weight
        self.cache = PagedState(self.cfg, max_seqs=self.config.max_batch_size, max_len=self.max_len,
                                page_size=self.config.page_size, dtype=p.dtype, device=p.device,
                                num_pages=self.config.num_pages)
        drafter = MTPDrafter(model) if model.mtp else None
        self.runner = ModelRunner(model, self.cache, drafter, self.config.prefill_chunk_size,
                                  compile=self.config.compile)
        self.scheduler = Scheduler(self.config.max_batch_size)
        self.decode = decode
        # EOS always ends a request (unless ignore_eos); a tokenizer may add its turn-end token.
        self.stop_token_ids = {self.cfg.eos_token_id, *stop_token_ids}
        self._ids = itertools.count()
        self.num_steps = 0  # decode steps / speculative rounds run over the batch
        # Unseeded requests draw their seeds from here: a fixed engine seed makes a whole run
        # reproducible, None (the default) makes every run differ.
        self._seed_rng = torch.Generator().manual_seed(seed if seed is not None else secrets.randbits(63))
        # Adaptive speculation: one runner per policy, kept for the engine's life so its
        # acceptance and cost estimates carry over from call to call.
        self._policies: dict[AutoPolicy, "SpecPolicyRunner"] = {}

    def policy_runner(self, policy: AutoPolicy, progress: bool = False) -> "SpecPolicyRunner":
        """The runner of `policy` on this engine (calibrating round costs the first time)."""
        from branchspec.spec.policy import SpecPolicyRunner, load_or_calibrate

        runner = self._policies.get(policy)
        if runner is None:
            costs = load_or_calibrate(self.model, self.config.max_batch_size, progress=progress)
            runner = self._policies[policy] = SpecPolicyRunner(policy, costs)
        return runner

    # -- requests ---------------------------------------------------------------------
    def check_spec(self, spec: SpecConfig | AutoPolicy | None) -> None:
        """Can this engine's model speculate with `spec`? ValueError naming what is missing."""
        if spec is None:
            return
        if not isinstance(spec, (SpecConfig, AutoPolicy)):
            raise TypeError(f"spec must be a SpecConfig, SpecConfig.auto(...) or None, got {type(spec).__name__}")
        if isinstance(spec, AutoPolicy) and not spec.speculative:
            return
        if self.runner.drafter is None:
            raise ValueError("speculative decoding needs a drafter, and this checkpoint has no MTP "
                             "block (num_mtp_layers=0); decode plainly (spec=None, or --speculative-algorithm NONE)")
        spec.check_model(self.cfg.vocab_size)

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
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_len:
            raise ValueError(f"{name} of {len(prompt_ids)} tokens + max_tokens {params.max_tokens} exceeds "
                             f"max_model_len {self.max_len}")
        if not self.cache.fits_alone(total):
            raise ValueError(f"{name}: a request of {total} tokens needs more pages than the cache has "
                             f"({self.cache.pages_needed(total)} needed, pools hold "
                             f"{ {n: p.num_pages for n, p in self.cache.pools.items()} }); raise num_pages")

    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Sequence:
        self.validate(prompt_ids, params)
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2**62, (1,), generator=self._seed_rng))
        seq = Sequence(seq_id=next(self._ids), prompt_ids=list(prompt_ids), params=params,
                       generator=torch.Generator().manual_seed(seed))
        seq.arrival = seq.seq_id
        self.scheduler.add(seq)
        return seq

    # -- loop -------------------------------------------------------------------------
    def step(self, spec: SpecConfig | AutoPolicy | None) -> list[Sequence]:
        """Admit what fits, then one decode step or speculative round. Returns the requests
        that finished in this step (their pages are already back in the pools).

        With an AutoPolicy the round's configuration is chosen here, after admission and
        before pages are reserved, and the round's outcome is fed back to the policy."""
        self.check_spec(spec)
        policy = self.policy_runner(spec) if isinstance(spec, AutoPolicy) else None
        done = self._admit(spec)
        if not self.scheduler.running:
            return done
        if policy is not None:
            # Reserve for the largest candidate first: preemption must settle the batch
            # before the choice, which depends on it.
            self._reserve_round(spec.max_draft_tokens)
            running = self.scheduler.running
            context = sum(s.num_committed for s in running) / len(running)
            chosen = policy.choose([s.seq_id for s in running], lag=[len(s.drafter_lag) for s in running],
                                   remaining=[s.num_remaining for s in running], context=context)
        else:
            chosen = spec
            self._reserve_round(1 if spec is None else spec.num_draft_tokens)
        running = list(self.scheduler.running)
        self.num_steps += 1
        t0 = time.perf_counter()
        if chosen is None:
            result = self.runner.decode_step(running, track_drafter=policy is not None and bool(spec.speculative))
        else:
            result = self.runner.spec_round(running, chosen)
        if policy is not None:
            # The round's own time: feeding the drafter what plain rounds committed is a
            # cost of having switched, not of this configuration.
            seconds = time.perf_counter() - t0 - (self.runner.last_catch_up_seconds if chosen else 0.0)
            policy.observe(chosen, [s.seq_id for s in running], seconds,
                           result.path_children, result.path_targets, result.path_len, context=context)
        logprobs = result.logprobs or [None] * len(running)
        for seq, toks, lps in zip(running, result.emitted, logprobs):
            self._append(seq, toks, lps)
            if seq.finished:
                self._release(seq)
                done.append(seq)
        return done

    def _admit(self, spec: SpecConfig | None) -> list[Sequence]:
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
        if isinstance(spec, AutoPolicy):
            # The drafter's prefill runs with the target's, as a fixed configuration's does,
            # unless the policy expects plain decoding to win at this batch size: then each
            # prompt joins its request's drafter lag, fed only if a speculative round comes.
            running = self.scheduler.running
            context = sum(len(s.token_ids) for s in running) / len(running)
            defer = None in spec.candidates and bool(spec.speculative) and \
                not self.policy_runner(spec).expects_speculation(len(running), context)
            logits = self.runner.prefill(admitted, with_mtp=bool(spec.speculative) and not defer, lag_mtp=defer)
        else:
            logits = self.runner.prefill(admitted, with_mtp=spec is not None)
        # Recomputed requests (preempted) already have their root: only new ones sample.
        fresh = [(seq, lg) for seq, lg in zip(admitted, logits) if not seq.output_ids]
        firsts = [int(target_tokens(lg[None, None], *self.runner.sampling([seq]))[0, 0]) for seq, lg in fresh]
        want = [r for r, (seq, _) in enumerate(fresh) if seq.params.logprobs is not None]
        first_lps = [None] * len(fresh)
        if want:
            dicts = logprob_dicts(torch.stack([fresh[r][1] for r in want]), [firsts[r] for r in want],
                                  [fresh[r][0].params.logprobs for r in want])
            for r, d in zip(want, dicts):
                first_lps[r] = [d]
        done = []
        for (seq, _), first, lps in zip(fresh, firsts, first_lps):
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
                self.cache.free(victim.seq_id)
                victim.forget_state()

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict[int, float]] | None = None) -> None:
        """Add emitted tokens (with their logprob dicts, when asked for) up to the first stop."""
        for i, t in enumerate(tokens):
            seq.output_ids.append(t)
            if logprobs is not None:
                seq.logprobs.append(logprobs[i])
            if t in self.stop_token_ids and not seq.params.ignore_eos:
                seq.finish_reason = FinishReason.STOP
                return
            if seq.params.stop and self.decode is not None:
                text = self.decode(seq.output_ids)
                hits = [text.find(s) for s in seq.params.stop if s in text]
                if hits:
                    seq.output_text = text[: min(hits)]
                    seq.finish_reason = FinishReason.STOP
                    return
            if seq.num_remaining <= 0:
                seq.finish_reason = FinishReason.LENGTH
                return

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finished(seq)
        self.cache.free(seq.seq_id)
        for policy in self._policies.values():
            policy.forget(seq.seq_id)
        if self.decode is not None and seq.output_text is None:
            seq.output_text = self.decode(seq.output_ids)

    def abort(self, seq: Sequence) -> None:
        """Take a request out wherever it is (queued or running) and return its pages.
        Finished requests are left as they are."""
        if seq.finished:
            return
        if seq in self.scheduler.waiting:
            self.scheduler.waiting.remove(seq)
        elif seq in self.scheduler.running:
            self.scheduler.finished(seq)
        if seq.seq_id in self.cache.tables:
            self.cache.free(seq.seq_id)
        for policy in self._policies.values():
            policy.forget(seq.seq_id)
        seq.finish_reason = FinishReason.ABORT
        if self.decode is not None and seq.output_text is None:
            seq.output_text = self.decode(seq.output_ids)

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
        if seq.seq_id in self.cache.tables:
            self.cache.free(seq.seq_id)
        seq.forget_state()

    def run(self, spec: SpecConfig | AutoPolicy | None, progress: Callable[[int], None] | None = None) -> list[Sequence]:
        finished = []
        while self.scheduler.has_work():
            done = self.step(spec)
            finished.extend(done)
            if progress is not None and done:
                progress(len(done))
        return finished
