"""Optional C fast paths for CPU tensors: compiled on first use, loaded with ctypes, torch otherwise.

Some of the data plane's CPU work is many small torch or numpy calls whose fixed cost (microseconds each)
outweighs the bytes they move: the content oracle's checks and stores, the direct backend's transfer
planning and its per-block copy loop. For these, ``refcache/gpu/csrc/NAME.c`` holds a plain C version
(no Python or torch headers: it takes raw pointers and lengths). ``load(NAME)`` compiles it once with the
system C compiler into a user cache and returns the ``ctypes.CDLL``, or None; every caller keeps its torch
path, which is what runs on GPU tensors, when ``load`` returns None, and what the tests compare the C
path with (specs/data-plane.md, "Native fast paths").

* ``REFCACHE_NATIVE``: ``auto`` (the default) uses C when a compiler is there and falls back quietly
  otherwise; ``off`` (or ``0``) never compiles or loads anything; ``require`` (what CI sets) raises
  ``NativeUnavailable`` instead of falling back, so a run that should test the C paths cannot quietly test
  only the torch ones. Any other value is a ``ValueError``.
* The compiler is ``$CC``, else ``cc``; the flags are fixed (``FLAGS``). The cache is
  ``$REFCACHE_NATIVE_CACHE``, else ``$XDG_CACHE_HOME/refcache/native``, else ``~/.cache/refcache/native``;
  a library's file name carries a hash of its source, the flags, the defines and the machine, so an edited
  source or another machine never loads a stale build. A build is written to a temporary file and renamed
  into place, so parallel test workers building the same library at once each load a whole file.
* ``defines`` (``-DNAME=VALUE``) build a variant: the tests use it to compile deliberately broken C and show
  that they fail on it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Final

from refcache.errors import RefcacheException

__all__ = ["FLAGS", "NATIVE_ENV", "NativeUnavailable", "load", "mode", "source", "why_not"]

NATIVE_ENV: Final = "REFCACHE_NATIVE"
CACHE_ENV: Final = "REFCACHE_NATIVE_CACHE"
# no -Werror: a newer compiler's new warning must not turn into a fallback (tests/gpu/test_native.py holds the
# sources to -Wall -Wextra -Werror with this machine's compiler)
FLAGS: Final = ("-O2", "-std=c11", "-shared", "-fPIC", "-fno-strict-aliasing", "-Wall")
_MODES: Final = {"auto": "auto", "": "auto", "1": "auto", "off": "off", "0": "off", "require": "require"}
_SOURCES: Final = Path(__file__).resolve().parent / "csrc"

_lock = threading.Lock()
_loaded: dict[tuple[str, tuple[tuple[str, int], ...]], ctypes.CDLL | None] = {}
_why_not: dict[str, str] = {}


class NativeUnavailable(RefcacheException, RuntimeError):
    """Raised by ``load`` under ``REFCACHE_NATIVE=require`` when a C library could not be built or loaded (the
    message says why: no compiler, a failed build, a library that does not load). Install a C compiler, or
    run under ``auto`` (the torch path where the C path is unavailable)."""


def mode() -> str:
    """``auto``, ``off`` or ``require``, from ``REFCACHE_NATIVE`` (read on every call)."""
    raw = os.environ.get(NATIVE_ENV, "").strip().lower()
    if raw not in _MODES:
        raise ValueError(f"{NATIVE_ENV}={raw!r} is not one of auto, off, require")
    return _MODES[raw]


def source(name: str) -> Path:
    """The C source of library ``name``."""
    return _SOURCES / f"{name}.c"


def why_not(name: str) -> str | None:
    """Why the last ``load(name)`` returned None (None when it did not, or was not called)."""
    return _why_not.get(name)


def load(name: str, *, defines: Mapping[str, int] = {}) -> ctypes.CDLL | None:
    """Library ``name`` (``csrc/NAME.c``) built with ``defines``, or None when ``REFCACHE_NATIVE=off``, no
    compiler runs or the build fails (``why_not(name)`` says which; ``require`` raises instead). Built once
    per process and cached on disk across processes."""
    how = mode()
    if how == "off":
        _why_not[name] = f"{NATIVE_ENV}=off"
        return None
    key = (name, tuple(sorted(defines.items())))
    with _lock:
        if key not in _loaded:
            try:
                _loaded[key] = ctypes.CDLL(str(_build(name, dict(key[1]))))
                _why_not.pop(name, None)
            except (OSError, subprocess.SubprocessError) as error:
                _loaded[key] = None
                _why_not[name] = str(error)
        lib = _loaded[key]
    if lib is None and how == "require":
        raise NativeUnavailable(
            f"the C library {name!r} is unavailable ({NATIVE_ENV}=require): {_why_not[name]}"
        )
    return lib


def _cache_dir() -> Path:
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "refcache" / "native"


def _build(name: str, defines: dict[str, int]) -> Path:
    """The path of the built library (building it when the cache lacks it)."""
    src = source(name)
    text = src.read_bytes()
    compiler = shlex.split(os.environ.get("CC") or "cc")
    args = [*FLAGS, *(f"-D{k}={v}" for k, v in sorted(defines.items()))]
    digest = hashlib.sha256(
        b"\0".join(
            [
                text,
                " ".join(compiler + args).encode(),
                platform.machine().encode(),
                platform.system().encode(),
            ]
        )
    ).hexdigest()[:16]
    directory = _cache_dir()
    target = directory / f"{name}-{digest}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run(
            [*compiler, *args, "-o", tmp, str(src)], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise subprocess.SubprocessError(
                f"{' '.join(compiler)} failed on {src.name} (exit {done.returncode}): {done.stderr.strip()[-2000:]}"
            )
        os.replace(tmp, target)
    except FileNotFoundError as error:
        raise subprocess.SubprocessError(f"no C compiler ({' '.join(compiler)}): {error}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
