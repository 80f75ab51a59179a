"""The vLLM reference model against vLLM 0.33's own managers, at the default differential budget."""

from __future__ import annotations

from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.rules.vllm import VllmDifferentialMachine


def test_vllm_model_agrees_with_vllm() -> None:
    run_state_machine_as_test(VllmDifferentialMachine, settings=budget.DIFFERENTIAL.settings())
    cov = VllmDifferentialMachine.coverage
    print(
        f"vllm-model vs vllm: {cov.runs} examples, {cov.steps} steps; outcomes {dict(sorted(cov.outcomes.items()))}"
    )
    for reached in ("Admit:hit", "Admit:full", "Decode:full", "Store:evicted", "Load:hit", "CompleteStore"):
        assert cov.outcomes[reached], reached
