"""Known findings as data (``refcache.check.known``): the file format and its errors, release ranges, the
matcher, and ``refcache fuzz --known`` / ``refcache replay --known`` over a model with two planted bugs, one
listed as known and one not (a known bug must not hide the next one)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refcache.check.harness import Divergence, Harness
from refcache.check.known import (
    KnownFindings,
    KnownFindingsError,
    Release,
    ReleaseRange,
    failing_op,
    failure_field,
    load_known,
)
from refcache.check.shrink import Failure
from refcache.cli import app
from refcache.config import HiCacheConfig
from refcache.hicache.family import FAMILY
from refcache.hicache.ops import AbortRequest, Evict, MatchPrefix, Observation, Op, StartRequest
from refcache.hicache.snapshot import Snapshot
from refcache.hicache.trace import write_trace
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, SystemEntry

CONFIG = HiCacheConfig(device_size=32).resolve()

SIGNATURE: dict[str, object] = {"kind": "planted crashed", "op": "Evict", "match": "planted bug A"}
FINDING: dict[str, object] = {
    "id": "planted-F1-evict-crash",
    "title": "the planted model crashes on every Evict",
    "system": "planted",
    "releases": "*",
    "signature": SIGNATURE,
    "upstream": "none found",
    "fixed_in": None,
    "doc": "tests/unit/test_known.py",
}


class PlantedA(HiCacheModel):
    """The model with bug A: it crashes on every ``Evict`` (listed as known)."""

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Evict):
            raise RuntimeError("planted bug A: evict")
        return super().apply(op)


class PlantedAB(PlantedA):
    """Bug A, and bug B: it crashes on every ``AbortRequest`` (not listed)."""

    def apply(self, op: Op) -> Observation:
        if isinstance(op, AbortRequest):
            raise RuntimeError("planted bug B: abort")
        return super().apply(op)


class PlantedTwoFields(HiCacheModel):
    """After its first ``Evict``, the model reports two wrong snapshot fields (two detail lines of one step)."""

    evicted = False

    def apply(self, op: Op) -> Observation:
        if isinstance(op, Evict):
            self.evicted = True
        return super().apply(op)

    def snapshot(self) -> Snapshot:
        snap = super().snapshot()
        if not self.evicted:
            return snap
        return dataclasses.replace(
            snap, model_name=snap.model_name + "-a", write_policy=snap.write_policy + "-b"
        )


@pytest.fixture
def planted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(SYSTEMS, "planted", SystemEntry("the model with bug A", f"{__name__}:PlantedA"))
    monkeypatch.setitem(
        SYSTEMS, "planted-two", SystemEntry("two wrong snapshot fields", f"{__name__}:PlantedTwoFields")
    )
    monkeypatch.setitem(
        SYSTEMS, "planted-ab", SystemEntry("the model with bugs A and B", f"{__name__}:PlantedAB")
    )


def write(path: Path, findings: list[dict[str, object]], version: int = 1) -> Path:
    path.write_text(json.dumps({"version": version, "findings": findings}))
    return path


# --- the file ------------------------------------------------------------------------------------------------


def test_a_file_loads_in_order_and_ignores_added_fields(tmp_path: Path) -> None:
    second = {**FINDING, "id": "planted-F2", "extra": "an additive field"}
    known = load_known([write(tmp_path / "k.json", [FINDING, second])])
    assert [f.id for f in known.findings] == ["planted-F1-evict-crash", "planted-F2"]
    assert known.findings[0].fixed_in is None and known.findings[0].signature.op == "Evict"


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"title": None}, "finding 'planted-F1-evict-crash': field 'title'"),
        ({"id": ""}, "findings[0]: field 'id'"),
        ({"releases": "0.5.23..0.5.20"}, "field 'releases': '0.5.23..0.5.20' ends before it starts"),
        ({"releases": "latest"}, "field 'releases': 'latest' is not a release number"),
        ({"signature": {"kind": "x", "op": "*"}}, "signature: field 'match' is missing"),
        ({"signature": {"kind": "x", "op": "*", "match": "("}}, "field 'match' is not a regular expression"),
        ({"signature": "x"}, "field 'signature' must be an object"),
        ({"fixed_in": 5}, "field 'fixed_in' must be a non-empty string or null"),
        ({"trace": 5}, "field 'trace' must be a non-empty string or null"),
        ({"signature": {**SIGNATURE, "after": "["}}, "field 'after' is not a regular expression"),
        ({"signature": {**SIGNATURE, "after": 3}}, "field 'after' must be a non-empty string or null"),
        ({"signature": {**SIGNATURE, "lines": []}}, "field 'lines' must be a non-empty list"),
        ({"signature": {**SIGNATURE, "lines": "^a"}}, "field 'lines' must be a non-empty list"),
        ({"signature": {**SIGNATURE, "lines": ["^a", 3]}}, "field 'lines'[1] must be a non-empty string"),
        ({"signature": {**SIGNATURE, "lines": ["("]}}, "field 'lines'[0] is not a regular expression"),
    ],
)
def test_a_bad_entry_names_the_file_the_entry_and_the_field(
    tmp_path: Path, change: dict[str, object], names: str
) -> None:
    path = write(tmp_path / "k.json", [{**FINDING, **change}])
    with pytest.raises(KnownFindingsError, match=re.escape(names)) as caught:
        load_known([path])
    assert str(path) in str(caught.value)


def test_a_bad_file_is_a_typed_error(tmp_path: Path) -> None:
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(KnownFindingsError, match="not JSON"):
        load_known([tmp_path / "bad.json"])
    with pytest.raises(KnownFindingsError, match="field 'version' is 2"):
        load_known([write(tmp_path / "v2.json", [FINDING], version=2)])
    with pytest.raises(KnownFindingsError, match="cannot be read"):
        load_known([tmp_path / "missing.json"])
    one, two = write(tmp_path / "one.json", [FINDING]), write(tmp_path / "two.json", [FINDING])
    with pytest.raises(KnownFindingsError, match=r"also listed in .*one\.json"):
        load_known([one, two])


def test_release_ranges() -> None:
    assert Release.parse("0.5.9") < Release.parse("0.5.10rc1") < Release.parse("0.5.10")
    assert Release.parse("0.5.10") < Release.parse("0.5.10.post1") and Release.parse("0.5") == Release.parse(
        "0.5.0"
    )
    span = ReleaseRange.parse("0.5.10..0.5.20")
    assert "0.5.10" in span and "0.5.20" in span and "0.5.15" in span
    assert "0.5.9" not in span and "0.5.21" not in span and None not in span and "main" not in span
    assert "0.5.3" in ReleaseRange.parse("..0.5.16") and "0.6.0" in ReleaseRange.parse("0.5.19..")
    assert "0.5.20" in ReleaseRange.parse("0.5.20") and "0.5.21" not in ReleaseRange.parse("0.5.20")
    assert None in ReleaseRange.parse("*") and "main" in ReleaseRange.parse("*")
    with pytest.raises(ValueError, match="neither end"):
        ReleaseRange.parse("..")


# --- the matcher ---------------------------------------------------------------------------------------------


def divergence(planted_system: str) -> Divergence:
    opened = {"model": HiCacheModel(CONFIG), "planted": SYSTEMS[planted_system].load(planted_system)(CONFIG)}
    harness = Harness(CONFIG, opened, family=FAMILY, write_trace=False)
    harness.step(StartRequest(1, (1, 2, 3)))
    with pytest.raises(Divergence) as caught:
        harness.step(Evict(8))
    return caught.value


def test_the_matcher_reads_kind_op_system_release_and_pattern(planted: None, tmp_path: Path) -> None:
    error = divergence("planted")
    failure = Failure.of(error)
    assert failing_op(failure.message) == "Evict" and failure.kind == "planted crashed"
    assert failure_field(failure) == ""  # a crash has no diff lines
    finding = {**FINDING, "releases": "1.0..1.2"}
    known = load_known([write(tmp_path / "k.json", [finding])])
    releases = {"model": None, "planted": "1.1"}
    assert known.match(error, releases) is known.findings[0]
    assert known.match(failure, releases) is known.findings[0]  # a shrink Failure reads alike
    assert known.match(error, {**releases, "planted": "1.3"}) is None  # another release
    assert known.match(error, {"model": None, "other": "1.1"}) is None  # another system
    for signature in (
        {"kind": "snapshots differ", "op": "*", "match": "planted bug A"},
        {"kind": "planted crashed", "op": "StartRequest", "match": "planted bug A"},
        {"kind": "planted crashed", "op": "*", "match": "planted bug B"},
    ):
        other = load_known([write(tmp_path / "o.json", [{**finding, "signature": signature}])])
        assert other.match(error, releases) is None, signature
    assert KnownFindings().match(error, releases) is None


def test_after_asks_for_an_earlier_operation(planted: None, tmp_path: Path) -> None:
    error = divergence("planted")  # StartRequest(1, (1, 2, 3)), then Evict(8) fails
    assert error.history == ("StartRequest(rid=1, tokens=(1, 2, 3), extra_key=None)",)
    releases = {"model": None, "planted": "1.1"}
    for after, matches in (
        (r"^StartRequest\(rid=1\b", True),
        (r"^StartRequest\(rid=2\b", False),  # not before it
        (r"^Evict\(", False),  # the failing operation is not before itself
    ):
        finding = {**FINDING, "signature": {**SIGNATURE, "after": after}}
        known = load_known([write(tmp_path / "a.json", [finding])])
        assert (known.match(error, releases) is not None) is matches, after
        assert (known.match(Failure.of(error), releases) is not None) is matches, after  # shrink's reading
    finding = {**FINDING, "signature": {**SIGNATURE, "after": r"^StartRequest\("}}
    known = load_known([write(tmp_path / "a.json", [finding])])
    unknown_history = Failure(2, error.kind, Failure.of(error).message)
    assert known.match(unknown_history, releases) is None  # no history: ``after`` cannot hold


# --- per-line explanation: a known finding must not hide another difference at the same step -------------

TWO_LINES = Failure(
    2,
    "snapshots differ",
    "step 2: snapshots differ after Evict(num_tokens=8):",
    "ranks[0].a: model=1 planted=2; ranks[0].b: model=3 planted=4",
)
RELEASES: dict[str, str | None] = {"model": None, "planted": "1.1"}


def explains(finding_id: str, line: str, **signature: object) -> dict[str, object]:
    """A finding on the planted system that applies to ``TWO_LINES`` and explains the lines ``line`` finds."""
    base: dict[str, object] = {"kind": "snapshots differ", "op": "Evict", "match": line[1:], "lines": [line]}
    return {**FINDING, "id": finding_id, "signature": {**base, **signature}}


def test_a_divergence_with_a_line_no_finding_explains_is_not_known(tmp_path: Path) -> None:
    only_a = load_known([write(tmp_path / "a.json", [explains("A", r"^ranks\[0\]\.a: ")])])
    assert only_a.applying(TWO_LINES, RELEASES) == list(only_a.findings)  # it applies ...
    assert only_a.match(TWO_LINES, RELEASES) is None  # ... but ranks[0].b is nobody's: not known
    assert only_a.explain(TWO_LINES, RELEASES) == ()
    one_line = Failure(2, TWO_LINES.kind, TWO_LINES.message, "ranks[0].a: model=1 planted=2")
    assert only_a.match(one_line, RELEASES) is only_a.findings[0]  # alone, the line is explained
    # a finding that explains ranks[0].b but does not apply (another operation) explains nothing
    elsewhere = explains("B", r"^ranks\[0\]\.b: ", op="StartRequest")
    both = load_known([write(tmp_path / "b.json", [explains("A", r"^ranks\[0\]\.a: "), elsewhere])])
    assert both.match(TWO_LINES, RELEASES) is None


def test_two_findings_explain_a_step_together(tmp_path: Path) -> None:
    a, b = explains("A", r"^ranks\[0\]\.a: "), explains("B", r"^ranks\[0\]\.b: ")
    known = load_known([write(tmp_path / "ab.json", [a, b])])
    assert [f.id for f in known.explain(TWO_LINES, RELEASES)] == ["A", "B"]
    assert known.match(TWO_LINES, RELEASES) is known.findings[0]  # the first, in file order
    reversed_ = load_known([write(tmp_path / "ba.json", [b, a])])
    assert [f.id for f in reversed_.explain(TWO_LINES, RELEASES)] == ["B", "A"]
    # a finding that applies but explains none of the lines is not reported
    idle = explains("C", r"^ranks\[0\]\.c: ", match="ranks")
    with_idle = load_known([write(tmp_path / "cab.json", [idle, a, b])])
    assert [f.id for f in with_idle.explain(TWO_LINES, RELEASES)] == ["A", "B"]


def test_a_finding_without_lines_explains_the_whole_divergence(tmp_path: Path) -> None:
    whole = {
        **FINDING,
        "id": "W",
        "signature": {"kind": "snapshots differ", "op": "*", "match": r"ranks\[0\]\.a"},
    }
    known = load_known([write(tmp_path / "w.json", [whole])])
    assert known.findings[0].signature.lines is None
    assert known.match(TWO_LINES, RELEASES) is known.findings[0]  # broad: ranks[0].b passed over with it


def test_the_report_names_the_findings_at_the_same_step(tmp_path: Path) -> None:
    from refcache.check.coverage import Coverage
    from refcache.check.known import KnownRecorder, known_report

    a, b = explains("A", r"^ranks\[0\]\.a: "), explains("B", r"^ranks\[0\]\.b: ")
    known = load_known([write(tmp_path / "ab.json", [a, b])])
    recorder = KnownRecorder(known, ("model", "planted"), Coverage())
    recorder.releases = RELEASES
    message = TWO_LINES.message + "\n" + TWO_LINES.detail.replace("; ", "\n")
    error = Divergence(message, None, kind=TWO_LINES.kind, step=2)
    assert recorder(error)
    assert recorder.hits[0].finding == "A" and recorder.hits[0].also == ("B",)
    report = known_report(recorder.hits, known)
    assert "A ×1" in report[1] and "with B at the same step" in report[1], report


# --- fuzz --known, replay --known ----------------------------------------------------------------------------


def fuzz(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(
        app, ["fuzz", "--examples", "40", "--seed", "7", "--shrink-seconds", "0", "--steps", "30", *args]
    )
    return result.exit_code, result.output


def test_fuzz_records_a_known_bug_and_goes_on(
    planted: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    known = write(tmp_path / "k.json", [FINDING])
    status, output = fuzz("--against", "model,planted")
    assert status == 1 and "FAILED" in output and "planted bug A" in output, output  # without --known: red
    status, output = fuzz("--against", "model,planted", "--known", str(known))
    assert status == 0, output
    found = re.search(r"known findings: (\d+) divergences? matched 1", output)
    assert found is not None and int(found.group(1)) > 1, output  # more than one example: it went on
    assert "planted-F1-evict-crash ×" in output and "unknown divergences: 0" in output
    assert "40 examples" in output  # the whole budget ran
    assert list(tmp_path.glob("*.known-planted-F1-evict-crash.jsonl"))  # the first hit's trace, kept


def test_a_known_bug_does_not_hide_an_unknown_one(
    planted: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    finding = {
        **FINDING,
        "system": "planted-ab",
        "signature": {**SIGNATURE, "kind": "planted-ab crashed"},
    }
    known = write(tmp_path / "k.json", [finding])
    # --minutes: the 400 examples, not fuzz's default minute, bound the run (34 s here on a quiet machine; under
    # load the minute ran out before bug B's example and the test failed)
    status, output = fuzz(
        "--against", "model,planted-ab", "--known", str(known), "--examples", "400", "--minutes", "30"
    )
    assert status == 1, output
    assert re.search(r"known findings: \d+ divergences? matched 1", output), output
    assert "unknown divergences: 1" in output and "planted bug B" in output, output


def test_replay_names_a_known_finding(planted: None, tmp_path: Path) -> None:
    trace = tmp_path / "evict.jsonl"
    write_trace(trace, CONFIG, [StartRequest(1, (1, 2, 3)), MatchPrefix((1, 2)), Evict(8)])
    known = write(tmp_path / "k.json", [FINDING])
    plain = CliRunner().invoke(app, ["replay", str(trace), "--against", "model,planted"])
    assert plain.exit_code == 1 and "DIVERGENCE" in plain.output and "known finding" not in plain.output
    named = CliRunner().invoke(
        app, ["replay", str(trace), "--against", "model,planted", "--known", str(known)]
    )
    assert named.exit_code == 0, named.output
    assert "known finding planted-F1-evict-crash" in named.output
    as_json = CliRunner().invoke(app, ["replay", str(trace), "--against", "model,planted", "--json"])
    assert as_json.exit_code == 1
    record = json.loads(as_json.output.strip().splitlines()[-1])
    assert record["verdict"] == "failed" and record["step"] == 3 and record["op"] == "Evict"
    assert record["kind"] == "planted crashed" and record["releases"] == {"model": None, "planted": None}
    clean = CliRunner().invoke(app, ["replay", str(trace), "--against", "model", "--json"])
    assert clean.exit_code == 0 and json.loads(clean.output)["verdict"] == "clean"


def test_replay_names_every_finding_that_explains_the_step(planted: None, tmp_path: Path) -> None:
    trace = tmp_path / "two.jsonl"
    write_trace(trace, CONFIG, [StartRequest(1, (1, 2, 3)), Evict(8)])
    a = {**explains("A", r"^model_name: "), "system": "planted-two"}
    b = {**explains("B", r"^write_policy: "), "system": "planted-two"}
    args = ["replay", str(trace), "--against", "model,planted-two"]
    named = CliRunner().invoke(app, [*args, "--known", str(write(tmp_path / "ab.json", [a, b]))])
    assert named.exit_code == 0, named.output
    assert "known finding A" in named.output and "known finding B" in named.output, named.output
    as_json = CliRunner().invoke(app, [*args, "--json", "--known", str(write(tmp_path / "j.json", [a, b]))])
    record = json.loads(as_json.output.strip().splitlines()[-1])
    assert record["verdict"] == "known" and record["finding"] == "A" and record["findings"] == ["A", "B"]
    only_a = CliRunner().invoke(app, [*args, "--known", str(write(tmp_path / "a.json", [a]))])
    assert only_a.exit_code == 1 and "known finding" not in only_a.output, (
        only_a.output
    )  # B's line unexplained


def test_a_bad_known_file_is_a_usage_error(tmp_path: Path) -> None:
    bad = write(tmp_path / "k.json", [{**FINDING, "releases": "soon"}])
    result = CliRunner().invoke(app, ["fuzz", "--against", "model", "--examples", "1", "--known", str(bad)])
    assert result.exit_code == 2 and "field 'releases'" in result.output


def test_a_fuzz_worker_sends_back_its_known_hits(
    planted: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--jobs``: each worker records its own known divergences (the loop in this process, as test_cli's)."""
    import multiprocessing
    import queue

    from refcache.check.parallel import _worker
    from refcache.check.plan import FuzzPlan

    monkeypatch.setenv("REFCACHE_TRACE_DIR", str(tmp_path))
    context = multiprocessing.get_context("spawn")
    results: queue.Queue[tuple[object, ...]] = queue.Queue()
    shared = {"claimed": context.Value("q", 0), "runs": context.Value("q", 0), "steps": context.Value("q", 0),
              "stop": context.Event(), "results": results, "deadline": None}  # fmt: skip
    plan = FuzzPlan("hicache", ("model", "planted"), {}, steps=30, examples=30, seconds=None, seed=5,
                    database=tmp_path / "db", chunk=5)  # fmt: skip
    _worker(1, plan, shared, load_known([write(tmp_path / "k.json", [FINDING])]))
    _index, _ledger, failure, _path, _messages, hits = results.get_nowait()
    assert failure is None and isinstance(hits, list) and len(hits) > 1
    assert {hit.finding for hit in hits} == {"planted-F1-evict-crash"}
    assert not (tmp_path / "db").exists() or not any((tmp_path / "db").iterdir())  # no known example saved


def test_fuzz_shrinks_only_to_failures_no_known_finding_explains(planted: None, tmp_path: Path) -> None:
    """``refcache fuzz --known`` shrinks its trace with ``shrink_file(..., known=...)``: a candidate whose
    failure a known finding explains is not kept, so shrinking never trades the new bug for a known one. Here
    the finding lists the trace's own failure (bug B), so no shorter candidate may be kept."""
    from refcache.cli.shrink import shrink_file

    trace = tmp_path / "abort.jsonl"
    write_trace(trace, CONFIG, [StartRequest(1, (1, 2, 3)), MatchPrefix((1, 2)), AbortRequest(1)])
    bug_b = {
        **FINDING,
        "system": "planted-ab",
        "signature": {"kind": "planted-ab crashed", "op": "*", "match": "bug B"},
    }
    known = load_known([write(tmp_path / "k.json", [bug_b])])
    plain, kept = tmp_path / "plain.min.jsonl", tmp_path / "kept.min.jsonl"
    shrink_file(trace, ("model", "planted-ab"), 10.0, plain, {})
    shrink_file(trace, ("model", "planted-ab"), 10.0, kept, {}, known=known)
    assert len(FAMILY.read_trace(plain)[1]) == 1  # AbortRequest alone still crashes on bug B
    assert len(FAMILY.read_trace(kept)[1]) == 3  # every shorter candidate fails the known way
