/*
 * half.c -- attention on bf16 heads with the bf16 kernels (AMX tiles or
 * AVX512-BF16 dot products on x86, p->tiles says which; BFDOT on aarch64:
 * kernels/bf16_tier.h): the driver.  mha_attention (sdpa.c) comes here
 * for bf16 q, k, v and out when the CPU has one of them and the call is
 * plain or causal attention (key lengths allowed); every other
 * half-precision call is widened there instead.
 *
 *   1. the largest finite |q| and |k| found (scores that could overflow
 *      float32 are refused before anything is written);
 *   2. K and V of each (b, K/V head) packed once into AMX's tile layouts,
 *      and each (b, h, block of 32 query rows) one work item, computed by
 *      one thread from start to end (mha_bf16_flash_rows): a thread packs
 *      a pair and runs its blocks at once when the pairs share out
 *      evenly; else all pairs are packed first and the blocks, those with
 *      the most keys first when causal, are shared out dynamically.
 *
 * Every item's arithmetic is fixed by its indices alone, so the bits do
 * not depend on the thread count.
 */
#include "engine.h"
#include "kernels/kernels.h"   /* (MHA_BF16_KERNELS) */

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if MHA_BF16_KERNELS

/* The keys row i of batch b sees: 0 .. lim - 1. */
static int64_t row_limit(const mha_half_problem *p, int64_t b, int64_t i)
{
    int64_t lim = p->key_lengths ? p->key_lengths[b] : p->Lk;
    const int64_t diag = p->causal == MHA_CAUSAL_TOP_LEFT ? i + 1
                       : p->causal == MHA_CAUSAL_BOTTOM_RIGHT
                           ? i + 1 + (p->Lk - p->Lq)
                           : p->Lk;
    if (diag < lim)
        lim = diag;
    return lim < 0 ? 0 : lim;
}

/* Query block qb of head (b, h), its K/V head packed at kp (K^T, then V
 * `words` on): one work item, mha_bf16_flash_rows on this thread. */
static void query_block(const mha_half_problem *p, const uint32_t *kp,
                        int64_t words, int64_t b, int64_t h, int64_t qb,
                        mha_bf16_scratch *s)
{
    int64_t lim[32];
    const int64_t i0 = qb * 32;
    const int mr = (int)(p->Lq - i0 < 32 ? p->Lq - i0 : 32);
    for (int r = 0; r < mr; r++)
        lim[r] = row_limit(p, b, i0 + r);
    const mha_bf16_block w = {
        .q = p->q + b * p->bsq + h * p->hsq + i0 * p->ldq,
        .ldq = p->ldq, .mr = mr, .dh = (int)p->dh, .lim = lim,
        .kp = kp, .vp = kp + words,
        .kt_stride = (p->Lk + 31) / 32 * 2, .scale = p->scale,
        .out = p->out + b * p->bso + h * p->hso + i0 * p->ldo,
        .ldo = p->ldo,
        .lse = p->lse ? p->lse + (b * p->H + h) * p->Lq + i0 : NULL};
    mha_bf16_flash_rows(&w, s);
}

/* K (as K^T: dims x keys) and V (keys x dims) of pair (b, g) into kp. */
static void pack_kv(const mha_half_problem *p, int64_t b, int64_t g,
                    int64_t words, uint32_t *kp)
{
    mha_bf16_pack_b(p->k + b * p->bsk + g * p->hsk, 1, p->ldk, p->dh, p->Lk,
                   kp);
    mha_bf16_pack_b(p->v + b * p->bsv + g * p->hsv, p->ldv, 1, p->Lk, p->dh,
                   kp + words);
}

mha_status mha_attn_bf16(const mha_engine *e, const mha_half_problem *p)
{
    const int dh = (int)p->dh;
    const int64_t words = mha_bf16_b_words(p->Lk, dh);   /* K^T or V */
    const int64_t nqb = (p->Lq + 31) / 32, group = p->H / p->Hkv;
    const int64_t n_kv = p->B * p->Hkv;
    /* Where packed K/V heads live.  With (b, K/V head) pairs enough to
     * share out evenly, a thread packs its pair into a buffer of its own
     * and runs that pair's query blocks at once, the packed head still in
     * its cache ("local"); else every pair is packed into one shared
     * buffer first and the query blocks are shared out.  An item's
     * arithmetic is the same either way. */
    const int local = n_kv % e->threads == 0 || n_kv >= 8 * e->threads;
    int64_t n_packed, n_items, n_scratch;
    if (!mha_mul_ok(local ? e->threads : n_kv, 2 * words, &n_packed) ||
        !mha_mul_ok(p->B * p->H, nqb, &n_items) ||
        !mha_mul_ok(e->threads, mha_bf16_scratch_floats(dh) + 64, &n_scratch) ||
        n_packed > INT64_MAX / 8 || n_scratch > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "bf16 attention workspace overflows");
    /* (aligned_alloc wants a multiple of the alignment) */
    uint32_t *packed = aligned_alloc(64, ((size_t)n_packed * 4 + 63) / 64 * 64);
    float *scratch = aligned_alloc(64, ((size_t)n_scratch * 4 + 63) / 64 * 64);
    if (!packed || !scratch) {
        free(packed);
        free(scratch);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "cannot allocate the bf16 attention workspace "
                             "(%lld bytes of packed K/V)",
                             (long long)n_packed * 4);
    }
    const int64_t per_thread = mha_bf16_scratch_floats(dh) + 64;
    unsigned qbits = 0, kbits = 0;   /* the largest finite |q|, |k| */

#pragma omp parallel num_threads(e->threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        /* 1. the largest finite |q| and |k| per (b, K/V head) and its
         * query heads; shared: K and V packed there too, rows in cache */
#pragma omp for schedule(static) reduction(max : qbits, kbits)
        for (int64_t bg = 0; bg < n_kv; bg++) {
            const int64_t b = bg / p->Hkv, g = bg % p->Hkv;
            const unsigned km = mha_bf16_max_abs(
                p->k + b * p->bsk + g * p->hsk, p->ldk, p->Lk, dh);
            kbits = km > kbits ? km : kbits;
            for (int64_t h = g * group; h < (g + 1) * group; h++) {
                const unsigned qm = mha_bf16_max_abs(
                    p->q + b * p->bsq + h * p->hsq, p->ldq, p->Lq, dh);
                qbits = qm > qbits ? qm : qbits;
            }
            if (!local)
                pack_kv(p, b, g, words, packed + bg * 2 * words);
        }
        /* (the loop's barrier: every thread reads the same maxima, and
         * nothing is written unless they pass) */
        const int in_range = mha_score_range_ok(
            p->scale, dh, mha_bf16_to_float((uint16_t)qbits),
            mha_bf16_to_float((uint16_t)kbits));

        /* 2. the query blocks; 64-byte aligned parts of this thread's
         * scratch */
        float *base = scratch + t * per_thread;
        mha_bf16_scratch s;
        s.S = base;
        s.O = s.S + 32 * MHA_BF16_BK;
        s.m = s.O + 32 * dh;
        s.l = s.m + 32;
        s.P = (uint16_t *)(s.l + 32 * 16);
        s.Q = s.P + 32 * MHA_BF16_BK;
        mha_bf16_begin(p->tiles);
        if (local) {   /* a pair at a time, packed into this thread's part */
            uint32_t *kp = packed + t * 2 * words;
#pragma omp for schedule(dynamic)
            for (int64_t bg = 0; bg < (in_range ? n_kv : 0); bg++) {
                const int64_t b = bg / p->Hkv, g = bg % p->Hkv;
                pack_kv(p, b, g, words, kp);
                for (int64_t h = g * group; h < (g + 1) * group; h++)
                    for (int64_t qb = nqb - 1; qb >= 0; qb--)
                        query_block(p, kp, words, b, h, qb, &s);
            }
        } else {   /* the blocks with the most keys first when causal */
#pragma omp for schedule(dynamic)
            for (int64_t it = 0; it < (in_range ? n_items : 0); it++) {
                const int64_t bh = it / nqb, qb = nqb - 1 - it % nqb;
                const int64_t b = bh / p->H, h = bh % p->H;
                query_block(p, packed + (b * p->Hkv + h / group) * 2 * words,
                            words, b, h, qb, &s);
            }
        }
        mha_bf16_end();
    }
    free(packed);
    free(scratch);
    /* scores that could overflow float32 are refused (nothing written) */
    return mha_check_score_range(p->scale, dh,
                                 mha_bf16_to_float((uint16_t)qbits),
                                 mha_bf16_to_float((uint16_t)kbits));
}

/* The backward: q, k, v, out (the forward's, bf16), dout and lse (the
 * forward's) in; dq, dk, dv out (p's strides for all of them: q's for
 * out, dout and dq, k's for dk, v's for dv). */
mha_status mha_attn_bf16_backward(const mha_engine *e,
                                 const mha_half_problem *p)
{
    const int dh = (int)p->dh;
    const int64_t group = p->H / p->Hkv, Lq64 = (p->Lq + 63) / 64 * 64;
    const int64_t wq = mha_bf16_b_words(dh, p->Lq), wqn = mha_bf16_b_words(p->Lq, dh);
    const int64_t wk = mha_bf16_b_words(dh, p->Lk), wkn = mha_bf16_b_words(p->Lk, dh);
    /* per (b, h): qt, dot, qn, don, then lim, lse2, D (Lq64 each);
     * per (b, g): kt, vt, kn */
    const int64_t per_h = 2 * wq + 2 * wqn + 3 * Lq64, per_g = 2 * wk + wkn;
    /* each thread's part: the scratch, then its group's head table, in
     * whole 64-byte lines (so every thread's part, and the table in it,
     * is aligned for its members) */
    const int64_t head_floats =
        (group * (int64_t)sizeof(mha_bf16_bwd_head) / 4 + 15) / 16 * 16;
    const int64_t per_thread = mha_bf16_bwd_scratch_floats(dh) + head_floats;
    int64_t nh, ng, nt;
    if (!mha_mul_ok(p->B * p->H, per_h, &nh) ||
        !mha_mul_ok(p->B * p->Hkv, per_g, &ng) ||
        !mha_mul_ok(e->threads, per_thread, &nt) ||
        nh > INT64_MAX / 16 || ng > INT64_MAX / 16 || nt > INT64_MAX / 16)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "bf16 attention backward workspace overflows");
    const size_t bytes = ((size_t)(nh + ng + nt) * 4 + 63) / 64 * 64;
    uint32_t *ws = aligned_alloc(64, bytes);
    if (!ws)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "cannot allocate the bf16 attention backward's "
                             "workspace (%zu bytes)", bytes);
    uint32_t *hs = ws, *gs = ws + nh;
    float *scratch_all = (float *)(gs + ng);
    const int64_t nkb = (p->Lk + 31) / 32, nqb = (p->Lq + 31) / 32;
    const float log2e = 1.44269504088896341f;

#pragma omp parallel num_threads(e->threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        /* 1. packing, and each query's lim, lse log2 e and D */
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < p->B * (p->H + p->Hkv); it++) {
            if (it < p->B * p->H) {
                const int64_t b = it / p->H, h = it % p->H;
                uint32_t *x = hs + it * per_h;
                const uint16_t *q = p->q + b * p->bsq + h * p->hsq;
                const uint16_t *o = p->out + b * p->bso + h * p->hso;
                const uint16_t *d = p->dout + b * p->bso + h * p->hso;
                mha_bf16_pack_b(q, 1, p->ldq, dh, p->Lq, x);
                mha_bf16_pack_b(d, 1, p->ldo, dh, p->Lq, x + wq);
                mha_bf16_pack_b(q, p->ldq, 1, p->Lq, dh, x + 2 * wq);
                mha_bf16_pack_b(d, p->ldo, 1, p->Lq, dh, x + 2 * wq + wqn);
                int32_t *lim = (int32_t *)(x + 2 * wq + 2 * wqn);
                float *lse2 = (float *)(lim + Lq64), *D = lse2 + Lq64;
                const float *lse = p->lse + (b * p->H + h) * p->Lq;
                for (int64_t i = 0; i < Lq64; i++) {
                    const int live = i < p->Lq;
                    lim[i] = live ? (int32_t)row_limit(p, b, i) : 0;
                    lse2[i] = live && lim[i] > 0 ? lse[i] * log2e : 0.0f;
                    float acc = 0.0f;
                    for (int64_t c = 0; live && c < dh; c++)
                        acc += mha_bf16_to_float(d[i * p->ldo + c]) *
                               mha_bf16_to_float(o[i * p->ldo + c]);
                    D[i] = acc;
                }
            } else {
                const int64_t bg = it - p->B * p->H;
                const int64_t b = bg / p->Hkv, g = bg % p->Hkv;
                uint32_t *x = gs + bg * per_g;
                const uint16_t *k = p->k + b * p->bsk + g * p->hsk;
                const uint16_t *v = p->v + b * p->bsv + g * p->hsv;
                mha_bf16_pack_b(k, 1, p->ldk, dh, p->Lk, x);
                mha_bf16_pack_b(v, 1, p->ldv, dh, p->Lk, x + wk);
                mha_bf16_pack_b(k, p->ldk, 1, p->Lk, dh, x + 2 * wk);
            }
        }

        float *base = scratch_all + t * per_thread;
        mha_bf16_bwd_scratch s;
        s.S = base;
        s.dP = s.S + 32 * 64;
        s.acc = s.dP + 32 * 64;
        s.P = (uint16_t *)(s.acc + 64 * dh);
        s.dS = s.P + 32 * 64;
        s.x = s.dS + 32 * 64;
        s.y = s.x + 32 * dh;
        mha_bf16_bwd_head *heads =
            (mha_bf16_bwd_head *)(base + mha_bf16_bwd_scratch_floats(dh));
        mha_bf16_begin(p->tiles);
        /* 2. dK and dV: a block of 32 keys of one (b, K/V head) an item */
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < p->B * p->Hkv * nkb; it++) {
            const int64_t bg = it / nkb, kb = it % nkb;
            const int64_t b = bg / p->Hkv, g = bg % p->Hkv, j0 = kb * 32;
            for (int64_t hh = 0; hh < group; hh++) {
                const uint32_t *x = hs + (b * p->H + g * group + hh) * per_h;
                const int32_t *lim = (const int32_t *)(x + 2 * wq + 2 * wqn);
                heads[hh] = (mha_bf16_bwd_head){
                    .qt = x, .dot = x + wq, .qn = x + 2 * wq,
                    .don = x + 2 * wq + wqn,
                    .qt_stride = (p->Lq + 31) / 32 * 2,
                    .dot_stride = (p->Lq + 31) / 32 * 2,
                    .qn_stride = dh / 16, .don_stride = dh / 16,
                    .lim = lim, .lse2 = (const float *)(lim + Lq64),
                    .D = (const float *)(lim + Lq64) + Lq64, .Lq = p->Lq};
            }
            const int mr = (int)(p->Lk - j0 < 32 ? p->Lk - j0 : 32);
            const mha_bf16_bwd_kv w = {
                .k = p->k + b * p->bsk + g * p->hsk + j0 * p->ldk,
                .v = p->v + b * p->bsv + g * p->hsv + j0 * p->ldv,
                .ldk = p->ldk, .ldv = p->ldv, .j0 = j0, .mr = mr, .dh = dh,
                .heads = (int)group, .head = heads, .scale = p->scale,
                .dk = p->dk + b * p->bsk + g * p->hsk + j0 * p->ldk,
                .dv = p->dv + b * p->bsv + g * p->hsv + j0 * p->ldv,
                .ldk_out = p->ldk, .ldv_out = p->ldv};
            mha_bf16_backward_kv(&w, &s);
        }
        /* 3. dQ: a block of 32 query rows of one (b, h) an item */
        int64_t lim[32];
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < p->B * p->H * nqb; it++) {
            const int64_t bh = it / nqb, qb = it % nqb;
            const int64_t b = bh / p->H, h = bh % p->H, g = h / group;
            const int64_t i0 = qb * 32;
            const int mr = (int)(p->Lq - i0 < 32 ? p->Lq - i0 : 32);
            const uint32_t *x = hs + bh * per_h;
            const int32_t *lim32 = (const int32_t *)(x + 2 * wq + 2 * wqn);
            for (int r = 0; r < mr; r++)
                lim[r] = lim32[i0 + r];
            const uint32_t *y = gs + (b * p->Hkv + g) * per_g;
            const mha_bf16_bwd_q w = {
                .q = p->q + b * p->bsq + h * p->hsq + i0 * p->ldq,
                .dout = p->dout + b * p->bso + h * p->hso + i0 * p->ldo,
                .ldq = p->ldq, .ldo = p->ldo, .mr = mr, .dh = dh,
                .lim = lim, .lse2 = (const float *)(lim32 + Lq64) + i0,
                .D = (const float *)(lim32 + Lq64) + Lq64 + i0,
                .kt = y, .vt = y + wk, .kn = y + 2 * wk,
                .kt_stride = (p->Lk + 31) / 32 * 2,
                .vt_stride = (p->Lk + 31) / 32 * 2, .kn_stride = dh / 16,
                .scale = p->scale,
                .dq = p->dq + b * p->bsq + h * p->hsq + i0 * p->ldq,
                .ldq_out = p->ldq};
            mha_bf16_backward_q(&w, &s);
        }
        mha_bf16_end();
    }
    free(ws);
    return MHA_OK;
}

#else   /* no bf16 kernels in this build: mha_bf16_tier() never says so */

mha_status mha_attn_bf16(const mha_engine *e, const mha_half_problem *p)
{
    (void)e;
    (void)p;
    return mha_set_error(MHA_ERR_UNSUPPORTED, "no bf16 kernels on this CPU family");
}

mha_status mha_attn_bf16_backward(const mha_engine *e,
                                 const mha_half_problem *p)
{
    return mha_attn_bf16(e, p);
}

#endif
