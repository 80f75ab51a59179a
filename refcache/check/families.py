"""What each engine family brings to the commands, in one table: its machines, its trace reader, its
invariant family, its status line and its coverage report.

``refcache fuzz|replay|shrink`` look the family up by the systems' ``SystemEntry.family``
(``family_of``), or by a trace's header (``trace_family``), and use only what the table gives, so a new
family is one entry here. A trace of one family given with systems of another is a ``UsageError``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from hypothesis.stateful import RuleBasedStateMachine

from refcache.check.configs import configs
from refcache.check.coverage import Coverage, coverage_report
from refcache.check.harness import HICACHE, InvariantFamily, status_line
from refcache.check.machines import machine
from refcache.check.vllm_machines import VLLM, vllm_machine
from refcache.check.vllm_machines import status_line as vllm_status_line
from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.systems import SYSTEMS, SystemOptions
from refcache.trace import read_trace
from refcache.vllm import trace as vllm_trace

__all__ = ["FAMILIES", "Family", "check_trace_family", "family_of", "trace_family"]

MachineFactory = Callable[
    [Sequence[str], Mapping[str, object], Coverage, str, SystemOptions], list[type[RuleBasedStateMachine]]
]
"""(systems, configuration constraints, ledger, trace name suffix, system options) -> the machines a fuzz
run takes turns with."""


@dataclass(frozen=True)
class Family:
    name: str
    summary: str  # for error messages: "HiCache (refcache.ops)"
    machines: MachineFactory
    read_trace: Callable[[Path], tuple[HiCacheConfig, Sequence[Any]]]
    is_trace: Callable[[str], bool]  # whether a trace's first line is this family's header
    invariants: InvariantFamily
    status_line: Callable[[Any], str]
    report: Callable[[Coverage], str]
    constrained: bool = True  # whether the HiCache configuration options (--page-size, ...) apply


def _hicache_machines(
    systems: Sequence[str],
    constraints: Mapping[str, object],
    ledger: Coverage,
    suffix: str,
    options: SystemOptions,
) -> list[type[RuleBasedStateMachine]]:
    strategy = configs(constraints=dict(constraints))
    out: list[type[RuleBasedStateMachine]] = []
    for faults in (False, True):
        label = ("Faulty" if faults else "") + "".join(s.capitalize() for s in systems) + "Machine"
        out.append(
            machine(
                systems,
                faults=faults,
                configs=strategy,
                coverage=ledger,
                trace_name=label + suffix,
                options=options,
            )
        )
    return out


def _vllm_machines(
    systems: Sequence[str],
    constraints: Mapping[str, object],
    ledger: Coverage,
    suffix: str,
    options: SystemOptions,  # vLLM's systems take none
) -> list[type[RuleBasedStateMachine]]:
    label = "".join(s.replace("-", " ").title().replace(" ", "") for s in systems) + "Machine"
    return [vllm_machine(systems, coverage=ledger, trace_name=label + suffix)]


def _vllm_report(cov: Coverage) -> str:
    lines = [f"{cov.runs:,} examples, {cov.steps:,} steps", "outcomes:"]
    lines += [f"  {k:<40} {v}" for k, v in sorted(cov.outcomes.items())]
    return "\n".join(lines)


FAMILIES: Final[Mapping[str, Family]] = {
    "hicache": Family(
        "hicache",
        "HiCache (refcache.ops)",
        _hicache_machines,
        read_trace,
        lambda first: not vllm_trace.is_vllm_trace(first),
        HICACHE,
        status_line,
        coverage_report,
    ),
    "vllm": Family(
        "vllm",
        "vLLM (refcache.vllm.ops)",
        _vllm_machines,
        vllm_trace.read_trace,
        vllm_trace.is_vllm_trace,
        VLLM,
        vllm_status_line,
        _vllm_report,
        constrained=False,
    ),
}
"""Every engine family by name (``SystemEntry.family``)."""


def family_of(systems: Sequence[str]) -> Family:
    """The family systems ``systems`` speak (``parse_against`` already refused a mix)."""
    names = {SYSTEMS[name].family for name in systems}
    if len(names) != 1:
        raise UsageError(f"systems {', '.join(systems)} speak {len(names)} families; name one family's")
    return FAMILIES[names.pop()]


def trace_family(path: str | os.PathLike[str]) -> Family:
    """The family whose header starts the trace at ``path`` (HiCache's unless the header says otherwise)."""
    with open(path, encoding="utf-8") as file:
        first = file.readline()
    for family in FAMILIES.values():
        if family.name != "hicache" and family.is_trace(first):
            return family
    return FAMILIES["hicache"]


def check_trace_family(path: str | os.PathLike[str], systems: Sequence[str]) -> Family:
    """The family of both the trace and the systems; ``UsageError`` when they differ."""
    of_trace, of_systems = trace_family(path), family_of(systems)
    if of_trace is not of_systems:
        raise UsageError(
            f"{path} is a {of_trace.summary} trace but {', '.join(systems)} speak {of_systems.summary}; "
            f"replay it against systems of its family "
            f"({', '.join(n for n, e in SYSTEMS.items() if e.family == of_trace.name)})"
        )
    return of_systems
