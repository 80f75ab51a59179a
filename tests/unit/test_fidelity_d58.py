"""D-58, ``revoke_at_query``: SGLang 0.5.16 and 0.5.17's prefetch thread revokes a query below the threshold itself,
through ``prefetch_revoke_queue`` (``cache_controller.py`` 0.5.17 ``prefetch_thread_func``), and the scheduler's
drain empties that queue before it allocates for ``prefetch_hit_queue`` (``hiradix_cache.py`` 0.5.17
``_drain_storage_control_queues_impl``: ``_drain_revoke`` first). 0.5.18 revokes in the drain of the hit queue,
in query order. So a revoke that unprotects an anchor lets the same drain's ``evict_host`` free it for an earlier
query's allocation on 0.5.16/0.5.17, and not on 0.5.18."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    Observation,
    Op,
    PrefetchFromStorage,
    StartRequest,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel

X = tuple(range(1, 5))  # 4 tokens, in L3 only
Y = tuple(range(11, 19))  # 8 tokens, host only: the anchor of a prefetch that misses
OPS: Sequence[Op] = (
    StartRequest(1, X),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),
    EvictHost(1000),  # X is in L3 only, the host pool (11 tokens) empty
    StartRequest(2, Y),
    FinishRequest(2),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),  # Y is host only: 8 of the 11 host tokens, 3 free
    PrefetchFromStorage(3, X),  # anchored at the root: 4 hits
    PrefetchFromStorage(4, (*Y, 21, 22)),  # anchored at Y (host-protected): 0 hits, below the threshold
    CompleteIO(IOQueue.PREFETCH_QUERY, 0, 2),
)


def _config(**options: bool) -> HiCacheConfig:
    """0.5.17's profile with ``options``."""
    return HiCacheConfig(
        device_size=8,
        hicache_ratio=1.25,
        page_size=1,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy=PrefetchPolicy.BEST_EFFORT,
        prefetch_threshold=2,
    ).with_fidelity({**PROFILES["sglang-0.5.17"], **options})


def _run(config: HiCacheConfig, ops: Sequence[Op]) -> tuple[list[Observation], Snapshot]:
    with HiCacheModel(config) as model:
        return [model.apply(op) for op in ops], model.snapshot()


def test_the_option_is_followed_up_to_0_5_17() -> None:
    assert FIDELITY_OPTIONS["D-58"] == "revoke_at_query"
    for profile in ("sglang-0.5.17", "sglang-0.5.16", "sglang-0.5.6"):
        assert PROFILES[profile]["revoke_at_query"], profile
    for profile in ("sglang-0.5.18", "sglang-0.5.20", "sglang-0.5.23", "refcache"):
        assert not PROFILES[profile]["revoke_at_query"], profile


def test_a_miss_waits_in_the_revoke_queue() -> None:
    """After the queries: 0.5.17 queues the miss for revoking; 0.5.18 queues both for the drain."""
    _, at_query = _run(_config(), OPS)
    _, at_drain = _run(_config(revoke_at_query=False), OPS)
    queues, queues_0518 = dict(at_query.ranks[0].queues), dict(at_drain.ranks[0].queues)
    assert (queues["revoke"], queues["prefetch_query"]) == (1, 1)
    assert (queues_0518["revoke"], queues_0518["prefetch_query"]) == (0, 2)
    assert [p.rid for p in at_query.ranks[0].ongoing_prefetch] == [3, 4]  # still live until the drain


def test_the_drain_revokes_first_so_its_allocation_may_evict_the_anchor() -> None:
    """0.5.17: the miss is revoked first, Y is no longer host-protected, and the hit's allocation evicts it
    for all 4 tokens; 0.5.18: Y is still protected when the hit allocates, which falls back to the 3 free."""
    ops = [*OPS, CheckHicacheEvents()]
    at_query, after = _run(_config(), ops)
    at_drain, after_0518 = _run(_config(revoke_at_query=False), ops)
    assert at_query[-1] == at_drain[-1] == EventsResult(0, 0, 1, 0, 0)
    assert [(p.rid, p.hit_pages) for p in after.ranks[0].ongoing_prefetch] == [(3, 4)]
    assert [(p.rid, p.hit_pages) for p in after_0518.ranks[0].ongoing_prefetch] == [(3, 3)]
    assert not after.ranks[0].nodes  # Y was evicted from the host (the root is not listed)
    assert len(after_0518.ranks[0].nodes) == 1
