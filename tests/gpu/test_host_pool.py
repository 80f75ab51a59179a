"""Host pools: capacity rules, the FIFO allocator, the four layouts' page helpers and zero-copy pointers."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from refcache.config import AttentionKind, HiCacheConfig, MemLayout
from refcache.errors import ConfigError, UsageError
from refcache.gpu import (
    HostKVCache,
    MHATokenToKVPool,
    MHATokenToKVPoolHost,
    MLATokenToKVPool,
    MLATokenToKVPoolHost,
    host_pool_from_config,
)
from refcache.gpu.memory import as_bits

from .gpu_helpers import (
    LAYOUTS,
    assert_same_bytes,
    fill_random_,
    host_slot,
    make_config,
    make_pools,
    page_slots,
)

# --- capacity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("ratio", [1.5, 2.0, 3.7])
def test_size_from_ratio_is_page_rounded(page_size: int, ratio: float) -> None:
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, page_size, hicache_ratio=ratio)
    _, host = make_pools(config)
    size = int(config.device_size * ratio)
    assert host.size == (size // page_size + 1) * page_size
    assert host.page_num == host.size // page_size
    assert host.available_size() == host.size


def test_size_from_hicache_size_wins_over_ratio() -> None:
    config = make_config(AttentionKind.MLA, MemLayout.PAGE_FIRST, 4, hicache_size=1e-5, hicache_ratio=50.0)
    _, host = make_pools(config)
    per_token = (8 + 4) * 2 * 2  # (kv_lora_rank + qk_rope_head_dim) * itemsize * layers
    assert host.size == (int(1e-5 * 1e9 // per_token) // 4 + 1) * 4
    assert host.size_per_token == per_token


def test_host_must_be_larger_than_device() -> None:
    with pytest.raises(ConfigError, match="not larger"):
        make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, hicache_ratio=0.5))
    # The rule is checked against the real device pool too, not only config.device_size.
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4)
    big = MHATokenToKVPool(10 * config.device_size, 4, torch.float16, 2, 8, 2)
    with pytest.raises(ConfigError, match="not larger"):
        MHATokenToKVPoolHost(big, config)


def test_device_pool_must_match_the_config() -> None:
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4)
    other_heads = MHATokenToKVPool(config.device_size, 4, torch.float16, 4, 8, 2)
    with pytest.raises(ConfigError, match="does not match"):
        MHATokenToKVPoolHost(other_heads, config)
    mla = MLATokenToKVPool(config.device_size, 4, torch.float16, 8, 4, 2)
    with pytest.raises(ConfigError, match="attention"):
        MLATokenToKVPoolHost(mla, config)


def test_not_pinned_without_cuda() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    assert host.kv_buffer.is_pinned() == torch.cuda.is_available()


def test_host_pool_from_config_rejects_other_pools() -> None:
    with pytest.raises(ConfigError):
        host_pool_from_config(object(), HiCacheConfig())  # type: ignore[arg-type]


# --- buffer dimensions (seed §5.3) ----------------------------------------------------------------------


@pytest.mark.parametrize(("attention", "layout"), LAYOUTS, ids=str)
def test_buffer_dims_follow_the_seed(attention: AttentionKind, layout: MemLayout) -> None:
    _, host = make_pools(make_config(attention, layout, 4))
    size, pn, ps = host.size, host.page_num, 4
    dims = {
        (AttentionKind.MHA, MemLayout.LAYER_FIRST): (2, 2, size, 2, 8),
        (AttentionKind.MHA, MemLayout.PAGE_FIRST): (2, size, 2, 2, 8),
        (AttentionKind.MHA, MemLayout.PAGE_FIRST_DIRECT): (2, pn, 2, ps, 2, 8),
        (AttentionKind.MHA, MemLayout.PAGE_HEAD): (2, pn, 2, ps, 2, 8),
        (AttentionKind.MLA, MemLayout.LAYER_FIRST): (2, size, 1, 12),
        (AttentionKind.MLA, MemLayout.PAGE_FIRST): (size, 2, 1, 12),
        (AttentionKind.MLA, MemLayout.PAGE_FIRST_DIRECT): (pn, 2, ps, 1, 12),
    }[(attention, layout)]
    assert tuple(host.kv_buffer.shape) == dims


# --- allocator ------------------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 5), st.randoms(use_true_random=False)), max_size=30)
)
def test_allocator_is_a_fifo_of_slots(ops: list[tuple[bool, int, object]]) -> None:
    """Against a list model: alloc takes the head, free appends to the tail in the given order."""
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.PAGE_FIRST, 2))
    model = list(range(host.size))
    held: list[list[int]] = []
    for is_alloc, pages, rnd in ops:
        if is_alloc or not held:
            got = host.alloc(pages * 2)
            if pages * 2 > len(model):
                assert got is None
                continue
            assert got is not None
            assert got.tolist() == model[: pages * 2]
            del model[: pages * 2]
            if pages:
                held.append(got.tolist())
        else:
            chunk = held.pop(rnd.randrange(len(held)))  # type: ignore[attr-defined]
            host.free(torch.tensor(chunk))
            model.extend(chunk)
        assert list(host.free_slots) == model
        assert host.available_size() == len(model)


def test_alloc_needs_whole_pages() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    with pytest.raises(UsageError, match="whole pages"):
        host.alloc(3)
    assert host.alloc(host.size + 4) is None
    assert host.available_size() == host.size


def test_alloc_returns_a_copy() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    got = host.alloc(4)
    assert got is not None
    got[:] = 99  # mutating the result must not touch the free queue (SGLang once returned a view)
    assert list(host.free_slots)[:4] == [4, 5, 6, 7]
    host.free(torch.arange(4))
    assert list(host.free_slots)[-4:] == [0, 1, 2, 3]


def test_double_free_raises_and_changes_nothing() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    a = host.alloc(8)
    assert a is not None
    host.free(a[:4])
    before = list(host.free_slots)
    for bad in (a[:4], a, torch.cat([a[4:], a[4:]]), torch.tensor([host.size])):
        with pytest.raises(UsageError):
            host.free(bad)
        assert list(host.free_slots) == before
    assert host.slot_used[int(a[4])]


def test_double_allocation_is_detected() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    a = host.alloc(4)
    assert a is not None
    host.free_slots.extendleft(reversed(a.tolist()))  # corrupt the queue: an allocated page at its head
    with pytest.raises(UsageError, match="double allocation"):
        host.alloc(4)


def test_clear_resets_the_queue() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4))
    host.alloc(8)
    host.clear()
    assert list(host.free_slots) == list(range(host.size))
    assert host.alloc(4) is not None


# --- page helpers ---------------------------------------------------------------------------------------


def _page_slots_by_oracle(
    host: HostKVCache, first: int, buffer: torch.Tensor | None = None
) -> list[torch.Tensor]:
    """Every ``(H, D)`` slot view of the page starting at ``first``, by the seed's dims."""
    return [
        host_slot(host, kv, layer, first + o, buffer)
        for kv in range(host.num_kv)
        for layer in range(host.layer_num)
        for o in range(host.page_size)
    ]


def _bits(t: torch.Tensor) -> list[int]:
    return [int(x) for x in as_bits(t).flatten().tolist()]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("attention", "layout"), LAYOUTS, ids=str)
@settings(max_examples=5, deadline=None)
@given(page=st.integers(0, 8), seed=st.integers(0, 1000))
def test_data_page_round_trip(
    attention: AttentionKind, layout: MemLayout, page_size: int, page: int, seed: int
) -> None:
    _, host = make_pools(make_config(attention, layout, page_size))
    fill_random_(host.kv_buffer, seed)
    first = page * page_size
    flat = host.get_data_page(first)
    assert flat.dim() == 1
    assert flat.numel() == host.get_dummy_flat_data_page().numel()
    view = host.get_data_page(first, flat=False)
    assert_same_bytes(flat, view.flatten(), "flat page vs page view")
    # The page holds exactly this page's slots (the oracle's count of elements and their bits).
    oracle = torch.cat([t.flatten() for t in _page_slots_by_oracle(host, first)])
    assert sorted(_bits(flat)) == sorted(_bits(oracle))
    # Writing a page back changes that page only.
    before = host.kv_buffer.clone()
    new = flat.clone()
    fill_random_(new, seed + 1)
    host.set_from_flat_data_page(first, new)
    assert_same_bytes(host.get_data_page(first), new, "page after set_from_flat_data_page")
    host.set_from_flat_data_page(first, flat)
    assert_same_bytes(host.kv_buffer, before, "buffer after restoring the page")


def test_page_helpers_reject_bad_input() -> None:
    _, host = make_pools(make_config(AttentionKind.MHA, MemLayout.PAGE_HEAD, 4))
    for bad in (2, -4, host.size):
        with pytest.raises(UsageError):
            host.get_data_page(bad)
    with pytest.raises(UsageError):
        host.set_from_flat_data_page(0, torch.zeros(3, dtype=torch.float16))
    with pytest.raises(UsageError):
        host.set_from_flat_data_page(0, host.get_dummy_flat_data_page().float())
    with pytest.raises(UsageError):
        host.get_page_buffer_meta(torch.arange(3))
    with pytest.raises(UsageError):
        host.get_page_buffer_meta(torch.arange(2, 6))


def test_dummy_page_is_zero_and_fresh() -> None:
    _, host = make_pools(make_config(AttentionKind.MLA, MemLayout.LAYER_FIRST, 4))
    a, b = host.get_dummy_flat_data_page(), host.get_dummy_flat_data_page()
    assert not a.any()
    assert a.data_ptr() != b.data_ptr()
    assert a.numel() == 2 * 4 * 12


# --- get_page_buffer_meta (seed §5.8) -------------------------------------------------------------------


def _seed_formula(host: HostKVCache, first: int) -> tuple[list[int], int]:
    """Pointers and element size of one page exactly as seed §5.8 writes them (MHA and MLA)."""
    base, isz, L, size = host.kv_buffer.data_ptr(), host.dtype.itemsize, host.layer_num, host.size
    ps = host.page_size
    if host.num_kv == 2:
        hd = host.head_num * host.head_dim
        v_offset = L * size * hd * isz
        if host.layout is MemLayout.LAYER_FIRST:
            ptrs = []
            for layer in range(L):
                k = base + first * hd * isz + layer * size * hd * isz
                ptrs += [k, k + v_offset]
            return ptrs, isz * ps * hd
        k = base + first * L * hd * isz
        return [k, k + v_offset], L * isz * ps * hd
    kv_dim = host.head_dim
    if host.layout is MemLayout.LAYER_FIRST:
        return [
            base + first * kv_dim * isz + layer * size * kv_dim * isz for layer in range(L)
        ], isz * ps * kv_dim
    return [base + first * L * kv_dim * isz], L * isz * ps * kv_dim


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("attention", "layout"), LAYOUTS, ids=str)
@settings(max_examples=3, deadline=None)
@given(data=st.data())
def test_page_buffer_meta_addresses_exactly_the_pages(
    attention: AttentionKind, layout: MemLayout, page_size: int, dtype: str, data: st.DataObject
) -> None:
    _, host = make_pools(make_config(attention, layout, page_size, dtype))
    fill_random_(host.kv_buffer, data.draw(st.integers(0, 1000), label="seed"))
    pages = data.draw(
        st.lists(st.integers(0, host.page_num - 1), min_size=1, max_size=3, unique=True), label="pages"
    )
    indices = page_slots(pages, page_size)
    ptrs, sizes = host.get_page_buffer_meta(indices)
    per_page = len(ptrs) // len(pages)
    expected_ptrs: list[int] = []
    for p in pages:
        page_ptrs, size = _seed_formula(host, p * page_size)
        expected_ptrs += page_ptrs
        assert set(sizes[: len(page_ptrs)]) == {size}
    assert ptrs == expected_ptrs
    # Read through the pointers: the segments of a page are its bytes, nothing else.
    for i, p in enumerate(pages):
        segs = sorted(
            zip(
                ptrs[i * per_page : (i + 1) * per_page], sizes[i * per_page : (i + 1) * per_page], strict=True
            )
        )
        got = b"".join(ctypes.string_at(ptr, n) for ptr, n in segs)
        want = host.get_data_page(p * page_size)
        assert got == bytes(want.view(torch.uint8).numpy()), (
            f"page {p}: bytes read through the pointers differ"
        )
    # Write through the pointers: exactly the named pages change.
    before = host.kv_buffer.clone()
    for ptr, n in zip(ptrs, sizes, strict=True):
        ctypes.memset(ptr, 0xA5, n)
    expected = before.clone()
    for p in pages:
        for t in _page_slots_by_oracle(host, p * page_size, expected):
            t.view(torch.uint8).fill_(0xA5)
    assert_same_bytes(host.kv_buffer, expected, "host pool after writing through the pointers")
