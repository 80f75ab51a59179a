"""D-46, ``last_host_node_is_best_match`` (SGLang 0.5.22 on, ``UnifiedTreeCore.match_prefix``): a match reports
its deepest matched node as ``last_host_node``, backed up or not; refcache (and 0.5.20) report the deepest
backed-up node. Under write_back nothing is backed up before an eviction, so one request shows it (the shrunk
trace of the model-versus-0.5.23 fuzzing, seed 3)."""

from __future__ import annotations

from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.hicache.ops import FinishRequest, MatchPrefix, MatchResult, Op, StartRequest
from refcache.model import HiCacheModel

OPS: tuple[Op, ...] = (StartRequest(0, (5, 3, 2, 2, 1, 3), prompt_len=4), FinishRequest(0))
MATCH = MatchPrefix((5, 3, 2, 2, 1, 3, 0, 4, 3, 2, 5, 1, 4, 3, 4))
CONFIG = HiCacheConfig(
    device_size=20,
    page_size=2,
    radix_eviction_policy=EvictionPolicy.MRU,
    hicache_write_policy=WritePolicy.WRITE_BACK,
)


def _match(best: bool) -> object:
    with HiCacheModel(CONFIG.with_fidelity({"last_host_node_is_best_match": best})) as model:
        for op in OPS:
            model.apply(op)
        return model.apply(MATCH)


def test_the_option_is_followed_from_0522() -> None:
    assert PROFILES["sglang-0.5.23"]["last_host_node_is_best_match"]
    assert not PROFILES["sglang-0.5.20"]["last_host_node_is_best_match"]
    assert not PROFILES["refcache"]["last_host_node_is_best_match"]


def test_an_unbacked_match_reports_its_last_node_as_last_host_node() -> None:
    assert _match(best=True) == MatchResult(6, 0, 6, 6)
    assert _match(best=False) == MatchResult(6, 0, 6, 0)
