/*
 * forward.c -- projections -> attention -> output projection.
 *
 * Data flow for one call, with B = batch, Lq / Lk query / key lengths,
 * E = embed_dim, H heads of width d_h = E / H, Lt = Lk + extra keys:
 *
 *   query (B,Lq,E)    -- W_q -->  q (B*Lq rows, row stride ldq)
 *   key   (B,Lk,kdim) -- W_k -->  k (B*Lk rows, row stride ldk)
 *   value (B,Lk,vdim) -- W_v -->  v (B*Lk rows, row stride ldv)
 *       (self-attention with one packed in_proj_weight: one GEMM writes
 *        q | k | v side by side, ldq = ldk = ldv = 3E)
 *   for every (b, h, i):  ctx[b,i, h*d_h ..] = softmax(q k^T * scale + mask) v
 *   ctx (B*Lq, E)     -- W_o -->  out (B, Lq, E)
 *
 * Shapes, masks and sizes are all checked before any work starts.
 */
#include "internal.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Everything one forward call needs, derived once from the arguments. */
typedef struct fwd_plan {
    int64_t B, Lq, Lk, Lt, E, H, dh;
    const float *query, *key, *value;
    int fuse_qkv;            /* query == key == value, packed weights */
    int fuse_kv;             /* key == value, packed weights          */
    int dropout;             /* training with p > 0                   */
    int64_t n_q, n_kv, n_w;  /* element counts of q, k/v, weights     */
} fwd_plan;

static mha_status plan_forward(const mha_module *m, const mha_forward_args *a,
                               fwd_plan *p)
{
    const mha_config *c = &m->cfg;
    if (!a->query)
        return mha_set_error(MHA_ERR_NULL_POINTER, "query is NULL");
    if (!a->out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "out is NULL");
    if (a->batch < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "batch must be >= 1 (unbatched input is batch "
                             "1), got %lld", (long long)a->batch);
    if (a->q_len < 1)
        return mha_set_error(MHA_ERR_SHAPE, "q_len must be >= 1, got %lld",
                             (long long)a->q_len);
    if (a->kv_len < 0)
        return mha_set_error(MHA_ERR_SHAPE,
                             "kv_len must be >= 1 (0 = q_len), got %lld",
                             (long long)a->kv_len);
    p->B = a->batch;
    p->Lq = a->q_len;
    p->Lk = a->kv_len ? a->kv_len : a->q_len;
    p->Lt = mha_total_keys(m, p->Lk);
    p->E = c->embed_dim;
    p->H = c->num_heads;
    p->dh = m->head_dim;

    p->query = a->query;
    p->key = a->key ? a->key : a->query;
    p->value = a->value ? a->value : p->key;
    if (!a->key && c->kdim != c->embed_dim)
        return mha_set_error(MHA_ERR_SHAPE,
                             "key is NULL, so the query (width E=%lld) is the "
                             "key, but kdim is %lld", (long long)c->embed_dim,
                             (long long)c->kdim);
    if (!a->key && p->Lk != p->Lq)
        return mha_set_error(MHA_ERR_SHAPE,
                             "key is NULL (self-attention), but kv_len %lld "
                             "differs from q_len %lld", (long long)p->Lk,
                             (long long)p->Lq);
    if (!a->value && c->vdim != c->kdim)
        return mha_set_error(MHA_ERR_SHAPE,
                             "value is NULL, so the key (width kdim=%lld) is "
                             "the value, but vdim is %lld",
                             (long long)c->kdim, (long long)c->vdim);

    if (a->need_weights != MHA_WEIGHTS_NONE &&
        a->need_weights != MHA_WEIGHTS_AVERAGE &&
        a->need_weights != MHA_WEIGHTS_PER_HEAD)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "need_weights must be NONE, AVERAGE or PER_HEAD, "
                             "got %d", (int)a->need_weights);
    if (a->need_weights != MHA_WEIGHTS_NONE && !a->attn_weights)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "need_weights is set but attn_weights is NULL");

    /* Every size product that indexes memory, checked once here. */
    int64_t rows_q, rows_k, t, lql;
    if (!mha_mul_ok(p->B, p->Lq, &rows_q) || !mha_mul_ok(p->B, p->Lk, &rows_k) ||
        !mha_mul_ok(rows_q, 3 * p->E, &t) || !mha_mul_ok(rows_k, 3 * p->E, &t) ||
        !mha_mul_ok(rows_k, c->kdim > c->vdim ? c->kdim : c->vdim, &t) ||
        !mha_mul_ok(p->Lq, p->Lt, &lql) || !mha_mul_ok(lql, p->B, &t) ||
        !mha_mul_ok(t, p->H, &t))
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "sizes B=%lld Lq=%lld Lk=%lld overflow 64 bits",
                             (long long)p->B, (long long)p->Lq,
                             (long long)p->Lk);
    /* Keep every count below 2^60 so that the workspace sums below cannot
     * overflow either. */
    const int64_t limit = INT64_MAX / 8;
    if (rows_q * 3 * p->E > limit || rows_k * 3 * p->E > limit || t > limit)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "sizes B=%lld Lq=%lld Lk=%lld are too large",
                             (long long)p->B, (long long)p->Lq,
                             (long long)p->Lk);
    p->n_q = rows_q * p->E;
    p->n_kv = rows_k * p->E;
    p->n_w = a->need_weights == MHA_WEIGHTS_PER_HEAD ? t : lql * p->B;

    /* One GEMM over the query rows serves as keys only when they are the
     * same rows: same pointer and same length. */
    p->fuse_qkv = m->packed && p->key == p->query && p->value == p->query &&
                  p->Lk == p->Lq;
    p->fuse_kv = m->packed && !p->fuse_qkv && p->key == p->value;
    p->dropout = a->training && c->dropout > 0.0f;
    return MHA_OK;
}

/* Per-row scratch: the mask row and the probabilities, Lt floats each. */
typedef struct row_scratch {
    float *bias;
    float *prob;
} row_scratch;

/*
 * One query row of one head: ctx (d_h) = sum_j p_j v_j over the keys that
 * are not excluded, with p = softmax(q . k_j * scale + bias_j).  Writes the
 * probabilities actually applied (after dropout) into prob[0 .. Lt).
 * Keys 0 .. Lk-1 come from k/v; then bias_k/bias_v; then the zero key.
 */
static void attend_row(const mha_module *m, const fwd_plan *p,
                       const mha_forward_args *a, int64_t b, int64_t h,
                       int64_t i, const float *q, const float *k, int64_t ldk,
                       const float *v, int64_t ldv, row_scratch *s,
                       float *ctx)
{
    const int64_t dh = p->dh, Lk = p->Lk, Lt = p->Lt;
    const float scale = m->cfg.scale;
    const float *bias_k = m->bias_k ? m->bias_k + h * dh : NULL;
    const float *bias_v = m->bias_v ? m->bias_v + h * dh : NULL;
    float *bias = s->bias, *prob = s->prob;

    memset(ctx, 0, (size_t)dh * sizeof(float));

    /* Scores of the live keys; the max for a stable softmax.  NaN scores
     * (NaN in a live input) never win the comparison but still reach the
     * sum below, so they propagate as IEEE arithmetic says they should. */
    float mx = -INFINITY;
    int64_t live = 0;
    for (int64_t j = 0; j < Lt; j++) {
        prob[j] = 0.0f;
        if (bias[j] == -INFINITY)
            continue;
        const float *kj = j < Lk ? k + j * ldk : j == Lk && bias_k ? bias_k
                                                                   : NULL;
        float dot = 0.0f;
        if (kj)
            for (int64_t d = 0; d < dh; d++)
                dot += q[d] * kj[d];
        /* A finite score plus a finite mask value saturates instead of
         * overflowing: only -inf excludes a key, and only non-finite data
         * makes a non-finite score. */
        float sc = dot * scale;
        if (isfinite(sc)) {
            sc += bias[j];
            sc = sc < -FLT_MAX ? -FLT_MAX : sc > FLT_MAX ? FLT_MAX : sc;
        }
        prob[j] = sc;
        if (sc > mx)
            mx = sc;
        live++;
    }
    if (live == 0)
        return;   /* no key to attend to: zero context, zero weights */

    float sum = 0.0f;
    for (int64_t j = 0; j < Lt; j++) {
        if (bias[j] == -INFINITY)
            continue;
        prob[j] = expf(prob[j] - mx);
        sum += prob[j];
    }
    float inv = 1.0f / sum;
    if (p->dropout) {
        const float pd = m->cfg.dropout;
        inv = pd < 1.0f ? inv / (1.0f - pd) : 0.0f;
    }
    for (int64_t j = 0; j < Lt; j++) {
        if (bias[j] == -INFINITY)
            continue;
        if (p->dropout && !mha_dropout_keep(a->dropout_seed, m->cfg.dropout,
                                            b, h, i, j)) {
            prob[j] = 0.0f;
            continue;
        }
        const float pj = prob[j] * inv;
        prob[j] = pj;
        const float *vj = j < Lk ? v + j * ldv : j == Lk && bias_v ? bias_v
                                                                   : NULL;
        if (vj)
            for (int64_t d = 0; d < dh; d++)
                ctx[d] += pj * vj[d];
    }
}

mha_status mha_forward(const mha_module *m, const mha_forward_args *a)
{
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "forward args are NULL");
    fwd_plan p = {0};
    MHA_CHECK(plan_forward(m, a, &p));
    mha_mask_plan mask;
    MHA_CHECK(mha_mask_plan_init(&mask, m, a));

    const int64_t E = p.E, dh = p.dh;
    const mha_config *c = &m->cfg;

    /* Workspace: projected q, k, v, the context, and two mask/prob rows. */
    const int64_t n_proj = p.fuse_qkv ? 3 * p.n_q : p.n_q + 2 * p.n_kv;
    const int64_t n_ws = n_proj + p.n_q + 2 * p.Lt;
    float *ws = mha_alloc_floats(n_ws, "forward workspace");
    if (!ws)
        return MHA_ERR_OUT_OF_MEMORY;
    float *qp, *kp, *vp;
    int64_t ldq, ldk, ldv;
    const int64_t rows_q = p.B * p.Lq, rows_k = p.B * p.Lk;
    if (p.fuse_qkv) {
        /* One GEMM: rows of in_proj_weight are [W_q; W_k; W_v]. */
        mha_linear(p.query, rows_q, E, E, m->w_q, 3 * E, m->b_q, ws, 3 * E);
        qp = ws; kp = ws + E; vp = ws + 2 * E;
        ldq = ldk = ldv = 3 * E;
    } else {
        qp = ws; ldq = E;
        mha_linear(p.query, rows_q, E, E, m->w_q, E, m->b_q, qp, E);
        if (p.fuse_kv) {
            kp = ws + p.n_q; vp = kp + E; ldk = ldv = 2 * E;
            mha_linear(p.key, rows_k, E, E, m->w_k, 2 * E, m->b_k, kp, 2 * E);
        } else {
            kp = ws + p.n_q; vp = kp + p.n_kv; ldk = ldv = E;
            mha_linear(p.key, rows_k, c->kdim, c->kdim, m->w_k, E, m->b_k, kp,
                       E);
            mha_linear(p.value, rows_k, c->vdim, c->vdim, m->w_v, E, m->b_v,
                       vp, E);
        }
    }
    float *ctx = ws + n_proj;
    row_scratch s = {ctx + p.n_q, ctx + p.n_q + p.Lt};

    if (a->need_weights != MHA_WEIGHTS_NONE)
        memset(a->attn_weights, 0, (size_t)p.n_w * sizeof(float));
    const float inv_heads = 1.0f / (float)p.H;

    for (int64_t b = 0; b < p.B; b++) {
        for (int64_t h = 0; h < p.H; h++) {
            const float *kb = kp + b * p.Lk * ldk + h * dh;
            const float *vb = vp + b * p.Lk * ldv + h * dh;
            for (int64_t i = 0; i < p.Lq; i++) {
                mha_mask_row(&mask, b, h, i, s.bias);
                attend_row(m, &p, a, b, h, i,
                           qp + (b * p.Lq + i) * ldq + h * dh, kb, ldk, vb,
                           ldv, &s, ctx + (b * p.Lq + i) * E + h * dh);
                if (a->need_weights == MHA_WEIGHTS_PER_HEAD) {
                    memcpy(a->attn_weights + ((b * p.H + h) * p.Lq + i) * p.Lt,
                           s.prob, (size_t)p.Lt * sizeof(float));
                } else if (a->need_weights == MHA_WEIGHTS_AVERAGE) {
                    float *w = a->attn_weights + (b * p.Lq + i) * p.Lt;
                    for (int64_t j = 0; j < p.Lt; j++)
                        w[j] += s.prob[j] * inv_heads;
                }
            }
        }
    }

    mha_linear(ctx, rows_q, E, E, m->w_o, E, m->b_o, a->out, E);
    free(ws);
    return MHA_OK;
}
