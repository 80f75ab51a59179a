"""The invariants of HiCache as named functions over a ``Snapshot``.

Each function returns the list of ``Violation``\\ s it finds (empty when the invariant holds). They read
only the engine-neutral snapshot, so the same functions check the model, the implementation and, through
an adapter that builds a ``Snapshot``, any other engine. ``specs/invariants.md`` lists every ID with its
statement, why it holds and the seed section it comes from.

``INVARIANTS`` are state invariants (one snapshot); ``STEP_INVARIANTS`` relate a snapshot to the one
before it (what an operation may remove).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Final

from refcache.family import Violation
from refcache.hashing import Token, get_hash_str, page_hashes, storage_namespace_seed
from refcache.hicache.snapshot import InFlight, NodeId, NodeRecord, PoolRecord, RankSnapshot, Snapshot
from refcache.hicache.states import NodeState

__all__ = [
    "INVARIANTS",
    "STEP_INVARIANTS",
    "Violation",
    "check_all",
    "check_step",
]


Invariant = Callable[[Snapshot], list[Violation]]
StepInvariant = Callable[[Snapshot, Snapshot], list[Violation]]


def _per_node(
    inv_id: str,
    snap: Snapshot,
    check: Callable[[RankSnapshot, NodeRecord, dict[NodeId, NodeRecord]], str | None],
) -> list[Violation]:
    out: list[Violation] = []
    for rank in snap.ranks:
        by_id = rank.by_id
        for node in rank.nodes:
            message = check(rank, node, by_id)
            if message:
                out.append(Violation(inv_id, rank.rank, node.id, message))
    return out


def _parent(node: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> NodeRecord | None:
    return by_id.get(node.parent_id)


def _children(rank: RankSnapshot) -> dict[NodeId, list[NodeRecord]]:
    out: dict[NodeId, list[NodeRecord]] = {}
    for node in rank.nodes:
        out.setdefault(node.parent_id, []).append(node)
    return out


_TIERS: Final = {
    NodeState.DEVICE: (True, False),
    NodeState.BOTH: (True, True),
    NodeState.HOST: (False, True),
}
"""Which tiers hold slots in each state a node in the tree can be in: (value set, host_value set)."""


def inv_tree_shape(snap: Snapshot) -> list[Violation]:
    """TREE-SHAPE: parents exist; keys, values, host values and hashes are page-aligned and agree; the
    state matches which tiers hold slots."""
    ps = snap.page_size

    def check(rank: RankSnapshot, n: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> str | None:
        if n.key_len <= 0 or n.key_len > n.id.depth:
            return f"key_len {n.key_len} impossible at depth {n.id.depth}"
        if n.parent_id.path and n.parent_id not in by_id:
            return f"parent {list(n.parent_id.path)} is not in the tree"
        if n.key_len % ps or n.id.depth % ps:
            return f"key_len {n.key_len} / depth {n.id.depth} not a multiple of page_size {ps}"
        for name, slots in (("value", n.value), ("host_value", n.host_value)):
            if slots is not None and len(slots) != n.key_len:
                return f"len({name}) = {len(slots)} != key_len {n.key_len}"
        if n.hash_value is not None and len(n.hash_value) != n.key_len // ps:
            return f"{len(n.hash_value)} page hashes for {n.key_len // ps} pages"
        expected = _TIERS.get(n.state)
        if expected is None or expected != (n.value is not None, n.host_value is not None):
            return (
                f"state {n.state.value} but value={n.value is not None} host_value={n.host_value is not None}"
            )
        return None

    return _per_node("TREE-SHAPE", snap, check)


def inv_evicted_suffix(snap: Snapshot) -> list[Violation]:
    """EVICTED-SUFFIX: on every root-to-leaf path, evicted nodes form a suffix (seed §1.2)."""

    def check(rank: RankSnapshot, n: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> str | None:
        parent = _parent(n, by_id)
        if parent is not None and parent.value is None and n.value is not None:
            return f"on the device below evicted parent {list(parent.id.path)}"
        return None

    return _per_node("EVICTED-SUFFIX", snap, check)


def inv_evicted_backuped(snap: Snapshot) -> list[Violation]:
    """EVICTED-BACKUPED: a node without device slots has host slots (seed §1.2)."""

    def check(rank: RankSnapshot, n: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> str | None:
        return "evicted but not backed up" if n.value is None and n.host_value is None else None

    return _per_node("EVICTED-BACKUPED", snap, check)


def inv_backup_contiguity(snap: Snapshot) -> list[Violation]:
    """BACKUP-CONTIGUITY: in write-through modes a backed-up node's parent is backed up (sglang.md §1.4)."""
    if snap.write_policy == "write_back":
        return []  # write_back backs up leaves first on eviction; parents follow when they become leaves

    def check(rank: RankSnapshot, n: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> str | None:
        parent = _parent(n, by_id)
        if n.host_value is not None and parent is not None and parent.host_value is None:
            return f"backed up under parent {list(parent.id.path)} that is not"
        return None

    return _per_node("BACKUP-CONTIGUITY", snap, check)


def inv_locks(snap: Snapshot) -> list[Violation]:
    """LOCKS: lock_ref and host_ref_counter are >= 0; a parent is locked at least as often as each child;
    a locked node is on the device (seed §3.7)."""

    def check(rank: RankSnapshot, n: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> str | None:
        if n.lock_ref < 0 or n.host_ref_counter < 0:
            return f"negative counter: lock_ref {n.lock_ref}, host_ref_counter {n.host_ref_counter}"
        if n.lock_ref > 0 and n.value is None:
            return f"locked ({n.lock_ref}) but evicted"
        parent = _parent(n, by_id)
        if parent is not None and parent.lock_ref < n.lock_ref:
            return f"lock_ref {n.lock_ref} above parent's {parent.lock_ref}"
        return None

    return _per_node("LOCKS", snap, check)


def inv_size_accounting(snap: Snapshot) -> list[Violation]:
    """SIZE-ACCOUNTING: evictable + protected = tokens of device nodes; protected = tokens of locked ones."""
    out: list[Violation] = []
    for rank in snap.ranks:
        on_device = sum(n.key_len for n in rank.nodes if n.value is not None)
        locked = sum(n.key_len for n in rank.nodes if n.value is not None and n.lock_ref > 0)
        if rank.evictable_size + rank.protected_size != on_device or rank.protected_size != locked:
            out.append(
                Violation(
                    "SIZE-ACCOUNTING",
                    rank.rank,
                    None,
                    f"evictable {rank.evictable_size} + protected {rank.protected_size}; device nodes hold "
                    f"{on_device} tokens, {locked} of them locked",
                )
            )
    return out


def inv_leaf_sets(snap: Snapshot) -> list[Violation]:
    """LEAF-SETS: the maintained leaf sets equal a from-scratch recomputation (sglang.md §3.2, §9 #5)."""
    out: list[Violation] = []
    for rank in snap.ranks:
        children = _children(rank)
        for n in rank.nodes:
            kids = children.get(n.id, [])
            device_leaf = n.value is not None and n.lock_ref == 0 and all(c.value is None for c in kids)
            host_leaf = (
                n.value is None and n.lock_ref == 0 and not any(c.host_value is not None for c in kids)
            )
            if n.evictable_leaf != device_leaf or n.host_leaf != host_leaf:
                out.append(
                    Violation(
                        "LEAF-SETS",
                        rank.rank,
                        n.id,
                        f"device leaf {n.evictable_leaf} (should be {device_leaf}), host leaf {n.host_leaf} "
                        f"(should be {host_leaf})",
                    )
                )
    return out


def _conservation(
    inv_id: str, rank: RankSnapshot, pool: PoolRecord, in_tree: Iterable[int]
) -> list[Violation]:
    owned = [*pool.free, *in_tree]
    for _, slots in pool.held:
        owned += slots
    # pool.size distinct slots, all in range, are exactly the slots 0..size-1: nothing doubled, lost or
    # foreign. Only otherwise is it worth counting which.
    in_range = not owned or (min(owned) >= 0 and max(owned) < pool.size)
    if in_range and len(owned) == pool.size == len(set(owned)):
        return []
    seen: Counter[int] = Counter(owned)
    doubled = sorted(s for s, c in seen.items() if c > 1)
    missing = sorted(set(range(pool.size)) - set(seen))
    foreign = sorted(s for s in seen if not 0 <= s < pool.size)
    if doubled or missing or foreign:
        return [
            Violation(
                inv_id,
                rank.rank,
                None,
                f"slots owned twice {doubled[:8]}, lost {missing[:8]}, out of range {foreign[:8]}",
            )
        ]
    return []


def inv_device_conservation(snap: Snapshot) -> list[Violation]:
    """DEVICE-CONSERVATION: every device slot is free, in one node's value, or held by one request."""
    return [
        v
        for rank in snap.ranks
        for v in _conservation(
            "DEVICE-CONSERVATION", rank, rank.device, (s for n in rank.nodes for s in n.value or ())
        )
    ]


def inv_host_conservation(snap: Snapshot) -> list[Violation]:
    """HOST-CONSERVATION: every host slot is free, in one node's host_value, held by one prefetch
    operation, or in the release queue (sglang.md §9 #11, #12)."""
    return [
        v
        for rank in snap.ranks
        for v in _conservation(
            "HOST-CONSERVATION", rank, rank.host, (s for n in rank.nodes for s in n.host_value or ())
        )
    ]


_PAGE_HASHES: dict[tuple[str | None, tuple[Token, ...]], str] = {}
"""``get_hash_str(page, prior)`` by ``(prior, page)``: HASH-CHAIN meets the same pages step after step.
Emptied when it reaches ``_PAGE_HASHES_MAX`` entries."""
_PAGE_HASHES_MAX: Final = 1 << 15


def _chain(tokens: tuple[Token, ...], page_size: int, prior: str | None) -> list[str]:
    """``refcache.hashing.page_hashes(tokens, page_size, prior)``, each page's hash remembered."""
    out: list[str] = []
    for start in range(0, len(tokens), page_size):
        page = tokens[start : start + page_size]
        digest = _PAGE_HASHES.get((prior, page))
        if digest is None:
            if len(_PAGE_HASHES) >= _PAGE_HASHES_MAX:
                _PAGE_HASHES.clear()
            digest = _PAGE_HASHES[(prior, page)] = get_hash_str(page, prior)
        out.append(digest)
        prior = digest
    return out


def inv_hash_chain(snap: Snapshot) -> list[Violation]:
    """HASH-CHAIN: a page's key is the chained hash of every token from the root (and the namespace)
    through that page (seed §4.1; sglang.md §9 #16, #17)."""
    ps = snap.page_size
    # The chain's last hash at the end of a page-aligned path (the namespace's seed for the empty path).
    # Hashes are a function of the path alone, so ranks share it; parents come before their children in
    # the sorted node list, so each page is hashed once.
    ends: dict[NodeId, str | None] = {}

    def end_of(node_id: NodeId) -> str | None:
        if node_id not in ends:
            seed = storage_namespace_seed(node_id.namespace or None)
            chain = _chain(node_id.path, ps, seed)
            ends[node_id] = chain[-1] if chain else seed
        return ends[node_id]

    def check(rank: RankSnapshot, n: NodeRecord, by_id: dict[NodeId, NodeRecord]) -> str | None:
        if n.hash_value is None:
            return None
        start = n.id.depth - n.key_len
        if start >= 0 and start % ps == 0 and n.id.depth % ps == 0:
            # page_hashes(path)[start // ps:] is the chain of the node's own key from its parent path's end.
            prior = end_of(n.parent_id)
            expected = _chain(n.id.path[start:], ps, prior)
            ends.setdefault(n.id, expected[-1] if expected else prior)
        else:  # a shape TREE-SHAPE reports: the literal definition
            seed = storage_namespace_seed(n.id.namespace or None)
            expected = page_hashes(n.id.path, ps, seed)[start // ps :]
        if tuple(expected) != n.hash_value:
            return "page hashes do not chain from the root"
        return None

    return _per_node("HASH-CHAIN", snap, check)


def inv_in_flight(snap: Snapshot) -> list[Violation]:
    """IN-FLIGHT: nodes in flight are protected — write-through sources and load destinations locked,
    L3 backups and prefetch anchors host-protected — and host_ref_counter counts exactly those holders."""
    out: list[Violation] = []
    for rank in snap.ranks:
        holders: Counter[NodeId] = Counter()
        for fragments in rank.ongoing_backup:
            holders.update(fragments)
        for p in rank.ongoing_prefetch:
            if p.anchor is not None:
                holders[p.anchor] += 1
            holders.update(p.split_off)  # D-57: the prefixes split off it are pinned with it
        for n in rank.nodes:
            problem = None
            if InFlight.WRITE_THROUGH in n.in_flight and (
                n.host_value is None or (snap.write_policy != "write_back" and n.lock_ref == 0)
            ):
                problem = "write-through source neither backed up nor locked"
            elif InFlight.LOAD_BACK in n.in_flight and (n.value is None or n.lock_ref == 0):
                problem = "load-back destination not on the device or not locked"
            elif n.host_ref_counter != holders[n.id]:
                problem = f"host_ref_counter {n.host_ref_counter} but {holders[n.id]} holders"
            elif (
                InFlight.BACKUP in n.in_flight or InFlight.PREFETCH_ANCHOR in n.in_flight
            ) and n.host_value is None:
                problem = "host-protected node has no host copy"
            if problem:
                out.append(Violation("IN-FLIGHT", rank.rank, n.id, problem))
        occupied = sum(p.tokens for p in rank.ongoing_prefetch)
        if rank.prefetch_tokens_occupied != occupied:
            out.append(
                Violation(
                    "IN-FLIGHT",
                    rank.rank,
                    None,
                    f"prefetch_tokens_occupied {rank.prefetch_tokens_occupied} but ongoing prefetches hold {occupied}",
                )
            )
    return out


def _path(node: NodeId) -> str:
    return f"{node.namespace or '-'}:{list(node.path)}"


def _where_now(rank: RankSnapshot, slots: tuple[int, ...]) -> str:
    """Where host ``slots`` are now, for a message: free, held by an owner of ``PoolRecord.held``, in a node's
    host copy, or nowhere (HOST-CONSERVATION reports that)."""
    owners = dict.fromkeys(rank.host.free, "free")
    for owner, held in rank.host.held:
        owners.update(dict.fromkeys(held, f"held by {owner}"))
    for n in rank.nodes:
        owners.update(dict.fromkeys(n.host_value or (), f"in the host copy of {_path(n.id)}"))
    # not "; ": a divergence's detail lines are split there (refcache.check.known)
    return ", ".join(sorted({owners.get(s, "nowhere") for s in slots}))


def inv_backup_source(snap: Snapshot) -> list[Violation]:
    """BACKUP-SOURCE: each rank reports one ``backup_host_indices`` entry per ``ongoing_backup`` entry, and the
    host slots a pending L2→L3 backup is still to read hold the pages it was enqueued for: in order, they are the
    host copy of the last ``len(slots)`` tokens of the path that ends at its last fragment. So none of them is
    free, held by a prefetch or the release queue, or another node's (HOST-CONSERVATION gives each slot one
    owner) while the backup thread has yet to read it (sglang.md §9 #15)."""
    out: list[Violation] = []
    for rank in snap.ranks:
        backups, reads = rank.ongoing_backup, rank.backup_host_indices
        if len(reads) != len(backups):
            problem = f"backup_host_indices has {len(reads)} entries for {len(backups)} backups in flight"
            out.append(Violation("BACKUP-SOURCE", rank.rank, None, problem))
            continue
        by_id = rank.by_id
        for index, (fragments, slots) in enumerate(zip(backups, reads, strict=True)):
            if not slots:
                continue  # run already (its ack pending): it reads nothing more
            if not fragments:
                problem = f"backup {index} reads host slots {list(slots[:8])} for no node in the tree"
                out.append(Violation("BACKUP-SOURCE", rank.rank, None, problem))
                continue
            # Walk up from the last fragment, matching its path's host copy against the slots from the end.
            need, node_id = len(slots), fragments[-1]
            while need > 0:
                node = by_id.get(node_id)
                if node is None and need == len(slots):
                    problem = (
                        f"backup {index} reads host slots {list(slots[:8])} for {_path(node_id)}, which is not "
                        f"in the tree (those slots are now {_where_now(rank, slots)})"
                    )
                    out.append(Violation("BACKUP-SOURCE", rank.rank, None, problem))
                    break
                if node is None:
                    problem = (
                        f"backup {index} reads {need} host slots more than the path to "
                        f"{_path(fragments[-1])} holds"
                    )
                    out.append(Violation("BACKUP-SOURCE", rank.rank, None, problem))
                    break
                take = min(need, node.key_len)
                wanted = slots[need - take : need]
                held = None if node.host_value is None else node.host_value[node.key_len - take :]
                if held != wanted:
                    copy = "it has no host copy" if held is None else f"its host copy is {list(held[:8])}"
                    problem = (
                        f"backup {index} reads host slots {list(wanted[:8])} for this node's pages, but {copy} "
                        f"(those slots are now {_where_now(rank, wanted)})"
                    )
                    out.append(Violation("BACKUP-SOURCE", rank.rank, node.id, problem))
                    break
                need, node_id = need - take, node.parent_id
    return out


def _idle_and_drained(rank: RankSnapshot) -> bool:
    return not rank.requests and not rank.ongoing_prefetch and all(length == 0 for _, length in rank.queues)


def inv_idle_drained(snap: Snapshot) -> list[Violation]:
    """IDLE-DRAINED: with no request running or prefetching and every queue empty, every in-flight table
    is empty, every counter is zero and no slot is held outside the tree (sglang.md §9 #12)."""
    out: list[Violation] = []
    for rank in snap.ranks:
        if not _idle_and_drained(rank):
            continue
        problems = []
        if rank.ongoing_write_through or rank.ongoing_load_back or rank.ongoing_backup:
            problems.append("in-flight tables not empty")
        if rank.prefetch_tokens_occupied:
            problems.append(f"prefetch_tokens_occupied {rank.prefetch_tokens_occupied}")
        if rank.protected_size:
            problems.append(f"protected_size {rank.protected_size}")
        if any(n.lock_ref or n.host_ref_counter for n in rank.nodes):
            problems.append("a node is still locked or host-protected")
        if rank.device.held or rank.host.held:
            problems.append("slots held outside the tree")
        if problems:
            out.append(Violation("IDLE-DRAINED", rank.rank, None, "; ".join(problems)))
    return out


def _load_locks(rank: RankSnapshot, node: NodeId) -> int:
    """The locks ``node`` holds for ``rank``'s load backs in flight: one per load whose anchor is ``node`` or
    below it (``inc_lock_ref`` locks the anchor's path up to the root)."""
    return sum(
        1
        for anchor in rank.ongoing_load_back
        if anchor.namespace == node.namespace and anchor.path[: len(node.path)] == node.path
    )


def _newest_part(part: tuple[NodeId, ...], whole: tuple[NodeId, ...]) -> bool:
    return len(part) <= len(whole) and whole[len(whole) - len(part) :] == part


def _rank_view(rank: RankSnapshot, loads_apart: bool = False) -> tuple[object, ...]:
    """Everything that must be equal across ranks (slot numbers and rank-local progress excluded). With
    ``loads_apart`` (D-68: each rank retires its own finished loads) the load backs in flight are left out: a
    node's locks count without its loads' and its in-flight names without ``load_back``."""
    nodes = tuple(
        (
            n.id,
            n.key_len,
            n.state,
            n.hash_value,
            n.lock_ref - _load_locks(rank, n.id) if loads_apart else n.lock_ref,
            n.host_ref_counter,
            n.hit_count,
            n.priority,
            tuple(f for f in n.in_flight if f != InFlight.LOAD_BACK) if loads_apart else n.in_flight,
        )
        for n in rank.nodes
    )
    prefetch = tuple((p.rid, p.anchor, p.tokens, p.hit_pages) for p in rank.ongoing_prefetch)
    return (
        nodes,
        rank.evictable_size,
        rank.protected_size,
        rank.ongoing_write_through,
        () if loads_apart else rank.ongoing_load_back,
        rank.ongoing_backup,
        prefetch,
        rank.prefetch_tokens_occupied,
        rank.requests,
        len(rank.device.free),
        len(rank.host.free),  # what is being released or still read by I/O threads may differ
    )


def inv_ranks_equal(snap: Snapshot) -> list[Violation]:
    """RANKS-EQUAL: every rank has the same tree, counters, in-flight tables and requests (seed §3.7)."""
    if len(snap.ranks) < 2:
        return []
    apart = snap.loads_retired_per_rank
    reference = _rank_view(snap.ranks[0], apart)
    names = ("nodes", "evictable_size", "protected_size", "ongoing_write_through", "ongoing_load_back",
             "ongoing_backup", "ongoing_prefetch", "prefetch_tokens_occupied", "requests", "device free",
             "host free")  # fmt: skip
    out: list[Violation] = []
    first = snap.ranks[0].ongoing_load_back
    for rank in snap.ranks[1:]:
        view = _rank_view(rank, apart)
        differing = [name for name, a, b in zip(names, reference, view, strict=True) if a != b]
        # D-68: the ranks issued the same loads and each retires the oldest it finished: one's table is the
        # other's newest part
        mine = rank.ongoing_load_back
        if apart and not (_newest_part(mine, first) or _newest_part(first, mine)):
            differing.append("ongoing_load_back (not the newest part of the other's)")
        if differing:
            out.append(
                Violation("RANKS-EQUAL", rank.rank, None, f"differs from rank 0 in {', '.join(differing)}")
            )
    return out


def inv_load_stream_order(snap: Snapshot) -> list[Violation]:
    """LOAD-STREAM-ORDER: each rank reports one finished flag per load in flight, and the finished loads are
    the oldest ones (a prefix of ``ongoing_load_back``): one load stream retires its copies in issue order."""
    out: list[Violation] = []
    for rank in snap.ranks:
        flags, loads = rank.load_finished, rank.ongoing_load_back
        if len(flags) != len(loads):
            problem = f"load_finished has {len(flags)} flags for {len(loads)} loads in flight"
            out.append(Violation("LOAD-STREAM-ORDER", rank.rank, None, problem))
            continue
        for i in range(1, len(flags)):
            if flags[i] and not flags[i - 1]:
                problem = f"load finished before the older load into {_path(loads[i - 1])} (flags {flags})"
                out.append(Violation("LOAD-STREAM-ORDER", rank.rank, loads[i], problem))
                break
    return out


INVARIANTS: Final[dict[str, Invariant]] = {
    "TREE-SHAPE": inv_tree_shape,
    "EVICTED-SUFFIX": inv_evicted_suffix,
    "EVICTED-BACKUPED": inv_evicted_backuped,
    "BACKUP-CONTIGUITY": inv_backup_contiguity,
    "LOCKS": inv_locks,
    "SIZE-ACCOUNTING": inv_size_accounting,
    "LEAF-SETS": inv_leaf_sets,
    "DEVICE-CONSERVATION": inv_device_conservation,
    "HOST-CONSERVATION": inv_host_conservation,
    "HASH-CHAIN": inv_hash_chain,
    "IN-FLIGHT": inv_in_flight,
    "BACKUP-SOURCE": inv_backup_source,
    "IDLE-DRAINED": inv_idle_drained,
    "RANKS-EQUAL": inv_ranks_equal,
    "LOAD-STREAM-ORDER": inv_load_stream_order,
}


def _reclaimed_duplicate(snap: Snapshot, before: NodeRecord, after: NodeRecord) -> bool:
    """Whether a live node's lost host copy is write_back's host-duplicate reclaim (SGLang 0.5.22 on, D-48):
    the system says it reclaims (``host_duplicate_reclaim``), and the node was on both tiers, unpinned and
    with no copy in flight, and keeps its device copy unchanged."""
    return (
        snap.host_duplicate_reclaim
        and before.value is not None
        and after.value == before.value
        and before.host_ref_counter == 0
        and not before.in_flight
    )


def step_removals(before: Snapshot, after: Snapshot) -> list[Violation]:
    """STEP-REMOVAL: a node leaves the tree only unpinned (lock_ref 0 and host_ref_counter 0 before the
    step, but for the host protection of prefetches anchored there, or split off their anchor (D-57), that the
    step ended: under D-01 one drain
    revokes a prefetch and then evicts host memory for another's allocation, which may take the anchor the
    revoke let go), and a live node never loses its host copy (seed §3.2's filters: host copies go only with
    the node), except an unpinned duplicate of a device copy that stays, where the snapshot says the system
    reclaims host duplicates (``Snapshot.host_duplicate_reclaim``: write_back on SGLang 0.5.22 on, D-48). Not
    applied across ``Reset``. A split keeps the deeper fragment's path, so a vanished path is a removed node."""
    out: list[Violation] = []
    for rank_before, rank_after in zip(before.ranks, after.ranks, strict=True):
        after_ids = rank_after.by_id
        live = {p.rid for p in rank_after.ongoing_prefetch}
        ended: Counter[NodeId | None] = Counter()
        for p in rank_before.ongoing_prefetch:
            if p.rid not in live:  # its pins go with it: the anchor and what was split off it (D-57)
                ended.update((p.anchor, *p.split_off))
        for n in rank_before.nodes:
            survivor = after_ids.get(n.id)
            if survivor is None:
                if n.lock_ref or n.host_ref_counter > ended[n.id]:
                    out.append(Violation("STEP-REMOVAL", rank_after.rank, n.id, "removed while pinned"))
            elif (
                n.host_value is not None
                and survivor.host_value is None
                and not _reclaimed_duplicate(after, n, survivor)
            ):
                out.append(
                    Violation("STEP-REMOVAL", rank_after.rank, n.id, "host copy dropped from a live node")
                )
    return out


STEP_INVARIANTS: Final[dict[str, StepInvariant]] = {"STEP-REMOVAL": step_removals}


def check_all(snap: Snapshot) -> list[Violation]:
    """Every state invariant, in ``INVARIANTS`` order."""
    return [v for check in INVARIANTS.values() for v in check(snap)]


def check_step(before: Snapshot, after: Snapshot) -> list[Violation]:
    return [v for check in STEP_INVARIANTS.values() for v in check(before, after)]
