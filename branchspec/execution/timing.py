"""Wall time per phase of a step (draft, plan, verify, accept, commit, draft extend)."""

from __future__ import annotations

import time

import torch


class PhaseClock:
    """Charges the time since the last reading to a phase. CPU work is synchronous; on a
    GPU each reading first waits for the queued kernels (`sync`), so a phase is charged
    its own work, not the one queued before it."""

    def __init__(self, sync: bool = False):
        self.sync = sync
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now
