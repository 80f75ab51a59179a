"""Model throughput: match + insert, and eviction cost against tree size (10^3 vs 10^5 tokens).

The claim under test: evicting k tokens costs O(k log n) — the leaf heaps are maintained incrementally —
so the cost of one ``Evict(k)`` barely changes between a tree of 10^3 and one of 10^5 tokens. Both trees
are measured side by side in one run (interleaved rounds, median), and the report is the ratio.

    python bench/bench_model.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

from refcache.config import HiCacheConfig
from refcache.model import HiCacheModel
from refcache.ops import Evict, FinishRequest, MatchPrefix, StartRequest

SEQ = 16  # tokens per inserted sequence (one leaf each)
K = 64  # tokens evicted per Evict call


def build(tokens: int) -> tuple[HiCacheModel, float]:
    """A tree of ``tokens`` tokens in leaves of SEQ tokens; returns it and the insert rate (requests/s)."""
    m = HiCacheModel(HiCacheConfig(device_size=4 * tokens, hicache_ratio=2.0))
    start = time.perf_counter()
    for i in range(tokens // SEQ):
        seq = (i, *range(1, SEQ))  # distinct first token: one leaf per sequence under the root
        m.apply(StartRequest(i, seq))
        m.apply(FinishRequest(i))
    return m, (tokens // SEQ) / (time.perf_counter() - start)


def match_rate(m: HiCacheModel, tokens: int, n: int = 2000) -> float:
    start = time.perf_counter()
    for i in range(n):
        m.apply(MatchPrefix((i % (tokens // SEQ), *range(1, SEQ))))
    return n / (time.perf_counter() - start)


def evict_cost(m: HiCacheModel, next_rid: list[int]) -> float:
    """Time one ``Evict(K)``, then insert K fresh tokens (untimed) so the tree keeps its size."""
    start = time.perf_counter()
    m.apply(Evict(K))
    elapsed = time.perf_counter() - start
    for _ in range(K // SEQ):
        rid = next_rid[0] = next_rid[0] + 1
        m.apply(StartRequest(rid, (rid, *range(1, SEQ))))
        m.apply(FinishRequest(rid))
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    small, insert_small = build(1_000)
    large, insert_large = build(100_000)
    match_small, match_large = match_rate(small, 1_000), match_rate(large, 100_000)
    costs: dict[str, list[float]] = {"1e3": [], "1e5": []}
    next_rid = [10**6]
    for _ in range(args.rounds):  # interleaved so both sizes see the same machine noise
        for _ in range(5):
            costs["1e3"].append(evict_cost(small, next_rid))
            costs["1e5"].append(evict_cost(large, next_rid))
    med = {k: statistics.median(v) for k, v in costs.items()}
    print(f"{'tree':>6} {'insert req/s':>13} {'match/s':>9} {'evict ' + str(K) + ' tokens':>18}")
    print(f"{'1e3':>6} {insert_small:>13.0f} {match_small:>9.0f} {med['1e3'] * 1e6:>15.1f} us")
    print(f"{'1e5':>6} {insert_large:>13.0f} {match_large:>9.0f} {med['1e5'] * 1e6:>15.1f} us")
    print(
        f"evict cost ratio 1e5/1e3 = {med['1e5'] / med['1e3']:.2f} (tree 100x larger; linear scan would be ~100x)"
    )


if __name__ == "__main__":
    main()
