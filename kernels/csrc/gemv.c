/* Matrix-vector products for decode on CPU: y[M][N] = x[M][K] @ W[N][K].T (+ bias) for a few rows M,
 * the weight streamed from memory once per call.
 *
 * At decode a step is bound by how fast the weights stream from memory. torch's fp32 GEMV (MKL) reached
 * about a third of this machine's read bandwidth on decoder-sized matrices. Here the weight is stored
 * once, at load time, in tiles of 4 output rows (TILE_ROWS): tile t holds rows 4t..4t+3, and its
 * inputs come in steps, each step holding the 4 rows' next inputs side by side. A thread then reads one
 * contiguous slab of memory from start to end (one stream the hardware prefetcher follows; reading 4
 * separate rows measured 20-26 GB/s here, one stream 26-30), computes 4 outputs at a time, and reuses
 * a tile from L1/L2 for all M rows of x.
 *
 * Weights: fp32 or bf16 (steps of 16 inputs, rows and inputs zero-padded to whole tiles and steps),
 * int4 in groups (weight-only W4A16; steps of 32 inputs, see llmopt_gemv_w4) or int8 per channel or in
 * groups (W8A16; steps of 16, see llmopt_gemv_w8).
 * Activations and outputs: fp32 or bf16 (elem 0 / 1); arithmetic in fp32 throughout.
 *
 * Every output element is computed with the same operation order whatever M is and wherever its row
 * falls in a thread's slab (a 16-lane vector accumulator over K, one per output, then a fixed
 * reduction), so a sequence's logits do not depend on what else is in the batch.
 *
 * The fast paths need AVX-512 (llmopt_gemv_fast() says whether the build has them); the portable
 * loops below them are kept for correctness on other CPUs, and callers there stay on torch.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "llmopt.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define FAST 1
#else
#define FAST 0
#endif

int llmopt_gemv_fast(void) { return FAST; }

/* x rows (fp32 or bf16, row stride xs) -> a contiguous fp32 copy [M][kp] (zero-padded from K to kp)
 * that the threads share. */
static float *load_x(const void *x, int64_t xs, int elem, int64_t m, int64_t k, int64_t kp) {
    float *out = llmopt_alloc(sizeof(float) * (size_t)(m * kp));
    if (!out) return NULL;
    for (int64_t i = 0; i < m; i++) {
        float *row = out + i * kp;
        if (elem == 0) {
            memcpy(row, (const float *)x + i * xs, sizeof(float) * (size_t)k);
        } else {
            const uint16_t *src = (const uint16_t *)x + i * xs;
            for (int64_t j = 0; j < k; j++) row[j] = llmopt_bf16_to_f32(src[j]);
        }
        for (int64_t j = k; j < kp; j++) row[j] = 0.0f;
    }
    return out;
}

static inline void store_y(void *y, int64_t ys, int elem, int64_t i, int64_t n, float v, const float *bias) {
    if (bias) v += bias[n];
    if (elem == 0) ((float *)y)[i * ys + n] = v;
    else ((uint16_t *)y)[i * ys + n] = llmopt_f32_to_bf16(v);
}

#define TILE_ROWS 4

/* One tile of 4 rows (steps of 16 inputs, fp32 or bf16, kp = K rounded up to 16) against one fp32
 * x row of kp entries (zero-padded): out[4]. */
#if FAST
static inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

/* 16 weights from element `at` of a tile, as fp32. */
static inline __m512 w16(const void *tile, int welem, int64_t at) {
    if (welem == 0) return _mm512_loadu_ps((const float *)tile + at);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)tile + at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

static inline void tile_dot(const void *tile, int welem, int64_t kp, const float *xr, float out[4]) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0, at = 0; j < kp; j += 16, at += 64) { /* gcc unswitches the element type */
        __m512 xv = _mm512_loadu_ps(xr + j);
        a0 = _mm512_fmadd_ps(w16(tile, welem, at), xv, a0);
        a1 = _mm512_fmadd_ps(w16(tile, welem, at + 16), xv, a1);
        a2 = _mm512_fmadd_ps(w16(tile, welem, at + 32), xv, a2);
        a3 = _mm512_fmadd_ps(w16(tile, welem, at + 48), xv, a3);
    }
    out[0] = hsum(a0); out[1] = hsum(a1); out[2] = hsum(a2); out[3] = hsum(a3);
}
#else
static inline void tile_dot(const void *tile, int welem, int64_t kp, const float *xr, float out[4]) {
    for (int r = 0; r < 4; r++) {
        float a = 0.0f;
        for (int64_t j = 0; j < kp; j++) {
            int64_t at = (j / 16) * 64 + r * 16 + j % 16;
            a += (welem == 0 ? ((const float *)tile)[at] : llmopt_bf16_to_f32(((const uint16_t *)tile)[at])) * xr[j];
        }
        out[r] = a;
    }
}
#endif

/* Dense tiled weight (see the top; fp32 welem 0 or bf16 welem 1) for an [N][K] matrix; x [M][K] and
 * y [M][N] fp32 or bf16 (elem); bias fp32 [N] or NULL. */
int llmopt_gemv_dense(const void *x, int64_t xs, const void *tiles, int welem, const float *bias, void *y, int64_t ys,
                      int elem, int64_t m, int64_t n, int64_t k) {
    int64_t kp = (k + 15) / 16 * 16, ntiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    float *xf = load_x(x, xs, elem, m, k, kp);
    if (!xf) return 2;
    size_t tile_bytes = (size_t)(TILE_ROWS * kp) * (welem == 0 ? 4 : 2);
#pragma omp parallel
    {
        int64_t t0, t1;
        llmopt_thread_slab(ntiles, &t0, &t1);
        for (int64_t t = t0; t < t1; t++) {
            const void *tile = (const char *)tiles + (size_t)t * tile_bytes;
            for (int64_t i = 0; i < m; i++) {
                float out[4];
                tile_dot(tile, welem, kp, xf + i * kp, out);
                for (int r = 0; r < TILE_ROWS && t * TILE_ROWS + r < n; r++)
                    store_y(y, ys, elem, i, t * TILE_ROWS + r, out[r], bias);
            }
        }
    }
    free(xf);
    return 0;
}

/* int4 weight, group-wise, tiled like the dense ones (converted once at load time by
 * llmopt.kernels.cpu_native.Int4Weight): tile t = rows 4t..4t+3 (zero rows pad N), steps of 32 inputs,
 * each step 4 x 16 bytes, one 16-byte chunk per row: byte j holds input j (low nibble) and input
 * j + 16 (high nibble) of the step; stored values 0..15. scales [tiles][K / group][4] fp32; zeros
 * [tiles][K / group][4] uint8 (the stored value meaning 0) or NULL for symmetric (8).
 * Output = sum of ((q - zero) * scale) * x, as for the dequantized fp32 weight; group and K multiples of 32. */
#if FAST

/* Rows r0..r0+RB-1 of a tile against x rows 0..MB-1 (RB * MB <= 8 accumulators in registers). Per row
 * and group, a 16-entry table holds the 16 dequantized values (j - zero) * scale; a permute picks each
 * weight from it by its nibble (vpermps reads only an index's low 4 bits), so a 16-byte chunk becomes 32
 * fp32 weights in four instructions, then feeds all MB x rows. Every output's operations and their order
 * are the same whatever RB and MB are, so results do not depend on M. */
static inline __attribute__((always_inline)) void w4_block(const uint8_t *p, const float *s, const uint8_t *z,
        int64_t groups, int64_t group, const float *xr, int64_t k, const int r0, const int rb, const int mb,
        float *out) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 acc[4][4];
    for (int r = 0; r < rb; r++)
        for (int i = 0; i < mb; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 table[4];
        for (int r = 0; r < rb; r++)
            table[r] = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps((float)(z ? z[g * 4 + r0 + r] : 8))),
                                     _mm512_set1_ps(s[g * 4 + r0 + r]));
        for (int64_t c = g * group; c < (g + 1) * group; c += 32) {
            const uint8_t *step = p + c * 2;  /* a step of 32 inputs is 64 bytes, 16 per row */
            for (int r = 0; r < rb; r++) {
                __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(step + 16 * (r0 + r))));
                __m512 lo = _mm512_permutexvar_ps(v, table[r]);
                __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), table[r]);
                for (int i = 0; i < mb; i++)
                    acc[r][i] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xr + i * k + c + 16),
                                                _mm512_fmadd_ps(lo, _mm512_loadu_ps(xr + i * k + c), acc[r][i]));
            }
        }
    }
    for (int r = 0; r < rb; r++)
        for (int i = 0; i < mb; i++) out[i * 4 + r0 + r] = hsum(acc[r][i]);
}

/* NAME(p, s, z, groups, gsize, xf, kp, m, out): a tile against M x rows, out [M][4], by BLOCK on register
 * blocks of (4 rows x 1-2 x rows) or (2 rows x 3-4 x rows). */
#define DEFINE_TILE_ROWS(NAME, BLOCK, PT, ZT)                                                            \
static void NAME(const void *pv, const float *s, const void *zv, int64_t groups, int64_t gsize,         \
                 const float *xf, int64_t kp, int64_t m, float *out) {                                  \
    const PT *p = pv;                                                                                   \
    const ZT *z = zv;                                                                                   \
    for (int64_t i = 0; i < m;) {                                                                       \
        const float *xr = xf + i * kp;                                                                  \
        float *o = out + i * 4;                                                                         \
        int64_t left = m - i;                                                                           \
        if (left == 1) BLOCK(p, s, z, groups, gsize, xr, kp, 0, 4, 1, o);                               \
        else if (left == 2) BLOCK(p, s, z, groups, gsize, xr, kp, 0, 4, 2, o);                          \
        else if (left == 3) {                                                                           \
            BLOCK(p, s, z, groups, gsize, xr, kp, 0, 2, 3, o);                                          \
            BLOCK(p, s, z, groups, gsize, xr, kp, 2, 2, 3, o);                                          \
        } else {                                                                                        \
            BLOCK(p, s, z, groups, gsize, xr, kp, 0, 2, 4, o);                                          \
            BLOCK(p, s, z, groups, gsize, xr, kp, 2, 2, 4, o);                                          \
        }                                                                                               \
        i += left < 4 ? left : 4;                                                                       \
    }                                                                                                   \
}

DEFINE_TILE_ROWS(w4_tile_rows, w4_block, uint8_t, uint8_t)
#else
/* Portable twin of both quantized tile kernels: bits 4 (nibbles, steps of 32, zero default 8, uint8 zeros) or
 * 8 (int8, steps of 16, zero default 0, int8 zeros); gsize = the group in inputs. */
static void scalar_tile_rows(int bits, const void *pv, const float *s, const void *zv, int64_t groups,
                             int64_t gsize, const float *xf, int64_t kp, int64_t m, float *out) {
    for (int r = 0; r < 4; r++)
        for (int64_t i = 0; i < m; i++) {
            float acc = 0.0f;
            for (int64_t g = 0; g < groups; g++) {
                float d = 0.0f;
                int zero = zv ? (bits == 4 ? ((const uint8_t *)zv)[g * 4 + r] : ((const int8_t *)zv)[g * 4 + r])
                              : (bits == 4 ? 8 : 0);
                for (int64_t c = g * gsize; c < (g + 1) * gsize; c++) {
                    int q;
                    if (bits == 4) {
                        uint8_t b = ((const uint8_t *)pv)[(c / 32) * 64 + r * 16 + c % 16];
                        q = (c % 32) < 16 ? (b & 15) : (b >> 4);
                    } else {
                        q = ((const int8_t *)pv)[(c / 16) * 64 + r * 16 + c % 16];
                    }
                    d += (float)(q - zero) * xf[i * kp + c];
                }
                acc += d * s[g * 4 + r];
            }
            out[i * 4 + r] = acc;
        }
}

static void w4_tile_rows(const void *p, const float *s, const void *z, int64_t groups, int64_t group,
                         const float *xf, int64_t k, int64_t m, float *out) {
    scalar_tile_rows(4, p, s, z, groups, group, xf, k, m, out);
}
#endif

typedef void (*tile_rows_fn)(const void *p, const float *s, const void *z, int64_t groups, int64_t gsize,
                             const float *xf, int64_t kp, int64_t m, float *out);

/* The quantized GEMVs' common part: tiles of tile_bytes, scales and 1-byte zero points [tiles][groups][4],
 * x zero-padded to kp; each thread runs its slab of tiles through `rows`. */
static int quant_gemv(tile_rows_fn rows, size_t tile_bytes, const void *x, int64_t xs, const void *tiles,
                      const float *scales, const void *zeros, int64_t groups, int64_t gsize, const float *bias, void *y,
                      int64_t ys, int elem, int64_t m, int64_t n, int64_t k, int64_t kp) {
    float *xf = load_x(x, xs, elem, m, k, kp);
    if (!xf) return 2;
    int64_t ntiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    int failed = 0;
#pragma omp parallel
    {
        int64_t t0, t1;
        llmopt_thread_slab(ntiles, &t0, &t1);
        float *out = llmopt_alloc(sizeof(float) * (size_t)(m * TILE_ROWS));
        if (!out) {
#pragma omp atomic write
            failed = 2;
        } else {
            for (int64_t t = t0; t < t1; t++) {
                const void *z = zeros ? (const char *)zeros + t * groups * TILE_ROWS : NULL;
                rows((const char *)tiles + (size_t)t * tile_bytes, scales + t * groups * TILE_ROWS, z, groups, gsize,
                     xf, kp, m, out);
                for (int64_t i = 0; i < m; i++)
                    for (int r = 0; r < TILE_ROWS && t * TILE_ROWS + r < n; r++)
                        store_y(y, ys, elem, i, t * TILE_ROWS + r, out[i * TILE_ROWS + r], bias);
            }
            free(out);
        }
    }
    free(xf);
    return failed;
}

int llmopt_gemv_w4(const void *x, int64_t xs, const uint8_t *packed, const float *scales, const uint8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k) {
    if (group % 32 || k % group) return 1;
    int rc = llmopt_gemv_quant_vnni(4, x, xs, packed, scales, zeros, k / group, group, bias, y, ys, elem, m, n, k, k);
    if (rc != 3) return rc; /* 3: no VNNI in this build */
    return quant_gemv(w4_tile_rows, (size_t)(TILE_ROWS * k / 2), x, xs, packed, scales, zeros, k / group, group, bias, y,
                      ys, elem, m, n, k, k);
}

/* int8 weight, group-wise (weight-only W8A16), tiled like the dense ones: tile t = rows 4t..4t+3, steps of
 * 16 inputs, each step 4 x 16 int8; K zero-padded to whole steps. scales [tiles][groups][4] fp32; zeros
 * [tiles][groups][4] int8 or NULL (0). A group is `gsteps` steps; output = sum over groups of
 * scale * sum((q - zero) * x). */
#if FAST
static inline __attribute__((always_inline)) void w8_block(const int8_t *p, const float *s, const int8_t *z,
        int64_t groups, int64_t gsteps, const float *xr, int64_t kp, const int r0, const int rb, const int mb,
        float *out) {
    __m512 acc[4][4], d[4][4];
    for (int r = 0; r < rb; r++)
        for (int i = 0; i < mb; i++) acc[r][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i zero[4];
        for (int r = 0; r < rb; r++) {
            zero[r] = _mm512_set1_epi32(z ? z[g * 4 + r0 + r] : 0);
            for (int i = 0; i < mb; i++) d[r][i] = _mm512_setzero_ps();
        }
        for (int64_t c = g * gsteps; c < (g + 1) * gsteps; c++) {
            for (int r = 0; r < rb; r++) {
                __m128i q = _mm_loadu_si128((const __m128i *)(p + c * 64 + 16 * (r0 + r)));
                __m512 w = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepi8_epi32(q), zero[r]));
                for (int i = 0; i < mb; i++)
                    d[r][i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xr + i * kp + c * 16), d[r][i]);
            }
        }
        for (int r = 0; r < rb; r++)
            for (int i = 0; i < mb; i++)
                acc[r][i] = _mm512_fmadd_ps(d[r][i], _mm512_set1_ps(s[g * 4 + r0 + r]), acc[r][i]);
    }
    for (int r = 0; r < rb; r++)
        for (int i = 0; i < mb; i++) out[i * 4 + r0 + r] = hsum(acc[r][i]);
}

DEFINE_TILE_ROWS(w8_tile_rows, w8_block, int8_t, int8_t)
#else
static void w8_tile_rows(const void *p, const float *s, const void *z, int64_t groups, int64_t gsteps,
                         const float *xf, int64_t kp, int64_t m, float *out) {
    scalar_tile_rows(8, p, s, z, groups, gsteps * 16, xf, kp, m, out);
}
#endif

int llmopt_gemv_w8(const void *x, int64_t xs, const int8_t *tiles, const float *scales, const int8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k) {
    int64_t kp = (k + 15) / 16 * 16, groups = group >= k ? 1 : k / group;
    if (groups > 1 && (group % 16 || k % group)) return 1;
    int rc = llmopt_gemv_quant_vnni(8, x, xs, tiles, scales, zeros, groups, kp / groups, bias, y, ys, elem, m, n, k,
                                    kp);
    if (rc != 3) return rc; /* 3: no VNNI in this build */
    return quant_gemv(w8_tile_rows, (size_t)(TILE_ROWS * kp), x, xs, tiles, scales, zeros, groups, kp / 16 / groups,
                      bias, y, ys, elem, m, n, k, kp);
}
