"""Host <-> device KV transfers: the io backend × layout dispatch table of seed §5.4.

The host pools call this module for a per-layer load (host -> device) and an all-layer backup
(device -> host). ``check_supported`` checks the (io backend, layout, attention) combination against
``DISPATCH`` (the rows of the seed's table; anything else raises ``ConfigError``, as SGLang raises
``ValueError``); ``plan_transfer`` validates the index arrays and prepares them once per operation
(a load's per-layer calls share the plan); ``run_transfer`` copies a layer range with one of two
mechanisms:

* ``kernel``: the Triton gather/scatter in ``kernels.py``, indices moved to the kernel's device.
* ``direct``: plain memory copies of runs: pairs consecutive on both sides, in host address order (as
  SGLang's ``move_indices`` sorts the host indices and permutes the device indices alike, seed §5.4 ①;
  here the runs are sorted rather than the slots). A run never crosses a page of a
  ``page_first_direct`` side, so a backup copies page by page and a load page by layer
  (``transfer_kv_all_layer_direct_lf_pf`` / ``transfer_kv_per_layer_direct_pf_lf``). With a GPU on
  either side each run is one ``copy_`` (``cudaMemcpyAsync``) covering K and V and every layer of the
  call. Between two CPU buffers (no GPU) a ``copy_`` of a 5-D view costs several microseconds of view
  creation and dispatch, about as much as copying a 16-token page, and torch's CPU copy loop runs
  below libc's ``memcpy`` on some CPUs. There, when the C path loads (``native_transfer``:
  ``csrc/transfer.c`` built by ``refcache.gpu.native``), a plan is one C call on the index tensors'
  memory (``rc_plan``: range check, cut, sort, merge, destination check and page split, the same runs
  and the same ``UsageError``s as below) holding ``NativeRuns``, and a call one more (``rc_copy``: every
  run per K/V and layer, runs of 256 bytes and more with streaming stores, after checking every run
  against both buffers). Without it (``REFCACHE_NATIVE=off``, no compiler) the runs come from
  ``_direct_runs`` and the plan holds them as byte slices (``ByteRuns``, computed once, checked against
  both buffers' extents whenever a plan is built): each run is one slice assignment between
  ``memoryview``s of the two buffers per K/V and layer, except that runs evenly spaced on both sides
  (consecutive pages) are copied together by one strided numpy copy. When the runs are many and short
  (``ROW_COPY_MIN_RUNS``, ``ROW_COPY_MAX_BYTES``: scattered single tokens of a small KV, where the
  per-run Python cost dwarfs the bytes) the plan holds ``RowCopy`` instead: every slot's row (its K or V
  of one layer, ``item_numel`` elements) by number, and a call is one numpy gather and one scatter of
  whole rows for all K/V and layers.

The config resolver (``HiCacheConfig.resolve``) performs the automatic rewrites of seed §5.3/§5.6 with
a ``ConfigRewriteWarning``; this module only sees resolved combinations and rejects the rest.
"""

from __future__ import annotations

import ctypes
import functools
import operator
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from refcache.config import AttentionKind, IOBackend, MemLayout
from refcache.errors import ConfigError, UsageError
from refcache.gpu import native
from refcache.gpu.kernels import transfer_kv_kernel
from refcache.gpu.layout import KVView

__all__ = [
    "DISPATCH",
    "ROW_COPY_MAX_BYTES",
    "ROW_COPY_MIN_RUNS",
    "ByteRuns",
    "NativeRuns",
    "NativeTransfer",
    "RowCopy",
    "TransferPlan",
    "bind_native",
    "byte_runs_eligible",
    "check_byte_runs_in_bounds",
    "check_supported",
    "move_indices",
    "native_transfer",
    "plan_transfer",
    "row_copy_eligible",
    "run_transfer",
    "transfer_kv_direct",
]

# (io backend, layout) -> (SGLang per-layer load op, SGLang all-layer backup op, attention kinds).
DISPATCH: Final[dict[tuple[IOBackend, MemLayout], tuple[str, str, frozenset[AttentionKind]]]] = {
    (IOBackend.KERNEL, MemLayout.LAYER_FIRST): (
        "transfer_kv_per_layer[_mla]",
        "transfer_kv_all_layer[_mla]",
        frozenset(AttentionKind),
    ),
    (IOBackend.KERNEL, MemLayout.PAGE_FIRST): (
        "transfer_kv_per_layer[_mla]_pf_lf",
        "transfer_kv_all_layer[_mla]_lf_pf",
        frozenset(AttentionKind),
    ),
    (IOBackend.KERNEL, MemLayout.PAGE_HEAD): (
        "transfer_kv_per_layer_ph_lf",
        "transfer_kv_all_layer_lf_ph",
        frozenset({AttentionKind.MHA}),
    ),
    (IOBackend.DIRECT, MemLayout.LAYER_FIRST): (
        "transfer_kv_direct",
        "transfer_kv_direct",
        frozenset(AttentionKind),
    ),
    (IOBackend.DIRECT, MemLayout.PAGE_FIRST_DIRECT): (
        "transfer_kv_per_layer_direct_pf_lf",
        "transfer_kv_all_layer_direct_lf_pf",
        frozenset(AttentionKind),
    ),
}


def check_supported(io_backend: IOBackend | str, layout: MemLayout, attention: AttentionKind) -> IOBackend:
    """The io backend as an ``IOBackend``; raises ``ConfigError`` for a combination outside seed §5.4."""
    try:
        backend = IOBackend(io_backend)
    except ValueError:
        raise ConfigError(f"io_backend={io_backend!r} is not one of 'kernel', 'direct'") from None
    row = DISPATCH.get((backend, layout))
    if row is None or attention not in row[2]:
        rows = ", ".join(f"{b.value}+{lay.value}" for (b, lay), r in DISPATCH.items() if attention in r[2])
        raise ConfigError(
            f"io_backend={backend.value!r} with layout={layout.value!r} is not supported for {attention.value} "
            f"(seed §5.4 has rows {rows}); resolve the configuration with HiCacheConfig.resolve()"
        )
    return backend


def move_indices(
    host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: IOBackend, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Seed §5.4 ①: for ``kernel`` put both index arrays on the kernel's device; for ``direct`` bring both
    to the CPU. SGLang's ``direct`` branch also sorts the host indices and permutes the device indices
    alike, so that copies go in host address order and slots consecutive on both sides meet; the plan
    does that sort on the runs instead (``_direct_runs``: the same copies in the same order, one sort
    key per run rather than per slot)."""
    if io_backend is IOBackend.KERNEL:
        return host_indices.to(device, non_blocking=True), device_indices.to(device, non_blocking=True)
    # .cpu() returns a CPU tensor itself, through torch's dispatcher (a cold call after a large copy)
    return (
        host_indices if host_indices.is_cpu else host_indices.cpu(),
        device_indices if device_indices.is_cpu else device_indices.cpu(),
    )


Int64s = npt.NDArray[np.int64]


def _as_index(name: str, indices: torch.Tensor) -> torch.Tensor:
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise UsageError(
            f"{name} must be a 1-D int64 tensor, got shape {tuple(indices.shape)} {indices.dtype}"
        )
    return indices if indices.dtype is torch.int64 else indices.to(torch.int64)


def _check_values(name: str, indices: torch.Tensor, limit: int, unique: bool) -> None:
    """Range (and, for a destination, uniqueness) of CPU indices, for the kernel backend. CUDA index
    tensors are trusted (they come from the allocators): reading their values would synchronise the
    device."""
    if indices.device.type != "cpu" or not indices.numel():
        return
    lo, hi = (int(v) for v in torch.aminmax(indices))
    if lo < 0 or hi >= limit:
        raise UsageError(f"{name} holds slots outside [0, {limit}): min {lo}, max {hi}")
    if unique:
        ordered = indices.sort().values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise UsageError(f"{name} name a destination slot twice")


def _slot_offsets(view: KVView, slots: Int64s, unit: int) -> Int64s:
    """``view.offset(0, 0, slot) * unit`` for every slot (``unit``: bytes per element, or 1).

    Strictly increasing in the slot for every layout (a page's tokens lie below the next page's), so two
    runs of slots share a slot exactly when their offset intervals overlap, and a run that continues
    another in slots across a page boundary of a ``page_first_direct`` side does not continue it in
    offsets (the step there jumps over the other layers' share of the page)."""
    if view.token_major:  # page_stride == page_size * token_stride: a slot is token_stride from the next
        return slots * (view.token_stride * unit)
    ps, ts = view.page_size, view.token_stride * unit
    # (slot // ps) * page_stride + (slot % ps) * token_stride, as slot * ts + page * (page_stride - ps * ts)
    return slots * ts + (slots // ps) * (view.page_stride * unit - ps * ts)


# A direct plan's runs: source offsets, destination offsets and slot counts as lists when few (finished in
# Python); when many (finished with numpy; the row copy needs neither as lists), the offsets as one
# (2, runs) array and the slot counts.
Runs = tuple[list[int], list[int], list[int]] | tuple[Int64s, Int64s]
PY_RUNS: Final = 32  # runs; up to this many, the runs are offset, sorted, merged and checked in Python
# (measured: 1 run 331 -> 212 us, 32 runs 411 -> 319 us cold; 128 runs were slower in Python)


def _direct_runs(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_view: KVView,
    dst_view: KVView,
    host_is_src: bool,
    unit: int,
) -> Runs:
    """The copies of a ``direct`` transfer: the maximal runs of pairs consecutive on both sides and inside
    a page of a side that is not token-major, in host address order (seed §5.4 ①), as ``(src_offsets,
    dst_offsets, lengths)``: the source/destination ``view.offset(0, 0, slot) * unit`` of each run's first
    pair and its slot count.

    Raises ``UsageError`` (before anything is copied) for a slot outside either pool and for a destination
    slot named twice.

    The cut touches every slot, with a few numpy calls (numpy's calls cost less than torch's on arrays
    this small, and array methods less than numpy's Python-level wrappers). The runs are cut in pair
    order, sorted by host offset, and two that then continue each other on both sides merged: the copies
    SGLang's ``move_indices`` gets by sorting every slot first, with one sort key per run (a page, when
    pages are scattered) instead of one per slot. Up to ``PY_RUNS`` runs (consecutive slots, scattered
    pages of 64 tokens and more) the rest is Python on lists, beyond that a fixed number of numpy calls:
    a transfer's planning follows megabytes of copying, which leave none of numpy's code in the CPU
    caches, and each numpy call then costs tens of microseconds, more than Python spends on a few dozen
    runs (specs/data-plane.md §9).
    """
    n = src.numel()
    if n == 0:
        return [], [], []
    slots = np.empty((2, n), dtype=np.int64)
    slots[0], slots[1] = src.numpy(), dst.numpy()
    host_side = 0 if host_is_src else 1
    keys = slots  # slots, with a gap after each page of a side whose slots are consecutive only in a page
    for side, view in enumerate((src_view, dst_view)):
        if not view.token_major:
            keys = keys.copy() if keys is slots else keys
            keys[side] += slots[side] // view.page_size
    starts = np.empty(n, dtype=bool)  # starts[i]: pair i begins a run
    starts[0] = True
    ((keys[:, 1:] - keys[:, :-1]) != 1).any(axis=0, out=starts[1:])
    first = starts.nonzero()[0]
    if len(first) <= PY_RUNS:
        return _runs_in_python(
            slots[:, first].tolist(), first.tolist(), n, src_view, dst_view, host_is_src, unit
        )
    lo, hi = slots.min(axis=1).tolist(), slots.max(axis=1).tolist()
    for side, view in enumerate((src_view, dst_view)):
        if lo[side] < 0 or hi[side] >= _slots(view):
            name = "host indices" if side == host_side else "device indices"
            raise UsageError(
                f"{name} holds slots outside [0, {_slots(view)}): min {lo[side]}, max {hi[side]}"
            )
    runs, lengths = slots[:, first], np.empty_like(first)
    np.subtract(first[1:], first[:-1], out=lengths[:-1])
    lengths[-1] = n - first[-1]
    runs = np.concatenate((_slot_offsets(src_view, runs[0], unit), _slot_offsets(dst_view, runs[1], unit)))
    runs.shape = (2, -1)
    steps = np.array([[src_view.token_stride * unit], [dst_view.token_stride * unit]])
    host = runs[host_side]
    if (host[1:] < host[:-1]).any():
        order = host.argsort(kind="stable")
        runs, lengths = runs[:, order], lengths[order]
        meet = ((runs + lengths * steps)[:, :-1] == runs[:, 1:]).all(axis=0)  # run i + 1 continues run i
        if meet.any():
            keep = np.concatenate(([True], ~meet)).nonzero()[0]
            runs, lengths = runs[:, keep], np.add.reduceat(lengths, keep)
    # Two runs share a destination slot exactly when their offset intervals overlap, which sorting by
    # first offset reveals as one beginning before its predecessor ends (a backup's destination is the
    # host side, already sorted).
    d_first, d_end = runs[1], runs[1] + lengths * steps[1]
    if host_is_src:
        order = d_first.argsort()
        d_first, d_end = d_first[order], d_end[order]
    if (d_first[1:] < d_end[:-1]).any():
        name = "device indices" if host_is_src else "host indices"
        raise UsageError(f"{name} name a destination slot twice")
    return runs, lengths


def _runs_in_python(
    run_slots: list[list[int]],
    first: list[int],
    n: int,
    src_view: KVView,
    dst_view: KVView,
    host_is_src: bool,
    unit: int,
) -> Runs:
    """``_direct_runs`` after the cut, on lists: ``run_slots`` the source and destination slots of each
    run's first pair, ``first`` each run's first pair. The same checks and result as the numpy path."""
    lengths = list(map(operator.sub, [*first[1:], n], first))
    offsets = []
    for side, (view, starts) in enumerate(zip((src_view, dst_view), run_slots, strict=True)):
        # A run's slots are consecutive: its first and last slot bound it.
        lo, hi = min(starts), max(map(operator.add, starts, lengths)) - 1
        if lo < 0 or hi >= _slots(view):
            name = "host indices" if side == (0 if host_is_src else 1) else "device indices"
            raise UsageError(f"{name} holds slots outside [0, {_slots(view)}): min {lo}, max {hi}")
        if view.token_major:
            step = view.token_stride * unit
            offsets.append([slot * step for slot in starts])
        else:
            ps, ts = view.page_size, view.token_stride * unit
            jump = view.page_stride * unit - ps * ts
            offsets.append([slot * ts + slot // ps * jump for slot in starts])
    s, d = offsets
    s_step, d_step = src_view.token_stride * unit, dst_view.token_stride * unit
    host = s if host_is_src else d
    if any(map(operator.lt, host[1:], host[:-1])):
        order = sorted(range(len(host)), key=host.__getitem__)
        s, d, lengths = [s[i] for i in order], [d[i] for i in order], [lengths[i] for i in order]
        ms, md, ml = [s[0]], [d[0]], [lengths[0]]
        for s_next, d_next, length in zip(s[1:], d[1:], lengths[1:], strict=True):
            if s_next == ms[-1] + ml[-1] * s_step and d_next == md[-1] + ml[-1] * d_step:
                ml[-1] += length  # continues the run before it on both sides
            else:
                ms.append(s_next)
                md.append(d_next)
                ml.append(length)
        s, d, lengths = ms, md, ml
    # Two runs share a destination slot exactly when their offset intervals overlap (see _direct_runs).
    d_first, d_end = d, [x + length * d_step for x, length in zip(d, lengths, strict=True)]
    if host_is_src:  # the destination is the device side, in pair order
        intervals = sorted(zip(d_first, d_end, strict=True))
        d_first, d_end = [a for a, _ in intervals], [b for _, b in intervals]
    if any(map(operator.lt, d_first[1:], d_end[:-1])):
        name = "device indices" if host_is_src else "host indices"
        raise UsageError(f"{name} name a destination slot twice")
    return s, d, lengths


class _Side(NamedTuple):
    """What the CPU planner and copy need of one pool view, worked out once per view (``_side``)."""

    kind: tuple[object, ...]  # (num_kv, head_num, head_dim, dtype): equal on both sides of a transfer
    cpu_rows: bool  # byte runs possible on this side: a CPU buffer, a slot's heads contiguous
    slots: int  # token slots the view addresses
    row: int  # bytes of one slot's K or V in one layer, and between consecutive slots inside a page
    page_size: int  # slots consecutive only inside a page of this many; 0 where consecutive everywhere
    jump: int  # extra bytes between the last slot of a page and the first of the next
    isz: int  # bytes of an element
    top: int  # bytes from layer 0 of K/V 0 to the first byte of the last K/V and layer
    kv_bytes: int  # bytes between K and V
    layer_bytes: int  # bytes between layers
    ptr: int  # the buffer's data_ptr()
    extent: int  # KVView.extent
    native: ctypes.Array[ctypes.c_int64]  # (slots, row, page_size, jump) for csrc/transfer.c's rc_plan


_SIDE_KEY: Final = "_transfer_side"  # the view's own attribute dict caches its _Side


def _side(view: KVView) -> _Side:
    """``view``'s ``_Side``, kept in the view's attribute dict (as ``functools.cached_property`` keeps its
    values): pools build their view once, so a plan looks the strides and sizes up instead of asking the
    buffer (every torch getter is a cold call after a large copy). The buffer's address is read once, as
    ``KVView.raw`` reads it: a pool's buffer is never reallocated."""
    cached: _Side | None = view.__dict__.get(_SIDE_KEY)
    if cached is None:
        buffer = view.buffer
        isz = buffer.element_size()
        slots, row = _slots(view), view.token_stride * isz
        page_size = 0 if view.token_major else view.page_size
        jump = 0 if view.token_major else (view.page_stride - view.page_size * view.token_stride) * isz
        cached = _Side(
            (view.num_kv, view.head_num, view.head_dim, buffer.dtype),
            buffer.is_cpu
            and view.token_stride == view.item_numel
            and (view.head_stride == view.head_dim or view.head_num == 1),
            slots,
            row,
            page_size,
            jump,
            isz,
            ((view.num_kv - 1) * view.kv_stride + (view.layer_num - 1) * view.layer_stride) * isz,
            view.kv_stride * isz,
            view.layer_stride * isz,
            buffer.data_ptr(),
            view.extent,
            (ctypes.c_int64 * 4)(slots, row, page_size, jump),
        )
        view.__dict__[_SIDE_KEY] = cached
    return cached


# --- the C path between two CPU pools (csrc/transfer.c) ----------------------------------------------------


class NativeTransfer(NamedTuple):
    """The functions of ``csrc/transfer.c`` with their argument types set (``bind_native``)."""

    plan: Callable[..., int]  # rc_plan: a plan's runs from the slot arrays, or an error code
    copy: Callable[..., int]  # rc_copy: a finished plan's runs for every (K/V, layer) of a call


def bind_native(lib: ctypes.CDLL) -> NativeTransfer:
    """``lib`` (a build of ``csrc/transfer.c``) as a ``NativeTransfer``."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    plan, copy = lib.rc_plan, lib.rc_copy
    plan.argtypes = [ptr, i64, ptr, i64, i64, ptr, ptr, i64, ptr, ptr]
    plan.restype = i64
    copy.argtypes = [ptr, ptr, i64, i64, i64, i64]
    copy.restype = i64
    return NativeTransfer(plan, copy)


_BOUND: list[NativeTransfer | None] = []  # the C path, once per process


def native_transfer() -> NativeTransfer | None:
    """The C path (``native.load("transfer")``, bound on the first call of a process: ``REFCACHE_NATIVE``
    is read then), or None: ``off``, or no compiler in ``auto`` (``require`` raises ``NativeUnavailable``
    instead, on every call). The tests replace this function to choose a path."""
    if not _BOUND:
        lib = native.load("transfer")
        _BOUND.append(None if lib is None else bind_native(lib))
    return _BOUND[0]


_RC_RANGE: Final = -1
_RC_DUPLICATE: Final = -2


class NativeRuns(NamedTuple):
    """A direct plan between two CPU buffers made by ``rc_plan``: ``size`` runs, each three int64s of
    ``runs`` (source byte offset, destination byte offset, bytes, from layer 0 of K/V 0), in host address
    order, the same runs as ``ByteRuns`` lists (without progressions: a run per page costs C nothing).
    ``copy`` is the ``rc_copy`` of the same build; it checks every run against both buffers before the
    first byte of a call moves."""

    runs: ctypes.Array[ctypes.c_int64]
    size: int
    copy: Callable[..., int]
    # rc_copy's geometry: both buffers' data_ptr(), num_kv, the kv and layer strides of source and
    # destination in bytes and both extents, looked up once per plan (a call's attribute reads are cold
    # after a large copy, and each argument of a ctypes call costs about 1 us)
    geometry: ctypes.Array[ctypes.c_int64]

    def triples(self) -> list[tuple[int, int, int]]:
        """The runs as (source offset, destination offset, bytes)."""
        flat = self.runs[: 3 * self.size]
        return list(zip(flat[0::3], flat[1::3], flat[2::3], strict=True))


def _native_runs(
    fast: NativeTransfer,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    src: _Side,
    dst: _Side,
    host_is_src: bool,
    num_kv: int,
) -> NativeRuns:
    """``rc_plan`` on validated 1-D int64 CPU index tensors of equal length; raises the ``UsageError``s of
    ``_direct_runs`` (a slot outside either pool, a destination slot named twice)."""
    n = src_idx.shape[0]
    out = (ctypes.c_int64 * (3 * n))()
    err = (ctypes.c_int64 * 3)()
    count = fast.plan(
        src_idx.data_ptr(),
        src_idx.stride(0),
        dst_idx.data_ptr(),
        dst_idx.stride(0),
        n,
        src.native,
        dst.native,
        host_is_src,
        out,
        err,
    )
    if count == _RC_RANGE:
        side, lo, hi = err
        name = "host indices" if side == (0 if host_is_src else 1) else "device indices"
        bound = (src, dst)[side].slots
        raise UsageError(f"{name} holds slots outside [0, {bound}): min {lo}, max {hi}")
    if count == _RC_DUPLICATE:
        name = "device indices" if host_is_src else "host indices"
        raise UsageError(f"{name} name a destination slot twice")
    if count < 0:
        raise MemoryError(f"rc_plan failed with code {count} on {n} slots")
    geometry = (ctypes.c_int64 * 9)(
        src.ptr,
        dst.ptr,
        num_kv,
        src.kv_bytes,
        src.layer_bytes,
        dst.kv_bytes,
        dst.layer_bytes,
        src.extent,
        dst.extent,
    )
    # a NamedTuple: a frozen dataclass costs 10 us cold
    return NativeRuns(out, count, fast.copy, geometry)


def _transfer_kv_native(runs: NativeRuns, src_layers: range, dst_layers: range) -> None:
    """Copy a plan's ``NativeRuns`` with one ``rc_copy``: every run per (K/V, layer) of the call, after
    checking each against both buffers' extents (``AssertionError``: a bug in the plan, nothing copied)."""
    bad = runs.copy(runs.geometry, runs.runs, runs.size, len(src_layers), src_layers.start, dst_layers.start)
    if bad:
        i = -1 - bad
        raise AssertionError(
            f"invariant byte runs in bounds: run {i} {runs.triples()[i]} reaches outside a buffer "
            f"(layers {src_layers} -> {dst_layers}; extents {runs.geometry[7]}, {runs.geometry[8]} bytes)"
        )


def transfer_kv_direct(
    src: KVView, dst: KVView, runs: Sequence[tuple[int, int, int]], src_layers: range, dst_layers: range
) -> None:
    """One ``copy_`` per run (storage offsets in elements and length in slots, from ``plan_transfer``),
    K and V and every layer of the call at once. The direct path whenever a GPU buffer is involved."""
    non_blocking = src.buffer.device != dst.buffer.device
    nl = len(src_layers)
    s_stride = (src.kv_stride, src.layer_stride, src.token_stride, src.head_stride, 1)
    d_stride = (dst.kv_stride, dst.layer_stride, dst.token_stride, dst.head_stride, 1)
    s_layer, d_layer = src_layers.start * src.layer_stride, dst_layers.start * dst.layer_stride
    s_buf, d_buf = src.buffer, dst.buffer
    for s, d, length in runs:
        shape = (src.num_kv, nl, length, src.head_num, src.head_dim)
        d_buf.as_strided(shape, d_stride, d + d_layer).copy_(
            s_buf.as_strided(shape, s_stride, s + s_layer), non_blocking=non_blocking
        )


Progression = tuple[int, int, int, int, int, int]  # src, dst, nbytes, count, src_step, dst_step
MIN_PROGRESSION: Final = 4  # runs; below this, slice copies cost less than building two strided views
ROW_COPY_MIN_RUNS: Final = 32  # runs; fewer: byte runs (the tests' small plans stay on that path too)
ROW_COPY_MAX_BYTES: Final = 1536  # mean bytes of a run (one K/V, one layer); more: byte runs


@dataclass(frozen=True)
class RowCopy:
    """A direct plan between two CPU buffers as rows: both buffers are seen as arrays of rows of
    ``item_numel`` elements (one slot's K or V in one layer), and ``src_rows[i]`` / ``dst_rows[i]`` are
    the row numbers of pair ``i`` for K/V 0 and layer 0; a call adds each (K/V, layer)'s row distance and
    copies every row with one numpy gather and one scatter (each row one ``memcpy``). The copies are
    those of the byte runs, slot by slot; destinations are distinct (the plan checked), so order does not
    matter. Constructing one checks that every row of every K/V and layer lies inside both buffers."""

    src_rows: Int64s
    dst_rows: Int64s


def row_copy_eligible(src: KVView, dst: KVView) -> bool:
    """Whether a direct plan between ``src`` and ``dst`` may copy rows: byte runs are eligible and every
    stride of both views is a whole number of rows."""
    return byte_runs_eligible(src, dst) and all(
        stride % v.item_numel == 0
        for v in (src, dst)
        for stride in (v.kv_stride, v.layer_stride, v.page_stride, v.token_stride)
    )


def _row_bases(view: KVView, layers: range) -> Int64s:
    """Row distance of each (K/V, layer) of ``layers`` from K/V 0, layer 0."""
    kv = np.arange(view.num_kv, dtype=np.int64)[:, None] * view.kv_stride
    layer = np.arange(layers.start, layers.stop, dtype=np.int64)[None, :] * view.layer_stride
    out: Int64s = ((kv + layer) // view.item_numel).ravel()
    return out


def check_rows_in_bounds(rows: RowCopy, src: KVView, dst: KVView) -> None:
    """Invariant of every ``TransferPlan`` with a ``RowCopy``: each row, at every K/V and layer, lies inside
    its buffer on both sides. Raises ``AssertionError`` naming the side (a bug in the plan)."""
    for side, view, numbers in (("source", src, rows.src_rows), ("destination", dst, rows.dst_rows)):
        if not len(numbers):
            continue
        top = int(_row_bases(view, range(view.layer_num))[-1])
        lo, hi = int(numbers.min()), int(numbers.max()) + top
        limit = view.extent // (view.item_numel * view.buffer.element_size())
        if lo < 0 or hi >= limit:
            raise AssertionError(
                f"invariant rows in bounds: a {side} row reaches {hi} (lowest {lo}) in a buffer of {limit} rows"
            )


@dataclass(frozen=True)
class ByteRuns:
    """The runs of a direct plan between two CPU buffers, in bytes from each buffer's ``data_ptr()`` and
    for layer 0 of K; a call copies each once per (K/V, layer), adding that pair's distance.

    Single runs: ``nbytes[i]`` contiguous bytes at ``src_offsets[i]`` go to ``dst_offsets[i]`` (in
    host address order), one ``memoryview`` slice assignment each. Progressions ``(src, dst, nbytes,
    count, src_step, dst_step)``: ``count`` runs of ``nbytes`` spaced ``src_step`` and ``dst_step``
    (> 0) apart, as consecutive pages give, one strided numpy copy each.
    """

    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    progressions: tuple[Progression, ...] = ()
    # The single runs as byte slices from a (K/V, layer)'s first byte, derived once for every call.
    src_slices: tuple[slice, ...] = field(init=False, repr=False, compare=False)
    dst_slices: tuple[slice, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, offsets in (("src_slices", self.src_offsets), ("dst_slices", self.dst_offsets)):
            object.__setattr__(
                self, name, tuple(map(slice, offsets, map(operator.add, offsets, self.nbytes)))
            )


def byte_runs_eligible(src: KVView, dst: KVView) -> bool:
    """Whether a direct plan between ``src`` and ``dst`` gets ``ByteRuns``: both buffers on the CPU, and
    a slot's heads contiguous and consecutive slots adjacent within a page on both sides (so that a run
    is one block of bytes per K/V and layer; true of every layout with a direct row). Read off each
    view's ``_Side``."""
    return _side(src).cpu_rows and _side(dst).cpu_rows


def _byte_runs(src: KVView, runs: Runs) -> ByteRuns:
    """``ByteRuns`` of ``_direct_runs`` in bytes: evenly spaced stretches of equal runs become
    progressions, the rest single runs."""
    row = src.item_numel * src.buffer.element_size()
    # Progressions need a run whose next two have the same steps; scattered pages have none.
    if len(runs) == 2:  # many runs: the check in numpy
        offsets, lengths = runs
        nbytes = lengths * row
        steps = offsets[:, 1:] - offsets[:, :-1]
        repeats = ((steps[:, 1:] == steps[:, :-1]).all(axis=0) & (nbytes[2:] == nbytes[1:-1])).any()
        (s, d), n = offsets.tolist(), nbytes.tolist()
        if not repeats:
            return ByteRuns(tuple(s), tuple(d), tuple(n))
        return _progressions(s, d, n, [])
    return _progressions(runs[0], runs[1], [length * row for length in runs[2]], [])


def _progressions(s: list[int], d: list[int], n: list[int], progressions: list[Progression]) -> ByteRuns:
    """``ByteRuns`` of single runs ``s``, ``d``, ``n`` (bytes) and ``progressions``: runs evenly spaced on
    both sides (at least ``MIN_PROGRESSION`` of equal length) join the progressions."""
    if len(n) < MIN_PROGRESSION or not _steps_repeat(s, d):
        return ByteRuns(tuple(s), tuple(d), tuple(n), tuple(progressions))
    r = len(n)
    singles: tuple[list[int], list[int], list[int]] = ([], [], [])
    i = 0
    while i < r:
        j = i + 1  # extend run i into a progression over runs i..j while the steps stay the same
        if j < r and n[j] == n[i] and s[j] > s[i] and d[j] > d[i]:
            s_step, d_step = s[j] - s[i], d[j] - d[i]
            while j + 1 < r and n[j + 1] == n[i] and s[j + 1] - s[j] == s_step and d[j + 1] - d[j] == d_step:
                j += 1
            if j + 1 - i >= MIN_PROGRESSION:
                progressions.append((s[i], d[i], n[i], j + 1 - i, s_step, d_step))
                i = j + 1
                continue
        for out, value in zip(singles, (s[i], d[i], n[i]), strict=True):
            out.append(value)
        i += 1
    return ByteRuns(tuple(singles[0]), tuple(singles[1]), tuple(singles[2]), tuple(progressions))


def _steps_repeat(s: list[int], d: list[int]) -> bool:
    """Whether some run is followed by two with equal steps on both sides (a progression may start)."""
    s_steps = list(map(operator.sub, s[1:], s[:-1]))
    same_s = list(map(operator.eq, s_steps[1:], s_steps[:-1]))
    if not any(same_s):  # scattered pages: decided on one side
        return False
    d_steps = list(map(operator.sub, d[1:], d[:-1]))
    return any(map(operator.and_, same_s, map(operator.eq, d_steps[1:], d_steps[:-1])))


def check_byte_runs_in_bounds(runs: ByteRuns, src: KVView, dst: KVView) -> None:
    """Invariant of every ``TransferPlan`` with byte runs: each run, at every K/V and layer, lies inside
    its buffer on both sides; progressions have positive steps and whole elements. The copy itself
    cannot leave the pools (``memoryview`` and numpy views are bounded), but a run outside them would
    stop a transfer halfway; this rejects such a plan before the first byte moves. Raises
    ``AssertionError`` naming the side (a bug in the plan, not in the caller)."""
    progressions = runs.progressions
    isz = _side(src).isz
    if any(
        count < 1 or s_step <= 0 or d_step <= 0 or any(v % isz for v in (s, d, n, s_step, d_step))
        for s, d, n, count, s_step, d_step in progressions
    ):
        raise AssertionError(f"invariant byte runs in bounds: a progression is malformed: {progressions}")
    nbytes = runs.nbytes
    if nbytes and min(nbytes) < 0:
        raise AssertionError(f"invariant byte runs in bounds: a run of negative length: {min(nbytes)}")
    widest = max(nbytes, default=0)
    for side, view, offsets, first, step in (
        ("source", src, runs.src_offsets, 0, 4),
        ("destination", dst, runs.dst_offsets, 1, 5),
    ):
        # Lowest first byte and highest end over the progressions and the single runs.
        starts = [p[first] for p in progressions]
        ends = [p[first] + p[2] + (p[3] - 1) * p[step] for p in progressions]
        if offsets:
            # The highest offset plus the widest run bounds every single run's end (the runs of
            # scattered pages have one width); only a bound past the buffer needs the exact end.
            starts.append(min(offsets))
            ends.append(max(offsets) + widest)
        if not starts:
            continue
        top, extent = _side(view).top, view.extent
        if max(ends) + top > extent and offsets:
            ends[-1] = max(map(operator.add, offsets, nbytes))
        lo, end = min(starts), max(ends)
        if lo < 0 or end + top > extent:
            raise AssertionError(
                f"invariant byte runs in bounds: a {side} run ends at byte {end} (+{top} for the last K/V "
                f"and layer) in a buffer of {extent} bytes; lowest offset {lo}"
            )


def _transfer_kv_bytes(plan: TransferPlan, src_layers: range, dst_layers: range) -> None:
    """Copy a plan's ``ByteRuns``: each single run per (K/V, layer) as one slice assignment between
    ``memoryview``s of the two buffers (a ``memcpy`` without a tensor view, a dispatch or a Python loop
    iteration in between: ``map`` drives it, and the slices are the plan's); each progression with one
    strided numpy copy covering K/V and the layers (numpy copies each row with ``memcpy`` as well).

    A ``memoryview`` slice never reaches past its buffer and an assignment of unequal lengths raises,
    so even a broken plan cannot write outside the pools; ``check_byte_runs_in_bounds`` rejects one
    before the first byte moves."""
    src, dst, runs = plan.src, plan.dst, plan.byte_runs
    assert runs is not None  # run_transfer dispatches here only for plans with byte runs
    isz = _side(src).isz
    src_mem, dst_mem = plan.memory
    consume = deque[object](maxlen=0).extend
    for kv in range(src.num_kv):
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            s_mem = src_mem[(kv * src.kv_stride + s_layer * src.layer_stride) * isz :]
            d_mem = dst_mem[(kv * dst.kv_stride + d_layer * dst.layer_stride) * isz :]
            consume(map(d_mem.__setitem__, runs.dst_slices, map(s_mem.__getitem__, runs.src_slices)))
    nl = len(src_layers)
    for s, d, n, count, s_step, d_step in runs.progressions:
        shape = (src.num_kv, nl, count, n)
        src_bytes, dst_bytes = (
            np.ndarray(
                shape,
                np.uint8,
                memory,
                offset + layers.start * view.layer_stride * isz,
                (view.kv_stride * isz, view.layer_stride * isz, step, 1),
            )
            for view, memory, offset, step, layers in (
                (src, src_mem, s, s_step, src_layers),
                (dst, dst_mem, d, d_step, dst_layers),
            )
        )
        np.copyto(dst_bytes, src_bytes)


@dataclass(frozen=True)
class TransferPlan:
    """The index work of one transfer, done once and reused for each of its layers.

    SGLang's controller runs ``move_indices`` once per operation and then loads layer by layer; a plan
    is that step plus validation and, for ``direct``, the run decomposition. ``matches`` recognises the
    same caller tensors (by identity and in-place version) so the per-layer calls of one load share it.
    Constructing a plan with ``byte_runs`` checks ``check_byte_runs_in_bounds``.
    """

    host_indices: torch.Tensor  # the caller's tensors, kept to recognise them
    device_indices: torch.Tensor
    versions: tuple[int, int]
    src: KVView
    dst: KVView
    io_backend: IOBackend
    src_idx: torch.Tensor  # validated; on the kernel's device (kernel) or the CPU (direct)
    dst_idx: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]  # direct with a GPU side: storage offsets and slot counts
    byte_runs: ByteRuns | None = None  # direct between CPU buffers (byte_runs_eligible)
    rows: RowCopy | None = None  # direct between CPU buffers, many short runs (instead of byte_runs)
    native_runs: NativeRuns | None = None  # direct between CPU buffers, planned in C (csrc/transfer.c)

    def __post_init__(self) -> None:
        if self.byte_runs is not None:
            check_byte_runs_in_bounds(self.byte_runs, self.src, self.dst)
        if self.rows is not None:
            check_rows_in_bounds(self.rows, self.src, self.dst)

    @property
    def memory(self) -> tuple[memoryview, memoryview]:
        """The source and destination buffers' bytes (CPU plans with byte runs), built once per pool view."""
        return self.src.raw, self.dst.raw

    @functools.cached_property
    def row_arrays(self) -> tuple[npt.NDArray[np.void], npt.NDArray[np.void]]:
        """The source and destination buffers as numpy arrays of rows (plans with ``rows``)."""
        out = []
        for view, memory in zip((self.src, self.dst), self.memory, strict=True):
            row = view.item_numel * view.buffer.element_size()
            out.append(np.frombuffer(memory, dtype=np.dtype((np.void, row)), count=view.extent // row))
        return out[0], out[1]

    def matches(
        self,
        src: KVView,
        dst: KVView,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io: IOBackend,
    ) -> bool:
        return (
            self.host_indices is host_indices
            and self.device_indices is device_indices
            and self.versions == (host_indices._version, device_indices._version)
            and self.src.buffer is src.buffer
            and self.dst.buffer is dst.buffer
            and self.io_backend is io
        )


def plan_transfer(
    src: KVView,
    dst: KVView,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    io_backend: IOBackend,
    host_is_src: bool,
) -> TransferPlan:
    """Validate and prepare ``host_indices[i] <-> device_indices[i]`` for ``io_backend`` (already checked
    by ``check_supported``).

    Raises ``UsageError`` for index arrays that are not 1-D integers, differ in length, hold slots out of
    range or name a destination slot twice, and for pools of different KV shapes or dtypes.
    """
    s_side, d_side = _side(src), _side(dst)
    if s_side.kind != d_side.kind:
        raise UsageError("source and destination pools hold KV of different shapes or dtypes")
    versions = (host_indices._version, device_indices._version)
    host_idx, dev_idx = _as_index("host indices", host_indices), _as_index("device indices", device_indices)
    if host_idx.shape != dev_idx.shape:
        raise UsageError(f"index arrays differ in length: {host_idx.numel()} vs {dev_idx.numel()}")
    host_view, dev_view = (src, dst) if host_is_src else (dst, src)
    if io_backend is IOBackend.KERNEL:
        _check_values("host indices", host_idx, _slots(host_view), unique=not host_is_src)
        _check_values("device indices", dev_idx, _slots(dev_view), unique=host_is_src)
        host_idx, dev_idx = move_indices(host_idx, dev_idx, io_backend, dev_view.buffer.device)
        src_idx, dst_idx = (host_idx, dev_idx) if host_is_src else (dev_idx, host_idx)
        return TransferPlan(
            host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, ()
        )
    host_idx, dev_idx = move_indices(host_idx, dev_idx, io_backend, dev_view.buffer.device)
    src_idx, dst_idx = (host_idx, dev_idx) if host_is_src else (dev_idx, host_idx)
    if byte_runs_eligible(src, dst):  # the C path, else byte runs or rows
        fast = native_transfer()
        if fast is not None:
            planned = _native_runs(fast, src_idx, dst_idx, s_side, d_side, host_is_src, src.num_kv)
            return TransferPlan(
                host_indices,
                device_indices,
                versions,
                src,
                dst,
                io_backend,
                src_idx,
                dst_idx,
                (),
                native_runs=planned,
            )
        isz = src.buffer.element_size()
        runs = _direct_runs(src_idx, dst_idx, src, dst, host_is_src, isz)
        count = len(runs[-1])
        if (
            count >= ROW_COPY_MIN_RUNS
            and src_idx.numel() * src.item_numel * isz < ROW_COPY_MAX_BYTES * count
            and row_copy_eligible(src, dst)
        ):
            rows = RowCopy(
                _slot_offsets(src, src_idx.numpy(), 1) // src.item_numel,
                _slot_offsets(dst, dst_idx.numpy(), 1) // dst.item_numel,
            )
            return TransferPlan(
                host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, (), rows=rows
            )
        byte_runs = _byte_runs(src, runs)
        return TransferPlan(
            host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, (), byte_runs
        )
    runs = _direct_runs(src_idx, dst_idx, src, dst, host_is_src, 1)
    if len(runs) == 2:
        (s, d), lengths = runs[0].tolist(), runs[1].tolist()
    else:
        s, d, lengths = runs
    s_base, d_base = int(src.buffer.storage_offset()), int(dst.buffer.storage_offset())
    gpu_runs = zip([x + s_base for x in s], [x + d_base for x in d], lengths, strict=True)
    return TransferPlan(
        host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, tuple(gpu_runs)
    )


def run_transfer(plan: TransferPlan, src_layers: range, dst_layers: range) -> None:
    """Copy the planned slots for layers ``src_layers -> dst_layers`` (equal lengths, step 1, in range).
    Raises ``UsageError`` for other layer ranges."""
    if not (
        len(src_layers) == len(dst_layers)
        and src_layers.step == dst_layers.step == 1
        and min(src_layers.start, dst_layers.start) >= 0
        and src_layers.stop <= plan.src.layer_num
        and dst_layers.stop <= plan.dst.layer_num
    ):
        raise UsageError(f"layers {src_layers} -> {dst_layers} are out of range")
    if plan.native_runs is not None:
        _transfer_kv_native(plan.native_runs, src_layers, dst_layers)
    elif plan.rows is not None:
        _transfer_kv_rows(plan, src_layers, dst_layers)
    elif plan.byte_runs is not None:
        _transfer_kv_bytes(plan, src_layers, dst_layers)
    elif plan.io_backend is IOBackend.DIRECT:
        transfer_kv_direct(plan.src, plan.dst, plan.runs, src_layers, dst_layers)
    else:
        transfer_kv_kernel(plan.src, plan.dst, plan.src_idx, plan.dst_idx, src_layers, dst_layers)


def _transfer_kv_rows(plan: TransferPlan, src_layers: range, dst_layers: range) -> None:
    """Copy a plan's ``RowCopy``: the rows of every (K/V, layer) pair of the call, gathered then scattered
    (numpy checks every row number before it copies)."""
    rows = plan.rows
    assert rows is not None  # run_transfer dispatches here only for plans with rows
    src_rows, dst_rows = plan.row_arrays
    s = (_row_bases(plan.src, src_layers)[:, None] + rows.src_rows).ravel()
    d = (_row_bases(plan.dst, dst_layers)[:, None] + rows.dst_rows).ravel()
    dst_rows[d] = src_rows[s]


def _slots(view: KVView) -> int:
    """Token slots a view addresses (its buffer's elements per layer and K/V, in tokens)."""
    return view.buffer.numel() // (view.num_kv * view.layer_num * view.item_numel)
