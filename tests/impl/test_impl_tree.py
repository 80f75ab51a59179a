"""HiRadixCache and HiCacheController as components: one rank built by ``build_rank`` on a manual
executor, driven through their SGLang-named methods."""

from __future__ import annotations

from typing import TypeVar

import pytest
import torch

from refcache.config import HiCacheConfig
from refcache.gpu.cache_controller import Check, PrefetchOperation
from refcache.gpu.driver import build_rank
from refcache.gpu.hiradix_cache import HiRadixCache
from refcache.hicache.ops import IOQueue
from refcache.hicache.states import NodeState
from refcache.runtime import Collective
from refcache.testing import InProcessGroup, LogicalClock, ManualExecutor

_T = TypeVar("_T")


def make(**overrides: object) -> tuple[HiRadixCache, ManualExecutor]:
    options: dict[str, object] = {"device_size": 32, "hicache_io_backend": "direct", **overrides}
    config = HiCacheConfig.from_json(options).resolve()
    executor = ManualExecutor(InProcessGroup(1))
    return build_rank(config, 0, executor, LogicalClock(), None), executor


def computed(cache: HiRadixCache, n: int) -> torch.Tensor:
    slots = cache.alloc_token_slots(n)
    assert slots is not None
    return slots


def run(gen: Collective[_T]) -> _T:
    """Drive a one-rank collective generator (every reduction of one value is that value)."""
    return InProcessGroup(1).run_lockstep([gen])[0]


@pytest.fixture
def selective() -> HiRadixCache:
    return make(hicache_write_policy="write_through_selective")[0]


def test_insert_splits_and_match_returns_the_device_prefix(selective: HiRadixCache) -> None:
    cache = selective
    a = computed(cache, 4)
    assert cache.insert((1, 2, 3, 4), a, None) == 0
    b = computed(cache, 4)
    assert cache.insert((1, 2, 9, 9), b, None) == 2  # (1, 2) already there: the caller frees b[:2]
    m = cache.match_prefix((1, 2, 3, 4, 5), None)
    assert m.device_indices.tolist() == a.tolist() and m.host_hit_length == 0
    assert [n.key for n in cache.root_node.children.values()] == [(1, 2)]
    split = next(iter(cache.root_node.children.values()))
    assert sorted(c.key for c in split.children.values()) == [(3, 4), (9, 9)]


def test_write_through_selective_backs_up_on_the_second_hit(selective: HiRadixCache) -> None:
    cache = selective
    cache.insert((1, 2), computed(cache, 2), None)
    node = next(iter(cache.root_node.children.values()))
    assert (node.state, node.hit_count) == (NodeState.DEVICE, 1)
    cache.insert((1, 2), computed(cache, 2), None)
    assert (node.state, node.lock_ref) == (NodeState.BOTH, 1)  # the source is pinned until the ack
    assert cache.cache_controller.ready_write_acks() == 0
    cache.cache_controller.executor.complete(IOQueue.WRITE.value, 0, 1)
    assert run(cache.writing_check()) == 1 and node.lock_ref == 0


@pytest.mark.parametrize(
    ("policy", "first_out"),
    [("lru", (3,)), ("fifo", (1,)), ("mru", (2,)), ("filo", (3,)), ("lfu", (3,))],
)
def test_eviction_order_follows_the_policy(policy: str, first_out: tuple[int, ...]) -> None:
    cache, _ = make(radix_eviction_policy=policy, hicache_write_policy="write_back")
    for token in (1, 2, 3):
        cache.insert((token,), computed(cache, 1), None)
    cache.match_prefix((1,), None)  # access order: 3 (created last, never touched since), 1, then 2
    cache.match_prefix((2,), None)
    cache.evict(1)  # write-back never counts hits, so LFU ties on hit_count and falls back to recency
    evicted = [k for k, n in cache.root_node.children.items() if n.evicted]
    assert [k[1] for k in evicted] == [first_out]


def test_prefetch_operation_ownership_moves_in_order() -> None:
    cache, _ = make(hicache_storage_backend=None)
    ctrl = cache.cache_controller
    slots = torch.arange(8, dtype=torch.int64)
    op = PrefetchOperation(0, 1, (), None, slots, 0, Check([], []))
    ctrl.release_tail(op, 6)  # the hit query found 6 tokens
    assert op.held().tolist() == list(range(6)) and len(ctrl.host_mem_release_queue) == 2
    assert op.increment(4) and op.mark_terminate() == 4 and not op.increment(2)
    assert ctrl.take(op, 4).tolist() == [0, 1, 2, 3]  # the scheduler takes what was read
    ctrl.release_tail(op, op.completed_tokens)  # the I/O helper ends: the unread tail goes back
    assert op.held().tolist() == [] and len(ctrl.host_mem_release_queue) == 4
