"""The bug zoo on SGLang 0.5.20: each zoo bug that SGLang's code has (``sglang_zoo.SGLANG_ZOO``), patched
into SGLang's own ``HiRadixCache``, is (a) caught by the model-versus-SGLang machine under the
``sglang-0.5.20`` profile, derandomized, within the default budget, with the expected kind of divergence,
and (b) caught by replaying on the model a run of the patched engine recorded with the recorder on: over
generated operations that reach the bug (``zoo_on_sglang.SCRIPTS``; the two-rank hangs recorded up to the
operation that never returned), at the step where the model-versus-SGLang harness finds it, with the field
(or observation) the bug changes; for some bugs also over the Mooncake head trace
(``refcache.sim.record``, the driver of ``refcache record``). Every other zoo bug says why SGLang has no
counterpart the adapter runs (``sglang_zoo.NO_COUNTERPART``). The measured table is in specs/bug-zoo.md
(``measure_zoo_sglang.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from quality.zoo import ZOO

from refcache.check import budget
from refcache.check.harness import Divergence, Harness, HiCacheHarness
from refcache.check.recorded import replay_recorded
from refcache.engines.sglang import _tp
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import Op
from refcache.hicache.recording import read_recording
from refcache.sim.record import record_run
from refcache.systems import open_systems

from .sglang_zoo import NO_COUNTERPART, NOT_REACHED, NOT_RECORDED, SGLANG_ZOO
from .zoo_on_sglang import (
    BLOCK_TOKENS,
    HEAD,
    HUNT_ROWS,
    RECORD_CONFIGS,
    SCRIPTS,
    hunt_on_sglang,
    record_patched,
    record_script,
)

RECORDED_BY: dict[str, tuple[str, str]] = {
    "evict-host-never-counts": ("write_back", "snapshots differ"),
    "host-leaf-predicate-swapped": ("write_through", "snapshots differ"),
    "unlock-never-locked": ("write_back", "snapshots differ"),
}
"""Per bug: the write policy of the recorded Mooncake run that catches it and the kind of divergence (the
other counterparts' Mooncake runs replay clean: the first requests of the head trace do not reach them;
specs/bug-zoo.md)."""

REQUESTS = 60
CAUGHT = sorted(set(SGLANG_ZOO) - set(NOT_REACHED))
"""The counterparts the checks reach (``NOT_REACHED`` says why the others are not asserted)."""


def test_every_zoo_bug_has_a_counterpart_or_a_reason() -> None:
    assert not set(SGLANG_ZOO) & set(NO_COUNTERPART)
    assert set(SGLANG_ZOO) | set(NO_COUNTERPART) == {bug.slug for bug in ZOO}
    assert set(NOT_REACHED) <= set(SGLANG_ZOO) and set(RECORDED_BY) <= set(CAUGHT)
    assert not set(SCRIPTS) & set(NOT_RECORDED) and not set(NOT_RECORDED) & set(NOT_REACHED)
    assert set(SCRIPTS) | set(NOT_RECORDED) == set(SGLANG_ZOO), (
        "every counterpart has a recorded run that reaches it, or a reason (and the machine catches it)"
    )


@pytest.mark.parametrize("slug", CAUGHT)
def test_the_profile_machine_catches_it_on_sglang(slug: str, tmp_path: Path) -> None:
    """On two ranks (``HUNT_ROWS``) the patch reaches the rank workers, whose pool is keyed on it: none is
    left afterwards, and SGLang as shipped passes the same examples."""
    bug = SGLANG_ZOO[slug]
    hunt = hunt_on_sglang(bug, tmp_path)
    assert hunt.caught, f"{slug} survived {budget.DIFFERENTIAL.examples} examples against SGLang"
    assert bug.caught_by in hunt.message, hunt.message
    assert 1 <= hunt.examples <= bug.budget
    if HUNT_ROWS.get(slug, {}).get("tp_size") == 2:
        if bug.caught_by.startswith("sglang crashed"):  # the hangs
            assert "collectives are out of step" in hunt.message, hunt.message  # _tp's check, not a timeout
        assert all(not hook for _, hook, _ in _tp._POOL), "a patched rank worker outlived its hunt"
        clean = hunt_on_sglang(None, tmp_path / "clean", hunt.examples, slug=slug)
        assert not clean.caught, clean.message


@pytest.mark.parametrize("slug", sorted(RECORDED_BY))
def test_a_recorded_run_of_the_patched_engine_is_caught(slug: str, tmp_path: Path) -> None:
    policy, kind = RECORDED_BY[slug]
    recorded = record_patched(SGLANG_ZOO[slug], tmp_path / "run.jsonl", policy, REQUESTS)
    assert recorded.caught, f"the recorded {policy} run of {slug} replays clean on the model"
    assert recorded.kind == kind, recorded.message


@pytest.mark.parametrize("policy", sorted(RECORD_CONFIGS))
def test_the_recorded_runs_of_the_healthy_engine_replay_clean(policy: str, tmp_path: Path) -> None:
    """Without a bug the same runs replay clean: what the zoo runs catch is the bug."""
    run = record_run(
        HEAD,
        tmp_path / "run.jsonl",
        RECORD_CONFIGS[policy],
        block_tokens=BLOCK_TOKENS,
        limit=REQUESTS,
        snapshots=True,
    )
    assert replay_recorded(run.recording) == len(run.recording.ops) > 100


@pytest.mark.parametrize("slug", sorted(SCRIPTS))
def test_a_recorded_run_of_generated_operations_is_caught_at_the_right_step(
    slug: str, tmp_path: Path
) -> None:
    """The patched engine, driven over the bug's operations with the recorder on: the recording is those
    operations, and its replay on the model fails at the step where the model-versus-SGLang harness
    (same operations, same patch) fails, on the field (or observation) the bug changes. As shipped, it
    replays clean. On two ranks (the hangs) the run ends at the operation whose ``apply`` raised
    ``RankError`` — the harness's "sglang crashed" there (the two-rank hunt asserts that; a second patched
    pair of workers here would cost ~15 s) — recorded as ``NeverReturned``, read back from the file."""
    bug, script = SGLANG_ZOO[slug], SCRIPTS[slug]
    recorded = record_script(bug, script, tmp_path / "patched.jsonl")
    assert recorded.recording is not None and recorded.recording.ops == list(script.ops)
    assert recorded.caught, f"the recorded run of {slug} replays clean on the model"
    assert (recorded.step, recorded.kind) == (script.step, script.kind), recorded.message
    assert any(line.strip().startswith(script.differs) for line in recorded.detail), recorded.detail
    if script.config.tp_size > 1:
        assert recorded.failed_at == recorded.step
        assert read_recording(tmp_path / "patched.jsonl") == recorded.recording
    else:
        with bug.applied(), open_systems(("model", "sglang"), script.config) as systems:
            harness = Harness(script.config, systems, write_trace=False, family=HICACHE)
            with pytest.raises(Divergence) as differential:
                _steps(harness, script.ops)
        assert differential.value.step == recorded.step
    clean = record_script(None, script, tmp_path / "clean.jsonl")
    assert not clean.caught, clean.message
    assert clean.ops == len(script.ops) and not clean.failed_at


def _steps(harness: HiCacheHarness, ops: tuple[Op, ...]) -> None:
    for op in ops:
        harness.step(op)
