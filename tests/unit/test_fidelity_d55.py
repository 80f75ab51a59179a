"""D-55, ``prefetch_timeout_from_first_poll`` (SGLang 0.5.23): under the ``timeout`` prefetch policy a prefetch's
budget starts at its first progress check that cannot finish it (``_StoragePrefetchWait``, a ``PollTimer``,
``unified_radix_cache.py`` 0.5.23:182, :2259-2292) and counts the pages it asked for, not its hits; up to 0.5.22
(and in refcache, D-26 / D-39) it runs from the prefetch's start. A request whose prefetch ended on that verdict has
its later prefetches declined until its admission (or abort) ends the wait. Both ways, on the model."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from refcache.config import FIDELITY_OPTIONS, PROFILES, HiCacheConfig, IOBackend, PrefetchPolicy, WritePolicy
from refcache.errors import UnsupportedError
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
    Observation,
    Op,
    PrefetchFromStorage,
    PrefetchResult,
    ProgressResult,
    StartRequest,
)
from refcache.model import HiCacheModel

A = tuple(range(1, 9))
TO_L3: Sequence[Op] = (
    StartRequest(1, A),
    FinishRequest(1),
    CompleteIO(IOQueue.WRITE, 0, 8),
    CheckHicacheEvents(),  # the write-through ack starts the backup
    CompleteIO(IOQueue.BACKUP, 0, 8),
    CheckHicacheEvents(),
    Evict(1000),
    EvictHost(1000),  # A is in L3 only
)
BASE_US = 1_000_000
# 0.5.23's budget for A's 8 requested pages of one token: 1 s + 8 * (1 / 1024 * 0.25 s) = 1.001953125 s
BUDGET_US = 1_001_953


def _config(policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT, **options: bool) -> HiCacheConfig:
    """0.5.23's profile (D-55 on) with ``options``, the ``timeout`` policy by default."""
    return HiCacheConfig(
        device_size=16,
        page_size=1,
        hicache_io_backend=IOBackend.DIRECT,
        load_back_threshold=1,
        hicache_write_policy=WritePolicy.WRITE_THROUGH,
        hicache_storage_backend="file",
        hicache_storage_prefetch_policy=policy,
        prefetch_threshold=1,
        prefetch_timeout_base=BASE_US / 1_000_000,
        prefetch_timeout_per_ki_token=0.25,
    ).with_fidelity({**PROFILES["sglang-0.5.23"], **options})


def _run(config: HiCacheConfig, ops: Sequence[Op]) -> list[Observation]:
    with HiCacheModel(config) as model:
        return [model.apply(op) for op in ops]


PAST_THE_START: Sequence[Op] = (
    *TO_L3,
    PrefetchFromStorage(2, A),  # its hit query has not run: no hits, no host memory
    AdvanceClock(BASE_US + 1),  # past the base from the prefetch's start
    CheckPrefetchProgress(2),
)


def test_the_option_is_followed_from_0_5_23() -> None:
    assert FIDELITY_OPTIONS["D-55"] == "prefetch_timeout_from_first_poll"
    assert PROFILES["sglang-0.5.23"]["prefetch_timeout_from_first_poll"]
    for profile in (
        "sglang-0.5.22",
        "sglang-0.5.21",
        "sglang-0.5.20-unified",
        "sglang-0.5.19-unified",
        "refcache",
    ):
        assert not PROFILES[profile]["prefetch_timeout_from_first_poll"], profile


def test_the_timeout_runs_from_the_first_blocked_check_not_from_the_start() -> None:
    # up to 0.5.22: the base has passed since the prefetch started, so the first check ends it (revoked)
    assert _run(_config(prefetch_timeout_from_first_poll=False), PAST_THE_START)[-1] == ProgressResult(
        True, 0
    )
    # 0.5.23: that first check only starts the wait, whose budget counts the 8 pages asked for
    ops = [
        *PAST_THE_START,
        AdvanceClock(BUDGET_US),  # 1.001953 s < 1.001953125 s since the first check
        CheckPrefetchProgress(2),
        AdvanceClock(1),
        CheckPrefetchProgress(2),
    ]
    obs = _run(_config(), ops)
    assert obs[-5] == ProgressResult(False, 0) and obs[-3] == ProgressResult(False, 0)
    assert obs[-1] == ProgressResult(True, 0)


TIMED_OUT: Sequence[Op] = (
    *TO_L3,
    PrefetchFromStorage(2, A),
    CheckPrefetchProgress(2),  # the wait starts
    AdvanceClock(BUDGET_US + 1),
    CheckPrefetchProgress(2),  # terminated on its timeout verdict: the wait is marked expired
)


def test_a_timed_out_request_is_declined_until_its_admission_or_abort() -> None:
    obs = _run(_config(), [*TIMED_OUT, PrefetchFromStorage(2, A)])
    assert obs[-2] == ProgressResult(True, 0)
    assert obs[-1] == PrefetchResult(False, "deadline_expired", len(A))
    admitted = _run(
        _config(), [*TIMED_OUT, StartRequest(2, A[:2]), FinishRequest(2), PrefetchFromStorage(2, A[2:])]
    )
    assert admitted[-1] == PrefetchResult(True, "admitted", len(A) - 2)
    aborted = _run(_config(), [*TIMED_OUT, AbortPrefetch(2), PrefetchFromStorage(2, A)])
    assert aborted[-1] == PrefetchResult(True, "admitted", len(A))
    # without the option nothing remembers the verdict
    assert _run(_config(prefetch_timeout_from_first_poll=False), [*TIMED_OUT, PrefetchFromStorage(2, A)])[
        -1
    ] == PrefetchResult(True, "admitted", len(A))


@pytest.mark.parametrize("policy", [PrefetchPolicy.BEST_EFFORT, PrefetchPolicy.WAIT_COMPLETE])
def test_the_other_policies_are_the_same_both_ways(policy: PrefetchPolicy) -> None:
    ops = [
        *TO_L3,
        PrefetchFromStorage(2, A),
        CheckPrefetchProgress(2),
        AdvanceClock(BUDGET_US + 1),
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        CheckHicacheEvents(),
        CompleteIO(IOQueue.PREFETCH_IO, 0, 1),
        CheckHicacheEvents(),
        CheckPrefetchProgress(2),
    ]
    assert _run(_config(policy), ops) == _run(_config(policy, prefetch_timeout_from_first_poll=False), ops)


def test_the_implementation_refuses_it_with_l3() -> None:
    from refcache.gpu.driver import HiCacheImpl

    cfg = HiCacheConfig(hicache_storage_backend="file").with_fidelity(
        {"prefetch_timeout_from_first_poll": True}
    )
    with pytest.raises(UnsupportedError, match="D-55"):
        HiCacheImpl(cfg)
