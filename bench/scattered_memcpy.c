/* The machine's own limit for a scattered copy, without Python: `total` bytes copied as `count` blocks of
 * `block` bytes at random block-aligned places of two 128 MiB pools, against the same bytes in `long`
 * contiguous copies (bench_transfer.py's baseline: one per layer for a load, one for a backup). Each
 * timed call starts after a read of twice the last-level cache; medians of 31 interleaved repetitions.
 *
 *     gcc -O2 -o /tmp/scattered_memcpy bench/scattered_memcpy.c
 *     /tmp/scattered_memcpy BLOCK COUNT LONG   # e.g. 18432 512 4: MLA page size 16, a load
 *
 * Rows: libc memcpy of the blocks; the same with non-temporal (streaming) stores, which no primitive
 * reachable from Python (ctypes.memmove, memoryview, numpy, torch) uses for blocks this small; and
 * libc memcpy of the long copies (the baseline). specs/data-plane.md §9 quotes the figures. */
#include <emmintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define POOL ((size_t)128 << 20)
#define SWEEP ((size_t)64 << 20)
#define REPS 31

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void stream_copy(char *d, const char *s, size_t n) { /* 16-byte aligned, n % 16 == 0 */
    for (size_t i = 0; i < n; i += 16)
        _mm_stream_si128((__m128i *)(d + i), _mm_load_si128((const __m128i *)(s + i)));
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s BLOCK COUNT LONG\n", argv[0]);
        return 2;
    }
    size_t block = strtoul(argv[1], 0, 10), count = strtoul(argv[2], 0, 10), nlong = strtoul(argv[3], 0, 10);
    size_t total = block * count;
    if (block % 16 || total % nlong || total > POOL / 2) {
        fprintf(stderr, "BLOCK must be a multiple of 16, BLOCK*COUNT a multiple of LONG and at most 64 MiB\n");
        return 2;
    }
    char *src = aligned_alloc(2 << 20, POOL), *dst = aligned_alloc(2 << 20, POOL);
    volatile long *sweep = aligned_alloc(2 << 20, SWEEP);
    madvise(src, POOL, MADV_HUGEPAGE);
    madvise(dst, POOL, MADV_HUGEPAGE);
    memset(src, 1, POOL);
    memset(dst, 2, POOL);
    memset((void *)sweep, 3, SWEEP);
    size_t *so = malloc(count * sizeof *so), *dof = malloc(count * sizeof *dof);
    double t[3][REPS];
    srand(1);
    for (int r = 0; r < REPS; r++) {
        for (size_t i = 0; i < count; i++) { /* distinct blocks are likely; repeats only help the copy */
            so[i] = (size_t)(rand() % (POOL / block)) * block;
            dof[i] = (size_t)(rand() % (POOL / block)) * block;
        }
        size_t bs = (size_t)(rand() % ((POOL - total) >> 12)) << 12, bd = (size_t)(rand() % ((POOL - total) >> 12)) << 12;
        for (int m = 0; m < 3; m++) {
            long acc = 0;
            for (size_t i = 0; i < SWEEP / sizeof(long); i += 8) acc += sweep[i];
            (void)acc;
            double t0 = now();
            if (m == 0)
                for (size_t i = 0; i < count; i++) memcpy(dst + dof[i], src + so[i], block);
            else if (m == 1) {
                for (size_t i = 0; i < count; i++) stream_copy(dst + dof[i], src + so[i], block);
                _mm_sfence();
            } else
                for (size_t k = 0; k < nlong; k++) memcpy(dst + bd + k * (total / nlong), src + bs + k * (total / nlong), total / nlong);
            t[m][r] = now() - t0;
        }
    }
    const char *names[3] = {"memcpy, blocks", "streaming stores, blocks", "memcpy, long (baseline)"};
    double med[3];
    for (int m = 0; m < 3; m++) {
        qsort(t[m], REPS, sizeof(double), cmp);
        med[m] = t[m][REPS / 2];
    }
    printf("%zu blocks of %zu bytes (%.2f MiB) against %zu long copies\n", count, block, total / 1048576.0, nlong);
    for (int m = 0; m < 3; m++)
        printf("  %-26s %8.0f us %6.2f GB/s  ratio to the baseline %.2f\n", names[m], med[m] * 1e6, total / med[m] / 1e9,
               med[2] / med[m]);
    return 0;
}
