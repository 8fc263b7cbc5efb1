/* Attention of a prefill chunk against many cached keys, the two steps around PyTorch's bf16
 * p v matmul: the scores s = (q . k) * scale, float32 from bf16 queries and keys, and the causal
 * softmax of each score row into bf16 probabilities. nextoken's own kernels; the reference they
 * must match is `nextoken.layers.attention.prefill_attention` with native=False (a float32 bmm,
 * PyTorch's softmax, a rounding to bf16), and tests hold them to it.
 *
 * Scores: the products exact (AVX512-BF16's vdpbf16ps multiplies bf16 pairs exactly and sums in
 * float32), as PyTorch's float32 bmm of the same bf16 values computes them, at the bf16 rate.
 *   q      [Hkv, R, D] bf16               the query rows of each KV head (GQA: its heads' rows stacked)
 *   k      [Hkv, S, D] bf16               the keys
 *   packed [Hkv, ceil(S/64), D/2, 64] u32 k in tiles of 64 keys (zeros past S); word (i, l) of a
 *                                         tile is dims 2i, 2i + 1 of its key l (`prefill_pack_keys`)
 *   out    [Hkv, R, keys] f32             scores against keys 0 .. keys - 1
 * Register tile: 6 query rows x 64 keys (24 accumulators); for each pair of dims, four loads of a
 * key tile and six broadcasts of a query pair feed 24 vdpbf16ps. A key tile (D * 128 bytes) is
 * read contiguously and stays in L1 while a chunk of RCHUNK query rows passes; tasks (head, 256
 * keys, RCHUNK rows) run over OpenMP.
 *
 * Softmax: row r of a head's R = group * n rows is query i = r % n of the block, which sees keys
 * 0 .. keys - n + i (the causal mask: the rest of its row is written as zeros, never exponentiated).
 * p = exp(s - max) / sum over the visible keys, exp from 2^k e^f (k = round(x log2 e), f reduced in
 * two steps by ln 2, e^f by its degree-7 Taylor polynomial: relative error under 2e-7), rounded to
 * bf16 to nearest even (as PyTorch's .to(bfloat16)).
 * Entry points return 2 when the CPU has no AVX512-BF16 (the caller keeps PyTorch).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "vmath.h" /* exp16 */
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#define ROWS 6     /* query rows per register tile */
#define KT 64      /* keys per packed tile */
#define KEYS 256   /* keys per task */
#define RCHUNK 48  /* query rows per task */

int prefill_scores_supported(void) { return HAVE_BF16_DOT; }

/* k [Hkv, S, D] -> packed [Hkv, ceil(S/64), D/2, 64] (see the top of this file) */
void prefill_pack_keys(const uint16_t *k, int64_t Hkv, int64_t S, int64_t D, uint32_t *packed) {
    const int64_t tiles = (S + KT - 1) / KT, half = D / 2;
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t tt = 0; tt < tiles; tt++) {
            uint32_t *dst = packed + (h * tiles + tt) * half * KT;
            for (int64_t l = 0; l < KT; l++) {
                const int64_t t = tt * KT + l;
                const uint32_t *row = (const uint32_t *)(k + (h * S + t) * D);
                for (int64_t i = 0; i < half; i++) dst[i * KT + l] = t < S ? row[i] : 0u;
            }
        }
}

#if HAVE_BF16_DOT
/* rows r0 .. r0 + nr - 1 (nr <= ROWS) against the 64 keys of tile kp from key t; stores keys < keys */
static inline void tile(const uint16_t *q, const uint32_t *kp, int64_t D, int64_t r0, int64_t nr, int64_t t,
                        int64_t keys, __m512 vs, float *out) {
    const uint32_t *qw[ROWS];
    for (int64_t r = 0; r < ROWS; r++) qw[r] = (const uint32_t *)(q + (r0 + (r < nr ? r : 0)) * D);
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < D / 2; i++) {
        __m512i kv[4];
        for (int j = 0; j < 4; j++) kv[j] = _mm512_loadu_si512((const void *)(kp + i * KT + 16 * j));
        for (int r = 0; r < ROWS; r++) {
            const __m512i qb = _mm512_set1_epi32((int)qw[r][i]);
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)kv[j], (__m512bh)qb);
        }
    }
    const int64_t left = keys - t;
    for (int j = 0; j < 4; j++) {
        const int64_t n = left - 16 * j;
        const __mmask16 m = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
        for (int64_t r = 0; r < nr; r++) _mm512_mask_storeu_ps(out + (r0 + r) * keys + t + 16 * j, m, _mm512_mul_ps(acc[r][j], vs));
    }
}
#endif

/* out[h, r, t] = scale * q[h, r] . k[h, t] for t < keys, from the packed keys of S in all */
int prefill_scores(const uint16_t *q, const uint32_t *packed, int64_t Hkv, int64_t R, int64_t S, int64_t D,
                   int64_t keys, float scale, float *out) {
#if HAVE_BF16_DOT
    if (D % 2 || keys > S) return 2;
    const int64_t tiles = (S + KT - 1) / KT, row_chunks = (R + RCHUNK - 1) / RCHUNK, key_chunks = (keys + KEYS - 1) / KEYS;
    const __m512 vs = _mm512_set1_ps(scale);
    #pragma omp parallel for collapse(3) schedule(dynamic, 2)
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t kc = 0; kc < key_chunks; kc++)
            for (int64_t rc = 0; rc < row_chunks; rc++) {
                const int64_t r_end = (rc + 1) * RCHUNK < R ? (rc + 1) * RCHUNK : R;
                for (int64_t t = kc * KEYS; t < keys && t < (kc + 1) * KEYS; t += KT) {
                    const uint32_t *kp = packed + (h * tiles + t / KT) * (D / 2) * KT;
                    for (int64_t r0 = rc * RCHUNK; r0 < r_end; r0 += ROWS)
                        tile(q + h * R * D, kp, D, r0, r_end - r0 < ROWS ? r_end - r0 : ROWS, t, keys, vs, out + h * R * keys);
                }
            }
    return 0;
#else
    (void)q; (void)packed; (void)Hkv; (void)R; (void)S; (void)D; (void)keys; (void)scale; (void)out;
    return 2;
#endif
}

#if HAVE_BF16_DOT

static inline __mmask16 first(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

/* one row: s [keys] float32 (overwritten with exp), p [keys] bf16; keys 0 .. visible - 1 count */
static void softmax_row(float *s, uint16_t *p, int64_t keys, int64_t visible) {
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff());
    __m512 vmax = ninf;
    for (int64_t t = 0; t < visible; t += 16) /* lanes past the row's end read as -inf, not 0 */
        vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(ninf, first(visible - t), s + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < visible; t += 16) {
        const __mmask16 m = first(visible - t);
        const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), mx)));
        _mm512_mask_storeu_ps(s + t, m, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(vsum));
    for (int64_t t = 0; t < visible; t += 16) {
        const __mmask16 m = first(visible - t);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
        _mm256_mask_storeu_epi16(p + t, m, (__m256i)b);
    }
    if (keys > visible) memset(p + visible, 0, sizeof(uint16_t) * (size_t)(keys - visible));
}
#endif

/* probs [Hkv, group * n, keys] bf16 = causal softmax of scores [Hkv, group * n, keys] float32 (their
 * rows overwritten): row r is query r % n of a block of n whose last query sees every key. */
int prefill_softmax(float *scores, int64_t Hkv, int64_t group, int64_t n, int64_t keys, uint16_t *probs) {
#if HAVE_BF16_DOT
    if (n > keys || n < 1) return 2;
    const int64_t rows = Hkv * group * n;
    #pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        softmax_row(scores + r * keys, probs + r * keys, keys, keys - n + 1 + r % n);
    return 0;
#else
    (void)scores; (void)Hkv; (void)group; (void)n; (void)keys; (void)probs;
    return 2;
#endif
}
