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

/* Row i of x (fp32 or bf16, k entries) -> fp32, zero-padded to kp. */
static void load_row(const void *x, int elem, int64_t k, int64_t kp, float *row) {
    if (elem == 0) {
        memcpy(row, x, sizeof(float) * (size_t)k);
    } else {
        const uint16_t *src = x;
        for (int64_t j = 0; j < k; j++) row[j] = llmopt_bf16_to_f32(src[j]);
    }
    for (int64_t j = k; j < kp; j++) row[j] = 0.0f;
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

/* Dense tiled weight (see the top; fp32 welem 0 or bf16 welem 1) for an [N][K] matrix: tiles [t0, t1) of y
 * [M][N] (fp32 or bf16, elem) from x in fp32 [M][kp]; bias fp32 [N] or NULL. */
static void dense_tiles(const float *xf, const void *tiles, int welem, const float *bias, void *y, int64_t ys, int elem,
                        int64_t m, int64_t n, int64_t kp, int64_t t0, int64_t t1) {
    size_t tile_bytes = (size_t)(TILE_ROWS * kp) * (welem == 0 ? 4 : 2);
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

#ifndef AMX_MIN_ROWS
#define AMX_MIN_ROWS 2 /* rows of x from which the AMX form runs, where it can (shape_t.amx) */
#endif

typedef void (*tile_rows_fn)(const void *p, const float *s, const void *z, int64_t groups, int64_t gsize,
                             const float *xf, int64_t kp, int64_t m, float *out);

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


typedef void (*tile_rows_fn)(const void *p, const float *s, const void *z, int64_t groups, int64_t gsize,
                             const float *xf, int64_t kp, int64_t m, float *out);

/* What a linear's kernels need to know of its shape. */
typedef struct {
    int64_t kp;          /* K padded to whole steps: the length of a prepared x row */
    int64_t groups;      /* quantization groups along K (1 for dense) */
    int64_t gsize;       /* inputs per group, as the VNNI kernels take it */
    int64_t gunit;       /* the portable tile kernels' group: inputs (int4) or steps of 16 (int8) */
    size_t tile_bytes;
    int bits;            /* 0 dense, 4, 8 */
    int vnni;            /* quantized, on the VNNI kernels */
    int amx;             /* ... on their AMX-INT8 form (gemv_vnni.c), for every M */
    int64_t dstride, nblocks; /* VNNI: bytes of digits per row, blocks (scale and sum) per row */
} shape_t;

static int linear_shape(const llmopt_linear *l, shape_t *s) {
    memset(s, 0, sizeof(*s));
    if (l->n <= 0 || l->k <= 0) return 1;
    if (l->kind == 0) {
        s->kp = (l->k + 15) / 16 * 16, s->groups = 1, s->bits = 0;
        s->tile_bytes = (size_t)(TILE_ROWS * s->kp) * (l->welem == 0 ? 4 : 2);
        return 0;
    }
    if (l->kind == 1) {
        if (l->group <= 0 || l->group % 32 || l->k % l->group) return 1;
        s->bits = 4, s->kp = l->k, s->groups = l->k / l->group, s->gsize = s->gunit = l->group;
        s->tile_bytes = (size_t)(TILE_ROWS * l->k / 2);
    } else if (l->kind == 2) {
        s->bits = 8, s->kp = (l->k + 15) / 16 * 16, s->groups = l->group >= l->k ? 1 : l->k / l->group;
        if (s->groups > 1 && (l->group % 16 || l->k % l->group)) return 1;
        s->gsize = s->kp / s->groups, s->gunit = s->kp / 16 / s->groups;
        s->tile_bytes = (size_t)(TILE_ROWS * s->kp);
    } else {
        return 1;
    }
    s->vnni = llmopt_gemv_vnni();
    if (s->vnni) {
        llmopt_vnni_sizes(s->kp, s->groups, s->gsize, &s->dstride, &s->nblocks);
        s->amx = llmopt_vnni_amx(s->kp, s->gsize);
    }
    return 0;
}

static size_t round64(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* Scratch layout for M rows: VNNI digits [M][dstride] (64-byte aligned), fp32 x [M][kp], VNNI block figures
 * [M][2 * nblocks]. */
static void scratch_parts(const shape_t *s, void *scratch, int64_t m, int8_t **digits, float **xf, float **sums) {
    char *at = scratch;
    *digits = (int8_t *)at;
    at += round64((size_t)(m * s->dstride));
    *xf = (float *)at;
    at += round64(sizeof(float) * (size_t)(m * s->kp));
    *sums = (float *)at;
}

int llmopt_gemv_check(const llmopt_linear *l) {
    shape_t s;
    return linear_shape(l, &s);
}

size_t llmopt_gemv_scratch(const llmopt_linear *l, int64_t m) {
    shape_t s;
    if (linear_shape(l, &s)) return 0;
    return round64((size_t)(m * s.dstride)) + round64(sizeof(float) * (size_t)(m * s.kp)) +
           round64(sizeof(float) * (size_t)(2 * m * s.nblocks));
}

int64_t llmopt_gemv_tiles(const llmopt_linear *l) { return (l->n + TILE_ROWS - 1) / TILE_ROWS; }

void llmopt_gemv_load_row(const llmopt_linear *l, const void *x, int elem, int64_t i, int64_t m, void *scratch) {
    shape_t s;
    int8_t *digits;
    float *xf, *sums;
    linear_shape(l, &s);
    scratch_parts(&s, scratch, m, &digits, &xf, &sums);
    load_row(x, elem, l->k, s.kp, xf + i * s.kp);
    int amx = s.amx && m >= AMX_MIN_ROWS; /* AMX layout: chunks of 64 inputs, each with all rows. 3 x 64 digits */
    if (s.vnni && s.bits)
        llmopt_vnni_quantize(xf + i * s.kp, s.gsize, s.groups, amx ? digits + i * 192 : digits + i * s.dstride,
                             sums + i * 2 * s.nblocks, amx ? m * 192 : 0);
}

void llmopt_gemv_run(const llmopt_linear *l, const void *scratch, int64_t m, void *y, int64_t ys, int elem,
                     int64_t t0, int64_t t1) {
    shape_t s;
    int8_t *digits;
    float *xf, *sums;
    linear_shape(l, &s);
    scratch_parts(&s, (void *)scratch, m, &digits, &xf, &sums);
    if (s.bits == 0) {
        dense_tiles(xf, l->weight, (int)l->welem, l->bias, y, ys, elem, m, l->n, s.kp, t0, t1);
        return;
    }
    if (s.amx && m >= AMX_MIN_ROWS) { /* fewer rows stream faster on vpdpbusd, in the form rounding as AMX does */
        llmopt_vnni_run_amx(s.bits, l->weight, l->scales, l->zeros, s.groups, s.gsize, l->bias, digits, sums,
                            s.nblocks, y, ys, elem, m, l->n, s.kp, t0, t1);
        return;
    }
    if (s.vnni) {
        llmopt_vnni_run(s.bits, s.amx, l->weight, l->scales, l->zeros, s.groups, s.gsize, l->bias, digits, sums,
                        s.dstride, s.nblocks, y, ys, elem, m, l->n, s.kp, t0, t1);
        return;
    }
    tile_rows_fn rows = s.bits == 4 ? w4_tile_rows : w8_tile_rows;
    for (int64_t t = t0; t < t1; t++) {
        const void *z = l->zeros ? (const char *)l->zeros + t * s.groups * TILE_ROWS : NULL;
        for (int64_t i0 = 0; i0 < m; i0 += 16) { /* 16 rows at a time: a whole number of the kernels' blocks */
            float out[16 * TILE_ROWS];
            int64_t mm = m - i0 < 16 ? m - i0 : 16;
            rows((const char *)l->weight + (size_t)t * s.tile_bytes, l->scales + t * s.groups * TILE_ROWS, z,
                 s.groups, s.gunit, xf + i0 * s.kp, s.kp, mm, out);
            for (int64_t i = 0; i < mm; i++)
                for (int r = 0; r < TILE_ROWS && t * TILE_ROWS + r < l->n; r++)
                    store_y(y, ys, elem, i0 + i, t * TILE_ROWS + r, out[i * TILE_ROWS + r], l->bias);
        }
    }
}

int llmopt_gemv(const llmopt_linear *l, const void *x, int64_t xs, void *y, int64_t ys, int elem, int64_t m) {
    if (llmopt_gemv_check(l)) return 1;
    void *scratch = llmopt_alloc(llmopt_gemv_scratch(l, m));
    if (!scratch) return 2;
    for (int64_t i = 0; i < m; i++)
        llmopt_gemv_load_row(l, (const char *)x + i * xs * (elem == 0 ? 4 : 2), elem, i, m, scratch);
    int64_t tiles = llmopt_gemv_tiles(l);
#pragma omp parallel
    {
        int64_t t0, t1;
        llmopt_thread_slab(tiles, &t0, &t1);
        llmopt_gemv_run(l, scratch, m, y, ys, elem, t0, t1);
    }
    free(scratch);
    return 0;
}

int llmopt_gemv_dense(const void *x, int64_t xs, const void *tiles, int welem, const float *bias, void *y, int64_t ys,
                      int elem, int64_t m, int64_t n, int64_t k) {
    llmopt_linear l = {0, welem, tiles, NULL, NULL, 0, bias, n, k};
    return llmopt_gemv(&l, x, xs, y, ys, elem, m);
}

int llmopt_gemv_w4(const void *x, int64_t xs, const uint8_t *packed, const float *scales, const uint8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k) {
    llmopt_linear l = {1, 0, packed, scales, zeros, group, bias, n, k};
    return llmopt_gemv(&l, x, xs, y, ys, elem, m);
}

int llmopt_gemv_w8(const void *x, int64_t xs, const int8_t *tiles, const float *scales, const int8_t *zeros,
                   int64_t group, const float *bias, void *y, int64_t ys, int elem, int64_t m, int64_t n, int64_t k) {
    llmopt_linear l = {2, 0, tiles, scales, zeros, group, bias, n, k};
    return llmopt_gemv(&l, x, xs, y, ys, elem, m);
}

