"""The content oracle's element function (``KVOracle.advance``, ``seeds_of``, ``expected``): small integers
every supported dtype holds exactly, a function of the whole prefix and the position, and different for a
wrong token, layer, K/V, head or dim; and a device hit's read is what the per-layer accessors return."""

from __future__ import annotations

import pytest
import torch

from refcache.config import AttentionKind, HiCacheConfig, IOBackend
from refcache.errors import CorruptionError
from refcache.gpu.device_pool import MHATokenToKVPool
from refcache.gpu.driver import HiCacheImpl
from refcache.gpu.kv_oracle import KVOracle
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    FinishRequest,
    IOQueue,
    IOResult,
    StartRequest,
    StartResult,
)

# every test twice: the oracle's C path for CPU pools, then its torch path (tests/impl/conftest.py)
pytestmark = pytest.mark.usefixtures("oracle_path")

MHA = HiCacheConfig(layer_num=3, head_num=2, head_dim=8, tp_size=2)
MLA = HiCacheConfig(attention=AttentionKind.MLA, layer_num=2, kv_lora_rank=8, qk_rope_head_dim=4)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]


def _seeds(oracle: KVOracle, tokens: list[int]) -> torch.Tensor:
    return oracle.seeds(None, tokens)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_values_are_small_integers_every_dtype_holds(dtype: torch.dtype) -> None:
    oracle = KVOracle(MHA, 1)
    ints = oracle.expected(_seeds(oracle, list(range(500))), torch.int32)
    assert int(ints.min()) == -8 and int(ints.max()) == 7  # the whole range is used, nothing beyond it
    stored = oracle.expected(_seeds(oracle, list(range(500))), dtype)
    assert torch.equal(stored.to(torch.int32), ints)  # exact: no rounding, no NaN or inf


def test_a_seed_is_a_function_of_the_whole_prefix_and_the_position() -> None:
    oracle = KVOracle(MHA, 0)
    base = _seeds(oracle, [5, 6, 7, 8])
    assert torch.equal(_seeds(oracle, [5, 6, 7, 8, 9])[:4], base)  # a prefix's seeds do not see what follows
    assert not torch.equal(_seeds(oracle, [4, 6, 7, 8])[1:], base[1:])  # an earlier token: every later one
    assert not torch.equal(_seeds(oracle, [6, 5, 7, 8])[2:], base[2:])  # so does an order swap
    repeated = _seeds(oracle, [3, 3, 3, 3])
    assert len(set(repeated.tolist())) == 4  # the same token at another position
    assert not torch.equal(oracle.seeds("tenant", [5, 6, 7, 8]), base)  # the namespace
    # A chain resumed from a state is the chain from the root (what trees cache per node).
    states = oracle.advance(oracle.root_state(None), [5, 6])
    resumed = oracle.advance(int(states[-1]), [7, 8], position=2)
    assert torch.equal(oracle.seeds_of(resumed), base[2:])


@pytest.mark.parametrize("config", [MHA, MLA], ids=["MHA", "MLA"])
def test_a_misplaced_element_differs(config: HiCacheConfig) -> None:
    oracle = KVOracle(config, 1)
    want = oracle.expected(_seeds(oracle, list(range(64))), torch.int32)  # (layer, kv, token, head, dim)

    def differs(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a != b).float().mean())

    assert differs(want[:, :, 1:], want[:, :, :-1]) > 0.85  # a neighbouring slot
    assert differs(want[1:], want[:-1]) > 0.85  # a wrong layer
    if config.attention is AttentionKind.MHA:
        assert differs(want[:, 0], want[:, 1]) > 0.85  # K for V
        assert differs(want[..., 0, :], want[..., 1, :]) > 0.85  # a wrong head
        other_rank = KVOracle(config, 0).expected(_seeds(oracle, list(range(64))), torch.int32)
        assert differs(want, other_rank) > 0.85  # another rank's heads
    assert differs(want[..., 1:], want[..., :-1]) > 0.85  # a dim shifted (a layout transform)
    for token in range(want.shape[2]):  # no token has a position equal in every element to its neighbour's
        assert not torch.equal(want[:, :, token], want[:, :, (token + 1) % want.shape[2]])


def test_a_device_hit_reads_what_the_per_layer_accessors_return(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-gather read of a device hit stands for the accessors' buffers only when they are the views
    it reads: an accessor that hands out another layer's buffer is caught."""
    config = HiCacheConfig(device_size=64, page_size=4, hicache_io_backend=IOBackend.DIRECT)
    tokens = tuple(range(100, 116))
    with HiCacheImpl(config) as impl:
        impl.apply(StartRequest(1, tokens))
        impl.apply(FinishRequest(1))
        assert isinstance(impl.apply(StartRequest(2, tokens)), StartResult)
        impl.apply(FinishRequest(2))
        real = MHATokenToKVPool.get_kv_buffer

        def next_layer(pool: MHATokenToKVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
            return real(pool, (layer_id + 1) % pool.layer_num)

        monkeypatch.setattr(MHATokenToKVPool, "get_kv_buffer", next_layer)
        with pytest.raises(CorruptionError, match="layer 0, K"):
            impl.apply(StartRequest(3, tokens))


@pytest.mark.parametrize("broken", ["none", "next-layer", "stale-layer-1"])
def test_a_load_back_reads_each_layer_through_its_accessor(
    monkeypatch: pytest.MonkeyPatch, broken: str
) -> None:
    """The forward pass of a load-back reads each layer as its accessor returns it and compares the whole
    read at the end: an accessor that hands out another layer's buffer, or one layer's loaded KV
    overwritten, is caught and named; an intact load passes."""
    config = HiCacheConfig(device_size=64, page_size=4, layer_num=3, hicache_io_backend=IOBackend.DIRECT)
    tokens = tuple(range(100, 116))
    with HiCacheImpl(config) as impl:
        impl.apply(StartRequest(1, tokens))
        impl.apply(FinishRequest(1))
        impl.apply(StartRequest(2, tokens))  # the second hit writes the node through to the host
        impl.apply(FinishRequest(2))
        impl.apply(CompleteIO(IOQueue.WRITE, 0, 1 << 20))
        impl.apply(CheckHicacheEvents())
        impl.apply(Evict(64))
        assert isinstance(impl.apply(StartRequest(3, tokens)), StartResult)
        real = MHATokenToKVPool.get_kv_buffer

        def accessor(pool: MHATokenToKVPool, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
            if broken == "next-layer":
                return real(pool, (layer_id + 1) % pool.layer_num)
            k, v = real(pool, layer_id)
            if broken == "stale-layer-1" and layer_id == 1:
                v[:] = 0  # after the wait: what the read sees is not what was loaded
            return k, v

        monkeypatch.setattr(MHATokenToKVPool, "get_kv_buffer", accessor)
        if broken == "none":
            done = impl.apply(CompleteIO(IOQueue.LOAD, 0, 1 << 20))
            assert isinstance(done, IOResult) and done.completed == 1  # the load ran, and its read passed
        else:
            with pytest.raises(
                CorruptionError, match="layer 0, K" if broken == "next-layer" else "layer 1, V"
            ):
                impl.apply(CompleteIO(IOQueue.LOAD, 0, 1 << 20))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("attention", [AttentionKind.MHA, AttentionKind.MLA], ids=["MHA", "MLA"])
def test_every_dtype_runs_the_oracle_end_to_end(dtype: str, attention: AttentionKind) -> None:
    """Writes, device hits, poisoned frees (eviction) and checked load-backs in each supported dtype."""
    config = HiCacheConfig(
        device_size=32, page_size=4, hicache_io_backend=IOBackend.DIRECT, dtype=dtype, attention=attention
    )
    prompts = [tuple(range(base, base + 24)) for base in (100, 200, 300)]
    with HiCacheImpl(config) as impl:
        for rid, tokens in enumerate(prompts * 2):  # the second round loads back what the first evicted
            impl.apply(StartRequest(rid, tokens))
            impl.apply(FinishRequest(rid))
            impl.apply(CompleteIO(IOQueue.WRITE, 0, 1 << 20))
            impl.apply(CompleteIO(IOQueue.LOAD, 0, 1 << 20))
            impl.apply(CheckHicacheEvents())
        pool = impl.ranks[0].cache_controller.mem_pool_device
        assert bool(pool.kv_buffer.to(torch.float32).isnan().any()), "freed slots were poisoned"
