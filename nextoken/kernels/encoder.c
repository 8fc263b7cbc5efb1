/* The BERT encoder's row kernels (models/bert.py), on float32 or bf16 rows (`bf16` flag), all
 * math in float32, each output rounded once (bf16: to nearest even, as PyTorch):
 *
 * encoder_attention: bidirectional attention within each packed sequence, no padding. A sequence
 *   [starts[s], starts[s] + lens[s]) of the rows of qkv [T, 3H] (q | k | v, heads of D = H /
 *   heads columns) attends to itself: o_i = sum_j softmax_j(q_i . k_j / sqrt(D)) v_j (Vaswani et
 *   al. 2017; the scale of PyTorch's scaled_dot_product_attention). One task per (sequence,
 *   head), over OpenMP threads: its keys transposed [D][n] and values [n][D] in float32 in a
 *   buffer of its own; query rows in pairs, 32 keys' scores or a row's D outputs summed in
 *   registers (GCC's vector extensions, 8 lanes: a portable source, 256-bit where the CPU has
 *   AVX), e^x by Cephes' exp2f polynomial (relative error about 1e-7). Heads of 32 and 64
 *   columns are compiled apart (BERT-base, MiniLM); any multiple of 8 up to 128 runs. This
 *   replaces laying sequences out padded for PyTorch's attention and the copies in and out
 *   (measured on MiniLM in bf16: the copies cost as much as the attention itself).
 * encoder_add_norm: out = LayerNorm(x + r) * w + b per row of n (Ba et al. 2016): the residual
 *   sum rounded to the rows' dtype first (PyTorch adds in bf16), mean and variance in float32
 *   (two passes), eps inside the square root. w, b in the rows' dtype. With `r_f32` the branch
 *   r comes in float32 (a quantized linear's output before any rounding) and the sum is not
 *   rounded: one rounding less than PyTorch's, on the output only.
 *
 * The references are the PyTorch expressions in models/bert.py (the plan's enforce_eager path);
 * tests/models/test_embeddings.py holds these to them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

/* f32_to_bf16 without a branch (a NaN kept quiet by a select), so that loops over it vectorize */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t r = u + 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(((u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) : r) >> 16);
}

static inline float get(const void *p, int bf16, int64_t i) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* row i of a [rows, cols] matrix, columns c0 .. c0 + n - 1, into float32 dst */
static void load_row(const void *p, int bf16, int64_t i, int64_t cols, int64_t c0, int64_t n, float *dst) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)p + i * cols + c0;
        for (int64_t j = 0; j < n; j++) dst[j] = bf16_to_f32(s[j]);
    } else {
        memcpy(dst, (const float *)p + i * cols + c0, (size_t)n * sizeof(float));
    }
}

typedef float v8sf __attribute__((vector_size(32)));
typedef int32_t v8si __attribute__((vector_size(32)));

static inline v8sf v8_set1(float x) { return (v8sf){x, x, x, x, x, x, x, x}; }

static inline v8sf v8_load(const float *p) {
    v8sf v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void v8_store(float *p, v8sf v) { memcpy(p, &v, sizeof v); }

/* exp_neg on 8 lanes (GCC's vector extensions: any x86 build, 256-bit where it has AVX): the
 * same polynomial, n rounded by the 1.5 * 2^23 trick, 2^n from the exponent bits */
static inline v8sf exp_neg8(v8sf x) {
    const v8sf lo = v8_set1(-87.0f), magic = v8_set1(12582912.0f);
    const v8si below = x < lo; /* all ones where x < -87 */
    x = (v8sf)(((v8si)lo & below) | ((v8si)x & ~below));
    const v8sf t = x * v8_set1(1.44269504088896341f), n = (t + magic) - magic, f = t - n;
    v8sf p = v8_set1(1.535336188319500e-4f);
    p = p * f + v8_set1(1.339887440266574e-3f);
    p = p * f + v8_set1(9.618437357674640e-3f);
    p = p * f + v8_set1(5.550332471162809e-2f);
    p = p * f + v8_set1(2.402264791363012e-1f);
    p = p * f + v8_set1(6.931472028550421e-1f);
    const v8si e = (__builtin_convertvector(n, v8si) + 127) << 23;
    return (v8_set1(1.0f) + p * f) * (v8sf)e;
}

/* one (sequence, head): rows [s0, s0 + n), head h, D columns (a multiple of 8, at most 128;
 * constant in each caller, so the accumulators stay in registers). buf: D * np keys transposed
 * (np: n rounded up to 8, the padding keys zero), n * D values, 2 * np scores. Query rows go in
 * pairs (the last row alone is paired with itself), each score vector and output vector summing
 * over the dimensions or keys in registers. */
static inline __attribute__((always_inline)) void attend_vec(const void *qkv, int bf16, int64_t H, const int64_t D,
                                                             int64_t s0, int64_t n, int64_t h, float *buf, void *out) {
    const int64_t np = (n + 7) & ~(int64_t)7, C = 3 * H, DV = D / 8;
    float *restrict kt = buf, *restrict v = buf + D * np, *restrict sc = v + n * D, q[2][128];
    const float scale = 1.0f / sqrtf((float)D);
    for (int64_t j = 0; j < np; j++) {
        if (j < n) {
            load_row(qkv, bf16, s0 + j, C, H + h * D, D, q[0]);
            load_row(qkv, bf16, s0 + j, C, 2 * H + h * D, D, v + j * D);
        }
        for (int64_t d = 0; d < D; d++) kt[d * np + j] = j < n ? q[0][d] : 0.0f;
    }
    for (int64_t i = 0; i < n; i += 2) {
        const int64_t i2 = i + 1 < n ? i + 1 : i;
        load_row(qkv, bf16, s0 + i, C, h * D, D, q[0]);
        load_row(qkv, bf16, s0 + i2, C, h * D, D, q[1]);
        for (int64_t d = 0; d < D; d++) {
            q[0][d] *= scale;
            q[1][d] *= scale;
        }
        int64_t jv = 0;
        for (; jv + 32 <= np; jv += 32) { /* scores of both rows for 32 keys: 8 sums in registers */
            v8sf a[2][4];
            for (int u = 0; u < 4; u++) a[0][u] = a[1][u] = v8_set1(0.0f);
            for (int64_t d = 0; d < D; d++) {
                const v8sf b0 = v8_set1(q[0][d]), b1 = v8_set1(q[1][d]);
                for (int u = 0; u < 4; u++) {
                    const v8sf k = v8_load(kt + d * np + jv + 8 * u);
                    a[0][u] += b0 * k;
                    a[1][u] += b1 * k;
                }
            }
            for (int u = 0; u < 4; u++) {
                v8_store(sc + jv + 8 * u, a[0][u]);
                v8_store(sc + np + jv + 8 * u, a[1][u]);
            }
        }
        for (; jv < np; jv += 8) { /* the last keys, 8 at a time */
            v8sf a0 = v8_set1(0.0f), a1 = v8_set1(0.0f);
            for (int64_t d = 0; d < D; d++) {
                const v8sf k = v8_load(kt + d * np + jv);
                a0 += v8_set1(q[0][d]) * k;
                a1 += v8_set1(q[1][d]) * k;
            }
            v8_store(sc + jv, a0);
            v8_store(sc + np + jv, a1);
        }
        float inv[2];
        for (int r = 0; r < 2; r++) { /* e^(s - max) of each row; the padding keys' lanes at -3e38 */
            float *srow = sc + r * np;
            for (int64_t j = n; j < np; j++) srow[j] = -3e38f;
            v8sf m = v8_load(srow);
            for (int64_t k = 8; k < np; k += 8) {
                const v8sf x = v8_load(srow + k);
                const v8si gt = x > m;
                m = (v8sf)(((v8si)x & gt) | ((v8si)m & ~gt));
            }
            float lanes[8], mx;
            v8_store(lanes, m);
            mx = lanes[0];
            for (int l = 1; l < 8; l++) mx = lanes[l] > mx ? lanes[l] : mx;
            v8sf sum = v8_set1(0.0f);
            for (int64_t k = 0; k < np; k += 8) {
                const v8sf e = exp_neg8(v8_load(srow + k) - v8_set1(mx));
                v8_store(srow + k, e);
                sum += e;
            }
            v8_store(lanes, sum);
            float total = 0.0f;
            for (int l = 0; l < 8; l++) total += lanes[l];
            inv[r] = 1.0f / total;
        }
        v8sf o0[16], o1[16]; /* (D / 8 of each used) */
        for (int64_t dv = 0; dv < DV; dv++) o0[dv] = o1[dv] = v8_set1(0.0f);
        for (int64_t j = 0; j < n; j++) {
            const v8sf p0 = v8_set1(sc[j]), p1 = v8_set1(sc[np + j]);
            for (int64_t dv = 0; dv < DV; dv++) {
                const v8sf vv = v8_load(v + j * D + 8 * dv);
                o0[dv] += p0 * vv;
                o1[dv] += p1 * vv;
            }
        }
        for (int r = 0; r < 2; r++) {
            const int64_t row = (s0 + (r ? i2 : i)) * H + h * D;
            for (int64_t dv = 0; dv < DV; dv++) {
                float t[8];
                v8_store(t, (r ? o1[dv] : o0[dv]) * v8_set1(inv[r]));
                for (int l = 0; l < 8; l++) {
                    if (bf16) ((uint16_t *)out)[row + 8 * dv + l] = to_bf16(t[l]);
                    else ((float *)out)[row + 8 * dv + l] = t[l];
                }
            }
        }
    }
}

static void attend_32(const void *qkv, int bf16, int64_t H, int64_t s0, int64_t n, int64_t h, float *buf, void *out) {
    attend_vec(qkv, bf16, H, 32, s0, n, h, buf, out);
}

static void attend_64(const void *qkv, int bf16, int64_t H, int64_t s0, int64_t n, int64_t h, float *buf, void *out) {
    attend_vec(qkv, bf16, H, 64, s0, n, h, buf, out);
}

static void attend_any(const void *qkv, int bf16, int64_t H, int64_t D, int64_t s0, int64_t n, int64_t h, float *buf,
                       void *out) {
    attend_vec(qkv, bf16, H, D, s0, n, h, buf, out);
}

/* 0: done; 1: a head of more than 128 columns or not a multiple of 8, or a buffer that could
 * not be allocated (the caller runs PyTorch) */
int encoder_attention(const void *qkv, int bf16, int64_t T, int64_t H, int64_t heads, const int64_t *starts,
                      const int64_t *lens, int64_t nseq, void *out) {
    const int64_t D = H / heads;
    int64_t longest = 0;
    for (int64_t s = 0; s < nseq; s++) longest = lens[s] > longest ? lens[s] : longest;
    if (D > 128 || D % 8 || D * heads != H) return 1;
    (void)T;
    int failed = 0;
    #pragma omp parallel reduction(| : failed)
    {
        const int64_t np = (longest + 7) & ~(int64_t)7;
        float *buf = malloc((size_t)(D * np + longest * D + 2 * np) * sizeof(float));
        if (!buf) failed = 1;
        #pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < nseq * heads; task++) {
            const int64_t s = task / heads, h = task % heads;
            if (!buf || lens[s] <= 0) continue;
            if (D == 32) attend_32(qkv, bf16, H, starts[s], lens[s], h, buf, out);
            else if (D == 64) attend_64(qkv, bf16, H, starts[s], lens[s], h, buf, out);
            else attend_any(qkv, bf16, H, D, starts[s], lens[s], h, buf, out);
        }
        free(buf);
    }
    return failed;
}

/* GELU, the exact (erf) form BERT uses: out = x / 2 (1 + erf(x / sqrt 2)) (Hendrycks & Gimpel 2016),
 * over n values of x (bf16 or float32; out the same, may be x), computed in float32 and rounded once
 * (as PyTorch's F.gelu). erf by Abramowitz & Stegun 7.1.26 (absolute error under 1.5e-7):
 * erf(z) = 1 - (a1 t + a2 t^2 + ... + a5 t^5) e^(-z^2) with t = 1 / (1 + p |z|), odd in z; the
 * plain loop calls libm's erff. The vector loops agree with the plain one within a few float32
 * ulps, not bit for bit. PyTorch's GELU was 3-5% of an AVX2 embedding pass (a pass of its own
 * over the [T, 1536] intermediate of MiniLM). */
#define GELU_P 0.3275911f
#define GELU_A1 0.254829592f
#define GELU_A2 -0.284496736f
#define GELU_A3 1.421413741f
#define GELU_A4 -1.453152027f
#define GELU_A5 1.061405429f
#if defined(__AVX512F__)
#include "vmath.h"
static inline __m512 gelu16(__m512 x) {
    const __m512 z = _mm512_mul_ps(x, _mm512_set1_ps(0.70710678118654752f));
    const __m512 az = _mm512_abs_ps(z);
    const __m512 one = _mm512_set1_ps(1.f);
    const __m512 t = _mm512_div_ps(one, _mm512_fmadd_ps(_mm512_set1_ps(GELU_P), az, one));
    __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(GELU_A5), t, _mm512_set1_ps(GELU_A4));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(GELU_A3));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(GELU_A2));
    poly = _mm512_fmadd_ps(poly, t, _mm512_set1_ps(GELU_A1));
    poly = _mm512_mul_ps(poly, t);
    const __m512 e = exp16(_mm512_max_ps(_mm512_mul_ps(az, _mm512_sub_ps(_mm512_setzero_ps(), az)),
                                         _mm512_set1_ps(-88.f)));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(z), _mm512_set1_epi32((int)0x80000000u));
    const __m512 erf = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(_mm512_fnmadd_ps(poly, e, one)), sign));
    return _mm512_mul_ps(_mm512_mul_ps(x, _mm512_set1_ps(0.5f)), _mm512_add_ps(erf, one));
}
#define GELU_W 16
#elif defined(__AVX2__) && defined(__FMA__)
#include "vmath.h"
static inline __m256 gelu8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    const __m256 z = _mm256_mul_ps(x, _mm256_set1_ps(0.70710678118654752f));
    const __m256 az = _mm256_andnot_ps(sign, z);
    const __m256 one = _mm256_set1_ps(1.f);
    const __m256 t = _mm256_div_ps(one, _mm256_fmadd_ps(_mm256_set1_ps(GELU_P), az, one));
    __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(GELU_A5), t, _mm256_set1_ps(GELU_A4));
    poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(GELU_A3));
    poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(GELU_A2));
    poly = _mm256_fmadd_ps(poly, t, _mm256_set1_ps(GELU_A1));
    poly = _mm256_mul_ps(poly, t);
    const __m256 e = exp8(_mm256_max_ps(_mm256_xor_ps(sign, _mm256_mul_ps(az, az)), _mm256_set1_ps(-88.f)));
    const __m256 erf = _mm256_or_ps(_mm256_fnmadd_ps(poly, e, one), _mm256_and_ps(sign, z));
    return _mm256_mul_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.5f)), _mm256_add_ps(erf, one));
}
#define GELU_W 8
#else
#define GELU_W 0
#endif

static inline float gelu1(float x) { return 0.5f * x * (1.f + erff(x * 0.70710678118654752f)); }

#if GELU_W == 16
static inline __m512 gelu_load(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i))), 16));
    return _mm512_loadu_ps((const float *)x + i);
}
static inline void gelu_store(void *out, int bf16, int64_t i, __m512 v) {
    if (!bf16) {
        _mm512_storeu_ps((float *)out + i, v);
        return;
    }
    const __m512i u = _mm512_castps_si512(v); /* to_bf16: to nearest even, a NaN kept quiet */
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
    _mm256_storeu_si256((__m256i *)((uint16_t *)out + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
}
#define GELU_V(x) gelu16(x)
#elif GELU_W == 8
static inline __m256 gelu_load(const void *x, int bf16, int64_t i) {
    if (bf16)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)x + i))), 16));
    return _mm256_loadu_ps((const float *)x + i);
}
static inline void gelu_store(void *out, int bf16, int64_t i, __m256 v) {
    if (!bf16) {
        _mm256_storeu_ps((float *)out + i, v);
        return;
    }
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(u, _mm256_set1_epi32(0x400000)),
                           _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))); /* a NaN kept quiet */
    r = _mm256_srli_epi32(r, 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08); /* 8 halves in order */
    _mm_storeu_si128((__m128i *)((uint16_t *)out + i), _mm256_castsi256_si128(packed));
}
#define GELU_V(x) gelu8(x)
#endif

void encoder_gelu(const void *x, int bf16, int64_t n, void *out) {
    #pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t c = 0; c < (n + 4095) / 4096; c++) {
        const int64_t i0 = c * 4096, i1 = i0 + 4096 < n ? i0 + 4096 : n;
        int64_t i = i0;
#if GELU_W
        for (; i + GELU_W <= i1; i += GELU_W) gelu_store(out, bf16, i, GELU_V(gelu_load(x, bf16, i)));
#endif
        for (; i < i1; i++) {
            const float g = gelu1(get(x, bf16, i));
            if (bf16) ((uint16_t *)out)[i] = to_bf16(g);
            else ((float *)out)[i] = g;
        }
    }
}

/* 0: done; 1: a buffer that could not be allocated (the caller runs PyTorch) */
int encoder_add_norm(const void *x, const void *r, int r_f32, const void *w, const void *b, int bf16, int64_t T,
                     int64_t n, float eps, void *out) {
    int failed = 0;
    #pragma omp parallel reduction(| : failed)
    {
        float *row = malloc((size_t)3 * n * sizeof(float)), *wf = row + n, *bfl = row + 2 * n;
        if (!row) failed = 1;
        else
            for (int64_t j = 0; j < n; j++) {
                wf[j] = get(w, bf16, j);
                bfl[j] = get(b, bf16, j);
            }
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            if (!row) continue;
            float mean = 0.0f, var = 0.0f;
            if (bf16 && r_f32) {
                const uint16_t *xs = (const uint16_t *)x + t * n;
                const float *rs = (const float *)r + t * n;
                #pragma omp simd reduction(+ : mean)
                for (int64_t j = 0; j < n; j++) {
                    row[j] = bf16_to_f32(xs[j]) + rs[j];
                    mean += row[j];
                }
            } else if (bf16) {
                const uint16_t *xs = (const uint16_t *)x + t * n, *rs = (const uint16_t *)r + t * n;
                #pragma omp simd reduction(+ : mean)
                for (int64_t j = 0; j < n; j++) {
                    row[j] = bf16_to_f32(to_bf16(bf16_to_f32(xs[j]) + bf16_to_f32(rs[j]))); /* bf16 add: rounded */
                    mean += row[j];
                }
            } else {
                const float *xs = (const float *)x + t * n, *rs = (const float *)r + t * n;
                #pragma omp simd reduction(+ : mean)
                for (int64_t j = 0; j < n; j++) {
                    row[j] = xs[j] + rs[j];
                    mean += row[j];
                }
            }
            const float mu = mean / (float)n;
            #pragma omp simd reduction(+ : var)
            for (int64_t j = 0; j < n; j++) var += (row[j] - mu) * (row[j] - mu);
            const float inv = 1.0f / sqrtf(var / (float)n + eps);
            if (bf16) {
                uint16_t *o = (uint16_t *)out + t * n;
                #pragma omp simd
                for (int64_t j = 0; j < n; j++) o[j] = to_bf16((row[j] - mu) * inv * wf[j] + bfl[j]);
            } else {
                float *o = (float *)out + t * n;
                #pragma omp simd
                for (int64_t j = 0; j < n; j++) o[j] = (row[j] - mu) * inv * wf[j] + bfl[j];
            }
        }
        free(row);
    }
    return failed;
}

/* encoder_linear_s8: out[T, N] = x[T, K] W^T + bias, the encoder's linears on int8 products
 * (--quantization q8_0). W is GGUF Q8_0 (each row's blocks of 32: int8 codes q_w in -127..127,
 * one scale d_w) packed by models/bert.py (`PackedS8.quantize`) into panels of 16 output columns: codes
 * [P][K/4][16][4] (four consecutive k of one column in 4 bytes: one 32-bit lane), scales d_w and
 * sums s_w = d_w * sum(q_w) as [P][K/32][16] float32, P = ceil(N/16) (the last panel padded with
 * zero codes). Each row of x, multiplied column by column by `smooth` [K] where given (the
 * SmoothQuant factors whose inverses the packed weight carries: Xiao et al. 2023), is quantized
 * per block of 32 to 7-bit unsigned codes with a minimum (asymmetric: x ~ d_x q_x + m_x, q_x =
 * round((x - m_x) / d_x) in 0..127, d_x = (max - min) / 127), then
 *     out[t, n] = bias[n] + sum over blocks of ( (d_w * sum_32 q_w q_x) * d_x  +  s_w * m_x )
 * each block's int32 dot exact, the float32 steps in this order with fused multiply-adds, so the
 * plain C loop and every vector loop give the same bits. 7 bits because AVX2's vpmaddubsw sums
 * two u8 x s8 products in int16: 2 * 127 * 127 fits, 2 * 255 * 127 does not (PyTorch's x86
 * int8 path reduces activations to 7 bits for the same reason); the asymmetric range keeps the
 * precision of 8 symmetric bits (simulated on all-MiniLM-L6-v2, 200 texts: min cosine 0.99915
 * against float32, 8-bit symmetric 0.99927, 7-bit symmetric 0.99861; blocks of 64 on either side
 * or a scale per whole row lose more; with the smoothing 0.99953). Loops: AVX-512 VNNI (one
 * vpdpbusd per 16 columns x 4 k, 8 rows a tile), AVX-VNNI (the same on 256 bits), AVX2
 * (vpmaddubsw, vpmaddwd with ones, vpaddd; 4 rows a tile: 3 rows measured slower), plain C;
 * threads over (16-tile chunk of rows, panel) pairs, each thread's chunk of x codes read from
 * L2 for every panel. Measured (`python benchmarks/embeddings.py --gemm`, 2 threads, GOP/s on
 * MiniLM's shapes at 2048 rows): the AVX2 loop 220-290 against MKL's AVX2 sgemm at 190-230 (the products cost two
 * multiply uops per 32 where sgemm's FMA costs one per 8, and each block's float epilogue four
 * more per 16; so at most about 1.6x sgemm), AVX-VNNI 360-440 (2x). 0: done; 1: K not a
 * multiple of 32 or no memory (the caller raises: the model's loader checked K). */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define S8_MR 8
#define S8_LOOP "avx512vnni"
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define S8_MR 4
#ifdef __AVXVNNI__
#define S8_LOOP "avxvnni"
#else
#define S8_LOOP "avx2"
#endif
#else
#define S8_MR 4
#define S8_LOOP "c"
#endif
#define S8_CHUNK (16 * S8_MR) /* rows of x per task */

const char *encoder_linear_s8_loop(void) { return S8_LOOP; }

/* row t of x [T, K] (float32 or bf16) -> its codes [K] and per-block d, m [K/32]; the AVX2 loop
 * rounds as nearbyintf does (to nearest even), so both give the same codes */
static void quantize_u7(const void *x, int bf16, int64_t t, int64_t K, const float *smooth, uint8_t *q, float *d,
                        float *m) {
    float v[32];
    for (int64_t b = 0; b < K / 32; b++) {
        load_row(x, bf16, t, K, b * 32, 32, v);
        if (smooth)
            for (int j = 0; j < 32; j++) v[j] *= smooth[b * 32 + j];
        uint8_t *out = q + t * K + b * 32;
#if defined(__AVX2__)
        __m256 x0 = _mm256_loadu_ps(v), x1 = _mm256_loadu_ps(v + 8), x2 = _mm256_loadu_ps(v + 16),
               x3 = _mm256_loadu_ps(v + 24);
        __m256 lo8 = _mm256_min_ps(_mm256_min_ps(x0, x1), _mm256_min_ps(x2, x3));
        __m256 hi8 = _mm256_max_ps(_mm256_max_ps(x0, x1), _mm256_max_ps(x2, x3));
        __m128 l4 = _mm_min_ps(_mm256_castps256_ps128(lo8), _mm256_extractf128_ps(lo8, 1));
        __m128 h4 = _mm_max_ps(_mm256_castps256_ps128(hi8), _mm256_extractf128_ps(hi8, 1));
        l4 = _mm_min_ps(l4, _mm_movehl_ps(l4, l4));
        h4 = _mm_max_ps(h4, _mm_movehl_ps(h4, h4));
        const float lo = _mm_cvtss_f32(_mm_min_ss(l4, _mm_movehdup_ps(l4)));
        const float hi = _mm_cvtss_f32(_mm_max_ss(h4, _mm_movehdup_ps(h4)));
        const float step = (hi - lo) / 127.0f, inv = step > 0.0f ? 1.0f / step : 0.0f;
        const __m256 vl = _mm256_set1_ps(lo), vi = _mm256_set1_ps(inv), top = _mm256_set1_ps(127.0f);
#define Q8(z) _mm256_cvtps_epi32(_mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(z, vl), vi), top))
        const __m256i w01 = _mm256_packs_epi32(Q8(x0), Q8(x1)), w23 = _mm256_packs_epi32(Q8(x2), Q8(x3));
#undef Q8
        const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w01, w23),
                                                          _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out, bytes);
#else
        float lo = v[0], hi = v[0];
        for (int j = 1; j < 32; j++) {
            lo = v[j] < lo ? v[j] : lo;
            hi = v[j] > hi ? v[j] : hi;
        }
        const float step = (hi - lo) / 127.0f, inv = step > 0.0f ? 1.0f / step : 0.0f;
        for (int j = 0; j < 32; j++) {
            const float r = (v[j] - lo) * inv;
            out[j] = (uint8_t)nearbyintf(r < 127.0f ? r : 127.0f);
        }
#endif
        d[t * (K / 32) + b] = step;
        m[t * (K / 32) + b] = lo;
    }
}

/* the tile's float32 sums [rows][16] plus bias, into out's columns n0.. of the panel below N */
static void store_row(const float *acc, const float *bias, int64_t nc, int out_bf16, void *out, int64_t at) {
    if (out_bf16)
        for (int64_t c = 0; c < nc; c++) ((uint16_t *)out)[at + c] = to_bf16(acc[c] + bias[c]);
    else
        for (int64_t c = 0; c < nc; c++) ((float *)out)[at + c] = acc[c] + bias[c];
}

static void store_tile(const float *acc, int rows, const float *bias, int64_t n0, int64_t N, int out_bf16, void *out,
                       int64_t t0) {
    for (int r = 0; r < rows; r++) {
        if (N - n0 >= 16) store_row(acc + r * 16, bias + n0, 16, out_bf16, out, (t0 + r) * N + n0); /* vectorized */
        else store_row(acc + r * 16, bias + n0, N - n0, out_bf16, out, (t0 + r) * N + n0);
    }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* rows (1..8) rows of codes qx (row stride K) x one panel -> acc [rows][16] */
static inline __attribute__((always_inline)) void tile_s8(const uint8_t *qx, const float *dx, const float *mx,
                                                          int64_t K, const int8_t *w, const float *dw,
                                                          const float *ws, const int rows, float *acc) {
    const int64_t nb = K / 32;
    __m512 f[S8_MR];
    for (int r = 0; r < S8_MR; r++) f[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m512i s[S8_MR];
        for (int r = 0; r < S8_MR; r++) s[r] = _mm512_setzero_si512();
        for (int k = 0; k < 8; k++) {
            const __m512i wv = _mm512_loadu_si512(w + (b * 8 + k) * 64);
            for (int r = 0; r < S8_MR; r++)
                if (r < rows) {
                    int32_t a;
                    memcpy(&a, qx + r * K + b * 32 + k * 4, 4);
                    s[r] = _mm512_dpbusd_epi32(s[r], _mm512_set1_epi32(a), wv);
                }
        }
        const __m512 d = _mm512_loadu_ps(dw + b * 16), sw = _mm512_loadu_ps(ws + b * 16);
        for (int r = 0; r < S8_MR; r++)
            if (r < rows) {
                f[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s[r]), d), _mm512_set1_ps(dx[r * nb + b]), f[r]);
                f[r] = _mm512_fmadd_ps(sw, _mm512_set1_ps(mx[r * nb + b]), f[r]);
            }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(acc + r * 16, f[r]);
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline __m256i dot4_s8(__m256i s, __m256i a, __m256i w) {
#ifdef __AVXVNNI__
    return _mm256_dpbusd_avx_epi32(s, a, w);
#else
    return _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(a, w), _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) void tile_s8(const uint8_t *qx, const float *dx, const float *mx,
                                                          int64_t K, const int8_t *w, const float *dw,
                                                          const float *ws, const int rows, float *acc) {
    const int64_t nb = K / 32;
    __m256 f[S8_MR][2];
    for (int r = 0; r < S8_MR; r++) f[r][0] = f[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i s[S8_MR][2];
        for (int r = 0; r < S8_MR; r++) s[r][0] = s[r][1] = _mm256_setzero_si256();
        for (int k = 0; k < 8; k++) {
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + k) * 64));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(w + (b * 8 + k) * 64 + 32));
            for (int r = 0; r < S8_MR; r++)
                if (r < rows) {
                    int32_t a;
                    memcpy(&a, qx + r * K + b * 32 + k * 4, 4);
                    const __m256i av = _mm256_set1_epi32(a);
                    s[r][0] = dot4_s8(s[r][0], av, w0);
                    s[r][1] = dot4_s8(s[r][1], av, w1);
                }
        }
        for (int h = 0; h < 2; h++) {
            const __m256 d = _mm256_loadu_ps(dw + b * 16 + 8 * h), sw = _mm256_loadu_ps(ws + b * 16 + 8 * h);
            for (int r = 0; r < S8_MR; r++)
                if (r < rows) {
                    f[r][h] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(s[r][h]), d), _mm256_set1_ps(dx[r * nb + b]), f[r][h]);
                    f[r][h] = _mm256_fmadd_ps(sw, _mm256_set1_ps(mx[r * nb + b]), f[r][h]);
                }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm256_storeu_ps(acc + r * 16, f[r][0]);
        _mm256_storeu_ps(acc + r * 16 + 8, f[r][1]);
    }
}
#else
/* the plain loop: the same sums in the same order */
static inline void tile_s8(const uint8_t *qx, const float *dx, const float *mx, int64_t K, const int8_t *w,
                           const float *dw, const float *ws, const int rows, float *acc) {
    const int64_t nb = K / 32;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < 16; c++) {
            float f = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                int32_t s = 0;
                for (int k = 0; k < 32; k++) s += (int32_t)qx[r * K + b * 32 + k] * w[(b * 8 + k / 4) * 64 + c * 4 + k % 4];
                f = fmaf((float)s * dw[b * 16 + c], dx[r * nb + b], f);
                f = fmaf(ws[b * 16 + c], mx[r * nb + b], f);
            }
            acc[r * 16 + c] = f;
        }
}
#endif

static void tile_rows(const uint8_t *qx, const float *dx, const float *mx, int64_t K, const int8_t *w,
                      const float *dw, const float *ws, int rows, float *acc) {
    if (rows == S8_MR) tile_s8(qx, dx, mx, K, w, dw, ws, S8_MR, acc); /* the full tile: rows a constant */
    else tile_s8(qx, dx, mx, K, w, dw, ws, rows, acc);
}

int encoder_linear_s8(const void *x, int bf16, int64_t T, int64_t K, const float *smooth, const int8_t *w,
                      const float *dw, const float *ws, const float *bias, int64_t N, int out_bf16, void *out) {
    if (K % 32 || K <= 0) return 1;
    if (T <= 0 || N <= 0) return 0;
    const int64_t nb = K / 32, P = (N + 15) / 16, chunks = (T + S8_CHUNK - 1) / S8_CHUNK;
    uint8_t *qx = malloc((size_t)(T * K));
    float *dx = malloc((size_t)(T * nb) * sizeof(float)), *mx = malloc((size_t)(T * nb) * sizeof(float));
    if (!qx || !dx || !mx) {
        free(qx), free(dx), free(mx);
        return 1;
    }
    #pragma omp parallel
    {
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) quantize_u7(x, bf16, t, K, smooth, qx, dx, mx);
        float acc[S8_MR * 16];
        #pragma omp for collapse(2) schedule(static)
        for (int64_t c = 0; c < chunks; c++)
            for (int64_t p = 0; p < P; p++)
                for (int64_t t = c * S8_CHUNK; t < (c + 1) * S8_CHUNK && t < T; t += S8_MR) {
                    const int rows = (int)(T - t < S8_MR ? T - t : S8_MR);
                    tile_rows(qx + t * K, dx + t * nb, mx + t * nb, K, w + p * 16 * K, dw + p * nb * 16,
                              ws + p * nb * 16, rows, acc);
                    store_tile(acc, rows, bias, p * 16, N, out_bf16, out, t);
                }
    }
    free(qx), free(dx), free(mx);
    return 0;
}
