"""The machines' forward-pass rule (``HiCacheMachine._finish_loads_like_a_forward_pass``) for a system whose
scheduler keeps at most ``SystemEntry.max_pending_loads`` load backs: before a start it completes the oldest
loads, and where the limit counts the loads not yet reaped (``counts_unreaped_loads``: SGLang 0.5.22 on, whose
``has_free_load_back_slot`` is ``len(ack_load_queue) < num_counters``) it also reaps them with
``CheckHicacheEvents()`` (specs/sglang-adapter.md, "The machines' load-slot gap")."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.check.harness import Divergence
from refcache.check.machines import machine
from refcache.config import AttentionKind, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.engines.sglang import _compat, versions
from refcache.errors import UnsupportedError, UsageError
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    FinishRequest,
    IOQueue,
    Observation,
    Op,
    StartRequest,
)
from refcache.model import HiCacheModel
from refcache.systems import SystemEntry, registered

LIMIT = 3  # LayerDoneCounter.num_counters

# The 0.5.23 write_back fuzz's stop (seed 2, example 47), shrunk to 12 operations: three loads back are out when
# the last start comes; the forward-pass rule completes the oldest, which a scheduler counting unreaped loads
# still counts until loading_check reaps it.
CONFIG = HiCacheConfig(
    page_size=1,
    hicache_ratio=3.0,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    radix_eviction_policy=EvictionPolicy.FIFO,
    attention=AttentionKind.MLA,
    device_size=6,
    load_back_threshold=1,
)
TRACE: tuple[Op, ...] = (
    StartRequest(19, (4, 7, 8), "lora-a", prompt_len=1),
    FinishRequest(19),
    Evict(10000),
    StartRequest(25, (4, 3, 3, 3, 0, 5, 5, 0, 4), "lora-a", prompt_len=2),
    StartRequest(26, (4, 7), "lora-a", prompt_len=2),
    StartRequest(29, (3900,)),
    FinishRequest(29),
    StartRequest(30, (4000,)),
    FinishRequest(30),
    Evict(10000),
    StartRequest(31, (3900,)),
    StartRequest(32, (4000,)),
)


class SlotCountingModel(HiCacheModel):
    """The model behind a scheduler that admits no start while ``LIMIT`` loads back are unreaped on a rank,
    finished or not (as the ``sglang-unified`` adapter refuses one on 0.5.22 on)."""

    def apply(self, op: Op) -> Observation:
        if isinstance(op, StartRequest):
            for record in self.snapshot().ranks:
                queues = dict(record.queues)
                if queues.get("load_pending", 0) + queues.get("load_acks", 0) >= LIMIT:
                    raise UnsupportedError("no free load-back slot")
        return super().apply(op)


def replay(counts_unreaped: bool) -> list[Op]:
    """The shrunk trace through the machine's ``run`` over the model and a slot-counting model whose entry says
    ``counts_unreaped``; the operations the harness applied."""
    entry = SystemEntry(
        "the model, counting unreaped loads",
        SlotCountingModel,
        max_pending_loads=LIMIT,
        counts_unreaped_loads=counts_unreaped,
    )
    applied: list[Op] = []
    with registered("slot-counting", entry):
        cls = machine(("model", "slot-counting"), name="SlotCountingMachine")
        assert cls.max_pending_loads == LIMIT
        assert cls.unreaped_counted_by == (("slot-counting",) if counts_unreaped else ())

        @settings(max_examples=1, database=None)
        @given(st.none())
        def run(_: None) -> None:
            applied.clear()
            rules = cls()
            harness = rules.open(CONFIG.resolve())
            try:
                for op in TRACE:
                    rules.run(op)
            finally:
                applied.extend(harness.ops)
                rules.teardown()

        run()
    return applied


def test_a_scheduler_counting_unreaped_loads_finds_a_slot_at_the_limit() -> None:
    ops = replay(counts_unreaped=True)
    # before the last start: the oldest load completed (the limit on unfinished ones), then reaped
    assert ops[-3:] == [CompleteIO(IOQueue.LOAD, 0, 1), CheckHicacheEvents(), TRACE[-1]]
    assert ops.count(CheckHicacheEvents()) == 1


def test_where_the_limit_counts_unfinished_loads_only_nothing_is_reaped() -> None:
    # The rule as before (the 0.5.20 "sglang" system, sglang-unified up to 0.5.21): the completed load stays
    # unreaped, and a scheduler that counts it refuses the start.
    with pytest.raises(Divergence, match="no free load-back slot"):
        replay(counts_unreaped=False)


def test_counts_unreaped_resolves_a_function(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = SystemEntry("x", "refcache.model:HiCacheModel", counts_unreaped_loads="os:getcwd")
    with pytest.raises(UsageError, match="not a bool"):
        entry.counts_unreaped()
    answers = {}
    for version in ("0.5.19", "0.5.20", "0.5.22", "0.5.23"):
        monkeypatch.setattr(versions, "installed_version", lambda v=version: v)
        asked = f"{_compat.__name__}:installed_unified_counts_unreaped_loads"
        answers[version] = SystemEntry(
            "x", "refcache.model:HiCacheModel", counts_unreaped_loads=asked
        ).counts_unreaped()
    # has_free_load_back_slot from 0.5.22 on (the compat row no_load_back_slot_query up to 0.5.21)
    assert answers == {"0.5.19": False, "0.5.20": False, "0.5.22": True, "0.5.23": True}
