"""Which requests run next. Pure Python: the scheduler never touches a tensor."""

from __future__ import annotations

from collections import deque

from branchspec.engine.request import Sequence


class Scheduler:
    """FIFO admission up to `max_batch_size` running requests; preemption takes the newest."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def next_admission(self) -> Sequence | None:
        if self.waiting and len(self.running) < self.max_batch_size:
            return self.waiting[0]
        return None

    def admitted(self, seq: Sequence) -> None:
        self.waiting.remove(seq)
        self.running.append(seq)

    def finished(self, seq: Sequence) -> None:
        self.running.remove(seq)

    def preempt(self) -> Sequence:
        """Take the most recently admitted request out; it goes back to the front of the queue."""
        seq = self.running.pop()
        self.waiting.appendleft(seq)
        return seq
