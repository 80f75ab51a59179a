"""The coverage ledger: which node states, transitions, in-flight tables, outcomes and situations a run
reached.

A ledger is passed to the machines that fill it (``refcache.check.machines.machine(coverage=...)``); there
is no process-wide one. ``coverage_report`` prints it; ``Coverage.missing`` names what was never reached,
which the coverage test and ``refcache coverage`` turn into a failure. Situations
(``refcache.check.situations``) are the circumstances where real HiCache bugs live; the ledger counts the
steps that reached each. ``failures`` and ``first_failure`` say whether, and in which example, a run
diverged: the zoo measures the default machines through them, without renaming or subclassing them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from refcache.check.situations import SITUATIONS
from refcache.hicache.states import OPTION_TRANSITIONS, TRANSITIONS, NodeState

__all__ = ["TABLES", "Coverage", "coverage_report", "ledger_report"]

TABLES: Final = ("ongoing_write_through", "ongoing_load_back", "ongoing_backup", "ongoing_prefetch")


@dataclass
class Coverage:
    """What the state machines reached, summed over runs."""

    states: Counter[str] = field(default_factory=Counter)
    transitions: Counter[str] = field(default_factory=Counter)
    filled: Counter[str] = field(default_factory=Counter)
    drained: Counter[str] = field(default_factory=Counter)
    outcomes: Counter[str] = field(default_factory=Counter)
    situations: Counter[str] = field(default_factory=Counter)  # steps that reached each situation
    first_reached: dict[str, int] = field(
        default_factory=dict
    )  # situation -> the example (``runs``) first there
    steps: int = 0  # operations applied (every system's step counts once)
    runs: int = 0  # examples started
    failures: int = 0  # steps that raised a divergence (a failing example, its replays)
    first_failure: int = 0  # the example (1-based, counted by ``runs``) that diverged first; 0: none

    def failed(self) -> None:
        """A step of the current example diverged."""
        self.failures += 1
        self.first_failure = self.first_failure or self.runs

    def reached(self, situation: str) -> None:
        """A step of the current example reached ``situation``."""
        self.situations[situation] += 1
        self.first_reached.setdefault(situation, self.runs)

    def missing_situations(self, names: Iterable[str]) -> list[str]:
        """Names of situations among ``names`` never reached (another family's situations: ``ledger_report``)."""
        return [f"situation {s}" for s in names if not self.situations[s]]

    def missing(self) -> list[str]:
        """Names of states, transitions, table fill/drain events and situations never reached."""
        out = [f"state {s.value}" for s in NodeState if s is not NodeState.GONE and not self.states[s.value]]
        out += [
            f"transition {s.value}--{e.value}"
            for (s, e) in TRANSITIONS
            if (s, e) not in OPTION_TRANSITIONS and not self.transitions[f"{s.value}--{e.value}"]
        ]
        out += [f"table {t} filled" for t in TABLES if not self.filled[t]]
        out += [f"table {t} drained" for t in TABLES if not self.drained[t]]
        out += self.missing_situations(SITUATIONS)
        return out


def _firsts(cov: Coverage, situations: Iterable[str]) -> str:
    """One line: the example that first reached each situation that was reached."""
    firsts = [f"{s} #{cov.first_reached[s]}" for s in situations if s in cov.first_reached]
    return "  first reached at example: " + (", ".join(firsts) if firsts else "none")


def coverage_report(cov: Coverage) -> str:
    lines = [f"{cov.runs:,} examples, {cov.steps:,} steps"]
    lines.append(
        "node states:  "
        + ", ".join(f"{s.value}={cov.states[s.value]}" for s in NodeState if s is not NodeState.GONE)
    )
    lines.append("transitions:")
    lines += [
        f"  {s.value:>6} --{e.value:<16}--> {t.value:<6} {cov.transitions[f'{s.value}--{e.value}']}"
        for (s, e), t in TRANSITIONS.items()
    ]
    lines.append("in-flight tables (filled / drained):")
    lines += [f"  {t:<22} {cov.filled[t]:>6} / {cov.drained[t]}" for t in TABLES]
    lines.append("situations (steps that reached each):")
    lines += [f"  {s:<38} {cov.situations[s]:>6}  {meaning}" for s, meaning in SITUATIONS.items()]
    lines.append(_firsts(cov, SITUATIONS))
    lines.append("outcomes:")
    lines += [f"  {k:<40} {v}" for k, v in sorted(cov.outcomes.items())]
    missing = cov.missing()
    if missing:
        lines.append("NOT REACHED: " + ", ".join(missing))
        lines.append(
            "  (what no example of this run did: not a failure, and no bug found. A longer run usually "
            "reaches them; `refcache coverage` exits 1 when its fixed CI budget misses one, a gap in the "
            "tests rather than in the cache.)"
        )
    else:
        lines.append("every state, transition, table event and situation reached")
    return "\n".join(lines)


def ledger_report(cov: Coverage, situations: Mapping[str, str]) -> str:
    """The ledger of a family whose machine runs over ``Rules`` (``refcache.check.machine``): examples and
    steps, then each of the family's ``situations`` (name -> one line of meaning) with the steps that reached
    it and the example that first did, the outcomes counted, and the situations never reached. A family with
    no situations: examples, steps and outcomes."""
    lines = [f"{cov.runs:,} examples, {cov.steps:,} steps"]
    if situations:
        lines.append("situations (steps that reached each):")
        lines += [f"  {s:<38} {cov.situations[s]:>6}  {meaning}" for s, meaning in situations.items()]
        lines.append(_firsts(cov, situations))
    lines.append("outcomes:")
    lines += [f"  {k:<40} {v}" for k, v in sorted(cov.outcomes.items())]
    if situations:
        missing = cov.missing_situations(situations)
        lines.append("NOT REACHED: " + ", ".join(missing) if missing else "every situation reached")
    return "\n".join(lines)
