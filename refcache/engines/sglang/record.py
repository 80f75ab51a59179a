"""The recorder: a live SGLang ``HiRadixCache`` (or ``UnifiedRadixCache``, below) written down as a refcache trace
while it runs.

``with record(system, path) as recorder: ...`` wraps the cache of ``system`` (an ``SGLangSystem``, or a bare
``HiRadixCache`` with its configuration given) and, on exit, writes every scheduler call and every
background completion it observed as a recorded trace (``refcache.hicache.recording``: the trace format, the
header's ``source`` naming the engine and version, and on each line what the engine returned, plus its
snapshot after the operation when ``snapshots=True`` and the target is an ``SGLangSystem``). The
configuration in the header is the live cache's, under the installed release's profile
(``PROFILES["sglang-0.5.20"]`` on 0.5.20: the engine follows its release at every decision) and the header's
``source`` names that release, so a clean run replays clean on the model.

How the wrapping works
----------------------
The cache instance's class is swapped for a subclass of its own class that overrides the methods below,
each calling the class's method and noting the call (so a patch of SGLang's class, as the zoo applies,
still runs; instance attributes the adapter sets, such as its ``insert`` spy, keep working). Only
*top-level* calls are interpreted: calls SGLang makes to these methods from inside one of them (the
``dec_lock_ref`` of ``cache_finished_req``, the ``evict`` inside ``evict_for_alloc``, the ``evict_host`` of
a prefetch drain) are part of the outer call. With a storage backend the recorder also hooks, as instance
attributes, the points where the storage threads hand their results to the scheduler (below) and the
cache's ``_revoke_pending_prefetch`` (wrapping whatever is there: the adapter's own counter, or the
class's method). Nothing the recorder does calls into SGLang except ``query()`` on ack events,
``prefetch_rate_limited()`` (reads), and, with ``snapshots=True``, the adapter's snapshot reader (reads
only). ``close`` (the context's exit) puts the class and every hooked attribute back.
``tests/engines/sglang/test_record.py`` checks that SGLang's observations and snapshots are identical with
and without the recorder, with and without L3.

Observed calls → operations
---------------------------
========================================================  =====================================================
observed top-level sequence                                operation (observation)
========================================================  =====================================================
``match_prefix(k)`` then any call other than the below    ``MatchPrefix(k)`` (lengths, depths of the match;
                                                           the snapshot is the one read right after the match)
``match_prefix(k)`` [``inc_lock_ref(last_device_node)``]  ``StartRequest(rid, k, prompt_len)``
``init_load_back`` [``dec_lock_ref``] ``inc_lock_ref(n)``  (admitted, device hit, loaded, computed =
[``evict_for_alloc`` / ``evict``]* [``ready_to_load_     len(k) - hit - loaded); the request's ``rid`` and
host_cache``]                                              ``prompt_len = len(origin_input_ids)`` (None when
                                                           it is all of ``k``) are taken from ``params.req``
                                                           when the scheduler passes it, else from the first
                                                           request later finished, cached or aborted whose
                                                           ``last_node`` is ``n`` and whose tokens are ``k``
... with ``dec_lock_ref(n)`` before the end               ``StartRequest`` not admitted (``computed`` 0)
``match_prefix(k)`` ``prefetch_from_storage(handle,        ``PrefetchFromStorage(handle.rid, k[:matched] + new,
last_host_node, new, ..., extra_key=e)``                   e)`` (admitted = ``rid in ongoing_prefetch`` after;
                                                           else the first refusal test that held before:
                                                           ``below_threshold``, ``rate_limited``; the page-
                                                           aligned tail), as the adapter observes it
``cache_finished_req(req)``                               ``FinishRequest(rid)`` (``prefix_len`` of its first
                                                           ``insert``; the freed tokens, as the adapter counts)
``cache_finished_req(req, is_insert=False)``              ``AbortRequest(rid)``
``cache_unfinished_req(req)``                             ``CacheUnfinishedRequest(rid)``
``evict(n)`` / ``evict_for_alloc(n)`` outside admission   ``Evict(n)`` (tokens evicted)
``evict_host(n)``                                         ``EvictHost(n)`` (host ``available_size`` delta)
``check_hicache_events()``                                ``CheckHicacheEvents`` (write / load ack list length
                                                           deltas; prefetches revoked; backup acks and host
                                                           releases the drain took)
``reset()``                                               ``Reset`` (flushed)
``check_prefetch_progress(handle)``                       ``CheckPrefetchProgress(rid)`` (done as returned;
                                                           inserted: ``prefetch_loaded_tokens_by_reqid[rid]``
                                                           when done, read, not popped)
``release_aborted_request(handle)``                       ``AbortPrefetch(rid)``
a write / load ack whose event is found finished before   ``CompleteIO(WRITE|LOAD, 0, count)`` for the oldest
a top-level call (or at close), having been unfinished     acks, before that call's operation (acks finished
after the previous one                                     *during* a call, e.g. a write-back eviction's
                                                           synchronize, belong to that call)
a storage thread's step (below)                           ``CompleteIO(PREFETCH_QUERY|PREFETCH_IO|BACKUP, 0,
                                                           count)``, consecutive steps of one queue merged
the adapter's logical clock moved (``SGLangSystem``)       ``AdvanceClock(delta)``
========================================================  =====================================================

The storage threads' steps
--------------------------
The recorder does not drive the storage threads: it observes each step at the moment its result becomes
visible to the scheduler, whatever runs the threads (the adapter's gate, ``_storage``, one token per
``CompleteIO``; or nothing, on a live engine where they run free):

* ``PREFETCH_QUERY``: the prefetch thread puts the queried operation on ``prefetch_hit_queue``;
* ``PREFETCH_IO``: the prefetch sync thread forwards to ``ack_prefetch_queue`` the ack of a batch for
  which the I/O thread called ``page_get_func`` (batches that read nothing — after a short batch or a
  termination — and an operation's final ack are no step, as under the adapter);
* ``BACKUP``: the backup thread puts the finished operation on ``ack_backup_queue``.

Each hook notes the step and makes the ``put`` under one lock, so a step the recorder writes before a call
was in its queue before the call began. Steps are written in the order they happened. A step that happened
*during* a call is written after it, unless the call took its result (the drain of
``check_hicache_events`` got it from the queue): then it, and every step before it, is written before the
call's operation, as the scheduler saw it. Write and load acks have no callback (their events are polled):
between two calls the recorder writes the acks it finds finished before the storage steps.

With ``snapshots=True``, of the lines written between two calls only the last carries a snapshot (the
engine's state is read on the scheduler's thread, at a call; the state after an earlier background step is
gone by then), and ``Reset`` carries none (``flush_cache`` clears the pools after ``reset()`` returns).
Snapshots are for the adapter's gated runs: it reads them once the storage threads are parked; threads
running free would change the state while it is read, and in steps the recorder writes after the line.

UnifiedRadixCache (0.5.19 to 0.5.23, system ``sglang-unified``; one rank or two)
--------------------------------------------------------------------------------
The same operations from the calls the scheduler makes of ``UnifiedRadixCache`` (``_recorder._UnifiedCalls``, a
subclass of the entry-point table; per-release differences are ``_compat`` rows):

* admission: the scheduler pins the match's last device node for every admission (``_lock_node``), host hit or
  not, and from 0.5.22 also host-locks and locks the load back's ``best_match_node`` inside it: every lock taken
  before the first pin is released, or while one is held, is a pin (``TEMP_LOCK``); the lock after them is the
  request's (``LOCK``). Locks are ``inc_lock_ref`` / ``dec_lock_ref`` up to 0.5.21 (``lock_by_node_id``),
  ``lock`` / ``unlock`` from 0.5.22; host locks are taken only inside a load back's admission;
* releases: up to 0.5.20 ``cache_finished_req`` / ``cache_unfinished_req`` as above; from 0.5.21
  ``release_kv_cache`` is ``claim_kv_row`` .. ``on_release`` (0.5.21: ``insert_req``, ``free_kv_row``, ``unpin``,
  ``on_release(inserted=)``; 0.5.22 on: ``checkpoint``, ``free_kv_row``, ``unlock``, ``on_release(checkpointed=)``,
  ``_compat`` "cache_req_calls"): ``FinishRequest`` when it inserted, else ``AbortRequest``; a ``checkpoint``
  outside one is ``checkpoint_kv_cache``, ``CacheUnfinishedRequest``. ``prefix_len`` is the first insert's less
  the ranges it adopted, as the adapter counts it. From 0.5.21 a batch's backups start at its
  ``flush_pending_backups`` (``backups_unbatched`` up to 0.5.20), so a release's line is written after that
  flush; a second release or checkpoint while the first's backups wait unflushed raises (one flush merges them
  into one write ack, D-38, which no operation expresses);
* ``evict_host`` returns what it freed (the observation); ``match_prefix``'s device length is
  ``device_prefix_len`` and ``init_load_back`` returns the loaded length from 0.5.22 (``match_device_indices``);
* L3: the ``HybridCacheController``'s storage threads hand their results over through the same queues, hooked
  as above; the revoke is the public ``revoke_pending_prefetch``; prefetches are keyed by the request handle
  itself (``ongoing_prefetch``, ``prefetch_loaded_tokens_by_reqid``); 0.5.23 declines a prefetch whose wait
  expired first (``deadline_expired``, read from ``_storage_prefetch_wait`` before the call, D-55). 0.5.23's
  ``finish_storage_prefetch_admission`` after an admission is not interpreted (it closes the wait and its metrics).

Two ranks of Unified (``SGLangRanks(config, system="sglang-unified")``) are recorded as HiRadixCache's are: a
``Recorder`` in each rank worker (the same class, which picks ``_UnifiedCalls`` from the cache it finds), merged by
``_tp.RanksRecorder`` in the order the operations were driven, with L3 too (the Hybrid controller's storage
all-reduces reduced through the parent, their steps written where they were driven).

Refused with ``RecordingError``: a host lock outside a load back, a release step outside ``release_kv_cache``, a row kept for a streaming session (``claim_kv_row``
true), a decode retraction's KV backup or restore (``backup_kv_cache``, ``restore_kv_cache``,
``discard_kv_cache_backup``, 0.5.21 on).

What a recording cannot contain
-------------------------------
* ``StorageFault``: a fault is something the adapter injects into HiCacheFile, not a call a live engine
  makes. A live storage that fails by itself shows as what the failure does (a batch that reads fewer pages,
  a backup cut short); the recorder writes the steps as they happened, so the replay on the model, which
  has no fault there, leaves the recording at that step. A recorded run of the adapter with faults
  injected diverges the same way.
* On a live engine (threads running free), an operation's unstepped tail — the acks of the batches after a
  short or terminated one and its final ack — comes a moment after the step before it; a drain that runs
  in between sees the batch ack without the final ack, which no operation expresses (the model drains
  both). The adapter's gate, which settles the threads after every operation, has no such moment.

What the alphabet cannot express raises ``RecordingError`` from the wrapper *before* SGLang runs the call
(never a silent drop): a lock or unlock outside an admission, a load back without a match, a call
sequence that leaves an admission half done (e.g. ``init_load_back`` then a finish), acks completing out
of order, and a prefetch without the match of its request or anchored elsewhere than that match's
``last_host_node``.

Admission stages
----------------
The calls of one admission (the table's first rows) move it through the stages of
``refcache.engines.admission`` — ``matched``, ``temp_locked``, ``loaded``, ``locked``, ``refused`` — by its
``TRANSITIONS`` (generated as ``specs/recorder-stages.md``); a call for which the table has no step raises
``RecordingError`` naming the events legal from the stage it found. The machinery is in ``_recorder``
(``Recorder``, and ``_Calls``: the recorded class's methods); this module is ``record`` and this account.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from refcache.config import HiCacheConfig
from refcache.engines.sglang._adapter import SGLangSystem
from refcache.engines.sglang._recorder import SOURCE, Recorder
from refcache.errors import RecordingError

if TYPE_CHECKING:
    from refcache.engines.sglang._tp import RanksRecorder

__all__ = ["SOURCE", "Recorder", "RecordingError", "record"]


@contextmanager
def record(
    target: SGLangSystem | Any,
    path: str | os.PathLike[str] | None = None,
    *,
    config: HiCacheConfig | None = None,
    snapshots: bool = False,
) -> Iterator[Recorder | RanksRecorder]:
    """Record ``target`` (an ``SGLangSystem`` or ``UnifiedSGLangSystem``, an ``SGLangRanks`` or a ``HiRadixCache``
    or ``UnifiedRadixCache`` with ``config``) while
    the block runs; write the recorded trace to ``path`` (if given) on exit, also when the block raises.
    Two ranks (either system): a recorder in each rank worker, merged in the order the operations were driven
    (``_tp.RanksRecorder``)."""
    from refcache.engines.sglang._tp import SGLangRanks

    if isinstance(target, SGLangRanks):
        with target.record(path, snapshots=snapshots) as ranks:
            yield ranks
        return
    if isinstance(target, SGLangSystem):
        recorder = Recorder(target.cache, config or target.config, target, snapshots)
    else:
        if config is None:
            raise RecordingError("recording a bare HiRadixCache needs its HiCacheConfig (config=...)")
        recorder = Recorder(target, config, None, False)
    recorder.install()
    try:
        yield recorder
    finally:
        recorder.close()
        if path is not None:
            recorder.write(path)
