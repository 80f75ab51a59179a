"""Chained SHA-256 page hashes: the L3 key of a page encodes its whole prefix (seed §4.1).

``digest_i = SHA256(digest_{i-1} as 32 raw bytes (omitted for the first page) || tokens of page i as
uint32 little-endian)``, lower-case hex. A bigram token (EAGLE, seed §5.7) hashes both of its elements.
A namespace (SGLang's ``extra_key``: LoRA id, tenant) seeds the chain so that identical tokens under
different namespaces never share keys (the fix of sglang.md §9 #16); without a namespace the keys are
byte-identical to SGLang's un-namespaced scheme.

Storage keys add a suffix per seed §5.5: ``_{model}`` for MLA (ranks hold identical latents and share
keys), ``_{model}_{tp_rank}_{tp_size}`` for MHA (each rank stores its own head shard).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

__all__ = [
    "Token",
    "get_hash_str",
    "page_hashes",
    "storage_key",
    "storage_namespace_seed",
    "to_bigram",
]

Token = int | tuple[int, int]
"""A radix-key element: a token id, or a pair of ids in EAGLE bigram mode."""

_NAMESPACE_TAG: Final = b"sglang-cache-namespace-v1"


def _u32(value: int) -> bytes:
    if not 0 <= value < 2**32:
        raise ValueError(f"token id {value} does not fit in uint32")
    return value.to_bytes(4, byteorder="little", signed=False)


def storage_namespace_seed(extra_key: str | None, cache_salt: str | None = None) -> str | None:
    """The prior hash that starts a namespaced chain, or ``None`` when there is no namespace."""
    if extra_key is None and cache_salt is None:
        return None
    hasher = hashlib.sha256(_NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            hasher.update(b"\x00")
        else:
            data = part.encode("utf-8")
            hasher.update(b"\x01" + len(data).to_bytes(8, "little") + data)
    return hasher.hexdigest()


def get_hash_str(tokens: Sequence[Token], prior_hash: str | None) -> str:
    """Hash of one page given the previous page's hash (``None`` for the first page)."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(prior_hash))
    for token in tokens:
        if isinstance(token, tuple):
            for element in token:
                hasher.update(_u32(element))
        else:
            hasher.update(_u32(token))
    return hasher.hexdigest()


def page_hashes(tokens: Sequence[Token], page_size: int, prior_hash: str | None) -> list[str]:
    """Hashes of consecutive pages of ``tokens`` continuing the chain from ``prior_hash``.

    A final partial page is hashed with the tokens it has (SGLang hashes ceil(len / page_size) pages);
    the cache itself only ever hashes page-aligned keys.
    """
    out: list[str] = []
    last = prior_hash
    for start in range(0, len(tokens), page_size):
        last = get_hash_str(tokens[start : start + page_size], last)
        out.append(last)
    return out


def to_bigram(tokens: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """EAGLE bigram view: ``(t0, t1), (t1, t2), ...`` — one element fewer than ``tokens``."""
    return tuple((tokens[i], tokens[i + 1]) for i in range(len(tokens) - 1))


def storage_key(page_hash: str, *, model_name: str, mla: bool, tp_rank: int, tp_size: int) -> str:
    """The L3 object key of one page on one rank (seed §5.5)."""
    suffix = "_" + model_name.replace("/", "-")
    if not mla:
        suffix += f"_{tp_rank}_{tp_size}"
    return page_hash + suffix
