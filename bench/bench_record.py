"""Overhead of the SGLang recorder: N requests of the Mooncake head through the driver (refcache.sim's
scheduler loop on SGLang 0.5.20's HiRadixCache), with and without the recorder, alternating, medians.

    PYTHONPATH=. python bench/bench_record.py [N] [ROUNDS]

Prints the median seconds of each, the per-request overhead and the ratio. Runs the SGLang side only when
sglang imports; otherwise says so."""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")  # before refcache.gpu loads (specs/data-plane.md)

from refcache.config import PROFILES, HiCacheConfig
from refcache.sim import SimOptions, Workload, simulate
from refcache.systems import open_systems

HEAD = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_conversation_head300.jsonl"


def main(n: int = 100, rounds: int = 5) -> None:
    if importlib.util.find_spec("sglang") is None:
        print("sglang does not import here: nothing to measure (run in the sglang venv, nox -s sglang)")
        return
    from refcache.engines.sglang.record import record

    config = HiCacheConfig(device_size=4096, page_size=16).with_fidelity(PROFILES["sglang-0.5.20"])
    workload = Workload.from_trace(HEAD, block_tokens=16, limit=n)
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            for on in (False, True):
                with open_systems(["sglang"], config) as systems:
                    system = systems["sglang"]
                    started = time.perf_counter()
                    if on:
                        with record(system, Path(tmp) / "run.jsonl"):
                            simulate(workload, config, SimOptions(audit_every=0), system=system)
                    else:
                        simulate(workload, config, SimOptions(audit_every=0), system=system)
                    times[on].append(time.perf_counter() - started)
    off, on_ = statistics.median(times[False]), statistics.median(times[True])
    print(f"{n} requests, {rounds} alternating rounds: without {off:.3f} s, with the recorder {on_:.3f} s")
    print(f"overhead {1e3 * (on_ - off) / n:.3f} ms per request, ratio {on_ / off:.3f}")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
