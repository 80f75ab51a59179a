"""The trace codec (``refcache.hicache.trace``) and its JSON Schema (``specs/trace.schema.json``)."""

from __future__ import annotations

import dataclasses
import enum
import itertools
import json
import re
import typing
from functools import cache
from pathlib import Path
from typing import cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import refcache
from refcache.check.harness import Divergence
from refcache.check.recorded import replay_recorded
from refcache.config import HiCacheConfig, WritePolicy
from refcache.errors import TraceFormatError
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import (
    OPS,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    Reset,
    StartRequest,
    StorageFault,
    op_to_json,
)
from refcache.hicache.recording import (
    NeverReturned,
    Observed,
    Recording,
    dumps_recording,
    read_recording,
    write_recording,
)
from refcache.hicache.snapshot import NodeRecord, Snapshot, SnapshotInterner
from refcache.hicache.trace import FORMAT, VERSION, dumps_trace, header, loads_trace, read_trace, write_trace
from refcache.model import HiCacheModel

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "specs" / "trace.schema.json"
SCHEMA = cast(dict[str, object], json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))
DEFS = cast(dict[str, dict[str, object]], SCHEMA["$defs"])

CONFIG = HiCacheConfig(
    tp_size=2,
    page_size=2,
    device_size=16,
    hicache_storage_backend="file",
    hicache_write_policy=WritePolicy.WRITE_THROUGH,
    prefetch_threshold=2,
)
PROGRAM: list[Op] = [
    StartRequest(1, (1, 2, 3, 4, 5), "lora-a"),
    CacheUnfinishedRequest(1),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0),
    CompleteIO(IOQueue.WRITE, 1, 4),
    CheckHicacheEvents(),
    CompleteIO(IOQueue.BACKUP, 1),
    CompleteIO(IOQueue.BACKUP, 0),
    CheckHicacheEvents(),
    Evict(100),
    EvictHost(100),
    PrefetchFromStorage(2, (1, 2, 3, 4, 5), "lora-a"),
    CompleteIO(IOQueue.PREFETCH_QUERY, 0),
    CompleteIO(IOQueue.PREFETCH_QUERY, 1),
    CompleteIO(IOQueue.PREFETCH_IO, 0),
    CompleteIO(IOQueue.PREFETCH_IO, 1),
    AdvanceClock(1_000),
    AdvanceClock(500, rank=1),
    CheckPrefetchProgress(2),
    MatchPrefix((1, 2, 3, 4), "lora-a"),
    StorageFault(FaultKind.CORRUPT, 1, 3),
    CheckHicacheEvents(),
    Reset(),
]

ops_strategy: st.SearchStrategy[Op] = st.one_of([st.from_type(cls) for cls in OPS])


def _replay(config: HiCacheConfig, ops: list[Op]) -> HiCacheModel:
    model = HiCacheModel(config)
    for op in ops:
        model.apply(op)
        assert check_all(model.snapshot()) == []
    return model


# --- round trips -------------------------------------------------------------------------------------------


def test_file_round_trip_replays_to_the_same_state(tmp_path: Path) -> None:
    path = tmp_path / "program.jsonl"
    write_trace(path, CONFIG, PROGRAM)
    config, ops = read_trace(path)
    assert (config, ops) == (CONFIG, PROGRAM)
    assert _replay(config, ops).snapshot() == _replay(CONFIG, PROGRAM).snapshot()
    assert read_trace(str(path)) == (CONFIG, PROGRAM)


def test_header_line() -> None:
    first = json.loads(dumps_trace(CONFIG, []).splitlines()[0])
    assert first == {
        "format": "refcache-trace",
        "version": 1,
        "package_version": refcache.__version__,
        "config": CONFIG.to_json(),
    }
    assert first == header(CONFIG)
    assert (FORMAT, VERSION) == ("refcache-trace", 1)


def test_text_layout() -> None:
    text = dumps_trace(CONFIG, PROGRAM)
    lines = text.split("\n")
    assert lines[-1] == "" and len(lines) == len(PROGRAM) + 2  # newline-terminated, no blank lines
    assert [json.loads(line) for line in lines[1:-1]] == [op_to_json(op) for op in PROGRAM]


def test_last_newline_and_crlf_are_optional() -> None:
    text = dumps_trace(CONFIG, PROGRAM)
    assert loads_trace(text.rstrip("\n")) == (CONFIG, PROGRAM)
    assert loads_trace(text.replace("\n", "\r\n")) == (CONFIG, PROGRAM)


def test_partial_config_takes_defaults() -> None:
    text = json.dumps(
        {"format": FORMAT, "version": 1, "package_version": "0.0.0", "config": {"page_size": 4}}
    )
    assert loads_trace(text) == (HiCacheConfig(page_size=4), [])


def test_config_is_stored_unresolved() -> None:
    config = HiCacheConfig(hicache_mem_layout="page_first_direct")  # type: ignore[arg-type]
    assert loads_trace(dumps_trace(config, []))[0] == config


@settings(max_examples=50, deadline=None)
@given(ops=st.lists(ops_strategy, max_size=15), namespace=st.text(max_size=4))
def test_any_ops_round_trip(ops: list[Op], namespace: str) -> None:
    config = HiCacheConfig(model_name=namespace or "m")
    assert loads_trace(dumps_trace(config, ops)) == (config, ops)


# --- errors --------------------------------------------------------------------------------------------------

GOOD_HEADER = json.dumps(header(CONFIG))
GOOD_OP = json.dumps(op_to_json(FinishRequest(1)))


def _with_header(**changes: object) -> str:
    data = header(CONFIG) | changes
    return json.dumps({k: v for k, v in data.items() if v is not _DROP})


def _with_config(**changes: object) -> str:
    config = CONFIG.to_json() | changes
    return json.dumps(header(CONFIG) | {"config": config})


_DROP = object()

BAD_TRACES: list[tuple[str, str]] = [
    ("", "trace: empty; line 1 must be the trace header"),
    ("\n", "trace:1: empty line"),
    (f"{GOOD_HEADER}\n\n{GOOD_OP}\n", "trace:2: empty line"),
    ("{not json}\n", r"trace:1: not valid JSON"),
    ("[1, 2]\n", "trace:1: expected a JSON object, got list"),
    (f"{GOOD_HEADER}\n{GOOD_OP}\n42\n", "trace:3: expected a JSON object, got int"),
    (
        f"{GOOD_HEADER}\n" + '{"op": "Evict", "num_tokens": 1, "num_tokens": 2}\n',
        "trace:2: .*duplicate key 'num_tokens'",
    ),
    (f"{GOOD_HEADER}\n" + '{"op": "AdvanceClock", "us": NaN}\n', "trace:2: .*NaN is not valid JSON"),
    (_with_header(format="other-trace"), "trace:1: not a refcache trace"),
    (_with_header(format=_DROP), "trace:1: not a refcache trace"),
    (_with_header(version=2), "trace:1: trace format version 2 is not supported; .* reads version 1 only"),
    (_with_header(version=0), "trace:1: trace format version 0 is not supported"),
    (_with_header(version="1"), "trace:1: header version must be an integer"),
    (_with_header(version=True), "trace:1: header version must be an integer"),
    (_with_header(package_version=_DROP), r"trace:1: header is missing keys \['package_version'\]"),
    (_with_header(config=_DROP), r"trace:1: header is missing keys \['config'\]"),
    (_with_header(comment="hi"), r"trace:1: header .* unknown keys \['comment'\]"),
    (_with_header(package_version=1), "trace:1: package_version must be a string"),
    (_with_header(config=[]), "trace:1: config must be a JSON object"),
    (_with_config(page_sise=4), "trace:1: bad config: unknown configuration keys"),
    (_with_config(page_size="4"), "trace:1: config.page_size has the wrong type"),
    (_with_config(page_size=1.5), "trace:1: config.page_size has the wrong type"),
    (_with_config(page_size=True), "trace:1: config.page_size has the wrong type"),
    (_with_config(is_eagle="yes"), "trace:1: config.is_eagle has the wrong type"),
    (_with_config(hicache_ratio="2"), "trace:1: config.hicache_ratio has the wrong type"),
    (_with_config(model_name=None), "trace:1: config.model_name has the wrong type"),
    (_with_config(hicache_write_policy="write_sometimes"), "trace:1: bad config: hicache_write_policy="),
    (_with_config(hicache_write_policy=1), "trace:1: config.hicache_write_policy has the wrong type"),
    (_with_config(page_size=0), "trace:1: bad config: page_size=0 must be a positive integer"),
    (_with_config(hicache_storage_backend="mooncake"), "trace:1: bad config: .*out of scope"),
    (f"{GOOD_HEADER}\n{GOOD_OP}\n" + '{"op": "Explode"}\n', "trace:3: unknown operation 'Explode'"),
    (f"{GOOD_HEADER}\n" + '{"rid": 1}\n', "trace:2: unknown operation None"),
    (
        f"{GOOD_HEADER}\n" + '{"op": "FinishRequest", "rid": "x"}\n',
        "trace:2: FinishRequest.rid must be an integer",
    ),
    (
        f"{GOOD_HEADER}\n" + '{"op": "CompleteIO", "queue": "disk"}\n',
        "trace:2: CompleteIO.queue='disk' is not one of",
    ),
    (f"{GOOD_HEADER}\n" + '{"op": "Reset", "hard": true}\n', r"trace:2: Reset has no fields \['hard'\]"),
    (
        f"{GOOD_HEADER}\n" + '{"op": "StartRequest", "rid": 1}\n',
        "trace:2: StartRequest is missing field 'tokens'",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_TRACES, ids=[m for _, m in BAD_TRACES])
def test_bad_trace_raises_trace_format_error_naming_the_line(text: str, message: str) -> None:
    with pytest.raises(TraceFormatError, match=f"^{message}"):
        loads_trace(text)


def test_read_trace_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD_HEADER}\n{GOOD_OP}\n" + '{"op": "Nope"}\n', encoding="utf-8")
    with pytest.raises(TraceFormatError, match=f"^{re.escape(str(path))}:3: unknown operation 'Nope'"):
        read_trace(path)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD_HEADER.encode() + b"\n\xff\xfe\n")
    with pytest.raises(TraceFormatError, match="not UTF-8"):
        read_trace(path)


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"absent\.jsonl"):
        read_trace(tmp_path / "absent.jsonl")


def test_unrepresentable_config_is_refused_on_write() -> None:
    config = HiCacheConfig()
    object.__setattr__(config, "prefetch_timeout_base", float("inf"))  # HiCacheConfig itself refuses inf
    with pytest.raises(TraceFormatError, match="cannot write"):
        dumps_trace(config, [])


def test_trace_format_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="empty"):
        loads_trace("")


# --- the JSON Schema -----------------------------------------------------------------------------------------


def _json_type(hint: object) -> object:
    if hint is bool:
        return "boolean"
    if hint is int:
        return "integer"
    if hint is float:
        return "number"
    if hint is str:
        return "string"
    if hint == str | None:
        return ["string", "null"]
    if hint == int | None:
        return ["integer", "null"]
    if hint == tuple[int, ...]:
        return "array"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "string"
    raise AssertionError(f"no JSON type for {hint!r}")  # a new field type: extend the schema and this test


def _check_property(
    prop: dict[str, object], hint: object, field: dataclasses.Field[object], where: str
) -> None:
    assert prop.get("type") == _json_type(hint), where
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        assert prop.get("enum") == [m.value for m in hint], where
    if hint == tuple[int, ...]:
        assert prop.get("items") == {"type": "integer"}, where
    if field.default is dataclasses.MISSING:
        assert "default" not in prop, where
    else:
        default = field.default.value if isinstance(field.default, enum.Enum) else field.default
        assert prop.get("default") == default, where


def test_schema_lists_exactly_the_op_classes_and_their_fields() -> None:
    """The schema and ``refcache.hicache.ops`` cannot drift: one branch per class, with its fields and types."""
    op_def = DEFS["op"]
    assert op_def["oneOf"] == [{"$ref": f"#/$defs/{cls.__name__}"} for cls in OPS]
    for cls in OPS:
        branch = DEFS[cls.__name__]
        props = cast(dict[str, dict[str, object]], branch["properties"])
        fields = dataclasses.fields(cls)
        assert branch["type"] == "object" and branch["additionalProperties"] is False
        assert props["op"] == {"const": cls.__name__}
        assert list(props) == ["op", *(f.name for f in fields), *RECORDED], cls.__name__
        assert all(props[key] == {"$ref": f"#/$defs/{key}"} for key in RECORDED), cls.__name__
        required = ["op", *(f.name for f in fields if f.default is dataclasses.MISSING)]
        assert branch["required"] == required, cls.__name__
        hints = typing.get_type_hints(cls)
        for f in fields:
            _check_property(
                props[f.name], hints[f.name], cast(dataclasses.Field[object], f), f"{cls.__name__}.{f.name}"
            )
    named = {name for name in DEFS if name not in ("header", "config", "op", *RECORDED)}
    assert named == {cls.__name__ for cls in OPS}


def test_schema_header_matches_the_codec_and_config() -> None:
    head = DEFS["header"]
    head_props = cast(dict[str, object], head["properties"])
    assert (
        set(head_props) - {"source", "seed", "release"}
        == set(header(CONFIG))
        == set(cast(list[str], head["required"]))
    )
    assert set(head_props) == set(
        header(
            CONFIG,
            {"engine": "sglang", "version": "0.5.20"},
            seed=1,
            release={"engine": "sglang", "version": "0.5.16"},
        )
    )  # optional
    assert head_props["format"] == {"const": FORMAT} and head_props["version"] == {"const": VERSION}
    config = DEFS["config"]
    assert config["additionalProperties"] is False
    props = cast(dict[str, dict[str, object]], config["properties"])
    hints = typing.get_type_hints(HiCacheConfig)
    fields = dataclasses.fields(HiCacheConfig)
    assert list(props) == [f.name for f in fields]
    for f in fields:
        _check_property(props[f.name], hints[f.name], cast(dataclasses.Field[object], f), f"config.{f.name}")
    assert SCHEMA["oneOf"] == [{"$ref": "#/$defs/header"}, {"$ref": "#/$defs/op"}]


@cache
def _validators() -> tuple[object, object, object]:
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    line = jsonschema.Draft202012Validator(SCHEMA)
    head = jsonschema.Draft202012Validator({"$ref": "#/$defs/header", "$defs": SCHEMA["$defs"]})
    op = jsonschema.Draft202012Validator({"$ref": "#/$defs/op", "$defs": SCHEMA["$defs"]})
    return line, head, op


def _valid(validator: object, instance: object) -> bool:
    result = validator.is_valid(instance)  # type: ignore[attr-defined]
    assert isinstance(result, bool)
    return result


RECORDED = ("observed", "snapshot")
"""The optional keys of an operation line of a recorded trace (``refcache.hicache.recording``)."""


def test_recorded_lines_validate_against_the_schema() -> None:
    """``observed`` and ``snapshot`` of a recorded trace's lines (``refcache.hicache.recording``) are in the schema."""
    _, _, op = _validators()
    with HiCacheModel(CONFIG) as model:
        observed = [model.apply(o) for o in PROGRAM]
        snaps = [model.snapshot()] * len(PROGRAM)
    text = dumps_recording(CONFIG, PROGRAM, observed, snaps, {"engine": "sglang", "version": "0.5.20"})
    lines = [json.loads(line) for line in text.splitlines()[1:]]
    assert all("observed" in line and "snapshot" in line for line in lines)
    for data in lines:
        assert _valid(op, data), data
        assert not _valid(op, {**data, "observed": {"num_evicted": 1}}), "an observation names its type"


def test_an_operation_the_engine_never_returned_from_is_recorded_and_diverges_there(tmp_path: Path) -> None:
    """``NeverReturned``: what a two-rank recording ends with when a rank waits in an all-reduce its peer
    never entered (``refcache.engines.sglang._tp``). It round-trips through the file and the schema,
    ``read_trace`` reads the operations alone, and the replay on the model diverges at exactly that line,
    naming the rank and the all-reduce; with the model's own observation there the recording replays
    clean (so the divergence is the hang's)."""
    config = HiCacheConfig(
        tp_size=2, page_size=1, device_size=8, hicache_write_policy=WritePolicy.WRITE_THROUGH
    )
    ops: list[Op] = [
        StartRequest(1, (1, 2, 3, 4)),
        FinishRequest(1),
        CompleteIO(IOQueue.WRITE, 0, 1),
        CheckHicacheEvents(),
    ]
    with HiCacheModel(config) as model:
        observed: list[Observed | None] = [model.apply(op) for op in ops]
    hang = NeverReturned(0, 1, "hiradix_cache.py:226 _all_reduce_attn_groups", 1, 0)
    path = tmp_path / "hung.jsonl"
    source = {"engine": "sglang", "version": "0.5.20"}
    write_recording(path, Recording(config, ops, [*observed[:-1], hang], [None] * len(ops), source))
    recording = read_recording(path)
    assert recording.observed[-1] == hang and read_trace(path)[1] == ops
    with pytest.raises(Divergence) as hung:
        replay_recorded(recording)
    assert (hung.value.step, hung.value.kind) == (4, "outcomes differ")
    assert (
        "(recorded): NeverReturned(rank=0, all_reduce=1, called_from='hiradix_cache.py:226"
        in hung.value.summary
    )
    assert replay_recorded(dataclasses.replace(recording, observed=observed)) == len(ops)
    _, _, op = _validators()
    last = json.loads(path.read_text().splitlines()[-1])
    assert _valid(op, last) and last["observed"]["type"] == "NeverReturned", last


@settings(max_examples=30, deadline=None)
@given(ops=st.lists(ops_strategy, max_size=10))
def test_generated_traces_validate_against_the_schema(ops: list[Op]) -> None:
    line, head, op = _validators()
    lines = [json.loads(text) for text in dumps_trace(CONFIG, [*PROGRAM, *ops]).splitlines()]
    assert _valid(head, lines[0]) and _valid(line, lines[0]) and not _valid(op, lines[0])
    for data in lines[1:]:
        assert _valid(op, data) and _valid(line, data) and not _valid(head, data), data


BAD_HEADERS: list[dict[str, object]] = [
    json.loads(_with_header(format="other-trace")),
    json.loads(_with_header(version=2)),
    json.loads(_with_header(version="1")),
    json.loads(_with_header(config=_DROP)),
    json.loads(_with_header(comment="hi")),
    json.loads(_with_header(package_version=1)),
    json.loads(_with_config(page_sise=4)),
    json.loads(_with_config(page_size="4")),
    json.loads(_with_config(page_size=1.5)),
    json.loads(_with_config(page_size=0)),
    json.loads(_with_config(is_eagle="yes")),
    json.loads(_with_config(model_name=None)),
    json.loads(_with_config(hicache_write_policy="write_sometimes")),
    json.loads(_with_config(hicache_storage_backend="mooncake")),
]
BAD_OPS: list[dict[str, object]] = [
    {"op": "Explode"},
    {"rid": 1},
    {"op": "FinishRequest", "rid": "x"},
    {"op": "FinishRequest", "rid": True},
    {"op": "StartRequest", "rid": 1},
    {"op": "StartRequest", "rid": 1, "tokens": [1, "2"]},
    {"op": "StartRequest", "rid": 1, "tokens": [1], "extra_key": 3},
    {"op": "CompleteIO", "queue": "disk"},
    {"op": "Reset", "hard": True},
]


@pytest.mark.parametrize("data", BAD_HEADERS, ids=str)
def test_schema_and_reader_reject_bad_headers(data: dict[str, object]) -> None:
    line, _, _ = _validators()
    assert not _valid(line, data)
    with pytest.raises(TraceFormatError, match=r"^trace:1: "):
        loads_trace(json.dumps(data))


@pytest.mark.parametrize("data", BAD_OPS, ids=str)
def test_schema_and_reader_reject_bad_ops(data: dict[str, object]) -> None:
    line, _, _ = _validators()
    assert not _valid(line, data)
    with pytest.raises(TraceFormatError, match=r"^trace:2: "):
        loads_trace(f"{GOOD_HEADER}\n{json.dumps(data)}\n")


def test_a_snapshot_writes_a_ranks_clock_skew_only_when_it_has_one(tmp_path: Path) -> None:
    """``RankSnapshot.clock_skew_us`` is ``omit_default`` (as ``AdvanceClock.rank`` in an operation): a
    lock-step recording's snapshots carry no such key (older versions, which do not know it, read them), a
    rank whose clock moved alone carries its skew, and both read back equal (a missing key is 0)."""
    config = HiCacheConfig(
        tp_size=2, page_size=1, device_size=8, hicache_write_policy=WritePolicy.WRITE_THROUGH
    )
    ops: list[Op] = [StartRequest(1, (1, 2, 3, 4)), AdvanceClock(100), AdvanceClock(300, rank=1)]
    with HiCacheModel(config) as model:
        observed: list[Observed | None] = []
        snapshots: list[Snapshot | None] = []
        for op in ops:
            observed.append(model.apply(op))
            snapshots.append(model.snapshot())
    path = tmp_path / "skew.jsonl"
    write_recording(
        path, Recording(config, ops, observed, snapshots, {"engine": "sglang", "version": "0.5.20"})
    )
    lines = [json.loads(text) for text in path.read_text().splitlines()[1:]]
    lock_step = [line["snapshot"]["ranks"] for line in lines[:2]]
    assert all("clock_skew_us" not in rank for ranks in lock_step for rank in ranks), lock_step
    skewed = lines[2]["snapshot"]["ranks"]
    assert "clock_skew_us" not in skewed[0] and skewed[1]["clock_skew_us"] == 300, skewed
    assert read_recording(path).snapshots == snapshots
    for line in lines:
        line["snapshot"]["ranks"][0]["clock_skew_us"] = 0  # as this version wrote them before: still read
    path.write_text(
        path.read_text().splitlines()[0] + "\n" + "".join(json.dumps(line) + "\n" for line in lines)
    )
    assert read_recording(path).snapshots == snapshots


def _program_snapshots() -> tuple[list[Observed | None], list[Snapshot | None]]:
    """PROGRAM on the model, its observation and snapshot after every operation."""
    observed: list[Observed | None] = []
    snapshots: list[Snapshot | None] = []
    with HiCacheModel(CONFIG) as model:
        for op in PROGRAM:
            observed.append(model.apply(op))
            snapshots.append(model.snapshot())
    return observed, snapshots


def test_a_recording_read_back_shares_what_its_snapshots_have_in_common(tmp_path: Path) -> None:
    """``read_recording`` passes the snapshots through one ``SnapshotInterner``: they read back equal to those
    written, and a node record, a pool record or a slot tuple unchanged from one snapshot to the next is the
    same object in both (a recording of a long trace held each snapshot's whole tree apart before: 1.09 GB for
    60 requests of the real trace, 0.41 GB shared). Without the interner no two snapshots share a record."""
    observed, snapshots = _program_snapshots()
    path = tmp_path / "shared.jsonl"
    write_recording(
        path, Recording(CONFIG, PROGRAM, observed, snapshots, {"engine": "sglang", "version": "0.5.20"})
    )
    read = read_recording(path).snapshots
    assert read == snapshots
    pairs = [(a, b) for a, b in itertools.pairwise(read) if a is not None and b is not None]
    same = [
        (x, y)
        for a, b in pairs
        for ra, rb in zip(a.ranks, b.ranks, strict=True)
        for x, y in [*zip(ra.nodes, rb.nodes, strict=False), (ra.host, rb.host), (ra.device, rb.device)]
        if x == y
    ]
    assert same and all(x is y for x, y in same), "equal records of successive snapshots are one object"
    by_rank = [n for s in read if s is not None for n in s.ranks[0].nodes]
    assert len({id(n) for n in by_rank}) == len(set(by_rank)), "one object per distinct node record"


def test_the_interner_shares_parts_of_a_changed_node_and_changes_nothing() -> None:
    """A node whose counters changed is a new record, but its name and slot tuples are the earlier ones'; the
    snapshot an interner returns equals the one it was given."""
    _, snapshots = _program_snapshots()
    shared = SnapshotInterner()
    out = [None if s is None else shared(s) for s in snapshots]
    assert out == snapshots
    records = [n for s in out if s is not None for r in s.ranks for n in r.nodes]
    by_name: dict[object, list[NodeRecord]] = {}
    for record in records:
        by_name.setdefault(record.id, []).append(record)
    changed = [(a, b) for rs in by_name.values() for a, b in itertools.pairwise(rs) if a != b]
    assert changed, "PROGRAM changes some node's record"
    for a, b in changed:
        assert a.id is b.id
        assert a.value != b.value or a.value is b.value
        assert a.host_value != b.host_value or a.host_value is b.host_value


@pytest.mark.parametrize(
    ("path", "bad", "message"),
    [
        (["ranks", 0, "nodes", 0, "value"], [0, "1"], "value"),
        (["ranks", 0, "host", "free"], [0, True], "free"),
        (["ranks", 0, "nodes", 0, "id", "path"], [1, 2.5], "path"),
    ],
)
def test_a_bad_item_in_a_long_tuple_is_still_refused(
    tmp_path: Path, path: list[str | int], bad: list[object], message: str
) -> None:
    """Tuples of plain items are read whole when every item is of the type they allow; one item of another
    type (a string slot, a boolean in a free list, a float token) still fails naming the field."""
    observed, snapshots = _program_snapshots()
    good = tmp_path / "good.jsonl"
    write_recording(
        good, Recording(CONFIG, PROGRAM, observed, snapshots, {"engine": "sglang", "version": "0.5.20"})
    )
    lines = good.read_text().splitlines()
    data = json.loads(lines[4])
    where: object = data["snapshot"]
    for key in path[:-1]:
        where = where[key]  # type: ignore[index]
    assert isinstance(where, dict) and path[-1] in where
    where[path[-1]] = bad
    lines[4] = json.dumps(data)
    broken = tmp_path / "broken.jsonl"
    broken.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=message):
        read_recording(broken)
