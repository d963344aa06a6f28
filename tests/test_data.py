"""Workload loaders: splits are fixed, disjoint and held out from training text."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

import pytest

from branchspec.data import workloads as wl
from branchspec.data.workloads import (
    WORKLOADS,
    Example,
    JsonArrayReader,
    load_workload,
    parse_sharegpt,
    training_text,
    workload_splits,
)

# tests/ -> repository -> its parent, where ../shared/data lives outside the repository on purpose.
MBPP_FILE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mbpp.jsonl"
needs_mbpp = pytest.mark.skipif(not MBPP_FILE.is_file(), reason=f"MBPP copy not found at {MBPP_FILE}")


def _load(name: str, split: str) -> list[Example]:
    return load_workload(name, split, mbpp_path=MBPP_FILE if name == "mbpp" else None)


def _cases() -> list:
    return [
        pytest.param(name, marks=needs_mbpp) if name == "mbpp" else name for name in WORKLOADS
    ]


# --- every workload --------------------------------------------------------------------


@pytest.mark.parametrize("name", _cases())
def test_splits_are_nonempty_well_formed_and_disjoint(name: str) -> None:
    uids_by_split = {}
    for split in workload_splits(name):
        examples = _load(name, split)
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

    wl._gsm8k.cache_clear()  # a fresh parse assigns the same splits
    assert [e.uid for e in load_workload("gsm8k", "eval")] == [e.uid for e in held_out]

    questions = {e.prompt for e in held_out}
    assert not any(doc.startswith(q) for doc in training_text("gsm8k") for q in questions)


# --- MBPP ------------------------------------------------------------------------------


@needs_mbpp
def test_mbpp_standard_split_by_task_id() -> None:
    ranges = {"fewshot": (1, 10), "eval": (11, 510), "validation": (511, 600), "train": (601, 974)}
    for split, (lo, hi) in ranges.items():
        ids = [int(ex.uid.removeprefix("mbpp-")) for ex in _load("mbpp", split)]
        assert ids == list(range(lo, hi + 1)), split
    ex = _load("mbpp", "eval")[0]
    assert ex.uid == "mbpp-11"
    assert ex.prompt.startswith('"""\n') and "assert remove_Occ(" in ex.prompt
    assert ex.completion.startswith("def remove_Occ") and "\r" not in ex.completion


@needs_mbpp
def test_mbpp_path_from_env_var(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(wl.MBPP_ENV_VAR, str(MBPP_FILE))
    monkeypatch.chdir(tmp_path)  # no ../shared here: the env var must be what is used
    assert len(load_workload("mbpp", "eval")) == 500


def test_mbpp_default_path_is_shared_next_to_cwd(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    rows = [
        {"task_id": t, "text": f"Task {t}.", "code": "def f():\r\n    return 1",
         "test_list": ["assert f() == 1"], "test_setup_code": "", "challenge_test_list": []}
        for t in (700, 5, 20)
    ]
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "mbpp.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "repo").mkdir()
    monkeypatch.chdir(tmp_path / "repo")
    monkeypatch.delenv(wl.MBPP_ENV_VAR, raising=False)
    assert [e.uid for e in load_workload("mbpp", "train")] == ["mbpp-700"]
    assert [e.uid for e in load_workload("mbpp", "fewshot")] == ["mbpp-5"]
    (example,) = load_workload("mbpp", "eval")
    assert example.prompt == '"""\nTask 20.\n\nassert f() == 1\n"""\n'
    assert example.completion == "def f():\n    return 1\n"


def test_mbpp_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="mbpp_path"):
        load_workload("mbpp", "eval", mbpp_path=tmp_path / "nope.jsonl")
    monkeypatch.setenv(wl.MBPP_ENV_VAR, str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match=wl.MBPP_ENV_VAR):
        load_workload("mbpp", "eval")
    monkeypatch.delenv(wl.MBPP_ENV_VAR)
    monkeypatch.chdir(tmp_path)  # ../shared/data/mbpp.jsonl does not exist from here
    with pytest.raises(FileNotFoundError, match=f"{wl.MBPP_ENV_VAR}.*allow_hub"):
        load_workload("mbpp", "eval")


def test_mbpp_hub_needs_datasets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("`datasets` is installed: allow_hub=True would go to the network")
    monkeypatch.delenv(wl.MBPP_ENV_VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="datasets"):
        load_workload("mbpp", "eval", allow_hub=True)


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
    conversations, stats = wl._sharegpt_parsed()
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
