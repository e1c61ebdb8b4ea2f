/*
 * scan.c -- scans of an input before the work starts: the largest finite
 * |x| (the scale's overflow check reads it) and that check itself, and
 * the fingerprint of a call's inputs.
 */
#include "core.h"
#include "half.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* The largest finite |x|, on the bits: for finite numbers |x| orders as
 * its bits without the sign, and Inf and NaN are the patterns whose
 * exponent is all ones (a plain integer max, which vectorises: signed
 * integers, since the library's baseline, SSE2, compares only those). */
float mha_amax_portable(const float *x, int64_t rows, int64_t cols,
                        int64_t ld, int *finite)
{
    int32_t m = 0, all = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            int32_t u;
            memcpy(&u, x + r * ld + c, sizeof u);
            u &= 0x7FFFFFFF;
            all = u > all ? u : all;
            u = u < 0x7F800000 ? u : 0;   /* (NaN, Inf: skipped) */
            m = u > m ? u : m;
        }
    *finite = all < 0x7F800000;
    float f;
    memcpy(&f, &m, sizeof f);
    return f;
}

/* A piece's largest finite |x|: `rows` rows of `cols` elements, ld
 * apart, at x; `how` says which scan. */
typedef float (*piece_max)(const void *x, int64_t rows, int64_t cols,
                           int64_t ld, const void *how);

/* Pieces of about 128 KiB (2^15 floats; whole rows), shared among the
 * threads from two pieces on: a max is exact, so the order of the pieces
 * is free (a scan of q and k on one thread was a visible share of a
 * forward, and the portable loop, on SSE2, a quarter of a short decoding
 * call; the keys of transformers' decoding step, 97K floats, ran on one
 * thread with pieces of 2^16: docs/BENCHMARKS.md).  es: bytes an
 * element. */
static double max_by_pieces(const void *x, size_t es, int64_t rows,
                            int64_t cols, int64_t ld, int threads,
                            piece_max scan, const void *how)
{
    const int64_t piece = (int64_t)((1 << 17) / es);
    if (rows <= 0 || cols <= 0)
        return 0.0;
    const char *base = x;
    const int flat = rows == 1 || ld == cols;
    /* flat: n elements in pieces of `piece`; else n rows, `per` a piece */
    const int64_t n = flat ? rows * cols : rows;
    const int64_t per = flat ? piece : cols >= piece ? 1 : piece / cols;
    const int64_t pieces = (n + per - 1) / per;
    float m = 0.0f;
    (void)threads;   /* (a build without OpenMP ignores the pragma) */
#pragma omp parallel for num_threads(threads) reduction(max : m) \
    schedule(static) if (threads > 1 && rows * cols >= 2 * piece)
    for (int64_t i = 0; i < pieces; i++) {
        const int64_t k = n - i * per < per ? n - i * per : per;
        const float mi =
            flat ? scan(base + (size_t)(i * per) * es, 1, k, k, how)
                 : scan(base + (size_t)(i * per * ld) * es, k, cols, ld, how);
        m = mi > m ? mi : m;
    }
    return m;
}

/* A float piece by the tier's scan (how: its mha_amax_fn). */
static float piece_f32(const void *x, int64_t rows, int64_t cols, int64_t ld,
                       const void *how)
{
    int finite;
    return (*(const mha_amax_fn *)how)(x, rows, cols, ld, &finite);
}

double mha_max_abs_finite(const float *x, int64_t rows, int64_t cols,
                          int64_t ld, int threads, mha_amax_fn amax)
{
    if (!amax)
        amax = mha_amax_portable;
    return max_by_pieces(x, sizeof *x, rows, cols, ld, threads, piece_f32,
                         &amax);
}

/* A 16-bit piece (how: int, nonzero for bfloat16, else IEEE half), on the
 * bits as mha_amax_portable: the magnitude bits, Inf and NaN those at or
 * past the all-ones exponent. */
static float piece_16(const void *x, int64_t rows, int64_t cols, int64_t ld,
                      const void *how)
{
    const uint16_t *h = x;
    const int bf = *(const int *)how;
    const int16_t inf = bf ? 0x7F80 : 0x7C00;
    int16_t m = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            int16_t u = (int16_t)(h[r * ld + c] & 0x7FFF);
            u = u < inf ? u : 0;   /* (NaN, Inf: skipped) */
            m = u > m ? u : m;
        }
    return bf ? mha_bf16_to_float((uint16_t)m) : mha_f16_to_float((uint16_t)m);
}

double mha_max_abs_finite16(const uint16_t *x, int64_t rows, int64_t cols,
                            int64_t ld, int bf, int threads)
{
    return max_by_pieces(x, sizeof *x, rows, cols, ld, threads, piece_16,
                         &bf);
}

int mha_score_range_ok(float scale, int64_t dh, double qmax, double kmax)
{
    return fabs((double)scale) * (double)dh * qmax * kmax <= FLT_MAX;
}

mha_status mha_check_score_range(float scale, int64_t dh, double qmax,
                                 double kmax)
{
    const double bound = fabs((double)scale) * (double)dh * qmax * kmax;
    if (!mha_score_range_ok(scale, dh, qmax, kmax))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "scale %g with max|q| %g and max|k| %g (d_h "
                             "%lld): the scaled scores may reach %g, past "
                             "float32's %g, which would make them Inf and "
                             "the softmax NaN; use a smaller scale (or "
                             "smaller inputs)", (double)scale, qmax, kmax,
                             (long long)dh, bound, (double)FLT_MAX);
    return MHA_OK;
}

uint64_t mha_inputs_fingerprint(const mha_print_buf *bufs, int n,
                                const mha_mask *attn_mask,
                                const mha_mask *key_padding_mask,
                                const int64_t *key_lengths, int64_t B)
{
    uint64_t h = 0;
    for (int i = 0; i < n; i++)
        if (bufs[i].data)
            h = mha_fingerprint(h, bufs[i].data, bufs[i].bytes);
    const mha_mask *masks[2] = {attn_mask, key_padding_mask};
    for (int k = 0; k < 2; k++) {
        const mha_mask *mk = masks[k];
        if (mk->kind == MHA_MASK_NONE)
            continue;
        size_t bytes = mk->kind == MHA_MASK_ADDITIVE ? sizeof(float) : 1;
        for (int d = 0; d < mk->ndim; d++)
            bytes *= (size_t)mk->shape[d];
        h = mha_fingerprint(h, mk->data, bytes);
    }
    if (key_lengths)
        h = mha_fingerprint(h, key_lengths, (size_t)B * sizeof(int64_t));
    return h;
}
