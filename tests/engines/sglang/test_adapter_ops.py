"""The SGLang adapter operation by operation, beside the model: small directed traces (hit, load back,
write-through acks, write-back eviction, evict_host, abort, reset) compared step by step by the harness,
the bytes each io backend / layout row moves, and what the adapter refuses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from refcache.check.harness import Divergence, Harness, Outcome
from refcache.config import PROFILES, AttentionKind, HiCacheConfig, IOBackend, MemLayout, WritePolicy
from refcache.engines.sglang import MAX_PENDING_LOADS, SGLangSystem, _shim, versions
from refcache.engines.sglang._tp import rank_system
from refcache.errors import UnsupportedError
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    AbortRequest,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CompleteIO,
    EventsResult,
    Evict,
    EvictHost,
    EvictHostResult,
    EvictResult,
    FinishRequest,
    FinishResult,
    IOQueue,
    IOResult,
    MatchPrefix,
    MatchResult,
    Op,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
)
from refcache.model import HiCacheModel
from refcache.systems import SYSTEMS

from .sglang_machines import SGLANG

ADAPTER = SYSTEMS[SGLANG].load(SGLANG)
FOLLOWS = SYSTEMS[SGLANG].followed() or "refcache"
IN_PROCESS: Any = rank_system(SGLANG)
"""The installed release's adapter as one rank in this process (the registry entries open worker processes for
two ranks: ``_tp.RANK_SYSTEMS``)."""
"""The adapter of the installed release (``SGLangSystem`` for 0.5.20, ``UnifiedSGLangSystem`` for 0.5.23)."""

ROWS: list[tuple[IOBackend, MemLayout, AttentionKind]] = [
    (io, layout, attention)
    for attention in AttentionKind
    for io, layout in (
        (IOBackend.DIRECT, MemLayout.LAYER_FIRST),
        (IOBackend.DIRECT, MemLayout.PAGE_FIRST_DIRECT),
        (IOBackend.KERNEL, MemLayout.LAYER_FIRST),
        (IOBackend.KERNEL, MemLayout.PAGE_FIRST),
        (IOBackend.KERNEL, MemLayout.PAGE_HEAD),
    )
    if not (layout is MemLayout.PAGE_HEAD and attention is AttentionKind.MLA)
]
"""Every io backend / layout row of SGLang's host pools, MHA and MLA (page_head is MHA only)."""

EXCLUDED = SYSTEMS[SGLANG].excluded()
"""The configuration values the installed release does not have (up to 0.5.5: the priority eviction policy and
the page_head layout), which the adapter refuses at open."""


def config(page_size: int = 1, **options: Any) -> HiCacheConfig:
    base: dict[str, Any] = {
        "page_size": page_size,
        "device_size": 8 * page_size,
        "hicache_io_backend": IOBackend.DIRECT,
        "load_back_threshold": 1,
        "hicache_write_policy": WritePolicy.WRITE_THROUGH,
    }
    # The model follows the installed release where refcache decided otherwise (its registry entry's profile).
    return HiCacheConfig(**{**base, **options}).with_fidelity(PROFILES[FOLLOWS])


def run(cfg: HiCacheConfig, ops: Sequence[Op]) -> list[Outcome]:
    """Apply ``ops`` to the model and SGLang through the harness (observations and snapshots compared,
    every invariant checked, after each step)."""
    with HiCacheModel(cfg) as model, ADAPTER(cfg) as sglang:
        harness = Harness(cfg, {"model": model, "sglang": sglang}, write_trace=False, family=HICACHE)
        return [harness.step(op) for op in ops]


A = (1, 2, 3, 4, 5, 6, 7, 8)
B = (*A, 20, 21, 22, 23, 24, 25, 26, 27)


@pytest.mark.parametrize("page_size", [1, 4])
def test_hit_write_through_and_load_back(page_size: int) -> None:
    a, b = A[: 2 * page_size], B[: 4 * page_size]
    out = run(
        config(page_size),
        [
            StartRequest(1, a),
            FinishRequest(1),
            StartRequest(2, b),  # device hit on a
            FinishRequest(2),
            CheckHicacheEvents(),  # nothing finished yet: both write-through copies are in flight
            CompleteIO(IOQueue.WRITE, 0, 1),
            CheckHicacheEvents(),
            CompleteIO(IOQueue.WRITE, 0, 8),
            CheckHicacheEvents(),
            Evict(1000),  # both nodes are backed up: device copies go, host copies stay
            MatchPrefix(b),
            StartRequest(3, b),  # the whole key is a host hit: loaded back
            CheckHicacheEvents(),
            CompleteIO(IOQueue.LOAD, 0, 1),
            CheckHicacheEvents(),
            FinishRequest(3),
        ],
    )
    assert out[2] == StartResult(True, len(a), 0, len(b) - len(a))
    assert out[4] == EventsResult(0, 0, 0, 0, 0)
    assert out[5] == IOResult(1)
    assert out[6] == EventsResult(1, 0, 0, 0, 0)
    assert out[9] == EvictResult(len(b))
    assert out[10] == MatchResult(0, len(b), len(b), len(b))
    assert out[11] == StartResult(True, 0, len(b), 0)
    assert out[12] == EventsResult(0, 0, 0, 0, 0)
    assert out[14] == EventsResult(0, 1, 0, 0, 0)
    assert out[15] == FinishResult(len(b), 0)


def test_below_the_load_back_threshold_the_request_recomputes() -> None:
    """The recompute refills the host-only node: UnifiedRadixCache counts a hit there (D-50, from 0.5.19), the
    model follows it under the release's profile."""
    out = run(
        config(1, load_back_threshold=10),
        [
            StartRequest(1, A),
            FinishRequest(1),
            CompleteIO(IOQueue.WRITE, 0, 8),
            CheckHicacheEvents(),
            Evict(100),
            StartRequest(2, A),
            FinishRequest(2),
        ],
    )
    assert out[5] == StartResult(True, 0, 0, len(A))  # 8 host tokens < 10: no load back


def test_write_back_eviction_copies_inside_evict() -> None:
    """write_back: no copy on insert; Evict writes the leaf back and blocks on the copy itself."""
    out = run(
        config(2, hicache_write_policy=WritePolicy.WRITE_BACK),
        [
            StartRequest(1, A),
            FinishRequest(1),
            CheckHicacheEvents(),
            Evict(4),
            MatchPrefix(A),
            EvictHost(100),
        ],
    )
    assert out[2] == EventsResult(0, 0, 0, 0, 0)
    assert out[3] == EvictResult(len(A))
    assert out[4] == MatchResult(0, len(A), len(A), len(A))
    assert out[5] == EvictHostResult(len(A))


def test_abort_and_unaligned_tails_free_what_the_request_owns() -> None:
    out = run(
        config(4),
        [
            StartRequest(1, (*A, 9, 10)),  # two pages and a partial one
            CacheUnfinishedRequest(1),
            AbortRequest(1),
            StartRequest(2, (*A, 9)),
            FinishRequest(2),
        ],
    )
    assert out[3] == StartResult(True, 8, 0, 1)
    assert out[4] == FinishResult(8, 1)


def test_reset_is_refused_until_idle_and_drained() -> None:
    out = run(
        config(1),
        [
            StartRequest(1, A),
            Reset(),
            FinishRequest(1),
            Reset(),  # the write-through copy is still in flight
            CompleteIO(IOQueue.WRITE, 0, 1),
            CheckHicacheEvents(),
            Reset(),
            StartRequest(2, A),
        ],
    )
    assert [out[1], out[3], out[6]] == [ResetResult(False), ResetResult(False), ResetResult(True)]
    assert out[7] == StartResult(True, 0, 0, len(A))


def test_namespaces_and_eagle_keys() -> None:
    run(
        config(2, is_eagle=True),
        [
            StartRequest(1, A, "lora-a"),
            FinishRequest(1),
            StartRequest(2, A),
            FinishRequest(2),
            MatchPrefix(A, "lora-a"),
        ],
    )


@pytest.mark.parametrize(("io_backend", "layout", "attention"), ROWS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_every_row_moves_the_bytes_only_when_the_copy_completes(
    io_backend: IOBackend, layout: MemLayout, attention: AttentionKind, page_size: int
) -> None:
    """KV written on the device goes to the host on the write-through copy, and comes back to other device
    slots only when the load back completes (before that the device slots keep what was there)."""
    cfg = config(page_size, hicache_io_backend=io_backend, hicache_mem_layout=layout, attention=attention)
    if str(layout) in EXCLUDED.get("hicache_mem_layout", ()):  # a layout the release has not: refused
        with pytest.raises(UnsupportedError, match=f"hicache_mem_layout={layout}: SGLang"):
            IN_PROCESS(cfg)
        return
    tokens = A[: 2 * page_size]
    with IN_PROCESS(cfg) as sglang:  # one rank, in this process: its buffers are read here
        sglang.apply(StartRequest(1, tokens))
        slots = _slots(sglang, 1, len(tokens))
        layers = _device_layers(sglang)
        for i, layer in enumerate(layers):
            layer[slots] = _pattern(layer, slots, i)
        sglang.apply(FinishRequest(1))
        sglang.apply(CompleteIO(IOQueue.WRITE, 0, 1))
        sglang.apply(CheckHicacheEvents())
        sglang.apply(Evict(1000))
        for layer in layers:
            layer.fill_(-1)
        assert sglang.apply(StartRequest(2, tokens)) == StartResult(True, 0, len(tokens), 0)
        loaded = _slots(sglang, 2, len(tokens))
        assert all(bool((layer[loaded] == -1).all()) for layer in layers), "copied before CompleteIO"
        assert sglang.apply(CompleteIO(IOQueue.LOAD, 0, 1)) == IOResult(1)
        for i, layer in enumerate(layers):
            assert torch.equal(layer[loaded], _pattern(layer, slots, i)), f"layer buffer {i}"


def _slots(sglang: SGLangSystem, rid: int, n: int) -> torch.Tensor:
    row = sglang.requests[rid].kv.req_pool_idx
    slots: torch.Tensor = sglang.req_to_token_pool.req_to_token[row, :n].long()
    return slots


def _device_layers(sglang: SGLangSystem) -> list[torch.Tensor]:
    kv = sglang.allocator.get_kvcache()
    if sglang.config.attention is AttentionKind.MHA:
        return [*kv.k_buffer, *kv.v_buffer]
    return list(kv.kv_buffer)


def _pattern(layer: torch.Tensor, slots: torch.Tensor, i: int) -> torch.Tensor:
    shape = (len(slots), *layer.shape[1:])
    values = torch.arange(len(slots) * layer[0].numel(), dtype=torch.float32).reshape(shape) % 50 + 100 * i
    return values.to(layer.dtype)


def test_unsupported_configurations_are_refused_with_the_reason() -> None:
    release = versions.installed().row  # what the adapter opens on this release
    if 2 in release.ranks_on(SGLANG):  # one rank here, two through worker processes (the registry's factory)
        with pytest.raises(UnsupportedError, match="tp_size=4"):
            ADAPTER(config(1, tp_size=4))
        with pytest.raises(UnsupportedError, match="group of 1"):  # two ranks need a process each (_tp)
            IN_PROCESS(config(1, tp_size=2))
    else:  # one rank
        with pytest.raises(UnsupportedError, match="tp_size=2"):
            ADAPTER(config(1, tp_size=2))
    if release.l3_on(SGLANG):  # L3 with its file backend only (a further system: where Release.also_l3 says)
        with pytest.raises(UnsupportedError, match="HiCacheFile"):
            ADAPTER(config(1, hicache_storage_backend="memory"))
    else:
        with pytest.raises(UnsupportedError, match="L3"):
            ADAPTER(config(1, hicache_storage_backend="file"))
    for option, values in EXCLUDED.items():  # what the release has not (up to 0.5.5), refused by name
        for value in values:
            kernel = {"hicache_io_backend": IOBackend.KERNEL}  # page_head's io backend
            with pytest.raises(UnsupportedError, match=f"{option}={value}: SGLang"):
                ADAPTER(config(1, **{option: value}, **kernel))


def test_a_fourth_load_in_flight_is_refused_as_sglang_would_assert() -> None:
    cfg = config(1, device_size=32)
    requests = [tuple(range(100 * k, 100 * k + 4)) for k in range(MAX_PENDING_LOADS + 1)]
    with ADAPTER(cfg) as sglang:
        for rid, tokens in enumerate(requests):
            sglang.apply(StartRequest(rid, tokens))
            sglang.apply(FinishRequest(rid))
        sglang.apply(CompleteIO(IOQueue.WRITE, 0, 64))
        sglang.apply(CheckHicacheEvents())
        sglang.apply(Evict(1000))
        for rid, tokens in enumerate(requests[:MAX_PENDING_LOADS]):
            assert sglang.apply(StartRequest(10 + rid, tokens)).loaded == 4  # type: ignore[union-attr]
        with pytest.raises(UnsupportedError, match="LayerDoneCounter"):
            sglang.apply(StartRequest(20, requests[-1]))
        sglang.apply(CompleteIO(IOQueue.LOAD, 0, 1))
        sglang.apply(
            CheckHicacheEvents()
        )  # 0.5.23 counts acks until they are retired (has_free_load_back_slot)
        assert sglang.apply(StartRequest(20, requests[-1])) == StartResult(True, 0, 4, 0)


def test_the_shim_names_every_stub() -> None:
    assert set(_shim.STUBBED) == {"torchvision", "transformers.AutoImageProcessor"}
    import torchvision  # type: ignore[import-not-found, unused-ignore]

    assert getattr(torchvision, "__refcache_stub__", False) == _shim.installed()


def test_admission_evicts_as_the_installed_release_does() -> None:
    """D-42: short of device memory by one token, admission evicts the shortfall (one 1-token node) from
    0.5.17 on, and the request's whole size (three nodes) up to 0.5.16. The model follows the installed
    release under its profile, and diverges with that one option flipped."""
    cfg = config(1, device_size=8, hicache_write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE)
    ops: list[Op] = []
    for rid in range(6):  # six 1-token leaves: 6 of 8 slots used, all evictable
        ops += [StartRequest(rid, (100 + rid,)), FinishRequest(rid)]
    ops.append(StartRequest(9, (7, 8, 9)))  # 3 tokens, 2 free: short by one
    run(cfg, ops)
    flipped = cfg.with_fidelity({"evict_request_size_on_admission": not cfg.evict_request_size_on_admission})
    with pytest.raises(Divergence, match="device"):
        run(flipped, ops)
