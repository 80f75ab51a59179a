"""The state machines on a small, fixed budget: the per-mutant test subset of ``nox -s mutants``.

The default run's machines (``tests/properties``, ``tests/impl/test_impl_differential.py``) fix 80-150
examples each in code, far too slow to run once per mutant. These run the same machines derandomized
(the same examples on every run, so a mutant's verdict does not depend on luck), without the example
database, and without shrinking (a failing example is enough to kill a mutant; shrinking it would only
spend time). ``REFCACHE_MUTANT_EXAMPLES`` scales the budget (``refcache.check.budget.MUTANT``).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.configs import configs, on_direct_backend
from refcache.check.machines import HiCacheMachine, machine

MODEL_AND_IMPL = ("model", "impl")
DIRECT_CONFIGS = configs().map(on_direct_backend)  # the Triton interpreter would dominate the time
MACHINES: dict[str, tuple[type[HiCacheMachine], budget.Budget]] = {
    "model": (machine(), budget.MUTANT),
    "faulty_model": (machine(faults=True), budget.MUTANT),
    "differential": (
        machine(MODEL_AND_IMPL, configs=DIRECT_CONFIGS),
        dataclasses.replace(budget.MUTANT, steps=30),
    ),
    "faulty_differential": (
        machine(MODEL_AND_IMPL, faults=True, configs=DIRECT_CONFIGS),
        dataclasses.replace(budget.MUTANT, steps=30),
    ),
}


@pytest.mark.parametrize("name", list(MACHINES))
def test_machine(name: str) -> None:
    chosen, mutant_budget = MACHINES[name]
    # derandomized: the same examples on every run, so a mutant's verdict does not depend on luck
    run_state_machine_as_test(chosen, settings=mutant_budget.settings(derandomize=True, shrink=False))  # type: ignore[no-untyped-call, unused-ignore]
