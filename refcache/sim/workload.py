"""Workloads: a Mooncake trace scaled to simulated tokens, and its offline bounds.

**Scaling.** ``Workload.from_trace`` scales each 512-token block to ``block_tokens`` tokens (16 by
default, so realistic capacities fit in memory) and turns block ``b`` into the page of token ids
``b*block_tokens .. b*block_tokens + block_tokens - 1``; the partial last block of an input keeps its
share, rounded up. Output tokens (``output_length`` scaled the same way, rounded up) are fresh ids above
every block token, unique per request: no later request can hit them. A token id therefore names its
whole prefix, which the simulator's accounting relies on. Every count in a report is in these
*simulated* tokens; ``token_scale`` (512 / ``block_tokens``) converts to trace tokens.

**Optimal bounds.** ``Workload.optimal_hit_tokens(capacity)`` runs Belady's offline rule on the block
sequence (every input block of every request, in order): a cache of ``ceil(capacity / block_tokens)``
whole blocks that, on a miss, keeps the new block only if some cached block (or the new one) is next
used later, and then drops the one used furthest in the future (bypass allowed). Each hit counts a full
block of tokens, capped by the infinite-capacity bound. This is an upper bound on the tokens any cache of
``capacity`` tokens can serve from that tier, under the simulator's scheduler, because: (1) blocks enter
a tier only when a request that contains them runs (L1: insert or load back; L1+L2: also prefetch of the
request's own blocks); (2) the prefix rule of a radix cache is not enforced (a hit is counted even if an
earlier block of the request missed); (3) a cache that keeps fractions of blocks gains nothing over
whole blocks (the interval LP of paging is integral), hence the rounding up of the capacity; (4) hits
are never worth more than a full block; (5) a running request holds its whole sequence on the device,
which only constrains the real cache further. It bounds ``L1`` with the device capacity and ``L1 + L2`` with
device + host capacity; L3 is unbounded, so the total (with L3) is bounded by ``infinite``, the tokens
of every block access that some earlier request already held.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Sequence
from dataclasses import dataclass

from refcache.errors import TraceFormatError, UsageError
from refcache.sim.mooncake import TRACE_BLOCK_TOKENS, TraceRequest, read_mooncake_trace

__all__ = ["SimRequest", "Workload", "belady_hits"]


@dataclass(frozen=True)
class SimRequest:
    """One request as the simulator runs it: blocks of token ids, then unique output tokens."""

    rid: int  # position in arrival order
    line: int  # line in the trace
    arrival_us: int  # logical arrival time
    blocks: tuple[int, ...]  # trace block ids, in order
    last_block_tokens: int  # tokens of the last (possibly partial) block; the others are full
    output_start: int  # first output token id
    output_tokens: int  # number of output tokens
    block_tokens: int  # tokens per full block

    @property
    def input_length(self) -> int:
        return (len(self.blocks) - 1) * self.block_tokens + self.last_block_tokens

    def input_tokens(self) -> tuple[int, ...]:
        """The prompt as token ids: block ``b`` is ``b*block_tokens ...``; built on demand (memory)."""
        bt = self.block_tokens
        out: list[int] = []
        for b in self.blocks[:-1]:
            out.extend(range(b * bt, (b + 1) * bt))
        last = self.blocks[-1] * bt
        out.extend(range(last, last + self.last_block_tokens))
        return tuple(out)

    def tokens(self) -> tuple[int, ...]:
        """Prompt and output token ids."""
        return self.input_tokens() + tuple(range(self.output_start, self.output_start + self.output_tokens))


class Workload:
    """A trace scaled to ``block_tokens`` per block, in arrival order, with its offline bounds.

    Raises ``UsageError`` if ``block_tokens`` is not in 1..512 or the token ids would not fit in
    uint32 (the systems' token type).
    """

    def __init__(self, requests: Sequence[TraceRequest], block_tokens: int = 16) -> None:
        if not 1 <= block_tokens <= TRACE_BLOCK_TOKENS:
            raise UsageError(f"block_tokens={block_tokens} must be in 1..{TRACE_BLOCK_TOKENS}")
        if not requests:
            raise UsageError("the trace has no requests")
        self.block_tokens = block_tokens
        ordered = sorted(requests, key=lambda r: r.timestamp_ms)  # stable: ties keep file order
        next_output = (max(h for r in ordered for h in r.hash_ids) + 1) * block_tokens
        built: list[SimRequest] = []
        for rid, r in enumerate(ordered):
            last = r.input_length - TRACE_BLOCK_TOKENS * (len(r.hash_ids) - 1)
            out = self.scale(r.output_length)
            built.append(
                SimRequest(
                    rid=rid,
                    line=r.line,
                    arrival_us=round(r.timestamp_ms * 1000),
                    blocks=r.hash_ids,
                    last_block_tokens=self.scale(last),
                    output_start=next_output,
                    output_tokens=out,
                    block_tokens=block_tokens,
                )
            )
            next_output += out
        if next_output > 2**32:
            raise UsageError(
                f"the scaled trace needs token ids up to {next_output}, beyond uint32; lower block_tokens"
            )
        self.requests: tuple[SimRequest, ...] = tuple(built)
        self._bounds: dict[int, int] = {}
        self._accesses: list[int] = []  # every input block of every request, in order
        self._weights: list[int] = []  # the request's tokens of that block
        for req in self.requests:
            self._accesses.extend(req.blocks)
            self._weights.extend([block_tokens] * (len(req.blocks) - 1))
            self._weights.append(req.last_block_tokens)
        self.input_tokens = sum(self._weights)
        self.output_tokens = sum(r.output_tokens for r in self.requests)
        self.infinite_hit_tokens = _infinite_hit_tokens(self._accesses, self._weights)
        """Input tokens whose block an earlier request already held (at least that many tokens of it)."""
        self.longest_request = max(r.input_length + r.output_tokens for r in self.requests)

    @classmethod
    def from_trace(
        cls, path: str | os.PathLike[str], *, block_tokens: int = 16, limit: int | None = None
    ) -> Workload:
        """Read a Mooncake trace file (``read_mooncake_trace``) and scale it. Raises ``TraceFormatError``
        naming the file when it holds no request."""
        requests = read_mooncake_trace(path, limit=limit)
        if not requests:
            raise TraceFormatError(f"{os.fspath(path)}: no requests (the file is empty or blank)")
        return cls(requests, block_tokens)

    @property
    def token_scale(self) -> float:
        """Trace tokens per simulated token."""
        return TRACE_BLOCK_TOKENS / self.block_tokens

    def scale(self, trace_tokens: int) -> int:
        """Simulated tokens for ``trace_tokens`` trace tokens (rounded up, so a non-empty span stays so)."""
        return -(-trace_tokens * self.block_tokens // TRACE_BLOCK_TOKENS)

    def optimal_hit_tokens(self, capacity_tokens: int) -> int:
        """Belady's offline bound on hit tokens for a cache of ``capacity_tokens`` (module docstring)."""
        blocks = -(-capacity_tokens // self.block_tokens)
        if blocks not in self._bounds:
            hits = belady_hits(self._accesses, blocks)
            self._bounds[blocks] = min(hits * self.block_tokens, self.infinite_hit_tokens)
        return self._bounds[blocks]


def _infinite_hit_tokens(accesses: Sequence[int], weights: Sequence[int]) -> int:
    held: dict[int, int] = {}  # block -> most tokens of it any earlier request had
    total = 0
    for block, tokens in zip(accesses, weights, strict=True):
        before = held.get(block, 0)
        total += min(tokens, before)
        held[block] = max(before, tokens)
    return total


def belady_hits(accesses: Sequence[int], capacity: int) -> int:
    """Hits of Belady's optimal offline cache of ``capacity`` items over ``accesses`` (bypass allowed).

    On a miss with a full cache, the item (cached or the new one) whose next use is furthest away is not
    kept; items never used again are never kept. Optimal for the number of hits with unit-size items.
    """
    n = len(accesses)
    never = n  # "next use" of an item not used again
    next_use = [never] * n
    last: dict[int, int] = {}
    for i in range(n - 1, -1, -1):
        item = accesses[i]
        next_use[i] = last.get(item, never)
        last[item] = i
    cached: dict[int, int] = {}  # item -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, item); stale entries skipped on pop
    hits = 0
    for i, item in enumerate(accesses):
        nxt = next_use[i]
        if item in cached:
            hits += 1
            if nxt == never:
                del cached[item]  # its slot is worth more to anything else
            else:
                cached[item] = nxt
                heapq.heappush(heap, (-nxt, item))
            continue
        if nxt == never or capacity <= 0:
            continue
        if len(cached) < capacity:
            cached[item] = nxt
            heapq.heappush(heap, (-nxt, item))
            continue
        while cached.get(heap[0][1]) != -heap[0][0]:
            heapq.heappop(heap)
        furthest, victim = -heap[0][0], heap[0][1]
        if furthest > nxt:
            heapq.heappop(heap)
            del cached[victim]
            cached[item] = nxt
            heapq.heappush(heap, (-nxt, item))
    return hits
