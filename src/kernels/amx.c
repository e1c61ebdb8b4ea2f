/*
 * amx.c -- bfloat16 attention on Intel AMX tiles (Sapphire Rapids and
 * later), or with the same code on AVX512-BF16's vdpbf16ps where the CPU
 * has no tiles (Cooper Lake, Zen 4, Zen 5): only the tile GEMM (gemm32)
 * differs.  This file, and only this file, is compiled with -mamx-tile
 * -mamx-bf16 -mavx512bf16 (and AVX-512 F/BW/DQ/VL); it is called only when
 * mha_bf16_tier() said so (CPUID, XCR0, and for the tiles Linux's
 * permission for the tile data, asked once with arch_prctl).
 *
 * AMX multiplies whole tiles: C (16 x 16 float32) += A (16 rows x 32
 * bf16) . B (32 x 16 bf16), where B is stored "VNNI": its row r holds the
 * pairs (B[2r][n], B[2r+1][n]) for n = 0..15, one 32-bit word each.  One
 * instruction is 16 x 16 x 32 multiply-adds.  The FlashAttention forward
 * of one block of 32 query rows then reads:
 *
 *   for each step of 256 keys:
 *       S = Q K^T              AMX: Q rows as A tiles (a zero-padded copy
 *                              of the block), K^T packed as B tiles of 32
 *                              head dims x 16 keys
 *       m' = max(m, rowmax(S * c));  P = 2^(S * c - m')      (AVX-512,
 *       l  = l 2^(m - m') + rowsum(P)        float32; c = scale * log2 e)
 *       O  = O 2^(m - m')                    (only rows whose max moved)
 *       O += bf16(P) V         AMX: O itself loaded as the C tiles, P as
 *                              A tiles, V packed as B tiles of 32 keys x
 *                              16 head dims, O stored back
 *   out = bf16(O / l),  lse = ln 2 (m + log2 l)
 *
 * Both products, and the backward's seven, are one tile GEMM (gemm32) on
 * one packed layout (mha_amx_pack_b).
 *
 * Numerics: Q, K and V are the caller's bf16; S, the row statistics, O and
 * every sum are float32 (AMX accumulates in float32); P is rounded to
 * bf16 (round to nearest even) before P V, as every fast bf16 kernel
 * does: each weight then carries a relative error of at most 2^-8, and l
 * sums the weights before that rounding (docs/semantics.md, "bf16").
 *
 * Each work item (b, h, block of query rows) is computed by one thread in
 * a fixed order, so the bits do not depend on the thread count.
 */
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

/* This thread's choice (mha_amx_begin): the tiles, or vdpbf16ps on the
 * same layouts.  Per thread, as the tile configuration itself is. */
static _Thread_local int use_tiles;

void mha_amx_begin(int tiles)
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

void mha_amx_end(void)
{
    if (use_tiles)
        _tile_release();
}

/* ---- 2^x on 16 lanes, x <= 0 ---------------------------------------------
 * x = n + f, n = round(x), |f| <= 1/2; 2^f by a cubic fitted for the least
 * largest relative error on [-1/2, 1/2] (7.5e-5, measured over 2e5 points
 * with these float32 coefficients), 2^n joined by vscalefps, which also
 * takes x = -inf (clamped to -200 first) to 0.  NaN stays NaN.  The
 * weights are rounded to bf16 (2^-8) right after: the cubic's error is
 * 2% of that, and l's sum sees it once per weight.
 */
static inline __m512 exp2_16(__m512 x)
{
    x = _mm512_max_ps(_mm512_set1_ps(-200.0f), x);   /* NaN: x (2nd) */
    const __m512 n =
        _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(5.5180370808e-2f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4261191487e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9325941801e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992799759e-1f));
    return _mm512_scalef_ps(p, n);
}

static inline __mmask16 lanes(int n)   /* the first n of 16 (n may be <0) */
{
    return n >= 16 ? (__mmask16)0xFFFF
         : n <= 0  ? (__mmask16)0
                   : (__mmask16)((1u << n) - 1);
}

/* ---- packing --------------------------------------------------------------
 * Every B operand is one layout (mha_amx_pack_b): the K x N matrix Bm
 * whose (k, n) element is src[k sk + n sn], as tiles of 32 k x 16 n, tile
 * (kt, nt) at dst + (kt nnt + nt) 256 words, nnt = 2 ceil(N / 32), its
 * row r the pairs (Bm[32 kt + 2r][n], Bm[32 kt + 2r + 1][n]).  For K^T in
 * S = Q K^T, k is the head dim and n the key (sk = 1: a word is two dims
 * of one key, 16 keys gathered); for V in O += P V, k is the key and n
 * the dim (sn = 1: two rows of 16 elements widened and interleaved).
 * Zeros past K and N.
 */
void mha_amx_pack_b(const uint16_t *src, int64_t sk, int64_t sn, int64_t K,
                    int64_t N, uint32_t *dst)
{
    mha_amx_pack_b_rows(src, sk, sn, K, N, 0, (K + 31) / 32, dst);
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

void mha_amx_pack_b_rows(const uint16_t *src, int64_t sk, int64_t sn,
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

uint16_t mha_amx_max_abs(const uint16_t *x, int64_t ld, int64_t rows,
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
 * apart) B, B packed by mha_amx_pack_b with its tile (kt, nt) at
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

void mha_amx_gemm32(float *C, int ldc, int N, const uint16_t *A, int lda,
                    int K, const uint32_t *b, int64_t bstride, int acc,
                    int two)
{
    gemm32(C, ldc, N, A, lda, K, b, bstride, acc, two);
}

/* ---- one block of query rows ---------------------------------------------
 * The tiles: 0-3 accumulate (S: rows 0-15 / 16-31 x keys 0-15 / 16-31;
 * O: rows 0-15 / 16-31 x two 16-column chunks), 4-5 the A operands
 * (rows 0-15 and 16-31 of Q or P), 6-7 the B operands (K or V tiles).
 * A step takes MHA_AMX_BK keys, so that O's loads and stores, the row
 * maxima's reductions and the rescaling come once per 256 keys.
 */
enum { BK = MHA_AMX_BK, BK32 = MHA_AMX_BK / 32 };

/* The largest of a row's first `live` scaled scores: c max(s), or c
 * min(s) when c < 0 (NaN never wins). */
static inline float row_top(const float *sr, int live, int ncols, float c)
{
    __m512 hi = _mm512_set1_ps(-INFINITY), lo = _mm512_set1_ps(INFINITY);
    if (live == ncols) {
        for (int v = 0; v < ncols / 16; v++) {
            const __m512 x = _mm512_loadu_ps(sr + 16 * v);
            hi = _mm512_max_ps(x, hi);   /* vmaxps: NaN in x gives hi */
            if (c < 0.0f)
                lo = _mm512_min_ps(x, lo);
        }
    } else {
        for (int v = 0; v < (live + 15) / 16; v++) {
            const __mmask16 k = lanes(live - 16 * v);
            const __m512 x = _mm512_maskz_loadu_ps(k, sr + 16 * v);
            hi = _mm512_mask_max_ps(hi, k, x, hi);
            lo = _mm512_mask_min_ps(lo, k, x, lo);
        }
    }
    return c >= 0.0f ? c * _mm512_reduce_max_ps(hi)
                     : c * _mm512_reduce_min_ps(lo);
}

/* P = bf16(2^(s c - mn)) over the row's ncols keys (0 past live); the
 * float32 weights' sum is added, lane by lane, to *lv. */
static inline void row_weights(const float *sr, uint16_t *pr, int live,
                               int ncols, float c, float mn, float *lv)
{
    const __m512 cv = _mm512_set1_ps(c), mv = _mm512_set1_ps(mn);
    __m512 sum = _mm512_loadu_ps(lv);
    for (int v = 0; v < ncols / 32; v++) {
        __m512 p[2];
        for (int u = 0; u < 2; u++) {
            const int at = 32 * v + 16 * u;
            if (live >= at + 16) {
                p[u] = exp2_16(
                    _mm512_fmsub_ps(_mm512_loadu_ps(sr + at), cv, mv));
            } else {
                const __mmask16 k = lanes(live - at);
                p[u] = _mm512_maskz_mov_ps(
                    k, exp2_16(_mm512_fmsub_ps(
                           _mm512_maskz_loadu_ps(k, sr + at), cv, mv)));
            }
            sum = _mm512_add_ps(sum, p[u]);
        }
        _mm512_storeu_si512(pr + 32 * v,
                            (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
    }
    _mm512_storeu_ps(lv, sum);
}

/* Whether any of a row's first `live` scores is NaN (the rare path: a
 * row whose every live score is NaN has no max). */
static int row_has_nan(const float *sr, int live)
{
    for (int j = 0; j < live; j++)
        if (isnan(sr[j]))
            return 1;
    return 0;
}

void mha_amx_flash_rows(const mha_amx_block *w, mha_amx_scratch *s)
{
    const int dh = w->dh, mr = w->mr, ndc = dh / 16;
    const int two = mr > 16;   /* rows 16-31 (tiles 2, 3 and 5) in use */
    const float c = w->scale * 1.44269504088896341f;
    float *S = s->S, *O = s->O, *m = s->m, *L = s->l;
    uint16_t *P = s->P, *Q = s->Q;

    /* The block's rows, zeros below mr: A tiles read 32 rows. */
    for (int r = 0; r < 32; r++) {
        if (r < mr)
            memcpy(Q + r * dh, w->q + r * w->ldq, (size_t)dh * 2);
        else
            memset(Q + r * dh, 0, (size_t)dh * 2);
        m[r] = -INFINITY;
    }
    memset(L, 0, sizeof(float) * 32 * 16);   /* l, 16 lanes per row */
    memset(O, 0, sizeof(float) * 32 * (size_t)dh);
    /* rows past mr are read by the A tiles but never written: zeros */
    memset(P + mr * BK, 0, sizeof(uint16_t) * (size_t)(32 - mr) * BK);

    int64_t kend = 0;   /* keys any row sees */
    for (int r = 0; r < mr; r++)
        kend = w->lim[r] > kend ? w->lim[r] : kend;

    for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int64_t left = kend - j0;
        const int halves = left >= BK ? BK32 : (int)((left + 31) / 32);
        const int ncols = 32 * halves;

        /* S = Q K^T for the step's keys (K^T packed: tile (dims, keys)) */
        gemm32(S, BK, ncols, Q, dh, dh, w->kp + j0 / 16 * 256, w->kt_stride,
               0, two);

        /* the online softmax, row by row, in float32 */
        for (int r = 0; r < mr; r++) {
            const float *sr = S + r * BK;
            uint16_t *pr = P + r * BK;
            const int64_t live64 = w->lim[r] - j0;
            const int live = live64 > ncols ? ncols : (int)live64;
            if (live <= 0) {   /* nothing visible here: zero weights */
                memset(pr, 0, sizeof(uint16_t) * (size_t)ncols);
                continue;
            }
            const float top = row_top(sr, live, ncols, c);
            /* (a NaN m never compares: it stays, and makes p NaN below) */
            float mn = top > m[r] ? top : m[r];
            if (mn == -INFINITY) {   /* no max: every live score -inf or NaN */
                if (row_has_nan(sr, live)) {
                    mn = NAN;
                } else {
                    memset(pr, 0, sizeof(uint16_t) * (size_t)ncols);
                    continue;
                }
            }
            if (!(mn == m[r])) {   /* the max moved (or is NaN): rescale */
                const float alpha = m[r] == -INFINITY ? 0.0f
                                                      : exp2f(m[r] - mn);
                const __m512 av = _mm512_set1_ps(alpha);
                for (int d = 0; d < dh; d += 16)
                    _mm512_storeu_ps(O + r * dh + d,
                                     _mm512_mul_ps(av, _mm512_loadu_ps(
                                                           O + r * dh + d)));
                _mm512_storeu_ps(L + 16 * r,
                                 _mm512_mul_ps(av, _mm512_loadu_ps(L + 16 * r)));
                m[r] = mn;
            }
            row_weights(sr, pr, live, ncols, c, mn, L + 16 * r);
        }

        /* O += P V: O itself the accumulator tiles, the V tiles of the
         * step's keys (tile (key block, 16 columns) at vp + (kb ndc + dc)
         * 256) */
        gemm32(O, dh, dh, P, BK, 32 * halves, w->vp + j0 / 32 * ndc * 256,
               ndc, 1, two);
    }

    /* out = O / l in bf16; lse = ln 2 (m + log2 l) */
    for (int r = 0; r < mr; r++) {
        uint16_t *dst = w->out + r * w->ldo;
        const float l = _mm512_reduce_add_ps(_mm512_loadu_ps(L + 16 * r));
        const int none = m[r] == -INFINITY || l == 0.0f;
        const __m512 inv = _mm512_set1_ps(none ? 0.0f : 1.0f / l);
        for (int d = 0; d < dh; d += 32) {
            const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(O + r * dh + d), inv);
            const __m512 b =
                _mm512_mul_ps(_mm512_loadu_ps(O + r * dh + d + 16), inv);
            _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        if (w->lse)
            w->lse[r] = none ? -INFINITY
                             : (float)(0.69314718055994531 *
                                       ((double)m[r] + log2((double)l)));
    }
}

/* ---- the backward ----------------------------------------------------------
 * With S = scale Q K^T, P = softmax(S) (from the forward's lse: P =
 * 2^(S log2 e - lse log2 e)), dP = dO V^T, D_i = sum_d dO_id O_id:
 *
 *   dS = P (dP - D)      dQ = scale dS K    dK = scale dS^T Q    dV = P^T dO
 *
 * in two sweeps, so that each gradient row is summed by one thread in a
 * fixed order (no atomics, the same bits for every thread count):
 *   1. per block of 32 keys (of one K/V head): every query head of its
 *      group and every 64 queries that see it, in the transposed
 *      orientation (S^T = K Q^T: the rows are keys), dK and dV summed;
 *   2. per block of 32 query rows: every 64 keys it sees, dQ summed.
 * S and dP are recomputed in each sweep.  P and scale dS are rounded to
 * bf16 before their products (as the forward rounds P); every sum is
 * float32.
 */

/* Rows of a (rows x dh) bf16 matrix into a zero-padded 32 x dh block. */
static void stage(uint16_t *dst, const uint16_t *src, int64_t ld, int rows,
                  int dh)
{
    for (int r = 0; r < 32; r++) {
        if (r < rows)
            memcpy(dst + r * dh, src + r * ld, (size_t)dh * 2);
        else
            memset(dst + r * dh, 0, (size_t)dh * 2);
    }
}

/* 32 x dh float32 accumulators, rows 0..rows-1, into bf16 rows ld apart. */
static void unstage(uint16_t *dst, int64_t ld, const float *acc, int rows,
                    int dh)
{
    for (int r = 0; r < rows; r++)
        for (int d = 0; d < dh; d += 32)
            _mm512_storeu_si512(
                dst + r * ld + d,
                (__m512i)_mm512_cvtne2ps_pbh(
                    _mm512_loadu_ps(acc + r * dh + d + 16),
                    _mm512_loadu_ps(acc + r * dh + d)));
}

enum { QS = 64, KS = 64 };   /* queries per step (sweep 1), keys (2) */

void mha_amx_backward_kv(const mha_amx_bwd_kv *w, mha_amx_bwd_scratch *s)
{
    const int dh = w->dh, mr = w->mr, two = mr > 16;
    const float c = w->scale * 1.44269504088896341f;
    const __m512 cv = _mm512_set1_ps(c), sc = _mm512_set1_ps(w->scale);
    float *dk = s->acc, *dv = s->acc + 32 * dh;
    memset(s->acc, 0, sizeof(float) * 64 * (size_t)dh);
    stage(s->x, w->k, w->ldk, mr, dh);
    stage(s->y, w->v, w->ldv, mr, dh);
    for (int hh = 0; hh < w->heads; hh++) {
        const mha_amx_bwd_head *h = &w->head[hh];
        /* the first query that sees key j0 (lim grows with the query) */
        int64_t first = 0;
        while (first < h->Lq && h->lim[first] <= w->j0)
            first++;
        for (int64_t i0 = first / 32 * 32; i0 < h->Lq; i0 += QS) {
            const int n = h->Lq - i0 < QS ? (int)((h->Lq - i0 + 31) / 32 * 32)
                                          : QS;
            /* S^T = K Q^T, dP^T = V dO^T: 32 keys x n queries */
            gemm32(s->S, QS, n, s->x, dh, dh, h->qt + i0 / 16 * 256,
                   h->qt_stride, 0, two);
            gemm32(s->dP, QS, n, s->y, dh, dh, h->dot + i0 / 16 * 256,
                   h->dot_stride, 0, two);
            /* P^T and scale dS^T: each key row, 16 queries a vector; key
             * j is seen by query q when j < lim[q] (padded queries: 0) */
            for (int r = 0; r < 32; r++) {
                const __m512i j = _mm512_set1_epi32((int)(w->j0 + r));
                for (int v = 0; v < n; v += 32) {
                    __m512 p[2], ds[2];
                    for (int u = 0; u < 2; u++) {
                        const int64_t q = i0 + v + 16 * u;
                        const __mmask16 k = r < mr
                            ? _mm512_cmpgt_epi32_mask(
                                  _mm512_loadu_si512(h->lim + q), j)
                            : 0;
                        const int at = r * QS + v + 16 * u;
                        p[u] = _mm512_maskz_mov_ps(
                            k, exp2_16(_mm512_fmsub_ps(
                                   _mm512_loadu_ps(s->S + at), cv,
                                   _mm512_loadu_ps(h->lse2 + q))));
                        ds[u] = _mm512_mul_ps(
                            _mm512_mul_ps(p[u],
                                          _mm512_sub_ps(
                                              _mm512_loadu_ps(s->dP + at),
                                              _mm512_loadu_ps(h->D + q))),
                            sc);
                    }
                    _mm512_storeu_si512(s->P + r * QS + v,
                                        (__m512i)_mm512_cvtne2ps_pbh(p[1], p[0]));
                    _mm512_storeu_si512(s->dS + r * QS + v,
                                        (__m512i)_mm512_cvtne2ps_pbh(ds[1], ds[0]));
                }
            }
            /* dV += P^T dO, dK += scale dS^T Q (n queries) */
            gemm32(dv, dh, dh, s->P, QS, n,
                   h->don + i0 / 32 * h->don_stride * 256, h->don_stride, 1,
                   two);
            gemm32(dk, dh, dh, s->dS, QS, n,
                   h->qn + i0 / 32 * h->qn_stride * 256, h->qn_stride, 1,
                   two);
        }
    }
    unstage(w->dk, w->ldk_out, dk, mr, dh);
    unstage(w->dv, w->ldv_out, dv, mr, dh);
}

void mha_amx_backward_q(const mha_amx_bwd_q *w, mha_amx_bwd_scratch *s)
{
    const int dh = w->dh, mr = w->mr, two = mr > 16;
    const float c = w->scale * 1.44269504088896341f;
    float *dq = s->acc;
    memset(dq, 0, sizeof(float) * 32 * (size_t)dh);
    stage(s->x, w->q, w->ldq, mr, dh);
    stage(s->y, w->dout, w->ldo, mr, dh);
    int64_t kend = 0;
    for (int r = 0; r < mr; r++)
        kend = w->lim[r] > kend ? w->lim[r] : kend;
    for (int64_t j0 = 0; j0 < kend; j0 += KS) {
        const int n = (int)(kend - j0 < KS ? (kend - j0 + 31) / 32 * 32 : KS);
        gemm32(s->S, KS, n, s->x, dh, dh, w->kt + j0 / 16 * 256, w->kt_stride,
               0, two);
        gemm32(s->dP, KS, n, s->y, dh, dh, w->vt + j0 / 16 * 256,
               w->vt_stride, 0, two);
        for (int r = 0; r < 32; r++) {
            const int live = r < mr ? (int)(w->lim[r] - j0 > n ? n
                                            : w->lim[r] - j0 < 0 ? 0
                                            : w->lim[r] - j0)
                                    : 0;
            const __m512 lse2 = _mm512_set1_ps(r < mr ? w->lse2[r] : 0.0f);
            const __m512 D = _mm512_set1_ps(r < mr ? w->D[r] : 0.0f);
            for (int v = 0; v < n; v += 32) {
                __m512 ds[2];
                for (int u = 0; u < 2; u++) {
                    const __mmask16 k = lanes(live - v - 16 * u);
                    const __m512 sv = _mm512_loadu_ps(s->S + r * KS + v + 16 * u);
                    const __m512 p = exp2_16(
                        _mm512_fmsub_ps(sv, _mm512_set1_ps(c), lse2));
                    const __m512 dp = _mm512_loadu_ps(s->dP + r * KS + v + 16 * u);
                    ds[u] = _mm512_maskz_mul_ps(
                        k, _mm512_mul_ps(p, _mm512_sub_ps(dp, D)),
                        _mm512_set1_ps(w->scale));
                }
                _mm512_storeu_si512(s->dS + r * KS + v,
                                    (__m512i)_mm512_cvtne2ps_pbh(ds[1], ds[0]));
            }
        }
        /* dQ += scale dS K (n keys) */
        gemm32(dq, dh, dh, s->dS, KS, n, w->kn + j0 / 32 * w->kn_stride * 256,
               w->kn_stride, 1, two);
    }
    unstage(w->dq, w->ldq_out, dq, mr, dh);
}
