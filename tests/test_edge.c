/*
 * test_edge.c -- the corners of the contract: fully masked rows, -inf
 * masks, huge logits, NaN in masked-out keys, dropout's scale and
 * reproducibility, weights that do not disturb the output, aliasing.
 * (The dropout generator itself: tests/test_dropout.c.)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "testutil.h"

enum { E = 8, H = 2, B = 2, L = 5 };

static mha_module *module(int no_bias, float dropout, int bias_kv)
{
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.no_bias = no_bias;
    cfg.dropout = dropout;
    cfg.add_bias_kv = bias_kv;
    mha_module *m = tu_module(&cfg, 77);
    assert_non_null(m);
    return m;
}

static mha_forward_args self_args(const float *x, float *out)
{
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    a.query = x;
    a.out = out;
    return a;
}

static int has_nan(const float *x, int64_t n)
{
    for (int64_t k = 0; k < n; k++)
        if (isnan(x[k]))
            return 1;
    return 0;
}

/* Row (b, i) of out must be out_proj.bias exactly (zero context), and the
 * per-head weights of that row exactly zero. */
static void expect_empty_row(const mha_module *m, const float *out,
                             const float *w, int64_t Lt, int64_t b, int64_t i)
{
    float bias[E] = {0};
    mha_param_info info;
    if (mha_param_info_by_name(m, "out_proj.bias", &info) == MHA_OK)
        mha_param_get(m, "out_proj.bias", bias, E);
    assert_memory_equal(out + (b * L + i) * E, bias, sizeof bias);
    for (int64_t h = 0; h < H; h++)
        for (int64_t j = 0; j < Lt; j++)
            assert_true(w[((b * H + h) * L + i) * Lt + j] == 0.0f);
}

static void test_fully_masked_rows(void **state)
{
    (void)state;
    for (int no_bias = 0; no_bias <= 1; no_bias++) {
        mha_module *m = module(no_bias, 0, 0);
        float x[B * L * E], out[B * L * E], w[B * H * L * L];
        tu_fill(x, B * L * E, 3, -1, 1);

        /* 1. an allow mask with an all-false row (row 2 of batch 1) */
        uint8_t allow[B * L * L];
        memset(allow, 1, sizeof allow);
        memset(allow + (1 * L + 2) * L, 0, L);
        mha_forward_args a = self_args(x, out);
        a.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 3, {B, L, L}};
        a.need_weights = MHA_WEIGHTS_PER_HEAD;
        a.attn_weights = w;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        expect_empty_row(m, out, w, L, 1, 2);
        assert_false(has_nan(out, B * L * E));

        /* 2. an additive mask whose row is all -inf */
        float add[L * L] = {0};
        for (int j = 0; j < L; j++)
            add[3 * L + j] = -INFINITY;
        a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 2, {L, L}};
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        expect_empty_row(m, out, w, L, 0, 3);
        expect_empty_row(m, out, w, L, 1, 3);

        /* 3. key_lengths = 0 for batch 0: every row of it is empty */
        int64_t lens[B] = {0, L};
        a.attn_mask = (mha_mask){0};
        a.key_lengths = lens;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        for (int i = 0; i < L; i++)
            expect_empty_row(m, out, w, L, 0, i);
        assert_false(has_nan(out, B * L * E));

        /* 4. a key padding mask with every key padded in batch 1 */
        uint8_t pad[B * L] = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
        a.key_lengths = NULL;
        a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, L}};
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        for (int i = 0; i < L; i++)
            expect_empty_row(m, out, w, L, 1, i);
        mha_free(m);
    }
}

/* Causal bottom-right with Lq > Lk: the first Lq - Lk queries see nothing. */
static void test_causal_empty_rows(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 0);
    enum { LK = 2 };
    float x[B * L * E], kv[B * LK * E], out[B * L * E], w[B * H * L * LK];
    tu_fill(x, B * L * E, 4, -1, 1);
    tu_fill(kv, B * LK * E, 5, -1, 1);
    mha_forward_args a = self_args(x, out);
    a.kv_len = LK;
    a.key = kv;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < L - LK; i++)
            expect_empty_row(m, out, w, LK, b, i);
    /* the last query sees every key */
    for (int h = 0; h < H; h++) {
        const float *r = w + ((0 * H + h) * L + (L - 1)) * LK;
        assert_true(r[0] > 0 && r[1] > 0);
    }
    mha_free(m);
}

/* With add_bias_kv a row whose real keys are all masked still attends to
 * bias_k, as in PyTorch: the row is not empty. */
static void test_bias_kv_keeps_row_alive(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 1);
    const int64_t Lt = L + 1;
    float x[B * L * E], out[B * L * E], w[B * H * L * (L + 1)];
    tu_fill(x, B * L * E, 6, -1, 1);
    int64_t lens[B] = {0, 0};
    mha_forward_args a = self_args(x, out);
    a.key_lengths = lens;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    for (int r = 0; r < B * H * L; r++) {
        for (int j = 0; j < L; j++)
            assert_true(w[r * Lt + j] == 0.0f);
        assert_true(w[r * Lt + L] == 1.0f);
    }
    mha_free(m);
}

/* A single live key gets weight exactly 1; logits of +-1e30 stay finite. */
static void test_huge_logits(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 0);
    float x[B * L * E], out[B * L * E], w[B * H * L * L];
    tu_fill(x, B * L * E, 7, -1, 1);
    float add[L * L];
    for (int i = 0; i < L; i++)
        for (int j = 0; j < L; j++)
            add[i * L + j] = j == (i + 1) % L ? 1e30f : -1e30f;
    mha_forward_args a = self_args(x, out);
    a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 2, {L, L}};
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_false(has_nan(out, B * L * E));
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < L; i++)
                for (int j = 0; j < L; j++)
                    assert_true(w[((b * H + h) * L + i) * L + j] ==
                                (j == (i + 1) % L ? 1.0f : 0.0f));

    /* Huge inputs: scores near +-1e30 from the data itself. */
    float big[B * L * E];
    for (int k = 0; k < B * L * E; k++)
        big[k] = x[k] * 1e14f;
    a = self_args(big, out);
    double out64[B * L * E];
    float out32[B * L * E];
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    ref_forward_f64(m, &a, out64, NULL);
    ref_forward_f32(m, &a, out32, NULL);
    assert_false(has_nan(out, B * L * E));
    double err = ref_max_err_f32(out, out64, B * L * E);
    double tol = ref_tolerance(ref_max_err_f32(out32, out64, B * L * E),
                               ref_max_abs(out64, B * L * E));
    assert_true(err <= tol);
    mha_free(m);
}

/* NaN and Inf in keys and values that are masked out never reach the
 * output: the result equals (bitwise) the one with those rows zeroed. */
static void test_nan_in_masked_keys(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 0);
    enum { LK = 6 };
    float q[B * L * E], k[B * LK * E], v[B * LK * E];
    float kz[B * LK * E], vz[B * LK * E];
    float out[B * L * E], out_z[B * L * E];
    tu_fill(q, B * L * E, 8, -1, 1);
    tu_fill(k, B * LK * E, 9, -1, 1);
    tu_fill(v, B * LK * E, 10, -1, 1);
    memcpy(kz, k, sizeof k);
    memcpy(vz, v, sizeof v);
    /* batch 0: key 4 poisoned; batch 1: keys 2 and 5 poisoned */
    const int poison[3][2] = {{0, 4}, {1, 2}, {1, 5}};
    for (int p = 0; p < 3; p++)
        for (int e = 0; e < E; e++) {
            int64_t idx = (poison[p][0] * LK + poison[p][1]) * E + e;
            k[idx] = NAN;
            v[idx] = e % 2 ? INFINITY : NAN;
            kz[idx] = vz[idx] = 0.0f;
        }

    for (int how = 0; how < 4; how++) {
        mha_forward_args a = self_args(q, out);
        a.kv_len = LK;
        a.key = k;
        a.value = v;
        uint8_t allow_pad[B * LK] = {1, 1, 1, 1, 0, 1, 1, 1, 0, 1, 1, 0};
        uint8_t block_attn[L * LK] = {0};
        float add_attn[B * L * LK] = {0};
        int64_t lens[B] = {4, 2};
        switch (how) {
        case 0:
            a.key_padding_mask = (mha_mask){MHA_MASK_ALLOW, allow_pad, 2,
                                            {B, LK}};
            break;
        case 1:   /* key lengths cut both poisoned tails */
            a.key_lengths = lens;
            break;
        case 2:   /* an additive -inf in every row, per batch */
            for (int b = 0; b < B; b++)
                for (int i = 0; i < L; i++)
                    for (int p = 0; p < 3; p++)
                        if (poison[p][0] == b)
                            add_attn[(b * L + i) * LK + poison[p][1]] =
                                -INFINITY;
            a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add_attn, 3,
                                     {B, L, LK}};
            break;
        case 3:   /* a block mask over columns 2, 4, 5, plus causal */
            for (int i = 0; i < L; i++)
                block_attn[i * LK + 2] = block_attn[i * LK + 4] =
                    block_attn[i * LK + 5] = 1;
            a.attn_mask = (mha_mask){MHA_MASK_BLOCK, block_attn, 2, {L, LK}};
            a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
            break;
        }
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        a.key = kz;
        a.value = vz;
        a.out = out_z;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        assert_false(has_nan(out, B * L * E));
        assert_memory_equal(out, out_z, sizeof out);
    }

    /* A NaN in a key that is NOT masked propagates, as IEEE arithmetic
     * says: the library does not hide bad data that is actually used. */
    mha_forward_args a = self_args(q, out);
    a.kv_len = LK;
    a.key = k;
    a.value = v;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_true(has_nan(out, B * L * E));
    mha_free(m);
}

/* NaN or Inf in one query row reaches that row's output, in every tier
 * and on every path (one block, split keys merged, stacked heads), as
 * NaN: never "no key left" (out_proj.bias and zero weights, what a row
 * whose keys are all masked gives).  The other rows are untouched. */
static void test_nan_query_row(void **state)
{
    (void)state;
    static const struct { int64_t nh, Hkv, Lq, Lk; } shapes[] = {
        {2, 2, 5, 70}, {2, 2, 1, 1500}, {4, 1, 1, 1500}, {2, 2, 70, 200}};
    const float bad[2] = {NAN, INFINITY};
    for (size_t t = 0; t < sizeof shapes / sizeof *shapes; t++)
        for (int v = 0; v < 2; v++) {
            const int64_t nh = shapes[t].nh, Hkv = shapes[t].Hkv, dh = 8;
            const int64_t Lq = shapes[t].Lq, Lk = shapes[t].Lk;
            const int64_t nq = Lq * nh * dh, nk = Lk * Hkv * dh;
            float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
            float *vv = malloc((size_t)nk * 4), *o = malloc((size_t)nq * 4);
            float *w = malloc((size_t)(nh * Lq * Lk) * 4);
            tu_fill(q, nq, 1 + t, -1, 1);
            tu_fill(k, nk, 2 + t, -1, 1);
            tu_fill(vv, nk, 3 + t, -1, 1);
            const int64_t row = Lq - 1, head = nh - 1;
            q[row * nh * dh + head * dh + 3] = bad[v];
            mha_attention_args a = {0};
            a.batch = 1;
            a.num_heads = nh;
            a.num_kv_heads = Hkv;
            a.head_dim = dh;
            a.q_len = Lq;
            a.kv_len = Lk;
            a.q = q;
            a.k = k;
            a.v = vv;
            a.out = o;
            a.need_weights = MHA_WEIGHTS_PER_HEAD;
            a.attn_weights = w;
            assert_int_equal(mha_attention(&a), MHA_OK);
            for (int64_t i = 0; i < Lq; i++)
                for (int64_t h = 0; h < nh; h++)
                    for (int64_t d = 0; d < dh; d++) {
                        const float x = o[(i * nh + h) * dh + d];
                        const int poisoned = i == row && h == head;
                        if (poisoned ? !isnan(x) : !isfinite(x))
                            fail_msg("shape %zu, %s in q[%lld][%lld]: out[%lld]"
                                     "[%lld][%lld] = %g", t,
                                     v ? "Inf" : "NaN", (long long)row,
                                     (long long)head, (long long)i,
                                     (long long)h, (long long)d, (double)x);
                    }
            /* its weights are not zeros either */
            int any_nan = 0;
            for (int64_t j = 0; j < Lk; j++)
                any_nan |= isnan(w[(head * Lq + row) * Lk + j]);
            assert_true(any_nan);
            free(q);
            free(k);
            free(vv);
            free(o);
            free(w);
        }
}

static void test_dropout_zero_is_identity(void **state)
{
    (void)state;
    mha_module *m0 = module(0, 0.0f, 0);
    mha_module *m5 = module(0, 0.5f, 0);   /* same params: same seed */
    float x[B * L * E], a_out[B * L * E], b_out[B * L * E], c_out[B * L * E];
    tu_fill(x, B * L * E, 11, -1, 1);
    mha_forward_args a = self_args(x, a_out);
    assert_int_equal(mha_forward(m0, &a), MHA_OK);
    a.training = 1;   /* p = 0 in training: bit-identical */
    a.dropout_seed = 99;
    a.out = b_out;
    assert_int_equal(mha_forward(m0, &a), MHA_OK);
    assert_memory_equal(a_out, b_out, sizeof a_out);
    a.training = 0;   /* p = 0.5 outside training: bit-identical */
    a.out = c_out;
    assert_int_equal(mha_forward(m5, &a), MHA_OK);
    assert_memory_equal(a_out, c_out, sizeof a_out);
    mha_free(m0);
    mha_free(m5);
}

static void test_dropout_reproducible(void **state)
{
    (void)state;
    mha_module *m = module(0, 0.4f, 0);
    float x[B * L * E], o1[B * L * E], o2[B * L * E], o3[B * L * E];
    float w[B * H * L * L];
    tu_fill(x, B * L * E, 12, -1, 1);
    mha_forward_args a = self_args(x, o1);
    a.training = 1;
    a.dropout_seed = 42;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.out = o2;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_memory_equal(o1, o2, sizeof o1);
    a.dropout_seed = 43;
    a.out = o3;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_memory_not_equal(o1, o3, sizeof o1);
    /* kept weights are scaled by 1 / (1 - p), dropped ones are 0: against
     * the float64 reference (which draws the mask with its own generator),
     * and kept ones against the weights without dropout */
    a.dropout_seed = 42;
    a.out = o2;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    double w64[B * H * L * L], o64[B * L * E];
    float w32[B * H * L * L], o32[B * L * E];
    assert_int_equal(ref_forward_f64(m, &a, o64, w64), 0);
    assert_int_equal(ref_forward_f32(m, &a, o32, w32), 0);
    const double tol = ref_tolerance(ref_max_err_f32(w32, w64, B * H * L * L),
                                     ref_max_abs(w64, B * H * L * L));
    const double err = ref_max_err_f32(w, w64, B * H * L * L);
    if (!(err <= tol))
        fail_msg("weights under dropout: error %.3g > bound %.3g", err, tol);
    float w_eval[B * H * L * L];
    mha_forward_args e = a;
    e.training = 0;
    e.attn_weights = w_eval;
    e.out = o3;
    assert_int_equal(mha_forward(m, &e), MHA_OK);
    int zeros = 0;
    for (int k = 0; k < B * H * L * L; k++) {
        assert_true((w[k] == 0.0f) == (w64[k] == 0.0));   /* the same mask */
        assert_true(w_eval[k] > 0.0f);
        if (w[k] == 0.0f) {
            zeros++;
            continue;
        }
        /* w = w_eval / (1 - p), up to a few float roundings */
        const double scaled = (double)w_eval[k] / (1.0 - 0.4f);
        if (!(fabs(w[k] - scaled) <= 4 * FLT_EPSILON * scaled))
            fail_msg("kept weight %d: %.9g, expected %.9g / (1 - p) = %.9g",
                     k, (double)w[k], (double)w_eval[k], scaled);
    }
    assert_true(zeros > 0 && zeros < B * H * L * L);
    mha_free(m);

    /* p = 1 drops everything: the output is the bias. */
    mha_module *m1 = module(0, 1.0f, 0);
    a.out = o3;
    assert_int_equal(mha_forward(m1, &a), MHA_OK);
    for (int b = 0; b < B; b++)
        for (int i = 0; i < L; i++)
            expect_empty_row(m1, o3, w, L, b, i);
    mha_free(m1);
}

/* Asking for weights (either form) leaves the output bit-identical. */
static void test_weights_do_not_change_output(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 0);
    float x[B * L * E], o0[B * L * E], o1[B * L * E], o2[B * L * E];
    float wp[B * H * L * L], wa[B * L * L];
    tu_fill(x, B * L * E, 13, -1, 1);
    mha_forward_args a = self_args(x, o0);
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = wp;
    a.out = o1;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.need_weights = MHA_WEIGHTS_AVERAGE;
    a.attn_weights = wa;
    a.out = o2;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_memory_equal(o0, o1, sizeof o0);
    assert_memory_equal(o0, o2, sizeof o0);
    /* and the average is the mean of the per-head maps */
    for (int b = 0; b < B; b++)
        for (int t = 0; t < L * L; t++) {
            double s = 0;
            for (int h = 0; h < H; h++)
                s += wp[(b * H + h) * L * L + t];
            assert_true(fabs(s / H - wa[b * L * L + t]) < 1e-6);
        }
    mha_free(m);
}

/* out may alias query; an unbatched input is batch 1 of a batch. */
static void test_alias_and_unbatched(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 0);
    float x[B * L * E], ref[B * L * E], y[B * L * E], one[L * E];
    tu_fill(x, B * L * E, 14, -1, 1);
    memcpy(y, x, sizeof x);
    mha_forward_args a = self_args(x, ref);
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a = self_args(y, y);
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_memory_equal(ref, y, sizeof y);
    for (int b = 0; b < B; b++) {
        a = self_args(x + b * L * E, one);
        a.batch = 1;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        for (int k = 0; k < L * E; k++)
            assert_true(fabsf(one[k] - ref[b * L * E + k]) <=
                        1e-6f * (1 + fabsf(ref[b * L * E + k])));
    }
    mha_free(m);
}

/* query, key and value may be one buffer even when Lk != Lq: the keys are
 * then the buffer's rows read with Lk per batch item, not the query's. */
static void test_one_buffer_two_lengths(void **state)
{
    (void)state;
    mha_module *m = module(0, 0, 0);
    const int64_t shapes[2][3] = {{1, 3, 6}, {2, 3, 4}};   /* B, Lq, Lk */
    for (int t = 0; t < 2; t++) {
        const int64_t Bn = shapes[t][0], Lq = shapes[t][1], Lk = shapes[t][2];
        float x[2 * 6 * E], out[2 * 6 * E], out32[2 * 6 * E];
        double out64[2 * 6 * E];
        tu_fill(x, Bn * Lk * E, 20 + t, -1, 1);
        mha_forward_args a = {0};
        a.batch = Bn;
        a.q_len = Lq;
        a.kv_len = Lk;
        a.query = a.key = a.value = x;
        a.out = out;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        ref_forward_f64(m, &a, out64, NULL);
        ref_forward_f32(m, &a, out32, NULL);
        const int64_t n = Bn * Lq * E;
        assert_true(ref_max_err_f32(out, out64, n) <=
                    ref_tolerance(ref_max_err_f32(out32, out64, n),
                                  ref_max_abs(out64, n)));
    }
    mha_free(m);
}

/* A finite score plus a finite mask saturates at -FLT_MAX: scores near
 * -1e32 with an additive -FLT_MAX on every key give uniform weights, not
 * -inf - (-inf) = NaN. */
static void test_finite_mask_saturates(void **state)
{
    (void)state;
    enum { E4 = 4, L4 = 3 };
    mha_config cfg = {0};
    cfg.embed_dim = E4;
    cfg.num_heads = 1;
    cfg.no_bias = 1;
    mha_module *m = NULL;
    assert_int_equal(mha_create(&cfg, &m), MHA_OK);
    float w[3 * E4 * E4] = {0};
    for (int k = 0; k < E4; k++) {
        w[k * E4 + k] = 1.0f;                   /* W_q = I   */
        w[(E4 + k) * E4 + k] = -1.0f;           /* W_k = -I  */
        w[(2 * E4 + k) * E4 + k] = 1.0f;        /* W_v = I   */
    }
    assert_int_equal(mha_param_set(m, "in_proj_weight", w, 3 * E4 * E4),
                     MHA_OK);
    float x[L4 * E4], out[L4 * E4], wt[L4 * L4], add[L4 * L4];
    for (int k = 0; k < L4 * E4; k++)
        x[k] = 1e16f;
    for (int k = 0; k < L4 * L4; k++)
        add[k] = -FLT_MAX;
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L4;
    a.query = x;
    a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 2, {L4, L4}};
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = wt;
    a.out = out;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_false(has_nan(out, L4 * E4));
    for (int k = 0; k < L4 * L4; k++)
        assert_true(fabsf(wt[k] - 1.0f / L4) < 1e-6f);
    mha_free(m);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fully_masked_rows),
        cmocka_unit_test(test_causal_empty_rows),
        cmocka_unit_test(test_bias_kv_keeps_row_alive),
        cmocka_unit_test(test_huge_logits),
        cmocka_unit_test(test_nan_in_masked_keys),
        cmocka_unit_test(test_nan_query_row),
        cmocka_unit_test(test_dropout_zero_is_identity),
        cmocka_unit_test(test_dropout_reproducible),
        cmocka_unit_test(test_weights_do_not_change_output),
        cmocka_unit_test(test_alias_and_unbatched),
        cmocka_unit_test(test_one_buffer_two_lengths),
        cmocka_unit_test(test_finite_mask_saturates),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
