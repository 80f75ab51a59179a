"""``refcache explore``: every operation sequence up to a depth on one small configuration, checked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from refcache.check.enabled import Bounds
from refcache.check.explore import Explored, Space, compare_coverage, load, sampled_coverage
from refcache.check.explore import explore as search
from refcache.cli import options as shared
from refcache.cli.options import (
    Against,
    EvictionPolicyOption,
    Jobs,
    L3Alias,
    PageSize,
    PrefetchPolicyOption,
    TpSize,
    WritePolicyOption,
    against_systems,
    console,
    fail,
    require_installed,
)
from refcache.config import EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.errors import ConfigError, TraceFormatError, UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import FaultKind, Op
from refcache.systems import SYSTEMS

SHORT_HELP = "Every operation sequence up to a depth on a small configuration, checked."


def _sequences(text: str) -> tuple[tuple[int, ...], ...]:
    try:
        return tuple(tuple(int(t) for t in part.split()) for part in text.split(",") if part.strip())
    except ValueError as error:
        raise fail(
            f"--sequences {text!r}: token sequences are space-separated integers, comma-separated"
        ) from error


def explore(
    depth: Annotated[int, typer.Option(metavar="N", min=0, help="Operations from the initial state.")] = 6,
    max_states: Annotated[
        int | None, typer.Option(metavar="N", min=1, help="Stop after N distinct states.")
    ] = None,
    minutes: Annotated[float | None, typer.Option(metavar="X", min=0, help="Stop after X minutes.")] = None,
    against: Against = "model",
    page_size: PageSize = 1,
    device_pages: Annotated[int, typer.Option(metavar="N", min=1, help="L1 pages per rank.")] = 2,
    host_pages: Annotated[int, typer.Option(metavar="N", min=1, help="L2 pages per rank.")] = 4,
    tp_size: TpSize = 1,
    write_policy: WritePolicyOption = WritePolicy.WRITE_BACK,
    prefetch_policy: PrefetchPolicyOption = PrefetchPolicy.BEST_EFFORT,
    eviction_policy: EvictionPolicyOption = EvictionPolicy.LRU,
    l3: L3Alias = True,
    sequences: Annotated[
        str,
        typer.Option(
            metavar="SEQS",
            help="The token sequences requests, matches and prefetches carry: space-separated tokens, "
            "comma-separated sequences.",
        ),
    ] = "1, 1 2",
    prompt_lens: Annotated[
        str,
        typer.Option(
            metavar="NS",
            help="Prompt lengths a request may also carry, comma-separated (each shorter than its sequence; "
            "read only with --reinsert-prompt-prefix); none: ''.",
        ),
    ] = "",
    reinsert_prompt_prefix: Annotated[
        bool,
        typer.Option(
            "--reinsert-prompt-prefix/--no-reinsert-prompt-prefix",
            help="SGLang 0.5.20's re-insert of a finished request's prompt at priority + 1 (D-24).",
        ),
    ] = False,
    faults: Annotated[
        str, typer.Option(metavar="KINDS", help="Storage fault kinds, comma-separated (with L3); none: ''.")
    ] = "",
    clock_steps: Annotated[
        str, typer.Option(metavar="US", help="AdvanceClock steps in microseconds, comma-separated.")
    ] = "",
    matches: Annotated[bool, typer.Option("--matches/--no-matches", help="MatchPrefix operations.")] = False,
    token_symmetry: Annotated[
        bool,
        typer.Option(
            "--token-symmetry/--no-token-symmetry",
            help="Relabel fresh tokens at generation: pays when --sequences holds sequences that differ by a "
            "renaming of tokens, such as '1, 2'; not with the misplaced fault.",
        ),
    ] = False,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare-coverage",
            help="Also run the random model machines at the default budget (refcache coverage's run) and "
            "print what each reached that the other did not, in the coverage ledger's terms.",
        ),
    ] = False,
    start: Annotated[
        Path | None,
        typer.Option(
            "--from",
            metavar="TRACE",
            exists=True,
            dir_okay=False,
            help="Start from the state this refcache trace reaches (its configuration replaces the "
            "configuration options; its operations count in a counterexample's trace, not in the depth).",
        ),
    ] = None,
    jobs: Jobs = 1,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            metavar="FILE", dir_okay=False, help="Save after every depth; resume from it if it exists."
        ),
    ] = None,
    spill: Annotated[
        Path | None,
        typer.Option(metavar="FILE", dir_okay=False, help="Keep the visited states in this SQLite file."),
    ] = None,
    trace_dir: Annotated[
        Path, typer.Option(metavar="DIR", file_okay=False, help="Where a counterexample's trace goes.")
    ] = Path("refcache-traces"),
) -> None:
    """Breadth-first search of the model's states from the initial state of a small configuration, every
    invariant checked on every state and transition; with --against model,impl every transition also runs on
    the other systems in lock step. Exit 1 with a shortest counterexample trace (refcache replay/shrink accept
    it) when a check fails."""
    systems = against_systems(against)
    require_installed(systems)
    try:
        kinds = tuple(FaultKind(k.strip()) for k in faults.split(",") if k.strip())
        steps = tuple(int(s) for s in clock_steps.split(",") if s.strip())
        prompts = tuple(int(n) for n in prompt_lens.split(",") if n.strip())
        # What the lock step's systems need on this machine (without CUDA: the implementation's direct I/O
        # backend; its Triton kernels, interpreted, are checked against it by tests/gpu/test_transfer.py)
        host: dict[str, object] = {}
        for name in systems[1:]:
            for option, (value, why) in SYSTEMS[name].host_defaults(name).items():
                if option not in host:
                    host[option] = value
                    shared.errors.print(why, highlight=False, soft_wrap=True)
        config = HiCacheConfig(
            page_size=page_size,
            device_size=device_pages * page_size,
            hicache_ratio=host_pages / device_pages,
            tp_size=tp_size,
            hicache_write_policy=write_policy,
            hicache_storage_prefetch_policy=prefetch_policy,
            radix_eviction_policy=eviction_policy,
            hicache_storage_backend="file" if l3 else None,
            prefetch_threshold=page_size,
            prefetch_timeout_base=0.001,
            prefetch_timeout_per_ki_token=0.1024,
            load_back_threshold=1,
            storage_batch_size=1,
            reinsert_prompt_prefix=reinsert_prompt_prefix,
            **host,  # type: ignore[arg-type]
        ).resolve()
        prefix: tuple[Op, ...] = ()
        if start is not None:
            traced, ops = HICACHE.read_trace(start)
            config, prefix = traced.resolve(), tuple(ops)
        space = Space(
            config,
            Bounds(
                _sequences(sequences),
                fault_kinds=kinds,
                clock_steps=steps,
                matches=matches,
                prompt_lens=prompts,
            ),
            token_symmetry=token_symmetry,
            prefix=prefix,
        )
    except (ValueError, ConfigError, UsageError, TraceFormatError, OSError) as error:
        raise fail(str(error)) from error
    resume: Explored | None = None
    if checkpoint is not None and checkpoint.exists():
        try:
            resume = load(checkpoint)
        except UsageError as error:
            raise fail(str(error)) from error
        if resume.space != space or resume.against != systems:
            raise fail(f"{checkpoint} is a checkpoint of another exploration (other options)")
    with Progress(
        SpinnerColumn(),
        TextColumn("[bold]explore"),
        BarColumn(),
        TextColumn("depth {task.completed:.0f}/{task.total:.0f}  {task.fields[line]}"),
        TimeElapsedColumn(),
        console=shared.errors,
        transient=True,
    ) as progress:
        task = progress.add_task("explore", total=depth, line="")

        def on_progress(states: int, at: int, transitions: int) -> None:
            progress.update(task, line=f"{states:,} states, {transitions:,} transitions at depth {at}")

        def on_level(result: Explored) -> None:
            progress.update(task, completed=result.depth)

        result = search(
            space,
            depth=depth,
            against=systems,
            max_states=max_states,
            seconds=None if minutes is None else minutes * 60,
            jobs=jobs,
            resume=resume,
            checkpoint=checkpoint,
            spill=spill,
            trace_dir=trace_dir,
            on_level=on_level,
            on_progress=on_progress,
        )
    console.print(report(result), highlight=False, soft_wrap=True)
    if compare:
        console.print(compare_coverage(result.coverage, sampled_coverage()), highlight=False, soft_wrap=True)
    if result.counterexample is not None:
        raise typer.Exit(1)


def report(result: Explored) -> str:
    """The exploration's figures: per depth, the states first reached, transitions and time; the totals."""
    lines = [f"configuration: {result.space.config.dumps()}", "depth  new states  transitions  seconds"]
    lines += [
        f"{lv.depth:>5}  {lv.frontier:>10,}  {lv.transitions:>11,}  {lv.seconds:>7.2f}"
        for lv in result.levels
    ]
    verdict = "exhaustive" if result.complete else "stopped early (a budget or a failure)"
    lines.append(
        f"{result.states:,} distinct states, {result.transitions:,} transitions, depth {result.depth} "
        f"({verdict}), {result.seconds:.1f} s, {result.states_per_second:,.0f} states/s"
    )
    if len(result.against) > 1:
        lines.append(
            f"lock step with {', '.join(result.against[1:])}: {result.lockstep_transitions:,} transitions, "
            f"every one to depth {result.lockstep_depth}"
        )
    cx = result.counterexample
    if cx is not None:
        after = len(result.space.prefix)
        at = f"{cx.depth}" + (
            f" ({cx.depth - after} after the {after} operations of --from)" if after else ""
        )
        lines.append(f"COUNTEREXAMPLE at depth {at}: {cx.what}")
        lines += [f"  {i + 1}. {op!r}" for i, op in enumerate(cx.ops)]
        if cx.written is not None:
            lines.append(
                f"trace written to {cx.written}; refcache replay {cx.written} --against {','.join(result.against)}"
            )
    return "\n".join(lines)
