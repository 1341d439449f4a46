/* A whole decode step's decoder layers in one call: for M sequences that each bring one new token, run
 * every layer (norm, fused qkv projection, RoPE, cache write, paged attention, o projection, norm, gate||up,
 * SwiGLU, down) with the same native kernels the per-op path calls from Python, in the same order and
 * element type, so the results are identical; only the Python and dispatch cost between them (a few
 * microseconds per op, about a dozen ops per layer) is gone, and one OpenMP team runs the whole step
 * (barriers between the parts, instead of starting and joining a team for each of ~150 calls a step).
 *
 * Linears are described by llmopt_linear (dense, int4 or int8 tiles, see gemv.c); layers by llmopt_layer.
 */
#include <stdlib.h>
#include <string.h>

#include "llmopt.h"

typedef struct {
    llmopt_linear qkv, o, gate_up, down;
    const void *input_norm, *post_norm;
    const void *q_norm, *k_norm;  /* per head, before RoPE (Qwen3, Gemma 3); NULL: none */
    const void *attn_out_norm, *mlp_out_norm;  /* on each block's output before the residual add (Gemma); NULL: none */
    int64_t group;  /* its KV layer group: which llmopt_group of the step it reads */
    int64_t cache_slot;  /* its cache rows: kv + cache_slot * layer_stride */
} llmopt_layer;

typedef struct {
    const int64_t *slots;  /* [M] cache slots of the new tokens in this group's blocks */
    const int32_t *block_tables;  /* [M][bt_stride] */
    int64_t bt_stride;
    const void *cos_sin;  /* [M][head_dim] (elem): the RoPE of this group's layers */
    int64_t window;  /* keys a query sees (0: all) */
} llmopt_group;

/* Each row of x [rows][n], rows `stride` apart, RMS-normed in place (no residual). */
static void norm_rows(char *x, int64_t rows, int64_t stride, int64_t n, const void *w, float eps, int elem, int64_t es) {
    for (int64_t r = 0; r < rows; r++) llmopt_add_rms_norm_row(x + r * stride * es, NULL, w, x + r * stride * es, n, eps, elem);
}

/* Tiles of a GEMV whose x rows are in `scratch`, split over the team; returns when every thread's are done. */
static void gemv_team(const llmopt_linear *l, const void *scratch, int64_t m, void *y, int64_t ys, int elem) {
    int64_t t0, t1;
    llmopt_thread_slab(llmopt_gemv_tiles(l), &t0, &t1);
    llmopt_gemv_run(l, scratch, m, y, ys, elem, t0, t1);
#pragma omp barrier
}

/* residual [M][hidden]: in, the embeddings (layer 0's input, which is also its residual stream); out, the
 * residual stream after the last layer. out [M][hidden]: the last layer's MLP output (the final norm adds
 * it to the residual). groups: each KV layer group's slots, tables, RoPE and window; gelu: GeGLU, else SwiGLU;
 * kv: the cache, layer l's rows at kv + cache_slot * layer_stride elements, rows of 2 * kv_heads * head_dim.
 *
 * One OpenMP team runs the whole step: the row-wise small ops (and the preparation of the next GEMV's x
 * rows) are shared out by rows, each GEMV by tiles, attention by sequences or parts of their heads, with a
 * barrier between them, where a call per op would start and join the team about 150 times a step. */
int llmopt_decode_layers(const llmopt_layer *layers, int64_t num_layers, void *residual, void *out, int64_t m,
                         int elem, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t inter,
                         float eps, const llmopt_group *groups, int gelu, void *kv, int64_t layer_stride,
                         const int32_t *context_lens, int64_t block_size, float scale) {
    int64_t es = elem == 0 ? 4 : 2, q_size = heads * head_dim, kv_width = 2 * kv_heads * head_dim;
    int64_t qkv_n = q_size + kv_width;
    if (kv_heads <= 0 || heads % kv_heads || head_dim <= 0 || head_dim > 1024) return 1;
    size_t scratch_bytes = 0;
    for (int64_t l = 0; l < num_layers; l++) {
        const llmopt_linear *ls[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; i++) {
            if (llmopt_gemv_check(ls[i])) return 1;
            size_t bytes = llmopt_gemv_scratch(ls[i], m);
            scratch_bytes = bytes > scratch_bytes ? bytes : scratch_bytes;
        }
    }
    char *h = llmopt_alloc((size_t)(m * (hidden + qkv_n + q_size + 3 * inter) * es));
    void *scratch = llmopt_alloc(scratch_bytes);
    if (!h || !scratch) {
        free(h);
        free(scratch);
        return 2;
    }
    char *qkv = h + m * hidden * es, *att = qkv + m * qkv_n * es, *gu = att + m * q_size * es;
    char *act = gu + m * 2 * inter * es, *res = residual, *mlp = out;
    int failed = 0;
#pragma omp parallel
    for (int64_t l = 0; l < num_layers; l++) {
        const llmopt_layer *L = layers + l;
        const llmopt_group *G = groups + L->group;
        const char *cs = G->cos_sin;
        char *cache = (char *)kv + L->cache_slot * layer_stride * es;
        /* layer 0 normalises the embeddings; later ones first add the previous MLP output to the stream */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            char *row = h + t * hidden * es;
            llmopt_add_rms_norm_row(l ? mlp + t * hidden * es : res + t * hidden * es, l ? res + t * hidden * es : NULL,
                                    L->input_norm, row, hidden, eps, elem);
            llmopt_gemv_load_row(&L->qkv, row, elem, t, m, scratch);
        }
        gemv_team(&L->qkv, scratch, m, qkv, qkv_n, elem);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            char *row = qkv + t * qkv_n * es;
            if (L->q_norm) norm_rows(row, heads, head_dim, head_dim, L->q_norm, eps, elem, es);
            if (L->k_norm) norm_rows(row + q_size * es, kv_heads, head_dim, head_dim, L->k_norm, eps, elem, es);
            llmopt_rope_row(row, cs + t * head_dim * es, heads + kv_heads, head_dim, elem);
            memcpy(cache + G->slots[t] * kv_width * es, row + q_size * es, (size_t)(kv_width * es));
        }
        int rc = elem == 0
            ? llmopt_paged_decode_f32_team((const float *)qkv, qkv_n, (const float *)cache, kv_width, G->block_tables,
                                           G->bt_stride, context_lens, (float *)att, q_size, m, heads, kv_heads,
                                           head_dim, block_size, scale, G->window)
            : llmopt_paged_decode_bf16_team((const uint16_t *)qkv, qkv_n, (const uint16_t *)cache, kv_width,
                                            G->block_tables, G->bt_stride, context_lens, (uint16_t *)att, q_size, m,
                                            heads, kv_heads, head_dim, block_size, scale, G->window);
        if (rc) {
#pragma omp atomic write
            failed = rc;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) llmopt_gemv_load_row(&L->o, att + t * q_size * es, elem, t, m, scratch);
        gemv_team(&L->o, scratch, m, mlp, hidden, elem);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            char *row = h + t * hidden * es;
            if (L->attn_out_norm) norm_rows(mlp + t * hidden * es, 1, hidden, hidden, L->attn_out_norm, eps, elem, es);
            llmopt_add_rms_norm_row(mlp + t * hidden * es, res + t * hidden * es, L->post_norm, row, hidden, eps, elem);
            llmopt_gemv_load_row(&L->gate_up, row, elem, t, m, scratch);
        }
        gemv_team(&L->gate_up, scratch, m, gu, 2 * inter, elem);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; t++) {
            if (gelu) llmopt_gelu_tanh_mul_row(gu + t * 2 * inter * es, act + t * inter * es, inter, elem);
            else llmopt_silu_mul_row(gu + t * 2 * inter * es, act + t * inter * es, inter, elem);
            llmopt_gemv_load_row(&L->down, act + t * inter * es, elem, t, m, scratch);
        }
        gemv_team(&L->down, scratch, m, mlp, hidden, elem);
        if (L->mlp_out_norm) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; t++) norm_rows(mlp + t * hidden * es, 1, hidden, hidden, L->mlp_out_norm, eps, elem, es);
        }
    }
    free(h);
    free(scratch);
    return failed;
}
