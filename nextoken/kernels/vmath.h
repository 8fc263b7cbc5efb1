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
#endif
