/* Attention scores of a prefill chunk, s = (q . k) * scale, from bf16 queries and keys to
 * float32 scores: the products exact (AVX512-BF16's vdpbf16ps multiplies bf16 pairs exactly and
 * sums in float32), as PyTorch's float32 bmm of the same bf16 values computes them, at the bf16
 * matrix rate. nextoken's own kernel; `nextoken.layers.attention.prefill_attention` uses it for
 * the q k^T of each block of query rows and keeps its float32 bmm as the reference (a test holds
 * the two equal).
 *
 *   q      [Hkv, R, D] bf16     the query rows of each KV head (GQA: its heads' rows stacked)
 *   k      [Hkv, S, D] bf16     the keys
 *   packed [Hkv, D / 2, S] u32  k as bf16 pairs (dims 2i, 2i + 1 of one key), `prefill_pack_keys`
 *   out    [Hkv, R, keys] f32   scores against keys 0 .. keys - 1
 *
 * Register tile: 6 query rows x 64 keys (24 accumulators); for each pair of dims, four loads of
 * packed keys and six broadcasts of a query pair feed 24 vdpbf16ps. Tasks (head, 6 rows, 256
 * keys) run over OpenMP. Measured (2 threads, 4608 keys, 384-768 rows): 230-250 GFLOP/s,
 * against 90-190 for the float32 bmm. Returns 2 when the CPU has no AVX512-BF16 (the caller keeps PyTorch).
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_BF16_DOT 1
#else
#define HAVE_BF16_DOT 0
#endif

#define ROWS 6
#define KEYS 256 /* keys per task */

int prefill_scores_supported(void) { return HAVE_BF16_DOT; }

/* k [Hkv, S, D] -> packed [Hkv, D / 2, S]: the (2i, 2i + 1) dims of key t as one 32-bit word */
void prefill_pack_keys(const uint16_t *k, int64_t Hkv, int64_t S, int64_t D, uint32_t *packed) {
    #pragma omp parallel for collapse(2) schedule(static)
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t t = 0; t < S; t++) {
            const uint32_t *row = (const uint32_t *)(k + (h * S + t) * D);
            uint32_t *dst = packed + h * (D / 2) * S + t;
            for (int64_t i = 0; i < D / 2; i++) dst[i * S] = row[i];
        }
}

#if HAVE_BF16_DOT
/* rows r0 .. r0 + nr - 1 (nr <= ROWS) against keys t0 .. t1 - 1 of one head */
static void tile(const uint16_t *q, const uint32_t *kp, int64_t S, int64_t D, int64_t r0, int64_t nr, int64_t t0,
                 int64_t t1, int64_t keys, float scale, float *out) {
    const uint32_t *qw[ROWS];
    for (int64_t r = 0; r < ROWS; r++) qw[r] = (const uint32_t *)(q + (r0 + (r < nr ? r : 0)) * D);
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t t = t0; t < t1; t += 64) {
        const int64_t left = t1 - t;
        __mmask16 m[4];
        for (int j = 0; j < 4; j++) {
            const int64_t n = left - 16 * j;
            m[j] = n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
        }
        __m512 acc[ROWS][4];
        for (int r = 0; r < ROWS; r++)
            for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < D / 2; i++) {
            const uint32_t *kr = kp + i * S + t;
            __m512i kv[4];
            for (int j = 0; j < 4; j++) kv[j] = _mm512_maskz_loadu_epi32(m[j], kr + 16 * j);
            for (int r = 0; r < ROWS; r++) {
                const __m512i qb = _mm512_set1_epi32((int)qw[r][i]);
                for (int j = 0; j < 4; j++) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)kv[j], (__m512bh)qb);
            }
        }
        for (int64_t r = 0; r < nr; r++)
            for (int j = 0; j < 4; j++)
                _mm512_mask_storeu_ps(out + (r0 + r) * keys + t + 16 * j, m[j], _mm512_mul_ps(acc[r][j], vs));
    }
}
#endif

/* out[h, r, t] = scale * q[h, r] . k[h, t] for t < keys, from the packed keys of S in all */
int prefill_scores(const uint16_t *q, const uint32_t *packed, int64_t Hkv, int64_t R, int64_t S, int64_t D,
                   int64_t keys, float scale, float *out) {
#if HAVE_BF16_DOT
    if (D % 2 || keys > S) return 2;
    const int64_t row_tiles = (R + ROWS - 1) / ROWS, key_tiles = (keys + KEYS - 1) / KEYS;
    #pragma omp parallel for collapse(3) schedule(dynamic, 4)
    for (int64_t h = 0; h < Hkv; h++)
        for (int64_t rt = 0; rt < row_tiles; rt++)
            for (int64_t kt = 0; kt < key_tiles; kt++) {
                const int64_t r0 = rt * ROWS, nr = R - r0 < ROWS ? R - r0 : ROWS;
                const int64_t t0 = kt * KEYS, t1 = t0 + KEYS < keys ? t0 + KEYS : keys;
                tile(q + h * R * D, packed + h * (D / 2) * S, S, D, r0, nr, t0, t1, keys, scale, out + h * R * keys);
            }
    return 0;
#else
    (void)q; (void)packed; (void)Hkv; (void)R; (void)S; (void)D; (void)keys; (void)scale; (void)out;
    return 2;
#endif
}
