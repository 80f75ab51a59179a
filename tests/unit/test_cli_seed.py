"""``refcache fuzz --seed N`` (#29 item 9): printed when a run starts, written in every trace header, and a
run with the same seed, options and budget draws the same examples."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.cli import app
from refcache.config import HiCacheConfig
from refcache.errors import TraceFormatError
from refcache.hicache.ops import Done, FinishRequest, Observation, Op
from refcache.hicache.trace import dumps_trace, loads_trace, read_trace, stamp_seed
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, SystemEntry

ROOT = Path(__file__).parent.parent.parent
REGRESSIONS = sorted((ROOT / "tests" / "regressions").glob("*.jsonl"))


def _fuzz(seed: int, database: Path, *extra: str) -> str:
    args = ["fuzz", "--against", "model", "--examples", "8", "--batch", "2", "--steps", "30"]
    result = CliRunner().invoke(app, [*args, "--seed", str(seed), "--database", str(database), *extra])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_a_fuzz_run_with_a_seed_reproduces(tmp_path: Path) -> None:
    first = _fuzz(7, tmp_path / "a")
    assert first == _fuzz(7, tmp_path / "b")  # the report counts every state, transition and step
    assert first != _fuzz(8, tmp_path / "c")  # and the seed is what fixes them


def test_the_seed_is_printed_when_the_run_starts(tmp_path: Path) -> None:
    args = ["fuzz", "--against", "model", "--examples", "1", "--database", str(tmp_path)]
    result = CliRunner().invoke(app, [*args, "--seed", "1234"])
    assert result.exit_code == 0 and "seed 1234" in result.output.splitlines()[0], result.output
    unseeded = CliRunner().invoke(app, args)
    assert unseeded.exit_code == 0 and "--seed " in unseeded.output.splitlines()[0], unseeded.output


class Liar(HiCacheModel):
    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        return Done() if isinstance(op, FinishRequest) else obs


def test_a_failing_runs_traces_name_its_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SYSTEMS, "liar", SystemEntry("a model that lies", f"{__name__}:Liar"))
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    args = ["fuzz", "--against", "model,liar", "--examples", "30", "--seed", "99", "--shrink-seconds", "5"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    traces = sorted(tmp_path.glob("*.jsonl"))
    assert len(traces) == 2 and any(t.name.endswith(".min.jsonl") for t in traces), traces
    for trace in traces:
        assert json.loads(trace.read_text().splitlines()[0])["seed"] == 99
        read_trace(trace)  # still a trace any reader takes


def test_the_seed_header_field_is_optional_and_checked(tmp_path: Path) -> None:
    for trace in REGRESSIONS:  # traces written before the field read as before
        read_trace(trace)
    path = tmp_path / "t.jsonl"
    path.write_text(dumps_trace(HiCacheConfig(), []))
    stamp_seed(path, 5)
    assert json.loads(path.read_text().splitlines()[0])["seed"] == 5 and read_trace(path)
    head = json.loads(path.read_text().splitlines()[0])
    for bad in (-1, "5", True):
        head["seed"] = bad
        with pytest.raises(TraceFormatError, match="seed must be a non-negative integer"):
            loads_trace(json.dumps(head) + "\n")


def test_ci_true_changes_nothing_in_a_seeded_fuzz_run(tmp_path: Path) -> None:
    """What ``fuzz --help`` says: Hypothesis' CI profile is the test suite's, not fuzz's."""
    import os
    import subprocess
    import sys

    outputs = []
    for ci in ("true", None):
        env = {k: v for k, v in os.environ.items() if k != "CI"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if ci is not None:
            env["CI"] = ci
        args = [
            "fuzz",
            "--against",
            "model",
            "--examples",
            "6",
            "--seed",
            "3",
            "--database",
            str(tmp_path / str(ci)),
        ]
        result = subprocess.run(
            [sys.executable, "-m", "refcache.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert outputs[0] == outputs[1]
