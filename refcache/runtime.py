"""Seams between HiCache's logic and the outside world — time, background work, collectives — as
production runs them: the protocols that ``refcache.gpu`` is written against (``Clock``, ``Executor``,
``Communicator``), the job and collective vocabulary, and the production implementations. The
deterministic test doubles of the same protocols live in ``refcache.testing``; nothing here imports
them or ``refcache.model`` (an import-linter contract in ``pyproject.toml`` says so).

Theory of operation
-------------------
**Clock.** Code asks a ``Clock`` for ``now_us()`` (integer microseconds). ``MonotonicClock`` reads
``time.monotonic_ns``; tests pass ``refcache.testing.LogicalClock``, which moves only when told.

**Background jobs.** A job is a generator. Its body does the work of one background step; it may
``yield CHECKPOINT`` to end a step (a multi-batch transfer yields after every batch) and it may
``yield AllReduce(op, values, channel)`` when it needs a collective, receiving the reduced values back
from ``yield``. Jobs are submitted to an ``Executor`` under a queue name (``IOQueue`` values) on one rank:

* ``ThreadExecutor`` runs each (queue, rank) on its own worker thread, as SGLang runs a thread (or CUDA
  stream) per queue: steps run back to back and a collective blocks in ``Communicator.all_reduce``.
* ``refcache.testing.ManualExecutor`` (tests) runs a step only when a test calls ``complete``, on the
  caller's thread, so every interleaving is an explicit, replayable operation.

**Collectives.** Scheduler code that needs a collective is written as a generator too: it yields
``AllReduce`` and gets the reduced tuple back; its return value is the method's result.

* ``TorchDistributedCommunicator`` serves one rank per process over ``torch.distributed`` (gloo on the
  CPU), with a separate gloo group for the prefetch threads' channel (seed §3.7); ``run_local(gen, comm,
  rank)`` drives a generator by calling ``comm.all_reduce`` at each yield, for any ``Communicator``.
* ``refcache.testing.InProcessGroup`` (tests) serves ``n`` ranks living in one process.

Both communicators record every reduction (``log``: channel, op, reduced values; ``keep_log=False`` turns
this off for long runs), so a test can compare the collective sequences of ranks.

Background jobs may also raise: ``ThreadExecutor`` keeps the worker alive and re-raises the first one
from ``check()``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from refcache.errors import UsageError

__all__ = [
    "CHECKPOINT",
    "AllReduce",
    "Checkpoint",
    "Clock",
    "Collective",
    "Communicator",
    "Executor",
    "Job",
    "MonotonicClock",
    "ReduceOp",
    "ThreadExecutor",
    "TorchDistributedCommunicator",
    "job_of",
    "reduce_values",
    "run_local",
]

_T = TypeVar("_T")

# --- clock -------------------------------------------------------------------------------------------------


class Clock(Protocol):
    def now_us(self) -> int:
        """The current time in integer microseconds (only differences are meaningful)."""
        ...


class MonotonicClock:
    """Production clock: ``time.monotonic_ns() // 1000``."""

    def now_us(self) -> int:
        return time.monotonic_ns() // 1000


# --- collectives -------------------------------------------------------------------------------------------


class ReduceOp(enum.StrEnum):
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True)
class AllReduce:
    """A request to reduce ``values`` element-wise over every rank of ``channel``'s group."""

    op: ReduceOp
    values: tuple[int, ...]
    channel: str = "scheduler"  # "scheduler": the TP group; "prefetch": the prefetch threads' group


@dataclass(frozen=True)
class Checkpoint:
    """Yielded by a background job between two steps (see ``Executor.complete``)."""


CHECKPOINT = Checkpoint()

Job = Generator[AllReduce | Checkpoint, tuple[int, ...] | None, None]
"""A background job: steps separated by ``CHECKPOINT``; ``AllReduce`` yields receive the reduced tuple."""

Collective = Generator[AllReduce, tuple[int, ...], _T]
"""Scheduler code that may reduce over the ranks; its return value is the result."""


def reduce_values(op: ReduceOp, rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Element-wise MIN or MAX of equally long rows. Raises ``UsageError`` for ragged rows."""
    if len(rows) == 1:  # one rank (the common case): its own row
        return tuple(rows[0])
    if not rows or any(len(r) != len(rows[0]) for r in rows):
        raise UsageError(f"all-reduce over ragged or empty rows {list(rows)}")
    pick = min if op is ReduceOp.MIN else max
    return tuple(pick(column) for column in zip(*rows, strict=True))


def job_of(fn: Callable[[], None]) -> Job:
    """A one-step job that calls ``fn`` when it runs."""
    yield from ()
    fn()


class Communicator(Protocol):
    """Blocking all-reduce for code that runs on a rank's own thread."""

    size: int

    def all_reduce(self, rank: int, request: AllReduce) -> tuple[int, ...]: ...


def run_local(gen: Collective[_T], comm: Communicator, rank: int) -> _T:
    """Drive ``gen`` for one rank, answering each ``AllReduce`` with ``comm.all_reduce`` (blocking)."""
    try:
        request = next(gen)
        while True:
            request = gen.send(comm.all_reduce(rank, request))
    except StopIteration as stop:
        result: _T = stop.value
        return result


class TorchDistributedCommunicator:
    """One rank of a ``torch.distributed`` process group (gloo on the CPU).

    Channel ``"scheduler"`` uses the default group; every other channel gets its own gloo group, created
    collectively in the constructor (``channels``), so the prefetch threads reduce without interleaving
    with the scheduler's collectives (seed §3.7). Call after ``dist.init_process_group``.
    """

    def __init__(self, channels: Sequence[str] = ("prefetch",), *, keep_log: bool = True) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        self._groups: dict[str, object] = {"scheduler": None}
        for channel in channels:
            self._groups[channel] = dist.new_group(backend="gloo")
        self.keep_log = keep_log  # tests compare the logs of ranks; production turns it off
        self.log: list[tuple[str, str, tuple[int, ...]]] = []
        self._log_lock = threading.Lock()

    def all_reduce(self, rank: int, request: AllReduce) -> tuple[int, ...]:
        import torch

        if rank != self.rank:
            raise UsageError(f"this process is rank {self.rank}, not {rank}")
        if request.channel not in self._groups:
            raise UsageError(f"no process group for channel {request.channel!r}")
        tensor = torch.tensor(request.values, dtype=torch.int64)
        op = self._dist.ReduceOp.MIN if request.op is ReduceOp.MIN else self._dist.ReduceOp.MAX
        self._dist.all_reduce(tensor, op=op, group=self._groups[request.channel])
        result = tuple(int(v) for v in tensor.tolist())
        if self.keep_log:
            with self._log_lock:
                self.log.append((request.channel, request.op.value, result))
        return result

    def run(self, gen: Collective[_T]) -> _T:
        return run_local(gen, self, self.rank)


# --- executors ---------------------------------------------------------------------------------------------


class Executor(Protocol):
    """Where background jobs run. ``inline`` is True when jobs run on the scheduler's thread."""

    inline: bool

    def submit(self, queue: str, rank: int, job: Job) -> None: ...

    def complete(self, queue: str, rank: int, count: int) -> int:
        """Let up to ``count`` steps of ``queue`` on ``rank`` finish; returns how many did."""
        ...

    def wait_all(self, queue: str, rank: int) -> None:
        """Block until every job submitted to ``queue`` on ``rank`` has finished (a rank-local flush)."""

    def discard(self, rank: int) -> None:
        """Drop every job of ``rank`` that has not started (reset); running ones finish."""

    def check(self) -> None:
        """Raise the first exception a background job raised, if any."""

    def close(self) -> None: ...


class _Worker:
    """One (queue, rank) worker thread of ``ThreadExecutor``."""

    def __init__(self, name: str, rank: int, comm: Communicator, on_error: Callable[[BaseException], None]):
        self.rank = rank
        self.comm = comm
        self.on_error = on_error
        self.cond = threading.Condition()
        self.jobs: deque[Job] = deque()
        self.finished = 0  # steps completed (a step ends at a checkpoint or the job's end)
        self.busy = False
        self.stopping = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            with self.cond:
                while not self.jobs and not self.stopping:
                    self.cond.wait()
                if not self.jobs:
                    return
                job = self.jobs[0]
                self.busy = True
            try:
                self._drive(job)
            except BaseException as e:  # reported by ThreadExecutor.check; the worker keeps going
                self.on_error(e)
            with self.cond:
                self.jobs.popleft()
                self.busy = False
                self.cond.notify_all()

    def _drive(self, job: Job) -> None:
        value: tuple[int, ...] | None = None
        while True:
            try:
                yielded = job.send(value) if value is not None else next(job)
            except StopIteration:
                with self.cond:
                    self.finished += 1
                    self.cond.notify_all()
                return
            value = None
            if isinstance(yielded, Checkpoint):
                with self.cond:
                    self.finished += 1
                    self.cond.notify_all()
            else:
                value = self.comm.all_reduce(self.rank, yielded)


class ThreadExecutor:
    """One worker thread per (queue, rank); collectives go through ``communicator.all_reduce``."""

    inline = False

    def __init__(self, communicator: Communicator, step_timeout_s: float = 5.0) -> None:
        self.communicator = communicator
        self.step_timeout_s = step_timeout_s
        self._workers: dict[tuple[str, int], _Worker] = {}
        self._lock = threading.Lock()
        self._errors: list[BaseException] = []

    def _worker(self, queue: str, rank: int) -> _Worker:
        with self._lock:
            worker = self._workers.get((queue, rank))
            if worker is None:
                worker = _Worker(f"hicache-{queue}-{rank}", rank, self.communicator, self._errors.append)
                self._workers[(queue, rank)] = worker
            return worker

    def submit(self, queue: str, rank: int, job: Job) -> None:
        worker = self._worker(queue, rank)
        with worker.cond:
            worker.jobs.append(job)
            worker.cond.notify_all()

    def complete(self, queue: str, rank: int, count: int) -> int:
        """Wait (at most ``step_timeout_s``) for ``count`` more steps, or until the queue is idle."""
        worker = self._worker(queue, rank)
        deadline = time.monotonic() + self.step_timeout_s
        with worker.cond:
            start = worker.finished
            while worker.finished - start < count and (worker.jobs or worker.busy):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                worker.cond.wait(left)
            return worker.finished - start

    def wait_all(self, queue: str, rank: int) -> None:
        worker = self._worker(queue, rank)
        with worker.cond:
            while worker.jobs or worker.busy:
                worker.cond.wait()

    def idle(self) -> bool:
        with self._lock:
            workers = list(self._workers.values())
        return all(not w.jobs and not w.busy for w in workers)

    def discard(self, rank: int) -> None:
        with self._lock:
            workers = [w for (_, r), w in self._workers.items() if r == rank]
        for w in workers:
            with w.cond:
                while len(w.jobs) > (1 if w.busy else 0):
                    w.jobs.pop()

    def check(self) -> None:
        if self._errors:
            raise self._errors[0]

    def close(self) -> None:
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for w in workers:
            with w.cond:
                w.stopping = True
                while len(w.jobs) > (1 if w.busy else 0):
                    w.jobs.pop()
                w.cond.notify_all()
        for w in workers:
            w.thread.join(timeout=self.step_timeout_s)
