"""Shared test helpers: pool builders, random bits, a byte comparison and an independent layout oracle.

The oracle indexes the seed's buffer dimensions (seed §5.3) directly, without ``KVView`` or strides, so a
stride mistake in the code under test cannot cancel out in the check.
"""

from __future__ import annotations

import torch

from refcache.config import AttentionKind, HiCacheConfig, IOBackend, MemLayout
from refcache.gpu import HostKVCache, KVCache, device_pool_from_config, host_pool_from_config
from refcache.gpu.memory import as_bits
from refcache.gpu.transfer import DISPATCH

# Every (attention, layout, io backend) row of seed §5.4, read off the dispatch table.
ROWS: list[tuple[AttentionKind, MemLayout, IOBackend]] = [
    (attention, layout, backend)
    for attention in AttentionKind
    for (backend, layout), (_, _, kinds) in DISPATCH.items()
    if attention in kinds
]
LAYOUTS: list[tuple[AttentionKind, MemLayout]] = [
    (a, m) for a in AttentionKind for m in MemLayout if (a, m) != (AttentionKind.MLA, MemLayout.PAGE_HEAD)
]
DEVICE_PAGES = 4  # device pool capacity in pages; the host pool gets 2x + 1 pages


def make_config(
    attention: AttentionKind,
    layout: MemLayout,
    page_size: int,
    dtype: str = "float16",
    io_backend: IOBackend | None = None,
    **extra: object,
) -> HiCacheConfig:
    """A tiny configuration (2 layers, 2 heads of 8, MLA latent 8 + 4) whose layout needs no rewrite."""
    if io_backend is None:
        io_backend = IOBackend.DIRECT if layout is MemLayout.PAGE_FIRST_DIRECT else IOBackend.KERNEL
    return HiCacheConfig(
        attention=attention,
        hicache_mem_layout=layout,
        hicache_io_backend=io_backend,
        page_size=page_size,
        dtype=dtype,
        device_size=DEVICE_PAGES * page_size,
        **extra,  # type: ignore[arg-type]
    )


def make_pools(config: HiCacheConfig) -> tuple[KVCache, HostKVCache]:
    device = device_pool_from_config(config)
    return device, host_pool_from_config(device, config)


def fill_random_(t: torch.Tensor, seed: int) -> None:
    """Overwrite ``t`` with random bits (NaN patterns included: comparisons are on bits)."""
    bits = as_bits(t)
    gen = torch.Generator().manual_seed(seed)
    info = torch.iinfo(bits.dtype)
    rand = torch.randint(info.min, info.max, bits.shape, generator=gen, dtype=torch.int64)
    bits.copy_(rand.to(bits.dtype))


def assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Raise ``AssertionError`` naming the first differing element unless the bits are identical."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    # On the CPU, so that device and host buffers compare directly.
    a, e = as_bits(actual.cpu().contiguous()), as_bits(expected.cpu().contiguous())
    diff = (a != e).nonzero()
    if diff.numel():
        first = tuple(diff[0].tolist())
        raise AssertionError(f"{what}: {diff.shape[0]} elements differ, first at {first}")


def host_slot(
    host: HostKVCache, kv: int, layer: int, index: int, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """View ``(H, D)`` of one token slot of one layer of K/V in ``buffer`` (default: the host pool's own),
    indexed by seed §5.3's dimensions."""
    b = host.kv_buffer if buffer is None else buffer
    page, off = divmod(index, host.page_size)
    if host.num_kv == 2:
        if host.layout is MemLayout.LAYER_FIRST:
            return b[kv, layer, index]
        if host.layout is MemLayout.PAGE_FIRST:
            return b[kv, index, layer]
        if host.layout is MemLayout.PAGE_FIRST_DIRECT:
            return b[kv, page, layer, off]
        return b[kv, page, :, off, layer]  # page_head
    if host.layout is MemLayout.LAYER_FIRST:
        return b[layer, index]
    if host.layout is MemLayout.PAGE_FIRST:
        return b[index, layer]
    return b[page, layer, off]  # page_first_direct


def device_slot(
    device: KVCache, kv: int, layer: int, index: int, buffer: torch.Tensor | None = None
) -> torch.Tensor:
    """View ``(H, D)`` of one token slot in ``buffer`` (default: the device pool's), by seed §5.2's dims."""
    b = device.kv_buffer if buffer is None else buffer
    return b[kv, layer, index] if device.num_kv == 2 else b[layer, index]


def page_slots(pages: list[int], page_size: int) -> torch.Tensor:
    """The token slots of ``pages`` in order."""
    return torch.tensor([p * page_size + o for p in pages for o in range(page_size)], dtype=torch.int64)


def expected_after_backup(
    host: HostKVCache, device: KVCache, h: torch.Tensor, d: torch.Tensor
) -> torch.Tensor:
    """The host buffer that backing up device slots ``d`` to host slots ``h`` must produce (the oracle)."""
    expected = host.kv_buffer.clone()
    for i, j in zip(h.tolist(), d.tolist(), strict=True):
        for layer in range(host.layer_num):
            for kv in range(host.num_kv):
                host_slot(host, kv, layer, i, expected).copy_(device_slot(device, kv, layer, j))
    return expected


def backup_and_check(
    host: HostKVCache, device: KVCache, h: torch.Tensor, d: torch.Tensor, io: IOBackend
) -> None:
    expected = expected_after_backup(host, device, h, d)
    host.backup_from_device_all_layer(device, h, d, io)
    assert_same_bytes(host.kv_buffer, expected, "host pool after backup")


def load_and_check(
    host: HostKVCache, device: KVCache, h: torch.Tensor, d: torch.Tensor, io: IOBackend
) -> None:
    for layer in range(host.layer_num):
        expected = device.kv_buffer.clone()
        for i, j in zip(h.tolist(), d.tolist(), strict=True):
            for kv in range(host.num_kv):
                device_slot(device, kv, layer, j, expected).copy_(host_slot(host, kv, layer, i))
        host.load_to_device_per_layer(device, h, d, layer, io)
        assert_same_bytes(device.kv_buffer, expected, f"device pool after loading layer {layer}")
