/* Prefill matmuls on weight-only quantized weights (W4, W8) with AMX: y[M][N] = x[M][K] @ W.T, W = (q - zero)
 * * scale dequantized in panels of 32 output columns straight into the tile layout, never as a whole dense
 * weight.
 *
 * A oneDNN bf16 GEMM on a dense weight dequantized per call (csrc/dequant.c) pays for the dense weight
 * twice: writing it (a few MiB per layer, out of cache), then oneDNN's own copy of a plain weight into
 * its blocked layout. Here each thread dequantizes a group of panels (32 columns x K each, in L2) already
 * in the layout of AMX B tiles, then runs every block of 32 rows of x (in L1) over them.
 *
 * Tiles (palette 1): C 0..3 = 2 x 2 blocks of 16 rows x 16 columns fp32; A 4, 5 = 16 rows of x x 32
 * inputs (bf16, straight from x, zero-padded to whole blocks of 32 rows); B 6, 7 = 16 input pairs x 16
 * columns: row p holds, for each column n, the bf16 pair (W[n][2p], W[n][2p + 1]) of the step.
 * TDPBF16PS accumulates in fp32: weight elements are bf16((q - zero) * scale) computed in fp32 (as
 * csrc/dequant.c), activations bf16, sums fp32, one rounding to the output dtype.
 *
 * Codes: W4 in compressed-tensors' int32 [N][K/8] (byte b of a row: inputs 2b low nibble, 2b + 1 high),
 * stored values 0..15 (symmetric: zero 8); W8 int8 [N][K] (symmetric: zero 0). Scales and zeros transposed
 * once by the caller to fp32 [G][N] (zeros NULL: symmetric). N, K and the group multiples of 32 (checked).
 */
#include <stdint.h>
#include <string.h>

#include "llmopt.h"
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX 1
#else
#define AMX 0
#endif

#if AMX
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define PANELS_PER_GROUP 8

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static void load_config(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* B tile of columns n0..n0+15, inputs 32s..32s+31: row p = 16 dwords, dword n = bf16 pair of inputs
 * (32s + 2p, 32s + 2p + 1) of row n0 + n. Gathers one dword (4 bytes = pairs 4j..4j+3) of each row. */
static const int16_t INTERLEAVE[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* B-tile row from the codes of 16 columns: lane n = bf16((lo - z) * s) | bf16((hi - z) * s) << 16. */
static inline void b_row(__m512i lo, __m512i hi, __m512 s, __m512 z, __m512i interleave, uint32_t *out) {
    __m512 flo = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(lo), z), s);
    __m512 fhi = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(hi), z), s);
    __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(fhi, flo); /* [16 x bf16(flo) | 16 x bf16(fhi)] */
    _mm512_store_si512((void *)out, _mm512_permutexvar_epi16(interleave, halves));
}

/* B tile of columns n0..n0+15, inputs 32s..32s+31 (row p: the pair 32s + 2p, 32s + 2p + 1 of each column),
 * from one gathered dword of each column's codes at a time: W4, 4 bytes = pairs 4j..4j+3 (a byte holds a
 * pair: low nibble first); W8, 4 int8 = pairs 2j, 2j + 1. */
static void b_tile(const uint8_t *w, int64_t row_bytes, int bits, __m512 s, __m512 z, int64_t step, uint32_t *out) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32((int)row_bytes));
    const __m512i interleave = _mm512_loadu_si512((const void *)INTERLEAVE), nibble = _mm512_set1_epi32(15);
    if (bits == 4) {
        for (int j = 0; j < 4; j++) {
            __m512i d = _mm512_i32gather_epi32(rows, (const void *)(w + step * 16 + 4 * j), 1);
            for (int b = 0; b < 4; b++) {
                __m512i byte = _mm512_srli_epi32(d, 8 * b);
                b_row(_mm512_and_si512(byte, nibble), _mm512_and_si512(_mm512_srli_epi32(byte, 4), nibble), s, z,
                      interleave, out + (4 * j + b) * 16);
            }
        }
        return;
    }
    for (int j = 0; j < 8; j++) {
        __m512i d = _mm512_i32gather_epi32(rows, (const void *)(w + step * 32 + 4 * j), 1);
        /* sign-extended bytes 0..3 of each lane: shift the byte to the top, then arithmetic shift down */
        b_row(_mm512_srai_epi32(_mm512_slli_epi32(d, 24), 24), _mm512_srai_epi32(_mm512_slli_epi32(d, 16), 24), s, z,
              interleave, out + (2 * j) * 16);
        b_row(_mm512_srai_epi32(_mm512_slli_epi32(d, 8), 24), _mm512_srai_epi32(d, 24), s, z, interleave,
              out + (2 * j + 1) * 16);
    }
}

/* The panel of columns n0..n0+31: steps x 2 B tiles of 16 x 16 dwords. */
static void panel(const uint8_t *codes, int64_t row_bytes, int bits, const float *scales_t, const float *zeros_t,
                  int64_t group, int64_t n, int64_t n0, int64_t k, uint32_t *out) {
    /* the panel's 32 rows are one contiguous block of codes, read 4 bytes of 16 rows at a time: fetch it all
     * first, the misses overlapping */
    const char *block = (const char *)(codes + n0 * row_bytes);
    for (int64_t off = 0; off < 32 * row_bytes; off += 64) _mm_prefetch(block + off, _MM_HINT_T0);
    float zero = bits == 4 ? 8.0f : 0.0f; /* symmetric: stored values are q + 8 (W4), q (W8) */
    for (int64_t step = 0; step < k / 32; step++) {
        int64_t g = step * 32 / group;
        for (int t = 0; t < 2; t++) {
            int64_t c = n0 + 16 * t;
            __m512 s = _mm512_loadu_ps(scales_t + g * n + c);
            __m512 z = zeros_t ? _mm512_loadu_ps(zeros_t + g * n + c) : _mm512_set1_ps(zero);
            b_tile(codes + c * row_bytes, row_bytes, bits, s, z, step, out + (step * 2 + t) * 256);
        }
    }
}

static void store_rows(const float *c, int64_t rows, void *y, int64_t ys, int elem, int64_t n0) {
    for (int64_t i = 0; i < rows; i++) {
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_load_ps(c + i * 32 + 16 * h);
            if (elem == 0)
                _mm512_storeu_ps((float *)y + i * ys + n0 + 16 * h, v);
            else
                _mm256_storeu_si256((__m256i *)((uint16_t *)y + i * ys + n0 + 16 * h), (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
}
#endif

int llmopt_amx_available(void) {
#if AMX
    static int state = -1; /* the kernel grants tile data once per process; oneDNN asks the same way */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

/* x: bf16 [mp][K] contiguous, mp = M rounded up to 32 (the caller zero-pads); codes: W4 (bits 4) int32
 * [N][>= K/8] or W8 (bits 8) int8 [N][>= K], rows row_bytes apart; y: fp32 or bf16 (elem 0 / 1) [M][N], row
 * stride ys. 0: done, 1: bad shape or no AMX, 2: out of memory. */
int llmopt_amx_wq_matmul(const uint16_t *x, const void *codes, int64_t row_bytes, int bits, const float *scales_t,
                         const float *zeros_t, int64_t group, void *y, int64_t ys, int elem, int64_t m, int64_t n,
                         int64_t k) {
    if (!llmopt_amx_available() || n % 32 || k % 32 || group <= 0 || group % 32 || k % group || (bits != 4 && bits != 8)
        || row_bytes * (bits == 4 ? 2 : 1) < k)
        return 1;
#if AMX
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    /* Panels per group: a thread dequantizes a group (up to PANELS_PER_GROUP, in L2), then runs each block of
     * 32 rows of x (in L1) over all of them; groups sized so that the threads get even shares. */
    int64_t mp = (m + 31) / 32 * 32, panels = n / 32, panel_dwords = k / 32 * 2 * 256;
    int64_t rounds = (panels + threads * PANELS_PER_GROUP - 1) / (threads * PANELS_PER_GROUP);
    int64_t per_group = (panels + threads * rounds - 1) / (threads * rounds);
    int64_t per_thread = per_group * panel_dwords + 32 * 32; /* panels, then the C block (fp32) */
    uint32_t *buffers = llmopt_alloc(sizeof(uint32_t) * (size_t)(per_thread * threads));
    if (!buffers) return 2;
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        uint32_t *bp = buffers + tid * per_thread;
        float *c = (float *)(bp + per_group * panel_dwords);
        load_config();
#pragma omp for schedule(static)
        for (int64_t first = 0; first < panels; first += per_group) {
            int64_t count = panels - first < per_group ? panels - first : per_group;
            for (int64_t q = 0; q < count; q++)
                panel((const uint8_t *)codes, row_bytes, bits, scales_t, zeros_t, group, n, 32 * (first + q), k,
                      bp + q * panel_dwords);
            for (int64_t m0 = 0; m0 < mp; m0 += 32) {
                const uint16_t *xa = x + m0 * k;
                int64_t rows = m - m0 < 32 ? m - m0 : 32;
                for (int64_t q = 0; q < count; q++) {
                    const uint32_t *b = bp + q * panel_dwords;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t s = 0; s < k / 32; s++) {
                        _tile_loadd(4, xa + 32 * s, k * 2);
                        _tile_loadd(5, xa + 16 * k + 32 * s, k * 2);
                        _tile_loadd(6, b + (s * 2) * 256, 64);
                        _tile_loadd(7, b + (s * 2 + 1) * 256, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 4, 7);
                        _tile_dpbf16ps(2, 5, 6);
                        _tile_dpbf16ps(3, 5, 7);
                    }
                    _tile_stored(0, c, 128);
                    _tile_stored(1, c + 16, 128);
                    _tile_stored(2, c + 16 * 32, 128);
                    _tile_stored(3, c + 16 * 32 + 16, 128);
                    store_rows(c, rows, elem == 0 ? (void *)((float *)y + m0 * ys) : (void *)((uint16_t *)y + m0 * ys),
                               ys, elem, 32 * (first + q));
                }
            }
        }
        _tile_release();
    }
    free(buffers);
    return 0;
#else
    (void)x; (void)codes; (void)scales_t; (void)zeros_t; (void)y; (void)ys; (void)elem; (void)m;
    return 1;
#endif
}
