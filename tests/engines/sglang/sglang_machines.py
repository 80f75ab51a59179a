"""The differential machines for SGLang: the family of ``refcache.check.machines`` over the model and the
SGLang adapter, drawing only configurations the adapter runs, and two adjustments that 0.5.20 needs.

* **Load backs in flight** (``LayerDoneCounter``): 0.5.20 keeps at most ``MAX_PENDING_LOADS`` load backs
  unfinished, because the scheduler's forward pass waits for each batch's load before more batches start.
  Before a ``StartRequest`` the machine completes the oldest loads (``CompleteIO(LOAD)``) so that fewer
  than that many are pending, as the forward pass of the batch that started them would have.
* **Divergences a decision explains**: when the systems diverge, ``refcache.check.explain`` replays the run
  with each decision's fidelity option set as SGLang 0.5.20 does; if one makes the run agree, the
  divergence is documented behaviour, not a bug. The machine records the decision in ``EXPLAINED`` and
  continues the example under that option (every earlier step agrees under it, by construction). A
  divergence no decision explains fails the test.
"""

from __future__ import annotations

from collections import Counter
from typing import ClassVar, Final

from hypothesis import note
from hypothesis import strategies as st

from refcache.check.configs import configs
from refcache.check.coverage import Coverage
from refcache.check.explain import explain
from refcache.check.harness import Divergence, Harness, Outcome
from refcache.check.machines import HiCacheMachine, machine
from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig
from refcache.engines.sglang import MAX_PENDING_LOADS, unsupported
from refcache.ops import CompleteIO, IOQueue, Observation, Op, StartRequest
from refcache.snapshot import Snapshot
from refcache.systems import open_systems

__all__ = ["EXPLAINED", "ROWS", "SGLangMachine", "row_of", "sglang_configs", "sglang_machine"]

SYSTEMS: Final = ("model", "sglang")

EXPLAINED: Counter[str] = Counter()
"""Divergences explained by a decision, by decision id, over every run of this process."""

ROWS: dict[str, Counter[str]] = {}
"""Examples and steps by configuration row (write policy, attention, page size), per machine name."""


def row_of(config: HiCacheConfig) -> str:
    return f"{config.hicache_write_policy.value} {config.attention.value} page_size={config.page_size}"


@st.composite
def sglang_configs(draw: st.DrawFn, /, **constraints: object) -> HiCacheConfig:
    """The configurations of ``refcache.check.configs`` that the adapter runs: one rank, no L3 (every
    eviction policy, write policy, page size, attention and io backend / layout row)."""
    config = draw(configs(tp_sizes=(1,), constraints={"hicache_storage_backend": None, **constraints}))
    assert unsupported(config.resolve()) is None
    return config


class SGLangMachine(HiCacheMachine):
    """``HiCacheMachine`` with the two adjustments of the module docstring."""

    explained: ClassVar[Counter[str]] = EXPLAINED

    def _on_step(self, index: int, op: Op, outcome: Outcome, snap: Snapshot) -> None:
        super()._on_step(index, op, outcome, snap)
        rows = ROWS.setdefault(self.trace_name, Counter())
        row = row_of(self.config)
        rows[f"{row}|steps"] += 1
        if index == 1:
            rows[f"{row}|examples"] += 1

    def run(self, op: Op) -> Observation:
        if isinstance(op, StartRequest):
            self._finish_loads_like_a_forward_pass()
        try:
            return super().run(op)
        except Divergence as error:
            return self._continue_if_explained(error)

    def _finish_loads_like_a_forward_pass(self) -> None:
        snap = self.snapshot()
        pending = dict(snap.ranks[0].queues).get("load_pending", 0)
        if pending >= MAX_PENDING_LOADS:
            super().run(CompleteIO(IOQueue.LOAD, 0, pending - MAX_PENDING_LOADS + 1))

    def _continue_if_explained(self, error: Divergence) -> Observation:
        assert self.harness is not None and self.opened is not None
        ops = list(self.harness.ops)
        decisions = explain(self.config, ops, SYSTEMS)
        if not decisions:
            raise error
        wanted = PROFILES["sglang-0.5.20"]
        config = self.config.with_fidelity(
            {FIDELITY_OPTIONS[d]: wanted[FIDELITY_OPTIONS[d]] for d in decisions}
        )
        for decision in decisions:
            self.explained[decision] += 1
        note(f"explained by {decisions}: continuing under {config.dumps()}")
        self.opened.close()
        self.opened = open_systems(SYSTEMS, config)
        harness = Harness(config, self.opened, trace_name=self.trace_name)
        outcome: Observation | None = None
        for op in ops:
            result = harness.step(op)
            assert not isinstance(result, Exception), result
            outcome = result
        assert outcome is not None
        harness.on_step = self._on_step
        self.harness, self._config = harness, config
        return outcome


def sglang_machine(
    name: str, coverage: Coverage | None = None, /, **constraints: object
) -> type[HiCacheMachine]:
    """The model-versus-SGLang machine over ``sglang_configs(**constraints)``."""
    return machine(
        SYSTEMS,
        configs=sglang_configs(**constraints),
        coverage=coverage,
        name=name,
        base=SGLangMachine,
    )
