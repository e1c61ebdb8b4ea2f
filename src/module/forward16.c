/*
 * forward16.c -- the module's forward on bf16 or f16 data: the same
 * three steps as forward.c, every tensor between them 16-bit.
 *
 *   query16 (B,Lq,E)    -- W_q -->  q16 (B*Lq, D)      mha_linear16: sums
 *   key16   (B,Lk,kdim) -- W_k -->  k16 (B*Lk, Dkv)    in float32, + b,
 *   value16 (B,Lk,vdim) -- W_v -->  v16 (B*Lk, Dvkv)   rounded to the type
 *   attention on 16-bit heads (mha_attention, dtype BF16 / F16): ctx16
 *   ctx16 (B*Lq, Dv)    -- W_o -->  out16 (B, Lq, E)
 *
 * The weights and biases are the module's float32 parameters rounded to
 * the data's type once per call (a module holds float32; rounding is
 * exact for parameters that came from a bf16 model), packed for the
 * bf16 kernels when those run.  This is what PyTorch computes for a
 * module moved to bfloat16: its linear layers round their outputs, its
 * SDPA takes 16-bit q, k and v.
 *
 * Its workspace is the plan's, allocated by the plan's first 16-bit
 * forward (its size depends on the kernels, which MHA_BF16 may change
 * before the first call) and kept until mha_plan_free.
 */
#include "module.h"
#include "core/half.h"
#include "kernels/kernels.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* What a 16-bit forward does not do yet, by the field that asks for it. */
static mha_status check_fields16(const mha_module *m,
                                 const mha_forward_args *a)
{
    const mha_config *c = &m->cfg;
    const char *f = a->query ? "query" : a->key ? "key" : a->value ? "value"
                  : a->out ? "out" : NULL;
    if (f)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype %s takes its data in query16, key16, "
                             "value16 and out16; %s must be NULL",
                             a->dtype == MHA_DTYPE_BF16 ? "BF16" : "F16", f);
    if (!a->query16)
        return mha_set_error(MHA_ERR_NULL_POINTER, "query16 is NULL");
    if (!a->out16)
        return mha_set_error(MHA_ERR_NULL_POINTER, "out16 is NULL");
    f = a->cache ? "a KV cache"
      : a->need_weights != MHA_WEIGHTS_NONE ? "attention weights"
      : a->training ? "training (no 16-bit backward yet)"
      : a->head_mask ? "head_mask"
      : a->positions ? "positions"
      : a->q_total ? "a slice of the query rows (q_total)"
      : c->mods.rope.style != MHA_ROPE_NONE ? "RoPE"
      : c->add_bias_kv ? "add_bias_kv"
      : c->add_zero_attn ? "add_zero_attn" : NULL;
    if (f)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "a %s forward does not take %s yet: run it on "
                             "float32 data",
                             a->dtype == MHA_DTYPE_BF16 ? "bf16" : "f16", f);
    return MHA_OK;
}

/* The module's bias b (n floats, or NULL) rounded to the type; *top
 * grows to its largest |b|. */
static float *round_bias(const float *b, int64_t n, int bf, float *dst,
                         float *top)
{
    if (!b)
        return NULL;
    for (int64_t i = 0; i < n; i++) {
        dst[i] = mha_half_round(b[i], bf);
        *top = fabsf(b[i]) > *top ? fabsf(b[i]) : *top;
    }
    return dst;
}

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

mha_status mha_linear16_kernel(mha_dtype dtype, int *kernel)
{
    const char *k = mha_bf16_kernel();
    if (!k)
        return MHA_ERR_INVALID_ARGUMENT;   /* a bad MHA_BF16 (message set) */
    *kernel = dtype == MHA_DTYPE_BF16 && strcmp(k, "float32") != 0;
    return MHA_OK;
}

mha_attention_args mha_attention16_args(const mha_plan *plan,
                                        const mha_forward_args *a)
{
    const mha_module *m = plan->m;
    const mha_config *c = &m->cfg;
    const fwd_shape *s = &plan->shape;
    mha_attention_args at = {
        .batch = s->B, .num_heads = s->H, .head_dim = s->dh,
        .v_head_dim = s->dv, .q_len = s->Lq,
        .kv_len = s->Lk, .num_kv_heads = s->Hkv, .scale = c->scale,
        .given = MHA_GIVEN_SCALE, .attn_mask = a->attn_mask,
        .key_padding_mask = a->key_padding_mask,
        .key_lengths = a->key_lengths, .causal = a->causal,
        .num_threads = plan->eng.threads, .dtype = a->dtype};
    at.mods = c->mods;
    memset(&at.mods.rope, 0, sizeof at.mods.rope);   /* (refused) */
    at.mods.alibi_slopes = c->mods.alibi ? m->slopes : NULL;
    at.attention_chunk = c->attention_chunk;
    at.sinks = m->sinks;
    return at;
}

mha_status mha_forward16(mha_plan *plan, const mha_forward_args *a)
{
    const mha_module *m = plan->m;
    const mha_config *c = &m->cfg;
    const fwd_shape *s = &plan->shape;
    MHA_CHECK(check_fields16(m, a));
    const int bf = a->dtype == MHA_DTYPE_BF16;
    int kernel;
    MHA_CHECK(mha_linear16_kernel(a->dtype, &kernel));
    const int nt = plan->eng.threads;
    const uint16_t *query = a->query16;
    const uint16_t *key = a->key16 ? a->key16 : query;
    const uint16_t *value = a->value16 ? a->value16 : key;
    const int64_t E = s->E, D = s->D, Dkv = s->Dkv, Dv = s->Dv;
    const int64_t Dvkv = s->Dvkv;
    const int64_t rows_q = s->B * s->Lq, rows_k = s->B * s->Lk;

    /* The workspace, in 64-byte lines: the four weights as the kernels
     * read them, the biases, q, k, v and ctx (16-bit), the rows' lse
     * (kept with q, k, v and ctx for the backward), the threads'
     * scratch.  Sizes are below 2^60 (mha_fwd_check_shapes). */
    const int64_t nw[4] = {
        up16(mha_linear16_weight_floats(kernel, D, E)),
        up16(mha_linear16_weight_floats(kernel, Dkv, c->kdim)),
        up16(mha_linear16_weight_floats(kernel, Dvkv, c->vdim)),
        up16(mha_linear16_weight_floats(kernel, E, Dv))};
    int64_t widest = E > D ? E : D;
    widest = widest > Dv ? widest : Dv;
    widest = widest > c->kdim ? widest : c->kdim;
    widest = widest > c->vdim ? widest : c->vdim;
    const int64_t per_thread = up16(mha_linear16_scratch_floats(kernel, widest));
    const int64_t n_b = up16(D) + up16(Dkv) + up16(Dvkv) + up16(E);
    const int64_t n_q = up16((s->n_qd + 1) / 2), n_k = up16((s->n_kvd + 1) / 2);
    const int64_t n_c = up16((s->n_ctx + 1) / 2), n_v = up16((s->n_vd + 1) / 2);
    const int64_t n_lse = up16(s->B * s->H * s->Lq);
    int64_t total =
        nw[0] + nw[1] + nw[2] + nw[3] + n_b + n_q + n_c + n_k + n_v + n_lse,
            n_scratch;
    if (!mha_mul_ok(per_thread, nt, &n_scratch) ||
        total > INT64_MAX / 8 - n_scratch)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "the 16-bit forward's workspace overflows");
    total += n_scratch;
    MHA_CHECK(mha_plan_buffer(&plan->ws16, &plan->n_ws16, total,
                              "the 16-bit forward's workspace"));
    float *ws = plan->ws16;
    float *wq = ws, *wk = wq + nw[0], *wv = wk + nw[1], *wo = wv + nw[2];
    float *bias = wo + nw[3];
    uint16_t *q16 = (uint16_t *)(bias + n_b);
    uint16_t *ctx16 = (uint16_t *)(bias + n_b + n_q);
    uint16_t *k16 = (uint16_t *)(bias + n_b + n_q + n_c);
    uint16_t *v16 = (uint16_t *)(bias + n_b + n_q + n_c + n_k);
    float *lse = bias + n_b + n_q + n_c + n_k + n_v;
    float *scratch = lse + n_lse;

    /* The weights and biases rounded (into the workspace only), and the
     * largest |w| of them on the way: parameters are finite
     * (mha_param_set), and one past the type's range would round to inf.
     * Rounding is monotonic: the largest decides. */
    const mha_lin16_weight ws4[4] = {{m->w_q, D, E, wq},
                                     {m->w_k, Dkv, c->kdim, wk},
                                     {m->w_v, Dvkv, c->vdim, wv},
                                     {m->w_o, E, Dv, wo}};
    float wmax = mha_linear16_prepare_all(ws4, 4, kernel, bf, nt);
    const float *bq = round_bias(m->b_q, D, bf, bias, &wmax);
    const float *bk = round_bias(m->b_k, Dkv, bf, bias + up16(D), &wmax);
    const float *bv =
        round_bias(m->b_v, Dvkv, bf, bias + up16(D) + up16(Dkv), &wmax);
    const float *bo = round_bias(m->b_o, E, bf,
                                 bias + up16(D) + up16(Dkv) + up16(Dvkv),
                                 &wmax);
    if (isinf(mha_half_round(wmax, bf)))
        return mha_set_error(MHA_ERR_NON_FINITE,
                             "a parameter of the module (|w| = %g) is past "
                             "%s's largest finite value: run the module in "
                             "%s", (double)wmax, bf ? "bf16" : "f16",
                             bf ? "float32" : "bf16 or float32");

    /* A q, k or v past the type's range would turn every score it meets
     * into inf or NaN: refused, before out16 is written. */
    const int64_t over[3] = {
        mha_linear16(query, rows_q, E, E, bf, kernel, wq, D, bq, q16, D,
                     scratch, nt),
        mha_linear16(key, rows_k, c->kdim, c->kdim, bf, kernel, wk, Dkv, bk,
                     k16, Dkv, scratch, nt),
        mha_linear16(value, rows_k, c->vdim, c->vdim, bf, kernel, wv, Dvkv,
                     bv, v16, Dvkv, scratch, nt)};
    for (int i = 0; i < 3; i++)
        if (over[i])
            return mha_set_error(MHA_ERR_NON_FINITE,
                                 "%lld values of the %s projection pass %s's "
                                 "largest finite value: run the module in "
                                 "bf16 or float32", (long long)over[i],
                                 i == 0 ? "query" : i == 1 ? "key" : "value",
                                 bf ? "bf16" : "f16");

    mha_attention_args at = mha_attention16_args(plan, a);
    at.q16 = q16, at.k16 = k16, at.v16 = v16, at.out16 = ctx16, at.lse = lse;
    if (!plan->att16)
        MHA_CHECK(mha_attention_plan_create(&at, &plan->att16));
    MHA_CHECK(mha_attention_plan_run(plan->att16, &at));
    /* Taken before out16 (which may alias the query) is written. */
    const uint64_t print = mha_fwd_fingerprint(m, s, a);
    /* (an output past the range is +-inf, as PyTorch's f16 module gives) */
    mha_linear16(ctx16, rows_q, Dv, Dv, bf, kernel, wo, E, bo, a->out16, E,
                 scratch, nt);
    /* What the backward needs is now in the workspace. */
    plan->q16 = q16, plan->k16 = k16, plan->v16 = v16, plan->ctx16 = ctx16;
    plan->lse16 = lse;
    plan->saved = *a;
    plan->saved_print = print;
    plan->has_saved = 1;
    return MHA_OK;
}
