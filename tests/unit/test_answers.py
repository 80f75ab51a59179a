"""Systems that answer part of an alphabet (``SystemEntry.answers``): the machines draw only the rules whose
operations every compared system answers, and a rule that applies anything else fails at once."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.machine import family_machine
from refcache.check.machines import EVICTION_ORDER_KINDS, FAULT_KINDS, KIND_OPS, KINDS, LOAD_KINDS, machine
from refcache.errors import UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import OPS
from refcache.rules.vllm import KIND_OPS as VLLM_KIND_OPS
from refcache.rules.vllm import KINDS as VLLM_KINDS
from refcache.rules.vllm import RULES as VLLM_RULES
from refcache.systems import SYSTEMS, SystemEntry, answered, registered
from refcache.vllm.family import FAMILY as VLLM
from refcache.vllm.ops import OPS as VLLM_OPS

QUICK = settings(budget.Budget(12, 20).settings(derandomize=True, shrink=False), database=None)


def test_every_kind_says_which_operations_it_applies() -> None:
    assert set(KIND_OPS) == {*KINDS, *FAULT_KINDS, *LOAD_KINDS, *EVICTION_ORDER_KINDS}
    assert set(VLLM_KIND_OPS) == set(VLLM_KINDS)
    assert frozenset().union(*KIND_OPS.values()) == frozenset(OPS)
    assert frozenset().union(*VLLM_KIND_OPS.values()) == frozenset(VLLM_OPS)


def test_a_hicache_machine_draws_only_what_is_answered() -> None:
    without = {
        "PrefetchFromStorage",
        "CheckPrefetchProgress",
        "AbortPrefetch",
        "StorageFault",
        "AdvanceClock",
    }
    entry = SystemEntry("the model, answering less", "refcache.model:HiCacheModel",
                        answers=frozenset(k.__name__ for k in OPS) - without)  # fmt: skip
    with registered("partial", entry):
        ops = answered(("model", "partial"), HICACHE)
        assert {k.__name__ for k in OPS} - {k.__name__ for k in ops} == without
        ledger = Coverage()
        hunter = machine(("model", "partial"), faults=True, coverage=ledger, name="PartialMachine")
        drawn = {
            *KINDS,
            *FAULT_KINDS,
        }  # a faulty machine's kinds (LOAD_KINDS, EVICTION_ORDER_KINDS: the others')
        assert set(hunter.kinds) == {k for k, ops_ in KIND_OPS.items() if ops_ <= ops and k in drawn}
        assert "prefetch_cycle" not in hunter.kinds and "start_request" in hunter.kinds
        run_state_machine_as_test(hunter, settings=QUICK)
    assert ledger.runs >= 12 and ledger.steps > 100
    assert not {op.split(":")[0] for op in ledger.outcomes} & without


def test_a_vllm_machine_draws_only_what_is_answered() -> None:
    offload = {"Store", "CompleteStore", "Load", "CompleteLoad"}
    entry = SystemEntry("vLLM's model without offloading", "refcache.vllm.model:VllmModel", family="vllm",
                        answers=frozenset(k.__name__ for k in VLLM_OPS) - offload)  # fmt: skip
    with registered("no-offload", entry):
        ledger = Coverage()
        hunter = family_machine(
            VLLM, VLLM_RULES, ("vllm-model", "no-offload"), coverage=ledger, name="NoOffloadMachine"
        )
        run_state_machine_as_test(hunter, settings=QUICK)
    assert ledger.steps > 100 and not {op.split(":")[0] for op in ledger.outcomes} & offload


def test_a_rule_that_applies_an_unlisted_operation_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard behind KIND_OPS: a rule said to apply only Evict, which also starts requests, is caught."""
    entry = SystemEntry(
        "the model, evicting only", "refcache.model:HiCacheModel", answers=frozenset({"Evict"})
    )
    monkeypatch.setitem(KIND_OPS, "host_pressure", frozenset(KIND_OPS["evict"]))  # a wrong table
    with registered("evicts", entry):
        hunter = machine(("model", "evicts"), coverage=Coverage(), name="EvictOnlyMachine")
        assert set(hunter.kinds) == {"evict", "host_pressure"}
        with pytest.raises(AssertionError, match="KIND_OPS is missing it"):
            run_state_machine_as_test(hunter, settings=QUICK)


def test_an_entry_naming_an_unknown_operation_is_a_usage_error() -> None:
    typo = SystemEntry("x", "refcache.model:HiCacheModel", answers=frozenset({"Evicts"}))
    with (
        registered("typo", typo),
        pytest.raises(UsageError, match="'Evicts' is not an operation of the hicache"),
    ):
        answered(("model", "typo"), HICACHE)
    with pytest.raises(UsageError, match="not an operation of the vllm family"):
        VLLM.op_named("Evict")
    assert "typo" not in SYSTEMS
