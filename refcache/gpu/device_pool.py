"""Device KV pools (L1): the KV of every token slot, per layer, on the GPU (CPU without CUDA).

MHA keeps per layer a K and a V buffer of shape ``(size, head_num, head_dim)``; MLA keeps per layer
one latent buffer ``(size, 1, kv_lora_rank + qk_rope_head_dim)`` (seed §5.2). Both are views into one
allocation (``kv_buffer``: ``(2, L, size, H, D)`` for MHA, ``(L, size, 1, kv_dim)`` for MLA) so that a
transfer kernel can address all layers with one stride; SGLang allocates one tensor per layer, which
gives the same per-layer shapes.

Every per-layer accessor first calls the registered ``LayerDoneCounter.wait_until(layer)``: reading a
layer before its H2D copy finished would read half-loaded KV (reference/sglang.md §9 #10).
"""

from __future__ import annotations

import abc

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import UsageError
from refcache.gpu.layer_done import LayerDoneCounter
from refcache.gpu.layout import KVView
from refcache.gpu.memory import INT_OF_SIZE, default_device, empty_kv, torch_dtype

__all__ = ["KVCache", "MHATokenToKVPool", "MLATokenToKVPool", "device_pool_from_config"]


class KVCache(abc.ABC):
    """What both device pools share: shape facts, the allocation, the layer-done counter."""

    kv_buffer: torch.Tensor  # the single allocation; every per-layer buffer is a view of it
    num_kv: int
    head_num: int
    head_dim: int

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        layer_num: int,
        device: torch.device | str | None,
        start_layer: int = 0,
    ) -> None:
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.store_dtype = dtype
        self.layer_num = layer_num
        self.start_layer = start_layer
        self.end_layer = start_layer + layer_num - 1
        self.device = default_device() if device is None else torch.device(device)
        self.layer_transfer_counter: LayerDoneCounter | None = None
        self._kv_view: KVView | None = None  # only kv_view touches it
        self._rows: tuple[torch.Tensor, torch.Tensor, int] | None = None  # only int_rows touches it

    def register_layer_transfer_counter(self, layer_transfer_counter: LayerDoneCounter) -> None:
        """Make every per-layer accessor wait for that layer's load (seed §2.3)."""
        self.layer_transfer_counter = layer_transfer_counter

    def _wait(self, layer_id: int) -> int:
        local = layer_id - self.start_layer
        if not 0 <= local < self.layer_num:
            raise UsageError(f"layer {layer_id} is outside [{self.start_layer}, {self.end_layer}]")
        if self.layer_transfer_counter is not None:
            self.layer_transfer_counter.wait_until(local)
        return local

    def kv_view(self) -> KVView:
        """The strides of ``kv_buffer`` (token-major, one slot per row); built once, as every transfer asks."""
        view = self._kv_view
        if view is None or view.buffer is not self.kv_buffer:
            view = self._kv_view = self._make_kv_view()
        return view

    def _make_kv_view(self) -> KVView:
        s = self.kv_buffer.stride()
        if self.num_kv == 2:
            kv, layer, token, head = s[0], s[1], s[2], s[3]
        else:
            kv, layer, token, head = 0, s[0], s[1], s[2]
        return KVView(
            self.kv_buffer,
            self.num_kv,
            self.layer_num,
            self.head_num,
            self.head_dim,
            1,
            kv,
            layer,
            token,
            token,
            head,
        )

    def int_rows(self) -> tuple[torch.Tensor, int] | None:
        """``kv_buffer`` as integer rows ``(num_kv * layer_num, size, words)``, one row per (K/V, layer)
        and slot, each slot's ``head_num * head_dim`` elements as ``words`` integers of the widest type
        that divides them (a slot of 16 fp16 elements is 4 int64: index kernels move a quarter as many
        items), and NaN's bit pattern repeated over one such integer. Integer views also because
        ``index_fill_`` and ``index_copy_`` have no fp8 kernels on the CPU. None when the allocation is
        not one contiguous tensor. Built once per allocation."""
        cached = self._rows
        buffer = self.kv_buffer
        if cached is not None and cached[0] is buffer:
            return cached[1], cached[2]
        if not buffer.is_contiguous():
            return None
        size = buffer.element_size()
        row_bytes = self.head_num * self.head_dim * size
        wide = next(w for w in (8, 4, 2, 1) if w >= size and row_bytes % w == 0)
        bits = INT_OF_SIZE[wide]
        nan = int(torch.full((wide // size,), float("nan"), dtype=buffer.dtype).view(bits)[0])
        rows = buffer.view(self.num_kv * self.layer_num, self.size, row_bytes // size).view(bits)
        self._rows = (buffer, rows, nan)
        return rows, nan

    def poison(self, slots: torch.Tensor) -> None:
        """Overwrite every layer of ``slots`` with NaN (freed slots, in test runs): a later read of a slot
        whose copy never arrived then differs from any real KV, even when the slot held the same bytes
        before it was freed."""
        index = slots.to(self.device)
        flat = self.int_rows()
        if flat is not None:  # one fill for every layer
            flat[0].index_fill_(1, index, flat[1])
        elif self.num_kv == 2:
            self.kv_buffer[:, :, index] = float("nan")
        else:
            self.kv_buffer[:, index] = float("nan")

    def set_kv_buffers(self, loc: torch.Tensor, cache: torch.Tensor) -> None:
        """Every layer's ``set_kv_buffer`` at once (the fake forward pass's store): ``cache`` is
        ``(num_kv, layer_num, len(loc), head_num, head_dim)`` in ``kv_buffer``'s order; one copy when the
        allocation is one contiguous tensor, else ``set_kv_buffer`` per layer. A ``cache`` of other
        (K/V, layer, position) counts is a ValueError (not a copy of the same element count in another
        layout)."""
        if cache.shape[:3] != (self.num_kv, self.layer_num, len(loc)):
            raise ValueError(
                f"set_kv_buffers: a cache of shape {tuple(cache.shape)} for a pool of {self.num_kv} x "
                f"{self.layer_num} (K/V, layer) rows and {len(loc)} slots"
            )
        flat = self.int_rows()
        if flat is not None and cache.dtype == self.dtype:
            rows = flat[0]
            source = cache.contiguous().view(rows.shape[0], len(loc), -1).view(rows.dtype)
            rows.index_copy_(1, loc, source)
            return
        for layer in range(self.layer_num):
            if self.num_kv == 1:
                self.set_kv_buffer(layer + self.start_layer, loc, cache[0, layer])
            else:
                self.set_kv_buffer(layer + self.start_layer, loc, cache[0, layer], cache[1, layer])

    def get_kv_size_bytes(self) -> int:
        return self.kv_buffer.numel() * self.kv_buffer.element_size()

    @abc.abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s K (MLA: latent) buffer, after waiting for its load."""

    @abc.abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """Layer ``layer_id``'s V (MLA: the kv_lora_rank part of the latent), after waiting for its load."""

    @abc.abstractmethod
    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(get_key_buffer, get_value_buffer)`` with a single wait."""

    @abc.abstractmethod
    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor | None = None
    ) -> None:
        """Write the KV of the tokens in slots ``loc`` of one layer (the forward pass's store)."""


class MHATokenToKVPool(KVCache):
    """Per layer a K and a V buffer ``(size, head_num, head_dim)``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: torch.device | str | None = None,
        start_layer: int = 0,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, start_layer)
        self.num_kv = 2
        self.head_num = head_num
        self.head_dim = head_dim
        self.kv_buffer = empty_kv((2, layer_num, size, head_num, head_dim), dtype, self.device)
        self.k_buffer = list(self.kv_buffer[0].unbind(0))
        self.v_buffer = list(self.kv_buffer[1].unbind(0))

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[self._wait(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[self._wait(layer_id)]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self._wait(layer_id)
        return self.k_buffer[local], self.v_buffer[local]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor | None = None
    ) -> None:
        """Write ``cache_k``/``cache_v`` (``(len(loc), H, D)``) into slots ``loc`` of layer ``layer_id``."""
        if cache_v is None:
            raise UsageError("MHA set_kv_buffer needs cache_v")
        local = layer_id - self.start_layer
        self.k_buffer[local][loc] = cache_k.to(self.device, self.dtype)
        self.v_buffer[local][loc] = cache_v.to(self.device, self.dtype)


class MLATokenToKVPool(KVCache):
    """Per layer one latent buffer ``(size, 1, kv_lora_rank + qk_rope_head_dim)``."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: torch.device | str | None = None,
        start_layer: int = 0,
    ) -> None:
        super().__init__(size, page_size, dtype, layer_num, device, start_layer)
        self.num_kv = 1
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.head_num = 1
        self.head_dim = self.kv_cache_dim
        self.kv_buffer = empty_kv((layer_num, size, 1, self.kv_cache_dim), dtype, self.device)
        self.kv_buffer_per_layer = list(self.kv_buffer.unbind(0))

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """The whole latent ``(size, 1, kv_lora_rank + qk_rope_head_dim)``."""
        return self.kv_buffer_per_layer[self._wait(layer_id)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """The compressed part ``(size, 1, kv_lora_rank)`` of the latent (a view)."""
        return self.kv_buffer_per_layer[self._wait(layer_id)][..., : self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        local = self._wait(layer_id)
        latent = self.kv_buffer_per_layer[local]
        return latent, latent[..., : self.kv_lora_rank]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor | None = None
    ) -> None:
        """Write the latent ``cache_k`` (``(len(loc), 1, kv_dim)``) into slots ``loc``; ``cache_v`` is
        ignored, as in SGLang, because the latent already holds it."""
        self.kv_buffer_per_layer[layer_id - self.start_layer][loc] = cache_k.to(self.device, self.dtype)


def device_pool_from_config(config: HiCacheConfig, device: torch.device | str | None = None) -> KVCache:
    """The device pool that ``config`` describes: ``device_size`` slots of ``attention`` KV."""
    dtype = torch_dtype(config.dtype)
    if config.attention is AttentionKind.MHA:
        return MHATokenToKVPool(
            config.device_size,
            config.page_size,
            dtype,
            config.head_num,
            config.head_dim,
            config.layer_num,
            device,
        )
    return MLATokenToKVPool(
        config.device_size,
        config.page_size,
        dtype,
        config.kv_lora_rank,
        config.qk_rope_head_dim,
        config.layer_num,
        device,
    )
