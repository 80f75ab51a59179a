"""D-67, ``write_back_flush_skips_storage``: under write_back, SGLang up to 0.5.8 retires the write acks of an eviction's
blocking flush (``writing_check(write_back=True)``, ``hiradix_cache.py`` 0.5.8:276-285) without queueing the demoted
nodes' L2 -> L3 backups; 0.5.9 on backs each up there as after any write ack (0.5.9:671; upstream PR #14718, issue
#14688). Found opening L3 on 0.5.8: test_fuzz_l3's write_back draw diverged on ``ongoing_backup`` after an Evict
(model one backup, SGLang none). The trace (tests/regressions/sglang/decisions/d67-...) replays clean on 0.5.8 and
0.5.9 under their profiles, and diverges on each with the option flipped."""

from __future__ import annotations

from pathlib import Path

from refcache.config import FIDELITY_OPTIONS, PROFILES
from refcache.hicache.trace import read_trace
from refcache.model import HiCacheModel

TRACE = (
    Path(__file__).resolve().parents[1]
    / "regressions"
    / "sglang"
    / "decisions"
    / "d67-write-back-flush-skips-storage.jsonl"
)


def _backups(**options: bool) -> int:
    """L3 backups queued after the trace (a request finished under write_back, then Evict(10000))."""
    config, ops = read_trace(TRACE)
    config = config.with_fidelity({**PROFILES["sglang-0.5.8"], **options})
    with HiCacheModel(config) as model:
        for op in ops:
            model.apply(op)
        return len(model.snapshot().ranks[0].ongoing_backup)


def test_the_option_is_followed_up_to_0_5_8() -> None:
    assert FIDELITY_OPTIONS["D-67"] == "write_back_flush_skips_storage"
    for profile in ("sglang-0.5.3", "sglang-0.5.5", "sglang-0.5.6", "sglang-0.5.8"):
        assert PROFILES[profile]["write_back_flush_skips_storage"], profile
    for profile in ("sglang-0.5.9", "sglang-0.5.10", "sglang-0.5.15", "sglang-0.5.20", "refcache"):
        assert not PROFILES[profile]["write_back_flush_skips_storage"], profile


def test_the_write_back_flush_queues_no_l3_backup_under_the_option() -> None:
    assert _backups() == 0  # 0.5.8: the demoted node is on the host only, never written to L3
    assert _backups(write_back_flush_skips_storage=False) == 1  # 0.5.9 on: backed up to L3 at the flush
