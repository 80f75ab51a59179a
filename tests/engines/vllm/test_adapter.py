"""Directed checks of the vLLM adapter against vLLM 0.33's own behaviour (``specs/vllm.md``), each also
applied to the reference model, which must agree step by step."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from refcache.check.harness import Harness
from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.engines.vllm import VllmSystem
from refcache.errors import RefcacheError
from refcache.hicache.snapshot import NodeId
from refcache.systems import open_systems
from refcache.vllm.family import FAMILY as VLLM
from refcache.vllm.invariants import check_all
from refcache.vllm.ops import (
    Admit,
    AdmitResult,
    CompleteLoad,
    CompleteStore,
    Decode,
    EventKind,
    EventsResult,
    EvictBlocks,
    Free,
    HitResult,
    Load,
    LoadResult,
    Lookup,
    ResetPrefixCache,
    ResetResult,
    Store,
    StoreResult,
    TakeEvents,
    VllmObservation,
    VllmOp,
)
from refcache.vllm.snapshot import VllmSnapshot

# Block size 4, 9 usable blocks (scouting notes' setting); 19 offload chunks.
CONFIG = HiCacheConfig(page_size=4, device_size=36, layer_num=1)


@pytest.fixture
def harness() -> Iterator[Harness[VllmOp, VllmObservation, VllmSnapshot]]:
    with open_systems(("vllm-model", "vllm"), CONFIG, family=VLLM) as systems:
        yield Harness(CONFIG, systems, write_trace=False, family=VLLM)


def vllm_snapshot(harness: Harness[VllmOp, VllmObservation, VllmSnapshot]) -> VllmSnapshot:
    return harness.snapshots["vllm"]


def run(harness: Harness[VllmOp, VllmObservation, VllmSnapshot], op: VllmOp) -> VllmObservation:
    outcome = harness.step(op)
    assert not isinstance(outcome, RefcacheError), outcome
    return outcome


def test_free_order_hits_and_the_last_block_rule(
    harness: Harness[VllmOp, VllmObservation, VllmSnapshot],
) -> None:
    a = tuple(range(10))
    assert run(harness, Admit(1, a)) == AdmitResult(True, 0, (1, 2, 3))
    for token in (100, 101, 102):
        run(harness, Decode(1, token))
    run(harness, Free(1))
    snap = vllm_snapshot(harness)
    assert snap.free_queue == (4, 5, 6, 7, 8, 9, 3, 2, 1)  # unhashed first, hashed appended tail first
    assert run(harness, Admit(2, (*a[:8], 50, 51, 52))) == AdmitResult(True, 8, (1, 2, 4))
    assert run(harness, Lookup(a[:8])) == HitResult(4)  # a prompt of exactly k cached blocks hits k-1


def test_duplicates_are_not_merged_and_events_count_them(
    harness: Harness[VllmOp, VllmObservation, VllmSnapshot],
) -> None:
    run(harness, Admit(1, (7, 7, 7, 7, 7)))
    run(harness, Admit(2, (7, 7, 7, 7, 7)))  # hits 1's block: one block, ref_cnt 2
    run(harness, Admit(3, (7, 7, 7, 7)))  # hits nothing (k-1 rule) and caches a duplicate
    snap = vllm_snapshot(harness)
    key = NodeId("", (7, 7, 7, 7))
    assert dict(snap.cache_map)[key] == (1, 4)
    assert dict(snap.events_replayed)[key] == 2
    events = run(harness, TakeEvents())
    assert isinstance(events, EventsResult)
    assert [e.kind for e in events.events] == [EventKind.STORED, EventKind.STORED]


def test_full_pool_refuses_lazy_eviction_and_evict_blocks_on_a_block_in_use(
    harness: Harness[VllmOp, VllmObservation, VllmSnapshot],
) -> None:
    run(harness, Admit(1, tuple(range(16))))  # 4 blocks
    run(harness, Admit(2, tuple(range(100, 116))))  # 4 blocks
    assert run(harness, Admit(3, tuple(range(200, 208)))) == AdmitResult(False, 0, ())
    run(harness, Free(1))
    run(harness, Admit(3, tuple(range(200, 212))))  # 3 blocks: one free-clean, then cached ones evicted
    run(harness, EvictBlocks((5,)))  # held by request 2: loses its hash, keeps its count
    snap = vllm_snapshot(harness)
    assert snap.blocks[5].ref_cnt == 1 and snap.blocks[5].key is None
    assert run(harness, ResetPrefixCache()) == ResetResult(False)
    run(harness, Free(2))
    run(harness, Free(3))
    assert run(harness, ResetPrefixCache()) == ResetResult(True)
    assert vllm_snapshot(harness).cache_map == ()


def test_namespaces_never_share_a_hash(harness: Harness[VllmOp, VllmObservation, VllmSnapshot]) -> None:
    tokens = tuple(range(8))
    run(harness, Admit(1, tokens, lora="x"))
    run(harness, Admit(2, tokens, salt="x"))
    run(harness, Admit(3, tokens))
    assert run(harness, Lookup((*tokens, 9), salt="x")) == HitResult(8)
    snap = vllm_snapshot(harness)
    assert snap.hash_collisions == ()
    assert {k.namespace for k, _ in snap.cache_map} == {"lora=x", "salt=x", ""}


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU])
def test_offload_store_load_evict_and_failed_store(policy: EvictionPolicy) -> None:
    config = HiCacheConfig(
        page_size=2, device_size=20, hicache_ratio=1.0, radix_eviction_policy=policy, layer_num=1
    )
    with open_systems(("vllm-model", "vllm"), config, family=VLLM) as systems:  # 10 blocks, 11 chunks
        harness = Harness(config, systems, write_trace=False, family=VLLM)
        run(harness, Admit(1, tuple(range(9))))  # 4 full blocks
        stored = run(harness, Store(1))
        assert isinstance(stored, StoreResult) and len(stored.stored) == 4
        assert run(harness, Load(1)) == LoadResult(("hit_pending",), ())
        run(harness, CompleteStore())
        loaded = run(harness, Load(1))
        assert isinstance(loaded, LoadResult) and len(loaded.loading) == 4
        run(harness, Free(1))  # its load job stays queued
        run(harness, Admit(2, tuple(range(50, 67))))  # 8 full blocks
        refused = run(harness, Store(2))  # 8 chunks, 7 free, the other 4 pinned
        assert refused == StoreResult(False, (), ())
        run(harness, CompleteLoad())
        evicting = run(harness, Store(2))
        assert isinstance(evicting, StoreResult) and len(evicting.evicted) == 1
        run(harness, CompleteStore(success=False))
        off = vllm_snapshot(harness).offload
        assert off is not None and off.num_write_pending == 0 and len(off.free_list) == 8


def test_double_free_is_accepted_silently_by_vllm() -> None:
    """The issue's note: ``free_blocks([b, b])`` on a block held once leaves ``ref_cnt == -1`` with the block
    queued once; vLLM itself raises nothing, the vLLM invariants report it at once."""
    system = VllmSystem(CONFIG)
    system.apply(Admit(1, (1, 2, 3)))
    pool = system.manager.block_pool
    block = pool.blocks[1]
    pool.free_blocks([block, block])
    system.running.clear()
    found = {v.invariant for v in check_all(system.snapshot())}
    assert block.ref_cnt == -1
    assert {"LOCKS", "DEVICE-CONSERVATION", "SIZE-ACCOUNTING", "FREE-QUEUE"} <= found


def test_two_groups_touch_every_hit_before_external_blocks() -> None:
    """#33775 / PR #44409 on vLLM's own coordinator: request 4's group-1 hit (block 3) is the free queue's head
    once group 0's hit is touched. vLLM 0.33 touches both groups' hits first, so group 0's block for the
    external token is block 5; with the loops fused again (the zoo's patch) group 0 takes block 3 and the
    GROUP-DISJOINT invariant reports vLLM's own snapshot."""
    from .zoo import ZOO

    config = HiCacheConfig(page_size=2, device_size=12, layer_num=2)  # 6 blocks shared by two groups
    ops: list[VllmOp] = [Admit(1, (1, 2, 3)), Admit(2, (7, 7)), Free(1), Free(2), Admit(3, (9,))]
    last = Admit(4, (1, 2, 3, 4), external=1)
    with open_systems(("vllm-model", "vllm"), config, family=VLLM) as systems:
        harness = Harness(config, systems, write_trace=False, family=VLLM)
        for op in ops:
            run(harness, op)
        assert vllm_snapshot(harness).free_queue == (1, 3, 5, 6)
        assert run(harness, last) == AdmitResult(True, 2, (1, 5))
        assert vllm_snapshot(harness).requests[-1].group_tables == ((3, 6),)
    bug = next(b for b in ZOO if b.slug == "group-evicts-group-hit")
    system = VllmSystem(config)
    with bug.applied():
        for op in (*ops, last):
            system.apply(op)
    found = {v.invariant for v in check_all(system.snapshot())}
    assert system.snapshot().requests[-1].table == (1, 3)
    assert {"GROUP-DISJOINT", "HASH-CHAIN"} <= found
