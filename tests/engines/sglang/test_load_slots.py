"""The machines' forward-pass rule on the installed SGLang (specs/sglang-adapter.md, "The machines' load-slot
gap"): the 0.5.23 write_back fuzz's stop (seed 2), shrunk to 12 operations, through the machine's ``run`` over
the model and the installed release's system. From 0.5.22 the UnifiedRadixCache admits a load back only while
fewer than three loads are unreaped (``has_free_load_back_slot``): the rule completes the oldest load and reaps
it (``CheckHicacheEvents``), and the last start is admitted; without the reap the adapter refuses it. Where the
limit counts unfinished loads only (0.5.20's HiRadixCache, the Unified adapter up to 0.5.21) nothing is reaped
and the start is admitted too. ``tests/unit/test_forward_pass_rule.py`` holds the rule's own tests."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.check.machines import machine
from refcache.config import PROFILES, AttentionKind, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.engines.sglang import versions
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)
from refcache.systems import SYSTEMS as REGISTRY

from .sglang_machines import SGLANG, SYSTEMS

CONFIG = HiCacheConfig(
    page_size=1,
    hicache_ratio=3.0,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    radix_eviction_policy=EvictionPolicy.FIFO,
    attention=AttentionKind.MLA,
    device_size=6,
    load_back_threshold=1,
)
TRACE: tuple[Op, ...] = (  # as in tests/unit/test_forward_pass_rule.py
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


def test_the_last_start_finds_a_load_back_slot() -> None:
    entry = REGISTRY[SGLANG]
    counts = entry.counts_unreaped()
    release = versions.release(versions.installed_version()).version
    assert counts == (SGLANG == "sglang-unified" and versions.parse(release) >= versions.parse("0.5.22"))
    profile = entry.followed()
    assert profile is not None
    config = CONFIG.with_fidelity(PROFILES[profile]).resolve()
    cls = machine(SYSTEMS, name="LoadSlotMachine")
    applied: list[Op] = []

    @settings(max_examples=1, database=None, deadline=None)
    @given(st.none())
    def run(_: None) -> None:
        applied.clear()
        rules = cls()
        harness = rules.open(config)
        try:
            for op in TRACE:
                rules.run(op)  # raises on a divergence (the adapter's refusal included)
        finally:
            applied.extend(harness.ops)
            rules.teardown()

    run()
    reaped = applied[-3:] == [CompleteIO(IOQueue.LOAD, 0, 1), CheckHicacheEvents(), TRACE[-1]]
    assert reaped == counts and applied.count(CheckHicacheEvents()) == int(counts)
