"""The LMCache family on the checking side: its machine runs model against model at a small budget, catches a
deliberately broken copy of the model (so the comparison can fail), and ``refcache fuzz``, ``replay`` and
``shrink`` take the family's systems and traces."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from typer.testing import CliRunner

from refcache.check.families import family_checks, family_of, trace_family
from refcache.check.harness import Divergence
from refcache.check.machine import family_machine
from refcache.cli import app
from refcache.family import NodeId
from refcache.lmcache._parts import MemoryObj
from refcache.lmcache.family import FAMILY as LMCACHE
from refcache.lmcache.model import LMCacheModel
from refcache.rules.lmcache import RULES
from refcache.systems import SYSTEMS, SystemEntry

SMALL = settings(max_examples=25, stateful_step_count=25, deadline=None, derandomize=True, database=None)
FIND = settings(
    SMALL, phases=(Phase.generate,)
)  # the failure is enough; refcache's own shrink is tested below


class LMCacheCopy(LMCacheModel):
    """The model under another name: two systems that must agree."""


class EvictsNewest(LMCacheModel):
    """The model with a planted bug: a CPU allocation that must evict takes the last candidate in policy order
    instead of the first (an LRU that evicts the most recent entry)."""

    def _allocate(self, key: NodeId, tokens: int) -> MemoryObj | None:
        order = self.cpu_policy.order
        self.cpu_policy.order = lambda mapping: order(mapping)[::-1]  # type: ignore[method-assign]
        try:
            return super()._allocate(key, tokens)
        finally:
            self.cpu_policy.order = order  # type: ignore[method-assign]


@pytest.fixture
def systems(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        SYSTEMS, "lmcache-copy", SystemEntry("a copy", f"{__name__}:LMCacheCopy", family="lmcache")
    )
    monkeypatch.setitem(
        SYSTEMS, "lmcache-bug", SystemEntry("a bug", f"{__name__}:EvictsNewest", family="lmcache")
    )


@pytest.mark.usefixtures("systems")
def test_model_against_model_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    machine = family_machine(LMCACHE, RULES, ("lmcache-model", "lmcache-copy"), name="LMCacheCopyMachine")
    run_state_machine_as_test(machine, settings=SMALL)
    assert machine.coverage.runs >= 25 and machine.coverage.steps > 200 and not machine.coverage.failures


@pytest.mark.usefixtures("systems")
def test_a_broken_model_is_caught(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    machine = family_machine(LMCACHE, RULES, ("lmcache-model", "lmcache-bug"), name="LMCacheBugMachine")
    with pytest.raises(Divergence, match="lmcache-bug"):
        run_state_machine_as_test(machine, settings=FIND)


def test_the_family_is_registered() -> None:
    assert family_of(["lmcache-model"]) is family_checks("lmcache")
    assert SYSTEMS["lmcache-model"].family == "lmcache"


@pytest.mark.usefixtures("systems")
def test_fuzz_shrink_and_replay_take_the_family(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    ok = CliRunner().invoke(app, ["fuzz", "--against", "lmcache-model,lmcache-copy", "--examples", "5"])
    assert ok.exit_code == 0 and "Store:" in ok.output, ok.output
    against = "lmcache-model,lmcache-bug"
    result = CliRunner().invoke(app, ["fuzz", "--against", against, "--examples", "40"])
    assert result.exit_code == 1, result.output
    match = re.search(rf"replay with: refcache replay (\S+) --against {against}", result.output)
    assert match is not None, result.output
    shrunk = Path(match.group(1))
    assert LMCACHE.is_trace(shrunk.read_text()) and trace_family(shrunk) is family_checks("lmcache")
    replayed = CliRunner().invoke(app, ["replay", str(shrunk), "--against", against])
    assert replayed.exit_code == 1 and "DIVERGENCE" in replayed.output, replayed.output
    agreed = CliRunner().invoke(app, ["replay", str(shrunk), "--against", "lmcache-model"])
    assert agreed.exit_code == 0 and "cpu " in agreed.output, agreed.output
    again = tmp_path / "again.jsonl"
    shrunk_again = CliRunner().invoke(
        app, ["shrink", str(shrunk), "--against", against, "--out", str(again), "--seconds", "5"]
    )
    assert shrunk_again.exit_code in (0, 1) and again.exists(), shrunk_again.output
