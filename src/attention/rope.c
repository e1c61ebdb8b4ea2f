/*
 * rope.c -- rotary position embeddings (Su et al. 2021), as Hugging Face
 * computes them for Llama (NEOX: rotate_half) and GPT-J (interleaved).
 *
 * Pair k (k = 0 .. dims/2 - 1) of a head at position p turns by
 *     angle = (p / scale) * theta^(-2k / dims)
 *     (x0, x1) <- (x0 cos - x1 sin, x0 sin + x1 cos)
 * with (x0, x1) = (x[k], x[k + dims/2]) for NEOX, (x[2k], x[2k+1]) for
 * GPTJ; elements dims .. head_dim - 1 are left as they are.
 *
 * Precision: the frequency, p / scale, the angle, its cosine and sine and
 * the two products are all float64; each output is rounded to float once.
 * So an output differs from the exact rotation of the float inputs by
 * about half an ulp of the larger of |x0|, |x1| (float64 angles stay
 * exact to ~1e-16 relative at every position a sequence can have), and
 * the same row at the same position gives the same bits whatever else is
 * rotated with it.  (Hugging Face computes angles in float32, off by up to
 * ~p * 2^-24 rad: ~2e-4 at p = 4096.)
 */
#include "rope.h"

#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#endif

mha_status mha_rope_resolve(const mha_rope *in, int64_t head_dim,
                            mha_rope *out)
{
    if (!in || !out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "rope: %s is NULL",
                             !in ? "the settings" : "the output");
    mha_rope r = *in;
    if (r.style == MHA_ROPE_NONE && (r.dims || r.theta != 0.0f ||
                                     r.scale != 0.0f))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope.style is MHA_ROPE_NONE but rope.%s is "
                             "set: no rotation reads it; choose a style or "
                             "leave the rope zero",
                             r.dims ? "dims" : r.theta != 0.0f ? "theta"
                                                               : "scale");
    if (r.style == MHA_ROPE_NONE) {
        const mha_rope none = {MHA_ROPE_NONE, 0, 0.0f, 0.0f};
        *out = none;
        return MHA_OK;
    }
    if (r.style != MHA_ROPE_NEOX && r.style != MHA_ROPE_GPTJ)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope.style must be MHA_ROPE_NONE (0), "
                             "MHA_ROPE_NEOX (1) or MHA_ROPE_GPTJ (2), got %d",
                             (int)r.style);
    if (head_dim < 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope: head_dim must be >= 1, got %lld",
                             (long long)head_dim);
    if (r.dims < 0 || r.dims > head_dim || r.dims % 2 != 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope.dims must be even and in [2, head_dim "
                             "%lld] (0: head_dim), got %lld",
                             (long long)head_dim, (long long)r.dims);
    if (r.dims == 0) {
        if (head_dim % 2 != 0)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "rope.dims 0 means head_dim, %lld, which is "
                                 "odd: rotary dims come in pairs, give an "
                                 "even rope.dims < head_dim",
                                 (long long)head_dim);
        r.dims = head_dim;
    }
    if (r.theta == 0.0f)
        r.theta = 10000.0f;
    else if (!(r.theta > 1.0f) || isinf(r.theta))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope.theta must be finite and > 1 (0: 10000), "
                             "got %g", (double)r.theta);
    if (r.scale == 0.0f)
        r.scale = 1.0f;
    else if (!(r.scale > 0.0f) || isinf(r.scale))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope.scale must be finite and > 0 (0: 1), got "
                             "%g", (double)r.scale);
    *out = r;
    return MHA_OK;
}

mha_status mha_rope_check_positions(const int64_t *positions, int64_t n,
                                    const char *who)
{
    for (int64_t r = 0; positions && r < n; r++)
        if (positions[r] < 0 || positions[r] > MHA_ROPE_MAX_POSITION)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "%s[%lld] is %lld: RoPE positions must be "
                                 "in [0, 2^53] (where float64, the angles' "
                                 "precision, holds every integer)", who,
                                 (long long)r, (long long)positions[r]);
    return MHA_OK;
}

/* theta^(-2k / dims), pair k's frequency. */
static double frequency(const mha_rope *rp, int64_t k)
{
    return pow((double)rp->theta, -2.0 * (double)k / (double)rp->dims);
}

/* The frequencies of the first FREQS pairs are computed once per call
 * (the same doubles pow gives row by row); wider rotations compute the
 * rest as they go. */
enum { FREQS = 256 };

/* Row x (heads of dh) at position pos; sign -1 turns it back. */
static void rotate_row(const mha_rope *rp, const double *freqs, double pos,
                       int64_t heads, int64_t dh, float *x, double sign)
{
    const int64_t half = rp->dims / 2;
    const int neox = rp->style == MHA_ROPE_NEOX;
    const double t = pos / (double)rp->scale;
    for (int64_t k = 0; k < half; k++) {
        const double freq = k < FREQS ? freqs[k] : frequency(rp, k);
        const double a = t * freq;
        const double c = cos(a), s = sign * sin(a);
        const int64_t i0 = neox ? k : 2 * k, i1 = neox ? k + half : 2 * k + 1;
        for (int64_t h = 0; h < heads; h++) {
            float *e = x + h * dh;
            const double x0 = e[i0], x1 = e[i1];
            e[i0] = (float)(x0 * c - x1 * s);
            e[i1] = (float)(x0 * s + x1 * c);
        }
    }
}

void mha_rope_rows(const mha_rope *rope, int64_t B, int64_t L,
                   int64_t heads, int64_t head_dim, const int64_t *positions,
                   const int64_t *starts, int64_t start, float *x,
                   int64_t ld, int inverse, int threads)
{
    const double sign = inverse ? -1.0 : 1.0;
    const int64_t rows = B * L;
    double freqs[FREQS];
    for (int64_t k = 0; k < rope->dims / 2 && k < FREQS; k++)
        freqs[k] = frequency(rope, k);
#ifdef _OPENMP
    if (threads <= 0)
        threads = omp_get_max_threads();
    /* Threads only where the trigonometry outweighs waking them. */
    if ((double)rows * (double)rope->dims < 16384.0)
        threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (threads > 1)
#else
    (void)threads;
#endif
    for (int64_t r = 0; r < rows; r++) {
        const int64_t p = positions ? positions[r]
                        : (starts ? starts[r / L] : start) + r % L;
        rotate_row(rope, freqs, (double)p, heads, head_dim, x + r * ld,
                   sign);
    }
}

/* mha_rope_apply, or its inverse (the rotation by minus the angle). */
static mha_status rope_apply(const mha_rope *rope, int64_t rows,
                             int64_t heads, int64_t head_dim,
                             const int64_t *positions, int64_t pos0, float *x,
                             int64_t ld, int inverse)
{
    if (!rope)
        return mha_set_error(MHA_ERR_NULL_POINTER, "rope_apply: rope is "
                             "NULL");
    if (!x)
        return mha_set_error(MHA_ERR_NULL_POINTER, "rope_apply: x is NULL");
    if (rows < 0 || heads < 1 || head_dim < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "rope_apply: rows must be >= 0, heads and "
                             "head_dim >= 1, got %lld, %lld, %lld",
                             (long long)rows, (long long)heads,
                             (long long)head_dim);
    int64_t width, last;
    if (!mha_mul_ok(heads, head_dim, &width))
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "rope_apply: heads %lld x head_dim %lld "
                             "overflows", (long long)heads,
                             (long long)head_dim);
    if (ld < width)
        return mha_set_error(MHA_ERR_SHAPE,
                             "rope_apply: ld %lld is less than a row's %lld "
                             "x %lld = %lld elements", (long long)ld,
                             (long long)heads, (long long)head_dim,
                             (long long)width);
    if (rows > 0 && (!mha_mul_ok(rows - 1, ld, &last) ||
                     last > INT64_MAX / 8 - width))
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "rope_apply: %lld rows of stride %lld overflow",
                             (long long)rows, (long long)ld);
    mha_rope r;
    MHA_CHECK(mha_rope_resolve(rope, head_dim, &r));
    if (positions) {
        MHA_CHECK(mha_rope_check_positions(positions, rows, "positions"));
    } else if (pos0 < 0 || pos0 > MHA_ROPE_MAX_POSITION ||
               (rows > 0 && rows - 1 > MHA_ROPE_MAX_POSITION - pos0)) {
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "rope_apply: pos0 %lld must be >= 0 and pos0 + "
                             "rows - 1 at most 2^53 (RoPE positions are "
                             "exact in float64 up to there)", (long long)pos0);
    }
    if (r.style == MHA_ROPE_NONE || rows == 0)
        return MHA_OK;
    mha_rope_rows(&r, 1, rows, heads, head_dim, positions, NULL, pos0, x, ld,
                  inverse, 0);
    return MHA_OK;
}

mha_status mha_rope_apply(const mha_rope *rope, int64_t rows, int64_t heads,
                          int64_t head_dim, const int64_t *positions,
                          int64_t pos0, float *x, int64_t ld)
{
    return rope_apply(rope, rows, heads, head_dim, positions, pos0, x, ld, 0);
}

mha_status mha_rope_apply_inverse(const mha_rope *rope, int64_t rows,
                                  int64_t heads, int64_t head_dim,
                                  const int64_t *positions, int64_t pos0,
                                  float *x, int64_t ld)
{
    return rope_apply(rope, rows, heads, head_dim, positions, pos0, x, ld, 1);
}
