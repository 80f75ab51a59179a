"""Process-wide set-up the adapter needs once: the import shim, the patches of SGLang's module globals, the
one-rank gloo group and the logical clock.

Every patch here replaces a module global that SGLang 0.5.20 itself resolves at import time or reads through
a documented dispatch table; no SGLang function or class is replaced:

==============================================  ==================================================  ======================
name                                            where                                               why
==============================================  ==================================================  ======================
``device_module``                               ``managers/cache_controller.py``,                   copies wait for
                                                ``mem_cache/l2_transfer.py``                        ``CompleteIO`` (_gate)
``torch`` (up to 0.5.5: its ``cuda`` only)      ``managers/cache_controller.py``                    as ``device_module``
``torch`` (up to 0.5.5: its ``cuda`` only)      ``mem_cache/memory_pool_host.py``                   host registration is
                                                                                                    CUDA-only
``transfer_kv_*`` (``_cpu.FUNCTIONS``)          ``mem_cache/pool_host/mha.py``, ``mla.py``          undefined on CPU
``ALLOC_MEMORY_FUNCS["cpu"]``                   ``mem_cache/pool_host/common.py``                   host registration is
                                                                                                    CUDA-only
``time``                                        ``mem_cache/radix_cache.py``, ``hiradix_cache.py``  LRU stamps from a
                                                                                                    logical counter
``time``                                        ``managers/cache_controller.py``                    prefetch start times
                                                                                                    on ``AdvanceClock``
``Queue``                                       ``managers/cache_controller.py``                    storage threads wait
                                                                                                    for ``CompleteIO``
                                                                                                    (``_storage``)
``_load_native_hash_module``                    ``mem_cache/cpp_utils/native_hash.py``              a C++ build at first
                                                                                                    hash: ``hashlib``
==============================================  ==================================================  ======================

The page hashes (L3 keys) come from ``_PageHash``, the same chained SHA-256 as 0.5.20's C++ extension
(``hash_binding.cpp``: ``SHA256(prior digest || uint32 words of the page)``, bigram pages as pairs), so that
no C++ compiler or OpenSSL headers are needed; on this machine the two agreed on every input tried (regular,
bigram, with and without a prior digest; specs/sglang-adapter.md, 'L3').
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import tempfile
import threading
import time as _real_time
import types
import warnings
from typing import Any, Final

from refcache.engines.sglang import _compat, _cpu, _gate, _shim, _storage, versions

__all__ = [
    "LOCK",
    "ClockSeconds",
    "LogicalTime",
    "ensure_ready",
    "rank_and_size",
    "use_batch_size",
    "use_clock",
]

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

        self.now_us = 0  # the adapter's logical clock (``AdvanceClock``)
        self.seconds = False  # while True, ``monotonic`` reads the clock (``clock_seconds``)

    def monotonic(self) -> float:
        if self.seconds:
            return self.now_us / 1_000_000
        self.ticks += 1
        return float(self.ticks)


class ClockSeconds(types.SimpleNamespace):
    """The ``time`` of ``cache_controller``: ``monotonic()`` is the logical clock in seconds (a prefetch's
    ``start_time``), so that 0.5.20's timeout compares clock readings, not access counts."""

    def __init__(self, clock: LogicalTime) -> None:
        super().__init__(perf_counter=_real_time.perf_counter, time=_real_time.time, sleep=_real_time.sleep)
        self._clock = clock

    def monotonic(self) -> float:
        return self._clock.now_us / 1_000_000


class PerfClockSeconds(ClockSeconds):
    """The ``time`` of 0.5.23's ``utils/poll_timer``: ``perf_counter()`` is the logical clock in seconds too, so
    that a ``PollTimer`` (the storage prefetch's wait, D-55) times the clock's moves."""

    def __init__(self, clock: LogicalTime) -> None:
        super().__init__(clock)
        self.perf_counter = self.monotonic


class _PageHash:
    """``hicache_hash_cpp`` in Python (see the module docstring): ``get_hash(raw, logical_len, unit_width,
    is_bigram, prior_digest, page_size)`` returns the chained page hashes (one string if page_size is None)."""

    @staticmethod
    def get_hash(
        raw: Any,
        logical_len: int,
        unit_width: int,
        is_bigram: bool,
        prior_digest: bytes | None,
        page_size: int | None,
    ) -> str | list[str]:
        words = [int(w) for w in raw]
        if is_bigram:
            units = [words[i : i + 2] for i in range(logical_len)]
        else:
            units = [words[i * unit_width : (i + 1) * unit_width] for i in range(logical_len)]
        step = page_size or max(logical_len, 1)
        out: list[str] = []
        prior = prior_digest
        for start in range(0, max(logical_len, 1 if page_size is None else 0), step):
            h = hashlib.sha256()
            if prior is not None:
                h.update(prior)
            for unit in units[start : start + step]:
                for w in unit:
                    h.update(w.to_bytes(4, "little"))
            prior = h.digest()
            out.append(h.hexdigest())
        return out[0] if page_size is None else out


def ensure_ready() -> None:
    """Import SGLang (through the shim when needed), patch its module globals, and start the one-rank
    gloo process group. Idempotent."""
    global _ready
    with LOCK:
        if _ready:
            return
        _shim.install()
        logging.getLogger("sglang").setLevel(logging.ERROR)
        compat = _compat.Compat(versions.installed().rows)
        if compat.has("kvcacheio_at_import"):
            _provide_kvcacheio()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # AWQ / GGUF "CUDA only" notices at import
            import sglang.srt.managers.cache_controller as cache_controller
            import sglang.srt.mem_cache.hiradix_cache  # noqa: F401 - the class under test

            modules = {role: compat.module(role) for role in _compat.MODULES}
            found: dict[str, Any] = {
                r: importlib.import_module(m) for r, m in modules.items() if m is not None
            }
        if compat.has("controller_cuda_streams"):  # up to 0.5.5: torch.cuda's streams and events by name
            cache_controller.torch = _TorchWithCuda(_gate.FAKE_DEVICE_MODULE)
        else:
            cache_controller.device_module = _gate.FAKE_DEVICE_MODULE
        cache_controller.Queue = _storage.GatedQueue
        if "native_hash" in found:
            found["native_hash"]._load_native_hash_module = lambda: _PageHash
        if "l2_transfer" in found:
            found["l2_transfer"].device_module = _gate.FAKE_DEVICE_MODULE
            found["l2_transfer"]._timing_events_supported.cache_clear()
        if "host_common" in found:
            found["host_common"].ALLOC_MEMORY_FUNCS["cpu"] = (
                _alloc_host_memory_unwrapped
                if compat.has("host_alloc_without_allocator")
                else _alloc_host_memory
            )
        if compat.has("host_pin_always"):  # 0.5.4.post2..0.5.5.post2: no pin switch; registers nothing
            found["host_mha"].torch = _TorchWithCuda(_NO_HOST_REGISTRATION)
        elif compat.has("host_pin_at_allocation"):  # to 0.5.4.post1: torch.empty(pin_memory=) pins nothing
            found["host_mha"].torch = _TorchUnpinned()
        elif compat.has("host_pin_inline"):  # up to 0.5.6: no dispatch table; the CPU pool must not pin
            found["host_mha"].SUPPORT_PIN_MEMORY = False
        _cpu.install(dict.fromkeys([found["host_mha"], found["host_mla"]]))
        _init_process_group()
        _ready = True


class _TorchWithCuda(types.ModuleType):
    """``torch`` as an SGLang module up to 0.5.5 sees it where it names ``torch.cuda`` itself: every attribute is
    torch's but ``cuda``. The controller's ``cuda`` is the fake device module (``_compat``
    "controller_cuda_streams": ``Stream``, ``Event``, ``stream``, ``current_stream``, where later releases
    name their ``device_module``); the host pools' is ``_NO_HOST_REGISTRATION`` ("host_pin_always")."""

    def __init__(self, cuda: object) -> None:
        super().__init__("torch")
        self.cuda = cuda

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


_NO_HOST_REGISTRATION: Final = types.SimpleNamespace(
    cudart=lambda: types.SimpleNamespace(cudaHostRegister=lambda *args: 0),
)
"""``torch.cuda`` in up to 0.5.5's host pool module, whose pools always pin their buffer with
``torch.cuda.cudart().cudaHostRegister`` (``_compat`` "host_pin_always"): CPU memory, registered nowhere."""


class _TorchUnpinned(types.ModuleType):
    """``torch`` as the host pool module up to 0.5.4 sees it (``_compat`` "host_pin_at_allocation"): its pools
    allocate with ``torch.empty(..., pin_memory=True)`` / ``torch.zeros(...)``, which a CPU-only torch refuses
    (pinning needs an accelerator); here both allocate the same tensor unpinned. Every other attribute is
    torch's."""

    def __init__(self) -> None:
        super().__init__("torch")

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> Any:
        import torch

        kwargs.pop("pin_memory", None)
        return torch.empty(*args, **kwargs)

    @staticmethod
    def zeros(*args: Any, **kwargs: Any) -> Any:
        import torch

        kwargs.pop("pin_memory", None)
        return torch.zeros(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)


def _provide_kvcacheio() -> None:
    """Up to 0.5.12 the host pool module imports ``sgl_kernel.kvcacheio``'s copy functions when it loads
    (``_compat`` "kvcacheio_at_import"). Without ``sgl_kernel`` (no CUDA), that module is made of ``_cpu``'s
    functions — the ones ``_cpu.install`` puts in the host pool modules on every release anyway."""
    try:
        importlib.import_module("sgl_kernel.kvcacheio")
        return  # a GPU machine: the real module; _cpu.install still replaces its names in the pool modules
    except ImportError:
        pass
    package = types.ModuleType("sgl_kernel")
    package.__path__ = []
    kvcacheio = types.ModuleType("sgl_kernel.kvcacheio")
    kvcacheio.__dict__.update(_cpu.FUNCTIONS)
    kvcacheio.__dict__["__refcache_stub__"] = True
    package.__dict__["kvcacheio"] = kvcacheio
    sys.modules.setdefault("sgl_kernel", package)
    sys.modules["sgl_kernel.kvcacheio"] = kvcacheio


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


def _alloc_host_memory_unwrapped(
    dims: tuple[int, ...], dtype: object, device: object, pin_memory: bool
) -> object:
    """``_alloc_host_memory`` where the dispatch table passes no allocator (``_compat`` "host_alloc_without_allocator",
    0.5.6's post releases): the tensor itself, unpinned."""
    import torch

    return torch.empty(dims, dtype=dtype, device=device)  # type: ignore[call-overload]


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
    import sglang.srt.managers.cache_controller as cache_controller
    import sglang.srt.mem_cache.hiradix_cache as hiradix_cache
    import sglang.srt.mem_cache.radix_cache as radix_cache

    radix_cache.time = clock
    hiradix_cache.time = clock
    cache_controller.time = ClockSeconds(clock)


def use_batch_size(pages: int) -> None:
    """Make ``pages`` the ``STORAGE_BATCH_SIZE`` of SGLang's controller (its module global, imported from
    ``hicache_storage``; 128 in 0.5.20): the configuration's ``storage_batch_size``."""
    import sglang.srt.managers.cache_controller as cache_controller

    cache_controller.STORAGE_BATCH_SIZE = pages
