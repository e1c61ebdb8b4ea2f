/*
 * test_kv_cache.c -- decoding through a KV cache equals the causal forward
 * of the whole sequence:
 *
 *   - three sequences of different lengths (a rollback by truncation, a
 *     reset) prefilled in chunks of 7 and continued token by token for
 *     hundreds of steps (and 1,100 in a long grouped-query generation),
 *     every output row against the float64 reference
 *     of its sequence's causal forward (tests/support), for plain,
 *     grouped-query, multi-query and bias_kv + zero_attn modules, and
 *     modules whose values are d_v != d_h wide;
 *   - keys appended by the caller (mha_project + mha_kv_cache_append);
 *   - 1, 2 and 4 threads bitwise equal on a shape where the threads run
 *     (a cached prefill against keys appended already projected, and the
 *     decoding split);
 *   - every misuse refused with the cache unchanged.
 *
 * Every tier runs it (CTest, MHA_ISA).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "assert_error.h"
#include "ref.h"
#include "testutil.h"

enum { MAX_SEQ = 3 };

/* One sequence's token stream: its inputs in order, and for each output
 * the decoder produced, the position it was produced for. */
typedef struct stream {
    float *x;        /* [cap][E] inputs of the tokens now in the cache   */
    int64_t len;
    float *out;      /* [n_out][E] outputs, position pos[k]             */
    int64_t *pos;
    int64_t n_out;
} stream;

typedef struct decoder {
    mha_module *m;
    mha_kv_cache *kv;
    int64_t B, E, cap;
    int threads;
    stream s[MAX_SEQ];
    uint64_t seed;
} decoder;

static void decoder_init(decoder *d, const mha_config *cfg, int64_t B,
                         int64_t cap, int threads)
{
    memset(d, 0, sizeof *d);
    d->m = tu_module(cfg, 99);
    assert_non_null(d->m);
    d->B = B;
    d->E = cfg->embed_dim;
    d->cap = cap;
    d->threads = threads;
    assert_int_equal(mha_kv_cache_for_module(d->m, B, cap, &d->kv), MHA_OK);
    for (int64_t b = 0; b < B; b++) {
        d->s[b].x = malloc((size_t)(cap * d->E) * sizeof(float));
        d->s[b].out = malloc((size_t)(4 * cap * d->E) * sizeof(float));
        d->s[b].pos = malloc((size_t)(4 * cap) * sizeof(int64_t));
    }
}

static void decoder_free(decoder *d)
{
    for (int64_t b = 0; b < d->B; b++) {
        free(d->s[b].x);
        free(d->s[b].out);
        free(d->s[b].pos);
    }
    mha_kv_cache_free(d->kv);
    mha_free(d->m);
}

/* One cached forward of n new tokens for every sequence. */
static void decoder_step(decoder *d, int64_t n)
{
    const int64_t B = d->B, E = d->E;
    float *x = malloc((size_t)(B * n * E) * sizeof *x);
    float *y = malloc((size_t)(B * n * E) * sizeof *y);
    tu_fill(x, B * n * E, d->seed++, -1.5f, 1.5f);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = n;
    a.query = x;
    a.cache = d->kv;
    a.num_threads = d->threads;
    a.out = y;
    if (mha_forward(d->m, &a) != MHA_OK)
        fail_msg("cached forward: %s", mha_last_error());
    for (int64_t b = 0; b < B; b++) {
        stream *s = &d->s[b];
        for (int64_t r = 0; r < n; r++) {
            memcpy(s->x + (s->len + r) * E, x + (b * n + r) * E,
                   (size_t)E * sizeof *x);
            memcpy(s->out + s->n_out * E, y + (b * n + r) * E,
                   (size_t)E * sizeof *y);
            s->pos[s->n_out++] = s->len + r;
        }
        s->len += n;
        assert_int_equal(mha_kv_cache_length(d->kv, b), s->len);
    }
    free(x);
    free(y);
}

/* Outputs of positions that truncation removed are forgotten with them. */
static void decoder_truncate(decoder *d, int64_t b, int64_t len)
{
    assert_int_equal(mha_kv_cache_truncate(d->kv, b, len), MHA_OK);
    stream *s = &d->s[b];
    int64_t keep = 0;
    for (int64_t k = 0; k < s->n_out; k++)
        if (s->pos[k] < len) {
            memmove(s->out + keep * d->E, s->out + k * d->E,
                    (size_t)d->E * sizeof(float));
            s->pos[keep++] = s->pos[k];
        }
    s->n_out = keep;
    s->len = len;
}

/* Every output against the float64 reference of its sequence's causal
 * forward over the tokens now in the stream. */
static void decoder_check(const decoder *d, const char *name)
{
    const int64_t E = d->E;
    for (int64_t b = 0; b < d->B; b++) {
        const stream *s = &d->s[b];
        if (s->len == 0)
            continue;
        const int64_t n = s->len * E;
        double *r64 = malloc((size_t)n * sizeof *r64);
        float *r32 = malloc((size_t)n * sizeof *r32);
        mha_forward_args a = {0};
        a.batch = 1;
        a.q_len = s->len;
        a.query = s->x;
        a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        assert_int_equal(ref_forward_f64(d->m, &a, r64, NULL), 0);
        assert_int_equal(ref_forward_f32(d->m, &a, r32, NULL), 0);
        const double tol = ref_tolerance(ref_max_err_f32(r32, r64, n),
                                         ref_max_abs(r64, n));
        for (int64_t k = 0; k < s->n_out; k++) {
            const double err =
                ref_max_err_f32(s->out + k * E, r64 + s->pos[k] * E, E);
            if (!(err <= tol))
                fail_msg("%s: sequence %lld position %lld: error %.3g > "
                         "bound %.3g", name, (long long)b,
                         (long long)s->pos[k], err, tol);
        }
        free(r64);
        free(r32);
    }
}

typedef struct ccase {
    const char *name;
    int64_t E, H, Hkv;
    int bias_kv, zero_attn, no_bias;
    int64_t v_head_dim;   /* d_v: values of their own width; 0: d_h */
} ccase;

static const ccase CASES[] = {
    {"plain", 32, 4, 0, 0, 0, 0, 0},
    {"GQA 4/2", 32, 4, 2, 0, 0, 0, 0},
    {"MQA 4/1, no bias", 32, 4, 1, 0, 0, 1, 0},
    {"bias_kv + zero_attn, GQA 6/3", 24, 6, 3, 1, 1, 0, 0},
    {"d_v 12 > d_h 8, GQA 4/2", 32, 4, 2, 0, 0, 0, 12},
    {"d_v 2 < d_h 4, bias_kv + zero_attn", 24, 6, 3, 1, 1, 0, 2},
};

static void test_decode_equals_forward(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const ccase *c = &CASES[t];
        mha_config cfg = {0};
        cfg.embed_dim = c->E;
        cfg.num_heads = c->H;
        cfg.num_kv_heads = c->Hkv;
        cfg.add_bias_kv = c->bias_kv;
        cfg.add_zero_attn = c->zero_attn;
        cfg.no_bias = c->no_bias;
        cfg.v_head_dim = c->v_head_dim;
        decoder d;
        decoder_init(&d, &cfg, 3, 400, 0);
        decoder_step(&d, 7);              /* prefill in chunks of 7 */
        decoder_step(&d, 7);
        decoder_truncate(&d, 1, 3);       /* a rollback: 14 -> 3 */
        assert_int_equal(mha_kv_cache_reset(d.kv, 2), MHA_OK);
        decoder_truncate(&d, 2, 0);
        for (int step = 0; step < 300; step++)
            decoder_step(&d, step % 50 == 49 ? 7 : 1);
        decoder_check(&d, c->name);
        decoder_free(&d);
    }
}

/* A long generation: two sequences, grouped-query, a prefill of 7 and
 * then 1,100 single-token steps (the later ones on more than 1,024 keys:
 * the decoding split, the group's heads stacked), every output against
 * the float64 causal forward of its whole sequence. */
static void test_long_decode(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 16;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    decoder d;
    decoder_init(&d, &cfg, 2, 1110, 0);
    decoder_step(&d, 7);
    decoder_truncate(&d, 1, 2);
    for (int step = 0; step < 1100; step++)
        decoder_step(&d, 1);
    assert_int_equal(mha_kv_cache_length(d.kv, 0), 1107);
    decoder_check(&d, "long GQA decode");
    decoder_free(&d);
}

/* Keys and values projected by the caller and appended, then a token
 * decoded through the cache: the same as the cache filling itself. */
static void test_append_projected(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 16;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    mha_module *m = tu_module(&cfg, 5);
    enum { L = 70, E = 16, EKV = 8 };
    float x[(L + 1) * E], k[L * EKV], v[L * EKV], y1[E], y2[E];
    float yall[L * E];
    tu_fill(x, (L + 1) * E, 6, -1, 1);
    assert_int_equal(mha_project(m, MHA_PROJ_KEY, x, L, k), MHA_OK);
    assert_int_equal(mha_project(m, MHA_PROJ_VALUE, x, L, v), MHA_OK);
    mha_kv_cache *by_hand = NULL, *by_forward = NULL;
    assert_int_equal(mha_kv_cache_for_module(m, 1, 100, &by_hand), MHA_OK);
    assert_int_equal(mha_kv_cache_for_module(m, 1, 100, &by_forward), MHA_OK);
    assert_int_equal(mha_kv_cache_append(by_hand, 0, k, v, 30), MHA_OK);
    assert_int_equal(mha_kv_cache_append(by_hand, 0, k + 30 * EKV,
                                         v + 30 * EKV, L - 30), MHA_OK);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.cache = by_forward;
    a.out = yall;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.q_len = 1;
    a.query = x + L * E;
    a.out = y1;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.cache = by_hand;
    a.out = y2;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    /* The same keys in the same layout: the same bits. */
    assert_memory_equal(y1, y2, sizeof y1);
    mha_kv_cache_free(by_hand);
    mha_kv_cache_free(by_forward);
    mha_free(m);
}

/* Fills the cache of every sequence with keys and values already
 * projected (random: the run only compares bits, never the reference, so
 * the stream keeps no inputs for them): sequence b gets n + 37 b tokens. */
static void decoder_append_random(decoder *d, int64_t n, int64_t kv_width)
{
    for (int64_t b = 0; b < d->B; b++) {
        const int64_t nb = n + 37 * b;
        float *k = malloc((size_t)(nb * kv_width) * sizeof *k);
        float *v = malloc((size_t)(nb * kv_width) * sizeof *v);
        tu_fill(k, nb * kv_width, 40 + (uint64_t)b, -1.0f, 1.0f);
        tu_fill(v, nb * kv_width, 50 + (uint64_t)b, -1.0f, 1.0f);
        assert_int_equal(mha_kv_cache_append(d->kv, b, k, v, nb), MHA_OK);
        d->s[b].len += nb;
        free(k);
        free(v);
    }
}

/* 1, 2 and 4 threads: the same bits.  B H Lq Lt d_h >= 2^20, so the
 * threads run: a cached prefill of 100 tokens (query blocks shared among
 * the threads) against ~1,000 keys appended already projected (sequences
 * of different lengths), then four decoding steps (Lk > 1024: the keys
 * split in chunks, the group's heads stacked). */
static void threaded_decode(int threads, decoder *d)
{
    mha_config cfg = {0};
    cfg.embed_dim = 512;
    cfg.num_heads = 8;
    cfg.num_kv_heads = 2;
    decoder_init(d, &cfg, 2, 1200, threads);
    decoder_append_random(d, 1000,
                          cfg.num_kv_heads * (cfg.embed_dim / cfg.num_heads));
    decoder_step(d, 100);
    for (int s = 0; s < 4; s++)
        decoder_step(d, 1);
}

static void test_threads_bitwise(void **state)
{
    (void)state;
    decoder one, many;
    threaded_decode(1, &one);
    for (int threads = 2; threads <= 4; threads += 2) {
        threaded_decode(threads, &many);
        for (int64_t b = 0; b < 2; b++) {
            assert_int_equal(many.s[b].n_out, 104);
            assert_memory_equal(one.s[b].out, many.s[b].out,
                                (size_t)(one.s[b].n_out * 512) * 4);
        }
        decoder_free(&many);
    }
    decoder_free(&one);
}

static void test_misuse(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 16;
    cfg.num_heads = 4;
    mha_module *m = tu_module(&cfg, 7);
    mha_kv_cache *kv = NULL;
    assert_fails(mha_kv_cache_for_module(m, 2, 0, &kv),
                 MHA_ERR_INVALID_ARGUMENT, "capacity");
    assert_null(kv);
    mha_kv_cache_config kc = {2, 4, 4, 10, (mha_kv_dtype)9, 0, 0, 0, 0, 0, 0};
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "dtype 9");
    assert_int_equal(mha_kv_cache_for_module(m, 2, 10, &kv), MHA_OK);

    float x[2 * 11 * 16], y[2 * 11 * 16], k[11 * 16];
    tu_fill(x, 2 * 11 * 16, 8, -1, 1);
    tu_fill(k, 11 * 16, 9, -1, 1);
    mha_forward_args a = {0};
    a.batch = 2;
    a.q_len = 4;
    a.query = x;
    a.cache = kv;
    a.out = y;
    assert_int_equal(mha_forward(m, &a), MHA_OK);   /* lengths 4, 4 */

    /* What a cached forward refuses. */
    mha_forward_args b = a;
    b.key = x;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT, "key");
    b = a;
    b.need_weights = MHA_WEIGHTS_PER_HEAD;   /* composes, but needs a buffer */
    assert_fails(mha_forward(m, &b), MHA_ERR_NULL_POINTER, "attn_weights");
    b = a;
    b.training = 1;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT, "training");
    b = a;
    b.causal = MHA_CAUSAL_TOP_LEFT;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT, "TOP_LEFT");
    b = a;
    b.batch = 1;
    assert_fails(mha_forward(m, &b), MHA_ERR_SHAPE, "2 sequences");
    /* 4 + 7 > 10: refused, the cache as it was. */
    b = a;
    b.q_len = 7;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT,
                 "do not fit");
    assert_int_equal(mha_kv_cache_length(kv, 0), 4);
    assert_int_equal(mha_kv_cache_length(kv, 1), 4);
    /* A plan made without a cache, given one; and the other way. */
    mha_plan *p = NULL;
    b = a;
    b.cache = NULL;
    assert_int_equal(mha_plan_create(m, &b, &p), MHA_OK);
    assert_fails(mha_plan_forward(p, &a), MHA_ERR_INVALID_ARGUMENT,
                 "without a KV cache");
    mha_plan_free(p);
    /* A plan made for this cache: no cache, or a larger one, refused. */
    assert_int_equal(mha_plan_create(m, &a, &p), MHA_OK);
    assert_fails(mha_plan_forward(p, &b), MHA_ERR_INVALID_ARGUMENT,
                 "made for a KV cache");
    mha_kv_cache *big = NULL;
    assert_int_equal(mha_kv_cache_for_module(m, 2, 25, &big), MHA_OK);
    b = a;
    b.cache = big;
    assert_fails(mha_plan_forward(p, &b), MHA_ERR_INVALID_ARGUMENT,
                 "capacity <= 10; the cache given holds 25");
    assert_int_equal(mha_kv_cache_length(big, 0), 0);
    mha_kv_cache_free(big);
    mha_plan_free(p);
    /* No backward after a cached forward. */
    assert_int_equal(mha_plan_create(m, &a, &p), MHA_OK);
    assert_int_equal(mha_plan_forward(p, &a), MHA_OK);   /* lengths 8 */
    float g[2 * 4 * 16];
    tu_fill(g, 2 * 4 * 16, 10, -1, 1);
    mha_backward_args bw = {0};
    bw.grad_out = g;
    bw.grad_query = y;
    assert_fails(mha_plan_backward(p, &a, &bw), MHA_ERR_INVALID_ARGUMENT,
                 "no forward");
    mha_plan_free(p);
    /* Appending and truncating. */
    assert_fails(mha_kv_cache_append(kv, 0, k, k, 3), MHA_ERR_INVALID_ARGUMENT,
                 "capacity 10");
    assert_fails(mha_kv_cache_append(kv, 2, k, k, 1), MHA_ERR_INVALID_ARGUMENT,
                 "sequence 2");
    assert_fails(mha_kv_cache_append(kv, 0, NULL, k, 1), MHA_ERR_NULL_POINTER,
                 "k is NULL");
    assert_fails(mha_kv_cache_truncate(kv, 1, 9), MHA_ERR_INVALID_ARGUMENT,
                 "length 8");
    assert_int_equal(mha_kv_cache_length(kv, 0), 8);
    assert_int_equal(mha_kv_cache_truncate(kv, 0, 2), MHA_OK);
    assert_int_equal(mha_kv_cache_length(kv, 0), 2);
    assert_int_equal(mha_kv_cache_reset(kv, -1), MHA_OK);
    assert_int_equal(mha_kv_cache_length(kv, 1), 0);
    assert_fails(mha_kv_cache_reset(kv, 5), MHA_ERR_INVALID_ARGUMENT,
                 "sequence 5");
    assert_int_equal(mha_kv_cache_length(NULL, 0), -1);
    assert_msg_has("cache is NULL");
    assert_int_equal(mha_kv_cache_length(kv, 2), -1);   /* a query's -1 */
    assert_msg_has("seq 2");
    mha_kv_cache_free(kv);
    mha_kv_cache_free(NULL);
    /* A cache for other heads than the module's. */
    mha_kv_cache_config other = {2, 2, 4, 10, MHA_KV_F32, 0, 0, 0, 0, 0, 0};
    assert_int_equal(mha_kv_cache_create(&other, &kv), MHA_OK);
    a.cache = kv;
    assert_fails(mha_forward(m, &a), MHA_ERR_SHAPE, "K/V heads");
    mha_kv_cache_free(kv);
    mha_free(m);
}

/* mha_attention on a cache (queries on heads, keys appended by the
 * caller): each sequence the same bits as mha_attention on its own keys,
 * causal bottom-right, and the mha_attention path refuses what it must. */
static void test_attention_on_cache(void **state)
{
    (void)state;
    enum { B = 2, H = 4, HKV = 2, DH = 8, LQ = 2, CAP = 1500, E = H * DH,
           EKV = HKV * DH };
    const int64_t lens[B] = {70, 1300};
    mha_kv_cache_config kc = {B, HKV, DH, CAP, MHA_KV_F32, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float *k = malloc((size_t)(CAP * EKV) * 4), *v = malloc((size_t)(CAP * EKV) * 4);
    float q[B * LQ * E], out[B * LQ * E], one[LQ * E], lse[B * H * LQ];
    tu_fill(q, B * LQ * E, 50, -1, 1);
    for (int64_t b = 0; b < B; b++) {
        tu_fill(k, lens[b] * EKV, 51 + (uint64_t)b, -1, 1);
        tu_fill(v, lens[b] * EKV, 61 + (uint64_t)b, -1, 1);
        assert_int_equal(mha_kv_cache_append(kv, b, k, v, lens[b]), MHA_OK);
    }
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.num_kv_heads = HKV;
    a.head_dim = DH;
    a.q_len = LQ;
    a.q = q;
    a.cache = kv;
    a.out = out;
    a.lse = lse;
    assert_int_equal(mha_attention(&a), MHA_OK);
    for (int64_t b = 0; b < B; b++) {
        tu_fill(k, lens[b] * EKV, 51 + (uint64_t)b, -1, 1);
        tu_fill(v, lens[b] * EKV, 61 + (uint64_t)b, -1, 1);
        mha_attention_args s = {0};
        s.batch = 1;
        s.num_heads = H;
        s.num_kv_heads = HKV;
        s.head_dim = DH;
        s.q_len = LQ;
        s.kv_len = lens[b];
        s.q = q + b * LQ * E;
        s.k = k;
        s.v = v;
        s.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        s.out = one;
        assert_int_equal(mha_attention(&s), MHA_OK);
        assert_memory_equal(one, out + b * LQ * E, sizeof one);
    }
    mha_attention_args bad = a;
    bad.k = k;
    assert_fails(mha_attention(&bad), MHA_ERR_INVALID_ARGUMENT, "k must be");
    bad = a;
    bad.num_kv_heads = 4;
    assert_fails(mha_attention(&bad), MHA_ERR_SHAPE, "cache holds");
    bad = a;
    bad.out = q;
    assert_fails(mha_attention(&bad), MHA_ERR_INVALID_ARGUMENT, "overlaps");
    mha_attention_plan *p = NULL;
    bad = a;
    bad.cache = NULL;
    bad.k = k;
    bad.v = v;
    bad.kv_len = 70;
    assert_int_equal(mha_attention_plan_create(&bad, &p), MHA_OK);
    assert_fails(mha_attention_plan_run(p, &a), MHA_ERR_INVALID_ARGUMENT,
                 "without a KV cache");
    mha_attention_plan_free(p);
    free(k);
    free(v);
    mha_kv_cache_free(kv);
}

int main(void)
{
    if (tu_backend_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_decode_equals_forward),
        cmocka_unit_test(test_long_decode),
        cmocka_unit_test(test_append_projected),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_misuse),
        cmocka_unit_test(test_attention_on_cache),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
