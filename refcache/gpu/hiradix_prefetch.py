"""L3→L2 prefetch of one rank on real pools: admission, termination, the insert of fetched pages, and the
drain of the storage control queues (seed §2.2, §3.6, §3.7).

``PrefetchingTree`` adds to the tiers (``hiradix_tiers.TieredTree``) the scheduler's side of a prefetch:
the ``ongoing_prefetch`` table (request id → anchor, key and the controller's ``PrefetchOperation``), the
tokens it occupies, ``check_prefetch_progress`` (MAX of ``can_terminate``, then MIN of completed tokens) and
the insert of what every rank read as host-only nodes (``_insert_helper_host``). The implementation runs
refcache's pipeline only (host memory at admission); SGLang 0.5.20's (D-01) is the model's
``AllocateAfterQuery`` and the implementation refuses that option with L3 (``driver.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from refcache.config import HiCacheConfig, PrefetchPolicy
from refcache.gpu.cache_controller import Check, HiCacheController, PrefetchOperation
from refcache.gpu.hiradix_tiers import TieredTree
from refcache.gpu.hiradix_tree import Key, TreeNode
from refcache.gpu.kv_oracle import KVOracle
from refcache.hicache.states import NodeEvent
from refcache.runtime import AllReduce, Collective, ReduceOp

__all__ = ["PrefetchingTree"]


@dataclass
class _Prefetch:
    """An ``ongoing_prefetch`` entry."""

    last_host_node: TreeNode  # host-protected until the entry goes
    tokens: Key
    namespace: str | None
    op: PrefetchOperation


class PrefetchingTree(TieredTree):
    """The tiers with the scheduler's side of L3 prefetch (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, controller: HiCacheController, oracle: KVOracle):
        TieredTree.__init__(self, config, rank, controller, oracle)

    def _reset_prefetch(self) -> None:
        self.ongoing_prefetch: dict[int, _Prefetch] = {}  # request id -> entry
        self.prefetch_tokens_occupied = 0

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

    # --- control queues ---------------------------------------------------------------------------------------

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
