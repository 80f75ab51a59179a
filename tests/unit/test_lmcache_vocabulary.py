"""The LMCache family's vocabulary: its configuration derived from a ``HiCacheConfig``, its chunk keys, the
operations' preconditions and the trace codec (a round trip, and every malformed line named)."""

from __future__ import annotations

import json

import pytest

from refcache.config import EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.errors import ConfigError, TraceFormatError, UsageError
from refcache.family import NodeId
from refcache.lmcache.config import CachePolicy, LMCacheConfig
from refcache.lmcache.family import FAMILY as LMCACHE
from refcache.lmcache.family import TRACES
from refcache.lmcache.ops import (
    Clear,
    FaultKind,
    LMCacheOp,
    Lookup,
    LookupUnpin,
    PollPrefetch,
    Prefetch,
    Queue,
    Retrieve,
    Step,
    StorageFault,
    Store,
    Tier,
    check_op,
    chunk_keys,
)

# 4 tokens of 2 layers x 2 heads x 8 dims x 2 bytes x (K, V) = 512 bytes: a chunk aligns to 4096.
BASE = HiCacheConfig(page_size=4, device_size=16, hicache_storage_backend="file", hicache_ratio=2.0)


def test_config_is_derived_field_by_field() -> None:
    c = LMCacheConfig.of(BASE)
    assert (c.chunk_size, c.bytes_per_token, c.chunk_bytes) == (4, 128, 512)
    assert (c.cpu_bytes, c.disk_bytes, c.remote) == (4 * 4096, 8 * 4096, False)
    assert (c.cache_policy, c.save_unfull_chunk, c.async_loading) == (CachePolicy.LRU, False, False)
    assert int(c.max_local_cpu_size * 1024**3) == c.cpu_bytes  # LMCache's GiB round-trips exactly
    remote_only = LMCacheConfig.of(HiCacheConfig(page_size=4, device_size=16, hicache_storage_backend="memory",
                                                 hicache_ratio=0.0))  # fmt: skip
    assert (remote_only.disk, remote_only.remote) == (False, True)
    other = LMCacheConfig.of(
        HiCacheConfig(
            page_size=4,
            device_size=16,
            radix_eviction_policy=EvictionPolicy.MRU,
            hicache_write_policy=WritePolicy.WRITE_THROUGH,
            hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        )
    )
    assert (other.cache_policy, other.save_unfull_chunk, other.async_loading, other.disk) == (
        CachePolicy.MRU,
        True,
        True,
        False,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"radix_eviction_policy": EvictionPolicy.FILO}, "no LMCache cache policy"),
        ({"hicache_write_policy": WritePolicy.WRITE_BACK}, "write_back"),
        ({"hicache_storage_prefetch_policy": PrefetchPolicy.TIMEOUT}, "timeout"),
        ({"hicache_ratio": 0.0}, "hicache_ratio must be > 0"),
    ],
)
def test_config_refuses_values_without_an_lmcache_meaning(changes: dict[str, object], message: str) -> None:
    fields = {**BASE.to_json(), **changes}
    with pytest.raises(ConfigError, match=message):
        LMCacheConfig.of(HiCacheConfig(**fields))  # type: ignore[arg-type]


def test_config_refuses_a_budget_below_one_chunk() -> None:
    with pytest.raises(ConfigError, match="holds no chunk"):
        LMCacheConfig(chunk_size=4, bytes_per_token=2048, cpu_bytes=4096, disk_bytes=0, remote=False,
                      cache_policy=CachePolicy.LRU)  # fmt: skip


def test_chunk_keys_are_the_prefix_chain() -> None:
    tokens = (1, 2, 3, 4, 5, 6)
    assert chunk_keys(tokens, 4, False) == (NodeId("", (1, 2, 3, 4)),)
    assert chunk_keys(tokens, 4, True) == (NodeId("", (1, 2, 3, 4)), NodeId("", tokens))
    assert chunk_keys((1, 2), 4, False) == ()


def test_preconditions() -> None:
    c = LMCacheConfig.of(BASE)
    none: frozenset[int] = frozenset()
    ok = {Queue.DISK: 1}
    check_op(Store((1, 2, 3, 4), skip=4), c, none, none, ok)
    check_op(Step(Queue.DISK), c, none, none, ok)
    bad: list[tuple[LMCacheOp, str]] = [
        (Store(()), "at least one token"),
        (Store((1, 2, 3, 4), skip=2), "multiple of the chunk size"),
        (Retrieve((1, 2, 3, 4), skip=8), "within the tokens"),
        (Lookup((1,), pin=True), "needs a lookup_id"),
        (Prefetch((1,), 1), "needs async loading"),
        (PollPrefetch(1), "no prefetch"),
        (Step(Queue.REMOTE), "no job is waiting"),
        (Step(Queue.DISK, 0), "at least one job"),
        (StorageFault(Tier.REMOTE, FaultKind.DELETE), "no remote tier"),
        (Clear((-1,)), "uint32"),
    ]
    for op, message in bad:
        with pytest.raises(UsageError, match=message):
            check_op(op, c, none, none, ok)
    with pytest.raises(UsageError, match="already holds pins"):
        check_op(Lookup((1,), 7, pin=True), c, frozenset({7}), none, ok)


ALL_OPS: list[LMCacheOp] = [
    Store((1, 2, 3, 4, 5), skip=4),
    Lookup((1, 2), 3, True),
    Retrieve((1, 2, 3, 4), 0, None),
    LookupUnpin(3),
    Prefetch((9,), 4, pin=True),
    PollPrefetch(4),
    Clear(),
    Clear((1, 2)),
    Step(Queue.DISK, 2),
    Step(Queue.REMOTE),
    StorageFault(Tier.DISK, FaultKind.FAIL_NEXT_WRITE, 1),
]


def test_trace_round_trip() -> None:
    text = TRACES.dumps(BASE, ALL_OPS)
    assert LMCACHE.is_trace(text)
    config, ops = TRACES.loads(text)
    assert config == BASE and ops == ALL_OPS
    assert [eval(repr(op)) for op in ops] == ALL_OPS  # a repr is valid Python that replays


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ({"op": "Evict"}, "unknown LMCache operation"),
        ({"op": "Store", "tokens": [1], "skip": 0, "extra": 1}, "no fields"),
        ({"op": "Store"}, "missing field 'tokens'"),
        ({"op": "Store", "tokens": "1"}, "list of integers"),
        ({"op": "Lookup", "tokens": [1], "pin": 1}, "true or false"),
        ({"op": "Step", "queue": "cpu"}, "one of 'disk', 'remote'"),
        ({"op": "LookupUnpin", "lookup_id": True}, "must be an integer"),
    ],
)
def test_trace_errors_name_the_line(line: dict[str, object], message: str) -> None:
    text = TRACES.dumps(BASE, [Store((1,))]) + json.dumps(line) + "\n"
    with pytest.raises(TraceFormatError, match=f"t:3: .*{message}"):
        TRACES.loads(text, "t")


def test_trace_header_must_name_the_family() -> None:
    text = TRACES.dumps(BASE, []).replace('"family": "lmcache"', '"family": "vllm"')
    assert not LMCACHE.is_trace(text)
    with pytest.raises(TraceFormatError, match="t:1: not an LMCache trace"):
        TRACES.loads(text, "t")
