"""What the checking side adds to each engine family, and the registry that finds it: its machines, its coverage
report, and replay and shrink typed over the family's own operations, observations and snapshots.

A family's vocabulary is its package (one ``FAMILY`` object, ``refcache.family.Family[Op, Obs, Snap]``).
``FamilyChecks[Op, Obs, Snap]`` pairs it with the machines a fuzz run takes turns with and the machine the bug
zoos hunt with (two factories, ``make_machines`` and ``make_hunter``: a family whose machine is the generic
``family_machine`` over its ``Rules`` gets both from ``FamilyChecks.from_rules``, HiCache passes its own) and
the report of its coverage ledger, and does what the commands need — replay a trace, shrink one —
generically, so that no command handles a family's operations or snapshots itself. The commands see a family only through ``Checks``, whose methods name none of its types: the
registry holds families of different types without ``Any`` or a cast.

Each family's ``FamilyChecks`` lives above this package, with its rules (``refcache.rules``: one module per
family), and is found by name: ``FAMILIES`` maps refcache's own families to "module:attribute" strings
imported on first use (as ``refcache.systems.SystemEntry.target`` is), and a package outside refcache
registers its family through the entry-point group ``refcache.families`` (``ENTRY_POINT_GROUP``):

    [project.entry-points."refcache.families"]
    toy = "toy_cache.refcache_rules:CHECKS"

so nothing here imports a family's rules or names its types (import-linter holds ``refcache.check`` to that).
``family_checks`` resolves a name; ``refcache fuzz|replay|shrink`` look the family up by the systems'
``SystemEntry.family`` (``family_of``), or by a trace's header (``trace_family``). A trace of one family given
with systems of another is a ``UsageError``. A new family is one module of rules and one registry line.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final, Generic, Protocol, TypeVar

from hypothesis.stateful import RuleBasedStateMachine

from refcache.check.coverage import Coverage
from refcache.check.harness import Harness
from refcache.check.machine import Rules, family_machine, machine_label
from refcache.check.shrink import Failure, shrink_trace, systems_named
from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.family import Family
from refcache.hicache.trace import open_trace
from refcache.systems import SYSTEMS, SystemOptions, granularity, open_systems

__all__ = [
    "ENTRY_POINT_GROUP",
    "FAMILIES",
    "UNTAGGED",
    "Checks",
    "FamilyChecks",
    "ShrinkSummary",
    "check_trace_family",
    "family_checks",
    "family_names",
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
    make_report: Callable[[Coverage], str]  # the ledger's report
    make_machines: MachineFactory  # the machines a fuzz run takes turns with
    make_hunter: HunterFactory  # the machine the bug zoos hunt with (and CI's sample of it)
    constrained: bool = True  # whether the HiCache configuration options (--page-size, ...) apply

    @classmethod
    def from_rules(
        cls, family: Family[O, B, S], rules: Rules[O, B, S], report: Callable[[Coverage], str]
    ) -> FamilyChecks[O, B, S]:
        """The checks of a family whose random machine is ``family_machine`` over ``rules``: a fuzz run takes
        turns with that one machine, named by ``machine_label`` (its trace by the label and the suffix); the
        zoo hunts with it under the name it gives (a family with rules draws its faults, if any, in every
        machine). Its configurations are drawn by ``rules.configs``: the HiCache configuration options, the
        ``constraints`` and the system ``options`` do not apply (``constrained`` False)."""

        def machines(
            systems: Sequence[str],
            constraints: Mapping[str, object],
            ledger: Coverage,
            suffix: str,
            options: SystemOptions,
        ) -> list[type[RuleBasedStateMachine]]:
            label = machine_label(systems) + suffix
            return [family_machine(family, rules, systems, coverage=ledger, trace_name=label)]

        def hunter(
            systems: Sequence[str], ledger: Coverage, name: str, seed: int | None, faults: bool
        ) -> type[RuleBasedStateMachine]:
            return family_machine(family, rules, systems, coverage=ledger, name=name, seed=seed)

        return cls(family, report, machines, hunter, constrained=False)

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
        """The machines a fuzz run over ``systems`` takes turns with, drawing configurations under
        ``constraints`` where the family is ``constrained``, filling ``ledger``; ``suffix`` ends their traces'
        names (a worker's index)."""
        return self.make_machines(systems, constraints, ledger, suffix, options)

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
        family has a machine with them and one without."""
        return self.make_hunter(systems, ledger, name, seed, faults)

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


FAMILIES: Final[Mapping[str, str]] = {
    "hicache": "refcache.rules.hicache:CHECKS",
    "vllm": "refcache.rules.vllm:CHECKS",
    "lmcache": "refcache.rules.lmcache:CHECKS",
}
"""refcache's own families by name (``SystemEntry.family``) -> where each one's ``FamilyChecks`` is
("module:attribute", imported by ``family_checks`` on first use)."""

ENTRY_POINT_GROUP: Final = "refcache.families"
"""The entry-point group through which another package registers a family (each names a ``FamilyChecks``)."""

UNTAGGED: Final = "hicache"
"""The family whose traces carry no ``family`` key in their header (HiCache's format predates the key): a trace
whose header no family claims is read as this family's, whose reader then says what is wrong with it."""


@functools.cache
def _plugins() -> Mapping[str, tuple[str, str]]:
    """Every plugin family (``ENTRY_POINT_GROUP``): name -> (its target, where it was registered); looked up
    once. A name that is taken is a ``UsageError`` naming the distribution."""
    found: dict[str, tuple[str, str]] = {}
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} = {point.value!r}" + (
            f" of {point.dist.name}" if point.dist is not None else ""
        )
        if point.name in FAMILIES or point.name in found:
            raise UsageError(f"{where}: a family named {point.name!r} exists already; rename the plugin's")
        found[point.name] = (point.value, where)
    return found


def family_names() -> tuple[str, ...]:
    """Every family refcache has checks for: its own (``FAMILIES``), then the plugins' (``ENTRY_POINT_GROUP``)."""
    return (*FAMILIES, *_plugins())


_LOADED: dict[tuple[str, str], Checks] = {}  # (name, target) -> its checks, once imported


def family_checks(name: str) -> Checks:
    """The checking side of family ``name``, imported on first use. Raises ``UsageError`` naming the known
    families when there is no family ``name``, and naming the registry entry when its target cannot be
    imported, lacks its attribute, or is not a ``FamilyChecks`` of family ``name``."""
    if name in FAMILIES:
        target, where = FAMILIES[name], f"refcache.check.families.FAMILIES[{name!r}] = {FAMILIES[name]!r}"
    elif name in _plugins():
        target, where = _plugins()[name]
    else:
        raise UsageError(f"refcache has no checks for the {name!r} family: {', '.join(family_names())}")
    loaded = _LOADED.get((name, target))
    if loaded is not None:
        return loaded
    module_name, _, attribute = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"the {name!r} family's checks ({where}) cannot be imported: {error}") from error
    checks: object = getattr(module, attribute.strip(), None)
    if not isinstance(checks, FamilyChecks):
        what = f"has no {attribute!r}" if checks is None else f"names a {type(checks).__name__}"
        raise UsageError(
            f"the {name!r} family's checks ({where}): {module_name} {what}, not a "
            "refcache.check.families.FamilyChecks"
        )
    if checks.name != name:
        raise UsageError(
            f"the {name!r} family's checks ({where}) are the {checks.name!r} family's; register them under "
            f"{checks.name!r}"
        )
    _LOADED[(name, target)] = checks
    return checks


def family_of(systems: Sequence[str]) -> Checks:
    """The family systems ``systems`` speak (``parse_against`` already refused a mix)."""
    names = {SYSTEMS[name].family for name in systems}
    if len(names) != 1:
        raise UsageError(f"systems {', '.join(systems)} speak {len(names)} families; name one family's")
    name = names.pop()
    if name not in family_names():
        raise UsageError(
            f"systems {', '.join(systems)} speak the {name!r} family, which refcache does not know "
            f"({', '.join(family_names())})"
        )
    return family_checks(name)


def trace_family(path: str | os.PathLike[str]) -> Checks:
    """The family whose header starts the trace at ``path`` (``UNTAGGED``'s when no family claims it)."""
    with open_trace(path) as file:
        first = file.readline()
    for name in family_names():
        checks = family_checks(name)
        if checks.is_trace(first):
            return checks
    return family_checks(UNTAGGED)


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
