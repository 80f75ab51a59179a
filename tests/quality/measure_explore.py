"""Measure ``refcache explore`` against the bug zoo: each HiCache zoo bug (``tests/quality/zoo.py``), injected
into the implementation, hunted by a lock-step exploration (model and implementation) of one small
configuration, and the depth of the shortest counterexample it finds; the table of specs/exploration.md.

    python -m tests.quality.measure_explore [SLUG ...] [--seconds S] [--depth N] [--from TRACE]
    python -m tests.quality.measure_explore --hunt [SLUG ...] [--seconds S]   # each on its own smallest space
    python -m tests.quality.measure_explore --hunt --from-start [--narrow] [SLUG ...]   # without its prefix
    python -m tests.quality.measure_explore --lockstep-ratios [--depth N]     # the lock step's ways, side by side

The lock step copies KV with the direct (torch) I/O backend: the Triton kernels, interpreted on the CPU, are
checked against it row by row elsewhere (tests/gpu/test_transfer.py) and cost half the lock step's time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
import time

from refcache.check.enabled import MAX_PREFETCHING, MAX_RUNNING, Bounds
from refcache.check.explore import Space, explore
from refcache.config import EvictionPolicy, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import (
    CheckHicacheEvents,
    CompleteIO,
    Evict,
    EvictHost,
    FaultKind,
    FinishRequest,
    IOQueue,
    Op,
    StartRequest,
)

from .zoo import ZOO

BASE = HiCacheConfig(
    page_size=1,
    device_size=2,
    hicache_ratio=2.0,
    hicache_write_policy=WritePolicy.WRITE_BACK,
    hicache_storage_backend="file",
    prefetch_threshold=1,
    prefetch_timeout_base=0.001,
    prefetch_timeout_per_ki_token=0.1024,
    load_back_threshold=1,
    storage_batch_size=1,
    hicache_io_backend=IOBackend.DIRECT,
)
SEQUENCES = ((1,), (1, 2))
# The configuration each bug needs on top of BASE (the zoo's notes say which); None: not expressible on a
# one-rank configuration of two device pages.
NEEDS: dict[str, dict[str, object] | None] = {
    "collective-skipped-when-queues-empty": {"tp_size": 2},
    "prefetch-progress-early-return": {
        "tp_size": 2,
        "hicache_storage_prefetch_policy": PrefetchPolicy.WAIT_COMPLETE,
    },
    "split-loses-write-through-fragment": {"hicache_write_policy": WritePolicy.WRITE_THROUGH},
    "wait-complete-on-empty-hashes": {"hicache_storage_prefetch_policy": PrefetchPolicy.WAIT_COMPLETE},
}


@dataclasses.dataclass(frozen=True)
class Hunt:
    """The smallest space that can express a bug the default one does not reach: the configuration on top of
    BASE, the alphabet, and why (specs/exploration.md's table)."""

    config: dict[str, object]
    sequences: tuple[tuple[int, ...], ...]
    why: str
    faults: tuple[FaultKind, ...] = ()
    token_symmetry: bool = False
    matches: bool = False
    # Operations the search starts after (a state the bounded alphabet cannot reach, or reaches only deep:
    # the depth found counts after them); ``--from`` replaces them, ``--from-start`` drops them.
    prefix: tuple[Op, ...] = ()
    prompt_lens: tuple[int, ...] = ()  # Bounds.prompt_lens
    without: frozenset[str] = frozenset()  # Bounds.without: operation classes the bug needs none of
    max_running: int = MAX_RUNNING
    max_prefetching: int = MAX_PREFETCHING

    def bounds(self) -> Bounds:
        """The hunt's alphabet."""
        return Bounds(
            self.sequences,
            fault_kinds=self.faults,
            matches=self.matches,
            prompt_lens=self.prompt_lens,
            without=self.without,
            max_running=self.max_running,
            max_prefetching=self.max_prefetching,
        )


# A state where the page of (1,) lies only in L3, on every rank of ``ranks``: written back, backed up (each
# rank's backup acknowledged), evicted from the host (test_explore_zoo.py's ONLY_IN_L3, for one rank).
def only_in_l3(ranks: int = 1) -> tuple[Op, ...]:
    backups = tuple(CompleteIO(IOQueue.BACKUP, rank, 1) for rank in range(ranks))
    return (StartRequest(0, (1,)), FinishRequest(0), Evict(1), *backups, CheckHicacheEvents(), EvictHost(1))


# The same for the two-page sequence (1, 2), one rank.
def only_in_l3_pair() -> tuple[Op, ...]:
    return (
        StartRequest(0, (1, 2)),
        FinishRequest(0),
        Evict(2),
        CompleteIO(IOQueue.BACKUP, 0, 1),
        CheckHicacheEvents(),
        EvictHost(2),
    )


# ``--narrow``: operation classes none of the prefixed hunts' traces uses left out, one request and one
# prefetch at a time: the space a hunt from the initial state (``--from-start``) can finish deeper.
NARROW: dict[str, object] = {
    "without": frozenset({"AbortRequest", "CacheUnfinishedRequest", "Reset", "AbortPrefetch"}),
    "max_running": 1,
    "max_prefetching": 1,
}

NO_L3: dict[str, object] = {"hicache_storage_backend": None}
HUNTS: dict[str, Hunt] = {
    "eviction-ignores-priority": Hunt(
        {**NO_L3, "radix_eviction_policy": EvictionPolicy.MRU},
        ((1,), (2,)),
        "two leaves whose creation order and MRU order disagree: no L3, two one-token sequences",
        token_symmetry=True,
    ),
    "missing-per-layer-wait": Hunt(NO_L3, ((1,),), "a load back, then a read: no L3, one sequence"),
    "host-pages-freed-under-load": Hunt(
        {**NO_L3, "device_size": 1, "hicache_ratio": 1.0, "radix_eviction_policy": EvictionPolicy.MRU},
        ((1,), (2,), (3,)),
        "a load back whose nested eviction (write-back -> write_backup -> evict_host) must choose between the "
        "page being loaded and another host leaf: no L3, one device page (so two host pages), three one-token "
        "sequences (two on the host, one on the device), MRU so that the page the request just matched is the "
        "host's first victim (LRU takes the other leaf first, with or without the pin: the bug needs "
        "evict_host to want more than the other leaves hold, hence longer nodes and more pages)",
        token_symmetry=True,
    ),
    "write-back-failed-backup-as-done": Hunt(
        {"device_size": 1, "hicache_ratio": 1.0},
        ((1,), (2,), (3,)),
        "a write-back eviction that finds no host page and none to evict: L3 (a pending backup pins its host "
        "page until acknowledged), one device page (so two host pages, both pinned), three one-token "
        "sequences; without L3 a host page is pinned only while it is loaded back",
        token_symmetry=True,
    ),
    "prefetch-host-under-device-node": Hunt(
        {"storage_batch_size": 2},
        ((1,), (1, 2)),
        "a prefetch of (1, 2) from L3 and a request inserting (1,) on the device meanwhile: L3, two sequences, "
        "a storage batch of 2 pages (one read job fetches both: with 1, one more CompleteIO), from the state "
        "where (1, 2) lies only in L3",
        prefix=only_in_l3_pair(),
    ),
    "l3-checksum-ignored": Hunt(
        {},
        ((1,),),
        "a damaged L3 object prefetched: L3, one sequence, FLIP_PAYLOAD",
        (FaultKind.FLIP_PAYLOAD,),
    ),
    "prefetch-progress-early-return": Hunt(
        {"tp_size": 2, "hicache_storage_prefetch_policy": PrefetchPolicy.WAIT_COMPLETE},
        ((1,),),
        "ranks that read different amounts: tp 2, wait_complete, one rank's object deleted",
        (FaultKind.DELETE,),
    ),
    "prefetch-hits-reduced-by-max": Hunt(
        {"tp_size": 2},
        ((1,),),
        "ranks whose L3 views differ at the hit query: tp 2, one sequence, one rank's object deleted, from the "
        "state where the page lies only in L3 on both ranks",
        (FaultKind.DELETE,),
        prefix=only_in_l3(2),
    ),
    "prefetch-release-by-min-completed": Hunt(
        {"tp_size": 2},
        ((1,),),
        "a prefetch released while one rank has read its page and the other not: tp 2, one sequence, no fault "
        "(with DELETE the same trace at the same depth, 20 s), from the state where the page lies only in L3 "
        "on both ranks",
        prefix=only_in_l3(2),
    ),
    "load-stream-newest-first": Hunt(
        NO_L3,
        ((1,), (2,)),
        "two loads back in flight, the older completed first: no L3, two one-token sequences",
        token_symmetry=True,
    ),
    "prefetch-anchor-not-touched": Hunt(
        {},
        ((1, 2), (3,)),
        "a prefetch of (1, 2) inserting (2,) below the device node (1,), then an eviction that must take the "
        "older device leaf (3,), which a match touched after the prefetch's admission (whose own match "
        "touches the anchor): L3, two sequences, matches; from the state where (1, 2) lies only in L3, (1,) was "
        "evicted, backed up and loaded back (a prefetch needs its anchor backed up: 'last_node_not_backuped' "
        "otherwise), then (3,) computed: both device pages full, (1,) the older",
        matches=True,
        prefix=(
            StartRequest(0, (1, 2)),
            FinishRequest(0),
            Evict(2),
            CompleteIO(IOQueue.BACKUP, 0, 1),
            CheckHicacheEvents(),
            EvictHost(2),
            StartRequest(0, (1,)),
            FinishRequest(0),
            Evict(1),
            CompleteIO(IOQueue.BACKUP, 0, 1),
            CheckHicacheEvents(),
            StartRequest(0, (1,)),
            CompleteIO(IOQueue.LOAD, 0, 1),
            CheckHicacheEvents(),
            FinishRequest(0),
            StartRequest(0, (3,)),
            FinishRequest(0),
        ),
    ),
    "split-drops-priority": Hunt(
        {
            **NO_L3,
            "device_size": 3,
            "reinsert_prompt_prefix": True,
            "radix_eviction_policy": EvictionPolicy.PRIORITY,
        },
        ((1, 2, 3), (1,)),
        "a split of a node already at priority 1: no L3, D-24's re-insert under the priority policy, three "
        "device pages, from the initial state: a request for (1, 2, 3) whose prompt is (1, 2) (prompt length "
        "2; its finish raises [1, 2, 3] to priority 1 and splits it at the prompt: [1, 2] keeps priority 1), "
        "then (1,) splits [1, 2]",
        matches=True,
        prompt_lens=(2,),
    ),
}


def hunt(
    slugs: list[str],
    seconds: float,
    depth: int,
    start: str | None = None,
    from_start: bool = False,
    narrow: bool = False,
) -> None:
    """Each bug of HUNTS on its own space, lock step breadth first until ``seconds`` run out; from the state
    trace ``start`` reaches when given (its configuration, with the hunt's on top), from the initial state
    with ``from_start`` (the hunt's prefix dropped: its alphabet must reach that state itself); on the hunt's
    alphabet narrowed by NARROW with ``narrow``."""
    base: HiCacheConfig = BASE
    given: tuple[Op, ...] | None = None
    if start:
        traced, ops = HICACHE.read_trace(start)
        base, given = traced, tuple(ops)
    for slug, h in HUNTS.items():
        if slugs and slug not in slugs:
            continue
        prefix = () if from_start else h.prefix if given is None else given
        if narrow:
            h = dataclasses.replace(h, **NARROW)  # type: ignore[arg-type]
        bug = next(b for b in ZOO if b.slug == slug)
        config = dataclasses.replace(base, **h.config).resolve()  # type: ignore[arg-type]
        space = Space(config, h.bounds(), token_symmetry=h.token_symmetry, prefix=prefix)
        started = time.perf_counter()
        with bug.applied():
            result = explore(space, depth=depth, against=("model", "impl"), seconds=seconds)
        spent = time.perf_counter() - started
        cx = result.counterexample
        origin = start or "the hunt's prefix"
        levels = ", ".join(f"{lv.depth}: {lv.transitions:,} in {lv.seconds:.0f} s" for lv in result.levels)
        print(
            f"{slug}: {'not found' if cx is None else f'depth {cx.depth - len(prefix)}'}"
            f"{f' after the {len(prefix)} operations of {origin}' if prefix else ''}; lock step exhaustive to "
            f"{result.lockstep_depth}; {result.states:,} states, {result.lockstep_transitions:,} transitions "
            f"in lock step, {spent:.0f} s ({levels}); {h.why}",
            flush=True,
        )
        if cx is not None:
            print("  " + " ; ".join(repr(op) for op in cx.ops), "\n  " + " ".join(cx.what.split())[:300])


def lockstep_ratios(depth: int) -> None:
    """The lock step's ways side by side in one run, on BASE with and without L3: the Triton kernels
    (interpreted) and the direct backend with every path replayed checked, and the default (direct, the path
    replayed unchecked, only the transition checked)."""
    for l3 in ("file", None):
        space_of = {
            io: Space(
                dataclasses.replace(BASE, hicache_storage_backend=l3, hicache_io_backend=io).resolve(),
                Bounds(SEQUENCES, matches=False),
            )
            for io in (IOBackend.KERNEL, IOBackend.DIRECT)
        }
        rows = []
        for name, io, check_path, disk in (
            ("kernel, path checked", IOBackend.KERNEL, True, True),
            ("direct, path checked", IOBackend.DIRECT, True, True),
            ("direct, path unchecked", IOBackend.DIRECT, False, True),
            ("direct, path unchecked, L3 on tmpfs", IOBackend.DIRECT, False, False),
        ):
            if l3 is None and not disk:
                continue
            if disk:  # a TMPDIR keeps the L3 directories where it says (explore._scratch_on_tmpfs)
                os.environ["TMPDIR"] = tempfile.gettempdir()
            else:
                os.environ.pop("TMPDIR", None)
            wall, cpu = time.perf_counter(), time.process_time()
            result = explore(space_of[io], depth=depth, against=("model", "impl"), check_path=check_path)
            rows.append(
                (name, result.lockstep_transitions, time.perf_counter() - wall, time.process_time() - cpu)
            )
        os.environ.pop("TMPDIR", None)
        base, base_wall = rows[0][3], rows[0][2]
        for name, transitions, wall, cpu in rows:
            print(
                f"L3 {l3 or 'off'}, depth {depth}, {name}: {transitions:,} transitions, {wall:.1f} s wall "
                f"(x{base_wall / wall:.2f}), {cpu:.1f} s CPU (x{base / cpu:.2f}), "
                f"{1e3 * cpu / transitions:.1f} ms CPU a transition",
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("slugs", nargs="*")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--from", dest="start", help="a trace whose state the search starts from")
    parser.add_argument("--hunt", action="store_true", help="each bug of HUNTS on its own smallest space")
    parser.add_argument("--from-start", action="store_true", help="hunt from the initial state, no prefix")
    parser.add_argument("--narrow", action="store_true", help="the hunt's alphabet narrowed by NARROW")
    parser.add_argument("--lockstep-ratios", action="store_true", help="the lock step's ways side by side")
    args = parser.parse_args()
    if args.hunt:
        hunt(args.slugs, args.seconds, args.depth, args.start, args.from_start, args.narrow)
        return
    if args.lockstep_ratios:
        lockstep_ratios(args.depth)
        return
    base = BASE
    prefix: tuple[Op, ...] = ()
    if args.start:
        base, ops = HICACHE.read_trace(args.start)
        prefix = tuple(ops)
    for bug in ZOO:
        if bug.family != "hicache" or (args.slugs and bug.slug not in args.slugs):
            continue
        needs = NEEDS.get(bug.slug, {})
        if needs is None:
            print(f"| `{bug.slug}` | not expressible: {bug.notes} | — | — |", flush=True)
            continue
        config = dataclasses.replace(base, **needs).resolve()  # type: ignore[arg-type]
        namespaces: tuple[str | None, ...] = (None, "lora-a") if "namespace" in bug.slug else (None,)
        faults = (FaultKind.FLIP_PAYLOAD,) if bug.faulty else ()
        space = Space(config, Bounds(SEQUENCES, namespaces=namespaces, fault_kinds=faults), prefix=prefix)
        started = time.perf_counter()
        with bug.applied():
            result = explore(space, depth=args.depth, against=("model", "impl"), seconds=args.seconds)
        spent = time.perf_counter() - started
        cx = result.counterexample
        what = "" if cx is None else " ".join(cx.what.split())[:240]
        found = "not found" if cx is None else f"depth {cx.depth - len(prefix)}: {what}"
        print(
            f"| `{bug.slug}` | {found} | {result.lockstep_depth} | {result.states:,} | {spent:.0f} |"
            + ("" if cx is None else " " + " ; ".join(repr(op) for op in cx.ops[len(prefix) :])),
            flush=True,
        )


if __name__ == "__main__":
    main()
