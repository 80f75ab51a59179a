"""A seeded random operation stream, for benchmarks, soak runs and stress tests.

Unlike the Hypothesis machines this needs no test framework and costs nothing per draw: it is the
workload of ``bench/bench_differential.py`` and of long runs that only check invariants. It keeps just
enough state (running requests, ongoing prefetches, recent token sequences) to produce valid operations,
reuses earlier prefixes and cuts near page boundaries, like the machines.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from refcache.config import HiCacheConfig
from refcache.hicache.ops import (
    AbortPrefetch,
    AdvanceClock,
    CheckHicacheEvents,
    CheckPrefetchProgress,
    CompleteIO,
    Evict,
    EvictHost,
    FinishRequest,
    IOQueue,
    MatchPrefix,
    Op,
    PrefetchFromStorage,
    StartRequest,
)

__all__ = ["random_ops"]


def random_ops(config: HiCacheConfig, count: int, seed: int = 0) -> Iterator[Op]:
    """``count`` valid operations for ``config``; the same seed always gives the same stream.

    Requests are finished by a later ``FinishRequest`` whatever ``StartRequest`` answered: the caller
    reports back nothing, so a finish of a request that was not admitted is an expected ``UsageError``
    that both model and implementation must raise alike.
    """
    rng = random.Random(seed)
    ps = config.page_size
    seqs: list[tuple[int, ...]] = [tuple(range(1, 2 + 3 * ps))]
    running: list[int] = []
    prefetching: list[int] = []
    next_rid = 0
    queues = list(IOQueue)

    def tokens() -> tuple[int, ...]:
        base = rng.choice(seqs)
        cut = rng.randrange(len(base) // ps + 1) * ps + rng.choice((-1, 0, 0, 1))
        seq = base[: max(cut, 0)] + tuple(rng.randrange(8) for _ in range(rng.randrange(1, 3 * ps + 2)))
        seq = seq[: 8 * ps]
        seqs.append(seq)
        if len(seqs) > 16:
            seqs.pop(0)
        return seq if len(seq) >= 2 else (*seq, 9, 9)

    for _ in range(count):
        roll = rng.random()
        if roll < 0.22 and len(running) < 4:
            running.append(next_rid)
            yield StartRequest(next_rid, tokens())
            next_rid += 1
        elif roll < 0.40 and running:
            yield FinishRequest(running.pop(rng.randrange(len(running))))
        elif roll < 0.65:
            yield CompleteIO(rng.choice(queues), rng.randrange(config.tp_size), rng.randint(1, 4))
        elif roll < 0.75:
            yield CheckHicacheEvents()
        elif roll < 0.80 and len(prefetching) < 3:
            prefetching.append(next_rid)
            yield PrefetchFromStorage(next_rid, tokens())
            next_rid += 1
        elif roll < 0.86 and prefetching:
            rid = prefetching[0]
            if rng.random() < 0.8:
                yield CheckPrefetchProgress(rid)
                if rng.random() < 0.5:  # assume done; if not, the entry lingers until a reset
                    prefetching.pop(0)
            else:
                yield AbortPrefetch(rid)
                prefetching.pop(0)
        elif roll < 0.91:
            yield Evict(rng.randint(1, 4 * ps))
        elif roll < 0.94:
            yield EvictHost(rng.randint(1, 4 * ps))
        elif roll < 0.97:
            yield MatchPrefix(tokens())
        else:
            us = rng.choice((100, 10_000, 100_000))
            # with several ranks, sometimes one rank's clock alone (D-41); tp_size 1 streams are unchanged
            yield AdvanceClock(
                us, rank=rng.choice((None, *range(config.tp_size))) if config.tp_size > 1 else None
            )
