"""The ``refcache`` command line.

``refcache fuzz`` runs the model state machines (fault-free and fault-injecting) for a time or example
budget with a progress bar and prints which states, transitions and in-flight table events were reached.
``refcache coverage`` runs the default (CI) budget deterministically and prints the same report.
``refcache replay`` re-executes a trace step by step; ``refcache shrink`` cuts a failing trace down to a
short one that fails the same way; ``refcache simulate`` runs a request trace through the cache.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text
from typer.core import TyperCommand

from refcache.check import budget
from refcache.check.coverage import Coverage, coverage_report
from refcache.check.families import Checks, StepView, check_trace_family, family_of
from refcache.check.harness import TRACE_DIR_ENV, Divergence
from refcache.check.machines import machine
from refcache.check.run import DEFAULT_CHUNK, hypothesis_storage, run_machines
from refcache.config import (
    PROFILES,
    AttentionKind,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import ConfigError, RankError, RecordingError, TraceFormatError, UsageError
from refcache.sim import SimOptions, SweepGrid, run_command
from refcache.systems import (
    SYSTEMS,
    SystemOptions,
    parse_against,
    required_constraints,
    system_options,
)

app = typer.Typer(
    help="refcache: a formally-tested reference implementation of SGLang's hierarchical KV cache.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's help: paragraphs reflowed, option names never cut
)
console = Console()
errors = Console(stderr=True)

TORCH_THREADS_ENV = "REFCACHE_TORCH_THREADS"  # refcache.gpu.threads (not imported: it imports torch)


@app.callback()
def _start() -> None:
    """Before any command opens a system: torch gets one intra-op thread (``REFCACHE_TORCH_THREADS=1``,
    applied when ``refcache.gpu`` is imported; specs/data-plane.md), unless the user set it or
    ``OMP_NUM_THREADS``. An environment variable, so that worker processes inherit it."""
    if TORCH_THREADS_ENV not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        os.environ[TORCH_THREADS_ENV] = "1"


class _Command(TyperCommand):
    """A command whose usage line names its arguments plainly (``TRACE``), without the braces typer puts
    around required ones."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:  # typer's (vendored) click.Context
        return [
            piece[1:-1] if piece.startswith("{") and piece.endswith("}") else piece
            for piece in super().collect_usage_pieces(ctx)
        ]


# error lines and progress bars: stdout keeps the reports

# Configuration fields whose command-line option has another name (the others are ``--field-name``).
_OPTION_NAMES = {"device_size": "--l1-tokens", "hicache_storage_backend": "--l3"}  # simulate's
STORAGE_FIELD = "hicache_storage_backend"
_FUZZ_NAMES = {STORAGE_FIELD: "--hicache-storage-backend"}  # fuzz names every field by SGLang's flag


def _option_message(message: str, fields: Iterable[str], names: Mapping[str, str] = _OPTION_NAMES) -> str:
    """``message`` (a ``ConfigError`` or ``UsageError`` naming configuration fields, ``device_size=-5``)
    with each of ``fields`` named by its command-line option instead (``--l1-tokens -5``); ``names``: the
    options whose name is not ``--field-name`` (``simulate``'s)."""
    for field in sorted(fields, key=len, reverse=True):
        option = names.get(field, "--" + field.replace("_", "-"))
        message = re.sub(rf"\b{field}=", f"{option} ", message)
        message = re.sub(rf"\b{field}\b", option, message)
    return message


def _fail(message: str, status: int = 2) -> typer.Exit:
    """Print ``message`` as one error line on stderr; the ``typer.Exit`` to raise (default status 2)."""
    errors.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True, markup=True)
    return typer.Exit(status)


class LedgerColumn(ProgressColumn):
    """Examples and steps as a coverage ledger counts them: read at every refresh, so the numbers move
    while an example runs and end equal to the final report's."""

    def __init__(self, ledger: Coverage) -> None:
        super().__init__()
        self.ledger = ledger

    def render(self, task: Task) -> Text:
        return Text(f"{self.ledger.runs:,} examples, {self.ledger.steps:,} steps")


# --- one vocabulary of options for every command --------------------------------------------------------
# Configuration options carry SGLang's server flag names (``--hicache-write-policy``, ...), with the short
# names earlier refcache releases used as aliases. Enum options name their choices in the help text and
# show a short metavar: typer's default metavar lists every choice and cuts the option names short at 80
# columns. In ``fuzz`` an option left unset is drawn at random (the ``...OrDrawn`` forms: typer reads the
# option from ``Annotated[X | None, ...]``, not from ``Annotated[X, ...] | None``).
_DRAWN = " Unset: drawn at random for each example."


def _choices(kind: type[enum.StrEnum]) -> str:
    return ", ".join(member.value for member in kind)


def _page_size(extra: str = "") -> Any:
    return typer.Option(
        "--page-size", min=1, metavar="N", help="Tokens per page (SGLang --page-size)." + extra
    )


def _tp_size(extra: str = "") -> Any:
    return typer.Option(
        "--tp-size", "--tp", min=1, metavar="N", help="Tensor-parallel ranks (SGLang --tp-size)." + extra
    )


def _attention(extra: str = "") -> Any:
    return typer.Option("--attention", metavar="KIND", case_sensitive=False, help="MHA or MLA." + extra)


def _enum_option(names: tuple[str, ...], kind: type[enum.StrEnum], metavar: str, extra: str = "") -> Any:
    return typer.Option(*names, metavar=metavar, help=f"SGLang {names[0]}: {_choices(kind)}.{extra}")


_WRITE = ("--hicache-write-policy", "--write-policy")
_PREFETCH = ("--hicache-storage-prefetch-policy", "--prefetch-policy")
_EVICTION = ("--radix-eviction-policy", "--eviction-policy")
_IO = ("--hicache-io-backend", "--io-backend")
_LAYOUT = ("--hicache-mem-layout", "--mem-layout")

PageSize = Annotated[int, _page_size()]
TpSize = Annotated[int, _tp_size()]
Attention = Annotated[AttentionKind, _attention()]
WritePolicyOption = Annotated[WritePolicy, _enum_option(_WRITE, WritePolicy, "POLICY")]
PrefetchPolicyOption = Annotated[PrefetchPolicy, _enum_option(_PREFETCH, PrefetchPolicy, "POLICY")]
EvictionPolicyOption = Annotated[EvictionPolicy, _enum_option(_EVICTION, EvictionPolicy, "POLICY")]
MemLayoutOption = Annotated[MemLayout, _enum_option(_LAYOUT, MemLayout, "LAYOUT")]

PageSizeOrDrawn = Annotated[int | None, _page_size(_DRAWN)]
TpSizeOrDrawn = Annotated[int | None, _tp_size(_DRAWN)]
AttentionOrDrawn = Annotated[AttentionKind | None, _attention(_DRAWN)]
WritePolicyOrDrawn = Annotated[WritePolicy | None, _enum_option(_WRITE, WritePolicy, "POLICY", _DRAWN)]
PrefetchPolicyOrDrawn = Annotated[
    PrefetchPolicy | None, _enum_option(_PREFETCH, PrefetchPolicy, "POLICY", _DRAWN)
]
EvictionPolicyOrDrawn = Annotated[
    EvictionPolicy | None, _enum_option(_EVICTION, EvictionPolicy, "POLICY", _DRAWN)
]
IOBackendOrDrawn = Annotated[IOBackend | None, _enum_option(_IO, IOBackend, "BACKEND", _DRAWN)]
MemLayoutOrDrawn = Annotated[MemLayout | None, _enum_option(_LAYOUT, MemLayout, "LAYOUT", _DRAWN)]


class StorageBackend(enum.StrEnum):
    """``--hicache-storage-backend`` in ``fuzz``: the L3 backends every system with L3 runs."""

    FILE = "file"


StorageBackendOrDrawn = Annotated[
    StorageBackend | None,
    typer.Option(
        "--hicache-storage-backend",
        metavar="BACKEND",
        help="SGLang --hicache-storage-backend: file (L3 in files). Unset: drawn at random for each example "
        "(no L3 for an engine adapter).",
    ),
]
_SYSTEM_NAMES = ", ".join(SYSTEMS)
Against = Annotated[
    str,
    typer.Option(
        "--against",
        metavar="SYSTEMS",
        help=f"The systems to run, comma-separated, the first is the reference ({_SYSTEM_NAMES}); "
        "both = model,impl.",
    ),
]

_ORACLE_MODES = ("full", "sampled", "off")
Oracle = Annotated[
    str,
    typer.Option(
        "--oracle",
        metavar="|".join(_ORACLE_MODES),
        help="The implementation's KV content oracle (impl only): full checks every position of every "
        "read, sampled every 8th and the last of each read, off none (fastest).",
    ),
]


def _system_options(systems: tuple[str, ...], oracle: str) -> SystemOptions:
    """The per-system options the command line sets (``refcache.systems.system_options``); exit 2 for a
    bad value or one no system of the run takes."""
    if oracle not in _ORACLE_MODES:
        raise _fail(f"--oracle {oracle!r} is not one of {', '.join(_ORACLE_MODES)}")
    if oracle == "full":  # the default: every system's own default
        return {}
    try:
        return system_options(systems, {"oracle": oracle})
    except UsageError as error:
        raise _fail(_option_message(str(error), ["oracle"])) from error


Verbose = Annotated[
    bool,
    typer.Option(
        "--verbose",
        "-v",
        help="Show the implementation's warnings, among them the storage faults the machines inject "
        "(each says 'injected fault').",
    ),
]


def _log_level(verbose: bool) -> None:
    """Keep the implementation's warnings (``refcache.gpu`` loggers: failed L3 reads and writes, which
    the fault-injecting machines cause on purpose) out of the console unless ``verbose``."""
    logging.getLogger("refcache.gpu").setLevel(logging.WARNING if verbose else logging.ERROR)


def _against(text: str) -> tuple[str, ...]:
    try:
        return parse_against(text)
    except UsageError as error:
        raise typer.BadParameter(str(error), param_hint="--against") from error


TraceArgument = Annotated[
    Path,
    typer.Argument(
        exists=True, dir_okay=False, metavar="TRACE", help="A refcache JSONL trace (specs/trace-format.md)."
    ),
]


@app.command(cls=_Command, short_help="Random operations on the systems side by side, compared.")
def fuzz(
    minutes: Annotated[
        float,
        typer.Option(
            metavar="MINUTES",
            min=0,
            help="Stop after this many minutes, checked before every example (0: no time limit).",
        ),
    ] = 1.0,
    against: Against = "both",
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
    profile: Annotated[
        str,
        typer.Option(
            metavar="|".join(PROFILES),
            help="Where refcache decided otherwise than SGLang 0.5.20 (specs/decisions.md): follow refcache's "
            "decisions, or SGLang 0.5.20 at each one.",
        ),
    ] = "refcache",
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
    """
    systems = _against(against)
    _log_level(verbose)
    if not minutes and not examples:
        raise _fail("--minutes 0 and --examples 0 set no limit: give one of them")
    fixed: Mapping[str, object | None] = {
        "tp_size": tp_size,
        "attention": attention,
        "hicache_write_policy": hicache_write_policy,
        "hicache_storage_prefetch_policy": hicache_storage_prefetch_policy,
        "radix_eviction_policy": radix_eviction_policy,
        "hicache_io_backend": hicache_io_backend,
        "hicache_mem_layout": hicache_mem_layout,
        "page_size": page_size,
        "hicache_storage_backend": None if hicache_storage_backend is None else hicache_storage_backend.value,
    }
    constraints: dict[str, object] = {name: value for name, value in fixed.items() if value is not None}
    family = family_of(systems)
    options = _system_options(systems, oracle)
    if not family.constrained and (constraints or profile != "refcache"):
        chosen = [*constraints, *(["profile"] if profile != "refcache" else [])]
        raise _fail(
            _option_message(
                f"{', '.join(chosen)} do not apply to {family.summary} systems",
                [*fixed, "profile"],
                _FUZZ_NAMES,
            )
        )
    try:
        needed = required_constraints(systems, constraints)  # e.g. one or two ranks for an engine adapter
    except UsageError as error:
        raise _fail(_option_message(str(error), fixed, _FUZZ_NAMES)) from error
    for name, value in needed.items():
        if name in constraints and constraints[name] != value:
            if value is None:
                raise _fail(
                    _option_message(
                        f"--against {','.join(systems)} runs only without {name}", [name], _FUZZ_NAMES
                    )
                )
            values = [value, *(v for s in systems for v in SYSTEMS[s].allows.get(name, ()))]
            raise _fail(
                _option_message(
                    f"--against {','.join(systems)} runs only with {name}={' or '.join(str(v) for v in values)}",
                    [name],
                    _FUZZ_NAMES,
                )
            )
    constraints.update(needed)
    if constraints.get("hicache_storage_backend") is not None:  # what an engine's L3 runs only with
        for system in systems:
            entry = SYSTEMS[system]
            for name, (value, why) in entry.with_storage.items():
                if name in constraints and constraints[name] != value:
                    raise _fail(
                        _option_message(
                            f"--against {','.join(systems)} with {STORAGE_FIELD}={constraints[STORAGE_FIELD]} runs "
                            f"only with {name}={value}: {why}",
                            [name, STORAGE_FIELD],
                            _FUZZ_NAMES,
                        )
                    )
                constraints[name] = value
    if profile not in PROFILES:
        raise _fail(f"--profile {profile!r} is not one of {', '.join(PROFILES)}")
    constraints.update(PROFILES[profile])
    # D-01's option is followed by the model only (specs/decisions.md D-01); without L3 it changes nothing.
    if (
        "impl" in systems
        and (
            constraints.get("allocate_prefetch_after_query")
            or constraints.get("backup_protects_passed_node_only")
        )
        and constraints.get("hicache_storage_backend", "file") is not None
    ):
        raise _fail(
            f"--profile {profile} turns on allocate_prefetch_after_query and backup_protects_passed_node_only "
            "(D-01, D-07: SGLang 0.5.20's prefetch pipeline and its unpinned backup fragment), which the "
            "implementation does not follow with L3; with --against impl use --profile refcache"
        )
    try:  # reject impossible combinations before any example runs
        HiCacheConfig(**constraints).resolve()  # type: ignore[arg-type]
    except ConfigError as error:
        raise _fail(_option_message(str(error), fixed, _FUZZ_NAMES)) from error
    ledger = Coverage()
    machines = family.machines(systems, constraints, ledger, "", options)
    seconds = minutes * 60 or None
    database = database or Path(os.environ.get(TRACE_DIR_ENV) or "refcache-traces") / "hypothesis-db"
    if jobs > 1:
        _fuzz_parallel(
            jobs,
            family,
            systems,
            constraints,
            steps,
            examples,
            seconds,
            batch,
            database,
            shrink_seconds,
            options,
        )
        return
    started = time.monotonic()
    with Progress(
        TextColumn("[bold]fuzz"), BarColumn(), LedgerColumn(ledger), TimeElapsedColumn(), console=errors
    ) as progress:
        task = progress.add_task("fuzz", total=1.0)

        def advance() -> None:  # before every example: the larger of the two budgets' shares spent
            spent = (time.monotonic() - started) / seconds if seconds else 0.0
            progress.update(task, completed=max(spent, ledger.runs / examples if examples else 0.0))

        try:
            run_machines(
                machines,
                ledger,
                steps=steps,
                examples=examples or None,
                seconds=seconds,
                chunk=batch,
                on_example=advance,
                report=lambda message: console.print(message, highlight=False, markup=False),
                database=database,
            )
        except (AssertionError, Flaky) as error:
            progress.stop()
            console.print(
                f"[red]FAILED[/red] in example {ledger.runs} ({ledger.steps} steps): {error}",
                highlight=False,
                soft_wrap=True,  # paths and the replay command stay whole, to be copied
            )
            if isinstance(error, Divergence) and error.trace_path is not None and shrink_seconds > 0:
                _shrink_file(error.trace_path, systems, shrink_seconds, None, options)
            raise typer.Exit(1) from error
        progress.update(task, completed=1.0)
    console.print(family.report(ledger), highlight=False)


def _fuzz_parallel(
    jobs: int,
    family: Checks,
    systems: tuple[str, ...],
    constraints: Mapping[str, object],
    steps: int,
    examples: int,
    seconds: float | None,
    batch: int,
    database: Path,
    shrink_seconds: float,
    options: SystemOptions,
) -> None:
    """``fuzz --jobs N`` (N > 1): the workers of ``refcache.check.parallel``, one progress bar and one
    report over all of them; the first failure stops the others and is shrunk as in one process."""
    from refcache.check.parallel import run_parallel

    live = Coverage()  # the workers' totals, for the progress bar
    started = time.monotonic()
    with Progress(
        TextColumn(f"[bold]fuzz ×{jobs}"),
        BarColumn(),
        LedgerColumn(live),
        TimeElapsedColumn(),
        console=errors,
    ) as progress:
        task = progress.add_task("fuzz", total=1.0)

        def advance(runs: int, done_steps: int) -> None:
            live.runs, live.steps = runs, done_steps
            spent = (time.monotonic() - started) / seconds if seconds else 0.0
            progress.update(task, completed=max(spent, runs / examples if examples else 0.0))

        outcome = run_parallel(
            jobs,
            family.name,
            systems,
            constraints,
            steps=steps,
            examples=examples or None,
            seconds=seconds,
            chunk=batch,
            database=str(database),
            options=options,
            on_progress=advance,
        )
        live.runs, live.steps = outcome.ledger.runs, outcome.ledger.steps
        if outcome.failure is not None:
            progress.stop()
            for message in outcome.messages:
                console.print(message, highlight=False, markup=False)
            console.print(
                f"[red]FAILED[/red] after {outcome.ledger.runs} examples ({outcome.ledger.steps} steps, "
                f"{jobs} workers): {outcome.failure}",
                highlight=False,
                soft_wrap=True,
            )
            if outcome.trace_path is not None and shrink_seconds > 0:
                _shrink_file(Path(outcome.trace_path), systems, shrink_seconds, None, options)
            raise typer.Exit(1)
        progress.update(task, completed=1.0)
    console.print(family.report(outcome.ledger), highlight=False)


@app.command(cls=_Command, short_help="States, transitions and tables a deterministic run reaches.")
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
    steps: Annotated[
        int, typer.Option(metavar="N", min=1, help="Rule steps per example, at most.")
    ] = budget.MODEL.steps,
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
        console=errors,
        transient=True,  # the report on stdout stays the same, run after run
    ) as progress:
        progress.add_task("coverage", total=None)
        with hypothesis_storage():
            for faults in (False, True):
                run_state_machine_as_test(machine(faults=faults, coverage=ledger), settings=settings)  # type: ignore[no-untyped-call, unused-ignore]
    console.print(coverage_report(ledger), highlight=False)
    if ledger.missing():
        raise typer.Exit(1)


def _read(trace: Path, systems: tuple[str, ...]) -> tuple[Checks, HiCacheConfig, int]:
    """Read a refcache trace of the family ``systems`` speak: the family, the configuration and the number
    of operations. A malformed one, or one of another family, is one error line (it names the file and
    line), exit 2."""
    try:
        family = check_trace_family(trace, systems)
        config, length = family.read_config(trace)
    except (TraceFormatError, UsageError, OSError) as error:
        raise _fail(str(error)) from error
    return family, config, length


@app.command(cls=_Command, short_help="Re-execute a trace step by step; stop at a divergence.")
def replay(
    trace: TraceArgument,
    against: Against = "model",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only print the verdict.")] = False,
    oracle: Oracle = "full",
    verbose: Verbose = False,
) -> None:
    """Re-execute a trace step by step, printing a status line per step, and stop at the first divergence
    or invariant violation with a readable diff (node by token path, field, both values). Exit 1 then."""
    systems = _against(against)
    _log_level(verbose)
    options = _system_options(systems, oracle)
    family, _config, length = _read(trace, systems)

    def show(index: int, op: object, outcome: object, status: str) -> None:
        if not quiet:
            console.print(
                f"{index:>4} {op!r}\n     -> {outcome!r}\n     {status}", highlight=False, soft_wrap=True
            )

    if _recorded(trace):  # recorded on an engine: compare with what the engine observed (refcache.recording)
        _replay_recorded(trace, systems, show)
        return
    try:
        family.replay(trace, systems, options, show)
    except (UsageError, TraceFormatError) as error:
        raise _fail(str(error)) from error
    except Divergence as error:
        console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from error
    console.print(
        f"{trace}: {length} steps against {', '.join(systems)}: no divergence, every invariant held",
        highlight=False,
        soft_wrap=True,
    )


@app.command(cls=_Command, short_help="Cut a failing trace to a short one failing the same way.")
def shrink(
    trace: TraceArgument,
    against: Against = "both",
    seconds: Annotated[
        float, typer.Option(metavar="SECONDS", min=0, help="Stop shrinking after about this many seconds.")
    ] = 60.0,
    out: Annotated[
        Path | None,
        typer.Option(metavar="FILE", help="Where to write the shrunk trace (default: TRACE.min.jsonl)."),
    ] = None,
    oracle: Oracle = "full",
    verbose: Verbose = False,
) -> None:
    """Shrink a failing trace to a short sub-sequence of its operations that fails the same way (ddmin over
    operations, each candidate replayed on fresh systems), and write it next to the original."""
    systems = _against(against)
    _log_level(verbose)
    _shrink_file(trace, systems, seconds, out, _system_options(systems, oracle))


def _shrink_file(
    trace: Path, systems: tuple[str, ...], seconds: float, out: Path | None, options: SystemOptions
) -> None:
    family, _config, length = _read(trace, systems)
    target = out or trace.with_name(trace.name.removesuffix(".jsonl") + ".min.jsonl")
    try:
        with Progress(
            TextColumn("{task.description}"), TimeElapsedColumn(), console=errors, transient=True
        ) as progress:
            task = progress.add_task(f"shrinking {length} operations", total=None)

            def show(length: int, replays: int) -> None:
                progress.update(task, description=f"{length} operations after {replays} replays")

            result = family.shrink(trace, target, systems, options, seconds=seconds, on_progress=show)
    except UsageError as error:
        raise _fail(f"{trace}: {error}") from error
    verdict = "1-minimal" if result.complete else "time budget reached, may shrink further"
    console.print(
        f"{result.original_length} -> {result.length} operations ({result.replays} replays, "
        f"{result.seconds:.1f} s, {verdict}); still fails: {result.failure.message}\n"
        f"written to {target}; replay with: refcache replay {target} --against {','.join(systems)}",
        highlight=False,
        soft_wrap=True,
    )


@app.command(cls=_Command, short_help="Replay a Mooncake request trace through the cache tiers.")
def simulate(
    trace: Annotated[
        Path,
        typer.Argument(
            exists=True,
            dir_okay=False,
            metavar="TRACE",
            help="A Mooncake request trace (JSON Lines: timestamp, input_length, output_length, hash_ids).",
        ),
    ],
    l1_tokens: Annotated[
        int, typer.Option(metavar="N", min=1, help="L1 (device) capacity, simulated tokens.")
    ] = 16384,
    hicache_ratio: Annotated[
        float,
        typer.Option(
            "--hicache-ratio",
            "--l2-ratio",
            metavar="X",
            min=0,
            help="L2 capacity as a multiple of L1 (SGLang --hicache-ratio).",
        ),
    ] = 2.0,
    hicache_size: Annotated[
        float,
        typer.Option(
            "--hicache-size",
            "--l2-gb",
            metavar="X",
            min=0,
            help="L2 capacity in GB per rank (SGLang --hicache-size); wins over the ratio.",
        ),
    ] = 0.0,
    l3: Annotated[bool, typer.Option("--l3/--no-l3", help="L3 storage with prefetch and backup.")] = False,
    page_size: PageSize = 16,
    block_tokens: Annotated[
        int, typer.Option(metavar="N", min=1, max=512, help="Simulated tokens per 512-token trace block.")
    ] = 16,
    hicache_write_policy: WritePolicyOption = WritePolicy.WRITE_THROUGH_SELECTIVE,
    radix_eviction_policy: EvictionPolicyOption = EvictionPolicy.LRU,
    hicache_storage_prefetch_policy: PrefetchPolicyOption = PrefetchPolicy.BEST_EFFORT,
    prefetch_threshold: Annotated[
        int, typer.Option(metavar="N", min=0, help="Smallest prefetch, simulated tokens.")
    ] = 16,
    prefetch_timeout_base: Annotated[
        float, typer.Option(metavar="X", min=0, help="Seconds (timeout policy).")
    ] = 1.0,
    prefetch_timeout_per_ki_token: Annotated[
        float, typer.Option(metavar="X", min=0, help="Seconds per 1024 tokens (timeout policy).")
    ] = 0.25,
    load_back_threshold: Annotated[
        int, typer.Option(metavar="N", min=0, help="Smallest host hit loaded back, tokens.")
    ] = 10,
    storage_batch_size: Annotated[int, typer.Option(metavar="N", min=1, help="Pages per L3 batch.")] = 128,
    hicache_io_backend: Annotated[
        IOBackend | None,
        _enum_option(_IO, IOBackend, "BACKEND", " Default: kernel; direct for --against impl without CUDA."),
    ] = None,
    hicache_mem_layout: MemLayoutOption = MemLayout.LAYER_FIRST,
    tp_size: TpSize = 1,
    attention: Attention = AttentionKind.MHA,
    limit: Annotated[
        int, typer.Option(metavar="N", min=0, help="Replay only the first N requests (0: all).")
    ] = 0,
    against: Annotated[
        str,
        typer.Option(
            "--against",
            metavar="SYSTEM",
            help="The system to replay the trace on: model (the reference model) or impl (the implementation).",
        ),
    ] = "model",
    queue_delay_us: Annotated[
        int, typer.Option(metavar="N", min=0, help="Arrival to first admission check (prefetch I/O runs).")
    ] = 10_000,
    l3_batch_us: Annotated[
        int, typer.Option(metavar="N", min=1, help="Logical time of one L3 read batch.")
    ] = 1_000,
    drain_every: Annotated[
        int, typer.Option(metavar="N", min=1, help="Requests between background I/O drains.")
    ] = 1,
    audit_every: Annotated[
        int,
        typer.Option(
            metavar="N",
            min=0,
            help="Count L1→L2 copies and L2 evictions from a snapshot every N requests: 1 is exact, more "
            "gives lower bounds, 0 (the default) does not count them. Snapshots make a run several times "
            "slower.",
        ),
    ] = 0,
    check_invariants: Annotated[
        bool, typer.Option(help="Check every invariant after every request (slow).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    per_request: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE.csv",
            help="Write one CSV row per request: hit tokens and pages per tier, computed, evicted, prefetch "
            "outcome. Takes a snapshot after every request (as --audit-every 1).",
        ),
    ] = None,
    run_sweep: Annotated[
        bool, typer.Option("--sweep", help="Run the grid of L2 ratio × eviction × write policy.")
    ] = False,
    sweep_l2_ratios: Annotated[
        str, typer.Option(help="Comma-separated L2 ratios for --sweep.")
    ] = "1.5,2,4,8",
    sweep_evictions: Annotated[
        str, typer.Option(help="Comma-separated eviction strategies for --sweep.")
    ] = "lru,lfu",
    sweep_write_policies: Annotated[
        str, typer.Option(help="Comma-separated write policies for --sweep.")
    ] = "write_through,write_back",
    plot: Annotated[Path, typer.Option(metavar="FILE.png", help="PNG written by --sweep.")] = Path(
        "simulate-sweep.png"
    ),
    oracle: Oracle = "full",
) -> None:
    """Replay a Mooncake request trace through the cache and report where every input token came from
    (L1, L2, L3 or computed), the bytes moved between tiers, evictions, prefetch outcomes, and Belady's
    offline-optimal hit rate at the same capacities. With --sweep, run a grid and plot it."""
    systems = _against(against)
    if len(systems) != 1:
        raise typer.BadParameter(
            f"simulate replays on one system, not {', '.join(systems)}", param_hint="--against"
        )
    if per_request is not None and run_sweep:
        raise typer.BadParameter("--per-request writes one run's requests; --sweep runs many")
    fields: dict[str, object] = {
        "device_size": l1_tokens,
        "hicache_ratio": hicache_ratio,
        "hicache_size": hicache_size,
        "hicache_storage_backend": "file" if l3 else None,
        "page_size": page_size,
        "hicache_write_policy": hicache_write_policy,
        "radix_eviction_policy": radix_eviction_policy,
        "hicache_storage_prefetch_policy": hicache_storage_prefetch_policy,
        "prefetch_threshold": prefetch_threshold,
        "prefetch_timeout_base": prefetch_timeout_base,
        "prefetch_timeout_per_ki_token": prefetch_timeout_per_ki_token,
        "load_back_threshold": load_back_threshold,
        "storage_batch_size": storage_batch_size,
        "hicache_mem_layout": hicache_mem_layout,
        "tp_size": tp_size,
        "attention": attention,
    }
    if hicache_io_backend is not None:
        fields["hicache_io_backend"] = hicache_io_backend
    option_names = [*fields, "hicache_io_backend", *(f.name for f in dataclasses.fields(SimOptions))]
    try:  # bad values and impossible combinations are usage errors, reported before the trace is read
        for name, (value, why) in SYSTEMS[systems[0]].host_defaults(systems[0]).items():
            if name not in fields:  # the user's choice wins
                fields[name] = value
                errors.print(why, highlight=False, soft_wrap=True)
        config = HiCacheConfig(**fields).resolve()  # type: ignore[arg-type]
        options = SimOptions(
            system=systems[0],
            queue_delay_us=queue_delay_us,
            l3_batch_us=l3_batch_us,
            drain_every=drain_every,
            audit_every=1 if per_request is not None else audit_every,
            check_invariants=check_invariants,
            system_options=tuple(_system_options(systems, oracle).get(systems[0], {}).items()),
        )
        grid = SweepGrid.parse(sweep_l2_ratios, sweep_evictions, sweep_write_policies) if run_sweep else None
    except (ConfigError, UsageError) as error:
        raise _fail(_option_message(str(error), option_names)) from error
    status = run_command(
        trace,
        config,
        options,
        block_tokens=block_tokens,
        limit=limit or None,
        grid=grid,
        plot=plot,
        as_json=as_json,
        per_request=per_request,
    )
    if status:
        raise typer.Exit(status)


# --- recorded traces (refcache.recording): replay against the engine's observations, and `record` ----------


def _recorded(trace: Path) -> bool:
    from refcache.recording import is_recorded

    return is_recorded(trace)


def _replay_recorded(trace: Path, systems: tuple[str, ...], show: StepView) -> None:
    """A recorded trace: each step's outcome (and snapshot, where recorded) is compared with the engine's."""
    from refcache.check.recorded import replay_recorded
    from refcache.hicache import status_line
    from refcache.recording import read_recording

    try:
        recording = read_recording(trace)
        steps = replay_recorded(
            recording, systems, on_step=lambda i, op, outcome, snap: show(i, op, outcome, status_line(snap))
        )
    except (UsageError, TraceFormatError) as error:
        raise _fail(str(error)) from error
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


@app.command(cls=_Command, short_help="Run a Mooncake trace on a real engine, recording what it does.")
def record(
    trace: Annotated[
        Path,
        typer.Argument(exists=True, dir_okay=False, metavar="TRACE", help="A Mooncake request trace."),
    ],
    out: Annotated[Path, typer.Option("--out", "-o", metavar="FILE", help="The recorded trace.")],
    engine: Annotated[
        str, typer.Option(metavar="ENGINE", help="The engine (one with a recorder).")
    ] = "sglang",
    l1_tokens: Annotated[int, typer.Option(metavar="N", min=1, help="L1 (device) capacity, tokens.")] = 4096,
    hicache_ratio: Annotated[float, typer.Option(metavar="X", min=0, help="L2 as a multiple of L1.")] = 2.0,
    page_size: PageSize = 16,
    block_tokens: Annotated[
        int, typer.Option(metavar="N", min=1, max=512, help="Simulated tokens per 512-token trace block.")
    ] = 16,
    limit: Annotated[int | None, typer.Option(metavar="N", min=1, help="Only the first N requests.")] = None,
    hicache_write_policy: WritePolicyOption = WritePolicy.WRITE_THROUGH,
    radix_eviction_policy: EvictionPolicyOption = EvictionPolicy.LRU,
    l3: Annotated[
        bool,
        typer.Option(
            "--l3/--no-l3",
            help="L3: SGLang's file backend, with prefetch and backup (the storage threads' steps recorded).",
        ),
    ] = False,
    prefetch_threshold: Annotated[
        int, typer.Option(metavar="N", min=0, help="Smallest prefetch, simulated tokens (with --l3).")
    ] = 16,
    tp_size: TpSize = 1,
    snapshots: Annotated[
        bool, typer.Option("--snapshots/--no-snapshots", help="Also record the engine's snapshot per step.")
    ] = False,
) -> None:
    """Run TRACE through ENGINE as the scheduler does (refcache.sim's loop) with its recorder on, and write
    every call and completion the recorder observed to FILE: `refcache replay FILE --against model` then
    says where the engine left the spec. Exit 1 when the engine failed: two ranks out of step (a hang) are
    named with the operation, and FILE then ends with the operation that never returned."""
    from refcache.sim.record import record_run

    written = _stamp(out)
    try:
        config = HiCacheConfig(
            device_size=l1_tokens,
            hicache_ratio=hicache_ratio,
            page_size=page_size,
            hicache_write_policy=hicache_write_policy,
            radix_eviction_policy=radix_eviction_policy,
            hicache_storage_backend="file" if l3 else None,
            prefetch_threshold=prefetch_threshold,
            tp_size=tp_size,
        ).with_fidelity(PROFILES["sglang-0.5.20"])
        run = record_run(
            trace, out, config, engine=engine, block_tokens=block_tokens, limit=limit, snapshots=snapshots
        )
    except (ConfigError, UsageError, TraceFormatError) as error:
        raise _fail(str(error)) from error
    except (RankError, RecordingError) as error:  # the engine's: the run failed, maybe with a recording
        raise _fail(escape(_recording_failure(error, out, _stamp(out) != written)), 1) from error
    rec = run.recording
    console.print(
        f"{out}: {len(rec.ops)} operations recorded from {rec.engine.removesuffix(' (recorded)')} over "
        f"{run.report.requests} requests of {trace} ({run.report.seconds:.1f} s)",
        highlight=False,
        soft_wrap=True,
    )


def _stamp(path: Path) -> tuple[int, int] | None:
    """``path``'s modification time and size (None: absent), to tell whether a run wrote it."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_size)


def _recording_failure(error: RankError | RecordingError, out: Path, written: bool) -> str:
    """``record``'s error line for ``error``: the ranks out of step (``RankError``), where a hang's
    recording was written to ``out`` (``written``: this run wrote it) ending with the operation that never
    returned; or a call sequence the recorder cannot express (``RecordingError``)."""
    from refcache.recording import NeverReturned, read_recording

    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, RecordingError):
        lost = f"; {out} was not written" if not written else f"; {out} holds what was recorded"
        return f"the recording cannot express what the engine did: {first}{lost}"
    if error.hang is None or not written:
        return f"a rank failed: {first}; {out} was not written"
    try:
        recording = read_recording(out)
    except (OSError, TraceFormatError):
        return f"the ranks went out of step: {first}; {out} was written but cannot be read"
    if not recording.observed or not isinstance(recording.observed[-1], NeverReturned):
        return f"the ranks went out of step: {first}; {out} was written"
    return (
        f"the ranks went out of step at operation {len(recording.ops)}: {first}. The recording was written "
        f"to {out} and ends with the operation that never returned: `refcache replay {out} --against "
        "model` shows where"
    )


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


if __name__ == "__main__":  # pragma: no cover
    main()
