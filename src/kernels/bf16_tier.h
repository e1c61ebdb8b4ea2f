/*
 * bf16_tier.h -- the bf16 attention kernels, once for every ISA that
 * multiplies bf16: the FlashAttention forward of one block of query rows,
 * the backward's two sweeps and a linear layer's rounding, written over
 * simd.h's vectors and one tile GEMM.  Included by the file of each bf16
 * kernel set -- amx.c (AMX tiles, or AVX512-BF16's vdpbf16ps) and
 * neon_bf16.c (aarch64's BFDOT) -- after simd.h and these of its own:
 *
 *   gemm32(C, ldc, N, A, lda, K, b, bstride, acc, two)
 *                     C (32 x N floats, rows ldc apart; rows 16-31 only
 *                     when two) = (acc: C +) A (32 x K bf16, rows lda
 *                     apart) B, B in mha_bf16_pack_b's layout with its
 *                     tile (kt, nt) at b + (kt bstride + nt) 256 words;
 *                     N and K multiples of 32
 *   vf_scale2(p, n)   p 2^n for whole n, -200 <= n <= 0 (0 below the
 *                     tier's least power of two)
 *   vf_store_bf16(p, v), vf_store_bf16_t(p, v, t)
 *                     v rounded to bf16 (nearest, ties to even) and
 *                     stored: VL of them, or the lanes of the vtail t
 *
 * The forward of a block of 32 query rows of one (b, h):
 *
 *   for each step of 256 keys:
 *       S = Q K^T              gemm32: Q rows as A (a zero-padded copy of
 *                              the block), K^T packed as B (32 head dims x
 *                              16 keys a tile)
 *       m' = max(m, rowmax(S * c));  P = 2^(S * c - m')   (float32 vectors;
 *       l  = l 2^(m - m') + rowsum(P)            c = scale * log2 e)
 *       O  = O 2^(m - m')                        (only rows whose max moved)
 *       O += bf16(P) V         gemm32 accumulating into O, P as A, V packed
 *                              as B (32 keys x 16 head dims a tile)
 *   out = bf16(O / l),  lse = ln 2 (m + log2 l)
 *
 * Numerics: Q, K and V are the caller's bf16; S, the row statistics, O and
 * every sum are float32; P is rounded to bf16 (round to nearest even)
 * before P V, as every fast bf16 kernel does: each weight then carries a
 * relative error of at most 2^-8, and l sums the weights before that
 * rounding (docs/semantics.md, "bf16").  Each work item (b, h, block of
 * query rows) is computed by one thread in a fixed order, so the bits do
 * not depend on the thread count; they do depend on the kernel set (its
 * GEMM's order of sums, its vector width in the sums of l).
 */
#ifndef MHA_BF16_TIER_H
#define MHA_BF16_TIER_H

#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <string.h>

/* ---- 2^x on VL lanes, x <= 0 ----------------------------------------------
 * x = n + f, n = round(x), |f| <= 1/2; 2^f by a cubic fitted for the least
 * largest relative error on [-1/2, 1/2] (7.5e-5, measured over 2e5 points
 * with these float32 coefficients), 2^n joined by the tier's vf_scale2,
 * x = -inf clamped to -200 first, so that it gives 0.  NaN stays NaN.  The
 * weights are rounded to bf16 (2^-8) right after: the cubic's error is
 * 2% of that, and l's sum sees it once per weight.
 */
MK_INLINE vf exp2_neg(vf x)
{
    x = vf_max_nan(vf_set1(-200.0f), x);
    const vf n = vf_round_even(x), f = vf_sub(x, n);
    vf p = vf_set1(5.5180370808e-2f);
    p = vf_fma(p, f, vf_set1(2.4261191487e-1f));
    p = vf_fma(p, f, vf_set1(6.9325941801e-1f));
    p = vf_fma(p, f, vf_set1(9.9992799759e-1f));
    return vf_scale2(p, n);
}

/* v with the lanes from n on zeroed (n may be <= 0 or >= VL). */
MK_INLINE vf keep_first(vf v, int n)
{
    return n >= VL ? v : n <= 0 ? vf_zero() : vf_keep_t(v, vt_make(n));
}

/* ---- one block of query rows ---------------------------------------------
 * A step takes MHA_BF16_BK keys, so that O's loads and stores, the row
 * maxima's reductions and the rescaling come once per 256 keys.
 */
enum { BK = MHA_BF16_BK, BK32 = MHA_BF16_BK / 32 };

/* The largest of a row's first `live` scaled scores: c max(s), or c
 * min(s) when c < 0 (NaN never wins). */
static inline float row_top(const float *sr, int live, float c)
{
    int j = 0;
    float top;
    if (c >= 0.0f) {
        vf hi = vf_set1(-INFINITY);
        for (; j + VL <= live; j += VL)
            hi = vf_max_ign(vf_load(sr + j), hi);
        top = vf_hmax(hi);
        for (; j < live; j++)
            top = sr[j] > top ? sr[j] : top;
    } else {
        vf lo = vf_set1(INFINITY);
        for (; j + VL <= live; j += VL)
            lo = vf_min_ign(vf_load(sr + j), lo);
        top = vf_hmin(lo);
        for (; j < live; j++)
            top = sr[j] < top ? sr[j] : top;
    }
    return c * top;
}

/* P = bf16(2^(s c - mn)) over the row's ncols keys (0 past live); the
 * float32 weights' sum is added, lane by lane, to the VL floats at lv. */
static inline void row_weights(const float *sr, uint16_t *pr, int live,
                               int ncols, float c, float mn, float *lv)
{
    const vf cv = vf_set1(c), mv = vf_set1(mn);
    vf sum = vf_load(lv);
    for (int at = 0; at < ncols; at += VL) {
        vf p;
        if (live >= at + VL)
            p = exp2_neg(vf_fms(vf_load(sr + at), cv, mv));
        else if (live <= at)
            p = vf_zero();
        else
            p = keep_first(
                exp2_neg(vf_fms(vf_load_t(sr + at, vt_make(live - at)), cv,
                                mv)),
                live - at);
        sum = vf_add(sum, p);
        vf_store_bf16(pr + at, p);
    }
    vf_store(lv, sum);
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

void mha_bf16_flash_rows(const mha_bf16_block *w, mha_bf16_scratch *s)
{
    const int dh = w->dh, mr = w->mr, ndc = dh / 16;
    const int two = mr > 16;   /* rows 16-31 of the GEMMs in use */
    const float c = w->scale * 1.44269504088896341f;
    float *S = s->S, *O = s->O, *m = s->m, *L = s->l;
    uint16_t *P = s->P, *Q = s->Q;

    /* The block's rows, zeros below mr: the GEMMs read 32 rows. */
    for (int r = 0; r < 32; r++) {
        if (r < mr)
            memcpy(Q + r * dh, w->q + r * w->ldq, (size_t)dh * 2);
        else
            memset(Q + r * dh, 0, (size_t)dh * 2);
        m[r] = -INFINITY;
    }
    memset(L, 0, sizeof(float) * 32 * 16);   /* l, VL of 16 lanes a row */
    memset(O, 0, sizeof(float) * 32 * (size_t)dh);
    /* rows past mr are read by the GEMMs but never written: zeros */
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
            const float top = row_top(sr, live, c);
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
                const vf av = vf_set1(m[r] == -INFINITY ? 0.0f
                                                        : exp2f(m[r] - mn));
                for (int d = 0; d < dh; d += VL)
                    vf_store(O + r * dh + d,
                             vf_mul(av, vf_load(O + r * dh + d)));
                vf_store(L + 16 * r, vf_mul(av, vf_load(L + 16 * r)));
                m[r] = mn;
            }
            row_weights(sr, pr, live, ncols, c, mn, L + 16 * r);
        }

        /* O += P V: O itself the accumulator, the V tiles of the step's
         * keys (tile (key block, 16 columns) at vp + (kb ndc + dc) 256) */
        gemm32(O, dh, dh, P, BK, 32 * halves, w->vp + j0 / 32 * ndc * 256,
               ndc, 1, two);
    }

    /* out = O / l in bf16; lse = ln 2 (m + log2 l) */
    for (int r = 0; r < mr; r++) {
        uint16_t *dst = w->out + r * w->ldo;
        const float l = vf_hsum(vf_load(L + 16 * r));
        const int none = m[r] == -INFINITY || l == 0.0f;
        const vf inv = vf_set1(none ? 0.0f : 1.0f / l);
        for (int d = 0; d < dh; d += VL)
            vf_store_bf16(dst + d, vf_mul(vf_load(O + r * dh + d), inv));
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
        for (int d = 0; d < dh; d += VL)
            vf_store_bf16(dst + r * ld + d, vf_load(acc + r * dh + d));
}

enum { QS = 64, KS = 64 };   /* queries per step (sweep 1), keys (2) */

void mha_bf16_backward_kv(const mha_bf16_bwd_kv *w, mha_bf16_bwd_scratch *s)
{
    const int dh = w->dh, mr = w->mr, two = mr > 16;
    const vf cv = vf_set1(w->scale * 1.44269504088896341f),
             sc = vf_set1(w->scale);
    float *dk = s->acc, *dv = s->acc + 32 * dh;
    memset(s->acc, 0, sizeof(float) * 64 * (size_t)dh);
    stage(s->x, w->k, w->ldk, mr, dh);
    stage(s->y, w->v, w->ldv, mr, dh);
    for (int hh = 0; hh < w->heads; hh++) {
        const mha_bf16_bwd_head *h = &w->head[hh];
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
            /* P^T and scale dS^T: each key row, VL queries a vector; key
             * j is seen by query q when j < lim[q] (padded queries: 0) */
            for (int r = 0; r < 32; r++) {
                const vi j = vi_set1((int)(w->j0 + r));
                for (int v = 0; v < n; v += VL) {
                    const int64_t q = i0 + v;
                    const int at = r * QS + v;
                    const vf e = exp2_neg(vf_fms(vf_load(s->S + at), cv,
                                                 vf_load(h->lse2 + q)));
                    const vf p = r < mr ? vf_select(vi_cmp_gt(vi_load(h->lim + q),
                                                              j),
                                                    e, vf_zero())
                                        : vf_zero();
                    const vf ds = vf_mul(
                        vf_mul(p, vf_sub(vf_load(s->dP + at),
                                         vf_load(h->D + q))),
                        sc);
                    vf_store_bf16(s->P + at, p);
                    vf_store_bf16(s->dS + at, ds);
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

void mha_bf16_backward_q(const mha_bf16_bwd_q *w, mha_bf16_bwd_scratch *s)
{
    const int dh = w->dh, mr = w->mr, two = mr > 16;
    const vf cv = vf_set1(w->scale * 1.44269504088896341f),
             sc = vf_set1(w->scale);
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
            const vf lse2 = vf_set1(r < mr ? w->lse2[r] : 0.0f);
            const vf D = vf_set1(r < mr ? w->D[r] : 0.0f);
            for (int v = 0; v < n; v += VL) {
                const vf p = exp2_neg(vf_fms(vf_load(s->S + r * KS + v), cv,
                                             lse2));
                const vf dp = vf_load(s->dP + r * KS + v);
                const vf ds =
                    keep_first(vf_mul(vf_mul(p, vf_sub(dp, D)), sc), live - v);
                vf_store_bf16(s->dS + r * KS + v, ds);
            }
        }
        /* dQ += scale dS K (n keys) */
        gemm32(dq, dh, dh, s->dS, KS, n, w->kn + j0 / 32 * w->kn_stride * 256,
               w->kn_stride, 1, two);
    }
    unstage(w->dq, w->ldq_out, dq, mr, dh);
}

/* ---- the linear layer's GEMM and its rounding ---------------------------- */

void mha_bf16_gemm32(float *C, int ldc, int N, const uint16_t *A, int lda,
                     int K, const uint32_t *b, int64_t bstride, int acc,
                     int two)
{
    gemm32(C, ldc, N, A, lda, K, b, bstride, acc, two);
}

void mha_bf16_round_rows(const float *C, int ldc, int rows, int cols,
                         const float *bias, uint16_t *y, int64_t ldy)
{
    for (int r = 0; r < rows; r++) {
        const float *cr = C + (int64_t)r * ldc;
        uint16_t *yr = y + r * ldy;
        int c = 0;
        for (; c + VL <= cols; c += VL)
            vf_store_bf16(yr + c, bias ? vf_add(vf_load(cr + c),
                                                vf_load(bias + c))
                                       : vf_load(cr + c));
        if (c < cols) {
            const vtail t = vt_make(cols - c);
            const vf x = vf_load_t(cr + c, t);
            vf_store_bf16_t(yr + c,
                            bias ? vf_add(x, vf_load_t(bias + c, t)) : x, t);
        }
    }
}

#endif /* MHA_BF16_TIER_H */
