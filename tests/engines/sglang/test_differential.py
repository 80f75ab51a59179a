"""Model versus the installed SGLang (0.5.20; 0.5.23 in ``nox -s sglang_latest``) over the default
differential budget: random operation sequences on every configuration the adapter runs (one rank, L1 + L2: every write and eviction policy, page sizes 1-4, MHA and
MLA, every io backend / layout row, EAGLE keys; two ranks; on 0.5.20 L3 with SGLang's file backend under the
0.5.20 profile), observations and snapshots compared after every step, every invariant checked on both.

Two profiles: refcache's decisions (the default configuration), where a divergence passes only when a
decision of specs/decisions.md explains it (``sglang_machines``), and the release's profile
(``sglang-0.5.20``, ``sglang-0.5.23``), where the model follows it at every decision and nothing may diverge. The examples and steps per configuration row, and
the explained divergences, are printed (``pytest -rP``) and, with ``REFCACHE_SGLANG_REPORT`` set, written
there as JSON.

Known findings: a divergence that the findings of specs/sglang-known.json listed for the installed release explain,
every line of it (``KnownFindings.explain``, as ``refcache fuzz --known`` reads them), ends its example (rejected,
so Hypothesis draws the next) and is counted as ``known ID`` in the report; any other divergence fails. On the
releases with a known bug the machines meet it (R-3 on 0.5.4..0.5.12, R-1 with L3 on 0.5.18), and without this
the test stopped there, leaving the rest of the budget unrun; on a release without one nothing changes.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import note, reject
from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence, Outcome
from refcache.check.known import load_known, system_releases
from refcache.check.machines import HiCacheMachine
from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.engines.sglang import versions
from refcache.errors import UnsupportedError
from refcache.systems import SYSTEMS

from .sglang_machines import ROWS, SGLANG, explained, sglang_machine
from .sglang_machines import SYSTEMS as COMPARED

RELEASE = versions.installed().row
"""The installed release's row: whether the adapter opens it with L3 and with two ranks."""
L3, RANKS, L3_RANKS = RELEASE.l3_on(SGLANG), RELEASE.ranks_on(SGLANG), RELEASE.l3_ranks_on(SGLANG)
"""What the system under test opens the installed release with (``REFCACHE_SGLANG_SYSTEM`` may name another than
the release's default: ``sglang-unified`` on 0.5.20 opens one rank, with L3)."""
PROFILE = SYSTEMS[SGLANG].followed() or versions.installed_profile()
"""What the system under test does where refcache decided otherwise (``refcache.config.FOLLOWED_BY``; the
``-unified`` profile for ``sglang-unified`` on 0.5.19/0.5.20, ``FOLLOWED_BY_UNIFIED``)."""

BUDGET = budget.DIFFERENTIAL
KNOWN = load_known([Path(__file__).resolve().parents[3] / "specs" / "sglang-known.json"])


def _known_ends_the_example(machine: type[HiCacheMachine]) -> type[HiCacheMachine]:
    """``machine`` whose divergence, once no decision explains it, ends its example when known findings of the
    installed release explain it (module docstring). The class keeps its name: its derandomized sample stays."""
    releases = system_releases(COMPARED)
    family_diverged = machine.diverged

    def diverged(self: HiCacheMachine, error: Divergence) -> Outcome:
        try:
            return family_diverged(self, error)
        except Divergence as failing:
            found = KNOWN.explain(failing, releases)
            if not found:
                raise
            for finding in found:
                self.coverage.outcomes[f"known {finding.id}"] += 1
            note(f"known finding {', '.join(f.id for f in found)}: {failing.summary}")
            reject()

    return type(machine.__name__, (machine,), {"diverged": diverged})


def known(coverage: Coverage) -> dict[str, int]:
    """Divergences that known findings explained, by finding id, in the runs ``coverage`` counted."""
    prefix = "known "
    return {k.removeprefix(prefix): n for k, n in coverage.outcomes.items() if k.startswith(prefix)}


def _report(name: str, seconds: float, coverage: Coverage) -> None:
    rows: Counter[str] = ROWS.get(name, Counter())
    table = {
        row: {"examples": rows.get(f"{row}|examples", 0), "steps": rows.get(f"{row}|steps", 0)}
        for row in sorted({key.split("|")[0] for key in rows})
    }
    report = {
        "machine": name,
        "seconds": round(seconds, 1),
        "explained": explained(coverage),
        "known": known(coverage),
        "rows": table,
    }
    print(json.dumps(report, indent=1))
    path = os.environ.get("REFCACHE_SGLANG_REPORT")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps(report) + "\n")


def _run(name: str, runs: budget.Budget, **constraints: object) -> Coverage:
    """The model-versus-SGLang machine ``name`` over ``constraints``' rows for ``runs``; reported."""
    machine = _known_ends_the_example(sglang_machine(name, None, **constraints))
    started = time.monotonic()
    run_state_machine_as_test(machine, settings=runs.settings(derandomize=True, shrink=False))
    coverage: Coverage = machine.coverage
    _report(name, time.monotonic() - started, coverage)
    return coverage


def test_model_and_sglang_agree_under_refcache_decisions() -> None:
    coverage = _run("SGLangDifferentialMachine", BUDGET)
    assert coverage.runs >= BUDGET.examples


def test_model_and_sglang_agree_under_the_sglang_profile() -> None:
    profile = SYSTEMS[SGLANG].followed()
    assert profile is not None
    coverage = _run("SGLangProfileMachine", BUDGET, **PROFILES[profile])
    assert explained(coverage) == {}, f"under the {profile} profile no decision should be needed"


def test_model_and_sglang_agree_with_l3_under_the_sglang_profile() -> None:
    """L3 rows: SGLang's HiCacheFile and its four storage threads, stepped by ``CompleteIO``, against the
    model under the 0.5.20 profile (its prefetch pipeline, D-01/D-39; its admission, D-13; its backup pins,
    D-07): backups, prefetches, progress checks, aborts and clock advances drawn by the machine, and
    nothing may diverge. write_through only: under the other policies a node inserted while a prefetch runs
    can stay device-only, and 0.5.20 then hangs the fetched pages below it (D-06, sglang.md §9 #6), which
    BACKUP-CONTIGUITY rejects on the engine (specs/sglang-adapter.md, 'L3')."""
    if not L3:  # a release whose storage pipeline the adapter does not drive must refuse L3
        with pytest.raises(UnsupportedError, match="L3"):
            SYSTEMS[SGLANG].load(SGLANG)(HiCacheConfig(hicache_storage_backend="file"))
        return
    coverage = _run(
        "SGLangL3ProfileMachine",
        BUDGET,
        **PROFILES[PROFILE],
        hicache_storage_backend="file",
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
    )
    assert explained(coverage) == {}, f"under the {PROFILE} profile no decision should be needed"
    assert coverage.runs >= BUDGET.examples


TWO_RANKS = budget.Budget(int(os.environ.get("REFCACHE_SGLANG_TP2_EXAMPLES", "60")), 40)
"""Two ranks cost two rank processes per system (kept between examples) and two round trips per step."""


def test_model_and_sglang_agree_with_two_ranks() -> None:
    """tp_size=2: SGLang's all-reduces run for real between two rank processes (``_tp``); one rank's
    acks and loads run ahead of the other's (per-rank ``CompleteIO``). Under refcache's decisions, as the
    first test: a divergence passes only when a decision explains it."""
    if 2 not in RANKS:  # a release the adapter opens with one rank only must refuse two
        with pytest.raises(UnsupportedError, match="tp_size=2"):
            SYSTEMS[SGLANG].load(SGLANG)(HiCacheConfig(tp_size=2))
        return
    coverage = _run("SGLangTwoRanksMachine", TWO_RANKS, tp_size=2)
    assert coverage.runs >= TWO_RANKS.examples


def test_model_and_sglang_agree_with_two_ranks_under_the_sglang_profile() -> None:
    """tp_size=2 under the profile the system follows (``sglang-0.5.20-unified`` for ``sglang-unified`` on 0.5.20,
    the release's on 0.5.21 on): the scheduler's all-reduces of either cache class (HiRadixCache's three MINs per
    ``check_hicache_events``, UnifiedRadixCache's one) against the model's MIN reduction; nothing may diverge."""
    if 2 not in RANKS:
        pytest.skip(f"{SGLANG} opens SGLang {RELEASE.version} with one rank (test above)")
    coverage = _run("SGLangTwoRanksProfileMachine", TWO_RANKS, **PROFILES[PROFILE], tp_size=2)
    assert explained(coverage) == {}, f"under the {PROFILE} profile no decision should be needed"
    assert coverage.runs >= TWO_RANKS.examples


TWO_RANKS_L3 = budget.Budget(int(os.environ.get("REFCACHE_SGLANG_TP2_L3_EXAMPLES", "10")), 40)
"""Two ranks with L3: the L3 rows' operations on two rank processes (each step of a storage thread on one rank;
the storage threads' all-reduces reduced by the parent once both ranks took that step)."""


def test_model_and_sglang_agree_with_l3_on_two_ranks() -> None:
    """tp_size=2 with SGLang's file backend under the 0.5.20 profile (write_through, as the one-rank L3 rows):
    a hit query or a read on one rank waits in its storage all-reduce (MIN of the hits, MIN of an ack's
    completed tokens) until the other rank took the same step, as the model's parked query does; nothing
    may diverge."""
    if not L3 or 2 not in RANKS:
        pytest.skip(f"{SGLANG} opens SGLang {RELEASE.version} without L3 or two ranks (tests above)")
    if 2 not in L3_RANKS:  # two ranks and L3, but not together: refused
        with pytest.raises(UnsupportedError, match="tp_size=2 with L3"):
            SYSTEMS[SGLANG].load(SGLANG)(HiCacheConfig(tp_size=2, hicache_storage_backend="file"))
        return
    coverage = _run(
        "SGLangTwoRanksL3Machine",
        TWO_RANKS_L3,
        **PROFILES[PROFILE],
        tp_size=2,
        hicache_storage_backend="file",
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
    )
    assert explained(coverage) == {}, f"under the {PROFILE} profile no decision should be needed"
    assert coverage.runs >= TWO_RANKS_L3.examples
    steps = ROWS["SGLangTwoRanksL3Machine"]
    assert any("tp_size=2" in row for row in steps), steps


def test_the_registry_knows_the_adapters_load_limit() -> None:
    from refcache.engines.sglang import MAX_PENDING_LOADS

    assert SYSTEMS[SGLANG].max_pending_loads == MAX_PENDING_LOADS
