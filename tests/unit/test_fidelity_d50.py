"""D-50, ``count_hits_on_refill`` (SGLang's ``UnifiedRadixCache`` from 0.5.19): a finished insert counts a hit on
a host-only node it refills with the request's recomputed KV; refcache (and 0.5.20's ``HiRadixCache``) count none
there. A chunked insert still counts nothing, which is what tells it from D-35 (``count_hits_per_request``,
0.5.22 on), whose checkpoint counts as a finished insert. Found by fuzzing 0.5.20's Unified path (the half of D-35
that 0.5.19 and 0.5.20 already do); the trace is ``test_adapter_ops``'s recompute below the load-back
threshold."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.errors import UnsupportedError
from refcache.hicache.ops import (
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)
from refcache.hicache.snapshot import NodeRecord
from refcache.model import HiCacheModel

A = tuple(range(1, 9))
EVICTED: tuple[Op, ...] = (
    StartRequest(1, A),
    FinishRequest(1),  # hit 1 on the new leaf; written through
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    Evict(100),  # A is host-only now
    StartRequest(2, A),  # 8 host tokens < load_back_threshold 10: recomputed, not loaded back
)
CONFIG = HiCacheConfig(
    device_size=8, page_size=1, load_back_threshold=10, hicache_write_policy=WritePolicy.WRITE_THROUGH
)


def _node(config: HiCacheConfig, ops: Sequence[Op], **options: bool) -> NodeRecord:
    with HiCacheModel(config.with_fidelity(options)) as model:
        for op in ops:
            model.apply(op)
        return next(n for n in model.snapshot().ranks[0].nodes if n.id.path == A)


def test_the_option_is_followed_by_unified_radix_cache_from_0519() -> None:
    for profile in ("sglang-0.5.19-unified", "sglang-0.5.20-unified", "sglang-0.5.22", "sglang-0.5.23"):
        assert PROFILES[profile]["count_hits_on_refill"], profile
    for profile in ("sglang-0.5.19", "sglang-0.5.20", "refcache"):
        assert not PROFILES[profile]["count_hits_on_refill"], profile
    # the other half of D-35 (a checkpoint counts a hit) is 0.5.22's only
    assert not PROFILES["sglang-0.5.20-unified"]["count_hits_per_request"]
    assert not PROFILES["sglang-0.5.19-unified"]["count_hits_per_request"]


def test_a_finished_insert_counts_a_hit_on_the_node_it_refills() -> None:
    ops = (*EVICTED, FinishRequest(2))
    assert _node(CONFIG, ops, count_hits_on_refill=True).hit_count == 2
    assert _node(CONFIG, ops).hit_count == 1, "refcache: a refill is not a hit"


def test_a_chunked_insert_counts_none_even_where_it_refills() -> None:
    """0.5.19/0.5.20's Unified checkpoint passes ``chunked``: no hit, refill or not (D-35 counts one)."""
    refill = (*EVICTED, CacheUnfinishedRequest(2))
    assert _node(CONFIG, refill, count_hits_on_refill=True).hit_count == 1
    checkpoint: tuple[Op, ...] = (StartRequest(1, A), CacheUnfinishedRequest(1))
    assert _node(CONFIG, checkpoint, count_hits_on_refill=True).hit_count == 0
    assert _node(CONFIG, checkpoint, count_hits_per_request=True).hit_count == 1


def test_write_back_counts_no_hit_on_a_refill() -> None:
    config = HiCacheConfig(**{**CONFIG.__dict__, "hicache_write_policy": WritePolicy.WRITE_BACK})
    ops: tuple[Op, ...] = (
        StartRequest(1, A),
        FinishRequest(1),
        Evict(100),  # written back inside the eviction: host-only
        StartRequest(2, A),
        FinishRequest(2),
    )
    assert _node(config, ops, count_hits_on_refill=True).hit_count == 0


def test_the_implementation_refuses_it() -> None:
    from refcache.gpu.driver import HiCacheImpl  # torch: imported by this test only

    with pytest.raises(UnsupportedError, match="count_hits_on_refill"):
        HiCacheImpl(CONFIG.with_fidelity({"count_hits_on_refill": True}))
