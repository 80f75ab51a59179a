"""Host <-> device KV transfers: the io backend × layout dispatch table of seed §5.4.

The host pools call this module for a per-layer load (host -> device) and an all-layer backup
(device -> host). ``check_supported`` checks the (io backend, layout, attention) combination against
``DISPATCH`` (the rows of the seed's table; anything else raises ``ConfigError``, as SGLang raises
``ValueError``); ``plan_transfer`` validates the index arrays and prepares them once per operation
(a load's per-layer calls share the plan); ``run_transfer`` copies a layer range with one of two
mechanisms:

* ``kernel``: the Triton gather/scatter in ``kernels.py``, indices moved to the kernel's device.
* ``direct``: torch copies. As in SGLang's ``move_indices`` the host indices are sorted and the device
  indices permuted alike (seed §5.4 ①), so that slots that are consecutive on both sides form runs;
  each run is one ``copy_`` (``cudaMemcpyAsync`` on a GPU) covering K and V and every layer in the
  call. For ``page_first_direct`` a run never crosses a host page, so a backup copies page by page with
  all layers at once and a load copies page by layer (``transfer_kv_all_layer_direct_lf_pf`` /
  ``transfer_kv_per_layer_direct_pf_lf``).

The config resolver (``HiCacheConfig.resolve``) performs the automatic rewrites of seed §5.3/§5.6 with
a ``ConfigRewriteWarning``; this module only sees resolved combinations and rejects the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import torch

from refcache.config import AttentionKind, IOBackend, MemLayout
from refcache.errors import ConfigError, UsageError
from refcache.gpu.kernels import transfer_kv_kernel
from refcache.gpu.layout import KVView

__all__ = [
    "DISPATCH",
    "TransferPlan",
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
    host_sorted, order = host_indices.cpu().sort()
    return host_sorted, device_indices.cpu().index_select(0, order)


def _as_index(name: str, indices: torch.Tensor) -> torch.Tensor:
    if indices.dim() != 1 or indices.dtype not in (torch.int64, torch.int32):
        raise UsageError(
            f"{name} must be a 1-D int64 tensor, got shape {tuple(indices.shape)} {indices.dtype}"
        )
    return indices.to(torch.int64)


def _check_values(name: str, indices: torch.Tensor, limit: int, unique: bool, is_sorted: bool) -> None:
    """Range (and, for a destination, uniqueness) of CPU indices. CUDA index tensors are trusted (they
    come from the allocators): reading their values would synchronise the device."""
    if indices.device.type != "cpu" or not indices.numel():
        return
    lo, hi = (int(v) for v in torch.aminmax(indices))
    if lo < 0 or hi >= limit:
        raise UsageError(f"{name} holds slots outside [0, {limit}): min {lo}, max {hi}")
    if unique:
        ordered = indices if is_sorted else indices.sort().values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise UsageError(f"{name} name a destination slot twice")


def _runs(
    src: torch.Tensor, dst: torch.Tensor, src_view: KVView, dst_view: KVView
) -> list[tuple[int, int, int]]:
    """``(src_offset, dst_offset, length)`` of maximal runs of slots consecutive on both sides, cut at
    the page boundaries of a side that is not token-major (``page_first_direct``, ``page_head``).
    Offsets are storage offsets (elements) of the run's first slot in layer 0 of K."""
    n = src.numel()
    if n == 0:
        return []
    cut = (src[1:] != src[:-1] + 1) | (dst[1:] != dst[:-1] + 1)
    for idx, view in ((src, src_view), (dst, dst_view)):
        if not view.token_major:
            cut |= idx[1:] % view.page_size == 0
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), cut.nonzero().flatten() + 1])
    lengths = torch.diff(starts, append=torch.tensor([n]))
    offsets = [_storage_offsets(view, idx[starts]) for idx, view in ((src, src_view), (dst, dst_view))]
    return list(zip(offsets[0], offsets[1], lengths.tolist(), strict=True))


def _storage_offsets(view: KVView, slots: torch.Tensor) -> list[int]:
    """``view.offset(0, 0, slot)`` plus the buffer's storage offset, for many slots at once."""
    ps = view.page_size
    rel = (slots // ps) * view.page_stride + (slots % ps) * view.token_stride
    return (rel + int(view.buffer.storage_offset())).tolist()


def transfer_kv_direct(
    src: KVView, dst: KVView, runs: Sequence[tuple[int, int, int]], src_layers: range, dst_layers: range
) -> None:
    """One ``copy_`` per run (from ``_runs``), K and V and every layer of the call at once."""
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


@dataclass(frozen=True)
class TransferPlan:
    """The index work of one transfer, done once and reused for each of its layers.

    SGLang's controller runs ``move_indices`` once per operation and then loads layer by layer; a plan
    is that step plus validation and, for ``direct``, the run decomposition. ``matches`` recognises the
    same caller tensors (by identity and in-place version) so the per-layer calls of one load share it.
    """

    host_indices: torch.Tensor  # the caller's tensors, kept to recognise them
    device_indices: torch.Tensor
    versions: tuple[int, int]
    src: KVView
    dst: KVView
    io_backend: IOBackend
    src_idx: torch.Tensor  # validated, moved (kernel) or sorted (direct)
    dst_idx: torch.Tensor
    runs: tuple[tuple[int, int, int], ...]  # direct only

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
    direct = io_backend is IOBackend.DIRECT
    if direct:
        host_idx, dev_idx = move_indices(host_idx, dev_idx, io_backend, dev_view.buffer.device)
    _check_values("host indices", host_idx, _slots(host_view), unique=not host_is_src, is_sorted=direct)
    _check_values("device indices", dev_idx, _slots(dev_view), unique=host_is_src, is_sorted=False)
    if not direct:
        host_idx, dev_idx = move_indices(host_idx, dev_idx, io_backend, dev_view.buffer.device)
    src_idx, dst_idx = (host_idx, dev_idx) if host_is_src else (dev_idx, host_idx)
    runs = tuple(_runs(src_idx, dst_idx, src, dst)) if direct else ()
    versions = (host_indices._version, device_indices._version)
    return TransferPlan(host_indices, device_indices, versions, src, dst, io_backend, src_idx, dst_idx, runs)


def run_transfer(plan: TransferPlan, src_layers: range, dst_layers: range) -> None:
    """Copy the planned slots for layers ``src_layers -> dst_layers`` (equal lengths, in range)."""
    if len(src_layers) != len(dst_layers) or not (
        min(src_layers.start, dst_layers.start) >= 0
        and src_layers.stop <= plan.src.layer_num
        and dst_layers.stop <= plan.dst.layer_num
    ):
        raise UsageError(f"layers {src_layers} -> {dst_layers} are out of range")
    if plan.io_backend is IOBackend.DIRECT:
        transfer_kv_direct(plan.src, plan.dst, plan.runs, src_layers, dst_layers)
    else:
        transfer_kv_kernel(plan.src, plan.dst, plan.src_idx, plan.dst_idx, src_layers, dst_layers)


def _slots(view: KVView) -> int:
    """Token slots a view addresses (its buffer's elements per layer and K/V, in tokens)."""
    return view.buffer.numel() // (view.num_kv * view.layer_num * view.item_numel)
