"""``refcache fuzz --jobs N``: N worker processes, each its own fuzz loop (``run_machines``, fresh random
examples), one budget for the whole run, one Hypothesis example database for all of them.

The workers are started with the ``spawn`` context (torch is not fork-safe once it has run). What they
share is three counters and an event: examples claimed (the example budget: a worker claims an example
before it starts, so the run ends exactly at the budget), examples and steps done (the progress bar), and
``stop`` (set on the first failure, so the others end before their next example). The time budget is one
wall-clock deadline. Each worker sends back its coverage ledger, and a failure's message and trace path;
``run_parallel`` sums the ledgers (``merged``). Every worker gets the run's ``FuzzPlan`` as it is, and the
known findings (``refcache fuzz --known``) if any: each records its own known divergences and sends them back
with its ledger (``Outcome.known``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import queue
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hypothesis.errors import Flaky

from refcache.check.coverage import Coverage
from refcache.check.families import family_checks
from refcache.check.harness import Divergence
from refcache.check.known import KnownFindings, KnownHit, KnownRecorder
from refcache.check.plan import FuzzPlan
from refcache.check.run import BudgetSpent, run_machines, sub_seed
from refcache.errors import ConfigError, UsageError

__all__ = ["Outcome", "merged", "run_parallel", "run_plan"]


def merged(ledgers: Iterable[Coverage]) -> Coverage:
    """The sum of ``ledgers`` (counters added, counts added; ``first_failure`` the first nonzero;
    ``first_reached`` the earliest per situation)."""
    total = Coverage()
    for ledger in ledgers:
        for f in dataclasses.fields(Coverage):
            mine, theirs = getattr(total, f.name), getattr(ledger, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            elif f.name == "first_reached":  # each worker counts its own examples: the earliest of them
                for name, example in theirs.items():
                    mine[name] = min(mine.get(name, example), example)
            elif f.name == "first_failure":
                total.first_failure = total.first_failure or theirs
            else:
                setattr(total, f.name, mine + theirs)
    return total


@dataclass
class Outcome:
    """What a parallel run ended with: every worker's ledger summed, and the first failure if any."""

    ledger: Coverage
    failure: str | None = None  # the failure's message
    trace_path: str | None = None  # the trace its harness wrote (a divergence)
    messages: list[str] = field(default_factory=list)  # Hypothesis' messages about it
    known: list[KnownHit] = field(default_factory=list)  # divergences that matched a known finding


def _worker(index: int, plan: FuzzPlan, shared: dict[str, Any], known: KnownFindings | None = None) -> None:
    ledger = Coverage()
    recorder = KnownRecorder(known, plan.systems, ledger) if known else None
    hits: list[KnownHit] = [] if recorder is None else recorder.hits
    family = family_checks(plan.family)
    machines = family.machines(plan.systems, plan.constraints, ledger, f"-{index}", plan.options)
    claimed, runs, steps, stop, results = (shared[k] for k in ("claimed", "runs", "steps", "stop", "results"))
    synced = [0, 0]

    def sync() -> None:
        with runs.get_lock():
            runs.value += ledger.runs - synced[0]
        with steps.get_lock():
            steps.value += ledger.steps - synced[1]
        synced[:] = [ledger.runs, ledger.steps]

    def gate() -> None:  # before every example: the shared budget, claimed one example at a time
        sync()
        if stop.is_set():
            raise BudgetSpent
        if plan.examples:
            with claimed.get_lock():
                if claimed.value >= plan.examples:
                    raise BudgetSpent
                claimed.value += 1

    messages: list[str] = []
    deadline = shared["deadline"]
    try:
        run_machines(
            machines,
            ledger,
            steps=plan.steps,
            seconds=None if deadline is None else max(0.0, deadline - time.time()),
            chunk=plan.chunk,
            on_example=gate,
            report=messages.append,
            database=plan.database,
            seed=sub_seed(plan.seed, -1, index),  # each worker its own stream, fixed by the run's seed
            known=recorder,
        )
    except (AssertionError, Flaky) as error:
        stop.set()
        sync()
        path = getattr(error, "trace_path", None) if isinstance(error, Divergence) else None
        results.put((index, ledger, str(error), None if path is None else str(path), messages, hits))
        return
    except BaseException:
        stop.set()
        sync()
        results.put((index, ledger, traceback.format_exc(), None, messages, hits))
        return
    sync()
    results.put((index, ledger, None, None, messages, hits))


def run_parallel(
    plan: FuzzPlan,
    on_progress: Callable[[int, int], None] | None = None,
    known: KnownFindings | None = None,
) -> Outcome:
    """Run ``plan.jobs`` workers (module docstring) until the plan's budget is spent or one fails (a known
    finding is recorded, not a failure). ``on_progress(examples, steps)`` is called about five times a second
    with the run's totals so far."""
    jobs = plan.jobs
    context = multiprocessing.get_context("spawn")
    shared: dict[str, Any] = {
        "claimed": context.Value("q", 0),
        "runs": context.Value("q", 0),
        "steps": context.Value("q", 0),
        "stop": context.Event(),
        "results": context.Queue(),
        "deadline": None if plan.seconds is None else time.time() + plan.seconds,  # one for every worker
    }
    workers = [
        context.Process(target=_worker, args=(i, plan, shared, known), daemon=True) for i in range(jobs)
    ]
    for worker in workers:
        worker.start()
    received: dict[int, tuple[Coverage, str | None, str | None, list[str], list[KnownHit]]] = {}
    first: int | None = None
    try:
        while len(received) < jobs:
            if on_progress is not None:
                on_progress(shared["runs"].value, shared["steps"].value)
            try:
                index, ledger, failure, path, messages, hits = shared["results"].get(timeout=0.2)
            except queue.Empty:
                dead = [i for i, w in enumerate(workers) if not w.is_alive() and i not in received]
                if dead and shared["results"].empty():
                    time.sleep(0.5)  # a result may still be in the pipe
                    if shared["results"].empty():
                        raise RuntimeError(f"fuzz worker {dead[0]} died without a result") from None
                continue
            received[index] = (ledger, failure, path, messages, hits)
            if failure is not None and first is None:
                first = index
                shared["stop"].set()
    finally:
        shared["stop"].set()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.terminate()
    outcome = Outcome(merged(r[0] for r in received.values()))
    outcome.known = [hit for index in sorted(received) for hit in received[index][4]]
    if first is not None:
        _, outcome.failure, outcome.trace_path, outcome.messages, _ = received[first]
    return outcome


def run_plan(
    plan: FuzzPlan,
    ledger: Coverage,
    *,
    on_progress: Callable[[int, int], None] | None = None,
    report: Callable[[str], None] = print,
    known: KnownFindings | None = None,
) -> Outcome:
    """Run ``plan``: in this process when ``plan.jobs`` is 1 (``ledger`` is the one its machines fill, so a
    progress bar reading it moves during an example), else in ``plan.jobs`` workers (``run_parallel``;
    ``ledger`` is left alone, the outcome's is their sum). ``on_progress(examples, steps)`` before every
    example (one process) or about five times a second (workers); Hypothesis' messages go to ``report``
    (workers: into the outcome). A failure is returned, not raised: its message and, for a divergence,
    the trace path. A ``UsageError`` or ``ConfigError`` from opening a system (say, an adapter that cannot
    drive the installed release) is raised: it is the user's to fix, not a finding. A divergence that matches
    one of ``known`` is recorded (``Outcome.known``) and the run goes on."""
    if plan.jobs > 1:
        return run_parallel(plan, on_progress, known)
    recorder = KnownRecorder(known, plan.systems, ledger) if known else None
    hits: list[KnownHit] = [] if recorder is None else recorder.hits
    machines = family_checks(plan.family).machines(plan.systems, plan.constraints, ledger, "", plan.options)
    try:
        run_machines(
            machines,
            ledger,
            steps=plan.steps,
            examples=plan.examples,
            seconds=plan.seconds,
            chunk=plan.chunk,
            on_example=None if on_progress is None else lambda: on_progress(ledger.runs, ledger.steps),
            report=report,
            database=plan.database,
            seed=plan.seed,
            known=recorder,
        )
    except (AssertionError, Flaky) as error:
        path = error.trace_path if isinstance(error, Divergence) else None
        return Outcome(ledger, str(error), None if path is None else str(path), known=hits)
    except (UsageError, ConfigError):  # a system that cannot run here (an unsupported release): not a finding
        raise
    except Exception as error:  # raised outside the harness's steps: a system that crashed when opened
        return Outcome(
            ledger, f"a system crashed before its first step: {type(error).__name__}: {error}", known=hits
        )
    return Outcome(ledger, known=hits)
