/*
 * test_heads.c -- head masks, heads wider or narrower than E / H, and head
 * pruning: the forward under a head mask against the float64 reference;
 * ablating a head equals pruning it; ablating every head leaves
 * out_proj.bias; pruned modules save, load and keep the kept heads'
 * attention weights; every bad argument of mha_prune_heads.
 *
 * The bound is test_forward's: max |mha - ref64| <= 2 * max |naive32 -
 * ref64| + 1e-6 (1 + max |ref64|), naive32 the reference run in float32.
 * Head-mask gradients are checked against central differences with the
 * other gradients, in test_backward.
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

typedef struct heads_case {
    const char *name;
    int64_t E, H, head_dim, kdim, vdim;
    int no_bias, bias_kv, zero_attn;
    int64_t B, Lq, Lk;
    int cross;
    mha_causal causal;
    int64_t v_head_dim;   /* d_v; 0: d_h */
} heads_case;

static const heads_case CASES[] = {
    /* name              E  H hd kd vd nb bkv za B Lq Lk cross causal d_v */
    {"self, 4 heads",    8, 4, 0, 0, 0, 0, 0, 0, 2, 5, 0, 0, MHA_CAUSAL_NONE, 0},
    {"cross, extras",   12, 3, 0, 5, 7, 0, 1, 1, 2, 4, 6, 1, MHA_CAUSAL_NONE, 0},
    {"no bias, causal",  8, 4, 0, 0, 0, 1, 0, 0, 3, 6, 0, 0,
     MHA_CAUSAL_BOTTOM_RIGHT, 0},
    {"head_dim 3",       8, 4, 3, 0, 0, 0, 0, 0, 2, 5, 0, 0, MHA_CAUSAL_NONE, 0},
    {"head_dim 5 cross", 6, 3, 5, 4, 0, 0, 1, 0, 2, 3, 5, 1,
     MHA_CAUSAL_TOP_LEFT, 0},
    /* values of their own width: a head's v rows and out_proj columns
     * are d_v, its q and k rows d_h */
    {"d_v 5, d_h 3, extras", 8, 4, 3, 5, 7, 0, 1, 1, 2, 4, 6, 1,
     MHA_CAUSAL_NONE, 5},
};

static float *fmalloc(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    assert_non_null(p);
    return p;
}

/* One case's module and inputs. */
typedef struct setup {
    mha_module *m;
    mha_config rc;
    float *q, *k, *v, *out;
    int64_t n_out;
    mha_forward_args a;
} setup;

static void setup_init(setup *s, const heads_case *c, uint64_t seed)
{
    memset(s, 0, sizeof *s);
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.head_dim = c->head_dim;
    cfg.v_head_dim = c->v_head_dim;
    cfg.kdim = c->kdim;
    cfg.vdim = c->vdim;
    cfg.no_bias = c->no_bias;
    cfg.add_bias_kv = c->bias_kv;
    cfg.add_zero_attn = c->zero_attn;
    s->m = tu_module(&cfg, seed);
    assert_non_null(s->m);
    assert_int_equal(mha_get_config(s->m, &s->rc), MHA_OK);
    const int64_t Lk = c->Lk ? c->Lk : c->Lq;
    s->n_out = c->B * c->Lq * c->E;
    s->q = fmalloc(s->n_out);
    s->k = fmalloc(c->B * Lk * s->rc.kdim);
    s->v = fmalloc(c->B * Lk * s->rc.vdim);
    s->out = fmalloc(s->n_out);
    tu_fill(s->q, s->n_out, seed + 1, -1, 1);
    tu_fill(s->k, c->B * Lk * s->rc.kdim, seed + 2, -1, 1);
    tu_fill(s->v, c->B * Lk * s->rc.vdim, seed + 3, -1, 1);
    s->a.batch = c->B;
    s->a.q_len = c->Lq;
    s->a.kv_len = c->Lk;
    s->a.query = s->q;
    s->a.key = c->cross ? s->k : NULL;
    s->a.value = c->cross ? s->v : NULL;
    s->a.causal = c->causal;
    s->a.out = s->out;
}

static void setup_free(setup *s)
{
    free(s->q); free(s->k); free(s->v); free(s->out);
    mha_free(s->m);
}

/* `got` against the reference forward of m with arguments a; returns the
 * bound it met. */
static double expect_ref(const char *what, const float *got,
                         const mha_module *m, const mha_forward_args *a,
                         int64_t n_out)
{
    double *ref = malloc((size_t)n_out * sizeof *ref);
    float *naive = fmalloc(n_out);
    assert_non_null(ref);
    assert_int_equal(ref_forward_f64(m, a, ref, NULL), 0);
    assert_int_equal(ref_forward_f32(m, a, naive, NULL), 0);
    const double err = ref_max_err_f32(got, ref, n_out);
    const double tol = ref_tolerance(ref_max_err_f32(naive, ref, n_out),
                                     ref_max_abs(ref, n_out));
    if (!(err <= tol))
        fail_msg("%s: error %.3g > bound %.3g", what, err, tol);
    free(ref);
    free(naive);
    return tol;
}

/* m's forward with arguments a, checked against the reference. */
static double check_forward(const char *what, const mha_module *m,
                            const mha_forward_args *a, int64_t n_out)
{
    if (mha_forward(m, a) != MHA_OK)
        fail_msg("%s: %s", what, mha_last_error());
    return expect_ref(what, a->out, m, a, n_out);
}

/* Any finite factors, including 0 and negative ones, against the
 * reference; a mask of ones is the unmasked forward, bit for bit. */
static void test_head_mask_forward(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        const heads_case *c = &CASES[i];
        setup s;
        setup_init(&s, c, 10 + i);
        float hm[8], ones[8];
        tu_fill(hm, c->H, 20 + i, -2, 2);
        hm[0] = 0.0f;
        for (int64_t h = 0; h < c->H; h++)
            ones[h] = 1.0f;
        s.a.head_mask = hm;
        check_forward(c->name, s.m, &s.a, s.n_out);
        float *plain = fmalloc(s.n_out);
        s.a.head_mask = NULL;
        s.a.out = plain;
        check_forward(c->name, s.m, &s.a, s.n_out);
        s.a.head_mask = ones;
        s.a.out = s.out;
        assert_int_equal(mha_forward(s.m, &s.a), MHA_OK);
        assert_memory_equal(plain, s.out, (size_t)s.n_out * sizeof(float));
        free(plain);
        setup_free(&s);
    }
}

/* The seeds' exercise: with every head removed only out_proj.bias is left
 * (zero without biases), exactly; the attention weights are unchanged. */
static void test_ablate_all_heads(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        const heads_case *c = &CASES[i];
        setup s;
        setup_init(&s, c, 30 + i);
        const float zeros[8] = {0};
        const int64_t Lt = mha_total_keys(s.m, c->Lk ? c->Lk : c->Lq);
        const int64_t n_w = c->B * c->H * c->Lq * Lt;
        float *w1 = fmalloc(n_w), *w2 = fmalloc(n_w);
        s.a.need_weights = MHA_WEIGHTS_PER_HEAD;
        s.a.attn_weights = w1;
        assert_int_equal(mha_forward(s.m, &s.a), MHA_OK);
        s.a.head_mask = zeros;
        s.a.attn_weights = w2;
        assert_int_equal(mha_forward(s.m, &s.a), MHA_OK);
        assert_memory_equal(w1, w2, (size_t)n_w * sizeof(float));
        float *bias = fmalloc(c->E);
        if (c->no_bias)
            memset(bias, 0, (size_t)c->E * sizeof *bias);
        else
            assert_int_equal(mha_param_get(s.m, "out_proj.bias", bias, c->E),
                             MHA_OK);
        for (int64_t r = 0; r < c->B * c->Lq; r++)
            assert_memory_equal(s.out + r * c->E, bias,
                                (size_t)c->E * sizeof *bias);
        free(bias); free(w1); free(w2);
        setup_free(&s);
    }
}

/* Pruning to `keep` equals ablating the other heads: outputs within the
 * reference bound of the ablated module's exact output, the kept heads'
 * attention weights, parameters moved as mha.h says. */
static void check_prune(const heads_case *c, setup *s, const int64_t *keep,
                        int64_t n_keep)
{
    char what[128];
    snprintf(what, sizeof what, "%s, keep %lld heads from %lld", c->name,
             (long long)n_keep, (long long)keep[0]);
    mha_module *p = NULL;
    if (mha_prune_heads(s->m, keep, n_keep, &p) != MHA_OK)
        fail_msg("%s: %s", what, mha_last_error());
    mha_config pc;
    assert_int_equal(mha_get_config(p, &pc), MHA_OK);
    assert_int_equal(pc.num_heads, n_keep);
    assert_int_equal(pc.head_dim, s->rc.head_dim);
    assert_int_equal(pc.v_head_dim, s->rc.v_head_dim);
    assert_int_equal(pc.embed_dim, s->rc.embed_dim);
    assert_true(pc.scale == s->rc.scale);
    /* out_proj's columns: the heads' values, d_v each */
    const int64_t dh = pc.v_head_dim, D = n_keep * dh, E = pc.embed_dim;
    mha_param_info info;
    assert_int_equal(mha_param_info_by_name(p, "out_proj.weight", &info),
                     MHA_OK);
    assert_int_equal(info.shape[0], E);
    assert_int_equal(info.shape[1], D);
    /* out_proj.weight: column block i of the pruned = block keep[i]. */
    const int64_t Do = s->rc.num_heads * dh;
    float *wo = fmalloc(E * Do), *wp = fmalloc(E * D);
    mha_param_get(s->m, "out_proj.weight", wo, E * Do);
    mha_param_get(p, "out_proj.weight", wp, E * D);
    for (int64_t e = 0; e < E; e++)
        for (int64_t i = 0; i < n_keep; i++)
            assert_memory_equal(wp + e * D + i * dh, wo + e * Do + keep[i] * dh,
                                (size_t)dh * sizeof(float));
    free(wo); free(wp);

    /* The ablated original (exact reference) and the pruned module. */
    float hm[8] = {0};
    for (int64_t i = 0; i < n_keep; i++)
        hm[keep[i]] = 1.0f;
    mha_forward_args abl = s->a;
    abl.head_mask = hm;
    float *out_abl = fmalloc(s->n_out);
    abl.out = out_abl;
    const double tol = check_forward(what, s->m, &abl, s->n_out);
    mha_forward_args pa = s->a;
    float *out_p = fmalloc(s->n_out);
    pa.out = out_p;
    if (mha_forward(p, &pa) != MHA_OK)
        fail_msg("%s: pruned forward: %s", what, mha_last_error());
    /* the pruned output against the ablated module's exact output */
    expect_ref(what, out_p, s->m, &abl, s->n_out);
    /* and the two float32 results agree as closely with each other */
    double diff = 0;
    for (int64_t k = 0; k < s->n_out; k++)
        diff = fmax(diff, fabs((double)out_p[k] - out_abl[k]));
    assert_true(diff <= 2 * tol);

    /* The pruned module's head i attends exactly as the original's head
     * keep[i] (within rounding of its projections). */
    const int64_t B = c->B, Lq = c->Lq, H = c->H;
    const int64_t Lt = mha_total_keys(s->m, c->Lk ? c->Lk : c->Lq);
    double *w_ref = malloc((size_t)(B * H * Lq * Lt) * sizeof *w_ref);
    double *ref = malloc((size_t)s->n_out * sizeof *ref);
    assert_int_equal(ref_forward_f64(s->m, &s->a, ref, w_ref), 0);
    float *w_p = fmalloc(B * n_keep * Lq * Lt);
    pa.need_weights = MHA_WEIGHTS_PER_HEAD;
    pa.attn_weights = w_p;
    assert_int_equal(mha_forward(p, &pa), MHA_OK);
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < n_keep; i++)
            for (int64_t r = 0; r < Lq * Lt; r++) {
                const double want = w_ref[((b * H + keep[i]) * Lq) * Lt + r];
                const float got = w_p[((b * n_keep + i) * Lq) * Lt + r];
                if (!(fabs(got - want) <= 1e-5))
                    fail_msg("%s: pruned head %lld weight %g, original head "
                             "%lld's %g", what, (long long)i, (double)got,
                             (long long)keep[i], want);
            }
    free(w_ref); free(w_p); free(ref);
    free(out_abl); free(out_p);
    mha_free(p);
}

static void test_prune_equals_ablation(void **state)
{
    (void)state;
    static const int64_t keeps[][4] = {{0, 2}, {3, 1}, {1}, {2, 0, 1, 3}};
    static const int64_t n_keeps[] = {2, 2, 1, 4};
    for (size_t i = 0; i < sizeof CASES / sizeof *CASES; i++) {
        const heads_case *c = &CASES[i];
        setup s;
        setup_init(&s, c, 50 + i);
        for (size_t t = 0; t < sizeof n_keeps / sizeof *n_keeps; t++) {
            int64_t keep[4], n = 0;
            for (int64_t j = 0; j < n_keeps[t]; j++)
                if (keeps[t][j] < c->H)
                    keep[n++] = keeps[t][j];
            if (n > 0)
                check_prune(c, &s, keep, n);
        }
        setup_free(&s);
    }
}

/* A pruned module saves and loads (out_proj.weight [E, D], D != E) and
 * computes the same, bit for bit. */
static void pruned_save_load(const heads_case *c)
{
    setup s;
    setup_init(&s, c, 70);
    const int64_t keep[2] = {2, 0};
    mha_module *p = NULL, *back = NULL;
    assert_int_equal(mha_prune_heads(s.m, keep, 2, &p), MHA_OK);
    char path[512];
    snprintf(path, sizeof path, "%s/pruned.safetensors", tu_tmpdir);
    assert_int_equal(mha_module_save(p, path), MHA_OK);
    assert_int_equal(mha_module_load(path, 0, &back), MHA_OK);
    mha_config pc, bc;
    mha_get_config(p, &pc);
    mha_get_config(back, &bc);
    assert_int_equal(bc.num_heads, 2);
    assert_int_equal(bc.head_dim, pc.head_dim);
    assert_int_equal(bc.v_head_dim, pc.v_head_dim);
    assert_int_equal(bc.kdim, pc.kdim);
    assert_int_equal(bc.add_bias_kv, 1);
    assert_int_equal(bc.add_zero_attn, 1);
    float *o1 = fmalloc(s.n_out), *o2 = fmalloc(s.n_out);
    s.a.out = o1;
    assert_int_equal(mha_forward(p, &s.a), MHA_OK);
    s.a.out = o2;
    assert_int_equal(mha_forward(back, &s.a), MHA_OK);
    assert_memory_equal(o1, o2, (size_t)s.n_out * sizeof(float));
    mha_free(back);
    /* the file says 2 heads: 3 given is refused, not preferred */
    assert_fails(mha_module_load(path, 3, &back), MHA_ERR_INVALID_ARGUMENT,
                 "__metadata__ says num_heads 2");
    assert_null(back);
    free(o1); free(o2);
    mha_free(p);
    setup_free(&s);
}

static void test_pruned_save_load(void **state)
{
    (void)state;
    pruned_save_load(&CASES[1]);   /* cross, kdim/vdim, extras */
    pruned_save_load(&CASES[5]);   /* ... values of their own width */
}

static void test_prune_errors(void **state)
{
    (void)state;
    setup s;
    setup_init(&s, &CASES[0], 80);   /* 4 heads */
    mha_module *p = (mha_module *)&p;   /* must be reset to NULL */
    const int64_t ok[2] = {0, 1}, twice[2] = {1, 1}, out_of[2] = {0, 4},
                  neg[1] = {-1};
    assert_fails(mha_prune_heads(s.m, ok, 2, NULL), MHA_ERR_NULL_POINTER,
                 "output");
    assert_fails(mha_prune_heads(NULL, ok, 2, &p), MHA_ERR_NULL_POINTER,
                 "module");
    assert_null(p);
    assert_fails(mha_prune_heads(s.m, NULL, 2, &p), MHA_ERR_NULL_POINTER,
                 "keep");
    assert_fails(mha_prune_heads(s.m, ok, 0, &p), MHA_ERR_INVALID_ARGUMENT,
                 "out_proj.bias");
    assert_fails(mha_prune_heads(s.m, ok, 5, &p), MHA_ERR_INVALID_ARGUMENT,
                 "n_keep");
    assert_fails(mha_prune_heads(s.m, twice, 2, &p), MHA_ERR_INVALID_ARGUMENT,
                 "twice");
    assert_fails(mha_prune_heads(s.m, out_of, 2, &p),
                 MHA_ERR_INVALID_ARGUMENT, "keep[1] = 4");
    assert_fails(mha_prune_heads(s.m, neg, 1, &p), MHA_ERR_INVALID_ARGUMENT,
                 "keep[0] = -1");
    assert_null(p);
    /* head_dim is checked like the other widths */
    mha_config cfg = {0};
    cfg.embed_dim = 8;
    cfg.num_heads = 3;
    cfg.head_dim = -1;
    assert_fails(mha_create(&cfg, &p), MHA_ERR_INVALID_CONFIG, "head_dim");
    cfg.head_dim = 0;   /* 3 does not divide 8 */
    assert_fails(mha_create(&cfg, &p), MHA_ERR_INVALID_CONFIG, "divisible");
    cfg.head_dim = 0x7fffffff;
    assert_fails(mha_create(&cfg, &p), MHA_ERR_INVALID_CONFIG, "head_dim");
    cfg.head_dim = 5;   /* 3 heads of 5 over E = 8: fine */
    assert_int_equal(mha_create(&cfg, &p), MHA_OK);
    mha_config rc;
    mha_get_config(p, &rc);
    assert_true(rc.scale == (float)(1.0 / sqrt(5.0)));
    assert_int_equal(mha_param_numel(p), 3 * 15 * 8 + 3 * 15 + 8 * 15 + 8);
    mha_free(p);
    setup_free(&s);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_head_mask_forward),
        cmocka_unit_test(test_ablate_all_heads),
        cmocka_unit_test(test_prune_equals_ablation),
        cmocka_unit_test(test_pruned_save_load),
        cmocka_unit_test(test_prune_errors),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
