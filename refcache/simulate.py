"""Workload simulation: replay a real request trace through an engine and account for every tier.

Theory of operation
-------------------
**Trace.** A Mooncake trace (``read_mooncake_trace``) is JSON Lines: ``timestamp`` (arrival, ms),
``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id per 512-token block of the
input. Ids encode the whole prefix, so equal ids mean equal blocks at equal positions and every block id
occurs at exactly one position.

**Workload.** ``Workload.from_trace`` scales each 512-token block to ``block_tokens`` tokens (16 by
default, so realistic capacities fit in memory) and turns block ``b`` into the page of token ids
``b*block_tokens .. b*block_tokens + block_tokens - 1``; the partial last block of an input keeps its
share, rounded up. Output tokens (``output_length`` scaled the same way, rounded up) are fresh ids above
every block token, unique per request: no later request can hit them. A token id therefore names its
whole prefix, which the accounting below relies on. Every count in a report is in these *simulated*
tokens; ``token_scale`` (512 / ``block_tokens``) converts to trace tokens.

**Scheduler** (``simulate``). Requests run one at a time, in timestamp order (ties in file order); the
logical clock follows the arrival times (``AdvanceClock``) and only L3 reads take logical time. For each
request ``rid`` (its index in that order):

1. the clock moves to its arrival;
2. L3 enabled: ``PrefetchFromStorage(rid, input)``; if admitted, the hit query runs on every rank
   (``CompleteIO(PREFETCH_QUERY)``; the MIN all-reduce resolves once every rank has run it) and
   ``CheckHicacheEvents`` retires a revoke. The request then waits ``queue_delay_us`` before the
   scheduler first looks at it, while the I/O helper reads one storage batch per ``l3_batch_us`` on
   every rank; then ``CheckPrefetchProgress`` runs, and as long as the prefetch policy says not done
   (wait_complete, timeout) one more batch is read per ``l3_batch_us``. Whatever batch jobs remain after
   ``done`` (a terminated, half-read prefetch) are completed at once: they read nothing;
3. ``StartRequest(rid, input + output)``: match, lock, load back the host hit (evicting L1 as needed),
   allocate and compute the rest (evicting as needed). A load back is completed on every rank before the
   request finishes (the forward pass waits for its layers). If the engine refuses admission, background
   I/O is drained (step 5) and the request tried once more, as a scheduler would at its next step; a
   second refusal counts the request as rejected;
4. ``FinishRequest(rid)`` inserts input and output;
5. every ``drain_every`` requests, background I/O catches up: the write, load, backup and prefetch I/O
   queues of every rank run dry and ``CheckHicacheEvents`` retires their acknowledgements, repeated
   until nothing moves. The run ends with such a drain.

**Counters.** What an observation reports is taken from it; what it does not is computed from snapshot
deltas (rank 0; tensor-parallel ranks hold equal trees). The simulator does not re-implement the cache:
where a derivation relies on a property of the engine, the table says which.

===========================  ===================================================================
counter                      source
===========================  ===================================================================
L1 (device hit)              ``StartResult.device_hit``
L2 (loaded back)             ``StartResult.loaded`` minus the L3 share below
L3                           ``ProgressResult.inserted`` of the request's own prefetch, when its
                             load back happened (``loaded > 0``: a load back covers the whole
                             host-only chain, and the prefetched pages are the end of that chain)
computed                     input tokens minus L1, L2 and L3 (output tokens are always computed)
recomputed                   computed tokens minus compulsory misses (first use of a block)
L2→L1                        ``StartResult.loaded``
L3→L2                        ``ProgressResult.inserted`` (no storage faults are injected and the tree
                             does not change between a prefetch's match and its insert, so every
                             page read is inserted)
L2→L3                        growth of rank 0's L3 key set × ``page_size`` (first/last snapshot)
L1 evictions                 device tokens in the tree: first + inserted (``FinishRequest``: aligned
                             length − ``FinishResult.prefix_len``) + loaded − last
L1→L2                        snapshot deltas every ``audit_every`` requests (and after a refused
                             admission): pages of tree nodes that gained a host copy, less the pages
                             prefetches inserted. A page is named by its last token id, which names
                             its whole prefix. Exact with ``audit_every=1`` up to a page copied and
                             evicted again within one request; sparser audits miss the pages copied
                             and evicted within an interval (a lower bound); 0 does not report it
L2 evictions                 host tokens in the tree: before + L1→L2 + L3→L2 − after, per audit
                             interval (so it misses exactly what L1→L2 misses)
prefetches                   ``PrefetchResult.admitted`` / ``reason``; ``EventsResult.revoked``;
                             timed out = policy ``timeout`` and batch jobs left after ``done``
===========================  ===================================================================

Bytes are tokens × ``HiCacheConfig.bytes_per_token``, per rank.

**Optimal bounds.** ``Workload.optimal_hit_tokens(capacity)`` runs Belady's offline rule on the block
sequence (every input block of every request, in order): a cache of ``ceil(capacity / block_tokens)``
whole blocks that, on a miss, keeps the new block only if some cached block (or the new one) is next
used later, and then drops the one used furthest in the future (bypass allowed). Each hit counts a full
block of tokens, capped by the infinite-capacity bound. This is an upper bound on the tokens any cache of
``capacity`` tokens can serve from that tier, under the scheduler above, because: (1) blocks enter a
tier only when a request that contains them runs (L1: insert or load back; L1+L2: also prefetch of the
request's own blocks); (2) the prefix rule of a radix cache is not enforced (a hit is counted even if an
earlier block of the request missed); (3) a cache that keeps fractions of blocks gains nothing over
whole blocks (the interval LP of paging is integral), hence the rounding up of the capacity; (4) hits
are never worth more than a full block; (5) a running request holds its whole sequence on the device,
which only constrains the real cache further. It bounds ``L1`` with the device capacity and ``L1 + L2`` with
device + host capacity; L3 is unbounded, so the total (with L3) is bounded by ``infinite``, the tokens
of every block access that some earlier request already held.

**Engines.** ``Engine`` is ``apply(op)`` and ``snapshot()``. ``make_engine("model", config)`` is the
reference model; ``make_engine("impl", config)`` imports ``refcache.gpu.driver`` lazily and builds its
``HiCacheImpl`` (closed after the run).
"""

from __future__ import annotations

import dataclasses
import heapq
import importlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Final, Protocol

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from refcache.config import (
    AttentionKind,
    EvictionPolicy,
    HiCacheConfig,
    IOBackend,
    MemLayout,
    PrefetchPolicy,
    WritePolicy,
)
from refcache.errors import RefcacheError, TraceFormatError, UsageError
from refcache.hashing import Token
from refcache.invariants import check_all
from refcache.ops import (
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    EventsResult,
    FinishRequest,
    FinishResult,
    IOQueue,
    IOResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    StartRequest,
    StartResult,
)
from refcache.snapshot import Snapshot

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = [
    "TRACE_BLOCK_TOKENS",
    "Engine",
    "SimOptions",
    "SimReport",
    "SimRequest",
    "TraceRequest",
    "Workload",
    "belady_hits",
    "make_engine",
    "parse_mooncake",
    "plot_sweep",
    "read_mooncake_trace",
    "render_report",
    "simulate",
    "simulate_command",
    "sweep",
]

TRACE_BLOCK_TOKENS: Final = 512
"""Tokens per ``hash_ids`` block in Mooncake traces."""

_DRAIN: Final = 1 << 20  # "all of them" for CompleteIO: the engine stops at the first missing job
_NO_EVENTS: Final = EventsResult(writes=0, loads=0, revoked=0, backups=0, host_releases=0)


# --- trace ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One line of a Mooncake trace, validated."""

    line: int  # 1-based line number in the source
    timestamp_ms: float  # arrival time
    input_length: int  # prompt tokens
    output_length: int  # generated tokens
    hash_ids: tuple[int, ...]  # one id per TRACE_BLOCK_TOKENS-token block of the prompt


def _int_field(data: dict[str, object], name: str, where: str, *, minimum: int) -> int:
    value = data.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise TraceFormatError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def parse_mooncake(
    lines: Iterable[str], *, source: str = "trace", limit: int | None = None
) -> list[TraceRequest]:
    """Parse Mooncake trace lines (blank lines are skipped); stop after ``limit`` requests.

    Raises ``TraceFormatError`` naming ``source``, the 1-based line number and the problem: not a JSON
    object, a missing or mistyped field, or ``hash_ids`` whose length is not
    ``ceil(input_length / 512)``. Unknown extra fields are ignored (other Mooncake traces carry some).
    """
    out: list[TraceRequest] = []
    for number, raw in enumerate(lines, start=1):
        if limit is not None and len(out) >= limit:
            break
        if not raw.strip():
            continue
        where = f"{source}:{number}"
        try:
            data: object = json.loads(raw)
        except ValueError as error:
            raise TraceFormatError(f"{where}: not valid JSON ({error})") from None
        if not isinstance(data, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(data).__name__}")
        fields = {str(k): v for k, v in data.items()}
        timestamp = fields.get("timestamp")
        if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or not timestamp >= 0:
            raise TraceFormatError(f"{where}: timestamp must be a number >= 0 (ms), got {timestamp!r}")
        input_length = _int_field(fields, "input_length", where, minimum=1)
        output_length = _int_field(fields, "output_length", where, minimum=0)
        hash_ids = fields.get("hash_ids")
        if not isinstance(hash_ids, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in hash_ids
        ):
            raise TraceFormatError(f"{where}: hash_ids must be a list of integers >= 0, got {hash_ids!r}")
        blocks = -(-input_length // TRACE_BLOCK_TOKENS)
        if len(hash_ids) != blocks:
            raise TraceFormatError(
                f"{where}: {len(hash_ids)} hash_ids for input_length {input_length}; expected {blocks} "
                f"(one per {TRACE_BLOCK_TOKENS}-token block)"
            )
        out.append(TraceRequest(number, float(timestamp), input_length, output_length, tuple(hash_ids)))
    return out


def read_mooncake_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace file (see ``parse_mooncake``). Raises ``TraceFormatError`` naming the file
    and line, and ``OSError`` if the file cannot be read."""
    with open(path, encoding="utf-8") as file:
        try:
            return parse_mooncake(file, source=os.fspath(path), limit=limit)
        except UnicodeDecodeError as error:
            raise TraceFormatError(f"{os.fspath(path)}: not UTF-8 text ({error})") from None


# --- workload ---------------------------------------------------------------------------------------------


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
    uint32 (the engines' token type).
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
        """Read a Mooncake trace file (``read_mooncake_trace``) and scale it."""
        return cls(read_mooncake_trace(path, limit=limit), block_tokens)

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


# --- engines ----------------------------------------------------------------------------------------------


class Engine(Protocol):
    """What ``simulate`` drives: the model, the implementation, or another engine's adapter."""

    def apply(self, op: Op) -> Observation: ...
    def snapshot(self) -> Snapshot: ...


ENGINES: Final = ("model", "impl")


def make_engine(kind: str, config: HiCacheConfig) -> Engine:
    """``"model"``: ``refcache.model.HiCacheModel``; ``"impl"``: ``refcache.gpu.driver.HiCacheImpl``
    (imported only here: it needs torch).

    Raises ``UsageError`` for another ``kind`` or when the implementation cannot be imported (the message
    says what is missing).
    """
    if kind == "model":
        from refcache.model import HiCacheModel

        return HiCacheModel(config)
    if kind == "impl":
        try:
            driver = importlib.import_module("refcache.gpu.driver")
        except ImportError as error:
            raise UsageError(
                f"--engine impl needs refcache.gpu.driver and its dependencies (torch, triton), which "
                f"cannot be imported here: {error}"
            ) from error
        impl_class = getattr(driver, "HiCacheImpl", None)
        if impl_class is None:
            raise UsageError("--engine impl: refcache.gpu.driver has no HiCacheImpl class (yet)")
        engine: Engine = impl_class(config)
        return engine
    raise UsageError(f"engine {kind!r} is not one of {', '.join(ENGINES)}")


def _close(engine: Engine) -> None:
    close = getattr(engine, "close", None)
    if callable(close):
        close()


# --- the report -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimOptions:
    """How the scheduler drives the engine (module docstring). Times are logical microseconds."""

    engine: str = "model"
    queue_delay_us: int = 10_000  # arrival -> first admission check; prefetch I/O runs meanwhile
    l3_batch_us: int = 1_000  # one storage batch (storage_batch_size pages) read on every rank
    drain_every: int = 1  # requests between background I/O drains
    audit_every: int = 1  # requests between audit snapshots (0: first and last only)
    check_invariants: bool = False  # check every invariant after every request (slow; tests)

    def __post_init__(self) -> None:
        for name in ("queue_delay_us", "audit_every"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("l3_batch_us", "drain_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.engine not in ENGINES:
            raise UsageError(f"engine {self.engine!r} is not one of {', '.join(ENGINES)}")


@dataclass
class Served:
    """Input tokens by where they came from (simulated tokens)."""

    input: int = 0  # every request's input
    output: int = 0  # every request's output (always computed)
    l1: int = 0  # device hit
    l2: int = 0  # loaded back from host memory (not prefetched for this request)
    l3: int = 0  # prefetched from L3 for this request, then loaded back
    computed: int = 0  # input tokens computed (misses)
    recomputed: int = 0  # of those, tokens some earlier request already had (not compulsory)
    rejected: int = 0  # input tokens of requests the engine did not admit


@dataclass
class Moved:
    """Tokens copied between tiers, per rank."""

    l1_to_l2: int = 0
    l2_to_l1: int = 0
    l2_to_l3: int = 0
    l3_to_l2: int = 0


@dataclass
class Evicted:
    """Tokens evicted per tier."""

    l1: int = 0
    l2: int = 0


@dataclass
class Prefetches:
    """L3 prefetch outcomes."""

    started: int = 0  # admitted by PrefetchFromStorage
    refused: dict[str, int] = field(default_factory=dict)  # PrefetchResult.reason -> count
    revoked: int = 0  # the hit query found too little (EventsResult.revoked)
    timed_out: int = 0  # timeout policy stopped it before every page was read
    cut_short: int = 0  # best_effort stopped it before every page was read
    inserted: int = 0  # tokens inserted into L2 (ProgressResult.inserted)


@dataclass
class Bounds:
    """Offline bounds on hit tokens (module docstring)."""

    belady_l1: int = 0
    belady_l1_l2: int = 0
    infinite: int = 0


@dataclass
class SimReport:
    """The outcome of one ``simulate`` run; ``to_json`` is the ``--json`` output."""

    config: HiCacheConfig
    options: SimOptions
    trace: str
    requests: int
    block_tokens: int
    served: Served = field(default_factory=Served)
    moved: Moved = field(default_factory=Moved)
    evicted: Evicted = field(default_factory=Evicted)
    prefetch: Prefetches = field(default_factory=Prefetches)
    bounds: Bounds = field(default_factory=Bounds)
    acks: dict[str, int] = field(default_factory=dict)  # EventsResult fields summed
    admission_retries: int = 0  # StartRequest refused once, retried after background events
    snapshots: int = 0  # engine snapshots the accounting took (first, audits, last)
    seconds: float = 0.0  # wall time of the replay

    @property
    def token_scale(self) -> float:
        return TRACE_BLOCK_TOKENS / self.block_tokens

    @property
    def bytes_per_token(self) -> int:
        return self.config.bytes_per_token

    def rate(self, tokens: int) -> float:
        """``tokens`` as a fraction of all input tokens."""
        return tokens / self.served.input if self.served.input else 0.0

    @property
    def hit_rates(self) -> dict[str, float]:
        s = self.served
        return {
            "l1": self.rate(s.l1),
            "l2": self.rate(s.l2),
            "l3": self.rate(s.l3),
            "l1_l2": self.rate(s.l1 + s.l2),
            "total": self.rate(s.l1 + s.l2 + s.l3),
            "belady_l1": self.rate(self.bounds.belady_l1),
            "belady_l1_l2": self.rate(self.bounds.belady_l1_l2),
            "infinite": self.rate(self.bounds.infinite),
        }

    @property
    def audit(self) -> str:
        """What ``moved.l1_to_l2`` and ``evicted.l2`` are: ``"exact"`` (one audit per request; up to a
        copy made and evicted within one request), ``"lower_bound"`` (sparser audits) or ``"off"`` (only
        the first and last snapshot: not reported)."""
        every = self.options.audit_every
        return "exact" if every == 1 else "off" if every == 0 else "lower_bound"

    def to_json(self) -> dict[str, object]:
        """Plain JSON data: every counter, rates, bytes (per rank) and the configuration. With the audit
        off, L1→L2 and the L2 evictions are ``null``."""
        bpt = self.bytes_per_token
        moved: dict[str, int | None] = dict(dataclasses.asdict(self.moved))
        evicted: dict[str, int | None] = dict(dataclasses.asdict(self.evicted))
        if self.audit == "off":
            moved["l1_to_l2"] = evicted["l2"] = None
        return {
            "trace": self.trace,
            "requests": self.requests,
            "block_tokens": self.block_tokens,
            "token_scale": self.token_scale,
            "config": self.config.to_json(),
            "options": dataclasses.asdict(self.options),
            "served": dataclasses.asdict(self.served),
            "hit_rates": self.hit_rates,
            "bounds": dataclasses.asdict(self.bounds),
            "moved_tokens": moved,
            "moved_bytes": {k: None if v is None else v * bpt for k, v in moved.items()},
            "bytes_per_token": bpt,
            "evicted_tokens": evicted,
            "prefetch": dataclasses.asdict(self.prefetch),
            "acks": dict(self.acks),
            "admission_retries": self.admission_retries,
            "audit": self.audit,
            "snapshots": self.snapshots,
            "seconds": round(self.seconds, 3),
            "requests_per_second": round(self.requests / self.seconds, 1) if self.seconds else None,
        }


# --- snapshot accounting ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TierView:
    """What the accounting reads from one snapshot (rank 0)."""

    device_tokens: int  # tokens of tree nodes with device slots
    host_pages: frozenset[Token]  # last token id of every page of a tree node with host slots
    host_tokens: int  # tokens of tree nodes with host slots
    l3_keys: int  # rank 0's L3 objects


def _view(snapshot: Snapshot) -> _TierView:
    rank = snapshot.ranks[0]
    ps = snapshot.page_size
    device = host_tokens = 0
    host: set[Token] = set()
    for node in rank.nodes:
        if node.value is not None:
            device += len(node.value)
        if node.host_value is not None:
            host_tokens += len(node.host_value)
            # Nodes hold whole pages, and in a simulated workload a token id names its whole prefix, so
            # a page's last token names the page.
            path = node.id.path
            host.update(path[len(path) - node.key_len + ps - 1 :: ps])
    return _TierView(device, frozenset(host), host_tokens, len(rank.l3_keys))


# --- the simulator ----------------------------------------------------------------------------------------


class _Simulator:
    """One replay: drives ``engine`` through the workload and fills ``report``."""

    def __init__(
        self, engine: Engine, config: HiCacheConfig, workload: Workload, options: SimOptions
    ) -> None:
        self.engine = engine
        self.cfg = config
        self.workload = workload
        self.options = options
        self.ranks = range(config.tp_size)
        self.clock_us = 0
        self.acks: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.device_inserted = 0  # device tokens FinishRequest added to the tree
        self.prefetched_pages: set[Token] = set()  # pages prefetches inserted since the last audit
        self.prefetch_since_audit = 0  # tokens prefetches inserted since the last audit
        self.seen_tokens: dict[int, int] = {}  # block -> most tokens of it any request had (recomputed)
        self.last_view = _TierView(0, frozenset(), 0, 0)  # the previous audit (set by run)

    def apply(self, op: Op) -> Observation:
        return self.engine.apply(op)

    # --- background I/O -------------------------------------------------------------------------------

    def events(self) -> EventsResult:
        ev = self.apply(CheckHicacheEvents())
        assert isinstance(ev, EventsResult), ev
        for name in ("writes", "loads", "revoked", "backups", "host_releases"):
            self.acks[name] += getattr(ev, name)
        return ev

    def complete(self, queue: IOQueue, count: int) -> int:
        """``count`` jobs of ``queue`` on every rank; returns jobs completed over all ranks."""
        done = 0
        for rank in self.ranks:
            result = self.apply(CompleteIO(queue, rank, count))
            assert isinstance(result, IOResult), result
            done += result.completed
        return done

    def drain(self) -> None:
        """Every background queue of every rank runs dry and every acknowledgement is retired."""
        while True:
            moved = sum(
                self.complete(q, _DRAIN)
                for q in (IOQueue.WRITE, IOQueue.LOAD, IOQueue.BACKUP, IOQueue.PREFETCH_IO)
            )
            if self.events() == _NO_EVENTS and moved == 0:
                return

    def advance(self, us: int) -> None:
        if us > 0:
            self.apply(AdvanceClock(us))
            self.clock_us += us

    # --- L3 prefetch ----------------------------------------------------------------------------------

    def prefetch(self, req: SimRequest, tokens: tuple[int, ...], report: SimReport) -> int:
        """Run the request's prefetch to its end; returns the tokens it inserted into L2."""
        result = self.apply(PrefetchFromStorage(req.rid, tokens))
        assert isinstance(result, PrefetchResult), result
        if not result.admitted:
            self.refused[result.reason] += 1
            return 0
        report.prefetch.started += 1
        self.complete(IOQueue.PREFETCH_QUERY, 1)  # hit query + MIN all-reduce on every rank
        report.prefetch.revoked += self.events().revoked
        opt = self.options
        waited = 0  # the request waits for the scheduler; the I/O helper reads meanwhile
        while waited + opt.l3_batch_us <= opt.queue_delay_us and self.complete(IOQueue.PREFETCH_IO, 1):
            self.advance(opt.l3_batch_us)
            waited += opt.l3_batch_us
        self.advance(opt.queue_delay_us - waited)
        idle = 0
        while True:
            progress = self.apply(CheckPrefetchProgress(req.rid))
            assert isinstance(progress, ProgressResult), progress
            if progress.done:
                break
            idle = 0 if self.complete(IOQueue.PREFETCH_IO, 1) else idle + 1
            self.advance(opt.l3_batch_us)
            if idle > 1 and self.cfg.hicache_storage_prefetch_policy is PrefetchPolicy.WAIT_COMPLETE:
                raise UsageError(f"request {req.rid}: the prefetch is not done but has no I/O left to run")
        # Jobs left now belong to this prefetch (the queue was empty before): it stopped half-read, and
        # its I/O helper only has to notice the termination (no page is read).
        if self.complete(IOQueue.PREFETCH_IO, _DRAIN):
            if self.cfg.hicache_storage_prefetch_policy is PrefetchPolicy.TIMEOUT:
                report.prefetch.timed_out += 1
            else:
                report.prefetch.cut_short += 1
        report.prefetch.inserted += progress.inserted
        self.prefetch_since_audit += progress.inserted
        if progress.inserted:
            # The prefetch key starts where the match ended: the aligned input minus the prefetch tail.
            ps = self.cfg.page_size
            start = len(tokens) - len(tokens) % ps - result.tokens
            self.prefetched_pages.update(tokens[start + ps - 1 : start + progress.inserted : ps])
        return progress.inserted

    # --- one request ----------------------------------------------------------------------------------

    def serve(self, req: SimRequest, report: SimReport) -> None:
        self.advance(req.arrival_us - self.clock_us)
        inp = req.input_tokens()
        tokens = inp + tuple(range(req.output_start, req.output_start + req.output_tokens))
        served = report.served
        served.input += len(inp)
        served.output += req.output_tokens
        inserted = self.prefetch(req, inp, report) if self.cfg.enable_storage else 0
        seen = self._seen_tokens(req)
        start = self.start(req.rid, tokens, report)
        loaded_before = 0
        if not start.admitted:
            # The scheduler keeps the request waiting and retries it at its next step, after background
            # events: pinned host slots and load-back locks may have gone by then.
            report.admission_retries += 1
            if self.options.audit_every == 1:
                self.audit(report)  # the refused attempt may have written back pages the retry evicts
            self.drain()
            loaded_before = start.loaded  # on the device now: the retry sees them as a device hit
            start = self.start(req.rid, tokens, report)
            if not start.admitted:
                served.rejected += len(inp)
                return
        device_hit = start.device_hit - min(loaded_before, start.device_hit)
        loaded = start.loaded + start.device_hit - device_hit
        from_l3 = min(inserted, loaded) if loaded else 0
        served.l1 += device_hit
        served.l2 += loaded - from_l3
        served.l3 += from_l3
        computed = len(inp) - device_hit - loaded
        served.computed += computed
        served.recomputed += max(0, computed - (len(inp) - seen))
        if start.loaded:
            self.complete(IOQueue.LOAD, _DRAIN)  # the forward pass waits for the loaded layers
        finish = self.apply(FinishRequest(req.rid))
        assert isinstance(finish, FinishResult), finish
        self.device_inserted += len(tokens) - len(tokens) % self.cfg.page_size - finish.prefix_len

    def start(self, rid: int, tokens: tuple[int, ...], report: SimReport) -> StartResult:
        start = self.apply(StartRequest(rid, tokens))
        assert isinstance(start, StartResult), start
        report.moved.l2_to_l1 += start.loaded  # copied even when admission fails afterwards
        return start

    def _seen_tokens(self, req: SimRequest) -> int:
        """Input tokens of ``req`` that some earlier request already had (the rest are compulsory misses)."""
        seen = 0
        last = len(req.blocks) - 1
        for i, block in enumerate(req.blocks):
            tokens = req.last_block_tokens if i == last else req.block_tokens
            before = self.seen_tokens.get(block, 0)
            seen += min(tokens, before)
            if tokens > before:
                self.seen_tokens[block] = tokens
        return seen

    # --- the run --------------------------------------------------------------------------------------

    def audit(self, report: SimReport) -> _TierView:
        """Count pages written to and evicted from L2 since the previous audit; returns this view."""
        before = self.last_view
        after = self.last_view = _view(self.engine.snapshot())
        report.snapshots += 1
        written = len(after.host_pages - before.host_pages - self.prefetched_pages) * self.cfg.page_size
        report.moved.l1_to_l2 += written
        # Host tokens: after = before + written + prefetched - evicted. Taking the evictions from this
        # balance (rather than from the pages that vanished) keeps both counters short by the same
        # amount when a page is written and evicted between two audits.
        report.evicted.l2 += before.host_tokens + written + self.prefetch_since_audit - after.host_tokens
        self.prefetched_pages.clear()
        self.prefetch_since_audit = 0
        return after

    def run(self, report: SimReport, on_request: Callable[[int], None] | None) -> None:
        opt = self.options
        first = self.last_view = _view(self.engine.snapshot())
        report.snapshots += 1
        requests = self.workload.requests
        for i, req in enumerate(requests, start=1):
            self.serve(req, report)
            if i % opt.drain_every == 0 or i == len(requests):
                self.drain()
            if opt.audit_every and i % opt.audit_every == 0 and i != len(requests):
                self.audit(report)
            if opt.check_invariants:
                violations = check_all(self.engine.snapshot())
                if violations:
                    raise AssertionError(f"after request {req.rid}: " + "; ".join(map(str, violations)))
            if on_request is not None:
                on_request(i)
        end = self.audit(report)
        report.evicted.l1 = (
            first.device_tokens + self.device_inserted + report.moved.l2_to_l1 - end.device_tokens
        )
        report.moved.l2_to_l3 = (end.l3_keys - first.l3_keys) * self.cfg.page_size
        report.moved.l3_to_l2 = report.prefetch.inserted
        report.prefetch.refused = dict(sorted(self.refused.items()))
        report.acks = dict(sorted(self.acks.items()))


def simulate(
    workload: Workload,
    config: HiCacheConfig,
    options: SimOptions | None = None,
    *,
    engine: Engine | None = None,
    trace_name: str = "trace",
    on_request: Callable[[int], None] | None = None,
) -> SimReport:
    """Replay ``workload`` through an engine (``engine``, else ``make_engine(options.engine, config)``,
    closed afterwards) and account for every tier (module docstring). ``on_request(i)`` is called after
    the i-th request (progress bars).

    Raises ``ConfigError`` for a configuration that cannot work (``config`` is resolved here),
    ``UsageError`` when the device pool cannot hold the longest request or the engine cannot be built,
    and ``AssertionError`` when ``options.check_invariants`` finds a violation.
    """
    options = options or SimOptions()
    config = config.resolve()
    device_pages = config.device_size // config.page_size
    needed = -(-workload.longest_request // config.page_size)
    if device_pages < needed:
        raise UsageError(
            f"L1 holds {device_pages * config.page_size} tokens but the longest request needs "
            f"{needed * config.page_size}: raise the L1 capacity, lower block_tokens or limit the trace"
        )
    report = SimReport(
        config=config,
        options=options,
        trace=trace_name,
        requests=len(workload.requests),
        block_tokens=workload.block_tokens,
    )
    report.bounds = Bounds(
        belady_l1=workload.optimal_hit_tokens(config.device_size),
        belady_l1_l2=workload.optimal_hit_tokens(config.device_size + config.host_size),
        infinite=workload.infinite_hit_tokens,
    )
    own = engine is None
    engine = engine if engine is not None else make_engine(options.engine, config)
    started = time.perf_counter()
    try:
        _Simulator(engine, config, workload, options).run(report, on_request)
    finally:
        if own:
            _close(engine)
    report.seconds = time.perf_counter() - started
    return report


# --- sweep and plot ---------------------------------------------------------------------------------------


def sweep(
    workload: Workload,
    base: HiCacheConfig,
    *,
    l2_ratios: Sequence[float],
    evictions: Sequence[EvictionPolicy | str],
    write_policies: Sequence[WritePolicy | str],
    options: SimOptions | None = None,
    trace_name: str = "trace",
    on_request: Callable[[int], None] | None = None,
    on_run: Callable[[SimReport], None] | None = None,
) -> list[SimReport]:
    """One ``simulate`` per (L2 ratio, eviction strategy, write policy), in that nesting order.

    ``on_run`` is called after each run. Raises what ``simulate`` raises.
    """
    reports: list[SimReport] = []
    for ratio in l2_ratios:
        for eviction in evictions:
            for write_policy in write_policies:
                config = dataclasses.replace(
                    base,
                    hicache_ratio=ratio,
                    hicache_size=0.0,
                    radix_eviction_policy=EvictionPolicy(eviction),
                    hicache_write_policy=WritePolicy(write_policy),
                )
                report = simulate(workload, config, options, trace_name=trace_name, on_request=on_request)
                reports.append(report)
                if on_run is not None:
                    on_run(report)
    return reports


_COLORS: Final = {
    EvictionPolicy.LRU: "tab:red",
    EvictionPolicy.LFU: "tab:blue",
    EvictionPolicy.FIFO: "tab:green",
    EvictionPolicy.MRU: "tab:purple",
    EvictionPolicy.FILO: "tab:brown",
    EvictionPolicy.PRIORITY: "tab:olive",
}
_LINE_STYLES: Final = {
    WritePolicy.WRITE_THROUGH: ("-", "o"),
    WritePolicy.WRITE_THROUGH_SELECTIVE: ("-.", "s"),
    WritePolicy.WRITE_BACK: (":", "^"),
}


def plot_sweep(reports: Sequence[SimReport], path: str | os.PathLike[str]) -> None:
    """Write a PNG of hit rate against L2 size: one panel per tier, one line per (eviction, write)
    policy, the offline bound dashed. Needs matplotlib (imported here only).

    Raises ``UsageError`` when ``reports`` is empty or matplotlib is missing.
    """
    if not reports:
        raise UsageError("nothing to plot: the sweep produced no runs")
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on CI machines
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise UsageError(f"the sweep plot needs matplotlib ({error}); pip install matplotlib") from error
    first = reports[0]
    l3 = "on" if first.config.enable_storage else "off"
    by_policy: dict[str, list[SimReport]] = {}
    for r in reports:
        name = f"{r.config.radix_eviction_policy.value} / {r.config.hicache_write_policy.value}"
        by_policy.setdefault(name, []).append(r)
    panels = (
        ("L1 (device hit)", "l1", "belady_l1", "Belady, L1"),
        ("L2 (loaded back)", "l2", None, ""),
        ("L1 + L2", "l1_l2", "belady_l1_l2", "Belady, L1+L2"),
        (f"total (L3 {l3})", "total", "infinite", "every repeat (infinite cache)"),
    )
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    for ax, (title, key, bound, bound_label) in zip(axes.flat, panels, strict=True):
        for name, runs in sorted(by_policy.items()):
            runs = sorted(runs, key=lambda r: r.config.host_size)
            style = _LINE_STYLES[runs[0].config.hicache_write_policy]  # equal lines stay distinguishable
            ax.plot(
                [r.config.host_size for r in runs],
                [r.hit_rates[key] for r in runs],
                color=_COLORS[runs[0].config.radix_eviction_policy],
                linestyle=style[0],
                marker=style[1],
                label=name,
            )
        if bound is not None:
            runs = sorted(reports, key=lambda r: r.config.host_size)
            ax.plot(
                [r.config.host_size for r in runs],
                [r.hit_rates[bound] for r in runs],
                linestyle="--",
                color="black",
                label=bound_label,
            )
        ax.set_title(title)
        ax.set_ylabel("fraction of input tokens")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("L2 capacity (simulated tokens)")
    fig.suptitle(
        f"{first.trace}: {first.requests} requests, L1 {first.config.device_size} tokens, "
        f"block {TRACE_BLOCK_TOKENS}→{first.block_tokens}, L3 {l3}"
    )
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=100)
    plt.close(fig)


# --- rendering --------------------------------------------------------------------------------------------


def _bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def render_report(report: SimReport) -> list[RenderableType]:
    """The report as rich renderables: a header line and three tables (served, moved, prefetch)."""
    cfg, s, rates = report.config, report.served, report.hit_rates
    l2 = f"ratio {cfg.hicache_ratio:g}" if cfg.hicache_size <= 0 else f"{cfg.hicache_size:g} GB"
    header = (
        f"[bold]{report.trace}[/bold]: {report.requests} requests, engine {report.options.engine}, "
        f"block {TRACE_BLOCK_TOKENS}→{report.block_tokens} "
        f"(1 token = {report.token_scale:g} trace tokens)\n"
        f"L1 {cfg.device_size} · L2 {cfg.host_size} ({l2}) · L3 {'on' if cfg.enable_storage else 'off'} · "
        f"page {cfg.page_size} · {cfg.hicache_write_policy.value} · {cfg.radix_eviction_policy.value} · "
        f"prefetch {cfg.hicache_storage_prefetch_policy.value} · TP {cfg.tp_size} {cfg.attention.value}"
    )
    served = Table(title="input tokens served", title_justify="left")
    for name, justify in (
        ("from", "left"),
        ("tokens", "right"),
        ("share", "right"),
        ("offline bound", "right"),
    ):
        served.add_column(name, justify=justify)  # type: ignore[arg-type]

    def pct(x: float) -> str:
        return f"{100 * x:.1f}%"

    served.add_row("L1 device hit", f"{s.l1:,}", pct(rates["l1"]), f"Belady(L1) {pct(rates['belady_l1'])}")
    served.add_row("L2 loaded back", f"{s.l2:,}", pct(rates["l2"]), "")
    served.add_row(
        "L1 + L2", f"{s.l1 + s.l2:,}", pct(rates["l1_l2"]), f"Belady(L1+L2) {pct(rates['belady_l1_l2'])}"
    )
    if cfg.enable_storage:
        served.add_row("L3 prefetched, loaded", f"{s.l3:,}", pct(rates["l3"]), "")
    served.add_row(
        "total hit", f"{s.l1 + s.l2 + s.l3:,}", pct(rates["total"]), f"infinite {pct(rates['infinite'])}"
    )
    served.add_row("computed (miss)", f"{s.computed:,}", pct(report.rate(s.computed)), "")
    served.add_row("  of which recomputed", f"{s.recomputed:,}", pct(report.rate(s.recomputed)), "")
    if s.rejected:
        served.add_row("[red]rejected requests[/red]", f"{s.rejected:,}", pct(report.rate(s.rejected)), "")
    served.add_row("input / output", f"{s.input:,} / {s.output:,}", "", "")

    moved = Table(
        title=f"data movement per rank ({report.bytes_per_token} bytes/token)", title_justify="left"
    )
    for name in ("direction", "tokens", "bytes"):
        moved.add_column(name, justify="left" if name == "direction" else "right")
    audit_prefix = {"exact": "", "lower_bound": "≥ ", "off": None}[report.audit]

    def row(label: str, tokens: int, *, audited: bool = False, with_bytes: bool = True) -> None:
        prefix = audit_prefix if audited else ""
        if prefix is None:
            moved.add_row(label, "not audited", "")
            return
        amount = f"{prefix}{_bytes(tokens * report.bytes_per_token)}" if with_bytes else ""
        moved.add_row(label, f"{prefix}{tokens:,}", amount)

    row("L1→L2 (write)", report.moved.l1_to_l2, audited=True)
    row("L2→L1 (load back)", report.moved.l2_to_l1)
    if cfg.enable_storage:
        row("L2→L3 (backup)", report.moved.l2_to_l3)
        row("L3→L2 (prefetch)", report.moved.l3_to_l2)
    row("evicted from L1", report.evicted.l1, with_bytes=False)
    row("evicted from L2", report.evicted.l2, audited=True, with_bytes=False)

    renderables: list[RenderableType] = [header, served, moved]
    if cfg.enable_storage:
        p = report.prefetch
        prefetch = Table(title="L3 prefetch", title_justify="left")
        prefetch.add_column("outcome")
        prefetch.add_column("count", justify="right")
        prefetch.add_row("started", f"{p.started:,}")
        for reason, count in p.refused.items():
            prefetch.add_row(f"refused: {reason}", f"{count:,}")
        prefetch.add_row("revoked (too few L3 hits)", f"{p.revoked:,}")
        prefetch.add_row("timed out", f"{p.timed_out:,}")
        prefetch.add_row("cut short (best effort)", f"{p.cut_short:,}")
        prefetch.add_row("tokens inserted into L2", f"{p.inserted:,}")
        renderables.append(prefetch)
    rps = report.requests / report.seconds if report.seconds else 0.0
    renderables.append(
        f"{report.seconds:.1f} s, {rps:,.0f} requests/s; L1→L2 / L2 eviction audit: "
        f"{report.audit.replace('_', ' ')} ({report.snapshots} snapshots)"
    )
    return renderables


def _sweep_table(reports: Sequence[SimReport]) -> Table:
    table = Table(title="sweep: hit rate of input tokens", title_justify="left")
    for name in (
        "L2 tokens",
        "eviction",
        "write policy",
        "L1",
        "L2",
        "L3",
        "total",
        "Belady L1",
        "Belady L1+L2",
        "infinite",
    ):
        table.add_column(name, justify="right")
    for r in reports:
        h = r.hit_rates
        table.add_row(
            f"{r.config.host_size:,}",
            r.config.radix_eviction_policy.value,
            r.config.hicache_write_policy.value,
            *(
                f"{100 * h[k]:.1f}%"
                for k in ("l1", "l2", "l3", "total", "belady_l1", "belady_l1_l2", "infinite")
            ),
        )
    return table


# --- command line -----------------------------------------------------------------------------------------


def _split(text: str, kind: Callable[[str], object], option: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise typer.BadParameter(f"{option} needs at least one value")
    for item in items:
        try:
            kind(item)
        except ValueError:
            raise typer.BadParameter(f"{option}: {item!r} is not valid") from None
    return items


def simulate_command(
    trace: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, help="A Mooncake trace (JSON Lines).")
    ],
    l1_tokens: Annotated[int, typer.Option(help="L1 (device) capacity, simulated tokens.")] = 16384,
    l2_ratio: Annotated[float, typer.Option(help="L2 capacity as a multiple of L1 (hicache_ratio).")] = 2.0,
    l2_gb: Annotated[
        float, typer.Option(help="L2 capacity in GB per rank (hicache_size); wins over the ratio.")
    ] = 0.0,
    l3: Annotated[bool, typer.Option("--l3/--no-l3", help="L3 storage with prefetch and backup.")] = False,
    page_size: Annotated[int, typer.Option(help="Tokens per page.")] = 16,
    block_tokens: Annotated[int, typer.Option(help="Simulated tokens per 512-token trace block.")] = 16,
    write_policy: Annotated[
        WritePolicy, typer.Option(help="hicache_write_policy.")
    ] = WritePolicy.WRITE_THROUGH_SELECTIVE,
    eviction: Annotated[EvictionPolicy, typer.Option(help="radix_eviction_policy.")] = EvictionPolicy.LRU,
    prefetch_policy: Annotated[
        PrefetchPolicy, typer.Option(help="hicache_storage_prefetch_policy.")
    ] = PrefetchPolicy.BEST_EFFORT,
    prefetch_threshold: Annotated[int, typer.Option(help="Smallest prefetch, simulated tokens.")] = 16,
    prefetch_timeout_base: Annotated[float, typer.Option(help="Seconds (timeout policy).")] = 1.0,
    prefetch_timeout_per_ki_token: Annotated[
        float, typer.Option(help="Seconds per 1024 tokens (timeout policy).")
    ] = 0.25,
    load_back_threshold: Annotated[int, typer.Option(help="Smallest host hit loaded back, tokens.")] = 10,
    storage_batch_size: Annotated[int, typer.Option(help="Pages per L3 batch.")] = 128,
    io_backend: Annotated[
        IOBackend, typer.Option(help="hicache_io_backend (impl engine on CPU: direct).")
    ] = IOBackend.KERNEL,
    mem_layout: Annotated[MemLayout, typer.Option(help="hicache_mem_layout.")] = MemLayout.LAYER_FIRST,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks.")] = 1,
    attention: Annotated[AttentionKind, typer.Option(help="MHA or MLA.")] = AttentionKind.MHA,
    limit: Annotated[int, typer.Option(help="Replay only the first N requests (0: all).")] = 0,
    engine: Annotated[str, typer.Option(help="model, or impl (refcache.gpu.driver.HiCacheImpl).")] = "model",
    queue_delay_us: Annotated[
        int, typer.Option(help="Arrival to first admission check (prefetch I/O runs).")
    ] = 10_000,
    l3_batch_us: Annotated[int, typer.Option(help="Logical time of one L3 read batch.")] = 1_000,
    drain_every: Annotated[int, typer.Option(help="Requests between background I/O drains.")] = 1,
    audit_every: Annotated[
        int | None,
        typer.Option(
            help="Requests between the snapshots that count L1→L2 copies and L2 evictions: 1 is exact; "
            "more gives lower bounds; 0 skips them (fast: a model snapshot grows with the L3 key set). "
            "Default: 1, or 0 with --sweep (which reports hit rates only)."
        ),
    ] = None,
    check_invariants: Annotated[
        bool, typer.Option(help="Check every invariant after every request (slow).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    run_sweep: Annotated[
        bool, typer.Option("--sweep", help="Run the grid of L2 ratio × eviction × write policy.")
    ] = False,
    sweep_l2_ratios: Annotated[
        str, typer.Option(help="Comma-separated L2 ratios for --sweep.")
    ] = "1.5,2,4,8",
    sweep_evictions: Annotated[
        str, typer.Option(help="Comma-separated eviction strategies for --sweep.")
    ] = "lru,lfu",
    sweep_write_policies: Annotated[
        str, typer.Option(help="Comma-separated write policies for --sweep.")
    ] = "write_through,write_back",
    plot: Annotated[Path, typer.Option(help="PNG written by --sweep.")] = Path("simulate-sweep.png"),
) -> None:
    """Replay a Mooncake request trace through the cache and report where every input token came from
    (L1, L2, L3 or computed), the bytes moved between tiers, evictions, prefetch outcomes, and Belady's
    offline-optimal hit rate at the same capacities. With --sweep, run a grid and plot it."""
    # Piped output (files, CI logs) gets room for the tables instead of rich's 80-column default.
    console = Console() if sys.stdout.isatty() else Console(width=max(Console().width, 132))
    status = Console(stderr=True)
    try:
        workload = Workload.from_trace(trace, block_tokens=block_tokens, limit=limit or None)
        config = HiCacheConfig(
            device_size=l1_tokens,
            hicache_ratio=l2_ratio,
            hicache_size=l2_gb,
            hicache_storage_backend="file" if l3 else None,
            page_size=page_size,
            hicache_write_policy=write_policy,
            radix_eviction_policy=eviction,
            hicache_storage_prefetch_policy=prefetch_policy,
            prefetch_threshold=prefetch_threshold,
            prefetch_timeout_base=prefetch_timeout_base,
            prefetch_timeout_per_ki_token=prefetch_timeout_per_ki_token,
            load_back_threshold=load_back_threshold,
            storage_batch_size=storage_batch_size,
            hicache_io_backend=io_backend,
            hicache_mem_layout=mem_layout,
            tp_size=tp,
            attention=attention,
        )
        options = SimOptions(
            engine=engine,
            queue_delay_us=queue_delay_us,
            l3_batch_us=l3_batch_us,
            drain_every=drain_every,
            audit_every=(0 if run_sweep else 1) if audit_every is None else audit_every,
            check_invariants=check_invariants,
        )
        grid = (
            (
                [float(x) for x in _split(sweep_l2_ratios, float, "--sweep-l2-ratios")],
                _split(sweep_evictions, EvictionPolicy, "--sweep-evictions"),
                _split(sweep_write_policies, WritePolicy, "--sweep-write-policies"),
            )
            if run_sweep
            else ([l2_ratio], [eviction.value], [write_policy.value])
        )
        runs = len(grid[0]) * len(grid[1]) * len(grid[2])
        n = len(workload.requests)
        with Progress(
            TextColumn("[bold]simulate[/bold] {task.fields[run]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=status,
            transient=True,
            disable=not status.is_terminal,
        ) as progress:
            task = progress.add_task("simulate", total=n * runs, run="")
            done = [0]

            def tick(i: int) -> None:
                progress.update(task, completed=done[0] + i)

            def next_run(report: SimReport) -> None:
                done[0] += n
                progress.update(task, run=f"({len(reports_so_far) + 1}/{runs})")
                reports_so_far.append(report)

            reports_so_far: list[SimReport] = []
            if run_sweep:
                reports = sweep(
                    workload,
                    config,
                    l2_ratios=grid[0],
                    evictions=grid[1],
                    write_policies=grid[2],
                    options=options,
                    trace_name=trace.name,
                    on_request=tick,
                    on_run=next_run,
                )
            else:
                reports = [simulate(workload, config, options, trace_name=trace.name, on_request=tick)]
        if run_sweep:
            plot_sweep(reports, plot)
    except (RefcacheError, OSError) as error:
        status.print(f"[red]{error}[/red]", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from error
    except AssertionError as error:  # --check-invariants found a violation: a bug in the engine
        status.print(f"[red]INVARIANT VIOLATED[/red] {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from error
    if as_json:
        payload: object = [r.to_json() for r in reports] if run_sweep else reports[0].to_json()
        console.print_json(json.dumps(payload))
        return
    if run_sweep:
        console.print(_sweep_table(reports))
        console.print(f"plot written to {plot}", soft_wrap=True)
        return
    for renderable in render_report(reports[0]):
        console.print(renderable)
