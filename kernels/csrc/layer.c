/* A whole decode step's decoder layers in one call: for M sequences that each bring one new token, run
 * every layer (norm, fused qkv projection, RoPE, cache write, paged attention, o projection, norm, gate||up,
 * SwiGLU, down) with the same native kernels the per-op path calls from Python, in the same order and
 * element type, so the results are identical; only the Python and dispatch cost between them (a few
 * microseconds per op, about a dozen ops per layer) is gone.
 *
 * Linears are described by llmopt_linear (dense, int4 or int8 tiles, see gemv.c); layers by llmopt_layer.
 */
#include <stdlib.h>
#include <string.h>

#include "llmopt.h"

typedef struct {
    int64_t kind; /* 0: dense tiles (welem 0 fp32 / 1 bf16); 1: int4; 2: int8 */
    int64_t welem;
    const void *weight; /* tiles, or packed int4 */
    const float *scales;
    const uint8_t *zeros;
    int64_t group;
    const float *bias;
    int64_t n, k;
} llmopt_linear;

typedef struct {
    llmopt_linear qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
} llmopt_layer;

static int linear(const llmopt_linear *l, const void *x, int64_t xs, void *y, int64_t ys, int elem, int64_t m) {
    if (l->kind == 0) return llmopt_gemv_dense(x, xs, l->weight, (int)l->welem, l->bias, y, ys, elem, m, l->n, l->k);
    if (l->kind == 1)
        return llmopt_gemv_w4(x, xs, l->weight, l->scales, l->zeros, l->group, l->bias, y, ys, elem, m, l->n, l->k);
    return llmopt_gemv_w8(x, xs, l->weight, l->scales, (const int8_t *)l->zeros, l->group, l->bias, y, ys, elem, m,
                          l->n, l->k);
}

/* residual [M][hidden]: in, the embeddings (layer 0's input, which is also its residual stream); out, the
 * residual stream after the last layer. out [M][hidden]: the last layer's MLP output (the final norm adds
 * it to the residual). cos_sin [M][head_dim] (elem); slots [M] int64 cache slots of the new tokens;
 * kv: the cache, layer l's rows at kv + l * layer_stride elements, rows of 2 * kv_heads * head_dim. */
int llmopt_decode_layers(const llmopt_layer *layers, int64_t num_layers, void *residual, void *out, int64_t m,
                         int elem, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                         float eps, const void *cos_sin, const int64_t *slots, void *kv, int64_t layer_stride,
                         const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                         int64_t block_size, float scale) {
    int64_t es = elem == 0 ? 4 : 2, q_size = heads * head_dim, kv_width = 2 * kv_heads * head_dim;
    int64_t qkv_n = q_size + kv_width;
    char *h = llmopt_alloc((size_t)(m * (hidden + qkv_n + q_size + 3 * inter) * es));
    if (!h) return 2;
    char *qkv = h + m * hidden * es, *att = qkv + m * qkv_n * es, *gu = att + m * q_size * es;
    char *act = gu + m * 2 * inter * es;
    int rc = 0;
    for (int64_t l = 0; l < num_layers && !rc; l++) {
        const llmopt_layer *L = layers + l;
        char *cache = (char *)kv + l * layer_stride * es;
        /* layer 0 normalises the embeddings; later ones first add the previous MLP output to the stream */
        rc |= llmopt_add_rms_norm(l ? out : residual, hidden, l ? residual : NULL, hidden, L->input_norm, h, hidden,
                                  m, hidden, eps, elem);
        rc |= linear(&L->qkv, h, hidden, qkv, qkv_n, elem, m);
        rc |= llmopt_rope(qkv, qkv_n, cos_sin, head_dim, m, heads + kv_heads, head_dim, elem);
        for (int64_t t = 0; t < m; t++)
            memcpy(cache + slots[t] * kv_width * es, qkv + (t * qkv_n + q_size) * es, (size_t)(kv_width * es));
        if (elem == 0)
            rc |= llmopt_paged_decode_f32((const float *)qkv, qkv_n, (const float *)cache, kv_width, block_tables,
                                          bt_stride, context_lens, (float *)att, q_size, m, heads, kv_heads, head_dim,
                                          block_size, scale);
        else
            rc |= llmopt_paged_decode_bf16((const uint16_t *)qkv, qkv_n, (const uint16_t *)cache, kv_width,
                                           block_tables, bt_stride, context_lens, (uint16_t *)att, q_size, m, heads,
                                           kv_heads, head_dim, block_size, scale);
        rc |= linear(&L->o, att, q_size, out, hidden, elem, m);
        rc |= llmopt_add_rms_norm(out, hidden, residual, hidden, L->post_norm, h, hidden, m, hidden, eps, elem);
        rc |= linear(&L->gate_up, h, hidden, gu, 2 * inter, elem, m);
        rc |= llmopt_silu_mul(gu, 2 * inter, act, inter, m, inter, elem);
        rc |= linear(&L->down, act, inter, out, hidden, elem, m);
    }
    free(h);
    return rc;
}
