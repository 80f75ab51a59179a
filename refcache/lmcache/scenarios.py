"""LMCache's directed conformance scenarios: short runs, each through one situation of its tiers — a stored
prefix found and read back, CPU eviction under each policy's order, a pinned lookup outliving pressure,
write-through to disk and promotion of a disk hit, a write in flight, the remote tier, an async prefetch and
a damaged file. ``refcache.conformance.check_system`` runs every one on a system under test;
``tests/unit/test_family.py`` and ``tests/unit/test_lmcache_model.py`` hold the reference model to them."""

from __future__ import annotations

from typing import Final

from refcache.config import EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.family import Scenario
from refcache.lmcache.ops import (
    Clear,
    FaultKind,
    LMCacheOp,
    Lookup,
    LookupUnpin,
    PollPrefetch,
    Prefetch,
    Queue,
    Retrieve,
    Step,
    StorageFault,
    Store,
    Tier,
)

__all__ = ["config", "scenarios"]


def config(
    cpu_chunks: int,
    *,
    disk_chunks: int = 0,
    remote: bool = False,
    policy: EvictionPolicy = EvictionPolicy.LRU,
    async_loading: bool = False,
    chunk_size: int = 4,
    save_unfull_chunk: bool = False,
) -> HiCacheConfig:
    """A configuration of ``cpu_chunks`` CPU chunks of ``chunk_size`` tokens (one aligned 4 KiB object each at
    the default KV shape), ``disk_chunks`` disk chunks, a remote tier or not (``refcache.lmcache.config``
    says which ``HiCacheConfig`` field carries each)."""
    backend = "memory" if remote else ("file" if disk_chunks else None)
    return HiCacheConfig(
        page_size=chunk_size,
        device_size=chunk_size * cpu_chunks,
        hicache_ratio=disk_chunks / cpu_chunks,
        hicache_storage_backend=backend,
        radix_eviction_policy=policy,
        hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE
        if async_loading
        else PrefetchPolicy.BEST_EFFORT,
        hicache_write_policy=WritePolicy.WRITE_THROUGH
        if save_unfull_chunk
        else WritePolicy.WRITE_THROUGH_SELECTIVE,
    )


A: Final = tuple(range(1, 9))  # two chunks
B: Final = tuple(range(11, 19))
C: Final = tuple(range(21, 29))


def scenarios() -> tuple[Scenario[LMCacheOp], ...]:
    """Every LMCache scenario, in a fixed order."""
    return (
        Scenario(
            "store-lookup-retrieve",
            "a stored prefix is found by a lookup and read back; a store past a cached prefix stores the rest",
            config(6),
            (
                Store(A),
                Lookup(A),
                Lookup((*A, 9)),
                Retrieve(A),
                Store((*A, *B), skip=8),
                Retrieve((*A, *B), skip=4),
            ),
        ),
        Scenario(
            "cpu-eviction-order",
            "a full CPU tier evicts one policy candidate at a time, LRU: a pinned lookup's touch makes the other "
            "prefix the least recently used",
            config(4),
            (
                Store(A),
                Store(B),
                Lookup(A, 1, pin=True),
                LookupUnpin(1),
                Store(C),
                Lookup(A),
                Lookup(B),
                Lookup(C),
            ),
        ),
        Scenario(
            "mru-evicts-newest",
            "under MRU the most recently used chunk goes first, leaving a gap in the older chain",
            config(3, policy=EvictionPolicy.MRU),
            (Store(A), Store(B), Lookup(A), Lookup(B)),
        ),
        Scenario(
            "pinned-survives-pressure",
            "chunks a lookup pins are not evicted: a store that needs their room stops short; after lookup_unpin "
            "it fits",
            config(3, policy=EvictionPolicy.LFU),
            (
                Store(A),
                Lookup(A, 7, pin=True),
                Store(B),
                Lookup(B),
                LookupUnpin(7),
                Store(B),
                Lookup(B),
                Lookup(A),
            ),
        ),
        Scenario(
            "disk-write-through-and-promotion",
            "a store writes through to disk once the disk worker runs; a chunk evicted from CPU is read from disk "
            "and promoted back into CPU",
            config(2, disk_chunks=4),
            (Store(A), Step(Queue.DISK, 2), Store(B), Step(Queue.DISK, 2), Lookup(A), Retrieve(A), Lookup(A)),
        ),
        Scenario(
            "write-in-flight",
            "an object whose disk write is in flight is held by it: CPU clear keeps it until the write ran",
            config(4, disk_chunks=4),
            (Store(A), Clear(), Lookup(A), Step(Queue.DISK), Clear(), Step(Queue.DISK), Clear(), Lookup(A)),
        ),
        Scenario(
            "remote-put-and-read",
            "a remote put holds its CPU object until it ran (clear keeps it); then the remote tier holds the chunk "
            "and a CPU miss reads it back",
            config(4, remote=True),
            (
                Store(A),
                Clear(),
                Lookup(A),
                Step(Queue.REMOTE, 2),
                Clear(),
                Lookup(A),
                Retrieve(A),
                Lookup(A),
            ),
        ),
        Scenario(
            "async-prefetch",
            "an async prefetch answers once its disk read ran, and the retrieve takes what it loaded",
            config(4, disk_chunks=4, async_loading=True),
            (
                Store(A),
                Step(Queue.DISK, 2),
                Clear(),
                Prefetch(A, 1),
                PollPrefetch(1),
                Step(Queue.DISK),
                PollPrefetch(1),
                Retrieve(A, lookup_id=1),
                LookupUnpin(1),
            ),
        ),
        Scenario(
            "damaged-file-is-a-miss",
            "a corrupted disk file is a miss when read (the chunks before it are returned, nothing is promoted); "
            "a failed write publishes nothing",
            config(2, disk_chunks=4),
            (
                Store(A),
                Step(Queue.DISK, 2),
                Store(B),
                Step(Queue.DISK, 2),
                StorageFault(Tier.DISK, FaultKind.CORRUPT, 1),
                Retrieve(A),
                StorageFault(Tier.DISK, FaultKind.FAIL_NEXT_WRITE),
                Store(C),
                Step(Queue.DISK, 2),
                Clear(),
                Lookup(C),
            ),
        ),
    )
