"""The engine thread: one long-lived Engine, stepped in one background thread, off the
event loop.

The engine is not thread-safe, so only this thread touches it. The event loop hands over
requests, aborts and a cancel-everything through a thread-safe inbox, read between
rounds, so new requests join the running batch at the next round (continuous batching).
Each request's progress goes back as `Output`s on its own asyncio queue, through
`loop.call_soon_threadsafe`.

A step that raises is not blamed on the whole batch: every request it involved is put back
in the queue with no cached state (`Engine.requeue`), then each is run alone for one step;
the one that raises again fails, with an error for its client only, and the others carry on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from branchspec.config import SamplingParams, SpecConfig
from branchspec.engine.engine import Engine
from branchspec.engine.request import Sequence
from branchspec.serve.metrics import ServerMetrics
from branchspec.serve.textstream import IncrementalText

log = logging.getLogger("branchspec.serve")


@dataclass
class Alternative:
    token_id: int
    token: str
    bytes: bytes
    logprob: float | None             # None: the first prompt token, which nothing scores
    special: bool = False             # a special token: the output text never holds it
    rank: int | None = None           # its vocabulary rank, where known (prompt tokens)


@dataclass
class TokenLogprob(Alternative):
    top: list[Alternative] = field(default_factory=list)   # chosen and top-k, most likely first


@dataclass
class Output:
    """What one sample of a request got since its last Output. The last one has
    `finish_reason` (stop, length, abort) or `error` set."""

    index: int = 0                    # the sample's choice index in its HTTP request
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    # With the first Output, when the prompt's logprobs were asked for: one per prompt token.
    prompt_logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None          # the request failed in the engine
    cancelled: bool = False           # aborted by the server (shutdown), not by the client
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accept_length: float = 0.0
    num_rounds: int = 0
    num_emitted: int = 0              # tokens its verify rounds emitted

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Job:
    """One sample of an HTTP request: one engine request. The event loop creates it and
    reads `outputs` (shared by the samples of one HTTP request, told apart by `index`); the
    worker alone sets and reads everything below `outputs`."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, *, stream: bool, logprobs: bool,
                 loop: asyncio.AbstractEventLoop, outputs: asyncio.Queue | None = None, index: int = 0):
        self.prompt_ids, self.params = prompt_ids, params
        self.stream, self.logprobs = stream, logprobs
        self.loop = loop
        self.index = index
        self.outputs: asyncio.Queue[Output] = outputs if outputs is not None else asyncio.Queue()
        self.arrival = time.monotonic()
        self.counted = False       # event loop: its end is counted (metrics, in-flight)
        # worker-only
        self.seq: Sequence | None = None
        self.text: IncrementalText | None = None
        self.num_sent = 0          # output tokens already in an Output
        self.prompt_sent = params.prompt_logprobs is None   # the prompt's logprobs went out
        self.num_seen = 0          # output tokens already counted in the metrics
        self.rounds_seen = 0
        self.emitted_seen = 0
        self.drafted_seen = 0
        self.accepted_seen: list[int] = []    # per draft depth
        self.last_token_at: float | None = None

    def push(self, out: Output) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, out)
        except RuntimeError:   # the event loop is closed: nobody is listening any more
            pass


class EngineWorker:
    def __init__(self, engine: Engine, spec: SpecConfig | None, metrics: ServerMetrics, *,
                 decode: Callable[[list[int]], str] | None,
                 token_piece: Callable[[int], tuple[str, bytes, bool]]):
        self.engine, self.spec, self.metrics = engine, spec, metrics
        self.decode, self.token_piece = decode, token_piece
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs: dict[int, Job] = {}          # seq_id -> job, for every unfinished request
        self._suspects: list[Sequence] = []      # requests of a failed step, to retry alone
        self._thread = threading.Thread(target=self._run, name="branchspec-engine", daemon=True)
        self.error: BaseException | None = None  # set if the thread itself died
        self._preemptions_seen = engine.num_preemptions

    # -- event loop side -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        self._inbox.put(("add", job))

    def abort(self, job: Job) -> None:
        """The client went away: take the request out and free its pages before the next round."""
        self._inbox.put(("abort", job))

    def cancel_all(self) -> None:
        """End every request now, each with a last Output (finish_reason abort, cancelled)."""
        self._inbox.put(("cancel", None))

    def stop(self, timeout: float | None = None) -> None:
        """Cancel what is left and end the thread."""
        self._inbox.put(("stop", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._gauges()
            while self._read_inbox(block=not self._has_work()):
                if self._has_work():
                    self._step()
                self._gauges()
        except BaseException as e:   # a bug here must not leave clients waiting forever
            self.error = e
            log.exception("the engine thread died")
        finally:
            self._cancel_all(error=None if self.error is None else f"the engine stopped: {self.error!r}")
            try:
                self._gauges()
            except Exception:
                pass

    def _has_work(self) -> bool:
        return self.engine.scheduler.has_work()

    def _read_inbox(self, block: bool) -> bool:
        """Handle every waiting command (waiting for one if `block`); False on stop."""
        while True:
            try:
                kind, job = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            if kind == "stop":
                return False
            if kind == "add":
                self._add(job)
            elif kind == "abort":
                self._end(job, "abort")
            elif kind == "cancel":
                self._cancel_all()

    def _add(self, job: Job) -> None:
        try:
            job.seq = self.engine.add_request(job.prompt_ids, job.params)
        except Exception as e:   # checked before, so only a bug gets here
            log.exception("could not add a request")
            job.push(Output(index=job.index, error=f"{type(e).__name__}: {e}", prompt_tokens=len(job.prompt_ids)))
            return
        decode, skip = self.decode, job.params.skip_special_tokens
        job.text = IncrementalText(None if decode is None else (lambda ids: decode(ids, skip)), job.params.stop)
        self._jobs[job.seq.seq_id] = job
        self.metrics.prompt_tokens.inc(len(job.prompt_ids))

    def _step(self) -> None:
        engine = self.engine
        if self._suspects:
            self._retry_alone(self._suspects.pop(0))
        else:
            before = engine.num_spec_rounds
            try:
                engine.step(self.spec)
            except Exception as e:
                self._step_failed(e)
            self.metrics.spec_rounds.inc(engine.num_spec_rounds - before)
        self._emit_all()

    def _step_failed(self, exc: Exception) -> None:
        engine = self.engine
        involved = list(engine.scheduler.running) + [s for s in engine.scheduler.waiting
                                                      if s.seq_id in engine.cache.tables]
        log.warning("a step failed (%s: %s); retrying its %d request(s) one at a time",
                    type(exc).__name__, exc, len(involved))
        if not involved and engine.scheduler.waiting:
            # Admission itself failed with nothing running: the head of the queue can never run.
            self._fail(engine.scheduler.waiting[0], exc)
            return
        for seq in reversed(involved):   # front of the queue, in their order
            engine.requeue(seq)
        if len(involved) == 1:
            self._fail(involved[0], exc)
        else:
            self._suspects = involved + [s for s in self._suspects if s not in involved]

    def _retry_alone(self, seq: Sequence) -> None:
        """One step with `seq` as the only request (the rest of the queue held aside)."""
        if seq.finished:
            return
        waiting = self.engine.scheduler.waiting
        held = [s for s in waiting if s is not seq]
        waiting.clear()
        waiting.append(seq)
        try:
            self.engine.step(self.spec)
        except Exception as e:
            self.engine.requeue(seq)
            self._fail(seq, e)
        else:
            self.engine.requeue(seq)   # innocent: back in the queue, to rejoin the batch
        finally:
            waiting.extend(held)

    def _fail(self, seq: Sequence, exc: BaseException) -> None:
        job = self._jobs.pop(seq.seq_id, None)
        self.engine.abort(seq)
        if seq in self._suspects:
            self._suspects.remove(seq)
        log.error("request %d failed: %s: %s", seq.seq_id, type(exc).__name__, exc, exc_info=exc)
        if job is not None:
            job.push(Output(index=job.index, error=f"{type(exc).__name__}: {exc}", prompt_tokens=len(seq.prompt_ids),
                            completion_tokens=len(seq.output_ids)))

    def _end(self, job: Job, why: str, cancelled: bool = False) -> None:
        """Abort one request now (its pages go back at once) and send its last Output."""
        seq = job.seq
        if seq is None or seq.seq_id not in self._jobs:
            return
        self.engine.abort(seq)
        if seq in self._suspects:
            self._suspects.remove(seq)
        self._emit(job, cancelled=cancelled)

    def _cancel_all(self, error: str | None = None) -> None:
        for job in list(self._jobs.values()):
            if error is not None:
                self._jobs.pop(job.seq.seq_id, None)
                self.engine.abort(job.seq)
                job.push(Output(index=job.index, error=error, prompt_tokens=len(job.prompt_ids)))
            else:
                self._end(job, "abort", cancelled=True)
        self._suspects.clear()

    def _emit_all(self) -> None:
        for job in list(self._jobs.values()):
            try:
                self._emit(job)
            except Exception as e:   # e.g. decoding this request's text: fail it alone
                self._fail(job.seq, e)

    def _emit(self, job: Job, cancelled: bool = False) -> None:
        """Send what the request got since its last Output (streams), or everything once it
        has finished; and count it in the metrics."""
        seq = job.seq
        n = len(seq.output_ids)
        now = time.monotonic()
        m = self.metrics
        if n > job.num_seen:
            if job.last_token_at is None:
                m.ttft.observe(now - job.arrival)
            else:
                m.itl.observe(now - job.last_token_at)
            job.last_token_at = now
            m.generation_tokens.inc(n - job.num_seen)
            job.num_seen = n
            self._count_rounds(job)
        final = seq.finished
        prompt_ready = not job.prompt_sent and seq.prompt_logprobs is not None
        if not final and (not job.stream or (n == job.num_sent and not prompt_ready)):
            return
        if final:
            text = job.text.finish(seq.output_text or "")
            m.e2e.observe(now - job.arrival)
            m.finished(seq.finish_reason.value, len(seq.prompt_ids), n, seq.params.max_tokens)
            del self._jobs[seq.seq_id]
        else:
            text = job.text.update(seq.output_ids)
        logprobs = None
        if job.logprobs and seq.logprobs is not None:
            logprobs = [self._token_logprob(t, d) for t, d in zip(seq.output_ids[job.num_sent:n],
                                                                   seq.logprobs[job.num_sent:n])]
        prompt_logprobs = None
        if prompt_ready:
            ranks = seq.prompt_ranks or [None] * len(seq.prompt_ids)
            prompt_logprobs = [self._token_logprob(t, d, r) for t, d, r in zip(seq.prompt_ids, seq.prompt_logprobs,
                                                                                ranks)]
            job.prompt_sent = True
        out = Output(index=job.index, text=text, token_ids=seq.output_ids[job.num_sent:n], logprobs=logprobs,
                     prompt_logprobs=prompt_logprobs, finish_reason=seq.finish_reason.value if final else None,
                     stop_reason=seq.stop_reason if final else None, cancelled=cancelled,
                     prompt_tokens=len(seq.prompt_ids), completion_tokens=n,
                     accept_length=seq.stats.accept_length, num_rounds=seq.stats.num_rounds,
                     num_emitted=seq.stats.num_emitted)
        job.num_sent = n
        job.push(out)

    def _count_rounds(self, job: Job) -> None:
        """The speculative rounds since the last count, in vLLM's spec-decode counters."""
        m, stats = self.metrics, job.seq.stats
        rounds, emitted = stats.num_rounds - job.rounds_seen, stats.num_emitted - job.emitted_seen
        if not rounds:
            return
        for _ in range(rounds):
            m.accept_length.observe(emitted / rounds)
        m.spec_drafts.inc(rounds)
        m.spec_draft_tokens.inc(stats.num_drafted - job.drafted_seen)
        m.spec_accepted.inc(emitted - rounds)            # a round emits its accepted drafts and one more
        seen = job.accepted_seen + [0] * (len(stats.accepted_per_depth) - len(job.accepted_seen))
        for position, (hits, before) in enumerate(zip(stats.accepted_per_depth, seen)):
            if hits > before:
                m.spec_accepted_per_pos.labels(str(position)).inc(hits - before)
        job.rounds_seen, job.emitted_seen, job.drafted_seen = stats.num_rounds, stats.num_emitted, stats.num_drafted
        job.accepted_seen = list(stats.accepted_per_depth)

    def _token_logprob(self, token_id: int, alternatives: dict[int, float] | None,
                       rank: int | None = None) -> TokenLogprob:
        """One token's logprob entry; `alternatives` None is the first prompt token (no score)."""
        def alt(t: int, lp: float | None, r: int | None = None) -> Alternative:
            text, raw, special = self.token_piece(t)
            return Alternative(t, text, raw, lp, special, r)

        if alternatives is None:
            chosen = alt(token_id, None)
            return TokenLogprob(chosen.token_id, chosen.token, chosen.bytes, None, chosen.special)
        chosen = alt(token_id, alternatives.get(token_id, float("-inf")), rank)
        ranked = sorted(alternatives.items(), key=lambda kv: -kv[1])
        top = [alt(t, lp, rank if t == token_id and rank is not None else i + 1) for i, (t, lp) in enumerate(ranked)]
        return TokenLogprob(chosen.token_id, chosen.token, chosen.bytes, chosen.logprob, chosen.special, chosen.rank,
                            top=top)

    def _gauges(self) -> None:
        engine, m = self.engine, self.metrics
        m.running.set(len(engine.scheduler.running))
        m.waiting.set(len(engine.scheduler.waiting))
        m.pages(engine.cache.num_free_pages())
        if engine.num_preemptions > self._preemptions_seen:
            m.preemptions.inc(engine.num_preemptions - self._preemptions_seen)
            self._preemptions_seen = engine.num_preemptions
