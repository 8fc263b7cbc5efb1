/* Paged decode attention: one new query token per sequence, keys and values read in place from
 * the paged KV cache (no gather copy). nextoken's own kernel; the reference it must match is
 * nextoken.layers.attention.paged_attention_reference.
 *
 * Layouts (row-major, as PyTorch hands them over):
 *   q          [B, H, D]               the new tokens' queries
 *   k/v cache  [Hkv, NB, BS, D]        one layer, head-major
 *   tables     [B, max_blocks] int64   block table of each sequence
 *   seq_lens   [B] int64               keys per sequence (including the new token's)
 *   out        [B, H, D]
 * For each (sequence, KV head) task: scores s = q.k * scale for every key, softmax in float32,
 * out = sum p v. The G = H / Hkv query heads of a KV head share each key and value read (GQA).
 * Tasks run in parallel over OpenMP (the runtime PyTorch already loaded, same soname).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"


typedef union { uint32_t u[256]; float f[256]; } row_t; /* one key or value row in float32 */

#define DEFINE_KERNEL(NAME, T, ELEM, LOAD, STORE)                                                        \
int NAME(const T *q, const T *kc, const T *vc, const int64_t *tables, int64_t max_blocks,           \
         const int64_t *seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t NB,         \
         int64_t BS, float scale, T *out) {                                                         \
    const int64_t G = H / Hkv;                                                                      \
    int failed = 0;                                                                                 \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1)")                                    \
    for (int64_t b = 0; b < B; b++) {                                                               \
        for (int64_t h = 0; h < Hkv; h++) {                                                         \
            const int64_t S = seq_lens[b];                                                          \
            float *qf = malloc(sizeof(float) * (G * D + G * S + G * D));                            \
            if (!qf) { failed = 1; continue; }                                                      \
            float *sc = qf + G * D, *acc = sc + G * S;                                              \
            for (int64_t g = 0; g < G; g++)                                                         \
                for (int64_t d = 0; d < D; d++)                                                     \
                    qf[g * D + d] = ELEM(q[(b * H + h * G + g) * D + d]) * scale;                   \
            float mx[64];                                                                           \
            for (int64_t g = 0; g < G; g++) mx[g] = -INFINITY;                                      \
            for (int64_t t = 0; t < S; t++) {                                                       \
                const int64_t blk = tables[b * max_blocks + t / BS];                                \
                const T *kp = kc + ((h * NB + blk) * BS + t % BS) * D;                              \
                row_t kr;                                                                           \
                LOAD(kr, kp, D);                                                                    \
                const float *kf = kr.f;                                                             \
                for (int64_t g = 0; g < G; g++) {                                                   \
                    float s = 0.f;                                                                  \
                    const float *qg = qf + g * D;                                                   \
                    _Pragma("omp simd reduction(+:s)")                                              \
                    for (int64_t d = 0; d < D; d++) s += qg[d] * kf[d];                             \
                    sc[g * S + t] = s;                                                              \
                    if (s > mx[g]) mx[g] = s;                                                       \
                }                                                                                   \
            }                                                                                       \
            for (int64_t g = 0; g < G; g++) {                                                       \
                float sum = 0.f;                                                                    \
                for (int64_t t = 0; t < S; t++) {                                                   \
                    float e = expf(sc[g * S + t] - mx[g]);                                          \
                    sc[g * S + t] = e;                                                              \
                    sum += e;                                                                       \
                }                                                                                   \
                const float inv = 1.f / sum;                                                        \
                for (int64_t t = 0; t < S; t++) sc[g * S + t] *= inv;                               \
            }                                                                                       \
            memset(acc, 0, sizeof(float) * G * D);                                                  \
            for (int64_t t = 0; t < S; t++) {                                                       \
                const int64_t blk = tables[b * max_blocks + t / BS];                                \
                const T *vp = vc + ((h * NB + blk) * BS + t % BS) * D;                              \
                row_t vr;                                                                           \
                LOAD(vr, vp, D);                                                                    \
                const float *vf = vr.f;                                                             \
                for (int64_t g = 0; g < G; g++) {                                                   \
                    const float p = sc[g * S + t];                                                  \
                    float *ag = acc + g * D;                                                        \
                    _Pragma("omp simd")                                                             \
                    for (int64_t d = 0; d < D; d++) ag[d] += p * vf[d];                             \
                }                                                                                   \
            }                                                                                       \
            for (int64_t g = 0; g < G; g++)                                                         \
                for (int64_t d = 0; d < D; d++)                                                     \
                    out[(b * H + h * G + g) * D + d] = STORE(acc[g * D + d]);                       \
            free(qf);                                                                               \
        }                                                                                           \
    }                                                                                               \
    return failed;                                                                                  \
}

#define ELEM_F32(x) (x)
#define LOAD_F32(row, src, n) memcpy((row).f, (src), sizeof(float) * (n))
#define STORE_F32(x) (x)
/* bf16 is the top half of a float32: widen a row with shifts the compiler vectorizes */
#define LOAD_BF16(row, src, n) for (int64_t i_ = 0; i_ < (n); i_++) (row).u[i_] = ((uint32_t)(src)[i_]) << 16
DEFINE_KERNEL(paged_decode_f32, float, ELEM_F32, LOAD_F32, STORE_F32)
DEFINE_KERNEL(paged_decode_bf16, uint16_t, bf16_to_f32, LOAD_BF16, f32_to_bf16)

/* Limits the caller checks before calling: head_dim <= 256, query heads per KV head <= 64. */
int paged_decode_max_head_dim(void) { return 256; }
int paged_decode_max_group(void) { return 64; }
