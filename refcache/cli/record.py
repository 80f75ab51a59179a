"""``refcache record``: a Mooncake request trace through a real engine with its recorder on, written as a
recorded trace that ``refcache replay`` compares with the spec."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from refcache.check.plan import PlanError, recording_fidelity
from refcache.cli.options import (
    EvictionPolicyOption,
    PageSize,
    TpSize,
    WritePolicyOption,
    console,
    fail,
)
from refcache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import ConfigError, RankError, RecordingError, TraceFormatError, UsageError

SHORT_HELP = "Run a Mooncake trace on a real engine, recording what it does."


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

    try:
        fidelity = recording_fidelity(engine)
    except PlanError as error:
        raise fail(str(error)) from error
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
        ).with_fidelity(fidelity)
        run = record_run(
            trace, out, config, engine=engine, block_tokens=block_tokens, limit=limit, snapshots=snapshots
        )
    except (ConfigError, UsageError, TraceFormatError) as error:
        raise fail(str(error)) from error
    except (RankError, RecordingError) as error:  # the engine's: the run failed, maybe with a recording
        raise fail(escape(_recording_failure(error, out, _stamp(out) != written)), 1) from error
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
