"""What machine this runs on, as benchmarks and caches name it."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model_name() -> str:
    """The CPU's model name (/proc/cpuinfo's, else what `platform` says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
