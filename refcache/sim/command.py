"""What ``refcache simulate`` does once its options are parsed (``refcache.cli`` parses them): read the
trace, run one simulation or a sweep under a progress bar, and print the report."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError, TransitionError
from refcache.sim.plot import plot_sweep, require_matplotlib
from refcache.sim.render import render_report, render_sweep, report_notes
from refcache.sim.report import SimReport, write_csv
from refcache.sim.simulator import SimOptions, simulate
from refcache.sim.sweep import SweepGrid, sweep
from refcache.sim.workload import Workload

__all__ = ["run_command"]


def run_command(
    trace: Path,
    config: HiCacheConfig,
    options: SimOptions,
    *,
    block_tokens: int = 16,
    limit: int | None = None,
    grid: SweepGrid | None = None,
    plot: Path = Path("simulate-sweep.png"),
    as_json: bool = False,
    per_request: Path | None = None,
    jobs: int = 1,
) -> int:
    """Read ``trace`` (its first ``limit`` requests, scaled to ``block_tokens``), replay it once, or once per
    point of ``grid`` (then plot the sweep to ``plot``), with a progress bar on stderr when that is a
    terminal, and print the report on stdout: tables, or JSON with ``as_json``. ``per_request`` names a
    CSV file for one row per request (``refcache.sim.report.write_csv``; one run only, with
    ``options.audit_every == 1``). A sweep checks that matplotlib imports before it simulates anything,
    prints a line per configuration on stderr when that is not a terminal, and runs its configurations in
    ``jobs`` processes (``refcache.sim.sweep.sweep``).

    Returns the exit status: 0; 2 when the trace, the configuration or a file fails; 1 when
    ``options.check_invariants`` finds a violation or the system makes an illegal node transition
    (``TransitionError``; a bug in the system either way). Failures are one message on stderr, without a
    traceback.
    """
    # Piped output (files, CI logs) gets room for the tables instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=max(Console().width, 132))
    status = Console(stderr=True)
    try:
        if grid is not None:
            require_matplotlib()  # before the grid runs (minutes), not after
        workload = Workload.from_trace(trace, block_tokens=block_tokens, limit=limit)
        runs = 1 if grid is None else grid.runs
        n = len(workload.requests)
        with Progress(
            TextColumn("[bold]simulate[/bold] {task.fields[run]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=status,
            transient=True,
            disable=not status.is_terminal,
        ) as progress:
            task = progress.add_task("simulate", total=n * runs, run="")
            done = [0]

            def tick(i: int) -> None:
                progress.update(task, completed=done[0] + i)

            def next_run(report: SimReport) -> None:
                done[0] += n
                progress.update(task, completed=done[0], run=f"({len(reports_so_far) + 1}/{runs})")
                reports_so_far.append(report)
                if not status.is_terminal:  # no bar off a terminal: a line per configuration instead
                    c = report.config
                    status.print(
                        f"simulate: {len(reports_so_far)}/{runs} done (L2 ratio {c.hicache_ratio:g}, "
                        f"{c.radix_eviction_policy.value}, {c.hicache_write_policy.value}; "
                        f"{time.monotonic() - started:.0f} s)",
                        highlight=False,
                        soft_wrap=True,
                    )

            reports_so_far: list[SimReport] = []
            started = time.monotonic()
            if grid is not None:
                reports = sweep(
                    workload,
                    config,
                    l2_ratios=grid.l2_ratios,
                    evictions=grid.evictions,
                    write_policies=grid.write_policies,
                    options=options,
                    trace_name=trace.name,
                    on_request=tick,
                    on_run=next_run,
                    jobs=jobs,
                )
            else:
                reports = [
                    simulate(
                        workload,
                        config,
                        options,
                        trace_name=trace.name,
                        on_request=tick,
                        per_request=per_request is not None,
                    )
                ]
        if grid is not None:
            plot_sweep(reports, plot)
        if per_request is not None:
            with open(per_request, "w", encoding="utf-8", newline="") as file:
                write_csv(reports[0].per_request, reports[0].config.page_size, file)
    except TransitionError as error:  # an illegal node transition: a bug in the system, not a usage error
        status.print(f"[red]BUG[/red] {error}", highlight=False, soft_wrap=True)
        return 1
    except (RefcacheError, OSError) as error:
        status.print(f"[red]error:[/red] {escape(str(error))}", highlight=False, soft_wrap=True)
        return 2
    except AssertionError as error:  # check_invariants found a violation: a bug in the system
        status.print(f"[red]INVARIANT VIOLATED[/red] {error}", highlight=False, soft_wrap=True)
        return 1
    if as_json:
        payload: object = [r.to_json() for r in reports] if grid is not None else reports[0].to_json()
        console.print_json(json.dumps(payload))
    elif grid is not None:
        console.print(render_sweep(reports))
        for note in report_notes(reports):
            console.print(f"[dim]note:[/dim] {note}", highlight=False)
        console.print(f"plot written to {plot}", soft_wrap=True)
    else:
        for renderable in render_report(reports[0]):
            console.print(renderable)
    if per_request is not None:
        status.print(f"{len(reports[0].per_request)} requests written to {per_request}", soft_wrap=True)
    return 0
