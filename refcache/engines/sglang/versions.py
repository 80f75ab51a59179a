"""Which adapter drives the installed SGLang: one registry entry per supported release
(``refcache.systems.SYSTEMS``), chosen by the installed distribution's version (nothing is imported).

0.5.20 has ``HiRadixCache`` (``_adapter.SGLangSystem``, system ``sglang``); 0.5.23 replaced it by
``UnifiedRadixCache`` (``_unified.UnifiedSGLangSystem``, system ``sglang-0.5.23``). Each release is pinned by
``constraints/sglang-<version>.txt`` and installed by its nox session (``sglang``, ``sglang_latest``).
"""

from __future__ import annotations

from importlib import metadata
from typing import Final

from refcache.errors import UsageError

__all__ = ["SYSTEM_BY_VERSION", "installed_system", "installed_version"]

SYSTEM_BY_VERSION: Final[dict[str, str]] = {"0.5.20": "sglang", "0.5.23": "sglang-0.5.23"}
"""SGLang release -> the registered system that drives it."""


def installed_version() -> str:
    """The installed SGLang's version. Raises ``UsageError`` when none is installed."""
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError as error:
        raise UsageError("SGLang is not installed here (nox -s sglang, or nox -s sglang_latest)") from error


def installed_system() -> str:
    """The system name of the adapter for the installed SGLang. Raises ``UsageError`` for a release no
    adapter drives."""
    version = installed_version()
    if version not in SYSTEM_BY_VERSION:
        known = ", ".join(SYSTEM_BY_VERSION)
        raise UsageError(f"no adapter drives SGLang {version} (adapters: {known})")
    return SYSTEM_BY_VERSION[version]
