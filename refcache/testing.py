"""Test doubles for the seams of ``refcache.runtime``: deterministic stand-ins that a test passes wherever
production code takes a ``Clock``, an ``Executor`` or a ``Communicator``. Public, so another engine's
tests can reuse them. Production code never imports this module (an import-linter contract in
``pyproject.toml`` says so); the one exception is ``refcache.gpu.driver``, the adapter that runs the
implementation under the harness with these doubles. The job and collective vocabulary (``Job``,
``CHECKPOINT``, ``AllReduce``, ``Collective``, ...) is imported from ``refcache.runtime``, not from here.

The doubles
-----------
**LogicalClock** — for behaviour that depends on time (prefetch timeouts): pass it as the ``Clock`` and
call ``advance(us)`` where the test wants time to pass; it never moves by itself.

**ManualExecutor** — for replaying an exact interleaving of background work: pass it as the ``Executor``.
It runs nothing by itself. ``complete(queue, rank, k)`` runs the next ``k`` steps of the oldest jobs of
that queue on that rank, on the caller's thread, so every interleaving is an explicit, replayable
operation; ``pending`` counts the jobs not finished yet and ``wait_all`` drains a queue. A step that
yields a collective *parks* its job (a parked job blocks its queue, like a thread blocked in
``all_reduce``); when the same channel has a parked job on every rank of its ``InProcessGroup``, the
values are reduced and every parked job resumes, in rank order, up to its next yield. A job's exception
propagates out of ``complete``.

**InProcessGroup(n)** — for ``n`` tensor-parallel ranks in one process, without ``torch.distributed``:

* ``run_lockstep(gens)`` steps the ranks' ``Collective`` generators together, reducing each time all of
  them have yielded (and raising ``UsageError`` if they disagree on what they reduce — the ranks
  diverged);
* ``arrive``/``parked`` are the non-blocking rendezvous behind ``ManualExecutor``'s parked jobs;
* ``all_reduce(rank, request)`` is the blocking rendezvous that worker threads use, so it is also a
  ``Communicator`` for ``refcache.runtime.ThreadExecutor``;
* ``log`` records every reduction as ``(channel, op, reduced values)`` (``keep_log=False`` turns this
  off), so a test can assert the collective sequence.

A test wires them up like this (two ranks' prefetch queries meeting in a MIN over the prefetch channel)::

    from refcache.runtime import AllReduce, Job, ReduceOp
    from refcache.testing import InProcessGroup, ManualExecutor

    group = InProcessGroup(2)
    executor = ManualExecutor(group)  # pass it to every rank as the Executor
    seen: dict[int, tuple[int, ...]] = {}

    def query(rank: int) -> Job:
        reply = yield AllReduce(ReduceOp.MIN, (rank + 3,), "prefetch")
        assert reply is not None
        seen[rank] = reply

    for rank in (0, 1):
        executor.submit("prefetch_query", rank, query(rank))
    executor.complete("prefetch_query", 0, 1)  # rank 0 parks in the collective
    assert seen == {} and group.parked("prefetch") == (0,)
    executor.complete("prefetch_query", 1, 1)  # rank 1 arrives: both resume, in rank order
    assert seen == {0: (3,), 1: (3,)} and group.log == [("prefetch", "min", (3,))]
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from refcache.errors import UsageError
from refcache.runtime import AllReduce, Checkpoint, Collective, Job, reduce_values

__all__ = ["InProcessGroup", "LogicalClock", "ManualExecutor"]

_T = TypeVar("_T")

# --- clock -------------------------------------------------------------------------------------------------


class LogicalClock:
    """Test clock: starts at ``start_us`` and moves only through ``advance``."""

    def __init__(self, start_us: int = 0) -> None:
        self._now = start_us

    def now_us(self) -> int:
        return self._now

    def advance(self, us: int) -> None:
        """Move forward by ``us`` microseconds. Raises ``UsageError`` for a negative step."""
        if us < 0:
            raise UsageError(f"the clock only moves forward; got us={us}")
        self._now += us


# --- collectives -------------------------------------------------------------------------------------------


@dataclass
class _Rendezvous:
    """One channel's blocking rendezvous: rows of the current round, then its result."""

    rows: dict[int, AllReduce] = field(default_factory=dict)
    result: tuple[int, ...] | None = None
    generation: int = 0
    leaving: int = 0


class InProcessGroup:
    """``size`` ranks in one process: lock-step scheduler generators, parked background collectives
    (``ManualExecutor``) and a blocking rendezvous for worker threads (``ThreadExecutor``).

    ``log`` records every reduction as ``(channel, op, reduced values)`` unless ``keep_log`` is False.
    """

    def __init__(self, size: int, *, keep_log: bool = True) -> None:
        if size < 1:
            raise UsageError(f"a group needs at least one rank, got {size}")
        self.size = size
        self.keep_log = keep_log
        self.log: list[tuple[str, str, tuple[int, ...]]] = []
        self._parked: dict[str, dict[int, AllReduce]] = {}  # ManualExecutor: channel -> rank -> request
        self._cond = threading.Condition()
        self._rendezvous: dict[str, _Rendezvous] = {}

    def _reduce(self, requests: Sequence[AllReduce]) -> tuple[int, ...]:
        first = requests[0]
        for other in requests[1:]:
            if (other.op, other.channel, len(other.values)) != (first.op, first.channel, len(first.values)):
                raise UsageError(f"ranks diverged: one reduces {first}, another {other}")
        result = reduce_values(first.op, [r.values for r in requests])
        if self.keep_log:
            self.log.append((first.channel, first.op.value, result))
        return result

    def run_lockstep(self, gens: Sequence[Collective[_T]]) -> list[_T]:
        """Run one generator per rank together; returns their results in rank order.

        Raises ``UsageError`` when the ranks diverge: some finish while others reduce, or they reduce
        different things.
        """
        if len(gens) != self.size:
            raise UsageError(f"{len(gens)} generators for a group of {self.size}")
        if self.size == 1:  # one rank: each all-reduce is its own request's values
            gen = gens[0]
            outcome = _start(gen)
            while isinstance(outcome, AllReduce):
                outcome = _send(gen, self._reduce([outcome]))
            return [outcome.value]
        outcomes: list[AllReduce | _Box[_T]] = [_start(g) for g in gens]
        while True:
            done = [o for o in outcomes if isinstance(o, _Box)]
            if len(done) == len(outcomes):
                return [o.value for o in done]
            if done:
                raise UsageError("ranks diverged: some finished while others wait in an all-reduce")
            requests = [o for o in outcomes if isinstance(o, AllReduce)]
            result = self._reduce(requests)
            outcomes = [_send(g, result) for g in gens]

    def arrive(self, rank: int, request: AllReduce) -> tuple[int, ...] | None:
        """Non-blocking: park ``rank``'s request on its channel; once every rank has parked, reduce and
        return the result (the caller resumes every parked job). Raises ``UsageError`` if the rank is
        already parked there."""
        parked = self._parked.setdefault(request.channel, {})
        if rank in parked:
            raise UsageError(f"rank {rank} is already parked on channel {request.channel!r}")
        parked[rank] = request
        if len(parked) < self.size:
            return None
        del self._parked[request.channel]
        return self._reduce([parked[r] for r in range(self.size)])

    def parked(self, channel: str) -> tuple[int, ...]:
        """Ranks with a parked request on ``channel``."""
        return tuple(sorted(self._parked.get(channel, {})))

    def all_reduce(self, rank: int, request: AllReduce) -> tuple[int, ...]:
        """Blocking rendezvous of worker threads (one per rank) on ``request.channel``."""
        with self._cond:
            rv = self._rendezvous.setdefault(request.channel, _Rendezvous())
            while rv.leaving:  # the previous round's result is still being collected
                self._cond.wait()
            rv.rows[rank] = request
            generation = rv.generation
            if len(rv.rows) == self.size:
                rv.result = self._reduce([rv.rows[r] for r in range(self.size)])
                rv.rows.clear()
                rv.generation += 1
                rv.leaving = self.size
                self._cond.notify_all()
            while rv.generation == generation:
                self._cond.wait()
            assert rv.result is not None
            result = rv.result
            rv.leaving -= 1
            if rv.leaving == 0:
                self._cond.notify_all()
            return result

    def clear(self, rank: int) -> None:
        """Forget ``rank``'s parked requests (after a reset dropped its jobs)."""
        for parked in self._parked.values():
            parked.pop(rank, None)


@dataclass(frozen=True)
class _Box(Generic[_T]):
    value: _T


def _start(gen: Collective[_T]) -> AllReduce | _Box[_T]:
    try:
        return next(gen)
    except StopIteration as stop:
        return _Box(stop.value)


def _send(gen: Collective[_T], value: tuple[int, ...]) -> AllReduce | _Box[_T]:
    try:
        return gen.send(value)
    except StopIteration as stop:
        return _Box(stop.value)


# --- executor ----------------------------------------------------------------------------------------------


@dataclass
class _Task:
    job: Job
    parked: AllReduce | None = None  # waiting in a collective


class ManualExecutor:
    """Jobs run only inside ``complete`` (see the module docstring); deterministic and single-threaded."""

    inline = True

    def __init__(self, group: InProcessGroup | None = None) -> None:
        self.group = group if group is not None else InProcessGroup(1)
        self._queues: dict[tuple[str, int], deque[_Task]] = {}

    def submit(self, queue: str, rank: int, job: Job) -> None:
        self._queues.setdefault((queue, rank), deque()).append(_Task(job))

    def pending(self, queue: str, rank: int) -> int:
        """Jobs of ``queue`` on ``rank`` not finished yet (parked ones included)."""
        return len(self._queues.get((queue, rank), ()))

    def complete(self, queue: str, rank: int, count: int) -> int:
        tasks = self._queues.get((queue, rank))
        done = 0
        while tasks and done < count and tasks[0].parked is None:
            self._step(queue, rank, None)
            done += 1
        return done

    def wait_all(self, queue: str, rank: int) -> None:
        tasks = self._queues.get((queue, rank))
        while tasks:
            if tasks[0].parked is not None:
                raise UsageError(f"{queue} on rank {rank} is parked in a collective; it cannot drain alone")
            self._step(queue, rank, None)

    def _step(self, queue: str, rank: int, value: tuple[int, ...] | None) -> None:
        """Run the head job of (queue, rank) up to its next yield; park or resolve collectives."""
        tasks = self._queues[(queue, rank)]
        task = tasks[0]
        task.parked = None
        try:
            yielded = task.job.send(value) if value is not None else next(task.job)
        except StopIteration:
            tasks.popleft()
            return
        if isinstance(yielded, Checkpoint):
            return
        task.parked = yielded
        result = self.group.arrive(rank, yielded)
        if result is None:
            return
        # Every rank is parked on this channel: resume them all, in rank order.
        for other in range(self.group.size):
            key = self._parked_queue(yielded.channel, other)
            self._step(key, other, result)

    def _parked_queue(self, channel: str, rank: int) -> str:
        for (queue, r), tasks in self._queues.items():
            if r == rank and tasks and tasks[0].parked is not None and tasks[0].parked.channel == channel:
                return queue
        raise UsageError(f"no job of rank {rank} is parked on channel {channel!r}")  # pragma: no cover

    def discard(self, rank: int) -> None:
        for (_, r), tasks in self._queues.items():
            if r == rank:
                tasks.clear()
        self.group.clear(rank)

    def check(self) -> None:
        pass

    def close(self) -> None:
        self._queues.clear()
