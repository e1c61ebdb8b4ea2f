/*
 * request.c -- the engine's front door.  Both callers describe an
 * attention as one mha_attn_request: the heads call (mha_attention and
 * its plans, sdpa.c) and the module's plans (forward.c, backward.c).  The
 * checks they share and the problem the tiers run are written here once:
 *
 *   check     per plan: the cache's shape and window, causal, the
 *             modifiers and chunks, the weights' mode
 *   masks     per run: the weights' buffer, the cache's keys now, the
 *             mask plan (mask.c)
 *   prepare   per run, on the data, before anything is written: the
 *             score range, an append's room
 *   problem   the mha_attn the tiers run
 *   run       the append, the weights zeroed, a rotated cache's turns
 */
#include "kv_cache.h"

#include <string.h>

mha_status mha_attn_request_check(const mha_attn_request *r, const char *who)
{
    MHA_CHECK(mha_check_weights_mode(r->need_weights));
    if (r->mods)
        MHA_CHECK(mha_modifiers_check(r->mods, r->H, who));
    MHA_CHECK(mha_chunk_check(r->chunk, who));
    const mha_kv_cache *kv = r->cache;
    if (!kv)
        return MHA_OK;
    if (r->causal == MHA_CAUSAL_TOP_LEFT)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "with a KV cache, causal masking is bottom-right "
                             "(each new token sees its sequence's past): "
                             "causal TOP_LEFT is refused");
    if (r->kv_len > kv->capacity)
        return mha_set_error(MHA_ERR_SHAPE,
                             "kv_len %lld exceeds the cache's capacity %lld",
                             (long long)r->kv_len, (long long)kv->capacity);
    if (kv->B != r->B || kv->Hkv != r->Hkv || kv->dh != r->dh)
        return mha_set_error(MHA_ERR_SHAPE,
                             "the cache holds %lld sequences of %lld K/V "
                             "heads of %lld; the call has batch %lld and "
                             "%lld K/V heads of %lld",
                             (long long)kv->B, (long long)kv->Hkv,
                             (long long)kv->dh, (long long)r->B,
                             (long long)r->Hkv, (long long)r->dh);
    if (kv->dv != r->dv)
        return mha_set_error(MHA_ERR_SHAPE,
                             "the cache's values are %lld wide, the call's "
                             "%lld", (long long)kv->dv, (long long)r->dv);
    if (kv->window) {
        MHA_CHECK(mha_kv_cache_window_args(&r->attn_mask,
                                           &r->key_padding_mask,
                                           r->key_lengths, r->need_weights,
                                           r->kv_len));
        MHA_CHECK(mha_kv_cache_check_window(kv, r->Lq, r->append));
    }
    return MHA_OK;
}

mha_status mha_attn_request_masks(mha_attn_request *r, mha_mask_plan *mask)
{
    MHA_CHECK(mha_check_mode_fields(r->need_weights, r->attn_weights));
    for (int64_t b = 0; r->append && !r->cache->window && b < r->B; b++)
        if (r->cache->len[b] > r->cache->capacity - r->append)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "sequence %lld of the cache holds %lld of "
                                 "%lld tokens: %lld more do not fit",
                                 (long long)b, (long long)r->cache->len[b],
                                 (long long)r->cache->capacity,
                                 (long long)r->append);
    if (r->cache) {
        /* The keys are the cache's: Lk is its longest sequence once this
         * step's tokens are in (a window cache: the most slots a sequence
         * fills). */
        r->Lk = mha_kv_cache_keys(r->cache, r->append);
        if (r->kv_len && r->kv_len != r->Lk)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "kv_len %lld differs from Lk = %lld, the "
                                 "longest sequence in the KV cache with "
                                 "this step's %lld tokens (0 = that length)",
                                 (long long)r->kv_len, (long long)r->Lk,
                                 (long long)r->append);
    }
    return mha_mask_plan_of(mask, r);
}

int64_t mha_attn_request_weights_floats(const mha_attn_request *r)
{
    return r->B * r->Lq * (r->Lk + mha_request_extra(r)) *
           (r->need_weights == MHA_WEIGHTS_PER_HEAD ? r->H : 1);
}

/* The largest finite |x| of a tensor of `rows` rows of n heads (strides
 * as the request's: heads first when hs is set). */
static double amax(const mha_attn_request *r, const float *x, int64_t rows,
                   int64_t heads, int64_t w, int64_t ld, int64_t hs,
                   int threads, mha_amax_fn scan)
{
    if (!x)
        return 0.0;
    if (r->x16 != MHA_KV_F32) {   /* (x: the caller's 16-bit array) */
        const uint16_t *h = (const uint16_t *)(const void *)x;
        const int bf = r->x16 == MHA_KV_BF16;
        return hs ? mha_max_abs_finite16(h, 1, rows * heads * w, 0, bf,
                                         threads)
                  : mha_max_abs_finite16(h, rows, heads * w, ld, bf, threads);
    }
    return hs ? mha_max_abs_finite(x, 1, rows * heads * w, 0, threads, scan)
              : mha_max_abs_finite(x, rows, heads * w, ld, threads, scan);
}

mha_status mha_attn_request_prepare(const mha_attn_request *r,
                                    const mha_microkernels *uk, int threads)
{
    /* Scores that could overflow float32 are refused before anything is
     * written.  The keys: those given (an append's new ones) and what the
     * cache ever held. */
    const int64_t krows = r->B * (r->cache ? r->append : r->Lk);
    double kmax = amax(r, r->k, krows, r->Hkv, r->dh, r->ldk, r->hsk, threads,
                       uk->amax);
    if (r->cache && r->cache->key_amax > kmax)
        kmax = r->cache->key_amax;
    const double qmax = amax(r, r->q, r->B * r->Lq, r->H, r->dh, r->ldq, r->hsq,
                             threads, uk->amax);
    MHA_CHECK(mha_check_score_range(r->scale, r->dh, qmax * r->q_growth,
                                    kmax));
    if (!r->append)
        return MHA_OK;
    for (int64_t b = 0; b < r->B; b++)   /* what f16 can hold */
        MHA_CHECK(mha_kv_cache_check_values(r->cache, b,
                                            r->k + b * r->append * r->ldk,
                                            r->ldk,
                                            r->v + b * r->append * r->ldv,
                                            r->ldv, r->append));
    /* a paged cache's pages: the last check */
    return mha_kv_pages_reserve(r->cache, -1, r->append);
}

mha_attn mha_attn_request_problem(const mha_attn_request *r,
                                  const mha_mask_plan *mask, float *ws,
                                  const mha_attn_layout *lay)
{
    const mha_modifiers *mods = r->mods;
    const mha_attn at = {
        .B = r->B, .H = r->H, .Hkv = r->Hkv, .Lq = r->Lq, .Lk = r->Lk,
        .Lt = r->Lk + mha_request_extra(r), .dh = r->dh, .dv = r->dv,
        .q = r->q, .k = r->k, .v = r->v,
        .ldq = r->ldq, .ldk = r->ldk, .ldv = r->ldv,
        .hsq = r->hsq, .hsk = r->hsk, .hsv = r->hsv, .hsc = r->hso,
        .bsq = r->bsq, .bsk = r->bsk, .bsv = r->bsv, .bsc = r->bso,
        .bias_k = r->bias_k, .bias_v = r->bias_v, .zero_attn = r->zero_attn,
        .scale = r->scale, .mask = mask,
        .softcap = mods ? mods->softcap : 0.0f,
        .alibi = mods && mods->alibi ? r->slopes : NULL,
        .sinks = r->sinks, .dropout = r->dropout, .p_drop = r->p_drop,
        .seed = r->seed, .drop_row0 = r->q_start, .ctx = r->out,
        .ldc = r->ldo, .stats = ws + lay->stats, .weights = r->need_weights,
        .w = r->need_weights != MHA_WEIGHTS_NONE ? r->attn_weights : NULL,
        .partials = ws + lay->partials, .packed = ws + lay->packed,
        .x16 = r->x16};
    return at;
}

void mha_attn_request_run(const mha_engine *e, const mha_attn_request *r,
                          mha_attn *at, mha_mask_plan *mask, float *qbuf,
                          float *scratch, int64_t per_thread)
{
    mha_kv_cache *kv = r->cache;
    for (int64_t b = 0; r->append && b < r->B; b++)
        mha_kv_cache_put(kv, b, r->k + b * r->append * r->ldk, r->ldk,
                         r->v + b * r->append * r->ldv, r->ldv, r->append);
    if (at->w)
        memset(at->w, 0,
               (size_t)mha_attn_request_weights_floats(r) * sizeof(float));
    const int turned = kv && kv->rot_block;
    if (kv)
        mha_attn_use_cache(at, kv, mask);
    if (turned) {   /* q into the stored keys' basis, out back after */
        if (at->q != qbuf)
            memcpy(qbuf, at->q, (size_t)(r->B * r->Lq) * (size_t)r->ldq *
                                    sizeof *qbuf);
        mha_kv_cache_turn(kv, qbuf, r->B * r->Lq, r->H, r->ldq);
        at->q = qbuf;
    }
    mha_attn_run(e, at, scratch, per_thread);
    if (turned)
        mha_kv_cache_turn(kv, at->ctx, r->B * r->Lq, r->H, at->ldc);
}
