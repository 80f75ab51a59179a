"""The model's pure arithmetic, with PEP 316 contracts that ``nox -s contracts`` checks with CrossHair.

Everything here is a total function of small integers and tuples: page alignment, the paged key match,
splitting a node's per-token and per-page lists, hash chaining over an abstract step function, the
eviction order, and the MIN/MAX reductions between ranks. ``page_align``, ``match_len``, ``split_at``,
``reduce_min`` and ``can_terminate_all`` are what ``_rank.py`` and ``_cache.py`` call, so their contracts
speak about the code that runs. ``split_pages``, ``chain`` and ``eviction_before`` state the properties of
code written inline elsewhere — the hash-list split in ``RankCache._split_node``,
``refcache.hashing.page_hashes`` (over SHA-256, out of CrossHair's reach) and ``_eviction.eviction_key``'s
tuple order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from refcache.hashing import Token

__all__ = [
    "can_terminate_all",
    "chain",
    "eviction_before",
    "match_len",
    "page_align",
    "reduce_min",
    "split_at",
    "split_pages",
]


def page_align(n: int, page_size: int) -> int:
    """``n`` rounded down to a multiple of ``page_size``.

    pre: n >= 0 and page_size >= 1
    post: __return__ % page_size == 0
    post: 0 <= n - __return__ < page_size
    """
    return n - n % page_size


def match_len(a: Sequence[Token], b: Sequence[Token], page_size: int) -> int:
    """Length of the common prefix of ``a`` and ``b`` in whole pages (``_key_match_paged``).

    pre: page_size >= 1
    post: __return__ % page_size == 0
    post: __return__ <= min(len(a), len(b))
    post: tuple(a[:__return__]) == tuple(b[:__return__])
    """
    x, y = tuple(a), tuple(b)  # no copy for tuples (the model's keys); slices then compare in C
    limit = min(len(x), len(y))
    if x[:limit] == y[:limit]:
        return page_align(limit, page_size)
    lo, hi = 0, limit  # x[:lo] == y[:lo] and x[:hi] != y[:hi]: the first difference is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if x[lo:mid] == y[lo:mid]:
            lo = mid
        else:
            hi = mid
    return page_align(lo, page_size)


def split_at(items: Sequence[int], split_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split a node's per-token list (key, value, host_value) at ``split_len``.

    pre: 0 < split_len < len(items)
    post: __return__[0] + __return__[1] == tuple(items)
    post: len(__return__[0]) == split_len
    """
    return tuple(items[:split_len]), tuple(items[split_len:])


def split_pages(
    hashes: Sequence[int], split_len: int, page_size: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split a node's per-page hash list where its key splits at ``split_len`` tokens.

    pre: page_size >= 1 and split_len % page_size == 0
    pre: 0 < split_len // page_size < len(hashes)
    post: __return__[0] + __return__[1] == tuple(hashes)
    post: len(__return__[0]) * page_size == split_len
    """
    pages = split_len // page_size
    return tuple(hashes[:pages]), tuple(hashes[pages:])


def chain(
    tokens: Sequence[int], page_size: int, prior: int, step: Callable[[int, tuple[int, ...]], int]
) -> list[int]:
    """Chained page hashes over an abstract ``step(prior, page) -> hash`` (SHA-256 in ``refcache.hashing``).

    The property the L3 key scheme needs: the hashes of a page-aligned prefix are a prefix of the hashes
    of the whole, and the chain continues from the prefix's last hash.

    pre: page_size >= 1
    post: len(__return__) == -(-len(tokens) // page_size)
    """
    out: list[int] = []
    last = prior
    for start in range(0, len(tokens), page_size):
        last = step(last, tuple(tokens[start : start + page_size]))
        out.append(last)
    return out


def chain_is_prefix_closed(tokens: tuple[int, ...], cut_pages: int, page_size: int) -> bool:
    """Contract check for ``chain`` with a concrete step: cutting at a page boundary and continuing
    from the last hash gives the same chain.

    pre: page_size >= 1 and 0 <= cut_pages * page_size <= len(tokens)
    post: __return__
    """

    def step(prior: int, page: tuple[int, ...]) -> int:
        acc = prior * 31 + 7
        for t in page:
            acc = acc * 131 + t
        return acc

    cut = cut_pages * page_size
    head = chain(tokens[:cut], page_size, 1, step)
    tail = chain(tokens[cut:], page_size, head[-1] if head else 1, step)
    return head + tail == chain(tokens, page_size, 1, step)


def eviction_before(a: tuple[int, ...], a_id: int, b: tuple[int, ...], b_id: int) -> bool:
    """Whether the node with priority ``a`` and id ``a_id`` is evicted before ``b``/``b_id``: strategy
    priority first, the older node (smaller id) on ties. A strict total order on distinct ids.

    pre: a_id != b_id and len(a) == len(b)
    post: __return__ != ((*b, b_id) < (*a, a_id))
    post: (a < b) <= __return__
    """
    return (*a, a_id) < (*b, b_id)


def reduce_min(values: Sequence[int]) -> int:
    """The MIN all-reduce: every rank applies the smallest local count.

    pre: len(values) >= 1
    post: __return__ in values
    post: all(__return__ <= v for v in values)
    """
    return min(values)


def can_terminate_all(can_terminate: Sequence[bool], terminated: Sequence[bool]) -> bool:
    """The MAX all-reduce of ``[1 - can_terminate, is_terminated]`` (seed §3.6): stop when every rank can
    stop, or when any rank already stopped.

    pre: len(can_terminate) == len(terminated) >= 1
    post: __return__ == (all(can_terminate) or any(terminated))
    """
    return max(1 - int(c) for c in can_terminate) == 0 or max(int(t) for t in terminated) == 1
