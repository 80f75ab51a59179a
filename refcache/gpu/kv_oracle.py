"""The KV content oracle: what the fake forward pass writes, and the checks every read path makes.

The KV of the token at position ``p`` of a key is a pure function of (namespace, the key elements
``0..p`` — the token's whole prefix —, layer, K or V, global head, dim): the prefix is folded into a 63-bit
rolling seed per position (``seeds``), and each element is a small integer in ``[-7, 7]``, exactly
representable in every supported dtype (fp8 included). MHA ranks hold different heads (the global head
index is ``rank * head_num + h``), MLA ranks hold the same latent, so an L3 object written by one MLA rank
is the right content for every rank.

A wrong slot, a stale page, a torn copy or a wrong layout transform changes the bytes a reader sees, and
the check raises ``CorruptionError`` naming what was read (node path, layer, K/V and slot).

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

import torch

from refcache.config import AttentionKind, HiCacheConfig
from refcache.errors import CorruptionError
from refcache.gpu.device_pool import KVCache
from refcache.gpu.host_pool import HostKVCache
from refcache.hashing import Token

__all__ = ["SAMPLE_STRIDE", "KVOracle", "OracleMode", "Picked"]

OracleMode = Literal["full", "sampled", "off"]
SAMPLE_STRIDE: Final = 8  # "sampled": every 8th position of a read (and its last)

_MASK64: Final = (1 << 64) - 1
_MASK63: Final = (1 << 63) - 1
_TAIL: Final = 1 << 40  # marks a position beyond the key (the last token of an EAGLE request)

Seeds = Sequence[int] | torch.Tensor  # per-position seeds: a list, or an int64 tensor (what trees cache)


def _mix(x: int) -> int:
    """splitmix64's finaliser, on Python ints."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


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
        kv = torch.arange(self.num_kv, dtype=torch.int64).view(-1, 1, 1, 1, 1)
        layer = torch.arange(self.layer_num, dtype=torch.int64).view(1, -1, 1, 1, 1)
        head = torch.arange(self.head_num, dtype=torch.int64).view(1, 1, 1, -1, 1) + self.head_base
        dim = torch.arange(self.head_dim, dtype=torch.int64).view(1, 1, 1, 1, -1)
        # A distinct odd multiplier per coordinate; the sum is the element's salt (stored premixed).
        salt = kv * 0x2545F491 + layer * 0x6C8E9CF5 + head * 0x1B873593 + dim * 0x5BD1E995
        self._salt_mixed = salt * 0x9E3779B1
        # check_device_layer's last seeds object and the expected values derived from it: a load's
        # per-layer reads share one. One tuple, replaced whole (the forward reads may run on another thread).
        self._memo: tuple[Seeds, torch.Tensor] | None = None

    # --- seeds -------------------------------------------------------------------------------------------

    def seeds(self, namespace: str | None, elements: Sequence[Token], tail: Sequence[int] = ()) -> list[int]:
        """Per-position seeds of ``elements`` (key elements from the root), then of ``tail`` tokens that
        have no key element (the unkeyed last token of an EAGLE request). Mode "off": zeros (unused)."""
        if not self.enabled:
            return [0] * (len(elements) + len(tail))
        return self.seeds_of(self.advance(self.root_state(namespace), elements, tail))

    def root_state(self, namespace: str | None) -> int:
        """The chain state before a namespace's first key element."""
        state = self._roots.get(namespace)
        if state is None:
            digest = hashlib.sha256(b"refcache-kv\x00" + (namespace or "").encode()).digest()
            state = self._roots[namespace] = int.from_bytes(digest[:8], "little")
        return state

    @staticmethod
    def advance(state: int, elements: Sequence[Token], tail: Sequence[int] = ()) -> list[int]:
        """The 64-bit chain states after each of ``elements`` then each ``tail`` token, from ``state``: a
        tree caches them per node (a seed is a state's low 63 bits), so a path is derived once."""
        out: list[int] = []
        append = out.append
        h = state
        # _mix(h ^ element), inlined (a bigram key element (a, b) is (a << 33) ^ (b + 1)): this loop is the
        # oracle's one per-token Python cost.
        for e in elements:
            v = (e[0] << 33) ^ (e[1] + 1) if isinstance(e, tuple) else e
            x = ((h ^ v) + 0x9E3779B97F4A7C15) & _MASK64
            x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
            x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
            h = x ^ (x >> 31)
            append(h)
        for t in tail:
            h = _mix(h ^ (_TAIL + t))
            append(h)
        return out

    @staticmethod
    def seeds_of(states: Sequence[int]) -> list[int]:
        return [h & _MASK63 for h in states]

    def expected(self, seeds: Seeds) -> torch.Tensor:
        """``(num_kv, layer_num, len(seeds), head_num, head_dim)`` int64 values in ``[-7, 7]``."""
        x = _seed_tensor(seeds).view(1, 1, -1, 1, 1) ^ self._salt_mixed  # a fresh tensor: in place below
        x.mul_(0x27D4EB2F165667C5)  # wraps modulo 2**64
        shifted = x >> 29
        shifted &= (1 << 35) - 1
        x ^= shifted
        return torch.remainder(x, 15).sub_(7)

    # --- the fake forward pass -----------------------------------------------------------------------------

    def write_device(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds) -> None:
        """Store the KV of freshly computed tokens in device ``slots`` (every layer)."""
        if not len(seeds) or not self.enabled:
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
        self, pool: KVCache, layer: int, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]
    ) -> None:
        """Compare one layer of device ``slots`` with the oracle, through the pool's per-layer accessors
        (which wait for that layer's load). ``what[i]`` names position ``i``'s node for the message.
        Consecutive calls with the same ``seeds`` object (a load's layers; seeds are never changed in
        place) derive the expected values once."""
        if not len(seeds) or not self.enabled:
            return
        picked, sampled, names = self._sample(slots, seeds, what)
        memo = self._memo
        if memo is not None and memo[0] is seeds:
            want = memo[1]
        else:
            want = self.expected(sampled).to(torch.float32)
            self._memo = (seeds, want)
        self._check_layer(pool, layer, picked, names, want[:, layer])

    def check_device(self, pool: KVCache, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]) -> None:
        """Compare every layer of device ``slots`` with the oracle (expected values derived once)."""
        if not len(seeds) or not self.enabled:
            return
        slots, seeds, what = self._sample(slots, seeds, what)
        want = self.expected(seeds).to(torch.float32)
        for layer in range(self.layer_num):
            self._check_layer(pool, layer, slots, what, want[:, layer])

    def _check_layer(
        self, pool: KVCache, layer: int, slots: torch.Tensor, what: Sequence[str], want: torch.Tensor
    ) -> None:
        index = slots.to(pool.device)
        if self.mla:
            got = pool.get_key_buffer(layer)[index].unsqueeze(0).cpu()
        else:
            k, v = pool.get_kv_buffer(layer)
            got = torch.stack((k[index], v[index])).cpu()
        self._compare(got, want, layer, slots, what, "device")

    def check_host(self, pool: HostKVCache, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]) -> None:
        """Compare every layer of host ``slots`` (any layout) with the oracle."""
        if not len(seeds) or not self.enabled:
            return
        slots, seeds, what = self._sample(slots, seeds, what)
        view = pool.kv_view()
        layers = range(self.layer_num)
        got = torch.cat([view.run(int(s), 1, layers) for s in slots.tolist()], dim=2)
        want = self.expected(seeds)
        for layer in layers:
            self._compare(got[:, layer], want[:, layer], layer, slots, what, "host")

    def _sample(
        self, slots: torch.Tensor, seeds: Seeds, what: Sequence[str]
    ) -> tuple[torch.Tensor, Seeds, Sequence[str]]:
        """The positions of a read that are checked: all ("full"), or every SAMPLE_STRIDE-th and the last."""
        n = len(seeds)
        if self.mode == "full" or n <= 2:
            return slots, seeds, what
        keep = [*range(0, n - 1, SAMPLE_STRIDE), n - 1]
        picked = seeds[keep] if isinstance(seeds, torch.Tensor) else [seeds[i] for i in keep]
        return slots[keep], picked, Picked(what, keep)

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
        diff = got.to(torch.float32) != want.to(torch.float32)  # want: float32 already on the hot paths
        if not bool(diff.any()):
            return
        kv, pos = (int(i) for i in diff.nonzero()[0][:2])
        name = ("K", "V")[kv] if not self.mla else "latent"
        raise CorruptionError(
            f"{tier} KV of {what[pos]} differs from the oracle: layer {layer}, {name}, slot "
            f"{int(slots[pos])} (position {pos} of the read)"
        )


def _seed_tensor(seeds: Seeds) -> torch.Tensor:
    if isinstance(seeds, torch.Tensor):
        return seeds.to(torch.int64)
    return torch.tensor(seeds if isinstance(seeds, list) else list(seeds), dtype=torch.int64)
