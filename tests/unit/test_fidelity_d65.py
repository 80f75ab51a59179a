"""D-65, ``tail_freed_before_insert``: SGLang up to 0.5.3's ``cache_finished_req`` frees a finished request's
unaligned tail (EAGLE's last token with page size 1; the partial page otherwise) before its insert, and the
duplicate slots the insert finds after it (``radix_cache.py`` 0.5.3:317-360); 0.5.4 on frees the duplicates
first and the tail last. Same slots either way; the device free list's order differs, and with it which slots the
next allocations take."""

from __future__ import annotations

from collections.abc import Sequence

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend
from refcache.hicache.ops import FinishRequest, Op, StartRequest
from refcache.hicache.snapshot import Snapshot
from refcache.model import HiCacheModel

OPS: Sequence[Op] = (
    StartRequest(0, (2, 3, 0, 1, 0, 5)),  # device slots 0..5
    StartRequest(2, (2, 3, 1)),  # slots 6..8, the same first two tokens
    FinishRequest(2),  # EAGLE: caches (2, 3) (bigram key (2,3), (3,1)), frees its last slot, 8
    FinishRequest(0),  # duplicates: slot 0 (the first bigram); the tail: slot 5
)
"""The 0.5.3 smoke failure of test_differential's profile machine, shrunk by hand (6 operations there)."""


def _free_after(**options: bool) -> tuple[int, ...]:
    config = HiCacheConfig(
        device_size=9, page_size=1, is_eagle=True, hicache_io_backend=IOBackend.DIRECT
    ).with_fidelity({**PROFILES["sglang-0.5.3"], **options})
    with HiCacheModel(config) as model:
        for op in OPS:
            model.apply(op)
        snapshot: Snapshot = model.snapshot()
    return tuple(snapshot.ranks[0].device.free)


def test_the_option_is_followed_up_to_0_5_3() -> None:
    assert FIDELITY_OPTIONS["D-65"] == "tail_freed_before_insert"
    assert PROFILES["sglang-0.5.3"]["tail_freed_before_insert"]
    for profile in ("sglang-0.5.4", "sglang-0.5.5", "sglang-0.5.20", "sglang-0.5.23", "refcache"):
        assert not PROFILES[profile]["tail_freed_before_insert"], profile


def test_the_tail_goes_back_before_the_duplicates() -> None:
    before, after = _free_after(), _free_after(tail_freed_before_insert=False)
    assert sorted(before) == sorted(after)  # the same slots
    assert before[-2:] == (5, 0) and after[-2:] == (
        0,
        5,
    )  # the tail first up to 0.5.3, the duplicate first after
