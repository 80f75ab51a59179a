"""``refcache replay``: re-execute a trace step by step on any systems of its family, stopping at the first
divergence or invariant violation; a trace recorded on an engine is compared with what the engine did."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from refcache.check.harness import Divergence, Harness, Outcome
from refcache.cli.options import (
    DEFAULT_AGAINST,
    Against,
    Oracle,
    TraceArgument,
    Verbose,
    _log_level,
    against_systems,
    console,
    fail,
    read_trace_of,
    require_installed,
    system_options_of,
)
from refcache.errors import TraceFormatError, UnsupportedError, UsageError
from refcache.ops import Op
from refcache.snapshot import Snapshot
from refcache.systems import open_systems

SHORT_HELP = "Re-execute a trace step by step; stop at a divergence."

Show = Callable[[int, Op, Outcome, Snapshot], None]


def replay(
    trace: TraceArgument,
    against: Against = DEFAULT_AGAINST,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only print the verdict.")] = False,
    oracle: Oracle = "full",
    verbose: Verbose = False,
) -> None:
    """Re-execute a trace step by step, printing a status line per step, and stop at the first divergence
    or invariant violation with a readable diff (node by token path, field, both values). Exit 1 then."""
    systems = against_systems(against)
    _log_level(verbose)
    options = system_options_of(systems, oracle)
    family, config, ops = read_trace_of(trace, systems)
    require_installed(systems)

    def show(index: int, op: Op, outcome: Outcome, snap: Snapshot) -> None:
        if not quiet:
            console.print(
                f"{index:>4} {op!r}\n     -> {outcome!r}\n     {family.status_line(snap)}",
                highlight=False,
                soft_wrap=True,
            )

    if _recorded(trace):  # recorded on an engine: compare with what the engine observed (refcache.recording)
        _replay_recorded(trace, systems, show)
        return
    try:
        with open_systems(systems, config, options) as opened:
            # the trace is the input: none written
            harness = Harness(config, opened, on_step=show, write_trace=False, invariants=family.invariants)
            for op in ops:
                harness.step(op)
    except UnsupportedError as error:  # an adapter that cannot drive the installed release
        raise fail(str(error)) from error
    except UsageError as error:
        raise fail(str(error)) from error
    except Divergence as error:
        console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from error
    except Exception as error:  # a system crashed while opening: a finding, not a usage error
        console.print(
            f"[red]CRASHED[/red] step 0: a system crashed when opened: {type(error).__name__}: {error}",
            highlight=False,
            soft_wrap=True,
        )
        raise typer.Exit(1) from error
    console.print(
        f"{trace}: {len(ops)} steps against {', '.join(systems)}: no divergence, every invariant held",
        highlight=False,
        soft_wrap=True,
    )


def _recorded(trace: Path) -> bool:
    from refcache.recording import is_recorded

    return is_recorded(trace)


def _replay_recorded(trace: Path, systems: tuple[str, ...], show: Show) -> None:
    """A recorded trace: each step's outcome (and snapshot, where recorded) is compared with the engine's."""
    from refcache.check.recorded import replay_recorded
    from refcache.recording import read_recording

    try:
        recording = read_recording(trace)
        steps = replay_recorded(recording, systems, on_step=show)
    except (UsageError, TraceFormatError) as error:
        raise fail(str(error)) from error
    except Divergence as error:
        console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
        console.print(f"the engine left the spec at step {error.step}", highlight=False)
        raise typer.Exit(1) from error
    console.print(
        f"{trace}: {steps} recorded steps of {recording.engine} against {', '.join(systems)}: "
        "no divergence, every invariant held",
        highlight=False,
        soft_wrap=True,
    )
