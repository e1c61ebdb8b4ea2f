/*
 * test_decode_api.c -- the decoding entry points (mha_decode,
 * mha_plan_create_decode / mha_plan_decode, mha_attention_decode and its
 * plan): a prompt and then single tokens decoded through them give the
 * rows of one causal forward over the whole sequence without a cache
 * (another path: the flash forward, not the decoder), for a GQA module
 * with RoPE and on heads; they are the same bits as mha_forward /
 * mha_attention with .cache set; and what the mode cannot read is not in
 * its struct, what it needs is refused when missing; and the module's
 * and the heads' decoding, one request to the engine, refuse the same
 * misuse in the same words.  Run once per kernel tier (MHA_ISA) by CTest.
 */
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "testutil.h"

enum { B = 2, H = 4, HKV = 2, DH = 8, E = H * DH, L = 9, P = 5 };

/* 1e-5: every row is a softmax-weighted mean of values in [-1, 1) over at
 * most L = 9 keys, computed in float32 on two paths whose products and
 * sums round differently (a few ulp of numbers below ~4). */
static const double TOL = 1e-5;

static void expect_close(const float *got, const float *want, int64_t n,
                         const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= TOL))
            fail_msg("%s: [%lld] %.9g, the uncached forward %.9g", what,
                     (long long)i, (double)got[i], (double)want[i]);
}

/* Row block [t0, t0 + n) of every sequence of x (B, L, W) into y. */
static void rows(const float *x, int64_t W, int64_t t0, int64_t n, float *y)
{
    for (int64_t b = 0; b < B; b++)
        memcpy(y + b * n * W, x + (b * L + t0) * W,
               (size_t)(n * W) * sizeof *y);
}

static void test_module_decode(void **state)
{
    (void)state;
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = H;
    c.num_kv_heads = HKV;
    c.mods.rope.style = MHA_ROPE_NEOX;
    mha_module *m = tu_module(&c, 11);
    assert_non_null(m);
    static float x[B * L * E], want[B * L * E];
    tu_fill(x, B * L * E, 12, -1, 1);
    mha_forward_args f = {0};
    f.batch = B;
    f.q_len = L;
    f.query = x;
    f.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    f.out = want;
    assert_int_equal(mha_forward(m, &f), MHA_OK);

    mha_kv_cache *kv = NULL, *old = NULL;
    assert_int_equal(mha_kv_cache_for_module(m, B, L, &kv), MHA_OK);
    assert_int_equal(mha_kv_cache_for_module(m, B, L, &old), MHA_OK);
    static float in[B * L * E], out[B * L * E], out_old[B * L * E];
    static float got[B * L * E];
    /* The prompt unplanned, then one token at a time on a plan. */
    mha_decode_args d = {0};
    d.batch = B;
    d.q_len = P;
    d.query = in;
    d.out = out;
    d.cache = kv;
    rows(x, E, 0, P, in);
    assert_int_equal(mha_decode(m, &d), MHA_OK);
    mha_forward_args legacy = {0};
    legacy.batch = B;
    legacy.q_len = P;
    legacy.query = in;
    legacy.out = out_old;
    legacy.cache = old;
    assert_int_equal(mha_forward(m, &legacy), MHA_OK);
    assert_memory_equal(out, out_old, (size_t)(B * P * E) * sizeof *out);
    for (int64_t b = 0; b < B; b++)
        memcpy(got + b * L * E, out + b * P * E, (size_t)(P * E) * 4);

    d.q_len = 1;
    mha_plan *plan = NULL;
    assert_int_equal(mha_plan_create_decode(m, &d, &plan), MHA_OK);
    /* a weights buffer with no weights asked for: refused, cache unchanged */
    float w[B * L];
    d.attn_weights = w;
    assert_int_equal(mha_plan_decode(plan, &d), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "need_weights"));
    assert_int_equal(mha_kv_cache_length(kv, 0), P);
    d.attn_weights = NULL;
    for (int64_t t = P; t < L; t++) {
        rows(x, E, t, 1, in);
        assert_int_equal(mha_plan_decode(plan, &d), MHA_OK);
        for (int64_t b = 0; b < B; b++)
            memcpy(got + (b * L + t) * E, out + b * E, (size_t)E * 4);
    }
    assert_int_equal(mha_kv_cache_length(kv, 1), L);
    expect_close(got, want, B * L * E, "mha_decode");

    /* What the mode needs, refused when missing or contradictory. */
    d.cache = NULL;
    assert_int_equal(mha_plan_decode(plan, &d), MHA_ERR_NULL_POINTER);
    assert_non_null(strstr(mha_last_error(), "cache is NULL"));
    d.cache = kv;
    d.batch = 1;   /* buffers of one sequence, a cache of two */
    assert_int_equal(mha_decode(m, &d), MHA_ERR_SHAPE);
    d.batch = B;
    mha_plan_free(plan);
    /* A plan made for the forward without a cache is not a decode plan. */
    f.q_len = 1;
    assert_int_equal(mha_plan_create(m, &f, &plan), MHA_OK);
    assert_int_equal(mha_plan_decode(plan, &d), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "without a KV cache"));
    mha_plan_free(plan);
    mha_kv_cache_free(kv);
    mha_kv_cache_free(old);
    mha_free(m);
}

static void test_attention_decode(void **state)
{
    (void)state;
    enum { EKV = HKV * DH };
    static float q[B * L * E], k[B * L * EKV], v[B * L * EKV];
    static float want[B * L * E], got[B * L * E], lse[B * H * L];
    tu_fill(q, B * L * E, 21, -1, 1);
    tu_fill(k, B * L * EKV, 22, -1, 1);
    tu_fill(v, B * L * EKV, 23, -1, 1);
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.num_kv_heads = HKV;
    a.head_dim = DH;
    a.q_len = L;
    a.q = q;
    a.k = k;
    a.v = v;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a.mods.softcap = 5.0f;
    a.out = want;
    assert_int_equal(mha_attention(&a), MHA_OK);

    mha_kv_cache_config cc = {0};
    cc.batch = B;
    cc.num_kv_heads = HKV;
    cc.head_dim = DH;
    cc.capacity = L;
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
    static float qs[B * L * E], os[B * L * E];
    mha_attention_decode_args d = {0};
    d.batch = B;
    d.num_heads = H;
    d.head_dim = DH;
    d.q = qs;
    d.out = os;
    d.cache = kv;
    d.mods.softcap = 5.0f;
    d.lse = lse;
    mha_attention_plan *plan = NULL;
    d.q_len = 1;
    assert_int_equal(mha_attention_plan_create_decode(&d, &plan), MHA_OK);
    for (int64_t t = 0; t < L; t++) {
        /* the prompt's P tokens in one unplanned call, then one by one */
        const int64_t n = t == 0 ? P : 1;
        if (t > 0 && t < P)
            continue;
        for (int64_t b = 0; b < B; b++)
            assert_int_equal(mha_kv_cache_append(kv, b,
                                                 k + (b * L + t) * EKV,
                                                 v + (b * L + t) * EKV, n),
                             MHA_OK);
        rows(q, E, t, n, qs);
        d.q_len = n;
        assert_int_equal(n > 1 ? mha_attention_decode(&d)
                               : mha_attention_plan_decode(plan, &d),
                         MHA_OK);
        for (int64_t b = 0; b < B; b++)
            memcpy(got + (b * L + t) * E, os + b * n * E,
                   (size_t)(n * E) * sizeof *os);
    }
    expect_close(got, want, B * L * E, "mha_attention_decode");
    d.cache = NULL;
    assert_int_equal(mha_attention_decode(&d), MHA_ERR_NULL_POINTER);
    d.cache = kv;
    d.batch = 1;
    assert_int_equal(mha_attention_decode(&d), MHA_ERR_SHAPE);
    mha_attention_plan_free(plan);
    mha_kv_cache_free(kv);
}

/* Both front doors hand the engine one request (src/attention/request.c),
 * so the module's decode and the heads' decode refuse the same misuse of
 * a cache with the same status and the same words, and leave the caches
 * as they were.  The module's step appends its token first, so its cache
 * holds one token fewer than the heads' for the same Lk. */
static void expect_same_refusal(const mha_module *m, mha_decode_args *md,
                                mha_attention_decode_args *ad,
                                mha_status want, const char *needle)
{
    const int64_t n_mod = mha_kv_cache_length(md->cache, 0);
    const int64_t n_att = mha_kv_cache_length(ad->cache, 0);
    assert_int_equal(mha_decode(m, md), want);
    char first[512];
    snprintf(first, sizeof first, "%s", mha_last_error());
    if (!strstr(first, needle))
        fail_msg("module: \"%s\" does not say \"%s\"", first, needle);
    assert_int_equal(mha_attention_decode(ad), want);
    if (strcmp(first, mha_last_error()))
        fail_msg("the two doors differ:\n  module: %s\n  heads:  %s", first,
                 mha_last_error());
    assert_int_equal(mha_kv_cache_length(md->cache, 0), n_mod);
    assert_int_equal(mha_kv_cache_length(ad->cache, 0), n_att);
}

static void test_one_validator(void **state)
{
    (void)state;
    enum { EKV = HKV * DH, W = 4, CAP = 8 };
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = H;
    c.num_kv_heads = HKV;
    mha_module *m = tu_module(&c, 31);
    assert_non_null(m);
    mha_kv_cache_config cc = {0};
    cc.batch = B;
    cc.num_kv_heads = HKV;
    cc.head_dim = DH;
    cc.capacity = CAP;
    mha_kv_cache *mod_kv = NULL, *att_kv = NULL, *mod_win = NULL,
                 *att_win = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &mod_kv), MHA_OK);
    assert_int_equal(mha_kv_cache_create(&cc, &att_kv), MHA_OK);
    cc.window = W;
    assert_int_equal(mha_kv_cache_create(&cc, &mod_win), MHA_OK);
    assert_int_equal(mha_kv_cache_create(&cc, &att_win), MHA_OK);
    static float k[B * P * EKV], v[B * P * EKV];
    tu_fill(k, B * P * EKV, 32, -1, 1);
    tu_fill(v, B * P * EKV, 33, -1, 1);
    for (int64_t b = 0; b < B; b++) {   /* Lk = P for both doors' step */
        assert_int_equal(mha_kv_cache_append(mod_kv, b, k, v, P - 1), MHA_OK);
        assert_int_equal(mha_kv_cache_append(att_kv, b, k, v, P), MHA_OK);
    }
    static float x[B * E], out[B * E];
    tu_fill(x, B * E, 34, -1, 1);
    mha_decode_args md = {0};
    md.batch = B;
    md.q_len = 1;
    md.query = x;
    md.out = out;
    md.cache = mod_kv;
    mha_attention_decode_args ad = {0};
    ad.batch = B;
    ad.num_heads = H;
    ad.head_dim = DH;
    ad.q_len = 1;
    ad.q = x;
    ad.out = out;
    ad.cache = att_kv;

    float w[B * H * CAP];
    md.attn_weights = ad.attn_weights = w;   /* a buffer with no weights */
    expect_same_refusal(m, &md, &ad, MHA_ERR_INVALID_ARGUMENT,
                        "need_weights is MHA_WEIGHTS_NONE");
    md.attn_weights = ad.attn_weights = NULL;

    const int64_t lengths[B] = {2, P + 1};   /* past Lk = P */
    md.key_lengths = ad.key_lengths = lengths;
    expect_same_refusal(m, &md, &ad, MHA_ERR_INVALID_ARGUMENT,
                        "key_lengths[1]");
    md.key_lengths = ad.key_lengths = NULL;

    md.batch = ad.batch = 1;   /* one sequence said, the cache holds two */
    expect_same_refusal(m, &md, &ad, MHA_ERR_SHAPE, "the cache holds 2");
    md.batch = ad.batch = B;

    md.cache = mod_win;   /* a window's ring has no key positions to mask */
    ad.cache = att_win;
    md.key_lengths = ad.key_lengths = lengths;
    expect_same_refusal(m, &md, &ad, MHA_ERR_UNSUPPORTED,
                        "sliding-window KV cache, key_lengths");
    md.key_lengths = ad.key_lengths = NULL;
    /* and both doors still take a good step afterwards */
    assert_int_equal(mha_decode(m, &md), MHA_OK);
    for (int64_t b = 0; b < B; b++)
        assert_int_equal(mha_kv_cache_append(att_win, b, k, v, 1), MHA_OK);
    assert_int_equal(mha_attention_decode(&ad), MHA_OK);
    mha_kv_cache_free(mod_kv);
    mha_kv_cache_free(att_kv);
    mha_kv_cache_free(mod_win);
    mha_kv_cache_free(att_win);
    mha_free(m);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_module_decode),
        cmocka_unit_test(test_attention_decode),
        cmocka_unit_test(test_one_validator),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
