/*
 * test_threads.c -- the attention's threads and plans: outputs and weights
 * bitwise identical for 1, 2, 3 and 4 threads (and equal to the float64
 * reference within the suite's bound); a plan runs many calls with no
 * change in results and refuses arguments it was not made for.  Run once
 * per kernel tier (MHA_ISA) by CTest.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "testutil.h"

typedef struct shape {
    const char *name;
    int64_t E, H, B, Lq, Lk;
    int cross, bias_kv, zero_attn;
    mha_causal causal;
    int pad;               /* key padding mask, block kind, (B, Lk) */
    int lengths;
    float dropout;
    mha_weights_mode weights;
} shape;

static const shape SHAPES[] = {
    {"self, many blocks", 64, 4, 2, 200, 0, 0, 0, 0, 0, 0, 0, 0, MHA_WEIGHTS_AVERAGE},
    {"causal, diagonal tiles", 64, 2, 1, 300, 0, 0, 0, 0, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, MHA_WEIGHTS_PER_HEAD},
    {"cross, padding, lengths", 48, 3, 3, 70, 130, 1, 1, 1, 0, 1, 1, 0, MHA_WEIGHTS_PER_HEAD},
    {"decoding, one query", 64, 8, 2, 1, 700, 1, 0, 0, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, MHA_WEIGHTS_AVERAGE},
    {"dropout", 32, 2, 2, 90, 0, 0, 0, 0, MHA_CAUSAL_TOP_LEFT, 0, 0, 0.3f, MHA_WEIGHTS_PER_HEAD},
    /* few queries, many keys: the keys are split in chunks and merged */
    {"decoding, split keys", 32, 2, 2, 3, 1500, 1, 1, 1, MHA_CAUSAL_BOTTOM_RIGHT, 1, 1, 0, MHA_WEIGHTS_PER_HEAD},
    {"decoding, split, dropout", 16, 1, 1, 1, 2100, 1, 0, 0, 0, 0, 0, 0.2f, MHA_WEIGHTS_AVERAGE},
    {"head dim 80", 160, 2, 1, 65, 0, 0, 0, 0, 0, 1, 0, 0, MHA_WEIGHTS_NONE},
};

typedef struct run {
    float *out, *w;
} run;

/* The arguments of a shape's problem (no outputs). */
static mha_forward_args problem(const shape *s, const float *q,
                                const float *kv, const uint8_t *pad,
                                const int64_t *lens)
{
    mha_forward_args a = {0};
    a.batch = s->B;
    a.q_len = s->Lq;
    a.kv_len = s->Lk;
    a.query = q;
    a.key = s->cross ? kv : NULL;
    a.value = s->cross ? kv : NULL;
    a.causal = s->causal;
    if (s->pad)
        a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2,
                                        {s->B, s->Lk ? s->Lk : s->Lq}};
    a.key_lengths = s->lengths ? lens : NULL;
    a.training = s->dropout > 0;
    a.dropout_seed = 11;
    return a;
}

static run forward(const mha_module *m, const shape *s, const float *q,
                   const float *kv, const uint8_t *pad, const int64_t *lens,
                   int threads, int64_t n_out, int64_t n_w)
{
    run r = {malloc((size_t)n_out * sizeof(float)),
             malloc((size_t)(n_w ? n_w : 1) * sizeof(float))};
    mha_forward_args a = problem(s, q, kv, pad, lens);
    a.need_weights = s->weights;
    a.attn_weights = r.w;
    a.num_threads = threads;
    a.out = r.out;
    if (mha_forward(m, &a) != MHA_OK)
        fail_msg("%s, %d threads: %s", s->name, threads, mha_last_error());
    return r;
}

static void test_thread_counts(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof SHAPES / sizeof *SHAPES; k++) {
        const shape *s = &SHAPES[k];
        mha_config cfg = {0};
        cfg.embed_dim = s->E;
        cfg.num_heads = s->H;
        cfg.add_bias_kv = s->bias_kv;
        cfg.add_zero_attn = s->zero_attn;
        cfg.dropout = s->dropout;
        mha_module *m = tu_module(&cfg, 31 + k);
        assert_non_null(m);
        const int64_t Lk = s->Lk ? s->Lk : s->Lq, Lt = mha_total_keys(m, Lk);
        const int64_t n_q = s->B * s->Lq * s->E, n_kv = s->B * Lk * s->E;
        const int64_t n_w = s->weights == MHA_WEIGHTS_PER_HEAD
                                ? s->B * s->H * s->Lq * Lt
                            : s->weights == MHA_WEIGHTS_AVERAGE
                                ? s->B * s->Lq * Lt : 0;
        float *q = malloc((size_t)n_q * sizeof *q);
        float *kv = malloc((size_t)n_kv * sizeof *kv);
        uint8_t *pad = calloc((size_t)(s->B * Lk), 1);
        int64_t lens[4];
        tu_fill(q, n_q, 100 + k, -1, 1);
        tu_fill(kv, n_kv, 200 + k, -1, 1);
        for (int64_t b = 0; b < s->B; b++) {
            lens[b] = Lk - 7 * b - 1;
            for (int64_t j = 0; j < Lk; j++)
                pad[b * Lk + j] = (j * 7 + b) % 5 == 0;
        }
        run one = forward(m, s, q, kv, pad, lens, 1, n_q, n_w);
        for (int t = 2; t <= 4; t++) {
            run r = forward(m, s, q, kv, pad, lens, t, n_q, n_w);
            if (memcmp(one.out, r.out, (size_t)n_q * sizeof(float)))
                fail_msg("%s: output with %d threads differs from 1 thread",
                         s->name, t);
            if (n_w && memcmp(one.w, r.w, (size_t)n_w * sizeof(float)))
                fail_msg("%s: weights with %d threads differ from 1 thread",
                         s->name, t);
            free(r.out);
            free(r.w);
        }
        /* and the result is right */
        const mha_forward_args a = problem(s, q, kv, pad, lens);
        double *o64 = malloc((size_t)n_q * sizeof *o64);
        float *o32 = malloc((size_t)n_q * sizeof *o32);
        ref_forward_f64(m, &a, o64, NULL);
        ref_forward_f32(m, &a, o32, NULL);
        double err = ref_max_err_f32(one.out, o64, n_q);
        double tol = ref_tolerance(ref_max_err_f32(o32, o64, n_q),
                                   ref_max_abs(o64, n_q));
        if (!(err <= tol))
            fail_msg("%s: error %.3g > bound %.3g", s->name, err, tol);
        free(o64); free(o32);
        free(one.out); free(one.w); free(q); free(kv); free(pad);
        mha_free(m);
    }
}

static void test_plan(void **state)
{
    (void)state;
    enum { E = 32, H = 4, B = 2, L = 40 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    mha_module *m = tu_module(&cfg, 5);
    static float x1[B * L * E], x2[B * L * E], o1[B * L * E], o2[B * L * E],
        p1[B * L * E], p2[B * L * E], w[B * H * L * L];
    tu_fill(x1, B * L * E, 1, -1, 1);
    tu_fill(x2, B * L * E, 2, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = L;
    mha_plan *plan = NULL;
    assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);   /* no data */
    a.query = x1;
    a.out = o1;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.out = p1;
    assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
    a.query = x2;
    a.out = o2;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;   /* masks may change per run */
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.out = p2;
    assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
    assert_memory_equal(o1, p1, sizeof o1);
    assert_memory_equal(o2, p2, sizeof o2);
    /* a shape it was not made for */
    a.q_len = L - 1;
    assert_int_equal(mha_plan_forward(plan, &a), MHA_ERR_SHAPE);
    assert_non_null(strstr(mha_last_error(), "do not match the plan"));
    a.q_len = L;
    a.query = NULL;
    assert_int_equal(mha_plan_forward(plan, &a), MHA_ERR_NULL_POINTER);
    assert_int_equal(mha_plan_forward(NULL, &a), MHA_ERR_NULL_POINTER);
    mha_plan *bad = (mha_plan *)&bad;
    a.num_threads = -1;
    assert_int_equal(mha_plan_create(m, &a, &bad), MHA_ERR_INVALID_ARGUMENT);
    assert_null(bad);   /* a failed create leaves NULL */
    mha_plan_free(NULL);
    mha_plan_free(plan);
    mha_free(m);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_plan),
        cmocka_unit_test(test_thread_counts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
