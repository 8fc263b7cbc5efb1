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
