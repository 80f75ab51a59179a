"""The seams: clocks, executors, run_local (refcache.runtime) and their doubles (refcache.testing)."""

from __future__ import annotations

import threading

import pytest

from refcache.errors import UsageError
from refcache.runtime import (
    CHECKPOINT,
    AllReduce,
    Collective,
    Job,
    MonotonicClock,
    ReduceOp,
    ThreadExecutor,
    job_of,
    reduce_values,
    run_local,
)
from refcache.testing import InProcessGroup, LogicalClock, ManualExecutor

# --- clocks ------------------------------------------------------------------------------------------------


def test_logical_clock_moves_only_when_advanced() -> None:
    clock = LogicalClock(5)
    assert clock.now_us() == 5
    clock.advance(10)
    assert clock.now_us() == 15
    with pytest.raises(UsageError):
        clock.advance(-1)
    assert clock.now_us() == 15


def test_monotonic_clock_never_goes_back() -> None:
    clock = MonotonicClock()
    a = clock.now_us()
    assert clock.now_us() >= a


# --- reductions and lock-step generators -------------------------------------------------------------------


def test_reduce_values_is_element_wise() -> None:
    assert reduce_values(ReduceOp.MIN, [(3, 1), (2, 5)]) == (2, 1)
    assert reduce_values(ReduceOp.MAX, [(3, 1), (2, 5)]) == (3, 5)
    with pytest.raises(UsageError):
        reduce_values(ReduceOp.MIN, [(1,), (1, 2)])


def _two_step(local: int, bonus: int) -> Collective[tuple[int, int]]:
    low = (yield AllReduce(ReduceOp.MIN, (local,)))[0]
    high = (yield AllReduce(ReduceOp.MAX, (local + bonus,)))[0]
    return low, high


def test_run_lockstep_reduces_at_every_yield_and_logs() -> None:
    group = InProcessGroup(3)
    results = group.run_lockstep([_two_step(v, b) for v, b in ((4, 0), (2, 9), (7, 1))])
    assert results == [(2, 11)] * 3
    assert group.log == [("scheduler", "min", (2,)), ("scheduler", "max", (11,))]
    alone = InProcessGroup(1)  # one rank takes a shorter path: the same answers and log
    assert alone.run_lockstep([_two_step(4, 3)]) == [(4, 7)]
    assert alone.run_lockstep([_finishes_early()]) == [0]
    assert alone.log == [("scheduler", "min", (4,)), ("scheduler", "max", (7,))]
    with pytest.raises(UsageError, match="2 generators for a group of 1"):
        alone.run_lockstep([_two_step(1, 0), _two_step(1, 0)])


def _finishes_early() -> Collective[int]:
    return 0
    yield AllReduce(ReduceOp.MIN, (0,))  # pragma: no cover - makes this a generator


def test_run_lockstep_detects_divergent_ranks() -> None:
    group = InProcessGroup(2)
    with pytest.raises(UsageError, match="diverged"):
        group.run_lockstep([_two_step(1, 0), _finishes_early()])

    def other_op() -> Collective[int]:
        return (yield AllReduce(ReduceOp.MAX, (1,)))[0]

    with pytest.raises(UsageError, match="diverged"):
        group.run_lockstep([_two_step(1, 0), other_op()])


def test_run_local_answers_each_yield_with_the_communicator() -> None:
    calls: list[AllReduce] = []

    class Doubling:
        size = 1

        def all_reduce(self, rank: int, request: AllReduce) -> tuple[int, ...]:
            calls.append(request)
            return tuple(2 * v for v in request.values)

    assert run_local(_two_step(3, 1), Doubling(), 0) == (6, 8)
    assert [c.op for c in calls] == [ReduceOp.MIN, ReduceOp.MAX]


def test_blocking_all_reduce_meets_every_thread_round_after_round() -> None:
    group = InProcessGroup(3)
    out: dict[int, list[tuple[int, ...]]] = {r: [] for r in range(3)}

    def worker(rank: int) -> None:
        for round_ in range(20):
            out[rank].append(group.all_reduce(rank, AllReduce(ReduceOp.MIN, (rank + round_,), "prefetch")))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert all(out[r] == [(round_,) for round_ in range(20)] for r in range(3))


# --- manual executor ---------------------------------------------------------------------------------------


def _steps(log: list[str], name: str, n: int) -> Job:
    for i in range(n):
        log.append(f"{name}{i}")
        if i < n - 1:
            yield CHECKPOINT


def test_manual_executor_runs_oldest_steps_only_when_told() -> None:
    log: list[str] = []
    ex = ManualExecutor()
    ex.submit("io", 0, _steps(log, "a", 2))
    ex.submit("io", 0, _steps(log, "b", 1))
    ex.submit("other", 0, job_of(lambda: log.append("x")))
    assert log == []
    assert ex.complete("io", 0, 1) == 1
    assert log == ["a0"]
    assert ex.pending("io", 0) == 2
    assert ex.complete("io", 0, 5) == 2  # a1, then b0; nothing else is runnable
    assert log == ["a0", "a1", "b0"]
    assert ex.complete("io", 0, 1) == 0
    ex.wait_all("other", 0)
    assert log[-1] == "x"


def _query(log: list[str], rank: int, hits: int) -> Job:
    log.append(f"query{rank}")
    reduced = yield AllReduce(ReduceOp.MIN, (hits,), channel="prefetch")
    assert reduced is not None
    log.append(f"resolved{rank}={reduced[0]}")


def test_manual_executor_parks_collectives_until_every_rank_arrives() -> None:
    group = InProcessGroup(2)
    ex = ManualExecutor(group)
    log: list[str] = []
    ex.submit("q", 0, _query(log, 0, 5))
    ex.submit("q", 0, _query(log, 0, 7))
    ex.submit("q", 1, _query(log, 1, 3))
    assert ex.complete("q", 0, 5) == 1  # parks; a parked job blocks its queue
    assert log == ["query0"]
    assert ex.complete("q", 0, 1) == 0
    assert group.parked("prefetch") == (0,)
    with pytest.raises(UsageError):
        ex.wait_all("q", 0)
    assert ex.complete("q", 1, 1) == 1  # the last rank arrives: both resume, in rank order
    assert log == ["query0", "query1", "resolved0=3", "resolved1=3"]
    assert ex.pending("q", 0) == 1 and ex.pending("q", 1) == 0
    assert group.log == [("prefetch", "min", (3,))]


def test_manual_executor_discard_drops_a_ranks_jobs() -> None:
    group = InProcessGroup(2)
    ex = ManualExecutor(group)
    log: list[str] = []
    ex.submit("q", 0, _query(log, 0, 1))
    ex.complete("q", 0, 1)
    ex.discard(0)
    assert ex.pending("q", 0) == 0 and group.parked("prefetch") == ()


# --- threaded executor -------------------------------------------------------------------------------------


def test_thread_executor_runs_jobs_and_meets_in_collectives() -> None:
    group = InProcessGroup(2)
    ex = ThreadExecutor(group)
    log: list[str] = []
    lock = threading.Lock()

    def query(rank: int, hits: int) -> Job:
        reduced = yield AllReduce(ReduceOp.MIN, (hits,), channel="prefetch")
        assert reduced is not None
        with lock:
            log.append(f"{rank}:{reduced[0]}")

    try:
        for rank, hits in ((0, 4), (1, 2)):
            ex.submit("q", rank, query(rank, hits))
        ex.wait_all("q", 0)
        ex.wait_all("q", 1)
        assert sorted(log) == ["0:2", "1:2"]
        ex.submit("io", 0, _steps(log, "s", 3))
        assert ex.complete("io", 0, 3) == 3
        assert log[-3:] == ["s0", "s1", "s2"]
        assert ex.idle()
    finally:
        ex.close()


def test_thread_executor_reports_job_errors() -> None:
    ex = ThreadExecutor(InProcessGroup(1))

    def boom() -> None:
        raise RuntimeError("boom")

    try:
        ex.submit("q", 0, job_of(boom))
        ex.wait_all("q", 0)
        with pytest.raises(RuntimeError, match="boom"):
            ex.check()
    finally:
        ex.close()
