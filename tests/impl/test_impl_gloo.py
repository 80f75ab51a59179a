"""Two processes, one rank each, over gloo: the same seeded program (with storage faults) on both, the
threads executor, the prefetch threads reducing on their own gloo group. After quiesce the ranks must
hold identical trees (slot numbers aside) and must have made identical collective calls."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
import time

import pytest

from refcache.config import HiCacheConfig

from .impl_harness import gloo_worker

CONFIGS = {
    "mha": HiCacheConfig.from_json(
        {
            "tp_size": 2,
            "page_size": 2,
            "device_size": 32,
            "hicache_write_policy": "write_through",
            "hicache_storage_backend": "file",
            "hicache_io_backend": "direct",
            "prefetch_threshold": 2,
            "load_back_threshold": 1,
            "storage_batch_size": 1,
            "hicache_storage_prefetch_policy": "timeout",
            "prefetch_timeout_base": 0.001,
        }
    ),
    "mla": HiCacheConfig.from_json(
        {
            "tp_size": 2,
            "attention": "MLA",
            "page_size": 1,
            "device_size": 20,
            "hicache_write_policy": "write_back",
            "hicache_storage_backend": "file",
            "hicache_io_backend": "direct",
            "prefetch_threshold": 1,
            "load_back_threshold": 1,
            "storage_batch_size": 2,
        }
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_two_gloo_ranks_stay_identical(name: str) -> None:
    config = CONFIGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        init_file, l3_dir, out_dir = (os.path.join(tmp, n) for n in ("init", "l3", "out"))
        os.makedirs(l3_dir)
        os.makedirs(out_dir)
        spawn = multiprocessing.get_context("spawn")
        procs = [
            spawn.Process(target=gloo_worker, args=(rank, init_file, l3_dir, out_dir, config.dumps(), 7, 200))
            for rank in range(2)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 150
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        if any(p.is_alive() for p in procs):
            for p in procs:
                p.kill()
            pytest.fail("the two ranks did not finish in time (a collective mismatch hangs gloo)")
        assert [p.exitcode for p in procs] == [0, 0]
        results = []
        for rank in range(2):
            with open(os.path.join(out_dir, f"rank{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    r0, r1 = results
    assert r0["violations"] == [] and r1["violations"] == []
    assert r0["view"] == r1["view"]
    assert r0["flushed"] is True and r1["flushed"] is True
    for channel in ("scheduler", "prefetch"):
        calls0 = [c for c in r0["log"] if c[0] == channel]
        calls1 = [c for c in r1["log"] if c[0] == channel]
        assert calls0 == calls1, f"collective sequences differ on channel {channel}"
        assert calls0, f"no collective on channel {channel}"
