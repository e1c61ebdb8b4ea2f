/*
 * linear.c -- the linear layer and its gradients, in GEMMs of the
 * backend gemm.c chose (CBLAS or oneDNN).
 *
 * Bitwise the same for every thread count.  A BLAS's result bits depend
 * on how it splits a GEMM among its threads, so no GEMM is handed to the
 * BLAS whole.  Each is cut into a fixed grid of blocks that depends only
 * on the shapes, never on the thread count, and no sum is ever split
 * between blocks:
 *
 *   y  = x w^T + b   (rows, n_out)  blocks of LIN_ROWS rows x LIN_COLS
 *   dx = dy w        (rows, n_in)   columns of the output; the whole
 *                                   reduction (n_in, n_out) in one call
 *                                   (under a head mask, one call per
 *                                   head, in head order, into the block)
 *   dw = dy^T x      (n_out, n_in)  tiles of GRAD_TILE x GRAD_TILE of dw;
 *                                   the whole reduction over the rows in
 *                                   one call (in chunks of INT_MAX rows
 *                                   past that: a function of the shape)
 *   db               (n_out)        column sums in float64, rows in
 *                                   order, DB_COLS columns per block
 *
 * The blocks run on libmha's own OpenMP threads (the call's num_threads,
 * dynamically scheduled: which thread computes a block changes nothing),
 * and each block is one GEMM call that runs on one thread (gemm.c).
 * Blocks of 256+ rows and 512 columns keep each call near the BLAS's
 * full speed (packing is O(1/256) of the work).  A block of one row (a
 * decoding step) is a matrix-vector product (sgemv), which reads w once
 * without packing it: a choice made by the shape, like the grid.
 */
#include "module.h"
#include "core/half.h"
#include "kernels/kernels.h"

#include <limits.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

enum {
    LIN_ROWS = 256,   /* output rows per block of y and dx      */
    LIN_COLS = 512,   /* output columns per block of y and dx   */
    GRAD_TILE = 256,  /* rows and columns per tile of dw        */
    DB_COLS = 256     /* columns of db per block                */
};

/*
 * One thread inside every GEMM call (gemm.c): on libmha's threads,
 * omp_one_thread is the first thing in every parallel region below:
 * omp_set_num_threads(1), which inside a parallel region sets the thread
 * count of that thread's own task only (the caller's OpenMP setting is
 * untouched).  An OpenMP-threaded BLAS (OpenBLAS's OpenMP build, oneDNN)
 * runs serially when called inside an active parallel region, and from a
 * team of one thread (not an active region) reads omp_get_max_threads(),
 * now 1.  A BLAS with a pool of its own is set to one thread by
 * mha_gemm_serial.
 */
static void omp_one_thread(void)
{
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
}

/* Names used only in the OpenMP pragmas: without OpenMP (the fuzz build)
 * the pragmas are comments, and every block runs on the calling thread. */
#define OMP_ONLY __attribute__((unused))

/* The team for `items` blocks: num_threads (0: the OpenMP default), at
 * most one thread per block. */
static OMP_ONLY int team(int threads, int64_t items)
{
#ifdef _OPENMP
    if (threads < 1)
        threads = omp_get_max_threads();
#endif
    if (threads < 1)
        threads = 1;
    return items < threads ? (int)(items > 0 ? items : 1) : threads;
}

static int64_t nblocks(int64_t n, int64_t size) { return (n + size - 1) / size; }
static int min_int(int64_t a, int64_t b) { return (int)(a < b ? a : b); }

void mha_linear(const float *x, int64_t rows, int64_t n_in, int64_t ldx,
                const float *w, int64_t n_out, const float *b, float *y,
                int64_t ldy, int threads)
{
    mha_linear_blocks(x, rows, n_in, ldx, w, n_out, b, NULL, 1, y, ldy,
                      threads);
}

void mha_linear_blocks(const float *x, int64_t rows, int64_t n_in,
                       int64_t ldx, const float *w, int64_t n_out,
                       const float *b, const float *scale, int64_t nblk,
                       float *y, int64_t ldy, OMP_ONLY int threads)
{
    const int64_t kb = n_in / nblk;
    const int64_t cb = nblocks(n_out, LIN_COLS);
    const int64_t items = nblocks(rows, LIN_ROWS) * cb;
    mha_gemm_serial();
#pragma omp parallel num_threads(team(threads, items))
    {
        omp_one_thread();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r0 = it / cb * LIN_ROWS, c0 = it % cb * LIN_COLS;
            const int r = min_int(LIN_ROWS, rows - r0);
            const int n = min_int(LIN_COLS, n_out - c0);
            const float *xb = x + r0 * ldx;
            float *yb = y + r0 * ldy + c0;
            float beta = 0.0f;
            if (b) {
                for (int i = 0; i < r; i++)
                    memcpy(yb + i * ldy, b + c0, (size_t)n * sizeof(float));
                beta = 1.0f;
            }
            for (int64_t t = 0; t < nblk; t++) {
                const float alpha = scale ? scale[t] : 1.0f;
                if (alpha == 0.0f)
                    continue;   /* an ablated head: nothing to add */
                if (r == 1)   /* one row (decoding): no packing of w */
                    mha_sgemv(n, (int)kb, alpha, w + c0 * n_in + t * kb,
                              (int)n_in, xb + t * kb, beta, yb);
                else
                    mha_sgemm(0, 1, r, n, (int)kb, alpha, xb + t * kb,
                              (int)ldx, w + c0 * n_in + t * kb, (int)n_in,
                              beta, yb, (int)ldy);
                beta = 1.0f;
            }
            if (beta == 0.0f)   /* no bias and every block scaled by 0 */
                for (int i = 0; i < r; i++)
                    memset(yb + i * ldy, 0, (size_t)n * sizeof(float));
        }
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
                           float beta, float *dx, int64_t lddx,
                           OMP_ONLY int threads)
{
    const int64_t cb = nblocks(n_in, LIN_COLS);
    const int64_t items = nblocks(rows, LIN_ROWS) * cb;
    mha_gemm_serial();
#pragma omp parallel num_threads(team(threads, items))
    {
        omp_one_thread();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r0 = it / cb * LIN_ROWS, c0 = it % cb * LIN_COLS;
            mha_sgemm(0, 0, min_int(LIN_ROWS, rows - r0),
                      min_int(LIN_COLS, n_in - c0), (int)n_out, 1.0f,
                      dy + r0 * lddy, (int)lddy, w + c0, (int)n_in, beta,
                      dx + r0 * lddx + c0, (int)lddx);
        }
    }
}

void mha_linear_grad_params(const float *dy, int64_t rows, int64_t n_out,
                            int64_t lddy, const float *x, int64_t n_in,
                            int64_t ldx, float beta, float *dw, float *db,
                            int threads)
{
    mha_linear_grad_params_blocks(dy, rows, n_out, lddy, x, n_in, ldx, NULL,
                                  1, beta, dw, db, threads);
}

/* dw's tile of rows [o0, o0 + m) and columns [c0, c0 + n): for each part
 * of it in one column block t (a head), scale[t] dy^T x_t over every row. */
static void dw_tile(const float *dy, int64_t rows, int64_t lddy,
                    const float *x, int64_t n_in, int64_t ldx,
                    const float *scale, int64_t kb, float beta, float *dw,
                    int64_t o0, int m, int64_t c0, int n)
{
    const int64_t chunk = INT_MAX;
    for (int64_t s0 = c0; s0 < c0 + n;) {
        const int64_t t = s0 / kb;
        const int64_t s1 = (t + 1) * kb < c0 + n ? (t + 1) * kb : c0 + n;
        const float alpha = scale ? scale[t] : 1.0f;
        float *d = dw + o0 * n_in + s0;
        if (alpha == 0.0f) {   /* dw_t = 0 * (dy^T x_t) (+ dw_t) */
            if (beta == 0.0f)
                for (int i = 0; i < m; i++)
                    memset(d + i * n_in, 0, (size_t)(s1 - s0) * sizeof(float));
        } else {
            for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
                const int64_t r = rows - r0 < chunk ? rows - r0 : chunk;
                mha_sgemm(1, 0, m, (int)(s1 - s0), (int)r, alpha,
                          dy + r0 * lddy + o0, (int)lddy, x + r0 * ldx + s0,
                          (int)ldx, r0 ? 1.0f : beta, d, (int)n_in);
            }
        }
        s0 = s1;
    }
}

/* db's columns [o0, o0 + n): float64 sums over the rows in order (a
 * float32 sum over thousands of rows would lose digits the GEMMs keep). */
static void db_block(const float *dy, int64_t rows, int64_t lddy, float beta,
                     float *db, int64_t o0, int n)
{
    double acc[DB_COLS];
    for (int o = 0; o < n; o++)
        acc[o] = beta == 0.0f ? 0.0 : (double)db[o0 + o];
    for (int64_t i = 0; i < rows; i++) {
        const float *row = dy + i * lddy + o0;
        for (int o = 0; o < n; o++)
            acc[o] += row[o];
    }
    for (int o = 0; o < n; o++)
        db[o0 + o] = (float)acc[o];
}

void mha_linear_grad_params_blocks(const float *dy, int64_t rows,
                                   int64_t n_out, int64_t lddy,
                                   const float *x, int64_t n_in, int64_t ldx,
                                   const float *scale, int64_t nblk,
                                   float beta, float *dw, float *db,
                                   OMP_ONLY int threads)
{
    const int64_t kb = n_in / nblk;
    const int64_t cb = nblocks(n_in, GRAD_TILE);
    const int64_t tiles = nblocks(n_out, GRAD_TILE) * cb;
    const int64_t items = tiles + (db ? nblocks(n_out, DB_COLS) : 0);
    mha_gemm_serial();
    /* The tiles first: the column sums are the short items. */
#pragma omp parallel num_threads(team(threads, items))
    {
        omp_one_thread();
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (it < tiles) {
                const int64_t o0 = it / cb * GRAD_TILE;
                const int64_t c0 = it % cb * GRAD_TILE;
                dw_tile(dy, rows, lddy, x, n_in, ldx, scale, kb, beta, dw,
                        o0, min_int(GRAD_TILE, n_out - o0), c0,
                        min_int(GRAD_TILE, n_in - c0));
            } else {
                const int64_t o0 = (it - tiles) * DB_COLS;
                db_block(dy, rows, lddy, beta, db, o0,
                         min_int(DB_COLS, n_out - o0));
            }
        }
    }
}

/* ---- 16-bit data: y = x W^T + b with x and y bf16 or f16 -----------------
 *
 * The weights are the module's float32 parameters rounded to the data's
 * type (as PyTorch's module.to(torch.bfloat16) rounds them), prepared
 * once per call by mha_linear16_prepare:
 *
 *   kernel tiers (bf16 data, mha_bf16_tier AMX or AVX512): W packed as
 *     AMX's B operand (kernels/amx_linear.c); each block of 32 rows x
 *     LIN16_COLS columns is one tile GEMM (amx.c, tiles or vdpbf16ps),
 *     float32 sums over all of n_in in one fixed order, then + b and
 *     rounded to bf16.
 *   widened (f16 data, or a CPU without AVX512-BF16): W rounded to the
 *     dtype and held as float32; each block's rows of x widened to
 *     float32 and multiplied by the backend's SGEMM on one thread.
 *
 * Blocks run column block by column block (threads then share one panel
 * of W in the cache), each output element summed by one thread: the bits
 * do not depend on the thread count.
 */
enum { LIN16_ROWS = 32, LIN16_COLS = 256 };
/* The widened blocks: as the float32 path's (256 x 512 of y), so that
 * each single-threaded SGEMM packs its panel of W for 256 rows, not 32
 * (with 32-row blocks OpenBLAS spent 14% of a bf16 BERT forward copying
 * W: docs/BENCHMARKS.md). */
enum { LIN16W_ROWS = 256, LIN16W_COLS = 512 };

/* A block's rows and columns, by path. */
static int lin16_rows(int kernel) { return kernel ? LIN16_ROWS : LIN16W_ROWS; }
static int lin16_cols(int kernel) { return kernel ? LIN16_COLS : LIN16W_COLS; }

static int64_t round32(int64_t n) { return (n + 31) / 32 * 32; }

/* This thread's index in the team (its share of the scratch). */
static int thread_num(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* A thread's tile configuration around its blocks on the bf16 kernels
 * (AMX tiles or AVX512-BF16: mha_bf16_tier). */
static void kernels_begin(int kernel)
{
#if MHA_BF16_KERNELS
    if (kernel)
        mha_bf16_begin(mha_bf16_tier() == MHA_BF16_AMX);
#else
    (void)kernel;
#endif
}

static void kernels_end(int kernel)
{
#if MHA_BF16_KERNELS
    if (kernel)
        mha_bf16_end();
#else
    (void)kernel;
#endif
}

int64_t mha_linear16_weight_floats(int kernel, int64_t n_out, int64_t n_in)
{
    return kernel ? mha_bf16_b_words(n_in, n_out) : n_out * n_in;
}

int64_t mha_linear16_scratch_floats(int kernel, int64_t n_in)
{
    /* the block's float32 sums, then its rows of x: zero-padded bf16
     * (kernel) or widened to float32 */
    /* (whole 64-byte lines: each thread's part starts aligned) */
    return lin16_rows(kernel) * lin16_cols(kernel) +
           (kernel ? LIN16_ROWS * round32(n_in) / 2
                   : (LIN16W_ROWS * n_in + 15) / 16 * 16);
}

float mha_linear16_prepare(const float *w, int64_t n_out, int64_t n_in,
                           int kernel, int bf, float *dst,
                           OMP_ONLY int threads)
{
    float top = 0.0f;   /* the largest |w| (w is finite) */
#if MHA_BF16_KERNELS
    if (kernel) {   /* pairs of 16-column tiles, one item each */
        const int64_t pairs = (n_out + 31) / 32;
#pragma omp parallel for num_threads(team(threads, pairs)) \
    schedule(static) reduction(max : top)
        for (int64_t t = 0; t < pairs; t++) {
            const float x = mha_bf16_pack_wt(w, n_in, n_out, 2 * t, 2 * t + 2,
                                            (uint32_t *)dst);
            top = x > top ? x : top;
        }
        return top;
    }
#endif
    (void)kernel;
    const int64_t n = n_out * n_in;
#pragma omp parallel for num_threads(team(threads, n / 4096 + 1)) \
    schedule(static) reduction(max : top)
    for (int64_t i = 0; i < n; i++) {
        dst[i] = mha_half_round(w[i], bf);
        top = fabsf(w[i]) > top ? fabsf(w[i]) : top;
    }
    return top;
}

float mha_linear16_prepare_all(const mha_lin16_weight *w, int n, int kernel,
                               int bf, OMP_ONLY int threads)
{
#if MHA_BF16_KERNELS
    if (kernel) {   /* every weight's pairs of 16-column tiles, one team */
        int64_t first[9] = {0};
        for (int i = 0; i < n && i < 8; i++)
            first[i + 1] = first[i] + (w[i].n_out + 31) / 32;
        const int64_t items = first[n < 8 ? n : 8];
        float top = 0.0f;
#pragma omp parallel for num_threads(team(threads, items)) \
    schedule(static) reduction(max : top)
        for (int64_t t = 0; t < items; t++) {
            int i = 0;
            while (t >= first[i + 1])
                i++;
            const int64_t p = t - first[i];
            const float x =
                mha_bf16_pack_wt(w[i].w, w[i].n_in, w[i].n_out, 2 * p,
                                2 * p + 2, (uint32_t *)w[i].dst);
            top = x > top ? x : top;
        }
        return top;
    }
#endif
    float top = 0.0f;
    for (int i = 0; i < n; i++) {
        const float x = mha_linear16_prepare(w[i].w, w[i].n_out, w[i].n_in,
                                             kernel, bf, w[i].dst, threads);
        top = x > top ? x : top;
    }
    return top;
}

void mha_linear16_prepare_t(const float *w, int64_t n_out, int64_t n_in,
                            int kernel, int bf, float *dst,
                            OMP_ONLY int threads)
{
#if MHA_BF16_KERNELS
    if (kernel) {   /* W's columns in pairs of 16-column tiles */
        const int64_t pairs = (n_in + 31) / 32;
#pragma omp parallel for num_threads(team(threads, pairs)) schedule(static)
        for (int64_t t = 0; t < pairs; t++)
            mha_bf16_pack_w(w, n_in, n_out, 2 * t, 2 * t + 2,
                           (uint32_t *)dst);
        return;
    }
#endif
    (void)kernel;   /* W^T (n_in x n_out), rounded */
#pragma omp parallel for num_threads(team(threads, n_in / 64 + 1)) \
    schedule(static)
    for (int64_t i = 0; i < n_in; i++)
        for (int64_t o = 0; o < n_out; o++)
            dst[i * n_out + o] = mha_half_round(w[o * n_in + i], bf);
}

static float widen(uint16_t h, int bf)
{
    return bf ? mha_bf16_to_float(h) : mha_f16_to_float(h);
}

/* One block's rows r0 .. r0 + r - 1, columns c0 .. c0 + n - 1 of one
 * part's product, into C (lin16_cols floats a row), or added to C (acc). */
static void block16(const mha_lin16_part *p, int bf, int kernel,
                    int64_t n_out, int64_t r0, int r, int64_t c0, int n,
                    int acc, float *C, void *xs)
{
    const int64_t n_in = p->n_in, ldx = p->ldx;
    const uint16_t *xb = p->x + r0 * ldx;
#if MHA_BF16_KERNELS
    if (kernel) {
        const int64_t k32 = round32(n_in);
        const uint16_t *a = xb;
        int64_t lda = ldx;
        if (r < LIN16_ROWS || k32 != n_in) {   /* a zero-padded copy */
            uint16_t *s = xs;
            for (int i = 0; i < LIN16_ROWS; i++) {
                const int64_t live = i < r ? n_in : 0;
                memcpy(s + i * k32, xb + i * ldx, (size_t)live * 2);
                memset(s + i * k32 + live, 0, (size_t)(k32 - live) * 2);
            }
            a = s;
            lda = k32;
        }
        const int64_t nnt = (n_out + 31) / 32 * 2;
        mha_bf16_gemm32(C, LIN16_COLS, (int)round32(n), a, (int)lda, (int)k32,
                       (const uint32_t *)p->wt + c0 / 16 * 256, nnt, acc,
                       r > 16);
        return;
    }
#endif
    (void)kernel;
    (void)n_out;
    float *s = xs;
    for (int i = 0; i < r; i++)
        for (int64_t k = 0; k < n_in; k++)
            s[i * n_in + k] = widen(xb[i * ldx + k], bf);
    mha_sgemm(0, 1, r, n, (int)n_in, 1.0f, s, (int)n_in, p->wt + c0 * n_in,
              (int)n_in, acc ? 1.0f : 0.0f, C, LIN16W_COLS);
}

int64_t mha_linear16(const uint16_t *x, int64_t rows, int64_t n_in,
                     int64_t ldx, int bf, int kernel, const float *wt,
                     int64_t n_out, const float *b, uint16_t *y, int64_t ldy,
                     float *scratch, int threads)
{
    const mha_lin16_part p = {x, n_in, ldx, wt};
    return mha_linear16_sum(&p, 1, rows, bf, kernel, n_out, b, y, ldy,
                            scratch, threads);
}

int64_t mha_linear16_sum(const mha_lin16_part *parts, int nparts,
                         int64_t rows, int bf, int kernel, int64_t n_out,
                         const float *b, uint16_t *y, int64_t ldy,
                         float *scratch, OMP_ONLY int threads)
{
    int64_t overflowed = 0;   /* finite sums rounded to +-inf */
    const int R = lin16_rows(kernel), NC = lin16_cols(kernel);
    const int64_t rb = nblocks(rows, R);
    const int64_t items = rb * nblocks(n_out, NC);
    int64_t widest = 0;
    for (int i = 0; i < nparts; i++)
        widest = parts[i].n_in > widest ? parts[i].n_in : widest;
    const int64_t per_thread = mha_linear16_scratch_floats(kernel, widest);
    mha_gemm_serial();
#pragma omp parallel num_threads(team(threads, items))
    {
        omp_one_thread();
        float *C = scratch + thread_num() * per_thread;
        void *xs = C + R * NC;
        kernels_begin(kernel);
#pragma omp for schedule(dynamic, 1) reduction(+ : overflowed)
        for (int64_t it = 0; it < items; it++) {
            const int64_t r0 = it % rb * R;
            const int64_t c0 = it / rb * NC;
            const int r = min_int(R, rows - r0);
            const int n = min_int(NC, n_out - c0);
            for (int i = 0; i < nparts; i++)   /* the parts in order */
                block16(&parts[i], bf, kernel, n_out, r0, r, c0, n, i > 0, C,
                        xs);
            const float *bias = b ? b + c0 : NULL;
            uint16_t *yb = y + r0 * ldy + c0;
#if MHA_BF16_KERNELS
            if (kernel) {
                mha_bf16_round_rows(C, LIN16_COLS, r, n, bias, yb, ldy);
                continue;
            }
#endif
            for (int i = 0; i < r; i++)
                for (int c = 0; c < n; c++) {
                    const float v = C[i * NC + c] + (bias ? bias[c] : 0);
                    const uint16_t h = bf ? mha_bf16_from_float(v)
                                          : mha_f16_from_float(v);
                    yb[i * ldy + c] = h;
                    overflowed += isfinite(v) && isinf(widen(h, bf));
                }
        }
        kernels_end(kernel);
    }
    return overflowed;
}

/* ---- 16-bit data: the weight gradient dW = dy^T x and db ----------------
 *
 * dW (n_out x n_in, float32) sums over every row of dy and x, in one
 * fixed order per element:
 *
 *   kernel tiers: dy^T staged as bf16 rows (mha_bf16_transpose, the A
 *     operand) and x packed as the B operand (K = the rows); each block
 *     of 32 rows x LIN16_COLS columns of dW is one tile GEMM over the
 *     rows in chunks of GRAD16_K (C carried from chunk to chunk).
 *   widened: tiles of GRAD_TILE x GRAD_TILE of dW, the rows in chunks of
 *     GRAD_TILE widened to float32 and multiplied by the backend's SGEMM
 *     (beta 1 after the first chunk) into a tile of sums.
 *
 * The whole sum is formed before it meets dW, so accumulate adds it once.
 *
 * db is the float32 path's: float64 column sums, rows in order.
 */
enum { GRAD16_K = 4096 };   /* rows per chunk: 32 rows of dy^T stay in L2 */

int64_t mha_linear16_grad_floats(int kernel, int64_t rows, int64_t n_out,
                                 int64_t n_in, int threads)
{
    threads = team(threads, INT64_MAX);   /* the most a team can hold */
    if (kernel)   /* dy^T, x packed, each thread's C */
        return (round32(n_out) * round32(rows) / 2 + 15) / 16 * 16 +
               mha_bf16_b_words(rows, n_in) +
               (int64_t)threads * LIN16_ROWS * LIN16_COLS;
    return (int64_t)threads * 3 * GRAD_TILE * GRAD_TILE;
}

/* Rows [r0, r0 + r) and columns [c0, c0 + n) of a 16-bit matrix, widened
 * into s (n floats a row). */
static void widen_block(const uint16_t *x, int64_t ld, int64_t r0, int r,
                        int64_t c0, int n, int bf, float *s)
{
    for (int i = 0; i < r; i++)
        for (int c = 0; c < n; c++)
            s[i * n + c] = widen(x[(r0 + i) * ld + c0 + c], bf);
}

static void db16_block(const uint16_t *dy, int64_t rows, int64_t lddy,
                       int bf, float beta, float *db, int64_t o0, int n)
{
    double acc[DB_COLS];
    for (int o = 0; o < n; o++)
        acc[o] = beta == 0.0f ? 0.0 : (double)db[o0 + o];
    for (int64_t i = 0; i < rows; i++)
        for (int o = 0; o < n; o++)
            acc[o] += widen(dy[i * lddy + o0 + o], bf);
    for (int o = 0; o < n; o++)
        db[o0 + o] = (float)acc[o];
}

void mha_linear16_grad_params(const uint16_t *dy, int64_t rows,
                              int64_t n_out, int64_t lddy, const uint16_t *x,
                              int64_t n_in, int64_t ldx, int bf, int kernel,
                              float beta, float *dw, float *db,
                              float *scratch, OMP_ONLY int threads)
{
    const int64_t rows32 = round32(rows);
    const int64_t ob = kernel ? nblocks(n_out, LIN16_ROWS)
                              : nblocks(n_out, GRAD_TILE);
    const int64_t cb = kernel ? nblocks(n_in, LIN16_COLS)
                              : nblocks(n_in, GRAD_TILE);
    const int64_t tiles = ob * cb;
    const int64_t items = tiles + (db ? nblocks(n_out, DB_COLS) : 0);
    uint16_t *dyt = (uint16_t *)scratch;
    uint32_t *xp = (uint32_t *)scratch +
                   (round32(n_out) * rows32 / 2 + 15) / 16 * 16;
    float *per = kernel ? (float *)(xp + mha_bf16_b_words(rows, n_in))
                        : scratch;
    const int64_t per_thread =
        kernel ? LIN16_ROWS * LIN16_COLS : 3 * GRAD_TILE * GRAD_TILE;
#if MHA_BF16_KERNELS
    if (kernel) {   /* the operands, by chunks of 256 rows */
        const int64_t nkt = rows32 / 32, step = 8;
        const int64_t chunks = nblocks(nkt, step);
#pragma omp parallel for num_threads(team(threads, chunks)) \
    schedule(dynamic, 1)
        for (int64_t t = 0; t < chunks; t++) {
            const int64_t kt1 = (t + 1) * step < nkt ? (t + 1) * step : nkt;
            mha_bf16_transpose(dy, lddy, rows, n_out, t * step, kt1, dyt,
                              rows32);
            mha_bf16_pack_b_rows(x, ldx, 1, rows, n_in, t * step, kt1, xp);
        }
    }
#endif
    (void)dyt;
    (void)xp;
    mha_gemm_serial();
#pragma omp parallel num_threads(team(threads, items))
    {
        omp_one_thread();
        float *C = per + thread_num() * per_thread;
        kernels_begin(kernel);
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (it >= tiles) {
                const int64_t o0 = (it - tiles) * DB_COLS;
                db16_block(dy, rows, lddy, bf, beta, db, o0,
                           min_int(DB_COLS, n_out - o0));
                continue;
            }
            const int64_t o0 = it % ob * (kernel ? LIN16_ROWS : GRAD_TILE);
            const int64_t c0 = it / ob * (kernel ? LIN16_COLS : GRAD_TILE);
            float *d = dw + o0 * n_in + c0;
#if MHA_BF16_KERNELS
            if (kernel) {
                const int m = min_int(LIN16_ROWS, n_out - o0);
                const int n = min_int(LIN16_COLS, n_in - c0);
                const int64_t nnt = (n_in + 31) / 32 * 2;
                for (int64_t k0 = 0; k0 < rows32; k0 += GRAD16_K)
                    mha_bf16_gemm32(
                        C, LIN16_COLS, (int)round32(n), dyt + o0 * rows32 + k0,
                        (int)rows32, min_int(GRAD16_K, rows32 - k0),
                        xp + (k0 / 32 * nnt + c0 / 16) * 256, nnt, k0 > 0,
                        m > 16);
                for (int i = 0; i < m; i++)
                    for (int c = 0; c < n; c++)
                        d[i * n_in + c] = (beta == 0.0f ? 0.0f : d[i * n_in + c]) +
                                          C[i * LIN16_COLS + c];
                continue;
            }
#endif
            const int m = min_int(GRAD_TILE, n_out - o0);
            const int n = min_int(GRAD_TILE, n_in - c0);
            float *sy = C + GRAD_TILE * GRAD_TILE, *sx = sy + GRAD_TILE * GRAD_TILE;
            for (int64_t r0 = 0; r0 < rows; r0 += GRAD_TILE) {
                const int r = min_int(GRAD_TILE, rows - r0);
                widen_block(dy, lddy, r0, r, o0, m, bf, sy);
                widen_block(x, ldx, r0, r, c0, n, bf, sx);
                mha_sgemm(1, 0, m, n, r, 1.0f, sy, m, sx, n, r0 ? 1.0f : 0.0f,
                          C, n);
            }
            for (int i = 0; i < m; i++)   /* the whole sum, then added */
                for (int c = 0; c < n; c++)
                    d[i * n_in + c] = (beta == 0.0f ? 0.0f : d[i * n_in + c]) +
                                      C[i * n + c];
        }
        kernels_end(kernel);
    }
}
