"""``refcache coverage``: the states, transitions and in-flight-table events a deterministic run reaches."""

from __future__ import annotations

from typing import Annotated

import typer
from hypothesis.stateful import run_state_machine_as_test
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from refcache.check import budget
from refcache.check.coverage import Coverage, coverage_report
from refcache.check.machines import machine
from refcache.check.run import hypothesis_storage
from refcache.cli import options as shared
from refcache.cli.options import LedgerColumn, Steps, console

SHORT_HELP = "States, transitions and tables a deterministic run reaches."


def coverage(
    examples: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=1,
            help=f"Examples per machine, as Hypothesis counts them (max_examples; the default test run uses "
            f"{budget.MODEL.examples}).",
        ),
    ] = budget.MODEL.examples,
    steps: Steps = budget.MODEL.steps,
) -> None:
    """Print the state, transition and in-flight-table coverage of a deterministic run of the model
    machines; exit 1 if some state, transition or table event was never reached.

    The report counts every example started, which includes the few Hypothesis discards.
    """
    ledger = Coverage()
    settings = budget.Budget(examples, steps).settings(derandomize=True)
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]coverage"),
        LedgerColumn(ledger),
        TimeElapsedColumn(),
        console=shared.errors,
        transient=True,  # the report on stdout stays the same, run after run
    ) as progress:
        progress.add_task("coverage", total=None)
        with hypothesis_storage():
            for faults in (False, True):
                run_state_machine_as_test(machine(faults=faults, coverage=ledger), settings=settings)  # type: ignore[no-untyped-call, unused-ignore]
    console.print(coverage_report(ledger), highlight=False, soft_wrap=True)  # never wrapped mid-phrase
    if ledger.missing():
        raise typer.Exit(1)
