"""``HiRadixCache``: one rank's radix tree over device (L1) and host (L2) KV, with L3 through the
controller — the scheduler side of SGLang's hierarchical cache, on real pools.

Theory of operation
-------------------
A ``TreeNode`` holds a page-aligned key and, per tier, an int64 tensor of token slots: ``value`` in the
device pool, ``host_value`` in the host pool, plus one chained page hash per page (the L3 key of the
page). Slot tensors live on the CPU whatever the pool's device; the transfers move them to the kernel's
device (seed §5.4 ①). Its state (``refcache.hicache.states.NodeState``) says which tiers hold it and changes only through
``_transition`` and the table of ``refcache.hicache.states``.

Everything here runs on the scheduler thread, on every rank in lock step. Rank-local facts (a finished
copy, a storage hit, a page read) enter the tree only at the reductions of seed §3.7: the methods that
need one are generators that ``yield AllReduce(...)`` and receive the reduced values (see
``refcache.runtime``); the driver steps the ranks together. Background data movement is the
controller's (``cache_controller.py``).

Eviction order is a documented total order: the policy's priority, then the node id (creation order on
this rank). Access and creation times come from a per-rank logical counter, bumped at every node creation
and every touch, so ranks that apply the same operations evict the same nodes — wall-clock stamps would
not. The two leaf sets (device-evictable, host-evictable) are maintained incrementally and kept in lazy
min-heaps.

Where SGLang versions differ, this follows the behaviour the reference model specifies; the decision
numbers (D-xx, ``specs/decisions.md``) are cited where they apply.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch

from refcache.config import EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.errors import UsageError
from refcache.gpu.allocator import sorted_unique
from refcache.gpu.cache_controller import Check, HiCacheController, PrefetchOperation
from refcache.gpu.kv_oracle import KVOracle, Picked, States
from refcache.hashing import Token, page_hashes, storage_namespace_seed
from refcache.hicache.snapshot import (
    InFlight,
    NodeId,
    NodeRecord,
    PoolRecord,
    PrefetchRecord,
    RankSnapshot,
    RequestRecord,
)
from refcache.hicache.states import NodeEvent, NodeState, next_state
from refcache.runtime import AllReduce, Collective, ReduceOp

__all__ = ["HiRadixCache", "MatchResult", "Req", "TreeNode"]

Key = tuple[Token, ...]
ChildKey = tuple[str | None, Key]

_EMPTY = torch.empty(0, dtype=torch.int64)
_NO_SEEDS = torch.empty(0, dtype=torch.int32)
_NO_STATES: States = np.empty(0, dtype=np.uint64)


class TreeNode:
    """A radix-tree node (seed §1.1). Only ``HiRadixCache`` writes these fields."""

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


@dataclass
class _WriteThrough:
    """An ``ongoing_write_through`` entry."""

    fragments: list[TreeNode]  # parent first; more than one once the node was split (D-07)
    locked: bool  # write-through locks the source until the ack; write-back eviction does not


@dataclass
class _Backup:
    """An ``ongoing_backup`` entry: the fragments whose host pages an L3 write reads."""

    fragments: list[TreeNode]


@dataclass
class _Prefetch:
    """An ``ongoing_prefetch`` entry."""

    last_host_node: TreeNode  # host-protected until the entry goes
    tokens: Key
    namespace: str | None
    op: PrefetchOperation


@dataclass
class Req:
    """A running request (the scheduler's view)."""

    rid: int
    tokens: tuple[int, ...]
    namespace: str | None
    key: Key
    kv_indices: torch.Tensor  # one device slot per token; [:cache_protected_len] belong to the tree
    cache_protected_len: int
    owned: torch.Tensor  # slots of the device pages the request owns (freed on finish/abort)
    last_node: TreeNode  # the node it holds a lock on
    prompt_len: int | None  # how many tokens are the prompt (None: all); read only by cache_finished_req
    # The oracle's chain states and seeds of the computed positions (key position ``computed_from`` on),
    # derived once for the fake forward pass and handed to the nodes insert creates for them.
    computed_from: int = 0
    computed: tuple[States, torch.Tensor] | None = None


class HiRadixCache:
    """One rank's tree and scheduler-side tables (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, controller: HiCacheController, oracle: KVOracle):
        self.config = config
        self.rank = rank
        self.cache_controller = controller
        self.oracle = oracle
        self.page_size = config.page_size
        self.enable_storage = config.enable_storage
        self.write_back = config.hicache_write_policy is WritePolicy.WRITE_BACK
        self.write_through_threshold = config.write_through_threshold
        self.load_back_threshold = config.load_back_threshold
        self.token_to_kv_pool_allocator = controller.mem_pool_device_allocator
        self.token_to_kv_pool_host = controller.mem_pool_host
        self.clock = controller.clock
        self._priority = _PRIORITY[config.radix_eviction_policy]
        self.reset()

    # --- state ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """``reset()``: a new tree, empty tables, cleared pools and queues (only when idle; see busy)."""
        self.cache_controller.reset()
        self.token_to_kv_pool_allocator.clear()
        self.token_to_kv_pool_host.clear()
        self._counter = 0  # logical clock of access/creation stamps (ticks at every creation and touch)
        self._next_id = 0
        self._nodes: dict[int, TreeNode] = {}
        self.root_node = self._new_node(None)
        self.root_node.state = NodeState.BOTH  # the root counts as present in both tiers
        self.root_node.value, self.root_node.host_value, self.root_node.hash_value = _EMPTY, _EMPTY, []
        self.root_node.kv_states = _NO_STATES
        self.root_node.kv_seeds = _NO_SEEDS
        self.root_node.lock_ref = 1
        self.evictable_leaves = _LeafHeap(self._priority)
        self.evictable_host_leaves = _LeafHeap(self._priority)
        self.evictable_size_ = 0
        self.protected_size_ = 0
        self.requests: dict[int, Req] = {}
        self.ongoing_write_through: dict[int, _WriteThrough] = {}  # ack id (node id) -> entry, FIFO
        self.ongoing_load_back: dict[int, TreeNode] = {}  # ack id (node id) -> last loaded node
        self.ongoing_prefetch: dict[int, _Prefetch] = {}  # request id -> entry
        self.ongoing_backup: dict[int, _Backup] = {}  # storage operation id -> entry
        self.prefetch_tokens_occupied = 0

    def busy(self) -> bool:
        """Whether anything is running, queued or in flight (``Reset`` is refused then)."""
        return bool(
            self.requests
            or self.ongoing_write_through
            or self.ongoing_load_back
            or self.ongoing_prefetch
            or self.ongoing_backup
            or self.cache_controller.busy()
        )

    def flush_cache(self) -> Collective[bool]:
        """Reset if no rank is busy (MAX over the ranks' busy flags)."""
        reduced = yield AllReduce(ReduceOp.MAX, (int(self.busy()),))
        if reduced[0]:
            return False
        self.reset()
        return True

    # --- node bookkeeping ------------------------------------------------------------------------------------

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

    # --- oracle helpers --------------------------------------------------------------------------------------

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

    # --- locks (seed §3.7) ----------------------------------------------------------------------------------

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

    # --- match and split (seed §2.1) -------------------------------------------------------------------------

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
        device_indices = torch.cat(values) if values else _EMPTY
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
        # A pending copy covers the whole original range: the new fragment joins it, and an L3 backup
        # pins the fragment's host pages like the original's (D-07).
        for entry in self.ongoing_write_through.values():
            if child in entry.fragments:
                entry.fragments.insert(entry.fragments.index(child), new_node)
        for backup in self.ongoing_backup.values():
            if child in backup.fragments:
                backup.fragments.insert(backup.fragments.index(child), new_node)
                new_node.protect_host()
        self._update_leaf_status(new_node)
        self._update_leaf_status(child)
        return new_node

    # --- insert ----------------------------------------------------------------------------------------------

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
        if not node.backuped and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    # --- L1 -> L2 (seed §2.4, §3.5) --------------------------------------------------------------------------

    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Start the device-to-host copy of ``node``; returns tokens queued (0 when refused)."""
        assert node.value is not None and node.parent is not None
        if not write_back and not node.parent.backuped:
            return 0  # backups stay contiguous from the root (D-04)
        host_indices = self.cache_controller.write(node.value, node.id)
        if host_indices is None:
            self.evict_host(len(node.value))
            host_indices = self.cache_controller.write(node.value, node.id)
        if host_indices is None:
            return 0
        self._transition(node, NodeEvent.WRITE_BACKUP)
        node.host_value = host_indices
        self.ongoing_write_through[node.id] = _WriteThrough([node], locked=not write_back)
        if not write_back:
            self.inc_lock_ref(node)
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)
        return len(host_indices)

    def writing_check(self) -> Collective[int]:
        """Retire the write acks every rank has finished (MIN), unlock, then chain L2→L3."""
        reduced = yield AllReduce(ReduceOp.MIN, (self.cache_controller.ready_write_acks(),))
        self._finish_write_through(reduced[0])
        return reduced[0]

    def _finish_write_through(self, finish_count: int) -> None:
        for ack_id in self.cache_controller.pop_write_acks(finish_count):
            entry = self.ongoing_write_through.pop(ack_id)
            if self.enable_storage:
                self.write_backup_storage(entry.fragments)
            if entry.locked:
                self.dec_lock_ref(entry.fragments[-1])

    def _writing_check_blocking(self) -> None:
        """``writing_check(write_back=True)``: wait for this rank's own copies and retire them all."""
        self.cache_controller.flush_writes()
        self._finish_write_through(len(self.cache_controller.ack_write_queue))

    def write_backup_storage(self, fragments: list[TreeNode]) -> None:
        """Queue the L2→L3 write of a node (every fragment of it, if it was split meanwhile)."""
        hashes = [h for f in fragments for h in self.hashes(f)]
        host_values = [f.host_value for f in fragments if f.host_value is not None]
        host_indices = torch.cat(host_values) if host_values else _EMPTY
        check = self._path_check(fragments[-1])
        check = check.cut(len(check.seeds) - len(host_indices), len(check.seeds))
        op_id = self.cache_controller.write_storage(host_indices, hashes, check)
        self.ongoing_backup[op_id] = _Backup(list(fragments))
        for f in fragments:
            f.protect_host()

    # --- L1 eviction (seed §3.1) -----------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` device tokens if unlocked leaves allow; returns tokens evicted."""
        num_evicted = 0
        skipped: list[TreeNode] = []
        staged: list[tuple[TreeNode, torch.Tensor]] = []
        while num_evicted < num_tokens:
            x = self.evictable_leaves.pop()
            if x is None:
                break
            if x.backuped:
                num_evicted += self._evict_backuped(x)
            elif not self.write_back:
                num_evicted += self._evict_regular(x)
            elif self.write_backup(x, write_back=True) > 0:
                # Detach now so x is no candidate again; its device slots stay allocated until the
                # blocking flush below has copied them.
                x.protect_host()
                assert x.value is not None
                staged.append((x, x.value))
                self._transition(x, NodeEvent.EVICT_BACKUPED)
                self.evictable_size_ -= len(x.value)
                x.value = None
                num_evicted += len(staged[-1][1])
                self._update_leaf_status(x)
                self._update_leaf_status(x.parent)
            else:
                # No host memory even after evict_host: flush what is staged, then drop x (D-10).
                self._flush_staged(staged)
                dropped = self._drop_no_host(x)
                if dropped == 0:
                    skipped.append(x)
                num_evicted += dropped
        self._flush_staged(staged)
        for x in skipped:
            self.evictable_leaves.push(x)
        return num_evicted

    def _flush_staged(self, staged: list[tuple[TreeNode, torch.Tensor]]) -> None:
        if not staged:
            return
        self._writing_check_blocking()
        for node, device_indices in staged:
            self.token_to_kv_pool_allocator.free(device_indices)
            node.release_host()
        staged.clear()

    def _evict_backuped(self, node: TreeNode) -> int:
        assert node.value is not None
        num = node.value.shape[0]
        self._transition(node, NodeEvent.EVICT_BACKUPED)
        self.token_to_kv_pool_allocator.free(node.value)
        node.value = None
        self.evictable_size_ -= num
        self._update_leaf_status(node)
        self._update_leaf_status(node.parent)
        return num

    def _evict_regular(self, node: TreeNode) -> int:
        assert node.value is not None
        assert not node.children, "a device-only node with children cannot be evicted"
        num = node.value.shape[0]
        self._transition(node, NodeEvent.EVICT_REGULAR)
        self.token_to_kv_pool_allocator.free(node.value)
        self.evictable_size_ -= num
        self._delete_leaf(node)
        return num

    def _drop_no_host(self, node: TreeNode) -> int:
        """Drop a childless device leaf whose write-back found no host memory; 0 if it has children
        (they are pinned: evict_host just freed every unpinned one) (D-10). With
        ``drop_subtree_without_host`` (SGLang 0.5.20), its unpinned host-only subtree goes with it."""
        if node.children and not (self.config.drop_subtree_without_host and self._drop_host_subtree(node)):
            return 0
        assert node.value is not None
        num = len(node.value)
        self._transition(node, NodeEvent.DROP_NO_HOST)
        self.token_to_kv_pool_allocator.free(node.value)
        self.evictable_size_ -= num
        self._delete_leaf(node)
        return num

    def _drop_host_subtree(self, node: TreeNode) -> bool:
        """Free and remove the host-only descendants of the device leaf ``node``, or nothing (False) when
        one of them is pinned."""
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
            self.token_to_kv_pool_host.free(n.host_value)
            self._delete_leaf(n)
        return True

    # --- L2 eviction (seed §3.2) -----------------------------------------------------------------------------

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from host-only leaves; returns tokens freed."""
        num_evicted = 0
        skipped: list[TreeNode] = []
        while num_evicted < num_tokens:
            x = self.evictable_host_leaves.pop()
            if x is None:
                break
            if not x.evicted or x.host_ref_counter > 0:  # on the device, or pinned by prefetch/backup
                skipped.append(x)
                continue
            assert x.host_value is not None
            self._transition(x, NodeEvent.EVICT_HOST)
            self.token_to_kv_pool_host.free(x.host_value)
            num_evicted += len(x.host_value)
            self._delete_leaf(x)
        for x in skipped:
            self.evictable_host_leaves.push(x)
        return num_evicted

    # --- L2 -> L1 (seed §2.3) --------------------------------------------------------------------------------

    def load_back(self, node: TreeNode) -> torch.Tensor | None:
        """Queue the host→device copy of the evicted chain ending at ``node``, all or nothing."""
        nodes_to_load: list[TreeNode] = []
        ancestor = node
        while ancestor.evicted:
            assert ancestor.backuped and ancestor.parent is not None, "no backup on an evicted node"
            nodes_to_load.insert(0, ancestor)
            ancestor = ancestor.parent
        self.inc_lock_ref(ancestor)  # the ancestor must survive the eviction below
        host_indices = torch.cat([n.host_value for n in nodes_to_load if n.host_value is not None])
        if len(host_indices) < self.load_back_threshold:
            self.dec_lock_ref(ancestor)
            return None
        for n in nodes_to_load:  # pin the source pages across a nested evict_host (D-05)
            n.protect_host()
        check = self._path_check(node)
        check = check.cut(len(check.seeds) - len(host_indices), len(check.seeds))
        device_indices = self.cache_controller.load(host_indices, node.id, check)
        if device_indices is None:
            self.evict(len(host_indices))
            device_indices = self.cache_controller.load(host_indices, node.id, check)
        self.dec_lock_ref(ancestor)
        for n in nodes_to_load:
            n.release_host()
        if device_indices is None:
            return None
        self.ongoing_load_back[node.id] = node
        offset = 0
        for n in nodes_to_load:
            assert n.host_value is not None
            self._transition(n, NodeEvent.LOAD_BACK)
            n.value = device_indices[offset : offset + len(n.host_value)].clone()
            offset += len(n.host_value)
            self._update_leaf_status(n)
        self.evictable_size_ += len(device_indices)
        self.inc_lock_ref(node)  # held until loading_check retires the ack
        for n in nodes_to_load:
            self._update_leaf_status(n.parent)
        return device_indices

    def init_load_back(self, last_node: TreeNode) -> tuple[torch.Tensor, TreeNode]:
        """Load back the host hit ending at ``last_node``; on refusal fall back to its device prefix.
        Returns the loaded device slots and the node to lock."""
        if last_node.evicted:
            loaded = self.load_back(last_node)
            if loaded is not None:
                return loaded, last_node
            while last_node.evicted:
                assert last_node.parent is not None
                last_node = last_node.parent
        return _EMPTY, last_node

    def ready_to_load_host_cache(self) -> None:
        """Launch the loads queued by this batch (one job and ack each); threaded, the forward pass then
        reads each layer as its event fires."""
        for op in self.cache_controller.start_loading():
            if not self.cache_controller.executor.inline:
                self.cache_controller.read_loaded(op)

    def loading_check(self) -> Collective[int]:
        reduced = yield AllReduce(ReduceOp.MIN, (self.cache_controller.ready_load_acks(),))
        for ack_id in self.cache_controller.pop_load_acks(reduced[0]):
            self.dec_lock_ref(self.ongoing_load_back.pop(ack_id))
        return reduced[0]

    # --- L3 -> L2 (seed §2.2, §3.6) --------------------------------------------------------------------------

    def prefetch_from_storage(
        self, req_id: int, last_host_node: TreeNode, new_input_tokens: Key, namespace: str | None
    ) -> str:
        """The admission layers; returns "" when admitted, else the name of the refusing layer."""
        tokens = self._page_aligned(new_input_tokens)
        if len(tokens) < self.config.effective_prefetch_threshold:
            return "below_threshold"
        if self.prefetch_tokens_occupied >= self.config.prefetch_capacity_limit:
            return "rate_limited"
        last_host_node.protect_host()
        host_indices = self.token_to_kv_pool_host.alloc(len(tokens))
        if host_indices is None:
            self.evict_host(len(tokens))
            host_indices = self.token_to_kv_pool_host.alloc(len(tokens))
        if host_indices is None:
            last_host_node.release_host()
            return "no_host_memory"
        anchor = self._path(last_host_node)
        seeds = self.oracle.seeds(namespace, anchor + tokens)[len(anchor) :]
        what = [
            f"prefetch of request {req_id} at position {len(anchor) + i} (rank {self.rank})"
            for i in range(len(tokens))
        ]
        op = self.cache_controller.prefetch(
            req_id, tokens, self._prior_hash(last_host_node, namespace), host_indices, Check(seeds, what)
        )
        self.ongoing_prefetch[req_id] = _Prefetch(last_host_node, tokens, namespace, op)
        self.prefetch_tokens_occupied += len(tokens)
        return ""

    def _can_terminate_prefetch(self, op: PrefetchOperation) -> tuple[bool, bool]:
        """This rank's ``(can_terminate, is_terminated)``."""
        policy = self.config.hicache_storage_prefetch_policy
        with op.lock:
            terminated = op.terminated
            # An empty hash list is never complete (sglang.md §9 #13).
            completed = len(op.hash_value) > 0 and op.completed_tokens == len(op.hash_value) * self.page_size
            pages = len(op.hash_value)
        if policy is PrefetchPolicy.BEST_EFFORT:
            return True, terminated
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return completed, terminated
        # timeout = base + pages * page_size / 1024 * per_ki_token, compared in microseconds x 1024.
        elapsed_x1024 = (self.clock.now_us() - op.start_us) * 1024
        limit_x1024 = (
            self.config.prefetch_timeout_base_us * 1024
            + pages * self.page_size * self.config.prefetch_timeout_per_ki_token_us
        )
        return completed or elapsed_x1024 > limit_x1024, terminated

    def check_prefetch_progress(self, req_id: int) -> Collective[tuple[bool, int]]:
        """``(done, tokens inserted)``: terminate if the policy allows on every rank (or any rank already
        stopped), then insert the prefix every rank has read (MIN) as host-only nodes."""
        entry = self.ongoing_prefetch.get(req_id)
        if entry is None:
            return True, 0
        if self.config.hicache_storage_prefetch_policy is not PrefetchPolicy.BEST_EFFORT:
            can, terminated = self._can_terminate_prefetch(entry.op)
            reduced = yield AllReduce(ReduceOp.MAX, (1 - int(can), int(terminated)))
            if reduced[0] == 1 and reduced[1] == 0:
                return False, 0
        completed = self.cache_controller.terminate_prefetch(entry.op)
        min_completed = (yield AllReduce(ReduceOp.MIN, (completed,)))[0]
        return True, self._handle_prefetch_result(req_id, min_completed, completed)

    def _handle_prefetch_result(self, req_id: int, min_completed: int, completed: int) -> int:
        entry = self.ongoing_prefetch.pop(req_id)
        op = entry.op
        taken = self.cache_controller.take(op, completed)
        fetched = taken[:min_completed]
        check = op.check.cut(0, min_completed)
        self.oracle.check_host(self.token_to_kv_pool_host, fetched, check.seeds, check.what)
        matched = self._insert_helper_host(
            entry.last_host_node,
            entry.tokens[:min_completed],
            fetched,
            op.hash_value[: min_completed // self.page_size],
            entry.namespace,
        )
        if matched:
            self.token_to_kv_pool_host.free(fetched[:matched])  # already in the tree
        self.cache_controller.append_host_mem_release(taken[min_completed:])
        entry.last_host_node.release_host()
        self.prefetch_tokens_occupied -= len(entry.tokens)
        return min_completed - matched

    def release_aborted_request(self, req_id: int) -> None:
        entry = self.ongoing_prefetch.pop(req_id)
        completed = self.cache_controller.terminate_prefetch(entry.op)
        self.cache_controller.append_host_mem_release(self.cache_controller.take(entry.op, completed))
        entry.last_host_node.release_host()
        self.prefetch_tokens_occupied -= len(entry.tokens)

    def _insert_helper_host(
        self, node: TreeNode, key: Key, host_value: torch.Tensor, hash_value: list[str], namespace: str | None
    ) -> int:
        """Attach fetched pages below ``node`` as host-only nodes; returns the tokens not attached (the
        caller frees them). The anchor ``node`` and every matched child count as accessed (D-33)."""
        self._touch(node)
        matched = 0
        while key:
            child = node.children.get(self._child_key(namespace, key))
            if child is None:
                break
            self._touch(child)
            prefix_len = self._key_match(child.key, key)
            key, host_value = key[prefix_len:], host_value[prefix_len:]
            hash_value = hash_value[prefix_len // self.page_size :]
            matched += prefix_len
            if prefix_len < len(child.key):
                child = self._split_node(child, prefix_len)
            node = child
        if not key:
            return matched
        if not node.backuped:
            # Never hang host-only nodes under a device-only node (sglang.md §9 #6): drop the data (D-06).
            return matched + len(key)
        new_node = self._new_node(namespace)
        new_node.key = key
        new_node.host_value = host_value.clone()
        new_node.hash_value = list(hash_value)
        new_node.priority = node.priority
        new_node.parent = node
        self._transition(new_node, NodeEvent.PREFETCH_INSERT)
        node.children[self._child_key(namespace, key)] = new_node
        self._update_leaf_status(new_node)
        self._update_leaf_status(node)
        return matched

    # --- control queues --------------------------------------------------------------------------------------

    def drain_storage_control_queues(self) -> Collective[tuple[int, int, int, int]]:
        """Process the MIN-reduced number of revokes, backup acks and host releases; returns
        ``(revoked, revokes, backups, releases)``."""
        ctrl = self.cache_controller
        revokes, backups, releases = yield AllReduce(ReduceOp.MIN, ctrl.control_queue_sizes())
        revoked = 0
        for _ in range(revokes):
            rid, op_id = ctrl.prefetch_revoke_queue.popleft()
            entry = self.ongoing_prefetch.get(rid)
            # The request may have finished or aborted meanwhile, and its id may even carry a newer
            # prefetch: revoke only the operation whose query failed.
            if entry is not None and entry.op.id == op_id:
                del self.ongoing_prefetch[rid]
                entry.last_host_node.release_host()
                self.prefetch_tokens_occupied -= len(entry.tokens)
                revoked += 1
        for _ in range(backups):
            for fragment in self.ongoing_backup.pop(ctrl.ack_backup_queue.popleft()).fragments:
                fragment.release_host()
        for _ in range(releases):
            self.token_to_kv_pool_host.free(ctrl.host_mem_release_queue.popleft())
        return revoked, revokes, backups, releases

    def check_hicache_events(self) -> Collective[tuple[int, int, int, int, int]]:
        """``(writes, loads, revoked, backups, host_releases)`` retired this round."""
        writes = yield from self.writing_check()
        loads = yield from self.loading_check()
        revoked = backups = releases = 0
        if self.enable_storage:
            revoked, _, backups, releases = yield from self.drain_storage_control_queues()
        return writes, loads, revoked, backups, releases

    # --- requests (scheduler side) ---------------------------------------------------------------------------

    def alloc_token_slots(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate device slots, evicting the shortfall from the tree first."""
        allocator = self.token_to_kv_pool_allocator
        needed = -(-num_tokens // self.page_size) * self.page_size
        if allocator.available_size() < needed:
            self.evict(needed - allocator.available_size())
        slots = allocator.alloc(num_tokens)
        return None if slots is None else slots.cpu()  # slot numbers live on the host (see Req)

    def start_request(
        self, rid: int, tokens: tuple[int, ...], namespace: str | None, prompt_len: int | None = None
    ) -> tuple[bool, int, int, int]:
        """Admit a request: match, lock, load back the host hit, allocate and compute the rest.
        Returns ``(admitted, device_hit, loaded, computed)``."""
        key = self.key_of(tokens)
        match = self.match_prefix(key, namespace)
        device_hit = match.device_indices.shape[0]  # (a tensor's len is a slow Python-level call)
        self._check_device_hit(match)
        loaded, lock_node = _EMPTY, match.last_node
        if match.host_hit_length > 0:
            loaded, lock_node = self.init_load_back(match.last_node)
        self.inc_lock_ref(lock_node)
        prefix = torch.cat((match.device_indices, loaded)) if loaded.shape[0] else match.device_indices
        done = prefix.shape[0]
        new_slots = self.alloc_token_slots(len(tokens) - done)
        if new_slots is None:
            self.dec_lock_ref(lock_node)
            self.ready_to_load_host_cache()
            return False, device_hit, loaded.shape[0], 0
        computed: tuple[States, torch.Tensor] | None = None
        if self.oracle.enabled:
            # The fake forward pass: the KV of every computed token, continuing the chain of the prefix.
            if not done:
                prior = self.oracle.root_state(namespace)
            elif match.host_hit_length == 0:  # the hit is the whole path to last_node: its last state
                prior = int(self._kv_states(match.last_node)[-1])
            else:
                prior = self._path_state_at(match.last_node, done - 1)
            states, seeds = self.oracle.advance_seeds(prior, key[done:], tokens[len(key) :], position=done)
            self.oracle.write_device(self.cache_controller.mem_pool_device, new_slots, seeds)
            computed = states, seeds
        self.requests[rid] = Req(
            rid,
            tokens,
            namespace,
            key,
            torch.cat((prefix, new_slots)),
            done,
            _whole_pages(new_slots, self.page_size),
            lock_node,
            prompt_len,
            done,
            computed,
        )
        self.ready_to_load_host_cache()
        return True, device_hit, loaded.shape[0], new_slots.shape[0]

    def _check_device_hit(self, match: MatchResult) -> None:
        """Read the matched device slots (those no pending load is still writing) against the oracle."""
        n = match.device_indices.shape[0]
        if n == 0 or not self.oracle.enabled:
            return
        node = match.last_node
        while node.evicted:
            assert node.parent is not None
            node = node.parent
        check = self._path_check(node)
        assert len(check.seeds) == n, "the device hit is the path to the last non-evicted node"
        pending = self.cache_controller.pending_load_slots()
        if not pending:  # the common case: read every matched slot
            self.oracle.check_device(
                self.cache_controller.mem_pool_device, match.device_indices, check.seeds, check.what
            )
            return
        keep = [i for i, s in enumerate(match.device_indices.tolist()) if s not in pending]
        if keep:
            self.oracle.check_device(
                self.cache_controller.mem_pool_device,
                match.device_indices[keep],
                torch.as_tensor(check.seeds)[keep],
                Picked(check.what, keep),
            )

    def _cache_req(self, req: Req, chunked: bool) -> tuple[int, int]:
        """Insert a request's page-aligned KV and free its duplicates; returns (prefix_len, freed)."""
        key = self._page_aligned(req.key)
        prefix_len = self.insert(
            key,
            req.kv_indices[: len(key)],
            req.namespace,
            chunked=chunked,
            computed=None if req.computed is None else (req.computed_from, *req.computed),
        )
        freed = max(prefix_len - req.cache_protected_len, 0)  # the duplicates (tensor slices only when any)
        if freed:
            self.token_to_kv_pool_allocator.free(req.kv_indices[req.cache_protected_len : prefix_len])
        tail = len(key) < req.kv_indices.shape[0]
        req.owned = _whole_pages(req.kv_indices[len(key) :], self.page_size) if tail else _EMPTY
        return prefix_len, freed

    def cache_finished_req(self, rid: int) -> tuple[int, int]:
        """Insert, free duplicates and the unaligned tail, unlock. Returns (prefix_len, freed)."""
        req = self.requests.pop(rid)
        prefix_len, freed = self._cache_req(req, chunked=False)
        if self.config.reinsert_prompt_prefix and req.prompt_len is not None:
            # SGLang 0.5.20 (D-24): the aligned prompt again, priority + 1, chunked (no hit), when it is a
            # proper prefix of the cached key; it splits a node at the prompt boundary.
            prompt = self._page_aligned(self.key_of(req.tokens[: req.prompt_len]))
            if 0 < len(prompt) < len(self._page_aligned(req.key)):
                self.insert(prompt, req.kv_indices[: len(prompt)], req.namespace, chunked=True, priority=1)
        if req.owned.shape[0]:
            self.token_to_kv_pool_allocator.free(req.owned)
            freed += req.kv_indices.shape[0] - len(self._page_aligned(req.key))
        self.dec_lock_ref(req.last_node)
        return prefix_len, freed

    def cache_unfinished_req(self, rid: int) -> None:
        """Insert the KV so far (chunked), re-match and move the lock to the new last node."""
        req = self.requests[rid]
        self._cache_req(req, chunked=True)
        key = self._page_aligned(req.key)
        match = self.match_prefix(key, req.namespace)
        assert len(match.device_indices) == len(key), "re-match after insert must cover the aligned key"
        req.kv_indices[: len(key)] = match.device_indices
        req.cache_protected_len = len(key)
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(match.last_node)
        req.last_node = match.last_node

    def abort_req(self, rid: int) -> None:
        req = self.requests.pop(rid)
        if len(req.owned):
            self.token_to_kv_pool_allocator.free(req.owned)
        self.dec_lock_ref(req.last_node)

    # --- snapshot --------------------------------------------------------------------------------------------

    def snapshot(self, l3_keys: Sequence[str]) -> RankSnapshot:
        in_flight: dict[int, set[str]] = {}
        for wt in self.ongoing_write_through.values():
            for f in wt.fragments:
                in_flight.setdefault(f.id, set()).add(InFlight.WRITE_THROUGH)
        for node in self.ongoing_load_back.values():
            in_flight.setdefault(node.id, set()).add(InFlight.LOAD_BACK)
        for backup in self.ongoing_backup.values():
            for f in backup.fragments:
                in_flight.setdefault(f.id, set()).add(InFlight.BACKUP)
        for entry in self.ongoing_prefetch.values():
            in_flight.setdefault(entry.last_host_node.id, set()).add(InFlight.PREFETCH_ANCHOR)
        records = []
        for node in self._nodes.values():
            nid = self.node_id(node)
            if nid is None:
                continue
            records.append(
                NodeRecord(
                    id=nid,
                    key_len=len(node.key),
                    state=node.state,
                    value=_slots(node.value),
                    host_value=_slots(node.host_value),
                    hash_value=tuple(self.hashes(node)),
                    lock_ref=node.lock_ref,
                    host_ref_counter=node.host_ref_counter,
                    hit_count=node.hit_count,
                    priority=node.priority,
                    in_flight=tuple(sorted(in_flight.get(node.id, ()))),
                    evictable_leaf=node.id in self.evictable_leaves.members,
                    host_leaf=node.id in self.evictable_host_leaves.members,
                )
            )
        records.sort(key=lambda r: r.id)
        allocator = self.token_to_kv_pool_allocator
        ps = self.page_size
        device_free = tuple(s for p in list(allocator.free_pages) for s in range(p * ps, (p + 1) * ps))
        held_device = tuple(
            sorted(
                (f"request:{r.rid}", tuple(r.owned.tolist())) for r in self.requests.values() if len(r.owned)
            )
        )
        host = self.token_to_kv_pool_host
        with host.lock:
            host_free = tuple(host.free_slots)
        ongoing_prefetch = tuple(
            PrefetchRecord(
                rid=rid,
                anchor=self.node_id(entry.last_host_node),
                tokens=len(entry.tokens),
                stage=entry.op.stage,
                hit_pages=len(entry.op.hash_value),
                completed_tokens=entry.op.completed_tokens,
                terminated=entry.op.terminated,
            )
            for rid, entry in sorted(self.ongoing_prefetch.items())
        )
        return RankSnapshot(
            rank=self.rank,
            nodes=tuple(records),
            device=PoolRecord(allocator.num_pages * ps, ps, device_free, held_device),
            host=PoolRecord(host.size, ps, host_free, tuple(self.cache_controller.held_host())),
            evictable_size=self.evictable_size_,
            protected_size=self.protected_size_,
            ongoing_write_through=tuple(
                self._ids(wt.fragments) for wt in self.ongoing_write_through.values()
            ),
            ongoing_load_back=tuple(
                nid for nid in (self.node_id(n) for n in self.ongoing_load_back.values()) if nid is not None
            ),
            ongoing_backup=tuple(self._ids(b.fragments) for b in self.ongoing_backup.values()),
            ongoing_prefetch=ongoing_prefetch,
            prefetch_tokens_occupied=self.prefetch_tokens_occupied,
            queues=self.cache_controller.queue_lengths(),
            l3_keys=tuple(l3_keys),
            requests=tuple(
                RequestRecord(r.rid, len(r.tokens), r.cache_protected_len, self.node_id(r.last_node))
                for _, r in sorted(self.requests.items())
            ),
        )

    def _ids(self, fragments: list[TreeNode]) -> tuple[NodeId, ...]:
        return tuple(nid for nid in (self.node_id(f) for f in fragments) if nid is not None)


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


def _slots(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.tolist())


def _whole_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every slot of the pages ``slots`` touch, in page order (a request owns whole pages)."""
    slot_numbers = slots.cpu().numpy().astype(np.int64, copy=False)
    pages = sorted_unique(slot_numbers // page_size if page_size > 1 else slot_numbers)  # (sorting copies)
    if page_size > 1:
        pages = (pages[:, None] * page_size + np.arange(page_size, dtype=np.int64)).ravel()
    return torch.from_numpy(pages.astype(np.int64, copy=False))
