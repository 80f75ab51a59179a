"""LMCache's own ``LMCacheEngine`` on CPU with its background work gated: the driver under the adapter.

``LMCacheDriver`` builds an engine (``LMCacheEngineBuilder.get_or_create`` + ``post_init``) with the local CPU
tier, optionally the local disk tier (a temporary directory) and the ``fs://`` remote tier (another temporary
directory), and only these stand-ins (specs/lmcache.md lists them): a CPU connector between a paged CPU KV
buffer and LMCache's memory objects through the slot mapping; single-rank broadcast callbacks; a lookup
server that records the replies of the asynchronous path; telemetry off. Nothing of LMCache's cache logic is
replaced; the seams below wrap the instance's attributes where LMCache hands work to an executor or to the
file system, and record what the snapshot needs (which chunk each memory object was allocated for, which
tier answered how much of a prefetch).

- **Gated jobs.** The disk worker's ``submit_task`` (a put, or a prefetch's batched read), the remote
  connector's ``put`` and the remote backend's ``batched_get_non_blocking`` (a prefetch's read) wait at a gate
  until ``run`` releases them; the disk queue releases in its executor's priority order (prefetch reads
  before puts, each in submission order), the remote one in submission order.
- **No thread of LMCache's does work of its own.** The storage manager's event loop keeps its thread
  (LMCache's blocking paths wait on it), but the loop's default executor (``asyncio.to_thread``, aiofiles)
  and the disk tier's read pool run their work inline, and after every operation the loop is settled
  (``settle``): every coroutine has finished or waits at a gate.
- **The allocator's busy-wait.** ``LocalCPUBackend.allocate`` sleeps 0.1 s and retries for ever when nothing
  is evictable; the ``time.sleep`` it calls raises ``WouldBlock`` instead.
- **LMCache's own alarms.** ``memory_management`` logs a double free, a double unpin, the use of an
  invalidated memory object or a collected object still counted, and carries on; those lines are captured.
- **Storage faults** at the file boundary: a write or a read that raises ``OSError`` once, a file whose
  bytes are damaged or that disappears.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import types
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # telemetry off, before LMCache reads it
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault(
    "LMCACHE_LOG_LEVEL", "WARNING"
)  # its loggers do not propagate; warnings carry the alarms

import torch
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend import local_cpu_backend as _cpu_module

__all__ = ["DTYPES", "Job", "LMCacheDriver", "WouldBlock", "content"]

SLOTS: Final = 1024  # the paged KV buffer's slots: a store in the lower half, a retrieve in the upper
GIB: Final = 1024**3
ALARMS: Final = ("Double free", "Double unpin", "invalidated MemoryObj", "being garbage collected")
DTYPES: Final = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_ALLOCATING_FOR: Final[contextvars.ContextVar[int | None]] = contextvars.ContextVar(
    "_ALLOCATING_FOR", default=None
)
"""The chunk hash the current asyncio task's next CPU allocation is for. The remote connector's gets of one
prefetch run concurrently (``batched_get_non_blocking`` gathers them), each in its own task and context, so a
label shared by the driver would be taken by whichever task allocates first."""

Fn = Callable[..., object]
AsyncFn = Callable[..., Coroutine[object, object, object]]


class WouldBlock(BaseException):
    """LMCache's allocator would sleep and retry for ever: nothing is evictable and no gated job holds memory
    that its completion would release. A ``BaseException``, so that LMCache's ``except Exception`` handlers
    (the fs:// connector's read, the loading callbacks) cannot turn the hang into a quiet miss."""


class _Wait(BaseException):
    """The allocator's busy-wait began (raised by ``_NoSleep.sleep``; ``LMCacheDriver`` decides what it is)."""


class _NoSleep:
    """``time`` as ``local_cpu_backend`` sees it: its ``sleep`` is the allocator's busy-wait."""

    def __init__(self, real: types.ModuleType) -> None:
        self.real = real

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)

    def sleep(self, seconds: float) -> None:
        raise _Wait(seconds)


def _install_no_sleep() -> None:
    current = _cpu_module.time
    if not isinstance(current, _NoSleep):
        _cpu_module.time = _NoSleep(current)


class _InlineExecutor(concurrent.futures.ThreadPoolExecutor):
    """Runs each job at once in the submitting thread (asyncio accepts only a ThreadPoolExecutor)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1)

    def submit(self, fn: Fn, /, *args: object, **kwargs: object) -> concurrent.futures.Future[object]:  # type: ignore[override]
        future: concurrent.futures.Future[object] = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:
            future.set_exception(error)
        return future

    def map(  # type: ignore[override]
        self, fn: Fn, *iterables: Iterable[object], timeout: float | None = None, chunksize: int = 1
    ) -> Iterable[object]:
        return [fn(*args) for args in zip(*iterables, strict=False)]


class _AlarmHandler(logging.Handler):
    """Keeps LMCache's alarm lines while ``listening``: during this driver's operations only, so that an
    object of an engine closed earlier, collected now, is not blamed on this one."""

    def __init__(self, sink: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.sink = sink
        self.listening = False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if self.listening and any(alarm in message for alarm in ALARMS):
            self.sink.append(" ".join(message.split()))


@dataclass
class Job:
    """A gated piece of LMCache's background work."""

    queue: str  # "disk" or "remote"
    kind: str  # "put" or "read"
    keys: tuple[int, ...]  # chunk hashes, in the job's order
    addresses: tuple[int, ...]  # the CPU memory objects it holds
    lookup_id: str | None
    gate: asyncio.Event
    seq: int
    task: asyncio.Task[object] | None = None  # the coroutine waiting at the gate (cancelled at close)
    done: threading.Event = field(default_factory=threading.Event)


def content(prefix: Sequence[int], layers: int, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """The KV of the last token of ``prefix``, ``[2, layers, hidden]``: a function of the whole prefix, exact in
    every dtype (integers below 256), so a retrieve is checked byte for byte."""
    seed = int.from_bytes(hashlib.blake2b(repr(tuple(prefix)).encode(), digest_size=8).digest(), "little")
    j = torch.arange(hidden, dtype=torch.int64)
    rows = [((seed >> (3 * r)) + j * (2 * r + 1)) % 251 for r in range(2 * layers)]
    return torch.stack(rows).reshape(2, layers, hidden).to(dtype)


class _Connector(GPUConnectorInterface):  # type: ignore[misc]
    """The serving engine's KV cache: a paged CPU buffer ``[2, layers, SLOTS, hidden]`` and the copies between
    it and LMCache's memory objects (``KV_2LTD``) through ``slot_mapping``."""

    def __init__(self, layers: int, hidden: int, dtype: torch.dtype) -> None:
        self.layers = layers
        self.hidden = hidden
        self.kv = torch.zeros(2, layers, SLOTS, hidden, dtype=dtype)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.layers, num_tokens, self.hidden])

    def from_gpu(self, memory_obj: object, start: int, end: int, **kwargs: object) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj: object, start: int, end: int, **kwargs: object) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(
        self, memory_objs: Sequence[object], starts: Sequence[int], ends: Sequence[int], **kwargs: object
    ) -> None:
        slots = kwargs["slot_mapping"]
        assert isinstance(slots, torch.Tensor)
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            obj.tensor.copy_(self.kv[:, :, slots[start:end], :])  # type: ignore[attr-defined]

    def batched_to_gpu(
        self,
        memory_objs: Sequence[object] | None = None,
        starts: Sequence[int] | None = None,
        ends: Sequence[int] | None = None,
        **kwargs: object,
    ) -> None:
        slots = kwargs["slot_mapping"]
        assert isinstance(slots, torch.Tensor) and memory_objs is not None and starts and ends
        for obj, start, end in zip(memory_objs, starts, ends, strict=True):
            self.kv[:, :, slots[start:end], :] = obj.tensor  # type: ignore[attr-defined]


class _LookupServer:
    """The asynchronous lookup server: it records the replies LMCache sends the scheduler."""

    def __init__(self) -> None:
        self.replies: dict[str, int] = {}

    def send_response_to_scheduler(self, lookup_id: str, retrieved_length: int) -> None:
        self.replies[lookup_id] = retrieved_length


@dataclass
class PrefetchLog:
    """What one ``async_lookup_and_prefetch`` did, recorded at the seams (its coroutine keeps it in locals)."""

    expected: list[int] = field(default_factory=list)  # per tier with a hit: chunks found
    loaded: list[tuple[int, object]] = field(default_factory=list)  # (chunk hash, memory object) loaded
    pinned_disk: list[int] = field(default_factory=list)  # disk keys its pinned lookup pinned


class LMCacheDriver:
    """One LMCache engine (module docstring). ``close`` destroys it and removes its directories."""

    _count = 0

    def __init__(
        self,
        *,
        chunk_size: int,
        layers: int,
        heads: int,
        head_dim: int,
        dtype: str,
        cpu_bytes: int,
        disk_bytes: int,
        remote: bool,
        policy: str,
        save_unfull_chunk: bool,
        async_loading: bool,
    ) -> None:
        LMCacheDriver._count += 1
        self.instance_id = f"refcache-{os.getpid()}-{LMCacheDriver._count}"
        self.root = tempfile.mkdtemp(prefix="refcache-lmcache-")
        self.layers, self.hidden, self.dtype = layers, heads * head_dim, DTYPES[dtype]
        self.chunk_size = chunk_size
        self.jobs: list[Job] = []
        self._seq = 0
        self.alarms: list[str] = []
        self.names: dict[int, tuple[int, ...]] = {}  # chunk hash -> the tokens up to the chunk's end
        self.objects: list[weakref.ref[object]] = []  # every memory object the CPU allocator handed out
        self.content_of: dict[int, int] = {}  # id(memory object) -> the chunk hash it was allocated for
        self._expect: list[int] = []  # chunk hashes the next allocations are for, in order
        self.prefetch_logs: dict[str, PrefetchLog] = {}
        self._current_lookup: str | None = None
        self.fail: dict[tuple[str, str], bool] = {}  # (tier, "write"/"read") -> armed
        self._closed = False
        gc.collect()  # what earlier engines left is collected before this one listens
        self._handler = _AlarmHandler(self.alarms)
        for logger in _lmcache_loggers():
            logger.addHandler(self._handler)
        settings: dict[str, object] = {
            "chunk_size": chunk_size,
            "local_cpu": True,
            "max_local_cpu_size": cpu_bytes / GIB,
            "pin_timeout_sec": 10**9,
            "save_unfull_chunk": save_unfull_chunk,
            "lmcache_instance_id": self.instance_id,
            "cache_policy": policy,
            "numa_mode": None,
            "py_enable_gc": True,
            "enable_async_loading": async_loading,
            "blocking_timeout_secs": 30,
        }
        if disk_bytes:
            settings["local_disk"] = f"file://{self.root}/disk"
            settings["max_local_disk_size"] = disk_bytes / GIB
        if remote:
            settings["remote_url"] = f"fs://localhost:0{self.root}/remote"
            settings["remote_serde"] = "naive"
        config = LMCacheEngineConfig.from_dict(settings)
        metadata = LMCacheMetadata(
            model_name="refcache",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=self.dtype,
            kv_shape=(layers, 2, chunk_size, heads, head_dim),
            chunk_size=chunk_size,
        )
        self.connector = _Connector(layers, self.hidden, self.dtype)
        self.lookup_server = _LookupServer()
        _install_no_sleep()
        self.engine: LMCacheEngine = LMCacheEngineBuilder.get_or_create(
            self.instance_id, config, metadata, self.connector, lambda t, r: None, lambda o, r: o
        )
        try:
            self.engine.post_init(async_lookup_server=self.lookup_server)
            manager = self.engine.storage_manager
            assert manager is not None
            self.manager = manager
            self.loop: asyncio.AbstractEventLoop = manager.loop
            self.loop.set_default_executor(_InlineExecutor())
            self.cpu = manager.storage_backends["LocalCPUBackend"]
            self.disk = manager.storage_backends.get("LocalDiskBackend")
            self.remote = manager.storage_backends.get("RemoteBackend")
            self._install_seams()
            self.settle()
            gc.freeze()  # what exists now is left out of every collection until close: a full one costs ~0.1 ms
        except BaseException:
            self.close()
            raise

    # -- seams -----------------------------------------------------------------------------------------------

    def _install_seams(self) -> None:
        cpu = self.cpu
        allocate: Fn = cpu.allocate
        driver = self

        def tracked_allocate(*args: object, **kwargs: object) -> object:
            key = _ALLOCATING_FOR.get()
            if key is not None:
                _ALLOCATING_FOR.set(None)  # one allocation per get
            elif driver._expect:
                key = driver._expect.pop(0)
            try:
                obj = allocate(*args, **kwargs)
            except _Wait:
                # LMCache busy-waits for other requests to release memory. With gated jobs holding memory,
                # its background threads would release it, later: that wait is not a hang, and the caller
                # gets what busy_loop=False gives (None; the model's decision L-05). With none, nothing
                # ever will: the operation would hang.
                if any(job.addresses for job in driver.jobs):
                    return None
                raise WouldBlock(
                    "LocalCPUBackend.allocate busy-waits for ever: nothing is evictable and no background "
                    "job holds memory"
                ) from None
            if obj is not None:
                driver.objects.append(weakref.ref(obj))
                driver.content_of.pop(id(obj), None)  # an id a collected object had
                if key is not None:
                    driver.content_of[id(obj)] = key
            return obj

        cpu.allocate = tracked_allocate
        cpu_async_contains: AsyncFn = cpu.batched_async_contains
        cpu.batched_async_contains = self._counting("cpu", cpu_async_contains)
        cpu_get_nb: AsyncFn = cpu.batched_get_non_blocking
        cpu.batched_get_non_blocking = self._loading(cpu_get_nb)
        if self.disk is not None:
            disk = self.disk
            disk._read_thread_pool = _InlineExecutor()
            worker = disk.disk_worker
            submit: AsyncFn = worker.submit_task

            async def gated_submit(task_type: str, task: Fn, *args: object, **kwargs: object) -> object:
                if task_type == "put":
                    key = kwargs["key"]
                    obj = kwargs["memory_obj"]
                    job = driver._job("disk", "put", (key.chunk_hash,), (obj.meta.address,), None)  # type: ignore[attr-defined]
                else:
                    keys = kwargs["keys"]
                    objs = kwargs["memory_objs"]
                    job = driver._job(
                        "disk",
                        "read",
                        tuple(k.chunk_hash for k in keys),  # type: ignore[attr-defined]
                        tuple(o.meta.address for o in objs),  # type: ignore[attr-defined]
                        driver._current_lookup,
                    )
                await job.gate.wait()
                try:
                    return await submit(task_type, task, *args, **kwargs)
                finally:
                    job.done.set()

            worker.submit_task = gated_submit
            disk_get_nb: AsyncFn = disk.batched_get_non_blocking

            async def disk_prefetch(
                lookup_id: str, keys: list[object], *args: object, **kwargs: object
            ) -> object:
                driver._current_lookup = lookup_id
                driver._expect = [k.chunk_hash for k in keys]  # type: ignore[attr-defined]
                try:
                    return await disk_get_nb(lookup_id, keys, *args, **kwargs)
                finally:
                    driver._expect = []

            disk.batched_get_non_blocking = self._loading(disk_prefetch)
            disk_async_contains: AsyncFn = disk.batched_async_contains
            disk.batched_async_contains = self._counting("disk", disk_async_contains)
            get_blocking: Fn = disk.get_blocking

            def disk_get(key: object) -> object:
                driver._expect = [key.chunk_hash]  # type: ignore[attr-defined]
                try:
                    return get_blocking(key)
                finally:
                    driver._expect = []

            disk.get_blocking = disk_get
            batched_get_blocking: Fn = disk.batched_get_blocking

            def disk_batched_get(keys: list[object]) -> object:
                if len(keys) > 1:
                    with disk.disk_lock:
                        driver._expect = [k.chunk_hash for k in keys if k in disk.dict]  # type: ignore[attr-defined]
                try:
                    return batched_get_blocking(keys)
                finally:
                    driver._expect = []

            disk.batched_get_blocking = disk_batched_get
            write_file: Fn = disk.write_file
            read_file: Fn = disk.read_file

            def faulty_write(buffer: object, path: str) -> object:
                if driver.fail.pop(("disk", "write"), False):
                    raise OSError(f"refcache: injected write failure on {os.path.basename(path)}")
                return write_file(buffer, path)

            def faulty_read(key: object, buffer: object, path: str) -> object:
                if driver.fail.pop(("disk", "read"), False):
                    raise OSError(f"refcache: injected read failure on {os.path.basename(path)}")
                return read_file(key, buffer, path)

            disk.write_file = faulty_write
            disk.read_file = faulty_read
        if self.remote is not None:
            remote = self.remote
            connection = remote.connection  # InstrumentedRemoteConnector over the fs:// connector
            put: AsyncFn = connection.put

            async def gated_put(key: object, memory_obj: object) -> object:
                address = (memory_obj.meta.address,)  # type: ignore[attr-defined]
                job = driver._job("remote", "put", (key.chunk_hash,), address, None)  # type: ignore[attr-defined]
                await job.gate.wait()
                try:
                    return await put(key, memory_obj)
                finally:
                    job.done.set()

            connection.put = gated_put
            fs = connection._connector  # the file boundary: faults are raised here, under LMCache's wrapper
            fs_put: AsyncFn = fs.put
            fs_get: AsyncFn = fs.get

            async def faulty_put(key: object, memory_obj: object) -> object:
                if driver.fail.pop(("remote", "write"), False):
                    raise OSError("refcache: injected remote write failure")
                return await fs_put(key, memory_obj)

            async def remote_get(key: object) -> object:
                chunk_hash: int = key.chunk_hash  # type: ignore[attr-defined]
                label = _ALLOCATING_FOR.set(chunk_hash)  # this get's task only: the gets run concurrently
                try:
                    # An armed read fault hits the next read of a stored object (as on disk, where only
                    # indexed keys are read): LMCache also asks the connector for keys it does not hold.
                    if driver.fail.get(("remote", "read")) and driver.path_of("remote", chunk_hash):
                        del driver.fail[("remote", "read")]
                        raise OSError("refcache: injected remote read failure")
                    return await fs_get(key)
                finally:
                    _ALLOCATING_FOR.reset(label)

            fs.put = faulty_put
            fs.get = remote_get
            remote_get_nb: AsyncFn = remote.batched_get_non_blocking

            async def gated_read(
                lookup_id: str, keys: list[object], *args: object, **kwargs: object
            ) -> object:
                job = driver._job("remote", "read", tuple(k.chunk_hash for k in keys), (), lookup_id)  # type: ignore[attr-defined]
                await job.gate.wait()
                try:
                    return await remote_get_nb(lookup_id, keys, *args, **kwargs)
                finally:
                    job.done.set()

            remote.batched_get_non_blocking = self._loading(gated_read)
            remote_async_contains: AsyncFn = remote.batched_async_contains
            remote.batched_async_contains = self._counting("remote", remote_async_contains)

    def _job(
        self, queue: str, kind: str, keys: tuple[int, ...], addresses: tuple[int, ...], lookup_id: str | None
    ) -> Job:
        self._seq += 1
        job = Job(queue, kind, keys, addresses, lookup_id, asyncio.Event(), self._seq, asyncio.current_task())
        self.jobs.append(job)
        return job

    def _counting(self, tier: str, contains: AsyncFn) -> AsyncFn:
        driver = self

        async def counted(lookup_id: str, keys: list[object], pin: bool = False) -> object:
            hits = await contains(lookup_id, keys, pin)
            assert isinstance(hits, int)
            log = driver.prefetch_logs.setdefault(lookup_id, PrefetchLog())
            if hits:
                log.expected.append(hits)
                if pin and tier == "disk":
                    log.pinned_disk.extend(k.chunk_hash for k in keys[:hits])  # type: ignore[attr-defined]
            return hits

        return counted

    def _loading(self, get: AsyncFn) -> AsyncFn:
        driver = self

        async def loaded(lookup_id: str, keys: list[object], *args: object, **kwargs: object) -> object:
            objs = await get(lookup_id, keys, *args, **kwargs)
            assert isinstance(objs, list)
            log = driver.prefetch_logs.setdefault(lookup_id, PrefetchLog())
            log.loaded.extend((k.chunk_hash, o) for k, o in zip(keys, objs, strict=False))  # type: ignore[attr-defined]
            return objs

        return loaded

    def settle(self) -> None:
        """Run LMCache's loop until nothing is ready: every coroutine has finished or waits at a gate."""
        loop = self.loop

        async def settle() -> None:
            for _ in range(100_000):
                await asyncio.sleep(0)
                if not loop._ready:  # type: ignore[attr-defined]
                    return
            raise RuntimeError("LMCache's event loop does not settle")

        asyncio.run_coroutine_threadsafe(settle(), loop).result(timeout=60)

    def listen(self, on: bool) -> None:
        """Attribute LMCache's alarm lines to this engine (``on`` for the span of one operation). An operation
        ends with a full collection, so that an object it left unreachable is collected (and LMCache's "garbage
        collected with ref_count" line logged) at the same step on every run: a collection of the young
        generations only would leave a cycle through an object old enough to be in the oldest one to whichever
        automatic collection came next, at another step on another run. The objects the engine was built with
        are frozen out of collections (``gc.freeze`` at open), so this costs ~0.1 ms, not 0.2 s."""
        if not on:
            gc.collect()
        self._handler.listening = on

    def stuck(self) -> str:
        """Why every later operation would deadlock ("" when none would): between operations nothing of
        LMCache's runs, so a lock held now is one it never released."""
        if self.disk is not None and self.disk.disk_lock.locked():
            return "LocalDiskBackend.disk_lock is held with nothing running: every later disk operation deadlocks"
        if self.cpu.cpu_lock.locked():
            return "LocalCPUBackend.cpu_lock is held with nothing running: every later operation deadlocks"
        return ""

    def queued(self, queue: str) -> list[Job]:
        """The jobs waiting in ``queue``, in the order they would run."""
        jobs = [j for j in self.jobs if j.queue == queue]
        if queue == "disk":  # AsyncPQThreadPoolExecutor: priority (prefetch 0, put 2), then submission
            jobs.sort(key=lambda j: (j.kind != "read", j.seq))
        return jobs

    def run(self, queue: str, count: int) -> list[Job]:
        """Release the next ``count`` jobs of ``queue`` one at a time, each to completion."""
        ran: list[Job] = []
        for _ in range(count):
            waiting = self.queued(queue)
            if not waiting:
                break
            job = waiting[0]
            self.jobs.remove(job)
            self.loop.call_soon_threadsafe(job.gate.set)
            if not job.done.wait(timeout=60):
                raise RuntimeError(f"LMCache's {queue} {job.kind} job did not finish")
            self.settle()
            ran.append(job)
        return ran

    # -- the serving engine's calls --------------------------------------------------------------------------

    def learn(self, tokens: Sequence[int], skip: int = 0) -> list[tuple[int, int, int]]:
        """(start, end, chunk hash) of each chunk of ``tokens`` from ``skip`` on, remembering what each hash
        names."""
        out = []
        for start, end, key in self.engine.token_database.process_tokens(tokens=list(tokens)):
            self.names.setdefault(key.chunk_hash, tuple(tokens[:end]))
            if start >= skip:
                out.append((start, end, key.chunk_hash))
        return out

    def _mask(self, n: int, skip: int) -> torch.Tensor | None:
        if not skip:
            return None
        mask = torch.ones(n, dtype=torch.bool)
        mask[:skip] = False
        return mask

    def store(self, tokens: Sequence[int], skip: int) -> int:
        """``store``; how many tokens' chunks were allocated (what it hands to ``batched_put``)."""
        chunks = self.learn(tokens, skip)
        n = len(tokens)
        for i in range(n):
            self.connector.kv[:, :, i, :] = content(tokens[: i + 1], self.layers, self.hidden, self.dtype)
        before = len(self.objects)
        self._expect = [h for _, _, h in chunks]
        try:
            self.engine.store(list(tokens), mask=self._mask(n, skip), slot_mapping=torch.arange(n))
        finally:
            self._expect = []
            self.settle()
        allocated = len(self.objects) - before
        return sum(end - start for start, end, _ in chunks[:allocated])

    def lookup(self, tokens: Sequence[int], lookup_id: str | None, pin: bool) -> int:
        self.learn(tokens)
        try:
            return int(self.engine.lookup(list(tokens), lookup_id=lookup_id, pin=pin))
        finally:
            self.settle()

    def retrieve(self, tokens: Sequence[int], skip: int, lookup_id: str | None) -> tuple[int, list[str]]:
        """``retrieve`` into fresh slots: (tokens retrieved, a line per chunk whose KV is not what was stored)."""
        self.learn(tokens)
        n = len(tokens)
        base = SLOTS // 2
        self.connector.kv[:, :, base : base + n, :] = -1
        kwargs: dict[str, object] = {"slot_mapping": torch.arange(base, base + n)}
        if lookup_id is not None:
            kwargs["req_id"] = lookup_id
        try:
            mask = self.engine.retrieve(list(tokens), mask=self._mask(n, skip), **kwargs)
        finally:
            self.settle()
        wrong: list[str] = []
        for start in range(0, n, self.chunk_size):
            end = min(start + self.chunk_size, n)
            if not bool(mask[start:end].any()):
                continue
            expected = torch.stack(
                [content(tokens[: i + 1], self.layers, self.hidden, self.dtype) for i in range(start, end)],
                dim=2,
            )
            if not torch.equal(self.connector.kv[:, :, base + start : base + end, :], expected):
                wrong.append(f"tokens {start}..{end}: the KV retrieved is not the KV stored for them")
        return int(mask.sum()), wrong

    def lookup_unpin(self, lookup_id: str) -> None:
        try:
            self.engine.lookup_unpin(lookup_id)
        finally:
            self.settle()

    def prefetch(self, tokens: Sequence[int], lookup_id: str, pin: bool) -> None:
        self.learn(tokens)
        self.prefetch_logs[lookup_id] = PrefetchLog()
        try:
            self.engine.async_lookup_and_prefetch(lookup_id, list(tokens), pin=pin)
        finally:
            self.settle()

    def clear(self, tokens: Sequence[int] | None) -> int:
        if tokens:
            self.learn(tokens)
        try:
            return int(self.engine.clear(list(tokens) if tokens else None))
        finally:
            self.settle()

    # -- faults ------------------------------------------------------------------------------------------------

    def arm(self, tier: str, what: str) -> None:
        """The tier's next write or read raises ``OSError`` (at the file boundary)."""
        self.fail[(tier, what)] = True

    def damage(self, tier: str, chunk_hash: int, delete: bool) -> None:
        """Damage the bytes of, or delete, the tier's file for ``chunk_hash``."""
        path = self.path_of(tier, chunk_hash)
        if path is None or not os.path.exists(path):
            return
        if delete:
            os.remove(path)
            return
        with open(path, "r+b") as file:
            data = bytearray(file.read())
            for i in range(len(data) - min(len(data), 256), len(data)):
                data[i] ^= 0x5A
            file.seek(0)
            file.write(data)

    def path_of(self, tier: str, chunk_hash: int) -> str | None:
        if tier == "disk":
            assert self.disk is not None
            for key, meta in self.disk.dict.items():
                if key.chunk_hash == chunk_hash:
                    return str(meta.path)
            return None
        directory = os.path.join(self.root, "remote")
        for name in os.listdir(directory) if os.path.isdir(directory) else []:
            if name.endswith(".data") and _hash_of(name) == chunk_hash:
                return os.path.join(directory, name)
        return None

    def remote_keys(self) -> list[int]:
        directory = os.path.join(self.root, "remote")
        names = os.listdir(directory) if os.path.isdir(directory) else []
        return [h for h in (_hash_of(n) for n in names if n.endswith(".data")) if h is not None]

    def live_objects(self) -> list[object]:
        out = []
        for ref in self.objects:
            obj = ref()
            if obj is not None and obj.is_valid():  # type: ignore[attr-defined]
                out.append(obj)
        self.objects = [r for r in self.objects if r() is not None]
        return sorted(out, key=lambda o: o.meta.address)  # type: ignore[attr-defined]

    def close(self) -> None:
        """Open the gates (so nothing waits for ever), destroy the engine, remove the directories."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.stuck():  # a lock LMCache never released would deadlock its own close
                for lock in (self.cpu.cpu_lock, *([self.disk.disk_lock] if self.disk is not None else [])):
                    if lock.locked():
                        lock.release()
            for job in self.jobs:  # what never ran is cancelled where it waits, as a shutdown would
                if job.task is not None:
                    self.loop.call_soon_threadsafe(job.task.cancel)
            self.jobs.clear()
            self.settle()
            LMCacheEngineBuilder.destroy(self.instance_id)
        finally:
            self._handler.listening = False
            gc.unfreeze()
            gc.collect()
            for logger in _lmcache_loggers():
                logger.removeHandler(self._handler)
            shutil.rmtree(self.root, ignore_errors=True)


def _lmcache_loggers() -> list[logging.Logger]:
    """LMCache's loggers (``lmcache.logging.init_logger``: one per module, none propagating)."""
    names = [n for n in logging.Logger.manager.loggerDict if n.startswith("lmcache")]
    return [logging.getLogger(n) for n in sorted(names)]


def _hash_of(name: str) -> int | None:
    """The chunk hash in an fs:// object's file name (``model@world@worker@hash@dtype.data``, hash in hex)."""
    parts = name.split("@")
    if len(parts) < 5:
        return None
    try:
        return int(parts[3], 16)
    except ValueError:
        return None
