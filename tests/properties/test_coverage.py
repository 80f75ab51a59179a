"""The default budget reaches every node state, every transition, every in-flight table filled and
drained and every situation of ``refcache.check.situations`` — otherwise the state machines would pass by
never getting anywhere, or never where the known HiCache bugs live."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage, coverage_report
from refcache.check.machines import machine


def test_default_budget_reaches_every_state_transition_and_table() -> None:
    ledger = Coverage()
    for faults in (False, True):
        run_state_machine_as_test(  # type: ignore[no-untyped-call, unused-ignore]
            machine(faults=faults, coverage=ledger), settings=budget.MODEL.settings(derandomize=True)
        )
    print(coverage_report(ledger))
    assert ledger.missing() == []


def test_coverage_report_names_what_was_not_reached() -> None:
    empty = Coverage()
    missing = empty.missing()
    assert "state device" in missing
    assert "transition gone--insert_leaf" in missing
    assert "table ongoing_prefetch drained" in missing
    assert "situation load-back-chain" in missing
    assert "situation loads-in-flight-interleaved" in missing
    assert "situation load-back-write-back-short-of-host" in missing
    assert "situation flipped-payload-read" in missing
    assert "NOT REACHED" in coverage_report(empty)
