"""What an OpenAI request means.

`parse_completion` and `parse_chat` check a /v1/completions or /v1/chat/completions body
field by field (`fields`) and turn it into prompts of token ids with their
`SamplingParams`; anything wrong raises `APIError` (HTTP 400, OpenAI's error JSON, `param`
naming the field). OpenAI's parameters and vLLM's sampling extras are implemented, or
refused unless they carry their no-op value: none is accepted and ignored.

A request is one or more prompts (completions take an array, as OpenAI and vLLM do), each
sampled `n` times: prompt i's sample j is choice i * n + j, run as its own engine request.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from branchspec.config import MAX_N, SamplingParams
from branchspec.serve import fields
from branchspec.serve.fields import APIError, bad, boolean, get, integer, number, only_default, what

MAX_LOGPROBS = 20        # OpenAI's limit for top_logprobs (vLLM's default max_logprobs)
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's default for /v1/completions


@dataclass
class PromptInput:
    """One prompt of a request and how its samples are drawn."""

    ids: list[int]
    text: str | None             # as echoed: the prompt text, or its ids decoded (None: not asked)
    params: SamplingParams       # params.n samples
    # Which prompt tokens the echoed text spells (for text_offset): not a BOS the server
    # added to a text prompt, and special tokens only in text the client gave (text
    # decoded from ids skips them).
    bos_added: bool = False
    specials_spelt: bool = True


@dataclass
class GenerationRequest:
    """One checked request: what the worker runs and how the answer is shaped."""

    endpoint: str                    # "completions" or "chat"
    prompts: list[PromptInput]
    stream: bool
    include_usage: bool              # stream_options.include_usage: a last chunk with usage
    logprobs: int | None             # alternatives per generated token to report; None: no logprobs
    model: str
    echo: bool = False               # completions: the prompt (and its logprobs) before the output
    prompt_logprobs: int | None = None   # vLLM's extra: alternatives per prompt token to report
    continuous_usage: bool = False   # vLLM's stream_options.continuous_usage_stats: usage on every chunk

    @property
    def n(self) -> int:
        return self.prompts[0].params.n

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n


@dataclass
class ModelInfo:
    """What parsing needs to know about the served model."""

    name: str
    max_len: int
    encode_text: Callable[[str, bool], list[int]] | None    # (text, add BOS); None: no tokenizer
    encode_chat: Callable[..., list[int]] | None            # (messages, add_generation_prompt=True); None: none
    decode: Callable[[list[int]], str] | None                # ids -> text (echo of id prompts)
    validate: Callable[[list[int], SamplingParams], None]   # Engine.validate
    max_choices: int                                        # engine requests one HTTP request may hold
    # Characters beyond which a text cannot fit max_len tokens (max_len times the most
    # characters one token spells: `Tokenizer.max_token_chars`); None: no such bound.
    max_prompt_chars: int | None = None
    bos_id: int | None = None                               # what encode_text(text, True) puts first


# vLLM's and OpenAI's parameters this server does not implement: refused unless they carry
# their no-op value (an empty tuple: any value is refused).
_UNSUPPORTED = {
    "best_of": ((1,), "one candidate per sample"),
    "suffix": (("",), "no insertion"),
    "use_beam_search": ((False,), "no beam search"),
    "length_penalty": ((1, 1.0), "no beam search"),
    "spaces_between_special_tokens": ((True,), "special tokens are never in the text"),
    "return_tokens_as_token_ids": ((False,), "tokens are reported as text"),
    "allowed_token_ids": ((), "no allowed-token list"),
    "bad_words": (([],), "no bad-words list"),
    "truncate_prompt_tokens": ((), "prompts are never truncated"),
    "guided_json": ((), "no guided decoding"), "guided_regex": ((), "no guided decoding"),
    "guided_choice": ((), "no guided decoding"), "guided_grammar": ((), "no guided decoding"),
    "structured_outputs": ((), "no guided decoding"),
    "prompt_embeds": ((), "prompts are text or token ids"),
}


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): a last chunk with the usage; and vLLM's
    usage so far on every chunk (which needs include_usage, as in vLLM)."""
    options = body.get("stream_options")
    if options is None:
        return False, False
    if not stream:
        raise bad("stream_options", "is only allowed when stream is true")
    if not isinstance(options, dict):
        raise bad("stream_options", f"must be an object, got {what(options)}")
    for key in options:
        if key not in ("include_usage", "continuous_usage_stats"):
            raise bad(f"stream_options.{key}", "is not an option this server knows (include_usage, "
                                               "continuous_usage_stats)")
    include = get(options, "include_usage", lambda n, v: boolean("stream_options.include_usage", v), default=False)
    continuous = get(options, "continuous_usage_stats",
                     lambda n, v: boolean("stream_options.continuous_usage_stats", v), default=False)
    if continuous and not include:
        raise bad("stream_options.continuous_usage_stats", "needs stream_options.include_usage set to true")
    return include, continuous


_FIELD_RE = re.compile(r"SamplingParams\.(\w+(?:\[\d+\])?)")


def _param_of(message: str, default: str | None, renames: dict[str, str]) -> str | None:
    m = _FIELD_RE.search(message)
    if not m:
        return default
    name = m.group(1)
    return renames.get(name, name)


def _sampling(body: dict, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
              max_param: str) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=get(body, "temperature", number, default=1.0),   # OpenAI's default
            top_p=get(body, "top_p", number, default=1.0),
            top_k=get(body, "top_k", integer, default=-1),
            min_p=get(body, "min_p", number, default=0.0),
            max_tokens=max_tokens,
            min_tokens=get(body, "min_tokens", integer, default=0),
            seed=get(body, "seed", fields.seed),
            stop=fields.stop_strings(body),
            stop_token_ids=tuple(get(body, "stop_token_ids", fields.token_ids, default=[])),
            ignore_eos=get(body, "ignore_eos", boolean, default=False),
            include_stop_str_in_output=get(body, "include_stop_str_in_output", boolean, default=False),
            skip_special_tokens=get(body, "skip_special_tokens", boolean, default=True),
            n=get(body, "n", integer, 1, MAX_N, default=1),
            presence_penalty=get(body, "presence_penalty", number, default=0.0),
            frequency_penalty=get(body, "frequency_penalty", number, default=0.0),
            repetition_penalty=get(body, "repetition_penalty", number, default=1.0),
            logit_bias=get(body, "logit_bias", fields.logit_bias, default={}),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except (TypeError, ValueError) as e:   # SamplingParams' own range checks name the field
        text = str(e).replace("SamplingParams.", "")
        raise APIError(400, text, _param_of(str(e), None, {"max_tokens": max_param})) from None


def _common(body: dict, info: ModelInfo) -> tuple[str, bool, tuple[bool, bool]]:
    _model(body, info)
    stream = get(body, "stream", boolean, default=False)
    usage = _stream_options(body, stream)
    for name, (allowed, why) in _UNSUPPORTED.items():
        only_default(body, name, allowed, why)
    return info.name, stream, usage


def _max_tokens(n: int, max_tokens: int | None, default: int | None, info: ModelInfo, prompt_param: str,
                max_param: str) -> int:
    """max_tokens for a prompt of n tokens: 400 when the prompt, or prompt + max_tokens, cannot fit."""
    limit = info.max_len
    if n > limit or (n == limit and max_tokens != 0):
        raise APIError(400, f"this model's maximum context length is {limit} tokens, and the prompt has "
                            f"{n} tokens, leaving no room for output; shorten the {prompt_param}",
                       prompt_param, code="context_length_exceeded")
    if max_tokens is None:
        return limit - n if default is None else min(default, limit - n)
    if n + max_tokens > limit:
        raise APIError(400, f"this model's maximum context length is {limit} tokens; you asked for "
                            f"{n + max_tokens} ({n} in the {prompt_param}, {max_tokens} in the completion); "
                            f"reduce {max_param} or the {prompt_param}", max_param, code="context_length_exceeded")
    return max_tokens


def _check_prompt_chars(num_chars: int, info: ModelInfo, param: str) -> None:
    """Refuse, before tokenizing it, a text too long for any of its tokenizations to fit
    the context: tokenizing megabytes takes seconds, and the answer would be this 400."""
    bound = info.max_prompt_chars
    if bound is not None and num_chars > bound:
        raise APIError(400, f"this model's maximum context length is {info.max_len} tokens, and the {param} has "
                            f"{num_chars} characters, more than {info.max_len} tokens of its tokenizer can spell "
                            f"({bound // info.max_len} characters at most each); shorten the {param}",
                       param, code="context_length_exceeded")


def _validate(info: ModelInfo, ids: list[int], params: SamplingParams, prompt_param: str,
              renames: dict[str, str]) -> None:
    try:
        info.validate(ids, params)
    except (TypeError, ValueError) as e:
        raise APIError(400, str(e).replace("SamplingParams.", ""), _param_of(str(e), prompt_param, renames)) from None


def _check_choices(count: int, info: ModelInfo, param: str) -> None:
    if count > info.max_choices:
        raise bad(param, f"asks for {count} samples in one request; this server runs at most {info.max_choices} "
                         "at once (running + queued requests)")


def _prompt_logprobs(body: dict, stream: bool) -> int | None:
    k = get(body, "prompt_logprobs", integer, 0, MAX_LOGPROBS)
    if k is not None and stream:
        raise bad("prompt_logprobs", "is not available when stream is true (as in vLLM)")
    return k


# -- /v1/completions --------------------------------------------------------------------
def _ids(param: str, prompt: list) -> list[int]:
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, int):
            raise bad(f"{param}[{i}]", f"must be an integer token id, got {what(t)}")
    return list(prompt)


def _prompts(prompt, info: ModelInfo, add_bos: bool) -> list[tuple[list[int], str | None]]:
    """(ids, text or None) of each prompt: a string, an array of token ids, or an array of those."""
    def encode(param: str, value: str) -> list[int]:
        fields.text(param, value)
        if info.encode_text is None:
            raise bad(param, "must be token ids: this model has no tokenizer")
        _check_prompt_chars(len(value), info, param)
        return info.encode_text(value, add_bos)

    if isinstance(prompt, str):
        return [(encode("prompt", prompt), prompt)]
    if not isinstance(prompt, list) or not prompt:
        raise bad("prompt", f"must be a string, an array of token ids, or an array of those, got {what(prompt)}")
    if not isinstance(prompt[0], (str, list)):   # one prompt of token ids
        return [(_ids("prompt", prompt), None)]
    out = []
    for i, inner in enumerate(prompt):
        where = f"prompt[{i}]"
        if isinstance(inner, str):
            out.append((encode(where, inner), inner))
        elif isinstance(inner, list) and inner:
            out.append((_ids(where, inner), None))
        elif isinstance(inner, list):
            raise bad(where, "is an empty array of token ids")
        else:
            raise bad(where, f"must be a string or an array of token ids, got {what(inner)}")
    return out


def parse_completion(body: dict, info: ModelInfo) -> GenerationRequest:
    model, stream, (include_usage, continuous) = _common(body, info)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required")
    echo = get(body, "echo", boolean, default=False)
    add_bos = get(body, "add_special_tokens", boolean, default=True)
    n = get(body, "n", integer, 1, MAX_N, default=1)
    raw = body["prompt"]
    num_prompts = len(raw) if isinstance(raw, list) and raw and isinstance(raw[0], (str, list)) else 1
    _check_choices(num_prompts * n, info, "n" if num_prompts == 1 else "prompt")   # before any encoding
    prompts = _prompts(raw, info, add_bos)
    logprobs = get(body, "logprobs", integer, 0, MAX_LOGPROBS)
    prompt_lp = _prompt_logprobs(body, stream)
    # The prompt's logprobs are computed once, for whichever of the two views asks more.
    engine_prompt_lp = max(k for k in (prompt_lp, logprobs if echo else None, -1) if k is not None)
    max_tokens = get(body, "max_tokens", integer, 0)
    out = []
    for i, (ids, text) in enumerate(prompts):
        given = text is not None
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
        params = _sampling(body, max_tokens=_max_tokens(len(ids), max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, info,
                                                        where, "max_tokens"),
                           logprobs=logprobs, prompt_logprobs=None if engine_prompt_lp < 0 else engine_prompt_lp,
                           max_param="max_tokens")
        _validate(info, ids, params, where, {"logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"})
        if echo and text is None and info.decode is not None:
            text = info.decode(ids)
        out.append(PromptInput(ids, text, params, bos_added=given and add_bos and info.bos_id is not None,
                               specials_spelt=given))
    return GenerationRequest("completions", out, stream, include_usage, logprobs, model, echo=echo,
                             prompt_logprobs=prompt_lp, continuous_usage=continuous)


# -- /v1/chat/completions -----------------------------------------------------------------
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


def _content(param: str, content) -> str:
    if isinstance(content, str):
        return fields.text(param, content, allow_empty=True)
    if not isinstance(content, list):
        raise bad(param, f"must be a string or an array of text parts, got {what(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad(where, "must be a text part {\"type\": \"text\", \"text\": ...}; this model reads text only")
        if "text" not in part:
            raise bad(f"{where}.text", "is required")
        texts.append(fields.text(f"{where}.text", part["text"], allow_empty=True))
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise bad("messages", "is required")
    if not isinstance(messages, list) or not messages:
        raise bad("messages", f"must be a non-empty array of messages, got {what(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"must be an object with role and content, got {what(m)}")
        role = m.get("role")
        if role not in _ROLES:
            raise bad(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {what(role)}")
        for key in ("tool_calls", "function_call"):
            if m.get(key):
                raise bad(f"{where}.{key}", "is not supported: this server has no tools")
        if m.get("content") is None:
            raise bad(f"{where}.content", "is required")
        out.append({"role": _ROLES[role], "content": _content(f"{where}.content", m["content"])})
    return out


def parse_chat(body: dict, info: ModelInfo) -> GenerationRequest:
    model, stream, (include_usage, continuous) = _common(body, info)
    for name in ("tools", "functions"):
        only_default(body, name, ([],), "no tools")
    for name in ("tool_choice", "function_call"):
        only_default(body, name, ("none",), "no tools")
    only_default(body, "echo", (False,), "the conversation is not echoed")
    only_default(body, "add_generation_prompt", (True,), "the reply always opens an assistant turn")
    only_default(body, "continue_final_message", (False,), "the reply always opens an assistant turn")
    only_default(body, "add_special_tokens", (False,), "the chat template adds BOS itself")
    only_default(body, "chat_template", (), "the checkpoint's own chat template is used")
    only_default(body, "chat_template_kwargs", ({},), "the template takes no arguments")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(400, f"response_format is not supported by this server (text only), got {what(fmt)}",
                       "response_format")
    messages = _messages(body)
    if info.encode_chat is None:
        raise bad("messages", "cannot be rendered: this model has no chat template; use /v1/completions")
    _check_prompt_chars(sum(len(m["content"]) for m in messages), info, "messages")
    ids = info.encode_chat(messages)
    _check_choices(get(body, "n", integer, 1, MAX_N, default=1), info, "n")
    want = get(body, "logprobs", boolean, default=False)
    top = get(body, "top_logprobs", integer, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "needs logprobs set to true")
    logprobs = (top or 0) if want else None
    prompt_lp = _prompt_logprobs(body, stream)
    # Both names are checked: max_tokens is OpenAI's older name for max_completion_tokens,
    # and a value beside the other must not be ignored (vLLM takes max_completion_tokens).
    given = {n: get(body, n, integer, 1) for n in ("max_completion_tokens", "max_tokens") if body.get(n) is not None}
    if len(set(given.values())) > 1:
        raise bad("max_tokens", f"({given['max_tokens']}) and max_completion_tokens ({given['max_completion_tokens']}) "
                                "disagree; give one of them (max_tokens is the older name)")
    name = next(iter(given), "max_tokens")
    max_tokens = given.get(name)
    params = _sampling(body, max_tokens=_max_tokens(len(ids), max_tokens, None, info, "messages", name),
                       logprobs=logprobs, prompt_logprobs=prompt_lp, max_param=name)
    _validate(info, ids, params, "messages", {"logprobs": "top_logprobs", "max_tokens": name})
    return GenerationRequest("chat", [PromptInput(ids, None, params)], stream, include_usage, logprobs, model,
                             prompt_logprobs=prompt_lp, continuous_usage=continuous)


# -- /tokenize and /detokenize (vLLM's) ---------------------------------------------------
@dataclass
class TokenizeRequest:
    ids: list[int]
    return_token_strs: bool


def parse_tokenize(body: dict, info: ModelInfo) -> TokenizeRequest:
    """{"prompt": text, "add_special_tokens": true} or {"messages": [...],
    "add_generation_prompt": true}, as vLLM's /tokenize takes them."""
    _model(body, info)
    strs = get(body, "return_token_strs", boolean, default=False)
    if "messages" in body:
        only_default(body, "add_special_tokens", (False,), "the chat template adds BOS itself")
        only_default(body, "continue_final_message", (False,), "the reply always opens an assistant turn")
        messages = _messages(body)
        if info.encode_chat is None:
            raise bad("messages", "cannot be rendered: this model has no chat template")
        return TokenizeRequest(info.encode_chat(messages, get(body, "add_generation_prompt", boolean, default=True)),
                               strs)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required (or messages)")
    prompt = fields.text("prompt", body["prompt"])
    if info.encode_text is None:
        raise bad("prompt", "cannot be tokenized: this model has no tokenizer")
    return TokenizeRequest(info.encode_text(prompt, get(body, "add_special_tokens", boolean, default=True)), strs)


def parse_detokenize(body: dict, info: ModelInfo, vocab_size: int) -> list[int]:
    _model(body, info)
    if body.get("tokens") is None:
        raise bad("tokens", "is required")
    ids = fields.token_ids("tokens", body["tokens"])
    for i, t in enumerate(ids):
        if t >= vocab_size:
            raise bad(f"tokens[{i}]", f"is outside the vocabulary [0, {vocab_size}), got {t}")
    if info.decode is None:
        raise bad("tokens", "cannot be detokenized: this model has no tokenizer")
    return ids


def _model(body: dict, info: ModelInfo) -> None:
    model = body.get("model")
    if model is not None and fields.text("model", model) != info.name:
        raise APIError(404, f"the model {model!r} does not exist; this server serves {info.name!r}",
                       "model", code="model_not_found")
