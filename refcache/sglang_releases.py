"""The SGLang releases refcache drives, as data (pure Python, no SGLang, no torch): which adapter drives each
and what it opens, and ranges of releases. ``refcache.config`` derives a profile per release from it,
``refcache.systems`` which releases its SGLang systems drive; ``refcache.engines.sglang.versions`` (the
versions API: install recipes, the installed release) re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from refcache.errors import UnsupportedError, UsageError

__all__ = [
    "ALIASES",
    "RELEASES",
    "SUPPORTED",
    "SYSTEM_BY_VERSION",
    "Release",
    "Releases",
    "Since",
    "Until",
    "check_supported",
    "parse",
    "release",
    "releases_of",
]


def parse(version: str) -> tuple[int, ...]:
    """``"0.5.12"`` -> ``(0, 5, 12)``. Raises ``UsageError`` for anything but dot-separated numbers (a local
    or pre-release suffix is not a release refcache can place)."""
    try:
        parts = tuple(int(p) for p in version.split("."))
    except ValueError:
        raise UsageError(f"{version!r} is not a release number like 0.5.12") from None
    if len(parts) != 3:
        raise UsageError(f"{version!r} is not a release number like 0.5.12")
    return parts


@dataclass(frozen=True)
class Releases:
    """The releases from ``first`` to ``last``, both included; None: no bound on that side."""

    first: str | None = None
    last: str | None = None

    def __post_init__(self) -> None:
        for bound in (self.first, self.last):
            if bound is not None:
                parse(bound)

    def __contains__(self, version: object) -> bool:
        if not isinstance(version, str):
            return False
        v = parse(version)
        if self.first is not None and v < parse(self.first):
            return False
        return self.last is None or v <= parse(self.last)

    def __str__(self) -> str:
        if self.first is None and self.last is None:
            return "every release"
        if self.first is None:
            return f"up to {self.last}"
        if self.last is None:
            return f"since {self.first}"
        return f"{self.first}..{self.last}"


def Since(first: str) -> Releases:
    """``first`` and every later release."""
    return Releases(first, None)


def Until(last: str) -> Releases:
    """Every release up to ``last``, included."""
    return Releases(None, last)


@dataclass(frozen=True)
class Release:
    """One supported SGLang release (a row of ``RELEASES``)."""

    version: str  # the PyPI release, e.g. "0.5.12"
    system: str  # the registered system (``refcache.systems.SYSTEMS``) that drives it by default
    l3: bool  # ``system`` drives its L3 (HiCacheFile and its storage threads)
    ranks: tuple[int, ...]  # the tp sizes ``system`` opens on it
    builds: str  # the cache class its scheduler builds for HiCache on a full-attention, non-DSA model
    also: tuple[str, ...] = ()  # further systems that drive it (one rank), the other cache class
    also_l3: tuple[str, ...] = ()  # those of ``also`` that drive its L3 too (HiCacheFile)
    also_ranks: tuple[str, ...] = ()  # those of ``also`` that open it with ``ranks`` too (else one rank)

    @property
    def systems(self) -> tuple[str, ...]:
        """Every registered system that drives this release, the default first."""
        return (self.system, *self.also)

    def l3_on(self, system: str) -> bool:
        """Whether ``system`` drives this release's L3: ``l3`` for the default system, ``also_l3`` for a
        further one."""
        system = ALIASES.get(system, system)
        return self.l3 if system == self.system else system in self.also_l3

    def ranks_on(self, system: str) -> tuple[int, ...]:
        """The tp sizes ``system`` opens this release with: ``ranks`` for the default system and for a further
        one named in ``also_ranks`` (two ranks: ``_tp``'s worker processes), one rank for another further one."""
        system = ALIASES.get(system, system)
        return self.ranks if system == self.system or system in self.also_ranks else (1,)


_HIRADIX: Final = "sglang"  # HiRadixCache: up to 0.5.20 (_adapter, with _compat's rows)
_UNIFIED: Final = "sglang-unified"  # UnifiedRadixCache: 0.5.19 on (_unified, with _compat's rows)
_HI: Final = "HiRadixCache"
_UNI: Final = "UnifiedRadixCache"

ALIASES: Final[dict[str, str]] = {"sglang-0.5.23": _UNIFIED}
"""Former system names -> the system's name now ("sglang-0.5.23" named the Unified adapter when it drove 0.5.23
only; traces and documents that name it still open)."""

_L3_BEFORE_0519: Final = frozenset({10, 12, 15, 16, 17, 18})
"""The HiRadixCache releases before 0.5.19 whose L3 ``sglang`` drives: the pipeline without ``ack_prefetch_queue``
(the I/O thread publishes its progress in the operation; ``_compat`` "prefetch_progress_in_operation"; up to 0.5.17
the prefetch thread revokes through ``prefetch_revoke_queue``, "prefetch_revoke_queue"; up to 0.5.15 host memory is
allocated at admission, D-01 off, "prefetch_allocated_at_admission", with D-59..D-64's limits; up to 0.5.12 the batch
size is the controller's, "storage_batch_size_attribute"). 0.5.11, 0.5.13 and 0.5.14 were read in their wheels, not
installed; 0.5.6..0.5.9 not read."""

_TWO_RANKS_BEFORE_0519: Final = frozenset({13, 14, 15, 16, 17, 18})
"""The HiRadixCache releases before 0.5.19 ``sglang`` opens with two ranks (``_tp``): from 0.5.13 the write and load
acks are retired by a MIN across ranks, as the model's (up to 0.5.12 each rank retires its own finished loads, which
the model does not follow: specs/sglang-adapter.md, "Two ranks before 0.5.18"); with L3 the prefetch thread's one
all-reduce is ``_all_reduce_prefetch_groups`` (``_compat`` "prefetch_groups_all_reduce")."""


def _ranks_before_0519(n: int) -> tuple[int, ...]:
    return (1, 2) if n in _TWO_RANKS_BEFORE_0519 else (1,)


RELEASES: Final[tuple[Release, ...]] = (
    *(
        Release(f"0.5.{n}", _HIRADIX, l3=n in _L3_BEFORE_0519, ranks=_ranks_before_0519(n), builds=_HI)
        for n in range(3, 19)
    ),
    # From 0.5.19 the scheduler's default cache factory (mem_cache/registry.py, default_radix_cache_factory)
    # builds UnifiedRadixCache + init_hicache for every model: HiRadixCache ships but nothing constructs it.
    Release(
        "0.5.19",
        _HIRADIX,
        l3=True,
        ranks=(1, 2),
        builds=_UNI,
        also=(_UNIFIED,),
        also_l3=(_UNIFIED,),
        also_ranks=(_UNIFIED,),
    ),
    # sglang-unified drives 0.5.20's L3 too (_unified: its HybridCacheController's storage threads under the gate),
    # and its two ranks (_tp's workers build _unified's adapter; the scheduler's one MIN per check runs for real)
    Release(
        "0.5.20",
        _HIRADIX,
        l3=True,
        ranks=(1, 2),
        builds=_UNI,
        also=(_UNIFIED,),
        also_l3=(_UNIFIED,),
        also_ranks=(_UNIFIED,),
    ),
    # 0.5.21 removed HiRadixCache (hiradix_cache.py): its UnifiedRadixCache is the only cache to drive
    # L3 driven as on 0.5.20's Unified (submit_prefetch calls prefetch without PP; the same queues)
    Release("0.5.21", _UNIFIED, l3=True, ranks=(1, 2), builds=_UNI),
    Release(
        "0.5.22", _UNIFIED, l3=True, ranks=(1, 2), builds=_UNI
    ),  # L3 as 0.5.21's (the server args passed)
    # L3 with the clock in poll_timer (the timeout's PollTimer, D-55) and the storage config's dcp rank stated
    Release("0.5.23", _UNIFIED, l3=True, ranks=(1, 2), builds=_UNI),
)
"""The supported releases, oldest first (specs/sglang-adapter.md, "Releases", says why the line is where
it is)."""

SUPPORTED: Final[tuple[str, ...]] = tuple(r.version for r in RELEASES)
"""The supported releases' versions, oldest first."""

SYSTEM_BY_VERSION: Final[dict[str, str]] = {r.version: r.system for r in RELEASES}
"""SGLang release -> the registered system that drives it by default (``Release.systems``: all of them)."""


def release(version: str) -> Release:
    """The row of ``version``. Raises ``UnsupportedError`` naming the supported range otherwise."""
    check_supported(version)
    return next(r for r in RELEASES if r.version == version)


def check_supported(version: str) -> None:
    """Raises ``UnsupportedError`` naming ``version`` and the supported releases unless a row drives it."""
    if version not in SYSTEM_BY_VERSION:
        raise UnsupportedError(
            f"SGLang {version} is not a release refcache drives: supported are {_supported_range()} "
            "(refcache.engines.sglang.versions.SUPPORTED; specs/sglang-adapter.md, 'Releases'). Install one "
            "of them (nox -s sglang_releases -- VERSION builds its environment)"
        )


def _supported_range() -> str:
    versions = sorted(SUPPORTED, key=parse)
    runs: list[list[str]] = []
    for v in versions:
        major, minor, patch = parse(v)
        if runs and parse(runs[-1][-1]) == (major, minor, patch - 1):
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(r[0] if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs)


def releases_of(system: str) -> tuple[str, ...]:
    """The releases the registered system ``system`` (or a former name of it, ``ALIASES``) drives
    (``refcache.systems.SystemEntry.engine``)."""
    system = ALIASES.get(system, system)
    return tuple(r.version for r in RELEASES if system in r.systems)
