"""The tiers of one rank on real pools: L1→L2 backups, L1 and L2 eviction, L2→L1 loads, L2→L3 backups
(seed §2.3-§3.5).

``TieredTree`` adds to the tree (``hiradix_tree.RadixTree``) what SGLang's ``HiRadixCache`` adds to
``RadixCache``: the device and host pools' allocators, the rank's ``cache_controller``
(``cache_controller.py``: queues, acks and the background copies) and three in-flight tables —
``ongoing_write_through``, ``ongoing_load_back``, ``ongoing_backup``. It fills the tree's hooks: a split
node's fragment joins the copies that cover the original (D-07), and a node hit ``write_through_threshold``
times is backed up (seed §3.5). The methods that need a reduction over ranks (``writing_check``,
``loading_check``) are generators that ``yield AllReduce(...)`` (``refcache.runtime``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refcache.config import HiCacheConfig
from refcache.gpu.cache_controller import HiCacheController
from refcache.gpu.hiradix_tree import EMPTY, RadixTree, TreeNode
from refcache.gpu.kv_oracle import KVOracle
from refcache.hicache.states import NodeEvent
from refcache.runtime import AllReduce, Collective, ReduceOp

__all__ = ["TieredTree"]


@dataclass
class _WriteThrough:
    """An ``ongoing_write_through`` entry."""

    fragments: list[TreeNode]  # parent first; more than one once the node was split (D-07)
    locked: bool  # write-through locks the source until the ack; write-back eviction does not


@dataclass
class _Backup:
    """An ``ongoing_backup`` entry: the fragments whose host pages an L3 write reads."""

    fragments: list[TreeNode]


class TieredTree(RadixTree):
    """The tree with its device and host copies and their in-flight tables (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, controller: HiCacheController, oracle: KVOracle):
        RadixTree.__init__(self, config, rank, oracle)
        self.cache_controller = controller
        self.enable_storage = config.enable_storage
        self.write_through_threshold = config.write_through_threshold
        self.load_back_threshold = config.load_back_threshold
        self.token_to_kv_pool_allocator = controller.mem_pool_device_allocator
        self.token_to_kv_pool_host = controller.mem_pool_host
        self.clock = controller.clock

    def _reset_tiers(self) -> None:
        self.ongoing_write_through: dict[int, _WriteThrough] = {}  # ack id (node id) -> entry, FIFO
        self.ongoing_load_back: dict[int, TreeNode] = {}  # ack id (node id) -> last loaded node
        self.ongoing_backup: dict[int, _Backup] = {}  # storage operation id -> entry

    def _split_inflight(self, child: TreeNode, new_node: TreeNode) -> None:
        # A pending copy covers the whole original range: the new fragment joins it, and an L3 backup
        # pins the fragment's host pages like the original's (D-07).
        for entry in self.ongoing_write_through.values():
            if child in entry.fragments:
                entry.fragments.insert(entry.fragments.index(child), new_node)
        for backup in self.ongoing_backup.values():
            if child in backup.fragments:
                backup.fragments.insert(backup.fragments.index(child), new_node)
                new_node.protect_host()

    def _on_hit(self, node: TreeNode) -> None:
        if not node.backuped and node.hit_count >= self.write_through_threshold:
            self.write_backup(node)

    # --- L1 -> L2 (seed §2.4, §3.5) ---------------------------------------------------------------------------

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
        host_indices = torch.cat(host_values) if host_values else EMPTY
        check = self._path_check(fragments[-1])
        check = check.cut(len(check.seeds) - len(host_indices), len(check.seeds))
        op_id = self.cache_controller.write_storage(host_indices, hashes, check)
        self.ongoing_backup[op_id] = _Backup(list(fragments))
        for f in fragments:
            f.protect_host()

    # --- L1 eviction (seed §3.1) ------------------------------------------------------------------------------

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

    # --- L2 eviction (seed §3.2) ------------------------------------------------------------------------------

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

    # --- L2 -> L1 (seed §2.3) ---------------------------------------------------------------------------------

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
        return EMPTY, last_node

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
