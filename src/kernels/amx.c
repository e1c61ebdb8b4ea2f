/*
 * amx.c -- bfloat16 attention on Intel AMX tiles (Sapphire Rapids and
 * later).  This file, and only this file, is compiled with -mamx-tile
 * -mamx-bf16 -mavx512bf16 (and AVX-512 F/BW/DQ/VL); it is called only when
 * mha_cpu_has_amx() said yes (CPUID, XCR0, and Linux's permission for the
 * tile data, asked once with arch_prctl).
 *
 * AMX multiplies whole tiles: C (16 x 16 float32) += A (16 rows x 32
 * bf16) . B (32 x 16 bf16), where B is stored "VNNI": its row r holds the
 * pairs (B[2r][n], B[2r+1][n]) for n = 0..15, one 32-bit word each.  One
 * instruction is 16 x 16 x 32 multiply-adds.  The FlashAttention forward
 * of one block of 32 query rows then reads:
 *
 *   for each block of 64 keys:
 *       S = Q K^T              AMX: Q rows as A tiles (straight from a
 *                              copy of the block), K packed so that each
 *                              B tile is 16 keys x 32 head dims
 *       m' = max(m, rowmax(S * c));  P = 2^(S * c - m')      (AVX-512,
 *       l  = l 2^(m - m') + rowsum(P)        float32; c = scale * log2 e)
 *       O  = O 2^(m - m')                    (only rows whose max moved)
 *       O += bf16(P) V         AMX: O itself loaded as the C tiles, P as
 *                              A tiles, V packed as B tiles of 32 keys x
 *                              16 head dims, O stored back
 *   out = bf16(O / l),  lse = ln 2 (m + log2 l)
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

void mha_amx_begin(void)
{
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

void mha_amx_end(void) { _tile_release(); }

/* ---- packing ------------------------------------------------------------
 *
 * K of one (b, K/V head): Lk rows of dh bf16, rows ld elements apart, into
 * B tiles for S = Q K^T: tile (kb, c) is keys 16 kb .. 16 kb + 15 against
 * head dims 32 c .. 32 c + 31, its row r the pairs of dims (2r, 2r+1) of
 * the 16 keys: the 16 x 16 transpose of the block's 32-bit words.  Keys
 * past Lk (up to a multiple of 32) are zeros.
 */
void mha_amx_pack_k(const uint16_t *k, int64_t ld, int64_t Lk, int dh,
                    uint32_t *dst)
{
    const int nc = dh / 32;
    const int64_t nkb = (Lk + 31) / 32 * 2;
    for (int64_t kb = 0; kb < nkb; kb++)
        for (int c = 0; c < nc; c++) {
            uint32_t *t = dst + (kb * nc + c) * 256;
            for (int n = 0; n < 16; n++) {
                const int64_t j = kb * 16 + n;
                if (j >= Lk) {
                    for (int r = 0; r < 16; r++)
                        t[r * 16 + n] = 0;
                    continue;
                }
                uint32_t w[16];
                memcpy(w, k + j * ld + 32 * c, sizeof w);
                for (int r = 0; r < 16; r++)
                    t[r * 16 + n] = w[r];
            }
        }
}

/*
 * V of one (b, K/V head) into B tiles for O += P V: tile (kb, dc) is keys
 * 32 kb .. 32 kb + 31 against head dims 16 dc .. 16 dc + 15, its row r
 * the pairs (V[2r][n], V[2r+1][n]) of two consecutive keys.  Keys past Lk
 * are zeros.
 */
void mha_amx_pack_v(const uint16_t *v, int64_t ld, int64_t Lk, int dh,
                    uint32_t *dst)
{
    const int ndc = dh / 16;
    const int64_t nkb = (Lk + 31) / 32;
    for (int64_t kb = 0; kb < nkb; kb++)
        for (int dc = 0; dc < ndc; dc++) {
            uint32_t *t = dst + (kb * ndc + dc) * 256;
            for (int r = 0; r < 16; r++) {
                const int64_t j0 = kb * 32 + 2 * r, j1 = j0 + 1;
                for (int n = 0; n < 16; n++) {
                    const uint32_t lo =
                        j0 < Lk ? v[j0 * ld + 16 * dc + n] : 0;
                    const uint32_t hi =
                        j1 < Lk ? v[j1 * ld + 16 * dc + n] : 0;
                    t[r * 16 + n] = lo | hi << 16;
                }
            }
        }
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
    const int dh = w->dh, mr = w->mr, nc = dh / 32, ndc = dh / 16;
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

        /* S = Q K^T, 32 keys at a time */
        for (int hf = 0; hf < halves; hf++) {
            const int64_t kb = (j0 + 32 * hf) / 16;
            _tile_zero(0);
            _tile_zero(1);
            if (two) {
                _tile_zero(2);
                _tile_zero(3);
            }
            /* the next 32 keys' K tiles into L1 while these multiply */
            {
                const char *nx = (const char *)(w->kp + (kb + 2) * nc * 256);
                for (int b = 0; b < 2 * nc * 1024; b += 64)
                    _mm_prefetch(nx + b, _MM_HINT_T0);
            }
            for (int cc = 0; cc < nc; cc++) {
                _tile_loadd(4, Q + 32 * cc, dh * 2);
                if (two)
                    _tile_loadd(5, Q + 16 * dh + 32 * cc, dh * 2);
                _tile_loadd(6, w->kp + (kb * nc + cc) * 256, 64);
                _tile_loadd(7, w->kp + ((kb + 1) * nc + cc) * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            float *sb = S + 32 * hf;
            _tile_stored(0, sb, BK * 4);
            _tile_stored(1, sb + 16, BK * 4);
            if (two) {
                _tile_stored(2, sb + 16 * BK, BK * 4);
                _tile_stored(3, sb + 16 * BK + 16, BK * 4);
            }
        }

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

        /* O += P V, two 16-column chunks of O at a time */
        const int64_t vb = j0 / 32;
        for (int dc = 0; dc < ndc; dc += 2) {
            _tile_loadd(0, O + 16 * dc, dh * 4);
            _tile_loadd(1, O + 16 * dc + 16, dh * 4);
            if (two) {
                _tile_loadd(2, O + 16 * dh + 16 * dc, dh * 4);
                _tile_loadd(3, O + 16 * dh + 16 * dc + 16, dh * 4);
            }
            for (int hf = 0; hf < halves; hf++) {
                {   /* the next 32 keys' two V tiles into L1 */
                    const char *nx = (const char *)(w->vp + ((vb + hf + 1) * ndc + dc) * 256);
                    for (int b = 0; b < 2048; b += 64)
                        _mm_prefetch(nx + b, _MM_HINT_T0);
                }
                _tile_loadd(4, P + 32 * hf, BK * 2);
                if (two)
                    _tile_loadd(5, P + 16 * BK + 32 * hf, BK * 2);
                _tile_loadd(6, w->vp + ((vb + hf) * ndc + dc) * 256, 64);
                _tile_loadd(7, w->vp + ((vb + hf) * ndc + dc + 1) * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                if (two) {
                    _tile_dpbf16ps(2, 5, 6);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, O + 16 * dc, dh * 4);
            _tile_stored(1, O + 16 * dc + 16, dh * 4);
            if (two) {
                _tile_stored(2, O + 16 * dh + 16 * dc, dh * 4);
                _tile_stored(3, O + 16 * dh + 16 * dc + 16, dh * 4);
            }
        }
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
