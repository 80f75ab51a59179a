"""Every row of seed §5.4 × page size × dtype: backup then per-layer load moves exactly the named slots.

Each example fills both pools with random bits, backs up random device pages to random host pages (the
index pairs in a random order), then loads them per layer into other random device pages; after each
call the whole destination buffer must equal the oracle's prediction, so named slots carry the source
bits and every other byte is untouched.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import dataclasses
import faulthandler
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from refcache.config import AttentionKind, ConfigRewriteWarning, IOBackend, MemLayout
from refcache.errors import ConfigError, UsageError
from refcache.gpu import HostKVCache, KVCache, native, transfer
from refcache.gpu.layout import KVView
from refcache.gpu.memory import as_bits
from refcache.gpu.transfer import ByteRuns, RowCopy, TransferPlan, plan_transfer, run_transfer

from .gpu_helpers import (
    DEVICE_PAGES,
    ROWS,
    assert_same_bytes,
    backup_and_check,
    device_slot,
    expected_after_backup,
    fill_random_,
    host_slot,
    load_and_check,
    make_config,
    make_pools,
    page_slots,
)

PAGE_SIZES = [1, 4, 16]
DTYPES = ["float16", "bfloat16", "float32"]
DIRECT_ROWS = [row for row in ROWS if row[2] is IOBackend.DIRECT]


def _no_native() -> None:
    """``transfer.native_transfer`` without the C path (``REFCACHE_NATIVE=off``, or no compiler)."""


# The direct plans' three ways to the runs between CPU pools: csrc/transfer.c ("native"), and without it up
# to transfer.PY_RUNS runs finished on lists ("python") and beyond that with numpy ("numpy": PY_RUNS 0).
RUN_TAILS: dict[str, dict[str, object]] = {
    "native": {},
    "python": {"native_transfer": _no_native},
    "numpy": {"native_transfer": _no_native, "PY_RUNS": 0},
}


def _require_native() -> transfer.NativeTransfer:
    """The C path; skips where it cannot build (``REFCACHE_NATIVE=auto`` without a compiler; CI requires
    it, and ``native_transfer`` raises there instead)."""
    fast = transfer.native_transfer()
    if fast is None:
        pytest.skip(f"no C path: {native.why_not('transfer')}")
    return fast


@contextlib.contextmanager
def _run_limits(tail: str) -> Iterator[None]:
    """The limits of ``RUN_TAILS[tail]`` set in ``transfer`` meanwhile."""
    if tail == "native":
        _require_native()
    with contextlib.ExitStack() as stack:
        for name, limit in RUN_TAILS[tail].items():
            stack.enter_context(mock.patch.object(transfer, name, limit))
        yield


@pytest.fixture
def python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The direct backend between CPU pools without the C path: byte runs, progressions or rows."""
    monkeypatch.setattr(transfer, "native_transfer", _no_native)


def _draw_slots(data: st.DataObject, n: int, pages: int, page_size: int, label: str) -> torch.Tensor:
    chosen = data.draw(st.permutations(range(pages)), label=f"{label} pages")[:n]
    return page_slots(chosen, page_size)


def _draw_order(data: st.DataObject, n: int) -> torch.Tensor:
    # Pair order is arbitrary in the caller; shuffling both arrays alike must not change the result.
    return torch.tensor(data.draw(st.permutations(range(n)), label="pair order"), dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), ROWS, ids=lambda v: str(v))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_backup_then_load_restores_bytes(
    attention: AttentionKind,
    layout: MemLayout,
    io_backend: IOBackend,
    page_size: int,
    dtype: str,
    data: st.DataObject,
) -> None:
    config = make_config(attention, layout, page_size, dtype, io_backend)
    device, host = make_pools(config)
    seed = data.draw(st.integers(0, 2**31), label="seed")
    fill_random_(device.kv_buffer, seed)
    fill_random_(host.kv_buffer, seed + 1)
    n = data.draw(st.integers(1, 3), label="pages")
    h = _draw_slots(data, n, host.page_num, page_size, "host")
    d = _draw_slots(data, n, DEVICE_PAGES, page_size, "device")
    order = _draw_order(data, n * page_size)
    backup_and_check(host, device, h[order], d[order], io_backend)
    fill_random_(device.kv_buffer, seed + 2)
    d = _draw_slots(data, n, DEVICE_PAGES, page_size, "load device")
    order = _draw_order(data, n * page_size)
    load_and_check(host, device, h[order], d[order], io_backend)


@pytest.mark.parametrize(("attention", "layout", "io_backend"), ROWS[:2] + ROWS[3:5], ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_round_trip(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, dtype: str
) -> None:
    config = make_config(attention, layout, 4, dtype, io_backend)
    device, host = make_pools(config)
    fill_random_(device.kv_buffer, 7)
    h, d = page_slots([5, 1], 4), page_slots([3, 0], 4)
    backup_and_check(host, device, h, d, io_backend)
    load_and_check(host, device, h, page_slots([1, 2], 4), io_backend)


def test_byte_check_detects_a_wrong_permutation() -> None:
    """The oracle comparison is not vacuous: pairing host slots with the wrong device slots fails."""
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, "float16", IOBackend.DIRECT)
    device, host = make_pools(config)
    fill_random_(device.kv_buffer, 3)
    h, d = page_slots([0, 1], 4), page_slots([2, 3], 4)
    expected = host.kv_buffer.clone()
    for i, j in zip(h.tolist(), d.tolist(), strict=True):
        for layer in range(2):
            for kv in range(2):
                host_slot(host, kv, layer, i, expected).copy_(device_slot(device, kv, layer, j))
    host.backup_from_device_all_layer(device, h, d.flip(0), IOBackend.DIRECT)  # the bug: a reversed pairing
    with pytest.raises(AssertionError, match="elements differ"):
        assert_same_bytes(host.kv_buffer, expected, "host pool")


def test_byte_check_detects_an_untouched_page_written() -> None:
    config = make_config(AttentionKind.MLA, MemLayout.PAGE_FIRST, 4, "bfloat16")
    device, host = make_pools(config)
    before = host.kv_buffer.clone()
    fill_random_(device.kv_buffer, 5)
    host.backup_from_device_all_layer(device, page_slots([2], 4), page_slots([1], 4), IOBackend.KERNEL)
    with pytest.raises(AssertionError):
        assert_same_bytes(host.kv_buffer, before, "host pool")


# --- the dispatch table's edges -------------------------------------------------------------------------

UNSUPPORTED = [
    (AttentionKind.MHA, MemLayout.PAGE_FIRST, IOBackend.DIRECT),
    (AttentionKind.MHA, MemLayout.PAGE_FIRST_DIRECT, IOBackend.KERNEL),
    (AttentionKind.MHA, MemLayout.PAGE_HEAD, IOBackend.DIRECT),
    (AttentionKind.MLA, MemLayout.PAGE_FIRST, IOBackend.DIRECT),
    (AttentionKind.MLA, MemLayout.PAGE_FIRST_DIRECT, IOBackend.KERNEL),
]


@pytest.mark.parametrize(("attention", "layout", "io_backend"), UNSUPPORTED, ids=lambda v: str(v))
def test_unsupported_combination_raises(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend
) -> None:
    device, host = make_pools(make_config(attention, layout, 4))
    idx = page_slots([0], 4)
    other = IOBackend.KERNEL if io_backend is IOBackend.DIRECT else IOBackend.DIRECT
    host.load_to_device_per_layer(device, idx, idx, 0, other)  # the pool's checked backend is now other
    with pytest.raises(ConfigError, match="not supported"):
        host.load_to_device_per_layer(device, idx, idx, 0, io_backend)
    with pytest.raises(ConfigError, match="not supported"):
        host.backup_from_device_all_layer(device, idx, idx, io_backend)
    with pytest.raises(ConfigError, match="not supported"):  # the same indices: a plan to reuse
        host.load_to_device_per_layer(device, idx, idx, 0, io_backend.value)


def test_unknown_io_backend_raises() -> None:
    device, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 1))
    idx = torch.tensor([0])
    host.load_to_device_per_layer(device, idx, idx, 0, "direct")
    with pytest.raises(ConfigError, match="kernel_ascend"):  # after a checked backend, with a plan to reuse
        host.load_to_device_per_layer(device, idx, idx, 0, "kernel_ascend")


@pytest.mark.parametrize(
    ("layout", "io_backend", "want_layout", "want_io"),
    [
        (MemLayout.PAGE_FIRST, IOBackend.DIRECT, MemLayout.PAGE_FIRST_DIRECT, IOBackend.DIRECT),
        (MemLayout.PAGE_FIRST_DIRECT, IOBackend.KERNEL, MemLayout.PAGE_FIRST_DIRECT, IOBackend.DIRECT),
    ],
)
def test_rewrites_warn_and_the_host_pool_follows_them(
    layout: MemLayout, io_backend: IOBackend, want_layout: MemLayout, want_io: IOBackend
) -> None:
    config = make_config(AttentionKind.MHA, layout, 4, io_backend=io_backend)
    with pytest.warns(ConfigRewriteWarning):
        _device, host = make_pools(config)
    assert host.layout is want_layout
    assert host.config.hicache_io_backend is want_io


def test_fa3_decode_backend_rewrites_kernel_to_direct() -> None:
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, decode_attention_backend="fa3")
    with pytest.warns(ConfigRewriteWarning, match="FlashAttention3"):
        _, host = make_pools(config)
    assert host.config.hicache_io_backend is IOBackend.DIRECT


def test_page_head_is_mha_only() -> None:
    with pytest.raises(ConfigError, match="page_head"):
        make_pools(make_config(AttentionKind.MLA, MemLayout.PAGE_HEAD, 4))


# --- index validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", RUN_TAILS)
@pytest.mark.parametrize("io_backend", [IOBackend.KERNEL, IOBackend.DIRECT])
def test_bad_indices_raise_and_change_nothing(
    io_backend: IOBackend, tail: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if tail == "native":
        _require_native()
    for name, limit in RUN_TAILS[tail].items():
        monkeypatch.setattr(transfer, name, limit)
    device, host = make_pools(make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 1, io_backend=io_backend))
    fill_random_(device.kv_buffer, 1)
    before = host.kv_buffer.clone()
    cases = [
        (torch.tensor([0, 1]), torch.tensor([0])),  # lengths differ
        (torch.tensor([host.size]), torch.tensor([0])),  # host slot out of range
        (torch.tensor([0]), torch.tensor([-1])),  # device slot out of range
        # one run of consecutive slots (the single-run plan checks its ends) past either end of a pool
        (torch.tensor([host.size - 1, host.size]), torch.tensor([0, 1])),
        (torch.tensor([0, 1, 2]), torch.tensor([-1, 0, 1])),
        (torch.tensor([3, 3]), torch.tensor([0, 1])),  # a destination slot twice
        (torch.tensor([[0]]), torch.tensor([[0]])),  # not 1-D
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for h, d in cases:
            with pytest.raises(UsageError):
                host.backup_from_device_all_layer(device, h, d, io_backend)
    assert_same_bytes(host.kv_buffer, before, "host pool after rejected backups")
    with pytest.raises(UsageError):
        host.load_to_device_per_layer(device, torch.tensor([0]), torch.tensor([0]), 2, io_backend)


def test_empty_transfer_is_a_no_op() -> None:
    device, host = make_pools(make_config(AttentionKind.MHA, MemLayout.PAGE_HEAD, 4))
    fill_random_(device.kv_buffer, 1)
    empty = torch.zeros(0, dtype=torch.int64)
    host.backup_from_device_all_layer(device, empty, empty, IOBackend.KERNEL)
    assert not host.kv_buffer.any()


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize(("attention", "layout", "io_backend"), ROWS, ids=lambda v: str(v))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_arbitrary_token_slots(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int, data: st.DataObject
) -> None:
    """Transfers are defined for any distinct slots, not only whole aligned pages: runs that start or
    end inside a page, cross page boundaries, or repeat a source slot."""
    _check_arbitrary_slots(attention, layout, io_backend, page_size, data)


def _layers(layer_num: int | None) -> dict[str, object]:
    """``make_config``'s extra arguments for ``layer_num`` layers (None: its default of 2). One layer makes a
    ``page_first_direct`` MLA host pool token-major with pages of several tokens (page stride = page size
    × token stride)."""
    return {} if layer_num is None else {"layer_num": layer_num}


def _check_arbitrary_slots(
    attention: AttentionKind,
    layout: MemLayout,
    io_backend: IOBackend,
    page_size: int,
    data: st.DataObject,
    layer_num: int | None = None,
) -> None:
    config = make_config(attention, layout, page_size, "float16", io_backend, **_layers(layer_num))
    device, host = make_pools(config)
    fill_random_(device.kv_buffer, 11)
    n = data.draw(st.integers(1, DEVICE_PAGES * page_size), label="tokens")
    slots = st.lists(st.integers(0, host.size - 1), min_size=n, max_size=n, unique=True)
    h = torch.tensor(data.draw(slots, label="host slots"))
    d = torch.tensor(data.draw(st.permutations(range(device.size)), label="device slots")[:n])
    backup_and_check(host, device, h, d, io_backend)
    # A load may read one host slot into several device slots.
    h = torch.tensor(
        data.draw(st.lists(st.sampled_from(h.tolist()), min_size=n, max_size=n), label="load host")
    )
    load_and_check(host, device, h, d, io_backend)


@pytest.mark.parametrize("io_backend", [IOBackend.KERNEL, IOBackend.DIRECT])
def test_a_plan_is_reused_only_for_the_same_unchanged_indices(io_backend: IOBackend) -> None:
    """The per-layer calls of one load share their index work; changed indices or pools must not."""
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, io_backend=io_backend)
    device, host = make_pools(config)
    fill_random_(host.kv_buffer, 1)
    h, d = page_slots([2], 4), page_slots([0], 4)
    host.load_to_device_per_layer(device, h, d, 0, io_backend)
    d[:] = page_slots([3], 4)  # modified in place between two layers
    host.load_to_device_per_layer(device, h, d, 1, io_backend)
    assert_same_bytes(device.kv_buffer[:, 1, d], host.kv_buffer[:, 1, h], "layer 1 at the new slots")
    assert not device.kv_buffer[:, 1, page_slots([0], 4)].any()
    other, _ = make_pools(config)
    host.load_to_device_per_layer(other, h, d, 0, io_backend)  # same tensors, another device pool
    assert_same_bytes(other.kv_buffer[:, 0, d], host.kv_buffer[:, 0, h], "the other pool")


def test_a_plan_is_not_reused_across_directions_or_a_replaced_host_buffer() -> None:
    """_plan's inline reuse check compares the pools' kv_buffer objects themselves: a backup's plan is not
    a load's, and a host pool whose buffer was replaced gets a new plan."""
    config = make_config(AttentionKind.MHA, MemLayout.LAYER_FIRST, 4, io_backend=IOBackend.DIRECT)
    device, host = make_pools(config)
    fill_random_(device.kv_buffer, 1)
    h, d = page_slots([2], 4), page_slots([0], 4)
    host.backup_from_device_all_layer(device, h, d, IOBackend.DIRECT)
    device.kv_buffer.zero_()
    host.load_to_device_per_layer(device, h, d, 0, IOBackend.DIRECT)  # same tensors, the other direction
    assert_same_bytes(device.kv_buffer[:, 0, d], host.kv_buffer[:, 0, h], "the load after a backup")
    assert device.kv_buffer[:, 0, d].any()
    host.kv_buffer = host.kv_buffer.clone()
    host.kv_buffer[:, 1, h] = 0
    host.load_to_device_per_layer(device, h, d, 1, IOBackend.DIRECT)  # same tensors, a new host buffer
    assert not device.kv_buffer[:, 1, d].any()


# --- the two mechanisms of the direct backend --------------------------------------------------------------

CPU_ONLY = pytest.mark.skipif(
    torch.cuda.is_available(), reason="the byte-run path needs both pools on the CPU"
)


def _backup_plan(host: HostKVCache, device: KVCache, h: torch.Tensor, d: torch.Tensor) -> TransferPlan:
    return plan_transfer(device.kv_view(), host.kv_view(), h, d, IOBackend.DIRECT, host_is_src=False)


@CPU_ONLY
@pytest.mark.usefixtures("python_path")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_cpu_direct_plans_copy_byte_runs(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int
) -> None:
    """Between two CPU pools every direct row plans byte runs (one per scattered page), so the round-trip
    tests above exercise that path for every layout, attention and page size."""
    device, host = make_pools(make_config(attention, layout, page_size, "bfloat16", io_backend))
    h, d = page_slots([4, 1, 7], page_size), page_slots([2, 0, 3], page_size)
    plan = _backup_plan(host, device, h, d)
    assert plan.byte_runs is not None and plan.runs == ()
    token_bytes = host.head_num * host.head_dim * host.kv_buffer.element_size()
    assert plan.byte_runs.nbytes == (page_size * token_bytes,) * 3
    assert list(plan.byte_runs.src_offsets) == sorted(plan.byte_runs.src_offsets)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_the_copy_path_of_the_direct_backend(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int
) -> None:
    """The ``copy_`` path (the one a GPU side takes) kept correct on the CPU by switching byte runs off:
    scattered pages in a shuffled pair order, and unaligned slots that cross pages."""
    device, host = make_pools(make_config(attention, layout, page_size, "float16", io_backend))
    fill_random_(device.kv_buffer, 21)
    fill_random_(host.kv_buffer, 22)
    gen = torch.Generator().manual_seed(page_size)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transfer, "byte_runs_eligible", lambda src, dst: False)
        h, d = page_slots([4, 1, 7], page_size), page_slots([2, 0, 3], page_size)
        assert _backup_plan(host, device, h, d).runs != ()
        order = torch.randperm(h.numel(), generator=gen)
        backup_and_check(host, device, h[order], d[order], io_backend)
        fill_random_(device.kv_buffer, 23)
        load_and_check(host, device, h[order], page_slots([3, 0, 1], page_size)[order], io_backend)
        n = min(5, device.size)
        h, d = torch.arange(1, n + 1), (torch.arange(n) + 2) % device.size  # unaligned, crossing pages
        backup_and_check(host, device, h, d, io_backend)
        load_and_check(host, device, h, d, io_backend)


@CPU_ONLY
@pytest.mark.usefixtures("python_path")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_a_wrong_byte_offset_is_caught(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int
) -> None:
    """The byte checks are not vacuous for the byte-run path: a plan whose first run reads one token too
    far into the device pool (still inside the buffer) writes bytes the oracle rejects."""
    device, host = make_pools(make_config(attention, layout, page_size, "float16", io_backend))
    fill_random_(device.kv_buffer, 31)
    fill_random_(host.kv_buffer, 32)
    h, d = page_slots([4, 1, 7], page_size), page_slots([2, 0, 3], page_size)
    expected = expected_after_backup(host, device, h, d)
    plan = _backup_plan(host, device, h, d)
    runs = plan.byte_runs
    assert runs is not None
    token_bytes = device.head_num * device.head_dim * device.kv_buffer.element_size()
    shifted = (runs.src_offsets[0] + token_bytes, *runs.src_offsets[1:])  # the bug: one token off
    bad = dataclasses.replace(plan, byte_runs=ByteRuns(shifted, runs.dst_offsets, runs.nbytes))
    run_transfer(bad, range(host.layer_num), range(host.layer_num))
    with pytest.raises(AssertionError, match="elements differ"):
        assert_same_bytes(host.kv_buffer, expected, "host pool after a backup with a wrong offset")
    run_transfer(plan, range(host.layer_num), range(host.layer_num))
    assert_same_bytes(host.kv_buffer, expected, "host pool after the correct plan")


@CPU_ONLY
@pytest.mark.usefixtures("python_path")
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_evenly_spaced_pages_copy_as_one_progression(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int
) -> None:
    """Runs evenly spaced on both sides (as consecutive allocations give) become one strided copy; the
    bytes match the oracle both ways, and a progression one token too narrow writes bytes it rejects."""
    device, host = make_pools(make_config(attention, layout, page_size, "float16", io_backend))
    fill_random_(device.kv_buffer, 41)
    fill_random_(host.kv_buffer, 42)
    h, d = page_slots([0, 2, 4, 6], page_size), page_slots([0, 1, 2, 3], page_size)
    plan = _backup_plan(host, device, h, d)
    runs = plan.byte_runs
    assert runs is not None and runs.nbytes == ()
    [(s, t, n, count, s_step, t_step)] = runs.progressions
    token_bytes = host.head_num * host.head_dim * host.kv_buffer.element_size()
    assert (count, n, s_step) == (4, page_size * token_bytes, page_size * token_bytes)  # device pages 0..3
    expected, before = expected_after_backup(host, device, h, d), host.kv_buffer.clone()
    wide = dataclasses.replace(runs, progressions=((s, t, n, count, s_step, t_step - token_bytes),))
    run_transfer(dataclasses.replace(plan, byte_runs=wide), range(host.layer_num), range(host.layer_num))
    with pytest.raises(AssertionError, match="elements differ"):
        assert_same_bytes(host.kv_buffer, expected, "host pool after a progression one token too narrow")
    host.kv_buffer.copy_(before)
    run_transfer(plan, range(host.layer_num), range(host.layer_num))
    assert_same_bytes(host.kv_buffer, expected, "host pool after the backup")
    fill_random_(device.kv_buffer, 43)
    load_and_check(host, device, h, d, io_backend)


@CPU_ONLY
@pytest.mark.usefixtures("python_path")
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_byte_runs_outside_a_pool_are_rejected_before_any_copy(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend
) -> None:
    """A plan cannot hold a run that would reach outside either buffer at any K/V and layer, so a bug in
    the plan is caught before a transfer copies anything rather than stopping it halfway."""
    device, host = make_pools(make_config(attention, layout, 4, "float16", io_backend))
    plan = _backup_plan(host, device, page_slots([1], 4), page_slots([3], 4))
    runs = plan.byte_runs
    assert runs is not None
    last_layer = (host.layer_num - 1) * host.kv_view().layer_stride * host.kv_buffer.element_size()
    extent = host.kv_buffer.numel() * host.kv_buffer.element_size()
    for offset in (-1, extent - runs.nbytes[0] - last_layer + 1, extent):
        bad = ByteRuns(runs.src_offsets, (offset,), runs.nbytes)
        with pytest.raises(AssertionError, match="invariant byte runs in bounds"):
            dataclasses.replace(plan, byte_runs=bad)
    for progression in ((0, 0, 2, 2, 0, 2), (0, 0, 2, 2, 2, -2), (0, 0, 1, 2, 2, 2), (0, extent, 2, 1, 2, 2)):
        bad = ByteRuns((), (), (), (progression,))
        with pytest.raises(AssertionError, match="invariant byte runs in bounds"):
            dataclasses.replace(plan, byte_runs=bad)
    with pytest.raises(UsageError, match="out of range"):  # a reversed range would pass a start/stop check
        run_transfer(plan, range(1, -1, -1), range(1, -1, -1))
    # Runs of two widths: the highest offset plus the widest run passes the end, the exact ends do not.
    view = host.kv_view()
    limit = extent - ((view.num_kv - 1) * view.kv_stride + (view.layer_num - 1) * view.layer_stride) * 2
    wide, narrow = 2 * runs.nbytes[0], runs.nbytes[0]
    fits = ByteRuns((0, 0), (0, limit - narrow), (wide, narrow))
    assert dataclasses.replace(plan, byte_runs=fits).byte_runs is fits
    with pytest.raises(AssertionError, match="invariant byte runs in bounds"):
        dataclasses.replace(plan, byte_runs=ByteRuns((0, 0), (limit - wide + 2, 0), (wide, narrow)))


@CPU_ONLY
@pytest.mark.usefixtures("python_path")
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_a_broken_plan_cannot_write_outside_a_pool(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend
) -> None:
    """The byte-run copy is bounded by itself: with the plan's invariant bypassed, a run past the end of
    the host pool raises instead of writing the memory behind it (here: a guard region of the same
    allocation, filled with a pattern)."""
    device, host = make_pools(make_config(attention, layout, 4, "float16", io_backend))
    fill_random_(device.kv_buffer, 51)
    numel = host.kv_buffer.numel()
    backing = torch.full((numel + 4096,), 7, dtype=host.kv_buffer.dtype)
    guarded = dataclasses.replace(host.kv_view(), buffer=backing[:numel].view(host.kv_buffer.shape))
    plan = plan_transfer(device.kv_view(), guarded, page_slots([1], 4), page_slots([3], 4), io_backend, False)
    runs = plan.byte_runs
    assert runs is not None
    extent = numel * host.kv_buffer.element_size()
    broken = copy.copy(plan)  # a plan that skipped __post_init__'s check
    object.__setattr__(broken, "byte_runs", ByteRuns(runs.src_offsets, (extent - 2,), runs.nbytes))
    with pytest.raises(ValueError, match="memoryview assignment"):
        run_transfer(broken, range(host.layer_num), range(host.layer_num))
    assert bool((backing[numel:] == 7).all()), "a run wrote past the end of the host pool"
    run_transfer(plan, range(host.layer_num), range(host.layer_num))
    assert bool((backing[numel:] == 7).all())


def _sglang_runs(
    src: KVView, dst: KVView, src_slots: list[int], dst_slots: list[int], host_is_src: bool
) -> list[tuple[int, int, int]]:
    """Seed §5.4 ① literally, as a reference: sort the pairs by host slot, then cut maximal runs of pairs
    consecutive on both sides and inside a page of a paged side; runs as (source byte, destination
    byte, bytes)."""
    isz = src.buffer.element_size()
    pairs = sorted(zip(src_slots, dst_slots, strict=True), key=lambda p: p[0] if host_is_src else p[1])
    runs: list[list[int]] = []  # [first src slot, first dst slot, length]
    for s, d in pairs:
        if runs:
            last = runs[-1]
            inside = all(view.token_major or slot % view.page_size for view, slot in ((src, s), (dst, d)))
            if s == last[0] + last[2] and d == last[1] + last[2] and inside:
                last[2] += 1
                continue
        runs.append([s, d, 1])
    return [
        (src.offset(0, 0, s) * isz, dst.offset(0, 0, d) * isz, n * src.item_numel * isz) for s, d, n in runs
    ]


def _planned_runs(plan: TransferPlan) -> list[tuple[int, int, int]]:
    """A CPU direct plan's copies as (source byte, destination byte, bytes), progressions expanded, in the
    plan's order."""
    if plan.native_runs is not None:
        return plan.native_runs.triples()
    runs = plan.byte_runs
    assert runs is not None
    singles = list(zip(runs.src_offsets, runs.dst_offsets, runs.nbytes, strict=True))
    for s, d, n, count, s_step, d_step in runs.progressions:
        singles += [(s + i * s_step, d + i * d_step, n) for i in range(count)]
    return singles


# (page size, layer count): one layer makes the page_first_direct MLA host pool token-major with pages of 4
SIZES_AND_LAYERS = [(1, None), (4, None), (16, None), (4, 1)]


@CPU_ONLY
@pytest.mark.parametrize("tail", RUN_TAILS)
@pytest.mark.parametrize(("page_size", "layer_num"), SIZES_AND_LAYERS)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_planned_runs_are_the_runs_of_sorting_every_slot(
    attention: AttentionKind,
    layout: MemLayout,
    io_backend: IOBackend,
    page_size: int,
    layer_num: int | None,
    tail: str,
    data: st.DataObject,
) -> None:
    """Cutting runs in pair order and then sorting and merging the runs gives exactly the runs SGLang's
    ``move_indices`` gets by sorting every slot first (seed §5.4 ①), for pages drawn in any order and
    pairs shuffled down to single tokens: the same copies, in host address order; with the runs cut on
    the slots and split at pages in Python, and cut with page keys and finished in Python or numpy."""
    with _run_limits(tail):
        _check_planned_runs(attention, layout, io_backend, page_size, data, layer_num)


def _check_planned_runs(
    attention: AttentionKind,
    layout: MemLayout,
    io_backend: IOBackend,
    page_size: int,
    data: st.DataObject,
    layer_num: int | None = None,
) -> None:
    config = make_config(attention, layout, page_size, "float16", io_backend, **_layers(layer_num))
    device, host = make_pools(config)
    n = data.draw(st.integers(1, DEVICE_PAGES), label="pages")
    h = _draw_slots(data, n, host.page_num, page_size, "host")
    d = _draw_slots(data, n, DEVICE_PAGES, page_size, "device")
    if data.draw(st.booleans(), label="consecutive pages"):
        h, d = page_slots(list(range(2, 2 + n)), page_size), page_slots(list(range(n)), page_size)
        # from any slot of a page on: runs that begin and end inside a page
        h = h + data.draw(st.integers(0, page_size - 1), label="host shift")
        d = d + data.draw(st.integers(0, page_size - 1 if n < DEVICE_PAGES else 0), label="device shift")
        keep = data.draw(st.integers(1, len(h)), label="slots kept")
        h, d = h[:keep], d[:keep]
    order = _draw_order(data, len(h)) if data.draw(st.booleans(), label="shuffled") else slice(None)
    h, d = h[order], d[order]
    host_is_src = data.draw(st.booleans(), label="load")
    src, dst = (host.kv_view(), device.kv_view()) if host_is_src else (device.kv_view(), host.kv_view())
    src_slots, dst_slots = (h, d) if host_is_src else (d, h)
    plan = plan_transfer(src, dst, h, d, io_backend, host_is_src)
    expected = _sglang_runs(src, dst, src_slots.tolist(), dst_slots.tolist(), host_is_src)
    planned = _planned_runs(plan)
    assert sorted(planned) == sorted(expected)
    if plan.native_runs is not None:
        host_offsets = [run[0 if host_is_src else 1] for run in planned]
    else:
        assert plan.byte_runs is not None
        host_offsets = list(plan.byte_runs.src_offsets if host_is_src else plan.byte_runs.dst_offsets)
    assert host_offsets == sorted(host_offsets), "single runs are not in host address order"


@CPU_ONLY
@pytest.mark.parametrize("tail", RUN_TAILS)
@pytest.mark.parametrize("page_sizes", [(4, 4), (4, 2), (2, 4)])
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_runs_between_two_paged_pools(page_sizes: tuple[int, int], tail: str, data: st.DataObject) -> None:
    """Between two page_first_direct pools (no pool pair of a transfer has that, the device pool is
    token-major, but the plan allows it) a run is cut at the page boundaries of both sides, whether the
    pages line up (same size, same phase), are shifted against each other or differ in size: the runs
    of the literal reference, for consecutive slots from any start and shuffled pairs."""
    with _run_limits(tail):
        _check_paged_pools(page_sizes, data)


def _check_paged_pools(page_sizes: tuple[int, int], data: st.DataObject) -> None:
    a, b = (
        make_pools(
            make_config(AttentionKind.MLA, MemLayout.PAGE_FIRST_DIRECT, ps, "float16", IOBackend.DIRECT)
        )[1]
        for ps in page_sizes
    )
    n = data.draw(st.integers(1, 3 * max(page_sizes)), label="slots")
    s0 = data.draw(st.integers(0, a.size - n), label="source start")
    d0 = data.draw(st.integers(0, b.size - n), label="destination start")
    src_slots, dst_slots = torch.arange(s0, s0 + n), torch.arange(d0, d0 + n)
    if data.draw(st.booleans(), label="shuffled"):
        order = _draw_order(data, n)
        src_slots, dst_slots = src_slots[order], dst_slots[order]
    plan = plan_transfer(a.kv_view(), b.kv_view(), src_slots, dst_slots, IOBackend.DIRECT, True)
    expected = _sglang_runs(a.kv_view(), b.kv_view(), src_slots.tolist(), dst_slots.tolist(), True)
    assert sorted(_planned_runs(plan)) == sorted(expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the kernel runs natively")
def test_kernel_backend_without_cuda_or_interpreter_is_a_clean_error() -> None:
    """``triton.jit`` fixes compile-or-interpret at import, so this needs a fresh interpreter."""
    code = (
        "import torch\n"
        "from refcache.config import HiCacheConfig\n"
        "from refcache.errors import UnsupportedError\n"
        "from refcache.gpu import device_pool_from_config, host_pool_from_config\n"
        "c = HiCacheConfig()\n"
        "d = device_pool_from_config(c); h = host_pool_from_config(d, c)\n"
        "try:\n"
        "    h.load_to_device_per_layer(d, torch.tensor([0]), torch.tensor([0]), 0, 'kernel')\n"
        "except UnsupportedError as e:\n"
        "    print('UnsupportedError', e)\n"
        "h.load_to_device_per_layer(d, torch.tensor([0]), torch.tensor([0]), 0, 'direct')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "UnsupportedError" in out.stdout
    assert "direct" in out.stdout


@CPU_ONLY
@pytest.mark.usefixtures("python_path")
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_many_short_runs_copy_rows(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend
) -> None:
    """Scattered single tokens of a small KV (at least ``ROW_COPY_MIN_RUNS`` runs of a few bytes) plan a
    ``RowCopy``: a backup and the per-layer loads move exactly the named slots (pairs in a random order);
    a row one slot off writes bytes the oracle rejects; rows outside a pool are rejected when the plan is
    built."""
    config = dataclasses.replace(make_config(attention, layout, 1, "float16", io_backend), device_size=64)
    device, host = make_pools(config)
    fill_random_(device.kv_buffer, 61)
    fill_random_(host.kv_buffer, 62)
    gen = torch.Generator().manual_seed(7)
    n = 2 * transfer.ROW_COPY_MIN_RUNS
    h, d = torch.randperm(host.size, generator=gen)[:n], torch.randperm(device.size, generator=gen)[:n]
    plan = _backup_plan(host, device, h, d)
    assert plan.rows is not None and plan.byte_runs is None
    layers = range(host.layer_num)
    expected, before = expected_after_backup(host, device, h, d), host.kv_buffer.clone()
    shifted = plan.rows.src_rows.copy()
    shifted[0] += 1  # the bug: the first pair reads the next device slot
    run_transfer(dataclasses.replace(plan, rows=RowCopy(shifted, plan.rows.dst_rows)), layers, layers)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_same_bytes(host.kv_buffer, expected, "host pool after a backup with a wrong row")
    host.kv_buffer.copy_(before)
    backup_and_check(host, device, h, d, io_backend)
    fill_random_(device.kv_buffer, 63)
    load_and_check(host, device, h, torch.randperm(device.size, generator=gen)[:n], io_backend)
    view = host.kv_view()
    limit = view.extent // (view.item_numel * host.kv_buffer.element_size())
    for wrong in (-1, limit):
        rows = plan.rows.dst_rows.copy()
        rows[-1] = wrong
        with pytest.raises(AssertionError, match="invariant rows in bounds"):
            dataclasses.replace(plan, rows=RowCopy(plan.rows.src_rows, rows))


# --- the C path between CPU pools (csrc/transfer.c) against the Python one ------------------------------------


@CPU_ONLY
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_cpu_direct_plans_are_native(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, page_size: int
) -> None:
    """With the C path every direct row between CPU pools plans ``NativeRuns`` (one per scattered page, in
    host address order), so the round-trip tests above exercise its plan and copy."""
    _require_native()
    device, host = make_pools(make_config(attention, layout, page_size, "bfloat16", io_backend))
    h, d = page_slots([4, 1, 7], page_size), page_slots([2, 0, 3], page_size)
    plan = _backup_plan(host, device, h, d)
    assert plan.native_runs is not None and plan.byte_runs is None and plan.rows is None and plan.runs == ()
    token_bytes = host.head_num * host.head_dim * host.kv_buffer.element_size()
    runs = plan.native_runs.triples()
    assert [n for _, _, n in runs] == [page_size * token_bytes] * 3
    assert [d for _, d, _ in runs] == sorted(d for _, d, _ in runs)


@CPU_ONLY
@pytest.mark.parametrize("path", ["python", "streamed"])
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_arbitrary_token_slots_on_each_cpu_path(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, path: str, data: st.DataObject
) -> None:
    """``test_arbitrary_token_slots`` for the direct rows without the C path ("python": byte runs and
    rows), and with every run of the C copy streamed ("streamed": unaligned heads, 64-byte blocks and
    tails; MLA rows of 24 bytes start anywhere in a 16-byte line)."""
    if path == "python":
        fast = None
    else:
        _require_native()
        fast = _streaming_everywhere()
    with mock.patch.object(transfer, "native_transfer", return_value=fast):
        test_arbitrary_token_slots.hypothesis.inner_test(attention, layout, io_backend, 4, data)


@CPU_ONLY
@pytest.mark.parametrize("tail", RUN_TAILS)
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_arbitrary_token_slots_of_one_layer(
    attention: AttentionKind, layout: MemLayout, io_backend: IOBackend, tail: str, data: st.DataObject
) -> None:
    """``test_arbitrary_token_slots`` with one layer and pages of 4 (the page_first_direct MLA host pool is
    then token-major with pages of several tokens: a slot's offset is slot × token stride) on each way to
    the runs: C, Python lists and numpy."""
    with _run_limits(tail):
        _check_arbitrary_slots(attention, layout, io_backend, 4, data, layer_num=1)


def _check_same_errors(
    fast: transfer.NativeTransfer,
    attention: AttentionKind,
    layout: MemLayout,
    page_size: int,
    data: st.DataObject,
    layer_num: int | None = None,
) -> None:
    """``fast`` and the Python path on the same slots, often out of range or repeated: the same
    ``UsageError`` (type and message) or the same copies."""
    config = make_config(attention, layout, page_size, "float16", IOBackend.DIRECT, **_layers(layer_num))
    device, host = make_pools(config)
    n = data.draw(st.integers(1, min(3 * page_size + 2, device.size)), label="slots")
    if data.draw(st.booleans(), label="distinct"):
        h = torch.tensor(data.draw(st.permutations(range(host.size)), label="host")[:n])
        d = torch.tensor(data.draw(st.permutations(range(device.size)), label="device")[:n])
        if data.draw(st.booleans(), label="consecutive"):
            h, d = (
                h[0] % (host.size - n + 1) + torch.arange(n),
                d[0] % (device.size - n + 1) + torch.arange(n),
            )
        at = data.draw(st.integers(0, n - 1), label="at")
        wrong = data.draw(st.sampled_from(["none", "host low", "host high", "device low", "device high"]))
        if wrong != "none":
            side = h if wrong.startswith("host") else d
            side[at] = -1 if wrong.endswith("low") else (host.size if side is h else device.size)
    else:  # few values: repeats
        h = torch.tensor(data.draw(st.lists(st.integers(-1, 5), min_size=n, max_size=n), label="host"))
        d = torch.tensor(data.draw(st.lists(st.integers(-1, 5), min_size=n, max_size=n), label="device"))
    host_is_src = data.draw(st.booleans(), label="load")
    src, dst = (host.kv_view(), device.kv_view()) if host_is_src else (device.kv_view(), host.kv_view())
    outcomes: list[tuple[str, object]] = []
    for path in (fast, None):
        with mock.patch.object(transfer, "native_transfer", lambda path=path: path):
            try:
                plan = plan_transfer(src, dst, h, d, IOBackend.DIRECT, host_is_src)
            except UsageError as error:
                outcomes.append(("UsageError", str(error)))
            else:
                assert (plan.native_runs is not None) is (path is not None)
                if plan.rows is not None:  # many single tokens on the Python path: rows
                    row = src.item_numel * src.buffer.element_size()
                    pairs = zip(plan.rows.src_rows.tolist(), plan.rows.dst_rows.tolist(), strict=True)
                    outcomes.append(("rows", sorted((s * row, d * row, row) for s, d in pairs)))
                else:
                    outcomes.append(("runs", sorted(_planned_runs(plan))))
    if outcomes[1][0] == "rows" and outcomes[0][0] == "runs":  # the C path's runs as single rows
        row = src.item_numel * src.buffer.element_size()
        runs = outcomes[0][1]
        assert isinstance(runs, list)
        outcomes[0] = ("rows", sorted((s + k, d + k, row) for s, d, m in runs for k in range(0, m, row)))
    assert outcomes[0] == outcomes[1], f"C path {outcomes[0]} != Python path {outcomes[1]}"


@CPU_ONLY
@pytest.mark.parametrize(("page_size", "layer_num"), [(1, None), (4, None), (4, 1)])
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_both_paths_raise_the_same_errors(
    attention: AttentionKind,
    layout: MemLayout,
    io_backend: IOBackend,
    page_size: int,
    layer_num: int | None,
    data: st.DataObject,
) -> None:
    """A slot outside either pool or a destination slot named twice: the C path raises exactly the
    Python path's ``UsageError`` (the error code and values come back from C, the message from Python);
    valid slots give both the same copies (also for a token-major host pool with pages of 4 tokens)."""
    _check_same_errors(_require_native(), attention, layout, page_size, data, layer_num)


@CPU_ONLY
@pytest.mark.parametrize(("attention", "layout", "io_backend"), DIRECT_ROWS, ids=lambda v: str(v))
def test_the_c_copy_is_checked(attention: AttentionKind, layout: MemLayout, io_backend: IOBackend) -> None:
    """The C copy is not vacuous and cannot leave a pool: runs one token off write bytes the oracle
    rejects; a run starting before either buffer, reaching one byte past either at its last K/V and
    layer, or of a negative byte count is refused before any byte of the call moves (the runs before it
    too), and guard regions behind both pools keep their bytes."""
    _check_c_copy(_require_native(), attention, layout, io_backend)


def _guarded(view: KVView, fill: int) -> tuple[KVView, torch.Tensor]:
    """``view`` on the front of a backing tensor filled with ``fill`` and 4096 elements longer (the guard
    region), and the backing tensor."""
    numel = view.buffer.numel()
    backing = torch.full((numel + 4096,), fill, dtype=view.buffer.dtype)
    return dataclasses.replace(view, buffer=backing[:numel].view(view.buffer.shape)), backing


def _check_c_copy(
    fast: transfer.NativeTransfer, attention: AttentionKind, layout: MemLayout, io_backend: IOBackend
) -> None:
    """``test_the_c_copy_is_checked`` on ``fast`` (plain asserts: a mutant of ``rc_copy`` fails it)."""
    device, host = make_pools(make_config(attention, layout, 4, "float16", io_backend))
    fill_random_(device.kv_buffer, 71)
    source, src_backing = _guarded(device.kv_view(), 5)
    source.buffer.copy_(device.kv_buffer)
    numel = host.kv_buffer.numel()
    guarded, backing = _guarded(host.kv_view(), 7)
    h, d = page_slots([4, 1, 7], 4), page_slots([2, 0, 3], 4)
    with mock.patch.object(transfer, "native_transfer", return_value=fast):
        plan = plan_transfer(source, guarded, h, d, io_backend, False)
    runs = plan.native_runs
    assert runs is not None
    assert runs.copy is fast.copy
    layers = range(host.layer_num)
    host.kv_buffer.copy_(guarded.buffer)
    expected = expected_after_backup(host, device, h, d)
    token_bytes = device.head_num * device.head_dim * device.kv_buffer.element_size()
    flat = list(runs.runs[: 3 * runs.size])
    flat[0] += token_bytes  # the bug: the first run reads one token too far (inside the device pool)
    shifted = (ctypes.c_int64 * len(flat))(*flat)
    run_transfer(dataclasses.replace(plan, native_runs=runs._replace(runs=shifted)), layers, layers)
    message = ""
    try:
        assert_same_bytes(guarded.buffer, expected, "host after a shifted run")
    except AssertionError as error:
        message = str(error)
    assert "elements differ" in message, f"a run shifted by one token copied the expected bytes: {message}"
    backing.fill_(7)
    nb = flat[2]  # every run here is one page

    def top(view: KVView) -> int:  # bytes from layer 0 of K/V 0 to the last K/V and layer
        return ((view.num_kv - 1) * view.kv_stride + (view.layer_num - 1) * view.layer_stride) * 2

    s_extent, d_extent = source.buffer.numel() * 2, numel * 2
    last = 3 * (runs.size - 1)  # the last run's source offset; + 1 destination, + 2 bytes
    corruptions = [
        ("source before the buffer", 0, -1),
        ("source one byte past the buffer", 0, s_extent - top(source) - nb + 1),
        ("destination before the buffer", 1, -1),
        ("destination one byte past the buffer", 1, d_extent - top(guarded) - nb + 1),
        ("a negative byte count", 2, -1),
        ("an overflowing source", 0, 2**63 - 1 - nb),
        ("an overflowing byte count", 2, 2**63 - 1),
    ]
    for what, field, value in corruptions:
        bad = list(runs.runs[: 3 * runs.size])
        bad[last + field] = value
        broken = runs._replace(runs=(ctypes.c_int64 * len(bad))(*bad))
        message = ""
        try:
            run_transfer(dataclasses.replace(plan, native_runs=broken), layers, layers)
        except AssertionError as error:
            message = str(error)
        refused = f"invariant byte runs in bounds: run {runs.size - 1} "
        assert refused in message, f"the C copy accepted a run with {what}: {message!r}"
        assert bool((backing == 7).all()), f"a refused C copy ({what}) wrote bytes"
        assert bool((src_backing[source.buffer.numel() :] == 5).all())
    for field, value in ((0, s_extent - top(source) - nb), (1, d_extent - top(guarded) - nb)):
        fits = list(runs.runs[: 3 * runs.size])
        fits[last + field] = value  # the last run ends at the buffer's last byte: accepted
        run_transfer(
            dataclasses.replace(plan, native_runs=runs._replace(runs=(ctypes.c_int64 * len(fits))(*fits))),
            layers,
            layers,
        )
        assert bool((backing[numel:] == 7).all()), "a run wrote past the end of the host pool"


def _overlap_copy_is_exact(fast: transfer.NativeTransfer) -> bool:
    """Whether ``fast`` copies exactly between two overlapping views of one backing tensor (the public
    ``plan_transfer`` takes any views): slots 0..7 of one to slots 0..7 of the other, which starts two
    slots later, so the run's source and destination bytes overlap; ``memmove`` semantics expected (the
    source as it was before the copy). Streaming stores, which load and store 64 bytes at a time, would
    read bytes the same run already wrote: ``rc_copy`` streams only between disjoint buffers."""
    config = make_config(
        AttentionKind.MLA, MemLayout.LAYER_FIRST, 4, "float16", IOBackend.DIRECT, layer_num=1
    )
    _, host = make_pools(config)
    view = host.kv_view()
    numel, row, shift = view.buffer.numel(), view.item_numel, 2
    backing = torch.empty(numel + shift * row, dtype=view.buffer.dtype)
    fill_random_(backing, 29)
    src = dataclasses.replace(view, buffer=backing[:numel].view(view.buffer.shape))
    dst = dataclasses.replace(view, buffer=backing[shift * row :].view(view.buffer.shape))
    slots = torch.arange(8)
    with mock.patch.object(transfer, "native_transfer", return_value=fast):
        plan = plan_transfer(src, dst, slots, slots, IOBackend.DIRECT, True)
    assert plan.native_runs is not None and plan.native_runs.triples() == [(0, 0, 8 * row * 2)]  # one run
    expected = backing.clone()
    expected[shift * row : (shift + 8) * row] = backing[: 8 * row].clone()
    run_transfer(plan, range(1), range(1))
    return bool(torch.equal(as_bits(backing), as_bits(expected)))


@CPU_ONLY
def test_overlapping_views_are_copied_as_by_memmove() -> None:
    """Two pools overlapping in memory (views of one backing tensor): the C copy of a build that streams
    every run (RC_STREAM_MIN 1) takes its memmove branch and copies the right bytes."""
    _require_native()
    assert _overlap_copy_is_exact(_streaming_everywhere())


# Deliberately broken builds of csrc/transfer.c (a text mutation of a copy of the source, built by the
# loader as any other), each with the property check that must catch it.
MUTANTS: dict[str, tuple[str, str, str]] = {
    "run one token short": (
        "out[3 * count + 2] = piece * row;",
        "out[3 * count + 2] = (piece - (piece > 1)) * row;",
        "runs",
    ),
    "runs not merged": ("runs[i].s == runs[k].s + runs[k].n &&", "0 &&", "runs"),
    "a page split one slot late": (
        "piece = src.page_size - s % src.page_size;",
        "piece = src.page_size - s % src.page_size + 1;",
        "paged",
    ),
    "a destination check of starts only": (
        "by_dst[i].d < by_dst[i - 1].d + by_dst[i - 1].n",
        "by_dst[i].d < by_dst[i - 1].d",
        "errors",
    ),
    "a slot equal to the pool size in range": ("hi[side] >= bound[side]", "hi[side] > bound[side]", "errors"),
    "no source bound in the copy": ("nb > s_extent - s_top - s ||", "0 ||", "copy"),
    "a negative byte count copied": ("nb < 0 || s < 0 || d < 0", "s < 0 || d < 0", "copy"),
    "streaming stores between overlapping buffers": (
        "const int stream = RC_STREAM_MIN > 0 && (",
        "const int stream = RC_STREAM_MIN > 0 || (",
        "overlap",
    ),
    "a streamed run's last byte dropped": (
        "memcpy(d + i, s + i, n - i);",
        "memcpy(d + i, s + i, n - i - (n > i));",
        "bytes",
    ),
}


def _mutant(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: str, new: str, defines: dict[str, int]
) -> transfer.NativeTransfer:
    text = native.source("transfer").read_text()
    assert text.count(old) == 1, old
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "transfer.c").write_text(text.replace(old, new))
    monkeypatch.setattr(native, "_SOURCES", src)
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(native.NATIVE_ENV, "require")
    lib = native.load("transfer", defines=defines)
    assert lib is not None
    return transfer.bind_native(lib)


def _streaming_everywhere() -> transfer.NativeTransfer:
    """A build of ``csrc/transfer.c`` that copies every run with streaming stores (``RC_STREAM_MIN`` 1;
    the default streams runs of 256 bytes and more, which the tiny pools of these tests seldom have)."""
    lib = native.load("transfer", defines=STREAM_EVERY_RUN)
    assert lib is not None
    return transfer.bind_native(lib)


STREAM_EVERY_RUN: dict[str, int] = {"RC_STREAM_MIN": 1}


def _fails_in_child(check: Callable[[], None]) -> bool:
    """Whether ``check`` fails (an ``AssertionError``, or a crash: a mutant of ``rc_copy`` that lets a
    negative byte count through hands ``memmove`` about 2**64 bytes) in a forked child process."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        faulthandler.disable()
        try:
            check()
        except AssertionError:
            os._exit(1)
        except BaseException:
            os._exit(2)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert not os.WIFEXITED(status) or os.WEXITSTATUS(status) in (0, 1), f"the check broke: {status}"
    return status != 0


def _fails(check: Callable[[st.DataObject], None]) -> bool:
    """Whether ``check`` fails on some drawn example (no shrinking: only the verdict is needed)."""

    @settings(max_examples=60, deadline=None, database=None, derandomize=True, phases=[Phase.generate])
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        check(data)

    try:
        run()
    except AssertionError:
        return True
    return False


@CPU_ONLY
@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_property_checks_catch_a_broken_c_path(
    mutant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each mutant of ``csrc/transfer.c`` fails the property check named beside it (and the unbroken build
    passes the same check, so the failure is the mutant's)."""
    _require_native()
    old, new, check_name = MUTANTS[mutant]
    if check_name in ("bytes", "overlap") and platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("streaming stores are built only for x86-64 (SSE2); elsewhere every run is a memmove")
    streamed = check_name in ("bytes", "overlap")
    good = _streaming_everywhere() if streamed else transfer.native_transfer()
    assert good is not None
    bad = _mutant(tmp_path, monkeypatch, old, new, STREAM_EVERY_RUN if streamed else {})
    if check_name == "overlap":
        assert _overlap_copy_is_exact(good), "the overlap check fails on the unbroken C path"
        assert not _overlap_copy_is_exact(bad), f"the overlap check passes on the mutant {mutant!r}"
        return
    row = (AttentionKind.MLA, MemLayout.PAGE_FIRST_DIRECT, IOBackend.DIRECT)
    if check_name == "copy":  # test_the_c_copy_is_checked, in a child: the mutant may crash the process
        if not hasattr(os, "fork"):
            pytest.skip("the copy mutants run in a forked child")
        assert not _fails_in_child(lambda: _check_c_copy(good, *row)), (
            "the check fails on the unbroken C path"
        )
        assert _fails_in_child(lambda: _check_c_copy(bad, *row)), f"the copy check passes on {mutant!r}"
        return

    def check(fast: transfer.NativeTransfer) -> Callable[[st.DataObject], None]:
        def runs(data: st.DataObject) -> None:
            with mock.patch.object(transfer, "native_transfer", return_value=fast):
                _check_planned_runs(*row, 4, data)

        def paged(data: st.DataObject) -> None:
            with mock.patch.object(transfer, "native_transfer", return_value=fast):
                _check_paged_pools((4, 4), data)

        def errors(data: st.DataObject) -> None:
            _check_same_errors(fast, row[0], row[1], 4, data)

        def bytes_(data: st.DataObject) -> None:
            with mock.patch.object(transfer, "native_transfer", return_value=fast):
                test_arbitrary_token_slots.hypothesis.inner_test(*row, 4, data)

        return {"runs": runs, "paged": paged, "errors": errors, "bytes": bytes_}[check_name]

    assert not _fails(check(good)), "the check fails on the unbroken C path"
    assert _fails(check(bad)), f"the check {check_name!r} passes on the mutant {mutant!r}"
