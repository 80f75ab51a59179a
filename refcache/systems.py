"""The systems refcache drives, by name: one protocol and one registry.

A *system* is anything that takes one engine family's operation alphabet and reports its snapshots
(``refcache.family``): the reference model, the implementation, another engine through its adapter. Every
command (``fuzz``, ``replay``, ``shrink``, ``simulate``), the differential machines, the shrinker and the
conformance kit open systems only through ``open_systems``, so adding one — an engine adapter — is one
entry in the registry, ``SYSTEMS``:

    "sglang": SystemEntry("SGLang's own HiRadixCache", "refcache.engines.sglang:SGLangSystem",
                          install="pip install 'refcache[sglang]'"),

A package outside refcache registers its adapter without touching refcache, through the entry-point group
``refcache.systems`` (each entry point names a ``SystemEntry``):

    [project.entry-points."refcache.systems"]
    toy = "toy_engine.refcache_entry:ENTRY"

Built-in entries are imported only when a system of that name is opened (``import refcache`` imports no
engine, and the model's commands never import torch); a plugin's entry module is imported the first time
the registry is asked for a name it does not hold, or listed.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from importlib import metadata
from types import TracebackType
from typing import Final, Protocol, Self, TypeVar, overload, runtime_checkable

from refcache.config import HiCacheConfig, WritePolicy
from refcache.errors import RefcacheError, UsageError
from refcache.family import EXACT, Family
from refcache.hicache.family import FAMILY as HICACHE
from refcache.hicache.ops import FaultKind, Observation, Op
from refcache.hicache.snapshot import Snapshot
from refcache.sglang_releases import releases_of as sglang_releases_of

__all__ = [
    "BUILT_IN_SYSTEMS",
    "ENTRY_POINT_GROUP",
    "SYSTEMS",
    "HiCacheSystem",
    "HostDefaults",
    "OpenSystems",
    "System",
    "SystemEntry",
    "SystemFactory",
    "SystemOptions",
    "answered",
    "engine_placements",
    "engine_releases",
    "excluded_values",
    "fault_kinds",
    "granularity",
    "open_systems",
    "parse_against",
    "registered",
    "required_constraints",
    "system_options",
]


OpT = TypeVar("OpT", contravariant=True)
ObsT = TypeVar("ObsT", covariant=True)
SnapT = TypeVar("SnapT", covariant=True)
O = TypeVar("O")  # noqa: E741 - the family's three types, invariant, in the generic functions below
B = TypeVar("B")
S = TypeVar("S")


@runtime_checkable
class System(Protocol[OpT, ObsT, SnapT]):
    """What the harness drives: a system of one family, ``System[Op, Obs, Snap]``. ``apply`` raises a
    ``RefcacheError`` subclass (state unchanged) for an operation it refuses; ``close`` releases what the
    system holds (threads, temporary L3 directories) and may be called more than once."""

    def apply(self, op: OpT) -> ObsT: ...
    def snapshot(self) -> SnapT: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


HiCacheSystem = System[Op, Observation, Snapshot]
"""A system of the HiCache family (the model, the implementation, SGLang)."""

SystemFactory = Callable[..., System[O, B, S]]
"""Builds a fresh system for a configuration (a class whose constructor takes the config is one), given
also the keyword options its entry lists (``SystemEntry.options``)."""

SystemOptions = Mapping[str, Mapping[str, object]]
"""Keyword options per system name, which ``open_systems`` passes to that system's factory
(``{"impl": {"oracle": "sampled"}}``; ``system_options`` builds it from command-line options)."""

HostDefaults = Callable[[], Mapping[str, tuple[str, str]]]
"""Configuration choices a system needs on this machine unless the user made them (``SystemEntry.defaults``):
field -> (value, why). The implementation without CUDA: the direct I/O backend."""


@dataclass(frozen=True)
class SystemEntry:
    """One registered system.

    ``target`` is ``"module:attribute"``, a ``SystemFactory`` imported on first use. ``install`` is what
    to run when that import fails (it goes into the error message).
    """

    summary: str  # one line for --help and error messages
    # "module:attribute" of the factory, imported on first use; or the factory itself (an entry made in
    # process: ``refcache.conformance.check_system``, a test's ``registered``)
    target: str | Callable[..., object]
    install: str = "pip install refcache"
    defaults: str | None = None  # "module:attribute" of a HostDefaults function (see ``host_defaults``)
    # The PROFILES entry an engine always behaves as, or "module:function" naming what returns it (the
    # installed release's, ``refcache.engines.sglang.versions.installed_profile``); None: it reads the config.
    # Read it with ``followed()``.
    follows: str | None = None
    # Configuration fields the system can run only with one value (e.g. one rank); machines draw only those.
    constraints: Mapping[str, object] = field(default_factory=dict)
    # Other values of a constrained field that it also runs when the user chooses them (``--tp-size 2``).
    allows: Mapping[str, tuple[object, ...]] = field(default_factory=dict)
    max_pending_loads: int | None = None  # load backs its scheduler keeps unfinished at most; None: no limit
    # Whether that limit counts the load backs not yet reaped by ``loading_check`` (finished or not:
    # ``len(ack_load_queue)``) rather than the unfinished ones: a bool, or "module:function" naming what answers
    # for the installed release (``refcache.engines.sglang._compat.installed_unified_counts_unreaped_loads``).
    # Read it with ``counts_unreaped()``; the machines reap (``CheckHicacheEvents``) at the limit where it does.
    counts_unreaped_loads: bool | str = False
    family: str = "hicache"  # the operations and snapshots it speaks: "hicache" (refcache.hicache.ops), "vllm", "lmcache"
    options: tuple[str, ...] = ()  # keyword options its factory takes (``system_options``, ``open_systems``)
    # The ``StorageFault`` kinds it injects (None: every kind); the fault-injecting machines draw only these.
    fault_kinds: frozenset[FaultKind] | None = None
    # With L3 on (``hicache_storage_backend`` set): field -> (the one value it runs with, why in one line).
    with_storage: Mapping[str, tuple[object, str]] = field(default_factory=dict)
    # Rows of ``with_storage`` that a known engine bug is the whole reason for: field -> the ids of the known
    # findings (``refcache.check.known``) that explain what the row keeps away. A run given a ``--known`` list
    # naming one of them leaves the field free (drawn or chosen): a divergence the list explains is recorded and
    # the run goes on, any other still fails (``refcache.check.plan.fuzz_constraints``).
    with_storage_unless_known: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The operations it answers, by class name (None: the family's whole alphabet); the machines draw only
    # rules whose operations every compared system answers (``refcache.check.machines``).
    answers: frozenset[str] | None = None
    # How its snapshots are compared with the others': ``refcache.family.EXACT`` or one of its family's
    # ``granularities`` (e.g. "no-slots": an allocator that hands out other slots). Invariants always read
    # the whole snapshot.
    compare: str = EXACT
    # The engine distribution it drives and the releases it drives ("sglang", ("0.5.20",)); None: none.
    engine: tuple[str, tuple[str, ...]] | None = None
    # Fidelity options (``FIDELITY_OPTIONS`` values) it does not follow once L3 is on (or may be drawn):
    # option -> why, in a phrase. A profile that turns one on is refused for a run with this system.
    unfollowed_with_storage: Mapping[str, str] = field(default_factory=dict)
    # Top-level packages it needs installed (``import NAME``), checked before a command runs anything
    # (``refcache.check.plan.check_installed``): the missing one is named with ``install``.
    requires: tuple[str, ...] = ()
    # "module:function" of its recorder (``refcache record --engine``; ``refcache.sim.record.Recorder``);
    # None: it has none.
    recorder: str | None = None
    # Configuration values it cannot run on the installed engine (a release without that option): field ->
    # the values, or "module:function" naming what returns that mapping for the installed release
    # (``refcache.engines.sglang._compat.installed_excluded_values``). Read it with ``excluded()``; the
    # machines draw none of them (``excluded_values``).
    excludes: Mapping[str, tuple[object, ...]] | str = field(default_factory=dict)
    # "module:function" naming what places the installed engine among the releases of ``engine``: it returns
    # (the release its rows and known findings are read at, the installed engine in words: "" for a release as
    # published), e.g. ("0.5.23", "SGLang main (0.5.24.dev3+gabc123), driven with 0.5.23's rows"); None: the
    # installed version as it is.
    # Read it with ``placed()``.
    placement: str | None = None

    def placed(self) -> tuple[str, str] | None:
        """(release, words) of the installed engine (``placement``, resolved); None when the entry has no
        placement. Raises ``UsageError`` when that function answers no pair, finds no engine installed, or
        one it cannot place (``UnsupportedError``)."""
        if self.placement is None:
            return None
        module, _, attribute = self.placement.partition(":")
        answer = getattr(importlib.import_module(module), attribute)()
        if not (isinstance(answer, tuple) and len(answer) == 2 and all(isinstance(a, str) for a in answer)):
            raise UsageError(f"{self.placement} returned {answer!r}, not (release, words)")
        return answer[0], answer[1]

    def followed(self) -> str | None:
        """The PROFILES entry the system behaves as (``follows``, resolved when it names a function). Raises
        ``UsageError`` when that function finds no engine to ask (not installed) or an unsupported one."""
        if self.follows is None or ":" not in self.follows:
            return self.follows
        module, _, attribute = self.follows.partition(":")
        profile = getattr(importlib.import_module(module), attribute)()
        if not isinstance(profile, str):
            raise UsageError(f"{self.follows} returned {profile!r}, not a profile name")
        return profile

    def counts_unreaped(self) -> bool:
        """Whether the system's load limit counts unreaped load backs (``counts_unreaped_loads``, resolved when it
        names a function). Raises ``UsageError`` when that function answers no bool, or finds no engine to ask."""
        if isinstance(self.counts_unreaped_loads, bool):
            return self.counts_unreaped_loads
        module, _, attribute = self.counts_unreaped_loads.partition(":")
        answer = getattr(importlib.import_module(module), attribute)()
        if not isinstance(answer, bool):
            raise UsageError(f"{self.counts_unreaped_loads} returned {answer!r}, not a bool")
        return answer

    def excluded(self) -> Mapping[str, tuple[object, ...]]:
        """The configuration values the system cannot run (``excludes``, resolved when it names a function).
        Raises ``UsageError`` when that function answers no mapping, or finds no engine to ask."""
        if not isinstance(self.excludes, str):
            return self.excludes
        module, _, attribute = self.excludes.partition(":")
        answer = getattr(importlib.import_module(module), attribute)()
        if not isinstance(answer, Mapping):
            raise UsageError(f"{self.excludes} returned {answer!r}, not a mapping")
        return answer

    @overload
    def load(self, name: str) -> SystemFactory[Op, Observation, Snapshot]: ...
    @overload
    def load(self, name: str, family: Family[O, B, S]) -> SystemFactory[O, B, S]: ...
    def load(
        self, name: str, family: Family[O, B, S] | None = None
    ) -> SystemFactory[O, B, S] | SystemFactory[Op, Observation, Snapshot]:
        """The factory of a system of ``family`` (HiCache's unless given), imported on first use. What it
        builds is checked to be a ``System`` (``UsageError`` naming what it lacks). Raises ``UsageError``
        when the entry speaks another family, and saying what to install when the import fails."""
        return self._load(name, HICACHE) if family is None else self._load(name, family)

    def _load(self, name: str, family: Family[O, B, S]) -> SystemFactory[O, B, S]:
        if self.family != family.name:
            raise UsageError(
                f"system {name!r} speaks the {self.family} family, not {family.name} ({family.summary})"
            )
        if not isinstance(self.target, str):
            return _checked(name, self.target, family)
        module_name, _, attribute = self.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise UsageError(
                f"system {name!r} ({self.summary}) cannot be imported here: {error}; install it with: "
                f"{self.install}"
            ) from error
        try:
            factory: Callable[..., object] = getattr(module, attribute)
        except AttributeError:
            raise UsageError(
                f"system {name!r}: {module_name} has no {attribute} (its entry's target)"
            ) from None
        return _checked(name, factory, family)

    def host_defaults(self, name: str) -> Mapping[str, tuple[str, str]]:
        """What this machine needs of the configuration unless the user chose otherwise: configuration
        field -> (value, one line saying why), from the ``defaults`` function (none: nothing). Raises
        ``UsageError`` like ``load``."""
        if self.defaults is None:
            return {}
        module_name, _, attribute = self.defaults.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise UsageError(
                f"system {name!r} ({self.summary}) cannot be imported here: {error}; install it with: "
                f"{self.install}"
            ) from error
        defaults: HostDefaults = getattr(module, attribute)
        return defaults()


def _checked(name: str, factory: Callable[..., object], family: Family[O, B, S]) -> SystemFactory[O, B, S]:
    """``factory``, whose systems are checked to have every method of ``System`` when built: a plugin's
    adapter that lacks one fails at once with its name, not at its first use in a run."""

    def build(*args: object, **kwargs: object) -> System[O, B, S]:
        system = factory(*args, **kwargs)
        if not isinstance(system, System):
            lacks = [
                m for m in ("apply", "snapshot", "close", "__enter__", "__exit__") if not hasattr(system, m)
            ]
            raise UsageError(
                f"system {name!r}: its factory built a {type(system).__name__}, which lacks "
                f"{', '.join(lacks)} of refcache.systems.System ({family.summary})"
            )
        return system

    return build


_HICACHE_FILE_FAULTS: Final = frozenset(
    {
        FaultKind.DELETE,
        FaultKind.FAIL_NEXT_READ,
        FaultKind.FAIL_NEXT_WRITE,
        FaultKind.DISK_FULL,
        FaultKind.FAIL_PUBLISH,
    }
)
"""The storage faults SGLang's adapters inject into its file backend (``refcache.engines.sglang._adapter.STORAGE_FAULTS``):
HiCacheFile has no checksum, so no damaged-page kinds (D-18, D-30)."""

_BUILT_IN: Final[Mapping[str, SystemEntry]] = {
    "model": SystemEntry("the reference model (pure Python)", "refcache.model:HiCacheModel"),
    "impl": SystemEntry(
        "the implementation (torch pools, Triton or direct transfers, file L3)",
        "refcache.gpu.driver:HiCacheImpl",
        install="pip install torch==2.13.0 && pip install refcache",
        requires=("torch",),
        defaults="refcache.gpu.driver:host_defaults",
        options=("oracle",),  # the KV content oracle: "full", "sampled" or "off" (refcache.gpu.kv_oracle)
        unfollowed_with_storage={  # specs/decisions.md D-01, D-07
            "allocate_prefetch_after_query": "D-01: SGLang 0.5.20's prefetch pipeline",
            "backup_protects_passed_node_only": "D-07: SGLang 0.5.20's unpinned backup fragment",
        },
    ),
    "sglang": SystemEntry(
        "SGLang's own HiRadixCache and HiCacheController, 0.5.5 to 0.5.20 (CPU)",
        "refcache.engines.sglang:open_system",
        install="nox -s sglang, or see README 'Check your SGLang'",
        requires=("sglang",),
        defaults="refcache.engines.sglang:host_defaults",
        follows="refcache.engines.sglang.versions:installed_profile",
        placement="refcache.engines.sglang.versions:installed_placement",
        engine=("sglang", sglang_releases_of("sglang")),  # the table: refcache.engines.sglang.versions
        recorder="refcache.engines.sglang.record:record",
        constraints={"tp_size": 1, "hicache_storage_backend": None},  # specs/sglang-adapter.md: Ranks, L3
        allows={"tp_size": (2,), "hicache_storage_backend": ("file",)},  # _tp; HiCacheFile (L3)
        max_pending_loads=3,  # 0.5.20's LayerDoneCounter (specs/sglang-adapter.md)
        fault_kinds=_HICACHE_FILE_FAULTS,
        # up to 0.5.5 the priority eviction policy and the page_head layout, which those releases lack
        excludes="refcache.engines.sglang._compat:installed_excluded_values",
        with_storage={  # specs/sglang-adapter.md, "L3"
            "hicache_write_policy": (
                WritePolicy.WRITE_THROUGH,
                (
                    "under the other policies a node inserted while a prefetch runs can stay device-only and "
                    "0.5.20 hangs the fetched pages below it (upstream bug sglang.md §9 #6, D-06), which breaks "
                    "BACKUP-CONTIGUITY (specs/sglang-adapter.md, 'L3'); --known listing finding F1 lifts this"
                ),
            ),
        },
        # F1 (specs/sglang-findings.md): at the drain from 0.5.19, at check_prefetch_progress 0.5.16..0.5.18 and,
        # its own entry, 0.5.9..0.5.15 (host memory allocated at admission), and another 0.5.3..0.5.8
        with_storage_unless_known={
            "hicache_write_policy": (
                "sglang-F1-prefetch-host-under-device-node",
                "sglang-F1-prefetch-host-under-device-node-at-progress",
                "sglang-F1-prefetch-host-under-device-node-at-progress-before-0.5.16",
                "sglang-F1-prefetch-host-under-device-node-at-progress-before-0.5.9",
            ),
        },
    ),
    "sglang-unified": SystemEntry(
        "SGLang's own UnifiedRadixCache and HybridCacheController, 0.5.19 to 0.5.23 (CPU)",
        "refcache.engines.sglang:open_unified",
        install="nox -s sglang_latest (specs/sglang-adapter.md, 'Newer releases')",
        requires=("sglang",),
        defaults="refcache.engines.sglang:host_defaults",
        follows="refcache.engines.sglang.versions:installed_unified_profile",
        placement="refcache.engines.sglang.versions:installed_placement",
        engine=("sglang", sglang_releases_of("sglang-unified")),
        # one rank without L3 (record refuses the others: specs/sglang-adapter.md, 'Recording')
        recorder="refcache.engines.sglang.record:record",
        constraints={"tp_size": 1, "hicache_storage_backend": None},  # as "sglang"
        # two ranks (_tp's workers) and L3 (HiCacheFile) where the release table says (Release.ranks_on, l3_on);
        # check_installed refuses elsewhere
        allows={"tp_size": (2,), "hicache_storage_backend": ("file",)},
        max_pending_loads=3,  # LayerDoneCounter.num_counters, still 3 (has_free_load_back_slot)
        counts_unreaped_loads="refcache.engines.sglang._compat:installed_unified_counts_unreaped_loads",
        fault_kinds=_HICACHE_FILE_FAULTS,  # as "sglang": the same HiCacheFile wrappers
    ),
    "sglang-0.5.23": SystemEntry(
        "sglang-unified's former name (it drove 0.5.23 first), kept for traces and documents that name it",
        "refcache.engines.sglang._unified:UnifiedSGLangSystem",
        install="nox -s sglang_latest (specs/sglang-adapter.md, 'Newer releases')",
        requires=("sglang",),
        defaults="refcache.engines.sglang:host_defaults",
        follows="refcache.engines.sglang.versions:installed_unified_profile",
        placement="refcache.engines.sglang.versions:installed_placement",
        engine=("sglang", sglang_releases_of("sglang-0.5.23")),  # the same releases (ALIASES)
        constraints={"tp_size": 1, "hicache_storage_backend": None},  # as "sglang"
        max_pending_loads=3,  # LayerDoneCounter.num_counters, still 3 (has_free_load_back_slot)
        counts_unreaped_loads="refcache.engines.sglang._compat:installed_unified_counts_unreaped_loads",
    ),
    "vllm-model": SystemEntry(
        "the reference model of vLLM v1's block pool and CPU offload manager (pure Python)",
        "refcache.vllm.model:VllmModel",
        family="vllm",
    ),
    "vllm": SystemEntry(
        "vLLM 0.33's own KVCacheManager and CPUOffloadingManager (CPU)",
        "refcache.engines.vllm:VllmSystem",
        install="nox -s vllm, or see README 'Check vLLM'",
        requires=("vllm",),
        family="vllm",
        engine=("vllm", ("0.33.0",)),
    ),
    "lmcache-model": SystemEntry(
        "the reference model of LMCache 0.5.6's cache engine and its CPU, disk and remote tiers (pure Python)",
        "refcache.lmcache.model:LMCacheModel",
        family="lmcache",
    ),
    "lmcache": SystemEntry(
        "LMCache 0.5.6's own cache engine: CPU, local disk and fs:// remote tiers (CPU)",
        "refcache.engines.lmcache:LMCacheSystem",
        install="nox -s lmcache, or see README 'Check LMCache'",
        requires=("lmcache",),
        family="lmcache",
        engine=("lmcache", ("0.5.6",)),
    ),
}
"""refcache's own systems by name (``SYSTEMS`` adds the plugins')."""

BUILT_IN_SYSTEMS: Final = tuple(_BUILT_IN)
"""The names of refcache's own systems (listing them loads no plugin)."""

ENTRY_POINT_GROUP: Final = "refcache.systems"
"""The entry-point group through which another package registers its systems (each names a ``SystemEntry``)."""


class _Registry(MutableMapping[str, SystemEntry]):
    """refcache's systems, then every plugin's (``ENTRY_POINT_GROUP``), then those registered in this process
    (``registered``; or ``SYSTEMS[name] = entry``, which only a test should do: it may stand in for any entry
    until ``del`` removes it). Plugins are looked up once, the first time a name is missing or the whole
    registry is listed; a plugin whose name is taken, or whose entry is not a ``SystemEntry``, is a
    ``UsageError`` naming its distribution."""

    def __init__(self, built_in: Mapping[str, SystemEntry]) -> None:
        self._built_in = dict(built_in)
        self._plugins: dict[str, SystemEntry] | None = None
        self._local: dict[str, SystemEntry] = {}

    def _all(self) -> dict[str, SystemEntry]:
        if self._plugins is None:
            self._plugins = _plugins(self._built_in)
        return {**self._built_in, **self._plugins, **self._local}  # a local entry may stand in for another

    def __getitem__(self, name: str) -> SystemEntry:
        entry = self._local.get(name) or self._built_in.get(name)
        return entry if entry is not None else self._all()[name]

    def __contains__(self, name: object) -> bool:
        return name in self._built_in or name in self._local or name in self._all()

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._all())

    def __setitem__(self, name: str, entry: SystemEntry) -> None:
        """Register (or, in a test, replace) system ``name`` in this process; ``registered`` is the checked way."""
        if name in ALIASES:
            raise UsageError(f"{name!r} names a group of systems; register yours under another name")
        self._local[name] = entry

    def __delitem__(self, name: str) -> None:
        if name not in self._local:
            raise KeyError(f"{name!r} was not registered in this process")
        del self._local[name]

    @contextlib.contextmanager
    def registered(self, name: str, entry: SystemEntry) -> Iterator[SystemEntry]:
        if name in self:
            raise UsageError(f"a system named {name!r} is registered already; choose another name")
        self._local[name] = entry
        try:
            yield entry
        finally:
            del self._local[name]


def _plugins(taken: Mapping[str, SystemEntry]) -> dict[str, SystemEntry]:
    found: dict[str, SystemEntry] = {}
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        where = f"entry point {point.name!r} = {point.value!r}" + (
            f" of {point.dist.name}" if point.dist is not None else ""
        )
        if point.name in taken or point.name in found or point.name in ALIASES:
            raise UsageError(f"{where}: a system named {point.name!r} exists already; rename the plugin's")
        try:
            entry = point.load()
        except ImportError as error:
            raise UsageError(f"{where} cannot be imported: {error}") from error
        if not isinstance(entry, SystemEntry):
            raise UsageError(f"{where} names a {type(entry).__name__}, not a refcache.systems.SystemEntry")
        found[point.name] = entry
    return found


SYSTEMS: Final = _Registry(_BUILT_IN)
"""Every system by name; the first one named in a run is the reference the others are compared with."""


def registered(name: str, entry: SystemEntry) -> contextlib.AbstractContextManager[SystemEntry]:
    """Register ``entry`` as system ``name`` for the duration of a ``with`` block (in this process only):
    what ``refcache.conformance.check_system`` does with a factory it is given. Raises ``UsageError`` when
    the name is taken."""
    return SYSTEMS.registered(name, entry)


ALIASES: Final[Mapping[str, tuple[str, ...]]] = {"both": ("model", "impl")}


def parse_against(text: str) -> tuple[str, ...]:
    """``"model"``, ``"both"`` (model and implementation) or a comma-separated list of system names, in
    order (the first is the reference). Raises ``UsageError`` naming the unknown system and the known ones."""
    names: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        for name in ALIASES.get(part, (part,)):
            if name not in SYSTEMS:
                known = ", ".join([*SYSTEMS, *ALIASES])
                raise UsageError(
                    f"unknown system {name!r}: expected one of {known}, or a comma-separated list"
                )
            if name in names:
                raise UsageError(f"system {name!r} is named twice")
            names.append(name)
    families = {SYSTEMS[name].family for name in names}
    if len(families) > 1:
        raise UsageError(
            f"systems {', '.join(names)} speak different operations ({', '.join(sorted(families))}); "
            f"compare systems of one family only with each other (e.g. vllm-model,vllm; lmcache-model,lmcache)"
        )
    return tuple(names)


class OpenSystems(Mapping[str, System[O, B, S]]):
    """Named, open systems of one family in the order they were asked for; closing it (or leaving its
    ``with``) closes every one of them, even when one ``close`` raises."""

    def __init__(self, systems: Mapping[str, System[O, B, S]]) -> None:
        self._systems = dict(systems)

    def __getitem__(self, name: str) -> System[O, B, S]:
        return self._systems[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._systems)

    def __len__(self) -> int:
        return len(self._systems)

    def close(self) -> None:
        errors: list[BaseException] = []
        for system in reversed(self._systems.values()):
            try:
                system.close()
            except Exception as error:  # close the others first, then report
                errors.append(error)
        if errors:
            raise errors[0]

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


@overload
def open_systems(
    names: Iterable[str], config: HiCacheConfig, options: SystemOptions | None = None
) -> OpenSystems[Op, Observation, Snapshot]: ...
@overload
def open_systems(
    names: Iterable[str],
    config: HiCacheConfig,
    options: SystemOptions | None = None,
    *,
    family: Family[O, B, S],
) -> OpenSystems[O, B, S]: ...
def open_systems(
    names: Iterable[str],
    config: HiCacheConfig,
    options: SystemOptions | None = None,
    *,
    family: Family[O, B, S] | None = None,
) -> OpenSystems[O, B, S] | OpenSystems[Op, Observation, Snapshot]:
    """Build fresh systems ``names`` (registry names, in order) of ``family`` (HiCache's unless given) for
    ``config``, each given its ``options`` (keyword arguments, ``SystemOptions``). Raises ``UsageError`` for
    an unknown or uninstallable system, or one of another family; what was opened before a failure is
    closed again."""
    return _open(names, config, options, HICACHE) if family is None else _open(names, config, options, family)


def _open(
    names: Iterable[str], config: HiCacheConfig, options: SystemOptions | None, family: Family[O, B, S]
) -> OpenSystems[O, B, S]:
    opened: dict[str, System[O, B, S]] = {}
    try:
        for name in names:
            if name not in SYSTEMS:
                raise UsageError(f"unknown system {name!r}: expected one of {', '.join(SYSTEMS)}")
            opened[name] = SYSTEMS[name]._load(name, family)(config, **(options or {}).get(name, {}))
    except BaseException:
        OpenSystems(opened).close()
        raise
    return OpenSystems(opened)


def answered(names: Iterable[str], family: Family[O, B, S]) -> frozenset[type[O]]:
    """The operations of ``family`` that every one of systems ``names`` answers (``SystemEntry.answers``).
    Raises ``UsageError`` for an entry naming an operation the family does not have."""
    out = frozenset(family.ops)
    for name in names:
        entry = SYSTEMS[name]
        if entry.answers is not None:
            out &= frozenset(family.op_named(op) for op in entry.answers)
    return out


def granularity(names: Iterable[str], family: Family[O, B, S]) -> Callable[[S], S] | None:
    """The projection every snapshot of systems ``names`` goes through before they are compared: the one
    granularity their entries ask for (``SystemEntry.compare``; None: exact). Raises ``UsageError`` when two
    entries ask for different coarser ones, or for one the family does not have."""
    asked = {SYSTEMS[name].compare for name in names} - {EXACT}
    if len(asked) > 1:
        raise UsageError(f"the systems compare at different granularities ({', '.join(sorted(asked))})")
    return family.project(asked.pop()) if asked else None


def required_constraints(
    names: Iterable[str], chosen: Mapping[str, object] | None = None
) -> dict[str, object]:
    """The configuration fields systems ``names`` need fixed (``SystemEntry.constraints``), together; a value
    in ``chosen`` (the user's) replaces a constraint whose entry ``allows`` it. Raises ``UsageError`` for an
    unknown system or when two systems need different values."""
    merged: dict[str, object] = {}
    chosen = chosen or {}
    for name in names:
        entry = SYSTEMS.get(name)
        if entry is None:
            raise UsageError(f"unknown system {name!r}: expected one of {', '.join(SYSTEMS)}")
        for option, value in entry.constraints.items():
            if option in chosen and chosen[option] in entry.allows.get(option, ()):
                value = chosen[option]
            if option in merged and merged[option] != value:
                raise UsageError(f"the systems need different {option}: {merged[option]!r} and {value!r}")
            merged[option] = value
    return merged


def excluded_values(names: Iterable[str]) -> dict[str, tuple[object, ...]]:
    """The configuration values any of systems ``names`` cannot run (``SystemEntry.excluded``), by field: what
    the machines draw none of. A system whose engine is not installed, or is a release no row drives,
    excludes nothing here (opening it says why it cannot run)."""
    out: dict[str, tuple[object, ...]] = {}
    for name in names:
        entry = SYSTEMS.get(name)
        if entry is None:
            continue
        try:
            excluded = entry.excluded()
        except RefcacheError:
            continue
        for option, values in excluded.items():
            out[option] = (*out.get(option, ()), *(v for v in values if v not in out.get(option, ())))
    return out


def fault_kinds(names: Iterable[str]) -> tuple[FaultKind, ...]:
    """The ``StorageFault`` kinds every one of systems ``names`` injects (``SystemEntry.fault_kinds``), in
    ``FaultKind`` order."""
    kinds = set(FaultKind)
    for name in names:
        entry = SYSTEMS.get(name)
        if entry is not None and entry.fault_kinds is not None:
            kinds &= entry.fault_kinds
    return tuple(kind for kind in FaultKind if kind in kinds)


def system_options(names: Iterable[str], given: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """``given`` options (option name -> value) for each of systems ``names`` whose entry takes them
    (``SystemEntry.options``). Raises ``UsageError`` for an option none of them takes."""
    out: dict[str, dict[str, object]] = {}
    names = list(names)
    for option, value in given.items():
        takers = [n for n in names if n in SYSTEMS and option in SYSTEMS[n].options]
        if not takers:
            which = [n for n, e in SYSTEMS.items() if option in e.options]
            raise UsageError(
                f"{option} applies to {', '.join(which) or 'no system'}, not to {', '.join(names)}"
            )
        for name in takers:
            out.setdefault(name, {})[option] = value
    return out


def engine_placements(names: Iterable[str]) -> dict[str, str]:
    """Distribution -> how it is placed among its releases, in words, for the engines systems ``names`` drive
    that are not a release as published (``SystemEntry.placed``: a post release, a source checkout): what a
    report says before its verdict and a trace's ``release`` records. An engine not installed, or not placed,
    says nothing here (the run says why it cannot drive it)."""
    out: dict[str, str] = {}
    for name in names:
        entry = SYSTEMS.get(name)
        if entry is None or entry.engine is None or entry.engine[0] in out:
            continue
        try:
            placed = entry.placed()
        except RefcacheError:
            continue
        if placed is not None and placed[1]:
            out[entry.engine[0]] = placed[1]
    return out


def engine_releases(names: Iterable[str]) -> list[tuple[str, str]]:
    """(distribution, installed version) of the engines systems ``names`` drive (``SystemEntry.engine``), each
    once, for those installed here: what a trace made against them records (``trace.stamp_release``)."""
    found: dict[str, str] = {}
    for name in names:
        entry = SYSTEMS.get(name)
        if entry is None or entry.engine is None or entry.engine[0] in found:
            continue
        try:
            found[entry.engine[0]] = metadata.version(entry.engine[0])
        except metadata.PackageNotFoundError:
            continue
    return sorted(found.items())
