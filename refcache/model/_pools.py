"""Slot allocators of the device (L1) and host (L2) pools, as the implementation must behave.

Both are FIFO free lists (the contract of ``specs/data-plane.md``), so model and implementation hand out
the same slot numbers for the same operations and snapshots can be compared slot for slot.

* Device: pages ``0..size//page_size-1``; ``alloc(n)`` takes ``ceil(n/page_size)`` pages from the head
  and returns their first ``n`` token slots; ``free`` appends the distinct pages, ascending, at the tail.
* Host: token slots ``0..size-1``; ``alloc(n)`` (``n`` a page multiple) takes ``n`` slots from the head;
  ``free`` appends at the tail in the given order.

Double allocation and double free raise ``UsageError`` and change nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from refcache.errors import UsageError

__all__ = ["DeviceAllocator", "HostAllocator"]


class DeviceAllocator:
    """Paged allocator over ``size`` device token slots (page size 1 is the token allocator)."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size - size % page_size
        self.page_size = page_size
        self._free: deque[int] = deque(range(self.size // page_size))  # free page numbers, FIFO
        self._is_free = [True] * (self.size // page_size)

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """Token slots for ``n`` tokens (whole pages reserved), or ``None`` if too few pages are free."""
        pages = -(-n // self.page_size)
        if pages > len(self._free):
            return None
        out: list[int] = []
        for _ in range(pages):
            page = self._free.popleft()
            self._is_free[page] = False
            out.extend(range(page * self.page_size, (page + 1) * self.page_size))
        return out[:n]

    def free(self, slots: Iterable[int]) -> None:
        pages = sorted({slot // self.page_size for slot in slots})
        for page in pages:
            if self._is_free[page]:
                raise UsageError(f"device page {page} freed twice")
        for page in pages:
            self._is_free[page] = True
            self._free.append(page)

    def clear(self) -> None:
        self._free = deque(range(self.size // self.page_size))
        self._is_free = [True] * (self.size // self.page_size)

    def free_slots(self) -> tuple[int, ...]:
        return tuple(
            s for page in self._free for s in range(page * self.page_size, (page + 1) * self.page_size)
        )


class HostAllocator:
    """FIFO allocator over ``size`` host token slots, in page multiples."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size
        self.page_size = page_size
        self._free: deque[int] = deque(range(size))
        self._is_free = [True] * size

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n % self.page_size:
            raise UsageError(f"host allocation of {n} tokens is not a multiple of page_size {self.page_size}")
        if n > len(self._free):
            return None
        out = [self._free.popleft() for _ in range(n)]
        for slot in out:
            self._is_free[slot] = False
        return out

    def free(self, slots: Sequence[int]) -> None:
        if len(set(slots)) != len(slots) or any(self._is_free[s] for s in slots):
            raise UsageError(f"host slots {sorted(slots)} freed twice")
        for slot in slots:
            self._is_free[slot] = True
            self._free.append(slot)

    def clear(self) -> None:
        self._free = deque(range(self.size))
        self._is_free = [True] * self.size

    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free)
