/*
 * ref.h -- the test suite's oracle: a float64 reference of the whole
 * forward pass, and the same code in float32 ("naive float32"), which
 * measures how much error plain single precision makes on a case.
 */
#ifndef MHA_TEST_REF_H
#define MHA_TEST_REF_H

#include "mha.h"

/* out (B, Lq, E); weights (B, H, Lq, Lt) per head, or NULL.  Inputs and
 * parameters are the module's and the arguments', read via the public API;
 * args->out, args->attn_weights and args->need_weights are ignored. */
int ref_forward_f64(const mha_module *m, const mha_forward_args *a,
                    double *out, double *weights);
int ref_forward_f32(const mha_module *m, const mha_forward_args *a,
                    float *out, float *weights);
/* The same float32 code with every sum taken in reverse order: where the
 * result is ill-conditioned (large terms cancelling), one order's error
 * is a single draw; the two together show how much the order moves it
 * (fuzz/fuzz_tiers.c takes the larger error of the two). */
int ref_forward_f32_reversed(const mha_module *m, const mha_forward_args *a,
                             float *out, float *weights);

/* The largest rounding scale of a live score in the last ref_forward_f64:
 * scale * sum_d |q_d k_d| (a float32 dot product rounds to about 2^-24 of
 * its terms' magnitudes, not of its result: q.k = -0.19 from terms
 * summing to 308 in a fuzzed case), times sech^2(s/c) under a softcap c
 * (what the cap passes on of an error in s); additive mask terms under
 * 1e4 too.  The softmax passes a score's error on to its weight. */
double ref_score_magnitude(void);

/* Heads-averaged weights (B, Lq, Lt) from per-head ones (B, H, Lq, Lt). */
void ref_average_heads(const double *per_head, int64_t B, int64_t H,
                       int64_t Lq, int64_t Lt, double *avg);

/* max |x - ref| over n elements; NaN anywhere in x gives +inf. */
double ref_max_err_f32(const float *x, const double *ref, int64_t n);
double ref_max_abs(const double *ref, int64_t n);

/*
 * The tolerance of the test suite: a result is correct when its max error
 * against the float64 reference is at most
 *     2 * (max error of naive float32) + 1e-6 * (1 + max |ref|).
 */
double ref_tolerance(double naive_err, double max_abs_ref);

/*
 * The dropout generator as docs/semantics.md ("Dropout") defines it,
 * written from that definition and not from src/rng.c: 1 if entry
 * (b, h, i, j) is kept for `seed` and drop probability p, 0 if dropped.
 * The reference draws its masks with this, so a library whose
 * mha_dropout_keep drifted from the documented generator disagrees with
 * the reference (and tests/test_dropout.c compares the two bit for bit).
 */
int ref_dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i,
                     int64_t j);

#endif
