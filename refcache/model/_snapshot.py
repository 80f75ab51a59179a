"""The snapshot encoder: one ``RankCache`` (tree, tables, controller) as a ``refcache.hicache.snapshot.RankSnapshot``.

Reads rank state and changes none. Nodes are named by their path (``NodeId``), never by their per-rank
creation id, so snapshots of the model and the implementation compare field by field.
"""

from __future__ import annotations

import dataclasses

from refcache.hicache.snapshot import (
    InFlight,
    NodeId,
    NodeRecord,
    PoolRecord,
    PrefetchRecord,
    RankSnapshot,
    RequestRecord,
)
from refcache.model._controller import PrefetchOperation
from refcache.model._rank import RankCache
from refcache.model._tree import Key, TreeNode

__all__ = ["snapshot_rank"]


def snapshot_rank(rank: RankCache, clock_skew_us: int = 0) -> RankSnapshot:
    """What ``rank`` holds, in the shared vocabulary of ``refcache.hicache.snapshot``; ``clock_skew_us``: how far its
    clock is past the snapshot's ``clock_us`` (D-41)."""
    ctrl = rank.cache_controller
    ids = _node_ids(rank)
    in_flight: dict[int, set[str]] = {}
    for wt in rank.ongoing_write_through.values():
        for f in wt.fragments:
            in_flight.setdefault(f.id, set()).add(InFlight.WRITE_THROUGH)
    for node in rank.ongoing_load_back.values():
        in_flight.setdefault(node.id, set()).add(InFlight.LOAD_BACK)
    for backup in rank.ongoing_backup.values():
        for f in backup.fragments:
            in_flight.setdefault(f.id, set()).add(InFlight.BACKUP)
    for entry in rank.ongoing_prefetch.values():
        in_flight.setdefault(entry.anchor.id, set()).add(InFlight.PREFETCH_ANCHOR)
    records: list[NodeRecord] = []
    for node in rank.nodes.values():
        node_id = _lookup(ids, node)
        if node_id is None:
            continue
        records.append(
            NodeRecord(
                id=node_id,
                key_len=len(node.key),
                state=node.state,
                value=None if node.value is None else tuple(node.value),
                host_value=None if node.host_value is None else tuple(node.host_value),
                hash_value=tuple(rank.hashes(node)),
                lock_ref=node.lock_ref,
                host_ref_counter=node.host_ref_counter,
                hit_count=node.hit_count,
                priority=node.priority,
                in_flight=tuple(sorted(in_flight.get(node.id, ()))),
                evictable_leaf=node.id in rank.leaves.members,
                host_leaf=node.id in rank.host_leaves.members,
            )
        )
    records.sort(key=lambda r: r.id)
    held_device = tuple(
        sorted((f"request:{r.rid}", tuple(r.owned)) for r in rank.requests.values() if r.owned)
    )
    held_host: list[tuple[str, tuple[int, ...]]] = []
    ops: dict[int, PrefetchOperation] = {
        e.op.id: e.op for e in rank.ongoing_prefetch.values()
    } | ctrl.orphan_prefetch_ops
    for op in ctrl.prefetch_queue:
        ops[op.id] = op
    if ctrl.prefetch_parked is not None:
        ops[ctrl.prefetch_parked.op.id] = ctrl.prefetch_parked.op
    if rank.cfg.allocate_prefetch_after_query and not rank.cfg.prefetch_progress_in_operation:
        # D-01: a live entry's operation holds all its slots; one the tree let go holds its unread tail
        # [completed_tokens, ...) until the drain of its final ack frees it. (D-54: as refcache's, the
        # operation keeps what it owns, and the I/O helper releases its unread tail when the transfer ends.)
        live = {e.op.id for e in rank.ongoing_prefetch.values()}
        ops = {
            op.id: dataclasses.replace(op, host_indices=op.host_indices[op.completed_tokens :])
            if op.id not in live
            else op
            for op in ctrl.pending_prefetch_ops
        }
    for op_id, op in sorted(ops.items()):
        if op.host_indices:
            held_host.append((f"prefetch:{op_id}", tuple(op.host_indices)))
    if ctrl.host_mem_release_queue:
        held_host.append(("release_queue", tuple(s for page in ctrl.host_mem_release_queue for s in page)))
    prefetch_records = tuple(
        PrefetchRecord(
            rid=rid,
            anchor=_lookup(ids, entry.anchor),
            tokens=len(entry.tokens),
            stage=entry.op.stage,
            hit_pages=len(entry.op.hash_value),
            completed_tokens=entry.op.completed_tokens,
            terminated=entry.op.terminated,
            split_off=tuple(_fragments(ids, entry.split_off)),
        )
        for rid, entry in sorted(rank.ongoing_prefetch.items())
    )
    ps = rank.ps
    finished = {ack.node_id: ack.done for ack in ctrl.ack_load_queue}  # the load stream's finish events
    reads = ctrl.pending_backup_reads()
    return RankSnapshot(
        rank=rank.rank,
        nodes=tuple(records),
        device=PoolRecord(rank.device.size, ps, rank.device.free_slots(), held_device),
        host=PoolRecord(rank.host.size, ps, rank.host.free_slots(), tuple(held_host)),
        evictable_size=rank.evictable_size,
        protected_size=rank.protected_size,
        ongoing_write_through=tuple(
            tuple(_fragments(ids, wt.fragments)) for wt in rank.ongoing_write_through.values()
        ),
        ongoing_load_back=tuple(
            nid for nid in (_lookup(ids, n) for n in rank.ongoing_load_back.values()) if nid is not None
        ),
        load_finished=tuple(
            finished.get(ack_id, False)
            for ack_id, n in rank.ongoing_load_back.items()
            if _lookup(ids, n) is not None
        ),
        ongoing_backup=tuple(tuple(_fragments(ids, b.fragments)) for b in rank.ongoing_backup.values()),
        backup_host_indices=tuple(tuple(reads.get(op_id, ())) for op_id in rank.ongoing_backup),
        ongoing_prefetch=prefetch_records,
        prefetch_tokens_occupied=rank.prefetch_tokens_occupied,
        queues=ctrl.queue_lengths(),
        l3_keys=tuple(ctrl.l3_keys()),
        requests=tuple(
            RequestRecord(r.rid, len(r.tokens), r.protected_len, _lookup(ids, r.lock_node))
            for _, r in sorted(rank.requests.items())
        ),
        clock_skew_us=clock_skew_us,
    )


def _node_ids(rank: RankCache) -> dict[int, NodeId]:
    """Every non-root node's name, built in one pass from the root down."""
    ids: dict[int, NodeId] = {}
    stack: list[tuple[TreeNode, Key]] = [(child, ()) for child in rank.root.children.values()]
    while stack:
        node, above = stack.pop()
        path = above + node.key
        ids[node.id] = NodeId(node.namespace or "", path)
        stack.extend((child, path) for child in node.children.values())
    return ids


def _lookup(ids: dict[int, NodeId], node: TreeNode) -> NodeId | None:
    return ids.get(node.id)


def _fragments(ids: dict[int, NodeId], fragments: list[TreeNode]) -> list[NodeId]:
    return [ids[f.id] for f in fragments if f.id in ids]
