"""``refcache explore --against model,impl`` finds zoo bugs (``tests/quality/zoo.py``) at their minimal depth:
breadth first, every transition of every smaller depth ran in lock step without a divergence first.
specs/exploration.md has the whole table (``tests/quality/measure_explore.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from refcache.check.enabled import Bounds
from refcache.check.explore import Explored, Space, explore
from refcache.config import HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
    StorageFault,
)

from .measure_explore import BASE as HUNT_BASE
from .measure_explore import HUNTS
from .zoo import ZOO

BASE = HiCacheConfig(
    page_size=1,
    device_size=2,
    hicache_ratio=2.0,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    hicache_storage_backend="file",
    prefetch_threshold=1,
    prefetch_timeout_base=0.001,
    load_back_threshold=1,
    storage_batch_size=1,
    hicache_io_backend=IOBackend.DIRECT,  # the lock step's (measure_explore.py says why)
)
SEQUENCES = ((1,), (1, 2))


@pytest.mark.parametrize(
    ("slug", "options", "depth"),
    [
        (
            "wait-complete-on-empty-hashes",
            {"hicache_storage_prefetch_policy": PrefetchPolicy.WAIT_COMPLETE},
            2,
        ),
        ("prefetch-tail-released-twice", {}, 2),
        ("evict-host-never-counts", {"hicache_storage_backend": None}, 4),
    ],
)
def test_a_zoo_bug_is_found_at_its_minimal_depth(slug: str, options: dict[str, object], depth: int) -> None:
    bug = next(b for b in ZOO if b.slug == slug)
    space = Space(dataclasses.replace(BASE, **options).resolve(), Bounds(SEQUENCES))  # type: ignore[arg-type]
    with bug.applied():
        result = explore(space, depth=depth + 1, against=("model", "impl"))
    cx = result.counterexample
    assert cx is not None and cx.depth == depth, cx
    assert result.lockstep_depth == depth - 1  # every shorter sequence ran in lock step and agreed


# A state where the page of (1,) lies only in L3: written back, backed up, acknowledged, evicted from the host.
ONLY_IN_L3: tuple[Op, ...] = (
    StartRequest(0, (1,)),
    FinishRequest(0),
    Evict(1),
    CompleteIO(IOQueue.BACKUP, 0, 1),
    CheckHicacheEvents(),
    EvictHost(1),
)


def _hunted(slug: str, depth: int, *, check_path: bool = False, prefix: tuple[Op, ...] = ()) -> Explored:
    bug, hunt = next(b for b in ZOO if b.slug == slug), HUNTS[slug]
    config = dataclasses.replace(BASE, **hunt.config).resolve()  # type: ignore[arg-type]
    space = Space(config, hunt.bounds(), token_symmetry=hunt.token_symmetry, prefix=prefix)
    with bug.applied():
        return explore(space, depth=depth, against=("model", "impl"), check_path=check_path)


@pytest.mark.parametrize(("slug", "depth"), [("eviction-ignores-priority", 5), ("split-drops-priority", 3)])
def test_a_zoo_bug_is_found_on_its_smallest_space(slug: str, depth: int) -> None:
    """Hunts of measure_explore.py that are cheap from the initial state (about 4 and 2 s): found at their
    minimal depth; ``split-drops-priority`` through its prompt length (``Bounds.prompt_lens``)."""
    result = _hunted(slug, depth + 1)
    cx = result.counterexample
    assert cx is not None and cx.depth == depth, cx
    assert result.lockstep_depth == depth - 1


def test_a_damaged_l3_object_is_found_from_a_state_with_the_page_only_in_l3() -> None:
    """``l3-checksum-ignored`` from ONLY_IN_L3 (about 2 s): prefetch, query, flip the object, read; 4 operations
    after the prefix, every 3 of them agreeing first (the operations of the prefix replayed checked)."""
    result = _hunted("l3-checksum-ignored", 5, prefix=ONLY_IN_L3)
    cx = result.counterexample
    assert cx is not None and cx.depth == len(ONLY_IN_L3) + 4, cx
    assert isinstance(cx.ops[-2], StorageFault) and result.lockstep_depth == 3


def test_a_prefetch_read_on_one_rank_only_is_found_from_a_state_with_the_page_only_in_l3() -> None:
    """``prefetch-progress-early-return`` on two ranks from ONLY_IN_L3 (both ranks' backups acknowledged): a
    prefetch that one rank has read and the other not yet, checked; 5 operations after the prefix, no fault
    needed (measure_explore's hunt, with DELETE faults in its alphabet, finds the same trace)."""
    bug = next(b for b in ZOO if b.slug == "prefetch-progress-early-return")
    config = dataclasses.replace(
        BASE, tp_size=2, hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE
    ).resolve()
    prefix = (*ONLY_IN_L3[:4], CompleteIO(IOQueue.BACKUP, 1, 1), *ONLY_IN_L3[4:])
    with bug.applied():
        result = explore(
            Space(config, Bounds(((1,),), matches=False), prefix=prefix), depth=6, against=("model", "impl")
        )
    cx = result.counterexample
    assert cx is not None and cx.depth == len(prefix) + 5, cx
    assert isinstance(cx.ops[-1], CheckPrefetchProgress) and result.lockstep_depth == 4


@pytest.mark.parametrize(
    ("slug", "depth", "last"),
    [
        ("prefetch-hits-reduced-by-max", 4, CompleteIO),
        ("prefetch-anchor-not-touched", 4, Evict),
        ("prefetch-release-by-min-completed", 5, CheckPrefetchProgress),
    ],
)
def test_a_zoo_bug_is_found_after_its_hunts_prefix(slug: str, depth: int, last: type[Op]) -> None:
    """The hunts of measure_explore.py that start after a prefix of their own (a state the alphabet cannot
    reach, or reaches only deep), on its BASE: each found at its minimal depth after the prefix, every
    shorter continuation having agreed in lock step (about 5, 10 and 15 s)."""
    bug, hunt = next(b for b in ZOO if b.slug == slug), HUNTS[slug]
    config = dataclasses.replace(HUNT_BASE, **hunt.config).resolve()  # type: ignore[arg-type]
    space = Space(config, hunt.bounds(), token_symmetry=hunt.token_symmetry, prefix=hunt.prefix)
    with bug.applied():
        result = explore(space, depth=depth, against=("model", "impl"))  # the depth counts after the prefix
    cx = result.counterexample
    assert cx is not None and cx.depth == len(hunt.prefix) + depth, cx
    assert isinstance(cx.ops[-1], last) and result.lockstep_depth == depth - 1, cx


# Operation classes the three hunts below need none of: left out of their pins to keep them cheap (their
# hunts in measure_explore.py keep the whole alphabet and find the same depth, in 12, 22 and 118 s).
UNUSED = frozenset({"AbortRequest", "CacheUnfinishedRequest", "Reset"})


@pytest.mark.parametrize(
    ("slug", "depth", "narrowed", "last"),
    [
        ("host-pages-freed-under-load", 7, {"without": UNUSED}, StartRequest),
        (
            "write-back-failed-backup-as-done",
            7,
            {"without": UNUSED | {"PrefetchFromStorage", "EvictHost"}},
            StartRequest,
        ),
        (
            "prefetch-host-under-device-node",
            6,
            {
                "without": UNUSED | {"AbortPrefetch", "Evict", "EvictHost"},
                "max_running": 1,
                "max_prefetching": 1,
            },
            CheckPrefetchProgress,
        ),
    ],
)
def test_a_zoo_bug_is_found_on_its_narrowed_smallest_space(
    slug: str, depth: int, narrowed: dict[str, object], last: type[Op]
) -> None:
    """The three hunts a hand-worked sequence located (specs/exploration.md), on their space with operation
    classes the bug needs none of left out (about 3, 3 and 4 s of CPU): each found at its minimal depth
    within that alphabet (after the prefix for ``prefetch-host-under-device-node``), every shorter sequence
    having agreed in lock step. The load back's pin (7: MRU makes the matched page the host's first victim),
    the write-back that finds every host page pinned (7: one by a pending L3 backup, one by the load back),
    the prefetch that attaches (2,) below the device-only (1,) a request inserted meanwhile (6)."""
    bug, hunt = next(b for b in ZOO if b.slug == slug), HUNTS[slug]
    hunt = dataclasses.replace(hunt, **narrowed)  # type: ignore[arg-type]
    config = dataclasses.replace(HUNT_BASE, **hunt.config).resolve()  # type: ignore[arg-type]
    space = Space(config, hunt.bounds(), token_symmetry=hunt.token_symmetry, prefix=hunt.prefix)
    with bug.applied():
        result = explore(space, depth=depth, against=("model", "impl"))
    cx = result.counterexample
    assert cx is not None and cx.depth == len(hunt.prefix) + depth, cx
    assert isinstance(cx.ops[-1], last) and result.lockstep_depth == depth - 1, cx


def test_a_path_replayed_unchecked_reaches_the_verdicts_a_checked_one_does() -> None:
    """The lock step replays a transition's path without the harness' checks and checks the transition only
    (explore._at_parent); replaying every step checked, as before, gives the same counterexample, message
    and counts: ``missing-per-layer-wait``, found at its minimal depth, 5, on its smallest space."""
    fast, checked = (
        _hunted("missing-per-layer-wait", 6),
        _hunted("missing-per-layer-wait", 6, check_path=True),
    )
    assert fast.counterexample is not None and checked.counterexample is not None
    assert fast.counterexample.depth == 5 and fast.lockstep_depth == 4
    assert fast.counterexample.ops == checked.counterexample.ops
    assert fast.counterexample.what == checked.counterexample.what
    assert (fast.lockstep_transitions, fast.states) == (checked.lockstep_transitions, checked.states)


def test_forking_reaches_the_verdicts_replaying_does() -> None:
    """The measured alternative (specs/exploration.md): the same transitions, the same verdicts, without L3."""
    space = Space(dataclasses.replace(BASE, hicache_storage_backend=None).resolve(), Bounds(SEQUENCES))
    replayed = explore(space, depth=2, against=("model", "impl"))
    forked = explore(space, depth=2, against=("model", "impl"), fork=True)
    assert (forked.lockstep_transitions, forked.states) == (replayed.lockstep_transitions, replayed.states)
    assert forked.counterexample is None and forked.lockstep_depth == 2
