/* Quantized matmul y = x W^T (+ bias) on GGUF block weights, with int8 activations.
 * nextoken's own kernel; the reference it must match is nextoken.layers.qweight
 * (`QuantWeight.dequantize` for the weights, `qmatmul_reference` for the arithmetic).
 *
 * Weights, converted once at load by layers/qweight.py, W[n, k] = scale[n, g] * u[n, k] + min[n, g]
 * with g = k / G (G = 16 or 32) and u an unsigned 4- or 8-bit code, in tiles of 16 rows:
 *   codes   [N/16, K/G, 16*G*bits/8] uint8. In tile t and group g, 64-byte vector j holds, in
 *           32-bit lane l, the codes of row 16t + l for four consecutive columns:
 *             8 bits: byte i of lane l of vector j = u[16t + l, G g + 4 j + i]
 *             4 bits (G = 32): low nibble = u[16t + l, 32 g + 4 j + i],
 *                              high nibble = u[16t + l, 32 g + 16 + 4 j + i]   (j < 4)
 *   scales  [N/16, K/G, 16] float32 (lane l: row 16t + l)
 *   mins    the same, or NULL: then min = -offset * scale
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
#define MB 4 /* activation rows per pass over a tile */


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

static void tile_mb(const uint8_t *codes, int bits, int64_t G, const float *scales, const float *mins,
                    float offset, const qact_t *a, int64_t m0, int64_t mb, int64_t K, __m512 *acc) {
    const int64_t ng = K / G, nv = G / 4, gbytes = TILE * G * bits / 8;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    const __m512i nib = _mm512_set1_epi8(0x0F);
    const __m512 negoff = _mm512_set1_ps(-offset);
    for (int64_t i = 0; i < mb; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *cg = codes + g * gbytes;
        __m512i w[8];
        if (bits == 4) {
            for (int j = 0; j < 4; j++) {
                const __m512i p = _mm512_loadu_si512((const void *)(cg + 64 * j));
                w[j] = _mm512_and_si512(p, nib);
                w[4 + j] = _mm512_and_si512(_mm512_srli_epi16(p, 4), nib);
            }
        } else {
            for (int j = 0; j < nv; j++) w[j] = _mm512_loadu_si512((const void *)(cg + 64 * j));
        }
        const __m512 sc = _mm512_loadu_ps(scales + g * TILE);
        const __m512 mn = mins ? _mm512_loadu_ps(mins + g * TILE) : _mm512_mul_ps(sc, negoff);
        for (int64_t i = 0; i < mb; i++) {
            const int8_t *xr = a->q + (m0 + i) * K + g * G;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
            for (int j = 0; j < nv; j += 2) {
                s0 = _mm512_dpbusd_epi32(s0, w[j], bcast4(xr + 4 * j));
                s1 = _mm512_dpbusd_epi32(s1, w[j + 1], bcast4(xr + 4 * j + 4));
            }
            const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                           _mm512_set1_ps(a->dx[(m0 + i) * (K / 32) + g * G / 32]));
            acc[i] = _mm512_fmadd_ps(f, sc, acc[i]);
            acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[(m0 + i) * ng + g]), acc[i]);
        }
    }
}

static void run_tile(const uint8_t *codes, int bits, int64_t G, const float *scales, const float *mins,
                     float offset, const float *bias, const qact_t *a, int64_t M, int64_t K, int64_t n0,
                     void *y, int y_bf16, int64_t ldy) {
    const __m512 bv = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = M - m0 < MB ? M - m0 : MB;
        __m512 acc[MB];
        tile_mb(codes, bits, G, scales, mins, offset, a, m0, mb, K, acc);
        for (int64_t i = 0; i < mb; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, _mm512_add_ps(acc[i], bv));
    }
}
#endif

static inline int code_in_group(const uint8_t *cg, int bits, int64_t l, int64_t kk) {
    if (bits == 4) {
        const uint8_t b = cg[((kk % 16) / 4) * 64 + l * 4 + kk % 4];
        return kk < 16 ? (b & 0x0F) : (b >> 4);
    }
    return cg[(kk / 4) * 64 + l * 4 + kk % 4];
}

#ifndef QM_VNNI
static void run_tile(const uint8_t *codes, int bits, int64_t G, const float *scales, const float *mins,
                     float offset, const float *bias, const qact_t *a, int64_t M, int64_t K, int64_t n0,
                     void *y, int y_bf16, int64_t ldy) {
    const int64_t ng = K / G, gbytes = TILE * G * bits / 8;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    for (int64_t m = 0; m < M; m++) {
        for (int64_t l = 0; l < TILE; l++) {
            float acc = 0.f;
            for (int64_t g = 0; g < ng; g++) {
                int32_t isum = 0;
                for (int64_t kk = 0; kk < G; kk++)
                    isum += code_in_group(codes + g * gbytes, bits, l, kk) * a->q[m * K + g * G + kk];
                const float sc = scales[g * TILE + l];
                const float mn = mins ? mins[g * TILE + l] : -offset * sc;
                acc += (float)isum * a->dx[m * (K / 32) + g * G / 32] * sc + mn * xs[m * ng + g];
            }
            if (bias) acc += bias[n0 + l];
            if (y_bf16) ((uint16_t *)y)[m * ldy + n0 + l] = f32_to_bf16(acc);
            else ((float *)y)[m * ldy + n0 + l] = acc;
        }
    }
}
#endif

static int qshape_ok(int64_t N, int64_t K, int bits, int64_t G) {
    return N % TILE == 0 && K % G == 0 && K % 32 == 0 && (G == 16 || G == 32) && (bits == 4 || bits == 8) &&
           !(bits == 4 && G != 32);
}

/* y = x W^T + bias with x already quantized (so several weights can share one quantization). */
static void qmatmul_q(const qact_t *a, const uint8_t *codes, int bits, int64_t G, const float *scales,
                      const float *mins, float offset, const float *bias, int64_t N, void *y, int y_bf16,
                      int64_t ldy) {
    const int64_t M = a->M, K = a->K, ng = K / G, tile_bytes = ng * TILE * G * bits / 8;
    #pragma omp parallel for schedule(static) if (N * K * M >= 65536)
    for (int64_t t = 0; t < N / TILE; t++)
        run_tile(codes + t * tile_bytes, bits, G, scales + t * ng * TILE, mins ? mins + t * ng * TILE : NULL,
                 offset, bias, a, M, K, t * TILE, y, y_bf16, ldy);
}

int qmatmul(const void *x, int x_bf16, int64_t M, int64_t K, const uint8_t *codes, int bits, int64_t G,
            const float *scales, const float *mins, float offset, const float *bias, int64_t N, void *y,
            int y_bf16, int64_t ldy) {
    if (!qshape_ok(N, K, bits, G)) return 2;
    qact_t a;
    if (quantize(x, x_bf16, M, K, &a)) return 1;
    qmatmul_q(&a, codes, bits, G, scales, mins, offset, bias, N, y, y_bf16, ldy);
    qact_free(&a);
    return 0;
}

/* The weight as dense bf16, transposed: out_t [K, N] (for one large bf16 matmul), computed in
 * float32 and rounded once. A column of a tile is one byte (or nibble) of every 32-bit lane. */
void qdequant_bf16_t(const uint8_t *codes, int bits, int64_t G, const float *scales, const float *mins,
                     float offset, int64_t N, int64_t K, uint16_t *out_t) {
    const int64_t ng = K / G, gbytes = TILE * G * bits / 8;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < N / TILE; t++) {
        for (int64_t g = 0; g < ng; g++) {
            const uint8_t *cg = codes + (t * ng + g) * gbytes;
            const float *sc = scales + (t * ng + g) * TILE, *mn = mins ? mins + (t * ng + g) * TILE : NULL;
#ifdef QM_VNNI
            const __m512 scv = _mm512_loadu_ps(sc);
            const __m512 mnv = mn ? _mm512_loadu_ps(mn) : _mm512_mul_ps(scv, _mm512_set1_ps(-offset));
            const __m512i byte = _mm512_set1_epi32(0xFF);
            for (int64_t kk = 0; kk < G; kk++) {
                const int64_t j = bits == 4 ? (kk % 16) / 4 : kk / 4, i = kk % 4;
                __m512i u = _mm512_srli_epi32(_mm512_loadu_si512((const void *)(cg + 64 * j)), (unsigned)(8 * i));
                if (bits == 4) u = kk < 16 ? _mm512_and_si512(u, _mm512_set1_epi32(0x0F))
                                           : _mm512_and_si512(_mm512_srli_epi32(u, 4), _mm512_set1_epi32(0x0F));
                else u = _mm512_and_si512(u, byte);
                const __m512 w = _mm512_fmadd_ps(_mm512_cvtepi32_ps(u), scv, mnv);
                store16(out_t, 1, (g * G + kk) * N + t * TILE, w);
            }
#else
            for (int64_t l = 0; l < TILE; l++) {
                const float s = sc[l], m = mn ? mn[l] : -offset * s;
                for (int64_t kk = 0; kk < G; kk++)
                    out_t[(g * G + kk) * N + t * TILE + l] = f32_to_bf16(s * (float)code_in_group(cg, bits, l, kk) + m);
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
