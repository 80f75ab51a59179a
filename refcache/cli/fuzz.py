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

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.harness import TRACE_DIR_ENV
from refcache.check.known import KnownFindings, known_report
from refcache.check.parallel import run_plan
from refcache.check.plan import ConfigOverrides, FuzzPlan, PlanError, fuzz_plan
from refcache.check.run import DEFAULT_CHUNK
from refcache.cli import options as o
from refcache.cli.shrink import shrink_file
from refcache.errors import ConfigError, UsageError
from refcache.hicache.trace import stamp_release, stamp_seed
from refcache.systems import engine_placements, engine_releases

SHORT_HELP = "Random operations on the systems side by side, compared."


def fuzz(
    minutes: o.Minutes = 1.0,
    against: o.Against = o.DEFAULT_AGAINST,
    examples: o.Examples = 0,
    tp_size: o.TpSizeOrDrawn = None,
    attention: o.AttentionOrDrawn = None,
    hicache_write_policy: o.WritePolicyOrDrawn = None,
    hicache_storage_prefetch_policy: o.PrefetchPolicyOrDrawn = None,
    radix_eviction_policy: o.EvictionPolicyOrDrawn = None,
    hicache_io_backend: o.IOBackendOrDrawn = None,
    hicache_mem_layout: o.MemLayoutOrDrawn = None,
    page_size: o.PageSizeOrDrawn = None,
    hicache_storage_backend: o.StorageBackendOrDrawn = None,
    l3: o.L3Alias = None,
    profile: o.Profile = "refcache",
    steps: o.Steps = budget.FUZZ_STEPS,
    batch: o.Batch = DEFAULT_CHUNK,
    shrink_seconds: o.ShrinkSeconds = 60.0,
    jobs: o.Jobs = 1,
    database: o.Database = None,
    seed: o.Seed = None,
    oracle: o.Oracle = "full",
    known: o.Known = None,
    verbose: o.Verbose = False,
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

    With --known FILE (repeatable; specs/sglang-known.json), a divergence that matches a known finding is
    recorded and the run goes on with the next example, so a known bug does not hide the next one; the
    report lists the known findings (count, id) apart from an unknown divergence, and the exit status is 1
    only for an unknown one. A --known list naming the finding that an engine's L3 runs with one value of a
    field for lifts that value (sglang: write_through, because of F1): the field is drawn or chosen again.
    """
    systems = o.against_systems(against)
    findings = o.known_findings(known)
    o._log_level(verbose)
    if not minutes and not examples:
        raise o.fail("--minutes 0 and --examples 0 set no limit: give one of them")
    storage, chosen = o.storage_backend(hicache_storage_backend, l3)
    overrides = ConfigOverrides(
        tp_size=tp_size,
        attention=attention,
        hicache_write_policy=hicache_write_policy,
        hicache_storage_prefetch_policy=hicache_storage_prefetch_policy,
        radix_eviction_policy=radix_eviction_policy,
        hicache_io_backend=hicache_io_backend,
        hicache_mem_layout=hicache_mem_layout,
        page_size=page_size,
        hicache_storage_backend=storage,
        without_storage=chosen and storage is None,
    )
    options = o.system_options_of(systems, oracle)
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
            known=tuple(finding.id for finding in findings.findings) if findings else (),
        )
    except PlanError as error:
        raise o.fail(o._option_message(str(error), error.fields, o.OPTION_NAMES)) from error
    o.require_installed(systems)
    for words in engine_placements(systems).values():  # a post release, a source checkout: what drives it
        o.errors.print(f"fuzz: {words}", highlight=False, markup=False, soft_wrap=True)
    o.errors.print(
        f"fuzz: seed {plan.seed} (rerun these examples with --seed {plan.seed})",
        highlight=False,
        soft_wrap=True,
    )
    _run(plan, findings)


def _run(plan: FuzzPlan, known: KnownFindings | None = None) -> None:
    """Run ``plan`` (``refcache.check.parallel.run_plan``) under one progress bar; print the report, or the
    failure, and shrink its trace (stamped with the run's seed) as ``refcache shrink`` does."""
    live = Coverage()  # one process: the machines' own ledger; workers: their totals
    started = time.monotonic()
    label = "fuzz" if plan.jobs == 1 else f"fuzz ×{plan.jobs}"
    columns = (TextColumn(f"[bold]{label}"), BarColumn(), o.LedgerColumn(live), TimeElapsedColumn())
    with Progress(*columns, console=o.errors) as progress:
        task = progress.add_task("fuzz", total=1.0)

        def advance(runs: int, steps: int) -> None:  # the larger of the two budgets' shares spent
            live.runs, live.steps = runs, steps
            spent = (time.monotonic() - started) / plan.seconds if plan.seconds else 0.0
            progress.update(task, completed=max(spent, runs / plan.examples if plan.examples else 0.0))

        try:
            outcome = run_plan(
                plan,
                live,
                on_progress=advance,
                report=lambda message: o.console.print(message, highlight=False, markup=False),
                known=known,
            )
        except (UsageError, ConfigError) as error:  # e.g. an adapter that cannot drive the installed release
            progress.stop()
            raise o.fail(str(error)) from error
        live.runs, live.steps = outcome.ledger.runs, outcome.ledger.steps  # the bar ends at the report's
        if outcome.failure is None:
            progress.update(task, completed=1.0)
    known_lines = [] if known is None else known_report(outcome.known, known)
    if outcome.failure is None:
        # one line per entry: a situation's meaning is not wrapped mid-phrase off a terminal
        o.console.print(plan.family_entry.report(outcome.ledger), highlight=False, soft_wrap=True)
        if known is not None:
            for line in known_lines:
                o.console.print(line, highlight=False, markup=False, soft_wrap=True)
            o.console.print("unknown divergences: 0", highlight=False)
        return
    for message in outcome.messages:
        o.console.print(message, highlight=False, markup=False)
    runs, steps = outcome.ledger.runs, outcome.ledger.steps
    where = (
        f"in example {runs} ({steps} steps)"
        if plan.jobs == 1
        else f"after {runs} examples ({steps} steps, {plan.jobs} workers)"
    )
    for line in known_lines:
        o.console.print(line, highlight=False, markup=False, soft_wrap=True)
    if known is not None:
        o.console.print("unknown divergences: 1 (below)", highlight=False)
    # paths and the replay command stay whole, to be copied
    o.console.print(f"[red]FAILED[/red] {where}: {outcome.failure}", highlight=False, soft_wrap=True)
    if outcome.trace_path is not None:
        trace = Path(outcome.trace_path)
        stamp_seed(trace, plan.seed)
        releases = engine_releases(plan.systems)  # the engine releases it was made against
        placed = engine_placements(plan.systems)  # and how a post release or a checkout was placed
        for engine, version in releases:
            stamp_release(trace, engine, version, placed.get(engine, ""))
        if plan.shrink_seconds > 0:
            shrink_file(
                trace, plan.systems, plan.shrink_seconds, None, plan.options, seed=plan.seed, known=known
            )
            shrunk = trace.with_name(trace.name.removesuffix(".jsonl") + ".min.jsonl")
            for engine, version in releases if shrunk.exists() else ():
                stamp_release(shrunk, engine, version, placed.get(engine, ""))
    raise typer.Exit(1)
