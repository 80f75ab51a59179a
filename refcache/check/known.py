"""Known findings as data: an engine's known upstream bugs, each with the signature of the divergence it causes,
loaded from a JSON file (``specs/sglang-known.json``, ``specs/lmcache-known.json``) and matched against a
divergence, so that ``refcache fuzz --known FILE`` records a known bug and goes on to the next example, and
``refcache replay --known FILE`` names it instead of failing.

The format (version 1; every field below but ``trace`` is required, any other field is ignored, so fields may be added)::

    {"version": 1,
     "findings": [
      {"id": "sglang-F1-short-slug",           # unique across the files loaded together
       "title": "one line: what the engine does wrong",
       "system": "sglang",                      # the registry system the divergence is against
       "releases": "0.5.20..0.5.23",            # "A..B" inclusive, one release, or "*"
       "signature": {"kind": "snapshots differ",   # a prefix of Divergence.kind
                     "op": "StartRequest",         # the failing operation's class name, or "*"
                     "match": "regex",             # re.search on the summary (Failure.message + detail)
                     "after": "regex",             # optional: re.search on an operation before the failing one
                     "lines": ["regex", ...]},     # optional: the detail lines it explains (re.search on each)
       "upstream": "issue #N / PR #M, or 'none found'",
       "fixed_in": "a release or commit, or null",
       "doc": "specs/sglang-findings.md#f1",
       "trace": "tests/regressions/sglang/known/f1-....jsonl"}]}   # optional: its shrunk trace

``trace`` and the signature's ``after`` and ``lines`` are the optional fields (added to version 1: a file
without them reads as before). ``after`` names what must have happened before the failure, for a finding whose divergence has no
shape of its own (a damaged file delivered as a hit differs from the model like any wrong hit count would): it
is searched for in the ``repr`` of each operation before the failing one (``Divergence.history``), and a
divergence whose history is not known does not match it.

A finding *applies* to a divergence when the divergence's kind starts with the signature's ``kind``, its
failing operation is the signature's ``op`` (or ``op`` is ``"*"``), ``match`` is found in its summary,
``after`` (if given) in one of the operations before it, the finding's ``system`` is one of the systems
compared, and that system's release (the installed version of its registry entry's ``engine`` distribution;
``None`` for a system that drives no engine) lies in ``releases`` (``"*"`` matches any release, ``None``
included).

A divergence is *known* only when every one of its detail lines (``Failure.detail`` split at ``"; "``: a
snapshot diff's field lines, an outcome's system lines, an invariant's lines) is explained by some finding that
applies to it, several findings together if need be (two bugs showing at one step). A finding with ``lines``
explains the detail lines that one of its ``lines`` patterns is found in (``re.search`` on that single line);
a finding without ``lines`` explains the whole divergence, every line of it, as soon as it applies: such a
finding is broad, and any other difference at the same step is passed over with it, so a finding should say
which lines it explains. A divergence with no detail lines (a crash, whose exception is in its first line) is
known when some finding applies. So a known finding never hides the next bug at the same step: a line no
finding explains leaves the divergence unknown. The findings reported (``KnownFindings.explain``) are those
that explain a line, in file order; the first of them is the one ``KnownFindings.match`` returns.

A divergence and a shrink ``Failure`` are matched alike: both are read as a ``Failure`` (``Failure.of``), whose
summary is its first line and its detail lines.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Final

from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence
from refcache.check.shrink import Failure
from refcache.errors import RefcacheError, UsageError
from refcache.systems import SYSTEMS

__all__ = [
    "FORMAT_VERSION",
    "KnownFinding",
    "KnownFindings",
    "KnownFindingsError",
    "KnownHit",
    "KnownRecorder",
    "Release",
    "ReleaseRange",
    "Signature",
    "detail_lines",
    "failing_op",
    "failure_field",
    "known_report",
    "load_known",
    "system_releases",
]

FORMAT_VERSION: Final = 1

_RELEASE = re.compile(r"^(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?(?:\+[\w.]+)?$")
_PRE_ORDER: Final = {"dev": 0, "a": 1, "b": 2, "rc": 3, "": 4}
_OP = re.compile(r"\b(?:on|after) ([A-Z]\w*)\(")  # "on StartRequest(...)", "in its snapshot after Evict(...)"


class KnownFindingsError(UsageError):
    """A known-findings file that cannot be read: not JSON, another format version, or an entry whose field
    is missing or wrong (the message names the file, the entry's id or index, and the field). Fix the file;
    nothing was loaded from it."""


@dataclass(frozen=True, order=True)
class Release:
    """A release number ordered as PEP 440 orders the common forms (``0.5.9`` < ``0.5.10rc1`` < ``0.5.10`` <
    ``0.5.10.post1``); trailing zeros do not count (``0.5`` == ``0.5.0``)."""

    numbers: tuple[int, ...]
    pre: tuple[int, int]  # (stage: dev 0, a 1, b 2, rc 3, final 4; its number)
    post: int

    @classmethod
    def parse(cls, text: str) -> Release:
        """Raises ``ValueError`` for text that is not a release number."""
        found = _RELEASE.match(text.strip())
        if found is None:
            raise ValueError(f"{text!r} is not a release number (like 0.5.20, 0.5.10rc1, 0.5.10.post1)")
        numbers = [int(n) for n in found.group(1).split(".")]
        while len(numbers) > 1 and numbers[-1] == 0:
            numbers.pop()
        stage, pre_n, post, dev = found.group(2) or "", found.group(3), found.group(4), found.group(5)
        pre = (_PRE_ORDER[stage], int(pre_n)) if stage else (_PRE_ORDER["dev"], int(dev)) if dev else (4, 0)
        return cls(tuple(numbers), pre, int(post) if post else -1)


@dataclass(frozen=True)
class ReleaseRange:
    """``"A..B"`` (both inclusive; either side may be left empty: ``"..0.5.16"``, ``"0.5.19.."``), one
    release ``"A"``, or ``"*"`` (every release, and a system with none). A release as the high end holds its
    post releases (``"0.5.5..0.5.10"`` holds ``0.5.10.post1``, ``_at_most``)."""

    text: str
    low: Release | None  # None: unbounded below
    high: Release | None  # None: unbounded above
    everything: bool = False  # "*"

    @classmethod
    def parse(cls, text: str) -> ReleaseRange:
        """Raises ``ValueError`` for a malformed range, or one whose low end is above its high end."""
        text = text.strip()
        if text == "*":
            return cls(text, None, None, everything=True)
        if ".." in text:
            low_text, _, high_text = text.partition("..")
            if not low_text and not high_text:
                raise ValueError(f"{text!r} names neither end (use '*' for every release)")
            low = Release.parse(low_text) if low_text else None
            high = Release.parse(high_text) if high_text else None
            if low is not None and high is not None and high < low:
                raise ValueError(f"{text!r} ends before it starts")
            return cls(text, low, high)
        one = Release.parse(text)
        return cls(text, one, one)

    def __contains__(self, release: object) -> bool:
        if self.everything:
            return True
        if not isinstance(release, str):
            return False
        try:
            value = Release.parse(release)
        except ValueError:  # a source checkout's version ("main"): only "*" covers it
            return False
        return (self.low is None or self.low <= value) and (self.high is None or _at_most(value, self.high))


def _at_most(value: Release, high: Release) -> bool:
    """``value <= high``, where a high end written as a release holds its post releases too (``..0.5.10``
    holds ``0.5.10.post1``): a post release is driven as its base release is until a finding names a post
    release as its end (``refcache.sglang_releases.Releases`` reads its bounds so)."""
    if value <= high:
        return True
    final = (_PRE_ORDER[""], 0)
    return high.post == -1 and high.pre == final and value.pre == final and value.numbers == high.numbers


@dataclass(frozen=True)
class Signature:
    kind: str  # a prefix of ``Divergence.kind`` ("snapshots differ", "invariant violated on sglang", ...)
    op: str  # the failing operation's class name, or "*"
    match: re.Pattern[str]  # searched for in the summary (``Failure.message`` and ``detail``)
    after: re.Pattern[str] | None = (
        None  # searched for in each earlier operation's repr (``Failure.history``)
    )
    lines: tuple[re.Pattern[str], ...] | None = (
        None  # each searched for in one detail line: the lines it explains; None: the whole divergence
    )


@dataclass(frozen=True)
class KnownFinding:
    id: str  # unique across the files loaded together ("sglang-F1-insert-helper-host")
    title: str  # one line: what the engine does wrong
    system: str  # the registry system the divergence is against
    releases: ReleaseRange  # the releases it affects
    signature: Signature
    upstream: str  # "issue #N / PR #M", or "none found"
    fixed_in: str | None  # a release or commit; None: not fixed (or not known to be)
    doc: str  # where it is written up ("specs/sglang-findings.md#f1")
    source: str  # the file it was loaded from
    trace: str | None = None  # its shrunk trace, relative to the repository root (optional)


@dataclass(frozen=True)
class KnownHit:
    """One divergence that matched a known finding during a run."""

    finding: str  # the finding's id
    example: int  # the example it happened in (1-based, the run's ledger count; per worker with --jobs)
    step: int  # the failing step
    summary: str  # the divergence's first line
    trace: str | None  # the trace of the first hit of this finding in the run, where one was written
    also: tuple[str, ...] = ()  # the other findings that explained some of its lines, in file order


def failing_op(text: str) -> str:
    """The class name of the failing operation in a divergence's summary ("" when none is named: a failure
    of the initial state)."""
    found = _OP.search(text)
    return found.group(1) if found else ""


def failure_field(failure: Failure) -> str:
    """What differed, without its values: the first detail line up to its first ": " (a snapshot diff's
    "ranks[0].nodes[2].lock_ref", an invariant's id, an outcome's system name). Two failures at the same
    step with the same kind, operation and field are "the same failure" (``refcache bisect``)."""
    first = failure.detail.split("; ")[0] if failure.detail else ""
    return first.partition(": ")[0] if ": " in first else first


def _summary(failure: Failure) -> str:
    return failure.message + ("\n" + failure.detail if failure.detail else "")


def detail_lines(failure: Failure) -> list[str]:
    """What differed, one entry a line: ``Failure.detail`` split at ``"; "``, empty lines left out."""
    return [line for line in failure.detail.split("; ") if line.strip()]


@dataclass(frozen=True)
class KnownFindings:
    """The findings of one or more files, in order (``load_known``)."""

    findings: tuple[KnownFinding, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.findings)

    def applying(
        self, failure: Failure | Divergence, releases: Mapping[str, str | None]
    ) -> list[KnownFinding]:
        """The findings that apply to ``failure`` (kind, operation, ``match``, ``after``, system and release:
        module docstring), in file order, whether or not they explain all of it."""
        read = Failure.of(failure) if isinstance(failure, Divergence) else failure
        summary = _summary(read)
        op = failing_op(read.message)
        out: list[KnownFinding] = []
        for finding in self.findings:
            sig = finding.signature
            if finding.system not in releases or not read.kind.startswith(sig.kind):
                continue
            if sig.op != "*" and sig.op != op:
                continue
            if releases[finding.system] not in finding.releases:
                continue
            if not sig.match.search(summary):
                continue
            if sig.after is None or any(sig.after.search(before) for before in read.history):
                out.append(finding)
        return out

    def explain(
        self, failure: Failure | Divergence, releases: Mapping[str, str | None]
    ) -> tuple[KnownFinding, ...]:
        """The findings that together explain every detail line of ``failure`` (module docstring), in file
        order, each explaining at least one line; ``()`` when some line is explained by none of them (the
        divergence is not known). ``releases``: each compared system's name and release (``system_releases``)."""
        read = Failure.of(failure) if isinstance(failure, Divergence) else failure
        found = self.applying(read, releases)
        if not found:
            return ()
        lines = detail_lines(read)
        if not lines:
            return (found[0],)
        explaining: list[KnownFinding] = []
        explained: set[int] = set()
        for finding in found:
            patterns = finding.signature.lines
            mine = {
                i
                for i, line in enumerate(lines)
                if patterns is None or any(pattern.search(line) for pattern in patterns)
            }
            if mine:
                explaining.append(finding)
                explained |= mine
        return tuple(explaining) if len(explained) == len(lines) else ()

    def match(self, failure: Failure | Divergence, releases: Mapping[str, str | None]) -> KnownFinding | None:
        """The first finding (in file order) of those that together explain ``failure`` (``explain``), or
        None when it is not known. ``releases``: each compared system's name and its release
        (``system_releases``)."""
        explaining = self.explain(failure, releases)
        return explaining[0] if explaining else None

    def get(self, finding_id: str) -> KnownFinding:
        for finding in self.findings:
            if finding.id == finding_id:
                return finding
        raise KeyError(finding_id)


def system_releases(systems: Iterable[str]) -> dict[str, str | None]:
    """Each system's release: the installed version of the distribution its registry entry drives
    (``SystemEntry.engine``), or where the entry places it (``SystemEntry.placed``: a post release as
    itself, an SGLang checkout newer than every release at the newest release, whose rows drive it); None
    for a system that drives no engine, or whose engine is not installed."""
    out: dict[str, str | None] = {}
    for name in systems:
        entry = SYSTEMS.get(name)
        release: str | None = None
        if entry is not None and entry.engine is not None:
            try:
                release = metadata.version(entry.engine[0])
            except metadata.PackageNotFoundError:
                release = None
            if release is not None:
                try:
                    placed = entry.placed()
                except RefcacheError:  # not placed: the run's open says why; the version as installed
                    placed = None
                release = placed[0] if placed is not None else release
        out[name] = release
    return out


def _field(
    path: str, where: str, entry: Mapping[str, object], name: str, *, nullable: bool = False
) -> str | None:
    if name not in entry:
        raise KnownFindingsError(f"{path}: {where}: field {name!r} is missing")
    value = entry[name]
    if value is None and nullable:
        return None
    if not isinstance(value, str) or not value.strip():
        kind = "a non-empty string" + (" or null" if nullable else "")
        raise KnownFindingsError(f"{path}: {where}: field {name!r} must be {kind}, not {value!r}")
    return value


def _lines(path: str, where: str, signature: Mapping[str, object]) -> tuple[re.Pattern[str], ...] | None:
    """The signature's optional ``lines``: a non-empty list of regular expressions (None when absent)."""
    if "lines" not in signature:
        return None
    value = signature["lines"]
    if not isinstance(value, list) or not value:
        raise KnownFindingsError(
            f"{path}: {where}: field 'lines' must be a non-empty list of regular expressions, not {value!r}"
        )
    out: list[re.Pattern[str]] = []
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item.strip():
            raise KnownFindingsError(
                f"{path}: {where}: field 'lines'[{i}] must be a non-empty string, not {item!r}"
            )
        try:
            out.append(re.compile(item))
        except re.error as error:
            raise KnownFindingsError(
                f"{path}: {where}: field 'lines'[{i}] is not a regular expression: {error}"
            ) from None
    return tuple(out)


def _finding(path: str, index: int, entry: object) -> KnownFinding:
    if not isinstance(entry, dict):
        raise KnownFindingsError(f"{path}: findings[{index}] must be an object, not {entry!r}")
    raw_id = entry.get("id")
    where = f"finding {raw_id!r}" if isinstance(raw_id, str) and raw_id else f"findings[{index}]"

    def text(name: str) -> str:
        value = _field(path, where, entry, name)
        assert value is not None  # not nullable
        return value

    releases_text = text("releases")
    try:
        releases = ReleaseRange.parse(releases_text)
    except ValueError as error:
        raise KnownFindingsError(f"{path}: {where}: field 'releases': {error}") from None
    signature = entry.get("signature")
    if not isinstance(signature, dict):
        raise KnownFindingsError(f"{path}: {where}: field 'signature' must be an object with kind, op, match")
    sig_where = f"{where}, signature"
    kind = _field(path, sig_where, signature, "kind")
    op = _field(path, sig_where, signature, "op")
    pattern = _field(path, sig_where, signature, "match")
    assert kind is not None and op is not None and pattern is not None
    after = _field(path, sig_where, signature, "after", nullable=True) if "after" in signature else None
    lines = _lines(path, sig_where, signature)
    compiled: dict[str, re.Pattern[str]] = {}
    for name, value in (("match", pattern), ("after", after)):
        if value is None:
            continue
        try:
            compiled[name] = re.compile(value)
        except re.error as error:
            raise KnownFindingsError(
                f"{path}: {sig_where}: field {name!r} is not a regular expression: {error}"
            ) from None
    return KnownFinding(
        id=text("id"),
        title=text("title"),
        system=text("system"),
        releases=releases,
        signature=Signature(kind, op, compiled["match"], compiled.get("after"), lines),
        upstream=text("upstream"),
        fixed_in=_field(path, where, entry, "fixed_in", nullable=True),
        doc=text("doc"),
        source=path,
        trace=_field(path, where, entry, "trace", nullable=True) if "trace" in entry else None,
    )


def _load_one(path: Path) -> list[KnownFinding]:
    name = str(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise KnownFindingsError(f"{name}: cannot be read: {error.strerror or error}") from None
    except json.JSONDecodeError as error:
        raise KnownFindingsError(f"{name}: not JSON: {error}") from None
    if not isinstance(data, dict):
        raise KnownFindingsError(f"{name}: must be an object with 'version' and 'findings'")
    if data.get("version") != FORMAT_VERSION:
        raise KnownFindingsError(
            f"{name}: field 'version' is {data.get('version')!r}; this refcache reads version {FORMAT_VERSION}"
        )
    entries = data.get("findings")
    if not isinstance(entries, list):
        raise KnownFindingsError(f"{name}: field 'findings' must be a list")
    return [_finding(name, i, entry) for i, entry in enumerate(entries)]


def load_known(paths: Sequence[str | Path]) -> KnownFindings:
    """The findings of ``paths``, in order. Raises ``KnownFindingsError`` for a file that cannot be read or a
    bad entry (naming the file, the entry and the field), and for an id listed twice."""
    findings: list[KnownFinding] = []
    seen: dict[str, str] = {}
    for path in paths:
        for finding in _load_one(Path(path)):
            if finding.id in seen:
                raise KnownFindingsError(
                    f"{finding.source}: finding {finding.id!r}: field 'id' is also listed in {seen[finding.id]}"
                )
            seen[finding.id] = finding.source
            findings.append(finding)
    return KnownFindings(tuple(findings))


class KnownRecorder:
    """The ``known`` callback of ``refcache.check.run.run_machines``: records a divergence of ``systems`` that
    matches one of ``findings`` (``hits``) and says so; the example it happened in is ``ledger.runs``. The
    trace of a finding's first hit is kept beside the failure trace as ``NAME.known-ID.jsonl`` (a later
    divergence would overwrite ``NAME.jsonl``)."""

    def __init__(self, findings: KnownFindings, systems: Iterable[str], ledger: Coverage) -> None:
        self.findings = findings
        self.releases = system_releases(systems)
        self.ledger = ledger
        self.hits: list[KnownHit] = []

    def __call__(self, error: Divergence) -> bool:
        explaining = self.findings.explain(error, self.releases)
        if not explaining:
            return False
        finding = explaining[0]
        trace: str | None = None
        if error.trace_path is not None and all(hit.finding != finding.id for hit in self.hits):
            target = error.trace_path.with_name(f"{error.trace_path.stem}.known-{finding.id}.jsonl")
            try:
                os.replace(error.trace_path, target)
                trace = str(target)
            except OSError:
                trace = None
        summary = Failure.of(error).message
        also = tuple(other.id for other in explaining[1:])
        self.hits.append(KnownHit(finding.id, self.ledger.runs, error.step, summary, trace, also))
        return True


def known_report(hits: Sequence[KnownHit], findings: KnownFindings) -> list[str]:
    """The report's lines on known findings: how many divergences matched, per finding (the first that
    explained each divergence) its count, title, upstream reference, the trace of its first hit and the other
    findings that explained lines of the same divergences."""
    if not hits:
        return []
    counts: dict[str, int] = {}
    for hit in hits:
        counts[hit.finding] = counts.get(hit.finding, 0) + 1
    lines = [f"known findings: {len(hits)} divergence{'s' if len(hits) != 1 else ''} matched {len(counts)}"]
    for finding_id, count in counts.items():
        finding = findings.get(finding_id)
        first = next(hit for hit in hits if hit.finding == finding_id)
        where = f"; first in example {first.example}, step {first.step}" + (
            f", trace {first.trace}" if first.trace else ""
        )
        together = sorted({other for hit in hits if hit.finding == finding_id for other in hit.also})
        with_ = f"; with {', '.join(together)} at the same step" if together else ""
        lines.append(f"  {finding_id} ×{count}: {finding.title} ({finding.upstream}){where}{with_}")
    return lines
