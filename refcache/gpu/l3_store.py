"""One rank's L3 as the cache controller uses it: ``HiCacheFile`` with the object lifecycle of D-18.

An L3 object is absent, readable or damaged. ``batch_exists`` counts the leading objects present (a
damaged object is present: the file backend only checks names and sizes). A read stops at the first
miss — absent, unreadable, or damaged, which ``HiCacheFile`` detects by checksum and deletes, so that the
next backup writes it again. ``set`` never overwrites an existing object. Payloads move zero-copy
between the files and the host pool (``batch_get_v1`` / ``batch_set_v1``).

Faults (``StorageFault``): ``corrupt`` zeroes the payload checksum stored in the object's footer (bit
rot the reader detects), ``flip_payload`` adds one to a payload byte (the offset comes from the fault's
index), ``stale`` turns the object into one of an older format version, ``misplaced`` overwrites it with
a copy of the next key's object, ``delete`` removes it; damaging an object again leaves it damaged. The
next read or write batch fails through ``refcache.gpu.faults.FaultyFileOps`` (every read fails with
``EIO``; every write hits a read-only file system); ``disk_full`` leaves room for ``index % 3`` more pages
(the write after them is cut short and fails with ``ENOSPC``) and ``fail_publish`` makes the renames that
publish new objects fail, both until a write batch has failed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import struct
import threading
from collections.abc import Sequence

import torch

from refcache.config import HiCacheConfig
from refcache.gpu.faults import FaultyFileOps
from refcache.gpu.host_pool import HostKVCache
from refcache.gpu.storage import FORMAT_VERSION, HiCacheFile

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

    def batch_get_v1(
        self, page_hashes: Sequence[str], host_indices: torch.Tensor, found: list[bytes] | None = None
    ) -> list[bool]:
        """Read pages straight into the host pool, stopping at the first miss; per-page hits (False from
        the first miss on). An injected read fault fails the batch. ``found`` gets each hit's identity as
        its object's footer held it (``HiCacheFile.batch_get_v1``)."""
        ps = self.page_size
        results = [False] * len(page_hashes)
        if self._take("read"):
            self.ops.fail_reads = 1 << 30
        try:
            for i, page_hash in enumerate(page_hashes):
                if not self.file.batch_get_v1([page_hash], host_indices[i * ps : (i + 1) * ps], found)[0]:
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
        if failing:
            return [False] * len(page_hashes)
        if not all(results):  # a full disk or a failed publish has failed a write: spent
            with self._lock:
                self.ops.space_left = None
                self.ops.fail_replace = False
        return results

    def identity(self, page_hash: str) -> bytes:
        """The identity the object of ``page_hash`` must carry (``HiCacheFile.identity``)."""
        return self.file.identity(page_hash)

    # --- faults ----------------------------------------------------------------------------------------------

    def inject(self, kind: str, index: int) -> None:
        """Damage the object at ``index`` of the sorted view (mod its length; ``misplaced``: mod its length
        less one), or arm a read or write fault (see the module docstring)."""
        if kind in ("fail_next_read", "fail_next_write"):
            with self._lock:
                setattr(self, kind, True)
            return
        if kind == "disk_full":
            size = self.file.object_bytes("0" * 64)  # every object of this rank has this size
            with self._lock:
                self.ops.space_left = (index % 3) * size + size // 2
            return
        if kind == "fail_publish":
            with self._lock:
                self.ops.fail_replace = True
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
        elif kind == "flip_payload":
            _bump_byte(path, (index // len(view) * 7919 + index) % self.file.page_bytes)
        elif kind == "stale":
            _make_stale(path, self.file.page_bytes)
        elif kind == "misplaced" and len(view) >= 2:
            # From a later key to an earlier one only: no fault ever puts an object back under its own key.
            i = index % (len(view) - 1)
            shutil.copyfile(
                os.path.join(self.directory, view[i + 1] + _OBJECT),
                os.path.join(self.directory, view[i] + _OBJECT),
            )

    def _take(self, which: str) -> bool:
        with self._lock:
            name = f"fail_next_{which}"
            armed: bool = getattr(self, name)
            setattr(self, name, False)
            return armed


def _bump_byte(path: str, offset: int) -> None:
    """Add one (mod 256) to the payload byte at ``offset``: detected by the checksum, and a second bump
    of the same byte does not undo the first (an XOR flip would)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([(byte + 1) % 256]))


def _make_stale(path: str, page_bytes: int) -> None:
    """Rewrite the footer's format version (after the payload and the 4-byte magic) as an older one."""
    with open(path, "r+b") as f:
        f.seek(page_bytes + 4)
        f.write(struct.pack("<H", FORMAT_VERSION - 1))


def _damage(path: str) -> None:
    """Zero the stored payload checksum (the footer's last 8 bytes), so that the next read sees a
    mismatch. Idempotent; only a payload whose checksum is 0 (probability 2**-64) would still read."""
    with open(path, "r+b") as f:
        f.seek(-8, os.SEEK_END)
        f.write(bytes(8))
