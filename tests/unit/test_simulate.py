"""Workload simulation (``refcache.sim``): trace parsing, known answers, the offline bound, the
accounting against a per-operation ground truth, the sweep plot and the command line."""

from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path
from types import TracebackType
from typing import Self

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from refcache.cli import app
from refcache.config import EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.errors import TraceFormatError, UsageError
from refcache.hashing import Token
from refcache.hicache.ops import CheckPrefetchProgress, Observation, Op
from refcache.hicache.snapshot import Snapshot
from refcache.sim import (
    SimOptions,
    SimReport,
    TraceRequest,
    Workload,
    belady_hits,
    identical_series,
    parse_mooncake,
    plot_sweep,
    read_mooncake_trace,
    report_notes,
    simulate,
    sweep,
)
from refcache.systems import HiCacheSystem, open_systems

DATA = Path(__file__).parent.parent / "data"
EXCERPT = DATA / "mooncake_conversation_head300.jsonl"


def request(line: int, ids: list[int], *, last: int = 512, output: int = 0, at: float = 0.0) -> TraceRequest:
    """A trace request of blocks ``ids`` whose last block has ``last`` of its 512 tokens."""
    return TraceRequest(line, at, 512 * (len(ids) - 1) + last, output, tuple(ids))


def config(**options: object) -> HiCacheConfig:
    base: dict[str, object] = {"device_size": 64, "page_size": 4, "hicache_ratio": 2.0}
    base.update(options)
    return HiCacheConfig(**base)  # type: ignore[arg-type]


# --- trace parsing ----------------------------------------------------------------------------------------

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}'


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "timestamp must be a number"),
        ('{"timestamp": -1, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": []}', "input_length must be"),
        (
            '{"timestamp": 0, "input_length": true, "output_length": 5, "hash_ids": [1]}',
            "input_length must be",
        ),
        ('{"timestamp": 0, "input_length": 600, "output_length": -2, "hash_ids": [1, 2]}', "output_length"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": "12"}', "hash_ids must be"),
        (
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, -2]}',
            "hash_ids must be",
        ),
        ('{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}', "expected 2"),
    ],
)
def test_a_bad_line_is_reported_with_its_number(line: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=r"^t\.jsonl:3: ") as caught:
        parse_mooncake([GOOD, "", line, GOOD], source="t.jsonl")
    assert message in str(caught.value)


def test_parsing_skips_blank_lines_and_stops_at_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(f"{GOOD}\n\n{GOOD}\n{{broken\n", encoding="utf-8")
    requests = read_mooncake_trace(path, limit=2)
    assert [r.line for r in requests] == [1, 3]
    assert requests[0] == TraceRequest(1, 0.0, 600, 5, (1, 2))
    with pytest.raises(TraceFormatError, match=rf"^{path}:4: not valid JSON"):
        read_mooncake_trace(path)


def test_the_shipped_excerpt_parses() -> None:
    requests = read_mooncake_trace(EXCERPT)
    assert len(requests) == 300
    assert all(len(r.hash_ids) == -(-r.input_length // 512) for r in requests)


# --- workload ---------------------------------------------------------------------------------------------


def test_blocks_become_pages_of_token_ids_and_outputs_are_unique() -> None:
    w = Workload([request(1, [0, 1], last=256, output=700, at=2.0), request(2, [0, 2], at=1.0)], 4)
    first, second = w.requests  # arrival order: the second line arrived first
    assert (first.line, first.arrival_us, second.line) == (2, 1000, 1)
    assert first.input_tokens() == (0, 1, 2, 3, 8, 9, 10, 11)
    assert second.input_tokens() == (0, 1, 2, 3, 4, 5)  # half of block 1
    assert second.tokens()[6:] == (12, 13, 14, 15, 16, 17)  # ceil(700 * 4 / 512) fresh ids
    assert w.input_tokens == 14 and w.output_tokens == 6 and w.token_scale == 128


def test_workload_rejects_bad_scales() -> None:
    with pytest.raises(UsageError, match="block_tokens"):
        Workload([request(1, [0])], 0)
    with pytest.raises(UsageError, match="no requests"):
        Workload([], 4)
    with pytest.raises(UsageError, match="uint32"):
        Workload([request(1, [2**32 // 512])], 512)


# --- the offline bound ------------------------------------------------------------------------------------


def test_belady_keeps_what_is_used_soonest() -> None:
    # LRU gets no hit on a cycle longer than the cache; the optimal cache keeps two of the three.
    assert belady_hits([1, 2, 3, 1, 2, 3], 2) == 2
    assert belady_hits([1, 2, 1, 2], 0) == 0
    assert belady_hits([1, 1, 1], 1) == 2
    assert belady_hits([1, 2, 3, 4, 1, 2, 3, 4], 4) == 4


def test_infinite_bound_counts_repeats_up_to_what_was_held() -> None:
    w = Workload([request(1, [0], last=256), request(2, [0]), request(3, [0], last=128)], 4)
    # Block 0: 2 tokens, then 4 (2 of them held before), then 1 (held).
    assert w.infinite_hit_tokens == 2 + 1
    assert w.optimal_hit_tokens(4) == 3  # capped by the infinite bound


# --- known answers ----------------------------------------------------------------------------------------


def test_a_repeated_prompt_hits_fully_after_the_first() -> None:
    w = Workload([request(i, [7, 8, 9], output=512) for i in range(1, 4)], 4)
    report = simulate(w, config(), SimOptions(check_invariants=True))
    s = report.served
    assert (s.input, s.l1, s.l2, s.l3, s.computed, s.recomputed) == (36, 24, 0, 0, 12, 0)
    assert report.bounds.belady_l1 == report.bounds.infinite == 24
    assert report.hit_rates["l1"] == pytest.approx(2 / 3)


def test_a_trace_larger_than_all_tiers_hits_nothing() -> None:
    # Six distinct 3-block prompts in a cycle, twice: 72 tokens of working set, 16 + 28 of cache, LRU.
    prompts = [[10 * p, 10 * p + 1, 10 * p + 2] for p in range(6)]
    w = Workload([request(i, prompts[i % 6]) for i in range(12)], 4)
    cfg = config(device_size=16, hicache_ratio=1.5, hicache_write_policy="write_through")
    report = simulate(w, cfg, SimOptions(check_invariants=True))
    s = report.served
    assert (s.l1, s.l2, s.l3) == (0, 0, 0)
    assert s.computed == s.input == 144 and s.recomputed == 72
    assert report.evicted.l1 > 0 and report.evicted.l2 > 0
    assert report.bounds.belady_l1_l2 > 0  # the optimal cache does better than LRU here
    # With L3 every repeat comes back from storage.
    with_l3 = simulate(
        w,
        dataclasses.replace(cfg, hicache_storage_backend="file", prefetch_threshold=4),
        SimOptions(check_invariants=True),
    )
    assert with_l3.served.l3 == 72 == with_l3.bounds.infinite
    assert with_l3.moved.l3_to_l2 == 72 and with_l3.moved.l2_to_l3 == 72
    assert with_l3.prefetch.started == 12 and with_l3.prefetch.revoked == 6


def test_l2_serves_what_l1_evicted() -> None:
    w = Workload([request(1, [1, 2]), request(2, [3, 4]), request(3, [1, 2])], 4)
    report = simulate(w, config(device_size=8, hicache_write_policy="write_through", load_back_threshold=1))
    assert (report.served.l1, report.served.l2) == (0, 8)
    assert report.moved.l2_to_l1 == 8
    assert report.moved.l1_to_l2 == 16  # written through once; the third request loads the host copy
    assert report.evicted.l1 == 16
    # Below the load-back threshold the host hit is recomputed instead.
    below = simulate(w, config(device_size=8, hicache_write_policy="write_through", load_back_threshold=10))
    assert (below.served.l2, below.served.computed, below.served.recomputed) == (0, 24, 8)


def test_two_ranks_that_retire_their_loads_apart_serve_as_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """D-68 (SGLang up to 0.5.12) on two ranks: the simulator reaps every rank's loads before a request ends, as
    the forward pass and the next check do (the model refuses the finish otherwise), and serves what one rank
    does."""
    w = Workload([request(1, [1, 2]), request(2, [3, 4]), request(3, [1, 2])], 4)
    options = {"device_size": 8, "hicache_write_policy": "write_through", "load_back_threshold": 1}
    one = simulate(w, config(**options))
    two = simulate(
        w, config(**options, tp_size=2, loads_retired_per_rank=True), SimOptions(check_invariants=True)
    )
    assert (two.served, two.moved.l2_to_l1) == (one.served, one.moved.l2_to_l1) and two.served.l2 == 8


def test_the_l1_must_hold_the_longest_request() -> None:
    with pytest.raises(UsageError, match="longest request needs 16"):
        simulate(Workload([request(1, [1, 2, 3, 4])], 4), config(device_size=12))


def test_slow_storage_times_out_under_the_timeout_policy() -> None:
    prompts = [list(range(10 * p, 10 * p + 6)) for p in range(3)]
    w = Workload([request(i, prompts[i % 3], at=1000.0 * i) for i in range(6)], 4)
    cfg = config(
        device_size=24,
        hicache_ratio=2.0,
        hicache_write_policy="write_through",
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy="timeout",
        prefetch_threshold=4,
        storage_batch_size=1,
        prefetch_timeout_base=0.002,
        prefetch_timeout_per_ki_token=0.0,
    )
    options = SimOptions(queue_delay_us=0, l3_batch_us=1000, check_invariants=True)
    report = simulate(w, cfg, options)
    # The first round finds nothing in L3 (revoked); each repeat reads one page per ms and the check after
    # the third page sees 3 ms > 2 ms: three of its six pages are inserted and loaded.
    assert (report.prefetch.revoked, report.prefetch.timed_out) == (3, 3)
    assert report.served.l3 == 3 * 3 * 4
    best = simulate(
        w, dataclasses.replace(cfg, hicache_storage_prefetch_policy=PrefetchPolicy.BEST_EFFORT), options
    )
    assert best.prefetch.cut_short == 3 and best.served.l3 == 0
    whole = simulate(
        w, dataclasses.replace(cfg, hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE), options
    )
    assert (whole.prefetch.timed_out, whole.prefetch.cut_short, whole.served.l3) == (0, 0, 72)


# --- accounting against a per-operation ground truth ------------------------------------------------------


@dataclasses.dataclass
class _Pages:
    host: frozenset[Token]
    device: frozenset[Token]


def _pages(snapshot: Snapshot) -> _Pages:
    ps = snapshot.page_size
    host: set[Token] = set()
    device: set[Token] = set()
    for node in snapshot.ranks[0].nodes:
        last_tokens = node.id.path[len(node.id.path) - node.key_len + ps - 1 :: ps]
        if node.host_value is not None:
            host.update(last_tokens)
        if node.value is not None:
            device.update(last_tokens)
    return _Pages(frozenset(host), frozenset(device))


class GroundTruth:
    """Wraps a system and diffs rank 0's pages after every operation: what the simulator must count."""

    def __init__(self, system: HiCacheSystem) -> None:
        self.system = system
        self.page_size = system.snapshot().page_size
        self.before = _pages(system.snapshot())
        self.written = self.evicted_l1 = self.evicted_l2 = self.prefetched = 0

    def apply(self, op: Op) -> Observation:
        observation = self.system.apply(op)
        after = _pages(self.system.snapshot())
        gained = len(after.host - self.before.host) * self.page_size
        if isinstance(op, CheckPrefetchProgress):
            self.prefetched += gained
        else:
            self.written += gained
        self.evicted_l2 += len(self.before.host - after.host) * self.page_size
        self.evicted_l1 += len(self.before.device - after.device) * self.page_size
        self.before = after
        return observation

    def snapshot(self) -> Snapshot:
        return self.system.snapshot()

    def close(self) -> None:
        self.system.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _check_against_ground_truth(w: Workload, cfg: HiCacheConfig, options: SimOptions) -> SimReport:
    with open_systems(["model"], cfg) as systems:
        truth = GroundTruth(systems["model"])
        report = simulate(w, cfg, options, system=truth)
    assert report.moved.l1_to_l2 == truth.written
    assert report.evicted.l2 == truth.evicted_l2
    assert report.evicted.l1 == truth.evicted_l1
    assert report.moved.l3_to_l2 == truth.prefetched
    return report


def _revisits() -> Workload:
    """Eight 4-block prompts with a shared first block, revisited out of order: L1 holds two, L1+L2 about
    three, so requests hit L1, load back from L2 and prefetch from L3."""
    prompts = [[0, 100 + 10 * p, 101 + 10 * p, 102 + 10 * p] for p in range(8)]
    order = [0, 1, 2, 0, 3, 4, 1, 5, 6, 0, 7, 2, 3, 1, 4, 5, 6, 7, 0, 2]
    return Workload([request(i, prompts[p], output=400, at=float(i)) for i, p in enumerate(order)], 4)


@pytest.mark.parametrize("write_policy", list(WritePolicy))
@pytest.mark.parametrize("eviction", [EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.MRU])
def test_counters_match_a_per_operation_ground_truth(
    write_policy: WritePolicy, eviction: EvictionPolicy
) -> None:
    cfg = HiCacheConfig(
        device_size=40,
        hicache_ratio=1.5,
        page_size=2,
        hicache_write_policy=write_policy,
        radix_eviction_policy=eviction,
        hicache_storage_backend="file",
        prefetch_threshold=2,
        storage_batch_size=2,
        load_back_threshold=1,
    )
    report = _check_against_ground_truth(_revisits(), cfg, SimOptions(queue_delay_us=1000))
    assert report.evicted.l1 > 0 and report.served.l1 > 0


def test_counters_match_the_ground_truth_on_the_real_excerpt() -> None:
    w = Workload(read_mooncake_trace(EXCERPT, limit=40), 2)
    cfg = HiCacheConfig(
        device_size=384,
        hicache_ratio=1.5,
        page_size=2,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        prefetch_threshold=2,
    )
    report = _check_against_ground_truth(w, cfg, SimOptions())
    assert report.evicted.l2 > 0 and report.moved.l2_to_l3 > 0


def test_sparse_audits_give_lower_bounds() -> None:
    w = Workload(read_mooncake_trace(EXCERPT, limit=60), 2)
    cfg = HiCacheConfig(
        device_size=512, hicache_ratio=1.5, page_size=2, radix_eviction_policy=EvictionPolicy.MRU
    )
    exact = simulate(w, cfg, SimOptions(audit_every=1))
    sparse = simulate(w, cfg, SimOptions(audit_every=20))
    assert sparse.moved.l1_to_l2 <= exact.moved.l1_to_l2 and sparse.evicted.l2 <= exact.evicted.l2
    assert exact.moved.l1_to_l2 - sparse.moved.l1_to_l2 == exact.evicted.l2 - sparse.evicted.l2
    assert sparse.evicted.l1 == exact.evicted.l1  # from the device balance: exact at any cadence
    assert (exact.audit, sparse.audit) == ("exact", "lower_bound")
    off = simulate(w, cfg, SimOptions(audit_every=0)).to_json()
    assert off["audit"] == "off" and off["evicted_tokens"] == {"l1": exact.evicted.l1, "l2": None}


# --- the bound is never below a policy: a property over small random traces -------------------------------


@st.composite
def traces(draw: st.DrawFn) -> list[TraceRequest]:
    """Requests that mostly repeat or extend earlier ones: ids of a prefix, then fresh ids (ids encode the
    prefix, as in Mooncake traces)."""
    prompts: list[list[int]] = []
    out: list[TraceRequest] = []
    fresh = 0
    at = 0.0
    cycle = draw(st.sampled_from((0, 0, 3, 5)))  # > 0: mostly revisit that many prompts in turn (thrashing)
    for line in range(1, draw(st.integers(1, 20)) + 1):
        ids: list[int] = []
        if cycle and len(prompts) >= cycle and draw(st.integers(0, 4)) > 0:
            ids = list(prompts[len(prompts) - cycle])
        elif prompts and draw(st.integers(0, 3)) > 0:
            base = draw(st.sampled_from(prompts))
            ids = base[: draw(st.sampled_from((len(base), len(base), 1, max(1, len(base) - 1))))]
        for _ in range(0 if cycle and len(ids) > 1 else draw(st.integers(0 if ids else 1, 3))):
            ids.append(fresh)
            fresh += 1
        prompts.append(ids)
        at += draw(st.sampled_from((0.0, 0.5, 3.0)))
        last = draw(st.sampled_from((512, 512, 100, 300)))
        out.append(request(line, ids, last=last, output=draw(st.sampled_from((0, 0, 200, 1100))), at=at))
    return out


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=traces(), data=st.data())
def test_the_offline_bound_is_never_below_a_policy(requests: list[TraceRequest], data: st.DataObject) -> None:
    w = Workload(requests, data.draw(st.sampled_from((2, 4)), label="block_tokens"))
    page_size = data.draw(st.sampled_from((1, 2, 4)), label="page_size")
    l1 = w.longest_request + data.draw(st.sampled_from((0, 0, 4, w.longest_request)), label="l1_extra")
    cfg = HiCacheConfig(
        device_size=-(-l1 // page_size) * page_size,
        page_size=page_size,
        hicache_ratio=data.draw(st.sampled_from((1.2, 1.5, 2.0, 3.0)), label="ratio"),
        hicache_write_policy=data.draw(st.sampled_from(list(WritePolicy)), label="write"),
        radix_eviction_policy=data.draw(st.sampled_from(list(EvictionPolicy)), label="eviction"),
        hicache_storage_backend=data.draw(st.sampled_from(("file", None)), label="l3"),
        hicache_storage_prefetch_policy=data.draw(st.sampled_from(list(PrefetchPolicy)), label="prefetch"),
        prefetch_threshold=data.draw(st.sampled_from((1, 2 * page_size)), label="threshold"),
        storage_batch_size=data.draw(st.sampled_from((1, 2, 128)), label="batch"),
        prefetch_timeout_base=0.001,
        prefetch_timeout_per_ki_token=0.0,
        load_back_threshold=data.draw(st.sampled_from((0, 1, 10)), label="load_back_threshold"),
        tp_size=data.draw(st.sampled_from((1, 2)), label="tp"),
    )
    options = SimOptions(queue_delay_us=data.draw(st.sampled_from((0, 1500)), label="delay"))
    report = _check_against_ground_truth(w, cfg, options)
    s, b = report.served, report.bounds
    assert s.l1 + s.l2 + s.l3 + s.computed + s.rejected == s.input == w.input_tokens
    assert s.rejected == 0 and 0 <= s.recomputed <= s.computed
    assert s.l1 <= b.belady_l1 <= b.belady_l1_l2 <= b.infinite
    assert s.l1 + s.l2 <= b.belady_l1_l2
    assert s.l1 + s.l2 + s.l3 <= b.infinite
    if not cfg.enable_storage:
        assert s.l3 == report.moved.l2_to_l3 == report.moved.l3_to_l2 == 0


# --- systems ----------------------------------------------------------------------------------------------


def test_an_unknown_system_is_refused() -> None:
    with pytest.raises(UsageError, match="expected one of model, impl"):
        open_systems(["nosuchcache"], HiCacheConfig())
    with pytest.raises(UsageError, match="system 'nosuchcache'"):
        SimOptions(system="nosuchcache")


def test_the_impl_system_fails_clearly_when_it_cannot_be_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    real = importlib.import_module

    def fake(name: str, package: str | None = None) -> object:
        if name == "refcache.gpu.driver":
            raise ModuleNotFoundError("No module named 'torch'")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", fake)
    with pytest.raises(UsageError, match=r"system 'impl' .*cannot be imported here: .*torch"):
        open_systems(["impl"], HiCacheConfig())


def test_the_impl_system_agrees_with_the_model() -> None:
    pytest.importorskip("torch")
    prompts = [[10 * p, 10 * p + 1, 10 * p + 2] for p in range(6)]
    w = Workload([request(i, prompts[i % 6], output=300) for i in range(12)], 4)
    cfg = config(
        device_size=24,
        hicache_ratio=1.5,
        hicache_write_policy="write_through",
        hicache_storage_backend="file",
        prefetch_threshold=4,
        hicache_io_backend="direct",  # the kernel backend needs CUDA or the Triton interpreter
    )
    reports = [simulate(w, cfg, SimOptions(system=system)).to_json() for system in ("model", "impl")]
    for report in reports:
        for key in ("seconds", "requests_per_second", "options"):
            del report[key]
    assert reports[0] == reports[1]
    served = reports[0]["served"]
    assert isinstance(served, dict) and served["l3"] == 72  # the repeats came back from L3


# --- sweep, plot and command line -------------------------------------------------------------------------


def test_the_sweep_writes_a_png(tmp_path: Path) -> None:
    w = Workload(read_mooncake_trace(EXCERPT, limit=40), 2)
    reports = sweep(
        w,
        HiCacheConfig(device_size=512, page_size=2),
        l2_ratios=(1.5, 3.0),
        evictions=("lru", "lfu"),
        write_policies=("write_through",),
    )
    assert [(r.config.hicache_ratio, r.config.radix_eviction_policy.value) for r in reports] == [
        (1.5, "lru"),
        (1.5, "lfu"),
        (3.0, "lru"),
        (3.0, "lfu"),
    ]
    assert reports[0].bounds.belady_l1_l2 <= reports[2].bounds.belady_l1_l2
    pytest.importorskip("matplotlib")
    path = tmp_path / "sweep.png"
    plot_sweep(reports, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_names_identical_series_and_explains_itself(tmp_path: Path) -> None:
    """Two eviction strategies that never get to choose differently give identical series: the notes say
    so (the plot draws the second beneath the first); the L2 size and the write-back starvation of L3 are explained
    from the reports."""
    w = Workload(read_mooncake_trace(EXCERPT, limit=60), 16)
    reports = sweep(
        w,
        HiCacheConfig(device_size=16384, page_size=16, hicache_storage_backend="file"),
        l2_ratios=(2.0, 4.0),
        evictions=("lru", "lfu"),
        write_policies=("write_back",),
    )
    assert identical_series(reports) == {"lru / write_back": "lfu / write_back"}
    notes = "\n".join(report_notes(reports))
    assert "ratio 2: 32,768 // 16 + 1 = 2,049 pages = 32,784 tokens" in notes
    assert "L3 served nothing under write_back" in notes and "last_node_not_backuped" in notes
    assert "partial last page" in notes
    assert "lru / write_back equals lfu / write_back" in notes
    pytest.importorskip("matplotlib")
    plot_sweep(reports, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_the_sweep_checks_matplotlib_before_it_simulates(monkeypatch: pytest.MonkeyPatch) -> None:
    import refcache.sim.command

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the sweep ran before matplotlib was checked")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    monkeypatch.setattr(refcache.sim.command, "sweep", never)
    result = CliRunner().invoke(app, ["simulate", str(EXCERPT), "--sweep"])
    assert result.exit_code == 2 and "matplotlib" in result.output and "pip install" in result.output


def test_per_request_rows_add_up_to_the_report(tmp_path: Path) -> None:
    """``--per-request FILE.csv``: one row per request, token and page counts side by side; every column
    sums to the report's counter."""
    out = tmp_path / "requests.csv"
    args = [
        "simulate",
        str(EXCERPT),
        "--limit",
        "60",
        "--l1-tokens",
        "4096",
        "--l3",
        "--per-request",
        str(out),
    ]
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    with open(out, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 60 and [int(r["rid"]) for r in rows] == list(range(60))

    def total(column: str) -> int:
        return sum(int(r[column]) for r in rows)

    served = payload["served"]
    assert total("input_tokens") == served["input"]
    assert total("l1_hit_tokens") == served["l1"] and total("l2_hit_tokens") == served["l2"]
    assert total("l3_hit_tokens") == served["l3"] and total("computed_tokens") == served["computed"]
    assert total("computed_pages") == served["computed_pages"]
    assert total("l1_evicted_tokens") == payload["evicted_tokens"]["l1"]
    assert total("l2_evicted_tokens") == payload["evicted_tokens"]["l2"]
    assert total("l1_to_l2_tokens") == payload["moved_tokens"]["l1_to_l2"]
    assert total("prefetch_inserted_tokens") == payload["prefetch"]["inserted"]
    for row in rows:
        for tier in ("l1_hit", "l2_hit", "l3_hit", "l1_evicted", "l2_evicted"):
            assert int(row[f"{tier}_pages"]) * 16 == int(row[f"{tier}_tokens"])  # whole pages
    outcomes = {r["prefetch"] for r in rows}
    assert outcomes <= {"complete", "revoked", "timed_out", "cut_short"} | {
        f"refused:{reason}" for reason in payload["prefetch"]["refused"]
    }


def test_the_command_prints_a_report_and_json(tmp_path: Path) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})  # rich would cut table cells at 80 columns
    common = ["simulate", str(EXCERPT), "--limit", "50", "--block-tokens", "2", "--page-size", "2"]
    result = runner.invoke(app, [*common, "--l1-tokens", "512", "--l3"])
    assert result.exit_code == 0, result.output
    assert "L1 device hit" in result.output and "Belady(L1+L2)" in result.output
    assert "L3 prefetch" in result.output
    for audit in ([], ["--audit-every", "0"]):  # the default is the cheap run; the report says what it lacks
        result = runner.invoke(app, [*common, "--l1-tokens", "512", *audit])
        assert result.exit_code == 0 and "not counted" in result.output and "--audit-every 1" in result.output
    result = runner.invoke(app, [*common, "--l1-tokens", "512", "--audit-every", "10"])
    assert result.exit_code == 0 and "≥ " in result.output
    result = runner.invoke(app, [*common, "--l1-tokens", "512", "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.output)
    assert payload["requests"] == 50
    assert (
        payload["moved_bytes"]["l2_to_l1"] == payload["moved_tokens"]["l2_to_l1"] * payload["bytes_per_token"]
    )
    assert 0 <= payload["hit_rates"]["l1"] <= payload["hit_rates"]["belady_l1"] <= 1
    pytest.importorskip("matplotlib")
    plot = tmp_path / "s.png"
    result = runner.invoke(
        app,
        [*common, "--l1-tokens", "512", "--sweep", "--sweep-l2-ratios", "2,4", "--sweep-evictions", "lru",
         "--sweep-write-policies", "write_back", "--plot", str(plot)],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert plot.exists() and "write_back" in result.output


def test_the_command_reports_errors_without_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{GOOD}\n{{\n", encoding="utf-8")
    result = CliRunner().invoke(app, ["simulate", str(bad)])
    assert result.exit_code == 2 and "bad.jsonl:2: not valid JSON" in result.output
    result = CliRunner().invoke(app, ["simulate", str(EXCERPT), "--l1-tokens", "64"])
    assert result.exit_code == 2 and "longest request" in result.output
    result = CliRunner().invoke(app, ["simulate", str(EXCERPT), "--sweep", "--sweep-evictions", "lru,nope"])
    assert result.exit_code == 2 and "'nope' is not valid" in result.output
