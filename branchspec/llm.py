"""The offline Python API, following vLLM's `LLM` (generate, chat) and SGLang's spec knobs."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping
from collections.abc import Sequence as Sequence_
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from branchspec.checkpoint import checkpoint_stop_ids, load_checkpoint
from branchspec.config import (MAX_SEED, AutoPolicy, ConfigError, ConfigTypeError, EngineConfig, SamplingParams,
                               SpecConfig, check_int, spec_label)
from branchspec.data.chat import ROLES
from branchspec.engine.engine import Engine
from branchspec.engine.request import Sequence
from branchspec.execution import expert_dispatch
from branchspec.model.layers import pack_products
from branchspec.speculative.draft_vocab import DraftVocab

DEFAULT_CHECKPOINT = Path(__file__).parent / "checkpoints" / "v4-mini-v2"


@dataclass
class CompletionOutput:
    """One sample of a prompt (vLLM's CompletionOutput), with its speculative statistics."""

    index: int                      # which of the request's n samples
    text: str
    token_ids: list[int]
    finish_reason: str              # "stop" or "length"
    # What stopped it: the stop string, or the stop_token_ids id; None for EOS or a length finish.
    stop_reason: str | int | None
    accept_length: float            # mean tokens per verify round (0.0 without speculation)
    num_rounds: int
    accepted_per_depth: list[int]   # rounds whose accepted path reached each draft depth
    # vLLM's raw logprobs (log_softmax of the target's logits, float64, before any bias,
    # penalty, temperature or cut), None unless SamplingParams asked: one {token_id: logprob}
    # per generated token (the chosen one and the top k), and their sum.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """What one prompt got (vLLM's RequestOutput): `outputs` holds its n samples, in order.

    The first sample's fields are also read straight off the request (`out.text`,
    `out.token_ids`, `out.finish_reason`, `out.accept_length`, ...), as before n existed.
    """

    request_id: int
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # per prompt token (None at position 0), when SamplingParams.prompt_logprobs asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt: str | None = None       # the prompt text, when it was given as text
    finished: bool = True

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> str | int | None:
        return self.outputs[0].stop_reason

    @property
    def accept_length(self) -> float:
        return self.outputs[0].accept_length

    @property
    def num_rounds(self) -> int:
        return self.outputs[0].num_rounds

    @property
    def accepted_per_depth(self) -> list[int]:
        return self.outputs[0].accepted_per_depth

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs


@dataclass
class GenerateStats:
    """Timing of the last generate() call."""

    num_requests: int = 0
    num_generated: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    phase_seconds: dict[str, float] = field(default_factory=dict)
    num_rounds: int = 0             # verify rounds summed over requests
    num_steps: int = 0              # batch-level decode steps / rounds
    accept_length: float = 0.0
    # With SpecConfig.auto: batch rounds per configuration ("none", "chain D=4", "tree 3x2
    # D=6", ...) and the seconds the policy spent deciding and learning.
    spec_choices: dict[str, int] = field(default_factory=dict)
    policy_seconds: float = 0.0
    policy: str = "fixed"           # "fixed" (one configuration) or "auto" (SpecConfig.auto)

    @property
    def decode_throughput(self) -> float:
        return self.num_generated / self.decode_seconds if self.decode_seconds > 0 else 0.0


class LLM:
    """Load a checkpoint folder (config.json + model.safetensors [+ tokenizer.json]) and
    generate. `LLM()` loads the embedded default checkpoint.

    One engine (its page pools and its seed stream) lives as long as the LLM: requests of
    later calls reuse the pools, and unseeded sampled requests differ from call to call.
    `seed` fixes that stream, so a whole script of calls is reproducible.
    `compile=True` runs decode, verify and drafting compiled (`warmup` compiles ahead).
    `device` ("cpu", "cuda", "cuda:N") is where the model, its state and its steps run; on
    a GPU every step replays as a CUDA graph per batch bucket (`cuda_graphs=False`: its
    kernels launched one by one from Python instead, for debugging).
    `speculative_token_map` (SGLang's flag): the tokens the drafter may propose, a reduced
    draft vocabulary (`speculative/draft_vocab.py`); None takes the checkpoint's own
    `draft_vocab.safetensors` if it has one, False drafts over the whole vocabulary.

    Threads: an LLM may be shared between threads. Its calls (`generate`, `chat`,
    `warmup`) run one at a time: a call made while another thread's runs waits for it to
    finish, then runs with the same engine (outputs are what each call would give alone:
    seeded requests repeat exactly). A call made from inside a running call on the same
    thread (from a progress callback, say), or while a server serves this LLM, raises
    RuntimeError at once instead of waiting forever.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype: str = "float32",
                 max_batch_size: int = 64, max_model_len: int | None = None, page_size: int = 16,
                 seed: int | None = None, compile: bool = False, device: str = "cpu",
                 speculative_token_map: str | os.PathLike | bool | None = None, cuda_graphs: bool | None = None):
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a checkpoint folder path (str or PathLike) or None, "
                            f"got {type(model).__name__}")
        if not isinstance(dtype, str):
            raise TypeError(f"dtype must be a string such as 'float32', got {type(dtype).__name__}")
        if seed is not None:
            seed = check_int("LLM", "seed", seed, minimum=0, maximum=MAX_SEED)
        self.engine_config = EngineConfig(max_batch_size=max_batch_size, page_size=page_size,
                                          max_model_len=max_model_len, compile=compile, device=device,
                                          cuda_graphs=cuda_graphs)
        path = Path(model) if model is not None else DEFAULT_CHECKPOINT
        if model is None and not (path / "config.json").is_file():
            raise FileNotFoundError(f"the embedded default checkpoint is missing at {path}; "
                                    "pass a checkpoint folder: LLM('path/to/checkpoint')")
        self.path = path
        self.seed = seed
        # Weights, pools and engine state are made as normal tensors even when this runs
        # under torch.inference_mode: inference tensors could not be written in place by a
        # later call outside it, and keep no version counter to tell a changed weight by.
        with torch.inference_mode(False):
            self._build(path, dtype, compile, device, speculative_token_map)
        self.last_stats = GenerateStats()
        self._lock = threading.Lock()              # one call at a time owns the engine
        self._holder: tuple[int, str] | None = None   # (thread, what) of the owner

    def _build(self, path: Path, dtype: str, compile: bool, device: str, speculative_token_map) -> None:
        self.model = load_checkpoint(path, dtype, expert_dispatch=expert_dispatch(compile, device)).to(device)
        pack_products(self.model)     # the large weights' products through oneDNN (model/matmul.py)
        self.tokenizer = None
        if (path / "tokenizer.json").is_file():
            from branchspec.data.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(path)
            # Ids past the model's vocabulary have no embedding row: refuse before any request.
            if self.tokenizer.vocab_size > self.model.cfg.vocab_size:
                raise ValueError(f"{path / 'tokenizer.json'} has {self.tokenizer.vocab_size} tokens but "
                                 f"config.json's vocab_size is {self.model.cfg.vocab_size}; the model "
                                 "cannot embed the extra ids")
        self.draft_vocab = self._draft_vocab(speculative_token_map)
        self.engine = self._build_engine()

    # -- one call at a time -------------------------------------------------------------
    def claim(self, what: str, blocking: bool = True) -> None:
        """Take the engine for `what` (see the class docstring: calls run one at a time);
        `release` gives it back. RuntimeError instead of waiting when this thread already
        holds it, when a server holds it, or (blocking=False) when anyone does."""
        holder = self._holder
        if holder is not None and (holder[0] == threading.get_ident() or holder[1] == "serving"):
            where = "on the same thread" if holder[0] == threading.get_ident() else "in another thread"
            raise RuntimeError(f"LLM.{what}: this LLM is busy with {holder[1]} {where}; its engine runs one "
                               "call at a time, and this one would wait forever")
        if not self._lock.acquire(blocking=blocking):
            raise RuntimeError(f"LLM.{what}: this LLM is busy with {holder[1] if holder else 'a call'} in "
                               "another thread")
        self._holder = (threading.get_ident(), what)

    def release(self) -> None:
        self._holder = None
        self._lock.release()

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        """Own the engine for one call, outside `torch.inference_mode` even when the caller
        is in it: the engine's tensors are normal ones (see __init__), and a compiled step
        traced in inference mode would fail its guards, and recompile, everywhere else."""
        self.claim(what)
        try:
            with torch.inference_mode(False):
                yield
        finally:
            self.release()

    @property
    def config(self):
        return self.model.cfg

    def _draft_vocab(self, token_map) -> DraftVocab | None:
        """The reduced draft vocabulary: the checkpoint's `draft_vocab.safetensors` when
        `token_map` is None, the given file, or none at all (False: draft over every token)."""
        vocab_size = self.model.cfg.vocab_size
        if token_map is None or token_map is True:
            return DraftVocab.of_folder(self.path, vocab_size)
        if token_map is False:
            return None
        if not isinstance(token_map, (str, os.PathLike)):
            raise TypeError(f"speculative_token_map must be a file path, None (the checkpoint's own) or False "
                            f"(the full vocabulary), got {type(token_map).__name__}")
        return DraftVocab.load(token_map, vocab_size)

    def _build_engine(self) -> Engine:
        # Stop on every end-of-sequence id the checkpoint declares (an HF eos list), and on
        # the tokenizer's own (e.g. the chat turn-end token).
        stop_ids = set(checkpoint_stop_ids(self.path))
        decode = None
        if self.tokenizer is not None:
            stop_ids.update(self.tokenizer.stop_ids)
            decode = self._decode_output
        return Engine(self.model, self.engine_config, decode=decode, seed=self.seed,
                      stop_token_ids=tuple(sorted(stop_ids)), draft_vocab=self.draft_vocab)

    def _decode_output(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of generated ids. A model's vocabulary may be padded past its tokenizer's
        (real V4 checkpoints are); ids in the padding have no text and are skipped."""
        known = self.tokenizer.vocab_size
        return self.tokenizer.decode([i for i in ids if i < known], skip_special_tokens=skip_special_tokens)

    def warmup(self, spec: SpecConfig | AutoPolicy | None = None, batch_sizes: tuple[int, ...] | None = None,
               sampling: tuple[str, ...] = ("greedy", "sampled"), progress: bool = True) -> dict:
        """Run short dummy generations at each batch size with `spec`, so that a compiled
        LLM compiles, and a CUDA-graph one captures, every graph that configuration needs
        now rather than mid-request, and no other: a fixed SpecConfig never decodes
        plainly, so plain decoding is warmed by `warmup(None)`. With
        `SpecConfig.auto(...)` it also measures (or loads) the round-cost calibration, and
        warms plain decoding and every candidate. What the dummy prompt's rounds accept
        teaches the engine's measured acceptance nothing (`AcceptanceModel.unchanged`).

        batch_sizes: positive integers; sizes past the engine's max_batch_size run at
        max_batch_size (no batch grows larger). None: what the execution needs to meet
        every graph: batch 1 and one larger batch for compiled steps (a batch of 2 or more
        covers all), every batch bucket, largest first, for CUDA graphs.
        sampling: the requests to warm for, "greedy" and/or "sampled": a batch with a request
        sampled at its temperature alone (no top-p, top-k or min-p), the others greedy or
        alike, draws its tokens inside the plain step's or the verify pass's graph, a graph
        of its own per D and batch class; other requests run the greedy graphs.
        progress: a progress bar over the warm-up runs (compilations are logged as they
        start and end, `compiled_step.report_progress`).

        Returns {"seconds", "graphs" compiled, "loaded": compiled steps loaded from the
        cache folder instead, "captured": CUDA graphs captured}; on an eager LLM it only
        warms caches."""
        from tqdm import tqdm

        from branchspec.execution.compiled_step import compilations, steps_loaded

        max_batch = self.engine_config.max_batch_size
        executor = self.engine.executor
        if batch_sizes is None:
            sizes = executor.batch_sizes(max_batch)
        else:
            sizes = _batch_sizes(batch_sizes, max_batch)
        temperatures = _warmup_temperatures(sampling)
        with self._exclusive("warmup"):
            policy = self.engine.policy(spec)
            t0, graphs0, loaded0 = time.perf_counter(), compilations(), steps_loaded()
            captured0 = getattr(executor, "captures", 0)
            policy.prepare(progress=progress)
            prompt = [self.config.bos_token_id] + [3 + i % (self.config.vocab_size - 3) for i in range(40)]
            runs = [(b, s, t) for b in sizes for s in policy.configurations for t in temperatures]
            # The dummy prompt's rounds must not teach the measured acceptance real requests are read by.
            learnt = self.engine.drafter.calibration.unchanged() if self.engine.drafter is not None \
                else nullcontext()
            with learnt, tqdm(runs, desc="warm-up", unit="run", disable=not progress, leave=False) as bar:
                for b, s, t in bar:
                    bar.set_postfix_str(f"batch {b}, {spec_label(s)}, {'sampled' if t else 'greedy'}")
                    # Long enough to cross a page of entries and finish rounds at every accept length.
                    params = SamplingParams(max_tokens=min(3 * (s.num_draft_tokens if s else 1) + 2, 32),
                                            temperature=t, ignore_eos=True, seed=0)
                    self._run([prompt] * b, [params] * b, s, False)
            return {"seconds": time.perf_counter() - t0, "graphs": compilations() - graphs0,
                    "loaded": steps_loaded() - loaded0, "captured": getattr(executor, "captures", 0) - captured0}

    # -- input ------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence_[int], name: str = "prompt") -> list[int]:
        """Token ids of one prompt: text is encoded (BOS first), ids are checked for type.

        TypeError for anything but a str or a sequence of integers (numpy integers are
        fine, bools and floats are not); ValueError for empty or unencodable text.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"{name} is empty: give at least one character or token id")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{name} cannot be encoded as UTF-8 ({e.reason} at character {e.start}, "
                                 f"{prompt[e.start:e.end]!r}); lone surrogates are not text") from None
            if self.tokenizer is None:
                raise ValueError(f"checkpoint {self.path} has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_bos=True)
        if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)):
            hint = {bytes: "; decode bytes to str first", torch.Tensor: "; pass tensor.tolist()"}.get(
                type(prompt), "")
            raise TypeError(f"{name} must be a str or a list of token ids, got {type(prompt).__name__}{hint}")
        ids = []
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise TypeError(f"{name}[{j}] must be an integer token id, got {type(t).__name__} {t!r}")
            ids.append(int(t))
        return ids

    def _prompt_list(self, prompts) -> list:
        """One prompt (text or ids) or a list of them -> a list of prompts."""
        if isinstance(prompts, (str, np.ndarray)):
            return [prompts]
        if isinstance(prompts, (list, tuple)):
            if prompts and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in prompts):
                return [prompts]   # a single token-id prompt
            return list(prompts)
        raise TypeError(f"prompts must be a str, a list of token ids, or a list of those, "
                        f"got {type(prompts).__name__}")

    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * n
        for i, p in enumerate(params_list):
            if not isinstance(p, SamplingParams):
                where = f"sampling_params[{i}]" if isinstance(params, (list, tuple)) else "sampling_params"
                raise TypeError(f"{where} must be a SamplingParams, got {type(p).__name__}")
        if len(params_list) != n:
            raise ValueError(f"{len(params_list)} sampling params for {n} prompts")
        return params_list

    # -- generation -------------------------------------------------------------------
    def generate(self, prompts: str | list[str] | list[int] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecConfig | AutoPolicy | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; spec=None decodes plainly. Outputs keep prompt order.

        Every prompt, parameter and the spec are checked before any request runs; a bad
        one raises TypeError or ValueError naming it, and nothing is queued.
        """
        with self._exclusive("generate"):
            prompts = self._prompt_list(prompts)
            encoded = [self.encode(p, name=f"prompts[{i}]") for i, p in enumerate(prompts)]
            texts = [p if isinstance(p, str) else None for p in prompts]
            return self._run(encoded, self._params_list(sampling_params, len(prompts)), spec, use_tqdm, texts)

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             spec: SpecConfig | AutoPolicy | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation ([{"role", "content"}, ...]) with the checkpoint's chat
        template, ending in the assistant's turn, and generate. Role markers typed inside
        content stay text."""
        if self.tokenizer is None:
            raise ValueError(f"checkpoint {self.path} has no tokenizer.json and so no chat template")
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise TypeError("conversations must be a non-empty list of messages, or a list of such lists")
        single = isinstance(conversations[0], Mapping)
        batch = [conversations] if single else conversations
        with self._exclusive("chat"):
            encoded = []
            for c, conversation in enumerate(batch):
                name = "messages" if single else f"conversations[{c}]"
                _check_messages(conversation, name)
                try:
                    encoded.append(self.tokenizer.encode_chat(conversation, add_generation_prompt=True))
                except ValueError as e:     # the template's own rules (a system message first, ...)
                    raise ValueError(f"{name}: {e}") from None
            return self._run(encoded, self._params_list(sampling_params, len(batch)), spec, use_tqdm)

    def _run(self, encoded: list[list[int]], params_list: list[SamplingParams], spec: SpecConfig | AutoPolicy | None,
             use_tqdm: bool, texts: list[str | None] | None = None) -> list[RequestOutput]:
        engine = self.engine
        policy = engine.policy(spec)
        for i, (ids, p) in enumerate(zip(encoded, params_list)):   # check all before running any
            engine.validate(ids, p, name=f"prompts[{i}]")
        if not isinstance(use_tqdm, bool):
            raise TypeError(f"use_tqdm must be a bool, got {type(use_tqdm).__name__}")
        engine.phase_seconds.clear()
        steps_before = engine.num_steps
        choices_before = dict(policy.counts)
        policy_seconds_before = policy.decide_seconds
        # n samples of a prompt are n requests of the batch (SamplingParams.choices).
        groups = [[engine.add_request(ids, c) for c in p.choices()] for ids, p in zip(encoded, params_list)]
        seqs = [s for group in groups for s in group]
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        t_start = time.perf_counter()
        try:
            engine.run(spec, progress=bar.update if bar is not None else None)
        finally:
            # An exception (or Ctrl-C) mid-run must not leave requests holding pages.
            for s in seqs:
                engine.abort(s)
            if bar is not None:
                bar.close()
        elapsed = time.perf_counter() - t_start
        self.last_stats = self._stats(engine, seqs, elapsed, engine.num_steps - steps_before)
        self.last_stats.spec_choices = {k: v - choices_before.get(k, 0) for k, v in policy.counts.items()
                                        if v - choices_before.get(k, 0) > 0}
        self.last_stats.policy_seconds = policy.decide_seconds - policy_seconds_before
        self.last_stats.policy = policy.name
        texts = texts or [None] * len(groups)
        return [request_output(group, text) for group, text in zip(groups, texts)]

    @staticmethod
    def _stats(engine: Engine, seqs: list[Sequence], elapsed: float, num_steps: int) -> GenerateStats:
        phases = dict(engine.phase_seconds)
        prefill = phases.pop("prefill", 0.0)
        rounds = sum(s.stats.num_rounds for s in seqs)
        emitted = sum(s.stats.num_emitted for s in seqs)
        return GenerateStats(num_requests=len(seqs), num_generated=sum(len(s.output_ids) for s in seqs),
                             prefill_seconds=prefill, decode_seconds=max(elapsed - prefill, 0.0),
                             phase_seconds=phases, num_rounds=rounds, num_steps=num_steps,
                             accept_length=emitted / rounds if rounds else 0.0)


def completion_output(index: int, s: Sequence) -> CompletionOutput:
    """One finished request as sample `index` of its prompt."""
    logprobs = list(s.logprobs) if s.logprobs is not None else None
    return CompletionOutput(index=index, text=s.output_text or "", token_ids=list(s.output_ids),
                            finish_reason=s.finish_reason.value, stop_reason=s.stop_reason,
                            accept_length=s.stats.accept_length, num_rounds=s.stats.num_rounds,
                            accepted_per_depth=list(s.stats.accepted_per_depth), logprobs=logprobs,
                            cumulative_logprob=None if logprobs is None else
                            sum(d[t] for d, t in zip(logprobs, s.output_ids)))


def request_output(group: list[Sequence], prompt: str | None = None) -> RequestOutput:
    """The n requests of one prompt (`SamplingParams.choices`, in order) as one output."""
    first = group[0]
    return RequestOutput(request_id=first.seq_id, prompt_token_ids=first.prompt_ids,
                         outputs=[completion_output(i, s) for i, s in enumerate(group)],
                         prompt_logprobs=list(first.prompt_logprobs) if first.prompt_logprobs is not None else None,
                         prompt=prompt, finished=all(s.finished for s in group))


def _batch_sizes(value, max_batch_size: int) -> tuple[int, ...]:
    """warmup's batch sizes: a non-empty sequence of positive integers, each capped at
    max_batch_size, without repeats."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)):
        raise ConfigTypeError(f"LLM.warmup.batch_sizes must be a tuple of integers such as (1, 4), "
                              f"got {type(value).__name__} {value!r}")
    if len(value) == 0:
        raise ConfigError("LLM.warmup.batch_sizes is empty: give at least one batch size, such as (1,)")
    sizes = [check_int("LLM.warmup", f"batch_sizes[{i}]", b, minimum=1) for i, b in enumerate(value)]
    return tuple(dict.fromkeys(min(b, max_batch_size) for b in sizes))


def _warmup_temperatures(value) -> tuple[float, ...]:
    """warmup's sampling modes ("greedy", "sampled") as the temperatures its runs use."""
    known = {"greedy": 0.0, "sampled": 1.0}
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not value or any(m not in known for m in value):
        raise ConfigError(f"LLM.warmup.sampling must name one or both of 'greedy' and 'sampled', got {value!r}")
    return tuple(known[m] for m in dict.fromkeys(value))


def _check_messages(messages, name: str) -> None:
    """A conversation is a non-empty list of {"role": str, "content": str} dicts."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TypeError(f"{name} must be a non-empty list of {{'role', 'content'}} dicts, "
                        f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"{name}[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if set(m) != {"role", "content"}:
            raise ValueError(f"{name}[{i}] must have exactly the keys 'role' and 'content', got {sorted(map(str, m))}")
        if not isinstance(m["content"], str):
            raise TypeError(f"{name}[{i}]['content'] must be a str, got {type(m['content']).__name__}")
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"{name}[{i}]['content'] cannot be encoded as UTF-8 ({e.reason} at "
                             f"character {e.start})") from None
        if m["role"] not in ROLES:
            raise ValueError(f"{name}[{i}]['role'] must be one of {ROLES}, got {m['role']!r}")
        if m["role"] == "system" and i > 0:
            raise ValueError(f"{name}[{i}]['role'] is 'system': a system message may only come first")
