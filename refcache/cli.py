"""The ``refcache`` command line.

``refcache fuzz`` runs the model state machines (fault-free and fault-injecting) for a time or example
budget with a progress bar and prints which states, transitions and in-flight table events were reached.
``refcache coverage`` runs the default (CI) budget deterministically and prints the same report.
``refcache replay`` re-executes a trace step by step; ``refcache shrink`` cuts a failing trace down to a
short one that fails the same way; ``refcache simulate`` runs a request trace through the cache.
"""

from __future__ import annotations

import importlib
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from refcache import strategies
from refcache.config import (
    AttentionKind,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import ConfigError, TraceFormatError, UsageError
from refcache.harness import Divergence, Harness, System, status_line
from refcache.model import HiCacheModel
from refcache.ops import Op
from refcache.shrink import SystemsFactory, shrink_trace
from refcache.simulate import simulate_command
from refcache.snapshot import Snapshot
from refcache.strategies import COVERAGE, FaultyModelMachine, ModelMachine, coverage_report
from refcache.trace import read_trace, write_trace

app = typer.Typer(
    help="refcache: a formally-tested reference implementation of SGLang's hierarchical KV cache.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()

# --- one vocabulary of options for every command --------------------------------------------------------
# Configuration options carry SGLang's server flag names (``--hicache-write-policy``, ...), with the short
# names earlier refcache releases used as aliases. In ``fuzz`` an option left unset is drawn at random.

PageSize = Annotated[int, typer.Option("--page-size", help="Tokens per page (SGLang --page-size).")]
TpSize = Annotated[int, typer.Option("--tp-size", "--tp", help="Tensor-parallel ranks (SGLang --tp-size).")]
Attention = Annotated[AttentionKind, typer.Option("--attention", help="MHA or MLA.", case_sensitive=False)]
WritePolicyOption = Annotated[
    WritePolicy, typer.Option("--hicache-write-policy", "--write-policy", help="SGLang --hicache-write-policy.")
]
PrefetchPolicyOption = Annotated[
    PrefetchPolicy,
    typer.Option(
        "--hicache-storage-prefetch-policy", "--prefetch-policy", help="SGLang --hicache-storage-prefetch-policy."
    ),
]
EvictionPolicyOption = Annotated[
    EvictionPolicy,
    typer.Option("--radix-eviction-policy", "--eviction-policy", help="SGLang --radix-eviction-policy."),
]
IOBackendOption = Annotated[
    IOBackend, typer.Option("--hicache-io-backend", "--io-backend", help="SGLang --hicache-io-backend.")
]
MemLayoutOption = Annotated[
    MemLayout, typer.Option("--hicache-mem-layout", "--mem-layout", help="SGLang --hicache-mem-layout.")
]


def _settings(examples: int, steps: int, *, derandomize: bool, shrink: bool = True) -> settings:
    phases = tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate)
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=derandomize,
        database=None,
        print_blob=False,
        suppress_health_check=list(HealthCheck),
        phases=phases,
    )


@app.command()
def fuzz(
    minutes: Annotated[
        float, typer.Option(help="Stop after this many minutes (checked between batches).")
    ] = 1.0,
    against: Annotated[
        str, typer.Option(help="both: model and implementation side by side; model: the model alone.")
    ] = "both",
    examples: Annotated[
        int, typer.Option(help="Stop after this many examples per machine (0: no limit).")
    ] = 0,
    tp: Annotated[int | None, typer.Option(help="Fix the number of tensor-parallel ranks.")] = None,
    attention: Annotated[str | None, typer.Option(help="Fix the attention kind: MHA or MLA.")] = None,
    write_policy: Annotated[
        str | None, typer.Option(help="write_through, write_through_selective or write_back.")
    ] = None,
    prefetch_policy: Annotated[
        str | None, typer.Option(help="best_effort, wait_complete or timeout.")
    ] = None,
    eviction_policy: Annotated[
        str | None, typer.Option(help="lru, lfu, fifo, mru, filo or priority.")
    ] = None,
    io_backend: Annotated[str | None, typer.Option(help="kernel or direct.")] = None,
    layout: Annotated[
        str | None, typer.Option(help="layer_first, page_first, page_first_direct or page_head.")
    ] = None,
    page_size: Annotated[int | None, typer.Option(help="Fix the page size.")] = None,
    steps: Annotated[int, typer.Option(help="Operations per example.")] = 50,
    batch: Annotated[int, typer.Option(help="Examples per batch between progress updates.")] = 50,
    shrink_seconds: Annotated[
        float, typer.Option(help="Shrink a failing run's trace for at most this long (0: keep it whole).")
    ] = 60.0,
) -> None:
    """Run random operation sequences against the model and the implementation side by side, comparing
    observations and snapshots and checking every invariant after every step.

    Each batch draws fresh random examples (derandomize off). On a failure the failing run is written as a
    JSONL trace ($REFCACHE_TRACE_DIR, default ./refcache-traces), then shrunk operation by operation
    (as ``refcache shrink`` does) into TRACE.min.jsonl; the replay command is printed and the command
    exits with status 1.
    """
    constraints = {
        name: value
        for name, value in (
            ("tp_size", tp),
            ("attention", attention),
            ("hicache_write_policy", write_policy),
            ("hicache_storage_prefetch_policy", prefetch_policy),
            ("radix_eviction_policy", eviction_policy),
            ("hicache_io_backend", io_backend),
            ("hicache_mem_layout", layout),
            ("page_size", page_size),
        )
        if value is not None
    }
    try:  # reject bad names and impossible combinations before any example runs
        HiCacheConfig(**constraints).resolve()  # type: ignore[arg-type]
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from error
    strategies.CONFIG_CONSTRAINTS.clear()
    strategies.CONFIG_CONSTRAINTS.update(constraints)
    machines: tuple[type[ModelMachine], ...] = (ModelMachine, FaultyModelMachine)
    if against == "both":
        differential = importlib.import_module("refcache.differential")  # pulls in torch: only on demand
        machines = (differential.DifferentialMachine, differential.FaultyDifferentialMachine)
    elif against != "model":
        raise typer.BadParameter("--against must be 'model' or 'both'")
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
                for machine in machines:
                    run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
                        machine, settings=_settings(n, steps, derandomize=False, shrink=False)
                    )
            except (AssertionError, Flaky) as error:
                progress.stop()
                console.print(f"[red]FAILED[/red] after {done} examples: {error}", highlight=False)
                trace_path = getattr(error, "trace_path", None)
                if trace_path is not None and shrink_seconds > 0:
                    _shrink_file(trace_path, against, shrink_seconds, None)
                raise typer.Exit(1) from error
            done += n
            progress.update(task, completed=done, steps=COVERAGE.steps)
    console.print(coverage_report())


@app.command()
def coverage(
    examples: Annotated[
        int, typer.Option(help="Examples per machine (the default test run uses 150).")
    ] = 150,
    steps: Annotated[int, typer.Option(help="Operations per example.")] = 50,
) -> None:
    """Print the state, transition and in-flight-table coverage of a deterministic run; exit 1 if some
    state, transition or table event was never reached."""
    for machine in (ModelMachine, FaultyModelMachine):
        run_state_machine_as_test(machine, settings=_settings(examples, steps, derandomize=True))  # type: ignore[no-untyped-call, unused-ignore]
    console.print(coverage_report(), highlight=False)
    if COVERAGE.missing():
        raise typer.Exit(1)


@app.command()
def replay(
    trace: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="A JSONL trace (specs/trace-format.md).")
    ],
    against: Annotated[
        str, typer.Option(help="model: the model alone (invariants); both: model and implementation.")
    ] = "model",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only print the verdict.")] = False,
) -> None:
    """Re-execute a trace step by step, printing a status line per step, and stop at the first divergence
    or invariant violation with a readable diff (node by token path, field, both values). Exit 1 then."""
    try:
        config, ops = read_trace(trace)
    except TraceFormatError as error:
        console.print(f"[red]{trace}: {error}[/red]")
        raise typer.Exit(2) from error
    systems: dict[str, System] = {"model": HiCacheModel(config)}
    if against == "both":
        driver = importlib.import_module("refcache.gpu.driver")  # pulls in torch: only on demand
        systems["impl"] = driver.HiCacheImpl(config)
    elif against != "model":
        raise typer.BadParameter("--against must be 'model' or 'both'")

    def show(index: int, op: Op, outcome: object, snap: Snapshot) -> None:
        if not quiet:
            console.print(
                f"{index:>4} {op!r}\n     -> {outcome!r}\n     {status_line(snap)}",
                highlight=False,
                soft_wrap=True,
            )

    with tempfile.TemporaryDirectory() as scratch:
        try:
            harness = Harness(config, systems, trace_name="replay", trace_dir=scratch, on_step=show)
            for op in ops:
                harness.step(op)
        except Divergence as error:
            console.print(
                f"[red]DIVERGENCE[/red] {str(error).split(chr(10) + '--- trace ---')[0]}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from error
    console.print(
        f"{trace}: {len(ops)} steps against {', '.join(systems)}: no divergence, every invariant held"
    )


@app.command()
def shrink(
    trace: Annotated[
        Path,
        typer.Argument(exists=True, dir_okay=False, help="A failing JSONL trace (specs/trace-format.md)."),
    ],
    against: Annotated[
        str, typer.Option(help="model: the model alone (invariants); both: model and implementation.")
    ] = "both",
    seconds: Annotated[float, typer.Option(help="Stop shrinking after about this many seconds.")] = 60.0,
    out: Annotated[
        Path | None, typer.Option(help="Where to write the shrunk trace (default: TRACE with .min.jsonl).")
    ] = None,
) -> None:
    """Shrink a failing trace to a short sub-sequence of its operations that fails the same way (ddmin over
    operations, each candidate replayed on fresh systems), and write it next to the original."""
    _shrink_file(trace, against, seconds, out)


def _shrink_file(trace: Path, against: str, seconds: float, out: Path | None) -> None:
    try:
        config, ops = read_trace(trace)
    except TraceFormatError as error:
        console.print(f"[red]{trace}: {error}[/red]")
        raise typer.Exit(2) from error
    make_systems = _systems_factory(against)
    target = out or trace.with_name(trace.name.removesuffix(".jsonl") + ".min.jsonl")
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(f"shrinking {len(ops)} operations", total=None)

        def show(length: int, replays: int) -> None:
            progress.update(task, description=f"{length} operations after {replays} replays")

        try:
            result = shrink_trace(config, ops, make_systems, seconds=seconds, on_progress=show)
        except UsageError as error:
            console.print(f"[red]{trace}: {error}[/red]")
            raise typer.Exit(2) from error
    write_trace(target, config, result.ops)
    verdict = "1-minimal" if result.complete else "time budget reached, may shrink further"
    console.print(
        f"{result.original_length} -> {len(result.ops)} operations ({result.replays} replays, "
        f"{result.seconds:.1f} s, {verdict}); still fails: {result.failure.message}\n"
        f"written to {target}; replay with: refcache replay {target} --against {against}",
        highlight=False,
        soft_wrap=True,
    )


def _systems_factory(against: str) -> SystemsFactory:
    if against == "model":
        return lambda config: {"model": HiCacheModel(config)}
    if against != "both":
        raise typer.BadParameter("--against must be 'model' or 'both'")
    differential = importlib.import_module("refcache.differential")  # pulls in torch: only on demand
    factory: SystemsFactory = differential.model_and_implementation
    return factory


app.command("simulate")(simulate_command)


if __name__ == "__main__":  # pragma: no cover
    app()
