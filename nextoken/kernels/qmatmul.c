/* Quantized matmul y = x W^T (+ bias) on GGUF block weights, with int8 activations.
 * nextoken's own kernel; the reference it must match is nextoken.layers.qweight
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
 *   scales  [N/16, K/G, 16] (lane l: row 16t + l), as GGUF stores them, so as few bytes as GGUF:
 *             float16, when scale_sup is NULL (Q4_0, Q4_1, Q5_0, Q8_0: one f16 per block);
 *             int8 times scale_sup [N/16, K/G/gps, 16] float32, one per super-block of gps groups
 *             (Q4_K: 6-bit sc times d; Q6_K: int8 sc times d).
 *   mins    the same two forms (min_sup), or NULL: then min = -offset * scale.
 * So one VNNI instruction (vpdpbusd: unsigned codes x signed activations, four products per
 * 32-bit lane) advances 16 rows by four columns, with the activations' four bytes broadcast:
 * the 16 rows' sums stay in the 16 lanes and no horizontal reduction is ever needed.
 *
 * Activations: each row of x is quantized per block of 32 columns (as llama.cpp's Q8_1):
 *   dx = max|x| / 127, xq = round_half_even(x * (1 / dx)), in -127..127,
 *   y[m, n] = sum_g scale[n, g] dx[m, g] sum_{k in g} u xq  +  min[n, g] dx[m, g] sum_{k in g} xq.
 * A portable C loop computes the same sums where VNNI is missing. Tiles are split over OpenMP
 * threads (PyTorch's own libgomp: one pool). Requires N % 16 == 0 and K % 32 == 0.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QM_VNNI 1
#endif

#define TILE 16
#define MB 8 /* activation rows per pass over a tile */


/* ---- activations ------------------------------------------------------------------------ */
typedef struct {
    int8_t *q;    /* [M, K] */
    float *dx;    /* [M, K/32] */
    float *xs16;  /* [M, K/16]: dx * sum of xq over each 16 columns */
    float *xs32;  /* [M, K/32]: the same over each 32 */
    int64_t M, K;
} qact_t;

static void quantize_row(const void *x, int x_bf16, int64_t K, int8_t *q, float *dx, float *xs16, float *xs32) {
    for (int64_t b = 0; b < K / 32; b++) {
        float xb[32], amax = 0.f;
        for (int i = 0; i < 32; i++) {
            const int64_t k = b * 32 + i;
            xb[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            amax = fmaxf(amax, fabsf(xb[i]));
        }
        const float d = amax / 127.f;
        const float id = d != 0.f ? 1.f / d : 0.f;
        int s[2] = {0, 0};
        for (int i = 0; i < 32; i++) {
            const int v = (int)rintf(xb[i] * id); /* default rounding: to nearest even */
            q[b * 32 + i] = (int8_t)v;
            s[i / 16] += v;
        }
        dx[b] = d;
        xs32[b] = d * (float)(s[0] + s[1]);
        xs16[2 * b] = d * (float)s[0];
        xs16[2 * b + 1] = d * (float)s[1];
    }
}

/* Quantize x [M, K] (bf16 or float32) into a (free it with qact_free). 0, or 1 when out of memory. */
static int quantize(const void *x, int x_bf16, int64_t M, int64_t K, qact_t *a) {
    void *mem = NULL;
    if (posix_memalign(&mem, 64, sizeof(float) * M * (K / 32 + K / 16 + K / 32) + (size_t)(M * K) + 64)) return 1;
    a->dx = (float *)mem;
    a->xs16 = a->dx + M * (K / 32);
    a->xs32 = a->xs16 + M * (K / 16);
    a->q = (int8_t *)(a->xs32 + M * (K / 32));
    a->M = M;
    a->K = K;
    const size_t esize = x_bf16 ? 2 : 4;
    #pragma omp parallel for schedule(static) if (M >= 8)
    for (int64_t m = 0; m < M; m++)
        quantize_row((const char *)x + esize * m * K, x_bf16, K, a->q + m * K, a->dx + m * (K / 32),
                     a->xs16 + m * (K / 16), a->xs32 + m * (K / 32));
    return 0;
}

static void qact_free(qact_t *a) { free(a->dx); }

/* ---- one tile of 16 rows against MB activation rows -------------------------------------- */
/* One quantized weight (see the top of this file). */
typedef struct {
    const uint8_t *codes;
    const void *scales, *mins;         /* f16 or int8 [N/16, K/G, 16]; mins may be NULL */
    const float *scale_sup, *min_sup;  /* f32 [N/16, K/G/gps, 16], or NULL for f16 scales / mins */
    const float *bias;                 /* f32 [N] or NULL */
    double offset;
    int64_t bits, group, gps, N, K;
} qw_t;

static inline int64_t qw_groups(const qw_t *w) { return w->K / w->group; }

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

static inline int code_in_group(const uint8_t *cg, int bits, int64_t l, int64_t kk) {
    if (bits == 6) {
        const int64_t j = kk / 4, i = kk % 4;
        const uint8_t b = cg[(j % 2) * 64 + l * 4 + i], hb = cg[128 + l * 4 + i];
        return (j < 2 ? (b & 0x0F) : (b >> 4)) | (((hb >> (2 * j)) & 3) << 4);
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

/* always inlined with a constant mb (see run_tile), so the accumulators stay in registers */
static inline __attribute__((always_inline)) void tile_mb(const qw_t *w, int64_t t, const qact_t *a, int64_t m0,
                                                          const int64_t mb, __m512 *acc) {
    const int64_t K = w->K, G = w->group, ng = K / G, nv = G / 4, gbytes = TILE * G * w->bits / 8;
    const uint8_t *codes = w->codes + t * ng * gbytes;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512 negoff = _mm512_set1_ps(-(float)w->offset);
    for (int64_t i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *cg = codes + g * gbytes;
        __m512i wv[8];
        if (w->bits == 4) {
            for (int j = 0; j < 4; j++) {
                const __m512i p = _mm512_loadu_si512((const void *)(cg + 64 * j));
                wv[j] = _mm512_and_si512(p, nib);
                wv[4 + j] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
            }
        } else if (w->bits == 5) {
            const __m512i hb = _mm512_loadu_si512((const void *)(cg + 256)), m10 = _mm512_set1_epi8(0x10);
            for (int j = 0; j < 4; j++) {
                const __m512i p = _mm512_loadu_si512((const void *)(cg + 64 * j));
                const __m512i hl = j == 0 ? _mm512_slli_epi16(hb, 4) : j == 1 ? _mm512_slli_epi16(hb, 3)
                                 : j == 2 ? _mm512_slli_epi16(hb, 2) : _mm512_slli_epi16(hb, 1);
                const __m512i hh = j == 0 ? hb : j == 1 ? _mm512_srli_epi16(hb, 1)
                                 : j == 2 ? _mm512_srli_epi16(hb, 2) : _mm512_srli_epi16(hb, 3);
                wv[j] = _mm512_or_si512(_mm512_and_si512(p, nib), _mm512_and_si512(hl, m10));
                wv[4 + j] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p, 4), nib), _mm512_and_si512(hh, m10));
            }
        } else if (w->bits == 6) {
            const __m512i p0 = _mm512_loadu_si512((const void *)cg), p1 = _mm512_loadu_si512((const void *)(cg + 64));
            const __m512i hp = _mm512_loadu_si512((const void *)(cg + 128)), m30 = _mm512_set1_epi8(0x30);
            wv[0] = _mm512_or_si512(_mm512_and_si512(p0, nib), _mm512_and_si512(_mm512_slli_epi16(hp, 4), m30));
            wv[1] = _mm512_or_si512(_mm512_and_si512(p1, nib), _mm512_and_si512(_mm512_slli_epi16(hp, 2), m30));
            wv[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p0, 4), nib), _mm512_and_si512(hp, m30));
            wv[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(p1, 4), nib),
                                    _mm512_and_si512(_mm512_srli_epi16(hp, 2), m30));
        } else {
            for (int j = 0; j < nv; j++) wv[j] = _mm512_loadu_si512((const void *)(cg + 64 * j));
        }
        const __m512 sc = vgroup(w->scales, w->scale_sup, w->gps, t, ng, g);
        const __m512 mn = w->mins ? vgroup(w->mins, w->min_sup, w->gps, t, ng, g) : _mm512_mul_ps(sc, negoff);
        for (int64_t i = 0; i < mb; i++) {
            const int8_t *xr = a->q + (m0 + i) * K + g * G;
            __m512i s0 = _mm512_setzero_si512();
            for (int j = 0; j < nv; j++) s0 = _mm512_dpbusd_epi32(s0, wv[j], bcast4(xr + 4 * j));
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s0),
                                           _mm512_set1_ps(a->dx[(m0 + i) * (K / 32) + g * G / 32]));
            acc[i] = _mm512_fmadd_ps(f, sc, acc[i]);
            acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(m0 + i) * ng + g]), acc[i]);
        }
    }
}

static void run_tile(const qw_t *w, int64_t t, const qact_t *a, void *y, int y_bf16, int64_t ldy) {
    const int64_t n0 = t * TILE;
    const __m512 bv = w->bias ? _mm512_loadu_ps(w->bias + n0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < a->M; m0 += MB) {
        const int64_t mb = a->M - m0 < MB ? a->M - m0 : MB;
        __m512 acc[MB];
        switch (mb) { /* one specialised copy per row count */
        case 1: tile_mb(w, t, a, m0, 1, acc); break;
        case 2: tile_mb(w, t, a, m0, 2, acc); break;
        case 3: tile_mb(w, t, a, m0, 3, acc); break;
        case 4: tile_mb(w, t, a, m0, 4, acc); break;
        case 5: tile_mb(w, t, a, m0, 5, acc); break;
        case 6: tile_mb(w, t, a, m0, 6, acc); break;
        case 7: tile_mb(w, t, a, m0, 7, acc); break;
        default: tile_mb(w, t, a, m0, 8, acc); break;
        }
        for (int64_t i = 0; i < mb; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, _mm512_add_ps(acc[i], bv));
    }
}
#else
static void run_tile(const qw_t *w, int64_t t, const qact_t *a, void *y, int y_bf16, int64_t ldy) {
    const int64_t K = w->K, G = w->group, ng = K / G, gbytes = TILE * G * w->bits / 8, n0 = t * TILE;
    const uint8_t *codes = w->codes + t * ng * gbytes;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    for (int64_t m = 0; m < a->M; m++) {
        for (int64_t l = 0; l < TILE; l++) {
            float acc = 0.f;
            for (int64_t g = 0; g < ng; g++) {
                int32_t isum = 0;
                for (int64_t kk = 0; kk < G; kk++)
                    isum += code_in_group(codes + g * gbytes, (int)w->bits, l, kk) * a->q[m * K + g * G + kk];
                acc += (float)isum * a->dx[m * (K / 32) + g * G / 32] * group_scale(w, t, g, l) +
                       group_min(w, t, g, l) * xs[m * ng + g];
            }
            if (w->bias) acc += w->bias[n0 + l];
            if (y_bf16) ((uint16_t *)y)[m * ldy + n0 + l] = f32_to_bf16(acc);
            else ((float *)y)[m * ldy + n0 + l] = acc;
        }
    }
}
#endif

static int qw_ok(const qw_t *w) {
    const int64_t G = w->group;
    return w->N % TILE == 0 && w->K % G == 0 && w->K % 32 == 0 && (G == 16 || G == 32) &&
           (w->bits >= 4 && w->bits <= 8 && w->bits != 7) && !(w->bits <= 5 && G != 32) && !(w->bits == 6 && G != 16) &&
           (!(w->scale_sup || w->min_sup) || (w->gps > 0 && (w->K / G) % w->gps == 0));
}

/* y = x W^T + bias with x already quantized (so several weights can share one quantization). */
static void qmatmul_q(const qact_t *a, const qw_t *w, void *y, int y_bf16, int64_t ldy) {
    #pragma omp parallel for schedule(static) if (w->N * w->K * a->M >= 65536)
    for (int64_t t = 0; t < w->N / TILE; t++) run_tile(w, t, a, y, y_bf16, ldy);
}

/* y [M, N] (row stride ldy; bf16 or float32) = x [M, K] (bf16 or float32) W^T + bias.
 * Returns 0, 1 when out of memory, 2 for a weight the kernel does not take. */
int qmatmul(const void *x, int x_bf16, int64_t M, const qw_t *w, void *y, int y_bf16, int64_t ldy) {
    if (!qw_ok(w)) return 2;
    qact_t a;
    if (quantize(x, x_bf16, M, w->K, &a)) return 1;
    qmatmul_q(&a, w, y, y_bf16, ldy);
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
                } else if (w->bits == 6) {
                    const int64_t j = kk / 4, i = kk % 4;
                    const __m512i lo = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 64 * (j % 2))),
                                                         (unsigned)(8 * i + (j < 2 ? 0 : 4)));
                    const __m512i hi = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 128)),
                                                         (unsigned)(8 * i + 2 * j));
                    u = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0x0F)),
                                        _mm512_slli_epi32(_mm512_and_si512(hi, _mm512_set1_epi32(3)), 4));
                } else {
                    const int64_t j = w->bits == 4 ? (kk % 16) / 4 : kk / 4, i = kk % 4;
                    u = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 64 * j)), (unsigned)(8 * i));
                    if (w->bits == 4 && kk >= 16) u = _mm512_srli_epi32(u, 4);
                    u = _mm512_and_si512(u, _mm512_set1_epi32(w->bits == 4 ? 0x0F : 0xFF));
                }
                store16(out_t, 1, (g * G + kk) * N + t * TILE, _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scv, mnv));
            }
#else
            for (int64_t l = 0; l < TILE; l++) {
                const float s = group_scale(w, t, g, l), m = group_min(w, t, g, l);
                for (int64_t kk = 0; kk < G; kk++)
                    out_t[(g * G + kk) * N + t * TILE + l] = f32_to_bf16(s * (float)code_in_group(cg, (int)w->bits, l, kk) + m);
            }
#endif
        }
    }
}

/* 1 when built with the AVX-512 VNNI loops, 0 for the plain C ones */
int qmatmul_vectorized(void) {
#ifdef QM_VNNI
    return 1;
#else
    return 0;
#endif
}
