"""Payload checksums for L3 objects: XXH3-64 when the system's libxxhash is present, CRC-32 otherwise.

A read touches every payload byte twice (copy, then verify), so the checksum's speed bounds L3 read
bandwidth: zlib's CRC-32 runs at about 4 GB/s on the development machine, below a page-cache read,
while XXH3 runs at about 40 GB/s with AVX2. Python's standard library has nothing faster than CRC-32, so XXH3 is
called through ctypes from ``libxxhash.so.0`` (Debian/Ubuntu package ``libxxhash0``) when it loads.
Each object records which algorithm wrote it; a reader without that algorithm reports a miss.

Both are streaming (``Hasher.update`` per segment), so the checksum of a page does not depend on how
its bytes are split into segments: the zero-copy and the generic path agree. Both release the GIL
while hashing (zlib for buffers over a few KiB, ctypes always), so a helper thread can hash one page
while the caller copies the next.
"""

from __future__ import annotations

import ctypes
import threading
import zlib
from collections.abc import Sequence
from typing import Final, Protocol

__all__ = ["CRC32", "KNOWN", "XXH3", "Hasher", "Segment", "available", "digest", "new", "preferred"]

Segment = tuple[int, int]  # (address, byte count) of memory that stays alive during the call

CRC32: Final = 1
XXH3: Final = 2
KNOWN: Final = frozenset({CRC32, XXH3})  # ids a valid object may carry, whether computable here or not


class Hasher(Protocol):
    def update(self, ptr: int, nbytes: int) -> None:
        """Add the ``nbytes`` bytes at address ``ptr``."""

    def update_segments(self, segments: Sequence[Segment]) -> None:
        """Add each segment in order (no Python call per segment)."""

    def digest(self) -> int:
        """The checksum of everything added so far (call once)."""
        ...


class _CRC32:
    def __init__(self) -> None:
        self._crc = 0

    def update(self, ptr: int, nbytes: int) -> None:
        self._crc = zlib.crc32((ctypes.c_char * nbytes).from_address(ptr), self._crc)

    def update_segments(self, segments: Sequence[Segment]) -> None:
        for ptr, nbytes in segments:
            self.update(ptr, nbytes)

    def digest(self) -> int:
        return self._crc


class _XXH3Lib:
    """The five functions of libxxhash's XXH3 streaming API."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.create, self.free = lib.XXH3_createState, lib.XXH3_freeState
        # The _dispatch variant picks the widest SIMD the CPU has (AVX2/AVX-512: 2-3x the SSE2 default).
        self.reset = lib.XXH3_64bits_reset
        self.update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
        self.digest = lib.XXH3_64bits_digest
        self.create.restype = ctypes.c_void_p
        self.free.argtypes = [ctypes.c_void_p]
        self.reset.argtypes = [ctypes.c_void_p]
        self.update.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self.digest.argtypes = [ctypes.c_void_p]
        self.digest.restype = ctypes.c_uint64


class _XXH3:
    def __init__(self, lib: _XXH3Lib) -> None:
        self._lib = lib
        self._state = lib.create()
        if not self._state:
            raise MemoryError("XXH3_createState failed")
        lib.reset(self._state)

    def update(self, ptr: int, nbytes: int) -> None:
        self._lib.update(self._state, ptr, nbytes)

    def update_segments(self, segments: Sequence[Segment]) -> None:
        update, handle = self._lib.update, self._state
        for ptr, nbytes in segments:
            update(handle, ptr, nbytes)

    def digest(self) -> int:
        return int(self._lib.digest(self._state))

    def __del__(self) -> None:
        self._lib.free(self._state)


def _load_xxh3() -> _XXH3Lib | None:
    try:
        return _XXH3Lib(ctypes.CDLL("libxxhash.so.0"))
    except (OSError, AttributeError):
        return None


_xxh3: Final = _load_xxh3()


_AVAILABLE: Final = frozenset({CRC32, XXH3}) if _xxh3 is not None else frozenset({CRC32})


def available() -> frozenset[int]:
    """The algorithm ids this process can compute."""
    return _AVAILABLE


def preferred() -> int:
    """The fastest available algorithm (what new objects are written with)."""
    return XXH3 if _xxh3 is not None else CRC32


_local = threading.local()  # .xxh3: this thread's reusable XXH3 state (only hasher touches it)


def hasher(algorithm: int) -> Hasher:
    """A fresh-started hasher for ``algorithm``, valid until the next ``hasher`` or ``digest`` call on the
    same thread: XXH3 reuses one state per thread (reset, not allocated and freed per page). Raises
    ``KeyError`` for an algorithm not in ``available()``."""
    if algorithm == XXH3 and _xxh3 is not None:
        state: _XXH3 | None = getattr(_local, "xxh3", None)
        if state is None:
            state = _local.xxh3 = _XXH3(_xxh3)
        _xxh3.reset(state._state)
        return state
    return new(algorithm)


def digest(algorithm: int, segments: Sequence[Segment]) -> int:
    """The checksum of the concatenated ``segments``, the same as a ``new(algorithm)`` hasher fed them in
    order. Raises ``KeyError`` for an algorithm not in ``available()``. Uses (and resets) this thread's
    ``hasher``: the L3 calls this once per page (16 segments for a ``layer_first`` page)."""
    h = hasher(algorithm)
    h.update_segments(segments)
    return h.digest()


def new(algorithm: int) -> Hasher:
    """A fresh hasher. Raises ``KeyError`` for an algorithm not in ``available()``."""
    if algorithm == XXH3 and _xxh3 is not None:
        return _XXH3(_xxh3)
    if algorithm == CRC32:
        return _CRC32()
    raise KeyError(f"checksum algorithm {algorithm} is not available")
