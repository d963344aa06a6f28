"""A pool of fixed-size pages with a free list."""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """Not enough free pages. Recoverable: nothing was allocated; queue or preempt and retry."""


class BlockPool:
    def __init__(self, num_pages: int, name: str = "pool"):
        if num_pages < 1:
            raise ValueError(f"{name}: num_pages must be >= 1, got {num_pages}")
        self.name = name
        self.num_pages = num_pages
        # Pop from the end: the lowest page ids are handed out first, which keeps tests readable.
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"{self.name}: need {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise RuntimeError(f"{self.name}: page {p} freed twice or never allocated")
            self._used.remove(p)
            self._free.append(p)
