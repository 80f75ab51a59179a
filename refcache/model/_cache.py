"""``HiCacheModel``: N tensor-parallel ranks, the operation alphabet, and the collectives between them.

Scheduler operations run on every rank in lock step, as SGLang's scheduler does. A rank-local fact that
can differ between ranks (a finished copy, a storage hit, a page read, a queue length, a can-terminate
flag) is reduced exactly where the seed's §3.7 table reduces it, and every rank then applies the reduced
value, so the trees stay equal:

===============================  ======  ==================================================
where                            reduce  what
===============================  ======  ==================================================
``writing_check``                MIN     finished prefix of the write stream
``loading_check``                MIN     finished prefix of the load stream (D-09)
prefetch thread                  MIN     storage hit count of the operation being queried
``can_terminate_prefetch``       MAX     ``[1 - can_terminate, is_terminated]``
``check_prefetch_progress``      MIN     completed tokens
``drain_storage_control_queues`` MIN     lengths of the revoke, backup-ack and release queues
===============================  ======  ==================================================

Every public entry validates its operation first and raises ``UsageError`` with the state unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Self, TypeVar

from refcache.config import HiCacheConfig, WritePolicy
from refcache.errors import UsageError
from refcache.hicache.ops import (
    AbortPrefetch,
    AbortRequest,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Done,
    EventsResult,
    Evict,
    EvictHost,
    EvictHostResult,
    EvictResult,
    FaultKind,
    FinishRequest,
    FinishResult,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
    check_op,
)
from refcache.hicache.snapshot import Snapshot, rank_clocks
from refcache.hicache.states import NodeEvent, NodeState
from refcache.model._controller import L3Store
from refcache.model._prefetch import pipeline_for
from refcache.model._pure import reduce_min
from refcache.model._rank import RankCache, TreeNode
from refcache.model._snapshot import snapshot_rank

__all__ = ["HiCacheModel"]

_T = TypeVar("_T")


class HiCacheModel:
    """The reference model: ``apply(op) -> Observation`` and ``snapshot() -> Snapshot``."""

    def __init__(self, config: HiCacheConfig) -> None:
        self.config = config.resolve()
        self.l3 = L3Store()
        self.ranks = [RankCache(self.config, rank, self.l3) for rank in range(self.config.tp_size)]
        self.prefetch = pipeline_for(self.config)  # the prefetch pipeline every rank holds (D-01)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Nothing to release: the model holds no threads, files or devices (``refcache.systems.System``)."""

    # --- the alphabet -------------------------------------------------------------------------------------

    def apply(self, op: Op) -> Observation:
        """Apply one operation to every rank it concerns. Raises ``UsageError`` (nothing changed)."""
        self._validate(op)
        if self.config.merge_write_acks:  # D-38: an operation is one scheduler step; its backups share a copy
            try:
                out = self._apply(op)
            finally:
                for r in self.ranks:
                    r.cache_controller.end_batch()
        else:
            out = self._apply(op)
        self.prefetch.after_operation(self.ranks)
        return out

    def _apply(self, op: Op) -> Observation:
        match op:
            case MatchPrefix(tokens, extra_key):
                return self._all(lambda r: _match(r, tokens, extra_key))
            case StartRequest(rid, tokens, extra_key, prompt_len):
                return self._all(lambda r: StartResult(*r.start_request(rid, tokens, extra_key, prompt_len)))
            case CacheUnfinishedRequest(rid):
                for r in self.ranks:
                    r.cache_unfinished_request(rid)
                return Done()
            case FinishRequest(rid):
                return self._all(lambda r: FinishResult(*r.finish_request(rid)))
            case AbortRequest(rid):
                for r in self.ranks:
                    r.abort_request(rid)
                return Done()
            case Evict(num_tokens):
                return self._all(lambda r: EvictResult(r.evict(num_tokens)))
            case EvictHost(num_tokens):
                return self._all(lambda r: EvictHostResult(r.evict_host(num_tokens)))
            case PrefetchFromStorage(rid, tokens, extra_key):
                return self._all(lambda r: _prefetch(r, rid, tokens, extra_key))
            case CheckPrefetchProgress(rid):
                return self.prefetch.check_prefetch_progress(self.ranks, rid)
            case AbortPrefetch(rid):
                self.prefetch.abort_prefetch(self.ranks, rid)
                return Done()
            case CheckHicacheEvents():
                return self._check_hicache_events()
            case Reset():
                if any(r.busy() for r in self.ranks):
                    return ResetResult(flushed=False)
                for r in self.ranks:
                    r.reset()
                return ResetResult(flushed=True)
            case CompleteIO(queue, rank, count):
                return IOResult(self._complete_io(queue, rank, count))
            case AdvanceClock(us, rank):
                # D-41: each rank reads its own clock; ``rank`` moves only that one
                for r in self.ranks:
                    if rank is None or r.rank == rank:
                        r.cache_controller.set_clock(r.cache_controller.clock_us + us)
                return Done()
            case StorageFault(kind, rank, index):
                self._storage_fault(kind, rank, index)
                return Done()

    @property
    def clock_us(self) -> int:
        """The time every rank's clock has reached (``Snapshot.clock_us``, D-41)."""
        return min(r.cache_controller.clock_us for r in self.ranks)

    def snapshot(self) -> Snapshot:
        cfg = self.config
        clock_us, skews = rank_clocks([r.cache_controller.clock_us for r in self.ranks])
        return Snapshot(
            page_size=cfg.page_size,
            write_policy=cfg.hicache_write_policy.value,
            attention=cfg.attention.value,
            tp_size=cfg.tp_size,
            model_name=cfg.model_name,
            storage_enabled=cfg.enable_storage,
            is_eagle=cfg.is_eagle,
            clock_us=clock_us,
            ranks=tuple(snapshot_rank(r, skew) for r, skew in zip(self.ranks, skews, strict=True)),
            host_duplicate_reclaim=cfg.reclaim_host_duplicates
            and cfg.hicache_write_policy is WritePolicy.WRITE_BACK,
            loads_retired_per_rank=cfg.loads_retired_per_rank and cfg.tp_size > 1,
        )

    def transitions_taken(self) -> dict[tuple[NodeState, NodeEvent], int]:
        """How often each (state, event) edge was taken, over all ranks (coverage reports)."""
        out: dict[tuple[NodeState, NodeEvent], int] = {}
        for r in self.ranks:
            for edge, count in r.transitions_taken.items():
                out[edge] = out.get(edge, 0) + count
        return out

    # --- helpers ------------------------------------------------------------------------------------------

    def _all(self, step: Callable[[RankCache], _T]) -> _T:
        results = [step(r) for r in self.ranks]
        # Lock-step operations see equal trees, so they must answer alike; a difference is a model bug.
        assert all(x == results[0] for x in results), f"ranks answered differently: {results}"
        return results[0]

    def _validate(self, op: Op) -> None:
        rank0 = self.ranks[0]
        check_op(
            op,
            tp_size=len(self.ranks),
            is_eagle=self.config.is_eagle,
            running=rank0.requests,
            prefetching=rank0.ongoing_prefetch,
        )
        if isinstance(op, FinishRequest | AbortRequest) and self.loads_unreaped():
            # D-68: SGLang ends a request only after a forward pass, which waited for every rank's load backs,
            # and its next check_hicache_events (before anything evicts) retires them on every rank. Were a
            # request ended while one rank still held a load's lock its peer had retired, an eviction would take
            # on one rank what the other spares, and the trees SGLang's ranks schedule from would differ.
            raise UsageError(
                f"{op!r}: a load back is not retired on every rank (D-68, loads retired per rank: "
                f"{[sorted(r.ongoing_load_back) for r in self.ranks]}); finish every rank's loads "
                "(CompleteIO(LOAD, rank, n)) and CheckHicacheEvents() first, as SGLang's forward pass does"
            )

    def loads_unreaped(self) -> bool:
        """D-68 with two ranks or more: whether a rank still has a load back in flight (``ongoing_load_back``),
        which each rank retires on its own (``EventsResult.loads_by_rank``)."""
        if not self.config.loads_retired_per_rank or len(self.ranks) < 2:
            return False
        return any(r.ongoing_load_back for r in self.ranks)

    def _check_hicache_events(self) -> EventsResult:
        writes = reduce_min([r.ready_write_acks() for r in self.ranks])
        for r in self.ranks:
            r.writing_check_apply(writes)
        by_rank: tuple[int, ...] = ()
        if self.config.loads_retired_per_rank and len(self.ranks) > 1:
            # D-68 (SGLang up to 0.5.12): no collective, each rank retires what its own load stream finished,
            # but a load holding its anchor's last lock only once every rank finished it
            ready = [r.ready_load_ids() for r in self.ranks]
            in_flight = [set(r.ongoing_load_back) for r in self.ranks]

            def everywhere(ack_id: int) -> bool:  # every rank finished it (retired, or in its ready prefix)
                return all(
                    ack_id not in pending or ack_id in ids
                    for pending, ids in zip(in_flight, ready, strict=True)
                )

            by_rank = tuple(
                r.loading_check_own(len(ids), everywhere) for r, ids in zip(self.ranks, ready, strict=True)
            )
            loads = min(by_rank)
            if all(count == loads for count in by_rank):
                by_rank = ()  # every rank retired the same: the answer of a MIN
        else:
            loads = reduce_min([r.ready_load_acks() for r in self.ranks])
            for r in self.ranks:
                r.loading_check_apply(loads)
        backups = releases = revoked = 0
        if self.config.enable_storage:
            backups, releases, revoked = self.prefetch.drain_storage_control_queues(self.ranks)
        return EventsResult(
            writes=writes,
            loads=loads,
            revoked=revoked,
            backups=backups,
            host_releases=releases,
            loads_by_rank=by_rank,
        )

    def _complete_io(self, queue: IOQueue, rank: int, count: int) -> int:
        """Run up to ``count`` jobs of one rank's ``queue``, as that controller's thread would."""
        ctrl = self.ranks[rank].cache_controller
        done = 0
        for _ in range(count):
            match queue:
                case IOQueue.WRITE:
                    if not ctrl.run_write():
                        break
                case IOQueue.LOAD:
                    if not ctrl.run_load():
                        break
                case IOQueue.PREFETCH_QUERY:
                    if not ctrl.run_prefetch_query():
                        break
                    # The query thread blocks in the MIN all-reduce until every rank's query has returned.
                    parked = [x.cache_controller.parked_hits() for x in self.ranks]
                    hits = [h for h in parked if h is not None]
                    if len(hits) == len(parked):
                        reduced = reduce_min(hits)
                        for x in self.ranks:
                            x.cache_controller.resolve_prefetch_query(reduced)
                case IOQueue.PREFETCH_IO:
                    if not ctrl.run_prefetch_io():
                        break
                case IOQueue.BACKUP:
                    if not ctrl.run_backup():
                        break
            done += 1
        return done

    def _storage_fault(self, kind: FaultKind, rank: int, index: int) -> None:
        ctrl = self.ranks[rank].cache_controller
        match kind:
            case FaultKind.FAIL_NEXT_WRITE:
                ctrl.arm_write_fault()
            case FaultKind.FAIL_NEXT_READ:
                ctrl.arm_read_fault()
            case FaultKind.CORRUPT | FaultKind.DELETE | FaultKind.FLIP_PAYLOAD | FaultKind.STALE:
                ctrl.damage_l3_object(index, delete=kind is FaultKind.DELETE)
            case FaultKind.MISPLACED:
                ctrl.misplace_l3_object(index)
            case FaultKind.DISK_FULL:
                ctrl.arm_disk_full(index % 3)
            case FaultKind.FAIL_PUBLISH:
                ctrl.arm_publish_fault()


def _depth(r: RankCache, node: TreeNode) -> int:
    node_id = r.node_id(node)
    return 0 if node_id is None else node_id.depth


def _match(r: RankCache, tokens: tuple[int, ...], namespace: str | None) -> MatchResult:
    values, last_node, host_hit_length, last_host_node = r.match_prefix(r.key_of(tokens), namespace)
    if r.cfg.last_host_node_is_best_match:  # D-46: SGLang 0.5.22 on reports the best match, backed up or not
        last_host_node = last_node
    return MatchResult(len(values), host_hit_length, _depth(r, last_node), _depth(r, last_host_node))


def _prefetch(r: RankCache, rid: int, tokens: tuple[int, ...], namespace: str | None) -> PrefetchResult:
    """The scheduler's ``_prefetch_kvcache``: match, then prefetch the tail below a backed-up last node."""
    key = r.key_of(tokens)
    values, last_node, host_hit_length, last_host_node = r.match_prefix(key, namespace)
    tail = r.page_aligned(key[len(values) + host_hit_length :])
    if not r.cfg.enable_storage:
        return PrefetchResult(False, "storage_disabled", len(tail))
    if not last_node.backuped and not r.cfg.prefetch_below_last_host_node:  # D-13: 0.5.20 does not ask
        # Seed §2.2: only prefetch when L2 holds the matched prefix, else completeness is not guaranteed.
        return PrefetchResult(False, "last_node_not_backuped", len(tail))
    reason = r.prefetch_from_storage(rid, last_host_node, tail, namespace)
    return PrefetchResult(reason == "", reason or "admitted", len(tail))
