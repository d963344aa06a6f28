"""Per-request sampling settings, as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from branchspec.config.checks import ConfigError, ConfigTypeError, check_bool, check_float, check_int


# Temperatures below this sample from a distribution indistinguishable from the argmax, and
# dividing logits by them overflows: they decode greedily (vLLM's rule).
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1   # the range torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as in vLLM. temperature 0 (or below 1e-5) means greedy.

    seed: None draws a fresh seed per request; an integer in [0, 2**64) makes the request
    reproducible whatever else runs in its batch. stop: strings that end the output, which
    is cut before the first one found (the stop string itself is not returned).

    logprobs: None (the default) returns none; k >= 0 returns, for every generated token, a
    {token_id: logprob} dict holding the chosen token and the k most likely ones (k or k + 1
    entries). prompt_logprobs: the same for every prompt token after the first (position 0
    gets None). Both are vLLM's default "raw" logprobs: log_softmax, in float64, of the
    target model's logits, before temperature and top-p; under speculation they come from the
    verify pass and equal plain decoding's. k may not exceed the model's vocabulary.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 128
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        own = "SamplingParams"
        temperature = check_float(own, "temperature", self.temperature)
        if temperature < 0.0:
            raise ConfigError(f"{own}.temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = check_float(own, "top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"{own}.top_p must be in (0, 1], got {top_p}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "max_tokens", check_int(own, "max_tokens", self.max_tokens, minimum=1))
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int(own, "seed", self.seed, minimum=0, maximum=MAX_SEED))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
        else:
            raise ConfigTypeError(f"{own}.stop must be a string or a list of strings, got {type(stop).__name__}")
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ConfigTypeError(f"{own}.stop[{i}] must be a string, got {type(s).__name__} {s!r}")
            if not s:
                raise ConfigError(f"{own}.stop[{i}] is empty: stop strings must be non-empty")
        object.__setattr__(self, "stop", stop)
        check_bool(own, "ignore_eos", self.ignore_eos)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(own, name, getattr(self, name), minimum=0))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def sampling_temperature(self) -> float:
        """The temperature the sampler uses: 0.0 for greedy requests."""
        return 0.0 if self.greedy else self.temperature
