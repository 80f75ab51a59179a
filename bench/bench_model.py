"""Model throughput against SGLang's ``RadixCache`` on one request sequence, and eviction cost against tree size.

Workload (``bench/_workload.py``): 1,500 chat requests, ~1.0M tokens — 12 shared system prompts, conversation
turns that extend the previous turn, 8% exact repeats, 5% one-shot requests — generated from a fixed seed.

Three measurements, each a median over ``--rounds`` repetitions that alternate between the two systems in
this one process (so both see the same machine noise); the report is the ratio refcache / SGLang:

1. **tree calls**: ``match_prefix`` + ``insert`` of every request on a fresh tree, no eviction. The model's
   rank (``HiCacheModel(...).ranks[0]``, write_back policy: no L2 traffic on a hit) against
   ``RadixCache.create_simulated``; both get the same per-request value slots. Target: >= 2x.
2. **request loop with device eviction**: the same requests through the model's operation alphabet
   (``StartRequest`` + ``FinishRequest``; write_back, so an evicted node is written to L2 first) against
   ``RadixCache`` over a real token allocator (match, lock, allocate with eviction of the shortfall, insert,
   free the duplicates, unlock), both with a device of 1/8 of the workload's tokens.
3. **evict cost**: one ``Evict(256)`` on a 1M-token tree (the workload's tree, no eviction before), against
   ``RadixCache.evict`` on the same tree; plus the model on a 10^3- against a 10^5-token tree (the claim
   that evicting k tokens costs O(k log n): the ratio stays near 1 although the tree is 100x larger).

The SGLang side runs when ``import sglang`` works in this interpreter (SGLang 0.5.20, e.g.
``nox -s sglang`` environment, ``python bench/bench_model.py``); otherwise the benchmark says so and
reports refcache alone. Torch (SGLang's values) runs with one intra-op thread (``REFCACHE_TORCH_THREADS``).

    python bench/bench_model.py [--rounds 5] [--page-size 1]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _workload import Workload, chat_workload

from refcache.config import HiCacheConfig, WritePolicy
from refcache.hicache.ops import Evict, FinishRequest, StartRequest
from refcache.model import HiCacheModel

SEQ = 16  # tokens per inserted sequence in the 10^3 / 10^5 trees (one leaf each)
K = 64  # tokens evicted per Evict call in the 10^3 / 10^5 comparison
EVICT_BIG = 256  # tokens evicted per call on the 1M-token tree


def _timed(run: Callable[[], float]) -> float:
    gc.collect()
    return run()


def model_tree_calls(w: Workload, ps: int, values: list[list[int]]) -> float:
    cfg = HiCacheConfig(device_size=w.tokens + ps, page_size=ps, hicache_write_policy=WritePolicy.WRITE_BACK)
    rank = HiCacheModel(cfg).ranks[0]
    start = time.perf_counter()
    for tokens, value in zip(w.requests, values, strict=True):
        key = rank.page_aligned(tokens)
        rank.match_prefix(key, None)
        rank.insert(key, value[: len(key)], None, chunked=False)
    return time.perf_counter() - start


def model_request_loop(w: Workload, ps: int, device: int) -> float:
    m = HiCacheModel(
        HiCacheConfig(device_size=device, page_size=ps, hicache_write_policy=WritePolicy.WRITE_BACK)
    )
    start = time.perf_counter()
    for rid, tokens in enumerate(w.requests):
        m.apply(StartRequest(rid, tokens))
        m.apply(FinishRequest(rid))
    return time.perf_counter() - start


def model_big_tree(w: Workload, ps: int) -> HiCacheModel:
    m = HiCacheModel(
        HiCacheConfig(device_size=w.tokens + ps, page_size=ps, hicache_write_policy=WritePolicy.WRITE_BACK)
    )
    for rid, tokens in enumerate(w.requests):
        m.apply(StartRequest(rid, tokens))
        m.apply(FinishRequest(rid))
    return m


def build(tokens: int) -> HiCacheModel:
    """A tree of ``tokens`` tokens in leaves of SEQ tokens."""
    m = HiCacheModel(HiCacheConfig(device_size=4 * tokens, hicache_ratio=2.0))
    for i in range(tokens // SEQ):
        seq = (i, *range(1, SEQ))  # distinct first token: one leaf per sequence under the root
        m.apply(StartRequest(i, seq))
        m.apply(FinishRequest(i))
    return m


def evict_cost(m: HiCacheModel, next_rid: list[int], k: int, refill: bool = True) -> float:
    """Time one ``Evict(k)``, then insert k fresh tokens (untimed) so the tree keeps its size."""
    start = time.perf_counter()
    m.apply(Evict(k))
    elapsed = time.perf_counter() - start
    for _ in range(k // SEQ if refill else 0):
        rid = next_rid[0] = next_rid[0] + 1
        m.apply(StartRequest(rid, (rid, *range(1, SEQ))))
        m.apply(FinishRequest(rid))
    return elapsed


def _line(name: str, ours: list[float], theirs: list[float] | None, unit: str, per: float) -> str:
    """``per / seconds`` rates (or ``seconds * per`` for a cost when unit ends in 's')."""
    if unit.endswith("/s"):
        a = per / statistics.median(ours)
        b = per / statistics.median(theirs) if theirs else None
        cells = f"{a:>10,.0f} {unit:<6}" + (f" {b:>10,.0f} {unit:<6} {a / b:6.2f}" if b else "")
    else:
        a = statistics.median(ours) * per
        b = statistics.median(theirs) * per if theirs else None
        cells = f"{a:>10.3f} {unit:<6}" + (f" {b:>10.3f} {unit:<6} {b / a:6.1f}x faster" if b else "")
    return f"{name:<42} {cells}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=1)
    args = parser.parse_args()
    os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")
    import _sglang

    why_not = _sglang.load()
    w = chat_workload()
    ps = args.page_size
    device = (w.tokens // 8) // ps * ps
    print(f"{w.description}; page size {ps}; request loop device {device:,} tokens")
    if why_not:
        print(f"SGLang side skipped: {why_not}")
    else:
        import torch

        torch.set_num_threads(int(os.environ["REFCACHE_TORCH_THREADS"]))
        print(f"SGLang {_sglang.version()} in this process; torch threads {torch.get_num_threads()}")
    values: list[list[int]] = []
    offset = 0
    for tokens in w.requests:
        values.append(list(range(offset, offset + len(tokens))))
        offset += len(tokens)
    tensors = None
    if not why_not:
        import torch

        tensors = [torch.tensor(v, dtype=torch.int64) for v in values]
    tree: dict[str, list[float]] = {"model": [], "sglang": []}
    loop: dict[str, list[float]] = {"model": [], "sglang": []}
    for _ in range(args.rounds):  # alternate the systems within each round
        tree["model"].append(_timed(lambda: model_tree_calls(w, ps, values)))
        if tensors is not None:
            tree["sglang"].append(_timed(lambda: _sglang.radix_tree_calls(w.requests, tensors, ps)))
        loop["model"].append(_timed(lambda: model_request_loop(w, ps, device)))
        if not why_not:

            def sglang_loop() -> float:
                rl = _sglang.RadixLoop(ps, device)
                start = time.perf_counter()
                for tokens in w.requests:
                    rl.request(tokens)
                return time.perf_counter() - start

            loop["sglang"].append(_timed(sglang_loop))
    # Eviction on the workload's 1M-token tree: model vs RadixCache, alternating calls.
    big = model_big_tree(w, ps)
    evict: dict[str, list[float]] = {"model": [], "sglang": []}
    rl_big = None
    if not why_not:
        rl_big = _sglang.RadixLoop(ps, w.tokens + ps)
        for tokens in w.requests:
            rl_big.request(tokens)
    for _ in range(args.rounds * 4):
        evict["model"].append(evict_cost(big, [0], EVICT_BIG, refill=False))
        if rl_big is not None:
            start = time.perf_counter()
            rl_big.evict(EVICT_BIG)
            evict["sglang"].append(time.perf_counter() - start)
    # The model alone: 10^3 against 10^5 tokens.
    small, large = build(1_000), build(100_000)
    costs: dict[str, list[float]] = {"1e3": [], "1e5": []}
    next_rid = [10**6]
    for _ in range(args.rounds):
        for _ in range(5):
            costs["1e3"].append(evict_cost(small, next_rid, K))
            costs["1e5"].append(evict_cost(large, next_rid, K))
    n = len(w.requests)
    theirs = None if why_not else "SGLang"
    header = f"{'':<42} {'refcache':>17}" + (f" {theirs:>17} {'ratio':>6}" if theirs else "")
    print(header)
    print(_line("match + insert (tree calls)", tree["model"], tree["sglang"] or None, "req/s", n))
    print(_line("request loop with device eviction", loop["model"], loop["sglang"] or None, "req/s", n))
    print(
        _line(
            f"evict {EVICT_BIG} tokens, {w.tokens / 1e6:.1f}M-token tree",
            evict["model"],
            evict["sglang"] or None,
            "ms",
            1e3,
        )
    )
    med = {k: statistics.median(v) for k, v in costs.items()}
    print(
        f"model evict {K} tokens: 1e3-token tree {med['1e3'] * 1e6:.1f} us, 1e5-token tree {med['1e5'] * 1e6:.1f} us, "
        f"ratio {med['1e5'] / med['1e3']:.2f} (tree 100x larger; a linear scan would be ~100x)"
    )


if __name__ == "__main__":
    main()
