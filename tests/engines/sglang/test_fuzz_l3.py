"""``refcache fuzz --against model,sglang --hicache-storage-backend file``: the command line's L3 rows on
SGLang (specs/sglang-adapter.md, "L3"), and an L3 trace replayed there."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.cli import app
from refcache.config import PROFILES
from refcache.engines.sglang import versions
from refcache.hicache.trace import write_trace
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG
from .test_l3 import A, config, prefetch, to_l3


def test_fuzz_with_l3_runs_sglangs_storage_and_its_traces_replay(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    against = f"model,{SGLANG}"
    profile = SYSTEMS[SGLANG].followed()  # sglang-0.5.20, or sglang-0.5.20-unified for sglang-unified
    assert profile is not None
    fuzz = ["fuzz", "--against", against, "--hicache-storage-backend", "file", "--profile", profile]
    # sglang-unified draws write_back too, where U-1 is known (specs/sglang-known.json)
    fuzz += ["--known", str(Path(__file__).resolve().parents[3] / "specs" / "sglang-known.json")]
    result = CliRunner().invoke(app, [*fuzz, "--examples", "10", "--batch", "3", "--steps", "30"])
    if not versions.installed().row.l3_on(SGLANG):  # no L3 here: refused up front
        assert result.exit_code == 2 and "--hicache-storage-backend" in result.output, result.output
        return
    assert result.exit_code == 0, result.output
    # Fuzz draws afresh on every run: 10 examples draw about 7 storage faults (4 in 697 steps of 6 examples
    # measured), so none at all is a ~0.1% event, where 6 examples missed them about once in fifty runs.
    for reached in ("PrefetchFromStorage:admitted", "CheckPrefetchProgress", "StorageFault"):
        assert reached in result.output, result.output  # both machines ran L3 on SGLang
    assert "explained by" not in result.output  # under the release's profile no decision is needed

    trace = tmp_path / "l3.jsonl"
    write_trace(
        trace,
        config(1, storage_batch_size=4).with_fidelity(PROFILES[profile]),
        [*to_l3(A), *prefetch(A)],
    )
    for systems in (against, SGLANG):
        replay = CliRunner().invoke(app, ["replay", str(trace), "--against", systems, "--quiet"])
        assert replay.exit_code == 0 and "no divergence" in replay.output, replay.output


def test_the_registry_knows_what_the_adapters_l3_runs() -> None:
    from refcache.engines.sglang._adapter import STORAGE_FAULTS, unsupported

    entry = SYSTEMS["sglang"]
    assert entry.fault_kinds == STORAGE_FAULTS
    fixed = {name: value for name, (value, _) in entry.with_storage.items()}
    assert unsupported(config(1, **fixed).resolve()) is None
    assert "tp_size" not in fixed and unsupported(config(1, tp_size=2).resolve()) is None  # two ranks run L3
