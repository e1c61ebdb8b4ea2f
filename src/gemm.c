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

/*
 * The gradients of y = x w^T + b, given dy (rows, n_out), row stride lddy:
 *   dx (rows, n_in), stride lddx  =  dy w            (+ dx if beta = 1)
 *   dw (n_out, n_in)              =  dy^T x          (+ dw if beta = 1)
 *   db (n_out)                    =  sum over rows of dy (+ db if beta = 1)
 * Each is one fixed order of operations for given shapes.
 */
void mha_linear_grad_input(const float *dy, int64_t rows, int64_t n_out,
                           int64_t lddy, const float *w, int64_t n_in,
                           float beta, float *dx, int64_t lddx)
{
    const int64_t chunk = INT_MAX;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t r = rows - r0 < chunk ? rows - r0 : chunk;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)r,
                    (int)n_in, (int)n_out, 1.0f, dy + r0 * lddy, (int)lddy, w,
                    (int)n_in, beta, dx + r0 * lddx, (int)lddx);
    }
}

void mha_linear_grad_params(const float *dy, int64_t rows, int64_t n_out,
                            int64_t lddy, const float *x, int64_t n_in,
                            int64_t ldx, float beta, float *dw, float *db)
{
    const int64_t chunk = INT_MAX;
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
        const int64_t r = rows - r0 < chunk ? rows - r0 : chunk;
        cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n_out,
                    (int)n_in, (int)r, 1.0f, dy + r0 * lddy, (int)lddy,
                    x + r0 * ldx, (int)ldx, r0 ? 1.0f : beta, dw, (int)n_in);
    }
    if (!db)
        return;
    /* Column sums in float64, a block of columns at a time: a float32 sum
     * over thousands of rows would lose digits the GEMMs keep. */
    enum { COLS = 256 };
    double acc[COLS];
    for (int64_t o0 = 0; o0 < n_out; o0 += COLS) {
        const int64_t n = n_out - o0 < COLS ? n_out - o0 : COLS;
        for (int64_t o = 0; o < n; o++)
            acc[o] = beta == 0.0f ? 0.0 : (double)db[o0 + o];
        for (int64_t i = 0; i < rows; i++) {
            const float *row = dy + i * lddy + o0;
            for (int64_t o = 0; o < n; o++)
                acc[o] += row[o];
        }
        for (int64_t o = 0; o < n; o++)
            db[o0 + o] = (float)acc[o];
    }
}
