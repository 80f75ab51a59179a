"""The radix tree of one rank: nodes and their states, locks, match, split, insert (seed §1-§2.1; sglang.md §2.1-2.3).

Theory of operation
-------------------
``RadixTree`` is the part of SGLang's ``HiRadixCache`` that its base class ``RadixCache`` would own: the
tree of ``TreeNode`` records keyed by (namespace, first page), the two leaf sets that eviction pops from
(ordered by a sort key, ``_eviction.eviction_key``), the lock counts and the evictable / protected sizes.
It knows nothing of tiers, copies or prefetches. Where a tree change concerns them it calls a hook that
the tier layer (``_tiers.py``) fills: ``_split_inflight`` when a split node's new fragment must join the
in-flight copies that cover the original, ``_on_hit`` when an insert counts a hit on a node, ``_on_refill``
when an insert puts a host-only node back on the device. Every node
state change goes through ``_transition`` and the table of ``refcache.hicache.states``.

The rank is four layers, one concern each, in the order SGLang's classes stack them:
``_tree.RadixTree`` ← ``_tiers.TieredTree`` (L1/L2 copies, eviction, the L2→L3 backups) ←
``_prefetch.PrefetchingTree`` (L3→L2 prefetch, with its ``PrefetchPipeline`` chosen at construction) ←
``_requests.RequestCache`` (running requests) ← ``_rank.RankCache``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from itertools import takewhile
from typing import Final

from refcache.config import HiCacheConfig, WritePolicy
from refcache.errors import UsageError
from refcache.hashing import Token, page_hashes, storage_namespace_seed
from refcache.hicache.snapshot import NodeId
from refcache.hicache.states import NodeEvent, NodeState, next_state
from refcache.model._eviction import LeafHeap, eviction_key
from refcache.model._pure import match_len, page_align, split_at

ROOT_PRIORITY_SGLANG: Final = -(2**63 - 1)
"""The priority of SGLang's root node (``-sys.maxsize``): 0.5.20's HiRadixCache keeps it, UnifiedRadixCache raises it
to each insert's priority (D-51); a prefetch insert below the root hands it down (D-01)."""

__all__ = ["ChildKey", "Key", "RadixTree", "TreeNode"]

Key = tuple[Token, ...]
ChildKey = tuple[str | None, Key]

_EVICTED: frozenset[NodeState] = frozenset(s for s in NodeState if s.evicted)
_BACKUPED: frozenset[NodeState] = frozenset(s for s in NodeState if s.backuped)


def _is_evicted(node: TreeNode) -> bool:
    return node.evicted


class TreeNode:
    """A radix-tree node (seed §1.1). Only the rank's layers (``RadixTree`` and its subclasses) touch these fields."""

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
        self.state = NodeState.GONE  # changed only by RadixTree._transition
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


class RadixTree:
    """The radix tree of one rank (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int) -> None:
        self.cfg = config
        self.rank = rank
        self.ps = config.page_size
        self.transitions_taken: dict[tuple[NodeState, NodeEvent], int] = {}  # coverage
        self._reset_tree()

    def _reset_tree(self) -> None:
        self._next_id = 0
        self._tick = 0
        self.nodes: dict[int, TreeNode] = {}
        self.root = self._new_node(None)
        self.root.state = NodeState.BOTH  # the root counts as present in both tiers (never evicted)
        self.root.value, self.root.host_value, self.root.hash_value = [], [], []
        self.root.lock_ref = 1
        if self.cfg.root_priority_from_inserts:  # D-51: UnifiedRadixCache's root starts at -sys.maxsize
            self.root.priority = ROOT_PRIORITY_SGLANG
        self.leaves = LeafHeap(self._key_of)
        self.host_leaves = LeafHeap(self._key_of)
        self.evictable_size = 0
        self.protected_size = 0

    # --- the tier layer's hooks (``_tiers.TieredTree`` fills them; a bare tree has no copies) ---------------

    def _split_inflight(self, child: TreeNode, new: TreeNode) -> None:
        """``child`` was split and ``new`` is its prefix fragment: in-flight copies of ``child`` cover it too."""

    def _on_hit(self, node: TreeNode) -> None:
        """An insert counted a hit on ``node`` (its ``hit_count`` is already raised)."""

    def _on_refill(self, node: TreeNode) -> None:
        """An insert gave the host-only ``node`` device slots again (it is now on both tiers)."""

    # --- node bookkeeping -------------------------------------------------------------------------------------

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

    def _ancestors(self, node: TreeNode) -> Iterator[TreeNode]:
        """``node``, its parent, its parent's parent, ..., the root."""
        n: TreeNode | None = node
        while n is not None:
            yield n
            n = n.parent

    def _descendants(self, node: TreeNode) -> Iterator[TreeNode]:
        """Every node below ``node``, each before its own descendants (depth first)."""
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

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

    # --- locks (seed §3.7; sglang.md §1.5) --------------------------------------------------------------------

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

    # --- match and split (seed §2.1; sglang.md §2.1-2.2) ------------------------------------------------------

    def key_of(self, tokens: Sequence[int]) -> Key:
        if self.cfg.is_eagle:
            return tuple((tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1))
        return tuple(tokens)

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
        # What the match says of the tiers, stated over the matched path read upwards from its end: the host
        # hit is the run of evicted (host-only) nodes that ends it, the last host node the deepest node with a
        # host copy (the root has one, so there always is one).
        host_hit_length = sum(len(n.key) for n in takewhile(_is_evicted, self._ancestors(node)))
        last_host_node = next(n for n in self._ancestors(node) if n.backuped)
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
        if self.cfg.split_keeps_creation_time:  # D-45: SGLang 0.5.22 on; FIFO/FILO rank it as the original
            new.creation_time = child.creation_time
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
        self._split_inflight(child, new)
        self._refresh_leaf(new)
        self._refresh_leaf(child)
        return new

    # --- insert (sglang.md §2.3) ------------------------------------------------------------------------------

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

        With ``count_hits_per_request`` (D-35, SGLang 0.5.22 on) a request's insert counts a hit on every node,
        refilled ones included, that ends past ``inserted_len`` (what that request inserted before; None:
        the whole key, no hit), chunked or not; otherwise on the matched device nodes and the new leaf unless
        ``chunked``, and on the nodes it refills too under ``count_hits_on_refill`` (D-50, UnifiedRadixCache
        from SGLang 0.5.19)."""
        per_request = self.cfg.count_hits_per_request
        floor = 0
        if per_request:
            chunked = inserted_len is None
            floor = len(key) if inserted_len is None else inserted_len
        assert len(key) % self.ps == 0 and len(value) == len(key)
        # Seed §3.5: write_back never writes on hits; chunked prefill is never counted.
        counts_hits = self.cfg.hicache_write_policy is not WritePolicy.WRITE_BACK and not chunked
        node = self.root
        if self.cfg.root_priority_from_inserts:  # D-51: every insert raises the root's priority to its own
            node.priority = max(node.priority, priority)
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
                # D-50: UnifiedRadixCache counts the hit after the refill (0.5.19 on; per request from 0.5.22).
                refill_hits = per_request or self.cfg.count_hits_on_refill
                if refill_hits and counts_hits and pos + plen > floor:
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
        self._on_refill(node)
        self._refresh_leaf(node.parent)

    def _inc_hit_count(self, node: TreeNode) -> None:
        node.hit_count += 1
        self.leaves.push(node.id)
        self.host_leaves.push(node.id)
        self._on_hit(node)
