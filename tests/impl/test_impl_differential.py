"""The implementation against the reference model: equal observations and snapshots after every step.

Random operation sequences (the machines of ``refcache.check.machines``: scheduler calls, background completions
per rank and queue, clock advances, storage faults) for 1, 2 and 4 ranks, MHA and MLA, every write,
prefetch and eviction policy, page sizes 1, 2 and 4, EAGLE keys, every io backend / layout row of seed
§5.4 and three dtypes; every invariant on the implementation's snapshot after every step.
"""

from __future__ import annotations

from pathlib import Path

from refcache.check import budget
from refcache.check.configs import DIRECT, KERNEL, configs
from refcache.check.harness import Harness
from refcache.check.machines import machine
from refcache.config import HiCacheConfig, IOBackend, WritePolicy
from refcache.gpu.driver import HiCacheImpl
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    Op,
    PrefetchFromStorage,
    ProgressResult,
    StartRequest,
)
from refcache.model import HiCacheModel

MODEL_AND_IMPL = ("model", "impl")
DiffMachine = machine(MODEL_AND_IMPL, configs=configs(transfers=DIRECT), name="DiffMachine")
FaultyDiffMachine = machine(
    MODEL_AND_IMPL, faults=True, configs=configs(transfers=DIRECT), name="FaultyDiffMachine"
)
KernelDiffMachine = machine(
    MODEL_AND_IMPL, configs=configs(tp_sizes=(1, 2), transfers=KERNEL), name="KernelDiffMachine"
)
"""The Triton kernel rows (interpreted without CUDA: slow, so a smaller budget)."""

TestDiff = DiffMachine.TestCase
TestDiff.settings = budget.IMPL.settings()

TestFaultyDiff = FaultyDiffMachine.TestCase
TestFaultyDiff.settings = budget.IMPL.settings()

TestKernelDiff = KernelDiffMachine.TestCase
TestKernelDiff.settings = budget.KERNEL.settings()


# A prefetch terminated between two storage batches: the I/O helper must release the whole unread tail
# when it stops (an early model released ``host_indices[completed:]`` of the already-cut list and lost
# ``completed`` slots). Model and implementation, step by step.
ORPHAN_TAIL: list[Op] = [
    StartRequest(1, (1, 2, 3, 4, 5)),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP),
    CheckHicacheEvents(),
    Evict(100),
    EvictHost(100),
    PrefetchFromStorage(2, (1, 2, 3, 4, 5)),
    CompleteIO(IOQueue.PREFETCH_QUERY),
    CompleteIO(IOQueue.PREFETCH_IO),
    CheckPrefetchProgress(2),
    CompleteIO(IOQueue.PREFETCH_IO),
    CheckHicacheEvents(),
]


def test_orphaned_prefetch_releases_its_whole_tail(tmp_path: Path) -> None:
    config = HiCacheConfig(
        device_size=16,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        hicache_io_backend=IOBackend.DIRECT,
        storage_batch_size=1,
        prefetch_threshold=1,
        load_back_threshold=1,
    )
    with HiCacheImpl(config) as impl:
        model = HiCacheModel(config)
        harness = Harness(model.config, {"model": model, "impl": impl}, trace_dir=tmp_path, family=HICACHE)
        outcomes = [harness.step(op) for op in ORPHAN_TAIL]
    assert outcomes[11] == ProgressResult(done=True, inserted=1)
    assert outcomes[-1] == EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=4)
