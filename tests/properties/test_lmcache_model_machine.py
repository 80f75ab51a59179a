"""The LMCache reference model alone under its state machine (every LMCache invariant after every step), with
the default differential budget; torch-free. LMCache's own nox session runs the same machine against
LMCache."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.rules.lmcache import LMCacheModelMachine


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
