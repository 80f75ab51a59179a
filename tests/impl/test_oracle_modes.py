"""The KV content oracle's modes (``HiCacheImpl(config, oracle=...)``): ``full`` catches a corrupted read,
``sampled`` catches it at a sampled position, ``off`` derives, writes and checks nothing."""

from __future__ import annotations

import pytest
import torch

from refcache.config import HiCacheConfig, IOBackend
from refcache.errors import CorruptionError, UsageError
from refcache.gpu.driver import HiCacheImpl
from refcache.gpu.kv_oracle import KVOracle
from refcache.hicache.ops import FinishRequest, StartRequest, StartResult

# every test twice: the oracle's C path for CPU pools, then its torch path (tests/impl/conftest.py)
pytestmark = pytest.mark.usefixtures("oracle_path")

CONFIG = HiCacheConfig(device_size=64, page_size=4, hicache_io_backend=IOBackend.DIRECT)
TOKENS = tuple(range(100, 116))


def _cached_then_corrupted(impl: HiCacheImpl, position: int) -> None:
    """Cache TOKENS, then overwrite the device KV of the token at ``position`` of the cached path."""
    impl.apply(StartRequest(1, TOKENS))
    impl.apply(FinishRequest(1))
    rank = impl.ranks[0]
    match = rank.match_prefix(rank.key_of(TOKENS), None)
    slot = int(match.device_indices[position])
    rank.cache_controller.mem_pool_device.kv_buffer[:, :, slot] = 5.0  # stale bytes: a legal value, wrong


def test_full_catches_a_corrupted_read() -> None:
    with HiCacheImpl(CONFIG) as impl:
        _cached_then_corrupted(impl, 5)
        with pytest.raises(CorruptionError, match="differs from the oracle"):
            impl.apply(StartRequest(2, TOKENS))


def test_sampled_catches_a_corrupted_sampled_position_and_is_deterministic() -> None:
    with HiCacheImpl(CONFIG, oracle="sampled") as impl:
        _cached_then_corrupted(impl, 8)  # positions 0, 8 and the last (15) are checked
        with pytest.raises(CorruptionError):
            impl.apply(StartRequest(2, TOKENS))
    with HiCacheImpl(CONFIG, oracle="sampled") as impl:
        _cached_then_corrupted(impl, 5)  # not a sampled position: the read passes
        assert isinstance(impl.apply(StartRequest(2, TOKENS)), StartResult)


def test_off_derives_writes_and_checks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the oracle ran with oracle='off'")

    for name in ("expected", "advance", "write_device", "check_device_layers", "check_host"):
        monkeypatch.setattr(KVOracle, name, never)
    with HiCacheImpl(CONFIG, oracle="off") as impl:
        _cached_then_corrupted(impl, 5)
        assert isinstance(impl.apply(StartRequest(2, TOKENS)), StartResult)
        pool = impl.ranks[0].cache_controller.mem_pool_device
        impl.apply(FinishRequest(2))
        assert not bool(torch.isnan(pool.kv_buffer).any()), "freed slots are not poisoned with the oracle off"


def test_the_oracle_takes_the_path_asked_for(oracle_path: str) -> None:
    with HiCacheImpl(CONFIG) as impl:
        assert (impl.ranks[0].oracle._c is not None) == (oracle_path == "c")


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises((ValueError, UsageError)):
        HiCacheImpl(CONFIG, oracle="most")  # type: ignore[arg-type]
