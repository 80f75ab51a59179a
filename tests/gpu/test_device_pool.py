"""Device pools and their slot allocators."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import UsageError
from refcache.gpu import (
    MHATokenToKVPool,
    MLATokenToKVPool,
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
    default_device,
    device_pool_from_config,
)
from refcache.gpu.memory import HUGE_PAGE, empty_kv

# --- pools ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="device pools are on the GPU")
def test_large_cpu_buffers_start_on_a_huge_page_and_are_zero() -> None:
    """A CPU pool of at least a huge page is aligned for transparent huge pages (and advised into them
    where the kernel allows); smaller ones are plain allocations. Both are zero-filled, and transfers see
    only the pool's own bytes."""
    big = MLATokenToKVPool(4096, 16, torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=2)
    assert big.get_kv_size_bytes() >= HUGE_PAGE
    assert big.kv_buffer.data_ptr() % HUGE_PAGE == 0
    assert big.kv_buffer.is_contiguous() and not big.kv_buffer.any()
    assert big.kv_buffer.shape == (2, 4096, 1, 576) and big.kv_buffer.dtype == torch.bfloat16
    assert big.kv_view().extent == big.get_kv_size_bytes()
    small = empty_kv((3, 5), torch.float16, torch.device("cpu"))
    assert small.shape == (3, 5) and not small.any()


def test_mha_buffers_have_the_seed_shapes() -> None:
    pool = MHATokenToKVPool(16, 4, torch.bfloat16, head_num=2, head_dim=8, layer_num=3)
    assert pool.device == default_device()
    for layer in range(3):
        assert pool.get_key_buffer(layer).shape == (16, 2, 8)
        assert pool.get_value_buffer(layer).shape == (16, 2, 8)
        assert pool.get_key_buffer(layer).data_ptr() == pool.kv_buffer[0, layer].data_ptr()
        assert pool.get_value_buffer(layer).data_ptr() == pool.kv_buffer[1, layer].data_ptr()
    assert pool.get_kv_size_bytes() == 2 * 3 * 16 * 2 * 8 * 2


def test_mla_buffers_have_the_seed_shapes() -> None:
    pool = MLATokenToKVPool(16, 4, torch.float16, kv_lora_rank=8, qk_rope_head_dim=4, layer_num=2)
    assert pool.get_key_buffer(1).shape == (16, 1, 12)
    assert pool.get_value_buffer(1).shape == (16, 1, 8)
    k, v = pool.get_kv_buffer(0)
    assert v.data_ptr() == k.data_ptr()


@pytest.mark.parametrize("attention", list(AttentionKind))
def test_set_kv_buffer_writes_the_named_slots(attention: AttentionKind) -> None:
    pool = device_pool_from_config(HiCacheConfig(attention=attention, device_size=8))
    loc = torch.tensor([5, 2])
    k = torch.randn(2, pool.head_num, pool.head_dim)
    v = torch.randn(2, pool.head_num, pool.head_dim)
    pool.set_kv_buffer(1, loc, k, v)
    assert torch.equal(pool.get_key_buffer(1)[loc].cpu(), k.half())
    if attention is AttentionKind.MHA:
        assert torch.equal(pool.get_value_buffer(1)[loc].cpu(), v.half())
    assert not pool.get_key_buffer(0).any()
    assert int(pool.kv_buffer.ne(0).sum()) == k.numel() * pool.num_kv


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("attention", list(AttentionKind))
def test_set_kv_buffers_is_set_kv_buffer_of_every_layer(attention: AttentionKind, dtype: str) -> None:
    """The one-copy store of every layer (the contiguous allocation) writes what ``set_kv_buffer`` per layer
    writes (the path of any other allocation), and nothing else."""
    config = HiCacheConfig(attention=attention, device_size=8, layer_num=3, dtype=dtype)
    fused, per_layer = device_pool_from_config(config), device_pool_from_config(config)
    per_layer.int_rows = lambda: None  # type: ignore[method-assign]  # as a non-contiguous allocation
    loc = torch.tensor([6, 1, 3])
    cache = torch.randint(-8, 8, (fused.num_kv, 3, 3, fused.head_num, fused.head_dim)).to(fused.dtype)
    fused.set_kv_buffers(loc, cache)
    per_layer.set_kv_buffers(loc, cache)
    bits = {1: torch.int8, 2: torch.int16}[fused.kv_buffer.element_size()]
    assert torch.equal(fused.kv_buffer.view(bits), per_layer.kv_buffer.view(bits))
    for layer in range(3):
        for kv, got in enumerate(fused.get_kv_buffer(layer)[: fused.num_kv]):
            assert torch.equal(got[loc].view(bits), cache[kv, layer].view(bits))
    assert int(fused.kv_buffer.view(bits).ne(0).sum()) == int(cache.view(bits).ne(0).sum())


def test_layer_out_of_range() -> None:
    pool = MHATokenToKVPool(8, 1, torch.float16, 1, 4, 2)
    with pytest.raises(UsageError):
        pool.get_key_buffer(2)


# --- allocators -----------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    page_size=st.sampled_from([1, 2, 4]),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 9), st.integers(0, 1000)), max_size=40),
)
def test_allocator_matches_the_fifo_contract(page_size: int, ops: list[tuple[bool, int, int]]) -> None:
    """Against a list model of the contract: pages from the head, freed pages to the tail, ascending."""
    alloc = PagedTokenToKVPoolAllocator(
        8 * page_size + page_size - 1, page_size
    )  # a partial tail page is unused
    free_pages = list(range(8))
    held: list[list[int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc or not held:
            got = alloc.alloc(n)
            need = -(-n // page_size)
            if need > len(free_pages):
                assert got is None
                continue
            assert got is not None
            assert got.dtype == torch.int64
            pages, free_pages = free_pages[:need], free_pages[need:]
            assert got.tolist() == [p * page_size + o for p in pages for o in range(page_size)][:n]
            if n:
                held.append(got.tolist())
        else:
            slots = held.pop(pick % len(held))
            alloc.free(torch.tensor(slots))
            free_pages += sorted({s // page_size for s in slots})
        assert list(alloc.free_pages) == free_pages
        assert alloc.available_size() == len(free_pages) * page_size


def test_token_allocator_is_paged_with_page_size_one() -> None:
    alloc = TokenToKVPoolAllocator(5)
    assert alloc.page_size == 1
    a = alloc.alloc(3)
    assert a is not None
    assert a.tolist() == [0, 1, 2]
    alloc.free(torch.tensor([2, 0]))
    assert list(alloc.free_pages) == [3, 4, 0, 2]


def test_free_frees_whole_pages_in_ascending_order() -> None:
    alloc = PagedTokenToKVPoolAllocator(16, 4)
    a = alloc.alloc(10)
    assert a is not None
    assert a.tolist() == list(range(10))
    alloc.free(torch.tensor([9, 1]))  # slot 9 is in page 2, slot 1 in page 0
    assert list(alloc.free_pages) == [3, 0, 2]


def test_double_free_raises_and_changes_nothing() -> None:
    alloc = PagedTokenToKVPoolAllocator(16, 4)
    a = alloc.alloc(8)
    assert a is not None
    alloc.free(a[:4])
    before = list(alloc.free_pages)
    for bad in (a[:1], a, torch.tensor([16]), torch.tensor([-1])):
        with pytest.raises(UsageError):
            alloc.free(bad)
        assert list(alloc.free_pages) == before
    alloc.free(a[4:])  # the still-allocated page can be freed normally


def test_double_allocation_is_detected() -> None:
    alloc = PagedTokenToKVPoolAllocator(16, 4)
    assert alloc.alloc(4) is not None
    alloc.free_pages.appendleft(0)  # corrupt the queue: page 0 is in use
    with pytest.raises(UsageError, match="double allocation"):
        alloc.alloc(4)
    assert alloc.available_size() == 16  # nothing was taken


def test_alloc_failure_changes_nothing() -> None:
    alloc = PagedTokenToKVPoolAllocator(8, 4)
    assert alloc.alloc(9) is None
    assert alloc.available_size() == 8
    with pytest.raises(UsageError):
        alloc.alloc(-1)
    alloc.clear()
    assert list(alloc.free_pages) == [0, 1]


def test_free_reports_every_slot_of_the_freed_pages_and_poison_overwrites_them() -> None:
    pool = MHATokenToKVPool(16, 4, torch.float16, head_num=2, head_dim=8, layer_num=2, device="cpu")
    pool.kv_buffer.zero_()
    freed: list[list[int]] = []

    def on_free(slots: torch.Tensor) -> None:
        freed.append(slots.tolist())
        pool.poison(slots)

    alloc = PagedTokenToKVPoolAllocator(16, 4, kvcache=pool, on_free=on_free)
    slots = alloc.alloc(6)
    assert slots is not None
    alloc.free(slots[:5])  # pages 0 and 1, the partly used page whole
    assert freed == [[0, 1, 2, 3, 4, 5, 6, 7]]
    for layer in range(pool.layer_num):
        for got in pool.get_kv_buffer(layer):
            assert bool(got[:8].isnan().all()) and not bool(got[8:].isnan().any())
