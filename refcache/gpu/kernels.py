"""The ``kernel`` io backend: one Triton gather/scatter kernel for every row of seed §5.4's table.

SGLang has one CUDA kernel per (layout, direction, attention) pair: ``transfer_kv_per_layer``,
``..._pf_lf``, ``..._ph_lf``, ``transfer_kv_all_layer_lf_pf``, the ``_mla`` variants and so on. They
differ only in where a token's KV sits, which ``KVView`` captures as strides, so here a single kernel
copies token ``src_indices[i]`` of the source view to token ``dst_indices[i]`` of the destination view for
a range of layers and both K and V. Buffers are passed as integer views of the same width (bit copies).

Runs natively on CUDA (device pool on the GPU, host pool in pinned memory reached through unified
addressing) and, without CUDA, under ``TRITON_INTERPRET=1``, which must be set before this module is
imported (``tests/gpu/conftest.py`` does so).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from refcache.errors import UnsupportedError
from refcache.gpu.layout import KVView
from refcache.gpu.memory import as_bits

__all__ = ["INTERPRETED", "kernels_available", "transfer_kv_kernel"]

# triton.jit decides between compiling and interpreting when the decorator runs, i.e. at import.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit  # type: ignore[untyped-decorator]
def _transfer_kv_kernel(  # type: ignore[no-untyped-def]
    src_ptr,
    dst_ptr,
    src_idx_ptr,
    dst_idx_ptr,
    num_tokens,
    num_layers,
    src_layer0,
    dst_layer0,
    src_kv_stride,
    src_layer_stride,
    src_page_stride,
    src_token_stride,
    src_head_stride,
    src_page_size,
    dst_kv_stride,
    dst_layer_stride,
    dst_page_stride,
    dst_token_stride,
    dst_head_stride,
    dst_page_size,
    HEAD_DIM: tl.constexpr,
    ITEM: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    # Program (t, kl) copies BLOCK_T tokens of one layer of K or V: kl = kv * num_layers + layer.
    pid_kl = tl.program_id(1)
    kv = (pid_kl // num_layers).to(tl.int64)
    layer = (pid_kl % num_layers).to(tl.int64)
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_mask = tok < num_tokens
    s = tl.load(src_idx_ptr + tok, mask=tok_mask, other=0).to(tl.int64)
    d = tl.load(dst_idx_ptr + tok, mask=tok_mask, other=0).to(tl.int64)
    s_base = (
        kv * src_kv_stride
        + (src_layer0 + layer) * src_layer_stride
        + (s // src_page_size) * src_page_stride
        + (s % src_page_size) * src_token_stride
    )
    d_base = (
        kv * dst_kv_stride
        + (dst_layer0 + layer) * dst_layer_stride
        + (d // dst_page_size) * dst_page_stride
        + (d % dst_page_size) * dst_token_stride
    )
    e = tl.arange(0, BLOCK_E)
    head = e // HEAD_DIM
    dim = e % HEAD_DIM
    mask = tok_mask[:, None] & (e < ITEM)[None, :]
    x = tl.load(src_ptr + s_base[:, None] + (head * src_head_stride + dim)[None, :], mask=mask)
    tl.store(dst_ptr + d_base[:, None] + (head * dst_head_stride + dim)[None, :], x, mask=mask)


def kernels_available(device: torch.device) -> bool:
    """Whether the kernel can run for buffers on ``device`` in this process."""
    return INTERPRETED or device.type == "cuda"


def transfer_kv_kernel(
    src: KVView,
    dst: KVView,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    src_layers: range,
    dst_layers: range,
) -> None:
    """Copy token slots ``src_indices[i] -> dst_indices[i]`` of layers ``src_layers -> dst_layers``
    (equal lengths), K and V. Index tensors are int64 on the kernel's device.

    Raises ``UnsupportedError`` when neither CUDA nor the Triton interpreter is available.
    """
    run_device = dst.buffer.device if dst.buffer.device.type == "cuda" else src.buffer.device
    if not kernels_available(run_device):
        raise UnsupportedError(
            "hicache_io_backend='kernel' needs CUDA, or TRITON_INTERPRET=1 set before refcache.gpu is "
            "imported (slow, for tests); on CPU use hicache_io_backend='direct'"
        )
    n = src_indices.numel()
    if n == 0:
        return
    block_e = triton.next_power_of_2(src.item_numel)
    block_t = max(1, min(triton.next_power_of_2(n), 4096 // block_e))
    grid = (triton.cdiv(n, block_t), src.num_kv * len(src_layers))
    _transfer_kv_kernel[grid](
        as_bits(src.buffer),
        as_bits(dst.buffer),
        src_indices,
        dst_indices,
        n,
        len(src_layers),
        src_layers.start,
        dst_layers.start,
        src.kv_stride,
        src.layer_stride,
        src.page_stride,
        src.token_stride,
        src.head_stride,
        src.page_size,
        dst.kv_stride,
        dst.layer_stride,
        dst.page_stride,
        dst.token_stride,
        dst.head_stride,
        dst.page_size,
        HEAD_DIM=src.head_dim,
        ITEM=src.item_numel,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
    )
