"""Which releases the recorder records: from 0.5.10 (the scheduler's calls take parameter objects); up to 0.5.9 it
refuses before it wraps anything, naming the calls it does not read and the releases it records. In the smoke set
of ``nox -s sglang_releases``, so each release checks its own side."""

from __future__ import annotations

from pathlib import Path

import pytest

from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.engines.sglang import SGLangSystem, _compat, versions
from refcache.engines.sglang.record import record
from refcache.errors import UnsupportedError
from refcache.hicache.ops import CheckHicacheEvents, FinishRequest, Op, StartRequest
from refcache.hicache.recording import read_recording
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG

ADAPTER = SYSTEMS[SGLANG].load(SGLANG)
"""The adapter of the installed release (HiRadixCache's, or UnifiedRadixCache's from 0.5.21)."""
BEFORE_0510 = _compat.Compat(versions.installed().rows).has("init_load_back_positional")
CONFIG = HiCacheConfig(
    page_size=1, device_size=8, hicache_write_policy=WritePolicy.WRITE_THROUGH
).with_fidelity(PROFILES[versions.installed_profile()])


@pytest.mark.skipif(not BEFORE_0510, reason="the recorder records this release (0.5.10 on)")
def test_recording_up_to_0_5_9_is_refused_before_anything_is_wrapped(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    with ADAPTER(CONFIG) as sglang:
        assert isinstance(sglang, SGLangSystem)
        cls = type(sglang.cache)
        with (
            pytest.raises(UnsupportedError, match=r"up to 0\.5\.9 .*record SGLang 0\.5\.10 or later"),
            record(sglang, path),
        ):
            pass
        assert type(sglang.cache) is cls  # nothing wrapped
        sglang.apply(StartRequest(1, (1, 2, 3)))  # and the adapter still drives it
        sglang.apply(FinishRequest(1))
    assert not path.exists()


@pytest.mark.skipif(BEFORE_0510, reason="up to 0.5.9 the recorder refuses (the test above)")
def test_a_release_from_0_5_10_is_recorded(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    ops: list[Op] = [StartRequest(1, (1, 2, 3)), FinishRequest(1), CheckHicacheEvents()]
    with ADAPTER(CONFIG) as sglang, record(sglang, path):
        for op in ops:
            sglang.apply(op)
    assert read_recording(path).ops == ops
