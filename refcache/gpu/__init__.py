"""refcache's data plane: KV pools, host layouts, transfers, layer-wise load events and the file L3.

The implementation side of refcache (it never imports ``refcache.model``). Names follow SGLang so
that HiRadixCache / HiCacheController code ports directly:

* device (L1): ``MHATokenToKVPool``, ``MLATokenToKVPool`` (``device_pool_from_config``) and the slot
  allocators ``TokenToKVPoolAllocator``, ``PagedTokenToKVPoolAllocator``;
* host (L2): ``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost`` with ``alloc``/``free``, the page
  helpers and ``load_to_device_per_layer`` / ``backup_from_device_all_layer``;
* ``LayerDoneCounter`` for layer-wise load overlap;
* L3: ``HiCacheFile`` (``FileOps`` is its file-system seam; ``refcache.gpu.faults`` injects faults).

See ``specs/data-plane.md`` for the contracts.

Importing this package chooses how Triton kernels run, for every entry point alike: without CUDA,
``TRITON_INTERPRET=1`` (the CPU interpreter) unless the environment already says otherwise. Triton reads
the variable when it is first imported, so this must come before any ``refcache.gpu`` module loads it.
It also applies ``REFCACHE_TORCH_THREADS`` (torch's intra-op threads; ``refcache.gpu.threads``).
"""

# ruff: noqa: E402 (the imports below the set-up must see TRITON_INTERPRET and the thread count first)

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from refcache.gpu.threads import configure_torch_threads

configure_torch_threads()  # REFCACHE_TORCH_THREADS, if set (refcache.gpu.threads)

# The kernels below import triton, which must see the choice above.
from refcache.gpu.allocator import PagedTokenToKVPoolAllocator, TokenToKVPoolAllocator
from refcache.gpu.device_pool import KVCache, MHATokenToKVPool, MLATokenToKVPool, device_pool_from_config
from refcache.gpu.host_pool import (
    HostKVCache,
    MHATokenToKVPoolHost,
    MLATokenToKVPoolHost,
    host_pool_from_config,
)
from refcache.gpu.kernels import kernels_available
from refcache.gpu.layer_done import CPUEvent, LayerDoneCounter, LayerLoadingEvent
from refcache.gpu.layout import KVView
from refcache.gpu.memory import default_device
from refcache.gpu.storage import FileOps, HiCacheFile
from refcache.gpu.transfer import (
    DISPATCH,
    TransferPlan,
    check_supported,
    move_indices,
    plan_transfer,
    run_transfer,
)

__all__ = [
    "DISPATCH",
    "CPUEvent",
    "FileOps",
    "HiCacheFile",
    "HostKVCache",
    "KVCache",
    "KVView",
    "LayerDoneCounter",
    "LayerLoadingEvent",
    "MHATokenToKVPool",
    "MHATokenToKVPoolHost",
    "MLATokenToKVPool",
    "MLATokenToKVPoolHost",
    "PagedTokenToKVPoolAllocator",
    "TokenToKVPoolAllocator",
    "TransferPlan",
    "check_supported",
    "configure_torch_threads",
    "default_device",
    "device_pool_from_config",
    "host_pool_from_config",
    "kernels_available",
    "move_indices",
    "plan_transfer",
    "run_transfer",
]
