"""The vLLM reference model alone under its state machine (every vLLM invariant after every step), with the
default differential budget; torch-free. ``tests/engines/vllm`` runs the same machine against vLLM. The
budget must reach every situation of vLLM's ledger (``refcache.rules.vllm.VLLM_SITUATIONS``: the offload
manager's edge states when a store needs room), or the machine would pass by never getting there."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.machine import family_machine
from refcache.rules.vllm import RULES, VLLM_SITUATIONS, VllmModelMachine, vllm_coverage_report
from refcache.vllm.family import FAMILY as VLLM


def test_vllm_model_machine() -> None:
    run_state_machine_as_test(VllmModelMachine, settings=budget.DIFFERENTIAL.settings())
    outcomes = VllmModelMachine.coverage.outcomes
    for reached in ("Admit:hit", "Admit:full", "Decode:full", "Store:evicted", "Load:hit", "CompleteStore"):
        assert outcomes[reached], reached


def test_default_budget_reaches_every_vllm_situation() -> None:
    """CI's sample (derandomized, as the coverage test of HiCache's ledger) of the machine's default budget."""
    ledger = Coverage()
    run_state_machine_as_test(
        family_machine(VLLM, RULES, ("vllm-model",), coverage=ledger, name="VllmModelMachine"),
        settings=budget.DIFFERENTIAL.settings(derandomize=True),
    )
    print(vllm_coverage_report(ledger))
    assert ledger.missing_situations(VLLM_SITUATIONS) == []


def test_vllm_report_names_what_was_not_reached() -> None:
    empty = Coverage()
    assert "situation arc-evicts-t1-empty" in empty.missing_situations(VLLM_SITUATIONS)
    assert "NOT REACHED: situation store-evicts-beside-own-chunks" in vllm_coverage_report(empty)
