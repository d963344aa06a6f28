"""A byte-level BPE tokenizer (HF ``tokenizers``) and the thin wrapper the engine uses.

Byte-level means every string maps to tokens and back exactly: text is split GPT-2 style,
then each piece is spelt in its UTF-8 bytes, and all 256 bytes are in the vocabulary, so
no input is ever unknown and ``decode(encode(text)) == text`` for any ``str`` (provided it
does not contain a special-token string literally, see ``encode``). There is no
normaliser, for the same reason.

The special tokens (``chat.SPECIAL_TOKENS``) take ids 0-6 in a freshly trained tokenizer.
A checkpoint directory holds ``tokenizer.json`` (the HF ``tokenizers`` file) and
``tokenizer_config.json`` (HF's name for it) with the special tokens and the chat
template (key ``chat_template``; see ``chat.py`` for its format).
"""

from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from branchspec.data.chat import (
    BOS,
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_FORMAT,
    END,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    check_template,
    render_chat,
)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"

# 256 byte tokens and the special tokens come first; a vocabulary must hold them all.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


def _read_json_object(path: Path) -> tuple[str, dict]:
    """The text of a JSON file and the object it holds; ValueError naming the file if it
    is not UTF-8 JSON or holds anything but an object."""
    try:
        text = path.read_text(encoding="utf-8")
        obj = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path} must hold a JSON object, got {json.dumps(obj)[:40]}")
    return text, obj


class Tokenizer:
    """Text <-> token ids, special token ids, and the chat template.

    Terms: ``bos_id`` starts every sequence the model sees; ``eos_id`` ends a
    completion-style document; ``end_id`` (``<|end|>``) closes a chat message, so a chat
    reply stops on it; ``pad_id`` fills batches and is never attended to.
    """

    def __init__(self, backend: _HFTokenizer, chat_template: str = CHAT_TEMPLATE):
        check_template(chat_template)
        self._backend = backend
        self.chat_template = chat_template
        self.special_ids: dict[str, int] = {}
        for token in SPECIAL_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is None:
                raise ValueError(f"tokenizer lacks the special token {token!r}")
            self.special_ids[token] = token_id
        # Counted with the added tokens: every id below this is valid, and it is the
        # size the model's embedding and output layers need.
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_id(self) -> int:
        return self.special_ids[BOS]

    @property
    def eos_id(self) -> int:
        return self.special_ids[EOS]

    @property
    def pad_id(self) -> int:
        return self.special_ids[PAD]

    @property
    def end_id(self) -> int:
        return self.special_ids[END]

    @property
    def stop_ids(self) -> tuple[int, int]:
        """Ids that end generation: ``<|eos|>`` (completion-style) and ``<|end|>`` (chat)."""
        return (self.eos_id, self.end_id)

    def encode(self, text: str, add_bos: bool = False, *, parse_special: bool = True) -> list[int]:
        """Token ids of ``text``, after ``bos_id`` when ``add_bos``.

        With ``parse_special`` (the default) a special-token string in ``text``, such as
        the role markers of a rendered chat, becomes its single id. Pass False for
        untrusted text, which is then spelt out byte by byte like any other text.
        """
        backend = self._backend
        # The backend has one flag for this; it is set per call and restored, so the
        # tokenizer looks stateless to callers (not for concurrent use from threads).
        previous = backend.encode_special_tokens
        backend.encode_special_tokens = not parse_special
        try:
            ids = backend.encode(text, add_special_tokens=False).ids
        finally:
            backend.encode_special_tokens = previous
        return [self.bos_id, *ids] if add_bos else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        """``encode`` over many texts, in parallel inside the backend."""
        encodings = self._backend.encode_batch(list(texts), add_special_tokens=False)
        prefix = [self.bos_id] if add_bos else []
        return [prefix + e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped when ``skip_special_tokens``.

        Accepts Python ints, numpy integers or integer tensors' elements. ValueError
        naming the first id outside ``[0, vocab_size)`` (the backend would silently drop
        it).
        """
        id_list = [operator.index(i) for i in ids]
        if id_list and (min(id_list) < 0 or max(id_list) >= self.vocab_size):
            bad = next(i for i in id_list if not 0 <= i < self.vocab_size)
            raise ValueError(f"unknown token id {bad} (vocab_size is {self.vocab_size})")
        return self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render chat ``messages`` with this tokenizer's template (see ``chat.py``).

        Returns text (no BOS); encode it with ``encode(text, add_bos=True)``.
        """
        return render_chat(messages, add_generation_prompt=add_generation_prompt, template=self.chat_template)

    def encode_chat(
        self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True, add_bos: bool = True
    ) -> list[int]:
        """Token ids of a chat, for untrusted messages: the template's role markers become
        their control ids, while message content is always spelt as text, so a user who
        types ``<|assistant|>`` cannot open a turn.

        Each message is ``head + content + tail`` (the template around ``{content}``);
        head and tail are encoded with special tokens, content without. Messages are
        checked as ``render_chat`` checks them.
        """
        messages = list(messages)
        render_chat(messages, add_generation_prompt=False, template=self.chat_template)   # validates
        head, _, tail = self.chat_template.partition("{content}")
        ids = [self.bos_id] if add_bos else []
        for message in messages:
            ids += self.encode(head.format(role=message["role"]))
            ids += self.encode(message["content"], parse_special=False)
            ids += self.encode(tail.format(role=message["role"]))
        if add_generation_prompt:
            ids += self.encode(head.format(role="assistant"))
        return ids

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(out / TOKENIZER_FILE))
        config = {
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)],
            "add_bos_token": False,  # encode() only adds BOS when asked
            "chat_template": self.chat_template,
            "chat_template_format": CHAT_TEMPLATE_FORMAT,
        }
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (out / CONFIG_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load what ``save`` wrote. Without ``tokenizer_config.json`` the default chat
        template is used; a template in another format (e.g. jinja) is a ValueError.

        No ``tokenizer.json`` is a FileNotFoundError. Either file corrupt, truncated or of
        the wrong shape is a ValueError naming it (``tokenizers`` itself raises a bare
        Exception, which callers cannot catch selectively).
        """
        path = Path(directory)
        tokenizer_path = path / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise FileNotFoundError(f"no {TOKENIZER_FILE} in {path}")
        text, _ = _read_json_object(tokenizer_path)
        try:
            backend = _HFTokenizer.from_str(text)
        except Exception as e:  # noqa: BLE001 - the backend's errors are plain Exception
            raise ValueError(f"{tokenizer_path} is not a tokenizers file: {e}") from e
        template = CHAT_TEMPLATE
        config_path = path / CONFIG_FILE
        if config_path.is_file():
            _, config = _read_json_object(config_path)
            template_format = config.get("chat_template_format")
            if "chat_template" in config and template_format != CHAT_TEMPLATE_FORMAT:
                raise ValueError(
                    f"{config_path}: chat_template_format is {template_format!r}; only "
                    f"{CHAT_TEMPLATE_FORMAT!r} templates can be rendered"
                )
            template = config.get("chat_template", CHAT_TEMPLATE)
            if not isinstance(template, str):
                raise ValueError(f"{config_path}: chat_template must be a string, got "
                                 f"{type(template).__name__}")
            try:
                check_template(template)
            except ValueError as e:
                raise ValueError(f"{config_path}: {e}") from e
        try:
            return cls(backend, chat_template=template)
        except ValueError as e:  # a missing special token
            raise ValueError(f"{tokenizer_path}: {e}") from e

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8192,
    *,
    min_frequency: int = 2,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer of (at most) ``vocab_size`` tokens on ``texts``.

    The vocabulary is smaller than ``vocab_size`` when the texts support fewer merges
    (pairs seen fewer than ``min_frequency`` times are never merged); read
    ``Tokenizer.vocab_size`` for the real size.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens)")
    backend = _HFTokenizer(models.BPE())
    # No prefix space: " x" and "x" stay different tokens, and decoding restores exactly
    # what was encoded, with nothing to strip.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # All 256 bytes, seen or not, so any future input still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    # The trainer does not split out special tokens the way encode() does, so from
    # rendered chats it would learn merges such as "<|" and "|>" that encode() never
    # uses. Feeding the text between special tokens as separate pieces trains on exactly
    # what encode() will see.
    pieces = (piece for text in texts for piece in _SPECIAL_RE.split(text) if piece)
    backend.train_from_iterator(pieces, trainer=trainer)
    return Tokenizer(backend)
