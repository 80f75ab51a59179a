"""The SGLang bugs found across releases (specs/sglang-findings-releases.md), as shrunk traces in
tests/regressions/sglang/: each diverges on the releases it affects and replays clean on the supported
releases after its fix, under the installed release's profile. Each trace's header names the release it was
found on (``release``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from refcache.check.harness import Divergence, Harness
from refcache.config import PROFILES
from refcache.engines.sglang import versions
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.trace import read_trace, trace_release
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG

TRACES = Path(__file__).resolve().parents[2] / "regressions" / "sglang"

AFFECTED = {
    # L3 page keys of a namespaced (LoRA / extra_key) node ignore the namespace: sglang.md §9 #16
    "l3-key-ignores-namespace.jsonl": versions.Releases("0.5.3", "0.5.19"),
    # a load back's own write-back eviction frees the host copy of the prefix being loaded: §9 #8
    "load-back-host-copy-evicted.jsonl": versions.Releases("0.5.3", "0.5.14"),
    # the same under FIFO, MLA, page size 4: SGLang keeps the host leaf the model evicts in the loaded node's place
    "load-back-host-copy-evicted-fifo.jsonl": versions.Releases("0.5.3", "0.5.14"),
    # the first traces under LRU (0.5.3 has no FIFO, MRU, FILO): the same steps, the same fields
    "load-back-host-copy-evicted-lru.jsonl": versions.Releases("0.5.3", "0.5.14"),
    "split-write-through-ack-lru.jsonl": versions.Releases("0.5.3", "0.5.12"),
    # a node split while its write-through ack is pending: the ack covers the suffix only (§9 #15's shape)
    "split-write-through-ack.jsonl": versions.Releases("0.5.3", "0.5.12"),
    # a load's ack reads its LayerDoneCounter slot's event, recorded again by the load three later: R-4
    "load-ack-rearmed-by-slot-reuse.jsonl": versions.Releases("0.5.3", "0.5.15"),
}
"""Each trace -> the supported releases it diverges on (bisected over the supported releases)."""
UNREAPED_START = "load-ack-rearmed-by-slot-reuse.jsonl"
"""The trace whose last start finds three load acks not yet reaped (the first one finished): a release whose
load limit counts unreaped acks (``SystemEntry.counts_unreaped``: ``has_free_load_back_slot``, 0.5.22 on) refuses
that start, as its scheduler admits no load back then."""


def test_every_trace_has_a_range() -> None:
    assert sorted(p.name for p in TRACES.glob("*.jsonl")) == sorted(AFFECTED)


@pytest.mark.parametrize("name", sorted(AFFECTED))
def test_a_finding_shows_exactly_on_the_releases_it_affects(name: str) -> None:
    version = versions.installed().rows  # a post release as itself, main as the newest release (its rows)
    row = versions.release(version)
    config, ops = read_trace(TRACES / name)
    found_on = trace_release(TRACES / name)
    assert found_on is not None and found_on[1] in AFFECTED[name]
    if config.enable_storage and not row.l3_on(SGLANG):
        pytest.skip(f"{SGLANG} does not drive SGLang {version}'s L3")
    for option, values in (
        SYSTEMS[SGLANG].excluded().items()
    ):  # up to 0.5.3: no FIFO, MRU, FILO (the -lru traces)
        if str(getattr(config, option)) in values:
            pytest.skip(f"SGLang {version} has no {option}={getattr(config, option)!s}")
    if name == UNREAPED_START and SYSTEMS[SGLANG].counts_unreaped():
        assert version not in AFFECTED[name]
        pytest.skip(
            f"{SGLANG} on SGLang {version} admits a load back only while fewer than three acks are unreaped "
            "(has_free_load_back_slot): it refuses the trace's last start, whose first ack is finished and "
            "unreaped; R-4 needs exactly that start"
        )
    profile = SYSTEMS[SGLANG].followed()  # sglang-X.Y.Z-unified when it names the Unified system
    assert profile is not None
    config = config.with_fidelity(PROFILES[profile])
    with HiCacheModel(config) as model, SYSTEMS[SGLANG].load(SGLANG)(config) as sglang:
        harness = Harness(config, {"model": model, "sglang": sglang}, write_trace=False, family=HICACHE)

        def replay() -> None:
            for op in ops:
                harness.step(op)

        if version in AFFECTED[name]:
            with pytest.raises(Divergence):
                replay()
        else:
            replay()
