/* Expand int4 weights to bf16 for one large matmul (prefill, big batches). nextoken's own
 * kernel; the reference it must match is nextoken.layers.quant_linear.int4_unpack.
 *
 *   packed           [N, K/2] uint8, PyTorch's CPU int4 layout: rows in blocks of 64; for block
 *                    b, column k and j < 32, byte [b, k, j] holds row 64b + j (low nibble)
 *                    and row 64b + 32 + j (high nibble)
 *   scales_and_zeros [K/32, N, 2] bf16: W[n, k] = (q - 8) * scale[k/32, n] + zero[k/32, n]
 *   out_t            [K, N] bf16: W transposed, ready for x @ W^T
 * The arithmetic is done in float32 and rounded once to bf16 (PyTorch's eager expansion
 * rounds after each bf16 operation; the two agree to within a bf16 rounding step).
 */
#include <stdint.h>
#include <string.h>

#include "bf16.h"


void int4_unpack_bf16(const uint8_t *packed, const uint16_t *sz, int64_t N, int64_t K, uint16_t *out_t) {
    /* out_t is W transposed, [K, N]: each 64-row block's bytes [k][j] are read in order and
     * written to 64 consecutive entries of row k, so loads and stores are both contiguous */
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < N / 64; b++) {
        const uint8_t *src = packed + b * K * 32;
        float s[64], z[64];
        for (int64_t k = 0; k < K; k++) {
            if (k % 32 == 0) {
                const uint16_t *g = sz + ((k / 32) * N + b * 64) * 2;
                for (int64_t r = 0; r < 64; r++) {
                    s[r] = bf16_to_f32(g[2 * r]);
                    z[r] = bf16_to_f32(g[2 * r + 1]) - 8.f * s[r];
                }
            }
            uint16_t *dst = out_t + k * N + b * 64;
#pragma omp simd
            for (int64_t j = 0; j < 32; j++) {
                const uint8_t byte = src[k * 32 + j];
                dst[j] = f32_to_bf16((float)(byte & 15) * s[j] + z[j]);
                dst[32 + j] = f32_to_bf16((float)(byte >> 4) * s[32 + j] + z[32 + j]);
            }
        }
    }
}
