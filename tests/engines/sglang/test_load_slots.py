"""The machines' forward-pass rule on the installed SGLang (specs/sglang-adapter.md, "The machines' load-slot
gap"): the 0.5.23 write_back fuzz's stop (seed 2), shrunk to 12 operations, through the machine's ``run`` over
the model and the installed release's system. From 0.5.22 the UnifiedRadixCache admits a load back only while
fewer than three loads are unreaped (``has_free_load_back_slot``): the rule completes the oldest load and reaps
it (``CheckHicacheEvents``), and the last start is admitted; without the reap the adapter refuses it. Where the
limit counts unfinished loads only (0.5.20's HiRadixCache, the Unified adapter up to 0.5.21) nothing is reaped
and the start is admitted too. Up to 0.5.15 the last start records again the load event the first load's
unretired ack holds (finding R-4, specs/sglang-findings-releases.md): there the run stops on that known
divergence. ``tests/unit/test_forward_pass_rule.py`` holds the rule's own tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.check.harness import Divergence
from refcache.check.known import load_known, system_releases
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

KNOWN = Path(__file__).resolve().parents[3] / "specs" / "sglang-known.json"
R4 = "sglang-R4-load-ack-rearmed-by-slot-reuse"
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
    release = versions.installed().row.version
    assert counts == (SGLANG == "sglang-unified" and versions.parse(release) >= versions.parse("0.5.22"))
    if str(CONFIG.radix_eviction_policy) in entry.excluded().get("radix_eviction_policy", ()):
        pytest.skip(
            f"SGLang {release} has no {CONFIG.radix_eviction_policy} eviction policy (R-4's own trace shows it)"
        )
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

    known = load_known([KNOWN])
    releases = system_releases(SYSTEMS)
    if releases[SGLANG] in known.get(R4).releases:
        # The forward-pass rule completes the first load and the last start reuses its LayerDoneCounter slot:
        # SGLang's ack of the first load reads unfinished again, the model's reads finished.
        with pytest.raises(Divergence) as stopped:
            run()
        found = known.explain(stopped.value, releases)
        assert [f.id for f in found] == [R4], stopped.value
        assert applied[-2:] == [CompleteIO(IOQueue.LOAD, 0, 1), TRACE[-1]]
        return
    run()
    reaped = applied[-3:] == [CompleteIO(IOQueue.LOAD, 0, 1), CheckHicacheEvents(), TRACE[-1]]
    assert reaped == counts and applied.count(CheckHicacheEvents()) == int(counts)
