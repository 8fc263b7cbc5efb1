/* Dense bf16 weights: y = x W^T (+ bias) for W [N, K] bf16, row-major as a checkpoint stores it.
 * nextoken's own kernel, included by qmatmul.c: a qw_t with bits == 16 names such a weight
 * (codes: the bf16 values, no scales), so the Linear layers (qmatmul) and the one-call decode
 * step (decode.c) run it beside the block formats. The reference it must match is PyTorch's
 * bf16 linear (`torch.nn.functional.linear` on bf16 tensors): every product in float32, summed in
 * float32, the bias added, one rounding to bf16 at the end (the float32 output is the sum itself).
 * The order of the sum differs from PyTorch's (lanes, then a tree), so results agree within
 * float32 rounding of the sum, then bf16 rounding.
 *
 * Decode reads each weight once per step, so its speed is the memory's: a thread takes a
 * contiguous range of rows, DB_ROWS rows at a time, each row one sequential stream.
 *   AVX512-BF16 (vdpbf16ps): x rounded to bf16 once (a bf16 model's activations already are),
 *     pairs of products summed in float32 by the instruction;
 *   AVX2 + FMA (also on an AVX-512 CPU without BF16): each bf16 is widened (a 16-bit shift:
 *     bf16 is the top half of a float32) and multiplied in float32;
 *   portable C: the same float32 products and sums, one lane at a time.
 * More rows than DB_MROWS (a batch of decodes) share each block of DB_BLOCK weight rows, widened
 * to float32 once and kept in L2 for every row of x; larger calls (prefill) are left to the caller's
 * float32 matmul, which the Linear layer runs (`layers.quantization.methods.DenseKernelMethod`).
 */
#include <stdint.h>
#include <stdlib.h>

#define DB_ROWS 4 /* weight rows per pass */
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define DB_DPBF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DB_AVX2 1
#endif

/* the bias and the rounding of one output */
static inline void db_store(void *y, int y_bf16, int64_t idx, float v, const float *bias, int64_t n) {
    if (bias) v += bias[n];
    store1(y, y_bf16, idx, v);
}

#ifdef DB_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 bf16 at p, widened to float32 */
static inline __m256 widen8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* rows [n0, n0 + nr) of W against one float32 row x: dot products into out[0..nr) */
static void db_dots_row(const float *x, const uint16_t *W, int64_t K, int64_t n0, int64_t nr, float *out) {
    int64_t r = 0;
#ifdef DB_AVX2
    for (; r + DB_ROWS <= nr; r += DB_ROWS) {
        const uint16_t *w0 = W + (n0 + r) * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
        int64_t k = 0;
        /* the rows of a pass ahead, two lines per step (a prefetch past the weight's end is
         * harmless: it never faults): two passes ahead into L1 while a pass is at most 16 KiB,
         * else the next pass into L2 (measured on Qwen2.5-0.5B's shapes, benchmarks/dense_bf16.py) */
        const int near = DB_ROWS * K * 2 <= 16384;
        const char *next = (const char *)(w0 + (near ? 2 : 1) * DB_ROWS * K);
        for (; k + 16 <= K; k += 16) {
if (near) {
                _mm_prefetch(next + 8 * k, _MM_HINT_T0);
                _mm_prefetch(next + 8 * k + 64, _MM_HINT_T0);
            } else {
                _mm_prefetch(next + 8 * k, _MM_HINT_T1);
                _mm_prefetch(next + 8 * k + 64, _MM_HINT_T1);
            }
            const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            a0 = _mm256_fmadd_ps(widen8(w0 + k), x0, a0);
            b0 = _mm256_fmadd_ps(widen8(w0 + k + 8), x1, b0);
            a1 = _mm256_fmadd_ps(widen8(w1 + k), x0, a1);
            b1 = _mm256_fmadd_ps(widen8(w1 + k + 8), x1, b1);
            a2 = _mm256_fmadd_ps(widen8(w2 + k), x0, a2);
            b2 = _mm256_fmadd_ps(widen8(w2 + k + 8), x1, b2);
            a3 = _mm256_fmadd_ps(widen8(w3 + k), x0, a3);
            b3 = _mm256_fmadd_ps(widen8(w3 + k + 8), x1, b3);
        }
        float s[DB_ROWS] = {hsum8(_mm256_add_ps(a0, b0)), hsum8(_mm256_add_ps(a1, b1)), hsum8(_mm256_add_ps(a2, b2)),
                            hsum8(_mm256_add_ps(a3, b3))};
        for (; k < K; k++) {
            s[0] += x[k] * bf16_to_f32(w0[k]);
            s[1] += x[k] * bf16_to_f32(w1[k]);
            s[2] += x[k] * bf16_to_f32(w2[k]);
            s[3] += x[k] * bf16_to_f32(w3[k]);
        }
        for (int i = 0; i < DB_ROWS; i++) out[r + i] = s[i];
    }
#endif
    for (; r < nr; r++) { /* portable: 8 lanes, as the vector loop sums */
        const uint16_t *w = W + (n0 + r) * K;
        float lane[8] = {0};
        int64_t k = 0;
        for (; k + 8 <= K; k += 8)
            for (int l = 0; l < 8; l++) lane[l] += x[k + l] * bf16_to_f32(w[k + l]);
        float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
        for (; k < K; k++) s += x[k] * bf16_to_f32(w[k]);
        out[r] = s;
    }
}

#ifdef DB_DPBF16
/* one bf16 row x against rows [n0, n0 + nr) of W with vdpbf16ps (K % 32 == 0) */
static void db_dots_row_bf16(const uint16_t *xb, const uint16_t *W, int64_t K, int64_t n0, int64_t nr, float *out) {
    for (int64_t r = 0; r < nr; r++) {
        const uint16_t *w = W + (n0 + r) * K;
        __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k + 64 <= K; k += 64) {
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                                   (__m512bh)_mm512_loadu_si512((const void *)(xb + k)));
            acc2 = _mm512_dpbf16_ps(acc2, (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)),
                                    (__m512bh)_mm512_loadu_si512((const void *)(xb + k + 32)));
        }
        for (; k < K; k += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(w + k)),
                                   (__m512bh)_mm512_loadu_si512((const void *)(xb + k)));
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
    }
}
#endif

/* rows of xf [M, K] against the nr weight rows wf [nr, K], already widened to float32: out [M, nr].
 * The vector loop takes three rows of x and four of wf at a time (twelve sums, seven loads),
 * then two; returns how many rows it did (all of them in the portable build; a last odd row is
 * left to db_dots_row, which streams the bf16 rows). */
static int64_t db_dots_block(const float *xf, int64_t M, const float *wf, int64_t K, int64_t nr, float *out) {
    int64_t m = 0;
#ifdef DB_AVX2
    if (K % 8 == 0 && nr % DB_ROWS == 0)
        for (; m + 3 <= M; m += 3) { /* three rows of x against four of wf: twelve sums, seven loads */
            const float *x0 = xf + m * K, *x1 = x0 + K, *x2 = x1 + K;
            for (int64_t r = 0; r < nr; r += DB_ROWS) {
                const float *w0 = wf + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                __m256 c0 = a0, c1 = a0, c2 = a0, c3 = a0;
                for (int64_t k = 0; k < K; k += 8) {
                    const __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k), z = _mm256_loadu_ps(x2 + k);
                    __m256 q = _mm256_loadu_ps(w0 + k);
                    a0 = _mm256_fmadd_ps(q, u, a0), b0 = _mm256_fmadd_ps(q, v, b0), c0 = _mm256_fmadd_ps(q, z, c0);
                    q = _mm256_loadu_ps(w1 + k);
                    a1 = _mm256_fmadd_ps(q, u, a1), b1 = _mm256_fmadd_ps(q, v, b1), c1 = _mm256_fmadd_ps(q, z, c1);
                    q = _mm256_loadu_ps(w2 + k);
                    a2 = _mm256_fmadd_ps(q, u, a2), b2 = _mm256_fmadd_ps(q, v, b2), c2 = _mm256_fmadd_ps(q, z, c2);
                    q = _mm256_loadu_ps(w3 + k);
                    a3 = _mm256_fmadd_ps(q, u, a3), b3 = _mm256_fmadd_ps(q, v, b3), c3 = _mm256_fmadd_ps(q, z, c3);
                }
                float *o0 = out + m * nr + r, *o1 = o0 + nr, *o2 = o1 + nr;
                o0[0] = hsum8(a0), o0[1] = hsum8(a1), o0[2] = hsum8(a2), o0[3] = hsum8(a3);
                o1[0] = hsum8(b0), o1[1] = hsum8(b1), o1[2] = hsum8(b2), o1[3] = hsum8(b3);
                o2[0] = hsum8(c0), o2[1] = hsum8(c1), o2[2] = hsum8(c2), o2[3] = hsum8(c3);
            }
        }
    if (K % 8 == 0 && nr % DB_ROWS == 0)
        for (; m + 2 <= M; m += 2) {
            const float *x0 = xf + m * K, *x1 = x0 + K;
            for (int64_t r = 0; r < nr; r += DB_ROWS) {
                const float *w0 = wf + r * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
                for (int64_t k = 0; k < K; k += 8) {
                    const __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
                    const __m256 c0 = _mm256_loadu_ps(w0 + k), c1 = _mm256_loadu_ps(w1 + k);
                    const __m256 c2 = _mm256_loadu_ps(w2 + k), c3 = _mm256_loadu_ps(w3 + k);
                    a0 = _mm256_fmadd_ps(c0, u, a0);
                    b0 = _mm256_fmadd_ps(c0, v, b0);
                    a1 = _mm256_fmadd_ps(c1, u, a1);
                    b1 = _mm256_fmadd_ps(c1, v, b1);
                    a2 = _mm256_fmadd_ps(c2, u, a2);
                    b2 = _mm256_fmadd_ps(c2, v, b2);
                    a3 = _mm256_fmadd_ps(c3, u, a3);
                    b3 = _mm256_fmadd_ps(c3, v, b3);
                }
                float *o0 = out + m * nr + r, *o1 = o0 + nr;
                o0[0] = hsum8(a0), o0[1] = hsum8(a1), o0[2] = hsum8(a2), o0[3] = hsum8(a3);
                o1[0] = hsum8(b0), o1[1] = hsum8(b1), o1[2] = hsum8(b2), o1[3] = hsum8(b3);
            }
        }
#endif
#ifdef DB_AVX2
    if (K % 8 == 0 && nr % DB_ROWS == 0) return m; /* a last row: the caller streams it (db_dots_row) */
#endif
    for (; m < M; m++) /* portable: 8 lanes, as the vector loop sums */
        for (int64_t r = 0; r < nr; r++) {
            const float *x = xf + m * K, *w = wf + r * K;
            float lane[8] = {0};
            int64_t k = 0;
            for (; k + 8 <= K; k += 8)
                for (int l = 0; l < 8; l++) lane[l] += x[k + l] * w[k + l];
            float s = ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
            for (; k < K; k++) s += x[k] * w[k];
            out[m * nr + r] = s;
        }
    return m;
}

#define DB_MROWS 4  /* up to this many rows of x stream the weights directly; more widen them once */
#define DB_BLOCK 16 /* weight rows per block (a thread's unit of work) */

/* rows [n0, n0 + nr) of weight w against every row of x: xf [M, K] float32 (xb: the same rows in
 * bf16, for vdpbf16ps), y [M, ldy], bias and rounding; wf: [DB_BLOCK, K] float32 scratch when
 * M > DB_MROWS */
static void db_block(const float *xf, const uint16_t *xb, int64_t M, const qw_t *w, int64_t n0, int64_t nr,
                     float *wf, void *y, int y_bf16, int64_t ldy) {
    const int64_t K = w->K;
    const uint16_t *W = (const uint16_t *)w->codes;
    float out[DB_BLOCK * 64];
    (void)xb;
    if (wf) /* widened once, for every row of x */
        for (int64_t i = 0; i < nr * K; i++) wf[i] = bf16_to_f32(W[n0 * K + i]);
    for (int64_t m0 = 0; m0 < M; m0 += 64) {
        const int64_t mr = M - m0 < 64 ? M - m0 : 64;
        if (wf) {
            const int64_t done = db_dots_block(xf + m0 * K, mr, wf, K, nr, out);
            for (int64_t m = done; m < mr; m++) db_dots_row(xf + (m0 + m) * K, W, K, n0, nr, out + m * nr);
        } else {
            for (int64_t m = 0; m < mr; m++)
#ifdef DB_DPBF16
                if (K % 32 == 0) db_dots_row_bf16(xb + (m0 + m) * K, W, K, n0, nr, out + m * nr); else
#endif
                db_dots_row(xf + (m0 + m) * K, W, K, n0, nr, out + m * nr);
        }
        for (int64_t m = 0; m < mr; m++)
            for (int64_t r = 0; r < nr; r++) db_store(y, y_bf16, (m0 + m) * ldy + n0 + r, out[m * nr + r], w->bias, n0 + r);
    }
}

#define DB_MAX_WEIGHTS 8

/* ys[i] [M, N_i] (row stride ldys[i], or N_i when ldys is NULL; bf16 or float32) = x [M, K] (bf16
 * or float32) W_i^T + bias_i for nw <= DB_MAX_WEIGHTS dense weights of the same K (q, k and v;
 * gate and up): one parallel pass over all their rows, so a small weight (k, v) costs no fork and
 * join of its own. Returns 0, 1 when out of memory, 2 for more than DB_MAX_WEIGHTS weights. */
static int dense_bf16_multi(const void *x, int x_bf16, int64_t M, const qw_t *const *ws, int nw, void *const *ys,
                            int y_bf16, const int64_t *ldys) {
    if (nw < 1 || nw > DB_MAX_WEIGHTS) return 2;
    const int64_t K = ws[0]->K;
    float *xf = malloc(sizeof(float) * (size_t)(M * K));
    uint16_t *xb = NULL;
    if (!xf) return 1;
    for (int64_t i = 0; i < M * K; i++) xf[i] = x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
#ifdef DB_DPBF16
    xb = malloc(sizeof(uint16_t) * (size_t)(M * K));
    if (!xb) { free(xf); return 1; }
    for (int64_t i = 0; i < M * K; i++) xb[i] = f32_to_bf16(xf[i]);
#endif
    int64_t first[DB_MAX_WEIGHTS + 1] = {0}, work = 0; /* first block of each weight, in the pass over all */
    for (int i = 0; i < nw; i++) {
        first[i + 1] = first[i] + (ws[i]->N + DB_BLOCK - 1) / DB_BLOCK;
        work += ws[i]->N * K * M;
    }
    int failed = 0;
    #pragma omp parallel if (work >= 65536)
    {
        float *wf = M > DB_MROWS ? malloc(sizeof(float) * (size_t)(DB_BLOCK * K)) : NULL;
        if (M > DB_MROWS && !wf) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < first[nw]; b++) {
            if (M > DB_MROWS && !wf) continue;
            int i = 0;
            while (b >= first[i + 1]) i++;
            const int64_t n0 = (b - first[i]) * DB_BLOCK, N = ws[i]->N;
            db_block(xf, xb, M, ws[i], n0, N - n0 < DB_BLOCK ? N - n0 : DB_BLOCK, wf, ys[i], y_bf16, ldys ? ldys[i] : N);
        }
        free(wf);
    }
    free(xb);
    free(xf);
    return failed;
}

/* y [M, N] (row stride ldy) = x [M, K] W^T + bias for one dense weight (see dense_bf16_multi) */
static int dense_bf16_matmul(const void *x, int x_bf16, int64_t M, const qw_t *w, void *y, int y_bf16, int64_t ldy) {
    return dense_bf16_multi(x, x_bf16, M, &w, 1, &y, y_bf16, &ldy);
}

/* 1 when the dense bf16 loops are vectorized (AVX2 + FMA or AVX512-BF16), 0 for the plain C ones */
int dense_bf16_vectorized(void) {
#if defined(DB_AVX2) || defined(DB_DPBF16)
    return 1;
#else
    return 0;
#endif
}
