"""Which text a request's tokens have made so far, safe to send before it finishes.

Streamed pieces must concatenate to exactly the text a finished request has (what
`LLM.generate` returns), so a piece is sent only once no later token can change it:

- a byte-level tokenizer may split one character over several tokens; the decoded prefix
  then ends in U+FFFD until the rest arrives, so trailing U+FFFD is held back;
- a stop string cuts the text before its first occurrence, and the engine looks for it
  after every token; an occurrence found later can start at most len(stop) - 1
  characters before the end of the text seen now, so that many characters are held back.

When the request finishes, `finish` sends the rest of its final text.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str] | None, stop: tuple[str, ...] = ()):
        self.decode = decode
        self.holdback = max((len(s) for s in stop), default=1) - 1
        self.sent = ""

    def update(self, output_ids: list[int]) -> str:
        """The new text that is safe to send now ("" if none)."""
        if self.decode is None:
            return ""
        stable = self.decode(output_ids).rstrip(REPLACEMENT)
        if self.holdback:
            stable = stable[: max(len(stable) - self.holdback, 0)]
        if len(stable) <= len(self.sent) or not stable.startswith(self.sent):
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the final text. By the rules above what was sent is its prefix."""
        delta = final_text[len(self.sent):] if final_text.startswith(self.sent) else ""
        self.sent = final_text if final_text.startswith(self.sent) else self.sent
        return delta


# GPT-2's byte <-> printable-character table, which byte-level BPE vocabularies are spelt in.
def _byte_table() -> dict[str, int]:
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTES_OF_CHAR = _byte_table()


class TokenPieces:
    """Each token's own text and bytes, for logprobs ({"token", "bytes"}), memoised, and
    whether it is a special token (which the output text never holds).

    A byte-level token may hold part of a character: its bytes are exact and its text
    shows U+FFFD for the partial character. Special tokens show their name
    (``<|end|>``). Tokens not spelt in the byte table (special tokens of other
    tokenizers, ids past the tokenizer's vocabulary) fall back to decode.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.special = tokenizer.special_token_ids if tokenizer is not None else frozenset()
        self._cache: dict[int, tuple[str, bytes, bool]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes, bool]:
        piece = self._cache.get(token_id)
        if piece is None:
            piece = self._cache[token_id] = (*self._piece(token_id), token_id in self.special)
        return piece

    def _piece(self, token_id: int) -> tuple[str, bytes]:
        tok = self.tokenizer
        if tok is None or token_id >= tok.vocab_size:
            return (f"token_id:{token_id}", b"") if tok is None else ("", b"")
        if token_id in self.special:
            text = tok.id_to_token(token_id) or ""
            return text, text.encode("utf-8")
        spelt = tok.id_to_token(token_id)
        if spelt is not None and all(c in _BYTES_OF_CHAR for c in spelt):
            raw = bytes(_BYTES_OF_CHAR[c] for c in spelt)
            return raw.decode("utf-8", errors="replace"), raw
        text = tok.decode([token_id], skip_special_tokens=False)
        return text, text.encode("utf-8")
