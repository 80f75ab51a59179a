"""The SGLang releases refcache drives, as data: which adapter drives each, what it opens (L3, two ranks), and
how to build an environment for it. Pure Python (nothing of SGLang or torch is imported): ``refcache.systems``,
``refcache.config`` (a profile per release), the nox sessions and ``refcache bisect`` read it.

``RELEASES`` is the table; ``SUPPORTED`` its versions, oldest first; ``install_recipe(version)`` the pip
argument lists that build a virtualenv for one release (run in the repository root); ``check_supported``
refuses any other release with ``UnsupportedError``. ``Releases`` is a range of releases (``Since("0.5.12")``,
``Until("0.5.16")``, ``Releases("0.5.12", "0.5.16")``): the compatibility layer (``_compat``) and the
fidelity options (``refcache.config``) say with it where a row applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from typing import Final

from refcache.errors import UnsupportedError, UsageError

__all__ = [
    "RELEASES",
    "SUPPORTED",
    "SYSTEM_BY_VERSION",
    "Release",
    "Releases",
    "Since",
    "Until",
    "check_installed",
    "check_supported",
    "constraints_file",
    "install_recipe",
    "installed_system",
    "installed_version",
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
    system: str  # the registered system (``refcache.systems.SYSTEMS``) that drives it
    l3: bool  # the adapter drives its L3 (HiCacheFile and its storage threads)
    ranks: tuple[int, ...]  # the tp sizes the adapter opens on it


_HIRADIX: Final = "sglang"  # HiRadixCache: up to 0.5.20 (_adapter, with _compat's rows)
_UNIFIED: Final = "sglang-0.5.23"  # UnifiedRadixCache: 0.5.21 on (_unified)

RELEASES: Final[tuple[Release, ...]] = (
    Release("0.5.20", _HIRADIX, l3=True, ranks=(1, 2)),
    Release("0.5.23", _UNIFIED, l3=False, ranks=(1,)),
)
"""The supported releases, oldest first (specs/sglang-adapter.md, "Releases", says why the line is where
it is)."""

SUPPORTED: Final[tuple[str, ...]] = tuple(r.version for r in RELEASES)
"""The supported releases' versions, oldest first."""

SYSTEM_BY_VERSION: Final[dict[str, str]] = {r.version: r.system for r in RELEASES}
"""SGLang release -> the registered system that drives it."""

IMPORTS: Final[tuple[str, ...]] = (
    "numpy", "triton", "transformers", "tokenizers", "xgrammar", "compressed-tensors", "openai", "orjson",
    "psutil", "pybase64", "requests", "packaging", "pillow", "starlette", "msgspec", "pyzmq", "tqdm",
    "ipython", "pydantic", "aiohttp", "dill", "gguf", "partial-json-parser", "sentencepiece",
    "apache-tvm-ffi",
)  # fmt: skip
"""What the HiCache modules of the supported releases (and the calls the adapters make) import beside torch:
each added because an import failed without it in a fresh venv; pinned per release by its constraints file."""

TOOLS: Final[tuple[str, ...]] = (
    "hypothesis>=6.150", "typer>=0.12", "rich>=13", "pytest>=8", "pytest-xdist>=3.5",
)  # fmt: skip
"""refcache's own dependencies and the test runner (refcache itself goes in with ``--no-deps``)."""

TORCH: Final = "torch==2.13.0"
"""Every release runs on the one CPU torch this machine has (the releases pin CUDA builds)."""


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


def constraints_file(version: str) -> str:
    """The constraints file (relative to the repository root) that pins ``version``'s imports."""
    check_supported(version)
    return f"constraints/sglang-{version}.txt"


def install_recipe(version: str) -> tuple[tuple[str, ...], ...]:
    """The pip argument lists, in order, that build a virtualenv for SGLang ``version``, run in the repository
    root: the CPU torch first; what the release imports, pinned by its constraints file; refcache's tools;
    refcache itself (``--no-deps -e .``); the SGLang wheel ``--no-deps`` last (its own dependencies are the GPU
    stack; nothing is installed after a ``--no-deps`` install, ``noxfile._NO_DEPS_LAST``). Raises
    ``UnsupportedError`` for a release no row drives."""
    pins = constraints_file(version)
    return (
        (TORCH,),
        ("-c", pins, *IMPORTS),
        ("-c", pins, *TOOLS),
        ("--no-deps", "-e", "."),
        ("--no-deps", f"sglang=={version}"),
    )


def releases_of(system: str) -> tuple[str, ...]:
    """The releases the registered system ``system`` drives (``refcache.systems.SystemEntry.engine``)."""
    return tuple(r.version for r in RELEASES if r.system == system)


def installed_version() -> str:
    """The installed SGLang's version. Raises ``UsageError`` when none is installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError as error:
        raise UsageError("SGLang is not installed here (nox -s sglang, or nox -s sglang_releases)") from error


def installed_system() -> str:
    """The system name of the adapter for the installed SGLang. Raises ``UnsupportedError`` for a release no
    row drives (naming the supported ones)."""
    return release(installed_version()).system


def check_installed(system: str, *, tp_size: int, storage: bool) -> Release:
    """The row of the installed SGLang, checked to be driven by ``system`` with ``tp_size`` ranks and (when
    ``storage``) L3; the adapters call it before importing anything of SGLang. Raises ``UnsupportedError``
    naming the release and what drives it, ``UsageError`` when SGLang is not installed."""
    row = release(installed_version())
    if row.system != system:
        raise UnsupportedError(
            f"SGLang {row.version} is driven by the system {row.system!r}, not {system!r} "
            f"(releases of {system!r}: {', '.join(releases_of(system)) or 'none'})"
        )
    if tp_size not in row.ranks:
        raise UnsupportedError(
            f"tp_size={tp_size}: the adapter opens SGLang {row.version} with tp_size "
            f"{', '.join(map(str, row.ranks))} (specs/sglang-adapter.md, 'Releases')"
        )
    if storage and not row.l3:
        raise UnsupportedError(
            f"L3: the adapter does not drive SGLang {row.version}'s storage pipeline; L3 runs on "
            f"{', '.join(r.version for r in RELEASES if r.l3)} (specs/sglang-adapter.md, 'Releases')"
        )
    return row
