"""Every trace under tests/regressions/ replays without divergence or invariant violation.

A trace lands here when it once exposed a bug (e.g. ``tp2-prefetch-min-of-ranks.jsonl`` caught the I/O
helper releasing the wrong part of a prefetch's host slots after the scheduler had taken the read prefix).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import refcache.differential  # noqa: F401  # sets TRITON_INTERPRET on a CPU-only machine before Triton loads
from refcache.gpu.driver import HiCacheImpl
from refcache.harness import Harness
from refcache.model import HiCacheModel
from refcache.trace import read_trace

TRACES = sorted(Path(__file__).parent.glob("*.jsonl"))


def test_there_are_regression_traces() -> None:
    assert TRACES


@pytest.mark.parametrize("trace", TRACES, ids=[t.stem for t in TRACES])
def test_trace_replays_against_model_and_implementation(trace: Path, tmp_path: Path) -> None:
    config, ops = read_trace(trace)
    with HiCacheImpl(config, l3_dir=str(tmp_path / "l3")) as impl:
        harness = Harness(config, {"model": HiCacheModel(config), "impl": impl}, trace_dir=tmp_path)
        for op in ops:
            harness.step(op)
