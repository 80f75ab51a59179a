"""SGLang's tree, tables and pools read into a ``refcache.hicache.snapshot.Snapshot``, and the device slot renaming.

Every field comes from SGLang's own objects, with three documented translations:

* **Device slots** are renamed (``DeviceRenamer``): SGLang reserves page 0 as padding and its allocators
  reuse freed pages first (paged: freed pages go to the head; token: to the tail in the freed order), while
  refcache allocates FIFO from page 0 and appends freed pages ascending (D-19). The renamer keeps a shadow
  allocator with refcache's rule and maps each SGLang page to the shadow page allocated at the same moment;
  both are freed together. Allocating at a different moment, or a different number of pages, than the
  model shows up as a difference in node values or the free list.
* **Host slots** need no renaming: SGLang's host pool is FIFO from slot 0 and appends frees at the tail
  in order (its lazy ``release_slots`` list keeps that order), exactly refcache's host rule.
* **Hashes**: without L3, 0.5.20 computes none (D-12); the snapshot then reports the chain of
  ``refcache.hashing.page_hashes`` over the node's path, which is what 0.5.20 computes when it hashes.

Node states follow from SGLang's fields (``value`` and ``host_value``); in-flight tables from
``ongoing_write_through`` (the publish nodes, fragments included), ``ongoing_load_back``,
``ongoing_backup`` and ``ongoing_prefetch``; leaf flags from ``evictable_leaves`` and
``evictable_host_leaves``; queue lengths from the controller's ack lists and their events; ``load_finished``
from the finish event of the load ack that lists each ``ongoing_load_back`` entry (``HiCacheAck.node_ids``).
On a CPU the adapter's fake stream (``_gate``) fires those events, oldest ack first, as a ``CompleteIO`` of the
load queue asks: LOAD-STREAM-ORDER there checks SGLang's ack bookkeeping under that stream, not CUDA's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Protocol

from refcache.config import HiCacheConfig
from refcache.engines.sglang._compat import Compat
from refcache.engines.sglang._storage import Gate
from refcache.hashing import Token, page_hashes, storage_namespace_seed
from refcache.hicache.snapshot import (
    InFlight,
    NodeId,
    NodeRecord,
    PoolRecord,
    PrefetchRecord,
    RankSnapshot,
    RequestRecord,
    Snapshot,
)
from refcache.hicache.states import NodeState, PrefetchStage

__all__ = ["DeviceRenamer", "SnapshotSource", "pending_backup_reads", "prefetch_state", "read_snapshot"]


class DeviceRenamer:
    """SGLang device pages -> the pages refcache's allocator would have handed out (module docstring)."""

    def __init__(self, size: int, page_size: int) -> None:
        self.page_size = page_size
        self.pages = size // page_size
        self.clear()

    def clear(self) -> None:
        self.free: deque[int] = deque(range(self.pages))
        self.to_shadow: dict[int, int] = {}  # SGLang page -> shadow page, for allocated pages
        self._batch: set[int] | None = None

    def allocated(self, first_slots: Iterable[int]) -> None:
        """SGLang allocated the pages starting at ``first_slots`` (in allocation order)."""
        for slot in first_slots:
            page = slot // self.page_size
            if page in self.to_shadow or not self.free:
                raise AssertionError(f"device page {page} allocated twice, or beyond the shadow pool")
            self.to_shadow[page] = self.free.popleft()

    def freed(self, slots: Iterable[int]) -> None:
        """SGLang freed the pages holding ``slots``; the shadow frees them ascending (refcache's rule), or at
        the end of the current ``batch``."""
        shadow = {self.to_shadow.pop(s // self.page_size) for s in slots}
        if self._batch is not None:
            self._batch.update(shadow)
        else:
            self.free.extend(sorted(shadow))

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Frees inside are one free: an abort releases the request's pages in one call in refcache, where
        0.5.20 frees two segments (``[protected, key_len)`` and the tail)."""
        self._batch = set()
        try:
            yield
        finally:
            pages, self._batch = self._batch, None
            self.free.extend(sorted(pages))

    def slot(self, slot: int) -> int:
        ps = self.page_size
        return self.to_shadow[slot // ps] * ps + slot % ps

    def slots(self, slots: Iterable[int]) -> tuple[int, ...]:
        return tuple(self.slot(int(s)) for s in slots)

    def free_slots(self) -> tuple[int, ...]:
        ps = self.page_size
        return tuple(p * ps + i for p in self.free for i in range(ps))


def _state(node: Any) -> NodeState:
    if node.value is not None:
        return NodeState.BOTH if node.host_value is not None else NodeState.DEVICE
    return NodeState.HOST


class SnapshotSource(Protocol):
    """What ``read_snapshot`` reads of an adapter (``_adapter.SGLangSystem`` is one). A protocol rather than
    the adapter's class, so that this module, which the adapter imports, imports nothing of the adapter."""

    @property
    def config(self) -> HiCacheConfig: ...
    @property
    def clock_us(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def cache(self) -> Any: ...  # SGLang's HiRadixCache
    @property
    def controller(self) -> Any: ...  # its HiCacheController
    @property
    def host_pool(self) -> Any: ...  # its host KV pool
    @property
    def req_to_token_pool(self) -> Any: ...
    @property
    def requests(self) -> Mapping[int, Any]: ...  # the adapter's running requests by rid
    @property
    def renamer(self) -> DeviceRenamer: ...
    @property
    def compat(self) -> Compat: ...  # the API differences of the installed release
    @property
    def gate(self) -> Gate | None: ...
    @property
    def op_base(self) -> int: ...
    def prefetch_ops(self) -> list[Any]: ...
    def io_done(self) -> set[int]: ...
    @property
    def io_releases_tail(self) -> bool: ...  # up to 0.5.18: the I/O thread releases the unread tail
    @property
    def revoke_queue(self) -> bool: ...  # up to 0.5.17: the prefetch thread revokes through a queue
    @property
    def allocated_at_admission(self) -> bool: ...  # up to 0.5.15: host memory from admission on (D-01 off)
    def past_query(self, op: Any) -> bool: ...  # the operation's hit query resolved
    def revoked_at_query(self, op: Any) -> bool: ...  # up to 0.5.15: its query released all its host memory
    def l3_keys(self) -> tuple[str, ...]: ...


def _tokens(node: Any) -> tuple[Token, ...]:
    return tuple(node.key)  # RadixKey iterates tokens, or (t_i, t_i+1) pairs in bigram (EAGLE) mode


def _walked_leaves(nodes: list[Any]) -> tuple[set[Any], set[Any]]:
    """The leaves up to 0.5.8's ``evict`` and ``evict_host`` collect by walking the tree (``_compat``
    "no_leaf_sets"), as they take them: device leaves (``_collect_leaves_device``: on the device, every child
    evicted) that are unlocked, and unlocked childless nodes (``_collect_leaves``) that are host-only."""
    device = {n for n in nodes if n.value is not None and n.lock_ref == 0}
    device = {n for n in device if all(c.value is None for c in n.children.values())}
    host = {n for n in nodes if n.value is None and n.lock_ref == 0 and not n.children}
    return device, host


def read_snapshot(system: SnapshotSource) -> Snapshot:
    """This process's rank. One rank of several (a ``_tp`` worker) reports its own clock as its
    ``clock_skew_us`` (and ``clock_us`` 0), which ``_tp.join_ranks`` joins with its peers' (D-41)."""
    cfg = system.config
    own = cfg.tp_size > 1
    return Snapshot(
        page_size=cfg.page_size,
        write_policy=cfg.hicache_write_policy.value,
        attention=cfg.attention.value,
        tp_size=cfg.tp_size,
        model_name=cfg.model_name,
        storage_enabled=cfg.enable_storage,
        is_eagle=cfg.is_eagle,
        clock_us=0 if own else system.clock_us,
        ranks=(_rank(system, system.clock_us if own else 0),),
    )


def request_records(
    system: Any, last_node_id: Callable[[Any], NodeId | None]
) -> tuple[list[tuple[str, tuple[int, ...]]], list[RequestRecord]]:
    """The requests' device pages (``held``: beyond each one's protected prefix, in shadow numbers) and their
    records, read from ``req_to_token`` (the same in 0.5.20 and 0.5.23); ``last_node_id`` names a request's
    last node (None for the root)."""
    ps, renamer = system.config.page_size, system.renamer
    held: list[tuple[str, tuple[int, ...]]] = []
    requests = []
    for rid, request in sorted(system.requests.items()):
        row = system.req_to_token_pool.req_to_token[request.kv.req_pool_idx]
        protected = int(request.kv.cache_protected_len)
        owned = [int(s) for s in row[protected : len(request.tokens)].tolist()]
        pages = sorted({s // ps for s in owned}, key=lambda p: renamer.to_shadow[p])
        if pages:
            held.append((f"request:{rid}", tuple(renamer.slot(p * ps + i) for p in pages for i in range(ps))))
        requests.append(RequestRecord(rid, len(request.tokens), protected, last_node_id(request.last_node)))
    held.sort()
    return held, requests


def host_free_slots(host: Any, *, lazy: bool = True) -> list[int]:
    """The host pool's free slots in order: ``free_slots``, then (``lazy``) the lazily released chunks; up to
    0.5.15 the pool frees into ``free_slots`` at once (``_compat`` "host_free_eager")."""
    free = [int(s) for s in host.free_slots.tolist()]
    for chunk in host.release_slots if lazy else ():
        free.extend(int(s) for s in chunk.tolist())
    return free


def pending_backup_reads(controller: Any) -> dict[int, tuple[int, ...]]:
    """The host slots each L3 backup the backup thread has not taken yet will read, by operation id (the
    snapshot's ``backup_host_indices``): the ``host_indices`` of the ``StorageOperation``s in ``backup_queue``,
    as ``write_storage`` enqueued them. One the thread took has run (the adapter settles after every step) and
    reads nothing more."""
    pending = controller.backup_queue
    with pending.mutex:
        ops = list(pending.queue)
    return {int(op.id): tuple(int(s) for s in op.host_indices.tolist()) for op in ops}


def _rank(system: SnapshotSource, clock_skew_us: int) -> RankSnapshot:
    cache, cc, renamer = system.cache, system.controller, system.renamer
    ps = system.config.page_size
    ids: dict[int, NodeId] = {}
    hashes: dict[int, tuple[str, ...]] = {}
    order: list[Any] = []
    stack: list[tuple[Any, tuple[Token, ...]]] = [(cache.root_node, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            child_path = path + _tokens(child)
            namespace = child.key.extra_key
            ids[id(child)] = NodeId(namespace or "", child_path)
            if child.hash_value is not None:
                hashes[id(child)] = tuple(child.hash_value)
            else:  # D-12: what 0.5.20 computes when it hashes (compute_node_hash_values)
                prior = hashes.get(id(node)) if node is not cache.root_node else None
                seed = prior[-1] if prior else storage_namespace_seed(namespace)
                hashes[id(child)] = tuple(page_hashes(_tokens(child), ps, seed))
            order.append(child)
            stack.append((child, child_path))

    in_flight: dict[int, set[str]] = {}
    write_through = []
    per_node = system.compat.has("write_through_per_node")
    for entry in cache.ongoing_write_through.values():
        publish = [entry] if per_node else entry[2]  # (lock node, length, the nodes it publishes)
        write_through.append(tuple(ids[id(n)] for n in publish if id(n) in ids))
        for n in publish:
            in_flight.setdefault(id(n), set()).add(InFlight.WRITE_THROUGH)
    load_back = []
    load_finished = []
    # An ack's finish event covers every load start_loading merged into it (its node_ids).
    finished = {nid: bool(a.finish_event.query()) for a in cc.ack_load_queue for nid in a.node_ids}
    for ack_id, node in cache.ongoing_load_back.items():
        in_flight.setdefault(id(node), set()).add(InFlight.LOAD_BACK)
        if id(node) in ids:
            load_back.append(ids[id(node)])
            load_finished.append(finished.get(ack_id, False))
    backups = []
    reads = pending_backup_reads(cc) if system.config.enable_storage else {}
    backup_reads = []
    for op_id, node in cache.ongoing_backup.items():
        in_flight.setdefault(id(node), set()).add(InFlight.BACKUP)
        backups.append((ids[id(node)],) if id(node) in ids else ())
        backup_reads.append(reads.get(op_id, ()))
    for anchor, *_rest in cache.ongoing_prefetch.values():
        in_flight.setdefault(id(anchor), set()).add(InFlight.PREFETCH_ANCHOR)

    if system.compat.has("no_leaf_sets"):
        evictable, host_leaves = _walked_leaves(order)
    else:
        evictable, host_leaves = cache.evictable_leaves, cache.evictable_host_leaves
    # up to 0.5.5 a node has no priority (``_compat`` "no_node_priority"): 0, as every node of the model
    # without D-24's and D-51's priorities, which those releases' profiles leave off
    no_priority = system.compat.has("no_node_priority")

    def priority(node: Any) -> int:
        return 0 if no_priority else int(node.priority)

    records = [
        NodeRecord(
            id=ids[id(n)],
            key_len=len(n.key),
            state=_state(n),
            value=None if n.value is None else renamer.slots(n.value.tolist()),
            host_value=None if n.host_value is None else tuple(int(s) for s in n.host_value.tolist()),
            hash_value=hashes[id(n)],
            lock_ref=int(n.lock_ref),
            host_ref_counter=int(n.host_ref_counter),
            hit_count=int(n.hit_count),
            priority=priority(n),
            in_flight=tuple(sorted(in_flight.get(id(n), ()))),
            evictable_leaf=n in evictable,
            host_leaf=n in host_leaves,
        )
        for n in order
    ]
    records.sort(key=lambda r: r.id)

    held, requests = request_records(
        system, lambda last: None if last is cache.root_node else ids.get(id(last))
    )
    host = system.host_pool
    host_free = host_free_slots(host, lazy=not system.compat.has("host_free_eager"))
    write_acks, load_acks = cc.ack_write_queue, cc.ack_load_queue
    write_pending = sum(1 for a in write_acks if not a.finish_event.query())
    load_pending = sum(1 for a in load_acks if not a.finish_event.query())
    storage = system.config.enable_storage
    entries = [
        (int(rid), None if anchor is cache.root_node else ids.get(id(anchor)), len(key), op)
        # up to 0.5.15 an entry holds the host indices before its operation
        for rid, (anchor, key, *_indices, op) in cache.ongoing_prefetch.items()
    ]
    held_host, prefetches = prefetch_state(system, entries) if storage else ([], ())

    def size(name: str) -> int:
        return int(getattr(cc, name).qsize()) if storage else 0

    return RankSnapshot(
        rank=system.rank,
        nodes=tuple(records),
        device=PoolRecord(renamer.pages * ps, ps, renamer.free_slots(), tuple(held)),
        host=PoolRecord(int(host.size), ps, tuple(host_free), tuple(held_host)),
        evictable_size=int(cache.evictable_size_),
        protected_size=int(cache.protected_size_),
        ongoing_write_through=tuple(write_through),
        ongoing_load_back=tuple(load_back),
        load_finished=tuple(load_finished),
        ongoing_backup=tuple(backups),
        backup_host_indices=tuple(backup_reads),
        ongoing_prefetch=prefetches,
        prefetch_tokens_occupied=int(cc.prefetch_tokens_occupied) if storage else 0,
        queues=(
            ("write_pending", write_pending),
            ("write_acks", len(write_acks) - write_pending),
            ("load_pending", load_pending),
            ("load_acks", len(load_acks) - load_pending),
            # awaiting the hit query, its all-reduce (two ranks) or its drain (the model's "parked" query)
            (
                "prefetch_query",
                size("prefetch_queue")
                + (0 if system.allocated_at_admission else size("prefetch_hit_queue"))
                + (system.gate.in_all_reduce("prefetch_hits") if system.gate is not None else 0),
            ),
            # allocated operations until the drain of their final ack (buffered, reading, acked); up to 0.5.18
            # until their transfer ends
            (
                "prefetch_io",
                sum(
                    system.past_query(op)
                    and not system.revoked_at_query(op)
                    and not (system.io_releases_tail and id(op) in system.io_done())
                    for op in system.prefetch_ops()
                )
                if storage
                else 0,
            ),
            ("backup_pending", size("backup_queue")),
            # from 0.5.18 no revoke queue: the drain of prefetch_hit_queue revokes
            ("revoke", size("prefetch_revoke_queue") if system.revoke_queue else 0),
            ("backup_acks", size("ack_backup_queue")),
            ("host_release", size("host_mem_release_queue")),
        ),
        l3_keys=system.l3_keys(),
        requests=tuple(requests),
        clock_skew_us=clock_skew_us,
    )


def prefetch_state(
    system: SnapshotSource, entries: list[tuple[int, NodeId | None, int, Any]]
) -> tuple[list[tuple[str, tuple[int, ...]]], tuple[PrefetchRecord, ...]]:
    """The host slots prefetches hold and the ``ongoing_prefetch`` records, from the cache's entries as
    ``(rid, anchor, tokens, operation)``. An operation owns all its ``host_indices`` while its entry is live;
    after ``_handle_prefetch_result`` or an abort it still owns ``[completed_tokens, ...)`` until the drain of
    its final ack frees them; the release queue holds the rest. Up to 0.5.18 (``io_releases_tail``) the I/O
    thread queues ``[completed_tokens, ...)`` for release when its transfer ends, live entry or not. Up to 0.5.15
    (``allocated_at_admission``) an operation holds all its ``host_indices`` from admission until its query, none
    once the query revoked it, and the query cuts ``host_indices`` to the hits (releasing the rest)."""
    cc = system.controller
    live = {id(op) for _rid, _anchor, _tokens, op in entries}
    ended = system.io_done() if system.io_releases_tail else set()
    held: list[tuple[str, tuple[int, ...]]] = []
    for op in sorted(system.prefetch_ops(), key=lambda o: o.id):
        if op.host_indices is None or system.revoked_at_query(op):
            continue
        slots = op.host_indices[: op.completed_tokens] if id(op) in ended else op.host_indices
        slots = slots if id(op) in live else slots[op.completed_tokens :]
        if len(slots):
            held.append((f"prefetch:{op.id - system.op_base}", tuple(int(s) for s in slots.tolist())))
    released = [int(s) for chunk in list(cc.host_mem_release_queue.queue) for s in chunk.tolist()]
    if released:
        held.append(("release_queue", tuple(released)))
    done = system.io_done()
    records = []
    for rid, anchor, tokens, op in sorted(entries, key=lambda e: e[0]):
        # SGLang keeps no stage: it is read off the operation (no host memory yet, I/O helper finished).
        stage = (
            PrefetchStage.QUERY
            if not system.past_query(op)
            else PrefetchStage.DONE
            if id(op) in done or system.revoked_at_query(op)
            else PrefetchStage.IO
        )
        records.append(
            PrefetchRecord(
                rid=rid,
                anchor=anchor,
                tokens=tokens,
                stage=stage,
                hit_pages=len(op.hash_value),
                completed_tokens=int(op.completed_tokens),
                terminated=op.is_terminated(),
            )
        )
    return held, tuple(records)
