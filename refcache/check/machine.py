"""What every family's random machine shares: systems opened from the registry, one differential harness,
the coverage ledger, the reference system's snapshot, a failure counted before it propagates.

``FamilyMachine[Op, Obs, Snap]`` is a Hypothesis ``RuleBasedStateMachine`` generic over a family
(``refcache.family``): it opens systems (``open``), draws a step's kind by weight (``draw_kind``) and applies
every operation through the harness (``apply``). ``build`` makes the machine class for some systems, one way
for every family: the kinds their entries answer, the ledger, the class name that fixes the derandomized
sample, another seed.

A family's random machine is ``family_machine(family, rules, systems, ...)``: one ``RulesMachine`` whose one
initialize rule draws a configuration and whose one rule draws a step, both from the family's ``Rules`` —
data and functions, no machine subclass: the kinds a step draws from with their weights, the operations each
kind applies (``kind_ops``), the configuration strategy, the outcome-detail function the ledger counts by,
and ``draws``, the per-example state whose ``step`` draws one step's operations (a ``Draws`` subclass; its
``observe`` names the ledger situations a step reached). A family's ``Rules`` live with its registration,
above this package (``refcache.rules``); ``refcache.check.families.FamilyChecks.from_rules`` makes the
machines a fuzz run and the zoo take from them. The HiCache machine (``refcache.check.machines``) predates
this: it subclasses ``FamilyMachine`` with rules of its own and its own label scheme, which its derandomized
samples depend on. The plumbing draws nothing a family did not draw before: moving it here left every
derandomized sample as it was.

Where a sample comes from: ``build`` makes every class with ``type()`` here, so its module is this one
wherever its rules live, and Hypothesis, finding no source for it, derandomizes it by its class name (and its
constructor's signature). Renaming a machine moves its sample; moving its rules to another module does not.
Hypothesis also mixes the literals of every local module loaded in the process into its draws (integers, floats
and strings that fit a draw's bounds; ``hypothesis.internal.conjecture.providers``, 6.170 here), so a sample
also depends on which refcache modules the process imported and on their literals: the same machine in a bare
script that never imports ``refcache.model`` and in the vLLM session's pytest draws differently (issue #27).
A change that keeps every integer and float literal, and the modules a session imports, keeps the samples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence, Harness
from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError, UsageError
from refcache.family import Family
from refcache.systems import SYSTEMS, OpenSystems, SystemOptions, answered, granularity, open_systems

__all__ = ["Draws", "FamilyMachine", "Rules", "RulesMachine", "build", "family_machine", "machine_label"]

O = TypeVar("O")  # noqa: E741 - the family's operation, observation and snapshot types
B = TypeVar("B")
S = TypeVar("S")


class FamilyMachine(RuleBasedStateMachine, Generic[O, B, S]):
    """The shared plumbing (module docstring). Class attributes are set by the family's ``machine(...)``
    factory; ``family`` is the subclass's."""

    systems: ClassVar[tuple[str, ...]] = ()  # registry names; the first is the reference
    coverage: ClassVar[Coverage] = Coverage()
    trace_name: ClassVar[str] = "FamilyMachine"  # the trace file a failure writes
    system_options: ClassVar[SystemOptions] = {}  # keyword options per system (``open_systems``)
    kinds: ClassVar[Mapping[str, int]] = {}  # the operation kinds a step draws from, with their weights
    answered: ClassVar[frozenset[type]] = frozenset()  # the operations every system answers (``build``)

    def __init__(self) -> None:
        super().__init__()
        self.opened: OpenSystems[O, B, S] | None = None
        self.harness: Harness[O, B, S] | None = None
        self._draw_kinds = [k for k, w in self.kinds.items() for _ in range(w)]

    def draw_kind(self, data: st.DataObject) -> str:
        """The kind of this step, drawn by weight."""
        kind: str = data.draw(st.sampled_from(self._draw_kinds), label="kind")
        return kind

    @property
    def family(self) -> Family[O, B, S]:
        raise NotImplementedError  # the family's machine says which

    def open(
        self, config: HiCacheConfig, on_step: Callable[[int, O, B | RefcacheError, S], None] | None = None
    ) -> Harness[O, B, S]:
        """Open fresh ``systems`` for ``config`` (closing any open ones) and the harness over them, compared
        at the granularity their entries ask for; ``on_step`` sees every step."""
        if self.opened is not None:
            self.opened.close()
        self.opened = open_systems(self.systems, config, self.system_options, family=self.family)
        self.harness = Harness(
            config,
            self.opened,
            family=self.family,
            trace_name=self.trace_name,
            on_step=on_step,
            compare=granularity(self.systems, self.family),
        )
        return self.harness

    def snapshot(self) -> S:
        """The reference system's snapshot after the last step."""
        assert self.harness is not None
        return self.harness.snapshots[self.systems[0]]

    def apply(self, op: O) -> B | RefcacheError:
        """``op`` through the harness (every system, compared, every invariant checked). A divergence goes to
        ``diverged``, which counts it in the ledger and raises it unless the family's machine goes on."""
        assert self.harness is not None
        if type(op) not in self.answered:
            raise AssertionError(
                f"a rule applied {op!r}, which {', '.join(self.systems)} do not all answer: KIND_OPS is missing "
                f"it for that rule (the kind-to-operations map of {type(self).__name__}'s family)"
            )
        try:
            return self.harness.step(op)
        except Divergence as error:
            return self.diverged(error)

    def diverged(self, error: Divergence) -> B | RefcacheError:
        self.coverage.failed()
        raise error

    def teardown(self) -> None:
        if self.opened is not None:
            self.opened.close()


M = TypeVar("M", bound=RuleBasedStateMachine)


def build(
    base: type[M],
    family: Family[O, B, S],
    systems: Sequence[str],
    *,
    kinds: Mapping[str, int],
    kind_ops: Mapping[str, frozenset[type[O]]],
    label: str,
    coverage: Coverage | None = None,
    name: str | None = None,
    seed: int | None = None,
    trace_name: str | None = None,
    **attributes: object,
) -> type[M]:
    """The machine class over ``systems`` (registry names, the first is the reference) with ``base``'s rules:
    it draws the ``kinds`` whose operations (``kind_ops``) every system answers (all of them, in their order,
    when every system answers the whole alphabet: the default machines' samples), fills ``coverage`` (default:
    a new ledger), is named ``name`` (default ``label``; the name fixes the derandomized sample), writes its
    failing trace as ``trace_name`` (default: the name) and runs ``seed``'s sample when given. ``attributes``
    set the rules' own class attributes."""
    ops = answered([s for s in systems if s in SYSTEMS], family)
    if ops != frozenset(family.ops):
        kinds = {kind: weight for kind, weight in kinds.items() if kind_ops[kind] <= ops}
    chosen: dict[str, object] = {
        "systems": tuple(systems),
        "kinds": kinds,
        "answered": ops,
        "coverage": coverage if coverage is not None else Coverage(),
        "trace_name": trace_name or name or label,
        **attributes,
    }
    if seed is not None:
        chosen["_hypothesis_internal_use_seed"] = seed
    made: type[M] = type(name or label, (base,), chosen)
    return made


def machine_label(systems: Sequence[str]) -> str:
    """The class name of a family machine over ``systems`` (``("toy-model", "toy")`` ->
    ``"ToyModelToyMachine"``): what the commands name a ``family_machine`` and its trace by."""
    return "".join(s.replace("-", " ").title().replace(" ", "") for s in systems) + "Machine"


class Draws(Generic[O, B, S]):
    """One example's draw state and its per-step draw, a family's (``Rules.draws``): ``RulesMachine`` makes one
    per example from the configuration it drew, and calls ``step`` for every step. ``run``, ``snapshot``,
    ``draw_kind`` and ``kinds`` are the machine's."""

    def __init__(self, machine: RulesMachine[O, B, S], config: HiCacheConfig) -> None:
        self.machine = machine

    @property
    def kinds(self) -> Mapping[str, int]:
        """The kinds this machine draws (those the systems answer)."""
        return self.machine.kinds

    def draw_kind(self, data: st.DataObject) -> str:
        return self.machine.draw_kind(data)

    def run(self, op: O) -> B:
        return self.machine.run(op)

    def snapshot(self) -> S:
        return self.machine.snapshot()

    def step(self, data: st.DataObject) -> None:
        """Draw one step (its kind first, ``draw_kind``) and ``run`` its operations."""
        raise NotImplementedError

    def observe(self, op: O, outcome: B | RefcacheError, before: S, after: S) -> Iterable[str]:
        """The ledger situations one step reached (the reference system's snapshots around it); none here."""
        return ()


@dataclass(frozen=True)
class Rules(Generic[O, B, S]):
    """What a family's random machine draws and counts (the module docstring)."""

    kinds: Mapping[str, int]  # a step's kinds with their weights; the order is part of every derandomized run
    kind_ops: Mapping[str, frozenset[type[O]]]  # the operations each kind applies
    configs: st.SearchStrategy[HiCacheConfig]  # an example's configuration
    detail: Callable[[B], str]  # an outcome's class for the ledger (":hit"), appended to the operation's name
    draws: Callable[[RulesMachine[O, B, S], HiCacheConfig], Draws[O, B, S]]  # one example's draw state


class RulesMachine(FamilyMachine[O, B, S]):
    """A family's random machine over its ``Rules`` (``family_machine`` sets ``family_rules`` and ``the_family``)."""

    family_rules: Rules[O, B, S]
    the_family: Family[O, B, S]

    def __init__(self) -> None:
        super().__init__()
        self.draws: Draws[O, B, S] | None = None

    @property
    def family(self) -> Family[O, B, S]:
        return self.the_family

    @initialize(data=st.data())
    def setup(self, data: st.DataObject) -> None:
        config = data.draw(self.family_rules.configs, label="config")
        note(f"config: {config.dumps()}")
        self.draws = self.family_rules.draws(self, config)
        self.open(config)
        self.coverage.runs += 1

    @precondition(lambda self: self.harness is not None)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        assert self.draws is not None
        self.draws.step(data)

    def run(self, op: O) -> B:
        """Apply one operation to every system through the harness (compared, every invariant checked), and
        count it, its outcome's detail and the situations it reached in the ledger."""
        assert self.draws is not None
        before = self.snapshot()
        outcome = self.apply(op)
        note(f"{op!r} -> {outcome!r}")
        after = self.snapshot()
        note(self.the_family.status_line(after))
        self.coverage.steps += 1
        for situation in set(self.draws.observe(op, outcome, before, after)):
            self.coverage.reached(situation)
        if isinstance(outcome, UsageError):
            raise outcome
        assert not isinstance(outcome, Exception), outcome
        self.coverage.outcomes[type(op).__name__ + self.family_rules.detail(outcome)] += 1
        return outcome


def family_machine(
    family: Family[O, B, S],
    rules: Rules[O, B, S],
    systems: Sequence[str],
    *,
    coverage: Coverage | None = None,
    name: str | None = None,
    seed: int | None = None,
    trace_name: str | None = None,
) -> type[RulesMachine[O, B, S]]:
    """The machine class driving ``family``'s ``systems`` (registry names, the first is the reference) with
    ``rules``, filling ``coverage`` (default: a new ledger); ``name`` names the class and so the derandomized
    sample (default ``machine_label(systems)``); ``seed`` runs another sample of it; ``trace_name`` names a
    failure's trace (default: the class name)."""
    base: type[RulesMachine[O, B, S]] = RulesMachine
    return build(
        base,
        family,
        systems,
        kinds=rules.kinds,
        kind_ops=rules.kind_ops,
        label=machine_label(systems),
        coverage=coverage,
        name=name,
        seed=seed,
        trace_name=trace_name,
        family_rules=rules,
        the_family=family,
    )
