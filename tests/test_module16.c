/*
 * test_module16.c -- mha_forward on bf16 and f16 data (forward16.c)
 * against the float64 reference forward (tests/support/ref.c) on the
 * rounded inputs and parameters: the module's parameters are rounded to
 * the type first (so "rounded parameters" are the parameters), the
 * inputs drawn and rounded, and ref_forward_f64 runs on their float
 * values with no rounding inside.
 *
 * The bound, normwise (max |out - ref| <= tol max |ref|): the 16-bit
 * forward rounds five times on the way, each by at most the unit
 * roundoff u (2^-8 bf16, 2^-11 f16) of what it rounds: q and k (their
 * scores then move by 2u of sum |q k| scale, at most the row's score
 * range, which a softmax of O(1) scores passes on as about that much
 * relative change of the weights), v, the weights (P rounded to bf16
 * before P V on the bf16 kernels), the heads' context and the output.
 * Every case here has O(1) scores, so tol = 8u: the five roundings, the
 * scores' factor 2, float32's sums (2^-24 n, far below u), and room for
 * their products; a wrong block, a missed bias, a masked key leaking or
 * an unrounded weight is caught at 10-1000 u (the mutation rows in
 * tests/mutations.tsv).
 *
 * Run by CTest once per bf16 kernel like test_half: test_module16_amx,
 * _avx512bf16 (skipped by name where the CPU lacks it) and _widened
 * (MHA_BF16=float32).  Threads 1, 2 and 3 give the same bits.
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

#include "testutil.h"
#include "ref.h"
#include "assert_error.h"
#include "core/half.h"

typedef struct mcase {
    const char *name;
    int64_t E, H, Hkv, kdim, vdim;   /* kdim, vdim 0: E */
    int64_t B, Lq, Lk;               /* Lk 0: self-attention */
    mha_causal causal;
    int key_padding;                 /* a (B, Lk) bool mask (block) */
    float softcap;
    int window;                      /* (window, 0) around the diagonal */
    int bias;                        /* biases on */
    int64_t v_head_dim;              /* d_v; 0: d_h */
    int sinks;                       /* a learned sink logit per head */
} mcase;

static uint16_t to16(mha_dtype t, float x)
{
    return t == MHA_DTYPE_BF16 ? mha_bf16_from_float(x) : mha_f16_from_float(x);
}
static float from16(mha_dtype t, uint16_t x)
{
    return t == MHA_DTYPE_BF16 ? mha_bf16_to_float(x) : mha_f16_to_float(x);
}

/* Every parameter of m replaced by its value rounded to t. */
static void round_params(mha_module *m, mha_dtype t)
{
    for (int i = 0; i < mha_param_count(m); i++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(m, i, &info), MHA_OK);
        float *p = malloc((size_t)info.numel * sizeof *p);
        assert_int_equal(mha_param_get(m, info.name, p, info.numel), MHA_OK);
        for (int64_t k = 0; k < info.numel; k++)
            p[k] = from16(t, to16(t, p[k]));
        assert_int_equal(mha_param_set(m, info.name, p, info.numel), MHA_OK);
        free(p);
    }
}

/* Random inputs (n) rounded to t: their 16-bit patterns and float values. */
static void draw(mha_dtype t, int64_t n, uint64_t seed, uint16_t *x16,
                 float *x)
{
    tu_fill(x, n, seed, -1.0f, 1.0f);
    for (int64_t i = 0; i < n; i++) {
        x16[i] = to16(t, x[i]);
        x[i] = from16(t, x16[i]);
    }
}

/* A case's module (its parameters rounded to t), its inputs drawn and
 * rounded (16-bit patterns and their float values) and the forward's
 * arguments without data pointers: what every test of a case starts
 * from. */
typedef struct mproblem {
    mha_module *m;
    int self;                    /* Lk 0: the query is key and value */
    int64_t nq, nk, nv;          /* elements of query, key, value    */
    uint16_t *q16, *k16, *v16;
    float *q, *k, *v;
    uint8_t *pad;                /* the key padding mask, or NULL    */
    mha_forward_args a;
} mproblem;

static void problem_make(const mcase *c, mha_dtype t, mproblem *p)
{
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.num_kv_heads = c->Hkv;
    cfg.kdim = c->kdim;
    cfg.vdim = c->vdim;
    cfg.no_bias = !c->bias;
    cfg.v_head_dim = c->v_head_dim;
    cfg.mods.softcap = c->softcap;
    cfg.mods.window = c->window > 0;
    cfg.mods.window_left = c->window;
    cfg.sinks = c->sinks;
    memset(p, 0, sizeof *p);
    p->m = tu_module(&cfg, 7);
    assert_non_null(p->m);
    round_params(p->m, t);
    p->self = c->Lk == 0;
    const int64_t Lk = p->self ? c->Lq : c->Lk;
    const int64_t kd = c->kdim ? c->kdim : c->E, vd = c->vdim ? c->vdim : c->E;
    p->nq = c->B * c->Lq * c->E, p->nk = c->B * Lk * kd, p->nv = c->B * Lk * vd;
    p->q16 = malloc(p->nq * 2), p->k16 = malloc(p->nk * 2);
    p->v16 = malloc(p->nv * 2);
    p->q = malloc(p->nq * 4), p->k = malloc(p->nk * 4), p->v = malloc(p->nv * 4);
    draw(t, p->nq, 11, p->q16, p->q);
    draw(t, p->nk, 12, p->k16, p->k);
    draw(t, p->nv, 13, p->v16, p->v);
    mha_forward_args *a = &p->a;
    a->batch = c->B, a->q_len = c->Lq, a->kv_len = p->self ? 0 : Lk;
    a->causal = c->causal;
    if (c->key_padding) {   /* every batch keeps its first key */
        p->pad = malloc((size_t)(c->B * Lk));
        for (int64_t i = 0; i < c->B * Lk; i++)
            p->pad[i] = i % Lk != 0 && (i * 7919) % 5 == 0;
        a->key_padding_mask.kind = MHA_MASK_BLOCK;
        a->key_padding_mask.data = p->pad;
        a->key_padding_mask.ndim = 2;
        a->key_padding_mask.shape[0] = c->B;
        a->key_padding_mask.shape[1] = Lk;
    }
}

/* The forward's arguments on float data (the reference's) or on 16-bit
 * data of type t. */
static void problem_float(mproblem *p)
{
    p->a.dtype = MHA_DTYPE_F32;
    p->a.query16 = p->a.key16 = p->a.value16 = NULL;
    p->a.query = p->q;
    p->a.key = p->self ? NULL : p->k;
    p->a.value = p->self ? NULL : p->v;
}

static void problem_half(mproblem *p, mha_dtype t)
{
    p->a.query = p->a.key = p->a.value = NULL;
    p->a.dtype = t;
    p->a.query16 = p->q16;
    p->a.key16 = p->self ? NULL : p->k16;
    p->a.value16 = p->self ? NULL : p->v16;
}

static void problem_free(mproblem *p)
{
    free(p->pad);
    free(p->q16), free(p->k16), free(p->v16);
    free(p->q), free(p->k), free(p->v);
    mha_free(p->m);
}

static void run_case(const mcase *c, mha_dtype t)
{
    mproblem pr;
    problem_make(c, t, &pr);
    mha_module *m = pr.m;
    mha_forward_args a = pr.a;
    const int64_t nq = pr.nq;

    /* the reference, on the rounded values */
    double *ref = malloc(nq * sizeof *ref);
    problem_float(&pr);
    assert_int_equal(ref_forward_f64(m, &pr.a, ref, NULL), 0);
    problem_half(&pr, t);
    a = pr.a;
    uint16_t *out[3];
    for (int th = 1; th <= 3; th++) {
        out[th - 1] = malloc(nq * 2);
        a.out16 = out[th - 1];
        a.num_threads = th;
        const mha_status st = mha_forward(m, &a);
        if (st != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
    }
    double err = 0, top = ref_max_abs(ref, nq);
    for (int64_t i = 0; i < nq; i++) {
        const double d = fabs(from16(t, out[0][i]) - ref[i]);
        err = d > err || d != d ? d : err;
    }
    const double u = t == MHA_DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
    print_message("%-28s %s: max err %.3g of max |ref| %.3g = %.2f u\n",
                  c->name, t == MHA_DTYPE_BF16 ? "bf16" : "f16 ", err, top,
                  err / top / u);
    if (!(err <= 8 * u * top))
        fail_msg("%s: error %.3g over the bound 8u max|ref| = %.3g", c->name,
                 err, 8 * u * top);
    for (int th = 1; th < 3; th++)
        if (memcmp(out[0], out[th], nq * 2))
            fail_msg("%s: %d threads differ from 1 thread", c->name, th + 1);
    for (int th = 0; th < 3; th++)
        free(out[th]);
    free(ref);
    problem_free(&pr);
}

static const mcase cases[] = {
    /* name                    E    H Hkv kd  vd  B  Lq   Lk  causal */
    {"self, causal, row tail", 64, 2, 0, 0, 0, 2, 37, 0,
     MHA_CAUSAL_TOP_LEFT, 0, 0, 0, 1, 0, 0},
    {"self, no bias", 64, 2, 0, 0, 0, 1, 40, 0, MHA_CAUSAL_NONE, 0, 0, 0, 0, 0, 0},
    {"cross, kdim 48 vdim 80, pad", 64, 2, 0, 48, 80, 2, 20, 45,
     MHA_CAUSAL_NONE, 1, 0, 0, 1, 0, 0},
    {"GQA 4:2, causal", 128, 4, 2, 0, 0, 1, 70, 0, MHA_CAUSAL_TOP_LEFT, 0, 0,
     0, 1, 0, 0},
    {"E 40 (d_h 20), softcap", 40, 2, 0, 0, 0, 2, 33, 0, MHA_CAUSAL_NONE, 0,
     30.0f, 0, 1, 0, 0},
    {"window 16, E 96 d_h 32", 96, 3, 0, 0, 0, 1, 65, 0,
     MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 16, 1, 0, 0},
    {"d_v 48 > d_h 32, GQA 4:2", 128, 4, 2, 0, 0, 1, 40, 0,
     MHA_CAUSAL_TOP_LEFT, 0, 0, 0, 1, 48, 0},
    {"d_v 16, cross, pad", 64, 2, 0, 48, 80, 2, 20, 45, MHA_CAUSAL_NONE, 1,
     0, 0, 1, 16, 0},
    {"E 320 (two column blocks)", 320, 5, 0, 0, 0, 1, 300, 0,
     MHA_CAUSAL_NONE, 0, 0, 0, 1, 0, 0},
};

static void test_bf16(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        run_case(&cases[i], MHA_DTYPE_BF16);
}

static void test_f16(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++)
        run_case(&cases[i], MHA_DTYPE_F16);
}

/* ---- the backward ------------------------------------------------------
 * Against the float32 backward (mha_backward on float32 data) on the
 * same rounded inputs, parameters and grad_out: test_backward holds that
 * one to float64 central differences at ~1e-6 of the gradients' size, far
 * below the bound here.  Normwise per tensor (each input gradient, each
 * parameter's gradient): max |g - ref| <= 16u max |ref|.  The 16-bit
 * backward rounds dctx, dq, dk, dv and the input gradients (u each), P and
 * scale dS in the attention's backward (u each, on the bf16 kernels), on
 * top of the forward's five roundings, which move what the backward reads
 * (q, k, v, ctx) by u each; the softmax's P (dP - D) loses up to about a
 * factor 2 in cancellation.  A wrong block, a missed part of a summed
 * input gradient, a transposed operand or an unscaled bias gradient is
 * off by 10-1000 u.  1, 2 and 3 threads give the same bits; accumulate
 * adds exactly (2g).
 */
static double norm_err(const float *g, const float *ref, int64_t n)
{
    double err = 0, top = 0;
    for (int64_t i = 0; i < n; i++) {
        const double d = fabs((double)g[i] - ref[i]);
        err = d > err || d != d ? d : err;
        top = fabs(ref[i]) > top ? fabs(ref[i]) : top;
    }
    return top > 0 ? err / top : err;
}

static void widen_all(mha_dtype t, const uint16_t *x, int64_t n, float *y)
{
    for (int64_t i = 0; i < n; i++)
        y[i] = from16(t, x[i]);
}

static void run_backward_case(const mcase *c, mha_dtype t)
{
    mproblem pr;
    problem_make(c, t, &pr);
    mha_module *m = pr.m;
    const int self = pr.self;
    const int64_t nq = pr.nq, nk = pr.nk, nv = pr.nv,
                  np = mha_param_numel(m);
    uint16_t *g16 = malloc(nq * 2);
    float *G = malloc(nq * 4);
    draw(t, nq, 14, g16, G);

    /* the float32 reference */
    float *rq = malloc(nq * 4), *rk = malloc(nk * 4), *rv = malloc(nv * 4),
          *rp = malloc(np * 4);
    problem_float(&pr);
    mha_forward_args a = pr.a;
    mha_backward_args rb = {.grad_out = G, .grad_query = rq,
                            .grad_key = self ? NULL : rk,
                            .grad_value = self ? NULL : rv, .grad_params = rp};
    if (mha_backward(m, &a, &rb) != MHA_OK)
        fail_msg("%s float32: %s", c->name, mha_last_error());
    problem_half(&pr, t);
    a = pr.a;
    uint16_t *gq[3], *gk[3], *gv[3];
    float *gp[3];
    for (int th = 0; th < 3; th++) {
        gq[th] = malloc(nq * 2), gk[th] = malloc(nk * 2);
        gv[th] = malloc(nv * 2), gp[th] = malloc(np * 4);
        mha_backward_args b = {.grad_out16 = g16, .grad_query16 = gq[th],
                               .grad_key16 = self ? NULL : gk[th],
                               .grad_value16 = self ? NULL : gv[th],
                               .grad_params = gp[th]};
        a.num_threads = th + 1;
        if (mha_backward(m, &a, &b) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
    }
    const double u = t == MHA_DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
    float *w = malloc((nq > nk ? (nq > nv ? nq : nv) : (nk > nv ? nk : nv)) * 4);
    double worst = 0;
    struct { const char *name; const uint16_t *g; const float *ref; int64_t n; }
        ins[3] = {{"query", gq[0], rq, nq}, {"key", gk[0], rk, nk},
                  {"value", gv[0], rv, nv}};
    for (int i = 0; i < (self ? 1 : 3); i++) {
        widen_all(t, ins[i].g, ins[i].n, w);
        const double e = norm_err(w, ins[i].ref, ins[i].n) / u;
        worst = e > worst ? e : worst;
        if (!(e <= 16))
            fail_msg("%s: grad %s off by %.2f u of its largest element (bound "
                     "16u)", c->name, ins[i].name, e);
    }
    for (int i = 0; i < mha_param_count(m); i++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(m, i, &info), MHA_OK);
        const double e = norm_err(gp[0] + info.offset, rp + info.offset,
                                  info.numel) / u;
        worst = e > worst ? e : worst;
        if (!(e <= 16))
            fail_msg("%s: grad %s off by %.2f u of its largest element (bound "
                     "16u)", c->name, info.name, e);
    }
    print_message("%-28s %s backward: worst gradient %.2f u\n", c->name,
                  t == MHA_DTYPE_BF16 ? "bf16" : "f16 ", worst);
    for (int th = 1; th < 3; th++)
        if (memcmp(gq[0], gq[th], nq * 2) || memcmp(gp[0], gp[th], np * 4) ||
            (!self && (memcmp(gk[0], gk[th], nk * 2) ||
                       memcmp(gv[0], gv[th], nv * 2))))
            fail_msg("%s: %d threads' gradients differ from 1 thread's",
                     c->name, th + 1);

    /* a plan: the same bits, and accumulate adds exactly */
    mha_plan *p;
    a.num_threads = 2;
    a.out16 = malloc(nq * 2);
    assert_int_equal(mha_plan_create(m, &a, &p), MHA_OK);
    assert_int_equal(mha_plan_forward(p, &a), MHA_OK);
    mha_backward_args b = {.grad_out16 = g16, .grad_query16 = gq[1],
                           .grad_key16 = self ? NULL : gk[1],
                           .grad_value16 = self ? NULL : gv[1],
                           .grad_params = gp[1]};
    assert_int_equal(mha_plan_backward(p, &a, &b), MHA_OK);
    assert_memory_equal(gq[0], gq[1], nq * 2);
    assert_memory_equal(gp[0], gp[1], np * 4);
    b.accumulate = 1;
    assert_int_equal(mha_plan_backward(p, &a, &b), MHA_OK);
    for (int64_t i = 0; i < np; i++)
        if (gp[1][i] != 2 * gp[0][i])
            fail_msg("%s: accumulated grad_params[%lld] = %g, not 2 x %g",
                     c->name, (long long)i, gp[1][i], gp[0][i]);
    mha_plan_free(p);
    free((void *)a.out16);
    for (int th = 0; th < 3; th++)
        free(gq[th]), free(gk[th]), free(gv[th]), free(gp[th]);
    free(w), free(rq), free(rk), free(rv), free(rp);
    free(g16), free(G);
    problem_free(&pr);
}

/* The backward's own shapes beside the forward's but the last (under
 * valgrind each backward costs minutes at the forward's E 320, L 300):
 * E 320 at L 70 still crosses a 256-column block of dW and dx; the
 * weight gradients sum over the rows in chunks of 4096 (linear.c's
 * GRAD16_K): 4200 rows (70 short sequences, cheap attention) take two,
 * at E 32 and one head of d_h 32 (E 64 and two heads cost 3x as much
 * under valgrind, 100 s a dtype, for the same chunks). */
static const mcase bwd_cases[] = {
    {"E 320, L 70 (two column blocks)", 320, 5, 0, 0, 0, 1, 70, 0,
     MHA_CAUSAL_NONE, 0, 0, 0, 1, 0, 0},
    {"4200 rows (two row chunks)", 32, 1, 0, 0, 0, 70, 60, 0,
     MHA_CAUSAL_TOP_LEFT, 0, 0, 0, 1, 0, 0},
    {"sinks, GQA 4:2, causal", 128, 4, 2, 0, 0, 1, 40, 0,
     MHA_CAUSAL_TOP_LEFT, 0, 0, 0, 1, 0, 1},
};

static void run_backward_cases(mha_dtype t)
{
    for (size_t i = 0; i + 1 < sizeof cases / sizeof *cases; i++)
        run_backward_case(&cases[i], t);
    for (size_t i = 0; i < sizeof bwd_cases / sizeof *bwd_cases; i++)
        run_backward_case(&bwd_cases[i], t);
}

static void test_backward_bf16(void **state)
{
    (void)state;
    run_backward_cases(MHA_DTYPE_BF16);
}

static void test_backward_f16(void **state)
{
    (void)state;
    run_backward_cases(MHA_DTYPE_F16);
}

/* float32 parameters that are not 16-bit values are rounded to the type
 * at the call: the same bits, forward and backward, as the module with
 * its parameters rounded beforehand (every kernel; test_module16_* run
 * each). */
static void test_params_rounded(void **state)
{
    (void)state;
    const mha_dtype types[2] = {MHA_DTYPE_BF16, MHA_DTYPE_F16};
    for (int ti = 0; ti < 2; ti++) {
        const mha_dtype t = types[ti];
        mha_config cfg = {0};
        cfg.embed_dim = 64;
        cfg.num_heads = 2;
        mha_module *m = tu_module(&cfg, 21);
        const int64_t n = 3 * 19 * 64;
        uint16_t *x16 = malloc(n * 2), *o1 = malloc(n * 2),
                 *o2 = malloc(n * 2);
        float *x = malloc(n * 4);
        draw(t, n, 5, x16, x);
        mha_forward_args a = {0};
        a.batch = 3, a.q_len = 19, a.dtype = t;
        a.query16 = x16, a.out16 = o1;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        /* and the backward's gradients (dL/d out = the input) */
        uint16_t *g1 = malloc(n * 2), *g2 = malloc(n * 2);
        const int64_t np = mha_param_numel(m);
        float *p1 = malloc(np * 4), *p2 = malloc(np * 4);
        mha_backward_args b = {.grad_out16 = x16, .grad_query16 = g1,
                               .grad_params = p1};
        assert_int_equal(mha_backward(m, &a, &b), MHA_OK);
        round_params(m, t);
        a.out16 = o2;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        assert_memory_equal(o1, o2, n * 2);
        b.grad_query16 = g2, b.grad_params = p2;
        assert_int_equal(mha_backward(m, &a, &b), MHA_OK);
        assert_memory_equal(g1, g2, n * 2);
        assert_memory_equal(p1, p2, np * 4);
        free(g1), free(g2), free(p1), free(p2);
        free(x16), free(o1), free(o2), free(x);
        mha_free(m);
    }
}

/* What a 16-bit forward refuses, by name, writing nothing. */
static void test_refused(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 64;
    cfg.num_heads = 2;
    mha_module *m = tu_module(&cfg, 3);
    uint16_t x[2 * 64] = {0}, o[2 * 64];
    float xf[2 * 64] = {0}, w[2 * 2 * 2];
    memset(o, 0x5a, sizeof o);
    mha_forward_args a = {0};
    a.batch = 1, a.q_len = 2, a.dtype = MHA_DTYPE_BF16;
    a.query16 = x, a.out16 = o;
    assert_int_equal(mha_forward(m, &a), MHA_OK);

    mha_forward_args b = a;
    b.dtype = (mha_dtype)9;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT, "dtype");
    b = a, b.query = xf;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT,
                 "query must be NULL");
    b = a, b.out16 = NULL;
    assert_fails(mha_forward(m, &b), MHA_ERR_NULL_POINTER, "out16");
    b = a, b.query16 = NULL;
    assert_fails(mha_forward(m, &b), MHA_ERR_NULL_POINTER, "query16");
    b = a, b.need_weights = MHA_WEIGHTS_PER_HEAD, b.attn_weights = w;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "weights");
    b = a, b.training = 1;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "training");
    const float hm[2] = {1, 0};
    b = a, b.head_mask = hm;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "head_mask");
    b = a, b.key16 = x, b.kv_len = 0;   /* a key of its own needs kv_len */
    assert_int_equal(mha_forward(m, &b), MHA_OK);   /* (key16 == query16) */
    /* float32 data with 16-bit pointers set */
    b = a, b.dtype = MHA_DTYPE_F32, b.query = xf, b.out = xf;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT,
                 "query16 must be NULL");
    /* a plan keeps its dtype */
    mha_plan *p;
    assert_int_equal(mha_plan_create(m, &a, &p), MHA_OK);
    assert_int_equal(mha_plan_forward(p, &a), MHA_OK);
    b = a, b.dtype = MHA_DTYPE_F16;
    assert_fails(mha_plan_forward(p, &b), MHA_ERR_INVALID_ARGUMENT,
                 "made for dtype 3");
    mha_plan_free(p);

    /* the backward's 16-bit fields */
    uint16_t gq[2 * 64];
    float gf[2 * 64];
    mha_backward_args g = {.grad_out16 = x, .grad_query16 = gq};
    assert_int_equal(mha_backward(m, &a, &g), MHA_OK);
    g.grad_out = gf;
    assert_fails(mha_backward(m, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "grad_out must be NULL");
    g.grad_out = NULL, g.grad_out16 = NULL;
    assert_fails(mha_backward(m, &a, &g), MHA_ERR_NULL_POINTER, "grad_out16");
    g.grad_out16 = x, g.grad_key16 = gq;   /* self-attention: no key */
    assert_fails(mha_backward(m, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "grad_key16 and grad_value16 must be NULL");
    g.grad_key16 = NULL;
    float ghm[2];
    g.grad_head_mask = ghm;
    assert_fails(mha_backward(m, &a, &g), MHA_ERR_UNSUPPORTED, "head mask");
    b = a, b.dtype = MHA_DTYPE_F32, b.query16 = NULL, b.out16 = NULL;
    b.query = xf, b.out = NULL;
    mha_backward_args gb = {.grad_out = gf, .grad_out16 = x};
    assert_fails(mha_backward(m, &b, &gb), MHA_ERR_INVALID_ARGUMENT,
                 "16-bit fields must be NULL");
    /* a plan's backward is of its last forward's data */
    assert_int_equal(mha_plan_create(m, &a, &p), MHA_OK);
    g.grad_head_mask = NULL;
    assert_fails(mha_plan_backward(p, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "no forward");
    assert_int_equal(mha_plan_forward(p, &a), MHA_OK);
    x[0] ^= 0x40;   /* the input changed since the forward */
    assert_fails(mha_plan_backward(p, &a, &g), MHA_ERR_INVALID_ARGUMENT,
                 "changed");
    x[0] ^= 0x40;
    assert_int_equal(mha_plan_backward(p, &a, &g), MHA_OK);
    mha_plan_free(p);
    mha_free(m);

    cfg.add_bias_kv = 1;
    m = tu_module(&cfg, 3);
    assert_fails(mha_forward(m, &a), MHA_ERR_UNSUPPORTED, "add_bias_kv");
    mha_free(m);

    /* f16's range: a parameter past it, a projection past it (the query
     * all 300s, the query weights all 4: sums of 64 x 1200), refused with
     * out16 untouched; bf16 takes both. */
    cfg.add_bias_kv = 0;
    m = tu_module(&cfg, 3);
    const int64_t nw = 3 * 64 * 64;
    float *pw = malloc(nw * sizeof *pw);
    assert_int_equal(mha_param_get(m, "in_proj_weight", pw, nw), MHA_OK);
    const float keep = pw[5];
    pw[5] = 70000.0f;
    assert_int_equal(mha_param_set(m, "in_proj_weight", pw, nw), MHA_OK);
    b = a, b.dtype = MHA_DTYPE_F16;
    memset(o, 0x5a, sizeof o);
    uint16_t before[2 * 64];
    memcpy(before, o, sizeof o);
    assert_fails(mha_forward(m, &b), MHA_ERR_NON_FINITE, "parameter");
    assert_memory_equal(o, before, sizeof o);
    assert_int_equal(mha_forward(m, &a), MHA_OK);   /* bf16 */
    pw[5] = keep;
    for (int64_t i = 0; i < 64 * 64; i++)   /* W_q */
        pw[i] = 4.0f;
    assert_int_equal(mha_param_set(m, "in_proj_weight", pw, nw), MHA_OK);
    uint16_t big[2 * 64];
    for (int i = 0; i < 2 * 64; i++)
        big[i] = mha_f16_from_float(300.0f);
    b.query16 = big;
    memset(o, 0x5a, sizeof o);
    assert_fails(mha_forward(m, &b), MHA_ERR_NON_FINITE, "query projection");
    assert_memory_equal(o, before, sizeof o);
    for (int i = 0; i < 2 * 64; i++)
        big[i] = mha_bf16_from_float(300.0f);
    b.dtype = MHA_DTYPE_BF16;
    assert_int_equal(mha_forward(m, &b), MHA_OK);
    free(pw);
    mha_free(m);
}

int main(void)
{
    const char *want = getenv("MHA_TEST_BF16");
    const char *k = mha_bf16_kernel();
    if (want && (!k || strcmp(k, want))) {
        printf("skipped: this CPU or OS has no %s (test_module16_%s)\n",
               !strcmp(want, "amx")     ? "AMX-BF16"
               : !strcmp(want, "bfdot") ? "BF16 (BFDOT, aarch64)"
                                        : "AVX512-BF16",
               want);
        return 77;
    }
    print_message("bf16 kernel: %s\n", k ? k : "(none)");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_f16),
        cmocka_unit_test(test_backward_bf16),
        cmocka_unit_test(test_backward_f16),
        cmocka_unit_test(test_params_rounded),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
