"""The tiers of one rank: L1→L2 backups, L1 and L2 eviction, L2→L1 loads, L2→L3 backups (seed §2.3-§3.5).

Theory of operation
-------------------
``TieredTree`` adds to the tree (``_tree.RadixTree``) what SGLang's ``HiRadixCache`` adds to ``RadixCache``:
the device and host allocators, the rank's ``cache_controller`` (``_controller.py``, SGLang's
``HiCacheController``: queues, acks and the background jobs, run only when ``HiCacheModel`` says so) and
three in-flight tables — ``ongoing_write_through``, ``ongoing_load_back``, ``ongoing_backup``. It fills the
tree's hooks: a split node's fragment joins the copies that cover the original (D-07), and a node hit
``write_through_threshold`` times is backed up (seed §3.5).

Under ``reclaim_host_duplicates`` (D-48, SGLang 0.5.22 on) with write_back, ``evict_host`` first frees the
host copies of nodes that are also on the device. As in SGLang, the candidates are the nodes registered in
``full_host_duplicates`` where such a copy is born — a write ack, a load ack, a refill, a split — in the order
they were registered; an entry is checked when the reclaim reaches it (it may be stale) and removed only there
(or with its node).

Methods that SGLang runs under a collective are split in two — a *local* half that reports this rank's
fact (``ready_write_acks``, ``ready_load_acks``) and an *apply* half that takes the reduced value — and
``HiCacheModel`` performs the MIN between them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from refcache.config import HiCacheConfig, WritePolicy
from refcache.hicache.states import NodeEvent
from refcache.model._controller import HiCacheController, L3Store
from refcache.model._pools import DeviceAllocator, HostAllocator
from refcache.model._tree import RadixTree, TreeNode

__all__ = ["TieredTree"]


@dataclass(slots=True)
class _WriteThrough:
    """An ``ongoing_write_through`` entry: the fragments of the node being copied L1→L2."""

    fragments: list[TreeNode]  # parent first; only _split_node adds to it (when the node is split)
    locked: bool  # write_through modes lock the source until the ack; write_back does not


@dataclass(slots=True)
class _Backup:
    """An ``ongoing_backup`` entry: the fragments whose host slots an L2→L3 operation pins until its ack."""

    fragments: list[TreeNode]  # parent first; only _split_node adds to it (when the node is split)


class TieredTree(RadixTree):
    """The tree with its device and host copies and their in-flight tables (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, l3: L3Store) -> None:
        self.device = DeviceAllocator(config.device_size, config.page_size)
        self.host = HostAllocator(config.host_size, config.page_size)
        self.cache_controller = HiCacheController(config, rank, self.device, self.host, l3)
        RadixTree.__init__(self, config, rank)
        self._reset_tiers()

    def _reset_tiers(self) -> None:
        self.ongoing_write_through: dict[int, _WriteThrough] = {}  # ack id → entry, in enqueue order
        self.ongoing_load_back: dict[int, TreeNode] = {}  # ack id → last loaded node
        self.ongoing_backup: dict[int, _Backup] = {}  # storage operation id → entry
        # D-48 only (empty otherwise): node id → node, in registration order; only _track_duplicate adds,
        # only _reclaim_host_duplicates removes (stale entries stay until it reaches them).
        self.full_host_duplicates: dict[int, TreeNode] = {}
        # D-48 with write_back only: node id → the load back (its anchor's id) whose copy onto it is in flight;
        # only load_back sets, _split_inflight copies and loading_check_apply clears an entry.
        self.load_back_pending: dict[int, int] = {}

    def _split_inflight(self, child: TreeNode, new: TreeNode) -> None:
        # A pending copy covers the whole original range: record the new fragment with it, and pin the
        # fragment's host slots like the original's (sglang.md §9 #15). D-07.
        for wt in self.ongoing_write_through.values():
            if child in wt.fragments:
                wt.fragments.insert(wt.fragments.index(child), new)
        for backup in () if self.cfg.backup_protects_passed_node_only else self.ongoing_backup.values():
            if child in backup.fragments:
                backup.fragments.insert(backup.fragments.index(child), new)
                self._protect_host(new)
        if (
            self.cfg.reclaim_host_duplicates
        ):  # D-48: the fragment shares the node's load back, and may be a duplicate
            if child.id in self.load_back_pending:
                self.load_back_pending[new.id] = self.load_back_pending[child.id]
            self._track_duplicate(new)

    def _on_refill(self, node: TreeNode) -> None:
        self._track_duplicate(node)  # D-48: a refilled node is on both tiers at once

    def _on_hit(self, node: TreeNode) -> None:
        if not node.backuped and node.hit_count >= self.cfg.write_through_threshold:
            self.write_backup(node)

    # --- L1 -> L2 (seed §2.4, §3.5) ---------------------------------------------------------------------------

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

    def writing_check_apply(self, finish_count: int, *, flush: bool = False) -> int:
        """Retire ``finish_count`` write acks (the MIN over ranks): unlock, then chain L2→L3. ``flush``: the
        blocking check of a write_back eviction, which chains none under D-67 (SGLang up to 0.5.8)."""
        storage = self.cfg.enable_storage and not (flush and self.cfg.write_back_flush_skips_storage)
        for ack_id in self.cache_controller.pop_write_acks(finish_count):
            entry = self.ongoing_write_through.pop(ack_id)
            for fragment in entry.fragments:  # D-48: the backed-up copy is a duplicate only from its ack
                self._track_duplicate(fragment)
            if storage and self.cfg.backup_per_fragment:
                for fragment in entry.fragments:  # D-53: one L3 backup (and host pin) per fragment
                    self.write_backup_storage([fragment])
            elif storage:
                self.write_backup_storage(entry.fragments)
            if entry.locked:
                self.dec_lock_ref(entry.fragments[-1])
        return finish_count

    def write_backup_storage(self, fragments: list[TreeNode]) -> None:
        """Queue the L2→L3 write of a node (all fragments of it, if it was split meanwhile)."""
        keys = [h for f in fragments for h in self.hashes(f)]
        # Every fragment's pages are read, also under D-07's option (0.5.20 reads the whole split chain).
        slots = [s for f in fragments for s in f.host_value or ()]
        op_id = self.cache_controller.write_storage(keys, slots)
        if self.cfg.backup_protects_passed_node_only:
            fragments = fragments[-1:]  # D-07 option: 0.5.20 pins only the node it was passed (§9 #15)
        self.ongoing_backup[op_id] = _Backup(list(fragments))
        for f in fragments:
            self._protect_host(f)

    # --- L1 eviction (seed §3.1) ------------------------------------------------------------------------------

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
            elif self.write_backup(x, write_back=True) == 0:
                # No host memory even after evict_host: a failed backup is never treated as done
                # (sglang.md §9 #7). D-66 (SGLang 0.5.11..0.5.14): x stays on the device, nothing counted.
                if self.cfg.failed_write_back_keeps_node:
                    skipped.append(node_id)
                    continue
                # Flush what is staged, then drop x.
                self._flush_staged(staged)
                dropped = self._drop_no_host(x)
                if dropped == 0:
                    skipped.append(node_id)
                num_evicted += dropped
            elif self.cfg.write_back_per_victim:
                # D-44 (SGLang 0.5.22 on): wait for this victim's copy and demote it before choosing the
                # next victim, whose backup's evict_host may then take this one's host copy.
                self.writing_check_blocking()
                num_evicted += self._evict_backuped(x)
            else:
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
        self.writing_check_apply(len(self.cache_controller.ack_write_queue), flush=True)

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
        below = list(self._descendants(node))
        if any(n.host_ref_counter > 0 for n in below):
            return False
        for n in reversed(below):  # every node after its descendants
            assert n.host_value is not None and n.value is None, "a device leaf's descendants are host-only"
            self._transition(n, NodeEvent.EVICT_HOST)
            self.host.free(n.host_value)
            self._delete(n)
        return True

    # --- L2 eviction (seed §3.2) ------------------------------------------------------------------------------

    def evict_host(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` host tokens from host-only leaves (under D-48 with write_back, from host
        duplicates first); returns tokens freed."""
        num_evicted = 0
        if self.cfg.reclaim_host_duplicates and self.cfg.hicache_write_policy is WritePolicy.WRITE_BACK:
            num_evicted = self._reclaim_host_duplicates(num_tokens)
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

    # --- D-48: host duplicates (SGLang 0.5.22 on, unified_tree_core.py) -----------------------------------------

    def _settled_duplicate(self, node: TreeNode) -> bool:
        """On both tiers with no copy onto either in flight (``_is_settled_full_host_duplicate``)."""
        return (
            node is not self.root
            and node.id in self.nodes
            and node.value is not None
            and node.host_value is not None
            and node.id not in self.load_back_pending
            and not any(node in wt.fragments for wt in self.ongoing_write_through.values())
        )

    def _track_duplicate(self, node: TreeNode) -> None:
        """Register ``node`` where a duplicate may be born (``_update_duplicate_tracking``): kept in place if
        already there, dropped if it is not (or no longer) a settled duplicate."""
        if not self.cfg.reclaim_host_duplicates:
            return
        if self._settled_duplicate(node):
            self.full_host_duplicates.setdefault(node.id, node)
        else:
            self.full_host_duplicates.pop(node.id, None)

    def _reclaim_host_duplicates(self, num_tokens: int) -> int:
        """Free host copies of registered duplicates until ``num_tokens`` are freed; the first pass spares
        evictable device leaves (their eviction would demote them onto that very copy), the second takes
        them. A node with a host pin (``host_ref_counter``) stays. Returns host tokens freed."""
        freed = 0
        swept: list[int] = []
        for spare_device_leaves in (True, False):
            if freed >= num_tokens:
                break
            for node_id, node in self.full_host_duplicates.items():  # not changed during the walk
                if freed >= num_tokens:
                    break
                if node.id not in self.nodes or node.value is None or node.host_value is None:
                    swept.append(node_id)  # stale: removed, demoted, or reclaimed in the first pass
                    continue
                if (
                    spare_device_leaves
                    and node.lock_ref == 0
                    and all(c.evicted for c in node.children.values())
                ):
                    continue
                if node.host_ref_counter > 0 or not self._settled_duplicate(node):
                    continue
                self._transition(node, NodeEvent.RECLAIM_HOST_DUPLICATE)
                self.host.free(node.host_value)
                freed += len(node.host_value)
                node.host_value = None
                self._refresh_leaf(node)
                self._refresh_leaf(node.parent)
                swept.append(node_id)
        for node_id in swept:
            self.full_host_duplicates.pop(node_id, None)
        return freed

    # --- L2 -> L1 (seed §2.3) ---------------------------------------------------------------------------------

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
            # D-47: 0.5.22 on evicts only the shortfall (``load_back_evicts_shortfall``), 0.5.20 the whole size.
            short = self.device.available_size() if self.cfg.load_back_evicts_shortfall else 0
            self.evict(len(host_indices) - short)
            device_indices = self.cache_controller.load(host_indices, node.id)
        self.dec_lock_ref(ancestor)
        for n in nodes_to_load:
            self._release_host(n)
        if device_indices is None:
            return None
        self.ongoing_load_back[node.id] = node
        if self.cfg.reclaim_host_duplicates and self.cfg.hicache_write_policy is WritePolicy.WRITE_BACK:
            for n in nodes_to_load:  # D-48: no reclaim of these host copies until the ack
                self.load_back_pending[n.id] = node.id
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
            anchor = self.ongoing_load_back.pop(ack_id)
            self.dec_lock_ref(anchor)
            if (
                self.cfg.reclaim_host_duplicates
            ):  # D-48 (``finish_load_back``): the loaded nodes, anchor first
                self._finish_load_back(anchor)
        return finish_count

    def ready_load_ids(self) -> list[int]:
        """Local half of D-68's ``loading_check``: the ack ids of this rank's finished loads, oldest first."""
        return self.cache_controller.ready_load_ids()

    def loading_check_own(self, finished: int, everywhere: Callable[[int], bool]) -> int:
        """D-68 (SGLang up to 0.5.12): retire this rank's own finished loads (``finished``, its ready prefix)
        without a collective, each that every rank has finished too (``everywhere(ack_id)``) or whose anchor another
        lock keeps protected, so that only lock counts differ between the ranks. The first whose lock is its
        anchor's last and that a peer has not finished waits, as the MIN would retire it: SGLang's rank that
        retires it alone makes the node evictable on that rank only (R-12). Returns how many."""
        done = 0
        while done < finished:
            ack_id = self.cache_controller.next_load_ack()
            assert ack_id is not None
            if not everywhere(ack_id) and self.ongoing_load_back[ack_id].lock_ref < 2:
                break
            self.loading_check_apply(1)
            done += 1
        return done

    def _finish_load_back(self, anchor: TreeNode) -> None:
        write_back = self.cfg.hicache_write_policy is WritePolicy.WRITE_BACK
        for n in self._ancestors(anchor):
            if n is self.root:
                break
            if write_back:
                if self.load_back_pending.get(n.id) != anchor.id:
                    continue
                del self.load_back_pending[n.id]
            self._track_duplicate(n)

    # --- L2 -> L3 acks and host releases (seed §3.7) ----------------------------------------------------------

    def backup_acks_apply(self, count: int) -> None:
        """Retire ``count`` L2→L3 backup acks (the MIN over ranks): unpin the fragments' host slots."""
        for op_id in self.cache_controller.pop_backup_acks(count):
            for fragment in self.ongoing_backup.pop(op_id).fragments:
                self._release_host(fragment)

    def host_mem_release_apply(self, count: int) -> None:
        """Free ``count`` entries of the host-memory release queue (the MIN over ranks, D-08)."""
        for page in self.cache_controller.pop_host_mem_releases(count):
            self.host.free(page)
