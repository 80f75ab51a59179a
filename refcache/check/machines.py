"""The differential state machines: one family, parametrised by the systems it drives.

``machine(systems, faults=..., configs=..., coverage=...)`` builds a Hypothesis ``RuleBasedStateMachine``
that drives the named systems (``refcache.systems``: the model, the implementation, another engine's
adapter) with random operation sequences — scheduler calls, background completions per rank and queue,
clock advances and, with ``faults``, storage faults — through the differential ``Harness``, which compares
every step's outcomes and snapshots and checks every invariant. Capacities are a few pages per tier so that
eviction, prefetch, revoke and timeout happen within a few steps. Token sequences reuse earlier prefixes
and are cut near page boundaries (±1 token), where bugs live.

The machines of the default run are built here once: ``ModelMachine`` and ``FaultyModelMachine`` (the
model alone), ``DifferentialMachine`` and ``FaultyDifferentialMachine`` (model and implementation over
every configuration row). Each owns a coverage ledger (``refcache.check.coverage``) that its runs fill.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Final

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from refcache.check.configs import configs as config_strategy
from refcache.check.coverage import TABLES, Coverage
from refcache.check.enabled import enabled_kinds
from refcache.check.explain import explain, followed_profile, follows_a_profile
from refcache.check.harness import Divergence, Outcome, expect, status_line
from refcache.check.machine import FamilyMachine, build
from refcache.check.situations import SituationTracker, key_of
from refcache.config import (
    FIDELITY_OPTIONS,
    PROFILES,
    AttentionKind,
    HiCacheConfig,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import UsageError
from refcache.family import Family
from refcache.hashing import page_hashes, storage_key, storage_namespace_seed
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    OPS,
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
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel
from refcache.systems import (
    SYSTEMS,
    SystemOptions,
    excluded_values,
    fault_kinds,
    required_constraints,
)

__all__ = [
    "KINDS",
    "KIND_OPS",
    "LOAD_KINDS",
    "DifferentialMachine",
    "FaultyDifferentialMachine",
    "FaultyModelMachine",
    "HiCacheMachine",
    "ModelMachine",
    "machine",
]

Request = tuple[tuple[int, ...], str | None]
"""A request's tokens and namespace (``extra_key``)."""

# The operation kinds a step draws from, with their weights. One rule instead of one per operation:
# Hypothesis' swarm testing would otherwise switch off, say, background completion for a whole run, and the
# deep states (drained tables, reloads, timeouts) would be starved. Simple operations come first so that
# shrinking prefers them. The order is part of every derandomized run: append new kinds at the end.
KINDS: Final[Mapping[str, int]] = {
    "check_hicache_events": 4, "match": 2, "evict": 2, "evict_host": 1, "advance_clock": 2, "reset": 1,
    "start_request": 5, "finish_request": 3, "cache_unfinished": 1, "abort_request": 1,
    "prefetch": 3, "check_prefetch_progress": 3, "abort_prefetch": 1,
    "complete_io": 5, "complete_everywhere": 4, "invalid_operation_changes_nothing": 1, "quiesce": 1,
    "push_down": 3, "prefetch_cycle": 2, "host_pressure": 1, "evict_and_rerun": 1, "skewed_progress": 2,
    "reload_under_pressure": 3, "deep_reload": 3,
}  # fmt: skip
FAULT_KINDS: Final[Mapping[str, int]] = {
    "storage_fault": 2, "fault_under_prefetch": 2, "one_rank_fault": 4, "damaged_read": 4,
}  # fmt: skip
LOAD_KINDS: Final[Mapping[str, int]] = {"concurrent_loads": 2, "load_back_short_of_host": 1}
"""Kinds only the machines without faults draw (after ``KINDS``): several loads in flight need no L3, and the
faulty machines' budget, and sample, stay on the storage faults whose situations are thin (issue #30 item 4)."""
EVICTION_ORDER_KINDS: Final[Mapping[str, int]] = {"anchored_prefetch": 2, "split_then_evict": 2}
"""Issue #30 item 5: prefetches below a non-root anchor, splits, and the eviction right after each. Drawn by the
machines without storage faults only: the faulty machines keep their sample, whose L3 situations (issue #30
item 2) rest on a few of its examples."""
OBJECT_FAULTS: Final = frozenset(
    {FaultKind.CORRUPT, FaultKind.DELETE, FaultKind.FLIP_PAYLOAD, FaultKind.MISPLACED, FaultKind.STALE}
)
"""Faults that damage one object (the others arm a failure of the next reads or writes)."""

_REQUEST: Final[frozenset[type[Op]]] = frozenset(
    {StartRequest, FinishRequest, CompleteIO, CheckHicacheEvents}
)
_QUIESCE: Final[frozenset[type[Op]]] = frozenset(
    {FinishRequest, CompleteIO, CheckHicacheEvents, AbortPrefetch, CheckPrefetchProgress, Reset}
)
_PREFETCH_CYCLE: Final[frozenset[type[Op]]] = _REQUEST | {
    PrefetchFromStorage,
    CheckPrefetchProgress,
    AdvanceClock,
}
_PUSH_DOWN: Final[frozenset[type[Op]]] = _REQUEST | _QUIESCE | _PREFETCH_CYCLE | {Evict, EvictHost}
KIND_OPS: Final[Mapping[str, frozenset[type[Op]]]] = {
    "check_hicache_events": frozenset({CheckHicacheEvents}),
    "match": frozenset({MatchPrefix}),
    "evict": frozenset({Evict}),
    "evict_host": frozenset({EvictHost}),
    "advance_clock": frozenset({AdvanceClock, CheckPrefetchProgress}),
    "reset": frozenset({Reset}),
    # CompleteIO and CheckHicacheEvents: ``max_pending_loads`` (``_finish_loads_like_a_forward_pass``)
    "start_request": frozenset({StartRequest, CompleteIO, CheckHicacheEvents}),
    # CompleteIO and CheckHicacheEvents: D-68's reaping before a request ends (``_reap_loads_apart``)
    "finish_request": frozenset({FinishRequest, CompleteIO, CheckHicacheEvents}),
    "cache_unfinished": frozenset({CacheUnfinishedRequest}),
    "abort_request": frozenset({AbortRequest, CompleteIO, CheckHicacheEvents}),
    "prefetch": frozenset({PrefetchFromStorage}),
    "check_prefetch_progress": frozenset({CheckPrefetchProgress, AdvanceClock}),
    "abort_prefetch": frozenset({AbortPrefetch}),
    "complete_io": frozenset({CompleteIO}),
    "complete_everywhere": frozenset({CompleteIO}),
    "invalid_operation_changes_nothing": frozenset(
        {FinishRequest, Evict, CompleteIO, AdvanceClock, StartRequest}
    ),
    "quiesce": _QUIESCE,
    "push_down": _PUSH_DOWN,
    "prefetch_cycle": _PREFETCH_CYCLE,
    "host_pressure": _REQUEST | {Evict},
    "evict_and_rerun": _REQUEST | {Evict},
    "skewed_progress": frozenset({CompleteIO, CheckHicacheEvents, CheckPrefetchProgress}),
    "reload_under_pressure": _REQUEST | {Evict},
    "deep_reload": _REQUEST | {Evict},
    "concurrent_loads": _REQUEST | {Evict},
    "load_back_short_of_host": _REQUEST | _QUIESCE | {Evict, EvictHost},
    "anchored_prefetch": _PUSH_DOWN,
    "split_then_evict": _REQUEST | {MatchPrefix, Evict, AbortPrefetch},
    "storage_fault": frozenset({StorageFault}),
    "fault_under_prefetch": _PUSH_DOWN | {StorageFault},
    "one_rank_fault": _PUSH_DOWN | {StorageFault},
    "damaged_read": _PUSH_DOWN | {StorageFault},
}
"""The operations each kind's rule may apply. A machine over systems that answer only some operations
(``SystemEntry.answers``) draws only the kinds whose operations they all answer; ``run`` refuses any other
operation, so a rule that applies one not listed here fails at once instead of being skipped."""


class HiCacheMachine(FamilyMachine[Op, Observation, Snapshot]):
    """The HiCache family's rules; ``machine(...)`` sets the class attributes. Every step goes through
    ``run``, which applies the operation to every system through the harness (``FamilyMachine.apply``)."""

    systems: ClassVar[tuple[str, ...]] = ("model",)  # registry names; the first is the reference
    kinds: ClassVar[Mapping[str, int]] = KINDS
    config_strategy: ClassVar[st.SearchStrategy[HiCacheConfig]] = config_strategy()
    trace_name: ClassVar[str] = "HiCacheMachine"  # the trace file a failure writes (``machine`` sets it)
    max_pending_loads: ClassVar[int | None] = None  # the systems' scheduler limit (``SystemEntry``)
    # Systems whose limit may count unreaped loads (``SystemEntry.counts_unreaped_loads``), asked at the limit
    unreaped_counted_by: ClassVar[tuple[str, ...]] = ()
    explains: ClassVar[bool] = False  # an engine follows a fixed profile: decisions may explain divergences
    fault_kinds: ClassVar[tuple[FaultKind, ...]] = tuple(FaultKind)  # what every system injects
    answered: ClassVar[frozenset[type[Op]]] = frozenset(OPS)  # the operations every system answers

    def __init__(self) -> None:
        super().__init__()
        self.tracker: SituationTracker | None = None  # recognises situations (setup makes it)
        self.last: Snapshot | None = None  # the reference snapshot before the current step
        self._config: HiCacheConfig | None = None
        self.seqs: list[tuple[int, ...]] = []
        self.running: set[int] = set()
        self.prefetching: set[int] = set()
        self.next_rid = 0
        self.had: Counter[str] = Counter()
        self.tokens_of: dict[int, Request] = {}  # running requests' tokens and namespace
        self.finished: list[Request] = []  # recently finished requests' tokens and namespace
        self._counts_unreaped: bool | None = None  # the answer of ``unreaped_counted_by``, asked once

    # --- plumbing -----------------------------------------------------------------------------------------

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        config = data.draw(self.config_strategy, label="config").resolve()
        note(f"config: {config.dumps()}")
        self._config = config
        harness = self.open(config, on_step=self._on_step)
        self.tracker = SituationTracker(config)
        self.last = harness.snapshots[self.systems[0]]
        self.coverage.runs += 1

    @property
    def config(self) -> HiCacheConfig:
        assert self._config is not None
        return self._config

    @property
    def family(self) -> Family[Op, Observation, Snapshot]:
        return HICACHE

    def run(self, op: Op) -> Observation:
        """Apply one operation to every system through the harness, which compares them and checks every
        invariant (and the step invariants) right after it."""
        assert self.harness is not None
        if self.max_pending_loads is not None and isinstance(op, StartRequest):
            self._finish_loads_like_a_forward_pass(self.max_pending_loads)
        if isinstance(op, FinishRequest | AbortRequest):
            self._reap_loads_apart()
        outcome = self.apply(op)
        note(f"{op!r} -> {outcome!r}")
        if isinstance(outcome, UsageError):
            raise outcome
        assert not isinstance(outcome, Exception), outcome
        return outcome

    def _finish_loads_like_a_forward_pass(self, limit: int) -> None:
        """An engine whose scheduler keeps fewer than ``limit`` load backs unfinished (its forward pass waits
        for each batch's load): complete the oldest ones before a request may start another. Where the limit
        counts the loads not yet reaped, finished or not (``SystemEntry.counts_unreaped_loads``: SGLang 0.5.22
        on), the scheduler's next step also runs ``loading_check``: at the limit, ``CheckHicacheEvents()``
        reaps the finished ones, so the start finds a free slot."""
        assert self.harness is not None
        # Per rank: a rank's loads finish on their own (CompleteIO per rank), and the limit holds on each.
        for rank, record in enumerate(self.snapshot().ranks):
            pending = dict(record.queues).get("load_pending", 0)
            if pending >= limit:
                self.apply(CompleteIO(IOQueue.LOAD, rank, pending - limit + 1))
        # Asked only at the limit (the engine is installed by then); it draws nothing, and a machine whose
        # systems count unfinished loads only (every default one, 0.5.20's "sglang") applies nothing more.
        unreaped = (dict(r.queues) for r in self.snapshot().ranks)
        if any(q.get("load_pending", 0) + q.get("load_acks", 0) >= limit for q in unreaped):
            if self._counts_unreaped is None:
                self._counts_unreaped = any(SYSTEMS[s].counts_unreaped() for s in self.unreaped_counted_by)
            if self._counts_unreaped:
                self.apply(CheckHicacheEvents())

    def _reap_loads_apart(self) -> None:
        """D-68 (``loads_retired_per_rank``, SGLang up to 0.5.12: each rank retires its own finished loads): a
        request ends only after a forward pass, which waited for every rank's load backs, and the scheduler's
        next ``check_hicache_events`` retires them on every rank before anything evicts. While a load back is
        in flight on a rank, finish every rank's and check, as that forward pass and check would, so no request
        ends before (the model refuses it: ``HiCacheModel._validate``)."""
        config = self.harness.config if self.harness is not None else None
        if config is None or not config.loads_retired_per_rank or config.tp_size < 2:
            return
        ranks = self.snapshot().ranks
        if not any(r.ongoing_load_back for r in ranks):
            return
        for rank, record in enumerate(ranks):
            pending = dict(record.queues).get("load_pending", 0)
            if pending:
                self.apply(CompleteIO(IOQueue.LOAD, rank, pending))
        self.apply(CheckHicacheEvents())

    def diverged(self, error: Divergence) -> Outcome:
        """A divergence from an engine that follows a fixed profile: when decisions explain it
        (``refcache.check.explain``), count them in the ledger (``explained by D-xx``) and go on under their
        options (every earlier step agrees there, by construction: the replay checks it); else it fails."""
        assert self.harness is not None and self.opened is not None
        ops = list(self.harness.ops)
        # the harness's configuration, not ``self.config``: a machine opened with ``open`` (a test that runs
        # one trace through the rules, tests/engines/sglang/test_load_slots.py) has drawn none
        current = self.harness.config
        decisions = explain(current, ops, self.systems) if self.explains else []
        if not decisions:
            return super().diverged(error)
        profile = followed_profile(self.systems)
        assert profile is not None
        wanted = PROFILES[profile]
        config = current.with_fidelity({FIDELITY_OPTIONS[d]: wanted[FIDELITY_OPTIONS[d]] for d in decisions})
        for decision in decisions:
            self.coverage.outcomes[f"explained by {decision}"] += 1
        note(f"explained by {decisions}: going on under {config.dumps()}")
        harness = self.open(config)
        outcome: Outcome | None = None
        for op in ops:
            outcome = harness.step(op)
        assert outcome is not None
        harness.on_step = self._on_step
        self._config = config
        return outcome

    def _on_step(self, index: int, op: Op, outcome: Outcome, snap: Snapshot) -> None:
        note(status_line(snap))
        cov = self.coverage
        cov.steps += 1
        reason = outcome.reason if isinstance(outcome, PrefetchResult) else None
        cov.outcomes[type(op).__name__ + ("" if reason is None else f":{reason}")] += 1
        for node in snap.ranks[0].nodes:
            cov.states[node.state.value] += 1
        assert self.tracker is not None and self.last is not None
        for situation in set(self.tracker.observe(op, outcome, self.last, snap)):
            cov.reached(situation)
        self.last = snap
        r = snap.ranks[0]
        sizes = {
            "ongoing_write_through": len(r.ongoing_write_through),
            "ongoing_load_back": len(r.ongoing_load_back),
            "ongoing_backup": len(r.ongoing_backup),
            "ongoing_prefetch": len(r.ongoing_prefetch),
        }
        for table in TABLES:
            size = sizes[table]
            if size and not self.had[table]:
                cov.filled[table] += 1
            if not size and self.had[table]:
                cov.drained[table] += 1
            self.had[table] = size

    def teardown(self) -> None:
        model = None if self.opened is None else self.opened.get("model")
        if isinstance(model, HiCacheModel):  # the model counts the transitions it took
            for (s, e), n in model.transitions_taken().items():
                self.coverage.transitions[f"{s.value}--{e.value}"] += n
        super().teardown()

    @precondition(lambda self: self.harness is not None)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        kind = self.draw_kind(data)
        # What is enabled is the explorer's function too (refcache.check.enabled); a kind whose operation is
        # not enabled is redirected to one that is, in this order (the derandomized samples depend on it).
        enabled = enabled_kinds(self.running, self.prefetching)
        if kind in ("finish_request", "cache_unfinished", "abort_request") and FinishRequest not in enabled:
            kind = "start_request"
        if kind in ("check_prefetch_progress", "abort_prefetch") and CheckPrefetchProgress not in enabled:
            kind = "prefetch"
        if kind == "start_request" and StartRequest not in enabled:
            kind = "finish_request"
        if kind == "prefetch" and PrefetchFromStorage not in enabled:
            kind = "check_prefetch_progress"
        if kind not in self.kinds:
            return  # redirected to a kind the systems do not answer (SystemEntry.answers): nothing this step
        getattr(self, kind)(data)

    # --- token sequences ----------------------------------------------------------------------------------

    def _tokens(self, data: st.DataObject) -> tuple[int, ...]:
        ps = self.config.page_size
        if self.seqs and data.draw(st.integers(0, 3), label="reuse") > 0:
            base = data.draw(st.sampled_from(self.seqs), label="base")
            pages = len(base) // ps
            cut = data.draw(st.integers(0, pages), label="cut_pages") * ps + data.draw(
                st.sampled_from((-1, 0, 0, 1)), label="nudge"
            )
            prefix = base[: max(cut, 0)]
        else:
            prefix = ()
        extra = data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=4 * ps + 2), label="extra")
        tokens = (prefix + tuple(extra))[: 6 * ps + 3]
        if len(tokens) < 2:
            tokens = (*tokens, 7, 8)
        self.seqs.append(tokens)
        if len(self.seqs) > 12:
            self.seqs.pop(0)
        return tokens

    def _namespace(self, data: st.DataObject) -> str | None:
        return data.draw(st.sampled_from((None, None, None, "lora-a")), label="extra_key")

    # --- scheduler operations ------------------------------------------------------------------------------

    def start_request(self, data: st.DataObject) -> None:
        rid = self.next_rid
        self.next_rid += 1
        tokens = self._tokens(data)
        namespace = self._namespace(data)
        prompt_len = None
        if self.config.reinsert_prompt_prefix:  # drawn only where it matters: default runs keep their sample
            prompt_len = data.draw(st.integers(1, len(tokens)), label="prompt_len")
        if expect(self.run(StartRequest(rid, tokens, namespace, prompt_len)), StartResult).admitted:
            self.running.add(rid)
            self.tokens_of[rid] = (tokens, namespace)

    def finish_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        self.run(FinishRequest(rid))
        self.running.discard(rid)
        self.finished = [*self.finished[-7:], self.tokens_of[rid]]

    def cache_unfinished(self, data: st.DataObject) -> None:
        self.run(CacheUnfinishedRequest(data.draw(st.sampled_from(sorted(self.running)), label="rid")))

    def abort_request(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="rid")
        self.run(AbortRequest(rid))
        self.running.discard(rid)

    def match(self, data: st.DataObject) -> None:
        self.run(MatchPrefix(self._tokens(data), self._namespace(data)))

    def evict(self, data: st.DataObject) -> None:
        self.run(Evict(data.draw(st.integers(0, 12), label="n")))

    def evict_host(self, data: st.DataObject) -> None:
        self.run(EvictHost(data.draw(st.integers(0, 12), label="n")))

    def prefetch(self, data: st.DataObject) -> None:
        rid = self.next_rid
        self.next_rid += 1
        obs = self.run(PrefetchFromStorage(rid, self._tokens(data), self._namespace(data)))
        if expect(obs, PrefetchResult).admitted:
            self.prefetching.add(rid)

    def check_prefetch_progress(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.prefetching)), label="rid")
        past = self._draw_deadline(data)
        if past is not None:  # the check lands exactly on the prefetch's deadline, or 1 us past it
            self._clock_to_deadline(rid, past, data)
        obs = self.run(CheckPrefetchProgress(rid))
        if isinstance(obs, ProgressResult) and obs.done:
            self.prefetching.discard(rid)

    def abort_prefetch(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.prefetching)), label="rid")
        self.run(AbortPrefetch(rid))
        self.prefetching.discard(rid)

    def check_hicache_events(self, data: st.DataObject) -> None:
        self.run(CheckHicacheEvents())

    def reset(self, data: st.DataObject) -> None:
        if expect(self.run(Reset()), ResetResult).flushed:
            self.seqs.clear()

    # --- background rules ---------------------------------------------------------------------------------

    def complete_io(self, data: st.DataObject) -> None:
        queue = data.draw(st.sampled_from(list(IOQueue)), label="queue")
        count = data.draw(st.integers(1, 3), label="count")
        rank = data.draw(st.integers(0, self.config.tp_size - 1), label="rank")
        self.run(CompleteIO(queue, rank, count))

    def complete_everywhere(self, data: st.DataObject) -> None:
        """All ranks finish a queue together: keeps drains likely despite per-rank divergence."""
        queue = data.draw(st.sampled_from(list(IOQueue)), label="queue")
        for rank in range(self.config.tp_size):
            self.run(CompleteIO(queue, rank, 8))

    def quiesce(self, data: st.DataObject) -> None:
        """Finish every request, let every queue on every rank run dry and retire everything: the state
        IDLE-DRAINED speaks about. Then reset, sometimes."""
        for rid in sorted(self.running):
            self.run(FinishRequest(rid))
        self.running.clear()
        for round_ in range(8):
            for queue in IOQueue:
                for rank in range(self.config.tp_size):
                    self.run(CompleteIO(queue, rank, 64))
            self.run(CheckHicacheEvents())
            for rid in sorted(self.prefetching):
                obs = self.run(AbortPrefetch(rid) if round_ >= 4 else CheckPrefetchProgress(rid))
                if not isinstance(obs, ProgressResult) or obs.done:
                    self.prefetching.discard(rid)
        if data.draw(st.booleans(), label="reset"):
            self.reset(data)

    def push_down(
        self,
        data: st.DataObject,
        before_prefetch: Callable[[st.DataObject, Request | None], None] | None = None,
        request: Request | None = None,
    ) -> Request | None:
        """Quiesce, then evict everything from L1 and L2, so later prefetches find their pages only in L3
        (a request runs first if none has finished yet); ``before_prefetch`` runs between the evictions
        and the prefetch, given the request about to be prefetched (``request``, else a drawn finished
        one), which is returned."""
        if request is None:
            if not self.finished and len(self.running) < 3:
                self._run_request(self._tokens(data), self._namespace(data))
            request = data.draw(st.sampled_from(self.finished), label="finished") if self.finished else None
        self.quiesce(data)
        self.run(Evict(10_000))
        self._finish_backups()
        self.run(EvictHost(10_000))
        if before_prefetch is not None:
            before_prefetch(data, request)
        if request is not None:
            self.prefetch_cycle(data, request)
        return request

    def _finish_backups(self) -> None:
        """Let the copies an eviction started (write-back: L1→L2, then L2→L3) finish on every rank."""
        for queue in (IOQueue.WRITE, IOQueue.BACKUP):
            for rank in range(self.config.tp_size):
                self.run(CompleteIO(queue, rank, 64))
            self.run(CheckHicacheEvents())

    def prefetch_cycle(self, data: st.DataObject, request: Request | None = None) -> None:
        """A prefetch (of ``request``'s tokens in its namespace, else of drawn ones) whose hit query and
        page reads finish on every rank before its progress check, so that host-only nodes really get
        inserted (rare when each completion is drawn separately)."""
        rid = self.next_rid
        self.next_rid += 1
        if request is None:
            namespace = self._namespace(data)
            tokens = self._tokens(data)
        else:
            tokens, namespace = request
            threshold, bigram = self.config.effective_prefetch_threshold, int(self.config.is_eagle)
            if len(tokens) - bigram >= threshold and data.draw(st.booleans(), label="at_threshold"):
                # Exactly prefetch_threshold tokens of the request's L3 chain, then maybe a page L3 lacks:
                # the admission and the hit query both meet the threshold with equality.
                tail = data.draw(st.sampled_from((0, self.config.page_size)), label="tail")
                tokens = tokens[: threshold + bigram] + tuple(range(900_000, 900_000 + tail))
        if not expect(self.run(PrefetchFromStorage(rid, tokens, namespace)), PrefetchResult).admitted:
            return
        past = self._draw_deadline(data)
        for rank in range(self.config.tp_size):
            self.run(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 64))
        ps, bigram = self.config.page_size, int(self.config.is_eagle)
        key_len = len(tokens) - bigram  # EAGLE keys are bigrams: one element fewer than tokens
        recompute = key_len >= 2 * ps and data.draw(st.booleans(), label="recompute")
        if recompute:
            # Meanwhile a request computes a prefix of the same tokens: its device-only node sits on the
            # prefetched path when the fetched pages (all of them, below) are inserted (sglang.md §9 #6).
            cut = data.draw(st.integers(1, key_len // ps - 1), label="recompute_pages") * ps
            self._run_request(tokens[: cut + bigram], namespace)
        for rank in range(self.config.tp_size):
            # Ranks read different numbers of batches: the MIN of completed tokens decides what is inserted,
            # and the unread tails are released later by each rank's I/O helper.
            # Before a deadline, few reads: the prefetch is still unfinished when its time is up.
            choices = (64, 1, 64, 0, 2) if past is None else (0, 0, 1)
            reads = 64 if recompute else data.draw(st.sampled_from(choices), label="reads")
            if reads:
                self.run(CompleteIO(IOQueue.PREFETCH_IO, rank, reads))
        if past is not None:
            if self.config.tp_size > 1 and data.draw(st.booleans(), label="one_rank_first"):
                # D-41: the deadline passes on one rank's clock first, and the scheduler checks right then
                # (the prefetch timed out there and not yet on the others, sglang.md §9 #2).
                first = data.draw(st.integers(0, self.config.tp_size - 1), label="first_rank")
                self._clock_to_deadline(rid, 1, data, rank=first)
                early = self.run(CheckPrefetchProgress(rid))
                if isinstance(early, ProgressResult) and early.done:
                    return
            self._clock_to_deadline(rid, past, data)
        progress = self.run(CheckPrefetchProgress(rid))
        if not (isinstance(progress, ProgressResult) and progress.done):
            self.prefetching.add(rid)

    def host_pressure(self, data: st.DataObject) -> None:
        """Fill L1 with fresh tokens and evict it, three times, without letting L3 backups finish: host
        slots stay pinned by pending backups, so write-back eviction runs out of host memory
        (sglang.md §9 #7)."""
        size = self.config.device_size
        for _ in range(3):
            if len(self.running) >= 3:
                break
            self._fresh_request(size // 2 + 1)
            self.run(Evict(10_000))

    def reload_under_pressure(self, data: st.DataObject) -> None:
        """A request's KV goes to the host, pending backups pin most of the rest of the host, fresh tokens
        fill the device, and the request runs again: its load back must evict the device, whose
        write-back needs host memory that only the pages being loaded could give (sglang.md §9 #8)."""
        if len(self.running) >= 2:
            return
        cfg = self.config
        size = cfg.device_size
        request: Request
        if bool(self.finished) and data.draw(st.booleans(), label="earlier"):
            request = data.draw(st.sampled_from(self.finished), label="again")
        else:  # a fresh one, long enough to be loaded back (load_back_threshold)
            request = (self._fresh_request(max(cfg.load_back_threshold, cfg.page_size) + cfg.is_eagle), None)
        self.run(Evict(10_000))
        self._finish_backups()
        for _ in range(6):
            if len(self.snapshot().ranks[0].host.free) < size:
                break
            self._fresh_request(size // 2 + 1)
            self.run(Evict(10_000))
        self._fresh_request(size - cfg.page_size)
        self._run_request(*request, load=True, data=data)

    def _fresh_request(self, length: int) -> tuple[int, ...]:
        """Run a request of ``length`` tokens no earlier request shares; returns its tokens."""
        base = 1000 + 100 * self.next_rid
        tokens = tuple(range(base, base + length))
        self._run_request(tokens, None)
        return tokens

    def _run_request(
        self,
        tokens: tuple[int, ...],
        namespace: str | None,
        load: bool = False,
        data: st.DataObject | None = None,
    ) -> None:
        """Start and finish one request; with ``load``, let a load back finish everywhere in between (with
        ``data``, sometimes on one rank first)."""
        rid = self.next_rid
        self.next_rid += 1
        obs = expect(self.run(StartRequest(rid, tokens, namespace)), StartResult)
        if load and obs.loaded:
            ranks = list(range(self.config.tp_size))
            if data is not None and len(ranks) > 1 and data.draw(st.booleans(), label="load_skew"):
                # One rank's load finishes first and the scheduler checks events in between: the load
                # is acknowledged on one rank only until the all-reduce's MIN lets every rank retire it.
                first = data.draw(st.sampled_from(ranks), label="first_rank")
                self.run(CompleteIO(IOQueue.LOAD, first, 8))
                self.run(CheckHicacheEvents())
                ranks.remove(first)
            for rank in ranks:
                self.run(CompleteIO(IOQueue.LOAD, rank, 8))
            self.run(CheckHicacheEvents())
        if obs.admitted:
            self.run(FinishRequest(rid))
            self.finished = [*self.finished[-7:], (tokens, namespace)]

    def skewed_progress(self, data: st.DataObject) -> None:
        """One rank runs ahead: after the writes finish everywhere, one queue finishes on one rank only and
        the scheduler checks events and a prefetch's progress. A rank-local fact (an ack, a read, a
        release) now differs between ranks and only the all-reduces keep them in step; a rank that skips
        one because its own tables are empty would hang the others (sglang.md §9 #1, #2)."""
        for rank in range(self.config.tp_size):
            self.run(CompleteIO(IOQueue.WRITE, rank, 64))
        self.run(CheckHicacheEvents())
        queue = data.draw(st.sampled_from(list(IOQueue)), label="queue")
        rank = data.draw(st.integers(0, self.config.tp_size - 1), label="rank")
        self.run(CompleteIO(queue, rank, 64))
        self.run(CheckHicacheEvents())
        if self.prefetching:
            rid = data.draw(st.sampled_from(sorted(self.prefetching)), label="rid")
            obs = self.run(CheckPrefetchProgress(rid))
            if isinstance(obs, ProgressResult) and obs.done:
                self.prefetching.discard(rid)

    def evict_and_rerun(self, data: st.DataObject) -> None:
        """Evict L1 to the host, then run a finished request again: below the load-back threshold (or
        without device room) its host-only nodes are recomputed and refilled."""
        self.run(Evict(10_000))
        if self.finished and len(self.running) < 3:
            self._run_request(*data.draw(st.sampled_from(self.finished), label="again"), load=True, data=data)

    def deep_reload(self, data: st.DataObject) -> None:
        """A fresh path of two or three nodes runs, its lower nodes go to the host while a request holds its
        top node on the device, and the whole path runs again. The host suffix (one or two nodes) is
        drawn around ``load_back_threshold``: the load back covers a chain of nodes under a device
        ancestor that is not the root, or is refused there, or meets the threshold exactly; the loads
        finish on one rank before the others (sglang.md §9 #1, #8)."""
        if len(self.running) >= 2:
            return
        cfg = self.config
        ps, bigram = cfg.page_size, int(cfg.is_eagle)
        room = cfg.device_size // ps - 1  # pages, one left for the lock request's rounding
        at = -(-cfg.load_back_threshold // ps)  # host pages that reach the threshold
        host_pages = data.draw(st.sampled_from((at - 1, at, at, at + 1, 2)), label="host_pages")
        top = data.draw(st.integers(1, 2), label="top_pages")
        host_pages = max(1, min(host_pages, room - top))
        split = data.draw(st.integers(0, host_pages - 1), label="host_split")  # 0: one host node
        pages = [top] + ([split, host_pages - split] if split else [host_pages])
        tokens = tuple(
            range(1000 + 100 * self.next_rid, 1000 + 100 * self.next_rid + sum(pages) * ps + bigram)
        )
        ends = [sum(pages[: i + 1]) * ps for i in range(len(pages))]
        if data.draw(st.booleans(), label="split_build"):
            # Longest first: each shorter request splits the node above it while that node's write-through
            # may still be pending (sglang.md §9 #15); either order leaves one node per segment.
            ends.reverse()
        for end in ends:
            self._run_request(tokens[: end + bigram], None)
        if cfg.hicache_write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._run_request(tokens, None)  # a second hit: selective write-through backs the path up
        self._finish_backups()
        holder = self.next_rid
        self.next_rid += 1
        held = expect(self.run(StartRequest(holder, tokens[: top * ps + bigram])), StartResult).admitted
        self.run(Evict(10_000))
        self._finish_backups()
        if held:
            self.run(FinishRequest(holder))
        self._run_request(tokens, None, load=True, data=data)
        self.finished = [*self.finished[-7:], (tokens, None)]

    def concurrent_loads(self, data: st.DataObject) -> None:
        """Two or three fresh requests go to the host, then run again one after another before any of their
        load backs finishes; the load stream then finishes them one at a time per rank, with an events check
        drawn between completions: several loads in flight with completions and loading_check interleaved,
        where the order the stream retires copies in (oldest first) shows (issue #30 item 4). Under write-back,
        sometimes under reload_under_pressure's pressure: the first load evicts, and the write-back of what it
        evicts finds the host full but for the pages being loaded (sglang.md §9 #8)."""
        if len(self.running) >= 2:
            return
        cfg = self.config
        ps, bigram = cfg.page_size, int(cfg.is_eagle)
        pages = -(-max(cfg.load_back_threshold, ps) // ps)  # host pages per request: at the threshold
        fit = (cfg.device_size // ps - 1) // pages  # loads the device holds at once (a page to spare)
        wanted = min(data.draw(st.integers(2, 3), label="loads"), fit)
        if wanted < 2:
            return
        requests = [self._fresh_request(pages * ps + bigram) for _ in range(wanted)]
        if cfg.hicache_write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            for tokens in requests:
                self._run_request(tokens, None)  # a second hit: selective write-through backs it up
        self._finish_backups()
        self.run(Evict(10_000))
        self._finish_backups()
        if cfg.hicache_write_policy is WritePolicy.WRITE_BACK and data.draw(st.booleans(), label="pressure"):
            # As reload_under_pressure: pending backups pin the host and fresh tokens fill the device, so the
            # loads evict, and the write-back of what they evict needs host memory that only the pages being
            # loaded could give (sglang.md §9 #8).
            for _ in range(6):
                if len(self.snapshot().ranks[0].host.free) < cfg.device_size:
                    break
                self._fresh_request(cfg.device_size // 2 + 1)
                self.run(Evict(10_000))
            self._fresh_request(cfg.device_size - ps)
        started = []
        for tokens in requests:
            rid = self.next_rid
            self.next_rid += 1
            if expect(self.run(StartRequest(rid, tokens)), StartResult).admitted:
                started.append(rid)
                self.running.add(rid)
                self.tokens_of[rid] = (tokens, None)
        for _ in range(wanted):
            for rank in range(cfg.tp_size):
                self.run(CompleteIO(IOQueue.LOAD, rank, 1))
                if data.draw(st.booleans(), label="check_between"):
                    self.run(CheckHicacheEvents())
        self.run(CheckHicacheEvents())
        for rid in started:
            self.run(FinishRequest(rid))
            self.running.discard(rid)
            self.finished = [*self.finished[-7:], self.tokens_of[rid]]

    def load_back_short_of_host(self, data: st.DataObject) -> None:
        """Under write-back with L3: a load back whose eviction must write a device-only leaf back while the
        host is full but for the pages being loaded (issue #30 item 6; sglang.md §9 #7, #8). From a settled,
        emptied cache, a fresh request goes to the host with its L3 backup finished (unpinned), then fresh
        requests go to the host with their L3 backups left pending (pinned) until less host memory is free
        than a fresh device-only leaf, which fills the device but for less than the first request; the
        first request then runs again and its load back evicts that leaf. Its backup finds no host memory:
        the nested evict_host may take nothing but the pages being loaded. With several ranks the pending
        backups then finish on one rank first. Elsewhere ``reload_under_pressure``, whose pressure is looser."""
        cfg = self.config
        ps, bigram = cfg.page_size, int(cfg.is_eagle)
        size = cfg.device_size
        first = -(-max(cfg.load_back_threshold, ps) // ps) * ps  # tokens loaded back: the threshold, in pages
        if cfg.hicache_write_policy is not WritePolicy.WRITE_BACK or not cfg.enable_storage or first > size:
            self.reload_under_pressure(data)
            return
        self._settle()
        self.run(Evict(10_000))
        self._finish_backups()
        self.run(EvictHost(10_000))
        request = self._fresh_request(first + bigram)
        self.run(Evict(10_000))
        self._finish_backups()  # its own backup done: nothing but the load back pins its pages
        leaf = min(size - first + data.draw(st.sampled_from((ps, 2 * ps)), label="leaf_slack"), size)
        for _ in range(8):  # pending L3 backups pin the rest of the host, down to less than the leaf
            free = len(self.snapshot().ranks[0].host.free)
            if free < leaf:
                break
            fill = min(-(-(free - leaf + 1) // ps) * ps, size - ps, free)
            self._fresh_request(fill + bigram)
            self.run(Evict(10_000))
        self._fresh_request(leaf + bigram)
        self._run_request(request, None, load=True, data=data)
        if cfg.tp_size > 1:
            # The pinned backups then finish on one rank first and the scheduler checks events: the ranks'
            # control queues differ, and only the MIN all-reduce keeps them in step (sglang.md §9 #1).
            rank = data.draw(st.integers(0, cfg.tp_size - 1), label="backups_rank")
            self.run(CompleteIO(IOQueue.BACKUP, rank, 64))
            self.run(CheckHicacheEvents())

    # --- issue #30 item 5: prefetches below a non-root anchor, splits, and the eviction right after -------

    def _settle(self) -> None:
        """Finish every running request and abort every prefetch in flight, then let the copies finish on
        every rank: no running request takes the device room a fresh chain needs, no prefetch holds the rate
        limit or the host memory an admission needs (``quiesce``, without its eight rounds)."""
        for rid in sorted(self.running):
            self.run(FinishRequest(rid))
        self.running.clear()
        for rid in sorted(self.prefetching):
            self.run(AbortPrefetch(rid))
        self.prefetching.clear()
        self._finish_backups()

    def _backed_on_device(self, tokens: tuple[int, ...]) -> None:
        """Run ``tokens`` so that its path ends on the device with its copies in L2 (and L3) finished on every
        rank, under every write policy: selective write-through copies on a second hit; write-back copies on
        eviction, after which the request runs again and loads its path back (or recomputes it onto its host
        nodes)."""
        self._run_request(tokens, None)
        if self.config.hicache_write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE:
            self._run_request(tokens, None)
        self._finish_backups()
        if self.config.hicache_write_policy is WritePolicy.WRITE_BACK:
            self.run(Evict(10_000))
            self._finish_backups()
            self._run_request(tokens, None, load=True)
            self._finish_backups()

    def anchored_prefetch(self, data: st.DataObject) -> None:
        """A prefetch below a non-root anchor. From a quiet cache, a fresh chain (an anchor of one or two
        pages, a tail long enough to be prefetched) is backed up to L3 on every rank, then L1 and L2 are
        emptied and the anchor runs again, backed up on the device. Then a prefetch of a longer key: the whole chain (its tail is in
        L3 but not in L1/L2: its pages are inserted under the anchor), or the anchor and a fresh tail L3 never
        held (the hit query finds too few pages: revoked). While its pages are read a peer request runs, so
        the peer was used after the admission's match and before the insert: an Evict right after the insert
        chooses between the anchor and the peer by whether the insert touched the anchor (D-33)."""
        cfg = self.config
        if not cfg.enable_storage:
            return
        self._settle()
        ps, bigram = cfg.page_size, int(cfg.is_eagle)
        head = data.draw(st.integers(1, 2), label="anchor_pages") * ps
        tail = max(cfg.effective_prefetch_threshold // ps, 1) + data.draw(
            st.integers(0, 1), label="tail_extra"
        )
        tail = max(1, min(tail, cfg.device_size // ps - head // ps - 1)) * ps
        base = 1000 + 100 * self.next_rid
        tokens = tuple(range(base, base + head + tail + bigram))
        self._backed_on_device(tokens)
        self.run(Evict(10_000))
        self._finish_backups()
        self.run(EvictHost(10_000))
        self._backed_on_device(tokens[: head + bigram])
        if data.draw(st.booleans(), label="revoke"):
            request = tokens[: head + bigram] + tuple(range(base + 50, base + 50 + tail))
        else:
            request = tokens
        rid = self.next_rid
        self.next_rid += 1
        if not expect(self.run(PrefetchFromStorage(rid, request, None)), PrefetchResult).admitted:
            return
        for rank in range(cfg.tp_size):
            self.run(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 64))
        self.run(CheckHicacheEvents())  # a failed query is revoked here
        self._fresh_request(data.draw(st.integers(1, 2), label="peer_pages") * ps + bigram)
        self._finish_backups()  # a pending write-through would lock the peer out of the eviction
        for rank in range(cfg.tp_size):
            self.run(CompleteIO(IOQueue.PREFETCH_IO, rank, 64))
        progress = self.run(CheckPrefetchProgress(rid))
        if not (isinstance(progress, ProgressResult) and progress.done):
            self.prefetching.add(rid)
            return
        # Right after the insert: the anchor and the peer are both device leaves.
        self.run(Evict(data.draw(st.sampled_from((ps, head, 10_000)), label="n")))

    def split_then_evict(self, data: st.DataObject) -> None:
        """A split, then an Evict right after it. From a settled cache (``_settle``) a fresh chain of three or
        four pages runs with a prompt boundary (under D-24's re-insert its nodes get priority 1), then a
        fresh peer, then a match cut at another page boundary inside the chain splits a node (the peer's
        timestamp is the closest); the eviction chooses between the split's new node and the peer (both
        priority 0, or 1)."""
        cfg = self.config
        self._settle()
        ps, bigram = cfg.page_size, int(cfg.is_eagle)
        pages = data.draw(st.integers(3, 4), label="chain_pages")
        base = 1000 + 100 * self.next_rid
        tokens = tuple(range(base, base + pages * ps + bigram))
        rid = self.next_rid
        self.next_rid += 1
        prompt = data.draw(st.integers(1, pages - 1), label="prompt_pages") * ps + bigram
        if expect(self.run(StartRequest(rid, tokens, None, prompt)), StartResult).admitted:
            self.run(FinishRequest(rid))
        peer = data.draw(st.integers(1, 2), label="peer_pages")
        peer_prompt = data.draw(st.integers(1, peer), label="peer_prompt_pages") * ps + bigram
        base = 1000 + 100 * self.next_rid
        rid = self.next_rid
        self.next_rid += 1
        peer_tokens = tuple(range(base, base + peer * ps + bigram))
        if expect(self.run(StartRequest(rid, peer_tokens, None, peer_prompt)), StartResult).admitted:
            self.run(FinishRequest(rid))
        # Inside a node: not at the prompt boundary, where D-24's re-insert has split the chain already.
        cuts = [c * ps + bigram for c in range(1, pages) if c * ps + bigram != prompt]
        cut = data.draw(st.sampled_from(cuts), label="cut")
        self.run(MatchPrefix(tokens[:cut], None))
        self.run(Evict(data.draw(st.sampled_from((ps, 2 * ps, 10_000)), label="n")))

    def _draw_deadline(self, data: st.DataObject) -> int | None:
        """Under the timeout policy, sometimes 0 or 1: how far past a prefetch's deadline to move the
        clock before its progress check (timeouts are drawn in whole microseconds per token, ``configs``)."""
        if self.config.hicache_storage_prefetch_policy is not PrefetchPolicy.TIMEOUT:
            return None
        return data.draw(st.sampled_from((0, 1, 0, None)), label="deadline")

    def _draw_clock_rank(self, data: st.DataObject) -> int | None:
        """With several ranks, sometimes one rank whose clock alone moves (D-41: each rank reads its own
        clock, so a prefetch may time out on one rank and not yet on another, sglang.md §9 #2)."""
        if (
            self.config.tp_size == 1
            or self.config.hicache_storage_prefetch_policy is not PrefetchPolicy.TIMEOUT
        ):
            return None  # only prefetch timeouts read the clock
        ranks: tuple[int | None, ...] = (None, *range(self.config.tp_size))
        rank: int | None = data.draw(st.sampled_from(ranks), label="clock_rank")
        return rank

    def _clock_to_deadline(self, rid: int, past: int, data: st.DataObject, rank: int | None = None) -> None:
        """Move the clock to ``past`` microseconds after prefetch ``rid``'s deadline, if that is ahead: ``rank``'s
        clock when given; else every rank's clock (the latest to its deadline lands on it), or one drawn
        rank's (``_draw_clock_rank``)."""
        assert self.tracker is not None
        snap = self.snapshot()
        record = next((p for p in snap.ranks[0].ongoing_prefetch if p.rid == rid), None)
        if self.tracker.started(rid) is None or record is None:
            return
        if rank is None:
            rank = self._draw_clock_rank(data)
        limit = -(
            -self.tracker.timeout_x1024(self.tracker.deadline_pages(record)) // 1024
        )  # whole us, rounded up
        us = max(
            (self.tracker.started(rid, r) or 0) + limit + past - snap.rank_clock_us(r)
            for r in (range(len(snap.ranks)) if rank is None else (rank,))
        )
        if us > 0:
            self.run(AdvanceClock(us, rank=rank))

    def advance_clock(self, data: st.DataObject) -> None:
        us = data.draw(st.sampled_from((100, 1_000, 50_000, 0)), label="us")
        past = self._draw_deadline(data) if us == 0 and self.prefetching else None
        if past is None:
            self.run(AdvanceClock(us or 100, rank=self._draw_clock_rank(data)))
            return
        # Onto a prefetch's deadline (or 1 us past it), and the scheduler checks its progress right there.
        rid = data.draw(st.sampled_from(sorted(self.prefetching)), label="rid")
        self._clock_to_deadline(rid, past, data)
        obs = self.run(CheckPrefetchProgress(rid))
        if isinstance(obs, ProgressResult) and obs.done:
            self.prefetching.discard(rid)

    def invalid_operation_changes_nothing(self, data: st.DataObject) -> None:
        """A bad operation raises ``UsageError`` everywhere and leaves every snapshot exactly as it was."""
        assert self.harness is not None
        before = {name: system.snapshot() for name, system in self.harness.systems.items()}
        bad: list[Op] = [
            FinishRequest(10_000),
            Evict(-1),
            CompleteIO(IOQueue.WRITE, self.config.tp_size, 1),
            AdvanceClock(-5),
            StartRequest(self.next_rid, ()),
        ]
        op = data.draw(st.sampled_from(bad), label="bad_op")
        outcome = self.apply(op)  # through diverged, as every step
        assert isinstance(outcome, UsageError), f"{op!r} was accepted: {outcome!r}"
        for name, system in self.harness.systems.items():
            assert system.snapshot() == before[name], f"{op!r} raised on {name} but changed the state"

    # --- storage faults (kinds of FAULT_KINDS) -------------------------------------------------------------
    # After a fault a prefetch may miss, never insert wrong pages (HASH-CHAIN and conservation still hold).

    def fault_under_prefetch(self, data: st.DataObject) -> None:
        """``push_down`` with a fault between the evictions and the prefetch: the prefetch of a finished
        request reads its pages from L3 right after one of them went bad. Sometimes the request then runs
        again, its pages are backed up again (the read dropped the damaged object, so the backup writes
        it anew) and pushed down once more, and another prefetch reads them back."""
        fault: Callable[[st.DataObject, Request | None], None] = self.storage_fault
        if FaultKind.DELETE in self.fault_kinds and data.draw(st.booleans(), label="delete_inner"):
            # An inner page of the chain vanishes: the hit query must stop there even when a later
            # storage batch of the chain is present (a storage batch smaller than the chain).
            fault = functools.partial(self.storage_fault, kind=FaultKind.DELETE)
        request = self.push_down(data, before_prefetch=fault)
        if request is not None and len(self.running) < 3 and data.draw(st.booleans(), label="reread"):
            self._run_request(*request)
            self.run(Evict(10_000))
            self._finish_backups()
            self.push_down(data, request=request)

    def storage_fault(
        self, data: st.DataObject, request: Request | None = None, kind: FaultKind | None = None
    ) -> None:
        """A fault (of ``kind``, else a drawn one) on a drawn rank; one that damages an object is aimed at
        an inner page of ``request``'s L3 chain when there is one (a gap in the middle of the chain the
        next prefetch reads)."""
        if not self.config.enable_storage:
            return
        if kind is None:
            kind = data.draw(st.sampled_from(self.fault_kinds), label="fault")
        rank = data.draw(st.integers(0, self.config.tp_size - 1), label="rank")
        index = None
        if request is not None and kind in OBJECT_FAULTS:
            index = self._aimed_index(data, request, rank, kind)
        if index is None:
            index = data.draw(st.integers(0, 20), label="index")
        self.run(StorageFault(kind, rank, index))

    def damaged_read(self, data: st.DataObject) -> None:
        """A read that meets an object whose framing is intact but whose bytes are wrong: a flipped payload byte
        (only the checksum tells) or another key's object in its place (only the key and page format tell),
        aimed at a page of a finished request's L3 chain on one rank; then, from emptied L1 and L2, a prefetch
        of that chain whose hit query and reads all finish on every rank before its progress check (issue #30
        item 6: ``fault_under_prefetch`` draws every kind and a partial read, so such a read was rare); sometimes
        the page is backed up anew and read back once more. Under the timeout policy, sometimes the time is up
        before any read instead (``_read_late``). Without L3, or without those kinds, a drawn fault
        (``storage_fault``)."""
        cfg = self.config
        kinds = [k for k in (FaultKind.FLIP_PAYLOAD, FaultKind.MISPLACED) if k in self.fault_kinds]
        if not cfg.enable_storage or not kinds:
            self.storage_fault(data)
            return
        if not self.finished and len(self.running) < 3:
            self._run_request(self._tokens(data), self._namespace(data))
        bigram = int(cfg.is_eagle)
        long = [r for r in self.finished if len(r[0]) - bigram >= cfg.effective_prefetch_threshold]
        if not long:
            return
        request = data.draw(st.sampled_from(long), label="finished")
        self.quiesce(data)
        self.run(Evict(10_000))
        self._finish_backups()
        self.run(EvictHost(10_000))
        kind = data.draw(st.sampled_from(kinds), label="damage")
        rank = data.draw(st.integers(0, cfg.tp_size - 1), label="rank")
        index = self._aimed_index(data, request, rank, kind)
        if index is not None:
            self.run(StorageFault(kind, rank, index))
        if cfg.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT and data.draw(
            st.booleans(), label="late"
        ):
            self._read_late(request)
            return
        self._read_whole(request)
        if len(self.running) < 3 and data.draw(st.booleans(), label="reread"):
            # As fault_under_prefetch: the read dropped the damaged object; the request runs again, its pages
            # are backed up anew, L1 and L2 are emptied and the whole chain is read back once more.
            self._run_request(*request)
            self.run(Evict(10_000))
            self._finish_backups()
            self.run(EvictHost(10_000))
            self._read_whole(request)

    def _read_late(self, request: Request) -> None:
        """Under the timeout policy: a prefetch of ``request`` whose hit query finishes on every rank and whose
        time is up before any read: every rank's clock moves to 1 us past its deadline and the scheduler checks
        right then (an unfinished, non-empty prefetch past its timeout, which the machines without faults
        reach only now and then)."""
        rid = self.next_rid
        self.next_rid += 1
        if not expect(self.run(PrefetchFromStorage(rid, *request)), PrefetchResult).admitted:
            return
        for rank in range(self.config.tp_size):
            self.run(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 64))
        if self.config.prefetch_timeout_from_first_poll:  # D-55: the timeout starts at a check that waits
            progress = self.run(CheckPrefetchProgress(rid))
            if isinstance(progress, ProgressResult) and progress.done:
                return
        assert self.tracker is not None
        snap = self.snapshot()
        record = next((p for p in snap.ranks[0].ongoing_prefetch if p.rid == rid), None)
        if record is not None:
            # the first whole us past it
            past = self.tracker.timeout_x1024(self.tracker.deadline_pages(record)) // 1024 + 1
            us = max(
                (self.tracker.started(rid, r) or 0) + past - snap.rank_clock_us(r)
                for r in range(len(snap.ranks))
            )
            if us > 0:
                self.run(AdvanceClock(us))
        progress = self.run(CheckPrefetchProgress(rid))
        if not (isinstance(progress, ProgressResult) and progress.done):
            self.prefetching.add(rid)

    def _read_whole(self, request: Request) -> None:
        """A prefetch of ``request`` whose hit query and reads all finish on every rank before its progress
        check."""
        rid = self.next_rid
        self.next_rid += 1
        if not expect(self.run(PrefetchFromStorage(rid, *request)), PrefetchResult).admitted:
            return
        for queue in (IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO):
            for rank in range(self.config.tp_size):
                self.run(CompleteIO(queue, rank, 64))
        progress = self.run(CheckPrefetchProgress(rid))
        if not (isinstance(progress, ProgressResult) and progress.done):
            self.prefetching.add(rid)

    # --- rank-divergent prefetches (issue #30 item 1) ------------------------------------------------------

    def _unequal_release(
        self, data: st.DataObject, fault: Callable[[st.DataObject, Request], None] | None = None
    ) -> None:
        """With several ranks and L3: a finished request's pages go to L3 only (``push_down`` without its
        prefetch), ``fault`` runs, then a prefetch of them whose hit query finishes on every rank, whose
        reads run ahead on one rank and lag (or do not start) on the others, and which is released right
        there — checked done (under the timeout policy past its deadline) or aborted. Each rank must free
        its own unread rest and the MIN of completed tokens alone is inserted. Else ``prefetch_cycle``."""
        cfg = self.config
        if cfg.tp_size == 1 or not cfg.enable_storage:
            self.prefetch_cycle(data)
            return
        if not self.finished and len(self.running) < 3:
            self._run_request(self._tokens(data), self._namespace(data))
        if not self.finished:
            return
        # One long enough to be admitted, where there is one (a shorter one would be refused at once).
        bigram = int(cfg.is_eagle)
        long = [r for r in self.finished if len(r[0]) - bigram >= cfg.effective_prefetch_threshold]
        request = data.draw(st.sampled_from(long or self.finished), label="finished")
        if cfg.hicache_write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE and len(self.running) < 3:
            # A second hit backs the chain up (selective write-through): else it is seldom in L3 on every
            # rank, no fault finds a page of it, and the ranks' L3 views never differ (issue #30 item 6).
            self._run_request(*request)
        self.quiesce(data)
        self.run(Evict(10_000))
        self._finish_backups()
        self.run(EvictHost(10_000))
        if fault is not None:
            fault(data, request)
        rid = self.next_rid
        self.next_rid += 1
        if not expect(self.run(PrefetchFromStorage(rid, *request)), PrefetchResult).admitted:
            return
        for rank in range(cfg.tp_size):
            self.run(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 64))
        ahead = data.draw(st.integers(0, cfg.tp_size - 1), label="ahead_rank")
        for rank in range(cfg.tp_size):
            reads = data.draw(
                st.sampled_from((64, 1) if rank == ahead else (0, 0, 1)),
                label="reads_ahead" if rank == ahead else "reads_behind",
            )
            if reads:
                self.run(CompleteIO(IOQueue.PREFETCH_IO, rank, reads))
        if data.draw(st.sampled_from(("check", "check", "abort")), label="release") == "check":
            if cfg.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT:
                self._clock_to_deadline(rid, 1, data)
            obs = self.run(CheckPrefetchProgress(rid))
            if isinstance(obs, ProgressResult) and obs.done:
                return
        self.run(AbortPrefetch(rid))

    def one_rank_fault(self, data: st.DataObject) -> None:
        """``_unequal_release`` after a fault on one rank's view of a page of the chain the prefetch is about
        to query, which the other ranks still have: deleted, the ranks' hit counts differ and only the MIN
        all-reduce keeps them fetching the same prefix; damaged, the hit counts agree and the reads stop at
        different pages."""
        self._unequal_release(data, fault=self._fault_on_one_rank)

    def _fault_on_one_rank(self, data: st.DataObject, request: Request) -> None:
        # Mostly deleted (the hit counts differ), else damaged (the counts agree, the reads stop at different
        # pages). Under MLA every rank reads one shared copy: a fault reaches every rank's view.
        wanted = (
            FaultKind.DELETE,
            FaultKind.DELETE,
            FaultKind.DELETE,
            FaultKind.CORRUPT,
            FaultKind.MISPLACED,
        )
        kinds = [k for k in wanted if k in self.fault_kinds]
        if not kinds:
            return
        kind = data.draw(st.sampled_from(kinds), label="one_rank_fault")
        rank = data.draw(st.integers(0, self.config.tp_size - 1), label="fault_rank")
        index = self._aimed_index(data, request, rank, kind, past_first=True)
        if index is not None:
            self.run(StorageFault(kind, rank, index))

    def _aimed_index(
        self, data: st.DataObject, request: Request, rank: int, kind: FaultKind, past_first: bool = False
    ) -> int | None:
        """The index in ``rank``'s L3 view of a page of ``request``'s chain — an inner one when the chain
        has three pages or more — plus a multiple of the view's length (which the payload-flip fault
        turns into another byte offset); None when that page is not in L3. A misplaced object is chosen
        modulo the view's length less one (the last key has no next key to copy from), so its lap is a
        multiple of that: any other lap would damage a page off the aimed chain, never read back. ``past_first``:
        never the first page (a fault there leaves the prefetch nothing every rank found: no release or timeout
        of read pages to speak of)."""
        cfg = self.config
        ps = cfg.page_size
        tokens, namespace = request
        key = key_of(cfg, tokens)
        hashes = page_hashes(key[: len(key) // ps * ps], ps, storage_namespace_seed(namespace))
        if not hashes:
            return None
        n = len(hashes)
        low = 1 if past_first and n >= 2 else 0  # past the first page: the MIN hit count stays non-empty
        page = data.draw(st.integers(1, n - 2) if n >= 3 else st.integers(low, n - 1), label="aimed_page")
        mla = cfg.attention is AttentionKind.MLA
        wanted = storage_key(
            hashes[page], model_name=cfg.model_name, mla=mla, tp_rank=rank, tp_size=cfg.tp_size
        )
        view = self.snapshot().ranks[rank].l3_keys
        if wanted not in view:
            return None
        at = view.index(wanted)
        cycle = len(view)
        if kind is FaultKind.MISPLACED:
            cycle -= 1
            if at >= cycle:  # the last key of the view cannot be overwritten by a next one
                return None
        return at + cycle * data.draw(st.integers(0, 3), label="lap")


def machine(
    systems: Sequence[str] = ("model",),
    *,
    faults: bool = False,
    configs: st.SearchStrategy[HiCacheConfig] | None = None,
    coverage: Coverage | None = None,
    name: str | None = None,
    base: type[HiCacheMachine] = HiCacheMachine,
    seed: int | None = None,
    trace_name: str | None = None,
    options: SystemOptions | None = None,
    kinds: Mapping[str, int] | None = None,
) -> type[HiCacheMachine]:
    """A machine class driving ``systems`` (registry names, the first is the reference). ``faults`` adds the
    storage-fault kinds; ``kinds`` replaces the operation kinds it draws, with their weights (default:
    ``KINDS`` and ``FAULT_KINDS`` with ``faults``, else ``KINDS``, ``LOAD_KINDS`` and ``EVICTION_ORDER_KINDS``;
    the label, and so the default name, is the same either way); ``configs`` replaces the configuration strategy (default: ``configs()``);
    ``coverage`` is the ledger its runs fill (default: a new one, ``Machine.coverage``); ``name`` names the
    class, and so the derandomized sample (Hypothesis derives a derandomized run's seed from the name of a
    class without findable source: two classes of one name run the same examples); ``base`` is a subclass of
    ``HiCacheMachine`` to build on. ``seed`` runs another sample of the same machine (Hypothesis'
    ``@seed``: the robustness figure of the zoo); ``trace_name`` names the trace a failure writes (default:
    the class name); ``options``: keyword options per system (``refcache.systems.open_systems``)."""
    limits = [SYSTEMS[s].max_pending_loads for s in systems if s in SYSTEMS]
    return build(
        base,
        HICACHE,
        systems,
        kinds=kinds
        if kinds is not None
        else {**KINDS, **FAULT_KINDS}
        if faults
        else {**KINDS, **LOAD_KINDS, **EVICTION_ORDER_KINDS},
        kind_ops=KIND_OPS,
        label=("Faulty" if faults else "") + "".join(s.capitalize() for s in systems) + "Machine",
        coverage=coverage,
        name=name,
        seed=seed,
        trace_name=trace_name,
        config_strategy=configs
        if configs is not None
        # Non-zero priorities (issue #30 item 5) where EVICTION_ORDER_KINDS are drawn: the faulty machines
        # keep their sample.
        else config_strategy(
            constraints=required_constraints(systems),
            priorities=not faults,
            excluded=excluded_values(systems),
        ),
        max_pending_loads=min((n for n in limits if n is not None), default=None),
        unreaped_counted_by=tuple(s for s in systems if s in SYSTEMS and SYSTEMS[s].counts_unreaped_loads),
        explains=follows_a_profile(systems),
        system_options=options or {},
        fault_kinds=fault_kinds(systems),
    )


ModelMachine: Final = machine(("model",), name="ModelMachine")
FaultyModelMachine: Final = machine(("model",), faults=True, name="FaultyModelMachine")
DifferentialMachine: Final = machine(("model", "impl"), name="DifferentialMachine")
FaultyDifferentialMachine: Final = machine(("model", "impl"), faults=True, name="FaultyDifferentialMachine")
