"""The LMCache reference model alone under its state machine (every LMCache invariant after every step), with
the default differential budget; torch-free; it must reach every situation of the family's ledger
(``LMCACHE_SITUATIONS``). LMCache's own nox session runs the same machine against LMCache."""

from __future__ import annotations

from pathlib import Path

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.families import FAMILIES
from refcache.check.lmcache_machines import LMCACHE_SITUATIONS, LMCacheDraws, LMCacheModelMachine
from refcache.lmcache.family import FAMILY as LMCACHE
from refcache.lmcache.model import LMCacheModel

REGRESSIONS = Path(__file__).resolve().parents[1] / "regressions" / "lmcache"


def test_lmcache_model_machine() -> None:
    run_state_machine_as_test(LMCacheModelMachine, settings=budget.DIFFERENTIAL.settings())
    outcomes = LMCacheModelMachine.coverage.outcomes
    reached = (
        "Store:stored",
        "Store:none",
        "Lookup:hit",
        "Retrieve:hit",
        "PollPrefetch:hit",
        "Clear:removed",
        "Step",
    )
    for outcome in reached:
        assert outcomes[outcome], outcome
    # the situations the draws aim at (a damaged copy read back, a pinned lookup meeting an evicted key)
    assert LMCacheModelMachine.coverage.missing_situations(LMCACHE_SITUATIONS) == []


def _situations(path: Path, drop: int | None = None) -> list[set[str]]:
    """The LMCache situations each operation of the trace at ``path`` reaches on the model (``drop``: an
    operation left out)."""
    config, ops = LMCACHE.read_trace(path)
    if drop is not None:
        del ops[drop]
    draws = LMCacheDraws(LMCacheModelMachine(), config)
    model = LMCacheModel(config)
    reached: list[set[str]] = []
    for op in ops:
        before = model.snapshot()
        outcome = model.apply(op)
        reached.append(set(draws.observe(op, outcome, before, model.snapshot())))
    return reached


def test_the_situations_are_those_of_the_f10_and_f11_traces() -> None:
    """Each LMCache situation is recognised at the last step of the finding's shrunk trace and nowhere
    before it, and not once the step that makes it is left out (the damage, the eviction)."""
    f10 = _situations(REGRESSIONS / "F10-damaged-file-delivered.jsonl")
    assert f10[-1] == {"damaged-chunk-read"} and not set().union(*f10[:-1])
    f10_async = _situations(REGRESSIONS / "F10-damaged-file-delivered-async.jsonl")
    assert f10_async[-2] == {"damaged-chunk-read"} and not set().union(*f10_async[:-2], f10_async[-1])
    assert not set().union(*_situations(REGRESSIONS / "F10-damaged-file-delivered.jsonl", drop=4))
    f11 = _situations(REGRESSIONS / "F11-pinned-prefetch-leaves-keys-to-touch.jsonl")
    assert f11[-1] == {"pinned-lookup-touches-evicted"} and not set().union(*f11[:-1])
    assert not set().union(
        *_situations(REGRESSIONS / "F11-pinned-prefetch-leaves-keys-to-touch.jsonl", drop=4)
    )


def test_the_lmcache_report_names_what_was_not_reached() -> None:
    report = FAMILIES["lmcache"].report(Coverage())
    assert "NOT REACHED: situation damaged-chunk-read, situation pinned-lookup-touches-evicted" in report
