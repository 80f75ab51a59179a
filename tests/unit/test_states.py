"""The node state machine and the prefetch stage machine: every (state, event) pair, the model's use of
them, and the generated tables."""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import TypeVar

import pytest

from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError, TransitionError, UsageError
from refcache.hicache.states import (
    PREFETCH_TRANSITIONS,
    TRANSITIONS,
    NodeEvent,
    NodeState,
    PrefetchEvent,
    PrefetchStage,
    next_stage,
    next_state,
)
from refcache.model._controller import L3Store, PrefetchOperation
from refcache.model._rank import RankCache, TreeNode

PAIRS = list(itertools.product(NodeState, NodeEvent))
LEGAL = [pair for pair in PAIRS if pair in TRANSITIONS]
ILLEGAL = [pair for pair in PAIRS if pair not in TRANSITIONS]
SPECS = Path(__file__).resolve().parents[2] / "specs"
S = TypeVar("S", bound=StrEnum)
E = TypeVar("E", bound=StrEnum)


def _id(pair: tuple[NodeState, NodeEvent]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


def test_pairs_partition() -> None:
    assert len(LEGAL) + len(ILLEGAL) == len(NodeState) * len(NodeEvent)
    assert set(TRANSITIONS) <= set(PAIRS)
    assert LEGAL, "the table is empty"


@pytest.mark.parametrize("pair", LEGAL, ids=_id)
def test_legal_pair_gives_the_tables_state(pair: tuple[NodeState, NodeEvent]) -> None:
    assert next_state(*pair) is TRANSITIONS[pair]


@pytest.mark.parametrize("pair", ILLEGAL, ids=_id)
def test_illegal_pair_raises(pair: tuple[NodeState, NodeEvent]) -> None:
    state, event = pair
    with pytest.raises(
        TransitionError, match=f"no transition from '{state.value}' on '{event.value}'"
    ) as info:
        next_state(state, event)
    # a bug in the system that raised it, not the caller's mistake: an outcome, never a usage error
    assert issubclass(type(info.value), RefcacheError)
    assert not isinstance(info.value, UsageError)
    legal = sorted(e.value for (s, e) in TRANSITIONS if s is state)
    assert str(legal) in str(info.value)  # the message lists what would be legal


def _rank() -> RankCache:
    return RankCache(HiCacheConfig(), 0, L3Store())


@pytest.mark.parametrize("pair", ILLEGAL, ids=_id)
def test_model_transition_leaves_state_unchanged_on_illegal_pair(pair: tuple[NodeState, NodeEvent]) -> None:
    rank = _rank()
    state, event = pair
    node = TreeNode(999, None, 0)
    node.state = state
    with pytest.raises(TransitionError):
        rank._transition(node, event)
    assert node.state is state
    assert rank.transitions_taken == {}


@pytest.mark.parametrize("pair", LEGAL, ids=_id)
def test_model_transition_follows_the_table(pair: tuple[NodeState, NodeEvent]) -> None:
    rank = _rank()
    state, event = pair
    node = TreeNode(999, None, 0)
    node.state = state
    rank._transition(node, event)
    assert node.state is TRANSITIONS[pair]
    assert rank.transitions_taken == {pair: 1}


def test_state_flags_match_sglang_booleans() -> None:
    """``evicted`` is "no device copy", ``backuped`` is "a host copy exists" (seed §1.1)."""
    assert {s for s in NodeState if s.evicted} == {NodeState.HOST, NodeState.GONE}
    assert {s for s in NodeState if s.backuped} == {NodeState.BOTH, NodeState.HOST}


def test_every_state_is_reachable_and_every_live_state_can_leave() -> None:
    targets = set(TRANSITIONS.values())
    assert set(NodeState) <= targets | {NodeState.GONE}
    for state in NodeState:
        if state is not NodeState.GONE:
            assert (state, NodeEvent.RESET) in TRANSITIONS, f"{state} survives a reset"
            assert TRANSITIONS[(state, NodeEvent.SPLIT)] is state, "a split keeps the state"


def _generated(render: str, name: str) -> str:
    """What ``specs/gen_transitions.py``'s ``render`` function returns, checked equal to ``specs/NAME``."""
    spec = importlib.util.spec_from_file_location("gen_transitions", SPECS / "gen_transitions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = getattr(module, render)()
    assert isinstance(rendered, str)
    committed = (SPECS / name).read_text(encoding="utf-8")
    assert committed == rendered, f"specs/{name} is stale: run python specs/gen_transitions.py"
    return rendered


def _check_table(
    rendered: str,
    states: list[S],
    events: list[E],
    table: Mapping[tuple[S, E], S],
) -> None:
    """The rendered table has one row per state and, in each cell, the table's state after (or —)."""
    rows = [
        line
        for line in rendered.splitlines()
        if line.startswith("| `") and line.count("|") == len(events) + 2
    ]
    assert len(rows) == len(states)
    for row, state in zip(rows, states, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] == f"`{state.value}`"
        for event, cell in zip(events, cells[1:], strict=True):
            after = table.get((state, event))
            assert cell == ("—" if after is None else f"`{after.value}`"), (state, event)


def test_generated_transitions_md_is_current() -> None:
    """``specs/transitions.md`` equals what ``specs/gen_transitions.py`` renders from the table."""
    rendered = _generated("render", "transitions.md")
    _check_table(rendered, list(NodeState), list(NodeEvent), TRANSITIONS)
    assert rendered.count(" --> ") == len(TRANSITIONS)  # one mermaid edge per legal pair


# --- the prefetch operation's stage (refcache.hicache.states.PREFETCH_TRANSITIONS) -----------------------------------

STAGE_PAIRS = list(itertools.product(PrefetchStage, PrefetchEvent))
STAGE_LEGAL = [pair for pair in STAGE_PAIRS if pair in PREFETCH_TRANSITIONS]
STAGE_ILLEGAL = [pair for pair in STAGE_PAIRS if pair not in PREFETCH_TRANSITIONS]


def _stage_id(pair: tuple[PrefetchStage, PrefetchEvent]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


def _prefetch_op(stage: PrefetchStage) -> PrefetchOperation:
    return PrefetchOperation(
        id=1, request_id=7, tokens=(1, 2), last_hash=None, host_indices=[], start_us=0, stage=stage
    )


def test_stage_pairs_partition_and_strings() -> None:
    assert len(STAGE_LEGAL) + len(STAGE_ILLEGAL) == len(PrefetchStage) * len(PrefetchEvent)
    assert set(PREFETCH_TRANSITIONS) <= set(STAGE_PAIRS)
    # Traces and snapshots written before the enum hold the strings: a stage still equals its string.
    assert list(PrefetchStage) == ["query", "io", "done"]
    assert PrefetchOperation(1, 7, (), None, [], 0).stage is PrefetchStage.QUERY


@pytest.mark.parametrize("pair", STAGE_LEGAL, ids=_stage_id)
def test_legal_stage_pair_moves_the_operation(pair: tuple[PrefetchStage, PrefetchEvent]) -> None:
    assert next_stage(*pair) is PREFETCH_TRANSITIONS[pair]
    op = _prefetch_op(pair[0])
    op.move(pair[1])
    assert op.stage is PREFETCH_TRANSITIONS[pair]


@pytest.mark.parametrize("pair", STAGE_ILLEGAL, ids=_stage_id)
def test_illegal_stage_pair_raises_and_leaves_the_stage(pair: tuple[PrefetchStage, PrefetchEvent]) -> None:
    stage, event = pair
    legal = sorted(e.value for (s, e) in PREFETCH_TRANSITIONS if s is stage)
    with pytest.raises(
        TransitionError, match=f"no transition from '{stage.value}' on '{event.value}'"
    ) as info:
        next_stage(stage, event)
    assert str(legal) in str(info.value)  # the message lists what would be legal
    op = _prefetch_op(stage)
    with pytest.raises(TransitionError):
        op.move(event)
    assert op.stage is stage


def test_every_stage_is_reachable_and_done_is_final() -> None:
    assert set(PREFETCH_TRANSITIONS.values()) | {PrefetchStage.QUERY} == set(PrefetchStage)
    assert not any(s is PrefetchStage.DONE for (s, _e) in PREFETCH_TRANSITIONS)


def test_generated_prefetch_stages_md_is_current() -> None:
    """``specs/prefetch-stages.md`` equals what ``specs/gen_transitions.py`` renders from the table."""
    rendered = _generated("render_prefetch", "prefetch-stages.md")
    _check_table(rendered, list(PrefetchStage), list(PrefetchEvent), PREFETCH_TRANSITIONS)
    edges = [line for line in rendered.splitlines() if " --> " in line and "[*]" not in line]
    assert len(edges) == len(PREFETCH_TRANSITIONS)  # one mermaid edge per legal pair
