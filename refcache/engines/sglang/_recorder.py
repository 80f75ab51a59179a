"""The recorder's machinery: ``Recorder`` (what was observed, the wrapping) and ``_Calls`` (the wrapped class's
methods). ``refcache.engines.sglang.record`` is the public module: ``record`` and the theory of operation (its
docstring's table of observed calls and operations); the two-rank worker (``_tp``) builds a ``Recorder`` of
its own rank from here. The admission stages are data: ``refcache.engines.admission``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

from refcache.config import PROFILES, HiCacheConfig
from refcache.engines.admission import TRANSITIONS, AdmissionEvent, AdmissionStage, next_stage
from refcache.engines.sglang import _compat, versions
from refcache.engines.sglang._adapter import SGLangSystem
from refcache.errors import RecordingError, UnsupportedError
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
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
)
from refcache.hicache.recording import Recording, write_recording
from refcache.hicache.snapshot import Snapshot, SnapshotInterner

__all__ = ["SOURCE", "Recorder"]

SOURCE: Final = {"engine": "sglang", "version": "0.5.20"}
"""A recording's ``source`` on 0.5.20; on another release its ``version`` is that release."""
"""The header's ``source`` of a trace recorded here."""

_ABSENT: Final = object()  # an attribute the recorder hooked was not in the instance's __dict__


@dataclass
class _Admission:
    """A ``match_prefix`` and what followed it, until it is known which operation it was."""

    tokens: tuple[int, ...]
    extra_key: str | None
    match: Any
    req: Any
    stage: AdmissionStage = AdmissionStage.MATCHED  # changed only through next_stage (admission.TRANSITIONS)
    loaded: int = 0
    node: Any = None  # the node locked for the request (LOCK)
    snapshot: Snapshot | None = None  # read right after the match (snapshots=True): a MatchPrefix's
    pinned: list[Any] = field(
        default_factory=list
    )  # UnifiedRadixCache: the nodes of the pins held (TEMP_LOCK)
    pins_done: bool = False  # UnifiedRadixCache: a pin was released (the next lock is the request's)


@dataclass
class _Release:
    """UnifiedRadixCache's ``release_kv_cache(req, ...)``: ``claim_kv_row(req)`` seen, ``on_release`` not yet."""

    req: Any
    protected: int  # ``req.kv.cache_protected_len`` at the claim
    seen: list[int] = field(default_factory=list)  # the prefix_len of each insert of its checkpoint


@dataclass
class _Line:
    op: Op
    observed: Observation | None
    snapshot: Snapshot | None = None
    admission: _Admission | None = None  # a StartRequest whose rid is not known yet
    admitted: bool = False


@dataclass
class _Step:
    """One storage thread step, and the item it put where the scheduler takes it."""

    queue: IOQueue
    item: Any


@dataclass
class Recorder:
    """What ``record`` observed so far (``recording()``), and the wrapping (``close``)."""

    cache: Any
    config: HiCacheConfig
    system: SGLangSystem | None = None
    snapshots: bool = False
    lines: list[_Line] = field(default_factory=list)
    _depth: int = 0
    _admission: _Admission | None = None
    _finished_acks: set[int] = field(default_factory=set)
    _clock_us: int = 0
    _rids: dict[str, int] = field(default_factory=dict)
    _unresolved: list[_Line] = field(default_factory=list)
    _original_class: type | None = None
    unified: bool = False  # the cache is a UnifiedRadixCache (install): its entry points are _UnifiedCalls'
    # a release's or checkpoint's line, written once the backups its batch queued are flushed (UnifiedRadixCache)
    _pending: list[tuple[Op, Observation]] = field(default_factory=list)
    _release: _Release | None = None  # release_kv_cache between its claim_kv_row and its on_release
    # --- storage (only the hooks, on the storage threads, and the scheduler's calls touch these) ---
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _steps: list[_Step] = field(default_factory=list)  # steps not written yet, in the order they happened
    _taken: list[Any] = field(default_factory=list)  # what the current call got from the storage queues
    _read: bool = False  # (I/O thread) page_get_func returned; its batch ack is the next one it puts
    _read_acks: set[int] = field(default_factory=set)  # id() of batch acks of a read, until forwarded
    _revoked: int = 0  # _revoke_pending_prefetch calls on a live entry since check_hicache_events began
    _drained: dict[str, int] = field(default_factory=dict)  # backup acks / host releases the drain took
    _hooked: list[tuple[Any, str, Any]] = field(default_factory=list)  # (object, attribute, previous)
    # the installed release's differences (``_compat``), read by ``install``
    _rows: _compat.Compat | None = None
    _placed: versions.Placement | None = None  # the installed SGLang's placement: its version, its row
    # the snapshots share what they have in common (a recording of the real trace held 12 GB without it)
    _interner: SnapshotInterner = field(default_factory=SnapshotInterner)

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _handle_rid(self, handle: Any) -> str:
        """The request id a prefetch call names: the handle's (up to 0.5.19 the handle is the id string,
        ``_compat`` "plain_request_ids")."""
        assert self._rows is not None
        return str(handle) if self._rows.has("plain_request_ids") else str(handle.rid)

    def _prefetch_key(self, handle: Any) -> Any:
        """How the cache keys a prefetch (``ongoing_prefetch``, ``prefetch_loaded_tokens_by_reqid``): the request id
        (HiRadixCache), the handle itself (UnifiedRadixCache, a ``CacheRequestHandle`` or up to 0.5.19 the id)."""
        return handle if self.unified else self._handle_rid(handle)

    def _handle(self, handle: Any) -> int:
        return self._rid_of(self._handle_rid(handle))

    def _rid(self, req: Any) -> int:
        return self._rid_of(str(req.rid))

    def _rid_of(self, key: str) -> int:
        if key not in self._rids:
            self._rids[key] = int(key) if key.isdecimal() else 1_000_000 + len(self._rids)
        return self._rids[key]

    def _read_snapshot(self) -> Snapshot | None:
        if not (self.snapshots and self.system is not None):
            return None
        from refcache.engines.sglang._snapshot import read_snapshot

        if self.unified:
            from refcache.engines.sglang._unified import UnifiedSGLangSystem
            from refcache.engines.sglang._unified import read_snapshot as read_unified

            assert isinstance(self.system, UnifiedSGLangSystem)
            self.system._settle()
            return self._interner(read_unified(self.system))
        # Under the adapter's gate the ungated storage threads may still be answering the call (the I/O
        # thread taking a buffered operation, the sync thread forwarding acks): read once they are parked,
        # as the adapter's own snapshot is.
        self.system._settle()
        return self._interner(read_snapshot(self.system))

    def _emit(
        self,
        op: Op,
        observed: Observation | None,
        admission: _Admission | None = None,
        *,
        snapshot: bool = True,
        taken: Snapshot | None = None,
    ) -> _Line:
        """Append a line; its snapshot is ``taken`` if given, else read now (``snapshot``), else none."""
        snap = taken if taken is not None else self._read_snapshot() if snapshot else None
        line = _Line(op, observed, snap, admission)
        self.lines.append(line)
        return line

    def _background(self) -> None:
        """Emit what happened since the last call: the clock, the acks that finished, the storage steps.
        Only the last of these lines carries a snapshot."""
        pending: list[tuple[Op, Observation]] = []
        if self.system is not None and self.system.clock_us != self._clock_us:
            pending.append((AdvanceClock(self.system.clock_us - self._clock_us), Done()))
            self._clock_us = self.system.clock_us
        cc = self.cache.cache_controller
        for queue, acks in ((IOQueue.WRITE, cc.ack_write_queue), (IOQueue.LOAD, cc.ack_load_queue)):
            done = [id(a) for a in acks if a.finish_event.query() and id(a) not in self._finished_acks]
            if not done:
                continue
            unfinished_before = [id(a) for a in acks if id(a) not in self._finished_acks]
            if unfinished_before[: len(done)] != done:
                raise RecordingError(
                    f"{queue.value} acks finished out of order: CompleteIO completes the oldest ones"
                )
            self._finished_acks.update(done)
            pending.append((CompleteIO(queue, 0, len(done)), IOResult(len(done))))
        with self._lock:
            steps, self._steps = self._steps, []
        pending += _merged(steps)
        for i, (op, observed) in enumerate(pending):
            self._emit(op, observed, snapshot=i == len(pending) - 1)

    def _steps_taken(self) -> None:
        """Steps that happened during the call whose result the call took: written before its operation,
        with every step before them (they happened earlier)."""
        taken, self._taken = self._taken, []
        if not taken:
            return
        with self._lock:
            ids = {id(item) for item in taken}
            last = max((i for i, s in enumerate(self._steps) if id(s.item) in ids), default=-1)
            steps, self._steps = self._steps[: last + 1], self._steps[last + 1 :]
        for op, observed in _merged(steps):
            self._emit(op, observed, snapshot=False)

    def _step(self, queue: IOQueue, item: Any, put: Callable[[], None]) -> None:
        """(A storage thread) note a step and make its result visible, as one."""
        with self._lock:
            self._steps.append(_Step(queue, item))
            put()

    def _settle(self) -> None:
        """Acks finished during a call belong to it."""
        cc = self.cache.cache_controller
        live = {id(a) for a in (*cc.ack_write_queue, *cc.ack_load_queue)}
        self._finished_acks = {
            id(a) for a in (*cc.ack_write_queue, *cc.ack_load_queue) if a.finish_event.query()
        } | (self._finished_acks & live)

    def _stage(self) -> AdmissionStage:
        return AdmissionStage.NONE if self._admission is None else self._admission.stage

    def _next(self, event: AdmissionEvent, call: str) -> AdmissionStage:
        """The open admission's stage after ``event`` (``admission.next_stage``: raises ``RecordingError``,
        naming ``call``, for a sequence the alphabet cannot express)."""
        return next_stage(self._stage(), event, call)

    def _takes(self, event: AdmissionEvent) -> bool:
        """Whether ``event`` is a step of the open admission (else the call is an operation of its own)."""
        return (self._stage(), event) in TRANSITIONS

    def _close_admission(self) -> None:
        """The call sequence since the last ``match_prefix`` ends here (``END``): emit what it was
        (``admission.ENDS``). An admission that cannot end here is dropped before ``RecordingError`` is
        raised, so the recording so far can still be written."""
        pending, self._pending = self._pending, []
        for op, observed in pending:
            self._emit(op, observed)
        a, self._admission = self._admission, None
        if a is None:
            return
        next_stage(
            a.stage,
            AdmissionEvent.END,
            f"an admission stopped after {a.stage.value.replace('_', ' ')} (match, load back, lock expected)",
        )
        if a.stage is AdmissionStage.MATCHED:
            m = a.match
            deepest = m.last_host_node if m.host_hit_length > 0 else m.last_device_node
            observed = MatchResult(
                self._device_len(m),
                m.host_hit_length,
                self._depth_of(deepest),
                self._depth_of(m.last_host_node),
            )
            self._emit(MatchPrefix(a.tokens, a.extra_key), observed, taken=a.snapshot)
            return
        hit = self._device_len(a.match)
        admitted = a.stage is AdmissionStage.LOCKED  # else REFUSED: its lock was released
        computed = len(a.tokens) - hit - a.loaded if admitted else 0
        observed_start = StartResult(admitted, hit, a.loaded, computed)
        if a.req is not None or not admitted:
            rid = self._rid(a.req) if a.req is not None else 2_000_000 + len(self.lines)
            prompt = None if a.req is None else self._prompt_len(a.req, a.tokens)
            self._emit(StartRequest(rid, a.tokens, a.extra_key, prompt), observed_start)
        else:
            line = self._emit(StartRequest(-1, a.tokens, a.extra_key), observed_start, a)
            line.admitted = True
            self._unresolved.append(line)

    @staticmethod
    def _prompt_len(req: Any, tokens: tuple[int, ...]) -> int | None:
        n = len(req.origin_input_ids)
        return None if n >= len(tokens) else n

    def _resolve(self, req: Any) -> int:
        """The rid of ``req``; the first unresolved admission that locked its node with its tokens gets it."""
        rid = self._rid(req)
        tokens = tuple(int(t) for t in req.get_fill_ids())
        for line in self._unresolved:
            a = line.admission
            assert a is not None
            if a.node is req.last_node and a.tokens == tokens:
                assert isinstance(line.op, StartRequest)
                line.op = StartRequest(rid, a.tokens, a.extra_key, self._prompt_len(req, a.tokens))
                line.admission = None
                self._unresolved.remove(line)
                break
        return rid

    def _device_len(self, m: Any) -> int:
        """A match's device-resident length: its ``device_indices`` (UnifiedRadixCache from 0.5.22:
        ``device_prefix_len``, ``_compat`` "match_device_indices")."""
        if self.unified and not self._compat().has("match_device_indices"):
            return int(m.device_prefix_len)
        return len(m.device_indices)

    def _loaded_len(self, result: Any) -> int:
        """What ``init_load_back`` loaded: its slots (UnifiedRadixCache from 0.5.22: their number)."""
        if result is None:
            return 0
        if self.unified and not self._compat().has("match_device_indices"):
            return int(result[0])
        return len(result[0])

    def _compat(self) -> _compat.Compat:
        assert self._rows is not None, "install() reads the installed release's rows"
        return self._rows

    def _key_len(self, tokens: tuple[int, ...]) -> int:
        n = len(tokens) - (1 if self.config.is_eagle else 0)
        return n - n % self.config.page_size

    def _depth_of(self, node: Any) -> int:
        if not hasattr(node, "parent"):  # UnifiedRadixCache's matches name nodes by NodeId
            node = self.cache.tree_core.node_by_id(node)
        n = 0
        while node is not None and node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n

    # --- the wrapped calls --------------------------------------------------------------------------------

    def _call(
        self,
        fn: Callable[[], Any],
        before: Callable[[], None],
        after: Callable[[Any], object],
        *,
        continues: bool = False,
    ) -> Any:
        """A top-level call: what happened before it (an admission it does not continue, then the
        background), ``before``, the call, what it took of the storage steps, ``after``."""
        if self._depth:
            return fn()
        if not continues:
            self._close_admission()
        self._background()
        before()
        self._taken = []
        self._depth += 1
        try:
            result = fn()
        finally:
            self._depth -= 1
        self._steps_taken()
        self._settle()
        after(result)
        return result

    def _inside(self, fn: Callable[[], Any]) -> Any:
        """A call that is part of an operation already under way (a release between its claim and its end, a
        batch's flush): run as a nested call (SGLang's own calls inside it are not interpreted), nothing
        written before it; the acks it finished belong to it."""
        self._depth += 1
        try:
            return fn()
        finally:
            self._depth -= 1
            if not self._depth:
                self._settle()

    def recording(self) -> Recording:
        """What was observed so far (pending admissions emitted, unresolved rids given fresh numbers)."""
        if self._depth == 0:
            self._close_admission()
            self._background()
        for line in self._unresolved:
            assert isinstance(line.op, StartRequest) and line.admission is not None
            line.op = StartRequest(3_000_000 + self.lines.index(line), line.op.tokens, line.op.extra_key)
        self._unresolved.clear()
        # the installed release's profile and number (a recording of 0.5.18 replays under 0.5.18's decisions)
        assert self._placed is not None
        profile = versions.installed_unified_profile() if self.unified else self._placed.profile
        config = self.config.with_fidelity(PROFILES[profile])
        return Recording(
            config,
            [line.op for line in self.lines],
            [line.observed for line in self.lines],
            [line.snapshot for line in self.lines],
            self._source(self._placed),
        )

    @staticmethod
    def _source(placed: versions.Placement) -> dict[str, str]:
        """The header's ``source``: the exact installed version, and where it is not a release's own row that
        drives it (a post release, main), the placement in words (``versions.Placement``)."""
        out = {**SOURCE, "version": placed.installed}
        if placed.kind != "release" or placed.source is not None:
            out["placed"] = str(placed)
        return out

    def flush(self) -> int:
        """Emit what is pending after an operation (an admission, finished acks, the clock) and return the
        lines so far: where a driver that knows its operations' ends marks one (the rank workers, ``_tp``)."""
        if self._depth == 0:
            self._close_admission()
            self._background()
        return len(self.lines)

    def write(self, path: str | os.PathLike[str]) -> Recording:
        rec = self.recording()
        write_recording(path, rec)
        return rec

    def install(self) -> None:
        self._placed = versions.installed()
        self._rows = _compat.Compat(self._placed.rows)
        cache = self.cache
        self.unified = any(c.__name__ == "UnifiedRadixCache" for c in type(cache).__mro__)
        if self._rows.has("init_load_back_positional"):
            raise UnsupportedError(
                f"recording SGLang {self._placed.installed} is not done: up to 0.5.9 the scheduler's calls take "
                "their arguments positionally (init_load_back(last_node, host_hit_length), _compat "
                "'init_load_back_positional'; up to 0.5.8 insert(key, value), 'insert_positional'; up to 0.5.7 "
                "match_prefix(key), 'match_prefix_by_key'), which the recorder's hooks do not read; "
                "record SGLang 0.5.10 or later (the adapter drives these releases: refcache fuzz, replay)"
            )
        if getattr(cache, "enable_storage", False) and self._rows.has("prefetch_allocated_at_admission"):
            raise UnsupportedError(
                "recording L3 up to 0.5.15 (host memory allocated at admission, _compat "
                "'prefetch_allocated_at_admission') is not done: the prefetch thread's steps there are a put on "
                "prefetch_buffer (rebuilt at every reset) or prefetch_revoke_queue, which the recorder does not hook"
            )
        base = type(cache)
        self._original_class = base
        self._finished_acks = set()
        self._settle()
        if self.system is not None:
            self._clock_us = self.system.clock_us
        if getattr(cache, "enable_storage", False):
            self._hook_storage()
        if self.system is not None:
            self._hook(self.system, "apply", self._flushing)
        calls = _UnifiedCalls(self, base) if self.unified else _Calls(self, base)
        cache.__class__ = type(f"Recorded{base.__name__}", (base,), calls.overrides())

    def _flushing(self, apply: Callable[[Op], Observation]) -> Callable[[Op], Observation]:
        """Under the adapter an operation is a whole scheduler step: what it did is written when it
        returns, not at the next call, so a completion's snapshot is the state right after it (the next
        call may be a finish, whose request the adapter forgets before SGLang sees the call)."""

        def hooked(op: Op) -> Observation:
            observed = apply(op)
            if self._depth == 0:
                self._close_admission()
                self._background()
            return observed

        return hooked

    def _hook(self, obj: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Set ``obj.name`` (an instance attribute) to ``make(current value)``; ``close`` puts it back."""
        self._hooked.append((obj, name, obj.__dict__.get(name, _ABSENT)))
        setattr(obj, name, make(getattr(obj, name)))

    def _hook_storage(self) -> None:
        """The storage threads' hand-outs (module docstring, 'The storage threads' steps'), what the
        scheduler's calls take from the storage queues, and the prefetches a drain revokes."""
        cc, cache = self.cache.cache_controller, self.cache

        def step_put(queue: IOQueue, is_step: Callable[[Any], bool]) -> Callable[[Any], Any]:
            def make(put: Any) -> Any:
                def hooked(item: Any, block: bool = True, timeout: float | None = None) -> None:
                    if item is not None and is_step(item):
                        self._step(queue, item, lambda: put(item, block, timeout))
                    else:
                        put(item, block, timeout)

                return hooked

            return make

        def taken(count: str | None) -> Callable[[Any], Any]:
            def make(get: Any) -> Any:
                def hooked(block: bool = True, timeout: float | None = None) -> Any:
                    item = get(block, timeout)
                    self._taken.append(item)
                    if count is not None:
                        self._drained[count] = self._drained.get(count, 0) + 1
                    return item

                return hooked

            return make

        def read(page_get: Any) -> Any:
            def hooked(*args: Any, **kwargs: Any) -> Any:
                result = page_get(*args, **kwargs)
                self._read = True
                return result

            return hooked

        def batch_ack(put: Any) -> Any:
            def hooked(item: Any, block: bool = True, timeout: float | None = None) -> None:
                if self._read and item is not None and item.completed_tokens is not None:
                    self._read = False
                    self._read_acks.add(id(item))
                put(item, block, timeout)

            return hooked

        def forwarded(ack: Any) -> bool:
            if id(ack) in self._read_acks:
                self._read_acks.discard(id(ack))
                return True
            return False

        def revoke(inner: Any) -> Any:
            def hooked(req_id: str) -> None:
                if req_id in cache.ongoing_prefetch:
                    self._revoked += 1
                inner(req_id)

            return hooked

        def read_step(page_get: Any) -> Any:
            # Up to 0.5.18 a read shows in the operation as soon as it returns: each call is a step, noted when
            # it returns (not under the lock: under the adapter the call first waits for its token).
            def hooked(operation: Any, *args: Any, **kwargs: Any) -> Any:
                result = page_get(operation, *args, **kwargs)
                self._step(IOQueue.PREFETCH_IO, operation, lambda: None)
                return result

            return hooked

        compat = self._rows
        assert compat is not None
        self._hook(cc.prefetch_hit_queue, "put", step_put(IOQueue.PREFETCH_QUERY, lambda _: True))
        self._hook(cc.ack_backup_queue, "put", step_put(IOQueue.BACKUP, lambda _: True))
        if compat.has("prefetch_revoke_queue"):  # up to 0.5.17 a query below the threshold is revoked here
            self._hook(cc.prefetch_revoke_queue, "put", step_put(IOQueue.PREFETCH_QUERY, lambda _: True))
            self._hook(cc.prefetch_revoke_queue, "get", taken(None))
        if compat.has("prefetch_progress_in_operation"):  # up to 0.5.18: no acks
            self._hook(cc, "page_get_func", read_step)
        else:
            self._hook(cc.ack_prefetch_queue, "put", step_put(IOQueue.PREFETCH_IO, forwarded))
            self._hook(cc.prefetch_sync_queue, "put", batch_ack)
            self._hook(cc, "page_get_func", read)
            self._hook(cc.ack_prefetch_queue, "get", taken(None))
        self._hook(cc.prefetch_hit_queue, "get", taken(None))
        self._hook(cc.ack_backup_queue, "get", taken("backups"))
        self._hook(cc.host_mem_release_queue, "get", taken("host_releases"))
        # UnifiedRadixCache's is public, keyed by the request handle
        self._hook(cache, "revoke_pending_prefetch" if self.unified else "_revoke_pending_prefetch", revoke)

    def close(self) -> None:
        if self._original_class is not None:
            self.cache.__class__ = self._original_class
            self._original_class = None
        while self._hooked:
            obj, name, previous = self._hooked.pop()
            if previous is _ABSENT:
                delattr(obj, name)
            else:
                setattr(obj, name, previous)


def _merged(steps: list[_Step]) -> list[tuple[Op, Observation]]:
    """Consecutive steps of one queue as one ``CompleteIO``."""
    out: list[tuple[Op, Observation]] = []
    count = 0
    for i, step in enumerate(steps):
        count += 1
        if i + 1 == len(steps) or steps[i + 1].queue is not step.queue:
            out.append((CompleteIO(step.queue, 0, count), IOResult(count)))
            count = 0
    return out


class _Calls:
    """The recorded class's methods (``overrides``): each calls ``base``'s method (looked up at call time, so a
    patch of SGLang's class still runs) through ``Recorder._call`` and tells the recorder what it did. A
    method that bears on an admission takes its step through ``admission.TRANSITIONS``."""

    NAMES: ClassVar[tuple[str, ...]] = (
        "match_prefix",
        "inc_lock_ref",
        "dec_lock_ref",
        "init_load_back",
        "evict",
        "evict_for_alloc",
        "evict_host",
        "ready_to_load_host_cache",
        "cache_finished_req",
        "cache_unfinished_req",
        "check_hicache_events",
        "reset",
        "prefetch_from_storage",
        "check_prefetch_progress",
        "release_aborted_request",
    )

    def __init__(self, rec: Recorder, base: Any) -> None:
        self.rec = rec
        self.base = base

    def overrides(self) -> dict[str, Callable[..., Any]]:
        """The subclass body: per name in ``NAMES`` a function whose ``self`` is the cache."""
        return {name: _forward(getattr(self, name)) for name in self.NAMES if hasattr(self.base, name)}

    def match_prefix(self, cache: Any, params: Any) -> Any:
        rec = self.rec

        def after(result: Any) -> None:
            key = params.key
            rec._admission = _Admission(
                tuple(int(t) for t in key.token_ids),
                key.extra_key,
                result,
                getattr(params, "req", None),
                rec._next(AdmissionEvent.MATCH, "match_prefix inside an admission"),
                snapshot=rec._read_snapshot(),
            )

        return rec._call(lambda: self.base.match_prefix(cache, params), _nothing, after)

    @staticmethod
    def _same(node: Any, other: Any) -> bool:
        """Whether two node handles name one node (HiRadixCache's are the nodes)."""
        return node is other

    def _locked(self, node: Any, call: str) -> None:
        """(Before a lock of ``node``) its step of the open admission."""
        rec = self.rec
        a = rec._admission
        temporary = a is not None and (  # the lock around a load back: the match's last device node, after a
            (  # host hit; from 0.5.22 also the load back's best match node, inside it (UnifiedRadixCache)
                a.stage is AdmissionStage.MATCHED
                and a.match.host_hit_length > 0
                and self._same(node, a.match.last_device_node)
            )
            or (
                a.stage is AdmissionStage.TEMP_LOCKED
                and self._same(node, getattr(a.match, "best_match_node", None))
            )
        )
        event = AdmissionEvent.TEMP_LOCK if temporary else AdmissionEvent.LOCK
        stage = rec._next(event, f"{call} outside an admission (match, load back, lock)")
        assert a is not None  # no admission (NONE) takes a lock
        a.stage = stage
        if event is AdmissionEvent.LOCK:
            a.node = node

    def _unlocked(self, node: Any, call: str) -> None:
        """(Before an unlock of ``node``) its step of the open admission."""
        rec = self.rec
        a = rec._admission
        own = (
            a is not None
            and a.stage in (AdmissionStage.LOCKED, AdmissionStage.REFUSED)
            and self._same(node, a.node)
        )
        stage = rec._next(
            AdmissionEvent.REFUSE if own else AdmissionEvent.UNLOCK,
            f"{call} outside an admission: the alphabet has no bare unlock",
        )
        assert a is not None  # no admission (NONE) takes an unlock
        a.stage = stage

    def inc_lock_ref(self, cache: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        return self.rec._call(
            lambda: self.base.inc_lock_ref(cache, node, *args, **kwargs),
            lambda: self._locked(node, "inc_lock_ref"),
            _nothing,
            continues=True,
        )

    def dec_lock_ref(self, cache: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        return self.rec._call(
            lambda: self.base.dec_lock_ref(cache, node, *args, **kwargs),
            lambda: self._unlocked(node, "dec_lock_ref"),
            _nothing,
            continues=True,
        )

    def init_load_back(self, cache: Any, params: Any) -> Any:
        rec = self.rec
        loaded: list[AdmissionStage] = []  # the stage once it returns (checked before SGLang runs it)

        def before() -> None:
            loaded.append(
                rec._next(AdmissionEvent.LOAD_BACK, "init_load_back without the match_prefix of its request")
            )
            a = rec._admission
            assert a is not None
            if getattr(params, "req", None) is not None:
                a.req = params.req

        def after(result: Any) -> None:
            a = rec._admission
            assert a is not None
            a.stage = loaded[0]
            a.loaded = rec._loaded_len(result)

        return rec._call(lambda: self.base.init_load_back(cache, params), before, after, continues=True)

    def _evict_like(self, name: str, cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        """``evict`` / ``evict_for_alloc``: room for the request whose node is locked (a step of its
        admission), else an ``Evict`` of its own."""
        rec = self.rec
        in_admission = not rec._depth and rec._takes(AdmissionEvent.EVICT)

        def after(result: Any) -> None:
            if not in_admission:
                rec._emit(Evict(int(params.num_tokens)), EvictResult(int(result.num_tokens_evicted)))

        return rec._call(
            lambda: getattr(self.base, name)(cache, params, *args, **kwargs),
            _nothing,
            after,
            continues=in_admission,
        )

    def evict(self, cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        return self._evict_like("evict", cache, params, *args, **kwargs)

    def evict_for_alloc(self, cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        return self._evict_like("evict_for_alloc", cache, params, *args, **kwargs)

    def evict_host(self, cache: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec
        pool = cache.token_to_kv_pool_host
        free: list[int] = []

        def before() -> None:
            free.append(int(pool.available_size()))

        def after(_: Any) -> None:
            rec._emit(EvictHost(int(num_tokens)), EvictHostResult(int(pool.available_size()) - free[0]))

        return rec._call(lambda: self.base.evict_host(cache, num_tokens, *args, **kwargs), before, after)

    def ready_to_load_host_cache(self, cache: Any) -> Any:
        rec = self.rec

        def after(_: Any) -> None:
            # READY ends an admission that locked its node (to NONE); any other stage stays open
            if rec._admission is not None and rec._next(AdmissionEvent.READY, "") is AdmissionStage.NONE:
                rec._close_admission()

        return rec._call(lambda: self.base.ready_to_load_host_cache(cache), _nothing, after, continues=True)

    def cache_finished_req(self, cache: Any, req: Any, is_insert: bool = True, **kwargs: Any) -> Any:
        rec, base = self.rec, self.base
        seen: list[int] = []
        protected = int(req.kv.cache_protected_len)

        def run() -> Any:
            return self._spied(cache, seen, lambda: base.cache_finished_req(cache, req, is_insert, **kwargs))

        def after(_: Any) -> None:
            self._released(req, is_insert, protected, seen)

        return rec._call(run, _nothing, after)

    def _spied(self, cache: Any, seen: list[int], run: Callable[[], Any]) -> Any:
        """``run()`` with each ``insert``'s prefix_len (as the adapter observes it) appended to ``seen``:
        spied for this call only."""
        own = cache.__dict__.get("insert")
        base = self.base
        inner = own if own is not None else (lambda p: base.insert(cache, p))

        def spy(params: Any) -> Any:
            self._inserting(params)
            result = inner(params)
            seen.append(self._prefix_len(result))
            return result

        cache.insert = spy
        try:
            return run()
        finally:
            if own is not None:
                cache.insert = own
            else:
                del cache.insert

    def _inserting(self, params: Any) -> None:
        """(Before an insert the recorder spies) what it asks of the insert besides: nothing here."""

    def _expired(self, cache: Any, handle: Any) -> bool:
        """Whether the request's prefetch wait expired (0.5.23's ``_storage_prefetch_wait``, D-55): none here."""
        return False

    @staticmethod
    def _prefix_len(result: Any) -> int:
        return int(result.prefix_len)

    def _released(self, req: Any, inserted: bool, protected: int, seen: list[int]) -> None:
        """A request's release: ``FinishRequest`` (inserted) or ``AbortRequest``."""
        rec = self.rec
        rid = rec._resolve(req)
        if not inserted:
            self._emit_release(AbortRequest(rid), Done())
            return
        n = len(req.get_fill_ids())
        key_len = n - (1 if rec.config.is_eagle else 0)
        key_len -= key_len % rec.config.page_size
        prefix = seen[0] if seen else 0
        self._emit_release(FinishRequest(rid), FinishResult(prefix, max(0, prefix - protected) + n - key_len))

    def _emit_release(self, op: Op, observed: Observation) -> None:
        """A finish, abort or unfinished request's line: written at once (HiRadixCache's insert started its
        backups)."""
        self.rec._emit(op, observed)

    def cache_unfinished_req(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec

        def after(_: Any) -> None:
            self._emit_release(CacheUnfinishedRequest(rec._resolve(req)), Done())

        return rec._call(lambda: self.base.cache_unfinished_req(cache, req, *args, **kwargs), _nothing, after)

    def check_hicache_events(self, cache: Any) -> Any:
        rec = self.rec
        cc = cache.cache_controller
        before_len: list[int] = []

        def before() -> None:
            before_len[:] = [len(cc.ack_write_queue), len(cc.ack_load_queue)]
            rec._revoked = 0
            rec._drained = {}

        def after(_: Any) -> None:
            writes = before_len[0] - len(cc.ack_write_queue)
            loads = before_len[1] - len(cc.ack_load_queue)
            backups, releases = rec._drained.get("backups", 0), rec._drained.get("host_releases", 0)
            rec._emit(CheckHicacheEvents(), EventsResult(writes, loads, rec._revoked, backups, releases))

        return rec._call(lambda: self.base.check_hicache_events(cache), before, after)

    def reset(self, cache: Any) -> Any:
        rec = self.rec
        # No snapshot: the scheduler's flush_cache clears the device and request pools after reset() returns,
        # where the recorder does not see it; the next line's snapshot shows the pools cleared.
        return rec._call(
            lambda: self.base.reset(cache),
            _nothing,
            lambda _: rec._emit(Reset(), ResetResult(True), snapshot=False),
        )

    def prefetch_from_storage(
        self, cache: Any, handle: Any, last_host_node: Any, new_input_tokens: Any, *args: Any, **kwargs: Any
    ) -> Any:
        rec, base = self.rec, self.base
        if rec._depth:
            return base.prefetch_from_storage(
                cache, handle, last_host_node, new_input_tokens, *args, **kwargs
            )
        seen: list[Any] = []  # the operation and its observation, as far as known before the call

        def before() -> None:
            a = rec._admission
            stage = rec._next(
                AdmissionEvent.PREFETCH, "prefetch_from_storage without the match_prefix of its request"
            )
            assert a is not None
            m = a.match
            if not self._same(last_host_node, m.last_host_node):
                raise RecordingError(
                    "prefetch_from_storage anchored elsewhere than its match's last_host_node: "
                    "PrefetchFromStorage anchors there"
                )
            assert stage is AdmissionStage.NONE  # the match was the prefetch's: no operation of its own
            rec._admission = None
            matched = rec._device_len(m) + m.host_hit_length
            tokens = a.tokens[:matched] + tuple(int(t) for t in new_input_tokens)
            tail = max(0, rec._key_len(tokens) - matched)
            tail -= tail % rec.config.page_size
            below = tail < cache.prefetch_threshold
            limited = not below and bool(cache.cache_controller.prefetch_rate_limited())
            reason = "below_threshold" if below else "rate_limited" if limited else "?"
            if self._expired(cache, handle):  # 0.5.23 declines it before its other tests (D-55)
                reason = "deadline_expired"
            op = PrefetchFromStorage(rec._handle(handle), tokens, kwargs.get("extra_key"))
            seen[:] = [op, reason, tail]

        def after(_: Any) -> None:
            op, reason, tail = seen
            if not cache.enable_storage:
                rec._emit(op, PrefetchResult(False, "storage_disabled", tail))
            elif rec._prefetch_key(handle) in cache.ongoing_prefetch:
                rec._emit(op, PrefetchResult(True, "admitted", tail))
            else:
                rec._emit(op, PrefetchResult(False, reason, tail))

        return rec._call(
            lambda: base.prefetch_from_storage(
                cache, handle, last_host_node, new_input_tokens, *args, **kwargs
            ),
            before,
            after,
            continues=True,
        )

    def check_prefetch_progress(self, cache: Any, handle: Any) -> Any:
        rec = self.rec
        rid = rec._handle(handle)

        def after(done: Any) -> None:
            # What the scheduler's pop_prefetch_loaded_tokens will return (read here, not popped).
            inserted = (
                int(cache.prefetch_loaded_tokens_by_reqid.get(rec._prefetch_key(handle), 0)) if done else 0
            )
            rec._emit(CheckPrefetchProgress(rid), ProgressResult(bool(done), inserted))

        return rec._call(lambda: self.base.check_prefetch_progress(cache, handle), _nothing, after)

    def release_aborted_request(self, cache: Any, handle: Any) -> Any:
        rec = self.rec
        rid = rec._handle(handle)
        return rec._call(
            lambda: self.base.release_aborted_request(cache, handle),
            _nothing,
            lambda _: rec._emit(AbortPrefetch(rid), Done()),
        )


class _UnifiedCalls(_Calls):
    """``UnifiedRadixCache``'s entry points (0.5.19..0.5.23), mapped to the same operations as HiRadixCache's
    (``record``'s table, 'UnifiedRadixCache'): what differs is how the scheduler calls the cache, per release
    (``_compat`` rows). Locks: ``inc_lock_ref(node_id)`` / ``dec_lock_ref(node_id, receipt)`` up to 0.5.21
    ("lock_by_node_id"), ``lock(node_id)`` / ``unlock(TreeLock)`` from 0.5.22, whose load back also host-locks
    and locks ``best_match_node`` inside the temporary lock ("load_back_under_device_lock"). Releases: up to
    0.5.20 ``cache_finished_req`` / ``cache_unfinished_req`` (as HiRadixCache); 0.5.21 ``release_kv_cache``
    calls ``claim_kv_row``, ``insert_req``, ``free_kv_row``, ``unpin``, ``on_release(inserted=)``; from 0.5.22
    ``claim_kv_row``, ``checkpoint``, ``free_kv_row``, ``unlock``, ``on_release(checkpointed=)``, and
    ``checkpoint_kv_cache`` a bare ``checkpoint`` ("cache_req_calls"). From 0.5.21 the backups a batch queued
    start at its ``flush_pending_backups`` ("backups_unbatched"): a release's line is written after it."""

    NAMES: ClassVar[tuple[str, ...]] = (
        *_Calls.NAMES,
        "lock",
        "unlock",
        "inc_host_lock_ref",
        "dec_host_lock_ref",
        "claim_kv_row",
        "insert_req",
        "checkpoint",
        "free_kv_row",
        "unpin",
        "on_release",
        "flush_pending_backups",
    )

    REFUSED: ClassVar[tuple[str, ...]] = ("backup_kv_cache", "restore_kv_cache", "discard_kv_cache_backup")
    """Entry points the alphabet has no operation for, refused when called at top level (0.5.21 on: a decode
    retraction's KV backup to the host and its restore)."""

    def overrides(self) -> dict[str, Callable[..., Any]]:
        body = super().overrides()
        for name in self.REFUSED:
            if hasattr(self.base, name):
                body[name] = self._refusal(name)
        return body

    def _refusal(self, name: str) -> Callable[..., Any]:
        rec, base = self.rec, self.base

        def refused(cache: Any, *args: Any, **kwargs: Any) -> Any:
            if rec._depth:
                return getattr(base, name)(cache, *args, **kwargs)
            raise RecordingError(
                f"{name}: a decode retraction's KV backup or restore, which no operation expresses"
            )

        refused.__name__ = refused.__qualname__ = name
        return refused

    @staticmethod
    def _same(node: Any, other: Any) -> bool:
        return bool(node == other)  # NodeIds: equal, not the same object

    def _locked(self, node: Any, call: str) -> None:
        """The scheduler pins the match's last device node around admission (``_lock_node``, with or without
        a host hit; ``schedule_policy.py`` 0.5.23:1224-1239, 1405), and from 0.5.22 the load back's best match
        node inside that pin: every lock before the first pin is released, or while one is held, is a pin
        (``TEMP_LOCK``); the next is the request's (``LOCK``)."""
        rec = self.rec
        a = rec._admission
        pin = (
            a is not None
            and a.stage in (AdmissionStage.MATCHED, AdmissionStage.TEMP_LOCKED)
            and (bool(a.pinned) or not a.pins_done)
        )
        event = AdmissionEvent.TEMP_LOCK if pin else AdmissionEvent.LOCK
        stage = rec._next(event, f"{call} outside an admission (match, pin, load back, lock)")
        assert a is not None  # no admission (NONE) takes a lock
        a.stage = stage
        if pin:
            a.pinned.append(node)
        else:
            a.node = node

    def _unlocked(self, node: Any, call: str) -> None:
        a = self.rec._admission
        held = [] if a is None else [i for i, p in enumerate(a.pinned) if self._same(p, node)]
        if a is None or not held:
            super()._unlocked(node, call)
            return
        a.stage = self.rec._next(AdmissionEvent.UNLOCK, call)  # a pin released
        del a.pinned[held[-1]]
        a.pins_done = True

    def _inserting(self, params: Any) -> None:
        # UnifiedRadixCache's prefix_len also counts evicted nodes the insert re-filled from the request's slots
        # (adopted, not freed); the adapter asks for the adopted ranges and subtracts them (_unified._spy_insert)
        params.track_adopted_ranges = True

    @staticmethod
    def _prefix_len(result: Any) -> int:
        matched = int(result.prefix_len)
        ranges = [r for rs in (result.adopted_ranges or {}).values() for r in rs]
        return matched - sum(int(min(end, matched) - start) for start, end in ranges if start < matched)

    def _expired(self, cache: Any, handle: Any) -> bool:
        # 0.5.23 (_compat "prefetch_timeout_from_start" up to 0.5.22): the request's wait, from its first blocked
        # progress check, read before the call as the adapter reads it (_unified._prefetch)
        if self.rec._compat().has("prefetch_timeout_from_start"):
            return False
        wait = cache._storage_prefetch_wait.get(handle)
        return wait is not None and bool(wait.expired)

    def _emit_release(self, op: Op, observed: Observation) -> None:
        # written at the next call but the batch's flush_pending_backups (or when the adapter's operation returns)
        self.rec._pending.append((op, observed))

    def _one_per_flush(self) -> None:
        """(Before a release or checkpoint) the one before it must have had its backups flushed: the model's
        ``FinishRequest`` / ``CacheUnfinishedRequest`` starts its own, where a batch of several releases before
        one ``flush_pending_backups`` starts them together, merged (D-38), which no operation expresses."""
        rec = self.rec
        queued = getattr(rec.cache.cache_controller, "write_queue", ())
        if rec._pending and not rec._compat().has("backups_unbatched") and len(queued):
            raise RecordingError(
                "a second release or checkpoint before the batch's flush_pending_backups: the backups of both "
                "start at one flush (one write ack, D-38), which no operation expresses"
            )

    def lock(self, cache: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        return self.rec._call(
            lambda: self.base.lock(cache, node, *args, **kwargs),
            lambda: self._locked(node, "lock"),
            _nothing,
            continues=True,
        )

    def unlock(self, cache: Any, lock: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec

        def run() -> Any:
            return self.base.unlock(cache, lock, *args, **kwargs)

        if rec._depth or lock is None:
            return rec._inside(run) if not rec._depth else run()
        if rec._release is not None:  # release_kv_cache's unlock of req.lock
            return rec._inside(run)
        return rec._call(run, lambda: self._unlocked(lock.node, "unlock"), _nothing, continues=True)

    def _host_lock(self, name: str, cache: Any, *args: Any, **kwargs: Any) -> Any:
        """``inc_host_lock_ref`` / ``dec_host_lock_ref``: from 0.5.22 the scheduler pins a load back's anchor
        around ``init_load_back`` (inside the temporary lock); the alphabet has no host lock of its own."""
        rec = self.rec

        def run() -> Any:
            return getattr(self.base, name)(cache, *args, **kwargs)

        if rec._depth:
            return run()
        if rec._stage() not in (AdmissionStage.TEMP_LOCKED, AdmissionStage.LOADED):
            raise RecordingError(
                f"{name} outside a load back's admission (match, lock, host lock, load back): the alphabet has no "
                f"bare host lock (the admission is at {rec._stage().value!r})"
            )
        return rec._inside(run)

    def inc_host_lock_ref(self, cache: Any, *args: Any, **kwargs: Any) -> Any:
        return self._host_lock("inc_host_lock_ref", cache, *args, **kwargs)

    def dec_host_lock_ref(self, cache: Any, *args: Any, **kwargs: Any) -> Any:
        return self._host_lock("dec_host_lock_ref", cache, *args, **kwargs)

    def claim_kv_row(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        """``release_kv_cache`` begins (0.5.21 on): the calls up to its ``on_release`` are its."""
        rec = self.rec
        if rec._depth:
            return self.base.claim_kv_row(cache, req, *args, **kwargs)

        def after(claimed: Any) -> None:
            if claimed:
                raise RecordingError(
                    f"claim_kv_row kept request {req.rid}'s row for a streaming session: the alphabet has no sessions"
                )
            rec._release = _Release(req, int(req.kv.cache_protected_len))

        self._one_per_flush()
        return rec._call(lambda: self.base.claim_kv_row(cache, req, *args, **kwargs), _nothing, after)

    def _in_release(self, name: str, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        """A step of ``release_kv_cache`` between ``claim_kv_row`` and ``on_release``."""
        rec = self.rec

        def run() -> Any:
            return getattr(self.base, name)(cache, req, *args, **kwargs)

        if rec._depth:
            return run()
        if rec._release is None:
            raise RecordingError(
                f"{name} outside release_kv_cache (claim_kv_row, insert, free_kv_row, unlock, on_release): no "
                "operation of the alphabet is a bare one"
            )
        return rec._inside(run)

    def insert_req(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        rel = self.rec._release
        if self.rec._depth or rel is None or rel.req is not req:
            return self._in_release("insert_req", cache, req, *args, **kwargs)
        return self.rec._inside(
            lambda: self._spied(cache, rel.seen, lambda: self.base.insert_req(cache, req, *args, **kwargs))
        )

    def checkpoint(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        """In ``release_kv_cache`` its insert; else ``checkpoint_kv_cache``: ``CacheUnfinishedRequest``."""
        rec = self.rec

        def run() -> Any:
            return self.base.checkpoint(cache, req, *args, **kwargs)

        rel = rec._release
        if rec._depth:
            return run()
        if rel is not None:
            if rel.req is not req:
                raise RecordingError(f"checkpoint of request {req.rid} inside another request's release")
            return rec._inside(lambda: self._spied(cache, rel.seen, run))
        self._one_per_flush()
        return rec._call(
            run, _nothing, lambda _: self._emit_release(CacheUnfinishedRequest(rec._resolve(req)), Done())
        )

    def free_kv_row(self, cache: Any, kv: Any, *args: Any, **kwargs: Any) -> Any:
        return self._in_release("free_kv_row", cache, kv, *args, **kwargs)

    def unpin(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        return self._in_release("unpin", cache, req, *args, **kwargs)

    def on_release(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        """``release_kv_cache`` ends: ``FinishRequest`` when it inserted (``checkpointed=``; 0.5.21
        ``inserted=``), else ``AbortRequest``."""
        rec = self.rec
        rel = rec._release
        if rec._depth:
            return self.base.on_release(cache, req, *args, **kwargs)
        if rel is None or rel.req is not req:
            raise RecordingError("on_release without the claim_kv_row of its request (release_kv_cache)")
        result = rec._inside(lambda: self.base.on_release(cache, req, *args, **kwargs))
        rec._release = None
        keyword = "inserted" if rec._compat().has("cache_req_calls") else "checkpointed"
        self._released(req, bool(kwargs[keyword]), rel.protected, rel.seen)
        return result

    def flush_pending_backups(self, cache: Any, *args: Any, **kwargs: Any) -> Any:
        """The batch's flush (0.5.21 on): the backups its releases queued start here, part of them."""
        return self.rec._inside(lambda: self.base.flush_pending_backups(cache, *args, **kwargs))

    def evict_host(self, cache: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        """Its return value is the tokens it freed (the host pool is the controller's pool group's)."""
        rec = self.rec
        return rec._call(
            lambda: self.base.evict_host(cache, num_tokens, *args, **kwargs),
            _nothing,
            lambda freed: rec._emit(EvictHost(int(num_tokens)), EvictHostResult(int(freed))),
        )


def _nothing(*_: Any) -> None:
    return None


def _forward(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function for the class body whose ``self`` (the cache) is passed on to ``method`` (of ``_Calls``)."""

    def forwarded(cache: Any, *args: Any, **kwargs: Any) -> Any:
        return method(cache, *args, **kwargs)

    forwarded.__name__ = forwarded.__qualname__ = method.__name__
    return forwarded
