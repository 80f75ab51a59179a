"""BACKUP-SOURCE on the implementation: the host slots a pending L3 backup reads hold its pages until it runs.

A planted bug in the style of the zoo (``quality.zoo``'s source patches): ``evict_host`` frees a host-only leaf
that a pending L3 backup pins, so the backup thread would read slots that are back in the pool. The
implementation alone (no model to compare with) reports it at that ``EvictHost``: BACKUP-SOURCE says which slots
the backup will read and that they are free, STEP-REMOVAL that the node went while pinned. (Where the node stays
and loses only its host copy as a reclaimed duplicate, D-48, as on UnifiedRadixCache up to 0.5.21, U-2,
BACKUP-SOURCE is the only one: ``tests/unit/test_backup_source_d07.py``.)"""

from __future__ import annotations

import pytest
from quality.zoo import Edit, _patched, _resolve

from refcache.check.harness import Divergence, Harness
from refcache.config import HiCacheConfig, IOBackend, WritePolicy
from refcache.gpu.driver import HiCacheImpl
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)
from refcache.model import HiCacheModel
from refcache.systems import HiCacheSystem, OpenSystems

CONFIG = HiCacheConfig(
    device_size=32,
    hicache_ratio=2.0,
    page_size=2,
    hicache_storage_backend="file",
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    hicache_io_backend=IOBackend.DIRECT,
)
# A node backed up to host, its L3 backup enqueued (and pinning it) but not run, then evicted from the device:
# a host-only leaf that only the backup's pin keeps out of evict_host.
PINNED_BY_BACKUP: tuple[Op, ...] = (
    StartRequest(0, tuple(range(1, 9))),
    FinishRequest(0),
    CompleteIO(IOQueue.WRITE),
    CheckHicacheEvents(),
    Evict(8),
    EvictHost(8),
    CompleteIO(IOQueue.BACKUP),
    CheckHicacheEvents(),
)
# The planted bug: evict_host takes a leaf pinned by a backup (or a prefetch) like an unpinned one.
IGNORES_PIN = Edit(
    "refcache.gpu.hiradix_tiers:TieredTree.evict_host",
    "if not x.evicted or x.host_ref_counter > 0:",
    "if not x.evicted:",
)


def _replay(systems: dict[str, HiCacheSystem]) -> None:
    with OpenSystems(systems) as opened:
        harness = Harness(CONFIG, opened, family=HICACHE, write_trace=False)
        for op in PINNED_BY_BACKUP:
            harness.step(op)


@pytest.fixture
def ignores_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    owner, name, original = _resolve(IGNORES_PIN.target)
    monkeypatch.setattr(owner, name, _patched("evict-host-ignores-backup-pin", original, [IGNORES_PIN]))


def test_the_pinned_leaf_survives_evict_host_until_its_backup_ran() -> None:
    _replay({"model": HiCacheModel(CONFIG), "impl": HiCacheImpl(CONFIG)})


def test_host_pages_freed_under_a_pending_backup_are_caught_on_the_implementation_alone(
    ignores_pin: None,
) -> None:
    with pytest.raises(Divergence) as caught:
        _replay({"impl": HiCacheImpl(CONFIG)})
    error = caught.value
    assert error.kind == "invariant violated on impl" and error.step == 6  # the EvictHost
    source = (
        "  [BACKUP-SOURCE] rank 0: backup 0 reads host slots [0, 1, 2, 3, 4, 5, 6, 7] for -:[1, 2, 3, 4, 5, 6, 7, 8], "
        "which is not in the tree (those slots are now free)"
    )
    removal = (
        "  [STEP-REMOVAL] rank 0 node -:[1, 2, 3, 4, 5, 6, 7, 8]: removed while pinned"  # the node went too
    )
    assert str(error).split("\n")[1:3] == [source, removal]
