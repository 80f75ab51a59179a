"""The HiCache family's checking side, registered (``CHECKS``, found by ``refcache.check.families.FAMILIES``):
its own machines, given as the two factories every family's checks are built from.

HiCache's machine stays in the checking side (``refcache.check.machines.machine``: a ``FamilyMachine`` with its
own rules, with and without storage faults), as do its situations (``refcache.check.situations``), the
coverage report (``refcache.check.coverage.coverage_report``), what is enabled in a state
(``refcache.check.enabled``) and the explorer (``refcache.check.explore``): every derandomized HiCache sample
CI runs (the coverage test, the bug zoo's catches) depends on those machines' class names and module, and the
zoo would have to be re-measured if they moved. What moved here is only how they are registered: a fuzz run
takes turns with the machine without faults and the faulty one, named after the systems (``ModelImplMachine``,
``FaultyModelImplMachine``), the zoo hunts with one of them under the name it gives.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from hypothesis.stateful import RuleBasedStateMachine

from refcache.check.configs import configs
from refcache.check.coverage import Coverage, coverage_report
from refcache.check.families import FamilyChecks
from refcache.check.machines import machine
from refcache.hicache import FAMILY as HICACHE
from refcache.systems import SystemOptions, excluded_values

__all__ = ["CHECKS", "hicache_hunter", "hicache_machines"]


def hicache_machines(
    systems: Sequence[str],
    constraints: Mapping[str, object],
    ledger: Coverage,
    suffix: str,
    options: SystemOptions,
) -> list[type[RuleBasedStateMachine]]:
    """The machines a fuzz run over ``systems`` takes turns with: without faults, then with them, each drawing
    configurations under ``constraints``, filling ``ledger``, named after the systems (and ``suffix``)."""
    out: list[type[RuleBasedStateMachine]] = []
    for faults in (False, True):
        label = ("Faulty" if faults else "") + "".join(s.capitalize() for s in systems) + "Machine"
        out.append(
            machine(
                systems,
                faults=faults,
                # Non-zero priorities where the eviction-order draws are (the machine without faults), as the
                # test suite's machines have them (refcache.check.machines.machine).
                configs=configs(
                    constraints=dict(constraints), priorities=not faults, excluded=excluded_values(systems)
                ),
                coverage=ledger,
                trace_name=label + suffix,
                options=options,
            )
        )
    return out


def hicache_hunter(
    systems: Sequence[str], ledger: Coverage, name: str, seed: int | None, faults: bool
) -> type[RuleBasedStateMachine]:
    """The machine class ``name`` over ``systems`` (with storage faults when ``faults``): what the zoo hunts with."""
    return machine(systems, faults=faults, coverage=ledger, name=name, seed=seed)


CHECKS: Final = FamilyChecks(HICACHE, coverage_report, hicache_machines, hicache_hunter)
"""The HiCache family's checking side, as ``refcache.check.families.FAMILIES`` finds it."""
