"""``HiRadixCache``: one rank's radix tree over device (L1) and host (L2) KV, with L3 through the
controller — the scheduler side of SGLang's hierarchical cache, on real pools.

Theory of operation
-------------------
A ``TreeNode`` holds a page-aligned key and, per tier, an int64 tensor of token slots: ``value`` in the
device pool, ``host_value`` in the host pool, plus one chained page hash per page (the L3 key of the
page). Slot tensors live on the CPU whatever the pool's device; the transfers move them to the kernel's
device (seed §5.4 ①). Its state (``refcache.hicache.states.NodeState``) says which tiers hold it and changes only through
``_transition`` and the table of ``refcache.hicache.states``.

``HiRadixCache`` is stacked from one layer per concern, cut as the model's ``RankCache`` is
(``refcache/model/_rank.py``) and as SGLang stacks ``RadixCache`` and ``HiRadixCache``:
``hiradix_tree.RadixTree`` (nodes, states, leaf heaps, locks, match, split, insert) ←
``hiradix_tiers.TieredTree`` (L1→L2 backups, eviction, loads, L2→L3 backups) ←
``hiradix_prefetch.PrefetchingTree`` (L3→L2 prefetch) ← ``hiradix_requests.RequestCache`` (running
requests) ← ``HiRadixCache`` (reset, idleness, the events round, the snapshot).

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

from collections.abc import Sequence

import torch

from refcache.config import HiCacheConfig
from refcache.gpu.cache_controller import HiCacheController
from refcache.gpu.hiradix_requests import Req
from refcache.gpu.hiradix_requests import RequestCache as _RequestCache
from refcache.gpu.hiradix_tree import MatchResult, TreeNode
from refcache.gpu.kv_oracle import KVOracle
from refcache.hicache.snapshot import (
    InFlight,
    NodeId,
    NodeRecord,
    PoolRecord,
    PrefetchRecord,
    RankSnapshot,
    RequestRecord,
)
from refcache.runtime import AllReduce, Collective, ReduceOp

__all__ = ["HiRadixCache", "MatchResult", "Req", "TreeNode"]


class HiRadixCache(_RequestCache):
    """One rank's tree and scheduler-side tables (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, controller: HiCacheController, oracle: KVOracle):
        _RequestCache.__init__(self, config, rank, controller, oracle)
        self.reset()

    # --- state ---------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """``reset()``: a new tree, empty tables, cleared pools and queues (only when idle; see busy)."""
        self.cache_controller.reset()
        self.token_to_kv_pool_allocator.clear()
        self.token_to_kv_pool_host.clear()
        self._reset_tree()
        self._reset_tiers()
        self._reset_prefetch()
        self._reset_requests()

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

    # --- the events round -------------------------------------------------------------------------------------

    def check_hicache_events(self) -> Collective[tuple[int, int, int, int, int]]:
        """``(writes, loads, revoked, backups, host_releases)`` retired this round."""
        writes = yield from self.writing_check()
        loads = yield from self.loading_check()
        revoked = backups = releases = 0
        if self.enable_storage:
            revoked, _, backups, releases = yield from self.drain_storage_control_queues()
        return writes, loads, revoked, backups, releases

    # --- snapshot ---------------------------------------------------------------------------------------------

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
        # The load stream's finish events (a load queued but not launched yet has none: unfinished).
        finished = {a.node_id: a.finish_event.is_set() for a in self.cache_controller.ack_load_queue}
        reads = self.cache_controller.pending_backup_reads()
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
            load_finished=tuple(
                finished.get(ack_id, False)
                for ack_id, n in self.ongoing_load_back.items()
                if self.node_id(n) is not None
            ),
            ongoing_backup=tuple(self._ids(b.fragments) for b in self.ongoing_backup.values()),
            backup_host_indices=tuple(reads.get(op_id, ()) for op_id in self.ongoing_backup),
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


def _slots(t: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if t is None else tuple(t.tolist())
