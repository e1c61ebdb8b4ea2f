/*
 * weights.c -- the attention weights, when asked for: a second pass over
 * the tiles that recomputes p = exp(s - m) / l from the row statistics the
 * output pass saved, so the output is bitwise the same whether weights are
 * asked for or not.  One work item is (b, query block), every head in
 * order, so the average over heads is summed in one fixed order.
 */
#include "engine.h"

#include <math.h>

static void weights_tile(const mha_attn *a, const mha_tile *t, void *ctx)
{
    flash_scratch *f = ctx;
    const mha_microkernels *uk = a->uk;
    const mha_tile_src src = mha_tile_source(a, t, f->kvt);
    const int64_t b = t->b, h = t->h, j0 = t->j0;
    const int nc = t->nc;
    mha_tile_qk(a, &src, t->mr, nc, f->qs, f->s, MHA_BC);
    mha_score_tile(a, t, f->s, NULL, 0);
    const float keep = (float)mha_keep_scale(a);
    const float inv_h = 1.0f / (float)a->H;
    for (int r = 0; r < t->mr; r++) {
        const int64_t i = t->i0 + r;
        const float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i);
        if (st[0] == -INFINITY)
            continue;
        float *sr = f->s + r * MHA_BC;
        if (isnan(st[0]) || isnan(st[1])) {
            /* A NaN score among the row's live keys: its live weights are
             * NaN, its masked ones still exactly 0 (exp(-inf - NaN) would
             * be NaN), as in the reference tier. */
            for (int c = 0; c < nc; c++)
                sr[c] = sr[c] == -INFINITY ? 0.0f : NAN;
        } else {
            (void)uk->probs(sr, nc, st[0], st[1] * keep, NULL);
        }
        float *w = a->weights == MHA_WEIGHTS_PER_HEAD
                       ? a->w + ((b * a->H + h) * a->Lq + i) * a->Lt + j0
                       : a->w + (b * a->Lq + i) * a->Lt + j0;
        for (int c = 0; c < nc; c++) {
            float pc = sr[c];
            if (a->dropout &&
                !mha_dropout_keep(a->seed, a->p_drop, b, h,
                                  a->drop_row0 + i, j0 + c))
                pc = 0.0f;
            if (a->weights == MHA_WEIGHTS_PER_HEAD)
                w[c] = pc;
            else
                w[c] += pc * inv_h;
        }
    }
}

void mha_weights_block(const mha_attn *a, int64_t b, int64_t i0, int mr,
                       flash_scratch *f)
{
    for (int64_t h = 0; h < a->H; h++) {
        mha_load_q(a, b, h, i0, mr, f->qs);
        mha_for_each_tile(a, b, h, i0, mr, 0, a->Lk, 1, f->bias,
                          weights_tile, f);
    }
}
