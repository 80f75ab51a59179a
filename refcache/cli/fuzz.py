"""``refcache fuzz``: random operation sequences on the systems side by side, for a time or example budget.

The options become a ``refcache.check.plan.FuzzPlan`` (every decision about the systems is made there);
this module runs it in one process or in ``--jobs`` workers, with a progress bar, and on a failure shrinks
the failing trace as ``refcache shrink`` does.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path
from typing import Annotated

import typer
from hypothesis.errors import Flaky
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.harness import TRACE_DIR_ENV, Divergence
from refcache.check.plan import ConfigOverrides, FuzzPlan, PlanError, fuzz_plan
from refcache.check.run import DEFAULT_CHUNK, run_machines
from refcache.cli.options import (
    OPTION_NAMES,
    AttentionOrDrawn,
    EvictionPolicyOrDrawn,
    IOBackendOrDrawn,
    LedgerColumn,
    MemLayoutOrDrawn,
    Oracle,
    PageSizeOrDrawn,
    PrefetchPolicyOrDrawn,
    Profile,
    StorageBackendOrDrawn,
    TpSizeOrDrawn,
    Verbose,
    WritePolicyOrDrawn,
    _log_level,
    _option_message,
    against_systems,
    console,
    errors,
    fail,
    require_installed,
    system_options_of,
)
from refcache.cli.options import Against as AgainstOption
from refcache.cli.shrink import shrink_file
from refcache.trace import stamp_seed

SHORT_HELP = "Random operations on the systems side by side, compared."


def fuzz(
    minutes: Annotated[
        float,
        typer.Option(
            metavar="MINUTES",
            min=0,
            help="Stop after this many minutes, checked before every example (0: no time limit).",
        ),
    ] = 1.0,
    against: AgainstOption = "both",
    examples: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=0,
            help="Stop after this many examples, both machines together (0: only the time limit).",
        ),
    ] = 0,
    tp_size: TpSizeOrDrawn = None,
    attention: AttentionOrDrawn = None,
    hicache_write_policy: WritePolicyOrDrawn = None,
    hicache_storage_prefetch_policy: PrefetchPolicyOrDrawn = None,
    radix_eviction_policy: EvictionPolicyOrDrawn = None,
    hicache_io_backend: IOBackendOrDrawn = None,
    hicache_mem_layout: MemLayoutOrDrawn = None,
    page_size: PageSizeOrDrawn = None,
    hicache_storage_backend: StorageBackendOrDrawn = None,
    profile: Profile = "refcache",
    steps: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=1,
            help="Rule steps per example, at most (a step applies one or more operations).",
        ),
    ] = budget.FUZZ_STEPS,
    batch: Annotated[
        int, typer.Option(metavar="N", min=1, help="Examples one machine runs before the other takes over.")
    ] = DEFAULT_CHUNK,
    shrink_seconds: Annotated[
        float,
        typer.Option(
            metavar="SECONDS",
            min=0,
            help="Shrink a failing run's trace for at most this long (0: keep it whole).",
        ),
    ] = 60.0,
    jobs: Annotated[
        int,
        typer.Option(
            "--jobs",
            "-j",
            metavar="N",
            min=1,
            help="Worker processes, each its own fuzz loop with its own random examples; the budgets are "
            "the whole run's.",
        ),
    ] = 1,
    database: Annotated[
        Path | None,
        typer.Option(
            metavar="DIR",
            file_okay=False,
            help="Hypothesis' example database, shared by the workers (and by later runs, or other machines "
            "on a shared path): a failure found once is replayed first everywhere "
            "(default: hypothesis-db under the trace directory; only a failing example is written, beside "
            "its trace, so that the next run, with any --jobs, tries it first).",
        ),
    ] = None,
    seed: Annotated[
        int | None,
        typer.Option(
            metavar="N",
            min=0,
            help="The run's seed: the same seed, options and budget draw the same examples (with --jobs, "
            "each worker's; which examples they reach depends on timing). Default: a random one. Printed "
            "when the run starts and written in the header of every trace it writes.",
        ),
    ] = None,
    oracle: Oracle = "full",
    verbose: Verbose = False,
) -> None:
    """Run random operation sequences against the chosen systems side by side, comparing observations and
    snapshots and checking every invariant after every step.

    Two machines take turns, one without and one with storage faults. Configuration options left unset
    are drawn at random for each example; every example is fresh (derandomize off). The time and example
    budgets are checked before every example; the progress bar and the final report count the same
    examples and steps.

    On a failure the failing run is written as a JSONL trace ($REFCACHE_TRACE_DIR, default
    ./refcache-traces), then shrunk operation by operation (as `refcache shrink` does) into
    TRACE.min.jsonl; the replay command is printed and the command exits with status 1.

    CI=true changes nothing here: Hypothesis' CI profile (derandomized, no example database) is for the
    test suite; fuzz always draws fresh examples from its --seed and keeps a failing one in --database.
    To rerun a CI failure as it ran, give the seed it printed.
    """
    systems = against_systems(against)
    _log_level(verbose)
    if not minutes and not examples:
        raise fail("--minutes 0 and --examples 0 set no limit: give one of them")
    overrides = ConfigOverrides(
        tp_size=tp_size,
        attention=attention,
        hicache_write_policy=hicache_write_policy,
        hicache_storage_prefetch_policy=hicache_storage_prefetch_policy,
        radix_eviction_policy=radix_eviction_policy,
        hicache_io_backend=hicache_io_backend,
        hicache_mem_layout=hicache_mem_layout,
        page_size=page_size,
        hicache_storage_backend=None if hicache_storage_backend is None else hicache_storage_backend.value,
    )
    options = system_options_of(systems, oracle)
    try:
        plan = fuzz_plan(
            systems,
            overrides,
            profile=profile,
            steps=steps,
            examples=examples or None,
            seconds=minutes * 60 or None,
            database=database or Path(os.environ.get(TRACE_DIR_ENV) or "refcache-traces") / "hypothesis-db",
            seed=secrets.randbelow(2**32) if seed is None else seed,
            chunk=batch,
            jobs=jobs,
            shrink_seconds=shrink_seconds,
            options=options,
        )
    except PlanError as error:
        raise fail(_option_message(str(error), error.fields, OPTION_NAMES)) from error
    require_installed(systems)
    errors.print(
        f"fuzz: seed {plan.seed} (rerun these examples with --seed {plan.seed})",
        highlight=False,
        soft_wrap=True,
    )
    if plan.jobs > 1:
        _fuzz_parallel(plan)
    else:
        _fuzz_here(plan)


def _progress(plan: FuzzPlan, ledger: Coverage, label: str) -> Progress:
    return Progress(
        TextColumn(f"[bold]{label}"), BarColumn(), LedgerColumn(ledger), TimeElapsedColumn(), console=errors
    )


def _share_spent(plan: FuzzPlan, started: float, runs: int) -> float:
    """The larger of the two budgets' shares spent."""
    spent = (time.monotonic() - started) / plan.seconds if plan.seconds else 0.0
    return max(spent, runs / plan.examples if plan.examples else 0.0)


def _failed(plan: FuzzPlan, trace_path: Path | None) -> typer.Exit:
    """A failure's trace stamped with the run's seed and shrunk (``plan.shrink_seconds``); exit status 1."""
    if trace_path is not None:
        stamp_seed(trace_path, plan.seed)
        if plan.shrink_seconds > 0:
            shrink_file(trace_path, plan.systems, plan.shrink_seconds, None, plan.options, seed=plan.seed)
    return typer.Exit(1)


def _fuzz_here(plan: FuzzPlan) -> None:
    """``fuzz`` in this process."""
    family = plan.family_entry
    ledger = Coverage()
    machines = family.machines(plan.systems, plan.constraints, ledger, "", plan.options)
    started = time.monotonic()
    with _progress(plan, ledger, "fuzz") as progress:
        task = progress.add_task("fuzz", total=1.0)
        try:
            run_machines(
                machines,
                ledger,
                steps=plan.steps,
                examples=plan.examples,
                seconds=plan.seconds,
                chunk=plan.chunk,
                on_example=lambda: progress.update(task, completed=_share_spent(plan, started, ledger.runs)),
                report=lambda message: console.print(message, highlight=False, markup=False),
                database=plan.database,
                seed=plan.seed,
            )
        except (AssertionError, Flaky) as error:
            progress.stop()
            console.print(
                f"[red]FAILED[/red] in example {ledger.runs} ({ledger.steps} steps): {error}",
                highlight=False,
                soft_wrap=True,  # paths and the replay command stay whole, to be copied
            )
            raise _failed(plan, error.trace_path if isinstance(error, Divergence) else None) from error
        except Exception as error:  # a system crashed outside the harness (opening it): a finding
            progress.stop()
            console.print(
                f"[red]FAILED[/red] in example {ledger.runs}: a system crashed before its first step: "
                f"{type(error).__name__}: {error}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from error
        progress.update(task, completed=1.0)
    console.print(family.report(ledger), highlight=False)


def _fuzz_parallel(plan: FuzzPlan) -> None:
    """``fuzz --jobs N`` (N > 1): the workers of ``refcache.check.parallel``, one progress bar and one
    report over all of them; the first failure stops the others and is shrunk as in one process."""
    from refcache.check.parallel import run_parallel

    live = Coverage()  # the workers' totals, for the progress bar
    started = time.monotonic()
    with _progress(plan, live, f"fuzz ×{plan.jobs}") as progress:
        task = progress.add_task("fuzz", total=1.0)

        def advance(runs: int, done_steps: int) -> None:
            live.runs, live.steps = runs, done_steps
            progress.update(task, completed=_share_spent(plan, started, runs))

        outcome = run_parallel(plan, on_progress=advance)
        live.runs, live.steps = outcome.ledger.runs, outcome.ledger.steps
        if outcome.failure is not None:
            progress.stop()
            for message in outcome.messages:
                console.print(message, highlight=False, markup=False)
            console.print(
                f"[red]FAILED[/red] after {outcome.ledger.runs} examples ({outcome.ledger.steps} steps, "
                f"{plan.jobs} workers): {outcome.failure}",
                highlight=False,
                soft_wrap=True,
            )
            raise _failed(plan, None if outcome.trace_path is None else Path(outcome.trace_path))
        progress.update(task, completed=1.0)
    console.print(plan.family_entry.report(outcome.ledger), highlight=False)
