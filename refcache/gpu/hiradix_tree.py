"""The radix tree of one rank on real pools: nodes and their states, the leaf heaps, the oracle's chain
per node, locks, match, split and insert (seed §1-§2.1).

Theory of operation
-------------------
A ``TreeNode`` holds a page-aligned key and, per tier, an int64 tensor of token slots: ``value`` in the
device pool, ``host_value`` in the host pool, plus one chained page hash per page (the L3 key of the
page). Slot tensors live on the CPU whatever the pool's device; the transfers move them to the kernel's
device (seed §5.4 ①). Its state (``refcache.hicache.states.NodeState``) says which tiers hold it and changes only
through ``_transition`` and the table of ``refcache.hicache.states``.

``RadixTree`` is what SGLang's ``RadixCache`` owns under ``HiRadixCache``: the tree, the two leaf sets
(device-evictable, host-evictable; maintained incrementally and kept in lazy min-heaps), the lock counts and
the evictable / protected sizes. Eviction order is a documented total order: the policy's priority, then
the node id (creation order on this rank). Access and creation times come from a per-rank logical counter,
bumped at every node creation and every touch, so ranks that apply the same operations evict the same
nodes — wall-clock stamps would not.

It knows nothing of tiers, copies or prefetches: where a tree change concerns them it calls a hook that
the tier layer (``hiradix_tiers.TieredTree``) fills — ``_split_inflight`` when a split node's fragment must
join the copies that cover the original, ``_on_hit`` when an insert counts a hit. The layers, as in the
model (``refcache/model/_tree.py`` and its neighbours): ``hiradix_tree.RadixTree`` ←
``hiradix_tiers.TieredTree`` ← ``hiradix_prefetch.PrefetchingTree`` ← ``hiradix_requests.RequestCache`` ←
``hiradix_cache.HiRadixCache``. ``HiRadixCache.reset`` initialises every layer's state.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from refcache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import UsageError
from refcache.gpu.cache_controller import Check
from refcache.gpu.kv_oracle import KVOracle, States
from refcache.hashing import Token, page_hashes, storage_namespace_seed
from refcache.hicache.snapshot import NodeId
from refcache.hicache.states import NodeEvent, NodeState, next_state

__all__ = ["EMPTY", "ChildKey", "Key", "MatchResult", "RadixTree", "TreeNode"]

Key = tuple[Token, ...]
ChildKey = tuple[str | None, Key]

EMPTY = torch.empty(0, dtype=torch.int64)
_NO_SEEDS = torch.empty(0, dtype=torch.int32)
_NO_STATES: States = np.empty(0, dtype=np.uint64)


class TreeNode:
    """A radix-tree node (seed §1.1). Only ``RadixTree`` and the layers above it write these fields."""

    __slots__ = (
        "children",
        "creation_time",
        "hash_value",
        "hit_count",
        "host_ref_counter",
        "host_value",
        "id",
        "key",
        "kv_seeds",
        "kv_states",
        "last_access_time",
        "lock_ref",
        "namespace",
        "parent",
        "priority",
        "state",
        "value",
    )

    def __init__(self, node_id: int, namespace: str | None, now: int) -> None:
        self.id = node_id  # creation order on this rank: the eviction tie-break
        self.namespace = namespace  # SGLang's extra_key; part of every child key below the root
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: Key = ()
        self.state = NodeState.GONE  # only _transition (and a split copying it) writes this
        self.value: torch.Tensor | None = None  # device slots, int64; set iff state in (DEVICE, BOTH)
        self.host_value: torch.Tensor | None = None  # host slots; set iff state in (BOTH, HOST)
        self.hash_value: list[str] | None = None  # chained page hashes, one per page; None until used
        self.kv_states: States | None = None  # the oracle's chain state per position; None until used
        self.kv_seeds: torch.Tensor | None = None  # the seeds of kv_states (int32); None until used
        self.lock_ref = 0  # requests and in-flight device copies pinning this node and its ancestors
        self.host_ref_counter = 0  # prefetch anchors and L3 backups pinning host_value
        self.hit_count = 0  # bumped by insert, never by match
        self.priority = 0
        self.last_access_time = now  # logical stamps (see the module docstring)
        self.creation_time = now

    @property
    def evicted(self) -> bool:
        return self.state.evicted

    @property
    def backuped(self) -> bool:
        return self.state.backuped

    def protect_host(self) -> None:
        self.host_ref_counter += 1

    def release_host(self) -> None:
        if self.host_ref_counter <= 0:
            raise UsageError(f"release_host on node {self.id} whose host_ref_counter is 0")
        self.host_ref_counter -= 1

    def get_last_hash_value(self) -> str | None:
        return self.hash_value[-1] if self.hash_value else None


_PRIORITY: dict[EvictionPolicy, Callable[[TreeNode], tuple[int, ...]]] = {
    EvictionPolicy.LRU: lambda n: (n.last_access_time,),
    EvictionPolicy.LFU: lambda n: (n.hit_count, n.last_access_time),
    EvictionPolicy.FIFO: lambda n: (n.creation_time,),
    EvictionPolicy.MRU: lambda n: (-n.last_access_time,),
    EvictionPolicy.FILO: lambda n: (-n.creation_time,),
    EvictionPolicy.PRIORITY: lambda n: (n.priority, n.last_access_time),
}


class _LeafHeap:
    """A leaf set and a lazy min-heap over it: ``push`` after any change of a member's priority; stale
    entries are dropped when popped."""

    def __init__(self, priority: Callable[[TreeNode], tuple[int, ...]]) -> None:
        self._priority = priority
        self._heap: list[tuple[tuple[int, ...], int]] = []
        self.members: dict[int, TreeNode] = {}

    def _key(self, node: TreeNode) -> tuple[int, ...]:
        return (*self._priority(node), node.id)

    def add(self, node: TreeNode) -> None:
        self.members[node.id] = node
        self.push(node)

    def discard(self, node: TreeNode) -> None:
        self.members.pop(node.id, None)

    def push(self, node: TreeNode) -> None:
        if node.id in self.members:
            heapq.heappush(self._heap, (self._key(node), node.id))
            if len(self._heap) > 2 * len(self.members) + 64:
                self._heap = [(self._key(n), i) for i, n in sorted(self.members.items())]
                heapq.heapify(self._heap)

    def pop(self) -> TreeNode | None:
        while self._heap:
            key, node_id = heapq.heappop(self._heap)
            node = self.members.get(node_id)
            if node is not None and self._key(node) == key:
                return node
        return None


@dataclass
class MatchResult:
    """``match_prefix``: device slots of the cached prefix and the nodes where the tiers end."""

    device_indices: torch.Tensor
    last_node: TreeNode  # deepest matched node (may be host-only)
    host_hit_length: int  # tokens of the host-only chain ending at last_node
    last_host_node: TreeNode  # deepest backed-up ancestor-or-self of last_node


class RadixTree:
    """One rank's radix tree (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, oracle: KVOracle) -> None:
        self.config = config
        self.rank = rank
        self.oracle = oracle
        self.page_size = config.page_size
        self.write_back = config.hicache_write_policy is WritePolicy.WRITE_BACK  # no hit counting (seed §3.5)
        self._priority = _PRIORITY[config.radix_eviction_policy]

    def _reset_tree(self) -> None:
        self._counter = 0  # logical clock of access/creation stamps (ticks at every creation and touch)
        self._next_id = 0
        self._nodes: dict[int, TreeNode] = {}
        self.root_node = self._new_node(None)
        self.root_node.state = NodeState.BOTH  # the root counts as present in both tiers
        self.root_node.value, self.root_node.host_value, self.root_node.hash_value = EMPTY, EMPTY, []
        self.root_node.kv_states = _NO_STATES
        self.root_node.kv_seeds = _NO_SEEDS
        self.root_node.lock_ref = 1
        self.evictable_leaves = _LeafHeap(self._priority)
        self.evictable_host_leaves = _LeafHeap(self._priority)
        self.evictable_size_ = 0
        self.protected_size_ = 0

    # --- the tier layer's hooks (``hiradix_tiers.TieredTree`` fills them; a bare tree has no copies) --------

    def _split_inflight(self, child: TreeNode, new_node: TreeNode) -> None:
        """``child`` was split and ``new_node`` is its prefix fragment: copies of ``child`` cover it too."""

    def _on_hit(self, node: TreeNode) -> None:
        """An insert counted a hit on ``node`` (its ``hit_count`` is already raised)."""

    # --- node bookkeeping -------------------------------------------------------------------------------------

    def _tick(self) -> int:
        self._counter += 1
        return self._counter

    def _new_node(self, namespace: str | None) -> TreeNode:
        node = TreeNode(self._next_id, namespace, self._tick())
        self._next_id += 1
        self._nodes[node.id] = node
        return node

    def _touch(self, node: TreeNode) -> None:
        node.last_access_time = self._tick()
        self.evictable_leaves.push(node)
        self.evictable_host_leaves.push(node)

    def _transition(self, node: TreeNode, event: NodeEvent) -> None:
        node.state = next_state(node.state, event)  # raises TransitionError before any change

    def _update_leaf_status(self, node: TreeNode | None) -> None:
        """Recompute ``node``'s membership in both leaf sets."""
        if node is None or node is self.root_node or node.id not in self._nodes:
            return
        device_leaf = host_leaf = False
        if node.lock_ref == 0:
            if node.state.evicted:
                host_leaf = not any(c.state.backuped for c in node.children.values())
            else:
                device_leaf = not node.children or all(c.state.evicted for c in node.children.values())
        for leaves, member in ((self.evictable_leaves, device_leaf), (self.evictable_host_leaves, host_leaf)):
            if not member:
                leaves.members.pop(node.id, None)  # discard
            elif node.id not in leaves.members:
                leaves.add(node)

    def _child_key(self, namespace: str | None, key: Sequence[Token]) -> ChildKey:
        return (namespace, tuple(key[: self.page_size]))

    def _key_match(self, a: Key, b: Key) -> int:
        """Common prefix length in whole pages (``_key_match_paged``)."""
        limit = min(len(a), len(b))
        if a[:limit] == b[:limit]:  # the common case, compared in C
            n = limit
        else:
            n = 0
            while a[n : n + 64] == b[n : n + 64]:  # a mismatch lies below limit: these stop before it
                n += 64
            while a[n] == b[n]:
                n += 1
        return n - n % self.page_size

    def _page_aligned(self, key: Key) -> Key:
        return key[: len(key) - len(key) % self.page_size]

    def _delete_leaf(self, node: TreeNode) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.namespace, node.key)]
        del self._nodes[node.id]
        self.evictable_leaves.discard(node)
        self.evictable_host_leaves.discard(node)
        self._update_leaf_status(parent)

    def _path(self, node: TreeNode) -> Key:
        parts: list[Key] = []
        n: TreeNode | None = node
        while n is not None and n is not self.root_node:
            parts.append(n.key)
            n = n.parent
        return tuple(t for part in reversed(parts) for t in part)

    def node_id(self, node: TreeNode) -> NodeId | None:
        """The engine-neutral name of ``node`` (None for the root)."""
        if node is self.root_node:
            return None
        return NodeId(node.namespace or "", self._path(node))

    def depth(self, node: TreeNode) -> int:
        return len(self._path(node))

    def _prior_hash(self, parent: TreeNode, namespace: str | None) -> str | None:
        if parent is not self.root_node:
            hashes = self.hashes(parent)
            if hashes:
                return hashes[-1]
        return storage_namespace_seed(namespace)

    def hashes(self, node: TreeNode) -> list[str]:
        """``node``'s chained page hashes, computed when an L3 key or a snapshot first asks and then kept:
        the chain is a function of the node's path, so the value is the one an eager hash at insert would
        have stored, and a tree without L3 that nobody snapshots never hashes."""
        pending: list[TreeNode] = []
        n = node
        while n.hash_value is None:  # the root's list is [] (never None)
            pending.append(n)
            assert n.parent is not None
            n = n.parent
        for n in reversed(pending):  # parents first
            assert n.parent is not None
            n.hash_value = page_hashes(n.key, self.page_size, self._prior_hash(n.parent, n.namespace))
        assert node.hash_value is not None
        return node.hash_value

    def key_of(self, tokens: Sequence[int]) -> Key:
        """The radix key of a token sequence (EAGLE: bigrams, seed §5.7)."""
        if self.config.is_eagle:
            return tuple((tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1))
        return tuple(tokens)

    # --- oracle helpers ---------------------------------------------------------------------------------------

    def _path_check(self, node: TreeNode) -> Check:
        """Oracle seeds and node names of every position from the root to the end of ``node``."""
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n is not self.root_node:
            chain.append(n)
            n = n.parent
        chain.reverse()
        if not self.oracle.enabled:
            total = sum(len(c.key) for c in chain)
            return Check(torch.zeros(total, dtype=torch.int32), _PathLabels(chain, self.rank))
        if len(chain) == 1:  # one node: its seeds as they are (a read never writes them)
            seeds = self._kv_seeds(chain[0])
        else:
            seeds = torch.cat([self._kv_seeds(c) for c in chain]) if chain else _NO_SEEDS
        return Check(seeds, _PathLabels(chain, self.rank))

    def _kv_seeds(self, node: TreeNode) -> torch.Tensor:
        """``node``'s oracle seeds as an int32 tensor, derived once per node (split like ``kv_states``)."""
        if node.kv_seeds is None:
            node.kv_seeds = self.oracle.seeds_of(self._kv_states(node))
        return node.kv_seeds

    def _kv_states(self, node: TreeNode) -> States:
        """The oracle's chain states of ``node``'s key positions, derived once per node (like ``hashes``:
        a function of the path, so splits slice them and nothing else changes them)."""
        if node.kv_states is not None:
            return node.kv_states
        pending: list[TreeNode] = []
        n = node
        while n.kv_states is None:  # the root's states are empty (never None)
            pending.append(n)
            assert n.parent is not None
            n = n.parent
        position = 0  # of the first pending node's first key element: the length of the path above it
        above: TreeNode | None = n
        while above is not None and above is not self.root_node:
            position += len(above.key)
            above = above.parent
        for n in reversed(pending):
            parent = n.parent
            assert parent is not None and parent.kv_states is not None
            prior = (
                int(parent.kv_states[-1]) if len(parent.kv_states) else self.oracle.root_state(n.namespace)
            )
            n.kv_states = self.oracle.advance(prior, n.key, position=position)
            position += len(n.key)
        assert node.kv_states is not None
        return node.kv_states

    def _path_state_at(self, node: TreeNode, position: int) -> int:
        """The oracle's chain state at ``position`` of the path from the root to the end of ``node``."""
        chain: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n is not self.root_node:
            chain.append(n)
            n = n.parent
        start = 0
        for c in reversed(chain):
            if position < start + len(c.key):
                return int(self._kv_states(c)[position - start])
            start += len(c.key)
        raise IndexError(f"position {position} is beyond the path of node {node.id} ({start} positions)")

    # --- locks (seed §3.7) ------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        n: TreeNode | None = node
        while n is not None and n is not self.root_node:
            if n.lock_ref == 0:
                self.evictable_size_ -= len(n.key)
                self.protected_size_ += len(n.key)
                delta -= len(n.key)
            n.lock_ref += 1
            self._update_leaf_status(n)
            n = n.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        delta = 0
        n: TreeNode | None = node
        while n is not None and n is not self.root_node:
            if n.lock_ref <= 0:
                raise UsageError(f"dec_lock_ref on node {n.id} whose lock_ref is {n.lock_ref}")
            if n.lock_ref == 1:
                self.evictable_size_ += len(n.key)
                self.protected_size_ -= len(n.key)
                delta += len(n.key)
            n.lock_ref -= 1
            self._update_leaf_status(n)
            n = n.parent
        return delta

    # --- match and split (seed §2.1) --------------------------------------------------------------------------

    def match_prefix(self, key: Key, namespace: str | None) -> MatchResult:
        """The longest cached page-aligned prefix of ``key``; may split one node, never locks."""
        key = self._page_aligned(key)
        node = self.root_node
        self._touch(node)
        values: list[torch.Tensor] = []
        while key:
            child = node.children.get(self._child_key(namespace, key))
            if child is None:
                break
            self._touch(child)
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                node = self._split_node(child, prefix_len)
                if not node.evicted:
                    assert node.value is not None
                    values.append(node.value)
                break
            if not child.evicted:
                assert child.value is not None
                values.append(child.value)
            node = child
            key = key[prefix_len:]
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
        device_indices = torch.cat(values) if values else EMPTY
        return MatchResult(device_indices, node, host_hit_length, last_host_node)

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Split ``child`` after ``split_len`` key elements; returns the new prefix node."""
        parent = child.parent
        assert parent is not None and 0 < split_len < len(child.key)
        self._transition(child, NodeEvent.SPLIT)
        new_node = self._new_node(child.namespace)
        new_node.state = child.state  # the fragment starts in the split node's state (SPLIT self-loop)
        new_node.priority = child.priority
        new_node.lock_ref = child.lock_ref
        new_node.hit_count = child.hit_count
        new_node.key, child.key = child.key[:split_len], child.key[split_len:]
        if child.value is not None:
            new_node.value, child.value = child.value[:split_len].clone(), child.value[split_len:].clone()
        if child.host_value is not None:
            new_node.host_value = child.host_value[:split_len].clone()
            child.host_value = child.host_value[split_len:].clone()
        if child.hash_value is not None:
            pages = split_len // self.page_size
            new_node.hash_value, child.hash_value = child.hash_value[:pages], child.hash_value[pages:]
        if child.kv_states is not None:
            new_node.kv_states, child.kv_states = child.kv_states[:split_len], child.kv_states[split_len:]
        if child.kv_seeds is not None:
            new_node.kv_seeds, child.kv_seeds = child.kv_seeds[:split_len], child.kv_seeds[split_len:]
        new_node.parent = parent
        parent.children[self._child_key(new_node.namespace, new_node.key)] = new_node
        new_node.children = {self._child_key(child.namespace, child.key): child}
        child.parent = new_node
        self._split_inflight(child, new_node)
        self._update_leaf_status(new_node)
        self._update_leaf_status(child)
        return new_node

    # --- insert -----------------------------------------------------------------------------------------------

    def insert(
        self,
        key: Key,
        value: torch.Tensor,
        namespace: str | None,
        *,
        chunked: bool = False,
        priority: int = 0,
        computed: tuple[int, States, torch.Tensor] | None = None,
    ) -> int:
        """Insert a page-aligned key with device ``value``; returns the length already on the device
        (whose slots the caller frees as duplicates). ``computed``: the oracle's chain states and seeds
        of the key from a position on (``Req.computed``), given to a new node they cover."""
        assert len(key) % self.page_size == 0 and value.shape[0] == len(key)
        node = self.root_node
        self._touch(node)
        total_prefix_length = 0
        position = 0  # of key[0] in the key as given (value is sliced only where a node takes a part)
        while key:
            child = node.children.get(self._child_key(namespace, key))
            if child is None:
                break
            child.priority = max(child.priority, priority)  # before the touch re-keys it in the leaf heaps
            self._touch(child)
            prefix_len = self._key_match(child.key, key)
            if prefix_len < len(child.key):
                child = self._split_node(child, prefix_len)
                child.priority = max(child.priority, priority)
            if child.evicted:
                # A host-only node gets the recomputed device slots and keeps its host copy (D-03); the
                # caller keeps these slots, so they do not count as a prefix.
                self._transition(child, NodeEvent.INSERT_REFILL)
                child.value = value[position : position + prefix_len].clone()
                self.evictable_size_ += prefix_len
                self._update_leaf_status(child)
                self._update_leaf_status(child.parent)
            else:
                self._inc_hit_count(child, chunked)
                total_prefix_length += prefix_len
            node = child
            key = key[prefix_len:]
            position += prefix_len
        if key:
            new_node = self._new_node(namespace)
            new_node.priority = priority
            new_node.key = key
            new_node.value = value[position:].clone()
            new_node.parent = node  # new_node.hash_value stays None until hashes() needs it
            if computed is not None:  # the chain is a function of the path: what _kv_states would derive
                start, states, seeds = computed
                lo, hi = position - start, position - start + len(key)
                if lo == 0 and hi == len(states):  # the whole run (the common case): no slices to make
                    new_node.kv_states, new_node.kv_seeds = states, seeds
                elif lo >= 0 and hi <= len(states):
                    new_node.kv_states, new_node.kv_seeds = states[lo:hi], seeds[lo:hi]
            self._transition(new_node, NodeEvent.INSERT_LEAF)
            node.children[self._child_key(namespace, key)] = new_node
            self.evictable_size_ += len(key)
            self._update_leaf_status(new_node)
            self._update_leaf_status(node)
            if not self.write_back:
                self._inc_hit_count(new_node, chunked)
        return total_prefix_length

    def _inc_hit_count(self, node: TreeNode, chunked: bool) -> None:
        if self.write_back or chunked:
            return  # write-back never writes on hits; chunked prefill is never counted (seed §3.5)
        node.hit_count += 1
        self.evictable_leaves.push(node)
        self.evictable_host_leaves.push(node)
        self._on_hit(node)


class _PathLabels(Sequence[str]):
    """The node name of each position of a path, formatted only when a failing check asks for one (the
    names of the nodes, and their keys, as they were when the check was made)."""

    def __init__(self, chain: Sequence[TreeNode], rank: int) -> None:
        self._parts = [(c.namespace, c.key) for c in chain]
        self._ends: list[int] = []
        total = 0
        for _, key in self._parts:
            total += len(key)
            self._ends.append(total)
        self._rank = rank
        self._range = range(total)

    def __len__(self) -> int:
        return len(self._range)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            out = _PathLabels.__new__(_PathLabels)
            out._parts, out._ends, out._rank, out._range = self._parts, self._ends, self._rank, self._range[i]
            return out
        pos = self._range[i]
        part = bisect.bisect_right(self._ends, pos)
        namespace = self._parts[part][0]
        path = [t for _, key in self._parts[: part + 1] for t in key]
        return f"node {namespace or '-'}:{path} (rank {self._rank})"
