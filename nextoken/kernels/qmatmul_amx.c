/* The AVX-512 VNNI loops' sums on AMX tiles, for calls of 32 activation rows or more (prefill,
 * large decode batches). Included by qmatmul.c in a build for a CPU with AMX-INT8 (Sapphire
 * Rapids and later), under Linux, which grants the tile data per process (amx.h).
 *
 * The tile layout of the codes (the top of qmatmul.c) is already the B operand of tdpbsud: the
 * 64-byte vector j of a group holds, in 32-bit lane l, row l's codes for columns 4j..4j+3, so a
 * group of G columns of one weight tile (16 rows) is a B tile of G / 4 rows of 64 bytes. 8-bit
 * codes are read where they lie; 4, 5 and 6-bit codes are unpacked once per weight tile and
 * call (code_pair: the VNNI loop's own unpacking) into a per-thread buffer of K * 16 bytes (no
 * second copy of the model). The A operand is 16 quantized activation rows, G columns each,
 * read in place (row stride K). One tdpbsud (A signed, B unsigned) gives the 16 x 16 group sums
 *   C[i][l] = sum_{k in group} xq[m0 + i, k] u[16t + l, k],
 * exactly the integers the VNNI loop holds in s[i] (group_sums), so the float arithmetic after
 * them is the VNNI loop's, operation for operation (tiles_mb's per group, tiles_sb's per
 * super-block and its mins pass first): an output equals the VNNI loop's bit for bit, whatever
 * rows it is computed with. Two C tiles alternate, so one group's sums are stored and scaled while
 * the next group multiplies. Rows beyond the last 16 go through the VNNI loop.
 * Peak (one core): a tdpbsud of 16 x 16 x 64 every 16 cycles, 1024 int8 products per cycle, 16x
 * the VNNI loop's 64; the scaling of each group's sums (4 vector operations per 16 x 16 x G
 * products, the integer ones for the K-quants) bounds these loops well before that.
 */
#include "amx.h"

#define AMX_MIN_ROWS 32 /* rows from which a call runs here: at 16, the VNNI loop was faster for all but Q6_K */

static int amx_enabled = 1; /* qmatmul_amx(0) turns these loops off (tests, benchmarks) */

/* tiles 0-3: C, 16 rows x 16 int32 (0, 1 for the even pairs of groups, 2, 3 for the odd; the
 * super-block formats: low and high bytes' sums of even super-blocks, then odd); 4, 5: A, 16
 * activation rows x G bytes; 6, 7: B, G / 4 rows of 64 bytes (4 columns of 16 weight rows).
 * G = 64 for the super-block formats: full tiles. */
static void amx_config(int64_t G) {
    volatile amx_tilecfg_t c;
    for (size_t i = 0; i < sizeof c; i++) ((volatile uint8_t *)&c)[i] = 0;
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.rows[i] = 16, c.colsb[i] = 64;
    c.colsb[4] = c.colsb[5] = (uint16_t)G;
    c.rows[6] = c.rows[7] = (uint8_t)(G / 4);
    _tile_loadconfig((const void *)&c);
}

/* Tile t's codes as B tiles, group after group (G * 16 bytes each), into ub: code_pair's vectors
 * at their columns' rows. */
static inline __attribute__((always_inline)) void amx_unpack(const qw_t *w, int64_t t, const int64_t bits, uint8_t *ub) {
    const int64_t G = GROUP_OF(bits), ng = w->K / G, gbytes = TILE * G * LAYOUT_BITS(bits) / 8;
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *cg = w->codes + (t * ng + g) * gbytes;
        uint8_t *o = ub + g * G * TILE;
        for (int p = 0; p < G / 8; p++) {
            __m512i v0, v1;
            int c0, c1;
            code_pair(cg, bits, p, w->lut, &v0, &v1, &c0, &c1);
            _mm512_storeu_si512((void *)(o + 16 * c0), v0);
            _mm512_storeu_si512((void *)(o + 16 * c1), v1);
        }
    }
}

/* The activations' per-row scalars the scaling broadcasts, transposed per block of 16 rows, so
 * that a group's 16 values lie together (one base, constant offsets; read row by row, their 16
 * addresses took 16 registers, spilled): dx [M16 / 16, K / QB, 16] the scales, xs [M16 / 16,
 * K / G, 16] dx times each group's sum of codes (the legacy formats; empty for the others), bs
 * (the super-block formats' mins' pass) below. */
typedef struct {
    float *dx, *xs;
    int32_t *bs; /* the super-block formats: [M16 / 16, K / G / 2, 16], groups 2j and 2j + 1's int16 sums of xq */
} amx_rows_t;

/* 0, or 1 when out of memory */
static int amx_rows(const qact_t *a, const qw_t *w, int64_t m16, amx_rows_t *tr) {
    const int64_t K = a->K, nd = K / a->QB, G = w->group, ng = K / G, nx = a->QB == 32 ? ng : 0;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    const int64_t np = a->QB == 32 ? 0 : ng / 2;
    const int16_t *bs = G == 16 ? a->bs16 : a->bs32;
    if (posix_memalign((void **)&tr->dx, 64, sizeof(float) * (size_t)(m16 * (nd + nx + np)) + 64)) return 1;
    tr->xs = tr->dx + m16 * nd;
    tr->bs = (int32_t *)(tr->xs + m16 * nx);
    for (int64_t m = 0; m < m16; m++) {
        const int64_t b = m / 16, i = m % 16;
        for (int64_t j = 0; j < nd; j++) tr->dx[(b * nd + j) * 16 + i] = a->dx[m * nd + j];
        for (int64_t g = 0; g < nx; g++) tr->xs[(b * nx + g) * 16 + i] = xs[m * ng + g];
        for (int64_t j = 0; j < np; j++) memcpy(tr->bs + (b * np + j) * 16 + i, bs + m * ng + 2 * j, 4);
    }
    return 0;
}

/* Groups 2p and 2p + 1 (when there is one) of activation rows xq.. against the B tiles at bsrc,
 * into C tiles CA and CB (constants), stored to buf [2][256]. Each pair's sums are stored one pair
 * ahead of the scaling that reads them (AMX_NEXT_PAIR), so the vector loads of a tile's store do
 * not wait right behind it (measured: within the noise of storing and scaling in turn). */
#define AMX_PAIR(CA, CB, p, buf)                                                      \
    do {                                                                              \
        const int64_t g_ = 2 * (p);                                                   \
        _tile_zero(CA);                                                               \
        _tile_loadd(4, xq + g_ * G, K);                                               \
        _tile_loadd(6, bsrc + g_ * bstep, 64);                                        \
        _tile_dpbsud(CA, 4, 6);                                                       \
        if (g_ + 1 < ng) {                                                            \
            _tile_zero(CB);                                                           \
            _tile_loadd(5, xq + (g_ + 1) * G, K);                                     \
            _tile_loadd(7, bsrc + (g_ + 1) * bstep, 64);                              \
            _tile_dpbsud(CB, 5, 7);                                                   \
        }                                                                             \
        _tile_stored(CA, buf, 64);                                                    \
        if (g_ + 1 < ng) _tile_stored(CB, (buf) + 256, 64);                           \
    } while (0)

/* Pair p + 1's sums (into the buffer half p + 1 picks), before pair p's scaling */
#define AMX_NEXT_PAIR(p)                                                              \
    do {                                                                              \
        if ((p) + 1 < np) {                                                           \
            if (((p) + 1) & 1) AMX_PAIR(2, 3, (p) + 1, cbuf + 512);                   \
            else AMX_PAIR(0, 1, (p) + 1, cbuf);                                       \
        }                                                                             \
    } while (0)

/* The legacy formats (tiles_mb's arithmetic): 16 rows from m0 against tile t, acc[i] the 16 outputs
 * of row m0 + i. bsrc: the B tiles (ub, or the 8-bit codes in place), bstep bytes apart; cbuf
 * [4][256] int32. */
static inline __attribute__((always_inline)) void amx_tile_mb(const qw_t *w, int64_t t, const int64_t bits,
                                                              const qact_t *a, const amx_rows_t *tr, int64_t m0,
                                                              const uint8_t *bsrc, int32_t *cbuf, __m512 *acc) {
    const int64_t K = w->K, G = GROUP_OF(bits), ng = K / G, bstep = (int64_t)G * TILE, np = (ng + 1) / 2;
    const int8_t *xq = a->q + m0 * K;
    const float *dxb = tr->dx + (m0 / 16) * (K / 32) * 16, *xsb = tr->xs + (m0 / 16) * ng * 16;
    const __m512 negoff = _mm512_set1_ps(-(float)w->offset);
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    AMX_PAIR(0, 1, 0, cbuf);
    for (int64_t p = 0; p < np; p++) {
        AMX_NEXT_PAIR(p);
        for (int64_t h = 2 * p; h < 2 * p + 2 && h < ng; h++) {
            const int32_t *c = cbuf + 512 * (p & 1) + 256 * (h & 1);
            const __m512 sc = vgroup(w->scales, w->scale_sup, w->gps, t, ng, h);
            const __m512 mn = w->mins ? vgroup(w->mins, w->min_sup, w->gps, t, ng, h) : _mm512_mul_ps(sc, negoff);
            const float *dxg = dxb + (h * G / 32) * 16, *xsg = xsb + h * 16;
            #pragma GCC unroll 16
            for (int i = 0; i < 16; i++) {
                const __m512 dx = _mm512_set1_ps(dxg[i]);
                const __m512 xsum = _mm512_set1_ps(xsg[i]);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * i))),
                                         _mm512_mul_ps(sc, dx), acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, xsum, acc[i]);
            }
        }
    }
}

/* The super-block formats (tiles_sb's arithmetic, nt = 1). Their int8 group scales go into the
 * weights: at unpacking, each code times its group's scale, v = u sc (|v| < 2^14: Q4_K 15 * 63,
 * Q6_K 63 * 128, IQ4_XS's looked-up codes 241 * 32, the other lut formats' less), is split into a low byte (unsigned) and a
 * high one (signed, v >> 8), two B tiles, so that one pass of tdpbsud (low) and tdpbssd (high)
 * over a super-block's 256 columns, four 64-column steps with no scaling between them, gives
 *   lo + 256 hi = sum_k xq_k u_k sc_g(k) = sum_g sc_g s_g,
 * the integer tiles_sb adds group by group (|.| < 2^31). Then tiles_sb's float operations: its
 * mins' pass, then each super-block's sum times scale_sup dx. */
static inline __attribute__((always_inline)) void amx_unpack_sb(const qw_t *w, int64_t t, const int64_t bits,
                                                                uint8_t *lo, uint8_t *hi) {
    const int64_t G = GROUP_OF(bits), ng = w->K / G, gbytes = TILE * G * LAYOUT_BITS(bits) / 8;
    /* int16 lane j of half h of a code vector is byte 32h + j: row (32h + j) / 4 */
    const __m512i rows0 = _mm512_set_epi16(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4,
                                           3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i rows1 = _mm512_add_epi16(rows0, _mm512_set1_epi16(8));
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *cg = w->codes + (t * ng + g) * gbytes;
        const __m512i sc = _mm512_castsi256_si512(
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((const int8_t *)w->scales + (t * ng + g) * TILE))));
        const __m512i sc0 = _mm512_permutexvar_epi16(rows0, sc), sc1 = _mm512_permutexvar_epi16(rows1, sc);
        for (int p = 0; p < G / 8; p++) {
            __m512i v[2];
            int c[2];
            code_pair(cg, bits, p, w->lut, &v[0], &v[1], &c[0], &c[1]);
            for (int j = 0; j < 2; j++) {
                const int64_t at = g * G * TILE + 16 * c[j];
                const __m512i p0 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(v[j])), sc0);
                const __m512i p1 = _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v[j], 1)), sc1);
                _mm256_storeu_si256((__m256i *)(lo + at), _mm512_cvtepi16_epi8(p0));
                _mm256_storeu_si256((__m256i *)(lo + at + 32), _mm512_cvtepi16_epi8(p1));
                _mm256_storeu_si256((__m256i *)(hi + at), _mm512_cvtepi16_epi8(_mm512_srai_epi16(p0, 8)));
                _mm256_storeu_si256((__m256i *)(hi + at + 32), _mm512_cvtepi16_epi8(_mm512_srai_epi16(p1, 8)));
            }
        }
    }
}

/* Super-block sb's sums into C tiles CL (low bytes) and CH (high), stored to buf [2][256] */
#define AMX_SUPER(CL, CH, sb, buf)                                                    \
    do {                                                                              \
        _tile_zero(CL);                                                               \
        _tile_zero(CH);                                                               \
        for (int64_t k_ = (sb) * QB; k_ < ((sb) + 1) * QB; k_ += 64) {                \
            _tile_loadd(4, xq + k_, K);                                               \
            _tile_loadd(6, lo + k_ * TILE, 64);                                       \
            _tile_loadd(7, hi + k_ * TILE, 64);                                       \
            _tile_dpbsud(CL, 4, 6);                                                   \
            _tile_dpbssd(CH, 4, 7);                                                   \
        }                                                                             \
        _tile_stored(CL, buf, 64);                                                    \
        _tile_stored(CH, (buf) + 256, 64);                                            \
    } while (0)

static inline __attribute__((always_inline)) void amx_tile_sb(const qw_t *w, int64_t t, const int64_t bits,
                                                              const qact_t *a, const amx_rows_t *tr, int64_t m0,
                                                              const uint8_t *lo, const uint8_t *hi, int32_t *cbuf,
                                                              __m512 *acc) {
    const int64_t K = w->K, G = GROUP_OF(bits), ng = K / G, gps = w->gps, nsb = ng / gps, QB = G * gps;
    const int8_t *xq = a->q + m0 * K;
    const int8_t *mins = w->mins ? (const int8_t *)w->mins : (const int8_t *)w->scales;
    const float *dxb = tr->dx + (m0 / 16) * nsb * 16;
    const int32_t *bsb = tr->bs + (m0 / 16) * (ng / 2) * 16;
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                           23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    AMX_SUPER(0, 1, 0, cbuf); /* the tiles work while the mins' pass runs */
    #pragma GCC unroll 16
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t sb = 0; sb < nsb; sb++) { /* the mins' term, as tiles_sb: two groups per vpdpwssd */
        const int64_t at = (t * nsb + sb) * TILE;
        const __m512 msup = w->mins ? _mm512_loadu_ps(w->min_sup + at)
                                    : _mm512_mul_ps(_mm512_loadu_ps(w->scale_sup + at), _mm512_set1_ps(-(float)w->offset));
        __m512i im[16];
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++) im[i] = _mm512_setzero_si512();
        for (int64_t g = sb * gps; g < (sb + 1) * gps; g += 2) {
            const __m512i mv = _mm512_permutexvar_epi16(pairs, _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(mins + (t * ng + g) * TILE))));
            const int32_t *bp = bsb + (g / 2) * 16;
            #pragma GCC unroll 16
            for (int i = 0; i < 16; i++) im[i] = _mm512_dpwssd_epi32(im[i], mv, _mm512_set1_epi32(bp[i]));
        }
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m512 f = _mm512_mul_ps(msup, _mm512_set1_ps(dxb[sb * 16 + i]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(im[i]), f, acc[i]);
        }
    }
    for (int64_t sb = 0; sb < nsb; sb++) { /* the scales' term, super-block sb + 1 multiplying meanwhile */
        if (sb + 1 < nsb) {
            if ((sb + 1) & 1) AMX_SUPER(2, 3, sb + 1, cbuf + 512);
            else AMX_SUPER(0, 1, sb + 1, cbuf);
        }
        const int32_t *c = cbuf + 512 * (sb & 1);
        const __m512 ssup = _mm512_loadu_ps(w->scale_sup + (t * nsb + sb) * TILE);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const __m512i isb = _mm512_add_epi32(_mm512_load_si512((const void *)(c + 16 * i)),
                                                 _mm512_slli_epi32(_mm512_load_si512((const void *)(c + 256 + 16 * i)), 8));
            const __m512 f = _mm512_mul_ps(ssup, _mm512_set1_ps(dxb[sb * 16 + i]));
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isb), f, acc[i]);
        }
    }
}

/* Tile t against every full block of 16 rows: unpack once, then each block's sums and output */
static inline __attribute__((always_inline)) void amx_tile_rows(const qw_t *w, int64_t t, const int64_t bits,
                                                                const int sup, const qact_t *a, const amx_rows_t *tr, int64_t m16,
                                                                uint8_t *ub, int32_t *cbuf, void *y, int y_bf16,
                                                                int64_t ldy) {
    const int64_t G = GROUP_OF(bits), ng = w->K / G, n0 = t * TILE;
    const uint8_t *bsrc = ub;
    if (sup) amx_unpack_sb(w, t, bits, ub, ub + w->K * TILE); /* low bytes, then high ones */
    else if (bits == 8) bsrc = w->codes + t * ng * (TILE * G); /* already B tiles */
    else amx_unpack(w, t, bits, ub);
    const __m512 bv = w->bias ? _mm512_loadu_ps(w->bias + n0) : _mm512_setzero_ps();
    for (int64_t m0 = 0; m0 < m16; m0 += 16) {
        __m512 acc[16];
        if (sup) amx_tile_sb(w, t, bits, a, tr, m0, ub, ub + w->K * TILE, cbuf, acc);
        else amx_tile_mb(w, t, bits, a, tr, m0, bsrc, cbuf, acc);
        #pragma GCC unroll 16
        for (int i = 0; i < 16; i++) store16(y, y_bf16, (m0 + i) * ldy + n0, _mm512_add_ps(acc[i], bv));
    }
}

#define AMX_BITS(SUP)                                                                                  \
    switch (LOOP_BITS(w)) {                                                                            \
    case BITS_LUT: amx_tile_rows(w, t, BITS_LUT, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break;        \
    case BITS_LUT16: if (SUP) amx_tile_rows(w, t, BITS_LUT16, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break; \
    case BITS_4G16: if (SUP) amx_tile_rows(w, t, BITS_4G16, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break; \
    case 4: amx_tile_rows(w, t, 4, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break;                      \
    case 5: amx_tile_rows(w, t, 5, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break;                      \
    case 6: amx_tile_rows(w, t, 6, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break;                      \
    default: amx_tile_rows(w, t, 8, SUP, a, tr, m16, ub, cbuf, y, y_bf16, ldy); break;                     \
    }

static __attribute__((noinline)) void amx_tile_sb_any(const qw_t *w, int64_t t, const qact_t *a, const amx_rows_t *tr, int64_t m16, uint8_t *ub,
                                                      int32_t *cbuf, void *y, int y_bf16, int64_t ldy) {
    AMX_BITS(1)
}

static __attribute__((noinline)) void amx_tile_mb_any(const qw_t *w, int64_t t, const qact_t *a, const amx_rows_t *tr, int64_t m16, uint8_t *ub,
                                                      int32_t *cbuf, void *y, int y_bf16, int64_t ldy) {
    AMX_BITS(0)
}

/* Whether qmatmul_q runs a call of M rows against w here */
static int amx_takes(const qact_t *a, const qw_t *w) {
    return amx_enabled && a->M >= AMX_MIN_ROWS && w->bits != 16 && w->bits <= 6 + 2 * (qw_act_block(w) == 32) &&
           (qw_act_block(w) == 32 || (qw_act_block(w) % 64 == 0 && w->gps % 2 == 0)) && amx_ready();
}

/* y = x W^T + bias for the rows of a, the full blocks of 16 on AMX, the rest on the VNNI loop;
 * the weight tiles split over the threads, each with its own unpacking buffer and tile state.
 * Returns 1 when a buffer cannot be allocated (nothing is written then), else 0. */
static int qmatmul_amx_q(const qact_t *a, const qw_t *w, void *y, int y_bf16, int64_t ldy) {
    const int64_t tiles = w->N / TILE, m16 = a->M / 16 * 16, G = w->group;
    const int sup = qw_act_block(w) != 32;
    amx_rows_t tr;
    if (amx_rows(a, w, m16, &tr)) return 1;
    int failed = 0;
    #pragma omp parallel
    {
        uint8_t *ub = NULL;
        int32_t *cbuf = NULL;
        int ok = posix_memalign((void **)&ub, 64, (size_t)(2 * w->K * TILE)) == 0;
        ok = ok && posix_memalign((void **)&cbuf, 64, 4 * 256 * sizeof(int32_t)) == 0;
        #pragma omp atomic
        failed += !ok;
        #pragma omp barrier
        if (!failed) {
            amx_config(sup ? 64 : G);
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                if (sup) amx_tile_sb_any(w, t, a, &tr, m16, ub, cbuf, y, y_bf16, ldy);
                else amx_tile_mb_any(w, t, a, &tr, m16, ub, cbuf, y, y_bf16, ldy);
                if (m16 < a->M) run_tiles(w, t, 1, a, m16, a->M, y, y_bf16, ldy);
            }
            _tile_release();
        }
        free(ub);
        free(cbuf);
    }
    free(tr.dx);
    return failed != 0;
}

/* 1 when a call of M rows against w would run on AMX tiles (the tests hold every format to it) */
int qmatmul_amx_takes(const qw_t *w, int64_t M) {
    qact_t a;
    memset(&a, 0, sizeof(a));
    a.M = M;
    return amx_takes(&a, w);
}

/* 1 when calls of 32 rows or more run on AMX tiles; enable: 0 or 1 sets it, -1 only asks */
int qmatmul_amx(int enable) {
    if (enable >= 0) amx_enabled = enable;
    return amx_enabled && amx_ready();
}
