"""Hypothesis strategies for configurations and operations, and the model-alone state machine.

``ModelMachine`` drives ``HiCacheModel`` with random operation sequences — scheduler calls, background
completions per rank and queue, clock advances and (in ``FaultyModelMachine``) storage faults — and checks
every invariant of ``refcache.invariants`` after every step. Capacities are a few pages per tier so
that eviction, prefetch, revoke and timeout happen within a few steps. Token sequences reuse earlier
prefixes and are cut near page boundaries (±1 token), where bugs live.

``COVERAGE`` accumulates, over every run in the process, which node states, transitions, in-flight tables
(filled and drained) and operation outcomes were reached; ``coverage_report()`` prints it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from refcache.config import (
    AttentionKind,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import UsageError
from refcache.harness import Harness, System, status_line
from refcache.invariants import check_all
from refcache.model import HiCacheModel
from refcache.ops import (
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
    ProgressResult,
    Reset,
    StartRequest,
    StorageFault,
)
from refcache.snapshot import Snapshot
from refcache.states import TRANSITIONS, NodeState

__all__ = [
    "COVERAGE",
    "Coverage",
    "FaultyModelMachine",
    "ModelMachine",
    "configs",
    "coverage_report",
    "status_line",
]

TABLES = ("ongoing_write_through", "ongoing_load_back", "ongoing_backup", "ongoing_prefetch")


@dataclass
class Coverage:
    """What the state machines reached, summed over runs."""

    states: Counter[str] = field(default_factory=Counter)
    transitions: Counter[str] = field(default_factory=Counter)
    filled: Counter[str] = field(default_factory=Counter)
    drained: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    steps: int = 0
    runs: int = 0

    def missing(self) -> list[str]:
        """Names of states, transitions and table fill/drain events never reached."""
        out = [f"state {s.value}" for s in NodeState if s is not NodeState.GONE and not self.states[s.value]]
        out += [
            f"transition {s.value}--{e.value}"
            for (s, e) in TRANSITIONS
            if not self.transitions[f"{s.value}--{e.value}"]
        ]
        out += [f"table {t} filled" for t in TABLES if not self.filled[t]]
        out += [f"table {t} drained" for t in TABLES if not self.drained[t]]
        return out


COVERAGE = Coverage()


def coverage_report(cov: Coverage = COVERAGE) -> str:
    lines = [f"{cov.runs} runs, {cov.steps} steps"]
    lines.append(
        "node states:  "
        + ", ".join(f"{s.value}={cov.states[s.value]}" for s in NodeState if s is not NodeState.GONE)
    )
    lines.append("transitions:")
    lines += [
        f"  {s.value:>6} --{e.value:<16}--> {t.value:<6} {cov.transitions[f'{s.value}--{e.value}']}"
        for (s, e), t in TRANSITIONS.items()
    ]
    lines.append("in-flight tables (filled / drained):")
    lines += [f"  {t:<22} {cov.filled[t]:>6} / {cov.drained[t]}" for t in TABLES]
    lines.append("outcomes:")
    lines += [f"  {k:<40} {v}" for k, v in sorted(cov.outcomes.items())]
    missing = cov.missing()
    lines.append(
        "NOT REACHED: " + ", ".join(missing) if missing else "every state, transition and table event reached"
    )
    return "\n".join(lines)


@st.composite
def configs(draw: st.DrawFn, *, tp_sizes: tuple[int, ...] = (1, 2, 4)) -> HiCacheConfig:
    """Small configurations: a few pages per tier, so every eviction and prefetch path runs quickly."""
    page_size = draw(st.sampled_from((1, 1, 2, 4)))
    device_pages = draw(st.integers(4, 10))
    storage = draw(st.sampled_from(("file", "file", "file", None)))
    attention = draw(st.sampled_from(list(AttentionKind)))
    layouts = [(IOBackend.KERNEL, MemLayout.LAYER_FIRST), (IOBackend.KERNEL, MemLayout.PAGE_FIRST),
               (IOBackend.DIRECT, MemLayout.LAYER_FIRST), (IOBackend.DIRECT, MemLayout.PAGE_FIRST_DIRECT)]  # fmt: skip
    if attention is AttentionKind.MHA:
        layouts.append((IOBackend.KERNEL, MemLayout.PAGE_HEAD))
    io_backend, layout = draw(st.sampled_from(layouts))
    drawn = HiCacheConfig(
        page_size=page_size,
        hicache_io_backend=io_backend,
        hicache_mem_layout=layout,
        device_size=device_pages * page_size,
        hicache_ratio=draw(st.sampled_from((1.5, 2.0, 3.0))),
        hicache_write_policy=draw(st.sampled_from(list(WritePolicy))),
        hicache_storage_backend=storage,
        hicache_storage_prefetch_policy=draw(st.sampled_from(list(PrefetchPolicy))),
        radix_eviction_policy=draw(st.sampled_from(list(EvictionPolicy))),
        prefetch_threshold=draw(st.sampled_from((1, 2 * page_size, 4 * page_size))),
        prefetch_timeout_base=0.001,
        prefetch_timeout_per_ki_token=0.25,
        tp_size=draw(st.sampled_from(tp_sizes)),
        attention=attention,
        is_eagle=draw(st.sampled_from((False, False, False, True))),
        load_back_threshold=draw(st.sampled_from((1, 4, 10))),
        storage_batch_size=draw(st.sampled_from((1, 1, 2, 128))),
    )
    if not CONFIG_CONSTRAINTS:
        return drawn
    return dataclasses.replace(drawn, **CONFIG_CONSTRAINTS)  # type: ignore[arg-type]


CONFIG_CONSTRAINTS: dict[str, object] = {}
"""Options every drawn configuration must have (``refcache fuzz --tp 2 --attention MLA ...`` sets them)."""


Request = tuple[tuple[int, ...], str | None]
"""A request's tokens and namespace (``extra_key``)."""


class ModelMachine(RuleBasedStateMachine):
    """The model alone, every invariant after every step. Subclasses add rules (faults) or swap the
    system under test."""

    def __init__(self) -> None:
        super().__init__()
        self.model: HiCacheModel | None = None
        self.harness: Harness | None = None
        self.seqs: list[tuple[int, ...]] = []
        self.running: set[int] = set()
        self.prefetching: set[int] = set()
        self.next_rid = 0
        self.had: Counter[str] = Counter()
        self.tokens_of: dict[int, Request] = {}  # running requests' tokens and namespace
        self.finished: list[Request] = []  # recently finished requests' tokens and namespace

    # --- plumbing -----------------------------------------------------------------------------------------

    def make_systems(self, config: HiCacheConfig) -> dict[str, System]:
        """The systems under test; the first one is the model. Subclasses add the implementation."""
        assert self.model is not None
        return {"model": self.model}

    @initialize(config=configs())
    def setup(self, config: HiCacheConfig) -> None:
        note(f"config: {config.dumps()}")
        self.model = HiCacheModel(config)
        self.harness = Harness(
            self.model.config,
            self.make_systems(self.model.config),
            trace_name=type(self).__name__,
            on_step=self._on_step,
        )
        COVERAGE.runs += 1

    @property
    def m(self) -> HiCacheModel:
        assert self.model is not None
        return self.model

    def run(self, op: Op) -> Observation:
        """Apply one operation to every system through the harness, which compares them and checks every
        invariant (and the step invariants) right after it."""
        assert self.harness is not None
        outcome = self.harness.step(op)
        note(f"{op!r} -> {outcome!r}")
        if isinstance(outcome, UsageError):
            raise outcome
        assert not isinstance(outcome, Exception), outcome
        return outcome

    def _on_step(self, index: int, op: Op, outcome: object, snap: Snapshot) -> None:
        note(status_line(snap))
        COVERAGE.steps += 1
        reason = getattr(outcome, "reason", None)
        COVERAGE.outcomes[type(op).__name__ + ("" if reason is None else f":{reason}")] += 1
        self._record_coverage(snap)

    @invariant()
    def invariants_hold(self) -> None:
        if self.model is not None:
            violations = check_all(self.m.snapshot())
            assert not violations, "\n".join(str(v) for v in violations)

    def _record_coverage(self, snap: Snapshot) -> None:
        for node in snap.ranks[0].nodes:
            COVERAGE.states[node.state.value] += 1
        r = snap.ranks[0]
        sizes = {
            "ongoing_write_through": len(r.ongoing_write_through),
            "ongoing_load_back": len(r.ongoing_load_back),
            "ongoing_backup": len(r.ongoing_backup),
            "ongoing_prefetch": len(r.ongoing_prefetch),
        }
        for table, size in sizes.items():
            if size and not self.had[table]:
                COVERAGE.filled[table] += 1
            if not size and self.had[table]:
                COVERAGE.drained[table] += 1
            self.had[table] = size

    def teardown(self) -> None:
        if self.model is not None:
            for (s, e), n in self.m.transitions_taken().items():
                COVERAGE.transitions[f"{s.value}--{e.value}"] += n

    # --- token sequences ----------------------------------------------------------------------------------

    def _tokens(self, data: st.DataObject) -> tuple[int, ...]:
        ps = self.m.config.page_size
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

    # --- scheduler rules ----------------------------------------------------------------------------------

    # --- the one rule: a weighted choice of operation ----------------------------------------------------
    #
    # One rule instead of one per operation: Hypothesis' swarm testing would otherwise switch off, say,
    # background completion for a whole run, and the deep states (drained tables, reloads, timeouts)
    # would be starved. Simple operations come first so that shrinking prefers them.

    KINDS: tuple[str, ...] = (
        "check_hicache_events", "match", "evict", "evict_host", "advance_clock", "reset",
        "start_request", "finish_request", "cache_unfinished", "abort_request",
        "prefetch", "check_prefetch_progress", "abort_prefetch",
        "complete_io", "complete_everywhere", "invalid_operation_changes_nothing", "quiesce", "push_down",
        "prefetch_cycle", "host_pressure", "evict_and_rerun", "skewed_progress", "reload_under_pressure",
    )  # fmt: skip
    WEIGHTS: tuple[int, ...] = (4, 2, 2, 1, 2, 1, 5, 3, 1, 1, 3, 3, 1, 5, 4, 1, 1, 3, 2, 1, 1, 2, 3)

    @precondition(lambda self: self.model is not None)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        kinds = [k for k, w in zip(self.KINDS, self.WEIGHTS, strict=True) for _ in range(w)]
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind in ("finish_request", "cache_unfinished", "abort_request") and not self.running:
            kind = "start_request"
        if kind in ("check_prefetch_progress", "abort_prefetch") and not self.prefetching:
            kind = "prefetch"
        if kind == "start_request" and len(self.running) >= 3:
            kind = "finish_request"
        if kind == "prefetch" and len(self.prefetching) >= 3:
            kind = "check_prefetch_progress"
        getattr(self, kind)(data)

    def start_request(self, data: st.DataObject) -> None:
        rid = self.next_rid
        self.next_rid += 1
        tokens = self._tokens(data)
        namespace = self._namespace(data)
        obs = self.run(StartRequest(rid, tokens, namespace))
        if getattr(obs, "admitted", False):
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
        if getattr(obs, "admitted", False):
            self.prefetching.add(rid)

    def check_prefetch_progress(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.prefetching)), label="rid")
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
        obs = self.run(Reset())
        if getattr(obs, "flushed", False):
            self.seqs.clear()

    # --- background rules ---------------------------------------------------------------------------------

    def complete_io(self, data: st.DataObject) -> None:
        queue = data.draw(st.sampled_from(list(IOQueue)), label="queue")
        count = data.draw(st.integers(1, 3), label="count")
        rank = data.draw(st.integers(0, self.m.config.tp_size - 1), label="rank")
        self.run(CompleteIO(queue, rank, count))

    def complete_everywhere(self, data: st.DataObject) -> None:
        """All ranks finish a queue together: keeps drains likely despite per-rank divergence."""
        queue = data.draw(st.sampled_from(list(IOQueue)), label="queue")
        for rank in range(self.m.config.tp_size):
            self.run(CompleteIO(queue, rank, 8))

    def quiesce(self, data: st.DataObject) -> None:
        """Finish every request, let every queue on every rank run dry and retire everything: the state
        IDLE-DRAINED speaks about. Then reset, sometimes."""
        for rid in sorted(self.running):
            self.run(FinishRequest(rid))
        self.running.clear()
        for round_ in range(8):
            for queue in IOQueue:
                for rank in range(self.m.config.tp_size):
                    self.run(CompleteIO(queue, rank, 64))
            self.run(CheckHicacheEvents())
            for rid in sorted(self.prefetching):
                obs = self.run(AbortPrefetch(rid) if round_ >= 4 else CheckPrefetchProgress(rid))
                if not isinstance(obs, ProgressResult) or obs.done:
                    self.prefetching.discard(rid)
        if data.draw(st.booleans(), label="reset"):
            self.reset(data)

    def push_down(
        self, data: st.DataObject, before_prefetch: Callable[[st.DataObject], None] | None = None
    ) -> None:
        """Quiesce, then evict everything from L1 and L2, so later prefetches find their pages only in L3
        (a request runs first if none has finished yet); ``before_prefetch`` runs between the evictions
        and the prefetch."""
        if not self.finished and len(self.running) < 3:
            self._run_request(self._tokens(data), self._namespace(data))
        self.quiesce(data)
        self.run(Evict(10_000))
        self._finish_backups()
        self.run(EvictHost(10_000))
        if before_prefetch is not None:
            before_prefetch(data)
        if self.finished:
            self.prefetch_cycle(data, data.draw(st.sampled_from(self.finished), label="finished"))

    def _finish_backups(self) -> None:
        """Let the copies an eviction started (write-back: L1→L2, then L2→L3) finish on every rank."""
        for queue in (IOQueue.WRITE, IOQueue.BACKUP):
            for rank in range(self.m.config.tp_size):
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
        obs = self.run(PrefetchFromStorage(rid, tokens, namespace))
        if not getattr(obs, "admitted", False):
            return
        for rank in range(self.m.config.tp_size):
            self.run(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 64))
        ps, bigram = self.m.config.page_size, int(self.m.config.is_eagle)
        key_len = len(tokens) - bigram  # EAGLE keys are bigrams: one element fewer than tokens
        recompute = key_len >= 2 * ps and data.draw(st.booleans(), label="recompute")
        if recompute:
            # Meanwhile a request computes a prefix of the same tokens: its device-only node sits on the
            # prefetched path when the fetched pages (all of them, below) are inserted (sglang.md §9 #6).
            cut = data.draw(st.integers(1, key_len // ps - 1), label="recompute_pages") * ps
            self._run_request(tokens[: cut + bigram], namespace)
        for rank in range(self.m.config.tp_size):
            # Ranks read different numbers of batches: the MIN of completed tokens decides what is inserted,
            # and the unread tails are released later by each rank's I/O helper.
            reads = 64 if recompute else data.draw(st.sampled_from((64, 1, 64, 0, 2)), label="reads")
            if reads:
                self.run(CompleteIO(IOQueue.PREFETCH_IO, rank, reads))
        progress = self.run(CheckPrefetchProgress(rid))
        if not (isinstance(progress, ProgressResult) and progress.done):
            self.prefetching.add(rid)

    def host_pressure(self, data: st.DataObject) -> None:
        """Fill L1 with fresh tokens and evict it, three times, without letting L3 backups finish: host
        slots stay pinned by pending backups, so write-back eviction runs out of host memory
        (sglang.md §9 #7)."""
        size = self.m.config.device_size
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
        cfg = self.m.config
        size = cfg.device_size
        request: Request
        if bool(self.finished) and data.draw(st.booleans(), label="earlier"):
            request = data.draw(st.sampled_from(self.finished), label="again")
        else:  # a fresh one, long enough to be loaded back (load_back_threshold)
            request = (self._fresh_request(max(cfg.load_back_threshold, cfg.page_size) + cfg.is_eagle), None)
        self.run(Evict(10_000))
        self._finish_backups()
        for _ in range(6):
            if len(self.m.snapshot().ranks[0].host.free) < size:
                break
            self._fresh_request(size // 2 + 1)
            self.run(Evict(10_000))
        self._fresh_request(size - cfg.page_size)
        self._run_request(*request, load=True)

    def _fresh_request(self, length: int) -> tuple[int, ...]:
        """Run a request of ``length`` tokens no earlier request shares; returns its tokens."""
        base = 1000 + 100 * self.next_rid
        tokens = tuple(range(base, base + length))
        self._run_request(tokens, None)
        return tokens

    def _run_request(self, tokens: tuple[int, ...], namespace: str | None, load: bool = False) -> None:
        """Start and finish one request; with ``load``, let a load back finish everywhere in between."""
        rid = self.next_rid
        self.next_rid += 1
        obs = self.run(StartRequest(rid, tokens, namespace))
        loaded: int = getattr(obs, "loaded", 0)
        if load and loaded:
            for rank in range(self.m.config.tp_size):
                self.run(CompleteIO(IOQueue.LOAD, rank, 8))
            self.run(CheckHicacheEvents())
        if getattr(obs, "admitted", False):
            self.run(FinishRequest(rid))
            self.finished = [*self.finished[-7:], (tokens, namespace)]

    def skewed_progress(self, data: st.DataObject) -> None:
        """One rank runs ahead: after the writes finish everywhere, one queue finishes on one rank only and
        the scheduler checks events and a prefetch's progress. A rank-local fact (an ack, a read, a
        release) now differs between ranks and only the all-reduces keep them in step; a rank that skips
        one because its own tables are empty would hang the others (sglang.md §9 #1, #2)."""
        for rank in range(self.m.config.tp_size):
            self.run(CompleteIO(IOQueue.WRITE, rank, 64))
        self.run(CheckHicacheEvents())
        queue = data.draw(st.sampled_from(list(IOQueue)), label="queue")
        rank = data.draw(st.integers(0, self.m.config.tp_size - 1), label="rank")
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
            self._run_request(*data.draw(st.sampled_from(self.finished), label="again"), load=True)

    def advance_clock(self, data: st.DataObject) -> None:
        us = data.draw(st.sampled_from((100, 1_000, 50_000)), label="us")
        self.run(AdvanceClock(us))

    def invalid_operation_changes_nothing(self, data: st.DataObject) -> None:
        """A bad operation raises ``UsageError`` everywhere and leaves every snapshot exactly as it was."""
        assert self.harness is not None
        before = {name: system.snapshot() for name, system in self.harness.systems.items()}
        bad: list[Op] = [
            FinishRequest(10_000),
            Evict(-1),
            CompleteIO(IOQueue.WRITE, self.m.config.tp_size, 1),
            AdvanceClock(-5),
            StartRequest(self.next_rid, ()),
        ]
        op = data.draw(st.sampled_from(bad), label="bad_op")
        outcome = self.harness.step(op)
        assert isinstance(outcome, UsageError), f"{op!r} was accepted: {outcome!r}"
        for name, system in self.harness.systems.items():
            assert system.snapshot() == before[name], f"{op!r} raised on {name} but changed the state"


class FaultyModelMachine(ModelMachine):
    """``ModelMachine`` plus storage faults: after a fault a prefetch may miss, never insert wrong pages
    (the HASH-CHAIN and conservation invariants still hold)."""

    KINDS = (*ModelMachine.KINDS, "storage_fault", "fault_under_prefetch")
    WEIGHTS = (*ModelMachine.WEIGHTS, 2, 1)

    def fault_under_prefetch(self, data: st.DataObject) -> None:
        """``push_down`` with a fault between the evictions and the prefetch: the prefetch of a finished
        request reads its pages from L3 right after one of them went bad."""
        self.push_down(data, before_prefetch=self.storage_fault)

    def storage_fault(self, data: st.DataObject) -> None:
        if not self.m.config.enable_storage:
            return
        kind = data.draw(st.sampled_from(list(FaultKind)), label="fault")
        index = data.draw(st.integers(0, 20), label="index")
        rank = data.draw(st.integers(0, self.m.config.tp_size - 1), label="rank")
        self.run(StorageFault(kind, rank, index))
