"""``HiCacheController`` of one rank: the queues of seed §2, their in-flight records, and the I/O jobs.

Theory of operation
-------------------
This is ``refcache/gpu/cache_controller.py`` minus the bytes and the threads. The tree (``RankCache``)
calls it on the scheduler thread — ``write``, ``load``, ``prefetch``, ``write_storage``,
``terminate_prefetch``, ``take`` — and reads the acknowledgements back at its lock-step points
(``pop_write_acks``, ``pop_load_acks``, ``pop_revokes``, ``pop_backup_acks``, ``pop_host_mem_releases``).
The background jobs run only when ``HiCacheModel`` applies a ``CompleteIO`` step, one job per step:

==================  ==============================================  =======================================
queue               one job (``run_*``)                             acknowledged through
==================  ==============================================  =======================================
``write``           D2H copy of a node                              ``ack_write_queue`` (``writing_check``)
``load``            H2D copy of a chain of nodes                    ``ack_load_queue`` (``loading_check``)
``prefetch_query``  L3 hit query, then park for the MIN all-reduce  ``prefetch_revoke_queue`` or I/O job
``prefetch_io``     one batch of ``storage_batch_size`` pages       ``PrefetchOperation.completed_tokens``
``backup``          one L2→L3 operation, batch by batch             ``ack_backup_queue``
==================  ==============================================  =======================================

Host memory that a job gives up goes through ``host_mem_release_queue`` in one entry per page, never
straight to the allocator: the tree frees a MIN-reduced number of entries, so host capacity changes only
at lock-step points and stays equal on every rank (D-08).

The controller shares the rank's two allocators (``write`` allocates host slots, ``load`` device slots,
as in SGLang) and the L3 store of all ranks; it never touches the tree. Unlike the implementation, the
model launches a load as soon as it is queued: there is no separate ``load_queue`` / ``start_loading``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final, Protocol

from refcache.config import AttentionKind, HiCacheConfig
from refcache.hashing import Token, page_hashes, storage_key
from refcache.hicache.states import PrefetchEvent, PrefetchStage, next_stage
from refcache.model._pools import DeviceAllocator, HostAllocator

__all__ = [
    "HiCacheAck",
    "HiCacheController",
    "L3Store",
    "ParkedQuery",
    "PrefetchOperation",
    "StorageOperation",
]

Key = tuple[Token, ...]


class L3Store:
    """The L3 object store shared by all ranks: key → readable (True) or corrupt (False)."""

    def __init__(self) -> None:
        self.objects: dict[str, bool] = {}  # only add, corrupt and discard change this
        self._views: dict[str, tuple[str, ...]] = {}  # sorted keys per suffix, until the key set changes

    def add(self, key: str) -> None:
        self.objects[key] = True
        self._views.clear()

    def corrupt(self, key: str) -> None:
        """Make an existing object unreadable (the key set, and so every view, stays)."""
        self.objects[key] = False

    def discard(self, key: str) -> None:
        if self.objects.pop(key, None) is not None:
            self._views.clear()

    def view(self, suffix: str) -> tuple[str, ...]:
        """The sorted keys a rank with this key suffix sees (page hashes are 64 hex digits)."""
        if suffix not in self._views:
            self._views[suffix] = tuple(
                sorted(k for k in self.objects if k.endswith(suffix) and len(k) == 64 + len(suffix))
            )
        return self._views[suffix]


@dataclass(slots=True)
class HiCacheAck:
    """One D2H (``write``) or H2D (``load``) copy in ``ack_write_queue`` / ``ack_load_queue``."""

    node_id: int  # the ack id: the node the tree keys its ongoing_write_through / ongoing_load_back entry by
    done: bool = False  # the copy has finished; only run_write, run_load and flush_writes set this
    merged: list[int] = field(default_factory=list)  # more ack ids in this one copy (D-38, merge_write_acks)


@dataclass(slots=True)
class PrefetchOperation:
    """An L3→L2 prefetch (SGLang ``PrefetchOperation``). The slots it still owns are ``host_indices``,
    the tokens ``[owned_from, owned_from + len(host_indices))`` of ``tokens``."""

    id: int  # from next_op_id, shared with StorageOperation
    request_id: int
    tokens: Key  # page-aligned prefetch key
    last_hash: str | None  # hash of the page before the key (namespace seed at the root)
    host_indices: list[int]  # allocated at admission; only the controller's jobs and take cut it
    start_us: int  # logical clock at creation (timeout policy)
    hash_value: list[str] = field(default_factory=list)  # set when the hit query resolves
    completed_tokens: int = 0  # only run_prefetch_io adds to this
    batches_done: int = 0  # only run_prefetch_io counts this
    terminated: bool = False  # only run_prefetch_io (short batch) and terminate_prefetch set this
    # Moved only by ``move`` (refcache.hicache.states.PREFETCH_TRANSITIONS): by the controller's query resolution and
    # I/O helper, and under D-01 by the prefetch pipeline's drain when it allocates (``_prefetch.py``).
    stage: PrefetchStage = PrefetchStage.QUERY
    owned_from: int = 0  # token offset of host_indices[0]; only take moves it
    # D-01 (allocate_prefetch_after_query, 0.5.20's pipeline) only:
    allocated: bool = True  # host_indices hold the operation's memory (False until the drain allocates)
    storage_hit_count: int = 0  # tokens the hit query found (MIN over ranks), cut by the drain's allocation
    io_completed: int = 0  # tokens the I/O helper has read (acked per batch; completed_tokens is drained)
    io_success: bool = True  # no batch came back short and no termination was seen between batches
    io_parked: bool = False  # the I/O helper waits to read batch ``batches_done`` (a PREFETCH_IO step)

    def move(self, event: PrefetchEvent) -> None:
        """Move ``stage`` along the table; an illegal ``event`` raises ``TransitionError``, stage unchanged."""
        self.stage = next_stage(self.stage, event)


@dataclass(slots=True, frozen=True)
class ParkedQuery:
    """A prefetch whose hit query has returned and that waits in the MIN all-reduce of its group."""

    op: PrefetchOperation
    hash_value: list[str]  # the leading page hashes this rank found in L3
    local_hits: int  # tokens found on this rank: the value contributed to the MIN


@dataclass(slots=True)
class StorageOperation:
    """An L2→L3 backup of a node's pages (SGLang ``StorageOperation``), in ``backup_queue`` until run."""

    id: int  # from next_op_id, shared with PrefetchOperation; the tree keys ongoing_backup by it
    hash_value: list[str]  # page hashes to store, in page order
    host_indices: list[
        int
    ]  # the host slots it reads, in page order (the fragments' host copies, as enqueued)
    done: bool = False  # only run_backup sets this


class PrefetchIO(Protocol):
    """How the prefetch thread and I/O helper follow a hit query: the controller's half of the prefetch
    pipeline a configuration chooses (the rank's half is ``refcache.model._prefetch.PrefetchPipeline``)."""

    def skips_query(self, op: PrefetchOperation) -> bool:
        """Whether the prefetch thread skips the hit query of ``op`` (answering 0 hits)."""
        ...

    def resolve(
        self, ctrl: HiCacheController, op: PrefetchOperation, hashes: list[str], storage_hit_count: int
    ) -> None:
        """What follows the all-reduce of ``op``'s hits."""
        ...

    def run_io(self, ctrl: HiCacheController) -> bool:
        """One step of the I/O helper (``PREFETCH_IO``); False when it had nothing to read."""
        ...

    def io_pending(self, ctrl: HiCacheController) -> int:
        """The ``prefetch_io`` queue length the snapshot shows."""
        ...


class ReadReserved:
    """refcache's pipeline: host slots were reserved at admission; the query keeps the hit pages' slots and
    the I/O helper reads into them, one batch a step."""

    def skips_query(self, op: PrefetchOperation) -> bool:
        return False

    def resolve(
        self, ctrl: HiCacheController, op: PrefetchOperation, hashes: list[str], storage_hit_count: int
    ) -> None:
        ctrl.resolve_reserved(op, hashes, storage_hit_count)

    def run_io(self, ctrl: HiCacheController) -> bool:
        return ctrl.read_reserved()

    def io_pending(self, ctrl: HiCacheController) -> int:
        return len(ctrl.prefetch_buffer)


class ReadAfterDrain:
    """SGLang 0.5.20's pipeline (D-01, ``allocate_prefetch_after_query``): the query only records its hits;
    the scheduler's drain revokes or allocates, and the I/O helper acks every batch (reading it, or not
    when the operation ended or came back short)."""

    def skips_query(self, op: PrefetchOperation) -> bool:
        return op.terminated  # 0.5.20 skips the query of an operation terminated while queued

    def resolve(
        self, ctrl: HiCacheController, op: PrefetchOperation, hashes: list[str], storage_hit_count: int
    ) -> None:
        # Record the hits; the scheduler's drain decides (revoke, or allocate and read).
        op.hash_value = hashes[: storage_hit_count // ctrl.page_size]
        op.storage_hit_count = storage_hit_count
        ctrl.prefetch_hit_queue.append(op)

    def run_io(self, ctrl: HiCacheController) -> bool:
        return ctrl.read_after_drain()

    def io_pending(self, ctrl: HiCacheController) -> int:
        # allocated operations until the drain of their final ack (buffered, reading, acked)
        return sum(op.allocated for op in ctrl.pending_prefetch_ops)


class ReadAfterDrainUnacked(ReadAfterDrain):
    """SGLang up to 0.5.18's pipeline (D-01 with D-54, ``prefetch_progress_in_operation``): the query and the
    drain's allocation as 0.5.20's, but no prefetch acks: the I/O helper adds what it read to the operation's
    ``completed_tokens`` itself and, when the transfer ends, queues the unread tail for release, as refcache's
    own helper does (``read_reserved``)."""

    def run_io(self, ctrl: HiCacheController) -> bool:
        return ctrl.read_reserved()

    def io_pending(self, ctrl: HiCacheController) -> int:
        return len(ctrl.prefetch_buffer)


class RevokeAtQuery(ReadAfterDrainUnacked):
    """SGLang 0.5.16 and 0.5.17's pipeline (D-01 with D-54 and D-58, ``revoke_at_query``): as 0.5.18's, but the
    prefetch thread itself revokes a query whose hits fall below ``max(prefetch_threshold, page_size)``, through
    ``prefetch_revoke_queue`` (the request and operation ids), which the scheduler's drain empties before it
    allocates for the hit queue. The operation stays in its query stage until then (nothing was allocated)."""

    def resolve(
        self, ctrl: HiCacheController, op: PrefetchOperation, hashes: list[str], storage_hit_count: int
    ) -> None:
        if storage_hit_count < ctrl.prefetch_threshold:
            ctrl.prefetch_revoke_queue.append((op.request_id, op.id))
            return
        super().resolve(ctrl, op, hashes, storage_hit_count)


READ_RESERVED: Final = ReadReserved()
READ_AFTER_DRAIN: Final = ReadAfterDrain()
READ_AFTER_DRAIN_UNACKED: Final = ReadAfterDrainUnacked()
REVOKE_AT_QUERY: Final = RevokeAtQuery()


class HiCacheController:
    """Queues, in-flight records and jobs of one rank (see the module docstring)."""

    def __init__(
        self,
        config: HiCacheConfig,
        rank: int,
        device_allocator: DeviceAllocator,
        host_allocator: HostAllocator,
        storage: L3Store,
    ) -> None:
        self.config = config
        self.rank = rank
        self.page_size = config.page_size
        self.storage_batch_size = config.storage_batch_size
        self.prefetch_threshold = config.effective_prefetch_threshold
        self.mem_pool_device_allocator = device_allocator  # the rank's; cleared, never replaced, by reset
        self.mem_pool_host = host_allocator  # the rank's
        self.storage_backend = storage
        self.mla = config.attention is AttentionKind.MLA
        # backup_skip: MLA ranks hold identical latents; only rank 0 writes them (seed §5.5).
        self.backup_skip = self.mla and rank != 0
        # The part of every L3 key that names this rank's view (seed §5.5), computed once.
        self.l3_suffix = storage_key(
            "", model_name=config.model_name, mla=self.mla, tp_rank=rank, tp_size=config.tp_size
        )
        # Injected storage faults, consumed by the next batch; they survive a reset. Only arm_write_fault /
        # arm_read_fault set them, only run_backup / run_prefetch_io clear them.
        self.fail_next_write = False
        self.fail_next_read = False
        # Faults that last until a write fails: pages the disk still has room for (None: unlimited), and
        # whether renames that publish new objects fail. Only arm_* set them, only run_backup clears them.
        self.disk_room: int | None = None
        self.fail_publish = False
        self.clock_us = 0  # this rank's logical clock (D-41); only set_clock changes it
        # D-63 (SGLang up to 0.5.18): the I/O helper reads the batch of an operation terminated before it
        self.read_when_terminated = config.terminated_prefetch_reads_batch
        # How prefetch reads follow the hit query (chosen once, by the configuration's D-01 option).
        self.prefetch_io: PrefetchIO = (
            READ_RESERVED
            if not config.allocate_prefetch_after_query
            else READ_AFTER_DRAIN
            if not config.prefetch_progress_in_operation
            else REVOKE_AT_QUERY
            if config.revoke_at_query
            else READ_AFTER_DRAIN_UNACKED
        )
        self.reset()

    def reset(self) -> None:
        """Forget every queue and operation (the rank resets only when idle and drained)."""
        self.ack_write_queue: deque[HiCacheAck] = deque()  # D2H copies in stream order
        self.batch_write_ack: HiCacheAck | None = None  # the step's copy more backups join (D-38)
        self.ack_load_queue: deque[HiCacheAck] = deque()  # H2D copies in stream order
        self.prefetch_queue: deque[PrefetchOperation] = deque()  # awaiting the hit query
        self.prefetch_parked: ParkedQuery | None = None  # query done, in the all-reduce
        self.prefetch_buffer: deque[PrefetchOperation] = deque()  # awaiting page reads
        self.backup_queue: deque[StorageOperation] = deque()  # awaiting the backup thread
        self.prefetch_revoke_queue: deque[tuple[int, int]] = deque()  # (request id, op id) of failed queries
        self.ack_backup_queue: deque[int] = deque()  # finished StorageOperation ids
        self.host_mem_release_queue: deque[list[int]] = deque()  # one page of host slots per entry
        self.orphan_prefetch_ops: dict[int, PrefetchOperation] = {}  # ops the tree let go, still running
        # D-01 (0.5.20's pipeline) only: queried operations awaiting the drain, the I/O helper's acks
        # (operation, completed tokens or None, final), and operations that may still hold host memory.
        self.prefetch_hit_queue: deque[PrefetchOperation] = deque()
        self.ack_prefetch_queue: deque[tuple[PrefetchOperation, int | None, bool]] = deque()
        self.pending_prefetch_ops: list[PrefetchOperation] = []
        self.next_op_id = 0  # prefetch and backup operations share one id counter

    def _new_op_id(self) -> int:
        op_id = self.next_op_id
        self.next_op_id += 1
        return op_id

    # --- clock and faults (HiCacheModel's AdvanceClock and StorageFault) ---------------------------------

    def set_clock(self, now_us: int) -> None:
        self.clock_us = now_us

    def arm_write_fault(self) -> None:
        """This rank's next L3 write batch fails."""
        self.fail_next_write = True

    def arm_read_fault(self) -> None:
        """This rank's next L3 read batch fails."""
        self.fail_next_read = True

    def arm_disk_full(self, room: int) -> None:
        """The disk has room for ``room`` more pages; the write after them is cut short (ENOSPC), and so
        is every later one of its batch. Lasts until a write fails."""
        self.disk_room = room

    def arm_publish_fault(self) -> None:
        """Renames that publish new objects fail until a write batch has failed on one."""
        self.fail_publish = True

    def misplace_l3_object(self, index: int) -> None:
        """The ``index``-th object (modulo their number less one) of this rank's view is overwritten by a
        copy of the next one: it now holds another key's object, which a read rejects. Copies go from a
        later key to an earlier one only, so no fault ever puts an object back under its own key."""
        view = self.storage_backend.view(self.l3_suffix)
        if len(view) >= 2:
            self.storage_backend.corrupt(view[index % (len(view) - 1)])

    def damage_l3_object(self, index: int, *, delete: bool) -> None:
        """Corrupt (or delete) the ``index``-th object, modulo their number, of this rank's L3 view."""
        view = self.storage_backend.view(self.l3_suffix)
        if not view:
            return
        key = view[index % len(view)]
        if delete:
            self.storage_backend.discard(key)
        else:
            self.storage_backend.corrupt(key)

    def l3_keys(self) -> tuple[str, ...]:
        """The keys of this rank's L3 view, sorted."""
        return self.storage_backend.view(self.l3_suffix)

    def _l3_key(self, page_hash: str) -> str:
        return storage_key(
            page_hash,
            model_name=self.config.model_name,
            mla=self.mla,
            tp_rank=self.rank,
            tp_size=self.config.tp_size,
        )

    # --- L1 -> L2 -----------------------------------------------------------------------------------------

    def write(self, device_indices: list[int], node_id: int) -> list[int] | None:
        """Allocate host slots and queue the D2H copy; None (nothing changed) if host memory is short."""
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        batch = self.batch_write_ack
        if (
            batch is not None
            and not batch.done
            and self.ack_write_queue
            and self.ack_write_queue[-1] is batch
        ):
            batch.merged.append(node_id)  # D-38: one copy and one ack for the batch's backups (0.5.23)
        else:
            ack = HiCacheAck(node_id)
            self.ack_write_queue.append(ack)
            if self.config.merge_write_acks:
                self.batch_write_ack = ack
        return host_indices

    def end_batch(self) -> None:
        """The scheduler step is over: later backups start another copy (``merge_write_acks``, D-38)."""
        self.batch_write_ack = None

    def run_write(self) -> bool:
        """The write stream: finish the oldest unfinished D2H copy; False if there is none."""
        ack = next((a for a in self.ack_write_queue if not a.done), None)
        if ack is None:
            return False
        ack.done = True
        return True

    def ready_write_acks(self) -> int:
        """Local half of ``writing_check``: the finished prefix of the write stream."""
        return _ready_prefix(self.ack_write_queue)

    def pop_write_acks(self, count: int) -> list[int]:
        """The ack ids of the oldest ``count`` write acks (each one's merged ids after it)."""
        out: list[int] = []
        for _ in range(count):
            ack = self.ack_write_queue.popleft()
            out.append(ack.node_id)
            out.extend(ack.merged)
        return out

    def flush_writes(self) -> None:
        """Finish every D2H copy of this rank (the blocking ``writing_check`` of write-back eviction)."""
        for ack in self.ack_write_queue:
            ack.done = True

    # --- L2 -> L1 -----------------------------------------------------------------------------------------

    def load(self, host_indices: list[int], node_id: int) -> list[int] | None:
        """Allocate device slots and queue the H2D copy; None (nothing changed) if the device pool is short."""
        device_indices = self.mem_pool_device_allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.ack_load_queue.append(HiCacheAck(node_id))
        return device_indices

    def run_load(self) -> bool:
        """The load stream: finish the oldest unfinished H2D copy; False if there is none."""
        ack = next((a for a in self.ack_load_queue if not a.done), None)
        if ack is None:
            return False
        ack.done = True
        return True

    def ready_load_acks(self) -> int:
        return _ready_prefix(self.ack_load_queue)

    def pop_load_acks(self, count: int) -> list[int]:
        return [self.ack_load_queue.popleft().node_id for _ in range(count)]

    def ready_load_ids(self) -> list[int]:
        """The ack ids of the finished prefix of the load stream, oldest first."""
        return [ack.node_id for ack in list(self.ack_load_queue)[: self.ready_load_acks()]]

    def next_load_ack(self) -> int | None:
        """The ack id of the oldest load not yet retired (None: none in flight)."""
        return self.ack_load_queue[0].node_id if self.ack_load_queue else None

    # --- L3 -> L2 -----------------------------------------------------------------------------------------

    def prefetch(
        self, request_id: int, tokens: Key, last_hash: str | None, host_indices: list[int]
    ) -> PrefetchOperation:
        """Queue a prefetch into the already allocated ``host_indices`` (classic SGLang allocates first)."""
        op = PrefetchOperation(
            self._new_op_id(), request_id, tokens, last_hash, host_indices, start_us=self.clock_us
        )
        self.prefetch_queue.append(op)
        return op

    def prefetch_unallocated(self, request_id: int, tokens: Key, last_hash: str | None) -> PrefetchOperation:
        """D-01 (0.5.20): queue a prefetch with no host memory; the drain of its hit query allocates."""
        op = PrefetchOperation(
            self._new_op_id(), request_id, tokens, last_hash, [], start_us=self.clock_us, allocated=False
        )
        self.prefetch_queue.append(op)
        if self.prefetch_io is READ_AFTER_DRAIN:  # D-54: without acks the tree's take tracks what it holds
            self.pending_prefetch_ops.append(op)
        return op

    def _storage_hit_query(self, op: PrefetchOperation) -> tuple[list[str], int]:
        """Leading L3 hits of ``op``'s pages, queried in batches of ``storage_batch_size`` pages."""
        hashes = page_hashes(op.tokens, self.page_size, op.last_hash)
        found: list[str] = []
        objects = self.storage_backend.objects
        for start in range(0, len(hashes), self.storage_batch_size):
            batch = hashes[start : start + self.storage_batch_size]
            hits = 0
            for page_hash in batch:  # batch_exists: number of leading keys present
                if self._l3_key(page_hash) not in objects:
                    break
                hits += 1
            found.extend(batch[:hits])
            if hits < len(batch):
                break
        return found, len(found) * self.page_size

    def run_prefetch_query(self) -> bool:
        """Prefetch thread: query the oldest operation, then block in the MIN all-reduce (parked)."""
        if self.prefetch_parked is not None or not self.prefetch_queue:
            return False
        op = self.prefetch_queue.popleft()
        hashes: list[str]
        if self.prefetch_io.skips_query(op):
            hashes, hits = [], 0
        else:
            hashes, hits = self._storage_hit_query(op)
        self.prefetch_parked = ParkedQuery(op, hashes, hits)
        return True

    def parked_hits(self) -> int | None:
        """This rank's contribution to the prefetch all-reduce, or None if no query is parked."""
        return None if self.prefetch_parked is None else self.prefetch_parked.local_hits

    def resolve_prefetch_query(self, storage_hit_count: int) -> None:
        """The all-reduce returned ``storage_hit_count`` (MIN over ranks): revoke or start reading."""
        assert self.prefetch_parked is not None
        op, hashes = self.prefetch_parked.op, self.prefetch_parked.hash_value
        self.prefetch_parked = None
        self.prefetch_io.resolve(self, op, hashes, storage_hit_count)

    def resolve_reserved(self, op: PrefetchOperation, hashes: list[str], storage_hit_count: int) -> None:
        """``ReadReserved``'s resolution: revoke below the threshold, else keep the slots of the hit pages
        (the rest go back to the pool) and queue the operation for reading."""
        if storage_hit_count < self.prefetch_threshold:
            self.prefetch_revoke_queue.append((op.request_id, op.id))
            self.append_host_mem_release(op.host_indices)
            op.host_indices = []
            op.move(PrefetchEvent.QUERY_MISS)
            self.orphan_prefetch_ops.pop(op.id, None)
            return
        op.hash_value = hashes[: storage_hit_count // self.page_size]
        self.append_host_mem_release(op.host_indices[storage_hit_count:])
        op.host_indices = op.host_indices[:storage_hit_count]
        op.move(PrefetchEvent.QUERY_HIT)
        self.prefetch_buffer.append(op)

    # --- D-01: 0.5.20's I/O helper (one read per PREFETCH_IO step; what needs no read runs at once) ---

    def advance_prefetch_io(self) -> None:
        """Run the I/O helper until it waits for a read (or the buffer is empty): batches of a terminated or
        short operation are acked without reading, and the end of an operation is its final ack."""
        while self.prefetch_buffer:
            op = self.prefetch_buffer[0]
            if op.io_parked:
                return
            batches = -(-len(op.hash_value) // self.storage_batch_size)
            if op.batches_done < batches:
                if op.io_success and op.terminated:
                    op.io_success = False
                if op.io_success:
                    op.io_parked = True
                    return
                op.batches_done += 1
                self.ack_prefetch_queue.append((op, op.io_completed, False))
                continue
            self.ack_prefetch_queue.append((op, None, True))
            op.move(PrefetchEvent.IO_END)
            self.prefetch_buffer.popleft()

    def read_after_drain(self) -> bool:
        """``ReadAfterDrain``'s I/O helper step (D-01): the parked batch of the oldest operation is read, its
        ack queued, and the helper runs on to its next read."""
        if not self.prefetch_buffer or not self.prefetch_buffer[0].io_parked:
            return False
        op = self.prefetch_buffer[0]
        start = op.batches_done * self.storage_batch_size
        batch = op.hash_value[start : start + self.storage_batch_size]
        hits = 0
        if self.fail_next_read:
            self.fail_next_read = False
        else:
            l3 = self.storage_backend
            for page_hash in batch:
                key = self._l3_key(page_hash)
                if not l3.objects.get(key, False):
                    l3.discard(key)  # D-18, as run_prefetch_io
                    break
                if op.terminated:  # 0.5.20 stops copying pages once the operation is terminated
                    break
                hits += 1
        if hits != len(batch):
            op.io_success = False
        op.io_completed += hits * self.page_size
        op.batches_done += 1
        op.io_parked = False
        self.ack_prefetch_queue.append((op, op.io_completed, False))
        self.advance_prefetch_io()
        return True

    def run_prefetch_io(self) -> bool:
        """Prefetch I/O helper: read one storage batch of the oldest buffered operation (as the configured
        pipeline reads: ``prefetch_io``)."""
        return self.prefetch_io.run_io(self)

    def read_reserved(self) -> bool:
        """``ReadReserved``'s I/O helper step: one batch into the operation's reserved slots; a short batch
        or the end of the key ends the transfer and frees the unread tail."""
        if not self.prefetch_buffer:
            return False
        op = self.prefetch_buffer[0]
        start = op.batches_done * self.storage_batch_size
        batch = op.hash_value[start : start + self.storage_batch_size]
        if batch and (not op.terminated or self.read_when_terminated):
            # D-63: up to 0.5.18 a terminated operation's next batch is still read (consuming a read fault), and
            # its first page is refused (``increment``), which ends the transfer
            hits = 0
            if self.fail_next_read:
                self.fail_next_read = False
            else:
                l3 = self.storage_backend
                for page_hash in batch:  # leading pages read successfully
                    key = self._l3_key(page_hash)
                    if not l3.objects.get(key, False):
                        # A corrupt object is a miss, and the reader deletes it so that the next backup
                        # of the page writes it again (D-18).
                        l3.discard(key)
                        break
                    if op.terminated:
                        break
                    hits += 1
            op.completed_tokens += hits * self.page_size
            op.batches_done += 1
            if hits < len(batch):
                op.terminated = True  # mark_terminate: a short batch ends the transfer
        if op.terminated or op.batches_done * self.storage_batch_size >= len(op.hash_value):
            # End of the transfer: the unread tail goes back to the pool.
            unread = op.completed_tokens - op.owned_from
            self.append_host_mem_release(op.host_indices[unread:])
            op.host_indices = op.host_indices[:unread]
            op.move(PrefetchEvent.IO_END)
            self.prefetch_buffer.popleft()
            if op.id in self.orphan_prefetch_ops:
                del self.orphan_prefetch_ops[op.id]
        return True

    def terminate_prefetch(self, op: PrefetchOperation) -> int:
        """``mark_terminate``: stop the transfer; returns the completed tokens, which no longer change."""
        op.terminated = True
        return op.completed_tokens

    def take(self, op: PrefetchOperation, upto: int) -> list[int]:
        """The tree takes the owned slots before token ``upto`` (into the tree, the allocator or the
        release queue) and lets the operation go; one still running keeps the rest, as an orphan, and
        releases it when it ends."""
        cut = upto - op.owned_from
        taken = op.host_indices[:cut]
        op.host_indices = op.host_indices[cut:]
        op.owned_from = upto
        if op.stage is not PrefetchStage.DONE:
            self.orphan_prefetch_ops[op.id] = op
        return taken

    # --- L2 -> L3 -----------------------------------------------------------------------------------------

    def write_storage(self, hash_value: list[str], host_indices: list[int]) -> int:
        """Queue the L3 write of the pages named ``hash_value``, read from host slots ``host_indices``; returns
        the operation id."""
        op = StorageOperation(self._new_op_id(), hash_value, host_indices)
        self.backup_queue.append(op)
        return op.id

    def pending_backup_reads(self) -> dict[int, list[int]]:
        """The host slots each backup not yet run will read, by operation id (the snapshot's
        ``backup_host_indices``); a run one reads nothing more."""
        return {op.id: op.host_indices for op in self.backup_queue}

    def run_backup(self) -> bool:
        """Backup thread: write the oldest queued operation's pages to L3, batch by batch, then ack."""
        if not self.backup_queue:
            return False
        op = self.backup_queue.popleft()
        if not self.backup_skip:
            l3 = self.storage_backend
            for start in range(0, len(op.hash_value), self.storage_batch_size):
                if self.fail_next_write:
                    self.fail_next_write = False
                    break  # a failed batch ends the operation; earlier batches stay written
                failed = False
                for page_hash in op.hash_value[start : start + self.storage_batch_size]:
                    key = self._l3_key(page_hash)
                    if key in l3.objects:  # set never overwrites an existing object (D-18)
                        continue
                    if self.disk_room is not None:  # the bytes are written before the rename
                        if self.disk_room == 0:
                            failed = True  # a short write: its temporary file is removed
                            continue
                        self.disk_room -= 1
                    if self.fail_publish:
                        failed = True  # the rename fails: its temporary file is removed
                        continue
                    l3.add(key)
                if failed:  # the batch reports a failure: the operation ends, the faults are spent
                    self.disk_room, self.fail_publish = None, False
                    break
        op.done = True
        self.ack_backup_queue.append(op.id)
        return True

    # --- control queues (seed §3.7) -----------------------------------------------------------------------

    def append_host_mem_release(self, slots: list[int]) -> None:
        # One entry per page, so that the MIN over entry counts frees the same number of tokens on every
        # rank (sglang.md §1.6 [0.5.20]). D-08.
        for start in range(0, len(slots), self.page_size):
            self.host_mem_release_queue.append(slots[start : start + self.page_size])

    def control_queue_sizes(self) -> tuple[int, int, int]:
        return len(self.prefetch_revoke_queue), len(self.ack_backup_queue), len(self.host_mem_release_queue)

    def drain_queue_sizes(self) -> tuple[int, int, int, int, int]:
        """The queues ``ReadAfterDrain``'s ``check_hicache_events`` reduces (D-01: hit, prefetch ack, backup ack,
        release; up to 0.5.17 also the revoke queue, D-58: the last)."""
        return (
            len(self.prefetch_hit_queue),
            len(self.ack_prefetch_queue),
            len(self.ack_backup_queue),
            len(self.host_mem_release_queue),
            len(self.prefetch_revoke_queue),
        )

    def pop_revokes(self, count: int) -> list[tuple[int, int]]:
        return [self.prefetch_revoke_queue.popleft() for _ in range(count)]

    def pop_backup_acks(self, count: int) -> list[int]:
        return [self.ack_backup_queue.popleft() for _ in range(count)]

    def pop_host_mem_releases(self, count: int) -> list[list[int]]:
        return [self.host_mem_release_queue.popleft() for _ in range(count)]

    # --- what the snapshot reads --------------------------------------------------------------------------

    def queue_lengths(self) -> tuple[tuple[str, int], ...]:
        return (
            ("write_pending", sum(1 for a in self.ack_write_queue if not a.done)),
            ("write_acks", sum(1 for a in self.ack_write_queue if a.done)),
            ("load_pending", sum(1 for a in self.ack_load_queue if not a.done)),
            ("load_acks", sum(1 for a in self.ack_load_queue if a.done)),
            (
                "prefetch_query",
                len(self.prefetch_queue) + (self.prefetch_parked is not None) + len(self.prefetch_hit_queue),
            ),
            (
                "prefetch_io",
                self.prefetch_io.io_pending(self),
            ),
            ("backup_pending", len(self.backup_queue)),
            ("revoke", len(self.prefetch_revoke_queue)),
            ("backup_acks", len(self.ack_backup_queue)),
            ("host_release", len(self.host_mem_release_queue)),
        )

    def busy(self) -> bool:
        return bool(
            self.orphan_prefetch_ops
            or self.prefetch_queue
            or self.prefetch_parked
            or self.prefetch_buffer
            or self.backup_queue
            or self.prefetch_revoke_queue
            or self.prefetch_hit_queue
            or self.ack_prefetch_queue
            or self.pending_prefetch_ops
            or self.ack_backup_queue
            or self.host_mem_release_queue
            or self.ack_write_queue
            or self.ack_load_queue
        )


def _ready_prefix(acks: deque[HiCacheAck]) -> int:
    n = 0
    for ack in acks:
        if not ack.done:
            break
        n += 1
    return n
