"""D-54, ``prefetch_progress_in_operation``: SGLang up to 0.5.18's prefetch pipeline, under D-01's
(``allocate_prefetch_after_query``). Its hit query and the drain's allocation are 0.5.20's, but nothing acks a
read (no ``PrefetchAck``, ``prefetch_sync_queue`` or ``ack_prefetch_queue`` before 0.5.19): the I/O thread adds
each page it reads to the operation's ``completed_tokens`` and, when the transfer ends, queues the unread tail
for release (``prefetch_io_aux_func``, ``cache_controller.py`` 0.5.18:1032); ``check_prefetch_progress`` inserts
(``hiradix_cache.py`` 0.5.18:1635), never a drain. Found by driving 0.5.18's L3 (``tests/engines/sglang/test_l3.py``,
the same traces)."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
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
    Observation,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    StartRequest,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel

A = tuple(range(1, 9))
QUERIED: Sequence[Op] = (
    StartRequest(1, A),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),  # the write-through ack starts the backup
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),
    EvictHost(1000),  # A is in L3 only
    PrefetchFromStorage(2, A),
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
    CheckHicacheEvents(),  # the drain allocates host memory for the 8 hits
)


def _config(policy: PrefetchPolicy, **options: bool) -> HiCacheConfig:
    """0.5.18's profile (D-01 and D-54) with ``options``; 4 pages per L3 batch."""
    return HiCacheConfig(
        device_size=16,
        page_size=1,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy=policy,
        prefetch_threshold=1,
        storage_batch_size=4,
    ).with_fidelity({**PROFILES["sglang-0.5.18"], **options})


def _run(config: HiCacheConfig, ops: Sequence[Op]) -> tuple[list[Observation], Snapshot]:
    with HiCacheModel(config) as model:
        return [model.apply(op) for op in ops], model.snapshot()


def test_the_option_is_followed_up_to_0_5_18() -> None:
    assert FIDELITY_OPTIONS["D-54"] == "prefetch_progress_in_operation"
    for profile in ("sglang-0.5.18", "sglang-0.5.12", "sglang-0.5.6"):
        assert PROFILES[profile]["prefetch_progress_in_operation"], profile
    for profile in ("sglang-0.5.19", "sglang-0.5.20", "sglang-0.5.20-unified", "sglang-0.5.23", "refcache"):
        assert not PROFILES[profile]["prefetch_progress_in_operation"], profile


def test_a_read_shows_in_the_operation_at_once() -> None:
    """0.5.18: the batch read is the operation's progress; 0.5.20: only the drain of its ack is."""
    ops = [*QUERIED, CompleteIO(IOQueue.PREFETCH_IO, 0, 1)]
    _, unacked = _run(_config(PrefetchPolicy.WAIT_COMPLETE), ops)
    _, acked = _run(_config(PrefetchPolicy.WAIT_COMPLETE, prefetch_progress_in_operation=False), ops)
    assert unacked.ranks[0].ongoing_prefetch[0].completed_tokens == 4
    assert acked.ranks[0].ongoing_prefetch[0].completed_tokens == 0


def test_wait_complete_finishes_at_the_progress_check_not_at_a_drain() -> None:
    ops = [*QUERIED, CompleteIO(IOQueue.PREFETCH_IO, 0, 2), CheckHicacheEvents(), CheckPrefetchProgress(2)]
    unacked, after = _run(_config(PrefetchPolicy.WAIT_COMPLETE), ops)
    acked, _ = _run(_config(PrefetchPolicy.WAIT_COMPLETE, prefetch_progress_in_operation=False), ops)
    assert unacked[-1] == ProgressResult(done=True, inserted=8), "0.5.18: check_prefetch_progress inserts"
    assert acked[-1] == ProgressResult(done=True, inserted=8), "0.5.20: the final ack's drain inserted"
    assert unacked[-2] == EventsResult(0, 0, 0, 0, 0)
    assert len(after.ranks[0].nodes) == 1 and not after.ranks[0].ongoing_prefetch


def test_an_aborted_read_releases_its_tail_through_the_queue() -> None:
    """Aborted before its first batch: 0.5.18's I/O thread reads no page of the terminated operation and queues
    all 8 slots for release, which the next drain frees; 0.5.20's final-ack drain frees them at once."""
    ops = [*QUERIED, AbortPrefetch(2), CompleteIO(IOQueue.PREFETCH_IO, 0, 1), CheckHicacheEvents()]
    unacked, after = _run(_config(PrefetchPolicy.BEST_EFFORT), ops)
    acked, after_acked = _run(_config(PrefetchPolicy.BEST_EFFORT, prefetch_progress_in_operation=False), ops)
    assert unacked[-1] == EventsResult(0, 0, 0, 0, 8)
    assert acked[-1] == EventsResult(0, 0, 0, 0, 0)
    assert after.ranks[0].host.free == after_acked.ranks[0].host.free
