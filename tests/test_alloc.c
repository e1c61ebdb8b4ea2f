/*
 * test_alloc.c -- "mha_plan_forward then runs any arguments of the same
 * batch, q_len and kv_len without allocating" (include/mha.h), and "the
 * first [mha_plan_backward] allocates the backward workspace, later calls
 * allocate nothing".
 *
 * This program is linked with -Wl,--wrap=malloc,... (tests/CMakeLists.txt)
 * against the static libmha, so every call that libmha's own code (and
 * this program's) makes to malloc, calloc, realloc, posix_memalign and
 * aligned_alloc goes through the counters below.  OpenBLAS and the OpenMP
 * runtime are shared libraries: their internal allocations are theirs,
 * not libmha's, and are not counted.  test_wrap_counts_libmha checks that
 * libmha's allocations are seen at all.
 *
 * Every run is checked, the first included: with weights (both modes),
 * every mask kind and rank, key padding, key lengths, causal, head masks,
 * dropout, cross-attention with extra keys, the split-key decoding path,
 * and 2 threads on shapes large enough to run threaded (allocations in the
 * workers count too); and planned steps on a KV cache with masks, key
 * lengths and weights that follow its lengths.  Run once per
 * kernel tier (MHA_ISA) by CTest.
 */
#define _POSIX_C_SOURCE 200809L
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "testutil.h"

/* ---- the counters ---------------------------------------------------------- */

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t size);
void *__real_realloc(void *p, size_t n);
int __real_posix_memalign(void **p, size_t align, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t n, size_t size);
void *__wrap_realloc(void *p, size_t n);
int __wrap_posix_memalign(void **p, size_t align, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);

static atomic_int counting;
static atomic_long n_allocs;

static void count(void)
{
    if (atomic_load(&counting))
        atomic_fetch_add(&n_allocs, 1);
}

void *__wrap_malloc(size_t n)
{
    count();
    return __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t size)
{
    count();
    return __real_calloc(n, size);
}
void *__wrap_realloc(void *p, size_t n)
{
    count();
    return __real_realloc(p, n);
}
int __wrap_posix_memalign(void **p, size_t align, size_t n)
{
    count();
    return __real_posix_memalign(p, align, n);
}
void *__wrap_aligned_alloc(size_t align, size_t n)
{
    count();
    return __real_aligned_alloc(align, n);
}

static void start_counting(void)
{
    atomic_store(&n_allocs, 0);
    atomic_store(&counting, 1);
}

static long stop_counting(void)
{
    atomic_store(&counting, 0);
    return atomic_load(&n_allocs);
}

/* ---- the problems ---------------------------------------------------------- */

typedef struct problem {
    const char *name;
    int64_t E, H, kdim, vdim, B, Lq, Lk;   /* Lk 0: self-attention */
    int bias_kv, zero_attn;
    float dropout;
    int threads;
} problem;

static const problem PROBLEMS[] = {
    {"self, one thread", 16, 2, 0, 0, 2, 70, 0, 0, 0, 0.2f, 1},
    /* just above 2^20 multiply-adds (B H Lq Lt d_h): the attention runs
     * on 2 threads */
    {"self, 2 threads", 32, 2, 0, 0, 1, 260, 0, 0, 0, 0.2f, 2},
    {"cross, extra keys, 2 threads", 64, 4, 24, 40, 2, 64, 130, 1, 1, 0.1f,
     2},
    /* Lq <= 64, Lk >= 1024: the keys are split in chunks */
    {"decoding, split keys, 2 threads", 32, 4, 0, 0, 1, 40, 1100, 1, 0,
     0.1f, 2},
};

/* The variations run on one plan, each a forward that must not allocate. */
enum { N_VARIANTS = 12 };

static void variant(int v, mha_forward_args *a, const void *allow2,
                    const void *add4, const void *pad, const int64_t *lens,
                    const float *head_mask, float *w, const float *q2)
{
    const int64_t B = a->batch, Lq = a->q_len;
    const int64_t Lk = a->kv_len ? a->kv_len : a->q_len;
    a->need_weights = MHA_WEIGHTS_NONE;
    a->attn_weights = NULL;
    a->attn_mask = (mha_mask){0};
    a->key_padding_mask = (mha_mask){0};
    a->key_lengths = NULL;
    a->causal = MHA_CAUSAL_NONE;
    a->head_mask = NULL;
    a->training = 0;
    switch (v) {
    case 0: break;                                        /* plain */
    case 1: a->need_weights = MHA_WEIGHTS_PER_HEAD; a->attn_weights = w; break;
    case 2: a->need_weights = MHA_WEIGHTS_AVERAGE; a->attn_weights = w; break;
    case 3: a->attn_mask = (mha_mask){MHA_MASK_ALLOW, allow2, 2, {Lq, Lk}};
            break;
    case 4: a->attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add4, 4,
                                      {1, 1, Lq, Lk}};
            break;
    case 5: a->key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, Lk}};
            break;
    case 6: a->key_lengths = lens; break;
    case 7: a->causal = MHA_CAUSAL_BOTTOM_RIGHT; break;
    case 8: a->head_mask = head_mask; break;
    case 9: a->training = 1; break;                       /* dropout */
    case 10: /* everything at once */
        a->need_weights = MHA_WEIGHTS_PER_HEAD;
        a->attn_weights = w;
        a->attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add4, 4, {1, 1, Lq, Lk}};
        a->key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, Lk}};
        a->key_lengths = lens;
        a->causal = MHA_CAUSAL_TOP_LEFT;
        a->head_mask = head_mask;
        a->training = 1;
        break;
    case 11: a->query = q2; a->training = 1; break;     /* other inputs */
    default: fail_msg("no variant %d", v);
    }
}

static void test_plan_forward_allocates_nothing(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof PROBLEMS / sizeof *PROBLEMS; t++) {
        const problem *p = &PROBLEMS[t];
        mha_config cfg = {0};
        cfg.embed_dim = p->E;
        cfg.num_heads = p->H;
        cfg.kdim = p->kdim;
        cfg.vdim = p->vdim;
        cfg.add_bias_kv = p->bias_kv;
        cfg.add_zero_attn = p->zero_attn;
        cfg.dropout = p->dropout;
        mha_module *m = tu_module(&cfg, 40 + t);
        assert_non_null(m);
        mha_config rc;
        mha_get_config(m, &rc);
        const int64_t B = p->B, Lq = p->Lq, Lk = p->Lk ? p->Lk : p->Lq;
        const int64_t Lt = mha_total_keys(m, Lk), E = p->E, H = p->H;
        /* (under 2^20 multiply-adds the attention runs on one thread,
         * src/attention.c) */
        if (p->threads > 1 && (double)B * H * Lq * Lt * (E / H) < (1 << 20))
            fail_msg("%s would run on one thread", p->name);
        float *q = malloc((size_t)(B * Lq * E) * sizeof *q);
        float *q2 = malloc((size_t)(B * Lq * E) * sizeof *q2);
        float *k = malloc((size_t)(B * Lk * rc.kdim) * sizeof *k);
        float *v = malloc((size_t)(B * Lk * rc.vdim) * sizeof *v);
        float *out = malloc((size_t)(B * Lq * E) * sizeof *out);
        float *w = malloc((size_t)(B * H * Lq * Lt) * sizeof *w);
        uint8_t *allow2 = malloc((size_t)(Lq * Lk));
        float *add4 = malloc((size_t)(Lq * Lk) * sizeof *add4);
        uint8_t *pad = malloc((size_t)(B * Lk));
        int64_t *lens = malloc((size_t)B * sizeof *lens);
        float *head_mask = malloc((size_t)H * sizeof *head_mask);
        tu_fill(q, B * Lq * E, 1 + t, -1, 1);
        tu_fill(q2, B * Lq * E, 2 + t, -1, 1);
        tu_fill(k, B * Lk * rc.kdim, 3 + t, -1, 1);
        tu_fill(v, B * Lk * rc.vdim, 4 + t, -1, 1);
        tu_fill(add4, Lq * Lk, 5 + t, -2, 2);
        for (int64_t x = 0; x < Lq * Lk; x++)
            allow2[x] = x % 3 != 1;
        for (int64_t x = 0; x < B * Lk; x++)
            pad[x] = x % 5 == 2;
        for (int64_t b = 0; b < B; b++)
            lens[b] = Lk - 3 * b;
        for (int64_t h = 0; h < H; h++)
            head_mask[h] = h == 1 ? 0.0f : 1.0f + 0.25f * (float)h;

        mha_forward_args a = {0};
        a.batch = B;
        a.q_len = Lq;
        a.kv_len = p->Lk;
        a.query = q;
        a.key = p->Lk ? k : NULL;
        a.value = p->Lk ? v : NULL;
        a.dropout_seed = 77;
        a.num_threads = p->threads;
        a.out = out;
        a.need_weights = MHA_WEIGHTS_PER_HEAD;   /* the largest output */
        mha_plan *plan = NULL;
        assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
        for (int vi = 0; vi < N_VARIANTS; vi++) {
            mha_forward_args r = a;
            variant(vi, &r, allow2, add4, pad, lens, head_mask, w, q2);
            start_counting();
            const mha_status st = mha_plan_forward(plan, &r);
            const long n = stop_counting();
            if (st != MHA_OK)
                fail_msg("%s, variant %d: %s", p->name, vi, mha_last_error());
            if (n != 0)
                fail_msg("%s: mha_plan_forward (variant %d, %s run) "
                         "allocated %ld times", p->name, vi,
                         vi == 0 ? "the first" : "a later", n);
        }

        /* The backward: its first call allocates its workspace, later ones
         * (after other forwards too) nothing. */
        float *G = malloc((size_t)(B * Lq * E) * sizeof *G);
        float *gq = malloc((size_t)(B * Lq * E) * sizeof *gq);
        float *gp = malloc((size_t)mha_param_numel(m) * sizeof *gp);
        tu_fill(G, B * Lq * E, 9 + t, -1, 1);
        mha_backward_args bw = {0};
        bw.grad_out = G;
        bw.grad_query = gq;
        bw.grad_params = gp;
        mha_forward_args f = a;
        variant(10, &f, allow2, add4, pad, lens, head_mask, w, q2);
        assert_int_equal(mha_plan_forward(plan, &f), MHA_OK);
        assert_int_equal(mha_plan_backward(plan, &f, &bw), MHA_OK);
        for (int round = 0; round < 2; round++) {
            f.dropout_seed = 100 + (uint64_t)round;
            start_counting();
            mha_status st = mha_plan_forward(plan, &f);
            if (st == MHA_OK)
                st = mha_plan_backward(plan, &f, &bw);
            const long n = stop_counting();
            if (st != MHA_OK)
                fail_msg("%s, backward: %s", p->name, mha_last_error());
            if (n != 0)
                fail_msg("%s: mha_plan_forward + mha_plan_backward after the "
                         "first backward allocated %ld times", p->name, n);
        }
        mha_plan_free(plan);
        free(G); free(gq); free(gp);
        free(q); free(q2); free(k); free(v); free(out); free(w); free(allow2);
        free(add4); free(pad); free(lens); free(head_mask);
        mha_free(m);
    }
}

/* Planned forwards with a KV cache (the module's and mha_attention's):
 * masks, key lengths and weights that follow the cache's lengths step
 * after step, on the split-key path, on 2 threads: nothing allocated. */
static void test_cached_plan_allocates_nothing(void **state)
{
    (void)state;
    enum { B = 3, E = 128, H = 4, HKV = 2, DH = 32, LQ = 3, CAP = 1200,
           EKV = HKV * DH, STEPS = 4 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.num_kv_heads = HKV;
    cfg.add_bias_kv = 1;
    mha_module *m = tu_module(&cfg, 60);
    assert_non_null(m);
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_for_module(m, B, CAP, &kv), MHA_OK);
    static const int64_t lens[B] = {1100, 300, 0};
    float *kvd = malloc((size_t)(2 * 1100 * EKV) * sizeof *kvd);
    tu_fill(kvd, 2 * 1100 * EKV, 61, -1, 1);
    for (int64_t b = 0; b < B; b++)
        assert_int_equal(mha_kv_cache_append(kv, b, kvd, kvd + 1100 * EKV,
                                             lens[b]), MHA_OK);
    free(kvd);
    const int64_t maxk = CAP + 1;
    float *x = malloc((size_t)(B * LQ * E) * sizeof *x);
    float *out = malloc((size_t)(B * LQ * E) * sizeof *out);
    float *w = malloc((size_t)(B * H * LQ * maxk) * sizeof *w);
    float *add = malloc((size_t)(B * H * LQ * maxk) * sizeof *add);
    uint8_t *pad = malloc((size_t)(B * maxk));
    int64_t kl[B];
    const float head_mask[H] = {1.0f, 0.0f, 0.5f, 2.0f};
    tu_fill(x, B * LQ * E, 62, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = LQ;
    a.query = x;
    a.cache = kv;
    a.num_threads = 2;
    a.out = out;
    mha_plan *plan = NULL;
    assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
    for (int step = 0; step < STEPS; step++) {
        const int64_t Lk = 1100 + LQ * (step + 1);
        tu_fill(add, B * H * LQ * Lk, 63 + (uint64_t)step, -2, 2);
        for (int64_t x2 = 0; x2 < B * Lk; x2++)
            pad[x2] = x2 % 7 == 3;
        for (int64_t b = 0; b < B; b++)
            kl[b] = Lk - 5 * b;
        mha_forward_args r = a;
        r.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 4, {B, H, LQ, Lk}};
        r.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, Lk}};
        r.key_lengths = kl;
        r.head_mask = head_mask;
        r.need_weights = step % 2 ? MHA_WEIGHTS_AVERAGE : MHA_WEIGHTS_PER_HEAD;
        r.attn_weights = w;
        start_counting();
        const mha_status st = mha_plan_forward(plan, &r);
        const long n = stop_counting();
        if (st != MHA_OK)
            fail_msg("cached step %d: %s", step, mha_last_error());
        if (n != 0)
            fail_msg("cached mha_plan_forward (step %d) allocated %ld times",
                     step, n);
    }
    mha_plan_free(plan);

    /* mha_attention on the same cache (lengths 1112, 312, 12). */
    const int64_t Lk = 1100 + LQ * STEPS;
    float *q = malloc((size_t)(B * LQ * H * DH) * sizeof *q);
    tu_fill(q, B * LQ * H * DH, 64, -1, 1);
    mha_attention_args t = {0};
    t.batch = B;
    t.num_heads = H;
    t.num_kv_heads = HKV;
    t.head_dim = DH;
    t.q_len = LQ;
    t.q = q;
    t.cache = kv;
    t.num_threads = 2;
    t.out = out;
    mha_attention_plan *ap = NULL;
    assert_int_equal(mha_attention_plan_create(&t, &ap), MHA_OK);
    t.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 4, {B, H, LQ, Lk}};
    t.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, Lk}};
    t.key_lengths = kl;
    t.need_weights = MHA_WEIGHTS_PER_HEAD;
    t.attn_weights = w;
    for (int64_t b = 0; b < B; b++)
        kl[b] = Lk - 5 * b;
    start_counting();
    const mha_status st = mha_attention_plan_run(ap, &t);
    const long n = stop_counting();
    if (st != MHA_OK)
        fail_msg("mha_attention on the cache: %s", mha_last_error());
    if (n != 0)
        fail_msg("mha_attention_plan_run on a cache allocated %ld times", n);
    mha_attention_plan_free(ap);
    free(q);
    free(x);
    free(out);
    free(w);
    free(add);
    free(pad);
    mha_kv_cache_free(kv);
    mha_free(m);
}

/* The counters see libmha's own allocations: a one-shot forward allocates
 * its workspace, a plan its plan; and they count nothing when off. */
static void test_wrap_counts_libmha(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 16;
    cfg.num_heads = 2;
    mha_module *m = tu_module(&cfg, 3);
    float x[2 * 5 * 16], out[2 * 5 * 16];
    tu_fill(x, 2 * 5 * 16, 1, -1, 1);
    mha_forward_args a = {0};
    a.batch = 2;
    a.q_len = 5;
    a.query = x;
    a.out = out;
    start_counting();
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_true(stop_counting() > 0);
    mha_plan *plan = NULL;
    start_counting();
    assert_int_equal(mha_plan_create(m, &a, &plan), MHA_OK);
    assert_true(stop_counting() >= 2);   /* the plan and its workspace */
    start_counting();
    mha_plan_free(plan);
    assert_int_equal(stop_counting(), 0);
    void *p = malloc(10);
    assert_int_equal(atomic_load(&n_allocs), 0);
    free(p);
    mha_free(m);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_wrap_counts_libmha),
        cmocka_unit_test(test_plan_forward_allocates_nothing),
        cmocka_unit_test(test_cached_plan_allocates_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
