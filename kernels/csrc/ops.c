/* The small per-layer operations of a CPU step, one call each instead of torch's several: RMSNorm with
 * the residual add, SwiGLU, GeGLU (the gelu-tanh gate of Gemma's MLP), RoPE. At decode each torch op costs
 * a few microseconds whatever its size (F.rms_norm alone was 8 ops and ~30 us per call), so a 30-layer
 * step spent milliseconds on them.
 *
 * Elements: fp32 (elem 0) or bf16 (elem 1), arithmetic in fp32. In bf16 the results are rounded where
 * transformers' Llama rounds (the residual sum, the normalised row before the weight, silu or gelu before
 * the product), so the runtime stays as close to the reference as the torch path was. Rows are split over
 * the threads when there are enough of them to pay for it.
 */
#include <math.h>
#include <stdint.h>

#include "llmopt.h"

static inline float ld(const void *p, int64_t i, int elem) {
    return elem == 0 ? ((const float *)p)[i] : llmopt_bf16_to_f32(((const uint16_t *)p)[i]);
}

static inline float round_to(float f, int elem) { /* to the element type and back */
    return elem == 0 ? f : llmopt_bf16_to_f32(llmopt_f32_to_bf16(f));
}

static inline void st(void *p, int64_t i, float f, int elem) {
    if (elem == 0) ((float *)p)[i] = f;
    else ((uint16_t *)p)[i] = llmopt_f32_to_bf16(f);
}

#define PARALLEL_ROWS 16 /* fewer rows run on the calling thread: waking the others costs more */

/* One row: residual != NULL: residual = x + residual (in place), then out = rmsnorm(residual) * w;
 * residual == NULL: out = rmsnorm(x) * w. */
static inline __attribute__((always_inline)) void norm_row(const void *x, void *residual, const void *w, void *out,
                                                           int64_t h, float eps, int elem) {
    const void *src = x;
    float ss = 0.0f;
    if (residual) {
        for (int64_t j = 0; j < h; j++) {
            float v = round_to(ld(x, j, elem) + ld(residual, j, elem), elem);
            st(residual, j, v, elem);
            ss += v * v;
        }
        src = residual;
    } else {
        for (int64_t j = 0; j < h; j++) {
            float v = ld(x, j, elem);
            ss += v * v;
        }
    }
    float inv = 1.0f / sqrtf(ss / (float)h + eps);
    for (int64_t j = 0; j < h; j++) st(out, j, round_to(ld(src, j, elem) * inv, elem) * ld(w, j, elem), elem);
}

/* One row: out[j] = silu(gu[j]) * gu[inter + j], the fused gate||up projection's halves. */
static inline __attribute__((always_inline)) void silu_row(const void *gu, void *out, int64_t inter, int elem) {
    for (int64_t j = 0; j < inter; j++) {
        float g = ld(gu, j, elem);
        st(out, j, round_to(g / (1.0f + expf(-g)), elem) * ld(gu, inter + j, elem), elem);
    }
}

/* gelu(g, approximate="tanh") = g * (1 + tanh(u)) / 2 = g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3): expf
 * vectorises where tanhf may not, and sigmoid taken as e / (1 + e) with e = exp(-|2u|) stays accurate in the
 * negative tail, where 1 + tanh(u) (torch's form) cancels to a few bits. */
static inline float gelu_tanh(float g) {
    const float x = 1.5957691216057308f * (g + 0.044715f * g * g * g); /* 2u */
    const float e = expf(-fabsf(x));
    return g * ((x >= 0.f ? 1.f : e) / (1.f + e));
}

/* One row: out[j] = gelu_tanh(gu[j]) * gu[inter + j], the fused gate||up projection's halves. */
static inline __attribute__((always_inline)) void gelu_row(const void *gu, void *out, int64_t inter, int elem) {
    for (int64_t j = 0; j < inter; j++)
        st(out, j, round_to(gelu_tanh(ld(gu, j, elem)), elem) * ld(gu, inter + j, elem), elem);
}

/* One token's row: rotate-half RoPE in place on its first `heads` heads (head dim d); cs = cos[d/2] || sin[d/2]
 * for the token's position (in the element type, as transformers rounds them): x1' = x1 cos - x2 sin,
 * x2' = x2 cos + x1 sin. */
static inline __attribute__((always_inline)) void rope_row(void *x, const void *cs, int64_t heads, int64_t d,
                                                           int elem) {
    int64_t half = d / 2;
    for (int64_t hd = 0; hd < heads; hd++) {
        int64_t at = hd * d;
        for (int64_t j = 0; j < half; j++) {
            float c = ld(cs, j, elem), s = ld(cs, half + j, elem);
            float x1 = ld(x, at + j, elem), x2 = ld(x, at + half + j, elem);
            st(x, at + j, round_to(x1 * c, elem) - round_to(x2 * s, elem), elem);
            st(x, at + half + j, round_to(x2 * c, elem) + round_to(x1 * s, elem), elem);
        }
    }
}

void llmopt_add_rms_norm_row(const void *x, void *residual, const void *w, void *out, int64_t h, float eps, int elem) {
    if (elem == 0) norm_row(x, residual, w, out, h, eps, 0);
    else norm_row(x, residual, w, out, h, eps, 1);
}

void llmopt_silu_mul_row(const void *gu, void *out, int64_t inter, int elem) {
    if (elem == 0) silu_row(gu, out, inter, 0);
    else silu_row(gu, out, inter, 1);
}

void llmopt_gelu_tanh_mul_row(const void *gu, void *out, int64_t inter, int elem) {
    if (elem == 0) gelu_row(gu, out, inter, 0);
    else gelu_row(gu, out, inter, 1);
}

void llmopt_rope_row(void *x, const void *cs, int64_t heads, int64_t d, int elem) {
    if (elem == 0) rope_row(x, cs, heads, d, 0);
    else rope_row(x, cs, heads, d, 1);
}

static inline char *row_at(const void *p, int64_t row, int64_t stride, int elem) {
    return (char *)p + row * stride * (elem == 0 ? 4 : 2);
}

/* residual != NULL: residual = x + residual (in place), then out = rmsnorm(residual) * w;
 * residual == NULL: out = rmsnorm(x) * w. Row strides in elements. */
int llmopt_add_rms_norm(const void *x, int64_t xs, void *residual, int64_t rs, const void *w, void *out, int64_t os,
                        int64_t rows, int64_t h, float eps, int elem) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++)
        llmopt_add_rms_norm_row(row_at(x, t, xs, elem), residual ? row_at(residual, t, rs, elem) : NULL, w,
                                row_at(out, t, os, elem), h, eps, elem);
    return 0;
}

/* out[t][j] = silu(gu[t][j]) * gu[t][inter + j]: the fused gate||up projection's halves. */
int llmopt_silu_mul(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t inter, int elem) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) llmopt_silu_mul_row(row_at(gu, t, gs, elem), row_at(out, t, os, elem), inter, elem);
    return 0;
}

/* out[t][j] = gelu_tanh(gu[t][j]) * gu[t][inter + j]. */
int llmopt_gelu_tanh_mul(const void *gu, int64_t gs, void *out, int64_t os, int64_t rows, int64_t inter, int elem) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++)
        llmopt_gelu_tanh_mul_row(row_at(gu, t, gs, elem), row_at(out, t, os, elem), inter, elem);
    return 0;
}

/* RoPE (llmopt_rope_row) on each token's row x[t] (row stride xs); cs[t] = cos || sin of its position. */
int llmopt_rope(void *x, int64_t xs, const void *cs, int64_t css, int64_t rows, int64_t heads, int64_t d, int elem) {
#pragma omp parallel for schedule(static) if (rows >= PARALLEL_ROWS)
    for (int64_t t = 0; t < rows; t++) llmopt_rope_row(row_at(x, t, xs, elem), row_at(cs, t, css, elem), heads, d, elem);
    return 0;
}
