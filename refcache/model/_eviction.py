"""Eviction order: the six strategies of seed §3.1 ② over one documented total order, and the leaf heap.

Every strategy maps a node to a priority tuple; a min-heap evicts the smallest first. SGLang breaks ties
through ``TreeNode.__lt__`` and, past that, through the iteration order of a Python set — not
reproducible. Here the total order is ``strategy priority + (node.id,)``: the node created earlier wins
a tie. Node ids come from a per-rank counter, so ranks that apply the same operations agree.

``LeafHeap`` keeps that order over a leaf set that the tree maintains incrementally. Entries are lazy: a
node whose priority changed is pushed again and stale entries are skipped when popped, so evicting
``k`` leaves costs ``O(k log n)`` instead of a scan of the whole tree per call.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Final, Protocol

from refcache.config import EvictionPolicy

__all__ = ["PRIORITY_FUNCTIONS", "LeafHeap", "Prioritized", "eviction_key"]


class Prioritized(Protocol):
    """The node fields the strategies read."""

    @property
    def id(self) -> int: ...
    @property
    def last_access_time(self) -> int: ...
    @property
    def creation_time(self) -> int: ...
    @property
    def hit_count(self) -> int: ...
    @property
    def priority(self) -> int: ...


PRIORITY_FUNCTIONS: Final[dict[EvictionPolicy, Callable[[Prioritized], tuple[int, ...]]]] = {
    EvictionPolicy.LRU: lambda n: (n.last_access_time,),
    EvictionPolicy.LFU: lambda n: (n.hit_count, n.last_access_time),
    EvictionPolicy.FIFO: lambda n: (n.creation_time,),
    EvictionPolicy.MRU: lambda n: (-n.last_access_time,),
    EvictionPolicy.FILO: lambda n: (-n.creation_time,),
    EvictionPolicy.PRIORITY: lambda n: (n.priority, n.last_access_time),
}


def eviction_key(policy: EvictionPolicy, node: Prioritized) -> tuple[int, ...]:
    """The node's place in the total eviction order: strategy priority, then node id.

    post: __return__[-1] == node.id
    """
    return (*PRIORITY_FUNCTIONS[policy](node), node.id)


class LeafHeap:
    """A min-heap of ``(eviction_key, node id)`` over a set of leaf ids, with lazy invalidation.

    ``members`` is the leaf set (owned by the tree: only ``add``/``discard`` change it). ``push`` is
    called whenever a member's key may have changed; ``pop`` returns the member with the smallest
    current key.
    """

    def __init__(self, key_of: Callable[[int], tuple[int, ...]]) -> None:
        self._key_of = key_of  # current key of a live node id
        self._heap: list[tuple[tuple[int, ...], int]] = []
        self.members: set[int] = set()

    def add(self, node_id: int) -> None:
        self.members.add(node_id)
        self.push(node_id)

    def discard(self, node_id: int) -> None:
        self.members.discard(node_id)

    def set_member(self, node_id: int, member: bool) -> None:
        """``add`` a node that should be a member and is not, ``discard`` one that should not be."""
        if not member:
            self.members.discard(node_id)
        elif node_id not in self.members:
            self.add(node_id)

    def push(self, node_id: int) -> None:
        if node_id in self.members:
            heapq.heappush(self._heap, (self._key_of(node_id), node_id))
            if len(self._heap) > 2 * len(self.members) + 64:
                self._compact()

    def pop(self) -> int | None:
        """Remove and return the member with the smallest key, or ``None`` if there is none."""
        while self._heap:
            key, node_id = heapq.heappop(self._heap)
            if node_id in self.members and self._key_of(node_id) == key:
                return node_id
        return None

    def clear(self) -> None:
        self._heap.clear()
        self.members.clear()

    def _compact(self) -> None:
        # Sorting the ids first makes the rebuilt heap independent of set iteration order.
        self._heap = [(self._key_of(i), i) for i in sorted(self.members)]
        heapq.heapify(self._heap)
