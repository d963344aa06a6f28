"""Extra training text that is already on every machine that runs branchspec.

The workloads' train splits are small (GSM8K about 0.17 M tokens, MBPP 0.07 M), so a
model trained for millions of tokens would see each of them dozens of times. These
corpora add real text without downloading anything or adding to the repository:

- ``pycode``: the Python source of the running interpreter's standard library (Python
  Software Foundation License), minus its test suites, one module per document.

They are training-only: nothing here overlaps a workload's held-out split.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path

CORPORA = ("pycode",)

# Folders of the standard library that are tests, vendored packages or generated tables.
_SKIP_PARTS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
               "lib2to3", "ensurepip", "turtledemo", "encodings", "pydoc_data"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_source_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files in a fixed order (sorted by relative path)."""
    root = root or stdlib_root()
    files = [p for p in root.rglob("*.py") if not _SKIP_PARTS.intersection(p.relative_to(root).parts[:-1])]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def python_source_documents(root: Path | None = None, max_chars: int = 200_000) -> Iterator[str]:
    """One document per module, as its text; files that do not decode as UTF-8, and
    machine-generated giants over ``max_chars``, are skipped."""
    for path in python_source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and len(text) <= max_chars:
            yield text


def corpus_text(name: str) -> Iterator[str]:
    if name == "pycode":
        return python_source_documents()
    raise ValueError(f"unknown corpus {name!r}; choose from {CORPORA}")


def corpus_fingerprint(name: str) -> dict:
    """Where a corpus came from and how big it was, for the training record."""
    if name == "pycode":
        files = python_source_files()
        digest = hashlib.sha256("\n".join(p.name for p in files).encode()).hexdigest()[:12]
        return {"source": f"Python {sysconfig.get_python_version()} standard library ({stdlib_root()})",
                "licence": "PSF-2.0", "files": len(files), "file_list_sha256": digest}
    raise ValueError(f"unknown corpus {name!r}; choose from {CORPORA}")
