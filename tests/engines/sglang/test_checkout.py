"""The installed SGLang placed as it was installed (``versions.installed``, specs/sglang-adapter.md, "Post
releases and source checkouts"): a release on its row, a post release on its base's, a source checkout
(``pip install --no-deps -e DIR``) named by its directory, whose tree is the one imported, and newer than the
newest release driven as main with that release's row. A replay over the model and the placed system runs
clean and says where it was placed. ``nox -s sglang_releases -- --checkout DIR`` runs it on a checkout."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Final

import pytest

from refcache.config import HiCacheConfig
from refcache.engines.sglang import versions
from refcache.hicache.ops import Evict, FinishRequest, MatchPrefix, Op, StartRequest
from refcache.hicache.trace import write_trace

from .sglang_machines import SGLANG

PLACED: Final = versions.installed()
ROOT: Final = Path(__file__).resolve().parents[3]


def test_the_installed_sglang_is_placed_as_it_was_installed() -> None:
    version = versions.installed_version()
    assert PLACED.installed == version
    assert PLACED.source == versions.installed_source()
    if PLACED.kind == "release":
        assert PLACED.row.version == version.partition("+")[0] == PLACED.rows
    elif PLACED.kind == "post":
        assert version.startswith(f"{PLACED.row.version}.post") and PLACED.rows == version.partition("+")[0]
    else:  # main: newer than every release, driven with the newest one's row
        assert PLACED.row == versions.RELEASES[-1] and PLACED.rows == PLACED.row.version
        assert tuple(int(part) for part in version.split(".")[:3]) >= versions.parse(PLACED.row.version)
    assert SGLANG in PLACED.row.systems
    assert versions.installed_placement() == (
        PLACED.rows,
        "" if PLACED.kind == "release" and PLACED.source is None and "+" not in version else str(PLACED),
    )


@pytest.mark.skipif(PLACED.source is None, reason="SGLang is installed from a wheel, not a source tree")
def test_a_checkout_is_the_tree_that_is_imported() -> None:
    assert PLACED.source is not None
    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None
    assert Path(spec.origin).resolve().is_relative_to(Path(PLACED.source).resolve()), (spec.origin, PLACED)


def test_a_replay_on_the_placed_release_runs_clean_and_says_where_it_was_placed(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    ops: list[Op] = [
        StartRequest(1, (1, 2, 3, 4)),
        FinishRequest(1),
        MatchPrefix((1, 2, 3)),
        Evict(4),
        MatchPrefix((1, 2)),
    ]
    write_trace(trace, HiCacheConfig(device_size=16).resolve(), ops)
    environment = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "refcache.cli", "replay", str(trace), "--against", f"model,{SGLANG}", "-q"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    words = versions.installed_placement()[1]
    assert (f"replay: {words}" in done.stderr) == bool(words), done.stderr
