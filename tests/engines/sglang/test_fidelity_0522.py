"""D-44..D-50 on the installed SGLang: the shrunk traces of ``tests/unit/test_fidelity_d44.py`` (write_back
eviction victim by victim), ``test_fidelity_d45.py`` (a split's prefix keeps the creation time),
``test_fidelity_d46.py`` (a match's last_host_node is its best match), ``test_fidelity_d47.py`` (a load
back evicts the shortfall), ``test_fidelity_d48.py`` (write_back's evict_host reclaims host duplicates),
``test_fidelity_d49.py`` (an insert frees duplicates node by node) and ``test_fidelity_d50.py`` (a hit on a
refilled node, UnifiedRadixCache from 0.5.19) replay clean under the profile the installed release's system
follows and diverge with the option flipped, on either side of 0.5.22 and on 0.5.19/0.5.20's Unified path."""

from __future__ import annotations

import dataclasses

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.engines.sglang import versions
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    StartRequest,
)
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG

FOLLOWS = SYSTEMS[SGLANG].followed() or versions.installed_profile()
"""The profile the installed release's system follows (``sglang-0.5.20-unified`` for 0.5.20's Unified path)."""

OPS: tuple[Op, ...] = (
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    StartRequest(2, tuple(range(10, 26))),
    FinishRequest(2),
    StartRequest(3, tuple(range(30, 46))),  # evicts request 2's node to the host
    FinishRequest(3),
    Evict(10000),
)
"""The shrunk counterexample (``tests/unit/test_fidelity_d44.py`` checks the model's outcome both ways)."""
CONFIG = HiCacheConfig(
    device_size=20,
    hicache_ratio=1.4,  # 32 host tokens
    page_size=4,
    radix_eviction_policy=EvictionPolicy.MRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)


SPLIT_OPS: tuple[Op, ...] = (
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    StartRequest(2, (9, 8)),
    FinishRequest(2),
    StartRequest(3, (1, 2)),  # splits (1, 2, 3, 4) after (9, 8) was created
    FinishRequest(3),
    Evict(3),
)
SPLIT_CONFIG = HiCacheConfig(
    device_size=16,
    page_size=1,
    radix_eviction_policy=EvictionPolicy.FIFO,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
# D-45 seen in host.free: the open write_back case of specs/sglang-findings-releases.md (0.5.22 and 0.5.23,
# seed 26, 7 operations). The prefetch's lookup splits the lora-a node at (3,); EvictHost frees (3,)'s host
# slot before or after the 1700 node's by the prefix's creation time.
HOST_ORDER_OPS: tuple[Op, ...] = (
    StartRequest(6, (3, 7, 8), "lora-a", prompt_len=3),
    FinishRequest(6),
    StartRequest(7, tuple(range(1700, 1705))),
    FinishRequest(7),
    PrefetchFromStorage(12, (3, 2, 5, 3), "lora-a"),
    StartRequest(13, (3, 7, 0), prompt_len=3),
    EvictHost(10000),
)
HOST_ORDER_CONFIG = HiCacheConfig(
    device_size=6,
    hicache_ratio=2.0,
    page_size=1,
    prefetch_threshold=1,
    radix_eviction_policy=EvictionPolicy.FIFO,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
BEST_MATCH_OPS: tuple[Op, ...] = (
    StartRequest(0, (5, 3, 2, 2, 1, 3), prompt_len=4),
    FinishRequest(0),
    MatchPrefix((5, 3, 2, 2, 1, 3, 0, 4, 3, 2, 5, 1, 4, 3, 4)),
)
BEST_MATCH_CONFIG = HiCacheConfig(
    device_size=20,
    page_size=2,
    radix_eviction_policy=EvictionPolicy.MRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
SHARED = (0, 5, 3, 3, 5, 4, 0, 5)
LOAD_BACK_OPS: tuple[Op, ...] = (
    StartRequest(26, (*SHARED, 1, 5, 4, 4, 2), "lora-a", prompt_len=10),
    FinishRequest(26),
    StartRequest(27, tuple(range(3700, 3708))),
    FinishRequest(27),
    StartRequest(31, (*SHARED, 4, 4, 5, 3, 0, 0, 3, 3, 5, 5, 5), prompt_len=4),
    FinishRequest(31),
    StartRequest(32, (*SHARED, 1, 5, 4, 4, 5), "lora-a", prompt_len=4),  # a load back 8 tokens short
)
LOAD_BACK_CONFIG = HiCacheConfig(
    device_size=32,
    page_size=4,
    load_back_threshold=4,
    radix_eviction_policy=EvictionPolicy.LRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
LOAD_BACK_SHORT_OPS: tuple[Op, ...] = (
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    Evict(10000),  # write_back: (1, 2, 3, 4) is backed up and demoted
    StartRequest(2, (10, 11, 12)),
    FinishRequest(2),
    StartRequest(3, (20, 21, 22)),
    FinishRequest(3),
    StartRequest(4, (30, 31, 32, 33)),  # held: 2 device tokens free
    # a load back 2 tokens short: the shortfall takes (10, 11, 12), the whole size (20, 21, 22) too; either way
    # the one computed token fits, so admission evicts nothing more (D-42 would evict the request's size)
    StartRequest(5, (1, 2, 3, 4, 5)),
)
LOAD_BACK_SHORT_CONFIG = HiCacheConfig(
    device_size=12,
    page_size=1,
    load_back_threshold=1,
    radix_eviction_policy=EvictionPolicy.LRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
DUPLICATE = tuple(range(3000, 3004))
RECLAIM_OPS: tuple[Op, ...] = (
    StartRequest(22, DUPLICATE),
    FinishRequest(22),
    Evict(10000),
    StartRequest(24, DUPLICATE),  # a load back: on both tiers, held by request 24
    CompleteIO(IOQueue.LOAD),
    CheckHicacheEvents(),
    EvictHost(11),  # 0.5.22 on frees the host copy (D-48)
)
RECLAIM_CONFIG = HiCacheConfig(
    device_size=9,
    hicache_ratio=3.0,  # 28 host tokens
    page_size=1,
    load_back_threshold=4,
    radix_eviction_policy=EvictionPolicy.PRIORITY,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
PER_NODE = (5, 5, 3, 0, 2, 0, 3, 0, 3)
PER_NODE_OPS: tuple[Op, ...] = (
    StartRequest(32, tuple(range(4000, 4008))),
    FinishRequest(32),
    StartRequest(35, (*PER_NODE, 1, 5, 4), "lora-a", prompt_len=4),
    StartRequest(41, tuple(range(4100, 4114)), prompt_len=14),
    StartRequest(42, (*PER_NODE, 2, 0), "lora-a", prompt_len=1),
    FinishRequest(35),
    FinishRequest(42),  # its duplicates of two nodes: freed node by node from 0.5.22 on (D-49)
)
PER_NODE_CONFIG = HiCacheConfig(
    device_size=40,
    page_size=4,
    radix_eviction_policy=EvictionPolicy.LFU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
A = tuple(range(1, 9))
REFILL_OPS: tuple[Op, ...] = (
    StartRequest(1, A),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),
    Evict(100),
    StartRequest(2, A),  # 8 host tokens < load_back_threshold: recomputed
    FinishRequest(2),  # refills A: a hit there on UnifiedRadixCache (D-50)
)
REFILL_CONFIG = HiCacheConfig(
    device_size=8, page_size=1, load_back_threshold=10, hicache_write_policy=WritePolicy.WRITE_THROUGH
)
B = (1, 0, 2, 2, 0, 0, 2, 1, 1, 2, 1, 0, 2, 1, 1, 1)
PER_NODE_NO_PROMPT_OPS: tuple[Op, ...] = (
    StartRequest(1, (10, 12, 10, 12, 12, 11, 12, 12, 11, 10, 11, 11, 10, 11, 10, 10)),
    FinishRequest(1),
    StartRequest(2, B[:4]),
    StartRequest(3, B[:4]),
    StartRequest(4, B[:12]),
    StartRequest(5, B),  # computes all of B while 2..4 insert its first three pages as two nodes
    FinishRequest(3),
    FinishRequest(2),
    FinishRequest(4),
    FinishRequest(5),  # its duplicates of two nodes, without D-24's prompt split (0.5.19 has none)
)
CASES = {
    "count_hits_on_refill": (REFILL_CONFIG, REFILL_OPS),
    "free_duplicates_per_node:no-prompt": (PER_NODE_CONFIG, PER_NODE_NO_PROMPT_OPS),
    "free_duplicates_per_node": (PER_NODE_CONFIG, PER_NODE_OPS),
    "reclaim_host_duplicates": (RECLAIM_CONFIG, RECLAIM_OPS),
    "load_back_evicts_shortfall": (LOAD_BACK_CONFIG, LOAD_BACK_OPS),
    "load_back_evicts_shortfall:page-size-1": (LOAD_BACK_SHORT_CONFIG, LOAD_BACK_SHORT_OPS),
    "last_host_node_is_best_match": (BEST_MATCH_CONFIG, BEST_MATCH_OPS),
    "write_back_per_victim": (CONFIG, OPS),
    "split_keeps_creation_time": (SPLIT_CONFIG, SPLIT_OPS),
    "split_keeps_creation_time:host-order": (HOST_ORDER_CONFIG, HOST_ORDER_OPS),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("flipped", [False, True], ids=["profile", "flipped"])
def test_the_trace_follows_the_release(case: str, flipped: bool) -> None:
    base, ops = CASES[case]
    option = case.partition(":")[0]
    profile = PROFILES[FOLLOWS]
    if case == "free_duplicates_per_node" and not profile["reinsert_prompt_prefix"]:
        pytest.skip(
            "its two nodes come from D-24's prompt split, which this release lacks: the no-prompt case"
        )
    if flipped and case == "load_back_evicts_shortfall" and profile["evict_request_size_on_admission"]:
        pytest.skip(
            f"{FOLLOWS} follows D-42 (up to 0.5.16): the request's admission, right after its load back, evicts "
            "its whole size, which takes what the whole-size load back would have: both options give the same "
            "state. The page-size-1 case, whose computed token fits, tests D-47 there"
        )
    if str(base.radix_eviction_policy) in SYSTEMS[SGLANG].excluded().get("radix_eviction_policy", ()):
        pytest.skip(f"the installed release has no {base.radix_eviction_policy} eviction policy")
    if profile["host_pool_rounded_down"]:  # D-56 (up to 0.5.5): the same host capacity from whole pages
        base = dataclasses.replace(base, hicache_ratio=base.host_size / base.device_size)
        assert base.with_fidelity(profile).host_size == CASES[case][0].host_size
    flips = {option: profile[option] != flipped}
    if flipped and option == "count_hits_on_refill":
        flips["count_hits_per_request"] = False  # D-35 (0.5.22 on) counts a refill hit too
    config = base.with_fidelity({**profile, **flips})
    with HiCacheModel(config) as model, SYSTEMS[SGLANG].load(SGLANG)(config) as sglang:
        harness = Harness(config, {"model": model, "sglang": sglang}, write_trace=False, family=HICACHE)

        def replay() -> None:
            for op in ops:
                harness.step(op)

        if flipped:
            with pytest.raises(Divergence):
                replay()
        else:
            replay()


SPLIT_LOAD_OPS: tuple[Op, ...] = (
    StartRequest(1, (5, 7, 8), prompt_len=1),
    FinishRequest(1),
    Evict(1),  # write_back: (7, 8) is backed up and demoted
    StartRequest(
        10, (5, 7, 8), prompt_len=2
    ),  # loads (7, 8) back: 0.5.22 on pins its host copy until the ack
    FinishRequest(10),  # the D-24 re-insert of (5, 7) splits the loading node: the pin's boundary moves up
    CompleteIO(IOQueue.LOAD),
    CheckHicacheEvents(),
)
SPLIT_LOAD_CONFIG = HiCacheConfig(
    device_size=16,
    page_size=1,
    load_back_threshold=1,
    radix_eviction_policy=EvictionPolicy.FIFO,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)


def test_a_load_backs_host_pin_split_by_a_reinsert_is_not_reported() -> None:
    """The write_back fuzzing of 0.5.23 (seed 3, shrunk to 5 operations): the adapter subtracts a load back's
    host pin on every node of its segment, the new prefix of a split included (an adapter mapping, not an
    SGLang bug: the pin goes at the ack). Clean under the installed release's profile."""
    policy = SPLIT_LOAD_CONFIG.radix_eviction_policy
    if str(policy) in SYSTEMS[SGLANG].excluded().get("radix_eviction_policy", ()):
        pytest.skip(f"the installed release has no {policy} eviction policy")
    config = SPLIT_LOAD_CONFIG.with_fidelity(PROFILES[FOLLOWS])
    with HiCacheModel(config) as model, SYSTEMS[SGLANG].load(SGLANG)(config) as sglang:
        harness = Harness(config, {"model": model, "sglang": sglang}, write_trace=False, family=HICACHE)
        for op in SPLIT_LOAD_OPS:
            harness.step(op)
