"""SGLang's known findings (specs/sglang-known.json, specs/sglang-findings.md): each shrunk trace under
tests/regressions/sglang/known/ fails on the installed SGLang as it is shipped, and ``--known`` names the
finding instead (exit 0). Each finding's trace is its ``trace`` field; one listed for another release is
skipped here (``nox -s sglang_releases`` installs the others). A trace made on another release is replayed under
the installed release's profile (as ``refcache bisect`` does; its header's is the release it was made on), so that
a decision between the two (D-56's host size, D-65's free order) is not read as the finding. A trace that stops
failing means the bug is fixed in this release: move its finding's ``fixed_in`` and ``releases``."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.check.bisect import profiled
from refcache.check.known import KnownFinding, load_known, system_releases
from refcache.cli import app
from refcache.hicache.trace import read_trace, trace_release
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG

ROOT = Path(__file__).resolve().parents[3]
KNOWN = ROOT / "specs" / "sglang-known.json"
FINDINGS = [f for f in load_known([KNOWN]).findings if f.trace is not None]


@pytest.mark.parametrize("finding", FINDINGS, ids=[f.id for f in FINDINGS])
def test_a_known_finding_fails_without_the_list_and_is_named_with_it(
    finding: KnownFinding, tmp_path: Path
) -> None:
    assert finding.trace is not None
    trace = ROOT / finding.trace
    release = system_releases([SGLANG])[SGLANG]
    if finding.system != SGLANG or release not in finding.releases:
        pytest.skip(
            f"{finding.id} is listed for {finding.system} {finding.releases.text}, not {SGLANG} {release}"
        )
    config, _ops = read_trace(trace)
    for option, values in SYSTEMS[SGLANG].excluded().items():  # up to 0.5.3: no FIFO, MRU, FILO
        if str(getattr(config, option)) in values:
            pytest.skip(
                f"SGLang {release} has no {option}={getattr(config, option)!s} (test_release_findings replays the "
                "finding's -lru copy there)"
            )
    made_on = trace_release(trace)
    if made_on is not None and made_on[1] != release:
        trace = profiled(trace, SYSTEMS[SGLANG].followed(), tmp_path / trace.name)
    plain = CliRunner().invoke(app, ["replay", str(trace), "--against", f"model,{SGLANG}", "-q"])
    assert plain.exit_code == 1 and "DIVERGENCE" in plain.output, plain.output
    named = CliRunner().invoke(
        app, ["replay", str(trace), "--against", f"model,{SGLANG}", "-q", "--known", str(KNOWN)]
    )
    assert named.exit_code == 0, named.output
    assert f"known finding {finding.id}" in named.output
