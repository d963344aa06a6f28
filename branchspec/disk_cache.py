"""Where branchspec keeps what it measures or compiles once per machine (round-cost
calibrations, compiled steps): $BRANCHSPEC_CACHE, else $XDG_CACHE_HOME/branchspec, else
~/.cache/branchspec."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("BRANCHSPEC_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "branchspec")
    return Path(root)
