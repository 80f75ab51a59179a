"""Shared pieces of the implementation tests: a seeded random program for the threads and multi-process
runs (no Hypothesis, no model), a tree view for comparing ranks, and the gloo worker."""

from __future__ import annotations

import json
import os
import pickle
import random
from collections.abc import Callable

from refcache.config import HiCacheConfig
from refcache.gpu.driver import HiCacheImpl
from refcache.hicache.invariants import check_all
from refcache.hicache.ops import (
    AbortPrefetch,
    AbortRequest,
    AdvanceClock,
    CacheUnfinishedRequest,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    Reset,
    StartRequest,
    StorageFault,
)
from refcache.hicache.snapshot import RankSnapshot
from refcache.runtime import TorchDistributedCommunicator

# --- a seeded random program (threads and multi-process runs: no Hypothesis, no model) ---------------------


class RandomProgram:
    """A reproducible random operation sequence that branches only on lock-step observations (equal on
    every rank), so N processes given the same seed apply the same program."""

    def __init__(self, system: HiCacheImpl, seed: int, *, faults: bool = False) -> None:
        self.system = system
        self.cfg = system.config
        self.rng = random.Random(seed)
        self.faults = faults
        self.running: set[int] = set()
        self.prefetching: set[int] = set()
        self.next_rid = 0
        self.seqs: list[tuple[int, ...]] = []

    def tokens(self) -> tuple[int, ...]:
        ps = self.cfg.page_size
        prefix: tuple[int, ...] = ()
        if self.seqs and self.rng.random() < 0.7:
            base = self.rng.choice(self.seqs)
            prefix = base[: self.rng.randint(0, len(base) // ps) * ps + self.rng.choice((-1, 0, 0, 1))]
        extra = tuple(self.rng.randint(0, 5) for _ in range(self.rng.randint(0, 4 * ps + 2)))
        tokens = (prefix + extra)[: 6 * ps + 3]
        if len(tokens) < 2:
            tokens = (*tokens, 7, 8)
        self.seqs = [*self.seqs[-11:], tokens]
        return tokens

    def step(self) -> None:
        rng, apply = self.rng, self.system.apply
        kinds = ["start"] * 5 + ["finish"] * 3 + ["unfinished", "abort", "match", "evict", "evict_host"]
        kinds += ["prefetch"] * 3 + ["progress"] * 3 + ["abort_prefetch", "clock"]
        kinds += ["events"] * 4 + ["complete"] * 5 + ["push_down"] + (["fault"] if self.faults else [])
        kind = rng.choice(kinds)
        if kind in ("finish", "unfinished", "abort") and not self.running:
            kind = "start"
        if kind in ("progress", "abort_prefetch") and not self.prefetching:
            kind = "prefetch"
        if kind == "start" and len(self.running) >= 3:
            kind = "finish"
        if kind == "prefetch" and len(self.prefetching) >= 3:
            kind = "progress"
        if kind == "start":
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            if getattr(apply(StartRequest(rid, self.tokens())), "admitted", False):
                self.running.add(rid)
        elif kind in ("finish", "unfinished", "abort"):
            rid = rng.choice(sorted(self.running))
            make: dict[str, Callable[[int], Op]] = {
                "finish": FinishRequest,
                "unfinished": CacheUnfinishedRequest,
                "abort": AbortRequest,
            }
            apply(make[kind](rid))
            if kind != "unfinished":
                self.running.discard(rid)
        elif kind == "match":
            apply(MatchPrefix(self.tokens()))
        elif kind == "evict":
            apply(Evict(rng.randint(0, 12)))
        elif kind == "evict_host":
            apply(EvictHost(rng.randint(0, 12)))
        elif kind == "prefetch":
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            if getattr(apply(PrefetchFromStorage(rid, self.tokens())), "admitted", False):
                self.prefetching.add(rid)
        elif kind == "progress":
            rid = rng.choice(sorted(self.prefetching))
            if getattr(apply(CheckPrefetchProgress(rid)), "done", False):
                self.prefetching.discard(rid)
        elif kind == "abort_prefetch":
            rid = rng.choice(sorted(self.prefetching))
            apply(AbortPrefetch(rid))
            self.prefetching.discard(rid)
        elif kind == "clock":
            apply(AdvanceClock(rng.choice((100, 1_000, 50_000))))
        elif kind == "events":
            apply(CheckHicacheEvents())
        elif kind == "complete":
            apply(CompleteIO(rng.choice(list(IOQueue)), rng.randrange(self.cfg.tp_size), rng.randint(1, 3)))
        elif kind == "push_down":
            # Everything to L3 and out of L1/L2, then a prefetch of an earlier sequence: host-only inserts.
            self.quiesce()
            apply(Evict(10_000))
            apply(EvictHost(10_000))
            rid, self.next_rid = self.next_rid, self.next_rid + 1
            if getattr(apply(PrefetchFromStorage(rid, rng.choice(self.seqs))), "admitted", False):
                self.prefetching.add(rid)
        elif kind == "fault" and self.cfg.enable_storage:
            kind_ = rng.choice([FaultKind.CORRUPT, FaultKind.DELETE, FaultKind.FAIL_NEXT_READ])
            apply(StorageFault(kind_, rng.randrange(self.cfg.tp_size), rng.randint(0, 20)))

    def quiesce(self) -> None:
        """Finish every request, run every queue dry and retire everything."""
        apply = self.system.apply
        for rid in sorted(self.running):
            apply(FinishRequest(rid))
        self.running.clear()
        for round_ in range(8):
            for queue in IOQueue:
                for rank in range(self.cfg.tp_size):
                    apply(CompleteIO(queue, rank, 1_000_000))
            apply(CheckHicacheEvents())
            for rid in sorted(self.prefetching):
                obs = apply(AbortPrefetch(rid) if round_ >= 3 else CheckPrefetchProgress(rid))
                if getattr(obs, "done", True):
                    self.prefetching.discard(rid)


def tree_view(snap: RankSnapshot) -> tuple[object, ...]:
    """What two ranks must agree on, without slot numbers, rank-local progress or the L3 view."""
    nodes = tuple(
        (n.id, n.key_len, n.state, n.hash_value, n.lock_ref, n.host_ref_counter, n.hit_count, n.priority,
         n.in_flight, n.evictable_leaf, n.host_leaf)
        for n in snap.nodes
    )  # fmt: skip
    prefetch = tuple((p.rid, p.anchor, p.tokens, p.hit_pages) for p in snap.ongoing_prefetch)
    return (
        nodes,
        snap.evictable_size,
        snap.protected_size,
        snap.ongoing_write_through,
        snap.ongoing_load_back,
        snap.ongoing_backup,
        prefetch,
        snap.prefetch_tokens_occupied,
        snap.requests,
        len(snap.device.free),
        len(snap.host.free),
        snap.queues,
    )


def gloo_worker(
    rank: int, init_file: str, l3_dir: str, out_dir: str, config_json: str, seed: int, steps: int
) -> None:
    """One process of the multi-process test: its rank of ``HiCacheImpl`` over gloo, the threads executor,
    the seeded program, quiesce; writes its tree view, collective log and invariant violations."""
    import torch.distributed as dist

    config = HiCacheConfig.from_json(json.loads(config_json))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=config.tp_size)
    try:
        comm = TorchDistributedCommunicator()
        with HiCacheImpl(config, l3_dir, executor="threads", communicator=comm) as impl:
            program = RandomProgram(impl, seed, faults=True)
            for _ in range(steps):
                program.step()
            program.quiesce()
            snap = impl.snapshot()
            result = {
                "view": tree_view(snap.ranks[0]),
                "log": list(comm.log),
                "violations": [str(v) for v in check_all(snap)],
                "flushed": getattr(impl.apply(Reset()), "flushed", None),
                "steps": len(program.seqs),
            }
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()
