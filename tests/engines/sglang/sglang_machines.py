"""The differential machines for SGLang: the family of ``refcache.check.machines`` over the model and the
SGLang adapter, drawing only configurations the adapter runs, with a table of examples and steps per
configuration row.

The two adjustments 0.5.20 needs come with the family, from the registry entry: at most
``SystemEntry.max_pending_loads`` load backs unfinished (``LayerDoneCounter``; the machine completes the
oldest before a ``StartRequest``, as the forward pass of the batch that started them would have; where the
release counts the loads not yet reaped, ``SystemEntry.counts_unreaped_loads``, 0.5.22 on, it also applies
``CheckHicacheEvents()`` at the limit, as the scheduler's next step does: ``test_load_slots.py``), and
divergences that a decision of specs/decisions.md explains (``refcache.check.explain``) are counted in the
ledger as ``explained by D-xx`` and the example goes on under that decision's option. A divergence no
decision explains fails the test.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Final

from hypothesis import strategies as st

from refcache.check.configs import configs
from refcache.check.coverage import Coverage
from refcache.check.harness import Outcome
from refcache.check.machines import KINDS, HiCacheMachine, machine
from refcache.config import HiCacheConfig
from refcache.engines.sglang import unsupported
from refcache.engines.sglang.versions import installed_system
from refcache.hicache.ops import Op
from refcache.hicache.snapshot import Snapshot
from refcache.systems import excluded_values

__all__ = ["ROWS", "SGLangMachine", "explained", "row_of", "sglang_configs", "sglang_machine"]

SGLANG: Final = installed_system()
"""The registered system of the installed release ("sglang" for 0.5.20, "sglang-0.5.23"): the same machines
run on each release in its own environment (``nox -s sglang``, ``nox -s sglang_latest``)."""
SYSTEMS: Final = ("model", SGLANG)

RELEASE_CONSTRAINTS: Final[dict[str, dict[str, object]]] = {}
"""What the machines draw only for one release. None now: 0.5.22 and 0.5.23 run every write policy, as the model
follows what they do differently — D-35..D-38 and D-44..D-49, write_back's host-duplicate reclaim (D-48) and the
free order of a request's duplicates (D-49) last; write_through_selective's extra eviction is D-45
(specs/sglang-adapter.md, "Newer releases", with shrunk traces)."""

ROWS: dict[str, Counter[str]] = {}
"""Examples and steps by configuration row (write policy, attention, page size), per machine name."""


def row_of(config: HiCacheConfig) -> str:
    ranks = f" tp_size={config.tp_size}" if config.tp_size > 1 else ""
    return f"{config.hicache_write_policy.value} {config.attention.value} page_size={config.page_size}{ranks}"


@st.composite
def sglang_configs(draw: st.DrawFn, /, **constraints: object) -> HiCacheConfig:
    """The configurations of ``refcache.check.configs`` that the adapter runs: one rank unless
    ``tp_size=2`` is given (two rank processes), no L3 (every eviction policy, write policy, page size,
    attention and io backend / layout row)."""
    config = draw(
        configs(
            tp_sizes=(1,),
            constraints={"hicache_storage_backend": None, **constraints},
            excluded=excluded_values(SYSTEMS),  # what the installed release has not (up to 0.5.5)
        )
    )
    assert unsupported(config.resolve()) is None
    return config


class SGLangMachine(HiCacheMachine):
    """``HiCacheMachine`` that also counts examples and steps per configuration row (``ROWS``)."""

    def _on_step(self, index: int, op: Op, outcome: Outcome, snap: Snapshot) -> None:
        super()._on_step(index, op, outcome, snap)
        rows = ROWS.setdefault(self.trace_name, Counter())
        row = row_of(self.config)
        rows[f"{row}|steps"] += 1
        if index == 1:
            rows[f"{row}|examples"] += 1


def explained(coverage: Coverage) -> dict[str, int]:
    """Divergences that a decision explained, by decision id, in the runs ``coverage`` counted."""
    prefix = "explained by "
    return {k.removeprefix(prefix): n for k, n in coverage.outcomes.items() if k.startswith(prefix)}


def sglang_machine(
    name: str,
    coverage: Coverage | None = None,
    kinds: Mapping[str, int] = KINDS,
    /,
    **constraints: object,
) -> type[HiCacheMachine]:
    """The model-versus-SGLang machine over ``sglang_configs(**constraints)`` (and the installed release's
    ``RELEASE_CONSTRAINTS``). By default it draws ``KINDS`` only, not the macro kinds of issue #30 items 4 and
    5 (``LOAD_KINDS``, ``EVICTION_ORDER_KINDS``): each of those runs a dozen or more operations, and on
    SGLang's rank processes they tripled the session's time past CI's budget and moved the sample the SGLang
    zoo's catches were measured on. ``kinds`` adds them where a hunt needs one (``zoo_on_sglang.HUNT_KINDS``)
    or an opt-in run drives them all (``nox -s sglang_macro``)."""
    return machine(
        SYSTEMS,
        configs=sglang_configs(**{**RELEASE_CONSTRAINTS.get(SGLANG, {}), **constraints}),
        coverage=coverage,
        name=name,
        base=SGLangMachine,
        kinds=kinds,
    )
