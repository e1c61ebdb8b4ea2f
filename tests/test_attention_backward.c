/*
 * test_attention_backward.c -- the planned mha_attention and its backward
 * (mha_attention_plan_*, mha_attention_backward):
 *
 *   - gradients against central differences of a float64 attention
 *     written here from the definition (scores, masks, softmax, dropout
 *     drawn by the tests' own generator, ref_dropout_keep),
 *     with every mask kind, causal, key lengths, an explicit scale of 0,
 *     dropout and a row with no key;
 *   - the plan's run equals mha_attention bitwise; results bitwise equal
 *     on 1, 2 and 4 threads, on shapes where threads really run (the ref
 *     tier with an odd key count included: its per-thread float64 scratch
 *     was misaligned on odd threads);
 *   - misuse refused: no run, other arguments, other contents (the
 *     fingerprint), overlapping outputs, NULL gradients; the same for the
 *     module's plan_backward.
 *
 * Every tier runs it (CTest, MHA_ISA).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assert_error.h"
#include "ref.h"
#include "testutil.h"

/* ---- a float64 attention, from the definition ---------------------------- */

typedef struct problem {
    int64_t B, H, Hkv, dh, Lq, Lk;  /* query head h reads K/V head
                                       h / (H / Hkv)                  */
    mha_causal causal;
    const int64_t *lengths;      /* (B) or NULL                      */
    const float *additive;       /* (Lq, Lk) or NULL                 */
    const uint8_t *allow;        /* (B, H, Lq, Lk) bool or NULL      */
    double scale;
    float p;                     /* dropout (training)               */
    uint64_t seed;
} problem;

/* Whether key j is visible from row i of (b, h), and its additive bias. */
static int visible(const problem *P, int64_t b, int64_t h, int64_t i,
                   int64_t j, double *bias)
{
    *bias = 0.0;
    if (P->lengths && j >= P->lengths[b])
        return 0;
    if (P->causal == MHA_CAUSAL_TOP_LEFT && j > i)
        return 0;
    if (P->causal == MHA_CAUSAL_BOTTOM_RIGHT && j > i + P->Lk - P->Lq)
        return 0;
    if (P->allow && !P->allow[((b * P->H + h) * P->Lq + i) * P->Lk + j])
        return 0;
    if (P->additive) {
        *bias = P->additive[i * P->Lk + j];
        if (*bias == -INFINITY)
            return 0;
    }
    return 1;
}

/* Row i of (b, h): s[j] = scale q_i . k_j + bias, -inf where j is not
 * visible; *mx their max and *sum = sum_j exp(s[j] - mx) (0 and -inf
 * for a row with no key). */
static void scores64(const problem *P, const double *q, const double *k,
                     int64_t b, int64_t h, int64_t i, double *s, double *mx,
                     double *sum)
{
    const int64_t E = P->H * P->dh, Ekv = P->Hkv * P->dh;
    const int64_t kvh = h / (P->H / P->Hkv);
    const double *qi = q + (b * P->Lq + i) * E + h * P->dh;
    double bias;
    *mx = -INFINITY;
    *sum = 0.0;
    for (int64_t j = 0; j < P->Lk; j++) {
        s[j] = -INFINITY;
        if (!visible(P, b, h, i, j, &bias))
            continue;
        const double *kj = k + (b * P->Lk + j) * Ekv + kvh * P->dh;
        double dot = 0.0;
        for (int64_t d = 0; d < P->dh; d++)
            dot += qi[d] * kj[d];
        s[j] = dot * P->scale + bias;
        *mx = s[j] > *mx ? s[j] : *mx;
    }
    for (int64_t j = 0; *mx != -INFINITY && j < P->Lk; j++)
        *sum += s[j] == -INFINITY ? 0.0 : exp(s[j] - *mx);
}

/* out = attention(q, k, v) in float64 (q, k, v as doubles), (B, Lq, E). */
static void attend64(const problem *P, const double *q, const double *k,
                     const double *v, double *out)
{
    const int64_t E = P->H * P->dh, Ekv = P->Hkv * P->dh;
    double *s = malloc((size_t)P->Lk * sizeof *s);
    memset(out, 0, (size_t)(P->B * P->Lq * E) * sizeof *out);
    for (int64_t b = 0; b < P->B; b++)
        for (int64_t h = 0; h < P->H; h++)
            for (int64_t i = 0; i < P->Lq; i++) {
                const int64_t kvh = h / (P->H / P->Hkv);
                double mx, sum;
                scores64(P, q, k, b, h, i, s, &mx, &sum);
                if (mx == -INFINITY)
                    continue;   /* no key: zero output */
                double *oi = out + (b * P->Lq + i) * E + h * P->dh;
                for (int64_t j = 0; j < P->Lk; j++) {
                    if (s[j] == -INFINITY)
                        continue;
                    double pj = exp(s[j] - mx) / sum;
                    if (P->p > 0.0f)
                        pj = ref_dropout_keep(P->seed, P->p, b, h, i, j)
                                 ? pj / (1.0 - P->p) : 0.0;
                    const double *vj = v + (b * P->Lk + j) * Ekv + kvh * P->dh;
                    for (int64_t d = 0; d < P->dh; d++)
                        oi[d] += pj * vj[d];
                }
            }
    free(s);
}

/* L = sum(g * attention(q, k, v)). */
static double loss64(const problem *P, const double *q, const double *k,
                     const double *v, const float *g)
{
    const int64_t n = P->B * P->Lq * P->H * P->dh;
    double *out = malloc((size_t)n * sizeof *out);
    attend64(P, q, k, v, out);
    double L = 0.0;
    for (int64_t e = 0; e < n; e++)
        L += out[e] * g[e];
    free(out);
    return L;
}

/* dL/dx of every element of x (n doubles) by central differences. */
static void central(const problem *P, double *q, double *k, double *v,
                    const float *g, double *x, int64_t n, double *grad)
{
    const double step = 1e-4;
    for (int64_t e = 0; e < n; e++) {
        const double x0 = x[e];
        x[e] = x0 + step;
        const double up = loss64(P, q, k, v, g);
        x[e] = x0 - step;
        const double down = loss64(P, q, k, v, g);
        x[e] = x0;
        grad[e] = (up - down) / (2 * step);
    }
}

/* dL/dq, dL/dk, dL/dv of L = sum(g * attention) analytically, in float64:
 * with P the softmax, D/(1-p) the dropout's scaling (P~ = P D/(1-p)),
 * dv += P~^T g, dP = (g v^T) D/(1-p), dS = P (dP - delta) with delta_i =
 * sum_j P_ij dP_ij, dq = scale dS k, dk = scale dS^T q.  For the shapes
 * where central differences cost too much; checked against them on the
 * small ones. */
static void grads64(const problem *P, const double *q, const double *k,
                    const double *v, const float *g, double *dq, double *dk,
                    double *dv)
{
    const int64_t E = P->H * P->dh, Ekv = P->Hkv * P->dh;
    double *s = malloc((size_t)P->Lk * sizeof *s);
    double *dp = malloc((size_t)P->Lk * sizeof *dp);
    memset(dq, 0, (size_t)(P->B * P->Lq * E) * sizeof *dq);
    memset(dk, 0, (size_t)(P->B * P->Lk * Ekv) * sizeof *dk);
    memset(dv, 0, (size_t)(P->B * P->Lk * Ekv) * sizeof *dv);
    for (int64_t b = 0; b < P->B; b++)
        for (int64_t h = 0; h < P->H; h++)
            for (int64_t i = 0; i < P->Lq; i++) {
                const int64_t kvh = h / (P->H / P->Hkv);
                const double *qi = q + (b * P->Lq + i) * E + h * P->dh;
                const float *gi = g + (b * P->Lq + i) * E + h * P->dh;
                double mx, sum, delta = 0.0;
                scores64(P, q, k, b, h, i, s, &mx, &sum);
                if (mx == -INFINITY)
                    continue;   /* no key: zero gradients */
                for (int64_t j = 0; j < P->Lk; j++) {
                    /* s[j] becomes P_ij, dp[j] dP_ij */
                    s[j] = s[j] == -INFINITY ? 0.0 : exp(s[j] - mx) / sum;
                    const double keep =
                        P->p > 0.0f
                            ? (ref_dropout_keep(P->seed, P->p, b, h, i, j)
                                   ? 1.0 / (1.0 - P->p) : 0.0)
                            : 1.0;
                    const double *vj = v + (b * P->Lk + j) * Ekv + kvh * P->dh;
                    double *dvj = dv + (b * P->Lk + j) * Ekv + kvh * P->dh;
                    double dot = 0.0;
                    for (int64_t d = 0; d < P->dh; d++) {
                        dot += gi[d] * vj[d];
                        dvj[d] += s[j] * keep * gi[d];
                    }
                    dp[j] = dot * keep;
                    delta += s[j] * dp[j];
                }
                double *dqi = dq + (b * P->Lq + i) * E + h * P->dh;
                for (int64_t j = 0; j < P->Lk; j++) {
                    const double ds = s[j] * (dp[j] - delta) * P->scale;
                    if (ds == 0.0)
                        continue;
                    const double *kj = k + (b * P->Lk + j) * Ekv + kvh * P->dh;
                    double *dkj = dk + (b * P->Lk + j) * Ekv + kvh * P->dh;
                    for (int64_t d = 0; d < P->dh; d++) {
                        dqi[d] += ds * kj[d];
                        dkj[d] += ds * qi[d];
                    }
                }
            }
    free(s);
    free(dp);
}

static double *widen(const float *x, int64_t n)
{
    double *y = malloc((size_t)n * sizeof *y);
    for (int64_t e = 0; e < n; e++)
        y[e] = x[e];
    return y;
}

/* |got - want| <= 1e-4 * (1 + max |want|) everywhere: float32 against
 * the exact gradient (central differences of a float64 function with a
 * step of 1e-4 are exact to ~1e-8). */
static void expect_close(const char *name, const char *what, const float *got,
                         const double *want, int64_t n)
{
    double mx = 0.0, err = 0.0;
    for (int64_t e = 0; e < n; e++)
        mx = fabs(want[e]) > mx ? fabs(want[e]) : mx;
    for (int64_t e = 0; e < n; e++) {
        const double d = fabs((double)got[e] - want[e]);
        err = d > err || d != d ? d : err;
    }
    if (!(err <= 1e-4 * (1.0 + mx)))
        fail_msg("%s: %s max error %.3g (max |grad| %.3g)", name, what, err,
                 mx);
}

/* Two float64 gradients agree to 1e-7 * (1 + max |want|): grads64
 * against central differences (exact to ~1e-8 here). */
static void expect_near64(const char *name, const char *what,
                          const double *got, const double *want, int64_t n)
{
    double mx = 0.0, err = 0.0;
    for (int64_t e = 0; e < n; e++) {
        mx = fabs(want[e]) > mx ? fabs(want[e]) : mx;
        const double d = fabs(got[e] - want[e]);
        err = d > err || d != d ? d : err;
    }
    if (!(err <= 1e-7 * (1.0 + mx)))
        fail_msg("%s: %s max error %.3g (max |grad| %.3g)", name, what, err,
                 mx);
}

typedef struct gcase {
    const char *name;
    int64_t B, H, Hkv, dh, Lq, Lk;
    mha_causal causal;
    int lengths, additive, allow;
    float scale;          /* 0 with given: an explicit scale of 0 */
    int given;
    float p;
} gcase;

static const gcase GCASES[] = {
    {"plain", 2, 2, 2, 8, 9, 11, 0, 0, 0, 0, 0.0f, 0, 0.0f},
    {"causal bottom-right", 1, 3, 3, 4, 7, 12, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0.0f, 0, 0.0f},
    {"causal top-left, lengths (a row with no key)", 2, 2, 2, 5, 8, 8, MHA_CAUSAL_TOP_LEFT, 1, 0, 0, 0.0f, 0, 0.0f},
    {"additive mask, custom scale", 2, 1, 1, 6, 5, 70, 0, 0, 1, 0, 0.31f, 0, 0.0f},
    {"allow mask (B, H, Lq, Lk)", 2, 2, 2, 3, 6, 9, 0, 0, 0, 1, 0.0f, 0, 0.0f},
    {"explicit scale 0", 1, 2, 2, 4, 5, 6, 0, 0, 0, 0, 0.0f, 1, 0.0f},
    {"dropout", 2, 2, 2, 4, 6, 10, 0, 1, 0, 0, 0.0f, 0, 0.3f},
    {"one query row", 1, 2, 2, 16, 1, 67, 0, 0, 0, 0, 0.0f, 0, 0.0f},
    {"GQA 4/2, causal, lengths", 2, 4, 2, 4, 6, 9, MHA_CAUSAL_BOTTOM_RIGHT, 1, 0, 0, 0.0f, 0, 0.0f},
    {"MQA 3/1, allow mask, dropout", 2, 3, 1, 4, 5, 70, 0, 0, 0, 1, 0.0f, 0, 0.2f},
    {"GQA 6/3, two query rows", 1, 6, 3, 8, 2, 33, 0, 0, 1, 0, 0.0f, 0, 0.0f},
    /* From Lk = 4096 the flash backward takes 128-row blocks: against the
     * analytic float64 gradients (central differences would take
     * minutes), query blocks of 128 and a remainder, key tiles with a
     * partial last one. */
    {"tall blocks: GQA 2/1, causal bottom-right, lengths", 2, 2, 1, 4, 130, 4100, MHA_CAUSAL_BOTTOM_RIGHT, 1, 0, 0, 0.0f, 0, 0.0f},
    {"tall blocks: dropout, allow mask", 1, 2, 2, 4, 150, 4096, 0, 0, 0, 1, 0.0f, 0, 0.2f},
    {"tall blocks: additive mask, causal top-left, custom scale", 1, 1, 1, 8, 129, 4097, MHA_CAUSAL_TOP_LEFT, 0, 1, 0, 0.4f, 0, 0.0f},
};

/* Shapes whose exact gradients come from grads64 alone. */
enum { ANALYTIC_FROM_LK = 4096 };

static void test_gradients(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof GCASES / sizeof *GCASES; t++) {
        const gcase *c = &GCASES[t];
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh;
        const int64_t nq = c->B * c->Lq * E, nk = c->B * c->Lk * Ekv;
        float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
        float *v = malloc((size_t)nk * 4), *g = malloc((size_t)nq * 4);
        float *out = malloc((size_t)nq * 4), *dq = malloc((size_t)nq * 4);
        float *dk = malloc((size_t)nk * 4), *dv = malloc((size_t)nk * 4);
        float *add = malloc((size_t)(c->Lq * c->Lk) * 4);
        const int64_t nm = c->B * c->H * c->Lq * c->Lk;
        uint8_t *allow = malloc((size_t)nm);
        int64_t lens[2] = {c->Lk, 0};   /* batch 1 has no key at all */
        tu_fill(q, nq, 10 * t + 1, -1.5f, 1.5f);
        tu_fill(k, nk, 10 * t + 2, -1.5f, 1.5f);
        tu_fill(v, nk, 10 * t + 3, -1.5f, 1.5f);
        tu_fill(g, nq, 10 * t + 4, -1, 1);
        tu_fill(add, c->Lq * c->Lk, 10 * t + 5, -2, 2);
        for (int64_t j = 3; j < c->Lq * c->Lk; j += 5)
            add[j] = -INFINITY;
        for (int64_t x = 0; x < nm; x++)
            allow[x] = (x * 7 + 3) % 5 != 0;

        mha_attention_args a = {0};
        a.batch = c->B;
        a.num_heads = c->H;
        a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh;
        a.q_len = c->Lq;
        a.kv_len = c->Lk;
        a.q = q;
        a.k = k;
        a.v = v;
        a.scale = c->scale;
        a.given = c->given ? MHA_GIVEN_SCALE : 0;
        a.causal = c->causal;
        a.key_lengths = c->lengths ? lens : NULL;
        if (c->additive)
            a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 2,
                                     {c->Lq, c->Lk}};
        if (c->allow)
            a.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 4,
                                     {c->B, c->H, c->Lq, c->Lk}};
        a.dropout = c->p;
        a.training = c->p > 0.0f;
        a.dropout_seed = 77;
        a.out = out;
        const mha_attention_grads gr = {g, dq, dk, dv, NULL};
        if (mha_attention(&a) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        if (mha_attention_backward(&a, &gr) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());

        problem P = {c->B, c->H, c->Hkv, c->dh, c->Lq, c->Lk, c->causal,
                     a.key_lengths, c->additive ? add : NULL,
                     c->allow ? allow : NULL,
                     c->given || c->scale != 0.0f
                         ? (double)c->scale : 1.0 / sqrt((double)c->dh),
                     c->p, 77};
        double *q64 = widen(q, nq), *k64 = widen(k, nk), *v64 = widen(v, nk);
        double *want = malloc((size_t)(nq > nk ? nq : nk) * sizeof *want);
        /* The forward's output (the backward's own run) first. */
        attend64(&P, q64, k64, v64, want);
        expect_close(c->name, "out", out, want, nq);
        double *aq = malloc((size_t)nq * sizeof *aq);
        double *ak = malloc((size_t)nk * sizeof *ak);
        double *av = malloc((size_t)nk * sizeof *av);
        grads64(&P, q64, k64, v64, g, aq, ak, av);
        if (c->Lk >= ANALYTIC_FROM_LK) {
            expect_close(c->name, "dq", dq, aq, nq);
            expect_close(c->name, "dk", dk, ak, nk);
            expect_close(c->name, "dv", dv, av, nk);
        } else {
            /* Central differences, and grads64 checked against them. */
            central(&P, q64, k64, v64, g, q64, nq, want);
            expect_close(c->name, "dq", dq, want, nq);
            expect_near64(c->name, "grads64 dq", aq, want, nq);
            central(&P, q64, k64, v64, g, k64, nk, want);
            expect_close(c->name, "dk", dk, want, nk);
            expect_near64(c->name, "grads64 dk", ak, want, nk);
            central(&P, q64, k64, v64, g, v64, nk, want);
            expect_close(c->name, "dv", dv, want, nk);
            expect_near64(c->name, "grads64 dv", av, want, nk);
        }
        free(aq); free(ak); free(av);
        if (c->lengths)   /* the batch with no key: zero gradients */
            for (int64_t x = c->Lq * E; x < nq; x++)
                assert_true(dq[x] == 0.0f);
        free(q64); free(k64); free(v64); free(want);
        free(q); free(k); free(v); free(g); free(out); free(dq); free(dk);
        free(dv); free(add); free(allow);
    }
}

/* ---- plans and threads ---------------------------------------------------- */

typedef struct bufs {
    int64_t nq, nk;
    float *q, *k, *v, *g, *out, *dq, *dk, *dv;
} bufs;

static bufs bufs_make(const mha_attention_args *a)
{
    bufs x;
    const int64_t E = a->num_heads * a->head_dim;
    const int64_t Hkv = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    const int64_t Lk = a->kv_len ? a->kv_len : a->q_len;
    x.nq = a->batch * a->q_len * E;
    x.nk = a->batch * Lk * Hkv * a->head_dim;
    x.q = malloc((size_t)x.nq * 4);
    x.k = malloc((size_t)x.nk * 4);
    x.v = malloc((size_t)x.nk * 4);
    x.g = malloc((size_t)x.nq * 4);
    x.out = malloc((size_t)x.nq * 4);
    x.dq = malloc((size_t)x.nq * 4);
    x.dk = malloc((size_t)x.nk * 4);
    x.dv = malloc((size_t)x.nk * 4);
    tu_fill(x.q, x.nq, 1, -2, 2);
    tu_fill(x.k, x.nk, 2, -2, 2);
    tu_fill(x.v, x.nk, 3, -2, 2);
    tu_fill(x.g, x.nq, 4, -1, 1);
    return x;
}

static void bufs_free(bufs *x)
{
    free(x->q); free(x->k); free(x->v); free(x->g); free(x->out);
    free(x->dq); free(x->dk); free(x->dv);
}

/* Forward and backward of `a` on a plan with `threads` threads into x. */
static void run_threads(mha_attention_args a, bufs *x, int threads)
{
    a.q = x->q;
    a.k = x->k;
    a.v = x->v;
    a.out = x->out;
    a.num_threads = threads;
    mha_attention_plan *p = NULL;
    assert_int_equal(mha_attention_plan_create(&a, &p), MHA_OK);
    if (mha_attention_plan_run(p, &a) != MHA_OK)
        fail_msg("run: %s", mha_last_error());
    const mha_attention_grads g = {x->g, x->dq, x->dk, x->dv, NULL};
    if (mha_attention_plan_backward(p, &a, &g) != MHA_OK)
        fail_msg("backward: %s", mha_last_error());
    mha_attention_plan_free(p);
}

static void test_threads_bitwise(void **state)
{
    (void)state;
    /* B H Lq Lk d_h >= 2^20 in each, so the engine runs every thread;
     * the odd key count made the ref tier's per-thread float64 scratch
     * misaligned on odd threads (UBSan: misaligned load). */
    static const int64_t shapes[][6] = {
        /* B, H, dh, Lq, Lk, Hkv */
        {2, 4, 32, 200, 200, 4},
        {1, 2, 16, 64, 1505, 2},
        {1, 4, 64, 3, 2100, 4},    /* decoding: split keys */
        {2, 8, 32, 100, 150, 2},   /* grouped-query */
        {1, 8, 64, 1, 2100, 1},    /* multi-query decoding */
        {1, 2, 8, 130, 4100, 1},   /* the backward's 128-row blocks */
    };
    for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
        mha_attention_args a = {0};
        a.batch = shapes[s][0];
        a.num_heads = shapes[s][1];
        a.head_dim = shapes[s][2];
        a.q_len = shapes[s][3];
        a.kv_len = shapes[s][4];
        a.num_kv_heads = shapes[s][5];
        a.causal = s == 0 || s == 5 ? MHA_CAUSAL_BOTTOM_RIGHT
                                    : MHA_CAUSAL_NONE;
        a.dropout = s == 1 ? 0.2f : 0.0f;
        a.training = s == 1;
        a.dropout_seed = 5;
        bufs one = bufs_make(&a);
        run_threads(a, &one, 1);
        for (int threads = 2; threads <= 4; threads += 2) {
            bufs many = bufs_make(&a);
            run_threads(a, &many, threads);
            assert_memory_equal(one.out, many.out, (size_t)one.nq * 4);
            assert_memory_equal(one.dq, many.dq, (size_t)one.nq * 4);
            assert_memory_equal(one.dk, many.dk, (size_t)one.nk * 4);
            assert_memory_equal(one.dv, many.dv, (size_t)one.nk * 4);
            bufs_free(&many);
        }
        /* The plan's run is mha_attention. */
        float *out = malloc((size_t)one.nq * 4);
        a.q = one.q;
        a.k = one.k;
        a.v = one.v;
        a.out = out;
        a.num_threads = 2;
        assert_int_equal(mha_attention(&a), MHA_OK);
        assert_memory_equal(one.out, out, (size_t)one.nq * 4);
        free(out);
        bufs_free(&one);
    }
}

/* ---- misuse ------------------------------------------------------------------ */

static void test_plan_misuse(void **state)
{
    (void)state;
    mha_attention_args a = {0};
    a.batch = 2;
    a.num_heads = 2;
    a.head_dim = 4;
    a.q_len = 5;
    a.kv_len = 7;
    bufs x = bufs_make(&a);
    a.q = x.q;
    a.k = x.k;
    a.v = x.v;
    a.out = x.out;
    const mha_attention_grads g = {x.g, x.dq, x.dk, x.dv, NULL};
    mha_attention_plan *p = NULL;
    assert_fails(mha_attention_plan_create(&a, NULL), MHA_ERR_NULL_POINTER,
                 "plan");
    assert_int_equal(mha_attention_plan_create(&a, &p), MHA_OK);
    assert_fails(mha_attention_plan_backward(p, &a, &g),
                 MHA_ERR_INVALID_ARGUMENT, "no run");
    assert_int_equal(mha_attention_plan_run(p, &a), MHA_OK);

    /* Other shapes than the plan's. */
    mha_attention_args b = a;
    b.q_len = 4;
    assert_fails(mha_attention_plan_run(p, &b), MHA_ERR_SHAPE, "plan");
    b = a;
    b.num_kv_heads = 1;
    assert_fails(mha_attention_plan_run(p, &b), MHA_ERR_SHAPE, "H_kv=1");
    b.num_kv_heads = 3;   /* must divide num_heads */
    assert_fails(mha_attention(&b), MHA_ERR_SHAPE, "num_kv_heads 3");
    b.num_kv_heads = -1;
    assert_fails(mha_attention(&b), MHA_ERR_SHAPE, "num_kv_heads -1");
    /* A failed run leaves nothing to differentiate. */
    assert_fails(mha_attention_plan_backward(p, &a, &g),
                 MHA_ERR_INVALID_ARGUMENT, "no run");
    assert_int_equal(mha_attention_plan_run(p, &a), MHA_OK);

    /* Other arguments than the run's. */
    b = a;
    b.causal = MHA_CAUSAL_TOP_LEFT;
    assert_fails(mha_attention_plan_backward(p, &b, &g),
                 MHA_ERR_INVALID_ARGUMENT, "differ");
    b = a;
    b.scale = 0.25f;   /* the default is 1/sqrt(4) = 0.5 */
    assert_fails(mha_attention_plan_backward(p, &b, &g),
                 MHA_ERR_INVALID_ARGUMENT, "differ");
    /* The same buffers refilled: the fingerprint tells. */
    const float saved = x.k[17];
    x.k[17] += 1.0f;
    assert_fails(mha_attention_plan_backward(p, &a, &g),
                 MHA_ERR_INVALID_ARGUMENT, "changed");
    x.k[17] = saved;
    assert_int_equal(mha_attention_plan_backward(p, &a, &g), MHA_OK);

    /* NULL and overlapping gradients. */
    mha_attention_grads h = g;
    h.grad_v = NULL;
    assert_fails(mha_attention_plan_backward(p, &a, &h), MHA_ERR_NULL_POINTER,
                 "grad_v");
    h = g;
    h.grad_k = x.dv + 1;
    assert_fails(mha_attention_plan_backward(p, &a, &h),
                 MHA_ERR_INVALID_ARGUMENT, "grad_v overlaps grad_k");
    h = g;
    h.grad_q = (float *)x.g;
    assert_fails(mha_attention_plan_backward(p, &a, &h),
                 MHA_ERR_INVALID_ARGUMENT, "grad_q overlaps grad_out");
    h = g;
    h.grad_v = x.v;
    assert_fails(mha_attention_plan_backward(p, &a, &h),
                 MHA_ERR_INVALID_ARGUMENT, "grad_v overlaps v");
    mha_attention_plan_free(p);
    mha_attention_plan_free(NULL);

    /* out may not overlap q, k, v, nor the weights (the ref tier read its
     * own output as keys before this was checked). */
    b = a;
    b.out = x.q;
    assert_fails(mha_attention(&b), MHA_ERR_INVALID_ARGUMENT,
                 "out overlaps q");
    b = a;
    b.out = x.v + 3;
    assert_fails(mha_attention(&b), MHA_ERR_INVALID_ARGUMENT,
                 "out overlaps v");
    /* (out and the weights in one allocation of their own: weights at
     * x.out + 2 ran past out's end into whichever buffer malloc had put
     * next, and the message named that one) */
    const int64_t n_out = a.batch * a.q_len * a.num_heads * a.head_dim;
    const int64_t n_w = a.batch * a.num_heads * a.q_len * a.kv_len;
    float *both = calloc((size_t)(n_out + n_w + 2), sizeof *both);
    assert_non_null(both);
    b = a;
    b.need_weights = MHA_WEIGHTS_PER_HEAD;
    b.out = both;
    b.attn_weights = both + 2;
    assert_fails(mha_attention(&b), MHA_ERR_INVALID_ARGUMENT,
                 "attn_weights overlaps out");
    free(both);
    assert_fails(mha_attention_backward(&a, NULL), MHA_ERR_NULL_POINTER,
                 "gradient");
    bufs_free(&x);
}

/* The module's plan_backward: the same pointers with other contents. */
static void test_module_fingerprint(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 16;
    cfg.num_heads = 4;
    mha_module *m = tu_module(&cfg, 3);
    assert_non_null(m);
    enum { B = 2, L = 9, E = 16 };
    float x[B * L * E], out[B * L * E], gout[B * L * E], gx[B * L * E];
    uint8_t pad[B * L] = {0};
    pad[5] = 1;
    tu_fill(x, B * L * E, 8, -1, 1);
    tu_fill(gout, B * L * E, 9, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, L}};
    a.out = out;
    mha_plan *p = NULL;
    assert_int_equal(mha_plan_create(m, &a, &p), MHA_OK);
    assert_int_equal(mha_plan_forward(p, &a), MHA_OK);
    mha_backward_args g = {0};
    g.grad_out = gout;
    g.grad_query = gx;
    assert_int_equal(mha_plan_backward(p, &a, &g), MHA_OK);
    /* A training loop that refills its input buffer with the next batch
     * but forgets the forward. */
    const float saved = x[100];
    x[100] = 0.5f - x[100];
    assert_fails(mha_plan_backward(p, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "changed");
    x[100] = saved;
    pad[7] = 1;   /* the mask's contents count too */
    assert_fails(mha_plan_backward(p, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "changed");
    pad[7] = 0;
    assert_int_equal(mha_plan_backward(p, &a, &g), MHA_OK);
    mha_plan_free(p);
    mha_free(m);
}

/* ---- configuration: widths and zero that means zero ------------------------ */

static void test_config_bounds(void **state)
{
    (void)state;
    /* CBLAS takes int sizes: the fused q|k|v width 3 D must fit. */
    mha_config c = {0};
    c.embed_dim = 1000000000;
    c.num_heads = 1;
    mha_module *m = NULL;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_CONFIG, "3 * num_heads");
    assert_null(m);
    c.embed_dim = 64;
    c.num_heads = 2;
    c.head_dim = INT_MAX / 4;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_CONFIG, "3 * num_heads");
}

static void test_given_zero(void **state)
{
    (void)state;
    /* An explicit scale of 0: every visible key weighs the same. */
    mha_config c = {0};
    c.embed_dim = 8;
    c.num_heads = 2;
    c.given = MHA_GIVEN_SCALE;
    mha_module *m = NULL;
    assert_int_equal(mha_create(&c, &m), MHA_OK);
    mha_config r;
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_true(r.scale == 0.0f);
    enum { L = 4 };
    float x[L * 8], out[L * 8], w[2 * L * L];
    tu_fill(x, L * 8, 1, -1, 1);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.causal = MHA_CAUSAL_TOP_LEFT;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    a.out = out;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < L; i++)
            for (int j = 0; j <= i; j++)
                assert_float_equal(w[(h * L + i) * L + j], 1.0f / (i + 1),
                                   1e-6f);
    /* Saved and loaded, the 0 stays. */
    char path[300];
    snprintf(path, sizeof path, "%s/given.safetensors", tu_tmpdir);
    assert_int_equal(mha_module_save(m, path), MHA_OK);
    mha_module *back = NULL;
    assert_int_equal(mha_module_load(path, 0, &back), MHA_OK);
    assert_int_equal(mha_get_config(back, &r), MHA_OK);
    assert_true(r.scale == 0.0f);
    mha_free(back);
    mha_free(m);

    /* An explicit dropout of 0 over a file's 0.5. */
    c = (mha_config){0};
    c.embed_dim = 8;
    c.num_heads = 2;
    c.dropout = 0.5f;
    assert_int_equal(mha_create(&c, &m), MHA_OK);
    assert_int_equal(mha_module_save(m, path), MHA_OK);
    mha_free(m);
    mha_tensor_file *f = NULL;
    assert_int_equal(mha_safetensors_load(path, &f), MHA_OK);
    mha_config base = {0};
    assert_int_equal(mha_module_from_file(f, 0, &base, &m), MHA_OK);
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_true(r.dropout == 0.5f);   /* zero alone: the file's */
    mha_free(m);
    base.given = MHA_GIVEN_DROPOUT;
    assert_int_equal(mha_module_from_file(f, 0, &base, &m), MHA_OK);
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_true(r.dropout == 0.0f);   /* given: zero */
    mha_free(m);
    mha_tensor_file_free(f);
}


/* ---- grouped-query modules: table, projections, files, refusals --------- */

static void test_gqa_module(void **state)
{
    (void)state;
    enum { E = 16, H = 4, HKV = 2, DKV = HKV * E / H, L = 5 };
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = H;
    c.num_kv_heads = 3;   /* does not divide 4 */
    mha_module *m = NULL;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_CONFIG, "num_kv_heads 3");
    c.num_kv_heads = -1;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_CONFIG, "num_kv_heads -1");
    c.num_kv_heads = HKV;
    c.add_bias_kv = 1;
    m = tu_module(&c, 11);
    assert_non_null(m);

    /* The table: W_k, W_v, their biases and bias_k / bias_v have H_kv d_h
     * rows; q/k/v stay apart (no in_proj_weight). */
    mha_param_info info;
    assert_int_equal(mha_param_info_by_name(m, "in_proj_weight", &info),
                     MHA_ERR_NOT_FOUND);
    assert_int_equal(mha_param_info_by_name(m, "q_proj_weight", &info), MHA_OK);
    assert_true(info.shape[0] == E && info.shape[1] == E);
    assert_int_equal(mha_param_info_by_name(m, "k_proj_weight", &info), MHA_OK);
    assert_true(info.shape[0] == DKV && info.shape[1] == E);
    assert_int_equal(mha_param_info_by_name(m, "v_proj_weight", &info), MHA_OK);
    assert_true(info.shape[0] == DKV && info.shape[1] == E);
    assert_int_equal(mha_param_info_by_name(m, "in_proj_bias", &info), MHA_OK);
    assert_true(info.shape[0] == E + 2 * DKV);
    assert_int_equal(mha_param_info_by_name(m, "bias_k", &info), MHA_OK);
    assert_true(info.shape[2] == DKV);

    /* The key projection, against float64 sums: x W_k^T + b_k, b_k the
     * in_proj_bias entries after b_q. */
    float x[L * E], y[L * DKV], wk[DKV * E], bias[E + 2 * DKV];
    tu_fill(x, L * E, 12, -1, 1);
    assert_int_equal(mha_param_get(m, "k_proj_weight", wk, DKV * E), MHA_OK);
    assert_int_equal(mha_param_get(m, "in_proj_bias", bias, E + 2 * DKV),
                     MHA_OK);
    assert_int_equal(mha_project(m, MHA_PROJ_KEY, x, L, y), MHA_OK);
    for (int r = 0; r < L; r++)
        for (int o = 0; o < DKV; o++) {
            double want = bias[E + o];
            for (int i = 0; i < E; i++)
                want += (double)x[r * E + i] * wk[o * E + i];
            assert_true(fabs(y[r * DKV + o] - want) <= 1e-5 * (1 + fabs(want)));
        }

    /* Saved with num_kv_heads in __metadata__; loaded, the same module:
     * the same outputs, bit for bit. */
    char path[300];
    snprintf(path, sizeof path, "%s/gqa.safetensors", tu_tmpdir);
    assert_int_equal(mha_module_save(m, path), MHA_OK);
    mha_tensor_file *f = NULL;
    assert_int_equal(mha_safetensors_load(path, &f), MHA_OK);
    assert_non_null(mha_tensor_file_metadata(f, "num_kv_heads"));
    assert_string_equal(mha_tensor_file_metadata(f, "num_kv_heads"), "2");
    mha_tensor_file_free(f);
    mha_module *back = NULL;
    assert_int_equal(mha_module_load(path, 0, &back), MHA_OK);
    mha_config r;
    assert_int_equal(mha_get_config(back, &r), MHA_OK);
    assert_int_equal(r.num_kv_heads, HKV);
    float out1[L * E], out2[L * E];
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.causal = MHA_CAUSAL_TOP_LEFT;
    a.out = out1;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.out = out2;
    assert_int_equal(mha_forward(back, &a), MHA_OK);
    assert_memory_equal(out1, out2, sizeof out1);
    mha_free(back);

    /* Without the metadata, H_kv follows from the shapes and --heads. */
    mha_tensor_view views[8];
    float *data[8];
    const int n = mha_param_count(m);
    for (int k = 0; k < n; k++) {
        assert_int_equal(mha_param_info_at(m, k, &info), MHA_OK);
        data[k] = malloc((size_t)info.numel * sizeof(float));
        assert_int_equal(mha_param_get(m, info.name, data[k], info.numel),
                         MHA_OK);
        views[k] = (mha_tensor_view){info.name, MHA_DTYPE_F32, info.ndim,
                                     {0}, data[k]};
        for (int d = 0; d < info.ndim; d++)
            views[k].shape[d] = info.shape[d];
    }
    assert_int_equal(mha_safetensors_save(path, views, n, NULL, NULL, 0),
                     MHA_OK);
    assert_int_equal(mha_module_load(path, H, &back), MHA_OK);
    assert_int_equal(mha_get_config(back, &r), MHA_OK);
    assert_int_equal(r.num_kv_heads, HKV);
    a.out = out2;
    assert_int_equal(mha_forward(back, &a), MHA_OK);
    assert_memory_equal(out1, out2, sizeof out1);
    mha_free(back);
    /* K/V rows that are no whole number of heads, or whose head count
     * does not divide H: named. */
    for (int k = 0; k < n; k++)
        if (!strcmp(views[k].name, "k_proj_weight") ||
            !strcmp(views[k].name, "v_proj_weight"))
            views[k].shape[0] = 6;   /* 6 rows of 16: d_h = 4 */
        else if (!strcmp(views[k].name, "in_proj_bias"))
            views[k].shape[0] = E + 12;
        else if (!strcmp(views[k].name, "bias_k") ||
                 !strcmp(views[k].name, "bias_v"))
            views[k].shape[2] = 6;
    assert_int_equal(mha_safetensors_save(path, views, n, NULL, NULL, 0),
                     MHA_OK);
    assert_fails(mha_module_load(path, H, &back), MHA_ERR_SHAPE,
                 "k_proj_weight has 6 rows");
    for (int k = 0; k < n; k++)
        free(data[k]);

    /* Pruning: the heads of a group share their K/V rows. */
    const int64_t keep[2] = {0, 1};
    assert_fails(mha_prune_heads(m, keep, 2, &back), MHA_ERR_UNSUPPORTED,
                 "grouped-query");
    mha_free(m);
}

/* ---- the merge of partial results ------------------------------------------ */

/* log sum_j exp(s_ij) over the visible keys of every row (b, h, i), in
 * float64; -inf for a row with no key. */
static void lse64(const problem *P, const double *q, const double *k,
                  double *lse)
{
    double *s = malloc((size_t)P->Lk * sizeof *s);
    for (int64_t b = 0; b < P->B; b++)
        for (int64_t h = 0; h < P->H; h++)
            for (int64_t i = 0; i < P->Lq; i++) {
                double mx, sum;
                scores64(P, q, k, b, h, i, s, &mx, &sum);
                lse[(b * P->H + h) * P->Lq + i] =
                    mx == -INFINITY ? -INFINITY : mx + log(sum);
            }
    free(s);
}

static void test_merge_partials(void **state)
{
    (void)state;
    enum { B = 2, H = 4, HKV = 2, DH = 8, LQ = 5, LK = 150, NP = 3 };
    const int64_t E = H * DH, EKV = HKV * DH, cut[NP + 1] = {0, 40, 100, LK};
    const int64_t nq = B * LQ * E, nk = B * LK * EKV, nl = B * H * LQ;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
    uint8_t *allow = malloc(B * H * LQ * LK);
    tu_fill(q, nq, 31, -1.5f, 1.5f);
    tu_fill(k, nk, 32, -1.5f, 1.5f);
    tu_fill(v, nk, 33, -1.5f, 1.5f);
    for (int64_t x = 0; x < B * H * LQ * LK; x++)
        allow[x] = (x * 13 + 5) % 7 != 0;
    /* Row (1, 0, 0) sees no key of part 1; row (1, 1, 2) no key at all. */
    for (int64_t j = 0; j < LK; j++) {
        if (j >= cut[1] && j < cut[2])
            allow[((1 * H + 0) * LQ + 0) * LK + j] = 0;
        allow[((1 * H + 1) * LQ + 2) * LK + j] = 0;
    }

    /* Each part: its keys, values and mask columns, copied out. */
    float *pout[NP], *plse[NP], *pk[NP], *pv[NP];
    uint8_t *pm[NP];
    mha_attention_part parts[NP];
    for (int p = 0; p < NP; p++) {
        const int64_t n = cut[p + 1] - cut[p];
        pk[p] = malloc((size_t)(B * n * EKV) * 4);
        pv[p] = malloc((size_t)(B * n * EKV) * 4);
        pm[p] = malloc((size_t)(B * H * LQ * n));
        pout[p] = malloc(nq * 4);
        plse[p] = malloc(nl * 4);
        for (int64_t b = 0; b < B; b++) {
            memcpy(pk[p] + b * n * EKV, k + (b * LK + cut[p]) * EKV,
                   (size_t)(n * EKV) * 4);
            memcpy(pv[p] + b * n * EKV, v + (b * LK + cut[p]) * EKV,
                   (size_t)(n * EKV) * 4);
        }
        for (int64_t r = 0; r < B * H * LQ; r++)
            memcpy(pm[p] + r * n, allow + r * LK + cut[p], (size_t)n);
        mha_attention_args a = {0};
        a.batch = B;
        a.num_heads = H;
        a.num_kv_heads = HKV;
        a.head_dim = DH;
        a.q_len = LQ;
        a.kv_len = n;
        a.q = q;
        a.k = pk[p];
        a.v = pv[p];
        a.attn_mask = (mha_mask){MHA_MASK_ALLOW, pm[p], 4, {B, H, LQ, n}};
        a.out = pout[p];
        a.lse = plse[p];
        if (mha_attention(&a) != MHA_OK)
            fail_msg("part %d: %s", p, mha_last_error());
        parts[p] = (mha_attention_part){pout[p], plse[p]};
    }
    float *out = malloc(nq * 4), *lse = malloc(nl * 4);
    assert_int_equal(mha_attention_merge(parts, NP, B, H, DH, LQ, out, lse),
                     MHA_OK);

    /* Against the float64 attention over all keys. */
    problem P = {B, H, HKV, DH, LQ, LK, MHA_CAUSAL_NONE, NULL, NULL, allow,
                 1.0 / sqrt((double)DH), 0.0f, 0};
    double *q64 = widen(q, nq), *k64 = widen(k, nk), *v64 = widen(v, nk);
    double *want = malloc(nq * sizeof *want), *wl = malloc(nl * sizeof *wl);
    attend64(&P, q64, k64, v64, want);
    expect_close("merge", "out", out, want, nq);
    lse64(&P, q64, k64, wl);
    for (int64_t r = 0; r < nl; r++) {
        if (wl[r] == -INFINITY) {
            assert_true(lse[r] == -INFINITY);
            continue;
        }
        if (!(fabs(lse[r] - wl[r]) <= 1e-5 * (1 + fabs(wl[r]))))
            fail_msg("lse[%lld] = %.9g, want %.9g", (long long)r,
                     (double)lse[r], wl[r]);
    }
    for (int64_t d = 0; d < DH; d++)   /* the row with no key: zero */
        assert_true(out[(1 * LQ + 2) * E + 1 * DH + d] == 0.0f);
    assert_true(plse[1][(1 * H + 0) * LQ + 0] == -INFINITY);

    /* In place, into part 0's buffers: the same bits. */
    assert_int_equal(mha_attention_merge(parts, NP, B, H, DH, LQ, pout[0],
                                         plse[0]), MHA_OK);
    assert_memory_equal(out, pout[0], (size_t)nq * 4);
    assert_memory_equal(lse, plse[0], (size_t)nl * 4);

    /* Misuse. */
    assert_fails(mha_attention_merge(parts, 0, B, H, DH, LQ, out, lse),
                 MHA_ERR_INVALID_ARGUMENT, "n_parts");
    assert_fails(mha_attention_merge(parts, NP, B, H, DH, LQ, pout[1] + 1,
                                     NULL),
                 MHA_ERR_INVALID_ARGUMENT, "overlaps parts[1].out");
    mha_attention_part bad[2] = {parts[0], {pout[1], NULL}};
    assert_fails(mha_attention_merge(bad, 2, B, H, DH, LQ, out, NULL),
                 MHA_ERR_NULL_POINTER, "parts[1].lse");
    assert_fails(mha_attention_merge(parts, NP, B, 0, DH, LQ, out, NULL),
                 MHA_ERR_SHAPE, "num_heads");

    for (int p = 0; p < NP; p++) {
        free(pk[p]); free(pv[p]); free(pm[p]); free(pout[p]); free(plse[p]);
    }
    free(q); free(k); free(v); free(allow); free(out); free(lse);
    free(q64); free(k64); free(v64); free(want); free(wl);
}

/* ---- grouped-query decoding: the group's heads stacked ------------------ */

/* Decoding shapes (Lq <= 64 / group; Lk >= 1024: split keys, or keys not
 * split with at least as many (b, K/V head) pairs as threads: B 4, H_kv 2)
 * run the query heads of a K/V head as one block, each K/V tile read
 * once for the group.  The kernels' sums do not depend on the row count,
 * so the result must be the same bits as the same problem with the K/V
 * heads repeated (H_kv = H, one head per block), and within the bound of
 * the float64 attention. */
static void test_gqa_decode_stacked(void **state)
{
    (void)state;
    enum { H = 8, HKV = 2, DH = 16 };
    static const struct { int64_t B, LK, len1; } shapes[] = {
        {2, 1100, 1000},   /* split keys, merged */
        {4, 300, 250},     /* one chunk, finished in place */
    };
    const int64_t E = H * DH, EKV = HKV * DH, G = H / HKV;
    for (int si = 0; si < 2; si++)
    for (int64_t Lq = 1; Lq <= 3; Lq += 2) {
        const int64_t B = shapes[si].B, LK = shapes[si].LK;
        const int64_t nq = B * Lq * E, nk = B * LK * EKV, nkf = B * LK * E;
        float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4);
        float *kf = malloc(nkf * 4), *vf = malloc(nkf * 4);
        float *o1 = malloc(nq * 4), *o2 = malloc(nq * 4);
        tu_fill(q, nq, 41, -1.5f, 1.5f);
        tu_fill(k, nk, 42, -1.5f, 1.5f);
        tu_fill(v, nk, 43, -1.5f, 1.5f);
        for (int64_t r = 0; r < B * LK; r++)     /* repeat_interleave */
            for (int64_t h = 0; h < H; h++) {
                memcpy(kf + r * E + h * DH, k + r * EKV + h / G * DH, DH * 4);
                memcpy(vf + r * E + h * DH, v + r * EKV + h / G * DH, DH * 4);
            }
        int64_t lens[4];
        for (int64_t b = 0; b < B; b++)
            lens[b] = b % 2 ? shapes[si].len1 : LK;
        mha_attention_args a = {0};
        a.batch = B;
        a.num_heads = H;
        a.num_kv_heads = HKV;
        a.head_dim = DH;
        a.q_len = Lq;
        a.kv_len = LK;
        a.q = q;
        a.k = k;
        a.v = v;
        a.key_lengths = lens;
        a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        a.out = o1;
        assert_int_equal(mha_attention(&a), MHA_OK);
        mha_attention_args f = a;
        f.num_kv_heads = 0;
        f.k = kf;
        f.v = vf;
        f.out = o2;
        assert_int_equal(mha_attention(&f), MHA_OK);
        assert_memory_equal(o1, o2, (size_t)nq * 4);
        /* every thread count the same bits: the one-chunk shape stacks up
         * to 8 threads and runs head by head on 16 */
        static const int threads[] = {1, 2, 16};
        for (int ti = 0; ti < 3; ti++) {
            mha_attention_args t = a;
            t.num_threads = threads[ti];
            t.out = o2;
            assert_int_equal(mha_attention(&t), MHA_OK);
            assert_memory_equal(o1, o2, (size_t)nq * 4);
        }

        problem P = {B, H, HKV, DH, Lq, LK, MHA_CAUSAL_BOTTOM_RIGHT, lens,
                     NULL, NULL, 1.0 / sqrt((double)DH), 0.0f, 0};
        double *q64 = widen(q, nq), *k64 = widen(k, nk), *v64 = widen(v, nk);
        double *want = malloc(nq * sizeof *want);
        attend64(&P, q64, k64, v64, want);
        expect_close("stacked decode", "out", o1, want, nq);
        free(q64); free(k64); free(v64); free(want);
        free(q); free(k); free(v); free(kf); free(vf); free(o1); free(o2);
    }
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_gradients),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_plan_misuse),
        cmocka_unit_test(test_module_fingerprint),
        cmocka_unit_test(test_config_bounds),
        cmocka_unit_test(test_given_zero),
        cmocka_unit_test(test_gqa_module),
        cmocka_unit_test(test_merge_partials),
        cmocka_unit_test(test_gqa_decode_stacked),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
