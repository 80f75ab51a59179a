"""refcache.check.shrink and ``refcache shrink``: a failing trace cut down to a short one failing the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.check.generate import random_ops
from refcache.check.shrink import failure_of, shrink_trace
from refcache.cli import app
from refcache.config import HiCacheConfig, WritePolicy
from refcache.errors import UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import AdvanceClock, Done, EvictHost, FinishRequest, Observation, Op, StartRequest
from refcache.hicache.snapshot import Snapshot
from refcache.hicache.trace import read_trace, write_trace
from refcache.model import HiCacheModel
from refcache.systems import OpenSystems

CONFIG = HiCacheConfig(device_size=32, hicache_write_policy=WritePolicy.WRITE_THROUGH).resolve()


class Liar(HiCacheModel):
    """The model, except that it misreports the finish of request ``rid``."""

    def __init__(self, config: HiCacheConfig, rid: int) -> None:
        super().__init__(config)
        self.rid = rid

    def apply(self, op: Op) -> Observation:
        obs = super().apply(op)
        if isinstance(op, FinishRequest) and op.rid == self.rid and not isinstance(obs, Done):
            return Done()
        return obs


def pair(rid: int) -> OpenSystems[Op, Observation, Snapshot]:
    return OpenSystems({"model": HiCacheModel(CONFIG), "liar": Liar(CONFIG, rid)})


def long_failing_trace() -> list[Op]:
    """200 random operations, then a request whose finish the liar misreports."""
    ops = [op for op in random_ops(CONFIG, 200, seed=7) if not isinstance(op, (StartRequest, FinishRequest))]
    return [*ops, StartRequest(999, (5, 6, 7)), EvictHost(1), FinishRequest(999), EvictHost(2)]


def test_a_long_trace_shrinks_to_the_two_operations_that_matter() -> None:
    ops = long_failing_trace()
    failure = failure_of(CONFIG, ops, lambda _cfg: pair(999), family=HICACHE)
    assert failure is not None and failure.kind == "outcomes differ" and failure.step == len(ops) - 1

    seen: list[int] = []
    result = shrink_trace(
        CONFIG, ops, lambda _cfg: pair(999), family=HICACHE, on_progress=lambda n, _r: seen.append(n)
    )
    assert result.ops == [StartRequest(999, (5, 6, 7)), FinishRequest(999)]
    assert result.complete and result.failure.kind == "outcomes differ"
    assert result.original_length == len(ops) and seen == sorted(seen, reverse=True)


def test_a_trace_that_does_not_fail_cannot_be_shrunk() -> None:
    ops = long_failing_trace()
    with pytest.raises(UsageError, match="nothing to shrink"):
        shrink_trace(CONFIG, ops, lambda _cfg: pair(12345), family=HICACHE)


def test_the_time_budget_is_honoured() -> None:
    result = shrink_trace(CONFIG, long_failing_trace(), lambda _cfg: pair(999), family=HICACHE, seconds=0.0)
    assert not result.complete and result.replays == 1
    assert result.ops[-1] == FinishRequest(999)  # already cut after the failing step


class CrashyLiar(Liar):
    """Also crashes on the marker ``AdvanceClock(77_777)`` unless request ``rid`` has started: removing
    that start gives a one-operation trace that fails, but with another kind of failure."""

    def apply(self, op: Op) -> Observation:
        if op == AdvanceClock(77_777) and self.rid not in self.ranks[0].requests:
            raise RuntimeError("marker reached without the request")
        return super().apply(op)


def test_only_the_same_kind_of_failure_counts() -> None:
    ops: list[Op] = [StartRequest(999, (5, 6, 7)), AdvanceClock(77_777), FinishRequest(999)]

    def crashy(cfg: HiCacheConfig) -> OpenSystems[Op, Observation, Snapshot]:
        return OpenSystems({"model": HiCacheModel(cfg), "liar": CrashyLiar(cfg, 999)})

    crash = failure_of(CONFIG, ops[1:], crashy, family=HICACHE)
    assert crash is not None and crash.kind == "liar crashed"  # a shorter trace fails, but differently...
    result = shrink_trace(CONFIG, ops, crashy, family=HICACHE)
    assert result.failure.kind == "outcomes differ"  # ...is not what we started from: rejected
    assert result.ops == [StartRequest(999, (5, 6, 7)), FinishRequest(999)]


def test_cli_writes_the_shrunk_trace_next_to_the_original(tmp_path: Path) -> None:
    trace = tmp_path / "failing.jsonl"
    write_trace(trace, CONFIG, long_failing_trace())
    # The CLI shrinks against the model (and the implementation); the model agrees with itself, so the
    # trace does not fail there: exit 2 with a clear message, nothing written.
    result = CliRunner().invoke(app, ["shrink", str(trace), "--against", "model", "--seconds", "5"])
    assert result.exit_code == 2 and "nothing to shrink" in result.output
    assert not (tmp_path / "failing.min.jsonl").exists()


def test_cli_shrinks_an_invariant_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model that breaks an invariant on one request: the CLI writes a short trace that still breaks it."""
    original = HiCacheModel.apply

    def broken(self: HiCacheModel, op: Op) -> Observation:
        obs = original(self, op)
        if isinstance(op, FinishRequest) and op.rid == 999:
            self.ranks[0].evictable_size += 1  # the SIZE-ACCOUNTING invariant must notice
        return obs

    trace = tmp_path / "failing.jsonl"
    write_trace(trace, CONFIG, long_failing_trace())
    monkeypatch.setattr(HiCacheModel, "apply", broken)
    result = CliRunner().invoke(app, ["shrink", str(trace), "--against", "model", "--seconds", "20"])
    assert result.exit_code == 0, result.output
    _, ops = read_trace(tmp_path / "failing.min.jsonl")
    assert ops == [StartRequest(999, (5, 6, 7)), FinishRequest(999)]
    assert "1-minimal" in result.output


def test_fuzz_shrinks_the_failing_run_it_finds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``refcache fuzz`` keeps Hypothesis from shrinking (minutes per failure on these machines) and cuts
    the failing run's trace with ``refcache.check.shrink`` instead."""
    original = HiCacheModel.apply

    def broken(self: HiCacheModel, op: Op) -> Observation:
        obs = original(self, op)
        if isinstance(op, FinishRequest):
            self.ranks[0].evictable_size += 1
        return obs

    monkeypatch.setattr(HiCacheModel, "apply", broken)
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    result = CliRunner().invoke(
        app, ["fuzz", "--against", "model", "--examples", "40", "--shrink-seconds", "20"]
    )
    assert result.exit_code == 1, result.output
    assert "FAILED" in result.output and "1-minimal" in result.output
    shrunk = sorted(tmp_path.glob("*.min.jsonl"))
    assert len(shrunk) == 1
    _, ops = read_trace(shrunk[0])
    assert [type(op) for op in ops] == [StartRequest, FinishRequest]
