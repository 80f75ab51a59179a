"""D-44 on the installed SGLang: the shrunk write_back eviction of ``tests/unit/test_fidelity_d44.py``
replays clean under the release's profile and diverges with ``write_back_per_victim`` flipped, on either
side of 0.5.22 (where ``UnifiedRadixCache._evict_components`` demotes victim by victim)."""

from __future__ import annotations

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.engines.sglang import versions
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import Evict, FinishRequest, Op, StartRequest
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG

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


@pytest.mark.parametrize("flipped", [False, True], ids=["profile", "flipped"])
def test_write_back_eviction_follows_the_release(flipped: bool) -> None:
    profile = PROFILES[versions.installed_profile()]
    follows = profile["write_back_per_victim"] != flipped
    config = CONFIG.with_fidelity({**profile, "write_back_per_victim": follows})
    with HiCacheModel(config) as model, SYSTEMS[SGLANG].load(SGLANG)(config) as sglang:
        harness = Harness(config, {"model": model, "sglang": sglang}, write_trace=False, family=HICACHE)

        def replay() -> None:
            for op in OPS:
                harness.step(op)

        if flipped:
            with pytest.raises(Divergence, match="after Evict"):
                replay()
        else:
            replay()
