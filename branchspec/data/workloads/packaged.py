"""Files that PyPI data-set packages ship (GSM8K, ShareGPT, HumanEval)."""

from __future__ import annotations

from importlib import resources
from typing import Any


def package_file(package: str, pip_name: str, *parts: str) -> Any:
    """``parts`` inside the installed ``package`` (an importlib Traversable); a
    ModuleNotFoundError naming the pip package when it is not installed."""
    try:
        root = resources.files(package)
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            f"the {pip_name!r} package is needed for this workload: pip install {pip_name}"
        ) from exc
    return root.joinpath(*parts)
