"""The fidelity options: the model and the implementation follow SGLang 0.5.20 where refcache decided
otherwise (``refcache.config.FIDELITY_OPTIONS``), agree with each other under both profiles, and a divergence
that a decision explains is named by it (``refcache.check.explain``)."""

from __future__ import annotations

import pytest

from refcache.check import budget
from refcache.check.configs import DIRECT, configs
from refcache.check.explain import explain
from refcache.check.harness import Harness
from refcache.check.machines import machine
from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import RefcacheError, UnsupportedError, UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Done,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    StartRequest,
    StartResult,
)
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS, SystemEntry, open_systems

SGLANG_0520 = PROFILES["sglang-0.5.20"]

# D-10: a load back whose nested write-back eviction stages C, then finds no host memory for its parent X
# (the host holds only the chain being loaded and C's copy). 0.5.20 drops X with C and the load succeeds;
# refcache keeps both, the load fails and the request recomputes.
D10_CONFIG = HiCacheConfig(
    device_size=16,
    page_size=1,
    hicache_ratio=1.1,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    load_back_threshold=1,
).resolve()
A, X = tuple(range(100, 116)), (1, 2, 3, 4)
D10_OPS: list[Op] = [
    StartRequest(1, A),
    FinishRequest(1),
    Evict(16),
    StartRequest(2, X),
    FinishRequest(2),
    StartRequest(3, (*X, 5, 6)),
    FinishRequest(3),
    StartRequest(4, A),
]

# D-24: a request with an 8-token sequence whose first 4 tokens are the prompt. 0.5.20 re-inserts the prompt,
# which splits the node at the prompt boundary.
D24_CONFIG = HiCacheConfig(
    device_size=32, page_size=1, hicache_write_policy=WritePolicy.WRITE_THROUGH
).resolve()
D24_OPS: list[Op] = [StartRequest(1, tuple(range(1, 9)), prompt_len=4), FinishRequest(1)]


def run(config: HiCacheConfig, ops: list[Op]) -> tuple[list[Observation], Snapshot]:
    """``ops`` on the model and the implementation side by side (the harness compares every step); the
    outcomes and the final snapshot."""
    with open_systems(("model", "impl"), config) as systems:
        harness = Harness(config, systems, write_trace=False, family=HICACHE)
        outcomes = [harness.step(op) for op in ops]
        assert not any(isinstance(o, RefcacheError) for o in outcomes), outcomes
        return [o for o in outcomes if not isinstance(o, RefcacheError)], harness.snapshots["model"]


def test_d10_refcache_keeps_the_subtree_and_sglang_0520_drops_it() -> None:
    kept = run(D10_CONFIG, D10_OPS)[0][-1]
    dropped = run(D10_CONFIG.with_fidelity({"drop_subtree_without_host": True}), D10_OPS)[0][-1]
    assert kept == StartResult(admitted=True, device_hit=0, loaded=0, computed=16)
    assert dropped == StartResult(admitted=True, device_hit=0, loaded=16, computed=0)


def test_d24_the_prompt_re_insert_splits_at_the_prompt_boundary() -> None:
    whole = run(D24_CONFIG, D24_OPS)[1].ranks[0].nodes
    split = run(D24_CONFIG.with_fidelity({"reinsert_prompt_prefix": True}), D24_OPS)[1].ranks[0].nodes
    assert [(n.key_len, n.priority, n.hit_count) for n in whole] == [(8, 0, 1)]
    # Split at the prompt boundary, no extra hit (chunked). As in 0.5.20's insert, priority + 1 lands on the
    # matched node before it is split, so the output half carries it too.
    assert [(n.key_len, n.priority, n.hit_count) for n in split] == [(4, 1, 1), (4, 1, 1)]


def test_prompt_len_changes_nothing_by_default_and_is_checked() -> None:
    without = [StartRequest(1, tuple(range(1, 9))), *D24_OPS[1:]]
    assert run(D24_CONFIG, D24_OPS) == run(D24_CONFIG, without)
    with open_systems(("model", "impl"), D24_CONFIG) as systems:
        outcome = Harness(D24_CONFIG, systems, write_trace=False, family=HICACHE).step(
            StartRequest(1, (1, 2), prompt_len=3)
        )
    assert isinstance(outcome, UsageError) and "prompt_len" in str(outcome)


def test_a_node_whose_priority_rose_stays_evictable() -> None:
    """The D-24 re-insert raises the priority of nodes already in the leaf heaps: the heap key must follow
    (found by the SGLang adapter, specs/sglang-adapter.md #1: the stale entry was skipped, nothing was
    evicted and the last request was refused)."""
    config = HiCacheConfig(
        device_size=9, page_size=1, radix_eviction_policy=EvictionPolicy.PRIORITY
    ).resolve()
    ops: list[Op] = [
        StartRequest(1, (1, 0, 0, 5, 3, 2), prompt_len=3),
        StartRequest(7, (0, 5, 3), prompt_len=2),
        FinishRequest(7),
        StartRequest(9, (7, 8)),
    ]
    last = run(config.with_fidelity(SGLANG_0520), ops)[0][-1]
    assert last == StartResult(admitted=True, device_hit=0, loaded=0, computed=2)


class Follows0520(HiCacheModel):
    """A stand-in engine for the explanation: the model, always under the sglang-0.5.20 profile."""

    def __init__(self, config: HiCacheConfig) -> None:
        super().__init__(config.with_fidelity(SGLANG_0520))


class Liar(Follows0520):
    """Also misreports every finish: a divergence no decision explains."""

    def apply(self, op: Op) -> Observation:
        outcome = super().apply(op)
        return Done() if isinstance(op, FinishRequest) else outcome


@pytest.fixture
def engines(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, target in (("as-0520", "Follows0520"), ("liar-0520", "Liar")):
        entry = SystemEntry("test engine", f"{__name__}:{target}", follows="sglang-0.5.20")
        monkeypatch.setitem(SYSTEMS, name, entry)


@pytest.mark.usefixtures("engines")
@pytest.mark.parametrize(
    ("config", "ops", "decision"), [(D10_CONFIG, D10_OPS, "D-10"), (D24_CONFIG, D24_OPS, "D-24")]
)
def test_a_divergence_a_decision_explains_is_named_by_it(
    config: HiCacheConfig, ops: list[Op], decision: str
) -> None:
    assert explain(config, ops, ("model", "as-0520")) == [decision]
    assert explain(config.with_fidelity(SGLANG_0520), ops, ("model", "as-0520")) == []  # nothing to explain


@pytest.mark.usefixtures("engines")
def test_a_bug_is_explained_by_no_decision() -> None:
    assert explain(D24_CONFIG, D24_OPS, ("model", "liar-0520")) == []
    assert explain(D24_CONFIG, D24_OPS, ("model", "impl")) == []  # both read the config: nothing to explain


# The model and the implementation agree under the sglang-0.5.20 profile too (prompt lengths are drawn there).
FidelityMachine = machine(
    ("model", "impl"),
    faults=True,
    # D-01's and D-07's options are the model's only (the implementation refuses them with L3).
    configs=configs(
        transfers=DIRECT,
        constraints={
            **SGLANG_0520,
            "allocate_prefetch_after_query": False,
            "backup_protects_passed_node_only": False,
        },
    ),
    name="FidelityMachine",
)
TestFidelityMachine = FidelityMachine.TestCase
TestFidelityMachine.settings = budget.FIDELITY.settings()


# D-01: a prefetch of 8 tokens of which L3 holds 4. The seed's pipeline allocates host memory for all 8 at
# admission and gives back the 4 the query did not find; 0.5.20's allocates nothing until the drain of the
# hit query, then exactly the 4 hits.
D01_CONFIG = HiCacheConfig(
    device_size=16,
    page_size=1,
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    hicache_storage_backend="file",
    prefetch_threshold=1,
).resolve()
D01_OPS: list[Op] = [
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 1),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP, 0, 1),
    CheckHicacheEvents(),
    Evict(100),
    EvictHost(100),
    PrefetchFromStorage(2, (1, 2, 3, 4, 5, 6, 7, 8)),
]


def _held(config: HiCacheConfig, ops: list[Op]) -> list[tuple[tuple[str, int], ...]]:
    """Host slots held outside the tree after each of the last steps (label, how many)."""
    out = []
    with HiCacheModel(config) as model:
        for op in ops:
            model.apply(op)
            out.append(tuple((label, len(slots)) for label, slots in model.snapshot().ranks[0].host.held))
    return out


def test_d01_0520_allocates_only_the_hits_after_the_query() -> None:
    after: list[Op] = [CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1), CheckHicacheEvents()]
    seed = _held(D01_CONFIG, [*D01_OPS, *after])[-3:]
    pipeline_0520 = _held(
        D01_CONFIG.with_fidelity({"allocate_prefetch_after_query": True}), [*D01_OPS, *after]
    )
    assert seed == [(("prefetch:1", 8),), (("prefetch:1", 4), ("release_queue", 4)), (("prefetch:1", 4),)]
    assert pipeline_0520[-3:] == [(), (), (("prefetch:1", 4),)]


def test_d01_the_implementation_refuses_the_0520_pipeline_with_l3() -> None:
    with pytest.raises(UnsupportedError, match="allocate_prefetch_after_query"):
        open_systems(("model", "impl"), D01_CONFIG.with_fidelity({"allocate_prefetch_after_query": True}))
    with pytest.raises(UnsupportedError, match="backup_protects_passed_node_only"):
        open_systems(("model", "impl"), D01_CONFIG.with_fidelity({"backup_protects_passed_node_only": True}))


def test_d13_0520_prefetches_below_a_device_only_last_node() -> None:
    ops: list[Op] = [
        StartRequest(1, (1, 2, 3, 4)),
        FinishRequest(1),
        PrefetchFromStorage(2, (1, 2, 3, 4, 5, 6)),
    ]
    config = HiCacheConfig(
        **{**D01_CONFIG.__dict__, "hicache_write_policy": WritePolicy.WRITE_BACK}
    ).resolve()
    assert run(config, ops)[0][-1] == PrefetchResult(False, "last_node_not_backuped", 2)
    followed = run(config.with_fidelity({"prefetch_below_last_host_node": True}), ops)[0][-1]
    assert followed == PrefetchResult(True, "admitted", 2)


@pytest.mark.usefixtures("engines")
def test_a_divergence_two_decisions_explain_only_together_is_named_by_both() -> None:
    """D-24's re-insert first, then D-10's write-back: neither option alone replays the trace clean (each
    leaves the other's divergence), both together do; the unrelated decisions the profile also sets are left
    out of the set."""
    ops = [StartRequest(11, tuple(range(200, 208)), prompt_len=4), FinishRequest(11), *D10_OPS]
    assert explain(D10_CONFIG, ops, ("model", "as-0520")) == ["D-10", "D-24"]
    assert explain(D10_CONFIG, ops, ("model", "liar-0520")) == []  # no set explains a bug
