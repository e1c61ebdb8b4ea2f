/*
 * test_kv_pages.c -- the paged KV cache (mha_kv_cache_config.page_size).
 *
 * A paged cache must hold and attend exactly what a contiguous cache
 * given the same operations holds: the same lengths, the same stored
 * values, the same attention bits.  So every test here runs the two side
 * by side.
 *   - random programs: thousands of operations (append, truncate, reset,
 *     fork, read, a decoding step on 1..3 threads) on small pools, so that
 *     appends run out of pages; after each, the page tables are checked
 *     against their counts (mha_kv_pages_consistent: every page's count is
 *     the entries naming it, the free stack the pages no one holds, no
 *     page past a sequence's length), the usage against the lengths, and
 *     a refused append must change nothing;
 *   - placement: sequences growing in turn get their pages side by side;
 *   - a decoding step against float64 attention over the values read back;
 *   - the module's forward with a paged cache;
 *   - memory: ragged sequences take their tokens' bytes, not capacity's;
 *   - misuse: every bad configuration or call refused by name.
 * Run once per kernel tier (MHA_ISA) by CTest: each tier's decoding
 * kernels read a tile from one page or from two or four (pages of 32, 16).
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
#include "attention/kv_cache.h"
#include "core/half.h"
#include "testutil.h"

enum { H = 4, HKV = 2, DH = 40, E = H * DH, EKV = HKV * DH, B = 4,
       CAP = 300 };

static uint64_t rng_state;
static uint64_t rnd(void)   /* splitmix64: the program's own sequence */
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int64_t below(int64_t n) { return (int64_t)(rnd() % (uint64_t)n); }

static mha_kv_cache *make(mha_kv_dtype dt, int64_t page, int64_t pages)
{
    mha_kv_cache_config c = {0};
    c.batch = B;
    c.num_kv_heads = HKV;
    c.head_dim = DH;
    c.capacity = CAP;
    c.dtype = dt;
    c.page_size = page;
    c.num_pages = pages;
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&c, &kv), MHA_OK);
    return kv;
}

/* The paged cache's tables and counts, and both caches' lengths and
 * usage, agree. */
static void check_state(const mha_kv_cache *paged, const mha_kv_cache *flat)
{
    assert_true(mha_kv_pages_consistent(paged));
    mha_kv_cache_usage u, f;
    assert_int_equal(mha_kv_cache_get_usage(paged, &u), MHA_OK);
    assert_int_equal(mha_kv_cache_get_usage(flat, &f), MHA_OK);
    int64_t pages_at_most = 0;
    for (int64_t b = 0; b < B; b++) {
        assert_int_equal(mha_kv_cache_length(paged, b),
                         mha_kv_cache_length(flat, b));
        pages_at_most += (mha_kv_cache_length(paged, b) + u.page_size - 1) /
                         u.page_size;
    }
    assert_int_equal(u.tokens, f.tokens);
    assert_int_equal(u.token_bytes, f.token_bytes);
    assert_int_equal(u.pages_used + u.pages_free, paged->pages);
    assert_true(u.pages_used <= pages_at_most);   /* shared ones once */
    assert_int_equal(u.bytes, u.pages_used * 2 * HKV * paged->tpp *
                                   paged->tile_bytes);
    assert_int_equal(f.page_size, 0);
    assert_int_equal(f.pages_used, 0);
}

/* A decoding step (one new query per sequence, its K/V appended before)
 * on both caches on `threads` threads: the same bits. */
static void same_step(mha_kv_cache *paged, mha_kv_cache *flat, int threads)
{
    static float q[B * E], o1[B * E], o2[B * E], l1[B * H], l2[B * H];
    for (int64_t i = 0; i < B * E; i++)
        q[i] = (float)((int64_t)below(2001) - 1000) / 1000.0f;
    mha_attention_decode_args d = {0};
    d.batch = B;
    d.num_heads = H;
    d.head_dim = DH;
    d.q_len = 1;
    d.q = q;
    d.num_threads = threads;
    d.cache = paged, d.out = o1, d.lse = l1;
    assert_int_equal(mha_attention_decode(&d), MHA_OK);
    d.cache = flat, d.out = o2, d.lse = l2;
    assert_int_equal(mha_attention_decode(&d), MHA_OK);
    assert_memory_equal(o1, o2, sizeof o1);
    assert_memory_equal(l1, l2, sizeof l1);
}

/* Tokens start .. start + n - 1 of sequence b read back: the same bits. */
static void same_read(const mha_kv_cache *paged, const mha_kv_cache *flat,
                      int64_t b)
{
    static float k1[CAP * EKV], v1[CAP * EKV], k2[CAP * EKV], v2[CAP * EKV];
    const int64_t len = mha_kv_cache_length(flat, b);
    const int64_t start = len ? below(len) : 0;
    const int64_t n = len - start;
    assert_int_equal(mha_kv_cache_read(paged, b, start, n, k1, v1), MHA_OK);
    assert_int_equal(mha_kv_cache_read(flat, b, start, n, k2, v2), MHA_OK);
    assert_memory_equal(k1, k2, (size_t)(n * EKV) * sizeof *k1);
    assert_memory_equal(v1, v2, (size_t)(n * EKV) * sizeof *v1);
}

/* One random program: `ops` operations on a paged cache of `pages`
 * pages of `page` positions and on a contiguous one. */
static void program(mha_kv_dtype dt, int64_t page, int64_t pages,
                    uint64_t seed, int ops)
{
    rng_state = seed;
    mha_kv_cache *paged = make(dt, page, pages), *flat = make(dt, 0, 0);
    static float k[128 * EKV], v[128 * EKV];
    static const int64_t sizes[] = {1, 1, 1, 2, 17, 64, 65, 100, 128};
    int refused = 0, forks = 0, steps = 0;
    for (int op = 0; op < ops; op++) {
        const int64_t b = below(B), len = mha_kv_cache_length(flat, b);
        const int what = (int)below(20);
        if (what < 9) {   /* append */
            int64_t n = sizes[below(9)];
            n = n < CAP - len ? n : CAP - len;
            tu_fill(k, n * EKV, rnd(), -2, 2);
            tu_fill(v, n * EKV, rnd(), -2, 2);
            mha_kv_cache_usage before, after;
            assert_int_equal(mha_kv_cache_get_usage(paged, &before), MHA_OK);
            const mha_status st = mha_kv_cache_append(paged, b, k, v, n);
            if (st == MHA_ERR_OUT_OF_MEMORY) {   /* the pool: nothing moved */
                assert_non_null(strstr(mha_last_error(), "pool is full"));
                assert_int_equal(mha_kv_cache_get_usage(paged, &after),
                                 MHA_OK);
                assert_memory_equal(&before, &after, sizeof before);
                refused++;
            } else {
                assert_int_equal(st, MHA_OK);
                assert_int_equal(mha_kv_cache_append(flat, b, k, v, n),
                                 MHA_OK);
            }
        } else if (what < 11) {   /* truncate (the rollback) */
            const int64_t to = len ? below(len + 1) : 0;
            assert_int_equal(mha_kv_cache_truncate(paged, b, to), MHA_OK);
            assert_int_equal(mha_kv_cache_truncate(flat, b, to), MHA_OK);
        } else if (what < 12) {   /* reset: the sequence leaves */
            assert_int_equal(mha_kv_cache_reset(paged, b), MHA_OK);
            assert_int_equal(mha_kv_cache_reset(flat, b), MHA_OK);
        } else if (what < 15) {   /* fork b into another slot */
            const int64_t to = (b + 1 + below(B - 1)) % B;
            assert_int_equal(mha_kv_cache_fork(paged, b, to), MHA_OK);
            assert_int_equal(mha_kv_cache_fork(flat, b, to), MHA_OK);
            forks++;
        } else if (what < 17) {
            same_read(paged, flat, b);
        } else {
            same_step(paged, flat, 1 + (int)below(3));
            steps++;
        }
        check_state(paged, flat);
    }
    for (int64_t b = 0; b < B; b++)
        same_read(paged, flat, b);
    /* every page back once no one holds it */
    assert_int_equal(mha_kv_cache_reset(paged, -1), MHA_OK);
    mha_kv_cache_usage u;
    assert_int_equal(mha_kv_cache_get_usage(paged, &u), MHA_OK);
    assert_int_equal(u.pages_free, paged->pages);
    assert_int_equal(u.tokens, 0);
    assert_true(mha_kv_pages_consistent(paged));
    print_message("dtype %d page %lld pool %lld: %d ops, %d appends refused "
                  "(pool full), %d forks, %d steps\n", (int)dt,
                  (long long)page, (long long)pages, ops, refused, forks,
                  steps);
    assert_true(refused > 0 && forks > 0 && steps > 0);   /* all exercised */
    mha_kv_cache_free(paged);
    mha_kv_cache_free(flat);
}

static void test_programs(void **state)
{
    (void)state;
    static const mha_kv_dtype dts[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16,
                                       MHA_KV_Q8, MHA_KV_Q4};
    /* pools of 8 pages of 64 and 4 of 128 (less than the 4 x 5, 4 x 3
     * pages that full sequences would take), and pages smaller than a
     * kernel's tile, 30 of 16 and 15 of 32 (of 4 x 19, 4 x 10): a tile
     * read from 4 or 2 pages must give the bits of a contiguous one */
    for (int d = 0; d < 5; d++) {
        program(dts[d], 64, 8, 100 + (uint64_t)d, 1500);
        program(dts[d], 128, 4, 200 + (uint64_t)d, 1500);
        program(dts[d], 16, 30, 300 + (uint64_t)d, 1500);
        program(dts[d], 32, 15, 400 + (uint64_t)d, 1500);
    }
}

/* Where pages go: sequences that grow a page at a time in turn (as a
 * server interleaves them) each get their pages side by side: a run of
 * their own from its first page, each page the one after the last
 * (kv_pages.c); a run given back is whole again and taken first.  In a
 * pool of just the pages they fill, whole runs run out and pages come
 * from anywhere free, until the pool is full.  The tables stay
 * consistent throughout; placement changes no bits (test_programs: any
 * page gives a contiguous cache's). */
static void placement(int64_t page)
{
    const int64_t run = page < MHA_PAGE_RUN ? MHA_PAGE_RUN / page : 1;
    const int64_t per = CAP / page;   /* pages a sequence fills below */
    static float k[256 * EKV], v[256 * EKV];
    tu_fill(k, page * EKV, 5, -1, 1);
    tu_fill(v, page * EKV, 6, -1, 1);
    for (int tight = 0; tight < 2; tight++) {
        /* room for every sequence in runs of its own, or just the pages */
        const int64_t runs_each = (per + run - 1) / run;
        const int64_t pool = tight ? B * per : B * runs_each * run;
        mha_kv_cache *kv = make(MHA_KV_F16, page, pool);
        int64_t loose = 0;   /* pages taken with no whole run left */
        for (int64_t i = 0; i < per; i++)
            for (int64_t b = 0; b < B; b++) {
                loose += kv->n_whole == 0;
                assert_int_equal(mha_kv_cache_append(kv, b, k, v, page),
                                 MHA_OK);
                assert_true(mha_kv_pages_consistent(kv));
            }
        assert_int_equal(kv->n_free, pool - B * per);
        if (tight) {   /* full: one more token refused, nothing moved */
            assert_true(run == 1 || loose > 0);
            assert_int_equal(kv->n_whole, 0);
            assert_int_equal(mha_kv_cache_append(kv, 0, k, v, 1),
                             MHA_ERR_OUT_OF_MEMORY);
            assert_int_equal(mha_kv_cache_length(kv, 0), per * page);
            assert_true(mha_kv_pages_consistent(kv));
            mha_kv_cache_free(kv);
            continue;
        }
        for (int64_t b = 0; b < B; b++) {
            const int32_t *t = kv->table + b * kv->table_len;
            for (int64_t i = 0; i < per; i++)   /* a run's first page, */
                assert_int_equal(t[i], i % run ? t[i - 1] + 1   /* next */
                                               : t[i] / run * run);
        }
        /* sequence 1 leaves: its runs whole again, one of them taken by
         * the next to start */
        int32_t held1[CAP];
        memcpy(held1, kv->table + kv->table_len, (size_t)per * sizeof *held1);
        assert_int_equal(mha_kv_cache_reset(kv, 1), MHA_OK);
        assert_int_equal(kv->n_whole, runs_each);
        assert_int_equal(mha_kv_cache_append(kv, 1, k, v, 1), MHA_OK);
        const int32_t again = kv->table[kv->table_len];
        int among = 0;
        for (int64_t i = 0; i < per; i++)
            among |= held1[i] / run == again / run;
        assert_true(among && again % run == 0);
        assert_true(mha_kv_pages_consistent(kv));
        mha_kv_cache_free(kv);
    }
}

static void test_placement(void **state)
{
    (void)state;
    placement(16);   /* runs of 16 pages */
    placement(32);   /* of 8 */
    placement(64);   /* of 4 */
    placement(256);  /* of 1: each page its own run */
}

/* float64 attention of one query head h (its DH elements at qr) over
 * the first `sees` keys and values read back (rows of EKV, K/V head h's
 * group): its DH outputs into r and its log-sum-exp returned. */
static double f64_head(const float *qr, int64_t h, const float *k,
                       const float *v, int64_t sees, double *r)
{
    const int64_t g = h / (H / HKV);
    static double s[1024];
    double m = -INFINITY, l = 0.0;
    for (int64_t j = 0; j < sees; j++) {
        double dot = 0.0;
        for (int64_t e = 0; e < DH; e++)
            dot += (double)qr[e] * k[j * EKV + g * DH + e];
        s[j] = dot / sqrt((double)DH);
        m = s[j] > m ? s[j] : m;
    }
    for (int64_t j = 0; j < sees; j++)
        l += exp(s[j] - m);
    for (int64_t e = 0; e < DH; e++) {
        r[e] = 0.0;
        for (int64_t j = 0; j < sees; j++)
            r[e] += exp(s[j] - m) / l * v[j * EKV + g * DH + e];
    }
    return m + log(l);
}

/* A step on a paged cache that forks and rolls back, against float64
 * attention over the values it reads back (each query row: the softmax of
 * q.k / sqrt(d_h) over the sequence's keys).  float32 sums of <= 300
 * terms of |p v| <= 2 err by < 300 * 2^-24 * 2 relative to the row's
 * sum: the bound below is 3x that. */
static void test_step_vs_float64(void **state)
{
    (void)state;
    rng_state = 7;
    mha_kv_cache *kv = make(MHA_KV_F32, 64, 12);
    static float k[CAP * EKV], v[CAP * EKV], q[B * E], o[B * E];
    tu_fill(k, 150 * EKV, 1, -2, 2);
    tu_fill(v, 150 * EKV, 2, -2, 2);
    assert_int_equal(mha_kv_cache_append(kv, 0, k, v, 150), MHA_OK);
    assert_int_equal(mha_kv_cache_fork(kv, 0, 1), MHA_OK);
    assert_int_equal(mha_kv_cache_fork(kv, 0, 2), MHA_OK);
    assert_int_equal(mha_kv_cache_truncate(kv, 2, 100), MHA_OK);
    tu_fill(k, 30 * EKV, 3, -2, 2);
    tu_fill(v, 30 * EKV, 4, -2, 2);
    assert_int_equal(mha_kv_cache_append(kv, 1, k, v, 30), MHA_OK);
    assert_int_equal(mha_kv_cache_append(kv, 2, k, v, 7), MHA_OK);
    assert_int_equal(mha_kv_cache_append(kv, 3, k, v, 1), MHA_OK);
    tu_fill(q, B * E, 5, -1, 1);
    mha_attention_decode_args d = {0};
    d.batch = B, d.num_heads = H, d.head_dim = DH, d.q_len = 1;
    d.q = q, d.out = o, d.cache = kv;
    assert_int_equal(mha_attention_decode(&d), MHA_OK);
    double worst = 0.0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = mha_kv_cache_length(kv, b);
        assert_int_equal(mha_kv_cache_read(kv, b, 0, n, k, v), MHA_OK);
        for (int64_t h = 0; h < H; h++) {
            double r[DH];
            f64_head(q + b * E + h * DH, h, k, v, n, r);
            for (int64_t e = 0; e < DH; e++) {
                const double err = fabs(o[b * E + h * DH + e] - r[e]);
                worst = err > worst ? err : worst;
            }
        }
    }
    print_message("paged step vs float64: worst error %.3g\n", worst);
    assert_true(worst < 3 * 300 * 2 * 0x1p-24);
    mha_kv_cache_free(kv);
}

/* The module's forward (prefill, then token by token) on a paged cache:
 * the contiguous cache's bits; a pool too small for a step refused with
 * the cache and the output untouched. */
static void test_module_forward(void **state)
{
    (void)state;
    enum { ME = 32, L0 = 70, STEPS = 5, MB = 2 };
    mha_config c = {0};
    c.embed_dim = ME;
    c.num_heads = 4;
    c.num_kv_heads = 2;
    mha_module *m = tu_module(&c, 21);
    assert_non_null(m);
    mha_kv_cache_config cc = {0};
    cc.batch = MB, cc.num_kv_heads = 2, cc.head_dim = ME / 4;
    cc.capacity = 200, cc.dtype = MHA_KV_F16;
    mha_kv_cache *flat = NULL, *paged = NULL, *tiny = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &flat), MHA_OK);
    cc.page_size = 64;
    assert_int_equal(mha_kv_cache_create(&cc, &paged), MHA_OK);
    cc.num_pages = 3;   /* two sequences of 70 tokens take 4 pages */
    assert_int_equal(mha_kv_cache_create(&cc, &tiny), MHA_OK);
    static float x[MB * L0 * ME], y1[MB * L0 * ME], y2[MB * L0 * ME];
    tu_fill(x, MB * L0 * ME, 22, -1, 1);
    mha_forward_args a = {0};
    a.batch = MB;
    a.q_len = L0;
    a.query = x;
    a.cache = tiny;
    a.out = y1;
    memset(y1, 0x5A, sizeof y1);
    assert_fails(mha_forward(m, &a), MHA_ERR_OUT_OF_MEMORY, "pool is full");
    assert_int_equal(mha_kv_cache_length(tiny, 0), 0);
    for (size_t i = 0; i < sizeof y1; i++)
        assert_int_equal(((unsigned char *)y1)[i], 0x5A);
    assert_true(mha_kv_pages_consistent(tiny));
    for (int step = 0; step <= STEPS; step++) {
        a.q_len = step ? 1 : L0;
        tu_fill(x, MB * a.q_len * ME, 30 + (uint64_t)step, -1, 1);
        a.cache = paged, a.out = y1;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        a.cache = flat, a.out = y2;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        assert_memory_equal(y1, y2, (size_t)(MB * a.q_len * ME) * 4);
    }
    assert_true(mha_kv_pages_consistent(paged));
    mha_kv_cache_free(flat);
    mha_kv_cache_free(paged);
    mha_kv_cache_free(tiny);
    mha_free(m);
}

/* 64 ragged sequences (lengths 256 .. 8192) in pages of 64 or 16: the
 * pages hold at most 1.1x their tokens' bytes (each sequence wastes <
 * 64 positions of its last page), where a contiguous cache holds the
 * capacity times the batch. */
static void memory_ragged(int64_t page)
{
    enum { NS = 64, MAXLEN = 8192 };
    mha_kv_cache_config cc = {0};
    cc.batch = NS, cc.num_kv_heads = 1, cc.head_dim = 16;
    cc.capacity = MAXLEN, cc.dtype = MHA_KV_F16, cc.page_size = page;
    cc.num_pages = NS * MAXLEN / page * 3 / 4;   /* 3/4 of a contiguous one */
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
    static float k[MAXLEN * 16], v[MAXLEN * 16];
    tu_fill(k, MAXLEN * 16, 1, -1, 1);
    tu_fill(v, MAXLEN * 16, 2, -1, 1);
    rng_state = 3;
    for (int64_t b = 0; b < NS; b++) {
        const int64_t n = 256 + below(MAXLEN - 256 + 1);
        assert_int_equal(mha_kv_cache_append(kv, b, k, v, n), MHA_OK);
    }
    mha_kv_cache_usage u;
    assert_int_equal(mha_kv_cache_get_usage(kv, &u), MHA_OK);
    const double ratio = (double)u.bytes / (double)u.token_bytes;
    print_message("64 ragged sequences, %lld tokens, pages of %lld: pages "
                  "hold %.4fx their bytes (%lld of %lld pages)\n",
                  (long long)u.tokens, (long long)page, ratio,
                  (long long)u.pages_used,
                  (long long)(u.pages_used + u.pages_free));
    assert_true(ratio >= 1.0 && ratio <= 1.1);
    assert_int_equal(u.token_bytes, u.tokens * 2 * 16 * 2);   /* K, V f16 */
    mha_kv_cache_free(kv);
}

static void test_memory_ragged(void **state)
{
    (void)state;
    memory_ragged(64);
    memory_ragged(16);
}

/* Each sequence of a ragged step `d` (already run: its out / out16 and
 * lse hold the step's rows) against a call on a cache holding that
 * sequence alone (alone[b]), the same arguments otherwise: its rows and
 * lse bitwise the same.  one and l_one: room for the longest's rows. */
static void assert_each_alone(const mha_attention_decode_args *d,
                              const int64_t *fresh, mha_kv_cache **alone,
                              void *one, float *l_one)
{
    const int half = d->dtype == MHA_DTYPE_BF16;
    for (int64_t b = 0; b < d->batch; b++) {
        if (!fresh[b])
            continue;
        const int64_t r0 = d->q_start[b];
        mha_attention_decode_args s = *d;
        s.batch = 1, s.q_start = NULL, s.q_len = fresh[b];
        s.cache = alone[b];
        if (d->q_positions)
            s.q_positions = d->q_positions + r0;
        if (half)
            s.q16 = d->q16 + r0 * E, s.out16 = one;
        else
            s.q = d->q + r0 * E, s.out = one, s.lse = d->lse ? l_one : NULL;
        assert_int_equal(mha_attention_decode(&s), MHA_OK);
        if (half)
            assert_memory_equal(d->out16 + r0 * E, one,
                                (size_t)(fresh[b] * E) * 2);
        else
            assert_memory_equal(d->out + r0 * E, one,
                                (size_t)(fresh[b] * E) * 4);
        if (!half && d->lse)
            assert_memory_equal(d->lse + r0 * H, l_one,
                                (size_t)(fresh[b] * H) * 4);
    }
}

/* A ragged step (q_start): sequences with 0, 1, 37 and 100 new tokens in
 * one call, on a paged and a contiguous cache, each sequence's rows (and
 * lse) bitwise those of a cache holding that sequence alone, on 1, 2 and
 * 3 threads; bf16 queries too; misuse refused with out untouched. */
static void test_ragged_step(void **state)
{
    (void)state;
    static const int64_t held[B] = {70, 5, 200, 131}, fresh[B] = {0, 1, 37,
                                                                  100};
    int64_t q_start[B + 1] = {0};
    for (int64_t b = 0; b < B; b++)
        q_start[b + 1] = q_start[b] + fresh[b];
    const int64_t T = q_start[B];
    mha_kv_cache *paged = make(MHA_KV_F16, 64, 20), *flat = make(MHA_KV_F16,
                                                                0, 0);
    mha_kv_cache *alone[B];
    static float k[CAP * EKV], v[CAP * EKV], q[138 * E], o1[138 * E],
        o2[138 * E], o3[138 * E], l1[138 * H], l3[138 * H];
    mha_kv_cache_config one = {0};
    one.batch = 1, one.num_kv_heads = HKV, one.head_dim = DH;
    one.capacity = CAP, one.dtype = MHA_KV_F16;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = held[b] + fresh[b];
        tu_fill(k, n * EKV, 40 + (uint64_t)b, -2, 2);
        tu_fill(v, n * EKV, 50 + (uint64_t)b, -2, 2);
        assert_int_equal(mha_kv_cache_create(&one, &alone[b]), MHA_OK);
        assert_int_equal(mha_kv_cache_append(alone[b], 0, k, v, n), MHA_OK);
        assert_int_equal(mha_kv_cache_append(paged, b, k, v, n), MHA_OK);
        assert_int_equal(mha_kv_cache_append(flat, b, k, v, n), MHA_OK);
    }
    tu_fill(q, T * E, 60, -1, 1);
    mha_attention_decode_args d = {0};
    d.batch = B, d.num_heads = H, d.head_dim = DH, d.q = q;
    d.q_start = q_start;
    for (int threads = 1; threads <= 3; threads++) {
        d.num_threads = threads;
        d.cache = paged, d.out = o1, d.lse = l1;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        mha_attention_decode_args p = d;   /* (the paged call's rows) */
        d.cache = flat, d.out = o2, d.lse = NULL;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        assert_memory_equal(o1, o2, (size_t)(T * E) * 4);
        assert_each_alone(&p, fresh, alone, o3, l3);
    }
    /* bf16 queries: each sequence's rows those of its own bf16 call */
    static uint16_t q16[138 * E], h1[138 * E], h3[138 * E];
    for (int64_t i = 0; i < T * E; i++)
        q16[i] = mha_bf16_from_float(q[i]);
    d.q = NULL, d.out = NULL, d.lse = NULL, d.cache = paged;
    d.dtype = MHA_DTYPE_BF16, d.q16 = q16, d.out16 = h1;
    assert_int_equal(mha_attention_decode(&d), MHA_OK);
    assert_each_alone(&d, fresh, alone, h3, NULL);

    /* misuse: each refused, naming what was wrong, out untouched */
    d.dtype = MHA_DTYPE_F32, d.q16 = NULL, d.out16 = NULL;
    d.q = q, d.out = o1;
    memset(o1, 0x5A, sizeof o1);
    d.q_len = 1;
    assert_fails(mha_attention_decode(&d), MHA_ERR_INVALID_ARGUMENT,
                 "q_len must be 0");
    d.q_len = 0;
    q_start[2] = q_start[1] - 1;
    assert_fails(mha_attention_decode(&d), MHA_ERR_INVALID_ARGUMENT,
                 "never decrease");
    q_start[2] = q_start[1] + fresh[1];
    q_start[0] = 1;
    assert_fails(mha_attention_decode(&d), MHA_ERR_INVALID_ARGUMENT,
                 "q_start[0]");
    q_start[0] = 0;
    d.key_lengths = held;
    assert_fails(mha_attention_decode(&d), MHA_ERR_UNSUPPORTED,
                 "key_lengths");
    d.key_lengths = NULL;
    d.out = q + E;
    assert_fails(mha_attention_decode(&d), MHA_ERR_INVALID_ARGUMENT,
                 "out overlaps q");
    d.out = o1;
    d.batch = 3;
    assert_fails(mha_attention_decode(&d), MHA_ERR_SHAPE, "batch 3");
    d.batch = B;
    mha_attention_plan *plan = NULL;
    assert_fails(mha_attention_plan_create_decode(&d, &plan),
                 MHA_ERR_UNSUPPORTED, "no plan");
    assert_null(plan);
    /* the last sequence's queries overflow the scores: refused, naming
     * it, after the others ran, and out still untouched */
    for (int64_t i = q_start[3] * E; i < T * E; i++)
        q[i] = 3e37f;
    assert_fails(mha_attention_decode(&d), MHA_ERR_INVALID_ARGUMENT,
                 "sequence 3 of the ragged step");
    for (size_t i = 0; i < sizeof o1; i++)
        assert_int_equal(((unsigned char *)o1)[i], 0x5A);
    for (int64_t b = 0; b < B; b++)
        mha_kv_cache_free(alone[b]);
    mha_kv_cache_free(paged);
    mha_kv_cache_free(flat);
}

/* Runs: a ragged step takes neighbouring sequences with as many new
 * tokens and keys split alike (under 1,024 keys: whole; 1,101 and 1,201
 * keys: 3 chunks of 512) in one batched call; each sequence's rows and
 * lse must still be bitwise those of a cache holding it alone, on 1, 2
 * and 3 threads, in f16 and q8, paged and contiguous, with RoPE,
 * softcap, ALiBi, the window modifier and sinks (each of which reads the
 * sequence's own length), chunks of 256 on the paged caches (acting:
 * the rows differ without them), pages of 64 and of 16 (a kernel's tile
 * then 4 pages), bf16 queries too, and where a run breaks:
 * 1,023 then 1,024 keys (whole, then split), a sequence with no new
 * token, another count. */
enum { RB = 13, RCAP = 1700 };
static void test_ragged_runs(void **state)
{
    (void)state;
    static const int64_t held[RB] = {100, 300, 37, 1100, 1200, 1600, 700,
                                     50, 200, 5, 1000, 1022, 1023},
                         fresh[RB] = {1, 1, 1, 1, 1, 1, 1, 0, 3, 3, 3, 1, 1};
    int64_t q_start[RB + 1] = {0};
    for (int64_t b = 0; b < RB; b++)
        q_start[b + 1] = q_start[b] + fresh[b];
    const int64_t T = q_start[RB];
    static float k[RCAP * EKV], v[RCAP * EKV], q[32 * E], o1[32 * E],
        o3[8 * E], l1[32 * H], l3[8 * H];
    static const float sinks[H] = {0.5f, -1.0f, 2.0f, 0.0f};
    int64_t qpos[32];
    tu_fill(q, T * E, 61, -1, 1);
    static const mha_kv_dtype dts[2] = {MHA_KV_F16, MHA_KV_Q8};
    static const int64_t pages[3] = {0, 64, 16};
    for (int cfg = 0; cfg < 6; cfg++) {
        mha_kv_cache_config cc = {0};
        cc.batch = RB, cc.num_kv_heads = HKV, cc.head_dim = DH;
        cc.capacity = RCAP, cc.dtype = dts[cfg & 1];
        cc.page_size = pages[cfg / 2];
        mha_kv_cache *kv = NULL, *alone[RB];
        assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
        mha_kv_cache_config one = cc;
        one.batch = 1;
        for (int64_t b = 0; b < RB; b++) {
            const int64_t n = held[b] + fresh[b];
            tu_fill(k, n * EKV, 140 + (uint64_t)b, -2, 2);
            tu_fill(v, n * EKV, 150 + (uint64_t)b, -2, 2);
            assert_int_equal(mha_kv_cache_create(&one, &alone[b]), MHA_OK);
            assert_int_equal(mha_kv_cache_append(alone[b], 0, k, v, n),
                             MHA_OK);
            assert_int_equal(mha_kv_cache_append(kv, b, k, v, n), MHA_OK);
            for (int64_t i = 0; i < fresh[b]; i++)   /* (their own ends) */
                qpos[q_start[b] + i] = held[b] + i + 3 * b;
        }
        mha_attention_decode_args d = {0};
        d.batch = RB, d.num_heads = H, d.head_dim = DH, d.q = q;
        d.q_start = q_start, d.cache = kv, d.out = o1, d.lse = l1;
        d.mods.softcap = 20.0f, d.mods.alibi = cfg & 1;
        d.mods.window = 1, d.mods.window_left = 900;
        d.mods.window_right = 0;
        d.mods.rope.style = MHA_ROPE_NEOX;
        d.sinks = sinks, d.q_positions = qpos;
        d.attention_chunk = cfg >= 2 ? 256 : 0;
        for (int threads = 1; threads <= 3; threads++) {
            d.num_threads = threads;
            memset(o1, 0, sizeof o1);
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
            assert_each_alone(&d, fresh, alone, o3, l3);
        }
        if (d.attention_chunk) {   /* the chunks act on the long rows */
            static float o_all[32 * E];
            mha_attention_decode_args u = d;
            u.attention_chunk = 0, u.out = o_all, u.lse = NULL;
            assert_int_equal(mha_attention_decode(&u), MHA_OK);
            assert_memory_not_equal(o1 + q_start[5] * E, o_all + q_start[5] * E,
                                    E * sizeof(float));
        }
        /* bf16 queries: each sequence's rows those of its own bf16 call */
        static uint16_t q16[32 * E], h1[32 * E], h3[8 * E];
        for (int64_t i = 0; i < T * E; i++)
            q16[i] = mha_bf16_from_float(q[i]);
        mha_attention_decode_args d16 = d;
        d16.q = NULL, d16.out = NULL, d16.lse = NULL;
        d16.dtype = MHA_DTYPE_BF16, d16.q16 = q16, d16.out16 = h1;
        assert_int_equal(mha_attention_decode(&d16), MHA_OK);
        assert_each_alone(&d16, fresh, alone, h3, NULL);
        /* a refused sequence inside a run is named, out untouched */
        const float keep = q[q_start[4] * E];
        q[q_start[4] * E] = 3e37f;
        memset(o1, 0x5A, sizeof o1);
        assert_fails(mha_attention_decode(&d), MHA_ERR_INVALID_ARGUMENT,
                     "sequence 4 of the ragged step");
        for (size_t i = 0; i < sizeof o1; i++)
            assert_int_equal(((unsigned char *)o1)[i], 0x5A);
        q[q_start[4] * E] = keep;
        for (int64_t b = 0; b < RB; b++)
            mha_kv_cache_free(alone[b]);
        mha_kv_cache_free(kv);
    }
}

/* Window caches (W = 100, a ring of 256 slots) paged (pages of 64, and
 * of 16) and contiguous, the same random operations: the paged one gives back the
 * pages whose positions all fell out of the window, and holds no more
 * than the window's pages per sequence once it has; its steps and reads
 * give the contiguous ring's bits.  A rollback the paged ring refuses
 * (its oldest position given back) is one the contiguous ring still
 * allows, never the reverse. */
static void window_pages(int64_t page)
{
    enum { W = 100, RING = 256 };
    /* fewer than 4 sequences' windows take (3 pages of 64, 8 of 16) */
    const int64_t pool = page == 64 ? 9 : 24;
    mha_kv_cache_config cc = {0};
    cc.batch = B, cc.num_kv_heads = HKV, cc.head_dim = DH;
    cc.capacity = RING, cc.window = W, cc.dtype = MHA_KV_BF16;
    mha_kv_cache *flat = NULL, *paged = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &flat), MHA_OK);
    cc.page_size = page, cc.num_pages = pool;
    assert_int_equal(mha_kv_cache_create(&cc, &paged), MHA_OK);
    rng_state = 11;
    static float k[128 * EKV], v[128 * EKV];
    int freed_some = 0, refused = 0;
    for (int op = 0; op < 3000; op++) {
        const int64_t b = below(B), len = mha_kv_cache_length(flat, b);
        const int what = (int)below(20);
        if (what < 10) {   /* n + W - 1 <= RING: a step of n may attend */
            const int64_t n = 1 + below(below(4) ? 3 : 100);
            tu_fill(k, n * EKV, rnd(), -2, 2);
            tu_fill(v, n * EKV, rnd(), -2, 2);
            const mha_status st = mha_kv_cache_append(paged, b, k, v, n);
            if (st == MHA_ERR_OUT_OF_MEMORY) {
                refused++;
            } else {
                assert_int_equal(st, MHA_OK);
                assert_int_equal(mha_kv_cache_append(flat, b, k, v, n),
                                 MHA_OK);
            }
        } else if (what < 12) {
            const int64_t to = len ? len - below(len < 40 ? len + 1 : 40)
                                   : 0;
            /* what the paged ring allows, the contiguous one does */
            if (mha_kv_cache_truncate(paged, b, to) == MHA_OK)
                assert_int_equal(mha_kv_cache_truncate(flat, b, to), MHA_OK);
            else
                assert_non_null(strstr(mha_last_error(), "oldest"));
        } else if (what < 13) {
            assert_int_equal(mha_kv_cache_reset(paged, b), MHA_OK);
            assert_int_equal(mha_kv_cache_reset(flat, b), MHA_OK);
        } else if (what < 15) {
            const int64_t to = (b + 1 + below(B - 1)) % B;
            assert_int_equal(mha_kv_cache_fork(paged, b, to), MHA_OK);
            assert_int_equal(mha_kv_cache_fork(flat, b, to), MHA_OK);
        } else if (what < 17) {   /* what both still hold */
            static float k1[RING * EKV], v1[RING * EKV], k2[RING * EKV],
                v2[RING * EKV];
            const int64_t from = len > W ? len - W : 0;
            assert_int_equal(mha_kv_cache_read(paged, b, from, len - from,
                                               k1, v1), MHA_OK);
            assert_int_equal(mha_kv_cache_read(flat, b, from, len - from, k2,
                                               v2), MHA_OK);
            assert_memory_equal(k1, k2, (size_t)((len - from) * EKV) * 4);
            assert_memory_equal(v1, v2, (size_t)((len - from) * EKV) * 4);
        } else {
            same_step(paged, flat, 1 + (int)below(3));
        }
        assert_true(mha_kv_pages_consistent(paged));
        mha_kv_cache_usage u;
        assert_int_equal(mha_kv_cache_get_usage(paged, &u), MHA_OK);
        assert_int_equal(u.pages_used + u.pages_free, pool);
        freed_some |= u.pages_used < u.tokens / page;
        for (int64_t s = 0; s < B; s++)
            assert_int_equal(mha_kv_cache_length(paged, s),
                             mha_kv_cache_length(flat, s));
    }
    print_message("window pages of %lld: %d appends refused (pool full), "
                  "pages given back: %s\n", (long long)page, refused,
                  freed_some ? "yes" : "no");
    assert_true(refused > 0 && freed_some);   /* both exercised */
    /* one long sequence alone: the pages W positions can straddle, and
     * the one being written */
    assert_int_equal(mha_kv_cache_reset(paged, -1), MHA_OK);
    for (int t = 0; t < 1000; t++) {
        tu_fill(k, EKV, (uint64_t)t, -2, 2);
        assert_int_equal(mha_kv_cache_append(paged, 0, k, k, 1), MHA_OK);
        mha_kv_cache_usage u;
        assert_int_equal(mha_kv_cache_get_usage(paged, &u), MHA_OK);
        assert_true(u.pages_used <= (W + page - 1) / page + 1);
    }
    cc.capacity = 300;   /* not whole pages */
    mha_kv_cache *bad = NULL;
    assert_fails(mha_kv_cache_create(&cc, &bad), MHA_ERR_INVALID_ARGUMENT,
                 "whole pages");
    mha_kv_cache_free(flat);
    mha_kv_cache_free(paged);
}

static void test_window_pages(void **state)
{
    (void)state;
    window_pages(64);
    window_pages(16);
}

/* share_prefix: four forks of a 300-token prompt (a fifth sequence, the
 * first, its own), each with its own tokens and a step of 1 or 5: the cascade's rows
 * against float64 softmax over the keys each sequence holds, within the
 * bound of test_step_vs_float64 (the merge of two parts adds a few
 * roundings of each row); the same bits on 1, 2 and 3 threads; refused
 * with ALiBi, the window, sinks or chunks; in f32 and f16 pages. */
static void shared_prefix(int64_t page, mha_kv_dtype dt)
{
    enum { NB = 5, P = 300 };
    mha_kv_cache_config cc = {0};
    cc.dtype = dt;
    /* (a capacity of 5 pages: the last sequence's own part ends in its
     * table's last page, where a read of the next page's entry would run
     * past the table: ASan's to see) */
    cc.batch = NB, cc.num_kv_heads = HKV, cc.head_dim = DH, cc.capacity = 320;
    cc.page_size = page;
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
    static float k[600 * EKV], v[600 * EKV], q[NB * 5 * E], o1[NB * 5 * E],
        o2[NB * 5 * E], l1[NB * 5 * H];
    tu_fill(k, P * EKV, 70, -2, 2);
    tu_fill(v, P * EKV, 71, -2, 2);
    assert_int_equal(mha_kv_cache_append(kv, 1, k, v, P), MHA_OK);
    for (int64_t b = 2; b < NB; b++)   /* (the last slot a fork: its own */
        assert_int_equal(mha_kv_cache_fork(kv, 1, b), MHA_OK);   /* end) */
    static const int64_t own[NB] = {150, 1, 14, 5, 10}, fresh[NB] = {1, 5, 1,
                                                                     5, 1};
    int64_t q_start[NB + 1] = {0};
    for (int64_t b = 0; b < NB; b++) {
        tu_fill(k, (own[b] + fresh[b]) * EKV, 80 + (uint64_t)b, -2, 2);
        tu_fill(v, (own[b] + fresh[b]) * EKV, 90 + (uint64_t)b, -2, 2);
        assert_int_equal(mha_kv_cache_append(kv, b, k, v, own[b] + fresh[b]),
                         MHA_OK);
        q_start[b + 1] = q_start[b] + fresh[b];
    }
    tu_fill(q, q_start[NB] * E, 99, -1, 1);
    mha_attention_decode_args d = {0};
    d.batch = NB, d.num_heads = H, d.head_dim = DH, d.q = q;
    d.cache = kv, d.q_start = q_start, d.share_prefix = 1;
    d.out = o1, d.lse = l1;
    assert_int_equal(mha_attention_decode(&d), MHA_OK);
    for (int threads = 1; threads <= 3; threads++) {
        d.num_threads = threads, d.out = o2, d.lse = NULL;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        assert_memory_equal(o1, o2, (size_t)(q_start[NB] * E) * 4);
    }
    double worst = 0.0, worst_lse = 0.0;
    static float ks[600 * EKV], vs[600 * EKV];
    for (int64_t b = 0; b < NB; b++) {
        const int64_t n = mha_kv_cache_length(kv, b);
        assert_int_equal(mha_kv_cache_read(kv, b, 0, n, ks, vs), MHA_OK);
        for (int64_t i = 0; i < fresh[b]; i++) {
            const int64_t row = q_start[b] + i, sees = n - fresh[b] + i + 1;
            for (int64_t h = 0; h < H; h++) {
                double r[DH];
                const double lse =
                    f64_head(q + row * E + h * DH, h, ks, vs, sees, r);
                const double el =
                    fabs(l1[q_start[b] * H + h * fresh[b] + i] - lse);
                worst_lse = el > worst_lse ? el : worst_lse;
                for (int64_t e = 0; e < DH; e++) {
                    const double err = fabs(o1[row * E + h * DH + e] - r[e]);
                    worst = err > worst ? err : worst;
                }
            }
        }
    }
    print_message("shared prefix (cascade), %s pages of %lld, vs float64: "
                  "worst error %.3g, lse %.3g\n", dt ? "f16" : "f32",
                  (long long)page, worst, worst_lse);
    assert_true(worst < 3 * 600 * 2 * 0x1p-24);
    assert_true(worst_lse < 1e-5);   /* |lse| < 20: float32's ulp ~2e-6 */
    /* what the stacked shared part cannot say, refused by name with out
     * untouched: ALiBi, the window, sinks and chunks (each a function of
     * a query's position or its own softmax) */
    memcpy(o2, o1, sizeof o2);
    d.out = o2;
    d.mods.alibi = 1;
    assert_fails(mha_attention_decode(&d), MHA_ERR_UNSUPPORTED, "ALiBi");
    d.mods.alibi = 0, d.mods.window = 1, d.mods.window_left = 8;
    assert_fails(mha_attention_decode(&d), MHA_ERR_UNSUPPORTED, "the window");
    d.mods.window = 0, d.mods.window_left = 0;
    static const float sinks[H] = {0.5f, -1, 0, 2};
    d.sinks = sinks;
    assert_fails(mha_attention_decode(&d), MHA_ERR_UNSUPPORTED, "sinks");
    d.sinks = NULL, d.attention_chunk = 64;
    assert_fails(mha_attention_decode(&d), MHA_ERR_UNSUPPORTED,
                 "attention_chunk");
    assert_memory_equal(o1, o2, sizeof o2);
    mha_kv_cache_free(kv);
}

/* (pages of 16: the shared part ends at position 288, so each sequence's
 * own part begins inside a kernel's tile of the whole sequence) */
static void test_shared_prefix(void **state)
{
    (void)state;
    shared_prefix(64, MHA_KV_F32);
    shared_prefix(16, MHA_KV_F32);
    shared_prefix(64, MHA_KV_F16);   /* (the values read back: the bound's) */
    shared_prefix(16, MHA_KV_F16);
}

static void test_misuse(void **state)
{
    (void)state;
    mha_kv_cache_config cc = {0};
    cc.batch = 2, cc.num_kv_heads = 1, cc.head_dim = 8, cc.capacity = 100;
    mha_kv_cache *kv = NULL;
    cc.page_size = 100;
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "page_size 100");
    assert_null(kv);
    cc.page_size = -64;
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "page_size");
    cc.page_size = 8;   /* below a page of 16 */
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "page_size 8: expected 0 (contiguous), 16, 32");
    cc.page_size = 48;   /* neither a divisor nor a multiple of a tile */
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "page_size 48");
    cc.page_size = 64, cc.window = 10;   /* a ring of 100: not whole pages */
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "whole pages");
    cc.window = 0, cc.page_size = 0, cc.num_pages = 4;
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "num_pages 4 without a page_size");
    cc.page_size = 64, cc.num_pages = INT64_C(1) << 40;
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "num_pages");
    cc.num_pages = -1;
    assert_fails(mha_kv_cache_create(&cc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "num_pages");
    cc.num_pages = 0;   /* the default: every sequence at its capacity */
    assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
    mha_kv_cache_usage u;
    assert_int_equal(mha_kv_cache_get_usage(kv, &u), MHA_OK);
    assert_int_equal(u.pages_free, 2 * 2);   /* 2 x ceil(100 / 64) */
    assert_fails(mha_kv_cache_fork(kv, 1, 1), MHA_ERR_INVALID_ARGUMENT,
                 "onto itself");
    assert_fails(mha_kv_cache_fork(kv, 0, 2), MHA_ERR_INVALID_ARGUMENT,
                 "sequence 2");
    assert_fails(mha_kv_cache_fork(kv, -1, 0), MHA_ERR_INVALID_ARGUMENT,
                 "sequence -1");
    assert_fails(mha_kv_cache_fork(NULL, 0, 1), MHA_ERR_NULL_POINTER,
                 "cache");
    assert_fails(mha_kv_cache_get_usage(kv, NULL), MHA_ERR_NULL_POINTER,
                 "usage");
    assert_fails(mha_kv_cache_get_usage(NULL, &u), MHA_ERR_NULL_POINTER,
                 "cache");
    assert_fails(mha_kv_cache_get_usage_sized(kv, &u, 0),
                 MHA_ERR_INVALID_ARGUMENT, "mha_kv_cache_usage");
    /* past the capacity: refused as in a contiguous cache */
    static float k[101 * 8], v[101 * 8];
    assert_fails(mha_kv_cache_append(kv, 0, k, v, 101),
                 MHA_ERR_INVALID_ARGUMENT, "capacity");
    assert_true(mha_kv_pages_consistent(kv));
    mha_kv_cache_free(kv);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_programs),
        cmocka_unit_test(test_placement),
        cmocka_unit_test(test_step_vs_float64),
        cmocka_unit_test(test_module_forward),
        cmocka_unit_test(test_memory_ragged),
        cmocka_unit_test(test_ragged_step),
        cmocka_unit_test(test_ragged_runs),
        cmocka_unit_test(test_shared_prefix),
        cmocka_unit_test(test_window_pages),
        cmocka_unit_test(test_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
