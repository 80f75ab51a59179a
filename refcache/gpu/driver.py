"""``HiCacheImpl``: the real HiCache — N tensor-parallel ranks on real pools — behind the operation alphabet.

``apply(op) -> Observation`` and ``snapshot() -> Snapshot`` are the same contract as the reference model's,
so a differential test can drive both with one operation sequence and compare everything they report.

Each rank is built by ``build_rank``: a device pool and its paged allocator, a host pool in the
configured layout, a file L3 (one directory shared by the ranks; keys carry the rank suffix of seed §5.5),
a ``HiCacheController`` and a ``HiRadixCache``. Scheduler operations run on every rank in lock step:
in one process, ``InProcessGroup.run_lockstep`` steps the ranks' generators and reduces at their yields;
with a ``TorchDistributedCommunicator`` this process hosts one rank and reduces through
``torch.distributed``. Background work runs on the executor: ``"manual"`` (deterministic; a ``CompleteIO``
op runs the next steps of one queue on one rank) or ``"threads"`` (worker threads; ``CompleteIO`` waits
briefly for progress and reports how much happened).

The production seams (``Clock``, ``Executor``, ``Communicator``) come from ``refcache.runtime``. Being the
implementation's adapter for the harness, this module alone of ``refcache.gpu`` also builds the test
doubles of ``refcache.testing``: the manual executor, the in-process group and the default logical clock.
"""

from __future__ import annotations

import functools
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import Literal, Self, TypeVar

import torch

from refcache.config import HiCacheConfig
from refcache.errors import CorruptionError, UnsupportedError, UsageError
from refcache.gpu.allocator import PagedTokenToKVPoolAllocator
from refcache.gpu.cache_controller import HiCacheController
from refcache.gpu.device_pool import device_pool_from_config
from refcache.gpu.hiradix_cache import HiRadixCache
from refcache.gpu.host_pool import host_pool_from_config
from refcache.gpu.kv_oracle import KVOracle, OracleMode
from refcache.gpu.l3_store import L3Store
from refcache.gpu.storage import stray_files
from refcache.hicache.ops import (
    AbortPrefetch,
    AbortRequest,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Done,
    EventsResult,
    Evict,
    EvictHost,
    EvictHostResult,
    EvictResult,
    FinishRequest,
    FinishResult,
    IOResult,
    MatchPrefix,
    MatchResult,
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    Reset,
    ResetResult,
    StartRequest,
    StartResult,
    StorageFault,
    check_op,
)
from refcache.hicache.snapshot import RankSnapshot, Snapshot, rank_clocks
from refcache.runtime import (
    Clock,
    Collective,
    Communicator,
    Executor,
    ThreadExecutor,
    TorchDistributedCommunicator,
    run_local,
)

# The harness adapter builds the test doubles; no other module of refcache.gpu may (pyproject.toml).
from refcache.testing import InProcessGroup, LogicalClock, ManualExecutor

__all__ = ["HiCacheImpl", "RankClock", "build_rank", "host_defaults"]

_T = TypeVar("_T")


def host_defaults() -> dict[str, tuple[str, str]]:
    """The configuration this machine needs unless the user chose otherwise (``refcache.systems``): without
    CUDA, the direct I/O backend (torch copies); the kernel backend stays available when asked for, its
    Triton kernels then run under the CPU interpreter (``refcache.gpu`` sets ``TRITON_INTERPRET=1``)."""
    if torch.cuda.is_available():
        return {}
    return {
        "hicache_io_backend": (
            "direct",
            (
                "no CUDA device: the implementation copies KV with --hicache-io-backend direct (pass "
                "--hicache-io-backend kernel to run the Triton kernels under the CPU interpreter)"
            ),
        )
    }


def build_rank(
    config: HiCacheConfig,
    rank: int,
    executor: Executor,
    clock: Clock,
    l3_dir: str | None,
    device: torch.device | str | None = None,
    oracle_mode: OracleMode = "full",
) -> HiRadixCache:
    """One rank's pools, L3, controller and tree, for a resolved ``config``; ``oracle_mode``: how much of
    every read the KV content oracle checks (``refcache.gpu.kv_oracle``)."""
    oracle = KVOracle(config, rank, oracle_mode)
    mem_pool_device = device_pool_from_config(config, device)
    allocator = PagedTokenToKVPoolAllocator(
        config.device_size,
        config.page_size,
        mem_pool_device.device,
        kvcache=mem_pool_device,
        # a read of a slot whose copy never arrived must show (no reader checks with the oracle off)
        on_free=functools.partial(oracle.poison, mem_pool_device) if oracle.enabled else None,
    )
    mem_pool_host = host_pool_from_config(
        mem_pool_device, config, pin_memory=mem_pool_device.device.type == "cuda"
    )
    storage = None
    if config.enable_storage:
        if l3_dir is None:
            raise UsageError("a storage backend is configured but no L3 directory was given")
        storage = L3Store(l3_dir, config, rank, mem_pool_host)
    controller = HiCacheController(
        config, rank, mem_pool_device, allocator, mem_pool_host, storage, executor, oracle, clock
    )
    return HiRadixCache(config, rank, controller, oracle)


class RankClock:
    """One rank's clock (D-41): the shared clock plus how far ``AdvanceClock(us, rank)`` moved this rank's
    past it (``skews``, one entry per rank of the system, shared by its ranks' clocks)."""

    def __init__(self, shared: Clock, skews: list[int], rank: int) -> None:
        self.shared = shared
        self.skews = skews
        self.rank = rank

    def now_us(self) -> int:
        return self.shared.now_us() + self.skews[self.rank]


class HiCacheImpl:
    """The implementation: ``apply(op) -> Observation``, ``snapshot() -> Snapshot``, ``close()``.

    ``l3_dir``: the L3 directory (a temporary one, removed by ``close``, when None and storage is on).
    ``executor``: ``"manual"`` or ``"threads"``. ``communicator``: host only this process's rank and
    reduce over ``torch.distributed`` (threads executor only). ``clock``: a ``LogicalClock`` by default.
    ``oracle``: the KV content oracle's mode — ``"full"`` (default: every position of every read is
    checked), ``"sampled"`` (every 8th position of each read and its last) or ``"off"`` (no seeds, no
    writes, no checks, no poisoning of freed slots); see ``specs/data-plane.md``.
    """

    def __init__(
        self,
        config: HiCacheConfig,
        l3_dir: str | None = None,
        *,
        executor: Literal["manual", "threads"] = "manual",
        device: torch.device | str | None = None,
        clock: Clock | None = None,
        communicator: TorchDistributedCommunicator | None = None,
        oracle: OracleMode = "full",
    ) -> None:
        self.config = config.resolve()
        self.oracle_mode: OracleMode = oracle
        cfg = self.config
        since_0_5_23 = [
            o
            for o in (
                "count_hits_per_request",
                "priority_after_split",
                "evict_host_shortfall",
                "merge_write_acks",
                "evict_request_size_on_admission",  # D-42, up to SGLang 0.5.16
                "write_back_per_victim",  # D-44, SGLang 0.5.22 on
                "split_keeps_creation_time",  # D-45, SGLang 0.5.22 on
                "last_host_node_is_best_match",  # D-46, SGLang 0.5.22 on
                "load_back_evicts_shortfall",  # D-47, SGLang 0.5.22 on
                "reclaim_host_duplicates",  # D-48, SGLang 0.5.22 on
                "free_duplicates_per_node",  # D-49, SGLang 0.5.22 on
                "count_hits_on_refill",  # D-50, SGLang's UnifiedRadixCache from 0.5.19
                "tail_freed_before_insert",  # D-65, SGLang up to 0.5.3
                "failed_write_back_keeps_node",  # D-66, SGLang 0.5.11..0.5.14
                "write_back_flush_skips_storage",  # D-67, SGLang up to 0.5.8
            )
            if getattr(cfg, o)
        ]
        if since_0_5_23:
            raise UnsupportedError(
                f"{', '.join(since_0_5_23)} (D-35..D-38 and D-44..D-49, SGLang 0.5.22 on; D-50; D-42; D-65; D-66; D-67) are followed by "
                "the model only; the implementation behaves as 0.5.20 does there (specs/decisions.md)"
            )
        for option, decision in (
            ("allocate_prefetch_after_query", "D-01, SGLang 0.5.20's prefetch pipeline"),
            ("backup_protects_passed_node_only", "D-07, 0.5.20's unpinned backup fragment"),
            ("root_priority_from_inserts", "D-51, UnifiedRadixCache's root priority under a prefetch insert"),
            ("release_unread_prefetch_tail", "D-52, UnifiedRadixCache's release of a prefetch's unread tail"),
            (
                "backup_per_fragment",
                "D-53, UnifiedRadixCache's L3 backup per fragment of a split write-through",
            ),
            ("prefetch_progress_in_operation", "D-54, SGLang up to 0.5.18's prefetch pipeline without acks"),
            (
                "prefetch_timeout_from_first_poll",
                "D-55, SGLang 0.5.23's prefetch timeout from the first blocked progress check",
            ),
            (
                "anchor_pin_follows_split",
                "D-57, SGLang 0.5.22 on: a split prefetch anchor's pin on the new prefix",
            ),
            ("revoke_at_query", "D-58, SGLang up to 0.5.17's revoke queue under D-01's pipeline"),
            ("prefetch_admission_falls_back", "D-59, SGLang 0.5.11..0.5.15's shorter key at admission"),
            ("prefetch_cap_half_host", "D-60, SGLang 0.5.15's cap on in-flight prefetch tokens"),
            ("prefetch_timeout_capped", "D-61, SGLang 0.5.12..0.5.15's capped float timeout"),
            ("prefetch_takes_root_priority", "D-62, SGLang 0.5.6..0.5.15's root priority under a prefetch"),
            ("terminated_prefetch_reads_batch", "D-63, SGLang up to 0.5.18's read of a terminated prefetch"),
            ("prefetch_timeout_in_floats", "D-64, SGLang up to 0.5.11's timeout in floats"),
        ):
            if cfg.enable_storage and getattr(cfg, option):
                raise UnsupportedError(
                    f"{option}=True ({decision}) is followed by the model only, with L3; the implementation "
                    "refuses it. Use it with --against model,sglang, or turn it off (specs/decisions.md D-39)"
                )
        if cfg.loads_retired_per_rank and cfg.tp_size > 1:
            raise UnsupportedError(
                "loads_retired_per_rank=True (D-68, SGLang up to 0.5.12's load acks retired per rank) is followed "
                "by the model only, with two ranks or more; the implementation retires them by a MIN "
                "(specs/decisions.md D-68)"
            )
        self.clock: Clock = clock if clock is not None else LogicalClock()
        # D-41: how far AdvanceClock(us, rank) moved each rank's clock past the shared one (the snapshot
        # reports the earliest rank's clock and each rank's skew from it: ``rank_clocks``)
        self.clock_skews = [0] * cfg.tp_size
        self._own_dir: str | None = None
        if cfg.enable_storage and l3_dir is None:
            l3_dir = self._own_dir = tempfile.mkdtemp(prefix="refcache-l3-")
        self.l3_dir = l3_dir
        self.communicator = communicator
        self.group = InProcessGroup(cfg.tp_size, keep_log=False) if communicator is None else None
        local_ranks = range(cfg.tp_size) if communicator is None else [communicator.rank]
        if communicator is not None and communicator.size != cfg.tp_size:
            raise UsageError(f"the process group has {communicator.size} ranks but tp_size is {cfg.tp_size}")
        self.executor: Executor
        if executor == "manual":
            if self.group is None:
                raise UsageError("the manual executor needs every rank in this process (no communicator)")
            self.executor = ManualExecutor(self.group)
        elif executor == "threads":
            comm: Communicator | None = self.group if self.group is not None else communicator
            assert comm is not None
            self.executor = ThreadExecutor(comm)
        else:
            raise UsageError(f"executor={executor!r} is not 'manual' or 'threads'")
        try:
            self.ranks = [
                build_rank(
                    cfg, r, self.executor, RankClock(self.clock, self.clock_skews, r), l3_dir, device, oracle
                )
                for r in local_ranks
            ]
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker threads and remove a temporary L3 directory."""
        self.executor.close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            self._own_dir = None

    # --- the alphabet -------------------------------------------------------------------------------------

    def apply(self, op: Op) -> Observation:
        """Apply one operation. Raises ``UsageError`` (nothing changed) for an invalid one."""
        self.executor.check()
        self._validate(op)
        match op:
            case MatchPrefix(tokens, extra_key):
                return self._all(lambda c: _match(c, tokens, extra_key))
            case StartRequest(rid, tokens, extra_key, prompt_len):
                return self._all(lambda c: StartResult(*c.start_request(rid, tokens, extra_key, prompt_len)))
            case CacheUnfinishedRequest(rid):
                for c in self.ranks:
                    c.cache_unfinished_req(rid)
                return Done()
            case FinishRequest(rid):
                return self._all(lambda c: FinishResult(*c.cache_finished_req(rid)))
            case AbortRequest(rid):
                for c in self.ranks:
                    c.abort_req(rid)
                return Done()
            case Evict(num_tokens):
                return self._all(lambda c: EvictResult(c.evict(num_tokens)))
            case EvictHost(num_tokens):
                return self._all(lambda c: EvictHostResult(c.evict_host(num_tokens)))
            case PrefetchFromStorage(rid, tokens, extra_key):
                return self._all(lambda c: _prefetch(c, rid, tokens, extra_key))
            case CheckPrefetchProgress(rid):
                done, inserted = self._collective(lambda c: c.check_prefetch_progress(rid))
                return ProgressResult(done=done, inserted=inserted)
            case AbortPrefetch(rid):
                if rid in self.ranks[0].ongoing_prefetch:
                    for c in self.ranks:
                        c.release_aborted_request(rid)
                return Done()
            case CheckHicacheEvents():
                return EventsResult(*self._collective(lambda c: c.check_hicache_events()))
            case Reset():
                return ResetResult(flushed=self._collective(lambda c: c.flush_cache()))
            case CompleteIO(queue, rank, count):
                if not self._hosts(rank):
                    return IOResult(0)
                completed = self.executor.complete(queue.value, rank, count)
                self.executor.check()
                return IOResult(completed)
            case AdvanceClock(us, rank):
                if isinstance(self.clock, LogicalClock):
                    if rank is None:
                        self.clock.advance(us)
                    else:
                        self.clock_skews[rank] += us
                return Done()
            case StorageFault(kind, rank, index):
                for c in self.ranks:
                    if c.rank == rank and c.cache_controller.storage_backend is not None:
                        c.cache_controller.storage_backend.inject(kind.value, index)
                return Done()

    def snapshot(self) -> Snapshot:
        """The state of every rank this process hosts. With L3, also the directory's hygiene, when every rank
        writes from this process: a file that is neither a published object nor a write in flight (a failed
        write's temporary file left behind) raises ``CorruptionError``, which the harness reports as this
        system's failure."""
        cfg = self.config
        self._check_l3_directory()
        clock_us, skews = rank_clocks([self.clock.now_us() + skew for skew in self.clock_skews])
        return Snapshot(
            page_size=cfg.page_size,
            write_policy=cfg.hicache_write_policy.value,
            attention=cfg.attention.value,
            tp_size=cfg.tp_size,
            model_name=cfg.model_name,
            storage_enabled=cfg.enable_storage,
            is_eagle=cfg.is_eagle,
            clock_us=clock_us,
            ranks=tuple(self._rank_snapshot(c, skews[c.rank]) for c in self.ranks),
        )

    # --- helpers ------------------------------------------------------------------------------------------

    def _check_l3_directory(self) -> None:
        if self.l3_dir is None or self.group is None:  # another process's writes are not known here
            return
        files = [
            c.cache_controller.storage_backend.file
            for c in self.ranks
            if c.cache_controller.storage_backend is not None
        ]
        stray = stray_files(self.l3_dir, files)
        if stray:
            raise CorruptionError(
                f"the L3 directory {self.l3_dir} holds {len(stray)} file(s) that are neither a published "
                f"object nor a write in flight (a failed write left them?): {', '.join(stray[:5])}"
            )

    def _rank_snapshot(self, c: HiRadixCache, skew: int) -> RankSnapshot:
        snap = c.snapshot(_l3_keys(c))
        return replace(snap, clock_skew_us=skew) if skew else snap

    def _hosts(self, rank: int) -> bool:
        return any(c.rank == rank for c in self.ranks)

    def _all(self, step: Callable[[HiRadixCache], _T]) -> _T:
        if len(self.ranks) == 1:
            return step(self.ranks[0])
        results = [step(c) for c in self.ranks]
        if any(r != results[0] for r in results):
            raise AssertionError(f"ranks answered a lock-step operation differently: {results}")
        return results[0]

    def _collective(self, make: Callable[[HiRadixCache], Collective[_T]]) -> _T:
        if self.group is not None:
            results = self.group.run_lockstep([make(c) for c in self.ranks])
        else:
            assert self.communicator is not None
            results = [run_local(make(c), self.communicator, c.rank) for c in self.ranks]
        if any(r != results[0] for r in results):
            raise AssertionError(f"ranks answered a collective operation differently: {results}")
        return results[0]

    def _validate(self, op: Op) -> None:
        rank0 = self.ranks[0]
        check_op(
            op,
            tp_size=self.config.tp_size,
            is_eagle=self.config.is_eagle,
            running=rank0.requests,
            prefetching=rank0.ongoing_prefetch,
        )


def _l3_keys(cache: HiRadixCache) -> list[str]:
    storage = cache.cache_controller.storage_backend
    return storage.keys() if storage is not None else []


def _match(c: HiRadixCache, tokens: tuple[int, ...], namespace: str | None) -> MatchResult:
    m = c.match_prefix(c.key_of(tokens), namespace)
    return MatchResult(
        len(m.device_indices), m.host_hit_length, c.depth(m.last_node), c.depth(m.last_host_node)
    )


def _prefetch(c: HiRadixCache, rid: int, tokens: tuple[int, ...], namespace: str | None) -> PrefetchResult:
    """The scheduler's ``_prefetch_kvcache``: match, then prefetch the missing tail below a backed-up node."""
    key = c.key_of(tokens)
    m = c.match_prefix(key, namespace)
    tail = key[len(m.device_indices) + m.host_hit_length :]
    tail = tail[: len(tail) - len(tail) % c.page_size]
    if not c.enable_storage:
        return PrefetchResult(False, "storage_disabled", len(tail))
    if not m.last_node.backuped and not c.config.prefetch_below_last_host_node:  # D-13 option: 0.5.20
        # Only prefetch when L2 holds the matched prefix, else completeness is not guaranteed (seed §2.2).
        return PrefetchResult(False, "last_node_not_backuped", len(tail))
    reason = c.prefetch_from_storage(rid, m.last_host_node, tail, namespace)
    return PrefetchResult(reason == "", reason or "admitted", len(tail))
