"""Every invariant of the vLLM family holds on real model snapshots and fails on a broken copy.

The healthy snapshot comes from driving ``VllmModel`` (block size 2, 10 usable blocks, LRU offload) into a
state with shared, cached-free and clean-free blocks, a LoRA request, a queued store and a queued load.
Each case breaks one clause with ``dataclasses.replace`` and names which invariant IDs must report it; a
new invariant without a case fails ``test_every_invariant_has_a_failing_case``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cache

import pytest

from refcache.check.harness import Harness
from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.errors import UsageError
from refcache.hicache.snapshot import NodeId
from refcache.vllm.family import FAMILY as VLLM
from refcache.vllm.family import TRACES, diff_vllm_snapshots
from refcache.vllm.invariants import (
    INVARIANTS,
    NOT_APPLICABLE,
    STEP_INVARIANTS,
    check_all,
    check_step,
    step_removal,
    step_store_keeps_offer,
)
from refcache.vllm.model import VllmModel
from refcache.vllm.ops import (
    OPS,
    Admit,
    CompleteLoad,
    CompleteStore,
    Decode,
    EvictBlocks,
    Free,
    Load,
    Lookup,
    ResetPrefixCache,
    Store,
    TakeEvents,
    VllmOp,
    op_from_json,
    op_to_json,
)
from refcache.vllm.snapshot import VllmSnapshot

CONFIG = HiCacheConfig(
    page_size=2, device_size=20, hicache_ratio=1.5, radix_eviction_policy=EvictionPolicy.LRU, layer_num=1
)
A = (1, 2, 3, 4, 5)

SETUP: tuple[VllmOp, ...] = (
    Admit(1, A),
    Store(1),
    CompleteStore(),
    Admit(2, (1, 2, 3, 4, 9)),  # hits 2 blocks of request 1
    Free(1),
    Admit(4, (8, 8, 8)),
    Free(4),  # leaves a FREE-CACHED block
    Admit(3, (7, 7, 7), lora="x"),
    Decode(3, 7),
    Admit(5, (1, 2, 3, 4, 6)),  # shares request 2's blocks
    Store(3),  # queued
    Load(2),  # queued, pins A's first chunks
)


# Two full-attention KV cache groups sharing 12 usable blocks; request 3 hits request 1's first block in both
# groups and takes two blocks per group for external tokens.
CONFIG2 = HiCacheConfig(page_size=2, device_size=24, hicache_ratio=1.0, layer_num=2)
SETUP2: tuple[VllmOp, ...] = (
    Admit(1, A),
    Admit(2, (7, 7)),
    Free(1),
    Admit(3, (1, 2, 8, 8, 8, 8, 8), external=4),
    Decode(3, 8),
)


@cache
def healthy(config: HiCacheConfig = CONFIG, setup: tuple[VllmOp, ...] = SETUP) -> VllmSnapshot:
    model = VllmModel(config)
    before = model.snapshot()
    for op in setup:
        model.apply(op)
        after = model.snapshot()
        assert check_all(after) == [] and check_step(before, after, op) == [], op
        before = after
    return model.snapshot()


def _block(snap: VllmSnapshot, block_id: int, **changes: object) -> VllmSnapshot:
    blocks = list(snap.blocks)
    blocks[block_id] = replace(blocks[block_id], **changes)  # type: ignore[arg-type]
    return replace(snap, blocks=tuple(blocks))


def _request(snap: VllmSnapshot, index: int, **changes: object) -> VllmSnapshot:
    requests = list(snap.requests)
    requests[index] = replace(requests[index], **changes)  # type: ignore[arg-type]
    return replace(snap, requests=tuple(requests))


def _offload(snap: VllmSnapshot, **changes: object) -> VllmSnapshot:
    assert snap.offload is not None
    return replace(snap, offload=replace(snap.offload, **changes))  # type: ignore[arg-type]


def _used(snap: VllmSnapshot) -> int:
    return next(b.id for b in snap.blocks if b.ref_cnt > 0)


def _free_cached(snap: VllmSnapshot) -> int:
    return next(b.id for b in snap.blocks if b.ref_cnt == 0 and b.key is not None and b.id)


CASES: dict[str, tuple[Callable[[VllmSnapshot], VllmSnapshot], set[str]]] = {
    "wrong request hash": (
        lambda s: _request(s, 0, keys=(NodeId("", (9, 9)), *s.requests[0].keys[1:])),
        {"HASH-CHAIN"},
    ),
    "table block holds another content": (
        lambda s: _block(s, s.requests[0].table[0], key=NodeId("", (9, 9))),
        {"HASH-CHAIN", "BLOCK-SHAPE"},
    ),
    "negative ref_cnt of a queued block (double free)": (
        lambda s: _block(s, s.free_queue[0], ref_cnt=-1),
        {"LOCKS", "DEVICE-CONSERVATION", "SIZE-ACCOUNTING", "FREE-QUEUE"},
    ),
    "idle with a block held": (
        lambda s: replace(
            _block(s, s.free_queue[0], ref_cnt=1),
            requests=(),
            free_queue=s.free_queue[1:],
            free_queue_backward=tuple(reversed(s.free_queue[1:])),
            num_free=s.num_free - 1,
        ),
        {"IDLE-DRAINED", "LOCKS"},
    ),
    "a queued block in use": (
        lambda s: replace(
            s, free_queue=(*s.free_queue, _used(s)), free_queue_backward=(_used(s), *s.free_queue_backward)
        ),
        {"DEVICE-CONSERVATION", "SIZE-ACCOUNTING", "FREE-QUEUE"},
    ),
    "counter drift": (lambda s: replace(s, num_free=s.num_free + 1), {"SIZE-ACCOUNTING"}),
    "broken backward link": (
        lambda s: replace(s, free_queue_backward=s.free_queue_backward[1:]),
        {"FREE-QUEUE"},
    ),
    "queued twice": (
        lambda s: replace(
            s,
            free_queue=(*s.free_queue, s.free_queue[0]),
            free_queue_backward=(s.free_queue[0], *s.free_queue_backward),
            num_free=s.num_free + 1,
        ),
        {"FREE-QUEUE", "SIZE-ACCOUNTING"},
    ),
    "partial block hashed": (
        lambda s: replace(
            _block(s, _free_cached(s), key=NodeId("", (1,))),
            cache_map=tuple(
                sorted(
                    [
                        *(e for e in s.cache_map if _free_cached(s) not in e[1]),
                        (NodeId("", (1,)), (_free_cached(s),)),
                    ]
                )
            ),
        ),
        {"BLOCK-SHAPE", "EVENTS-REPLAY"},
    ),
    "null block hashed": (lambda s: _block(s, 0, key=NodeId("", (1, 2))), {"BLOCK-SHAPE"}),
    "a block twice in a table": (
        lambda s: _request(s, 0, table=(*s.requests[0].table, s.requests[0].table[0])),
        {"NO-DUP-IN-TABLE", "LOCKS"},
    ),
    "event lost": (lambda s: replace(s, events_replayed=s.events_replayed[1:]), {"EVENTS-REPLAY"}),
    "hit of the whole prompt": (
        lambda s: _request(s, 0, hit_tokens=s.requests[0].prompt_len + 1),
        {"HIT-BOUND"},
    ),
    "hash collision": (
        lambda s: replace(s, hash_collisions=("a and b share one block hash",)),
        {"NAMESPACE"},
    ),
    "write-pending chunk without a store": (lambda s: _offload(s, pending_stores=()), {"IN-FLIGHT"}),
    "pinned chunk without a load": (lambda s: _offload(s, pending_loads=()), {"IN-FLIGHT"}),
    "chunk counter drift": (
        lambda s: _offload(s, num_evictable=s.offload.num_evictable + 1 if s.offload else 0),
        {"HOST-CONSERVATION"},
    ),
    "chunk id reused while held": (
        lambda s: _offload(
            s,
            free_list=(s.offload.chunks[0].chunk_id,) if s.offload else (),
            num_allocated=(s.offload.num_allocated + 1) if s.offload else 0,
        ),
        {"HOST-CONSERVATION"},
    ),
    "policy misses a chunk": (
        lambda s: _offload(s, recency=s.offload.recency[1:] if s.offload else ()),
        {"HOST-CONSERVATION"},
    ),
    "a ghost of a resident chunk": (
        lambda s: _offload(s, ghosts=((s.offload.chunks[0].key,) if s.offload else (), ())),
        {"OFFLOAD-POLICY"},
    ),
    "a ghost list over capacity": (
        lambda s: _offload(
            s,
            ghosts=(
                (),
                tuple(NodeId("", (90, i)) for i in range(s.offload.capacity + 1)) if s.offload else (),
            ),
        ),
        {"OFFLOAD-POLICY"},
    ),
    "a key in both ghost lists": (
        lambda s: _offload(s, ghosts=((NodeId("", (90, 91)),), (NodeId("", (90, 91)),))),
        {"OFFLOAD-POLICY"},
    ),
    "target size beyond capacity": (
        lambda s: _offload(s, target_recent=s.offload.capacity + 0.5 if s.offload else 0.0),
        {"OFFLOAD-POLICY"},
    ),
}


def _group_table(snap: VllmSnapshot, index: int, table: tuple[int, ...]) -> VllmSnapshot:
    return _request(snap, index, group_tables=(table,))


CASES2: dict[str, tuple[Callable[[VllmSnapshot], VllmSnapshot], set[str]]] = {
    "group 1 holds group 0's hit block (#33775)": (
        lambda s: _group_table(s, 1, (s.requests[1].table[0], *s.requests[1].group_tables[0][1:])),
        {"GROUP-DISJOINT", "LOCKS", "HASH-CHAIN"},
    ),
    "group 1's hashed block holds a group-0 key": (
        lambda s: _block(s, s.requests[1].group_tables[0][0], key=NodeId("", (1, 2))),
        {"GROUP-DISJOINT", "HASH-CHAIN", "BLOCK-SHAPE"},
    ),
    "groups out of step": (
        lambda s: _request(s, 1, group_num_cached=(s.requests[1].num_cached - 1,)),
        {"GROUPS-ALIGNED"},
    ),
}


def healthy2() -> VllmSnapshot:
    return healthy(CONFIG2, SETUP2)


def test_two_group_snapshot_shares_a_hit_in_both_groups() -> None:
    snap = healthy2()
    (two, three) = snap.requests
    assert two.rid == 2 and three.rid == 3 and three.hit_tokens == 2
    assert len(three.table) == len(three.group_tables[0]) == 4
    assert {k.namespace for k, _ in snap.cache_map} == {"", "group=1"}
    assert all(check_all(healthy(CONFIG2, SETUP2[:i])) == [] for i in range(len(SETUP2)))


@pytest.mark.parametrize("case", sorted(CASES2))
def test_group_invariant_fails_on_broken_two_group_snapshot(case: str) -> None:
    breaks, expected = CASES2[case]
    found = {v.invariant for v in check_all(breaks(healthy2()))}
    assert found == expected, case


def test_healthy_snapshot_fills_every_structure() -> None:
    snap = healthy()
    assert snap.offload is not None and snap.offload.pending_stores and snap.offload.pending_loads
    assert any(b.ref_cnt > 1 for b in snap.blocks)  # shared by a hit
    assert any(b.ref_cnt == 0 and b.key is not None for b in snap.blocks[1:])  # FREE-CACHED
    assert {r.namespace for r in snap.requests} == {"", "lora=x"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_invariant_fails_on_broken_snapshot(case: str) -> None:
    breaks, expected = CASES[case]
    found = {v.invariant for v in check_all(breaks(healthy()))}
    assert found == expected, case


def test_every_invariant_has_a_failing_case() -> None:
    ids = {fn.__doc__.split(":")[0] for fn in INVARIANTS if fn.__doc__}
    covered = {i for _, expected in (*CASES.values(), *CASES2.values()) for i in expected}
    assert ids == covered
    assert set(NOT_APPLICABLE) == {"EVICTED-SUFFIX", "EVICTED-BACKUPED", "BACKUP-CONTIGUITY", "RANKS-EQUAL"}


def test_step_removal_fails_on_a_shrunk_table_and_a_lost_hash() -> None:
    step = step_removal
    snap = healthy()
    shrunk = _request(snap, 0, table=snap.requests[0].table[:-1])
    assert {v.invariant for v in step(snap, shrunk, TakeEvents())} == {"STEP-REMOVAL"}
    used = next(b for b in snap.blocks if b.ref_cnt > 0 and b.key is not None)
    lost = _block(snap, used.id, key=None)
    assert {v.invariant for v in step(snap, lost, TakeEvents())} == {"STEP-REMOVAL"}
    assert step(snap, lost, EvictBlocks((used.id,))) == []


def test_store_keeps_offer_fails_when_a_store_evicts_its_own_chunk() -> None:
    """A store that evicted a chunk of its own offer (the zoo's store-evicts-own-offer) breaks
    STORE-KEEPS-OFFER; losing a chunk it does not offer, or any chunk on another operation, does not."""
    assert (step_removal, step_store_keeps_offer) == STEP_INVARIANTS
    snap = healthy()
    assert snap.offload is not None
    request = snap.requests[0]
    offered = set(request.keys[: request.num_computed // snap.block_size])
    own = next(c for c in snap.offload.chunks if c.key in offered)
    other = next(c for c in snap.offload.chunks if c.key not in offered)

    def without(key: NodeId) -> VllmSnapshot:
        return _offload(
            snap, chunks=tuple(c for c in snap.offload.chunks if c.key != key) if snap.offload else ()
        )

    found = step_store_keeps_offer(snap, without(own.key), Store(request.rid))
    assert {v.invariant for v in found} == {"STORE-KEEPS-OFFER"} and found[0].node == own.key
    assert step_store_keeps_offer(snap, without(other.key), Store(request.rid)) == []
    assert step_store_keeps_offer(snap, without(own.key), TakeEvents()) == []
    assert step_store_keeps_offer(snap, snap, Store(request.rid)) == []


def test_codec_round_trips_and_reprs_replay() -> None:
    ops: list[VllmOp] = [*SETUP, Lookup((1, 2), salt="s"), EvictBlocks((0, 3)), ResetPrefixCache(), TakeEvents(),
                         CompleteStore(success=False), CompleteLoad()]  # fmt: skip
    assert {type(op) for op in ops} == set(OPS)
    for op in ops:
        assert op_from_json(op_to_json(op)) == op
        assert eval(repr(op)) == op
    text = TRACES.dumps(CONFIG, ops)
    assert VLLM.is_trace(text)
    assert TRACES.loads(text) == (CONFIG, ops)


def test_harness_takes_the_family() -> None:
    with VllmModel(CONFIG) as a, VllmModel(CONFIG) as b:
        harness = Harness(CONFIG, {"vllm-model": a, "copy": b}, write_trace=False, family=VLLM)
        for op in SETUP:
            harness.step(op)
        assert '"family": "vllm"' in harness.trace_text()
    snap = healthy()
    assert diff_vllm_snapshots(snap, replace(snap, num_free=0)) == [
        f"snapshot.num_free: vllm-model={snap.num_free} vllm=0"
    ]


def test_preconditions_refuse_without_changing_anything() -> None:
    model = VllmModel(CONFIG)
    before = model.snapshot()
    for op in (
        Decode(1, 0),
        Free(1),
        Store(1),
        CompleteStore(),
        CompleteLoad(),
        EvictBlocks((99,)),
        Admit(1, ()),
        Admit(1, (1,), external=-1),
    ):
        with pytest.raises(UsageError):
            model.apply(op)
    assert model.snapshot() == before
