/*
 * test_backward.c -- mha_backward and mha_plan_backward: every gradient
 * (query, key, value and every parameter element) against float64 central
 * differences of the reference forward, on small random configurations
 * covering every option; fully masked rows; accumulate; bitwise identical
 * gradients for 1, 2 and 4 threads and for plan and one-shot calls; the
 * errors.  Run once per kernel tier (MHA_ISA) by CTest.
 *
 * The loss is L = sum(out * G) for a random G, so grad_out = G and the
 * exact gradient of an input x is dL/dx of the float64 reference forward
 * (tests/support/ref_impl.h, which applies dropout with mha_dropout_keep as
 * mha.h documents).  It is estimated by a central difference
 *
 *     g_fd = (L(x + d1) - L(x - d2)) / (d1 + d2)
 *
 * where x + d1 and x - d2 are x +- FD_STEP rounded to float (inputs and
 * parameters are float): the denominator is the exact distance between the
 * two points, evaluated in double.
 *
 * The bound, per tensor: max |g - g_fd| <= GRAD_TOL * (1 + max |g_fd|).
 *   - g_fd's own error: the truncation term h^2/6 |L'''| ~ 2e-7 |L'''|
 *     (h = 1e-3, L''' of order 1 on these inputs) plus float64
 *     cancellation ~ 1e-16 |L| / h ~ 1e-12: ~1e-7 or less.
 *   - g's own error: about four stages of float32 arithmetic (the output
 *     projection, the attention, the input projections), each a sum of at
 *     most ~10 products (E <= 8, B * L <= 10, Lt <= 7), so at most
 *     ~10 * 2^-24 = 6e-7 of the magnitudes summed per stage; with those
 *     magnitudes a few times max |g| (cancellation in the softmax's
 *     P (dP - delta)), a worst case of ~1e-5 (1 + max |g|).
 * GRAD_TOL = 5e-5 is 5x that worst case; the errors measured in every
 * tier are below 5e-7, 1/100 of the bound.  Yet a gradient wrong by 1% in
 * any element larger than 0.5% of (1 + max |g|) fails:
 * test_checker_is_sensitive shows it on a real case.
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

#define FD_STEP 1e-3
#define GRAD_TOL 5e-5

/* How a test case builds a mask: kind, rank, and which of the batch and
 * head dimensions are 1 (broadcast). */

/* How query, key and value are passed. */
typedef enum inputs {
    SELF = 0,    /* key = value = NULL: one tensor, grad_query is the sum */
    CROSS = 1,   /* three separate buffers */
    KV_SAME = 2, /* key == value as pointers: still two inputs */
    ALL_SAME = 3,/* query == key == value as pointers: three inputs */
    V_NULL = 4   /* value = NULL: the key is also the value, grad_key is
                    the sum */
} inputs;

typedef struct bwd_case {
    const char *name;
    int64_t E, H, kdim, vdim;
    int no_bias, bias_kv, zero_attn;
    float scale, dropout;
    int64_t B, Lq, Lk;
    inputs in;
    tu_mask_spec attn, pad;
    int lengths;        /* pass key_lengths */
    mha_causal causal;
    int64_t head_dim;   /* 0: E / H */
    int head_mask;      /* pass a head mask (else grad_head_mask is at 1) */
    int64_t kv_heads;   /* grouped-query attention; 0: H */
    int64_t v_head_dim; /* d_v; 0: d_h */
} bwd_case;

#define ALLOW MHA_MASK_ALLOW
#define BLOCK MHA_MASK_BLOCK
#define ADD MHA_MASK_ADDITIVE
#define BR MHA_CAUSAL_BOTTOM_RIGHT
#define TL MHA_CAUSAL_TOP_LEFT

static const bwd_case CASES[] = {
    /* name                  E  H kd vd nb bkv za scale  drop  B Lq Lk in attn pad len causal head_dim head_mask H_kv d_v */
    {"self plain",           8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 5, 0, SELF, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"self one head",        4, 1, 0, 0, 0, 0, 0, 0,     0,    1, 4, 0, SELF, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"self four heads",      8, 4, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {ALLOW, 2, 0, 0}, {0}, 0, BR, 0, 0, 0, 0},
    {"cross kdim5 vdim3",    8, 2, 5, 3, 0, 0, 0, 0,     0,    2, 3, 5, CROSS, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"key == value pointer", 8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 3, KV_SAME, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"q == k == v pointer",  8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 4, ALL_SAME, {BLOCK, 2, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"bias off",             8, 2, 0, 0, 1, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"add_bias_kv",          8, 2, 0, 0, 0, 1, 0, 0,     0,    2, 3, 4, CROSS, {BLOCK, 2, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"add_zero_attn",        8, 2, 0, 0, 0, 0, 1, 0,     0,    2, 4, 0, SELF, {0}, {ALLOW, 2, 0, 0}, 0, 0, 0, 0, 0, 0},
    {"bias off + extras",    8, 4, 3, 5, 1, 1, 1, 0,     0,    2, 3, 4, CROSS, {0}, {0}, 0, TL, 0, 0, 0, 0},
    {"allow (Lq,Lk)",        8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 5, 0, SELF, {ALLOW, 2, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"block (B,Lq,Lk)",      8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 5, CROSS, {BLOCK, 3, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"block (1,Lq,Lk)",      8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {BLOCK, 3, 1, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"additive (B,H,Lq,Lk)", 8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {ADD, 4, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"additive (B,1,Lq,Lk)", 8, 4, 0, 0, 0, 0, 0, 0,     0,    2, 3, 5, CROSS, {ADD, 4, 0, 1}, {0}, 0, 0, 0, 0, 0, 0},
    {"additive (Lq,Lk)",     8, 2, 6, 8, 0, 0, 0, 0,     0,    2, 4, 3, CROSS, {ADD, 2, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"pad block (B,Lk)",     8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 3, 5, CROSS, {0}, {BLOCK, 2, 0, 0}, 0, 0, 0, 0, 0, 0},
    {"pad allow (Lk)",       8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {ALLOW, 1, 0, 0}, 0, 0, 0, 0, 0, 0},
    {"pad additive (1,Lk)",  8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {ADD, 2, 1, 0}, 0, 0, 0, 0, 0, 0},
    {"key lengths",          8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 3, 5, CROSS, {0}, {0}, 1, 0, 0, 0, 0, 0},
    {"value NULL",           8, 2, 5, 5, 0, 0, 0, 0,     0,    2, 3, 4, V_NULL, {0}, {BLOCK, 2, 0, 0}, 0, 0, 0, 0, 0, 0},
    {"causal Lq = Lk",       8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 5, 0, SELF, {0}, {0}, 0, BR, 0, 0, 0, 0},
    {"causal BR Lq < Lk",    8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 2, 5, CROSS, {0}, {0}, 0, BR, 0, 0, 0, 0},
    {"causal BR Lq > Lk",    8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 5, 2, CROSS, {0}, {0}, 0, BR, 0, 0, 0, 0},
    {"causal TL Lq < Lk",    8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 2, 5, CROSS, {0}, {0}, 0, TL, 0, 0, 0, 0},
    {"causal TL Lq > Lk",    8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 5, 3, KV_SAME, {0}, {0}, 0, TL, 0, 0, 0, 0},
    {"custom scale",         8, 2, 0, 0, 0, 0, 0, 0.9f,  0,    2, 4, 0, SELF, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"negative scale",       8, 2, 0, 0, 0, 0, 0, -0.3f, 0,    2, 4, 0, SELF, {ADD, 2, 0, 0}, {0}, 0, 0, 0, 0, 0, 0},
    {"dropout 0.3",          8, 2, 0, 0, 0, 0, 0, 0,     0.3f, 2, 5, 0, SELF, {0}, {0}, 0, 0, 0, 0, 0, 0},
    {"dropout + masks",      8, 2, 0, 0, 0, 0, 0, 0,     0.4f, 2, 4, 5, CROSS, {ALLOW, 3, 0, 0}, {BLOCK, 2, 0, 0}, 0, BR, 0, 0, 0, 0},
    {"dropout + extras",     8, 2, 5, 3, 0, 1, 1, 0,     0.5f, 2, 3, 4, CROSS, {0}, {0}, 1, 0, 0, 0, 0, 0},
    {"everything",           8, 2, 3, 5, 0, 1, 1, 0.7f,  0.2f, 2, 4, 5, CROSS, {BLOCK, 4, 0, 1}, {ADD, 2, 0, 0}, 1, BR, 0, 0, 0, 0},
    /* Heads narrower or wider than E / H (pruned modules) and head masks
     * (with a 0: an ablated head, and negative and fractional factors). */
    {"head mask",            8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {0}, 0, BR, 0, 1, 0, 0},
    {"head mask cross",      8, 4, 5, 3, 0, 0, 0, 0,     0.2f, 2, 3, 4, CROSS, {ADD, 2, 0, 0}, {0}, 0, 0, 0, 1, 0, 0},
    {"head_dim 3, D < E",    8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {BLOCK, 2, 0, 0}, 0, 0, 3, 0, 0, 0},
    {"head_dim 4, D > E",    6, 2, 0, 0, 0, 0, 0, 0,     0,    2, 3, 4, KV_SAME, {0}, {0}, 0, TL, 4, 1, 0, 0},
    {"head_dim + extras",    8, 3, 5, 3, 0, 1, 1, 0,     0,    2, 3, 4, CROSS, {0}, {0}, 1, 0, 2, 1, 0, 0},
    {"head_dim, no bias",    8, 3, 0, 0, 1, 0, 0, 0,     0,    2, 4, 0, V_NULL, {0}, {0}, 0, BR, 2, 1, 0, 0},
    /* Grouped-query and multi-query attention (the last field: H_kv):
     * dk, dv and the K/V weights' gradients summed over each group. */
    {"GQA 4/2 self",         8, 4, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {0}, 0, BR, 0, 0, 2, 0},
    {"MQA 4/1 cross",        8, 4, 5, 3, 0, 1, 1, 0,     0,    2, 3, 5, CROSS, {ADD, 4, 0, 0}, {BLOCK, 2, 0, 0}, 1, 0, 0, 0, 1, 0},
    {"GQA 6/2 dropout, k==v",12, 6, 0, 0, 0, 0, 0, 0,    0.3f, 2, 3, 4, KV_SAME, {0}, {0}, 0, TL, 0, 1, 2, 0},
    {"GQA value NULL",       8, 4, 5, 5, 0, 0, 0, 0,     0,    2, 3, 4, V_NULL, {0}, {0}, 0, 0, 0, 0, 2, 0},
    /* Values d_v wide beside keys d_h wide (the last field: d_v): every
     * value-side parameter (v rows, bias_v, out_proj's columns) sized by
     * d_v. */
    {"d_v 6 > d_h 4 self",   8, 2, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, SELF, {0}, {0}, 0, BR, 0, 0, 0, 6},
    {"d_v 3, extras, mask",  8, 2, 5, 3, 0, 1, 1, 0,     0.2f, 2, 3, 4, CROSS, {ADD, 2, 0, 0}, {0}, 1, 0, 0, 1, 0, 3},
    {"d_v 2, d_h 3, GQA 4/2",8, 4, 0, 0, 0, 0, 0, 0,     0,    2, 4, 0, ALL_SAME, {0}, {BLOCK, 2, 0, 0}, 0, BR, 3, 1, 2, 2},
    {"d_v 5, MQA, value NULL",8, 2, 5, 5, 0, 0, 0, 0,    0,    2, 3, 4, V_NULL, {0}, {0}, 0, TL, 0, 0, 1, 5},
};

static float *fmalloc(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    assert_non_null(p);
    return p;
}

static double *dmalloc(int64_t n)
{
    double *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    assert_non_null(p);
    return p;
}

static void fill_nan(float *x, int64_t n)
{
    for (int64_t k = 0; k < n; k++)
        x[k] = NAN;
}

static int all_finite(const float *x, int64_t n)
{
    for (int64_t k = 0; k < n; k++)
        if (!isfinite(x[k]))
            return 0;
    return 1;
}

/* ---- the central differences -------------------------------------------- */

/* The float64 loss sum(out * G) of the reference forward. */
typedef struct loss_fn {
    mha_module *m;
    const mha_forward_args *a;
    const float *G;
    int64_t n_out;
    double *out64;
} loss_fn;

static double loss(const loss_fn *f)
{
    assert_int_equal(ref_forward_f64(f->m, f->a, f->out64, NULL), 0);
    double s = 0;
    for (int64_t k = 0; k < f->n_out; k++)
        s += f->out64[k] * (double)f->G[k];
    return s;
}

/* x +- FD_STEP, rounded to float; the step actually taken is exact. */
static void fd_points(float x0, float *xp, float *xm)
{
    *xp = (float)((double)x0 + FD_STEP);
    *xm = (float)((double)x0 - FD_STEP);
}

/* dL/dx[k] for every element of an input buffer the forward reads. */
static void fd_input(const loss_fn *f, float *x, int64_t n, double *g)
{
    for (int64_t k = 0; k < n; k++) {
        const float x0 = x[k];
        float xp, xm;
        fd_points(x0, &xp, &xm);
        x[k] = xp;
        const double lp = loss(f);
        x[k] = xm;
        const double lm = loss(f);
        x[k] = x0;
        g[k] = (lp - lm) / ((double)xp - (double)xm);
    }
}

/* dL/dp for every element of parameter `info`, through mha_param_set. */
static void fd_param(const loss_fn *f, const mha_param_info *info, double *g)
{
    float *p = fmalloc(info->numel);
    assert_int_equal(mha_param_get(f->m, info->name, p, info->numel), MHA_OK);
    for (int64_t k = 0; k < info->numel; k++) {
        const float x0 = p[k];
        float xp, xm;
        fd_points(x0, &xp, &xm);
        p[k] = xp;
        assert_int_equal(mha_param_set(f->m, info->name, p, info->numel),
                         MHA_OK);
        const double lp = loss(f);
        p[k] = xm;
        assert_int_equal(mha_param_set(f->m, info->name, p, info->numel),
                         MHA_OK);
        const double lm = loss(f);
        p[k] = x0;
        g[k] = (lp - lm) / ((double)xp - (double)xm);
    }
    assert_int_equal(mha_param_set(f->m, info->name, p, info->numel), MHA_OK);
    free(p);
}

/* The error of g against g_fd, as a fraction of the bound (> 1: fails);
 * *worst receives the element where it is largest. */
static double grad_error(const float *g, const double *fd, int64_t n,
                         int64_t *worst)
{
    const double bound = GRAD_TOL * (1.0 + ref_max_abs(fd, n));
    double e = 0;
    *worst = 0;
    for (int64_t k = 0; k < n; k++) {
        double d = fabs((double)g[k] - fd[k]);
        if (isnan(d) || !isfinite(g[k])) {
            *worst = k;
            return INFINITY;
        }
        if (d > e) {
            e = d;
            *worst = k;
        }
    }
    return e / bound;
}

static void expect_grad(const char *cname, const char *what, const float *g,
                        const double *fd, int64_t n)
{
    int64_t k;
    const double r = grad_error(g, fd, n, &k);
    if (!(r <= 1.0))
        fail_msg("%s: d/d %s[%lld] = %.9g, central difference %.9g: error "
                 "%.3g > bound %.3g (max |g_fd| %.3g)",
                 cname, what, (long long)k, (double)g[k], fd[k],
                 fabs((double)g[k] - fd[k]),
                 GRAD_TOL * (1.0 + ref_max_abs(fd, n)), ref_max_abs(fd, n));
}

/* ---- one configuration --------------------------------------------------- */

typedef struct problem {
    mha_module *m;
    mha_config rc;
    int64_t B, Lq, Lk, E, H;
    int64_t n_q, n_k, n_v, n_out, n_par;
    float *q, *k, *v, *G;
    float hm[8];          /* the head mask, when the case has one */
    void *am, *pm;
    int64_t lengths[8];
    mha_forward_args a;   /* the analytic call's arguments */
} problem;

static void problem_init(problem *p, const bwd_case *c, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.kdim = c->kdim;
    cfg.vdim = c->vdim;
    cfg.no_bias = c->no_bias;
    cfg.add_bias_kv = c->bias_kv;
    cfg.add_zero_attn = c->zero_attn;
    cfg.scale = c->scale;
    cfg.dropout = c->dropout;
    cfg.head_dim = c->head_dim;
    cfg.num_kv_heads = c->kv_heads;
    cfg.v_head_dim = c->v_head_dim;
    p->m = tu_module(&cfg, seed);
    assert_non_null(p->m);
    assert_int_equal(mha_get_config(p->m, &p->rc), MHA_OK);
    /* Random factors in [-1.5, 1.5], and head 1 ablated. */
    assert_true(c->H <= 8);
    tu_fill(p->hm, c->H, seed + 7, -1.5f, 1.5f);
    p->hm[1 % c->H] = 0.0f;
    p->B = c->B;
    p->Lq = c->Lq;
    p->Lk = c->Lk ? c->Lk : c->Lq;
    p->E = c->E;
    p->H = c->H;
    p->n_q = p->B * p->Lq * p->E;
    p->n_k = p->B * p->Lk * p->rc.kdim;
    p->n_v = p->B * p->Lk * p->rc.vdim;
    p->n_out = p->n_q;
    p->n_par = mha_param_numel(p->m);
    assert_true(p->n_par > 0);
    /* ALL_SAME: one buffer read as query, key and value (Lq = Lk). */
    p->q = fmalloc(p->n_q > p->n_k ? p->n_q : p->n_k);
    p->k = fmalloc(p->n_k);
    p->v = fmalloc(p->n_v);
    p->G = fmalloc(p->n_out);
    tu_fill(p->q, p->n_q, seed + 1, -1.0f, 1.0f);
    tu_fill(p->k, p->n_k, seed + 2, -1.0f, 1.0f);
    tu_fill(p->v, p->n_v, seed + 3, -1.0f, 1.0f);
    tu_fill(p->G, p->n_out, seed + 6, -1.0f, 1.0f);
    for (int64_t b = 0; b < p->B; b++)
        p->lengths[b] = (p->Lk * (b + 1)) / (p->B + 1) + 1;

    mha_forward_args *a = &p->a;
    a->batch = p->B;
    a->q_len = p->Lq;
    a->kv_len = p->Lk;   /* said even when it is Lq: a key is given */
    a->query = p->q;
    switch (c->in) {
    case SELF: break;
    case CROSS: a->key = p->k; a->value = p->v; break;
    case KV_SAME: a->key = a->value = p->k; break;
    case ALL_SAME: a->key = a->value = p->q; break;
    case V_NULL: a->key = p->k; break;
    }
    p->am = tu_make_mask(&c->attn, p->B, p->H, p->Lq, p->Lk, 1, seed + 4,
                      &a->attn_mask);
    p->pm = tu_make_mask(&c->pad, p->B, p->H, p->Lq, p->Lk, 0, seed + 5,
                      &a->key_padding_mask);
    a->key_lengths = c->lengths ? p->lengths : NULL;
    a->causal = c->causal;
    a->training = c->dropout > 0;
    a->dropout_seed = seed * 7 + 3;
    a->head_mask = c->head_mask ? p->hm : NULL;
}

static void problem_free(problem *p)
{
    free(p->q); free(p->k); free(p->v); free(p->G);
    free(p->am); free(p->pm);
    mha_free(p->m);
}

/* Analytic gradients of a problem (NULL where not wanted). */
typedef struct grads {
    float *q, *k, *v, *par, *hm;
} grads;

static grads grads_alloc(const problem *p, int key_grad, int value_grad)
{
    grads g = {fmalloc(p->n_q), key_grad ? fmalloc(p->n_k) : NULL,
               value_grad ? fmalloc(p->n_v) : NULL, fmalloc(p->n_par),
               fmalloc(p->H)};
    return g;
}

static void grads_free(grads *g)
{
    free(g->q); free(g->k); free(g->v); free(g->par); free(g->hm);
}

static mha_backward_args bwd_args(const problem *p, grads *g, int accumulate)
{
    mha_backward_args b = {0};
    b.grad_out = p->G;
    b.grad_query = g->q;
    b.grad_key = g->k;
    b.grad_value = g->v;
    b.grad_params = g->par;
    b.grad_head_mask = g->hm;
    b.accumulate = accumulate;
    return b;
}

static void run_backward(const problem *p, grads *g, const char *cname)
{
    /* accumulate = 0 overwrites whatever the buffers held */
    fill_nan(g->q, p->n_q);
    if (g->k) fill_nan(g->k, p->n_k);
    if (g->v) fill_nan(g->v, p->n_v);
    fill_nan(g->par, p->n_par);
    fill_nan(g->hm, p->H);
    mha_backward_args b = bwd_args(p, g, 0);
    if (mha_backward(p->m, &p->a, &b) != MHA_OK)
        fail_msg("%s: mha_backward: %s", cname, mha_last_error());
}

static void check_case(const bwd_case *c, uint64_t seed)
{
    problem p;
    problem_init(&p, c, seed);
    const int key_grad = c->in != SELF, value_grad = key_grad && c->in != V_NULL;
    grads g = grads_alloc(&p, key_grad, value_grad);
    run_backward(&p, &g, c->name);

    /* The differences run on private copies, so that key and value (or
     * query) sharing memory in the analytic call are still perturbed one
     * at a time. */
    float *fq = fmalloc(p.n_q), *fk = fmalloc(p.n_k), *fv = fmalloc(p.n_v);
    memcpy(fq, p.q, (size_t)p.n_q * sizeof *fq);
    memcpy(fk, p.a.key ? p.a.key : p.q, (size_t)p.n_k * sizeof *fk);
    memcpy(fv, p.a.value ? p.a.value : p.q, (size_t)p.n_v * sizeof *fv);
    mha_forward_args fa = p.a;
    fa.query = fq;
    fa.key = key_grad ? fk : NULL;
    fa.value = value_grad ? fv : NULL;
    fa.kv_len = p.Lk;   /* a copy of the query as key: its length, said */
    /* Without a head mask the gradient is at m = 1: differentiate there. */
    float fm[8];
    for (int64_t h = 0; h < p.H; h++)
        fm[h] = c->head_mask ? p.hm[h] : 1.0f;
    fa.head_mask = fm;
    loss_fn f = {p.m, &fa, p.G, p.n_out, dmalloc(p.n_out)};

    int64_t n_fd = p.n_par;
    if (p.n_q > n_fd) n_fd = p.n_q;
    if (p.n_k > n_fd) n_fd = p.n_k;
    if (p.n_v > n_fd) n_fd = p.n_v;
    double *fd = dmalloc(n_fd);
    fd_input(&f, fq, p.n_q, fd);
    expect_grad(c->name, key_grad ? "query" : "query (= key = value)", g.q,
                fd, p.n_q);
    if (key_grad) {
        fd_input(&f, fk, p.n_k, fd);
        expect_grad(c->name, value_grad ? "key" : "key (= value)", g.k, fd,
                    p.n_k);
    }
    if (value_grad) {
        fd_input(&f, fv, p.n_v, fd);
        expect_grad(c->name, "value", g.v, fd, p.n_v);
    }
    int64_t offset = 0;
    for (int i = 0; i < mha_param_count(p.m); i++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(p.m, i, &info), MHA_OK);
        assert_int_equal(info.offset, offset);   /* table order, packed */
        offset += info.numel;
        fd_param(&f, &info, fd);
        expect_grad(c->name, info.name, g.par + info.offset, fd, info.numel);
    }
    assert_int_equal(offset, p.n_par);
    fd_input(&f, fm, p.H, fd);
    expect_grad(c->name, "head_mask", g.hm, fd, p.H);

    free(fd); free(f.out64); free(fq); free(fk); free(fv);
    grads_free(&g);
    problem_free(&p);
}

static void test_gradients(void **state)
{
    (void)state;
    const size_t n = sizeof CASES / sizeof CASES[0];
    for (size_t i = 0; i < n; i++)
        check_case(&CASES[i], 1000 + 17 * i);
}

static const bwd_case *find_case(const char *name)
{
    for (size_t i = 0; i < sizeof CASES / sizeof CASES[0]; i++)
        if (!strcmp(CASES[i].name, name))
            return &CASES[i];
    fail_msg("no case \"%s\"", name);
    return NULL;
}

/* The check catches an error of 1% in one element: the analytic gradient
 * of a real case, with its largest parameter-gradient element scaled by
 * 1.01, is refused, and the unmodified one passes. */
static void test_checker_is_sensitive(void **state)
{
    (void)state;
    const bwd_case *c = &CASES[0];
    problem p;
    problem_init(&p, c, 1);
    grads g = grads_alloc(&p, 0, 0);
    run_backward(&p, &g, c->name);
    loss_fn f = {p.m, &p.a, p.G, p.n_out, dmalloc(p.n_out)};
    mha_param_info info;
    assert_int_equal(mha_param_info_by_name(p.m, "in_proj_weight", &info),
                     MHA_OK);
    double *fd = dmalloc(info.numel);
    fd_param(&f, &info, fd);
    float *gw = g.par + info.offset;
    int64_t k;
    assert_true(grad_error(gw, fd, info.numel, &k) <= 1.0);
    int64_t big = 0;
    for (int64_t j = 1; j < info.numel; j++)
        if (fabs(fd[j]) > fabs(fd[big]))
            big = j;
    gw[big] *= 1.01f;
    assert_true(grad_error(gw, fd, info.numel, &k) > 1.0);
    assert_int_equal(k, big);
    free(fd); free(f.out64);
    grads_free(&g);
    problem_free(&p);
}

/* ---- fully masked rows ----------------------------------------------------- */

static int row_is_zero(const float *x, int64_t n)
{
    for (int64_t k = 0; k < n; k++)
        if (x[k] != 0.0f)
            return 0;
    return 1;
}

/* Rows with no key to attend to contribute zero gradients: the query rows
 * of batch 1 with every key padded, the first Lq - Lk rows of a bottom-right
 * causal mask, an all -inf additive row, dropout p = 1.  Nothing is NaN. */
static void test_fully_masked_rows(void **state)
{
    (void)state;
    enum { E = 8, H = 2, B = 2, LQ = 5, LK = 3 };
    for (int how = 0; how < 4; how++)
        for (int no_bias = 0; no_bias <= 1; no_bias++) {
            mha_config cfg = {0};
            cfg.embed_dim = E;
            cfg.num_heads = H;
            cfg.no_bias = no_bias;
            cfg.dropout = how == 3 ? 1.0f : 0.0f;
            mha_module *m = tu_module(&cfg, 40 + how);
            assert_non_null(m);
            const int64_t np = mha_param_numel(m);
            float q[B * LQ * E], k[B * LK * E], v[B * LK * E];
            float G[B * LQ * E];
            float gq[B * LQ * E], gk[B * LK * E], gv[B * LK * E];
            float *gp = fmalloc(np);
            tu_fill(q, B * LQ * E, 1, -1, 1);
            tu_fill(k, B * LK * E, 2, -1, 1);
            tu_fill(v, B * LK * E, 3, -1, 1);
            tu_fill(G, B * LQ * E, 4, -1, 1);
            fill_nan(gq, B * LQ * E);
            fill_nan(gk, B * LK * E);
            fill_nan(gv, B * LK * E);
            fill_nan(gp, np);
            uint8_t pad[B * LK] = {0, 1, 0, 1, 1, 1};
            float add[LQ * LK] = {0};
            for (int j = 0; j < LK; j++)
                add[2 * LK + j] = -INFINITY;
            /* empty[b][i]: row i of batch b sees no key */
            int empty[B][LQ] = {{0}};
            mha_forward_args a = {0};
            a.batch = B;
            a.q_len = LQ;
            a.kv_len = LK;
            a.query = q;
            a.key = k;
            a.value = v;
            switch (how) {
            case 0:
                a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2,
                                                {B, LK}};
                for (int i = 0; i < LQ; i++)
                    empty[1][i] = 1;
                break;
            case 1:
                a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
                for (int b = 0; b < B; b++)
                    for (int i = 0; i < LQ - LK; i++)
                        empty[b][i] = 1;
                break;
            case 2:
                a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 2, {LQ, LK}};
                for (int b = 0; b < B; b++)
                    empty[b][2] = 1;
                break;
            case 3:
                a.training = 1;
                a.dropout_seed = 5;
                for (int b = 0; b < B; b++)
                    for (int i = 0; i < LQ; i++)
                        empty[b][i] = 1;
                break;
            }
            mha_backward_args bw = {.grad_out = G, .grad_query = gq, .grad_key = gk, .grad_value = gv, .grad_params = gp, .accumulate = 0, .grad_head_mask = NULL};
            if (mha_backward(m, &a, &bw) != MHA_OK)
                fail_msg("case %d: %s", how, mha_last_error());
            assert_true(all_finite(gq, B * LQ * E));
            assert_true(all_finite(gk, B * LK * E));
            assert_true(all_finite(gv, B * LK * E));
            assert_true(all_finite(gp, np));
            for (int b = 0; b < B; b++)
                for (int i = 0; i < LQ; i++)
                    if (empty[b][i] &&
                        !row_is_zero(gq + (b * LQ + i) * E, E))
                        fail_msg("case %d, no_bias %d: grad_query row (%d, "
                                 "%d) sees no key but is not zero",
                                 how, no_bias, b, i);
            if (how == 0 || how == 3) {
                /* no query attends to batch 1's keys (or to any key) */
                for (int b = how == 0 ? 1 : 0; b < B; b++) {
                    assert_true(row_is_zero(gk + b * LK * E, LK * E));
                    assert_true(row_is_zero(gv + b * LK * E, LK * E));
                }
            }
            if (how == 3) {
                /* every context is zero: only out_proj has a gradient */
                mha_param_info info;
                for (int t = 0; t < mha_param_count(m); t++) {
                    mha_param_info_at(m, t, &info);
                    if (strncmp(info.name, "out_proj.", 9) != 0)
                        assert_true(row_is_zero(gp + info.offset,
                                                info.numel));
                }
            }
            free(gp);
            mha_free(m);
        }
}

/* ---- accumulate, partial requests, what is not written ------------------ */

static void test_accumulate(void **state)
{
    (void)state;
    const bwd_case *c = find_case("everything");
    problem p;
    problem_init(&p, c, 3);
    grads g1 = grads_alloc(&p, 1, 1), g2 = grads_alloc(&p, 1, 1);
    run_backward(&p, &g1, c->name);

    /* twice with accumulate = 1 on a zeroed buffer: 2x; the input
     * gradients are overwritten each time, never accumulated */
    memset(g2.par, 0, (size_t)p.n_par * sizeof(float));
    memset(g2.hm, 0, (size_t)p.H * sizeof(float));
    for (int t = 0; t < 2; t++) {
        fill_nan(g2.q, p.n_q);
        fill_nan(g2.k, p.n_k);
        fill_nan(g2.v, p.n_v);
        mha_backward_args b = bwd_args(&p, &g2, 1);
        assert_int_equal(mha_backward(p.m, &p.a, &b), MHA_OK);
    }
    assert_memory_equal(g1.q, g2.q, (size_t)p.n_q * sizeof(float));
    assert_memory_equal(g1.k, g2.k, (size_t)p.n_k * sizeof(float));
    assert_memory_equal(g1.v, g2.v, (size_t)p.n_v * sizeof(float));
    /* the head mask's gradient is summed in float64 from the float32
     * value there (docs/semantics.md): the second call gives g1 + S rounded
     * once, S the float64 sum that g1 rounds; |S - g1| <= ulp(g1) / 2 is a
     * quarter ulp of 2 g1, so the result is 2 g1 exactly */
    for (int64_t h = 0; h < p.H; h++)
        assert_true(g2.hm[h] == 2.0f * g1.hm[h]);
    /* (the sums may be associated differently when the GEMM adds into
     * the buffer: equal to a few float32 roundings of each parameter's
     * largest gradient) */
    for (int t = 0; t < mha_param_count(p.m); t++) {
        mha_param_info info;
        mha_param_info_at(p.m, t, &info);
        const float *a2 = g2.par + info.offset, *a1 = g1.par + info.offset;
        float mx = 0;
        for (int64_t k = 0; k < info.numel; k++)
            mx = fmaxf(mx, fabsf(a1[k]));
        for (int64_t k = 0; k < info.numel; k++)
            if (!(fabsf(a2[k] - 2.0f * a1[k]) <= 1e-6f * (1 + 2 * mx)))
                fail_msg("accumulated twice: %s[%lld] = %.9g, expected "
                         "2 * %.9g", info.name, (long long)k, (double)a2[k],
                         (double)a1[k]);
    }

    /* accumulate = 1 adds to what is there */
    for (int64_t k = 0; k < p.n_par; k++)
        g2.par[k] = (float)(k % 7) - 3.0f;
    for (int64_t h = 0; h < p.H; h++)
        g2.hm[h] = (float)h - 1.5f;
    mha_backward_args b = bwd_args(&p, &g2, 1);
    assert_int_equal(mha_backward(p.m, &p.a, &b), MHA_OK);
    for (int64_t k = 0; k < p.n_par; k++) {
        const float want = ((float)(k % 7) - 3.0f) + g1.par[k];
        assert_true(fabsf(g2.par[k] - want) <= 1e-6f * (4 + fabsf(want)));
    }
    /* The head mask's: the library adds its float64 sum S to x and rounds
     * once, (float)(x + S); g1.hm is S rounded, so the contract ("summed in
     * float64", "accumulated") bounds the result's distance from x + g1.hm
     * by half an ulp of itself plus half an ulp of g1.hm: one float32
     * rounding of x + S.  ((float)(x + g1.hm) rounds twice and may differ
     * from it by an ulp.) */
    for (int64_t h = 0; h < p.H; h++) {
        const float x = (float)h - 1.5f, got = g2.hm[h], s1 = g1.hm[h];
        const double want = (double)x + (double)s1;
        const double bound =
            0.5 * ((double)nextafterf(fabsf(got), INFINITY) - fabsf(got)) +
            0.5 * ((double)nextafterf(fabsf(s1), INFINITY) - fabsf(s1));
        if (!(fabs((double)got - want) <= bound))
            fail_msg("grad_head_mask[%lld] accumulated onto %g: %.9g, "
                     "expected %g + %.9g within %.3g", (long long)h,
                     (double)x, (double)got, (double)x, (double)s1, bound);
    }

    /* Any subset of the outputs may be asked for, with the same values;
     * the forward's out and attn_weights are not written. */
    float *only = fmalloc(p.n_par);
    const int64_t n_w = p.B * p.H * p.Lq * mha_total_keys(p.m, p.Lk);
    float *canary = fmalloc(n_w > p.n_out ? n_w : p.n_out);
    float *canary2 = fmalloc(n_w > p.n_out ? n_w : p.n_out);
    tu_fill(canary, n_w > p.n_out ? n_w : p.n_out, 9, -1, 1);
    memcpy(canary2, canary, (size_t)(n_w > p.n_out ? n_w : p.n_out) * 4);
    mha_forward_args a = p.a;
    a.out = canary;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = canary;
    mha_backward_args bo = {0};
    bo.grad_out = p.G;
    bo.grad_params = only;
    assert_int_equal(mha_backward(p.m, &a, &bo), MHA_OK);
    assert_memory_equal(only, g1.par, (size_t)p.n_par * sizeof(float));
    assert_memory_equal(canary, canary2,
                        (size_t)(n_w > p.n_out ? n_w : p.n_out) * 4);
    bo.grad_params = NULL;
    bo.grad_value = g2.v;
    assert_int_equal(mha_backward(p.m, &a, &bo), MHA_OK);
    assert_memory_equal(g1.v, g2.v, (size_t)p.n_v * sizeof(float));
    bo.grad_value = NULL;
    bo.grad_key = g2.k;
    assert_int_equal(mha_backward(p.m, &a, &bo), MHA_OK);
    assert_memory_equal(g1.k, g2.k, (size_t)p.n_k * sizeof(float));
    bo.grad_key = NULL;
    bo.grad_query = g2.q;
    assert_int_equal(mha_backward(p.m, &a, &bo), MHA_OK);
    assert_memory_equal(g1.q, g2.q, (size_t)p.n_q * sizeof(float));
    bo.grad_query = NULL;
    bo.grad_head_mask = g2.hm;
    assert_int_equal(mha_backward(p.m, &a, &bo), MHA_OK);
    assert_memory_equal(g1.hm, g2.hm, (size_t)p.H * sizeof(float));
    bo.grad_head_mask = NULL;   /* nothing asked: nothing to do, still OK */
    assert_int_equal(mha_backward(p.m, &a, &bo), MHA_OK);

    free(only); free(canary); free(canary2);
    grads_free(&g1);
    grads_free(&g2);
    problem_free(&p);
}

/* ---- threads and plans: bitwise identical ----------------------------- */

typedef struct big_shape {
    const char *name;
    int64_t E, H, kdim, vdim, B, Lq, Lk;
    int cross, bias_kv, zero_attn, pad, lengths;
    mha_causal causal;
    float dropout;
    int64_t v_head_dim;   /* d_v; 0: d_h */
} big_shape;

/* The first two (and the last, values d_v wide) are above the 2^20
 * multiply-adds (B * H * Lq * Lt * d_h) under which the attention runs on
 * one thread whatever num_threads says; the third is a decoding shape, whose forward splits the keys in chunks
 * and merges the chunks' row statistics, which the backward then uses. */
static const big_shape BIG[] = {
    {"self, causal, padding, dropout", 32, 4, 0, 0, 2, 160, 0, 0, 0, 0, 1, 0,
     MHA_CAUSAL_BOTTOM_RIGHT, 0.2f, 0},
    {"cross, extras, lengths", 32, 4, 24, 40, 2, 120, 150, 1, 1, 1, 0, 1,
     MHA_CAUSAL_TOP_LEFT, 0, 0},
    {"decoding, split keys", 16, 2, 0, 0, 2, 2, 1100, 1, 1, 0, 1, 0,
     MHA_CAUSAL_BOTTOM_RIGHT, 0.1f, 0},
    {"d_v 12, extras, lengths", 32, 4, 24, 40, 2, 120, 150, 1, 1, 1, 0, 1,
     MHA_CAUSAL_BOTTOM_RIGHT, 0, 12},
};

typedef struct big_grads {
    float *q, *k, *v, *p;
} big_grads;

/* A few elements of each gradient against central differences: the
 * shapes here are too large to difference every element.  The sums are
 * ~100x longer than in the small cases (over ~1000 keys, ~300 rows), so
 * the bound per element is SPOT_TOL * (1 + |g_fd|), SPOT_TOL = 4 *
 * GRAD_TOL; the errors measured in every tier are below 4e-6 on
 * gradients up to 17 (relative 2e-7), 1/50 of the bound or less. */
#define SPOT_TOL (4 * GRAD_TOL)
static void spot_check(const char *name, mha_module *m,
                       const mha_forward_args *a, const float *G,
                       int64_t n_out, const big_grads *g, int64_t n_q,
                       int64_t n_k, int64_t n_v)
{
    enum { PER_TENSOR = 3 };
    float *q = fmalloc(n_q), *k = fmalloc(n_k), *v = fmalloc(n_v);
    const int cross = a->key != NULL;   /* else the query is all three */
    memcpy(q, a->query, (size_t)n_q * sizeof *q);
    memcpy(k, cross ? a->key : a->query, (size_t)n_k * sizeof *k);
    memcpy(v, cross ? a->value : a->query, (size_t)n_v * sizeof *v);
    mha_forward_args fa = *a;
    fa.query = q;
    fa.key = cross ? k : NULL;
    fa.value = cross ? v : NULL;
    loss_fn f = {m, &fa, G, n_out, dmalloc(n_out)};
    float *buf[3] = {q, k, v};
    const float *got[3] = {g->q, g->k, g->v};
    const int64_t n[3] = {n_q, n_k, n_v};
    const char *what[3] = {"query", "key", "value"};
    for (int t = 0; t < (cross ? 3 : 1); t++)
        for (int s = 0; s < PER_TENSOR; s++) {
            /* the middle of each third of the tensor */
            const int64_t idx = (n[t] / PER_TENSOR) * s + n[t] / (2 * PER_TENSOR) + s;
            double fd;
            fd_input(&f, buf[t] + idx, 1, &fd);   /* one element */
            if (!(fabs(got[t][idx] - fd) <= SPOT_TOL * (1 + fabs(fd))))
                fail_msg("%s: d/d %s[%lld] = %.9g, central difference %.9g",
                         name, what[t], (long long)idx, (double)got[t][idx],
                         fd);
        }
    for (int i = 0; i < mha_param_count(m); i++) {
        mha_param_info info;
        mha_param_info_at(m, i, &info);
        float *p = fmalloc(info.numel);
        mha_param_get(m, info.name, p, info.numel);
        const int64_t idx = (info.numel * 2) / 3;
        const float x0 = p[idx];
        float xp, xm;
        fd_points(x0, &xp, &xm);
        p[idx] = xp;
        mha_param_set(m, info.name, p, info.numel);
        const double lp = loss(&f);
        p[idx] = xm;
        mha_param_set(m, info.name, p, info.numel);
        const double lm = loss(&f);
        p[idx] = x0;
        mha_param_set(m, info.name, p, info.numel);
        const double fd = (lp - lm) / ((double)xp - (double)xm);
        const float gv = g->p[info.offset + idx];
        if (!(fabs(gv - fd) <= SPOT_TOL * (1 + fabs(fd))))
            fail_msg("%s: d/d %s[%lld] = %.9g, central difference %.9g",
                     name, info.name, (long long)idx, (double)gv, fd);
        free(p);
    }
    free(f.out64); free(q); free(k); free(v);
}

static void test_threads_and_plans(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof BIG / sizeof *BIG; t++) {
        const big_shape *s = &BIG[t];
        mha_config cfg = {0};
        cfg.embed_dim = s->E;
        cfg.num_heads = s->H;
        cfg.kdim = s->kdim;
        cfg.vdim = s->vdim;
        cfg.add_bias_kv = s->bias_kv;
        cfg.add_zero_attn = s->zero_attn;
        cfg.dropout = s->dropout;
        cfg.v_head_dim = s->v_head_dim;
        mha_module *m = tu_module(&cfg, 60 + t);
        assert_non_null(m);
        mha_config rc;
        mha_get_config(m, &rc);
        const int64_t Lk = s->Lk ? s->Lk : s->Lq;
        const int64_t n_q = s->B * s->Lq * s->E, n_k = s->B * Lk * rc.kdim;
        const int64_t n_v = s->B * Lk * rc.vdim, np = mha_param_numel(m);
        float *q = fmalloc(n_q), *k = fmalloc(n_k), *v = fmalloc(n_v);
        float *q2 = fmalloc(n_q), *G = fmalloc(n_q), *out = fmalloc(n_q);
        tu_fill(q, n_q, 70 + t, -1, 1);
        tu_fill(q2, n_q, 80 + t, -1, 1);
        tu_fill(k, n_k, 90 + t, -1, 1);
        tu_fill(v, n_v, 100 + t, -1, 1);
        tu_fill(G, n_q, 110 + t, -1, 1);
        uint8_t *pad = calloc((size_t)(s->B * Lk), 1);
        for (int64_t b = 0; b < s->B; b++)
            for (int64_t j = 0; j < Lk; j++)
                pad[b * Lk + j] = (j * 7 + b) % 5 == 0;
        int64_t lens[2] = {Lk - 3, Lk / 2};

        mha_forward_args a = {0};
        a.batch = s->B;
        a.q_len = s->Lq;
        a.kv_len = s->Lk;
        a.query = q;
        a.key = s->cross ? k : NULL;
        a.value = s->cross ? v : NULL;
        if (s->pad)
            a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2,
                                            {s->B, Lk}};
        a.key_lengths = s->lengths ? lens : NULL;
        a.causal = s->causal;
        a.training = s->dropout > 0;
        a.dropout_seed = 123;

        /* one thread, one-shot: the reference bits */
        big_grads r = {fmalloc(n_q), fmalloc(n_k), fmalloc(n_v), fmalloc(np)};
        big_grads g = {fmalloc(n_q), fmalloc(n_k), fmalloc(n_v), fmalloc(np)};
        mha_backward_args rb = {.grad_out = G, .grad_query = r.q, .grad_key = s->cross ? r.k : NULL, .grad_value = s->cross ? r.v : NULL, .grad_params = r.p, .accumulate = 0, .grad_head_mask = NULL};
        mha_backward_args gb = {.grad_out = G, .grad_query = g.q, .grad_key = s->cross ? g.k : NULL, .grad_value = s->cross ? g.v : NULL, .grad_params = g.p, .accumulate = 0, .grad_head_mask = NULL};
        a.num_threads = 1;
        assert_int_equal(mha_backward(m, &a, &rb), MHA_OK);
        assert_true(all_finite(r.q, n_q));
        assert_true(all_finite(r.p, np));
        spot_check(s->name, m, &a, G, n_q, &r, n_q, n_k, n_v);

#define SAME_BITS(what)                                                       \
    do {                                                                      \
        if (memcmp(r.q, g.q, (size_t)n_q * 4) ||                              \
            (s->cross && (memcmp(r.k, g.k, (size_t)n_k * 4) ||                \
                          memcmp(r.v, g.v, (size_t)n_v * 4))) ||              \
            memcmp(r.p, g.p, (size_t)np * 4))                                 \
            fail_msg("%s: gradients %s differ from 1 thread, one-shot",      \
                     s->name, what);                                          \
    } while (0)

        a.num_threads = 2;
        assert_int_equal(mha_backward(m, &a, &gb), MHA_OK);
        SAME_BITS("with 2 threads");

        /* A plan on 4 threads: forward then backward, a second backward,
         * and a backward after other forwards. */
        a.num_threads = 4;
        a.out = out;
        mha_plan *plan = NULL;
        assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
        assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
        assert_int_equal(mha_plan_backward(plan, &a, &gb), MHA_OK);
        SAME_BITS("of a plan on 4 threads");
        memset(g.q, 0, (size_t)n_q * 4);
        memset(g.p, 0, (size_t)np * 4);
        assert_int_equal(mha_plan_backward(plan, &a, &gb), MHA_OK);
        SAME_BITS("of a plan's second backward");
        a.query = q2;
        assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
        a.query = q;
        assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
        assert_int_equal(mha_plan_backward(plan, &a, &gb), MHA_OK);
        SAME_BITS("of a plan after other forwards");
        mha_plan_free(plan);
#undef SAME_BITS
        free(q); free(k); free(v); free(q2); free(G); free(out); free(pad);
        free(r.q); free(r.k); free(r.v); free(r.p);
        free(g.q); free(g.k); free(g.v); free(g.p);
        mha_free(m);
    }
}

/* ---- errors ----------------------------------------------------------------- */

static void test_errors(void **state)
{
    (void)state;
    enum { E = 8, H = 2, B = 2, L = 4 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    mha_module *m = tu_module(&cfg, 3);
    assert_non_null(m);
    const int64_t np = mha_param_numel(m);
    assert_int_equal(np, 3 * E * E + 3 * E + E * E + E);
    assert_int_equal(mha_param_numel(NULL), -1);
    float x[B * L * E], x2[B * L * E], kv[B * L * E], G[B * L * E];
    float out[B * L * E], gq[B * L * E], gk[B * L * E];
    float *gp = fmalloc(np);
    tu_fill(x, B * L * E, 1, -1, 1);
    tu_fill(x2, B * L * E, 2, -1, 1);
    tu_fill(kv, B * L * E, 3, -1, 1);
    tu_fill(G, B * L * E, 4, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.out = out;
    mha_backward_args bw = {.grad_out = G, .grad_query = gq, .grad_key = NULL, .grad_value = NULL, .grad_params = gp, .accumulate = 0, .grad_head_mask = NULL};
    assert_int_equal(mha_backward(m, &a, &bw), MHA_OK);

    /* NULL arguments */
    assert_fails(mha_backward(NULL, &a, &bw), MHA_ERR_NULL_POINTER, "module");
    assert_fails(mha_backward(m, NULL, &bw), MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_backward(m, &a, NULL), MHA_ERR_NULL_POINTER, "NULL");
    bw.grad_out = NULL;
    assert_fails(mha_backward(m, &a, &bw), MHA_ERR_NULL_POINTER, "grad_out");
    bw.grad_out = G;
    a.query = NULL;
    assert_fails(mha_backward(m, &a, &bw), MHA_ERR_NULL_POINTER, "query");
    a.query = x;

    /* key / value gradients of a self-attention (key NULL) */
    bw.grad_key = gk;
    assert_fails(mha_backward(m, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "grad_key");
    bw.grad_key = NULL;
    bw.grad_value = gk;
    assert_fails(mha_backward(m, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "grad_value");
    bw.grad_value = NULL;

    /* the forward's own checks still apply */
    a.q_len = -1;
    assert_int_not_equal(mha_backward(m, &a, &bw), MHA_OK);
    a.q_len = L;
    const float bad_hm[H] = {1.0f, NAN};
    a.head_mask = bad_hm;
    assert_fails(mha_backward(m, &a, &bw), MHA_ERR_NON_FINITE, "head_mask[1]");
    a.head_mask = NULL;

    /* plans */
    mha_plan *plan = NULL;
    assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
    assert_fails(mha_plan_backward(NULL, &a, &bw), MHA_ERR_NULL_POINTER,
                 "plan");
    assert_fails(mha_plan_backward(plan, NULL, &bw), MHA_ERR_NULL_POINTER,
                 "NULL");
    assert_fails(mha_plan_backward(plan, &a, NULL), MHA_ERR_NULL_POINTER,
                 "NULL");
    /* no forward yet */
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "forward");
    assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
    assert_int_equal(mha_plan_backward(plan, &a, &bw), MHA_OK);
    bw.grad_out = NULL;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_NULL_POINTER,
                 "grad_out");
    bw.grad_out = G;
    /* not the inputs of the last forward */
    a.query = x2;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "forward");
    a.query = x;
    a.key = a.value = kv;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "forward");
    a.key = a.value = NULL;
    a.causal = MHA_CAUSAL_TOP_LEFT;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "forward");
    a.causal = MHA_CAUSAL_NONE;
    const float hm[H] = {1.0f, 0.0f};
    a.head_mask = hm;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "head_mask");
    a.head_mask = NULL;
    assert_int_equal(mha_plan_backward(plan, &a, &bw), MHA_OK);
    bw.grad_key = gk;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "grad_key");
    bw.grad_key = NULL;
    /* a forward whose out overwrote its query leaves nothing to go back to */
    float y[B * L * E];
    memcpy(y, x, sizeof y);
    a.query = y;
    a.out = y;
    assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "overwrote");
    mha_plan_free(plan);

    /* a dropout seed other than the forward's */
    mha_free(m);
    cfg.dropout = 0.5f;
    m = tu_module(&cfg, 3);
    a.query = x;
    a.out = out;
    a.training = 1;
    a.dropout_seed = 1;
    plan = NULL;
    assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
    assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
    a.dropout_seed = 2;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "forward");
    a.dropout_seed = 1;
    a.training = 0;
    assert_fails(mha_plan_backward(plan, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "forward");
    a.training = 1;
    assert_int_equal(mha_plan_backward(plan, &a, &bw), MHA_OK);
    mha_plan_free(plan);
    free(gp);
    mha_free(m);
}

int main(void)
{
    if (tu_backend_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_checker_is_sensitive),
        cmocka_unit_test(test_gradients),
        cmocka_unit_test(test_fully_masked_rows),
        cmocka_unit_test(test_accumulate),
        cmocka_unit_test(test_threads_and_plans),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
