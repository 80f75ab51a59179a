"""``refcache bisect`` over a fake engine built here, offline: wheels of a tiny package ``fakeengine`` whose
releases differ (1.0 clean, 2.0 fails otherwise, 3.0 and 4.0 crash on ``Evict``, 5.0 cannot be imported, 6.0 has
no wheel), a versions API over them, environments cached in a temporary directory. No network: every pip step
is ``--no-index`` from local wheels, and refcache's own dependencies come from this interpreter's
site-packages through a ``.pth`` that a local wheel installs."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.check.bisect import (
    MARKER,
    FailureKey,
    ReleaseResult,
    Verdict,
    bisect_releases,
    choose_releases,
    ensure_env,
    recipe_key,
    run_release,
    versions_of,
)
from refcache.cli import app
from refcache.config import HiCacheConfig
from refcache.hicache.ops import Evict, MatchPrefix, StartRequest
from refcache.hicache.trace import write_trace

RELEASES = ("1.0", "2.0", "3.0", "4.0", "5.0", "6.0")
ENGINE = "fakeengine"

MODULE = """\
from refcache.hicache.ops import Evict, MatchPrefix
from refcache.model import HiCacheModel
from refcache.systems import SystemEntry

RELEASE = {release!r}
{broken}

class FakeEngine(HiCacheModel):
    def apply(self, op):
        if RELEASE == "2.0" and isinstance(op, MatchPrefix):
            raise RuntimeError("fake bug of 2.0")
        if RELEASE in ("3.0", "4.0") and isinstance(op, Evict):
            raise RuntimeError("fake bug: evict")
        return super().apply(op)


ENTRY = SystemEntry("a fake engine", "fakeengine:FakeEngine", engine=("fakeengine", {releases!r}))
"""

VERSIONS = """\
from pathlib import Path

from refcache.errors import UnsupportedError

HERE = Path(__file__).parent
SUPPORTED = {releases!r}


def check_supported(version):
    if version not in SUPPORTED:
        raise UnsupportedError(f"fakeengine {{version}} is not supported ({{', '.join(SUPPORTED)}})")


def install_recipe(version):
    check_supported(version)
    base = HERE / "refcache_site-0-py3-none-any.whl"
    engine = HERE / f"fakeengine-{{version}}-py3-none-any.whl"
    return (("--no-index", "--no-deps", str(base), str(engine)),)  # one pip step: the test's time
"""


def wheel(path: Path, name: str, version: str, files: dict[str, str], entry_points: str = "") -> None:
    """A minimal wheel, written by hand (no build backend, no network)."""
    info = f"{name}-{version}.dist-info"
    files = {
        **files,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: refcache-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    if entry_points:
        files[f"{info}/entry_points.txt"] = entry_points
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-{version}-py3-none-any.whl", "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)


@pytest.fixture(scope="module")
def fake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheels and the versions API ``fakeengine_versions`` in one directory (on ``sys.path``)."""
    where = tmp_path_factory.mktemp("fakeengine")
    site = "\n".join(p for p in sys.path if p.endswith("site-packages")) + "\n"
    wheel(where, "refcache_site", "0", {"refcache_site.pth": site})
    for release in RELEASES[:-1]:  # 6.0: no wheel (install fails)
        broken = "import fakeengine_missing_dependency" if release == "5.0" else ""
        module = MODULE.format(release=release, broken=broken, releases=RELEASES)
        entry = "[refcache.systems]\nfakeengine = fakeengine:ENTRY\n"
        wheel(where, ENGINE, release, {"fakeengine/__init__.py": module}, entry)
    (where / "fakeengine_versions.py").write_text(VERSIONS.format(releases=RELEASES))
    sys.path.insert(0, str(where))
    try:
        yield where
    finally:
        sys.path.remove(str(where))
        sys.modules.pop("fakeengine_versions", None)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("trace") / "evict.jsonl"
    config = HiCacheConfig(device_size=32).resolve()
    write_trace(path, config, [StartRequest(1, (1, 2, 3)), MatchPrefix((1, 2)), Evict(8)])
    return path


def test_the_releases_asked_for(fake: Path) -> None:
    versions = versions_of(ENGINE, "fakeengine_versions")
    assert choose_releases(versions, None) == list(RELEASES)
    assert choose_releases(versions, "2.0..4.0") == ["2.0", "3.0", "4.0"]
    assert choose_releases(versions, "5.0..7.0") == ["5.0", "6.0", "7.0"]  # an end named, unsupported


def test_the_table_over_every_release_and_the_cache(
    fake: Path, cache: Path, trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_CACHE", str(cache))
    started = time.monotonic()
    cold = CliRunner().invoke(
        app,
        [
            "bisect",
            str(trace),
            "--engine",
            ENGINE,
            "--versions-module",
            "fakeengine_versions",
            "--releases",
            "1.0..7.0",
        ],
    )
    cold_seconds = time.monotonic() - started
    assert cold.exit_code == 0, cold.output
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^(\d\.0): ([a-z ]+) \(env", cold.output, re.M)}
    assert rows == {
        "1.0": "clean",
        "2.0": "different failure",
        "3.0": "same failure",
        "4.0": "same failure",
        "5.0": "cannot drive",
        "6.0": "cannot drive",
        "7.0": "cannot drive",
    }, cold.output
    assert re.search(r"^5\.0: .*fakeengine_missing_dependency", cold.output, re.M)  # import failed, and why
    assert re.search(r"^6\.0: .*install failed: step 1", cold.output, re.M)
    assert re.search(r"^7\.0: .*unsupported: fakeengine 7.0 is not supported", cold.output, re.M)
    assert "step 3: fakeengine crashed on Evict" in cold.output
    envs = sorted(p.name for p in (cache / "envs").iterdir())
    assert len(envs) == 5 and all((cache / "envs" / e / MARKER).is_file() for e in envs)  # not 6.0's half
    # warm: every environment as it was, pip never called
    monkeypatch.setattr("refcache.check.bisect._run", lambda *a: pytest.fail("pip called on a warm cache"))
    started = time.monotonic()
    warm = CliRunner().invoke(
        app,
        [
            "bisect",
            str(trace),
            "--engine",
            ENGINE,
            "--versions-module",
            "fakeengine_versions",
            "--releases",
            "1.0..5.0",
        ],
    )
    assert warm.exit_code == 0, warm.output
    assert warm.output.count(" cached, run") == 5, warm.output
    assert time.monotonic() - started < cold_seconds


def test_first_bad_binary_searches(
    fake: Path, cache: Path, trace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_CACHE", str(cache))
    versions = versions_of(ENGINE, "fakeengine_versions")
    tried: list[str] = []

    def check(release: str) -> ReleaseResult:
        tried.append(release)
        env, _built = ensure_env(ENGINE, release, versions)
        verdict, detail, failure, _raw = run_release(env, trace, ENGINE)
        return ReleaseResult(release, verdict, detail, failure)

    results, first = bisect_releases(["1.0", "2.0", "3.0", "4.0"], check, first_bad=True)
    assert first == "3.0" and tried == ["4.0", "1.0", "2.0", "3.0"]  # newest, oldest, then by halves
    assert {r.release: r.verdict for r in results}["2.0"] is Verdict.DIFFERENT  # not the failure looked for
    # the command line says the same
    result = CliRunner().invoke(
        app,
        [
            "bisect",
            str(trace),
            "--engine",
            ENGINE,
            "--versions-module",
            "fakeengine_versions",
            "--releases",
            "1.0..4.0",
            "--first-bad",
        ],
    )
    assert result.exit_code == 0 and "first bad release: 3.0" in result.output, result.output


def test_first_bad_skips_a_release_it_cannot_drive() -> None:
    bad = FailureKey(3, "x crashed", "Evict", "")
    verdicts = {
        "1": Verdict.CLEAN,
        "2": Verdict.CLEAN,
        "3": Verdict.CANNOT,
        "4": Verdict.CLEAN,
        "5": Verdict.SAME,
    }
    tried: list[str] = []

    def check(release: str) -> ReleaseResult:
        tried.append(release)
        verdict = verdicts[release]
        return ReleaseResult(release, verdict, failure=bad if verdict is Verdict.SAME else None)

    _results, first = bisect_releases(list(verdicts), check, first_bad=True)
    assert first == "5" and tried == ["5", "1", "3", "2", "4"]  # 3 skipped: its neighbours instead
    verdicts["4"] = Verdict.SAME  # 3 alone between the last good and the first bad: either may be first
    tried.clear()
    _results, first = bisect_releases(list(verdicts), check, first_bad=True)
    assert first == "3..4"


def test_the_recipe_key_follows_the_constraints_files(tmp_path: Path) -> None:
    (tmp_path / "c.txt").write_text("torch==1\n")
    recipe = (("-c", "c.txt", "numpy"),)
    before = recipe_key(recipe, tmp_path)
    assert recipe_key(recipe, tmp_path) == before
    (tmp_path / "c.txt").write_text("torch==2\n")
    assert recipe_key(recipe, tmp_path) != before
    assert recipe_key((("numpy",),), tmp_path) != before


def test_fuzz_mode_runs_each_release(fake: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REFCACHE_CACHE", str(cache))
    result = CliRunner().invoke(
        app,
        ["bisect", "--fuzz", "--minutes", "0.03", "--seed", "3", "--engine", ENGINE,
         "--versions-module", "fakeengine_versions", "--releases", "1.0..3.0"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"^1\.0: clean .*: [\d,]+ examples, [\d,]+ steps", result.output, re.M), result.output
    assert re.search(r"^3\.0: failed .*FAILED", result.output, re.M), result.output


def test_usage_errors() -> None:
    for args in (
        ["bisect"],
        ["bisect", "--fuzz", "--first-bad"],
        ["bisect", "--engine", "nothing", "--fuzz"],
        ["bisect", "--fuzz", "--fidelity", "backup_protects_passed_node_only=off"],
        ["bisect", __file__, "--fidelity", "no_such_option=off"],
        ["bisect", __file__, "--fidelity", "backup_protects_passed_node_only=maybe"],
    ):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, (args, result.output)


def test_replay_json_is_what_bisect_reads(trace: Path) -> None:
    result = CliRunner().invoke(app, ["replay", str(trace), "--against", "model", "--json"])
    assert json.loads(result.output)["verdict"] == "clean"


def test_a_trace_is_replayed_under_the_profile_its_release_follows(trace: Path, tmp_path: Path) -> None:
    from refcache.check.bisect import followed, profiled
    from refcache.config import PROFILES
    from refcache.hicache.trace import read_trace

    here = Path(sys.executable).parent.parent  # this interpreter's environment
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    assert followed(here, "model", environment) is None  # it reads the configuration
    assert followed(here, "nothing", environment) is None  # not registered there
    out = profiled(trace, "sglang-0.5.23", tmp_path / "p.jsonl")
    config, ops = read_trace(out)
    original, original_ops = read_trace(trace)
    assert ops == original_ops and config == original.with_fidelity(PROFILES["sglang-0.5.23"]) != original
    less = profiled(trace, "sglang-0.5.20", tmp_path / "q.jsonl", {"backup_protects_passed_node_only": False})
    assert PROFILES["sglang-0.5.20"]["backup_protects_passed_node_only"]  # the profile follows D-07's bug
    assert not read_trace(less)[0].backup_protects_passed_node_only  # the override wins


def test_a_new_recipe_builds_a_new_environment_and_removes_the_old(
    fake: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = versions_of(ENGINE, "fakeengine_versions")

    class Changed:
        SUPPORTED = versions.SUPPORTED
        check_supported = staticmethod(versions.check_supported)

        @staticmethod
        def install_recipe(version: str) -> tuple[tuple[str, ...], ...]:
            return tuple((*step, "--no-compile") for step in versions.install_recipe(version))

    old, built = ensure_env(ENGINE, "1.0", versions, cache=tmp_path)
    assert built and ensure_env(ENGINE, "1.0", versions, cache=tmp_path) == (old, False)
    other, _ = ensure_env(ENGINE, "2.0", versions, cache=tmp_path)
    new, built = ensure_env(ENGINE, "1.0", Changed(), cache=tmp_path)
    assert built and new != old and not old.exists() and other.exists()  # 2.0's is another release's


def test_an_environment_given_for_a_release_is_used_as_it_is(
    fake: Path, cache: Path, trace: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    versions = versions_of(ENGINE, "fakeengine_versions")
    one, _ = ensure_env(ENGINE, "1.0", versions, cache=cache / "envs")
    three, _ = ensure_env(ENGINE, "3.0", versions, cache=cache / "envs")
    empty = tmp_path / "cache"
    monkeypatch.setenv("REFCACHE_CACHE", str(empty))
    monkeypatch.setattr(
        "refcache.check.bisect._run", lambda *a: pytest.fail("pip called for a given environment")
    )
    result = CliRunner().invoke(
        app,
        ["bisect", str(trace), "--engine", ENGINE, "--versions-module", "fakeengine_versions",
         "--releases", "1.0..3.0", "--first-bad", "--env", f"1.0={one}", "--env", f"2.0={one}",
         "--env", f"3.0={three}"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert re.search(r"^1\.0: clean \(env [\d.]+ s given", result.output, re.M), result.output
    assert re.search(r"^3\.0: same failure \(env [\d.]+ s given", result.output, re.M), result.output
    # another release's environment is refused, not run (its verdict would be that release's)
    assert re.search(r"^2\.0: cannot drive .*has fakeengine 1\.0, not 2\.0", result.output, re.M), (
        result.output
    )
    assert "first bad release: one of 2.0..3.0" in result.output
    assert not empty.exists()  # nothing built
    for bad in ("9.0=" + str(one), "1.0", f"1.0={tmp_path / 'none'}"):
        refused = CliRunner().invoke(
            app,
            [
                "bisect",
                str(trace),
                "--engine",
                ENGINE,
                "--versions-module",
                "fakeengine_versions",
                "--env",
                bad,
            ],
        )
        assert refused.exit_code == 2 and "--env" in refused.output, refused.output
