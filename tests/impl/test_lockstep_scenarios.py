"""Directed scenarios run in lock step on the model and the implementation, with the seed's observations.

Written for mutants ``nox -s mutants`` found surviving (specs/mutation.md).

Most are directed scenarios run in lock step on the reference model and on ``HiCacheImpl`` through
``refcache.check.harness.Harness``: observations and snapshots must agree after every step and every invariant
must hold, so one scenario reaches the same path in ``refcache.model._rank`` and ``refcache.gpu``. Each
also asserts the observations the seed specifies, so it checks the behaviour, not just agreement. The
random machines reach these paths rarely under the mutation budget (20 examples).
"""

from __future__ import annotations

from refcache.check.harness import Harness, Outcome
from refcache.config import HiCacheConfig
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AbortPrefetch,
    AbortRequest,
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    EvictHostResult,
    EvictResult,
    FaultKind,
    FinishRequest,
    FinishResult,
    IOQueue,
    MatchPrefix,
    MatchResult,
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
from refcache.systems import open_systems

from .test_impl_tree import computed, make


def test_a_split_inside_a_namespace_keeps_the_suffix_reachable() -> None:
    """The new prefix node files its child under the child's namespace: a match in that namespace walks
    through the split to the whole key (the random machines rarely split under a namespace)."""
    cache, _ = make(hicache_write_policy="write_through_selective")
    a = computed(cache, 4)
    assert cache.insert((1, 2, 3, 4), a, "lora-a") == 0
    b = computed(cache, 4)
    assert cache.insert((1, 2, 9, 9), b, "lora-a") == 2
    assert cache.match_prefix((1, 2, 3, 4), "lora-a").device_indices.tolist() == a.tolist()
    assert cache.match_prefix((1, 2, 9, 9), "lora-a").device_indices.tolist() == [
        *a[:2].tolist(),
        *b[2:].tolist(),
    ]
    assert cache.match_prefix((1, 2, 3, 4), None).device_indices.tolist() == []


# --- model and implementation in lock step ------------------------------------------------------------


def lockstep(ops: list[Op], **options: object) -> list[Outcome]:
    """Apply ``ops`` to the model and the implementation; every step must agree (else ``Divergence``)."""
    base: dict[str, object] = {
        "device_size": 32,
        "hicache_io_backend": "direct",
        "hicache_write_policy": "write_through",
        "prefetch_threshold": 1,
        "load_back_threshold": 1,
    }
    config = HiCacheConfig.from_json({**base, **options})
    with open_systems(("model", "impl"), config) as systems:
        harness = Harness(config, systems, write_trace=False, family=HICACHE)
        return [harness.step(op) for op in ops]


def drained(tp_size: int = 1) -> list[Op]:
    """Every queue of every rank run dry, twice (an L1→L2 ack queues the L2→L3 backup), and retired."""
    one = [CompleteIO(q, r, 100) for q in (IOQueue.WRITE, IOQueue.LOAD) for r in range(tp_size)]
    two = [CompleteIO(IOQueue.BACKUP, r, 100) for r in range(tp_size)]
    return [*one, CheckHicacheEvents(), *two, CheckHicacheEvents()]


def served(rid: int, tokens: tuple[int, ...], extra_key: str | None = None) -> list[Op]:
    return [StartRequest(rid, tokens, extra_key), FinishRequest(rid)]


def fetched(rid: int, tokens: tuple[int, ...], extra_key: str | None = None) -> list[Op]:
    """A prefetch whose query and reads have all completed (one rank)."""
    return [
        PrefetchFromStorage(rid, tokens, extra_key),
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 100),
        CompleteIO(IOQueue.PREFETCH_IO, 0, 100),
    ]


L3_ONLY: list[Op] = [Evict(100), EvictHost(100)]  # push everything out of L1 and L2: only L3 keeps it


# --- prefetch timeout (seed §3.6, D-26): base + pages x page_size / 1024 x per_ki_token, strictly exceeded


def test_the_timeout_policy_gives_up_only_once_the_limit_is_strictly_exceeded() -> None:
    """8 one-token pages: limit = 10 ms + 8 x 256 ms / 1024 = 12 000 us exactly. At 12 000 us the
    prefetch still waits (``elapsed > limit``, not ``>=``); one microsecond later it is terminated."""
    tokens = tuple(range(8))
    out = lockstep(
        [
            *served(1, tokens),
            *drained(),
            *L3_ONLY,
            PrefetchFromStorage(2, tokens),
            CompleteIO(IOQueue.PREFETCH_QUERY),
            AdvanceClock(11_999),
            CheckPrefetchProgress(2),
            AdvanceClock(1),
            CheckPrefetchProgress(2),
            AdvanceClock(1),
            CheckPrefetchProgress(2),
        ],
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="timeout",
        prefetch_timeout_base=0.01,
        prefetch_timeout_per_ki_token=0.256,
    )
    assert out[-5] == ProgressResult(done=False, inserted=0)  # 11 999 us: short of the limit
    assert out[-3] == ProgressResult(done=False, inserted=0)  # 12 000 us: the limit itself is not past it
    assert out[-1] == ProgressResult(done=True, inserted=0)  # 12 001 us: past it, nothing read yet


def in_l3_on_two_ranks(tokens: tuple[int, ...], ops: list[Op]) -> list[Outcome]:
    """``lockstep``: ``tokens`` (8 one-token pages: a 12 000 us limit) served and pushed out to L3 only on two
    ranks under the timeout policy, then ``ops``; the outcome of every step."""
    return lockstep(
        [*served(1, tokens), *drained(2), *L3_ONLY, *ops],
        tp_size=2,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="timeout",
        prefetch_timeout_base=0.01,
        prefetch_timeout_per_ki_token=0.256,
    )


def test_each_rank_times_out_on_its_own_clock() -> None:
    """D-41: ``AdvanceClock(us, rank)`` moves one rank's clock. Past the limit (12 000 us) on rank 0 alone,
    the seed's MAX of ``1 - can_terminate`` (§3.6) keeps the prefetch: rank 1 cannot stop yet; once rank 1
    is past it too, every rank stops. The harness compares each rank's clock (``clock_skew_us``) as well."""
    tokens = tuple(range(8))
    out = in_l3_on_two_ranks(
        tokens,
        [
            PrefetchFromStorage(2, tokens),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0),
            CompleteIO(IOQueue.PREFETCH_QUERY, 1),
            AdvanceClock(12_001, rank=0),
            CheckPrefetchProgress(2),
            AdvanceClock(12_000, rank=1),
            CheckPrefetchProgress(2),
            AdvanceClock(1, rank=1),
            CheckPrefetchProgress(2),
        ],
    )
    assert out[-5] == ProgressResult(done=False, inserted=0)  # rank 0 past the limit, rank 1 at 0 us
    assert out[-3] == ProgressResult(done=False, inserted=0)  # rank 1 at the limit itself
    assert out[-1] == ProgressResult(done=True, inserted=0)  # both past it


def test_a_prefetch_starts_on_each_ranks_own_clock() -> None:
    """D-41: a prefetch's start is read from each rank's clock. Rank 0 is 5 000 us ahead when it starts; both
    ranks then read 12 001 us, past the limit on rank 1 (started at 0) but not on rank 0 (7 001 us since its
    start), so the seed's MAX of ``1 - can_terminate`` keeps the prefetch until rank 0 is past it too. Ranks
    that read one shared clock would both start at 0 and stop at the first check."""
    tokens = tuple(range(8))
    out = in_l3_on_two_ranks(
        tokens,
        [
            AdvanceClock(5_000, rank=0),
            PrefetchFromStorage(2, tokens),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0),
            CompleteIO(IOQueue.PREFETCH_QUERY, 1),
            AdvanceClock(12_001, rank=1),
            AdvanceClock(7_001, rank=0),
            CheckPrefetchProgress(2),
            AdvanceClock(5_000, rank=0),
            CheckPrefetchProgress(2),
        ],
    )
    assert out[-3] == ProgressResult(done=False, inserted=0)  # rank 0: 7 001 us since its start
    assert out[-1] == ProgressResult(done=True, inserted=0)  # rank 0: 12 001 us


# --- load back (seed §2.3) -------------------------------------------------------------------------------


def test_a_load_back_that_must_evict_never_evicts_its_own_ancestor() -> None:
    """(0..3) on the device, (4..11) on the host only, a running request holding 8 of the 16 slots: the
    load of (4..11) needs 4 more slots and the only evictable leaf is its own ancestor (0..3), which
    ``load_back`` locks across the eviction. So the load is refused, the request is not admitted, and
    the ancestor stays on the device and evictable afterwards."""
    a, ab = (0, 1, 2, 3), tuple(range(12))
    out = lockstep(
        [
            *served(1, a),
            *served(2, ab),
            *drained(),
            Evict(8),  # the leaf (4..11) leaves L1; (0..3) stays
            StartRequest(3, tuple(range(100, 108))),
            StartRequest(4, (*ab, 50)),
            FinishRequest(3),
            MatchPrefix(ab),
            Evict(100),
        ],
        device_size=16,
    )
    assert out[-5] == StartResult(admitted=True, device_hit=0, loaded=0, computed=8)
    assert out[-4] == StartResult(admitted=False, device_hit=4, loaded=0, computed=0)
    assert out[-2] == MatchResult(
        device_len=4, host_hit_length=8, last_node_depth=12, last_host_node_depth=12
    )
    assert out[-1] == EvictResult(4)  # (0..3) stayed on the device, unlocked


def test_a_load_is_retired_only_when_every_rank_finished_it() -> None:
    """``loading_check`` retires the MIN over ranks of finished loads (D-09): rank 0 alone is not enough."""
    a = (0, 1, 2, 3)
    out = lockstep(
        [
            *served(1, a),
            *drained(2),
            Evict(100),
            StartRequest(2, (*a, 9)),
            FinishRequest(2),
            CompleteIO(IOQueue.LOAD, 0),
            CheckHicacheEvents(),
            CompleteIO(IOQueue.LOAD, 1),
            CheckHicacheEvents(),
        ],
        tp_size=2,
    )
    assert out[-6] == StartResult(admitted=True, device_hit=0, loaded=4, computed=1)
    assert out[-3] == EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=0)
    assert out[-1] == EventsResult(writes=0, loads=1, revoked=0, backups=0, host_releases=0)


def test_recomputing_over_a_host_only_node_makes_it_evictable_again() -> None:
    """A host hit below ``load_back_threshold`` is recomputed (seed §2.3); inserting it over the host-only
    node refills that node (D-03: ``both``), whose tokens join the evictable ones already on the device
    (the size accounting is compared step by step, and checked by the invariants)."""
    a, b = (0, 1, 2, 3), (10, 11, 12, 13)
    out = lockstep(
        [*served(1, a), *served(2, b), *drained(), Evict(4), *served(3, a), *drained(), Evict(100)],
        load_back_threshold=10,
    )
    assert out[-9] == EvictResult(4)  # (0..3), the least recently used, leaves L1
    assert out[-8] == StartResult(admitted=True, device_hit=0, loaded=0, computed=4)
    assert out[-1] == EvictResult(8)  # both nodes are evictable device leaves


def test_an_aborted_request_unlocks_its_matched_prefix() -> None:
    """``AbortRequest`` frees the request's own slots and releases its lock on the cached prefix it
    matched, so the prefix can be evicted again."""
    a = (1, 2, 3, 4)
    out = lockstep(
        [*served(1, a), *drained(), StartRequest(2, (*a, 5)), Evict(100), AbortRequest(2), Evict(100)]
    )
    assert out[-4] == StartResult(admitted=True, device_hit=4, loaded=0, computed=1)
    assert out[-3] == EvictResult(0)  # locked by the running request
    assert out[-1] == EvictResult(4)


# --- EAGLE (seed §5.7): bigram keys, one slot more than the key -----------------------------------------


def test_eagle_duplicate_request_frees_its_duplicates_and_its_tail_slot() -> None:
    """Two concurrent requests of the same 4 tokens (3 bigram keys): the second to finish finds all 3 keys
    in the tree and frees its 3 duplicate slots plus the slot of the last token, which no key covers."""
    out = lockstep(
        [StartRequest(1, (1, 2, 3, 4)), StartRequest(2, (1, 2, 3, 4)), FinishRequest(1), FinishRequest(2)],
        is_eagle=True,
        page_size=1,
        hicache_write_policy="write_through_selective",
    )
    assert out[2:] == [FinishResult(prefix_len=0, freed=1), FinishResult(prefix_len=3, freed=4)]


# --- prefetch into the host tier (seed §2.2, §3.6, D-25) ---------------------------------------------------


def test_overlapping_prefetches_in_a_namespace_share_their_host_nodes() -> None:
    """Three prefetches of overlapping prefixes, in flight together, in one namespace, page size 2. Each
    inserts only what the earlier ones did not (the progress counts new tokens): (0..3) as a node, then
    (4..7) below it, then nothing, splitting (4..7) at (4, 5). The result is reachable in the namespace
    with its hashes intact, and absent from the default one."""
    t = tuple(range(8))
    out = lockstep(
        [
            *served(1, t, "lora-a"),
            *drained(),
            *L3_ONLY,
            PrefetchFromStorage(2, t[:4], "lora-a"),
            PrefetchFromStorage(3, t, "lora-a"),
            PrefetchFromStorage(4, t[:6], "lora-a"),
            CompleteIO(IOQueue.PREFETCH_QUERY, 0, 100),
            CompleteIO(IOQueue.PREFETCH_IO, 0, 100),
            CheckPrefetchProgress(2),
            CheckPrefetchProgress(3),
            CheckPrefetchProgress(4),
            MatchPrefix(t, "lora-a"),
            MatchPrefix(t),
            *drained(),
            EvictHost(100),
            *fetched(5, t, "lora-a"),
            CheckPrefetchProgress(5),
        ],
        hicache_storage_backend="file",
        page_size=2,
    )
    assert out[-15:-12] == [ProgressResult(True, 4), ProgressResult(True, 4), ProgressResult(True, 0)]
    assert out[-12] == MatchResult(device_len=0, host_hit_length=8, last_node_depth=8, last_host_node_depth=8)
    assert out[-11] == MatchResult(device_len=0, host_hit_length=0, last_node_depth=0, last_host_node_depth=0)
    assert out[-1] == ProgressResult(True, 8)  # the pages' hashes still name the L3 objects


def test_a_prefetch_below_a_host_node_chains_its_hashes_from_the_anchor() -> None:
    """(0..3) kept on the host, (4..7) only in L3: the prefetch of (0..7) is anchored at (0..3) and fetches
    (4..7) under hashes that continue the anchor's chain; the anchor is pinned while it is in flight
    (snapshots compared step by step) and cannot be host-evicted."""
    a, ab = (0, 1, 2, 3), tuple(range(8))
    out = lockstep(
        [
            *served(1, a),
            *served(2, ab),
            *drained(),
            Evict(100),
            EvictHost(4),  # the host leaf (4..7); (0..3) stays on the host
            PrefetchFromStorage(3, ab),
            CompleteIO(IOQueue.PREFETCH_QUERY),
            EvictHost(100),
            CompleteIO(IOQueue.PREFETCH_IO),
            CheckPrefetchProgress(3),
            MatchPrefix(ab),
        ],
        hicache_storage_backend="file",
    )
    assert out[-6] == PrefetchResult(admitted=True, reason="admitted", tokens=4)
    assert out[-4] == EvictHostResult(0)
    assert out[-2] == ProgressResult(done=True, inserted=4)
    assert out[-1] == MatchResult(device_len=0, host_hit_length=8, last_node_depth=8, last_host_node_depth=8)


def test_a_host_leaf_pinned_by_a_prefetch_is_skipped_then_evictable_again() -> None:
    """``evict_host`` skips a host leaf whose ``host_ref_counter`` a prefetch holds and puts it back in
    the candidate set: once the prefetch is aborted, the next ``EvictHost`` frees it (seed §3.2 ②)."""
    a = (0, 1, 2, 3)
    out = lockstep(
        [
            *served(1, a),
            *served(2, (5, 6, 7, 8)),
            *drained(),
            Evict(100),
            PrefetchFromStorage(3, (*a, 9, 9, 9, 9)),  # anchored at (0..3)
            EvictHost(100),
            AbortPrefetch(3),
            CheckHicacheEvents(),
            EvictHost(100),
            MatchPrefix(a),
        ],
        hicache_storage_backend="file",
    )
    assert out[-5] == EvictHostResult(4)  # only (5..8)
    assert out[-2] == EvictHostResult(4)  # (0..3), no longer pinned
    assert out[-1] == MatchResult(device_len=0, host_hit_length=0, last_node_depth=0, last_host_node_depth=0)


def test_write_back_without_host_memory_drops_a_childless_leaf_and_keeps_a_parent() -> None:
    """``write_back`` with the host pool full of pages pinned by pending L2→L3 backups: evicting drops the
    device-only leaf (60..63) (its data is lost, seed §3.1 / D-10) but keeps (40..43), whose host-only
    child must not be orphaned, on the device and among the eviction candidates: once the backups are
    acknowledged and host memory can be freed, the next eviction writes it back."""
    x, z2, w = tuple(range(13)), tuple(range(40, 48)), (60, 61, 62, 63)
    out = lockstep(
        [
            *served(1, x),
            Evict(13),  # 13 of the 17 host slots, pinned until the L3 backup is acknowledged
            *served(2, z2[:4]),
            *served(3, z2),
            Evict(4),  # the leaf (44..47): the last 4 host slots, pinned too
            *served(4, w),
            Evict(100),
            MatchPrefix(w),
            CompleteIO(IOQueue.BACKUP, 0, 100),
            CheckHicacheEvents(),
            Evict(100),
            MatchPrefix(z2),
        ],
        device_size=16,
        hicache_ratio=1.0,
        hicache_write_policy="write_back",
        hicache_storage_backend="file",
    )
    assert out[-6] == EvictResult(4)  # (60..63) dropped; (40..43) skipped
    assert out[-5] == MatchResult(device_len=0, host_hit_length=0, last_node_depth=0, last_host_node_depth=0)
    assert out[-2] == EvictResult(4)  # (40..43) written back after all
    assert out[-1] == MatchResult(device_len=0, host_hit_length=8, last_node_depth=8, last_host_node_depth=8)


# --- idleness and Reset (D-16: refused unless every rank is idle and drained) ---------------------------

ORPHAN: list[Op] = [
    *served(1, (1, 2, 3, 4, 5)),
    *drained(),
    *L3_ONLY,
    PrefetchFromStorage(2, (1, 2, 3, 4, 5)),
    CompleteIO(IOQueue.PREFETCH_QUERY),
    CompleteIO(IOQueue.PREFETCH_IO),
    CheckPrefetchProgress(2),  # terminated between two storage batches: the tail is orphaned
    CheckHicacheEvents(),
]


def test_reset_is_refused_while_only_an_orphaned_prefetch_tail_is_pending() -> None:
    """After the request has its prefetch result, the I/O helper still owns the unread tail (D-25): the
    system is not idle until that transfer has ended and its slots are released."""
    out = lockstep(
        [*ORPHAN, Reset(), CompleteIO(IOQueue.PREFETCH_IO, 0, 100), CheckHicacheEvents(), Reset()],
        hicache_storage_backend="file",
        storage_batch_size=1,
        device_size=16,
    )
    assert out[len(ORPHAN) - 2] == ProgressResult(done=True, inserted=1)
    assert out[-4] == ResetResult(flushed=False)
    assert out[-2] == EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=4)
    assert out[-1] == ResetResult(flushed=True)


def test_reset_is_refused_while_a_revoke_is_pending() -> None:
    """A prefetch ended by the scheduler before its query; the query then finds too little and queues a
    revoke: not idle until ``CheckHicacheEvents`` has retired it."""
    out = lockstep(
        [
            *served(1, (1, 2, 3, 4, 5)),
            *drained(),
            *L3_ONLY,
            PrefetchFromStorage(7, (50, 51, 52, 53)),
            CheckPrefetchProgress(7),
            CompleteIO(IOQueue.PREFETCH_QUERY),
            Reset(),
            CheckHicacheEvents(),
            Reset(),
        ],
        hicache_storage_backend="file",
        prefetch_threshold=2,
    )
    assert out[-3:] == [
        ResetResult(flushed=False),
        EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=4),
        ResetResult(flushed=True),
    ]


# --- storage faults (D-18, D-30): L3 contents show only through later prefetches -------------------------


def test_a_terminated_prefetch_reads_no_more_batches_so_a_read_fault_hits_the_next_one() -> None:
    """The orphaned tail of a terminated prefetch is released unread, so a ``FAIL_NEXT_READ`` injected
    meanwhile is still pending for the next prefetch, whose first batch it fails (a failed read ends the
    prefetch's reading, D-18)."""
    out = lockstep(
        [
            *ORPHAN,
            StorageFault(FaultKind.FAIL_NEXT_READ),
            CompleteIO(IOQueue.PREFETCH_IO, 0, 100),  # the orphaned tail is released, not read
            CheckHicacheEvents(),
            *fetched(3, (1, 2, 3, 4, 5)),
            CheckPrefetchProgress(3),
        ],
        hicache_storage_backend="file",
        storage_batch_size=1,
        device_size=16,
    )
    assert out[-1] == ProgressResult(done=True, inserted=0)  # its first batch failed


def test_a_deleted_or_corrupt_l3_object_ends_the_prefetched_prefix() -> None:
    """The fourth L3 key in sorted order is deleted, resp. damaged — its checksum zeroed, a payload byte
    changed, its footer aged to an older format, or overwritten by the fifth key's object (it still exists
    for the query but its read is a miss, D-30): either way the prefetch of the 8 pages stops at the same
    page."""
    damage = (FaultKind.CORRUPT, FaultKind.FLIP_PAYLOAD, FaultKind.STALE, FaultKind.MISPLACED)
    for kind in (FaultKind.DELETE, *damage):
        t = tuple(range(8))
        out = lockstep(
            [
                *served(1, t),
                *drained(),
                *L3_ONLY,
                StorageFault(kind, 0, 3),
                *fetched(2, t),
                CheckPrefetchProgress(2),
            ],
            hicache_storage_backend="file",
        )
        assert out[-1] == ProgressResult(done=True, inserted=1), kind


def test_a_failed_l3_write_fails_only_the_next_batch() -> None:
    """``FAIL_NEXT_WRITE`` fails one L2→L3 batch: that node never reaches L3, the next backup does."""
    a, b = (0, 1, 2, 3), (7, 8, 9, 10)
    out = lockstep(
        [
            StorageFault(FaultKind.FAIL_NEXT_WRITE),
            *served(1, a),
            *drained(),
            *served(2, b),
            *drained(),
            *L3_ONLY,
            *fetched(3, a),
            CheckPrefetchProgress(3),
            *fetched(4, b),
            CheckPrefetchProgress(4),
        ],
        hicache_storage_backend="file",
    )
    assert out[-5] == ProgressResult(done=True, inserted=0)  # a's backup batch failed: not in L3
    assert out[-1] == ProgressResult(done=True, inserted=4)


def test_a_full_disk_writes_the_pages_that_fit_and_fails_the_rest_of_the_batch() -> None:
    """``DISK_FULL`` with room for one page: the backup writes the first page of ``a``, cuts the second
    short (ENOSPC, its temporary file removed) and fails the rest, which ends the operation and frees the
    disk again, so ``b``'s backup is whole."""
    a, b = (0, 1, 2, 3), (7, 8, 9, 10)
    out = lockstep(
        [
            StorageFault(FaultKind.DISK_FULL, 0, 1),
            *served(1, a),
            *drained(),
            *served(2, b),
            *drained(),
            *L3_ONLY,
            *fetched(3, a),
            CheckPrefetchProgress(3),
            *fetched(4, b),
            CheckPrefetchProgress(4),
        ],
        hicache_storage_backend="file",
    )
    assert out[-5] == ProgressResult(done=True, inserted=1)  # one page of a fitted
    assert out[-1] == ProgressResult(done=True, inserted=4)


def test_a_failed_publish_fails_the_next_batch_that_writes_a_page() -> None:
    """``FAIL_PUBLISH``: the renames of ``a``'s backup fail (nothing of ``a`` reaches L3); the fault is
    then spent and ``b``'s backup is whole."""
    a, b = (0, 1, 2, 3), (7, 8, 9, 10)
    out = lockstep(
        [
            StorageFault(FaultKind.FAIL_PUBLISH),
            *served(1, a),
            *drained(),
            *served(2, b),
            *drained(),
            *L3_ONLY,
            *fetched(3, a),
            CheckPrefetchProgress(3),
            *fetched(4, b),
            CheckPrefetchProgress(4),
        ],
        hicache_storage_backend="file",
    )
    assert out[-5] == ProgressResult(done=True, inserted=0)
    assert out[-1] == ProgressResult(done=True, inserted=4)
