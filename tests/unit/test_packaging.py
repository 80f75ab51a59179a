"""What a built distribution carries: the wheel and the sdist hold the bundled trace with its attribution,
and ``bundled_trace()`` finds it from the installed wheel (not from this checkout)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent
DATA_FILES = (
    "refcache/data/mooncake_conversation_trace.jsonl.gz",
    "refcache/data/README.md",
    "refcache/data/LICENSE-Apache-2.0.txt",
)


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A wheel and an sdist built from a copy of the project's packaging inputs (setuptools' backend, as
    ``pip install .`` runs it, without build isolation: no index needed)."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "refcache", source / "refcache", ignore=shutil.ignore_patterns("__pycache__"))
    out = source / "dist"
    built = []
    for hook in ("build_wheel", "build_sdist"):  # one process each: the backend keeps state between hooks
        build = f"import sys; from setuptools import build_meta as b; print('BUILT', b.{hook}(sys.argv[1]))"
        done = subprocess.run(
            [sys.executable, "-c", build, str(out)], cwd=source, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-3000:]
        # the backend prints its own log on stdout too; the last line is ours
        mark, name = done.stdout.splitlines()[-1].split()
        assert mark == "BUILT", done.stdout[-3000:]
        built.append(name)
    wheel, sdist = built
    return out / wheel, out / sdist


def test_the_wheel_and_the_sdist_carry_the_trace_and_its_attribution(dists: tuple[Path, Path]) -> None:
    wheel, sdist = dists
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    with tarfile.open(sdist) as archive:
        top = sdist.name.removesuffix(".tar.gz")
        in_sdist = {name.removeprefix(f"{top}/") for name in archive.getnames()}
    for name in DATA_FILES:
        assert name in in_wheel, f"{name} missing from the wheel"
        assert name in in_sdist, f"{name} missing from the sdist"


def test_bundled_trace_is_found_in_the_installed_wheel(dists: tuple[Path, Path], tmp_path: Path) -> None:
    wheel, _ = dists
    installed = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(installed)  # a wheel's install is its files unpacked into site-packages
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); import refcache; "
        "from refcache.sim.mooncake import bundled_trace, read_mooncake_trace; "
        "assert refcache.__file__.startswith(sys.argv[1]), refcache.__file__; "
        "path = bundled_trace(); print(path); print(len(read_mooncake_trace(path, limit=50)))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(installed)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    path, count = done.stdout.split()
    assert Path(path).is_relative_to(installed) and count == "50"
