/*
 * backward.c -- the gradients of forward.c's pass, in reverse order:
 *
 *   out = (ctx M) W_o^T + b_o    dctx = (dout W_o) M,  dm_h = sum (dout W_o)_h . ctx_h
 *   (M: the head mask, m_h on   dW_o = dout^T (ctx M),  db_o = sum_rows dout
 *    head h's columns)
 *   ctx = attention(q, k, v)     dq, dk, dv, d bias_k, d bias_v
 *                                (attention.c: flash-style, from the
 *                                forward's row stats)
 *   q = x_q W_q^T + b_q          dx_q = dq W_q,  dW_q = dq^T x_q,
 *   (k, v likewise)              db_q = sum_rows dq
 *
 * The forward's plan keeps what this needs: the projections q, k, v (with
 * RoPE, q and k as rotated: dq, dk are turned back below), the
 * context ctx and one (max, 1/sum) pair per row and head.  Gradients of
 * projections that were fused into one GEMM in the forward (q|k|v of
 * self-attention, k|v when key == value) are fused the same way here: one
 * GEMM for the weight gradient of in_proj_weight's rows, one for the input.
 */
#include "module.h"
#include "attention/rope.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Whether [a, a + na) and [b, b + nb) (floats) share memory. */
static int overlaps(const void *a, int64_t na, const void *b, int64_t nb)
{
    if (!a || !b)
        return 0;
    const uintptr_t a0 = (uintptr_t)a, a1 = a0 + (uintptr_t)na * sizeof(float);
    const uintptr_t b0 = (uintptr_t)b, b1 = b0 + (uintptr_t)nb * sizeof(float);
    return a0 < b1 && b0 < a1;
}

static int same_mask(const mha_mask *x, const mha_mask *y)
{
    return x->kind == y->kind && (x->kind == MHA_MASK_NONE || x->data == y->data);
}

/* Is `a` the forward the plan last ran, whose state is in the workspace? */
static mha_status check_saved(const mha_plan *p, const mha_forward_args *a)
{
    if (a->q_total || a->q_start)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a forward of a slice of the query rows "
                             "(q_total) has no backward: differentiate the "
                             "whole problem");
    if (!p->has_saved)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "no forward to differentiate: call "
                             "mha_plan_forward on this plan first (a failed "
                             "forward leaves nothing either)");
    const mha_forward_args *s = &p->saved;
    if (a->dtype != s->dtype)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "the forward's dtype %d differs from the plan's "
                             "last forward's (%d)", (int)a->dtype,
                             (int)s->dtype);
    if (mha_fwd_query(a) != mha_fwd_query(s) ||
        mha_fwd_key(a) != mha_fwd_key(s) ||
        mha_fwd_value(a) != mha_fwd_value(s) ||
        a->batch != s->batch || a->q_len != s->q_len ||
        a->kv_len != s->kv_len || !same_mask(&a->attn_mask, &s->attn_mask) ||
        !same_mask(&a->key_padding_mask, &s->key_padding_mask) ||
        a->key_lengths != s->key_lengths || a->causal != s->causal ||
        a->head_mask != s->head_mask || a->positions != s->positions ||
        (a->training != 0) != (s->training != 0) ||
        a->dropout_seed != s->dropout_seed)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "the arguments differ from those of the plan's "
                             "last forward (inputs, masks, head_mask, causal, "
                             "training, dropout_seed and positions must be "
                             "the same)");
    const mha_config *c = &p->m->cfg;
    const fwd_shape *sh = &p->shape;
    const int64_t rows_k = sh->B * sh->Lk;
    /* (in floats: 16-bit data counts half) */
    const int h = s->dtype != MHA_DTYPE_F32;
    const void *out = h ? (const void *)s->out16 : (const void *)s->out;
    const int64_t nq = h ? (sh->n_q + 1) / 2 : sh->n_q;
    if (overlaps(out, nq, mha_fwd_query(s), nq) ||
        overlaps(out, nq, mha_fwd_key(s),
                 h ? (rows_k * c->kdim + 1) / 2 : rows_k * c->kdim) ||
        overlaps(out, nq, mha_fwd_value(s),
                 h ? (rows_k * c->vdim + 1) / 2 : rows_k * c->vdim))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "the forward's out overwrote its query, key or "
                             "value, which the backward needs: give the "
                             "forward a separate out");
    /* The same pointers may hold other data: a training loop that refills
     * its input buffer between forward and backward would get the
     * gradients of data the forward never saw. */
    if (mha_fwd_fingerprint(p->m, sh, a) != p->saved_print)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "the contents of the inputs, masks, key_lengths "
                             "or head_mask changed since the plan's last "
                             "forward: run mha_plan_forward again on the new "
                             "data before its backward");
    return MHA_OK;
}

static mha_status check_grads(const mha_forward_args *a,
                              const mha_backward_args *g)
{
    if (a->dtype != MHA_DTYPE_F32) {
        const char *f = g->grad_out ? "grad_out" : g->grad_query ? "grad_query"
                      : g->grad_key ? "grad_key"
                      : g->grad_value ? "grad_value" : NULL;
        if (f)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "a 16-bit forward's gradients are in "
                                 "grad_out16, grad_query16, grad_key16 and "
                                 "grad_value16; %s must be NULL", f);
        if (!g->grad_out16)
            return mha_set_error(MHA_ERR_NULL_POINTER, "grad_out16 is NULL");
        if (g->grad_head_mask)
            return mha_set_error(MHA_ERR_UNSUPPORTED,
                                 "a 16-bit backward has no head mask "
                                 "gradient: run the module in float32");
        if (!a->key16 && (g->grad_key16 || g->grad_value16))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "key16 is NULL (the query is also key and "
                                 "value), so its whole gradient goes to "
                                 "grad_query16: grad_key16 and grad_value16 "
                                 "must be NULL");
        if (a->key16 && !a->value16 && g->grad_value16)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "value16 is NULL (the key is also the "
                                 "value), so its whole gradient goes to "
                                 "grad_key16: grad_value16 must be NULL");
        return MHA_OK;
    }
    if (g->grad_out16 || g->grad_query16 || g->grad_key16 || g->grad_value16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a float32 forward's gradients are in grad_out, "
                             "grad_query, grad_key and grad_value; the "
                             "16-bit fields must be NULL");
    if (!g->grad_out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "grad_out is NULL");
    if (!a->key && (g->grad_key || g->grad_value))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "key is NULL (the query is also key and value), "
                             "so its whole gradient goes to grad_query: "
                             "grad_key and grad_value must be NULL");
    if (a->key && !a->value && g->grad_value)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "value is NULL (the key is also the value), so "
                             "its whole gradient goes to grad_key: "
                             "grad_value must be NULL");
    return MHA_OK;
}

/* Floats of the per-(b, h) sink gradients, rounded up to a 64-byte line:
 * the attention's layout after them keeps its float64 scratch aligned
 * (an odd B H once put the reference tier's doubles on 4-byte
 * boundaries). */
static int64_t sinks_floats(const fwd_shape *s)
{
    return (s->B * s->H + 15) & ~(int64_t)15;
}

/* The backward's workspace: dctx (n_ctx), dq|dk|dv laid out as the
 * forward's projections (n_proj), d bias_k and d bias_v per (b, K/V
 * head), d sinks per (b, h), then (from a 64-byte line) K and V packed
 * for the backward and the per-thread scratch. */
static int64_t attn_part(const mha_plan *p)
{
    const fwd_shape *s = &p->shape;
    const int64_t n = s->n_ctx + p->n_proj + s->B * (s->Dkv + s->Dvkv) +
                      sinks_floats(s);
    return (n + 15) & ~(int64_t)15;
}

static mha_status ensure_workspace(mha_plan *p)
{
    if (p->bws)
        return MHA_OK;
    const fwd_shape *s = &p->shape;
    MHA_CHECK(mha_attn_layout_backward(&p->eng, s->B, s->Hkv, s->Lk, s->Lt,
                                       s->dh, s->dv,
                                       p->m->cfg.mods.softcap > 0.0f,
                                       &p->blay));
    p->bws = mha_alloc_floats(attn_part(p) + p->blay.total,
                              "backward workspace");
    return p->bws ? MHA_OK : MHA_ERR_OUT_OF_MEMORY;
}

/* Where parameter `name`'s gradient starts in grad_params (NULL: absent). */
static float *grad_of(const mha_module *m, float *grad_params,
                      const char *name)
{
    mha_param_info info;
    if (!grad_params || mha_param_info_by_name(m, name, &info) != MHA_OK)
        return NULL;
    return grad_params + info.offset;
}

/* d bias_k (n = Dkv) and d bias_v (n = Dvkv): the per-(b, h) rows summed
 * over b in order. */
static void reduce_bias_kv(const fwd_shape *s, int64_t n, const float *per_b,
                           float beta, float *dst)
{
    if (beta == 0.0f)
        memset(dst, 0, (size_t)n * sizeof *dst);
    for (int64_t b = 0; b < s->B; b++)
        for (int64_t e = 0; e < n; e++)
            dst[e] += per_b[b * n + e];
}

/* dL/d sinks = the batch's per-(b, h) shares, summed over b in order in
 * float64 (added to dst when accumulating). */
static void reduce_sinks(const fwd_shape *s, const float *per_b, float beta,
                         float *dst)
{
    for (int64_t h = 0; h < s->H; h++) {
        double acc = beta == 0.0f ? 0.0 : (double)dst[h];
        for (int64_t b = 0; b < s->B; b++)
            acc += per_b[b * s->H + h];
        dst[h] = (float)acc;
    }
}

/* dL/dm_h = sum over rows and head h's columns of (dout W_o) . ctx, in
 * float64, one fixed order. */
static void head_mask_grad(const fwd_shape *s, const float *dctx,
                           const float *ctx, float beta, float *g)
{
    const int64_t rows = s->B * s->Lq;
    for (int64_t h = 0; h < s->H; h++) {
        double acc = beta == 0.0f ? 0.0 : (double)g[h];
        for (int64_t r = 0; r < rows; r++) {
            const float *x = dctx + r * s->Dv + h * s->dv;
            const float *y = ctx + r * s->Dv + h * s->dv;
            for (int64_t d = 0; d < s->dv; d++)
                acc += (double)x[d] * y[d];
        }
        g[h] = (float)acc;
    }
}

/* dctx's column block h times m_h: what reaches the attention of head h. */
static void scale_heads(const fwd_shape *s, const float *head_mask,
                        float *dctx)
{
    const int64_t rows = s->B * s->Lq;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t h = 0; h < s->H; h++) {
            float *x = dctx + r * s->Dv + h * s->dv;
            for (int64_t d = 0; d < s->dv; d++)
                x[d] *= head_mask[h];
        }
}

static mha_status mha_plan_backward_impl(mha_plan *plan,
                                         const mha_forward_args *a,
                                         const mha_backward_args *g)
{
    if (!plan)
        return mha_set_error(MHA_ERR_NULL_POINTER, "plan is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "forward args are NULL");
    if (!g)
        return mha_set_error(MHA_ERR_NULL_POINTER, "backward args are NULL");
    MHA_CHECK(check_grads(a, g));
    MHA_CHECK(check_saved(plan, a));
    if (plan->dtype != MHA_DTYPE_F32)
        return mha_backward16(plan, a, g);
    MHA_CHECK(ensure_workspace(plan));
    const mha_module *m = plan->m;
    const mha_config *c = &m->cfg;
    const fwd_shape *s = &plan->shape;
    const int64_t E = s->E, D = s->D, Dkv = s->Dkv, Dv = s->Dv;
    const int64_t Dvkv = s->Dvkv;
    const int64_t rows_q = s->B * s->Lq, rows_k = s->B * s->Lk;
    const float beta = g->accumulate ? 1.0f : 0.0f;
    const int nt = plan->eng.threads;   /* the projections' threads too */

    mha_attn_request r = mha_fwd_request(plan, a);
    mha_mask_plan mask;
    MHA_CHECK(mha_attn_request_masks(&r, &mask));
    mha_attn at = mha_attn_request_problem(&r, &mask, mha_plan_attn_ws(plan),
                                           &plan->lay);
    at.weights = MHA_WEIGHTS_NONE;
    at.w = NULL;

    /* The output projection. */
    float *dctx = plan->bws;
    float *dproj = dctx + s->n_ctx;
    float *dbias = dproj + plan->n_proj;      /* [B][Dkv], then [B][Dvkv] */
    float *dsinks = dbias + s->B * (Dkv + Dvkv);   /* [B][H] */
    float *battn = plan->bws + attn_part(plan);  /* the backward's layout */
    mha_linear_grad_input(g->grad_out, rows_q, E, E, m->w_o, Dv, 0.0f, dctx,
                          Dv, nt);
    if (g->grad_head_mask)
        head_mask_grad(s, dctx, at.ctx, beta, g->grad_head_mask);
    const float *hm = mha_head_mask_in_use(a->head_mask, s->H);
    if (hm)
        scale_heads(s, hm, dctx);
    float *gp = g->grad_params;
    if (gp)
        mha_linear_grad_params_blocks(g->grad_out, rows_q, E, E, at.ctx, Dv, Dv,
                                      hm, hm ? s->H : 1,
                                      beta, grad_of(m, gp, "out_proj.weight"),
                                      grad_of(m, gp, "out_proj.bias"), nt);

    /* The attention: dq, dk, dv where the forward kept q, k, v. */
    float *dq = dproj + (plan->q - plan->ws);
    float *dk = dproj + (plan->k - plan->ws);
    float *dv = dproj + (plan->v - plan->ws);
    const mha_attn_grad ag = {
        .dctx = dctx, .lddc = Dv, .dq = dq, .dk = dk, .dv = dv,
        .lddq = plan->ldq, .lddk = plan->ldk, .lddv = plan->ldv,
        .dbias_k = m->bias_k ? dbias : NULL,
        .dbias_v = m->bias_k ? dbias + s->B * Dkv : NULL,
        .dsinks = m->sinks ? dsinks : NULL,
        .packed = battn + plan->blay.packed};
    mha_attn_backward(&plan->eng, &at, &ag, battn + plan->blay.scratch,
                      plan->blay.per_thread);

    /* RoPE: the forward rotated q and k after their projections (the
     * attention saw, and the plan keeps, the rotated values), so dq and
     * dk are with respect to the rotated values; the inverse rotation at
     * the same positions makes them the projections' gradients. */
    if (c->mods.rope.style != MHA_ROPE_NONE) {
        const int self = !a->key || (a->key == a->query && s->Lk == s->Lq);
        mha_rope_rows(&c->mods.rope, s->B, s->Lq, s->H, s->dh, a->positions,
                      NULL, 0, dq, plan->ldq, 1, nt);
        mha_rope_rows(&c->mods.rope, s->B, s->Lk, s->Hkv, s->dh,
                      self ? a->positions : NULL, NULL, 0, dk, plan->ldk, 1,
                      nt);
    }

    /* The input projections' parameters. */
    if (gp) {
        const char *wq = m->packed ? "in_proj_weight" : "q_proj_weight";
        float *dw_q = grad_of(m, gp, wq);
        float *db_q = grad_of(m, gp, "in_proj_bias");
        float *dw_k = m->packed ? dw_q + D * E : grad_of(m, gp, "k_proj_weight");
        float *dw_v = m->packed ? dw_q + 2 * D * E
                                : grad_of(m, gp, "v_proj_weight");
        float *db_k = db_q ? db_q + D : NULL;
        float *db_v = db_q ? db_q + D + Dkv : NULL;
        const float *xq = a->query;
        const float *xk = a->key ? a->key : xq;
        const float *xv = a->value ? a->value : xk;
        if (plan->fuse_qkv) {
            mha_linear_grad_params(dq, rows_q, 3 * D, 3 * D, xq, E, E, beta,
                                   dw_q, db_q, nt);
        } else {
            mha_linear_grad_params(dq, rows_q, D, plan->ldq, xq, E, E, beta,
                                   dw_q, db_q, nt);
            if (plan->fuse_kv) {
                mha_linear_grad_params(dk, rows_k, 2 * D, 2 * D, xk, E, E,
                                       beta, dw_k, db_k, nt);
            } else {
                mha_linear_grad_params(dk, rows_k, Dkv, plan->ldk, xk, c->kdim,
                                       c->kdim, beta, dw_k, db_k, nt);
                mha_linear_grad_params(dv, rows_k, Dvkv, plan->ldv, xv, c->vdim,
                                       c->vdim, beta, dw_v, db_v, nt);
            }
        }
        if (m->bias_k) {
            reduce_bias_kv(s, Dkv, ag.dbias_k, beta, grad_of(m, gp, "bias_k"));
            reduce_bias_kv(s, Dvkv, ag.dbias_v, beta,
                           grad_of(m, gp, "bias_v"));
        }
        if (m->sinks)
            reduce_sinks(s, dsinks, beta, grad_of(m, gp, "sinks"));
    }

    /* The inputs.  A tensor that served as several inputs receives the sum,
     * in the order q, k, v. */
    float *tq = g->grad_query;
    float *tk = a->key ? g->grad_key : tq;
    float *tv = a->value ? g->grad_value : tk;
    if (plan->fuse_qkv && tq && tk == tq && tv == tq) {
        /* [dq | dk | dv] [W_q; W_k; W_v]: one GEMM. */
        mha_linear_grad_input(dq, rows_q, 3 * D, 3 * D, m->w_q, E, 0.0f, tq,
                              E, nt);
        return MHA_OK;
    }
    if (tq)
        mha_linear_grad_input(dq, rows_q, D, plan->ldq, m->w_q, E, 0.0f, tq,
                              E, nt);
    if (plan->fuse_kv && tk && tv == tk) {
        mha_linear_grad_input(dk, rows_k, 2 * D, 2 * D, m->w_k, E,
                              tk == tq ? 1.0f : 0.0f, tk, E, nt);
        return MHA_OK;
    }
    if (tk)
        mha_linear_grad_input(dk, rows_k, Dkv, plan->ldk, m->w_k, c->kdim,
                              tk == tq ? 1.0f : 0.0f, tk, c->kdim, nt);
    if (tv)
        mha_linear_grad_input(dv, rows_k, Dvkv, plan->ldv, m->w_v, c->vdim,
                              tv == tq || tv == tk ? 1.0f : 0.0f, tv, c->vdim,
                              nt);
    return MHA_OK;
}

mha_status mha_plan_backward_sized(mha_plan *plan, const mha_forward_args *fwd,
                                   size_t fwd_size,
                                   const mha_backward_args *bwd,
                                   size_t bwd_size)
{
    MHA_STRUCT_IN(mha_forward_args, fwd);
    MHA_STRUCT_IN(mha_backward_args, bwd);
    return mha_plan_backward_impl(plan, fwd ? &fwd_ : NULL,
                                  bwd ? &bwd_ : NULL);
}

static mha_status mha_backward_impl(const mha_module *m,
                                    const mha_forward_args *fwd,
                                    const mha_backward_args *bwd)
{
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    if (!fwd)
        return mha_set_error(MHA_ERR_NULL_POINTER, "forward args are NULL");
    if (!bwd)
        return mha_set_error(MHA_ERR_NULL_POINTER, "backward args are NULL");
    MHA_CHECK(check_grads(fwd, bwd));
    if (fwd->q_total || fwd->q_start)   /* refused before a forward runs */
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a forward of a slice of the query rows "
                             "(q_total) has no backward: differentiate the "
                             "whole problem");
    mha_forward_args f = *fwd;
    f.need_weights = MHA_WEIGHTS_NONE;
    f.attn_weights = NULL;
    f.out = NULL;
    f.out16 = NULL;
    mha_plan *plan;
    MHA_CHECK(mha_plan_create(m, &f, &plan));
    /* (a 16-bit output takes half of these floats) */
    float *out = mha_alloc_floats(plan->shape.n_q, "forward output");
    mha_status st = out ? MHA_OK : MHA_ERR_OUT_OF_MEMORY;
    if (f.dtype == MHA_DTYPE_F32)
        f.out = out;
    else
        f.out16 = (uint16_t *)out;
    if (st == MHA_OK)
        st = mha_plan_forward(plan, &f);
    if (st == MHA_OK)
        st = mha_plan_backward(plan, &f, bwd);
    free(out);
    mha_plan_free(plan);
    return st;
}

mha_status mha_backward_sized(const mha_module *module,
                              const mha_forward_args *fwd, size_t fwd_size,
                              const mha_backward_args *bwd, size_t bwd_size)
{
    MHA_STRUCT_IN(mha_forward_args, fwd);
    MHA_STRUCT_IN(mha_backward_args, bwd);
    return mha_backward_impl(module, fwd ? &fwd_ : NULL, bwd ? &bwd_ : NULL);
}
