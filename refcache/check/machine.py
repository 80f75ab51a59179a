"""What every family's random machine shares: systems opened from the registry, one differential harness,
the coverage ledger, the reference system's snapshot, a failure counted before it propagates.

``FamilyMachine[Op, Obs, Snap]`` is a Hypothesis ``RuleBasedStateMachine`` generic over a family
(``refcache.family``). A family's machine (``refcache.check.machines.HiCacheMachine``,
``refcache.check.vllm_machines.VllmMachine``) subclasses it with its rules — which operation kinds it draws,
with which weights (``kinds``), which operations each kind applies (``KIND_OPS``), and what its ledger counts —
and calls ``draw_kind`` and ``open`` from its rules and ``apply`` for every operation. ``build`` makes the
machine class for some systems, one way for every family: the kinds their entries answer, the ledger, the
class name that fixes the derandomized sample, another seed. The plumbing draws nothing a family did not
draw before: moving it here left every derandomized sample as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, Generic, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence, Harness
from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError
from refcache.family import Family
from refcache.systems import SYSTEMS, OpenSystems, SystemOptions, answered, granularity, open_systems

__all__ = ["FamilyMachine", "build"]

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
                f"it for that rule (the module of {type(self).__mro__[1].__qualname__})"
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
