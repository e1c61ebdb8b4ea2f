/*
 * test_modifiers.c -- the score modifiers (include/mha.h, "Positions and
 * score modifiers"; docs/semantics.md): softcap, ALiBi, the window, the
 * chunks (attention_chunk) and sinks, alone and together, with GQA, causal masking and decoding.
 *
 *   - mha_attention (out and lse) against an attention written here from
 *     the definitions, in float64, within the suite's tolerance (twice
 *     the error of the same code in float32, ref.h);
 *   - ALiBi equals the additive mask -slope |i + Lk - Lq - j| fed to the
 *     masked path, and the window and the chunks the bool mask of their
 *     band (bitwise);
 *   - gradients (q, k, v and the sinks) against central differences of
 *     the float64 attention;
 *   - 1, 2 and 4 threads bitwise on prefill and on decoding shapes (key
 *     chunks, stacked GQA);
 *   - a module with every modifier decodes through a KV cache (token by
 *     token, chunks of 7, an ordinary and a sliding-window cache) as its
 *     one-shot causal forward computes; its `sinks` parameter, its
 *     gradient, and its pruning;
 *   - slices of the query rows (q_start, q_total) give the whole
 *     forward's rows, every causal kind, with dropout;
 *   - mha_alibi_slopes against the paper's recursive definition;
 *   - bad settings refused, naming what was wrong.
 *
 * Every tier runs it (CTest, MHA_ISA).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assert_error.h"
#include "ref.h"
#include "testutil.h"

/* ---- the definitions, in float64 (and the same code in float32) ---------- */

enum { SEED = 4242 };   /* the dropout seed of every case */

typedef struct mcase {
    const char *name;
    int64_t B, H, Hkv, dh, Lq, Lk;
    mha_causal causal;
    float softcap;
    int alibi, custom_slopes;
    int window;
    int64_t left, right;
    int sinks;
    float p;             /* dropout (training), drawn by ref_dropout_keep */
    int64_t chunk;       /* attention_chunk, 0: none */
} mcase;

/* floor(x / C) for C > 0, x of either sign. */
static int64_t floor_div(int64_t x, int64_t C)
{
    return x >= 0 ? x / C : -((-x + C - 1) / C);
}

/* Key j visible from row i: causal, then the window and the chunks
 * (bottom-right). */
static int visible(const mcase *c, int64_t i, int64_t j)
{
    const int64_t qpos = i + c->Lk - c->Lq;
    if (c->chunk && floor_div(qpos, c->chunk) != floor_div(j, c->chunk))
        return 0;
    if (c->causal == MHA_CAUSAL_BOTTOM_RIGHT && j > qpos)
        return 0;
    if (c->causal == MHA_CAUSAL_TOP_LEFT && j > i)
        return 0;
    if (c->window && c->left >= 0 && j < qpos - c->left)
        return 0;
    if (c->window && c->right >= 0 && j > qpos + c->right)
        return 0;
    return 1;
}

/*
 * out (B, Lq, H dh) and lse (B, H, Lq): s = scale q.k; softcap; ALiBi;
 * masks; softmax with the sink in the denominator.  T is double (the
 * reference) or float (naive float32: how much error float makes).
 */
#define DEFINE_ATTEND(T, NAME, EXP, TANH, LOG)                                 \
    static void NAME(const mcase *c, const float *slopes,                      \
                     const float *sinks, double scale, const float *q,         \
                     const float *k, const float *v, const double *dq,         \
                     const double *dk, const double *dv, T *out, T *lse)       \
    {                                                                          \
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh;                  \
        T *s = malloc((size_t)c->Lk * sizeof *s);                              \
        for (int64_t b = 0; b < c->B; b++)                                     \
            for (int64_t h = 0; h < c->H; h++)                                 \
                for (int64_t i = 0; i < c->Lq; i++) {                          \
                    const int64_t g = h / (c->H / c->Hkv);                     \
                    const int64_t qo = (b * c->Lq + i) * E + h * c->dh;        \
                    T mx = sinks ? (T)sinks[h] : (T)-INFINITY;                 \
                    int any = sinks != NULL;                                   \
                    for (int64_t j = 0; j < c->Lk; j++) {                      \
                        s[j] = (T)-INFINITY;                                   \
                        if (!visible(c, i, j))                                 \
                            continue;                                          \
                        const int64_t ko = (b * c->Lk + j) * Ekv + g * c->dh;  \
                        T dot = 0;                                             \
                        for (int64_t d = 0; d < c->dh; d++)                    \
                            dot += (dq ? (T)dq[qo + d] : (T)q[qo + d]) *       \
                                   (dk ? (T)dk[ko + d] : (T)k[ko + d]);        \
                        T x = dot * (T)scale;                                  \
                        if (c->softcap > 0)                                    \
                            x = (T)c->softcap * TANH(x / (T)c->softcap);       \
                        if (c->alibi) {                                        \
                            const int64_t dist = i + c->Lk - c->Lq - j;        \
                            x -= (T)slopes[h] * (T)(dist < 0 ? -dist : dist);  \
                        }                                                      \
                        s[j] = x;                                              \
                        mx = x > mx ? x : mx;                                  \
                        any = 1;                                               \
                    }                                                          \
                    T *o = out + qo;                                           \
                    for (int64_t d = 0; d < c->dh; d++)                        \
                        o[d] = 0;                                              \
                    T *l = lse + (b * c->H + h) * c->Lq + i;                   \
                    if (!any) {                                                \
                        *l = (T)-INFINITY;                                     \
                        continue;                                              \
                    }                                                          \
                    T sum = sinks ? EXP((T)sinks[h] - mx) : 0;                 \
                    for (int64_t j = 0; j < c->Lk; j++)                        \
                        sum += s[j] == (T)-INFINITY ? 0 : EXP(s[j] - mx);      \
                    for (int64_t j = 0; j < c->Lk; j++) {                      \
                        if (s[j] == (T)-INFINITY)                              \
                            continue;                                          \
                        T p = EXP(s[j] - mx) / sum;                            \
                        if (c->p > 0.0f)                                       \
                            p = ref_dropout_keep(SEED, c->p, b, h, i, j)       \
                                    ? p / (T)(1.0 - (double)c->p) : 0;         \
                        const int64_t vo = (b * c->Lk + j) * Ekv + g * c->dh;  \
                        for (int64_t d = 0; d < c->dh; d++)                    \
                            o[d] += p * (dv ? (T)dv[vo + d] : (T)v[vo + d]);   \
                    }                                                          \
                    *l = mx + LOG(sum);                                        \
                }                                                              \
        free(s);                                                               \
    }
DEFINE_ATTEND(double, attend64, exp, tanh, log)
DEFINE_ATTEND(float, attend32, expf, tanhf, logf)

/* A problem's data and the library's arguments for it. */
typedef struct prob {
    const mcase *c;
    int64_t nq, nk;
    float *q, *k, *v, *out, *lse, *slopes, *sinks;
    mha_attention_args a;
} prob;

static void prob_init(prob *p, const mcase *c, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->c = c;
    p->nq = c->B * c->Lq * c->H * c->dh;
    p->nk = c->B * c->Lk * c->Hkv * c->dh;
    p->q = malloc((size_t)p->nq * 4);
    p->k = malloc((size_t)p->nk * 4);
    p->v = malloc((size_t)p->nk * 4);
    p->out = malloc((size_t)p->nq * 4);
    p->lse = malloc((size_t)(c->B * c->H * c->Lq) * 4);
    p->slopes = malloc((size_t)c->H * 4);
    p->sinks = malloc((size_t)c->H * 4);
    /* Scores of a few units: the softcap (c ~ 1..5) bends them. */
    tu_fill(p->q, p->nq, seed + 1, -2.0f, 2.0f);
    tu_fill(p->k, p->nk, seed + 2, -2.0f, 2.0f);
    tu_fill(p->v, p->nk, seed + 3, -1.5f, 1.5f);
    tu_fill(p->sinks, c->H, seed + 4, -2.0f, 3.0f);
    if (c->custom_slopes)
        tu_fill(p->slopes, c->H, seed + 5, 0.0f, 0.7f);
    else
        assert_int_equal(mha_alibi_slopes(c->H, p->slopes), MHA_OK);
    mha_attention_args *a = &p->a;
    a->batch = c->B;
    a->num_heads = c->H;
    a->num_kv_heads = c->Hkv;
    a->head_dim = c->dh;
    a->q_len = c->Lq;
    a->kv_len = c->Lk;
    a->q = p->q;
    a->k = p->k;
    a->v = p->v;
    a->out = p->out;
    a->lse = p->lse;
    a->causal = c->causal;
    a->mods.softcap = c->softcap;
    a->mods.alibi = c->alibi;
    a->mods.alibi_slopes = c->custom_slopes ? p->slopes : NULL;
    a->mods.window = c->window;
    a->mods.window_left = c->left;
    a->mods.window_right = c->right;
    a->attention_chunk = c->chunk;
    a->sinks = c->sinks ? p->sinks : NULL;
    a->dropout = c->p;
    a->training = c->p > 0.0f;
    a->dropout_seed = SEED;
}

static void prob_free(prob *p)
{
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->out);
    free(p->lse);
    free(p->slopes);
    free(p->sinks);
}

static double scale_of(const mcase *c)
{
    return (double)(float)(1.0 / sqrt((double)c->dh));
}

static const mcase CASES[] = {
    /* name                       B  H Hkv dh  Lq   Lk  causal cap  alibi cs win left right sinks p */
    {"softcap",                   2, 2, 2, 16, 9,   70, 0, 1.5f, 0, 0, 0, 0, 0, 0, 0, 0},
    {"softcap, large scores",     1, 2, 2, 32, 5,   40, 0, 0.3f, 0, 0, 0, 0, 0, 0, 0, 0},
    {"alibi, default slopes",     2, 3, 3, 8,  7,   90, 0, 0.0f, 1, 0, 0, 0, 0, 0, 0, 0},
    {"alibi, causal, Lq < Lk",    1, 4, 2, 8,  20,  150, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 1, 1, 0, 0, 0, 0, 0, 0},
    {"window (16, 0) causal",     2, 2, 2, 8,  130, 130, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 1, 16, 0, 0, 0, 0},
    {"window (3, 5), no causal",  1, 2, 1, 8,  70,  70, 0, 0.0f, 0, 0, 1, 3, 5, 0, 0, 0},
    {"window (-1, 2), Lq < Lk",   1, 2, 2, 8,  9,   200, 0, 0.0f, 0, 0, 1, -1, 2, 0, 0, 0},
    {"window (100, -1)",          1, 1, 1, 4,  300, 300, 0, 0.0f, 0, 0, 1, 100, -1, 0, 0, 0},
    {"window (0, 0): itself",     1, 2, 2, 4,  70,  70, 0, 0.0f, 0, 0, 1, 0, 0, 0, 0, 0},
    {"sinks",                     2, 2, 2, 8,  9,   70, 0, 0.0f, 0, 0, 0, 0, 0, 1, 0, 0},
    {"sinks, rows with no key",   1, 2, 2, 8,  20,  10, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 0, 0, 0, 1, 0, 0},
    {"everything, GQA",           2, 4, 2, 16, 33,  140, MHA_CAUSAL_BOTTOM_RIGHT, 2.0f, 1, 1, 1, 40, 0, 1, 0, 0},
    {"everything, decoding",      2, 8, 2, 16, 1,   1500, MHA_CAUSAL_BOTTOM_RIGHT, 3.0f, 1, 0, 1, 700, 0, 1, 0, 0},
    {"everything, top-left",      1, 2, 2, 8,  80,  80, MHA_CAUSAL_TOP_LEFT, 1.0f, 1, 0, 1, 20, 3, 1, 0, 0},
    {"everything, dropout",       2, 4, 2, 8,  40,  90, MHA_CAUSAL_BOTTOM_RIGHT, 2.0f, 1, 0, 1, 30, 0, 1, 0.25f, 0},
    {"softcap, sinks, dropout, decoding", 1, 4, 1, 16, 2, 1100, 0, 1.0f, 0, 0, 0, 0, 0, 1, 0.3f, 0},
    /* chunks: inside tiles (16, 50) and on their edges (64); rows before
     * position 0 (Lq > Lk) that see nothing; with the window */
    {"chunk 16, causal",          2, 2, 2, 8,  130, 130, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 0, 0, 0, 0, 0, 16},
    {"chunk 64, no causal, Lq < Lk", 1, 2, 1, 8, 40, 300, 0, 0.0f, 0, 0, 0, 0, 0, 0, 0, 64},
    {"chunk 7, Lq > Lk",          1, 2, 2, 8,  30,  20,  0, 0.0f, 0, 0, 0, 0, 0, 0, 0, 7},
    {"chunk 50, window (30, 0)",  1, 2, 2, 8,  200, 200, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 1, 30, 0, 0, 0, 50},
    {"chunk 600, decoding",       2, 8, 2, 16, 1,   1500, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 0, 0, 0, 0, 0, 600},
    {"everything, chunk 48",      2, 4, 2, 16, 33,  140, MHA_CAUSAL_BOTTOM_RIGHT, 2.0f, 1, 1, 1, 40, 0, 1, 0, 48},
};

/* max |x - ref| over n, NaN anywhere: +inf. */
static double max_err(const float *x, const double *ref, int64_t n)
{
    double e = 0.0;
    for (int64_t k = 0; k < n; k++) {
        const double d = fabs((double)x[k] - ref[k]);
        if (!(d <= e))
            e = d != d ? INFINITY : d;
    }
    return e;
}

static double max_err32(const float *x, const double *ref, int64_t n)
{
    return max_err(x, ref, n);
}

/* lse of rows that have a key compared; -inf must match exactly. */
static void check_lse(const char *name, const float *lse, const double *ref,
                      const float *naive, int64_t n)
{
    double err = 0.0, nerr = 0.0, mx = 0.0;
    for (int64_t r = 0; r < n; r++) {
        if (ref[r] == -INFINITY) {
            if (lse[r] != -INFINITY)
                fail_msg("%s: lse[%lld] = %g for a row with no key", name,
                         (long long)r, (double)lse[r]);
            continue;
        }
        mx = fabs(ref[r]) > mx ? fabs(ref[r]) : mx;
        err = fmax(err, fabs((double)lse[r] - ref[r]));
        nerr = fmax(nerr, fabs((double)naive[r] - ref[r]));
    }
    if (!(err <= ref_tolerance(nerr, mx)))
        fail_msg("%s: lse error %.3g > tolerance %.3g", name, err,
                 ref_tolerance(nerr, mx));
}

static void test_forward_vs_reference(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const mcase *c = &CASES[t];
        prob p;
        prob_init(&p, c, 100 * t);
        if (mha_attention(&p.a) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        const int64_t nl = c->B * c->H * c->Lq;
        double *ref = malloc((size_t)p.nq * sizeof *ref);
        double *rlse = malloc((size_t)nl * sizeof *rlse);
        float *naive = malloc((size_t)p.nq * sizeof *naive);
        float *nlse = malloc((size_t)nl * sizeof *nlse);
        const float *sinks = c->sinks ? p.sinks : NULL;
        attend64(c, p.slopes, sinks, scale_of(c), p.q, p.k, p.v, NULL, NULL,
                 NULL, ref, rlse);
        attend32(c, p.slopes, sinks, scale_of(c), p.q, p.k, p.v, NULL, NULL,
                 NULL, naive, nlse);
        const double tol = ref_tolerance(max_err32(naive, ref, p.nq),
                                         ref_max_abs(ref, p.nq));
        const double err = max_err(p.out, ref, p.nq);
        if (!(err <= tol))
            fail_msg("%s: out error %.3g > tolerance %.3g", c->name, err, tol);
        check_lse(c->name, p.lse, rlse, nlse, nl);
        /* The weights: applied to V they give the output, and with the
         * sink's share exp(sink - lse) each row sums to 1 (0 when the row
         * has no key and no sink). */
        const int64_t nw = nl * c->Lk, E = c->H * c->dh, Ekv = c->Hkv * c->dh;
        float *w = malloc((size_t)nw * sizeof *w);
        p.a.need_weights = MHA_WEIGHTS_PER_HEAD;
        p.a.attn_weights = w;
        assert_int_equal(mha_attention(&p.a), MHA_OK);
        double *wv = malloc((size_t)p.nq * sizeof *wv);
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t h = 0; h < c->H; h++)
                for (int64_t i = 0; i < c->Lq; i++) {
                    const int64_t row = (b * c->H + h) * c->Lq + i;
                    const int64_t g = h / (c->H / c->Hkv);
                    double sum = sinks && rlse[row] != -INFINITY
                                     ? exp(sinks[h] - rlse[row]) : 0.0;
                    double *o = wv + (b * c->Lq + i) * E + h * c->dh;
                    for (int64_t d = 0; d < c->dh; d++)
                        o[d] = 0.0;
                    for (int64_t j = 0; j < c->Lk; j++) {
                        const double wj = w[row * c->Lk + j];
                        sum += wj;
                        const float *vj = p.v + (b * c->Lk + j) * Ekv +
                                          g * c->dh;
                        for (int64_t d = 0; d < c->dh; d++)
                            o[d] += wj * vj[d];
                    }
                    if (c->p == 0.0f &&   /* (dropout scales kept weights) */
                        !(fabs(sum - (rlse[row] == -INFINITY ? 0.0 : 1.0)) <=
                          1e-5))
                        fail_msg("%s: weights of row %lld sum to %.9g", c->name,
                                 (long long)row, sum);
                }
        double werr = 0.0;
        for (int64_t e = 0; e < p.nq; e++)
            werr = fmax(werr, fabs(wv[e] - ref[e]));
        if (!(werr <= 1e-5 * (1.0 + ref_max_abs(ref, p.nq))))
            fail_msg("%s: weights times V differ from the output by %.3g",
                     c->name, werr);
        free(w);
        free(wv);
        free(ref);
        free(rlse);
        free(naive);
        free(nlse);
        prob_free(&p);
    }
}

/* The modifiers change what they claim to: each case differs from the
 * plain attention of its data (the test above could not tell a modifier
 * that does nothing from one that does little). */
static void test_modifiers_act(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        prob p;
        prob_init(&p, &CASES[t], 100 * t);
        assert_int_equal(mha_attention(&p.a), MHA_OK);
        float *with = malloc((size_t)p.nq * 4);
        memcpy(with, p.out, (size_t)p.nq * 4);
        p.a.mods = (mha_modifiers){0};
        p.a.attention_chunk = 0;
        p.a.sinks = NULL;
        assert_int_equal(mha_attention(&p.a), MHA_OK);
        double diff = 0.0;
        for (int64_t e = 0; e < p.nq; e++)
            diff = fmax(diff, fabs((double)with[e] - p.out[e]));
        if (!(diff > 1e-3))
            fail_msg("%s: the modifiers change the output by only %.3g",
                     CASES[t].name, diff);
        free(with);
        prob_free(&p);
    }
}

/* ---- ALiBi and the window against explicit masks ------------------------ */

static int bitwise_equal(const float *x, const float *y, int64_t n)
{
    return memcmp(x, y, (size_t)n * sizeof *x) == 0;
}

static void test_alibi_and_window_as_masks(void **state)
{
    (void)state;
    const int ref_tier = !strcmp(mha_kernel_tier(), "ref");
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const mcase *c = &CASES[t];
        if (c->softcap > 0.0f || c->sinks ||
            (!c->alibi && !c->window && !c->chunk))
            continue;
        prob p;
        prob_init(&p, c, 100 * t);
        assert_int_equal(mha_attention(&p.a), MHA_OK);
        float *with = malloc((size_t)p.nq * 4);
        memcpy(with, p.out, (size_t)p.nq * 4);
        /* The same as a (1, H, Lq, Lk) additive mask, -inf outside the
         * window, -slope_h |i + Lk - Lq - j| inside (rounded as the
         * library rounds it: slope * (float)distance). */
        const int64_t nm = c->H * c->Lq * c->Lk;
        float *add = malloc((size_t)nm * 4);
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t i = 0; i < c->Lq; i++)
                for (int64_t j = 0; j < c->Lk; j++) {
                    const int64_t d = i + c->Lk - c->Lq - j;
                    const int64_t at = (h * c->Lq + i) * c->Lk + j;
                    mcase nc = *c;
                    nc.causal = MHA_CAUSAL_NONE;   /* still the flag's */
                    add[at] = !visible(&nc, i, j) ? -INFINITY
                            : c->alibi ? -(p.slopes[h] * (float)(d < 0 ? -d : d))
                                       : 0.0f;
                }
        p.a.mods = (mha_modifiers){0};
        p.a.attention_chunk = 0;
        p.a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 4,
                                   {1, c->H, c->Lq, c->Lk}};
        assert_int_equal(mha_attention(&p.a), MHA_OK);
        if (ref_tier) {
            /* float64 there: ALiBi in float64, the mask rounded */
            double err = 0.0;
            for (int64_t e = 0; e < p.nq; e++)
                err = fmax(err, fabs((double)with[e] - p.out[e]));
            if (!(err <= 1e-5))
                fail_msg("%s: ref tier, masks differ by %.3g", c->name, err);
        } else if (!bitwise_equal(with, p.out, p.nq)) {
            fail_msg("%s: not bitwise the explicit mask's result", c->name);
        }
        free(add);
        free(with);
        prob_free(&p);
    }
}

/* ---- gradients ------------------------------------------------------------ */

/* L = sum(g * out) of the float64 attention at (q, k, v) as doubles and
 * the given sinks. */
static double loss64(const mcase *c, const float *slopes, const float *sinks,
                     const double *q, const double *k, const double *v,
                     const float *g)
{
    const int64_t n = c->B * c->Lq * c->H * c->dh;
    double *out = malloc((size_t)n * sizeof *out);
    double *lse = malloc((size_t)(c->B * c->H * c->Lq) * sizeof *lse);
    attend64(c, slopes, sinks, scale_of(c), NULL, NULL, NULL, q, k, v, out,
             lse);
    double L = 0.0;
    for (int64_t e = 0; e < n; e++)
        L += out[e] * g[e];
    free(out);
    free(lse);
    return L;
}

static void expect_close(const char *name, const char *what, const float *got,
                         const double *want, int64_t n)
{
    double mx = 0.0, err = 0.0;
    for (int64_t e = 0; e < n; e++)
        mx = fmax(mx, fabs(want[e]));
    err = max_err(got, want, n);
    if (!(err <= 1e-4 * (1.0 + mx)))
        fail_msg("%s: %s max error %.3g (max |grad| %.3g)", name, what, err,
                 mx);
}

static double *widen(const float *x, int64_t n)
{
    double *y = malloc((size_t)n * sizeof *y);
    for (int64_t e = 0; e < n; e++)
        y[e] = x[e];
    return y;
}

static const mcase GCASES[] = {
    {"softcap",               1, 2, 2, 4, 5,  9,  0, 1.0f, 0, 0, 0, 0, 0, 0, 0, 0},
    {"alibi, causal",         1, 2, 1, 4, 6,  9,  MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 1, 1, 0, 0, 0, 0, 0, 0},
    {"window (2, 1)",         1, 2, 2, 4, 8,  8,  0, 0.0f, 0, 0, 1, 2, 1, 0, 0, 0},
    {"sinks",                 2, 2, 2, 4, 5,  7,  0, 0.0f, 0, 0, 0, 0, 0, 1, 0, 0},
    {"sinks, a row with no key", 1, 2, 2, 4, 6, 3, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 0, 0, 0, 1, 0, 0},
    {"everything, GQA",       2, 4, 2, 4, 7,  70, MHA_CAUSAL_BOTTOM_RIGHT, 1.5f, 1, 0, 1, 30, 0, 1, 0, 0},
    {"everything, dropout",   2, 2, 1, 4, 6,  40, MHA_CAUSAL_BOTTOM_RIGHT, 1.5f, 1, 0, 1, 10, 0, 1, 0.3f, 0},
    {"chunk 5, causal",       1, 2, 2, 4, 12, 12, MHA_CAUSAL_BOTTOM_RIGHT, 0.0f, 0, 0, 0, 0, 0, 0, 0, 5},
    {"chunk 4, window (2, 1), sinks", 1, 2, 1, 4, 9, 11, 0, 0.0f, 0, 0, 1, 2, 1, 1, 0, 4},
};

static void test_gradients(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof GCASES / sizeof *GCASES; t++) {
        const mcase *c = &GCASES[t];
        prob p;
        prob_init(&p, c, 1000 + 10 * t);
        float *g = malloc((size_t)p.nq * 4), *dq = malloc((size_t)p.nq * 4);
        float *dk = malloc((size_t)p.nk * 4), *dv = malloc((size_t)p.nk * 4);
        float dsink[8];
        tu_fill(g, p.nq, 77 + t, -1.0f, 1.0f);
        const mha_attention_grads gr = {g, dq, dk, dv,
                                        c->sinks ? dsink : NULL};
        if (mha_attention_backward(&p.a, &gr) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        double *q = widen(p.q, p.nq), *k = widen(p.k, p.nk);
        double *v = widen(p.v, p.nk);
        const float *sinks = c->sinks ? p.sinks : NULL;
        double *x[3] = {q, k, v};
        const float *got[3] = {dq, dk, dv};
        const int64_t n[3] = {p.nq, p.nk, p.nk};
        const char *names[3] = {"dq", "dk", "dv"};
        const double step = 1e-4;
        for (int w = 0; w < 3; w++) {
            double *want = malloc((size_t)n[w] * sizeof *want);
            for (int64_t e = 0; e < n[w]; e++) {
                const double x0 = x[w][e];
                x[w][e] = x0 + step;
                const double up = loss64(c, p.slopes, sinks, q, k, v, g);
                x[w][e] = x0 - step;
                const double down = loss64(c, p.slopes, sinks, q, k, v, g);
                x[w][e] = x0;
                want[e] = (up - down) / (2 * step);
            }
            char what[64];
            snprintf(what, sizeof what, "%s", names[w]);
            expect_close(c->name, what, got[w], want, n[w]);
            free(want);
        }
        if (c->sinks) {
            /* the sinks in float64 for the differences */
            double want[8];
            float sk[8];
            for (int64_t h = 0; h < c->H; h++) {
                memcpy(sk, p.sinks, (size_t)c->H * 4);
                /* a float step: the sinks are floats (2^-10 exactly) */
                const float st = 0x1p-10f;
                sk[h] = p.sinks[h] + st;
                const double up = loss64(c, p.slopes, sk, q, k, v, g);
                sk[h] = p.sinks[h] - st;
                const double down = loss64(c, p.slopes, sk, q, k, v, g);
                want[h] = (up - down) / (2.0 * st);
            }
            /* (a step of 2^-10: the differences' own error ~1e-7) */
            expect_close(c->name, "dsinks", dsink, want, c->H);
        }
        free(q);
        free(k);
        free(v);
        free(g);
        free(dq);
        free(dk);
        free(dv);
        prob_free(&p);
    }
}

/* ---- threads ---------------------------------------------------------------- */

static void test_threads_bitwise(void **state)
{
    (void)state;
    static const size_t picks[] = {4, 11, 12, 13, 20, 21};
    for (size_t k = 0; k < sizeof picks / sizeof *picks; k++) {
        const mcase *c = &CASES[picks[k]];
        prob p;
        prob_init(&p, c, 7 * k);
        float *first = malloc((size_t)p.nq * 4);
        float *lse1 = malloc((size_t)(c->B * c->H * c->Lq) * 4);
        const int threads[3] = {1, 2, 4};
        for (int n = 0; n < 3; n++) {
            p.a.num_threads = threads[n];
            assert_int_equal(mha_attention(&p.a), MHA_OK);
            if (n == 0) {
                memcpy(first, p.out, (size_t)p.nq * 4);
                memcpy(lse1, p.lse, (size_t)(c->B * c->H * c->Lq) * 4);
            } else if (!bitwise_equal(first, p.out, p.nq) ||
                       !bitwise_equal(lse1, p.lse, c->B * c->H * c->Lq)) {
                fail_msg("%s: %d threads differ from 1", c->name, threads[n]);
            }
        }
        free(first);
        free(lse1);
        prob_free(&p);
    }
}

/* ---- a module with every modifier, decoding ------------------------------- */

/* Runs `m` over x (B, L, E) through a cache in chunks of `chunk` (window
 * cache when window > 0) and returns the max |decoded - one-shot|; fails
 * on an error. */
static double decode_vs_forward(const mha_module *m, const float *x,
                                int64_t B, int64_t L, int64_t chunk,
                                int64_t window, const float *full)
{
    mha_config c;
    assert_int_equal(mha_get_config(m, &c), MHA_OK);
    const int64_t E = c.embed_dim;
    const mha_kv_cache_config kc = {B, c.num_kv_heads, c.head_dim,
                                    window ? window - 1 + chunk : L,
                                    MHA_KV_F32, window, 0, 0, 0, 0, 0};
    mha_kv_cache *kv;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float *step_in = malloc((size_t)(B * chunk * E) * 4);
    float *step_out = malloc((size_t)(B * chunk * E) * 4);
    double err = 0.0;
    for (int64_t t0 = 0; t0 < L; t0 += chunk) {
        const int64_t n = L - t0 < chunk ? L - t0 : chunk;
        for (int64_t b = 0; b < B; b++)
            memcpy(step_in + b * n * E, x + (b * L + t0) * E,
                   (size_t)(n * E) * 4);
        mha_forward_args a = {0};
        a.batch = B;
        a.q_len = n;
        a.query = step_in;
        a.out = step_out;
        a.cache = kv;
        if (mha_forward(m, &a) != MHA_OK)
            fail_msg("decode at %lld: %s", (long long)t0, mha_last_error());
        for (int64_t b = 0; b < B; b++)
            for (int64_t e = 0; e < n * E; e++)
                err = fmax(err, fabs((double)step_out[b * n * E + e] -
                                     full[(b * L + t0) * E + e]));
    }
    free(step_in);
    free(step_out);
    mha_kv_cache_free(kv);
    return err;
}

static void test_module_decodes(void **state)
{
    (void)state;
    const int64_t B = 2, L = 150, E = 32, H = 4;
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.num_kv_heads = 2;
    cfg.mods.softcap = 2.5f;
    cfg.mods.alibi = 1;
    cfg.mods.window = 1;
    cfg.mods.window_left = 40;
    cfg.mods.window_right = -1;   /* causal bounds it */
    cfg.sinks = 1;
    mha_module *m = tu_module(&cfg, 5);
    assert_non_null(m);
    /* the module's sinks: a parameter of (H), random by tu_module */
    mha_param_info info;
    assert_int_equal(mha_param_info_by_name(m, "sinks", &info), MHA_OK);
    assert_int_equal(info.ndim, 1);
    assert_int_equal(info.shape[0], H);
    float *x = malloc((size_t)(B * L * E) * 4);
    float *full = malloc((size_t)(B * L * E) * 4);
    tu_fill(x, B * L * E, 9, -1.0f, 1.0f);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.out = full;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    double mx = 0.0;
    for (int64_t e = 0; e < B * L * E; e++)
        mx = fmax(mx, fabs((double)full[e]));
    /* The same sums in another order (the cache's tiles, a ring's slots):
     * float rounding apart, nothing more. */
    const double tol = 2e-5 * (1.0 + mx);
    const int64_t chunks[3] = {1, 7, 150};
    for (int k = 0; k < 3; k++) {
        const double err = decode_vs_forward(m, x, B, L, chunks[k], 0, full);
        if (!(err <= tol))
            fail_msg("chunks of %lld: decoding differs from the forward by "
                     "%.3g", (long long)chunks[k], err);
    }
    /* A sliding-window cache of 41 positions holds all a row sees; one
     * of 60 holds more, and the module's window (40 back) must still
     * bound what a row sees in it. */
    const int64_t windows[2] = {41, 60};
    for (int k = 0; k < 2; k++)
        for (int w = 0; w < 2; w++) {
            const double err = decode_vs_forward(m, x, B, L, chunks[k],
                                                 windows[w], full);
            if (!(err <= tol))
                fail_msg("window cache of %lld, chunks of %lld: differs by "
                         "%.3g", (long long)windows[w], (long long)chunks[k],
                         err);
        }
    free(x);
    free(full);
    mha_free(m);
}

/* A chunked module (Llama 4's layers: chunks of 32 here, with softcap,
 * ALiBi and sinks beside) decodes as its one-shot causal forward, through
 * an ordinary cache and through a sliding-window cache of W = C (all a
 * chunk's row can see) or more. */
static void test_module_chunk_decodes(void **state)
{
    (void)state;
    const int64_t B = 2, L = 150, E = 32, H = 4;
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.num_kv_heads = 2;
    cfg.mods.softcap = 2.5f;
    cfg.mods.alibi = 1;
    cfg.attention_chunk = 32;
    cfg.sinks = 1;
    mha_module *m = tu_module(&cfg, 6);
    assert_non_null(m);
    float *x = malloc((size_t)(B * L * E) * 4);
    float *full = malloc((size_t)(B * L * E) * 4);
    float *unchunked = malloc((size_t)(B * L * E) * 4);
    tu_fill(x, B * L * E, 10, -1.0f, 1.0f);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.out = full;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    double mx = 0.0;
    for (int64_t e = 0; e < B * L * E; e++)
        mx = fmax(mx, fabs((double)full[e]));
    const double tol = 2e-5 * (1.0 + mx);
    const int64_t chunks[3] = {1, 7, 150}, windows[2] = {32, 45};
    for (int k = 0; k < 3; k++) {
        double err = decode_vs_forward(m, x, B, L, chunks[k], 0, full);
        if (!(err <= tol))
            fail_msg("chunked module, steps of %lld: decoding differs from "
                     "the forward by %.3g", (long long)chunks[k], err);
        for (int w = 0; k < 2 && w < 2; w++) {
            err = decode_vs_forward(m, x, B, L, chunks[k], windows[w], full);
            if (!(err <= tol))
                fail_msg("chunked module, window cache of %lld, steps of "
                         "%lld: differs by %.3g", (long long)windows[w],
                         (long long)chunks[k], err);
        }
    }
    /* and the chunks act: rows past the first chunk differ without them */
    mha_free(m);
    cfg.attention_chunk = 0;
    m = tu_module(&cfg, 6);
    a.out = unchunked;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    double first = 0.0, later = 0.0;
    for (int64_t i = 0; i < L; i++)
        for (int64_t e = 0; e < E; e++) {
            const double d = fabs((double)full[i * E + e] - unchunked[i * E + e]);
            if (i < 32)
                first = fmax(first, d);
            else
                later = fmax(later, d);
        }
    if (!(first == 0.0 && later > 1e-3))
        fail_msg("chunks of 32: the first chunk's rows differ by %.3g (must "
                 "not), later rows by %.3g (must)", first, later);
    free(x);
    free(full);
    free(unchunked);
    mha_free(m);
}

/* The module plumbs the modifiers and the sinks' gradient: its forward
 * and backward equal mha_attention's on its own projections. */
static void test_module_matches_heads(void **state)
{
    (void)state;
    const int64_t B = 2, L = 24, E = 24, H = 3, dh = 8;
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.no_bias = 1;
    cfg.mods.softcap = 1.5f;
    cfg.mods.alibi = 1;
    cfg.mods.window = 1;
    cfg.mods.window_left = 5;
    cfg.mods.window_right = 2;
    cfg.attention_chunk = 10;
    cfg.sinks = 1;
    mha_module *m = tu_module(&cfg, 21);
    assert_non_null(m);
    const int64_t n = B * L * E;
    float *x = malloc((size_t)n * 4), *out = malloc((size_t)n * 4);
    float *q = malloc((size_t)n * 4), *k = malloc((size_t)n * 4);
    float *v = malloc((size_t)n * 4), *ctx = malloc((size_t)n * 4);
    float *y = malloc((size_t)n * 4), *g = malloc((size_t)n * 4);
    tu_fill(x, n, 3, -1.0f, 1.0f);
    tu_fill(g, n, 4, -1.0f, 1.0f);
    assert_int_equal(mha_project(m, MHA_PROJ_QUERY, x, B * L, q), MHA_OK);
    assert_int_equal(mha_project(m, MHA_PROJ_KEY, x, B * L, k), MHA_OK);
    assert_int_equal(mha_project(m, MHA_PROJ_VALUE, x, B * L, v), MHA_OK);
    float sinks[3], dsink_heads[3];
    assert_int_equal(mha_param_get(m, "sinks", sinks, H), MHA_OK);
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.head_dim = dh;
    a.q_len = L;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = ctx;
    a.mods = cfg.mods;
    a.attention_chunk = cfg.attention_chunk;
    a.sinks = sinks;
    assert_int_equal(mha_attention(&a), MHA_OK);
    assert_int_equal(mha_project(m, MHA_PROJ_OUT, ctx, B * L, y), MHA_OK);
    mha_forward_args f = {0};
    f.batch = B;
    f.q_len = L;
    f.query = x;
    f.out = out;
    assert_int_equal(mha_forward(m, &f), MHA_OK);
    for (int64_t e = 0; e < n; e++)
        if (fabsf(out[e] - y[e]) > 1e-5f)
            fail_msg("module forward %g vs heads %g at %lld", (double)out[e],
                     (double)y[e], (long long)e);
    /* dL/d sinks: the module's (grad_params) and the heads' (dctx =
     * g W_o, the gradient reaching ctx). */
    const int64_t np = mha_param_numel(m);
    float *gp = calloc((size_t)np, 4);
    mha_backward_args bw = {0};
    bw.grad_out = g;
    bw.grad_params = gp;
    assert_int_equal(mha_backward(m, &f, &bw), MHA_OK);
    float *wo = malloc((size_t)(E * E) * 4), *dctx = malloc((size_t)n * 4);
    assert_int_equal(mha_param_get(m, "out_proj.weight", wo, E * E), MHA_OK);
    for (int64_t r = 0; r < B * L; r++)
        for (int64_t d = 0; d < E; d++) {
            double s = 0.0;
            for (int64_t e = 0; e < E; e++)
                s += (double)g[r * E + e] * wo[e * E + d];
            dctx[r * E + d] = (float)s;
        }
    float *dq = malloc((size_t)n * 4), *dk = malloc((size_t)n * 4);
    float *dv = malloc((size_t)n * 4);
    const mha_attention_grads gr = {dctx, dq, dk, dv, dsink_heads};
    assert_int_equal(mha_attention_backward(&a, &gr), MHA_OK);
    mha_param_info info;
    assert_int_equal(mha_param_info_by_name(m, "sinks", &info), MHA_OK);
    for (int64_t h = 0; h < H; h++) {
        const float got = gp[info.offset + h];
        if (!(fabsf(got - dsink_heads[h]) <= 1e-4f * (1.0f + fabsf(got))) ||
            got == 0.0f)
            fail_msg("dL/d sinks[%lld]: module %g, heads %g", (long long)h,
                     (double)got, (double)dsink_heads[h]);
    }
    /* Pruning keeps the kept heads' slopes and sinks: head 2 alone equals
     * the module with head masks (0, 0, 1). */
    const int64_t keep[1] = {2};
    mha_module *pr;
    assert_int_equal(mha_prune_heads(m, keep, 1, &pr), MHA_OK);
    const float hm[3] = {0.0f, 0.0f, 1.0f};
    f.head_mask = hm;
    assert_int_equal(mha_forward(m, &f), MHA_OK);
    f.head_mask = NULL;
    f.out = y;
    assert_int_equal(mha_forward(pr, &f), MHA_OK);
    for (int64_t e = 0; e < n; e++)
        if (fabsf(out[e] - y[e]) > 1e-5f)
            fail_msg("pruned module %g vs head mask %g at %lld",
                     (double)y[e], (double)out[e], (long long)e);
    mha_free(pr);
    free(gp);
    free(wo);
    free(dctx);
    free(dq);
    free(dk);
    free(dv);
    free(x);
    free(out);
    free(q);
    free(k);
    free(v);
    free(ctx);
    free(y);
    free(g);
    mha_free(m);
}

/* The keys of add_bias_kv and add_zero_attn have no position: ALiBi and
 * the window leave them alone, so a module with ALiBi and a window equals
 * the same module with the equivalent (B, H, Lq, Lk) additive mask, which
 * covers the real keys only (bitwise on the flash tiers). */
static void test_extra_keys_have_no_position(void **state)
{
    (void)state;
    const int64_t B = 1, L = 70, E = 16, H = 2;
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.add_bias_kv = 1;
    cfg.add_zero_attn = 1;
    cfg.mods.alibi = 1;
    cfg.mods.window = 1;
    cfg.mods.window_left = 9;
    cfg.mods.window_right = 4;
    mha_module *m = tu_module(&cfg, 8);
    assert_non_null(m);
    mha_config plain = cfg;
    plain.mods = (mha_modifiers){0};
    mha_module *p = tu_module(&plain, 8);   /* the same parameters */
    assert_non_null(p);
    float slopes[2];
    assert_int_equal(mha_alibi_slopes(H, slopes), MHA_OK);
    float *add = malloc((size_t)(H * L * L) * 4);
    for (int64_t h = 0; h < H; h++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t j = 0; j < L; j++) {
                const int64_t d = i - j;
                add[(h * L + i) * L + j] =
                    j < i - 9 || j > i + 4 ? -INFINITY
                                           : -(slopes[h] *
                                               (float)(d < 0 ? -d : d));
            }
    float *x = malloc((size_t)(B * L * E) * 4);
    float *y1 = malloc((size_t)(B * L * E) * 4);
    float *y2 = malloc((size_t)(B * L * E) * 4);
    tu_fill(x, B * L * E, 2, -1.0f, 1.0f);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.out = y1;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.out = y2;
    a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 4, {1, H, L, L}};
    assert_int_equal(mha_forward(p, &a), MHA_OK);
    double err = 0.0;
    for (int64_t e = 0; e < B * L * E; e++)
        err = fmax(err, fabs((double)y1[e] - y2[e]));
    if (strcmp(mha_kernel_tier(), "ref") ? err != 0.0 : !(err <= 1e-5))
        fail_msg("modifiers vs their mask, with extra keys: %.3g", err);
    free(add);
    free(x);
    free(y1);
    free(y2);
    mha_free(m);
    mha_free(p);
}

/* ---- the default slopes --------------------------------------------------- */

/* The paper's code, in C: get_slopes(n). */
/* A forward of a slice of the query rows (mha_forward_args.q_start,
 * q_total) computes those rows of the whole problem: everything that
 * depends on a query's index (top-left and bottom-right causal, ALiBi,
 * the window, RoPE, the dropout draw) reads q_start + i.  Slices of every
 * size, covering the rows, give the whole forward's output and weights
 * up to float rounding (the GEMMs' blocks and the kernels' tiles follow
 * the number of rows: a misplaced position moves a weight by far more);
 * the misuses are refused. */
static double max_diff(const float *x, const float *y, int64_t n)
{
    double d = 0.0;
    for (int64_t k = 0; k < n; k++)
        d = fmax(d, fabs((double)x[k] - (double)y[k]));
    return d;
}

/* The first row of the slice of n rows after the one at i0: one-row
 * slices at every fifth row and the last (each a forward of its own:
 * every row took minutes under valgrind); wider slices cover every row. */
static int64_t next_slice(int64_t i0, int64_t n, int64_t Lq)
{
    if (n > 1 || i0 == Lq - 1)
        return i0 + n;
    return i0 + 5 < Lq ? i0 + 5 : Lq - 1;
}

static void slices_match(const mha_module *m, mha_forward_args whole,
                         const char *what, int64_t E, int64_t H, int64_t Lt)
{
    const int64_t Lq = whole.q_len;
    float *out = malloc((size_t)(Lq * E) * 4);
    float *w = malloc((size_t)(H * Lq * Lt) * 4);
    whole.out = out;
    whole.need_weights = MHA_WEIGHTS_PER_HEAD;
    whole.attn_weights = w;
    if (mha_forward(m, &whole) != MHA_OK)
        fail_msg("%s: %s", what, mha_last_error());
    double mx = 0.0;
    for (int64_t e = 0; e < Lq * E; e++)
        mx = fmax(mx, fabs((double)out[e]));
    const int64_t sizes[4] = {1, 7, 64, 100};
    for (int k = 0; k < 4; k++) {
        const int64_t n = sizes[k];
        float *so = malloc((size_t)(n * E) * 4);
        float *sw = malloc((size_t)(H * n * Lt) * 4);
        double d_out = 0.0, d_w = 0.0;
        for (int64_t i0 = 0; i0 < Lq; i0 = next_slice(i0, n, Lq)) {
            const int64_t nq = Lq - i0 < n ? Lq - i0 : n;
            mha_forward_args a = whole;
            a.query = whole.query + i0 * E;
            a.q_len = nq;
            a.q_start = i0;
            a.q_total = Lq;
            a.out = so;
            a.attn_weights = sw;
            if (mha_forward(m, &a) != MHA_OK)
                fail_msg("%s, slice %lld+%lld: %s", what, (long long)i0,
                         (long long)nq, mha_last_error());
            d_out = fmax(d_out, max_diff(so, out + i0 * E, nq * E));
            for (int64_t h = 0; h < H; h++)
                d_w = fmax(d_w, max_diff(sw + h * nq * Lt,
                                         w + (h * Lq + i0) * Lt, nq * Lt));
        }
        if (!(d_out <= 1e-5 * (1.0 + mx)) || !(d_w <= 1e-5))
            fail_msg("%s, slices of %lld rows: the outputs differ from the "
                     "whole forward's by %.3g, the weights by %.3g", what,
                     (long long)n, d_out, d_w);
        free(so);
        free(sw);
    }
    free(out);
    free(w);
}

static void test_query_slices(void **state)
{
    (void)state;
    const int64_t E = 32, H = 4;
    /* Lq != Lk, so that top-left and bottom-right differ; 1100 keys: the
     * short slices (<= 64 rows, no dropout) take the decoding kernel,
     * which splits the keys in chunks of 512, as the whole does not. */
    const int64_t Lq = 150, Lk = 1100;
    float *x = malloc((size_t)(Lq * E) * 4), *y = malloc((size_t)(Lk * E) * 4);
    tu_fill(x, Lq * E, 10, -1.0f, 1.0f);
    tu_fill(y, Lk * E, 11, -1.0f, 1.0f);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.query = x;
    a.key = y;
    mha_module *m = NULL;
    /* Every modifier, then without the window (which, aligned bottom-
     * right, leaves top-left causal rows no key when Lk > Lq). */
    for (int win = 1; win >= 0; win--) {
        mha_config cfg = {0};
        cfg.embed_dim = E;
        cfg.num_heads = H;
        cfg.num_kv_heads = 2;
        cfg.mods.softcap = 2.5f;
        cfg.mods.alibi = 1;
        cfg.mods.window = win;
        cfg.mods.window_left = win ? 40 : 0;
        cfg.mods.window_right = win ? 3 : 0;
        cfg.mods.rope.style = MHA_ROPE_NEOX;
        cfg.sinks = 1;
        cfg.dropout = 0.25f;
        mha_free(m);
        m = tu_module(&cfg, 8);
        assert_non_null(m);
        const mha_causal kinds[3] = {MHA_CAUSAL_NONE, MHA_CAUSAL_TOP_LEFT,
                                     MHA_CAUSAL_BOTTOM_RIGHT};
        for (int k = 0; k < 3; k++)
            for (int train = 0; train < 2; train++) {
                char what[80];
                snprintf(what, sizeof what, "window %d, causal kind %d, "
                         "training %d", win, (int)kinds[k], train);
                a.causal = kinds[k];
                a.training = train;
                a.dropout_seed = 77;
                slices_match(m, a, what, E, H, mha_total_keys(m, Lk));
            }
    }

    /* Misuse: named, refused. */
    float *out = malloc((size_t)(Lq * E) * 4);
    a.out = out;
    a.q_len = 10;
    a.q_total = 0;
    a.q_start = 3;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "q_total");
    a.q_total = 12;
    assert_fails(mha_forward(m, &a), MHA_ERR_SHAPE, "q_start=3");
    a.q_start = -1;
    assert_fails(mha_forward(m, &a), MHA_ERR_SHAPE, "q_total=12");
    a.q_start = 2;
    a.key = NULL;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "key given");
    a.key = x;      /* the query itself, kv_len 0: the slice's own rows */
    a.kv_len = 0;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "kv_len >= 1");
    a.key = y;
    a.kv_len = Lk;
    /* the one-shot backward refuses before it runs a forward */
    float *gq = calloc((size_t)(10 * E), 4), *dy0 = calloc((size_t)(10 * E), 4);
    mha_backward_args g0 = {0};
    g0.grad_out = dy0;
    g0.grad_query = gq;
    assert_fails(mha_backward(m, &a, &g0), MHA_ERR_INVALID_ARGUMENT, "slice");
    free(gq);
    free(dy0);
    /* a sliced forward has no backward */
    mha_plan *plan;
    assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
    assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
    float *dy = calloc((size_t)(10 * E), 4);
    mha_backward_args g = {0};
    g.grad_out = dy;
    assert_fails(mha_plan_backward(plan, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "slice");
    mha_plan_free(plan);
    free(dy);
    free(out);
    free(x);
    free(y);
    mha_free(m);
}

static void paper_slopes(int64_t n, double *out)
{
    const double l2 = log2((double)n);
    if (l2 == floor(l2)) {
        const double start = pow(2.0, -pow(2.0, -(l2 - 3.0)));
        for (int64_t i = 0; i < n; i++)
            out[i] = start * pow(start, (double)i);
        return;
    }
    const int64_t p2 = (int64_t)pow(2.0, floor(l2));
    paper_slopes(p2, out);
    double *twice = malloc((size_t)(2 * p2) * sizeof *twice);
    paper_slopes(2 * p2, twice);
    for (int64_t i = 0; i < n - p2; i++)
        out[p2 + i] = twice[2 * i];   /* [0::2][:n - p2] */
    free(twice);
}

static void test_alibi_slopes(void **state)
{
    (void)state;
    for (int64_t H = 1; H <= 70; H++) {
        float got[70];
        double want[70];
        assert_int_equal(mha_alibi_slopes(H, got), MHA_OK);
        paper_slopes(H, want);
        for (int64_t h = 0; h < H; h++)
            if (!(fabs(got[h] - want[h]) <= 1e-7 * want[h]))
                fail_msg("H = %lld: slope %lld is %.9g, the paper's %.9g",
                         (long long)H, (long long)h, (double)got[h], want[h]);
    }
    assert_fails(mha_alibi_slopes(0, (float[1]){0}), MHA_ERR_INVALID_ARGUMENT,
                 "num_heads");
    assert_fails(mha_alibi_slopes(4, NULL), MHA_ERR_NULL_POINTER, "NULL");
}

/* ---- bad settings ------------------------------------------------------------ */

static void test_bad_settings(void **state)
{
    (void)state;
    prob p;
    prob_init(&p, &CASES[0], 1);
    const float bad_caps[3] = {-1.0f, NAN, INFINITY};
    for (int k = 0; k < 3; k++) {
        p.a.mods.softcap = bad_caps[k];
        assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT, "softcap");
    }
    p.a.mods.softcap = 0.0f;
    p.a.mods.window = 1;
    p.a.mods.window_left = -2;
    assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT, "window");
    p.a.mods.window_left = 3;
    p.a.mods.window_right = -7;
    assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT, "-7");
    p.a.mods.window = 0;
    p.a.mods.window_left = p.a.mods.window_right = 0;
    p.a.mods.alibi = 1;
    p.slopes[1] = NAN;
    p.a.mods.alibi_slopes = p.slopes;
    assert_fails(mha_attention(&p.a), MHA_ERR_NON_FINITE, "alibi_slopes[1]");
    p.a.mods.alibi = 0;
    p.a.mods.alibi_slopes = NULL;
    p.sinks[0] = -INFINITY;
    p.a.sinks = p.sinks;
    assert_fails(mha_attention(&p.a), MHA_ERR_NON_FINITE, "sinks[0]");
    p.a.sinks = NULL;
    p.a.attention_chunk = -1;
    assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT,
                 "attention_chunk");
    p.a.attention_chunk = 0;
    /* grad_sinks with no sinks */
    p.a.sinks = NULL;
    float *g = calloc((size_t)p.nq, 4), *dq = malloc((size_t)p.nq * 4);
    float *dk = malloc((size_t)p.nk * 4), *dv = malloc((size_t)p.nk * 4);
    float ds[2];
    const mha_attention_grads gr = {g, dq, dk, dv, ds};
    assert_fails(mha_attention_backward(&p.a, &gr), MHA_ERR_INVALID_ARGUMENT,
                 "grad_sinks");
    /* The module's config */
    mha_config c = {0};
    c.embed_dim = 8;
    c.num_heads = 2;
    c.mods.softcap = -3.0f;
    mha_module *m = NULL;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_ARGUMENT, "softcap");
    assert_null(m);
    c.mods.softcap = 0.0f;
    c.mods.window = 1;
    c.mods.window_left = -5;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_ARGUMENT, "window");
    /* bounds with no window, slopes with no ALiBi: fields nothing reads */
    c.mods.window = 0;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_ARGUMENT,
                 "window is 0");
    c.mods.window_left = 0;
    const float finite[2] = {0.5f, 0.25f};
    c.mods.alibi_slopes = finite;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_ARGUMENT,
                 "alibi is 0");
    c.mods.alibi = 1;
    const float slopes[2] = {0.5f, INFINITY};
    c.mods.alibi_slopes = slopes;
    assert_fails(mha_create(&c, &m), MHA_ERR_NON_FINITE, "alibi_slopes[1]");
    c.mods.alibi = 0;
    c.mods.alibi_slopes = NULL;
    c.attention_chunk = INT64_MIN;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_ARGUMENT,
                 "attention_chunk");
    assert_null(m);
    c.attention_chunk = 0;
    /* a module's sinks are a parameter: set finite only */
    c.mods.alibi = 0;
    c.mods.alibi_slopes = NULL;
    c.sinks = 1;
    assert_int_equal(mha_create(&c, &m), MHA_OK);
    const float bad[2] = {0.0f, NAN};
    assert_fails(mha_param_set(m, "sinks", bad, 2), MHA_ERR_NON_FINITE,
                 "sinks");
    mha_free(m);
    free(g);
    free(dq);
    free(dk);
    free(dv);
    prob_free(&p);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_forward_vs_reference),
        cmocka_unit_test(test_modifiers_act),
        cmocka_unit_test(test_alibi_and_window_as_masks),
        cmocka_unit_test(test_gradients),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_module_decodes),
        cmocka_unit_test(test_module_chunk_decodes),
        cmocka_unit_test(test_module_matches_heads),
        cmocka_unit_test(test_extra_keys_have_no_position),
        cmocka_unit_test(test_query_slices),
        cmocka_unit_test(test_alibi_slopes),
        cmocka_unit_test(test_bad_settings),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
