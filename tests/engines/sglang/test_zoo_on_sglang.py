"""The bug zoo on SGLang 0.5.20: each zoo bug that SGLang's code has (``sglang_zoo.SGLANG_ZOO``), patched
into SGLang's own ``HiRadixCache``, is (a) caught by the model-versus-SGLang machine under the
``sglang-0.5.20`` profile, derandomized, within the default budget, with the expected kind of divergence,
and (b) caught by replaying on the model a run of the patched engine recorded over the Mooncake head trace
(``refcache.sim.record``, the driver of ``refcache record``). Every other zoo bug says why SGLang has no
counterpart the adapter runs (``sglang_zoo.NO_COUNTERPART``). The measured table is in specs/bug-zoo.md
(``measure_zoo_sglang.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from quality.zoo import ZOO

from refcache.check import budget
from refcache.check.recorded import replay_recorded
from refcache.sim.record import record_run

from .sglang_zoo import NO_COUNTERPART, NOT_REACHED, SGLANG_ZOO
from .zoo_on_sglang import BLOCK_TOKENS, HEAD, RECORD_CONFIGS, hunt_on_sglang, record_patched

RECORDED_BY: dict[str, tuple[str, str]] = {
    "evict-host-never-counts": ("write_back", "snapshots differ"),
    "host-leaf-predicate-swapped": ("write_through", "snapshots differ"),
}
"""Per bug: the write policy of the recorded run that catches it and the kind of divergence (the bugs measured
so far; the other counterparts' recorded runs are still to be measured)."""

REQUESTS = 60
CAUGHT = sorted(set(SGLANG_ZOO) - set(NOT_REACHED))
"""The counterparts the checks reach (``NOT_REACHED`` says why the others are not asserted)."""


def test_every_zoo_bug_has_a_counterpart_or_a_reason() -> None:
    assert not set(SGLANG_ZOO) & set(NO_COUNTERPART)
    assert set(SGLANG_ZOO) | set(NO_COUNTERPART) == {bug.slug for bug in ZOO}
    assert set(NOT_REACHED) <= set(SGLANG_ZOO) and set(RECORDED_BY) <= set(CAUGHT)


@pytest.mark.parametrize("slug", CAUGHT)
def test_the_profile_machine_catches_it_on_sglang(slug: str, tmp_path: Path) -> None:
    bug = SGLANG_ZOO[slug]
    hunt = hunt_on_sglang(bug, tmp_path)
    assert hunt.caught, f"{slug} survived {budget.DIFFERENTIAL.examples} examples against SGLang"
    assert bug.caught_by in hunt.message, hunt.message
    assert 1 <= hunt.examples <= bug.budget


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
