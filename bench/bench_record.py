"""Overhead of the SGLang recorder: N requests of the Mooncake head through the driver (refcache.sim's
scheduler loop on SGLang 0.5.20's HiRadixCache), with and without the recorder, alternating, medians.

    PYTHONPATH=. python bench/bench_record.py [N] [ROUNDS] [--l3] [--engine sglang-unified]

``--l3``: with L3 (SGLang's HiCacheFile, write_through) over a Mooncake-format trace of six 40-block
documents requested in turn, so that L1 and L2 evict them and later requests' prefetches query and read
them from L3 (the head's first requests share no page): every storage step goes through the recorder's
hooks.

``--engine sglang-unified``: SGLang's UnifiedRadixCache (0.5.19 to 0.5.23) instead, under its profile.

Prints the median seconds of each, the per-request overhead and the ratio. Runs the SGLang side only when
sglang imports; otherwise says so."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")  # before refcache.gpu loads (specs/data-plane.md)

from refcache.config import PROFILES, HiCacheConfig, WritePolicy
from refcache.sim import SimOptions, Workload, simulate
from refcache.systems import SYSTEMS, open_systems

HEAD = Path(__file__).resolve().parents[1] / "tests" / "data" / "mooncake_conversation_head300.jsonl"


def _documents(path: Path, n: int) -> None:
    """``n`` requests over six 40-block documents in turn (a Mooncake-format trace)."""
    lines = [
        {
            "timestamp": i * 1000,
            "input_length": 40 * 512,
            "output_length": 8,
            "hash_ids": list(range(d, d + 40)),
        }
        for i, d in enumerate(1000 * (i % 6) for i in range(n))
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def main(n: int = 100, rounds: int = 5, l3: bool = False, engine: str = "sglang") -> None:
    if importlib.util.find_spec("sglang") is None:
        print("sglang does not import here: nothing to measure (run in the sglang venv, nox -s sglang)")
        return
    from refcache.engines.sglang.record import record

    profile = PROFILES[SYSTEMS[engine].followed() or "sglang-0.5.20"]  # the installed release's
    times: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        if l3:
            config = HiCacheConfig(
                device_size=1024,
                hicache_ratio=1.2,
                page_size=16,
                hicache_write_policy=WritePolicy.WRITE_THROUGH,
                hicache_storage_backend="file",
                prefetch_threshold=16,
            ).with_fidelity(profile)
            _documents(Path(tmp) / "documents.jsonl", n)
            workload = Workload.from_trace(Path(tmp) / "documents.jsonl", block_tokens=16, limit=n)
        else:
            config = HiCacheConfig(device_size=4096, page_size=16).with_fidelity(profile)
            workload = Workload.from_trace(HEAD, block_tokens=16, limit=n)
        for _ in range(rounds):
            for on in (False, True):
                with open_systems([engine], config) as systems:
                    system = systems[engine]
                    started = time.perf_counter()
                    if on:
                        with record(system, Path(tmp) / "run.jsonl"):
                            simulate(workload, config, SimOptions(audit_every=0), system=system)
                    else:
                        simulate(workload, config, SimOptions(audit_every=0), system=system)
                    times[on].append(time.perf_counter() - started)
    off, on_ = statistics.median(times[False]), statistics.median(times[True])
    what = "requests over L3" if l3 else "requests"
    print(
        f"{engine}, {n} {what}, {rounds} alternating rounds: without {off:.3f} s, with the recorder {on_:.3f} s"
    )
    print(f"overhead {1e3 * (on_ - off) / n:.3f} ms per request, ratio {on_ / off:.3f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    engine = args[args.index("--engine") + 1] if "--engine" in args else "sglang"
    numbers = [int(a) for a in args if a.isdecimal()]  # [N [ROUNDS]]
    main(numbers[0] if numbers else 100, numbers[1] if len(numbers) > 1 else 5, "--l3" in args, engine)
