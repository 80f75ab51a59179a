"""Measure ``refcache explore`` against the bug zoo: each HiCache zoo bug (``tests/quality/zoo.py``), injected
into the implementation, hunted by a lock-step exploration (model and implementation) of one small
configuration, and the depth of the shortest counterexample it finds; the table of specs/exploration.md.

    python -m tests.quality.measure_explore [SLUG ...] [--seconds S] [--depth N] [--from TRACE]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from refcache.check.enabled import Bounds
from refcache.check.explore import Space, explore
from refcache.config import HiCacheConfig, PrefetchPolicy, WritePolicy
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("slugs", nargs="*")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--from", dest="start", help="a trace whose state the search starts from")
    args = parser.parse_args()
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
