"""The node state machine: every (state, event) pair, the model's use of it, and the generated table."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import pytest

from refcache.config import HiCacheConfig
from refcache.errors import RefcacheError, TransitionError, UsageError
from refcache.hicache.states import TRANSITIONS, NodeEvent, NodeState, next_state
from refcache.model._controller import L3Store
from refcache.model._rank import RankCache, TreeNode

PAIRS = list(itertools.product(NodeState, NodeEvent))
LEGAL = [pair for pair in PAIRS if pair in TRANSITIONS]
ILLEGAL = [pair for pair in PAIRS if pair not in TRANSITIONS]
SPECS = Path(__file__).resolve().parents[2] / "specs"


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


def test_generated_transitions_md_is_current() -> None:
    """``specs/transitions.md`` equals what ``specs/gen_transitions.py`` renders from the table."""
    spec = importlib.util.spec_from_file_location("gen_transitions", SPECS / "gen_transitions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert isinstance(rendered, str)
    committed = (SPECS / "transitions.md").read_text(encoding="utf-8")
    assert committed == rendered, "specs/transitions.md is stale: run python specs/gen_transitions.py"
    rows = [
        line
        for line in rendered.splitlines()
        if line.startswith("| `") and line.count("|") == len(NodeEvent) + 2
    ]
    assert len(rows) == len(NodeState)
    for row, state in zip(rows, NodeState, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] == f"`{state.value}`"
        for event, cell in zip(NodeEvent, cells[1:], strict=True):
            after = TRANSITIONS.get((state, event))
            assert cell == ("—" if after is None else f"`{after.value}`"), (state, event)
    assert rendered.count(" --> ") == len(TRANSITIONS)  # one mermaid edge per legal pair
