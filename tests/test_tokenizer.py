"""Byte-level BPE tokenizer: exact round trips, special tokens, chat template, save/load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from branchspec.data.chat import CHAT_TEMPLATE, SPECIAL_TOKENS, jinja_chat_template, render_chat
from branchspec.data.tokenizer import Tokenizer, train_tokenizer

# A small mixed corpus (prose, arithmetic, code, non-Latin scripts, rendered chats), so
# the tokenizer trains in well under a second and still learns real merges.
_PROSE = "The quick brown fox jumps over the lazy dog. Natalia sold clips to 48 of her friends in April. "
_MATH = "She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18\n"
_CODE = 'def add(a, b):\n    """Return a + b."""\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n'
_INTL = "Grüße aus Köln. 東京は日本の首都です。 Привет, мир! 🚀✨ naïve café\n"
_CHAT = render_chat(
    [{"role": "user", "content": "Write a haiku."}, {"role": "assistant", "content": "Autumn moon rises"}],
    add_generation_prompt=False,
)
CORPUS = [_PROSE, _MATH, _CODE, _INTL, _CHAT] * 40

ROUND_TRIP = [
    "",
    "hello world",
    "  leading and trailing spaces  ",
    "tabs\tand\r\nCRLF\nand\n\n\nblank lines",
    _CODE,
    "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}  # 注释\n",
    "日本語のテキスト、한국어 텍스트, العربية, עברית, हिन्दी",
    "emoji 👩‍👩‍👧‍👦 🇯🇵 🏳️‍🌈, combining é (e + U+0301), zero-width \u200b\u200d, BOM \ufeff",
    "control chars \x00\x01\x7f and U+10FFFF \U0010ffff",
    "    " * 20 + "deep indentation",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return train_tokenizer(CORPUS, vocab_size=512)


def test_vocab_and_special_ids(tok: Tokenizer) -> None:
    assert 263 < tok.vocab_size <= 512  # 256 bytes + 7 specials + learnt merges
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert tok.stop_ids == (tok.eos_id, tok.token_to_id("<|end|>"))
    # Special-token pieces are not learnt as merges (the trainer sees text between them).
    vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
    assert not [t for t in vocab if t not in SPECIAL_TOKENS and ("<|" in t or "|>" in t)]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode(text, add_bos=True)) == text


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_any_unicode(tok: Tokenizer, text: str) -> None:
    # parse_special=False: even a text spelling "<|end|>" is plain bytes, so exact.
    assert tok.decode(tok.encode(text, parse_special=False)) == text


def test_learnt_merges_compress(tok: Tokenizer) -> None:
    assert len(tok.encode(_PROSE)) < len(_PROSE.encode()) / 2


def test_special_tokens_are_single_ids(tok: Tokenizer) -> None:
    for token in SPECIAL_TOKENS:
        assert tok.encode(token) == [tok.token_to_id(token)]
        assert tok.decode(tok.encode(token)) == ""
        assert tok.decode(tok.encode(token), skip_special_tokens=False) == token
    spelt = tok.encode("<|end|>", parse_special=False)
    assert len(spelt) > 1 and tok.token_to_id("<|end|>") not in spelt
    assert tok.encode("x", add_bos=True)[0] == tok.bos_id
    assert tok.encode_batch(["x", "yz"], add_bos=True) == [tok.encode("x", True), tok.encode("yz", True)]


def test_decode_rejects_unknown_ids(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match=f"unknown token id {tok.vocab_size}"):
        tok.decode([5, tok.vocab_size, 7])
    with pytest.raises(ValueError, match="unknown token id -1"):
        tok.decode([-1])


def test_chat_template(tok: Tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Use {braces} freely"},
    ]
    text = tok.apply_chat_template(messages)
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nUse {braces} freely<|end|>\n<|assistant|>\n"
    assert not tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|assistant|>\n")
    ids = tok.encode(text, add_bos=True)
    markers = [i for i in ids if i < len(SPECIAL_TOKENS)]
    names = ["<|bos|>", "<|system|>", "<|end|>", "<|user|>", "<|end|>", "<|assistant|>"]
    assert markers == [tok.token_to_id(n) for n in names]
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="system"):
        tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "system", "content": "y"}])


def test_save_load_round_trip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["branchspec_chat_template"] == CHAT_TEMPLATE and config["bos_token"] == "<|bos|>"
    assert config["chat_template"] == jinja_chat_template(CHAT_TEMPLATE) and config["add_bos_token"] is True
    loaded = Tokenizer.from_dir(tmp_path)
    assert loaded.vocab_size == tok.vocab_size and loaded.special_ids == tok.special_ids
    for text in ROUND_TRIP + [_CHAT]:
        assert loaded.encode(text) == tok.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert loaded.apply_chat_template(messages) == tok.apply_chat_template(messages)

    # The template travels with the checkpoint: an edited one is what gets loaded ...
    config["branchspec_chat_template"] = "<|{role}|>{content}<|end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "<|user|>hi<|end|><|assistant|>"
    # ... a folder from before branchspec_chat_template (its own under chat_template) still loads ...
    old = {k: v for k, v in config.items() if k != "branchspec_chat_template"}
    old["chat_template"] = "<|{role}|>{content}<|end|>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(old))
    assert Tokenizer.from_dir(tmp_path).apply_chat_template(messages) == "<|user|>hi<|end|><|assistant|>"
    # ... and a Jinja template alone, which branchspec cannot render, is refused, not printed raw.
    old["chat_template"], old["chat_template_format"] = config["chat_template"], "jinja"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="chat_template_format"):
        Tokenizer.from_dir(tmp_path)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="fields"):
        render_chat([], add_generation_prompt=True, template="{role}: {text}")
