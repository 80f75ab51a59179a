"""``refcache record``: a Mooncake request trace through a real engine with its recorder on, written as a
recorded trace that ``refcache replay`` compares with the spec."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from refcache.check.plan import recording_fidelity
from refcache.cli import options as o
from refcache.config import EvictionPolicy, HiCacheConfig
from refcache.errors import ConfigError, RankError, RecordingError, TraceFormatError, UsageError

SHORT_HELP = "Run a Mooncake trace on a real engine, recording what it does."


def record(
    out: Annotated[
        Path,
        typer.Option(
            "--out",
            "-o",
            metavar="FILE",
            help="The recorded trace (a FILE ending in .gz is written gzip-compressed; every command reads it).",
        ),
    ],
    trace: o.MooncakeTrace = None,
    engine: o.Engine = "sglang",
    l1_tokens: o.L1Tokens = o.DEFAULT_L1_TOKENS,
    hicache_ratio: o.HiCacheRatio = 2.0,
    page_size: o.PageSize = 16,
    block_tokens: o.BlockTokens = 16,
    limit: o.Limit = 0,
    hicache_write_policy: o.WritePolicyDefaulted = o.DEFAULT_WRITE_POLICY,
    radix_eviction_policy: o.EvictionPolicyOption = EvictionPolicy.LRU,
    hicache_storage_backend: o.StorageBackendOption = None,
    l3: o.L3Alias = None,
    prefetch_threshold: o.PrefetchThreshold = 16,
    tp_size: o.TpSize = 1,
    snapshots: Annotated[
        bool, typer.Option("--snapshots/--no-snapshots", help="Also record the engine's snapshot per step.")
    ] = False,
) -> None:
    """Run TRACE through ENGINE as the scheduler does (refcache.sim's loop) with its recorder on, and write
    every call and completion the recorder observed to FILE: `refcache replay FILE --against model` then
    says where the engine left the spec. The engine runs under the fidelity profile its registry entry
    follows. Exit 1 when the engine failed: two ranks out of step (a hang) are
    named with the operation, and FILE then ends with the operation that never returned."""
    trace = o.trace_or_bundled(trace)
    from refcache.sim.record import record_run

    try:
        fidelity = recording_fidelity(engine)
    except UsageError as error:  # a PlanError, or the engine not installed / a release no adapter drives
        raise o.fail(str(error)) from error
    storage, _ = o.storage_backend(hicache_storage_backend, l3)
    written = _stamp(out)
    try:
        config = HiCacheConfig(
            device_size=l1_tokens,
            hicache_ratio=hicache_ratio,
            page_size=page_size,
            hicache_write_policy=hicache_write_policy,
            radix_eviction_policy=radix_eviction_policy,
            hicache_storage_backend=storage,
            prefetch_threshold=prefetch_threshold,
            tp_size=tp_size,
        ).with_fidelity(fidelity)
        run = record_run(
            trace,
            out,
            config,
            engine=engine,
            block_tokens=block_tokens,
            limit=limit or None,
            snapshots=snapshots,
        )
    except (ConfigError, UsageError, TraceFormatError) as error:
        raise o.fail(str(error)) from error
    except (RankError, RecordingError) as error:  # the engine's: the run failed, maybe with a recording
        raise o.fail(escape(_recording_failure(error, out, _stamp(out) != written)), 1) from error
    rec = run.recording
    o.console.print(
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
    from refcache.hicache.recording import NeverReturned, read_recording

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
