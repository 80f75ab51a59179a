"""``refcache explore --against model,impl`` finds zoo bugs (``tests/quality/zoo.py``) at their minimal depth:
breadth first, every transition of every smaller depth ran in lock step without a divergence first.
specs/exploration.md has the whole table (``tests/quality/measure_explore.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from refcache.check.enabled import Bounds
from refcache.check.explore import Space, explore
from refcache.config import HiCacheConfig, PrefetchPolicy, WritePolicy

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


def test_forking_reaches_the_verdicts_replaying_does() -> None:
    """The measured alternative (specs/exploration.md): the same transitions, the same verdicts, without L3."""
    space = Space(dataclasses.replace(BASE, hicache_storage_backend=None).resolve(), Bounds(SEQUENCES))
    replayed = explore(space, depth=2, against=("model", "impl"))
    forked = explore(space, depth=2, against=("model", "impl"), fork=True)
    assert (forked.lockstep_transitions, forked.states) == (replayed.lockstep_transitions, replayed.states)
    assert forked.counterexample is None and forked.lockstep_depth == 2
