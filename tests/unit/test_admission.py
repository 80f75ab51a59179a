"""The SGLang recorder's admission stages (``refcache.engines.admission``): every (stage, event) pair, the
table's shape, the generated ``specs/recorder-stages.md``, and that none of it needs SGLang."""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from refcache.engines.admission import ENDS, TRANSITIONS, AdmissionEvent, AdmissionStage, next_stage
from refcache.errors import RecordingError

PAIRS = list(itertools.product(AdmissionStage, AdmissionEvent))
LEGAL = [pair for pair in PAIRS if pair in TRANSITIONS]
ILLEGAL = [pair for pair in PAIRS if pair not in TRANSITIONS]
ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
S, E = AdmissionStage, AdmissionEvent


def _id(pair: tuple[AdmissionStage, AdmissionEvent]) -> str:
    return f"{pair[0].value}-{pair[1].value}"


def test_pairs_partition() -> None:
    assert len(LEGAL) + len(ILLEGAL) == len(AdmissionStage) * len(AdmissionEvent)
    assert set(TRANSITIONS) <= set(PAIRS)
    assert LEGAL, "the table is empty"


@pytest.mark.parametrize("pair", LEGAL, ids=_id)
def test_legal_pair_gives_the_tables_stage(pair: tuple[AdmissionStage, AdmissionEvent]) -> None:
    assert next_stage(*pair) is TRANSITIONS[pair]


@pytest.mark.parametrize("pair", ILLEGAL, ids=_id)
def test_illegal_pair_raises_naming_the_call_and_the_legal_events(
    pair: tuple[AdmissionStage, AdmissionEvent],
) -> None:
    stage, event = pair
    with pytest.raises(
        RecordingError, match=f"^dec_lock_ref here: no admission step from '{stage.value}' on '{event.value}'"
    ) as info:
        next_stage(stage, event, "dec_lock_ref here")
    legal = [e.value for e in AdmissionEvent if (stage, e) in TRANSITIONS]
    assert legal and str(legal) in str(info.value)  # every stage has a way on, and the message lists it


def test_an_admission_opens_only_from_none_and_every_stage_is_reachable() -> None:
    assert [pair for pair in LEGAL if pair[1] is E.MATCH] == [(S.NONE, E.MATCH)]
    reached, frontier = {S.NONE}, [S.NONE]
    while frontier:
        stage = frontier.pop()
        for (before, _), after in TRANSITIONS.items():
            if before is stage and after not in reached:
                reached.add(after)
                frontier.append(after)
    assert reached == set(AdmissionStage)


def test_ends_are_the_stages_an_operation_is_written_from() -> None:
    """An admission ends (END) exactly where it is a whole operation: a match alone, or a locked node (admitted
    or refused); half done (a temporary lock, a load back without its lock) it cannot be written."""
    ending = {
        stage for (stage, event), after in TRANSITIONS.items() if event is E.END and stage is not S.NONE
    }
    assert ending == set(ENDS) == {S.MATCHED, S.LOCKED, S.REFUSED}
    assert all(TRANSITIONS[(stage, E.END)] is S.NONE for stage in ending)
    for stage in AdmissionStage:  # READY never raises; it ends exactly the stages with a locked node
        after = next_stage(stage, E.READY)
        assert after is (S.NONE if stage in (S.LOCKED, S.REFUSED) else stage)
    assert TRANSITIONS[(S.MATCHED, E.PREFETCH)] is S.NONE  # the match was the prefetch's


def test_the_scheduler_sequences_reach_their_operation() -> None:
    """The sequences of record.py's table, through the table: each ends where it is written as its operation."""
    sequences = {
        (E.MATCH, E.END): S.MATCHED,  # MatchPrefix
        (E.MATCH, E.LOCK, E.EVICT, E.EVICT, E.READY): S.LOCKED,  # StartRequest, device hit only
        (E.MATCH, E.TEMP_LOCK, E.LOAD_BACK, E.UNLOCK, E.LOCK, E.EVICT, E.READY): S.LOCKED,  # with a load back
        (E.MATCH, E.LOAD_BACK, E.LOCK, E.REFUSE, E.END): S.REFUSED,  # not admitted
        (E.MATCH, E.PREFETCH): S.MATCHED,  # PrefetchFromStorage
    }
    for events, last in sequences.items():
        stage, seen = S.NONE, []
        for event in events:
            seen.append(stage)
            stage = next_stage(stage, event)
        assert stage is S.NONE and seen[-1] is last, (events, seen)


def test_generated_recorder_stages_md_is_current() -> None:
    """``specs/recorder-stages.md`` equals what ``specs/gen_recorder_stages.py`` renders from the table."""
    spec = importlib.util.spec_from_file_location("gen_recorder_stages", SPECS / "gen_recorder_stages.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert isinstance(rendered, str)
    committed = (SPECS / "recorder-stages.md").read_text(encoding="utf-8")
    assert committed == rendered, "specs/recorder-stages.md is stale: run python specs/gen_recorder_stages.py"
    rows = [
        line
        for line in rendered.splitlines()
        if line.startswith("| `") and line.count("|") == len(AdmissionEvent) + 2
    ]
    assert len(rows) == len(AdmissionStage)
    for row, stage in zip(rows, AdmissionStage, strict=True):
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[0] == f"`{stage.value}`"
        for event, cell in zip(AdmissionEvent, cells[1:], strict=True):
            after = TRANSITIONS.get((stage, event))
            assert cell == ("—" if after is None else f"`{after.value}`"), (stage, event)
    assert rendered.count(" --> ") == len(TRANSITIONS)  # one mermaid edge per legal pair


def test_the_stages_import_no_engine() -> None:
    """The table is tested and generated without SGLang (or torch)."""
    code = (
        "import sys, refcache.engines.admission\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch', 'numpy', 'vllm'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
