"""The adapter's fake load stream (``refcache.engines.sglang._gate``): ``CompleteIO(LOAD, 0, k)`` finishes the
next ``k`` copies in stream order, also where an older ack shares its event with a later copy (SGLang up to
0.5.15: a load's ack holds its ``LayerDoneCounter`` slot's event, which the load three later records again;
finding R-4, specs/sglang-findings-releases.md). Pure Python: no SGLang needed."""

from __future__ import annotations

from dataclasses import dataclass

from refcache.engines.sglang import _gate


@dataclass
class Ack:
    finish_event: _gate.FakeEvent


def _load(stream: _gate.FakeStream, event: _gate.FakeEvent, log: list[int], number: int) -> Ack:
    """One copy on ``stream`` (it appends ``number`` to ``log`` when it runs), then ``event`` recorded."""
    with _gate.FAKE_DEVICE_MODULE.stream(stream):
        _gate.enqueue(lambda: log.append(number))
        event.record()
    return Ack(event)


def test_each_completion_finishes_the_next_copy_with_one_event_per_ack() -> None:
    stream, log = _gate.FakeStream(), list[int]()
    acks = [_load(stream, _gate.FakeEvent(), log, n) for n in range(3)]
    assert _gate.pending(acks) == 3
    assert _gate.complete(acks, 2) == 2
    assert log == [0, 1] and [a.finish_event.query() for a in acks] == [True, True, False]
    assert _gate.complete(acks, 5) == 1 and log == [0, 1, 2]


def test_a_completion_finishes_one_copy_when_a_later_one_recorded_the_oldest_acks_event_again() -> None:
    stream, log = _gate.FakeStream(), list[int]()
    slots = [_gate.FakeEvent() for _ in range(3)]  # LayerDoneCounter's three events
    acks = [_load(stream, slots[n], log, n) for n in range(3)]
    assert _gate.complete(acks, 1) == 1 and log == [0]
    # the fourth load reuses slot 0: its ack holds the first's event
    acks.append(_load(stream, slots[0], log, 3))
    assert [a.finish_event.query() for a in acks] == [False, False, False, False]
    assert _gate.complete(acks, 1) == 1
    assert log == [0, 1]  # the second copy only, not the stream through the fourth
    assert [a.finish_event.query() for a in acks] == [False, True, False, False]
    assert _gate.complete(acks, 1) == 1 and log == [0, 1, 2]
    assert _gate.complete(acks, 1) == 1 and log == [0, 1, 2, 3]
    assert [a.finish_event.query() for a in acks] == [True, True, True, True]
    assert _gate.complete(acks, 1) == 0
