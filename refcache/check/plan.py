"""A run plan: what a command resolved from its options before anything runs, as typed records.

The command line (``refcache.cli``) parses options; this module decides what they mean for the systems
named: which configuration fields the user fixed (``ConfigOverrides``), which ones the systems need fixed
(``SystemEntry.constraints``, ``allows``, ``with_storage``), which fidelity profile applies and whether every
system follows it (``SystemEntry.unfollowed_with_storage``), and the budgets (``FuzzPlan``). Nothing here
reads a system's name: every decision reads the systems' registry entries, so a new engine is one entry.

A plan that cannot run raises ``PlanError`` (a ``UsageError``) before any example runs; its ``fields`` are
the configuration fields the message names, so that the command line can call each by its option's name.
A ``FuzzPlan`` is plain data (picklable): ``refcache fuzz --jobs N`` hands it to every worker as it is.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from refcache.check.families import Checks, family_of
from refcache.config import (
    PROFILES,
    AttentionKind,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import ConfigError, RefcacheError, UsageError
from refcache.systems import SYSTEMS, SystemOptions, required_constraints

__all__ = [
    "DEFAULT_PROFILE",
    "STORAGE_FIELD",
    "ConfigOverrides",
    "FuzzPlan",
    "PlanError",
    "check_installed",
    "config_with",
    "fuzz_constraints",
    "fuzz_plan",
    "recording_fidelity",
]

STORAGE_FIELD: Final = "hicache_storage_backend"
"""The configuration field that turns L3 on (None: only L1 and L2)."""
DEFAULT_PROFILE: Final = "refcache"
"""The fidelity profile a run follows unless told otherwise: refcache's own decisions."""


class PlanError(UsageError):
    """Raised when the options given cannot make a run: a value no system runs, two systems that need
    different values, a profile a system does not follow. ``fields``: the configuration fields (and
    ``profile``) the message names, in the ``field=value`` or bare ``field`` form. Fix the options."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.fields = fields


@dataclass(frozen=True)
class ConfigOverrides:
    """The configuration fields a user fixed on the command line, under ``HiCacheConfig``'s names; None:
    not fixed (``fuzz`` draws it for each example; the other commands take their default)."""

    tp_size: int | None = None
    attention: AttentionKind | None = None
    hicache_write_policy: WritePolicy | None = None
    hicache_storage_prefetch_policy: PrefetchPolicy | None = None
    radix_eviction_policy: EvictionPolicy | None = None
    hicache_io_backend: IOBackend | None = None
    hicache_mem_layout: MemLayout | None = None
    page_size: int | None = None
    hicache_storage_backend: str | None = None  # "file"; None: not fixed (fuzz: drawn), or see below
    without_storage: bool = False  # fixed to no L3 (``--no-l3``); wins over ``hicache_storage_backend``

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every configuration field a user can fix, in declaration order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name != "without_storage")

    def chosen(self) -> dict[str, object]:
        """The configuration fields the user fixed: field -> value (``hicache_storage_backend`` None: no
        L3, fixed)."""
        out = {name: getattr(self, name) for name in self.names() if getattr(self, name) is not None}
        if self.without_storage:
            out[STORAGE_FIELD] = None
        return out


def config_with(fields: Mapping[str, object]) -> HiCacheConfig:
    """The configuration with ``fields`` set (the others at their defaults), validated as the constructor
    validates (raises ``ConfigError`` or ``UnsupportedError``), and resolved (``HiCacheConfig.resolve``)."""
    return HiCacheConfig.from_json(dict(fields)).resolve()


def fuzz_constraints(
    systems: tuple[str, ...],
    overrides: ConfigOverrides,
    profile: str = DEFAULT_PROFILE,
    known: Collection[str] = (),
) -> dict[str, object]:
    """The configuration fields every example of a ``fuzz`` run of ``systems`` has: the user's
    ``overrides``, what the systems need (their entries' ``constraints``, ``allows`` and, with L3,
    ``with_storage``, less the rows that ``known``, the ids of the run's known findings, lifts:
    ``SystemEntry.with_storage_unless_known``) and ``profile``'s fidelity options. Raises ``PlanError`` when
    they disagree or the combination cannot be configured."""
    family = family_of(systems)
    constraints = overrides.chosen()
    fixed = overrides.names()
    if not family.constrained and (constraints or profile != DEFAULT_PROFILE):
        chosen = [*constraints, *(["profile"] if profile != DEFAULT_PROFILE else [])]
        raise PlanError(f"{', '.join(chosen)} do not apply to {family.summary} systems", (*fixed, "profile"))
    against = ",".join(systems)
    try:
        needed = required_constraints(systems, constraints)  # e.g. one or two ranks for an engine adapter
    except UsageError as error:
        raise PlanError(str(error), fixed) from error
    for name, value in needed.items():
        if name in constraints and constraints[name] != value:
            if value is None:
                raise PlanError(f"--against {against} runs only without {name}", (name,))
            values = [value, *(v for s in systems for v in SYSTEMS[s].allows.get(name, ()))]
            raise PlanError(
                f"--against {against} runs only with {name}={' or '.join(str(v) for v in values)}", (name,)
            )
    constraints.update(needed)
    storage = constraints.get(STORAGE_FIELD)
    if storage is not None:  # what an engine's L3 runs only with
        for system in systems:
            for name, (value, why) in SYSTEMS[system].with_storage.items():
                if set(SYSTEMS[system].with_storage_unless_known.get(name, ())) & set(known):
                    continue  # a known finding explains what the row keeps away: the field stays free
                if name in constraints and constraints[name] != value:
                    raise PlanError(
                        f"--against {against} with {STORAGE_FIELD}={storage} runs only with {name}={value}: "
                        f"{why}",
                        (name, STORAGE_FIELD),
                    )
                constraints[name] = value
    if profile not in PROFILES:
        raise PlanError(f"--profile {profile!r} is not one of {', '.join(PROFILES)}")
    constraints.update(PROFILES[profile])
    if profile != DEFAULT_PROFILE:
        for system in systems:
            # the installed engine's release, asked without importing it; not installed, or a release no row
            # drives: check_installed and the open say so
            try:
                followed = SYSTEMS[system].followed()
            except RefcacheError:
                continue
            if followed is not None and followed != profile:
                raise PlanError(
                    f"--profile {profile} makes the model follow another release than {system}, which behaves as "
                    f"{followed} (the installed engine): a divergence would then be neither the engine's bug nor a "
                    f"decision; use --profile {followed}, or --profile {DEFAULT_PROFILE} (each divergence "
                    "explained by the decision behind it)",
                    ("profile",),
                )
    if constraints.get(STORAGE_FIELD, "file") is not None:  # L3 fixed on, or drawn
        for system in systems:
            unfollowed = SYSTEMS[system].unfollowed_with_storage
            on = [name for name in unfollowed if constraints.get(name)]
            if on:
                raise PlanError(
                    f"--profile {profile} turns on {' and '.join(on)} "
                    f"({'; '.join(unfollowed[name] for name in on)}), which {system} "
                    f"({SYSTEMS[system].summary}) does not follow with L3; with --against {against} use "
                    f"--profile {DEFAULT_PROFILE}"
                )
    try:  # reject impossible combinations before any example runs
        config_with(constraints)
    except ConfigError as error:
        raise PlanError(str(error), fixed) from error
    return constraints


def check_installed(systems: tuple[str, ...]) -> None:
    """Raise ``PlanError`` naming the first package one of ``systems`` needs (``SystemEntry.requires``) that
    is not installed here, and the command that installs it. Looks the packages up without importing
    them: a command calls this before it runs or writes anything."""
    for name in systems:
        entry = SYSTEMS[name]
        for package in entry.requires:
            try:
                found = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):  # a broken or half-installed package
                found = False
            if not found:
                raise PlanError(
                    f"{name} ({entry.summary}) needs the package {package!r}, which is not installed here; "
                    f"install it with: {entry.install}"
                )


def recording_fidelity(engine: str) -> Mapping[str, bool]:
    """The fidelity options a recording of ``engine`` runs under: the profile its entry ``follows`` (none:
    the configuration's own). Raises ``PlanError`` for an engine that is not registered, has no recorder
    (``SystemEntry.recorder``) or is not installed (``check_installed``)."""
    entry = SYSTEMS.get(engine)
    if entry is None or entry.recorder is None:
        with_one = [name for name, e in SYSTEMS.items() if e.recorder is not None]
        raise PlanError(f"--engine {engine!r} has no recorder; engines with one: {', '.join(with_one)}")
    check_installed((engine,))
    followed = entry.followed()
    return PROFILES[followed] if followed is not None else {}


@dataclass(frozen=True)
class FuzzPlan:
    """Everything a ``fuzz`` run needs once its options are resolved; plain data, the same in every worker
    of ``--jobs N``."""

    family: str  # ``Family.name`` of the systems (``family_of``)
    systems: tuple[str, ...]  # registry names, the first is the reference
    constraints: Mapping[str, object]  # configuration fields every example has (``fuzz_constraints``)
    steps: int  # rule steps per example, at most
    examples: int | None  # examples in all, every machine and worker together; None: no such limit
    seconds: float | None  # wall-clock budget; None: no such limit
    database: Path  # Hypothesis' example database, shared by the workers
    seed: int  # the run's seed (``run_machines``): the same seed and options draw the same examples
    chunk: int = 10  # examples a machine runs before the next takes over
    jobs: int = 1  # worker processes
    shrink_seconds: float = 60.0  # shrinking a failing trace, at most (0: keep it whole)
    options: SystemOptions = field(default_factory=dict)  # per-system keyword options (``--oracle``)

    @property
    def family_entry(self) -> Checks:
        """The family the systems speak."""
        return family_of(self.systems)


def fuzz_plan(
    systems: tuple[str, ...],
    overrides: ConfigOverrides,
    *,
    profile: str = DEFAULT_PROFILE,
    steps: int,
    examples: int | None,
    seconds: float | None,
    database: Path,
    seed: int,
    chunk: int = 10,
    jobs: int = 1,
    shrink_seconds: float = 60.0,
    options: SystemOptions | None = None,
    known: Collection[str] = (),
) -> FuzzPlan:
    """The plan of a ``fuzz`` run (``fuzz_constraints`` for the configuration; ``known``: the ids of the run's
    known findings). Raises ``PlanError``."""
    if examples is None and seconds is None:
        raise PlanError("--minutes 0 and --examples 0 set no limit: give one of them")
    return FuzzPlan(
        family=family_of(systems).name,
        systems=systems,
        constraints=fuzz_constraints(systems, overrides, profile, known),
        steps=steps,
        examples=examples,
        seconds=seconds,
        database=database,
        seed=seed,
        chunk=chunk,
        jobs=jobs,
        shrink_seconds=shrink_seconds,
        options={name: dict(given) for name, given in (options or {}).items()},
    )
