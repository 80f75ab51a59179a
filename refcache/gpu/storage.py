"""File L3: SGLang's ``HiCacheFile`` (seed §3.3, §5.5, §5.8), one file per page key, made tamper-evident.

Semantics kept from SGLang:

* Key ``k`` lives in ``{directory}/{k}{config_suffix}.bin`` with ``config_suffix = _{model}`` for MLA
  (every rank holds the same latent, so ranks share objects) and ``_{model}_{tp_rank}_{tp_size}`` for
  MHA (each rank stores its own heads); ``/`` in the model name becomes ``-``.
* ``batch_exists(keys)`` is the number of leading keys present; ``set`` never overwrites an existing
  object (it returns True); ``batch_set`` stops at the first failure; ``clear()`` deletes every file in
  the directory.
* Two data paths: the generic one copies a flat page (``get_data_page`` order) to and from a tensor;
  ``batch_get_v1`` / ``batch_set_v1`` move bytes straight between the file and host-pool pages through
  ``get_page_buffer_meta`` (``readv``/``writev`` on the host memory, no intermediate tensor). Both write
  the same byte order (a page's segments in ascending address order are exactly ``get_data_page``'s
  flat order in every layout), so either path reads what the other wrote.

Beyond SGLang, every object is ``payload + footer``; the footer holds a magic, ``FORMAT_VERSION``, the
file's key, a page-format descriptor (attention, layout, dtype, shape, page size), the payload length,
the checksum algorithm and the payload checksum (``refcache.gpu.checksum``: XXH3-64, or CRC-32 where
libxxhash is missing). ``exists`` compares the file size with the expected size; a read checks
everything, and any mismatch (truncated, bit-flipped, another key's object, another layout's object,
half-written) is a miss: the file is deleted so a later ``set`` can rewrite it, and the caller gets
False/None. A hit guarantees the bytes written; on a miss the destination page's content is
unspecified (the v1 path reads into it before checking), and the caller frees it. Writes go to a
hidden temporary file that is renamed over the key only when complete, so no reader ever sees a partial
object; a failed write (no space, read-only directory) is reported for that page and its temporary file
removed. There is no fsync: rename atomicity protects readers, not against power loss (as SGLang).

All file-system calls go through a ``FileOps`` object, the seam that ``refcache.gpu.faults`` uses to
inject failures.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import struct
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Final

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import CorruptionError, StorageIOError, UsageError
from refcache.gpu import checksum
from refcache.gpu.checksum import Segment
from refcache.gpu.host_pool import HostKVCache
from refcache.gpu.memory import raw_bytes

__all__ = ["FORMAT_VERSION", "FileOps", "HiCacheFile", "describe_identity", "page_format", "stray_files"]

logger = logging.getLogger(__name__)

FORMAT_VERSION: Final = 1
_MAGIC: Final = b"RCKV"
# Footer: magic, format version, key length, page-format length, payload length, then the key and the
# page format (all predictable by a reader), then the checksum algorithm and the payload checksum.
_FIXED: Final = struct.Struct("<4sHHHQ")
_TRAILER: Final = struct.Struct("<HQ")
_IOV_MAX: Final = 512  # buffers per readv/writev call, below every platform's IOV_MAX
_HASH_CHUNK: Final = 512 << 10  # bytes a read moves before hashing them, while they are in the CPU cache


class FileOps:
    """The file-system calls ``HiCacheFile`` makes, as thin wrappers over ``os``. Subclass to inject
    faults (see ``refcache.gpu.faults``); every method raises ``OSError`` like its ``os`` counterpart."""

    def open(self, path: str, flags: int) -> int:
        return os.open(path, flags, 0o644)

    def fstat(self, fd: int) -> os.stat_result:
        return os.fstat(fd)

    def readv(self, fd: int, buffers: Sequence[memoryview]) -> int:
        return os.readv(fd, buffers)

    def writev(self, fd: int, buffers: Sequence[memoryview]) -> int:
        return os.writev(fd, buffers)

    def close(self, fd: int) -> None:
        os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def stat(self, path: str) -> os.stat_result:
        return os.stat(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)


def page_format(config: HiCacheConfig) -> str:
    """The page-format descriptor stored in every footer: objects are only readable by a pool with the
    same attention, layout, dtype, shape and page size (the payload's element order depends on them)."""
    if config.attention is AttentionKind.MHA:
        shape = f"L{config.layer_num}xH{config.head_num}xD{config.head_dim}"
    else:
        shape = f"L{config.layer_num}xR{config.kv_lora_rank}+{config.qk_rope_head_dim}"
    return f"{config.attention.value}/{config.hicache_mem_layout.value}/{config.dtype}/{shape}/ps{config.page_size}"


def _views(segments: Sequence[Segment], arena: tuple[int, memoryview] | None = None) -> list[memoryview]:
    """Memoryviews of ``segments``; those inside ``arena`` (base address, view of the whole host pool)
    are slices of it, which costs a fraction of building a view from an address."""
    if arena is None:
        return [raw_bytes(ptr, n) for ptr, n in segments]
    base, whole = arena
    return [
        whole[ptr - base : ptr - base + n] if 0 <= ptr - base <= len(whole) - n else raw_bytes(ptr, n)
        for ptr, n in segments
    ]


def _split(segments: Sequence[Segment], limit: int) -> list[list[Segment]]:
    """``segments`` cut into consecutive chunks of at most ``limit`` bytes each, in order (a segment is
    split where a chunk fills up)."""
    chunks: list[list[Segment]] = []
    chunk: list[Segment] = []
    room = limit
    for ptr, n in segments:
        while n:
            take = min(n, room)
            chunk.append((ptr, take))
            ptr, n, room = ptr + take, n - take, room - take
            if not room:
                chunks.append(chunk)
                chunk, room = [], limit
    if chunk:
        chunks.append(chunk)
    return chunks


def _tensor_segment(t: torch.Tensor) -> list[Segment]:
    if t.device.type != "cpu" or not t.is_contiguous():
        raise UsageError("L3 pages move through contiguous CPU tensors")
    return [(t.data_ptr(), t.numel() * t.element_size())]


def _transfer_all(
    call: Callable[[int, Sequence[memoryview]], int], fd: int, buffers: list[memoryview], total: int
) -> int:
    """Run ``readv``/``writev`` until every buffer (``total`` bytes in all) is done or a call moves 0
    bytes; returns bytes moved. One call does it all in the common case."""
    done = 0
    if len(buffers) <= _IOV_MAX:
        done = call(fd, buffers)
        if done == total or done <= 0:
            return done
    pending = [b for b in buffers if len(b)]
    n = done
    while True:
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if not pending:
            return done
        if n:
            pending[0] = pending[0][n:]
        n = call(fd, pending[:_IOV_MAX])
        if n <= 0:
            return done
        done += n


class HiCacheFile:
    """The ``file`` L3 backend of one rank. See the module docstring for the semantics.

    ``directory`` is created if missing. ``register_mem_pool_host`` must be called before the v1 paths.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        config: HiCacheConfig,
        tp_rank: int = 0,
        file_ops: FileOps | None = None,
    ) -> None:
        self.file_path = os.fspath(directory)
        self._dir_prefix = os.path.join(self.file_path, "")  # the directory and a separator
        self.config = config
        self.tp_rank = tp_rank
        self.tp_size = config.tp_size
        self.is_mla_model = config.attention is AttentionKind.MLA
        model = config.model_name.replace("/", "-")
        self.config_suffix = f"_{model}" if self.is_mla_model else f"_{model}_{tp_rank}_{self.tp_size}"
        self.ops = file_ops if file_ops is not None else FileOps()
        self.mem_pool_host: HostKVCache | None = None
        self._arena: tuple[int, memoryview] | None = None  # the host pool's memory, for cheap views
        self._format = page_format(config).encode()
        self.page_bytes = config.bytes_per_token * config.page_size
        self._fixed: dict[int, bytes] = {}  # footer's fixed part by key length; only _footer_prefix fills it
        # Temporary names: unique per process (pid at write time, so forks differ), per instance (random
        # tag) and per write (serial; ``next`` on an ``itertools.count`` is atomic under the GIL), without
        # the cost of a uuid4 per write.
        self._tmp_tag = uuid.uuid4().hex[:12]
        self._tmp_serial = itertools.count()
        # The temporary files of the writes in flight (by path); only _write adds and removes, under the lock.
        self._writing: set[str] = set()
        self._writing_lock = threading.Lock()
        os.makedirs(self.file_path, exist_ok=True)

    def register_mem_pool_host(self, mem_pool_host: HostKVCache) -> None:
        """Attach the host pool that the v1 paths read and write; its (resolved) configuration fixes the
        page format."""
        self.mem_pool_host = mem_pool_host
        view = mem_pool_host.kv_view()
        self._arena = (view.buffer.data_ptr(), raw_bytes(view.buffer.data_ptr(), view.extent))
        self._format = page_format(mem_pool_host.config).encode()
        self.page_bytes = mem_pool_host.page_size * mem_pool_host.size_per_token
        self._fixed = {}

    # --- names and footers ---------------------------------------------------------------------------

    def _name(self, key: str) -> str:
        if not key or os.sep in key or key.startswith("."):
            raise UsageError(
                f"L3 key {key!r} must be non-empty, not start with '.' and contain no {os.sep!r}"
            )
        return f"{key}{self.config_suffix}"

    def _get_path(self, key: str) -> str:
        return self._path(self._name(key))

    def _path(self, name: str) -> str:
        return f"{self._dir_prefix}{name}.bin"

    def _footer_prefix(self, name: str) -> bytes:
        key = name.encode()
        fixed = self._fixed.get(len(key))  # keys of a cache share one length: pack once
        if fixed is None:
            fixed = _FIXED.pack(_MAGIC, FORMAT_VERSION, len(key), len(self._format), self.page_bytes)
            self._fixed[len(key)] = fixed
        return fixed + key + self._format

    def _check_size(self, segments: Sequence[Segment]) -> None:
        size = sum(n for _, n in segments)
        if size != self.page_bytes:
            raise UsageError(f"an L3 page is {self.page_bytes} bytes, got {size}")

    def _mismatch(self, name: str, got: bytes) -> str:
        """Which footer field of ``got`` differs from what ``name``'s object must hold ("" if none)."""
        magic, version, key_len, fmt_len, payload = _FIXED.unpack_from(got)
        if magic != _MAGIC:
            return "not a refcache object (bad magic)"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if payload != self.page_bytes:
            return f"payload of {payload} bytes, expected {self.page_bytes}"
        key = got[_FIXED.size : _FIXED.size + key_len]
        if key != name.encode():
            return f"object of key {key.decode(errors='replace')!r} (files swapped or renamed)"
        fmt = got[_FIXED.size + key_len : _FIXED.size + key_len + fmt_len]
        if fmt != self._format:
            return f"page format {fmt.decode(errors='replace')!r}, expected {self._format.decode()!r}"
        return "footer bytes differ" if got != self._footer_prefix(name) else ""

    # --- object I/O ----------------------------------------------------------------------------------
    #
    # An object is ``payload + footer``: the payload starts at offset 0, page-aligned in the page cache,
    # which keeps the copy as fast as a raw read (a header in front measurably slows it); one writev
    # moves payload and footer together. A read moves the payload in chunks of at most _HASH_CHUNK
    # bytes, the footer with the last one, and hashes each chunk right after it lands, while it is still
    # in the CPU cache (a 2 MiB page hashed after one whole read comes back from memory). The checksum
    # runs on the caller's thread: a helper thread's hand-offs (thread wake-ups on a virtual machine)
    # measured dearer than hashing a 512 KiB page.

    def _read(self, key: str, segments: Sequence[Segment]) -> bytes:
        """Fill ``segments`` with ``key``'s payload; returns the identity the object's footer holds (its
        fixed part, key and page format, as read: what ``identity(key)`` must equal). Raises
        ``FileNotFoundError`` when absent, ``CorruptionError`` when the object is not exactly what ``set``
        wrote (deleting it unless it is merely unverifiable in this process), and ``StorageIOError`` when
        reading fails."""
        name = self._name(key)
        path = self._path(name)
        prefix = self._footer_prefix(name)
        footer = bytearray(len(prefix) + _TRAILER.size)
        total = self.page_bytes + len(footer)
        hashed = 0
        try:
            fd = self.ops.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise
        except OSError as e:
            raise StorageIOError(f"opening {path}: {e}") from e
        try:
            st = self.ops.fstat(fd)
            # The size check comes first so that a truncated object never touches the destination.
            if st.st_size != total:
                problem = f"{st.st_size} bytes, expected {total} (truncated, half-written or foreign)"
            else:
                got, hashed = self._read_hashed(fd, segments, footer)
                problem = f"read {got} of {total} bytes" if got != total else ""
        except OSError as e:
            raise StorageIOError(f"reading {path}: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                self.ops.close(fd)
        damaged = True
        if not problem and not footer.startswith(prefix):
            problem = self._mismatch(name, bytes(footer[: len(prefix)]))
        if not problem:
            algorithm, stored = _TRAILER.unpack_from(footer, len(prefix))
            if algorithm not in checksum.KNOWN:
                problem = f"unknown checksum algorithm {algorithm}"
            elif algorithm not in checksum.available():
                problem, damaged = f"checksum algorithm {algorithm} is not available in this process", False
            elif (actual := self._verify(algorithm, hashed, segments)) != stored:
                problem = f"payload checksum {actual:016x}, footer says {stored:016x} (bit rot or torn write)"
        if problem:
            if damaged:
                self._quarantine(path, st)
            raise CorruptionError(f"L3 object {name}: {problem}")
        return bytes(footer[: len(prefix)])

    def _read_hashed(self, fd: int, segments: Sequence[Segment], footer: bytearray) -> tuple[int, int]:
        """Read the payload into ``segments`` and the footer into ``footer``, hashing the payload chunk by
        chunk as it arrives with the algorithm this process writes (``checksum.preferred()``, before the
        footer says which one the object has); returns the bytes read and that checksum."""
        h = checksum.hasher(checksum.preferred())
        chunks = [segments] if self.page_bytes <= _HASH_CHUNK else _split(segments, _HASH_CHUNK)
        got, last = 0, len(chunks) - 1
        for i, chunk in enumerate(chunks):
            buffers = _views(chunk, self._arena)
            if i == last:
                buffers.append(memoryview(footer))  # with the last chunk: one call fewer
            want = sum(map(len, buffers))
            n = _transfer_all(self.ops.readv, fd, buffers, want)
            got += n
            h.update_segments(chunk)
            if n < want:
                break
        return got, h.digest()

    @staticmethod
    def _verify(algorithm: int, hashed: int, segments: Sequence[Segment]) -> int:
        """The payload checksum under ``algorithm``: the one taken while reading, unless the object was
        written with another algorithm (by a process without libxxhash), then hashed again."""
        return hashed if algorithm == checksum.preferred() else checksum.digest(algorithm, segments)

    def _quarantine(self, path: str, st: os.stat_result) -> None:
        # Delete the bad object so a later set can rewrite it, unless a writer has already replaced it.
        with contextlib.suppress(OSError):
            now = self.ops.stat(path)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self.ops.unlink(path)

    def _write(self, key: str, segments: Sequence[Segment]) -> None:
        """Write ``key``'s object atomically. Raises ``StorageIOError``; nothing partial stays visible."""
        name = self._name(key)
        path = self._path(name)
        algorithm = checksum.preferred()
        footer = self._footer_prefix(name) + _TRAILER.pack(algorithm, checksum.digest(algorithm, segments))
        tmp = f"{self._dir_prefix}.{name}.{os.getpid()}-{self._tmp_tag}-{next(self._tmp_serial)}.tmp"
        with self._writing_lock:
            self._writing.add(tmp)
        try:
            self._write_tmp(tmp, path, segments, footer)
        finally:
            with self._writing_lock:
                self._writing.discard(tmp)

    def _write_tmp(self, tmp: str, path: str, segments: Sequence[Segment], footer: bytes) -> None:
        try:
            fd = self.ops.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        except OSError as e:
            raise StorageIOError(f"creating {tmp}: {e}") from e
        try:
            try:
                buffers = _views(segments, self._arena)
                buffers.append(memoryview(footer))
                written = _transfer_all(self.ops.writev, fd, buffers, self.page_bytes + len(footer))
            finally:
                self.ops.close(fd)
            if written != self.page_bytes + len(footer):
                raise OSError(f"wrote {written} of {self.page_bytes + len(footer)} bytes")
            self.ops.replace(tmp, path)
        except OSError as e:
            with contextlib.suppress(OSError):
                self.ops.unlink(tmp)
            raise StorageIOError(f"writing {path}: {e}") from e

    def writes_in_flight(self) -> frozenset[str]:
        """The temporary files of this instance's writes now in flight (their paths)."""
        with self._writing_lock:
            return frozenset(self._writing)

    def _get_pages(
        self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], found: list[bytes] | None = None
    ) -> list[bool]:
        """Read each key into its page (segments of ``page_bytes`` in all: ``_pages`` and
        ``_tensor_pages`` check that); per-page hit. Misses are logged, never raised. ``found`` gets, per
        hit in order, the identity its object's footer held (``_read``)."""
        if len(keys) != len(pages):
            raise UsageError(f"{len(keys)} keys but {len(pages)} pages")
        results = []
        for key, segments in zip(keys, pages, strict=True):
            try:
                identity = self._read(key, segments)
            except FileNotFoundError:
                logger.debug("L3 miss: %s is absent", key)
                results.append(False)
            except (CorruptionError, StorageIOError) as e:
                logger.warning("L3 miss: %s", e)
                results.append(False)
            else:
                results.append(True)
                if found is not None:
                    found.append(identity)
        return results

    def _set_pages(
        self, keys: Sequence[str], pages: Sequence[Sequence[Segment]], stop_at_failure: bool
    ) -> list[bool]:
        """Store each page (sizes checked as for ``_get_pages``) under its key unless the key exists (never
        overwrite); per-page success."""
        if len(keys) != len(pages):
            raise UsageError(f"{len(keys)} keys but {len(pages)} pages")
        results = []
        for key, segments in zip(keys, pages, strict=True):
            if self.exists(key):
                results.append(True)  # a damaged object was deleted by the read that saw it
                continue
            try:
                self._write(key, segments)
            except StorageIOError as e:
                logger.warning("L3 write failed: %s", e)
                results.append(False)
                if stop_at_failure:
                    break
            else:
                results.append(True)
        return results

    # --- SGLang's interface ---------------------------------------------------------------------------

    def identity(self, key: str) -> bytes:
        """The identity ``key``'s object carries in its footer: the fixed part (magic, format version,
        lengths), the key with this rank's suffix and this pool's page format. A read that returns another
        identity returned another object (``describe_identity`` says whose)."""
        return self._footer_prefix(self._name(key))

    def object_bytes(self, key: str) -> int:
        """The size of ``key``'s object on disk: payload and footer."""
        return (
            self.page_bytes + _FIXED.size + len(self._name(key).encode()) + len(self._format) + _TRAILER.size
        )

    def exists(self, key: str) -> bool:
        """Whether an object of the right size exists for ``key`` (content is checked on read)."""
        try:
            size = self.ops.stat(self._get_path(key)).st_size
        except OSError:
            return False
        return size == self.object_bytes(key)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """The number of leading keys whose objects exist."""
        for i, key in enumerate(keys):
            if not self.exists(key):
                return i
        return len(keys)

    def get(self, key: str, target_location: torch.Tensor) -> torch.Tensor | None:
        """Read ``key``'s page into the flat CPU tensor ``target_location``; None on a miss."""
        return self.batch_get([key], [target_location])[0]

    def batch_get(
        self, keys: Sequence[str], target_locations: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Read each key's page into its flat CPU tensor (the generic, copying path); None on a miss."""
        hits = self._get_pages(keys, self._tensor_pages(target_locations))
        return [t if hit else None for t, hit in zip(target_locations, hits, strict=True)]

    def set(self, key: str, value: torch.Tensor) -> bool:
        """Store the flat page ``value`` under ``key``; True if stored or already present."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: Sequence[str], values: Sequence[torch.Tensor]) -> bool:
        """Store flat pages in order, stopping at the first failure (earlier pages stay written)."""
        values = [v.contiguous() for v in values]
        results = self._set_pages(keys, self._tensor_pages(values), stop_at_failure=True)
        return len(results) == len(keys) and all(results)

    def _tensor_pages(self, tensors: Sequence[torch.Tensor]) -> list[list[Segment]]:
        """One segment per flat page tensor (the generic path). Raises ``UsageError`` unless each is a
        contiguous CPU tensor of ``page_bytes``."""
        pages = [_tensor_segment(t) for t in tensors]
        for segments in pages:
            self._check_size(segments)
        return pages

    def _pages(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[list[Segment]]:
        """Per key, the host-pool memory of its page, segments in ascending address order."""
        host = self.mem_pool_host
        if host is None:
            raise UsageError("register_mem_pool_host must be called before batch_get_v1/batch_set_v1")
        if host_indices.numel() != len(keys) * host.page_size:
            raise UsageError(
                f"{len(keys)} keys need {len(keys) * host.page_size} host indices, got {host_indices.numel()}"
            )
        ptrs, sizes = host.get_page_buffer_meta(host_indices)
        per_page = len(ptrs) // max(1, len(keys))
        # Every page's segments come in the same layout order and sizes; sort that order once by address
        # and check the size once.
        order = sorted(range(per_page), key=lambda j: ptrs[j]) if ptrs else []
        pages = [[(ptrs[i * per_page + j], sizes[i * per_page + j]) for j in order] for i in range(len(keys))]
        if pages:
            self._check_size(pages[0])
        return pages

    def batch_get_v1(
        self, keys: Sequence[str], host_indices: torch.Tensor, found: list[bytes] | None = None
    ) -> list[bool]:
        """Read each key's page straight into the host-pool page at ``host_indices[i*ps]``; per-page hits.
        ``found`` gets each hit's identity as its footer held it (for ``KVOracle.check_identity``)."""
        return self._get_pages(keys, self._pages(keys, host_indices), found)

    def batch_set_v1(self, keys: Sequence[str], host_indices: torch.Tensor) -> list[bool]:
        """Write each host-pool page at ``host_indices[i*ps]`` under its key; per-page success."""
        return self._set_pages(keys, self._pages(keys, host_indices), stop_at_failure=False)

    def clear(self) -> None:
        """Delete every file in the directory (SGLang's ``clear``; other ranks' objects included)."""
        for name in self.ops.listdir(self.file_path):
            path = os.path.join(self.file_path, name)
            if os.path.isfile(path):
                with contextlib.suppress(FileNotFoundError):
                    self.ops.unlink(path)


def describe_identity(identity: bytes) -> str:
    """An object identity (``HiCacheFile.identity``'s form) in words: its key and page format, or what
    makes it unreadable."""
    if len(identity) < _FIXED.size:
        return f"{len(identity)} bytes, shorter than a footer"
    magic, version, key_len, fmt_len, payload = _FIXED.unpack_from(identity)
    key = identity[_FIXED.size : _FIXED.size + key_len].decode(errors="replace")
    fmt = identity[_FIXED.size + key_len : _FIXED.size + key_len + fmt_len].decode(errors="replace")
    return f"key {key!r}, page format {fmt!r} (magic {magic!r}, version {version}, payload {payload} bytes)"


_PUBLISHED = re.compile(r"[0-9a-f]{64}_.+\.bin")
"""A published object's file name: a page hash (SHA-256, hex), a rank's suffix, ``.bin`` (``_path``)."""


def stray_files(directory: str | os.PathLike[str], files: Sequence[HiCacheFile]) -> list[str]:
    """The L3 directory's hygiene: the names in ``directory`` that are neither a published object nor the
    temporary file of a write in flight in one of ``files`` (the instances sharing it), sorted. A write that
    failed must leave nothing behind (``_write`` removes its temporary file): one that does fills the disk
    unseen, since no read or key listing looks at such names."""
    writing = {os.path.basename(p) for f in files for p in f.writes_in_flight()}
    return sorted(
        name for name in os.listdir(directory) if not _PUBLISHED.fullmatch(name) and name not in writing
    )
