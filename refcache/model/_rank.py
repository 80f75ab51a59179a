"""One tensor-parallel rank of HiCache: the radix tree, its in-flight tables and its requests.

Theory of operation
-------------------
``RankCache`` is SGLang's ``HiRadixCache`` for one rank, minus the bytes. It owns the tree of
``TreeNode`` records, the device and host allocators, the four in-flight tables
(``ongoing_write_through``, ``ongoing_load_back``, ``ongoing_prefetch``, ``ongoing_backup``) and the
running requests; its ``cache_controller`` (``_controller.py``, SGLang's ``HiCacheController``) owns the
queues, acks and operations of the background copies, whose jobs run only when ``HiCacheModel`` says so.
Rank state changes only through methods of these two classes (``HiCacheModel`` calls them, never writes
a field), and every node state change goes through ``_transition`` and the table of ``refcache.states``.

Methods named like SGLang's do what seed §1–§4 describe. Methods that SGLang runs under a collective are
split in two — a *local* half that reports this rank's fact (``ready_write_acks``, ``can_terminate_local``,
the controller's ``parked_hits``, ...) and an *apply* half that takes the reduced value — and
``HiCacheModel`` performs the MIN/MAX between them, exactly at the points of the seed's §3.7 table. Where the sources differ the choice is recorded in
``specs/decisions.md`` under the D-number cited in a comment.

Ownership of slots (what the host/device conservation invariants check):
* device slots: free, a node's ``value``, or a running request's pages;
* host slots: free, a node's ``host_value``, a prefetch operation's ``host_indices`` (from allocation until
  inserted or released), or the host-memory release queue.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from refcache.config import HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.errors import UsageError
from refcache.hashing import Token, page_hashes, storage_namespace_seed
from refcache.model._controller import HiCacheController, L3Store, PrefetchOperation
from refcache.model._eviction import LeafHeap, eviction_key
from refcache.model._pools import DeviceAllocator, HostAllocator
from refcache.model._pure import match_len, page_align, split_at
from refcache.snapshot import NodeId
from refcache.states import NodeEvent, NodeState, PrefetchEvent, next_state

__all__ = ["RankCache", "TreeNode"]

Key = tuple[Token, ...]
ChildKey = tuple[str | None, Key]

_EVICTED: frozenset[NodeState] = frozenset(s for s in NodeState if s.evicted)
_BACKUPED: frozenset[NodeState] = frozenset(s for s in NodeState if s.backuped)


class TreeNode:
    """A radix-tree node (seed §1.1). Only ``RankCache`` touches these fields."""

    __slots__ = (
        "children",
        "creation_time",
        "hash_value",
        "hit_count",
        "host_ref_counter",
        "host_value",
        "id",
        "key",
        "last_access_time",
        "lock_ref",
        "namespace",
        "parent",
        "priority",
        "state",
        "value",
    )

    def __init__(self, node_id: int, namespace: str | None, now: int) -> None:
        self.id = node_id  # creation order on this rank; the eviction tie-break
        self.namespace = namespace  # SGLang extra_key, part of every child key below the root
        self.parent: TreeNode | None = None
        self.children: dict[ChildKey, TreeNode] = {}
        self.key: Key = ()
        self.state = NodeState.GONE  # changed only by RankCache._transition
        self.value: list[int] | None = None  # device slots; set iff state in (DEVICE, BOTH)
        self.host_value: list[int] | None = None  # host slots; set iff state in (BOTH, HOST)
        self.hash_value: list[str] | None = None  # chained page hashes, one per page; None until used
        self.lock_ref = 0  # running requests / in-flight copies pinning this node and its path
        self.host_ref_counter = 0  # prefetch anchors and L3 backups pinning host_value (per node)
        self.hit_count = 0  # bumped by insert only (never by match)
        self.priority = 0  # PriorityStrategy input; max over inserts, inherited by splits
        self.last_access_time = now  # logical access stamp (LRU/MRU)
        self.creation_time = now  # logical creation stamp (FIFO/FILO)

    @property
    def evicted(self) -> bool:
        return self.state in _EVICTED  # NodeState.evicted, read from a set: the tree walks ask it per node

    @property
    def backuped(self) -> bool:
        return self.state in _BACKUPED


@dataclass(slots=True)
class _WriteThrough:
    """An ``ongoing_write_through`` entry: the fragments of the node being copied L1→L2."""

    fragments: list[TreeNode]  # parent first; only _split_node adds to it (when the node is split)
    locked: bool  # write_through modes lock the source until the ack; write_back does not


@dataclass(slots=True)
class _Backup:
    """An ``ongoing_backup`` entry: the fragments whose host slots an L2→L3 operation pins until its ack."""

    fragments: list[TreeNode]  # parent first; only _split_node adds to it (when the node is split)


@dataclass(slots=True)
class _PrefetchEntry:
    """An ``ongoing_prefetch`` entry (scheduler side); the controller runs ``op``."""

    anchor: TreeNode  # last_host_node, host-protected until the entry goes
    tokens: Key  # page-aligned prefetch key
    namespace: str | None
    op: PrefetchOperation


@dataclass(slots=True)
class _Request:
    """A running request: its slots (tree prefix first), the pages it owns and the node it locks."""

    rid: int
    tokens: tuple[int, ...]
    namespace: str | None
    slots: list[int]  # one device slot per token; only cache_unfinished_request rewrites the prefix
    protected_len: int  # slots[:protected_len] belong to the tree; only cache_unfinished_request moves it
    owned: list[int]  # slots of the device pages it owns (freed on finish/abort); only _cache_request cuts it
    lock_node: TreeNode  # the node it holds a lock on; only cache_unfinished_request moves it
    prompt_len: int | None  # how many tokens are the prompt (None: all); read only by finish_request
    inserted_len: int = 0  # the key it already inserted (D-35, ``count_hits_per_request``)


class RankCache:
    """HiRadixCache + HiCacheController of one rank (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, l3: L3Store) -> None:
        self.cfg = config
        self.rank = rank
        self.ps = config.page_size
        self.device = DeviceAllocator(config.device_size, config.page_size)
        self.host = HostAllocator(config.host_size, config.page_size)
        self.cache_controller = HiCacheController(config, rank, self.device, self.host, l3)
        self.transitions_taken: dict[tuple[NodeState, NodeEvent], int] = {}  # coverage
        self._reset_state()

    def _reset_state(self) -> None:
        self._next_id = 0
        self._tick = 0
        self.nodes: dict[int, TreeNode] = {}
        self.root = self._new_node(None)
        self.root.state = NodeState.BOTH  # the root counts as present in both tiers (never evicted)
        self.root.value, self.root.host_value, self.root.hash_value = [], [], []
        self.root.lock_ref = 1
        self.leaves = LeafHeap(self._key_of)
        self.host_leaves = LeafHeap(self._key_of)
        self.evictable_size = 0
        self.protected_size = 0
        self.requests: dict[int, _Request] = {}
        self.ongoing_write_through: dict[int, _WriteThrough] = {}  # ack id → entry, in enqueue order
        self.ongoing_load_back: dict[int, TreeNode] = {}  # ack id → last loaded node
        self.ongoing_prefetch: dict[int, _PrefetchEntry] = {}  # rid → entry
        self.ongoing_backup: dict[int, _Backup] = {}  # storage operation id → entry
        self.prefetch_tokens_occupied = 0
        self.prefetch_loaded_tokens: dict[int, int] = {}  # D-01 only: rid → tokens its insert added

    # --- node bookkeeping ---------------------------------------------------------------------------------

    def _now(self) -> int:
        self._tick += 1
        return self._tick

    def _new_node(self, namespace: str | None) -> TreeNode:
        node = TreeNode(self._next_id, namespace, self._now())
        self._next_id += 1
        self.nodes[node.id] = node
        return node

    def _key_of(self, node_id: int) -> tuple[int, ...]:
        return eviction_key(self.cfg.radix_eviction_policy, self.nodes[node_id])

    def _transition(self, node: TreeNode, event: NodeEvent) -> None:
        before = node.state
        node.state = next_state(before, event)  # raises TransitionError before any change
        self.transitions_taken[(before, event)] = self.transitions_taken.get((before, event), 0) + 1

    def _touch(self, node: TreeNode) -> None:
        self._tick += 1  # _now(), written out: the tree walks touch every node they pass
        node.last_access_time = self._tick
        self.leaves.push(node.id)
        self.host_leaves.push(node.id)

    def _refresh_leaf(self, node: TreeNode | None) -> None:
        """Recompute ``node``'s membership in both leaf sets (seed §3.1 ①, §3.2; sglang.md §3.2)."""
        if node is None or node is self.root or node.id not in self.nodes:
            return
        evicted, unlocked = node.evicted, node.lock_ref == 0
        device_leaf = not evicted and unlocked and all(c.evicted for c in node.children.values())
        host_leaf = evicted and unlocked and not any(c.backuped for c in node.children.values())
        self.leaves.set_member(node.id, device_leaf)
        self.host_leaves.set_member(node.id, host_leaf)

    def _child_key(self, namespace: str | None, key: Key, start: int = 0) -> ChildKey:
        """The child-map key of ``key[start:]``: its namespace and first page."""
        return (namespace, key[start : start + self.ps])

    def _match_len(self, node_key: Key, key: Key, start: int) -> int:
        """Shared prefix length of ``node_key`` and ``key[start:]``, rounded down to whole pages
        (``_key_match_paged``). The tree walks move ``start`` instead of cutting the rest of the key off."""
        window = key[start : start + len(node_key)]
        if window == node_key:  # the whole node matches: the common case on a walk
            return len(node_key) - len(node_key) % self.ps
        return match_len(node_key, window, self.ps)

    def _delete(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.namespace, node.key)]
        del self.nodes[node.id]
        self.leaves.discard(node.id)
        self.host_leaves.discard(node.id)
        self._refresh_leaf(parent)

    def _node_path(self, node: TreeNode) -> Key:
        parts: list[Key] = []
        n: TreeNode | None = node
        while n is not None and n is not self.root:
            parts.append(n.key)
            n = n.parent
        return tuple(t for part in reversed(parts) for t in part)

    def node_id(self, node: TreeNode) -> NodeId | None:
        if node is self.root:
            return None
        return NodeId(node.namespace or "", self._node_path(node))

    def _prior_hash(self, parent: TreeNode, namespace: str | None) -> str | None:
        if parent is not self.root:
            hashes = self.hashes(parent)
            if hashes:
                return hashes[-1]
        return storage_namespace_seed(namespace)

    def hashes(self, node: TreeNode) -> list[str]:
        """``node``'s chained page hashes (seed §4.1), computed when first asked for — by an L3 key or a
        snapshot — and kept. The chain is a function of the node's path alone, so the value is the one an
        eager hash at insert would have stored; a tree that never meets L3 never hashes."""
        pending: list[TreeNode] = []
        n = node
        while n.hash_value is None:  # the root's list is [] (never None): the walk stops there
            pending.append(n)
            assert n.parent is not None
            n = n.parent
        for n in reversed(pending):  # parents first, each continuing its parent's chain
            assert n.parent is not None
            n.hash_value = page_hashes(n.key, self.ps, self._prior_hash(n.parent, n.namespace))
        assert node.hash_value is not None
        return node.hash_value

    # --- locks (seed §3.7; sglang.md §1.5) ----------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        n: TreeNode | None = node
        while n is not None and n is not self.root:
            if n.lock_ref == 0:
                self.evictable_size -= len(n.key)
                self.protected_size += len(n.key)
                delta -= len(n.key)
            n.lock_ref += 1
            if n.lock_ref == 1:  # locked: in neither leaf set (both need lock_ref == 0, _refresh_leaf)
                self.leaves.discard(n.id)
                self.host_leaves.discard(n.id)
            n = n.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        n: TreeNode | None = node
        while n is not None and n is not self.root:
            if n.lock_ref <= 0:
                # Never below zero (sglang.md §9 #21): decrementing an unlocked node is a caller bug.
                raise UsageError(f"dec_lock_ref on node {n.id} whose lock_ref is {n.lock_ref}")
            if n.lock_ref == 1:
                self.evictable_size += len(n.key)
                self.protected_size -= len(n.key)
                delta += len(n.key)
            n.lock_ref -= 1
            if n.lock_ref == 0:  # unlocked: it may be a leaf-set member again
                self._refresh_leaf(n)
            n = n.parent
        return delta

    def _protect_host(self, node: TreeNode) -> None:
        node.host_ref_counter += 1

    def _release_host(self, node: TreeNode) -> None:
        if node.host_ref_counter == 0:
            raise UsageError("Host reference counter is already zero.")
        node.host_ref_counter -= 1

    # --- match and split (seed §2.1; sglang.md §2.1-2.2) --------------------------------------------------

    def page_aligned(self, key: Key) -> Key:
        return key[: page_align(len(key), self.ps)]

    def match_prefix(self, key: Key, namespace: str | None) -> tuple[list[int], TreeNode, int, TreeNode]:
        """``(device_indices, last_node, host_hit_length, last_host_node)`` for a page-aligned prefix."""
        key = self.page_aligned(key)
        node = self.root
        self._touch(node)
        values: list[int] = []
        pos = 0  # key[:pos] is matched
        while pos < len(key):
            child = node.children.get(self._child_key(namespace, key, pos))
            if child is None:
                break
            self._touch(child)
            plen = self._match_len(child.key, key, pos)
            if plen < len(child.key):
                new = self._split_node(child, plen)
                if not new.evicted:
                    assert new.value is not None
                    values += new.value
                node = new
                break
            if not child.evicted:
                assert child.value is not None
                values += child.value
            node = child
            pos += plen
        host_hit_length = 0
        n = node
        while n.evicted:
            assert n.host_value is not None and n.parent is not None
            host_hit_length += len(n.host_value)
            n = n.parent
        last_host_node = node
        while not last_host_node.backuped:
            assert last_host_node.parent is not None
            last_host_node = last_host_node.parent
        return values, node, host_hit_length, last_host_node

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Split ``child`` after ``split_len`` key elements; returns the new prefix node (its parent)."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key) and split_len % self.ps == 0
        self._transition(child, NodeEvent.SPLIT)
        new = self._new_node(child.namespace)
        new.state = child.state  # the fragment copies the split node's state (a SPLIT self-loop)
        new.priority = child.priority
        new.lock_ref = child.lock_ref
        new.hit_count = child.hit_count
        new.key, child.key = child.key[:split_len], child.key[split_len:]
        if child.value is not None:
            top, bottom = split_at(child.value, split_len)
            new.value, child.value = list(top), list(bottom)
        if child.host_value is not None:
            top, bottom = split_at(child.host_value, split_len)
            new.host_value, child.host_value = list(top), list(bottom)
        if child.hash_value is not None:
            pages = split_len // self.ps
            new.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        new.parent = parent
        parent.children[self._child_key(new.namespace, new.key)] = new
        new.children = {self._child_key(child.namespace, child.key): child}
        child.parent = new
        # A pending copy covers the whole original range: record the new fragment with it, and pin the
        # fragment's host slots like the original's (sglang.md §9 #15). D-07.
        for wt in self.ongoing_write_through.values():
            if child in wt.fragments:
                wt.fragments.insert(wt.fragments.index(child), new)
        for backup in () if self.cfg.backup_protects_passed_node_only else self.ongoing_backup.values():
            if child in backup.fragments:
                backup.fragments.insert(backup.fragments.index(child), new)
                self._protect_host(new)
        self._refresh_leaf(new)
        self._refresh_leaf(child)
        return new

    # --- insert (sglang.md §2.3) --------------------------------------------------------------------------

    def insert(
        self,
        key: Key,
        value: list[int],
        namespace: str | None,
        *,
        chunked: bool,
        priority: int = 0,
        inserted_len: int | None = None,
    ) -> int:
        """Insert a page-aligned ``key`` with device ``value``; returns the device-matched prefix length.

        With ``count_hits_per_request`` (D-35, SGLang 0.5.23) a request's insert counts a hit on every node,
        refilled ones included, that ends past ``inserted_len`` (what that request inserted before; None:
        the whole key, no hit), chunked or not; otherwise on the matched device nodes and the new leaf unless
        ``chunked``."""
        per_request = self.cfg.count_hits_per_request
        floor = 0
        if per_request:
            chunked = inserted_len is None
            floor = len(key) if inserted_len is None else inserted_len
        assert len(key) % self.ps == 0 and len(value) == len(key)
        # Seed §3.5: write_back never writes on hits; chunked prefill is never counted.
        counts_hits = self.cfg.hicache_write_policy is not WritePolicy.WRITE_BACK and not chunked
        node = self.root
        self._touch(node)
        total_prefix_length = 0
        pos = 0  # key[:pos] and value[:pos] are placed
        while pos < len(key):
            child = node.children.get(self._child_key(namespace, key, pos))
            if child is None:
                break
            # max of the inserts; before the touch re-keys it in the heaps. D-36: 0.5.23 raises it only on the
            # matched part, after a split (``priority_after_split``).
            if priority > child.priority and not self.cfg.priority_after_split:
                child.priority = priority
            self._touch(child)
            plen = self._match_len(child.key, key, pos)
            if plen < len(child.key):
                child = self._split_node(child, plen)
            if priority > child.priority:
                child.priority = priority
                if self.cfg.priority_after_split:  # re-key it in the leaf heaps at its new priority
                    self.leaves.push(child.id)
                    self.host_leaves.push(child.id)
            if child.evicted:
                self._refill(child, value[pos : pos + plen])
                if per_request and counts_hits and pos + plen > floor:
                    self._inc_hit_count(child)
            else:
                if counts_hits and not (per_request and pos + plen <= floor):
                    self._inc_hit_count(child)
                total_prefix_length += plen
            node = child
            pos += plen
        if pos < len(key):
            leaf = self._new_node(namespace)
            leaf.priority = priority
            leaf.key = key[pos:]
            leaf.value = value[pos:]
            leaf.parent = node  # leaf.hash_value stays None until hashes() needs it
            self._transition(leaf, NodeEvent.INSERT_LEAF)
            node.children[self._child_key(namespace, leaf.key)] = leaf
            self.evictable_size += len(leaf.key)
            self._refresh_leaf(leaf)
            self._refresh_leaf(node)
            if counts_hits and not (per_request and len(key) <= floor):
                self._inc_hit_count(leaf)
        return total_prefix_length

    def _refill(self, node: TreeNode, value: list[int]) -> None:
        """Insert over a host-only node: it gets recomputed device slots (``value``, a fresh list that the
        node keeps) and keeps its host copy."""
        self._transition(node, NodeEvent.INSERT_REFILL)
        node.value = value
        self.evictable_size += len(value)
        self._refresh_leaf(node)
        self._refresh_leaf(node.parent)

    def _inc_hit_count(self, node: TreeNode) -> None:
        node.hit_count += 1
        self.leaves.push(node.id)
        self.host_leaves.push(node.id)
        if not node.backuped and node.hit_count >= self.cfg.write_through_threshold:
            self.write_backup(node)

    # --- L1 -> L2 (seed §2.4, §3.5) -----------------------------------------------------------------------

    def write_backup(self, node: TreeNode, *, write_back: bool = False) -> int:
        """Allocate host slots and queue the device→host copy; returns tokens queued (0 on failure)."""
        assert node.value is not None and node.parent is not None
        if not write_back and not node.parent.backuped:
            return 0  # keep backups contiguous from the root (sglang.md §2.4 [0.5.20]). D-04.
        host_indices = self.cache_controller.write(node.value, node.id)
        if host_indices is None:
            # D-37: 0.5.23 evicts only the shortfall (``evict_host_shortfall``), 0.5.20 the whole size.
            short = self.host.available_size() if self.cfg.evict_host_shortfall else 0
            self.evict_host(len(node.value) - short)
            host_indices = self.cache_controller.write(node.value, node.id)
        if host_indices is None:
            return 0
        self._transition(node, NodeEvent.WRITE_BACKUP)
        node.host_value = host_indices
        self.ongoing_write_through[node.id] = _WriteThrough([node], locked=not write_back)
        if not write_back:
            self.inc_lock_ref(node)
        self._refresh_leaf(node)
        self._refresh_leaf(node.parent)
        return len(host_indices)

    def ready_write_acks(self) -> int:
        """Local half of ``writing_check``: the finished prefix of the write stream."""
        return self.cache_controller.ready_write_acks()

    def writing_check_apply(self, finish_count: int) -> int:
        """Retire ``finish_count`` write acks (the MIN over ranks): unlock, then chain L2→L3."""
        for ack_id in self.cache_controller.pop_write_acks(finish_count):
            entry = self.ongoing_write_through.pop(ack_id)
            if self.cfg.enable_storage:
                self.write_backup_storage(entry.fragments)
            if entry.locked:
                self.dec_lock_ref(entry.fragments[-1])
        return finish_count

    def write_backup_storage(self, fragments: list[TreeNode]) -> None:
        """Queue the L2→L3 write of a node (all fragments of it, if it was split meanwhile)."""
        keys = [h for f in fragments for h in self.hashes(f)]
        op_id = self.cache_controller.write_storage(keys)
        if self.cfg.backup_protects_passed_node_only:
            fragments = fragments[-1:]  # D-07 option: 0.5.20 pins only the node it was passed (§9 #15)
        self.ongoing_backup[op_id] = _Backup(list(fragments))
        for f in fragments:
            self._protect_host(f)

    # --- L1 eviction (seed §3.1) --------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` device tokens if unlocked leaves allow; returns tokens evicted."""
        num_evicted = 0
        skipped: list[int] = []
        staged: list[tuple[TreeNode, list[int]]] = []
        write_back = self.cfg.hicache_write_policy is WritePolicy.WRITE_BACK
        while num_evicted < num_tokens:
            node_id = self.leaves.pop()
            if node_id is None:
                break
            x = self.nodes[node_id]
            if x.backuped:
                num_evicted += self._evict_backuped(x)
            elif not write_back:
                num_evicted += self._evict_regular(x)
            elif self.write_backup(x, write_back=True) > 0:
                # Detach now so x is no leaf candidate again; its device slots stay allocated until the
                # blocking flush below has copied them (sglang.md §2.6 write_back).
                self._protect_host(x)
                assert x.value is not None
                staged.append((x, x.value))
                self._transition(x, NodeEvent.EVICT_BACKUPED)
                self.evictable_size -= len(x.value)
                x.value = None
                num_evicted += len(staged[-1][1])
                self._refresh_leaf(x)
                self._refresh_leaf(x.parent)
            else:
                # No host memory even after evict_host: a failed backup is never treated as done
                # (sglang.md §9 #7). Flush what is staged, then drop x.
                self._flush_staged(staged)
                dropped = self._drop_no_host(x)
                if dropped == 0:
                    skipped.append(node_id)
                num_evicted += dropped
        self._flush_staged(staged)
        for node_id in skipped:
            self.leaves.push(node_id)
        return num_evicted

    def _flush_staged(self, staged: list[tuple[TreeNode, list[int]]]) -> None:
        if not staged:
            return
        self.writing_check_blocking()  # rank-local: wait for this rank's own copies (no collective)
        for node, device_slots in staged:
            self.device.free(device_slots)
            self._release_host(node)
        staged.clear()

    def writing_check_blocking(self) -> None:
        """``writing_check(write_back=True)`` on this rank once every rank's writes have completed."""
        self.cache_controller.flush_writes()
        self.writing_check_apply(len(self.cache_controller.ack_write_queue))

    def _evict_backuped(self, node: TreeNode) -> int:
        assert node.value is not None
        n = len(node.value)
        self._transition(node, NodeEvent.EVICT_BACKUPED)
        self.device.free(node.value)
        node.value = None
        self.evictable_size -= n
        self._refresh_leaf(node)
        self._refresh_leaf(node.parent)
        return n

    def _evict_regular(self, node: TreeNode) -> int:
        assert node.value is not None
        assert not node.children, "a device-only node with children cannot be evicted (backup contiguity)"
        n = len(node.value)
        self._transition(node, NodeEvent.EVICT_REGULAR)
        self.device.free(node.value)
        self.evictable_size -= n
        self._delete(node)
        return n

    def _drop_no_host(self, node: TreeNode) -> int:
        """Drop a device leaf whose write-back found no host memory; returns tokens freed.

        SGLang 0.5.20 drops the node with its host-only subtree unless some node there is pinned. Here a
        node with children stays on the device (returns 0): its children are pinned, or were written back
        by this very eviction, and are never dropped with it. D-10; ``drop_subtree_without_host`` follows
        0.5.20 instead.
        """
        if node.children and not (self.cfg.drop_subtree_without_host and self._drop_host_subtree(node)):
            return 0
        assert node.value is not None
        n = len(node.value)
        self._transition(node, NodeEvent.DROP_NO_HOST)
        self.device.free(node.value)
        self.evictable_size -= n
        self._delete(node)
        return n

    def _drop_host_subtree(self, node: TreeNode) -> bool:
        """Free and remove every descendant of the device leaf ``node`` (all host-only), unless one of them
        is pinned (``host_ref_counter > 0``): then nothing changes and the answer is False."""
        below: list[TreeNode] = []
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            below.append(n)
            stack.extend(n.children.values())
        if any(n.host_ref_counter > 0 for n in below):
            return False
        for n in reversed(below):  # every node after its descendants
            assert n.host_value is not None and n.value is None, "a device leaf's descendants are host-only"
            self._transition(n, NodeEvent.EVICT_HOST)
            self.host.free(n.host_value)
            self._delete(n)
        return True

    # --- L2 eviction (seed §3.2) --------------------------------------------------------------------------

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from host-only leaves; returns tokens freed."""
        num_evicted = 0
        skipped: list[int] = []
        while num_evicted < num_tokens:
            node_id = self.host_leaves.pop()
            if node_id is None:
                break
            x = self.nodes[node_id]
            if not x.evicted:  # filter ①: still on the device (never true for a leaf-set member)
                skipped.append(node_id)
                continue
            if x.host_ref_counter > 0:  # filter ②: a prefetch or backup holds it
                skipped.append(node_id)
                continue
            assert x.host_value is not None
            self._transition(x, NodeEvent.EVICT_HOST)  # filter ③: removal from the tree
            self.host.free(x.host_value)
            num_evicted += len(x.host_value)
            self._delete(x)
        for node_id in skipped:
            self.host_leaves.push(node_id)
        return num_evicted

    # --- L2 -> L1 (seed §2.3) -----------------------------------------------------------------------------

    def load_back(self, node: TreeNode) -> list[int] | None:
        """Queue the host→device copy of the evicted chain ending at ``node``; all or nothing."""
        nodes_to_load: list[TreeNode] = []
        ancestor = node
        while ancestor.evicted:
            assert ancestor.backuped and ancestor.parent is not None, "No backup available on evicted nodes"
            nodes_to_load.insert(0, ancestor)
            ancestor = ancestor.parent
        self.inc_lock_ref(ancestor)  # the ancestor must survive the eviction below
        host_indices = [s for n in nodes_to_load for s in (n.host_value or [])]
        if len(host_indices) < self.cfg.load_back_threshold:
            self.dec_lock_ref(ancestor)
            return None
        for n in nodes_to_load:  # pin the source pages across a nested evict_host (sglang.md §9 #8). D-05.
            self._protect_host(n)
        device_indices = self.cache_controller.load(host_indices, node.id)
        if device_indices is None:
            self.evict(len(host_indices))
            device_indices = self.cache_controller.load(host_indices, node.id)
        self.dec_lock_ref(ancestor)
        for n in nodes_to_load:
            self._release_host(n)
        if device_indices is None:
            return None
        self.ongoing_load_back[node.id] = node
        offset = 0
        for n in nodes_to_load:
            assert n.host_value is not None
            self._transition(n, NodeEvent.LOAD_BACK)
            n.value = device_indices[offset : offset + len(n.host_value)]
            offset += len(n.host_value)
            self._refresh_leaf(n)
        self.evictable_size += len(device_indices)
        self.inc_lock_ref(node)  # held until loading_check retires the ack
        for n in nodes_to_load:
            self._refresh_leaf(n.parent)
        return device_indices

    def ready_load_acks(self) -> int:
        """Local half of ``loading_check``: the finished prefix of the load stream."""
        return self.cache_controller.ready_load_acks()

    def loading_check_apply(self, finish_count: int) -> int:
        """Retire ``finish_count`` load acks (the MIN over ranks): unlock the loaded nodes."""
        for ack_id in self.cache_controller.pop_load_acks(finish_count):
            self.dec_lock_ref(self.ongoing_load_back.pop(ack_id))
        return finish_count

    # --- L3 -> L2 prefetch (seed §2.2, §3.6) --------------------------------------------------------------

    def prefetch_from_storage(self, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None) -> str:
        """The three admission layers; returns "" when admitted, else the refusing layer's name."""
        tokens = self.page_aligned(tokens)
        if self.cfg.allocate_prefetch_after_query:
            return self._prefetch_from_storage_0520(rid, anchor, tokens, namespace)
        if len(tokens) < self.cfg.effective_prefetch_threshold:
            return "below_threshold"
        if self.prefetch_tokens_occupied >= self.cfg.prefetch_capacity_limit:
            return "rate_limited"
        self._protect_host(anchor)
        host_indices = self.host.alloc(len(tokens))
        if host_indices is None:
            self.evict_host(len(tokens))
            host_indices = self.host.alloc(len(tokens))
        if host_indices is None:
            self._release_host(anchor)
            return "no_host_memory"
        op = self.cache_controller.prefetch(rid, tokens, self._prior_hash(anchor, namespace), host_indices)
        self.ongoing_prefetch[rid] = _PrefetchEntry(anchor, tokens, namespace, op)
        self.prefetch_tokens_occupied += len(tokens)
        return ""

    # --- D-01: 0.5.20's pipeline (allocate_prefetch_after_query) ---------------------------------------------

    def _prefetch_from_storage_0520(
        self, rid: int, anchor: TreeNode, tokens: Key, namespace: str | None
    ) -> str:
        """0.5.20's ``prefetch_from_storage``: the threshold as configured (not raised to a page), the cap
        ``int(0.5 * host_size)``, and no host memory until the drain of the hit query."""
        if len(tokens) < self.cfg.prefetch_threshold:
            return "below_threshold"
        if self.prefetch_tokens_occupied >= self.cfg.prefetch_capacity_limit_0520:
            return "rate_limited"
        self._protect_host(anchor)
        op = self.cache_controller.prefetch_unallocated(rid, tokens, self._prior_hash(anchor, namespace))
        self.ongoing_prefetch[rid] = _PrefetchEntry(anchor, tokens, namespace, op)
        self.prefetch_tokens_occupied += len(tokens)
        return ""

    def revoke_pending_prefetch(self, rid: int) -> bool:
        """``_revoke_pending_prefetch``: drop the entry (by request id, as 0.5.20 keys it)."""
        entry = self.ongoing_prefetch.pop(rid, None)
        if entry is None:
            return False
        self._release_host(entry.anchor)
        self.prefetch_tokens_occupied = max(0, self.prefetch_tokens_occupied - len(entry.tokens))
        return True

    def handle_prefetch_result(self, rid: int) -> None:
        """``_handle_prefetch_result``: insert the drained completed tokens of the entry's operation; the
        operation keeps ``[completed_tokens, ...)`` until the drain of its final ack frees it."""
        entry = self.ongoing_prefetch.pop(rid)
        op = entry.op
        done = op.completed_tokens - op.completed_tokens % self.ps
        matched = self._insert_helper_host(
            entry.anchor,
            entry.tokens[:done],
            op.host_indices[:done],
            op.hash_value[: done // self.ps],
            entry.namespace,
        )
        self.host.free(op.host_indices[:matched])
        self._release_host(entry.anchor)
        self.prefetch_tokens_occupied -= len(entry.tokens)
        self.prefetch_loaded_tokens[rid] = done - matched

    def check_prefetch_progress_local(self, rid: int) -> bool:
        """Local half of 0.5.20's ``check_prefetch_progress``: ``is_terminated() or can_terminate``."""
        op = self.ongoing_prefetch[rid].op
        policy = self.cfg.hicache_storage_prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return op.terminated  # only the drain of the final ack completes it
        return op.terminated or self._prefetch_timed_out_0520(op)

    def _prefetch_timed_out_0520(self, op: PrefetchOperation) -> bool:
        # 0.5.20's comparison, in its float arithmetic on clock readings in seconds (so the boundary rounds as
        # there, D-39): now - start > min(max, base + per_ki_token * tokens / 1024), tokens = the hits
        # recorded so far, max = 30 s (0.5.20's default).
        elapsed = self.cache_controller.clock_us / 1_000_000 - op.start_us / 1_000_000
        tokens = len(op.hash_value) * self.ps
        limit = min(
            PREFETCH_TIMEOUT_MAX_S,
            self.cfg.prefetch_timeout_base + self.cfg.prefetch_timeout_per_ki_token * tokens / 1024,
        )
        return elapsed > limit

    def terminate_prefetch_0520(self, rid: int) -> None:
        """Terminate, then revoke (no host memory yet) or insert what was drained."""
        op = self.ongoing_prefetch[rid].op
        op.terminated = True
        if not op.allocated:
            self.revoke_pending_prefetch(rid)
        else:
            self.handle_prefetch_result(rid)

    def release_aborted_request_0520(self, rid: int) -> None:
        """0.5.20's ``release_aborted_request``."""
        self.prefetch_loaded_tokens.pop(rid, None)
        entry = self.ongoing_prefetch.get(rid)
        if entry is None:
            return
        op = entry.op
        op.terminated = True
        if not op.allocated:
            self.revoke_pending_prefetch(rid)
            return
        self._release_host(entry.anchor)
        del self.ongoing_prefetch[rid]
        self.cache_controller.append_host_mem_release(op.host_indices[: op.completed_tokens])
        self.prefetch_tokens_occupied -= len(entry.tokens)

    def drain_storage_control_queues_0520(self, hit: int, acks: int, backup: int, release: int) -> int:
        """0.5.20's drain: allocate for (or revoke) queried prefetches, apply the I/O acks (the final one
        inserts a live entry's pages and frees the operation's unread tail), backups, releases. Returns the
        prefetches revoked."""
        ctrl = self.cache_controller
        revoked = 0
        threshold = self.cfg.prefetch_threshold
        for _ in range(hit):
            op = ctrl.prefetch_hit_queue.popleft()
            rid = op.request_id
            if rid not in self.ongoing_prefetch:
                continue
            if op.terminated or op.storage_hit_count < threshold:
                revoked += self.revoke_pending_prefetch(rid)
                continue
            length = op.storage_hit_count
            slots = self.host.alloc(length)
            if slots is None:
                self.evict_host(length)
                slots = self.host.alloc(length)
            if slots is None:  # a shorter page-aligned prefix
                available = self.host.available_size()
                length = min(op.storage_hit_count, available - available % self.ps)
                if length >= threshold:
                    slots = self.host.alloc(length)
            if slots is None:
                revoked += self.revoke_pending_prefetch(rid)
                continue
            op.storage_hit_count = length
            op.hash_value = op.hash_value[: length // self.ps]
            op.host_indices = slots
            op.allocated = True
            op.move(PrefetchEvent.QUERY_HIT)
            ctrl.prefetch_buffer.append(op)
        for _ in range(acks):
            op, completed, final = ctrl.ack_prefetch_queue.popleft()
            if completed is not None and op.request_id in self.ongoing_prefetch:
                op.completed_tokens = completed
            if final:
                if op.request_id in self.ongoing_prefetch:
                    self.handle_prefetch_result(op.request_id)
                self.host.free(op.host_indices[op.completed_tokens :])
                ctrl.pending_prefetch_ops.remove(op)
        for op_id in ctrl.pop_backup_acks(backup):
            for fragment in self.ongoing_backup.pop(op_id).fragments:
                self._release_host(fragment)
        for page in ctrl.pop_host_mem_releases(release):
            self.host.free(page)
        ctrl.advance_prefetch_io()
        return revoked

    def forget_dead_prefetches(self) -> None:
        """Operations revoked before any allocation, and no longer queued, hold nothing (0.5.20 drops them)."""
        ctrl = self.cache_controller
        queued = {op.id for op in ctrl.prefetch_queue} | {op.id for op in ctrl.prefetch_hit_queue}
        if ctrl.prefetch_parked is not None:
            queued.add(ctrl.prefetch_parked.op.id)
        live = {e.op.id for e in self.ongoing_prefetch.values()}
        ctrl.pending_prefetch_ops = [
            op for op in ctrl.pending_prefetch_ops if op.allocated or op.id in queued or op.id in live
        ]

    def can_terminate_local(self, rid: int) -> tuple[bool, bool]:
        """Local half of ``can_terminate_prefetch``: ``(can_terminate, is_terminated)`` on this rank."""
        op = self.ongoing_prefetch[rid].op
        policy = self.cfg.hicache_storage_prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True, op.terminated
        # An empty hash list is never "complete" (sglang.md §9 #13).
        completed = len(op.hash_value) > 0 and op.completed_tokens == len(op.hash_value) * self.ps
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return completed, op.terminated
        return completed or self._prefetch_timed_out(op), op.terminated

    def _prefetch_timed_out(self, op: PrefetchOperation) -> bool:
        # timeout = base + per_page * pages, per_page = page_size / 1024 * per_ki_token (seed §3.6), in
        # integer microseconds scaled by 1024 so that no rounding is involved.
        elapsed_x1024 = (self.cache_controller.clock_us - op.start_us) * 1024
        limit_x1024 = (
            self.cfg.prefetch_timeout_base_us * 1024
            + len(op.hash_value) * self.ps * self.cfg.prefetch_timeout_per_ki_token_us
        )
        return elapsed_x1024 > limit_x1024

    def terminate_prefetch(self, rid: int) -> int:
        """``terminate_prefetch``: stop the operation; returns this rank's completed tokens."""
        return self.cache_controller.terminate_prefetch(self.ongoing_prefetch[rid].op)

    def finish_prefetch(self, rid: int, min_completed_tokens: int) -> int:
        """Insert the common prefix (MIN over ranks) as host-only nodes; returns tokens newly inserted."""
        entry = self.ongoing_prefetch.pop(rid)
        op = entry.op
        # Everything read so far; any unread tail stays with the I/O helper.
        taken = self.cache_controller.take(op, op.completed_tokens)
        inserted = taken[:min_completed_tokens]
        matched = self._insert_helper_host(
            entry.anchor,
            entry.tokens[:min_completed_tokens],
            inserted,
            op.hash_value[: min_completed_tokens // self.ps],
            entry.namespace,
        )
        if matched:
            self.host.free(inserted[:matched])  # already in the tree: duplicates
        self.cache_controller.append_host_mem_release(taken[min_completed_tokens:])
        self._release_host(entry.anchor)
        self.prefetch_tokens_occupied -= len(entry.tokens)
        return min_completed_tokens - matched

    def release_aborted_request(self, rid: int) -> None:
        entry = self.ongoing_prefetch.pop(rid)
        ctrl = self.cache_controller
        completed = ctrl.terminate_prefetch(entry.op)
        ctrl.append_host_mem_release(ctrl.take(entry.op, completed))
        self._release_host(entry.anchor)
        self.prefetch_tokens_occupied -= len(entry.tokens)

    def _insert_helper_host(
        self, node: TreeNode, key: Key, host_value: list[int], hash_value: list[str], namespace: str | None
    ) -> int:
        """Attach fetched pages below ``node`` as host-only nodes; returns tokens not attached (freed).
        The anchor ``node`` and every matched child count as accessed (D-33)."""
        self._touch(node)
        matched = 0
        while key:
            child = node.children.get(self._child_key(namespace, key))
            if child is None:
                break
            self._touch(child)
            plen = self._match_len(child.key, key, 0)
            key, host_value, hash_value = key[plen:], host_value[plen:], hash_value[plen // self.ps :]
            matched += plen
            if plen < len(child.key):
                child = self._split_node(child, plen)
            node = child
        if not key:
            return matched
        if not node.backuped:
            # Never hang host-only nodes under a device-only node (sglang.md §9 #6): drop the data. D-06.
            return matched + len(key)
        leaf = self._new_node(namespace)
        leaf.key = key
        leaf.host_value = list(host_value)
        leaf.hash_value = list(hash_value)
        leaf.priority = node.priority
        if node is self.root and self.cfg.allocate_prefetch_after_query:
            leaf.priority = ROOT_PRIORITY_0520  # D-01: 0.5.20's new node takes its root's priority
        leaf.parent = node
        self._transition(leaf, NodeEvent.PREFETCH_INSERT)
        node.children[self._child_key(leaf.namespace, key)] = leaf
        self._refresh_leaf(leaf)
        self._refresh_leaf(node)
        return matched

    # --- control queues (seed §3.7) -----------------------------------------------------------------------

    def control_queue_sizes(self) -> tuple[int, int, int]:
        """Local half of ``drain_storage_control_queues``: the lengths of the three control queues."""
        return self.cache_controller.control_queue_sizes()

    def drain_storage_control_queues_apply(self, revoke: int, backup: int, release: int) -> int:
        """Process the MIN-reduced number of entries of each control queue."""
        ctrl = self.cache_controller
        revoked = 0
        for rid, op_id in ctrl.pop_revokes(revoke):
            entry = self.ongoing_prefetch.get(rid)
            # The request may have terminated or aborted meanwhile, and its id may even carry a newer
            # prefetch: revoke only the operation the query resolved (SGLang keys this by request id).
            if entry is not None and entry.op.id == op_id:
                del self.ongoing_prefetch[rid]
                self._release_host(entry.anchor)
                self.prefetch_tokens_occupied -= len(entry.tokens)
                revoked += 1
        for op_id in ctrl.pop_backup_acks(backup):
            for fragment in self.ongoing_backup.pop(op_id).fragments:
                self._release_host(fragment)
        for page in ctrl.pop_host_mem_releases(release):
            self.host.free(page)
        return revoked

    # --- requests (scheduler side; sglang.md §2.12, §2.16) --------------------------------------------------

    def key_of(self, tokens: Sequence[int]) -> Key:
        if self.cfg.is_eagle:
            return tuple((tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1))
        return tuple(tokens)

    def allocate_device(self, n: int) -> list[int] | None:
        """``alloc`` with ``evict_from_tree_cache`` of the shortfall first."""
        needed = -(-n // self.ps) * self.ps
        if self.device.available_size() < needed:
            self.evict(needed - self.device.available_size())
        return self.device.alloc(n)

    def start_request(
        self, rid: int, tokens: tuple[int, ...], namespace: str | None, prompt_len: int | None = None
    ) -> tuple[bool, int, int, int]:
        key = self.key_of(tokens)
        values, last_node, host_hit_length, _ = self.match_prefix(key, namespace)
        device_hit = len(values)
        loaded: list[int] = []
        lock_node = last_node
        if host_hit_length > 0:
            loaded_or_none = self.load_back(last_node)
            if loaded_or_none is None:
                while lock_node.evicted:
                    assert lock_node.parent is not None
                    lock_node = lock_node.parent
            else:
                loaded = loaded_or_none
        self.inc_lock_ref(lock_node)
        prefix = values + loaded
        new_slots = self.allocate_device(len(tokens) - len(prefix))
        if new_slots is None:
            self.dec_lock_ref(lock_node)
            return False, device_hit, len(loaded), 0
        owned = _whole_pages(new_slots, self.ps)
        self.requests[rid] = _Request(
            rid, tokens, namespace, prefix + new_slots, len(prefix), owned, lock_node, prompt_len
        )
        return True, device_hit, len(loaded), len(new_slots)

    def _cache_request(self, req: _Request, *, chunked: bool) -> tuple[int, int]:
        """Insert a request's aligned KV; free duplicates. Returns (prefix_len, tokens freed)."""
        key = self.page_aligned(self.key_of(req.tokens))
        prefix_len = self.insert(
            key, req.slots[: len(key)], req.namespace, chunked=chunked, inserted_len=req.inserted_len
        )
        req.inserted_len = max(req.inserted_len, len(key))
        duplicates = req.slots[req.protected_len : prefix_len]
        if duplicates:
            self.device.free(duplicates)
        # What the request still owns: the pages after the aligned key (the unaligned tail).
        req.owned = _whole_pages(req.slots[len(key) :], self.ps) if len(key) < len(req.slots) else []
        return prefix_len, len(duplicates)

    def finish_request(self, rid: int) -> tuple[int, int]:
        req = self.requests.pop(rid)
        prefix_len, freed = self._cache_request(req, chunked=False)
        if self.cfg.reinsert_prompt_prefix and req.prompt_len is not None:
            self._reinsert_prompt(req)
        if req.owned:
            self.device.free(req.owned)
            freed += len(req.slots) - len(self.page_aligned(self.key_of(req.tokens)))
        self.dec_lock_ref(req.lock_node)
        return prefix_len, freed

    def _reinsert_prompt(self, req: _Request) -> None:
        """SGLang 0.5.20: insert the page-aligned prompt again when it is a proper prefix of the cached key,
        with priority + 1 and ``chunked`` (no hit counted), which splits a node at the prompt boundary
        (D-24; ``reinsert_prompt_prefix``). Every node on that path exists: nothing is allocated."""
        assert req.prompt_len is not None
        prompt = self.page_aligned(self.key_of(req.tokens[: req.prompt_len]))
        if 0 < len(prompt) < len(self.page_aligned(self.key_of(req.tokens))):
            self.insert(prompt, req.slots[: len(prompt)], req.namespace, chunked=True, priority=1)

    def cache_unfinished_request(self, rid: int) -> None:
        req = self.requests[rid]
        self._cache_request(req, chunked=True)
        if self.cfg.count_hits_per_request and self.cfg.reinsert_prompt_prefix and req.prompt_len is not None:
            self._reinsert_prompt(req)  # 0.5.23's checkpoint is the finished insert (D-35)
        key = self.page_aligned(self.key_of(req.tokens))
        values, last_node, _, _ = self.match_prefix(key, req.namespace)
        assert len(values) == len(key), "re-match after insert must cover the whole aligned key"
        req.slots[: len(key)] = values
        req.protected_len = len(key)
        self.dec_lock_ref(req.lock_node)
        self.inc_lock_ref(last_node)
        req.lock_node = last_node

    def abort_request(self, rid: int) -> None:
        req = self.requests.pop(rid)
        if req.owned:
            self.device.free(req.owned)
        self.dec_lock_ref(req.lock_node)

    # --- reset and idleness ---------------------------------------------------------------------------------

    def busy(self) -> bool:
        return bool(
            self.requests
            or self.ongoing_write_through
            or self.ongoing_load_back
            or self.ongoing_prefetch
            or self.ongoing_backup
            or self.cache_controller.busy()
        )

    def reset(self) -> None:
        for node in list(self.nodes.values()):
            if node is not self.root:
                self._transition(node, NodeEvent.RESET)
        self._reset_state()
        self.cache_controller.reset()
        self.device.clear()  # the controller shares both allocators: cleared, never replaced
        self.host.clear()


ROOT_PRIORITY_0520: Final = -(2**63 - 1)
"""The priority of 0.5.20's root node (``-sys.maxsize``), which a prefetch insert below it hands down (D-01)."""

PREFETCH_TIMEOUT_MAX_S: Final = 30.0
"""0.5.20's default ``prefetch_timeout_max`` (D-01)."""


def _whole_pages(slots: Sequence[int], page_size: int) -> list[int]:
    """All slots of the pages that ``slots`` touch, in page order (a request owns whole pages)."""
    if page_size == 1:
        return sorted(set(slots))
    pages = sorted({s // page_size for s in slots})
    return [p * page_size + i for p in pages for i in range(page_size)]
