"""SGLang 0.5.20's storage threads, stepped by ``CompleteIO`` instead of free-running.

With a storage backend, ``HiCacheController._start_storage_threads`` starts four daemon threads, each a loop
over a ``queue.Queue`` (``managers/cache_controller.py``): the prefetch thread (``prefetch_queue`` -> hit
query -> ``prefetch_hit_queue``), the prefetch I/O thread (``prefetch_buffer`` -> one ``page_get_func`` call
per ``STORAGE_BATCH_SIZE`` pages, one ack per batch and a final ack -> ``prefetch_sync_queue``), the prefetch
sync thread (``prefetch_sync_queue`` -> ``ack_prefetch_queue``) and the backup thread (``backup_queue`` ->
``_page_backup`` -> ``ack_backup_queue``). Up to 0.5.18 there is no sync thread: the I/O thread publishes its
reads in the operation, and the prefetch thread builds ``prefetch_buffer`` and starts the I/O thread itself
(specs/sglang-adapter.md, 'L3 before 0.5.19'). The threads stay SGLang's own; the adapter decides when each runs
one item:

* ``GatedQueue`` is what the name ``Queue`` means in ``cache_controller`` while the adapter runs (a module
  global, resolved when the controller builds its queues). Its ``get`` parks on the ``Gate``'s condition
  until an item is there and, for a gated queue (``prefetch_queue``: ``PREFETCH_QUERY``, ``backup_queue``:
  ``BACKUP``), the step has granted a token. The other queues are ungated: a thread takes their items as
  soon as they arrive, as in SGLang. The one-second ``timeout`` of the threads' ``get`` is not honoured
  (the loops only use it to re-check the stop event; ``Gate`` wakes them when the event is set).
* ``page_get_func`` (an instance attribute SGLang selects per backend) is wrapped so that each batch read
  waits for a ``PREFETCH_IO`` token. A terminated operation's remaining batches never read
  (``_page_transfer``) and so need none; the final ack of an operation comes from the step of its last batch.
* ``Gate.settle`` waits for quiescence: every storage thread alive and parked at a point it cannot pass
  (no item, or no token). The adapter settles after every operation, so what ungated threads do in response
  (the I/O thread taking a buffered operation up to its first read, the sync thread forwarding acks) belongs
  to the operation that caused it, and every ``CompleteIO`` starts and ends quiescent. A thread that died
  (an exception inside SGLang's loop) or does not park within ``SETTLE_TIMEOUT_S`` raises
  ``EngineThreadError``: the harness reports it as a crash of the engine, never a hang.

``CompleteIO(PREFETCH_QUERY|PREFETCH_IO|BACKUP, 0, k)`` grants one token at a time, at most ``k``, while the
queue has a runnable item, settling after each; it returns how many ran.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

from refcache.errors import EngineFailure
from refcache.hicache.ops import IOQueue

__all__ = ["SETTLE_TIMEOUT_S", "Contributions", "EngineThreadError", "Gate", "GatedQueue", "building"]

SETTLE_TIMEOUT_S: Final = 30.0
"""How long a storage thread may take to park again after a step before the adapter reports it stuck."""

Contributions = dict[tuple[str, int], tuple[int, ...]]
"""A rank's storage all-reduces that wait for their result: ``(group, n)`` -> the values its thread contributed
(one, or a packed vector: 0.5.22's Unified reduces the hits and every pool's pages in one MIN), or their result."""

_BUILDING: list[Gate] = []  # the gate of the controller being constructed (``building``)


class EngineThreadError(EngineFailure, RuntimeError):
    """Raised by the adapter when one of SGLang's storage threads died (the message carries its exception)
    or did not park within ``SETTLE_TIMEOUT_S``: an engine failure, which the harness reports as a crash of
    the engine, never a hang. The system is unusable; close it (``EngineFailure``)."""


class Gate:
    """The step tokens, parked threads and stop signal of one controller's storage threads."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.tokens: dict[IOQueue, int] = dict.fromkeys(
            (IOQueue.PREFETCH_QUERY, IOQueue.PREFETCH_IO, IOQueue.BACKUP), 0
        )
        # thread ident -> (where it parks, "can it go on now?") for every thread parked on this gate
        self.parked: dict[int, tuple[str, Callable[[], bool]]] = {}
        self.stop_event: threading.Event | None = None
        self.deaths: dict[int, BaseException] = {}
        # The storage threads' all-reduces across ranks (``all_reduce``): how many each group entered, the
        # contributions that wait for their result, and the results handed in (``resolve``).
        self.entered: dict[str, int] = {}
        self.waiting: Contributions = {}
        self.reduced: Contributions = {}

    def all_reduce(self, group: str, value: tuple[int, ...]) -> tuple[int, ...]:
        """A storage thread's all-reduce number ``n`` in ``group``: park until ``resolve`` hands in the
        reduced value of ``(group, n)`` (the parent reduces what every rank contributed); stopping, the
        thread goes on with its own value (its peers stop too)."""
        with self.cond:
            n = self.entered.get(group, 0) + 1
            self.entered[group] = n
            key = (group, n)
            self.waiting[key] = value
            try:
                self._park(f"{group} all-reduce #{n}", lambda: key in self.reduced)
            finally:
                self.waiting.pop(key, None)
            return self.reduced.pop(key, value)

    def resolve(self, results: Contributions) -> None:
        """Hand in reduced values of all-reduces this rank's threads wait in (``all_reduce``)."""
        with self.cond:
            self.reduced.update({key: v for key, v in results.items() if key in self.waiting})
            self.cond.notify_all()

    def contributions(self) -> Contributions:
        """The all-reduces this rank's storage threads wait in, with the value each contributed."""
        with self.cond:
            return dict(self.waiting)

    def in_all_reduce(self, group: str) -> int:
        """How many of this rank's storage threads wait in an all-reduce of ``group``."""
        with self.cond:
            return sum(1 for g, _ in self.waiting if g == group)

    def restart_collectives(self) -> None:
        """The threads were restarted (``reset``): their all-reduces count from 0 again."""
        with self.cond:
            self.entered.clear()
            self.waiting.clear()
            self.reduced.clear()

    def stopping(self) -> bool:
        if self.stop_event is None:
            # Still inside the controller's constructor (whose reset() stops and restarts the threads): a
            # storage thread finds the event on the controller that runs it.
            # Up to 0.5.8 (``_compat`` "storage_threads_on_stop_event") it is the controller's ``stop_event``.
            owner = getattr(getattr(threading.current_thread(), "_target", None), "__self__", None)
            event = getattr(owner, "storage_stop_event", None) or getattr(owner, "stop_event", None)
            return isinstance(event, threading.Event) and event.is_set()
        return self.stop_event.is_set()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _park(self, where: str, ready: Callable[[], bool]) -> None:
        """Block the calling thread until ``ready()`` or the stop event (under ``cond``)."""
        ident = threading.get_ident()
        self.parked[ident] = (where, lambda: ready() or self.stopping())
        self.cond.notify_all()  # a settling caller may be waiting for this thread to park
        try:
            while not (ready() or self.stopping()):
                # A NotifyingEvent wakes the parked threads; before it is installed, poll the stop event.
                self.cond.wait(1.0 if isinstance(self.stop_event, NotifyingEvent) else 0.02)
        finally:
            del self.parked[ident]

    def take(self, q: GatedQueue, block: bool) -> Any:
        """``q.get()`` for a storage thread (or the scheduler's drains, which never wait)."""
        with self.cond:

            def ready() -> bool:
                return bool(q.queue) and (q.role is None or self.tokens[q.role] > 0 or self.stopping())

            if not ready():
                if not block:
                    raise queue.Empty
                self._park(f"{q.role.value if q.role else 'queue'}.get", ready)
                if not ready():  # stopping with nothing queued: the loop re-checks its stop event
                    raise queue.Empty
            if q.role is not None and not self.stopping():
                self.tokens[q.role] -= 1
            with q.mutex:
                item = q._get()
                q.not_full.notify()
            if q.on_get is not None:
                q.on_get(item)
            return item

    def acquire(self, role: IOQueue) -> None:
        """Wait for a ``role`` token (the gated ``page_get_func``); consume it."""
        with self.cond:
            self._park(role.value, lambda: self.tokens[role] > 0)
            if not self.stopping():
                self.tokens[role] -= 1

    def settle(self, threads: list[threading.Thread], timeout: float = SETTLE_TIMEOUT_S) -> None:
        """Wait until every thread of ``threads`` is alive and parked where it cannot go on."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for t in threads:
                    if not t.is_alive():
                        error = self.deaths.get(t.ident or -1)
                        raise EngineThreadError(
                            f"SGLang storage thread {t.name} ({_target_name(t)}) died"
                            + (f": {type(error).__name__}: {error}" if error is not None else "")
                        )
                busy = [t for t in threads if t.ident not in self.parked or self.parked[t.ident][1]()]
                if not busy:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(_target_name(t) for t in busy)
                    raise EngineThreadError(
                        f"SGLang storage thread(s) {names} did not park within {timeout} s"
                    )
                self.cond.wait(min(left, 0.05))

    def where(self, thread: threading.Thread) -> str | None:
        """Where ``thread`` is parked (None: not parked)."""
        with self.cond:
            entry = self.parked.get(thread.ident or -1)
            return None if entry is None else entry[0]

    def grant(self, role: IOQueue) -> None:
        with self.cond:
            self.tokens[role] = 1
            self.cond.notify_all()

    def spent(self, role: IOQueue) -> bool:
        """Whether the token granted last was consumed; withdraws it either way."""
        with self.cond:
            left, self.tokens[role] = self.tokens[role], 0
            return left == 0


def _target_name(thread: threading.Thread) -> str:
    target = getattr(thread, "_target", None)
    return getattr(target, "__name__", thread.name)


class GatedQueue(queue.Queue[Any]):
    """``queue.Queue`` whose ``get`` parks on the gate of the controller that built it (module docstring).
    Outside ``building`` it is a plain queue."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self.gate: Gate | None = _BUILDING[-1] if _BUILDING else _running_gate()
        self.role: IOQueue | None = None
        self.on_get: Callable[[Any], None] | None = None  # told of every item a get returns
        self.on_put: Callable[[Any], None] | None = None  # told of every item put

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        gate = self.gate
        if gate is None:
            super().put(item, block, timeout)
            return
        with gate.cond:
            super().put(item, block, timeout)
            if self.on_put is not None:
                self.on_put(item)
            gate.cond.notify_all()

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        gate = self.gate
        if gate is None:
            return super().get(block, timeout)
        return gate.take(self, block)


def _running_gate() -> Gate | None:
    """The gate of the controller whose storage thread is running (None on any other thread, or before the
    adapter gated that controller): up to 0.5.18 the prefetch thread builds ``prefetch_buffer`` itself when it
    starts, after the constructor returned or after a ``reset``."""
    owner = getattr(getattr(threading.current_thread(), "_target", None), "__self__", None)
    event = getattr(owner, "storage_stop_event", None)
    return event.gate if isinstance(event, NotifyingEvent) else None


@contextmanager
def building(gate: Gate) -> Iterator[None]:
    """Queues created inside (by the controller's constructor) belong to ``gate``."""
    _BUILDING.append(gate)
    try:
        yield
    finally:
        _BUILDING.pop()


class NotifyingEvent(threading.Event):
    """The controller's ``storage_stop_event``: setting it wakes the parked threads so they can exit."""

    def __init__(self, gate: Gate) -> None:
        super().__init__()
        self.gate = gate

    def set(self) -> None:
        super().set()
        self.gate.wake()


_previous_hook = threading.excepthook
_GATES: list[Gate] = []


def _record_death(args: threading.ExceptHookArgs) -> None:
    thread = args.thread
    if thread is not None and args.exc_value is not None:
        for gate in _GATES:
            gate.deaths[thread.ident or -1] = args.exc_value
    _previous_hook(args)


def watch(gate: Gate) -> None:
    """Record the exceptions that end threads for ``gate``'s error messages."""
    if threading.excepthook is not _record_death:
        threading.excepthook = _record_death
    _GATES.append(gate)


def unwatch(gate: Gate) -> None:
    """Forget ``gate``: its threads' deaths and the all-reduces routed for it (``route_all_reduce``)."""
    if gate in _GATES:
        _GATES.remove(gate)
    for key in [key for key, (owner, _group, _reduce) in _ROUTES.items() if owner is gate]:
        del _ROUTES[key]


Reduce = Callable[[Any, Any], None]
"""Reduces a tensor in place, given the ``torch.distributed.ReduceOp`` asked for."""

_ROUTES: dict[int, tuple[Gate, object, Reduce]] = {}
"""``route_all_reduce``: the id of a process group -> the gate it was routed for, the group (kept, so that its id
is not reused while routed) and what reduces a tensor over it instead."""
_ROUTING: list[bool] = []  # one entry once ``torch.distributed.all_reduce`` is wrapped in this process


def route_all_reduce(gate: Gate, group: object, reduce: Reduce) -> None:
    """From now until ``unwatch(gate)``, ``torch.distributed.all_reduce(tensor, op, group)`` over ``group`` calls
    ``reduce(tensor, op)`` instead: up to 0.5.10 the prefetch thread reduces the storage hits by calling the
    collective itself on ``prefetch_tp_group`` (``_compat`` "prefetch_hits_all_reduce_inline"), where later
    releases call a method of the controller, which the adapter wraps. The wrapper is installed once per process,
    around the ``all_reduce`` of that moment (in a rank worker, ``_tp``'s, which passes another thread's call to
    the real one); it passes every call over another group on."""
    import torch.distributed as dist

    _ROUTES[id(group)] = (gate, group, reduce)
    if _ROUTING:
        return
    _ROUTING.append(True)
    real = dist.all_reduce

    def all_reduce(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        route = _ROUTES.get(id(group)) if group is not None else None
        if route is None or route[1] is not group:
            return real(*args, **kwargs)
        if kwargs.get("async_op", args[3] if len(args) > 3 else False):
            raise EngineThreadError("an asynchronous all-reduce over a routed group (not SGLang's call)")
        tensor = kwargs["tensor"] if "tensor" in kwargs else args[0]
        route[2](tensor, kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM))
        return None

    dist.all_reduce = all_reduce
