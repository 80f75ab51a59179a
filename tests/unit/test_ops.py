"""The operation alphabet: JSON codec, ``repr`` as Python, malformed input, and traces of operations."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refcache.hicache.ops
from refcache.config import HiCacheConfig
from refcache.errors import TraceFormatError, UsageError
from refcache.hicache.ops import (
    OPS,
    CompleteIO,
    FaultKind,
    IOQueue,
    Op,
    StartRequest,
    StorageFault,
    op_from_json,
    op_to_json,
)
from refcache.hicache.trace import dumps_trace, loads_trace

# Everything ``repr`` may mention: the operation classes and the enums.
NAMESPACE = {name: getattr(refcache.hicache.ops, name) for name in refcache.hicache.ops.__all__}

ops_strategy: st.SearchStrategy[Op] = st.one_of([st.from_type(cls) for cls in OPS])


def test_ops_is_the_whole_alphabet() -> None:
    assert len(OPS) == len(set(OPS)) == 15
    for cls in OPS:
        assert dataclasses.is_dataclass(cls)
        assert cls.__name__ in refcache.hicache.ops.__all__


@pytest.mark.parametrize("cls", OPS, ids=lambda c: c.__name__)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_every_op_class_round_trips(cls: type[Op], data: st.DataObject) -> None:
    op = data.draw(st.from_type(cls))
    encoded = op_to_json(op)
    assert encoded["op"] == cls.__name__
    assert op_from_json(encoded) == op
    # Through real JSON text too (tuples become lists, enums their values).
    assert op_from_json(json.loads(json.dumps(encoded))) == op
    assert eval(repr(op), NAMESPACE) == op
    name = next((f.name for f in dataclasses.fields(op)), "anything")
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(op, name, None)


@settings(deadline=None)
@given(ops=st.lists(ops_strategy, max_size=20))
def test_trace_round_trip(ops: list[Op]) -> None:
    config = HiCacheConfig(page_size=4, tp_size=2, hicache_storage_backend="file")
    text = dumps_trace(config, ops)
    assert text.count("\n") == len(ops) + 1
    assert loads_trace(text) == (config, ops)


def test_enum_repr_is_python() -> None:
    assert repr(IOQueue.PREFETCH_IO) == "IOQueue.PREFETCH_IO"
    assert repr(CompleteIO(IOQueue.LOAD, 1, 2)) == "CompleteIO(queue=IOQueue.LOAD, rank=1, count=2)"
    assert repr(StorageFault(FaultKind.CORRUPT)) == "StorageFault(kind=FaultKind.CORRUPT, rank=0, index=0)"


def test_to_json_shape() -> None:
    assert op_to_json(StartRequest(3, (1, 2), "lora")) == {
        "op": "StartRequest",
        "rid": 3,
        "tokens": [1, 2],
        "extra_key": "lora",
    }
    assert op_to_json(CompleteIO(IOQueue.BACKUP)) == {
        "op": "CompleteIO",
        "queue": "backup",
        "rank": 0,
        "count": 1,
    }


def test_defaults_may_be_omitted() -> None:
    assert op_from_json({"op": "CompleteIO", "queue": "load"}) == CompleteIO(IOQueue.LOAD, 0, 1)
    assert op_from_json({"op": "MatchPrefix", "tokens": [5]}) == refcache.hicache.ops.MatchPrefix((5,))
    # D-41's rank: absent in older traces (every rank's clock), and left out when null, so they keep their form
    assert op_from_json({"op": "AdvanceClock", "us": 5}) == refcache.hicache.ops.AdvanceClock(5, rank=None)
    assert op_to_json(refcache.hicache.ops.AdvanceClock(5)) == {"op": "AdvanceClock", "us": 5}
    assert op_to_json(refcache.hicache.ops.AdvanceClock(5, rank=1)) == {
        "op": "AdvanceClock",
        "us": 5,
        "rank": 1,
    }


MALFORMED: list[tuple[dict[str, object], str]] = [
    ({}, "unknown operation None"),
    ({"op": "Frobnicate"}, "unknown operation 'Frobnicate'"),
    ({"op": 7}, "unknown operation 7"),
    ({"op": "startrequest", "rid": 1, "tokens": []}, "unknown operation"),
    ({"op": "FinishRequest"}, "missing field 'rid'"),
    ({"op": "FinishRequest", "rid": 1, "tokens": [1]}, r"has no fields \['tokens'\]"),
    ({"op": "FinishRequest", "rid": "1"}, "FinishRequest.rid must be an integer"),
    ({"op": "FinishRequest", "rid": True}, "FinishRequest.rid must be an integer"),
    ({"op": "FinishRequest", "rid": 1.0}, "FinishRequest.rid must be an integer"),
    ({"op": "FinishRequest", "rid": None}, "FinishRequest.rid must be an integer"),
    ({"op": "StartRequest", "rid": 1, "tokens": "abc"}, "StartRequest.tokens must be a list of integers"),
    (
        {"op": "StartRequest", "rid": 1, "tokens": [1, False]},
        "StartRequest.tokens must be a list of integers",
    ),
    ({"op": "StartRequest", "rid": 1, "tokens": [1, 2.5]}, "StartRequest.tokens must be a list of integers"),
    ({"op": "StartRequest", "rid": 1, "tokens": {"0": 1}}, "StartRequest.tokens must be a list of integers"),
    ({"op": "StartRequest", "rid": 1, "tokens": [1], "extra_key": 5}, "extra_key must be a string or null"),
    ({"op": "CompleteIO", "queue": "WRITE"}, r"CompleteIO.queue='WRITE' is not one of \['write'"),
    ({"op": "CompleteIO", "queue": None}, "CompleteIO.queue=None is not one of"),
    ({"op": "StorageFault", "kind": "explode"}, "StorageFault.kind='explode' is not one of"),
    ({"op": "Reset", "force": True}, r"Reset has no fields \['force'\]"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED, ids=[m for _, m in MALFORMED])
def test_malformed_json_raises_trace_format_error(data: dict[str, object], message: str) -> None:
    with pytest.raises(TraceFormatError, match=message):
        op_from_json(data)


@settings(deadline=None)
@given(
    data=st.dictionaries(
        st.sampled_from(
            ["op", "rid", "tokens", "extra_key", "queue", "rank", "count", "us", "kind", "index", "x"]
        ),
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(-5, 5),
            st.floats(allow_nan=False),
            st.text(max_size=5),
            st.sampled_from(
                [op.__name__ for op in OPS] + [q.value for q in IOQueue] + [k.value for k in FaultKind]
            ),
            st.lists(st.one_of(st.integers(0, 9), st.booleans(), st.text(max_size=2)), max_size=3),
        ),
    )
)
def test_arbitrary_json_either_decodes_or_raises_trace_format_error(data: dict[str, object]) -> None:
    try:
        op = op_from_json(data)
    except TraceFormatError:
        return
    assert op_from_json(op_to_json(op)) == op


@pytest.mark.parametrize(
    ("tokens", "bad"),
    [
        ((0, 7, 2**32 - 1), []),
        ((5, -1, 6), [-1]),
        ((2**32, 1, 2**40), [2**32, 2**40]),
        ((-(2**70),), [-(2**70)]),
    ],
)
@pytest.mark.parametrize(
    "kind", [refcache.hicache.ops.StartRequest, refcache.hicache.ops.PrefetchFromStorage]
)
def test_token_ids_must_fit_in_uint32(
    kind: type[refcache.hicache.ops.StartRequest | refcache.hicache.ops.PrefetchFromStorage],
    tokens: tuple[int, ...],
    bad: list[int],
) -> None:
    def check() -> None:
        refcache.hicache.ops.check_op(kind(1, tokens), tp_size=1, is_eagle=False, running=(), prefetching=())

    if not bad:
        check()
        return
    with pytest.raises(UsageError, match=re.escape(f"token ids must fit in uint32; got {bad}")):
        check()
