/* Weight-only quantized weights -> a dense bf16 weight [N][K], for prefill-sized matmuls.
 *
 * Beyond a few rows the packed GEMVs lose to a bf16 GEMM (oneDNN, on AMX where the CPU has it): the
 * caller dequantizes a layer's weight into a reusable scratch buffer with these functions, then runs
 * the GEMM on it. Unpacking with torch ops cost ~10 passes over the weight (nibble split, stack, casts,
 * subtract, multiply, cast); here each weight byte is read once and each bf16 written once.
 *
 * Every element is (q - zero) * scale in fp32, rounded to nearest even bf16: the bf16 nearest the
 * exact twin's fp32 weight (kernels/wq_matmul.dequantize), the same whatever the path (vector or scalar).
 *
 * W4: compressed-tensors' pack-quantized layout, int32 [N][K/8] with input 8c+j in bits 4j..4j+3 of word
 * c (on a little-endian CPU byte b of the row holds inputs 2b (low nibble) and 2b+1 (high)), stored
 * values 0..15; zero points as stored values 0..15, uint8 [N][G] (NULL: symmetric, 8).
 * W8: int8 [N][K]; zero points int8 [N][G] (NULL: symmetric, 0).
 * Scales fp32 [N][G], G = K / group (a group of K: one per row). K must be a multiple of 32 (W4) or 16
 * (W8), the group a multiple of that (the caller checks; the fast path assumes it).
 */
#include <stdint.h>
#include <string.h>

#include "llmopt.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DQ_FAST 1
#else
#define DQ_FAST 0
#endif

/* Rows per OpenMP chunk: a few KiB of output each, enough to amortise the scheduling. */
#define ROW_CHUNK 16

#if DQ_FAST
/* 16 fp32 -> 16 bf16 in the low halves of 32-bit lanes (round to nearest even, as torch). */
static inline __m512i bf16_lanes(__m512 v) {
    return _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
}

static void w4_row(const uint8_t *src, const float *scales, const uint8_t *zeros, int64_t group, uint16_t *out,
                   int64_t k) {
    for (int64_t c = 0; c < k; c += 32) {  /* 32 inputs = 16 bytes: input 2b in byte b's low nibble */
        int64_t g = c / group;
        __m512 s = _mm512_set1_ps(scales[g]);
        __m512 z = _mm512_set1_ps(zeros ? (float)zeros[g] : 8.0f);
        __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(src + c / 2)));
        __m512i lo = _mm512_and_si512(b, _mm512_set1_epi32(15)), hi = _mm512_srli_epi32(b, 4);
        __m512 flo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(lo), z), s);
        __m512 fhi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), z), s);
        /* lane b = bf16(input 2b) | bf16(input 2b + 1) << 16: the two in memory order */
        __m512i pair = _mm512_or_si512(bf16_lanes(flo), _mm512_slli_epi32(bf16_lanes(fhi), 16));
        _mm512_storeu_si512((void *)(out + c), pair);
    }
}

static void w8_row(const int8_t *src, const float *scales, const int8_t *zeros, int64_t group, uint16_t *out,
                   int64_t k) {
    for (int64_t c = 0; c < k; c += 16) {
        int64_t g = c / group;
        __m512 s = _mm512_set1_ps(scales[g]);
        __m512 z = _mm512_set1_ps(zeros ? (float)zeros[g] : 0.0f);
        __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + c))));
        _mm256_storeu_si256((__m256i *)(out + c), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_sub_ps(q, z), s)));
    }
}
#else
static void w4_row(const uint8_t *src, const float *scales, const uint8_t *zeros, int64_t group, uint16_t *out,
                   int64_t k) {
    for (int64_t c = 0; c < k; c++) {
        int q = (src[c / 2] >> (4 * (c & 1))) & 15;
        float z = zeros ? (float)zeros[c / group] : 8.0f;
        out[c] = llmopt_f32_to_bf16(((float)q - z) * scales[c / group]);
    }
}

static void w8_row(const int8_t *src, const float *scales, const int8_t *zeros, int64_t group, uint16_t *out,
                   int64_t k) {
    for (int64_t c = 0; c < k; c++) {
        float z = zeros ? (float)zeros[c / group] : 0.0f;
        out[c] = llmopt_f32_to_bf16(((float)src[c] - z) * scales[c / group]);
    }
}
#endif

int llmopt_dequant_fast(void) { return DQ_FAST; }

/* packed: int32 [N][ps] (ps >= K/8 words per row); out: bf16 [N][K] contiguous. 0: done, 1: bad shape. */
int llmopt_dequant_w4_bf16(const int32_t *packed, int64_t ps, const float *scales, const uint8_t *zeros,
                           int64_t group, uint16_t *out, int64_t n, int64_t k) {
    if (k % 32 || group <= 0 || group % 32 || k % group || ps * 8 < k) return 1;
    int64_t groups = k / group;
#pragma omp parallel for schedule(static, ROW_CHUNK)
    for (int64_t r = 0; r < n; r++)
        w4_row((const uint8_t *)(packed + r * ps), scales + r * groups, zeros ? zeros + r * groups : NULL, group,
               out + r * k, k);
    return 0;
}

/* q: int8 [N][qs]; out: bf16 [N][K] contiguous. 0: done, 1: bad shape. */
int llmopt_dequant_w8_bf16(const int8_t *q, int64_t qs, const float *scales, const int8_t *zeros, int64_t group,
                           uint16_t *out, int64_t n, int64_t k) {
    if (k % 16 || group <= 0 || group % 16 || k % group || qs < k) return 1;
    int64_t groups = k / group;
#pragma omp parallel for schedule(static, ROW_CHUNK)
    for (int64_t r = 0; r < n; r++)
        w8_row(q + r * qs, scales + r * groups, zeros ? zeros + r * groups : NULL, group, out + r * k, k);
    return 0;
}
