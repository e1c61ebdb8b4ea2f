/*
 * test_kv_dtype.c -- KV caches stored in f16, bf16, q8 and q4, and the
 * Hadamard rotation of a cache:
 *
 *   - what a cache stores (mha_kv_cache_read) is, bit for bit, what an
 *     independent rounding gives: nearest f16 / bf16 found by searching
 *     the formats' values in float64 (ties to the even code), and q8's
 *     codes by exact residuals in float64, over every f16 value, every
 *     midpoint between two, their neighbours, a sweep of float bit
 *     patterns and the special values;
 *   - attention on such a cache is bitwise the attention on an f32 cache
 *     holding the stored values (the kernels convert exactly, in
 *     registers, into the same chains), for every tier, on 1, 2 and 4
 *     threads, grouped-query and not, short and split (>= 1024 keys);
 *     and it is within the test suite's bound of the float64 attention
 *     on the stored values;
 *   - non-finite values: f16 overflow reads as Inf, a q8 block with NaN
 *     or Inf reads as NaN, and the fast/exact pv choice follows them
 *     through appends and truncation.
 *
 * Every tier runs it (CTest, MHA_ISA).
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
#include "core/half.h"
#include "ref.h"
#include "testutil.h"

static uint32_t bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* ---- the independent roundings ------------------------------------------ */

/* The value of f16 code h (h < 0x7c00: finite, non-negative), by its
 * definition: subnormal m 2^-24, normal (1 + m/1024) 2^(e-15). */
static double f16_value(unsigned h)
{
    const unsigned e = h >> 10, m = h & 0x3ffu;
    return e ? ldexp(1.0 + m / 1024.0, (int)e - 15) : ldexp((double)m, -24);
}

/* x rounded to the nearest f16, ties to the even code, as a float: the
 * finite codes searched by bisection (their values increase with the
 * code), overflow past the midpoint of 65504 and 65536 to Inf. */
static float ref_f16(float x)
{
    if (isnan(x))
        return x;
    const double a = fabs((double)x);
    double r;
    if (a >= 65520.0) {
        r = INFINITY;
    } else {
        unsigned lo = 0, hi = 0x7bffu;   /* f16_value(lo) <= a */
        while (lo < hi) {
            const unsigned mid = (lo + hi + 1) / 2;
            if (f16_value(mid) <= a)
                lo = mid;
            else
                hi = mid - 1;
        }
        const double below = f16_value(lo);
        const double above = lo < 0x7bffu ? f16_value(lo + 1) : 65536.0;
        const double d0 = a - below, d1 = above - a;
        r = d0 < d1 ? below : d1 < d0 ? above : (lo & 1u) ? above : below;
    }
    return (float)(signbit(x) ? -r : r);
}

/* x rounded to the nearest bfloat16 (8 significant bits), ties to the
 * even code: the two neighbours by truncating x's bits, compared in
 * float64; 2^128 stands for the code past the largest finite one, Inf. */
static float ref_bf16(float x)
{
    if (isnan(x) || isinf(x))
        return x;
    const uint32_t t = bits(x) & 0xffff0000u;
    const double below = fabs((double)from_bits(t));
    const uint32_t next = (t & 0x7fffffffu) + 0x10000u;
    const double above = next >= 0x7f800000u ? ldexp(1.0, 128)
                                             : (double)from_bits(next);
    const double a = fabs((double)x);
    const double d0 = a - below, d1 = above - a;
    const int even_below = ((t >> 16) & 1u) == 0;
    const double r = d0 < d1 ? below : d1 < d0 ? above
                   : even_below ? below : above;
    if (r >= ldexp(1.0, 128))
        return signbit(x) ? -INFINITY : INFINITY;
    return (float)(signbit(x) ? -r : r);
}

/* One q8 (qmax 127) or q4 (qmax 7) block of n values, as include/mha.h
 * and docs/semantics.md define it: s = amax / qmax in float (NaN if any
 * value is not finite), each code the integer nearest x / s (ties even),
 * found from the exact residuals x - c s in float64, clamped to +-qmax;
 * the stored value is the float c * s. */
static void ref_quant(const float *x, int n, int qmax, float *out)
{
    float amax = 0.0f;
    int finite = 1;
    for (int i = 0; i < n; i++) {
        finite &= isfinite(x[i]) != 0;
        if (fabsf(x[i]) > amax)
            amax = fabsf(x[i]);
    }
    const float s = amax / (float)qmax;
    for (int i = 0; i < n; i++) {
        if (!finite) {
            out[i] = NAN;
            continue;
        }
        if (!(s > 0.0f)) {
            out[i] = 0.0f;
            continue;
        }
        const double c0 = floor((double)x[i] / (double)s);
        /* c0 may be off by one from the floor of the exact quotient:
         * take the best of c0 - 1 .. c0 + 2 by exact residual. */
        double best = 0.0, err = INFINITY;
        for (double c = c0 - 1; c <= c0 + 2; c++) {
            const double e = fabs((double)x[i] - c * (double)s);
            if (e < err || (e == err && fmod(fabs(c), 2.0) == 0.0)) {
                err = e;
                best = c;
            }
        }
        best = best > qmax ? qmax : best < -qmax ? -qmax : best;
        out[i] = (float)best * s;
    }
}

/* ---- round trips through a cache ---------------------------------------- */

enum { RT_DH = 64 };

/* Stores n values (n a multiple of RT_DH) as keys and values of one
 * head of d_h = RT_DH in a cache of `dtype`, reads both back. */
static void round_trip(mha_kv_dtype dtype, const float *x, int64_t n,
                       float *k, float *v)
{
    const int64_t tokens = n / RT_DH;
    mha_kv_cache_config kc = {1, 1, RT_DH, tokens, dtype, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    assert_int_equal(mha_kv_cache_append(kv, 0, x, x, tokens), MHA_OK);
    assert_int_equal(mha_kv_cache_read(kv, 0, 0, tokens, k, v), MHA_OK);
    mha_kv_cache_free(kv);
}

/* Every f16 value, every midpoint of two neighbours and the floats on
 * either side of it, a sweep of float bit patterns, the specials. */
static float *conversion_inputs(int64_t *n)
{
    const int64_t cap = 6 * 65536 + 4 * 65536 + 64;
    float *x = malloc((size_t)cap * sizeof *x);
    int64_t k = 0;
    for (unsigned h = 0; h < 0x7c00u; h++) {
        const double a = f16_value(h);
        const double b = h < 0x7bffu ? f16_value(h + 1) : 65536.0;
        const float mid = (float)((a + b) / 2);    /* exact in float */
        const float vals[] = {(float)a, mid, nextafterf(mid, 0.0f),
                              nextafterf(mid, INFINITY)};
        for (int i = 0; i < 4; i++) {
            x[k++] = vals[i];
            if (h % 2)
                x[k++] = -vals[i];
        }
    }
    /* Float bit patterns 0x00000000 .. 0xffffffff in steps of 16411 (a
     * prime): every exponent, both signs, NaNs and Infs among them. */
    for (uint64_t u = 0; u <= 0xffffffffu && k < cap - 64; u += 16411u * 64)
        for (int i = 0; i < 64 && k < cap - 64; i++)
            x[k++] = from_bits((uint32_t)(u + (uint64_t)i * 16411u));
    const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN,
                              65504.0f, 65519.99f, 65520.0f, -65520.0f,
                              0x1p-24f, 0x1p-25f, nextafterf(0x1p-25f, 1.0f),
                              0x1p-14f, FLT_MAX, -FLT_MAX, FLT_MIN,
                              0x1.fffffep+127f, 0x1.ff8p+127f,
                              0x1.ff7fffp+127f, 1e-45f};
    for (size_t i = 0; i < sizeof specials / sizeof *specials; i++)
        x[k++] = specials[i];
    while (k % RT_DH)
        x[k++] = 1.0f;
    *n = k;
    return x;
}

/* Bitwise equal, or both NaN. */
static int same_value(float a, float b)
{
    return (isnan(a) && isnan(b)) || bits(a) == bits(b);
}

static void check_rounding(mha_kv_dtype dtype, float (*ref)(float))
{
    int64_t n;
    float *x = conversion_inputs(&n);
    float *k = malloc((size_t)n * 4), *v = malloc((size_t)n * 4);
    /* f16 refuses a finite |x| >= 65520 (docs/semantics.md): those
     * inputs become the Inf that the rounding would have made, which f16
     * stores as given; test_red_team checks the refusal. */
    for (int64_t i = 0; dtype == MHA_KV_F16 && i < n; i++)
        if (isfinite(x[i]) && fabsf(x[i]) >= 65520.0f)
            x[i] = copysignf(INFINITY, x[i]);
    round_trip(dtype, x, n, k, v);
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        const float want = ref(x[i]);
        if (!same_value(k[i], want) || !same_value(v[i], want)) {
            if (bad++ < 5)
                print_error("dtype %d: %a stored as %a / %a, expected %a\n",
                            (int)dtype, (double)x[i], (double)k[i],
                            (double)v[i], (double)want);
        }
    }
    assert_int_equal(bad, 0);
    free(x);
    free(k);
    free(v);
}

static void test_f16_rounding(void **state)
{
    (void)state;
    check_rounding(MHA_KV_F16, ref_f16);
}

static void test_bf16_rounding(void **state)
{
    (void)state;
    check_rounding(MHA_KV_BF16, ref_bf16);
}

static void test_f32_exact(void **state)
{
    (void)state;
    int64_t n;
    float *x = conversion_inputs(&n);
    float *k = malloc((size_t)n * 4), *v = malloc((size_t)n * 4);
    round_trip(MHA_KV_F32, x, n, k, v);
    assert_memory_equal(k, x, (size_t)n * 4);
    assert_memory_equal(v, x, (size_t)n * 4);
    free(x);
    free(k);
    free(v);
}

/* q8, for d_h a multiple of 32 and not (the last block shorter), values
 * of every scale, blocks that are all zero, hold a NaN or an Inf, or are
 * tiny enough that amax / 127 is 0. */
/* q8 (d_h 64, 40, 7) and q4 (d_h 64, 40, 6: even) against ref_quant,
 * on rows of every scale, zeros, NaN, -Inf, subnormals and exact
 * halves. */
static void check_quant(mha_kv_dtype dtype, const int64_t *dhs, int ndh)
{
    const int qmax = dtype == MHA_KV_Q8 ? 127 : 7;
    for (int t = 0; t < ndh; t++) {
        const int64_t dh = dhs[t], tokens = 300, n = tokens * dh;
        float *x = malloc((size_t)n * 4), *k = malloc((size_t)n * 4),
              *v = malloc((size_t)n * 4), *want = malloc((size_t)n * 4);
        tu_fill(x, n, 70 + (uint64_t)t, -1, 1);
        for (int64_t r = 0; r < tokens; r++) {
            float *row = x + r * dh;
            const float scale = ldexpf(1.0f, (int)(r % 60) - 30);
            for (int64_t d = 0; d < dh; d++)
                row[d] *= scale;
            if (r == 5)
                memset(row, 0, (size_t)dh * 4);
            if (r == 6)
                row[dh - 1] = NAN;
            if (r == 7)
                row[0] = -INFINITY;
            if (r == 8)
                for (int64_t d = 0; d < dh; d++)
                    row[d] = d % 2 ? 1e-45f : -1e-45f;
            if (r == 9)   /* exact halves: ties to even */
                for (int64_t d = 0; d < dh; d++)
                    row[d] = d == 0 ? (float)qmax
                                    : (float)(d % (qmax < 9 ? qmax : 9)) -
                                          3.5f;
        }
        mha_kv_cache_config kc = {1, 1, dh, tokens, dtype, 0, 0, 0, 0, 0, 0};
        mha_kv_cache *kv = NULL;
        assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
        assert_int_equal(mha_kv_cache_append(kv, 0, x, x, tokens), MHA_OK);
        assert_int_equal(mha_kv_cache_read(kv, 0, 0, tokens, k, v), MHA_OK);
        mha_kv_cache_free(kv);
        for (int64_t r = 0; r < tokens; r++)
            for (int64_t d0 = 0; d0 < dh; d0 += 32)
                ref_quant(x + r * dh + d0,
                          (int)(dh - d0 < 32 ? dh - d0 : 32), qmax,
                          want + r * dh + d0);
        int64_t bad = 0;
        for (int64_t i = 0; i < n; i++)
            if (!same_value(k[i], want[i]) || !same_value(v[i], want[i]))
                if (bad++ < 5)
                    print_error("q%d d_h %lld: %a stored as %a / %a, "
                                "expected %a\n", qmax == 127 ? 8 : 4,
                                (long long)dh, (double)x[i],
                                (double)k[i], (double)v[i], (double)want[i]);
        assert_int_equal(bad, 0);
        /* The whole block with the NaN, and only it, reads as NaN. */
        for (int64_t d = 0; d < dh; d++)
            assert_int_equal(isnan(k[6 * dh + d]) != 0,
                             d >= (dh - 1) / 32 * 32);
        free(x);
        free(k);
        free(v);
        free(want);
    }
}

static void test_q8_rounding(void **state)
{
    (void)state;
    const int64_t dhs[] = {64, 40, 7};
    check_quant(MHA_KV_Q8, dhs, 3);
}

static void test_q4_rounding(void **state)
{
    (void)state;
    const int64_t dhs[] = {64, 40, 6};
    check_quant(MHA_KV_Q4, dhs, 3);
    /* two codes a byte: an odd d_h is refused, naming it */
    mha_kv_cache_config kc = {1, 1, 7, 8, MHA_KV_Q4, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "head_dim must be even");
    assert_null(kv);
}

/* ---- attention on a compact cache ---------------------------------------- */

enum { H = 4, DH = 40, LQ = 3 };

typedef struct problem {
    int64_t B, Hkv;
    int64_t len[2];
    float *k[2], *v[2];   /* each sequence's keys (len, Hkv * DH) */
    float *q;             /* (B, LQ, H * DH) */
    int64_t lq;           /* query rows a sequence: LQ, or fewer (the
                             first rows of q, as (B, lq, H * DH))     */
} problem;

static void problem_init(problem *p, int64_t Hkv, int64_t len0, int64_t len1,
                         uint64_t seed, float kv_scale)
{
    p->B = 2;
    p->Hkv = Hkv;
    p->len[0] = len0;
    p->len[1] = len1;
    for (int b = 0; b < 2; b++) {
        const int64_t n = p->len[b] * Hkv * DH;
        p->k[b] = malloc((size_t)n * 4);
        p->v[b] = malloc((size_t)n * 4);
        tu_fill(p->k[b], n, seed + 10 * (uint64_t)b, -kv_scale, kv_scale);
        tu_fill(p->v[b], n, seed + 10 * (uint64_t)b + 1, -kv_scale, kv_scale);
    }
    p->lq = LQ;
    p->q = malloc((size_t)(2 * LQ * H * DH) * 4);
    tu_fill(p->q, 2 * LQ * H * DH, seed + 5, -1, 1);
}

static void problem_free(problem *p)
{
    for (int b = 0; b < 2; b++) {
        free(p->k[b]);
        free(p->v[b]);
    }
    free(p->q);
}

static mha_kv_cache *cache_of(const problem *p, mha_kv_dtype dtype,
                              float *const k[2], float *const v[2])
{
    mha_kv_cache_config kc = {p->B, p->Hkv, DH,
                              (p->len[0] > p->len[1] ? p->len[0] : p->len[1]),
                              dtype, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    for (int64_t b = 0; b < p->B; b++)
        assert_int_equal(mha_kv_cache_append(kv, b, k[b], v[b], p->len[b]),
                         MHA_OK);
    return kv;
}

static void attend(const problem *p, mha_kv_cache *kv, int threads,
                   float *out, float *lse)
{
    mha_attention_args a = {0};
    a.batch = p->B;
    a.num_heads = H;
    a.num_kv_heads = p->Hkv;
    a.head_dim = DH;
    a.q_len = p->lq;
    a.q = p->q;
    a.cache = kv;
    a.out = out;
    a.lse = lse;
    a.num_threads = threads;
    assert_int_equal(mha_attention(&a), MHA_OK);
}

/* The float64 attention of row i of head h of sequence b on keys k, v
 * (the last lq keys are the new tokens': causal bottom-right), and the
 * same in float32 loops, the measure of plain single precision. */
static void attend_ref(const problem *p, const float *k, const float *v,
                       int64_t b, int64_t h, int64_t i, double *o64,
                       float *o32)
{
    const int64_t n = p->len[b] - p->lq + i + 1, g = h / (H / p->Hkv);
    const int64_t ld = p->Hkv * DH;
    const float *q = p->q + (b * p->lq + i) * H * DH + h * DH;
    const double scale = 1.0 / sqrt((double)DH);
    double *s = malloc((size_t)n * sizeof *s), mx = -INFINITY, sum = 0;
    float *s32 = malloc((size_t)n * sizeof *s32), mx32 = -INFINITY,
          sum32 = 0;
    for (int64_t j = 0; j < n; j++) {
        double dot = 0;
        float dot32 = 0;
        for (int64_t d = 0; d < DH; d++) {
            dot += (double)q[d] * k[j * ld + g * DH + d];
            dot32 += q[d] * k[j * ld + g * DH + d];
        }
        s[j] = dot * scale;
        s32[j] = dot32 * (float)scale;
        mx = s[j] > mx ? s[j] : mx;
        mx32 = s32[j] > mx32 ? s32[j] : mx32;
    }
    for (int64_t j = 0; j < n; j++) {
        sum += s[j] = exp(s[j] - mx);
        sum32 += s32[j] = expf(s32[j] - mx32);
    }
    for (int64_t d = 0; d < DH; d++) {
        double acc = 0;
        float acc32 = 0;
        for (int64_t j = 0; j < n; j++) {
            acc += s[j] * v[j * ld + g * DH + d];
            acc32 += s32[j] * v[j * ld + g * DH + d];
        }
        o64[d] = acc / sum;
        o32[d] = acc32 / sum32;
    }
    free(s);
    free(s32);
}

static void check_dtype(const problem *p, mha_kv_dtype dtype)
{
    const int64_t nout = p->B * p->lq * H * DH;
    float *rk[2], *rv[2];
    mha_kv_cache *kv = cache_of(p, dtype, p->k, p->v);
    for (int64_t b = 0; b < p->B; b++) {
        const int64_t n = p->len[b] * p->Hkv * DH;
        rk[b] = malloc((size_t)n * 4);
        rv[b] = malloc((size_t)n * 4);
        assert_int_equal(mha_kv_cache_read(kv, b, 0, p->len[b], rk[b], rv[b]),
                         MHA_OK);
        if (dtype != MHA_KV_F32)   /* the rounding happened */
            assert_true(memcmp(rk[b], p->k[b], (size_t)n * 4) != 0);
    }
    mha_kv_cache *f32 = cache_of(p, MHA_KV_F32, rk, rv);
    float *want = malloc((size_t)nout * 4), *got = malloc((size_t)nout * 4);
    float lse_want[2 * H * LQ], lse_got[2 * H * LQ];
    attend(p, f32, 1, want, lse_want);
    const int threads[] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        memset(got, 0xff, (size_t)nout * 4);
        attend(p, kv, threads[t], got, lse_got);
        assert_memory_equal(got, want, (size_t)nout * 4);
        assert_memory_equal(lse_got, lse_want,
                            (size_t)(p->B * H * p->lq) * sizeof *lse_got);
    }
    /* Against float64 on the stored values. */
    double o64[DH], naive = 0, err = 0, amax = 0;
    float o32[DH];
    for (int64_t b = 0; b < p->B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < p->lq; i++) {
                attend_ref(p, rk[b], rv[b], b, h, i, o64, o32);
                const float *row = got + (b * p->lq + i) * H * DH + h * DH;
                for (int64_t d = 0; d < DH; d++) {
                    err = fmax(err, fabs(row[d] - o64[d]));
                    naive = fmax(naive, fabs(o32[d] - o64[d]));
                    amax = fmax(amax, fabs(o64[d]));
                }
            }
    assert_true(err <= ref_tolerance(naive, amax));
    for (int64_t b = 0; b < p->B; b++) {
        free(rk[b]);
        free(rv[b]);
    }
    free(want);
    free(got);
    mha_kv_cache_free(kv);
    mha_kv_cache_free(f32);
}

/* Short and split (>= 1024 keys: the decoding split, and with H_kv < H
 * the group's heads stacked), grouped-query and multi-query; LQ rows and
 * one (a lone row of a 16-bit cache takes its keys a chunk ahead of its
 * values: flash_forward.c's queue, here against the f32 cache's tiles
 * taken in turn, bit for bit). */
static void test_attention_bitwise(void **state)
{
    (void)state;
    const int64_t shapes[][3] = {{4, 70, 5}, {2, 1300, 200}, {1, 1100, 1030},
                                 {4, 1300, 600}};
    const mha_kv_dtype dtypes[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16,
                                   MHA_KV_Q8, MHA_KV_Q4};
    for (size_t s = 0; s < 4; s++) {
        problem p;
        problem_init(&p, shapes[s][0], shapes[s][1], shapes[s][2],
                     100 + 17 * s, 2.0f);
        for (p.lq = LQ; p.lq >= 1; p.lq -= LQ - 1)
            for (size_t d = 0; d < 5; d++)
                check_dtype(&p, dtypes[d]);
        problem_free(&p);
    }
}

/* bf16 and f16 queries (mha_attention_decode's dtype, q16, out16) against
 * every cache dtype: the keys and values read where they are, the
 * queries widened and the context rounded, so the output is bitwise the
 * float32 decode on the widened queries, rounded to nearest even (that
 * decode is held to float64 above), and the lse is its lse; on 1 and 2
 * threads; a decode plan (mha_attention_plan_create_decode) of the same
 * bits, run twice.  Then the misuse of the 16-bit fields and plans. */
static void test_half_queries(void **state)
{
    (void)state;
    const mha_kv_dtype dtypes[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16,
                                   MHA_KV_Q8, MHA_KV_Q4};
    const mha_dtype qt[] = {MHA_DTYPE_BF16, MHA_DTYPE_F16};
    problem p;
    problem_init(&p, 2, 1300, 70, 321, 2.0f);
    const int64_t nq = p.B * LQ * H * DH;
    uint16_t *q16 = malloc((size_t)nq * 2), *o16 = malloc((size_t)nq * 2);
    float *qf = malloc((size_t)nq * 4), *want = malloc((size_t)nq * 4);
    float lse_want[2 * H * LQ], lse_got[2 * H * LQ];
    for (size_t t = 0; t < 2; t++) {
        const int bf = qt[t] == MHA_DTYPE_BF16;
        for (int64_t i = 0; i < nq; i++) {
            q16[i] = bf ? mha_bf16_from_float(p.q[i])
                        : mha_f16_from_float(p.q[i]);
            qf[i] = bf ? mha_bf16_to_float(q16[i]) : mha_f16_to_float(q16[i]);
        }
        for (size_t d = 0; d < 5; d++) {
            mha_kv_cache *kv = cache_of(&p, dtypes[d], p.k, p.v);
            problem pf = p;
            pf.q = qf;
            attend(&pf, kv, 1, want, lse_want);
            for (int threads = 1; threads <= 2; threads++) {
                mha_attention_decode_args a = {0};
                a.batch = p.B, a.num_heads = H, a.head_dim = DH;
                a.q_len = LQ, a.cache = kv, a.lse = lse_got;
                a.num_threads = threads;
                a.dtype = qt[t], a.q16 = q16, a.out16 = o16;
                /* the call, then a decode plan (twice: a plan's second
                 * run too) */
                mha_attention_plan *plan = NULL;
                for (int run = 0; run < 3; run++) {
                    memset(o16, 0xff, (size_t)nq * 2);
                    memset(lse_got, 0xff, sizeof lse_got);
                    if (run == 1 &&
                        mha_attention_plan_create_decode(&a, &plan) != MHA_OK)
                        fail_msg("16-bit decode plan: %s", mha_last_error());
                    if ((run ? mha_attention_plan_decode(plan, &a)
                             : mha_attention_decode(&a)) != MHA_OK)
                        fail_msg("%s queries, cache dtype %d, run %d: %s",
                                 bf ? "bf16" : "f16", (int)dtypes[d], run,
                                 mha_last_error());
                    for (int64_t i = 0; i < nq; i++) {
                        const uint16_t r = bf ? mha_bf16_from_float(want[i])
                                              : mha_f16_from_float(want[i]);
                        if (o16[i] != r)
                            fail_msg("%s queries, cache dtype %d, %d "
                                     "threads, run %d: out16[%lld] = "
                                     "0x%04x, the rounded float32 decode "
                                     "0x%04x", bf ? "bf16" : "f16",
                                     (int)dtypes[d], threads, run,
                                     (long long)i, o16[i], r);
                    }
                    assert_memory_equal(lse_got, lse_want, sizeof lse_got);
                }
                mha_attention_plan_free(plan);
            }
            mha_kv_cache_free(kv);
        }
    }

    /* misuse */
    mha_kv_cache *kv = cache_of(&p, MHA_KV_F16, p.k, p.v);
    mha_attention_decode_args a = {0};
    a.batch = p.B, a.num_heads = H, a.head_dim = DH, a.q_len = LQ;
    a.cache = kv, a.dtype = MHA_DTYPE_BF16, a.q16 = q16, a.out16 = o16;
    assert_int_equal(mha_attention_decode(&a), MHA_OK);
    mha_attention_decode_args b = a;
    b.q = qf;
    assert_fails(mha_attention_decode(&b), MHA_ERR_INVALID_ARGUMENT,
                 "q must be NULL");
    b = a, b.out16 = NULL;
    assert_fails(mha_attention_decode(&b), MHA_ERR_NULL_POINTER, "out16");
    b = a, b.out16 = q16 + 1;
    assert_fails(mha_attention_decode(&b), MHA_ERR_INVALID_ARGUMENT,
                 "overlaps");
    b = a, b.head_dim = 0;
    assert_fails(mha_attention_decode(&b), MHA_ERR_SHAPE, "head_dim");
    b = a, b.dtype = (mha_dtype)7;
    assert_fails(mha_attention_decode(&b), MHA_ERR_INVALID_ARGUMENT, "dtype");
    b = a, b.dtype = MHA_DTYPE_F32;   /* 16-bit fields on a float32 call */
    b.q = qf, b.out = want;
    assert_fails(mha_attention_decode(&b), MHA_ERR_INVALID_ARGUMENT, "q16");
    /* a plan runs its own dtype only, and refuses what the call does */
    mha_attention_plan *plan = NULL;
    assert_int_equal(mha_attention_plan_create_decode(&a, &plan), MHA_OK);
    b = a, b.dtype = MHA_DTYPE_F16;
    assert_fails(mha_attention_plan_decode(plan, &b), MHA_ERR_INVALID_ARGUMENT,
                 "made for dtype MHA_DTYPE_BF16");
    b = a, b.dtype = MHA_DTYPE_F32, b.q16 = NULL, b.out16 = NULL;
    b.q = qf, b.out = want;
    assert_fails(mha_attention_plan_decode(plan, &b), MHA_ERR_INVALID_ARGUMENT,
                 "made for dtype MHA_DTYPE_BF16");
    b = a, b.out16 = q16 + 1;
    assert_fails(mha_attention_plan_decode(plan, &b), MHA_ERR_INVALID_ARGUMENT,
                 "overlaps");
    b = a, b.q = qf;
    assert_fails(mha_attention_plan_decode(plan, &b), MHA_ERR_INVALID_ARGUMENT,
                 "q must be NULL");
    mha_attention_args without = {0};   /* a decode plan takes a cache */
    without.batch = a.batch, without.num_heads = a.num_heads;
    without.head_dim = a.head_dim, without.q_len = a.q_len;
    without.dtype = a.dtype, without.q16 = q16, without.k16 = q16;
    without.v16 = q16, without.out16 = o16;
    assert_fails(mha_attention_plan_run(plan, &without),
                 MHA_ERR_INVALID_ARGUMENT, "made for a KV cache");
    b = a, b.q_len = 1;
    assert_fails(mha_attention_plan_decode(plan, &b), MHA_ERR_SHAPE,
                 "do not match the plan");
    mha_attention_plan_free(plan);
    plan = NULL;
    b = a, b.out16 = NULL;   /* a shape needs no data */
    b.q16 = NULL;
    assert_int_equal(mha_attention_plan_create_decode(&b, &plan), MHA_OK);
    mha_attention_plan_free(plan);
    mha_kv_cache_free(kv);
    free(q16), free(o16), free(qf), free(want);
    problem_free(&p);
}

/* ---- the Hadamard rotation (mha_kv_cache_config.rotate) ------------------ */

enum { RB = 2, RHKV = 2, RH = 4, RDH = 64, RLEN = 300, RLQ = 2 };

/* keys and values (RB, RLEN, RHKV * RDH) uniform in [-1, 1], two channels
 * of every key and one of every value 24x larger (outlier channels, as
 * the keys of LLMs have them), queries (RB, RLQ, RH * RDH) */
static void rotation_data(float *k, float *v, float *q)
{
    const int64_t nkv = RB * RLEN * RHKV * RDH;
    tu_fill(k, nkv, 901, -1, 1);
    tu_fill(v, nkv, 902, -1, 1);
    tu_fill(q, RB * RLQ * RH * RDH, 903, -1, 1);
    for (int64_t r = 0; r < RB * RLEN * RHKV; r++) {
        k[r * RDH + 3] *= 24.0f;
        k[r * RDH + 41] *= 24.0f;
        v[r * RDH + 17] *= 24.0f;
    }
}

/* The decode of q on a cache of `dtype` (rotated or not) filled with k
 * and v: out (RB, RLQ, RH * RDH), on `threads` threads. */
static void rotated_decode(mha_kv_dtype dtype, int rotate, const float *k,
                           const float *v, const float *q, int threads,
                           float *out, float *kr)
{
    mha_kv_cache_config kc = {RB, RHKV, RDH, RLEN, dtype, 0, 0, 0, rotate, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    const int64_t ld = RLEN * RHKV * RDH;
    for (int64_t b = 0; b < RB; b++)
        assert_int_equal(mha_kv_cache_append(kv, b, k + b * ld, v + b * ld,
                                             RLEN), MHA_OK);
    if (kr)
        assert_int_equal(mha_kv_cache_read(kv, 1, 0, RLEN, kr, NULL), MHA_OK);
    mha_attention_decode_args a = {0};
    a.batch = RB, a.num_heads = RH, a.head_dim = RDH, a.q_len = RLQ;
    a.q = q, a.out = out, a.cache = kv, a.num_threads = threads;
    assert_int_equal(mha_attention_decode(&a), MHA_OK);
    mha_kv_cache_free(kv);
}

/* The float64 decode of the original (unrounded) data. */
static void rotation_ref(const float *k, const float *v, const float *q,
                         double *out)
{
    const double scale = 1.0 / sqrt((double)RDH);
    double s[RLEN];
    for (int64_t b = 0; b < RB; b++)
        for (int64_t i = 0; i < RLQ; i++)
            for (int64_t h = 0; h < RH; h++) {
                const int64_t g = h / (RH / RHKV), n = RLEN - RLQ + i + 1;
                const float *qr = q + ((b * RLQ + i) * RH + h) * RDH;
                double mx = -INFINITY, sum = 0.0;
                for (int64_t j = 0; j < n; j++) {
                    const float *kj = k + ((b * RLEN + j) * RHKV + g) * RDH;
                    double dot = 0.0;
                    for (int64_t d = 0; d < RDH; d++)
                        dot += (double)qr[d] * kj[d];
                    s[j] = dot * scale;
                    mx = s[j] > mx ? s[j] : mx;
                }
                for (int64_t j = 0; j < n; j++)
                    sum += s[j] = exp(s[j] - mx);
                double *o = out + ((b * RLQ + i) * RH + h) * RDH;
                for (int64_t d = 0; d < RDH; d++) {
                    double acc = 0.0;
                    for (int64_t j = 0; j < n; j++)
                        acc += s[j] * v[((b * RLEN + j) * RHKV + g) * RDH + d];
                    o[d] = acc / sum;
                }
            }
}

static double rot_err(const float *x, const double *ref, int64_t n)
{
    double e = 0.0;
    for (int64_t i = 0; i < n; i++)
        e = fmax(e, fabs((double)x[i] - ref[i]));
    return e;
}

/*
 * A rotated cache: attention unchanged but for rounding (an f32 cache,
 * rotated or not, within the suite's bound of float64), its read gives
 * the keys back, every thread count the same bits; and on data with
 * outlier channels it halves q4's error or better (the target;
 * docs/semantics.md gives the figures), and lowers q8's.
 */
static void test_rotation(void **state)
{
    (void)state;
    const int64_t nkv = RB * RLEN * RHKV * RDH, nq = RB * RLQ * RH * RDH;
    float *k = malloc((size_t)nkv * 4), *v = malloc((size_t)nkv * 4);
    float *q = malloc((size_t)nq * 4), *out = malloc((size_t)nq * 4);
    float *out2 = malloc((size_t)nq * 4);
    float *kr = malloc((size_t)(RLEN * RHKV * RDH) * 4);
    double *ref = malloc((size_t)nq * sizeof *ref);
    rotation_data(k, v, q);
    rotation_ref(k, v, q, ref);
    double amax = 0.0;
    for (int64_t i = 0; i < nq; i++)
        amax = fmax(amax, fabs(ref[i]));
    /* f32: plain and rotated both within float rounding of float64 (the
     * bound of a float32 attention of this size: a few ulp of the
     * largest value per sum of 300 terms, 1e-5 relative) */
    rotated_decode(MHA_KV_F32, 0, k, v, q, 1, out, NULL);
    const double e_plain = rot_err(out, ref, nq);
    rotated_decode(MHA_KV_F32, 1, k, v, q, 1, out, kr);
    const double e_turned = rot_err(out, ref, nq);
    if (!(e_plain <= 1e-5 * amax && e_turned <= 1e-5 * amax))
        fail_msg("f32 cache: error %.3g plain, %.3g rotated (bound %.3g)",
                 e_plain, e_turned, 1e-5 * amax);
    /* read turns back: the keys of sequence 1 within float rounding */
    double kerr = 0.0;
    for (int64_t i = 0; i < RLEN * RHKV * RDH; i++)
        kerr = fmax(kerr, fabs((double)kr[i] - k[RLEN * RHKV * RDH + i]));
    if (!(kerr <= 1e-5 * 24.0))
        fail_msg("a rotated f32 cache reads keys back off by %.3g", kerr);
    /* threads: the same bits */
    for (int t = 2; t <= 4; t += 2) {
        rotated_decode(MHA_KV_Q4, 1, k, v, q, t, out2, NULL);
        rotated_decode(MHA_KV_Q4, 1, k, v, q, 1, out, NULL);
        assert_memory_equal(out, out2, (size_t)nq * 4);
    }
    /* q4 and q8 on outlier channels, without and with the rotation */
    const mha_kv_dtype dts[2] = {MHA_KV_Q4, MHA_KV_Q8};
    for (int d = 0; d < 2; d++) {
        rotated_decode(dts[d], 0, k, v, q, 1, out, NULL);
        const double e0 = rot_err(out, ref, nq);
        rotated_decode(dts[d], 1, k, v, q, 1, out, NULL);
        const double e1 = rot_err(out, ref, nq);
        print_message("q%d, outlier channels: max error %.4g without the "
                      "rotation, %.4g with it (%.2fx); max |out| %.3g\n",
                      d ? 8 : 4, e0, e1, e1 / e0, amax);
        if (!(e1 <= (d ? 1.0 : 0.5) * e0))
            fail_msg("q%d: the rotation's error %.4g against %.4g without",
                     d ? 8 : 4, e1, e0);
    }
    /* the module's cached forward and a decode plan turn q and the
     * output too: equal to the unrotated f32 cache up to rounding, and the
     * plan bitwise the one-shot call */
    mha_config mc = {0};
    mc.embed_dim = RH * RDH, mc.num_heads = RH, mc.num_kv_heads = RHKV;
    mha_module *m = tu_module(&mc, 77);
    assert_non_null(m);
    const int64_t E = RH * RDH, L = 40;
    float *x = malloc((size_t)(RB * L * E) * 4);
    float *y[2] = {malloc((size_t)(RB * L * E) * 4),
                   malloc((size_t)(RB * L * E) * 4)};
    tu_fill(x, RB * L * E, 78, -1, 1);
    for (int rot = 0; rot < 2; rot++) {
        mha_kv_cache_config kc = {RB, RHKV, RDH, L, MHA_KV_F32, 0, 0, 0, rot, 0, 0};
        mha_kv_cache *kv = NULL;
        assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
        mha_forward_args fa = {0};
        fa.batch = RB, fa.q_len = L, fa.query = x, fa.out = y[rot];
        fa.cache = kv;
        assert_int_equal(mha_forward(m, &fa), MHA_OK);
        if (rot) {   /* a planned decode of the last token, again */
            for (int64_t b = 0; b < RB; b++)
                assert_int_equal(mha_kv_cache_truncate(kv, b, L - 1), MHA_OK);
            float qd[RB * RH * RDH], o1[RB * RH * RDH], o2[RB * RH * RDH];
            tu_fill(qd, RB * RH * RDH, 79, -1, 1);
            mha_attention_decode_args a = {0};
            a.batch = RB, a.num_heads = RH, a.head_dim = RDH, a.q_len = 1;
            a.q = qd, a.out = o1, a.cache = kv;
            assert_int_equal(mha_attention_decode(&a), MHA_OK);
            mha_attention_plan *plan = NULL;
            assert_int_equal(mha_attention_plan_create_decode(&a, &plan),
                             MHA_OK);
            a.out = o2;
            assert_int_equal(mha_attention_plan_decode(plan, &a), MHA_OK);
            assert_memory_equal(o1, o2, sizeof o1);
            mha_attention_plan_free(plan);
        }
        mha_kv_cache_free(kv);
    }
    double mdiff = 0.0, mmax = 0.0;
    for (int64_t i = 0; i < RB * L * E; i++) {
        mdiff = fmax(mdiff, fabs((double)y[0][i] - y[1][i]));
        mmax = fmax(mmax, fabs((double)y[0][i]));
    }
    if (!(mdiff <= 1e-5 * (1.0 + mmax)))
        fail_msg("the module on a rotated cache differs by %.3g", mdiff);
    mha_free(m);
    free(x), free(y[0]), free(y[1]);
    /* misuse: an odd head_dim cannot be turned */
    mha_kv_cache_config kc = {1, 1, 7, 8, MHA_KV_F32, 0, 0, 0, 1, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "rotated");
    assert_null(kv);
    free(k), free(v), free(q), free(out), free(out2), free(kr), free(ref);
}

/* An Inf value in an f16 cache (given as Inf: a finite value past f16's
 * range is refused): the output rows that weigh it are what f32
 * attention on an Inf gives, bitwise, the others finite; truncating the
 * token away makes the tile finite again. */
static void test_non_finite(void **state)
{
    (void)state;
    const mha_kv_dtype dtypes[] = {MHA_KV_F16, MHA_KV_Q8};
    for (size_t t = 0; t < 2; t++) {
        problem p;
        problem_init(&p, 2, 90, 40, 300, 1.0f);
        /* Value 80 of sequence 0, K/V head 0: Inf, which f16 holds and
         * q8 cannot (its block reads as NaN). */
        p.v[0][80 * 2 * DH + 3] = INFINITY;
        float *rk[2], *rv[2];
        mha_kv_cache *kv = cache_of(&p, dtypes[t], p.k, p.v);
        for (int64_t b = 0; b < 2; b++) {
            const int64_t n = p.len[b] * 2 * DH;
            rk[b] = malloc((size_t)n * 4);
            rv[b] = malloc((size_t)n * 4);
            assert_int_equal(
                mha_kv_cache_read(kv, b, 0, p.len[b], rk[b], rv[b]), MHA_OK);
        }
        assert_true(dtypes[t] == MHA_KV_F16 ? isinf(rv[0][80 * 2 * DH + 3])
                                            : isnan(rv[0][80 * 2 * DH + 3]));
        mha_kv_cache *f32 = cache_of(&p, MHA_KV_F32, rk, rv);
        const int64_t nout = 2 * LQ * H * DH;
        float *want = malloc((size_t)nout * 4), *got = malloc((size_t)nout * 4);
        float lse[2 * H * LQ];
        attend(&p, f32, 2, want, lse);
        attend(&p, kv, 2, got, lse);
        for (int64_t i = 0; i < nout; i++)
            assert_true(same_value(got[i], want[i]));
        /* Sequence 1 never sees the non-finite value. */
        for (int64_t i = LQ * H * DH; i < nout; i++)
            assert_true(isfinite(got[i]));
        /* Back to 80 keys (the bad one gone), then 3 new finite ones:
         * everything finite, and equal to a cache that never had it. */
        assert_int_equal(mha_kv_cache_truncate(kv, 0, 80), MHA_OK);
        float extra_k[3 * 2 * DH], extra_v[3 * 2 * DH];
        tu_fill(extra_k, 3 * 2 * DH, 310, -1, 1);
        tu_fill(extra_v, 3 * 2 * DH, 311, -1, 1);
        assert_int_equal(mha_kv_cache_append(kv, 0, extra_k, extra_v, 3),
                         MHA_OK);
        attend(&p, kv, 2, got, lse);
        memcpy(p.k[0] + 80 * 2 * DH, extra_k, sizeof extra_k);
        memcpy(p.v[0] + 80 * 2 * DH, extra_v, sizeof extra_v);
        p.len[0] = 83;
        mha_kv_cache *clean = cache_of(&p, dtypes[t], p.k, p.v);
        attend(&p, clean, 2, want, lse);
        assert_memory_equal(got, want, (size_t)nout * 4);
        for (int64_t i = 0; i < nout; i++)
            assert_true(isfinite(got[i]));
        for (int64_t b = 0; b < 2; b++) {
            free(rk[b]);
            free(rv[b]);
        }
        free(want);
        free(got);
        mha_kv_cache_free(kv);
        mha_kv_cache_free(f32);
        mha_kv_cache_free(clean);
        problem_free(&p);
    }
}

/* A non-finite value that stays in the tile a truncation cuts: the tile
 * keeps its "not finite" flag, so a row that gives the value no weight
 * (here: a key padding mask blocks it) does not see 0 * Inf = NaN. */
static void test_truncation_keeps_flag(void **state)
{
    (void)state;
    problem p;
    problem_init(&p, 2, 90, 40, 320, 1.0f);
    p.v[0][70 * 2 * DH + 5] = INFINITY;   /* value 70, tile 1 */
    mha_kv_cache *kv = cache_of(&p, MHA_KV_F16, p.k, p.v);
    assert_int_equal(mha_kv_cache_truncate(kv, 0, 80), MHA_OK);
    uint8_t pad[2 * 80] = {0};
    pad[70] = 1;                      /* sequence 0 blocks key 70 */
    const int64_t nout = 2 * LQ * H * DH;
    float *out = malloc((size_t)nout * 4);
    mha_attention_args a = {0};
    a.batch = 2;
    a.num_heads = H;
    a.num_kv_heads = 2;
    a.head_dim = DH;
    a.q_len = LQ;
    a.q = p.q;
    a.cache = kv;
    a.out = out;
    a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {2, 80}};
    a.num_threads = 1;
    assert_int_equal(mha_attention(&a), MHA_OK);
    for (int64_t i = 0; i < nout; i++)
        assert_true(isfinite(out[i]));
    free(out);
    mha_kv_cache_free(kv);
    problem_free(&p);
}

static void test_read_misuse(void **state)
{
    (void)state;
    mha_kv_cache_config kc = {2, 1, 8, 10, MHA_KV_BF16, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float x[4 * 8], y[4 * 8];
    tu_fill(x, 4 * 8, 1, -1, 1);
    assert_int_equal(mha_kv_cache_append(kv, 0, x, x, 4), MHA_OK);
    assert_fails(mha_kv_cache_read(kv, 0, 2, 3, y, y), MHA_ERR_INVALID_ARGUMENT,
                 "tokens 2 .. 4 are not in sequence 0 of length 4");
    assert_fails(mha_kv_cache_read(kv, 2, 0, 1, y, y), MHA_ERR_INVALID_ARGUMENT,
                 "sequence 2");
    assert_fails(mha_kv_cache_read(kv, 0, -1, 1, y, y),
                 MHA_ERR_INVALID_ARGUMENT, "not in sequence");
    assert_fails(mha_kv_cache_read(kv, 0, 0, 1, NULL, NULL),
                 MHA_ERR_NULL_POINTER, "both NULL");
    assert_fails(mha_kv_cache_read(NULL, 0, 0, 1, y, y), MHA_ERR_NULL_POINTER,
                 "cache is NULL");
    assert_int_equal(mha_kv_cache_read(kv, 0, 1, 3, NULL, y), MHA_OK);
    for (int i = 0; i < 3 * 8; i++)
        assert_true(same_value(y[i], ref_bf16(x[8 + i])));
    assert_int_equal(mha_kv_cache_read(kv, 1, 0, 0, y, y), MHA_OK);
    mha_kv_cache_free(kv);
    /* A dtype that does not exist, and sizes that overflow. */
    kc.dtype = (mha_kv_dtype)5;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "dtype 5");
    kc.dtype = MHA_KV_Q8;
    kc.capacity = INT64_MAX / 2;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_OVERFLOW, "overflows");
    assert_null(kv);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_f32_exact),
        cmocka_unit_test(test_f16_rounding),
        cmocka_unit_test(test_bf16_rounding),
        cmocka_unit_test(test_q8_rounding),
        cmocka_unit_test(test_q4_rounding),
        cmocka_unit_test(test_rotation),
        cmocka_unit_test(test_attention_bitwise),
        cmocka_unit_test(test_half_queries),
        cmocka_unit_test(test_non_finite),
        cmocka_unit_test(test_truncation_keeps_flag),
        cmocka_unit_test(test_read_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
