/* The int8 multiply-add peak of this CPU on each instruction set nextoken's quantized matmul uses:
 * the ceiling its prefill loops are measured against (`python benchmarks/qmatmul.py --peak`
 * builds and runs it). Not part of nextoken; by hand:
 *
 *     gcc -O2 -march=native -fopenmp benchmarks/int8_peak.c -o /tmp/int8_peak && /tmp/int8_peak 2
 *
 * Each line runs one instruction kind on every thread (the argument; default 1), 12 independent
 * accumulators each, and prints billions of int8 multiply-adds per second for all threads:
 *   avx2       vpmaddubsw + vpaddw (u8 x s8 pairs summed in int16: 32 multiply-adds per pair of
 *              instructions), one activation broadcast from memory per two, as the AVX2 loop
 *   avxvnni    256-bit vpdpbusd (32 per instruction)
 *   avx512vnni 512-bit vpdpbusd (64 per instruction)
 *   amx        tdpbusd on 16 x 64 tiles (16384 per instruction), where the kernel grants the tile data
 * Only the kinds this build (-march) and CPU have are printed. Output lines: "<kind> <GMAC/s>".
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef __AMX_INT8__
#include "../nextoken/kernels/amx.h"
#endif

#define REPS 20000000LL /* inner iterations per thread (12 instructions each) */
#define KEEP(v) __asm__("" : "+x"(v))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static int sink;

/* twelve accumulators as named variables (an array of vectors stays in memory at -O2) */
#define DECL12(T, init) T a0 = init(0), a1 = init(1), a2 = init(2), a3 = init(3), a4 = init(4), a5 = init(5), \
    a6 = init(6), a7 = init(7), a8 = init(8), a9 = init(9), a10 = init(10), a11 = init(11)
#define EACH12(OP) OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7) OP(a8) OP(a9) OP(a10) OP(a11)

static void avx2(long reps) {
#define I16(i) _mm256_set1_epi16((short)(i))
    DECL12(__m256i, I16);
    const __m256i w0 = _mm256_set1_epi8(3), w1 = _mm256_set1_epi8(5);
    int8_t x[64];
    for (int i = 0; i < 64; i++) x[i] = (int8_t)i;
    for (long it = 0; it < reps; it++) {
        const int8_t *xr = x + (it & 7);
        int32_t v[6];
        memcpy(v, xr, sizeof v);
        /* one broadcast per two products, as the AVX2 loop's two halves of a tile */
#define PAIR(s, t, r)                                                   \
        {                                                               \
            const __m256i xb = _mm256_set1_epi32(v[r]);                 \
            s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w0, xb));      \
            t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w1, xb));      \
            KEEP(s);                                                    \
            KEEP(t);                                                    \
        }
        PAIR(a0, a1, 0) PAIR(a2, a3, 1) PAIR(a4, a5, 2) PAIR(a6, a7, 3) PAIR(a8, a9, 4) PAIR(a10, a11, 5)
    }
#define SINK16(a) sink += _mm256_extract_epi16(a, 0);
    EACH12(SINK16)
}

#ifdef __AVXVNNI__
static void avxvnni(long reps) {
#define I32(i) _mm256_set1_epi32(i)
    DECL12(__m256i, I32);
    const __m256i w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
#define DP256(a) a = _mm256_dpbusd_avx_epi32(a, w, x); KEEP(a);
    for (long it = 0; it < reps; it++) { EACH12(DP256) }
#define SINK32(a) sink += _mm256_extract_epi32(a, 0);
    EACH12(SINK32)
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512F__)
static void avx512vnni(long reps) {
#define I512(i) _mm512_set1_epi32(i)
    DECL12(__m512i, I512);
    const __m512i w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
#define DP512(a) a = _mm512_dpbusd_epi32(a, w, x); KEEP(a);
    for (long it = 0; it < reps; it++) { EACH12(DP512) }
#define SINK512(a) sink += _mm512_reduce_add_epi32(a);
    EACH12(SINK512)
}
#endif

#ifdef __AMX_INT8__
/* tiles 0-3 accumulate (16 x 16 int32), 4-5 hold A (16 x 64 bytes), 6-7 B: four independent
 * tdpbusd per iteration, as a 32 x 32 block of a GEMM */
static void amx(long reps) {
    static __thread int8_t buf[2][16 * 64];
    static __thread int32_t out[16 * 16];
    volatile amx_tilecfg_t cfg;
    memset((void *)&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig((const void *)&cfg);
    _tile_loadd(4, buf[0], 64);
    _tile_loadd(5, buf[1], 64);
    _tile_loadd(6, buf[0], 64);
    _tile_loadd(7, buf[1], 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (long it = 0; it < reps / 4; it++) {
        _tile_dpbusd(0, 4, 6);
        _tile_dpbusd(1, 4, 7);
        _tile_dpbusd(2, 5, 6);
        _tile_dpbusd(3, 5, 7);
    }
    _tile_stored(0, out, 64);
    _tile_release();
    sink += out[0];
}
#endif

/* run f on every thread at once, three times; the best rate in multiply-adds per second (billions)
 * for all of them (a shared VM's clock moves between runs) */
static double rate(void (*f)(long), long reps, double macs_per_rep) {
    f(reps / 20); /* warm-up: clocks up, AMX state granted */
    double best = 0;
    for (int r = 0; r < 3; r++) {
        double t = now();
#pragma omp parallel
        f(reps);
        t = now() - t;
        const double v = macs_per_rep * reps * omp_get_max_threads() / t / 1e9;
        if (v > best) best = v;
    }
    return best;
}

int main(int argc, char **argv) {
    const int threads = argc > 1 ? atoi(argv[1]) : 1;
    omp_set_num_threads(threads > 0 ? threads : 1);
    printf("avx2 %.1f\n", rate(avx2, REPS, 12 * 32.0));
#ifdef __AVXVNNI__
    printf("avxvnni %.1f\n", rate(avxvnni, REPS, 12 * 32.0));
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
    printf("avx512vnni %.1f\n", rate(avx512vnni, REPS, 12 * 64.0));
#endif
#ifdef __AMX_INT8__
    if (amx_ready()) printf("amx %.1f\n", rate(amx, REPS / 4, 16384.0));
#endif
    return sink == 12345 ? 1 : 0;
}
