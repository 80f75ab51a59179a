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
  below libc's ``memcpy`` on some CPUs; there the runs are cut on the slots alone and finished per run
  in Python (``_cpu_plan``: up to ``SLOT_RUNS`` runs; a run across pages of a ``page_first_direct``
  side becomes its partial pages and one progression of its whole pages), and the plan holds them as
  byte slices (``ByteRuns``,
  computed once, checked against both buffers' extents whenever a plan is built) and each run is one
  slice assignment between ``memoryview``s of the two buffers per K/V and layer, except that runs
  evenly spaced on both sides (consecutive pages) are copied together by one strided numpy copy. When
  the runs are many and short (``ROW_COPY_MIN_RUNS``, ``ROW_COPY_MAX_BYTES``: scattered single tokens
  of a small KV, where the per-run Python cost dwarfs the bytes) the plan holds ``RowCopy`` instead:
  every slot's row (its K or V of one layer, ``item_numel`` elements) by number, and a call is one numpy
  gather and one scatter of whole rows for all K/V and layers.

The config resolver (``HiCacheConfig.resolve``) performs the automatic rewrites of seed §5.3/§5.6 with
a ``ConfigRewriteWarning``; this module only sees resolved combinations and rejects the rest.
"""

from __future__ import annotations

import functools
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import compress, repeat
from typing import Final, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from refcache.config import AttentionKind, IOBackend, MemLayout
from refcache.errors import ConfigError, UsageError
from refcache.gpu.kernels import transfer_kv_kernel
from refcache.gpu.layout import KVView

__all__ = [
    "DISPATCH",
    "ROW_COPY_MAX_BYTES",
    "ROW_COPY_MIN_RUNS",
    "ByteRuns",
    "RowCopy",
    "TransferPlan",
    "byte_runs_eligible",
    "check_byte_runs_in_bounds",
    "check_supported",
    "move_indices",
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
    return host_indices.cpu(), device_indices.cpu()


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
    if view.token_major:
        return slots * (view.page_stride * unit)
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
            step = view.page_stride * unit
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
    """What the CPU planner needs of one pool view, worked out once per view (``_side``)."""

    kind: tuple[object, ...]  # (num_kv, head_num, head_dim, dtype): equal on both sides of a transfer
    cpu_rows: bool  # byte runs possible on this side: a CPU buffer, a slot's heads contiguous
    slots: int  # token slots the view addresses
    row: int  # bytes of one slot's K or V in one layer, and between consecutive slots inside a page
    page_size: int  # slots consecutive only inside a page of this many; 0 where consecutive everywhere
    jump: int  # extra bytes between the last slot of a page and the first of the next
    isz: int  # bytes of an element
    top: int  # bytes from layer 0 of K/V 0 to the first byte of the last K/V and layer


_SIDE_KEY: Final = "_transfer_side"  # the view's own attribute dict caches its _Side


def _side(view: KVView) -> _Side:
    """``view``'s ``_Side``, kept in the view's attribute dict (as ``functools.cached_property`` keeps its
    values): pools build their view once, so a plan looks the strides and sizes up instead of asking the
    buffer (every torch getter is a cold call after a large copy)."""
    cached: _Side | None = view.__dict__.get(_SIDE_KEY)
    if cached is None:
        buffer = view.buffer
        isz = buffer.element_size()
        cached = _Side(
            (view.num_kv, view.head_num, view.head_dim, buffer.dtype),
            buffer.is_cpu
            and view.token_stride == view.item_numel
            and (view.head_stride == view.head_dim or view.head_num == 1),
            _slots(view),
            view.token_stride * isz,
            0 if view.token_major else view.page_size,
            0 if view.token_major else (view.page_stride - view.page_size * view.token_stride) * isz,
            isz,
            ((view.num_kv - 1) * view.kv_stride + (view.layer_num - 1) * view.layer_stride) * isz,
        )
        view.__dict__[_SIDE_KEY] = cached
    return cached


_INT64: Final = np.dtype(np.int64)
SLOT_RUNS: Final = 256  # runs; up to this many a CPU plan is cut on slots and finished in Python (_cpu_plan)


def _offsets(slots: list[int], side: _Side) -> list[int]:
    """Byte offsets of ``slots`` (from layer 0 of K/V 0) on ``side``."""
    row, ps, jump = side.row, side.page_size, side.jump
    if not ps:
        return list(map(row.__mul__, slots))
    return [x * row + x // ps * jump for x in slots]


def _nbytes(lengths: list[int], row: int) -> list[int]:
    """``length * row`` for each of ``lengths``; one shared int when all are equal (scattered pages): after
    a large copy every new Python object costs a cache miss or two."""
    if lengths.count(lengths[0]) == len(lengths):
        return [lengths[0] * row] * len(lengths)
    return list(map(row.__mul__, lengths))


def _first_slots(a: Int64s, b: Int64s, at: Int64s) -> tuple[list[int], list[int], list[int]]:
    """The first source and destination slot and the length of each run, given ``at``: the pairs before
    which a new run begins (after pair 0)."""
    at += 1
    firsts = at.tolist()
    s0, d0 = [a.item(0), *a.take(at).tolist()], [b.item(0), *b.take(at).tolist()]
    return s0, d0, list(map(operator.sub, [*firsts, len(a)], [0, *firsts]))


def _merge(s0: list[int], d0: list[int], lengths: list[int]) -> tuple[list[int], list[int], list[int]]:
    """Runs sorted by host slot, each that continues the one before it on both sides joined to it."""
    ms, md, ml = [s0[0]], [d0[0]], [lengths[0]]
    for s, d, length in zip(s0[1:], d0[1:], lengths[1:], strict=True):
        if s == ms[-1] + ml[-1] and d == md[-1] + ml[-1]:
            ml[-1] += length
        else:
            ms.append(s)
            md.append(d)
            ml.append(length)
    return ms, md, ml


def _cpu_plan(
    a: Int64s, b: Int64s, src: _Side, dst: _Side, host_is_src: bool
) -> tuple[list[int], list[int], list[int], list[Progression]] | None:
    """The byte runs of a direct transfer between two CPU buffers (both ``cpu_rows``) of source slots ``a``
    and destination slots ``b``, or ``None`` when the slots make more than ``SLOT_RUNS`` runs (the numpy
    path of ``_direct_runs`` then).

    The same copies as ``_direct_runs`` with fewer array calls: the runs are cut on the slots alone (pairs
    consecutive on both sides; five array operations of one kind and a ``nonzero``), then range-checked,
    sorted by host slot, merged, checked for a destination slot named twice, and split at the page
    boundaries of a paged side in Python, per run. A run that crosses pages of one paged side (or of two
    whose pages line up) is its partial first page, its whole pages as one progression (``count``
    evenly spaced runs) and its partial last page: consecutive pages of a ``page_first_direct`` pool
    never become a list of runs. Returns ``(src_offsets, dst_offsets, nbytes, progressions)``, the single
    runs in host address order.

    Raises ``UsageError`` for a slot outside either pool and for a destination slot named twice."""
    n = len(a)
    if n == 0:
        return [], [], [], []
    if n == 1:
        s0, d0, lengths = [a.item(0)], [b.item(0)], [1]
    else:
        # Pair i + 1 continues pair i exactly when both differences are 1 (wrapping int64 differences
        # cannot fake one: a run's first slot and length bound all of it, and both are checked below).
        cut = a[1:] - a[:-1]
        cut -= 1
        other = b[1:] - b[:-1]
        other -= 1
        cut |= other
        at = cut.nonzero()[0]
        if len(at) + 1 > SLOT_RUNS:
            return None
        if not len(at):  # one run
            s0, d0, lengths = [a.item(0)], [b.item(0)], [n]
        else:
            s0, d0, lengths = _first_slots(a, b, at)

    for side, first, bound in ((0, s0, src.slots), (1, d0, dst.slots)):
        lo, hi = min(first), max(map(operator.add, first, lengths)) - 1
        if lo < 0 or hi >= bound:
            name = "host indices" if side == (0 if host_is_src else 1) else "device indices"
            raise UsageError(f"{name} holds slots outside [0, {bound}): min {lo}, max {hi}")
    host = s0 if host_is_src else d0
    if any(map(operator.lt, host[1:], host[:-1])):
        order = sorted(range(len(host)), key=host.__getitem__)
        s0, d0, lengths = [s0[i] for i in order], [d0[i] for i in order], [lengths[i] for i in order]
        s_end = list(map(operator.add, s0, lengths))
        if any(map(operator.eq, s0[1:], s_end)) and any(
            map(operator.eq, d0[1:], map(operator.add, d0, lengths))
        ):
            s0, d0, lengths = _merge(s0, d0, lengths)
    # Two runs share a destination slot exactly when their slot intervals overlap: when some k-th lowest
    # first slot lies below the (k-1)-th lowest end (a backup's destination is the host side, sorted).
    d_first, d_end = d0, list(map(operator.add, d0, lengths))
    if host_is_src:
        d_first, d_end = sorted(d_first), sorted(d_end)
    if any(map(operator.lt, d_first[1:], d_end)):
        name = "device indices" if host_is_src else "host indices"
        raise UsageError(f"{name} name a destination slot twice")
    row = src.row
    s_ps, d_ps = src.page_size, dst.page_size
    if not (s_ps or d_ps):
        return list(map(row.__mul__, s0)), list(map(row.__mul__, d0)), _nbytes(lengths, row), []
    so, do, nb = _offsets(s0, src), _offsets(d0, dst), _nbytes(lengths, row)
    # Runs that cross a page boundary of a paged side (consecutive pages): cut there. Scattered pages
    # have none, so the rest stays per run, as it is.
    crosses = [False] * len(lengths)
    for ps, first in ((s_ps, s0), (d_ps, d0)):
        if ps:
            ends = map(operator.add, map(ps.__rmod__, first), lengths)  # end of the run in its first page
            crosses = list(map(operator.or_, crosses, map(operator.gt, ends, repeat(ps))))
    if not any(crosses):
        return so, do, nb, []
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    progressions: list[Progression] = []
    done = 0
    for i in compress(range(len(crosses)), crosses):
        for part, whole in zip(out, (so, do, nb), strict=True):
            part += whole[done:i]
        _split_run(s0[i], d0[i], lengths[i], src, dst, out, progressions)
        done = i + 1
    for part, whole in zip(out, (so, do, nb), strict=True):
        part += whole[done:]
    return out[0], out[1], out[2], progressions


def _split_run(
    s: int,
    d: int,
    length: int,
    src: _Side,
    dst: _Side,
    out: tuple[list[int], list[int], list[int]],
    progressions: list[Progression],
) -> None:
    """Cut the run of ``length`` slots from ``s`` to ``d`` at the page boundaries of the paged sides:
    pieces appended to ``out`` (source offsets, destination offsets, bytes) in slot order, whole pages
    (at least ``MIN_PROGRESSION``) as one progression."""
    row, s_ps, s_jump, d_ps, d_jump = src.row, src.page_size, src.jump, dst.page_size, dst.jump
    ps = s_ps or d_ps
    if not (s_ps and d_ps) or (s_ps == d_ps and (s - d) % ps == 0):
        # Pieces: up to the first page boundary, whole pages, the rest (boundaries of both sides agree).
        head = min(-(s if s_ps else d) % ps, length)
        whole, tail = divmod(length - head, ps)
        pieces = [(s, d, head)] if head else []
        if whole >= MIN_PROGRESSION:
            s1, d1 = s + head, d + head
            progressions.append(
                (
                    s1 * row + (s1 // s_ps * s_jump if s_ps else 0),
                    d1 * row + (d1 // d_ps * d_jump if d_ps else 0),
                    ps * row,
                    whole,
                    ps * row + s_jump,
                    ps * row + d_jump,
                )
            )
        else:
            pieces += [(s + head + k * ps, d + head + k * ps, ps) for k in range(whole)]
        if tail:
            pieces.append((s + length - tail, d + length - tail, tail))
    else:  # pages of different sizes or phases on the two sides: cut at every boundary of either
        pieces, k = [], 0
        while k < length:
            m = min(length - k, s_ps - (s + k) % s_ps, d_ps - (d + k) % d_ps)
            pieces.append((s + k, d + k, m))
            k += m
    for x, y, m in pieces:
        out[0].append(x * row + (x // s_ps * s_jump if s_ps else 0))
        out[1].append(y * row + (y // d_ps * d_jump if d_ps else 0))
        out[2].append(m * row)


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
    if io_backend is IOBackend.DIRECT and byte_runs_eligible(src, dst):
        plan = _plan_cpu_direct(src, dst, s_side, d_side, host_indices, device_indices, versions, host_is_src)
        if plan is not None:
            return plan
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
    if byte_runs_eligible(src, dst):
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


def _plan_cpu_direct(
    src: KVView,
    dst: KVView,
    s_side: _Side,
    d_side: _Side,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    versions: tuple[int, int],
    host_is_src: bool,
) -> TransferPlan | None:
    """``plan_transfer`` for ``direct`` between two CPU buffers with byte runs: ``_cpu_plan`` on the
    caller's index arrays, or ``None`` for index tensors that are not 1-D int64 CPU tensors of equal
    length (``plan_transfer``'s general path converts or rejects them) and for slots making more than
    ``SLOT_RUNS`` runs. A few dozen Python steps and a dozen array calls for the common case."""
    src_idx, dst_idx = (host_indices, device_indices) if host_is_src else (device_indices, host_indices)
    try:  # the index tensors' own numpy views: the CPU tensors' checks are numpy's attribute reads
        a, b = src_idx.numpy(), dst_idx.numpy()
    except (TypeError, RuntimeError):  # a GPU tensor (or one needing grad): the general path
        return None
    if not (a.dtype is _INT64 and b.dtype is _INT64 and a.ndim == 1 and a.shape == b.shape):
        return None
    runs = _cpu_plan(a, b, s_side, d_side, host_is_src)
    if runs is None:
        return None
    s, d, n, progressions = runs
    count = len(n) + sum(p[3] for p in progressions)
    if (
        count >= ROW_COPY_MIN_RUNS
        and len(a) * s_side.row < ROW_COPY_MAX_BYTES * count
        and row_copy_eligible(src, dst)
    ):
        rows = RowCopy(_slot_offsets(src, a, 1) // src.item_numel, _slot_offsets(dst, b, 1) // dst.item_numel)
        return TransferPlan(
            host_indices,
            device_indices,
            versions,
            src,
            dst,
            IOBackend.DIRECT,
            src_idx,
            dst_idx,
            (),
            rows=rows,
        )
    byte_runs = _progressions(s, d, n, progressions)
    return TransferPlan(
        host_indices, device_indices, versions, src, dst, IOBackend.DIRECT, src_idx, dst_idx, (), byte_runs
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
    if plan.rows is not None:
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
