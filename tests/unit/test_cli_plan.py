"""``refcache.check.plan``: what the options mean is read from the systems' registry entries, never from
their names (#25 item 3), and the plan is plain typed data."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from refcache.check.plan import (
    ConfigOverrides,
    PlanError,
    check_installed,
    fuzz_constraints,
    fuzz_plan,
    recording_fidelity,
)
from refcache.config import PROFILES, WritePolicy
from refcache.systems import SYSTEMS, SystemEntry


@pytest.fixture
def stickler(monkeypatch: pytest.MonkeyPatch) -> str:
    """A system that, like the implementation, does not follow D-01 with L3 — under another name."""
    entry = SystemEntry(
        "a model that keeps refcache's prefetch pipeline",
        "refcache.model:HiCacheModel",
        unfollowed_with_storage={"allocate_prefetch_after_query": "D-01: a pipeline it does not have"},
    )
    monkeypatch.setitem(SYSTEMS, "stickler", entry)
    return "stickler"


def test_a_profile_a_system_does_not_follow_with_l3_is_refused_by_its_entry(stickler: str) -> None:
    with pytest.raises(PlanError, match=r"D-01: a pipeline.*which stickler \(.*\) does not follow with L3"):
        fuzz_constraints(("model", stickler), ConfigOverrides(), "sglang-0.5.20")
    without_l3 = fuzz_constraints(("model", stickler), ConfigOverrides(without_storage=True), "sglang-0.5.20")
    assert (
        without_l3["allocate_prefetch_after_query"] is True and without_l3["hicache_storage_backend"] is None
    )
    assert fuzz_constraints(("model",), ConfigOverrides(), "sglang-0.5.20")  # the model follows every profile


def test_a_profile_of_another_release_than_the_engine_follows_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model under 0.5.22's profile against an engine that behaves as 0.5.21: neither a bug nor a decision
    would explain what differs. The engine's own profile and refcache's are taken."""
    entry = SystemEntry("an engine at 0.5.21", "refcache.model:HiCacheModel", follows="sglang-0.5.21")
    monkeypatch.setitem(SYSTEMS, "older", entry)
    with pytest.raises(
        PlanError, match=r"--profile sglang-0\.5\.22 .* older, which behaves as sglang-0\.5\.21"
    ):
        fuzz_constraints(("model", "older"), ConfigOverrides(without_storage=True), "sglang-0.5.22")
    assert fuzz_constraints(("model", "older"), ConfigOverrides(without_storage=True), "sglang-0.5.21")
    assert fuzz_constraints(("model", "older"), ConfigOverrides(without_storage=True), "refcache")


def test_the_implementation_is_refused_as_before_because_of_its_entry() -> None:
    with pytest.raises(PlanError, match=r"which impl \(.*\) does not follow with L3"):
        fuzz_constraints(("model", "impl"), ConfigOverrides(), "sglang-0.5.20")
    renamed = dataclasses.replace(SYSTEMS["impl"], unfollowed_with_storage={})
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(SYSTEMS, "impl", renamed)
        assert fuzz_constraints(("model", "impl"), ConfigOverrides(), "sglang-0.5.20")


def test_a_known_finding_lifts_the_l3_row_it_is_the_reason_for_and_only_that_one() -> None:
    """``sglang`` runs L3 with write_through only because of F1; a run whose --known list names F1 (either
    face) may draw or choose write_back, and one whose list names other findings is refused as before (#26)."""
    write_back = ConfigOverrides(hicache_storage_backend="file", hicache_write_policy=WritePolicy.WRITE_BACK)
    systems = ("model", "sglang")
    with pytest.raises(
        PlanError, match=r"runs only with hicache_write_policy=write_through: .*F1 lifts this"
    ):
        fuzz_constraints(systems, write_back, "refcache")
    with pytest.raises(PlanError, match="runs only with hicache_write_policy=write_through"):
        fuzz_constraints(systems, write_back, "refcache", known=("sglang-R1-l3-key-ignores-namespace",))
    for f1 in SYSTEMS["sglang"].with_storage_unless_known["hicache_write_policy"]:
        lifted = fuzz_constraints(
            systems, write_back, "refcache", known=(f1, "sglang-R2-load-back-host-copy-evicted")
        )
        assert lifted["hicache_write_policy"] is WritePolicy.WRITE_BACK
        drawn = fuzz_constraints(
            systems, ConfigOverrides(hicache_storage_backend="file"), "refcache", known=(f1,)
        )
        assert "hicache_write_policy" not in drawn  # drawn per example, every policy
    fixed = fuzz_constraints(systems, ConfigOverrides(hicache_storage_backend="file"), "refcache")
    assert fixed["hicache_write_policy"] is WritePolicy.WRITE_THROUGH
    known = {f["id"] for f in json.loads(Path("specs/sglang-known.json").read_text())["findings"]}
    # every face of F1 the list holds lifts it (each era's: at the drain, at progress, before 0.5.16)
    assert set(SYSTEMS["sglang"].with_storage_unless_known["hicache_write_policy"]) == {
        i for i in known if i.startswith("sglang-F1-")
    }


def test_a_recording_follows_its_engines_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = SystemEntry(
        "a newer engine", "refcache.model:HiCacheModel", follows="sglang-0.5.23", recorder="x:y"
    )
    monkeypatch.setitem(SYSTEMS, "newer", entry)
    assert recording_fidelity("newer") == PROFILES["sglang-0.5.23"] != PROFILES["sglang-0.5.20"]
    with pytest.raises(PlanError, match="no recorder"):
        recording_fidelity("model")


def test_check_installed_names_the_missing_package(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = SystemEntry(
        "needs a package",
        "refcache.model:HiCacheModel",
        install="pip install nope",
        requires=("no_such_pkg_xyz",),
    )
    monkeypatch.setitem(SYSTEMS, "needy", entry)
    with pytest.raises(PlanError, match=r"needs the package 'no_such_pkg_xyz'.*pip install nope"):
        check_installed(("model", "needy"))
    check_installed(("model",))


def test_the_fuzz_plan_is_typed_plain_data(tmp_path: Path) -> None:
    overrides = ConfigOverrides(hicache_write_policy=WritePolicy.WRITE_BACK, page_size=4)
    plan = fuzz_plan(
        ("model",), overrides, steps=5, examples=3, seconds=None, database=tmp_path, seed=1, jobs=2
    )
    assert plan.constraints["page_size"] == 4 and plan.family == "hicache"
    assert pickle.loads(pickle.dumps(plan)) == plan  # what every worker of --jobs gets
    with pytest.raises(PlanError, match="set no limit"):
        fuzz_plan(("model",), overrides, steps=5, examples=None, seconds=None, database=tmp_path, seed=1)
