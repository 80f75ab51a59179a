"""D-47, ``load_back_evicts_shortfall`` (SGLang 0.5.22 on, ``UnifiedRadixCache.load_back``): a load back short of
device memory evicts the shortfall; refcache (and 0.5.20) evict the load's whole size. The shrunk trace of the
model-versus-0.5.23 write_back fuzzing (seed 1, 163 -> 7 operations)."""

from __future__ import annotations

from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.hicache.ops import FinishRequest, Op, StartRequest, StartResult
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
