"""The simulator: replay a workload through a system and account for every tier.

**Scheduler** (``simulate``). Requests run one at a time, in timestamp order (ties in file order); the
logical clock follows the arrival times (``AdvanceClock``) and only L3 reads take logical time. For each
request ``rid`` (its index in that order):

1. the clock moves to its arrival;
2. L3 enabled: ``PrefetchFromStorage(rid, input)``; if admitted, the hit query runs on every rank
   (``CompleteIO(PREFETCH_QUERY)``; the MIN all-reduce resolves once every rank has run it) and
   ``CheckHicacheEvents`` retires a revoke. The request then waits ``queue_delay_us`` before the
   scheduler first looks at it, while the I/O helper reads one storage batch per ``l3_batch_us`` on
   every rank; then, as at every scheduler step, ``CheckHicacheEvents`` retires what the threads acked
   and ``CheckPrefetchProgress`` runs, and as long as the prefetch policy says not done (wait_complete,
   timeout) one more batch is read per ``l3_batch_us`` and the step repeats. Whatever batch jobs remain after
   ``done`` (a terminated, half-read prefetch) are completed at once: they read nothing;
3. ``StartRequest(rid, input + output)``: match, lock, load back the host hit (evicting L1 as needed),
   allocate and compute the rest (evicting as needed). A load back is completed on every rank before the
   request finishes (the forward pass waits for its layers). If the system refuses admission, background
   I/O is drained (step 5) and the request tried once more, as a scheduler would at its next step; a
   second refusal counts the request as rejected;
4. ``FinishRequest(rid)`` inserts input and output;
5. every ``drain_every`` requests, background I/O catches up: the write, load, backup and prefetch I/O
   queues of every rank run dry and ``CheckHicacheEvents`` retires their acknowledgements, repeated
   until nothing moves. The run ends with such a drain.

**Counters.** What an observation reports is taken from it; what it does not is computed from snapshot
deltas (rank 0; tensor-parallel ranks hold equal trees). The simulator does not re-implement the cache:
where a derivation relies on a property of the system, the table says which.

===========================  ===================================================================
counter                      source
===========================  ===================================================================
L1 (device hit)              ``StartResult.device_hit``
L2 (loaded back)             ``StartResult.loaded`` minus the L3 share below
L3                           ``ProgressResult.inserted`` of the request's own prefetch, when its
                             load back happened (``loaded > 0``: a load back covers the whole
                             host-only chain, and the prefetched pages are the end of that chain)
computed                     input tokens minus L1, L2 and L3 (output tokens are always computed)
recomputed                   computed tokens minus compulsory misses (first use of a block)
L2→L1                        ``StartResult.loaded``
L3→L2                        ``ProgressResult.inserted`` (no storage faults are injected and the tree
                             does not change between a prefetch's match and its insert, so every
                             page read is inserted)
L2→L3                        growth of rank 0's L3 key set × ``page_size`` (first/last snapshot)
L1 evictions                 device tokens in the tree: first + inserted (``FinishRequest``: aligned
                             length − ``FinishResult.prefix_len``) + loaded − last
L1→L2                        snapshot deltas every ``audit_every`` requests (and after a refused
                             admission): pages of tree nodes that gained a host copy, less the pages
                             prefetches inserted. A page is named by its last token id, which names
                             its whole prefix. Exact with ``audit_every=1`` up to a page copied and
                             evicted again within one request; sparser audits miss the pages copied
                             and evicted within an interval (a lower bound); 0 does not report it
L2 evictions                 host tokens in the tree: before + L1→L2 + L3→L2 − after, per audit
                             interval (so it misses exactly what L1→L2 misses)
prefetches                   ``PrefetchResult.admitted`` / ``reason``; ``EventsResult.revoked``;
                             timed out = policy ``timeout`` and batch jobs left after ``done``
===========================  ===================================================================

Bytes are tokens × ``HiCacheConfig.bytes_per_token``, per rank.

**Systems.** ``simulate`` drives any ``refcache.systems.HiCacheSystem`` (``apply(op)`` and ``snapshot()``): the
one it is given, or else a fresh one of ``SimOptions.system`` (``"model"``, the reference model, or
``"impl"``, the implementation, imported only then) opened with ``refcache.systems.open_systems`` and
closed after the run.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeVar, cast

from refcache.config import HiCacheConfig, PrefetchPolicy
from refcache.errors import UsageError
from refcache.hashing import Token
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import (
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Done,
    EventsResult,
    FinishRequest,
    FinishResult,
    IOQueue,
    IOResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    StartRequest,
    StartResult,
)
from refcache.hicache.snapshot import Snapshot
from refcache.sim.report import Bounds, RequestRecord, SimOptions, SimReport
from refcache.sim.workload import SimRequest, Workload
from refcache.systems import HiCacheSystem, open_systems

__all__ = ["SimOptions", "simulate"]

_DRAIN: Final = 1 << 20  # "all of them" for CompleteIO: the system stops at the first missing job
_NO_EVENTS: Final = EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=0)

_R = TypeVar("_R", bound=Observation)


@dataclass(frozen=True)
class _TierView:
    """What the accounting reads from one snapshot (rank 0)."""

    device_tokens: int  # tokens of tree nodes with device slots
    host_pages: frozenset[Token]  # last token id of every page of a tree node with host slots
    host_tokens: int  # tokens of tree nodes with host slots
    l3_keys: int  # rank 0's L3 objects


def _view(snapshot: Snapshot) -> _TierView:
    rank = snapshot.ranks[0]
    ps = snapshot.page_size
    device = host_tokens = 0
    host: set[Token] = set()
    for node in rank.nodes:
        if node.value is not None:
            device += len(node.value)
        if node.host_value is not None:
            host_tokens += len(node.host_value)
            # Nodes hold whole pages, and in a simulated workload a token id names its whole prefix, so
            # a page's last token names the page.
            path = node.id.path
            host.update(path[len(path) - node.key_len + ps - 1 :: ps])
    return _TierView(device, frozenset(host), host_tokens, len(rank.l3_keys))


class _Simulator:
    """One replay: drives ``system`` through the workload and fills ``report``."""

    def __init__(
        self, system: HiCacheSystem, config: HiCacheConfig, workload: Workload, options: SimOptions
    ) -> None:
        self.system = system
        self.cfg = config
        self.workload = workload
        self.options = options
        self.ranks = range(config.tp_size)
        self.clock_us = 0
        self.acks: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.device_inserted = 0  # device tokens FinishRequest added to the tree
        self.prefetched_pages: set[Token] = set()  # pages prefetches inserted since the last audit
        self.prefetch_since_audit = 0  # tokens prefetches inserted since the last audit
        self.seen_tokens: dict[int, int] = {}  # block -> most tokens of it any request had (recomputed)
        self.last_view = _TierView(0, frozenset(), 0, 0)  # the previous audit (set by run)
        self.prefetch_outcome = "off"  # the last request's prefetch (RequestRecord.prefetch)

    def apply(self, op: Op, kind: type[_R]) -> _R:
        """Apply ``op``, whose observation is a ``kind``: each operation has one observation type, which
        ``Observation`` (the union of them all) does not say."""
        return cast(_R, self.system.apply(op))

    # --- background I/O -------------------------------------------------------------------------------

    def events(self) -> EventsResult:
        ev = self.apply(CheckHicacheEvents(), EventsResult)
        for name in ("writes", "loads", "revoked", "backups", "host_releases"):
            self.acks[name] += getattr(ev, name)
        return ev

    def complete(self, queue: IOQueue, count: int) -> int:
        """``count`` jobs of ``queue`` on every rank; returns jobs completed over all ranks."""
        return sum(self.apply(CompleteIO(queue, rank, count), IOResult).completed for rank in self.ranks)

    def drain(self) -> None:
        """Every background queue of every rank runs dry and every acknowledgement is retired."""
        while True:
            moved = sum(
                self.complete(q, _DRAIN)
                for q in (IOQueue.WRITE, IOQueue.LOAD, IOQueue.BACKUP, IOQueue.PREFETCH_IO)
            )
            if self.events() == _NO_EVENTS and moved == 0:
                return

    def advance(self, us: int) -> None:
        if us > 0:
            self.apply(AdvanceClock(us), Done)
            self.clock_us += us

    # --- L3 prefetch ----------------------------------------------------------------------------------

    def prefetch(self, req: SimRequest, tokens: tuple[int, ...], report: SimReport) -> int:
        """Run the request's prefetch to its end; returns the tokens it inserted into L2."""
        result = self.apply(PrefetchFromStorage(req.rid, tokens), PrefetchResult)
        if not result.admitted:
            self.refused[result.reason] += 1
            self.prefetch_outcome = f"refused:{result.reason}"
            return 0
        report.prefetch.started += 1
        self.complete(IOQueue.PREFETCH_QUERY, 1)  # hit query + MIN all-reduce on every rank
        revoked = self.events().revoked
        report.prefetch.revoked += revoked
        self.prefetch_outcome = "revoked" if revoked else "complete"
        opt = self.options
        waited = 0  # the request waits for the scheduler; the I/O helper reads meanwhile
        while waited + opt.l3_batch_us <= opt.queue_delay_us and self.complete(IOQueue.PREFETCH_IO, 1):
            self.advance(opt.l3_batch_us)
            waited += opt.l3_batch_us
        self.advance(opt.queue_delay_us - waited)
        idle = 0
        while True:
            # Each scheduler step drains the acknowledgements first (check_hicache_events), then asks
            # about the prefetch: SGLang 0.5.20 counts a read batch only once a drain took its ack.
            report.prefetch.revoked += self.events().revoked
            progress = self.apply(CheckPrefetchProgress(req.rid), ProgressResult)
            if progress.done:
                break
            idle = 0 if self.complete(IOQueue.PREFETCH_IO, 1) else idle + 1
            self.advance(opt.l3_batch_us)
            if idle > 1 and self.cfg.hicache_storage_prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
                raise UsageError(f"request {req.rid}: the prefetch is not done but has no I/O left to run")
        # Jobs left now belong to this prefetch (the queue was empty before): it stopped half-read, and
        # its I/O helper only has to notice the termination (no page is read).
        if self.complete(IOQueue.PREFETCH_IO, _DRAIN):
            if self.cfg.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT:
                report.prefetch.timed_out += 1
                self.prefetch_outcome = "timed_out"
            else:
                report.prefetch.cut_short += 1
                self.prefetch_outcome = "cut_short"
        report.prefetch.inserted += progress.inserted
        self.prefetch_since_audit += progress.inserted
        if progress.inserted:
            # The prefetch key starts where the match ended: the aligned input minus the prefetch tail.
            ps = self.cfg.page_size
            start = len(tokens) - len(tokens) % ps - result.tokens
            self.prefetched_pages.update(tokens[start + ps - 1 : start + progress.inserted : ps])
        return progress.inserted

    # --- one request ----------------------------------------------------------------------------------

    def serve(self, req: SimRequest, report: SimReport) -> None:
        self.advance(req.arrival_us - self.clock_us)
        inp = req.input_tokens()
        tokens = inp + tuple(range(req.output_start, req.output_start + req.output_tokens))
        served = report.served
        served.input += len(inp)
        served.output += req.output_tokens
        self.prefetch_outcome = "off"
        inserted = self.prefetch(req, inp, report) if self.cfg.enable_storage else 0
        seen = self._seen_tokens(req)
        start = self.start(req.rid, tokens, report)
        loaded_before = 0
        if not start.admitted:
            # The scheduler keeps the request waiting and retries it at its next step, after background
            # events: pinned host slots and load-back locks may have gone by then.
            report.admission_retries += 1
            if self.options.audit_every == 1:
                self.audit(report)  # the refused attempt may have written back pages the retry evicts
            self.drain()
            loaded_before = start.loaded  # on the device now: the retry sees them as a device hit
            start = self.start(req.rid, tokens, report)
            if not start.admitted:
                served.rejected += len(inp)
                return
        device_hit = start.device_hit - min(loaded_before, start.device_hit)
        loaded = start.loaded + start.device_hit - device_hit
        from_l3 = min(inserted, loaded) if loaded else 0
        served.l1 += device_hit
        served.l2 += loaded - from_l3
        served.l3 += from_l3
        computed = len(inp) - device_hit - loaded
        served.computed += computed
        # Hits are whole pages, so the computed tokens fill the rest of the input's pages.
        served.computed_pages += (
            -(-len(inp) // self.cfg.page_size) - (device_hit + loaded) // self.cfg.page_size
        )
        served.recomputed += max(0, computed - (len(inp) - seen))
        if self.cfg.loads_retired_per_rank and self.cfg.tp_size > 1:
            # D-68: the forward pass waits for every load issued (a request sent back after its load back's
            # too), and the scheduler's next check retires them on every rank before the request ends
            self.complete(IOQueue.LOAD, _DRAIN)
            self.events()
        elif start.loaded:
            self.complete(IOQueue.LOAD, _DRAIN)  # the forward pass waits for the loaded layers
        finish = self.apply(FinishRequest(req.rid), FinishResult)
        self.device_inserted += len(tokens) - len(tokens) % self.cfg.page_size - finish.prefix_len

    def start(self, rid: int, tokens: tuple[int, ...], report: SimReport) -> StartResult:
        start = self.apply(StartRequest(rid, tokens), StartResult)
        report.moved.l2_to_l1 += start.loaded  # copied even when admission fails afterwards
        return start

    def _seen_tokens(self, req: SimRequest) -> int:
        """Input tokens of ``req`` that some earlier request already had (the rest are compulsory misses)."""
        seen = 0
        last = len(req.blocks) - 1
        for i, block in enumerate(req.blocks):
            tokens = req.last_block_tokens if i == last else req.block_tokens
            before = self.seen_tokens.get(block, 0)
            seen += min(tokens, before)
            if tokens > before:
                self.seen_tokens[block] = tokens
        return seen

    # --- the run --------------------------------------------------------------------------------------

    def audit(self, report: SimReport) -> _TierView:
        """Count pages written to and evicted from L2 since the previous audit; returns this view."""
        before = self.last_view
        after = self.last_view = _view(self.system.snapshot())
        report.snapshots += 1
        written = len(after.host_pages - before.host_pages - self.prefetched_pages) * self.cfg.page_size
        report.moved.l1_to_l2 += written
        # Host tokens: after = before + written + prefetched - evicted. Taking the evictions from this
        # balance (rather than from the pages that vanished) keeps both counters short by the same
        # amount when a page is written and evicted between two audits.
        report.evicted.l2 += before.host_tokens + written + self.prefetch_since_audit - after.host_tokens
        self.prefetched_pages.clear()
        self.prefetch_since_audit = 0
        return after

    def _counters(self, report: SimReport) -> tuple[int, ...]:
        """What a request record is the difference of (``_record``)."""
        s = report.served
        return (
            s.l1, s.l2, s.l3, s.computed, s.computed_pages, s.rejected, report.moved.l1_to_l2,
            report.evicted.l2, report.prefetch.inserted, report.moved.l2_to_l1, self.device_inserted,
        )  # fmt: skip

    def _record(
        self, req: SimRequest, before: tuple[int, ...], device_before: int, report: SimReport
    ) -> None:
        """Append ``req``'s record: the counters' growth since ``before``; its L1 evictions from the device
        tokens before it and after its audit (as ``run`` counts them for the whole trace)."""
        now = self._counters(report)
        d = [b - a for a, b in zip(before, now, strict=True)]
        loaded, inserted = d[9], d[10]
        report.per_request.append(
            RequestRecord(
                rid=req.rid,
                line=req.line,
                arrival_us=req.arrival_us,
                input=req.input_length,
                output=req.output_tokens,
                l1=d[0],
                l2=d[1],
                l3=d[2],
                computed=d[3],
                computed_pages=d[4],
                rejected=d[5] > 0,
                l1_to_l2=d[6],
                evicted_l1=device_before + inserted + loaded - self.last_view.device_tokens,
                evicted_l2=d[7],
                prefetch=self.prefetch_outcome,
                prefetch_inserted=d[8],
            )
        )

    def run(
        self, report: SimReport, on_request: Callable[[int], None] | None, per_request: bool = False
    ) -> None:
        """Replay every request, then fill the counters taken from the first and last snapshot and the
        wall time of the replay; ``per_request`` (audits after every request) also fills
        ``report.per_request``."""
        started = time.perf_counter()
        opt = self.options
        first = self.last_view = _view(self.system.snapshot())
        report.snapshots += 1
        requests = self.workload.requests
        end = first
        for i, req in enumerate(requests, start=1):
            before = self._counters(report) if per_request else ()
            device_before = self.last_view.device_tokens
            self.serve(req, report)
            if i % opt.drain_every == 0 or i == len(requests):
                self.drain()
            if i == len(requests):
                end = self.audit(report)
            elif opt.audit_every and i % opt.audit_every == 0:
                self.audit(report)
            if per_request:
                self._record(req, before, device_before, report)
            if opt.check_invariants:
                violations = check_all(self.system.snapshot())
                if violations:
                    raise AssertionError(f"after request {req.rid}: " + "; ".join(map(str, violations)))
            if on_request is not None:
                on_request(i)
        if not requests:
            end = self.audit(report)
        report.evicted.l1 = (
            first.device_tokens + self.device_inserted + report.moved.l2_to_l1 - end.device_tokens
        )
        report.moved.l2_to_l3 = (end.l3_keys - first.l3_keys) * self.cfg.page_size
        report.moved.l3_to_l2 = report.prefetch.inserted
        report.prefetch.refused = dict(sorted(self.refused.items()))
        report.acks = dict(sorted(self.acks.items()))
        report.seconds = time.perf_counter() - started


def simulate(
    workload: Workload,
    config: HiCacheConfig,
    options: SimOptions | None = None,
    *,
    system: HiCacheSystem | None = None,
    trace_name: str = "trace",
    on_request: Callable[[int], None] | None = None,
    per_request: bool = False,
) -> SimReport:
    """Replay ``workload`` through ``system`` (left open), or else through a fresh system
    ``options.system`` built for ``config`` and closed afterwards, and account for every tier (module
    docstring). ``on_request(i)`` is called after the i-th request (progress bars). ``per_request``
    fills ``SimReport.per_request`` with one ``RequestRecord`` per request; it needs
    ``options.audit_every == 1`` (a snapshot after every request).

    Raises ``ConfigError`` for a configuration that cannot work (``config`` is resolved here),
    ``UsageError`` when the device pool cannot hold the longest request or the system cannot be built,
    and ``AssertionError`` when ``options.check_invariants`` finds a violation.
    """
    options = options or SimOptions()
    if per_request and options.audit_every != 1:
        raise UsageError(
            f"per-request records need audit_every=1 (a snapshot per request), not {options.audit_every}"
        )
    config = config.resolve()
    device_pages = config.device_size // config.page_size
    needed = -(-workload.longest_request // config.page_size)
    if device_pages < needed:
        raise UsageError(
            f"L1 holds {device_pages * config.page_size} tokens but the longest request needs "
            f"{needed * config.page_size}: raise the L1 capacity, lower block_tokens or limit the trace"
        )
    report = SimReport(
        config=config,
        options=options,
        trace=trace_name,
        requests=len(workload.requests),
        block_tokens=workload.block_tokens,
    )
    report.bounds = Bounds(
        belady_l1=workload.optimal_hit_tokens(config.device_size),
        belady_l1_l2=workload.optimal_hit_tokens(config.device_size + config.host_size),
        infinite=workload.infinite_hit_tokens,
    )
    if system is not None:
        _Simulator(system, config, workload, options).run(report, on_request, per_request)
        return report
    with open_systems([options.system], config, {options.system: dict(options.system_options)}) as systems:
        _Simulator(systems[options.system], config, workload, options).run(report, on_request, per_request)
    return report
