"""CPU equivalents of the ``sgl_kernel.kvcacheio`` functions that SGLang's host pools call.

SGLang 0.5.20 imports these names in ``mem_cache/pool_host/mha.py`` and ``mla.py`` only on CUDA or ROCm;
on a CPU they are undefined and the first copy would raise ``NameError``. ``install(modules)`` sets each of
them in those modules to the function here of the same name and signature. They are refcache's code, not
SGLang's: every copy is planned and run by ``refcache.gpu.transfer`` (``plan_transfer`` + ``run_transfer``,
the direct mechanism: plain memory copies of slot runs), on ``KVView``s that describe SGLang's own buffers
by their strides. The copy is deferred onto the current fake device stream (``_gate.enqueue``), so it
happens when the adapter completes the copy, as on a GPU.

Which function runs for which (io backend, layout), as SGLang's host pools dispatch them:

========================  =========================================  ==============================================
io backend / layout       load, per layer (host -> device)           backup, all layers (device -> host)
========================  =========================================  ==============================================
direct / layer_first      ``transfer_kv_direct``                     ``transfer_kv_direct``
direct / page_first_dir.  ``transfer_kv_per_layer_direct_pf_lf``     ``transfer_kv_all_layer_direct_lf_pf``
kernel / layer_first      ``transfer_kv_per_layer[_mla]``            ``transfer_kv_all_layer[_mla]`` (pointer tables)
kernel / page_first       ``transfer_kv_per_layer[_mla]_pf_lf``      ``transfer_kv_all_layer[_mla]_lf_pf``
kernel / page_head (MHA)  ``transfer_kv_per_layer_ph_lf``            ``transfer_kv_all_layer_lf_ph``
========================  =========================================  ==============================================

The ``*_all_layer`` functions of the kernel backend receive tables of ``data_ptr()`` values (uint64
tensors) instead of tensors; ``register`` maps each per-layer buffer's address back to its tensor (the
adapter registers the device and host pools it builds, and ``unregister``s them on close).
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Sequence
from typing import Final

import torch

from refcache.config import IOBackend
from refcache.engines.sglang import _gate
from refcache.errors import UsageError
from refcache.gpu.layout import KVView
from refcache.gpu.transfer import plan_transfer, run_transfer

__all__ = ["FUNCTIONS", "install", "register", "register_host", "unregister", "unregister_host"]

_BY_ADDRESS: dict[int, torch.Tensor] = {}


def register(tensors: Iterable[torch.Tensor]) -> None:
    """Make ``tensors`` (per-layer KV buffers) resolvable from the addresses in SGLang's pointer tables."""
    for tensor in tensors:
        _BY_ADDRESS[tensor.data_ptr()] = tensor


def unregister(tensors: Iterable[torch.Tensor]) -> None:
    for tensor in tensors:
        if _BY_ADDRESS.get(tensor.data_ptr()) is tensor:
            del _BY_ADDRESS[tensor.data_ptr()]


def _resolve(table: torch.Tensor) -> list[torch.Tensor]:
    out = []
    for address in table.tolist():
        tensor = _BY_ADDRESS.get(int(address))
        if tensor is None:
            raise UsageError(f"no registered KV buffer at address {int(address):#x} (pointer table entry)")
        out.append(tensor)
    return out


# --- views of SGLang's buffers ---------------------------------------------------------------------------


def _token_view(t: torch.Tensor) -> KVView:
    """One layer of K, V or an MLA latent: ``[slots, heads, head_dim]`` (heads contiguous in a slot)."""
    _, heads, dim = t.shape
    return KVView(t, 1, 1, heads, dim, 1, 0, 0, t.stride(0), t.stride(0), t.stride(1))


def _page_first_view(t: torch.Tensor) -> KVView:
    """Host ``page_first``: ``[slots, layers, heads, head_dim]``."""
    _, layers, heads, dim = t.shape
    return KVView(t, 1, layers, heads, dim, 1, 0, t.stride(1), t.stride(0), t.stride(0), t.stride(2))


def _page_first_direct_view(t: torch.Tensor) -> KVView:
    """Host ``page_first_direct``: ``[pages, layers, page_size, heads, head_dim]``."""
    _, layers, page, heads, dim = t.shape
    return KVView(t, 1, layers, heads, dim, page, 0, t.stride(1), t.stride(0), t.stride(2), t.stride(3))


def _page_head_view(t: torch.Tensor, page_size: int) -> KVView:
    """Host ``page_head``: ``[pages, heads, page_size, layers, head_dim]``."""
    _, heads, page, layers, dim = t.shape
    assert page == page_size
    return KVView(t, 1, layers, heads, dim, page, 0, t.stride(3), t.stride(0), t.stride(2), t.stride(1))


def _copy(
    src: KVView,
    dst: KVView,
    src_layer: int,
    dst_layer: int,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    host_is_src: bool,
) -> None:
    """Plan ``src[src_layer][src_indices] -> dst[dst_layer][dst_indices]`` now (indices are validated and
    copied), and run it when the current fake stream reaches it."""
    src_idx, dst_idx = src_indices.cpu().to(torch.int64), dst_indices.cpu().to(torch.int64)
    host_idx, dev_idx = (src_idx, dst_idx) if host_is_src else (dst_idx, src_idx)
    plan = plan_transfer(src, dst, host_idx.clone(), dev_idx.clone(), IOBackend.DIRECT, host_is_src)
    src_layers, dst_layers = range(src_layer, src_layer + 1), range(dst_layer, dst_layer + 1)
    _gate.enqueue(lambda: run_transfer(plan, src_layers, dst_layers))


def _load_pairs(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
) -> None:
    """One layer's host buffers to the device's, per-layer token-major buffers on both sides."""
    for s, d in zip(srcs, dsts, strict=True):
        _copy(_token_view(s), _token_view(d), 0, 0, src_indices, dst_indices, True)


# --- the sgl_kernel.kvcacheio names ----------------------------------------------------------------------
# Parameter names are SGLang's (its host pools call them by keyword). ``item_size``, ``page_size`` and the
# layout dimensions are implied by the buffers' shapes and strides.


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """direct / layer_first, both directions: one per-layer buffer pair per K, V (or latent) and layer."""
    host_is_src = _is_host(src_layers[0])
    for s, d in zip(src_layers, dst_layers, strict=True):
        _copy(_token_view(s), _token_view(d), 0, 0, src_indices, dst_indices, host_is_src)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """direct / page_first_direct load: host ``[pages, layers, page, ...]`` K and V to one device layer."""
    for s, d in zip(src_ptrs, dst_ptrs, strict=True):
        _copy(_page_first_direct_view(s), _token_view(d), layer_id, 0, src_indices, dst_indices, True)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """direct / page_first_direct backup: every device layer of K then V (``src_ptrs``) to the host."""
    layers = len(src_ptrs) // len(dst_ptrs)
    for i, s in enumerate(src_ptrs):
        dst = _page_first_direct_view(dst_ptrs[i // layers])
        _copy(_token_view(s), dst, 0, i % layers, src_indices, dst_indices, False)


def transfer_kv_per_layer(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
) -> None:
    """kernel / layer_first MHA load of one layer."""
    _load_pairs([src_k, src_v], [dst_k, dst_v], src_indices, dst_indices)


def transfer_kv_per_layer_mla(
    src: torch.Tensor, dst: torch.Tensor, src_indices: torch.Tensor, dst_indices: torch.Tensor, item_size: int
) -> None:
    """kernel / layer_first MLA load of one layer."""
    _load_pairs([src], [dst], src_indices, dst_indices)


def transfer_kv_all_layer(
    src_k_layers: torch.Tensor,
    dst_k_layers: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
) -> None:
    """kernel / layer_first MHA backup: pointer tables of per-layer buffers on both sides."""
    for src_table, dst_table in ((src_k_layers, dst_k_layers), (src_v_layers, dst_v_layers)):
        for s, d in zip(_resolve(src_table)[:num_layers], _resolve(dst_table)[:num_layers], strict=True):
            _copy(_token_view(s), _token_view(d), 0, 0, src_indices, dst_indices, False)


def transfer_kv_all_layer_mla(
    src_layers: torch.Tensor,
    dst_layers: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    num_layers: int,
) -> None:
    """kernel / layer_first MLA backup: pointer tables of per-layer latent buffers."""
    for s, d in zip(_resolve(src_layers)[:num_layers], _resolve(dst_layers)[:num_layers], strict=True):
        _copy(_token_view(s), _token_view(d), 0, 0, src_indices, dst_indices, False)


def transfer_kv_per_layer_pf_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """kernel / page_first MHA load of one layer: host ``[slots, layers, heads, dim]``."""
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        _copy(_page_first_view(s), _token_view(d), layer_id, 0, src_indices, dst_indices, True)


def transfer_kv_per_layer_mla_pf_lf(
    src: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
) -> None:
    """kernel / page_first MLA load of one layer."""
    _copy(_page_first_view(src), _token_view(dst), layer_id, 0, src_indices, dst_indices, True)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """kernel / page_first MHA backup: device pointer tables to the host ``[slots, layers, ...]``."""
    for table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        view = _page_first_view(dst)
        for layer, s in enumerate(_resolve(table)[:num_layers]):
            _copy(_token_view(s), view, 0, layer, src_indices, dst_indices, False)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: torch.Tensor,
    dst: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
) -> None:
    """kernel / page_first MLA backup."""
    view = _page_first_view(dst)
    for layer, s in enumerate(_resolve(src_layers)[:num_layers]):
        _copy(_token_view(s), view, 0, layer, src_indices, dst_indices, False)


def transfer_kv_per_layer_ph_lf(
    src_k: torch.Tensor,
    dst_k: torch.Tensor,
    src_v: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
) -> None:
    """kernel / page_head MHA load of one layer: host ``[pages, heads, page, layers, dim]``."""
    for s, d in ((src_k, dst_k), (src_v, dst_v)):
        _copy(_page_head_view(s, page_size), _token_view(d), layer_id, 0, src_indices, dst_indices, True)


def transfer_kv_all_layer_lf_ph(
    src_k_layers: torch.Tensor,
    dst_k: torch.Tensor,
    src_v_layers: torch.Tensor,
    dst_v: torch.Tensor,
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
) -> None:
    """kernel / page_head MHA backup."""
    for table, dst in ((src_k_layers, dst_k), (src_v_layers, dst_v)):
        view = _page_head_view(dst, page_size)
        for layer, s in enumerate(_resolve(table)[:num_layers]):
            _copy(_token_view(s), view, 0, layer, src_indices, dst_indices, False)


_HOST_BUFFERS: set[int] = set()


def _is_host(t: torch.Tensor) -> bool:
    """Whether a per-layer buffer belongs to a host pool (``register_host``)."""
    return t.data_ptr() in _HOST_BUFFERS


def register_host(tensors: Iterable[torch.Tensor]) -> None:
    """Mark per-layer buffers as host-side (``transfer_kv_direct`` serves both directions)."""
    _HOST_BUFFERS.update(t.data_ptr() for t in tensors)


def unregister_host(tensors: Iterable[torch.Tensor]) -> None:
    _HOST_BUFFERS.difference_update(t.data_ptr() for t in tensors)


FUNCTIONS: Final = {
    f.__name__: f
    for f in (
        transfer_kv_direct,
        transfer_kv_per_layer_direct_pf_lf,
        transfer_kv_all_layer_direct_lf_pf,
        transfer_kv_per_layer,
        transfer_kv_per_layer_mla,
        transfer_kv_all_layer,
        transfer_kv_all_layer_mla,
        transfer_kv_per_layer_pf_lf,
        transfer_kv_per_layer_mla_pf_lf,
        transfer_kv_all_layer_lf_pf,
        transfer_kv_all_layer_mla_lf_pf,
        transfer_kv_per_layer_ph_lf,
        transfer_kv_all_layer_lf_ph,
    )
}
"""Every ``sgl_kernel.kvcacheio`` name the CPU path supplies, by name."""


def install(modules: Iterable[types.ModuleType]) -> list[str]:
    """Set every name of ``FUNCTIONS`` in ``modules`` (SGLang's host pool modules); returns the names set.

    Also where ``sgl_kernel`` defined them (a GPU machine): the adapter's pools live in CPU memory, which
    the CUDA kernels cannot address, and the copies must wait for ``CompleteIO``."""
    done = []
    for module in modules:
        for name, function in FUNCTIONS.items():
            setattr(module, name, function)
            done.append(f"{module.__name__}.{name}")
    return done
