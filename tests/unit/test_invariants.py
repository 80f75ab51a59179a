"""Every invariant of ``refcache.hicache.invariants`` holds on real model snapshots and fails on a broken copy.

The healthy snapshots come from driving ``HiCacheModel`` (2 ranks, page size 2, write_through, file
L3) into a state where every in-flight table is filled: host-only nodes, a running load back, a pending
write-through, an L3 backup of a node split while pending (D-07), a prefetch awaiting its hit query, a
device-only chunked insert and two running requests. Each case then breaks one clause of one invariant
with ``dataclasses.replace`` and names exactly which invariant IDs must report it, so a check that
stops firing, or starts firing on something else, fails here. A new invariant without a case fails
``test_every_invariant_has_a_failing_case``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import cache

import pytest

from refcache.config import HiCacheConfig, WritePolicy
from refcache.hashing import page_hashes, storage_namespace_seed
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.invariants import INVARIANTS, STEP_INVARIANTS, check_all, check_step
from refcache.hicache.ops import (
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    StartRequest,
)
from refcache.hicache.snapshot import (
    InFlight,
    NodeId,
    NodeRecord,
    PoolRecord,
    PrefetchRecord,
    RankSnapshot,
    Snapshot,
)
from refcache.hicache.states import NodeState
from refcache.model import HiCacheModel

PS = 2
A = (1, 2, 3, 4, 5, 6, 7, 8)
B = (1, 2, 3, 4, 9, 10, 11, 12)

# Node names in the live snapshot (identical on both ranks).
LOADING = NodeId("", A[:6])  # BOTH, lock_ref 2: load-back destination, locked by request 3
ANCHOR = NodeId("", A)  # HOST leaf below LOADING: the running prefetch's anchor (host_ref_counter 1)
CHUNKED = NodeId("", (30, 31, 32, 33))  # DEVICE: chunked insert of running request 4 (lock_ref 1)
WRITING = NodeId("", (40, 41, 42, 43))  # BOTH, lock_ref 1: write-through pending
NS_TOP = NodeId("lora-a", B[:6])  # BOTH: prefix fragment of a node split during its L3 backup
NS_LEAF = NodeId("lora-a", B)  # BOTH leaf: the other fragment of that backup (host_ref_counter 1)


class Driver:
    """Applies operations and checks every state and step invariant after each one."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.model = HiCacheModel(config)
        self.before = self.model.snapshot()
        self.steps: list[tuple[Snapshot, Snapshot]] = []

    def run(self, *ops: Op) -> None:
        for op in ops:
            self.model.apply(op)
            after = self.model.snapshot()
            violations = check_all(after) + check_step(self.before, after)
            assert violations == [], f"after {op!r}: {[str(v) for v in violations]}"
            self.steps.append((self.before, after))
            self.before = after

    def everywhere(self, *queues: IOQueue) -> None:
        for queue in queues:
            self.run(*(CompleteIO(queue, rank, 16) for rank in range(self.model.config.tp_size)))


def _config() -> HiCacheConfig:
    return HiCacheConfig(
        tp_size=2,
        page_size=PS,
        device_size=32,
        hicache_ratio=3.0,
        hicache_storage_backend="file",
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        prefetch_threshold=2,
        load_back_threshold=1,
    )


def _drive_live() -> Driver:
    d = Driver(_config())
    # A goes L1 -> L2 -> L3, then leaves L1: a host-only node.
    d.run(StartRequest(1, A), FinishRequest(1))
    d.everywhere(IOQueue.WRITE)
    d.run(CheckHicacheEvents())
    d.everywhere(IOQueue.BACKUP)
    d.run(CheckHicacheEvents(), Evict(len(A)))
    # B (namespaced) is written to L2; its L3 backup is pending when a match splits it (D-07).
    d.run(StartRequest(2, B, "lora-a"), FinishRequest(2))
    d.everywhere(IOQueue.WRITE)
    d.run(CheckHicacheEvents(), MatchPrefix(B[:6], "lora-a"))
    # Request 3 hits A[:6] on the host: split + load back, left running.
    d.run(StartRequest(3, (*A[:6], 20, 21)))
    # Request 4 caches a chunk (device only: chunked inserts never count hits) and keeps running.
    d.run(StartRequest(4, (30, 31, 32, 33, 34)), CacheUnfinishedRequest(4))
    # Request 5 finishes: its node's write-through is pending.
    d.run(StartRequest(5, (40, 41, 42, 43)), FinishRequest(5))
    # A prefetch of A's continuation, anchored at A's host-only tail, awaits its hit query.
    d.run(PrefetchFromStorage(6, (*A, 50, 51, 52, 53)))
    return d


@cache
def live() -> Snapshot:
    """A healthy snapshot with every in-flight table filled."""
    return _drive_live().model.snapshot()


@cache
def live_steps() -> tuple[tuple[Snapshot, Snapshot], ...]:
    return tuple(_drive_live().steps)


@cache
def drained() -> Snapshot:
    """A healthy snapshot of the same cache once idle and drained (what IDLE-DRAINED speaks about)."""
    d = _drive_live()
    d.run(FinishRequest(3), FinishRequest(4))
    for _ in range(3):
        d.everywhere(*IOQueue)
        d.run(CheckHicacheEvents(), CheckPrefetchProgress(6))
    return d.model.snapshot()


@cache
def two_loads() -> Snapshot:
    """A healthy snapshot with two loads in flight on every rank, the older one finished (the load stream
    retires its copies oldest first), neither retired yet."""
    d = Driver(_config())
    c = (60, 61, 62, 63)
    d.run(StartRequest(1, A), FinishRequest(1), StartRequest(2, c), FinishRequest(2))
    d.everywhere(IOQueue.WRITE)
    d.run(CheckHicacheEvents(), Evict(len(A) + len(c)))
    d.run(StartRequest(3, (*A, 20)), StartRequest(4, (*c, 21)))
    d.run(*(CompleteIO(IOQueue.LOAD, rank, 1) for rank in range(d.model.config.tp_size)))
    return d.model.snapshot()


# --- editing helpers (every edit applies to every rank unless told otherwise) ----------------------------


def edit_ranks(
    snap: Snapshot, edit: Callable[[RankSnapshot], RankSnapshot], ranks: tuple[int, ...] | None = None
) -> Snapshot:
    return replace(snap, ranks=tuple(edit(r) if ranks is None or r.rank in ranks else r for r in snap.ranks))


def edit_node(
    snap: Snapshot, node_id: NodeId, ranks: tuple[int, ...] | None = None, **changes: object
) -> Snapshot:
    def edit(rank: RankSnapshot) -> RankSnapshot:
        assert rank.node(node_id) is not None, node_id
        nodes = tuple(replace(n, **changes) if n.id == node_id else n for n in rank.nodes)  # type: ignore[arg-type]
        return replace(rank, nodes=nodes)

    return edit_ranks(snap, edit, ranks)


def drop_node(snap: Snapshot, node_id: NodeId) -> Snapshot:
    return edit_ranks(snap, lambda r: replace(r, nodes=tuple(n for n in r.nodes if n.id != node_id)))


def get(snap: Snapshot, node_id: NodeId, rank: int = 0) -> NodeRecord:
    return _record(snap.ranks[rank], node_id)


def sizes(snap: Snapshot, *, evictable: int = 0, protected: int = 0) -> Snapshot:
    """Shift the size counters (to keep SIZE-ACCOUNTING true while breaking something else)."""
    return edit_ranks(
        snap,
        lambda r: replace(
            r, evictable_size=r.evictable_size + evictable, protected_size=r.protected_size + protected
        ),
    )


def device_pool(snap: Snapshot, edit: Callable[[PoolRecord], PoolRecord]) -> Snapshot:
    return edit_ranks(snap, lambda r: replace(r, device=edit(r.device)))


def host_pool(snap: Snapshot, edit: Callable[[PoolRecord], PoolRecord]) -> Snapshot:
    return edit_ranks(snap, lambda r: replace(r, host=edit(r.host)))


def _record(rank: RankSnapshot, node_id: NodeId) -> NodeRecord:
    record = rank.node(node_id)
    assert record is not None, node_id
    return record


def free_device_of(snap: Snapshot, node_id: NodeId) -> Snapshot:
    """Return a node's device slots to the free list (conservation stays true without them)."""
    return edit_ranks(
        snap,
        lambda r: replace(
            r, device=replace(r.device, free=r.device.free + (_record(r, node_id).value or ()))
        ),
    )


def free_host_of(snap: Snapshot, node_id: NodeId) -> Snapshot:
    """Return a node's host slots to the free list."""
    return edit_ranks(
        snap,
        lambda r: replace(r, host=replace(r.host, free=r.host.free + (_record(r, node_id).host_value or ()))),
    )


def restarted_chain(node: NodeRecord) -> tuple[str, ...]:
    """The hashes a node gets if its chain restarts at its own first page (sglang.md §9 #17)."""
    own = node.id.path[node.id.depth - node.key_len :]
    return tuple(page_hashes(own, PS, storage_namespace_seed(node.id.namespace or None)))


# --- the cases ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    invariant: str
    clause: str
    base: Callable[[], Snapshot]
    breaks: Callable[[Snapshot], Snapshot]
    also: frozenset[str] = frozenset()  # other invariants the same edit necessarily breaks

    def __str__(self) -> str:
        return f"{self.invariant}:{self.clause}"


def _evict_ns_top(s: Snapshot) -> Snapshot:
    """NS_TOP loses its device copy (slots back to the pool) while its child stays on the device."""
    s = free_device_of(s, NS_TOP)
    s = edit_node(s, NS_TOP, value=None, state=NodeState.HOST)
    return sizes(s, evictable=-get(live(), NS_TOP).key_len)


def _unback_loading(s: Snapshot) -> Snapshot:
    """LOADING loses its host copy (slots back to the pool) while its child ANCHOR keeps one."""
    s = free_host_of(s, LOADING)
    return edit_node(s, LOADING, host_value=None, state=NodeState.DEVICE)


def _unlock(s: Snapshot, node_id: NodeId) -> Snapshot:
    """Drop a device leaf's locks and keep size accounting and leaf sets consistent with that."""
    n = get(s, node_id)
    s = edit_node(s, node_id, lock_ref=0, evictable_leaf=True)
    return sizes(s, evictable=n.key_len, protected=-n.key_len)


def _lock_child_only(s: Snapshot) -> Snapshot:
    n = get(s, NS_LEAF)
    s = edit_node(s, NS_LEAF, lock_ref=1, evictable_leaf=False)
    return sizes(s, evictable=-n.key_len, protected=n.key_len)


def _first_free(pool: PoolRecord) -> PoolRecord:
    return replace(pool, free=pool.free[1:])


def _hold_free(pool: PoolRecord, owner: str) -> PoolRecord:
    """Move the first free page to a holder outside the tree (conservation stays true)."""
    page = pool.free[: pool.page_size]
    return replace(pool, free=pool.free[pool.page_size :], held=(*pool.held, (owner, page)))


def _move_host_copy(node_id: NodeId, old_to: str | None) -> Callable[[Snapshot], Snapshot]:
    """The node's host copy moves to the first free slots; its old slots go back to the free list (``old_to``
    None) or to a holder outside the tree. Conservation holds; the pending backup still reads the old slots."""

    def edit(r: RankSnapshot) -> RankSnapshot:
        old = _record(r, node_id).host_value
        assert old is not None
        new, rest = r.host.free[: len(old)], r.host.free[len(old) :]
        host = (
            replace(r.host, free=rest + old)
            if old_to is None
            else replace(r.host, free=rest, held=tuple(sorted((*r.host.held, (old_to, old)))))
        )
        nodes = tuple(replace(n, host_value=new) if n.id == node_id else n for n in r.nodes)
        return replace(r, nodes=nodes, host=host)

    return lambda s: edit_ranks(s, edit)


def _swap_host_copies(a: NodeId, b: NodeId) -> Callable[[Snapshot], Snapshot]:
    """Two nodes of one length exchange host copies: every slot still has one owner, but another node's."""

    def edit(r: RankSnapshot) -> RankSnapshot:
        copies = {a: _record(r, b).host_value, b: _record(r, a).host_value}
        return replace(
            r, nodes=tuple(replace(n, host_value=copies[n.id]) if n.id in copies else n for n in r.nodes)
        )

    return lambda s: edit_ranks(s, edit)


def _ranks_one(edit: Callable[[RankSnapshot], RankSnapshot]) -> Callable[[Snapshot], Snapshot]:
    return lambda s: edit_ranks(s, edit, ranks=(1,))


def _bump_prefetch(r: RankSnapshot) -> RankSnapshot:
    p: PrefetchRecord = r.ongoing_prefetch[0]
    return replace(r, ongoing_prefetch=(replace(p, hit_pages=p.hit_pages + 1),))


CASES: tuple[Case, ...] = (
    # TREE-SHAPE
    Case(
        "TREE-SHAPE",
        "state disagrees with the tiers",
        live,
        lambda s: edit_node(s, CHUNKED, state=NodeState.BOTH),
    ),
    Case(
        "TREE-SHAPE",
        "value length differs from key length",
        live,
        lambda s: edit_node(
            device_pool(s, lambda p: replace(p, free=(*p.free, 27))), CHUNKED, value=(24, 25, 26)
        ),
    ),
    Case(
        "TREE-SHAPE",
        "key_len exceeds depth",
        live,
        lambda s: edit_node(s, CHUNKED, key_len=6),
        frozenset({"SIZE-ACCOUNTING", "HASH-CHAIN"}),
    ),
    Case(
        "TREE-SHAPE",
        "parent missing",
        live,
        lambda s: drop_node(s, NS_TOP),
        # the pending backup reads the dropped node's host slots too
        frozenset({"DEVICE-CONSERVATION", "HOST-CONSERVATION", "SIZE-ACCOUNTING", "BACKUP-SOURCE"}),
    ),
    Case(
        "TREE-SHAPE",
        "not page-aligned",
        live,
        lambda s: replace(s, page_size=4),
        frozenset({"HASH-CHAIN"}),
    ),
    Case(
        "TREE-SHAPE",
        "page hash count differs from page count",
        live,
        lambda s: edit_node(s, CHUNKED, hash_value=get(s, CHUNKED).hash_value[:1]),  # type: ignore[index]
        frozenset({"HASH-CHAIN"}),
    ),
    # EVICTED-SUFFIX
    Case("EVICTED-SUFFIX", "device node below an evicted parent", live, _evict_ns_top),
    # EVICTED-BACKUPED
    Case(
        "EVICTED-BACKUPED",
        "evicted without host copy",
        live,
        lambda s: edit_node(free_host_of(s, ANCHOR), ANCHOR, host_value=None),
        frozenset({"TREE-SHAPE", "IN-FLIGHT"}),
    ),
    # BACKUP-CONTIGUITY
    Case("BACKUP-CONTIGUITY", "backed up below a parent that is not", live, _unback_loading),
    # LOCKS
    Case("LOCKS", "negative lock_ref", live, lambda s: edit_node(s, NS_TOP, lock_ref=-1)),
    Case(
        "LOCKS",
        "negative host_ref_counter",
        live,
        lambda s: edit_node(s, CHUNKED, host_ref_counter=-1),
        frozenset({"IN-FLIGHT"}),
    ),
    Case("LOCKS", "child locked more than its parent", live, _lock_child_only),
    Case(
        "LOCKS",
        "locked but evicted",
        live,
        lambda s: edit_node(s, ANCHOR, lock_ref=1, host_leaf=False),
    ),
    # SIZE-ACCOUNTING
    Case("SIZE-ACCOUNTING", "evictable + protected != device tokens", live, lambda s: sizes(s, evictable=1)),
    Case(
        "SIZE-ACCOUNTING",
        "protected != locked tokens",
        live,
        lambda s: sizes(s, evictable=-PS, protected=PS),
    ),
    # LEAF-SETS
    Case(
        "LEAF-SETS",
        "device leaf missing from the leaf set",
        live,
        lambda s: edit_node(s, NS_LEAF, evictable_leaf=False),
    ),
    Case(
        "LEAF-SETS",
        "locked node in the device leaf set",
        live,
        lambda s: edit_node(s, CHUNKED, evictable_leaf=True),
    ),
    Case(
        "LEAF-SETS",
        "host leaf missing from the host leaf set",
        live,
        lambda s: edit_node(s, ANCHOR, host_leaf=False),
    ),
    Case(
        "LEAF-SETS", "device node in the host leaf set", live, lambda s: edit_node(s, WRITING, host_leaf=True)
    ),
    # DEVICE-CONSERVATION
    Case(
        "DEVICE-CONSERVATION",
        "tree slot also free",
        live,
        lambda s: device_pool(s, lambda p: replace(p, free=(*p.free, *(get(s, CHUNKED).value or ())[:1]))),
    ),
    Case("DEVICE-CONSERVATION", "slot lost", live, lambda s: device_pool(s, _first_free)),
    # As many slots as the pool has, so only the distinctness and range tests can tell.
    Case(
        "DEVICE-CONSERVATION",
        "slot doubled and another lost",
        live,
        lambda s: device_pool(s, lambda p: replace(p, free=(p.free[1], *p.free[1:]))),
    ),
    Case(
        "DEVICE-CONSERVATION",
        "slot renumbered out of range",
        live,
        lambda s: device_pool(s, lambda p: replace(p, free=(p.size, *p.free[1:]))),
    ),
    Case(
        "DEVICE-CONSERVATION",
        "slot renumbered below zero",
        live,
        lambda s: device_pool(s, lambda p: replace(p, free=(-1, *p.free[1:]))),
    ),
    Case(
        "DEVICE-CONSERVATION",
        "slot out of range",
        live,
        lambda s: device_pool(s, lambda p: replace(p, free=(*p.free, p.size))),
    ),
    Case(
        "DEVICE-CONSERVATION",
        "request holds a tree slot",
        live,
        lambda s: device_pool(
            s, lambda p: replace(p, held=(*p.held, ("request:9", (get(s, WRITING).value or ())[:1])))
        ),
    ),
    # HOST-CONSERVATION
    Case(
        "HOST-CONSERVATION",
        "tree slot also free",
        live,
        lambda s: host_pool(s, lambda p: replace(p, free=(*p.free, *(get(s, ANCHOR).host_value or ())[:1]))),
    ),
    Case("HOST-CONSERVATION", "slot lost", live, lambda s: host_pool(s, _first_free)),
    Case(
        "HOST-CONSERVATION",
        "prefetch buffer lost (never released)",
        live,
        lambda s: host_pool(s, lambda p: replace(p, held=())),
    ),
    Case(
        "HOST-CONSERVATION",
        "prefetch slot released twice (§9 #11)",
        live,
        lambda s: host_pool(s, lambda p: replace(p, held=(*p.held, ("release_queue", p.held[0][1][:PS])))),
    ),
    # HASH-CHAIN
    Case(
        "HASH-CHAIN",
        "namespace ignored (§9 #16)",
        live,
        lambda s: edit_node(s, NS_TOP, hash_value=tuple(page_hashes(NS_TOP.path, PS, None))),
    ),
    Case(
        "HASH-CHAIN",
        "chain restarts below the root (§9 #17)",
        live,
        lambda s: edit_node(s, NS_LEAF, hash_value=restarted_chain(get(s, NS_LEAF))),
    ),
    Case(
        "HASH-CHAIN",
        "one page hash wrong",
        live,
        lambda s: edit_node(s, ANCHOR, hash_value=("0" * 64,)),
    ),
    # IN-FLIGHT
    Case("IN-FLIGHT", "write-through source unlocked", live, lambda s: _unlock(s, WRITING)),
    Case(
        "IN-FLIGHT",
        "write-through source without host copy",
        live,
        lambda s: edit_node(free_host_of(s, WRITING), WRITING, host_value=None, state=NodeState.DEVICE),
    ),
    Case(
        "IN-FLIGHT",
        "load-back destination unlocked",
        live,
        lambda s: sizes(
            edit_node(s, LOADING, lock_ref=0, evictable_leaf=True),
            evictable=LOADING.depth,
            protected=-LOADING.depth,
        ),
    ),
    Case(
        "IN-FLIGHT",
        "host_ref_counter counts a holder too many",
        live,
        lambda s: edit_node(s, ANCHOR, host_ref_counter=2),
    ),
    Case(
        "IN-FLIGHT",
        "split fragment of a pending backup not host-protected (§9 #15)",
        live,
        lambda s: edit_node(s, NS_TOP, host_ref_counter=0),
    ),
    Case(
        "IN-FLIGHT",
        "backup fragment without host copy",
        live,
        lambda s: edit_node(free_host_of(s, NS_LEAF), NS_LEAF, host_value=None, state=NodeState.DEVICE),
        frozenset({"BACKUP-SOURCE"}),  # the backup still reads the freed slots
    ),
    Case(
        "IN-FLIGHT",
        "prefetch_tokens_occupied disagrees",
        live,
        lambda s: edit_ranks(
            s, lambda r: replace(r, prefetch_tokens_occupied=r.prefetch_tokens_occupied + 1)
        ),
    ),
    # BACKUP-SOURCE
    Case(
        "BACKUP-SOURCE",
        "a slot the pending backup reads is free (§9 #15: wrong bytes to L3)",
        live,
        _move_host_copy(NS_TOP, None),
    ),
    Case(
        "BACKUP-SOURCE",
        "a slot the pending backup reads is held by a prefetch",
        live,
        _move_host_copy(NS_TOP, "prefetch:9"),
    ),
    Case(
        "BACKUP-SOURCE",
        "a slot the pending backup reads is another node's host copy",
        live,
        _swap_host_copies(NS_TOP, LOADING),
    ),
    Case(
        "BACKUP-SOURCE",
        "the backup reads more slots than its path holds",
        live,
        lambda s: edit_ranks(
            s,
            lambda r: replace(
                r, backup_host_indices=tuple((r.host.free[0], *b) for b in r.backup_host_indices)
            ),
        ),
    ),
    Case(
        "BACKUP-SOURCE",
        "no backup_host_indices entry for a backup in flight",
        live,
        lambda s: edit_ranks(s, lambda r: replace(r, backup_host_indices=())),
    ),
    # IDLE-DRAINED
    Case(
        "IDLE-DRAINED",
        "device slots held outside the tree",
        drained,
        lambda s: device_pool(s, lambda p: _hold_free(p, "request:9")),
    ),
    Case(
        "IDLE-DRAINED",
        "host slots still in the release queue",
        drained,
        lambda s: host_pool(s, lambda p: _hold_free(p, "release_queue")),
    ),
    Case(
        "IDLE-DRAINED",
        "in-flight table not empty",
        drained,
        lambda s: edit_ranks(s, lambda r: replace(r, ongoing_load_back=(LOADING,), load_finished=(False,))),
    ),
    Case(
        "IDLE-DRAINED",
        "node still locked",
        drained,
        lambda s: sizes(
            edit_node(s, WRITING, lock_ref=1, evictable_leaf=False),
            evictable=-WRITING.depth,
            protected=WRITING.depth,
        ),
    ),
    Case(
        "IDLE-DRAINED",
        "node still host-protected (§9 #12)",
        drained,
        lambda s: edit_node(s, ANCHOR, host_ref_counter=1),
        frozenset({"IN-FLIGHT"}),
    ),
    Case(
        "IDLE-DRAINED",
        "prefetch tokens still occupied (§9 #12)",
        drained,
        lambda s: edit_ranks(s, lambda r: replace(r, prefetch_tokens_occupied=4)),
        frozenset({"IN-FLIGHT"}),
    ),
    # RANKS-EQUAL
    Case(
        "RANKS-EQUAL",
        "a node's hit_count differs",
        live,
        lambda s: edit_node(s, WRITING, ranks=(1,), hit_count=get(s, WRITING).hit_count + 1),
    ),
    Case(
        "RANKS-EQUAL",
        "a node's priority differs",
        live,
        lambda s: edit_node(s, ANCHOR, ranks=(1,), priority=7),
    ),
    Case("RANKS-EQUAL", "prefetch hit count differs", live, _ranks_one(_bump_prefetch)),
    Case(
        "RANKS-EQUAL",
        "ongoing table differs",
        live,
        _ranks_one(lambda r: replace(r, ongoing_write_through=())),
    ),
    # LOAD-STREAM-ORDER
    Case(
        "LOAD-STREAM-ORDER",
        "newer load finished before an older one",
        two_loads,
        lambda s: edit_ranks(s, lambda r: replace(r, load_finished=tuple(reversed(r.load_finished)))),
    ),
    Case(
        "LOAD-STREAM-ORDER",
        "no finished flag for a load in flight",
        two_loads,
        lambda s: edit_ranks(s, lambda r: replace(r, load_finished=r.load_finished[:1])),
    ),
)

STEP_CASES: tuple[tuple[str, str, Callable[[Snapshot], Snapshot]], ...] = (
    ("STEP-REMOVAL", "locked node removed", lambda s: drop_node(s, CHUNKED)),
    ("STEP-REMOVAL", "host-protected node removed (§9 #12)", lambda s: drop_node(s, ANCHOR)),
    (
        "STEP-REMOVAL",
        "host copy dropped from a live node",
        lambda s: edit_node(s, NS_LEAF, host_value=None, state=NodeState.DEVICE),
    ),
)


def test_every_invariant_has_a_failing_case() -> None:
    assert {c.invariant for c in CASES} == set(INVARIANTS)
    assert {inv for inv, _, _ in STEP_CASES} == set(STEP_INVARIANTS)


@pytest.mark.parametrize("base", [live, drained], ids=["live", "drained"])
def test_healthy_snapshots_pass(base: Callable[[], Snapshot]) -> None:
    assert check_all(base()) == []


def test_live_snapshot_fills_every_table() -> None:
    """The live snapshot really has what the cases rely on (a guard against model changes)."""
    for rank in live().ranks:
        assert rank.ongoing_write_through and rank.ongoing_load_back and rank.ongoing_backup
        assert rank.ongoing_prefetch and rank.requests and rank.host.held and rank.device.held
        states = {n.id: n.state for n in rank.nodes}
        assert states[ANCHOR] is NodeState.HOST and states[CHUNKED] is NodeState.DEVICE
        assert states[LOADING] is states[WRITING] is states[NS_TOP] is NodeState.BOTH
        assert InFlight.BACKUP in get(live(), NS_TOP, rank.rank).in_flight
        assert get(live(), NS_TOP, rank.rank).host_ref_counter == 1  # D-07: the split fragment is pinned
        # the backup has not run: it reads both fragments' host copies, as enqueued before the split
        top, leaf = get(live(), NS_TOP, rank.rank).host_value, get(live(), NS_LEAF, rank.rank).host_value
        assert top is not None and leaf is not None and rank.backup_host_indices == ((*top, *leaf),)


def test_every_real_step_passes_the_step_invariants() -> None:
    for before, after in live_steps():
        assert check_step(before, after) == []


@pytest.mark.parametrize("case", CASES, ids=str)
def test_broken_snapshot_is_caught(case: Case) -> None:
    broken = case.breaks(case.base())
    assert broken != case.base()
    found = {v.invariant for v in check_all(broken)}
    assert found == {case.invariant} | case.also, [str(v) for v in check_all(broken)]
    # The check itself, called alone, reports it with a message.
    assert all(v.message for v in INVARIANTS[case.invariant](broken))


@pytest.mark.parametrize(("invariant", "clause", "breaks"), STEP_CASES, ids=[c[1] for c in STEP_CASES])
def test_broken_step_is_caught(invariant: str, clause: str, breaks: Callable[[Snapshot], Snapshot]) -> None:
    before = live()
    violations = check_step(before, breaks(before))
    assert {v.invariant for v in violations} == {invariant}
    assert len(violations) == len(before.ranks)  # every rank reports it


def test_an_anchor_the_step_let_go_may_be_removed() -> None:
    """Under D-01 one drain revokes a prefetch, then evicts host memory for another's allocation, which may take
    the anchor the revoke let go (tests/unit/test_fidelity_d58.py): allowed once the prefetch anchored there is
    gone, not while it runs (the second STEP_CASES clause) nor while the node is locked too."""
    before = live()
    revoked = edit_ranks(drop_node(before, ANCHOR), lambda r: replace(r, ongoing_prefetch=()))
    assert all(p.anchor == ANCHOR for r in before.ranks for p in r.ongoing_prefetch)
    assert check_step(before, revoked) == []
    locked = edit_node(before, ANCHOR, lock_ref=1)
    assert {v.invariant for v in check_step(locked, revoked)} == {"STEP-REMOVAL"}


def test_a_prefix_split_off_an_anchor_the_step_let_go_may_be_removed() -> None:
    """D-57: a prefix split off a prefetch's anchor is pinned with it (``PrefetchRecord.split_off``), so the step
    that ends the prefetch lets it go too, as it does the anchor."""
    before = live()
    rank0 = before.ranks[0]
    prefix = rank0.by_id[
        ANCHOR
    ].parent_id  # the anchor's parent, unlocked, stands in for the split-off prefix
    pinned = edit_ranks(
        before,
        lambda r: replace(
            r, ongoing_prefetch=tuple(replace(p, split_off=(prefix,)) for p in r.ongoing_prefetch)
        ),
    )
    pinned = edit_node(pinned, prefix, lock_ref=0, host_ref_counter=rank0.by_id[prefix].host_ref_counter + 1)
    revoked = edit_ranks(
        drop_node(drop_node(pinned, ANCHOR), prefix), lambda r: replace(r, ongoing_prefetch=())
    )
    assert check_step(pinned, revoked) == []
    running = edit_ranks(drop_node(drop_node(pinned, ANCHOR), prefix), lambda r: r)  # the prefetch still runs
    assert {v.invariant for v in check_step(pinned, running)} == {"STEP-REMOVAL"}


def test_two_loads_snapshot_has_an_older_finished_load() -> None:
    """The base of the LOAD-STREAM-ORDER cases really has two loads in flight, only the older finished."""
    for rank in two_loads().ranks:
        assert len(rank.ongoing_load_back) == 2 and rank.load_finished == (True, False)


def test_backup_contiguity_does_not_apply_to_write_back() -> None:
    broken = _unback_loading(live())
    assert INVARIANTS["BACKUP-CONTIGUITY"](replace(broken, write_policy="write_back")) == []


def test_write_back_host_duplicate_reclaim_is_no_lost_copy() -> None:
    """D-48: where the snapshot says host duplicates are reclaimed (write_back on SGLang 0.5.22 on), a live
    node may lose an unpinned host copy of its device copy; anywhere else (write_back without the reclaim
    included), pinned, in flight or with the device copy changed, it is still a dropped copy."""
    base = drained()
    both = next(
        n
        for n in base.ranks[0].nodes
        if n.state is NodeState.BOTH and not n.host_ref_counter and not n.in_flight
    )
    before = replace(base, write_policy="write_back", host_duplicate_reclaim=True)

    def reclaimed(snap: Snapshot, **changes: object) -> Snapshot:
        return edit_node(snap, both.id, None, **{"host_value": None, "state": NodeState.DEVICE, **changes})

    assert check_step(before, reclaimed(before)) == []
    assert {v.invariant for v in check_step(base, reclaimed(base))} == {"STEP-REMOVAL"}  # write_through
    spec = replace(base, write_policy="write_back")  # write_back as the spec has it: no reclaim
    assert {v.invariant for v in check_step(spec, reclaimed(spec))} == {"STEP-REMOVAL"}
    pinned = edit_node(before, both.id, host_ref_counter=1)
    assert {v.invariant for v in check_step(pinned, reclaimed(pinned, host_ref_counter=1))} == {
        "STEP-REMOVAL"
    }
    loading = edit_node(before, both.id, in_flight=(InFlight.LOAD_BACK,))
    assert {v.invariant for v in check_step(loading, reclaimed(loading))} == {"STEP-REMOVAL"}
    assert {v.invariant for v in check_step(before, reclaimed(before, value=None))} == {"STEP-REMOVAL"}


def test_write_back_sources_need_no_lock() -> None:
    broken = _unlock(live(), WRITING)
    assert INVARIANTS["IN-FLIGHT"](replace(broken, write_policy="write_back")) == []


def test_single_rank_snapshot_is_trivially_rank_equal() -> None:
    one = replace(live(), ranks=live().ranks[:1], tp_size=1)
    assert INVARIANTS["RANKS-EQUAL"](one) == []


def test_violation_str_names_invariant_rank_and_node() -> None:
    broken = edit_node(live(), CHUNKED, state=NodeState.BOTH)
    text = str(check_all(broken)[0])
    assert text.startswith("[TREE-SHAPE] rank 0 node -:[30, 31, 32, 33]: state both")


def test_snapshot_records_are_plain_data() -> None:
    """Snapshots compare by value: two runs of the same operations give equal snapshots."""
    assert _drive_live().model.snapshot() == live()
    assert dataclasses.is_dataclass(live())


class _Breaking:
    """A model whose snapshots go through ``breaks`` once ``armed`` (two of these report alike)."""

    def __init__(self, breaks: Callable[[Snapshot], Snapshot]) -> None:
        self.model = HiCacheModel(_config())
        self.breaks = breaks
        self.armed = False

    def apply(self, op: Op) -> object:
        return self.model.apply(op)

    def snapshot(self) -> Snapshot:
        snap = self.model.snapshot()
        return self.breaks(snap) if self.armed else snap

    def close(self) -> None:
        pass


@pytest.mark.parametrize(
    ("invariant", "breaks"),
    [
        ("LOCKS", lambda s: edit_node(s, NodeId("", A), lock_ref=-1)),
        ("STEP-REMOVAL", lambda s: drop_node(s, NodeId("", A))),
    ],
)
def test_harness_catches_a_break_every_system_shares(
    invariant: str, breaks: Callable[[Snapshot], Snapshot]
) -> None:
    """Equal snapshots are checked once (``Harness`` runs the invariants on the first system's): a break
    that every system reports alike, so that the snapshots still compare equal, is still caught."""
    from refcache.check.harness import Divergence, Harness

    systems = {"a": _Breaking(breaks), "b": _Breaking(breaks)}
    harness = Harness(_config(), systems, write_trace=False, family=HICACHE)  # type: ignore[arg-type]
    for op in (StartRequest(1, A), FinishRequest(1), StartRequest(2, A)):  # A in the tree, locked by 2
        harness.step(op)
    for system in systems.values():
        system.armed = True
    with pytest.raises(Divergence) as failure:
        harness.step(MatchPrefix(A))
    assert failure.value.kind == "invariant violated on a"
    assert f"[{invariant}]" in failure.value.summary
