"""LMCache 0.5.6's findings (specs/lmcache-findings.md) still hold, each as its own finding, and the model
errors they once exposed stay fixed.

Every ``tests/regressions/lmcache/F*.jsonl`` must diverge between the reference model and LMCache exactly as
its entry in ``specs/lmcache-known.json`` says (``refcache.check.known``'s matcher: kind, operation, pattern and
what came before; the first entry that matches must be its own), so a finding that LMCache stops showing — a fix, or an adapter that stopped seeing it — fails here
and the entry can go. Every ``model-*.jsonl`` and ``adapter-*.jsonl`` (a model or adapter error a divergence
once exposed) must replay without divergence.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.check.known import load_known, system_releases
from refcache.lmcache.family import FAMILY
from refcache.systems import open_systems

ROOT = Path(__file__).resolve().parents[3]
TRACES = ROOT / "tests" / "regressions" / "lmcache"
KNOWN = json.loads((ROOT / "specs" / "lmcache-known.json").read_text(encoding="utf-8"))["findings"]
FINDINGS_FILE = load_known([ROOT / "specs" / "lmcache-known.json"])
FINDINGS = sorted(TRACES.glob("F*.jsonl"))
MODEL_FIXES = sorted([*TRACES.glob("model-*.jsonl"), *TRACES.glob("adapter-*.jsonl")])
SYSTEMS = ("lmcache-model", "lmcache")


def _replay(trace: Path, tmp_path: Path) -> Divergence | None:
    config, ops = FAMILY.read_trace(trace)
    with open_systems(SYSTEMS, config, family=FAMILY) as systems:
        harness = Harness(config, systems, trace_dir=tmp_path, family=FAMILY)
        try:
            for op in ops:
                harness.step(op)
        except Divergence as divergence:
            return divergence
    return None


def _first_match(divergence: Divergence) -> str | None:
    finding = FINDINGS_FILE.match(divergence, system_releases(SYSTEMS))
    return None if finding is None else finding.id


def test_every_known_finding_has_its_trace() -> None:
    ids = {f["id"] for f in KNOWN}
    stems = {"lmcache-" + t.stem for t in FINDINGS}
    assert ids == stems, ids ^ stems


@pytest.mark.parametrize("trace", FINDINGS, ids=[t.stem for t in FINDINGS])
def test_a_finding_still_diverges_as_itself(trace: Path, tmp_path: Path) -> None:
    divergence = _replay(trace, tmp_path)
    assert divergence is not None, (
        f"{trace.name} no longer diverges: LMCache fixed it, or the adapter lost it"
    )
    assert _first_match(divergence) == "lmcache-" + trace.stem, divergence.summary


@pytest.mark.parametrize("trace", MODEL_FIXES, ids=[t.stem for t in MODEL_FIXES])
def test_a_fixed_model_error_stays_fixed(trace: Path, tmp_path: Path) -> None:
    divergence = _replay(trace, tmp_path)
    assert divergence is None, divergence.summary
