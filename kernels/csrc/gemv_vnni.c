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
#define VNNI_BUILD 1

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
static void quantize_row(const float *x, int64_t gsize, int64_t groups, int8_t *d, float *xs, int64_t amx_stride) {
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
                if (amx_stride) { /* AMX: A-tile rows, chunk of 64 inputs c at d + c * amx_stride, digit t 64 bytes on */
                    int8_t *at = d + (j / 64) * amx_stride + j % 64;
                    _mm_storeu_si128((__m128i *)at, _mm512_cvtepi32_epi8(d0));
                    _mm_storeu_si128((__m128i *)(at + 64), _mm512_cvtepi32_epi8(d1));
                    _mm_storeu_si128((__m128i *)(at + 128), _mm512_cvtepi32_epi8(d2));
                } else {
                    int8_t *at = d + (j / 16) * DIGITS;
                    _mm512_store_si512((void *)at, _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(d0)));
                    _mm512_store_si512((void *)(at + 64), _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(d1)));
                    _mm512_store_si512((void *)(at + 128), _mm512_broadcast_i32x4(_mm512_cvtepi32_epi8(d2)));
                }
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

/* A block's contribution to 16 fp32 sums: acc + (scale * sx) * (2^16 a2 + 2^8 a1 + a0 - offset * xsum), in
 * this order of explicit operations, so that the AMX form below (one output per lane) and the VNNI form with
 * whole outputs (`whole`: each output's int32 total in all 4 of its lanes) round alike. */
static inline __attribute__((always_inline)) __m512 block_whole(__m512i a0, __m512i a1, __m512i a2, __m512 offset,
                                                                float xsum, __m512 sv, float sx, __m512 acc) {
    __m512 f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a2), _mm512_set1_ps(65536.0f),
                               _mm512_fmadd_ps(_mm512_cvtepi32_ps(a1), _mm512_set1_ps(256.0f),
                                               _mm512_cvtepi32_ps(a0)));
    f = _mm512_fnmadd_ps(offset, _mm512_set1_ps(xsum), f);
    return _mm512_fmadd_ps(_mm512_mul_ps(sv, _mm512_set1_ps(sx)), f, acc);
}

/* Each lane <- the int32 total of its output's 4 lanes (exact). */
static inline __m512i output_total(__m512i a) {
    a = _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_BADC));
    return _mm512_add_epi32(a, _mm512_shuffle_epi32(a, _MM_PERM_CDAB));
}

/* The 4 scales (or zeros) of a tile's rows, each spread over its row's 4 lanes. */
static inline __m512 per_row(__m128 four) {
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    return _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
}

/* One tile against MB x rows: acc[i] gets each row's blocks, scaled. bits 4: steps of 32 inputs (byte j =
 * input j low nibble, j + 16 high), bits 8: steps of 16. */
static inline __attribute__((always_inline)) void tile_blocks(const int bits, const int mb, const int whole,
        const uint8_t *p, const float *s, const uint8_t *z, int64_t groups, int64_t gsize, const int8_t *const *dig,
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
                if (whole) {
                    acc[i] = block_whole(output_total(_mm512_add_epi32(a[i][0], h[i][0])),
                                         output_total(_mm512_add_epi32(a[i][1], h[i][1])),
                                         output_total(_mm512_add_epi32(a[i][2], h[i][2])), offset,
                                         sums[i][2 * b + 1], sv, sums[i][2 * b], acc[i]);
                    continue;
                }
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

/* `whole`: the form whose outputs equal the AMX form's (the rows below AMX_MIN_ROWS, see llmopt_vnni_run). */
static void tile_rows(int bits, int whole, const uint8_t *p, const float *s, const uint8_t *z, int64_t groups,
                      int64_t gsize, const int8_t *digits, const float *sums, int64_t dstride, int64_t nblocks,
                      int64_t m, float bias, float *out) {
    for (int64_t i = 0; i < m; i += 2) {
        const int8_t *dig[2] = {digits + i * dstride, digits + (i + 1 < m ? i + 1 : i) * dstride};
        const float *sm[2] = {sums + i * 2 * nblocks, sums + (i + 1 < m ? i + 1 : i) * 2 * nblocks};
        __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        int two = i + 1 < m;
        if (whole) { /* specialised: the flag is a constant inside tile_blocks */
            if (bits == 4 && two) tile_blocks(4, 2, 1, p, s, z, groups, gsize, dig, sm, bias, acc);
            else if (bits == 4) tile_blocks(4, 1, 1, p, s, z, groups, gsize, dig, sm, bias, acc);
            else if (two) tile_blocks(8, 2, 1, p, s, z, groups, gsize, dig, sm, bias, acc);
            else tile_blocks(8, 1, 1, p, s, z, groups, gsize, dig, sm, bias, acc);
        } else {
            if (bits == 4 && two) tile_blocks(4, 2, 0, p, s, z, groups, gsize, dig, sm, bias, acc);
            else if (bits == 4) tile_blocks(4, 1, 0, p, s, z, groups, gsize, dig, sm, bias, acc);
            else if (two) tile_blocks(8, 2, 0, p, s, z, groups, gsize, dig, sm, bias, acc);
            else tile_blocks(8, 1, 0, p, s, z, groups, gsize, dig, sm, bias, acc);
        }
        for (int r = 0; r <= two; r++) {
            if (whole) /* every lane of an output holds it: the first of each 4 */
                _mm_storeu_ps(out + (i + r) * 4, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, acc[r])));
            else
                finish(acc[r], out + (i + r) * 4);
        }
    }
}

/* Bytes of digits per x row and blocks per row for kp inputs in `groups` groups of gsize. */
void llmopt_vnni_sizes(int64_t kp, int64_t groups, int64_t gsize, int64_t *dstride, int64_t *nblocks) {
    *dstride = kp / 16 * DIGITS;
    *nblocks = groups * ((gsize + BLOCK - 1) / BLOCK);
}

/* One fp32 x row (kp entries, zero-padded) as digits d (64-byte aligned) and block figures xs; amx_stride 0:
 * the VNNI layout (llmopt_vnni_run's digits [M][dstride], d = row i's), else the AMX one (d = the row's first
 * A-tile rows, chunks of 64 inputs amx_stride bytes apart). */
void llmopt_vnni_quantize(const float *row, int64_t gsize, int64_t groups, int8_t *d, float *xs, int64_t amx_stride) {
    quantize_row(row, gsize, groups, d, xs, amx_stride);
}

/* Tiles [t0, t1) of y[M][N] (+ bias) for int4 (bits 4, symmetric zero 8 when zeros is NULL) or int8 (bits 8,
 * zero 0) tiles against M x rows prepared by llmopt_vnni_quantize (digits [M][dstride], sums [M][2 * nblocks]);
 * y fp32 or bf16 (elem). */
void llmopt_vnni_run(int bits, int whole, const void *tiles, const float *scales, const void *zeros, int64_t groups,
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
            tile_rows(bits, whole, (const uint8_t *)tiles + t * tile_bytes, scales + t * groups * 4, z,
                      groups, gsize,
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

void llmopt_vnni_quantize(const float *row, int64_t gsize, int64_t groups, int8_t *d, float *xs, int64_t amx_stride) {
    (void)row; (void)gsize; (void)groups; (void)d; (void)xs; (void)amx_stride;
}


void llmopt_vnni_run(int bits, int whole, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                     int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t dstride,
                     int64_t nblocks, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0,
                     int64_t t1) {
    (void)bits; (void)whole; (void)tiles; (void)scales; (void)zeros; (void)groups; (void)gsize; (void)bias; (void)digits;
    (void)sums; (void)dstride; (void)nblocks; (void)y; (void)ys; (void)elem; (void)m; (void)n; (void)kp; (void)t0;
    (void)t1;
}
#endif

/* The same GEMVs on AMX-INT8 tiles, for more than one row of x: on vpdpbusd each further row costs six more
 * instructions per 64 bytes of weights (about half a memory-bound row's time), on TDPBSUD a tile holds 5 rows'
 * three digits. The digits and block figures are those above; a block's int32 sums come whole per output, then
 * go through block_whole. A single row stays on vpdpbusd (it streams faster there) in its `whole` form, which
 * sums each output's 4 lanes in int32 before the same block_whole: a row's outputs are bit-identical alone
 * or in a batch, so a sequence's logits still do not depend on it.
 *
 * Tiles (palette 1): 0 = B, 16 quads of inputs x 16 outputs (4 of our tiles) x 4 bytes, unsigned codes;
 * 1, 2 = A, digits of up to 5 x rows each (row 3i + t: digit t of x row i, 64 inputs); 3, 4 = C, int32
 * [3 rows of x per digit][16 outputs]. */
#if defined(VNNI_BUILD) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define AMX_ROWS 5 /* x rows per A tile: 3 digits each, 15 of its 16 rows */

int llmopt_amx_available(void);

int llmopt_vnni_amx(int64_t kp, int64_t gsize) { return kp % 64 == 0 && gsize % 64 == 0 && llmopt_amx_available(); }

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void amx_configure(int rows0, int rows1) {
    struct amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    c.colsb[0] = 64, c.rows[0] = 16;
    c.colsb[1] = 64, c.rows[1] = (uint8_t)(3 * rows0);
    c.colsb[3] = 64, c.rows[3] = (uint8_t)(3 * rows0);
    if (rows1) {
        c.colsb[2] = 64, c.rows[2] = (uint8_t)(3 * rows1);
        c.colsb[4] = 64, c.rows[4] = (uint8_t)(3 * rows1);
    }
    _tile_loadconfig(&c);
}

/* Four 64-byte steps (4 rows x 4 dwords of 4 inputs, one per tile T) -> 4 B-tile rows: row q holds dword q of
 * each of the 16 outputs (output 4T + r). */
static inline void b_quads(__m512i v0, __m512i v1, __m512i v2, __m512i v3, uint8_t *out) {
    const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512i p0 = _mm512_permutexvar_epi32(tr, v0), p1 = _mm512_permutexvar_epi32(tr, v1);
    __m512i p2 = _mm512_permutexvar_epi32(tr, v2), p3 = _mm512_permutexvar_epi32(tr, v3);
    __m512i t0 = _mm512_shuffle_i32x4(p0, p1, 0x44), t1 = _mm512_shuffle_i32x4(p0, p1, 0xEE);
    __m512i t2 = _mm512_shuffle_i32x4(p2, p3, 0x44), t3 = _mm512_shuffle_i32x4(p2, p3, 0xEE);
    _mm512_store_si512((void *)out, _mm512_shuffle_i32x4(t0, t2, 0x88));
    _mm512_store_si512((void *)(out + 64), _mm512_shuffle_i32x4(t0, t2, 0xDD));
    _mm512_store_si512((void *)(out + 128), _mm512_shuffle_i32x4(t1, t3, 0x88));
    _mm512_store_si512((void *)(out + 192), _mm512_shuffle_i32x4(t1, t3, 0xDD));
}

/* The B tile of 64 inputs from `c` of tiles p[0..3] (NULL: a missing tile, zero codes). */
static inline void b_tile(int bits, const uint8_t *const *p, int64_t c, uint8_t *out) {
    const __m512i nib = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    __m512i v[4][4];
    for (int T = 0; T < 4; T++)
        for (int s = 0; s < 4; s++) v[T][s] = _mm512_setzero_si512();
    if (bits == 4) { /* two steps of 32: low nibbles inputs 0-15, high 16-31 */
        for (int T = 0; T < 4; T++) {
            if (!p[T]) continue;
            for (int h = 0; h < 2; h++) {
                const uint8_t *at = p[T] + (c / 32 + h) * 64;
                _mm_prefetch((const char *)at + AHEAD, _MM_HINT_T0);
                __m512i w = _mm512_loadu_si512((const void *)at);
                v[T][2 * h] = _mm512_and_si512(w, nib);
                v[T][2 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(w, 4), nib);
            }
        }
    } else { /* four steps of 16, codes with their sign bit flipped */
        for (int T = 0; T < 4; T++) {
            if (!p[T]) continue;
            for (int s = 0; s < 4; s++) {
                const uint8_t *at = p[T] + (c / 16 + s) * 64;
                if (s == 0) _mm_prefetch((const char *)at + AHEAD, _MM_HINT_T0);
                if (s == 2) _mm_prefetch((const char *)at + AHEAD, _MM_HINT_T0);
                v[T][s] = _mm512_xor_si512(_mm512_loadu_si512((const void *)at), flip);
            }
        }
    }
    for (int s = 0; s < 4; s++) b_quads(v[0][s], v[1][s], v[2][s], v[3][s], out + s * 256);
}

/* 16 outputs' figures of one group: 4 floats per tile from `base` + T * stride (a missing tile: 0). */
static inline __m512 per_output(const float *const *rows, int64_t at) {
    __m512 v = _mm512_setzero_ps();
    for (int T = 0; T < 4; T++)
        if (rows[T]) v = _mm512_insertf32x4(v, _mm_loadu_ps(rows[T] + at), T);
    return v;
}

void llmopt_vnni_run_amx(int bits, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                         int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t nblocks,
                         void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0, int64_t t1) {
    size_t tile_bytes = (size_t)(4 * kp * bits / 8);
    const float base_offset = (zeros ? 0.0f : (bits == 4 ? 8.0f : 0.0f)) + (bits == 8 ? 128.0f : 0.0f);
    const int64_t stride = m * 3 * 64; /* bytes between chunks of 64 inputs in the A layout */
    uint8_t btile[BLOCK / 64 * 1024] __attribute__((aligned(64))); /* a block's B tiles */
    int32_t cbuf[2][16 * 16] __attribute__((aligned(64)));
    for (int64_t i0 = 0; i0 < m; i0 += 2 * AMX_ROWS) {
        int rows0 = (int)(m - i0 < AMX_ROWS ? m - i0 : AMX_ROWS);
        int rows1 = (int)(m - i0 - rows0 < AMX_ROWS ? m - i0 - rows0 : AMX_ROWS);
        if (t1 <= t0) break;
        amx_configure(rows0, rows1);
        for (int64_t t = t0; t < t1; t += 4) {
            const uint8_t *p[4];
            const float *srow[4];
            const uint8_t *zrow[4];
            for (int T = 0; T < 4; T++) {
                int in = t + T < t1;
                p[T] = in ? (const uint8_t *)tiles + (t + T) * tile_bytes : NULL;
                srow[T] = in ? scales + (t + T) * groups * 4 : NULL;
                zrow[T] = in && zeros ? (const uint8_t *)zeros + (t + T) * groups * 4 : NULL;
            }
            __m512 acc[2 * AMX_ROWS];
            for (int i = 0; i < rows0 + rows1; i++) acc[i] = _mm512_setzero_ps();
            int64_t b = 0;
            for (int64_t g = 0; g < groups; g++) {
                __m512 sv = per_output(srow, g * 4), offset = _mm512_set1_ps(base_offset);
                if (zeros) {
                    __m512i zz = _mm512_setzero_si512();
                    for (int T = 0; T < 4; T++) {
                        if (!zrow[T]) continue;
                        __m128i four = _mm_cvtsi32_si128(*(const int32_t *)(zrow[T] + g * 4));
                        __m128i wide = bits == 4 ? _mm_cvtepu8_epi32(four) : _mm_cvtepi8_epi32(four);
                        zz = _mm512_inserti32x4(zz, wide, T);
                    }
                    offset = _mm512_add_ps(offset, _mm512_cvtepi32_ps(zz));
                }
                for (int64_t b0 = g * gsize; b0 < (g + 1) * gsize; b0 += BLOCK, b++) {
                    int64_t b1 = b0 + BLOCK < (g + 1) * gsize ? b0 + BLOCK : (g + 1) * gsize;
                    _tile_zero(3);
                    if (rows1) _tile_zero(4);
                    /* the block's B tiles first: a tile load right after the stores that wrote it waits for them */
                    for (int64_t c = b0; c < b1; c += 64) b_tile(bits, p, c, btile + (c - b0) * 16);
                    for (int64_t c = b0; c < b1; c += 64) {
                        _tile_loadd(0, btile + (c - b0) * 16, 64);
                        const int8_t *a = digits + (c / 64) * stride + i0 * 3 * 64;
                        _tile_loadd(1, a, 64);
                        _tile_dpbsud(3, 1, 0);
                        if (rows1) {
                            _tile_loadd(2, a + rows0 * 3 * 64, 64);
                            _tile_dpbsud(4, 2, 0);
                        }
                    }
                    _tile_stored(3, cbuf[0], 64);
                    if (rows1) _tile_stored(4, cbuf[1], 64);
                    for (int i = 0; i < rows0 + rows1; i++) {
                        const int32_t *cr = i < rows0 ? cbuf[0] + 3 * i * 16 : cbuf[1] + 3 * (i - rows0) * 16;
                        const float *xs = sums + (i0 + i) * 2 * nblocks + 2 * b;
                        acc[i] = block_whole(_mm512_load_si512((const void *)cr),
                                             _mm512_load_si512((const void *)(cr + 16)),
                                             _mm512_load_si512((const void *)(cr + 32)), offset, xs[1], sv, xs[0],
                                             acc[i]);
                    }
                }
            }
            int64_t outs = (t1 - t) * 4 < 16 ? (t1 - t) * 4 : 16;
            for (int i = 0; i < rows0 + rows1; i++) {
                float o[16] __attribute__((aligned(64)));
                _mm512_store_ps(o, acc[i]);
                for (int64_t r = 0; r < outs && t * 4 + r < n; r++) {
                    float v = o[r] + (bias ? bias[t * 4 + r] : 0.0f);
                    if (elem == 0) ((float *)y)[(i0 + i) * ys + t * 4 + r] = v;
                    else ((uint16_t *)y)[(i0 + i) * ys + t * 4 + r] = llmopt_f32_to_bf16(v);
                }
            }
        }
        _tile_release();
    }
}
#else
int llmopt_vnni_amx(int64_t kp, int64_t gsize) {
    (void)kp; (void)gsize;
    return 0;
}

void llmopt_vnni_run_amx(int bits, const void *tiles, const float *scales, const void *zeros, int64_t groups,
                         int64_t gsize, const float *bias, const int8_t *digits, const float *sums, int64_t nblocks,
                         void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t kp, int64_t t0, int64_t t1) {
    (void)bits; (void)tiles; (void)scales; (void)zeros; (void)groups; (void)gsize; (void)bias; (void)digits;
    (void)sums; (void)nblocks; (void)y; (void)ys; (void)elem; (void)m; (void)n; (void)kp; (void)t0; (void)t1;
}
#endif
