"""The loader of the optional C fast paths (``refcache.gpu.native``): build, cache, modes and failures."""

from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from refcache.gpu import native

_ADD = "int add(int a, int b) { return a + b + OFFSET; }\n#ifndef OFFSET\n#error OFFSET\n#endif\n"


@pytest.fixture
def sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A source directory holding ``probe.c``, an empty build cache and no memo of earlier loads."""
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "probe.c").write_text(_ADD)
    monkeypatch.setattr(native, "_SOURCES", src)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.delenv(native.NATIVE_ENV, raising=False)
    monkeypatch.delenv("CC", raising=False)
    return src


def _add(lib: ctypes.CDLL | None, a: int, b: int) -> int:
    assert lib is not None
    return int(lib.add(a, b))


def test_a_library_builds_once_and_each_variant_apart(sources: Path, tmp_path: Path) -> None:
    assert _add(native.load("probe", defines={"OFFSET": 0}), 2, 3) == 5
    assert _add(native.load("probe", defines={"OFFSET": 100}), 2, 3) == 105  # a variant: its own build
    built = sorted((tmp_path / "cache").glob("probe-*.so"))
    assert len(built) == 2
    native._loaded.clear()  # another process: the cached files load without a compiler
    stamps = [p.stat().st_mtime_ns for p in built]
    assert _add(native.load("probe", defines={"OFFSET": 0}), 1, 1) == 2
    assert [p.stat().st_mtime_ns for p in built] == stamps
    assert not list((tmp_path / "cache").glob(".probe-*"))  # no temporary file left behind


def test_an_edited_source_is_built_again(sources: Path) -> None:
    assert _add(native.load("probe", defines={"OFFSET": 0}), 1, 1) == 2
    (sources / "probe.c").write_text(_ADD.replace("a + b", "a * b"))
    native._loaded.clear()
    assert _add(native.load("probe", defines={"OFFSET": 0}), 3, 4) == 12


def test_off_loads_nothing(sources: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "off")
    assert native.load("probe", defines={"OFFSET": 0}) is None
    assert native.why_not("probe") == "REFCACHE_NATIVE=off"
    assert not (tmp_path / "cache").exists()


def test_a_failed_build_falls_back_in_auto_and_raises_in_require(
    sources: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert native.load("probe") is None  # OFFSET undefined: the source's #error
    assert "failed on probe.c" in (native.why_not("probe") or "")
    assert "OFFSET" in (native.why_not("probe") or "")
    monkeypatch.setenv(native.NATIVE_ENV, "require")
    with pytest.raises(native.NativeUnavailable, match="'probe' is unavailable"):
        native.load("probe")


def test_no_compiler(sources: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert native.load("probe", defines={"OFFSET": 0}) is None
    assert "no C compiler" in (native.why_not("probe") or "")


def test_a_bad_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "sometimes")
    with pytest.raises(ValueError, match="REFCACHE_NATIVE='sometimes' is not one of auto, off, require"):
        native.mode()


# every build a source documents: the default and each variant its header names
_VARIANTS: dict[str, tuple[list[str], ...]] = {
    "oracle": ([], ["-DORACLE_SIMD=0"]),
    "transfer": ([], ["-DRC_STREAM_MIN=0"]),
}


def test_every_source_has_its_builds_listed() -> None:
    assert sorted(p.stem for p in native._SOURCES.glob("*.c")) == sorted(_VARIANTS)


@pytest.mark.parametrize(
    ("name", "defines"), [(name, d) for name, builds in sorted(_VARIANTS.items()) for d in builds], ids=str
)
def test_each_build_compiles_without_a_warning(name: str, defines: list[str]) -> None:
    """Users' builds do not use -Werror (native.FLAGS); the sources are held to it here instead."""
    compiler = shlex.split(os.environ.get("CC") or "cc")
    if shutil.which(compiler[0]) is None:
        pytest.skip(f"no C compiler ({compiler[0]})")
    done = subprocess.run(
        [
            *compiler,
            "-fsyntax-only",
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            *defines,
            str(native.source(name)),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
