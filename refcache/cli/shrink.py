"""``refcache shrink``: cut a failing trace down to a short one that fails the same way (and ``fuzz``'s
shrinking of the trace it found)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from refcache.check.known import KnownFindings, system_releases
from refcache.check.shrink import Failure
from refcache.cli.options import (
    DEFAULT_AGAINST,
    Against,
    Oracle,
    TraceArgument,
    Verbose,
    _log_level,
    against_systems,
    console,
    errors,
    fail,
    read_trace_of,
    require_installed,
    system_options_of,
)
from refcache.errors import UsageError
from refcache.hicache.trace import stamp_seed
from refcache.systems import SystemOptions

SHORT_HELP = "Cut a failing trace to a short one failing the same way."


def shrink(
    trace: TraceArgument,
    against: Against = DEFAULT_AGAINST,
    seconds: Annotated[
        float, typer.Option(metavar="SECONDS", min=0, help="Stop shrinking after about this many seconds.")
    ] = 60.0,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", metavar="FILE", help="Where to write the shrunk trace (default: TRACE.min.jsonl)."
        ),
    ] = None,
    oracle: Oracle = "full",
    verbose: Verbose = False,
) -> None:
    """Shrink a failing trace to a short sub-sequence of its operations that fails the same way (ddmin over
    operations, each candidate replayed on fresh systems), and write it next to the original."""
    systems = against_systems(against)
    _log_level(verbose)
    shrink_file(trace, systems, seconds, out, system_options_of(systems, oracle))


def shrink_file(
    trace: Path,
    systems: tuple[str, ...],
    seconds: float,
    out: Path | None,
    options: SystemOptions,
    *,
    seed: int | None = None,
    known: KnownFindings | None = None,
) -> None:
    """Shrink ``trace`` on ``systems`` for about ``seconds``, write the result to ``out`` (default
    TRACE.min.jsonl; its header names ``seed``, the fuzz run's, if given) and print how to replay it; a
    trace that does not fail is one error line, exit 2. With ``known`` (fuzz --known), a shrunk candidate
    must still fail in a way no known finding explains: shrinking never trades the new bug for a known one."""
    family, _config, length = read_trace_of(trace, systems)
    require_installed(systems)
    target = out or trace.with_name(trace.name.removesuffix(".jsonl") + ".min.jsonl")
    try:
        with Progress(
            TextColumn("{task.description}"), TimeElapsedColumn(), console=errors, transient=True
        ) as progress:
            task = progress.add_task(f"shrinking {length} operations", total=None)

            def show(length: int, replays: int) -> None:
                progress.update(task, description=f"{length} operations after {replays} replays")

            keep = None
            if known:
                releases = system_releases(systems)

                def keep(failure: Failure) -> bool:
                    return known.match(failure, releases) is None

            result = family.shrink(
                trace, target, systems, options, seconds=seconds, on_progress=show, keep=keep
            )
    except UsageError as error:
        raise fail(f"{trace}: {error}") from error
    if seed is not None:
        stamp_seed(target, seed)
    verdict = "1-minimal" if result.complete else "time budget reached, may shrink further"
    console.print(
        f"{result.original_length} -> {result.length} operations ({result.replays} replays, "
        f"{result.seconds:.1f} s, {verdict}); still fails: {result.failure.message}\n"
        f"written to {target}; replay with: refcache replay {target} --against {','.join(systems)}",
        highlight=False,
        soft_wrap=True,
    )
