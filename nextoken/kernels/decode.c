/* The decoder layers of a Llama-style model for a batch of single-token decodes, in one call.
 * nextoken's own kernel; the reference it must match is the model's PyTorch forward
 * (nextoken.models.llama.LlamaDecoderLayer with qweight linears), step by step, with the
 * same bf16 roundings at the same points:
 *
 *   for each layer:
 *     x  = bf16(w_attn * bf16(h * rsqrt(mean(h^2) + eps)))          RMSNorm
 *     q, k, v = x Wq^T + bq, x Wk^T + bk, x Wv^T + bv                (qmatmul, one quantization of x)
 *     q, k = bf16(bf16(r cos) + bf16(rot(r) sin)), rot(a, b) = (-b, a) RoPE, rotate-half pairs
 *     cache[slot] = k, v ;  a = softmax(q K^T * scale) V              (paged_attention.c)
 *       (an int8 cache stores each head's row as codes and a scale: quantize_row_i8)
 *     h  = bf16(h + a Wo^T)
 *     x  = RMSNorm(h) with w_ffn ;  h = bf16(h + bf16(bf16(silu(x Wg^T)) * x Wu^T) Wd^T)
 *       (SwiGLU: activation.c's kernel, which rounds as the PyTorch layers do)
 *
 * h: [T, hidden] bf16, updated in place. Token i is the one new token of sequence i, at
 * positions[i], written to slots[i], attending to seq_lens[i] keys through row i of tables.
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
} layer_t;

/* one row of D bf16 values -> int8 codes and their scale, the same float32 operations as
 * nextoken.kv_cache.tensors.quantize_rows: scale = amax / 127, code = rint(x * (127 / amax)) */
static void quantize_row_i8(const uint16_t *x, int64_t D, int8_t *codes, float *scale) {
    float amax = 0.f;
    for (int64_t i = 0; i < D; i++) amax = fmaxf(amax, fabsf(bf16_to_f32(x[i])));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t i = 0; i < D; i++) {
        const float c = nearbyintf(bf16_to_f32(x[i]) * inv);
        codes[i] = (int8_t)(c > 127.f ? 127.f : c < -127.f ? -127.f : c);
    }
    *scale = amax / 127.f;
}

/* `rows` rows of D bf16 values -> codes [rows, D] and scales [rows] (for the test against
 * quantize_rows) */
void kv_quantize_rows(const uint16_t *x, int64_t rows, int64_t D, int8_t *codes, float *scales) {
    for (int64_t r = 0; r < rows; r++) quantize_row_i8(x + r * D, D, codes + r * D, scales + r);
}

/* token t's key and value rows of every KV head into the cache at `slot` */
static void write_kv(const layer_t *ly, const uint16_t *k, const uint16_t *v, int64_t slot, int64_t Hkv, int64_t D,
                     int64_t NB, int64_t BS) {
    const int64_t blk = slot / BS, off = slot % BS;
    for (int64_t hh = 0; hh < Hkv; hh++) {
        const int64_t row = (hh * NB + blk) * BS + off;
        if (ly->k_scale) {
            quantize_row_i8(k + hh * D, D, (int8_t *)ly->k_cache + row * D, ly->k_scale + row);
            quantize_row_i8(v + hh * D, D, (int8_t *)ly->v_cache + row * D, ly->v_scale + row);
        } else {
            memcpy((uint16_t *)ly->k_cache + row * D, k + hh * D, sizeof(uint16_t) * D);
            memcpy((uint16_t *)ly->v_cache + row * D, v + hh * D, sizeof(uint16_t) * D);
        }
    }
}

/* y = x W^T for x [T, K] bf16, with x quantized once per activation block size (32, or 256 for the
 * super-block formats: qw_act_block) and that quantization shared by the weights that take it:
 * qa[0] for 32 columns, qa[1] for 256 (NULL q: not yet quantized). 0, or 1 when out of memory. */
static int apply(const uint16_t *x, int64_t T, const qw_t *w, qact_t qa[2], uint16_t *y) {
    if (w->bits == 16) return dense_bf16_matmul(x, 1, T, w, y, 1, w->N); /* dense bf16: no quantization */
    const int64_t QB = qw_act_block(w);
    qact_t *a = &qa[QB != 32];
    if (!a->q && quantize(x, 1, T, w->K, QB, a)) return 1;
    qmatmul_q(a, w, y, 1, w->N);
    return 0;
}

/* apply for weights that share x (q, k, v; gate, up): dense bf16 ones in one pass over all their
 * rows (dense_bf16_multi), else one by one */
static int apply_n(const uint16_t *x, int64_t T, const qw_t *const *ws, int n, qact_t qa[2], uint16_t *const *ys) {
    int dense = 1;
    for (int i = 0; i < n; i++) dense &= ws[i]->bits == 16;
    if (dense) return dense_bf16_multi(x, 1, T, ws, n, (void *const *)ys, 1, NULL);
    for (int i = 0; i < n; i++)
        if (apply(x, T, ws[i], qa, ys[i])) return 1;
    return 0;
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

int decode_layers(const layer_t *layers, int64_t L, uint16_t *h, int64_t T, int64_t hidden, int64_t H,
                  int64_t Hkv, int64_t D, int64_t rope_dim, const float *inv_freq, const int64_t *positions,
                  const int64_t *slots, const int64_t *tables, int64_t max_blocks, const int64_t *seq_lens,
                  int64_t NB, int64_t BS, float eps, float scale) {
    if (rope_dim > 512 || rope_dim > D || D > 256 || H % Hkv != 0 || H / Hkv > 64) return 2;
    for (int64_t l = 0; l < L; l++) {
        const layer_t *ly = layers + l;
        const qw_t *ws[7] = {&ly->q, &ly->k, &ly->v, &ly->o, &ly->gate, &ly->up, &ly->down};
        for (int i = 0; i < 7; i++)
            if (!qw_ok(ws[i])) return 2;
    }
    const int64_t inter = layers[0].gate.N, qd = H * D, kd = Hkv * D;
    uint16_t *buf = malloc(sizeof(uint16_t) * T * (hidden + qd + 2 * kd + qd + 2 * inter + hidden));
    float *cs = malloc(sizeof(float) * T * rope_dim * 2);
    if (!buf || !cs) { free(buf); free(cs); return 1; }
    uint16_t *x = buf, *q = x + T * hidden, *k = q + T * qd, *v = k + T * kd, *att = v + T * kd;
    uint16_t *g = att + T * qd, *u = g + T * inter, *o = u + T * inter;
    float *sn = cs + T * rope_dim;
    for (int64_t t = 0; t < T; t++) /* cos/sin once per call, as the PyTorch path: f32, then bf16 */
        for (int64_t i = 0; i < rope_dim; i++) {
            const float ang = (float)positions[t] * inv_freq[i % (rope_dim / 2)];
            cs[t * rope_dim + i] = rb(cosf(ang));
            sn[t * rope_dim + i] = rb(sinf(ang));
        }
    int rc = 0;
    for (int64_t l = 0; l < L && rc == 0; l++) {
        const layer_t *ly = layers + l;
        qact_t qa[2] = {{0}, {0}};
        rms_norm_rows_bf16(h, ly->attn_norm, T, hidden, eps, x);
        const qw_t *qkv[3] = {&ly->q, &ly->k, &ly->v}, *gu[2] = {&ly->gate, &ly->up};
        uint16_t *qkv_out[3] = {q, k, v}, *gu_out[2] = {g, u};
        rc = apply_n(x, T, qkv, 3, qa, qkv_out);
        qacts_free(qa);
        if (rc) break;
        for (int64_t t = 0; t < T; t++) {
            rope_bf16(q + t * qd, H, D, rope_dim, cs + t * rope_dim, sn + t * rope_dim);
            rope_bf16(k + t * kd, Hkv, D, rope_dim, cs + t * rope_dim, sn + t * rope_dim);
            write_kv(ly, k + t * kd, v + t * kd, slots[t], Hkv, D, NB, BS);
        }
        const int failed = ly->k_scale
            ? paged_decode_int8(q, ly->k_cache, ly->v_cache, ly->k_scale, ly->v_scale, tables, max_blocks, seq_lens, T,
                                H, Hkv, D, NB, BS, scale, att)
            : paged_decode_bf16(q, ly->k_cache, ly->v_cache, tables, max_blocks, seq_lens, T, H, Hkv, D, NB, BS,
                                scale, att);
        if (failed) { rc = 1; break; }
        rc = apply(att, T, &ly->o, qa, o);
        qacts_free(qa);
        if (rc) break;
        for (int64_t i = 0; i < T * hidden; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(o[i]));
        rms_norm_rows_bf16(h, ly->ffn_norm, T, hidden, eps, x);
        rc = apply_n(x, T, gu, 2, qa, gu_out);
        qacts_free(qa);
        if (rc) break;
        silu_mul_bf16(g, u, g, T * inter); /* a scalar expf loop took 46 us of Qwen-1.5B's layer */
        rc = apply(g, T, &ly->down, qa, o);
        qacts_free(qa);
        if (rc) break;
        for (int64_t i = 0; i < T * hidden; i++) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(o[i]));
    }
    free(buf);
    free(cs);
    return rc;
}
