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

Index patterns: ``contiguous`` (both sides consecutive pages: fresh FIFO allocators) and ``scattered``
(distinct random pages on both sides: a long-running cache). Target (issue #17): direct backend
ratio >= 0.7 for page_size >= 16, or a measured argument in ``specs/data-plane.md`` that the cell is at the
machine's limit.

Without CUDA the ``kernel`` rows run the Triton kernel under ``TRITON_INTERPRET=1`` at a tiny size; they
show that the path works, not a bandwidth (marked "interp").

    python bench/bench_transfer.py [--tokens 2048] [--layers 4] [--reps 15] [--match "MLA layer_first"]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refcache.config import AttentionKind, HiCacheConfig, IOBackend, MemLayout
from refcache.gpu import HostKVCache, KVCache, device_pool_from_config, host_pool_from_config
from refcache.gpu.kernels import INTERPRETED
from refcache.gpu.transfer import DISPATCH

TARGET = 0.7  # direct backend, page size >= 16: median ratio to the faster plain copy (issue #17)

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
    times: dict[str, list[float]]  # per baseline name, and "op"


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


def cases(tokens: int, layers: int, rng: random.Random) -> list[Case]:
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
                out.append(
                    Case(
                        f"{label} load  ",
                        nbytes,
                        load,
                        layered_copies(device.kv_buffer, host.kv_buffer, per_layer, host.layer_num, rng),
                        interp,
                        target,
                        {},
                    )
                )
                out.append(
                    Case(
                        f"{label} backup",
                        nbytes,
                        backup,
                        layered_copies(host.kv_buffer, device.kv_buffer, nbytes, 1, rng),
                        interp,
                        target,
                        {},
                    )
                )
    return out


def timed(fn: Callable[[], None]) -> float:
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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    device = "cuda" if torch.cuda.is_available() else f"cpu ({torch.get_num_threads()} threads)"
    all_cases = [
        case for case in cases(args.tokens, args.layers, rng) if args.match in " ".join(case.label.split())
    ]
    for case in all_cases:  # warm-up (Triton compilation, first touch)
        case.prepare()()
        for base in case.bases.values():
            base()
    for rep in range(args.reps):
        for case in all_cases:
            if case.interpreted and rep >= 3:
                continue
            for name, base in case.bases.items():
                case.times.setdefault(name, []).append(timed(base))
            case.times.setdefault("op", []).append(timed(case.prepare()))
    print(
        f"Transfers vs a contiguous copy of the same bytes on {device}; {args.tokens} tokens per call, "
        f"MHA {args.layers} layers x 8 heads x 128 / MLA 512+64, fp16; {args.reps} interleaved reps; "
        f"copy = the faster plain contiguous copy (median); ratio = median copy time / median op time, "
        f"best = min / min; load average {os.getloadavg()[0]:.1f} at the end"
    )
    print(
        f"{'attn layout':<21} {'io':<6} {'ps':>3} {'pattern':<10} {'op':<6} {'MiB':>7} {'copy':>7} "
        f"{'copy GB/s':>9} {'op GB/s':>8} {'ratio':>6} {'best':>5}  target (on the median ratio)"
    )
    for case in all_cases:
        run = statistics.median(case.times["op"])
        name, copy = min(((n, statistics.median(case.times[n])) for n in case.bases), key=lambda nt: nt[1])
        # best: least disturbed by other load on the machine
        best = min(min(case.times[n]) for n in case.bases) / min(case.times["op"])
        gbs = case.nbytes / 2**30
        note = (
            "interp (tiny, not a bandwidth)"
            if case.interpreted
            else (("ok" if copy / run >= TARGET else f"BELOW {TARGET}") if case.direct_target else "")
        )
        print(
            f"{case.label} {case.nbytes / 2**20:>7.2f} {name:>7} {gbs / copy:>9.2f} {gbs / run:>8.2f} "
            f"{copy / run:>6.2f} {best:>5.2f}  {note}"
        )


if __name__ == "__main__":
    main()
