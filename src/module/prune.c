/*
 * prune.c -- head pruning: a smaller module that keeps some heads' rows of
 * the input projections and columns of the output projection.
 */
#include "module.h"

#include <stdlib.h>
#include <string.h>

/* Copies head keep[i]'s block of dh rows (each `width` floats) of the
 * H dh-row matrix src into block i of dst, for i < n_keep. */
static void copy_head_rows(float *dst, const float *src, const int64_t *keep,
                           int64_t n_keep, int64_t dh, int64_t width)
{
    for (int64_t i = 0; i < n_keep; i++)
        memcpy(dst + i * dh * width, src + keep[i] * dh * width,
               (size_t)(dh * width) * sizeof(float));
}

/* The writable address of one of p's parameter views. */
static float *own(mha_module *p, const float *view)
{
    return p->params + (view - p->params);
}

mha_status mha_prune_heads(const mha_module *m, const int64_t *keep,
                           int64_t n_keep, mha_module **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output handle is NULL");
    *out = NULL;
    if (!m || !keep)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             m ? "keep" : "module");
    const int64_t H = m->cfg.num_heads, dh = m->head_dim;
    const int64_t dv = m->v_head_dim;
    const int64_t E = m->cfg.embed_dim, Dv = m->v_inner_dim;
    if (m->cfg.num_kv_heads != H)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "pruning a grouped-query module (%lld query "
                             "heads sharing %lld K/V heads) is not "
                             "supported: its heads do not own their K/V "
                             "rows", (long long)H,
                             (long long)m->cfg.num_kv_heads);
    if (n_keep < 1 || n_keep > H)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "n_keep must be in [1, num_heads=%lld], got %lld "
                             "(with no head left the output would be "
                             "out_proj.bias alone)", (long long)H,
                             (long long)n_keep);
    unsigned char *seen = calloc((size_t)H, 1);
    if (!seen)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate %lld "
                             "bytes", (long long)H);
    mha_status st = MHA_OK;
    for (int64_t i = 0; i < n_keep && st == MHA_OK; i++) {
        if (keep[i] < 0 || keep[i] >= H)
            st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                               "keep[%lld] = %lld is not a head of this "
                               "module (0 .. %lld)", (long long)i,
                               (long long)keep[i], (long long)(H - 1));
        else if (seen[keep[i]]++)
            st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                               "keep names head %lld twice", (long long)keep[i]);
    }
    free(seen);
    MHA_CHECK(st);

    mha_config c = m->cfg;
    c.num_heads = n_keep;
    c.num_kv_heads = n_keep;
    c.head_dim = dh;
    c.v_head_dim = dv;
    if (!m->scale_given)
        c.scale = 0.0f;   /* the default, 1/sqrt(d_h), is unchanged */
    /* ALiBi: the kept heads keep their slopes (the defaults of n_keep
     * heads would differ); the sinks are copied below. */
    float *slopes = NULL;
    if (m->cfg.mods.alibi) {
        slopes = mha_alloc_floats(n_keep, "ALiBi slopes");
        if (!slopes)
            return MHA_ERR_OUT_OF_MEMORY;
        for (int64_t i = 0; i < n_keep; i++)
            slopes[i] = m->slopes[keep[i]];
        c.mods.alibi_slopes = slopes;
    }
    mha_module *p;
    st = mha_create(&c, &p);
    free(slopes);
    MHA_CHECK(st);
    const int64_t Dvp = p->v_inner_dim;
    /* W_q, W_k, W_v and their biases: the kept heads' rows, part by part
     * (packed: the three parts of in_proj_weight one after the other);
     * a value head's block is d_v rows. */
    const int64_t widths[3] = {E, m->cfg.kdim, m->cfg.vdim};
    const int64_t rows[3] = {dh, dh, dv};
    const float *src_w[3] = {m->w_q, m->w_k, m->w_v};
    const float *dst_w[3] = {p->w_q, p->w_k, p->w_v};
    for (int r = 0; r < 3; r++)
        copy_head_rows(own(p, dst_w[r]), src_w[r], keep, n_keep, rows[r],
                       widths[r]);
    if (m->b_q) {
        copy_head_rows(own(p, p->b_q), m->b_q, keep, n_keep, dh, 1);
        copy_head_rows(own(p, p->b_k), m->b_k, keep, n_keep, dh, 1);
        copy_head_rows(own(p, p->b_v), m->b_v, keep, n_keep, dv, 1);
        memcpy(own(p, p->b_o), m->b_o, (size_t)E * sizeof(float));
    }
    if (m->bias_k) {
        copy_head_rows(own(p, p->bias_k), m->bias_k, keep, n_keep, dh, 1);
        copy_head_rows(own(p, p->bias_v), m->bias_v, keep, n_keep, dv, 1);
    }
    if (m->sinks)
        copy_head_rows(own(p, p->sinks), m->sinks, keep, n_keep, 1, 1);
    /* out_proj.weight [E, Dv]: the kept heads' columns of every row. */
    for (int64_t e = 0; e < E; e++)
        copy_head_rows(own(p, p->w_o) + e * Dvp, m->w_o + e * Dv, keep,
                       n_keep, dv, 1);
    *out = p;
    return MHA_OK;
}
