/* The decoder layers of a Llama-style model for a batch of single-token decodes, in one call.
 * nextoken's own kernel; the reference it must match is the model's PyTorch forward
 * (nextoken.models.llama.LlamaDecoderLayer, or gemma3.Gemma3DecoderLayer, with qweight linears),
 * step by step, with the same bf16 roundings at the same points:
 *
 *   for each layer:
 *     x  = norm(h, w_attn)                     RMSNorm: bf16(w * bf16(h * rsqrt(mean(h^2) + eps)))
 *                                              (Gemma: bf16(h * rsqrt(..) * w), the product in float32)
 *     q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv                (qmatmul, one quantization of x)
 *     q, k = norm(q, w_qn), norm(k, w_kn) over each head              (QK-norm: Qwen 3, Gemma 3)
 *     q, k = bf16(bf16(r cos) + bf16(rot(r) sin)), rot(a, b) = (-b, a) RoPE, rotate-half pairs
 *       (a sliding-window layer: its own RoPE base, inv_freq_local)
 *     cache[slot] = k, v ;  a = softmax(q K^T * scale) V              (paged_attention.c)
 *       (an int8 cache stores each head's row as codes and a scale: quantize_row_i8, the
 *       keys and queries rotated first: rotate_f32; a sliding-window layer writes to its ring
 *       and reads its window, keys max(0, positions[i] - window + 1) ..)
 *     h  = bf16(h + a Wo^T)                    Gemma: bf16(h + norm(a Wo^T, w_post_attn))
 *     x  = norm(h, w_ffn) ;  h = bf16(h + bf16(bf16(act(x Wg^T)) * x Wu^T) Wd^T)
 *   with LoRA adapters, each projection's output y of a row gets its adapter's term:
 *     y = bf16(y + bf16(x A^T) (s B)^T)          (nextoken.lora.slots.LoRASlots.add)
 *       (act: SiLU, or Gemma's tanh GELU, activation.c's kernels; Gemma normalises the
 *       feed-forward's output with w_post_ffn before the add)
 *
 *   then, when final_norm is set:  h = norm(h, w_final)              (the model's final norm)
 *
 * h: [T, hidden] bf16, updated in place. Row i is one new token, at positions[i], written to
 * slots[i], attending to its positions[i] + 1 keys through row i of tables (every row's key and
 * value are written before any row attends: consecutive rows of one sequence are a causal prefill).
 * Returns 0, 1 when out of memory, 2 for shapes the kernels do not take.
 */
#include "qmatmul.c"
#include "paged_attention.c"
#include "activation.c"

typedef struct {
    const uint16_t *attn_norm, *ffn_norm; /* bf16 [hidden] */
    qw_t q, k, v, o, gate, up, down;
    void *k_cache, *v_cache;     /* [Hkv, NB, BS, D] bf16, or int8 codes when the scales are set */
    float *k_scale, *v_scale;    /* [Hkv, NB, BS] float32 for an int8 cache, else NULL */
    const uint16_t *q_norm, *k_norm;               /* bf16 [D]: QK-norm over each head, or NULL */
    const uint16_t *post_attn_norm, *post_ffn_norm; /* bf16 [hidden]: Gemma's norms before the adds, or NULL */
    int64_t sliding;             /* 1: a sliding-window layer; its caches are its ring ([Hkv, ring NB, BS, D]) */
} layer_t;

/* What the architectures differ in, beyond the layers' tensors (all zero / NULL: Llama) */
typedef struct {
    int64_t gemma;               /* Gemma's norms (weight product in float32) and tanh-GELU GeGLU */
    const float *inv_freq_local; /* [rope_dim / 2]: the sliding-window layers' RoPE frequencies */
    const int64_t *ring_tables;  /* [T, ring_max_blocks]: logical block b of row i -> its ring block */
    int64_t ring_max_blocks, ring_NB;
    const int64_t *ring_slots;   /* [T]: where row i's key goes in the ring */
    int64_t window;              /* the sliding window: row i reads keys from max(0, positions[i] - window + 1) */
} arch_t;

/* One projection's LoRA adapters in a step: every adapter's A stacked, bf16 [R, K], and its scaled
 * B transposed and stacked the same way, bf16 [R, N] (b2: the same with each pair of ranks
 * interleaved, [R / 2, N, 2], for vdpbf16ps; NULL when R is odd; a2 likewise for A, pairs of
 * columns: NULL when K is odd); NULL a: no adapter of the step targets it */
typedef struct {
    const uint16_t *a, *b, *b2;
    const uint16_t *a2; /* A with each pair of columns interleaved, [K / 2, R, 2], for vdpbf16ps; or NULL */
    int64_t R;          /* the stacks' rows (every adapter's rank) */
} lora_w_t;

/* The step's adapters: w [L * 7] (q, k, v, o, gate, up, down of each layer); row t uses rows
 * row_start[t] .. row_start[t] + row_rank[t] - 1 of the stacks (rank 0: the base model alone) */
typedef struct {
    const lora_w_t *w;
    const int64_t *row_start, *row_rank;
} lora_t;

#if defined(DB_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define LORA_AMX 1
#include "amx.h"

/* The tiles for a group of m rows: 0-3 float32 sums [m, 16]; 4, 5: the shrink's x [m rows, 32
 * columns] and A [16 column pairs, 16 ranks x 2]; 6, 7: the expansion's u [m rows, 16 ranks] and
 * B [8 rank pairs, 16 columns x 2]. Each row's sums are the same whatever m is. (volatile: GCC
 * may drop stores to a local that only ldtilecfg reads.) */
static void lora_amx_config(int64_t m) {
    volatile amx_tilecfg_t c;
    for (size_t i = 0; i < sizeof c; i++) ((volatile uint8_t *)&c)[i] = 0;
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = (uint8_t)m, c.colsb[i] = 64;
    c.rows[5] = 16, c.colsb[6] = 32, c.rows[7] = 8;
    _tile_loadconfig((const void *)&c);
}

/* One group of m <= 16 rows of one adapter (ranks rs .. rs + rk - 1 of the stacks) for projection
 * w: xg [m, K] the rows' inputs, gathered; ug [m, ld] their shrink, bf16(x A^T); y [T, N] the
 * projection's outputs, row perm[r] for the group's row r. The tiles are configured for m rows. */
static void lora_amx_group(const lora_w_t *w, const uint16_t *xg, int64_t m, int64_t K, int64_t N, int64_t rs,
                           int64_t rk, uint16_t *ug, int64_t ld, const int64_t *perm, uint16_t *y) {
    float c0[256], c1[256], acc[4][256];
    for (int64_t c = 0; c < rk; c += 16) { /* the shrink: u = bf16(x A^T), m rows x 16 ranks */
        const uint32_t *a2 = (const uint32_t *)w->a2 + rs + c;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t k = 0; k < K; k += 64) { /* two sums: even and odd blocks of 32 columns */
            _tile_loadd(4, xg + k, K * 2);
            _tile_loadd(5, a2 + (k / 2) * w->R, w->R * 4);
            _tile_dpbf16ps(0, 4, 5);
            if (k + 32 < K) {
                _tile_loadd(4, xg + k + 32, K * 2);
                _tile_loadd(5, a2 + (k / 2 + 16) * w->R, w->R * 4);
                _tile_dpbf16ps(1, 4, 5);
            }
        }
        _tile_stored(0, c0, 64);
        _tile_stored(1, c1, 64);
        for (int64_t r = 0; r < m; r++)
            _mm256_storeu_si256((__m256i *)(ug + r * ld + c), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(
                                    _mm512_loadu_ps(c0 + 16 * r), _mm512_loadu_ps(c1 + 16 * r))));
    }
    for (int64_t n0 = 0; n0 < N; n0 += 64) { /* the expansion: y += u B^T, m rows x 64 columns */
        const int64_t nt = (N - n0) / 16 < 4 ? (N - n0) / 16 : 4;
        _tile_zero(0); /* tile numbers are constants: one call each */
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < rk; c += 16) {
            _tile_loadd(6, ug + c, ld * 2);
            const uint32_t *b2 = (const uint32_t *)w->b2 + ((rs + c) / 2) * N + n0;
            _tile_loadd(7, b2, N * 4);
            _tile_dpbf16ps(0, 6, 7);
            if (nt > 1) { _tile_loadd(7, b2 + 16, N * 4); _tile_dpbf16ps(1, 6, 7); }
            if (nt > 2) { _tile_loadd(7, b2 + 32, N * 4); _tile_dpbf16ps(2, 6, 7); }
            if (nt > 3) { _tile_loadd(7, b2 + 48, N * 4); _tile_dpbf16ps(3, 6, 7); }
        }
        _tile_stored(0, acc[0], 64);
        if (nt > 1) _tile_stored(1, acc[1], 64);
        if (nt > 2) _tile_stored(2, acc[2], 64);
        if (nt > 3) _tile_stored(3, acc[3], 64);
        for (int64_t r = 0; r < m; r++)
            for (int64_t v = 0; v < nt; v++) { /* y = bf16(y + sum), round to nearest even */
                uint16_t *yc = y + perm[r] * N + n0 + 16 * v;
                const __m512 yv = _mm512_castsi512_ps(
                    _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)yc)), 16));
                _mm256_storeu_si256((__m256i *)yc,
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(yv, _mm512_loadu_ps(acc[v] + 16 * r))));
            }
    }
}

/* The rows of lora_add_n whose adapter's rank is a multiple of 16, on AMX: rows sharing an adapter
 * are taken 16 at a time (Punica's SGMV shape), so that one tdpbf16ps multiplies up to 16 rows by
 * 32 columns of A for 16 ranks (the shrink), or by 16 ranks of B for 16 columns (the expansion).
 * Each output is its own row's dot product, summed in float32 in the same order whatever the group
 * holds, so a row's arithmetic does not depend on the other rows. A task is one group's shrink and
 * expansion for one projection (no barrier between them); the threads share the tasks. rank[t]:
 * the rank row t still needs (0: none, or another path's), set to 0 for the rows it takes.
 * Returns 0, or 1 when out of memory. */
static int lora_add_amx(const lora_t *lr, const lora_w_t *w, int n, const uint16_t *x, int64_t T, int64_t K,
                        const int64_t *N, uint16_t *const *y, int64_t *rank) {
    if (K % 32) return 0;
    for (int j = 0; j < n; j++)
        if (w[j].a && (!w[j].a2 || !w[j].b2 || N[j] % 16)) return 0;
    if (!amx_ready()) return 0;
    int64_t *perm = malloc(sizeof(int64_t) * T * 2), *gstart = perm + T, ng = 0, nrow = 0, rmax = 0;
    if (!perm) return 1;
    for (int64_t t = 0; t < T; t++) { /* group the rows by adapter, 16 at most per group */
        const int64_t rk = rank[t], rs = lr->row_start[t];
        if (rk == 0 || rk % 16 || rs % 2) continue;
        const int64_t g0 = nrow;
        perm[nrow++] = t, rank[t] = 0;
        for (int64_t s = t + 1; s < T && nrow - g0 < 16; s++)
            if (rank[s] == rk && lr->row_start[s] == rs) perm[nrow++] = s, rank[s] = 0;
        gstart[ng++] = g0;
        rmax = rk > rmax ? rk : rmax;
    }
    if (ng == 0) { free(perm); return 0; }
    uint16_t *xs = malloc(sizeof(uint16_t) * (size_t)(nrow * K)), *us = malloc(sizeof(uint16_t) * (size_t)(n * nrow * rmax));
    if (!xs || !us) { free(perm); free(xs); free(us); return 1; }
    for (int64_t i = 0; i < nrow; i++) memcpy(xs + i * K, x + perm[i] * K, sizeof(uint16_t) * K); /* grouped */
#pragma omp parallel if (ng * n > 1)
    {
        int64_t tiles_m = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < ng * n; task++) {
            const int64_t g = task / n, first = gstart[g], m = (g + 1 < ng ? gstart[g + 1] : nrow) - first;
            const int j = (int)(task % n);
            if (!w[j].a) continue;
            if (tiles_m != m) lora_amx_config(m), tiles_m = m;
            const int64_t t0 = perm[first];
            lora_amx_group(w + j, xs + first * K, m, K, N[j], lr->row_start[t0], lr->row_rank[t0],
                           us + (j * nrow + first) * rmax, rmax, perm + first, y[j]);
        }
        _tile_release();
    }
    free(perm);
    free(xs);
    free(us);
    return 0;
}
#endif

#define LORA_COLS 128 /* output columns per task of the expansion */

/* y_j[t] = bf16(y_j[t] + bf16(x[t] A_jt^T) B_jt) for the n projections j that take x [T, K] (A_jt,
 * B_jt: row t's adapter's rows of projection j's stacks w[j]; y_j [T, N_j]): the roundings of
 * LoRASlots.add (its mm rounds x A^T to bf16, its addmm rounds the sum once). One parallel region
 * for them all (q, k and v share one, gate and up another): the shrink (16 ranks of a row per
 * vdpbf16ps chain where the CPU has it, else one float32 dot product per rank), then the expansion
 * by blocks of columns, so that even one row uses every thread. A row's arithmetic does not
 * depend on the other rows. Returns 0, or 1 when out of memory. */
static int lora_add_n(const lora_t *lr, const lora_w_t *w, int n, const uint16_t *x, int64_t T, int64_t K,
                      const int64_t *N, uint16_t *const *y) {
    if (!lr) return 0;
    int64_t rmax = 0, any = 0;
    for (int j = 0; j < n; j++) any |= w[j].a != NULL;
    for (int64_t t = 0; t < T; t++) rmax = lr->row_rank[t] > rmax ? lr->row_rank[t] : rmax;
    if (rmax == 0 || !any) return 0;
    int64_t *rank = malloc(sizeof(int64_t) * T); /* each row's rank left to the loops below */
    if (!rank) return 1;
    memcpy(rank, lr->row_rank, sizeof(int64_t) * T);
#ifdef LORA_AMX
    if (lora_add_amx(lr, w, n, x, T, K, N, y, rank)) { free(rank); return 1; }
#endif
    rmax = 0;
    for (int64_t t = 0; t < T; t++) rmax = rank[t] > rmax ? rank[t] : rmax;
    if (rmax == 0) { free(rank); return 0; }
#ifdef DB_DPBF16
    int pairs = K % 2 == 0; /* the shrink on vdpbf16ps: every projection's A interleaved by column pairs */
    for (int j = 0; j < n; j++) pairs &= !w[j].a || w[j].a2 != NULL;
#else
    const int pairs = 0;
#endif
    const int wide = !pairs; /* else float32 dot products, x widened once */
    int64_t blocks[8], nb = 0; /* the expansion's tasks: [projection][row][column block] */
    for (int j = 0; j < n; j++) blocks[j] = w[j].a ? (N[j] + LORA_COLS - 1) / LORA_COLS : 0, nb += blocks[j];
    float *u = malloc(sizeof(float) * n * T * rmax), *xf = wide ? malloc(sizeof(float) * T * K) : NULL;
    if (!u || (wide && !xf)) {
        free(u);
        free(xf);
        free(rank);
        return 1;
    }
#pragma omp parallel
    {
        if (wide) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < T * K; i++) xf[i] = bf16_to_f32(x[i]);
        }
#ifdef DB_DPBF16
        if (pairs) { /* 16 ranks of a row at once: x's column pairs against A's interleaved rows */
            const int64_t chunks = (rmax + 15) / 16;
#pragma omp for schedule(static)
            for (int64_t i = 0; i < n * T * chunks; i++) {
                const int64_t j = i / (T * chunks), t = (i / chunks) % T, c = (i % chunks) * 16;
                const int64_t rk = rank[t];
                if (!w[j].a || c >= rk) continue;
                const int64_t m = rk - c < 16 ? rk - c : 16;
                const __mmask16 mask = (__mmask16)((1u << m) - 1u);
                const uint32_t *a2 = (const uint32_t *)w[j].a2 + lr->row_start[t] + c;
                const uint32_t *xp = (const uint32_t *)(x + t * K);
                const int64_t R = w[j].R, P = K / 2;
#define LORA_DP(acc, p) \
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_maskz_loadu_epi32(mask, a2 + (p) * R), \
                           (__m512bh)_mm512_set1_epi32((int)xp[p]))
                __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0; /* four chains */
                int64_t p = 0;
                for (; p + 4 <= P; p += 4) {
                    LORA_DP(s0, p);
                    LORA_DP(s1, p + 1);
                    LORA_DP(s2, p + 2);
                    LORA_DP(s3, p + 3);
                }
                for (; p < P; p++) LORA_DP(s0, p);
#undef LORA_DP
                float d[16];
                _mm512_storeu_ps(d, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
                for (int64_t l = 0; l < m; l++) u[(j * T + t) * rmax + c + l] = rb(d[l]);
            }
        } else
#endif
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n * T * rmax; i++) {
            const int64_t j = i / (T * rmax), t = (i / rmax) % T, r = i % rmax;
            if (!w[j].a || r >= rank[t]) continue;
            float d;
            db_dots_row(xf + t * K, w[j].a, K, lr->row_start[t] + r, 1, &d);
            u[i] = rb(d);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * nb; i++) {
            const int64_t t = i / nb;
            int64_t blk = i % nb, j = 0;
            while (blk >= blocks[j]) blk -= blocks[j++];
            const int64_t Nj = N[j], n0 = blk * LORA_COLS, n1 = n0 + LORA_COLS < Nj ? n0 + LORA_COLS : Nj;
            const int64_t rk = rank[t], r0 = lr->row_start[t];
            if (rk == 0) continue;
            uint16_t *yt = y[j] + t * Nj;
            const float *ut = u + (j * T + t) * rmax;
#ifdef DB_DPBF16
            if (w[j].b2 && !(r0 & 1) && !(rk & 1) && (n1 - n0) % 16 == 0) { /* pairs of ranks per vdpbf16ps */
                __m512 acc[LORA_COLS / 16];
                const int64_t nv = (n1 - n0) / 16;
                for (int64_t v = 0; v < nv; v++) acc[v] = _mm512_setzero_ps();
                for (int64_t p = 0; p < rk / 2; p++) {
                    const uint32_t pair = (uint32_t)f32_to_bf16(ut[2 * p]) | (uint32_t)f32_to_bf16(ut[2 * p + 1]) << 16;
                    const __m512i up = _mm512_set1_epi32((int)pair);
                    const uint32_t *row = (const uint32_t *)w[j].b2 + (r0 / 2 + p) * Nj + n0;
                    for (int64_t v = 0; v < nv; v++)
                        acc[v] = _mm512_dpbf16_ps(acc[v], (__m512bh)_mm512_loadu_si512((const void *)(row + 16 * v)),
                                                  (__m512bh)up);
                }
                for (int64_t v = 0; v < nv; v++) { /* y = bf16(y + acc): widen, add, round to nearest even */
                    uint16_t *yc = yt + n0 + 16 * v;
                    const __m512 yv = _mm512_castsi512_ps(
                        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)yc)), 16));
                    _mm256_storeu_si256((__m256i *)yc, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(yv, acc[v])));
                }
                continue;
            }
#endif
            float acc[LORA_COLS] = {0};
            for (int64_t r = 0; r < rk; r++) {
                const uint16_t *br = w[j].b + (r0 + r) * Nj;
                const float ur = ut[r];
#pragma omp simd
                for (int64_t c = n0; c < n1; c++) acc[c - n0] += ur * bf16_to_f32(br[c]);
            }
            for (int64_t c = n0; c < n1; c++) yt[c] = f32_to_bf16(bf16_to_f32(yt[c]) + acc[c - n0]);
        }
    }
    free(u);
    free(xf);
    free(rank);
    return 0;
}

/* one projection's lora_add_n */
static int lora_add(const lora_t *lr, const lora_w_t *w, const uint16_t *x, int64_t T, int64_t K, int64_t N,
                    uint16_t *y) {
    return lora_add_n(lr, w, 1, x, T, K, &N, &y);
}

/* one row of D float32 values -> int8 codes and their scale, the same float32 operations as
 * nextoken.kv_cache.tensors.quantize_rows: scale = amax / 127, code = rint(x * (127 / amax)) */
static void quantize_row_f32(const float *x, int64_t D, int8_t *codes, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(x[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < D; i++) {
        const float c = nearbyintf(x[i] * inv);
        codes[i] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
    }
    *scale = amax / 127.f;
}

/* quantize_row_f32 of a row of D bf16 values (D <= 512) */
static void quantize_row_i8(const uint16_t *x, int64_t D, int8_t *codes, float *scale) {
    float f[512];
    for (int64_t i = 0; i < D; i++) f[i] = bf16_to_f32(x[i]);
    quantize_row_f32(f, D, codes, scale);
}

/* `rows` rows of D bf16 values -> codes [rows, D] and scales [rows] (for the test against
 * quantize_rows) */
void kv_quantize_rows(const uint16_t *x, int64_t rows, int64_t D, int8_t *codes, float *scales) {
    for (int64_t r = 0; r < rows; r++) quantize_row_i8(x + r * D, D, codes + r * D, scales + r);
}

/* x [D] float32 rotated in place as an int8 cache's keys are (nextoken.kv_cache.tensors.
 * hadamard_matrix): over each block of b = D & -D values, the fast Walsh-Hadamard transform's
 * butterflies (a, c) -> (a + c, a - c) at strides 1, 2, .., b / 2 (Sylvester's order, the
 * matrix's), then the block times 1 / sqrt(b). Strides 1, 2 and 4 are one unrolled pass over each
 * 8 values, the longer ones contiguous runs the compiler vectorizes: 60 ns a row of 64, 3x faster
 * than the product by the matrix (11x at D = 128). */
static void rotate_f32(float *x, int64_t D) {
    const int64_t b = D & -D;
    const float norm = (float)(1.0 / sqrt((double)b));
    for (float *y = x; y < x + D; y += b) {
        int64_t h = 1;
        if (b >= 8) {
            for (float *p = y; p < y + b; p += 8) {
                const float a0 = p[0] + p[1], a1 = p[0] - p[1], a2 = p[2] + p[3], a3 = p[2] - p[3];
                const float a4 = p[4] + p[5], a5 = p[4] - p[5], a6 = p[6] + p[7], a7 = p[6] - p[7];
                const float c0 = a0 + a2, c1 = a1 + a3, c2 = a0 - a2, c3 = a1 - a3;
                const float c4 = a4 + a6, c5 = a5 + a7, c6 = a4 - a6, c7 = a5 - a7;
                p[0] = c0 + c4, p[1] = c1 + c5, p[2] = c2 + c6, p[3] = c3 + c7;
                p[4] = c0 - c4, p[5] = c1 - c5, p[6] = c2 - c6, p[7] = c3 - c7;
            }
            h = 8;
        }
        for (; h < b; h *= 2)
            for (int64_t i = 0; i < b; i += 2 * h) {
                float *restrict lo = y + i, *restrict hi = y + i + h;
                for (int64_t j = 0; j < h; j++) {
                    const float a = lo[j], c = hi[j];
                    lo[j] = a + c;
                    hi[j] = a - c;
                }
            }
        for (int64_t i = 0; i < b; i++) y[i] *= norm;
    }
}

/* `rows` rows of D float32 values rotated in place by rotate_f32 (for the test against
 * hadamard_rows) */
void kv_rotate_rows(float *x, int64_t rows, int64_t D) {
    for (int64_t r = 0; r < rows; r++) rotate_f32(x + r * D, D);
}

/* each of `heads` bf16 query rows of D values (D <= 512) rotated as the keys (rotate_f32), then
 * rounded to bf16: nextoken.kv_cache.tensors.PagedKVCache.queries */
static void rotate_queries(uint16_t *q, int64_t heads, int64_t D) {
    float f[512];
    for (int64_t hh = 0; hh < heads; hh++) {
        uint16_t *r = q + hh * D;
        for (int64_t i = 0; i < D; i++) f[i] = bf16_to_f32(r[i]);
        rotate_f32(f, D);
        for (int64_t i = 0; i < D; i++) r[i] = f32_to_bf16(f[i]);
    }
}

/* token t's key and value rows of every KV head into the cache at `slot` (an int8 cache: each key
 * row rotated in float32, then both quantized) */
static void write_kv(const layer_t *ly, const uint16_t *k, const uint16_t *v, int64_t slot, int64_t Hkv, int64_t D,
                     int64_t NB, int64_t BS) {
    const int64_t blk = slot / BS, off = slot % BS;
    for (int64_t hh = 0; hh < Hkv; hh++) {
        const int64_t row = (hh * NB + blk) * BS + off;
        if (ly->k_scale) {
            float f[512];
            for (int64_t i = 0; i < D; i++) f[i] = bf16_to_f32(k[hh * D + i]);
            rotate_f32(f, D);
            quantize_row_f32(f, D, (int8_t *)ly->k_cache + row * D, ly->k_scale + row);
            quantize_row_i8(v + hh * D, D, (int8_t *)ly->v_cache + row * D, ly->v_scale + row);
        } else {
            memcpy((uint16_t *)ly->k_cache + row * D, k + hh * D, sizeof(uint16_t) * D);
            memcpy((uint16_t *)ly->v_cache + row * D, v + hh * D, sizeof(uint16_t) * D);
        }
    }
}

/* y_i = x W_i^T for the n weights (n <= 8) that take x [T, K] bf16 (q, k and v; gate and up; or
 * one): dense bf16 ones in one pass over all their rows (dense_bf16_multi); block-quantized ones
 * with x quantized once per activation block size (32, or 256 for the super-block formats:
 * qw_act_block) and that quantization shared, qa[0] for 32 columns and qa[1] for 256 (NULL q: not
 * yet quantized), then all their tiles in one parallel loop (qmatmul_q_n); a mix, one by one.
 * 0, or 1 when out of memory. */
static int apply_n(const uint16_t *x, int64_t T, const qw_t *const *ws, int n, qact_t qa[2], uint16_t *const *ys) {
    int dense = 1, codes = 1;
    for (int i = 0; i < n; i++) dense &= ws[i]->bits == 16, codes &= ws[i]->bits != 16;
    if (dense) return dense_bf16_multi(x, 1, T, ws, n, (void *const *)ys, 1, NULL);
    if (!codes) {
        for (int i = 0; i < n; i++)
            if (apply_n(x, T, ws + i, 1, qa, ys + i)) return 1;
        return 0;
    }
    const qact_t *as[8];
    int64_t ldy[8];
    for (int i = 0; i < n; i++) {
        qact_t *a = &qa[qw_act_block(ws[i]) != 32];
        if (!a->q && quantize(x, 1, T, ws[i]->K, qw_act_block(ws[i]), a)) return 1;
        as[i] = a, ldy[i] = ws[i]->N;
    }
    qmatmul_q_n(as, ws, n, (void *const *)ys, 1, ldy);
    return 0;
}

/* apply_n of one weight */
static int apply(const uint16_t *x, int64_t T, const qw_t *w, qact_t qa[2], uint16_t *y) {
    return apply_n(x, T, &w, 1, qa, &y);
}

static void qacts_free(qact_t qa[2]) {
    for (int i = 0; i < 2; i++)
        if (qa[i].q) {
            qact_free(&qa[i]);
            qa[i].q = NULL;
        }
}

/* rotate the first rope_dim dims of each of `heads` heads of one token, in bf16 steps */
static void rope_bf16(uint16_t *x, int64_t heads, int64_t D, int64_t rope_dim, const float *cs, const float *sn) {
    const int64_t half = rope_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        uint16_t *r = x + h * D;
        float tmp[512];
        for (int64_t i = 0; i < rope_dim; i++) tmp[i] = bf16_to_f32(r[i]);
        for (int64_t i = 0; i < rope_dim; i++) {
            const float rot = i < half ? -tmp[i + half] : tmp[i - half];
            r[i] = f32_to_bf16(rb(tmp[i] * cs[i]) + rb(rot * sn[i]));
        }
    }
}

/* cos and sin of every row's position (f32, then bf16, as the PyTorch path): [T, rope_dim] each */
static void rope_tables(const float *inv_freq, const int64_t *positions, int64_t T, int64_t rope_dim, float *cs,
                        float *sn) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < rope_dim; i++) {
            const float ang = (float)positions[t] * inv_freq[i % (rope_dim / 2)];
            cs[t * rope_dim + i] = rb(cosf(ang));
            sn[t * rope_dim + i] = rb(sinf(ang));
        }
}

static void norm_rows(const arch_t *ar, const uint16_t *x, const uint16_t *w, int64_t T, int64_t n, float eps,
                      uint16_t *out) {
    if (ar->gemma)
        rms_norm_rows_gemma(x, w, T, n, eps, out);
    else
        rms_norm_rows_bf16(x, w, T, n, eps, out);
}

/* h = bf16(h + o), o first normalised with w when w is set (Gemma's post-norms) */
static void residual_add(const arch_t *ar, uint16_t *h, uint16_t *o, const uint16_t *w, int64_t T, int64_t n,
                         float eps) {
    if (w) norm_rows(ar, o, w, T, n, eps, o);
    for (int64_t i = 0; i < T * n; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(o[i]));
}

typedef struct { /* one call's shapes and buffers, shared by its layers */
    int64_t T, hidden, H, Hkv, D, rope_dim, inter, max_blocks, NB, BS;
    float eps, scale;
    const int64_t *slots, *tables, *seq_lens, *starts; /* starts: each row's window's first key (sliding layers) */
    const float *cs[2], *sn[2]; /* [T, rope_dim]: full-attention layers [0], sliding-window layers [1] */
    uint16_t *x, *q, *k, *v, *att, *g, *u, *o;
    const lora_t *lora; /* the step's adapters, or NULL */
} step_t;

/* the attention half of one layer: h += attention(norm(h)) */
static int attention_half(const layer_t *ly, const arch_t *ar, const step_t *s, const lora_w_t *lw, uint16_t *h) {
    const int64_t T = s->T, qd = s->H * s->D, kd = s->Hkv * s->D, sl = ly->sliding != 0;
    qact_t qa[2] = {{0}, {0}};
    norm_rows(ar, h, ly->attn_norm, T, s->hidden, s->eps, s->x);
    const qw_t *qkv[3] = {&ly->q, &ly->k, &ly->v};
    uint16_t *qkv_out[3] = {s->q, s->k, s->v};
    int rc = apply_n(s->x, T, qkv, 3, qa, qkv_out);
    qacts_free(qa);
    if (rc) return rc;
    const int64_t qkv_n[3] = {qd, kd, kd};
    if (lw && lora_add_n(s->lora, lw, 3, s->x, T, s->hidden, qkv_n, qkv_out)) return 1;
    if (ly->q_norm) {
        norm_rows(ar, s->q, ly->q_norm, T * s->H, s->D, s->eps, s->q);
        norm_rows(ar, s->k, ly->k_norm, T * s->Hkv, s->D, s->eps, s->k);
    }
    const int64_t NB = sl ? ar->ring_NB : s->NB;
    for (int64_t t = 0; t < T; t++) {
        const float *cs = s->cs[sl] + t * s->rope_dim, *sn = s->sn[sl] + t * s->rope_dim;
        rope_bf16(s->q + t * qd, s->H, s->D, s->rope_dim, cs, sn);
        rope_bf16(s->k + t * kd, s->Hkv, s->D, s->rope_dim, cs, sn);
        if (ly->k_scale) rotate_queries(s->q + t * qd, s->H, s->D); /* as the keys are stored */
        write_kv(ly, s->k + t * kd, s->v + t * kd, sl ? ar->ring_slots[t] : s->slots[t], s->Hkv, s->D, NB, s->BS);
    }
    const int64_t *tables = sl ? ar->ring_tables : s->tables, max_blocks = sl ? ar->ring_max_blocks : s->max_blocks;
    const kv_t kv = {ly->k_cache, ly->v_cache, ly->k_scale, ly->v_scale};
    if (paged_decode(ly->k_scale ? chunk_i8 : chunk_bf16, s->q, &kv, tables, max_blocks, s->seq_lens,
                     sl ? s->starts : NULL, T, s->H, s->Hkv, s->D, NB, s->BS, s->scale, s->att, 1))
        return 1;
    rc = apply(s->att, T, &ly->o, qa, s->o);
    qacts_free(qa);
    if (rc) return rc;
    if (lw && lora_add(s->lora, lw + 3, s->att, T, qd, s->hidden, s->o)) return 1;
    residual_add(ar, h, s->o, ly->post_attn_norm, T, s->hidden, s->eps);
    return 0;
}

/* the feed-forward half: h += down(act(gate(x)) * up(x)), x = norm(h) */
static int ffn_half(const layer_t *ly, const arch_t *ar, const step_t *s, const lora_w_t *lw, uint16_t *h) {
    const int64_t T = s->T;
    qact_t qa[2] = {{0}, {0}};
    norm_rows(ar, h, ly->ffn_norm, T, s->hidden, s->eps, s->x);
    const qw_t *gu[2] = {&ly->gate, &ly->up};
    uint16_t *gu_out[2] = {s->g, s->u};
    int rc = apply_n(s->x, T, gu, 2, qa, gu_out);
    qacts_free(qa);
    if (rc) return rc;
    const int64_t gu_n[2] = {s->inter, s->inter};
    if (lw && lora_add_n(s->lora, lw + 4, 2, s->x, T, s->hidden, gu_n, gu_out)) return 1;
    if (ar->gemma)
        gelu_tanh_mul_bf16(s->g, s->u, s->g, T * s->inter);
    else
        silu_mul_bf16(s->g, s->u, s->g, T * s->inter); /* a scalar expf loop took 46 us of Qwen-1.5B's layer */
    rc = apply(s->g, T, &ly->down, qa, s->o);
    qacts_free(qa);
    if (rc) return rc;
    if (lw && lora_add(s->lora, lw + 6, s->g, T, s->inter, s->hidden, s->o)) return 1;
    residual_add(ar, h, s->o, ly->post_ffn_norm, T, s->hidden, s->eps);
    return 0;
}

/* 1 when the step's LoRA runs on AMX tiles (built with AMX-BF16 and the kernel granted the tiles),
 * else 0: the vdpbf16ps or float32 loops */
int decode_lora_amx(void) {
#ifdef LORA_AMX
    return amx_ready();
#else
    return 0;
#endif
}

/* decode_layers' rows and shapes (`kernels.structs.DecodeCall`) */
typedef struct {
    uint16_t *h;                                  /* [T, hidden] bf16: the rows' hidden states, updated in place */
    int64_t T, hidden, H, Hkv, D, rope_dim;
    const float *inv_freq;                        /* [rope_dim / 2] */
    const int64_t *positions, *slots;             /* [T] */
    const int64_t *tables;                        /* [T, max_blocks] */
    int64_t max_blocks, NB, BS;                   /* the cache's blocks and their size */
    float eps, scale;                             /* the norms' epsilon, the attention's scale */
    const uint16_t *final_norm;                   /* bf16 [hidden]: the model's final norm, applied to the
                                                     rows after the last layer; NULL: none */
} decode_call_t;

int decode_layers(const layer_t *layers, int64_t L, const decode_call_t *c, const arch_t *arch, const lora_t *lora) {
    uint16_t *h = c->h;
    const int64_t T = c->T, hidden = c->hidden, H = c->H, Hkv = c->Hkv, D = c->D, rope_dim = c->rope_dim;
    const int64_t max_blocks = c->max_blocks, NB = c->NB, BS = c->BS;
    const float *inv_freq = c->inv_freq, eps = c->eps, scale = c->scale;
    const int64_t *positions = c->positions, *slots = c->slots, *tables = c->tables;
    static const arch_t LLAMA = {0};
    const arch_t *ar = arch ? arch : &LLAMA;
    if (rope_dim > 512 || rope_dim > D || D > 256 || H % Hkv != 0 || H / Hkv > 64) return 2;
    for (int64_t l = 0; l < L; l++) {
        const layer_t *ly = layers + l;
        const qw_t *ws[7] = {&ly->q, &ly->k, &ly->v, &ly->o, &ly->gate, &ly->up, &ly->down};
        for (int i = 0; i < 7; i++)
            if (!qw_ok(ws[i])) return 2;
        if (ly->sliding && (!ar->ring_tables || !ar->ring_slots || ar->window < 1 || ly->k_scale)) return 2;
        if ((ly->q_norm == NULL) != (ly->k_norm == NULL)) return 2;
    }
    const int64_t inter = layers[0].gate.N, qd = H * D, kd = Hkv * D;
    uint16_t *buf = malloc(sizeof(uint16_t) * T * (hidden + qd + 2 * kd + qd + 2 * inter + hidden));
    float *cs = malloc(sizeof(float) * T * rope_dim * 4);
    int64_t *seq_lens = malloc(sizeof(int64_t) * T * 2), *starts = seq_lens + T;
    if (!buf || !cs || !seq_lens) { free(buf); free(cs); free(seq_lens); return 1; }
    for (int64_t t = 0; t < T; t++) {
        seq_lens[t] = positions[t] + 1; /* keys up to and including its own */
        starts[t] = ar->window > 0 && positions[t] >= ar->window ? positions[t] - ar->window + 1 : 0;
    }
    step_t s = {T, hidden, H, Hkv, D, rope_dim, inter, max_blocks, NB, BS, eps, scale, slots, tables, seq_lens, starts,
                {cs, cs + 2 * T * rope_dim}, {cs + T * rope_dim, cs + 3 * T * rope_dim}};
    s.x = buf, s.q = s.x + T * hidden, s.k = s.q + T * qd, s.v = s.k + T * kd, s.att = s.v + T * kd;
    s.g = s.att + T * qd, s.u = s.g + T * inter, s.o = s.u + T * inter;
    s.lora = lora;
    rope_tables(inv_freq, positions, T, rope_dim, cs, cs + T * rope_dim);
    rope_tables(ar->inv_freq_local ? ar->inv_freq_local : inv_freq, positions, T, rope_dim, cs + 2 * T * rope_dim,
                cs + 3 * T * rope_dim);
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const lora_w_t *lw = lora ? lora->w + l * 7 : NULL;
        rc = attention_half(layers + l, ar, &s, lw, h);
        if (rc == 0) rc = ffn_half(layers + l, ar, &s, lw, h);
    }
    if (rc == 0 && c->final_norm) norm_rows(ar, h, c->final_norm, T, hidden, eps, h);
    free(buf);
    free(cs);
    free(seq_lens);
    return rc;
}
