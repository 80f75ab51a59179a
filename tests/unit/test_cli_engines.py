"""A missing engine, an adapter that cannot drive the installed release, and an engine that crashes: each
is told apart (#29 item 1). The dev virtualenv has neither SGLang nor vLLM, so the missing-engine tests run
the real console command in a subprocess there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.cli import app
from refcache.config import HiCacheConfig
from refcache.errors import UnsupportedError
from refcache.hicache.snapshot import Snapshot
from refcache.hicache.trace import write_trace
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, SystemEntry

ROOT = Path(__file__).parent.parent.parent
EXCERPT = ROOT / "tests" / "data" / "mooncake_conversation_head300.jsonl"
REGRESSION = sorted((ROOT / "tests" / "regressions").glob("*.jsonl"))[0]

needs_no_sglang = pytest.mark.skipif(
    importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here"
)
needs_no_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here"
)


def run(*args: str, cwd: Path, trace_dir: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["REFCACHE_TRACE_DIR"] = str(trace_dir)
    return subprocess.run(
        [sys.executable, "-m", "refcache.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _one_line_install_hint(result: subprocess.CompletedProcess[str], package: str, install: str) -> None:
    assert result.returncode == 2, result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert f"'{package}'" in result.stderr and install in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "transformers" not in result.stderr, result.stderr
    assert result.stdout == ""


@needs_no_sglang
@pytest.mark.parametrize(
    "args",
    [
        ("fuzz", "--against", "model,sglang", "--examples", "2"),
        ("replay", str(REGRESSION), "--against", "model,sglang"),
        ("shrink", str(REGRESSION), "--against", "model,sglang"),
        ("simulate", str(EXCERPT), "--against", "sglang", "--limit", "5"),
        ("record", str(EXCERPT), "-o", "recorded.jsonl", "--limit", "5"),
    ],
    ids=["fuzz", "replay", "shrink", "simulate", "record"],
)
def test_a_missing_sglang_is_one_line_with_its_install_command_and_nothing_is_written(
    args: tuple[str, ...], tmp_path: Path
) -> None:
    traces = tmp_path / "traces"
    result = run(*args, cwd=tmp_path, trace_dir=traces)
    _one_line_install_hint(result, "sglang", "nox -s sglang")
    assert not traces.exists()  # no example database entry, no trace
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no recording, no .hypothesis


@needs_no_vllm
def test_a_missing_vllm_is_one_line_with_its_install_command(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    result = run("fuzz", "--against", "vllm-model,vllm", "--examples", "2", cwd=tmp_path, trace_dir=traces)
    _one_line_install_hint(result, "vllm", "nox -s vllm")
    assert not traces.exists()


class CrashesOnSnapshot(HiCacheModel):
    """An engine whose first ``snapshot()`` raises (its own bug, not a refusal)."""

    def snapshot(self) -> Snapshot:
        raise RuntimeError("the engine fell over")


class CrashesOnOpen(HiCacheModel):
    def __init__(self, config: HiCacheConfig) -> None:
        raise RuntimeError("the engine would not start")


def _unsupported(config: HiCacheConfig) -> HiCacheModel:
    raise UnsupportedError("refcache drives Engine 1.x; this is Engine 2.0")


@pytest.fixture
def crashing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, target in (
        ("crash-snapshot", "CrashesOnSnapshot"),
        ("crash-open", "CrashesOnOpen"),
        ("unsupported", "_unsupported"),
    ):
        monkeypatch.setitem(SYSTEMS, name, SystemEntry(f"a test engine ({name})", f"{__name__}:{target}"))


@pytest.mark.usefixtures("crashing")
def test_an_engine_crashing_in_its_first_snapshot_is_a_finding_with_the_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    args = ["fuzz", "--against", "model,crash-snapshot", "--examples", "2", "--shrink-seconds", "0"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "step 0: crash-snapshot crashed in its first snapshot: RuntimeError: the engine fell over" in (
        result.output
    )
    assert "trace written to" in result.output and list(tmp_path.glob("*.jsonl"))
    trace = tmp_path / "t.jsonl"
    write_trace(trace, HiCacheConfig(), [])
    result = CliRunner().invoke(app, ["replay", str(trace), "--against", "model,crash-snapshot"])
    assert result.exit_code == 1 and "crash-snapshot crashed in its first snapshot" in result.output


@pytest.mark.usefixtures("crashing")
def test_an_engine_crashing_when_opened_is_a_finding_and_an_unsupported_release_a_usage_error(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, HiCacheConfig(), [])
    crashed = CliRunner().invoke(app, ["replay", str(trace), "--against", "model,crash-open"])
    assert crashed.exit_code == 1 and "crashed when opened: RuntimeError" in crashed.output, crashed.output
    unsupported = CliRunner().invoke(app, ["replay", str(trace), "--against", "model,unsupported"])
    assert unsupported.exit_code == 2, unsupported.output
    assert "error: refcache drives Engine 1.x; this is Engine 2.0" in unsupported.output
    args = ["fuzz", "--against", "model,unsupported", "--examples", "2", "--database", str(tmp_path / "db")]
    unsupported = CliRunner().invoke(app, args)
    assert unsupported.exit_code == 2, unsupported.output
    assert "error: refcache drives Engine 1.x; this is Engine 2.0" in unsupported.output
    crashed = CliRunner().invoke(
        app, ["fuzz", "--against", "model,crash-open", "--examples", "2", "--database", str(tmp_path / "db")]
    )
    assert crashed.exit_code == 1 and "a system crashed before its first step: RuntimeError" in crashed.output
