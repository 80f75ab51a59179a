"""The recorder: a live SGLang ``HiRadixCache`` written down as a refcache trace while it runs.

``with record(system, path) as recorder: ...`` wraps the cache of ``system`` (an ``SGLangSystem``, or a bare
``HiRadixCache`` with its configuration given) and, on exit, writes every scheduler call and every
background completion it observed as a recorded trace (``refcache.recording``: the trace format, the
header's ``source`` naming the engine and version, and on each line what the engine returned, plus its
snapshot after the operation when ``snapshots=True`` and the target is an ``SGLangSystem``). The
configuration in the header is the live cache's, under ``PROFILES["sglang-0.5.20"]`` (the engine follows
0.5.20 at every decision), so a clean run replays clean on the model.

How the wrapping works
----------------------
The cache instance's class is swapped for a subclass of its own class that overrides the methods below,
each calling the class's method and noting the call (so a patch of SGLang's class, as the zoo applies,
still runs; instance attributes the adapter sets, such as its ``insert`` spy, keep working). Only
*top-level* calls are interpreted: calls SGLang makes to these methods from inside one of them (the
``dec_lock_ref`` of ``cache_finished_req``, the ``evict`` inside ``evict_for_alloc``) are part of the outer
call. Nothing the recorder does calls into SGLang except ``query()`` on ack events (no side effect) and,
with ``snapshots=True``, the adapter's snapshot reader (reads only). ``close`` (the context's exit) puts the
class back. ``tests/engines/sglang/test_record.py`` checks that SGLang's snapshots are identical with and
without the recorder.

Observed calls → operations
---------------------------
========================================================  =====================================================
observed top-level sequence                                operation (observation)
========================================================  =====================================================
``match_prefix(k)`` then any call other than the below    ``MatchPrefix(k)`` (lengths, depths of the match)
``match_prefix(k)`` [``inc_lock_ref(last_device_node)``]  ``StartRequest(rid, k, prompt_len)``
``init_load_back`` [``dec_lock_ref``] ``inc_lock_ref(n)``  (admitted, device hit, loaded, computed =
[``evict_for_alloc`` / ``evict``]* [``ready_to_load_     len(k) - hit - loaded); the request's ``rid`` and
host_cache``]                                              ``prompt_len = len(origin_input_ids)`` (None when
                                                           it is all of ``k``) are taken from ``params.req``
                                                           when the scheduler passes it, else from the first
                                                           request later finished, cached or aborted whose
                                                           ``last_node`` is ``n`` and whose tokens are ``k``
... with ``dec_lock_ref(n)`` before the end               ``StartRequest`` not admitted (``computed`` 0)
``cache_finished_req(req)``                               ``FinishRequest(rid)`` (``prefix_len`` of its first
                                                           ``insert``; the freed tokens, as the adapter counts)
``cache_finished_req(req, is_insert=False)``              ``AbortRequest(rid)``
``cache_unfinished_req(req)``                             ``CacheUnfinishedRequest(rid)``
``evict(n)`` / ``evict_for_alloc(n)`` outside admission   ``Evict(n)`` (tokens evicted)
``evict_host(n)``                                         ``EvictHost(n)`` (host ``available_size`` delta)
``check_hicache_events()``                                ``CheckHicacheEvents`` (ack queue length deltas)
``reset()``                                               ``Reset`` (flushed)
``check_prefetch_progress(req)``                          ``CheckPrefetchProgress(rid)`` (not observed)
``release_aborted_request(req)``                          ``AbortPrefetch(rid)``
a write / load ack whose event is found finished before   ``CompleteIO(WRITE|LOAD, 0, count)`` for the oldest
a top-level call (or at close), having been unfinished     acks, before that call's operation (acks finished
after the previous one                                     *during* a call, e.g. a write-back eviction's
                                                           synchronize, belong to that call)
the adapter's logical clock moved (``SGLangSystem``)       ``AdvanceClock(delta)``
========================================================  =====================================================

What the alphabet cannot express raises ``RecordingError`` from the wrapper *before* SGLang runs the call
(never a silent drop): a lock or unlock outside an admission, a load back without a match, a call
sequence that leaves an admission half done (e.g. ``init_load_back`` then a finish), acks completing out
of order, and an L3 prefetch (``prefetch_from_storage``: the adapter runs SGLang's storage threads, but the
recorder does not yet record a prefetch nor the storage threads' completions).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final

from refcache.config import PROFILES, HiCacheConfig
from refcache.engines.sglang._adapter import SGLangSystem
from refcache.errors import RefcacheError
from refcache.ops import (
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
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
)
from refcache.recording import Recording, dumps_recording
from refcache.snapshot import Snapshot

__all__ = ["SOURCE", "Recorder", "RecordingError", "record"]

SOURCE: Final = {"engine": "sglang", "version": "0.5.20"}
"""The header's ``source`` of a trace recorded here."""


class RecordingError(RefcacheError):
    """The engine made a call sequence the operation alphabet cannot express (the message says which)."""


@dataclass
class _Admission:
    """A ``match_prefix`` and what followed it, until it is known which operation it was."""

    tokens: tuple[int, ...]
    extra_key: str | None
    match: Any
    req: Any
    stage: str = "matched"  # matched -> temp_locked -> loaded -> locked
    loaded: int = 0
    node: Any = None  # the node locked for the request
    refused: bool = False


@dataclass
class _Line:
    op: Op
    observed: Observation | None
    snapshot: Snapshot | None = None
    admission: _Admission | None = None  # a StartRequest whose rid is not known yet
    admitted: bool = False


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

    # --- bookkeeping ------------------------------------------------------------------------------------

    def _rid(self, req: Any) -> int:
        key = str(req.rid)
        if key not in self._rids:
            self._rids[key] = int(key) if key.isdecimal() else 1_000_000 + len(self._rids)
        return self._rids[key]

    def _emit(self, op: Op, observed: Observation | None, admission: _Admission | None = None) -> _Line:
        snap = None
        if self.snapshots and self.system is not None:
            from refcache.engines.sglang._snapshot import read_snapshot

            snap = read_snapshot(self.system)
        line = _Line(op, observed, snap, admission)
        self.lines.append(line)
        return line

    def _background(self) -> None:
        """Emit what happened between two calls: the clock and the acks that finished."""
        if self.system is not None and self.system.clock_us != self._clock_us:
            self._emit(AdvanceClock(self.system.clock_us - self._clock_us), Done())
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
            self._emit(CompleteIO(queue, 0, len(done)), IOResult(len(done)))

    def _settle(self) -> None:
        """Acks finished during a call belong to it."""
        cc = self.cache.cache_controller
        live = {id(a) for a in (*cc.ack_write_queue, *cc.ack_load_queue)}
        self._finished_acks = {
            id(a) for a in (*cc.ack_write_queue, *cc.ack_load_queue) if a.finish_event.query()
        } | (self._finished_acks & live)

    def _close_admission(self) -> None:
        """The call sequence since the last ``match_prefix`` ends here: emit what it was."""
        a, self._admission = self._admission, None
        if a is None:
            return
        if a.stage == "matched":
            m = a.match
            deepest = m.last_host_node if m.host_hit_length > 0 else m.last_device_node
            observed = MatchResult(
                len(m.device_indices),
                m.host_hit_length,
                self._depth_of(deepest),
                self._depth_of(m.last_host_node),
            )
            self._emit(MatchPrefix(a.tokens, a.extra_key), observed)
            return
        if a.stage != "locked":
            raise RecordingError(
                f"an admission stopped after {a.stage.replace('_', ' ')} (match, load back, lock expected)"
            )
        hit = len(a.match.device_indices)
        admitted = not a.refused
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

    @staticmethod
    def _depth_of(node: Any) -> int:
        n = 0
        while node is not None and node.parent is not None:
            n += len(node.key)
            node = node.parent
        return n

    # --- the wrapped calls --------------------------------------------------------------------------------

    def _call(
        self, name: str, fn: Callable[[], Any], before: Callable[[], None], after: Callable[[Any], object]
    ) -> Any:
        if self._depth:
            return fn()
        self._background()
        before()
        self._depth += 1
        try:
            result = fn()
        finally:
            self._depth -= 1
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
        config = self.config.with_fidelity(PROFILES["sglang-0.5.20"])
        return Recording(
            config,
            [line.op for line in self.lines],
            [line.observed for line in self.lines],
            [line.snapshot for line in self.lines],
            dict(SOURCE),
        )

    def write(self, path: str | os.PathLike[str]) -> Recording:
        rec = self.recording()
        text = dumps_recording(rec.config, rec.ops, rec.observed, rec.snapshots, rec.source)
        with open(path, "w", encoding="utf-8", newline="\n") as file:
            file.write(text)
        return rec

    def install(self) -> None:
        cache = self.cache
        base = type(cache)
        self._original_class = base
        self._finished_acks = set()
        self._settle()
        if self.system is not None:
            self._clock_us = self.system.clock_us
        cache.__class__ = type(f"Recorded{base.__name__}", (base,), _overrides(self, base))

    def close(self) -> None:
        if self._original_class is not None:
            self.cache.__class__ = self._original_class
            self._original_class = None


def _overrides(rec: Recorder, base: Any) -> dict[str, Any]:
    """The subclass body: each method calls ``base``'s (looked up at call time) and tells ``rec``."""

    def nothing(*_: Any) -> None:
        return None

    def match_prefix(self: Any, params: Any) -> Any:
        def after(result: Any) -> None:
            key = params.key
            rec._admission = _Admission(
                tuple(int(t) for t in key.token_ids), key.extra_key, result, getattr(params, "req", None)
            )

        return rec._call("match_prefix", lambda: base.match_prefix(self, params), rec._close_admission, after)

    def inc_lock_ref(self: Any, node: Any) -> Any:
        def before() -> None:
            a = rec._admission
            if a is None or a.stage in ("temp_locked", "locked"):
                raise RecordingError("inc_lock_ref outside an admission (match, load back, lock)")
            if a.stage == "matched" and a.match.host_hit_length > 0 and node is a.match.last_device_node:
                a.stage = "temp_locked"
            else:
                a.stage, a.node = "locked", node

        return rec._call("inc_lock_ref", lambda: base.inc_lock_ref(self, node), before, nothing)

    def dec_lock_ref(self: Any, node: Any, *args: Any, **kwargs: Any) -> Any:
        def before() -> None:
            a = rec._admission
            if a is not None and a.stage == "temp_locked":
                return  # the temporary lock around init_load_back
            if a is not None and a.stage == "loaded":
                return
            if a is not None and a.stage == "locked" and node is a.node and not a.refused:
                a.refused = True
                return
            raise RecordingError("dec_lock_ref outside an admission: the alphabet has no bare unlock")

        return rec._call(
            "dec_lock_ref", lambda: base.dec_lock_ref(self, node, *args, **kwargs), before, nothing
        )

    def init_load_back(self: Any, params: Any) -> Any:
        def before() -> None:
            a = rec._admission
            if a is None or a.stage not in ("matched", "temp_locked"):
                raise RecordingError("init_load_back without the match_prefix of its request")
            if getattr(params, "req", None) is not None:
                a.req = params.req

        def after(result: Any) -> None:
            a = rec._admission
            assert a is not None
            a.stage = "loaded"
            a.loaded = 0 if result is None else len(result[0])

        return rec._call("init_load_back", lambda: base.init_load_back(self, params), before, after)

    def evict_like(name: str) -> Callable[..., Any]:
        def method(self: Any, params: Any) -> Any:
            in_admission = rec._admission is not None and rec._admission.stage == "locked" and not rec._depth

            def before() -> None:
                if not in_admission:
                    rec._close_admission()

            def after(result: Any) -> None:
                if not in_admission:
                    rec._emit(Evict(int(params.num_tokens)), EvictResult(int(result.num_tokens_evicted)))

            return rec._call(name, lambda: getattr(base, name)(self, params), before, after)

        return method

    def evict_host(self: Any, num_tokens: int, *args: Any, **kwargs: Any) -> Any:
        pool = self.token_to_kv_pool_host
        free: list[int] = []

        def before() -> None:
            rec._close_admission()
            free.append(int(pool.available_size()))

        def after(_: Any) -> None:
            rec._emit(EvictHost(int(num_tokens)), EvictHostResult(int(pool.available_size()) - free[0]))

        return rec._call(
            "evict_host", lambda: base.evict_host(self, num_tokens, *args, **kwargs), before, after
        )

    def ready_to_load_host_cache(self: Any) -> Any:
        def after(_: Any) -> None:
            if rec._admission is not None and rec._admission.stage == "locked":
                rec._close_admission()

        return rec._call(
            "ready_to_load_host_cache", lambda: base.ready_to_load_host_cache(self), nothing, after
        )

    def cache_finished_req(self: Any, req: Any, is_insert: bool = True, **kwargs: Any) -> Any:
        seen: list[int] = []
        protected = int(req.kv.cache_protected_len)

        def run() -> Any:
            # The first insert's prefix_len (as the adapter observes it): spied for this call only.
            own = self.__dict__.get("insert")
            inner = own if own is not None else (lambda p: base.insert(self, p))

            def spy(params: Any) -> Any:
                result = inner(params)
                seen.append(int(result.prefix_len))
                return result

            self.insert = spy
            try:
                return base.cache_finished_req(self, req, is_insert, **kwargs)
            finally:
                if own is not None:
                    self.insert = own
                else:
                    del self.insert

        def before() -> None:
            rec._close_admission()

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

        return rec._call("cache_finished_req", run, before, after)

    def cache_unfinished_req(self: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
        def after(_: Any) -> None:
            rec._emit(CacheUnfinishedRequest(rec._resolve(req)), Done())

        return rec._call(
            "cache_unfinished_req",
            lambda: base.cache_unfinished_req(self, req, *args, **kwargs),
            rec._close_admission,
            after,
        )

    def check_hicache_events(self: Any) -> Any:
        cc = self.cache_controller
        before_len: list[int] = []

        def before() -> None:
            rec._close_admission()
            before_len[:] = [len(cc.ack_write_queue), len(cc.ack_load_queue)]

        def after(_: Any) -> None:
            writes = before_len[0] - len(cc.ack_write_queue)
            loads = before_len[1] - len(cc.ack_load_queue)
            rec._emit(CheckHicacheEvents(), EventsResult(writes, loads, 0, 0, 0))

        return rec._call("check_hicache_events", lambda: base.check_hicache_events(self), before, after)

    def reset(self: Any) -> Any:
        return rec._call(
            "reset",
            lambda: base.reset(self),
            rec._close_admission,
            lambda _: rec._emit(Reset(), ResetResult(True)),
        )

    def check_prefetch_progress(self: Any, handle: Any) -> Any:
        rid = rec._rid(getattr(handle, "req", handle))
        return rec._call(
            "check_prefetch_progress",
            lambda: base.check_prefetch_progress(self, handle),
            rec._close_admission,
            lambda _: rec._emit(CheckPrefetchProgress(rid), None),
        )

    def release_aborted_request(self: Any, handle: Any) -> Any:
        rid = rec._rid(getattr(handle, "req", handle))
        return rec._call(
            "release_aborted_request",
            lambda: base.release_aborted_request(self, handle),
            rec._close_admission,
            lambda _: rec._emit(AbortPrefetch(rid), Done()),
        )

    def prefetch_from_storage(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not rec._depth:
            raise RecordingError(
                "prefetch_from_storage: the recorder does not record L3 prefetches (nor the storage "
                "threads' completions) yet"
            )
        return base.prefetch_from_storage(self, *args, **kwargs)

    return {
        "match_prefix": match_prefix,
        "inc_lock_ref": inc_lock_ref,
        "dec_lock_ref": dec_lock_ref,
        "init_load_back": init_load_back,
        "evict": evict_like("evict"),
        "evict_for_alloc": evict_like("evict_for_alloc"),
        "evict_host": evict_host,
        "ready_to_load_host_cache": ready_to_load_host_cache,
        "cache_finished_req": cache_finished_req,
        "cache_unfinished_req": cache_unfinished_req,
        "check_hicache_events": check_hicache_events,
        "reset": reset,
        "check_prefetch_progress": check_prefetch_progress,
        "release_aborted_request": release_aborted_request,
        "prefetch_from_storage": prefetch_from_storage,
    }


@contextmanager
def record(
    target: SGLangSystem | Any,
    path: str | os.PathLike[str] | None = None,
    *,
    config: HiCacheConfig | None = None,
    snapshots: bool = False,
) -> Iterator[Recorder]:
    """Record ``target`` (an ``SGLangSystem``, or a ``HiRadixCache`` with ``config``) while the block runs;
    write the recorded trace to ``path`` (if given) on exit, also when the block raises."""
    if isinstance(target, SGLangSystem):
        recorder = Recorder(target.cache, config or target.config, target, snapshots)
    else:
        if config is None:
            raise RecordingError("recording a bare HiRadixCache needs its HiCacheConfig (config=...)")
        recorder = Recorder(target, config, None, False)
    recorder.install()
    try:
        yield recorder
    finally:
        recorder.close()
        if path is not None:
            recorder.write(path)
