"""The LMCache reference model's directed behaviours: every scenario keeps its promise, the allocator and the
policies do what LMCache's do, and each decision of specs/lmcache-model.md (L-xx) shows in a short run. Also
the model's speed (ops/second, printed)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence

import pytest

from refcache.config import EvictionPolicy
from refcache.errors import UsageError
from refcache.family import NodeId
from refcache.lmcache._parts import Allocator, Policy
from refcache.lmcache.config import CachePolicy
from refcache.lmcache.family import FAMILY
from refcache.lmcache.model import LMCacheModel
from refcache.lmcache.ops import (
    Clear,
    ClearResult,
    FaultKind,
    LMCacheObservation,
    LMCacheOp,
    Lookup,
    LookupResult,
    LookupUnpin,
    PollPrefetch,
    Prefetch,
    PrefetchResult,
    Queue,
    Retrieve,
    RetrieveResult,
    Step,
    StorageFault,
    Store,
    StoreResult,
    Tier,
)
from refcache.lmcache.scenarios import A, B, C, config
from refcache.lmcache.snapshot import LMCacheSnapshot


def k(*tokens: int) -> NodeId:
    return NodeId("", tokens)


def run(model: LMCacheModel, ops: Sequence[LMCacheOp]) -> list[LMCacheObservation]:
    """Apply ``ops``, checking every invariant after each step; the outcomes."""
    out = []
    before = model.snapshot()
    for op in ops:
        out.append(model.apply(op))
        after = model.snapshot()
        assert FAMILY.check(after) == [] and FAMILY.check_step(before, after, op) == [], op
        before = after
    return out


def hit(result: LMCacheObservation) -> int:
    assert isinstance(result, LookupResult | RetrieveResult)
    return result.hit if isinstance(result, LookupResult) else result.retrieved


PROMISES: dict[str, Callable[[list[LMCacheObservation]], bool]] = {
    "store-lookup-retrieve": lambda o: [hit(x) for x in o[1:4]] == [8, 8, 8] and o[4] == StoreResult(8)
    and hit(o[5]) == 12,
    "cpu-eviction-order": lambda o: [hit(x) for x in o[5:]] == [8, 0, 8],
    "mru-evicts-newest": lambda o: [hit(x) for x in o[2:]] == [4, 8],
    "pinned-survives-pressure": lambda o: o[2] == StoreResult(4) and o[5] == StoreResult(8) and hit(o[7]) == 4,
    "disk-write-through-and-promotion": lambda o: hit(o[4]) == 8 and hit(o[5]) == 8,
    "write-in-flight": lambda o: o[1] == ClearResult(0) and hit(o[2]) == 8 and hit(o[7]) == 8,
    "remote-put-and-read": lambda o: o[1] == ClearResult(0) and o[4] == ClearResult(8)
    and [hit(x) for x in (o[2], o[5], o[6], o[7])] == [8, 8, 8, 8],
    "async-prefetch": lambda o: o[4] == PrefetchResult(False, 0) and o[6] == PrefetchResult(True, 8)
    and hit(o[7]) == 8,
    "damaged-file-is-a-miss": lambda o: hit(o[5]) == 4 and hit(o[10]) == 0,
}  # fmt: skip


def test_every_scenario_is_named_once_and_has_a_promise() -> None:
    names = [s.name for s in FAMILY.scenarios()]
    assert len(set(names)) == len(names) and set(names) == set(PROMISES) and len(names) >= 5


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_scenarios_hold_on_the_model_and_keep_their_promise(name: str) -> None:
    scenario = next(s for s in FAMILY.scenarios() if s.name == name)
    assert PROMISES[name](run(LMCacheModel(scenario.config), scenario.ops))


def test_allocator_is_first_fit_and_coalesces() -> None:
    a = Allocator(4 * 4096)
    objs = [a.allocate(100, 1, k(i)) for i in range(4)]
    assert [o.address for o in objs if o] == [0, 4096, 8192, 12288] and a.allocate(1, 1, k(9)) is None
    assert objs[1] is not None and objs[2] is not None and objs[0] is not None
    a.free(objs[1])
    a.free(objs[2])
    assert a.free_list == [(4096, 8192)]  # coalesced with its successor
    big = a.allocate(5000, 2, k(5))  # two aligned units, first fit
    assert big is not None and (big.address, big.size) == (4096, 8192) and a.free_list == []
    a.free(objs[0])
    a.free(big)
    assert a.free_list == [(0, 12288)] and a.allocated == 4096


@pytest.mark.parametrize(
    ("kind", "order"),
    [
        (CachePolicy.LRU, ["b", "c", "a"]),
        (CachePolicy.FIFO, ["a", "b", "c"]),
        (CachePolicy.MRU, ["a", "c", "b"]),
        (CachePolicy.LFU, ["b", "c", "a"]),
    ],
)
def test_policies_scan_in_their_order(kind: CachePolicy, order: list[str]) -> None:
    policy = Policy(kind)
    mapping: dict[NodeId, int] = {}
    names = {"a": k(1), "b": k(2), "c": k(3)}
    for key in names.values():
        mapping[key] = 0
        policy.on_put(key)
    policy.on_hit(names["a"], mapping)
    assert policy.order(mapping) == [names[n] for n in order]
    first = policy.candidate(mapping, lambda key: key != names[order[0]])  # the first candidate is pinned
    assert first == names[order[1]]


def test_store_reallocates_cached_chunks_and_can_evict_them() -> None:
    """L-02: a store allocates a fresh object for every chunk, cached ones included; with a full CPU tier the
    allocations evict the very chunks being stored again, which come back as the most recent entries (a store
    of cached chunks with room to spare leaves the policy order alone)."""
    model = LMCacheModel(config(3))
    run(model, [Store(A), Store((9, 9, 9, 9))])
    order = [e.key for e in model.snapshot().cpu.entries]
    assert order == [k(*A[:4]), k(*A), k(9, 9, 9, 9)]
    assert run(model, [Store(A), Lookup(A)]) == [StoreResult(8), LookupResult(8)]
    assert [e.key for e in model.snapshot().cpu.entries] == [k(9, 9, 9, 9), k(*A[:4]), k(*A)]
    roomy = LMCacheModel(config(5))
    run(roomy, [Store(A), Store((9, 9, 9, 9)), Store(A)])
    assert [e.key for e in roomy.snapshot().cpu.entries] == order


def test_a_read_that_finds_no_cpu_room_is_a_miss_not_a_wait() -> None:
    """L-05: the CPU tier full of objects disk writes still hold; a disk hit cannot get a buffer. LMCache
    busy-waits for ever there (``allocate(busy_loop=True)``); the model answers a miss."""
    model = LMCacheModel(config(2, disk_chunks=4))
    run(model, [Store(A), Step(Queue.DISK, 2), Store(B)])  # B's two writes are in flight and hold the CPU
    assert run(model, [Lookup(A), Retrieve(A)]) == [LookupResult(8), RetrieveResult(0)]


def test_a_forced_remove_gives_disk_bytes_back() -> None:
    """L-07: ``Clear(tokens)`` removes a published file and its reservation."""
    model = LMCacheModel(config(2, disk_chunks=2))
    run(model, [Store(A), Step(Queue.DISK, 2), Clear(A)])
    disk = model.snapshot().disk
    assert disk is not None and (disk.entries, disk.reserved, disk.usage) == ((), 0, 0)
    run(model, [Store(B), Step(Queue.DISK, 2), Clear(), Lookup(B)])
    assert model.apply(Lookup(B)) == LookupResult(8)


def test_pinned_disk_files_are_not_evicted_and_a_full_disk_refuses_writes() -> None:
    model = LMCacheModel(config(2, disk_chunks=2))
    run(model, [Store(A), Step(Queue.DISK, 2), Clear(), Lookup(A, 1, pin=True), Store(B)])
    disk = model.snapshot().disk
    assert disk is not None and disk.jobs == () and [e.pin_count for e in disk.entries] == [1, 1]
    run(model, [LookupUnpin(1), Clear(), Store(B), Step(Queue.DISK, 2)])
    disk = model.snapshot().disk
    assert disk is not None and [e.key for e in disk.entries] == [k(*B[:4]), k(*B)]


def test_lfu_skips_a_write_in_flight() -> None:
    """L-10: under LFU the disk policy knows a key from its admission on; eviction skips it until the write
    publishes it (LMCache 0.5.6 looks the key up in the tier's mapping there and raises KeyError)."""
    model = LMCacheModel(config(4, disk_chunks=2, policy=EvictionPolicy.LFU))
    p, q, z = (1, 2, 3, 4), (5, 6, 7, 8), (9, 9, 9, 9)
    run(model, [Store(p), Store(q), Step(Queue.DISK), Store(p)])  # p published and hit (freq 2); q in flight
    run(model, [Store(z)])  # the scan meets q (freq 1, not published) first, skips it and evicts p
    disk = model.snapshot().disk
    assert disk is not None and disk.entries == () and disk.pending_puts == (k(*q), k(*z))


def test_failed_write_and_failed_read() -> None:
    model = LMCacheModel(config(2, disk_chunks=4, remote=True))
    ops: list[LMCacheOp] = [
        StorageFault(Tier.DISK, FaultKind.FAIL_NEXT_WRITE),
        StorageFault(Tier.REMOTE, FaultKind.FAIL_NEXT_WRITE),
        Store(A),
        Step(Queue.DISK, 2),
        Step(Queue.REMOTE, 2),
        Clear(),
        Lookup(A),
    ]
    assert run(model, ops)[-1] == LookupResult(0)  # the first chunk's writes failed everywhere
    snap = model.snapshot()
    assert snap.disk is not None and snap.disk.reserved == 4096 and snap.remote is not None
    assert snap.remote.keys == (k(*A),)
    assert run(model, [StorageFault(Tier.REMOTE, FaultKind.DELETE), Retrieve(A)])[-1] == RetrieveResult(0)


def test_prefetch_across_tiers_and_its_release() -> None:
    model = LMCacheModel(config(4, disk_chunks=4, remote=True, async_loading=True))
    run(model, [Store(A), Step(Queue.DISK, 2), Step(Queue.REMOTE, 2), Clear()])
    run(model, [Store((*A[:4], 9, 9, 9, 9))])  # the first chunk back in CPU
    out = run(model, [Prefetch(A, 1, pin=True), PollPrefetch(1), Step(Queue.DISK), PollPrefetch(1)])
    assert out[1] == PrefetchResult(False, 0) and out[3] == PrefetchResult(True, 8)
    snap = model.snapshot()
    assert [len(p.loaded) for p in snap.prefetches] == [2]
    assert run(model, [LookupUnpin(1)]) and model.snapshot().prefetches == ()
    assert all(o.pin_count == 0 for o in model.snapshot().cpu.objects)


def test_a_prefetch_with_no_hit_answers_at_once_and_a_retrieve_needs_an_answer() -> None:
    model = LMCacheModel(config(4, disk_chunks=4, async_loading=True))
    assert run(model, [Prefetch(A, 1), PollPrefetch(1)])[-1] == PrefetchResult(True, 0)
    with pytest.raises(UsageError, match="answered with a hit"):  # L-16: LMCache registered no event for it
        model.apply(Retrieve(A, lookup_id=1))
    run(model, [Store(B), Step(Queue.DISK, 2), Clear(), Prefetch(B, 2)])
    with pytest.raises(UsageError, match="has answered"):
        model.apply(Retrieve(B, lookup_id=2))
    assert run(model, [Step(Queue.DISK), Retrieve(B, lookup_id=2)])[-1] == RetrieveResult(8)


def test_refused_operations_change_nothing() -> None:
    model = LMCacheModel(config(2, disk_chunks=2))
    run(model, [Store(A), Lookup(A, 1, pin=True)])
    before = model.snapshot()
    for op in (Lookup(A, 1, pin=True), Step(Queue.REMOTE), Store(A, skip=3), Prefetch(A, 2), PollPrefetch(3)):
        with pytest.raises(UsageError):
            model.apply(op)
        assert model.snapshot() == before


def test_unfull_chunks_are_stored_when_configured() -> None:
    model = LMCacheModel(config(4, save_unfull_chunk=True))
    assert run(model, [Store((*A, 1)), Lookup((*A, 1)), Lookup(A)]) == [
        StoreResult(9),
        LookupResult(9),
        LookupResult(8),
    ]
    assert LMCacheModel(config(4)).apply(Store((*A, 1))) == StoreResult(8)


def test_the_model_is_deterministic_and_fast() -> None:
    ops: list[LMCacheOp] = []
    for i in range(300):
        tokens = (*(A if i % 2 else B), i % 7, i % 5, 1, 2)
        ops += [
            Store(tokens),
            Lookup(tokens, i, pin=True),
            Retrieve(tokens, 0, i),
            LookupUnpin(i),
            Step(Queue.DISK),
        ]
        ops += [Lookup(C)] if i % 3 else [Clear(tokens)]
    snaps: list[LMCacheSnapshot] = []
    seconds = 0.0
    for _ in range(2):
        model = LMCacheModel(config(6, disk_chunks=8))
        start = time.perf_counter()
        for op in ops:
            with contextlib.suppress(UsageError):
                model.apply(op)
        seconds = time.perf_counter() - start
        snaps.append(model.snapshot())
    print(f"lmcache-model: {len(ops) / seconds:,.0f} ops/s ({len(ops)} ops, no snapshots)")
    assert snaps[0] == snaps[1]
