"""LMCache 0.5.6's own engine through the adapter, operation by operation: the gates, the content oracle, the
busy-wait turned into an observation, LMCache's alarms captured, faults, and clean teardown. Each check is
shown failing on a deliberately broken input where it could pass vacuously."""

from __future__ import annotations

import threading

import pytest
import torch

from refcache.config import HiCacheConfig, PrefetchPolicy
from refcache.engines.lmcache import LMCacheSystem
from refcache.errors import UsageError
from refcache.family import NodeId
from refcache.lmcache.ops import (
    Blocked,
    FaultKind,
    Lookup,
    LookupResult,
    LookupUnpin,
    PollPrefetch,
    Prefetch,
    PrefetchResult,
    Queue,
    Retrieve,
    RetrieveResult,
    Step,
    StepResult,
    StorageFault,
    Store,
    StoreResult,
    Tier,
)

A = tuple(range(100, 112))  # three chunks of four tokens
B = tuple(range(200, 216))  # four chunks


def config(**changes: object) -> HiCacheConfig:
    base: dict[str, object] = {
        "page_size": 4,
        "device_size": 16,  # four chunks of CPU memory
        "hicache_storage_backend": "memory",  # CPU, local disk and the fs:// remote tier
        "hicache_ratio": 1.5,  # six chunks of disk
    }
    base.update(changes)
    return HiCacheConfig(**base)  # type: ignore[arg-type]


def key(tokens: tuple[int, ...]) -> NodeId:
    return NodeId("", tokens)


def test_writes_wait_at_their_gates_until_a_step_runs_them() -> None:
    with LMCacheSystem(config()) as lm:
        assert lm.apply(Store(A)) == StoreResult(12)
        snap = lm.snapshot()
        assert snap.disk is not None and snap.remote is not None
        assert [j.keys for j in snap.disk.jobs] == [(key(A[:4]),), (key(A[:8]),), (key(A),)]
        assert snap.disk.entries == () and snap.remote.keys == ()
        assert snap.disk.pending_puts == (key(A[:4]), key(A[:8]), key(A))
        assert lm.apply(Step(Queue.DISK, 2)) == StepResult((key(A[:4]), key(A[:8])))
        snap = lm.snapshot()
        assert snap.disk is not None and [e.key for e in snap.disk.entries] == [key(A[:4]), key(A[:8])]
        assert lm.apply(Step(Queue.REMOTE, 3)).done == (key(A[:4]), key(A[:8]), key(A))  # type: ignore[union-attr]
        assert snap.remote is not None and lm.snapshot().remote.keys == (key(A[:4]), key(A[:8]), key(A))  # type: ignore[union-attr]
        with pytest.raises(UsageError, match="no job is waiting in the remote queue"):
            lm.apply(Step(Queue.REMOTE))


def test_a_retrieve_returns_the_bytes_stored_and_the_oracle_sees_a_wrong_slot() -> None:
    with LMCacheSystem(config()) as lm:
        lm.apply(Store(A))
        assert lm.apply(Lookup(A, 1, pin=True)) == LookupResult(12)
        assert lm.apply(Retrieve(A, 0, 1)) == RetrieveResult(12)
        lm.apply(LookupUnpin(1))
        assert lm.snapshot().warnings == ()
        # A connector that writes each chunk one slot too far: the oracle must say so.
        connector = lm.driver.connector

        def shifted(memory_objs: list[object], starts: list[int], ends: list[int], **kwargs: object) -> None:
            slots = kwargs["slot_mapping"]
            assert isinstance(slots, torch.Tensor)
            for obj, start, end in zip(memory_objs, starts, ends, strict=True):
                connector.kv[:, :, slots[start:end] + 1, :] = obj.tensor  # type: ignore[attr-defined]

        connector.batched_to_gpu = shifted  # type: ignore[method-assign,assignment]
        lm.apply(Lookup(A, 2, pin=True))
        lm.apply(Retrieve(A, 0, 2))
        assert any("not the KV stored" in w for w in lm.snapshot().warnings)


def test_a_disk_hit_is_read_back_byte_for_byte_and_promoted_into_cpu() -> None:
    with LMCacheSystem(config(hicache_ratio=3)) as lm:  # twelve chunks of disk: nothing leaves it
        lm.apply(Store(A))
        lm.apply(Step(Queue.DISK, 3))
        lm.apply(Step(Queue.REMOTE, 3))  # a remote put holds its object until it ran
        lm.apply(Store(B))  # four chunks into four: A's chunks are evicted from CPU
        lm.apply(Step(Queue.DISK, 4))
        lm.apply(Step(Queue.REMOTE, 4))
        cpu = {e.key for e in lm.snapshot().cpu.entries}
        assert key(A[:4]) not in cpu
        assert lm.apply(Retrieve(A)) == RetrieveResult(12)
        assert key(A[:4]) in {e.key for e in lm.snapshot().cpu.entries}
        assert lm.snapshot().warnings == ()


def test_the_allocators_busy_wait_is_an_observation_not_a_hang() -> None:
    with LMCacheSystem(config(device_size=4, hicache_ratio=2)) as lm:  # one chunk of CPU memory
        lm.apply(Store(A[:4]))
        lm.apply(Step(Queue.DISK, 1))
        lm.apply(Step(Queue.REMOTE, 1))
        lm.apply(Store(B[:4]))  # evicts A's chunk from CPU
        lm.apply(Step(Queue.DISK, 1))
        lm.apply(Step(Queue.REMOTE, 1))
        lm.apply(Lookup(B[:4], 1, pin=True))  # the only CPU object is pinned
        outcome = lm.apply(Retrieve(A[:4]))  # reading A from disk needs a CPU buffer: nothing is evictable
        assert isinstance(outcome, Blocked) and "nothing is evictable" in outcome.where


def test_lmcaches_own_double_free_and_double_unpin_lines_are_captured() -> None:
    with LMCacheSystem(config()) as lm:
        lm.apply(Store(A))
        assert lm.snapshot().warnings == ()
        obj = next(iter(lm.driver.cpu.hot_cache.values()))
        lm.driver.listen(True)  # as during an operation
        obj.unpin()  # LMCache clamps the count and logs; the adapter must report it
        obj.ref_count_down()
        obj.ref_count_down()
        obj.ref_count_down()
        obj.ref_count_down()
        warnings = lm.snapshot().warnings
        assert any("Double unpin" in w for w in warnings) and any("Double free" in w for w in warnings)


def test_storage_faults_reach_lmcaches_files() -> None:
    with LMCacheSystem(config()) as lm:
        lm.apply(Store(A))
        lm.apply(StorageFault(Tier.DISK, FaultKind.FAIL_NEXT_WRITE))
        snap = lm.snapshot()
        assert snap.disk is not None and snap.disk.fail_next_write
        lm.apply(Step(Queue.DISK, 3))
        snap = lm.snapshot()
        assert snap.disk is not None and not snap.disk.fail_next_write
        assert key(A[:4]) not in {e.key for e in snap.disk.entries}  # the first write failed
        lm.apply(Step(Queue.REMOTE, 3))
        lm.apply(StorageFault(Tier.REMOTE, FaultKind.DELETE, 0))
        snap = lm.snapshot()
        assert snap.remote is not None and key(A[:4]) not in snap.remote.keys


def test_an_async_prefetch_answers_once_its_disk_read_ran() -> None:
    prefetching = config(hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, hicache_ratio=3)
    with LMCacheSystem(prefetching) as lm:
        lm.apply(Store(A))
        lm.apply(Step(Queue.DISK, 3))
        lm.apply(Step(Queue.REMOTE, 3))
        lm.apply(Store(B))  # A leaves CPU
        lm.apply(Step(Queue.DISK, 4))
        lm.apply(Step(Queue.REMOTE, 4))
        lm.apply(Prefetch(A, 7, pin=True))
        assert lm.apply(PollPrefetch(7)) == PrefetchResult(False, 0)
        snap = lm.snapshot()
        assert snap.disk is not None and [j.kind for j in snap.disk.jobs][:1] == ["read"]
        lm.apply(Step(Queue.DISK, 1))
        assert lm.apply(PollPrefetch(7)) == PrefetchResult(True, 12)
        assert lm.apply(Retrieve(A, 0, 7)) == RetrieveResult(12)
        assert not any("not the KV stored" in w for w in lm.snapshot().warnings)


def test_build_and_destroy_leave_no_thread_behind() -> None:
    with LMCacheSystem(config()) as lm:
        lm.apply(Store(A))
    before = {t.name for t in threading.enumerate()}
    for _ in range(5):
        with LMCacheSystem(config()) as lm:
            lm.apply(Store(A))
            lm.apply(Step(Queue.DISK, 1))
    assert {t.name for t in threading.enumerate()} <= before | {"PinMonitor-thread"}


def test_a_disk_prefetch_that_cannot_allocate_keeps_the_disk_lock_and_is_reported() -> None:
    """LMCache 0.5.6's ``LocalDiskBackend.batched_get_non_blocking`` returns early without releasing its disk
    lock when the CPU pool is full (specs/lmcache-findings.md): the adapter says so instead of deadlocking."""
    prefetching = config(hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, hicache_ratio=3)
    with LMCacheSystem(prefetching) as lm:
        lm.apply(Store(A))
        lm.apply(Step(Queue.DISK, 3))
        lm.apply(Step(Queue.REMOTE, 3))
        lm.apply(Store(B))  # A leaves CPU; B's objects are held by their queued writes
        assert not lm.driver.stuck()
        lm.apply(Prefetch(A, 7, pin=True))
        assert "disk_lock is held" in lm.driver.stuck()
        assert any("disk_lock is held" in w for w in lm.snapshot().warnings)
        assert isinstance(lm.apply(Step(Queue.DISK)), Blocked)
