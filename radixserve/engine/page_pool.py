"""PagePool: the free list of KV page ids."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable


class PagePool:
    """Free page ids in [0, num_pages); running out returns None, never raises. Owners of used pages
    track them (KVManager.check_invariants)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self.on_free: Callable[[list[int]], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        return [self._free.popleft() for _ in range(n)]

    def free(self, page_ids: list[int]) -> None:
        for p in page_ids:
            assert 0 <= p < self.num_pages, f"page id {p} out of range"
        self._free.extend(page_ids)
        if self.on_free is not None:
            self.on_free(page_ids)

    def free_ids(self) -> list[int]:
        return list(self._free)
