"""D-51, ``root_priority_from_inserts``, D-52, ``release_unread_prefetch_tail``, and D-53, ``backup_per_fragment``
(SGLang's ``UnifiedRadixCache`` from 0.5.19; D-51 and D-52 under the prefetch pipeline of D-01). D-51, D-52: where a prefetch's pages hang below the root they take the root's
priority, which 0.5.20's ``HiRadixCache`` keeps at ``-sys.maxsize`` and UnifiedRadixCache raises to each insert's
priority (``unified_tree_core.py`` 0.5.20:1055); and the drain of a prefetch's final ack frees the host slots it
did not read at once in HiRadixCache, while UnifiedRadixCache queues them for release (``_drain_ack_prefetch``,
``unified_radix_cache.py`` 0.5.20:2881), after the drain counted that queue, so the next drain frees them. D-53: a write-through whose node was split
before its ack starts one L3 backup per fragment, each pinning its own node (``_finish_write_through_ack``), where
the model's D-07 starts one over both. Found by driving 0.5.20's UnifiedRadixCache L3 (``tests/engines/sglang/test_unified_l3.py``: the same traces;
D-53's is the shrunk trace of ``refcache fuzz --against model,sglang-unified``, write_through, seed 1)."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, WritePolicy
from refcache.hicache.ops import (
    AbortPrefetch,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    IOResult,
    Observation,
    Op,
    PrefetchFromStorage,
    Reset,
    StartRequest,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel
from refcache.model._prefetch import ROOT_PRIORITY_0520

A = tuple(range(1, 9))
TO_L3: Sequence[Op] = (
    StartRequest(1, A),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),  # the write-through ack starts the backup
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),
    EvictHost(1000),  # A is in L3 only
)
PREFETCHED: Sequence[Op] = (
    *TO_L3,
    PrefetchFromStorage(2, A),
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
    CheckHicacheEvents(),  # the drain allocates host memory for the 8 hits
    CompleteIO(IOQueue.PREFETCH_IO, 0, 2),  # two batches of 4
    CheckHicacheEvents(),  # the final ack: A's pages inserted below the root
)
# aborted before its first batch: the I/O thread reads that batch, then sends the final ack, whose drain finds
# none of the 8 slots completed
ABORTED: Sequence[Op] = (
    *TO_L3,
    PrefetchFromStorage(2, A),
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
    CheckHicacheEvents(),
    AbortPrefetch(2),
    CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
    CheckHicacheEvents(),  # the final ack's drain: the unread tail
    CheckHicacheEvents(),  # the next drain
)


def _config(**options: bool) -> HiCacheConfig:
    """0.5.20's profile (its pipeline, D-01) with ``options``; 4 pages per L3 batch."""
    return HiCacheConfig(
        device_size=16,
        page_size=1,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        prefetch_threshold=1,
        storage_batch_size=4,
    ).with_fidelity({**PROFILES["sglang-0.5.20"], **options})


def _run(config: HiCacheConfig, ops: Sequence[Op]) -> tuple[list[Observation], Snapshot]:
    with HiCacheModel(config) as model:
        return [model.apply(op) for op in ops], model.snapshot()


def test_the_options_are_followed_by_unified_radix_cache() -> None:
    assert FIDELITY_OPTIONS["D-51"] == "root_priority_from_inserts"
    assert FIDELITY_OPTIONS["D-52"] == "release_unread_prefetch_tail"
    assert FIDELITY_OPTIONS["D-53"] == "backup_per_fragment"
    for option in ("root_priority_from_inserts", "release_unread_prefetch_tail", "backup_per_fragment"):
        for profile in ("sglang-0.5.19-unified", "sglang-0.5.20-unified", "sglang-0.5.21", "sglang-0.5.23"):
            assert PROFILES[profile][option], (profile, option)
        for profile in ("sglang-0.5.19", "sglang-0.5.20", "sglang-0.5.12", "refcache"):
            assert not PROFILES[profile][option], (profile, option)


def test_a_prefetch_below_the_root_takes_the_priority_the_inserts_left_there() -> None:
    _, raised = _run(_config(root_priority_from_inserts=True), PREFETCHED)
    _, kept = _run(_config(), PREFETCHED)
    (node,) = raised.ranks[0].nodes
    assert node.id.path == A and node.priority == 0, "Unified: A's insert raised the root to 0"
    (node,) = kept.ranks[0].nodes
    assert node.priority == ROOT_PRIORITY_0520, "HiRadixCache: -sys.maxsize"


def test_before_any_insert_the_root_priority_is_still_minus_maxsize() -> None:
    with HiCacheModel(_config(root_priority_from_inserts=True)) as model:
        for op in TO_L3:
            model.apply(op)
        assert model.ranks[0].root.priority == 0
        model.apply(Reset())
        assert model.ranks[0].root.priority == ROOT_PRIORITY_0520


def test_the_unread_tail_is_released_by_the_next_drain() -> None:
    queued, queued_after = _run(_config(release_unread_prefetch_tail=True), ABORTED)
    freed, freed_after = _run(_config(), ABORTED)
    assert queued[-2] == EventsResult(0, 0, 0, 0, 0) and queued[-1] == EventsResult(0, 0, 0, 0, 8)
    assert freed[-2] == EventsResult(0, 0, 0, 0, 0) and freed[-1] == EventsResult(0, 0, 0, 0, 0)
    assert queued_after.ranks[0].host.free == freed_after.ranks[0].host.free


def test_a_prefetch_read_whole_leaves_no_tail() -> None:
    ops = [*PREFETCHED, CheckPrefetchProgress(2), CheckHicacheEvents()]
    queued, _ = _run(_config(release_unread_prefetch_tail=True), ops)
    freed, _ = _run(_config(), ops)
    assert queued == freed


SPLIT: Sequence[Op] = (
    StartRequest(2, (1200, 1201, 1202)),
    FinishRequest(2),  # one write-through of 3 tokens
    StartRequest(3, (1200, 1201)),  # splits its node before the ack
    CompleteIO(IOQueue.WRITE, 0, 64),
    CheckHicacheEvents(),  # the ack: the L3 backups start
)


def test_a_split_write_through_is_backed_up_per_fragment() -> None:
    _, apart = _run(_config(backup_per_fragment=True), SPLIT)
    _, together = _run(_config(), SPLIT)
    prefix, whole = (1200, 1201), (1200, 1201, 1202)
    assert [tuple(n.path for n in b) for b in apart.ranks[0].ongoing_backup] == [(prefix,), (whole,)]
    assert [tuple(n.path for n in b) for b in together.ranks[0].ongoing_backup] == [(whole,)]
    pins = {n.id.path: n.host_ref_counter for n in apart.ranks[0].nodes}
    assert pins == {prefix: 1, whole: 1}, "each fragment is pinned by its own backup"
    assert {n.id.path: n.host_ref_counter for n in together.ranks[0].nodes} == {prefix: 0, whole: 1}, (
        "D-07 option"
    )
    with HiCacheModel(_config(backup_per_fragment=True)) as model:
        for op in SPLIT:
            model.apply(op)
        assert model.apply(CompleteIO(IOQueue.BACKUP, 0, 8)) == IOResult(2)
        assert model.apply(CheckHicacheEvents()) == EventsResult(0, 0, 0, 2, 0)
        assert all(n.host_ref_counter == 0 for n in model.snapshot().ranks[0].nodes)
