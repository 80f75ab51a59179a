"""The threads executor: real worker threads per (queue, rank), in-process ranks meeting in blocking
collectives, the forward pass waiting on layer events. A seeded random program, then quiesce: every
invariant (ranks equal, idle and drained) must hold and a reset must succeed."""

from __future__ import annotations

import faulthandler
from collections.abc import Iterator

import pytest

from refcache.config import HiCacheConfig
from refcache.gpu.driver import HiCacheImpl
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import Reset, ResetResult

from .impl_harness import RandomProgram

CONFIGS = {
    "mha-tp2-wt": HiCacheConfig.from_json(
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
        }
    ),
    "mla-tp4-wb-timeout": HiCacheConfig.from_json(
        {
            "tp_size": 4,
            "attention": "MLA",
            "page_size": 1,
            "device_size": 20,
            "hicache_write_policy": "write_back",
            "hicache_storage_backend": "file",
            "hicache_io_backend": "direct",
            "hicache_mem_layout": "page_first_direct",
            "hicache_storage_prefetch_policy": "timeout",
            "prefetch_threshold": 1,
            "load_back_threshold": 1,
            "prefetch_timeout_base": 0.001,
            "storage_batch_size": 2,
        }
    ),
    "mha-tp2-selective-wait": HiCacheConfig.from_json(
        {
            "tp_size": 2,
            "page_size": 4,
            "device_size": 32,
            "hicache_write_policy": "write_through_selective",
            "hicache_storage_backend": "file",
            "hicache_io_backend": "direct",
            "prefetch_threshold": 4,
            "hicache_storage_prefetch_policy": "wait_complete",
            "load_back_threshold": 4,
            "storage_batch_size": 1,
        }
    ),
}


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(120, exit=True)  # a deadlock fails loudly instead of hanging CI
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1])
def test_random_program_then_quiesce(name: str, seed: int) -> None:
    with HiCacheImpl(CONFIGS[name], executor="threads") as impl:
        program = RandomProgram(impl, seed, faults=True)
        for _ in range(150):
            program.step()
        program.quiesce()
        snap = impl.snapshot()
        assert check_all(snap) == []
        assert all(length == 0 for rank in snap.ranks for _, length in rank.queues)
        assert impl.apply(Reset()) == ResetResult(flushed=True)
        assert check_all(impl.snapshot()) == []
