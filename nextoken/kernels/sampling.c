/* The sampler's draw on a batch of logits rows: greedy argmax, or temperature, top-k, top-p,
 * min-p and one draw by the inverse CDF with the caller's uniform number.
 * nextoken's own kernel; the reference it must match is `nextoken.sample.sampler.torch_draw`
 * (PyTorch, the same rule written with sorts over the whole vocabulary). The rule, per row l [V]:
 *
 *   greedy (temperature 0): the first index of max l.
 *   x = l / T, m = max x, e_i = exp(x_i - m)                (so the best token has e = 1)
 *   order the tokens by x descending, ties by id ascending;
 *   top-k:  keep the first K                                 (K <= 0 or >= V: all)
 *   top-p:  Zk = sum of e over those, in double; keep token j while the sum of e before it
 *           (exclusive, in that order, in double) < P * Zk  (Holtzman et al. 2019)
 *   min-p:  keep e_j >= Mp (= p_j >= Mp * p_max, Nguyen et al. 2024)
 *   (the best token is always kept)
 *   draw:   the kept tokens in id order, S their running sum of e in double; the first token with
 *           S > u * S_total.
 *
 * Greedy is one pass (row_argmax). Without a filter the draw is one pass for the max and one for e (summed per block of 64 in
 * double lanes), then a walk over the block sums and one block. With filters the candidates
 * {e >= tau} are gathered for a threshold tau low enough that no token outside them can be kept
 * (tau = Mp for min-p; else 2^-8, lowered by 2^-8 until the K best or the top-p mass are inside),
 * and those are counted and summed by buckets of x: whole buckets are kept by their sums, and
 * only the bucket where a cut falls is sorted (ranking_t). The kept ones are then put in id order
 * by merging the gathers' runs, each already in id order (kept_by_id): no sort of the vocabulary,
 * nor of a flat row's nucleus. A whole bucket's mass is summed in gather order, not the
 * reference's sorted order, so a token can differ from the reference's only where top-p's limit
 * falls within float64's rounding of a boundary (as the Triton draw's sums in their own order).
 * Rows run in parallel over OpenMP threads, each row on one thread from start to end, so a row's
 * token never depends on the other rows of the batch. Plain C that the compiler vectorizes.
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64   /* elements per block sum of the unfiltered draw */
#define LANES 8
#define TAU0 0x1p-8f
#define TAU_STEP 0x1p-8f

typedef struct {
    float x, e;
    int32_t id;
} cand_t;

#define MAX_RUNS 24        /* gathers of one row: tau from 2^-8 down by 2^-8 to 2^-126, then the rest */
#define NBUCKETS 1024      /* buckets of x over a row's candidates (ranking_t) */

/* per-thread scratch, grown on demand (OpenMP's pool threads live as long as the process):
 * the candidates in gather order, the ones sorted by x, and the kept ones in id order */
static _Thread_local float *t_e;
static _Thread_local double *t_blocks;
static _Thread_local cand_t *t_cand, *t_sorted, *t_kept;
static _Thread_local int64_t t_e_cap, t_cand_cap, t_sorted_cap, t_kept_cap;

static int reserve(int64_t V) {
    if (t_e_cap < V) {
        free(t_e);
        free(t_blocks);
        t_e = malloc(sizeof(float) * (size_t)V);
        t_blocks = malloc(sizeof(double) * (size_t)(V / BLOCK + 1));
        t_e_cap = (t_e && t_blocks) ? V : 0;
        if (!t_e_cap) return 1;
    }
    return 0;
}

/* *buf holds at least n candidates (its capacity *cap doubled as needed); 1 when out of memory */
static int grow(cand_t **buf, int64_t *cap, int64_t n) {
    if (*cap < n) {
        int64_t c = *cap ? *cap : 256;
        while (c < n) c *= 2;
        cand_t *p = realloc(*buf, sizeof(cand_t) * (size_t)c);
        if (!p) return 1;
        *buf = p;
        *cap = c;
    }
    return 0;
}

static int reserve_cand(int64_t n) { return grow(&t_cand, &t_cand_cap, n); }

/* e^x for x <= 0 (0 below -87, and for -inf): x = k ln 2 + f with |f| <= ln 2 / 2, e^f by its
 * degree-7 Taylor polynomial (relative error under 2e-7), times 2^k through the exponent bits.
 * exp_le0(0) is exactly 1. Branch-free, so the loops that call it vectorize. */
static inline float exp_le0(float x) {
    const float t = x > -87.f ? x : -87.f;
    float k = t * 1.44269504088896341f + 12582912.f; /* round to nearest through the float's mantissa */
    k -= 12582912.f;
    float f = t - k * 0.693359375f; /* ln 2 = 0.693359375 - 2.12194440e-4, so k ln 2 is exact */
    f = f - k * -2.12194440e-4f;
    float p = 1.f / 5040.f;
    p = p * f + 1.f / 720.f;
    p = p * f + 1.f / 120.f;
    p = p * f + 1.f / 24.f;
    p = p * f + 1.f / 6.f;
    p = p * f + 0.5f;
    p = p * f + 1.f;
    p = p * f + 1.f;
    const int32_t bits = ((int32_t)k + 127) << 23;
    float s;
    memcpy(&s, &bits, 4);
    return x > -87.f ? p * s : 0.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SAMPLING_AVX2 1

/* exp_le0 on 8 lanes, the same operations in the same order (so the same values) */
static inline __m256 exp8_le0(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.f);
    const __m256 t = _mm256_max_ps(x, lo);
    const __m256 magic = _mm256_set1_ps(12582912.f);
    __m256 k = _mm256_add_ps(_mm256_mul_ps(t, _mm256_set1_ps(1.44269504088896341f)), magic);
    k = _mm256_sub_ps(k, magic);
    __m256 f = _mm256_sub_ps(t, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f)));
    f = _mm256_sub_ps(f, _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f / 720.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f / 120.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f / 24.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f / 6.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f));
    p = _mm256_add_ps(_mm256_mul_ps(p, f), _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 r = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    return _mm256_and_ps(r, _mm256_cmp_ps(x, lo, _CMP_GT_OQ));
}
#else
#define SAMPLING_AVX2 0
#endif

/* 1 when x is an infinity or NaN (its exponent bits all ones), in integers */
static inline uint32_t nonfinite1(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    return (bits & 0x7f800000u) == 0x7f800000u;
}

#if SAMPLING_AVX2
/* nonfinite1 on 8 lanes: all ones where the lane is an infinity or NaN */
static inline __m256i nonfinite8(__m256 x) {
    const __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(x), e), e);
}
#endif

/* max of a row (-inf for an empty or all -inf row); *finite (when set) = 1 when the row holds no
 * NaN and no infinity, found in the same pass */
static float row_max(const float *l, int64_t V, uint8_t *finite) {
    float m = -INFINITY;
    uint32_t bad = 0;
    int64_t i = 0;
#if SAMPLING_AVX2
    __m256 a = _mm256_set1_ps(-INFINITY), b = a;
    __m256i nf = _mm256_setzero_si256();
    for (; i + 16 <= V; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(l + i), x1 = _mm256_loadu_ps(l + i + 8);
        a = _mm256_max_ps(a, x0);
        b = _mm256_max_ps(b, x1);
        nf = _mm256_or_si256(nf, _mm256_or_si256(nonfinite8(x0), nonfinite8(x1)));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    bad = !_mm256_testz_si256(nf, nf);
#endif
    for (; i < V; i++) {
        m = l[i] > m ? l[i] : m;
        bad |= nonfinite1(l[i]);
    }
    if (finite) *finite = (uint8_t)!bad;
    return m;
}

static int64_t first_index_of(const float *l, int64_t V, float m);

#define ARGMAX_BLOCK 256 /* floats per block of the greedy draw's pass (1 KiB: the rescan stays in L1) */

/* The first index of a row's maximum (0 for an all -inf row), in one pass over the row, with
 * *finite (when set) as row_max's: the greedy draw. Where AVX2 is there, the row goes in blocks of
 * ARGMAX_BLOCK: each block's maximum by vector max (two accumulators), the first block holding the
 * largest kept, then the first index of that value within it (first_index_of over one block, in
 * L1); the tail past the last whole block by the plain loop, a later value replacing only a larger
 * one. The first maximum, as PyTorch's argmax. Before, the draw made row_max's pass and a second
 * for the index (half a row on average), and the engine's finiteness check a third from Python;
 * one pass keeping each lane's first index (a compare and two blends a vector) ran a row held in
 * L2 30% slower than those passes. */
static int64_t row_argmax(const float *l, int64_t V, uint8_t *finite) {
    float best = -INFINITY;
    int64_t best_i = 0, i = 0;
    uint32_t bad = 0;
#if SAMPLING_AVX2
    int64_t best_block = -1;
    __m256i nf = _mm256_setzero_si256();
    for (; i + ARGMAX_BLOCK <= V; i += ARGMAX_BLOCK) {
        __m256 a = _mm256_set1_ps(-INFINITY), b = a;
        for (int64_t k = i; k < i + ARGMAX_BLOCK; k += 16) {
            const __m256 x0 = _mm256_loadu_ps(l + k), x1 = _mm256_loadu_ps(l + k + 8);
            a = _mm256_max_ps(a, x0);
            b = _mm256_max_ps(b, x1);
            nf = _mm256_or_si256(nf, _mm256_or_si256(nonfinite8(x0), nonfinite8(x1)));
        }
        float lanes[8], m = -INFINITY;
        _mm256_storeu_ps(lanes, _mm256_max_ps(a, b));
        for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
        if (m > best) best = m, best_block = i;
    }
    if (best_block >= 0) best_i = best_block + first_index_of(l + best_block, ARGMAX_BLOCK, best);
    bad = !_mm256_testz_si256(nf, nf);
#endif
    for (; i < V; i++) {
        if (l[i] > best) best = l[i], best_i = i;
        bad |= nonfinite1(l[i]);
    }
    if (finite) *finite = (uint8_t)!bad;
    return best_i;
}

/* the first i with l[i] == m (V - 1 when there is none); 16 lanes compared at a time where AVX2
 * is there (within row_argmax's best block; a sampled row with nothing to draw from) */
static int64_t first_index_of(const float *l, int64_t V, float m) {
    int64_t i = 0;
#if SAMPLING_AVX2
    const __m256 mm = _mm256_set1_ps(m);
    for (; i + 16 <= V; i += 16) {
        const int lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + i), mm, _CMP_EQ_OQ));
        const int hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(l + i + 8), mm, _CMP_EQ_OQ));
        if (lo | hi) return i + __builtin_ctz((unsigned)(lo | (hi << 8)));
    }
#endif
    while (i < V - 1 && !(l[i] == m)) i++;
    return i;
}

/* the vector loop of exp_pass over one block, x8 the 8 lanes of l / T at i (see there) */
#define EXP_BLOCK_LOOP(x8)                                                          \
    for (; i + 8 <= n; i += 8) {                                                    \
        const __m256 e = exp8_le0(_mm256_sub_ps(x8, vm));                           \
        _mm256_storeu_ps(t_e + b0 + i, e);                                          \
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));         \
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));       \
    }

/* e = exp(l / T - mx) into t_e; the sums of e per block of BLOCK into t_blocks (double lanes);
 * returns their total. At T = 1 the vector loop skips the division, whose quotient would be l
 * itself (exactly): a sampled draw of one Gemma 3 row (262144 tokens) 0.30 -> 0.25 ms, and
 * temperature 1 is the APIs' default. */
static double exp_pass(const float *l, int64_t V, float T, float mx) {
    double total = 0.0;
    for (int64_t b0 = 0; b0 < V; b0 += BLOCK) {
        const int64_t n = V - b0 < BLOCK ? V - b0 : BLOCK;
        double s = 0.0;
        int64_t i = 0;
#if SAMPLING_AVX2
        const __m256 vt = _mm256_set1_ps(T), vm = _mm256_set1_ps(mx);
        __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
        if (T == 1.f) EXP_BLOCK_LOOP(_mm256_loadu_ps(l + b0 + i))
        else EXP_BLOCK_LOOP(_mm256_div_ps(_mm256_loadu_ps(l + b0 + i), vt))
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(a0, a1));
        s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
        for (; i < n; i++) {
            const float e = exp_le0(l[b0 + i] / T - mx);
            t_e[b0 + i] = e;
            s += (double)e;
        }
        t_blocks[b0 / BLOCK] = s;
        total += s;
    }
    return total;
}

/* the unfiltered draw: the first token whose running sum passes u * total */
static int64_t draw_all(int64_t V, double total, float u) {
    const double target = (double)u * total;
    double run = 0.0;
    const int64_t nb = (V + BLOCK - 1) / BLOCK;
    int64_t b = 0;
    for (; b < nb - 1 && run + t_blocks[b] <= target; b++) run += t_blocks[b];
    int64_t last = -1;
    for (int64_t i = b * BLOCK; i < V && i < (b + 1) * BLOCK; i++) {
        if (t_e[i] > 0.f) last = i;
        run += (double)t_e[i];
        if (run > target && t_e[i] > 0.f) return i;
    }
    if (last >= 0) return last; /* the block's sum rounded above its running sum */
    for (int64_t i = V - 1; i >= 0; i--)
        if (t_e[i] > 0.f) return i;
    return 0;
}

static int by_x_desc(const void *a, const void *b) {
    const cand_t *p = a, *q = b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->id > q->id) - (p->id < q->id);
}

/* the x-bucket of a candidate: 0 for the largest x (top), NBUCKETS - 1 for the smallest, never
 * increasing with x (every operation rounds monotonically), so a lower bucket holds only larger x */
static inline int bucket_of(float x, float top, float scale) {
    const float b = (top - x) * scale;
    return b < (float)(NBUCKETS - 1) ? (int)b : NBUCKETS - 1;
}

/* The candidates' order (x descending, ties by id ascending) kept by buckets of x: bucket b holds
 * count[b] candidates of mass[b] (their e summed in double), and a lower bucket only larger x;
 * only the buckets where a filter's cut falls are ever sorted (sort_bucket). Sorting every
 * candidate, a flat row's top-p had sorted each token within 2^-16 of the best: 1-19 thousand a
 * row at temperature 1 with the catalog's models, up to 3 ms a row, 13 ms at temperature 1.5. */
typedef struct {
    float top, scale;
    int sorted; /* the bucket whose candidates t_sorted holds in order (-1: none) */
    int64_t count[NBUCKETS];
    double mass[NBUCKETS];
} ranking_t;

static _Thread_local ranking_t t_ranking; /* (16 KiB: off the OpenMP threads' stacks) */

static void rank_candidates(ranking_t *r, int64_t n) {
    float top = -INFINITY, low = INFINITY;
    for (int64_t j = 0; j < n; j++) {
        top = t_cand[j].x > top ? t_cand[j].x : top;
        low = t_cand[j].x < low ? t_cand[j].x : low;
    }
    const float scale = (float)NBUCKETS / (top - low);
    r->top = top;
    r->scale = top > low && isfinite(scale) ? scale : 0.f; /* (0: one bucket) */
    r->sorted = -1;
    memset(r->count, 0, sizeof r->count);
    memset(r->mass, 0, sizeof r->mass);
    for (int64_t j = 0; j < n; j++) {
        const int b = bucket_of(t_cand[j].x, r->top, r->scale);
        r->count[b]++;
        r->mass[b] += (double)t_cand[j].e;
    }
}

/* bucket b's candidates into t_sorted, in order; -1 when out of memory */
static int sort_bucket(ranking_t *r, int64_t n, int b) {
    if (r->sorted == b) return 0;
    if (grow(&t_sorted, &t_sorted_cap, r->count[b])) return -1;
    int64_t m = 0;
    for (int64_t j = 0; j < n; j++)
        if (bucket_of(t_cand[j].x, r->top, r->scale) == b) t_sorted[m++] = t_cand[j];
    qsort(t_sorted, (size_t)m, sizeof(cand_t), by_x_desc);
    r->sorted = b;
    return 0;
}

/* The first `keep` candidates of the order (top-k's set): their mass (top-p's Zk: the full buckets'
 * sums, then the first ones of the bucket where it ends, in order), and in *last the last of
 * them (keep >= 1). -1 when out of memory. */
static double prefix_mass(ranking_t *r, int64_t n, int64_t keep, cand_t *last) {
    double mass = 0.0;
    int64_t pos = 0;
    int b = 0;
    while (pos + r->count[b] < keep) mass += r->mass[b], pos += r->count[b++];
    if (sort_bucket(r, n, b)) return -1.0;
    for (int64_t j = 0; j < keep - pos; j++) mass += (double)t_sorted[j].e;
    *last = t_sorted[keep - pos - 1];
    return mass;
}

/* Top-p within the first `keep` candidates: how many are kept, the first always and each next one
 * while the mass before it (in the order) is under `limit`; whole buckets are taken by their
 * sums while they stay under it, and the bucket where the walk may stop is sorted and walked
 * token by token. *last: the last kept candidate. -1 when out of memory. */
static int64_t nucleus(ranking_t *r, int64_t n, int64_t keep, double limit, cand_t *last) {
    double before = 0.0;
    int64_t pos = 0;
    for (int b = 0; b < NBUCKETS && pos < keep; b++) {
        const int64_t c = r->count[b], in = c < keep - pos ? c : keep - pos;
        if (c == 0) continue;
        if (pos + c < keep && before + r->mass[b] < limit) { /* all of it, and the walk goes on */
            before += r->mass[b], pos += c;
            continue;
        }
        if (sort_bucket(r, n, b)) return -1;
        int64_t j = 0;
        for (; j < in; j++) {
            if (pos + j > 0 && !(before < limit)) break;
            before += (double)t_sorted[j].e;
        }
        if (j > 0) *last = t_sorted[j - 1];
        if (j < in || pos + j == keep) return pos + j; /* stopped by top-p, or by top-k (in < c) */
        pos += j; /* the whole bucket was kept: on to the next */
    }
    return pos;
}

/* The candidates ranked at or before `last` in the x order (x larger, or equal with an id no
 * larger) whose e is at least min_e (min-p's cut: with top-k and top-p both on, the gathers may go
 * below it), in id order, into t_kept; returns how many, -1 when out of memory. t_cand holds them
 * as runs in id order (runs[r] .. runs[r + 1], one per gather): each run is filtered in place in
 * t_sorted (no longer needed), then the runs are merged pairwise. */
static int64_t kept_by_id(const int64_t *runs, int nruns, cand_t last, float min_e) {
    const int64_t n = runs[nruns];
    if (grow(&t_sorted, &t_sorted_cap, n) || grow(&t_kept, &t_kept_cap, n)) return -1;
    int64_t bounds[MAX_RUNS + 1], k = 0;
    for (int r = 0; r < nruns; r++) {
        bounds[r] = k;
        for (int64_t j = runs[r]; j < runs[r + 1]; j++) {
            const cand_t c = t_cand[j];
            if ((c.x > last.x || (c.x == last.x && c.id <= last.id)) && c.e >= min_e) t_sorted[k++] = c;
        }
    }
    bounds[nruns] = k;
    cand_t *src = t_sorted, *dst = t_kept;
    while (nruns > 1) {
        int out = 0;
        for (int r = 0; r < nruns; r += 2) {
            const int64_t a_end = bounds[r + 1], b_end = r + 1 < nruns ? bounds[r + 2] : a_end;
            int64_t a = bounds[r], b = a_end, o = bounds[r];
            while (a < a_end && b < b_end) dst[o++] = src[a].id < src[b].id ? src[a++] : src[b++];
            while (a < a_end) dst[o++] = src[a++];
            while (b < b_end) dst[o++] = src[b++];
            bounds[out++] = bounds[r];
        }
        bounds[out] = k;
        nruns = out;
        cand_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != t_kept) memcpy(t_kept, src, sizeof(cand_t) * (size_t)k);
    return k;
}

/* append the tokens with lo <= e < hi to the candidates (n so far); returns the new n, -1 when out
 * of memory */
static int64_t gather(const float *l, int64_t V, float T, float lo, float hi, int64_t n) {
    int64_t i0 = 0;
#if SAMPLING_AVX2
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
    for (; i0 + 8 <= V; i0 += 8) {
        const __m256 e = _mm256_loadu_ps(t_e + i0);
        unsigned mask = (unsigned)_mm256_movemask_ps(
            _mm256_and_ps(_mm256_cmp_ps(e, vlo, _CMP_GE_OQ), _mm256_cmp_ps(e, vhi, _CMP_LT_OQ)));
        while (mask) {
            const int j = __builtin_ctz(mask);
            mask &= mask - 1;
            if (n >= t_cand_cap && reserve_cand(n + 1)) return -1;
            t_cand[n].x = l[i0 + j] / T;
            t_cand[n].e = t_e[i0 + j];
            t_cand[n].id = (int32_t)(i0 + j);
            n++;
        }
    }
#endif
    for (int64_t i = i0; i < V; i++) {
        const float e = t_e[i];
        if (e >= lo && e < hi) {
            if (n >= t_cand_cap && reserve_cand(n + 1)) return -1;
            t_cand[n].x = l[i] / T;
            t_cand[n].e = e;
            t_cand[n].id = (int32_t)i;
            n++;
        }
    }
    return n;
}

/* One row's kept tokens under its filters (see the top of the file), in id order, into t_kept;
 * returns how many (0 only for a row without a token of e > 0: one with +inf, which the engine fails
 * before its draw), -1 when out of memory. Z: the row's mass (exp_pass). */
static int64_t kept_set(const float *l, int64_t V, float T, int32_t K, float P, float Mp, double Z) {
    const int top_k = K > 0 && K < V, top_p = P < 1.f, min_p = Mp > 0.f;
    float tau = min_p ? Mp : TAU0, hi = INFINITY;
    int64_t n = 0, runs[MAX_RUNS + 1];
    int nruns = 0;
    for (;;) {
        runs[nruns++] = n;
        n = gather(l, V, T, tau, hi, n);
        if (n < 0) return -1;
        const int full = tau <= 0.f; /* every token with e > 0 is a candidate */
        const int outside_by_k = top_k && n >= K, outside_by_minp = min_p && tau <= Mp;
        int outside_by_p = 0;
        if (top_p && !outside_by_k && !top_k) { /* the nucleus ends inside the candidates? */
            double mass = 0.0;
            for (int64_t j = 0; j < n; j++) mass += (double)t_cand[j].e;
            outside_by_p = mass >= (double)P * Z * (1.0 + 1e-9);
        }
        const int zk_known = !(top_p && top_k) || n >= K;
        if (full || ((outside_by_k || outside_by_minp || outside_by_p) && zk_known)) break;
        hi = tau;
        tau = tau * TAU_STEP < 0x1p-126f ? 0.f : tau * TAU_STEP;
        if (tau == 0.f) { /* the rest of e > 0 */
            runs[nruns++] = n;
            n = gather(l, V, T, 0x1p-149f, hi, n);
            if (n < 0) return -1;
            break;
        }
    }
    runs[nruns] = n;
    if (n == 0) return 0;
    if (!top_k && !top_p) { /* min-p alone: one gather, of e >= Mp, every candidate kept */
        const cand_t all = {-INFINITY, 0.f, INT32_MAX};
        return kept_by_id(runs, nruns, all, 0.f);
    }
    ranking_t *rk = &t_ranking;
    rank_candidates(rk, n);
    int64_t keep = top_k && n > K ? K : n;
    cand_t last = t_cand[0]; /* (set below: the last candidate kept) */
    double zk = Z;
    if (top_k) { /* the top-k set's mass (top-p's Zk) and its last */
        zk = prefix_mass(rk, n, keep, &last);
        if (zk < 0.0) return -1;
    }
    if (top_p) {
        keep = nucleus(rk, n, keep, (double)P * zk, &last);
        if (keep < 0) return -1;
    }
    return kept_by_id(runs, nruns, last, min_p ? Mp : 0.f);
}

/* one row with filters: the draw over kept_set's tokens; -1 when out of memory */
static int64_t filtered_row(const float *l, int64_t V, float T, int32_t K, float P, float Mp, double Z, float u,
                            int32_t *kept_out) {
    const int64_t keep = kept_set(l, V, T, K, P, Mp, Z);
    if (keep < 0) return -1;
    if (keep == 0) {
        if (kept_out) *kept_out = 1;
        return row_argmax(l, V, NULL);
    }
    if (kept_out) *kept_out = (int32_t)keep;
    double total = 0.0;
    for (int64_t j = 0; j < keep; j++) total += (double)t_kept[j].e;
    const double target = (double)u * total;
    double run = 0.0;
    int64_t fallback = t_kept[0].id;
    for (int64_t j = 0; j < keep; j++) {
        if (t_kept[j].e > 0.f) fallback = t_kept[j].id;
        run += (double)t_kept[j].e;
        if (run > target && t_kept[j].e > 0.f) return t_kept[j].id;
    }
    return fallback;
}

/* One token per row. rows: B addresses of float32 rows of V logits; temperature [B] (0: greedy);
 * top_k [B] (<= 0: off), top_p [B] (1: off), min_p [B] (0: off); u [B] uniform numbers in [0, 1);
 * tokens [B] out; kept [B] out or NULL: how many tokens the filters kept (V without filters, 1 for
 * greedy rows); finite [B] out or NULL: rows_finite's flags, found in the draw's first pass (the
 * engine's check before a step's draw, without a pass and a call of its own). Returns 0, or 1 when
 * out of memory. */
int sample_rows(const int64_t *rows, int64_t B, int64_t V, const float *temperature, const int32_t *top_k,
                const float *top_p, const float *min_p, const float *u, int64_t *tokens, int32_t *kept,
                uint8_t *finite) {
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) if (B > 1) reduction(| : failed)
    for (int64_t r = 0; r < B; r++) {
        const float *l = (const float *)(intptr_t)rows[r];
        const float T = temperature[r];
        if (T <= 0.f) { /* greedy: the first maximum, in one pass */
            tokens[r] = row_argmax(l, V, finite ? finite + r : NULL);
            if (kept) kept[r] = 1;
            continue;
        }
        const float mx = row_max(l, V, finite ? finite + r : NULL);
        if (mx == -INFINITY) { /* nothing left to draw from */
            tokens[r] = first_index_of(l, V, mx);
            if (kept) kept[r] = 1;
            continue;
        }
        if (reserve(V)) {
            failed = 1;
            continue;
        }
        const double Z = exp_pass(l, V, T, mx / T);
        const int filters = (top_k[r] > 0 && top_k[r] < V) || top_p[r] < 1.f || min_p[r] > 0.f;
        if (!filters) {
            tokens[r] = draw_all(V, Z, u[r]);
            if (kept) kept[r] = (int32_t)V;
            continue;
        }
        const int64_t t = filtered_row(l, V, T, top_k[r], top_p[r], min_p[r], Z, u[r], kept ? kept + r : NULL);
        if (t < 0) failed = 1;
        else tokens[r] = t;
    }
    return failed;
}

/* The kept tokens of B rows (rows: their addresses) under their filters, as sample_rows draws
 * from them: masks [B, V] out, 1 for a kept token and 0 for the others (a token of weight e = 0
 * is never kept). Rows with temperature 0 or no filter on are left as they are (the caller's);
 * a row without a token of e > 0 (+inf) keeps its first maximum. The sampler's whole
 * distributions (speculative verification, the draft's proposals, the inspector) take their
 * kept sets from here where PyTorch sorted the vocabulary (12-14 ms a row of 151936 on one core).
 * Returns 0, or 1 when out of memory. */
int kept_masks(const int64_t *rows, int64_t B, int64_t V, const float *temperature, const int32_t *top_k,
               const float *top_p, const float *min_p, uint8_t *masks) {
    int failed = 0;
    #pragma omp parallel for schedule(dynamic, 1) if (B > 1) reduction(| : failed)
    for (int64_t r = 0; r < B; r++) {
        const float *l = (const float *)(intptr_t)rows[r];
        const float T = temperature[r];
        const int filters = (top_k[r] > 0 && top_k[r] < V) || top_p[r] < 1.f || min_p[r] > 0.f;
        if (T <= 0.f || !filters) continue;
        uint8_t *mask = masks + r * V;
        memset(mask, 0, (size_t)V);
        const float mx = row_max(l, V, NULL);
        if (reserve(V)) {
            failed = 1;
            continue;
        }
        const int64_t keep = mx == -INFINITY ? 0 : kept_set(l, V, T, top_k[r], top_p[r], min_p[r], exp_pass(l, V, T, mx / T));
        if (keep < 0) failed = 1;
        else if (keep == 0) mask[row_argmax(l, V, NULL)] = 1;
        else
            for (int64_t j = 0; j < keep; j++) mask[t_kept[j].id] = 1;
    }
    return failed;
}

/* Whether each of B rows of V float32 logits (rows: their addresses) is free of NaN and infinity:
 * finite[r] = 1 or 0. One pass over the exponent bits (nonfinite1), in integers, so that the
 * compiler vectorizes it without reassociating floats; the engine's check before sampling where the
 * draw's own pass did not make it (`Sampler.finite_rows`), where PyTorch's sum, isfinite and copy back took 3-4 times as long on
 * a 151936-token row just written by the head. Rows over the threads: a batch of 64 Gemma 3 rows
 * (262144 tokens) is 64 MiB of logits, 9 ms a step on one core of a 2-core VM. */
void rows_finite(const int64_t *rows, int64_t B, int64_t V, uint8_t *finite) {
    #pragma omp parallel for schedule(static) if (B > 1)
    for (int64_t r = 0; r < B; r++) {
        const float *l = (const float *)(intptr_t)rows[r];
        uint32_t bad = 0;
        for (int64_t i = 0; i < V; i++) bad |= nonfinite1(l[i]);
        finite[r] = (uint8_t)!bad;
    }
}
