"""Process-wide set-up the adapter needs once: the import shim, the patches of SGLang's module globals, the
one-rank gloo group and the logical clock.

Every patch here replaces a module global that SGLang 0.5.20 itself resolves at import time or reads through
a documented dispatch table; no SGLang function or class is replaced:

==============================================  ==================================================  ======================
name                                            where                                               why
==============================================  ==================================================  ======================
``device_module``                               ``managers/cache_controller.py``,                   copies wait for
                                                ``mem_cache/l2_transfer.py``                        ``CompleteIO`` (_gate)
``transfer_kv_*`` (``_cpu.FUNCTIONS``)          ``mem_cache/pool_host/mha.py``, ``mla.py``          undefined on CPU
``ALLOC_MEMORY_FUNCS["cpu"]``                   ``mem_cache/pool_host/common.py``                   host registration is
                                                                                                    CUDA-only
``time``                                        ``mem_cache/radix_cache.py``, ``hiradix_cache.py``  LRU stamps from a
                                                                                                    logical counter
==============================================  ==================================================  ======================
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time as _real_time
import types
import warnings
from typing import Final

from refcache.engines.sglang import _cpu, _gate, _shim

__all__ = ["LOCK", "LogicalTime", "ensure_ready", "rank_and_size", "use_clock"]

LOCK: Final = threading.RLock()
"""Held by every adapter call: SGLang's patched module globals (the clock) are process-wide."""

_ready = False


class LogicalTime(types.SimpleNamespace):
    """A stand-in for the ``time`` module in SGLang's tree modules: ``monotonic()`` returns a counter that
    every call advances, so no two access or creation stamps are equal (D-02: no eviction ties, and the
    same relative order as the model's stamps). Everything else is the real ``time``."""

    def __init__(self) -> None:
        super().__init__(perf_counter=_real_time.perf_counter, time=_real_time.time, sleep=_real_time.sleep)
        self.ticks = 0

    def monotonic(self) -> float:
        self.ticks += 1
        return float(self.ticks)


def ensure_ready() -> None:
    """Import SGLang (through the shim when needed), patch its module globals, and start the one-rank
    gloo process group. Idempotent."""
    global _ready
    with LOCK:
        if _ready:
            return
        _shim.install()
        logging.getLogger("sglang").setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # AWQ / GGUF "CUDA only" notices at import
            import sglang.srt.managers.cache_controller as cache_controller
            import sglang.srt.mem_cache.hiradix_cache  # noqa: F401 - the class under test
            import sglang.srt.mem_cache.l2_transfer as l2_transfer
            import sglang.srt.mem_cache.pool_host.common as host_common
            import sglang.srt.mem_cache.pool_host.mha as host_mha
            import sglang.srt.mem_cache.pool_host.mla as host_mla
        cache_controller.device_module = _gate.FAKE_DEVICE_MODULE
        l2_transfer.device_module = _gate.FAKE_DEVICE_MODULE
        l2_transfer._timing_events_supported.cache_clear()
        host_common.ALLOC_MEMORY_FUNCS["cpu"] = _alloc_host_memory
        _cpu.install([host_mha, host_mla])
        _init_process_group()
        _ready = True


def _alloc_host_memory(
    dims: tuple[int, ...],
    dtype: object,
    device: object,
    pin_memory: bool,
    allocator: object,
    registration_granularity_bytes: int | None = None,
) -> object:
    """The host pools' allocation for a CPU "device": SGLang's allocator, no ``cudaHostRegister``."""
    return allocator.allocate(dims, dtype=dtype, device=device)  # type: ignore[attr-defined]


def _init_process_group() -> None:
    """A one-rank gloo group, unless this process already joined one (a rank worker of ``_tp``)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    store_path = os.path.join(tempfile.mkdtemp(prefix="refcache-sglang-"), "gloo-store")
    store = dist.FileStore(store_path, 1)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def rank_and_size() -> tuple[int, int]:
    """This process's rank and the size of its group (``ensure_ready`` started a one-rank group unless a
    rank worker of ``_tp`` joined a larger one first)."""
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def use_clock(clock: LogicalTime) -> None:
    """Make ``clock`` the ``time`` of SGLang's tree modules (called at the start of every adapter call)."""
    import sglang.srt.mem_cache.hiradix_cache as hiradix_cache
    import sglang.srt.mem_cache.radix_cache as radix_cache

    radix_cache.time = clock
    hiradix_cache.time = clock
