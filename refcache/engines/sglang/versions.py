"""The versions API: the SGLang releases refcache drives and how to build an environment for each. Pure
Python (nothing of SGLang or torch is imported): the nox sessions, ``refcache bisect`` and the adapters read it.

The table itself (``RELEASES``: which adapter drives each release, whether it opens L3 and two ranks;
``SUPPORTED``, oldest first; ``check_supported``; the ranges ``Releases`` / ``Since("0.5.12")`` /
``Until("0.5.16")``) lives in ``refcache.sglang_releases``, beside the vocabulary, so that ``refcache.config``
(a profile per release) and ``refcache.systems`` read it without importing an engine package; it is
re-exported here. This module adds ``install_recipe(version)`` (the pip argument lists that build a
virtualenv for one release, run in the repository root), the installed release (``installed_version``,
``installed_profile``) and ``check_installed``, which the adapters call before importing SGLang.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Final
from urllib.parse import unquote, urlparse

from refcache.errors import UnsupportedError, UsageError
from refcache.sglang_releases import (
    ALIASES,
    DRIVEN_POSTS,
    POST_RELEASES,
    POSTS_NOT_DRIVEN,
    RELEASES,
    SUPPORTED,
    SYSTEM_BY_VERSION,
    Before,
    Placement,
    Release,
    Releases,
    Since,
    Until,
    check_supported,
    parse,
    place,
    release,
    releases_of,
)

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
    "check_installed",
    "check_supported",
    "checkout_recipe",
    "checkout_version",
    "constraints_file",
    "install_recipe",
    "installed",
    "installed_placement",
    "installed_profile",
    "installed_source",
    "installed_system",
    "installed_unified_profile",
    "installed_version",
    "parse",
    "place",
    "release",
    "releases_of",
]


IMPORTS: Final[tuple[str, ...]] = (
    "numpy", "triton", "transformers", "tokenizers", "xgrammar", "compressed-tensors", "openai", "orjson",
    "psutil", "pybase64", "requests", "packaging", "pillow", "starlette", "msgspec", "pyzmq", "tqdm",
    "ipython", "pydantic", "aiohttp", "dill", "gguf", "partial-json-parser", "sentencepiece",
    "apache-tvm-ffi", "einops",
)  # fmt: skip
"""What the HiCache modules of the supported releases (and the calls the adapters make) import beside torch:
each added because an import failed without it in a fresh venv; pinned per release by its constraints file."""

RELEASE_IMPORTS: Final[dict[str, tuple[str, ...]]] = {
    # srt/utils/common.py imports it at module level (0.5.8 on: no longer)
    "0.5.3": ("fastapi",),
    "0.5.4": ("fastapi",),
    "0.5.5": ("fastapi",),
    "0.5.6": ("fastapi",),
    "0.5.7": ("fastapi",),
}
"""What a release's HiCache modules import beyond ``IMPORTS`` (each added because an import failed without it in
that release's fresh venv), pinned by its constraints file like the rest."""

TOOLS: Final[tuple[str, ...]] = (
    "hypothesis>=6.150", "typer>=0.12", "rich>=13", "pytest>=8", "pytest-xdist>=3.5",
)  # fmt: skip
"""refcache's own dependencies and the test runner (refcache itself goes in with ``--no-deps``)."""

TORCH: Final = "torch==2.13.0"
"""Every release runs on the one CPU torch this machine has (the releases pin CUDA builds)."""


def constraints_file(version: str) -> str:
    """The constraints file (relative to the repository root) that pins ``version``'s imports: its row's
    (a post release's is its base release's, a checkout newer than the newest release the newest's)."""
    return f"constraints/sglang-{release(version).version}.txt"


def install_recipe(version: str) -> tuple[tuple[str, ...], ...]:
    """The pip argument lists, in order, that build a virtualenv for SGLang ``version``, run in the repository
    root: the CPU torch first; what the release imports (``IMPORTS``, ``RELEASE_IMPORTS``), pinned by its
    constraints file; refcache's tools; refcache itself (``--no-deps -e .``); the SGLang wheel ``--no-deps`` last (its own dependencies are the GPU
    stack; nothing is installed after a ``--no-deps`` install, ``noxfile._NO_DEPS_LAST``). Raises
    ``UnsupportedError`` for a release no row drives, and for a source checkout's version
    (``checkout_recipe`` builds one)."""
    check_supported(version)
    return _recipe(version, (f"sglang=={version}",))


def _recipe(version: str, sglang: tuple[str, ...]) -> tuple[tuple[str, ...], ...]:
    pins, row = constraints_file(version), release(version).version
    return (
        (TORCH,),
        ("-c", pins, *IMPORTS, *RELEASE_IMPORTS.get(row, ())),
        ("-c", pins, *TOOLS),
        ("--no-deps", "-e", "."),
        ("--no-deps", *sglang),
    )


def checkout_version(directory: str | os.PathLike[str]) -> str:
    """The version a source tree of SGLang installs as, read without building it: ``directory`` is the
    checkout's ``python/`` folder (or the checkout, which has it) or an unpacked sdist. Its ``PKG-INFO``
    (an sdist), else the static ``version`` of its ``pyproject.toml``, else the ``sglang/_version.py`` a
    build left (SGLang's version is setuptools-scm's, from git: ``0.5.24.dev3+gabc123`` on main). Raises
    ``UsageError`` naming the directory when it holds no SGLang source tree or no version is found."""
    root = _python_dir(directory)
    pkg_info = root / "PKG-INFO"
    if pkg_info.is_file():
        for line in pkg_info.read_text(encoding="utf-8").splitlines():
            if line.startswith("Version:"):
                return line.partition(":")[2].strip()
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8")).get("project", {})
    if isinstance(project.get("version"), str):
        return str(project["version"])
    written = root / "sglang" / "_version.py"
    if written.is_file():
        found = re.search(
            r"^__version__\s*=\s*(?:version\s*=\s*)?['\"]([^'\"]+)['\"]", written.read_text(), re.M
        )
        if found is not None:
            return found.group(1)
    raise UsageError(
        f"{root}: no version found (no PKG-INFO, no static version in pyproject.toml, no sglang/_version.py); "
        "build it once (pip install --no-deps -e DIR/python) or set SETUPTOOLS_SCM_PRETEND_VERSION"
    )


def _python_dir(directory: str | os.PathLike[str]) -> Path:
    root = Path(directory).resolve()
    if not (root / "pyproject.toml").is_file() and (root / "python" / "pyproject.toml").is_file():
        root = root / "python"
    if not (root / "pyproject.toml").is_file() or not (root / "sglang").is_dir():
        raise UsageError(
            f"{directory} is not an SGLang source tree: give the checkout (with python/pyproject.toml) or its "
            "python/ folder, or an unpacked sdist"
        )
    return root


def checkout_recipe(directory: str | os.PathLike[str]) -> tuple[tuple[str, ...], ...]:
    """``install_recipe`` for a source tree of SGLang (``checkout_version``): the same steps, pinned by the
    constraints file of the row that will drive it (``place``: its release's, or the newest release's for
    main), and the tree itself installed ``--no-deps -e`` last. Raises ``UnsupportedError`` when its version
    cannot be placed, ``UsageError`` when it is no source tree."""
    root = _python_dir(directory)
    placed = place(checkout_version(root), source=str(root))
    return _recipe(placed.rows if placed.kind != "main" else placed.row.version, ("-e", str(root)))


def installed_version() -> str:
    """The installed SGLang's version. Raises ``UsageError`` when none is installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError as error:
        raise UsageError("SGLang is not installed here (nox -s sglang, or nox -s sglang_releases)") from error


def installed_source() -> str | None:
    """The directory the installed SGLang was installed from, where it is a source tree
    (``pip install -e DIR/python``, ``pip install DIR``: PEP 610's ``direct_url.json`` with ``dir_info``);
    None for a wheel from an index, and where SGLang is not installed (``installed_version`` says so)."""
    try:
        text = metadata.distribution("sglang").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    if not text:
        return None
    found = json.loads(text)
    if not isinstance(found, dict) or "dir_info" not in found or not isinstance(found.get("url"), str):
        return None
    return unquote(urlparse(found["url"]).path)


def installed() -> Placement:
    """The placement of the installed SGLang (``place``): its version and the checkout it comes from. Raises
    ``UnsupportedError`` where it cannot be placed, ``UsageError`` when SGLang is not installed."""
    return place(installed_version(), source=installed_source())


def installed_placement() -> tuple[str, str]:
    """(the release the installed SGLang's rows and known findings are read at, its placement in words, ""
    for a release as published): ``SystemEntry.placement`` of the SGLang systems (``refcache.systems``), e.g.
    ("0.5.23", "SGLang main (0.5.24.dev3+gabc123), driven with 0.5.23's rows"). Raises ``UnsupportedError``
    where it cannot be placed, ``UsageError`` when SGLang is not installed."""
    placed = installed()
    plain = placed.kind == "release" and placed.source is None and "+" not in placed.installed
    return placed.rows, "" if plain else str(placed)


def installed_system() -> str:
    """The system name of the adapter for the installed SGLang: the environment variable
    ``REFCACHE_SGLANG_SYSTEM`` where set (one of the release's ``Release.systems``, e.g. ``sglang-unified`` on
    0.5.20), else the release's default. Raises ``UnsupportedError`` for a release no row drives (naming the
    supported ones) or a chosen system that does not drive it."""
    row = installed().row
    chosen = os.environ.get("REFCACHE_SGLANG_SYSTEM")
    if not chosen:
        return row.system
    chosen = ALIASES.get(chosen, chosen)
    if chosen not in row.systems:
        raise UnsupportedError(
            f"REFCACHE_SGLANG_SYSTEM={chosen!r} does not drive SGLang {row.version}: "
            f"{', '.join(row.systems)} do"
        )
    return chosen


def check_installed(system: str, *, tp_size: int, storage: bool) -> Release:
    """The row of the installed SGLang, checked to be driven by ``system`` with ``tp_size`` ranks and (when
    ``storage``) L3; the adapters call it before importing anything of SGLang. Raises ``UnsupportedError``
    naming the release and what drives it, ``UsageError`` when SGLang is not installed."""
    row = installed().row
    system = ALIASES.get(system, system)
    if system not in row.systems:
        raise UnsupportedError(
            f"SGLang {row.version} is driven by the system {' or '.join(map(repr, row.systems))}, not "
            f"{system!r} (releases of {system!r}: {', '.join(releases_of(system)) or 'none'})"
        )
    ranks = row.ranks_on(system)
    if tp_size not in ranks:
        raise UnsupportedError(
            f"tp_size={tp_size}: {system!r} opens SGLang {row.version} with tp_size "
            f"{', '.join(map(str, ranks))} (specs/sglang-adapter.md, 'Releases')"
        )
    if storage and not row.l3_on(system):
        raise UnsupportedError(
            f"L3: {system!r} does not drive SGLang {row.version}'s storage pipeline; it drives L3 on "
            f"{', '.join(r.version for r in RELEASES if r.l3_on(system)) or 'no release'} "
            "(specs/sglang-adapter.md, 'Releases')"
        )
    if storage and tp_size not in row.l3_ranks_on(system):
        raise UnsupportedError(
            f"tp_size={tp_size} with L3: {system!r} opens SGLang {row.version}'s L3 with tp_size "
            f"{', '.join(map(str, row.l3_ranks_on(system)))}; two ranks with L3 on "
            f"{', '.join(r.version for r in RELEASES if tp_size in r.l3_ranks_on(system)) or 'no release'} "
            "(specs/sglang-adapter.md, 'Releases')"
        )
    return row


def installed_unified_profile() -> str:
    """The profile the UnifiedRadixCache system (``sglang-unified``) follows on the installed release:
    ``sglang-X.Y.Z`` where it is the release's default system, ``sglang-X.Y.Z-unified`` where the default drives
    HiRadixCache (``refcache.config.FOLLOWED_BY_UNIFIED``). Raises ``UnsupportedError`` for a release no row
    drives."""
    row = installed().row
    return f"sglang-{row.version}" if row.system == "sglang-unified" else f"sglang-{row.version}-unified"


def installed_profile() -> str:
    """The profile (``refcache.config.PROFILES``) of the installed release, ``sglang-X.Y.Z``: what the SGLang
    systems follow (``SystemEntry.follows``). Raises ``UnsupportedError`` for a release no row drives."""
    return installed().profile
