"""The offline Python API, following vLLM's `LLM` (generate, chat) and SGLang's spec knobs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from branchspec.config import EngineConfig, SamplingParams, SpecConfig
from branchspec.engine.engine import Engine
from branchspec.engine.request import Sequence
from branchspec.model.weights import load_checkpoint

DEFAULT_CHECKPOINT = Path(__file__).parent / "checkpoints" / "v4-mini"


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    accept_length: float            # mean tokens per verify round (0.0 without speculation)
    num_rounds: int
    accepted_per_depth: list[int]   # rounds whose accepted path reached each draft depth


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

    @property
    def decode_throughput(self) -> float:
        return self.num_generated / self.decode_seconds if self.decode_seconds > 0 else 0.0


class LLM:
    """Load a checkpoint folder (config.json + model.safetensors [+ tokenizer.json]) and
    generate. `LLM()` loads the embedded default checkpoint."""

    def __init__(self, model: str | Path | None = None, *, dtype: str = "float32",
                 max_batch_size: int = 64, max_model_len: int | None = None, page_size: int = 16,
                 seed: int = 0):
        path = Path(model) if model is not None else DEFAULT_CHECKPOINT
        if model is None and not (path / "config.json").is_file():
            raise FileNotFoundError(f"the embedded default checkpoint is missing at {path}; "
                                    "pass a checkpoint folder: LLM('path/to/checkpoint')")
        self.path = path
        self.model = load_checkpoint(path, dtype)
        self.tokenizer = None
        if (path / "tokenizer.json").is_file():
            from branchspec.data.tokenizer import Tokenizer
            self.tokenizer = Tokenizer.from_dir(path)
        self.engine_config = EngineConfig(max_batch_size=max_batch_size, page_size=page_size,
                                          max_model_len=max_model_len)
        self.seed = seed
        self.last_stats = GenerateStats()

    @property
    def config(self):
        return self.model.cfg

    def _engine(self) -> Engine:
        if self.tokenizer is None:
            return Engine(self.model, self.engine_config, seed=self.seed)
        return Engine(self.model, self.engine_config, decode=self.tokenizer.decode, seed=self.seed,
                      stop_token_ids=tuple(self.tokenizer.stop_ids))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"checkpoint {self.path} has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt, add_bos=True)
        return list(prompt)

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecConfig | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for every prompt; spec=None decodes plainly. Outputs keep prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        if spec is not None and not isinstance(spec, SpecConfig):
            raise TypeError(f"spec must be a SpecConfig or None, got {type(spec).__name__}")
        engine = self._engine()
        encoded = [self.encode(p) for p in prompts]
        for ids, p in zip(encoded, params_list):   # check every request before running any
            engine.validate(ids, p)
        seqs = [engine.add_request(ids, p) for ids, p in zip(encoded, params_list)]

        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        t_start = time.perf_counter()
        engine.run(spec, progress=bar.update if bar is not None else None)
        elapsed = time.perf_counter() - t_start
        if bar is not None:
            bar.close()
        self.last_stats = self._stats(engine, seqs, elapsed)
        return [self._output(s) for s in seqs]

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             spec: SpecConfig | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Render each conversation ([{"role", "content"}, ...]) with the checkpoint's chat
        template, ending in the assistant's turn, and generate."""
        if self.tokenizer is None:
            raise ValueError(f"checkpoint {self.path} has no tokenizer.json and so no chat template")
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, spec, use_tqdm)

    @staticmethod
    def _output(s: Sequence) -> RequestOutput:
        return RequestOutput(request_id=s.seq_id, prompt_token_ids=s.prompt_ids, token_ids=list(s.output_ids),
                             text=s.output_text, finish_reason=s.finish_reason.value,
                             accept_length=s.stats.accept_length, num_rounds=s.stats.num_rounds,
                             accepted_per_depth=list(s.stats.accepted_per_depth))

    @staticmethod
    def _stats(engine: Engine, seqs: list[Sequence], elapsed: float) -> GenerateStats:
        phases = dict(engine.runner.timer.seconds)
        prefill = phases.pop("prefill", 0.0)
        rounds = sum(s.stats.num_rounds for s in seqs)
        emitted = sum(s.stats.num_emitted for s in seqs)
        return GenerateStats(num_requests=len(seqs), num_generated=sum(len(s.output_ids) for s in seqs),
                             prefill_seconds=prefill, decode_seconds=max(elapsed - prefill, 0.0),
                             phase_seconds=phases, num_rounds=rounds, num_steps=engine.num_steps,
                             accept_length=emitted / rounds if rounds else 0.0)
