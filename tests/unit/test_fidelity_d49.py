"""D-49, ``free_duplicates_per_node`` (SGLang 0.5.22 on, the insert walk of ``UnifiedTreeCore``: a ``FreeDeviceKV``
per matched node): a finished request's device slots that duplicate the tree go back node by node, in key order;
refcache (and 0.5.20's one ``free``, sorted by ``torch.unique``) free them in one call, ascending. The shrunk
trace of the model-versus-0.5.23 write_back fuzzing (seed 2, 7 operations; specs/sglang-adapter.md)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from refcache.config import (
    FIDELITY_OPTIONS,
    FOLLOWED_BY,
    PROFILES,
    EvictionPolicy,
    HiCacheConfig,
    WritePolicy,
)
from refcache.errors import UnsupportedError
from refcache.hicache.ops import FinishRequest, FinishResult, Op, StartRequest
from refcache.model import HiCacheModel

SHARED = (5, 5, 3, 0, 2, 0, 3, 0, 3)
OPS: Sequence[Op] = (
    StartRequest(32, tuple(range(4000, 4008))),
    FinishRequest(32),
    StartRequest(35, (*SHARED, 1, 5, 4), "lora-a", prompt_len=4),
    StartRequest(41, tuple(range(4100, 4114)), prompt_len=14),
    StartRequest(
        42, (*SHARED, 2, 0), "lora-a", prompt_len=1
    ),  # pages 36..39 then 0..3 (request 32's, evicted)
    FinishRequest(
        35
    ),  # the tree holds (5, 5, 3, 0) and (2, 0, 3, 0) ...: request 42's first 8 tokens duplicate it
    FinishRequest(42),
)


def _config(policy: WritePolicy = WritePolicy.WRITE_BACK) -> HiCacheConfig:
    """Device 40 tokens, page size 4, LFU, 0.5.23's profile but for D-49."""
    return HiCacheConfig(
        device_size=40, page_size=4, radix_eviction_policy=EvictionPolicy.LFU, hicache_write_policy=policy
    ).with_fidelity({**PROFILES["sglang-0.5.23"], "free_duplicates_per_node": False})


def _free_after(config: HiCacheConfig, per_node: bool) -> tuple[object, tuple[int, ...]]:
    with HiCacheModel(config.with_fidelity({"free_duplicates_per_node": per_node})) as model:
        results = [model.apply(op) for op in OPS]
        return results[-1], model.snapshot().ranks[0].device.free


def test_the_option_is_registered_and_followed_from_0522() -> None:
    assert FIDELITY_OPTIONS["D-49"] == "free_duplicates_per_node"
    assert PROFILES["sglang-0.5.22"]["free_duplicates_per_node"]
    assert PROFILES["sglang-0.5.23"]["free_duplicates_per_node"]
    assert not PROFILES["sglang-0.5.20"]["free_duplicates_per_node"]
    assert not PROFILES["refcache"]["free_duplicates_per_node"]
    assert "0.5.22" in FOLLOWED_BY["free_duplicates_per_node"]


@pytest.mark.parametrize("policy", [WritePolicy.WRITE_BACK, WritePolicy.WRITE_THROUGH_SELECTIVE])
def test_duplicates_go_back_node_by_node_in_key_order(policy: WritePolicy) -> None:
    """Node (5, 5, 3, 0)'s duplicate is page 36, node (2, 0, 3, 0)'s page 0: 0.5.23 frees 36 first; one
    free of both (refcache) puts them back ascending. The unaligned tail (page 4) follows either way. (Under
    write_through request 32's node is backed up and locked until its ack: request 42 is not admitted.)"""
    result, free = _free_after(_config(policy), per_node=True)
    assert result == FinishResult(prefix_len=8, freed=11)
    assert free == (*range(36, 40), *range(8))
    result, free = _free_after(_config(policy), per_node=False)
    assert result == FinishResult(prefix_len=8, freed=11)
    assert free == (*range(4), *range(36, 40), *range(4, 8))


def test_the_implementation_refuses_it() -> None:
    from refcache.gpu.driver import HiCacheImpl  # torch: imported by this test only

    with pytest.raises(UnsupportedError, match="free_duplicates_per_node"):
        HiCacheImpl(_config().with_fidelity({"free_duplicates_per_node": True}))
