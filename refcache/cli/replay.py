"""``refcache replay``: re-execute a trace step by step on any systems of its family, stopping at the first
divergence or invariant violation; a trace recorded on an engine is compared with what the engine did."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

import typer

from refcache.check.families import StepView
from refcache.check.harness import Divergence
from refcache.check.known import KnownFindings, failing_op, failure_field, system_releases
from refcache.check.shrink import Failure
from refcache.cli.options import (
    DEFAULT_AGAINST,
    Against,
    Json,
    Known,
    Oracle,
    TraceArgument,
    Verbose,
    _log_level,
    against_systems,
    console,
    errors,
    fail,
    known_findings,
    read_trace_of,
    require_installed,
    system_options_of,
)
from refcache.errors import TraceFormatError, UnsupportedError, UsageError
from refcache.systems import engine_placements

SHORT_HELP = "Re-execute a trace step by step; stop at a divergence."

PIPED_WIDTH = 160  # columns of a step's line when stdout is not a terminal
_NUMBERS = re.compile(r"([(\[])(\d+(?:, \d+){5,}),?([)\]])")  # a tuple or list of more than 5 ints


def elide(text: str) -> str:
    """``text`` (a repr) with every tuple or list of more than 5 integers cut to its first 3 and its length:
    ``(0, 1, 2, ... 512 tokens)``."""

    def cut(match: re.Match[str]) -> str:
        items = match.group(2).split(", ")
        return f"{match.group(1)}{', '.join(items[:3])}, ... {len(items)} tokens{match.group(3)}"

    return _NUMBERS.sub(cut, text)


def replay(
    trace: TraceArgument,
    against: Against = DEFAULT_AGAINST,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only print the verdict.")] = False,
    oracle: Oracle = "full",
    known: Known = None,
    as_json: Json = False,
    verbose: Verbose = False,
) -> None:
    """Re-execute a trace step by step, printing one line per step, and stop at the first divergence or
    invariant violation with a readable diff (node by token path, field, both values), in full. Exit 1 then.

    A step's line is cut to the terminal's width (160 columns when piped) and token tuples are elided ("(0, 1, 2, ... 512
    tokens)"); -v prints every step in full. The line ends with the status of the first system:
    t= its logical clock, then per rank rN: L1 and L2 used/capacity (tokens), L3 its stored keys, n tree
    nodes, and the in-flight tables: wt write-throughs (L1 to L2) not yet acknowledged, lb load-backs
    (L2 to L1), bk backups (L2 to L3), pf prefetches (L3 to L2), rq running requests; [queue=n] the I/O
    queues with jobs waiting.

    With --known FILE (repeatable), a divergence that known findings explain (every line of it, each by some
    finding) prints "known finding ID" once per explaining finding and exits 0.
    """
    systems = against_systems(against)
    _log_level(verbose)
    findings = known_findings(known)
    if as_json:
        quiet = True
        try:
            options = system_options_of(systems, oracle)
            family, _config, length = read_trace_of(trace, systems)
            require_installed(systems)
        except typer.Exit as error:  # the reason is printed on stderr (fail)
            _verdict(systems, "cannot drive", reason="see stderr")
            raise error
    else:
        options = system_options_of(systems, oracle)
        family, _config, length = read_trace_of(trace, systems)
        require_installed(systems)
        for words in engine_placements(systems).values():  # a post release, a source checkout: what drives it
            errors.print(f"replay: {words}", highlight=False, markup=False, soft_wrap=True)

    # A terminal's width; piped output (files, CI logs) gets room for the status too, as simulate's tables.
    width = console.width if console.is_terminal else max(console.width, PIPED_WIDTH)

    def show(index: int, op: object, outcome: object, status: str) -> None:
        if quiet:
            return
        if verbose:  # everything, as it is
            line = f"{index:>4} {op!r}\n     -> {outcome!r}\n     {status}"
            console.print(line, highlight=False, soft_wrap=True)
            return
        line = f"{index:>4} {elide(repr(op))} -> {elide(repr(outcome))} | {status}"
        if len(line) > width:
            line = line[: width - 1] + "…"
        console.print(line, highlight=False, markup=False, soft_wrap=True)

    if _recorded(
        trace
    ):  # recorded on an engine: compare with what the engine observed (refcache.hicache.recording)
        _replay_recorded(trace, systems, show, findings)
        return
    try:
        family.replay(trace, systems, options, show)  # the trace is the input: none written
    except (
        UnsupportedError,
        UsageError,
        TraceFormatError,
    ) as error:  # Unsupported: an adapter vs the release
        if as_json:
            _verdict(systems, "cannot drive", reason=f"{type(error).__name__}: {error}")
        raise fail(str(error)) from error
    except Divergence as error:
        if _known(error, systems, findings, as_json):
            return
        if as_json:
            _verdict(systems, "failed", error)
        else:
            console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from error
    except Exception as error:  # a system crashed while opening: a finding, not a usage error
        reason = f"a system crashed when opened: {type(error).__name__}: {error}"
        if as_json:
            _verdict(systems, "crashed", reason=reason)
        else:
            console.print(f"[red]CRASHED[/red] step 0: {reason}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from error
    if as_json:
        _verdict(systems, "clean")
        return
    console.print(
        f"{trace}: {length} steps against {', '.join(systems)}: no divergence, every invariant held",
        highlight=False,
        soft_wrap=True,
    )


def _known(
    error: Divergence, systems: tuple[str, ...], findings: KnownFindings | None, as_json: bool
) -> bool:
    """Whether ``error`` is known: every detail line of it is explained by some of ``findings``
    (``KnownFindings.explain``); if so, say which ("known finding ID", one line each, in file order)."""
    if findings is None:
        return False
    explaining = findings.explain(error, system_releases(systems))
    if not explaining:
        return False
    if as_json:
        _verdict(systems, "known", error, finding=explaining[0].id, findings=[f.id for f in explaining])
    else:
        console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
        for finding in explaining:
            console.print(
                f"known finding {finding.id}: {finding.title} ({finding.upstream}; {finding.doc})",
                highlight=False,
                soft_wrap=True,
            )
    return True


def _verdict(
    systems: tuple[str, ...],
    verdict: str,
    error: Divergence | None = None,
    *,
    finding: str | None = None,
    findings: list[str] | None = None,
    reason: str | None = None,
) -> None:
    """``--json``'s one line: the verdict, the systems' releases, and what diverged."""
    record: dict[str, object] = {"verdict": verdict, "releases": system_releases(systems)}
    if error is not None:
        failure = Failure.of(error)
        record.update(
            step=failure.step,
            kind=failure.kind,
            op=failing_op(failure.message),
            field=failure_field(failure),
            summary=failure.message,
        )
    if finding is not None:
        record["finding"] = finding  # the first explaining finding (kept for readers of the one-id field)
    if findings is not None:
        record["findings"] = findings  # every finding that explains part of the divergence
    if reason is not None:
        record["reason"] = reason
    console.print(json.dumps(record), highlight=False, markup=False, soft_wrap=True)


def _recorded(trace: Path) -> bool:
    from refcache.hicache.recording import is_recorded

    return is_recorded(trace)


def _replay_recorded(
    trace: Path, systems: tuple[str, ...], show: StepView, findings: KnownFindings | None = None
) -> None:
    """A recorded trace: each step's outcome (and snapshot, where recorded) is compared with the engine's."""
    from refcache.check.recorded import replay_recorded
    from refcache.hicache import status_line
    from refcache.hicache.recording import read_recording

    try:
        recording = read_recording(trace)
        steps = replay_recorded(
            recording, systems, on_step=lambda i, op, outcome, snap: show(i, op, outcome, status_line(snap))
        )
    except (UsageError, TraceFormatError) as error:
        raise fail(str(error)) from error
    except Divergence as error:
        if _known(error, systems, findings, as_json=False):
            return
        console.print(f"[red]DIVERGENCE[/red] {error.summary}", highlight=False, soft_wrap=True)
        console.print(f"the engine left the spec at step {error.step}", highlight=False)
        raise typer.Exit(1) from error
    console.print(
        f"{trace}: {steps} recorded steps of {recording.engine} against {', '.join(systems)}: "
        "no divergence, every invariant held",
        highlight=False,
        soft_wrap=True,
    )
