"""Storage fault injection for tests: a ``FileOps`` that fails on demand, and ways to damage objects.

Shipped in the package (not under tests/) so that controller and harness tests can inject the same
faults. Nothing here is used by the product code path; ``HiCacheFile`` only sees a ``FileOps``. Every
injected ``OSError`` says so in its message (``injected``): ``HiCacheFile`` logs failed reads and writes,
and these lines show up in the middle of a ``refcache fuzz`` run.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from refcache.gpu.storage import FileOps

__all__ = ["FaultyFileOps", "flip_byte", "injected", "swap_files", "truncate_file", "write_partial_object"]


def injected(code: int, *filenames: str) -> OSError:
    """The ``OSError`` an injected fault raises: errno ``code``, and a message that says it was injected
    (``[Errno 5] injected fault: Input/output error``), so that a log line cannot pass for a real disk
    error."""
    return OSError(code, f"injected fault: {os.strerror(code)}", *filenames)


class FaultyFileOps(FileOps):
    """``FileOps`` with switchable failures (all off by default; tests flip them between calls).

    ``space_left``: bytes that writes may still put on disk before ``ENOSPC`` (None: unlimited).
    ``read_only``: opening for writing fails with ``EROFS`` (a read-only mount; works as root too).
    ``fail_replace``: the rename that publishes an object fails with ``EIO``.
    ``fail_reads``: that many following ``readv`` calls fail with ``EIO``.
    """

    def __init__(self) -> None:
        self.space_left: int | None = None
        self.read_only = False
        self.fail_replace = False
        self.fail_reads = 0

    def open(self, path: str, flags: int) -> int:
        if self.read_only and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise injected(errno.EROFS, path)
        return super().open(path, flags)

    def writev(self, fd: int, buffers: Sequence[memoryview]) -> int:
        if self.space_left is None:
            return super().writev(fd, buffers)
        if self.space_left == 0:
            raise injected(errno.ENOSPC)
        # Write what fits, like a file system that fills up mid-write; the next call fails.
        room, fitting = self.space_left, []
        for b in buffers:
            if room == 0:
                break
            fitting.append(b[:room])
            room -= len(fitting[-1])
        written = super().writev(fd, fitting)
        self.space_left -= written
        return written

    def readv(self, fd: int, buffers: Sequence[memoryview]) -> int:
        if self.fail_reads:
            self.fail_reads -= 1
            raise injected(errno.EIO)
        return super().readv(fd, buffers)

    def replace(self, src: str, dst: str) -> None:
        if self.fail_replace:
            raise injected(errno.EIO, src)
        super().replace(src, dst)


def truncate_file(path: str, size: int) -> None:
    """Cut the file at ``path`` to ``size`` bytes."""
    os.truncate(path, size)


def flip_byte(path: str, offset: int, mask: int = 0xFF) -> None:
    """XOR the byte at ``offset`` of ``path`` with ``mask`` (non-zero)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def swap_files(a: str, b: str) -> None:
    """Exchange the contents of two objects (each now sits under the other's key)."""
    tmp = f"{a}.swap"
    os.replace(a, tmp)
    os.replace(b, a)
    os.replace(tmp, b)


def write_partial_object(src: str, dst: str, nbytes: int) -> None:
    """Put the first ``nbytes`` of the object ``src`` at ``dst`` non-atomically, as a writer that crashed
    mid-write without a temporary file would leave it."""
    with open(src, "rb") as f:
        data = f.read(nbytes)
    with open(dst, "wb") as f:
        f.write(data)
