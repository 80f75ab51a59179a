"""Host KV pools (L2): pinned host memory in one of the four layouts of seed §5.3, with its allocator.

Capacity. ``size = config.host_size``: from ``hicache_size`` (GB per rank) or ``hicache_ratio``, rounded
to ``(size // page_size + 1) * page_size`` tokens, and it must exceed the device pool's size
(``ConfigError`` otherwise, seed §6). The configuration is resolved first, so seed §5.3/§5.6's rewrites
apply (with a ``ConfigRewriteWarning``) exactly as when SGLang builds its host pool.

Layouts. Each layout is an order of named axes; MLA drops the K/V axis and has one head of
``kv_lora_rank + qk_rope_head_dim`` (``page_head`` is MHA only)::

    layer_first        (2, L, size, H, D)
    page_first         (2, size, L, H, D)
    page_first_direct  (2, page_num, L, page_size, H, D)
    page_head          (2, page_num, H, page_size, L, D)

Allocator. A FIFO queue of token slots, initially ``[0, 1, ..., size - 1]``. ``alloc(n)`` needs ``n`` to
be a multiple of ``page_size``, returns None when fewer than ``n`` slots are free and otherwise the first
``n`` slots of the queue (a copy); ``free(idx)`` appends ``idx`` to the tail in the given order. Since
every alloc and free is in whole pages, pages stay contiguous and aligned, so a page is addressed by its
first slot (``get_data_page``, ``get_page_buffer_meta``). Alloc and free hold an ``RLock``: the I/O
threads and the scheduler both call them.
"""

from __future__ import annotations

import threading
from typing import Final

import numpy as np
import torch

from refcache.config import AttentionKind, HiCacheConfig, IOBackend, MemLayout
from refcache.errors import ConfigError, UnsupportedError, UsageError
from refcache.gpu.allocator import FreeQueue
from refcache.gpu.device_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool
from refcache.gpu.layout import KVView
from refcache.gpu.memory import empty_kv
from refcache.gpu.transfer import TransferPlan, check_supported, plan_transfer, run_transfer

__all__ = [
    "LAYOUT_AXES",
    "HostKVCache",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPoolHost",
    "host_pool_from_config",
]

# Axis names: kv (K/V), layer, token (slot), page, ptoken (slot within a page), head, dim.
LAYOUT_AXES: Final[dict[MemLayout, tuple[str, ...]]] = {
    MemLayout.LAYER_FIRST: ("kv", "layer", "token", "head", "dim"),
    MemLayout.PAGE_FIRST: ("kv", "token", "layer", "head", "dim"),
    MemLayout.PAGE_FIRST_DIRECT: ("kv", "page", "layer", "ptoken", "head", "dim"),
    MemLayout.PAGE_HEAD: ("kv", "page", "head", "ptoken", "layer", "dim"),
}


def _available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


class HostKVCache:
    """The host pool shared by MHA and MLA: buffer, allocator, page helpers and transfers."""

    def __init__(self, device_pool: KVCache, config: HiCacheConfig, pin_memory: bool = True) -> None:
        config = config.resolve()
        self.config = config
        self.device_pool = device_pool
        self.layout = config.hicache_mem_layout
        self.page_size = config.page_size
        self.size = config.host_size
        self.page_num = self.size // self.page_size
        self.dtype = device_pool.store_dtype
        self.layer_num = device_pool.layer_num
        self.num_kv = device_pool.num_kv
        self.head_num = device_pool.head_num
        self.head_dim = device_pool.head_dim
        self.attention = AttentionKind.MHA if self.num_kv == 2 else AttentionKind.MLA
        if self.attention is not config.attention:
            raise ConfigError(
                f"config.attention={config.attention.value} but the device pool is {self.attention.value}"
            )
        kv_dim = config.head_dim if self.num_kv == 2 else config.kv_lora_rank + config.qk_rope_head_dim
        expected = (
            config.page_size,
            config.layer_num,
            config.head_num if self.num_kv == 2 else 1,
            kv_dim,
            config.dtype,
        )
        actual = (
            device_pool.page_size,
            self.layer_num,
            self.head_num,
            self.head_dim,
            str(self.dtype).removeprefix("torch."),
        )
        if expected != actual:
            raise ConfigError(
                f"the device pool (page_size, layers, heads, head_dim, dtype) = {actual} does not match the "
                f"configuration's {expected}"
            )
        if self.size <= device_pool.size:
            raise ConfigError(
                f"host pool of {self.size} tokens is not larger than the device pool of {device_pool.size} "
                "tokens (seed §6); raise hicache_ratio or hicache_size"
            )
        self.size_per_token = (
            self.num_kv * self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
        )
        requested = self.size * self.size_per_token
        available = _available_memory_bytes()
        if available is not None and requested > available:
            raise ConfigError(
                f"host pool needs {requested} bytes but only {available} bytes of memory are available"
            )
        axes = LAYOUT_AXES[self.layout]
        self.axes = axes if self.num_kv == 2 else axes[1:]
        extent = {
            "kv": 2,
            "layer": self.layer_num,
            "token": self.size,
            "page": self.page_num,
            "ptoken": self.page_size,
            "head": self.head_num,
            "dim": self.head_dim,
        }
        self.pin_memory = pin_memory
        self.kv_buffer = empty_kv(
            tuple(extent[a] for a in self.axes), self.dtype, torch.device("cpu"), pin_memory
        )
        self.lock = threading.RLock()
        self._last_plan: TransferPlan | None = None  # only _plan touches it
        self._io_arg: object = object()  # only _plan touches these: the last io_backend argument as checked
        self._io_backend = IOBackend.DIRECT
        self._kv_view: KVView | None = None  # only kv_view touches it
        self.clear()

    # --- allocator ---------------------------------------------------------------------------------------

    def clear(self) -> None:
        """Free every slot; the free queue becomes ``[0, 1, ..., size - 1]``."""
        with self.lock:
            self.free_slots = FreeQueue(range(self.size))  # FIFO; only alloc/free/clear touch it
            self.slot_used = np.zeros(self.size, dtype=bool)  # only alloc/free/clear touch it

    def available_size(self) -> int:
        with self.lock:
            return len(self.free_slots)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """The first ``need_size`` free slots (int64 CPU tensor, a copy), or None (nothing changed) when
        fewer are free. Raises ``UsageError`` when ``need_size`` is not a multiple of ``page_size``, or on
        a double allocation (the queue holds a slot in use)."""
        if need_size < 0 or need_size % self.page_size:
            raise UsageError(
                f"alloc({need_size}): host allocations are whole pages of {self.page_size} tokens"
            )
        with self.lock:
            if need_size > len(self.free_slots):
                return None
            slots = self.free_slots.peek(need_size)
            used = self.slot_used[slots]
            if used.any():
                raise UsageError(
                    f"double allocation: host slots {slots[used][:8].tolist()} are in use but sit in the "
                    "free queue"
                )
            self.free_slots.take(need_size)
            self.slot_used[slots] = True
            return torch.from_numpy(slots)

    def free(self, indices: torch.Tensor) -> int:
        """Append ``indices`` to the tail of the free queue in the given order; returns how many.

        Raises ``UsageError`` (nothing changed) for a slot out of range or not in use (double free).
        """
        slots = indices.detach().flatten().cpu().numpy().astype(np.int64, copy=False)
        with self.lock:
            if len(slots) and (int(slots.min()) < 0 or int(slots.max()) >= self.size):
                bad = slots[(slots < 0) | (slots >= self.size)]
                raise UsageError(f"free: host slots {bad[:8].tolist()} are outside [0, {self.size})")
            ordered = np.sort(slots)
            repeated = ordered[1:][ordered[1:] == ordered[:-1]]
            not_used = slots[~self.slot_used[slots]]
            if len(repeated) or len(not_used):
                twice = sorted({*repeated.tolist(), *not_used.tolist()})
                raise UsageError(f"double free: host slots {twice[:8]} are already free")
            self.slot_used[slots] = False
            self.free_slots.put(slots)
            return len(slots)

    def get_size_per_token(self) -> int:
        return self.size_per_token

    # --- layout and page helpers -------------------------------------------------------------------------

    def kv_view(self) -> KVView:
        """The strides of ``kv_buffer`` for the transfer mechanisms (built once: every transfer asks)."""
        view = self._kv_view
        if view is None or view.buffer is not self.kv_buffer:
            view = self._kv_view = self._make_kv_view()
        return view

    def _make_kv_view(self) -> KVView:
        stride = dict(zip(self.axes, self.kv_buffer.stride(), strict=True))
        paged = "page" in stride
        token = stride["ptoken"] if paged else stride["token"]
        return KVView(
            self.kv_buffer,
            self.num_kv,
            self.layer_num,
            self.head_num,
            self.head_dim,
            self.page_size if paged else 1,
            stride.get("kv", 0),
            stride["layer"],
            stride["page"] if paged else token,
            token,
            stride["head"],
        )

    def _page_view(self, index: int) -> torch.Tensor:
        if not (0 <= index < self.size and index % self.page_size == 0):
            raise UsageError(f"host index {index} is not the first slot of a page in [0, {self.size})")
        if "page" in self.axes:
            return self.kv_buffer.narrow(self.axes.index("page"), index // self.page_size, 1)
        return self.kv_buffer.narrow(self.axes.index("token"), index, self.page_size)

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        """The page starting at slot ``index``: a view in the layout's page shape (``flat=False``), or a
        new 1-D tensor of its elements in that shape's order (``flat=True``).

        Page shapes (MHA; MLA drops the leading 2 and has ``H=1``): layer_first ``(2, L, ps, H, D)``,
        page_first ``(2, ps, L, H, D)``, page_first_direct ``(2, 1, L, ps, H, D)``, page_head
        ``(2, 1, H, ps, L, D)``. Raises ``UsageError`` when ``index`` is not a page's first slot.
        """
        page = self._page_view(index)
        if not flat:
            return page
        out = torch.empty(page.numel(), dtype=self.dtype)
        out.view(page.shape).copy_(page)
        return out

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        """A zero page, flat, for the generic L3 read path to fill."""
        return torch.zeros(self.page_size * self.size_per_token // self.dtype.itemsize, dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        """Write a flat page (``get_data_page``'s order) into the page starting at slot ``index``.

        Raises ``UsageError`` for a misaligned index or a page of the wrong size or dtype.
        """
        page = self._page_view(index)
        if data_page.numel() != page.numel() or data_page.dtype != self.dtype:
            raise UsageError(
                f"a flat page holds {page.numel()} {self.dtype} elements, got {data_page.numel()} {data_page.dtype}"
            )
        page.copy_(data_page.reshape(page.shape))

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        """Pointers and byte sizes of the memory of the pages whose first slots are
        ``indices[0], indices[ps], ...`` (seed §5.8), for zero-copy L3 backends.

        Per page, in this order: layer_first, one segment per layer (MHA: K then V of that layer, each
        ``ps*H*D`` elements; MLA: ``ps*kv_dim``); the page-major layouts, one segment per K and V (MLA: one)
        of ``L*ps*H*D`` elements. Raises ``UsageError`` when ``len(indices)`` is not a multiple of
        ``page_size`` or a page start is misaligned.
        """
        flat = indices.flatten().to(torch.int64).cpu()
        if flat.numel() % self.page_size:
            raise UsageError(f"{flat.numel()} indices are not whole pages of {self.page_size}")
        # In Python on the page list: the L3 calls this per batch, and a dozen torch operations on a few
        # pages cost more than the arithmetic.
        firsts = flat[:: self.page_size].tolist()
        bad = [f for f in firsts if not (0 <= f < self.size and f % self.page_size == 0)]
        if bad:
            raise UsageError(f"host indices {bad[:8]} are not first slots of pages in [0, {self.size})")
        view = self.kv_view()
        split = self.axes.index("page" if "page" in self.axes else "token")
        per_layer = "layer" in self.axes[:split]  # layer_first: each layer of a page is a separate segment
        extent = self.kv_buffer.shape[split + 1 :].numel() * (1 if "page" in self.axes else self.page_size)
        # Offsets of (page, layer, kv) in that order, as KVView.offset computes them.
        ps, isz, base = view.page_size, self.dtype.itemsize, self.kv_buffer.data_ptr()
        within = [
            (layer * view.layer_stride + kv * view.kv_stride) * isz
            for layer in range(self.layer_num if per_layer else 1)
            for kv in range(self.num_kv)
        ]
        page_starts = [
            base + ((f // ps) * view.page_stride + (f % ps) * view.token_stride) * isz for f in firsts
        ]
        ptrs = [start + offset for start in page_starts for offset in within]
        return ptrs, [extent * self.dtype.itemsize] * len(ptrs)

    # --- transfers (seed §5.4) ---------------------------------------------------------------------------

    def _plan(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: IOBackend | str,
        host_is_src: bool,
    ) -> TransferPlan:
        # the last call's object, checked then (the pool's layout and attention are fixed)
        if io_backend is self._io_arg:
            backend = self._io_backend
        else:  # an enum call, a table lookup and a set test: 25 us cold, in every per-layer call
            backend = check_supported(io_backend, self.layout, self.attention)
            self._io_arg, self._io_backend = io_backend, backend
        plan = self._last_plan  # a load calls once per layer with the same index tensors
        # TransferPlan.matches inline, on the buffers themselves: kv_view()'s buffer is always the pool's
        # kv_buffer, so two kv_view calls and matches are not needed to reuse the plan (per layer, cold).
        if plan is not None:
            src_buffer, dst_buffer = (
                (self.kv_buffer, device_pool.kv_buffer)
                if host_is_src
                else (device_pool.kv_buffer, self.kv_buffer)
            )
            if (
                plan.host_indices is host_indices
                and plan.device_indices is device_indices
                and plan.versions == (host_indices._version, device_indices._version)
                and plan.src.buffer is src_buffer
                and plan.dst.buffer is dst_buffer
                and plan.io_backend is backend
            ):
                return plan
        host, device = self.kv_view(), device_pool.kv_view()
        src, dst = (host, device) if host_is_src else (device, host)
        plan = plan_transfer(src, dst, host_indices, device_indices, backend, host_is_src)
        self._last_plan = plan
        return plan

    def load_to_device_per_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: IOBackend | str,
    ) -> None:
        """Copy layer ``layer_id`` (0-based within the pool) of slots ``host_indices`` to
        ``device_indices``. Raises ``ConfigError`` for an io backend / layout pair outside seed §5.4 and
        ``UsageError`` for bad indices or layer."""
        plan = self._plan(device_pool, host_indices, device_indices, io_backend, host_is_src=True)
        run_transfer(plan, range(layer_id, layer_id + 1), range(layer_id, layer_id + 1))

    def backup_from_device_all_layer(
        self,
        device_pool: KVCache,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        io_backend: IOBackend | str,
    ) -> None:
        """Copy every layer of slots ``device_indices`` to ``host_indices``. Raises as
        ``load_to_device_per_layer``."""
        plan = self._plan(device_pool, host_indices, device_indices, io_backend, host_is_src=False)
        run_transfer(plan, range(self.layer_num), range(self.layer_num))


class MHATokenToKVPoolHost(HostKVCache):
    """Host pool of an ``MHATokenToKVPool``: K and V of ``head_num`` heads (this rank's share)."""

    def __init__(self, device_pool: MHATokenToKVPool, config: HiCacheConfig, pin_memory: bool = True) -> None:
        super().__init__(device_pool, config, pin_memory)
        self.k_buffer = self.kv_buffer[0]
        self.v_buffer = self.kv_buffer[1]


class MLATokenToKVPoolHost(HostKVCache):
    """Host pool of an ``MLATokenToKVPool``: one latent of ``kv_lora_rank + qk_rope_head_dim``."""

    def __init__(self, device_pool: MLATokenToKVPool, config: HiCacheConfig, pin_memory: bool = True) -> None:
        super().__init__(device_pool, config, pin_memory)
        self.kv_lora_rank = device_pool.kv_lora_rank
        self.qk_rope_head_dim = device_pool.qk_rope_head_dim
        self.kv_cache_dim = device_pool.kv_cache_dim


def host_pool_from_config(
    device_pool: KVCache, config: HiCacheConfig, pin_memory: bool = True
) -> HostKVCache:
    """The host pool class for ``device_pool``'s type (seed §5.1: MHA or MLA; anything else is rejected).

    Raises ``UnsupportedError`` for another device pool type and ``ConfigError`` as the constructors.
    """
    if isinstance(device_pool, MHATokenToKVPool):
        return MHATokenToKVPoolHost(device_pool, config, pin_memory)
    if isinstance(device_pool, MLATokenToKVPool):
        return MLATokenToKVPoolHost(device_pool, config, pin_memory)
    raise UnsupportedError(f"HiCache supports MHA and MLA device pools, not {type(device_pool).__name__}")
