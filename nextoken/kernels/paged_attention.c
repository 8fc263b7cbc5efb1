/* Paged decode attention: one new query token per sequence, keys and values read in place from
 * the paged KV cache (no gather copy). nextoken's own kernel; the reference it must match is
 * nextoken.layers.attention.paged_attention_reference.
 *
 * Layouts (row-major, as PyTorch hands them over):
 *   q          [B, H, D]               the new tokens' queries
 *   k/v cache  [Hkv, NB, BS, D]        one layer, head-major (float32, bf16, or int8 codes)
 *   k/v scales [Hkv, NB, BS] float32   int8 cache only: row (token, head) x = code * scale
 *   tables     [B, max_blocks] int64   block table of each sequence
 *   seq_lens   [B] int64               keys per sequence (including the new token's)
 *   out        [B, H, D]
 *
 * Split-K over the keys ("flash-decoding", Dao et al. 2023): every (sequence, KV head) is cut
 * into chunks of CHUNK keys, and each (sequence, KV head, chunk) is one task, so that one long
 * sequence of two KV heads still keeps every thread busy. A task computes, for the G = H / Hkv
 * query heads that share its KV head (each key and value row is read once for all of them):
 *   s_t = (scale q) . k_t,  m = max s_t,  p_t = exp(s_t - m),  l = sum p_t,  a = sum p_t v_t
 * in float32, and the combine step joins a sequence's chunks exactly (online softmax):
 *   M = max_c m_c,  out = sum_c exp(m_c - M) a_c / sum_c exp(m_c - M) l_c.
 * exp is a Cephes-style polynomial (relative error about 2e-7, 1-2 ulp). With AVX-512 the bf16
 * task body and exp are intrinsics (`chunk_bf16_avx512`); the plain C loops serve other CPUs,
 * float32, and head sizes that are not a multiple of 16. With AVX512-BF16, p v needs no
 * widening: p is split into two bf16 halves and each value row paired with itself (`pv_split`).
 * At depth the kernel is bound by memory: every block's rows are prefetched into L2 ahead of
 * use, the values' while their keys are scored.
 * int8 cache (`paged_decode_int8`, bf16 queries and output): s_t = scale (q . code_t) kscale_t
 * and p_t vscale_t weights the value codes, so rows are never dequantized in memory. With
 * AVX512-VNNI the query is quantized to int8 like a cache row and q . code_t is an exact
 * integer dot product (`scores_i8_vnni`); llama.cpp likewise quantizes the query for its q8_0
 * cache.
 * Tasks run in parallel over OpenMP (the runtime PyTorch already loaded, same soname).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define CHUNK 256 /* keys per task (a multiple of any block size we use) */
#define P_PAD 3 /* zero rows of p past the G heads': the p v loops run whole groups of up to 4 heads */

#if defined(__AVX512F__)
#include <immintrin.h>
#define VECTORIZED 1
#else
#define VECTORIZED 0
#endif

/* Loops over keys t in [t0, t1) of head h, block by block: the block table is read and divided
 * by once per block, not per key. ROW is key or value row t in CACHE, row_ its index in the
 * layer's [Hkv, NB, BS] rows (for the scales). Close with END_ROWS. */
#define FOR_ROWS(t, ROW, T, CACHE)                                                                        \
    for (int64_t t = t0; t < t1;) {                                                                       \
        const int64_t base_ = (h * NB + table[t / BS]) * BS;                                              \
        const T *blk_ = CACHE + base_ * D;                                                                \
        if ((t / BS + 1) * BS < t1) prefetch_rows(CACHE + (h * NB + table[t / BS + 1]) * BS * D, BS * D * (int64_t)sizeof(T)); \
        for (int64_t r_ = t % BS; r_ < BS && t < t1; r_++, t++) {                                         \
            const int64_t row_ = base_ + r_;                                                              \
            (void)row_;                                                                                   \
            const T *ROW = blk_ + r_ * D;
#define END_ROWS }}

/* The same walk in groups of up to four consecutive rows of one block: `rows` rows from key t
 * on, the first at GROUP in CACHE; the rows of these keys in VCACHE (the values, read next by
 * p v) are fetched meanwhile. Close with END_ROW_GROUPS. */
#define FOR_ROW_GROUPS(t, GROUP, rows, T, CACHE, VCACHE)                                                  \
    for (int64_t t = t0; t < t1;) {                                                                       \
        const T *blk_ = CACHE + (h * NB + table[t / BS]) * BS * D;                                        \
        if ((t / BS + 1) * BS < t1) prefetch_rows(CACHE + (h * NB + table[t / BS + 1]) * BS * D, BS * D * (int64_t)sizeof(T)); \
        prefetch_rows(VCACHE + (h * NB + table[t / BS]) * BS * D, BS * D * (int64_t)sizeof(T));           \
        const int64_t end_ = t % BS + (t1 - t) < BS ? t % BS + (t1 - t) : BS;                             \
        for (int64_t r_ = t % BS, rows = 0; r_ < end_; r_ += rows, t += rows) {                           \
            rows = end_ - r_ < 4 ? end_ - r_ : 4;                                                         \
            const T *GROUP = blk_ + r_ * D;
#define END_ROW_GROUPS }}

/* one layer's cache as the task bodies read it; the scales only for an int8 cache */
typedef struct {
    const void *k, *v;
    const float *ks, *vs;
} kv_t;

/* a block's rows, asked for ahead of use: blocks lie anywhere in the cache, so the hardware
 * prefetcher, which follows address streams within a page, cannot guess them. Into L2
 * (prefetcht1): L2 keeps more misses in flight than L1, and a task's values (64 KiB at most)
 * wait there while its keys are scored. Measured on Qwen2.5-1.5B's shapes at 4096 keys in
 * scattered blocks, 28 layers' caches in turn (cold, as in a decode step): 343 -> 238 us per
 * layer, the speed of a bare read of the same rows. */
static inline void prefetch_rows(const void *p, int64_t bytes) {
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch((const char *)p + off, 0, 2);
}

/* x[i] = exp(x[i] - m) for i < n; returns the sum. x[i] - m <= 0 (m is the maximum). */
static float exp_shifted(float *x, int64_t n, float m) {
    float sum = 0.f;
    int64_t i = 0;
#if VECTORIZED
    const __m512 vm = _mm512_set1_ps(m);
    __m512 vsum = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_max_ps(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm), _mm512_set1_ps(-87.f));
        const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512 r = _mm512_fmadd_ps(fx, _mm512_set1_ps(2.12194440e-4f),
                                         _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), v));
        __m512 y = _mm512_fmadd_ps(_mm512_set1_ps(1.9875691500e-4f), r, _mm512_set1_ps(1.3981999507e-3f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
        y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
        y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.f));
        y = _mm512_scalef_ps(y, fx); /* y 2^fx */
        _mm512_storeu_ps(x + i, y);
        vsum = _mm512_add_ps(vsum, y);
    }
    sum = _mm512_reduce_add_ps(vsum);
#endif
    for (; i < n; i++) {
        float v = x[i] - m;
        v = v < -87.f ? -87.f : v;
        const float fx = nearbyintf(v * 1.44269504088896341f); /* v = fx ln2 + r, |r| <= ln2 / 2 */
        const float r = v - fx * 0.693359375f + fx * 2.12194440e-4f;
        float y = ((((1.9875691500e-4f * r + 1.3981999507e-3f) * r + 8.3334519073e-3f) * r + 4.1665795894e-2f) * r +
                   1.6666665459e-1f) * r + 5.0000001201e-1f;
        y = ldexpf(y * r * r + r + 1.f, (int)fx);
        x[i] = y;
        sum += y;
    }
    return sum;
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < n; d++) s += a[d] * b[d];
    return s;
}

#if VECTORIZED
/* acc + the dot products of a and b's bf16 pairs (AVX512-BF16 where the CPU has it: exact
 * products, float32 sums; else both halves widened to float32 and FMA) */
static inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#if defined(__AVX512BF16__)
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000);
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                          acc);
    return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)),
                           acc);
#endif
}

/* q . k as 16 partial sums, for bf16 rows of D = 32 J2 */
static inline __m512 qk_partial(const uint16_t *kp, const uint16_t *qg, int64_t J2) {
    __m512 s = _mm512_setzero_ps();
    for (int64_t j = 0; j < J2; j++) s = dot_pairs(s, _mm512_loadu_si512(kp + 32 * j), _mm512_loadu_si512(qg + 32 * j));
    return s;
}

/* the totals of four vectors' lanes, as four floats (a transposing reduction: about three
 * instructions per vector instead of eight for one reduce each) */
static inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    __m512 y = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
    return _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                          0, 0, 0), y));
}

static inline __m512 widen16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

static inline __m512 widen16_i8(const int8_t *p) { /* 16 int8 codes -> float32, exact */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

static float max_of(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
    float r = _mm512_reduce_max_ps(m);
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}

/* a_g = sum_t p_gt v_t for the G heads of one task, J = D / 16 constant: GB heads at a time,
 * their accumulators in registers (p rows past G are zero, so a last partial group needs no
 * special case), each 16-lane slice of a value row widened once per group. Registers: GB J
 * accumulators (<= 24), GB probabilities, one slice (D = 128: GB 3, so that G = 6 heads take two
 * passes over the rows, not three; the widening costs as much as the FMAs). T, WIDEN: the
 * cache's element type and its 16-lane widening to float32. */
#define DEFINE_PV(NAME, JC, GB, T, WIDEN)                                                                \
static void NAME(const T *vc, const int64_t *table, int64_t h, int64_t t0, int64_t t1, int64_t G,       \
                 int64_t NB, int64_t BS, const float *sc, float *part) {                                \
    _Static_assert((GB) - 1 <= P_PAD, "p v group larger than the zero rows of p");                      \
    const int64_t D = 16 * (JC);                                                                        \
    for (int64_t g0 = 0; g0 < G; g0 += GB) {                                                            \
        __m512 acc[GB * (JC)];                                                                          \
        for (int64_t i = 0; i < GB * (JC); i++) acc[i] = _mm512_setzero_ps();                           \
        FOR_ROWS(t, vp, T, vc)                                                                          \
            __m512 p[GB];                                                                               \
            for (int64_t gi = 0; gi < GB; gi++) p[gi] = _mm512_set1_ps(sc[(g0 + gi) * CHUNK + t - t0]); \
            for (int64_t j = 0; j < (JC); j++) {                                                        \
                const __m512 row = WIDEN(vp + 16 * j);                                                  \
                for (int64_t gi = 0; gi < GB; gi++)                                                     \
                    acc[gi * (JC) + j] = _mm512_fmadd_ps(p[gi], row, acc[gi * (JC) + j]);               \
            }                                                                                           \
        END_ROWS                                                                                        \
        for (int64_t gi = 0; gi < GB && g0 + gi < G; gi++)                                              \
            for (int64_t j = 0; j < (JC); j++)                                                          \
                _mm512_storeu_ps(part + (g0 + gi) * (D + 2) + 16 * j, acc[gi * (JC) + j]);              \
    }                                                                                                   \
}
/* the same for any D = 16 J <= 256, accumulating in memory */
#define DEFINE_PV_ANY(NAME, T, WIDEN)                                                                    \
static void NAME(const T *vc, const int64_t *table, int64_t h, int64_t t0, int64_t t1, int64_t G, \
                       int64_t D, int64_t NB, int64_t BS, const float *sc, float *part) {               \
    for (int64_t g = 0; g < G; g++) memset(part + g * (D + 2), 0, sizeof(float) * D);                   \
    FOR_ROWS(t, vp, T, vc)                                                                              \
        __m512 row[16];                                                                                 \
        for (int64_t j = 0; j < D / 16; j++) row[j] = WIDEN(vp + 16 * j);                               \
        for (int64_t g = 0; g < G; g++) {                                                               \
            const __m512 p = _mm512_set1_ps(sc[g * CHUNK + t - t0]);                                    \
            float *a = part + g * (D + 2);                                                              \
            for (int64_t j = 0; j < D / 16; j++)                                                        \
                _mm512_storeu_ps(a + 16 * j, _mm512_fmadd_ps(p, row[j], _mm512_loadu_ps(a + 16 * j)));  \
        }                                                                                               \
    END_ROWS                                                                                            \
}
DEFINE_PV(pv_j4, 4, 4, uint16_t, widen16)
DEFINE_PV(pv_j8, 8, 3, uint16_t, widen16)
DEFINE_PV(pv_i8_j4, 4, 4, int8_t, widen16_i8)
DEFINE_PV(pv_i8_j8, 8, 3, int8_t, widen16_i8)
DEFINE_PV_ANY(pv_any, uint16_t, widen16)
DEFINE_PV_ANY(pv_i8_any, int8_t, widen16_i8)

/* per head g: the chunk's maximum score and sum of exp into part (a[D], a[D + 1]), the scores
 * replaced by exp(s - m) (p), then zero p rows for pv's padding heads */
static void softmax_rows(float *sc, float *part, int64_t G, int64_t D, int64_t n) {
    for (int64_t g = 0; g < G; g++) {
        float *s = sc + g * CHUNK, *a = part + g * (D + 2);
        a[D] = max_of(s, n);
        a[D + 1] = exp_shifted(s, n, a[D]);
    }
    memset(sc + G * CHUNK, 0, sizeof(float) * P_PAD * CHUNK);
}

/* the first `rows` of four scores */
static inline void store_scores(float *dst, __m128 s4, int64_t rows) {
    _mm_mask_storeu_ps(dst, (__mmask8)((1u << rows) - 1), s4);
}

static const uint16_t ZERO_ROW[256] __attribute__((aligned(64))); /* a bf16 row of zeros, D <= 256 */

/* Scores of bf16 rows, D = 32 J2C: QH query heads at a time with their queries held in registers
 * (a load feeds one dot product at most once per key row, not twice: loads, not arithmetic,
 * bounded the simple loop), four key rows at a time, each lane sum reduced by sum4. Registers:
 * QH J2C queries, 4 QH accumulators, J2C key vectors (<= 32). vc: the value cache, whose rows
 * for these keys are fetched into L2 meanwhile (for p v, next). */
#define DEFINE_QK(NAME, J2C, QH)                                                                         \
static void NAME(const uint16_t *qh, const uint16_t *kc, const uint16_t *vc, const int64_t *table,       \
                 int64_t h, int64_t t0, int64_t t1, int64_t G, int64_t NB, int64_t BS, float scale,     \
                 float *sc) {                                                                           \
    const int64_t D = 32 * (J2C);                                                                       \
    const __m128 vscale = _mm_set1_ps(scale);                                                           \
    for (int64_t g0 = 0; g0 < G; g0 += (QH)) {                                                          \
        const int64_t gn = G - g0 < (QH) ? G - g0 : (QH);                                               \
        __m512i qv[QH][J2C];                                                                            \
        for (int64_t gi = 0; gi < (QH); gi++)                                                           \
            for (int64_t j = 0; j < (J2C); j++)                                                         \
                qv[gi][j] = gi < gn ? _mm512_loadu_si512(qh + (g0 + gi) * D + 32 * j) : _mm512_setzero_si512(); \
        FOR_ROW_GROUPS(t, kg, rows, uint16_t, kc, vc)                                                   \
            __m512 acc[QH][4];                                                                          \
            for (int64_t gi = 0; gi < (QH); gi++)                                                       \
                for (int64_t i = 0; i < 4; i++) acc[gi][i] = _mm512_setzero_ps();                       \
            const uint16_t *kr[4]; /* rows past the group's end read zeros */                          \
            for (int64_t i = 0; i < 4; i++) kr[i] = i < rows ? kg + i * D : ZERO_ROW;                   \
            for (int64_t i = 0; i < 4; i++) {                                                           \
                for (int64_t j = 0; j < (J2C); j++) {                                                   \
                    const __m512i k = _mm512_loadu_si512(kr[i] + 32 * j);                               \
                    for (int64_t gi = 0; gi < (QH); gi++) acc[gi][i] = dot_pairs(acc[gi][i], k, qv[gi][j]); \
                }                                                                                       \
            }                                                                                           \
            for (int64_t gi = 0; gi < gn; gi++)                                                         \
                store_scores(sc + (g0 + gi) * CHUNK + t - t0,                                           \
                             _mm_mul_ps(sum4(acc[gi][0], acc[gi][1], acc[gi][2], acc[gi][3]), vscale), rows); \
        END_ROW_GROUPS                                                                                  \
    }                                                                                                   \
}
DEFINE_QK(qk_j2_2, 2, 4)
DEFINE_QK(qk_j2_4, 4, 3)
DEFINE_QK(qk_j2_8, 8, 1)

/* The same for any D = 32 J2 <= 256, one head at a time (its query read from memory). */
static void scores_bf16_any(const uint16_t *qh, const uint16_t *kc, const uint16_t *vc, const int64_t *table,
                            int64_t h, int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t NB, int64_t BS,
                            float scale, float *sc) {
    const __m128 vscale = _mm_set1_ps(scale);
    FOR_ROW_GROUPS(t, kg, rows, uint16_t, kc, vc)
        for (int64_t g = 0; g < G; g++) {
            const uint16_t *qg = qh + g * D;
            __m512 acc[4];
            for (int64_t i = 0; i < 4; i++) acc[i] = i < rows ? qk_partial(kg + i * D, qg, D / 32) : _mm512_setzero_ps();
            store_scores(sc + g * CHUNK + t - t0, _mm_mul_ps(sum4(acc[0], acc[1], acc[2], acc[3]), vscale), rows);
        }
    END_ROW_GROUPS
}

#if defined(__AVX512BF16__)
/* p v for bf16 rows with AVX512-BF16, D = 32 J2C, with no widening: each probability split into
 * two bf16 halves, p = hi + lo (hi = bf16(p), lo = bf16(p - hi): 16 significant bits, so p v
 * stays as exact as with float32 p), and each value row interleaved with itself (v_d, v_d in
 * each 32-bit lane), so that one vdpbf16ps adds v_d hi + v_d lo for 16 d. (Rounding p to a
 * single bf16, with two keys' rows paired, halves the instructions again but adds about 15% to
 * the output's error at a few hundred keys: tests/kernels/test_paged_attention holds the error to the
 * output's bf16 rounding.) The scores' rows hold each key's (hi, lo)
 * in place of its float (`split_probs`). unpacklo/hi work within 128-bit lanes: lane l of
 * accumulator 2j (2j + 1) holds d = 32 j + 8 (l / 4) + l % 4 (+ 4). GB query heads at a time,
 * each row unpacked once for them. Registers: 2 J2C GB accumulators, GB pairs, 3 for the row. */
#define DEFINE_PV_SPLIT(NAME, J2C, GB)                                                                   \
static void NAME(const uint16_t *vc, const int64_t *table, int64_t h, int64_t t0, int64_t t1, int64_t G, \
                 int64_t NB, int64_t BS, const float *sc, float *part) {                                \
    _Static_assert((GB) - 1 <= P_PAD, "p v group larger than the zero rows of p");                      \
    const int64_t D = 32 * (J2C);                                                                       \
    for (int64_t g0 = 0; g0 < G; g0 += (GB)) {                                                          \
        __m512 acc[(GB) * 2 * (J2C)];                                                                   \
        for (int64_t i = 0; i < (GB) * 2 * (J2C); i++) acc[i] = _mm512_setzero_ps();                    \
        FOR_ROWS(t, vp, uint16_t, vc)                                                                   \
            __m512i pp[GB];                                                                             \
            for (int64_t gi = 0; gi < (GB); gi++) pp[gi] = _mm512_set1_epi32(((const int32_t *)sc)[(g0 + gi) * CHUNK + t - t0]); \
            for (int64_t j = 0; j < (J2C); j++) {                                                       \
                const __m512i a = _mm512_loadu_si512(vp + 32 * j);                                      \
                const __m512i lo = _mm512_unpacklo_epi16(a, a), hi = _mm512_unpackhi_epi16(a, a);       \
                for (int64_t gi = 0; gi < (GB); gi++) {                                                 \
                    acc[gi * 2 * (J2C) + 2 * j] = dot_pairs(acc[gi * 2 * (J2C) + 2 * j], lo, pp[gi]);   \
                    acc[gi * 2 * (J2C) + 2 * j + 1] = dot_pairs(acc[gi * 2 * (J2C) + 2 * j + 1], hi, pp[gi]); \
                }                                                                                       \
            }                                                                                           \
        END_ROWS                                                                                        \
        for (int64_t gi = 0; gi < (GB) && g0 + gi < G; gi++)                                            \
            for (int64_t j = 0; j < 2 * (J2C); j++) {                                                   \
                float lanes[16], *a = part + (g0 + gi) * (D + 2) + 32 * (j / 2) + 4 * (j % 2);         \
                _mm512_storeu_ps(lanes, acc[gi * 2 * (J2C) + j]);                                       \
                for (int64_t l = 0; l < 16; l++) a[8 * (l / 4) + l % 4] = lanes[l];                     \
            }                                                                                           \
    }                                                                                                   \
}
DEFINE_PV_SPLIT(pv_split_j2_2, 2, 4)
DEFINE_PV_SPLIT(pv_split_j2_4, 4, 3)

/* each of the G rows' n probabilities rewritten in place as its (hi, lo) bf16 pair, hi in the low
 * half (round to nearest even, as PyTorch): the form pv_split reads */
static void split_probs(float *sc, int64_t G, int64_t n) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < n; i++) {
            float *x = sc + g * CHUNK + i;
            const uint16_t hi = f32_to_bf16(*x), lo = f32_to_bf16(*x - bf16_to_f32(hi));
            const uint32_t pair = (uint32_t)hi | (uint32_t)lo << 16;
            memcpy(x, &pair, sizeof pair);
        }
}
#endif

/* AVX-512 task body for bf16 rows of D = 32 J2 <= 256: scores (q . k times scale), softmax,
 * then p v: on split probabilities where the CPU has AVX512-BF16 and D is 64 or 128, else with
 * the value row widened once for GB query heads. */
static void chunk_bf16_avx512(const uint16_t *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h,
                              int64_t t0, int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS,
                              float scale, float *work, float *part) {
    const uint16_t *kc = kv->k, *vc = kv->v;
    const int64_t n = t1 - t0, J = D / 16;
    const uint16_t *qh = q + (b * H + h * G) * D;
    float *sc = work;
    const int64_t J2 = D / 32;
    if (J2 == 2)
        qk_j2_2(qh, kc, vc, table, h, t0, t1, G, NB, BS, scale, sc);
    else if (J2 == 4)
        qk_j2_4(qh, kc, vc, table, h, t0, t1, G, NB, BS, scale, sc);
    else if (J2 == 8)
        qk_j2_8(qh, kc, vc, table, h, t0, t1, G, NB, BS, scale, sc);
    else
        scores_bf16_any(qh, kc, vc, table, h, t0, t1, G, D, NB, BS, scale, sc);
    softmax_rows(sc, part, G, D, n);
#if defined(__AVX512BF16__)
    if (J == 4 || J == 8) {
        split_probs(sc, G, n);
        if (J == 4)
            pv_split_j2_2(vc, table, h, t0, t1, G, NB, BS, sc, part);
        else
            pv_split_j2_4(vc, table, h, t0, t1, G, NB, BS, sc, part);
        return;
    }
#endif
    if (J == 4)
        pv_j4(vc, table, h, t0, t1, G, NB, BS, sc, part);
    else if (J == 8)
        pv_j8(vc, table, h, t0, t1, G, NB, BS, sc, part);
    else
        pv_any(vc, table, h, t0, t1, G, D, NB, BS, sc, part);
}

#if defined(__AVX512VNNI__)
/* sum4 for int32 lanes: the four vectors' totals */
static inline __m128i sum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_shuffle_i32x4(a, b, 0x44), _mm512_shuffle_i32x4(a, b, 0xEE));
    const __m512i cd = _mm512_add_epi32(_mm512_shuffle_i32x4(c, d, 0x44), _mm512_shuffle_i32x4(c, d, 0xEE));
    __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(ab, cd, 0x88), _mm512_shuffle_i32x4(ab, cd, 0xDD));
    y = _mm512_add_epi32(y, _mm512_shuffle_epi32(y, 0x4E));
    y = _mm512_add_epi32(y, _mm512_shuffle_epi32(y, 0xB1));
    return _mm512_castsi512_si128(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0,
                                                                             0, 0, 0, 0), y));
}

/* int8 scores with AVX512-VNNI, D = 64 J64 <= 256: each query row is quantized to int8 as the
 * cache rows are (absmax, `qs` its scale), and q . k is an integer dot product: vpdpbusd takes
 * one unsigned operand, so the key codes enter as k + 128 (a sign-bit flip) and 128 sum(q) is
 * subtracted. s_t = (sum q_i k_i) qs scale kscale_t, the sums exact in int32. */
static void scores_i8_vnni(const uint16_t *qh, const int8_t *kc, const int8_t *vc, const int64_t *table, int64_t h,
                           int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t NB, int64_t BS, const float *ksc,
                           float *work, float *sc) {
    const int64_t J64 = D / 64;
    int8_t *qc = (int8_t *)work; /* G rows of D codes */
    float *qs = work + G * D / 4;
    int32_t *corr = (int32_t *)(qs + G);
    for (int64_t g = 0; g < G; g++) { /* 16 at a time: per task, this once cost as much as the dot products */
        __m512 m = _mm512_setzero_ps();
        for (int64_t i = 0; i < D; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(widen16(qh + g * D + i)));
        const float amax = _mm512_reduce_max_ps(m), inv = amax > 0.f ? 127.f / amax : 0.f;
        __m512i sum = _mm512_setzero_si512();
        for (int64_t i = 0; i < D; i += 16) { /* round to nearest even, as nearbyintf */
            const __m512i c = _mm512_cvtps_epi32(_mm512_mul_ps(widen16(qh + g * D + i), _mm512_set1_ps(inv)));
            _mm_storeu_si128((__m128i *)(qc + g * D + i), _mm512_cvtepi32_epi8(c));
            sum = _mm512_add_epi32(sum, c);
        }
        qs[g] = amax / 127.f;
        corr[g] = 128 * _mm512_reduce_add_epi32(sum);
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    FOR_ROW_GROUPS(t, kg, rows, int8_t, kc, vc)
        __m512i k[4][4];
        for (int64_t i = 0; i < 4; i++)
            for (int64_t j = 0; j < J64; j++)
                k[i][j] = i < rows ? _mm512_xor_si512(_mm512_loadu_si512(kg + i * D + 64 * j), flip)
                                   : _mm512_setzero_si512();
        const __m128 ks4 = _mm_loadu_ps(ksc + t - t0); /* past n: lanes dropped by store_scores */
        for (int64_t g = 0; g < G; g++) {
            __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < J64; j++) {
                const __m512i qv = _mm512_loadu_si512(qc + g * D + 64 * j);
                a0 = _mm512_dpbusd_epi32(a0, k[0][j], qv);
                a1 = _mm512_dpbusd_epi32(a1, k[1][j], qv);
                a2 = _mm512_dpbusd_epi32(a2, k[2][j], qv);
                a3 = _mm512_dpbusd_epi32(a3, k[3][j], qv);
            }
            const __m128i dots = _mm_sub_epi32(sum4_epi32(a0, a1, a2, a3), _mm_set1_epi32(corr[g]));
            store_scores(sc + g * CHUNK + t - t0, _mm_mul_ps(_mm_mul_ps(_mm_cvtepi32_ps(dots), _mm_set1_ps(qs[g])), ks4),
                         rows);
        }
    END_ROW_GROUPS
}
#endif

/* int8 scores in float32, D = 16 J <= 256: four key rows at a time widened once into kf (L1)
 * and dotted with each of the G queries. */
static void scores_i8_f32(const uint16_t *qh, const int8_t *kc, const int8_t *vc, const int64_t *table, int64_t h,
                          int64_t t0, int64_t t1, int64_t G, int64_t D, int64_t NB, int64_t BS, const float *ksc,
                          float *work, float *sc) {
    const int64_t J = D / 16;
    float *qf = work, *kf = work + G * D;
    for (int64_t i = 0; i < G * D; i++) qf[i] = bf16_to_f32(qh[i]);
    FOR_ROW_GROUPS(t, kg, rows, int8_t, kc, vc)
        for (int64_t i = 0; i < rows; i++)
            for (int64_t j = 0; j < J; j++) _mm512_storeu_ps(kf + i * D + 16 * j, widen16_i8(kg + i * D + 16 * j));
        for (int64_t i = rows; i < 4; i++) memset(kf + i * D, 0, sizeof(float) * D);
        for (int64_t g = 0; g < G; g++) {
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t j = 0; j < J; j++) {
                const __m512 qv = _mm512_loadu_ps(qf + g * D + 16 * j);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + 16 * j), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + D + 16 * j), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + 2 * D + 16 * j), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(kf + 3 * D + 16 * j), a3);
            }
            /* ksc past the chunk's n keys reads into vsc: those lanes are dropped by store_scores */
            store_scores(sc + g * CHUNK + t - t0, _mm_mul_ps(sum4(a0, a1, a2, a3), _mm_loadu_ps(ksc + t - t0)), rows);
        }
    END_ROW_GROUPS
}

/* AVX-512 task body for int8 rows of D = 16 J <= 256 (bf16 queries): scores (VNNI integer dot
 * products where the CPU has them and D % 64 == 0, else float32), then p v with each value row's
 * scale folded into p. Work: scores, then the key and value scales, then the scores' scratch. */
static void chunk_i8_avx512(const uint16_t *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h,
                            int64_t t0, int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS,
                            float scale, float *work, float *part) {
    const int8_t *kc = kv->k, *vc = kv->v;
    const int64_t n = t1 - t0, J = D / 16;
    const uint16_t *qh = q + (b * H + h * G) * D;
    float *sc = work, *ksc = sc + (G + P_PAD) * CHUNK, *vsc = ksc + CHUNK, *scratch = vsc + CHUNK;
    FOR_ROWS(t, vp, int8_t, vc) /* the chunk's scales, in key order */
        ksc[t - t0] = kv->ks[row_] * scale;
        vsc[t - t0] = kv->vs[row_];
        (void)vp;
    END_ROWS
#if defined(__AVX512VNNI__)
    if (D % 64 == 0)
        scores_i8_vnni(qh, kc, vc, table, h, t0, t1, G, D, NB, BS, ksc, scratch, sc);
    else
#endif
        scores_i8_f32(qh, kc, vc, table, h, t0, t1, G, D, NB, BS, ksc, scratch, sc);
    softmax_rows(sc, part, G, D, n);
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < n; i++) sc[g * CHUNK + i] *= vsc[i];
    if (J == 4)
        pv_i8_j4(vc, table, h, t0, t1, G, NB, BS, sc, part);
    else if (J == 8)
        pv_i8_j8(vc, table, h, t0, t1, G, NB, BS, sc, part);
    else
        pv_i8_any(vc, table, h, t0, t1, G, D, NB, BS, sc, part);
}
#endif

/* One task, plain C: keys [t0, t1) of sequence b, KV head h. part: G x (D + 2) floats, a then
 * m, l. QT, T: query and cache element types; ELEM widens a query element, WIDEN a cache row;
 * KS, VS: a key / value row's scale by its row index (1 for float caches). */
#define DEFINE_CHUNK(NAME, QT, T, ELEM, WIDEN, KS, VS)                                                  \
static void NAME(const QT *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h, int64_t t0,   \
                 int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale,      \
                 float *work, float *part) {                                                            \
    const T *kc = kv->k, *vc = kv->v;                                                                   \
    const int64_t n = t1 - t0;                                                                          \
    float *qf = work, *sc = qf + G * D, *row = sc + G * CHUNK;                                          \
    for (int64_t g = 0; g < G; g++)                                                                     \
        for (int64_t d = 0; d < D; d++) qf[g * D + d] = ELEM(q[(b * H + h * G + g) * D + d]) * scale;   \
    FOR_ROWS(t, kp, T, kc)                                                                              \
        WIDEN(row, kp, D);                                                                              \
        for (int64_t g = 0; g < G; g++) sc[g * CHUNK + t - t0] = dot(qf + g * D, row, D) * KS(row_);    \
    END_ROWS                                                                                            \
    for (int64_t g = 0; g < G; g++) {                                                                   \
        float *s = sc + g * CHUNK, m = -INFINITY;                                                       \
        for (int64_t i = 0; i < n; i++) m = s[i] > m ? s[i] : m;                                        \
        float *a = part + g * (D + 2);                                                                  \
        a[D] = m;                                                                                       \
        a[D + 1] = exp_shifted(s, n, m);                                                                \
        memset(a, 0, sizeof(float) * D);                                                                \
    }                                                                                                   \
    FOR_ROWS(t, vp, T, vc)                                                                              \
        WIDEN(row, vp, D);                                                                              \
        for (int64_t g = 0; g < G; g++) {                                                               \
            const float p = sc[g * CHUNK + t - t0] * VS(row_);                                          \
            float *a = part + g * (D + 2);                                                              \
            _Pragma("omp simd")                                                                         \
            for (int64_t d = 0; d < D; d++) a[d] += p * row[d];                                         \
        }                                                                                               \
    END_ROWS                                                                                            \
}

typedef void (*chunk_fn)(const void *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h, int64_t t0,
                         int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale,
                         float *work, float *part);

/* The whole call: tasks over (sequence, KV head, chunk), each run by `body`, then each
 * (sequence, query head)'s chunks combined; out is bf16 when `out_bf16`, else float32.
 * Sequence b reads keys starts[b] .. seq_lens[b] - 1 (a sliding window), or from 0 when
 * `starts` is NULL. Returns 1 when out of memory. */
static int paged_decode(chunk_fn body, const void *q, const kv_t *kv, const int64_t *tables, int64_t max_blocks,
                        const int64_t *seq_lens, const int64_t *starts, int64_t B, int64_t H, int64_t Hkv,
                        int64_t D, int64_t NB, int64_t BS, float scale, void *out, int out_bf16) {
    const int64_t G = H / Hkv, P = G * (D + 2);
    int64_t *first = malloc(sizeof(int64_t) * (B + 1)); /* first chunk of each sequence */
    if (!first) return 1;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++)
        first[b + 1] = first[b] + (seq_lens[b] - (starts ? starts[b] : 0) + CHUNK - 1) / CHUNK;
    const int64_t chunks = first[B];
    int64_t *seq = malloc(sizeof(int64_t) * (chunks + 1));
    float *parts = malloc(sizeof(float) * (chunks * Hkv * P + 1));
    if (!seq || !parts) { free(first); free(seq); free(parts); return 1; }
    for (int64_t b = 0; b < B; b++)
        for (int64_t c = first[b]; c < first[b + 1]; c++) seq[c] = b;
    int failed = 0;
    #pragma omp parallel
    {
        /* scores (G + P_PAD chunks), key and value scales (2 chunks), q as float32 (G D) and 4
         * widened rows (or q's codes, scales and sums), or for the plain loops q, scores, a row */
        float *work = malloc(sizeof(float) * ((G + P_PAD + 2) * CHUNK + G * D + 4 * D + 2 * G));
        if (!work) failed = 1;
        #pragma omp for collapse(2) schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t h = 0; h < Hkv; h++) {
                if (!work) continue;
                const int64_t b = seq[c], t0 = (starts ? starts[b] : 0) + (c - first[b]) * CHUNK;
                const int64_t t1 = t0 + CHUNK < seq_lens[b] ? t0 + CHUNK : seq_lens[b];
                body(q, kv, tables + b * max_blocks, b, h, t0, t1, H, G, D, NB, BS, scale, work,
                     parts + (c * Hkv + h) * P);
            }
        }
        free(work);
        if (!failed) {
            #pragma omp for collapse(2) schedule(static)
            for (int64_t b = 0; b < B; b++) {
                for (int64_t hq = 0; hq < H; hq++) {
                    const int64_t h = hq / G, g = hq % G;
                    float M = -INFINITY, L = 0.f, acc[256];
                    for (int64_t c = first[b]; c < first[b + 1]; c++) {
                        const float m = parts[(c * Hkv + h) * P + g * (D + 2) + D];
                        M = m > M ? m : M;
                    }
                    memset(acc, 0, sizeof(float) * D);
                    for (int64_t c = first[b]; c < first[b + 1]; c++) {
                        const float *a = parts + (c * Hkv + h) * P + g * (D + 2);
                        const float w = expf(a[D] - M);
                        L += w * a[D + 1];
                        for (int64_t d = 0; d < D; d++) acc[d] += w * a[d];
                    }
                    const float inv = 1.f / L;
                    const int64_t o = (b * H + hq) * D;
                    for (int64_t d = 0; d < D; d++) {
                        if (out_bf16)
                            ((uint16_t *)out)[o + d] = f32_to_bf16(acc[d] * inv);
                        else
                            ((float *)out)[o + d] = acc[d] * inv;
                    }
                }
            }
        }
    }
    free(first);
    free(seq);
    free(parts);
    return failed;
}

#define ELEM_F32(x) (x)
#define WIDEN_F32(row, src, n) memcpy((row), (src), sizeof(float) * (n))
#define NO_SCALE(r) 1.f
#define KSCALE(r) kv->ks[r]
#define VSCALE(r) kv->vs[r]
/* bf16 is the top half of a float32: widen a row with shifts the compiler vectorizes */
#define WIDEN_BF16(row, src, n)                                                                           \
    do {                                                                                                  \
        uint32_t *u_ = (uint32_t *)(row);                                                                 \
        _Pragma("omp simd")                                                                               \
        for (int64_t i_ = 0; i_ < (n); i_++) u_[i_] = ((uint32_t)(src)[i_]) << 16;                        \
    } while (0)
#define WIDEN_I8(row, src, n)                                                                             \
    do {                                                                                                  \
        _Pragma("omp simd")                                                                               \
        for (int64_t i_ = 0; i_ < (n); i_++) (row)[i_] = (float)(src)[i_];                                \
    } while (0)
DEFINE_CHUNK(chunk_f32, float, float, ELEM_F32, WIDEN_F32, NO_SCALE, NO_SCALE)
DEFINE_CHUNK(chunk_bf16_plain, uint16_t, uint16_t, bf16_to_f32, WIDEN_BF16, NO_SCALE, NO_SCALE)
DEFINE_CHUNK(chunk_i8_plain, uint16_t, int8_t, bf16_to_f32, WIDEN_I8, KSCALE, VSCALE)

/* the bf16 and int8 task bodies: the AVX-512 ones where they apply, else plain C */
static void chunk_bf16(const void *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h, int64_t t0,
                       int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale, float *work,
                       float *part) {
#if VECTORIZED
    if (D % 32 == 0) {
        chunk_bf16_avx512(q, kv, table, b, h, t0, t1, H, G, D, NB, BS, scale, work, part);
        return;
    }
#endif
    chunk_bf16_plain(q, kv, table, b, h, t0, t1, H, G, D, NB, BS, scale, work, part);
}

static void chunk_i8(const void *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h, int64_t t0,
                     int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale, float *work,
                     float *part) {
#if VECTORIZED
    if (D % 16 == 0) {
        chunk_i8_avx512(q, kv, table, b, h, t0, t1, H, G, D, NB, BS, scale, work, part);
        return;
    }
#endif
    chunk_i8_plain(q, kv, table, b, h, t0, t1, H, G, D, NB, BS, scale, work, part);
}

static void chunk_f32_body(const void *q, const kv_t *kv, const int64_t *table, int64_t b, int64_t h, int64_t t0,
                           int64_t t1, int64_t H, int64_t G, int64_t D, int64_t NB, int64_t BS, float scale,
                           float *work, float *part) {
    chunk_f32(q, kv, table, b, h, t0, t1, H, G, D, NB, BS, scale, work, part);
}

/* The entry points: q, out [B, H, D] in the cache's dtype (bf16 for the int8 cache); `starts`
 * [B] (or NULL: from 0): the first key of each sequence's window. */
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *tables, int64_t max_blocks,
                     const int64_t *seq_lens, const int64_t *starts, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t NB, int64_t BS,
                     float scale, float *out) {
    const kv_t kv = {kc, vc, NULL, NULL};
    return paged_decode(chunk_f32_body, q, &kv, tables, max_blocks, seq_lens, starts, B, H, Hkv, D, NB, BS, scale, out, 0);
}

int paged_decode_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int64_t *tables,
                      int64_t max_blocks, const int64_t *seq_lens, const int64_t *starts, int64_t B, int64_t H,
                      int64_t Hkv, int64_t D, int64_t NB, int64_t BS, float scale, uint16_t *out) {
    const kv_t kv = {kc, vc, NULL, NULL};
    return paged_decode(chunk_bf16, q, &kv, tables, max_blocks, seq_lens, starts, B, H, Hkv, D, NB, BS, scale, out, 1);
}

int paged_decode_int8(const uint16_t *q, const int8_t *kc, const int8_t *vc, const float *ks, const float *vs,
                      const int64_t *tables, int64_t max_blocks, const int64_t *seq_lens, const int64_t *starts,
                      int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t NB, int64_t BS, float scale,
                      uint16_t *out) {
    const kv_t kv = {kc, vc, ks, vs};
    return paged_decode(chunk_i8, q, &kv, tables, max_blocks, seq_lens, starts, B, H, Hkv, D, NB, BS, scale, out, 1);
}

/* Limits the caller checks before calling: head_dim <= 256, query heads per KV head <= 64. */
int paged_decode_max_head_dim(void) { return 256; }
int paged_decode_max_group(void) { return 64; }
