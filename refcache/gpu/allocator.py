"""Device slot allocators: which token slots of the device KV pool are in use.

Theory of operation. The device pool's ``size`` slots form ``num_pages = size // page_size`` pages,
numbered from 0 (no padding slot). Free pages wait in a FIFO queue that starts as ``[0, 1, ...]``.
``alloc(n)`` takes ``ceil(n / page_size)`` pages from the head and returns their slots
``page * page_size + offset`` in page order, cut to ``n``; ``free(slots)`` appends the distinct pages that
contain ``slots`` to the tail in ascending page order. The token allocator is the paged one with
``page_size=1``. The reference model mirrors exactly this order, so both hand out the same slots.

Only the scheduler thread touches an allocator (as in SGLang), so there is no lock.

Cost. A request allocates and frees hundreds of pages at page size 1, so the per-page work is one deque
operation; the checks (range, double allocation, double free) and the slot arithmetic are numpy calls on
the whole batch, not per-page Python.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import numpy as np
import numpy.typing as npt
import torch

from refcache.errors import UsageError

__all__ = ["FreeQueue", "PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator", "sorted_unique"]

Int64s = npt.NDArray[np.int64]


def sorted_unique(numbers: Int64s) -> Int64s:
    """``np.unique(numbers)`` (sorted, distinct) in two numpy calls when they are already distinct."""
    ordered = np.sort(numbers)
    if len(ordered) < 2:
        return ordered
    distinct = ordered[1:] != ordered[:-1]
    if distinct.all():
        return ordered
    keep = np.concatenate((np.ones(1, dtype=bool), distinct))
    out: Int64s = ordered[keep]
    return out


class FreeQueue:
    """A FIFO queue of free page (or slot) numbers in a numpy ring buffer: ``take(n)`` removes the first
    ``n`` and ``put(numbers)`` appends at the tail, each a couple of numpy slices however many numbers
    move. It reads like a ``deque`` of ints (``len``, iteration head first, ``popleft``, ``append``,
    ``extend``, ``appendleft``, ``extendleft``), which is how tests corrupt it on purpose."""

    def __init__(self, numbers: Iterable[int] = ()) -> None:
        data = (
            np.arange(numbers.start, numbers.stop, numbers.step, dtype=np.int64)
            if isinstance(numbers, range)
            else np.fromiter(numbers, dtype=np.int64)
        )
        self._buf: Int64s = np.empty(max(len(data), 16), dtype=np.int64)
        self._buf[: len(data)] = data
        self._head = 0
        self._len = len(data)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[int]:
        return iter(self.peek(self._len).tolist())

    def __repr__(self) -> str:
        return f"FreeQueue({list(self)})"

    def _positions(self, start: int, n: int) -> tuple[slice, slice]:
        """The buffer slices holding ``n`` entries from queue position ``start`` (the second may be empty)."""
        cap = len(self._buf)
        first = (self._head + start) % cap
        end = first + n
        if end <= cap:
            return slice(first, end), slice(0, 0)
        return slice(first, cap), slice(0, end - cap)

    def peek(self, n: int) -> Int64s:
        """A copy of the first ``n`` entries (``n <= len``)."""
        a, b = self._positions(0, n)
        if b.stop == 0:
            return self._buf[a].copy()
        return np.concatenate((self._buf[a], self._buf[b]))

    def take(self, n: int) -> Int64s:
        """Remove and return the first ``n`` entries (``n <= len``)."""
        out = self.peek(n)
        self._head = (self._head + n) % len(self._buf)
        self._len -= n
        return out

    def _reserve(self, extra: int) -> None:
        if self._len + extra <= len(self._buf):
            return
        data = self.peek(self._len)
        self._buf = np.empty(max(2 * len(self._buf), self._len + extra), dtype=np.int64)
        self._buf[: self._len] = data
        self._head = 0

    def put(self, numbers: Int64s) -> None:
        """Append ``numbers`` at the tail, in order."""
        self._reserve(len(numbers))
        a, b = self._positions(self._len, len(numbers))
        cut = a.stop - a.start
        self._buf[a] = numbers[:cut]
        self._buf[b] = numbers[cut:]
        self._len += len(numbers)

    def append(self, number: int) -> None:
        self.put(np.array([number], dtype=np.int64))

    def extend(self, numbers: Iterable[int]) -> None:
        self.put(np.fromiter(numbers, dtype=np.int64))

    def popleft(self) -> int:
        if not self._len:
            raise IndexError("pop from an empty FreeQueue")
        return int(self.take(1)[0])

    def appendleft(self, number: int) -> None:
        self._reserve(1)
        self._head = (self._head - 1) % len(self._buf)
        self._buf[self._head] = number
        self._len += 1

    def extendleft(self, numbers: Iterable[int]) -> None:
        """As ``deque.extendleft``: each number in turn goes to the head (so they end up reversed)."""
        for number in numbers:
            self.appendleft(number)


class PagedTokenToKVPoolAllocator:
    """Page-granular FIFO allocator over ``size`` device token slots.

    ``kvcache`` is the device pool whose slots are handed out (returned by ``get_kvcache``); it may be
    None for a bare allocator in tests. ``on_free`` is called with every slot of the pages each ``free``
    returns (the test implementation poisons them, see ``KVCache.poison``).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        device: torch.device | str = "cpu",
        kvcache: object = None,
        on_free: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        if size < 1 or page_size < 1:
            raise UsageError(f"size={size} and page_size={page_size} must be positive")
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        self._kvcache = kvcache
        self._on_free = on_free
        self.clear()

    def clear(self) -> None:
        """Free every page; the free queue becomes ``[0, 1, ..., num_pages - 1]``."""
        self.free_pages = FreeQueue(range(self.num_pages))  # FIFO; only alloc/free/clear touch it
        self._allocated = np.zeros(self.num_pages, dtype=bool)  # page -> in use; only alloc/free/clear
        self._offsets = np.arange(self.page_size, dtype=np.int64)

    def get_kvcache(self) -> object:
        return self._kvcache

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return len(self.free_pages) * self.page_size

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` token slots (int64, on ``device``) from whole pages at the queue head, or None
        (nothing changed) when too few pages are free.

        Raises ``UsageError`` for a negative size, or when the queue holds a page that is in use (a
        double allocation: the queue was corrupted from outside).
        """
        if need_size < 0:
            raise UsageError(f"alloc({need_size}): the size must be non-negative")
        num = -(-need_size // self.page_size)
        if num > len(self.free_pages):
            return None
        pages = self.free_pages.peek(num)
        in_use = self._allocated[pages]
        if in_use.any():
            raise UsageError(
                f"double allocation: pages {pages[in_use].tolist()} are already allocated but sit in the "
                "free queue"
            )
        self.free_pages.take(num)
        self._allocated[pages] = True
        slots = pages if self.page_size == 1 else (pages[:, None] * self.page_size + self._offsets).ravel()
        return torch.from_numpy(slots[:need_size]).to(self.device)

    def free(self, free_index: torch.Tensor) -> None:
        """Free the distinct pages containing ``free_index``; they join the tail in ascending order.

        Raises ``UsageError`` (and changes nothing) for a slot out of range or a page that is already
        free (double free).
        """
        slots = free_index.detach().flatten().cpu().numpy().astype(np.int64, copy=False)
        if not len(slots):
            return
        limit = self.num_pages * self.page_size
        if int(slots.min()) < 0 or int(slots.max()) >= limit:
            bad = slots[(slots < 0) | (slots >= limit)]
            raise UsageError(f"free: slots {bad[:8].tolist()} are outside [0, {limit})")
        pages = sorted_unique(slots // self.page_size)
        free = ~self._allocated[pages]
        if free.any():
            raise UsageError(f"double free: pages {pages[free][:8].tolist()} are already free")
        self._allocated[pages] = False
        self.free_pages.put(pages)
        if self._on_free is not None:
            self._on_free(torch.from_numpy((pages[:, None] * self.page_size + self._offsets).ravel()))


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The paged allocator with ``page_size=1``: one slot per page."""

    def __init__(self, size: int, device: torch.device | str = "cpu", kvcache: object = None) -> None:
        super().__init__(size, 1, device, kvcache)
