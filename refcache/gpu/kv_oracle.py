"""The KV content oracle: what the fake forward pass writes, and the checks every read path makes.

The KV of the token at position ``p`` of a key is a pure function of (namespace, the key elements
``0..p`` — the token's whole prefix —, layer, K or V, global head, dim). The prefix is folded into a 64-bit
chain state per position: the state after position ``p`` is the state before it plus a mix of
(element, ``p``), so a path's states are one vectorised cumulative sum (``advance``) and stay a function of
the whole prefix and of each element's position. A position's seed is its state's top 32 bits; each element
is the multiply-shift ``(seed * m) >> 28`` in 32-bit arithmetic, where ``m`` is an odd multiplier unique to
the element's (layer, K/V, global head, dim): a small integer in ``[-8, 7]``, exactly representable in every
supported dtype (fp8 included; never a NaN or inf pattern). The expected values of a read are its seeds
broadcast against the fixed multipliers, and reads are compared on the raw bits. MHA ranks hold different
heads (the global head index is ``rank * head_num + h``), MLA ranks hold the same latent, so an L3 object
written by one MLA rank is the right content for every rank.

A wrong slot, a stale page, a torn copy, a wrong layer or a wrong layout transform changes the bytes a
reader sees, and the check raises ``CorruptionError`` naming what was read (node path, layer, K/V and slot).
Two distinct tokens whose 32-bit seeds coincide (probability 2**-32 per pair) are the oracle's one blind
spot; every other misplaced element differs in about 15 of 16 positions of every token it touches.

Modes (``OracleMode``; ``HiCacheImpl(config, oracle=...)``, specs/data-plane.md "The content oracle"):
``"full"`` (the default, and what every check and fuzz run uses) writes every computed token's KV and
checks every position of every read; ``"sampled"`` still writes everything but checks, in each read, the
positions ``0, SAMPLE_STRIDE, 2 * SAMPLE_STRIDE, ...`` and the last one (a fixed rule: the same positions
on every run); ``"off"`` derives no seeds, writes no KV, checks nothing (and the driver does not poison
freed slots) — the data plane still moves the bytes.

Two paths, one result (specs/data-plane.md §10, §11). For a CPU pool in one contiguous allocation with a
1-, 2- or 4-byte float dtype, the C library ``csrc/oracle.c`` (``native.load("oracle")``; AVX2 blocks where
the CPU has them) does the work in one call each: a device hit's or a load-back layer's comparison reads the
pool in place and derives each expected element as it goes (the dtype's bits of -8..7 come from a 16-entry
table converted by torch, as ``expected`` converts), the fake forward pass's store writes the pool in
place, ``poison`` fills freed slots, and ``advance`` runs the chain. The per-layer accessors are still
called first, each waiting for its layer, and a read uses the C path only when every accessor hands out the
view of the single allocation it should. The torch (and numpy) path is the reference: it runs on CUDA
pools, with ``REFCACHE_NATIVE=off`` or without a compiler, and whenever the C path finds a difference it
runs on the same read to raise the ``CorruptionError`` with its message (``NativeDisagreement`` if it then
finds none). Both check the same positions and write the same bytes (tests/gpu/test_oracle_native.py).
"""

from __future__ import annotations

import array
import ctypes
import hashlib
from collections.abc import Sequence
from typing import Final, Literal, get_args, overload

import numpy as np
import numpy.typing as npt
import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import CorruptionError, RefcacheException
from refcache.gpu import native
from refcache.gpu.device_pool import KVCache
from refcache.gpu.host_pool import HostKVCache
from refcache.gpu.memory import INT_OF_SIZE
from refcache.gpu.storage import describe_identity
from refcache.hashing import Token

__all__ = ["SAMPLE_STRIDE", "KVOracle", "NativeDisagreement", "OracleMode", "Picked", "States"]

OracleMode = Literal["full", "sampled", "off"]
SAMPLE_STRIDE: Final = 8  # "sampled": every 8th position of a read (and its last)

_MASK64: Final = (1 << 64) - 1
_TAIL: Final = 1 << 40  # marks a position beyond the key (the last token of an EAGLE request)
_SHIFT: Final = 28  # int32 multiply-shift: the top 4 bits, as a signed value in [-8, 7]

States = npt.NDArray[np.uint64]  # per-position chain states (what trees cache)
Seeds = Sequence[int] | torch.Tensor  # per-position seeds: an int32 tensor (a list is converted)

_U64 = np.uint64
_GOLDEN: Final = _U64(0x9E3779B97F4A7C15)
_M1: Final = _U64(0xBF58476D1CE4E5B9)
_M2: Final = _U64(0x94D049BB133111EB)
_POSITION_KEY: Final = _U64(0x243F6A8885A308D3)  # keeps an element's mix apart from its position's
_POSITION_KEY_INT: Final = int(_POSITION_KEY)


def _mix(x: States) -> States:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic; a fresh array)."""
    x = x + _GOLDEN
    x ^= x >> _U64(30)
    x *= _M1
    x ^= x >> _U64(27)
    x *= _M2
    x ^= x >> _U64(31)
    return x


_position_keys: States = np.empty(0, dtype=np.uint64)  # mix(p ^ _POSITION_KEY) for p < its length


def _position_mix(start: int, n: int) -> States:
    """``mix(p ^ _POSITION_KEY)`` for ``p`` in ``[start, start + n)``: a slice of a table grown by doubling
    (replaced whole, never written in place, so a reader on another thread sees an old or a new table)."""
    global _position_keys
    table = _position_keys
    if start + n > len(table):
        size = max(4096, 2 * len(table), start + n)
        table = _position_keys = _mix(np.arange(size, dtype=np.uint64) ^ _POSITION_KEY)
    return table[start : start + n]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s raw bits as one flat integer tensor, in the widest integer its byte count and offset allow
    (comparing 8 bytes at a time is several times faster than one fp16 element at a time)."""
    flat = t.reshape(-1)
    size = flat.element_size()
    nbytes, offset = flat.numel() * size, flat.storage_offset() * size
    for dtype, wide in ((torch.int64, 8), (torch.int32, 4)):
        if wide > size and nbytes % wide == 0 and offset % wide == 0:
            return flat.view(dtype)
    return flat.view(INT_OF_SIZE[size])


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``got`` and ``want`` have one shape and hold the same raw bits (``_bits`` flattens)."""
    return got.shape == want.shape and torch.equal(_bits(got), _bits(want))


_PASS, _DIFFERS, _DECLINED = 0, 1, 2  # the C path's verdicts on a read
_DISAGREE = (
    "the C oracle found a difference in a {read} that the torch oracle does not find on the same read "
    "(a bug in refcache/gpu/csrc/oracle.c or kv_oracle.py; REFCACHE_NATIVE=off runs the torch path alone)"
)

# a device pool's kv_buffer, its rows, each (K/V, layer)'s buffer (start, strides) in them, and the rows'
# geometry for the C path: (start, row stride, slot stride in bytes, slots per row)
_FlatRows = tuple[torch.Tensor, torch.Tensor, list[tuple[int, tuple[int, ...]]], tuple[int, int, int, int]]


class NativeDisagreement(RefcacheException, AssertionError):
    """Raised when the C path found a difference that the torch path, run on the same read, does not (a bug
    in one of them, never a corrupted pool: the torch path is the reference). Report it; ``REFCACHE_NATIVE=off``
    runs the torch path alone meanwhile."""


_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


class _COracle:
    """The C fast path for CPU pools (``csrc/oracle.c``, loaded by ``native.load``): a read compared, a store
    written and a chain advanced in one call each, from raw pointers."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.check = lib.oracle_check  # (geometry, row_begin, row_end, slots, n, stride, seeds)
        self.check.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR]
        self.check.restype = _I64
        self.store = lib.oracle_store  # (geometry, rows, slots, n, seeds)
        self.store.argtypes = [_PTR, _I64, _PTR, _I64, _PTR]
        self.store.restype = _I64
        self.fill = lib.oracle_fill  # (geometry, rows, slots, n, row)
        self.fill.argtypes = [_PTR, _I64, _PTR, _I64, _PTR]
        self.fill.restype = _I64
        self.advance = lib.oracle_advance  # (values, n, state, position, key, seeds or NULL)
        self.advance.argtypes = [_PTR, _I64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_uint64, _PTR]
        self.advance.restype = None
        self.simd = lib.oracle_simd  # () -> whether the AVX2 blocks run here
        self.simd.argtypes = []
        self.simd.restype = _I64


class _CPool:
    """A CPU pool in one contiguous allocation as the C path addresses it: the geometry array the entry
    points take (``csrc/oracle.c``: start, row stride, slot stride, slots per row, elements per slot row,
    element size, the multipliers' and the dtype table's addresses, rows), a NaN slot row for poisoning,
    and the per-layer accessors' buffers already found to be the views they should be."""

    def __init__(self, flat: _FlatRows, multipliers: torch.Tensor, table: torch.Tensor, width: int) -> None:
        start, row_stride, slot_stride, size = flat[3]
        self.flat = flat
        self.keep = (multipliers, table)  # alive as long as the geometry points at them
        self.geometry = torch.tensor(
            [start, row_stride, slot_stride, size, width, table.element_size(), multipliers.data_ptr(),
             table.data_ptr(), flat[1].shape[0]],
            dtype=torch.int64,
        )  # fmt: skip
        self.g = self.geometry.data_ptr()
        self.nan = torch.full((width,), float("nan"), dtype=flat[0].dtype)
        self.views: list[torch.Tensor | None] = [None] * len(flat[2])

    def same_views(self, buffers: Sequence[Sequence[torch.Tensor]], layer_num: int, first: int = 0) -> bool:
        """Whether each accessor's buffer (``buffers[i]``: layer ``first + i``) is the view of the single
        allocation it should be: the very tensor found so before, else one whose start and strides are.
        Assumes the pool hands out the same view objects and nobody changes one's start or strides in place
        (``set_``, ``as_strided_``, ``resize_``): such a view is taken for what it was."""
        views, where = self.views, self.flat[2]
        for i, pair in enumerate(buffers):
            for kv, b in enumerate(pair):
                at = kv * layer_num + first + i
                if b is not views[at]:
                    if (b.data_ptr(), b.stride()) != where[at]:
                        return False
                    views[at] = b
        return True


_c_oracles: dict[int, tuple[ctypes.CDLL, _COracle]] = {}  # per loaded library (argument types set once)


def _c_oracle() -> _COracle | None:
    """The C path, or None (``REFCACHE_NATIVE=off``, no compiler; ``require`` raises instead)."""
    lib = native.load("oracle")
    if lib is None:
        return None
    known = _c_oracles.get(id(lib))
    if known is None or known[0] is not lib:
        known = _c_oracles[id(lib)] = (lib, _COracle(lib))
    return known[1]


def _cpu_index(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` contiguous for the C path; None (the torch path decides, and raises what torch raises) unless
    it is a 1-D int64 CPU tensor."""
    if not t.is_cpu or t.dim() != 1 or t.dtype != torch.int64:
        return None
    return t if t.is_contiguous() else t.contiguous()


class Picked(Sequence[str]):
    """``[base[i] for i in indices]``, read only when asked (the names of a read are formatted only for the
    message of a failing check)."""

    def __init__(self, base: Sequence[str], indices: Sequence[int]) -> None:
        self._base = base
        self._indices = indices

    def __len__(self) -> int:
        return len(self._indices)

    @overload
    def __getitem__(self, i: int) -> str: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...
    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return Picked(self._base, self._indices[i])
        return self._base[self._indices[i]]


class KVOracle:
    """Expected KV of one rank's pools (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int, mode: OracleMode = "full") -> None:
        if mode not in get_args(OracleMode):
            raise ValueError(f"oracle mode {mode!r} is not one of {', '.join(get_args(OracleMode))}")
        self.mode: OracleMode = mode
        self.enabled = mode != "off"
        self._roots: dict[str | None, int] = {}
        self.mla = config.attention is AttentionKind.MLA
        self.layer_num = config.layer_num
        self.num_kv = 1 if self.mla else 2
        self.head_num = 1 if self.mla else config.head_num
        self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim if self.mla else config.head_dim
        self.head_base = 0 if self.mla else rank * config.head_num
        heads = 1 if self.mla else config.tp_size * config.head_num  # global heads
        # Each element's coordinate (layer, K/V, global head, dim) numbered densely, then sent through a
        # bijection of 31-bit integers: the multipliers 2 * b + 1 are odd and pairwise distinct.
        layer = torch.arange(self.layer_num, dtype=torch.int64).view(-1, 1, 1, 1, 1)
        kv = torch.arange(self.num_kv, dtype=torch.int64).view(1, -1, 1, 1, 1)
        head = torch.arange(self.head_num, dtype=torch.int64).view(1, 1, 1, -1, 1) + self.head_base
        dim = torch.arange(self.head_dim, dtype=torch.int64).view(1, 1, 1, 1, -1)
        index = ((layer * self.num_kv + kv) * heads + head) * self.head_dim + dim
        if self.layer_num * self.num_kv * heads * self.head_dim > 1 << 31:
            raise ValueError("the KV oracle numbers at most 2**31 elements per token")
        # ``m`` (layer, kv, 1, head, dim): one odd int32 multiplier per coordinate
        self._multipliers = (_bijection31(index) * 2 + 1).to(torch.int32)
        # the same in (kv, layer, ...) order: a whole device read in the pool's own order (check_device)
        self._multipliers_kv_first = self._multipliers.transpose(0, 1).contiguous()
        # the checks' view of the last device pool they read (``_flat_rows``; one tuple, replaced whole:
        # the forward reads may run on another thread)
        self._flat: _FlatRows | None = None
        # the C path for CPU pools (None: the torch path everywhere) and, per pool dtype, the bits of the
        # values -8..7 in it (None: a dtype the C path does not handle)
        self._c = _c_oracle() if self.enabled else None
        self._tables: dict[torch.dtype, torch.Tensor | None] = {}
        self._cp: tuple[torch.Tensor, _CPool | None] | None = None  # the last pool the C path addressed

    # --- seeds -------------------------------------------------------------------------------------------

    def seeds(
        self, namespace: str | None, elements: Sequence[Token], tail: Sequence[int] = ()
    ) -> torch.Tensor:
        """Per-position seeds of ``elements`` (key elements from the root), then of ``tail`` tokens that
        have no key element (the unkeyed last token of an EAGLE request). Mode "off": zeros (unused)."""
        if not self.enabled:
            return torch.zeros(len(elements) + len(tail), dtype=torch.int32)
        return self.seeds_of(self.advance(self.root_state(namespace), elements, tail))

    def root_state(self, namespace: str | None) -> int:
        """The chain state before a namespace's first key element."""
        state = self._roots.get(namespace)
        if state is None:
            digest = hashlib.sha256(b"refcache-kv\x00" + (namespace or "").encode()).digest()
            state = self._roots[namespace] = int.from_bytes(digest[:8], "little")
        return state

    def advance(
        self, state: int, elements: Sequence[Token], tail: Sequence[int] = (), position: int = 0
    ) -> States:
        """The 64-bit chain states after each of ``elements`` then each ``tail`` token, from ``state`` (the
        state before key position ``position``, where ``elements[0]`` sits): state(p) = state(p - 1) +
        mix(element(p) ^ mix(p ^ key)), wrapping. A tree caches them per node (a path is derived once)."""
        return self._advance(state, elements, tail, position)[0]

    def advance_seeds(
        self, state: int, elements: Sequence[Token], tail: Sequence[int] = (), position: int = 0
    ) -> tuple[States, torch.Tensor]:
        """``advance`` and the ``seeds_of`` its states (the C path derives both in one pass)."""
        states, seeds = self._advance(state, elements, tail, position, with_seeds=True)
        return states, self.seeds_of(states) if seeds is None else seeds

    def _advance(
        self,
        state: int,
        elements: Sequence[Token],
        tail: Sequence[int],
        position: int,
        *,
        with_seeds: bool = False,
    ) -> tuple[States, torch.Tensor | None]:
        n = len(elements) + len(tail)
        if elements and isinstance(elements[0], tuple):  # bigram key elements (a, b): (a << 33) ^ (b + 1)
            values: Sequence[int] = [((e[0] << 33) ^ (e[1] + 1)) & _MASK64 for e in elements]  # type: ignore[index]
        else:
            values = elements  # type: ignore[assignment]
        if tail:
            values = [*values, *(_TAIL + t for t in tail)]
        c = self._c
        words = None
        if c is not None and n:  # the same arithmetic in one loop, the seeds on the way
            try:
                words = array.array("Q", values)
            except OverflowError:  # an element outside [0, 2**64): numpy's path raises numpy's error
                words = None
        if c is not None and words is not None:
            seeds = torch.empty(n, dtype=torch.int32) if with_seeds else None
            out = None if seeds is None else seeds.data_ptr()
            c.advance(words.buffer_info()[0], n, state, position, _POSITION_KEY_INT, out)
            return np.frombuffer(words, dtype=np.uint64), seeds
        x = np.array(values, dtype=np.uint64) if n else np.empty(0, dtype=np.uint64)
        x ^= _position_mix(position, n)
        x = _mix(x)
        np.cumsum(x, out=x)
        x += _U64(state)
        return x, None

    @staticmethod
    def seeds_of(states: States) -> torch.Tensor:
        """The seeds of ``states``: their top 32 bits, as an int32 tensor."""
        return torch.from_numpy((states >> _U64(32)).astype(np.uint32).view(np.int32))

    def expected(
        self, seeds: Seeds, dtype: torch.dtype = torch.float32, *, kv_first: bool = False
    ) -> torch.Tensor:
        """``(layer_num, num_kv, len(seeds), head_num, head_dim)`` values in ``[-8, 7]`` as ``dtype``
        (``kv_first``: ``(num_kv, layer_num, ...)``, the device pool's order)."""
        multipliers = self._multipliers_kv_first if kv_first else self._multipliers
        x = _seed_tensor(seeds).view(1, 1, -1, 1, 1) * multipliers  # wraps modulo 2**32
        x >>= _SHIFT
        return _convert(x, dtype)

    # --- the fake forward pass -----------------------------------------------------------------------------

    def write_device(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds) -> None:
        """Store the KV of freshly computed tokens in device ``slots`` (every layer)."""
        if not self.enabled or not _count(seeds):
            return
        if self._c is not None and self._store_c(pool, slots, seeds):
            return
        pool.set_kv_buffers(
            slots.to(pool.device), self.expected(seeds, pool.dtype, kv_first=True).to(pool.device)
        )

    # --- checks ----------------------------------------------------------------------------------------------

    def check_device_layers(
        self, pool: KVCache, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]
    ) -> None:
        """Compare every layer of device ``slots`` with the oracle, each layer read through the pool's
        per-layer accessors (which wait for that layer's load) as soon as its accessor returns — the
        forward pass of a load-back reads layer ``i`` once its event fired — and the whole read compared
        once after the last layer. ``what[i]`` names position ``i``'s node for the message. (The C path
        compares each layer where the torch path copies it, right after its accessor returns.)"""
        if not self.enabled or not _count(seeds):
            return
        if self._c is not None:
            verdict = self._check_layers_c(pool, slots, seeds)
            if verdict == _PASS:
                return
            if verdict == _DIFFERS:
                self._check_device_layers(pool, slots, seeds, what)
                raise NativeDisagreement(_DISAGREE.format(read="load-back"))
        self._check_device_layers(pool, slots, seeds, what)

    def _check_device_layers(
        self, pool: KVCache, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]
    ) -> None:
        """``check_device_layers``' torch path."""
        slots, seeds, what = self._sample(slots, seeds, what)
        index = slots.to(pool.device)
        n = len(index)
        got = torch.empty(
            (self.layer_num, self.num_kv, n, self.head_num, self.head_dim),
            dtype=pool.dtype,
            device=pool.device,
        )
        for layer in range(self.layer_num):
            pair = (pool.get_key_buffer(layer),) if self.mla else pool.get_kv_buffer(layer)
            for kv, b in enumerate(pair):
                torch.index_select(b, 0, index, out=got[layer, kv])
        got = got.cpu()
        want = self.expected(seeds, pool.dtype)
        if not _same_bits(got, want):
            for layer in range(self.layer_num):
                if not _same_bits(got[layer], want[layer]):
                    self._raise(got[layer], want[layer], layer, slots, what, "device")

    def check_device(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]) -> None:
        """Compare every layer of device ``slots`` with the oracle: each layer read through the pool's
        per-layer accessors, the whole read compared at once."""
        if not self.enabled or not _count(seeds):
            return
        buffers = [
            (pool.get_key_buffer(layer),) if self.mla else pool.get_kv_buffer(layer)
            for layer in range(self.layer_num)
        ]
        if self._c is not None:
            verdict = self._check_c(pool, buffers, slots, seeds)
            if verdict == _PASS:
                return
            if verdict == _DIFFERS:
                self._check_device(pool, buffers, slots, seeds, what)
                raise NativeDisagreement(_DISAGREE.format(read="device hit"))
        self._check_device(pool, buffers, slots, seeds, what)

    def _check_device(
        self,
        pool: KVCache,
        buffers: Sequence[Sequence[torch.Tensor]],
        slots: torch.Tensor,
        seeds: Seeds,
        what: Sequence[str],
    ) -> None:
        """``check_device``'s torch path, on the accessors' ``buffers``."""
        slots, seeds, what = self._sample(slots, seeds, what)
        got = self._read_all(pool, buffers, slots.to(pool.device)).cpu()  # (num_kv, layer_num, n, h, d)
        want = self.expected(seeds, pool.dtype, kv_first=True)
        if not _same_bits(got, want):
            for layer in range(self.layer_num):
                if not _same_bits(got[:, layer].contiguous(), want[:, layer].contiguous()):
                    self._raise(got[:, layer], want[:, layer], layer, slots, what, "device")

    def _read_all(
        self, pool: KVCache, buffers: Sequence[Sequence[torch.Tensor]], index: torch.Tensor
    ) -> torch.Tensor:
        """``(num_kv, layer_num, len(index), head_num, head_dim)``: every layer of ``index`` as the per-layer
        accessors gave it (``buffers``, each after waiting for its layer). When every accessor's buffer is
        the view of the pool's single allocation it should be (the common case), one gather reads them all;
        otherwise each accessor's buffer is read on its own."""
        flat = self._flat_rows(pool)
        if flat is not None and self._as_flat(buffers, flat):
            got = flat[1].index_select(1, index).view(pool.dtype)
            return got.view(self.num_kv, self.layer_num, len(index), self.head_num, self.head_dim)
        return torch.stack(
            [torch.stack([b.index_select(0, index) for b in pair]) for pair in buffers], dim=1
        ).view(self.num_kv, self.layer_num, len(index), self.head_num, self.head_dim)

    def _as_flat(self, buffers: Sequence[Sequence[torch.Tensor]], flat: _FlatRows) -> bool:
        """Whether each accessor's buffer (``buffers[layer]``) is the view of the pool's single allocation
        that it should be."""
        where = flat[2]
        return all(
            (b.data_ptr(), b.stride()) == where[kv * self.layer_num + i]
            for i, pair in enumerate(buffers)
            for kv, b in enumerate(pair)
        )

    # --- the C path ----------------------------------------------------------------------------------------

    def _table(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The bits of the values -8..7 in ``dtype`` (converted as ``expected`` converts), as 16 integers of
        the dtype's width; None when the C path does not handle the dtype (1, 2 or 4 bytes)."""
        if dtype in self._tables:
            return self._tables[dtype]
        table: torch.Tensor | None = None
        if dtype.is_floating_point and dtype.itemsize in (1, 2, 4):
            values = _convert(torch.arange(-8, 8, dtype=torch.int32), dtype)
            table = values.view(INT_OF_SIZE[dtype.itemsize]).contiguous()
        self._tables[dtype] = table
        return table

    def _c_pool(self, pool: KVCache) -> _CPool | None:
        """The pool as the C path addresses it, when it can (a CPU pool in one contiguous allocation, a 1-,
        2- or 4-byte float dtype), else None; built once per allocation."""
        known = self._cp
        buffer = pool.kv_buffer
        if known is not None and known[0] is buffer:
            return known[1]
        cp: _CPool | None = None
        table = self._table(pool.dtype) if pool.device.type == "cpu" else None
        flat = self._flat_rows(pool) if table is not None else None
        if table is not None and flat is not None:
            cp = _CPool(flat, self._multipliers_kv_first, table, self.head_num * self.head_dim)
        self._cp = (buffer, cp)
        return cp

    def _c_args(
        self, pool: KVCache, slots: torch.Tensor, seeds: Seeds
    ) -> tuple[_COracle, _CPool, torch.Tensor, torch.Tensor] | None:
        """What a C check or store of ``slots`` takes: the library, the pool as it addresses it, the slots
        as contiguous int64 and the seeds as contiguous int32 CPU tensors of one length; None when the C
        path declines (another device, dtype or layout)."""
        c = self._c
        cp = self._c_pool(pool)
        index = _cpu_index(slots)
        if c is None or cp is None or index is None:
            return None
        seed = _seed_tensor(seeds)
        if seed.shape[0] != index.shape[0]:
            return None
        return c, cp, index, seed if seed.is_contiguous() else seed.contiguous()

    def _check_c(
        self, pool: KVCache, buffers: Sequence[Sequence[torch.Tensor]], slots: torch.Tensor, seeds: Seeds
    ) -> int:
        """``check_device`` in C: _PASS, _DIFFERS, or _DECLINED (an accessor's buffer is not the view of
        the single allocation it should be, another device, dtype or layout, a slot out of range: the
        torch path decides)."""
        args = self._c_args(pool, slots, seeds)
        if args is None or not args[1].same_views(buffers, self.layer_num):
            return _DECLINED
        c, cp, index, seed = args
        rows = self.num_kv * self.layer_num
        found = c.check(cp.g, 0, rows, index.data_ptr(), index.shape[0], self._stride(), seed.data_ptr())
        return _PASS if found == -2 else _DECLINED if found == -1 else _DIFFERS

    def _check_layers_c(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds) -> int:
        """``check_device_layers`` in C: each layer compared in place right after its accessor returns (as
        the torch path copies it then); the verdict as ``_check_c``'s, after the last layer."""
        args = self._c_args(pool, slots, seeds)
        if args is None:
            return _DECLINED
        c, cp, index, seed = args
        verdict = _PASS
        for layer in range(self.layer_num):
            pair = (pool.get_key_buffer(layer),) if self.mla else pool.get_kv_buffer(layer)
            if not cp.same_views([pair], self.layer_num, layer):
                return _DECLINED
            for kv in range(self.num_kv):
                row = kv * self.layer_num + layer
                found = c.check(
                    cp.g, row, row + 1, index.data_ptr(), index.shape[0], self._stride(), seed.data_ptr()
                )
                if found == -1:
                    return _DECLINED
                if found >= 0:
                    verdict = _DIFFERS
        return verdict

    def _store_c(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds) -> bool:
        """``write_device`` in C, straight into the pool's single allocation; False when declined (another
        device, dtype or layout, a slot out of range: ``set_kv_buffers`` decides)."""
        args = self._c_args(pool, slots, seeds)
        if args is None:
            return False
        c, cp, index, seed = args
        rows = self.num_kv * self.layer_num
        return int(c.store(cp.g, rows, index.data_ptr(), index.shape[0], seed.data_ptr())) == 0

    def poison(self, pool: KVCache, slots: torch.Tensor) -> None:
        """``pool.poison(slots)`` (every layer of freed ``slots`` overwritten with NaN), in C for a CPU pool
        in one contiguous allocation."""
        c = self._c
        if c is not None:
            cp = self._c_pool(pool)
            index = _cpu_index(slots)
            if cp is not None and index is not None:
                rows = self.num_kv * self.layer_num
                if c.fill(cp.g, rows, index.data_ptr(), index.shape[0], cp.nan.data_ptr()) == 0:
                    return
        pool.poison(slots)

    def _stride(self) -> int:
        """The C path's sampling rule (``_sample``'s): every position, or every SAMPLE_STRIDE-th and the last."""
        return 1 if self.mode == "full" else SAMPLE_STRIDE

    def _flat_rows(self, pool: KVCache) -> _FlatRows | None:
        """``pool.kv_buffer``, its integer rows (``KVCache.int_rows``: few wide items per slot to gather),
        each (K/V, layer)'s buffer start and strides in it, and the rows' geometry in bytes; None when the
        allocation is not one contiguous tensor or not of this oracle's shape (num_kv * layer_num rows of
        head_num * head_dim elements per slot: the torch path then raises its own error)."""
        flat = self._flat
        buffer = pool.kv_buffer
        if flat is not None and flat[0] is buffer:
            return flat
        int_rows = pool.int_rows()
        if int_rows is None:
            return None
        rows = int_rows[0]
        size = rows.element_size()
        row_bytes = self.head_num * self.head_dim * buffer.element_size()
        if rows.shape[0] != self.num_kv * self.layer_num or rows.shape[2] * size != row_bytes:
            return None
        shaped = buffer.view(self.num_kv, self.layer_num, rows.shape[1], self.head_num, self.head_dim)
        where = [
            (shaped[kv, layer].data_ptr(), shaped[kv, layer].stride())
            for kv in range(self.num_kv)
            for layer in range(self.layer_num)
        ]
        geometry = (rows.data_ptr(), rows.stride(0) * size, rows.stride(1) * size, rows.shape[1])
        self._flat = flat = (buffer, rows, where, geometry)
        return flat

    def check_host(self, pool: HostKVCache, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]) -> None:
        """Compare every layer of host ``slots`` (any layout) with the oracle."""
        if not len(seeds) or not self.enabled:
            return
        slots, seeds, what = self._sample(slots, seeds, what)
        view = pool.kv_view()
        layers = range(self.layer_num)
        got = torch.cat([view.run(int(s), 1, layers) for s in slots.tolist()], dim=2)  # (kv, layer, n, h, d)
        want = self.expected(seeds, got.dtype)
        for layer in layers:
            if not _same_bits(got[:, layer].contiguous(), want[layer]):
                self._raise(got[:, layer], want[layer], layer, slots, what, "host")

    def check_identity(self, found: Sequence[bytes], requested: Sequence[bytes], what: Sequence[str]) -> None:
        """The read-back identity of L3 objects: each object a read returned (``found``: the identity its
        footer held, ``HiCacheFile.identity``'s form) is the one requested — its key and page format, not
        only a footer of the right shape. ``what[i]`` names the first position of page ``i``. Raises
        ``CorruptionError`` naming both objects. The content check that follows compares the payload;
        this one names the object, and holds in ``"sampled"`` mode too."""
        if not self.enabled:
            return
        for i, (got, want) in enumerate(zip(found, requested, strict=True)):
            if got != want:
                raise CorruptionError(
                    f"L3 object read for {what[i]} is not the one requested: it holds "
                    f"{describe_identity(got)}, expected {describe_identity(want)}"
                )

    def _sample(
        self, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]
    ) -> tuple[torch.Tensor, Seeds, Sequence[str]]:
        """The positions of a read that are checked: all ("full"), or every SAMPLE_STRIDE-th and the last."""
        n = len(seeds)
        if self.mode == "full" or n <= 2:
            return slots, seeds, what
        keep = [*range(0, n - 1, SAMPLE_STRIDE), n - 1]
        if isinstance(seeds, torch.Tensor):  # strided views, not an index per position
            picked: Seeds = torch.cat((seeds[: n - 1 : SAMPLE_STRIDE], seeds[n - 1 :]))
        else:
            picked = [seeds[i] for i in keep]
        return torch.cat((slots[: n - 1 : SAMPLE_STRIDE], slots[n - 1 :])), picked, Picked(what, keep)

    def _raise(
        self,
        got: torch.Tensor,
        want: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        what: Sequence[str],
        tier: str,
    ) -> None:
        """``got``/``want``: one layer, ``(num_kv, n, head_num, head_dim)``, whose raw bits differ."""
        size = got.element_size()
        diff = got.contiguous().view(INT_OF_SIZE[size]) != want.contiguous().view(INT_OF_SIZE[size])
        kv, pos = (int(i) for i in diff.nonzero()[0][:2])
        name = ("K", "V")[kv] if not self.mla else "latent"
        raise CorruptionError(
            f"{tier} KV of {what[pos]} differs from the oracle: layer {layer}, {name}, slot "
            f"{int(slots[pos])} (position {pos} of the read)"
        )


def _bijection31(x: torch.Tensor) -> torch.Tensor:
    """A bijection of ``[0, 2**31)`` (odd multiplications and xor-shifts modulo 2**31), on int64."""
    mask = (1 << 31) - 1
    x = (x * 0x2C1B3C6D) & mask
    x ^= x >> 16
    x = (x * 0x297A2D39) & mask
    x ^= x >> 15
    x = (x * 0x3C6EF35F) & mask
    return x ^ (x >> 16)


def _count(seeds: Seeds) -> int:
    """``len(seeds)`` (a tensor's ``len`` is a Python-level call several times slower than its shape)."""
    return seeds.shape[0] if isinstance(seeds, torch.Tensor) else len(seeds)


def _convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int32 values in ``[-8, 7]`` as ``dtype`` (the C path's table is this conversion of -8..7)."""
    if dtype.is_floating_point and dtype != torch.float32:
        # through fp32, exact for [-8, 7]: torch's int32 -> fp16 conversion is twice int32 -> fp32 -> fp16
        return x.to(torch.float32).to(dtype)
    return x.to(dtype)


def _seed_tensor(seeds: Seeds) -> torch.Tensor:
    if isinstance(seeds, torch.Tensor):
        return seeds if seeds.dtype == torch.int32 else seeds.to(torch.int32)
    ints = seeds if isinstance(seeds, list) else list(seeds)
    return torch.tensor(ints, dtype=torch.int64).to(torch.int32)  # a seed is 32 bits (wraps to int32)
