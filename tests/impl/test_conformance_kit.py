"""The implementation through the conformance kit, as a third party's engine would run it: the HiCache
family's directed scenarios (L3 included) and its random machines, against the reference model."""

from __future__ import annotations

from pathlib import Path

from refcache.config import IOBackend, MemLayout
from refcache.conformance import check_system
from refcache.gpu.driver import HiCacheImpl
from refcache.hicache import FAMILY


def test_the_implementation_conforms_through_the_kit(tmp_path: Path) -> None:
    # Without CUDA, direct copies (the Triton kernels' interpreter is too slow for a budget like this)
    constraints: dict[str, object] = {
        "hicache_io_backend": IOBackend.DIRECT,
        "hicache_mem_layout": MemLayout.LAYER_FIRST,
    }
    report = check_system(
        HiCacheImpl,
        family=FAMILY,
        name="impl-under-test",
        constraints=constraints,
        examples=10,
        trace_dir=tmp_path,
    )
    assert report.skipped == () and len(report.scenarios) == len(FAMILY.scenarios())
    assert report.examples >= 20 and report.steps > 300
