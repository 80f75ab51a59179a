/* The direct backend between two CPU pools (refcache/gpu/transfer.py, specs/data-plane.md §5): the plan
 * of a transfer from its slot arrays, and the copy of a finished plan, without the interpreter.
 *
 * rc_plan makes the runs refcache.gpu.transfer._direct_runs makes (the tests compare both with a literal
 * sort-every-slot reference): every slot range-checked, the runs of pairs consecutive on both sides cut in
 * pair order, sorted by host slot (stable), merged where one continues the other on both sides, checked
 * for a destination slot named twice, then cut at the page boundaries of a paged (page_first_direct)
 * side; each run as (source byte offset, destination byte offset, bytes) from layer 0 of K/V 0, in host
 * address order. Errors come back as codes with the offending values; Python raises the same
 * UsageError as its own planner.
 *
 * rc_copy copies a finished plan's runs for every (K/V, layer) of a call, after checking that every run,
 * at the last K/V and layer, lies inside both buffers (nothing is copied otherwise).
 *
 * No Python or torch headers: raw pointers, int64 values. Built by refcache.gpu.native. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* Runs of at least this many bytes are copied with streaming (non-temporal) stores where the CPU has them
 * (x86-64: SSE2 is part of the base instruction set): a scattered block's regular stores first read each
 * destination line and start a new prefetch stream, streaming stores write around the caches
 * (specs/data-plane.md §9: bench/scattered_memcpy.c, bench_transfer.py). 0: libc memmove for every run. */
#ifndef RC_STREAM_MIN
#define RC_STREAM_MIN 256
#endif

#define RC_RANGE (-1)     /* err = {side (0 source, 1 destination), lowest slot, highest slot} */
#define RC_DUPLICATE (-2) /* a destination slot named twice */
#define RC_MEMORY (-3)

typedef struct {
    int64_t key, s, d, n; /* sort key (host slot or destination slot), first slots, slot count */
} run_t;

/* One side of a transfer: token slots, bytes per slot (one K/V of one layer), the page size when the
 * side's slots are consecutive only inside a page (0: everywhere), and the extra bytes between the last
 * slot of a page and the next page's first. */
typedef struct {
    int64_t slots, row, page_size, jump;
} side_t;

static void merge_sort(run_t *r, run_t *tmp, int64_t m) { /* stable, by key */
    if (m < 2)
        return;
    if (m <= 16) {
        for (int64_t i = 1; i < m; i++) {
            run_t x = r[i];
            int64_t j = i;
            while (j > 0 && r[j - 1].key > x.key) {
                r[j] = r[j - 1];
                j--;
            }
            r[j] = x;
        }
        return;
    }
    int64_t h = m / 2;
    merge_sort(r, tmp, h);
    merge_sort(r + h, tmp, m - h);
    if (r[h - 1].key <= r[h].key)
        return;
    memcpy(tmp, r, (size_t)h * sizeof(run_t));
    int64_t i = 0, j = h, k = 0;
    while (i < h && j < m)
        r[k++] = (r[j].key < tmp[i].key) ? r[j++] : tmp[i++];
    while (i < h)
        r[k++] = tmp[i++];
}

static int sorted_by_key(const run_t *r, int64_t m) {
    for (int64_t i = 1; i < m; i++)
        if (r[i].key < r[i - 1].key)
            return 0;
    return 1;
}

static int64_t offset(const side_t *side, int64_t slot) {
    return slot * side->row + (side->page_size ? slot / side->page_size * side->jump : 0);
}

/* a[i * a_step] -> b[i * b_step] for i < n; src_side, dst_side: {slots, row, page_size, jump} (side_t);
 * out: room for 3 * n values. Returns the number of runs written to out, or an RC_ code. */
int64_t rc_plan(const int64_t *a, int64_t a_step, const int64_t *b, int64_t b_step, int64_t n,
                const int64_t *src_side, const int64_t *dst_side, int64_t host_is_src, int64_t *out,
                int64_t *err) {
    const side_t src = {src_side[0], src_side[1], src_side[2], src_side[3]};
    const side_t dst = {dst_side[0], dst_side[1], dst_side[2], dst_side[3]};
    if (n <= 0)
        return 0;
    int64_t lo[2] = {a[0], b[0]}, hi[2] = {a[0], b[0]};
    for (int64_t i = 1; i < n; i++) {
        int64_t x = a[i * a_step], y = b[i * b_step];
        lo[0] = x < lo[0] ? x : lo[0];
        hi[0] = x > hi[0] ? x : hi[0];
        lo[1] = y < lo[1] ? y : lo[1];
        hi[1] = y > hi[1] ? y : hi[1];
    }
    const int64_t bound[2] = {src.slots, dst.slots};
    for (int side = 0; side < 2; side++) {
        if (lo[side] < 0 || hi[side] >= bound[side]) {
            err[0] = side;
            err[1] = lo[side];
            err[2] = hi[side];
            return RC_RANGE;
        }
    }
    run_t *runs = malloc(3 * (size_t)n * sizeof(run_t)); /* the runs, by destination, merge space */
    if (!runs)
        return RC_MEMORY;
    run_t *tmp = runs + n, *space = runs + 2 * n;
    /* Runs of pairs consecutive on both sides, in pair order (slots are in range: no overflow). */
    int64_t m = 0;
    int64_t ps = a[0], pd = b[0];
    runs[0] = (run_t){host_is_src ? ps : pd, ps, pd, 1};
    for (int64_t i = 1; i < n; i++) {
        int64_t x = a[i * a_step], y = b[i * b_step];
        if (x == ps + 1 && y == pd + 1) {
            runs[m].n++;
        } else {
            runs[++m] = (run_t){host_is_src ? x : y, x, y, 1};
        }
        ps = x;
        pd = y;
    }
    m++;
    /* In host slot order (stable), each run that continues the one before it on both sides joined to it. */
    if (!sorted_by_key(runs, m)) {
        merge_sort(runs, space, m);
        int64_t k = 0;
        for (int64_t i = 1; i < m; i++) {
            if (runs[i].s == runs[k].s + runs[k].n && runs[i].d == runs[k].d + runs[k].n)
                runs[k].n += runs[i].n;
            else
                runs[++k] = runs[i];
        }
        m = k + 1;
    }
    /* Two runs share a destination slot exactly when their destination intervals overlap: sorted by first
     * slot, when one begins before its predecessor ends (a backup's destination is the host side, sorted). */
    const run_t *by_dst = runs;
    if (host_is_src) {
        for (int64_t i = 0; i < m; i++)
            tmp[i] = (run_t){runs[i].d, 0, runs[i].d, runs[i].n};
        if (!sorted_by_key(tmp, m))
            merge_sort(tmp, space, m);
        by_dst = tmp;
    }
    for (int64_t i = 1; i < m; i++) {
        if (by_dst[i].d < by_dst[i - 1].d + by_dst[i - 1].n) {
            free(runs);
            return RC_DUPLICATE;
        }
    }
    /* Each run cut at the page boundaries of a paged side, as byte offsets. */
    int64_t count = 0, row = src.row;
    for (int64_t i = 0; i < m; i++) {
        int64_t s = runs[i].s, d = runs[i].d, left = runs[i].n;
        while (left > 0) {
            int64_t piece = left;
            if (src.page_size && src.page_size - s % src.page_size < piece)
                piece = src.page_size - s % src.page_size;
            if (dst.page_size && dst.page_size - d % dst.page_size < piece)
                piece = dst.page_size - d % dst.page_size;
            out[3 * count] = offset(&src, s);
            out[3 * count + 1] = offset(&dst, d);
            out[3 * count + 2] = piece * row;
            count++;
            s += piece;
            d += piece;
            left -= piece;
        }
    }
    free(runs);
    return count;
}

/* n bytes from s to d, which do not overlap: streaming stores from the first 16-byte aligned byte of d,
 * memcpy for the unaligned head and the tail. */
static void stream_copy(char *d, const char *s, size_t n) {
#if defined(__SSE2__)
    size_t head = (size_t)(-(uintptr_t)d & 15);
    if (head > n)
        head = n;
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + i, s + i, n - i);
#else
    memcpy(d, s, n);
#endif
}

/* Copy runs[3 * i .. 3 * i + 3) = (source byte, destination byte, bytes), i < count, for every (K/V, layer)
 * of a call: `layers` layers from layer s_first of the source to d_first of the destination. geometry:
 * the source and destination buffers' addresses, num_kv, the kv and layer strides of the source and of
 * the destination in bytes, the buffers' extents in bytes (an array made once per plan: a cold ctypes
 * call costs about 1 us per argument). Returns 0, or -1 - i for the first run i that reaches outside a
 * buffer at some K/V and layer (nothing copied then). */
int64_t rc_copy(const int64_t *geometry, const int64_t *runs, int64_t count, int64_t layers, int64_t s_first,
                int64_t d_first) {
    char *src = (char *)(intptr_t)geometry[0], *dst = (char *)(intptr_t)geometry[1];
    const int64_t num_kv = geometry[2], s_kv = geometry[3], s_layer = geometry[4], d_kv = geometry[5];
    const int64_t d_layer = geometry[6], s_extent = geometry[7], d_extent = geometry[8];
    const int64_t s_base = s_first * s_layer, d_base = d_first * d_layer;
    if (count <= 0 || layers <= 0 || num_kv <= 0)
        return 0;
    const int64_t s_top = s_base + (num_kv - 1) * s_kv + (layers - 1) * s_layer;
    const int64_t d_top = d_base + (num_kv - 1) * d_kv + (layers - 1) * d_layer;
    const int bases_inside = s_base >= 0 && d_base >= 0 && s_top <= s_extent && d_top <= d_extent;
    /* Each bound as a subtraction of values known to be in range (0 <= s, 0 <= s_extent - s_top): a
     * corrupted run's s + nb + s_top could overflow int64 (undefined behaviour, in practice a wrap past
     * the check). */
    for (int64_t i = 0; i < count; i++) {
        int64_t s = runs[3 * i], d = runs[3 * i + 1], nb = runs[3 * i + 2];
        if (!bases_inside || nb < 0 || s < 0 || d < 0 || nb > s_extent - s_top - s ||
            nb > d_extent - d_top - d)
            return -1 - i;
    }
    /* Streaming stores only between buffers that do not overlap (memmove is exact for any two). */
    const uintptr_t s_lo = (uintptr_t)src, d_lo = (uintptr_t)dst;
    /* a variable, not the macro: with RC_STREAM_MIN 0, nb >= (size_t)0 is a -Wtype-limits error */
    const size_t stream_min = (size_t)RC_STREAM_MIN;
    const int stream = RC_STREAM_MIN > 0 && (s_lo + (uintptr_t)s_extent <= d_lo || d_lo + (uintptr_t)d_extent <= s_lo);
    for (int64_t kv = 0; kv < num_kv; kv++) {
        for (int64_t layer = 0; layer < layers; layer++) {
            char *sp = src + s_base + kv * s_kv + layer * s_layer;
            char *dp = dst + d_base + kv * d_kv + layer * d_layer;
            for (int64_t i = 0; i < count; i++) {
                size_t nb = (size_t)runs[3 * i + 2];
                if (stream && nb >= stream_min)
                    stream_copy(dp + runs[3 * i + 1], sp + runs[3 * i], nb);
                else
                    memmove(dp + runs[3 * i + 1], sp + runs[3 * i], nb);
            }
        }
    }
#if defined(__SSE2__)
    if (stream)
        _mm_sfence(); /* the streamed bytes are visible to other threads when the call returns */
#endif
    return 0;
}
