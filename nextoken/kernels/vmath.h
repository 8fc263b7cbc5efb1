/* Vector math shared by nextoken's AVX-512 kernels. */
#ifndef NEXTOKEN_VMATH_H
#define NEXTOKEN_VMATH_H
#ifdef __AVX512F__
#include <immintrin.h>

/* e^x, 16 lanes: x = k ln 2 + f with |f| <= ln 2 / 2 (ln 2 split in two for an exact k ln 2), e^f by
 * its degree-7 Taylor polynomial (relative error under 2e-7), times 2^k by scalef, which overflows
 * to inf and underflows to 0 cleanly (so any x, e.g. x - max of a row for a softmax). */
static inline __m512 exp16(__m512 x) {
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x); /* ln 2 = 0.693359375 - 2.12194440e-4 */
    f = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, k);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
/* e^x, 8 lanes: exp16's reduction and polynomial, and its result: 2^k applied as two exact
 * powers of two (k split in halves, each a normal float for |k| <= 252), so one rounding, as
 * scalef's, for x within +-174 (callers clamp further). */
static inline __m256 exp8(__m256 x) {
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    f = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), f);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.f));
    const __m256i ki = _mm256_cvtps_epi32(k), k1 = _mm256_srai_epi32(ki, 1), k2 = _mm256_sub_epi32(ki, k1);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
}
#endif
#endif
