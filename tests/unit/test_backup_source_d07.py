"""BACKUP-SOURCE under D-07's option: the model following 0.5.20's one-node backup pin (the option the
``sglang-0.5.19``..``sglang-0.5.21`` profiles, ``-unified`` ones included, turn on) copies U-2, and where the
unpinned prefix fragment's host copy is then reclaimed (D-48, write_back) while the backup has still to read it,
the model's own snapshot breaks BACKUP-SOURCE. That is the profile reproducing a known bug, not a model error:
``specs/sglang-known.json`` names it (``sglang-U2-l3-backup-split-fragment-unlocked-reclaimed``) wherever an
engine of its releases is compared. Under refcache's D-07 (the fragment joins the backup, pinned) the same
operations hold every invariant: nothing is reclaimed under the backup."""

from __future__ import annotations

from pathlib import Path

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.check.known import load_known
from refcache.check.shrink import Failure
from refcache.config import HiCacheConfig
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import Op
from refcache.hicache.trace import read_trace
from refcache.model import HiCacheModel
from refcache.systems import OpenSystems

ROOT = Path(__file__).resolve().parents[2]
KNOWN = ROOT / "specs" / "sglang-known.json"
TRACE = ROOT / "tests" / "regressions" / "sglang" / "known" / "u2-l3-backup-split-fragment-reclaimed.jsonl"
PREFIX = "-:[" + ", ".join(str(t) for t in range(2700, 2708)) + "]"
VIOLATION = (
    f"[BACKUP-SOURCE] rank 0 node {PREFIX}: backup 0 reads host slots [0, 1, 2, 3, 4, 5, 6, 7] for this node's "
    "pages, but it has no host copy (those slots are now free)"
)
U2_RECLAIMED = "sglang-U2-l3-backup-split-fragment-unlocked-reclaimed"


def _replay(config: HiCacheConfig, ops: list[Op]) -> Failure | None:
    with OpenSystems({"model": HiCacheModel(config)}) as systems:
        harness = Harness(config, systems, family=HICACHE, write_trace=False)
        try:
            for op in ops:
                harness.step(op)
        except Divergence as error:
            return Failure.of(error)
    return None


@pytest.fixture(scope="module")
def under_the_option() -> Failure:
    config, ops = read_trace(TRACE)
    assert config.backup_protects_passed_node_only and config.reclaim_host_duplicates  # the profile's pair
    failure = _replay(config, ops)
    assert failure is not None
    return failure


def test_under_d07_s_option_the_model_breaks_backup_source_where_the_fragment_is_reclaimed(
    under_the_option: Failure,
) -> None:
    # step 9, EvictHost(8): the prefix fragment (not pinned, not listed with the backup) loses its host copy
    # as a device duplicate while the backup, not run yet, still reads slots 0..11; only BACKUP-SOURCE sees it
    assert under_the_option.step == 9 and under_the_option.kind == "invariant violated on model"
    assert under_the_option.message == "step 9: invariant violated on model after EvictHost(num_tokens=8):"
    assert under_the_option.detail == VIOLATION


def test_under_refcache_s_d07_the_same_operations_hold_every_invariant() -> None:
    config, ops = read_trace(TRACE)
    assert _replay(config.with_fidelity({"backup_protects_passed_node_only": False}), ops) is None


def test_the_known_finding_names_it_where_an_engine_of_its_releases_is_compared(
    under_the_option: Failure,
) -> None:
    known = load_known([KNOWN])
    for release in ("0.5.20", "0.5.21"):
        found = known.explain(under_the_option, {"model": None, "sglang-unified": release})
        assert [f.id for f in found] == [U2_RECLAIMED]
    assert known.match(under_the_option, {"model": None, "sglang-unified": "0.5.22"}) is None  # fixed there
    assert known.match(under_the_option, {"model": None}) is None  # no engine compared: the profile's own run
    # the engine's own snapshot, checked alone (its snapshot equals the model's here)
    on_engine = Failure(9, "invariant violated on sglang-unified", under_the_option.message, VIOLATION)
    assert known.match(on_engine, {"sglang-unified": "0.5.20"}) is not None
    # slots reused by another node, or taken by a prefetch, with the fragment's copy moved: another bug
    moved = VIOLATION.replace("it has no host copy", "its host copy is [12, 13, 14, 15, 16, 17, 18, 19]")
    assert (
        known.match(
            Failure(9, under_the_option.kind, under_the_option.message, moved),
            {"model": None, "sglang-unified": "0.5.20"},
        )
        is None
    )
    # a second line no finding explains leaves the divergence unknown
    more = f"{VIOLATION}; [STEP-REMOVAL] rank 0 node {PREFIX}: removed while pinned"
    failure = Failure(9, under_the_option.kind, under_the_option.message, more)
    assert known.match(failure, {"model": None, "sglang-unified": "0.5.20"}) is None
