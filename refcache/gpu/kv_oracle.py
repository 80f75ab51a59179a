"""The KV content oracle: what the fake forward pass writes, and the checks every read path makes.

The KV of the token at position ``p`` of a key is a pure function of (namespace, the key elements
``0..p`` — the token's whole prefix —, layer, K or V, global head, dim): the prefix is folded into a 63-bit
rolling seed per position (``seeds``), and each element is a small integer in ``[-7, 7]``, exactly
representable in every supported dtype (fp8 included). MHA ranks hold different heads (the global head
index is ``rank * head_num + h``), MLA ranks hold the same latent, so an L3 object written by one MLA rank
is the right content for every rank.

A wrong slot, a stale page, a torn copy or a wrong layout transform changes the bytes a reader sees, and
the check raises ``CorruptionError`` naming what was read (node path, layer, K/V and slot).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import CorruptionError
from refcache.gpu.device_pool import KVCache
from refcache.gpu.host_pool import HostKVCache
from refcache.hashing import Token

__all__ = ["KVOracle"]

_MASK64: Final = (1 << 64) - 1
_MASK63: Final = (1 << 63) - 1
_TAIL: Final = 1 << 40  # marks a position beyond the key (the last token of an EAGLE request)


def _mix(x: int) -> int:
    """splitmix64's finaliser, on Python ints."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _element(token: Token) -> int:
    if isinstance(token, tuple):
        return (token[0] << 33) ^ (token[1] + 1)
    return token


class KVOracle:
    """Expected KV of one rank's pools (see the module docstring)."""

    def __init__(self, config: HiCacheConfig, rank: int) -> None:
        self.mla = config.attention is AttentionKind.MLA
        self.layer_num = config.layer_num
        self.num_kv = 1 if self.mla else 2
        self.head_num = 1 if self.mla else config.head_num
        self.head_dim = config.kv_lora_rank + config.qk_rope_head_dim if self.mla else config.head_dim
        self.head_base = 0 if self.mla else rank * config.head_num
        kv = torch.arange(self.num_kv, dtype=torch.int64).view(-1, 1, 1, 1, 1)
        layer = torch.arange(self.layer_num, dtype=torch.int64).view(1, -1, 1, 1, 1)
        head = torch.arange(self.head_num, dtype=torch.int64).view(1, 1, 1, -1, 1) + self.head_base
        dim = torch.arange(self.head_dim, dtype=torch.int64).view(1, 1, 1, 1, -1)
        # A distinct odd multiplier per coordinate; the sum is the element's salt.
        self._salt = kv * 0x2545F491 + layer * 0x6C8E9CF5 + head * 0x1B873593 + dim * 0x5BD1E995

    # --- seeds -------------------------------------------------------------------------------------------

    def seeds(self, namespace: str | None, elements: Sequence[Token], tail: Sequence[int] = ()) -> list[int]:
        """Per-position seeds of ``elements`` (key elements from the root), then of ``tail`` tokens that
        have no key element (the unkeyed last token of an EAGLE request)."""
        digest = hashlib.sha256(b"refcache-kv\x00" + (namespace or "").encode()).digest()
        h = int.from_bytes(digest[:8], "little")
        out: list[int] = []
        for e in elements:
            h = _mix(h ^ _element(e))
            out.append(h & _MASK63)
        for t in tail:
            h = _mix(h ^ (_TAIL + t))
            out.append(h & _MASK63)
        return out

    def expected(self, seeds: Sequence[int]) -> torch.Tensor:
        """``(num_kv, layer_num, len(seeds), head_num, head_dim)`` int64 values in ``[-7, 7]``."""
        s = torch.tensor(list(seeds), dtype=torch.int64).view(1, 1, -1, 1, 1)
        x = s ^ (self._salt * 0x9E3779B1)
        x = x * 0x27D4EB2F165667C5  # wraps modulo 2**64
        x = x ^ ((x >> 29) & ((1 << 35) - 1))
        return torch.remainder(x, 15) - 7

    # --- the fake forward pass -----------------------------------------------------------------------------

    def write_device(self, pool: KVCache, slots: torch.Tensor, seeds: Sequence[int]) -> None:
        """Store the KV of freshly computed tokens in device ``slots`` (every layer)."""
        if not len(seeds):
            return
        values = self.expected(seeds).to(device=pool.device, dtype=pool.dtype)
        slots = slots.to(pool.device)
        for layer in range(self.layer_num):
            if self.mla:
                pool.set_kv_buffer(layer, slots, values[0, layer])
            else:
                pool.set_kv_buffer(layer, slots, values[0, layer], values[1, layer])

    # --- checks ----------------------------------------------------------------------------------------------

    def check_device_layer(
        self, pool: KVCache, layer: int, slots: torch.Tensor, seeds: Sequence[int], what: Sequence[str]
    ) -> None:
        """Compare one layer of device ``slots`` with the oracle, through the pool's per-layer accessors
        (which wait for that layer's load). ``what[i]`` names position ``i``'s node for the message."""
        if not len(seeds):
            return
        want = self.expected(seeds)[:, layer]
        index = slots.to(pool.device)
        if self.mla:
            got = pool.get_key_buffer(layer)[index].unsqueeze(0).cpu()
        else:
            k, v = pool.get_kv_buffer(layer)
            got = torch.stack((k[index], v[index])).cpu()
        self._compare(got, want, layer, slots, what, "device")

    def check_device(
        self, pool: KVCache, slots: torch.Tensor, seeds: Sequence[int], what: Sequence[str]
    ) -> None:
        for layer in range(self.layer_num):
            self.check_device_layer(pool, layer, slots, seeds, what)

    def check_host(
        self, pool: HostKVCache, slots: torch.Tensor, seeds: Sequence[int], what: Sequence[str]
    ) -> None:
        """Compare every layer of host ``slots`` (any layout) with the oracle."""
        if not len(seeds):
            return
        view = pool.kv_view()
        layers = range(self.layer_num)
        got = torch.cat([view.run(int(s), 1, layers) for s in slots.tolist()], dim=2)
        want = self.expected(seeds)
        for layer in layers:
            self._compare(got[:, layer], want[:, layer], layer, slots, what, "host")

    def _compare(
        self,
        got: torch.Tensor,
        want: torch.Tensor,
        layer: int,
        slots: torch.Tensor,
        what: Sequence[str],
        tier: str,
    ) -> None:
        """``got``/``want``: ``(num_kv, n, head_num, head_dim)``."""
        diff = got.to(torch.float32) != want.to(torch.float32)
        if not bool(diff.any()):
            return
        kv, pos = (int(i) for i in diff.nonzero()[0][:2])
        name = ("K", "V")[kv] if not self.mla else "latent"
        raise CorruptionError(
            f"{tier} KV of {what[pos]} differs from the oracle: layer {layer}, {name}, slot "
            f"{int(slots[pos])} (position {pos} of the read)"
        )
