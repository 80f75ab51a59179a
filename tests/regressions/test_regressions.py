"""Every trace under tests/regressions/ replays without divergence or invariant violation, and every one of
its operations really ran.

A trace lands here when it once exposed a bug (e.g. ``tp2-prefetch-min-of-ranks.jsonl`` caught the I/O
helper releasing the wrong part of a prefetch's host slots after the scheduler had taken the read prefix).
The harness counts the same error from every system as agreement, so a trace whose operations were all
refused (a configuration a system cannot run, a missing kernel backend) would pass without testing
anything: each replay also asserts that no operation was refused and every request was admitted.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from refcache.check.harness import Harness
from refcache.errors import RefcacheError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import StartRequest, StartResult
from refcache.hicache.trace import read_trace
from refcache.systems import open_systems

TRACES = sorted(Path(__file__).parent.glob("*.jsonl"))


def test_there_are_regression_traces() -> None:
    assert TRACES


@pytest.mark.parametrize("trace", TRACES, ids=[t.stem for t in TRACES])
def test_trace_replays_against_model_and_implementation(trace: Path, tmp_path: Path) -> None:
    config, ops = read_trace(trace)
    with open_systems(("model", "impl"), config) as systems:
        harness = Harness(config, systems, trace_dir=tmp_path, family=HICACHE)
        for index, op in enumerate(ops, 1):
            outcome = harness.step(op)
            assert not isinstance(outcome, RefcacheError), f"step {index} {op!r} was refused: {outcome!r}"
            if isinstance(op, StartRequest):
                assert isinstance(outcome, StartResult) and outcome.admitted, f"step {index}: {outcome!r}"
