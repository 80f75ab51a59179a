"""``refcache explore`` and the enabled-operation function it shares with the machines: the canonical form merges
what it should and never what it must not, BFS finds a planted bug at its minimal depth, a resumed (parallel,
spilled) exploration counts what one run counts, the counterexample is a trace replay accepts, and the
command's smoke run (seconds: CI runs it)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from refcache.check.coverage import Coverage
from refcache.check.enabled import MAX_RUNNING, Bounds, enabled_kinds, enabled_ops
from refcache.check.explore import Space, canonical, compare_coverage, explore, fresh_rid, load, normalize
from refcache.check.families import family_checks
from refcache.check.harness import Divergence
from refcache.cli import app
from refcache.config import EvictionPolicy, HiCacheConfig, WritePolicy
from refcache.errors import RefcacheError, UsageError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AbortRequest,
    CacheUnfinishedRequest,
    CheckPrefetchProgress,
    Evict,
    FaultKind,
    FinishRequest,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    StartRequest,
)
from refcache.model import HiCacheModel
from refcache.model._pools import DeviceAllocator

CONFIG = HiCacheConfig(
    page_size=1,
    device_size=2,
    hicache_ratio=2.0,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    hicache_storage_backend="file",
    prefetch_threshold=1,
    prefetch_timeout_base=0.001,
    load_back_threshold=1,
    storage_batch_size=1,
).resolve()
BOUNDS = Bounds(((1,), (1, 2)), matches=False, cache_unfinished=False)
SPACE = Space(CONFIG, BOUNDS)


def _enabled(model: HiCacheModel, bounds: Bounds = BOUNDS) -> list[Op]:
    return enabled_ops(model.snapshot(), bounds, fresh_rid(model))


def _apply(model: HiCacheModel, op: Op) -> object:
    try:
        return model.apply(op)
    except RefcacheError as error:
        return type(error).__name__


def _clone(model: HiCacheModel) -> HiCacheModel:
    clone: HiCacheModel = pickle.loads(pickle.dumps(model))  # the explorer's fork, 3x cheaper than deepcopy
    return clone


def _paths(
    config: HiCacheConfig, bounds: Bounds, depth: int
) -> Iterator[tuple[tuple[Op, ...], HiCacheModel]]:
    """Every enabled sequence of up to ``depth`` operations (no deduplication), with the model after it."""
    frontier: list[tuple[tuple[Op, ...], HiCacheModel]] = [((), HiCacheModel(config))]
    for _ in range(depth):
        nxt = []
        for path, model in frontier:
            for op in _enabled(model, bounds):
                child = _clone(model)
                _apply(child, op)
                nxt.append(((*path, op), child))
                yield nxt[-1]
        frontier = nxt


# --- the enabled-operation function ----------------------------------------------------------------------------


def test_enabled_kinds_follow_the_requests() -> None:
    idle = enabled_kinds((), ())
    assert not idle & {FinishRequest, AbortRequest, CacheUnfinishedRequest, CheckPrefetchProgress}
    assert {StartRequest, PrefetchFromStorage} <= idle
    busy = enabled_kinds(range(MAX_RUNNING), range(3))
    assert {FinishRequest, AbortRequest, CheckPrefetchProgress} <= busy
    assert not busy & {StartRequest, PrefetchFromStorage}


def test_every_enabled_operation_is_accepted() -> None:
    """What ``enabled_ops`` lists, the model never refuses as a usage error (faults and clocks included)."""
    bounds = dataclasses.replace(
        BOUNDS, clock_steps=(100,), fault_kinds=(FaultKind.DELETE, FaultKind.DISK_FULL), prompt_lens=(1,)
    )
    seen = 0
    for _, model in _paths(CONFIG, bounds, 2):
        for op in _enabled(model, bounds):
            try:
                _clone(model).apply(op)
            except UsageError as error:  # pragma: no cover - the failure message
                pytest.fail(f"{op!r} was listed as enabled but refused: {error}")
            seen += 1
    assert seen > 100


def test_prompt_lengths_are_listed_beside_the_whole_prompt_and_off_by_default() -> None:
    """``Bounds.prompt_lens``: each length shorter than a sequence adds a request carrying it, beside the one
    without (all prompt); the default lists no prompt length, so the alphabet of earlier explorations stands."""
    model = HiCacheModel(CONFIG)
    starts = [
        op
        for op in _enabled(model, Bounds(((1,), (1, 2, 3)), prompt_lens=(2, 3)))
        if isinstance(op, StartRequest)
    ]
    assert [(op.tokens, op.prompt_len) for op in starts] == [((1,), None), ((1, 2, 3), None), ((1, 2, 3), 2)]
    assert all(op.prompt_len is None for op in _enabled(model) if isinstance(op, StartRequest))
    with pytest.raises(UsageError, match="at least 1 token"):
        Bounds(((1,),), prompt_lens=(0,))


def test_prompt_lengths_reach_the_states_of_the_prompt_reinsert() -> None:
    """With D-24's re-insert of the prompt, a request whose prompt is shorter than its sequence splits the
    node it inserts: states no request without a prompt length reaches at that depth."""
    config = dataclasses.replace(
        CONFIG,
        device_size=3,
        hicache_storage_backend=None,
        reinsert_prompt_prefix=True,
        radix_eviction_policy=EvictionPolicy.PRIORITY,
    ).resolve()
    bounds = Bounds(((1, 2, 3),), matches=False, cache_unfinished=False)
    without = explore(Space(config, bounds), depth=2)
    with_prompts = explore(Space(config, dataclasses.replace(bounds, prompt_lens=(2,))), depth=2)
    assert with_prompts.complete and without.complete
    assert with_prompts.states > without.states


# --- the canonical form ----------------------------------------------------------------------------------------


def _after(ops: Iterable[Op], config: HiCacheConfig = CONFIG) -> HiCacheModel:
    model = HiCacheModel(config)
    for op in ops:
        model.apply(op)
    return model


BUSY = (StartRequest(0, (1, 2)), FinishRequest(0), StartRequest(0, (1,)), StartRequest(1, (2,)))


def test_shifted_stamps_are_one_state() -> None:
    """Two states whose access and creation stamps differ by an order-preserving shift are merged."""
    model = _after(BUSY)
    shifted = copy.deepcopy(model)
    for rank in shifted.ranks:
        for node in rank.nodes.values():
            node.last_access_time += 7
            node.creation_time += 7
        rank._tick += 7
    assert pickle.dumps(model) != pickle.dumps(shifted)
    normalize(model)
    normalize(shifted)
    assert canonical(model) == canonical(shifted)


def test_reordered_stamps_are_two_states() -> None:
    """Swapping two nodes' access stamps changes the eviction order: never merged."""
    model = _after(BUSY)
    swapped = copy.deepcopy(model)
    nodes = sorted(swapped.ranks[0].nodes.values(), key=lambda n: n.last_access_time)
    a, b = nodes[0], nodes[-1]
    assert a.last_access_time != b.last_access_time
    a.last_access_time, b.last_access_time = b.last_access_time, a.last_access_time
    normalize(model)
    normalize(swapped)
    assert canonical(model) != canonical(swapped)


def test_used_tokens_are_part_of_the_key() -> None:
    model = _after(())
    normalize(model)
    assert canonical(model, {1}) != canonical(model, {1, 2})


@pytest.mark.parametrize(
    "policy", [EvictionPolicy.LRU, EvictionPolicy.MRU, EvictionPolicy.FIFO, EvictionPolicy.FILO]
)
def test_a_normalized_model_evicts_the_same_leaf(policy: EvictionPolicy) -> None:
    """Two evictable leaves whose stamps decide which goes first: the normalized copy picks the same one."""
    config = dataclasses.replace(CONFIG, radix_eviction_policy=policy, device_size=3)
    model = _after(
        (StartRequest(0, (1,)), FinishRequest(0), StartRequest(0, (2,)), FinishRequest(0), MatchPrefix((1,))),
        config,
    )
    copied = _clone(model)
    normalize(copied)
    assert _apply(copied, Evict(1)) == _apply(model, Evict(1))
    assert copied.snapshot() == model.snapshot()


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.FIFO])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_normalize_changes_no_behaviour(policy: EvictionPolicy, data: st.DataObject) -> None:
    """A normalized copy answers every operation as the original does and reports equal snapshots, step after
    step, under the policies that read the stamps (the soundness of the canonical form's rewriting)."""
    config = dataclasses.replace(CONFIG, radix_eviction_policy=policy, hicache_ratio=3.0)
    bounds = dataclasses.replace(BOUNDS, sequences=((1,), (1, 2), (2,), (2, 1)), matches=True)
    model = HiCacheModel(config)
    copied: HiCacheModel | None = None
    cut = data.draw(st.integers(0, 8), label="normalize after")
    for step in range(16):
        if step == cut:
            copied = copy.deepcopy(model)
            normalize(copied)
        op = data.draw(st.sampled_from(_enabled(model, bounds)), label="op")
        outcome = _apply(model, op)
        if copied is not None:
            assert _apply(copied, op) == outcome, op
            assert copied.snapshot() == model.snapshot(), op


def test_merged_states_cannot_be_told_apart() -> None:
    """Every two sequences (up to depth 4) whose states share a key: equal snapshots, equal invariant verdicts,
    equal enabled operations, and every continuation of two operations answered and reported alike."""
    groups: dict[bytes, HiCacheModel] = {}
    pairs = 0
    for _, model in _paths(CONFIG, BOUNDS, 4):
        normalized = _clone(model)
        normalize(normalized)
        key = canonical(normalized)
        first = groups.setdefault(key, model)
        if first is model:
            continue
        pairs += 1
        if pairs > 60:
            break
        assert first.snapshot() == model.snapshot()
        assert HICACHE.check(first.snapshot()) == HICACHE.check(model.snapshot())
        assert _enabled(first) == _enabled(model)
        for op in _enabled(model):
            a, b = _clone(first), _clone(model)
            assert _apply(a, op) == _apply(b, op)
            for then in _enabled(a):
                c, d = _clone(a), _clone(b)
                assert _apply(c, then) == _apply(d, then)
                assert c.snapshot() == d.snapshot()
    assert pairs > 60, "the canonical form merged too few sequences to test anything"


# --- the search ------------------------------------------------------------------------------------------------


@contextmanager
def _leaky_free() -> Iterator[None]:
    """A planted bug: freeing two device slots or more keeps the last one out of the free list (a leak that
    DEVICE-CONSERVATION sees)."""
    original = DeviceAllocator.free

    def free(self: DeviceAllocator, slots: Iterable[int]) -> None:
        slots = list(slots)
        original(self, slots[:-1] if len(slots) >= 2 else slots)

    with mock.patch.object(DeviceAllocator, "free", free):
        yield


def _minimal_failing_depth(depth: int) -> int | None:
    for path, model in _paths(CONFIG, BOUNDS, depth):
        if HICACHE.check(model.snapshot()):
            return len(path)
    return None


def test_bfs_finds_a_planted_bug_at_its_minimal_depth(tmp_path: Path) -> None:
    with _leaky_free():
        minimal = _minimal_failing_depth(4)
        result = explore(SPACE, depth=6, trace_dir=tmp_path)
    assert minimal is not None
    cx = result.counterexample
    assert cx is not None and cx.depth == minimal, (cx, minimal)
    assert "DEVICE-CONSERVATION" in cx.what
    assert cx.written is not None and cx.written.exists()
    # The written trace is a normal one: replay fails on it under the bug, and passes without it.
    with _leaky_free(), pytest.raises(Divergence):
        family_checks("hicache").replay(cx.written, ["model"])
    assert family_checks("hicache").replay(cx.written, ["model"]) == cx.depth


def test_the_model_as_shipped_passes_to_depth_4() -> None:
    result = explore(SPACE, depth=4)
    assert result.complete and result.counterexample is None
    assert [lv.depth for lv in result.levels] == [1, 2, 3, 4]
    assert result.states == 1 + sum(lv.frontier for lv in result.levels)
    assert result.coverage.steps == result.transitions


def test_resume_counts_what_one_run_counts(tmp_path: Path) -> None:
    whole = explore(SPACE, depth=4)
    checkpoint = tmp_path / "explore.ckpt"
    explore(SPACE, depth=2, checkpoint=checkpoint)
    resumed = explore(SPACE, depth=4, resume=load(checkpoint))
    assert (resumed.states, resumed.transitions, resumed.levels[-1].frontier) == (
        whole.states,
        whole.transitions,
        whole.levels[-1].frontier,
    )
    assert [lv.frontier for lv in resumed.levels] == [lv.frontier for lv in whole.levels]


def test_jobs_and_spill_count_what_one_process_counts(tmp_path: Path) -> None:
    one = explore(SPACE, depth=4)
    two = explore(SPACE, depth=4, jobs=2)
    spilled = explore(SPACE, depth=4, spill=tmp_path / "seen.sqlite")
    assert (
        (one.states, one.transitions)
        == (two.states, two.transitions)
        == (spilled.states, spilled.transitions)
    )


def test_a_budget_stops_early_and_says_so() -> None:
    result = explore(SPACE, depth=8, max_states=50)
    assert not result.complete and result.states >= 50


def test_misplaced_faults_refuse_token_relabelling() -> None:
    with pytest.raises(UsageError, match="MISPLACED"):
        Space(CONFIG, dataclasses.replace(BOUNDS, fault_kinds=(FaultKind.MISPLACED,)), token_symmetry=True)


def test_the_command_explores_and_reports(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["explore", "--depth", "3", "--trace-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "(exhaustive)" in result.output and "distinct states" in result.output


def test_the_command_takes_prompt_lengths_and_refuses_a_bad_one(tmp_path: Path) -> None:
    common = ["explore", "--depth", "2", "--trace-dir", str(tmp_path), "--sequences", "1 2 3", "--no-l3"]
    common += ["--device-pages", "3", "--reinsert-prompt-prefix", "--eviction-policy", "priority"]
    result = CliRunner().invoke(app, [*common, "--prompt-lens", "2"])
    assert result.exit_code == 0, result.output
    assert "(exhaustive)" in result.output
    refused = CliRunner().invoke(app, [*common, "--prompt-lens", "0"])
    assert refused.exit_code == 2 and "at least 1 token" in refused.output, refused.output


def test_the_command_exits_1_with_the_counterexample(tmp_path: Path) -> None:
    with _leaky_free():
        result = CliRunner().invoke(app, ["explore", "--depth", "4", "--trace-dir", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "COUNTEREXAMPLE at depth" in result.output
    assert list(tmp_path.glob("explore-depth*.jsonl"))


def test_coverage_comparison_names_what_only_one_side_reached() -> None:
    explored, sampled = Coverage(), Coverage()
    explored.transitions.update({"host--load_back": 2, "both--evict": 1})
    sampled.transitions.update({"both--evict": 5, "device--write_backup": 1})
    text = compare_coverage(explored, sampled)
    assert "transitions: exploration 2, machines 2, both 1" in text
    assert "only the exploration: host--load_back" in text
    assert "only the machines: device--write_backup" in text


def test_a_prefix_is_where_the_search_starts_and_part_of_the_trace(tmp_path: Path) -> None:
    prefix = (StartRequest(0, (1, 2)),)
    plain = explore(Space(CONFIG, BOUNDS, prefix=prefix), depth=2)
    assert plain.complete and plain.levels[0].depth == 1
    with _leaky_free():
        result = explore(Space(CONFIG, BOUNDS, prefix=prefix), depth=3, trace_dir=tmp_path)
    cx = result.counterexample
    assert cx is not None and cx.ops[:1] == prefix and cx.written is not None
    with _leaky_free(), pytest.raises(Divergence):
        family_checks("hicache").replay(cx.written, ["model"])


def test_a_failing_prefix_is_the_counterexample() -> None:
    with _leaky_free():
        result = explore(Space(CONFIG, BOUNDS, prefix=(StartRequest(0, (1, 2)), AbortRequest(0))), depth=3)
    assert result.counterexample is not None and result.counterexample.depth == 2
    assert not result.levels


def test_token_relabelling_prunes_renamed_sequences_and_finds_the_same_depth() -> None:
    """With sequences that differ by a renaming ((1,) and (2,)), relabelling explores fewer states and still
    finds the planted leak at the depth the full search finds it."""
    bounds = dataclasses.replace(BOUNDS, sequences=((1,), (2,), (1, 2), (2, 1)))
    full = explore(Space(CONFIG, bounds), depth=3)
    relabelled = explore(Space(CONFIG, bounds, token_symmetry=True), depth=3)
    assert relabelled.states < full.states
    with _leaky_free():
        depths = [
            explore(Space(CONFIG, bounds, token_symmetry=s), depth=5).counterexample for s in (False, True)
        ]
    assert depths[0] is not None and depths[1] is not None and depths[0].depth == depths[1].depth
