/* The quantized GEMVs (int4 and int8 weights, tiled as in gemv.c) on integer dot products (AVX512-VNNI).
 *
 * gemv.c's fp32 paths turn every weight into an fp32 lane before its multiply-add: at batch 1 that is
 * about three vector instructions per 16 weights, so a core streamed only ~6 GB/s of int4 tiles, less
 * than memory delivers; the decode step was bound by the arithmetic, not by the bytes. Here 64 weights
 * (one 64-byte step of a tile: 4 rows side by side) go through one `vpdpbusd` per digit of x.
 *
 * x is held to fp32's precision: each block of a row (a group of inputs, at most BLOCK) is scaled to a
 * 24-bit fixed point, xi = round(x / sx) with sx = (the block's max|x|) / XMAX, and xi is written as three
 * signed 8-bit digits, xi = d2 * 2^16 + d1 * 2^8 + d0 (each digit in [-128, 127]); |x - sx * xi| <= sx / 2
 * = max|x| * 6e-8, the rounding of one fp32 operation on the block's largest entry (an outlier costs
 * the small entries of its own block some bits, no others). The weights are the unsigned operand: int4 codes as stored (0..15), int8 codes
 * with their sign bit flipped (q + 128). Per block of inputs (a group, at most BLOCK inputs) each digit's
 * dot product is exact in int32; the block's sum, in fp32, is
 *   sum((q - zero) * xi) = 2^16 dot(q', d2) + 2^8 dot(q', d1) + dot(q', d0) - (bias + zero) * sum(xi)
 * (q' = the unsigned code, bias = 0 for int4 and 128 for int8, zero = the stored zero point: 8 for
 * symmetric int4, 0 for symmetric int8), and y = the sum over blocks of scale * sx * that.
 *
 * Accumulators hold a tile's 4 rows at once (4 int32 lanes per row, vpdpbusd sums 4 neighbouring bytes
 * into a lane), so the per-block arithmetic is shared by the 4 rows. Every output's operations and their
 * order are the same whatever M is, so a sequence's logits do not depend on the batch.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "llmopt.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#define XMAX 8323072.0f /* 127 * 2^16: the top digit stays within [-127, 127] */
#define BLOCK 256       /* inputs per block at most: each digit's int32 sums stay below 2^24, exact in fp32 */
#define DIGITS 192      /* bytes of digits per chunk of 16 inputs: 3 digits x 4 copies x 16 */
#ifndef AHEAD
#define AHEAD 4096      /* bytes of a tile's stream prefetched ahead: the hardware prefetcher alone left the
                         * core waiting on memory for about half the time, and it stops at each 4 KiB page;
                         * a page ahead (against 1 KiB before) took the batch-1 decode step of the W4A16 +
                         * int8-embeddings SmolLM2 from 4.9 to 4.3 ms at 2 threads, 9.8 to 7.0-7.9 at 1 */
#endif

int llmopt_gemv_vnni(void) { return 1; }

/* One x row as digits: d [kp / 16][3][64] (chunk c = inputs 16c..16c+15; digit 0, 1, 2; its 16 bytes
 * written 4 times, once per tile row, so that vpdpbusd reads them straight from memory), and per block
 * (in the order the kernels walk them) its scale sx and sum(xi): xs[2 * b] = sx, xs[2 * b + 1] = sum. */
static void quantize_row(const float *x, int64_t gsize, int64_t groups, int8_t *d, float *xs) {
    const __m512 lim = _mm512_set1_ps(XMAX);
    const __m512i half = _mm512_set1_epi32(128), byte = _mm512_set1_epi32(255);
    int64_t b = 0;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t b0 = g * gsize; b0 < (g + 1) * gsize; b0 += BLOCK, b++) { /* whole chunks of 16 */
            int64_t b1 = b0 + BLOCK < (g + 1) * gsize ? b0 + BLOCK : (g + 1) * gsize;
            __m512 top = _mm512_setzero_ps();
            for (int64_t j = b0; j < b1; j += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + j)));
            float most = _mm512_reduce_max_ps(top), sx = most > 0.0f ? most / XMAX : 1.0f;
            __m512 inv = _mm512_set1_ps(1.0f / sx);
            __m512i total = _mm512_setzero_si512(); /* per lane at most 16 entries of |xi| <= XMAX: no overflow */
            for (int64_t j = b0; j < b1; j += 16) {
                __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(x + j), inv),
                                                       _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim);
                __m512i xi = _mm512_cvtps_epi32(v); /* round to nearest even */
                __m512i d0 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(xi, half), byte), half);
                __m512i r = _mm512_srai_epi32(_mm512_sub_epi32(xi, d0), 8);
                __m512i d1 = _mm512_sub_epi32(_mm512_and_si512(_mm512_add_epi32(r, half), byte), half);
                __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(r, d1), 8);
                int8_t *at = d + (j / 16) * DIGITS;
                _mm512_store_si512((void *)at, _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(d0)));
                _mm512_store_si512((void *)(at + 64), _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(d1)));
                _mm512_store_si512((void *)(at + 128), _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(d2)));
                total = _mm512_add_epi32(total, xi);
            }
            int64_t sum = _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(total))) +
                          _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(total, 1)));
            xs[2 * b] = sx;
            xs[2 * b + 1] = (float)sum;
        }
}

static inline __m512i digit(const int8_t *d, int which) { return _mm512_load_si512((const void *)(d + 64 * which)); }

/* The fp32 sum of a block from its three digit accumulators, less (bias + zero) * sum(xi) in each row's
 * first lane. */
static inline __m512 block_sum(__m512i a0, __m512i a1, __m512i a2, __m512 offset, float xsum) {
    __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_set1_ps(65536.0f),
                               _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps(256.0f),
                                               _mm512_cvtepi32_ps(a0)));
    return _mm512_sub_ps(f, _mm512_maskz_mul_ps(0x1111, offset, _mm512_set1_ps(xsum)));
}

/* The 4 scales (or zeros) of a tile's rows, each spread over its row's 4 lanes. */
static inline __m512 per_row(__m128 four) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
}

/* One tile against MB x rows: acc[i] gets each row's blocks, scaled. bits 4: steps of 32 inputs (byte j =
 * input j low nibble, j + 16 high), bits 8: steps of 16. */
static inline __attribute__((always_inline)) void tile_blocks(const int bits, const int mb, const uint8_t *p,
        const float *s, const uint8_t *z, int64_t groups, int64_t gsize, const int8_t *const *dig,
        const float *const *sums, float bias, __m512 *acc) {
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    const uint64_t per_step = bits == 4 ? 32 : 16;
    int64_t b = 0;
    for (int64_t g = 0; g < groups; g++) {
        __m512 sv = per_row(_mm_loadu_ps(s + g * 4)), offset = _mm512_set1_ps(bias);
        if (z) {
            __m128i zz = _mm_cvtsi32_si128(*(const int32_t *)(z + g * 4));
            __m128 zf = _mm_cvtepi32_ps(bits == 4 ? _mm_cvtepu8_epi32(zz) : _mm_cvtepi8_epi32(zz));
            offset = _mm512_add_ps(offset, per_row(zf));
        }
        for (int64_t b0 = g * gsize; b0 < (g + 1) * gsize; b0 += BLOCK, b++) {
            int64_t b1 = b0 + BLOCK < (g + 1) * gsize ? b0 + BLOCK : (g + 1) * gsize;
            __m512i a[4][3], h[4][3]; /* two sets of accumulators: no chain waits on vpdpbusd's latency */
            for (int i = 0; i < mb; i++)
                for (int t = 0; t < 3; t++) a[i][t] = h[i][t] = _mm512_setzero_si512();
            for (uint64_t c = (uint64_t)b0; c < (uint64_t)b1; c += per_step) {
                const uint8_t *at = p + (c / per_step) * 64;
                _mm_prefetch((const char *)at + AHEAD, _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)at);
                if (bits == 4) {
                    __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
                    for (int i = 0; i < mb; i++) {
                        const int8_t *d = dig[i] + (c / 16) * DIGITS;
                        for (int t = 0; t < 3; t++) {
                            a[i][t] = _mm512_dpbusd_epi32(a[i][t], lo, digit(d, t));
                            h[i][t] = _mm512_dpbusd_epi32(h[i][t], hi, digit(d + DIGITS, t));
                        }
                    }
                } else {
                    __m512i u = _mm512_xor_si512(v, flip);
                    int odd = (int)((c / 16) & 1);
                    for (int i = 0; i < mb; i++) {
                        const int8_t *d = dig[i] + (c / 16) * DIGITS;
                        for (int t = 0; t < 3; t++) {
                            if (odd) h[i][t] = _mm512_dpbusd_epi32(h[i][t], u, digit(d, t));
                            else a[i][t] = _mm512_dpbusd_epi32(a[i][t], u, digit(d, t));
                        }
                    }
                }
            }
            for (int i = 0; i < mb; i++) {
                __m512 f = block_sum(_mm512_add_epi32(a[i][0], h[i][0]), _mm512_add_epi32(a[i][1], h[i][1]),
                                     _mm512_add_epi32(a[i][2], h[i][2]), offset, sums[i][2 * b + 1]);
                acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(sv, _mm512_set1_ps(sums[i][2 * b])), f, acc[i]);
            }
        }
    }
}

/* Each row's 4 lanes summed: out[4]. */
static inline void finish(__m512 acc, float *out) {
    __m512 t = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4e));
    t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xb1));
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, t)));
}

static void tile_rows(int bits, const uint8_t *p, const float *s, const uint8_t *z, int64_t groups, int64_t gsize,
                      const int8_t *digits, const float *sums, int64_t dstride, int64_t nblocks,
                      int64_t m, float bias, float *out) {
    for (int64_t i = 0; i < m; i += 2) {
        const int8_t *dig[2] = {digits + i * dstride, digits + (i + 1 < m ? i + 1 : i) * dstride};
        const float *sm[2] = {sums + i * 2 * nblocks, sums + (i + 1 < m ? i + 1 : i) * 2 * nblocks};
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        int two = i + 1 < m;
        if (bits == 4 && two) tile_blocks(4, 2, p, s, z, groups, gsize, dig, sm, bias, acc);
        else if (bits == 4) tile_blocks(4, 1, p, s, z, groups, gsize, dig, sm, bias, acc);
        else if (two) tile_blocks(8, 2, p, s, z, groups, gsize, dig, sm, bias, acc);
        else tile_blocks(8, 1, p, s, z, groups, gsize, dig, sm, bias, acc);
        finish(acc[0], out + i * 4);
        if (two) finish(acc[1], out + (i + 1) * 4);
    }
}

/* Bytes of digits per x row and blocks per row for kp inputs in `groups` groups of gsize. */
void llmopt_vnni_sizes(int64_t kp, int64_t groups, int64_t gsize, int64_t *dstride, int64_t *nblocks) {
    *dstride = kp / 16 * DIGITS;
    *nblocks = groups * ((gsize + BLOCK - 1) / BLOCK);
}

/* One fp32 x row (kp entries, zero-padded) as digits d (64-byte aligned) and block figures xs. */
void llmopt_vnni_quantize(const float *row, int64_t gsize, int64_t groups, int8_t *d, float *xs) {
    quantize_row(row, gsize, groups, d, xs);
}

/* Tiles [t0, t1) of y[M][N] (+ bias) for int4 (bits 4, symmetric zero 8 when zeros is NULL) or int8 (bits 8,
 * zero 0) tiles against M x rows prepared by llmopt_vnni_quantize (digits [M][dstride], sums [M][2 * nblocks]);
 * y fp32 or bf16 (elem). */
void llmopt_vnni_run(int bits, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                     int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t dstride,
                     int64_t nblocks, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0,
                     int64_t t1) {
    size_t tile_bytes = (size_t)(4 * kp * bits / 8);
    float zero_bias = zeros ? 0.0f : (bits == 4 ? 8.0f : 0.0f), code_bias = bits == 8 ? 128.0f : 0.0f;
    float out[16 * 4];
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *z = zeros ? (const uint8_t *)zeros + t * groups * 4 : NULL;
        for (int64_t i0 = 0; i0 < m; i0 += 16) {
            int64_t mm = m - i0 < 16 ? m - i0 : 16;
            tile_rows(bits, (const uint8_t *)tiles + t * tile_bytes, scales + t * groups * 4, z, groups, gsize,
                      digits + i0 * dstride, sums + i0 * 2 * nblocks, dstride, nblocks, mm, code_bias + zero_bias,
                      out);
            for (int64_t i = 0; i < mm; i++)
                for (int r = 0; r < 4 && t * 4 + r < n; r++) {
                    float v = out[i * 4 + r] + (bias ? bias[t * 4 + r] : 0.0f);
                    if (elem == 0) ((float *)y)[(i0 + i) * ys + t * 4 + r] = v;
                    else ((uint16_t *)y)[(i0 + i) * ys + t * 4 + r] = llmopt_f32_to_bf16(v);
                }
        }
    }
}
#else
/* Not built with VNNI: llmopt_gemv_vnni() says so, and gemv.c never calls the others. */
int llmopt_gemv_vnni(void) { return 0; }

void llmopt_vnni_sizes(int64_t kp, int64_t groups, int64_t gsize, int64_t *dstride, int64_t *nblocks) {
    (void)kp; (void)groups; (void)gsize;
    *dstride = *nblocks = 0;
}

void llmopt_vnni_quantize(const float *row, int64_t gsize, int64_t groups, int8_t *d, float *xs) {
    (void)row; (void)gsize; (void)groups; (void)d; (void)xs;
}

void llmopt_vnni_run(int bits, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                     int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t dstride,
                     int64_t nblocks, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0,
                     int64_t t1) {
    (void)bits; (void)tiles; (void)scales; (void)zeros; (void)groups; (void)gsize; (void)bias; (void)digits;
    (void)sums; (void)dstride; (void)nblocks; (void)y; (void)ys; (void)elem; (void)m; (void)n; (void)kp; (void)t0;
    (void)t1;
}
#endif
