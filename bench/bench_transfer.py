"""Host <-> device transfer bandwidth of every seed §5.4 row against a contiguous copy of the same bytes.

For each (attention, layout, io backend, page size, index pattern) the script times a load (one
``load_to_device_per_layer`` call per layer, as the controller issues it, host -> device) against one
contiguous copy per layer of the same bytes, and an all-layer backup (``backup_from_device_all_layer``,
device -> host) against one contiguous copy of the same bytes; the copies run between the same two pools
at random offsets, so neither side is kept hot in cache. The baseline is the faster of two plain copies,
both timed in every repetition: torch's ``copy_`` and, on the CPU, libc's ``memmove`` (on some CPUs one
is 1.5x the other; a baseline slower than the best plain copy would flatter every ratio). Repetitions
interleave the baselines and the transfer; figures are medians; ratio = baseline time / transfer time.
Each transfer gets fresh index tensors, made outside the timed region, so no call reuses the previous
call's plan (a load's layers share one, as the controller's per-layer calls of one load do).

Every timed call starts with cold CPU caches (a read of twice the last-level cache before it): the op
copies the same slots in every repetition and the baselines random ones, so without the sweep the op's
bytes sat in the last-level cache when few cases ran (``--match``) and not when all did.

Index patterns: ``contiguous`` (both sides consecutive pages: fresh FIFO allocators) and ``scattered``
(distinct random pages on both sides: a long-running cache). Target (issue #17): direct backend
ratio >= 0.7 for page_size >= 16, or a measured argument in ``specs/data-plane.md`` that the cell is at the
machine's limit.

``--limit`` adds that argument's measurement for each direct cell: its *floor*, the least work any
implementation must do for it, i.e. the same copies (the cell's plan: the same blocks of the same sizes at
the same addresses) with every address computed beforehand and no index handling, by the cheapest
primitive at hand (the fastest median of: the direct backend's copy loop on the finished plan, one
``ctypes.memmove`` per block, one ``memoryview`` slice assignment per block), timed in the same
repetitions as the baseline and the op; and the planning alone. The target column counts a cell below 0.7
as at the limit only when its floor is below 0.7 too and its ratio within ``LIMIT_MARGIN`` of the floor.
``bench/scattered_memcpy.c`` times the same scattered blocks in C, the memory system's own limit.

Without CUDA the ``kernel`` rows run the Triton kernel under ``TRITON_INTERPRET=1`` at a tiny size; they
show that the path works, not a bandwidth (marked "interp").

    python bench/bench_transfer.py [--tokens 2048] [--layers 4] [--reps 15] [--match "MLA layer_first"] [--limit]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import os
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from refcache.config import AttentionKind, HiCacheConfig, IOBackend, MemLayout
from refcache.gpu import HostKVCache, KVCache, device_pool_from_config, host_pool_from_config
from refcache.gpu.kernels import INTERPRETED
from refcache.gpu.layout import KVView
from refcache.gpu.transfer import DISPATCH, TransferPlan, plan_transfer, run_transfer

TARGET = 0.7  # direct backend, page size >= 16: median ratio to the faster plain copy (issue #17)
# --limit: a cell below TARGET counts as at the machine's limit when its floor (its copies alone, addresses
# precomputed, by the cheapest primitive) is below TARGET too and its ratio is within this fraction of it.
LIMIT_MARGIN = 0.9

# Every (attention, layout, io backend) row of seed §5.4, read off the dispatch table.
ROWS: list[tuple[AttentionKind, MemLayout, IOBackend]] = [
    (attention, layout, backend)
    for attention in AttentionKind
    for (backend, layout), (_, _, kinds) in DISPATCH.items()
    if attention in kinds
]


@dataclass
class Case:
    label: str
    nbytes: int  # bytes one call moves
    prepare: Callable[[], Callable[[], None]]  # untimed: fresh index tensors; returns the timed call
    bases: dict[str, Callable[[], None]]  # plain contiguous copies of the same bytes, by name
    interpreted: bool
    direct_target: bool
    times: dict[str, list[float]]  # per baseline name, "op", and with --limit "plan" and the floors
    # --limit: the planning alone (untimed: fresh index tensors; returns the timed call)
    plan: Callable[[], Callable[[], None]] | None = None
    # --limit: the same copies as the op with every address precomputed, by name (the cheapest is the floor)
    floors: dict[str, Callable[[], None]] = field(default_factory=dict)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def pages(count: int, total: int, ps: int, scattered: bool, rng: random.Random) -> torch.Tensor:
    chosen = rng.sample(range(total), count) if scattered else list(range(1, count + 1))
    return torch.tensor([p * ps + o for p in chosen for o in range(ps)], dtype=torch.int64)


def layered_copies(
    dst: torch.Tensor, src: torch.Tensor, nbytes: int, calls: int, rng: random.Random
) -> dict[str, Callable[[], None]]:
    """``calls`` copies of ``nbytes`` between random contiguous regions of the two pools' memory, by
    torch's ``copy_`` and (both pools on the CPU) by libc's ``memmove``."""
    d, s = dst.view(torch.uint8).view(-1), src.view(torch.uint8).view(-1)

    def offsets() -> tuple[int, int]:
        return rng.randrange(d.numel() - nbytes + 1), rng.randrange(s.numel() - nbytes + 1)

    def torch_copy() -> None:
        for _ in range(calls):
            i, j = offsets()
            d[i : i + nbytes].copy_(s[j : j + nbytes], non_blocking=True)

    def memmove() -> None:
        d_ptr, s_ptr = d.data_ptr(), s.data_ptr()
        for _ in range(calls):
            i, j = offsets()
            ctypes.memmove(d_ptr + i, s_ptr + j, nbytes)

    if d.is_cpu and s.is_cpu:
        return {"copy_": torch_copy, "memmove": memmove}
    return {"copy_": torch_copy}


def plan_blocks(plan: TransferPlan, layer_num: int) -> list[tuple[int, int, int]] | None:
    """Every contiguous block a CPU ``direct`` plan copies for all its layers, as (source byte offset,
    destination byte offset, bytes) from each buffer's first byte: its C runs, or its byte runs and each
    row of its progressions, or its rows, at every K/V and layer. ``None`` for a plan with a GPU side."""
    src, dst = plan.src, plan.dst
    isz = src.buffer.element_size()
    bases = [
        (
            (kv * src.kv_stride + layer * src.layer_stride) * isz,
            (kv * dst.kv_stride + layer * dst.layer_stride) * isz,
        )
        for kv in range(src.num_kv)
        for layer in range(layer_num)
    ]
    if plan.rows is not None:
        row = src.item_numel * isz
        pairs = list(zip(plan.rows.src_rows.tolist(), plan.rows.dst_rows.tolist(), strict=True))
        return [(sb + s * row, db + d * row, row) for sb, db in bases for s, d in pairs]
    if plan.native_runs is not None:
        return [(sb + s, db + d, n) for sb, db in bases for s, d, n in plan.native_runs.triples()]
    runs = plan.byte_runs
    if runs is None:
        return None
    single = list(zip(runs.src_offsets, runs.dst_offsets, runs.nbytes, strict=True))
    single += [
        (s + k * s_step, d + k * d_step, n)
        for s, d, n, count, s_step, d_step in runs.progressions
        for k in range(count)
    ]
    return [(sb + s, db + d, n) for sb, db in bases for s, d, n in single]


def floors(plan: TransferPlan, layer_num: int, load: bool) -> dict[str, Callable[[], None]]:
    """The least work a transfer with ``plan``'s copies must do: those copies with every address computed
    beforehand (no index handling), by each cheap primitive at hand; the fastest is the cell's floor.

    ``copy``: the direct backend's own copy loop on the finished plan (a load layer by layer);
    ``memmove``: one ``ctypes.memmove`` per block over precomputed addresses; ``slices``: one
    ``memoryview`` slice assignment per block over precomputed slices (what the byte-run path does,
    without its per-layer slicing)."""

    def copy() -> None:
        if load:
            for layer in range(layer_num):
                run_transfer(plan, range(layer, layer + 1), range(layer, layer + 1))
        else:
            run_transfer(plan, range(layer_num), range(layer_num))

    out: dict[str, Callable[[], None]] = {"copy": copy}
    blocks = plan_blocks(plan, layer_num)
    if blocks is None:
        return out
    s_ptr, d_ptr = plan.src.buffer.data_ptr(), plan.dst.buffer.data_ptr()
    addresses = [(d_ptr + d, s_ptr + s, n) for s, d, n in blocks]
    src_mem, dst_mem = plan.memory
    src_slices = [slice(s, s + n) for s, _, n in blocks]
    dst_slices = [slice(d, d + n) for _, d, n in blocks]
    consume = deque[object](maxlen=0).extend
    out["memmove"] = lambda: consume(itertools.starmap(ctypes.memmove, addresses))
    out["slices"] = lambda: consume(
        map(dst_mem.__setitem__, dst_slices, map(src_mem.__getitem__, src_slices))
    )
    return out


def build(
    attention: AttentionKind, layout: MemLayout, io: IOBackend, ps: int, tokens: int, layers: int, tiny: bool
) -> tuple[KVCache, HostKVCache]:
    config = HiCacheConfig(
        attention=attention,
        hicache_mem_layout=layout,
        hicache_io_backend=io,
        page_size=ps,
        device_size=4 * tokens,
        layer_num=2 if tiny else layers,
        head_num=2 if tiny else 8,
        head_dim=8 if tiny else 128,
        kv_lora_rank=8 if tiny else 512,
        qk_rope_head_dim=8 if tiny else 64,
    )
    device = device_pool_from_config(config)
    host = host_pool_from_config(device, config)
    device.kv_buffer.view(torch.int16).random_()
    return device, host


def cases(tokens: int, layers: int, rng: random.Random, limit: bool = False) -> list[Case]:
    out = []
    for attention, layout, io in ROWS:
        interp = io is IOBackend.KERNEL and INTERPRETED
        n_tok = 64 if interp else tokens
        for ps in (1, 16, 64):
            if n_tok < ps:
                continue
            device, host = build(attention, layout, io, ps, n_tok, layers, interp)
            n_pages = n_tok // ps
            for scattered in (False, True):
                h = pages(n_pages, host.page_num, ps, scattered, rng)
                d = pages(n_pages, device.size // ps, ps, scattered, rng)
                per_layer = n_tok * host.size_per_token // host.layer_num
                pattern = "scattered" if scattered else "contiguous"
                label = f"{attention.value} {layout.value:<17} {io.value:<6} {ps:>3} {pattern:<10}"

                # Fresh index tensors per call, so no call reuses the previous call's transfer plan; a
                # load's layers do share one, as the controller's per-layer calls of one load do.
                def load(
                    device: KVCache = device,
                    host: HostKVCache = host,
                    h: torch.Tensor = h,
                    d: torch.Tensor = d,
                    io: IOBackend = io,
                ) -> Callable[[], None]:
                    hh, dd = h.clone(), d.clone()

                    def run() -> None:
                        for layer in range(host.layer_num):
                            host.load_to_device_per_layer(device, hh, dd, layer, io)

                    return run

                def backup(
                    device: KVCache = device,
                    host: HostKVCache = host,
                    h: torch.Tensor = h,
                    d: torch.Tensor = d,
                    io: IOBackend = io,
                ) -> Callable[[], None]:
                    hh, dd = h.clone(), d.clone()
                    return lambda: host.backup_from_device_all_layer(device, hh, dd, io)

                target = io is IOBackend.DIRECT and ps >= 16
                nbytes = per_layer * host.layer_num
                for op, prepare, bases, host_is_src in (
                    (
                        "load  ",
                        load,
                        layered_copies(device.kv_buffer, host.kv_buffer, per_layer, host.layer_num, rng),
                        True,
                    ),
                    (
                        "backup",
                        backup,
                        layered_copies(host.kv_buffer, device.kv_buffer, nbytes, 1, rng),
                        False,
                    ),
                ):
                    case = Case(f"{label} {op}", nbytes, prepare, bases, interp, target, {})
                    if limit and io is IOBackend.DIRECT:
                        views = (host.kv_view(), device.kv_view())
                        src, dst = views if host_is_src else views[::-1]

                        def plan(
                            src: KVView = src,
                            dst: KVView = dst,
                            h: torch.Tensor = h,
                            d: torch.Tensor = d,
                            host_is_src: bool = host_is_src,
                        ) -> Callable[[], None]:
                            hh, dd = h.clone(), d.clone()

                            def run() -> None:
                                plan_transfer(src, dst, hh, dd, IOBackend.DIRECT, host_is_src)

                            return run

                        case.plan = plan
                        finished = plan_transfer(
                            src, dst, h.clone(), d.clone(), IOBackend.DIRECT, host_is_src
                        )
                        case.floors = floors(finished, host.layer_num, host_is_src)
                    out.append(case)
    return out


def _last_level_cache() -> int:
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text = f.read().strip()
        return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]]
    except (OSError, ValueError, KeyError, IndexError):
        return 128 << 20


# Read (not written: no dirty lines left to write back during the next call) before every timed call, so
# each starts with none of the pools' bytes in the CPU caches, whichever cases run before it.
_SWEEP = torch.ones(2 * _last_level_cache() // 8, dtype=torch.int64)


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes, starting with cold CPU caches: without the sweep, a cell copying the same
    slots in every repetition (the op, its floors) found them in the last-level cache when few cases ran
    (``--match``) and not when all did, while the baselines copy at random offsets."""
    _SWEEP.max()
    sync()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per transfer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: immune to other load on the machine)"
    )
    parser.add_argument(
        "--match", default="", help="only the cases whose label contains this (e.g. 'MLA page_first_direct')"
    )
    parser.add_argument(
        "--limit",
        action="store_true",
        help="also time each direct cell's floor (its copies with every address precomputed, by the cheapest "
        "primitive) and its planning alone",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    all_cases = [
        case
        for case in cases(args.tokens, args.layers, rng, args.limit)
        if args.match in " ".join(case.label.split())
    ]
    for case in all_cases:  # warm-up (Triton compilation, first touch)
        case.prepare()()
        for base in [*case.bases.values(), *case.floors.values()]:
            base()
    for rep in range(args.reps):
        for case in all_cases:
            if case.interpreted and rep >= 3:
                continue
            for name, base in case.bases.items():
                case.times.setdefault(name, []).append(timed(base))
            case.times.setdefault("op", []).append(timed(case.prepare()))
            for name, alone in case.floors.items():
                case.times.setdefault(name, []).append(timed(alone))
            if case.plan is not None:
                case.times.setdefault("plan", []).append(timed(case.plan()))
    print(
        f"Transfers vs a contiguous copy of the same bytes on {device}; {args.tokens} tokens per call, "
        f"MHA {args.layers} layers x 8 heads x 128 / MLA 512+64, fp16; {args.reps} interleaved reps; "
        f"copy = the faster plain contiguous copy (median); ratio = median copy time / median op time, "
        f"best = min / min; load average {os.getloadavg()[0]:.1f} at the end"
    )
    if args.limit:
        print(
            "floor = copy time / the fastest median of the op's own copies with every address precomputed "
            "(by: the backend's copy loop on a finished plan, one ctypes.memmove or one memoryview slice "
            f"assignment per block); plan = planning alone; a target cell below {TARGET} is at the limit when "
            f"its floor is below {TARGET} and its ratio within {LIMIT_MARGIN} of the floor"
        )
    print(
        f"{'attn layout':<21} {'io':<6} {'ps':>3} {'pattern':<10} {'op':<6} {'MiB':>7} {'copy':>7} "
        f"{'copy GB/s':>9} {'op GB/s':>8} {'ratio':>6} {'best':>5}"
        + (f" {'floor':>5} {'by':>7} {'/floor':>6} {'plan us':>7}" if args.limit else "")
        + "  target (on the median ratio)"
    )
    verdicts: dict[str, int] = {}
    for case in all_cases:
        run = statistics.median(case.times["op"])
        name, copy = min(((n, statistics.median(case.times[n])) for n in case.bases), key=lambda nt: nt[1])
        # best: least disturbed by other load on the machine
        best = min(min(case.times[n]) for n in case.bases) / min(case.times["op"])
        gbs = case.nbytes / 2**30
        ratio = copy / run
        limit = ""
        floor = None
        if case.floors:
            by, floor_time = min(
                ((n, statistics.median(case.times[n])) for n in case.floors), key=lambda nt: nt[1]
            )
            floor = copy / floor_time
            plan = statistics.median(case.times["plan"]) * 1e6
            limit = f" {floor:>5.2f} {by:>7} {ratio / floor:>6.2f} {plan:>7.0f}"
        elif args.limit:
            limit = f" {'':>5} {'':>7} {'':>6} {'':>7}"
        if case.interpreted:
            note = "interp (tiny, not a bandwidth)"
        elif not case.direct_target:
            note = ""
        elif ratio >= TARGET:
            note = "ok"
        elif floor is not None and floor < TARGET and ratio >= LIMIT_MARGIN * floor:
            note = f"at the limit (floor {floor:.2f} < {TARGET})"
        elif floor is not None:
            note = f"BELOW {TARGET} (floor {floor:.2f})"
        else:
            note = f"BELOW {TARGET} (--limit: floor)"
        if note:
            key = note.split(" (")[0]
            verdicts[key] = verdicts.get(key, 0) + 1
        print(
            f"{case.label} {case.nbytes / 2**20:>7.2f} {name:>7} {gbs / copy:>9.2f} {gbs / run:>8.2f} "
            f"{ratio:>6.2f} {best:>5.2f}{limit}  {note}"
        )
    targets = sum(n for key, n in verdicts.items() if not key.startswith("interp"))
    if targets:
        summary = ", ".join(f"{n} {key}" for key, n in verdicts.items() if not key.startswith("interp"))
        print(f"target cells (direct, page size >= 16): {targets}: {summary}")


if __name__ == "__main__":
    main()
