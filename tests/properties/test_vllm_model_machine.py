"""The vLLM reference model alone under its state machine (every vLLM invariant after every step), with the
default differential budget; torch-free. ``tests/engines/vllm`` runs the same machine against vLLM."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.vllm_machines import VllmModelMachine


def test_vllm_model_machine() -> None:
    run_state_machine_as_test(VllmModelMachine, settings=budget.DIFFERENTIAL.settings())
    outcomes = VllmModelMachine.coverage.outcomes
    for reached in ("Admit:hit", "Admit:full", "Decode:full", "Store:evicted", "Load:hit", "CompleteStore"):
        assert outcomes[reached], reached
