"""D-45, ``split_keeps_creation_time`` (SGLang 0.5.22 on, ``UnifiedTreeCore._split_node``): the prefix node a
split creates keeps the split node's creation time, so FIFO and FILO rank it as the original node; refcache
(and 0.5.20) stamp it anew. Found by the model-versus-0.5.23 fuzzing (FIFO, write_back), here on a shorter
trace."""

from __future__ import annotations

import pytest

from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import UnsupportedError
from refcache.hicache.ops import (
    Evict,
    EvictHost,
    EvictHostResult,
    FinishRequest,
    Op,
    PrefetchFromStorage,
    StartRequest,
)
from refcache.hicache.snapshot import Path
from refcache.model import HiCacheModel

X = (1, 2, 3, 4)
Y = (9, 8)
OPS: tuple[Op, ...] = (
    StartRequest(1, X),
    FinishRequest(1),
    StartRequest(2, Y),
    FinishRequest(2),
    StartRequest(3, X[:2]),  # its insert splits X into (1, 2) and (3, 4), after Y was created
    FinishRequest(3),
    Evict(3),  # (3, 4) first, then the older of (1, 2) and Y
)
CONFIG = HiCacheConfig(
    device_size=16,
    page_size=1,
    radix_eviction_policy=EvictionPolicy.FIFO,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)


def _on_device(keeps: bool) -> set[Path]:
    with HiCacheModel(CONFIG.with_fidelity({"split_keeps_creation_time": keeps})) as model:
        for op in OPS:
            model.apply(op)
        return {n.id.path for n in model.snapshot().ranks[0].nodes if n.id.path and n.value is not None}


def test_the_option_is_followed_from_0522() -> None:
    assert PROFILES["sglang-0.5.22"]["split_keeps_creation_time"]
    assert PROFILES["sglang-0.5.23"]["split_keeps_creation_time"]
    assert not PROFILES["sglang-0.5.20"]["split_keeps_creation_time"]
    assert not PROFILES["refcache"]["split_keeps_creation_time"]


def test_fifo_ranks_a_split_prefix_as_the_original_node() -> None:
    assert _on_device(keeps=True) == {Y}, "the prefix (1, 2) is as old as X: evicted before Y"
    assert _on_device(keeps=False) == {X[:2]}, "the prefix (1, 2) is newer than Y: Y goes first"


def test_the_implementation_refuses_it() -> None:
    from refcache.gpu.driver import HiCacheImpl  # torch: imported by this test only

    with pytest.raises(UnsupportedError, match="split_keeps_creation_time"):
        HiCacheImpl(CONFIG.with_fidelity({"split_keeps_creation_time": True}))


# The open write_back case of specs/sglang-findings-releases.md (0.5.22 and 0.5.23, `refcache fuzz --seed 26`
# on 4933890, 180 -> 7 operations): the prefetch's anchor lookup splits the lora-a node (3, 7, 8) at (3,), which
# keeps (3, 7, 8)'s creation time on 0.5.22 on. Host: 13 slots; (3, 7, 8) written back to 0..2, then the
# 1700 node to 3..7; EvictHost frees (7, 8) first (the oldest host leaf), then (3,) or the 1700 node.
HOST_ORDER_OPS: tuple[Op, ...] = (
    StartRequest(6, (3, 7, 8), "lora-a", prompt_len=3),
    FinishRequest(6),
    StartRequest(7, tuple(range(1700, 1705))),  # device 6: writes (3, 7, 8) back to host slots 0..2
    FinishRequest(7),
    PrefetchFromStorage(12, (3, 2, 5, 3), "lora-a"),  # no L3: declined, but its match splits (3, 7, 8)
    StartRequest(13, (3, 7, 0), prompt_len=3),  # writes the 1700 node back to host slots 3..7
    EvictHost(10000),
)
HOST_ORDER_CONFIG = HiCacheConfig(
    device_size=6,
    hicache_ratio=2.0,
    page_size=1,
    prefetch_threshold=1,
    radix_eviction_policy=EvictionPolicy.FIFO,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)


def _host_free(keeps: bool) -> tuple[int, ...]:
    config = HOST_ORDER_CONFIG.with_fidelity(
        {**PROFILES["sglang-0.5.23"], "split_keeps_creation_time": keeps}
    )
    with HiCacheModel(config) as model:
        results = [model.apply(op) for op in HOST_ORDER_OPS]
        assert results[-1] == EvictHostResult(num_evicted=8)
        return model.snapshot().ranks[0].host.free


def test_fifo_frees_a_split_prefix_host_copy_in_the_original_nodes_turn() -> None:
    """The free list's order is what the next host allocations take (D-19), so the snapshot compares it as a
    sequence. 0.5.22 and 0.5.23 freed (8..12, 1, 2, 0, 3..7): (3,) as old as (3, 7, 8), before the 1700 node."""
    assert _host_free(keeps=True) == (8, 9, 10, 11, 12, 1, 2, 0, 3, 4, 5, 6, 7)
    assert _host_free(keeps=False) == (8, 9, 10, 11, 12, 1, 2, 3, 4, 5, 6, 7, 0)
