"""What an OpenAI request means, and the JSON we answer with.

`parse_completion` and `parse_chat` check a /v1/completions or /v1/chat/completions body
field by field and turn it into token ids and `SamplingParams`; anything wrong raises
`APIError` (HTTP 400, OpenAI's error JSON, `param` naming the field). The builders below
shape responses, stream chunks and logprobs as OpenAI does, plus three non-standard
fields: `token_ids` on each choice (as vLLM's `return_token_ids`), and `spec_stats`
(accept length and verify rounds of the request) on a response or last chunk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

from branchspec.config import MAX_SEED, SamplingParams

MAX_LOGPROBS = 20        # OpenAI's limit for top_logprobs (vLLM's default max_logprobs)
MAX_STOP_STRINGS = 16    # each one is searched after every token
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions
LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this instead


class APIError(Exception):
    """An error answered with OpenAI's JSON: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, param: str | None = None, *,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, status_label: str = "invalid"):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type, code, headers or {}
        self.status_label = status_label   # the `status` label of the requests metric

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


@dataclass
class GenerationRequest:
    """One checked request: what the worker runs and how the answer is shaped."""

    endpoint: str                    # "completions" or "chat"
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool              # stream_options.include_usage: a last chunk with usage
    logprobs: int | None             # alternatives per token to report; None: no logprobs
    model: str


@dataclass
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str
    max_len: int
    encode_text: Callable[[str], list[int]] | None          # None: no tokenizer
    encode_chat: Callable[[list[dict]], list[int]] | None   # None: no chat template
    validate: Callable[[list[int], SamplingParams], None]   # Engine.validate


# -- field checks ---------------------------------------------------------------------
_JSON_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
               float: "number", type(None): "null"}


def _what(value) -> str:
    text = repr(value)
    return f"{_JSON_NAMES.get(type(value), type(value).__name__)} {text if len(text) <= 40 else text[:37] + '...'}"


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param} {message}", param)


def _integer(param: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        hint = f"; write {int(value)}" if isinstance(value, float) and value.is_integer() else ""
        raise _bad(param, f"must be an integer, got {_what(value)}{hint}")
    if minimum is not None and value < minimum:
        raise _bad(param, f"must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise _bad(param, f"must be <= {maximum}, got {value}")
    return value


def _number(param: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(param, f"must be a number, got {_what(value)}")
    try:
        value = float(value)
    except OverflowError:
        raise _bad(param, "must be a finite number, got an integer too large for a float") from None
    if not math.isfinite(value):   # json.loads accepts NaN and Infinity
        raise _bad(param, f"must be a finite number, got {value}")
    return value


def _boolean(param: str, value) -> bool:
    if not isinstance(value, bool):
        raise _bad(param, f"must be true or false, got {_what(value)}")
    return value


def _text(param: str, value, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise _bad(param, f"must be a string, got {_what(value)}")
    if not value and not allow_empty:
        raise _bad(param, "is empty")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:   # a lone surrogate, e.g. "\ud800" in the JSON
        raise _bad(param, f"cannot be encoded as UTF-8 ({e.reason} at character {e.start})") from None
    return value


def _get(body: dict, name: str, check, *args, default=None):
    """body[name] checked, or `default` when absent or null."""
    value = body.get(name)
    return default if value is None else check(name, value, *args)


def _only_default(body: dict, name: str, allowed: tuple, what: str) -> None:
    """Parameters we accept only at their no-op value."""
    value = body.get(name)
    if value is not None and not any(value == a and type(value) is type(a) for a in allowed):
        raise APIError(400, f"{name} is not supported by this server ({what}), got {_what(value)}", name)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list):
        raise _bad("stop", f"must be a string or an array of strings, got {_what(stop)}")
    if len(stop) > MAX_STOP_STRINGS:
        raise _bad("stop", f"may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
    return tuple(_text(f"stop[{i}]", s) for i, s in enumerate(stop))


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise _bad("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise _bad("stream_options", f"must be an object, got {_what(options)}")
    return _get(options, "include_usage", lambda n, v: _boolean("stream_options.include_usage", v), default=False)


_FIELD_RE = re.compile(r"SamplingParams\.(\w+)")


def _sampling(body: dict, *, max_tokens: int, stop: tuple[str, ...], logprobs: int | None) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=_get(body, "temperature", _number, default=1.0),   # OpenAI's default
            top_p=_get(body, "top_p", _number, default=1.0),
            max_tokens=max_tokens,
            seed=_get(body, "seed", _integer, 0, MAX_SEED),
            stop=stop,
            ignore_eos=_get(body, "ignore_eos", _boolean, default=False),
            logprobs=logprobs)
    except (TypeError, ValueError) as e:   # SamplingParams' own range checks name the field
        m = _FIELD_RE.search(str(e))
        raise APIError(400, str(e).replace("SamplingParams.", ""), m.group(1) if m else None) from None


def _common(body: dict, info: ModelInfo) -> tuple[str, bool, bool]:
    model = body.get("model")
    if model is not None:
        _text("model", model)
        if model != info.name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {info.name!r}",
                           "model", code="model_not_found", status_label="invalid")
    n = _get(body, "n", _integer)
    if n is not None and n != 1:
        raise _bad("n", f"must be 1 (one choice per request), got {n}")
    stream = _get(body, "stream", _boolean, default=False)
    include_usage = _stream_options(body, stream)
    for name in ("presence_penalty", "frequency_penalty"):
        _only_default(body, name, (0, 0.0), "no penalties")
    _only_default(body, "logit_bias", ({},), "no logit bias")
    return info.name, stream, include_usage


def _lengths(prompt_ids: list[int], max_tokens: int | None, default: int | None, info: ModelInfo,
             prompt_param: str) -> int:
    """max_tokens for this prompt: 400 when the prompt, or prompt + max_tokens, cannot fit."""
    n, limit = len(prompt_ids), info.max_len
    if n >= limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens, and the prompt has "
                            f"{n} tokens, leaving no room for output; shorten the {prompt_param}",
                       prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return limit - n if default is None else min(default, limit - n)
    if n + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; you asked for "
                            f"{n + max_tokens} ({n} in the {prompt_param}, {max_tokens} in the completion); "
                            f"reduce max_tokens or the {prompt_param}", "max_tokens", code="context_length_exceeded")
    return max_tokens


def _validate(info: ModelInfo, ids: list[int], params: SamplingParams, prompt_param: str,
              logprobs_param: str) -> None:
    try:
        info.validate(ids, params)
    except (TypeError, ValueError) as e:
        text = str(e)
        param = logprobs_param if "logprobs" in text else prompt_param
        raise APIError(400, text.replace("SamplingParams.", ""), param) from None


# -- /v1/completions --------------------------------------------------------------------
def _prompt_ids(prompt, info: ModelInfo, nested: bool = False) -> list[int]:
    """A prompt: text, token ids, or (OpenAI's batch form, one prompt only) an array
    holding one of those; no deeper nesting."""
    if isinstance(prompt, str):
        _text("prompt", prompt)
        if info.encode_text is None:
            raise _bad("prompt", "must be token ids: this model has no tokenizer")
        return info.encode_text(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise _bad("prompt", f"must be a string, an array of token ids, or an array holding one of those, "
                             f"got {_what(prompt)}")
    if not isinstance(prompt[0], (str, list)):   # token ids
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int):
                raise _bad(f"prompt{'[0]' if nested else ''}[{i}]", f"must be an integer token id, got {_what(t)}")
        return list(prompt)
    if nested:
        raise _bad("prompt[0][0]", f"must be an integer token id, got {_what(prompt[0])}: a prompt nests one "
                                   "level at most")
    if len(prompt) != 1:
        raise _bad("prompt", f"holds {len(prompt)} prompts; this server takes one prompt per request "
                             "(send one request each; they are batched together)")
    inner = prompt[0]
    if isinstance(inner, str) or (isinstance(inner, list) and inner):
        return _prompt_ids(inner, info, nested=True)
    if isinstance(inner, list):
        raise _bad("prompt", "is an empty array of token ids")
    raise _bad("prompt[0]", f"must be a string or an array of token ids, got {_what(inner)}")


def parse_completion(body: dict, info: ModelInfo) -> GenerationRequest:
    model, stream, include_usage = _common(body, info)
    _only_default(body, "echo", (False,), "the prompt is not echoed")
    _only_default(body, "best_of", (1,), "one candidate per request")
    _only_default(body, "suffix", ("",), "no insertion")
    if "prompt" not in body or body["prompt"] is None:
        raise _bad("prompt", "is required")
    ids = _prompt_ids(body["prompt"], info)
    logprobs = _get(body, "logprobs", _integer, 0, MAX_LOGPROBS)
    max_tokens = _get(body, "max_tokens", _integer, 1)
    stop = _stop(body)
    params = _sampling(body, max_tokens=_lengths(ids, max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, info, "prompt"),
                       stop=stop, logprobs=logprobs)
    _validate(info, ids, params, "prompt", "logprobs")
    return GenerationRequest("completions", ids, params, stream, include_usage, logprobs, model)


# -- /v1/chat/completions -----------------------------------------------------------------
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content(param: str, content) -> str:
    if isinstance(content, str):
        return _text(param, content, allow_empty=True)
    if not isinstance(content, list):
        raise _bad(param, f"must be a string or an array of text parts, got {_what(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise _bad(where, "must be a text part {\"type\": \"text\", \"text\": ...}; this model reads text only")
        if "text" not in part:
            raise _bad(f"{where}.text", "is required")
        texts.append(_text(f"{where}.text", part["text"], allow_empty=True))
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise _bad("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"must be a non-empty array of messages, got {_what(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"must be an object with role and content, got {_what(m)}")
        role = m.get("role")
        if role not in _ROLES:
            raise _bad(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {_what(role)}")
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                raise _bad(f"{where}.{key}", "is not supported: this server has no tools")
        if m.get("content") is None:
            raise _bad(f"{where}.content", "is required")
        out.append({"role": _ROLES[role], "content": _content(f"{where}.content", m["content"])})
    return out


def parse_chat(body: dict, info: ModelInfo) -> GenerationRequest:
    model, stream, include_usage = _common(body, info)
    for name in ("tools", "functions"):
        _only_default(body, name, ([],), "no tools")
    for name in ("tool_choice", "function_call"):
        _only_default(body, name, ("none",), "no tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(400, f"response_format is not supported by this server (text only), got {_what(fmt)}",
                       "response_format")
    messages = _messages(body)
    if info.encode_chat is None:
        raise _bad("messages", "cannot be rendered: this model has no chat template; use /v1/completions")
    ids = info.encode_chat(messages)
    want = _get(body, "logprobs", _boolean, default=False)
    top = _get(body, "top_logprobs", _integer, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise _bad("top_logprobs", "needs logprobs set to true")
    logprobs = (top or 0) if want else None
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, name, _integer, 1)
    stop = _stop(body)
    params = _sampling(body, max_tokens=_lengths(ids, max_tokens, None, info, "messages"), stop=stop,
                       logprobs=logprobs)
    _validate(info, ids, params, "messages", "top_logprobs")
    return GenerationRequest("chat", ids, params, stream, include_usage, logprobs, model)


# -- responses ------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def spec_stats(accept_length: float, num_rounds: int) -> dict:
    """Non-standard: mean tokens per verify round (bonus included; 0 without speculation)."""
    return {"accept_length": accept_length, "num_rounds": num_rounds}


def _lp(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(tokens: list, text_offset: int) -> dict:
    """OpenAI's legacy shape: parallel lists; top_logprobs holds the chosen token and the
    k most likely ones, as `SamplingParams.logprobs` returns them."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t in tokens:
        out["tokens"].append(t.token)
        out["token_logprobs"].append(_lp(t.logprob))
        out["top_logprobs"].append({alt.token: _lp(alt.logprob) for alt in t.top})
        out["text_offset"].append(text_offset)
        text_offset += len(t.token)
    return out


def chat_logprobs(tokens: list, k: int) -> dict:
    def entry(t) -> dict:
        return {"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.bytes)}

    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t.top[:k]]} for t in tokens],
            "refusal": None}
