/*
 * gemm.c -- the only file that calls CBLAS.
 */
#include "internal.h"

#include <cblas.h>
#include <limits.h>
#include <string.h>

/* CBLAS dimensions are int; rows beyond INT_MAX are done in chunks.
 * The widths were bounded by INT32_MAX when the module was configured. */
void mha_linear(const float *x, int64_t rows, int64_t n_in, int64_t ldx,
                const float *w, int64_t n_out, const float *b, float *y,
                int64_t ldy)
{
    const int64_t chunk = INT_MAX;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t r = rows - r0 < chunk ? rows - r0 : chunk;
        float *yc = y + r0 * ldy;
        const float *xc = x + r0 * ldx;
        float beta = 0.0f;
        if (b) {
            for (int64_t i = 0; i < r; i++)
                memcpy(yc + i * ldy, b, (size_t)n_out * sizeof(float));
            beta = 1.0f;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)r,
                    (int)n_out, (int)n_in, 1.0f, xc, (int)ldx, w, (int)n_in,
                    beta, yc, (int)ldy);
    }
}
