/*
 * test_forward.c -- the forward pass against the float64 reference, for
 * every option: mask kinds and broadcast shapes, key padding, key lengths,
 * causal alignments, cross-attention with odd kdim/vdim, L = 1, head dims
 * 1, 3, 40, 64, add_bias_kv, add_zero_attn, bias off, weights per head and
 * averaged, dropout.
 *
 * The bound, per tensor: max |mha - ref64| <= 2 * max |naive32 - ref64|
 *                                               + 1e-6 * (1 + max |ref64|)
 * where naive32 is the reference algorithm run in float32.
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

#include "ref.h"
#include "testutil.h"

/* How a test case builds a mask: kind, rank, and which of the batch and
 * head dimensions are 1 (broadcast). */

typedef struct fwd_case {
    const char *name;
    int64_t E, H, kdim, vdim;
    int no_bias, bias_kv, zero_attn;
    float scale, dropout;
    int64_t B, Lq, Lk;
    int cross;          /* separate key/value inputs */
    int kv_same;        /* cross, with key and value the same pointer */
    tu_mask_spec attn, pad;
    int lengths;        /* pass key_lengths */
    mha_causal causal;
    mha_weights_mode weights;
    int64_t kv_heads;   /* grouped-query attention; 0: H */
    int64_t head_dim, v_head_dim;   /* d_h, d_v; 0: E / H, d_h */
} fwd_case;

#define ALLOW MHA_MASK_ALLOW
#define BLOCK MHA_MASK_BLOCK
#define ADD MHA_MASK_ADDITIVE
#define BR MHA_CAUSAL_BOTTOM_RIGHT
#define TL MHA_CAUSAL_TOP_LEFT
#define AVG MHA_WEIGHTS_AVERAGE
#define PER MHA_WEIGHTS_PER_HEAD

static const fwd_case CASES[] = {
    /* name                E  H kd vd nb bkv za scale drop B Lq Lk cr same attn pad len causal weights H_kv d_h d_v */
    {"self plain",         8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 5, 0, 0, 0, {0}, {0}, 0, 0, AVG, 0, 0, 0},
    {"allow (Lq,Lk)",      8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 5, 0, 0, 0, {ALLOW, 2, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"block (B,Lq,Lk)",    8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 4, 0, 0, 0, {BLOCK, 3, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"block (1,Lq,Lk)",    8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 4, 0, 0, 0, {BLOCK, 3, 1, 0}, {0}, 0, 0, AVG, 0, 0, 0},
    {"additive (B,H,..)",  8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 6, 0, 0, 0, {ADD, 4, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"additive (1,H,..)",  8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 6, 0, 0, 0, {ADD, 4, 1, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"allow (B,1,..)",     12, 3, 0, 0, 0, 0, 0, 0, 0, 2, 6, 0, 0, 0, {ALLOW, 4, 0, 1}, {0}, 0, 0, PER, 0, 0, 0},
    {"allow (1,1,Lq,Lk)",  8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 5, 0, 0, 0, {ALLOW, 4, 1, 1}, {0}, 0, 0, PER, 0, 0, 0},
    /* one (Lq, Lk) mask for every batch and head, over many key tiles */
    {"add (1,1,..) tiles", 16, 2, 0, 0, 0, 0, 0, 0, 0, 2, 70, 130, 1, 0, {ADD, 4, 1, 1}, {BLOCK, 2, 0, 0}, 0, BR, AVG, 0, 0, 0},
    {"additive (Lq,Lk)",   8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 6, 0, 0, 0, {ADD, 2, 0, 0}, {0}, 0, 0, AVG, 0, 0, 0},
    {"pad allow (B,Lk)",   8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 5, 0, 0, 0, {0}, {ALLOW, 2, 0, 0}, 0, 0, PER, 0, 0, 0},
    {"pad block (Lk)",     8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 5, 0, 0, 0, {0}, {BLOCK, 1, 0, 0}, 0, 0, PER, 0, 0, 0},
    {"pad additive (1,Lk)",8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 5, 0, 0, 0, {0}, {ADD, 2, 1, 0}, 0, 0, PER, 0, 0, 0},
    {"key lengths",        8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 6, 0, 0, 0, {0}, {0}, 1, 0, PER, 0, 0, 0},
    {"causal Lq=Lk",       8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 7, 0, 0, 0, {0}, {0}, 0, BR, PER, 0, 0, 0},
    /* key lengths below the causal limit of some rows, no explicit mask:
     * only the index-masked tiles stand between those rows and key len */
    {"causal + lengths",   8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 8, 0, 0, 0, {0}, {0}, 1, BR, PER, 0, 0, 0},
    /* ... and equal to the block's last row's limit (lengths 1, 2, 3 of
     * Lk = 4): the tile walk itself reaches key len */
    {"causal, len = Lk-1", 8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 4, 0, 0, 0, {0}, {0}, 1, BR, PER, 0, 0, 0},
    {"causal TL + lengths",8, 2, 0, 0, 0, 0, 0, 0, 0, 3, 9, 70, 1, 0, {0}, {0}, 1, TL, AVG, 0, 0, 0},
    {"causal BR Lq<Lk",    8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 3, 8, 1, 0, {0}, {0}, 0, BR, PER, 0, 0, 0},
    {"causal BR Lq>Lk",    8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 8, 3, 1, 0, {0}, {0}, 0, BR, PER, 0, 0, 0},
    {"causal TL Lq<Lk",    8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 3, 8, 1, 0, {0}, {0}, 0, TL, PER, 0, 0, 0},
    {"causal TL Lq>Lk",    8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 8, 3, 1, 0, {0}, {0}, 0, TL, AVG, 0, 0, 0},
    {"cross kdim5 vdim7",  8, 2, 5, 7, 0, 0, 0, 0, 0, 2, 3, 6, 1, 0, {0}, {0}, 0, 0, PER, 0, 0, 0},
    {"cross kdim=vdim=3",  6, 3, 3, 3, 0, 0, 0, 0, 0, 2, 4, 5, 1, 1, {BLOCK, 2, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"cross same k/v ptr", 8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 4, 6, 1, 1, {0}, {0}, 0, 0, AVG, 0, 0, 0},
    {"cross separate k/v", 8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 4, 6, 1, 0, {0}, {0}, 0, 0, AVG, 0, 0, 0},
    {"L = 1",              8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 1, 0, 0, 0, {0}, {0}, 0, BR, PER, 0, 0, 0},
    {"Lq = 1, Lk = 9",     8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 1, 9, 1, 0, {ADD, 3, 0, 0}, {0}, 0, BR, PER, 0, 0, 0},
    {"head dim 1",         4, 4, 0, 0, 0, 0, 0, 0, 0, 2, 5, 0, 0, 0, {ALLOW, 2, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"head dim 3",         9, 3, 0, 0, 0, 0, 0, 0, 0, 2, 5, 0, 0, 0, {0}, {BLOCK, 2, 0, 0}, 0, BR, PER, 0, 0, 0},
    {"head dim 40",        80, 2, 0, 0, 0, 0, 0, 0, 0, 2, 9, 0, 0, 0, {ADD, 4, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"head dim 64",        128, 2, 0, 0, 0, 0, 0, 0, 0, 2, 17, 0, 0, 0, {0}, {0}, 1, BR, AVG, 0, 0, 0},
    {"add_bias_kv",        8, 2, 0, 0, 0, 1, 0, 0, 0, 2, 5, 0, 0, 0, {BLOCK, 2, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"add_zero_attn",      8, 2, 0, 0, 0, 0, 1, 0, 0, 2, 5, 0, 0, 0, {0}, {ALLOW, 2, 0, 0}, 0, 0, PER, 0, 0, 0},
    {"bias_kv + zero_attn",8, 2, 5, 7, 0, 1, 1, 0, 0, 2, 4, 6, 1, 0, {ADD, 4, 0, 0}, {0}, 1, BR, PER, 0, 0, 0},
    {"bias off",           8, 2, 0, 0, 1, 0, 0, 0, 0, 2, 5, 0, 0, 0, {ALLOW, 3, 0, 0}, {0}, 0, 0, AVG, 0, 0, 0},
    {"bias off + bias_kv", 8, 2, 0, 0, 1, 1, 1, 0, 0, 2, 5, 0, 0, 0, {0}, {0}, 0, TL, PER, 0, 0, 0},
    {"custom scale",       8, 2, 0, 0, 0, 0, 0, 0.9f, 0, 2, 5, 0, 0, 0, {0}, {0}, 0, 0, PER, 0, 0, 0},
    {"negative scale",     8, 2, 0, 0, 0, 0, 0, -0.3f, 0, 2, 5, 0, 0, 0, {ADD, 2, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"everything",         12, 3, 5, 7, 0, 1, 1, 0, 0, 3, 6, 9, 1, 0, {BLOCK, 4, 0, 1}, {ADD, 2, 0, 0}, 1, BR, PER, 0, 0, 0},
    {"dropout 0.3",        8, 2, 0, 0, 0, 0, 0, 0, 0.3f, 2, 6, 0, 0, 0, {ALLOW, 2, 0, 0}, {0}, 0, 0, PER, 0, 0, 0},
    {"dropout + extras",   8, 2, 5, 7, 0, 1, 1, 0, 0.5f, 2, 4, 6, 1, 0, {0}, {0}, 0, BR, AVG, 0, 0, 0},
    /* Grouped-query and multi-query attention (the last field: H_kv). */
    {"GQA 4/2, causal",    16, 4, 0, 0, 0, 0, 0, 0, 0, 2, 7, 0, 0, 0, {0}, {0}, 0, BR, PER, 2, 0, 0},
    {"MQA 4/1, everything",16, 4, 5, 7, 0, 1, 1, 0, 0, 2, 5, 9, 1, 0, {ADD, 4, 0, 0}, {BLOCK, 2, 0, 0}, 1, 0, AVG, 1, 0, 0},
    {"GQA 6/3, dropout",   12, 6, 0, 0, 0, 0, 0, 0, 0.3f, 2, 6, 0, 0, 0, {ALLOW, 2, 0, 0}, {0}, 0, 0, PER, 3, 0, 0},
    {"GQA 4/2, 70 keys",   16, 4, 0, 0, 0, 0, 0, 0, 0, 1, 3, 70, 1, 1, {0}, {0}, 1, BR, PER, 2, 0, 0},
    /* Values d_v wide beside keys d_h wide (MLA: 128 beside 192; the last
     * two fields: d_h, d_v), with every extra that has value rows. */
    {"d_v 6 > d_h 4",      8, 2, 0, 0, 0, 0, 0, 0, 0, 2, 6, 0, 0, 0, {0}, {0}, 0, BR, PER, 0, 0, 6},
    {"d_v 3 < d_h 4, cross",8, 2, 5, 7, 0, 1, 1, 0, 0, 2, 4, 6, 1, 0, {ADD, 4, 0, 0}, {0}, 1, BR, PER, 0, 0, 3},
    {"d_v 5, GQA 4/2, drop",16, 4, 0, 0, 0, 0, 0, 0, 0.3f, 2, 5, 0, 0, 0, {0}, {BLOCK, 2, 0, 0}, 0, 0, AVG, 2, 0, 5},
    {"MLA-ish 6/4, 70 keys",12, 2, 0, 0, 0, 0, 0, 0, 0, 1, 3, 70, 1, 1, {0}, {0}, 1, BR, PER, 1, 6, 4},
    {"d_v 2, no bias",     8, 2, 0, 0, 1, 1, 0, 0, 0, 2, 5, 0, 0, 0, {0}, {0}, 0, TL, PER, 0, 0, 2},
};

static void check_tensor(const char *cname, const char *what, const float *got,
                         const double *ref, const float *naive, int64_t n)
{
    double *naive_d = malloc((size_t)n * sizeof *naive_d);
    for (int64_t k = 0; k < n; k++)
        naive_d[k] = naive[k];
    double err = ref_max_err_f32(got, ref, n);
    double naive_err = ref_max_err_f32(naive, ref, n);
    double tol = ref_tolerance(naive_err, ref_max_abs(ref, n));
    if (!(err <= tol))
        fail_msg("%s: %s error %.3g exceeds bound %.3g (naive f32 error %.3g)",
                 cname, what, err, tol, naive_err);
    free(naive_d);
}

static void run_case(const fwd_case *c, uint64_t seed)
{
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.num_kv_heads = c->kv_heads;
    cfg.kdim = c->kdim;
    cfg.vdim = c->vdim;
    cfg.no_bias = c->no_bias;
    cfg.add_bias_kv = c->bias_kv;
    cfg.add_zero_attn = c->zero_attn;
    cfg.scale = c->scale;
    cfg.dropout = c->dropout;
    cfg.head_dim = c->head_dim;
    cfg.v_head_dim = c->v_head_dim;
    mha_module *m = tu_module(&cfg, seed);
    assert_non_null(m);
    mha_config rc;
    mha_get_config(m, &rc);

    const int64_t B = c->B, Lq = c->Lq, Lk = c->Lk ? c->Lk : c->Lq, E = c->E;
    const int64_t H = c->H, Lt = mha_total_keys(m, Lk);
    float *q = malloc((size_t)(B * Lq * E) * sizeof *q);
    float *k = malloc((size_t)(B * Lk * rc.kdim) * sizeof *k);
    float *v = malloc((size_t)(B * Lk * rc.vdim) * sizeof *v);
    tu_fill(q, B * Lq * E, seed + 1, -1.5f, 1.5f);
    tu_fill(k, B * Lk * rc.kdim, seed + 2, -1.5f, 1.5f);
    tu_fill(v, B * Lk * rc.vdim, seed + 3, -1.5f, 1.5f);
    int64_t lengths[8];
    for (int64_t b = 0; b < B; b++)
        lengths[b] = (Lk * (b + 1)) / (B + 1);   /* includes short ones */

    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = Lq;
    a.kv_len = c->Lk;
    a.query = q;
    if (c->cross) {
        a.key = k;
        a.value = c->kv_same ? k : v;
    }
    void *am = tu_make_mask(&c->attn, B, H, Lq, Lk, 1, seed + 4, &a.attn_mask);
    void *pm = tu_make_mask(&c->pad, B, H, Lq, Lk, 0, seed + 5,
                         &a.key_padding_mask);
    a.key_lengths = c->lengths ? lengths : NULL;
    a.causal = c->causal;
    a.training = c->dropout > 0;
    a.dropout_seed = seed * 7 + 3;
    a.need_weights = c->weights;

    const int64_t n_out = B * Lq * E, n_wh = B * H * Lq * Lt;
    const int64_t n_w = c->weights == PER ? n_wh : B * Lq * Lt;
    float *out = malloc((size_t)n_out * sizeof *out);
    float *w = malloc((size_t)n_w * sizeof *w);
    a.out = out;
    a.attn_weights = w;
    mha_status st = mha_forward(m, &a);
    if (st != MHA_OK)
        fail_msg("%s: mha_forward: %s", c->name, mha_last_error());

    double *out64 = malloc((size_t)n_out * sizeof *out64);
    double *w64 = malloc((size_t)n_wh * sizeof *w64);
    double *w64a = malloc((size_t)(B * Lq * Lt) * sizeof *w64a);
    float *out32 = malloc((size_t)n_out * sizeof *out32);
    float *w32 = malloc((size_t)n_wh * sizeof *w32);
    assert_int_equal(ref_forward_f64(m, &a, out64, w64), 0);
    assert_int_equal(ref_forward_f32(m, &a, out32, w32), 0);
    check_tensor(c->name, "output", out, out64, out32, n_out);
    if (c->weights == PER) {
        check_tensor(c->name, "per-head weights", w, w64, w32, n_wh);
    } else {
        double *w32d = malloc((size_t)n_wh * sizeof *w32d);
        double *w32a = malloc((size_t)(B * Lq * Lt) * sizeof *w32a);
        float *w32af = malloc((size_t)(B * Lq * Lt) * sizeof *w32af);
        for (int64_t t = 0; t < n_wh; t++)
            w32d[t] = w32[t];
        ref_average_heads(w64, B, H, Lq, Lt, w64a);
        ref_average_heads(w32d, B, H, Lq, Lt, w32a);
        for (int64_t t = 0; t < B * Lq * Lt; t++)
            w32af[t] = (float)w32a[t];
        check_tensor(c->name, "averaged weights", w, w64a, w32af, B * Lq * Lt);
        free(w32d);
        free(w32a);
        free(w32af);
    }
    free(out64); free(w64); free(w64a); free(out32); free(w32);
    free(out); free(w); free(am); free(pm); free(q); free(k); free(v);
    mha_free(m);
}

static void test_all_cases(void **state)
{
    (void)state;
    const size_t n = sizeof CASES / sizeof CASES[0];
    for (size_t i = 0; i < n; i++)
        for (uint64_t seed = 1; seed <= 3; seed++)
            run_case(&CASES[i], seed * 1000 + i);
}

/* The reference's own sanity: weights rows sum to 1 (or 0 when the row has
 * no key), so the oracle cannot silently drift with the library. */
static void test_reference_rows_sum_to_one(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 8;
    cfg.num_heads = 2;
    mha_module *m = tu_module(&cfg, 5);
    float q[2 * 4 * 8];
    tu_fill(q, 64, 9, -1, 1);
    uint8_t allow[16] = {1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1};
    mha_forward_args a = {0};
    a.batch = 2;
    a.q_len = 4;
    a.query = q;
    a.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 2, {4, 4}};
    double out[64], w[2 * 2 * 16];
    ref_forward_f64(m, &a, out, w);
    for (int r = 0; r < 2 * 2 * 4; r++) {
        double s = 0;
        for (int j = 0; j < 4; j++)
            s += w[r * 4 + j];
        int row = r % 4;
        assert_true(fabs(s - (row == 1 ? 0.0 : 1.0)) < 1e-12);
    }
    mha_free(m);
}

int main(void)
{
    if (tu_backend_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reference_rows_sum_to_one),
        cmocka_unit_test(test_all_cases),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
