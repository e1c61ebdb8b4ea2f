/*
 * ref.c -- instantiates ref_impl.h in float64 and in float32.
 */
#include "ref.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define REAL double
#define FN(name) ref64_##name
#include "ref_impl.h"
#undef REAL
#undef FN

#define REAL float
#define FN(name) ref32_##name
#include "ref_impl.h"
#undef REAL
#undef FN

int ref_forward_f64(const mha_module *m, const mha_forward_args *a,
                    double *out, double *weights)
{
    return ref64_forward(m, a, out, weights);
}

int ref_forward_f32(const mha_module *m, const mha_forward_args *a,
                    float *out, float *weights)
{
    return ref32_forward(m, a, out, weights);
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
