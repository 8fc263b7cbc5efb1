/* Quantized matmul y = x W^T (+ bias) on GGUF block weights, with int8 activations.
 * nextoken's own kernel; the reference it must match is nextoken.layers.quantization.qweight
 * (`QuantWeight.dequantize` for the weights, `qmatmul_reference` for the arithmetic).
 *
 * Weights (qw_t), converted once at load by layers/qweight.py: W[n, k] = scale[n, g] * u[n, k] + min[n, g]
 * with g = k / G (G = 16 or 32) and u an unsigned 4- or 8-bit code, in tiles of 16 rows:
 *   codes   [N/16, K/G, 16*G*bits/8] uint8. In tile t and group g, 64-byte vector j holds, in
 *           32-bit lane l, the codes of row 16t + l for four consecutive columns:
 *             8 bits: byte i of lane l of vector j = u[16t + l, G g + 4 j + i]
 *             4 bits (G = 32): low nibble = u[16t + l, 32 g + 4 j + i],
 *                              high nibble = u[16t + l, 32 g + 16 + 4 j + i]   (j < 4)
 *             5 bits (G = 32, Q5_0): the 4-bit layout's 256 bytes, then 64 bytes of 5th bits:
 *                              byte (l, i): bit j = column 4j + i, bit 4 + j = column 16 + 4j + i
 *             6 bits (G = 16, Q6_K): 128 bytes of low 4 bits, then 64 bytes of high 2 bits:
 *                              vector a < 2: low nibble = column 4a + i, high nibble = 8 + 4a + i;
 *                              vector 2, byte (l, i): bits 2j..2j+1 = high bits of column 4j + i
 *             4 bits with G = 16 (Q3_K, Q2_K, IQ2_XS, IQ2_S): the 6-bit layout's 128 bytes of low bits
 *   scales  [N/16, K/G, 16] (lane l: row 16t + l), as GGUF stores them, so as few bytes as GGUF:
 *             float16, when scale_sup is NULL (Q4_0, Q4_1, Q5_0, Q8_0: one f16 per block);
 *             int8 times scale_sup [N/16, K/G/gps, 16] float32, one per super-block of gps groups
 *             (Q4_K: 6-bit sc times d; Q6_K: int8 sc times d).
 *   mins    the same two forms (min_sup), or NULL: then min = -offset * scale.
 * So one VNNI instruction (vpdpbusd: unsigned codes x signed activations, four products per
 * 32-bit lane) advances 16 rows by four columns, with the activations' four bytes broadcast:
 * the 16 rows' sums stay in the 16 lanes and no horizontal reduction is ever needed.
 *
 * Activations: each row of x is quantized per block of QB columns: 32 for the legacy formats (as
 * llama.cpp's Q8_1), the 256-column super-block for the K-quants (as llama.cpp's Q8_K; qw_act_block):
 *   dx = max|x| / 127, xq = round_half_even(x * (1 / dx)), in -127..127,
 *   y[m, n] = sum_g scale[n, g] dx[m, g] sum_{k in g} u xq  +  min[n, g] dx[m, g] sum_{k in g} xq.
 * Blocking (VNNI): a pass runs two tiles (32 rows) against up to MB = 6 activation rows, with
 * each group's 12 integer sums in registers: every unpacked weight vector serves 6 rows and
 * every activation broadcast 2 tiles. Rows go in blocks of MBLOCK = 48 (kept in L2 while every
 * tile passes); pairs of tiles are split over OpenMP threads (PyTorch's own libgomp: one pool).
 * The legacy formats scale each group's sum in float32 (tiles_mb); the K-quants, whose dx is one
 * per super-block, add a super-block's scaled sums in integers and scale once (tiles_sb). At 512
 * rows, Q4_K runs at 55-65% of the VNNI peak (one 64-byte vpdpbusd per cycle and core: 3.3-3.6
 * G/s per core measured on this Zen 4) and Q6_K at 47-57%, ahead of PyTorch's bf16 matmul on the
 * expanded weight (benchmarks/qmatmul.py). vpmulld, vpdpwssd and float multiplies take the same
 * slot as vpdpbusd (benchmarks/vnni_slots.c): Q4_K's loop can reach about 80% of the peak.
 * Decode (1 or 2 rows) streams the weights from memory once per token: the codes are prefetched
 * a few groups ahead; Q4_K at one row went from 60 to about 95 GB/s from L3 and from 31 to 35
 * GB/s from memory. One row runs one tile at a time (one stream of codes per thread, see
 * qmatmul_q), prefetched into L2.
 * Where the CPU has AMX-INT8, calls of 32 rows or more run on tiles (qmatmul_amx.c): the same
 * integer sums and float operations, so the same outputs bit for bit.
 * A portable C loop computes the same sums where VNNI is missing. Requires N % 16 == 0 and
 * K % 32 == 0.
 */
#define _POSIX_C_SOURCE 200112L /* posix_memalign under -std=c11 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* what y holds (the y_bf16 argument of the calls below): float32, bf16, or float32 values rounded to
 * bf16 (the LM head's logits: a bf16 model's numbers, without a second pass to widen them) */
#define Y_F32 0
#define Y_BF16 1
#define Y_F32_RB 2
static inline void store1(void *y, int y_mode, int64_t idx, float v) {
    if (y_mode == Y_BF16) ((uint16_t *)y)[idx] = f32_to_bf16(v);
    else ((float *)y)[idx] = y_mode == Y_F32_RB ? rb(v) : v;
}
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QM_VNNI 1
#endif

#define TILE 16
#define MB 6 /* activation rows per pass over pairs of tiles */
#ifndef MB1
#define MB1 8 /* activation rows per pass over one tile (nt * mb accumulators: at most 2 MB): see qmatmul_q_n */
#endif
#if MB1 < 1 || MB1 > 8
#error "MB1 must be 1 .. 8 (TILES_MB1's cases; each more costs compile time: cases to 12 doubled it)"
#endif
#define MBLOCK 48 /* activation rows per block (see qmatmul_q) */
#ifndef DECODE_ROWS
#define DECODE_ROWS 16 /* calls of at most this many rows stream each tile from memory once (group_sums) */
#endif
#ifndef ONE_TILE_ROWS
#define ONE_TILE_ROWS 8 /* calls of at most this many rows go one tile a task (qmatmul_q_n) */
#endif
#ifndef AVX2_PF
#define AVX2_PF 4 /* the AVX2 loop's decode prefetch, in groups ahead: Qwen2.5-0.5B decode +5%, its Q8_0 +7% */
#endif
#ifndef AVX2_PF_SB
#define AVX2_PF_SB 8 /* the same for the super-block formats: Q6_K one row 14.0-14.2 -> 16.7-17.3 GB/s, Q4_K +2-5% */
#endif
#ifndef PF_GROUPS
#define PF_GROUPS 8 /* prefill's prefetch distance, in groups (into L1) */
#endif
/* A split build (`toolchain.build`, which compiles the loops' functions as QM_PARTS units in
 * parallel with the rest: decode.c's native build 23 s on one core, two thirds of it those
 * functions): each unit is this file compiled with QM_PART = 1 .. QM_PARTS, defining only its
 * part's loop functions (QM_IN_PART) and nothing after them; the main unit declares them all. The
 * functions are the same code either way (noinline: no call into them was ever inlined). */
#ifdef QM_PARTS
#define QM_LOOP_FN __attribute__((noinline, visibility("hidden")))
#ifdef QM_PART
#define QM_IN_PART(k) (QM_PART == (k))
#else
#define QM_IN_PART(k) 0 /* the main unit: declared only */
#endif
#else
#define QM_IN_PART(k) 1
#define QM_LOOP_FN static __attribute__((noinline))
#endif
#ifndef PF_DECODE_BYTES
#define PF_DECODE_BYTES 8192 /* decode's, in bytes of codes (into L2): see group_sums */
#endif


/* ---- activations ------------------------------------------------------------------------ */
typedef struct {
    int8_t *q;    /* [M, K] */
    float *dx;    /* [M, K/QB]: one scale per block of QB columns */
    float *xs16;  /* [M, K/16]: dx * sum of xq over each 16 columns (the VNNI build: only when QB == 32) */
    float *xs32;  /* [M, K/32]: the same over each 32 */
    int16_t *bs16, *bs32; /* [M, K/16], [M, K/32]: the sums of xq themselves (|sum| <= 32 * 127);
                           * only when QB != 32 */
    int64_t M, K, QB;
} qact_t;

#ifdef QM_VNNI
static inline __m512 load16(const void *x, int x_bf16, int64_t k) {
    if (x_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + k))), 16));
    return _mm512_loadu_ps((const float *)x + k);
}

/* the plain loop's arithmetic (below), 16 lanes at a time: the same d and 1 / d, and the conversion's
 * default rounding (to nearest even) is rintf's. One scale per block of QB (32 or 256) columns. */
static inline __attribute__((always_inline)) void quantize_row_qb(const void *x, int x_bf16, int64_t K, const int64_t QB,
                                                                  int8_t *q, float *dx, float *xs16, float *xs32,
                                                                  int16_t *bs16, int16_t *bs32) {
    for (int64_t b0 = 0; b0 < K; b0 += QB) {
        float d = 0.f;
        __m512 id = _mm512_setzero_ps();
        if (QB != 32) { /* 32 columns: below, from the block's two loads */
            __m512 mx = _mm512_setzero_ps();
            for (int64_t k = b0; k < b0 + QB; k += 16) mx = _mm512_max_ps(mx, _mm512_abs_ps(load16(x, x_bf16, k)));
            d = _mm512_reduce_max_ps(mx) / 127.f;
            id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
            dx[b0 / QB] = d;
        }
        for (int64_t b = b0 / 32; b < (b0 + QB) / 32; b++) {
            const __m512 x0 = load16(x, x_bf16, 32 * b), x1 = load16(x, x_bf16, 32 * b + 16);
            if (QB == 32) {
                d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1))) / 127.f;
                id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
                dx[b] = d;
            }
            const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
            _mm_storeu_si128((__m128i *)(q + 32 * b), _mm512_cvtepi32_epi8(q0));
            _mm_storeu_si128((__m128i *)(q + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
            const int s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
            if (QB == 32) { /* the float sums for tiles_mb, the integer ones for tiles_sb */
                xs32[b] = d * (float)(s0 + s1);
                xs16[2 * b] = d * (float)s0;
                xs16[2 * b + 1] = d * (float)s1;
            } else {
                bs32[b] = (int16_t)(s0 + s1);
                bs16[2 * b] = (int16_t)s0;
                bs16[2 * b + 1] = (int16_t)s1;
            }
        }
    }
}
/* compiled once per block size, so that 32 columns keep the single pass they had alone */
static void quantize_row(const void *x, int x_bf16, int64_t K, int64_t QB, int8_t *q, float *dx, float *xs16,
                         float *xs32, int16_t *bs16, int16_t *bs32) {
    if (QB == 32) quantize_row_qb(x, x_bf16, K, 32, q, dx, xs16, xs32, bs16, bs32);
    else quantize_row_qb(x, x_bf16, K, QB, q, dx, xs16, xs32, bs16, bs32);
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline __m256 load8(const void *x, int x_bf16, int64_t k) {
    if (x_bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + k))), 16));
    return _mm256_loadu_ps((const float *)x + k);
}

/* the plain loop's arithmetic (below), 8 lanes at a time: the same max, d and 1 / d, and the
 * conversion's default rounding (to nearest even) is rintf's; codes packed with saturation (never
 * reached: |x / d| <= 127). The plain loop (fmaxf calls, one rintf a column) took 7% of Qwen2.5-1.5B's
 * AVX2 prefill. */
static void quantize_row(const void *x, int x_bf16, int64_t K, int64_t QB, int8_t *q, float *dx, float *xs16,
                         float *xs32, int16_t *bs16, int16_t *bs32) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    for (int64_t b0 = 0; b0 < K; b0 += QB) {
        __m256 mx = _mm256_setzero_ps();
        for (int64_t k = b0; k < b0 + QB; k += 8) mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, load8(x, x_bf16, k)));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        const float d = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4))) / 127.f;
        const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
        dx[b0 / QB] = d;
        for (int64_t b = b0 / 32; b < (b0 + QB) / 32; b++) {
            int s[2];
            for (int h = 0; h < 2; h++) { /* columns 16h .. 16h + 15 of the block */
                const int64_t k = 32 * b + 16 * h;
                const __m256i v0 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, x_bf16, k), id));
                const __m256i v1 = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x, x_bf16, k + 8), id));
                const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(v0, v1), 0xD8); /* 16 int16 in order */
                _mm_storeu_si128((__m128i *)(q + k), _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
                __m128i t = _mm_add_epi32(_mm256_castsi256_si128(_mm256_add_epi32(v0, v1)),
                                          _mm256_extracti128_si256(_mm256_add_epi32(v0, v1), 1));
                t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
                s[h] = _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
            }
            xs32[b] = d * (float)(s[0] + s[1]);
            xs16[2 * b] = d * (float)s[0];
            xs16[2 * b + 1] = d * (float)s[1];
            bs32[b] = (int16_t)(s[0] + s[1]);
            bs16[2 * b] = (int16_t)s[0];
            bs16[2 * b + 1] = (int16_t)s[1];
        }
    }
}
#else
static void quantize_row(const void *x, int x_bf16, int64_t K, int64_t QB, int8_t *q, float *dx, float *xs16,
                         float *xs32, int16_t *bs16, int16_t *bs32) {
    for (int64_t b0 = 0; b0 < K; b0 += QB) {
        float amax = 0.f;
        for (int64_t k = b0; k < b0 + QB; k++)
            amax = fmaxf(amax, fabsf(x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k]));
        const float d = amax / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        dx[b0 / QB] = d;
        for (int64_t b = b0 / 32; b < (b0 + QB) / 32; b++) {
            int s[2] = {0, 0};
            for (int i = 0; i < 32; i++) {
                const int64_t k = b * 32 + i;
                const float xk = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
                const int v = (int)rintf(xk * id); /* default rounding: to nearest even */
                q[k] = (int8_t)v;
                s[i / 16] += v;
            }
            xs32[b] = d * (float)(s[0] + s[1]);
            xs16[2 * b] = d * (float)s[0];
            xs16[2 * b + 1] = d * (float)s[1];
            bs32[b] = (int16_t)(s[0] + s[1]); /* (the AVX2 loop's 8-bit codes read them too) */
            bs16[2 * b] = (int16_t)s[0];
            bs16[2 * b + 1] = (int16_t)s[1];
        }
    }
}
#endif

/* Quantize x [M, K] (bf16 or float32) into a, one scale per QB columns (32, or 256 for the
 * super-block formats; see qw_act_block); free it with qact_free. 0, or 1 when out of memory. */
static int quantize(const void *x, int x_bf16, int64_t M, int64_t K, int64_t QB, qact_t *a) {
    void *mem = NULL;
    /* the int16 sums only for tiles_sb (QB 256): each call's buffer is fresh memory, faulted in
     * page by page, and 32 columns ran 2% slower with them */
#ifdef QM_VNNI
    const size_t nbs = QB == 32 ? 0 : (size_t)(M * (K / 16 + K / 32 + K / 32)); /* (the last: keeps q 4-byte aligned) */
#else
    const size_t nbs = (size_t)(M * (K / 16 + K / 32 + K / 32)); /* the plain and AVX2 loops: always */
#endif
    if (posix_memalign(&mem, 64, sizeof(float) * M * (K / 32 + K / 16 + K / 32) + sizeof(int16_t) * nbs + (size_t)(M * K) + 64))
        return 1;
    a->dx = (float *)mem;
    a->xs16 = a->dx + M * (K / 32);
    a->xs32 = a->xs16 + M * (K / 16);
    a->bs16 = (int16_t *)(a->xs32 + M * (K / 32));
    a->bs32 = a->bs16 + (nbs ? M * (K / 16) : 0);
    a->q = (int8_t *)((int16_t *)a->bs16 + nbs);
    a->M = M;
    a->K = K;
    a->QB = QB;
    const size_t esize = x_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + esize * m * K, x_bf16, K, QB, a->q + m * K, a->dx + m * (K / QB),
                     a->xs16 + m * (K / 16), a->xs32 + m * (K / 32), a->bs16 + m * (K / 16), a->bs32 + m * (K / 32));
    return 0;
}

static void qact_free(qact_t *a) { free(a->dx); }

/* ---- tiles of 16 rows against MB activation rows ----------------------------------------- */
/* One quantized weight (see the top of this file). */
typedef struct {
    const uint8_t *codes;
    const void *scales, *mins;         /* f16 or int8 [N/16, K/G, 16]; mins may be NULL */
    const float *scale_sup, *min_sup;  /* f32 [N/16, K/G/gps, 16], or NULL for f16 scales / mins */
    const float *bias;                 /* f32 [N] or NULL */
    double offset;
    int64_t bits, group, gps, N, K;
    const uint8_t *lut; /* NULL, or the 16 8-bit codes a lut weight's 4-bit indices stand for */
} qw_t;

/* A lut weight's 4-bit codes are indices into a table of 16 8-bit codes v + 128 (offset 128, as
 * Q8_0's), v the signed values of its format's grid (IQ4_NL and IQ4_XS's non-uniform grid, the
 * values of the IQ3_XXS, IQ2 and IQ1_S lattices with their signs: kernels/structs.py,
 * LUT_VALUES, which owns the tables). The loops run a lut weight with the compile-time bits
 * BITS_LUT: the 4-bit layout, unpacked, then looked up (one byte shuffle); groups of 16 (IQ2_XS,
 * IQ2_S) in the 4-bit layout of groups of 16 (BITS_LUT16). */
#define BITS_LUT 12 /* (qmatmul_avx2.c's PASSES and TILE_MB spell it out) */
#define BITS_4G16 20 /* 4-bit codes in groups of 16: the 6-bit layout's low plane (Q3_K, Q2_K) */
#define BITS_LUT16 22 /* BITS_LUT in groups of 16 (IQ2_XS, IQ2_S): BITS_4G16's layout, looked up */
#define G16(b) ((b) == 6 || (b) == BITS_4G16 || (b) == BITS_LUT16) /* the layouts of groups of 16 */
#define LAYOUT_BITS(b) ((b) == BITS_LUT || (b) == BITS_4G16 || (b) == BITS_LUT16 ? 4 : (b)) /* the bits of the layout the codes lie in */
#define GROUP_OF(b) (G16(b) ? 16 : 32) /* a layout's columns per group */
#define LOOP_BITS(w) ((w)->lut ? ((w)->group == 16 ? BITS_LUT16 : BITS_LUT) \
                               : (w)->bits == 4 && (w)->group == 16 ? BITS_4G16 : (w)->bits) /* the loops' compile-time bits */

static inline int64_t qw_groups(const qw_t *w) { return w->K / w->group; }

/* The activations' block (columns per scale dx) the weight is multiplied with: its super-block
 * (256 columns) for the super-block formats, whose int8 scales then add up in integers (tiles_sb);
 * 32 for the others. */
static inline int64_t qw_act_block(const qw_t *w) {
    const int64_t sb = w->group * w->gps;
    return w->scale_sup && (!w->mins || w->min_sup) && sb % 32 == 0 && (sb & (sb - 1)) == 0 && w->K % sb == 0
               ? sb : 32; /* (a power of two: the AVX2 loop indexes the scales by shifting) */
}

/* Whether the loops without AVX-512 VNNI run w in the super-block form (integer sums across a
 * super-block: the plain loop's comment): a super-block activation block and codes of at most 6
 * bits (8-bit codes take the sign trick's correction per group on AVX2). */
static inline int qw_sb_form(const qw_t *w) { return qw_act_block(w) != 32 && w->bits <= 6 && !w->lut; }

/* scale and min of row 16t + l in group g */
static inline float group_scale(const qw_t *w, int64_t t, int64_t g, int64_t l) {
    const int64_t ng = qw_groups(w), i = (t * ng + g) * TILE + l;
    if (w->scale_sup)
        return (float)((const int8_t *)w->scales)[i] * w->scale_sup[(t * (ng / w->gps) + g / w->gps) * TILE + l];
    return f16_to_f32(((const uint16_t *)w->scales)[i]);
}

static inline float group_min(const qw_t *w, int64_t t, int64_t g, int64_t l) {
    const int64_t ng = qw_groups(w), i = (t * ng + g) * TILE + l;
    if (!w->mins) return -(float)w->offset * group_scale(w, t, g, l);
    if (w->min_sup)
        return (float)((const int8_t *)w->mins)[i] * w->min_sup[(t * (ng / w->gps) + g / w->gps) * TILE + l];
    return f16_to_f32(((const uint16_t *)w->mins)[i]);
}

static inline int code_in_group(const uint8_t *cg, int bits, int64_t G, int64_t l, int64_t kk) {
    if (G == 16) { /* 6 bits, or 4 (the low plane alone) */
        const int64_t j = kk / 4, i = kk % 4;
        const uint8_t b = cg[(j % 2) * 64 + l * 4 + i];
        const int lo = j < 2 ? (b & 0x0F) : (b >> 4);
        return bits == 6 ? lo | (((cg[128 + l * 4 + i] >> (2 * j)) & 3) << 4) : lo;
    }
    if (bits == 4 || bits == 5) {
        const uint8_t b = cg[((kk % 16) / 4) * 64 + l * 4 + kk % 4];
        const int lo = kk < 16 ? (b & 0x0F) : (b >> 4);
        if (bits == 4) return lo;
        const uint8_t hb = cg[256 + l * 4 + kk % 4];
        return lo | (((hb >> ((kk / 16) * 4 + (kk % 16) / 4)) & 1) << 4);
    }
    return cg[(kk / 4) * 64 + l * 4 + kk % 4];
}

/* the code of row l, column kk of a group (code_in_group, looked up for a lut weight) */
static inline int qw_code(const qw_t *w, const uint8_t *cg, int64_t l, int64_t kk) {
    const int c = code_in_group(cg, (int)w->bits, w->group, l, kk);
    return w->lut ? w->lut[c] : c;
}

#ifdef QM_VNNI
static inline __m512i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline void store16(void *y, int y_bf16, int64_t idx, __m512 v) {
    if (y_bf16) { /* round to nearest even, as f32_to_bf16 */
        __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
        if (y_bf16 == Y_F32_RB)
            _mm512_storeu_ps((float *)y + idx, _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u))));
        else
            _mm256_storeu_si256((__m256i *)((uint16_t *)y + idx), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    } else {
        _mm512_storeu_ps((float *)y + idx, v);
    }
}

/* the 16 rows' scales (or mins) of tile t, group g: f16, or int8 times the super-block's f32 */
static inline __m512 vgroup(const void *v, const float *sup, int64_t gps, int64_t t, int64_t ng, int64_t g) {
    const int64_t i = (t * ng + g) * TILE;
    if (sup) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)v + i))));
        return _mm512_mul_ps(q, _mm512_loadu_ps(sup + (t * (ng / gps) + g / gps) * TILE));
    }
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)v + i)));
}

/* Two vectors of codes of tile t, group g (cg: the group's bytes), and the columns they cover:
 * pair p of nv / 2. 4 and 5 bits (and BITS_LUT): vectors p and 4 + p (columns 4p.., 16 + 4p..) from one load;
 * groups of 16: vectors p and 2 + p (columns 4p.., 8 + 4p..); 8 bits: vectors 2p and 2p + 1. A lut
 * weight's indices come out looked up. */
static inline __attribute__((always_inline)) void code_pair(const uint8_t *cg, const int64_t bits, const int p,
                                                            const uint8_t *lut, __m512i *v0, __m512i *v1, int *c0,
                                                            int *c1) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    if (bits == 4 || bits == 5 || bits == BITS_LUT) {
        const __m512i q = _mm512_loadu_si512((const void *)(cg + 64 * p));
        *v0 = _mm512_and_si512(q, nib);
        *v1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), nib);
        if (bits == 5) { /* fifth bits: bit p of each byte for the low half, bit 4 + p for the high */
            const __m512i hb = _mm512_loadu_si512((const void *)(cg + 256)), m10 = _mm512_set1_epi8(0x10);
            const __m512i hl = p == 0 ? _mm512_slli_epi16(hb, 4) : p == 1 ? _mm512_slli_epi16(hb, 3)
                             : p == 2 ? _mm512_slli_epi16(hb, 2) : _mm512_slli_epi16(hb, 1);
            const __m512i hh = p == 0 ? hb : p == 1 ? _mm512_srli_epi16(hb, 1)
                             : p == 2 ? _mm512_srli_epi16(hb, 2) : _mm512_srli_epi16(hb, 3);
            *v0 = _mm512_or_si512(*v0, _mm512_and_si512(hl, m10));
            *v1 = _mm512_or_si512(*v1, _mm512_and_si512(hh, m10));
        }
        *c0 = 4 * p;
        *c1 = 16 + 4 * p;
    } else if (G16(bits)) { /* low nibbles of vectors p, 2 + p in one 64-byte plane; 6 bits: high 2 bits in the third */
        const __m512i q = _mm512_loadu_si512((const void *)(cg + 64 * p));
        *v0 = _mm512_and_si512(q, nib);
        *v1 = _mm512_and_si512(_mm512_srli_epi16(q, 4), nib);
        if (bits == 6) {
            const __m512i hp = _mm512_loadu_si512((const void *)(cg + 128)), m30 = _mm512_set1_epi8(0x30);
            const __m512i h0 = p == 0 ? _mm512_slli_epi16(hp, 4) : _mm512_slli_epi16(hp, 2);
            const __m512i h1 = p == 0 ? hp : _mm512_srli_epi16(hp, 2);
            *v0 = _mm512_or_si512(*v0, _mm512_and_si512(h0, m30));
            *v1 = _mm512_or_si512(*v1, _mm512_and_si512(h1, m30));
        }
        *c0 = 4 * p;
        *c1 = 8 + 4 * p;
    } else {
        *v0 = _mm512_loadu_si512((const void *)(cg + 128 * p));
        *v1 = _mm512_loadu_si512((const void *)(cg + 128 * p + 64));
        *c0 = 8 * p;
        *c1 = 8 * p + 4;
    }
    if (bits == BITS_LUT || bits == BITS_LUT16) { /* the indices looked up: the table in each 16-byte lane */
        const __m512i tab = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)lut));
        *v0 = _mm512_shuffle_epi8(tab, *v0);
        *v1 = _mm512_shuffle_epi8(tab, *v1);
    }
}

/* The integer sums of group g: s[nt * i + u] = sum over the group's columns of the codes of the 16
 * rows of tile t + u times activation row m0 + i. The weight vectors are unpacked two at a time and
 * each used mb times; each activation broadcast serves nt tiles. The codes ahead are prefetched (a
 * tile's codes are one stream; the hardware alone kept the loads waiting): PF_GROUPS groups ahead
 * into L1 when the group is used for many rows; for a tile's one read from memory (`stream`: the
 * first pass of a call of at most DECODE_ROWS rows) PF_DECODE_BYTES of codes ahead into L2, where L2,
 * which keeps more misses in flight, let the weight stream run 12-14% faster, and a pass of more
 * than two rows (more work a line: the loads wait longer on L2) also PF_GROUPS ahead into L1.
 * The decode distance is in bytes, not groups: at 8 groups Q6_K (192 bytes a group) looked 1.5 KiB
 * ahead and streamed at 18 GB/s, Q4_K (256) 21, Q8_0 (512) 23.5; at 6-12 KiB ahead all three
 * stream at 22-24 (2 threads, Sapphire Rapids VM, bare read 25): decode +9% on Qwen2.5-0.5B and
 * SmolLM2, +13% on Qwen2.5-1.5B; 3 KiB was slower, 16 KiB no better. Decode prefetches on past the tile's
 * last group into the next tile's first (the tiles lie one after another; past the weight's end a
 * harmless hint): where it stopped at the tile's end, the last PF_GROUPS groups of every tile and
 * the next tile's first came in unprefetched (a third of Qwen2.5-0.5B's 28 groups a tile): decode
 * +6-9% on SmolLM2, Qwen2.5-0.5B and 1.5B, one row's stream 70-84% -> 81-99% of the bare read. With few accumulators (nt * mb <= 2,
 * the decode case) each sum is split over two registers by pair, halving the chain of dependent
 * vpdpbusd, then added: from L2, one thread, 10-15% faster. */
static inline __attribute__((always_inline)) void group_sums(const qw_t *w, int64_t t, const int64_t nt,
                                                             const int64_t bits, const qact_t *a, int64_t m0,
                                                             const int64_t mb, int64_t g, const int stream, __m512i *s) {
    const int64_t K = w->K, G = GROUP_OF(bits), ng = K / G, gbytes = TILE * G * LAYOUT_BITS(bits) / 8, npairs = G / 8;
    const int split = nt * mb <= 2; /* two accumulators per sum: s and s2 */
    __m512i s2[2];
    for (int64_t i = 0; i < nt * mb; i++) s[i] = _mm512_setzero_si512();
    if (split)
        for (int64_t i = 0; i < nt * mb; i++) s2[i] = _mm512_setzero_si512();
    const int64_t pf = stream ? PF_DECODE_BYTES / gbytes : PF_GROUPS; /* groups ahead */
    if (g + pf < ng || stream) /* from memory: on past the tile's end, into the next tile (a hint) */
        for (int64_t u = 0; u < nt; u++) {
            const char *pc = (const char *)(w->codes + ((t + u) * ng + g + pf) * gbytes);
            for (int64_t b = 0; b < gbytes; b += 64) {
                if (stream) _mm_prefetch(pc + b, _MM_HINT_T1);
                else _mm_prefetch(pc + b, _MM_HINT_T0);
            }
        }
    if (stream && mb > 2 && g + PF_GROUPS < ng) /* a pass of many rows: from L2 into L1 as well */
        for (int64_t u = 0; u < nt; u++) {
            const char *pc = (const char *)(w->codes + ((t + u) * ng + g + PF_GROUPS) * gbytes);
            for (int64_t b = 0; b < gbytes; b += 64) _mm_prefetch(pc + b, _MM_HINT_T0);
        }
    for (int p = 0; p < npairs; p++) {
        __m512i v[2][2];
        int c0 = 0, c1 = 0;
        for (int64_t u = 0; u < nt; u++)
            code_pair(w->codes + ((t + u) * ng + g) * gbytes, bits, p, w->lut, &v[u][0], &v[u][1], &c0, &c1);
        for (int64_t i = 0; i < mb; i++) {
            const int8_t *xr = a->q + (m0 + i) * K + g * G;
            const __m512i x0 = bcast4(xr + c0), x1 = bcast4(xr + c1);
            for (int64_t u = 0; u < nt; u++) {
                __m512i *acc = split && (p & 1) ? &s2[nt * i + u] : &s[nt * i + u];
                *acc = _mm512_dpbusd_epi32(*acc, v[u][0], x0);
                *acc = _mm512_dpbusd_epi32(*acc, v[u][1], x1);
            }
        }
    }
    if (split)
        for (int64_t i = 0; i < nt * mb; i++) s[i] = _mm512_add_epi32(s[i], s2[i]);
}

/* nt (1 or 2) tiles from t against mb activation rows from m0: acc[nt * i + s] holds the 16 rows
 * of tile t + s for activation row m0 + i. Each group's integer sums stay in registers (nt * mb
 * accumulators) and are scaled into acc group by group. Always inlined with constant nt and mb
 * (see run_tiles), with constant bits, so everything stays in registers: nt * mb <= 12. */
static inline __attribute__((always_inline)) void tiles_mb(const qw_t *w, int64_t t, const int64_t nt,
                                                           const int64_t bits, const qact_t *a, int64_t m0,
                                                           const int64_t mb, const int stream, __m512 *acc) {
    const int64_t K = w->K, G = GROUP_OF(bits), ng = K / G;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    const __m512 negoff = _mm512_set1_ps(-(float)w->offset);
    for (int64_t i = 0; i < nt * mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        __m512i s[2 * MB];
        group_sums(w, t, nt, bits, a, m0, mb, g, stream, s);
        __m512 sc[2], mn[2];
        for (int64_t u = 0; u < nt; u++) {
            sc[u] = vgroup(w->scales, w->scale_sup, w->gps, t + u, ng, g);
            mn[u] = w->mins ? vgroup(w->mins, w->min_sup, w->gps, t + u, ng, g) : _mm512_mul_ps(sc[u], negoff);
        }
        for (int64_t i = 0; i < mb; i++) {
            const __m512 dx = _mm512_set1_ps(a->dx[(m0 + i) * (K / 32) + g * G / 32]);
            const __m512 xsum = _mm512_set1_ps(xs[(m0 + i) * ng + g]);
            for (int64_t u = 0; u < nt; u++) {
                __m512 *o = &acc[nt * i + u];
                *o = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[nt * i + u]), _mm512_mul_ps(sc[u], dx), *o);
                *o = _mm512_fmadd_ps(mn[u], xsum, *o);
            }
        }
    }
}

/* tiles_mb for the super-block formats (int8 scales and mins times one float32 per super-block:
 * Q4_K, Q6_K), whose activations have one scale dx per super-block of QB = 256 columns (as
 * llama.cpp's Q8_K), so a super-block's sum is an integer: each group's integer sum times its int8
 * scale (|s sc| < 2^24: 32 codes < 16 times |x| <= 127 times sc < 64, or 16 codes < 64 times 127
 * times |sc| <= 128; 8 or 16 of them < 2^28) is added up in int32 and scaled once per super-block:
 *   acc = sum_sb dx_sb (scale_sup sum_g sc_g s_g  +  min_sup sum_g min_g bsum_g),
 * with bsum_g the group's sum of xq (int16), and min_g = sc_g and min_sup = -offset scale_sup
 * where the format has no mins (Q6_K). The
 * mins' term needs no codes and runs as a pass of its own (in integers as well, two groups per
 * vpdpwssd: 10% faster than float32 for Q6_K, the same for Q4_K), so the main loop holds nt * mb
 * group sums and as many super-block sums. Against the per-32-column activations and per-group
 * float32 scaling before it (tiles_mb), 512 rows of Qwen2.5-1.5B's shapes ran 4-12% faster for
 * Q4_K and 23-30% for Q6_K (both sources alternated in one process on benchmarks/qmatmul.py's
 * weights). The float operations are the same for any mb and nt, so a row's output does not
 * depend on the rows computed with it (decode equals prefill, bit for bit). */
static inline __attribute__((always_inline)) void tiles_sb(const qw_t *w, int64_t t, const int64_t nt,
                                                           const int64_t bits, const qact_t *a, int64_t m0,
                                                           const int64_t mb, const int stream, __m512 *acc) {
    const int64_t K = w->K, G = GROUP_OF(bits), ng = K / G, gps = w->gps, nsb = ng / gps;
    const int8_t *mins = w->mins ? (const int8_t *)w->mins : (const int8_t *)w->scales;
    for (int64_t i = 0; i < nt * mb; i++) acc[i] = _mm512_setzero_ps();
    /* the mins' term, in integers: vpdpwssd multiplies two groups' int16 mins (interleaved per
     * lane) by the two groups' int16 sums of xq (broadcast) and adds both products */
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int16_t *bs = G == 16 ? a->bs16 : a->bs32;
    for (int64_t sb = 0; sb < nsb; sb++) {
        __m512i im[2 * MB];
        for (int64_t i = 0; i < nt * mb; i++) im[i] = _mm512_setzero_si512();
        for (int64_t g = sb * gps; g < (sb + 1) * gps; g += 2) {
            __m512i mv[2];
            for (int64_t u = 0; u < nt; u++) /* lane l: (min[g][l], min[g + 1][l]) */
                mv[u] = _mm512_permutexvar_epi16(pairs, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(mins + ((t + u) * ng + g) * TILE))));
            for (int64_t i = 0; i < mb; i++) {
                const __m512i xb = bcast4((const int8_t *)(bs + (m0 + i) * ng + g));
                for (int64_t u = 0; u < nt; u++) im[nt * i + u] = _mm512_dpwssd_epi32(im[nt * i + u], mv[u], xb);
            }
        }
        for (int64_t u = 0; u < nt; u++) {
            const int64_t at = ((t + u) * nsb + sb) * TILE;
            const __m512 msup = w->mins ? _mm512_loadu_ps(w->min_sup + at)
                                        : _mm512_mul_ps(_mm512_loadu_ps(w->scale_sup + at), _mm512_set1_ps(-(float)w->offset));
            for (int64_t i = 0; i < mb; i++) {
                const __m512 f = _mm512_mul_ps(msup, _mm512_set1_ps(a->dx[(m0 + i) * nsb + sb]));
                acc[nt * i + u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(im[nt * i + u]), f, acc[nt * i + u]);
            }
        }
    }
    for (int64_t sb = 0; sb < nsb; sb++) { /* the scales' term */
        __m512i isb[2 * MB];
        for (int64_t i = 0; i < nt * mb; i++) isb[i] = _mm512_setzero_si512();
        for (int64_t g = sb * gps; g < (sb + 1) * gps; g++) {
            __m512i s[2 * MB], sci[2];
            group_sums(w, t, nt, bits, a, m0, mb, g, stream, s);
            for (int64_t u = 0; u < nt; u++)
                sci[u] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)w->scales + ((t + u) * ng + g) * TILE)));
            for (int64_t i = 0; i < mb; i++)
                for (int64_t u = 0; u < nt; u++)
                    isb[nt * i + u] = _mm512_add_epi32(isb[nt * i + u], _mm512_mullo_epi32(s[nt * i + u], sci[u]));
        }
        for (int64_t u = 0; u < nt; u++) {
            const __m512 ssup = _mm512_loadu_ps(w->scale_sup + ((t + u) * nsb + sb) * TILE);
            for (int64_t i = 0; i < mb; i++) {
                const __m512 f = _mm512_mul_ps(ssup, _mm512_set1_ps(a->dx[(m0 + i) * nsb + sb]));
                acc[nt * i + u] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb[nt * i + u]), f, acc[nt * i + u]);
            }
        }
    }
}

#define TILES_ROWS(NT, BITS, MBC)                                    \
    if (sup) tiles_sb(w, t, NT, BITS, a, m0, MBC, stream, acc);      \
    else if (!G16(BITS) || BITS == 6) tiles_mb(w, t, NT, BITS, a, m0, MBC, stream, acc); /* (qw_ok: the others are sb) */
#define TILES_MB(NT, BITS)                                           \
    switch (mb) {                                                    \
    case 1: TILES_ROWS(NT, BITS, 1) break;                           \
    case 2: TILES_ROWS(NT, BITS, 2) break;                           \
    case 3: TILES_ROWS(NT, BITS, 3) break;                           \
    case 4: TILES_ROWS(NT, BITS, 4) break;                           \
    case 5: TILES_ROWS(NT, BITS, 5) break;                           \
    default: TILES_ROWS(NT, BITS, 6) break;                          \
    }
#define TILES_MB1(BITS) /* one tile: up to MB1 (at most 8) rows */         \
    if (mb == 7) { TILES_ROWS(1, BITS, 7) }                                  \
    else if (mb > 7) { TILES_ROWS(1, BITS, MB1) }                            \
    else { TILES_MB(1, BITS) }
/* Tiles t .. t + nt - 1 (nt 1 or 2) against activation rows m_begin .. m_end - 1, for compile-time
 * `bits` (LOOP_BITS) and `sup` (w is a super-block format), in passes of at most MB rows (one
 * tile: MB1) split evenly (pairs of tiles, 8 rows: 4 + 4, not 6 + 2; as many passes, so as many
 * code unpacks and products): decode steps of 8 and 16 sequences, two sets of three alternated
 * rounds on a Zen 4 VM, greedy / sampled, Qwen2.5-0.5B 1.10 / 1.24x and 1.16 / 1.08x at 8,
 * 1.33 / 1.10x and 1.09 / 0.98x at 16; SmolLM2 0.94 / 1.09x and 1.16 / 1.03x; Qwen2.5-1.5B at 8
 * and 12 rows 1.02 / 0.95x and 1.04 / 0.93x. */
static inline __attribute__((always_inline)) void run_tiles_rows(const qw_t *w, int64_t t, int64_t nt, const qact_t *a,
                                                                 int64_t m_begin, int64_t m_end, void *y, int y_bf16,
                                                                 int64_t ldy, const int sup, const int64_t bits) {
    const int64_t most = nt == 1 ? MB1 : MB;
    for (int64_t m0 = m_begin, mb; m0 < m_end; m0 += mb) { /* passes of at most `most` rows, split evenly */
        const int64_t left = m_end - m0, passes = (left + most - 1) / most;
        mb = (left + passes - 1) / passes;
        const int stream = m0 == m_begin && m_end - m_begin <= DECODE_ROWS; /* the tile's one read from memory */
        __m512 acc[2 * MB];
        if (nt == 2) { TILES_MB(2, bits) } else { TILES_MB1(bits) }
        for (int64_t u = 0; u < nt; u++) {
            const int64_t n0 = (t + u) * TILE;
            const __m512 bv = w->bias ? _mm512_loadu_ps(w->bias + n0) : _mm512_setzero_ps();
            for (int64_t i = 0; i < mb; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, _mm512_add_ps(acc[nt * i + u], bv));
        }
    }
}

/* One function per format kind and code layout (the super-block formats' tiles_sb, the others'
 * tiles_mb), each with its 14 (nt, mb) variants (one tile: 1-8 rows; two: 1-6), as
 * qmatmul_avx2.c's passes: register allocation then sees one layout's loops at a time. With all
 * layouts in two functions (sb and mb), a change to one layout's code moved another's: adding
 * the lut formats' table pointer cost Q5_0 8% at 512 rows (Qwen2.5-0.5B's gate, 7.8 -> 8.4 ms),
 * and earlier tiles_sb's code cost the legacy formats 6-10%. Split, 512 rows of [2048, 1536] run 11-17% faster for Q4_K, Q5_K, Q6_K, Q3_K, Q2_K and
 * IQ3_S, 9% for Q5_0 and Q5_1, the others within 3% (one row from L2: the same within 5%), and
 * the library compiles in 16 s instead of 23 (Sapphire Rapids VM, gcc 12). */
typedef void (*run_tiles_fn)(const qw_t *, int64_t, int64_t, const qact_t *, int64_t, int64_t, void *, int, int64_t);
#define RUN_TILES_DECL(NAME)                                                                                   \
    QM_LOOP_FN void NAME(const qw_t *w, int64_t t, int64_t nt, const qact_t *a, int64_t m_begin, int64_t m_end, \
                         void *y, int y_bf16, int64_t ldy)
#define RUN_TILES(NAME, SUP, BITS)                                                   \
    RUN_TILES_DECL(NAME) { run_tiles_rows(w, t, nt, a, m_begin, m_end, y, y_bf16, ldy, SUP, BITS); }
RUN_TILES_DECL(run_sb_lut); RUN_TILES_DECL(run_sb_lut16); RUN_TILES_DECL(run_sb_4g16); RUN_TILES_DECL(run_sb_4);
RUN_TILES_DECL(run_sb_5); RUN_TILES_DECL(run_sb_6); RUN_TILES_DECL(run_sb_8); RUN_TILES_DECL(run_mb_lut);
RUN_TILES_DECL(run_mb_4); RUN_TILES_DECL(run_mb_5); RUN_TILES_DECL(run_mb_6); RUN_TILES_DECL(run_mb_8);
#if QM_IN_PART(1)
RUN_TILES(run_sb_4, 1, 4)
RUN_TILES(run_mb_lut, 0, BITS_LUT)
RUN_TILES(run_mb_8, 0, 8)
#endif
#if QM_IN_PART(2)
RUN_TILES(run_sb_6, 1, 6)
RUN_TILES(run_sb_lut, 1, BITS_LUT)
RUN_TILES(run_mb_4, 0, 4)
#endif
#if QM_IN_PART(3)
RUN_TILES(run_sb_5, 1, 5)
RUN_TILES(run_sb_lut16, 1, BITS_LUT16)
RUN_TILES(run_mb_5, 0, 5)
#endif
#if QM_IN_PART(4)
RUN_TILES(run_sb_8, 1, 8)
RUN_TILES(run_sb_4g16, 1, BITS_4G16)
RUN_TILES(run_mb_6, 0, 6)
#endif
#ifndef QM_PART /* (a part unit ends with its loop functions) */

/* run_tiles_rows for weight w, by its kind (the 4-bit groups of 16 are super-blocks only: qw_ok) */
static void run_tiles(const qw_t *w, int64_t t, int64_t nt, const qact_t *a, int64_t m_begin, int64_t m_end,
                      void *y, int y_bf16, int64_t ldy) {
    const int sup = qw_act_block(w) != 32;
    run_tiles_fn run;
    switch (LOOP_BITS(w)) {
    case BITS_LUT: run = sup ? run_sb_lut : run_mb_lut; break;
    case BITS_LUT16: run = run_sb_lut16; break;
    case BITS_4G16: run = run_sb_4g16; break;
    case 4: run = sup ? run_sb_4 : run_mb_4; break;
    case 5: run = sup ? run_sb_5 : run_mb_5; break;
    case 6: run = sup ? run_sb_6 : run_mb_6; break;
    default: run = sup ? run_sb_8 : run_mb_8; break;
    }
    run(w, t, nt, a, m_begin, m_end, y, y_bf16, ldy);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define QM_AMX 1
#include "qmatmul_amx.c" /* 32 rows or more on AMX tiles, the same sums */
#endif
#endif /* QM_PART */
#else
#define PMB 8 /* activation rows per pass of the plain loop */

#if defined(__AVX2__) && defined(__F16C__)
#include "qmatmul_avx2.c" /* AVX2 and AVX-VNNI loops */
#else
/* vectors 0..nvec-1 of a group: the low nibble of byte (l, i) of vector j is column 4j + i of row
 * l, the high nibble column hi + 4j + i */
static void split_nibbles(const uint8_t *cg, int64_t nvec, int64_t hi, uint8_t u[TILE][32]) {
    for (int64_t j = 0; j < nvec; j++)
        for (int64_t l = 0; l < TILE; l++)
            for (int64_t i = 0; i < 4; i++) {
                const uint8_t b = cg[j * 64 + l * 4 + i];
                u[l][4 * j + i] = b & 0x0F;
                u[l][hi + 4 * j + i] = b >> 4;
            }
}

/* a group's codes for the 16 rows of a tile, u[l][kk] = code_in_group(cg, bits, l, kk), unpacked
 * a whole byte lane at a time (loops the compiler vectorizes) */
static void unpack_group(const uint8_t *cg, int bits, int64_t G, uint8_t u[TILE][32]) {
    if (bits == 8) {
        for (int64_t j = 0; j < G / 4; j++)
            for (int64_t l = 0; l < TILE; l++)
                for (int64_t i = 0; i < 4; i++) u[l][4 * j + i] = cg[j * 64 + l * 4 + i];
    } else if (G == 16) { /* nibbles of two vectors, then (6 bits) 2 high bits each */
        split_nibbles(cg, 2, 8, u);
        if (bits == 6)
            for (int64_t l = 0; l < TILE; l++)
                for (int64_t i = 0; i < 4; i++) {
                    const uint8_t hb = cg[128 + l * 4 + i];
                    for (int64_t j = 0; j < 4; j++) u[l][4 * j + i] |= (uint8_t)(((hb >> (2 * j)) & 3) << 4);
                }
    } else { /* 4 or 5 bits, G = 32: low nibble column 4j + i, high nibble 16 + 4j + i */
        split_nibbles(cg, 4, 16, u);
        if (bits == 5)
            for (int64_t l = 0; l < TILE; l++)
                for (int64_t i = 0; i < 4; i++) {
                    const uint8_t hb = cg[256 + l * 4 + i];
                    for (int64_t j = 0; j < 4; j++) {
                        u[l][4 * j + i] |= (uint8_t)(((hb >> j) & 1) << 4);
                        u[l][16 + 4 * j + i] |= (uint8_t)(((hb >> (4 + j)) & 1) << 4);
                    }
                }
    }
}

/* The plain loop: each group's codes unpacked once per PMB activation rows, integer sums over
 * the group, then the float arithmetic every loop without AVX-512 VNNI shares, in its order:
 *   the legacy formats (f16 scale and min per group, activation scale per 32 columns):
 *     acc += isum dx scale + min xsum, group after group;
 *   the super-block formats (int8 scale and min per group times a float32 per super-block, one
 *   activation scale dx per super-block: qw_act_block), in integers across the super-block, as
 *   the VNNI loop's tiles_sb:  isb = sum_g sc_g isum_g,  imin = sum_g mn_g bsum_g  (exact int32),
 *     acc += isb (scale_sup dx) + imin (min_sup dx),   min_sup = -offset scale_sup without mins. */
static void run_tile(const qw_t *w, int64_t t, const qact_t *a, void *y, int y_bf16, int64_t ldy) {
    const int64_t K = w->K, G = w->group, ng = K / G, gbytes = TILE * G * w->bits / 8, n0 = t * TILE;
    const uint8_t *codes = w->codes + t * ng * gbytes;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    const int16_t *bs = G == 16 ? a->bs16 : a->bs32;
    const int sbf = qw_sb_form(w), gps = w->gps > 0 ? (int)w->gps : 1; /* the super-block form; groups per super-block */
    const int64_t nsb = ng / gps;
    const int8_t *sc8 = (const int8_t *)w->scales, *mn8 = w->mins ? (const int8_t *)w->mins : sc8;
    uint8_t u[TILE][32];
    float sc[TILE], mn[TILE];
    for (int64_t m0 = 0; m0 < a->M; m0 += PMB) {
        const int64_t mr = a->M - m0 < PMB ? a->M - m0 : PMB;
        float acc[PMB][TILE];
        int32_t isb[PMB][TILE], imin[PMB][TILE];
        memset(acc, 0, sizeof(acc));
        memset(isb, 0, sizeof(isb));
        memset(imin, 0, sizeof(imin));
        for (int64_t g = 0; g < ng; g++) {
            unpack_group(codes + g * gbytes, (int)w->bits, G, u);
            if (w->lut)
                for (int64_t l = 0; l < TILE; l++)
                    for (int64_t kk = 0; kk < G; kk++) u[l][kk] = w->lut[u[l][kk]];
            if (!sbf)
                for (int64_t l = 0; l < TILE; l++) {
                    sc[l] = group_scale(w, t, g, l);
                    mn[l] = group_min(w, t, g, l);
                }
            const int64_t si = (t * ng + g) * TILE, sb = g / gps;
            for (int64_t mm = 0; mm < mr; mm++) {
                const int64_t m = m0 + mm;
                const int8_t *q = a->q + m * K + g * G;
                for (int64_t l = 0; l < TILE; l++) {
                    int32_t isum = 0;
                    for (int64_t kk = 0; kk < G; kk++) isum += (int32_t)u[l][kk] * (int32_t)q[kk];
                    if (sbf) {
                        isb[mm][l] += (int32_t)sc8[si + l] * isum;
                        imin[mm][l] += (int32_t)mn8[si + l] * (int32_t)bs[m * ng + g];
                    } else {
                        acc[mm][l] += (float)isum * a->dx[m * (K / a->QB) + g * G / a->QB] * sc[l] + mn[l] * xs[m * ng + g];
                    }
                }
                if (sbf && g % gps == gps - 1) /* the super-block's end: scale its sums once */
                    for (int64_t l = 0; l < TILE; l++) {
                        const int64_t at = (t * nsb + sb) * TILE + l;
                        const float d = a->dx[m * nsb + sb];
                        const float ms = w->mins ? w->min_sup[at] : w->scale_sup[at] * -(float)w->offset;
                        acc[mm][l] += (float)isb[mm][l] * (w->scale_sup[at] * d) + (float)imin[mm][l] * (ms * d);
                        isb[mm][l] = imin[mm][l] = 0;
                    }
            }
        }
        for (int64_t mm = 0; mm < mr; mm++)
            for (int64_t l = 0; l < TILE; l++) {
                float v = acc[mm][l];
                if (w->bias) v += w->bias[n0 + l];
                store1(y, y_bf16, (m0 + mm) * ldy + n0 + l, v);
            }
    }
}
#endif /* QM_AVX2 */
#endif

#ifndef QM_PART /* (a part unit ends with its loop functions) */
#include "dense_bf16.c" /* bits == 16: dense bf16 rows */

static int qw_ok(const qw_t *w) {
    const int64_t G = w->group;
    if (w->bits == 16) return w->N > 0 && w->K > 0 && w->codes && !w->scales;
    return w->N % TILE == 0 && w->K % G == 0 && w->K % 32 == 0 && (G == 16 || G == 32) &&
           (w->bits >= 4 && w->bits <= 8 && w->bits != 7) && !(w->bits == 5 && G != 32) && !(w->bits == 6 && G != 16) &&
           !(w->lut && w->bits != 4) && !(w->bits == 4 && G == 16 && qw_act_block(w) == 32) && /* (the loops' 4-bit groups of 16 run super-blocks only) */
           (!(w->scale_sup || w->min_sup) || (w->gps > 0 && (w->K / G) % w->gps == 0));
}

/* which of the weights task i belongs to: start[u] <= i < start[u + 1] (a handful of weights) */
static inline int task_owner(const int64_t *start, int64_t i) {
    int u = 0;
    while (i >= start[u + 1]) u++;
    return u;
}

/* y_j = x W_j^T + bias_j for the n weights that take the same rows of x (q, k and v; gate and up),
 * with x already quantized (a[j]: its quantization for weight j, so weights can share one): every
 * weight's tiles in one OpenMP loop, one parallel region instead of n (each costs a fork and a join:
 * about 0.8 us with two threads on a VM, and a decode step opens eight a layer one by one). Each
 * output is the one qmatmul_q computes for that weight alone, bit for bit: only the split of the
 * tiles over the threads changes. Weights on AMX tiles (qmatmul_amx.c) run there, one by one. */
static void qmatmul_q_n(const qact_t *const *a, const qw_t *const *w, int n, void *const *y, int y_bf16,
                        const int64_t *ldy) {
    int64_t start[9] = {0}, work = 0; /* start[j]: weight j's first task; tasks: one or two tiles each */
    const int64_t M = a[0]->M;
#ifdef QM_VNNI
    /* Pairs of tiles (an odd last tile alone), split over the threads, for each block of
     * MBLOCK activation rows in turn: a block's rows stay in L2 while every tile passes.
     * Calls of at most ONE_TILE_ROWS rows (decode of one or a few streams), bound by the
     * weights' read, go one tile at a time: each thread then reads one stream of codes, not two
     * tiles' streams side by side, and the weights of Qwen2.5-1.5B's decode step streamed 25%
     * faster (slow memory: 23 -> 31 GB/s, 2 threads, bare read 38), though the kernel computes
     * 10% slower from L2. Up to 2026-12-02 only one row went so, and only passes of at most 2
     * rows prefetched from memory (group_sums' `stream`): on a 2-core Zen 4 VM, Qwen2.5-1.5B's
     * decode step of 4 sequences took 56-62 ms against 29-42 for one. With one tile a task up to
     * 4 rows and the stream's prefetch up to DECODE_ROWS, decode steps (medians of three
     * alternated rounds against the old rules, greedy / sampled) of 4 sequences ran 1.67 / 1.62x
     * faster on Qwen2.5-1.5B, 1.60 / 1.62x on Qwen2.5-0.5B, 1.31 / 1.57x on Gemma 3 270M; 8 and
     * 16 sequences 1.05-1.21x; one sequence and a 512-token prefill unchanged. One tile a task
     * at 8 or 16 rows, in passes of at most MB = 6 rows (8 rows as 4 + 4: each tile's codes
     * unpacked twice), was 1.3-1.7x slower on SmolLM2 and Qwen2.5-0.5B (their legacy formats
     * compute more a byte: two tiles share each activation broadcast). Since 2026-12-03 one tile
     * a task runs up to 8 rows in one pass of MB1 = 8 (8 accumulators, as 2 tiles x 4 rows):
     * decode steps of 6 and 8 sequences against 4 rows' rule (medians of three alternated rounds,
     * greedy / sampled, Zen 4 VM) Qwen2.5-0.5B 1.38 / 1.43x and 1.28 / 1.32x, Qwen2.5-1.5B
     * 1.17 / 1.22x both, Gemma 3 270M 1.24 / 1.11x and 1.09 / 1.29x, SmolLM2 1.06 / 1.09x both;
     * 1, 12 and 16 sequences level. Up to 12 rows in one pass of 12 was no better at 6 and 8,
     * 0.88 / 0.90x at 12 on SmolLM2 (1.10x on Qwen2.5-0.5B), and doubled the compile time. */
    const int64_t nt = M <= ONE_TILE_ROWS ? 1 : 2; /* tiles per task */
#else
    const int64_t nt = 1;
#endif
    int todo[8], m = 0;
    for (int j = 0; j < n; j++) {
#ifdef QM_AMX
        if (amx_takes(a[j], w[j]) && qmatmul_amx_q(a[j], w[j], y[j], y_bf16, ldy[j]) == 0) continue;
#endif
        todo[m] = j;
        start[m + 1] = start[m] + (w[j]->N / TILE + nt - 1) / nt;
        work += w[j]->N * w[j]->K * M;
        m++;
    }
    const int64_t tasks = start[m];
#ifdef QM_VNNI
    for (int64_t m0 = 0; m0 < M; m0 += MBLOCK) {
        const int64_t m1 = M - m0 < MBLOCK ? M : m0 + MBLOCK;
        #pragma omp parallel for schedule(static) if (work >= 65536)
        for (int64_t i = 0; i < tasks; i++) {
            const int u = task_owner(start, i), j = todo[u];
            const int64_t tiles = w[j]->N / TILE, t = (i - start[u]) * nt;
            run_tiles(w[j], t, tiles - t >= nt ? nt : 1, a[j], m0, m1, y[j], y_bf16, ldy[j]);
        }
    }
#else
    #pragma omp parallel for schedule(static) if (work >= 65536)
    for (int64_t i = 0; i < tasks; i++) {
        const int u = task_owner(start, i), j = todo[u];
        run_tile(w[j], i - start[u], a[j], y[j], y_bf16, ldy[j]);
    }
#endif
}

/* y = x W^T + bias with x already quantized (so several weights can share one quantization) */
static void qmatmul_q(const qact_t *a, const qw_t *w, void *y, int y_bf16, int64_t ldy) {
    qmatmul_q_n(&a, &w, 1, &y, y_bf16, &ldy);
}

/* y [M, N] (row stride ldy; bf16 or float32) = x [M, K] (bf16 or float32) W^T + bias.
 * Returns 0, 1 when out of memory, 2 for a weight the kernel does not take. */
int qmatmul(const void *x, int x_bf16, int64_t M, const qw_t *w, void *y, int y_bf16, int64_t ldy) {
    if (!qw_ok(w)) return 2;
    if (w->bits == 16) return dense_bf16_matmul(x, x_bf16, M, w, y, y_bf16, ldy);
    qact_t a;
    if (quantize(x, x_bf16, M, w->K, qw_act_block(w), &a)) return 1;
    qmatmul_q(&a, w, y, y_bf16, ldy);
    qact_free(&a);
    return 0;
}

/* The activation quantization alone (for the tests): q [M, K] int8 and dx [M, K/QB] float32, one
 * scale per QB (32 or 256) columns. Returns 0, 1 when out of memory, 2 when K is not a multiple of
 * QB or QB is neither 32 nor 256. */
int qmatmul_quantize(const void *x, int x_bf16, int64_t M, int64_t K, int64_t QB, int8_t *q, float *dx) {
    if ((QB != 32 && QB != 256) || K % QB) return 2;
    qact_t a;
    if (quantize(x, x_bf16, M, K, QB, &a)) return 1;
    memcpy(q, a.q, (size_t)(M * K));
    memcpy(dx, a.dx, sizeof(float) * (size_t)(M * (K / QB)));
    qact_free(&a);
    return 0;
}

/* The weight as dense bf16, transposed: out_t [K, N] (for one large bf16 matmul), computed in
 * float32 and rounded once. A column of a tile is one byte (or nibble) of every 32-bit lane. */
void qdequant_bf16_t(const qw_t *w, uint16_t *out_t) {
    const int64_t N = w->N, G = w->group, ng = qw_groups(w), gbytes = TILE * G * w->bits / 8;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / TILE; t++) {
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *cg = w->codes + (t * ng + g) * gbytes;
#ifdef QM_VNNI
            const __m512 scv = vgroup(w->scales, w->scale_sup, w->gps, t, ng, g);
            const __m512 mnv = w->mins ? vgroup(w->mins, w->min_sup, w->gps, t, ng, g)
                                       : _mm512_mul_ps(scv, _mm512_set1_ps(-(float)w->offset));
            for (int64_t kk = 0; kk < G; kk++) {
                __m512i u;
                if (w->bits == 5) {
                    const int64_t j = (kk % 16) / 4, i = kk % 4;
                    const __m512i lo = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 64 * j)),
                                                         (unsigned)(8 * i + (kk < 16 ? 0 : 4)));
                    const __m512i hi = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 256)),
                                                         (unsigned)(8 * i + (kk / 16) * 4 + j));
                    u = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0x0F)),
                                        _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(1)), 4));
                } else if (G == 16) { /* 6 bits, or 4 (the low plane alone) */
                    const int64_t j = kk / 4, i = kk % 4;
                    const __m512i lo = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 64 * (j % 2))),
                                                         (unsigned)(8 * i + (j < 2 ? 0 : 4)));
                    u = _mm512_and_si512(lo, _mm512_set1_epi32(0x0F));
                    if (w->bits == 6) {
                        const __m512i hi = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 128)),
                                                             (unsigned)(8 * i + 2 * j));
                        u = _mm512_or_si512(u, _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
                    }
                } else {
                    const int64_t j = w->bits == 4 ? (kk % 16) / 4 : kk / 4, i = kk % 4;
                    u = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 64 * j)), (unsigned)(8 * i));
                    if (w->bits == 4 && kk >= 16) u = _mm512_srli_epi32(u, 4);
                    u = _mm512_and_si512(u, _mm512_set1_epi32(w->bits == 4 ? 0x0F : 0xFF));
                }
                if (w->lut) u = _mm512_permutexvar_epi32(u, _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)w->lut)));
                store16(out_t, 1, (g * G + kk) * N + t * TILE, _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scv, mnv));
            }
#else
            for (int64_t l = 0; l < TILE; l++) {
                const float s = group_scale(w, t, g, l), m = group_min(w, t, g, l);
                for (int64_t kk = 0; kk < G; kk++)
                    out_t[(g * G + kk) * N + t * TILE + l] = f32_to_bf16(s * (float)qw_code(w, cg, l, kk) + m);
            }
#endif
        }
    }
}

/* Rows `ids` [T] of the weight de-quantized to bf16, out [T, K] (an embedding lookup that
 * expands only the rows it reads): code * scale + min in float32, rounded once, the arithmetic
 * of `QuantWeight.lookup` followed by a cast to bf16. Returns 0, or 2 for an id outside [0, N). */
int qlookup_bf16(const qw_t *w, const int64_t *ids, int64_t T, uint16_t *out) {
    const int64_t G = w->group, ng = qw_groups(w), gbytes = TILE * G * w->bits / 8;
    for (int64_t r = 0; r < T; r++)
        if (ids[r] < 0 || ids[r] >= w->N) return 2;
    for (int64_t r = 0; r < T; r++) {
        const int64_t t = ids[r] / TILE, l = ids[r] % TILE;
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *cg = w->codes + (t * ng + g) * gbytes;
            const float s = group_scale(w, t, g, l), m = group_min(w, t, g, l);
            for (int64_t kk = 0; kk < G; kk++)
                out[r * w->K + g * G + kk] = f32_to_bf16(s * (float)qw_code(w, cg, l, kk) + m);
        }
    }
    return 0;
}

#ifndef QM_AMX
/* 1 when calls of 32 rows or more run on AMX tiles (qmatmul_amx.c): never in this build */
int qmatmul_amx(int enable) {
    (void)enable;
    return 0;
}

int qmatmul_amx_takes(const qw_t *w, int64_t M) {
    (void)w, (void)M;
    return 0;
}
#endif

/* 1 when built with the AVX-512 VNNI loops, 0 for the plain C ones */
int qmatmul_vectorized(void) {
#ifdef QM_VNNI
    return 1;
#else
    return 0;
#endif
}

/* which loop this build runs: "avx512-vnni", "avx-vnni", "avx2" or "plain" */
const char *qmatmul_loop(void) {
#if defined(QM_VNNI)
    return "avx512-vnni";
#elif defined(QM_AVXVNNI)
    return "avx-vnni";
#elif defined(QM_AVX2)
    return "avx2";
#else
    return "plain";
#endif
}
#endif /* QM_PART */
