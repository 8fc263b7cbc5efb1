/* The quantized matmul's loops for CPUs with AVX2, FMA and F16C but no AVX-512 VNNI (AMD Zen 1-3,
 * Intel client CPUs before Alder Lake, most cloud VMs), and with AVX-VNNI (the 256-bit vpdpbusd of
 * Alder Lake and Zen 5) where built with it. Included by qmatmul.c, which holds the layout (its top
 * comment), the activation quantization and the plain C loop these must equal bit for bit: the same
 * integer sums however they are formed, then the plain loop's float operations in its order (its
 * comment: per group for the legacy formats, per super-block for the K-quants), in a tile's 16 lanes.
 *
 * Integer sums (llama.cpp's and ik_llama.cpp's AVX2 pairing for u8 x s8): vpmaddubsw multiplies
 * unsigned codes by signed activation bytes and adds pairs into int16; vpmaddwd by ones widens to
 * int32. Where the codes are small the int16 pair sums of several vectors are added before one
 * widening (ik_llama.cpp's trick): a pair sum is at most 2 * c_max * 127, so 8 of them fit int16 for
 * 4-bit codes (30480), 4 for 5-bit (31496), 2 for 6-bit (32004); 8-bit codes go through the sign
 * trick (|u - 128| times x signed as u - 128, then 128 * sum(x) added), one vector per widening; a
 * lut weight's indices (the IQ formats) are looked up (vpshufb) as u - 128 and summed so too.
 * AVX-VNNI's vpdpbusd does the product, the pair sums and the int32 add in one instruction.
 *
 * Blocking: a tile is 16 weight rows, two halves of 8 lanes. Up to MR2 = 4 activation rows run in
 * one pass over both halves: 1-2 rows sweep each group once for both halves (each activation
 * broadcast serves both); 3-4 rows sweep each chunk of groups (a super-block, or 8 groups) once
 * per half, its codes then in L1, so a sweep's sums fit the 16 vector registers while the tile
 * still streams in order. 5 to 8 rows (MR) run one pass per half. More rows go in blocks of at
 * most MR, split evenly (9 rows: 4 + 5). Every constant (format, rows, halves) is compiled in, and
 * KEEP stops GCC from spilling a group's products. Decode (up to MR rows: one stream, speculative
 * verification, small batches) reads each weight once per call, every line of a group prefetched
 * AVX2_PF groups ahead (AVX2_PF_SB for the K-quants) by the first sweep; a second half's pass and
 * more row blocks find the tile's codes in L1 or L2.
 * Measured (an A/B harness over 512 MiB of [1536, 1536] weights, AVX2 build on a 2-core Sapphire
 * Rapids VM, time of 2 / 4 / 8 rows against 1): passes of at most 4 rows over both halves, no KEEP:
 * Q4_K 1.14 / 1.59 / 2.65, Q6_K 1.20 / 1.28 / 2.33, Q8_0 1.04 / 1.42 / 2.65; with KEEP and per-half
 * passes from 5 rows: Q4_K 1.06 / 1.46 / 2.13, Q6_K 1.19 / 1.32 / 1.83, Q8_0 1.11 / 1.49 / 2.15;
 * with the chunked sweeps at 3-4 rows (4 rows, two alternated runs): Q4_K 1.41 and 1.39 against
 * 1.37 and 1.50, Q6_K 1.12 and 1.19 against 1.38 and 1.36, Q4_0 1.58 and 1.57 against 1.82 and 1.82.
 */
#include <immintrin.h>
#define QM_AVX2 1
#if defined(__AVXVNNI__)
#define QM_AVXVNNI 1 /* 256-bit vpdpbusd */
#endif

#define MR 8 /* activation rows per pass over one half of a tile */
#define MR2 4 /* activation rows per pass over both halves */
#ifndef AVX2_PF_HINT
#define AVX2_PF_HINT _MM_HINT_T0
#endif

/* the 8 rows' scales (or mins) of half h of a tile's group: group_scale's arithmetic on 8 lanes;
 * i: the group's first entry ((t * ng + g) * TILE), sup: its super-block's 16 float32 or NULL */
static inline __m256 vgroup8(const void *v, const float *sup, int64_t i, int h) {
    if (sup) {
        int64_t raw;
        memcpy(&raw, (const int8_t *)v + i + 8 * h, 8);
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(raw)));
        return _mm256_mul_ps(q, _mm256_loadu_ps(sup + 8 * h));
    }
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)v + i + 8 * h)));
}

/* int8 values p[0..7] as 8 lanes of int16 pairs: lane l = (p[l], p[l]) with dup, else (p[l], q[l]) */
static inline __m256i pairs16(const int8_t *p, const int8_t *q) {
    int64_t a, b;
    memcpy(&a, p, 8);
    memcpy(&b, q, 8);
    return _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(_mm_cvtsi64_si128(a), _mm_cvtsi64_si128(b)));
}

static inline __m256i bcast4x(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

static inline __m256i load32(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* Pins vector v to a register at this point: without it GCC 12 computes every product of a group's
 * unrolled loops before adding any and spills them to the stack (a 4-row pass over a Q4_K tile:
 * 180 stack accesses in its code, 2 with it). */
#define KEEP(v) __asm__("" : "+x"(v))

/* s += unsigned codes c times signed bytes x, four products per 32-bit lane: one vpdpbusd, or
 * (AVX2) the int16 pair sums, to be widened by the caller (dot16) */
#ifdef QM_AVXVNNI
#define DOT32(s, c, x) ((s) = _mm256_dpbusd_avx_epi32((s), (c), (x)))
#endif
#define DOT16(c, x) _mm256_maddubs_epi16((c), (x))
#define WIDEN(s16, w) _mm256_madd_epi16((s16), (w)) /* int16 pairs times w's int16 pairs, added: int32 */
/* the int32 sums of signed codes c (u - 128) times x, widened against w: the sign trick (AVX2) */
#define SIGNED_DOT(c, x, w) WIDEN(DOT16(_mm256_abs_epi8(c), _mm256_sign_epi8((x), (c))), (w))
/* the int16 pair sums of two products (AVX2) */
#define PAIR16(c0, x0, c1, x1) _mm256_add_epi16(DOT16((c0), (x0)), DOT16((c1), (x1)))

/* Integer sums of one group of a tile (codes from cg) against mb activation rows (row i's group
 * columns at x + i * K): isum[hh][i] lane l = sum over the columns k of u[8h + l, k] x_i[k] for the
 * nh halves h = h0 + hh of the pass, side by side so that each activation broadcast serves both (8-bit
 * codes without VNNI: sum (u - 128) x; the caller adds 128 sum x). Without VNNI the int16 pair
 * sums are widened by vpmaddwd against w16[h]: ones, or the group's int8 scales as int16 pairs
 * (the super-block form: the sums come out times their scale, at no extra instruction). */
static inline __attribute__((always_inline)) void group_sums(const uint8_t *cg, const int bits, const uint8_t *lut, const int8_t *x,
                                                             const int64_t K, const int mb, const int h0, const int nh,
                                                             const __m256i w16[2], __m256i isum[2][MR]) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < mb; i++) isum[h][i] = _mm256_setzero_si256();
#ifdef QM_AVXVNNI
    /* with one or two sums, a second accumulator each: two chains of dependent vpdpbusd instead of
     * one (its latency, not its throughput, bounded one row); more sums are chains enough */
    const int c2 = mb * nh <= 2;
    __m256i s2[2][MR];
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < mb; i++) s2[h][i] = _mm256_setzero_si256();
#define DOT32B(s, t, c, x) (c2 ? DOT32((t), (c), (x)) : DOT32((s), (c), (x)))
#endif
    /* a lut weight's indices looked up: the unsigned codes, or without VNNI the signed values u - 128 */
    __m256i tab = _mm256_setzero_si256();
    if (bits == BITS_LUT || bits == BITS_LUT16) {
        tab = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lut));
#ifndef QM_AVXVNNI
        tab = _mm256_xor_si256(tab, _mm256_set1_epi8((char)0x80));
#endif
    }
    if (bits == 4 || bits == 5 || bits == BITS_LUT) { /* load j: low nibbles = columns 4j.., high nibbles = 16 + 4j.. */
        const __m256i m10 = _mm256_set1_epi8(0x10);
#ifndef QM_AVXVNNI
        __m256i s16[2][MR];
        for (int h = 0; h < nh; h++)
            for (int i = 0; i < mb; i++) s16[h][i] = _mm256_setzero_si256();
#endif
        /* unrolled: GCC kept it a loop, reloading the mask per load (64 rows, one thread: Q5_0
         * 111-112 -> 156-157 GOP/s, Q4_0 and Q4_1 +10%, Q4_K +5%) */
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i lo[2], hi[2];
            for (int h = 0; h < nh; h++) {
                const __m256i q = load32(cg + 64 * j + 32 * (h0 + h));
                lo[h] = _mm256_and_si256(q, nib);
                hi[h] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
                if (bits == 5) { /* fifth bits: bit j of each byte for the low columns, bit 4 + j for the high */
                    const __m256i hb = load32(cg + 256 + 32 * (h0 + h));
                    const __m256i lo5 = j == 0 ? _mm256_slli_epi16(hb, 4) : j == 1 ? _mm256_slli_epi16(hb, 3)
                                      : j == 2 ? _mm256_slli_epi16(hb, 2) : _mm256_slli_epi16(hb, 1);
                    const __m256i hi5 = j == 0 ? hb : j == 1 ? _mm256_srli_epi16(hb, 1)
                                      : j == 2 ? _mm256_srli_epi16(hb, 2) : _mm256_srli_epi16(hb, 3);
                    lo[h] = _mm256_or_si256(lo[h], _mm256_and_si256(lo5, m10));
                    hi[h] = _mm256_or_si256(hi[h], _mm256_and_si256(hi5, m10));
                }
                if (bits == BITS_LUT) {
                    lo[h] = _mm256_shuffle_epi8(tab, lo[h]);
                    hi[h] = _mm256_shuffle_epi8(tab, hi[h]);
                }
            }
            for (int i = 0; i < mb; i++) {
                const __m256i xl = bcast4x(x + i * K + 4 * j), xh = bcast4x(x + i * K + 16 + 4 * j);
                for (int h = 0; h < nh; h++) {
#ifdef QM_AVXVNNI
                    DOT32(isum[h][i], lo[h], xl);
                    DOT32B(isum[h][i], s2[h][i], hi[h], xh);
                    KEEP(isum[h][i]);
#else
                    if (bits == BITS_LUT) { /* the sign trick, one widening per vector (a pair sum reaches 2 * 127^2) */
                        isum[h][i] = _mm256_add_epi32(isum[h][i], SIGNED_DOT(lo[h], xl, w16[h]));
                        isum[h][i] = _mm256_add_epi32(isum[h][i], SIGNED_DOT(hi[h], xh, w16[h]));
                        KEEP(isum[h][i]);
                        continue;
                    }
                    s16[h][i] = _mm256_add_epi16(s16[h][i], PAIR16(lo[h], xl, hi[h], xh));
                    KEEP(s16[h][i]);
                    if (bits == 5 && (j & 1)) { /* 4 pair sums of 5-bit codes fill int16 */
                        isum[h][i] = _mm256_add_epi32(isum[h][i], WIDEN(s16[h][i], w16[h]));
                        s16[h][i] = _mm256_setzero_si256();
                    }
#endif
                }
            }
        }
#ifndef QM_AVXVNNI
        if (bits == 4)
            for (int h = 0; h < nh; h++)
                for (int i = 0; i < mb; i++) isum[h][i] = WIDEN(s16[h][i], w16[h]);
#endif
    } else if (G16(bits)) { /* G = 16; load a: columns 4a.. (low nibbles), 8 + 4a.. (high); 6 bits: 2 high bits each */
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int a = 0; a < 2; a++) {
            __m256i v0[2], v1[2];
            for (int h = 0; h < nh; h++) {
                const __m256i q = load32(cg + 64 * a + 32 * (h0 + h));
                v0[h] = _mm256_and_si256(q, nib);
                v1[h] = _mm256_and_si256(_mm256_srli_epi16(q, 4), nib);
                if (bits == 6) {
                    const __m256i hb = load32(cg + 128 + 32 * (h0 + h));
                    const __m256i h0 = a == 0 ? _mm256_slli_epi16(hb, 4) : _mm256_slli_epi16(hb, 2);
                    const __m256i h1 = a == 0 ? hb : _mm256_srli_epi16(hb, 2);
                    v0[h] = _mm256_or_si256(v0[h], _mm256_and_si256(h0, m30));
                    v1[h] = _mm256_or_si256(v1[h], _mm256_and_si256(h1, m30));
                }
                if (bits == BITS_LUT16) {
                    v0[h] = _mm256_shuffle_epi8(tab, v0[h]);
                    v1[h] = _mm256_shuffle_epi8(tab, v1[h]);
                }
            }
            for (int i = 0; i < mb; i++) {
                const __m256i x0 = bcast4x(x + i * K + 4 * a), x1 = bcast4x(x + i * K + 8 + 4 * a);
                for (int h = 0; h < nh; h++) {
#ifdef QM_AVXVNNI
                    DOT32(isum[h][i], v0[h], x0);
                    DOT32B(isum[h][i], s2[h][i], v1[h], x1);
#else
                    if (bits == BITS_LUT16) { /* the sign trick, as BITS_LUT's */
                        isum[h][i] = _mm256_add_epi32(isum[h][i], SIGNED_DOT(v0[h], x0, w16[h]));
                        isum[h][i] = _mm256_add_epi32(isum[h][i], SIGNED_DOT(v1[h], x1, w16[h]));
                    } else {
                        isum[h][i] = _mm256_add_epi32(isum[h][i], WIDEN(PAIR16(v0[h], x0, v1[h], x1), w16[h]));
                    }
#endif
                    KEEP(isum[h][i]);
                }
            }
        }
    } else { /* 8 bits: vector j = columns 4j.. */
        for (int j = 0; j < 8; j++) {
            __m256i c[2], ca[2];
            for (int h = 0; h < nh; h++) {
                c[h] = load32(cg + 64 * j + 32 * (h0 + h));
#ifndef QM_AVXVNNI
                c[h] = _mm256_xor_si256(c[h], _mm256_set1_epi8((char)0x80));
                ca[h] = _mm256_abs_epi8(c[h]);
#endif
            }
            for (int i = 0; i < mb; i++) {
                const __m256i xb = bcast4x(x + i * K + 4 * j);
                for (int h = 0; h < nh; h++) {
#ifdef QM_AVXVNNI
                    if (j & 1) DOT32B(isum[h][i], s2[h][i], c[h], xb);
                    else DOT32(isum[h][i], c[h], xb);
#else
                    isum[h][i] = _mm256_add_epi32(isum[h][i], WIDEN(DOT16(ca[h], _mm256_sign_epi8(xb, c[h])), w16[h]));
#endif
                    KEEP(isum[h][i]);
                }
            }
            (void)ca;
        }
    }
#ifdef QM_AVXVNNI
    if (c2)
        for (int h = 0; h < nh; h++)
            for (int i = 0; i < mb; i++) isum[h][i] = _mm256_add_epi32(isum[h][i], s2[h][i]);
#undef DOT32B
    (void)w16;
#endif
}

/* The end of a super-block (groups g0..g1) in the super-block form, for the pass's halves: the
 * mins' term in integers (two groups' int8 mins against their int16 activation sums per vpmaddwd),
 * then one float scaling of both terms into acc; isb is cleared. at: the super-block's scales,
 * dx: row 0's scale of it (row i's at i * dxn). */
static inline __attribute__((always_inline)) void sb_end(const qw_t *w, int64_t t, int64_t ng, int64_t g0, int64_t g1,
                                                         int64_t at, const int8_t *mn8, const int16_t *bsr,
                                                         const float *dx, int64_t dxn, const int mb, const int h0,
                                                         const int nh, __m256 negoff, __m256i isb[2][MR], __m256 acc[2][MR]) {
    static const int8_t zero[8] = {0};
    for (int hh = 0; hh < nh; hh++) {
        const int h = h0 + hh;
        __m256i imin[MR];
        for (int i = 0; i < mb; i++) imin[i] = _mm256_setzero_si256();
        for (int64_t g2 = g0; g2 <= g1; g2 += 2) {
            const int two = g2 + 1 <= g1;
            const __m256i mp = pairs16(mn8 + (t * ng + g2) * TILE + 8 * h, two ? mn8 + (t * ng + g2 + 1) * TILE + 8 * h : zero);
            for (int i = 0; i < mb; i++) {
                uint32_t pair; /* the two groups' sums side by side in memory: one broadcast load */
                if (two) memcpy(&pair, bsr + i * ng + g2, 4);
                else pair = (uint16_t)bsr[i * ng + g2];
                imin[i] = _mm256_add_epi32(imin[i], _mm256_madd_epi16(mp, _mm256_set1_epi32((int32_t)pair)));
            }
        }
        const __m256 ssup = _mm256_loadu_ps(w->scale_sup + at + 8 * h);
        const __m256 msup = w->mins ? _mm256_loadu_ps(w->min_sup + at + 8 * h) : _mm256_mul_ps(ssup, negoff);
        for (int i = 0; i < mb; i++) {
            const __m256 d = _mm256_set1_ps(dx[i * dxn]);
            acc[hh][i] = _mm256_add_ps(acc[hh][i], _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isb[hh][i]), _mm256_mul_ps(ssup, d)),
                                                                 _mm256_mul_ps(_mm256_cvtepi32_ps(imin[i]), _mm256_mul_ps(msup, d))));
            isb[hh][i] = _mm256_setzero_si256();
        }
    }
}

/* Halves h0 .. h0 + nh - 1 of tile t against activation rows m0 .. m0 + mb - 1 (bits, mb, nh and
 * sbf compile-time constants): the plain loop's float operations (its comment), then the bias and
 * the output rounding. sbf: the super-block form (int8 scales; dx per super-block), its sums in
 * integers until the super-block ends. */
static inline __attribute__((always_inline)) void tile_rows(const qw_t *w, int64_t t, const qact_t *a, int64_t m0,
                                                            const int mb, const int bits, const int sbf, const int h0,
                                                            const int nh, void *y, int y_bf16, int64_t ldy) {
    const int64_t K = w->K, G = GROUP_OF(bits), ng = K / G, gbytes = TILE * G * LAYOUT_BITS(bits) / 8, n0 = t * TILE;
    const uint8_t *codes = w->codes + t * ng * gbytes;
    const float *xs = G == 16 ? a->xs16 : a->xs32;
    const int16_t *bs = G == 16 ? a->bs16 : a->bs32;
    const int8_t *sc8 = (const int8_t *)w->scales, *mn8 = w->mins ? (const int8_t *)w->mins : sc8;
    const __m256 negoff = _mm256_set1_ps(-(float)w->offset);
    const int stream = a->M <= MR && h0 == 0; /* the first pass over a tile read once: stream it from memory */
    /* row i's activations, scales (one per QB = 32 or 256 columns: a shift, never a division in the
     * loop) and group sums, at a stride from row m0's */
    /* QB: 32, or a power-of-two super-block (the two that occur spelt out, constants the compiler
     * can specialise on) */
    const int qsh = a->QB == 256 ? 8 : a->QB == 32 ? 5 : __builtin_ctzll((unsigned long long)a->QB);
    const int64_t dxn = K >> qsh;
    const int8_t *xq = a->q + m0 * K;
    const float *dxr = a->dx + m0 * dxn, *xsr = xs + m0 * ng;
    const int16_t *bsr = bs + m0 * ng;
    const int64_t gps = w->gps > 0 ? w->gps : 1, nsb = ng / gps;
    int64_t sb = 0, gin = 0; /* the group's super-block, and its place in it (no division per group) */
    __m256 acc[2][MR];
    __m256i isb[2][MR]; /* the super-block form: sum_g sc_g isum_g so far */
    for (int h = 0; h < nh; h++)
        for (int i = 0; i < mb; i++) {
            acc[h][i] = _mm256_setzero_ps();
            isb[h][i] = _mm256_setzero_si256();
        }
    /* 3 or 4 rows over both halves: the groups in chunks (a super-block, or 8 groups), each chunk
     * swept once per half (its codes then in L1), so a sweep's sums fit the registers while the
     * tile still streams in order; otherwise one sweep of every group over the pass's halves */
    const int chunked = nh == 2 && mb >= 3, sweeps = chunked ? 2 : 1, hn = chunked ? 1 : nh;
    const int64_t CH = chunked ? (sbf ? gps : 8) : ng;
    for (int64_t c0 = 0; c0 < ng; c0 += CH) {
    const int64_t c1 = c0 + CH < ng ? c0 + CH : ng;
    for (int sw = 0; sw < sweeps; sw++) {
    const int hs = chunked ? sw : h0; /* the sweep's first half */
    __m256(*A)[MR] = acc + (chunked ? sw : 0);
    __m256i(*B)[MR] = isb + (chunked ? sw : 0);
    sb = c0 / gps, gin = c0 % gps;
    for (int64_t g = c0; g < c1; g++) {
        const uint8_t *cg = codes + g * gbytes;
        const int64_t si = (t * ng + g) * TILE; /* the group's scales */
        if (stream && sw == 0) { /* every line of the group AVX2_PF (AVX2_PF_SB) ahead (past the tile's end: a harmless hint) */
            const char *pc = (const char *)(cg + (sbf ? AVX2_PF_SB : AVX2_PF) * gbytes);
            for (int64_t b = 0; b < gbytes; b += 64) _mm_prefetch(pc + b, AVX2_PF_HINT);
        }
        __m256i isum[2][MR], w16[2];
        for (int h = 0; h < hn; h++)
            w16[h] = sbf ? pairs16(sc8 + si + 8 * (hs + h), sc8 + si + 8 * (hs + h)) : _mm256_set1_epi16(1);
        group_sums(cg, bits, w->lut, xq + g * G, K, mb, hs, hn, w16, isum);
        const int64_t at = (t * nsb + sb) * TILE; /* the group's super-block's float32 scales */
        if (!sbf) { /* (super-block scales here only where the activations are not: see qw_act_block) */
            const float *ssup = w->scale_sup ? w->scale_sup + at : NULL, *msup = w->min_sup ? w->min_sup + at : NULL;
            for (int h = 0; h < hn; h++) {
                const __m256 sc = vgroup8(w->scales, ssup, si, hs + h);
                const __m256 mn = w->mins ? vgroup8(w->mins, msup, si, hs + h) : _mm256_mul_ps(negoff, sc);
                for (int i = 0; i < mb; i++) {
#ifndef QM_AVXVNNI
                    if (bits == 8 || bits == BITS_LUT || bits == BITS_LUT16)
                        isum[h][i] = _mm256_add_epi32(isum[h][i], _mm256_set1_epi32(128 * (int32_t)bsr[i * ng + g]));
#endif
                    const __m256 d = _mm256_set1_ps(dxr[i * dxn + ((g * G) >> qsh)]), xv = _mm256_set1_ps(xsr[i * ng + g]);
                    A[h][i] = _mm256_add_ps(A[h][i], _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(isum[h][i]), d), sc),
                                                                       _mm256_mul_ps(mn, xv)));
                }
            }
        } else {
            for (int h = 0; h < hn; h++) {
#ifdef QM_AVXVNNI /* vpdpbusd's sums are int32: times the scales here */
                int64_t raw;
                memcpy(&raw, sc8 + si + 8 * (hs + h), 8);
                const __m256i s32 = _mm256_cvtepi8_epi32(_mm_cvtsi64_si128(raw));
                for (int i = 0; i < mb; i++) isum[h][i] = _mm256_mullo_epi32(isum[h][i], s32);
#endif
                for (int i = 0; i < mb; i++) B[h][i] = _mm256_add_epi32(B[h][i], isum[h][i]);
            }
            if (gin + 1 == gps)
                sb_end(w, t, ng, g + 1 - gps, g, at, mn8, bsr, dxr + sb, dxn, mb, hs, hn, negoff, B, A);
        }
        if (++gin == gps) {
            gin = 0;
            sb++;
        }
    }
    }
    }
    for (int i = 0; i < mb; i++) {
        float v[TILE];
        for (int h = 0; h < nh; h++) _mm256_storeu_ps(v + 8 * (h0 + h), acc[h][i]);
        for (int64_t l = 8 * h0; l < 8 * (h0 + nh); l++) {
            float o = v[l];
            if (w->bias) o += w->bias[n0 + l];
            store1(y, y_bf16, (m0 + i) * ldy + n0 + l, o);
        }
    }
}

/* One function per pass shape (format, form, rows, halves), none inlined into another: with all
 * 63 shapes inlined into run_tile GCC kept fewer sums in registers (a [4096, 1536] weight at 64
 * rows, one thread, AVX2 build, GOP/s, one function / one per shape: Q4_K 171-182 / 194-197, Q6_K
 * 118-129 / 145-146, Q5_0 128-137 / 145-146, Q4_0 Q4_1 Q8_0 within 5%), and decode.c's AVX2 build
 * compiles in half the time (7 s against 15). */
#define PASS_DECL(BITS, SBF, MB, NH)                                                 \
    QM_LOOP_FN void pass_##BITS##_##SBF##_##MB##_##NH(const qw_t *w, int64_t t, const qact_t *a, int64_t m0, \
                                                      int h0, void *y, int y_bf16, int64_t ldy)
#define PASS_FN(BITS, SBF, MB, NH) \
    PASS_DECL(BITS, SBF, MB, NH) { tile_rows(w, t, a, m0, MB, BITS, SBF, h0, NH, y, y_bf16, ldy); }
#define PASS_ROWS(P, BITS, SBF)                                                        \
    P(BITS, SBF, 1, 2) P(BITS, SBF, 2, 2) P(BITS, SBF, 3, 2) P(BITS, SBF, 4, 2) P(BITS, SBF, 4, 1) \
    P(BITS, SBF, 5, 1) P(BITS, SBF, 6, 1) P(BITS, SBF, 7, 1) P(BITS, SBF, 8, 1)
#define PASS_DECL_SEMI(BITS, SBF, MB, NH) PASS_DECL(BITS, SBF, MB, NH);
#define PASSES(BITS, SBF) PASS_ROWS(PASS_FN, BITS, SBF)
#define PASSES_DECL(BITS, SBF) PASS_ROWS(PASS_DECL_SEMI, BITS, SBF)
PASSES_DECL(4, 1) PASSES_DECL(5, 1) PASSES_DECL(6, 1) PASSES_DECL(4, 0) PASSES_DECL(5, 0)
PASSES_DECL(6, 0) PASSES_DECL(8, 0) PASSES_DECL(12, 0) PASSES_DECL(20, 1) PASSES_DECL(22, 0)
#if QM_IN_PART(1)
PASSES(4, 1)
PASSES(4, 0)
PASSES(22, 0) /* BITS_LUT16 */
#endif
#if QM_IN_PART(2)
PASSES(6, 1)
PASSES(5, 0)
#endif
#if QM_IN_PART(3)
PASSES(5, 1)
PASSES(8, 0)
PASSES(12, 0) /* BITS_LUT */
#endif
#if QM_IN_PART(4)
PASSES(6, 0)
PASSES(20, 1) /* BITS_4G16 (super-blocks only: qw_ok) */
#endif
#ifndef QM_PART /* (a part unit ends with its loop functions) */

#define TILE_MB(BITS, SBF)                                                                              \
    if (nh == 2) {                                                                                      \
        switch (mb) {                                                                                   \
        case 1: pass_##BITS##_##SBF##_1_2(w, t, a, m0, 0, y, y_bf16, ldy); break;                       \
        case 2: pass_##BITS##_##SBF##_2_2(w, t, a, m0, 0, y, y_bf16, ldy); break;                       \
        case 3: pass_##BITS##_##SBF##_3_2(w, t, a, m0, 0, y, y_bf16, ldy); break;                       \
        default: pass_##BITS##_##SBF##_4_2(w, t, a, m0, 0, y, y_bf16, ldy); break;                      \
        }                                                                                               \
    } else /* blocks of 4 to 8 rows (more than MR2 rows, split evenly) */                               \
        for (int h0 = 0; h0 < 2; h0++) switch (mb) {                                                    \
            case 4: pass_##BITS##_##SBF##_4_1(w, t, a, m0, h0, y, y_bf16, ldy); break;                  \
            case 5: pass_##BITS##_##SBF##_5_1(w, t, a, m0, h0, y, y_bf16, ldy); break;                  \
            case 6: pass_##BITS##_##SBF##_6_1(w, t, a, m0, h0, y, y_bf16, ldy); break;                  \
            case 7: pass_##BITS##_##SBF##_7_1(w, t, a, m0, h0, y, y_bf16, ldy); break;                  \
            default: pass_##BITS##_##SBF##_8_1(w, t, a, m0, h0, y, y_bf16, ldy); break;                 \
            }

/* every activation row against tile t: up to MR2 rows in one pass over both halves, more in
 * blocks of at most MR rows split evenly, one pass per half */
static void run_tile(const qw_t *w, int64_t t, const qact_t *a, void *y, int y_bf16, int64_t ldy) {
    const int nh = a->M <= MR2 ? 2 : 1;
    const int64_t blocks = (a->M + MR - 1) / MR;
    for (int64_t b = 0, m0 = 0; b < blocks; b++) {
        const int64_t mb = (a->M - m0) / (blocks - b); /* even split: the rest divided by the blocks left */
        if (qw_sb_form(w)) { /* Q4_K, Q6_K, Q3_K, Q2_K (and a 5-bit one, were it mapped) */
            switch (LOOP_BITS(w)) {
            case 4: TILE_MB(4, 1) break;
            case 5: TILE_MB(5, 1) break;
            case BITS_4G16: TILE_MB(20, 1) break;
            default: TILE_MB(6, 1) break;
            }
        } else {
            switch (LOOP_BITS(w)) {
            case BITS_LUT: TILE_MB(12, 0) break;
            case BITS_LUT16: TILE_MB(22, 0) break;
            case 4: TILE_MB(4, 0) break;
            case 5: TILE_MB(5, 0) break;
            case 6: TILE_MB(6, 0) break;
            default: TILE_MB(8, 0) break;
            }
        }
        m0 += mb;
    }
}
#endif /* QM_PART */
