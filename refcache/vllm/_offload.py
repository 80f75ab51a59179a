"""The reference model of vLLM's CPU offload manager (``CPUOffloadingManager``) and its two policies.

Theory of operation. A chunk holds one block's content (``NodeId``) in a physical CPU slot and is in one
state of ``ChunkState``, by its reference count: -1 write-pending (``lookup`` says ``hit_pending``), 0
ready and evictable, > 0 loading (pinned). ``prepare_store`` skips contents already present, evicts only
ready, unpinned chunks outside its own offer, and either allocates every chunk it needs or returns None
(then no chunk changed; the policy may have adapted to the offer already). ``complete_store`` makes
chunks ready, or on failure removes and frees them (a ``metadata_only`` removal, reported only for chunks
still absent when the events are taken). Slots are handed out fresh first, then from the end of the free
list.

Each request's accesses (stores and loads) are recorded in first-seen order; finishing the request
commits them to the policy. The scheduler records no key positions here, so recency is by call order.

* ``Lru``: a recency order over every chunk; storing, and a request finishing (its keys tail first), move
  keys to the most recent end; eviction takes the least recent evictable chunks.
* ``Arc``: T1 (seen once) and T2 (reused), ghost lists B1 / B2 of evicted keys and an adaptive target
  size for T1; a store miss that hits a ghost moves the target; a finished request promotes the ready
  chunks it reused to T2.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from refcache.family import NodeId
from refcache.vllm.config import OffloadPolicy
from refcache.vllm.ops import EventKind, KvEvent
from refcache.vllm.snapshot import ChunkRecord

__all__ = ["Access", "Arc", "ChunkState", "Lru", "OffloadManager"]


class ChunkState(enum.Enum):
    WRITE_PENDING = "write-pending"  # ref_cnt -1: being stored, not readable
    READY = "ready"  # ref_cnt 0: readable and evictable
    LOADING = "loading"  # ref_cnt > 0: pinned by that many loads


@dataclass
class Chunk:
    chunk_id: int  # physical slot
    ref_cnt: int = -1  # only prepare_load, complete_load and complete_store change it

    @property
    def state(self) -> ChunkState:
        if self.ref_cnt < 0:
            return ChunkState.WRITE_PENDING
        return ChunkState.READY if self.ref_cnt == 0 else ChunkState.LOADING


@dataclass
class Access:
    """One request's accesses since it was admitted."""

    seen: list[NodeId] = field(default_factory=list)  # keys stored or loaded, first-seen order
    inserted: set[NodeId] = field(default_factory=set)  # keys this request's stores created
    reused: set[NodeId] = field(default_factory=set)  # ready keys it loaded or offered again
    store_misses: set[NodeId] = field(default_factory=set)  # keys already reported to on_store_miss
    finished: bool = False  # on_request_finished ran


class Policy(Protocol):
    def get(self, key: NodeId) -> Chunk | None: ...
    def insert(self, key: NodeId, chunk: Chunk) -> None: ...
    def remove(self, key: NodeId) -> None: ...
    def on_store_miss(self, keys: Sequence[NodeId]) -> None: ...
    def on_request_finished(
        self, keys: Sequence[NodeId], inserted_only: set[NodeId], reused: set[NodeId]
    ) -> None: ...
    def evict(self, n: int, protected: set[NodeId]) -> list[tuple[NodeId, Chunk]] | None: ...
    def mark_evictable(self, key: NodeId) -> None: ...
    def mark_non_evictable(self, key: NodeId) -> None: ...
    def orders(
        self,
    ) -> tuple[
        tuple[NodeId, ...], tuple[NodeId, ...], tuple[tuple[NodeId, ...], tuple[NodeId, ...]], float
    ]: ...


class Lru:
    def __init__(self) -> None:
        self.order: dict[NodeId, Chunk] = {}  # every chunk, least recently used first
        self.evictable: set[NodeId] = set()  # ready, unpinned

    def get(self, key: NodeId) -> Chunk | None:
        return self.order.get(key)

    def insert(self, key: NodeId, chunk: Chunk) -> None:
        self.order[key] = chunk
        if chunk.ref_cnt == 0:
            self.evictable.add(key)

    def remove(self, key: NodeId) -> None:
        del self.order[key]
        self.evictable.discard(key)

    def _refresh(self, keys: Sequence[NodeId]) -> None:
        for key in reversed(keys):  # tail first, so the head ends most recent
            if key in self.order:
                self.order[key] = self.order.pop(key)

    def on_store_miss(self, keys: Sequence[NodeId]) -> None:
        self._refresh(keys)

    def on_request_finished(
        self, keys: Sequence[NodeId], inserted_only: set[NodeId], reused: set[NodeId]
    ) -> None:
        self._refresh(keys)

    def evict(self, n: int, protected: set[NodeId]) -> list[tuple[NodeId, Chunk]] | None:
        chosen = [k for k in self.order if k in self.evictable and k not in protected][:n]
        if len(chosen) < n:
            return None
        out = []
        for key in chosen:
            out.append((key, self.order.pop(key)))
            self.evictable.remove(key)
        return out

    def mark_evictable(self, key: NodeId) -> None:
        self.evictable.add(key)

    def mark_non_evictable(self, key: NodeId) -> None:
        self.evictable.remove(key)

    def orders(
        self,
    ) -> tuple[tuple[NodeId, ...], tuple[NodeId, ...], tuple[tuple[NodeId, ...], tuple[NodeId, ...]], float]:
        return tuple(self.order), (), ((), ()), 0.0


def _by_key(record: ChunkRecord) -> NodeId:
    return record.key


def _to_end(d: dict[NodeId, Chunk], key: NodeId) -> None:
    d[key] = d.pop(key)


class Arc:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # ghost lists are cut to this length
        self.target: float = 0.0  # target_t1_size
        self.t1: dict[NodeId, Chunk] = {}  # seen once, oldest first
        self.t2: dict[NodeId, Chunk] = {}  # reused, oldest first
        self.b1: dict[NodeId, None] = {}  # keys evicted from T1, oldest first
        self.b2: dict[NodeId, None] = {}  # keys evicted from T2, oldest first

    def get(self, key: NodeId) -> Chunk | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: NodeId, chunk: Chunk) -> None:
        self.t1[key] = chunk
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: NodeId) -> None:
        if self.t1.pop(key, None) is None:
            self.t2.pop(key, None)

    def on_store_miss(self, keys: Sequence[NodeId]) -> None:
        for key in reversed(keys):
            if key in self.b1:
                self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.capacity)
                self.b1[key] = self.b1.pop(key)
            elif key in self.b2:
                self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
                self.b2[key] = self.b2.pop(key)

    def on_request_finished(
        self, keys: Sequence[NodeId], inserted_only: set[NodeId], reused: set[NodeId]
    ) -> None:
        for key in reversed(keys):
            if key in inserted_only:
                if key in self.t1:
                    _to_end(self.t1, key)
                elif key in self.t2:
                    _to_end(self.t2, key)
            elif key in reused and key in self.t1:
                self.t2[key] = self.t1.pop(key)
            elif key in reused and key in self.t2:
                _to_end(self.t2, key)

    def evict(self, n: int, protected: set[NodeId]) -> list[tuple[NodeId, Chunk]] | None:
        def candidates(d: dict[NodeId, Chunk]) -> list[NodeId]:
            return [k for k, c in d.items() if c.ref_cnt == 0 and k not in protected]

        from_t1, from_t2 = candidates(self.t1), candidates(self.t2)
        i1 = i2 = 0
        virtual_t1 = len(self.t1)
        chosen: list[tuple[NodeId, bool]] = []
        for _ in range(n):
            if virtual_t1 >= int(self.target) and i1 < len(from_t1):
                chosen.append((from_t1[i1], True))
                i1, virtual_t1 = i1 + 1, virtual_t1 - 1
            elif i2 < len(from_t2):
                chosen.append((from_t2[i2], False))
                i2 += 1
            elif i1 < len(from_t1):
                chosen.append((from_t1[i1], True))
                i1, virtual_t1 = i1 + 1, virtual_t1 - 1
            else:
                return None
        out = []
        for key, recent in chosen:
            if recent:
                out.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                out.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                del ghost[next(iter(ghost))]
        return out

    def mark_evictable(self, key: NodeId) -> None:
        pass  # ARC scans T1 / T2 for unpinned ready chunks instead

    def mark_non_evictable(self, key: NodeId) -> None:
        pass

    def orders(
        self,
    ) -> tuple[tuple[NodeId, ...], tuple[NodeId, ...], tuple[tuple[NodeId, ...], tuple[NodeId, ...]], float]:
        return tuple(self.t1), tuple(self.t2), (tuple(self.b1), tuple(self.b2)), self.target


class OffloadManager:
    def __init__(self, capacity: int, policy: OffloadPolicy) -> None:
        self.capacity = capacity  # num_chunks
        self.policy: Policy = Lru() if policy is OffloadPolicy.LRU else Arc(capacity)
        self.num_allocated = 0  # fresh chunk ids handed out
        self.free_list: list[int] = []  # freed chunk ids, reused from the end
        self.num_evictable = 0  # ready, unpinned chunks (the manager's own counter)
        self.num_write_pending = 0  # write-pending chunks (the manager's own counter)
        self._events: list[tuple[KvEvent, bool]] = []  # (event, metadata_only), not yet taken

    def lookup(self, key: NodeId) -> str:
        chunk = self.policy.get(key)
        if chunk is None:
            return "miss"
        return "hit_pending" if chunk.ref_cnt < 0 else "hit"

    def _record(self, keys: Sequence[NodeId], access: Access, reused: Sequence[NodeId] = ()) -> None:
        for key in keys:
            if key not in access.seen:
                assert not access.finished, "new keys after the request finished"
                access.seen.append(key)
        access.reused.update(k for k in reused if k not in access.inserted)

    def prepare_load(self, keys: Sequence[NodeId], access: Access) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.ref_cnt >= 0, f"load of {key} that is not ready"
            if chunk.ref_cnt == 0:
                self.policy.mark_non_evictable(key)
                self.num_evictable -= 1
            chunk.ref_cnt += 1
        self._record(keys, access, reused=keys)

    def complete_load(self, keys: Sequence[NodeId]) -> None:
        for key in keys:
            chunk = self.policy.get(key)
            assert chunk is not None and chunk.ref_cnt > 0, f"complete_load of {key} that is not pinned"
            chunk.ref_cnt -= 1
            if chunk.ref_cnt == 0:
                self.num_evictable += 1
                self.policy.mark_evictable(key)

    def prepare_store(
        self, keys: Sequence[NodeId], access: Access
    ) -> tuple[list[NodeId], list[NodeId]] | None:
        """(keys now write-pending, keys evicted), or None when the chunks do not fit."""
        to_store = [k for k in keys if self.policy.get(k) is None]
        ready = [k for k in keys if (c := self.policy.get(k)) is not None and c.ref_cnt >= 0]
        misses = [k for k in to_store if k not in access.store_misses]
        if misses:
            self.policy.on_store_miss(misses)
            access.store_misses.update(misses)
        recorded = set(to_store) | set(ready)
        self._record([k for k in keys if k in recorded], access, reused=ready)
        if not to_store:
            return [], []
        need = len(to_store) - (len(self.free_list) + self.capacity - self.num_allocated)
        evicted: list[NodeId] = []
        if need > 0:
            if need > self.num_evictable:
                return None
            chosen = self.policy.evict(need, set(keys))
            if chosen is None:
                return None
            self.num_evictable -= len(chosen)
            for key, chunk in chosen:
                self.free_list.append(chunk.chunk_id)
                evicted.append(key)
            self._events.append((KvEvent(EventKind.OFFLOAD_REMOVED, tuple(evicted)), False))
        fresh = min(len(to_store), self.capacity - self.num_allocated)
        ids = list(range(self.num_allocated, self.num_allocated + fresh))
        self.num_allocated += fresh
        ids += [self.free_list.pop() for _ in range(len(to_store) - fresh)]
        for key, chunk_id in zip(to_store, ids, strict=True):
            self.policy.insert(key, Chunk(chunk_id))
        self.num_write_pending += len(to_store)
        access.inserted.update(to_store)
        return to_store, evicted

    def complete_store(self, keys: Sequence[NodeId], success: bool) -> None:
        done: list[NodeId] = []
        for key in keys:
            chunk = self.policy.get(key)
            if chunk is None or chunk.ref_cnt >= 0:
                continue
            self.num_write_pending -= 1
            if success:
                chunk.ref_cnt = 0
                self.num_evictable += 1
                self.policy.mark_evictable(key)
            else:
                self.policy.remove(key)
                self.free_list.append(chunk.chunk_id)
            done.append(key)
        if done:
            kind = EventKind.OFFLOAD_STORED if success else EventKind.OFFLOAD_REMOVED
            self._events.append((KvEvent(kind, tuple(done)), not success))

    def on_request_finished(self, access: Access) -> None:
        if access.finished:
            return
        access.finished = True
        self.policy.on_request_finished(list(access.seen), access.inserted - access.reused, access.reused)

    def take_events(self) -> list[KvEvent]:
        """The events so far; a failed store's removal names only chunks still absent now."""
        out: list[KvEvent] = []
        for event, metadata_only in self._events:
            if metadata_only:
                keys = tuple(k for k in event.keys if self.policy.get(k) is None)
                if not keys:
                    continue
                event = KvEvent(event.kind, keys)
            out.append(event)
        self._events.clear()
        return out

    def chunk_records(self) -> tuple[ChunkRecord, ...]:
        recency, frequent, _, _ = self.policy.orders()
        chunks = [(k, self.policy.get(k)) for k in (*recency, *frequent)]
        return tuple(
            sorted((ChunkRecord(k, c.chunk_id, c.ref_cnt) for k, c in chunks if c is not None), key=_by_key)
        )
