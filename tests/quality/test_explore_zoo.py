"""``refcache explore --against model,impl`` finds zoo bugs (``tests/quality/zoo.py``) at their minimal depth:
breadth first, every transition of every smaller depth ran in lock step without a divergence first.
specs/exploration.md has the whole table (``tests/quality/measure_explore.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from refcache.check.enabled import Bounds
from refcache.check.explore import Explored, Space, explore
from refcache.config import HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy

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


def _hunted(slug: str, depth: int, *, check_path: bool = False) -> Explored:
    bug, hunt = next(b for b in ZOO if b.slug == slug), HUNTS[slug]
    config = dataclasses.replace(BASE, **hunt.config).resolve()  # type: ignore[arg-type]
    bounds = Bounds(hunt.sequences, fault_kinds=hunt.faults, matches=hunt.matches)
    space = Space(config, bounds, token_symmetry=hunt.token_symmetry)
    with bug.applied():
        return explore(space, depth=depth, against=("model", "impl"), check_path=check_path)


def test_a_zoo_bug_is_found_on_its_smallest_space() -> None:
    """A hunt of measure_explore.py that is cheap (about 4 s): found at its minimal depth, 5."""
    result = _hunted("eviction-ignores-priority", 6)
    cx = result.counterexample
    assert cx is not None and cx.depth == 5, cx
    assert result.lockstep_depth == 4


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
