"""D-45, ``split_keeps_creation_time`` (SGLang 0.5.22 on, ``UnifiedTreeCore._split_node``): the prefix node a
split creates keeps the split node's creation time, so FIFO and FILO rank it as the original node; refcache
(and 0.5.20) stamp it anew. Found by the model-versus-0.5.23 fuzzing (FIFO, write_back), here on a shorter
trace."""

from __future__ import annotations

import pytest

from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import UnsupportedError
from refcache.hicache.ops import Evict, FinishRequest, Op, StartRequest
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
