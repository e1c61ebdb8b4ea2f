/*
 * test_dropout.c -- the dropout generator, mha_dropout_keep:
 *
 *   - bit for bit equal to the suite's own implementation of the generator
 *     documented in docs/semantics.md (ref_dropout_keep, tests/support/ref.c)
 *     over many (seed, p, b, h, i, j): small and huge coordinates, p = 0,
 *     tiny, 0.1, 0.5, 0.9, 1, and every p at the edge of a draw;
 *   - its statistics, each within 5 standard deviations: the fraction
 *     dropped; no correlation between neighbours along b, h, i or j, or
 *     between two seeds; and the drops of every line along each axis
 *     (a row of keys, a column of queries, ...) spread as independent
 *     draws are (binomially), so no row or column is dropped together.
 *
 * The generator does not depend on the kernel tier: this runs once.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "testutil.h"

/* The test's own source of cases: xorshift64* (Vigna 2016), which shares
 * nothing with the generator under test. */
static uint64_t rnd_state = 0x2545f4914f6cdd1dULL;
static uint64_t rnd(void)
{
    rnd_state ^= rnd_state >> 12;
    rnd_state ^= rnd_state << 25;
    rnd_state ^= rnd_state >> 27;
    return rnd_state * 0x2545f4914f6cdd1dULL;
}

/* A coordinate: small, medium, around 2^31, 2^32 and 2^53, near INT64_MAX,
 * or any non-negative int64. */
static int64_t coordinate(void)
{
    const uint64_t r = rnd();
    switch (r % 7) {
    case 0: return (int64_t)(r >> 58);                         /* [0, 64) */
    case 1: return (int64_t)(r >> 44);                         /* [0, 2^20) */
    case 2: return (INT64_C(1) << 31) - 8 + (int64_t)(r >> 60);
    case 3: return (INT64_C(1) << 32) - 8 + (int64_t)(r >> 60);
    case 4: return (INT64_C(1) << 53) - 8 + (int64_t)(r >> 60);
    case 5: return INT64_MAX - (int64_t)(r >> 60);
    default: return (int64_t)(r >> 1);
    }
}

static uint64_t a_seed(void)
{
    const uint64_t r = rnd();
    return r % 5 == 0 ? 0 : r % 5 == 1 ? UINT64_MAX : rnd();
}

/* The 32 bits the documented generator compares, recovered from the
 * reference alone: the largest t with keep(p = t * 2^-32) (binary search
 * over p = t * 2^-32 for t < 2^24, where such p are floats).  Returns -1
 * when u >= 2^24. */
static int64_t small_u(uint64_t seed, int64_t b, int64_t h, int64_t i,
                       int64_t j)
{
    if (ref_dropout_keep(seed, 0x1p-8f, b, h, i, j))
        return -1;   /* kept at p = 2^24 / 2^32: u >= 2^24 */
    int64_t lo = 0, hi = INT64_C(1) << 24;   /* keep(lo), !keep(hi) */
    while (hi - lo > 1) {
        const int64_t mid = (lo + hi) / 2;
        if (ref_dropout_keep(seed, ldexpf((float)mid, -32), b, h, i, j))
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

#define SAME(seed, p, b, h, i, j)                                            \
    do {                                                                     \
        const int lib_ = mha_dropout_keep(seed, p, b, h, i, j);              \
        const int ref_ = ref_dropout_keep(seed, p, b, h, i, j);              \
        if (lib_ != ref_)                                                    \
            fail_msg("mha_dropout_keep(%llu, %a, %lld, %lld, %lld, %lld) = " \
                     "%d, the documented generator says %d",                 \
                     (unsigned long long)(seed), (double)(p), (long long)(b),\
                     (long long)(h), (long long)(i), (long long)(j), lib_,   \
                     ref_);                                                  \
        n_checked++;                                                         \
        n_kept += lib_;                                                      \
    } while (0)

static void test_matches_documented_generator(void **state)
{
    (void)state;
    const float fixed[] = {0.0f, -0.0f, FLT_TRUE_MIN, 1e-30f, 0x1p-33f,
                           0x1p-32f, 0x1.8p-32f, 1e-9f, 1e-6f, 1e-3f,
                           0x1.fffffep-10f, 0x1p-9f, 0.1f, 0.25f, 0.5f,
                           0.9f, 0x1.fffffep-1f, 1.0f};
    const int n_fixed = (int)(sizeof fixed / sizeof *fixed);
    long n_checked = 0, n_kept = 0;
    for (int t = 0; t < 100000; t++) {
        const uint64_t seed = a_seed();
        const int64_t b = coordinate(), h = coordinate(), i = coordinate(),
                      j = coordinate();
        for (int k = 0; k < n_fixed; k++)
            SAME(seed, fixed[k], b, h, i, j);
        /* any p in (0, 1) */
        const float pr = (float)((double)(rnd() >> 40) * 0x1p-24);
        SAME(seed, pr, b, h, i, j);
    }
    assert_int_equal(n_checked, 100000L * (n_fixed + 1));
    /* both outcomes occurred (p ranges over (0, 1) and the fixed values) */
    assert_true(n_kept > 0 && n_kept < n_checked);
    /* p = 0 and p = 1 themselves */
    for (int t = 0; t < 1000; t++) {
        const uint64_t seed = a_seed();
        const int64_t b = coordinate(), h = coordinate(), i = coordinate(),
                      j = coordinate();
        assert_int_equal(mha_dropout_keep(seed, 0.0f, b, h, i, j), 1);
        assert_int_equal(mha_dropout_keep(seed, 1.0f, b, h, i, j), 0);
    }
}

/* p at the edge of a draw: for draws whose 32 compared bits u are below
 * 2^24, p = u * 2^-32 (kept), its float neighbours, (u + 1) * 2^-32
 * (dropped) and, for u < 2^23, (u + 0.5) * 2^-32 (kept: floor(p * 2^32)
 * = u), where a `>` for `>=` or a rounded threshold shows. */
static void test_edges_of_each_draw(void **state)
{
    (void)state;
    long n_checked = 0, n_kept = 0, found = 0, tries = 0;
    while (found < 400) {
        assert_true(++tries < 10000000);
        const uint64_t seed = a_seed();
        const int64_t b = coordinate(), h = coordinate(), i = coordinate(),
                      j = coordinate();
        const int64_t u = small_u(seed, b, h, i, j);
        if (u < 0)
            continue;
        found++;
        const float pu = ldexpf((float)u, -32);
        SAME(seed, pu, b, h, i, j);
        SAME(seed, nextafterf(pu, 0.0f), b, h, i, j);
        SAME(seed, nextafterf(pu, 1.0f), b, h, i, j);
        SAME(seed, ldexpf((float)(u + 1), -32), b, h, i, j);
        if (u < (INT64_C(1) << 23))
            SAME(seed, ldexpf((float)u + 0.5f, -32), b, h, i, j);
        /* the reference's own reading of its definition */
        assert_true(ref_dropout_keep(seed, pu, b, h, i, j));
        assert_false(ref_dropout_keep(seed, ldexpf((float)(u + 1), -32), b, h,
                                      i, j));
    }
    /* both outcomes were compared, many times */
    assert_true(n_kept >= 400 && n_checked - n_kept >= 400);
}

/* ---- statistics ------------------------------------------------------------ */

enum { NB = 16, NH = 16, NI = 64, NJ = 64, N = NB * NH * NI * NJ };
#define SIGMAS 5.0

/* dropped[((b * NH + h) * NI + i) * NJ + j] for the grid at origin o. */
static void draw_grid(uint64_t seed, float p, const int64_t o[4],
                      uint8_t *dropped)
{
    for (int64_t b = 0; b < NB; b++)
        for (int64_t h = 0; h < NH; h++)
            for (int64_t i = 0; i < NI; i++)
                for (int64_t j = 0; j < NJ; j++)
                    dropped[((b * NH + h) * NI + i) * NJ + j] =
                        (uint8_t)!mha_dropout_keep(seed, p, o[0] + b,
                                                   o[1] + h, o[2] + i,
                                                   o[3] + j);
}

static const char *const AXIS[4] = {"b", "h", "i", "j"};
static const int64_t LEN[4] = {NB, NH, NI, NJ};
static const int64_t STRIDE[4] = {NH * NI * NJ, NI * NJ, NJ, 1};

/* Along axis a, for drop probability q:
 *  - the correlation of neighbours, sum (x - q)(y - q) / (n q (1-q)) over
 *    the n neighbour pairs: mean 0 and variance 1/n for independent draws
 *    (the terms are uncorrelated, each of variance (q(1-q))^2);
 *  - the dispersion of the drops per line (the LEN[a] entries that differ
 *    only in coordinate a): mean over the M lines of (c - nq)^2 / (nq(1-q)),
 *    1 for binomial counts, with variance (2 + (1 - 6q(1-q)) / (nq(1-q)))
 *    / M. */
static int check_axis(const char *what, const uint8_t *x, double q, int a)
{
    const int64_t len = LEN[a], stride = STRIDE[a];
    double corr = 0, disp = 0;
    int64_t pairs = 0, lines = 0;
    for (int64_t start = 0; start < N; start++) {
        if ((start / stride) % len != 0)
            continue;   /* not the first entry of a line along a */
        double c = 0;
        for (int64_t k = 0; k < len; k++) {
            const double xk = x[start + k * stride];
            c += xk;
            if (k + 1 < len) {
                corr += (xk - q) * (x[start + (k + 1) * stride] - q);
                pairs++;
            }
        }
        const double var = len * q * (1 - q);
        disp += (c - len * q) * (c - len * q) / var;
        lines++;
    }
    assert_int_equal(lines * len, N);
    corr /= (double)pairs * q * (1 - q);
    disp /= (double)lines;
    const double sd_corr = 1.0 / sqrt((double)pairs);
    const double npq = len * q * (1 - q);
    const double sd_disp =
        sqrt((2.0 + (1.0 - 6.0 * q * (1 - q)) / npq) / (double)lines);
    int bad = 0;
    if (!(fabs(corr) <= SIGMAS * sd_corr)) {
        print_error("%s: neighbours along %s correlate: %.5f (sd %.5f)\n",
                    what, AXIS[a], corr, sd_corr);
        bad++;
    }
    if (!(fabs(disp - 1.0) <= SIGMAS * sd_disp)) {
        print_error("%s: the drops per line along %s are not binomial: "
                    "dispersion %.4f, expected 1 +- %.4f\n", what, AXIS[a],
                    disp, sd_disp);
        bad++;
    }
    return bad;
}

static void test_statistics(void **state)
{
    (void)state;
    uint8_t *x = malloc(N), *y = malloc(N);
    int bad = 0;
    assert_non_null(x);
    assert_non_null(y);
    const int64_t zero[4] = {0, 0, 0, 0};
    const int64_t far[4] = {INT64_C(1) << 40, (INT64_C(1) << 31) - 5,
                            (INT64_C(1) << 32) - 20, INT64_MAX - NJ};
    const struct {
        float p;
        uint64_t seed;
        const int64_t *origin;
    } runs[] = {{0.1f, 1234, zero}, {0.5f, 1234, zero}, {0.9f, 1234, zero},
                {0.5f, UINT64_MAX, far}};
    for (size_t r = 0; r < sizeof runs / sizeof *runs; r++) {
        /* q: the drop probability, floor(p 2^32) / 2^32 = p for these p */
        const float p = runs[r].p;
        const double q = (double)p;
        char what[64];
        snprintf(what, sizeof what, "p = %g, seed %llu%s", (double)p,
                 (unsigned long long)runs[r].seed,
                 runs[r].origin == far ? ", far coordinates" : "");
        draw_grid(runs[r].seed, p, runs[r].origin, x);
        double dropped = 0;
        for (int64_t k = 0; k < N; k++)
            dropped += x[k];
        const double frac = dropped / N, sd = sqrt(q * (1 - q) / N);
        if (!(fabs(frac - q) <= SIGMAS * sd)) {
            print_error("%s: dropped fraction %.6f, expected %.6f +- %.6f\n",
                        what, frac, q, SIGMAS * sd);
            bad++;
        }
        for (int a = 0; a < 4; a++)
            bad += check_axis(what, x, q, a);
        /* the next seed draws an unrelated mask */
        draw_grid(runs[r].seed + 1, p, runs[r].origin, y);
        double c = 0;
        for (int64_t k = 0; k < N; k++)
            c += (x[k] - q) * (y[k] - q);
        c /= (double)N * q * (1 - q);
        if (!(fabs(c) <= SIGMAS / sqrt((double)N))) {
            print_error("%s: the masks of seeds %llu and %llu correlate: "
                        "%.5f\n", what, (unsigned long long)runs[r].seed,
                        (unsigned long long)(runs[r].seed + 1), c);
            bad++;
        }
    }
    free(x);
    free(y);
    if (bad)
        fail_msg("%d statistics off by more than %g standard deviations",
                 bad, SIGMAS);
}

/* The coordinates are not interchangeable: (k, 0, ...) and (0, k, ...)
 * are unrelated draws, and so on for every pair of coordinates. */
static void test_coordinates_not_interchangeable(void **state)
{
    (void)state;
    for (int a = 0; a < 4; a++)
        for (int c = a + 1; c < 4; c++) {
            int differ = 0;
            for (int64_t k = 1; k <= 256; k++) {
                int64_t x[4] = {3, 5, 7, 11}, y[4] = {3, 5, 7, 11};
                x[a] = k;
                y[c] = k;
                x[c] = y[a] = 0;
                differ += mha_dropout_keep(5, 0.5f, x[0], x[1], x[2], x[3]) !=
                          mha_dropout_keep(5, 0.5f, y[0], y[1], y[2], y[3]);
            }
            /* 256 fair coin pairs differ 128 +- 8 times; 5 sigma: 88..168 */
            if (differ < 88 || differ > 168)
                fail_msg("swapping coordinates %s and %s: %d of 256 differ",
                         AXIS[a], AXIS[c], differ);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_documented_generator),
        cmocka_unit_test(test_edges_of_each_draw),
        cmocka_unit_test(test_statistics),
        cmocka_unit_test(test_coordinates_not_interchangeable),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
