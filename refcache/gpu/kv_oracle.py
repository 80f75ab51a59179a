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
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final, Literal, get_args, overload

import numpy as np
import numpy.typing as npt
import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import CorruptionError
from refcache.gpu.device_pool import KVCache
from refcache.gpu.host_pool import HostKVCache
from refcache.gpu.memory import INT_OF_SIZE
from refcache.hashing import Token

__all__ = ["SAMPLE_STRIDE", "KVOracle", "OracleMode", "Picked", "States"]

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


# a device pool's kv_buffer, its rows and each (K/V, layer)'s buffer (start, strides) in them
_FlatRows = tuple[torch.Tensor, torch.Tensor, list[tuple[int, tuple[int, ...]]]]


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

    @staticmethod
    def advance(state: int, elements: Sequence[Token], tail: Sequence[int] = (), position: int = 0) -> States:
        """The 64-bit chain states after each of ``elements`` then each ``tail`` token, from ``state`` (the
        state before key position ``position``, where ``elements[0]`` sits): state(p) = state(p - 1) +
        mix(element(p) ^ mix(p ^ key)), wrapping. A tree caches them per node (a path is derived once)."""
        n = len(elements) + len(tail)
        if elements and isinstance(elements[0], tuple):  # bigram key elements (a, b): (a << 33) ^ (b + 1)
            values: Sequence[int] = [((e[0] << 33) ^ (e[1] + 1)) & _MASK64 for e in elements]  # type: ignore[index]
        else:
            values = elements  # type: ignore[assignment]
        if tail:
            values = [*values, *(_TAIL + t for t in tail)]
        x = np.array(values, dtype=np.uint64) if n else np.empty(0, dtype=np.uint64)
        x ^= _position_mix(position, n)
        x = _mix(x)
        np.cumsum(x, out=x)
        x += _U64(state)
        return x

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
        if dtype.is_floating_point and dtype != torch.float32:
            # through fp32, exact for [-8, 7]: torch's int32 -> fp16 conversion is twice int32 -> fp32 -> fp16
            return x.to(torch.float32).to(dtype)
        return x.to(dtype)

    # --- the fake forward pass -----------------------------------------------------------------------------

    def write_device(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds) -> None:
        """Store the KV of freshly computed tokens in device ``slots`` (every layer)."""
        if not len(seeds) or not self.enabled:
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
        once after the last layer. ``what[i]`` names position ``i``'s node for the message."""
        if not len(seeds) or not self.enabled:
            return
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
        if not len(seeds) or not self.enabled:
            return
        slots, seeds, what = self._sample(slots, seeds, what)
        got = self._read_all(pool, slots.to(pool.device)).cpu()  # (num_kv, layer_num, n, head_num, head_dim)
        want = self.expected(seeds, pool.dtype, kv_first=True)
        if not _same_bits(got, want):
            for layer in range(self.layer_num):
                if not _same_bits(got[:, layer].contiguous(), want[:, layer].contiguous()):
                    self._raise(got[:, layer], want[:, layer], layer, slots, what, "device")

    def _read_all(self, pool: KVCache, index: torch.Tensor) -> torch.Tensor:
        """``(num_kv, layer_num, len(index), head_num, head_dim)``: every layer of ``index`` as the per-layer
        accessors give it (each waits for its layer). When every accessor's buffer is the view of the pool's
        single allocation it should be (the common case), one gather reads them all; otherwise each
        accessor's buffer is read on its own."""
        buffers = [
            (pool.get_key_buffer(layer),) if self.mla else pool.get_kv_buffer(layer)
            for layer in range(self.layer_num)
        ]
        flat = self._flat_rows(pool)
        if flat is not None:
            rows, where = flat[1], flat[2]
            if all(
                (b.data_ptr(), b.stride()) == where[kv * self.layer_num + layer]
                for layer, pair in enumerate(buffers)
                for kv, b in enumerate(pair)
            ):
                got = rows.index_select(1, index).view(pool.dtype)
                return got.view(self.num_kv, self.layer_num, len(index), self.head_num, self.head_dim)
        return torch.stack(
            [torch.stack([b.index_select(0, index) for b in pair]) for pair in buffers], dim=1
        ).view(self.num_kv, self.layer_num, len(index), self.head_num, self.head_dim)

    def _flat_rows(self, pool: KVCache) -> _FlatRows | None:
        """``pool.kv_buffer``, its integer rows (``KVCache.int_rows``: few wide items per slot to gather)
        and each (K/V, layer)'s buffer start and strides in it; None when the allocation is not one
        contiguous tensor."""
        flat = self._flat
        buffer = pool.kv_buffer
        if flat is not None and flat[0] is buffer:
            return flat
        int_rows = pool.int_rows()
        if int_rows is None:
            return None
        rows = int_rows[0]
        shaped = buffer.view(self.num_kv, self.layer_num, rows.shape[1], self.head_num, self.head_dim)
        where = [
            (shaped[kv, layer].data_ptr(), shaped[kv, layer].stride())
            for kv in range(self.num_kv)
            for layer in range(self.layer_num)
        ]
        self._flat = flat = (buffer, rows, where)
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


def _seed_tensor(seeds: Seeds) -> torch.Tensor:
    if isinstance(seeds, torch.Tensor):
        return seeds if seeds.dtype == torch.int32 else seeds.to(torch.int32)
    ints = seeds if isinstance(seeds, list) else list(seeds)
    return torch.tensor(ints, dtype=torch.int64).to(torch.int32)  # a seed is 32 bits (wraps to int32)
