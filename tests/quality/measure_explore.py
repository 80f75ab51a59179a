"""Measure ``refcache explore`` against the bug zoo: each HiCache zoo bug (``tests/quality/zoo.py``), injected
into the implementation, hunted by a lock-step exploration (model and implementation) of one small
configuration, and the depth of the shortest counterexample it finds; the table of specs/exploration.md.

    python -m tests.quality.measure_explore [SLUG ...] [--seconds S] [--depth N] [--from TRACE]
    python -m tests.quality.measure_explore --hunt [SLUG ...] [--seconds S]   # each on its own smallest space
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

from refcache.check.enabled import Bounds
from refcache.check.explore import Space, explore
from refcache.config import EvictionPolicy, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.hicache import FAMILY as HICACHE
from refcache.hicache.ops import FaultKind, Op

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
        {**NO_L3, "device_size": 1, "hicache_ratio": 1.0},
        ((1,), (2,), (3,)),
        "a load back that must evict the device while the host is full: no L3, one device page (so two host pages), three pages' worth of sequences: the page loaded, a host page to fill the host, a device page to evict",
        token_symmetry=True,
    ),
    "write-back-failed-backup-as-done": Hunt(
        {**NO_L3, "device_size": 1, "hicache_ratio": 1.0},
        ((1,), (2,), (3,)),
        "a write-back eviction that finds no host page and none to evict: no L3, one device page (so two host pages), three pages' worth of sequences",
        token_symmetry=True,
    ),
    "prefetch-host-under-device-node": Hunt(
        {},
        ((1,), (1, 2)),
        "a prefetch of (1, 2) from L3 and a request inserting (1,) on the device meanwhile: L3, two sequences",
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
}


def hunt(slugs: list[str], seconds: float, depth: int, start: str | None = None) -> None:
    """Each bug of HUNTS on its own space, lock step breadth first until ``seconds`` run out; from the state
    trace ``start`` reaches when given (its configuration, with the hunt's on top)."""
    base: HiCacheConfig = BASE
    prefix: tuple[Op, ...] = ()
    if start:
        traced, ops = HICACHE.read_trace(start)
        base, prefix = traced, tuple(ops)
    for slug, h in HUNTS.items():
        if slugs and slug not in slugs:
            continue
        bug = next(b for b in ZOO if b.slug == slug)
        config = dataclasses.replace(base, **h.config).resolve()  # type: ignore[arg-type]
        bounds = Bounds(h.sequences, fault_kinds=h.faults, matches=h.matches)
        space = Space(config, bounds, token_symmetry=h.token_symmetry, prefix=prefix)
        started = time.perf_counter()
        with bug.applied():
            result = explore(space, depth=depth, against=("model", "impl"), seconds=seconds)
        spent = time.perf_counter() - started
        cx = result.counterexample
        levels = ", ".join(f"{lv.depth}: {lv.transitions:,} in {lv.seconds:.0f} s" for lv in result.levels)
        print(
            f"{slug}: {'not found' if cx is None else f'depth {cx.depth - len(prefix)}'}"
            f"{f' after the {len(prefix)} operations of {start}' if prefix else ''}; lock step exhaustive to "
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
    parser.add_argument("--lockstep-ratios", action="store_true", help="the lock step's ways side by side")
    args = parser.parse_args()
    if args.hunt:
        hunt(args.slugs, args.seconds, args.depth, args.start)
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
