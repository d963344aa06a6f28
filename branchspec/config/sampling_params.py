"""Per-request sampling settings, as in vLLM."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from branchspec.config.checks import ConfigError, ConfigTypeError, check_bool, check_float, check_int


# Temperatures below this sample from a distribution indistinguishable from the argmax, and
# dividing logits by them overflows: they decode greedily (vLLM's rule).
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**64 - 1   # the range torch.Generator.manual_seed takes
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
# The most samples of one prompt (vLLM's VLLM_MAX_N_SEQUENCES default): each is a request
# of its own, made before any runs, so n = 10**12 (a typo for 12) would never start.
MAX_N = 16384


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, as in vLLM. temperature 0 (or below 1e-5) means greedy.

    How a token is drawn at each step (vLLM v1's order): the target's logits get
    `logit_bias` added, stop ids banned while fewer than `min_tokens` tokens were generated,
    then the penalties; greedy takes the argmax of that, sampling divides by the
    temperature, drops tokens below `min_p` times the most likely one's probability,
    keeps the `top_k` most likely (ties with the k-th kept), then the smallest set
    reaching `top_p`, and draws. top_k = 1 is greedy whatever the temperature.

    seed: None draws a fresh seed per request; an integer in [0, 2**64) makes the request
    reproducible whatever else runs in its batch. stop: strings that end the output, which
    is cut before the first one found (the stop string itself is not returned unless
    include_stop_str_in_output, which also keeps a stop id's text). skip_special_tokens
    (default True): special tokens have no text in the output, as in vLLM.
    stop_token_ids: token ids that end the output as EOS does (the id is kept in token_ids,
    its text is not), even with ignore_eos. min_tokens: no EOS, stop id or stop string
    ends the output before this many tokens.

    Penalties follow vLLM (and OpenAI's definitions): presence_penalty and
    frequency_penalty ([-2, 2]) subtract, from each token's logit, the penalty once if the
    token was generated before / times the number of times it was; repetition_penalty
    (> 0, 1 = off) divides positive logits of tokens seen in the prompt or the output by
    the penalty and multiplies negative ones. Under speculation each draft node is
    penalised by its own prefix: the committed output plus its path in the tree.

    n: independent samples of the prompt (1 to MAX_N = 16384, vLLM's limit), run as n
    requests in one batch and returned as one RequestOutput with n outputs. With a seed,
    sample i uses seed + i (mod 2**64), as vLLM does, so sample 0 is what n = 1 gives.

    max_tokens 0 generates nothing: the request only scores its prompt (prompt_logprobs).

    logprobs: None (the default) returns none; k >= 0 returns, for every generated token, a
    {token_id: logprob} dict holding the chosen token and the k most likely ones (k or k + 1
    entries). prompt_logprobs: the same for every prompt token after the first (position 0
    gets None). Both are vLLM's default "raw" logprobs: log_softmax, in float64, of the
    target model's logits, before any bias, penalty, temperature or cut; under
    speculation they come from the verify pass and equal plain decoding's. k may not
    exceed the model's vocabulary.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 128
    min_tokens: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        own = "SamplingParams"
        temperature = check_float(own, "temperature", self.temperature)
        if temperature < 0.0:
            raise ConfigError(f"{own}.temperature must be >= 0 (0 = greedy), got {temperature}")
        top_p = check_float(own, "top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ConfigError(f"{own}.top_p must be in (0, 1], got {top_p}")
        top_k = check_int(own, "top_k", self.top_k)
        if top_k < -1:
            raise ConfigError(f"{own}.top_k must be -1 or 0 (all tokens) or >= 1, got {top_k}")
        min_p = check_float(own, "min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ConfigError(f"{own}.min_p must be in [0, 1], got {min_p}")
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "top_k", -1 if top_k == 0 else top_k)
        object.__setattr__(self, "min_p", min_p)
        max_tokens = check_int(own, "max_tokens", self.max_tokens, minimum=0)
        object.__setattr__(self, "max_tokens", max_tokens)
        min_tokens = check_int(own, "min_tokens", self.min_tokens, minimum=0)
        if min_tokens > max_tokens:
            raise ConfigError(f"{own}.min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})")
        object.__setattr__(self, "min_tokens", min_tokens)
        if self.seed is not None:
            object.__setattr__(self, "seed", check_int(own, "seed", self.seed, minimum=0, maximum=MAX_SEED))
        object.__setattr__(self, "stop", _stop_strings(own, self.stop))
        object.__setattr__(self, "stop_token_ids", _token_ids(own, "stop_token_ids", self.stop_token_ids))
        check_bool(own, "ignore_eos", self.ignore_eos)
        check_bool(own, "include_stop_str_in_output", self.include_stop_str_in_output)
        check_bool(own, "skip_special_tokens", self.skip_special_tokens)
        object.__setattr__(self, "n", check_int(own, "n", self.n, minimum=1, maximum=MAX_N))
        for name in ("presence_penalty", "frequency_penalty"):
            value = check_float(own, name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ConfigError(f"{own}.{name} must be in [-2, 2], got {value}")
            object.__setattr__(self, name, value)
        repetition = check_float(own, "repetition_penalty", self.repetition_penalty)
        if not 0.0 < repetition <= 2.0:
            raise ConfigError(f"{own}.repetition_penalty must be in (0, 2] (1 = off), got {repetition}")
        object.__setattr__(self, "repetition_penalty", repetition)
        object.__setattr__(self, "logit_bias", _logit_bias(own, self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(own, name, getattr(self, name), minimum=0))

    @property
    def greedy(self) -> bool:
        """The argmax is taken: temperature below 1e-5, or top_k = 1."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def sampling_temperature(self) -> float:
        """The temperature the sampler uses: 0.0 for greedy requests."""
        return 0.0 if self.greedy else self.temperature

    def choices(self) -> list["SamplingParams"]:
        """The n single-sample requests this one stands for (itself when n is 1): sample i
        is seeded seed + i (mod 2**64) when a seed is given, else draws its own."""
        if self.n == 1:
            return [self]
        return [dataclasses.replace(self, n=1, seed=None if self.seed is None else (self.seed + i) % (MAX_SEED + 1))
                for i in range(self.n)]


def _stop_strings(own: str, stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
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
    return stop


def _token_ids(own: str, name: str, ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    if not isinstance(ids, (list, tuple)):
        raise ConfigTypeError(f"{own}.{name} must be a list of token ids, got {type(ids).__name__}")
    return tuple(dict.fromkeys(check_int(own, f"{name}[{i}]", t, minimum=0) for i, t in enumerate(ids)))


def _logit_bias(own: str, bias) -> tuple[tuple[int, float], ...]:
    """{token_id: bias} (or pairs) -> sorted (id, bias) pairs, so the params stay hashable."""
    if bias is None:
        return ()
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, (list, tuple)) and not isinstance(bias, Mapping):
        raise ConfigTypeError(f"{own}.logit_bias must be a {{token_id: bias}} dict, got {type(bias).__name__}")
    out = {}
    for pair in items:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise ConfigTypeError(f"{own}.logit_bias must be a {{token_id: bias}} dict, got an item {pair!r}")
        t = check_int(own, "logit_bias key", pair[0], minimum=0)
        b = check_float(own, f"logit_bias[{t}]", pair[1])
        if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS or math.isnan(b):
            raise ConfigError(f"{own}.logit_bias[{t}] must be in [-100, 100], got {b}")
        if t in out:   # one of the two would silently win
            raise ConfigError(f"{own}.logit_bias gives token {t} twice (biases {out[t]:g} and {b:g}); give each "
                              "token once")
        out[t] = b
    return tuple(sorted(out.items()))
