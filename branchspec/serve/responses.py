"""The JSON we answer with: OpenAI's responses, stream chunks and logprobs, vLLM's extras.

Beyond OpenAI's fields: `token_ids` on each choice (the chunk's tokens in a stream, as
vLLM's `return_token_ids`), `stop_reason` (vLLM's: the stop string or stop id that ended
the choice, null for EOS or length), `prompt_logprobs` when asked (vLLM's layout), and
`spec_stats` (accept length and verify rounds) on a response or on a choice's last chunk.
"""

from __future__ import annotations

import time

from branchspec.serve.protocol import GenerationRequest, PromptInput
from branchspec.serve.worker import Alternative, Output, TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf; OpenAI and vLLM report this instead


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def request_usage(req: GenerationRequest, outs: list[Output]) -> dict:
    """Usage of a whole request: each prompt counted once, every sample's tokens summed
    (as OpenAI and vLLM count n > 1)."""
    return usage(sum(len(p.ids) for p in req.prompts), sum(o.completion_tokens for o in outs))


def spec_stats(outs: list[Output]) -> dict:
    """Non-standard: mean tokens per verify round (bonus included; 0 without speculation)
    and verify rounds, over the given samples."""
    rounds = sum(o.num_rounds for o in outs)
    return {"accept_length": sum(o.num_emitted for o in outs) / rounds if rounds else 0.0, "num_rounds": rounds}


def _lp(x: float) -> float:
    return x if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def _top(t: TokenLogprob, k: int) -> list[Alternative]:
    """The k most likely tokens at t's place, and t itself if it is not among them (k or k + 1)."""
    top = t.top[:k]
    return top if any(a.token_id == t.token_id for a in top) else top + [t]


class TextOffsets:
    """OpenAI's text_offset: where each token's text starts in its choice's text, counted
    from the tokens' bytes as they arrive (a stream's chunks share one). A token the text
    does not spell (`spelt`) takes no room; a character split over two tokens is one
    character, and a token that continues it points at it."""

    def __init__(self) -> None:
        self.chars = 0        # characters the text holds so far: its UTF-8 lead bytes

    def place(self, raw: bytes, spelt: bool) -> int:
        """The offset of a token of bytes `raw`, which then moves the count if `spelt`."""
        if not spelt:
            return self.chars
        continues = bool(raw) and 0x80 <= raw[0] < 0xC0 and self.chars > 0
        offset = self.chars - continues
        self.chars += sum(1 for b in raw if not 0x80 <= b < 0xC0)
        return offset


def spelt(prompt: PromptInput, echoed: list[TokenLogprob], generated: list[TokenLogprob]) -> list[bool]:
    """Which of a choice's tokens its text spells: of the echoed prompt, all but a BOS the
    server added, and special tokens only where the client gave the text (text decoded
    from ids skips them); of the generated ones, special tokens only with
    skip_special_tokens false."""
    skip = prompt.params.skip_special_tokens
    return ([not (i == 0 and prompt.bos_added) and (prompt.specials_spelt or not t.special)
             for i, t in enumerate(echoed)] + [not (t.special and skip) for t in generated])


def completion_logprobs(tokens: list[TokenLogprob], spelt_flags: list[bool], offsets: TextOffsets, k: int,
                        text_length: int | None = None) -> dict:
    """OpenAI's legacy layout (parallel lists); `offsets` moves past the tokens (see
    `TextOffsets`, `spelt`), and an offset past `text_length` (a token a stop string cut
    off) is the text's end.

    A token nothing scores (the first prompt token, under echo) gets null logprobs.
    top_logprobs is keyed by token text: of tokens spelling the same text (parts of one
    character) the most likely keeps the key, so its maximum stays the top token's
    (lm-eval's greedy test)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, spelt_here in zip(tokens, spelt_flags):
        out["tokens"].append(t.token)
        out["token_logprobs"].append(None if t.logprob is None else _lp(t.logprob))
        top: dict[str, float] | None = None
        if t.logprob is not None:
            top = {}
            for a in _top(t, k):           # most likely first
                top.setdefault(a.token, _lp(a.logprob))
        out["top_logprobs"].append(top)
        offset = offsets.place(t.bytes, spelt_here)
        out["text_offset"].append(offset if text_length is None else min(offset, text_length))
    return out


def chat_logprobs(tokens: list[TokenLogprob], k: int) -> dict:
    def entry(t) -> dict:
        return {"token": t.token, "logprob": _lp(t.logprob), "bytes": list(t.bytes)}

    return {"content": [{**entry(t), "top_logprobs": [entry(a) for a in t.top[:k]]} for t in tokens],
            "refusal": None}


def prompt_logprobs(tokens: list[TokenLogprob], k: int) -> list:
    """vLLM's prompt_logprobs: null for the first token, then per token a dict from token id
    to {logprob, rank, decoded_token}: the prompt token and the k most likely there."""
    return [None if t.logprob is None else
            {str(a.token_id): {"logprob": _lp(a.logprob), "rank": a.rank, "decoded_token": a.token}
             for a in _top(t, k)} for t in tokens]


def _object(req: GenerationRequest, chunk: bool) -> str:
    if req.endpoint == "chat":
        return "chat.completion.chunk" if chunk else "chat.completion"
    return "text_completion"


def chunk(req: GenerationRequest, rid: str, created: int, index: int, delta, logprobs, token_ids: list[int],
          finish_reason: str | None, stop_reason=None, completion_tokens: int = 0) -> dict:
    """One stream chunk of choice `index` (`delta`: the chat delta, or the completion text;
    `completion_tokens`: the choice's tokens so far, for continuous usage)."""
    choice = {"index": index, ("delta" if req.endpoint == "chat" else "text"): delta, "logprobs": logprobs,
              "finish_reason": finish_reason, "token_ids": token_ids}
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    body = {"id": rid, "object": _object(req, True), "created": created, "model": req.model, "choices": [choice]}
    if req.continuous_usage:        # vLLM: this choice's usage so far on every chunk
        body["usage"] = usage(len(req.prompts[index // req.n].ids), completion_tokens)
    elif req.include_usage:
        body["usage"] = None        # OpenAI: every chunk has it, null but in the last one
    return body


def usage_chunk(req: GenerationRequest, rid: str, created: int, outs: list[Output]) -> dict:
    return {"id": rid, "object": _object(req, True), "created": created, "model": req.model, "choices": [],
            "usage": request_usage(req, outs)}


def response_body(req: GenerationRequest, rid: str, outs: list[Output]) -> dict:
    """The whole answer; outs[i] is choice i's (only, final) Output."""
    choices = []
    for out in outs:
        prompt = req.prompts[out.index // req.n]
        choice: dict = {"index": out.index}
        if req.endpoint == "chat":
            choice["message"] = {"role": "assistant", "content": out.text}
            choice["logprobs"] = None if out.logprobs is None else chat_logprobs(out.logprobs, req.logprobs)
        else:
            echoed = (out.prompt_logprobs or []) if req.echo else []
            choice["text"] = (prompt.text or "") + out.text if req.echo else out.text
            choice["logprobs"] = None if out.logprobs is None else completion_logprobs(
                echoed + out.logprobs, spelt(prompt, echoed, out.logprobs), TextOffsets(), req.logprobs,
                len(choice["text"]))
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs(out.prompt_logprobs or [], req.prompt_logprobs)
        choice["finish_reason"] = out.finish_reason
        choice["stop_reason"] = out.stop_reason
        choice["token_ids"] = out.token_ids
        choices.append(choice)
    body = {"id": rid, "object": _object(req, False), "created": int(time.time()), "model": req.model,
            "choices": choices, "usage": request_usage(req, outs), "spec_stats": spec_stats(outs)}
    if req.endpoint == "chat" and req.prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs(outs[0].prompt_logprobs or [], req.prompt_logprobs)
    return body
