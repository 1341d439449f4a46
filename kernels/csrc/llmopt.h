/* Entry points shared between the native CPU sources (each also called from Python through ctypes). */
#ifndef LLMOPT_H
#define LLMOPT_H
#include <stdint.h>
#include <stdlib.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* Scratch memory aligned to 64 bytes: gcc's vectorised loops peel by the pointer's alignment, so with
 * malloc's 16 the order of a reduction, and so its rounding, changed from one call to the next. */
static inline void *llmopt_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static inline float llmopt_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t llmopt_f32_to_bf16(float f) { /* round to nearest even, as torch does; NaN stays NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

/* The tiles [*t0, *t1) of the calling OpenMP thread: equal parts of `tiles`, neighbouring threads on
 * neighbouring slabs. */
static inline void llmopt_thread_slab(int64_t tiles, int64_t *t0, int64_t *t1) {
    int64_t threads = 1, tid = 0;
#ifdef _OPENMP
    threads = omp_get_num_threads();
    tid = omp_get_thread_num();
#endif
    int64_t per = tiles / threads, extra = tiles % threads;
    *t0 = tid * per + (tid < extra ? tid : extra);
    *t1 = *t0 + per + (tid < extra ? 1 : 0);
}

int llmopt_paged_decode_f32(const float *q, int64_t q_stride, const float *kv, int64_t row_stride,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens, float *out,
                            int64_t out_stride, int64_t num_seqs, int64_t hq, int64_t hk, int64_t dim,
                            int64_t block_size, float scale);
int llmopt_paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t row_stride,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                             uint16_t *out, int64_t out_stride, int64_t num_seqs, int64_t hq, int64_t hk,
                             int64_t dim, int64_t block_size, float scale);
int llmopt_gemv_dense(const void *x, int64_t xs, const void *tiles, int welem, const float *bias, void *y, int64_t ys,
                      int elem, int64_t m, int64_t n, int64_t k);
int llmopt_gemv_w4(const void *x, int64_t xs, const uint8_t *packed, const float *scales, const uint8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k);
int llmopt_gemv_w8(const void *x, int64_t xs, const int8_t *tiles, const float *scales, const int8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k);
int llmopt_gemv_vnni(void);
int llmopt_gemv_quant_vnni(int bits, const void *x, int64_t xs, const void *tiles, const float *scales,
                           const void *zeros, int64_t groups, int64_t gsize, const float *bias, void *y, int64_t ys,
                           int elem, int64_t m, int64_t n, int64_t k, int64_t kp);
int llmopt_add_rms_norm(const void *x, int64_t xs, void *residual, int64_t rs, const void *w, void *out, int64_t os,
                        int64_t rows, int64_t h, float eps, int elem);
int llmopt_silu_mul(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t inter, int elem);
int llmopt_rope(void *x, int64_t xs, const void *cs, int64_t css, int64_t rows, int64_t heads, int64_t d, int elem);

#endif
