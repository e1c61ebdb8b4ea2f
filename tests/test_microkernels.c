/*
 * test_microkernels.c -- the micro-kernel tables of src/kernels/ (scalar,
 * avx2, avx512 and neon, each where the CPU has it; one CTest entry per
 * tier)
 * against float64 loops computed here: awkward shapes and strides, canaries after every output buffer,
 * bitwise reproducibility across tile splits and alignments, the p == 0
 * contract of pv / pv_exact, qk_rows bitwise qk on the packed tile,
 * widen_t's q8 / q4 rows bitwise mha_v_load, softmax_rows bitwise its
 * contract from max and exp_sum, exp accuracy over a dense
 * sweep of [-88, 0],
 * and a small (unasserted) GFLOP/s print.
 */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime under -std=c11 */

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include "kernels/kernels.h"

/* The AVX2 and AVX-512 tables exist in x86 builds only, the NEON table
 * in aarch64 builds only (CMakeLists.txt). */
#if defined(__x86_64__) || defined(__i386__)
#define MHA_TEST_X86 1
#else
#define MHA_TEST_X86 0
#endif
#if defined(__aarch64__)
#define MHA_TEST_ARM 1
#else
#define MHA_TEST_ARM 0
#endif
#include "testutil.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- helpers --------------------------------------------------------------*/

#define GUARD 37                 /* canary floats after every output buffer */
static const uint32_t CANARY_BITS = 0x7fc0deadu;   /* a quiet NaN */

/* The documented bound of each tier's exp (docs/KERNELS.md). */
static double exp_ulp_bound(const mha_microkernels *k)
{
    return strcmp(k->name, "scalar") != 0 ? 2.0 : 1.0;   /* the SIMD tiers */
}

static uint64_t rng_state;
static void rng_seed(uint64_t s) { rng_state = s * 0x9E3779B97F4A7C15ull + 1; }
static uint32_t rng_u32(void)
{
    uint64_t x = rng_state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    rng_state = x;
    return (uint32_t)((x * 0x2545F4914F6CDD1Dull) >> 32);
}
/* Uniform in [lo, hi). */
static float rng_f(float lo, float hi)
{
    return lo + (hi - lo) * (float)((rng_u32() >> 8) * (1.0 / 16777216.0));
}

static float canary(void)
{
    float f;
    memcpy(&f, &CANARY_BITS, sizeof f);
    return f;
}
static int is_canary(float f)
{
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b == CANARY_BITS;
}

/* n floats followed by GUARD canaries; every float starts as a canary. */
static float *out_buf(size_t n)
{
    float *x = malloc((n + GUARD) * sizeof *x);
    assert_non_null(x);
    for (size_t i = 0; i < n + GUARD; i++)
        x[i] = canary();
    return x;
}
static void check_guard(const float *x, size_t n)
{
    for (size_t i = n; i < n + GUARD; i++)
        if (!is_canary(x[i]))
            fail_msg("write past the end of a buffer (%zu floats) at +%zu", n,
                     i - n);
}

/* Exactly n floats (reads past them are ASan / valgrind errors). */
static float *in_buf(size_t n)
{
    float *x = malloc((n ? n : 1) * sizeof *x);
    assert_non_null(x);
    return x;
}

static void fill(float *x, size_t n, float lo, float hi)
{
    for (size_t i = 0; i < n; i++)
        x[i] = rng_f(lo, hi);
}

static int same_bits(const float *a, const float *b, size_t n)
{
    return memcmp(a, b, n * sizeof *a) == 0;
}

static const int MRS[] = {1, 2, 3, 4, 5, 7, 8, 13, 64};
/* Every block path of both wide tiers: avx2 16 / 8 / masked tail, avx512
 * 64 / 32 / 16 / masked tail. */
static const int NCS[] = {1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 48, 63, 64};
static const int DHS[] = {1, 3, 8, 40, 64, 80, 128};
#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Rows of an mr x w matrix at stride ld: the padding between rows must stay
 * canary. */
static void check_padding(const float *x, int rows, int w, int ld)
{
    for (int r = 0; r < rows - 1; r++)
        for (int c = w; c < ld; c++)
            if (!is_canary(x[(size_t)r * ld + c]))
                fail_msg("write into the padding: row %d col %d (w %d, ld %d)",
                         r, c, w, ld);
}

/* ---- qk -------------------------------------------------------------------*/

static void run_qk_shape(const mha_microkernels *k, int mr, int nc, int dh)
{
    const int ldkt = nc + 3, lds = nc + 5;
    const size_t nq = (size_t)mr * dh;
    const size_t nkt = (size_t)(dh - 1) * ldkt + nc;
    const size_t ns = (size_t)(mr - 1) * lds + nc;
    float *q = in_buf(nq), *kt = in_buf(nkt), *s = out_buf(ns);
    fill(q, nq, -1.0f, 1.0f);
    fill(kt, nkt, -1.0f, 1.0f);

    k->qk(mr, nc, dh, q, kt, ldkt, s, lds);

    check_guard(s, ns);
    check_padding(s, mr, nc, lds);
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            double ref = 0.0, mag = 0.0;
            for (int d = 0; d < dh; d++) {
                const double t = (double)q[r * dh + d] * kt[d * ldkt + c];
                ref += t;
                mag += fabs(t);
            }
            const double got = s[(size_t)r * lds + c];
            const double tol = dh * ldexp(mag, -23) + 1e-30;
            if (!(fabs(got - ref) <= tol))
                fail_msg("%s qk mr=%d nc=%d dh=%d s[%d][%d] = %.9g, want %.9g "
                         "(tol %.3g)", k->name, mr, nc, dh, r, c, got, ref,
                         tol);
        }
    free(q);
    free(kt);
    free(s);
}

static void test_qk_shapes(void **state)
{
    const mha_microkernels *k = *state;
    rng_seed(11);
    for (int a = 0; a < COUNT(MRS); a++)
        for (int b = 0; b < COUNT(NCS); b++)
            for (int c = 0; c < COUNT(DHS); c++)
                run_qk_shape(k, MRS[a], NCS[b], DHS[c]);
}

/* Splitting the rows and the keys of a tile, and moving it in memory, gives
 * the same bits. */
static void test_qk_splits_bitwise(void **state)
{
    const mha_microkernels *k = *state;
    static const int dhs[] = {1, 3, 40, 64};
    static const int rsplit[] = {0, 1, 6, 7, 13, 19, 32, 33, 64};
    static const int csplit[] = {0, 3, 17, 24, 25, 57, 64};
    const int mr = 64, nc = 64, ldkt = 67, lds = 69;
    rng_seed(12);
    for (int t = 0; t < COUNT(dhs); t++) {
        const int dh = dhs[t];
        const size_t nq = (size_t)mr * dh, nkt = (size_t)dh * ldkt;
        const size_t ns = (size_t)mr * lds;
        float *q = in_buf(nq + 1), *kt = in_buf(nkt + 1);
        float *s = out_buf(ns), *s2 = out_buf(ns + 1);
        fill(q, nq + 1, -2.0f, 2.0f);
        fill(kt, nkt + 1, -2.0f, 2.0f);
        k->qk(mr, nc, dh, q, kt, ldkt, s, lds);

        for (int i = 0; i + 1 < COUNT(rsplit); i++)
            for (int j = 0; j + 1 < COUNT(csplit); j++) {
                const int r0 = rsplit[i], c0 = csplit[j];
                k->qk(rsplit[i + 1] - r0, csplit[j + 1] - c0, dh,
                      q + (size_t)r0 * dh, kt + c0, ldkt,
                      s2 + (size_t)r0 * lds + c0, lds);
            }
        for (int r = 0; r < mr; r++)
            assert_true(same_bits(s + (size_t)r * lds, s2 + (size_t)r * lds,
                                  nc));

        /* Every tile one float off its alignment. */
        memmove(q + 1, q, nq * sizeof *q);
        memmove(kt + 1, kt, nkt * sizeof *kt);
        for (size_t i = 0; i < ns + 1; i++)
            s2[i] = canary();
        k->qk(mr, nc, dh, q + 1, kt + 1, ldkt, s2 + 1, lds);
        check_guard(s2, ns + 1);
        for (int r = 0; r < mr; r++)
            assert_true(same_bits(s + (size_t)r * lds,
                                  s2 + 1 + (size_t)r * lds, nc));
        free(q);
        free(kt);
        free(s);
        free(s2);
    }
}

/* ---- pv / pv_exact --------------------------------------------------------*/

typedef void (*pv_fn)(int, int, int, const float *, int, const float *,
                      float *, int);

/* o, written by a pv over mr rows, against o0 + p v in float64, v [nc][dh]
 * the tile's values as floats: within nc + 1 roundings of float of the
 * terms' magnitudes; its guard and padding untouched. */
static void check_pv_f64(const char *tier, const char *what, int mr, int nc,
                         int dh, const float *p, int ldp, const float *v,
                         const float *o0, const float *o, size_t no, int ldo)
{
    check_guard(o, no);
    check_padding(o, mr, dh, ldo);
    for (int r = 0; r < mr; r++)
        for (int d = 0; d < dh; d++) {
            double ref = o0[(size_t)r * ldo + d];
            double mag = fabs(ref);
            for (int c = 0; c < nc; c++) {
                const double t = (double)p[(size_t)r * ldp + c] * v[c * dh + d];
                ref += t;
                mag += fabs(t);
            }
            const double got = o[(size_t)r * ldo + d];
            const double tol = (nc + 1) * ldexp(mag, -23) + 1e-30;
            if (!(fabs(got - ref) <= tol))
                fail_msg("%s %s mr=%d nc=%d dh=%d o[%d][%d] = %.9g, want %.9g "
                         "(tol %.3g)", tier, what, mr, nc, dh, r, d, got, ref,
                         tol);
        }
}

static void run_pv_shape(const mha_microkernels *k, int exact, int mr, int nc,
                         int dh)
{
    const pv_fn fn = exact ? k->pv_exact : k->pv;
    const int ldp = nc + 7, ldo = dh + 1;
    const size_t np = (size_t)(mr - 1) * ldp + nc;
    const size_t nv = (size_t)nc * dh;
    const size_t no = (size_t)(mr - 1) * ldo + dh;
    float *p = in_buf(np), *v = in_buf(nv), *o = out_buf(no);
    float *o0 = malloc(no * sizeof *o0);
    assert_non_null(o0);
    fill(p, np, 0.0f, 1.0f);
    for (size_t i = 0; i < np; i += 5)
        p[i] = 0.0f;                        /* some zero weights */
    fill(v, nv, -1.0f, 1.0f);
    for (int r = 0; r < mr; r++)
        for (int d = 0; d < dh; d++)
            o[(size_t)r * ldo + d] = rng_f(-4.0f, 4.0f);
    memcpy(o0, o, no * sizeof *o);

    fn(mr, nc, dh, p, ldp, v, o, ldo);

    check_pv_f64(k->name, exact ? "pv_exact" : "pv", mr, nc, dh, p, ldp, v,
                 o0, o, no, ldo);
    free(p);
    free(v);
    free(o);
    free(o0);
}

static void test_pv_shapes(void **state)
{
    const mha_microkernels *k = *state;
    rng_seed(21);
    for (int a = 0; a < COUNT(MRS); a++)
        for (int b = 0; b < COUNT(NCS); b++)
            for (int c = 0; c < COUNT(DHS); c++)
                run_pv_shape(k, 0, MRS[a], NCS[b], DHS[c]);
}

static void test_pv_exact_shapes(void **state)
{
    const mha_microkernels *k = *state;
    rng_seed(22);
    for (int a = 0; a < COUNT(MRS); a++)
        for (int b = 0; b < COUNT(NCS); b++)
            for (int c = 0; c < COUNT(DHS); c++)
                run_pv_shape(k, 1, MRS[a], NCS[b], DHS[c]);
}

/* pv_kv on a 16-bit value tile (a KV cache's f16 / bf16 rows, nc x dh)
 * against float64 on the values the tile holds: the stacked rows of a
 * grouped-query decode, whose blocking depends on the rows and the tile's
 * width (AVX-512: four rows against 65..128 columns go as two pairs); and
 * with a next tile given (16-bit tiles prefetch it), the same bits, of
 * pv_kv and of qk_kv on the same elements read as a key tile (dh x nc). */
static void run_pv_kv_half(const mha_microkernels *k, mha_kv_dtype dt, int mr,
                           int nc, int dh)
{
    const int ldp = nc + 7, ldo = dh + 1;
    const size_t np = (size_t)(mr - 1) * ldp + nc, nv = (size_t)nc * dh;
    const size_t no = (size_t)(mr - 1) * ldo + dh;
    float *p = in_buf(np), *o = out_buf(no), *vf = in_buf(nv);
    float *o0 = in_buf(no), *o1 = in_buf(no), *q = in_buf((size_t)mr * dh);
    float *s0 = in_buf((size_t)mr * nc), *s1 = in_buf((size_t)mr * nc);
    uint16_t *v = malloc(nv * sizeof *v), *next = malloc(nv * sizeof *next);
    assert_true(v && next);
    fill(p, np, 0.0f, 1.0f);
    for (size_t i = 0; i < nv; i++) {
        const float x = rng_f(-1.0f, 1.0f);
        v[i] = dt == MHA_KV_F16 ? mha_f16_from_float(x)
                                : mha_bf16_from_float(x);
        vf[i] = mha_kv_elem(dt, v, (int64_t)i);   /* the value it holds */
    }
    for (int r = 0; r < mr; r++)
        for (int d = 0; d < dh; d++)
            o[(size_t)r * ldo + d] = rng_f(-4.0f, 4.0f);
    memcpy(o0, o, no * sizeof *o);
    memcpy(o1, o, no * sizeof *o);
    k->pv_kv(dt, 0, mr, nc, dh, p, ldp, v, nc, NULL, o, ldo);
    check_pv_f64(k->name, dt == MHA_KV_F16 ? "pv_kv f16" : "pv_kv bf16", mr,
                 nc, dh, p, ldp, vf, o0, o, no, ldo);

    memcpy(next, v, nv * sizeof *v);
    k->pv_kv(dt, 0, mr, nc, dh, p, ldp, v, nc, next, o1, ldo);
    assert_memory_equal(o1, o, no * sizeof *o);
    fill(q, (size_t)mr * dh, -1.0f, 1.0f);
    k->qk_kv(dt, mr, nc, dh, q, v, nc, NULL, s0, nc);
    k->qk_kv(dt, mr, nc, dh, q, v, nc, next, s1, nc);
    assert_memory_equal(s0, s1, (size_t)mr * nc * sizeof *s0);
    free(p);
    free(o);
    free(vf);
    free(o0);
    free(o1);
    free(q);
    free(s0);
    free(s1);
    free(v);
    free(next);
}

static void test_pv_kv_half(void **state)
{
    const mha_microkernels *k = *state;
    static const int mrs[] = {1, 2, 3, 4, 5, 6, 8}, ncs[] = {1, 17, 63, 64},
                     dhs[] = {40, 72, 80, 128};
    static const mha_kv_dtype dts[] = {MHA_KV_F16, MHA_KV_BF16};
    rng_seed(23);
    for (int t = 0; t < COUNT(dts); t++)
        for (int a = 0; a < COUNT(mrs); a++)
            for (int b = 0; b < COUNT(ncs); b++)
                for (int c = 0; c < COUNT(dhs); c++)
                    run_pv_kv_half(k, dts[t], mrs[a], ncs[b], dhs[c]);
}

/*
 * pv_add (o += a tile's sum) is bitwise pv into a zeroed buffer followed by
 * one add per element, on every shape, plain and exact; for the exact form
 * value rows of NaN / Inf that only zero weights touch leave o finite.
 * (pv itself is checked against float64 above.)  Canaries after o and in
 * its row padding catch stray writes.
 */
static void test_pv_add_is_pv_then_add(void **state)
{
    const mha_microkernels *k = *state;
    rng_seed(25);
    for (int a = 0; a < COUNT(MRS); a++)
        for (int b = 0; b < COUNT(NCS); b++)
            for (int c = 0; c < COUNT(DHS); c++)
                for (int exact = 0; exact < 2; exact++) {
                    const int mr = MRS[a], nc = NCS[b], dh = DHS[c];
                    const int ldp = nc + 3, ldo = dh + 2;
                    const size_t np = (size_t)(mr - 1) * ldp + nc;
                    const size_t no = (size_t)(mr - 1) * ldo + dh;
                    float *p = in_buf(np), *v = in_buf((size_t)nc * dh);
                    float *o = out_buf(no), *sum = out_buf(no);
                    float *want = malloc(no * sizeof *want);
                    assert_non_null(want);
                    fill(p, np, -1.0f, 1.0f);
                    fill(v, (size_t)nc * dh, -1.0f, 1.0f);
                    for (size_t i = 0; i < np; i += 4)
                        p[i] = 0.0f;
                    if (exact) {
                        /* key nc/2: no row weighs it, and it is NaN / Inf */
                        for (int r = 0; r < mr; r++)
                            p[(size_t)r * ldp + nc / 2] = -0.0f;
                        for (int d = 0; d < dh; d++)
                            v[(nc / 2) * dh + d] = d & 1 ? NAN : -INFINITY;
                    }
                    for (int r = 0; r < mr; r++)
                        for (int d = 0; d < dh; d++) {
                            o[(size_t)r * ldo + d] = rng_f(-2.0f, 2.0f);
                            sum[(size_t)r * ldo + d] = 0.0f;
                        }
                    (exact ? k->pv_exact : k->pv)(mr, nc, dh, p, ldp, v, sum,
                                                  ldo);
                    for (int r = 0; r < mr; r++)
                        for (int d = 0; d < dh; d++)
                            want[(size_t)r * ldo + d] =
                                o[(size_t)r * ldo + d] +
                                sum[(size_t)r * ldo + d];
                    (exact ? k->pv_add_exact : k->pv_add)(mr, nc, dh, p, ldp,
                                                          v, o, ldo);
                    check_guard(o, no);
                    check_padding(o, mr, dh, ldo);
                    for (int r = 0; r < mr; r++) {
                        const float *got = o + (size_t)r * ldo;
                        if (!same_bits(got, want + (size_t)r * ldo, dh))
                            fail_msg("%s pv_add%s mr=%d nc=%d dh=%d: row %d "
                                     "is not pv then add", k->name,
                                     exact ? "_exact" : "", mr, nc, dh, r);
                        for (int d = 0; exact && d < dh; d++)
                            assert_true(isfinite(got[d]));
                    }
                    free(p);
                    free(v);
                    free(o);
                    free(sum);
                    free(want);
                }
}

/* Rows, keys and value dims split, tiles moved: the same bits; and for
 * finite v, pv == pv_exact bitwise even with many zero weights. */
/*
 * pvt (the backward's o += p^T x) is pv_add applied to p transposed, bit
 * for bit: the same products summed in the same order, then added.
 * Checked on every shape, plain and exact, with zero weights and (for the
 * exact form) NaN rows of x that only zero weights touch; the canaries
 * after o catch writes past its nc rows.
 */
static void test_pvt_is_pv_transposed(void **state)
{
    const mha_microkernels *k = *state;
    rng_seed(23);
    enum { LDP = 70 };
    for (int a = 0; a < COUNT(MRS); a++)
        for (int b = 0; b < COUNT(NCS); b++)
            for (int c = 0; c < COUNT(DHS); c++)
                for (int exact = 0; exact < 2; exact++) {
                    const int mr = MRS[a], nc = NCS[b], dh = DHS[c];
                    float *p = malloc(sizeof(float) * (size_t)mr * LDP);
                    float *pt = malloc(sizeof(float) * (size_t)nc * mr);
                    float *x = malloc(sizeof(float) * (size_t)mr * dh);
                    float *o1 = malloc(sizeof(float) * ((size_t)nc * dh + GUARD));
                    float *o2 = malloc(sizeof(float) * ((size_t)nc * dh + GUARD));
                    assert_non_null(p); assert_non_null(pt); assert_non_null(x);
                    assert_non_null(o1); assert_non_null(o2);
                    for (int r = 0; r < mr; r++) {
                        const int dead = exact && r % 3 == 1;  /* NaN row */
                        for (int j = 0; j < LDP; j++)
                            p[r * LDP + j] = dead || rng_u32() % 4 == 0
                                                 ? 0.0f : rng_f(-1, 1);
                        for (int d = 0; d < dh; d++)
                            x[r * dh + d] = dead ? NAN : rng_f(-2, 2);
                    }
                    for (int j = 0; j < nc; j++)
                        for (int r = 0; r < mr; r++)
                            pt[j * mr + r] = p[r * LDP + j];
                    for (int i = 0; i < nc * dh; i++)
                        o1[i] = o2[i] = rng_f(-1, 1);
                    for (int g = 0; g < GUARD; g++)
                        o1[nc * dh + g] = o2[nc * dh + g] = canary();
                    (exact ? k->pvt_exact : k->pvt)(mr, nc, dh, p, LDP, x, o1,
                                                    dh);
                    (exact ? k->pv_add_exact : k->pv_add)(nc, mr, dh, pt, mr,
                                                          x, o2, dh);
                    assert_memory_equal(o1, o2,
                                        sizeof(float) * ((size_t)nc * dh + GUARD));
                    for (int i = 0; exact && i < nc * dh; i++)
                        assert_false(isnan(o1[i]));
                    for (int g = 0; g < GUARD; g++)
                        assert_true(is_canary(o1[nc * dh + g]));
                    free(p); free(pt); free(x); free(o1); free(o2);
                }
}


static void test_pv_splits_bitwise(void **state)
{
    const mha_microkernels *k = *state;
    /* (200, 520: B over GEMM_BIG floats, walked in strips of columns) */
    static const int dhs[] = {1, 3, 40, 64, 80, 200, 520};
    static const int rsplit[] = {0, 5, 6, 13, 20, 45, 64};
    static const int csplit[] = {0, 1, 9, 31, 64};
    static const int dsplit[] = {0, 3, 11, 16, 35};   /* then up to dh */
    const int mr = 64, nc = 64, ldp = 65;
    rng_seed(23);
    for (int t = 0; t < COUNT(dhs); t++) {
        for (int exact = 0; exact < 2; exact++) {
            const pv_fn fn = exact ? k->pv_exact : k->pv;
            const int dh = dhs[t], ldo = dh + 3;
            const size_t np = (size_t)mr * ldp, nv = (size_t)nc * dh;
            const size_t no = (size_t)mr * ldo;
            float *p = in_buf(np + 1), *v = in_buf(nv + 1);
            float *o = out_buf(no), *o2 = out_buf(no + 1), *o3 = out_buf(no);
            float *vd = in_buf(nv);
            fill(p, np + 1, 0.0f, 1.0f);
            for (size_t i = 0; i < np; i++)
                if (rng_u32() % 3 == 0)
                    p[i] = (rng_u32() & 1) ? 0.0f : -0.0f;
            fill(v, nv + 1, -1.0f, 1.0f);
            for (int r = 0; r < mr; r++)
                for (int d = 0; d < dh; d++)
                    o[(size_t)r * ldo + d] = rng_f(-1.0f, 1.0f);
            memcpy(o2, o, no * sizeof *o);
            memcpy(o3, o, no * sizeof *o);
            fn(mr, nc, dh, p, ldp, v, o, ldo);

            /* rows x keys split: the fma chain per element is unchanged */
            for (int i = 0; i + 1 < COUNT(rsplit); i++)
                for (int j = 0; j + 1 < COUNT(csplit); j++) {
                    const int r0 = rsplit[i], c0 = csplit[j];
                    fn(rsplit[i + 1] - r0, csplit[j + 1] - c0, dh,
                       p + (size_t)r0 * ldp + c0, ldp, v + (size_t)c0 * dh,
                       o2 + (size_t)r0 * ldo, ldo);
                }
            for (int r = 0; r < mr; r++)
                assert_true(same_bits(o + (size_t)r * ldo,
                                      o2 + (size_t)r * ldo, dh));

            /* value dims split (v repacked per slice) */
            for (int i = 0; i < COUNT(dsplit) && dsplit[i] < dh; i++) {
                const int d0 = dsplit[i];
                const int d1 = (i + 1 < COUNT(dsplit) && dsplit[i + 1] < dh)
                                   ? dsplit[i + 1] : dh;
                const int w = d1 - d0;
                float *vs = in_buf((size_t)nc * w);
                for (int c = 0; c < nc; c++)
                    memcpy(vs + (size_t)c * w, v + (size_t)c * dh + d0,
                           (size_t)w * sizeof *v);
                fn(mr, nc, w, p, ldp, vs, o3 + d0, ldo);
                free(vs);
            }
            for (int r = 0; r < mr; r++)
                assert_true(same_bits(o + (size_t)r * ldo,
                                      o3 + (size_t)r * ldo, dh));

            /* the other of pv / pv_exact: same bits (v finite) */
            for (int r = 0; r < mr; r++)
                for (int d = 0; d < dh; d++)
                    o2[(size_t)r * ldo + d] = rng_f(-1.0f, 1.0f);
            memcpy(o3, o2, no * sizeof *o);
            fn(mr, nc, dh, p, ldp, v, o2, ldo);
            (exact ? k->pv : k->pv_exact)(mr, nc, dh, p, ldp, v, o3, ldo);
            for (int r = 0; r < mr; r++)
                assert_true(same_bits(o2 + (size_t)r * ldo,
                                      o3 + (size_t)r * ldo, dh));

            /* unaligned tiles */
            memmove(p + 1, p, np * sizeof *p);
            memmove(v + 1, v, nv * sizeof *v);
            memcpy(vd, v + 1, nv * sizeof *v);
            for (size_t i = 0; i < no + 1 + GUARD; i++)
                o2[i] = canary();
            for (int r = 0; r < mr; r++)
                for (int d = 0; d < dh; d++)
                    o2[1 + (size_t)r * ldo + d] = o3[(size_t)r * ldo + d] =
                        rng_f(-1.0f, 1.0f);
            fn(mr, nc, dh, p + 1, ldp, v + 1, o2 + 1, ldo);
            fn(mr, nc, dh, p + 1, ldp, vd, o3, ldo);
            check_guard(o2, no + 1);
            for (int r = 0; r < mr; r++)
                assert_true(same_bits(o3 + (size_t)r * ldo,
                                      o2 + 1 + (size_t)r * ldo, dh));
            free(p);
            free(v);
            free(vd);
            free(o);
            free(o2);
            free(o3);
        }
    }
}

/* NaN / Inf in value rows that some query rows weigh 0: those query rows
 * stay finite and equal pv with the rows zeroed; the others get NaN. */
static void test_pv_exact_nonfinite(void **state)
{
    const mha_microkernels *k = *state;
    static const int dhs[] = {1, 3, 8, 40, 64};
    static const int ncs[] = {1, 7, 9, 16, 33};
    rng_seed(24);
    for (int a = 0; a < COUNT(dhs); a++)
        for (int b = 0; b < COUNT(ncs); b++) {
            const int mr = 13, nc = ncs[b], dh = dhs[a];
            const int ldp = nc + 2, ldo = dh + 5;
            const size_t np = (size_t)(mr - 1) * ldp + nc;
            const size_t nv = (size_t)nc * dh;
            const size_t no = (size_t)(mr - 1) * ldo + dh;
            float *p = in_buf(np), *v = in_buf(nv), *vz = in_buf(nv);
            float *o = out_buf(no), *oz = out_buf(no);
            fill(p, np, 0.1f, 1.0f);
            fill(v, nv, -1.0f, 1.0f);
            memcpy(vz, v, nv * sizeof *v);
            const int bad = nc / 2;             /* the non-finite key */
            for (int d = 0; d < dh; d++) {
                v[bad * dh + d] = (d % 3 == 0) ? NAN
                                  : (d % 3 == 1) ? INFINITY : -INFINITY;
                vz[bad * dh + d] = 0.0f;
            }
            /* rows r % 3 == 0 weigh the bad key; the others give it 0 */
            for (int r = 0; r < mr; r++)
                if (r % 3 != 0)
                    p[(size_t)r * ldp + bad] = (r & 1) ? 0.0f : -0.0f;
            for (int r = 0; r < mr; r++)
                for (int d = 0; d < dh; d++)
                    o[(size_t)r * ldo + d] = oz[(size_t)r * ldo + d] =
                        rng_f(-1.0f, 1.0f);
            k->pv_exact(mr, nc, dh, p, ldp, v, o, ldo);
            k->pv(mr, nc, dh, p, ldp, vz, oz, ldo);
            check_guard(o, no);
            check_padding(o, mr, dh, ldo);
            for (int r = 0; r < mr; r++) {
                const float *orow = o + (size_t)r * ldo;
                if (r % 3 != 0) {
                    for (int d = 0; d < dh; d++)
                        assert_true(isfinite(orow[d]));
                    assert_true(same_bits(orow, oz + (size_t)r * ldo, dh));
                } else {
                    for (int d = 0; d < dh; d++)
                        assert_false(isfinite(orow[d]));
                }
            }
            free(p);
            free(v);
            free(vz);
            free(o);
            free(oz);
        }
}

/* ---- exp_sum --------------------------------------------------------------*/

/* The distance |y - e| in units of the float ulp at e (2^-149 below
 * FLT_MIN). */
static double ulp_err(float y, double e)
{
    double ulp;
    if (e < FLT_MIN) {
        ulp = ldexp(1.0, -149);
    } else {
        int ex;
        frexp(e, &ex);
        ulp = ldexp(1.0, ex - 24);
    }
    return fabs((double)y - e) / ulp;
}

static void test_exp_accuracy(void **state)
{
    const mha_microkernels *k = *state;
    const double bound = exp_ulp_bound(k);
    const int flushes = strcmp(k->name, "scalar") != 0;   /* docs/KERNELS.md */
    enum { N = 1 << 20, CH = 61 };   /* 61: calls end in a tail */
    float *x = in_buf(N), *in = in_buf(N);
    for (int i = 0; i < N; i++)
        in[i] = x[i] = (float)(-88.0 * i / (N - 1));
    /* and every float around ln FLT_MIN, where the flushing starts */
    float t = -87.3366f;
    for (int i = 0; i < 64; i++, t = nextafterf(t, 0.0f))
        in[i] = x[i] = t;
    double max_ulp = 0.0, max_rel = 0.0;
    float worst = 0.0f;
    int flushed = 0;
    for (int i = 0; i < N; i += CH)
        k->exp_sum(x + i, N - i < CH ? N - i : CH, 0.0f);
    for (int i = 0; i < N; i++) {
        const double e = exp((double)in[i]);
        if (flushes) {
            /* avx2, avx512: exactly the results below FLT_MIN are 0, no
             * denormal */
            if (e < FLT_MIN) {
                if (x[i] != 0.0f)
                    fail_msg("%s exp(%.9g) = %a, want 0 (flushed)", k->name,
                             in[i], x[i]);
                flushed++;
                continue;
            }
            assert_true(x[i] >= FLT_MIN);
        }
        const double u = ulp_err(x[i], e);
        if (u > max_ulp) {
            max_ulp = u;
            worst = in[i];
        }
        if (e >= FLT_MIN && fabs(x[i] - e) / e > max_rel)
            max_rel = fabs(x[i] - e) / e;
        if (!(u <= bound))
            fail_msg("%s exp(%.9g) = %.9g, want %.9g (%.3f ulp > %.1f)",
                     k->name, in[i], x[i], e, u, bound);
    }
    printf("[ %s ] exp over %d points of [-88, 0]: max %.4f ulp (at %.7g), "
           "max rel %.3g, %d flushed to 0\n", k->name, N, max_ulp, worst,
           max_rel, flushed);

    /* x - m with m != 0: the argument is the float difference */
    rng_seed(31);
    for (int i = 0; i < 4096; i++)
        in[i] = x[i] = rng_f(-30.0f, 3.5f);
    k->exp_sum(x, 4096, 3.5f);
    for (int i = 0; i < 4096; i++) {
        const double e = exp((double)(in[i] - 3.5f));
        assert_true(ulp_err(x[i], e) <= bound);
    }
    free(x);
    free(in);
}

/* softcap: c tanh(x / c) within 8 ulp of the float64 value (of the
 * argument the kernel forms, x * (1/c) with 1/c rounded to float), on
 * magnitudes from 1e-30 to 1e4 of both signs, in calls of 61 (tails);
 * dcap = 1 - tanh^2 within 2^-22; +-Inf -> +-c, NaN -> NaN, -0 -> -0. */
static void test_softcap(void **state)
{
    const mha_microkernels *k = *state;
    enum { N = 1 << 16, CH = 61 };
    static const float caps[] = {0.5f, 1.0f, 30.0f};
    float *x = in_buf(N), *in = in_buf(N), *dc = out_buf(N);
    for (int ci = 0; ci < COUNT(caps); ci++) {
        const float c = caps[ci], inv = 1.0f / c;
        for (int i = 0; i < N; i++) {
            const double mag = pow(10.0, -30.0 + 34.0 * (i / 2) / (N / 2));
            in[i] = x[i] = (float)(i % 2 ? -mag : mag);
        }
        for (int i = 0; i < N; i += CH)
            k->softcap(x + i, N - i < CH ? N - i : CH, c, dc + i);
        check_guard(dc, N);
        double worst = 0.0;
        for (int i = 0; i < N; i++) {
            const double t = tanh((double)in[i] * (double)inv);
            const double u = ulp_err(fabsf(x[i]), fabs(c * t));
            worst = u > worst ? u : worst;
            if (!(u <= 4.0) || (x[i] < 0) != (in[i] < 0))
                fail_msg("%s softcap(%.9g, c=%g) = %.9g, want %.9g (%.2f ulp)",
                         k->name, (double)in[i], (double)c, (double)x[i],
                         c * t, u);
            if (!(fabs(dc[i] - (1.0 - t * t)) <= 0x1p-22))
                fail_msg("%s softcap'(%.9g, c=%g) = %.9g, want %.9g", k->name,
                         (double)in[i], (double)c, (double)dc[i], 1.0 - t * t);
        }
        print_message("%s softcap c=%g: worst %.2f ulp\n", k->name, (double)c,
                      worst);
    }
    const float sp[5] = {INFINITY, -INFINITY, NAN, -0.0f, 0.0f};
    float y[5];
    memcpy(y, sp, sizeof y);
    k->softcap(y, 5, 2.0f, NULL);
    assert_true(y[0] == 2.0f && y[1] == -2.0f && isnan(y[2]));
    assert_true(y[3] == 0.0f && signbit(y[3]) && y[4] == 0.0f &&
                !signbit(y[4]));
    free(x);
    free(in);
    free(dc);
}

static void test_exp_special(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {1, 5, 8, 9, 16, 19, 27};
    for (int t = 0; t < COUNT(ns); t++) {
        const int n = ns[t];
        float *x = out_buf((size_t)n);
        for (int pos = 0; pos < n; pos++) {
            /* one special value at each position, vector lane or tail */
            for (int kind = 0; kind < 4; kind++) {
                for (int i = 0; i < n; i++)
                    x[i] = -1.0f - 0.25f * i;
                const float m = 2.0f;
                x[pos] = kind == 0 ? -INFINITY
                       : kind == 1 ? NAN
                       : kind == 2 ? m : -1e30f;
                const float sum = k->exp_sum(x, n, m);
                check_guard(x, (size_t)n);
                switch (kind) {
                case 0: assert_true(x[pos] == 0.0f && !signbit(x[pos])); break;
                case 1: assert_true(isnan(x[pos]) && isnan(sum)); break;
                case 2: assert_true(x[pos] == 1.0f); break;
                default: assert_true(x[pos] == 0.0f); break;
                }
                if (kind != 1) {
                    double ref = 0.0;
                    for (int i = 0; i < n; i++)
                        ref += x[i];
                    assert_true(fabs(sum - ref) <= n * ldexp(ref, -24));
                }
            }
        }
        free(x);
    }
    /* very negative arguments: 0 */
    float y[9] = {-87.5f, -88.0f, -100.0f, -103.9f, -104.0f, -150.0f, -1e10f,
                  -FLT_MAX, -INFINITY};
    k->exp_sum(y, 9, 0.0f);
    for (int i = 0; i < 9; i++)
        assert_true(y[i] >= 0.0f && y[i] < FLT_MIN);
    /* n == 0: nothing read or written, sum 0 */
    assert_true(k->exp_sum(y, 0, 0.0f) == 0.0f);
}

/* Sum of the outputs, and the same values whatever the alignment. */
static void test_exp_sum_order(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {1, 3, 8, 17, 64, 100, 1000};
    rng_seed(32);
    for (int t = 0; t < COUNT(ns); t++) {
        const int n = ns[t];
        float *a = out_buf((size_t)n + 1), *b = out_buf((size_t)n + 1);
        fill(a, (size_t)n, -20.0f, 0.0f);
        memcpy(b + 1, a, (size_t)n * sizeof *a);
        const float sa = k->exp_sum(a, n, 0.5f);
        const float sb = k->exp_sum(b + 1, n, 0.5f);
        check_guard(a, (size_t)n + 1);
        check_guard(b, (size_t)n + 1);
        assert_true(is_canary(b[0]));
        assert_true(same_bits(a, b + 1, (size_t)n));
        assert_true(sa == sb);
        double ref = 0.0;
        for (int i = 0; i < n; i++)
            ref += a[i];
        assert_true(fabs(sa - ref) <= n * ldexp(ref, -24));
        free(a);
        free(b);
    }
    /* one element per call vs all at once: the same values */
    float x[40], y[40];
    fill(x, 40, -30.0f, 0.0f);
    memcpy(y, x, sizeof x);
    k->exp_sum(x, 40, 0.0f);
    for (int i = 0; i < 40; i++)
        k->exp_sum(y + i, 1, 0.0f);
    assert_true(same_bits(x, y, 40));
}

/* A lane's exp does not depend on its neighbours: the vector tiers take a
 * fast path when every lane of a vector is within |x| <= 86 and a general
 * one otherwise (docs/KERNELS.md); both must give the same bits.  Each
 * value of [-86.5, 86.5] alone (a one-element call) against the same
 * value beside a lane that forces the general path (-inf, NaN, +-100) in
 * every position of a 16-wide group. */
static void test_exp_lanes_apart(void **state)
{
    const mha_microkernels *k = *state;
    enum { N = 4096, G = 16 };
    static const float odd[] = {-INFINITY, NAN, 100.0f, -100.0f};
    float *alone = out_buf(N), *mixed = out_buf(N);
    rng_seed(41);
    fill(alone, N, -86.5f, 86.5f);
    alone[0] = -86.0f;
    alone[1] = 86.0f;
    alone[2] = 0.0f;
    alone[3] = nextafterf(86.0f, 100.0f);
    memcpy(mixed, alone, N * sizeof *alone);
    for (int i = 0; i < N; i++)
        k->exp_sum(alone + i, 1, 0.0f);
    for (int i = 0; i < N; i++)
        if (i % G == (i / G) % G)
            mixed[i] = odd[(i / G) % COUNT(odd)];
    k->exp_sum(mixed, N, 0.0f);
    check_guard(alone, N);
    check_guard(mixed, N);
    for (int i = 0; i < N; i++) {
        if (i % G == (i / G) % G)
            continue;
        uint32_t a, b;
        memcpy(&a, alone + i, 4);
        memcpy(&b, mixed + i, 4);
        if (a != b)
            fail_msg("%s exp lane %d: %a alone, %a beside a special lane",
                     k->name, i, alone[i], mixed[i]);
    }
    free(alone);
    free(mixed);
}

/* ---- scale ----------------------------------------------------------------*/

static void test_scale(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {0, 1, 7, 8, 9, 31, 32, 33, 100};
    rng_seed(41);
    for (int t = 0; t < COUNT(ns); t++)
        for (int off = 0; off < 2; off++) {
            const int n = ns[t];
            float *x = out_buf((size_t)n + 1);
            fill(x + off, (size_t)n, -3.0f, 3.0f);
            float *ref = in_buf((size_t)n);
            const float a = 0.3767f;
            for (int i = 0; i < n; i++)
                ref[i] = x[off + i] * a;
            k->scale(x + off, x + off, n, a);
            check_guard(x, (size_t)n + 1);
            if (off)
                assert_true(is_canary(x[0]));
            else
                assert_true(is_canary(x[n]));
            assert_true(same_bits(x + off, ref, (size_t)n));
            free(x);
            free(ref);
        }
}

/* copy_finite: an exact copy whatever it holds, and "finite" exactly when
 * no element of the n is NaN or +-Inf (the one planted at each position
 * in turn, the tails of every width included). */
static void test_copy_finite(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {1, 7, 8, 9, 16, 17, 31, 33, 64};
    const float odd[] = {NAN, INFINITY, -INFINITY};
    rng_seed(43);
    for (int t = 0; t < COUNT(ns); t++) {
        const int n = ns[t];
        float *src = in_buf((size_t)n + 1);
        float *dst = out_buf((size_t)n);
        fill(src, (size_t)n, -1e38f, 1e38f);   /* (hi - lo finite) */
        src[n] = NAN;   /* past the end: never read as part of the n */
        assert_int_equal(k->copy_finite(dst, src, n), 1);
        assert_true(same_bits(dst, src, (size_t)n));
        check_guard(dst, (size_t)n);
        for (int at = 0; at < n; at++) {
            const float keep = src[at];
            src[at] = odd[at % COUNT(odd)];
            assert_int_equal(k->copy_finite(dst, src, n), 0);
            assert_true(same_bits(dst, src, (size_t)n));
            src[at] = keep;
        }
        free(src);
        free(dst);
    }
}

/* amax, the input scans: over rows of every width (tails, ld gaps), the
 * largest finite |x| equal to a plain loop's with fabsf and isfinite (a
 * max: exact, the same float in every tier), and the flag.  Values from
 * subnormal to near FLT_MAX, -0; the gaps between rows hold NaN and
 * 3e38, never read; a NaN, +Inf or -Inf at each place in turn clears the
 * flag and leaves the max of the others; all non-finite: max 0. */
static float amax_plain(const float *x, int rows, int cols, int ld,
                        int *finite)
{
    float m = 0.0f;
    *finite = 1;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < cols; c++) {
            const float v = x[(size_t)r * ld + c];
            if (!isfinite(v))
                *finite = 0;
            else if (fabsf(v) > m)
                m = fabsf(v);
        }
    return m;
}

static void test_amax(void **state)
{
    const mha_microkernels *k = *state;
    static const int rs[] = {1, 2, 5};
    static const int cs[] = {1, 7, 15, 16, 17, 31, 32, 33, 64, 100, 200};
    const float odd[] = {NAN, INFINITY, -INFINITY};
    rng_seed(47);
    for (int ri = 0; ri < COUNT(rs); ri++)
        for (int ci = 0; ci < COUNT(cs); ci++)
            for (int gap = 0; gap <= 3; gap += 3) {
                const int rows = rs[ri], cols = cs[ci], ld = cols + gap;
                const size_t n = (size_t)(rows - 1) * ld + cols;
                float *x = in_buf(n);
                for (size_t i = 0; i < n; i++) {
                    /* magnitudes 2^-140 .. 2^126, either sign */
                    const float e = rng_f(-140.0f, 126.0f);
                    x[i] = ldexpf(rng_f(1.0f, 1.99f), (int)e) *
                           (rng_u32() & 1 ? -1.0f : 1.0f);
                    if (i % ld >= (size_t)cols)   /* a gap: never read */
                        x[i] = i % 2 ? NAN : 3e38f;
                }
                x[n / 2 - n / 2 % ld] = -0.0f;
                int fin = -1, want_fin;
                float want = amax_plain(x, rows, cols, ld, &want_fin);
                float got = k->amax(x, rows, cols, ld, &fin);
                assert_int_equal(want_fin, 1);
                assert_int_equal(fin, 1);
                if (!same_bits(&got, &want, 1))
                    fail_msg("amax %d x %d ld %d: %a, want %a", rows, cols,
                             ld, got, want);
                for (size_t at = 0; at < n; at++) {
                    if (at % ld >= (size_t)cols)
                        continue;
                    const float keep = x[at];
                    x[at] = odd[at % COUNT(odd)];
                    want = amax_plain(x, rows, cols, ld, &want_fin);
                    got = k->amax(x, rows, cols, ld, &fin);
                    assert_int_equal(fin, 0);
                    if (!same_bits(&got, &want, 1))
                        fail_msg("amax %d x %d with %g at %zu: %a, want %a",
                                 rows, cols, x[at], at, got, want);
                    x[at] = keep;
                }
                for (size_t i = 0; i < n; i++)
                    x[i] = odd[i % COUNT(odd)];
                got = k->amax(x, rows, cols, ld, &fin);
                assert_int_equal(fin, 0);
                assert_true(got == 0.0f);
                free(x);
            }
}

/* widen_t: key rows of every dtype into the transposed kt tile and the
 * value rows, each element the float it stands for (bitwise), tails of
 * every width; with kt NULL the rows alone; nothing written past either
 * output, nothing read past the rows (in_buf: exactly their bytes). */
static void test_widen_t(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {1, 4, 15, 16, 17, 33, 64};
    static const int dhs[] = {1, 7, 16, 40, 64, 576};
    const mha_kv_dtype dts[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16};
    rng_seed(47);
    for (int t = 0; t < COUNT(dts); t++)
        for (int i = 0; i < COUNT(ns); i++)
            for (int j = 0; j < COUNT(dhs); j++) {
                const mha_kv_dtype dt = dts[t];
                const int n = ns[i], dh = dhs[j], ldx = dh + 5;
                const int dv = dh > 3 ? dh - 3 : dh, ldkt = n + 2;
                const size_t nx = (size_t)(n - 1) * ldx + dh;
                void *x = in_buf(dt == MHA_KV_F32 ? nx : (nx + 1) / 2);
                for (size_t e = 0; e < nx; e++) {
                    const float f = rng_f(-3.0f, 3.0f);
                    if (dt == MHA_KV_F32)
                        ((float *)x)[e] = f;
                    else
                        ((uint16_t *)x)[e] = dt == MHA_KV_F16
                                                 ? mha_f16_from_float(f)
                                                 : mha_bf16_from_float(f);
                }
                const size_t nkt = (size_t)dh * ldkt, nv = (size_t)n * dv;
                float *kt = out_buf(nkt), *v = out_buf(nv);
                float *rows = out_buf((size_t)n * dh);
                k->widen_t(dt, x, ldx, n, dh, kt, ldkt, v, dv);
                k->widen_t(dt, x, ldx, n, dh, NULL, 0, rows, dh);
                for (int c = 0; c < n; c++)
                    for (int d = 0; d < dh; d++) {
                        const float e =
                            mha_kv_elem(dt, x, (int64_t)c * ldx + d);
                        assert_true(same_bits(&kt[(size_t)d * ldkt + c], &e,
                                              1));
                        assert_true(same_bits(&rows[(size_t)c * dh + d], &e,
                                              1));
                        if (d < dv)
                            assert_true(
                                same_bits(&v[(size_t)c * dv + d], &e, 1));
                    }
                for (int d = 0; d < dh; d++)   /* the padding untouched */
                    for (int c = n; c < ldkt; c++)
                        assert_true(is_canary(kt[(size_t)d * ldkt + c]));
                check_guard(kt, nkt);
                check_guard(v, nv);
                check_guard(rows, (size_t)n * dh);
                free(x), free(kt), free(v), free(rows);
            }
}

/* narrow: floats (times a multiplier or not) rounded into bf16 and f16,
 * the bits of half.h's conversions (which test_kv_dtype holds to
 * independent roundings) for every element: ties both ways, f16's
 * largest finite value and the first that rounds to Inf, its subnormals
 * and the halfway points below them, float subnormals, +-0, +-Inf, quiet
 * and signalling NaN with payloads, and random values of every
 * magnitude; at lengths through each vector tail; nothing written past
 * n. */
static void test_narrow(void **state)
{
    const mha_microkernels *k = *state;
    static const uint32_t special[] = {
        0x00000000u, 0x80000000u, 0x3f800000u, 0xbf800000u,
        0x3f801000u, 0x3f803000u, 0x3f800001u, 0x3f808000u, /* ties */
        0x3f818000u, 0x3f817fffu, 0x477fe000u, 0x477fefffu, /* 65504 .. */
        0x477ff000u, 0xc77ff000u, 0x7f7fffffu, 0xff7fffffu, /* -> Inf */
        0x33800000u, 0x33000000u, 0x33000001u, 0x33c00000u, /* 2^-24 .. */
        0x38800000u, 0x387fc000u, 0x387fe000u, 0x387ff000u, /* 2^-14 .. */
        0x00000001u, 0x807fffffu, 0x00400000u,              /* subnormal */
        0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc12345u, /* Inf, NaN */
        0x7f800001u, 0x7fa5a5a5u, 0xff80e001u, 0x7fffffffu};
    static const int ns[] = {1, 3, 4, 7, 8, 15, 16, 17, 33, 64, 100};
    static const float mults[] = {0.125f, 3.7f};
    enum { N = 100 };
    float x[N];
    rng_seed(53);
    for (int round = 0; round < 40; round++) {
        for (int i = 0; i < N; i++) {
            const int s = i + round * 7;
            if (round % 2 == 0 && s % 3 == 0) {
                const uint32_t b = special[s / 3 % COUNT(special)];
                memcpy(&x[i], &b, sizeof b);
            } else {   /* magnitudes 2^-30 .. 2^20, either sign */
                x[i] = ldexpf(rng_f(1.0f, 2.0f), (int)(rng_u32() % 51) - 30);
                x[i] = rng_u32() % 2 ? -x[i] : x[i];
            }
        }
        for (int bf = 0; bf < 2; bf++)
            for (int m = -1; m < COUNT(mults); m++)
                for (int j = 0; j < COUNT(ns); j++) {
                    const int n = ns[j];
                    const float *mult = m < 0 ? NULL : &mults[m];
                    uint16_t y[N + 8];
                    for (int i = 0; i < N + 8; i++)
                        y[i] = 0xA5A5u;
                    k->narrow(bf, x, n, mult, y);
                    for (int i = 0; i < n; i++) {
                        const float v = mult ? x[i] * *mult : x[i];
                        const uint16_t want = bf ? mha_bf16_from_float(v)
                                                 : mha_f16_from_float(v);
                        if (y[i] != want)
                            fail_msg("%s, n %d, x[%d] = %a (times %a): 0x%04x, "
                                     "half.h 0x%04x", bf ? "bf16" : "f16",
                                     n, i, (double)x[i],
                                     mult ? (double)*mult : 1.0,
                                     (unsigned)y[i], (unsigned)want);
                    }
                    for (int i = n; i < N + 8; i++)
                        assert_int_equal(y[i], 0xA5A5u);
                }
    }
}

/* widen_t's rows of a q8 or q4 tile (kt NULL; a latent cache's tile):
 * each code times its block's scale, the bits of mha_v_load, for widths
 * below, at and past the vector tails; nothing written past dv. */
static void test_widen_rows_quantised(void **state)
{
    const mha_microkernels *k = *state;
    static const int dhs[] = {2, 32, 40, 64, 96, 576};
    const mha_kv_dtype dts[] = {MHA_KV_Q8, MHA_KV_Q4};
    rng_seed(53);
    for (int t = 0; t < COUNT(dts); t++)
        for (int j = 0; j < COUNT(dhs); j++) {
            const mha_kv_dtype dt = dts[t];
            const int n = 64, dh = dhs[j], dv = dh > 4 ? dh - 2 : dh;
            const int64_t sb = mha_q8_scale_bytes(n, dh);
            const int64_t cb = dt == MHA_KV_Q8 ? (int64_t)n * dh
                                               : (int64_t)n * dh / 2;
            unsigned char *buf = malloc((size_t)(sb + cb));
            assert_non_null(buf);
            float *sc = (float *)buf;   /* the scales, then the codes */
            for (int64_t i = 0; i < sb / 4; i++)
                sc[i] = rng_f(0.001f, 0.1f);
            for (int64_t i = 0; i < cb; i++)   /* any byte: both nibbles */
                buf[sb + i] = (unsigned char)(rng_u32() >> 24);
            const void *x = buf + sb;
            float *v = out_buf((size_t)n * dv);
            k->widen_t(dt, x, dh, n, dh, NULL, 0, v, dv);
            for (int c = 0; c < n; c++)
                for (int d = 0; d < dv; d++) {
                    const float e = mha_v_load(dt, x, n, dh, c, d);
                    if (!same_bits(&v[(size_t)c * dv + d], &e, 1))
                        fail_msg("%s %s dh %d: row %d element %d is %g, "
                                 "mha_v_load %g", k->name,
                                 dt == MHA_KV_Q8 ? "q8" : "q4", dh, c, d,
                                 (double)v[(size_t)c * dv + d], (double)e);
                }
            check_guard(v, (size_t)n * dv);
            free(buf), free(v);
        }
}

/* qk_rows on keys where they lie (rows ldk apart) is bitwise qk on the
 * packed kt tile of the same keys, for row counts, key counts and widths
 * across the slabs and the vector tails. */
static void test_qk_rows_is_qk(void **state)
{
    const mha_microkernels *k = *state;
    static const int mrs[] = {1, 4, 7, 64};
    static const int ncs[] = {1, 15, 16, 33, 64};
    static const int dhs[] = {3, 64, 65, 128, 200, 576};
    rng_seed(59);
    for (int a = 0; a < COUNT(mrs); a++)
        for (int b = 0; b < COUNT(ncs); b++)
            for (int c = 0; c < COUNT(dhs); c++) {
                const int mr = mrs[a], nc = ncs[b], dh = dhs[c];
                const int ldk = dh + 3, lds = nc + 1;
                float *q = in_buf((size_t)mr * dh);
                float *key = in_buf((size_t)(nc - 1) * ldk + dh);
                float *kt = in_buf((size_t)dh * nc);
                fill(q, (size_t)mr * dh, -2.0f, 2.0f);
                fill(key, (size_t)(nc - 1) * ldk + dh, -2.0f, 2.0f);
                for (int j = 0; j < nc; j++)
                    for (int d = 0; d < dh; d++)
                        kt[(size_t)d * nc + j] = key[(size_t)j * ldk + d];
                float *s1 = out_buf((size_t)mr * lds);
                float *s2 = out_buf((size_t)mr * lds);
                k->qk(mr, nc, dh, q, kt, nc, s1, lds);
                k->qk_rows(mr, nc, dh, q, key, ldk, s2, lds);
                for (int r = 0; r < mr; r++)
                    if (!same_bits(s1 + (size_t)r * lds, s2 + (size_t)r * lds,
                                   (size_t)nc))
                        fail_msg("%s: qk_rows differs from qk (mr %d, nc "
                                 "%d, dh %d, row %d)", k->name, mr, nc, dh,
                                 r);
                check_guard(s2, (size_t)mr * lds);
                free(q), free(key), free(kt), free(s1), free(s2);
            }
}

/* max: the largest value, NaN ignored, -inf when nothing is larger. */
static void test_max(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {0, 1, 7, 8, 9, 31, 32, 33, 64, 100};
    rng_seed(43);
    for (int t = 0; t < COUNT(ns); t++)
        for (int off = 0; off < 2; off++) {
            const int n = ns[t];
            float *x = in_buf((size_t)n + 1);
            fill(x + off, (size_t)n, -3.0f, 3.0f);
            float want = -INFINITY;
            for (int i = 0; i < n; i++) {
                if (i % 5 == 2)
                    x[off + i] = NAN;
                else if (x[off + i] > want)
                    want = x[off + i];
            }
            const float got = k->max(x + off, n);
            if (!(got == want))
                fail_msg("%s max, n=%d off=%d: %g, expected %g", k->name, n,
                         off, (double)got, (double)want);
            free(x);
        }
    float all_inf[9] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY,
                        -INFINITY, -INFINITY, -INFINITY, -INFINITY, NAN};
    assert_true(k->max(all_inf, 9) == -INFINITY);
}

/* softmax_rows: bit for bit its contract (kernels.h) composed of the
 * same table's max and exp_sum and scalar steps, for every mr up to
 * MHA_UK_ROWS (whole and partial groups of rows) and widths with and
 * without a tail; running maxima that hold, move, are -inf (nothing
 * yet) or NaN; rows all -inf (nothing live: left alone, alpha -1), rows
 * holding NaN or masked keys, scores far below the max (exp's general
 * path). */
static void test_softmax_rows(void **state)
{
    const mha_microkernels *k = *state;
    static const int ncs[] = {1, 5, 8, 16, 17, 40, 64};
    enum { LDS = 72 };
    rng_seed(47);
    for (int mr = 1; mr <= MHA_UK_ROWS; mr += mr < 20 ? 1 : 7)
        for (int t = 0; t < COUNT(ncs); t++) {
            const int nc = ncs[t];
            float *s = in_buf((size_t)mr * LDS), *s2 = in_buf((size_t)mr * LDS);
            float m[MHA_UK_ROWS], l[MHA_UK_ROWS], m2[MHA_UK_ROWS],
                l2[MHA_UK_ROWS], al2[MHA_UK_ROWS];
            float *al = out_buf((size_t)mr);
            fill(s, (size_t)mr * LDS, -4.0f, 4.0f);
            for (int r = 0; r < mr; r++) {
                float *x = s + (size_t)r * LDS;
                switch (r % 7) {
                case 0: m[r] = -INFINITY; l[r] = 0.0f; break;   /* first */
                case 1: m[r] = 10.0f; l[r] = 3.0f; break;       /* holds */
                case 2: m[r] = -1.5f; l[r] = 2.5f; break;       /* moves */
                case 3: m[r] = NAN; l[r] = NAN; break;          /* NaN   */
                case 4:   /* nothing live */
                    m[r] = r % 2 ? -INFINITY : 1.0f;
                    l[r] = r % 2 ? 0.0f : 1.0f;
                    for (int c = 0; c < nc; c++)
                        x[c] = -INFINITY;
                    break;
                case 5:   /* masked keys, a NaN, one far below */
                    m[r] = -INFINITY; l[r] = 0.0f;
                    x[0] = -INFINITY;
                    x[nc / 2] = NAN;
                    x[nc - 1] = -200.0f;
                    break;
                default: m[r] = 0.25f; l[r] = 1.0f; break;
                }
            }
            memcpy(s2, s, (size_t)mr * LDS * sizeof *s);
            memcpy(m2, m, sizeof m);
            memcpy(l2, l, sizeof l);
            for (int r = 0; r < mr; r++) {   /* the contract, row by row */
                float *x = s2 + (size_t)r * LDS;
                const float mt = k->max(x, nc);
                const float mn = mt > m2[r] ? mt : m2[r];
                if (mn == -INFINITY) {
                    al2[r] = -1.0f;
                    continue;
                }
                float d = mn == m2[r] ? 0.0f : m2[r] - mn;
                k->exp_sum(&d, 1, 0.0f);   /* the tier's exp of d */
                al2[r] = d;
                const float sum = k->exp_sum(x, nc, mn);
                l2[r] = l2[r] * d;
                l2[r] = l2[r] + sum;
                m2[r] = mn;
            }
            k->softmax_rows(mr, nc, s, LDS, m, l, al);
            check_guard(al, (size_t)mr);
            for (int r = 0; r < mr; r++) {
                if (memcmp(&m[r], &m2[r], sizeof m[r]) ||
                    memcmp(&l[r], &l2[r], sizeof l[r]) ||
                    memcmp(&al[r], &al2[r], sizeof al[r]))
                    fail_msg("%s softmax_rows mr=%d nc=%d row %d: m %g l %g "
                             "alpha %g, expected %g %g %g",
                             k->name, mr, nc, r, (double)m[r], (double)l[r],
                             (double)al[r], (double)m2[r], (double)l2[r],
                             (double)al2[r]);
                if (memcmp(s + (size_t)r * LDS, s2 + (size_t)r * LDS,
                           LDS * sizeof *s))
                    fail_msg("%s softmax_rows mr=%d nc=%d: row %d's weights "
                             "differ from exp_sum's", k->name, mr, nc, r);
            }
            free(s), free(s2), free(al);
        }
}

/* ---- the backward's row work ---------------------------------------------*/

/* dot_nonzero: the float64 sum of the products over p != 0, against the
 * products (each exact in double) summed in long double; a zero p keeps
 * a NaN or Inf of d out; the order depends on n alone (the same bits at
 * another alignment). */
static void test_dot_nonzero(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100};
    rng_seed(47);
    for (int t = 0; t < COUNT(ns); t++) {
        const int n = ns[t];
        float *p = in_buf((size_t)n + 1), *d = in_buf((size_t)n + 1);
        fill(p, (size_t)n + 1, 0.0f, 1.0f);
        fill(d, (size_t)n + 1, -3.0f, 3.0f);
        for (int i = 0; i < n; i++)
            if (i % 3 == 1) {
                p[i] = i % 2 ? -0.0f : 0.0f;
                d[i] = i % 4 == 1 ? NAN : INFINITY;
            }
        long double want = 0.0L, mag = 0.0L;
        for (int i = 0; i < n; i++)
            if (p[i] != 0.0f) {
                want += (long double)p[i] * d[i];
                mag += fabsl((long double)p[i] * d[i]);
            }
        const double got = k->dot_nonzero(p, d, n);
        if (!(fabsl(got - want) <= (n + 1) * 0x1p-52L * mag))
            fail_msg("%s dot_nonzero, n=%d: %.17g, expected %.17Lg", k->name,
                     n, got, want);
        /* The same values one float further on: the same bits. */
        memmove(p + 1, p, (size_t)n * sizeof *p);
        memmove(d + 1, d, (size_t)n * sizeof *d);
        const double moved = k->dot_nonzero(p + 1, d + 1, n);
        assert_memory_equal(&moved, &got, sizeof got);
        free(p);
        free(d);
    }
    /* A NaN p is not zero: it reaches the sum. */
    float p[9] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
    float d[9] = {1, 1, 1, 1, 1, 1, 1, 1, 1};
    p[5] = NAN;
    assert_true(isnan(k->dot_nonzero(p, d, 9)));
}

/* probs: the bits of exp_sum, scale and dot_nonzero called in turn (each
 * tested against float64 above), with and without d; the special scores
 * (-inf: a masked key, p = 0, whose d may be NaN or Inf; NaN; below the
 * flush; 0) among them; nothing written past n. */
static void test_probs(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65,
                             100};
    static const float special[] = {-INFINITY, NAN, -90.0f, -87.4f, 0.0f,
                                    -86.0f};
    rng_seed(53);
    for (int t = 0; t < COUNT(ns); t++)
        for (int with_d = 0; with_d < 2; with_d++) {
            const int n = ns[t];
            float *x = out_buf((size_t)n), *want = in_buf((size_t)n);
            float *d = in_buf((size_t)n);
            fill(x, (size_t)n, -20.0f, 0.0f);
            fill(d, (size_t)n, -3.0f, 3.0f);
            for (int i = 0; i < n; i++)
                if (i % 5 == 2) {
                    x[i] = special[(i / 5) % COUNT(special)];
                    if (x[i] == -INFINITY)
                        d[i] = i % 2 ? NAN : INFINITY;
                }
            memcpy(want, x, (size_t)n * sizeof *x);
            const float m = -0.75f, a = 0.3f;
            k->exp_sum(want, n, m);
            k->scale(want, want, n, a);
            const double dwant = with_d ? k->dot_nonzero(want, d, n) : 0.0;
            const double got = k->probs(x, n, m, a, with_d ? d : NULL);
            if (!same_bits(x, want, (size_t)n))
                fail_msg("%s probs, n=%d: not exp_sum then scale", k->name, n);
            if (memcmp(&got, &dwant, sizeof got) != 0)
                fail_msg("%s probs, n=%d, d %s: %.17g, dot_nonzero %.17g",
                         k->name, n, with_d ? "given" : "NULL", got, dwant);
            check_guard(x, (size_t)n);
            free(x);
            free(want);
            free(d);
        }
}

/* dscore: p * (d - delta), each operation rounded, +0 where p is zero
 * (whatever d holds): the same bits as the C expression, in place too,
 * nothing written past n. */
static void test_dscore(void **state)
{
    const mha_microkernels *k = *state;
    static const int ns[] = {0, 1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 100};
    rng_seed(53);
    for (int t = 0; t < COUNT(ns); t++)
        for (int in_place = 0; in_place < 2; in_place++) {
            const int n = ns[t];
            float *p = in_buf((size_t)n), *d = out_buf((size_t)n);
            float *want = in_buf((size_t)n);
            fill(p, (size_t)n, 0.0f, 1.0f);
            fill(d, (size_t)n, -3.0f, 3.0f);
            for (int i = 0; i < n; i++) {
                if (i % 5 == 2) {
                    p[i] = i % 2 ? -0.0f : 0.0f;
                    d[i] = i % 3 ? NAN : -INFINITY;
                } else if (i % 11 == 4) {
                    d[i] = INFINITY;
                }
            }
            const float delta = 0.3183099f;
            for (int i = 0; i < n; i++)
                want[i] = p[i] == 0.0f ? 0.0f : p[i] * (d[i] - delta);
            float *ds = in_place ? d : out_buf((size_t)n);
            k->dscore(p, d, delta, ds, n);
            check_guard(ds, (size_t)n);
            if (!same_bits(ds, want, (size_t)n))
                fail_msg("%s dscore, n=%d%s: not the bits of "
                         "p * (d - delta)", k->name, n,
                         in_place ? " (in place)" : "");
            if (!in_place)
                free(ds);
            free(p);
            free(d);
            free(want);
        }
}

/* ---- micro-benchmark (printed, not asserted) ------------------------------*/

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static void test_bench(void **state)
{
    const mha_microkernels *k = *state;
    enum { M = 64, C = 64, D = 64 };
    float *q = in_buf(M * D), *kt = in_buf(D * C), *s = in_buf(M * C);
    float *v = in_buf(C * D), *o = in_buf(M * D);
    rng_seed(51);
    fill(q, M * D, -1.0f, 1.0f);
    fill(kt, D * C, -1.0f, 1.0f);
    fill(s, M * C, 0.0f, 0.01f);
    fill(v, C * D, -1.0f, 1.0f);
    memset(o, 0, sizeof(float) * M * D);
    const double flops = 2.0 * M * C * D;
    double g[2];
    for (int which = 0; which < 2; which++) {
        double best = 1e30;
        const double t_end = now_s() + 0.004;
        int iters = 0;
        do {
            const double t0 = now_s();
            for (int i = 0; i < 8; i++) {
                if (which == 0)
                    k->qk(M, C, D, q, kt, C, s, C);
                else
                    k->pv(M, C, D, s, C, v, o, D);
            }
            const double dt = (now_s() - t0) / 8;
            if (dt < best)
                best = dt;
            iters++;
        } while (now_s() < t_end || iters < 2);
        g[which] = flops / best * 1e-9;
    }
    printf("[ %s ] mr=nc=dh=64: qk %.1f GFLOP/s, pv %.1f GFLOP/s "
           "(best of ~4 ms, one thread)\n", k->name, g[0], g[1]);
    free(q);
    free(kt);
    free(s);
    free(v);
    free(o);
}

#if MHA_TEST_X86
/* The avx512 exp is the avx2 exp lane for lane (docs/KERNELS.md): the same
 * bits for every input, the tails included. */
static void test_avx512_exp_is_avx2s(void **state)
{
    (void)state;
    enum { N = 1 << 18 };
    float *a = in_buf(N), *b = in_buf(N);
    rng_seed(77);
    fill(a, N, -120.0f, 100.0f);
    a[0] = -INFINITY;
    a[1] = NAN;
    a[2] = 0.0f;
    a[3] = -0.0f;
    a[4] = -0x1.5d589ep+6f;
    a[5] = 88.7f;
    memcpy(b, a, N * sizeof *a);
    for (int i = 0; i < N; i += 37) {
        const int n = N - i < 37 ? N - i : 37;
        mha_microkernels_avx2.exp_sum(a + i, n, 0.25f);
        mha_microkernels_avx512.exp_sum(b + i, n, 0.25f);
    }
    for (int i = 0; i < N; i++)
        if (!same_bits(a + i, b + i, 1))
            fail_msg("exp(%d): avx2 %a, avx512 %a", i, a[i], b[i]);
    free(a);
    free(b);
}

#endif

/* ---- main -----------------------------------------------------------------*/

static void test_names(void **state)
{
    (void)state;
    assert_string_equal(mha_microkernels_scalar.name, "scalar");
#if MHA_TEST_X86
    assert_string_equal(mha_microkernels_avx2.name, "avx2");
    assert_string_equal(mha_microkernels_avx512.name, "avx512");
#endif
#if MHA_TEST_ARM
    assert_string_equal(mha_microkernels_neon.name, "neon");
#endif
}

#define KERNEL_TESTS(table)                                                  \
    cmocka_unit_test_prestate(test_qk_shapes, (void *)&table),               \
    cmocka_unit_test_prestate(test_qk_splits_bitwise, (void *)&table),       \
    cmocka_unit_test_prestate(test_pv_shapes, (void *)&table),               \
    cmocka_unit_test_prestate(test_pv_exact_shapes, (void *)&table),         \
    cmocka_unit_test_prestate(test_pv_kv_half, (void *)&table),              \
    cmocka_unit_test_prestate(test_pv_splits_bitwise, (void *)&table),       \
    cmocka_unit_test_prestate(test_pv_add_is_pv_then_add, (void *)&table),   \
    cmocka_unit_test_prestate(test_pvt_is_pv_transposed, (void *)&table),    \
    cmocka_unit_test_prestate(test_pv_exact_nonfinite, (void *)&table),      \
    cmocka_unit_test_prestate(test_exp_accuracy, (void *)&table),            \
    cmocka_unit_test_prestate(test_exp_special, (void *)&table),             \
    cmocka_unit_test_prestate(test_exp_lanes_apart, (void *)&table),         \
    cmocka_unit_test_prestate(test_softcap, (void *)&table),                 \
    cmocka_unit_test_prestate(test_exp_sum_order, (void *)&table),           \
    cmocka_unit_test_prestate(test_scale, (void *)&table),                   \
    cmocka_unit_test_prestate(test_copy_finite, (void *)&table),             \
    cmocka_unit_test_prestate(test_amax, (void *)&table),                    \
    cmocka_unit_test_prestate(test_widen_t, (void *)&table),                 \
    cmocka_unit_test_prestate(test_narrow, (void *)&table),                  \
    cmocka_unit_test_prestate(test_widen_rows_quantised, (void *)&table),    \
    cmocka_unit_test_prestate(test_qk_rows_is_qk, (void *)&table),           \
    cmocka_unit_test_prestate(test_max, (void *)&table),                     \
    cmocka_unit_test_prestate(test_softmax_rows, (void *)&table),            \
    cmocka_unit_test_prestate(test_dot_nonzero, (void *)&table),             \
    cmocka_unit_test_prestate(test_probs, (void *)&table),                   \
    cmocka_unit_test_prestate(test_dscore, (void *)&table),                  \
    cmocka_unit_test_prestate(test_bench, (void *)&table)

/* The tables to test are named on the command line: scalar, avx2, avx512.
 * CTest runs each tier in its own entry (tests/CMakeLists.txt):
 * test_microkernels (scalar), test_microkernels_avx2 and
 * test_microkernels_avx512; an entry whose tier this CPU lacks exits
 * TU_SKIP, which CTest reports as Skipped, never as a pass.  Without
 * arguments (a manual run, the valgrind loop of scripts/test.sh) every
 * tier the CPU has runs, and each one it lacks is named as skipped. */
int main(int argc, char **argv)
{
    const struct CMUnitTest scalar_tests[] = {
        cmocka_unit_test(test_names),
        KERNEL_TESTS(mha_microkernels_scalar),
    };
#if MHA_TEST_X86
    const struct CMUnitTest avx2_tests[] = {
        KERNEL_TESTS(mha_microkernels_avx2),
    };
    const struct CMUnitTest avx512_tests[] = {
        KERNEL_TESTS(mha_microkernels_avx512),
        cmocka_unit_test(test_avx512_exp_is_avx2s),
    };
#endif
#if MHA_TEST_ARM
    const struct CMUnitTest neon_tests[] = {
        KERNEL_TESTS(mha_microkernels_neon),
    };
#endif
    /* Each tier: its tests where this build has them, and whether this
     * CPU runs them. */
    struct tier {
        const char *name, *lacks;
        const struct CMUnitTest *tests;
        size_t count;
        int runs;
    } tiers_known[] = {
        {"scalar", "", scalar_tests,
         sizeof scalar_tests / sizeof *scalar_tests, 1},
#if MHA_TEST_X86
        {"avx2", "AVX2 or FMA", avx2_tests,
         sizeof avx2_tests / sizeof *avx2_tests, 0},
        {"avx512", "AVX-512F", avx512_tests,
         sizeof avx512_tests / sizeof *avx512_tests, 0},
        {"neon", "NEON (it is an x86 CPU)", NULL, 0, 0},
#elif MHA_TEST_ARM
        {"avx2", "AVX2 (it is an aarch64 CPU)", NULL, 0, 0},
        {"avx512", "AVX-512F (it is an aarch64 CPU)", NULL, 0, 0},
        {"neon", "", neon_tests, sizeof neon_tests / sizeof *neon_tests, 1},
#endif
    };
    const int known = (int)(sizeof tiers_known / sizeof *tiers_known);
#if MHA_TEST_X86
    __builtin_cpu_init();
    tiers_known[1].runs =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    tiers_known[2].runs =
        tiers_known[1].runs && __builtin_cpu_supports("avx512f");
#endif
    static const char *const all[] = {"scalar", "avx2", "avx512", "neon"};
    const char *const *tiers = argc > 1 ? (const char *const *)argv + 1 : all;
    const int n = argc > 1 ? argc - 1 : 4;
    int rc = 0, skipped = 0;
    for (int t = 0; t < n; t++) {
        int k = 0;
        while (k < known && strcmp(tiers[t], tiers_known[k].name))
            k++;
        if (k == known) {
            fprintf(stderr, "usage: %s [scalar|avx2|avx512|neon]...\n",
                    argv[0]);
            return 2;
        }
        char group[64];
        snprintf(group, sizeof group, "microkernels_%s", tiers_known[k].name);
        if (tiers_known[k].runs) {
            rc |= _cmocka_run_group_tests(group, tiers_known[k].tests,
                                          tiers_known[k].count, NULL, NULL);
        } else {
            printf("skipped: the %s tier, this CPU lacks %s\n",
                   tiers_known[k].name, tiers_known[k].lacks);
            skipped++;
        }
    }
    if (rc)
        return rc;
    return argc > 1 && skipped ? TU_SKIP : 0;
}
