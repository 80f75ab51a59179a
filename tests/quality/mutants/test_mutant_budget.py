"""The state machines on a small, fixed budget: the per-mutant test subset of ``nox -s mutants``.

The default run's machines (``tests/properties``, ``tests/impl/test_impl_differential.py``) fix 80-150
examples each in code, far too slow to run once per mutant. These run the same machines derandomized
(the same examples on every run, so a mutant's verdict does not depend on luck), without the example
database, and without shrinking (a failing example is enough to kill a mutant; shrinking it would only
spend time). ``REFCACHE_MUTANT_EXAMPLES`` scales the budget.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, run_state_machine_as_test

from refcache.config import HiCacheConfig, IOBackend, MemLayout
from refcache.differential import DifferentialMachine
from refcache.strategies import FaultyModelMachine, ModelMachine, configs

EXAMPLES = int(os.environ.get("REFCACHE_MUTANT_EXAMPLES", "20"))


def _budget(examples: int, steps: int) -> settings:
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )


def _direct(config: HiCacheConfig) -> HiCacheConfig:
    """The same configuration on the direct io backend: the Triton interpreter would dominate the time,
    and the kernels are no part of what is mutated here."""
    if config.hicache_io_backend is IOBackend.DIRECT:
        return config
    layout = (
        MemLayout.LAYER_FIRST
        if config.hicache_mem_layout is MemLayout.LAYER_FIRST
        else MemLayout.PAGE_FIRST_DIRECT
    )
    return dataclasses.replace(config, hicache_io_backend=IOBackend.DIRECT, hicache_mem_layout=layout)


class DirectDifferentialMachine(DifferentialMachine):
    """``DifferentialMachine`` with every drawn configuration moved to the direct io backend."""

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        ModelMachine.setup(self, _direct(data.draw(configs(), label="config")))


class DirectFaultyDifferentialMachine(FaultyModelMachine, DirectDifferentialMachine):
    """The faulty rules too."""


MACHINES: dict[str, tuple[type[RuleBasedStateMachine], int, int]] = {
    "model": (ModelMachine, EXAMPLES, 40),
    "faulty_model": (FaultyModelMachine, EXAMPLES, 40),
    "differential": (DirectDifferentialMachine, EXAMPLES, 30),
    "faulty_differential": (DirectFaultyDifferentialMachine, EXAMPLES, 30),
}


@pytest.mark.parametrize("name", list(MACHINES))
def test_machine(name: str) -> None:
    machine, examples, steps = MACHINES[name]
    run_state_machine_as_test(machine, settings=_budget(examples, steps))  # type: ignore[no-untyped-call, unused-ignore]
