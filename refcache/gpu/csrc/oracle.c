/* The content oracle's fast path for CPU pools (refcache/gpu/kv_oracle.py; loaded by refcache/gpu/native.py).
 *
 * A pool is addressed as rows of slots: row r (one (K/V, layer) pair, in the order of the multiplier table)
 * starts at base + r * row_stride bytes, slot s of it at + s * slot_stride bytes, and holds `width`
 * elements of `elem` bytes (head_num * head_dim). The expected element e of a position with seed `seed` in
 * row r is (seed * m[r * width + e]) >> 28 in 32-bit arithmetic (a value in [-8, 7]); its bits in the
 * pool's dtype are table[value + 8] (built by the caller from torch for that dtype). Every function checks
 * its rows against the pool's (G_ROWS), the row width against the slot and every slot index against `size`
 * before touching memory, and returns -1 on one out of range (the caller's torch path then raises torch's
 * own error).
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* index into the 16-entry table: the top 4 bits of seed * m, sign flipped (value + 8) */
#define ORACLE_INDEX(seed, m) ((((uint32_t)(seed) * (uint32_t)(m)) >> 28) ^ 8u)

static int slots_in_range(const int64_t *slots, int64_t n, int64_t size) {
    for (int64_t i = 0; i < n; i++) {
        if (slots[i] < 0 || slots[i] >= size) return 0;
    }
    return 1;
}

/* Whether position i of a read of n positions is checked: every one (stride 1), or every stride-th and
 * the last ("sampled"). */
static int checked(int64_t i, int64_t n, int64_t stride) { return i == n - 1 || i % stride == 0; }

#define ORACLE_CHECK(T)                                                                                  \
    static int64_t check_##T(const uint8_t *base, int64_t row_stride, int64_t slot_stride,              \
                             int64_t row_begin, int64_t row_end, const int64_t *slots, int64_t n,       \
                             int64_t stride, const int32_t *seeds, const int32_t *mult, int64_t width,  \
                             const T *table) {                                                          \
        for (int64_t i = 0; i < n; i++) {                                                                \
            if (!checked(i, n, stride)) continue;                                                        \
            uint32_t seed = (uint32_t)seeds[i];                                                          \
            T diff = 0;                                                                                  \
            for (int64_t r = row_begin; r < row_end; r++) {                                              \
                const T *got = (const T *)(base + r * row_stride + slots[i] * slot_stride);              \
                const int32_t *m = mult + r * width;                                                     \
                for (int64_t e = 0; e < width; e++) diff |= got[e] ^ table[ORACLE_INDEX(seed, m[e])];  \
            }                                                                                            \
            if (diff) return i;                                                                          \
        }                                                                                                \
        return -2;                                                                                       \
    }

#define ORACLE_STORE(T)                                                                                  \
    static void store_##T(uint8_t *base, int64_t row_stride, int64_t slot_stride, int64_t rows,          \
                          const int64_t *slots, int64_t n, const int32_t *seeds, const int32_t *mult,   \
                          int64_t width, const T *table) {                                              \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            const int32_t *m = mult + r * width;                                                         \
            for (int64_t i = 0; i < n; i++) {                                                            \
                uint32_t seed = (uint32_t)seeds[i];                                                      \
                T *put = (T *)(base + r * row_stride + slots[i] * slot_stride);                          \
                for (int64_t e = 0; e < width; e++) put[e] = table[ORACLE_INDEX(seed, m[e])];           \
            }                                                                                            \
        }                                                                                                \
    }

ORACLE_CHECK(uint8_t)
ORACLE_CHECK(uint16_t)
ORACLE_CHECK(uint32_t)
ORACLE_STORE(uint8_t)
ORACLE_STORE(uint16_t)
ORACLE_STORE(uint32_t)

/* AVX2 versions (x86-64 with GCC or clang, chosen at run time when the CPU has AVX2; ORACLE_SIMD=0 builds
 * the plain loops only, which the tests also run): a block of 16 elements (8 for 4-byte ones) is 2
 * multiplies, 2 shifts and a table lookup by byte shuffles; a row's remainder runs the plain loop. */
#ifndef ORACLE_SIMD
#if defined(__x86_64__) && defined(__GNUC__)
#define ORACLE_SIMD 1
#else
#define ORACLE_SIMD 0
#endif
#endif

#if ORACLE_SIMD
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2")))

static int has_avx2(void) {
    static int known = -1;
    if (known < 0) known = __builtin_cpu_supports("avx2") ? 1 : 0;
    return known;
}

/* Slots are scattered over a pool far larger than the caches: ask for the rows of the slot AHEAD positions
 * on while this one is compared (a hint only: no effect on what is read or written). */
#define AHEAD 8
static inline void prefetch_rows(const uint8_t *base, int64_t row_stride, int64_t slot_stride, int64_t row_begin,
                                 int64_t row_end, const int64_t *slots, int64_t n, int64_t i, int write) {
    if (i >= n) return;
    for (int64_t r = row_begin; r < row_end; r++) {
        const uint8_t *p = base + r * row_stride + slots[i] * slot_stride;
        if (write)
            __builtin_prefetch(p, 1);
        else
            __builtin_prefetch(p, 0);
    }
}

/* the table indices (value + 8) of seed * m[0..15], in order, as 16-bit lanes */
AVX2 static inline __m256i indices16(__m256i s, const int32_t *m) {
    __m256i a = _mm256_srli_epi32(_mm256_mullo_epi32(s, _mm256_loadu_si256((const __m256i *)m)), 28);
    __m256i b = _mm256_srli_epi32(_mm256_mullo_epi32(s, _mm256_loadu_si256((const __m256i *)(m + 8))), 28);
    __m256i w = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
    return _mm256_xor_si256(w, _mm256_set1_epi16(8));
}

/* the low bytes (lo) and high bytes (hi) of a 16-entry table, each in both 128-bit lanes */
AVX2 static inline __m256i table_bytes(const uint8_t *bytes16) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)bytes16));
}

/* 16 expected 2-byte elements */
AVX2 static inline __m256i want_u16(__m256i idx, __m256i lo, __m256i hi) {
    __m256i low = _mm256_and_si256(_mm256_shuffle_epi8(lo, idx), _mm256_set1_epi16(0xFF));
    return _mm256_or_si256(low, _mm256_slli_epi16(_mm256_shuffle_epi8(hi, idx), 8));
}

/* 16 expected 1-byte elements */
AVX2 static inline __m128i want_u8(__m256i idx, __m256i lo) {
    __m256i low = _mm256_and_si256(_mm256_shuffle_epi8(lo, idx), _mm256_set1_epi16(0xFF));
    return _mm_packus_epi16(_mm256_castsi256_si128(low), _mm256_extracti128_si256(low, 1));
}

/* 8 expected 4-byte elements (t0: entries 0..7, t1: 8..15) */
AVX2 static inline __m256i want_u32(__m256i s, const int32_t *m, __m256i t0, __m256i t1) {
    __m256i idx = _mm256_srli_epi32(_mm256_mullo_epi32(s, _mm256_loadu_si256((const __m256i *)m)), 28);
    idx = _mm256_xor_si256(idx, _mm256_set1_epi32(8));
    __m256i low = _mm256_permutevar8x32_epi32(t0, idx), high = _mm256_permutevar8x32_epi32(t1, idx);
    return _mm256_blendv_epi8(low, high, _mm256_cmpgt_epi32(idx, _mm256_set1_epi32(7)));
}

/* a row's SIMD blocks: BLOCK elements each; WANT(e) the expected vector of elements e.., LOAD/STORE its
 * type's unaligned access, OR/XOR/ZERO/TESTZ its bitwise operations */
#define ORACLE_SIMD_FUNCS(T, VEC, BLOCK, SETUP, WANT, LOAD, STORE, OR, XOR, ZERO, TESTZ)                      \
    AVX2 static int64_t check_##T##_avx2(const uint8_t *base, int64_t row_stride, int64_t slot_stride,     \
                                         int64_t row_begin, int64_t row_end, const int64_t *slots,         \
                                         int64_t n, int64_t stride, const int32_t *seeds,                 \
                                         const int32_t *mult, int64_t width, const T *table) {             \
        SETUP;                                                                                           \
        int64_t blocks = width - width % BLOCK;                                                          \
        for (int64_t i = 0; i < n; i++) {                                                                \
            if (!checked(i, n, stride)) continue;                                                        \
            prefetch_rows(base, row_stride, slot_stride, row_begin, row_end, slots, n, i + AHEAD * stride, 0); \
            uint32_t seed = (uint32_t)seeds[i];                                                          \
            __m256i s = _mm256_set1_epi32((int32_t)seed);                                                \
            VEC acc = ZERO;                                                                              \
            T diff = 0;                                                                                  \
            for (int64_t r = row_begin; r < row_end; r++) {                                              \
                const T *got = (const T *)(base + r * row_stride + slots[i] * slot_stride);              \
                const int32_t *m = mult + r * width;                                                     \
                int64_t e = 0;                                                                           \
                for (; e < blocks; e += BLOCK) acc = OR(acc, XOR(WANT(e), LOAD(got + e)));                \
                for (; e < width; e++) diff |= got[e] ^ table[ORACLE_INDEX(seed, m[e])];                \
            }                                                                                            \
            if (diff || !TESTZ(acc)) return i;                                                           \
        }                                                                                                \
        return -2;                                                                                       \
    }                                                                                                    \
    AVX2 static void store_##T##_avx2(uint8_t *base, int64_t row_stride, int64_t slot_stride, int64_t rows, \
                                      const int64_t *slots, int64_t n, const int32_t *seeds,              \
                                      const int32_t *mult, int64_t width, const T *table) {               \
        SETUP;                                                                                           \
        int64_t blocks = width - width % BLOCK;                                                          \
        for (int64_t r = 0; r < rows; r++) {                                                             \
            const int32_t *m = mult + r * width;                                                         \
            for (int64_t i = 0; i < n; i++) {                                                            \
                prefetch_rows(base, row_stride, slot_stride, r, r + 1, slots, n, i + AHEAD, 1);          \
                uint32_t seed = (uint32_t)seeds[i];                                                      \
                __m256i s = _mm256_set1_epi32((int32_t)seed);                                            \
                T *put = (T *)(base + r * row_stride + slots[i] * slot_stride);                          \
                int64_t e = 0;                                                                           \
                for (; e < blocks; e += BLOCK) STORE(put + e, WANT(e));                                  \
                for (; e < width; e++) put[e] = table[ORACLE_INDEX(seed, m[e])];                        \
            }                                                                                            \
        }                                                                                                \
    }

#define LOAD256(p) _mm256_loadu_si256((const __m256i *)(p))
#define STORE256(p, v) _mm256_storeu_si256((__m256i *)(p), (v))
#define LOAD128(p) _mm_loadu_si128((const __m128i *)(p))
#define STORE128(p, v) _mm_storeu_si128((__m128i *)(p), (v))
#define TESTZ256(v) _mm256_testz_si256((v), (v))
#define TESTZ128(v) _mm_testz_si128((v), (v))

#define SETUP_U16                                                                                        \
    uint8_t lo_bytes[16], hi_bytes[16];                                                                  \
    for (int k = 0; k < 16; k++) lo_bytes[k] = (uint8_t)table[k], hi_bytes[k] = (uint8_t)(table[k] >> 8); \
    __m256i lo = table_bytes(lo_bytes), hi = table_bytes(hi_bytes)
#define SETUP_U8 __m256i lo = table_bytes(table)
#define SETUP_U32                                                                                        \
    __m256i t0 = LOAD256(table), t1 = LOAD256(table + 8)

#define WANT_U16(e) want_u16(indices16(s, m + (e)), lo, hi)
#define WANT_U8(e) want_u8(indices16(s, m + (e)), lo)
#define WANT_U32(e) want_u32(s, m + (e), t0, t1)

ORACLE_SIMD_FUNCS(uint16_t, __m256i, 16, SETUP_U16, WANT_U16, LOAD256,
                  STORE256, _mm256_or_si256, _mm256_xor_si256, _mm256_setzero_si256(), TESTZ256)
ORACLE_SIMD_FUNCS(uint8_t, __m128i, 16, SETUP_U8, WANT_U8, LOAD128, STORE128,
                  _mm_or_si128, _mm_xor_si128, _mm_setzero_si128(), TESTZ128)
ORACLE_SIMD_FUNCS(uint32_t, __m256i, 8, SETUP_U32, WANT_U32, LOAD256, STORE256,
                  _mm256_or_si256, _mm256_xor_si256, _mm256_setzero_si256(), TESTZ256)
#endif

/* Whether the check and the store run the AVX2 blocks on this machine (1) or the plain loops (0). */
int64_t oracle_simd(void) {
#if ORACLE_SIMD
    return has_avx2();
#else
    return 0;
#endif
}

/* A pool as the entry points see it: nine int64 values (built once per pool by the caller). */
enum {
    G_BASE,        /* address of row 0, slot 0 */
    G_ROW_STRIDE,  /* bytes from one (K/V, layer) row to the next */
    G_SLOT_STRIDE, /* bytes from one slot to the next */
    G_SIZE,        /* slots per row */
    G_WIDTH,       /* elements per (row, slot): head_num * head_dim */
    G_ELEM,        /* bytes per element: 1, 2 or 4 */
    G_MULT,        /* address of the int32 multipliers, width per row, in row order */
    G_TABLE,       /* address of the 16 bit patterns of -8..7 in the pool's dtype */
    G_ROWS,        /* (K/V, layer) rows in the pool */
};

/* Whether a slot row's elements fit in its slot (else every access would reach into the next one). */
static int width_fits(const int64_t *g) { return g[G_WIDTH] * g[G_ELEM] <= g[G_SLOT_STRIDE]; }

/* The kernel NAME_T for element type T: its AVX2 version where the CPU runs it, else the plain loop. */
#if ORACLE_SIMD
#define ORACLE_PICK(name, T) (has_avx2() ? name##_##T##_avx2 : name##_##T)
#else
#define ORACLE_PICK(name, T) name##_##T
#endif

/* Compare rows [row_begin, row_end) of the checked positions of `slots` with the oracle. Returns the first
 * position (index into slots) whose bits differ in any of those rows, -2 when every checked position
 * matches, -1 when a slot is out of [0, size), the rows are not within [0, G_ROWS), a slot row's elements
 * overrun its slot or the element size is not 1, 2 or 4 (nothing read). */
int64_t oracle_check(const int64_t *g, int64_t row_begin, int64_t row_end, const int64_t *slots, int64_t n,
                     int64_t stride, const int32_t *seeds) {
    if (row_begin < 0 || row_end > g[G_ROWS] || row_begin > row_end || !width_fits(g)) return -1;
    if (!slots_in_range(slots, n, g[G_SIZE]) || stride < 1) return -1;
#define ORACLE_CHECK_ARGS(T)                                                                              \
    ((const uint8_t *)(uintptr_t)g[G_BASE], g[G_ROW_STRIDE], g[G_SLOT_STRIDE], row_begin, row_end, slots, n, \
     stride, seeds, (const int32_t *)(uintptr_t)g[G_MULT], g[G_WIDTH], (const T *)(uintptr_t)g[G_TABLE])
    switch (g[G_ELEM]) {
        case 1: return ORACLE_PICK(check, uint8_t) ORACLE_CHECK_ARGS(uint8_t);
        case 2: return ORACLE_PICK(check, uint16_t) ORACLE_CHECK_ARGS(uint16_t);
        case 4: return ORACLE_PICK(check, uint32_t) ORACLE_CHECK_ARGS(uint32_t);
        default: return -1;
    }
}

/* Write rows [0, rows) of `slots` with the oracle's values (the fake forward pass's store). Returns 0, or
 * -1 when a slot is out of [0, size), rows is more than G_ROWS, a slot row's elements overrun its slot or
 * the element size is not 1, 2 or 4 (nothing written). */
int64_t oracle_store(const int64_t *g, int64_t rows, const int64_t *slots, int64_t n, const int32_t *seeds) {
    if (rows > g[G_ROWS] || !width_fits(g)) return -1;
    if (!slots_in_range(slots, n, g[G_SIZE])) return -1;
#define ORACLE_STORE_ARGS(T)                                                                              \
    ((uint8_t *)(uintptr_t)g[G_BASE], g[G_ROW_STRIDE], g[G_SLOT_STRIDE], rows, slots, n, seeds,           \
     (const int32_t *)(uintptr_t)g[G_MULT], g[G_WIDTH], (const T *)(uintptr_t)g[G_TABLE])
    switch (g[G_ELEM]) {
        case 1: ORACLE_PICK(store, uint8_t) ORACLE_STORE_ARGS(uint8_t); return 0;
        case 2: ORACLE_PICK(store, uint16_t) ORACLE_STORE_ARGS(uint16_t); return 0;
        case 4: ORACLE_PICK(store, uint32_t) ORACLE_STORE_ARGS(uint32_t); return 0;
        default: return -1;
    }
}

/* Copy the `width * elem` bytes at `row` into rows [0, rows) of every slot (the poisoning of freed slots:
 * `row` holds NaN in the pool's dtype). Returns 0, or -1 when a slot is out of [0, size), rows is more
 * than G_ROWS or a slot row's elements overrun its slot (nothing written). */
int64_t oracle_fill(const int64_t *g, int64_t rows, const int64_t *slots, int64_t n, const void *row) {
    if (rows > g[G_ROWS] || !width_fits(g)) return -1;
    if (!slots_in_range(slots, n, g[G_SIZE])) return -1;
    uint8_t *b = (uint8_t *)(uintptr_t)g[G_BASE];
    size_t bytes = (size_t)(g[G_WIDTH] * g[G_ELEM]);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < n; i++) memcpy(b + r * g[G_ROW_STRIDE] + slots[i] * g[G_SLOT_STRIDE], row, bytes);
    }
    return 0;
}

/* splitmix64's finaliser */
static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* The chain (KVOracle.advance): in place, values[i] becomes state(position + i) =
 * state + sum over j <= i of mix(values[j] ^ mix((position + j) ^ key)), wrapping; seeds[i] (when not
 * NULL) its top 32 bits. */
void oracle_advance(uint64_t *values, int64_t n, uint64_t state, uint64_t position, uint64_t key,
                    int32_t *seeds) {
    for (int64_t i = 0; i < n; i++) {
        state += mix(values[i] ^ mix((position + (uint64_t)i) ^ key));
        values[i] = state;
        if (seeds) seeds[i] = (int32_t)(uint32_t)(state >> 32);
    }
}
