"""The family interface: each family's directed scenarios hold on its reference model and reach what their
names promise; granularities, the operation lookup and the field diff (each shown failing)."""

from __future__ import annotations

import dataclasses

import pytest

from refcache.errors import UsageError
from refcache.family import EXACT, Family, field_diff
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.family import NO_SLOTS, without_slots
from refcache.hicache.ops import (
    EvictHostResult,
    EvictResult,
    MatchResult,
    ProgressResult,
    ResetResult,
    StartResult,
)
from refcache.model import HiCacheModel
from refcache.vllm.family import FAMILY as VLLM
from refcache.vllm.model import VllmModel
from refcache.vllm.ops import AdmitResult, HitResult, IOResult, LoadResult
from refcache.vllm.ops import ResetResult as VllmReset


def _run_hicache(name: str) -> list[object]:
    scenario = next(s for s in HICACHE.scenarios() if s.name == name)
    outcomes: list[object] = []
    with HiCacheModel(scenario.config) as model:
        before = model.snapshot()
        for op in scenario.ops:
            outcomes.append(model.apply(op))  # a refused operation would raise: every step is accepted
            after = model.snapshot()
            assert HICACHE.check(after) == [] and HICACHE.check_step(before, after, op) == [], (name, op)
            before = after
    return outcomes


def _run_vllm(name: str) -> list[object]:
    scenario = next(s for s in VLLM.scenarios() if s.name == name)
    outcomes: list[object] = []
    with VllmModel(scenario.config) as model:
        before = model.snapshot()
        for op in scenario.ops:
            outcomes.append(model.apply(op))
            after = model.snapshot()
            assert VLLM.check(after) == [] and VLLM.check_step(before, after, op) == [], (name, op)
            before = after
    return outcomes


# What each scenario's name promises, as a predicate over its outcomes on the reference model.
HICACHE_PROMISES = {
    "prefix-hit": lambda o: any(isinstance(x, StartResult) and x.device_hit > 0 for x in o),
    "write-through-acknowledged": lambda o: isinstance(o[-1], MatchResult) and o[-1].device_len == 14,
    "evict-to-host-and-load-back": lambda o: any(isinstance(x, StartResult) and x.loaded > 0 for x in o),
    "evict-least-recent-first": lambda o: (
        [x.num_evicted for x in o if isinstance(x, EvictResult)] == [4]
        and [x.device_len for x in o[-3:] if isinstance(x, MatchResult)] == [4, 0, 4]
    ),
    "evict-host": lambda o: (
        [x.num_evicted for x in o if isinstance(x, EvictHostResult)] == [14]
        and isinstance(o[-1], MatchResult)
        and (o[-1].device_len, o[-1].host_hit_length) == (0, 0)
    ),
    "write-back-on-eviction": lambda o: isinstance(o[-1], MatchResult) and o[-1].host_hit_length == 8,
    "backup-then-prefetch": lambda o: (
        any(isinstance(x, ProgressResult) and x.inserted > 0 for x in o)
        and any(isinstance(x, StartResult) and x.loaded > 0 for x in o)
    ),
    "abort-and-reset": lambda o: [x.flushed for x in o if isinstance(x, ResetResult)] == [False, True],
}
VLLM_PROMISES = {
    "prefix-hit": lambda o: (
        any(isinstance(x, HitResult) and x.hit_tokens > 0 for x in o)
        and any(isinstance(x, AdmitResult) and x.hit_tokens > 0 for x in o)
    ),
    "evict-under-pressure": lambda o: all(not isinstance(x, AdmitResult) or x.admitted for x in o),
    "reset-refused-while-in-use": lambda o: [x.ok for x in o if isinstance(x, VllmReset)] == [False, True],
    "offload-store-and-load": lambda o: any(isinstance(x, LoadResult) and x.loading for x in o),
    "failed-store": lambda o: (
        any(isinstance(x, IOResult) for x in o)
        and all(not isinstance(x, LoadResult) or not x.loading for x in o)
    ),
}


def test_every_scenario_is_named_once_and_has_a_promise() -> None:
    for family, promises in ((HICACHE, HICACHE_PROMISES), (VLLM, VLLM_PROMISES)):
        names = [s.name for s in family.scenarios()]
        assert len(set(names)) == len(names) and set(names) == set(promises), family.name


@pytest.mark.parametrize("name", sorted(HICACHE_PROMISES))
def test_hicache_scenarios_hold_on_the_model_and_keep_their_promise(name: str) -> None:
    assert HICACHE_PROMISES[name](_run_hicache(name))


@pytest.mark.parametrize("name", sorted(VLLM_PROMISES))
def test_vllm_scenarios_hold_on_the_model_and_keep_their_promise(name: str) -> None:
    assert VLLM_PROMISES[name](_run_vllm(name))


def test_a_promise_can_fail() -> None:
    """The promises are not vacuous: each fails on another scenario's outcomes."""
    other = _run_hicache("prefix-hit")
    assert not HICACHE_PROMISES["evict-to-host-and-load-back"](other)
    assert not HICACHE_PROMISES["abort-and-reset"](other)


def test_granularities_and_operation_names() -> None:
    assert HICACHE.project(EXACT) is None and HICACHE.project(NO_SLOTS) is without_slots
    with pytest.raises(UsageError, match="compares at exact, no-slots"):
        HICACHE.project("approximately")
    with pytest.raises(UsageError, match="compares at exact;"):
        VLLM.project(NO_SLOTS)
    assert HICACHE.op_named("Evict").__name__ == "Evict"
    with pytest.raises(UsageError, match="not an operation of the vllm family: Lookup, Admit"):
        VLLM.op_named("Evict")


def test_no_slots_forgets_slot_numbers_only() -> None:
    with HiCacheModel(HICACHE.scenarios()[0].config) as model:
        for op in HICACHE.scenarios()[0].ops:
            model.apply(op)
        snap = model.snapshot()
    rank = snap.ranks[0]
    node = rank.nodes[0]
    assert node.value is not None
    moved = dataclasses.replace(node, value=tuple(v + 1 for v in node.value))
    free = dataclasses.replace(rank.device, free=tuple(reversed(rank.device.free)))
    other = dataclasses.replace(
        snap, ranks=(dataclasses.replace(rank, nodes=(moved, *rank.nodes[1:]), device=free),)
    )
    assert other != snap and without_slots(other) == without_slots(snap)
    shorter = dataclasses.replace(node, value=node.value[:-1])  # one slot fewer is not a slot number
    fewer = dataclasses.replace(snap, ranks=(dataclasses.replace(rank, nodes=(shorter, *rank.nodes[1:])),))
    assert without_slots(fewer) != without_slots(snap)
    assert any(".value" in line for line in HICACHE.diff(snap, fewer, "a", "b"))


def test_field_diff_names_the_field_and_the_element() -> None:
    @dataclasses.dataclass(frozen=True)
    class Leaf:
        x: int

    @dataclasses.dataclass(frozen=True)
    class Root:
        leaves: tuple[Leaf, ...]
        name: str

    a, b = Root((Leaf(1), Leaf(2)), "n"), Root((Leaf(1), Leaf(3)), "m")
    assert field_diff("r", a, b, "A", "B") == ["r.leaves[1].x: A=2 B=3", "r.name: A='n' B='m'"]
    assert field_diff("r", a, a, "A", "B") == []


def test_the_families_are_typed_families() -> None:
    assert type(HICACHE) is Family and type(VLLM) is Family
    assert (HICACHE.reference, VLLM.reference) == ("model", "vllm-model")


@pytest.mark.parametrize("module", ["ops", "snapshot", "invariants", "states", "trace", "recording"])
def test_the_old_import_paths_re_export_the_family_package(module: str) -> None:
    """``refcache.ops`` and the others moved into ``refcache.hicache``; for one release the old path hands out
    the very same objects (README, "Import paths")."""
    import importlib

    old, new = (
        importlib.import_module(f"refcache.{module}"),
        importlib.import_module(f"refcache.hicache.{module}"),
    )
    assert old.__all__ == new.__all__ and new.__all__
    assert all(getattr(old, name) is getattr(new, name) for name in new.__all__)
