"""A third-party package registers its adapter through the ``refcache.systems`` entry-point group, without
touching refcache: built and installed (into a directory of its own, put on the path of the commands run
here), listed by the registry and fuzzed by ``refcache fuzz --against model,toy``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).parent

PYPROJECT = """\
[build-system]
requires = ["setuptools>=69"]
build-backend = "setuptools.build_meta"

[project]
name = "refcache-toy"
version = "0.0.1"

[project.entry-points."refcache.systems"]
toy = "refcache_toy:ENTRY"

[tool.setuptools]
py-modules = ["refcache_toy"]
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The toy engine as a package (its module is tests/conformance/toy_engine.py), installed into a new
    directory; the environment that puts it on the path."""
    root = tmp_path_factory.mktemp("plugin")
    source = root / "src"
    source.mkdir()
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "refcache_toy.py").write_text((HERE / "toy_engine.py").read_text())
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True,
    )  # fmt: skip
    assert any(p.name.startswith("refcache_toy-0.0.1.dist-info") for p in target.iterdir())
    path = os.pathsep.join([str(target), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "REFCACHE_TRACE_DIR": str(root / "traces")}


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from refcache.cli import main; main(sys.argv[1:])"
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600
    )


def test_the_registry_lists_the_plugin(plugin: dict[str, str]) -> None:
    code = (
        "from refcache.systems import SYSTEMS; e = SYSTEMS['toy']; "
        "print(sorted(SYSTEMS)); print(e.family, sorted(e.answers or ()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=plugin, capture_output=True, text=True, check=True
    ).stdout
    assert "'toy'" in out and "'model'" in out
    assert "hicache" in out and "PrefetchFromStorage" not in out and "StartRequest" in out


def test_refcache_fuzz_drives_the_plugin(plugin: dict[str, str]) -> None:
    result = run(plugin, "fuzz", "--against", "model,toy", "--examples", "12", "--shrink-seconds", "0")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PrefetchFromStorage" not in result.stdout  # the toy does not answer it: never drawn


def test_a_planted_bug_in_the_plugin_is_a_finding(plugin: dict[str, str]) -> None:
    result = run({**plugin, "REFCACHE_TOY_BUG": "1"}, "fuzz", "--against", "model,toy", "--examples", "60",
                 "--shrink-seconds", "20")  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert "refcache replay" in result.stdout + result.stderr


def test_a_plugin_that_takes_a_name_refcache_has_is_refused(tmp_path: Path) -> None:
    site = tmp_path / "site"
    info = site / "bad_plugin-1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: bad-plugin\nVersion: 1\n")
    (info / "entry_points.txt").write_text("[refcache.systems]\nmodel = bad_plugin:ENTRY\n")
    code = textwrap.dedent("""\
        from refcache.systems import SYSTEMS
        try:
            'nothing' in SYSTEMS
        except Exception as error:
            print(type(error).__name__, error)
        """)
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "UsageError" in out and "a system named 'model' exists already" in out and "bad-plugin" in out
