/* Paged attention for decode on CPU: one new query token per sequence, keys and values read in
 * place from the paged KV cache (no gather copy), each cached row read once. With a sliding window
 * (window > 0) a sequence attends to its last `window` rows only, and nothing before them is read: the
 * block manager may free those blocks, so their table entries may point at other data.
 *
 * Cache rows (one layer): kv[slot] = K[Hk][D] || V[Hk][D], slot = block * block_size + offset,
 * row_stride elements apart. q and out: [B][Hq][D] with q_stride / out_stride elements between
 * tokens; query head i uses kv head i / (Hq / Hk) (GQA). One work item per sequence, or per part of a
 * sequence's query heads when there are fewer sequences than threads (threads take them dynamically).
 * Per-thread scratch: scores [Hq][block_size], scaled q and accumulators [Hq][D].
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

/* Query heads [i0, i1) of a sequence use, of kv head h (query heads h * group .. h * group + group - 1), those
 * from FIRST(h) to LAST(h) (exclusive) within its group. */
#define FIRST(h) (i0 > (h) * group ? i0 - (h) * group : 0)
#define LAST(h) (i1 < ((h) + 1) * group ? i1 - (h) * group : group)

/* One sequence's query heads [i0, i1): out[i0..i1)[DIM] from its rows [start, ctx), one cache block at a
 * time (the first from `start` on, mid-block where a window starts there; online softmax): the block's K
 * rows give its scores, the running maxima rescale what was accumulated, then its V rows are added while
 * the block is still in cache, so each row comes from memory once. DIM is a literal in the specialised
 * copies, so the dot products and updates unroll into whole vectors. */
#define DEFINE_SEQUENCE(NAME, T, LOAD, STORE, DIM)                                                       \
static void NAME(const T *qr, const T *kv, int64_t row_stride, const int32_t *table, int64_t start, int64_t ctx, \
                 T *orow, int64_t hq, int64_t hk, int64_t dim_arg, int64_t block_size, float scale,     \
                 float *scores, float *qv, float *acc, int64_t i0, int64_t i1) {                        \
    const int64_t dim = DIM, group = hq / hk, h0 = i0 / group, h1 = (i1 + group - 1) / group;          \
    float mx[hq], sum[hq];                                                                             \
    (void)dim_arg;                                                                                     \
    for (int64_t i = i0 * dim; i < i1 * dim; i++) { qv[i] = LOAD(qr[i]) * scale; acc[i] = 0.f; }      \
    for (int64_t i = i0; i < i1; i++) { mx[i] = -INFINITY; sum[i] = 0.f; }                             \
    for (int64_t t0 = start, n = 0; t0 < ctx; t0 += n) {                                               \
        const int64_t first = t0 % block_size; /* nonzero only where a window starts mid-block */      \
        const T *block = kv + ((int64_t)table[t0 / block_size] * block_size + first) * row_stride;     \
        n = ctx - t0 < block_size - first ? ctx - t0 : block_size - first;                             \
        if (t0 + n < ctx) { /* blocks are scattered: hardware prefetch stops at each page */           \
            const int64_t left = ctx - t0 - n;                                                         \
            const char *next = (const char *)(kv + (int64_t)table[t0 / block_size + 1] * block_size * row_stride); \
            const int64_t bytes = (left < block_size ? left : block_size) * row_stride * (int64_t)sizeof(T); \
            for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(next + off, 0, 3);         \
        }                                                                                              \
        for (int64_t o = 0; o < n; o++)                                                                \
            for (int64_t h = h0; h < h1; h++) {                                                        \
                const T *k = block + o * row_stride + h * dim;                                         \
                float kf[DIM > 0 ? DIM : 1024] __attribute__((aligned(64)));                           \
                for (int64_t d = 0; d < dim; d++) kf[d] = LOAD(k[d]);                                  \
                for (int64_t j = FIRST(h); j < LAST(h); j++) {                                         \
                    const float *qi = qv + (h * group + j) * dim;                                      \
                    float s = 0.f;                                                                     \
                    for (int64_t d = 0; d < dim; d++) s += qi[d] * kf[d];                              \
                    scores[(h * group + j) * block_size + o] = s;                                      \
                }                                                                                      \
            }                                                                                          \
        for (int64_t i = i0; i < i1; i++) {                                                            \
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
            for (int64_t h = h0; h < h1; h++) {                                                        \
                const T *v = block + o * row_stride + (hk + h) * dim;                                  \
                float vf[DIM > 0 ? DIM : 1024] __attribute__((aligned(64)));                           \
                for (int64_t d = 0; d < dim; d++) vf[d] = LOAD(v[d]);                                  \
                for (int64_t j = FIRST(h); j < LAST(h); j++) {                                         \
                    float *a = acc + (h * group + j) * dim;                                            \
                    const float p = scores[(h * group + j) * block_size + o];                          \
                    for (int64_t d = 0; d < dim; d++) a[d] += p * vf[d];                               \
                }                                                                                      \
            }                                                                                          \
    }                                                                                                  \
    for (int64_t i = i0; i < i1; i++) {                                                                \
        const float inv = sum[i] > 0.f ? 1.f / sum[i] : 0.f;                                           \
        for (int64_t d = 0; d < dim; d++) orow[i * dim + d] = STORE(acc[i * dim + d] * inv);           \
    }                                                                                                  \
}

/* Work items per sequence: 1 when the sequences alone give every thread of the team one, else each
 * sequence's query heads in that many parts (at most one head each), so that batch-1 decode does not leave
 * the other threads waiting. Every head's arithmetic is the same whatever part it falls in, so the output
 * does not depend on the split. */
static inline int64_t llmopt_head_parts(int64_t num_seqs, int64_t hq) {
    int64_t threads = 1;
#ifdef _OPENMP
    threads = omp_get_num_threads();
#endif
    if (num_seqs >= threads) return 1;
    int64_t parts = (threads + num_seqs - 1) / num_seqs;
    return parts < hq ? parts : hq;
}

#define DEFINE_DECODE(NAME, T, LOAD, STORE)                                                            \
DEFINE_SEQUENCE(NAME##_d64, T, LOAD, STORE, 64)                                                        \
DEFINE_SEQUENCE(NAME##_d128, T, LOAD, STORE, 128)                                                      \
DEFINE_SEQUENCE(NAME##_any, T, LOAD, STORE, dim_arg)                                                   \
/* The team part: every thread of the calling OpenMP team calls it (a lone thread outside one does all the \
 * work); returns 2 where this thread's scratch could not be allocated. */                             \
int NAME##_team(const T *q, int64_t q_stride, const T *kv, int64_t row_stride, const int32_t *block_tables, \
                int64_t bt_stride, const int32_t *context_lens, T *out, int64_t out_stride, int64_t num_seqs, \
                int64_t hq, int64_t hk, int64_t dim, int64_t block_size, float scale, int64_t window) {  \
    float *scores = llmopt_alloc(sizeof(float) * (size_t)(hq * block_size + 2 * hq * dim));                  \
    const int64_t parts = llmopt_head_parts(num_seqs, hq);                                             \
    _Pragma("omp for schedule(dynamic, 1)")                                                            \
    for (int64_t item = 0; item < num_seqs * parts; item++) {                                          \
        if (!scores) continue;                                                                         \
        const int64_t b = item / parts, part = item % parts;                                           \
        const int64_t i0 = hq * part / parts, i1 = hq * (part + 1) / parts;                            \
        float *qv = scores + hq * block_size, *acc = qv + hq * dim;                                    \
        const T *qr = q + b * q_stride;                                                                \
        const int32_t *table = block_tables + b * bt_stride;                                           \
        T *orow = out + b * out_stride;                                                                \
        const int64_t ctx = context_lens[b], start = window > 0 && ctx > window ? ctx - window : 0;    \
        if (dim == 64)                                                                                 \
            NAME##_d64(qr, kv, row_stride, table, start, ctx, orow, hq, hk, dim, block_size, scale,    \
                       scores, qv, acc, i0, i1);                                                       \
        else if (dim == 128)                                                                           \
            NAME##_d128(qr, kv, row_stride, table, start, ctx, orow, hq, hk, dim, block_size, scale,   \
                        scores, qv, acc, i0, i1);                                                      \
        else                                                                                           \
            NAME##_any(qr, kv, row_stride, table, start, ctx, orow, hq, hk, dim, block_size, scale,    \
                       scores, qv, acc, i0, i1);                                                       \
    }                                                                                                  \
    const int rc = scores ? 0 : 2;                                                                     \
    free(scores);                                                                                      \
    return rc;                                                                                         \
}                                                                                                      \
int NAME(const T *q, int64_t q_stride, const T *kv, int64_t row_stride, const int32_t *block_tables,   \
         int64_t bt_stride, const int32_t *context_lens, T *out, int64_t out_stride, int64_t num_seqs, \
         int64_t hq, int64_t hk, int64_t dim, int64_t block_size, float scale, int64_t window) {     \
    if (hk <= 0 || hq % hk || dim <= 0 || dim > 1024) return 1;                                        \
    int failed = 0;                                                                                    \
    _Pragma("omp parallel")                                                                            \
    {                                                                                                  \
        if (NAME##_team(q, q_stride, kv, row_stride, block_tables, bt_stride, context_lens, out, out_stride, \
                        num_seqs, hq, hk, dim, block_size, scale, window)) {                           \
            _Pragma("omp atomic write") failed = 2;                                                    \
        }                                                                                              \
    }                                                                                                  \
    return failed;                                                                                     \
}

#define F32_LOAD(x) (x)
#define F32_STORE(x) (x)
DEFINE_DECODE(llmopt_paged_decode_f32, float, F32_LOAD, F32_STORE)
DEFINE_DECODE(llmopt_paged_decode_bf16, uint16_t, bf16_load, bf16_store)
