"""specs/sglang-known.json: it loads, every finding is written up in specs/sglang-findings.md and has its
shrunk trace under tests/regressions/sglang/known/, and F1's signature matches the divergence its trace gives
on SGLang 0.5.20 (recorded below from ``refcache replay``; tests/engines/sglang/test_known_findings.py replays
it on the engine) and nothing close to it."""

from __future__ import annotations

import re
from pathlib import Path

from refcache.check.known import load_known
from refcache.check.shrink import Failure
from refcache.hicache.trace import read_trace

ROOT = Path(__file__).resolve().parents[2]
KNOWN = ROOT / "specs" / "sglang-known.json"
DOC = ROOT / "specs" / "sglang-findings.md"

# What ``refcache replay tests/regressions/sglang/known/f1-prefetch-host-under-device-node.jsonl --against
# model,sglang`` says on SGLang 0.5.20 (read as a Failure: first line, then the diff lines).
F1_ON_0520 = Failure(
    13,
    "snapshots differ",
    "step 13: snapshots differ after CheckHicacheEvents():",
    "rank 0 node -:[2100, 2101, 2102, 2103, 2104]: only in sglang; "
    "rank 0 host.free: model=(10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9) sglang=(10, 11, 12, 0, 1, 2, 3, 4, 5, 6, 7, 8)",
)


def test_every_finding_is_written_up_with_its_trace() -> None:
    findings = load_known([KNOWN]).findings
    assert findings
    for finding in findings:
        assert finding.system in ("sglang", "sglang-unified", "sglang-0.5.23") and finding.id.startswith(
            "sglang-"
        )
        document, _, anchor = finding.doc.partition("#")
        document = document.split(" (")[0]  # "specs/sglang-findings-releases.md (R-1)"
        text = (ROOT / document).read_text()
        if anchor:  # this list's own write-up: the anchor and the id
            assert f'<a id="{anchor}">' in text and f"**{finding.id}**" in text, finding.id
        else:  # the releases' write-up (specs/sglang-findings-releases.md): its heading
            number = finding.id.split("-")[1]  # "R1"
            assert f"### {number[0]}-{number[1:]} " in text, finding.id
        assert finding.trace is not None, finding.id
        _config, ops = read_trace(ROOT / finding.trace)
        assert ops


def test_f1_matches_its_divergence_and_nothing_close() -> None:
    known = load_known([KNOWN])
    on_0520 = {"model": None, "sglang": "0.5.20"}
    found = known.match(F1_ON_0520, on_0520)
    assert found is not None and found.id == "sglang-F1-prefetch-host-under-device-node"
    bigram = Failure(
        281,
        F1_ON_0520.kind,
        F1_ON_0520.message,
        "rank 0 node -:[(4200, 4201), (4201, 4202)]: only in sglang; rank 0 host.free: model=(1, 2) sglang=(1,)",
    )
    assert known.match(bigram, on_0520) is found  # EAGLE's bigram keys
    namespaced = Failure(
        372, F1_ON_0520.kind, F1_ON_0520.message, F1_ON_0520.detail.replace("node -:", "node lora-a:")
    )
    assert known.match(namespaced, on_0520) is found  # a request's extra_key names the path's namespace
    assert known.match(F1_ON_0520, {"model": None, "sglang": "0.5.19"}) is found  # bisect: the same on 0.5.19
    assert known.match(F1_ON_0520, {"model": None, "sglang": "0.5.18"}) is None  # not placed there (no L3)
    only_in_model = Failure(
        13, F1_ON_0520.kind, F1_ON_0520.message, re.sub("only in sglang", "only in model", F1_ON_0520.detail)
    )
    assert known.match(only_in_model, on_0520) is None
    no_host = Failure(13, F1_ON_0520.kind, F1_ON_0520.message, F1_ON_0520.detail.partition(";")[0])
    assert known.match(no_host, on_0520) is None  # a node only on SGLang that holds no host slot: another bug
    invariant = Failure(13, "invariant violated on sglang", F1_ON_0520.message, F1_ON_0520.detail)
    assert known.match(invariant, on_0520) is None


def test_f2_matches_its_divergence_and_nothing_close() -> None:
    known = load_known([KNOWN])
    on_0520 = {"model": None, "sglang": "0.5.20"}
    detail = (  # F2's first trace on 0.5.20 (a split by the prompt prefix's re-insert, step 4)
        "rank 0 node -:[0].host_ref_counter: model=1 sglang=0; rank 0 node -:[0].in_flight: model=('backup',) "
        "sglang=(); rank 0 ongoing_backup: model=((NodeId(namespace='', path=(0,)), NodeId(namespace='', "
        "path=(0, 3, 1, 5, 0, 1))),) sglang=((NodeId(namespace='', path=(0, 3, 1, 5, 0, 1)),),)"
    )
    f2 = Failure(4, "snapshots differ", "step 4: snapshots differ after CheckHicacheEvents():", detail)
    found = known.match(f2, on_0520)
    assert found is not None and found.id == "sglang-F2-backup-split-fragment-unpinned"
    load_pin = detail.replace("('backup',)", "('load_back',)")
    assert known.match(Failure(4, f2.kind, f2.message, load_pin), on_0520) is None  # another table's pin
    anchor = detail.replace("model=1 sglang=0", "model=2 sglang=1").replace(
        "model=('backup',) sglang=()", "model=('backup', 'prefetch_anchor') sglang=('prefetch_anchor',)"
    )
    assert known.match(Failure(19, f2.kind, f2.message, anchor), on_0520) is found  # also a prefetch's anchor
    reverse = detail.replace("model=1 sglang=0", "model=0 sglang=1").replace(
        "model=('backup',) sglang=()", "model=() sglang=('backup',)"
    )
    assert known.match(Failure(4, f2.kind, f2.message, reverse), on_0520) is None  # SGLang pinning more


def test_r1_matches_its_divergence_and_not_the_unnamespaced_one() -> None:
    known = load_known([KNOWN])
    detail = (  # tests/regressions/sglang/l3-key-ignores-namespace.jsonl on 0.5.19 (step 2)
        "rank 0 node lora-a:[4, 0].hash_value: model=('39bcd27d66ffe406e6b2e3b5dc693247664dcd0ea989b8100a4691f86f9d3365',) "
        "sglang=('f0a0278e4372459cca6159cd5e71cfee638302a7b9ca9b05c34181ac0a65ac5d',)"
    )
    r1 = Failure(2, "snapshots differ", "step 2: snapshots differ after FinishRequest(rid=0):", detail)
    found = known.match(r1, {"model": None, "sglang": "0.5.19"})
    assert found is not None and found.id == "sglang-R1-l3-key-ignores-namespace"
    assert known.match(r1, {"model": None, "sglang": "0.5.20"}) is None  # fixed in 0.5.20
    plain = Failure(2, r1.kind, r1.message, detail.replace("node lora-a:", "node -:"))
    assert known.match(plain, {"model": None, "sglang": "0.5.19"}) is None  # no namespace: another bug


def test_r2_and_r3_match_their_divergences_on_0512() -> None:
    known = load_known([KNOWN])
    on = {"model": None, "sglang": "0.5.12"}
    r3 = Failure(  # tests/regressions/sglang/split-write-through-ack.jsonl on 0.5.12 (step 3)
        3,
        "snapshots differ",
        "step 3: snapshots differ after StartRequest(rid=25, tokens=(3400, 3401), extra_key=None):",
        "rank 0 node -:[3400, 3401].in_flight: model=('write_through',) sglang=(); rank 0 ongoing_write_through: "
        "model=((NodeId(namespace='', path=(3400, 3401)), NodeId(namespace='', path=(3400, 3401, 3402))),) "
        "sglang=((NodeId(namespace='', path=(3400, 3401, 3402)),),)",
    )
    r2 = Failure(  # tests/regressions/sglang/load-back-host-copy-evicted.jsonl on 0.5.12 (step 7)
        7,
        "snapshots differ",
        "step 7: snapshots differ after StartRequest(rid=15, tokens=(2200, 2201), extra_key=None):",
        "rank 0 node -:[2200, 2201]: only in model; rank 0 node -:[2400, 2401].host_value: model=(8, 2) "
        "sglang=(8, 0); rank 0 host.free: model=(3, 4) sglang=(1, 2, 3, 4); rank 0 ongoing_load_back: "
        "model=(NodeId(namespace='', path=(2200, 2201)),) sglang=(); rank 0 requests[0].locked: "
        "model=NodeId(namespace='', path=(2200, 2201)) sglang=None",
    )
    for failure, wanted in (
        (r3, "sglang-R3-split-write-through-ack"),
        (r2, "sglang-R2-load-back-host-copy-evicted"),
    ):
        found = known.match(failure, on)
        assert found is not None and found.id == wanted
    assert known.match(r3, {**on, "sglang": "0.5.13"}) is None  # fixed in 0.5.13
    assert known.match(r2, {**on, "sglang": "0.5.15"}) is None  # fixed in 0.5.15
    backup = Failure(3, r3.kind, r3.message, r3.detail.replace("write_through", "backup"))
    assert known.match(backup, on) is None  # F2's shape, which is not listed for 0.5.12


def test_each_finding_explains_only_its_own_lines() -> None:
    """Every entry names the lines it explains (``lines``): its divergence with one more line that no finding
    explains is not known (a known finding must not hide the next bug at the same step)."""
    known = load_known([KNOWN])
    assert all(f.signature.lines for f in known.findings)
    extra = "; rank 0 node -:[9, 9].lock_ref: model=0 sglang=1"
    on_0520 = {"model": None, "sglang": "0.5.20"}
    assert known.match(F1_ON_0520, on_0520) is not None
    assert (
        known.match(Failure(13, F1_ON_0520.kind, F1_ON_0520.message, F1_ON_0520.detail + extra), on_0520)
        is None
    )


def test_r11_at_admission_matches_its_divergence_and_nothing_close() -> None:
    known = load_known([KNOWN])
    detail = "rank 0 node -:[2900, 2901, 2902, 2903].host_leaf: model=False sglang=True"  # its trace, step 8
    message = (
        "step 8: snapshots differ after StartRequest(rid=26, tokens=(3600, 3601, 3602, 3603, 3604, 3605)):"
    )
    r11 = Failure(8, "snapshots differ", message, detail)
    found = known.match(r11, {"model": None, "sglang": "0.5.9"})
    assert found is not None and found.id == "sglang-R11-host-leaf-over-backed-up-child-at-admission"
    assert known.match(r11, {"model": None, "sglang": "0.5.10"}) is found
    assert known.match(r11, {"model": None, "sglang": "0.5.11"}) is None  # fixed in 0.5.11 (PR #23537)
    assert known.match(r11, {"model": None, "sglang": "0.5.8"}) is None  # no leaf sets there
    reverse = Failure(
        8, r11.kind, message, detail.replace("model=False sglang=True", "model=True sglang=False")
    )
    assert (
        known.match(reverse, {"model": None, "sglang": "0.5.9"}) is None
    )  # a host leaf SGLang lacks: another bug
    more = Failure(8, r11.kind, message, detail + "; rank 0 host.free: model=(1,) sglang=(2,)")
    assert known.match(more, {"model": None, "sglang": "0.5.9"}) is None  # slots differ too: not this alone


def test_r12_matches_its_divergence_and_not_a_min_reduced_one() -> None:
    known = load_known([KNOWN])
    on = {"model": None, "sglang": "0.5.12"}
    r12 = Failure(  # tests/regressions/sglang/known/r12-load-back-retired-on-one-rank.jsonl on 0.5.12 (step 12)
        12,
        "outcomes differ",
        "step 12: outcomes differ on CheckHicacheEvents():",
        "model: EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=0, loads_by_rank=()); "
        "sglang: EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=0, loads_by_rank=(0, 1))",
    )
    found = known.match(r12, on)
    assert found is not None and found.id == "sglang-R12-load-back-retired-on-one-rank"
    assert known.match(r12, {**on, "sglang": "0.5.13"}) is None  # fixed in 0.5.13 (a MIN)
    plain = Failure(12, r12.kind, r12.message, r12.detail.replace(", loads_by_rank=(0, 1)", ""))
    assert known.match(plain, on) is None  # the ranks agreed: not R-12
    # tests/regressions/sglang/decisions/d68-loads-retired-in-another-order.jsonl on 0.5.11 (step 16): rank 0
    # retires the last-lock load alone while rank 1 retires the other, so SGLang's counts coincide
    crossed = Failure(
        16,
        "outcomes differ",
        "step 16: outcomes differ on CheckHicacheEvents():",
        "model: EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=0, loads_by_rank=(0, 1)); "
        "sglang: EventsResult(writes=0, loads=1, revoked=0, backups=0, host_releases=0, loads_by_rank=())",
    )
    found = known.match(crossed, {**on, "sglang": "0.5.11"})
    assert found is not None and found.id == "sglang-R12-load-back-retired-on-one-rank"


def test_r9_r10_r11_match_their_divergences_on_059_and_nothing_close() -> None:
    """The findings of opening L3 on 0.5.9 (specs/sglang-findings-releases.md R-9, R-10, R-11), each on the
    divergence its trace gives there (``refcache replay``), fixed in 0.5.10 or 0.5.11, and not its mirror image."""
    known = load_known([KNOWN])
    on = {"model": None, "sglang": "0.5.9"}
    never_hits = Failure(  # r9-eagle-prefetch-key-never-hits.jsonl on 0.5.9 (step 10)
        10,
        "snapshots differ",
        "step 10: snapshots differ after CompleteIO(queue=IOQueue.PREFETCH_QUERY, rank=0, count=64):",
        "rank 0 host.held: model=(('prefetch:3', (14, 15)),) sglang=(('release_queue', (14, 15)),); "
        "rank 0 ongoing_prefetch[0].stage: model=PrefetchStage.IO sglang=PrefetchStage.DONE; "
        "rank 0 ongoing_prefetch[0].hit_pages: model=1 sglang=0; "
        "rank 0 queues: model=(('prefetch_io', 1), ('revoke', 0)) sglang=(('prefetch_io', 0), ('revoke', 1))",
    )
    admission = Failure(  # r9-eagle-prefetch-key-admission.jsonl on 0.5.9 (step 1)
        1,
        "outcomes differ",
        "step 1: outcomes differ on PrefetchFromStorage(rid=5, tokens=(4, 0, 3, 1), extra_key='lora-a'):",
        "model: PrefetchResult(admitted=False, reason='below_threshold', tokens=0); "
        "sglang: PrefetchResult(admitted=True, reason='admitted', tokens=0)",
    )
    crash = Failure(  # r10-write-back-failed-backup-asserted.jsonl on 0.5.9 (step 6)
        6,
        "sglang crashed",
        "step 6: sglang crashed on StartRequest(rid=18, tokens=(0, 3, 3, 5, 2), extra_key=None): AssertionError: ",
        "",
    )
    host_leaf = Failure(  # r11-host-leaf-over-backed-up-child.jsonl on 0.5.9 (step 7)
        7,
        "snapshots differ",
        "step 7: snapshots differ after Evict(num_tokens=10000):",
        "rank 0 node -:[7].host_leaf: model=False sglang=True",
    )
    for failure, wanted, fixed in (
        (never_hits, "sglang-R9-eagle-prefetch-key-never-hits", "0.5.10"),
        (admission, "sglang-R9-eagle-prefetch-key-admission", "0.5.10"),
        (crash, "sglang-R10-write-back-failed-backup-asserted", "0.5.11"),
        (host_leaf, "sglang-R11-host-leaf-over-backed-up-child", "0.5.11"),
    ):
        found = known.match(failure, on)
        assert found is not None and found.id == wanted, wanted
        assert known.match(failure, {**on, "sglang": fixed}) is None, wanted
    hits_more = Failure(
        10,
        never_hits.kind,
        never_hits.message,
        never_hits.detail.replace("model=1 sglang=0", "model=0 sglang=1"),
    )
    assert (
        known.match(hits_more, on) is None
    )  # SGLang hitting where the model does not: R-1's shape, not R-9's
    refused = admission.detail.replace(
        "admitted=False, reason='below_threshold'", "admitted=True, reason='admitted'"
    )
    refused = refused.replace(
        "sglang: PrefetchResult(admitted=True, reason='admitted'",
        "sglang: PrefetchResult(admitted=False, reason='below_threshold'",
    )
    assert (
        known.match(Failure(1, admission.kind, admission.message, refused), on) is None
    )  # SGLang refusing more
    other_assert = Failure(
        6, crash.kind, crash.message.replace("AssertionError: ", "AssertionError: non-leaf"), ""
    )
    assert known.match(other_assert, on) is None  # another assertion (sglang.md §9 #6's non-leaf)
    reverse = host_leaf.detail.replace("model=False sglang=True", "model=True sglang=False")
    assert known.match(Failure(7, host_leaf.kind, host_leaf.message, reverse), on) is None


R10_ON_A_RANK = (  # tests/regressions/sglang/known/r10-write-back-failed-backup-asserted-on-a-rank.jsonl on 0.5.10
    "--- rank 0 traceback ---",
    "Traceback (most recent call last):",
    'File "/w/refcache/engines/sglang/_tp.py", line 235, in _serve',
    "result = (system.apply(argument), system.snapshot(), _contributions(system))",
    "^^^^^^^^^^^^^^^^^^^^^^",
    'File "/w/refcache/engines/sglang/_adapter.py", line 1043, in _apply',
    "return self._start(rid, tokens, extra_key, op.prompt_len)",
    'File "/w/refcache/engines/sglang/_adapter.py", line 1095, in _evict_for_alloc',
    "evict_from_tree_cache(self.cache, num_tokens)",
    'File "/e/site-packages/sglang/srt/mem_cache/common.py", line 252, in evict_from_tree_cache',
    "tree_cache.evict(EvictParams(num_tokens=num_tokens))",
    'File "/e/site-packages/sglang/srt/mem_cache/hiradix_cache.py", line 819, in evict',
    "assert node.backuped",
    "AssertionError",
)


def test_r10_on_a_rank_matches_its_rank_crash_and_no_other_assertion() -> None:
    """R-10 on two ranks comes back as the rank's RankError with its traceback (detail lines); the face names the
    assertion in ``evict`` only, on 0.5.6..0.5.10."""
    known = load_known([KNOWN])
    message = (
        "step 11: sglang crashed on StartRequest(rid=6, tokens=(1000, 1001), extra_key=None): RankError: rank 0 "
        "failed on 'apply': AssertionError: "
    )
    crash = Failure(11, "sglang crashed", message, "; ".join(R10_ON_A_RANK))
    found = known.match(crash, {"model": None, "sglang": "0.5.10"})
    assert found is not None and found.id == "sglang-R10-write-back-failed-backup-asserted-on-a-rank"
    assert known.match(crash, {"model": None, "sglang": "0.5.6"}) is found
    assert known.match(crash, {"model": None, "sglang": "0.5.11"}) is None  # fixed (D-66)
    other = "; ".join(R10_ON_A_RANK).replace("assert node.backuped", "assert node.evicted")
    assert known.match(Failure(11, crash.kind, message, other), {"model": None, "sglang": "0.5.10"}) is None
    # an Evict operation's own eviction (the two-rank write_back fuzz with L3 on 0.5.5, step 313)
    evicting = (
        *R10_ON_A_RANK[:5],
        'File "/w/refcache/engines/sglang/_adapter.py", line 1051, in _apply',
        "return EvictResult(self._evict(num_tokens))",
        "^^^^^^^^^^^^^^^^^^^^^^^",
        'File "/w/refcache/engines/sglang/_adapter.py", line 1295, in _evict',
        "self.cache.evict(num_tokens)",
        *R10_ON_A_RANK[-4:],
    )
    evict = message.replace(
        "StartRequest(rid=6, tokens=(1000, 1001), extra_key=None)", "Evict(num_tokens=10000)"
    )
    assert evict != message
    assert (
        known.match(Failure(11, crash.kind, evict, "; ".join(evicting)), {"model": None, "sglang": "0.5.10"})
        is found
    )
    elsewhere = "; ".join(R10_ON_A_RANK).replace("in evict;", "in evict_host;")
    assert (
        known.match(Failure(11, crash.kind, message, elsewhere), {"model": None, "sglang": "0.5.10"}) is None
    )


def test_r10_on_a_rank_before_056_matches_the_schedulers_eviction_there_only() -> None:
    """Up to 0.5.3 the eviction before an allocation goes through the scheduler's ``_evict_tree_cache_if_needed``
    (``schedule_batch.py`` 0.5.3:1917), a frame R-10's two-rank face from 0.5.6 does not explain; the face before
    0.5.6 does, on 0.5.3..0.5.5 only."""
    known = load_known([KNOWN])
    frames = [
        *R10_ON_A_RANK[:7],
        "self._schedule_batch()._evict_tree_cache_if_needed(num_tokens)",
        'File "/e/site-packages/sglang/srt/managers/schedule_batch.py", line 1917, in _evict_tree_cache_if_needed',
        "self.tree_cache.evict(num_tokens)",
        *R10_ON_A_RANK[-4:],
    ]
    message = (
        "step 7: sglang crashed on StartRequest(rid=15, tokens=(2500, 2501, 2502), extra_key=None): RankError: "
        "rank 0 failed on 'apply': AssertionError: "
    )
    crash = Failure(7, "sglang crashed", message, "; ".join(frames))
    found = known.match(crash, {"model": None, "sglang": "0.5.3"})
    assert (
        found is not None
        and found.id == "sglang-R10-write-back-failed-backup-asserted-on-a-rank-before-0.5.6"
    )
    assert (
        known.match(crash, {"model": None, "sglang": "0.5.6"}) is None
    )  # the later face: no scheduler frame


R14_ON_A_RANK = (  # tests/regressions/sglang/known/r14-eagle-page-hash-of-bigram-crashes-on-a-rank.jsonl on 0.5.3
    "--- rank 0 traceback ---",
    "Traceback (most recent call last):",
    'File "/w/refcache/engines/sglang/_tp.py", line 235, in _serve',
    "result = (system.apply(argument), system.snapshot(), _contributions(system))",
    "^^^^^^^^^^^^^^^^^^^^^^",
    'File "/w/refcache/engines/sglang/_adapter.py", line 1228, in _finish',
    "cache.cache_finished_req(request, **self._handled(request))",
    'File "/e/site-packages/sglang/srt/mem_cache/radix_cache.py", line 356, in cache_finished_req',
    "new_prefix_len = self.insert(",
    'File "/e/site-packages/sglang/srt/mem_cache/hiradix_cache.py", line 886, in insert',
    "self.cache_controller.get_hash_str(",
    'File "/e/site-packages/sglang/srt/mem_cache/hicache_storage.py", line 22, in get_hash_str',
    'hasher.update(t.to_bytes(4, byteorder="little", signed=False))',
    "^^^^^^^^^^",
    "AttributeError: 'tuple' object has no attribute 'to_bytes'",
)


def test_r14_on_a_rank_matches_its_rank_crash_in_get_hash_str_only() -> None:
    """R-14 on two ranks comes back as the rank's RankError with its traceback (detail lines); the face names the
    AttributeError raised in ``get_hash_str`` only, on 0.5.3..0.5.4."""
    known = load_known([KNOWN])
    message = (
        "step 2: sglang crashed on FinishRequest(rid=1): RankError: rank 0 failed on 'apply': AttributeError: "
        "'tuple' object has no attribute 'to_bytes'"
    )
    crash = Failure(2, "sglang crashed", message, "; ".join(R14_ON_A_RANK) + "; ")
    found = known.match(crash, {"model": None, "sglang": "0.5.3"})
    assert found is not None and found.id == "sglang-R14-eagle-page-hash-of-bigram-crashes-on-a-rank"
    assert known.match(crash, {"model": None, "sglang": "0.5.4"}) is found
    assert known.match(crash, {"model": None, "sglang": "0.5.5"}) is None  # fixed
    elsewhere = crash.detail.replace("in get_hash_str;", "in get_hash_values;")
    assert known.match(Failure(2, crash.kind, message, elsewhere), {"model": None, "sglang": "0.5.3"}) is None


def test_r13_r14_match_their_divergences_up_to_055_and_nothing_close() -> None:
    """The findings of opening L3 on 0.5.3..0.5.5 (specs/sglang-findings-releases.md R-13, R-14), each on the
    divergence its trace gives (``refcache replay``), fixed in 0.5.6 or 0.5.5; R-13 names a release queue that
    holds a run of slots twice in a row and no other queue's length differing."""
    known = load_known([KNOWN])
    queues = "(('write_pending', 0), ('prefetch_io', 0), ('host_release', {}))"
    twice = Failure(  # r13-prefetch-tail-released-twice.jsonl on 0.5.5 (step 12)
        12,
        "snapshots differ",
        "step 12: snapshots differ after CompleteIO(queue=IOQueue.PREFETCH_IO, rank=0, count=1):",
        "rank 0 host.held: model=(('release_queue', (8, 9, 10, 11)),) "
        "sglang=(('release_queue', (8, 9, 10, 11, 8, 9, 10, 11)),); "
        f"rank 0 queues: model={queues.format(4)} sglang={queues.format(8)}",
    )
    crash = Failure(  # r14-eagle-page-hash-of-bigram-crashes.jsonl on 0.5.4 (step 2)
        2,
        "sglang crashed",
        "step 2: sglang crashed on FinishRequest(rid=1): AttributeError: 'tuple' object has no attribute 'to_bytes'",
        "",
    )
    for failure, wanted, present, fixed in (
        (twice, "sglang-R13-prefetch-tail-released-twice", "0.5.3", "0.5.6"),
        (crash, "sglang-R14-eagle-page-hash-of-bigram-crashes", "0.5.4", "0.5.5"),
    ):
        found = known.match(failure, {"model": None, "sglang": present})
        assert found is not None and found.id == wanted, wanted
        assert known.match(failure, {"model": None, "sglang": fixed}) is None, wanted
    on = {"model": None, "sglang": "0.5.5"}
    once = Failure(
        12, twice.kind, twice.message, twice.detail.replace("8, 9, 10, 11, 8, 9, 10, 11", "8, 9, 10, 12")
    )
    assert known.match(once, on) is None  # other slots queued, none twice: another bug
    other_queue = Failure(
        12,
        twice.kind,
        twice.message,
        twice.detail.replace("sglang=(('write_pending', 0)", "sglang=(('write_pending', 1)"),
    )
    assert known.match(other_queue, on) is None  # another queue's length differs too
