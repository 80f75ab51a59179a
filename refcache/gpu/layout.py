"""A KV buffer described by strides, so one kernel and one copy loop serve every layout.

Every layout of seed §5.3 (and the device pool's own) places element ``d`` of head ``h`` of token slot
``t`` in layer ``l`` of K (``kv=0``) or V (``kv=1``) at::

    kv * kv_stride + l * layer_stride + (t // page_size) * page_stride + (t % page_size) * token_stride
        + h * head_stride + d

Token-major layouts (device, ``layer_first``, ``page_first``) use ``page_size=1``, which makes the page
term the token term; the page-split layouts (``page_first_direct``, ``page_head``) use the pool's page
size. MLA has one latent "K" (``num_kv=1``) with one head of ``kv_lora_rank + qk_rope_head_dim``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from refcache.gpu.memory import raw_bytes

__all__ = ["KVView"]


@dataclass(frozen=True)
class KVView:
    """The strides (in elements) of one KV allocation. See the module docstring for the formula."""

    buffer: torch.Tensor  # the whole allocation; offsets are relative to its first element
    num_kv: int  # 2 (K and V) for MHA, 1 (latent) for MLA
    layer_num: int
    head_num: int
    head_dim: int
    page_size: int  # 1 for token-major layouts
    kv_stride: int
    layer_stride: int
    page_stride: int
    token_stride: int
    head_stride: int

    @property
    def item_numel(self) -> int:
        """Elements of one token in one layer of K or V."""
        return self.head_num * self.head_dim

    @functools.cached_property
    def extent(self) -> int:
        """Bytes from the buffer's ``data_ptr()`` to the end of its last element (the pool's own memory,
        also when the buffer is a view into a larger allocation)."""
        buffer = self.buffer
        last = sum((size - 1) * stride for size, stride in zip(buffer.shape, buffer.stride(), strict=True))
        return (last + 1) * buffer.element_size()

    @functools.cached_property
    def raw(self) -> memoryview:
        """The buffer's bytes (``extent`` from its ``data_ptr()``) for the CPU copy loops; built once per
        view (pools keep theirs, so every transfer between two pools shares it). The view holds the buffer,
        so the memory outlives the ``memoryview``'s users. CPU buffers only."""
        return raw_bytes(self.buffer.data_ptr(), self.extent)

    @property
    def token_major(self) -> bool:
        """Whether consecutive slots are ``token_stride`` apart everywhere (not only inside a page)."""
        return self.page_stride == self.page_size * self.token_stride

    def offset(self, kv: int, layer: int, index: int) -> int:
        """Element offset of the first element of token slot ``index`` in ``layer`` of K/V ``kv``."""
        ps = self.page_size
        return (
            kv * self.kv_stride
            + layer * self.layer_stride
            + (index // ps) * self.page_stride
            + (index % ps) * self.token_stride
        )

    def run(self, index: int, length: int, layers: range) -> torch.Tensor:
        """A view ``(num_kv, len(layers), length, head_num, head_dim)`` of ``length`` consecutive slots.

        Unless the view is ``token_major``, the slots must not cross a page boundary (the token stride is
        only uniform inside a page); the direct copy loop cuts its runs accordingly.
        """
        shape = (self.num_kv, len(layers), length, self.head_num, self.head_dim)
        stride = (self.kv_stride, self.layer_stride, self.token_stride, self.head_stride, 1)
        start = self.buffer.storage_offset() + self.offset(0, layers.start, index)
        return self.buffer.as_strided(shape, stride, start)
