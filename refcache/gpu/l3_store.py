"""One rank's L3 as the cache controller uses it: ``HiCacheFile`` with the object lifecycle of D-18.

An L3 object is absent, readable or damaged. ``batch_exists`` counts the leading objects present (a
damaged object is present: the file backend only checks names and sizes). A read stops at the first
miss — absent, unreadable, or damaged, which ``HiCacheFile`` detects by checksum and deletes, so that the
next backup writes it again. ``set`` never overwrites an existing object. Payloads move zero-copy
between the files and the host pool (``batch_get_v1`` / ``batch_set_v1``).

Faults (``StorageFault``): ``corrupt`` zeroes the payload checksum stored in the object's footer (bit
rot the reader detects; unlike flipping a payload byte, damaging an object twice leaves it damaged),
``delete`` removes the object, and the next read or write batch fails through
``refcache.gpu.faults.FaultyFileOps`` (every read fails with ``EIO``; every write hits a read-only file
system).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Sequence

import torch

from refcache.config import HiCacheConfig
from refcache.gpu.faults import FaultyFileOps
from refcache.gpu.host_pool import HostKVCache
from refcache.gpu.storage import HiCacheFile

__all__ = ["L3Store"]

_OBJECT = ".bin"


class L3Store:
    """The file L3 of one rank (see the module docstring). Keys are page hashes; ``HiCacheFile`` adds
    the rank's suffix (seed §5.5). One reader thread and one writer thread per rank may use it."""

    def __init__(self, directory: str, config: HiCacheConfig, rank: int, host_pool: HostKVCache) -> None:
        self.ops = FaultyFileOps()
        self.file = HiCacheFile(directory, config, rank, self.ops)
        self.file.register_mem_pool_host(host_pool)
        self.directory = directory
        self.suffix = self.file.config_suffix
        self.page_size = config.page_size
        self._lock = threading.Lock()  # guards the one-shot fault flags
        self.fail_next_read = False  # only inject/_take touch these
        self.fail_next_write = False

    def keys(self) -> list[str]:
        """This rank's view: the storage keys (``hash + suffix``) of the objects present, sorted."""
        out = []
        for name in os.listdir(self.directory):
            stem, ext = os.path.splitext(name)
            if ext == _OBJECT and stem.endswith(self.suffix) and len(stem) == 64 + len(self.suffix):
                out.append(stem)
        return sorted(out)

    # --- the three calls the controller makes --------------------------------------------------------------

    def batch_exists(self, page_hashes: Sequence[str]) -> int:
        """The number of leading keys present (damaged objects count)."""
        return self.file.batch_exists(page_hashes)

    def batch_get_v1(self, page_hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Read pages straight into the host pool, stopping at the first miss; per-page hits (False from
        the first miss on). An injected read fault fails the batch."""
        ps = self.page_size
        results = [False] * len(page_hashes)
        if self._take("read"):
            self.ops.fail_reads = 1 << 30
        try:
            for i, page_hash in enumerate(page_hashes):
                if not self.file.batch_get_v1([page_hash], host_indices[i * ps : (i + 1) * ps])[0]:
                    break
                results[i] = True
        finally:
            self.ops.fail_reads = 0
        return results

    def batch_set_v1(self, page_hashes: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Write pages from the host pool, skipping existing objects; per-page success. An injected write
        fault fails the whole batch."""
        failing = self._take("write")
        self.ops.read_only = failing
        try:
            results = self.file.batch_set_v1(page_hashes, host_indices)
        finally:
            self.ops.read_only = False
        return [False] * len(page_hashes) if failing else results

    # --- faults ----------------------------------------------------------------------------------------------

    def inject(self, kind: str, index: int) -> None:
        """``corrupt``/``delete`` the object at ``index`` of the sorted view (mod its length), or arm
        ``fail_next_read``/``fail_next_write``."""
        if kind in ("fail_next_read", "fail_next_write"):
            with self._lock:
                setattr(self, kind, True)
            return
        view = self.keys()
        if not view:
            return
        path = os.path.join(self.directory, view[index % len(view)] + _OBJECT)
        if kind == "corrupt":
            _damage(path)
        elif kind == "delete":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def _take(self, which: str) -> bool:
        with self._lock:
            name = f"fail_next_{which}"
            armed: bool = getattr(self, name)
            setattr(self, name, False)
            return armed


def _damage(path: str) -> None:
    """Zero the stored payload checksum (the footer's last 8 bytes), so that the next read sees a
    mismatch. Idempotent; only a payload whose checksum is 0 (probability 2**-64) would still read."""
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(bytes(8))
