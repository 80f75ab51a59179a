"""The engine-neutral snapshot: a cache's whole observable state as plain data, per rank.

No tensors and no object identity: nodes are named by their namespace and token path from the root,
in-flight operations by the paths of the nodes they cover. The model, the implementation and (through
an adapter) any other engine produce a ``Snapshot``; the invariants of ``refcache.hicache.invariants`` and the
differential harness read nothing else.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TypeVar

from refcache.family import NodeId
from refcache.hashing import Token
from refcache.hicache.states import NodeState, PrefetchStage

__all__ = [
    "InFlight",
    "NodeId",
    "NodeRecord",
    "PoolRecord",
    "PrefetchRecord",
    "RankSnapshot",
    "RequestRecord",
    "Snapshot",
    "SnapshotInterner",
    "rank_clocks",
]

Path = tuple[Token, ...]
_H = TypeVar("_H", bound=Hashable)


class InFlight:
    """Names of the in-flight tables a node can belong to (``NodeRecord.in_flight``)."""

    WRITE_THROUGH = "write_through"  # ongoing_write_through: L1→L2 copy not yet acknowledged
    LOAD_BACK = "load_back"  # ongoing_load_back: L2→L1 copy not yet acknowledged
    BACKUP = "backup"  # ongoing_backup: L2→L3 write not yet acknowledged
    PREFETCH_ANCHOR = "prefetch_anchor"  # last_host_node of an ongoing_prefetch entry


@dataclass(frozen=True)
class NodeRecord:
    """One non-root node. Slot tuples are in key order; ``None`` where the tier holds nothing."""

    id: NodeId
    key_len: int  # len(node.key) in key elements (tokens, or bigram pairs)
    state: NodeState
    value: tuple[int, ...] | None  # device slots
    host_value: tuple[int, ...] | None  # host slots
    hash_value: tuple[str, ...] | None  # one chained SHA-256 per page
    lock_ref: int
    host_ref_counter: int
    hit_count: int
    priority: int
    in_flight: tuple[str, ...]  # sorted InFlight names
    evictable_leaf: bool  # member of the device-eviction leaf set the cache maintains
    host_leaf: bool  # member of the host-eviction leaf set the cache maintains

    @cached_property
    def parent_id(self) -> NodeId:
        # Derived once per record (records are immutable): the invariants ask for it many times.
        return NodeId(self.id.namespace, self.id.path[: len(self.id.path) - self.key_len])


@dataclass(frozen=True)
class PoolRecord:
    """Slot accounting of one pool, in tokens. Every slot is free, in the tree, or held by one owner."""

    size: int
    page_size: int
    free: tuple[int, ...]  # allocator free list, in order
    held: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (owner, slots) outside the tree, sorted by owner


@dataclass(frozen=True)
class RequestRecord:
    """A running request: its device slots (tree-owned prefix first) and the node it locks."""

    rid: int
    tokens: int  # tokens computed so far
    protected_len: int  # leading slots owned by the tree (cache_protected_len)
    locked: NodeId | None  # last_node it holds a lock on (None: the root)


@dataclass(frozen=True)
class PrefetchRecord:
    """One ``ongoing_prefetch`` entry and its controller operation on this rank."""

    rid: int
    anchor: NodeId | None  # last_host_node (None: the root)
    tokens: int  # len of the page-aligned prefetch key
    stage: PrefetchStage  # query (awaiting the hit query), io (reading pages), done (revoked or I/O finished)
    hit_pages: int  # pages the query found (after the MIN reduction); 0 before
    completed_tokens: int  # tokens this rank has read into host memory
    terminated: bool
    # D-57 (SGLang 0.5.22 on): the prefixes split off the anchor since admission, root side first, which the
    # entry's host pin covers with it; empty where the pin stays on the anchor alone
    split_off: tuple[NodeId, ...] = ()


@dataclass(frozen=True)
class RankSnapshot:
    rank: int
    nodes: tuple[NodeRecord, ...]  # sorted by id
    device: PoolRecord
    host: PoolRecord
    evictable_size: int
    protected_size: int
    ongoing_write_through: tuple[tuple[NodeId, ...], ...]  # per entry, its fragments (ack order)
    ongoing_load_back: tuple[NodeId, ...]  # ack order
    ongoing_backup: tuple[tuple[NodeId, ...], ...]  # per entry, its fragments (ack order)
    ongoing_prefetch: tuple[PrefetchRecord, ...]  # sorted by rid
    prefetch_tokens_occupied: int
    queues: tuple[tuple[str, int], ...]  # background and control queue lengths, by name
    l3_keys: tuple[str, ...]  # this rank's view of L3, sorted
    requests: tuple[RequestRecord, ...]  # sorted by rid
    # this rank's clock minus Snapshot.clock_us (D-41: AdvanceClock(us, rank) moves one rank's clock);
    # not written when 0 (refcache.hicache.recording.to_json), so lock-step recordings read in older versions
    clock_skew_us: int = field(default=0, metadata={"omit_default": True})
    # per ongoing_load_back entry (same order): whether its host->device copy has finished on this rank (the
    # load stream's finish event), not yet retired by loading_check. The load stream retires copies oldest
    # first, so the finished entries are a prefix (LOAD-STREAM-ORDER, specs/invariants.md); rank-local, like
    # the queues. Not written when empty (no load in flight), so recordings without loads read unchanged.
    load_finished: tuple[bool, ...] = field(default=(), metadata={"omit_default": True})
    # per ongoing_backup entry (same order): the host slots its L2->L3 operation has still to read, in page
    # order -- the operation's host indices as enqueued (SGLang's StorageOperation.host_indices) while it waits
    # for the backup thread, () once the thread has run it (its ack may still be pending). BACKUP-SOURCE
    # (specs/invariants.md) checks they still hold the pages enqueued. Rank-local slot numbers, like host_value.
    # Not written when empty (no backup in flight), so recordings without L3 backups read unchanged.
    backup_host_indices: tuple[tuple[int, ...], ...] = field(default=(), metadata={"omit_default": True})

    def node(self, node_id: NodeId) -> NodeRecord | None:
        for record in self.nodes:
            if record.id == node_id:
                return record
        return None

    @cached_property
    def by_id(self) -> dict[NodeId, NodeRecord]:
        """The nodes by name, built once per snapshot (the invariants look parents up in it many times). A
        broken snapshot that names a node twice maps the name to the last record."""
        return {record.id: record for record in self.nodes}


@dataclass(frozen=True)
class Snapshot:
    """All ranks plus the configuration facts the invariants need."""

    page_size: int
    write_policy: str
    attention: str
    tp_size: int
    model_name: str
    storage_enabled: bool
    is_eagle: bool
    clock_us: int  # the time every rank's clock has reached (the earliest); rank r's is this plus its skew
    ranks: tuple[RankSnapshot, ...] = field(default=())
    # Whether an evict_host may first drop the host copy of a node also on the device (write_back's
    # host-duplicate reclaim, SGLang 0.5.22 on, D-48): STEP-REMOVAL allows that drop only where this is set.
    host_duplicate_reclaim: bool = False
    # Whether each rank retires its own finished load backs (SGLang up to 0.5.12, D-68, two ranks or more): the
    # ranks may then differ in what RANKS-EQUAL's ``load_backs_apart`` allows. Not written when False.
    loads_retired_per_rank: bool = field(default=False, metadata={"omit_default": True})

    def rank_clock_us(self, index: int) -> int:
        """The clock of ``ranks[index]`` (D-41): ``clock_us`` plus that rank's ``clock_skew_us``."""
        return self.clock_us + self.ranks[index].clock_skew_us


def rank_clocks(clocks: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """``(clock_us, skews)`` of a snapshot whose ranks' clocks are ``clocks``: the earliest, and how far each
    rank is past it (D-41). One clock, or equal ones, give skews of 0: the snapshot of lock-step clocks."""
    base = min(clocks)
    return base, tuple(c - base for c in clocks)


class SnapshotInterner:
    """Makes successive snapshots share what they have in common, so that holding a trace's snapshots costs
    what changed between them rather than the whole cache each time: a node record, a pool record, or a node's
    name or slot tuple equal to one an earlier snapshot had is replaced by that earlier object. A snapshot is
    immutable, so sharing is invisible to its readers (equality, the invariants, ``to_json``). What a recorder
    or a trace reader passes through one interner it holds anyway, so the interner's tables cost no more than
    their references."""

    def __init__(self) -> None:
        self._seen: dict[Hashable, Hashable] = {}

    def _one(self, value: _H) -> _H:
        found = self._seen.setdefault(value, value)
        return value if found is value or type(found) is not type(value) else found

    def _node(self, record: NodeRecord) -> NodeRecord:
        found = self._seen.get(record)
        if found is not None:
            assert isinstance(found, NodeRecord)
            return found
        shared = replace(
            record,
            id=self._one(record.id),
            value=None if record.value is None else self._one(record.value),
            host_value=None if record.host_value is None else self._one(record.host_value),
            hash_value=None if record.hash_value is None else self._one(record.hash_value),
        )
        self._seen[shared] = shared
        return shared

    def __call__(self, snapshot: Snapshot) -> Snapshot:
        ranks = tuple(
            replace(
                rank,
                nodes=tuple(self._node(record) for record in rank.nodes),
                device=self._one(rank.device),
                host=self._one(rank.host),
            )
            for rank in snapshot.ranks
        )
        return replace(snapshot, ranks=ranks)
