"""The ``refcache`` command line.

``refcache fuzz`` runs the model state machines (fault-free and fault-injecting) for a time or example
budget with a progress bar and prints which states, transitions and in-flight table events were reached.
``refcache coverage`` runs the default (CI) budget deterministically and prints the same report.
"""

from __future__ import annotations

import time

import typer
from hypothesis import HealthCheck, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from refcache.strategies import COVERAGE, FaultyModelMachine, ModelMachine, coverage_report

app = typer.Typer(
    help="refcache: a formally-tested reference implementation of SGLang's hierarchical KV cache.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()


def _settings(examples: int, steps: int, *, derandomize: bool) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
    )


@app.command()
def fuzz(
    minutes: float = typer.Option(1.0, help="Stop after this many minutes (checked between batches)."),
    examples: int = typer.Option(0, help="Stop after this many examples per machine (0: no limit)."),
    steps: int = typer.Option(50, help="Operations per example."),
    batch: int = typer.Option(50, help="Examples per batch between progress updates."),
) -> None:
    """Run the model state machines with random operation sequences and check every invariant.

    Each batch draws fresh random examples (derandomize off). On a failure Hypothesis prints the shrunk
    operation sequence as a Python program, and the command exits with status 1.
    """
    deadline = time.monotonic() + minutes * 60
    done = 0
    with Progress(
        TextColumn("[bold]fuzz"), BarColumn(), TextColumn("{task.completed} examples, {task.fields[steps]} steps"),
        TimeElapsedColumn(), console=console,
    ) as progress:  # fmt: skip
        task = progress.add_task("fuzz", total=examples or None, steps=0)
        while time.monotonic() < deadline and (not examples or done < examples):
            n = batch if not examples else min(batch, examples - done)
            try:
                for machine in (ModelMachine, FaultyModelMachine):
                    run_state_machine_as_test(machine, settings=_settings(n, steps, derandomize=False))  # type: ignore[no-untyped-call]
            except (AssertionError, Flaky) as error:
                progress.stop()
                console.print(f"[red]FAILED[/red] after {done} examples: {error}")
                raise typer.Exit(1) from error
            done += n
            progress.update(task, completed=done, steps=COVERAGE.steps)
    console.print(coverage_report())


@app.command()
def coverage(
    examples: int = typer.Option(150, help="Examples per machine (the default test run uses 150)."),
    steps: int = typer.Option(50, help="Operations per example."),
) -> None:
    """Print the state, transition and in-flight-table coverage of a deterministic run; exit 1 if some
    state, transition or table event was never reached."""
    for machine in (ModelMachine, FaultyModelMachine):
        run_state_machine_as_test(machine, settings=_settings(examples, steps, derandomize=True))  # type: ignore[no-untyped-call]
    console.print(coverage_report(), highlight=False)
    if COVERAGE.missing():
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    app()
