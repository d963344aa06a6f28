"""Workload loaders: splits are fixed, disjoint and held out from training text."""

from __future__ import annotations

import io
import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from branchspec.data import workloads as wl
from branchspec.data.workloads import gsm8k as gsm8k_source
from branchspec.data.workloads import mbpp as mbpp_source
from branchspec.data.workloads import sharegpt as sharegpt_source
from branchspec.data.workloads import (
    WORKLOADS,
    Example,
    JsonArrayReader,
    MbppUnavailable,
    load_workload,
    parse_sharegpt,
    training_text,
    workload_splits,
)
from conftest import mbpp_rows, write_mbpp

# The real MBPP, only for the checks of its published content: $BRANCHSPEC_MBPP, which
# conftest.py sets to ../shared/data/mbpp.jsonl beside the checkout when that exists. Every
# other MBPP test writes an MBPP-shaped file of its own.
REAL_MBPP = Path(os.environ.get(wl.MBPP_ENV_VAR) or "/nonexistent/mbpp.jsonl")
needs_real_mbpp = pytest.mark.skipif(
    not REAL_MBPP.is_file(),
    reason=f"no real MBPP file: ${wl.MBPP_ENV_VAR} is unset or names a missing file (set it to an mbpp.jsonl "
           "to run this)")


@pytest.fixture(scope="module")
def mbpp_file(tmp_path_factory) -> Path:
    return write_mbpp(tmp_path_factory.mktemp("mbpp") / "mbpp.jsonl")


# --- the registry ----------------------------------------------------------------------


def test_registry_lists_each_workload_once() -> None:
    names = [w.name for w in wl.REGISTRY]
    assert names == ["gsm8k", "mbpp", "sharegpt", "humaneval"]   # this order is WORKLOADS' order
    assert len(set(names)) == len(names) and WORKLOADS == tuple(names)
    for workload in wl.REGISTRY:
        assert wl.get_workload(workload.name) is workload and workload_splits(workload.name) == workload.splits
        assert "eval" in workload.splits and len(set(workload.splits)) == len(workload.splits)
        assert workload.source and workload.split_rule and workload.prompt_format
    with pytest.raises(ValueError, match="valid workloads: gsm8k, mbpp, sharegpt, humaneval"):
        wl.get_workload("gsm9k")


@pytest.mark.parametrize("workload", wl.REGISTRY, ids=lambda w: w.name)
def test_every_registered_split_loads_from_its_real_source(workload: wl.Workload) -> None:
    """Each split of each registered workload, from the source a user gets (MBPP: from
    $BRANCHSPEC_MBPP or the Hugging Face cache; skipped when neither has it)."""
    for split in workload.splits:
        try:
            examples = load_workload(workload.name, split)
        except MbppUnavailable as e:
            pytest.skip(f"MBPP has no source here ({e.reason}); set ${wl.MBPP_ENV_VAR} to an mbpp.jsonl")
        assert examples and all(ex.workload == workload.name for ex in examples), split
        assert examples == list(workload.load(split, None))
    if "train" in workload.splits:
        assert next(training_text(workload.name)).strip()


# --- every workload --------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_splits_are_nonempty_well_formed_and_disjoint(name: str, mbpp_file: Path) -> None:
    uids_by_split = {}
    for split in workload_splits(name):
        examples = load_workload(name, split, mbpp_path=mbpp_file if name == "mbpp" else None)
        assert examples, f"{name}/{split} is empty"
        for ex in examples:
            assert isinstance(ex, Example) and ex.workload == name
            assert isinstance(ex.uid, str) and ex.uid
            assert isinstance(ex.completion, str) and ex.completion.strip()
            if name == "sharegpt":
                assert ex.is_chat and ex.prompt[-1]["role"] == "user"
            else:
                assert isinstance(ex.prompt, str) and ex.prompt.strip()
            # What the model is shown is exactly the start of what it is trained on.
            assert ex.document().startswith(ex.prompt_text())
        uids = [ex.uid for ex in examples]
        assert len(set(uids)) == len(uids), f"{name}/{split} repeats a uid"
        uids_by_split[split] = set(uids)
    splits = list(uids_by_split)
    for i, a in enumerate(splits):
        for b in splits[i + 1:]:
            assert not uids_by_split[a] & uids_by_split[b], f"{name}: {a} and {b} overlap"


def test_unknown_workload_or_split_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="gsm8k.*mbpp.*sharegpt.*humaneval"):
        load_workload("gsm9k", "eval")
    with pytest.raises(ValueError, match="train, eval"):
        load_workload("gsm8k", "test")
    with pytest.raises(ValueError, match="valid splits: eval"):
        load_workload("humaneval", "train")
    with pytest.raises(ValueError, match="valid splits: eval"):
        training_text("humaneval")


def test_hash_split_is_pinned() -> None:
    # sha1, not Python's salted hash(): the same examples are held out on every machine.
    # If this fails the split moved, and every published acceptance number with it.
    eval_uids = [ex.uid for ex in load_workload("gsm8k", "eval")]
    assert eval_uids[:5] == ["gsm8k-4", "gsm8k-5", "gsm8k-6", "gsm8k-7", "gsm8k-11"]
    assert wl.sharegpt_split("W4wL13P_0") == "eval"
    assert wl.sharegpt_split("QWJhYvA_0") == "train"


# --- GSM8K -----------------------------------------------------------------------------


def test_gsm8k_split_and_format() -> None:
    train, held_out = load_workload("gsm8k", "train"), load_workload("gsm8k", "eval")
    assert (len(train), len(held_out)) == (1000, 319)
    ex = held_out[0]
    assert ex.prompt.startswith("Question: ") and ex.prompt.endswith("\nAnswer:")
    assert ex.completion.startswith(" ") and "\n#### " in ex.completion

    gsm8k_source._gsm8k.cache_clear()  # a fresh parse assigns the same splits
    assert [e.uid for e in load_workload("gsm8k", "eval")] == [e.uid for e in held_out]

    questions = {e.prompt for e in held_out}
    assert not any(doc.startswith(q) for doc in training_text("gsm8k") for q in questions)


# --- MBPP ------------------------------------------------------------------------------

MBPP_RANGES = {"fewshot": (1, 10), "eval": (11, 510), "validation": (511, 600), "train": (601, 974)}


def test_mbpp_standard_split_by_task_id(mbpp_file: Path) -> None:
    for split, (lo, hi) in MBPP_RANGES.items():
        ids = [int(ex.uid.removeprefix("mbpp-")) for ex in load_workload("mbpp", split, mbpp_path=mbpp_file)]
        assert ids == list(range(lo, hi + 1)), split
    ex = load_workload("mbpp", "eval", mbpp_path=mbpp_file)[0]
    assert ex.uid == "mbpp-11"
    assert ex.prompt == ('"""\nWrite a function that multiplies a number by 11.\n\n'
                         'assert times_11(2) == 22\nassert times_11(0) == 0\n"""\n')
    assert ex.completion == "def times_11(x):\n    return x * 11\n"   # CRLF normalised


@needs_real_mbpp
def test_real_mbpp_has_the_published_tasks() -> None:
    for split, (lo, hi) in MBPP_RANGES.items():
        ids = [int(ex.uid.removeprefix("mbpp-")) for ex in load_workload("mbpp", split, mbpp_path=REAL_MBPP)]
        assert ids == list(range(lo, hi + 1)), split
    ex = load_workload("mbpp", "eval", mbpp_path=REAL_MBPP)[0]
    assert ex.uid == "mbpp-11"
    assert ex.prompt.startswith('"""\n') and "assert remove_Occ(" in ex.prompt
    assert ex.completion.startswith("def remove_Occ") and "\r" not in ex.completion


def test_mbpp_path_from_env_var(monkeypatch: pytest.MonkeyPatch, mbpp_file: Path) -> None:
    monkeypatch.setenv(wl.MBPP_ENV_VAR, str(mbpp_file))
    assert len(load_workload("mbpp", "eval")) == 500


def test_mbpp_explicit_path_wins_over_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(wl.MBPP_ENV_VAR, str(write_mbpp(tmp_path / "env" / "mbpp.jsonl", task_ids=(700, 5, 20))))
    named = write_mbpp(tmp_path / "named" / "mbpp.jsonl", task_ids=(701, 21))
    assert [e.uid for e in load_workload("mbpp", "train", mbpp_path=named)] == ["mbpp-701"]
    assert [e.uid for e in load_workload("mbpp", "train")] == ["mbpp-700"]
    assert [e.uid for e in load_workload("mbpp", "fewshot")] == ["mbpp-5"]
    (example,) = load_workload("mbpp", "eval")
    assert example.prompt.startswith('"""\nWrite a function that multiplies a number by 20.\n')
    assert example.completion == "def times_20(x):\n    return x * 20\n"


# Every way of providing MBPP, as the error for "no source" must list them.
MBPP_WAYS = ("mbpp_path", "--mbpp-path", wl.MBPP_ENV_VAR, "going online", wl.MBPP_HUB_NAME)


def _assert_lists_every_way(error: Exception) -> None:
    for way in MBPP_WAYS:
        assert way in str(error), way
    assert "../shared" not in str(error)   # no location that exists only in this project's setting


@pytest.fixture
def no_local_mbpp(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """No local MBPP named (no env var; the working directory is a fresh folder), and the hub
    loader's cache emptied before and after, so no hub result leaks between tests."""
    monkeypatch.delenv(wl.MBPP_ENV_VAR, raising=False)
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    mbpp_source._mbpp_from_hub.cache_clear()
    yield
    mbpp_source._mbpp_from_hub.cache_clear()


def test_mbpp_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_local_mbpp) -> None:
    with pytest.raises(FileNotFoundError, match="mbpp_path") as named:
        load_workload("mbpp", "eval", mbpp_path=tmp_path / "nope.jsonl")
    assert not isinstance(named.value, MbppUnavailable)   # a named file that is missing is not skippable
    monkeypatch.setenv(wl.MBPP_ENV_VAR, str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=wl.MBPP_ENV_VAR):
        load_workload("mbpp", "eval")
    monkeypatch.delenv(wl.MBPP_ENV_VAR)
    # The real huggingface_hub, offline, over an empty cache: no network, no wait.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    with pytest.raises(MbppUnavailable, match="HF_HUB_OFFLINE") as error:
        training_text("mbpp")
    _assert_lists_every_way(error.value)


def test_mbpp_has_no_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_local_mbpp) -> None:
    """Without mbpp_path or $BRANCHSPEC_MBPP, offline, MBPP is unavailable even when
    ../shared/data/mbpp.jsonl lies beside the working directory: library code has no
    default path, and the error names the env var and the flag, not a path."""
    write_mbpp(Path.cwd().parent / "shared" / "data" / "mbpp.jsonl")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    assert wl.resolve_mbpp_path() is None
    with pytest.raises(MbppUnavailable, match="HF_HUB_OFFLINE") as error:
        load_workload("mbpp", "eval")
    message = str(error.value)
    assert wl.MBPP_ENV_VAR in message and "--mbpp-path" in message
    assert "../shared" not in message and "shared/data" not in message


def _write_hub_parquet(folder: Path) -> list[str]:
    """The hub's four parquet files (full/train, test, validation, prompt), by task_id range."""
    parts = {"train": range(601, 975), "test": range(11, 511), "validation": range(511, 601), "prompt": range(1, 11)}
    paths = []
    for name, ids in parts.items():
        paths.append(str(folder / f"{name}-00000-of-00001.parquet"))
        pq.write_table(pa.Table.from_pylist(mbpp_rows(ids)), paths[-1])
    return paths


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, no_local_mbpp):
    """The hub downloader replaced: ``calls`` records each ``local_files_only``, ``cached``
    says whether the cache holds MBPP, and ``fail`` makes the network attempt raise. Online
    as far as the loader can tell (the fake never touches the network)."""
    import huggingface_hub.constants

    hub = SimpleNamespace(calls=[], cached=False, fail=None, paths=_write_hub_parquet(tmp_path))

    def download(*, local_files_only: bool) -> list[str]:
        hub.calls.append(local_files_only)
        if local_files_only and not hub.cached:
            raise FileNotFoundError("not in the cache")
        if not local_files_only and hub.fail is not None:
            raise hub.fail
        return hub.paths

    monkeypatch.setattr(mbpp_source, "_download_mbpp", download)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return hub


def test_mbpp_from_hub_cache_first(fake_hub) -> None:
    fake_hub.cached = True
    for split, (lo, hi) in MBPP_RANGES.items():
        assert [e.uid for e in load_workload("mbpp", split)] == [f"mbpp-{t}" for t in range(lo, hi + 1)]
    assert fake_hub.calls == [True]   # found in the cache, read once, never downloaded
    ex = load_workload("mbpp", "eval")[0]
    assert ex.completion == "def times_11(x):\n    return x * 11\n" and "assert times_11(2) == 22" in ex.prompt


def test_mbpp_from_hub_downloads_when_not_cached(fake_hub) -> None:
    assert len(load_workload("mbpp", "eval")) == 500
    assert fake_hub.calls == [True, False]   # the cache, then the network


def test_mbpp_hub_failures_give_the_clear_error(fake_hub, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub.fail = ConnectionError("[Errno -2] Name or service not known\nmore detail")
    with pytest.raises(MbppUnavailable, match="ConnectionError: .Errno -2. Name or service not known") as error:
        load_workload("mbpp", "eval")
    assert "more detail" not in error.value.reason   # one line, for the bench's skip line
    _assert_lists_every_way(error.value)
    fake_hub.calls.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(MbppUnavailable, match="HF_HUB_OFFLINE"):
        load_workload("mbpp", "eval")
    assert fake_hub.calls == [True]   # offline: the cache only
    fake_hub.calls.clear()   # a package missing ends the same way, before any download
    for module in ("pyarrow.parquet", "huggingface_hub"):
        with monkeypatch.context() as m:
            m.setitem(sys.modules, module, None)
            with pytest.raises(MbppUnavailable, match=f"pip install {module.split('.')[0]}") as error:
                load_workload("mbpp", "eval")
            _assert_lists_every_way(error.value)
    assert fake_hub.calls == []


def test_mbpp_download_asks_the_hub_once_before_downloading(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real downloader over a stubbed huggingface_hub: the cache attempt makes no extra
    request; the network attempt first makes one request without retries (hf_hub_download's
    own retries take about 25 s offline), with the short timeout or $HF_HUB_ETAG_TIMEOUT."""
    import huggingface_hub

    calls = []
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata",
                        lambda url, timeout: calls.append(("probe", url, timeout)))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download",
                        lambda repo_id, filename, **kw: calls.append((repo_id, filename, kw)) or f"/cache/{filename}")
    monkeypatch.delenv("HF_HUB_ETAG_TIMEOUT", raising=False)
    assert mbpp_source._download_mbpp(local_files_only=True) == [f"/cache/{f}" for f in wl.MBPP_HUB_FILES]
    assert calls == [(wl.MBPP_HUB_NAME, f, {"repo_type": "dataset", "local_files_only": True,
                                           "etag_timeout": wl.MBPP_HUB_TIMEOUT}) for f in wl.MBPP_HUB_FILES]
    calls.clear()
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "7")
    mbpp_source._download_mbpp(local_files_only=False)
    (kind, url, timeout), *downloads = calls
    assert kind == "probe" and timeout == 7.0
    assert url.endswith("/datasets/google-research-datasets/mbpp/resolve/main/full/train-00000-of-00001.parquet")
    assert [(f, kw["local_files_only"]) for _, f, kw in downloads] == [(f, False) for f in wl.MBPP_HUB_FILES]


# --- HumanEval -------------------------------------------------------------------------


def test_humaneval_is_eval_only() -> None:
    problems = load_workload("humaneval", "eval")
    assert len(problems) == 164 and problems[0].uid == "HumanEval/0"
    assert "def has_close_elements" in problems[0].prompt


# --- ShareGPT --------------------------------------------------------------------------


def _record(uid: str, *turns: tuple[str, str]) -> dict:
    return {"id": uid, "conversations": [{"from": who, "value": text} for who, text in turns]}


def _cut_sharegpt_file() -> bytes:
    records = [
        _record("a_0", ("human", "Hi ☃"), ("gpt", " Hello! ")),
        _record("b_0"),  # empty
        _record("c_0", ("human", "x"), ("robot", "y")),  # unknown speaker
        _record("d_0", ("human", "  "), ("gpt", "y")),  # blank turn
        # A continuation piece: the leading reply and the trailing question are dropped.
        _record("a_1", ("gpt", "more"), ("human", "and?"), ("gpt", "done"), ("human", "unanswered")),
        _record("e_0", ("human", "1"), ("human", "2"), ("gpt", "3")),
        _record("h_0", ("human", "1"), ("gpt", "2"), ("human", "3"), ("human", "4")),
        _record("f_0", ("system", "be brief"), ("human", "q"), ("gpt", "a")),
        _record("g_0", ("human", "cut ☃☃"), ("gpt", "never")),
    ]
    text = json.dumps(records, indent=2, ensure_ascii=False).encode("utf-8")
    # Cut inside the last record, in the middle of a 3-byte UTF-8 character.
    return text[: text.rindex("☃".encode()) + 1]


def test_sharegpt_parse_keeps_only_complete_well_formed_conversations() -> None:
    conversations, stats = parse_sharegpt(io.BytesIO(_cut_sharegpt_file()))
    assert [c.uid for c in conversations] == ["a_0", "a_1", "f_0"]
    user, assistant = "user", "assistant"
    assert conversations[0].messages == ({"role": user, "content": "Hi ☃"}, {"role": assistant, "content": "Hello!"})
    assert conversations[1].messages == ({"role": user, "content": "and?"}, {"role": assistant, "content": "done"})
    assert conversations[0].is_opening and not conversations[1].is_opening
    assert [m["role"] for m in conversations[2].messages] == ["system", user, assistant]
    counts = (stats.num_records, stats.num_malformed, stats.num_unpaired, stats.num_non_alternating)
    assert counts == (8, 2, 1, 2)
    assert stats.truncated_chars > 0


def test_json_array_reader_is_chunk_size_independent() -> None:
    data = json.dumps([{"k": "é" * n, "n": n} for n in range(30)] + [12345, "s", [1, 2]]).encode()
    whole = list(JsonArrayReader(io.BytesIO(data)))
    for chunk in (1, 3, 7, 64):
        reader = JsonArrayReader(io.BytesIO(data), chunk_bytes=chunk)
        assert list(reader) == whole and reader.closed and reader.truncated_chars == 0
    assert whole[-3:] == [12345, "s", [1, 2]]
    broken = io.BytesIO(b'[{"a": 1}, {"a": oops}, ' + b" " * 100)
    with pytest.raises(ValueError, match="malformed"):
        list(JsonArrayReader(broken, chunk_bytes=4, max_element_chars=16))


def test_sharegpt_packaged_file() -> None:
    conversations, stats = sharegpt_source._sharegpt_parsed()
    assert 17_000 < stats.num_records < 18_000 and stats.truncated_chars > 0
    assert stats.num_kept == len(conversations) > 17_000
    for conv in conversations:
        roles = [m["role"] for m in conv.messages]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles and roles == ["user", "assistant"] * (len(roles) // 2)
        assert all(m["content"] and m["content"] == m["content"].strip() for m in conv.messages)

    # Every piece of a conversation is in the same split.
    splits_by_base = defaultdict(set)
    for conv in conversations:
        splits_by_base[wl.sharegpt_base_id(conv.uid)].add(wl.sharegpt_split(conv.uid))
    assert all(len(s) == 1 for s in splits_by_base.values())

    document = next(training_text("sharegpt"))
    assert document.startswith(("<|user|>\n", "<|system|>\n")) and document.endswith("<|end|>\n")

    held_out = load_workload("sharegpt", "eval")
    assert 300 < len(held_out) < 1_000
    train_user_turns = {
        m["content"]
        for c in conversations
        if wl.sharegpt_split(c.uid) == "train"
        for m in c.messages
        if m["role"] == "user"
    }
    questions = [ex.prompt[-1]["content"] for ex in held_out]
    assert len(set(questions)) == len(questions) and not set(questions) & train_user_turns
