"""MBPP: 974 Python tasks, which no PyPI package ships (DESIGN.md section 6).

Source, the first that applies: a local ``mbpp.jsonl`` named by the caller or by
``$BRANCHSPEC_MBPP`` (``resolve_mbpp_path``), else ``google-research-datasets/mbpp`` from
the Hugging Face hub (the user's cache, else a download when online). Split: the
standard ranges of task_id (Austin et al., 2021), 1-10 fewshot, 11-510 eval, 511-600
validation, 601-974 train. Prompt: the task and the asserts its code must pass, as a
docstring; completion: the reference code.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any

from branchspec.data.workloads.example import Example

MBPP_ENV_VAR = "BRANCHSPEC_MBPP"
MBPP_HUB_NAME = "google-research-datasets/mbpp"
# The "full" config's four splits together hold task_ids 1-974; ``_mbpp_examples`` re-splits by id.
MBPP_HUB_FILES = tuple(f"full/{part}-00000-of-00001.parquet" for part in ("train", "test", "validation", "prompt"))
# Seconds a hub request may wait for an answer: huggingface_hub's default, 10, is long to
# wait on a network that drops packets before the clear "no MBPP" error. $HF_HUB_ETAG_TIMEOUT
# overrides it.
MBPP_HUB_TIMEOUT = 3.0


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
    """No source of MBPP worked: no local file was named, and the Hugging Face hub could not
    supply it.

    A subclass, so that a caller for whom MBPP is optional (``branchspec bench`` without
    ``--workloads``) can skip it on exactly this, while a file that was named but is
    missing stays a plain FileNotFoundError. ``reason`` says in one line why the hub failed.
    """

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(
            f"no MBPP source: no local mbpp.jsonl was named, and the Hugging Face hub failed ({reason}). "
            f"Provide MBPP by passing mbpp_path=FILE / --mbpp-path FILE (a local mbpp.jsonl), setting "
            f"${MBPP_ENV_VAR}=FILE, or going online so that {MBPP_HUB_NAME} downloads from the "
            f"Hugging Face hub"
        )


def resolve_mbpp_path(mbpp_path: str | os.PathLike[str] | None = None) -> Path | None:
    """The local MBPP file: ``mbpp_path``, else ``$BRANCHSPEC_MBPP``; None when neither is
    given, and MBPP then comes from the Hugging Face hub.

    There is deliberately no default location: a path that exists only in one checkout's
    surroundings would make the same call load different data elsewhere. A path or env
    var that names a missing file raises FileNotFoundError at once rather than falling
    through to another source.
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
    return None


def load_mbpp(split: str, mbpp_path: str | os.PathLike[str] | None = None) -> list[Example]:
    """The examples of ``split``, by task_id; ``mbpp_path`` as for ``resolve_mbpp_path``."""
    return [ex for ex, s in _mbpp(mbpp_path) if s == split]


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

