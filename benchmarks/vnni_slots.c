/* Which AVX-512 instructions compete with vpdpbusd for this CPU's execution slots: the ceiling
 * of kernels/qmatmul.c's prefill loop. Not part of nextoken; build and run by hand:
 *
 *     gcc -O2 -march=native benchmarks/vnni_slots.c -o /tmp/vnni_slots && /tmp/vnni_slots
 *
 * Each line runs 12 independent vpdpbusd chains (64-byte registers), alone or with a few other
 * instructions per 12 of them on independent registers, and prints the vpdpbusd rate (billions
 * per second, one thread). An instruction that leaves the rate where it is runs beside vpdpbusd;
 * one that lowers it takes its slot. On the AMD EPYC (Zen 4) VMs of this project (2026-11-25,
 * three runs; the clock moves from run to run): alone 3.3-3.5; with 4 vpand/vpsrlw, 4 vpaddd, 4
 * broadcasts from memory or 4 vcvtdq2ps per 12, 3.2-3.5 (beside it); with 2 vpmulld 2.8-3.0,
 * 4 vpmulld 2.3-2.7 and 4 vpmaddwd 2.5-2.7 (about one slot each: 12 / 16 of 3.5 is 2.6), 4 vfmadd
 * 1.8-2.4 (a slot each or more).
 * So qmatmul's K-quant loop (96 vpdpbusd per group of 32 columns at 6 rows x 2 tiles, plus 12
 * vpmulld for the group scales, 6 vpdpwssd for the mins and about 6 float multiplies per group
 * for the super-block scales) can reach at most about 80% of the vpdpbusd peak.
 */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define N 60000000LL /* vpdpbusd per measurement */
#define DP(a) a = _mm512_dpbusd_epi32(a, x, y);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static const char *NAMES[] = {"vpdpbusd alone", "+ 2 vpmulld", "+ 4 vpand/vpsrlw", "+ 4 vpaddd", "+ 4 vfmadd",
                              "+ 4 vpmulld", "+ 4 vpbroadcastd (memory)", "+ 4 vcvtdq2ps", "+ 4 vpmaddwd"};

static double run(int mode) {
    static int buf[64];
    for (int i = 0; i < 64; i++) buf[i] = i * 7;
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0,
            a9 = a0, a10 = a0, a11 = a0;
    __m512i x = _mm512_set1_epi32(0x01020304), y = _mm512_set1_epi32(0x05060708), z = _mm512_set1_epi32(3);
    __m512i b0 = _mm512_set1_epi32(7), b1 = _mm512_set1_epi32(9), b2 = _mm512_set1_epi32(11), b3 = _mm512_set1_epi32(13);
    const double t = now();
    for (long long i = 0; i < N / 12; i++) {
        DP(a0) DP(a1) DP(a2) DP(a3) DP(a4) DP(a5) DP(a6) DP(a7) DP(a8) DP(a9) DP(a10) DP(a11)
        switch (mode) {
        case 1: b0 = _mm512_mullo_epi32(b0, z); b1 = _mm512_mullo_epi32(b1, z); break;
        case 2:
            b0 = _mm512_and_si512(_mm512_srli_epi16(b0, 4), z); b1 = _mm512_and_si512(_mm512_srli_epi16(b1, 4), z);
            break;
        case 3:
            b0 = _mm512_add_epi32(b0, z); b1 = _mm512_add_epi32(b1, z);
            b2 = _mm512_add_epi32(b2, z); b3 = _mm512_add_epi32(b3, z);
            break;
        case 4: {
            const __m512 f = _mm512_castsi512_ps(z);
            b0 = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(b0), f, _mm512_castsi512_ps(b0)));
            b1 = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(b1), f, _mm512_castsi512_ps(b1)));
            b2 = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(b2), f, _mm512_castsi512_ps(b2)));
            b3 = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_castsi512_ps(b3), f, _mm512_castsi512_ps(b3)));
            break;
        }
        case 5:
            b0 = _mm512_mullo_epi32(b0, z); b1 = _mm512_mullo_epi32(b1, z);
            b2 = _mm512_mullo_epi32(b2, z); b3 = _mm512_mullo_epi32(b3, z);
            break;
        case 6:
            b0 = _mm512_add_epi32(b0, _mm512_set1_epi32(buf[i & 63])); b1 = _mm512_add_epi32(b1, _mm512_set1_epi32(buf[(i + 1) & 63]));
            b2 = _mm512_add_epi32(b2, _mm512_set1_epi32(buf[(i + 2) & 63])); b3 = _mm512_add_epi32(b3, _mm512_set1_epi32(buf[(i + 3) & 63]));
            break;
        case 7:
            b0 = _mm512_castps_si512(_mm512_cvtepi32_ps(b0)); b1 = _mm512_castps_si512(_mm512_cvtepi32_ps(b1));
            b2 = _mm512_castps_si512(_mm512_cvtepi32_ps(b2)); b3 = _mm512_castps_si512(_mm512_cvtepi32_ps(b3));
            break;
        case 8:
            b0 = _mm512_madd_epi16(b0, z); b1 = _mm512_madd_epi16(b1, z);
            b2 = _mm512_madd_epi16(b2, z); b3 = _mm512_madd_epi16(b3, z);
            break;
        }
        /* keep every chain in a register and every result live */
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7),
                         "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
        __asm__ volatile("" : "+v"(b0), "+v"(b1), "+v"(b2), "+v"(b3), "+v"(x), "+v"(y), "+v"(z));
    }
    const double dt = now() - t;
    __m512i s = _mm512_add_epi32(_mm512_add_epi32(a0, a11), _mm512_add_epi32(b0, b3));
    if (_mm512_reduce_add_epi32(s) == 42) puts(""); /* the sums are used */
    return N / dt / 1e9;
}

int main(void) {
    for (int mode = 0; mode < 9; mode++) {
        double best = 0.;
        for (int r = 0; r < 2; r++) {
            const double g = run(mode);
            best = g > best ? g : best;
        }
        printf("%-28s %.2f G vpdpbusd/s\n", NAMES[mode], best);
    }
    return 0;
}
