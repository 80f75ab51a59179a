"""D-47, ``load_back_evicts_shortfall`` (SGLang 0.5.22 on, ``UnifiedRadixCache.load_back``): a load back short of
device memory evicts the shortfall; refcache (and 0.5.20) evict the load's whole size. The shrunk trace of the
model-versus-0.5.23 write_back fuzzing (seed 1, 163 -> 7 operations)."""

from __future__ import annotations

from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.hashing import Token
from refcache.hicache.ops import Evict, FinishRequest, Op, StartRequest, StartResult
from refcache.hicache.states import NodeState
from refcache.model import HiCacheModel

SHARED = (0, 5, 3, 3, 5, 4, 0, 5)
OPS: tuple[Op, ...] = (
    StartRequest(26, (*SHARED, 1, 5, 4, 4, 2), "lora-a", prompt_len=10),
    FinishRequest(26),
    StartRequest(27, tuple(range(3700, 3708))),
    FinishRequest(27),  # writes request 26's nodes back to the host
    StartRequest(31, (*SHARED, 4, 4, 5, 3, 0, 0, 3, 3, 5, 5, 5), prompt_len=4),
    FinishRequest(31),
    StartRequest(32, (*SHARED, 1, 5, 4, 4, 5), "lora-a", prompt_len=4),  # loads 12 tokens back, 8 short
)
CONFIG = HiCacheConfig(
    device_size=32,
    page_size=4,
    load_back_threshold=4,
    radix_eviction_policy=EvictionPolicy.LRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)
TAIL = (*SHARED, 4, 4, 5, 3, 0, 0, 3, 3)  # request 31's node below the shared prefix (no namespace)


def _tail_state(shortfall: bool) -> NodeState:
    with HiCacheModel(CONFIG.with_fidelity({"load_back_evicts_shortfall": shortfall})) as model:
        results = [model.apply(op) for op in OPS]
        assert results[-1] == StartResult(admitted=True, device_hit=0, loaded=12, computed=1)
        rank = model.snapshot().ranks[0]
        return next(n.state for n in rank.nodes if n.id.namespace == "" and n.id.path == TAIL)


def test_the_option_is_followed_from_0522() -> None:
    assert PROFILES["sglang-0.5.23"]["load_back_evicts_shortfall"]
    assert not PROFILES["sglang-0.5.20"]["load_back_evicts_shortfall"]
    assert not PROFILES["refcache"]["load_back_evicts_shortfall"]


def test_a_load_back_evicts_only_what_is_missing() -> None:
    assert _tail_state(shortfall=True) is NodeState.DEVICE, "8 tokens short: request 27's node is enough"
    assert _tail_state(shortfall=False) is NodeState.HOST, (
        "the whole 12: request 31's tail is written back too"
    )


# Under D-42 (evict_request_size_on_admission, up to 0.5.16) the trace above cannot tell the options apart: the
# request's admission right after its load back is short of its computed page and evicts the request's whole
# size, taking what the whole-size load back would have. Page size 1, where the computed token fits either way:
SHORT_OPS: tuple[Op, ...] = (
    StartRequest(1, (1, 2, 3, 4)),
    FinishRequest(1),
    Evict(10000),  # write_back: (1, 2, 3, 4) is backed up and demoted
    StartRequest(2, (10, 11, 12)),
    FinishRequest(2),
    StartRequest(3, (20, 21, 22)),
    FinishRequest(3),
    StartRequest(4, (30, 31, 32, 33)),  # held: 2 device tokens free
    StartRequest(5, (1, 2, 3, 4, 5)),  # loads 4 tokens back, 2 short
)
SHORT_CONFIG = HiCacheConfig(
    device_size=12,
    page_size=1,
    load_back_threshold=1,
    radix_eviction_policy=EvictionPolicy.LRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)


def _states(
    ops: tuple[Op, ...], config: HiCacheConfig, shortfall: bool
) -> dict[tuple[Token, ...], NodeState]:
    with HiCacheModel(config.with_fidelity({"load_back_evicts_shortfall": shortfall})) as model:
        for op in ops:
            model.apply(op)
        return {n.id.path: n.state for n in model.snapshot().ranks[0].nodes}


def test_under_d42_the_first_trace_cannot_tell_and_the_page_size_1_one_can() -> None:
    d42 = PROFILES["sglang-0.5.16"]
    assert d42["evict_request_size_on_admission"] and not d42["load_back_evicts_shortfall"]
    first = CONFIG.with_fidelity(d42)
    assert _states(OPS, first, shortfall=True) == _states(OPS, first, shortfall=False)
    for profile in ("sglang-0.5.16", "sglang-0.5.20"):
        config = SHORT_CONFIG.with_fidelity(PROFILES[profile])
        shortfall, whole = _states(SHORT_OPS, config, True), _states(SHORT_OPS, config, False)
        assert shortfall[(10, 11, 12)] is NodeState.HOST and shortfall[(20, 21, 22)] is NodeState.DEVICE, (
            profile
        )
        assert whole[(10, 11, 12)] is NodeState.HOST and whole[(20, 21, 22)] is NodeState.HOST, profile
