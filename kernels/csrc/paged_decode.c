/* Paged attention for decode on CPU: one new query token per sequence, keys and values read in
 * place from the paged KV cache (no gather copy), each cached row read once.
 *
 * Cache rows (one layer): kv[slot] = K[Hk][D] || V[Hk][D], slot = block * block_size + offset,
 * row_stride elements apart. q and out: [B][Hq][D] with q_stride / out_stride elements between
 * tokens; query head i uses kv head i / (Hq / Hk) (GQA). One work item per sequence (threads take
 * them dynamically). Per-thread scratch: scores [Hq][block_size], scaled q and accumulators [Hq][D].
 * Head dims 64 and 128 have unrolled copies; others (up to 1024) take a generic one.
 * Arithmetic in fp32 for both element types.
 *
 * Built at first use by llmopt.kernels.cpu_native (gcc -O3 -march=native -fopenmp); OpenMP
 * resolves to the libgomp torch has loaded, so both share one thread pool and thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "llmopt.h"

static inline float bf16_load(uint16_t h) { return llmopt_bf16_to_f32(h); }
static inline uint16_t bf16_store(float f) { return llmopt_f32_to_bf16(f); }

/* One sequence: out[Hq][DIM] from its context, one cache block at a time (online softmax): the
 * block's K rows give its scores, the running maxima rescale what was accumulated, then its V rows
 * are added while the block is still in cache, so each row comes from memory once. DIM is a
 * literal in the specialised copies, so the dot products and updates unroll into whole vectors. */
#define DEFINE_SEQUENCE(NAME, T, LOAD, STORE, DIM)                                                       \
static void NAME(const T *qr, const T *kv, int64_t row_stride, const int32_t *table, int64_t ctx,      \
                 T *orow, int64_t hq, int64_t hk, int64_t dim_arg, int64_t block_size, float scale,     \
                 float *scores, float *qv, float *acc) {                                                \
    const int64_t dim = DIM, group = hq / hk;                                                          \
    float mx[hq], sum[hq];                                                                             \
    (void)dim_arg;                                                                                     \
    for (int64_t i = 0; i < hq * dim; i++) { qv[i] = LOAD(qr[i]) * scale; acc[i] = 0.f; }              \
    for (int64_t i = 0; i < hq; i++) { mx[i] = -INFINITY; sum[i] = 0.f; }                              \
    for (int64_t t0 = 0; t0 < ctx; t0 += block_size) {                                                 \
        const T *block = kv + (int64_t)table[t0 / block_size] * block_size * row_stride;               \
        const int64_t n = ctx - t0 < block_size ? ctx - t0 : block_size;                                \
        if (t0 + block_size < ctx) { /* blocks are scattered: hardware prefetch stops at each page */  \
            const int64_t left = ctx - t0 - block_size;                                                \
            const char *next = (const char *)(kv + (int64_t)table[t0 / block_size + 1] * block_size * row_stride); \
            const int64_t bytes = (left < block_size ? left : block_size) * row_stride * (int64_t)sizeof(T); \
            for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, 3);         \
        }                                                                                              \
        for (int64_t o = 0; o < n; o++)                                                                \
            for (int64_t h = 0; h < hk; h++) {                                                         \
                const T *k = block + o * row_stride + h * dim;                                         \
                float kf[DIM > 0 ? DIM : 1024] __attribute__((aligned(64)));                           \
                for (int64_t d = 0; d < dim; d++) kf[d] = LOAD(k[d]);                                  \
                for (int64_t j = 0; j < group; j++) {                                                  \
                    const float *qi = qv + (h * group + j) * dim;                                      \
                    float s = 0.f;                                                                     \
                    for (int64_t d = 0; d < dim; d++) s += qi[d] * kf[d];                              \
                    scores[(h * group + j) * block_size + o] = s;                                      \
                }                                                                                      \
            }                                                                                          \
        for (int64_t i = 0; i < hq; i++) {                                                             \
            float *si = scores + i * block_size, m = mx[i];                                            \
            for (int64_t o = 0; o < n; o++) m = si[o] > m ? si[o] : m;                                 \
            const float rescale = expf(mx[i] - m);                                                     \
            float z = 0.f;                                                                             \
            for (int64_t o = 0; o < n; o++) { si[o] = expf(si[o] - m); z += si[o]; }                  \
            sum[i] = sum[i] * rescale + z;                                                             \
            mx[i] = m;                                                                                 \
            if (rescale != 1.f)                                                                        \
                for (int64_t d = 0; d < dim; d++) acc[i * dim + d] *= rescale;                         \
        }                                                                                              \
        for (int64_t o = 0; o < n; o++)                                                                \
            for (int64_t h = 0; h < hk; h++) {                                                         \
                const T *v = block + o * row_stride + (hk + h) * dim;                                  \
                float vf[DIM > 0 ? DIM : 1024] __attribute__((aligned(64)));                           \
                for (int64_t d = 0; d < dim; d++) vf[d] = LOAD(v[d]);                                  \
                for (int64_t j = 0; j < group; j++) {                                                  \
                    float *a = acc + (h * group + j) * dim;                                            \
                    const float p = scores[(h * group + j) * block_size + o];                          \
                    for (int64_t d = 0; d < dim; d++) a[d] += p * vf[d];                               \
                }                                                                                      \
            }                                                                                          \
    }                                                                                                  \
    for (int64_t i = 0; i < hq; i++) {                                                                 \
        const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;                                           \
        for (int64_t d = 0; d < dim; d++) orow[i * dim + d] = STORE(acc[i * dim + d] * inv);           \
    }                                                                                                  \
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                            \
DEFINE_SEQUENCE(NAME##_d64, T, LOAD, STORE, 64)                                                        \
DEFINE_SEQUENCE(NAME##_d128, T, LOAD, STORE, 128)                                                      \
DEFINE_SEQUENCE(NAME##_any, T, LOAD, STORE, dim_arg)                                                   \
int NAME(const T *q, int64_t q_stride, const T *kv, int64_t row_stride, const int32_t *block_tables,   \
         int64_t bt_stride, const int32_t *context_lens, T *out, int64_t out_stride, int64_t num_seqs, \
         int64_t hq, int64_t hk, int64_t dim, int64_t block_size, float scale) {                     \
    if (hk <= 0 || hq % hk || dim <= 0 || dim > 1024) return 1;                                        \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel")                                                                            \
    {                                                                                                  \
        float *scores = llmopt_alloc(sizeof(float) * (size_t)(hq * block_size + 2 * hq * dim));              \
        if (!scores) {                                                                                 \
            _Pragma("omp atomic write") failed = 2;                                                    \
        }                                                                                              \
        _Pragma("omp for schedule(dynamic, 1)")                                                        \
        for (int64_t b = 0; b < num_seqs; b++) {                                                       \
            if (!scores) continue;                                                                     \
            float *qv = scores + hq * block_size, *acc = qv + hq * dim;                                \
            const T *qr = q + b * q_stride;                                                            \
            const int32_t *table = block_tables + b * bt_stride;                                       \
            T *orow = out + b * out_stride;                                                            \
            if (dim == 64)                                                                             \
                NAME##_d64(qr, kv, row_stride, table, context_lens[b], orow, hq, hk, dim, block_size,  \
                           scale, scores, qv, acc);                                              \
            else if (dim == 128)                                                                       \
                NAME##_d128(qr, kv, row_stride, table, context_lens[b], orow, hq, hk, dim, block_size, \
                            scale, scores, qv, acc);                                             \
            else                                                                                       \
                NAME##_any(qr, kv, row_stride, table, context_lens[b], orow, hq, hk, dim, block_size,  \
                           scale, scores, qv, acc);                                              \
        }                                                                                              \
        free(scores);                                                                                  \
    }                                                                                                  \
    return failed;                                                                                     \
}

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_DECODE(llmopt_paged_decode_f32, float, F32_LOAD, F32_STORE)
DEFINE_DECODE(llmopt_paged_decode_bf16, uint16_t, bf16_load, bf16_store)
