/*
 * amx.c -- the bf16 kernels of x86 (bf16_tier.h's algorithm): on Intel
 * AMX tiles (Sapphire Rapids and later), or with the same code on
 * AVX512-BF16's vdpbf16ps where the CPU has no tiles (Cooper Lake, Zen 4,
 * Zen 5): only the tile GEMM (gemm32) differs.  This file, and
 * amx_linear.c, are compiled with -mamx-tile -mamx-bf16 -mavx512bf16 (and
 * AVX-512 F/BW/DQ/VL); they are called only when mha_bf16_tier() said so
 * (CPUID, XCR0, and for the tiles Linux's permission for the tile data,
 * asked once with arch_prctl).
 *
 * AMX multiplies whole tiles: C (16 x 16 float32) += A (16 rows x 32
 * bf16) . B (32 x 16 bf16), where B is stored "VNNI": its row r holds the
 * pairs (B[2r][n], B[2r+1][n]) for n = 0..15, one 32-bit word each.  One
 * instruction is 16 x 16 x 32 multiply-adds.  Every product of the
 * forward and the backward is one tile GEMM (gemm32) on that one packed
 * layout (mha_bf16_pack_b): tiles 0-3 accumulate (rows 0-15 / 16-31 x
 * two 16-column chunks), 4-5 hold the A operands (rows 0-15 and 16-31),
 * 6-7 the B operands; the float32 softmax between the products runs on
 * AVX-512 vectors (simd.h).
 */
#define MHA_SIMD_AVX512
#include "simd.h"

#include "kernels.h"

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The tile configuration: palette 1, all eight tiles 16 rows x 64 bytes. */
typedef struct __attribute__((packed, aligned(64))) tilecfg {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

/* This thread's choice (mha_bf16_begin): the tiles, or vdpbf16ps on the
 * same layouts.  Per thread, as the tile configuration itself is. */
static _Thread_local int use_tiles;

void mha_bf16_begin(int tiles)
{
    use_tiles = tiles;
    if (!tiles)
        return;
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    /* GCC 12 does not see ldtilecfg read the struct and dropped the
     * stores above: the barrier makes them happen first. */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

void mha_bf16_end(void)
{
    if (use_tiles)
        _tile_release();
}

static inline __mmask16 lanes(int n)   /* the first n of 16 (n may be <0) */
{
    return n >= 16 ? (__mmask16)0xFFFF
         : n <= 0  ? (__mmask16)0
                   : (__mmask16)((1u << n) - 1);
}

/* ---- packing --------------------------------------------------------------
 * Every B operand is one layout (mha_bf16_pack_b): the K x N matrix Bm
 * whose (k, n) element is src[k sk + n sn], as tiles of 32 k x 16 n, tile
 * (kt, nt) at dst + (kt nnt + nt) 256 words, nnt = 2 ceil(N / 32), its
 * row r the pairs (Bm[32 kt + 2r][n], Bm[32 kt + 2r + 1][n]).  For K^T in
 * S = Q K^T, k is the head dim and n the key (sk = 1: a word is two dims
 * of one key, 16 keys gathered); for V in O += P V, k is the key and n
 * the dim (sn = 1: two rows of 16 elements widened and interleaved).
 * Zeros past K and N.
 */
void mha_bf16_pack_b(const uint16_t *src, int64_t sk, int64_t sn, int64_t K,
                    int64_t N, uint32_t *dst)
{
    mha_bf16_pack_b_rows(src, sk, sn, K, N, 0, (K + 31) / 32, dst);
}

/* A whole tile of K^T (sk = 1): key n's 16 words (dims 32 kt ..) become
 * column n, a 16 x 16 transpose of 32-bit words in registers (two
 * unpack stages within 128-bit lanes, then two of whole lanes), where a
 * gather would load the 256 words one by one. */
static void pack_transposed(const uint16_t *src, int64_t sn, uint32_t *t)
{
    __m512i r[16], u[16];
    for (int n = 0; n < 16; n++)
        r[n] = _mm512_loadu_si512(src + n * sn);
    for (int n = 0; n < 16; n += 2) {   /* lane L: (n, n+1) words 4L.. */
        u[n] = _mm512_unpacklo_epi32(r[n], r[n + 1]);
        u[n + 1] = _mm512_unpackhi_epi32(r[n], r[n + 1]);
    }
    /* c[g][j], lane L: word 4L + j of keys 4g .. 4g + 3 */
    __m512i c[4][4];
    for (int g = 0; g < 4; g++) {
        c[g][0] = _mm512_unpacklo_epi64(u[4 * g], u[4 * g + 2]);
        c[g][1] = _mm512_unpackhi_epi64(u[4 * g], u[4 * g + 2]);
        c[g][2] = _mm512_unpacklo_epi64(u[4 * g + 1], u[4 * g + 3]);
        c[g][3] = _mm512_unpackhi_epi64(u[4 * g + 1], u[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {   /* tile row 4L + j: lane L of each g */
        const __m512i y0 = _mm512_shuffle_i32x4(c[0][j], c[1][j], 0x44);
        const __m512i y1 = _mm512_shuffle_i32x4(c[0][j], c[1][j], 0xEE);
        const __m512i y2 = _mm512_shuffle_i32x4(c[2][j], c[3][j], 0x44);
        const __m512i y3 = _mm512_shuffle_i32x4(c[2][j], c[3][j], 0xEE);
        _mm512_storeu_si512(t + (0 + j) * 16, _mm512_shuffle_i32x4(y0, y2, 0x88));
        _mm512_storeu_si512(t + (4 + j) * 16, _mm512_shuffle_i32x4(y0, y2, 0xDD));
        _mm512_storeu_si512(t + (8 + j) * 16, _mm512_shuffle_i32x4(y1, y3, 0x88));
        _mm512_storeu_si512(t + (12 + j) * 16, _mm512_shuffle_i32x4(y1, y3, 0xDD));
    }
}

void mha_bf16_pack_b_rows(const uint16_t *src, int64_t sk, int64_t sn,
                         int64_t K, int64_t N, int64_t kt0, int64_t kt1,
                         uint32_t *dst)
{
    const int64_t nnt = (N + 31) / 32 * 2;
    /* gathers index 16 n's by int32 element offsets */
    const int gather =
        sk == 1 && K % 2 == 0 && (N + 16) * sn < (INT64_C(1) << 30);
    const __m512i cols = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14,
                          15),
        _mm512_set1_epi32(gather ? (int)sn : 0));
    for (int64_t kt = kt0; kt < kt1; kt++)
        for (int64_t nt = 0; nt < nnt; nt++) {
            uint32_t *t = dst + (kt * nnt + nt) * 256;
            const int64_t n0 = 16 * nt;
            const int live = N - n0 >= 16 ? 16 : N - n0 <= 0 ? 0
                                                             : (int)(N - n0);
            const __mmask16 in = lanes(live);
            if (sk == 1 && live == 16 && 32 * kt + 32 <= K) {
                pack_transposed(src + n0 * sn + 32 * kt, sn, t);
                continue;
            }
            for (int r = 0; r < 16; r++) {
                const int64_t k0 = 32 * kt + 2 * r, k1 = k0 + 1;
                __m512i w;
                if (k0 >= K || live == 0) {
                    w = _mm512_setzero_si512();
                } else if (sn == 1) {   /* two rows of 16, widened */
                    const __m512i lo = _mm512_cvtepu16_epi32(
                        _mm256_maskz_loadu_epi16(in, src + k0 * sk + n0));
                    const __m512i hi =
                        k1 < K ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(
                                     in, src + k1 * sk + n0))
                               : _mm512_setzero_si512();
                    w = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
                } else if (gather) {    /* the word (k0, k1) of 16 n's */
                    w = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(),
                                                    in, cols,
                                                    src + n0 * sn + k0, 2);
                } else {                /* other strides */
                    uint32_t x[16];
                    for (int c = 0; c < 16; c++) {
                        const int64_t n = n0 + c;
                        const uint32_t lo = n < N ? src[k0 * sk + n * sn] : 0;
                        const uint32_t hi =
                            n < N && k1 < K ? src[k1 * sk + n * sn] : 0;
                        x[c] = lo | hi << 16;
                    }
                    w = _mm512_loadu_si512(x);
                }
                _mm512_storeu_si512(t + r * 16, w);
            }
        }
}

uint16_t mha_bf16_max_abs(const uint16_t *x, int64_t ld, int64_t rows,
                         int64_t n)
{
    const __m512i mag = _mm512_set1_epi16(0x7FFF);
    const __m512i inf = _mm512_set1_epi16(0x7F80);   /* exponent all ones */
    __m512i m = _mm512_setzero_si512();
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < n; j += 32) {
            const __mmask32 k = n - j >= 32 ? 0xFFFFFFFFu
                                            : (__mmask32)((1u << (n - j)) - 1);
            const __m512i v = _mm512_and_si512(
                mag, _mm512_maskz_loadu_epi16(k, x + r * ld + j));
            m = _mm512_mask_max_epu16(m, _mm512_cmplt_epu16_mask(v, inf), m,
                                      v);
        }
    const __m512i lo = _mm512_and_si512(m, _mm512_set1_epi32(0xFFFF));
    const __m512i hi = _mm512_srli_epi32(m, 16);
    return (uint16_t)_mm512_reduce_max_epu32(_mm512_max_epu32(lo, hi));
}

/*
 * C (32 x N floats, rows ldc apart) = (acc: +=) A (32 x K bf16, rows lda
 * apart) B, B packed by mha_bf16_pack_b with its tile (kt, nt) at
 * b + (kt * bstride + nt) * 256.  N and K multiples of 32; rows 16-31
 * only when two.
 */
static void gemm32_tiles(float *C, int ldc, int N, const uint16_t *A,
                         int lda, int K, const uint32_t *b, int64_t bstride,
                         int acc, int two)
{
    for (int nt = 0; nt < N / 16; nt += 2) {
        if (acc) {
            _tile_loadd(0, C + 16 * nt, ldc * 4);
            _tile_loadd(1, C + 16 * nt + 16, ldc * 4);
            if (two) {
                _tile_loadd(2, C + 16 * ldc + 16 * nt, ldc * 4);
                _tile_loadd(3, C + 16 * ldc + 16 * nt + 16, ldc * 4);
            }
        } else {
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(2);
                _tile_zero(3);
            }
        }
        for (int kt = 0; kt < K / 32; kt++) {
            const uint32_t *bt = b + ((int64_t)kt * bstride + nt) * 256;
            /* the next two B tiles into L1 while these multiply (tile
             * loads from L2 wait for their lines) */
            const uint32_t *nx = kt + 1 < K / 32 ? bt + bstride * 256
                                                 : b + (nt + 2) * 256;
            for (int x = 0; x < 2048; x += 64)
                _mm_prefetch((const char *)nx + x, _MM_HINT_T0);
            _tile_loadd(4, A + 32 * kt, lda * 2);
            _tile_loadd(6, bt, 64);
            _tile_loadd(7, bt + 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (two) {
                _tile_loadd(5, A + 16 * lda + 32 * kt, lda * 2);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, C + 16 * nt, ldc * 4);
        _tile_stored(1, C + 16 * nt + 16, ldc * 4);
        if (two) {
            _tile_stored(2, C + 16 * ldc + 16 * nt, ldc * 4);
            _tile_stored(3, C + 16 * ldc + 16 * nt + 16, ldc * 4);
        }
    }
}

/*
 * The same product with AVX512-BF16 (Cooper Lake, Zen 4 and later: no
 * tiles): a B tile's row is one zmm of 16 bf16 pairs, so vdpbf16ps takes
 * the packed layout as it is, with A's pair (A[r][2k], A[r][2k+1])
 * broadcast as one 32-bit word: C[r][n] += A[r][2k] B[2k][n] + A[r][2k+1]
 * B[2k+1][n], for blocks of 8 rows x 32 columns (16 accumulators, 2 B
 * vectors, a broadcast), k ascending: a fixed order, its own bits.
 */
static void gemm32_dp(float *C, int ldc, int N, const uint16_t *A, int lda,
                      int K, const uint32_t *b, int64_t bstride, int acc,
                      int two)
{
    enum { R = 8 };
    for (int nt = 0; nt < N / 16; nt += 2)
        for (int r0 = 0; r0 < (two ? 32 : 16); r0 += R) {
            __m512 c[R][2];
            for (int r = 0; r < R; r++)
                for (int w = 0; w < 2; w++)
                    c[r][w] = acc ? _mm512_loadu_ps(C + (r0 + r) * ldc +
                                                    16 * (nt + w))
                                  : _mm512_setzero_ps();
            for (int kt = 0; kt < K / 32; kt++) {
                const uint32_t *b0 = b + ((int64_t)kt * bstride + nt) * 256;
                for (int kk = 0; kk < 16; kk++) {
                    const __m512bh v0 =
                        (__m512bh)_mm512_loadu_si512(b0 + 16 * kk);
                    const __m512bh v1 =
                        (__m512bh)_mm512_loadu_si512(b0 + 256 + 16 * kk);
                    for (int r = 0; r < R; r++) {
                        int32_t w;
                        memcpy(&w, A + (r0 + r) * lda + 32 * kt + 2 * kk, 4);
                        const __m512bh a = (__m512bh)_mm512_set1_epi32(w);
                        c[r][0] = _mm512_dpbf16_ps(c[r][0], a, v0);
                        c[r][1] = _mm512_dpbf16_ps(c[r][1], a, v1);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                for (int w = 0; w < 2; w++)
                    _mm512_storeu_ps(C + (r0 + r) * ldc + 16 * (nt + w),
                                     c[r][w]);
        }
}

/* The tiles or the dot products, as this thread was configured. */
static void gemm32(float *C, int ldc, int N, const uint16_t *A, int lda,
                   int K, const uint32_t *b, int64_t bstride, int acc,
                   int two)
{
    if (use_tiles)
        gemm32_tiles(C, ldc, N, A, lda, K, b, bstride, acc, two);
    else
        gemm32_dp(C, ldc, N, A, lda, K, b, bstride, acc, two);
}


/* bf16_tier.h's pieces of this ISA: 2^n joined by vscalefps (which
 * takes n down to -200 to subnormals and 0), and bf16 rounding by
 * vcvtneps2bf16. */
#define vf_scale2 _mm512_scalef_ps
#define vf_store_bf16(p, v)                                                 \
    _mm256_storeu_si256((__m256i *)(p), (__m256i)_mm512_cvtneps_pbh(v))
#define vf_store_bf16_t(p, v, t)                                            \
    _mm256_mask_storeu_epi16(p, t, (__m256i)_mm512_cvtneps_pbh(v))
#include "bf16_tier.h"
