"""The SGLang releases refcache drives, as data (pure Python, no SGLang, no torch): which adapter drives each
and what it opens, and ranges of releases. ``refcache.config`` derives a profile per release from it,
``refcache.systems`` which releases its SGLang systems drive; ``refcache.engines.sglang.versions`` (the
versions API: install recipes, the installed release) re-exports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from refcache.errors import UnsupportedError, UsageError

__all__ = [
    "ALIASES",
    "DRIVEN_POSTS",
    "POSTS_NOT_DRIVEN",
    "POST_RELEASES",
    "RELEASES",
    "SUPPORTED",
    "SYSTEM_BY_VERSION",
    "Before",
    "Placement",
    "Release",
    "Releases",
    "Since",
    "Until",
    "check_supported",
    "parse",
    "place",
    "release",
    "releases_of",
]


_VERSION: Final = re.compile(
    r"(?P<base>\d+\.\d+\.\d+)(?:\.post(?P<post>\d+))?(?:\.dev(?P<dev>\d+))?(?:\+(?P<local>[0-9A-Za-z.]+))?"
)
"""What refcache reads in an installed SGLang's version: a release ``0.5.12``, a post release ``0.5.10.post1``,
and what a source checkout reports: a dev version ``0.5.24.dev3`` and a local label ``+gabc123``."""


def parse(version: str) -> tuple[int, ...]:
    """A release's ordering key: ``"0.5.12"`` -> ``(0, 5, 12)``, a post release ``"0.5.10.post1"`` ->
    ``(0, 5, 10, 1)`` (after its base release, before the next one). Raises ``UsageError`` for anything
    else: a dev or local version is a source checkout's, which ``place`` places, not a release."""
    found = _VERSION.fullmatch(version)
    if found is None or found["dev"] is not None or found["local"] is not None:
        raise UsageError(f"{version!r} is not a release number like 0.5.12 or 0.5.10.post1")
    base = tuple(int(p) for p in found["base"].split("."))
    return base if found["post"] is None else (*base, int(found["post"]))


@dataclass(frozen=True)
class Releases:
    """The releases from ``first`` to ``last``, both included; None: no bound on that side. A bound written
    as a release takes in its post releases (``Until("0.5.10")`` holds ``0.5.10.post1``, as
    ``Since("0.5.10")`` does): a post release is driven as its base is until a row or decision names a post
    release as a bound (``Since("0.5.10.post1")``, ``Until("0.5.10.post1")``), which is compared exactly.
    ``before``, an upper bound that is excluded (``Before("0.5.6.post1")``: 0.5.6 but not its post releases), is
    how a row ends at a release whose post releases already differ."""

    first: str | None = None
    last: str | None = None
    before: str | None = None  # excluded, compared exactly; with ``last`` None

    def __post_init__(self) -> None:
        for bound in (self.first, self.last, self.before):
            if bound is not None:
                parse(bound)
        if self.last is not None and self.before is not None:
            raise ValueError("a range ends at 'last' or before 'before', not both")

    def __contains__(self, version: object) -> bool:
        if not isinstance(version, str):
            return False
        v = parse(version)
        if self.first is not None and v < parse(self.first):
            return False
        if self.before is not None:
            return v < parse(self.before)
        if self.last is None:
            return True
        last = parse(self.last)
        return v[: len(last)] <= last  # a release bound: its post releases too

    def __str__(self) -> str:
        end = f"before {self.before}" if self.before is not None else None
        if self.first is None and self.last is None:
            return end or "every release"
        if self.first is None:
            return f"up to {self.last}"
        if self.last is None:
            return f"since {self.first}" + (f", {end}" if end else "")
        return f"{self.first}..{self.last}"


def Since(first: str) -> Releases:
    """``first`` and every later release."""
    return Releases(first, None)


def Until(last: str) -> Releases:
    """Every release up to ``last``, included."""
    return Releases(None, last)


def Before(first_excluded: str) -> Releases:
    """Every release before ``first_excluded`` (``Before("0.5.6.post1")``: up to 0.5.6, its post releases out)."""
    return Releases(None, None, before=first_excluded)


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
    one_rank_l3: bool = False  # ``system`` opens L3 with one rank only (two ranks without L3)

    @property
    def systems(self) -> tuple[str, ...]:
        """Every registered system that drives this release, the default first."""
        return (self.system, *self.also)

    def l3_on(self, system: str) -> bool:
        """Whether ``system`` drives this release's L3: ``l3`` for the default system, ``also_l3`` for a
        further one."""
        system = ALIASES.get(system, system)
        return self.l3 if system == self.system else system in self.also_l3

    def l3_ranks_on(self, system: str) -> tuple[int, ...]:
        """The tp sizes ``system`` opens this release's L3 with: ``ranks_on``, but one rank where the row says
        ``one_rank_l3`` (the two-rank storage pipeline of that era is not driven yet); () without L3."""
        if not self.l3_on(system):
            return ()
        ranks = self.ranks_on(system)
        return (1,) if self.one_rank_l3 and ALIASES.get(system, system) == self.system else ranks

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

_L3_BEFORE_0519: Final = frozenset({3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18})
"""The HiRadixCache releases before 0.5.19 whose L3 ``sglang`` drives: the pipeline without ``ack_prefetch_queue``
(the I/O thread publishes its progress in the operation; ``_compat`` "prefetch_progress_in_operation"; up to 0.5.17
the prefetch thread revokes through ``prefetch_revoke_queue``, "prefetch_revoke_queue"; up to 0.5.15 host memory is
allocated at admission, D-01 off, "prefetch_allocated_at_admission", with D-59..D-64's limits; up to 0.5.12 the batch
size is the controller's, "storage_batch_size_attribute"; 0.5.11..0.5.14 keep a write_back victim short of host memory,
D-66). 0.5.9: 0.5.10's rows (its EAGLE prefetch keys are the known finding R-9); 0.5.6..0.5.8: five rows more (the
storage threads on the controller's stop_event, the drain without _impl, the unnamed I/O thread, no detach, no
loaded-token count) and D-67: specs/sglang-adapter.md, 'L3 before 0.5.10'. 0.5.3..0.5.5: 0.5.6's pipeline but for the I/O
thread releasing a prefetch's unread tail twice (the known finding R-13); 0.5.3: no prefix_keys (``_compat``
"prefetch_without_prefix_keys"): 'L3 on 0.5.3 to 0.5.5'."""

_TWO_RANKS_BEFORE_0519: Final = frozenset(range(3, 19))
"""The HiRadixCache releases before 0.5.19 ``sglang`` opens with two ranks (``_tp``): from 0.5.13 the write and load
acks are retired by a MIN across ranks, as the model's; up to 0.5.12 each rank retires its own finished loads, which
the model follows under D-68 (``loads_retired_per_rank``) and ``_tp`` joins by rank (``_compat``
"loads_retired_per_rank"; specs/sglang-adapter.md, "Two ranks before 0.5.18"); with L3 the prefetch thread's one
all-reduce is ``_all_reduce_prefetch_groups`` (``_compat`` "prefetch_groups_all_reduce"), up to 0.5.10 written inline
("prefetch_hits_all_reduce_inline")."""


def _ranks_before_0519(n: int) -> tuple[int, ...]:
    return (1, 2) if n in _TWO_RANKS_BEFORE_0519 else (1,)


_TWO_RANKS_L3_BEFORE_0519: Final = frozenset(range(3, 19))
"""The HiRadixCache releases before 0.5.19 ``sglang`` opens with two ranks and L3: every one it opens with two ranks
and L3 (0.5.3..0.5.18; on 0.5.3..0.5.5 the known findings R-13, a read's tail released twice, and R-14, EAGLE's
page hashes, show on two ranks as on one). The prefetch thread's MIN of the hits is ``_all_reduce_prefetch_groups`` from 0.5.11
(``_compat`` "prefetch_groups_all_reduce"), up to 0.5.10 ``torch.distributed.all_reduce`` on ``prefetch_tp_group``
called inline, which the adapter routes through the gate ("prefetch_hits_all_reduce_inline"). Up to 0.5.15 host
memory is allocated at admission, and a query resolves only once that MIN returns (``_adapter._track_queries``: the
differential's step 65 there was the adapter's, which took the query's return for it; specs/sglang-adapter.md, *Two
ranks with L3 before 0.5.16*); up to 0.5.12 each rank retires its own loads (D-68), with L3 as without. A release
with two ranks and L3 not listed here opens L3 with one rank only (``Release.one_rank_l3``)."""


RELEASES: Final[tuple[Release, ...]] = (
    *(
        Release(
            f"0.5.{n}",
            _HIRADIX,
            l3=n in _L3_BEFORE_0519,
            ranks=_ranks_before_0519(n),
            builds=_HI,
            one_rank_l3=n in _L3_BEFORE_0519 and n not in _TWO_RANKS_L3_BEFORE_0519,
        )
        for n in range(3, 19)
    ),
    # From 0.5.19 the scheduler's default cache factory (mem_cache/registry.py, default_radix_cache_factory)
    # builds UnifiedRadixCache + init_hicache for every model: HiRadixCache ships but nothing constructs it.
    # sglang-unified drives their L3 too (_unified: its HybridCacheController's storage threads under the gate),
    # and their two ranks (_tp's workers build _unified's adapter; the scheduler's one MIN per check runs for real)
    *(
        Release(
            version,
            _HIRADIX,
            l3=True,
            ranks=(1, 2),
            builds=_UNI,
            also=(_UNIFIED,),
            also_l3=(_UNIFIED,),
            also_ranks=(_UNIFIED,),
        )
        for version in ("0.5.19", "0.5.20")
    ),
    # 0.5.21 removed HiRadixCache (hiradix_cache.py): its UnifiedRadixCache is the only cache to drive
    # L3 driven as on 0.5.20's Unified (submit_prefetch calls prefetch without PP; the same queues)
    Release("0.5.21", _UNIFIED, l3=True, ranks=(1, 2), builds=_UNI),
    # L3 as 0.5.21's (the server args passed)
    Release("0.5.22", _UNIFIED, l3=True, ranks=(1, 2), builds=_UNI),
    # L3 with the clock in poll_timer (the timeout's PollTimer, D-55) and the storage config's dcp rank stated
    Release("0.5.23", _UNIFIED, l3=True, ranks=(1, 2), builds=_UNI),
)
"""The supported releases, oldest first (specs/sglang-adapter.md, "Releases", says why the line is where
it is)."""

SUPPORTED: Final[tuple[str, ...]] = tuple(r.version for r in RELEASES)
"""The supported releases' versions, oldest first."""

SYSTEM_BY_VERSION: Final[dict[str, str]] = {r.version: r.system for r in RELEASES}
"""SGLang release -> the registered system that drives it by default (``Release.systems``: all of them)."""


POST_RELEASES: Final[tuple[str, ...]] = (
    "0.5.3.post1", "0.5.3.post2", "0.5.3.post3", "0.5.4.post1", "0.5.4.post2", "0.5.4.post3",
    "0.5.5.post1", "0.5.5.post2", "0.5.5.post3", "0.5.6.post1", "0.5.6.post2", "0.5.8.post1", "0.5.10.post1",
    "0.5.12.post1", "0.5.13.post1", "0.5.15.post1",
)  # fmt: skip
"""The post releases PyPI has of supported releases, oldest first (``pip index versions sglang``): what
``refcache bisect --post`` adds to a range. A post release of a supported release, listed here or not, is
driven with its base release's row (``place``; a listed one with a profile of its own, ``DRIVEN_POSTS``), unless
``POSTS_NOT_DRIVEN`` refuses it (specs/sglang-adapter.md, "Post releases and source checkouts")."""

_NOT_READ: Final = "(not read: refused until rows with post-release bounds describe it)"
_TOWARDS_054: Final = (
    "its HiCache modules are a snapshot between 0.5.3 and 0.5.4, not 0.5.3's: it adds mem_cache/common.py, and "
    "hiradix_cache.py, cache_controller.py, radix_cache.py and schedule_batch.py's release_req differ from 0.5.3's "
    + _NOT_READ
)
POSTS_NOT_DRIVEN: Final[dict[str, str]] = {
    "0.5.3.post2": _TOWARDS_054,
    "0.5.3.post3": _TOWARDS_054,
}
"""Post releases whose modules refcache drives differ from their base release's in what ``_compat``'s rows and
the profiles describe (``diff -r`` of the wheels' ``srt/mem_cache`` and ``managers/cache_controller.py``,
specs/sglang-adapter.md, "Post releases and source checkouts"): they are refused, saying why, until rows with
post-release bounds describe them (as they now describe 0.5.4.post2, .post3 and 0.5.5.post3; 0.5.3.post1 and
0.5.4.post1 change nothing the adapter calls). The later post releases (0.5.8.post1 on) change none of those modules
but 0.5.12.post1's DeepSeek-V4 and SWA pools, which refcache does not drive."""

DRIVEN_POSTS: Final[tuple[str, ...]] = tuple(p for p in POST_RELEASES if p not in POSTS_NOT_DRIVEN)
"""The post releases of ``POST_RELEASES`` that refcache drives (those ``POSTS_NOT_DRIVEN`` does not refuse),
oldest first: each has a profile of its own (``refcache.config.PROFILES``, ``Placement.profile``)."""

_NEWEST_DEV: Final = 1 << 62  # a version with no dev part, in ``_pep440``: after its own dev versions


def _pep440(base: tuple[int, ...], post: int | None, dev: int | None) -> tuple[int, ...]:
    """The PEP 440 order of the versions ``_VERSION`` reads: ``0.5.24.dev3`` < ``0.5.24`` < ``0.5.24.post1.dev2``
    < ``0.5.24.post1``."""
    return (*base, -1 if post is None else post, _NEWEST_DEV if dev is None else dev)


@dataclass(frozen=True)
class Placement:
    """Where an installed SGLang's version sits among the supported releases (``place``): the row that drives
    it and how it relates to that row's release."""

    installed: str  # the version as installed: "0.5.10", "0.5.10.post1", "0.5.24.dev3+gabc123"
    row: Release  # the row that drives it: its own, its base release's, or (main) the newest release's
    kind: Literal["release", "post", "main"]  # main: a source checkout newer than the newest release
    source: str | None = None  # the checkout it is installed from (pip install -e DIR/python); None: a wheel

    @property
    def rows(self) -> str:
        """The version ``_compat``'s rows and the fidelity ranges are looked up with: the release or post
        release itself (a row whose bound is a post release applies to it alone), the newest release for main."""
        return self.row.version if self.kind == "main" else self.installed.partition("+")[0]

    @property
    def profile(self) -> str:
        """The profile (``refcache.config.PROFILES``) the driving system follows: a post release that
        ``POST_RELEASES`` lists, its own (``sglang-0.5.5.post3``: the decisions' ranges evaluated at the post
        release, as ``_compat``'s rows are, so a bound written as a post release moves it off its base's); any
        other, its row's release's (a post release not listed: its base's; main: the newest release's)."""
        if self.kind == "post" and self.rows in DRIVEN_POSTS:
            return f"sglang-{self.rows}"
        return f"sglang-{self.row.version}"

    def __str__(self) -> str:
        where = f", the checkout {self.source}" if self.source else ""
        if self.kind == "main":
            return f"SGLang main ({self.installed}{where}), driven with {self.row.version}'s rows"
        if self.kind == "post":
            return (
                f"SGLang {self.installed} (a post release of {self.row.version}{where}), driven with its row"
            )
        return f"SGLang {self.installed}" + (f" ({where.removeprefix(', ')})" if where else "")


def place(version: str, *, source: str | None = None) -> Placement:
    """The placement of SGLang ``version`` (installed from the checkout ``source``, where one is known): a
    supported release, a post release of one (driven with its base's row), or a source checkout newer than
    the newest supported release (a dev or local version, or any version installed from a checkout: driven
    as ``main`` with the newest release's row). A checkout whose version is a release's is that release.
    Raises ``UnsupportedError`` naming the version and the supported releases for anything else: an
    unparseable version, a release older or newer than the supported ones, a checkout between two releases."""
    found = _VERSION.fullmatch(version)
    if found is None:
        raise UnsupportedError(
            f"SGLang {version!r} is not a version refcache can place: it reads a release (0.5.12), a post "
            "release (0.5.10.post1) and a source checkout's version (0.5.24.dev3+gabc123); supported are "
            f"{_supported_range()} (specs/sglang-adapter.md, 'Releases')"
        )
    base, post, dev = found["base"], found["post"], found["dev"]
    if dev is None and base in SYSTEM_BY_VERSION:
        row = next(r for r in RELEASES if r.version == base)
        unlike = POSTS_NOT_DRIVEN.get(version.partition("+")[0])
        if unlike is not None:
            raise UnsupportedError(
                f"SGLang {version} is a post release refcache does not drive with {base}'s row: {unlike}. "
                f"Install {base} or a later release (supported are {_supported_range()})"
            )
        return Placement(version, row, "release" if post is None else "post", source)
    key = tuple(int(p) for p in base.split("."))
    newest = RELEASES[-1]
    checkout = source is not None or dev is not None or found["local"] is not None
    order = _pep440(key, None if post is None else int(post), None if dev is None else int(dev))
    if checkout and order > _pep440(parse(newest.version), None, None):
        return Placement(version, newest, "main", source)
    if checkout and key >= parse(RELEASES[0].version):
        raise UnsupportedError(
            f"SGLang {version} is a source checkout between two releases: refcache drives a checkout at a "
            f"release tag as that release, and one newer than {newest.version} as main with "
            f"{newest.version}'s rows; check out a release tag (supported are {_supported_range()}) or main"
        )
    fallback = (
        " (0.0.0.dev0 is setuptools-scm's version for a checkout without its git history: install it from a "
        "git clone, or set SETUPTOOLS_SCM_PRETEND_VERSION)"
        if key == (0, 0, 0) and checkout
        else ""
    )
    raise UnsupportedError(
        f"SGLang {version} is not a release refcache drives{fallback}: supported are {_supported_range()} "
        "(refcache.engines.sglang.versions.SUPPORTED; specs/sglang-adapter.md, 'Releases'), and their post "
        "releases. Install one of them (nox -s sglang_releases -- VERSION builds its environment)"
    )


def release(version: str) -> Release:
    """The row that drives ``version`` (``place``): its own, its base release's for a post release, the
    newest release's for a checkout newer than it. Raises ``UnsupportedError`` naming the supported range
    otherwise."""
    return place(version).row


def check_supported(version: str) -> None:
    """Raises ``UnsupportedError`` naming ``version`` and the supported releases unless it is a release PyPI
    installs that a row drives: a supported release or a post release of one (a source checkout's version
    is placed once installed, ``place``; an environment for it is built from the checkout)."""
    placed = place(version)
    if placed.kind == "main" or "+" in version:
        raise UnsupportedError(
            f"SGLang {version} is a source checkout's version, not a release on PyPI: refcache places it once "
            f"installed ({placed}) and builds its environment from the checkout (refcache bisect --checkout "
            "DIR, nox -s sglang_releases -- --checkout DIR)"
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
