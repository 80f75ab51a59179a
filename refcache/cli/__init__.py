"""The ``refcache`` command line: one module per command over a shared option table.

``refcache fuzz`` runs the state machines (fault-free and fault-injecting) for a time or example budget
with a progress bar and prints which states, transitions and in-flight table events were reached.
``refcache coverage`` runs the default (CI) budget deterministically and prints the same report.
``refcache explore`` checks every operation sequence up to a depth on a small configuration (breadth first,
shortest counterexample). ``refcache replay`` re-executes a trace step by step; ``refcache shrink`` cuts a failing trace down to a
short one that fails the same way; ``refcache simulate`` runs a request trace through the cache;
``refcache record`` runs one through a real engine with its recorder on; ``refcache bisect`` replays a trace
(or fuzzes) on each release of an engine, each in a cached environment of its own.

The commands parse options and print; what the options mean for the systems is decided in the checking
side (``refcache.check.plan``), never here by a system's name.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

import refcache
from refcache.cli import bisect, coverage, explore, fuzz, record, replay, shrink, simulate
from refcache.cli.options import Command, LedgerColumn, console, errors
from refcache.cli.options import _log_level as _log_level  # the tests' handles on the shared helpers
from refcache.cli.options import _option_message as _option_message

__all__ = ["LedgerColumn", "app", "main"]

app = typer.Typer(
    help="refcache: a formally-tested reference implementation of SGLang's hierarchical KV cache.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's help: paragraphs reflowed, option names never cut
)

TORCH_THREADS_ENV = "REFCACHE_TORCH_THREADS"  # refcache.gpu.threads (not imported: it imports torch)


def _version(shown: bool) -> None:
    if shown:
        console.print(f"refcache {refcache.__version__}", highlight=False)
        raise typer.Exit


@app.callback()
def _start(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_version, help="Print refcache's version and exit."
        ),
    ] = False,
) -> None:
    """Before any command opens a system: torch gets one intra-op thread (``REFCACHE_TORCH_THREADS=1``,
    applied when ``refcache.gpu`` is imported; specs/data-plane.md), unless the user set it or
    ``OMP_NUM_THREADS``. An environment variable, so that worker processes inherit it."""
    if TORCH_THREADS_ENV not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ[TORCH_THREADS_ENV] = "1"


for _module, _command in (
    (fuzz, fuzz.fuzz),
    (coverage, coverage.coverage),
    (replay, replay.replay),
    (shrink, shrink.shrink),
    (simulate, simulate.simulate),
    (record, record.record),
    (explore, explore.explore),
    (bisect, bisect.bisect),
):
    app.command(cls=Command, short_help=_module.SHORT_HELP)(_command)


def main(argv: list[str] | None = None) -> None:
    """The ``refcache`` console command: ``app``, with a usage error (a bad option value, an unknown option,
    a missing argument) printed as one line that names the option, exit status 2."""
    try:
        status = app(argv, prog_name="refcache", standalone_mode=False)
    except typer.Abort:
        raise SystemExit(1) from None
    except typer.TyperException as error:  # typer's click: usage errors carry exit code 2
        if type(error).__name__ == "NoArgsIsHelpError":  # plain ``refcache``: the help, as click prints it
            console.print(error.format_message(), highlight=False, markup=False)
        else:
            errors.print(f"[red]error:[/red] {error.format_message()}", highlight=False, soft_wrap=True)
        raise SystemExit(error.exit_code) from None
    raise SystemExit(status if isinstance(status, int) else 0)
