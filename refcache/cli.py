"""The ``refcache`` command line.

``refcache fuzz`` runs the model state machines (fault-free and fault-injecting) for a time or example
budget with a progress bar and prints which states, transitions and in-flight table events were reached.
``refcache coverage`` runs the default (CI) budget deterministically and prints the same report.
``refcache replay`` re-executes a trace step by step; ``refcache shrink`` cuts a failing trace down to a
short one that fails the same way; ``refcache simulate`` runs a request trace through the cache.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from refcache.check import budget
from refcache.check.configs import configs
from refcache.check.coverage import Coverage, coverage_report
from refcache.check.harness import Divergence, Harness, Outcome, status_line
from refcache.check.machines import machine
from refcache.check.shrink import shrink_trace, systems_named
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
from refcache.ops import Op
from refcache.sim import SimOptions, SweepGrid, run_command
from refcache.snapshot import Snapshot
from refcache.systems import SYSTEMS, open_systems, parse_against
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
    WritePolicy,
    typer.Option("--hicache-write-policy", "--write-policy", help="SGLang --hicache-write-policy."),
]
PrefetchPolicyOption = Annotated[
    PrefetchPolicy,
    typer.Option(
        "--hicache-storage-prefetch-policy",
        "--prefetch-policy",
        help="SGLang --hicache-storage-prefetch-policy.",
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
_SYSTEM_NAMES = ", ".join(SYSTEMS)
Against = Annotated[
    str,
    typer.Option(
        "--against",
        help=f"The systems to run, comma-separated, the first is the reference ({_SYSTEM_NAMES}); "
        "both = model,impl.",
    ),
]


def _against(text: str) -> tuple[str, ...]:
    try:
        return parse_against(text)
    except UsageError as error:
        raise typer.BadParameter(str(error), param_hint="--against") from error


@app.command()
def fuzz(
    minutes: Annotated[
        float, typer.Option(help="Stop after this many minutes (checked between batches).")
    ] = 1.0,
    against: Against = "both",
    examples: Annotated[
        int, typer.Option(help="Stop after this many examples per machine (0: no limit).")
    ] = 0,
    tp_size: TpSize | None = None,
    attention: Attention | None = None,
    hicache_write_policy: WritePolicyOption | None = None,
    hicache_storage_prefetch_policy: PrefetchPolicyOption | None = None,
    radix_eviction_policy: EvictionPolicyOption | None = None,
    hicache_io_backend: IOBackendOption | None = None,
    hicache_mem_layout: MemLayoutOption | None = None,
    page_size: PageSize | None = None,
    steps: Annotated[int, typer.Option(help="Operations per example.")] = budget.FUZZ_STEPS,
    batch: Annotated[int, typer.Option(help="Examples per batch between progress updates.")] = 50,
    shrink_seconds: Annotated[
        float, typer.Option(help="Shrink a failing run's trace for at most this long (0: keep it whole).")
    ] = 60.0,
) -> None:
    """Run random operation sequences against the chosen systems side by side, comparing observations and
    snapshots and checking every invariant after every step.

    Configuration options left unset are drawn at random for each example. Each batch draws fresh random
    examples (derandomize off). On a failure the failing run is written as a JSONL trace
    ($REFCACHE_TRACE_DIR, default ./refcache-traces), then shrunk operation by operation (as ``refcache
    shrink`` does) into TRACE.min.jsonl; the replay command is printed and the command exits with status 1.
    """
    systems = _against(against)
    fixed: Mapping[str, object | None] = {
        "tp_size": tp_size,
        "attention": attention,
        "hicache_write_policy": hicache_write_policy,
        "hicache_storage_prefetch_policy": hicache_storage_prefetch_policy,
        "radix_eviction_policy": radix_eviction_policy,
        "hicache_io_backend": hicache_io_backend,
        "hicache_mem_layout": hicache_mem_layout,
        "page_size": page_size,
    }
    constraints = {name: value for name, value in fixed.items() if value is not None}
    try:  # reject impossible combinations before any example runs
        HiCacheConfig(**constraints).resolve()  # type: ignore[arg-type]
    except ConfigError as error:
        raise typer.BadParameter(str(error)) from error
    ledger = Coverage()
    machines = [
        machine(systems, faults=faults, configs=configs(constraints=constraints), coverage=ledger)
        for faults in (False, True)
    ]
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
                for chosen in machines:
                    run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
                        chosen, settings=budget.Budget(n, steps).settings(derandomize=False, shrink=False)
                    )
            except Divergence as error:
                progress.stop()
                console.print(f"[red]FAILED[/red] after {done} examples: {error}", highlight=False)
                if error.trace_path is not None and shrink_seconds > 0:
                    _shrink_file(error.trace_path, systems, shrink_seconds, None)
                raise typer.Exit(1) from error
            except (AssertionError, Flaky) as error:
                progress.stop()
                console.print(f"[red]FAILED[/red] after {done} examples: {error}", highlight=False)
                raise typer.Exit(1) from error
            done += n
            progress.update(task, completed=done, steps=ledger.steps)
    console.print(coverage_report(ledger))


@app.command()
def coverage(
    examples: Annotated[
        int, typer.Option(help=f"Examples per machine (the default test run uses {budget.MODEL.examples}).")
    ] = budget.MODEL.examples,
    steps: Annotated[int, typer.Option(help="Operations per example.")] = budget.MODEL.steps,
) -> None:
    """Print the state, transition and in-flight-table coverage of a deterministic run of the model
    machines; exit 1 if some state, transition or table event was never reached."""
    ledger = Coverage()
    settings = budget.Budget(examples, steps).settings(derandomize=True)
    for faults in (False, True):
        run_state_machine_as_test(machine(faults=faults, coverage=ledger), settings=settings)  # type: ignore[no-untyped-call, unused-ignore]
    console.print(coverage_report(ledger), highlight=False)
    if ledger.missing():
        raise typer.Exit(1)


@app.command()
def replay(
    trace: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="A JSONL trace (specs/trace-format.md).")
    ],
    against: Against = "model",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only print the verdict.")] = False,
) -> None:
    """Re-execute a trace step by step, printing a status line per step, and stop at the first divergence
    or invariant violation with a readable diff (node by token path, field, both values). Exit 1 then."""
    systems = _against(against)
    try:
        config, ops = read_trace(trace)
    except TraceFormatError as error:
        console.print(f"[red]{trace}: {error}[/red]")
        raise typer.Exit(2) from error

    def show(index: int, op: Op, outcome: Outcome, snap: Snapshot) -> None:
        if not quiet:
            console.print(
                f"{index:>4} {op!r}\n     -> {outcome!r}\n     {status_line(snap)}",
                highlight=False,
                soft_wrap=True,
            )

    try:
        with open_systems(systems, config) as opened:
            harness = Harness(config, opened, on_step=show, write_trace=False)  # the trace is the input
            for op in ops:
                harness.step(op)
    except UsageError as error:
        console.print(f"[red]{error}[/red]", highlight=False)
        raise typer.Exit(2) from error
    except Divergence as error:
        console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
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
    against: Against = "both",
    seconds: Annotated[float, typer.Option(help="Stop shrinking after about this many seconds.")] = 60.0,
    out: Annotated[
        Path | None, typer.Option(help="Where to write the shrunk trace (default: TRACE with .min.jsonl).")
    ] = None,
) -> None:
    """Shrink a failing trace to a short sub-sequence of its operations that fails the same way (ddmin over
    operations, each candidate replayed on fresh systems), and write it next to the original."""
    _shrink_file(trace, _against(against), seconds, out)


def _shrink_file(trace: Path, systems: tuple[str, ...], seconds: float, out: Path | None) -> None:
    try:
        config, ops = read_trace(trace)
    except TraceFormatError as error:
        console.print(f"[red]{trace}: {error}[/red]")
        raise typer.Exit(2) from error
    target = out or trace.with_name(trace.name.removesuffix(".jsonl") + ".min.jsonl")
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=console) as progress:
        task = progress.add_task(f"shrinking {len(ops)} operations", total=None)

        def show(length: int, replays: int) -> None:
            progress.update(task, description=f"{length} operations after {replays} replays")

        try:
            result = shrink_trace(config, ops, systems_named(systems), seconds=seconds, on_progress=show)
        except UsageError as error:
            console.print(f"[red]{trace}: {error}[/red]")
            raise typer.Exit(2) from error
    write_trace(target, config, result.ops)
    verdict = "1-minimal" if result.complete else "time budget reached, may shrink further"
    console.print(
        f"{result.original_length} -> {len(result.ops)} operations ({result.replays} replays, "
        f"{result.seconds:.1f} s, {verdict}); still fails: {result.failure.message}\n"
        f"written to {target}; replay with: refcache replay {target} --against {','.join(systems)}",
        highlight=False,
        soft_wrap=True,
    )


@app.command()
def simulate(
    trace: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="A Mooncake trace (JSON Lines).")
    ],
    l1_tokens: Annotated[int, typer.Option(help="L1 (device) capacity, simulated tokens.")] = 16384,
    hicache_ratio: Annotated[
        float,
        typer.Option(
            "--hicache-ratio", "--l2-ratio", help="L2 capacity as a multiple of L1 (SGLang --hicache-ratio)."
        ),
    ] = 2.0,
    hicache_size: Annotated[
        float,
        typer.Option(
            "--hicache-size",
            "--l2-gb",
            help="L2 capacity in GB per rank (SGLang --hicache-size); wins over the ratio.",
        ),
    ] = 0.0,
    l3: Annotated[bool, typer.Option("--l3/--no-l3", help="L3 storage with prefetch and backup.")] = False,
    page_size: PageSize = 16,
    block_tokens: Annotated[int, typer.Option(help="Simulated tokens per 512-token trace block.")] = 16,
    hicache_write_policy: WritePolicyOption = WritePolicy.WRITE_THROUGH_SELECTIVE,
    radix_eviction_policy: EvictionPolicyOption = EvictionPolicy.LRU,
    hicache_storage_prefetch_policy: PrefetchPolicyOption = PrefetchPolicy.BEST_EFFORT,
    prefetch_threshold: Annotated[int, typer.Option(help="Smallest prefetch, simulated tokens.")] = 16,
    prefetch_timeout_base: Annotated[float, typer.Option(help="Seconds (timeout policy).")] = 1.0,
    prefetch_timeout_per_ki_token: Annotated[
        float, typer.Option(help="Seconds per 1024 tokens (timeout policy).")
    ] = 0.25,
    load_back_threshold: Annotated[int, typer.Option(help="Smallest host hit loaded back, tokens.")] = 10,
    storage_batch_size: Annotated[int, typer.Option(help="Pages per L3 batch.")] = 128,
    hicache_io_backend: IOBackendOption = IOBackend.KERNEL,
    hicache_mem_layout: MemLayoutOption = MemLayout.LAYER_FIRST,
    tp_size: TpSize = 1,
    attention: Attention = AttentionKind.MHA,
    limit: Annotated[int, typer.Option(help="Replay only the first N requests (0: all).")] = 0,
    against: Annotated[
        str,
        typer.Option(
            "--against",
            help="The system to replay the trace on: model (the reference model) or impl (the implementation).",
        ),
    ] = "model",
    queue_delay_us: Annotated[
        int, typer.Option(help="Arrival to first admission check (prefetch I/O runs).")
    ] = 10_000,
    l3_batch_us: Annotated[int, typer.Option(help="Logical time of one L3 read batch.")] = 1_000,
    drain_every: Annotated[int, typer.Option(help="Requests between background I/O drains.")] = 1,
    audit_every: Annotated[
        int | None,
        typer.Option(
            help="Requests between the snapshots that count L1→L2 copies and L2 evictions: 1 is exact; "
            "more gives lower bounds; 0 skips them (fast: a model snapshot grows with the L3 key set). "
            "Default: 1, or 0 with --sweep (which reports hit rates only)."
        ),
    ] = None,
    check_invariants: Annotated[
        bool, typer.Option(help="Check every invariant after every request (slow).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
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
    plot: Annotated[Path, typer.Option(help="PNG written by --sweep.")] = Path("simulate-sweep.png"),
) -> None:
    """Replay a Mooncake request trace through the cache and report where every input token came from
    (L1, L2, L3 or computed), the bytes moved between tiers, evictions, prefetch outcomes, and Belady's
    offline-optimal hit rate at the same capacities. With --sweep, run a grid and plot it."""
    systems = _against(against)
    if len(systems) != 1:
        raise typer.BadParameter(
            f"simulate replays on one system, not {', '.join(systems)}", param_hint="--against"
        )
    try:  # bad values and impossible combinations are usage errors, reported before the trace is read
        config = HiCacheConfig(
            device_size=l1_tokens,
            hicache_ratio=hicache_ratio,
            hicache_size=hicache_size,
            hicache_storage_backend="file" if l3 else None,
            page_size=page_size,
            hicache_write_policy=hicache_write_policy,
            radix_eviction_policy=radix_eviction_policy,
            hicache_storage_prefetch_policy=hicache_storage_prefetch_policy,
            prefetch_threshold=prefetch_threshold,
            prefetch_timeout_base=prefetch_timeout_base,
            prefetch_timeout_per_ki_token=prefetch_timeout_per_ki_token,
            load_back_threshold=load_back_threshold,
            storage_batch_size=storage_batch_size,
            hicache_io_backend=hicache_io_backend,
            hicache_mem_layout=hicache_mem_layout,
            tp_size=tp_size,
            attention=attention,
        )
        options = SimOptions(
            system=systems[0],
            queue_delay_us=queue_delay_us,
            l3_batch_us=l3_batch_us,
            drain_every=drain_every,
            audit_every=(0 if run_sweep else 1) if audit_every is None else audit_every,
            check_invariants=check_invariants,
        )
        grid = SweepGrid.parse(sweep_l2_ratios, sweep_evictions, sweep_write_policies) if run_sweep else None
    except (ConfigError, UsageError) as error:
        raise typer.BadParameter(str(error)) from error
    status = run_command(
        trace,
        config,
        options,
        block_tokens=block_tokens,
        limit=limit or None,
        grid=grid,
        plot=plot,
        as_json=as_json,
    )
    if status:
        raise typer.Exit(status)


if __name__ == "__main__":  # pragma: no cover
    app()
