"""HiCacheImpl, directed: the data paths end to end, the KV content oracle on every read path, storage
faults and failing backends, backup_skip for MLA, reset. Every step checks every invariant."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from refcache.config import HiCacheConfig
from refcache.errors import CorruptionError, UsageError
from refcache.gpu.driver import HiCacheImpl
from refcache.gpu.hiradix_cache import HiRadixCache
from refcache.gpu.l3_store import L3Store
from refcache.hashing import page_hashes
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    IOResult,
    Observation,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
)

TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)


def config(**overrides: object) -> HiCacheConfig:
    base: dict[str, object] = {
        "page_size": 2,
        "device_size": 16,
        "hicache_write_policy": "write_through",
        "hicache_storage_backend": "file",
        "hicache_io_backend": "direct",
        "prefetch_threshold": 2,
        "load_back_threshold": 1,
        "storage_batch_size": 2,
    }
    base.update(overrides)
    return HiCacheConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def impl(request: pytest.FixtureRequest) -> Iterator[HiCacheImpl]:
    marker = request.node.get_closest_marker("config")
    cfg = config(**(marker.kwargs if marker else {}))
    with HiCacheImpl(cfg) as system:
        yield system


def apply(impl: HiCacheImpl, op: Op) -> Observation:
    obs = impl.apply(op)
    violations = check_all(impl.snapshot())
    assert not violations, f"after {op!r}: " + "; ".join(map(str, violations))
    return obs


def drain(impl: HiCacheImpl, *queues: IOQueue) -> None:
    for queue in queues or tuple(IOQueue):
        for rank in range(impl.config.tp_size):
            apply(impl, CompleteIO(queue, rank, 64))
    apply(impl, CheckHicacheEvents())


def cache_to_l3(impl: HiCacheImpl, rid: int, tokens: tuple[int, ...] = TOKENS) -> None:
    """Compute, insert, copy to host, back up to L3, then push everything out of L1 and L2."""
    assert apply(impl, StartRequest(rid, tokens)) == StartResult(True, 0, 0, len(tokens))
    apply(impl, FinishRequest(rid))
    drain(impl, IOQueue.WRITE)
    drain(impl, IOQueue.BACKUP)
    apply(impl, Evict(10_000))
    apply(impl, EvictHost(10_000))


def rank0(impl: HiCacheImpl) -> HiRadixCache:
    return impl.ranks[0]


def store(impl: HiCacheImpl, rank: int = 0) -> L3Store:
    backend = impl.ranks[rank].cache_controller.storage_backend
    assert backend is not None
    return backend


def tamper_host(cache: HiRadixCache, slot: int) -> None:
    host = cache.cache_controller.mem_pool_host
    host.kv_view().run(slot, 1, range(host.layer_num)).add_(1)


def node_slots(cache: HiRadixCache, host: bool) -> list[int]:
    snap = cache.snapshot([])
    node = snap.nodes[0]
    slots = node.host_value if host else node.value
    assert slots is not None
    return list(slots)


# --- the data paths ---------------------------------------------------------------------------------------


def test_round_trip_through_every_tier() -> None:
    with HiCacheImpl(config()) as impl:
        cache_to_l3(impl, 1)
        snap = impl.snapshot().ranks[0]
        assert snap.nodes == () and len(snap.l3_keys) == len(TOKENS) // 2
        apply(impl, PrefetchFromStorage(2, TOKENS))
        drain(impl, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
        assert apply(impl, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=len(TOKENS))
        drain(impl)
        # Host-only now: the request loads it back (each layer checked against the oracle as it lands).
        assert apply(impl, StartRequest(3, (*TOKENS, 9))) == StartResult(True, 0, len(TOKENS), 1)
        drain(impl, IOQueue.LOAD)
        # A second request hits the loaded KV on the device (checked again, from the device pool).
        assert apply(impl, StartRequest(4, (*TOKENS, 10))) == StartResult(True, len(TOKENS), 0, 1)
        for rid in (3, 4):
            apply(impl, FinishRequest(rid))
        drain(impl)


def test_usage_errors_change_nothing(impl: HiCacheImpl) -> None:
    apply(impl, StartRequest(1, TOKENS))
    before = impl.snapshot()
    for op in (
        StartRequest(1, TOKENS),
        FinishRequest(7),
        Evict(-1),
        CompleteIO(IOQueue.LOAD, 3),
        StartRequest(2, ()),
    ):
        with pytest.raises(UsageError):
            impl.apply(op)
        assert impl.snapshot() == before


def test_reset_waits_for_idle(impl: HiCacheImpl) -> None:
    apply(impl, StartRequest(1, TOKENS))
    assert apply(impl, Reset()) == ResetResult(flushed=False)
    apply(impl, FinishRequest(1))
    assert apply(impl, Reset()) == ResetResult(flushed=False)  # the write-through is still in flight
    drain(impl)
    drain(impl)
    assert apply(impl, Reset()) == ResetResult(flushed=True)
    snap = impl.snapshot().ranks[0]
    assert snap.nodes == () and len(snap.l3_keys) == len(TOKENS) // 2  # L3 outlives a reset


# --- the content oracle on every read path ----------------------------------------------------------------


@pytest.mark.config(hicache_write_policy="write_back")
def test_device_hit_is_checked(impl: HiCacheImpl) -> None:
    apply(impl, StartRequest(1, TOKENS))
    apply(impl, FinishRequest(1))
    cache = rank0(impl)
    slot = node_slots(cache, host=False)[3]
    cache.cache_controller.mem_pool_device.get_value_buffer(1)[slot].add_(1)
    with pytest.raises(CorruptionError, match=rf"node -:\[1, 2, 3, 4, 5, 6, 7, 8\].*layer 1, V, slot {slot}"):
        impl.apply(StartRequest(2, TOKENS))


def test_load_back_is_checked_layer_by_layer(impl: HiCacheImpl) -> None:
    apply(impl, StartRequest(1, TOKENS))
    apply(impl, FinishRequest(1))
    drain(impl, IOQueue.WRITE)
    apply(impl, Evict(10_000))
    cache = rank0(impl)
    tamper_host(cache, node_slots(cache, host=True)[5])
    apply(impl, StartRequest(2, TOKENS))  # the copy is queued; it lands (and is read) when the job runs
    with pytest.raises(CorruptionError, match=r"device KV of node -:\[1, 2, 3, 4, 5, 6, 7, 8\].*layer 0"):
        impl.apply(CompleteIO(IOQueue.LOAD))


def test_backup_source_is_checked(impl: HiCacheImpl) -> None:
    apply(impl, StartRequest(1, TOKENS))
    apply(impl, FinishRequest(1))
    drain(impl, IOQueue.WRITE)
    cache = rank0(impl)
    tamper_host(cache, node_slots(cache, host=True)[0])
    with pytest.raises(CorruptionError, match="host KV of node"):
        impl.apply(CompleteIO(IOQueue.BACKUP))


def test_l3_read_is_checked(impl: HiCacheImpl) -> None:
    cache_to_l3(impl, 1)
    l3 = store(impl)
    first = next(iter(l3.keys()))[:64]
    # A well-formed object (valid checksum) with the wrong content, as a buggy writer would leave it.
    os.unlink(os.path.join(l3.directory, f"{first}{l3.suffix}.bin"))
    wrong = l3.file.mem_pool_host.get_dummy_flat_data_page() if l3.file.mem_pool_host else None
    assert wrong is not None
    assert l3.file.set(first, wrong.fill_(3))
    apply(impl, PrefetchFromStorage(2, TOKENS))
    apply(impl, CompleteIO(IOQueue.PREFETCH_QUERY))
    with pytest.raises(CorruptionError, match="host KV of prefetch of request 2 at position 0"):
        impl.apply(CompleteIO(IOQueue.PREFETCH_IO))


def test_prefetched_pages_are_checked_before_insertion(impl: HiCacheImpl) -> None:
    cache_to_l3(impl, 1)
    apply(impl, PrefetchFromStorage(2, TOKENS))
    drain(impl, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    cache = rank0(impl)
    held = impl.snapshot().ranks[0].host.held
    assert held[0][0].startswith("prefetch:")
    tamper_host(cache, held[0][1][2])
    with pytest.raises(CorruptionError, match="prefetch of request 2 at position 2"):
        impl.apply(CheckPrefetchProgress(2))


# --- storage faults and failing backends -------------------------------------------------------------------


def test_a_failing_read_ends_the_prefetch_cleanly_and_l3_stays_in_use(impl: HiCacheImpl) -> None:
    cache_to_l3(impl, 1)
    l3 = store(impl)
    real = l3.batch_get_v1

    def broken(hashes: object, indices: torch.Tensor) -> list[bool]:
        raise OSError("the backend fell over")

    l3.batch_get_v1 = broken  # type: ignore[assignment,method-assign]
    apply(impl, PrefetchFromStorage(2, TOKENS))
    drain(impl, IOQueue.PREFETCH_QUERY)
    assert apply(impl, CompleteIO(IOQueue.PREFETCH_IO)) == IOResult(1)
    assert apply(impl, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=0)
    drain(impl)
    snap = impl.snapshot().ranks[0]
    assert snap.host.held == () and snap.prefetch_tokens_occupied == 0 and snap.nodes == ()
    l3.batch_get_v1 = real  # type: ignore[method-assign]
    apply(impl, PrefetchFromStorage(3, TOKENS))
    drain(impl, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    assert apply(impl, CheckPrefetchProgress(3)) == ProgressResult(done=True, inserted=len(TOKENS))


def test_a_failing_hit_query_revokes_the_prefetch(impl: HiCacheImpl) -> None:
    cache_to_l3(impl, 1)
    l3 = store(impl)

    def broken(hashes: object) -> int:
        raise OSError("no metadata service")

    l3.batch_exists = broken  # type: ignore[assignment,method-assign]
    apply(impl, PrefetchFromStorage(2, TOKENS))
    apply(impl, CompleteIO(IOQueue.PREFETCH_QUERY))
    assert apply(impl, CheckHicacheEvents()) == EventsResult(0, 0, 1, 0, len(TOKENS) // 2)
    assert impl.snapshot().ranks[0].ongoing_prefetch == ()


def test_a_failing_backup_is_acknowledged_and_the_next_one_writes(impl: HiCacheImpl) -> None:
    l3 = store(impl)
    real = l3.batch_set_v1

    def broken(hashes: object, indices: torch.Tensor) -> list[bool]:
        raise OSError("disk gone")

    l3.batch_set_v1 = broken  # type: ignore[assignment,method-assign]
    apply(impl, StartRequest(1, TOKENS))
    apply(impl, FinishRequest(1))
    drain(impl, IOQueue.WRITE)
    apply(impl, CompleteIO(IOQueue.BACKUP))
    assert apply(impl, CheckHicacheEvents()) == EventsResult(0, 0, 0, 1, 0)
    assert impl.snapshot().ranks[0].l3_keys == ()
    l3.batch_set_v1 = real  # type: ignore[method-assign]
    apply(impl, StartRequest(2, (*TOKENS, 11, 12)))
    apply(impl, FinishRequest(2))
    drain(impl, IOQueue.WRITE)
    drain(impl, IOQueue.BACKUP)
    assert len(impl.snapshot().ranks[0].l3_keys) == 1  # the new page; the old node is not re-backed up


def test_injected_faults_map_to_the_data_plane(impl: HiCacheImpl) -> None:
    cache_to_l3(impl, 1)
    l3 = store(impl)
    keys = l3.keys()
    apply(impl, StorageFault(FaultKind.CORRUPT, 0, 1))  # keys[1]: its stored checksum no longer matches
    apply(impl, StorageFault(FaultKind.CORRUPT, 0, 1))  # damaging twice keeps it damaged
    damaged_page = page_hashes(TOKENS, 2, None).index(keys[1][:64])
    apply(impl, PrefetchFromStorage(2, TOKENS))
    drain(impl, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    assert apply(impl, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=2 * damaged_page)
    # The reader deleted the damaged object (D-18); the others are untouched.
    assert l3.keys() == [k for k in keys if k != keys[1]]
    drain(impl)
    apply(impl, StorageFault(FaultKind.DELETE, 0, 0))
    assert len(l3.keys()) == len(keys) - 2
    apply(impl, StorageFault(FaultKind.FAIL_NEXT_READ, 0, 0))
    apply(impl, Evict(10_000))
    apply(impl, EvictHost(10_000))
    apply(impl, PrefetchFromStorage(3, TOKENS))
    drain(impl, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    assert apply(impl, CheckPrefetchProgress(3)) == ProgressResult(done=True, inserted=0)
    drain(impl)


def test_a_failed_write_batch_writes_nothing_and_the_next_backup_heals(impl: HiCacheImpl) -> None:
    l3 = store(impl)
    apply(impl, StorageFault(FaultKind.FAIL_NEXT_WRITE, 0, 0))
    cache_to_l3(impl, 1)
    assert l3.keys() == []  # batches of two pages: the first failed and ended the operation
    apply(impl, Reset())
    cache_to_l3(impl, 2)
    assert len(l3.keys()) == len(TOKENS) // 2


# --- tensor parallelism -----------------------------------------------------------------------------------


@pytest.mark.config(attention="MLA", tp_size=2)
def test_mla_ranks_share_objects_and_only_rank0_writes(impl: HiCacheImpl) -> None:
    cache_to_l3(impl, 1)
    snap = impl.snapshot()
    assert snap.ranks[0].l3_keys == snap.ranks[1].l3_keys and len(snap.ranks[0].l3_keys) == 4
    apply(impl, PrefetchFromStorage(2, TOKENS))
    drain(impl, IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO)
    assert apply(impl, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=len(TOKENS))


@pytest.mark.config(tp_size=2)
def test_ranks_retire_only_what_every_rank_finished(impl: HiCacheImpl) -> None:
    apply(impl, StartRequest(1, TOKENS))
    apply(impl, FinishRequest(1))
    apply(impl, CompleteIO(IOQueue.WRITE, 0))
    assert apply(impl, CheckHicacheEvents()) == EventsResult(0, 0, 0, 0, 0)  # rank 1 has not copied yet
    apply(impl, CompleteIO(IOQueue.WRITE, 1))
    assert apply(impl, CheckHicacheEvents()) == EventsResult(1, 0, 0, 0, 0)
