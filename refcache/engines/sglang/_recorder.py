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
from typing import Any, Final

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
from refcache.hicache.snapshot import Snapshot

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

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _handle_rid(self, handle: Any) -> str:
        """The request id a prefetch call names: the handle's (up to 0.5.19 the handle is the id string,
        ``_compat`` "plain_request_ids")."""
        assert self._rows is not None
        return str(handle) if self._rows.has("plain_request_ids") else str(handle.rid)

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

        # Under the adapter's gate the ungated storage threads may still be answering the call (the I/O
        # thread taking a buffered operation, the sync thread forwarding acks): read once they are parked,
        # as the adapter's own snapshot is.
        self.system._settle()
        return read_snapshot(self.system)

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
                len(m.device_indices),
                m.host_hit_length,
                self._depth_of(deepest),
                self._depth_of(m.last_host_node),
            )
            self._emit(MatchPrefix(a.tokens, a.extra_key), observed, taken=a.snapshot)
            return
        hit = len(a.match.device_indices)
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

    def _key_len(self, tokens: tuple[int, ...]) -> int:
        n = len(tokens) - (1 if self.config.is_eagle else 0)
        return n - n % self.config.page_size

    @staticmethod
    def _depth_of(node: Any) -> int:
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
        config = self.config.with_fidelity(PROFILES[self._placed.profile])
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
        cache.__class__ = type(f"Recorded{base.__name__}", (base,), _Calls(self, base).overrides())

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
        self._hook(cache, "_revoke_pending_prefetch", revoke)

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

    NAMES: Final = (
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
        return {name: _forward(getattr(self, name)) for name in self.NAMES}

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

    def inc_lock_ref(self, cache: Any, node: Any) -> Any:
        rec = self.rec

        def before() -> None:
            a = rec._admission
            temporary = (  # the lock around a load back: the match's last device node, right after a host hit
                a is not None
                and a.stage is AdmissionStage.MATCHED
                and a.match.host_hit_length > 0
                and node is a.match.last_device_node
            )
            event = AdmissionEvent.TEMP_LOCK if temporary else AdmissionEvent.LOCK
            stage = rec._next(event, "inc_lock_ref outside an admission (match, load back, lock)")
            assert a is not None  # no admission (NONE) takes a lock
            a.stage = stage
            if event is AdmissionEvent.LOCK:
                a.node = node

        return rec._call(lambda: self.base.inc_lock_ref(cache, node), before, _nothing, continues=True)

    def dec_lock_ref(self, cache: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec

        def before() -> None:
            a = rec._admission
            own = (
                a is not None
                and a.stage in (AdmissionStage.LOCKED, AdmissionStage.REFUSED)
                and node is a.node
            )
            stage = rec._next(
                AdmissionEvent.REFUSE if own else AdmissionEvent.UNLOCK,
                "dec_lock_ref outside an admission: the alphabet has no bare unlock",
            )
            assert a is not None  # no admission (NONE) takes an unlock
            a.stage = stage

        return rec._call(
            lambda: self.base.dec_lock_ref(cache, node, *args, **kwargs), before, _nothing, continues=True
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
            a.loaded = 0 if result is None else len(result[0])

        return rec._call(lambda: self.base.init_load_back(cache, params), before, after, continues=True)

    def _evict_like(self, name: str, cache: Any, params: Any) -> Any:
        """``evict`` / ``evict_for_alloc``: room for the request whose node is locked (a step of its
        admission), else an ``Evict`` of its own."""
        rec = self.rec
        in_admission = not rec._depth and rec._takes(AdmissionEvent.EVICT)

        def after(result: Any) -> None:
            if not in_admission:
                rec._emit(Evict(int(params.num_tokens)), EvictResult(int(result.num_tokens_evicted)))

        return rec._call(
            lambda: getattr(self.base, name)(cache, params), _nothing, after, continues=in_admission
        )

    def evict(self, cache: Any, params: Any) -> Any:
        return self._evict_like("evict", cache, params)

    def evict_for_alloc(self, cache: Any, params: Any) -> Any:
        return self._evict_like("evict_for_alloc", cache, params)

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
            # The first insert's prefix_len (as the adapter observes it): spied for this call only.
            own = cache.__dict__.get("insert")
            inner = own if own is not None else (lambda p: base.insert(cache, p))

            def spy(params: Any) -> Any:
                result = inner(params)
                seen.append(int(result.prefix_len))
                return result

            cache.insert = spy
            try:
                return base.cache_finished_req(cache, req, is_insert, **kwargs)
            finally:
                if own is not None:
                    cache.insert = own
                else:
                    del cache.insert

        def after(_: Any) -> None:
            rid = rec._resolve(req)
            if not is_insert:
                rec._emit(AbortRequest(rid), Done())
                return
            n = len(req.get_fill_ids())
            key_len = n - (1 if rec.config.is_eagle else 0)
            key_len -= key_len % rec.config.page_size
            prefix = seen[0] if seen else 0
            rec._emit(FinishRequest(rid), FinishResult(prefix, max(0, prefix - protected) + n - key_len))

        return rec._call(run, _nothing, after)

    def cache_unfinished_req(self, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        rec = self.rec

        def after(_: Any) -> None:
            rec._emit(CacheUnfinishedRequest(rec._resolve(req)), Done())

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
            if last_host_node is not m.last_host_node:
                raise RecordingError(
                    "prefetch_from_storage anchored elsewhere than its match's last_host_node: "
                    "PrefetchFromStorage anchors there"
                )
            assert stage is AdmissionStage.NONE  # the match was the prefetch's: no operation of its own
            rec._admission = None
            matched = len(m.device_indices) + m.host_hit_length
            tokens = a.tokens[:matched] + tuple(int(t) for t in new_input_tokens)
            tail = max(0, rec._key_len(tokens) - matched)
            tail -= tail % rec.config.page_size
            below = tail < cache.prefetch_threshold
            limited = not below and bool(cache.cache_controller.prefetch_rate_limited())
            reason = "below_threshold" if below else "rate_limited" if limited else "?"
            op = PrefetchFromStorage(rec._handle(handle), tokens, kwargs.get("extra_key"))
            seen[:] = [op, reason, tail]

        def after(_: Any) -> None:
            op, reason, tail = seen
            if not cache.enable_storage:
                rec._emit(op, PrefetchResult(False, "storage_disabled", tail))
            elif rec._handle_rid(handle) in cache.ongoing_prefetch:
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
                int(cache.prefetch_loaded_tokens_by_reqid.get(rec._handle_rid(handle), 0)) if done else 0
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


def _nothing(*_: Any) -> None:
    return None


def _forward(method: Callable[..., Any]) -> Callable[..., Any]:
    """A function for the class body whose ``self`` (the cache) is passed on to ``method`` (of ``_Calls``)."""

    def forwarded(cache: Any, *args: Any, **kwargs: Any) -> Any:
        return method(cache, *args, **kwargs)

    forwarded.__name__ = forwarded.__qualname__ = method.__name__
    return forwarded
