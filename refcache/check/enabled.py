"""What is enabled in a HiCache state: the one function the random machines and ``refcache explore`` share.

An operation is *enabled* when the scheduler could issue it there: a request is finished, cached or aborted
only while it runs, a prefetch's progress is checked or aborted only while it is in flight, a new request
or prefetch starts only below the bounds' limits (the machines keep at most three of each), a background
queue completes a job only when that rank's queue holds one. ``enabled_kinds`` is the part that needs only
the running and prefetching request ids (what the machines' ``step`` rule reads before it draws anything);
``enabled_ops`` builds on it and lists the concrete operations over a whole bounded alphabet (``Bounds``:
token sequences, prompt lengths, namespaces, eviction sizes, clock steps, fault kinds), which the explorer
branches on.

Pure: no Hypothesis, no system; it reads a snapshot and the bounds.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Final

from refcache.errors import UsageError
from refcache.hicache.ops import (
    AbortPrefetch,
    AbortRequest,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    Reset,
    StartRequest,
    StorageFault,
)
from refcache.hicache.snapshot import Snapshot

__all__ = ["MAX_PREFETCHING", "MAX_RUNNING", "QUEUE_OF", "Bounds", "enabled_kinds", "enabled_ops"]

MAX_RUNNING: Final = 3
"""Running requests the machines keep at most (a fourth start finishes one instead)."""
MAX_PREFETCHING: Final = 3
"""Prefetches in flight the machines keep at most (a fourth checks one's progress instead)."""

QUEUE_OF: Final[dict[IOQueue, tuple[str, ...]]] = {
    IOQueue.WRITE: ("write_pending",),
    IOQueue.LOAD: ("load_pending",),
    IOQueue.PREFETCH_QUERY: ("prefetch_query",),
    IOQueue.PREFETCH_IO: ("prefetch_io",),
    IOQueue.BACKUP: ("backup_pending",),
}
"""The snapshot's queue lengths (``RankSnapshot.queues``) that say a ``CompleteIO`` of each queue has a job."""


def enabled_kinds(
    running: Collection[int],
    prefetching: Collection[int],
    *,
    max_running: int = MAX_RUNNING,
    max_prefetching: int = MAX_PREFETCHING,
) -> frozenset[type[Op]]:
    """The operation classes whose enabledness depends on the requests alone: those of ``OPS`` minus the
    request operations with no running request, the prefetch checks with none in flight, and new requests
    (prefetches) at the limit. Background and maintenance operations are always in (``enabled_ops`` drops
    the completions of empty queues)."""
    out: set[type[Op]] = {
        MatchPrefix,
        Evict,
        EvictHost,
        CheckHicacheEvents,
        Reset,
        CompleteIO,
        AdvanceClock,
        StorageFault,
    }
    if running:
        out |= {FinishRequest, CacheUnfinishedRequest, AbortRequest}
    if prefetching:
        out |= {CheckPrefetchProgress, AbortPrefetch}
    if len(running) < max_running:
        out.add(StartRequest)
    if len(prefetching) < max_prefetching:
        out.add(PrefetchFromStorage)
    return frozenset(out)


@dataclass(frozen=True)
class Bounds:
    """The bounded alphabet an exploration branches over (``refcache explore``'s options)."""

    sequences: tuple[tuple[int, ...], ...]  # token sequences a request, a match or a prefetch may carry
    namespaces: tuple[str | None, ...] = (None,)  # extra_key values
    evict_sizes: tuple[int, ...] = (1,)  # Evict/EvictHost num_tokens
    clock_steps: tuple[int, ...] = ()  # AdvanceClock us (none: the clock never moves)
    fault_kinds: tuple[FaultKind, ...] = ()  # StorageFault kinds (with L3)
    io_count: int = 1  # jobs one CompleteIO finishes
    max_running: int = MAX_RUNNING
    max_prefetching: int = MAX_PREFETCHING
    matches: bool = True  # MatchPrefix (changes only access times and splits)
    cache_unfinished: bool = True
    reset: bool = True
    # Which operation classes to leave out altogether (by class name), e.g. to focus an exploration.
    without: frozenset[str] = field(default_factory=frozenset)
    # Prompt lengths a request may also carry (``StartRequest.prompt_len``, read by D-24's
    # ``reinsert_prompt_prefix`` only): each one shorter than the request's sequence is listed beside the
    # request without one (all prompt), which is always listed. Empty (the default): none.
    prompt_lens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        bad = [n for n in self.prompt_lens if n < 1]
        if bad:
            raise UsageError(f"prompt lengths must be at least 1 token, not {bad}")

    def tokens(self) -> frozenset[int]:
        """Every token of the alphabet."""
        return frozenset(t for seq in self.sequences for t in seq)


def enabled_ops(snap: Snapshot, bounds: Bounds, fresh_rid: int) -> list[Op]:
    """The concrete operations enabled in ``snap`` over ``bounds``, in a fixed order (the explorer's branch
    order, hence which of two equal-length counterexamples BFS reports). ``fresh_rid`` is the id a new
    request or prefetch takes. A ``CompleteIO`` is listed only for a rank whose queue has a job, a
    ``StorageFault`` that picks an object (``index``) once per object of that rank's L3 view."""
    rank0 = snap.ranks[0]
    running = [r.rid for r in rank0.requests]
    prefetching = [p.rid for p in rank0.ongoing_prefetch]
    kinds = enabled_kinds(
        running, prefetching, max_running=bounds.max_running, max_prefetching=bounds.max_prefetching
    )
    kinds = frozenset(k for k in kinds if k.__name__ not in bounds.without)
    return list(_ops(snap, bounds, fresh_rid, kinds, running, prefetching))


def _ops(
    snap: Snapshot,
    bounds: Bounds,
    fresh_rid: int,
    kinds: frozenset[type[Op]],
    running: list[int],
    prefetching: list[int],
) -> Iterator[Op]:
    if StartRequest in kinds:
        for ns in bounds.namespaces:
            for seq in bounds.sequences:
                yield StartRequest(fresh_rid, seq, ns)
                for prompt_len in bounds.prompt_lens:
                    if prompt_len < len(seq):
                        yield StartRequest(fresh_rid, seq, ns, prompt_len=prompt_len)
    for rid in running:
        if FinishRequest in kinds:
            yield FinishRequest(rid)
        if AbortRequest in kinds:
            yield AbortRequest(rid)
        if CacheUnfinishedRequest in kinds and bounds.cache_unfinished:
            yield CacheUnfinishedRequest(rid)
    if MatchPrefix in kinds and bounds.matches:
        for ns in bounds.namespaces:
            for seq in bounds.sequences:
                yield MatchPrefix(seq, ns)
    for n in bounds.evict_sizes:
        if Evict in kinds:
            yield Evict(n)
        if EvictHost in kinds:
            yield EvictHost(n)
    if snap.storage_enabled:
        if PrefetchFromStorage in kinds:
            for ns in bounds.namespaces:
                for seq in bounds.sequences:
                    yield PrefetchFromStorage(fresh_rid, seq, ns)
        for rid in prefetching:
            if CheckPrefetchProgress in kinds:
                yield CheckPrefetchProgress(rid)
            if AbortPrefetch in kinds:
                yield AbortPrefetch(rid)
    if CheckHicacheEvents in kinds:
        yield CheckHicacheEvents()
    if CompleteIO in kinds:
        for queue, names in QUEUE_OF.items():
            for record in snap.ranks:
                if any(dict(record.queues).get(name, 0) for name in names):
                    yield CompleteIO(queue, record.rank, bounds.io_count)
    if AdvanceClock in kinds:
        for us in bounds.clock_steps:
            yield AdvanceClock(us)
            if len(snap.ranks) > 1:
                for record in snap.ranks:
                    yield AdvanceClock(us, rank=record.rank)
    if StorageFault in kinds and snap.storage_enabled:
        for kind in bounds.fault_kinds:
            for record in snap.ranks:
                if kind in _OBJECT_FAULTS:
                    for index in range(len(record.l3_keys)):
                        yield StorageFault(kind, record.rank, index)
                elif kind is FaultKind.DISK_FULL:
                    for room in range(3):  # room for index % 3 more pages
                        yield StorageFault(kind, record.rank, room)
                else:
                    yield StorageFault(kind, record.rank, 0)
    if Reset in kinds and bounds.reset:
        yield Reset()


_OBJECT_FAULTS: Final = frozenset(
    {FaultKind.CORRUPT, FaultKind.DELETE, FaultKind.FLIP_PAYLOAD, FaultKind.MISPLACED, FaultKind.STALE}
)
"""Faults whose ``index`` picks one object of the rank's sorted L3 view (the others arm a failure: the
index does not matter, except DISK_FULL's ``index % 3``: the room left, 0 to 2 pages)."""
