/*
 * ref_backward.c -- the reference backward of one (batch, K/V head), in
 * float64 row by row: P recomputed from the scores (not from the saved
 * stats), dk and dv summed over rows in float64 and rounded once.  The
 * formulas are those of flash_backward.c.
 */
#include "engine.h"

#include <math.h>
#include <string.h>

/* The mask row (Lt floats, padded to even), then doubles: s, P, the
 * softcap's derivative and dq (3 Lt + dh), dk and dv (2 Lt dh). */
int64_t mha_ref_bwd_scratch_floats(int64_t dh, int64_t Lt)
{
    return (Lt + 2) + 2 * (3 * Lt + dh + 2 * Lt * dh) + 2;
}

void mha_ref_bwd_item(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                      int64_t kvh, float *scratch)
{
    const int64_t dh = a->dh, dvw = mha_dv(a), Lk = a->Lk, Lt = a->Lt;
    const int64_t group = a->H / a->Hkv;
    float *bias = scratch;
    double *s = (double *)(void *)(scratch + ((Lt + 1) & ~(int64_t)1));
    double *ds = s + Lt, *dcap = ds + Lt, *dq = dcap + Lt, *dk = dq + dh;
    double *dv = dk + Lt * dh;   /* (the layout's dh is the wider one) */
    memset(dk, 0, (size_t)(Lt * (dh + dvw)) * sizeof *dk);
    const double keep = mha_keep_scale(a);
    double dsink = 0.0;
    /* Every query head of K/V head kvh's group, in order, adds into the
     * same float64 dk and dv. */
    for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
    for (int64_t i = 0; i < a->Lq; i++) {
        const float *q = mha_q_row(a, b, h, i);
        const float *dO = g->dctx + mha_row_at(mha_dv(a), a->Lq, g->lddc, g->hsdc,
                                               g->bsdc, b, h, i);
        float *dqd = g->dq + mha_row_at(dh, a->Lq, g->lddq, g->hsdq, g->bsdq,
                                        b, h, i);
        int64_t live = mha_mask_row(a->mask, b, h, i, bias);
        memset(dq, 0, (size_t)dh * sizeof *dq);
        const double sink = a->sinks ? a->sinks[h] : -INFINITY;
        double mx = sink, delta = 0.0;
        for (int64_t j = 0; live && j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            const float *kj = mha_key_row(a, b, kvh, j);
            double dot = 0.0;
            for (int64_t d = 0; kj && d < dh; d++)
                dot += (double)q[d] * kj[d];
            s[j] = mha_ref_modify(a, b, h, i, j, dot * a->scale, &dcap[j]) +
                   bias[j];
            if (s[j] > mx)
                mx = s[j];
        }
        double sum = a->sinks ? exp(sink - mx) : 0.0;
        /* A part of a split-key problem: P = exp(s - lse) with the whole
         * row's lse (no key anywhere: P = 0). */
        const float row_lse =
            g->row_lse ? g->row_lse[(b * a->H + h) * a->Lq + i] : 0.0f;
        if (g->row_lse && row_lse == -INFINITY)
            live = 0;
        if (g->row_lse)
            mx = row_lse;
        for (int64_t j = 0; live && j < Lt; j++)
            if (bias[j] != -INFINITY)
                sum += s[j] = exp(s[j] - mx);
        if (g->row_lse)
            sum = 1.0;
        /* ds[j] = dP~_j * keep * scale_keep; delta = sum_j P~_j dP~_j */
        for (int64_t j = 0; live && j < Lt; j++) {
            ds[j] = 0.0;
            if (bias[j] == -INFINITY)
                continue;
            s[j] /= sum;
            if (a->dropout &&
                !mha_dropout_keep(a->seed, a->p_drop, b, h,
                                  a->drop_row0 + i, j))
                continue;
            const float *vj = mha_value_row(a, b, kvh, j);
            double dp = 0.0;
            for (int64_t d = 0; vj && d < dvw; d++)
                dp += (double)dO[d] * vj[d];
            ds[j] = dp * keep;
            delta += s[j] * ds[j];
            for (int64_t d = 0; d < dvw; d++)
                dv[j * dvw + d] += s[j] * keep * dO[d];
        }
        /* The sink's logit: dL/d sink = -P_sink delta (its value is 0),
         * summed over the head's rows in float64. */
        if (g->row_delta)
            delta = g->row_delta[(b * a->H + h) * a->Lq + i];
        if (i == 0)
            dsink = 0.0;
        if (live && a->sinks)
            dsink -= exp(sink - mx) / sum * delta;
        if (i == a->Lq - 1 && a->sinks && g->dsinks)
            g->dsinks[b * a->H + h] = (float)dsink;
        for (int64_t j = 0; live && j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            const double dsj = s[j] * (ds[j] - delta) * dcap[j] * a->scale;
            const float *kj = mha_key_row(a, b, kvh, j);
            for (int64_t d = 0; d < dh; d++) {
                if (kj)
                    dq[d] += dsj * kj[d];
                dk[j * dh + d] += dsj * q[d];
            }
        }
        for (int64_t d = 0; d < dh; d++)
            dqd[d] = (float)dq[d];
    }
    for (int64_t j = 0; j < Lk; j++) {
        for (int64_t d = 0; d < dh; d++)
            g->dk[mha_row_at(dh, Lk, g->lddk, g->hsdk, g->bsdk, b, kvh, j) +
                  d] = (float)dk[j * dh + d];
        for (int64_t d = 0; d < dvw; d++)
            g->dv[mha_row_at(dvw, Lk, g->lddv, g->hsdv, g->bsdv, b, kvh, j) +
                  d] = (float)dv[j * dvw + d];
    }
    if (a->bias_k && g->dbias_k) {
        for (int64_t d = 0; d < dh; d++)
            g->dbias_k[(b * a->Hkv + kvh) * dh + d] = (float)dk[Lk * dh + d];
        for (int64_t d = 0; d < dvw; d++)
            g->dbias_v[(b * a->Hkv + kvh) * dvw + d] = (float)dv[Lk * dvw + d];
    }
}
