"""``HiCacheController``: one rank's background data movement between device, host and L3.

Theory of operation
-------------------
The controller owns the queues of seed §2 and the jobs that drain them; the tree (``HiRadixCache``)
calls it on the scheduler thread and reads the acknowledgements back at its lock-step points. Every job
runs through the executor seam of ``refcache.runtime`` under its ``IOQueue`` name, so the same code runs
on worker threads in production and one explicit step at a time in tests:

==================  ==============================================  =======================================
queue               one job (step)                                  acknowledged through
==================  ==============================================  =======================================
``write``           D2H copy of a node, every layer                 ``ack_write_queue`` (``writing_check``)
``load``            H2D copy, layer by layer, one event per layer   ``ack_load_queue`` (``loading_check``)
``prefetch_query``  L3 hit query, then MIN over the prefetch group  ``prefetch_revoke_queue`` or I/O job
``prefetch_io``     one batch of ``storage_batch_size`` pages       ``PrefetchOperation.completed_tokens``
``backup``          one L2→L3 operation, batch by batch             ``ack_backup_queue``
==================  ==============================================  =======================================

Host memory that a background job gives up goes through ``host_mem_release_queue`` in one entry per page,
never straight to the allocator: the scheduler frees a MIN-reduced number of entries, so host capacity
changes only at lock-step points and stays equal on every rank (D-08).

Thread ownership: allocators and the in-flight tables belong to the scheduler thread; jobs touch only
their own operation (under its lock), the pool bytes of slots that the tree keeps pinned for them, and
append-only ends of the control queues (``deque.append`` is atomic).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.gpu.allocator import PagedTokenToKVPoolAllocator
from refcache.gpu.device_pool import KVCache
from refcache.gpu.host_pool import HostKVCache
from refcache.gpu.kv_oracle import KVOracle, Seeds
from refcache.gpu.l3_store import L3Store
from refcache.gpu.layer_done import LayerDoneCounter
from refcache.hashing import Token, page_hashes
from refcache.hicache.ops import IOQueue
from refcache.hicache.states import PrefetchEvent, PrefetchStage, next_stage
from refcache.runtime import CHECKPOINT, AllReduce, Clock, Executor, Job, ReduceOp

__all__ = ["CacheOperation", "HiCacheAck", "HiCacheController", "PrefetchOperation", "StorageOperation"]

logger = logging.getLogger(__name__)

Key = tuple[Token, ...]


@dataclass
class Check:
    """What the oracle expects of a run of slots: one seed and one node name per position (``what`` may be
    a lazy sequence that formats a name only when a failing check asks for it)."""

    seeds: Seeds  # a path's seeds are an int32 tensor (cached per node)
    what: Sequence[str]

    def cut(self, start: int, stop: int) -> Check:
        return Check(self.seeds[start:stop], self.what[start:stop])


@dataclass
class HiCacheAck:
    """One D2H or H2D copy: the node it acknowledges and whether the copy has finished."""

    node_id: int
    finish_event: threading.Event = field(default_factory=threading.Event)


@dataclass
class CacheOperation:
    """A queued H2D load (``load``), launched by ``start_loading``."""

    host_indices: torch.Tensor
    device_indices: torch.Tensor
    ack: HiCacheAck
    check: Check
    producer_index: int = -1  # LayerDoneCounter slot, set when the copy starts
    started: threading.Event = field(default_factory=threading.Event)


class PrefetchOperation:
    """An L3→L2 prefetch. ``host_indices[owned_lo:owned_hi]`` are the slots it still owns; ``lock``
    guards every field the I/O job and the scheduler both touch."""

    def __init__(
        self,
        op_id: int,
        request_id: int,
        tokens: Key,
        last_hash: str | None,
        host_indices: torch.Tensor,
        start_us: int,
        check: Check,
    ) -> None:
        self.id = op_id
        self.request_id = request_id
        self.tokens = tokens  # page-aligned prefetch key
        self.last_hash = last_hash  # hash of the page before the key (namespace seed at the root)
        self.host_indices = host_indices  # allocated at admission, cut to the hit length at resolve
        self.start_us = start_us
        self.check = check
        self.lock = threading.Lock()
        self.hash_value: list[str] = []  # set when the hit query resolves
        self.completed_tokens = 0
        self.batches_done = 0
        self.terminated = False
        self.stage = (
            PrefetchStage.QUERY
        )  # moved only by move(), along refcache.hicache.states.PREFETCH_TRANSITIONS
        self.owned_lo = 0
        self.owned_hi = len(host_indices)

    def move(self, event: PrefetchEvent) -> None:
        """Move ``stage`` along the table (the caller holds ``lock``); an illegal ``event`` raises
        ``TransitionError`` and leaves the stage unchanged."""
        self.stage = next_stage(self.stage, event)

    def increment(self, num_tokens: int) -> bool:
        """Add read tokens unless terminated (a terminated op's count is frozen)."""
        with self.lock:
            if self.terminated:
                return False
            self.completed_tokens += num_tokens
            return True

    def mark_terminate(self) -> int:
        """Stop the transfer; returns the completed tokens, which no longer change."""
        with self.lock:
            self.terminated = True
            return self.completed_tokens

    def held(self) -> torch.Tensor:
        with self.lock:
            return self.host_indices[self.owned_lo : self.owned_hi]


@dataclass
class StorageOperation:
    """An L2→L3 backup of the pages at ``host_indices``."""

    id: int
    host_indices: torch.Tensor
    hash_value: list[str]
    check: Check
    done: bool = False


class HiCacheController:
    """Queues and jobs of one rank (see the module docstring)."""

    def __init__(
        self,
        config: HiCacheConfig,
        rank: int,
        mem_pool_device: KVCache,
        device_allocator: PagedTokenToKVPoolAllocator,
        mem_pool_host: HostKVCache,
        storage: L3Store | None,
        executor: Executor,
        oracle: KVOracle,
        clock: Clock,
    ) -> None:
        self.config = config
        self.rank = rank
        self.page_size = config.page_size
        self.io_backend = config.hicache_io_backend
        self.mem_pool_device = mem_pool_device
        self.mem_pool_device_allocator = device_allocator
        self.mem_pool_host = mem_pool_host
        self.storage_backend = storage
        self.executor = executor
        self.oracle = oracle
        self.clock = clock
        self.storage_batch_size = config.storage_batch_size
        self.prefetch_threshold = config.effective_prefetch_threshold
        # backup_skip: MLA ranks hold identical latents; only rank 0 writes them (seed §5.5).
        self.backup_skip = config.attention is AttentionKind.MLA and rank != 0
        self.layer_done_counter = LayerDoneCounter(config.layer_num, mem_pool_device.device)
        mem_pool_device.register_layer_transfer_counter(self.layer_done_counter)
        self._pending_load_slots: set[int] = set()  # device slots an unfinished H2D copy will write
        self._lock = threading.Lock()  # guards _pending_load_slots and the two registries
        self.reset()

    def reset(self) -> None:
        """Forget every queue and operation (the cache only resets when idle and drained)."""
        self.ack_write_queue: deque[HiCacheAck] = deque()
        self.load_queue: list[CacheOperation] = []  # queued by load(), launched by start_loading()
        self.ack_load_queue: deque[HiCacheAck] = deque()
        self.prefetch_revoke_queue: deque[tuple[int, int]] = deque()  # (request id, op id) of failed queries
        self.ack_backup_queue: deque[int] = deque()  # finished StorageOperation ids
        self.host_mem_release_queue: deque[torch.Tensor] = deque()  # one page of host slots per entry
        self.prefetch_ops: dict[int, PrefetchOperation] = {}  # every op that may still own host slots
        self.backup_ops: dict[int, StorageOperation] = {}  # backups not finished yet
        self.next_op_id = 0  # prefetch and backup operations share one id counter
        with self._lock:
            self._pending_load_slots = set()
        self.executor.discard(self.rank)
        self.layer_done_counter.reset()

    def _submit(self, queue: IOQueue, job: Job) -> None:
        self.executor.submit(queue.value, self.rank, job)

    def _new_op_id(self) -> int:
        op_id = self.next_op_id
        self.next_op_id += 1
        return op_id

    # --- L1 -> L2 ------------------------------------------------------------------------------------------

    def write(self, device_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Allocate host slots and start the D2H copy; None (nothing changed) if host memory is short."""
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        ack = HiCacheAck(node_id)
        self.ack_write_queue.append(ack)
        self._submit(IOQueue.WRITE, self._write_job(host_indices, device_indices.clone(), ack))
        return host_indices

    def _write_job(self, host_indices: torch.Tensor, device_indices: torch.Tensor, ack: HiCacheAck) -> Job:
        yield from ()
        self.mem_pool_host.backup_from_device_all_layer(
            self.mem_pool_device, host_indices, device_indices, self.io_backend
        )
        ack.finish_event.set()

    def ready_write_acks(self) -> int:
        return _ready_prefix(self.ack_write_queue)

    def pop_write_acks(self, count: int) -> list[int]:
        return [self.ack_write_queue.popleft().node_id for _ in range(count)]

    def flush_writes(self) -> None:
        """Block until every D2H copy of this rank has finished (write-back eviction)."""
        self.executor.wait_all(IOQueue.WRITE.value, self.rank)

    # --- L2 -> L1 ------------------------------------------------------------------------------------------

    def load(self, host_indices: torch.Tensor, node_id: int, check: Check) -> torch.Tensor | None:
        """Allocate device slots and queue the H2D copy (launched by ``start_loading``); None if the
        device pool is short."""
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        device_indices = device_indices.cpu()  # the tree keeps slot numbers on the host; copies move them
        op = CacheOperation(host_indices.clone(), device_indices, HiCacheAck(node_id), check)
        self.load_queue.append(op)
        return device_indices

    def start_loading(self) -> list[CacheOperation]:
        """Launch every queued load (one job and one ack each); returns them."""
        launched, self.load_queue = self.load_queue, []
        for op in launched:
            with self._lock:
                self._pending_load_slots.update(op.device_indices.tolist())
            self.ack_load_queue.append(op.ack)
            self._submit(IOQueue.LOAD, self._load_job(op))
        return launched

    def _load_job(self, op: CacheOperation) -> Job:
        yield from ()
        counter = self.layer_done_counter
        op.producer_index = counter.update_producer()
        op.started.set()
        events = counter.events[op.producer_index]
        inline = self.executor.inline
        for layer in range(self.mem_pool_device.layer_num):
            copy = functools.partial(
                self.mem_pool_host.load_to_device_per_layer,
                self.mem_pool_device,
                op.host_indices,
                op.device_indices,
                layer,
                self.io_backend,
            )
            if inline:
                events.complete(layer, issued=copy)  # runs when the reader waits for this layer
            else:
                copy()
                events.complete(layer)
        if inline:
            # The forward pass of the batch reads layer i once its event fired (seed §2.3); inline, that
            # reader is this step, and each layer's copy runs only when the reader's wait asks for it.
            # Threaded, the scheduler reads (``read_loaded``).
            try:
                self._forward_reads(op)
            finally:
                events.drain()
        with self._lock:
            self._pending_load_slots.difference_update(op.device_indices.tolist())
        op.ack.finish_event.set()

    def read_loaded(self, op: CacheOperation) -> None:
        """The forward pass of a threaded run: read each loaded layer as soon as its event fires."""
        op.started.wait()
        self._forward_reads(op)

    def _forward_reads(self, op: CacheOperation) -> None:
        """Check every loaded layer against the oracle through the pool's accessors, which wait for that
        layer's event of ``op``'s slot."""
        counter = self.layer_done_counter
        counter.set_consumer(op.producer_index)
        try:
            self.oracle.check_device_layers(
                self.mem_pool_device, op.device_indices, op.check.seeds, op.check.what
            )
        finally:
            counter.set_consumer(-1)

    def pending_load_slots(self) -> set[int]:
        with self._lock:
            return set(self._pending_load_slots)

    def ready_load_acks(self) -> int:
        return _ready_prefix(self.ack_load_queue)

    def pop_load_acks(self, count: int) -> list[int]:
        return [self.ack_load_queue.popleft().node_id for _ in range(count)]

    # --- L3 -> L2 ------------------------------------------------------------------------------------------

    def prefetch(
        self, request_id: int, tokens: Key, last_hash: str | None, host_indices: torch.Tensor, check: Check
    ) -> PrefetchOperation:
        """Queue a prefetch into the already allocated ``host_indices`` (classic SGLang allocates first)."""
        op = PrefetchOperation(
            self._new_op_id(), request_id, tokens, last_hash, host_indices, self.clock.now_us(), check
        )
        self._prune_prefetch_ops()
        self.prefetch_ops[op.id] = op
        self._submit(IOQueue.PREFETCH_QUERY, self._prefetch_query_job(op))
        return op

    def _storage_hit_query(self, op: PrefetchOperation) -> tuple[list[str], int]:
        """Leading L3 hits of the op's pages, per storage batch; a short batch ends the query."""
        assert self.storage_backend is not None
        hashes = page_hashes(op.tokens, self.page_size, op.last_hash)
        found: list[str] = []
        for start in range(0, len(hashes), self.storage_batch_size):
            batch = hashes[start : start + self.storage_batch_size]
            try:
                hits = self.storage_backend.batch_exists(batch)
            except Exception:  # a failing backend is a miss, never a crash (and L3 stays enabled)
                logger.exception("L3 hit query failed")
                hits = 0
            found.extend(batch[:hits])
            if hits < len(batch):
                break
        return found, len(found) * self.page_size

    def _prefetch_query_job(self, op: PrefetchOperation) -> Job:
        """The prefetch thread: query, MIN over the prefetch group, then revoke or start reading."""
        hashes, local_hits = self._storage_hit_query(op)
        reduced = yield AllReduce(ReduceOp.MIN, (local_hits,), channel="prefetch")
        assert reduced is not None
        storage_hit_count = reduced[0]
        if storage_hit_count < self.prefetch_threshold:
            self.release_tail(op, 0)
            with op.lock:
                op.move(PrefetchEvent.QUERY_MISS)
            self.prefetch_revoke_queue.append((op.request_id, op.id))
            return
        with op.lock:
            op.hash_value = hashes[: storage_hit_count // self.page_size]
        self.release_tail(op, storage_hit_count)
        with op.lock:
            op.move(PrefetchEvent.QUERY_HIT)
        self._submit(IOQueue.PREFETCH_IO, self._page_transfer_job(op))

    def _page_transfer_job(self, op: PrefetchOperation) -> Job:
        """The prefetch I/O helper: one storage batch per step until done, short or terminated."""
        ps, size = self.page_size, self.storage_batch_size
        while True:
            start = op.batches_done * size
            batch = op.hash_value[start : start + size]
            if not op.terminated and batch:
                slots = op.host_indices[start * ps : (start + len(batch)) * ps]
                hits = self._read_batch(op, batch, slots, start * ps)
                op.increment(hits * ps)
                op.batches_done += 1
                if hits < len(batch):
                    op.mark_terminate()  # a short batch ends the transfer
            if op.terminated or op.batches_done * size >= len(op.hash_value):
                with op.lock:
                    self._release_tail_locked(op, op.completed_tokens)
                    op.move(PrefetchEvent.IO_END)
                return
            yield CHECKPOINT

    def _read_batch(
        self, op: PrefetchOperation, batch: Sequence[str], slots: torch.Tensor, offset: int
    ) -> int:
        """Read one batch into host memory; the number of leading pages that arrived intact."""
        assert self.storage_backend is not None
        found: list[bytes] = []
        try:
            results = self.storage_backend.batch_get_v1(batch, slots, found)
        except Exception:  # the operation ends short; host memory goes back through the release queue
            logger.exception("L3 read failed")
            return 0
        hits = 0
        for ok in results:
            if not ok:
                break
            hits += 1
        got = slots[: hits * self.page_size]
        self.oracle.check_identity(
            found[:hits],
            [self.storage_backend.identity(h) for h in batch[:hits]],
            op.check.what[offset : offset + len(got) : self.page_size],
        )
        self.oracle.check_host(
            self.mem_pool_host, got, op.check.seeds[offset : offset + len(got)], op.check.what[offset:]
        )
        return hits

    def release_tail(self, op: PrefetchOperation, cut: int) -> None:
        """Give the slots the op owns from position ``cut`` on back, through the release queue."""
        with op.lock:
            self._release_tail_locked(op, cut)

    def _release_tail_locked(self, op: PrefetchOperation, cut: int) -> None:
        cut = max(cut, op.owned_lo)
        if cut < op.owned_hi:
            self.append_host_mem_release(op.host_indices[cut : op.owned_hi])
            op.owned_hi = cut

    def take(self, op: PrefetchOperation, upto: int) -> torch.Tensor:
        """The scheduler takes the owned slots before position ``upto`` (into the tree, the allocator or
        the release queue); a transfer still running keeps the rest and releases it when it ends."""
        with op.lock:
            upto = min(max(upto, op.owned_lo), op.owned_hi)
            taken = op.host_indices[op.owned_lo : upto]
            op.owned_lo = upto
            return taken

    def terminate_prefetch(self, op: PrefetchOperation) -> int:
        return op.mark_terminate()

    # --- L2 -> L3 ------------------------------------------------------------------------------------------

    def write_storage(self, host_indices: torch.Tensor, hash_value: list[str], check: Check) -> int:
        """Queue the L3 write of pages ``host_indices`` under ``hash_value``; returns the operation id."""
        op = StorageOperation(self._new_op_id(), host_indices.clone(), list(hash_value), check)
        with self._lock:
            self.backup_ops[op.id] = op
        self._submit(IOQueue.BACKUP, self._backup_job(op))
        return op.id

    def pending_backup_reads(self) -> dict[int, tuple[int, ...]]:
        """The host slots each backup not yet run will read, by operation id (the snapshot's
        ``backup_host_indices``); a finished one reads nothing more."""
        with self._lock:
            return {op_id: tuple(op.host_indices.tolist()) for op_id, op in self.backup_ops.items()}

    def _backup_job(self, op: StorageOperation) -> Job:
        yield from ()
        if not self.backup_skip:
            assert self.storage_backend is not None
            self.oracle.check_host(self.mem_pool_host, op.host_indices, op.check.seeds, op.check.what)
            ps, size = self.page_size, self.storage_batch_size
            for start in range(0, len(op.hash_value), size):
                batch = op.hash_value[start : start + size]
                try:
                    ok = all(
                        self.storage_backend.batch_set_v1(
                            batch, op.host_indices[start * ps : (start + len(batch)) * ps]
                        )
                    )
                except Exception:  # the operation ends; earlier batches stay written
                    logger.exception("L3 write failed")
                    ok = False
                if not ok:
                    break
        op.done = True
        with self._lock:
            del self.backup_ops[op.id]
        self.ack_backup_queue.append(op.id)

    # --- control queues ------------------------------------------------------------------------------------

    def append_host_mem_release(self, host_indices: torch.Tensor) -> None:
        """Queue slots for the scheduler to free, one page per entry (D-08)."""
        for start in range(0, len(host_indices), self.page_size):
            self.host_mem_release_queue.append(host_indices[start : start + self.page_size])

    def control_queue_sizes(self) -> tuple[int, int, int]:
        return len(self.prefetch_revoke_queue), len(self.ack_backup_queue), len(self.host_mem_release_queue)

    # --- what the snapshot reads ---------------------------------------------------------------------------

    def queue_lengths(self) -> tuple[tuple[str, int], ...]:
        writes_done = sum(1 for a in self.ack_write_queue if a.finish_event.is_set())
        loads_done = sum(1 for a in self.ack_load_queue if a.finish_event.is_set())
        stages = [op.stage for op in list(self.prefetch_ops.values())]
        return (
            ("write_pending", len(self.ack_write_queue) - writes_done),
            ("write_acks", writes_done),
            ("load_pending", len(self.ack_load_queue) - loads_done + len(self.load_queue)),
            ("load_acks", loads_done),
            ("prefetch_query", stages.count(PrefetchStage.QUERY)),
            ("prefetch_io", stages.count(PrefetchStage.IO)),
            ("backup_pending", len(self.backup_ops)),
            ("revoke", len(self.prefetch_revoke_queue)),
            ("backup_acks", len(self.ack_backup_queue)),
            ("host_release", len(self.host_mem_release_queue)),
        )

    def held_host(self) -> list[tuple[str, tuple[int, ...]]]:
        """Host slots outside the tree: each prefetch operation's, then the release queue's."""
        self._prune_prefetch_ops()
        out: list[tuple[str, tuple[int, ...]]] = []
        for op_id in sorted(self.prefetch_ops):
            held = self.prefetch_ops[op_id].held()
            if len(held):
                out.append((f"prefetch:{op_id}", tuple(held.tolist())))
        releases = list(self.host_mem_release_queue)
        if releases:
            out.append(("release_queue", tuple(s for page in releases for s in page.tolist())))
        return out

    def _prune_prefetch_ops(self) -> None:
        """Forget operations that are finished and own no host slots."""
        for op_id in [
            i for i, op in self.prefetch_ops.items() if op.stage is PrefetchStage.DONE and not len(op.held())
        ]:
            del self.prefetch_ops[op_id]

    def busy(self) -> bool:
        return bool(
            self.ack_write_queue
            or self.load_queue
            or self.ack_load_queue
            or any(op.stage is not PrefetchStage.DONE or len(op.held()) for op in self.prefetch_ops.values())
            or self.backup_ops
            or self.prefetch_revoke_queue
            or self.ack_backup_queue
            or self.host_mem_release_queue
        )


def _ready_prefix(acks: deque[HiCacheAck]) -> int:
    n = 0
    for ack in acks:
        if not ack.finish_event.is_set():
            break
        n += 1
    return n
