"""HiCache's directed conformance scenarios: short runs, each through one situation of the seed.

Each scenario is a configuration and an operation list that takes a system from empty through one named
situation: a prefix hit, a write-through and its acknowledgement, eviction to the host tier and the load
back, host eviction, write-back's backup on eviction, the L3 backup and a prefetch from L3, an aborted
request and a reset. ``refcache.conformance.check_system`` runs every one on a system under test (its
invariants after each step, and the same outcomes and snapshots as the reference model when one runs
beside it); ``tests/unit/test_conformance.py`` holds the model to them and checks that each reaches the
situation its name promises.
"""

from __future__ import annotations

from typing import Final

from refcache.config import HiCacheConfig, WritePolicy
from refcache.family import Scenario
from refcache.hicache.ops import (
    AbortRequest,
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    Reset,
    StartRequest,
)

__all__ = ["scenarios"]

_SMALL: Final = HiCacheConfig(
    device_size=32, hicache_ratio=2.0, page_size=2, hicache_write_policy=WritePolicy.WRITE_THROUGH
)
_BACK: Final = HiCacheConfig(
    device_size=32, hicache_ratio=2.0, page_size=2, hicache_write_policy=WritePolicy.WRITE_BACK
)
_L3: Final = HiCacheConfig(
    device_size=32,
    hicache_ratio=2.0,
    page_size=2,
    hicache_storage_backend="file",
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    prefetch_threshold=1,
)

A: Final = tuple(range(1, 15))  # 14 tokens: a load back of its 12-token prefix passes the threshold
B: Final = (*A[:12], 30, 31)  # shares A's first 12 tokens
C: Final = (9, 9, 8, 8, 7, 7, 6, 6)
D: Final = (21, 22, 23, 24)  # D, E, F: three two-page leaves under the root
E: Final = (31, 32, 33, 34)
F: Final = (41, 42, 43, 44)


def _written(tokens: tuple[int, ...], rid: int = 0) -> tuple[Op, ...]:
    """A request over ``tokens`` that finishes, and its L1→L2 copy acknowledged."""
    return (
        StartRequest(rid, tokens),
        FinishRequest(rid),
        CompleteIO(IOQueue.WRITE),
        CheckHicacheEvents(),
    )


def _on_host(tokens: tuple[int, ...]) -> tuple[Op, ...]:
    """``tokens`` written through and then evicted from the device: host-only."""
    return (*_written(tokens), Evict(32), MatchPrefix(tokens))


def scenarios() -> tuple[Scenario[Op], ...]:
    """Every HiCache scenario, in a fixed order."""
    return (
        Scenario(
            "prefix-hit",
            "a finished request's prefix is matched on the device by the next one that shares it",
            _SMALL,
            (StartRequest(0, A), FinishRequest(0), MatchPrefix(B), StartRequest(1, B), FinishRequest(1)),
        ),
        Scenario(
            "write-through-acknowledged",
            "a device node's L1→L2 copy is queued, completed and acknowledged: the node is backed up",
            _SMALL,
            (*_written(A), MatchPrefix(A)),
        ),
        Scenario(
            "evict-to-host-and-load-back",
            "a backed-up node is evicted from the device, then loaded back by a request that matches it",
            _SMALL,
            (
                *_on_host(A),
                StartRequest(1, B),
                CompleteIO(IOQueue.LOAD),
                CheckHicacheEvents(),
                FinishRequest(1),
                CompleteIO(IOQueue.WRITE),
                CheckHicacheEvents(),
            ),
        ),
        Scenario(
            "evict-least-recent-first",
            "an eviction of one leaf's worth of tokens takes exactly the least recently used leaf, no more",
            _SMALL,
            (
                *_written(D),
                *_written(E, rid=1),
                *_written(F, rid=2),
                MatchPrefix(D),
                Evict(4),
                MatchPrefix(D),
                MatchPrefix(E),
                MatchPrefix(F),
            ),
        ),
        Scenario(
            "evict-host",
            "a host-only node is evicted from the host tier: it leaves the tree",
            _SMALL,
            (*_on_host(A), EvictHost(64), MatchPrefix(A)),
        ),
        Scenario(
            "write-back-on-eviction",
            "under write_back a device node is copied to the host only when it is evicted",
            _BACK,
            (
                StartRequest(0, C),
                FinishRequest(0),
                Evict(32),
                CompleteIO(IOQueue.WRITE),
                CheckHicacheEvents(),
                Evict(32),
                MatchPrefix(C),
            ),
        ),
        Scenario(
            "backup-then-prefetch",
            "a node is backed up to L3, evicted from both tiers, prefetched from L3 and used by a request",
            _L3,
            (
                *_written(A),
                CompleteIO(IOQueue.BACKUP),
                CheckHicacheEvents(),
                Evict(32),
                EvictHost(64),
                PrefetchFromStorage(5, A),
                CompleteIO(IOQueue.PREFETCH_QUERY),
                CompleteIO(IOQueue.PREFETCH_IO),
                CompleteIO(IOQueue.PREFETCH_IO),
                AdvanceClock(1_000),
                CheckPrefetchProgress(5),
                StartRequest(6, A),
                CompleteIO(IOQueue.LOAD),
                CheckHicacheEvents(),
                FinishRequest(6),
            ),
        ),
        Scenario(
            "abort-and-reset",
            "a running request is aborted (its slots freed); a reset is refused while a write is in flight and "
            "empties the cache once it is acknowledged",
            _SMALL,
            (
                StartRequest(0, A),
                StartRequest(1, C),
                AbortRequest(0),
                FinishRequest(1),
                Reset(),
                CompleteIO(IOQueue.WRITE),
                CheckHicacheEvents(),
                Reset(),
                MatchPrefix(C),
            ),
        ),
    )
