"""Example budgets: how many examples of how many steps each machine runs, in one place.

The default test run (``nox``, and CI with Hypothesis' ``ci`` profile: derandomized, no database) uses the
``DEFAULT_*`` budgets; the zoo asserts every bug is caught within ``DIFFERENTIAL.examples``; ``refcache
coverage`` and the coverage test use ``MODEL``; ``refcache fuzz`` uses ``FUZZ_STEPS`` per example.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final

from hypothesis import HealthCheck, Phase, settings

__all__ = ["DIFFERENTIAL", "FIDELITY", "FUZZ_STEPS", "IMPL", "KERNEL", "MODEL", "MUTANT", "Budget"]


@dataclass(frozen=True)
class Budget:
    examples: int  # examples per machine
    steps: int  # operations per example (stateful_step_count)

    def settings(self, *, derandomize: bool | None = None, shrink: bool = True) -> settings:
        """Hypothesis settings for this budget: no deadline, no health checks (the machines are slow by
        design); ``derandomize`` None keeps the loaded profile's choice; ``shrink=False`` leaves shrinking to
        ``refcache.check.shrink`` (replaying a trace is far cheaper than re-running the machine)."""
        phases = tuple(Phase) if shrink else (Phase.explicit, Phase.reuse, Phase.generate)
        chosen = settings(
            max_examples=self.examples,
            stateful_step_count=self.steps,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=phases,
        )
        if derandomize is None:
            return chosen
        return settings(chosen, derandomize=derandomize, database=None, print_blob=False)


MODEL: Final = Budget(150, 50)
"""The model machines (``tests/properties``, ``refcache coverage``)."""
DIFFERENTIAL: Final = Budget(150, 40)
"""Model versus implementation over every configuration row (``tests/properties``, the zoo)."""
IMPL: Final = Budget(80, 40)
"""Model versus implementation on the direct rows with drawn dtypes (``tests/impl``)."""
FIDELITY: Final = Budget(40, 40)
"""Model versus implementation under the sglang-0.5.20 fidelity profile (``tests/impl/test_fidelity.py``)."""
KERNEL: Final = Budget(8, 30)
"""The Triton kernel rows, interpreted without CUDA (slow)."""
MUTANT: Final = Budget(int(os.environ.get("REFCACHE_MUTANT_EXAMPLES", "20")), 40)
"""Per mutant under ``nox -s mutants`` (``REFCACHE_MUTANT_EXAMPLES`` scales it)."""
FUZZ_STEPS: Final = 50
"""Operations per example in ``refcache fuzz``."""
