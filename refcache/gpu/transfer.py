"""Host <-> device KV transfers: the io backend × layout dispatch table of seed §5.4.

The host pools call this module for a per-layer load (host -> device) and an all-layer backup
(device -> host). ``check_supported`` checks the (io backend, layout, attention) combination against
``DISPATCH`` (the rows of the seed's table; anything else raises ``ConfigError``, as SGLang raises
``ValueError``); ``plan_transfer`` validates the index arrays and prepares them once per operation
(a load's per-layer calls share the plan); ``run_transfer`` copies a layer range with one of two
mechanisms:

* ``kernel``: the Triton gather/scatter in ``kernels.py``, indices moved to the kernel's device.
* ``direct``: plain memory copies. As in SGLang's ``move_indices`` the host indices are sorted and the
  device indices permuted alike (seed §5.4 ①), so that slots that are consecutive on both sides form
  runs; a run never crosses a page of a ``page_first_direct`` side, so a backup copies page by page
  and a load page by layer (``transfer_kv_all_layer_direct_lf_pf`` / ``transfer_kv_per_layer_direct_pf_lf``).
  With a GPU on either side each run is one ``copy_`` (``cudaMemcpyAsync``) covering K and V and every
  layer of the call. Between two CPU buffers (no GPU) a ``copy_`` of a 5-D view costs several
  microseconds of view creation and dispatch, about as much as copying a 16-token page; there the
  plan holds the runs as byte offsets (``ByteRuns``, computed once, checked against both buffers'
  extents whenever a plan is built) and each run is one ``ctypes.memmove`` per K/V and layer, except
  that runs evenly spaced on both sides (consecutive pages) are copied together by one strided
  ``copy_``.

The config resolver (``HiCacheConfig.resolve``) performs the automatic rewrites of seed §5.3/§5.6 with
a ``ConfigRewriteWarning``; this module only sees resolved combinations and rejects the rest.
"""

from __future__ import annotations

import ctypes
import operator
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import torch

from refcache.config import AttentionKind, IOBackend, MemLayout
from refcache.errors import ConfigError, UsageError
from refcache.gpu.kernels import transfer_kv_kernel
from refcache.gpu.layout import KVView

__all__ = [
    "DISPATCH",
    "ByteRuns",
    "TransferPlan",
    "byte_runs_eligible",
    "check_byte_runs_in_bounds",
    "check_supported",
    "move_indices",
    "plan_transfer",
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
    to the CPU, sort the host indices and permute the device indices the same way."""
    if io_backend is IOBackend.KERNEL:
        return host_indices.to(device, non_blocking=True), device_indices.to(device, non_blocking=True)
    # numpy: its calls cost less than torch's on these small arrays (specs/data-plane.md §9).
    host, dev = host_indices.cpu().numpy(), device_indices.cpu().numpy()
    order = np.argsort(host, kind="stable")
    return torch.from_numpy(host[order]), torch.from_numpy(dev[order])


def _as_index(name: str, indices: torch.Tensor) -> torch.Tensor:
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise UsageError(
            f"{name} must be a 1-D int64 tensor, got shape {tuple(indices.shape)} {indices.dtype}"
        )
    return indices.to(torch.int64)


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


def _runs(
    src: torch.Tensor, dst: torch.Tensor, src_view: KVView, dst_view: KVView
) -> tuple[list[int], list[int], list[int]]:
    """First source slot, first destination slot and length of the maximal runs of pairs consecutive on
    both sides, cut at the page boundaries of a side that is not token-major (``page_first_direct``,
    ``page_head``); runs in pair order. Exact for any slot values (negative, out of range), so range
    checks can use the runs.

    The slot arrays are the only per-token work, in a handful of numpy operations (cheaper per call
    than torch's on arrays this small); everything after works on the runs as lists (few: one per page
    for scattered pages).
    """
    n = src.numel()
    if n == 0:
        return [], [], []
    pair = np.stack((src.numpy(), dst.numpy()))
    keys = pair
    for side, view in enumerate((src_view, dst_view)):
        if not view.token_major:
            # A gap after every page of that side: its slots are consecutive only inside a page.
            keys = keys.copy() if keys is pair else keys
            keys[side] += pair[side] // view.page_size
    starts = np.empty(n, dtype=bool)  # starts[i]: pair i begins a run
    starts[0] = True
    np.any(np.diff(keys, axis=1) != 1, axis=0, out=starts[1:])
    first = np.flatnonzero(starts)
    src_first, dst_first = pair[:, first].tolist()
    at = first.tolist()
    return src_first, dst_first, list(map(operator.sub, [*at[1:], n], at))


def _check_runs(name: str, firsts: list[int], lengths: list[int], limit: int, unique: bool) -> None:
    """Raise ``UsageError`` when a run holds a slot outside ``[0, limit)`` or, for a destination
    (``unique``), two runs share a slot: every run covers the slots ``[first, first + length)``, so a slot
    repeats exactly when two of these intervals overlap, which sorting the runs by first slot reveals
    as an interval that begins before its predecessor ends."""
    if not firsts:
        return
    lo, hi = min(firsts), max(map(operator.add, firsts, lengths)) - 1
    if lo < 0 or hi >= limit:
        raise UsageError(f"{name} holds slots outside [0, {limit}): min {lo}, max {hi}")
    if unique:
        end = lo
        for first, length in sorted(zip(firsts, lengths, strict=True)):
            if first < end:
                raise UsageError(f"{name} name a destination slot twice")
            end = first + length


def _offsets(view: KVView, slots: list[int], scale: int) -> list[int]:
    """``view.offset(0, 0, slot) * scale`` for many slots (``scale``: bytes per element, or 1)."""
    ps = view.page_size
    page_stride, token_stride = view.page_stride * scale, view.token_stride * scale
    if ps == 1:
        return [slot * page_stride for slot in slots]
    return [(slot // ps) * page_stride + (slot % ps) * token_stride for slot in slots]


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
MIN_PROGRESSION: Final = 4  # runs; below this, memmoves cost less than building two strided views


@dataclass(frozen=True)
class ByteRuns:
    """The runs of a direct plan between two CPU buffers, in bytes from each buffer's ``data_ptr()`` and
    for layer 0 of K; a call copies each once per (K/V, layer), adding that pair's distance.

    Single runs: ``nbytes[i]`` contiguous bytes at ``src_offsets[i]`` go to ``dst_offsets[i]`` (in
    source address order), one ``ctypes.memmove`` each. Progressions ``(src, dst, nbytes, count,
    src_step, dst_step)``: ``count`` runs of ``nbytes`` spaced ``src_step`` and ``dst_step`` (> 0)
    apart, as consecutive pages give, one strided ``copy_`` each.
    """

    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    progressions: tuple[Progression, ...] = ()


def byte_runs_eligible(src: KVView, dst: KVView) -> bool:
    """Whether a direct plan between ``src`` and ``dst`` gets ``ByteRuns``: both buffers on the CPU, and
    a slot's heads contiguous and consecutive slots adjacent within a page on both sides (so that a run
    is one block of bytes per K/V and layer; true of every layout with a direct row)."""
    return all(
        v.buffer.is_cpu
        and v.token_stride == v.item_numel
        and (v.head_stride == v.head_dim or v.head_num == 1)
        for v in (src, dst)
    )


def _byte_runs(
    src: KVView, dst: KVView, src_first: list[int], dst_first: list[int], lengths: list[int]
) -> ByteRuns:
    isz = src.buffer.element_size()
    s, d = _offsets(src, src_first, isz), _offsets(dst, dst_first, isz)
    run_bytes = src.item_numel * isz
    n = [length * run_bytes for length in lengths]
    # Progressions need a run whose next two have the same steps; scattered pages have none, so one
    # pass of C-level maps decides whether to look for them at all.
    s_steps, d_steps = list(map(operator.sub, s[1:], s)), list(map(operator.sub, d[1:], d))
    if not any(map(operator.eq, s_steps, s_steps[1:])) or not any(map(operator.eq, d_steps, d_steps[1:])):
        return ByteRuns(tuple(s), tuple(d), tuple(n))
    singles: tuple[list[int], list[int], list[int]] = ([], [], [])
    progressions: list[Progression] = []
    i, r = 0, len(n)
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


def _extent(view: KVView) -> int:
    """Bytes of the buffer's storage from its ``data_ptr()`` on."""
    buffer = view.buffer
    return int(buffer.untyped_storage().nbytes()) - int(buffer.storage_offset()) * buffer.element_size()


def check_byte_runs_in_bounds(runs: ByteRuns, src: KVView, dst: KVView) -> None:
    """Invariant of every ``TransferPlan`` with byte runs: each run, at every K/V and layer, lies inside
    its buffer on both sides, so ``memmove`` can never touch memory outside the two pools; progressions
    have positive steps and whole elements (the strided views need them). Raises ``AssertionError``
    naming the side (a bug in the plan, not in the caller)."""
    progressions = runs.progressions
    isz = src.buffer.element_size()
    if any(
        count < 1 or s_step <= 0 or d_step <= 0 or any(v % isz for v in (s, d, n, s_step, d_step))
        for s, d, n, count, s_step, d_step in progressions
    ):
        raise AssertionError(f"invariant byte runs in bounds: a progression is malformed: {progressions}")
    for side, view, offsets, first, step in (
        ("source", src, runs.src_offsets, 0, 4),
        ("destination", dst, runs.dst_offsets, 1, 5),
    ):
        # (lowest first byte, highest end) over the single runs and the progressions.
        spans = [(p[first], p[first] + p[2] + (p[3] - 1) * p[step]) for p in progressions]
        if offsets:
            spans.append((min(offsets), max(map(operator.add, offsets, runs.nbytes))))
        if not spans:
            continue
        lo, end = min(lo for lo, _ in spans), max(end for _, end in spans)
        top = ((view.num_kv - 1) * view.kv_stride + (view.layer_num - 1) * view.layer_stride) * isz
        extent = _extent(view)
        if lo < 0 or min(runs.nbytes, default=0) < 0 or end + top > extent:
            raise AssertionError(
                f"invariant byte runs in bounds: a {side} run ends at byte {end} (+{top} for the last K/V "
                f"and layer) in a buffer of {extent} bytes; lowest offset {lo}"
            )


def _transfer_kv_bytes(plan: TransferPlan, src_layers: range, dst_layers: range) -> None:
    """Copy a plan's ``ByteRuns``: single runs with ``ctypes.memmove`` per (K/V, layer), a call into
    libc per block of bytes without a tensor view, a dispatch or a Python loop iteration in between
    (``map`` drives it); each progression with one strided ``copy_`` covering K/V and the layers."""
    src, dst, runs = plan.src, plan.dst, plan.byte_runs
    assert runs is not None  # run_transfer dispatches here only for plans with byte runs
    isz = src.buffer.element_size()
    s_ptr, d_ptr = src.buffer.data_ptr(), dst.buffer.data_ptr()
    memmove, consume = ctypes.memmove, deque[object](maxlen=0).extend
    for kv in range(src.num_kv):
        for s_layer, d_layer in zip(src_layers, dst_layers, strict=True):
            s_base = s_ptr + (kv * src.kv_stride + s_layer * src.layer_stride) * isz
            d_base = d_ptr + (kv * dst.kv_stride + d_layer * dst.layer_stride) * isz
            consume(
                map(
                    memmove,
                    map(d_base.__add__, runs.dst_offsets),
                    map(s_base.__add__, runs.src_offsets),
                    runs.nbytes,
                )
            )
    nl = len(src_layers)
    for s, d, n, count, s_step, d_step in runs.progressions:
        shape = (src.num_kv, nl, count, n // isz)
        views = [
            view.buffer.as_strided(
                shape,
                (view.kv_stride, view.layer_stride, step // isz, 1),
                view.buffer.storage_offset() + offset // isz + layers.start * view.layer_stride,
            )
            for view, offset, step, layers in ((src, s, s_step, src_layers), (dst, d, d_step, dst_layers))
        ]
        views[1].copy_(views[0])


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
    src_idx: torch.Tensor  # validated, moved (kernel) or sorted (direct)
    dst_idx: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]  # direct with a GPU side: storage offsets and slot counts
    byte_runs: ByteRuns | None = None  # direct between CPU buffers (byte_runs_eligible)

    def __post_init__(self) -> None:
        if self.byte_runs is not None:
            check_byte_runs_in_bounds(self.byte_runs, self.src, self.dst)

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
    if (src.num_kv, src.head_num, src.head_dim, src.buffer.dtype) != (
        dst.num_kv,
        dst.head_num,
        dst.head_dim,
        dst.buffer.dtype,
    ):
        raise UsageError("source and destination pools hold KV of different shapes or dtypes")
    host_idx, dev_idx = _as_index("host indices", host_indices), _as_index("device indices", device_indices)
    if host_idx.shape != dev_idx.shape:
        raise UsageError(f"index arrays differ in length: {host_idx.numel()} vs {dev_idx.numel()}")
    host_view, dev_view = (src, dst) if host_is_src else (dst, src)
    versions = (host_indices._version, device_indices._version)
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
    src_first, dst_first, lengths = _runs(src_idx, dst_idx, src, dst)
    host_first, dev_first = (src_first, dst_first) if host_is_src else (dst_first, src_first)
    _check_runs("host indices", host_first, lengths, _slots(host_view), unique=not host_is_src)
    _check_runs("device indices", dev_first, lengths, _slots(dev_view), unique=host_is_src)
    if byte_runs_eligible(src, dst):
        byte_runs = _byte_runs(src, dst, src_first, dst_first, lengths)
        return TransferPlan(
            host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, (), byte_runs
        )
    base = [int(v.buffer.storage_offset()) for v in (src, dst)]
    runs = zip(
        [offset + base[0] for offset in _offsets(src, src_first, 1)],
        [offset + base[1] for offset in _offsets(dst, dst_first, 1)],
        lengths,
        strict=True,
    )
    return TransferPlan(
        host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, tuple(runs)
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
    if plan.byte_runs is not None:
        _transfer_kv_bytes(plan, src_layers, dst_layers)
    elif plan.io_backend is IOBackend.DIRECT:
        transfer_kv_direct(plan.src, plan.dst, plan.runs, src_layers, dst_layers)
    else:
        transfer_kv_kernel(plan.src, plan.dst, plan.src_idx, plan.dst_idx, src_layers, dst_layers)


def _slots(view: KVView) -> int:
    """Token slots a view addresses (its buffer's elements per layer and K/V, in tokens)."""
    return view.buffer.numel() // (view.num_kv * view.layer_num * view.item_numel)
