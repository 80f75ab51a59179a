"""The reference model's parts: a tier's cache policy (LMCache's ``cache_policy/``) and the CPU allocator's
address space (``memory_management.AddressManager``), each as LMCache runs it; ``refcache.lmcache.model``
composes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from refcache.family import NodeId
from refcache.lmcache.config import ALIGN_BYTES, CachePolicy

__all__ = ["Allocator", "MemoryObj", "Policy"]

V = TypeVar("V")


class Policy:
    """One tier's cache policy over the tier's own mapping (an insertion-ordered ``dict``, as LMCache's
    ``init_mutable_mapping`` makes one). LRU, FIFO and MRU keep their state in the mapping's order; LFU
    keeps a frequency per key and, per frequency, its keys in the order they got there."""

    def __init__(self, kind: CachePolicy) -> None:
        self.kind = kind
        self.freq: dict[NodeId, int] = {}  # LFU only: key_to_freq (only this class touches it)
        self.buckets: dict[int, dict[NodeId, None]] = {}  # LFU only: freq_to_keys

    def _bucket_add(self, key: NodeId, freq: int) -> None:
        self.freq[key] = freq
        self.buckets.setdefault(freq, {})[key] = None

    def _bucket_drop(self, key: NodeId) -> None:
        freq = self.freq.pop(key, None)
        if freq is None:
            return
        bucket = self.buckets[freq]
        bucket.pop(key, None)
        if not bucket:
            del self.buckets[freq]

    def on_hit(self, key: NodeId, mapping: dict[NodeId, V]) -> None:
        """``update_on_hit``: LRU and MRU move the key to the end; LFU counts one more use; FIFO nothing. A
        key no longer in the mapping is left alone (decision L-09)."""
        if key not in mapping:
            return
        if self.kind in (CachePolicy.LRU, CachePolicy.MRU):
            mapping[key] = mapping.pop(key)
        elif self.kind is CachePolicy.LFU and key in self.freq:
            freq = self.freq[key]
            self._bucket_drop(key)
            self._bucket_add(key, freq + 1)

    def on_put(self, key: NodeId) -> None:
        """``update_on_put``: LFU starts the key at frequency 1 (at the end of that bucket)."""
        if self.kind is CachePolicy.LFU:
            self._bucket_drop(key)
            self._bucket_add(key, 1)

    def on_force_evict(self, key: NodeId) -> None:
        """``update_on_force_evict``: LFU forgets the key."""
        if self.kind is CachePolicy.LFU:
            self._bucket_drop(key)

    def order(self, mapping: Mapping[NodeId, object]) -> list[NodeId]:
        """The mapping's keys in the order ``get_evict_candidates`` scans them (first candidate first)."""
        if self.kind in (CachePolicy.LRU, CachePolicy.FIFO):
            return list(mapping)
        if self.kind is CachePolicy.MRU:
            return list(mapping)[::-1]
        scanned = [k for f in sorted(self.buckets) for k in self.buckets[f] if k in mapping]
        return scanned + [k for k in mapping if k not in self.freq]

    def candidate(
        self, mapping: Mapping[NodeId, object], can_evict: Callable[[NodeId], bool]
    ) -> NodeId | None:
        """``get_evict_candidates(num_candidates=1)``: the first evictable key in policy order, or None. LFU
        forgets the key it returns (the caller removes it with ``force=False``). Keys the policy holds that
        the mapping does not (a disk write admitted and not yet published) are skipped (decision L-10)."""
        for key in self.order(mapping):
            if can_evict(key):
                if self.kind is CachePolicy.LFU:
                    self._bucket_drop(key)
                return key
        return None

    def frequency(self, key: NodeId) -> int:
        """The key's LFU frequency (0 under the other policies)."""
        return self.freq.get(key, 0) if self.kind is CachePolicy.LFU else 0


@dataclass
class MemoryObj:
    """One allocated CPU memory object (``TensorMemoryObj``'s metadata). Only ``Allocator`` creates and
    frees them; the model's tiers change the counts through ``refcache.lmcache.model``."""

    address: int
    size: int  # physical (aligned) size
    tokens: int
    content: NodeId  # the chunk it holds
    ref_count: int = 1  # a fresh object is held by whoever allocated it
    pin_count: int = 0

    @property
    def can_evict(self) -> bool:
        """Not pinned and held by its tier alone (``MemoryObj.can_evict``)."""
        return self.pin_count == 0 and self.ref_count == 1


class Allocator:
    """``AddressManager`` over ``capacity`` bytes: first fit over an explicit free list sorted by address,
    sizes rounded up to ``ALIGN_BYTES``, a freed block coalesced with its neighbours."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_list: list[tuple[int, int]] = [(0, capacity)]  # (start, size), by start
        self.allocated = 0  # total_allocated_size
        self.objects: dict[int, MemoryObj] = {}  # live objects by address

    def allocate(self, nbytes: int, tokens: int, content: NodeId) -> MemoryObj | None:
        """A fresh object of ``nbytes`` (rounded up), or None when no free block is large enough."""
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        for index, (start, free) in enumerate(self.free_list):
            if free >= size:
                if free > size:
                    self.free_list[index] = (start + size, free - size)
                else:
                    del self.free_list[index]
                self.allocated += size
                obj = MemoryObj(start, size, tokens, content)
                self.objects[start] = obj
                return obj
        return None

    def free(self, obj: MemoryObj) -> None:
        """Return ``obj``'s block (``AddressManager.free`` with ``_coalesce``)."""
        del self.objects[obj.address]
        self.allocated -= obj.size
        start, size = obj.address, obj.size
        index = next((i for i, (s, _) in enumerate(self.free_list) if s > start), len(self.free_list))
        prev = self.free_list[index - 1] if index > 0 else None
        succ = self.free_list[index] if index < len(self.free_list) else None
        merge_prev = prev is not None and prev[0] + prev[1] == start
        merge_succ = succ is not None and start + size == succ[0]
        if merge_prev and merge_succ:
            assert prev is not None and succ is not None
            self.free_list[index - 1] = (prev[0], prev[1] + size + succ[1])
            del self.free_list[index]
        elif merge_prev:
            assert prev is not None
            self.free_list[index - 1] = (prev[0], prev[1] + size)
        elif merge_succ:
            assert succ is not None
            self.free_list[index] = (start, size + succ[1])
        else:
            self.free_list.insert(index, (start, size))

    def live(self) -> Iterable[MemoryObj]:
        return (self.objects[a] for a in sorted(self.objects))
