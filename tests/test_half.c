/*
 * test_half.c -- mha_attention on bf16 and f16 q, k, v and out, against a
 * float64 reference on the rounded inputs (written here: softmax(q k^T
 * scale) v per head, causal and key lengths by index, grouped heads).
 *
 * Run by CTest once per bf16 kernel: test_half_amx (AMX tiles, where the
 * CPU has them; exit 77, skipped by name, elsewhere), test_half_avx512bf16
 * (MHA_BF16=avx512bf16: vdpbf16ps on the same layouts and code, where the
 * CPU has AVX512-BF16) and test_half_widened (MHA_BF16=float32: the inputs
 * widened to float32, the float32 kernels); test_half_bad_env checks that
 * a wrong MHA_BF16 is refused.  "AMX" below is either bf16 kernel: the
 * same numerics (P rounded to bf16, the same cubic 2^x).
 *
 * The bound, per output element (b, h, i, d), with w_j the reference's
 * weights and A = sum_j w_j |v_jd|:
 *   - out rounded to the 16-bit type: the unit roundoff, 2^-8 |ref| (bf16,
 *     8 significant bits) or 2^-11 |ref| (f16, 11);
 *   - on AMX each weight is rounded to bf16 before P V: at most 2^-8 of
 *     each term, 2^-8 A;
 *   - float32 arithmetic: the scores' sums of d_h products (d_h 2^-24 of
 *     sum |q k| scale, which moves each weight and l by twice that), the
 *     AMX kernel's 2^x (a cubic: 7.5e-5 of each weight and of l; the
 *     float32 kernels' exp: 1e-6), l's sum of Lk terms (Lk 2^-24): each
 *     a fraction of A.
 * The sum of these, times 1.25 for the second-order terms.  A key missed
 * or added moves the output by ~w_j |v_j| and lse by w_j, which lse's
 * bound (1e-5 (1 + |lse|), plus 7.5e-5 on AMX) catches where out's would
 * not (w_j >= 1e-3 in every case here).
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
#include "core/half.h"

static int kernel_run;   /* a bf16 kernel runs (AMX or AVX512-BF16) */

typedef struct hcase {
    int64_t B, H, Hkv, Lq, Lk, dh;
    mha_causal causal;
    int key_lengths;      /* 1: per-batch key lengths */
    mha_layout layout;
    mha_dtype dtype;
    float scale;          /* 0: default */
} hcase;

static uint16_t to16(mha_dtype t, float x)
{
    return t == MHA_DTYPE_BF16 ? mha_bf16_from_float(x) : mha_f16_from_float(x);
}

static double from16(mha_dtype t, uint16_t x)
{
    return t == MHA_DTYPE_BF16 ? mha_bf16_to_float(x) : mha_f16_to_float(x);
}

/* Element (b, h, i, d) of a (B, heads, L, dh) tensor in layout lay. */
static int64_t at(mha_layout lay, int64_t heads, int64_t L, int64_t dh,
                  int64_t b, int64_t h, int64_t i, int64_t d)
{
    return lay == MHA_LAYOUT_HEADS_FIRST
               ? ((b * heads + h) * L + i) * dh + d
               : (b * L + i) * heads * dh + h * dh + d;
}

static void run_case(const hcase *c, uint64_t seed)
{
    const int64_t nq = c->B * c->Lq * c->H * c->dh;
    const int64_t nk = c->B * c->Lk * c->Hkv * c->dh;
    uint16_t *q = malloc(nq * 2), *k = malloc(nk * 2), *v = malloc(nk * 2);
    uint16_t *out[3];
    float *lse[3];
    float *u = malloc((nq > nk ? nq : nk) * sizeof *u);
    tu_fill(u, nq, seed, -2.0f, 2.0f);
    for (int64_t x = 0; x < nq; x++)
        q[x] = to16(c->dtype, u[x]);
    tu_fill(u, nk, seed + 1, -2.0f, 2.0f);
    for (int64_t x = 0; x < nk; x++)
        k[x] = to16(c->dtype, u[x]);
    tu_fill(u, nk, seed + 2, -3.0f, 3.0f);
    for (int64_t x = 0; x < nk; x++)
        v[x] = to16(c->dtype, u[x]);
    int64_t *kl = NULL;
    if (c->key_lengths) {
        kl = malloc(c->B * sizeof *kl);
        for (int64_t b = 0; b < c->B; b++)
            kl[b] = (c->Lk * (b + 1)) / (c->B + 1) + (b == 0 ? 0 : 1);
        kl[0] = 0;   /* a sequence with no key: zero rows, lse -inf */
    }
    /* 1, 2 and 4 threads */
    static const int threads[3] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        out[t] = malloc(nq * 2);
        lse[t] = malloc(c->B * c->H * c->Lq * sizeof(float));
        memset(out[t], 0xFF, nq * 2);
        mha_attention_args a = {0};
        a.batch = c->B, a.num_heads = c->H, a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh, a.q_len = c->Lq, a.kv_len = c->Lk;
        a.dtype = c->dtype;
        a.q16 = q, a.k16 = k, a.v16 = v, a.out16 = out[t];
        a.causal = c->causal, a.key_lengths = kl, a.layout = c->layout;
        a.scale = c->scale, a.lse = lse[t], a.num_threads = threads[t];
        mha_status st = mha_attention(&a);
        if (st != MHA_OK)
            fail_msg("mha_attention: %s", mha_last_error());
    }
    for (int t = 1; t < 3; t++) {
        assert_memory_equal(out[0], out[t], nq * 2);
        assert_memory_equal(lse[0], lse[t],
                            c->B * c->H * c->Lq * sizeof(float));
    }

    /* the float64 reference on the rounded inputs */
    const int amx = kernel_run && c->dtype == MHA_DTYPE_BF16 && c->dh % 32 == 0;
    const double scale = c->scale ? c->scale : 1.0 / sqrt((double)c->dh);
    const double ulp_out = c->dtype == MHA_DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
    double *s = malloc(c->Lk * sizeof *s), worst = 0.0, worst_lse = 0.0;
    const int64_t group = c->H / c->Hkv;
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->H; h++)
            for (int64_t i = 0; i < c->Lq; i++) {
                const int64_t g = h / group;
                int64_t lim = kl ? kl[b] : c->Lk;
                const int64_t diag =
                    c->causal == MHA_CAUSAL_TOP_LEFT ? i + 1
                    : c->causal == MHA_CAUSAL_BOTTOM_RIGHT
                        ? i + 1 + c->Lk - c->Lq
                        : c->Lk;
                lim = diag < lim ? diag : lim;
                lim = lim < 0 ? 0 : lim;
                double mx = -INFINITY, l = 0.0, qk = 0.0;
                for (int64_t j = 0; j < lim; j++) {
                    double dot = 0.0, adot = 0.0;
                    for (int64_t d = 0; d < c->dh; d++) {
                        const double x = from16(c->dtype, q[at(c->layout, c->H, c->Lq, c->dh, b, h, i, d)]);
                        const double y = from16(c->dtype, k[at(c->layout, c->Hkv, c->Lk, c->dh, b, g, j, d)]);
                        dot += x * y;
                        adot += fabs(x * y);
                    }
                    s[j] = dot * scale;
                    qk = fmax(qk, adot * fabs(scale));
                    mx = fmax(mx, s[j]);
                }
                for (int64_t j = 0; j < lim; j++)
                    l += exp(s[j] - mx);
                const float got_lse = lse[0][(b * c->H + h) * c->Lq + i];
                if (lim == 0) {
                    assert_true(got_lse == -INFINITY);
                } else {
                    const double ref_lse = mx + log(l);
                    /* float32's rounding, and on AMX the cubic's 7.5e-5
                     * of l, which is ln l's error */
                    const double e = fabs(got_lse - ref_lse) /
                                     (1e-5 * (1.0 + fabs(ref_lse)) +
                                      (amx ? 7.5e-5 : 0.0));
                    worst_lse = fmax(worst_lse, e);
                }
                const double frac =
                    (amx ? 0x1p-8 + 2 * 7.5e-5 : 2e-6) +
                    2.0 * c->dh * 0x1p-24 * qk + (double)lim * 0x1p-24;
                for (int64_t d = 0; d < c->dh; d++) {
                    double ref = 0.0, A = 0.0;
                    for (int64_t j = 0; j < lim; j++) {
                        const double w = exp(s[j] - mx) / l;
                        const double y = from16(c->dtype, v[at(c->layout, c->Hkv, c->Lk, c->dh, b, g, j, d)]);
                        ref += w * y;
                        A += w * fabs(y);
                    }
                    const double got = from16(
                        c->dtype, out[0][at(c->layout, c->H, c->Lq, c->dh, b, h, i, d)]);
                    const double tol =
                        1.25 * (ulp_out * fabs(ref) + frac * A) + 1e-30;
                    if (lim == 0)
                        assert_true(got == 0.0);
                    worst = fmax(worst, fabs(got - ref) / tol);
                }
            }
    print_message("  B%lld H%lld/%lld Lq%lld Lk%lld d%lld causal %d kl %d "
                  "layout %d %s: worst error / bound %.3f, lse %.3f\n",
                  (long long)c->B, (long long)c->H, (long long)c->Hkv,
                  (long long)c->Lq, (long long)c->Lk, (long long)c->dh,
                  (int)c->causal, c->key_lengths, (int)c->layout,
                  c->dtype == MHA_DTYPE_BF16 ? "bf16" : "f16", worst,
                  worst_lse);
    assert_true(worst <= 1.0);
    assert_true(worst_lse <= 1.0);
    for (int t = 0; t < 3; t++) {
        free(out[t]);
        free(lse[t]);
    }
    free(s);
    free(kl);
    free(u);
    free(q);
    free(k);
    free(v);
}

/*
 * The backward, against float64 gradients on the rounded inputs (P, dP,
 * D = sum_d dO O, dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q,
 * dV = P^T dO).  The bound, per gradient element, from where bf16 enters:
 * each gradient rounded (2^-8 |ref|); P rounded before P^T dO (2^-8 of
 * sum_i P |dO|); dS rounded before its products (2^-8 of scale sum |dS|
 * |Q| or |K|); float32's sums and the cubic 2^x (2e-4 of the same
 * magnitudes); times 1.25 for the second-order terms.  And D, formed from
 * the forward's bf16 output: its error dD_i is at most sum_d |dO| (2^-7
 * (|O| + sum_j P |V|)), the forward's bound on each output element.  In
 * dK that adds scale sum_i P dD_i |Q| to the bound.  In a row of dQ it
 * acts along one direction, -dD_i scale sum_j P K: the test fits that
 * multiple (it must be within dD_i) and bounds what is left, so that dQ
 * is held to the tight bound and not to D's (25x looser in practice).
 */
static void run_backward(const hcase *c, uint64_t seed)
{
    const int64_t nq = c->B * c->Lq * c->H * c->dh;
    const int64_t nk = c->B * c->Lk * c->Hkv * c->dh;
    uint16_t *q = malloc(nq * 2), *k = malloc(nk * 2), *v = malloc(nk * 2);
    uint16_t *go = malloc(nq * 2);
    uint16_t *g[3][3];   /* per thread count: dq, dk, dv */
    float *u = malloc((nq > nk ? nq : nk) * sizeof *u);
    tu_fill(u, nq, seed, -2.0f, 2.0f);
    for (int64_t x = 0; x < nq; x++)
        q[x] = to16(c->dtype, u[x]);
    tu_fill(u, nk, seed + 1, -2.0f, 2.0f);
    for (int64_t x = 0; x < nk; x++)
        k[x] = to16(c->dtype, u[x]);
    tu_fill(u, nk, seed + 2, -3.0f, 3.0f);
    for (int64_t x = 0; x < nk; x++)
        v[x] = to16(c->dtype, u[x]);
    tu_fill(u, nq, seed + 3, -1.0f, 1.0f);
    for (int64_t x = 0; x < nq; x++)
        go[x] = to16(c->dtype, u[x]);
    int64_t *kl = NULL;
    if (c->key_lengths) {
        kl = malloc(c->B * sizeof *kl);
        for (int64_t b = 0; b < c->B; b++)
            kl[b] = c->Lk - b * (c->Lk / (c->B + 1));
    }
    static const int threads[3] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        g[t][0] = malloc(nq * 2);
        g[t][1] = malloc(nk * 2);
        g[t][2] = malloc(nk * 2);
        mha_attention_args a = {0};
        a.batch = c->B, a.num_heads = c->H, a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh, a.q_len = c->Lq, a.kv_len = c->Lk;
        a.dtype = c->dtype, a.q16 = q, a.k16 = k, a.v16 = v;
        a.causal = c->causal, a.key_lengths = kl, a.layout = c->layout;
        a.scale = c->scale, a.num_threads = threads[t];
        const mha_attention_grads16 gr = {.grad_out = go, .grad_q = g[t][0],
                                          .grad_k = g[t][1], .grad_v = g[t][2]};
        if (mha_attention_backward16(&a, &gr) != MHA_OK)
            fail_msg("mha_attention_backward16: %s", mha_last_error());
    }
    for (int t = 1; t < 3; t++) {
        assert_memory_equal(g[0][0], g[t][0], nq * 2);
        assert_memory_equal(g[0][1], g[t][1], nk * 2);
        assert_memory_equal(g[0][2], g[t][2], nk * 2);
    }
    {   /* the forward's out16 and lse given: the same gradients, bitwise */
        uint16_t *o = malloc(nq * 2), *gg[3] = {malloc(nq * 2), malloc(nk * 2),
                                                malloc(nk * 2)};
        float *lse = malloc(c->B * c->H * c->Lq * sizeof *lse);
        mha_attention_args a = {0};
        a.batch = c->B, a.num_heads = c->H, a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh, a.q_len = c->Lq, a.kv_len = c->Lk;
        a.dtype = c->dtype, a.q16 = q, a.k16 = k, a.v16 = v, a.out16 = o;
        a.causal = c->causal, a.key_lengths = kl, a.layout = c->layout;
        a.scale = c->scale, a.lse = lse;
        assert_int_equal(mha_attention(&a), MHA_OK);
        const mha_attention_grads16 gr = {.grad_out = go, .grad_q = gg[0],
                                          .grad_k = gg[1], .grad_v = gg[2]};
        assert_int_equal(mha_attention_backward16(&a, &gr), MHA_OK);
        assert_memory_equal(g[0][0], gg[0], nq * 2);
        assert_memory_equal(g[0][1], gg[1], nk * 2);
        assert_memory_equal(g[0][2], gg[2], nk * 2);
        /* a plan: its run the call's bits, its backward (on the forward
         * it kept) the same gradients; each twice */
        uint16_t *po = malloc(nq * 2);
        float *pl = malloc(c->B * c->H * c->Lq * sizeof *pl);
        mha_attention_args pa = a;
        pa.out16 = po, pa.lse = pl, pa.num_threads = 3;
        mha_attention_plan *plan = NULL;
        assert_int_equal(mha_attention_plan_create(&pa, &plan), MHA_OK);
        for (int r = 0; r < 2; r++) {
            memset(po, 0xFF, nq * 2);
            for (int i = 0; i < 3; i++)
                memset(gg[i], 0xFF, (i ? nk : nq) * 2);
            if (mha_attention_plan_run(plan, &pa) != MHA_OK)
                fail_msg("16-bit plan: %s", mha_last_error());
            assert_memory_equal(po, o, nq * 2);
            assert_memory_equal(pl, lse, c->B * c->H * c->Lq * sizeof *pl);
            if (mha_attention_plan_backward16(plan, &pa, &gr) != MHA_OK)
                fail_msg("16-bit plan's backward: %s", mha_last_error());
            assert_memory_equal(g[0][0], gg[0], nq * 2);
            assert_memory_equal(g[0][1], gg[1], nk * 2);
            assert_memory_equal(g[0][2], gg[2], nk * 2);
        }
        mha_attention_plan_free(plan);
        free(po), free(pl);
        free(o), free(lse), free(gg[0]), free(gg[1]), free(gg[2]);
    }

    const double scale = c->scale ? c->scale : 1.0 / sqrt((double)c->dh);
    const int64_t group = c->H / c->Hkv, L = c->Lq, M = c->Lk, D = c->dh;
    double *P = calloc(L * M, sizeof *P), *dS = calloc(L * M, sizeof *dS);
    double *dD = calloc(L, sizeof *dD);
    /* reference gradients and bounds, summed over the heads of a group */
    double *rq = calloc(D, sizeof *rq), *bq = calloc(D, sizeof *bq);
    double *bdk = calloc(M * D, sizeof *bdk), *cohv = calloc(D, sizeof *cohv);
    double *rk = calloc(M * D, sizeof *rk), *bk = calloc(M * D, sizeof *bk);
    double *rv = calloc(M * D, sizeof *rv), *bv = calloc(M * D, sizeof *bv);
    double worst = 0.0;
#define E16(x, lay, heads, len, b_, h_, i_, d_) \
    from16(c->dtype, x[at(lay, heads, len, c->dh, b_, h_, i_, d_)])
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t gg = 0; gg < c->Hkv; gg++) {
            memset(rk, 0, M * D * sizeof *rk);
            memset(bk, 0, M * D * sizeof *bk);
            memset(bdk, 0, M * D * sizeof *bdk);
            memset(rv, 0, M * D * sizeof *rv);
            memset(bv, 0, M * D * sizeof *bv);
            for (int64_t h = gg * group; h < (gg + 1) * group; h++) {
                for (int64_t i = 0; i < L; i++) {
                    int64_t lim = kl ? kl[b] : M;
                    const int64_t diag =
                        c->causal == MHA_CAUSAL_TOP_LEFT ? i + 1
                        : c->causal == MHA_CAUSAL_BOTTOM_RIGHT ? i + 1 + M - L
                                                               : M;
                    lim = diag < lim ? diag : lim;
                    double mx = -INFINITY, l = 0.0, Di = 0.0, dDi = 0.0;
                    for (int64_t j = 0; j < M; j++) {
                        double sc = 0.0;
                        for (int64_t d = 0; d < D; d++)
                            sc += E16(q, c->layout, c->H, L, b, h, i, d) *
                                  E16(k, c->layout, c->Hkv, M, b, gg, j, d);
                        P[i * M + j] = j < lim ? sc * scale : -INFINITY;
                        mx = fmax(mx, P[i * M + j]);
                    }
                    for (int64_t j = 0; j < M; j++)
                        l += j < lim ? exp(P[i * M + j] - mx) : 0.0;
                    for (int64_t j = 0; j < M; j++)
                        P[i * M + j] = j < lim ? exp(P[i * M + j] - mx) / l : 0.0;
                    for (int64_t d = 0; d < D; d++) {
                        double o = 0.0, A = 0.0;
                        for (int64_t j = 0; j < M; j++) {
                            const double y = E16(v, c->layout, c->Hkv, M, b, gg, j, d);
                            o += P[i * M + j] * y;
                            A += P[i * M + j] * fabs(y);
                        }
                        const double dy = E16(go, c->layout, c->H, L, b, h, i, d);
                        Di += dy * o;
                        dDi += 0x1p-7 * fabs(dy) * (fabs(o) + A);
                    }
                    dD[i] = dDi;
                    for (int64_t j = 0; j < M; j++) {
                        double dp = 0.0;
                        for (int64_t d = 0; d < D; d++)
                            dp += E16(go, c->layout, c->H, L, b, h, i, d) *
                                  E16(v, c->layout, c->Hkv, M, b, gg, j, d);
                        dS[i * M + j] = P[i * M + j] * (dp - Di);
                    }
                }
                /* dQ of this head, row by row */
                for (int64_t i = 0; i < L; i++) {
                    double ec = 0.0, cc = 0.0, tt = 0.0;
                    for (int64_t d = 0; d < D; d++) {
                        double r = 0.0, m = 0.0, coh = 0.0;
                        for (int64_t j = 0; j < M; j++) {
                            const double y = E16(k, c->layout, c->Hkv, M, b, gg, j, d);
                            r += scale * dS[i * M + j] * y;
                            m += fabs(scale) * fabs(dS[i * M + j]) * fabs(y);
                            coh += scale * P[i * M + j] * y;
                        }
                        const double got = from16(
                            c->dtype, g[0][0][at(c->layout, c->H, L, D, b, h, i, d)]);
                        rq[d] = got - r;   /* the error */
                        /* (the rounding of a value that is itself off: 2^-8 of the larger) */
                        bq[d] = 1.25 * (0x1p-8 * fmax(fabs(r), fabs(got)) +
                                        (0x1p-8 + 2e-4) * m);
                        cohv[d] = coh;
                        ec += rq[d] * coh;
                        cc += coh * coh;
                        tt += bq[d] * bq[d];
                    }
                    /* e = -delta coh + eps, |eps_d| <= bq_d: the fitted
                     * delta is within |delta| + |eps| / |coh| */
                    const double delta = cc > 0.0 ? -ec / cc : 0.0;
                    const double slack = cc > 0.0 ? sqrt(tt / cc) : 0.0;
                    worst = fmax(worst, fabs(delta) / (1.25 * dD[i] + slack + 1e-30));
                    for (int64_t d = 0; d < D; d++) {
                        const double resid = rq[d] + delta * cohv[d];
                        const double tol = bq[d] + fabs(cohv[d]) * slack + 1e-30;
                        worst = fmax(worst, fabs(resid) / tol);
                    }
                }
                /* this head's share of dK and dV */
                for (int64_t j = 0; j < M; j++)
                    for (int64_t d = 0; d < D; d++)
                        for (int64_t i = 0; i < L; i++) {
                            const double x = E16(q, c->layout, c->H, L, b, h, i, d);
                            const double dy = E16(go, c->layout, c->H, L, b, h, i, d);
                            rk[j * D + d] += scale * dS[i * M + j] * x;
                            bk[j * D + d] += fabs(scale) * fabs(dS[i * M + j]) * fabs(x);
                            bdk[j * D + d] += fabs(scale) * P[i * M + j] * dD[i] * fabs(x);
                            rv[j * D + d] += P[i * M + j] * dy;
                            bv[j * D + d] += P[i * M + j] * fabs(dy);
                        }
            }
            for (int64_t j = 0; j < M; j++)
                for (int64_t d = 0; d < D; d++) {
                    const int64_t x = at(c->layout, c->Hkv, M, D, b, gg, j, d);
                    const double gk = from16(c->dtype, g[0][1][x]);
                    const double gv = from16(c->dtype, g[0][2][x]);
                    const double ek = fabs(gk - rk[j * D + d]);
                    const double ev = fabs(gv - rv[j * D + d]);
                    worst = fmax(worst, ek / (1.25 * (0x1p-8 * fmax(fabs(rk[j * D + d]), fabs(gk)) +
                                                     (0x1p-8 + 2e-4) * bk[j * D + d] +
                                                     bdk[j * D + d]) + 1e-30));
                    worst = fmax(worst, ev / (1.25 * (0x1p-8 * fmax(fabs(rv[j * D + d]), fabs(gv)) +
                                                     (0x1p-8 + 2e-4) * bv[j * D + d]) + 1e-30));
                }
        }
#undef E16
    print_message("  backward B%lld H%lld/%lld Lq%lld Lk%lld d%lld causal %d "
                  "kl %d layout %d: worst error / bound %.3f\n",
                  (long long)c->B, (long long)c->H, (long long)c->Hkv,
                  (long long)c->Lq, (long long)c->Lk, (long long)c->dh,
                  (int)c->causal, c->key_lengths, (int)c->layout, worst);
    assert_true(worst <= 1.0);
    for (int t = 0; t < 3; t++)
        for (int x = 0; x < 3; x++)
            free(g[t][x]);
    free(P), free(dS), free(dD), free(rq), free(bq), free(rk), free(bk), free(bdk), free(cohv);
    free(rv), free(bv), free(kl), free(u), free(q), free(k), free(v), free(go);
}

static void test_bf16_backward(void **state)
{
    (void)state;
    const hcase cases[] = {
        /* B H Hkv Lq Lk dh causal kl layout dtype scale */
        {1, 2, 2, 40, 40, 64, MHA_CAUSAL_NONE, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {2, 4, 2, 70, 70, 32, MHA_CAUSAL_TOP_LEFT, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {1, 2, 2, 50, 45, 64, MHA_CAUSAL_NONE, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0.2f},
        {1, 2, 1, 33, 100, 64, MHA_CAUSAL_BOTTOM_RIGHT, 0, MHA_LAYOUT_HEADS_FIRST, MHA_DTYPE_BF16, 0},
        {2, 2, 2, 50, 45, 128, MHA_CAUSAL_NONE, 1, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, -0.2f},
        /* widened everywhere: d_h 48, and f16 */
        {1, 2, 2, 20, 30, 48, MHA_CAUSAL_TOP_LEFT, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {1, 2, 1, 24, 24, 32, MHA_CAUSAL_NONE, 1, MHA_LAYOUT_ROWS, MHA_DTYPE_F16, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        run_backward(&cases[c], 3000 + 10 * c);
}

static void test_bf16_shapes(void **state)
{
    (void)state;
    const hcase cases[] = {
        /* B H Hkv Lq Lk dh causal kl layout dtype scale */
        {1, 1, 1, 1, 1, 64, MHA_CAUSAL_NONE, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {2, 4, 4, 37, 37, 64, MHA_CAUSAL_NONE, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {1, 2, 2, 100, 100, 64, MHA_CAUSAL_TOP_LEFT, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {1, 4, 2, 33, 130, 128, MHA_CAUSAL_BOTTOM_RIGHT, 0, MHA_LAYOUT_HEADS_FIRST, MHA_DTYPE_BF16, 0},
        {3, 8, 2, 40, 75, 32, MHA_CAUSAL_NONE, 1, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {2, 2, 1, 64, 64, 96, MHA_CAUSAL_BOTTOM_RIGHT, 1, MHA_LAYOUT_HEADS_FIRST, MHA_DTYPE_BF16, -0.3f},
        {1, 2, 2, 70, 40, 64, MHA_CAUSAL_BOTTOM_RIGHT, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {1, 2, 2, 20, 300, 256, MHA_CAUSAL_NONE, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        /* several 256-key steps: the pipelined walk, rescaling across them */
        {1, 2, 1, 600, 600, 64, MHA_CAUSAL_TOP_LEFT, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
        {2, 1, 1, 40, 1000, 128, MHA_CAUSAL_NONE, 1, MHA_LAYOUT_HEADS_FIRST, MHA_DTYPE_BF16, 0.3f},
        /* d_h not a multiple of 32: widened everywhere */
        {2, 2, 2, 17, 23, 48, MHA_CAUSAL_TOP_LEFT, 0, MHA_LAYOUT_ROWS, MHA_DTYPE_BF16, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        run_case(&cases[c], 1000 + 10 * c);
}

static void test_f16_shapes(void **state)
{
    (void)state;
    const hcase cases[] = {
        {2, 4, 2, 37, 50, 64, MHA_CAUSAL_NONE, 1, MHA_LAYOUT_ROWS, MHA_DTYPE_F16, 0},
        {1, 2, 2, 64, 64, 32, MHA_CAUSAL_TOP_LEFT, 0, MHA_LAYOUT_HEADS_FIRST, MHA_DTYPE_F16, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        run_case(&cases[c], 2000 + 10 * c);
}

/* NaN in, NaN out: a NaN query element makes its row's output and lse
 * NaN, and leaves every other row as it was. */
static void test_nan(void **state)
{
    (void)state;
    enum { L = 40, D = 64 };
    uint16_t q[L * D], k[L * D], v[L * D], o1[L * D], o2[L * D];
    float u[L * D], lse1[L], lse2[L];
    tu_fill(u, L * D, 7, -1.0f, 1.0f);
    for (int x = 0; x < L * D; x++)
        q[x] = k[x] = v[x] = mha_bf16_from_float(u[x]);
    mha_attention_args a = {0};
    a.batch = 1, a.num_heads = 1, a.head_dim = D, a.q_len = L;
    a.dtype = MHA_DTYPE_BF16;
    a.q16 = q, a.k16 = k, a.v16 = v, a.out16 = o1, a.lse = lse1;
    assert_int_equal(mha_attention(&a), MHA_OK);
    q[5 * D + 3] = 0x7FC0;   /* bf16 NaN in row 5 */
    a.out16 = o2, a.lse = lse2;
    assert_int_equal(mha_attention(&a), MHA_OK);
    for (int i = 0; i < L; i++) {
        if (i == 5) {
            assert_true(isnan(lse2[i]));
            for (int d = 0; d < D; d++)
                assert_true(isnan(mha_bf16_to_float(o2[i * D + d])));
        } else {
            assert_memory_equal(o1 + i * D, o2 + i * D, D * 2);
        }
    }
}

/* Scores that could overflow float32 are refused before anything is
 * written, over every head's rows (the kernel scans them head by head):
 * here one large q in the last dim of the last row of head 1 and one
 * large k in head 1.  An Inf is not the scale's to answer for: skipped. */
static void test_score_range(void **state)
{
    (void)state;
    enum { H = 2, L = 40, D = 64, E = H * D };
    static uint16_t q[L * E], k[L * E], v[L * E], o[L * E];
    static float u[L * E];
    tu_fill(u, L * E, 9, -1.0f, 1.0f);
    for (int x = 0; x < L * E; x++)
        q[x] = k[x] = v[x] = mha_bf16_from_float(u[x]);
    q[(L - 1) * E + D + D - 1] = mha_bf16_from_float(3e19f);
    k[5 * E + D + 2] = mha_bf16_from_float(-3e19f);   /* 64 * 9e38 */
    for (int x = 0; x < L * E; x++)
        o[x] = 0x1234;
    mha_attention_args a = {0};
    a.batch = 1, a.num_heads = H, a.head_dim = D, a.q_len = L;
    a.dtype = MHA_DTYPE_BF16;
    a.q16 = q, a.k16 = k, a.v16 = v, a.out16 = o;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "scale"));
    for (int x = 0; x < L * E; x++)
        assert_int_equal(o[x], 0x1234);   /* untouched */
    /* a scale of 1/256 keeps the bound (9e38 / 4) finite: it runs */
    a.given = MHA_GIVEN_SCALE;
    a.scale = 1.0f / 256;
    assert_int_equal(mha_attention(&a), MHA_OK);
    /* the large q as +Inf: skipped by the scan, so the default scale runs
     * (the row of head 1 that holds it is NaN, the others are not) */
    a.given = 0;
    q[(L - 1) * E + D + D - 1] = 0x7F80;
    assert_int_equal(mha_attention(&a), MHA_OK);
    assert_false(isnan(mha_bf16_to_float(o[0])));
}

static void test_misuse(void **state)
{
    (void)state;
    uint16_t q[64], k[64], v[64], o[64];
    float qf[64], of[64];
    memset(q, 0, sizeof q);
    memset(k, 0, sizeof k);
    memset(v, 0, sizeof v);
    mha_attention_args a = {0};
    a.batch = 1, a.num_heads = 1, a.head_dim = 32, a.q_len = 2;
    a.dtype = MHA_DTYPE_BF16;
    a.q16 = q, a.k16 = k, a.v16 = v, a.out16 = o;
    assert_int_equal(mha_attention(&a), MHA_OK);
    /* the float pointers with a 16-bit dtype */
    a.q = qf;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "q must be NULL"));
    a.q = NULL;
    a.out16 = NULL;
    assert_int_equal(mha_attention(&a), MHA_ERR_NULL_POINTER);
    assert_non_null(strstr(mha_last_error(), "out16"));
    /* an output over an input */
    a.out16 = q + 1;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "overlaps"));
    a.out16 = o;
    /* an unknown dtype, and F64 (a file type, not an attention one) */
    a.dtype = (mha_dtype)77;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    a.dtype = MHA_DTYPE_F64;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "dtype"));
    /* 16-bit pointers with float32 */
    a.dtype = MHA_DTYPE_F32;
    a.q = qf, a.k = qf, a.v = qf, a.out = of;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "q16"));
    a.dtype = MHA_DTYPE_BF16;
    a.q = a.k = a.v = NULL, a.out = NULL;
    /* the backwards: each refuses the other's dtype, NULLs, overlaps */
    uint16_t go[64], gq[64], gk[64], gv[64];
    memset(go, 0, sizeof go);
    mha_attention_grads16 g16 = {.grad_out = go, .grad_q = gq,
                                 .grad_k = gk, .grad_v = gv};
    assert_int_equal(mha_attention_backward16(&a, &g16), MHA_OK);
    const mha_attention_grads g32 = {.grad_out = of, .grad_q = of,
                                     .grad_k = of, .grad_v = of};
    assert_int_equal(mha_attention_backward(&a, &g32),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "mha_attention_backward16"));
    g16.grad_q = NULL;
    assert_int_equal(mha_attention_backward16(&a, &g16), MHA_ERR_NULL_POINTER);
    assert_non_null(strstr(mha_last_error(), "grad_q"));
    g16.grad_q = q;   /* over the input q16 */
    assert_int_equal(mha_attention_backward16(&a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "overlaps"));
    g16.grad_q = gq;
    assert_int_equal(mha_attention_backward16(NULL, &g16), MHA_ERR_NULL_POINTER);
    assert_int_equal(mha_attention_backward16(&a, NULL), MHA_ERR_NULL_POINTER);
    float gs[1], fwd_lse[2];
    g16.grad_sinks = gs;   /* without sinks */
    assert_int_equal(mha_attention_backward16(&a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "grad_sinks"));
    a.lse = fwd_lse;   /* the forward's out16 and lse given: the same */
    assert_int_equal(mha_attention(&a), MHA_OK);
    assert_int_equal(mha_attention_backward16(&a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "grad_sinks"));
    a.lse = NULL;
    g16.grad_sinks = NULL;

    /* 16-bit plans: each backward before a run, on changed data or
     * arguments, of the other dtype, refused by name */
    mha_attention_plan *p = NULL;
    assert_int_equal(mha_attention_plan_create(&a, &p), MHA_OK);
    assert_int_equal(mha_attention_plan_backward16(p, &a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "no run to differentiate"));
    assert_int_equal(mha_attention_plan_run(p, &a), MHA_OK);
    assert_int_equal(mha_attention_plan_backward16(p, &a, &g16), MHA_OK);
    assert_int_equal(mha_attention_plan_backward(p, &a, &g32),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "mha_attention_plan_backward16"));
    q[3] ^= 0x40;   /* the data changed since the run */
    assert_int_equal(mha_attention_plan_backward16(p, &a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "changed since"));
    q[3] ^= 0x40;
    o[0] ^= 0x40;   /* (out16: the bf16 kernels' backward reads it) */
    if (kernel_run) {
        assert_int_equal(mha_attention_plan_backward16(p, &a, &g16),
                         MHA_ERR_INVALID_ARGUMENT);
        assert_non_null(strstr(mha_last_error(), "out16"));
    } else {   /* the float32 route reads its own statistics */
        assert_int_equal(mha_attention_plan_backward16(p, &a, &g16), MHA_OK);
    }
    o[0] ^= 0x40;
    mha_attention_args b = a;
    b.causal = MHA_CAUSAL_TOP_LEFT;
    assert_int_equal(mha_attention_plan_backward16(p, &b, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "differ"));
    b = a, b.layout = MHA_LAYOUT_HEADS_FIRST;
    assert_int_equal(mha_attention_plan_backward16(p, &b, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    b = a, b.dtype = MHA_DTYPE_F16;
    assert_int_equal(mha_attention_plan_run(p, &b), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "made for dtype MHA_DTYPE_BF16"));
    assert_int_equal(mha_attention_plan_backward16(p, &a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);   /* a failed run: nothing */
    b = a, b.q_len = 1;
    assert_int_equal(mha_attention_plan_run(p, &b), MHA_ERR_SHAPE);
    b = a, b.q = qf;
    assert_int_equal(mha_attention_plan_run(p, &b), MHA_ERR_INVALID_ARGUMENT);
    b = a, b.out16 = q;
    assert_int_equal(mha_attention_plan_run(p, &b), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "overlaps"));
    assert_int_equal(mha_attention_plan_backward16(NULL, &a, &g16),
                     MHA_ERR_NULL_POINTER);
    assert_int_equal(mha_attention_plan_backward16(p, &a, NULL),
                     MHA_ERR_NULL_POINTER);
    mha_attention_plan_free(p);
    /* a float32 plan: no 16-bit run or backward */
    b = a, b.dtype = MHA_DTYPE_F32, b.q16 = b.k16 = b.v16 = NULL;
    b.out16 = NULL;
    assert_int_equal(mha_attention_plan_create(&b, &p), MHA_OK);
    assert_int_equal(mha_attention_plan_run(p, &a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "made for dtype MHA_DTYPE_F32"));
    assert_int_equal(mha_attention_plan_backward16(p, &a, &g16),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "mha_attention_plan_backward"));
    mha_attention_plan_free(p);
    /* a bad dtype in a plan's shape */
    b = a, b.dtype = (mha_dtype)9;
    p = NULL;
    assert_int_equal(mha_attention_plan_create(&b, &p),
                     MHA_ERR_INVALID_ARGUMENT);
    assert_null(p);
    assert_non_null(strstr(mha_last_error(), "dtype"));
    /* key_lengths outside [0, Lk] */
    const int64_t kl[1] = {3};
    a.key_lengths = kl;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    a.key_lengths = NULL;
    /* absurd sizes: overflow, not a huge allocation */
    a.batch = INT64_MAX / 2;
    assert_int_not_equal(mha_attention(&a), MHA_OK);
}

/*
 * Where a 16-bit call runs on the float32 kernels (every option the bf16
 * kernels do not take, and f16), it is the float32 call on the widened
 * inputs with the output rounded to nearest even, bit for bit: out, lse
 * and the weights, for 1 and 3 threads; and its backward, each gradient
 * the float32 backward's rounded.  (The engine widens per tile,
 * reading the 16-bit arrays where they lie, or, with RoPE, copies: both
 * must give these bits.)  The float32 call is itself held to the float64
 * reference by test_attention and the others.
 */
typedef struct wcase {
    int64_t B, H, Hkv, Lq, Lk, dh, dv;
    mha_causal causal;
    int key_lengths, softcap, alibi, window, sinks, weights, masks, dropout,
        chunk, q_offset, rope;
    mha_layout layout;
} wcase;

static void widened_case(const wcase *c, mha_dtype dt, uint64_t seed)
{
    const int64_t dv = c->dv ? c->dv : c->dh;
    const int64_t nq = c->B * c->Lq * c->H * c->dh,
                  nk = c->B * c->Lk * c->Hkv * c->dh,
                  nv = c->B * c->Lk * c->Hkv * dv,
                  no = c->B * c->Lq * c->H * dv, nl = c->B * c->H * c->Lq,
                  nw = c->weights ? c->B * c->H * c->Lq * c->Lk : 0;
    uint16_t *q = malloc(nq * 2), *k = malloc(nk * 2), *v = malloc(nv * 2);
    float *qf = malloc(nq * 4), *kf = malloc(nk * 4), *vf = malloc(nv * 4);
    float *of = malloc(no * 4), *lf = malloc(nl * 4);
    float *wf = nw ? malloc(nw * 4) : NULL;
    tu_fill(qf, nq, seed, -2.0f, 2.0f);
    tu_fill(kf, nk, seed + 1, -2.0f, 2.0f);
    tu_fill(vf, nv, seed + 2, -3.0f, 3.0f);
    for (int64_t x = 0; x < nq; x++)
        qf[x] = (float)from16(dt, q[x] = to16(dt, qf[x]));
    for (int64_t x = 0; x < nk; x++)
        kf[x] = (float)from16(dt, k[x] = to16(dt, kf[x]));
    for (int64_t x = 0; x < nv; x++)
        vf[x] = (float)from16(dt, v[x] = to16(dt, vf[x]));
    int64_t kl[4];
    for (int64_t b = 0; b < c->B; b++)
        kl[b] = c->Lk - 1 - (b * 37) % c->Lk;
    float sinks[16], bias[4096];
    uint8_t pad[4096];
    for (int64_t h = 0; h < c->H; h++)
        sinks[h] = 0.5f * (float)h - 1.0f;
    assert_true(!c->masks || (c->Lq * c->Lk <= 4096 && c->B * c->Lk <= 4096));
    if (c->masks) {
        tu_fill(bias, c->Lq * c->Lk, seed + 3, -2.0f, 2.0f);
        for (int64_t x = 0; x < c->Lq * c->Lk; x += 7)
            bias[x] = -INFINITY;
        for (int64_t x = 0; x < c->B * c->Lk; x++)
            pad[x] = x % 5 == 3;
    }
    mha_attention_args a = {0};
    a.batch = c->B, a.num_heads = c->H, a.num_kv_heads = c->Hkv;
    a.head_dim = c->dh, a.v_head_dim = c->dv, a.q_len = c->Lq;
    a.kv_len = c->Lk, a.causal = c->causal, a.layout = c->layout;
    a.key_lengths = c->key_lengths ? kl : NULL;
    a.mods.softcap = c->softcap ? 20.0f : 0.0f;
    a.mods.alibi = c->alibi;
    if (c->window) {
        a.mods.window = 1;
        a.mods.window_left = 50;
        a.mods.window_right = 9;
    }
    if (c->rope)
        a.mods.rope.style = MHA_ROPE_NEOX;
    a.sinks = c->sinks ? sinks : NULL;
    if (c->masks) {
        a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, bias, 2, {c->Lq, c->Lk}};
        a.key_padding_mask =
            (mha_mask){MHA_MASK_BLOCK, pad, 2, {c->B, c->Lk}};
    }
    if (c->dropout) {
        a.training = 1;
        a.dropout = 0.25f;
        a.dropout_seed = 99;
    }
    a.attention_chunk = c->chunk;
    if (c->q_offset) {
        a.given = MHA_GIVEN_Q_OFFSET;
        a.q_offset = c->Lk - c->Lq - 3;
    }
    a.need_weights = c->weights ? MHA_WEIGHTS_PER_HEAD : MHA_WEIGHTS_NONE;
    /* the float32 call on the widened inputs */
    mha_attention_args f = a;
    f.q = qf, f.k = kf, f.v = vf, f.out = of, f.lse = lf, f.attn_weights = wf;
    f.num_threads = 2;
    if (mha_attention(&f) != MHA_OK)
        fail_msg("float32: %s", mha_last_error());
    uint16_t *want = malloc(no * 2), *got = malloc(no * 2);
    for (int64_t x = 0; x < no; x++)
        want[x] = to16(dt, of[x]);
    float *lg = malloc(nl * 4), *wg = nw ? malloc(nw * 4) : NULL;
    static const int threads[2] = {1, 3};
    for (int t = 0; t < 2; t++) {
        mha_attention_args h = a;
        h.dtype = dt;
        h.q16 = q, h.k16 = k, h.v16 = v, h.out16 = got;
        h.lse = lg, h.attn_weights = wg, h.num_threads = threads[t];
        memset(got, 0xFF, no * 2);
        if (mha_attention(&h) != MHA_OK)
            fail_msg("16-bit: %s", mha_last_error());
        assert_memory_equal(got, want, no * 2);
        assert_memory_equal(lg, lf, nl * 4);
        if (nw)
            assert_memory_equal(wg, wf, nw * 4);
    }
    /* the backward: the float32 backward's gradients on the same
     * numbers, each rounded (dL/d sinks: float32, the same bits); by the
     * call, which computes the forward again, and by a plan, on the
     * forward it kept */
    {
        uint16_t *go = malloc(no * 2), *g16[3];
        float *gof = malloc(no * 4), *gf[3], gsf[16], gs16[16];
        const int64_t n[3] = {nq, nk, nv};
        tu_fill(gof, no, seed + 4, -1.0f, 1.0f);
        for (int64_t x = 0; x < no; x++)
            gof[x] = (float)from16(dt, go[x] = to16(dt, gof[x]));
        for (int i = 0; i < 3; i++) {
            g16[i] = malloc(n[i] * 2);
            gf[i] = malloc(n[i] * 4);
        }
        mha_attention_args fb = f;
        fb.need_weights = MHA_WEIGHTS_NONE, fb.attn_weights = NULL;
        const mha_attention_grads fg = {gof, gf[0], gf[1], gf[2],
                                        c->sinks ? gsf : NULL};
        if (mha_attention_backward(&fb, &fg) != MHA_OK)
            fail_msg("float32 backward: %s", mha_last_error());
        for (int t = 0; t < 4; t++) {   /* call, call, plan, plan again */
            mha_attention_args h = a;
            h.dtype = dt, h.need_weights = MHA_WEIGHTS_NONE;
            h.q16 = q, h.k16 = k, h.v16 = v, h.num_threads = threads[t % 2];
            const mha_attention_grads16 g = {go, g16[0], g16[1], g16[2],
                                             c->sinks ? gs16 : NULL};
            for (int i = 0; i < 3; i++)
                memset(g16[i], 0xFF, n[i] * 2);
            memset(gs16, 0xFF, sizeof gs16);
            mha_attention_plan *plan = NULL;
            if (t >= 2) {
                h.out16 = got, h.lse = lg;
                if (mha_attention_plan_create(&h, &plan) != MHA_OK ||
                    mha_attention_plan_run(plan, &h) != MHA_OK ||
                    (t == 3 && mha_attention_plan_run(plan, &h) != MHA_OK))
                    fail_msg("16-bit plan: %s", mha_last_error());
                assert_memory_equal(got, want, no * 2);
                assert_memory_equal(lg, lf, nl * 4);
            }
            if ((plan ? mha_attention_plan_backward16(plan, &h, &g)
                      : mha_attention_backward16(&h, &g)) != MHA_OK)
                fail_msg("16-bit backward (%s): %s", plan ? "plan" : "call",
                         mha_last_error());
            mha_attention_plan_free(plan);
            for (int i = 0; i < 3; i++)
                for (int64_t x = 0; x < n[i]; x++)
                    if (g16[i][x] != to16(dt, gf[i][x]))
                        fail_msg("gradient %d element %lld (%s): %04x, the "
                                 "float32 backward's %g rounds to %04x", i,
                                 (long long)x, t >= 2 ? "plan" : "call",
                                 g16[i][x], (double)gf[i][x],
                                 to16(dt, gf[i][x]));
            if (c->sinks)
                assert_memory_equal(gs16, gsf, c->H * sizeof *gsf);
        }
        for (int i = 0; i < 3; i++)
            free(g16[i]), free(gf[i]);
        free(go), free(gof);
    }
    free(want), free(got), free(lg), free(wg);
    free(q), free(k), free(v), free(qf), free(kf), free(vf);
    free(of), free(lf), free(wf);
}

static void test_widened_bits(void **state)
{
    (void)state;
    static const wcase cases[] = {
        /* B H Hkv Lq Lk dh dv: causal, kl, cap, alibi, window, sinks,
         * weights, masks, dropout, chunk, q_offset, rope; layout */
        {2, 4, 2, 70, 130, 48, 0, MHA_CAUSAL_BOTTOM_RIGHT, 1, 1, 0, 0, 0,
         0, 0, 0, 0, 0, 0, MHA_LAYOUT_ROWS},
        {1, 4, 4, 65, 200, 64, 32, MHA_CAUSAL_NONE, 0, 0, 1, 1, 0, 1, 0,
         0, 0, 0, 0, MHA_LAYOUT_HEADS_FIRST},
        {2, 8, 2, 1, 3000, 64, 0, MHA_CAUSAL_NONE, 1, 0, 0, 0, 1, 0, 0, 0,
         0, 0, 0, MHA_LAYOUT_ROWS},           /* split keys, stacked */
        {2, 8, 8, 1, 2100, 32, 0, MHA_CAUSAL_NONE, 0, 1, 0, 0, 0, 0, 0, 0,
         0, 0, 0, MHA_LAYOUT_HEADS_FIRST},    /* split keys */
        {2, 2, 1, 40, 60, 32, 0, MHA_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 0, 1, 1,
         1, 0, 0, 0, MHA_LAYOUT_ROWS},        /* masks, dropout */
        {2, 4, 4, 4, 600, 128, 0, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0,
         0, 0, 0, 128, 1, 0, MHA_LAYOUT_ROWS}, /* chunks, q_offset */
        {1, 4, 2, 33, 77, 64, 0, MHA_CAUSAL_TOP_LEFT, 0, 0, 0, 0, 1, 0, 0,
         0, 0, 0, 1, MHA_LAYOUT_ROWS},        /* RoPE: the copies */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        widened_case(&cases[i], MHA_DTYPE_F16, 700 + i);
        widened_case(&cases[i], MHA_DTYPE_BF16, 800 + i);
    }
}

static void test_kernel_named(void **state)
{
    (void)state;
    const char *k = mha_bf16_kernel(), *want = getenv("MHA_TEST_BF16");
    assert_non_null(k);
    print_message("bf16 kernel: %s\n", k);
    if (want)
        assert_string_equal(k, want);
}

/* MHA_BF16 naming no kernel: every bf16 call refused, naming it. */
static int bad_env_refused(void)
{
    uint16_t q[64] = {0}, k[64] = {0}, v[64] = {0}, o[64];
    mha_attention_args a = {0};
    a.batch = 1, a.num_heads = 1, a.head_dim = 32, a.q_len = 2;
    a.dtype = MHA_DTYPE_BF16;
    a.q16 = q, a.k16 = k, a.v16 = v, a.out16 = o;
    const mha_status st = mha_attention(&a);
    const int ok = mha_bf16_kernel() == NULL &&
                   st == MHA_ERR_INVALID_ARGUMENT &&
                   strstr(mha_last_error(), "MHA_BF16") != NULL;
    printf("MHA_BF16=%s: %s (%s)\n", getenv("MHA_BF16"),
           ok ? "refused" : "NOT refused", mha_last_error());
    return ok ? 0 : 1;
}

int main(void)
{
    /* CTest's entries set MHA_TEST_BF16 to the kernel they test (amx,
     * avx512bf16 or float32, each capped with MHA_BF16): that kernel or
     * a skip (exit 77, by name) when this CPU lacks it; "bad": a wrong
     * MHA_BF16 refused.  Run alone (valgrind's stage) the binary takes
     * whichever kernel is. */
    const char *want = getenv("MHA_TEST_BF16");
    if (want && !strcmp(want, "bad"))
        return bad_env_refused();
    const char *k = mha_bf16_kernel();
    kernel_run = k && strcmp(k, "float32") != 0;
    if (want && (!k || strcmp(k, want))) {
        printf("skipped: this CPU or OS has no %s (test_half_%s)\n",
               !strcmp(want, "amx")     ? "AMX-BF16"
               : !strcmp(want, "bfdot") ? "BF16 (BFDOT, aarch64)"
                                        : "AVX512-BF16",
               want);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_kernel_named),
        cmocka_unit_test(test_bf16_shapes),
        cmocka_unit_test(test_f16_shapes),
        cmocka_unit_test(test_widened_bits),
        cmocka_unit_test(test_bf16_backward),
        cmocka_unit_test(test_nan),
        cmocka_unit_test(test_score_range),
        cmocka_unit_test(test_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
