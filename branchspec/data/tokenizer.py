"""A byte-level BPE tokenizer (HF ``tokenizers``) and the thin wrapper the engine uses.

Byte-level means every string maps to tokens and back exactly: text is split GPT-2 style,
then each piece is spelt in its UTF-8 bytes, and all 256 bytes are in the vocabulary, so
no input is ever unknown and ``decode(encode(text)) == text`` for any ``str`` (provided it
does not contain a special-token string literally, see ``encode``). There is no
normaliser, for the same reason.

The special tokens (``chat.SPECIAL_TOKENS``) take ids 0-6 in a freshly trained tokenizer.
A checkpoint directory holds ``tokenizer.json`` (the HF ``tokenizers`` file) and
``tokenizer_config.json`` (HF's name for it) with the special tokens and the chat
template: branchspec's own under ``branchspec_chat_template`` (see ``chat.py`` for its
format) and the same written in Jinja under ``chat_template``, for transformers.

BOS: a text prompt starts with ``<|bos|>`` (``encode(text, add_bos=True)``, what the
server and ``LLM.generate`` do) and token-id prompts are taken exactly as given, as in
vLLM. The saved files state that rule for other tools: ``add_bos_token: true`` and
``bos_token`` in ``tokenizer_config.json``, and a post-processor in ``tokenizer.json``
that adds BOS when asked for special tokens, so transformers'
``AutoTokenizer.from_pretrained(folder)(text).input_ids`` are the ids the server makes
of ``text``, and its ``apply_chat_template`` (which adds none) the ids of a chat.

A foreign checkpoint's tokenizer (e.g. a Hugging Face one, without these special tokens)
loads as a ``ForeignTokenizer``: bos/eos from its ``tokenizer_config.json`` or the model's
``config.json``, and no chat template unless a branchspec-format one is present.
"""

from __future__ import annotations

import functools
import json
import operator
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from branchspec.data.chat import (
    BOS,
    CHAT_TEMPLATE,
    CHAT_TEMPLATE_FORMAT,
    END,
    EOS,
    PAD,
    SPECIAL_TOKENS,
    check_template,
    jinja_chat_template,
    render_chat,
)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
# Where branchspec's own (str.format) chat template is kept; `chat_template` holds its Jinja form.
OWN_TEMPLATE_KEY = "branchspec_chat_template"

# 256 byte tokens and the special tokens come first; a vocabulary must hold them all.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))


# A text this long (or a quarter as many ids, to decode) goes through the backend's batch
# call, which releases the GIL while it works (its one-text `encode` and `decode` hold it: a
# prompt of megabytes held every other thread, a server's event loop included, for
# seconds). Shorter ones take the plain call, which keeps the backend's thread pool (and
# its warning on a later fork) out of use.
RELEASE_GIL_CHARS = 1 << 16


def _encode_releasing_gil(backend: _HFTokenizer, text: str) -> list[int]:
    batch = getattr(backend, "encode_batch_fast", backend.encode_batch)   # _fast: no offsets (tokenizers >= 0.20)
    return batch([text], add_special_tokens=False)[0].ids


# Pre-tokenizers that split text without dropping any of it (ByteLevel and Metaspace
# respell it, a Split that keeps its matches keeps them).
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split")


def _keeps_every_character(pre: dict | None) -> bool:
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(p) for p in pre.get("pretokenizers", []))
    if kind == "Split" or kind == "Punctuation":
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


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
            if len(text) < RELEASE_GIL_CHARS:
                ids = backend.encode(text, add_special_tokens=False).ids
            else:   # the same ids, computed without holding the GIL (see RELEASE_GIL_CHARS)
                ids = _encode_releasing_gil(backend, text)
        finally:
            backend.encode_special_tokens = previous
        return [self.bos_id, *ids] if add_bos else ids

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token can stand for (its longest entry, an
        added token's content included), so a text of more than n times this many
        characters has more than n tokens, which a server can tell without tokenizing it.
        None where the bound does not hold: a normaliser (NFC composes two characters into
        one) or a pre-tokenizer that drops characters (whitespace splitting) lets a token
        stand for more of the input than its own spelling."""
        try:
            spec = json.loads(self._backend.to_str())
        except (ValueError, TypeError):
            return None
        if spec.get("normalizer") is not None or not _keeps_every_character(spec.get("pre_tokenizer")):
            return None
        vocab = self._backend.get_vocab(with_added_tokens=True)
        return max((len(token) for token in vocab), default=None)

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
        if len(id_list) < RELEASE_GIL_CHARS // 4:
            return self._backend.decode(id_list, skip_special_tokens=skip_special_tokens)
        # The batch call releases the GIL (a million ids held it for a second otherwise).
        return self._backend.decode_batch([id_list], skip_special_tokens=skip_special_tokens)[0]

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The ids ``decode`` drops with ``skip_special_tokens`` (added special tokens)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

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

        The chat is the rendered text (``render_chat``), cut only at the template's own
        special tokens; the text between two of them (template text and content alike) is
        encoded as one piece with special tokens spelt. So for content that spells no
        special token the ids are exactly those of encoding the rendered text whole, as
        the training documents were and as transformers encodes the Jinja template's
        output. Messages are checked as ``render_chat`` checks them.
        """
        messages = list(messages)
        render_chat(messages, add_generation_prompt=False, template=self.chat_template)   # validates
        head, _, tail = self.chat_template.partition("{content}")
        pieces = []   # (text, from the template)
        for message in messages:
            pieces += [(head.format(role=message["role"]), True), (message["content"], False),
                       (tail.format(role=message["role"]), True)]
        if add_generation_prompt:
            pieces.append((head.format(role="assistant"), True))
        added = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items()}
        ids = [self.bos_id] if add_bos else []
        text = ""     # plain text waiting for the next special token of the template
        for piece, trusted in pieces:
            if not trusted:
                text += piece
                continue
            at = 0
            for m in _SPECIAL_RE.finditer(piece):
                if m.group() not in added:   # not a token of this vocabulary: text
                    continue
                text += piece[at:m.start()]
                if text:
                    ids += self.encode(text, parse_special=False)
                ids.append(added[m.group()])
                text, at = "", m.end()
            text += piece[at:]
        if text:
            ids += self.encode(text, parse_special=False)
        return ids

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        # branchspec always encodes with add_special_tokens=False, so the post-processor
        # only speaks to other tools: BOS first when they ask for special tokens.
        backend = _HFTokenizer.from_str(self._backend.to_str())
        backend.post_processor = processors.TemplateProcessing(
            single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, self.bos_id)])
        _save_backend(backend, out / TOKENIZER_FILE)
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (BOS, EOS, PAD)],
            # Text prompts start with BOS (token-id prompts are taken as given).
            "add_bos_token": True,
            "add_eos_token": False,
            "chat_template": jinja_chat_template(self.chat_template),
            OWN_TEMPLATE_KEY: self.chat_template,
            "chat_template_format": CHAT_TEMPLATE_FORMAT,   # of branchspec_chat_template
        }
        text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
        (out / CONFIG_FILE).write_text(text, encoding="utf-8")

    @classmethod
    def from_dir(cls, directory: str | os.PathLike[str]) -> Tokenizer:
        """Load what ``save`` wrote. Without ``tokenizer_config.json`` the default chat
        template is used. The template is ``branchspec_chat_template``, or, in folders
        written before it existed, ``chat_template`` in branchspec's format; a Jinja
        ``chat_template`` alone is a ValueError (branchspec never renders Jinja).

        A foreign tokenizer (one without branchspec's special tokens whose
        ``tokenizer_config.json`` names other bos/eos tokens, or that sits beside a Hugging
        Face or DeepSeek ``config.json``) loads as a ``ForeignTokenizer``.

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
        config = _read_json_object(config_path)[1] if config_path.is_file() else None
        if _is_foreign(backend, config, path):
            return ForeignTokenizer.from_parts(backend, config, path)
        if config is not None:
            template_format = config.get("chat_template_format")
            key = OWN_TEMPLATE_KEY if OWN_TEMPLATE_KEY in config else "chat_template"
            if key in config and template_format != CHAT_TEMPLATE_FORMAT:
                raise ValueError(
                    f"{config_path}: chat_template_format is {template_format!r}; only "
                    f"{CHAT_TEMPLATE_FORMAT!r} templates can be rendered"
                )
            template = config.get(key, CHAT_TEMPLATE)
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


def _save_backend(backend: _HFTokenizer, path: Path) -> None:
    """``tokenizers``' save, whose I/O failures (a full disk) are bare Exceptions: raised
    as the OSError they are, naming the file."""
    from branchspec.atomic import os_error_of

    try:
        backend.save(str(path))
    except Exception as e:   # noqa: BLE001 - the backend's errors are plain Exception
        error = os_error_of(e, path)
        if error is None:
            raise
        raise error from e


def _token_content(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _model_config(path: Path) -> dict:
    """``config.json`` beside the tokenizer, if it is a readable JSON object, else {}."""
    try:
        obj = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return obj if isinstance(obj, dict) else {}


def _is_foreign(backend: _HFTokenizer, config: dict | None, path: Path) -> bool:
    """A tokenizer without branchspec's special tokens that declares (or, by its model's
    config.json, belongs to) another model family. A branchspec tokenizer_config.json over
    a broken tokenizer.json still gets the "lacks the special token" error."""
    if all(backend.token_to_id(t) is not None for t in SPECIAL_TOKENS):
        return False
    if config is not None:
        named = {_token_content(config.get(k)) for k in ("bos_token", "eos_token")} - {None}
        if named:
            return not named & {BOS, EOS}
        if config.get("chat_template_format") == CHAT_TEMPLATE_FORMAT:
            return False
    model = _model_config(path)
    return "architecture" not in model and (model.get("model_type") is not None
                                            or ("dim" in model and "n_layers" in model))


def _ids(value) -> list[int]:
    """Integer token ids from a config value: an int or a list of ints (others ignored)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


class ForeignTokenizer(Tokenizer):
    """A tokenizer from another model family (e.g. a Hugging Face checkpoint's
    ``tokenizer.json``), which lacks branchspec's special tokens.

    It encodes and decodes with the ``tokenizers`` file. bos/eos/pad come from
    ``tokenizer_config.json`` (``bos_token``, ``eos_token``, ``pad_token``: strings or
    ``{"content": ...}`` objects), else from the model's ``config.json`` ids; pad falls
    back to eos. ``stop_ids`` holds eos and every other eos id the model's
    ``config.json`` or ``generation_config.json`` lists. There is no chat template unless
    ``tokenizer_config.json`` holds a branchspec-format one; a jinja template is never
    rendered, and ``apply_chat_template`` / ``encode_chat`` raise ValueError.
    """

    def __init__(self, backend: _HFTokenizer, *, bos_id: int | None, eos_id: int, pad_id: int | None = None,
                 stop_ids: Iterable[int] = (), chat_template: str | None = None,
                 config: dict | None = None, source: str | os.PathLike[str] = "tokenizer"):
        self._backend = backend
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self.source = str(source)
        for name, tid in (("bos", bos_id), ("eos", eos_id), ("pad", pad_id)):
            if tid is not None and not 0 <= tid < self.vocab_size:
                raise ValueError(f"{self.source}: the {name} token id {tid} is outside the tokenizer's "
                                 f"vocabulary [0, {self.vocab_size})")
        if chat_template is not None:
            check_template(chat_template)
        self.chat_template = chat_template
        self._bos_id, self._eos_id = bos_id, eos_id
        self._pad_id = pad_id if pad_id is not None else eos_id
        self._stop_ids = tuple(dict.fromkeys([eos_id, *(s for s in stop_ids if 0 <= s < self.vocab_size)]))
        self._config = dict(config) if config else {}
        self.special_ids = {backend.id_to_token(i): i for i in (bos_id, eos_id, self._pad_id) if i is not None}

    @classmethod
    def from_parts(cls, backend: _HFTokenizer, config: dict | None, path: Path) -> "ForeignTokenizer":
        """Build from the loaded backend, the tokenizer_config.json dict (or None) and the
        folder (for config.json and generation_config.json)."""
        config = config or {}
        config_path = path / CONFIG_FILE
        model = _model_config(path)
        generation = {}
        try:
            obj = json.loads((path / "generation_config.json").read_text(encoding="utf-8"))
            generation = obj if isinstance(obj, dict) else {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            pass

        def token_id(key: str) -> int | None:
            token = _token_content(config.get(key))
            if token is None:
                return None
            tid = backend.token_to_id(token)
            if tid is None:
                raise ValueError(f"{config_path}: {key} {token!r} is not in {path / TOKENIZER_FILE}")
            return tid

        model_eos = _ids(model.get("eos_token_id"))
        generation_eos = _ids(generation.get("eos_token_id"))
        bos = token_id("bos_token")
        if bos is None and _ids(model.get("bos_token_id")):
            bos = _ids(model.get("bos_token_id"))[0]
        eos = token_id("eos_token")
        if eos is None:
            candidates = model_eos or generation_eos
            if not candidates:
                raise ValueError(f"{path}: no eos token: {CONFIG_FILE} names no eos_token and config.json "
                                 "has no eos_token_id")
            eos = candidates[0]
        pad = token_id("pad_token")
        if pad is None and _ids(model.get("pad_token_id")):
            pad = _ids(model.get("pad_token_id"))[0]
        template = None
        key = OWN_TEMPLATE_KEY if OWN_TEMPLATE_KEY in config else "chat_template"
        if config.get("chat_template_format") == CHAT_TEMPLATE_FORMAT and isinstance(config.get(key), str):
            template = config[key]
            try:
                check_template(template)
            except ValueError as e:
                raise ValueError(f"{config_path}: {e}") from e
        return cls(backend, bos_id=bos, eos_id=eos, pad_id=pad, stop_ids=[*model_eos, *generation_eos],
                   chat_template=template, config=config, source=path / TOKENIZER_FILE)

    @property
    def bos_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_id(self) -> int:
        return self._eos_id

    @property
    def pad_id(self) -> int:
        return self._pad_id

    @property
    def end_id(self) -> None:
        """No chat turn-end token: a foreign tokenizer has no branchspec chat template."""
        return None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def encode(self, text: str, add_bos: bool = False, *, parse_special: bool = True) -> list[int]:
        ids = super().encode(text, add_bos=False, parse_special=parse_special)
        return [self._bos_id, *ids] if add_bos and self._bos_id is not None else ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool = False) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos) for t in texts]

    def _no_template(self) -> ValueError:
        jinja = " (its tokenizer_config.json holds a jinja template, which branchspec does not render)" \
            if self._config.get("chat_template") is not None else ""
        return ValueError(f"{self.source} has no branchspec chat template{jinja}; render the chat "
                          "yourself and pass the text (or token ids) to generate()")

    def apply_chat_template(self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise self._no_template()
        return super().apply_chat_template(messages, add_generation_prompt)

    def encode_chat(self, messages: Iterable[Mapping[str, str]], add_generation_prompt: bool = True,
                    add_bos: bool = True) -> list[int]:
        if self.chat_template is None:
            raise self._no_template()
        return super().encode_chat(messages, add_generation_prompt, add_bos)

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write ``tokenizer.json`` and the foreign ``tokenizer_config.json`` (bos/eos/pad
        tokens filled in where they came from the model config)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        _save_backend(self._backend, out / TOKENIZER_FILE)
        config = dict(self._config)
        for key, tid in (("bos_token", self._bos_id), ("eos_token", self._eos_id), ("pad_token", self._pad_id)):
            if _token_content(config.get(key)) is None and tid is not None:
                config[key] = self._backend.id_to_token(tid)
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def __repr__(self) -> str:
        return f"ForeignTokenizer(vocab_size={self.vocab_size}, bos={self._bos_id}, eos={self._eos_id})"


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
