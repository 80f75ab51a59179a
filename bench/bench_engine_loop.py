"""The implementation's request loop against SGLang's ``HiRadixCache`` on one request sequence.

Workload (``bench/_workload.py``): the first ``--requests`` (default 1,500) chat requests — 12 shared system
prompts, conversation turns that extend the previous turn, 8% exact repeats — from a fixed seed. Both caches:
one rank, L1 of ``--device`` tokens (default 1/8 of the workload's tokens: device eviction happens) and
L2 twice that, page size ``--page-size``, write_through_selective, the ``direct`` I/O backend, tiny MHA KV
(2 layers x 2 heads x 8 dims, fp16), no L3. One request is: admit (match, load back a host hit, allocate
with eviction of the shortfall, write the computed tokens' KV), finish (insert, free duplicates, unlock),
then the scheduler's ``check_hicache_events``. refcache runs it as ``StartRequest``, ``FinishRequest``,
``CompleteIO`` of the write and load queues and ``CheckHicacheEvents`` through ``HiCacheImpl`` with the
content oracle in each mode (``full``: every read checked, the default of every check; ``sampled``;
``off``); SGLang's copies complete synchronously (``bench/_sglang.py``).

Repetitions alternate between the systems in this one process; the report is medians and the ratio
refcache / SGLang (SGLang's side runs when ``import sglang`` works, e.g.
``nox -s sglang`` environment, ``python bench/bench_engine_loop.py``; otherwise refcache alone), of wall-clock
time and of the process's CPU time (``time.process_time``: on a loaded machine the time a loop waits for a
core is not its own), with the load average at the end.
Torch runs with one intra-op thread (``REFCACHE_TORCH_THREADS``, see ``specs/data-plane.md``).

    python bench/bench_engine_loop.py [--rounds 3] [--requests 1500] [--modes full,sampled,off]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")  # before refcache.gpu (and torch's pool) loads
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workload import chat_workload

from refcache.config import HiCacheConfig, IOBackend, WritePolicy
from refcache.gpu.driver import HiCacheImpl
from refcache.hicache.ops import CheckHicacheEvents, CompleteIO, FinishRequest, IOQueue, StartRequest


def impl_loop(
    requests: tuple[tuple[int, ...], ...], config: HiCacheConfig, oracle: str
) -> tuple[float, float]:
    """``(wall seconds, CPU seconds)`` of the loop."""
    with HiCacheImpl(config, oracle=oracle) as impl:  # type: ignore[arg-type]
        start, cpu = time.perf_counter(), time.process_time()
        for rid, tokens in enumerate(requests):
            impl.apply(StartRequest(rid, tokens))
            impl.apply(FinishRequest(rid))
            impl.apply(CompleteIO(IOQueue.WRITE, 0, 1 << 20))
            impl.apply(CompleteIO(IOQueue.LOAD, 0, 1 << 20))
            impl.apply(CheckHicacheEvents())
        return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--device", type=int, default=0, help="L1 tokens (0: 1/8 of the workload's tokens)")
    parser.add_argument("--modes", default="full,sampled,off")
    args = parser.parse_args()
    import _sglang
    import torch

    why_not = _sglang.load()
    w = chat_workload()
    requests = w.requests[: args.requests]
    tokens = sum(len(r) for r in requests)
    ps = args.page_size
    device = (args.device or tokens // 8) // ps * ps
    config = HiCacheConfig(
        device_size=device,
        page_size=ps,
        hicache_ratio=2.0,
        hicache_io_backend=IOBackend.DIRECT,
        hicache_write_policy=WritePolicy.WRITE_THROUGH_SELECTIVE,
    )
    print(
        f"{len(requests)} requests, {tokens:,} tokens ({w.description}); page size {ps}; L1 {device:,} tokens, "
        f"L2 {config.host_size:,}; torch threads {torch.get_num_threads()}"
    )
    modes = args.modes.split(",")
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in [*modes, "sglang"]}
    if why_not:
        print(f"SGLang side skipped: {why_not}")
        del times["sglang"]
    for _ in range(args.rounds):
        for mode in modes:
            gc.collect()
            times[mode].append(impl_loop(requests, config, mode))
        if not why_not:
            gc.collect()
            loop = _sglang.HiRadixLoop(ps, device)
            start, cpu = time.perf_counter(), time.process_time()
            for r in requests:
                loop.request(r)
            times["sglang"].append((time.perf_counter() - start, time.process_time() - cpu))
            loop.close()
    rate = {name: len(requests) / statistics.median(w for w, _ in t) for name, t in times.items()}
    cpu_rate = {name: len(requests) / statistics.median(c for _, c in t) for name, t in times.items()}
    for name in modes:
        cells = f"impl, oracle {name:<8} {rate[name]:>8,.0f} req/s"
        if "sglang" in rate:
            cells += f"   / HiRadixCache {rate[name] / rate['sglang']:.2f}"
            cells += f"   (CPU time: {cpu_rate[name]:,.0f} req/s, {cpu_rate[name] / cpu_rate['sglang']:.2f})"
        print(cells)
    if "sglang" in rate:
        print(
            f"SGLang {_sglang.version()} HiRadixCache {rate['sglang']:>8,.0f} req/s"
            f"   (CPU time: {cpu_rate['sglang']:,.0f} req/s)"
        )
    print("load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
