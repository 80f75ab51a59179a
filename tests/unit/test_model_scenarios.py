"""Directed scenarios: the model does what the seed says, step by step, with every invariant checked."""

from __future__ import annotations

import pytest

from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import (
    AbortPrefetch,
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    EvictHostResult,
    EvictResult,
    FaultKind,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    MatchResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
)
from refcache.hicache.snapshot import NodeId, RankSnapshot
from refcache.hicache.states import NodeState
from refcache.model import HiCacheModel


def model(**options: object) -> HiCacheModel:
    base: dict[str, object] = {"device_size": 32, "hicache_ratio": 2.0, "prefetch_threshold": 1}
    base.update(options)
    return HiCacheModel(HiCacheConfig(**base))  # type: ignore[arg-type]


def apply(m: HiCacheModel, *ops: Op) -> Observation:
    obs: Observation | None = None
    for op in ops:
        obs = m.apply(op)
        violations = check_all(m.snapshot())
        assert not violations, f"after {op!r}: {violations}"
    assert obs is not None
    return obs


def drain(m: HiCacheModel) -> None:
    """Let every queue of every rank run dry and retire everything."""
    for _ in range(4):
        for queue in IOQueue:
            for rank in range(m.config.tp_size):
                apply(m, CompleteIO(queue, rank, 100))
        apply(m, CheckHicacheEvents())


def serve(m: HiCacheModel, rid: int, tokens: tuple[int, ...]) -> StartResult:
    start = apply(m, StartRequest(rid, tokens))
    assert isinstance(start, StartResult)
    assert start.admitted
    apply(m, FinishRequest(rid))
    return start


def node(rank: RankSnapshot, *path: int) -> NodeState | None:
    record = rank.node(NodeId("", tuple(path)))
    return None if record is None else record.state


def r0(m: HiCacheModel) -> RankSnapshot:
    return m.snapshot().ranks[0]


# --- write policies (seed §3.5) ------------------------------------------------------------------------


def test_write_through_backs_up_on_first_insert_and_locks_until_the_ack() -> None:
    m = model(hicache_write_policy="write_through")
    serve(m, 1, (1, 2, 3, 4))
    rec = r0(m).node(NodeId("", (1, 2, 3, 4)))
    assert rec is not None
    assert rec.state is NodeState.BOTH
    assert rec.lock_ref == 1  # pinned while the device→host copy is in flight
    assert rec.in_flight == ("write_through",)
    apply(m, CheckHicacheEvents())
    assert r0(m).node(NodeId("", (1, 2, 3, 4))).lock_ref == 1  # type: ignore[union-attr]  # not finished yet
    apply(m, CompleteIO(IOQueue.WRITE), CheckHicacheEvents())
    rec = r0(m).node(NodeId("", (1, 2, 3, 4)))
    assert rec is not None
    assert (rec.lock_ref, rec.in_flight) == (0, ())


def test_write_through_selective_waits_for_the_second_hit() -> None:
    m = model()  # write_through_selective is the default
    serve(m, 1, (1, 2, 3, 4))
    assert node(r0(m), 1, 2, 3, 4) is NodeState.DEVICE
    serve(m, 2, (1, 2, 3, 4))
    assert node(r0(m), 1, 2, 3, 4) is NodeState.BOTH


def test_chunked_insert_never_counts_hits() -> None:
    from refcache.hicache.ops import CacheUnfinishedRequest

    m = model(hicache_write_policy="write_through")
    apply(m, StartRequest(1, (1, 2, 3, 4)), CacheUnfinishedRequest(1), CacheUnfinishedRequest(1))
    rec = r0(m).node(NodeId("", (1, 2, 3, 4)))
    assert rec is not None
    assert (rec.hit_count, rec.state) == (0, NodeState.DEVICE)
    apply(m, FinishRequest(1))
    assert node(r0(m), 1, 2, 3, 4) is NodeState.BOTH


def test_write_back_writes_only_when_evicting() -> None:
    m = model(hicache_write_policy="write_back", hicache_storage_backend="file")
    serve(m, 1, (1, 2, 3, 4))
    serve(m, 2, (1, 2, 3, 4))
    assert node(r0(m), 1, 2, 3, 4) is NodeState.DEVICE
    apply(m, Evict(4))
    snap = r0(m)
    assert node(snap, 1, 2, 3, 4) is NodeState.HOST
    assert len(snap.ongoing_backup) == 1  # L2→L3 follows the L1→L2 acknowledgement
    drain(m)
    assert len(r0(m).l3_keys) == 4


def test_l3_backup_follows_the_write_ack() -> None:
    m = model(hicache_write_policy="write_through", hicache_storage_backend="file", page_size=2)
    serve(m, 1, (1, 2, 3, 4, 5))
    assert r0(m).ongoing_backup == ()
    apply(m, CompleteIO(IOQueue.WRITE), CheckHicacheEvents())
    assert len(r0(m).ongoing_backup) == 1
    apply(m, CompleteIO(IOQueue.BACKUP), CheckHicacheEvents())
    snap = r0(m)
    assert snap.ongoing_backup == ()
    assert len(snap.l3_keys) == 2  # two whole pages; the fifth token is an unaligned tail


# --- eviction (seed §3.1, §3.2) ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("policy", "survivor"),
    [("lru", 2), ("mru", 1), ("fifo", 2), ("filo", 1), ("lfu", 1), ("priority", 2)],
)
def test_eviction_strategy_picks_the_victim(policy: str, survivor: int) -> None:
    m = model(radix_eviction_policy=policy)
    serve(m, 1, (1, 1))
    serve(m, 2, (2, 2))
    if policy == "lfu":
        serve(m, 3, (1, 1))  # a second hit on (1, 1)
    apply(m, Evict(2))
    remaining = [r.id.path for r in r0(m).nodes]
    assert remaining == [(survivor, survivor)]


def test_eviction_of_a_backed_up_leaf_keeps_the_host_copy_and_promotes_the_parent() -> None:
    m = model(hicache_write_policy="write_through")
    serve(m, 1, (1, 2))
    serve(m, 2, (1, 2, 3, 4))
    drain(m)
    apply(m, Evict(4))
    snap = r0(m)
    assert node(snap, 1, 2) is NodeState.HOST  # parent became a leaf and was evicted next
    assert node(snap, 1, 2, 3, 4) is NodeState.HOST


def test_evict_host_only_removes_device_evicted_unpinned_leaves() -> None:
    m = model(hicache_write_policy="write_through")
    serve(m, 1, (1, 2))
    serve(m, 2, (3, 4))
    drain(m)
    apply(m, Evict(2))  # (1, 2) leaves L1 (LRU)
    assert apply(m, EvictHost(100)) == EvictHostResult(2)
    snap = r0(m)
    assert node(snap, 1, 2) is None
    assert node(snap, 3, 4) is NodeState.BOTH  # still on the device: never host-evicted


def test_locked_nodes_are_not_evicted() -> None:
    m = model()
    apply(m, StartRequest(1, (1, 2, 3)), FinishRequest(1), StartRequest(2, (1, 2, 3, 9)))
    assert apply(m, Evict(100)) == EvictResult(0)
    assert node(r0(m), 1, 2, 3) is NodeState.DEVICE


# --- load back (seed §2.3) -----------------------------------------------------------------------------


def test_load_back_below_the_threshold_recomputes() -> None:
    m = model(hicache_write_policy="write_through", load_back_threshold=10)
    serve(m, 1, tuple(range(8)))
    drain(m)
    apply(m, Evict(100))
    start = apply(m, StartRequest(2, tuple(range(8))))
    assert start == StartResult(admitted=True, device_hit=0, loaded=0, computed=8)


def test_load_back_is_locked_until_the_load_ack() -> None:
    m = model(hicache_write_policy="write_through", load_back_threshold=10)
    serve(m, 1, tuple(range(12)))
    drain(m)
    apply(m, Evict(100))
    match = apply(m, MatchPrefix(tuple(range(12))))
    assert match == MatchResult(device_len=0, host_hit_length=12, last_node_depth=12, last_host_node_depth=12)
    start = apply(m, StartRequest(2, tuple(range(13))))
    assert start == StartResult(admitted=True, device_hit=0, loaded=12, computed=1)
    apply(m, FinishRequest(2))
    rec = r0(m).node(NodeId("", tuple(range(12))))
    assert rec is not None
    # Two holders: the load (until its ack) and the write-through of the new child token 12.
    assert (rec.state, rec.lock_ref, rec.in_flight) == (NodeState.BOTH, 2, ("load_back",))
    apply(m, CompleteIO(IOQueue.LOAD), CheckHicacheEvents())
    rec = r0(m).node(NodeId("", tuple(range(12))))
    assert rec is not None
    assert (rec.lock_ref, rec.in_flight) == (1, ())
    drain(m)
    assert r0(m).node(NodeId("", tuple(range(12)))).lock_ref == 0  # type: ignore[union-attr]


def test_load_back_evicts_and_retries_when_the_device_is_full() -> None:
    m = model(hicache_write_policy="write_through", load_back_threshold=1, device_size=16)
    serve(m, 1, tuple(range(10)))
    drain(m)
    apply(m, Evict(100))
    serve(m, 2, tuple(range(100, 116)))  # the device is full of other tokens
    drain(m)
    start = apply(m, StartRequest(3, tuple(range(10))))
    assert isinstance(start, StartResult)
    assert (start.admitted, start.loaded) == (True, 10)


# --- prefetch (seed §2.2, §3.6) ------------------------------------------------------------------------


def pushed_to_l3(**options: object) -> HiCacheModel:
    m = model(hicache_write_policy="write_through", hicache_storage_backend="file", **options)
    serve(m, 1, tuple(range(8)))
    drain(m)
    apply(m, Evict(100), EvictHost(100))
    assert r0(m).nodes == ()
    return m


def prefetch_all(m: HiCacheModel, rid: int, tokens: tuple[int, ...]) -> None:
    result = apply(m, PrefetchFromStorage(rid, tokens))
    assert isinstance(result, PrefetchResult)
    assert result.admitted, result
    for queue in (IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO):
        for rank in range(m.config.tp_size):
            apply(m, CompleteIO(queue, rank, 100))


def test_prefetch_inserts_host_only_nodes() -> None:
    m = pushed_to_l3()
    prefetch_all(m, 2, tuple(range(10)))
    assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=8)
    assert node(r0(m), *range(8)) is NodeState.HOST
    drain(m)
    snap = r0(m)
    assert snap.host.held == ()  # the two missing tokens' slots went back to the pool


@pytest.mark.parametrize(
    ("options", "tokens", "reason"),
    [
        ({"prefetch_threshold": 16}, tuple(range(10)), "below_threshold"),
        ({"hicache_storage_backend": None}, tuple(range(10)), "storage_disabled"),
    ],
)
def test_prefetch_admission_refusals(
    options: dict[str, object], tokens: tuple[int, ...], reason: str
) -> None:
    m = model(**{"hicache_storage_backend": "file", **options})
    result = apply(m, PrefetchFromStorage(2, tokens))
    assert isinstance(result, PrefetchResult)
    assert (result.admitted, result.reason) == (False, reason)


def test_prefetch_is_rate_limited_by_in_flight_tokens() -> None:
    m = model(hicache_storage_backend="file")  # limit int(0.8 * (65 - 32)) = 26 tokens
    assert apply(m, PrefetchFromStorage(1, tuple(range(30)))) == PrefetchResult(True, "admitted", 30)
    assert apply(m, PrefetchFromStorage(2, tuple(range(100, 110)))) == PrefetchResult(
        False, "rate_limited", 10
    )


def test_prefetch_is_revoked_below_the_threshold_after_the_query() -> None:
    m = pushed_to_l3(prefetch_threshold=12)
    prefetch_all(m, 2, tuple(range(14)))  # L3 holds only 8 of the 14 tokens
    apply(m, CheckHicacheEvents())
    snap = r0(m)
    assert (snap.ongoing_prefetch, snap.prefetch_tokens_occupied, snap.host.held) == ((), 0, ())
    assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=0)


def test_wait_complete_waits_and_timeout_gives_up_on_the_clock() -> None:
    for policy in ("wait_complete", "timeout"):
        m = pushed_to_l3(hicache_storage_prefetch_policy=policy, prefetch_timeout_base=0.01)
        apply(m, PrefetchFromStorage(2, tuple(range(8))), CompleteIO(IOQueue.PREFETCH_QUERY))
        assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=False, inserted=0)
        apply(m, AdvanceClock(20_000))  # 20 ms > 10 ms + 8 pages * 0.25 s / 1024
        expected = ProgressResult(done=policy == "timeout", inserted=0)
        assert apply(m, CheckPrefetchProgress(2)) == expected
        if policy == "wait_complete":
            apply(m, CompleteIO(IOQueue.PREFETCH_IO))
            assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=8)


def test_a_rank_times_out_on_its_own_clock_and_0520_stops_every_rank() -> None:
    """D-41: ``AdvanceClock(us, rank)`` moves that rank's clock alone, so a prefetch times out there first.
    0.5.20's MAX of ``should_terminate`` (D-39) then terminates it on every rank; the seed's MAX of
    ``1 - can_terminate`` (§3.6) waits until every rank can stop."""
    for after_query in (True, False):
        m = pushed_to_l3(
            tp_size=2,
            hicache_storage_prefetch_policy="timeout",
            prefetch_timeout_base=0.01,
            allocate_prefetch_after_query=after_query,
        )
        apply(m, PrefetchFromStorage(2, tuple(range(8))))
        apply(m, CompleteIO(IOQueue.PREFETCH_QUERY, 0), CompleteIO(IOQueue.PREFETCH_QUERY, 1))
        apply(m, AdvanceClock(20_000, rank=1))  # 20 ms > 10 ms + 8 pages * 0.25 s / 1024, on rank 1 only
        snap = m.snapshot()
        assert (snap.clock_us, [r.clock_skew_us for r in snap.ranks]) == (0, [0, 20_000])
        assert [snap.rank_clock_us(r) for r in (0, 1)] == [0, 20_000]
        assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=after_query, inserted=0)
        if not after_query:
            apply(m, AdvanceClock(20_000, rank=0))  # now rank 0 can stop too
            snap = m.snapshot()
            assert (snap.clock_us, [r.clock_skew_us for r in snap.ranks]) == (20_000, [0, 0])
            assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=0)
        assert all(r.ongoing_prefetch == () for r in m.snapshot().ranks)


def test_aborted_prefetch_returns_every_host_slot() -> None:
    m = pushed_to_l3()
    apply(m, PrefetchFromStorage(2, tuple(range(8))), CompleteIO(IOQueue.PREFETCH_QUERY), AbortPrefetch(2))
    drain(m)
    assert r0(m).host.held == ()
    assert len(r0(m).host.free) == r0(m).host.size


def test_a_corrupt_l3_object_is_a_miss_never_data() -> None:
    m = pushed_to_l3()
    apply(m, StorageFault(FaultKind.CORRUPT, 0, 3))  # the fourth key in sorted order
    prefetch_all(m, 2, tuple(range(8)))
    progress = apply(m, CheckPrefetchProgress(2))
    assert isinstance(progress, ProgressResult)
    assert progress.inserted < 8


# --- tensor parallelism (seed §3.7, §5.5) ---------------------------------------------------------------


def test_a_write_is_retired_only_when_every_rank_finished_it() -> None:
    m = model(hicache_write_policy="write_through", tp_size=2)
    serve(m, 1, (1, 2, 3))
    apply(m, CompleteIO(IOQueue.WRITE, rank=0))
    assert apply(m, CheckHicacheEvents()).writes == 0  # type: ignore[union-attr]
    apply(m, CompleteIO(IOQueue.WRITE, rank=1))
    assert apply(m, CheckHicacheEvents()).writes == 1  # type: ignore[union-attr]


def test_ranks_insert_the_minimum_of_their_prefetched_pages() -> None:
    m = model(
        hicache_write_policy="write_through", hicache_storage_backend="file", tp_size=2, storage_batch_size=1
    )
    serve(m, 1, tuple(range(4)))
    drain(m)
    apply(m, Evict(100), EvictHost(100))
    apply(m, PrefetchFromStorage(2, tuple(range(4))))
    apply(m, CompleteIO(IOQueue.PREFETCH_QUERY, 0), CompleteIO(IOQueue.PREFETCH_QUERY, 1))
    apply(m, CompleteIO(IOQueue.PREFETCH_IO, 0, 4), CompleteIO(IOQueue.PREFETCH_IO, 1, 2))
    assert apply(m, CheckPrefetchProgress(2)) == ProgressResult(done=True, inserted=2)


def test_mha_ranks_use_rank_suffixed_keys_and_mla_only_rank_0_writes() -> None:
    for attention in ("MHA", "MLA"):
        m = model(
            hicache_write_policy="write_through",
            hicache_storage_backend="file",
            tp_size=2,
            attention=attention,
        )
        serve(m, 1, (1, 2))
        drain(m)
        keys0, keys1 = (r.l3_keys for r in m.snapshot().ranks)
        if attention == "MHA":
            assert all(k.endswith("_refcache_0_2") for k in keys0)
            assert all(k.endswith("_refcache_1_2") for k in keys1)
        else:
            assert keys0 == keys1
            assert all(k.endswith("_refcache") for k in keys0)


# --- namespaces, EAGLE, reset, errors ------------------------------------------------------------------


def test_namespaces_do_not_share_nodes_or_keys() -> None:
    m = model(hicache_write_policy="write_through", hicache_storage_backend="file")
    apply(m, StartRequest(1, (1, 2)), FinishRequest(1), StartRequest(2, (1, 2), "lora-a"), FinishRequest(2))
    drain(m)
    snap = r0(m)
    assert {r.id.namespace for r in snap.nodes} == {"", "lora-a"}
    assert len(snap.l3_keys) == 4


def test_eagle_keys_are_bigrams() -> None:
    m = model(is_eagle=True)
    serve(m, 1, (1, 2, 3))
    assert [r.id.path for r in r0(m).nodes] == [((1, 2), (2, 3))]


def test_reset_is_refused_while_busy_and_flushes_when_idle() -> None:
    m = model(hicache_write_policy="write_through")
    serve(m, 1, (1, 2))
    assert apply(m, Reset()) == ResetResult(flushed=False)  # a write is in flight
    drain(m)
    assert apply(m, Reset()) == ResetResult(flushed=True)
    assert r0(m).nodes == ()


def test_usage_errors_leave_the_state_unchanged() -> None:
    m = model()
    apply(m, StartRequest(1, (1, 2)))
    before = m.snapshot()
    for bad in (
        StartRequest(1, (3,)),
        FinishRequest(7),
        Evict(-1),
        CompleteIO(IOQueue.WRITE, 3),
        AdvanceClock(-1),
        AdvanceClock(1, rank=1),  # tp_size 1: no rank 1 (D-41)
    ):
        with pytest.raises(UsageError):
            m.apply(bad)
        assert m.snapshot() == before


def test_match_in_the_middle_of_a_node_splits_every_list() -> None:
    m = model(hicache_write_policy="write_through", hicache_storage_backend="file", page_size=2)
    serve(m, 1, (1, 2, 3, 4))
    apply(m, MatchPrefix((1, 2, 9, 9)))
    snap = r0(m)
    top, bottom = snap.node(NodeId("", (1, 2))), snap.node(NodeId("", (1, 2, 3, 4)))
    assert top is not None
    assert bottom is not None
    assert (top.key_len, bottom.key_len) == (2, 2)
    assert top.value is not None
    assert top.host_value is not None
    assert top.hash_value is not None
    assert (len(top.value), len(top.host_value), len(top.hash_value)) == (2, 2, 1)
    assert "write_through" in top.in_flight  # the pending copy now covers both fragments


def test_a_revoke_never_hits_a_newer_prefetch_of_the_same_request_id() -> None:
    """The revoke of an operation already ended by the scheduler must not remove a newer prefetch that
    reuses the request id (SGLang keys the revoke queue by request id alone)."""
    m = pushed_to_l3(prefetch_threshold=2)
    apply(m, PrefetchFromStorage(7, (50, 51, 52, 53)), CheckPrefetchProgress(7))  # ended before its query
    apply(
        m, PrefetchFromStorage(7, tuple(range(4))), CompleteIO(IOQueue.PREFETCH_QUERY), CheckHicacheEvents()
    )
    apply(m, CompleteIO(IOQueue.PREFETCH_QUERY), CheckHicacheEvents())
    assert [p.rid for p in r0(m).ongoing_prefetch] == [7]


def test_the_empty_namespace_is_rejected() -> None:
    m = model()
    with pytest.raises(UsageError, match="extra_key"):
        m.apply(StartRequest(1, (1, 2), extra_key=""))
