"""The driver of ``refcache record``: a request trace through a real engine, the way the scheduler runs it,
with the engine's recorder on.

``record_run`` reads a Mooncake trace (``refcache.sim.mooncake`` through ``Workload``: timestamp order,
``block_tokens`` simulated tokens per block), opens the engine from the registry (``open_systems``: for
``sglang`` that is the adapter's own construction of SGLang 0.5.20's ``HiRadixCache``), wraps its live
cache in the engine's recorder and runs ``refcache.sim.simulator.simulate`` over it — the scheduler loop of
the simulator (clock to the arrival, admission with one retry after a drain, the load waited for by the
forward pass, finish, background I/O drained every ``drain_every`` requests), unchanged. What the recorder
writes is therefore what the engine did on realistic traffic, not what the simulator asked for.

The recorder is imported by name (``SystemEntry.recorder``), as the registry imports systems: the checking
and simulation side never imports an engine module statically (``pyproject.toml``, import-linter).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.hicache.recording import Recording
from refcache.sim.report import SimReport
from refcache.sim.simulator import SimOptions, simulate
from refcache.sim.workload import Workload
from refcache.systems import SYSTEMS, HiCacheSystem, open_systems

__all__ = ["RECORDERS", "RecordedRun", "Recorder", "RecordingRecorder", "record_run"]


class RecordingRecorder(Protocol):
    """What a recorder's context yields: the recording so far."""

    def recording(self) -> Recording: ...


class Recorder(Protocol):
    """An engine's recorder (``SystemEntry.recorder``): a context manager over an open system that records
    every call and completion to ``path`` (written on exit)."""

    def __call__(
        self, system: HiCacheSystem, path: str | os.PathLike[str], *, snapshots: bool = ...
    ) -> AbstractContextManager[RecordingRecorder]: ...


RECORDERS: Final[Mapping[str, str]] = {
    name: entry.recorder for name, entry in SYSTEMS.items() if entry.recorder is not None
}
"""Engines with a recorder: registry name -> ``module:function`` (``SystemEntry.recorder``), read when this
module is imported; ``record_run`` reads the registry itself."""


@dataclass(frozen=True)
class RecordedRun:
    report: SimReport
    recording: Recording


def record_run(
    trace: Path,
    out: Path,
    config: HiCacheConfig,
    *,
    engine: str = "sglang",
    block_tokens: int = 16,
    limit: int | None = None,
    snapshots: bool = False,
    options: SimOptions | None = None,
) -> RecordedRun:
    """Run the Mooncake ``trace`` through ``engine`` with its recorder on; write the recorded trace to
    ``out``. Raises ``UsageError`` for an engine without a recorder (or not installed)."""
    entry = SYSTEMS.get(engine)
    if entry is None or entry.recorder is None:
        with_one = [n for n, e in SYSTEMS.items() if e.recorder is not None]
        raise UsageError(f"no recorder for {engine!r}; engines with one: {', '.join(with_one)}")
    module, _, name = entry.recorder.partition(":")
    try:
        recorder: Recorder = getattr(importlib.import_module(module), name)
    except ImportError as error:
        raise UsageError(
            f"cannot import the {engine} recorder ({error}); install it with: {entry.install}"
        ) from error
    workload = Workload.from_trace(trace, block_tokens=block_tokens, limit=limit)
    options = options or SimOptions(audit_every=0)
    with open_systems([engine], config) as systems:
        system = systems[engine]
        with recorder(system, out, snapshots=snapshots) as rec:
            report = simulate(workload, config, options, system=system, trace_name=trace.name)
        recording: Recording = rec.recording()
    return RecordedRun(report, recording)
