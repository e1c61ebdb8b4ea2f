/*
 * sdpa.c -- mha_attention: the attention of attention.c on heads the
 * caller has already projected, without a module.
 */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

mha_status mha_attention(const mha_attention_args *a)
{
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    const int64_t B = a->batch, H = a->num_heads, dh = a->head_dim;
    const int64_t Lq = a->q_len, Lk = a->kv_len ? a->kv_len : a->q_len;
    if (B < 1 || H < 1 || dh < 1 || Lq < 1 || Lk < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "batch, num_heads, head_dim, q_len and kv_len "
                             "must be >= 1, got %lld, %lld, %lld, %lld, %lld",
                             (long long)B, (long long)H, (long long)dh,
                             (long long)Lq, (long long)Lk);
    if (!a->q || !a->k || !a->v || !a->out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !a->q ? "q" : !a->k ? "k" : !a->v ? "v" : "out");
    if (!isfinite(a->scale))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "scale must be finite, got %g", (double)a->scale);
    if (!(a->dropout >= 0.0f && a->dropout <= 1.0f))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dropout must be in [0, 1], got %g",
                             (double)a->dropout);
    if (a->need_weights != MHA_WEIGHTS_NONE &&
        a->need_weights != MHA_WEIGHTS_AVERAGE &&
        a->need_weights != MHA_WEIGHTS_PER_HEAD)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "need_weights must be NONE, AVERAGE or PER_HEAD, "
                             "got %d", (int)a->need_weights);
    if (a->need_weights != MHA_WEIGHTS_NONE && !a->attn_weights)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "need_weights is set but attn_weights is NULL");
    if (a->num_threads < 0 || a->num_threads > 4096)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "num_threads must be in [0, 4096], got %d",
                             a->num_threads);
    int64_t E, t, n_q, n_w;
    if (!mha_mul_ok(H, dh, &E) || E > 0x7fffffff ||
        !mha_mul_ok(B, Lq, &t) || !mha_mul_ok(t, E, &n_q) ||
        !mha_mul_ok(B, Lk, &t) || !mha_mul_ok(t, E, &t) ||
        !mha_mul_ok(B, H, &t) || !mha_mul_ok(t, Lq, &t) ||
        !mha_mul_ok(t, Lk, &n_w) || n_w > INT64_MAX / 8 ||
        n_q > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "attention sizes overflow 64 bits");
    if (a->need_weights == MHA_WEIGHTS_AVERAGE)
        n_w /= H;

    /* The mask fields are those of mha_forward_args. */
    mha_forward_args fa = {0};
    fa.batch = B;
    fa.q_len = Lq;
    fa.kv_len = Lk;
    fa.attn_mask = a->attn_mask;
    fa.key_padding_mask = a->key_padding_mask;
    fa.key_lengths = a->key_lengths;
    fa.causal = a->causal;
    mha_mask_plan mask;
    MHA_CHECK(mha_mask_plan_init(&mask, H, 0, &fa));
    mha_isa isa;
    const mha_microkernels *uk;
    MHA_CHECK(mha_isa_get(&isa, &uk));

    int threads = a->num_threads;
#ifdef _OPENMP
    if (threads == 0)
        threads = omp_get_max_threads();
#else
    threads = 1;
#endif
    if (threads < 1)
        threads = 1;
    const int64_t per_thread = mha_attn_scratch(isa, dh, Lk);
    const int64_t n_stats = 2 * B * H * Lq;
    const int64_t n_partials =
        isa == MHA_ISA_REF ? 0 : mha_attn_partials(B, H, Lq, Lk, dh);
    const int64_t n_packed =
        isa == MHA_ISA_REF ? 0 : mha_attn_packed(B, H, Lk, dh);
    float *ws = mha_alloc_floats(n_stats + n_partials + n_packed +
                                     per_thread * threads,
                                 "attention workspace");
    if (!ws)
        return MHA_ERR_OUT_OF_MEMORY;
    if (a->need_weights != MHA_WEIGHTS_NONE)
        memset(a->attn_weights, 0, (size_t)n_w * sizeof(float));
    mha_attn at = {
        .B = B, .H = H, .Lq = Lq, .Lk = Lk, .Lt = Lk, .dh = dh,
        .q = a->q, .k = a->k, .v = a->v, .ldq = E, .ldk = E, .ldv = E,
        .scale = a->scale != 0.0f ? a->scale : (float)(1.0 / sqrt((double)dh)),
        .mask = &mask, .dropout = a->training && a->dropout > 0.0f,
        .p_drop = a->dropout, .seed = a->dropout_seed, .ctx = a->out,
        .ldc = E, .stats = ws, .weights = a->need_weights,
        .w = a->need_weights != MHA_WEIGHTS_NONE ? a->attn_weights : NULL,
        .partials = ws + n_stats, .packed = ws + n_stats + n_partials};
    mha_attn_run(isa, uk, &at, threads, ws + n_stats + n_partials + n_packed,
                 per_thread);
    free(ws);
    return MHA_OK;
}
