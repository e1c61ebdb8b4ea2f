/*
 * ref.c -- instantiates ref_impl.h in float64 and in float32.
 */
#include "ref.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- the dropout generator (docs/semantics.md, "Dropout") ---------------- */

/* SplitMix64's output function (Steele, Lea & Flood, "Fast splittable
 * pseudorandom number generators", 2014; the constants of Stafford's
 * variant 13, as in java.util.SplittableRandom). */
static uint64_t splitmix64_out(uint64_t z)
{
    z ^= z >> 30;
    z *= UINT64_C(0xbf58476d1ce4e5b9);
    z ^= z >> 27;
    z *= UINT64_C(0x94d049bb133111eb);
    z ^= z >> 31;
    return z;
}

int ref_dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i,
                     int64_t j)
{
    if (!(p > 0.0f))          /* p = 0: nothing is dropped */
        return 1;
    if (p >= 1.0f)            /* p = 1: everything is */
        return 0;
    /* phi = 2^64 / golden ratio, SplitMix64's increment.  Round n
     * (n = 1..4) folds in coordinate n, offset by n * phi (mod 2^64). */
    const uint64_t phi = UINT64_C(0x9e3779b97f4a7c15);
    const int64_t coord[4] = {b, h, i, j};
    uint64_t x = splitmix64_out(seed + phi);
    for (uint64_t n = 1; n <= 4; n++)
        x = splitmix64_out(x ^ ((uint64_t)coord[n - 1] + n * phi));
    /* u: the high 32 bits, a uniform integer in [0, 2^32).  The entry is
     * dropped when the whole cell [u, u + 1) * 2^-32 lies below p, i.e.
     * u < floor(p * 2^32) (p * 2^32 is exact in a double). */
    const double u = (double)(x >> 32);
    return !(u + 1.0 <= ldexp((double)p, 32));
}

/* ---- the forward pass ------------------------------------------------------ */

/* The largest rounding scale of a live score (and additive mask term
 * below 1e4) of the last forward (ref_score_magnitude, ref.h). */
static double ref_max_score;

/* Every sum in order, or (ref_forward_f32_reversed) in reverse order. */
static int ref_reversed;
#define REF_ORDER(t, n) (ref_reversed ? (n) - 1 - (t) : (t))

#define REAL double
#define FN(name) ref64_##name
#define TANH tanh
#include "ref_impl.h"
#undef REAL
#undef FN
#undef TANH

#define REAL float
#define FN(name) ref32_##name
#define TANH tanhf   /* libm's float tanh, as a plain float32 code has */
#include "ref_impl.h"
#undef REAL
#undef FN
#undef TANH

int ref_forward_f64(const mha_module *m, const mha_forward_args *a,
                    double *out, double *weights)
{
    ref_max_score = 0.0;
    return ref64_forward(m, a, out, weights);
}

double ref_score_magnitude(void)
{
    return ref_max_score;
}

int ref_forward_f32(const mha_module *m, const mha_forward_args *a,
                    float *out, float *weights)
{
    return ref32_forward(m, a, out, weights);
}

int ref_forward_f32_reversed(const mha_module *m, const mha_forward_args *a,
                             float *out, float *weights)
{
    ref_reversed = 1;   /* (not thread-safe: the tests call it from one) */
    const int rc = ref32_forward(m, a, out, weights);
    ref_reversed = 0;
    return rc;
}

void ref_average_heads(const double *w, int64_t B, int64_t H, int64_t Lq,
                       int64_t Lt, double *avg)
{
    memset(avg, 0, (size_t)(B * Lq * Lt) * sizeof *avg);
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < Lq * Lt; t++)
                avg[b * Lq * Lt + t] += w[(b * H + h) * Lq * Lt + t] / H;
}

double ref_max_err_f32(const float *x, const double *ref, int64_t n)
{
    double e = 0;
    for (int64_t k = 0; k < n; k++) {
        double d = fabs((double)x[k] - ref[k]);
        if (isnan(d))
            return INFINITY;
        if (d > e)
            e = d;
    }
    return e;
}

double ref_max_abs(const double *ref, int64_t n)
{
    double e = 0;
    for (int64_t k = 0; k < n; k++)
        if (fabs(ref[k]) > e)
            e = fabs(ref[k]);
    return e;
}

double ref_tolerance(double naive_err, double max_abs_ref)
{
    return 2.0 * naive_err + 1e-6 * (1.0 + max_abs_ref);
}
