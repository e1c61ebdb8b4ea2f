/*
 * half.c -- attention on bf16 heads with AMX tiles (kernels/amx.c): the
 * driver.  mha_attention (sdpa.c) comes here for bf16 q, k, v and out when
 * the CPU has AMX and the call is plain or causal attention (key lengths
 * allowed); every other half-precision call is widened there instead.
 *
 *   1. K and V of each (b, K/V head) packed once into AMX's tile layouts
 *      (work items (b, g), spread over the threads);
 *   2. each (b, h, block of 32 query rows) one work item, computed by one
 *      thread from start to end (mha_amx_flash_rows), the blocks with the
 *      most keys first when causal (dynamic scheduling balances them).
 *
 * Every item's arithmetic is fixed by its indices alone, so the bits do
 * not depend on the thread count.
 */
#include "attention.h"

#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__)

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

mha_status mha_attn_amx(const mha_engine *e, const mha_half_problem *p)
{
    const int dh = (int)p->dh;
    const int64_t words = mha_amx_packed_words(p->Lk, dh);
    const int64_t nqb = (p->Lq + 31) / 32, group = p->H / p->Hkv;
    int64_t n_packed, n_items, n_scratch;
    if (!mha_mul_ok(p->B * p->Hkv, 2 * words, &n_packed) ||
        !mha_mul_ok(p->B * p->H, nqb, &n_items) ||
        !mha_mul_ok(e->threads, mha_amx_scratch_floats(dh) + 64, &n_scratch) ||
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
    const int64_t n_kv = p->B * p->Hkv;
    const int64_t per_thread = mha_amx_scratch_floats(dh) + 64;

#pragma omp parallel num_threads(e->threads)
    {
#ifdef _OPENMP
        const int t = omp_get_thread_num();
#else
        const int t = 0;
#endif
        /* 1. K and V packed per (b, K/V head) */
#pragma omp for schedule(static)
        for (int64_t bg = 0; bg < n_kv; bg++) {
            const int64_t b = bg / p->Hkv, g = bg % p->Hkv;
            uint32_t *kp = packed + bg * 2 * words;
            mha_amx_pack_k(p->k + b * p->bsk + g * p->hsk, p->ldk, p->Lk, dh,
                           kp);
            mha_amx_pack_v(p->v + b * p->bsv + g * p->hsv, p->ldv, p->Lk, dh,
                           kp + words);
        }

        /* 2. the query blocks; 64-byte aligned parts of this thread's
         * scratch */
        float *base = scratch + t * per_thread;
        mha_amx_scratch s;
        s.S = base;
        s.O = s.S + 32 * MHA_AMX_BK;
        s.m = s.O + 32 * dh;
        s.l = s.m + 32;
        s.P = (uint16_t *)(s.l + 32 * 16);
        s.Q = s.P + 32 * MHA_AMX_BK;
        int64_t lim[32];
        mha_amx_begin();
#pragma omp for schedule(dynamic)
        for (int64_t it = 0; it < n_items; it++) {
            const int64_t bh = it / nqb, qb = nqb - 1 - it % nqb;
            const int64_t b = bh / p->H, h = bh % p->H, g = h / group;
            const int64_t i0 = qb * 32;
            const int mr = (int)(p->Lq - i0 < 32 ? p->Lq - i0 : 32);
            for (int r = 0; r < mr; r++)
                lim[r] = row_limit(p, b, i0 + r);
            const uint32_t *kp = packed + (b * p->Hkv + g) * 2 * words;
            const mha_amx_block w = {
                .q = p->q + b * p->bsq + h * p->hsq + i0 * p->ldq,
                .ldq = p->ldq, .mr = mr, .dh = dh, .lim = lim,
                .kp = kp, .vp = kp + words, .scale = p->scale,
                .out = p->out + b * p->bso + h * p->hso + i0 * p->ldo,
                .ldo = p->ldo,
                .lse = p->lse ? p->lse + (b * p->H + h) * p->Lq + i0 : NULL};
            mha_amx_flash_rows(&w, &s);
        }
        mha_amx_end();
    }
    free(packed);
    free(scratch);
    return MHA_OK;
}

#else   /* no AMX off x86: mha_half_amx_ok() never says yes */

mha_status mha_attn_amx(const mha_engine *e, const mha_half_problem *p)
{
    (void)e;
    (void)p;
    return mha_set_error(MHA_ERR_UNSUPPORTED, "AMX exists on x86 only");
}

#endif
