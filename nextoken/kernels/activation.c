/* Row-wise kernels of the layers on bf16: SwiGLU and RMSNorm.
 *
 * SwiGLU on bf16 rows: y = silu(g) * u, with silu(x) = x / (1 + e^-x) (Shazeer 2020).
 * nextoken's own kernel; its reference is layers/activation.py's PyTorch expression
 * ``F.silu(gate) * up``, and it rounds as that does (and as decode.c's one-call decode does):
 * silu(g) in float32 rounded to bf16, times u in float32, rounded to bf16 (to nearest even). The
 * values are PyTorch's except where the last bits of e^-x move a rounding. One pass over g, u and
 * y instead of PyTorch's two (silu, then the product), split over OpenMP threads; e^-x by exp16
 * (vmath.h), or exp8 on AVX2 (the same polynomial and result). A plain C loop where neither is.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "vmath.h"
#define ACT_AVX512 1
#else
#define ACT_AVX512 0
#endif
#if defined(__AVX2__) && defined(__FMA__) /* also under AVX-512: GeGLU has no 512-bit body */
#include "vmath.h"
#define ACT_AVX2 1
#else
#define ACT_AVX2 0
#endif

#define ACT_CHUNK 4096 /* elements per OpenMP task */

#if ACT_AVX512
static inline __m512 load_bf16(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

/* v rounded to bf16 (to nearest even) and back to float32 */
static inline __m512 round_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xffff0000u)));
}

/* round to nearest even, as f32_to_bf16 (NaN kept a quiet NaN) */
static inline void store_bf16(uint16_t *p, __m512 v, __mmask16 m) {
    __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    __m512i h = _mm512_srli_epi32(u, 16);
    h = _mm512_mask_or_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                             _mm512_srli_epi32(_mm512_castps_si512(v), 16), _mm512_set1_epi32(0x40));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(h));
}
#endif

#if ACT_AVX2
static inline __m256 load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* v rounded to bf16 (to nearest even), as float32 bits (NaN kept a quiet NaN) */
static inline __m256i bf16_bits8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_and_si256(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))),
                                       _mm256_set1_epi32((int)0xffff0000u));
    const __m256i nan = _mm256_or_si256(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)),
                                        _mm256_set1_epi32(0x400000));
    return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

static inline __m256 round8_bf16(__m256 v) { return _mm256_castsi256_ps(bf16_bits8(v)); }

static inline void store8_bf16(uint16_t *p, __m256 v) {
    const __m256i h = _mm256_srli_epi32(bf16_bits8(v), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* y = bf16(bf16(silu(g)) * u) for 8 values (e^-x of -x clamped to +-100, as the AVX-512 body) */
static inline void silu_mul8(const uint16_t *g, const uint16_t *u, uint16_t *y) {
    const __m256 x = load8_bf16(g), v = load8_bf16(u);
    const __m256 nx = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), x), _mm256_set1_ps(-100.f)),
                                    _mm256_set1_ps(100.f));
    const __m256 e = exp8(nx);
    store8_bf16(y, _mm256_mul_ps(round8_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e))), v));
}

/* y = bf16(bf16(gelu_tanh(g)) * u) for 8 values, gelu_tanh(x) = x / (1 + e^-2a) (the same as
 * x/2 (1 + tanh a), without its cancellation where tanh a is near -1), -2a clamped to +-100 */
static inline void gelu_mul8(const uint16_t *g, const uint16_t *u, uint16_t *y) {
    const __m256 x = load8_bf16(g), v = load8_bf16(u);
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 a = _mm256_mul_ps(_mm256_set1_ps(-1.5957691216057308f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    const __m256 e = exp8(_mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(-100.f)), _mm256_set1_ps(100.f)));
    store8_bf16(y, _mm256_mul_ps(round8_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), e))), v));
}

/* f on [begin, end) in steps of 8, the tail through a zero-padded copy */
static void rows8(void (*f)(const uint16_t *, const uint16_t *, uint16_t *), const uint16_t *g, const uint16_t *u,
                  uint16_t *y, int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + 8 <= end; i += 8) f(g + i, u + i, y + i);
    if (i < end) {
        uint16_t gt[8] = {0}, ut[8] = {0}, yt[8];
        memcpy(gt, g + i, sizeof(uint16_t) * (end - i));
        memcpy(ut, u + i, sizeof(uint16_t) * (end - i));
        f(gt, ut, yt);
        memcpy(y + i, yt, sizeof(uint16_t) * (end - i));
    }
}
#endif

static void silu_mul_range(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t begin, int64_t end) {
#if ACT_AVX512
    const __m512 one = _mm512_set1_ps(1.f), lo = _mm512_set1_ps(-100.f), hi = _mm512_set1_ps(100.f);
    for (int64_t i = begin; i < end; i += 16) {
        const __mmask16 m = end - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (end - i)) - 1);
        const __m512 x = load_bf16(g + i, m), v = load_bf16(u + i, m);
        /* -x clamped to +-100 (e^100 overflows to inf anyway; exp16 of +-inf would be NaN) */
        const __m512 e = exp16(_mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), x), lo), hi));
        store_bf16(y + i, _mm512_mul_ps(round_bf16(_mm512_div_ps(x, _mm512_add_ps(one, e))), v), m);
    }
#elif ACT_AVX2
    rows8(silu_mul8, g, u, y, begin, end);
#else
    for (int64_t i = begin; i < end; i++) {
        const float x = bf16_to_f32(g[i]);
        y[i] = f32_to_bf16(rb(x / (1.f + expf(-x))) * bf16_to_f32(u[i]));
    }
#endif
}

typedef void (*range_fn)(const uint16_t *, const uint16_t *, uint16_t *, int64_t, int64_t);

/* `range` over [0, n) in ACT_CHUNK pieces, split over OpenMP threads when there are many */
static void over_chunks(range_fn range, const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t n) {
    const int64_t chunks = (n + ACT_CHUNK - 1) / ACT_CHUNK;
    #pragma omp parallel for schedule(static) if (chunks > 4)
    for (int64_t c = 0; c < chunks; c++)
        range(g, u, y, c * ACT_CHUNK, c * ACT_CHUNK + ACT_CHUNK < n ? c * ACT_CHUNK + ACT_CHUNK : n);
}

/* y[i] = silu(g[i]) * u[i] for i < n; g, u, y bf16 (y may be g or u). */
void silu_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t n) {
    over_chunks(silu_mul_range, g, u, y, n);
}

/* RMSNorm (Zhang & Sennrich 2019) of one row: out = bf16(w * bf16(h * r)), r = 1 / sqrt(mean(h^2) + eps).
 * Its reference is layers/norm.py's rms_norm, which normalises in float32, rounds to bf16, then
 * scales by the bf16 weight (transformers' LlamaRMSNorm). The squares are float32 products, as
 * there, summed in float64 (PyTorch sums float32 in another order: the mean can differ in its
 * last bit, and then a product can round to the neighbouring bf16 value). */
static void rms_norm_row(const uint16_t *h, const uint16_t *w, int64_t n, float eps, uint16_t *out) {
#if ACT_AVX512
    __m512d s0 = _mm512_setzero_pd(), s1 = _mm512_setzero_pd();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 x = load_bf16(h + i, m), sq = _mm512_mul_ps(x, x);
        s0 = _mm512_add_pd(s0, _mm512_cvtps_pd(_mm512_castps512_ps256(sq)));
        s1 = _mm512_add_pd(s1, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(sq), 1))));
    }
    const double ss = _mm512_reduce_add_pd(_mm512_add_pd(s0, s1));
    const __m512 r = _mm512_set1_ps(1.f / sqrtf((float)(ss / (double)n) + eps));
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        store_bf16(out + i, _mm512_mul_ps(load_bf16(w + i, m), round_bf16(_mm512_mul_ps(load_bf16(h + i, m), r))), m);
    }
#else
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const float v = bf16_to_f32(h[i]);
        ss += (double)(v * v);
    }
    const float r = 1.f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++)
        out[i] = f32_to_bf16(bf16_to_f32(w[i]) * rb(bf16_to_f32(h[i]) * r));
#endif
}

/* RMSNorm of T rows of n bf16 values: h [T, n], weight w [n], out [T, n] (may be h); rows split
 * over OpenMP threads when there are many. */
void rms_norm_rows_bf16(const uint16_t *h, const uint16_t *w, int64_t T, int64_t n, float eps, uint16_t *out) {
    #pragma omp parallel for schedule(static) if (T * n >= (1 << 16))
    for (int64_t t = 0; t < T; t++) rms_norm_row(h + t * n, w, n, eps, out + t * n);
}

/* Gemma's RMSNorm of T rows: out = bf16((h * r) * w), the product with the weight in float32
 * (layers/norm.py's rms_norm_gemma, transformers' Gemma3RMSNorm); r as in rms_norm_row. */
void rms_norm_rows_gemma(const uint16_t *h, const uint16_t *w, int64_t T, int64_t n, float eps, uint16_t *out) {
    #pragma omp parallel for schedule(static) if (T * n >= (1 << 16))
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *x = h + t * n;
        double ss = 0.0;
        for (int64_t i = 0; i < n; i++) {
            const float v = bf16_to_f32(x[i]);
            ss += (double)(v * v);
        }
        const float r = 1.f / sqrtf((float)(ss / (double)n) + eps);
        for (int64_t i = 0; i < n; i++) out[t * n + i] = f32_to_bf16(bf16_to_f32(x[i]) * r * bf16_to_f32(w[i]));
    }
}

/* GeGLU on bf16 rows (Shazeer 2020; Gemma): y = bf16(bf16(gelu_tanh(g)) * u), gelu_tanh(x) =
 * x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016) in float32, computed as
 * x / (1 + e^(-2 sqrt(2/pi) (x + 0.044715 x^3))), which it equals; rounded as layers/activation.py's
 * ``F.gelu(gate, approximate="tanh") * up`` rounds on bf16 (the last bits of e^x can move a
 * rounding). y may be g. */
static void gelu_mul_range(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t begin, int64_t end) {
#if ACT_AVX2
    rows8(gelu_mul8, g, u, y, begin, end);
#else
    for (int64_t i = begin; i < end; i++) {
        const float x = bf16_to_f32(g[i]);
        const float a = -1.5957691216057308f * (x + 0.044715f * x * x * x);
        y[i] = f32_to_bf16(rb(x / (1.f + expf(fminf(fmaxf(a, -100.f), 100.f)))) * bf16_to_f32(u[i]));
    }
#endif
}

void gelu_tanh_mul_bf16(const uint16_t *g, const uint16_t *u, uint16_t *y, int64_t n) {
    over_chunks(gelu_mul_range, g, u, y, n);
}

int activation_vectorized(void) { return ACT_AVX512 || ACT_AVX2; }
