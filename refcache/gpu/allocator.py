"""Device slot allocators: which token slots of the device KV pool are in use.

Theory of operation. The device pool's ``size`` slots form ``num_pages = size // page_size`` pages,
numbered from 0 (no padding slot). Free pages wait in a FIFO queue that starts as ``[0, 1, ...]``.
``alloc(n)`` takes ``ceil(n / page_size)`` pages from the head and returns their slots
``page * page_size + offset`` in page order, cut to ``n``; ``free(slots)`` appends the distinct pages that
contain ``slots`` to the tail in ascending page order. The token allocator is the paged one with
``page_size=1``. The reference model mirrors exactly this order, so both hand out the same slots.

Only the scheduler thread touches an allocator (as in SGLang), so there is no lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from refcache.errors import UsageError

__all__ = ["PagedTokenToKVPoolAllocator", "TokenToKVPoolAllocator"]


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
        self.free_pages: deque[int] = deque(range(self.num_pages))  # FIFO; only alloc/free/clear touch it
        self._allocated = [False] * self.num_pages  # page -> in use; only alloc/free/clear touch it

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
        pages = [self.free_pages[i] for i in range(num)]
        taken = [p for p in pages if self._allocated[p]]
        if taken:
            raise UsageError(
                f"double allocation: pages {taken} are already allocated but sit in the free queue"
            )
        for p in pages:
            self.free_pages.popleft()
            self._allocated[p] = True
        base = torch.tensor(pages, dtype=torch.int64) * self.page_size
        slots = (base[:, None] + torch.arange(self.page_size, dtype=torch.int64)).flatten()[:need_size]
        return slots.to(self.device)

    def free(self, free_index: torch.Tensor) -> None:
        """Free the distinct pages containing ``free_index``; they join the tail in ascending order.

        Raises ``UsageError`` (and changes nothing) for a slot out of range or a page that is already
        free (double free).
        """
        slots = free_index.flatten().tolist()
        if not slots:
            return
        bad = [s for s in slots if not 0 <= s < self.num_pages * self.page_size]
        if bad:
            raise UsageError(f"free: slots {bad[:8]} are outside [0, {self.num_pages * self.page_size})")
        pages = sorted({s // self.page_size for s in slots})
        already = [p for p in pages if not self._allocated[p]]
        if already:
            raise UsageError(f"double free: pages {already[:8]} are already free")
        for p in pages:
            self._allocated[p] = False
            self.free_pages.append(p)
        if self._on_free is not None:
            base = torch.tensor(pages, dtype=torch.int64) * self.page_size
            self._on_free((base[:, None] + torch.arange(self.page_size, dtype=torch.int64)).flatten())


class TokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """The paged allocator with ``page_size=1``: one slot per page."""

    def __init__(self, size: int, device: torch.device | str = "cpu", kvcache: object = None) -> None:
        super().__init__(size, 1, device, kvcache)
