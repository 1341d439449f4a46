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

/* A linear layer's weight as the GEMVs take it (dense, int4 or int8 tiles: see gemv.c); the same layout as
 * llmopt.kernels.cpu_native._Linear. */
typedef struct {
    int64_t kind; /* 0: dense tiles (welem 0 fp32 / 1 bf16); 1: int4; 2: int8 */
    int64_t welem;
    const void *weight; /* tiles, or packed int4 */
    const float *scales;
    const void *zeros; /* uint8 (int4) or int8 (int8) zero points, or NULL */
    int64_t group;
    const float *bias;
    int64_t n, k;
} llmopt_linear;

int llmopt_paged_decode_f32(const float *q, int64_t q_stride, const float *kv, int64_t row_stride,
                            const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens, float *out,
                            int64_t out_stride, int64_t num_seqs, int64_t hq, int64_t hk, int64_t dim,
                            int64_t block_size, float scale, int64_t window);
int llmopt_paged_decode_bf16(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t row_stride,
                             const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                             uint16_t *out, int64_t out_stride, int64_t num_seqs, int64_t hq, int64_t hk,
                             int64_t dim, int64_t block_size, float scale, int64_t window);
int llmopt_gemv_dense(const void *x, int64_t xs, const void *tiles, int welem, const float *bias, void *y, int64_t ys,
                      int elem, int64_t m, int64_t n, int64_t k);
int llmopt_gemv_w4(const void *x, int64_t xs, const uint8_t *packed, const float *scales, const uint8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k);
int llmopt_gemv_w8(const void *x, int64_t xs, const int8_t *tiles, const float *scales, const int8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k);
int llmopt_gemv(const llmopt_linear *l, const void *x, int64_t xs, void *y, int64_t ys, int elem, int64_t m);
int llmopt_add_rms_norm(const void *x, int64_t xs, void *residual, int64_t rs, const void *w, void *out, int64_t os,
                        int64_t rows, int64_t h, float eps, int elem);
int llmopt_silu_mul(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t inter, int elem);
int llmopt_gelu_tanh_mul(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t inter, int elem);
int llmopt_rope(void *x, int64_t xs, const void *cs, int64_t css, int64_t rows, int64_t heads, int64_t d, int elem);

/* The parts of those calls, for a caller that runs a whole step in one OpenMP team (layer.c).
 *
 * A GEMV in three parts: llmopt_gemv_scratch bytes (64-byte aligned) hold x prepared for the tiles;
 * llmopt_gemv_load_row prepares row i of M there (any thread, each row once); once every row is in,
 * llmopt_gemv_run computes tiles [t0, t1) of llmopt_gemv_tiles (any split over the threads). Each output is
 * computed the same way whatever the split. llmopt_gemv_check: nonzero for a shape the kernels refuse. */
int llmopt_gemv_check(const llmopt_linear *l);
size_t llmopt_gemv_scratch(const llmopt_linear *l, int64_t m);
int64_t llmopt_gemv_tiles(const llmopt_linear *l);
void llmopt_gemv_load_row(const llmopt_linear *l, const void *x, int elem, int64_t i, int64_t m, void *scratch);
void llmopt_gemv_run(const llmopt_linear *l, const void *scratch, int64_t m, void *y, int64_t ys, int elem,
                     int64_t t0, int64_t t1);
/* Paged decode attention's work, shared over the calling team (orphaned `omp for`); 2: no scratch.
 * window > 0: each sequence attends to its last `window` rows only (0: all of them). */
int llmopt_paged_decode_f32_team(const float *q, int64_t q_stride, const float *kv, int64_t row_stride,
                                 const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                                 float *out, int64_t out_stride, int64_t num_seqs, int64_t hq, int64_t hk,
                                 int64_t dim, int64_t block_size, float scale, int64_t window);
int llmopt_paged_decode_bf16_team(const uint16_t *q, int64_t q_stride, const uint16_t *kv, int64_t row_stride,
                                  const int32_t *block_tables, int64_t bt_stride, const int32_t *context_lens,
                                  uint16_t *out, int64_t out_stride, int64_t num_seqs, int64_t hq, int64_t hk,
                                  int64_t dim, int64_t block_size, float scale, int64_t window);
/* One row (pointers at the row) of the small ops. */
void llmopt_add_rms_norm_row(const void *x, void *residual, const void *w, void *out, int64_t h, float eps, int elem);
void llmopt_silu_mul_row(const void *gu, void *out, int64_t inter, int elem);
void llmopt_gelu_tanh_mul_row(const void *gu, void *out, int64_t inter, int elem);
void llmopt_rope_row(void *x, const void *cs, int64_t heads, int64_t d, int elem);

/* gemv_vnni.c, for gemv.c (llmopt_gemv_vnni(): 1 where the build has the VNNI kernels, 0 where these do
 * nothing). */
int llmopt_gemv_vnni(void);
void llmopt_vnni_sizes(int64_t kp, int64_t groups, int64_t gsize, int64_t *dstride, int64_t *nblocks);
void llmopt_vnni_quantize(const float *row, int64_t gsize, int64_t groups, int8_t *d, float *xs, int64_t amx_stride);
/* 1 where the AMX-INT8 form takes a linear of these sizes on this machine (then for every M). */
int llmopt_vnni_amx(int64_t kp, int64_t gsize);
void llmopt_vnni_run_amx(int bits, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                         int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t nblocks,
                         void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0, int64_t t1);
void llmopt_vnni_run(int bits, int whole, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                     int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t dstride,
                     int64_t nblocks, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0,
                     int64_t t1);

#endif
