"""The default budget reaches every node state, every transition and every in-flight table filled and
drained — otherwise the state machines would pass by never getting anywhere."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from refcache import strategies
from refcache.strategies import Coverage, FaultyModelMachine, ModelMachine, coverage_report


def test_default_budget_reaches_every_state_transition_and_table(monkeypatch: pytest.MonkeyPatch) -> None:
    fresh = Coverage()
    monkeypatch.setattr(strategies, "COVERAGE", fresh)
    budget = settings(
        max_examples=150,
        stateful_step_count=50,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    for machine in (ModelMachine, FaultyModelMachine):
        run_state_machine_as_test(machine, settings=budget)  # type: ignore[no-untyped-call, unused-ignore]
    print(coverage_report(fresh))
    assert fresh.missing() == []


def test_coverage_report_names_what_was_not_reached() -> None:
    empty = Coverage()
    missing = empty.missing()
    assert "state device" in missing
    assert "transition gone--insert_leaf" in missing
    assert "table ongoing_prefetch drained" in missing
    assert "NOT REACHED" in coverage_report(empty)
