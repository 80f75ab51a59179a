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

from array import array
from collections.abc import Iterable, Sequence

from refcache.errors import UsageError

__all__ = ["DeviceAllocator", "HostAllocator"]


# The free lists and flags are arrays and bytearrays, not lists and deques of ints: they are no containers
# the garbage collector walks (a full collection would otherwise visit every slot of both pools).


class _Fifo:
    """A FIFO of ints in an ``array``: ``take`` from the head, ``extend`` at the tail."""

    __slots__ = ("_head", "_items")

    def __init__(self, items: Iterable[int]) -> None:
        self._items = array("q", items)
        self._head = 0

    def __len__(self) -> int:
        return len(self._items) - self._head

    def take(self, n: int) -> list[int]:
        head = self._head
        out = self._items[head : head + n].tolist()
        self._head = head + n
        if self._head > 4096 and 2 * self._head > len(self._items):
            del self._items[: self._head]
            self._head = 0
        return out

    def extend(self, items: Iterable[int]) -> None:
        self._items.extend(items)

    def tolist(self) -> list[int]:
        return self._items[self._head :].tolist()


# Plain loops: Python 3.11 specialises a bytearray subscript, which makes them about twice as fast as
# mapping ``flags.__getitem__`` / ``__setitem__`` (a method-wrapper call per slot).


def _any_set(flags: bytearray, indices: Iterable[int]) -> bool:
    for i in indices:  # noqa: SIM110 - any() over a generator is slower than this loop
        if flags[i]:
            return True
    return False


def _set_all(flags: bytearray, indices: Iterable[int], value: int) -> None:
    for i in indices:
        flags[i] = value


class DeviceAllocator:
    """Paged allocator over ``size`` device token slots (page size 1 is the token allocator)."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size - size % page_size
        self.page_size = page_size
        self.clear()

    def available_size(self) -> int:
        return len(self._free) * self.page_size

    def alloc(self, n: int) -> list[int] | None:
        """Token slots for ``n`` tokens (whole pages reserved), or ``None`` if too few pages are free."""
        ps = self.page_size
        pages = -(-n // ps)
        if pages > len(self._free):
            return None
        taken = self._free.take(pages)
        _set_all(self._is_free, taken, 0)
        if ps == 1:
            return taken
        out: list[int] = []
        for page in taken:
            out.extend(range(page * ps, (page + 1) * ps))
        return out[:n]

    def free(self, slots: Iterable[int]) -> None:
        ps = self.page_size
        pages = sorted(set(slots)) if ps == 1 else sorted({slot // ps for slot in slots})
        if _any_set(self._is_free, pages):
            page = next(p for p in pages if self._is_free[p])
            raise UsageError(f"device page {page} freed twice")
        _set_all(self._is_free, pages, 1)
        self._free.extend(pages)

    def clear(self) -> None:
        self._free = _Fifo(range(self.size // self.page_size))  # free page numbers, FIFO
        self._is_free = bytearray(b"\x01") * (self.size // self.page_size)

    def free_slots(self) -> tuple[int, ...]:
        ps = self.page_size
        pages = self._free.tolist()
        if ps == 1:
            return tuple(pages)
        return tuple(s for page in pages for s in range(page * ps, (page + 1) * ps))


class HostAllocator:
    """FIFO allocator over ``size`` host token slots, in page multiples."""

    def __init__(self, size: int, page_size: int) -> None:
        self.size = size
        self.page_size = page_size
        self.clear()

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        if n % self.page_size:
            raise UsageError(f"host allocation of {n} tokens is not a multiple of page_size {self.page_size}")
        if n > len(self._free):
            return None
        out = self._free.take(n)
        _set_all(self._is_free, out, 0)
        return out

    def free(self, slots: Sequence[int]) -> None:
        if len(set(slots)) != len(slots) or _any_set(self._is_free, slots):
            raise UsageError(f"host slots {sorted(slots)} freed twice")
        _set_all(self._is_free, slots, 1)
        self._free.extend(slots)

    def clear(self) -> None:
        self._free = _Fifo(range(self.size))
        self._is_free = bytearray(b"\x01") * self.size

    def free_slots(self) -> tuple[int, ...]:
        return tuple(self._free.tolist())
