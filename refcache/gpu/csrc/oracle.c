/* The content oracle's fast path for CPU pools (refcache/gpu/kv_oracle.py; loaded by refcache/gpu/native.py).
 *
 * A pool is addressed as rows of slots: row r (one (K/V, layer) pair, in the order of the multiplier table)
 * starts at base + r * row_stride bytes, slot s of it at + s * slot_stride bytes, and holds `width`
 * elements of `elem` bytes (head_num * head_dim). The expected element e of a position with seed `seed` in
 * row r is (seed * m[r * width + e]) >> 28 in 32-bit arithmetic (a value in [-8, 7]); its bits in the
 * pool's dtype are table[value + 8] (built by the caller from torch for that dtype). Every function checks
 * every slot index against `size` before touching memory and returns -1 on one out of range (the caller's
 * torch path then raises torch's own error).
 */
#include <stddef.h>
#include <stdint.h>

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

/* Compare rows [row_begin, row_end) of the checked positions of `slots` with the oracle. Returns the first
 * position (index into slots) whose bits differ in any of those rows, -2 when every checked position
 * matches, -1 when a slot is out of [0, size) or the element size is not 1, 2 or 4 (nothing read). */
int64_t oracle_check(const void *base, int64_t row_stride, int64_t slot_stride, int64_t size,
                     int64_t row_begin, int64_t row_end, const int64_t *slots, int64_t n, int64_t stride,
                     const int32_t *seeds, const int32_t *mult, int64_t width, const void *table,
                     int64_t elem) {
    if (!slots_in_range(slots, n, size) || stride < 1) return -1;
    const uint8_t *b = (const uint8_t *)base;
    switch (elem) {
        case 1:
            return check_uint8_t(b, row_stride, slot_stride, row_begin, row_end, slots, n, stride, seeds,
                                 mult, width, (const uint8_t *)table);
        case 2:
            return check_uint16_t(b, row_stride, slot_stride, row_begin, row_end, slots, n, stride, seeds,
                                  mult, width, (const uint16_t *)table);
        case 4:
            return check_uint32_t(b, row_stride, slot_stride, row_begin, row_end, slots, n, stride, seeds,
                                  mult, width, (const uint32_t *)table);
        default:
            return -1;
    }
}

/* Write every row of `slots` with the oracle's values (the fake forward pass's store). Returns 0, or -1
 * when a slot is out of [0, size) or the element size is not 1, 2 or 4 (nothing written). */
int64_t oracle_store(void *base, int64_t row_stride, int64_t slot_stride, int64_t size, int64_t rows,
                     const int64_t *slots, int64_t n, const int32_t *seeds, const int32_t *mult,
                     int64_t width, const void *table, int64_t elem) {
    if (!slots_in_range(slots, n, size)) return -1;
    uint8_t *b = (uint8_t *)base;
    switch (elem) {
        case 1:
            store_uint8_t(b, row_stride, slot_stride, rows, slots, n, seeds, mult, width, (const uint8_t *)table);
            return 0;
        case 2:
            store_uint16_t(b, row_stride, slot_stride, rows, slots, n, seeds, mult, width, (const uint16_t *)table);
            return 0;
        case 4:
            store_uint32_t(b, row_stride, slot_stride, rows, slots, n, seeds, mult, width, (const uint32_t *)table);
            return 0;
        default:
            return -1;
    }
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
