"""The SGLang zoo (``sglang_zoo.SGLANG_ZOO``) hunted two ways, shared by ``test_zoo_on_sglang.py`` and the
table generator ``measure_zoo_sglang.py``:

- ``hunt_on_sglang``: the model-versus-SGLang machine (``sglang_machines.sglang_machine``) under the
  ``sglang-0.5.20`` profile, derandomized, over ``refcache.check.budget.DIFFERENTIAL`` (or fewer examples),
  with the bug patched into SGLang; a coverage ledger says which example failed first.
- ``record_patched``: a run of the patched engine over the first requests of the Mooncake head trace
  (``refcache.sim.record``, the driver of ``refcache record``), replayed on the model
  (``refcache.check.recorded``); the step where the recorded run leaves the model.
- ``record_script``: a run of the patched engine over generated operations (``SCRIPTS``: per bug, a few
  operations that reach it), driven with the recorder (``refcache.engines.sglang.record``) on and
  replayed on the model the same way; on two ranks (the bug patched into both rank workers) a run that
  hangs is recorded up to the operation that never returned (``NeverReturned``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from quality.zoo import Bug, first_divergence

from refcache.check import budget
from refcache.check.coverage import Coverage
from refcache.check.harness import Divergence
from refcache.check.machines import KINDS
from refcache.check.recorded import replay_recorded
from refcache.config import PROFILES, EvictionPolicy, HiCacheConfig, PrefetchPolicy, WritePolicy
from refcache.engines.sglang import RankError, SGLangSystem, open_system
from refcache.engines.sglang._tp import rank_setup
from refcache.engines.sglang.record import record
from refcache.hicache.ops import (
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
from refcache.hicache.recording import Recording
from refcache.hicache.trace import read_trace
from refcache.sim.record import record_run

from .sglang_machines import sglang_machine

__all__ = [
    "HEAD",
    "HUNT_KINDS",
    "HUNT_ROWS",
    "RECORD_CONFIGS",
    "SCRIPTS",
    "Hunt",
    "Recorded",
    "Script",
    "applied_everywhere",
    "apply_in_rank",
    "hunt_on_sglang",
    "record_patched",
    "record_script",
    "sglang_ready",
]

HEAD = Path(__file__).resolve().parents[2] / "data" / "mooncake_conversation_head300.jsonl"
PROFILE = PROFILES["sglang-0.5.20"]
BLOCK_TOKENS = 4
"""Simulated tokens per 512-token block of the recorded runs (the longest of the first requests fits L1)."""
MACHINE = "SGLangZooMachine"
"""One class name for every bug: the same derandomized sample of the profile machine."""


def _record_config(policy: WritePolicy, device: int) -> HiCacheConfig:
    return HiCacheConfig(
        device_size=device, hicache_ratio=2.0, page_size=16, hicache_write_policy=policy
    ).with_fidelity(PROFILE)


RECORD_CONFIGS: dict[str, HiCacheConfig] = {
    "write_through": _record_config(WritePolicy.WRITE_THROUGH, 1024),
    "write_back": _record_config(WritePolicy.WRITE_BACK, 1024),
}
"""The recorded runs: ``refcache record``'s configuration with a small L1 (1024 tokens, L2 twice that,
pages of 16) and ``BLOCK_TOKENS`` per trace block, so that the first requests of the head trace evict on both
tiers."""


def sglang_ready() -> None:
    """Import SGLang's modules (behind the adapter's shim) so a zoo patch can resolve its target."""
    SGLangSystem(RECORD_CONFIGS["write_through"]).close()


@dataclass
class Hunt:
    caught: bool
    examples: int  # examples up to and including the first failing one (0: none failed)
    ops: int  # operations of the failing example's trace
    message: str  # the divergence's first line
    trace: Path | None
    detail: str = ""  # what differed first (the divergence's second line)


_L3_ROWS: dict[str, object] = {
    "hicache_storage_backend": "file",
    "hicache_write_policy": WritePolicy.WRITE_THROUGH,
}
HUNT_ROWS: dict[str, dict[str, object]] = {
    "collective-skipped-when-queues-empty": {"tp_size": 2},
    "prefetch-progress-early-return": {
        **_L3_ROWS,
        "tp_size": 2,
        "hicache_storage_prefetch_policy": PrefetchPolicy.TIMEOUT,
    },
    "write-back-failed-backup-as-done": {"hicache_storage_backend": "file"},
    "prefetch-tail-released-twice": _L3_ROWS,
    "wait-complete-on-empty-hashes": _L3_ROWS,
    "l3-keys-ignore-namespace": _L3_ROWS,
    "hash-chain-restarted": _L3_ROWS,
    "prefetch-hits-reduced-by-max": {**_L3_ROWS, "tp_size": 2},
    "prefetch-anchor-not-touched": _L3_ROWS,
}
"""Bugs hunted on some rows of the profile machine. ``collective-skipped-when-queues-empty``: two ranks
(the bug is in the all-reduce between them; ``applied_everywhere`` patches the rank workers).
``prefetch-progress-early-return``: two ranks with L3 under the timeout policy, where the machine moves one
rank's clock at times (D-41), so a prefetch times out on one rank first. On the L3
rows (SGLang's HiCacheFile): the L3 bugs, test_differential.py's L3 machine (write_through: the only L3
rows where SGLang 0.5.20 as shipped does not leave the model, §9 #6, specs/sglang-adapter.md), two ranks for
``prefetch-hits-reduced-by-max`` (the hit counts the all-reduce combines differ only across ranks).
``write-back-failed-backup-as-done``: the same rows without the write_through pin, because a storage backup
pins its host pages until the L3 write acks (write_backup_storage, hiradix_cache.py:958), which is what
leaves write_backup no host memory in a write-back eviction; without L3 the machine does not reach it (not
in 1000 examples). Unpinned, SGLang as shipped leaves the model at example 38 of this sample (a node only
in SGLang after CheckHicacheEvents: what the write_through pin avoids, specs/sglang-adapter.md L3 #4; not
analysed further), after the bug's example 11."""

HUNT_KINDS: dict[str, Mapping[str, int]] = {
    "prefetch-hits-reduced-by-max": {**KINDS, "one_rank_fault": 2},
    "prefetch-anchor-not-touched": {**KINDS, "anchored_prefetch": 2},
    "split-drops-priority": {**KINDS, "split_then_evict": 2},
}
"""Bugs hunted with one operation kind besides ``KINDS`` (``sglang_machine``'s default), the one that builds
the situation exposing the bug (issue #30 items 1 and 5): ``one_rank_fault`` deletes a page of the chain a
prefetch is about to query from one rank's L3 view (the ranks' hit counts differ; the fault-free machine did
not catch the MAX in 150 examples on two ranks with L3), ``anchored_prefetch`` inserts a prefetch below a
non-root anchor and evicts right after, ``split_then_evict`` splits a node of non-zero priority (D-24's
re-insert) and evicts right after. One kind each, not all the macro kinds: each runs a dozen or more
operations on SGLang (``sglang_machine``); each hunt catches its bug within the first examples, and SGLang as
shipped passed 150 examples of each of the three machines (specs/bug-zoo.md)."""


_APPLIED_IN_RANK = contextlib.ExitStack()


def apply_in_rank(slug: str) -> None:
    """The rank workers' set-up hook (``refcache.engines.sglang._tp``, ``rank_setup``): patch ``slug``'s
    counterpart into this worker's SGLang for the worker's life (its pool is keyed on the hook)."""
    from .sglang_zoo import SGLANG_ZOO

    _APPLIED_IN_RANK.enter_context(SGLANG_ZOO[slug].applied())


@contextlib.contextmanager
def applied_everywhere(bug: Bug) -> Iterator[None]:
    """``bug`` patched into SGLang in this process and in the rank workers of two-rank systems opened in the
    block (``apply_in_rank``); those workers end with the block."""
    with rank_setup(f"{__name__}:apply_in_rank:{bug.slug}"), bug.applied():
        yield


def hunt_on_sglang(bug: Bug | None, trace_dir: Path, examples: int | None = None, slug: str = "") -> Hunt:
    """The profile machine with ``bug`` patched in (None: SGLang as shipped, on the rows of ``slug``)."""
    ledger = Coverage()
    slug = bug.slug if bug is not None else slug
    rows, kinds = HUNT_ROWS.get(slug, {}), HUNT_KINDS.get(slug, KINDS)
    hunter = sglang_machine(MACHINE, ledger, kinds, **PROFILE, **rows)
    sglang_ready()
    with applied_everywhere(bug) if bug is not None else contextlib.nullcontext():
        divergence = first_divergence(hunter, examples or budget.DIFFERENTIAL.examples, trace_dir)
    message, detail, *_ = [*divergence.splitlines(), "", ""]
    if detail.startswith(("trace written", "trace not written")):  # a crash: no diff follows
        detail = ""
    trace = trace_dir / f"{hunter.trace_name}.jsonl"
    if not message or not trace.exists():
        return Hunt(False, 0, 0, message, None)
    ops = len(read_trace(trace)[1])
    return Hunt(True, ledger.first_failure, ops, message, trace, detail.strip())


@dataclass
class Recorded:
    caught: bool
    step: int  # the step of the recorded run where the model disagrees (0: none)
    ops: int  # operations recorded
    kind: str
    message: str  # the divergence's first line
    detail: tuple[str, ...] = ()  # what differed: the divergence's next lines
    recording: Recording | None = None
    failed_at: int = 0  # the step whose apply raised RankError while recording (0: none)


def _replayed(recording: Recording, failed_at: int = 0) -> Recorded:
    try:
        replay_recorded(recording)
    except Divergence as error:
        first, *detail = error.summary.splitlines()
        return Recorded(
            True, error.step or 0, len(recording.ops), error.kind, first, tuple(detail), recording, failed_at
        )
    return Recorded(False, 0, len(recording.ops), "", "", (), recording, failed_at)


def record_patched(bug: Bug, out: Path, policy: str, requests: int = 60) -> Recorded:
    config = RECORD_CONFIGS[policy]
    sglang_ready()
    with bug.applied():
        run = record_run(HEAD, out, config, block_tokens=BLOCK_TOKENS, limit=requests, snapshots=True)
    return _replayed(run.recording)


@dataclass(frozen=True)
class Script:
    """Generated operations that reach one bug on SGLang, and where its recorded run leaves the model."""

    config: HiCacheConfig
    ops: tuple[Op, ...]
    step: int  # the step of the recorded run of the patched engine where the model disagrees
    differs: str  # a line of the divergence there: the field (or node, or observation) the bug changes
    kind: str = "snapshots differ"


def _script(
    step: int, differs: str, policy: WritePolicy, *ops: Op, kind: str = "snapshots differ", **config: Any
) -> Script:
    """``config``: what differs from one-token pages and a host pool 1.5 times the device pool."""
    fields = {"page_size": 1, "hicache_ratio": 1.5, **config}
    return Script(
        HiCacheConfig(hicache_write_policy=policy, **fields).with_fidelity(PROFILE), ops, step, differs, kind
    )


def _served(*requests: tuple[int, tuple[int, ...]]) -> tuple[Op, ...]:
    """Each request (rid, tokens) started, then finished, one after the other."""
    return tuple(op for rid, tokens in requests for op in (StartRequest(rid, tokens), FinishRequest(rid)))


def _tokens(first: int, count: int) -> tuple[int, ...]:
    return tuple(range(first, first + count))


_L3: Final[dict[str, Any]] = {
    "hicache_storage_backend": "file",
    "prefetch_threshold": 1,
    "storage_batch_size": 4,
    "device_size": 16,
}
"""The prefetch scripts' L3: a prefetch of any length admitted, eight pages read in two batches."""


def _to_l3(rid: int, tokens: tuple[int, ...]) -> tuple[Op, ...]:
    """A request served, written through to L2, backed up to L3, then dropped from L1 and L2."""
    return (
        *_served((rid, tokens)),
        CompleteIO(IOQueue.WRITE, 0, 1),
        CheckHicacheEvents(),  # the write-through ack queues the backup
        CompleteIO(IOQueue.BACKUP, 0, 1),
        CheckHicacheEvents(),
        Evict(1000),
        EvictHost(1000),
    )


SCRIPTS: dict[str, Script] = {
    "collective-skipped-when-queues-empty": _script(
        4,
        "sglang-0.5.20 (recorded): NeverReturned(rank=0, all_reduce=1, called_from='hiradix_cache.py:226",
        WritePolicy.WRITE_THROUGH,
        *_served((1, (1, 2, 3, 4))),
        CompleteIO(IOQueue.WRITE, 0, 1),  # rank 0's write-through finished, rank 1's not
        CheckHicacheEvents(),  # rank 1 has nothing ready, skips the MIN: rank 0 waits in it for good
        kind="outcomes differ",
        device_size=8,
        hicache_ratio=2.0,
        tp_size=2,
    ),
    "prefetch-progress-early-return": _script(
        15,
        "sglang-0.5.20 (recorded): NeverReturned(rank=0, all_reduce=",
        WritePolicy.WRITE_THROUGH,
        *_served((1, _tokens(1, 8))),
        *(CompleteIO(IOQueue.WRITE, rank, 1) for rank in (0, 1)),
        CheckHicacheEvents(),  # the write-through acks queue the backups
        *(CompleteIO(IOQueue.BACKUP, rank, 1) for rank in (0, 1)),
        CheckHicacheEvents(),
        Evict(1000),
        EvictHost(1000),
        PrefetchFromStorage(2, _tokens(1, 8)),
        *(CompleteIO(IOQueue.PREFETCH_QUERY, rank, 1) for rank in (0, 1)),
        AdvanceClock(20_000, rank=0),  # past the timeout (10 ms + 8 tokens * 0.25 s / 1024) on rank 0 only
        CheckPrefetchProgress(2),  # rank 1 returns before the MAX: rank 0 waits in it for good
        kind="outcomes differ",
        hicache_storage_prefetch_policy=PrefetchPolicy.TIMEOUT,
        prefetch_timeout_base=0.01,
        tp_size=2,
        **_L3,
    ),
    "evict-host-never-counts": _script(
        7,
        "rank 0 node -:[1800, 1801, 1802]: only in model",
        WritePolicy.WRITE_BACK,
        *_served(*((rid, _tokens(rid * 100 + 1000, 3)) for rid in (7, 8, 9)), (10, _tokens(1600, 4))),
        device_size=4,
        radix_eviction_policy=EvictionPolicy.PRIORITY,
    ),
    "host-leaf-predicate-swapped": _script(
        6,
        "rank 0 node -:[6300, 6301].host_leaf: model=False",
        WritePolicy.WRITE_THROUGH,
        *_served((54, (6300,)), (55, (6300, 6301))),
        CompleteIO(IOQueue.WRITE, 0, 2),
        CheckHicacheEvents(),
        device_size=6,
        radix_eviction_policy=EvictionPolicy.FIFO,
    ),
    "write-back-failed-backup-as-done": _script(
        5,
        "rank 0 node -:[200, 201, 202, 203, 204, 205, 206, 207]: only in sglang",
        WritePolicy.WRITE_BACK,
        *_served((1, _tokens(100, 8)), (2, _tokens(200, 8)), (3, _tokens(100, 8))),
        device_size=8,
        load_back_threshold=1,
    ),
    "eviction-ignores-priority": _script(
        5,
        "rank 0 node -:[0, 1, 3].host_value: model=(2, 3, 4)",
        WritePolicy.WRITE_BACK,
        StartRequest(1, (5, 4), prompt_len=1),
        *_served((2, (0, 1, 3))),
        FinishRequest(1),
        Evict(10000),
        device_size=9,
        radix_eviction_policy=EvictionPolicy.FILO,
    ),
    "host-pages-freed-under-load": _script(
        7,
        "rank 0 host.free: model=() sglang",
        WritePolicy.WRITE_BACK,
        *_served(
            (18, (2600, 2601)), (22, _tokens(3200, 10)), (23, _tokens(3300, 12)), (24, _tokens(3200, 10))
        ),
        page_size=2,
        device_size=14,
        radix_eviction_policy=EvictionPolicy.FIFO,
    ),
    "unlock-never-locked": _script(
        3,
        "rank 0 node -:[0, 1, 3].lock_ref: model=0 sglang",
        WritePolicy.WRITE_BACK,
        *_served((2, (0, 1, 3))),
        Evict(10000),
        device_size=9,
    ),
    "split-loses-write-through-fragment": _script(
        3,
        "rank 0 node -:[1000, 1001, 1002, 1003, 1004].in_flight: model=('write_through',) sglang",
        WritePolicy.WRITE_THROUGH,
        *_served((0, _tokens(1000, 13)), (1, _tokens(1000, 5))),
        device_size=16,
    ),
    "l3-keys-ignore-namespace": _script(
        2,
        "rank 0 node lora-a:[1, 2].hash_value: model=",
        WritePolicy.WRITE_BACK,
        StartRequest(1, (1, 2), "lora-a"),
        FinishRequest(1),
        device_size=8,
        hicache_storage_backend="file",
    ),
    "prefetch-tail-released-twice": _script(
        14,
        "rank 0 host.free: model=",
        WritePolicy.WRITE_THROUGH,
        *_to_l3(1, _tokens(1, 8)),
        PrefetchFromStorage(2, _tokens(1, 8)),
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        CheckHicacheEvents(),  # allocates eight host slots
        CompleteIO(IOQueue.PREFETCH_IO, 0, 1),  # the first batch of four
        CheckHicacheEvents(),
        CheckPrefetchProgress(2),  # best_effort: ends it with four read; the tail is freed here, too
        **_L3,
    ),
    "wait-complete-on-empty-hashes": _script(
        2,
        "model: ProgressResult(done=False, inserted=0)",
        WritePolicy.WRITE_THROUGH,
        PrefetchFromStorage(1, _tokens(1, 8)),
        CheckPrefetchProgress(1),  # before the hit query: no hashes, 0 == 0
        kind="outcomes differ",
        hicache_storage_prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        **_L3,
    ),
    "prefetch-anchor-not-touched": _script(
        18,
        "model: EvictResult(num_evicted=4)",
        WritePolicy.WRITE_THROUGH,
        *_served((11, _tokens(2100, 12))),
        CompleteIO(IOQueue.WRITE, 0, 1),
        CheckHicacheEvents(),  # the write-through ack queues the backup
        Evict(10000),
        CompleteIO(IOQueue.BACKUP, 0, 1),
        CheckHicacheEvents(),
        EvictHost(10000),  # the chain is in L3 only
        *_served((12, _tokens(2100, 8))),  # the anchor: two pages on the device
        PrefetchFromStorage(13, _tokens(2100, 12)),  # the third page, below the anchor
        CompleteIO(IOQueue.PREFETCH_QUERY, 0, 1),
        *_served((14, _tokens(2400, 4))),  # the peer, used after the anchor
        CompleteIO(IOQueue.WRITE, 0, 2),  # the anchor's and the peer's write-throughs
        CheckHicacheEvents(),
        CheckPrefetchProgress(13),  # best_effort: ends it and inserts below the anchor, stamping it
        Evict(4),  # LRU: the peer (the anchor is newer), or the anchor when the insert did not stamp it
        kind="outcomes differ",
        page_size=4,
        device_size=20,
        hicache_storage_backend="file",
        prefetch_threshold=1,
        storage_batch_size=2,
        radix_eviction_policy=EvictionPolicy.LRU,
    ),
    "split-drops-priority": _script(
        3,
        "rank 0 node -:[1200, 1201, 1202].priority: model=1 sglang",
        WritePolicy.WRITE_THROUGH_SELECTIVE,
        StartRequest(2, _tokens(1200, 4), prompt_len=2),  # D-24's re-insert: priority 1
        FinishRequest(2),
        MatchPrefix(_tokens(1200, 3)),  # splits the node inside the prompt's chain
        device_size=6,
        radix_eviction_policy=EvictionPolicy.FIFO,
    ),
    "hash-chain-restarted": _script(
        4,
        "rank 0 node -:[1, 2, 3, 4].hash_value: model=",
        WritePolicy.WRITE_BACK,
        *_served((1, (1, 2)), (2, (1, 2, 3, 4))),
        device_size=8,
        hicache_storage_backend="file",
    ),
}
"""Per SGLang zoo bug, a run of generated operations that reaches it: the profile machine's failing trace
after ``refcache.check.shrink`` (model against the patched SGLang), with the configuration fields that
matter, each request finished (the recorder takes a request's id from its finish) and every completion
of exactly the acks pending (the recorder sees what completed, not what was asked); for
``write-back-failed-backup-as-done``, written for the bug without L3 (the machine reaches it only on its L3
rows, ``HUNT_ROWS``); for the two hash bugs, written for the bug with L3 on and no prefetch (SGLang hashes
each inserted node when storage is on, hiradix_cache.py:2004-2005) and write_back with no eviction (no
backup, so no storage write); for the two prefetch bugs, written for the bug on the machine's L3 rows
(write_through, one prefetch, each storage step a ``CompleteIO`` of exactly what is runnable: the recorder
writes the storage threads' steps it observes, ``refcache.engines.sglang.record``); for
``collective-skipped-when-queues-empty``, written for the bug on two ranks: one rank's write-through acked,
then the drain (the machine's failing trace is 570 operations long); for ``prefetch-progress-early-return``,
written for the bug on two ranks with L3 under the timeout policy: one prefetch queried on both ranks, then
rank 0's clock alone past its timeout (D-41) and the progress check (the machine's failing trace is 119
operations long)."""


def record_script(bug: Bug | None, script: Script, out: Path) -> Recorded:
    """Drive SGLang (with ``bug`` patched in; None: as shipped) over ``script.ops`` with the recorder on,
    write the recording to ``out`` and replay it on the model. On two ranks the bug is patched into the
    rank workers too, and an operation that ends the workers (``RankError``: a rank that never returned)
    ends the run; ``failed_at`` is its step."""
    sglang_ready()
    failed_at = 0
    with contextlib.ExitStack() as stack:
        if bug is not None:
            stack.enter_context(applied_everywhere(bug) if script.config.tp_size > 1 else bug.applied())
        system = open_system(script.config)
        stack.callback(system.close)
        with record(system, out, snapshots=True) as recorder:
            for step, op in enumerate(script.ops, start=1):
                try:
                    system.apply(op)
                except RankError:
                    failed_at = step
                    break
        recording = recorder.recording()
    return _replayed(recording, failed_at)
