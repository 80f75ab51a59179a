"""The recorder (``refcache.engines.sglang.record``) and ``refcache record``: a recorded clean run replays
clean on the model; the recorder does not change SGLang's behaviour; its trace of a run is the trace of the
operations that drove it; a run of a patched SGLang diverges, on replay against the model, at the step the
differential harness finds."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.engines.sglang import SGLangSystem
from refcache.engines.sglang.record import SOURCE, record
from refcache.ops import (
    AdvanceClock,
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    StartRequest,
)
from refcache.recording import read_recording
from refcache.systems import open_systems

from .sglang_zoo import SGLANG_ZOO

ROOT = Path(__file__).resolve().parents[3]
HEAD = ROOT / "tests" / "data" / "mooncake_conversation_head300.jsonl"
CONFIG = HiCacheConfig(
    page_size=1, device_size=8, hicache_write_policy=WritePolicy.WRITE_THROUGH
).with_fidelity(PROFILES["sglang-0.5.20"])

W1 = CompleteIO(IOQueue.WRITE, 0, 1)
OPS: list[Op] = [
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    W1,
    CheckHicacheEvents(),
    StartRequest(2, (5, 6, 7, 8, 9, 10)),
    FinishRequest(2),
    Evict(4),
    CheckHicacheEvents(),
    W1,
    CheckHicacheEvents(),
    StartRequest(3, (1, 2, 3, 4, 11), prompt_len=3),
    FinishRequest(3),
    MatchPrefix((5, 6)),
    EvictHost(3),
    AdvanceClock(7),
    CheckHicacheEvents(),
]
"""Every completion completes exactly its count and every admission is admitted: the operations the
recorder can tell apart (it sees a completion, not a request to complete nothing)."""


def _run(ops: list[Op], recorded: Path | None) -> tuple[list[object], list[object]]:
    observations: list[object] = []
    snapshots: list[object] = []
    with SGLangSystem(CONFIG) as system:
        if recorded is None:
            for op in ops:
                observations.append(system.apply(op))
                snapshots.append(system.snapshot())
        else:
            with record(system, recorded, snapshots=True):
                for op in ops:
                    observations.append(system.apply(op))
                    snapshots.append(system.snapshot())
    return observations, snapshots


def test_the_recorder_does_not_change_behaviour_and_records_the_operations(tmp_path: Path) -> None:
    plain = _run(OPS, None)
    path = tmp_path / "run.jsonl"
    recorded = _run(OPS, path)
    assert recorded == plain, "observations and snapshots with the recorder equal those without"
    rec = read_recording(path)
    assert rec.source == SOURCE
    assert rec.config == CONFIG.resolve().with_fidelity(PROFILES["sglang-0.5.20"])
    assert rec.ops == OPS, "the recorder's trace is the adapter's trace of the same operations"
    assert rec.observed == plain[0]
    assert rec.snapshots == plain[1]
    assert replay_recorded(rec) == len(OPS)


def test_a_recorded_mooncake_run_replays_clean_on_the_model(tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    run = _cli("record", str(HEAD), "-o", str(out), "--limit", "40")
    assert run.returncode == 0, run.stdout + run.stderr
    rec = read_recording(out)
    assert len(rec.ops) > 100 and rec.source == SOURCE
    kinds = {type(op).__name__ for op in rec.ops}
    assert {"StartRequest", "FinishRequest", "CompleteIO", "CheckHicacheEvents", "AdvanceClock"} <= kinds
    replay = _cli("replay", str(out), "--against", "model", "--quiet")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "no divergence" in replay.stdout


@pytest.fixture
def patched() -> Iterator[None]:
    bug = SGLANG_ZOO["evict-host-never-counts"]
    SGLangSystem(CONFIG).close()  # SGLang's modules import only behind the adapter's shim
    with bug.applied():
        yield


def test_a_patched_run_diverges_at_the_step_the_harness_finds(tmp_path: Path, patched: None) -> None:
    ops: list[Op] = [
        StartRequest(1, (1, 2, 3, 4)),
        FinishRequest(1),
        W1,
        CheckHicacheEvents(),
        StartRequest(2, (5, 6, 7, 8)),
        FinishRequest(2),
        W1,
        CheckHicacheEvents(),
        Evict(8),
        EvictHost(1),
        CheckHicacheEvents(),
    ]
    path = tmp_path / "patched.jsonl"
    _run(ops, path)
    rec = read_recording(path)
    with pytest.raises(Divergence) as replayed:
        replay_recorded(rec)
    with open_systems(("model", "sglang"), rec.config) as systems:
        harness = Harness(rec.config, systems, write_trace=False)
        with pytest.raises(Divergence) as differential:
            _steps(harness, rec.ops)
    assert replayed.value.step == differential.value.step == 10
    assert replayed.value.kind == "outcomes differ"
    assert "EvictHostResult(num_evicted=1)" not in replayed.value.summary.split("\n")[-1]


def _steps(harness: Harness, ops: list[Op]) -> None:
    for op in ops:
        harness.step(op)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "refcache.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
        check=False,
        cwd=ROOT,
    )
