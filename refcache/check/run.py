"""Running the state machines for a budget of examples, of time, or both, stopping between two examples.

``run_machines`` is what ``refcache fuzz`` runs: the machines take turns, ``chunk`` examples each per
Hypothesis run (fresh random examples, derandomize off), and the budget is checked before every example,
so a run ends within one example of its time budget and exactly at its example budget. Every count is the
coverage ledger's: ``Coverage.runs`` examples started, ``Coverage.steps`` operations applied; progress
bars and the final report read the same ledger.

How a run stops between examples: every machine is wrapped so that its ``@initialize`` rule first asks
the budget, and raises ``BudgetSpent`` when it is spent. ``BudgetSpent`` is a ``KeyboardInterrupt``, the
one exception Hypothesis treats as an interruption rather than a result: it passes straight through (no
shrinking, no replay, and the cut-short example is not recorded, so Hypothesis does not see an example
that stopped drawing early as inconsistent data generation), and the Hypothesis run ends before the
example does anything. The final replay of a failing example is never stopped: the failure always
reaches the caller.

Seeded runs: with ``seed``, every turn of every machine draws its examples from a stream fixed by the seed,
the machine's index and the turn's number (``sub_seed``, applied with Hypothesis'
``seed``), so the same seed and budget draw the same examples on any machine (``refcache fuzz --seed``).
The examples are still fresh within a run: each turn has its own stream.

What a run writes: the example database it is given (Hypothesis saves a failing example there, nothing for
a passing run) and, on a failure, the trace. Hypothesis' own storage directory (by default ``.hypothesis``
in the working directory, where Hypothesis 6.1xx caches the constants it reads from the source of every
local module it sees) is a temporary directory for the run (``hypothesis_storage``), unless
``HYPOTHESIS_STORAGE_DIRECTORY`` names one.

Known findings (``refcache fuzz --known``): with ``known``, a divergence that the machine would fail on (one
that no decision explains) and that ``known`` accepts (it records the divergence and returns True) ends its example with ``KnownStop``, a ``BudgetSpent`` for that example alone:
Hypothesis neither shrinks nor saves the example, so a known bug does not come back first in every later run,
and the loop goes on with the next machine's turn. The rest of that Hypothesis run's examples (at most
``chunk - 1``) are not drawn; the next turn draws fresh ones. Any other divergence fails the run as before.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Final

from hypothesis import seed as hypothesis_seed
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.control import current_build_context
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RuleBasedStateMachine, initialize, run_state_machine_as_test

from refcache.check.budget import Budget
from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence
from refcache.check.machine import FamilyMachine

__all__ = ["BudgetSpent", "KnownStop", "hypothesis_storage", "run_machines", "sub_seed"]

DEFAULT_CHUNK: Final = 10
"""Examples a machine runs before the next one takes over (``refcache fuzz --batch``)."""


def sub_seed(seed: int, *parts: int) -> int:
    """A seed for one part of a seeded run (a worker, a machine's turn), a fixed function of ``seed`` and
    ``parts``: the same run seed gives every part the same stream, run after run, on any machine."""
    text = ":".join(str(p) for p in (seed, *parts)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") >> 1


class BudgetSpent(KeyboardInterrupt):
    """Raised at the start of an example when the run's budget is spent (module docstring)."""


class KnownStop(BudgetSpent):
    """Raised by a machine whose divergence matched a known finding: that example's budget is spent, and
    the run goes on with the next turn (module docstring). Caught before ``BudgetSpent``."""


@contextmanager
def hypothesis_storage() -> Iterator[None]:
    """Hypothesis' storage directory is a temporary one inside the block (and the default again after it),
    unless the environment's ``HYPOTHESIS_STORAGE_DIRECTORY`` names one: a command leaves nothing in the
    working directory that the user did not ask for (module docstring)."""
    if os.environ.get("HYPOTHESIS_STORAGE_DIRECTORY"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="refcache-hypothesis-") as scratch:
        set_hypothesis_home_dir(scratch)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)


def _gated(
    machine: type[RuleBasedStateMachine],
    gate: Callable[[], None],
    known: Callable[[Divergence], bool] | None = None,
) -> type[RuleBasedStateMachine]:
    """``machine`` (one whose ``setup(data)`` is its ``@initialize`` rule, as every family's is) whose
    examples first call ``gate`` (which raises ``BudgetSpent`` to stop the run); with ``known``, a
    ``FamilyMachine`` whose divergence ``known`` accepts ends its example with ``KnownStop``."""
    inner: Callable[[RuleBasedStateMachine, st.DataObject], None] = machine.setup  # type: ignore[attr-defined]

    @initialize(data=st.data())
    def setup(self: RuleBasedStateMachine, data: st.DataObject) -> None:
        if not current_build_context().is_final:  # never stop the replay of a failing example
            gate()
        inner(self, data)

    body: dict[str, object] = {"setup": setup}
    if known is not None and issubclass(machine, FamilyMachine):
        diverged: Callable[[FamilyMachine[object, object, object], Divergence], object] = machine.diverged
        accepts = known

        def known_or_diverged(self: FamilyMachine[object, object, object], error: Divergence) -> object:
            # The family's machine first: a divergence that a decision explains goes on and is no finding.
            try:
                return diverged(self, error)
            except Divergence as failing:
                if accepts(failing):
                    raise KnownStop from failing
                raise

        body["diverged"] = known_or_diverged
    return type(machine.__name__, (machine,), body)


def run_machines(
    machines: Sequence[type[RuleBasedStateMachine]],
    ledger: Coverage,
    *,
    steps: int,
    examples: int | None = None,
    seconds: float | None = None,
    chunk: int = DEFAULT_CHUNK,
    on_example: Callable[[], None] | None = None,
    report: Callable[[str], None] = print,
    database: str | os.PathLike[str] | None = None,
    seed: int | None = None,
    known: Callable[[Divergence], bool] | None = None,
) -> None:
    """Run ``machines`` in turn, ``chunk`` random examples of at most ``steps`` operations each per turn,
    until ``examples`` examples (``ledger.runs``, every machine together) have started or ``seconds`` have
    passed (``None``: no such limit; with neither, until a failure).

    ``ledger`` must be the ledger the machines fill. ``on_example()`` is called before every example
    (progress bars). Hypothesis' own messages go to ``report`` (none is printed for a run the budget
    ended). A failure propagates (``Divergence``, ``AssertionError``, Hypothesis' ``Flaky``). ``database``:
    a directory for Hypothesis' example database (a failing example is saved there and replayed first by
    every later run that shares it, ``refcache fuzz --jobs``); None: no database. ``seed``: the run's seed
    (module docstring); None: Hypothesis' own random examples. ``known(divergence)``: True when the
    divergence is a known finding it has recorded; that example ends and the run goes on (module docstring).
    """
    if chunk < 1 or steps < 1:
        raise ValueError(f"chunk={chunk} and steps={steps} must be >= 1")
    deadline = None if seconds is None else time.monotonic() + seconds
    start_runs = ledger.runs

    def gate() -> None:
        if on_example is not None:
            on_example()
        if examples is not None and ledger.runs - start_runs >= examples:
            raise BudgetSpent
        if deadline is not None and time.monotonic() >= deadline:
            raise BudgetSpent

    gated = [_gated(m, gate, known) for m in machines]
    settings = Budget(chunk, steps).settings(derandomize=False, shrink=False)
    if database is not None:
        settings = hypothesis_settings(settings, database=DirectoryBasedExampleDatabase(str(database)))
    messages: list[str] = []
    with hypothesis_storage():
        turn = 0
        while True:
            turn += 1
            for index, machine in enumerate(gated):
                if seed is not None:
                    hypothesis_seed(sub_seed(seed, index, turn))(machine)
                messages.clear()
                try:
                    with with_reporter(lambda message: messages.append(str(message))):
                        run_state_machine_as_test(machine, settings=settings)  # type: ignore[no-untyped-call, unused-ignore]
                except KnownStop:
                    continue  # recorded by ``known``; Hypothesis' note is about the stop
                except BudgetSpent:
                    return  # Hypothesis' note on how to reproduce this "failure" is about the stop: dropped
                except BaseException:
                    for message in messages:
                        report(message)
                    raise
                for message in messages:
                    report(message)
