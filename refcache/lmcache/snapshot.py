"""``LMCacheSnapshot``: an LMCache engine's whole observable cache state, as plain data.

Cached content is named by ``NodeId`` (the tokens from the first one to the chunk's end: what LMCache's
chained chunk hash stands for), CPU memory objects by their allocator address (the model runs the same
first-fit allocator over an explicit free list, so addresses compare; ``Family.granularities`` has
``no-addresses`` for an adapter whose allocator differs). Tiers list their keys in policy order: the order
the tier's cache policy scans for an eviction candidate (``get_evict_candidates``), first candidate first.
The invariants of ``refcache.lmcache.invariants`` and the differential harness read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass

from refcache.family import NodeId

__all__ = [
    "CpuEntry",
    "CpuRecord",
    "DiskEntry",
    "DiskJob",
    "DiskRecord",
    "LMCacheSnapshot",
    "ObjectRecord",
    "PinRecord",
    "PrefetchRecord",
    "RemoteJob",
    "RemoteRecord",
]


@dataclass(frozen=True)
class ObjectRecord:
    """One live ``MemoryObj`` of the CPU allocator (allocated and not yet freed)."""

    address: int  # its start in the allocator's address space
    size: int  # physical size: the logical size rounded up to ALIGN_BYTES
    tokens: int  # tokens it holds (get_num_tokens)
    content: NodeId  # the chunk its bytes are (the key it was allocated for)
    ref_count: int  # meta.ref_count
    pin_count: int  # meta.pin_count


@dataclass(frozen=True)
class CpuEntry:
    """One entry of ``LocalCPUBackend.hot_cache``."""

    key: NodeId
    address: int  # the object it maps to
    freq: int  # LFU: the policy's frequency of the key; other policies: 0


@dataclass(frozen=True)
class CpuRecord:
    """``LocalCPUBackend`` and its allocator."""

    capacity: int  # allocator bytes (cpu_bytes)
    entries: tuple[CpuEntry, ...]  # the hot cache in policy order (first eviction candidate first)
    objects: tuple[ObjectRecord, ...]  # every live object, by address (hot-cache ones and others)
    free_list: tuple[tuple[int, int], ...]  # the allocator's explicit free list: (start, size), by start
    allocated_bytes: int  # the allocator's own counter of allocated bytes (total_allocated_size)
    touched: tuple[NodeId, ...] = ()  # keys_in_request: pinned hits whose policy update waits for touch_cache


@dataclass(frozen=True)
class DiskEntry:
    """One entry of ``LocalDiskBackend.dict`` (a published file)."""

    key: NodeId
    size: int  # the physical size it was written with (DiskCacheMetadata.size)
    pin_count: int  # DiskCacheMetadata's pin count
    damaged: bool = False  # a StorageFault (CORRUPT, DELETE) hit it: it can no longer be read intact


@dataclass(frozen=True)
class DiskJob:
    """A job of the disk worker's executor, waiting for ``Step(Queue.DISK)``: one put, or one prefetch's read of
    every disk chunk it hit (LMCache submits them as one job)."""

    kind: str  # "put": write the object's bytes, then publish the key; "read": a prefetch's batched read
    keys: tuple[NodeId, ...]  # put: one key; read: the chunks in order
    addresses: tuple[int, ...]  # the CPU objects it holds (put: the copy being written; read: the buffers)
    lookup_id: int | None = None  # read: the prefetch it belongs to


@dataclass(frozen=True)
class DiskRecord:
    """``LocalDiskBackend``."""

    capacity: int  # max_local_disk_size in bytes
    entries: tuple[DiskEntry, ...]  # published files in policy order (first eviction candidate first)
    reserved: int  # current_cache_size: bytes admitted (published files and writes in flight)
    usage: int  # usage: bytes of finished writes not yet removed
    pending_puts: tuple[NodeId, ...]  # the disk worker's put_tasks (admitted writes not yet published)
    jobs: tuple[DiskJob, ...]  # the executor's queue in the order it runs them
    fail_next_write: bool = False  # a FAIL_NEXT_WRITE fault waits for the next write
    fail_next_read: bool = False  # a FAIL_NEXT_READ fault waits for the next read
    touched: tuple[NodeId, ...] = ()  # keys_in_request: pinned hits whose policy update waits for touch_cache


@dataclass(frozen=True)
class RemoteJob:
    """A job of the remote connector on the storage manager's loop, waiting for ``Step(Queue.REMOTE)``."""

    kind: str  # "put" or "read" (a prefetch's batched read)
    keys: tuple[NodeId, ...]  # put: one key; read: the chunks in order
    lookup_id: int | None = None  # read: the prefetch it belongs to
    addresses: tuple[int, ...] = ()  # put: the CPU object it holds until it ran (the serializer passes it on)


@dataclass(frozen=True)
class RemoteRecord:
    """``RemoteBackend`` over its connector (unbounded; no pins)."""

    keys: tuple[NodeId, ...]  # stored objects, sorted
    damaged: tuple[NodeId, ...]  # stored objects a StorageFault damaged, sorted
    pending_puts: tuple[NodeId, ...]  # put_tasks (a set in LMCache): submitted and not yet finished, sorted
    jobs: tuple[RemoteJob, ...]  # FIFO
    fail_next_write: bool = False
    fail_next_read: bool = False


@dataclass(frozen=True)
class PinRecord:
    """The pins a pinned lookup holds (``LMCacheEngine.lookup_pins[lookup_id][location]``)."""

    lookup_id: int
    tier: (
        str  # "cpu" (LocalCPUBackend), "disk" (LocalDiskBackend) or "remote" (RemoteBackend: pins are no-ops)
    )
    keys: tuple[NodeId, ...]  # in lookup order


@dataclass(frozen=True)
class PrefetchRecord:
    """One ``async_lookup_and_prefetch`` not yet released by a ``Retrieve`` or ``LookupUnpin``."""

    lookup_id: int
    expected: tuple[int, ...]  # per tier with a hit, the chunks its lookup found (tier_expected_chunks)
    loaded: tuple[tuple[NodeId, int], ...]  # (key, CPU address) of every object loaded so far, in key order
    waiting: int  # reads still queued
    done: bool  # every read ran and the lookup server answered
    hit: int  # the answer (retrieved length in tokens); 0 until done
    pinned: tuple[NodeId, ...] = ()  # disk entries its pinned lookup pinned (released when it is consumed)


@dataclass(frozen=True)
class LMCacheSnapshot:
    chunk_size: int
    cpu: CpuRecord
    disk: DiskRecord | None  # None: no local disk tier
    remote: RemoteRecord | None  # None: no remote tier
    lookup_pins: tuple[PinRecord, ...]  # by lookup id, then tier
    prefetches: tuple[PrefetchRecord, ...]  # by lookup id
    warnings: tuple[str, ...] = ()  # LMCache's own "double free" / "double unpin" / invalidated-object
    #                                 reports so far (an adapter captures them; must stay empty)
