"""What every family's random machine shares: systems opened from the registry, one differential harness,
the coverage ledger, the reference system's snapshot, a failure counted before it propagates.

``FamilyMachine[Op, Obs, Snap]`` is a Hypothesis ``RuleBasedStateMachine`` generic over a family
(``refcache.family``). A family's machine (``refcache.check.machines.HiCacheMachine``,
``refcache.check.vllm_machines.VllmMachine``) subclasses it with its rules — which operations it draws, with
which weights, and what its ledger counts — and calls ``open`` from its ``@initialize`` rule and ``apply``
from the others. The plumbing draws nothing: moving it here left every derandomized sample as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Generic, TypeVar

from hypothesis.stateful import RuleBasedStateMachine

from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence, Harness
from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError
from refcache.family import Family
from refcache.systems import OpenSystems, SystemOptions, granularity, open_systems

__all__ = ["FamilyMachine"]

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

    def __init__(self) -> None:
        super().__init__()
        self.opened: OpenSystems[O, B, S] | None = None
        self.harness: Harness[O, B, S] | None = None

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
