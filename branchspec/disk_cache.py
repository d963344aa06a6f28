"""Where branchspec keeps what it measures or compiles once per machine (round-cost
calibrations, compiled steps): $BRANCHSPEC_CACHE, else $XDG_CACHE_HOME/branchspec, else
~/.cache/branchspec; and what such an artefact is keyed by besides the machine: the
source it was built from."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

_PACKAGE = Path(__file__).parent


def cache_dir() -> Path:
    root = os.environ.get("BRANCHSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "branchspec")
    return Path(root)


@functools.lru_cache(maxsize=None)
def source_digest() -> str:
    """What a compiled step is built from and a round-cost table measures: the model and
    config code, the speculative code whole-function steps run (a draft tree's growth,
    the verify pass, the draft extend), the paged state's reads and writes, the draws a
    verify pass makes in its graph (`sampling`), and the execution paths. A change to any
    of them compiles and measures anew."""
    h = hashlib.sha256()
    packages = [_PACKAGE / "model", _PACKAGE / "config", _PACKAGE / "speculative", _PACKAGE / "execution"]
    files = [p for pkg in packages for p in sorted(pkg.glob("*.py"))]
    files += [_PACKAGE / "cache" / "paged.py", _PACKAGE / "sampling.py"]
    for path in files:
        h.update(path.read_bytes())
    return h.hexdigest()
