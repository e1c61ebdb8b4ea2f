/*
 * backward16.c -- the gradients of forward16.c's pass on bf16 or f16
 * data, in reverse order, every tensor between the steps 16-bit (where
 * PyTorch's autograd of a module moved to bfloat16 rounds them):
 *
 *   dctx16 = dout16 W_o                     dW_o = dout^T ctx16, db_o
 *   dq16, dk16, dv16: the attention's backward (its 16-bit plan's,
 *            mha_attention_plan_backward16, on the forward it kept;
 *            dL/d sinks float32)
 *   dx_q16 = dq16 W_q                       dW_q = dq^T x_q16,   db_q
 *   (k, v likewise; a tensor that served as several inputs receives
 *   dq W_q + dk W_k + dv W_v, summed in float32 and rounded once)
 *
 * The weight gradients are float32 sums (the module's parameters are
 * float32), never rounded to the type.  The weights are the parameters
 * rounded to the type, as the forward used them, packed for dx = dy W.
 */
#include "module.h"
#include "kernels/kernels.h"

#include <stdlib.h>

static int64_t up16(int64_t n) { return (n + 15) / 16 * 16; }

static int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

/* Parameter p's gradient in grad_params (the same offsets as params). */
static float *grad_at(const mha_module *m, float *gp, const float *p)
{
    return gp && p ? gp + (p - m->params) : NULL;
}

mha_status mha_backward16(mha_plan *plan, const mha_forward_args *a,
                          const mha_backward_args *g)
{
    const mha_module *m = plan->m;
    const mha_config *c = &m->cfg;
    const fwd_shape *s = &plan->shape;
    const int bf = a->dtype == MHA_DTYPE_BF16;
    int kernel;
    MHA_CHECK(mha_linear16_kernel(a->dtype, &kernel));
    const int nt = plan->eng.threads;
    const int64_t E = s->E, D = s->D, Dkv = s->Dkv, Dv = s->Dv;
    const int64_t Dvkv = s->Dvkv;
    const int64_t kd = c->kdim, vd = c->vdim;
    const int64_t rows_q = s->B * s->Lq, rows_k = s->B * s->Lk;
    const uint16_t *query = a->query16;
    const uint16_t *key = a->key16 ? a->key16 : query;
    const uint16_t *value = a->value16 ? a->value16 : key;
    uint16_t *tq = g->grad_query16;
    uint16_t *tk = a->key16 ? g->grad_key16 : tq;
    uint16_t *tv = a->value16 ? g->grad_value16 : tk;
    float *gp = g->grad_params;

    /* The workspace, in 64-byte lines: the four weights of dx = dy W,
     * dctx, dq, dk, dv (16-bit), the linear layer's per-thread scratch,
     * the weight gradients' scratch.  Sizes are below 2^60 (shapes
     * checked by the forward). */
    const int64_t nw[4] = {
        up16(mha_linear16_weight_floats(kernel, Dv, E)),    /* W_o: E -> Dv */
        up16(mha_linear16_weight_floats(kernel, E, D)),     /* W_q: D -> E */
        up16(mha_linear16_weight_floats(kernel, kd, Dkv)),  /* W_k */
        up16(mha_linear16_weight_floats(kernel, vd, Dvkv))}; /* W_v */
    const int64_t n_q = up16((s->n_qd + 1) / 2), n_k = up16((s->n_kvd + 1) / 2);
    const int64_t n_c = up16((s->n_ctx + 1) / 2), n_v = up16((s->n_vd + 1) / 2);
    const int64_t widest = max64(max64(max64(E, D), Dkv), max64(Dv, Dvkv));
    const int64_t n_lin = up16(mha_linear16_scratch_floats(kernel, widest)) * nt;
    int64_t n_grad = 0;
    if (gp) {
        n_grad = mha_linear16_grad_floats(kernel, rows_q, E, Dv, nt);
        n_grad = max64(n_grad, mha_linear16_grad_floats(kernel, rows_q, D, E, nt));
        n_grad = max64(n_grad, mha_linear16_grad_floats(kernel, rows_k, Dkv, kd, nt));
        n_grad = max64(n_grad, mha_linear16_grad_floats(kernel, rows_k, Dvkv, vd, nt));
        n_grad = up16(n_grad);
    }
    const int64_t n_s = up16(s->H);   /* dL/d sinks */
    const int64_t total = nw[0] + nw[1] + nw[2] + nw[3] + n_c + n_q + n_k +
                          n_v + n_lin + n_grad + n_s;
    MHA_CHECK(mha_plan_buffer(&plan->bws16, &plan->n_bws16, total,
                              "the 16-bit backward's workspace"));
    float *wo = plan->bws16, *wq = wo + nw[0], *wk = wq + nw[1],
          *wv = wk + nw[2];
    uint16_t *dctx = (uint16_t *)(wv + nw[3]);
    uint16_t *dq = (uint16_t *)(wv + nw[3] + n_c);
    uint16_t *dk = (uint16_t *)(wv + nw[3] + n_c + n_q);
    uint16_t *dv = (uint16_t *)(wv + nw[3] + n_c + n_q + n_k);
    float *lin = wv + nw[3] + n_c + n_q + n_k + n_v;
    float *gs = lin + n_lin, *dsinks = gs + n_grad;
    const float beta = g->accumulate ? 1.0f : 0.0f;

    /* The output projection. */
    mha_linear16_prepare_t(m->w_o, E, Dv, kernel, bf, wo, nt);
    mha_linear16(g->grad_out16, rows_q, E, E, bf, kernel, wo, Dv, NULL, dctx,
                 Dv, lin, nt);
    if (gp)
        mha_linear16_grad_params(g->grad_out16, rows_q, E, E, plan->ctx16, Dv,
                                 Dv, bf, kernel, beta,
                                 grad_at(m, gp, m->w_o),
                                 grad_at(m, gp, m->b_o), gs, nt);

    /* The attention, on what its plan kept of the forward (packed K/V and
     * row statistics, or the bf16 kernels' output and lse). */
    mha_attention_args at = mha_attention16_args(plan, a);
    at.q16 = plan->q16, at.k16 = plan->k16, at.v16 = plan->v16;
    at.out16 = plan->ctx16, at.lse = plan->lse16;
    float *ds = gp && m->sinks ? dsinks : NULL;
    const mha_attention_grads16 ag = {.grad_out = dctx, .grad_q = dq,
                                      .grad_k = dk, .grad_v = dv,
                                      .grad_sinks = ds};
    MHA_CHECK(mha_attention_plan_backward16(plan->att16, &at, &ag));
    if (ds) {   /* (float32, as the module's parameters) */
        float *dst = grad_at(m, gp, m->sinks);
        for (int64_t h = 0; h < s->H; h++)
            dst[h] = g->accumulate ? dst[h] + ds[h] : ds[h];
    }

    /* The input projections' parameters. */
    if (gp) {
        mha_linear16_grad_params(dq, rows_q, D, D, query, E, E, bf, kernel,
                                 beta, grad_at(m, gp, m->w_q),
                                 grad_at(m, gp, m->b_q), gs, nt);
        mha_linear16_grad_params(dk, rows_k, Dkv, Dkv, key, kd, kd, bf,
                                 kernel, beta, grad_at(m, gp, m->w_k),
                                 grad_at(m, gp, m->b_k), gs, nt);
        mha_linear16_grad_params(dv, rows_k, Dvkv, Dvkv, value, vd, vd, bf,
                                 kernel, beta, grad_at(m, gp, m->w_v),
                                 grad_at(m, gp, m->b_v), gs, nt);
    }

    /* The inputs: each target receives its parts' sum, q, k, v in order. */
    if (tq)
        mha_linear16_prepare_t(m->w_q, D, E, kernel, bf, wq, nt);
    if (tk)
        mha_linear16_prepare_t(m->w_k, Dkv, kd, kernel, bf, wk, nt);
    if (tv)
        mha_linear16_prepare_t(m->w_v, Dvkv, vd, kernel, bf, wv, nt);
    const mha_lin16_part part[3] = {{dq, D, D, wq}, {dk, Dkv, Dkv, wk},
                                    {dv, Dvkv, Dvkv, wv}};
    uint16_t *target[3] = {tq, tk, tv};
    const int64_t rows[3] = {rows_q, rows_k, rows_k}, width[3] = {E, kd, vd};
    for (int i = 0; i < 3; i++) {
        if (!target[i])
            continue;
        int first = 1;   /* the first part into this target */
        for (int j = 0; j < i; j++)
            first &= target[j] != target[i];
        if (!first)
            continue;
        mha_lin16_part mine[3];
        int n = 0;
        for (int j = i; j < 3; j++)
            if (target[j] == target[i])
                mine[n++] = part[j];
        mha_linear16_sum(mine, n, rows[i], bf, kernel, width[i], NULL,
                         target[i], width[i], lin, nt);
    }
    return MHA_OK;
}
