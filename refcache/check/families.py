"""What the checking side adds to each engine family, in one registry: its machines, its coverage report, and
replay and shrink typed over the family's own operations, observations and snapshots.

A family's vocabulary is its package (``refcache.hicache``, ``refcache.vllm``: one ``FAMILY`` object,
``refcache.family.Family[Op, Obs, Snap]``). ``FamilyChecks[Op, Obs, Snap]`` pairs it with what its random
machine draws (``rules``: ``refcache.check.machine.Rules``, the data and draw functions of
``refcache.check.vllm_machines`` and ``refcache.check.lmcache_machines``; the one generic
``family_machine`` runs them) and the report of its coverage ledger, and does what the commands need —
replay a trace, shrink one — generically, so that no command handles a family's operations or snapshots
itself. HiCache's machines keep their own factory (``refcache.check.machines.machine``: two machines, with
and without faults, and a label scheme of their own that fixes their derandomized samples), given as
``make_machines`` and ``make_hunter`` instead of ``rules``. The commands see a family only
through ``Checks``, whose methods name none of its types: the registry holds families of different types
without ``Any`` or a cast.

``refcache fuzz|replay|shrink`` look the family up by the systems' ``SystemEntry.family`` (``family_of``),
or by a trace's header (``trace_family``). A trace of one family given with systems of another is a
``UsageError``. A new family is one entry in ``FAMILIES``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Generic, Protocol, TypeVar

from hypothesis.stateful import RuleBasedStateMachine

from refcache.check.configs import configs
from refcache.check.coverage import Coverage, coverage_report, vllm_coverage_report
from refcache.check.harness import Harness
from refcache.check.lmcache_machines import RULES as LMCACHE_RULES
from refcache.check.machine import Rules, family_machine, machine_label
from refcache.check.machines import machine
from refcache.check.shrink import Failure, shrink_trace, systems_named
from refcache.check.vllm_machines import RULES as VLLM_RULES
from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.family import Family
from refcache.hicache import FAMILY as HICACHE
from refcache.lmcache.family import FAMILY as LMCACHE
from refcache.systems import SYSTEMS, SystemOptions, granularity, open_systems
from refcache.vllm.family import FAMILY as VLLM

__all__ = [
    "FAMILIES",
    "Checks",
    "FamilyChecks",
    "ShrinkSummary",
    "check_trace_family",
    "family_of",
    "trace_family",
]

O = TypeVar("O")  # noqa: E741 - the family's operation, observation and snapshot types
B = TypeVar("B")
S = TypeVar("S")

MachineFactory = Callable[
    [Sequence[str], Mapping[str, object], Coverage, str, SystemOptions], list[type[RuleBasedStateMachine]]
]
"""(systems, configuration constraints, ledger, trace name suffix, system options) -> the machines a fuzz
run takes turns with."""

HunterFactory = Callable[[Sequence[str], Coverage, str, int | None, bool], type[RuleBasedStateMachine]]
"""(systems, ledger, class name, seed, faults) -> one machine: the one CI runs under that class name (the
name fixes the derandomized sample), or another sample of it under ``seed``."""

StepView = Callable[[int, object, object, str], None]
"""Called after each replayed step with its 1-based index, the operation, its outcome and the reference
system's status line (``Family.status_line``)."""


@dataclass(frozen=True)
class ShrinkSummary:
    """What ``Checks.shrink`` did: the failure the shrunk trace still shows, and how far it got."""

    failure: Failure
    original_length: int
    length: int
    replays: int
    seconds: float
    complete: bool  # 1-minimal; False: the time budget ran out first
    written: Path


class Checks(Protocol):
    """A family as the commands use it: nothing here names the family's operation, observation or snapshot
    types (``FamilyChecks`` is generic over them)."""

    @property
    def name(self) -> str: ...
    @property
    def summary(self) -> str: ...
    @property
    def constrained(self) -> bool: ...
    def machines(
        self,
        systems: Sequence[str],
        constraints: Mapping[str, object],
        ledger: Coverage,
        suffix: str,
        options: SystemOptions,
    ) -> list[type[RuleBasedStateMachine]]: ...
    def hunter(
        self,
        systems: Sequence[str],
        ledger: Coverage,
        name: str,
        seed: int | None = None,
        *,
        faults: bool = False,
    ) -> type[RuleBasedStateMachine]: ...
    def report(self, ledger: Coverage) -> str: ...
    def is_trace(self, first: str) -> bool: ...
    def read_config(self, path: str | os.PathLike[str]) -> tuple[HiCacheConfig, int]: ...
    def replay(
        self,
        path: str | os.PathLike[str],
        systems: Sequence[str],
        options: SystemOptions | None = None,
        on_step: StepView | None = None,
    ) -> int: ...
    def shrink(
        self,
        path: str | os.PathLike[str],
        out: Path,
        systems: Sequence[str],
        options: SystemOptions | None = None,
        *,
        seconds: float = 60.0,
        on_progress: Callable[[int, int], None] | None = None,
        keep: Callable[[Failure], bool] | None = None,
    ) -> ShrinkSummary: ...


@dataclass(frozen=True)
class FamilyChecks(Generic[O, B, S]):
    """One family's checking side (see the module docstring)."""

    family: Family[O, B, S]
    make_report: Callable[[Coverage], str]
    rules: Rules[O, B, S] | None = None  # what ``family_machine`` draws; None: the factories below
    make_machines: MachineFactory | None = None  # a family's own machines (HiCache's), when ``rules`` is None
    make_hunter: HunterFactory | None = None
    constrained: bool = True  # whether the HiCache configuration options (--page-size, ...) apply

    def __post_init__(self) -> None:
        if (self.rules is None) == (self.make_machines is None or self.make_hunter is None):
            raise UsageError(
                f"the {self.family.name} family's checks need either rules or both make_machines and "
                "make_hunter, not both and not neither"
            )

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def summary(self) -> str:
        return self.family.summary

    def machines(
        self,
        systems: Sequence[str],
        constraints: Mapping[str, object],
        ledger: Coverage,
        suffix: str,
        options: SystemOptions,
    ) -> list[type[RuleBasedStateMachine]]:
        """The machines a fuzz run over ``systems`` takes turns with, filling ``ledger``: the family's own, or
        one ``family_machine`` over its rules (configurations drawn: ``constraints`` and ``options`` do not
        apply) whose trace is named by ``machine_label`` and ``suffix``."""
        if self.make_machines is not None:
            return self.make_machines(systems, constraints, ledger, suffix, options)
        assert self.rules is not None
        label = machine_label(systems) + suffix
        return [family_machine(self.family, self.rules, systems, coverage=ledger, trace_name=label)]

    def hunter(
        self,
        systems: Sequence[str],
        ledger: Coverage,
        name: str,
        seed: int | None = None,
        *,
        faults: bool = False,
    ) -> type[RuleBasedStateMachine]:
        """The machine class ``name`` over ``systems`` (its default configurations), filling ``ledger``: what
        the bug zoos hunt with, CI's sample of it, or ``seed``'s; ``faults`` adds storage faults where the
        family has them (a family with ``rules`` draws its faults, if any, in every machine)."""
        if self.make_hunter is not None:
            return self.make_hunter(systems, ledger, name, seed, faults)
        assert self.rules is not None
        return family_machine(self.family, self.rules, systems, coverage=ledger, name=name, seed=seed)

    def report(self, ledger: Coverage) -> str:
        return self.make_report(ledger)

    def is_trace(self, first: str) -> bool:
        return self.family.is_trace(first)

    def read_config(self, path: str | os.PathLike[str]) -> tuple[HiCacheConfig, int]:
        """The configuration of the trace at ``path`` and how many operations it holds."""
        config, ops = self.family.read_trace(path)
        return config, len(ops)

    def replay(
        self,
        path: str | os.PathLike[str],
        systems: Sequence[str],
        options: SystemOptions | None = None,
        on_step: StepView | None = None,
    ) -> int:
        """Re-execute the trace at ``path`` on fresh ``systems`` through the harness (nothing written: the
        trace is the input); the number of steps. Raises ``Divergence`` at the first divergence,
        ``TraceFormatError`` for a malformed trace, ``UsageError`` for unknown systems."""
        config, ops = self.family.read_trace(path)
        status = self.family.status_line

        def show(index: int, op: O, outcome: object, snap: S) -> None:
            if on_step is not None:
                on_step(index, op, outcome, status(snap))

        with open_systems(systems, config, options, family=self.family) as opened:
            harness = Harness(
                config,
                opened,
                family=self.family,
                on_step=show,
                write_trace=False,
                compare=granularity(systems, self.family),
            )
            for op in ops:
                harness.step(op)
        return len(ops)

    def shrink(
        self,
        path: str | os.PathLike[str],
        out: Path,
        systems: Sequence[str],
        options: SystemOptions | None = None,
        *,
        seconds: float = 60.0,
        on_progress: Callable[[int, int], None] | None = None,
        keep: Callable[[Failure], bool] | None = None,
    ) -> ShrinkSummary:
        """Shrink the failing trace at ``path`` on ``systems`` (``refcache.check.shrink``) for about
        ``seconds`` and write the result to ``out``; ``keep``: which failures a shrunk candidate may end in
        (e.g. none a known finding explains). Raises ``UsageError`` when it does not fail."""
        config, ops = self.family.read_trace(path)
        result = shrink_trace(
            config,
            ops,
            systems_named(systems, options, family=self.family),
            family=self.family,
            seconds=seconds,
            on_progress=on_progress,
            keep=keep,
        )
        out.write_text(self.family.dumps_trace(config, result.ops))
        return ShrinkSummary(
            result.failure,
            result.original_length,
            len(result.ops),
            result.replays,
            result.seconds,
            result.complete,
            out,
        )


def _hicache_machines(
    systems: Sequence[str],
    constraints: Mapping[str, object],
    ledger: Coverage,
    suffix: str,
    options: SystemOptions,
) -> list[type[RuleBasedStateMachine]]:
    out: list[type[RuleBasedStateMachine]] = []
    for faults in (False, True):
        label = ("Faulty" if faults else "") + "".join(s.capitalize() for s in systems) + "Machine"
        out.append(
            machine(
                systems,
                faults=faults,
                # Non-zero priorities where the eviction-order draws are (the machine without faults), as the
                # test suite's machines have them (refcache.check.machines.machine).
                configs=configs(constraints=dict(constraints), priorities=not faults),
                coverage=ledger,
                trace_name=label + suffix,
                options=options,
            )
        )
    return out


def _hicache_hunter(
    systems: Sequence[str], ledger: Coverage, name: str, seed: int | None, faults: bool
) -> type[RuleBasedStateMachine]:
    return machine(systems, faults=faults, coverage=ledger, name=name, seed=seed)


def _outcomes_report(cov: Coverage) -> str:
    """Examples, steps and the outcomes counted (a family whose ledger has no situations yet)."""
    lines = [f"{cov.runs:,} examples, {cov.steps:,} steps", "outcomes:"]
    lines += [f"  {k:<40} {v}" for k, v in sorted(cov.outcomes.items())]
    return "\n".join(lines)


FAMILIES: Final[Mapping[str, Checks]] = {
    "hicache": FamilyChecks(
        HICACHE, coverage_report, make_machines=_hicache_machines, make_hunter=_hicache_hunter
    ),
    "vllm": FamilyChecks(VLLM, vllm_coverage_report, VLLM_RULES, constrained=False),
    "lmcache": FamilyChecks(LMCACHE, _outcomes_report, LMCACHE_RULES, constrained=False),
}
"""Every engine family by name (``SystemEntry.family``)."""


def family_of(systems: Sequence[str]) -> Checks:
    """The family systems ``systems`` speak (``parse_against`` already refused a mix)."""
    names = {SYSTEMS[name].family for name in systems}
    if len(names) != 1:
        raise UsageError(f"systems {', '.join(systems)} speak {len(names)} families; name one family's")
    name = names.pop()
    if name not in FAMILIES:
        raise UsageError(
            f"systems {', '.join(systems)} speak the {name!r} family, which refcache does not know"
        )
    return FAMILIES[name]


def trace_family(path: str | os.PathLike[str]) -> Checks:
    """The family whose header starts the trace at ``path`` (HiCache's unless a header says otherwise)."""
    with open(path, encoding="utf-8") as file:
        first = file.readline()
    for family in FAMILIES.values():
        if family.name != "hicache" and family.is_trace(first):
            return family
    return FAMILIES["hicache"]


def check_trace_family(path: str | os.PathLike[str], systems: Sequence[str]) -> Checks:
    """The family of both the trace and the systems; ``UsageError`` when they differ."""
    of_trace, of_systems = trace_family(path), family_of(systems)
    if of_trace is not of_systems:
        raise UsageError(
            f"{path} is a {of_trace.summary} trace but {', '.join(systems)} speak {of_systems.summary}; "
            f"replay it against systems of its family "
            f"({', '.join(n for n, e in SYSTEMS.items() if e.family == of_trace.name)})"
        )
    return of_systems
