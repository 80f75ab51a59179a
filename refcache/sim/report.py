"""Report records: what one simulation run found, and its JSON form.

A ``SimReport`` holds the counters ``refcache.sim.simulator`` fills (its docstring says where each one
comes from), the offline bounds of ``refcache.sim.workload`` and the configuration and options of the
run. Counts are simulated tokens; bytes are tokens × ``HiCacheConfig.bytes_per_token``, per rank.
``SimReport.to_json`` is the ``refcache simulate --json`` output.
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

from refcache.config import HiCacheConfig
from refcache.errors import UsageError
from refcache.sim.mooncake import TRACE_BLOCK_TOKENS
from refcache.systems import SYSTEMS

__all__ = [
    "Bounds",
    "Evicted",
    "Moved",
    "Prefetches",
    "RequestRecord",
    "Served",
    "SimOptions",
    "SimReport",
    "write_csv",
]


@dataclass
class Served:
    """Input tokens by where they came from (simulated tokens)."""

    input: int = 0  # every request's input
    output: int = 0  # every request's output (always computed)
    l1: int = 0  # device hit
    l2: int = 0  # loaded back from host memory (not prefetched for this request)
    l3: int = 0  # prefetched from L3 for this request, then loaded back
    computed: int = 0  # input tokens computed (misses)
    computed_pages: int = 0  # pages those tokens fill, a request's partial last page counting as one
    recomputed: int = 0  # of those, tokens some earlier request already had (not compulsory)
    rejected: int = 0  # input tokens of requests the system did not admit


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
class RequestRecord:
    """One request's share of the counters (``simulate(..., per_request=True)``), simulated tokens.

    The evictions and the L1→L2 copies are those between the snapshot before the request and the one
    after it and its background I/O drain; summed over the requests, every column equals the report's
    counter.
    """

    rid: int  # position in arrival order
    line: int  # line in the trace
    arrival_us: int
    input: int
    output: int
    l1: int = 0  # device hit
    l2: int = 0  # loaded back from L2
    l3: int = 0  # prefetched from L3, then loaded back
    computed: int = 0
    computed_pages: int = 0
    rejected: bool = False  # not admitted (its input counts as neither hit nor computed)
    l1_to_l2: int = 0
    evicted_l1: int = 0
    evicted_l2: int = 0
    prefetch: str = "off"  # off (no L3), refused:<reason>, revoked, timed_out, cut_short, complete
    prefetch_inserted: int = 0  # tokens its prefetch inserted into L2


_CSV_COLUMNS = (
    ("rid", "rid", False),
    ("line", "line", False),
    ("arrival_us", "arrival_us", False),
    ("input_tokens", "input", False),
    ("output_tokens", "output", False),
    ("l1_hit_tokens", "l1", True),
    ("l2_hit_tokens", "l2", True),
    ("l3_hit_tokens", "l3", True),
    ("computed_tokens", "computed", False),
    ("computed_pages", "computed_pages", False),
    ("rejected", "rejected", False),
    ("l1_to_l2_tokens", "l1_to_l2", True),
    ("l1_evicted_tokens", "evicted_l1", True),
    ("l2_evicted_tokens", "evicted_l2", True),
    ("prefetch", "prefetch", False),
    ("prefetch_inserted_tokens", "prefetch_inserted", True),
)


def write_csv(records: Sequence[RequestRecord], page_size: int, file: TextIO) -> None:
    """``records`` as CSV (``csv`` module, a header row first): one row per request, every token count of
    whole pages followed by its page count (``*_pages``)."""
    writer = csv.writer(file, lineterminator="\n")
    header: list[str] = []
    for name, _, paged in _CSV_COLUMNS:
        header.append(name)
        if paged:
            header.append(name.removesuffix("_tokens") + "_pages")
    writer.writerow(header)
    for record in records:
        row: list[object] = []
        for _, attribute, paged in _CSV_COLUMNS:
            value = getattr(record, attribute)
            row.append(int(value) if isinstance(value, bool) else value)
            if paged:
                row.append(value // page_size)
        writer.writerow(row)


@dataclass
class Bounds:
    """Offline bounds on hit tokens (``refcache.sim.workload``)."""

    belady_l1: int = 0
    belady_l1_l2: int = 0
    infinite: int = 0


@dataclass(frozen=True)
class SimOptions:
    """How the scheduler drives the system (``refcache.sim.simulator``'s docstring); a report carries the options
    of its run. Defined here, beside the report, so that the report needs nothing of the simulator. Times are logical microseconds.

    Raises ``UsageError`` for a negative time or cadence, or when ``system`` is not exactly one
    registered system (``refcache.systems.SYSTEMS``).
    """

    system: str = "model"  # the system simulate opens when it is given none (refcache.systems)
    queue_delay_us: int = 10_000  # arrival -> first admission check; prefetch I/O runs meanwhile
    l3_batch_us: int = 1_000  # one storage batch (storage_batch_size pages) read on every rank
    drain_every: int = 1  # requests between background I/O drains
    audit_every: int = 1  # requests between audit snapshots (0: first and last only)
    check_invariants: bool = False  # check every invariant after every request (slow; tests)
    system_options: tuple[tuple[str, object], ...] = ()  # keyword options for the system (open_systems)

    def __post_init__(self) -> None:
        for name in ("queue_delay_us", "audit_every"):
            if getattr(self, name) < 0:
                raise UsageError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("l3_batch_us", "drain_every"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.system not in SYSTEMS:
            raise UsageError(
                f"system {self.system!r} is not one of {', '.join(SYSTEMS)} (simulate drives exactly one)"
            )


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
    snapshots: int = 0  # system snapshots the accounting took (first, audits, last)
    seconds: float = 0.0  # wall time of the replay
    per_request: list[RequestRecord] = field(default_factory=list)  # filled with per_request=True

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
            "page_size": self.config.page_size,
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
