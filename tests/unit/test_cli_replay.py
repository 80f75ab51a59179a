"""``refcache replay``'s output fits a terminal (#29 item 4): one line per step at most, token tuples
elided, the divergence in full; ``-v`` prints everything. Tried on a trace of a recording's size (200
requests of 2,000 tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.cli import app
from refcache.cli.replay import PIPED_WIDTH, elide
from refcache.config import HiCacheConfig, WritePolicy
from refcache.hicache.ops import Done, FinishRequest, Observation, Op, StartRequest
from refcache.hicache.trace import write_trace
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, SystemEntry

ROOT = Path(__file__).parent.parent.parent
CONFIG = HiCacheConfig(device_size=8192, page_size=16, hicache_write_policy=WritePolicy.WRITE_THROUGH)


def _big_trace(path: Path, requests: int = 200, tokens: int = 2000) -> int:
    ops: list[Op] = []
    for rid in range(requests):
        start = (rid % 20) * 500  # requests share prefixes, as a conversation trace's do
        ops += [StartRequest(rid, tuple(range(start, start + tokens))), FinishRequest(rid)]
    write_trace(path, CONFIG, ops)
    return len(ops)


def _replay(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("COLUMNS", None)
    return subprocess.run(
        [sys.executable, "-m", "refcache.cli", "replay", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_recorded_size_replay_is_one_short_line_per_step(tmp_path: Path) -> None:
    trace = tmp_path / "big.jsonl"
    steps = _big_trace(trace)
    result = _replay(str(trace), "--against", "model")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == steps + 1  # a line per step and the verdict
    assert max(len(line) for line in lines[:-1]) <= PIPED_WIDTH, max(lines, key=len)
    assert "... 2000 tokens)" in lines[0] and "1999" not in lines[0]
    everything = _replay(str(trace), "--against", "model", "-v")
    assert everything.returncode == 0 and len(everything.stdout.splitlines()) == 3 * steps + 1
    assert "1999" in everything.stdout.splitlines()[0]  # -v: every token


def test_elide_keeps_short_tuples_and_cuts_long_ones() -> None:
    assert elide("StartRequest(rid=1, tokens=(1, 2, 3, 4, 5), extra_key=None)").endswith(
        "(1, 2, 3, 4, 5), extra_key=None)"
    )
    assert elide("X(t=(1, 2, 3, 4, 5, 6), u=[7, 8, 9, 10, 11, 12, 13])") == (
        "X(t=(1, 2, 3, ... 6 tokens), u=[7, 8, 9, ... 7 tokens])"
    )


class Liar(HiCacheModel):
    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        return Done() if isinstance(op, FinishRequest) else obs


def test_the_divergence_is_printed_in_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SYSTEMS, "liar", SystemEntry("a model that lies", f"{__name__}:Liar"))
    trace = tmp_path / "big.jsonl"
    _big_trace(trace, requests=3)
    result = CliRunner().invoke(app, ["replay", str(trace), "--against", "model,liar"])
    assert result.exit_code == 1
    divergence = result.output[result.output.index("DIVERGENCE") :]
    assert "outcomes differ" in divergence and "FinishRequest(rid=0)" in divergence
    assert "…" not in divergence
