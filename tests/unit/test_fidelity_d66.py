"""D-66, ``failed_write_back_keeps_node``: under write_back, SGLang 0.5.11 to 0.5.14's ``evict`` skips a victim whose
``write_backup`` found no host memory even after ``evict_host``: the node stays on the device and nothing is counted
(``hiradix_cache.py`` 0.5.11:874-880, ``written > 0``). 0.5.10 counts it and then asserts it backed up (sglang.md
§9 #7); 0.5.15 on drops it (``_drop_subtree_no_host``, D-10), as the model does without the option. With L3 the host
fills with slots no eviction may take (storage backups in flight, a prefetch's admission-time allocation), which is
how the fuzz on 0.5.11 reached it (test_fuzz_l3, shrunk to 8 operations)."""

from __future__ import annotations

from pathlib import Path

from refcache.config import FIDELITY_OPTIONS, PROFILES
from refcache.hicache.ops import Evict
from refcache.hicache.trace import read_trace
from refcache.model import HiCacheModel

TRACE = (
    Path(__file__).resolve().parents[1]
    / "regressions"
    / "sglang"
    / "decisions"
    / "d66-failed-write-back-keeps-node.jsonl"
)


def _evicted(**options: bool) -> tuple[int, int]:
    """The last operation's (an Evict on a full host) tokens evicted, and the device's used slots after it."""
    config, ops = read_trace(TRACE)
    config = config.with_fidelity({**PROFILES["sglang-0.5.11"], **options})
    assert isinstance(ops[-1], Evict)
    with HiCacheModel(config) as model:
        for op in ops[:-1]:
            model.apply(op)
        result = model.apply(ops[-1])
        used = config.device_size - len(model.snapshot().ranks[0].device.free)
    return result.num_evicted, used  # type: ignore[union-attr]


def test_the_option_is_followed_from_0_5_11_to_0_5_14() -> None:
    assert FIDELITY_OPTIONS["D-66"] == "failed_write_back_keeps_node"
    for profile in ("sglang-0.5.11", "sglang-0.5.12", "sglang-0.5.13", "sglang-0.5.14"):
        assert PROFILES[profile]["failed_write_back_keeps_node"], profile
    for profile in ("sglang-0.5.10", "sglang-0.5.15", "sglang-0.5.20", "sglang-0.5.23", "refcache"):
        assert not PROFILES[profile]["failed_write_back_keeps_node"], profile


def test_a_victim_short_of_host_stays_on_the_device() -> None:
    assert _evicted() == (0, 2)  # [7, 8] kept: no host slot for its copy
    assert _evicted(failed_write_back_keeps_node=False) == (2, 0)  # D-10: dropped
