/*
 * test_red_team.c -- the library-side findings of issue 38's red team,
 * one test each, every one a case that once gave a silent wrong result:
 *
 *   1  window bounds and q_offset near INT64_MAX overflowed the position
 *      arithmetic and masked every key (or gave ALiBi an lse of 5.8e17);
 *   7  a scale whose scaled scores overflow float32 gave NaN where the
 *      float64 reference is finite: refused, naming the scale;
 *   6  an f16 cache stored a finite value past 65504 as Inf (NaN rows,
 *      no word): refused, naming the value;
 *   8  the reference tier gave lse -inf for a row of NaN scores (the
 *      others NaN), so the merge dropped it: NaN in, NaN out everywhere;
 *   9  a q8 block whose max is FLT_MAX read back as Inf;
 *   (a) a masked-out Inf value in an untruncated cache (the mutation of
 *      tests/mutations.tsv that once survived: a tile's finite flag set
 *      to its last column's alone).
 *
 * Results are compared with float64 definitions written here from
 * include/mha.h (attend_f64, for mha_attention) or with the suite's
 * reference of the module (tests/support/ref.c).  Every tier runs it
 * (CTest, MHA_ISA).
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

#include "assert_error.h"
#include "ref.h"
#include "testutil.h"

/* ---- mha_attention's definition, in float64 ----------------------------- */

/* out (B, Lq, H dh) and lse (B, H, Lq) of mha_attention's arguments `a`
 * (no masks, GQA, sinks or RoPE; causal, window, ALiBi, softcap, q_offset,
 * key_lengths).  Positions in 128-bit integers, so that bounds near
 * INT64_MAX are compared exactly; scores in float64, where a float32
 * scale times a float32 product cannot overflow. */
static void attend_f64(const mha_attention_args *a, double *out, double *lse)
{
    const int64_t B = a->batch, H = a->num_heads, dh = a->head_dim;
    const int64_t Lq = a->q_len, Lk = a->kv_len ? a->kv_len : Lq;
    const double scale = (a->given & MHA_GIVEN_SCALE) || a->scale != 0.0f
                             ? (double)a->scale : 1.0 / sqrt((double)dh);
    const __int128 q0 = (a->given & MHA_GIVEN_Q_OFFSET)
                            ? (__int128)a->q_offset : (__int128)(Lk - Lq);
    float slopes[64];
    if (a->mods.alibi)
        mha_alibi_slopes(H, slopes);
    double *s = malloc((size_t)Lk * sizeof *s);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Lq; i++) {
                const __int128 qpos = q0 + i;
                const float *q = a->q + (b * Lq + i) * H * dh + h * dh;
                double mx = -INFINITY;
                int live = 0, nan = 0;
                for (int64_t j = 0; j < Lk; j++) {
                    int vis = 1;
                    if (a->causal == MHA_CAUSAL_BOTTOM_RIGHT && j > qpos)
                        vis = 0;
                    if (a->causal == MHA_CAUSAL_TOP_LEFT && j > i)
                        vis = 0;
                    if (a->key_lengths && j >= a->key_lengths[b])
                        vis = 0;
                    if (a->mods.window && a->mods.window_left >= 0 &&
                        qpos - j > a->mods.window_left)
                        vis = 0;
                    if (a->mods.window && a->mods.window_right >= 0 &&
                        j - qpos > a->mods.window_right)
                        vis = 0;
                    s[j] = -INFINITY;
                    if (!vis)
                        continue;
                    const float *k = a->k + (b * Lk + j) * H * dh + h * dh;
                    double dot = 0;
                    for (int64_t d = 0; d < dh; d++)
                        dot += (double)q[d] * (double)k[d];
                    double x = dot * scale;
                    if (a->mods.softcap > 0)
                        x = a->mods.softcap * tanh(x / a->mods.softcap);
                    if (a->mods.alibi) {
                        const __int128 dist = qpos > j ? qpos - j : j - qpos;
                        x -= (double)slopes[h] * (double)dist;
                    }
                    s[j] = x;
                    nan |= isnan(x);
                    mx = x > mx ? x : mx;
                    live = 1;
                }
                double *o = out + (b * Lq + i) * H * dh + h * dh;
                double *l = lse + (b * H + h) * Lq + i;
                for (int64_t d = 0; d < dh; d++)
                    o[d] = nan ? NAN : 0.0;
                if (nan || !live) {
                    *l = nan ? NAN : -INFINITY;
                    continue;
                }
                double sum = 0;
                for (int64_t j = 0; j < Lk; j++)
                    sum += s[j] == -INFINITY ? 0.0 : exp(s[j] - mx);
                for (int64_t j = 0; j < Lk; j++) {
                    if (s[j] == -INFINITY)
                        continue;
                    const double p = exp(s[j] - mx) / sum;
                    const float *v = a->v + (b * Lk + j) * H * dh + h * dh;
                    for (int64_t d = 0; d < dh; d++)
                        o[d] += p * (double)v[d];
                }
                *l = mx + log(sum);
            }
    free(s);
}

/* max |x - ref| / (1 + |ref|) over n; NaN against a finite ref is +inf. */
static double rel_err(const float *x, const double *ref, int64_t n)
{
    double e = 0;
    for (int64_t k = 0; k < n; k++) {
        if (isnan(ref[k]) && isnan(x[k]))
            continue;
        if (isinf(ref[k]) && x[k] == ref[k])
            continue;
        const double d = fabs((double)x[k] - ref[k]) / (1.0 + fabs(ref[k]));
        e = d > e || isnan(d) ? (isnan(d) ? INFINITY : d) : e;
    }
    return e;
}

/* A problem of mha_attention on random q, k, v in [-1, 1). */
enum { AB = 1, AH = 2, ADH = 8, ALQ = 5, ALK = 7 };
typedef struct aprob {
    float q[AB * ALQ * AH * ADH], k[AB * ALK * AH * ADH];
    float v[AB * ALK * AH * ADH], out[AB * ALQ * AH * ADH];
    float lse[AB * AH * ALQ];
    double ro[AB * ALQ * AH * ADH], rl[AB * AH * ALQ];
    mha_attention_args a;
} aprob;

static void aprob_make(aprob *p, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    tu_fill(p->q, AB * ALQ * AH * ADH, seed, -1, 1);
    tu_fill(p->k, AB * ALK * AH * ADH, seed + 1, -1, 1);
    tu_fill(p->v, AB * ALK * AH * ADH, seed + 2, -1, 1);
    mha_attention_args *a = &p->a;
    a->batch = AB;
    a->num_heads = AH;
    a->head_dim = ADH;
    a->q_len = ALQ;
    a->kv_len = ALK;
    a->q = p->q;
    a->k = p->k;
    a->v = p->v;
    a->out = p->out;
    a->lse = p->lse;
}

/* Runs p's problem and checks out and lse against attend_f64.  1e-5
 * relative: scores of at most a few units, rounded once in float32 per
 * product and sum of 8 terms, are far inside it. */
static void aprob_check(aprob *p)
{
    assert_int_equal(mha_attention(&p->a), MHA_OK);
    attend_f64(&p->a, p->ro, p->rl);
    const double eo = rel_err(p->out, p->ro, AB * ALQ * AH * ADH);
    const double el = rel_err(p->lse, p->rl, AB * AH * ALQ);
    if (!(eo <= 1e-5) || !(el <= 1e-5))
        fail_msg("out error %g, lse error %g against float64 (out[0] %g vs "
                 "%g, lse[0] %g vs %g)", eo, el, (double)p->out[0], p->ro[0],
                 (double)p->lse[0], p->rl[0]);
}

/* ---- finding 1: position arithmetic never overflows ---------------------- */

/* A module of E 16, 4 heads with the window (left, right), its forward on
 * 6 tokens (self-attention, causal or not, through an empty KV cache or
 * not) against the reference. */
static void window_module_case(int64_t left, int64_t right, mha_causal causal,
                               int through_cache)
{
    enum { E = 16, L = 6 };
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = 4;
    c.mods.window = 1;
    c.mods.window_left = left;
    c.mods.window_right = right;
    mha_module *m = tu_module(&c, 7);
    assert_non_null(m);
    float x[L * E], y[L * E], y32[L * E];
    double ref[L * E];
    tu_fill(x, L * E, 8, -1, 1);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.out = y;
    a.causal = causal;
    mha_kv_cache *kv = NULL;
    if (through_cache) {
        assert_int_equal(mha_kv_cache_for_module(m, 1, L, &kv), MHA_OK);
        a.cache = kv;
    }
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    a.cache = NULL;
    assert_int_equal(ref_forward_f64(m, &a, ref, NULL), 0);
    assert_int_equal(ref_forward_f32(m, &a, y32, NULL), 0);
    const double tol = ref_tolerance(ref_max_err_f32(y32, ref, L * E),
                                     ref_max_abs(ref, L * E));
    const double err = ref_max_err_f32(y, ref, L * E);
    if (!(err <= tol))
        fail_msg("window (%lld, %lld)%s: error %g > tolerance %g",
                 (long long)left, (long long)right,
                 through_cache ? " through a cache" : "", err, tol);
    mha_kv_cache_free(kv);
    mha_free(m);
}

static void test_window_bounds_near_int64_max(void **state)
{
    (void)state;
    /* `mha forward --window 0,9223372036854775807` masked every key. */
    window_module_case(0, INT64_MAX, MHA_CAUSAL_NONE, 0);
    window_module_case(INT64_MAX, INT64_MAX, MHA_CAUSAL_NONE, 0);
    window_module_case(INT64_MAX - 1, 2, MHA_CAUSAL_NONE, 0);
    /* and decoding (a cache prefilled, causal) */
    window_module_case(INT64_MAX, INT64_MAX, MHA_CAUSAL_BOTTOM_RIGHT, 1);
    window_module_case(2, INT64_MAX, MHA_CAUSAL_BOTTOM_RIGHT, 1);
}

static void test_q_offset_near_int64_limits(void **state)
{
    (void)state;
    aprob p;
    /* Positions beyond 2^61 are refused: no overflow, a clear error. */
    aprob_make(&p, 1);
    p.a.given = MHA_GIVEN_Q_OFFSET;
    p.a.q_offset = INT64_MAX;
    p.a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT, "q_offset");
    p.a.causal = MHA_CAUSAL_NONE;
    p.a.mods.alibi = 1;
    p.a.q_offset = INT64_MIN + 2;
    assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT, "q_offset");
    /* At the limit, every key is visible to a causal row and the window
     * (0, INT64_MAX) leaves them all: the plain softmax. */
    aprob_make(&p, 2);
    p.a.given = MHA_GIVEN_Q_OFFSET;
    p.a.q_offset = INT64_C(1) << 61;
    p.a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    aprob_check(&p);
    p.a.q_offset = -(INT64_C(1) << 61);
    p.a.causal = MHA_CAUSAL_NONE;
    p.a.mods.window = 1;
    p.a.mods.window_left = INT64_MAX;
    p.a.mods.window_right = INT64_MAX;
    aprob_check(&p);
    /* ALiBi with the queries before the keys (distances of ~100, exact in
     * float32 as in float64). */
    p.a.mods.window = 0;
    p.a.mods.window_left = p.a.mods.window_right = 0;
    p.a.q_offset = -100;
    p.a.mods.alibi = 1;
    aprob_check(&p);
}

/* A slice of the query rows of a problem of q_total rows near INT64_MAX:
 * its rows' positions (q_start + i + Lk - q_total) would overflow with
 * ALiBi's distance or a window's bound; refused. */
static void test_q_total_near_int64_max(void **state)
{
    (void)state;
    enum { E = 16, L = 4 };
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = 4;
    c.mods.alibi = 1;
    c.mods.window = 1;
    c.mods.window_left = 3;
    c.mods.window_right = 3;
    mha_module *m = tu_module(&c, 9);
    assert_non_null(m);
    float x[L * E], y[L * E];
    tu_fill(x, L * E, 10, -1, 1);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.kv_len = L;
    a.query = x;
    a.key = x;
    a.out = y;
    a.q_total = INT64_MAX;
    a.q_start = 0;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "q_total");
    mha_free(m);
}

/* ---- finding 7: scaled scores never overflow to NaN ----------------------- */

/* A scale whose scores overflow float32 is refused, naming the scale; the
 * float64 reference of such a call is finite, so NaN would be wrong. */
static void test_scale_overflow(void **state)
{
    (void)state;
    aprob p;
    aprob_make(&p, 3);
    p.a.given = MHA_GIVEN_SCALE;
    p.a.scale = FLT_MAX;
    attend_f64(&p.a, p.ro, p.rl);
    assert_true(isfinite(p.ro[0]));   /* what a NaN would contradict */
    assert_fails(mha_attention(&p.a), MHA_ERR_INVALID_ARGUMENT, "scale");
    /* A large scale whose scores stay finite (|s| <= 1e4 * 8) runs, and
     * agrees with float64 (the softmax is then nearly one-hot). */
    p.a.scale = 1e4f;
    aprob_check(&p);

    /* The module: a file's scale of 3e38, with and without a cache. */
    enum { E = 16, L = 4 };
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = 2;
    c.scale = 3e38f;
    mha_module *m = tu_module(&c, 12);
    assert_non_null(m);
    float x[L * E], y[L * E];
    tu_fill(x, L * E, 13, -1, 1);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.out = y;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "scale");
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_for_module(m, 1, L, &kv), MHA_OK);
    a.cache = kv;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "scale");
    /* a refused step appends nothing */
    assert_int_equal(mha_kv_cache_length(kv, 0), 0);
    mha_kv_cache_free(kv);
    mha_free(m);
}

/* The same refusal on decoding steps whose keys are read in place (one
 * query row per head, the tiers' `amax` scan): for 100 keys (one block
 * per head) and 1,100 (the split in chunks of 512), on one thread and two,
 * a key of 3e38 is refused naming the scale, also where no row attends to
 * it (past key_lengths: the refusal is about the keys given), and out and
 * lse keep every bit they held; the same call with the key put back runs
 * and agrees with float64 (1e-5: float32 sums of at most 1,100 terms of
 * size <= 1, as aprob_check). */
static void test_scale_overflow_decoding(void **state)
{
    (void)state;
    enum { B = 2, H = 4, D = 16 };
    static const int64_t lks[] = {100, 1100};
    for (int li = 0; li < 2; li++)
        for (int threads = 1; threads <= 2; threads++) {
            const int64_t Lk = lks[li], nkv = B * Lk * H * D;
            float *q = malloc(B * H * D * sizeof *q);
            float *k = malloc((size_t)nkv * sizeof *k);
            float *v = malloc((size_t)nkv * sizeof *v);
            float out[B * H * D], lse[B * H];
            double ro[B * H * D], rl[B * H];
            assert_non_null(q);
            assert_non_null(k);
            assert_non_null(v);
            tu_fill(q, B * H * D, 31, -1, 1);
            tu_fill(k, nkv, 32, -1, 1);
            tu_fill(v, nkv, 33, -1, 1);
            const int64_t lengths[B] = {Lk, Lk - 5};
            mha_attention_args a = {0};
            a.batch = B;
            a.num_heads = H;
            a.head_dim = D;
            a.q_len = 1;
            a.kv_len = Lk;
            a.q = q;
            a.k = k;
            a.v = v;
            a.out = out;
            a.lse = lse;
            a.num_threads = threads;
            /* batch 1's last key, head 2, element 3 */
            float *big = k + ((1 * Lk + Lk - 1) * H + 2) * D + 3;
            const float keep = *big;
            *big = 3e38f;
            for (int masked = 0; masked <= 1; masked++) {
                a.key_lengths = masked ? lengths : NULL;
                for (int i = 0; i < B * H * D; i++)
                    out[i] = 7.0f;
                for (int i = 0; i < B * H; i++)
                    lse[i] = 5.0f;
                assert_fails(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT,
                             "scale");
                for (int i = 0; i < B * H * D; i++)
                    assert_true(out[i] == 7.0f);
                for (int i = 0; i < B * H; i++)
                    assert_true(lse[i] == 5.0f);
            }
            *big = keep;
            assert_int_equal(mha_attention(&a), MHA_OK);
            attend_f64(&a, ro, rl);
            const double eo = rel_err(out, ro, B * H * D);
            const double el = rel_err(lse, rl, B * H);
            if (!(eo <= 1e-5) || !(el <= 1e-5))
                fail_msg("Lk %lld, %d threads: out error %g, lse error %g "
                         "against float64", (long long)Lk, threads, eo, el);
            free(q);
            free(k);
            free(v);
        }
}

/* ---- finding 6: an f16 cache never turns a finite value into Inf ---------- */

/* Appending a finite key or value that f16 cannot hold (|x| >= 65520
 * rounds to Inf) is refused, naming the value, and changes nothing; the
 * largest f16, 65504, is kept exactly. */
static void test_f16_cache_overflow(void **state)
{
    (void)state;
    enum { HK = 2, D = 4, EK = HK * D };
    const mha_kv_cache_config kc = {1, HK, D, 8, MHA_KV_F16, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float k[2 * EK], v[2 * EK], rk[2 * EK], rv[2 * EK];
    tu_fill(k, 2 * EK, 20, -1, 1);
    tu_fill(v, 2 * EK, 21, -1, 1);
    k[EK + 5] = 1e5f;
    assert_fails(mha_kv_cache_append(kv, 0, k, v, 2),
                 MHA_ERR_INVALID_ARGUMENT, "100000");
    assert_int_equal(mha_kv_cache_length(kv, 0), 0);
    k[EK + 5] = 0.5f;
    v[3] = -7e4f;
    assert_fails(mha_kv_cache_append(kv, 0, k, v, 2),
                 MHA_ERR_INVALID_ARGUMENT, "f16");
    assert_int_equal(mha_kv_cache_length(kv, 0), 0);
    v[3] = -65504.0f;
    k[0] = 65519.0f;   /* rounds to 65504, not Inf: kept */
    assert_int_equal(mha_kv_cache_append(kv, 0, k, v, 2), MHA_OK);
    assert_int_equal(mha_kv_cache_read(kv, 0, 0, 2, rk, rv), MHA_OK);
    assert_true(rv[3] == -65504.0f && rk[0] == 65504.0f);
    mha_kv_cache_free(kv);

    /* A module decoding into an f16 cache: keys projected past f16's
     * range are refused before the step appends anything. */
    enum { E = 16, L = 3 };
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = 2;
    mha_module *m = tu_module(&c, 22);
    assert_non_null(m);
    const mha_kv_cache_config mc = {1, 2, 8, L, MHA_KV_F16, 0, 0, 0, 0, 0, 0};
    assert_int_equal(mha_kv_cache_create(&mc, &kv), MHA_OK);
    float x[L * E], y[L * E];
    tu_fill(x, L * E, 23, -1e6f, 1e6f);
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.out = y;
    a.cache = kv;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_fails(mha_forward(m, &a), MHA_ERR_INVALID_ARGUMENT, "f16");
    assert_int_equal(mha_kv_cache_length(kv, 0), 0);
    mha_kv_cache_free(kv);
    mha_free(m);
}

/* ---- finding 8: NaN in, NaN out, in every tier ---------------------------- */

/* A row whose scores are all NaN (its query is NaN) has a NaN output and
 * a NaN lse in every tier: an lse of -inf (the reference tier's) reads as
 * "no key" and mha_attention_merge would drop the part silently. */
static void test_all_nan_row(void **state)
{
    (void)state;
    aprob p;
    aprob_make(&p, 4);
    for (int d = 0; d < ADH; d++)
        p.q[2 * AH * ADH + d] = NAN;   /* row 2, head 0 */
    aprob_check(&p);                   /* NaN where float64 has NaN */
    assert_true(isnan(p.lse[0 * ALQ + 2]));
    assert_true(isnan(p.out[2 * AH * ADH]));
    assert_true(isfinite(p.lse[1 * ALQ + 2]));   /* head 1 is untouched */
    /* The merge of that part with a finite one is NaN, not the other. */
    aprob q;
    aprob_make(&q, 5);
    assert_int_equal(mha_attention(&q.a), MHA_OK);
    float mo[AB * ALQ * AH * ADH], ml[AB * AH * ALQ];
    const mha_attention_part parts[2] = {{p.out, p.lse}, {q.out, q.lse}};
    assert_int_equal(mha_attention_merge(parts, 2, AB, AH, ADH, ALQ, mo, ml),
                     MHA_OK);
    assert_true(isnan(ml[2]) && isnan(mo[2 * AH * ADH]));
}

/* ---- finding 9: a q8 block at FLT_MAX reads back finite ------------------- */

/* Each element of a q8 block reads back within max|x| / 254 of what was
 * stored (docs/semantics.md), FLT_MAX and -FLT_MAX included: 127 times
 * the rounded scale FLT_MAX / 127 once rounded up to Inf. */
static void test_q8_flt_max(void **state)
{
    (void)state;
    enum { HK = 1, D = 32 };
    const mha_kv_cache_config kc = {1, HK, D, 2, MHA_KV_Q8, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    const mha_status st = mha_kv_cache_create(&kc, &kv);
    if (st == MHA_ERR_UNSUPPORTED) {
        mha_kv_cache_free(kv);
        return;   /* (a build without q8 has nothing to check) */
    }
    assert_int_equal(st, MHA_OK);
    float k[2 * D], v[2 * D], rk[2 * D], rv[2 * D];
    tu_fill(k, 2 * D, 30, -1, 1);
    tu_fill(v, 2 * D, 31, -1, 1);
    k[0] = FLT_MAX;
    v[D + 7] = -FLT_MAX;
    k[D + 3] = -FLT_MAX;
    k[D + 4] = FLT_MAX;
    assert_int_equal(mha_kv_cache_append(kv, 0, k, v, 2), MHA_OK);
    assert_int_equal(mha_kv_cache_read(kv, 0, 0, 2, rk, rv), MHA_OK);
    for (int t = 0; t < 2; t++) {
        const float *x[2] = {k + t * D, v + t * D};
        const float *r[2] = {rk + t * D, rv + t * D};
        for (int w = 0; w < 2; w++) {
            double amax = 0;
            for (int d = 0; d < D; d++)
                amax = fmax(amax, fabs((double)x[w][d]));
            for (int d = 0; d < D; d++)
                if (!isfinite(r[w][d]) ||
                    fabs((double)r[w][d] - (double)x[w][d]) > amax / 254)
                    fail_msg("token %d %s[%d]: %g stored, %g read back "
                             "(bound %g)", t, w ? "v" : "k", d,
                             (double)x[w][d], (double)r[w][d], amax / 254);
        }
    }
    mha_kv_cache_free(kv);
}

/* ---- (a): a masked-out Inf value in an untruncated cache ----------------- */

/* An Inf value at key 2 of a cache tile, finite keys after it in the same
 * tile, and a decoding step whose key padding mask excludes key 2: the
 * tile's all-finite flag must stay down (the flag of every column so
 * far, not the last one's), so that the exact pv skips the weight-0 key
 * rather than computing 0 * Inf = NaN.  The result is the float64
 * attention over the other keys. */
static void test_masked_inf_in_cache(void **state)
{
    (void)state;
    const mha_kv_dtype dtypes[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16};
    for (int t = 0; t < 3; t++) {
        const mha_kv_cache_config kc = {AB, AH, ADH, ALK, dtypes[t], 0, 0, 0, 0, 0, 0};
        mha_kv_cache *kv = NULL;
        assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
        aprob p;
        aprob_make(&p, 40 + (uint64_t)t);
        const int64_t J = 2, E = AH * ADH;
        p.v[J * E + 3] = INFINITY;
        p.v[J * E + E - 1] = -INFINITY;   /* both heads */
        for (int64_t j = 0; j < ALK; j++)   /* one token at a time */
            assert_int_equal(mha_kv_cache_append(kv, 0, p.k + j * E,
                                                 p.v + j * E, 1), MHA_OK);
        /* what the cache holds (f16, bf16: rounded), the reference's keys */
        float hk[ALK * AH * ADH], hv[ALK * AH * ADH];
        assert_int_equal(mha_kv_cache_read(kv, 0, 0, ALK, hk, hv), MHA_OK);
        uint8_t pad[ALK] = {0};
        pad[J] = 1;
        mha_attention_args a = p.a;
        a.q_len = 1;
        a.kv_len = 0;
        a.k = a.v = NULL;
        a.cache = kv;
        a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 1, {ALK}};
        assert_int_equal(mha_attention(&a), MHA_OK);
        /* the reference: the same query over the keys but J */
        float rk[(ALK - 1) * AH * ADH], rv[(ALK - 1) * AH * ADH];
        for (int64_t j = 0, r = 0; j < ALK; j++)
            if (j != J) {
                memcpy(rk + r * E, hk + j * E, (size_t)E * sizeof *rk);
                memcpy(rv + r * E, hv + j * E, (size_t)E * sizeof *rv);
                r++;
            }
        mha_attention_args ra = p.a;
        ra.q_len = 1;
        ra.kv_len = ALK - 1;
        ra.k = rk;
        ra.v = rv;
        attend_f64(&ra, p.ro, p.rl);
        const double e = rel_err(p.out, p.ro, E);
        if (!(e <= 1e-5))   /* (aprob_check's bound) */
            fail_msg("dtype %d: error %g against float64 (out[0] %g vs %g)",
                     (int)dtypes[t], e, (double)p.out[0], p.ro[0]);
        mha_kv_cache_free(kv);
    }
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_window_bounds_near_int64_max),
        cmocka_unit_test(test_q_offset_near_int64_limits),
        cmocka_unit_test(test_q_total_near_int64_max),
        cmocka_unit_test(test_scale_overflow),
        cmocka_unit_test(test_scale_overflow_decoding),
        cmocka_unit_test(test_f16_cache_overflow),
        cmocka_unit_test(test_all_nan_row),
        cmocka_unit_test(test_q8_flt_max),
        cmocka_unit_test(test_masked_inf_in_cache),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
