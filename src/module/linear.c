/*
 * gemm.c -- the only file that calls CBLAS.
 */
#include "module.h"

#include <cblas.h>
#include <limits.h>
#include <string.h>

/* CBLAS dimensions are int; rows beyond INT_MAX are done in chunks.
 * The widths were bounded by INT32_MAX when the module was configured. */
void mha_linear(const float *x, int64_t rows, int64_t n_in, int64_t ldx,
                const float *w, int64_t n_out, const float *b, float *y,
                int64_t ldy)
{
    mha_linear_blocks(x, rows, n_in, ldx, w, n_out, b, NULL, 1, y, ldy);
}

void mha_linear_blocks(const float *x, int64_t rows, int64_t n_in,
                       int64_t ldx, const float *w, int64_t n_out,
                       const float *b, const float *scale, int64_t nblk,
                       float *y, int64_t ldy)
{
    const int64_t chunk = INT_MAX, kb = n_in / nblk;
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
        for (int64_t t = 0; t < nblk; t++) {
            const float alpha = scale ? scale[t] : 1.0f;
            if (alpha == 0.0f)
                continue;   /* an ablated head: nothing to add */
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)r,
                        (int)n_out, (int)kb, alpha, xc + t * kb, (int)ldx,
                        w + t * kb, (int)n_in, beta, yc, (int)ldy);
            beta = 1.0f;
        }
        if (beta == 0.0f)   /* no bias and every block scaled by 0 */
            for (int64_t i = 0; i < r; i++)
                memset(yc + i * ldy, 0, (size_t)n_out * sizeof(float));
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
    mha_linear_grad_params_blocks(dy, rows, n_out, lddy, x, n_in, ldx, NULL,
                                  1, beta, dw, db);
}

void mha_linear_grad_params_blocks(const float *dy, int64_t rows,
                                   int64_t n_out, int64_t lddy,
                                   const float *x, int64_t n_in, int64_t ldx,
                                   const float *scale, int64_t nblk,
                                   float beta, float *dw, float *db)
{
    const int64_t chunk = INT_MAX, kb = n_in / nblk;
    for (int64_t t = 0; t < nblk; t++) {
        const float alpha = scale ? scale[t] : 1.0f;
        float *dwt = dw + t * kb;
        if (alpha == 0.0f) {   /* dw_t = 0 * (dy^T x_t) (+ dw_t) */
            if (beta == 0.0f)
                for (int64_t o = 0; o < n_out; o++)
                    memset(dwt + o * n_in, 0, (size_t)kb * sizeof(float));
            continue;
        }
        for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
            const int64_t r = rows - r0 < chunk ? rows - r0 : chunk;
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, (int)n_out,
                        (int)kb, (int)r, alpha, dy + r0 * lddy, (int)lddy,
                        x + r0 * ldx + t * kb, (int)ldx, r0 ? 1.0f : beta,
                        dwt, (int)n_in);
        }
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
