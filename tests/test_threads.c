/*
 * test_threads.c -- the attention's threads and plans: outputs and weights
 * bitwise identical for 1, 2, 3 and 4 threads, gradients for 1, 2 and 4
 * (and the output equal to the float64 reference within the suite's
 * bound), on shapes large enough to run threaded: every block path, the
 * split keys of decoding, dropout, d_h = 80, the backward; a plan runs
 * many calls with no change in results and refuses arguments it was not
 * made for; threads loading good and bad safetensors files at once each
 * get their own answer and message (run under ThreadSanitizer by
 * scripts/test.sh: cJSON's parse writes a process-wide error record, so
 * the library's parses take turns); threads decoding from one KV cache
 * at once each get a lone call's bits.  Run once per kernel tier (MHA_ISA)
 * by CTest.
 */
#define _XOPEN_SOURCE 700   /* mkdtemp */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "mha_io.h"

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

/* Every shape is above the engine's one-thread threshold: below 2^20
 * multiply-adds, B * H * Lq * Lt * d_h (Lt: keys with the extra ones), the
 * forward and the backward run on one thread whatever num_threads says
 * (src/attention.c, mha_attn_run and mha_attn_backward), and a thread
 * test there would compare one thread with itself.  test_thread_counts
 * asserts it for each shape. */
#define ONE_THREAD_BELOW (1 << 20)

static const shape SHAPES[] = {
    {"self, many blocks", 64, 4, 2, 200, 0, 0, 0, 0, 0, 0, 0, 0, MHA_WEIGHTS_AVERAGE},
    {"causal, diagonal tiles", 64, 2, 1, 300, 0, 0, 0, 0, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, MHA_WEIGHTS_PER_HEAD},
    {"cross, padding, lengths", 48, 3, 3, 70, 130, 1, 1, 1, 0, 1, 1, 0, MHA_WEIGHTS_PER_HEAD},
    /* one query, fewer keys than a split needs: one work item per (b, h) */
    {"decoding, one query", 16, 2, 72, 1, 1000, 1, 0, 0, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, MHA_WEIGHTS_AVERAGE},
    {"dropout", 32, 2, 5, 90, 0, 0, 0, 0, MHA_CAUSAL_TOP_LEFT, 0, 0, 0.3f, MHA_WEIGHTS_PER_HEAD},
    /* few queries (<= 64), many keys (>= 1024): the keys are split in
     * chunks of 512, computed in parallel and merged */
    {"decoding, split keys", 64, 2, 2, 40, 1500, 1, 1, 1, MHA_CAUSAL_BOTTOM_RIGHT, 1, 1, 0, MHA_WEIGHTS_PER_HEAD},
    {"decoding, split, dropout", 32, 2, 4, 16, 2100, 1, 0, 0, 0, 0, 0, 0.2f, MHA_WEIGHTS_AVERAGE},
    {"head dim 80", 160, 2, 2, 65, 0, 0, 0, 0, 0, 1, 0, 0, MHA_WEIGHTS_NONE},
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
    a.attn_weights = s->weights ? r.w : NULL;
    a.num_threads = threads;
    a.out = r.out;
    if (mha_forward(m, &a) != MHA_OK)
        fail_msg("%s, %d threads: %s", s->name, threads, mha_last_error());
    return r;
}

/* The gradients of every input and parameter for `threads` threads. */
typedef struct grads {
    float *q, *k, *v, *p;
} grads;

static grads backward(const mha_module *m, const shape *s, const float *q,
                      const float *kv, const uint8_t *pad,
                      const int64_t *lens, const float *G, int threads,
                      int64_t n_q, int64_t n_kv)
{
    grads g = {malloc((size_t)n_q * sizeof(float)),
               malloc((size_t)n_kv * sizeof(float)),
               malloc((size_t)n_kv * sizeof(float)),
               malloc((size_t)mha_param_numel(m) * sizeof(float))};
    mha_forward_args a = problem(s, q, kv, pad, lens);
    a.num_threads = threads;
    /* cross: key and value are one buffer, two inputs (mha.h) */
    mha_backward_args bw = {.grad_out = G, .grad_query = g.q, .grad_key = s->cross ? g.k : NULL, .grad_value = s->cross ? g.v : NULL, .grad_params = g.p, .accumulate = 0, .grad_head_mask = NULL};
    if (mha_backward(m, &a, &bw) != MHA_OK)
        fail_msg("%s, backward on %d threads: %s", s->name, threads,
                 mha_last_error());
    return g;
}

/* Every shape runs; the differences are listed, then the test fails. */
#define DIFFERS(what, t)                                                     \
    do {                                                                     \
        print_error("%s: %s with %d threads differ from 1 thread\n",        \
                    s->name, what, t);                                       \
        differ++;                                                            \
    } while (0)

static void test_thread_counts(void **state)
{
    (void)state;
    int differ = 0;
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
        const double work = (double)s->B * s->H * s->Lq * Lt * (s->E / s->H);
        if (!(work >= ONE_THREAD_BELOW))
            fail_msg("%s: %.0f multiply-adds, under %d: it would run on one "
                     "thread", s->name, work, ONE_THREAD_BELOW);
        const int64_t n_q = s->B * s->Lq * s->E, n_kv = s->B * Lk * s->E;
        const int64_t n_w = s->weights == MHA_WEIGHTS_PER_HEAD
                                ? s->B * s->H * s->Lq * Lt
                            : s->weights == MHA_WEIGHTS_AVERAGE
                                ? s->B * s->Lq * Lt : 0;
        const int64_t n_p = mha_param_numel(m);
        float *q = malloc((size_t)n_q * sizeof *q);
        float *kv = malloc((size_t)n_kv * sizeof *kv);
        float *G = malloc((size_t)n_q * sizeof *G);
        uint8_t *pad = calloc((size_t)(s->B * Lk), 1);
        int64_t *lens = malloc((size_t)s->B * sizeof *lens);
        tu_fill(q, n_q, 100 + k, -1, 1);
        tu_fill(kv, n_kv, 200 + k, -1, 1);
        tu_fill(G, n_q, 300 + k, -1, 1);
        for (int64_t b = 0; b < s->B; b++) {
            lens[b] = Lk - 7 * b - 1;
            for (int64_t j = 0; j < Lk; j++)
                pad[b * Lk + j] = (j * 7 + b) % 5 == 0;
        }
        run one = forward(m, s, q, kv, pad, lens, 1, n_q, n_w);
        grads g1 = backward(m, s, q, kv, pad, lens, G, 1, n_q, n_kv);
        for (int t = 2; t <= 4; t++) {
            run r = forward(m, s, q, kv, pad, lens, t, n_q, n_w);
            if (memcmp(one.out, r.out, (size_t)n_q * sizeof(float)))
                DIFFERS("output", t);
            if (n_w && memcmp(one.w, r.w, (size_t)n_w * sizeof(float)))
                DIFFERS("weights", t);
            free(r.out);
            free(r.w);
            if (t == 3)
                continue;   /* the backward on 1, 2 and 4 threads */
            grads g = backward(m, s, q, kv, pad, lens, G, t, n_q, n_kv);
            if (memcmp(g1.q, g.q, (size_t)n_q * sizeof(float)) ||
                (s->cross &&
                 (memcmp(g1.k, g.k, (size_t)n_kv * sizeof(float)) ||
                  memcmp(g1.v, g.v, (size_t)n_kv * sizeof(float)))) ||
                memcmp(g1.p, g.p, (size_t)n_p * sizeof(float)))
                DIFFERS("gradients", t);
            free(g.q); free(g.k); free(g.v); free(g.p);
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
        free(one.out); free(one.w); free(q); free(kv); free(G); free(pad);
        free(lens); free(g1.q); free(g1.k); free(g1.v); free(g1.p);
        mha_free(m);
    }
    if (differ)
        fail_msg("%d results depend on the thread count", differ);
}
#undef DIFFERS

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

/* ---- concurrent loads ---------------------------------------------------- */

typedef struct loader {
    const char *good, *bad;
    int wrong;              /* loads that did not answer as they should */
} loader;

static void *load_many(void *arg)
{
    loader *l = arg;
    for (int k = 0; k < 40; k++) {
        mha_tensor_file *f = NULL;
        if (mha_safetensors_load(l->good, &f) != MHA_OK ||
            mha_tensor_file_count(f) != 1)
            l->wrong++;
        mha_tensor_file_free(f);
        f = NULL;
        if (mha_safetensors_load(l->bad, &f) != MHA_ERR_FORMAT || f ||
            !strstr(mha_last_error(), "nests too deeply"))
            l->wrong++;
    }
    return NULL;
}

static void test_concurrent_loads(void **state)
{
    (void)state;
    char dir[] = "/tmp/mha-threads-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char good[64], bad[64];
    snprintf(good, sizeof good, "%s/good.safetensors", dir);
    snprintf(bad, sizeof bad, "%s/bad.safetensors", dir);
    float x[6] = {1, 2, 3, 4, 5, 6};
    const mha_tensor_view t = {"x", MHA_DTYPE_F32, 2, {2, 3}, x};
    assert_int_equal(mha_safetensors_save(good, &t, 1, NULL, NULL, 0),
                     MHA_OK);
    /* lexically valid JSON nested past cJSON's limit: the parse fails */
    const int depth = 1100;
    char *json = malloc(2 * depth + 16);
    int n = 0;
    json[n++] = '{';
    json[n++] = '"';
    json[n++] = 'a';
    json[n++] = '"';
    json[n++] = ':';
    for (int k = 0; k < depth; k++)
        json[n++] = '[';
    for (int k = 0; k < depth; k++)
        json[n++] = ']';
    json[n++] = '}';
    unsigned char len[8] = {0};
    for (int k = 0; k < 8; k++)
        len[k] = (unsigned char)((uint64_t)n >> (8 * k));
    FILE *f = fopen(bad, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(len, 1, 8, f), 8);
    assert_int_equal(fwrite(json, 1, (size_t)n, f), (size_t)n);
    assert_int_equal(fclose(f), 0);
    free(json);
    enum { T = 4 };
    pthread_t th[T];
    loader l[T];
    for (int i = 0; i < T; i++) {
        l[i] = (loader){good, bad, 0};
        assert_int_equal(pthread_create(&th[i], NULL, load_many, &l[i]), 0);
    }
    for (int i = 0; i < T; i++) {
        assert_int_equal(pthread_join(th[i], NULL), 0);
        assert_int_equal(l[i].wrong, 0);
    }
    unlink(good);
    unlink(bad);
    rmdir(dir);
}

/* Calls reading one KV cache may run together (docs/semantics.md,
 * "Threads" under "Paged KV caches"): four threads decode from one
 * contiguous and one paged cache at once, a plain batched step and a
 * ragged one each, every result bitwise the one a lone call gave (and,
 * under ThreadSanitizer, no call writes what another reads). */
enum { CB = 3, CH = 4, CHKV = 2, CDH = 32, CLEN = 200 };
typedef struct reader {
    mha_kv_cache *kv;
    const float *q;        /* (CB, CH * CDH) */
    const float *want;     /* the plain step's rows, then the ragged one's */
    int wrong;
} reader;

static void *read_cache(void *arg)
{
    reader *r = arg;
    float out[2 * CB * CH * CDH];
    int64_t q_start[CB + 1] = {0, 1, 2, 3};
    for (int i = 0; i < 10; i++) {
        mha_attention_decode_args d = {0};
        d.batch = CB, d.num_heads = CH, d.head_dim = CDH, d.q_len = 1;
        d.q = r->q, d.out = out, d.cache = r->kv, d.num_threads = 1;
        r->wrong += mha_attention_decode(&d) != MHA_OK;
        d.q_len = 0, d.q_start = q_start, d.out = out + CB * CH * CDH;
        r->wrong += mha_attention_decode(&d) != MHA_OK;
        r->wrong += memcmp(out, r->want, sizeof out) != 0;
    }
    return NULL;
}

static void test_concurrent_cache_reads(void **state)
{
    (void)state;
    static float k[CLEN * CHKV * CDH], v[CLEN * CHKV * CDH];
    static const int pages[3] = {0, 64, 16};
    for (int pi = 0; pi < 3; pi++) {
        const int page = pages[pi];
        mha_kv_cache_config cc = {0};
        cc.batch = CB, cc.num_kv_heads = CHKV, cc.head_dim = CDH;
        cc.capacity = CLEN, cc.dtype = MHA_KV_F16, cc.page_size = page;
        mha_kv_cache *kv = NULL;
        assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
        for (int64_t b = 0; b < CB; b++) {
            const int64_t n = CLEN - 30 * b;
            tu_fill(k, n * CHKV * CDH, 300 + (uint64_t)b, -1, 1);
            tu_fill(v, n * CHKV * CDH, 310 + (uint64_t)b, -1, 1);
            assert_int_equal(mha_kv_cache_append(kv, b, k, v, n), MHA_OK);
        }
        enum { T = 4 };
        static float q[T][CB * CH * CDH], want[T][2 * CB * CH * CDH];
        reader r[T];
        pthread_t th[T];
        for (int i = 0; i < T; i++) {
            tu_fill(q[i], CB * CH * CDH, 320 + (uint64_t)i, -1, 1);
            r[i] = (reader){kv, q[i], want[i], 0};
            /* the lone call's rows: the first of read_cache's loop */
            int64_t q_start[CB + 1] = {0, 1, 2, 3};
            mha_attention_decode_args d = {0};
            d.batch = CB, d.num_heads = CH, d.head_dim = CDH, d.q_len = 1;
            d.q = q[i], d.out = want[i], d.cache = kv, d.num_threads = 1;
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
            d.q_len = 0, d.q_start = q_start;
            d.out = want[i] + CB * CH * CDH;
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
        }
        for (int i = 0; i < T; i++)
            assert_int_equal(pthread_create(&th[i], NULL, read_cache, &r[i]),
                             0);
        for (int i = 0; i < T; i++) {
            assert_int_equal(pthread_join(th[i], NULL), 0);
            assert_int_equal(r[i].wrong, 0);
        }
        mha_kv_cache_free(kv);
    }
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_plan),
        cmocka_unit_test(test_thread_counts),
        cmocka_unit_test(test_concurrent_loads),
        cmocka_unit_test(test_concurrent_cache_reads),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
