"""File L3 throughput against raw file I/O of the same bytes, measured side by side in one run.

For each (layout, page size): write a batch of pages with ``HiCacheFile.batch_set_v1`` and read them
back with ``batch_get_v1``; the baseline writes/reads the same host-pool pages to/from the same number
of plain files (``os.open`` + ``os.writev``/``os.readv`` straight from/into the page memory, no header,
no checksum, no rename). The generic path (``batch_set``/``batch_get`` through ``get_data_page``
copies) is shown for reference. Repetitions are interleaved, each timed call starting with cold CPU
caches; figures are medians; the ratio is raw time / L3 time (1.0 = as fast as raw I/O; target ≥ 0.7).
Files live in the page cache of ``--dir``, so this measures the software path, not the disk. The
default is ``/dev/shm`` where it exists: on a disk-backed file system the gigabytes this writes start
background writeback, and the write ratios then swung between 0.3 and 0.9 from one run to the next
(specs/data-plane.md §9); elsewhere, the system's temporary directory.

    python bench/bench_l3.py [--pages 64] [--reps 11] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("REFCACHE_TORCH_THREADS", "1")  # before refcache.gpu loads (specs/data-plane.md)

import torch

from refcache.config import HiCacheConfig, IOBackend, MemLayout
from refcache.gpu import HiCacheFile, checksum, device_pool_from_config, host_pool_from_config
from refcache.gpu.storage import _views  # the same zero-copy memory views the L3 uses

KEY = "{:064x}"


def raw_write(directory: str, host_pages: list[list[tuple[int, int]]]) -> None:
    for i, segments in enumerate(host_pages):
        fd = os.open(os.path.join(directory, f"{i}.raw"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.writev(fd, _views(segments))
        os.close(fd)


def raw_read(directory: str, host_pages: list[list[tuple[int, int]]]) -> None:
    for i, segments in enumerate(host_pages):
        fd = os.open(os.path.join(directory, f"{i}.raw"), os.O_RDONLY)
        os.readv(fd, _views(segments))
        os.close(fd)


def empty(directory: str) -> None:
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))


_SWEEP = torch.empty(256 << 20, dtype=torch.uint8)  # more than the last-level caches of these machines


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` takes, starting with no file or pool data in the CPU caches: without the sweep, a
    read that follows another of the same files finds their pages in a 100 MiB last-level cache and
    measured up to 1.3x faster than the first."""
    _SWEEP.fill_(1)
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench(layout: MemLayout, page_size: int, pages: int, reps: int, root: str) -> list[str]:
    config = HiCacheConfig(
        hicache_mem_layout=layout,
        hicache_io_backend=IOBackend.DIRECT if layout is MemLayout.PAGE_FIRST_DIRECT else IOBackend.KERNEL,
        page_size=page_size,
        layer_num=8,
        head_num=8,
        head_dim=128,
        device_size=pages * page_size,
    )
    host = host_pool_from_config(device_pool_from_config(config, "cpu"), config, pin_memory=False)
    host.kv_buffer.view(torch.int16).random_()
    keys = [KEY.format(i + 1) for i in range(pages)]
    src = torch.arange(pages * page_size)  # read back into the second half of the pool
    dst = src + pages * page_size
    ptrs, sizes = host.get_page_buffer_meta(src)
    per = len(ptrs) // pages
    segs = [
        sorted(zip(ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True))
        for i in range(pages)
    ]
    dptrs, dsizes = host.get_page_buffer_meta(dst)
    dsegs = [
        sorted(zip(dptrs[i * per : (i + 1) * per], dsizes[i * per : (i + 1) * per], strict=True))
        for i in range(pages)
    ]
    l3_dir, raw_dir = tempfile.mkdtemp(dir=root), tempfile.mkdtemp(dir=root)
    l3 = HiCacheFile(l3_dir, config)
    l3.register_mem_pool_host(host)
    flat = [host.get_data_page(int(i) * page_size) for i in range(pages)]
    targets = [host.get_dummy_flat_data_page() for _ in range(pages)]
    t: dict[str, list[float]] = {k: [] for k in ("raw_w", "v1_w", "gen_w", "raw_r", "v1_r", "gen_r")}
    for _ in range(reps):
        l3.clear()
        empty(raw_dir)
        t["raw_w"].append(timed(lambda: raw_write(raw_dir, segs)))
        t["v1_w"].append(timed(lambda: l3.batch_set_v1(keys, src)))
        t["raw_r"].append(timed(lambda: raw_read(raw_dir, dsegs)))
        t["v1_r"].append(timed(lambda: l3.batch_get_v1(keys, dst)))
        t["gen_r"].append(timed(lambda: l3.batch_get(keys, targets)))
        l3.clear()
        t["gen_w"].append(timed(lambda: l3.batch_set(keys, flat)))
    assert all(l3.batch_get_v1(keys, dst))  # the measured paths really moved the pages
    for i in range(pages):
        assert torch.equal(
            host.get_data_page(int(dst[i * page_size])).view(torch.int16), flat[i].view(torch.int16)
        )
    shutil.rmtree(l3_dir)
    shutil.rmtree(raw_dir)
    med = {k: statistics.median(v) for k, v in t.items()}
    low = {k: min(v) for k, v in t.items()}
    mib = pages * host.page_size * host.size_per_token / 2**20

    def row(what: str, raw: str, ours: str) -> str:
        ratio = med[raw] / med[ours]
        return (
            f"{layout.value:<18} {page_size:>4} {host.page_size * host.size_per_token // 1024:>7} {what:<13} "
            f"{mib / med[raw] / 1024:>8.2f} {mib / med[ours] / 1024:>8.2f} {ratio:>6.2f} "
            f"{low[raw] / low[ours]:>5.2f}"
        )

    return [
        row("write v1", "raw_w", "v1_w"),
        row("read v1", "raw_r", "v1_r"),
        row("write generic", "raw_w", "gen_w"),
        row("read generic", "raw_r", "gen_r"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--reps", type=int, default=11)
    parser.add_argument(
        "--dir",
        default="/dev/shm"
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
        else tempfile.gettempdir(),
        help="where the files go (default: /dev/shm if writable, else the temporary directory)",
    )
    args = parser.parse_args()
    print(
        f"L3 (HiCacheFile) vs raw file I/O; MHA, 8 layers x 8 heads x 128, fp16; {args.pages} pages; "
        f"{args.reps} interleaved reps; GiB/s in the page cache of {args.dir}"
    )
    print(
        f"{'layout':<18} {'ps':>4} {'KiB/pg':>7} {'path':<13} {'raw':>8} {'L3':>8} {'ratio':>6} {'best':>5}"
    )
    for layout in (MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST_DIRECT):
        for page_size in (16, 64):
            for line in bench(layout, page_size, args.pages, args.reps, args.dir):
                print(line)
    print(
        f"ratio = median raw time / median L3 time, best = min / min; checksum "
        f"{'XXH3-64' if checksum.preferred() == checksum.XXH3 else 'CRC-32'}; load average "
        f"{os.getloadavg()[0]:.1f} at the end"
    )


if __name__ == "__main__":
    main()
