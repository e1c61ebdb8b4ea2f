/*
 * ref_forward.c -- the reference tier: one query row at a time, the whole
 * score row materialised, every sum in float64.  Slow, obviously right,
 * never deleted: the oracle the flash tiers are tested against, and the
 * tier MHA_ISA=ref forces.
 *
 * To learn the algorithm, read tests/support/ref_impl.h (the module from
 * its definition, nothing else) or docs/LEARN.md (NumPy, step by step)
 * first: mha_ref_row below serves every feature at once.  Its map, per
 * head h of row i of batch b:
 *
 *   g = mha_kv_head          GQA: the KV head query head h reads
 *   mha_mask_row -> bias     every mask, key length, causal alignment and
 *                            window as 0 or -inf per key (live: any key)
 *   mx = sink                a sink starts the max (and the sum) with a
 *                            logit of no value
 *   key_dot, mha_ref_modify  the score s_j = q . k_j * scale, softcapped,
 *                            minus ALiBi, plus the mask's bias; keys are
 *                            read in the cache's dtype (mha_key_elem)
 *   sum of exp(s - mx)       the softmax's denominator, sink included
 *   mha_dropout_keep, keep   dropout: a dropped key adds nothing, a kept
 *                            one is scaled by 1 / (1 - p)
 *   add_value, w             the context and the attention weights (per
 *                            head, or averaged over heads)
 *   st = (mx, 1 / sum)       the row statistics the backward reuses; a
 *                            row with no key gets (-inf, 0) and a zero
 *                            context, a NaN score a NaN row
 */
#include "engine.h"

#include <math.h>
#include <string.h>

/* Lt floats (the mask row), then Lt doubles (the scores) and dh doubles
 * (the context); the doubles start on an even float, so an 8-byte aligned
 * base keeps them aligned. */
int64_t mha_ref_scratch_floats(int64_t dh, int64_t Lt)
{
    return (Lt + 2) + 2 * (Lt + dh) + 2;
}

/* K and V are read where they are: the caller's rows, or a KV cache's
 * tiles in its dtype (mha_key_elem). */
static double key_dot(const mha_attn *a, int64_t b, int64_t g, int64_t j,
                      const float *q)
{
    double dot = 0.0;
    for (int64_t d = 0; d < a->dh; d++)
        dot += (double)q[d] * mha_key_elem(a, b, g, j, d);
    return dot;
}

static void add_value(const mha_attn *a, int64_t b, int64_t g, int64_t j,
                      double w, double *acc)
{
    for (int64_t d = 0; d < mha_dv(a); d++)
        acc[d] += w * mha_value_elem(a, b, g, j, d);
}

double mha_ref_modify(const mha_attn *a, int64_t b, int64_t h, int64_t i,
                      int64_t j, double s, double *dcap)
{
    if (a->softcap > 0.0f) {
        const double t = tanh(s / a->softcap);
        s = a->softcap * t;
        if (dcap)
            *dcap = 1.0 - t * t;
    } else if (dcap) {
        *dcap = 1.0;
    }
    if (a->alibi && j < a->Lk) {
        const mha_mask_plan *mk = a->mask;
        const int64_t kpos =
            mk->window ? mha_ring_position(mk->seq_lengths[b], mk->ring, j)
                       : j;
        const int64_t d = mha_mask_qpos(mk, b, i) - kpos;
        s -= (double)a->alibi[h] * (double)(d < 0 ? -d : d);
    }
    return s;
}

/* Scores, softmax, dropout, context, row stats and weights of row i of
 * every head of batch b.  A sink is one more term of the denominator. */
void mha_ref_row(const mha_attn *a, int64_t b, int64_t i, float *scratch)
{
    const int64_t dh = mha_dv(a), Lt = a->Lt;   /* (dh: the values' width) */
    float *bias = scratch;
    double *s = (double *)(void *)(scratch + ((Lt + 1) & ~(int64_t)1));
    double *acc = s + Lt;
    const double keep = mha_keep_scale(a);
    for (int64_t h = 0; h < a->H; h++) {
        const int64_t g = mha_kv_head(a, h);
        const float *q = mha_q_row(a, b, h, i);
        const int64_t live = mha_mask_row(a->mask, b, h, i, bias);
        const double sink = a->sinks ? a->sinks[h] : -INFINITY;
        double mx = sink;
        for (int64_t j = 0; j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            s[j] = mha_ref_modify(a, b, h, i, j,
                                  key_dot(a, b, g, j, q) * a->scale, NULL) +
                   bias[j];
            /* A NaN score makes the row's max NaN, as in the flash
             * tiers: its lse is then NaN, never -inf ("no key"). */
            if (s[j] > mx || isnan(s[j]))
                mx = isnan(mx) ? mx : s[j];
        }
        double sum = a->sinks ? exp(sink - mx) : 0.0;
        for (int64_t j = 0; j < Lt; j++)
            if (bias[j] != -INFINITY)
                sum += s[j] = exp(s[j] - mx);
        memset(acc, 0, (size_t)dh * sizeof *acc);
        float *dst = mha_ctx_row(a, b, h, i);
        float *w = a->weights == MHA_WEIGHTS_PER_HEAD
                       ? a->w + ((b * a->H + h) * a->Lq + i) * Lt
                       : a->w ? a->w + (b * a->Lq + i) * Lt : NULL;
        for (int64_t j = 0; live && j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            if (a->dropout &&
                !mha_dropout_keep(a->seed, a->p_drop, b, h,
                                  a->drop_row0 + i, j))
                continue;
            const double p = s[j] / sum * keep;
            add_value(a, b, g, j, p, acc);
            if (a->weights == MHA_WEIGHTS_PER_HEAD)
                w[j] = (float)p;
            else if (w)
                w[j] += (float)(p / (double)a->H);
        }
        /* A row whose softmax is NaN (a NaN score among its live keys)
         * is NaN throughout, even where dropout removed every key: the
         * flash tiers' o / l, and torch's dropout(softmax) @ v. */
        const int nan_row = live && isnan(sum);
        for (int64_t d = 0; d < dh; d++)
            dst[d] = nan_row ? NAN : (float)acc[d];
        float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i);
        const int any = live || a->sinks;
        st[0] = any ? (float)mx : -INFINITY;
        st[1] = any ? (float)(1.0 / sum) : 0.0f;
    }
}
