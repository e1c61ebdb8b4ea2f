/*
 * fuzz_tiers.c -- a differential fuzzer of the attention tiers: a module
 * and a forward call built from the input bytes (every option the module
 * takes: grouped-query heads, kdim/vdim, biases, bias_kv, zero_attn,
 * sinks, dropout, a given scale, softcap, ALiBi, a window, RoPE, causal
 * kinds, attention masks of every kind and rank, key padding, key
 * lengths, a head mask, NaN in the data), run on the tier MHA_ISA names
 * (ref, scalar, avx2, avx512; the CPU's best when unset), and judged
 * against the test suite's float64 reference (tests/support/ref.c),
 * which shares no code with the library:
 *
 *   - the output and the per-head weights within the suite's bound
 *     (ref_tolerance: twice the error of a naive float32 run, plus
 *     1e-6 (1 + max |ref|)), the naive error the largest of: the naive
 *     float32 code's in both summation orders (ref_forward_f32_reversed),
 *     and how far the float64 result moves when every input and
 *     parameter moves by a random ulp (the problem's own sensitivity to
 *     rounding); plus what the rounding of the scores themselves moves
 *     (2^-22 of the largest score's sum |scale q_d k_d|, 4 ulp of a
 *     softcap c, times two, of max |ref|); non-finite exactly where the
 *     reference is;
 *   - the same bits with 1 and 3 threads (forward and backward);
 *   - the backward: for the query, key, value and every parameter, the
 *     gradient's inner product with the step x+ - x- (x +- eps u, rounded
 *     to float, so the step is exact) against the float64 reference's
 *     central difference L(x+) - L(x-), L = sum(dout * out), within
 *     1e-3 of sum |g_i| |step_i|.  A wrong gradient element of a tensor
 *     up to 8 x 32 moves this by a few percent.
 *
 * A call the library refuses must leave a message; nothing else is
 * checked then (the module's own tests pin down what it accepts).
 *
 * Built two ways, as the other targets (fuzz/CMakeLists.txt):
 *   - with -fsanitize=fuzzer,address,undefined; scripts/fuzz.sh runs it
 *     on the CPU's best tier for a bounded time:
 *         MHA_ISA=avx2 build-fuzz/fuzz/fuzz_tiers -max_total_time=20 \
 *             NEW_DIR fuzz/corpus/tiers
 *     (scripts/test.sh --all runs the replay below over seeded mutants
 *     of the corpus on every tier the CPU has)
 *   - with fuzz/replay_main.c: CTest's fuzz_replay_tiers_<tier> replays
 *     fuzz/corpus/tiers on each tier.
 * An unavailable tier (MHA_ISA=avx512 on a CPU without it) exits 77 at
 * start, CTest's "skipped".
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "ref.h"

/* A failed check names the tier too. */
static const char *fuzz_who(void)
{
    static char who[64];
    snprintf(who, sizeof who, "fuzz_tiers (%s)", mha_kernel_tier());
    return who;
}
#include "fuzz_common.h"

/* MHA_FUZZ_DEBUG=1 in the environment: each case's configuration and
 * refusals on stderr. */
static int debug;
#define DEBUGF(...) (debug ? (void)fprintf(stderr, __VA_ARGS__) : (void)0)

/* ---- the input: configuration bytes, then a seed for the values ------- */

typedef struct bytes {
    const uint8_t *p;
    size_t n, at;
} bytes;

/* The next byte mod `m` (0 past the end: the smallest configuration). */
static unsigned pick(bytes *in, unsigned m)
{
    return in->at < in->n ? in->p[in->at++] % m : 0;
}

static void fill(float *x, int64_t n, double mag)
{
    for (int64_t k = 0; k < n; k++)
        x[k] = (float)(mag * rng_unit());
}

/* Everything one case needs, owned here and freed by case_free. */
typedef struct fcase {
    mha_config c;
    mha_forward_args a;
    mha_module *m;
    int64_t Lt, nq, nk, nv, no, nw;   /* element counts */
    float slopes[4], head_mask[4];
    int64_t key_lengths[3];
    float *x, *key, *value, *out, *w, *out2, *w2;
    void *attn_mask, *pad_mask;
    int has_nan;
    double ds;   /* a weight's relative error from its scores' rounding */
} fcase;

static void case_free(fcase *f)
{
    mha_free(f->m);
    free(f->x);
    free(f->key);
    free(f->value);
    free(f->out);
    free(f->w);
    free(f->out2);
    free(f->w2);
    free(f->attn_mask);
    free(f->pad_mask);
}

/* Set when a mask adds -1e30: the scores it meets are lost to rounding,
 * in float64 too, so the loss is flat there while the gradient (that of
 * the formula, as torch's) is not; such cases skip the gradient check. */
static int absorbing;

/* A mask tensor: bool (a quarter of the entries set) or additive (a fifth
 * -inf, in one mask of four a tenth -1e30, the rest in [-3, 3]). */
static void *make_mask(mha_mask *mk, mha_mask_kind kind, int ndim,
                       const int64_t *shape)
{
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        mk->shape[d] = shape[d];
        n *= shape[d];
    }
    mk->kind = kind;
    mk->ndim = ndim;
    void *data;
    if (kind == MHA_MASK_ADDITIVE) {
        float *v = malloc((size_t)n * sizeof *v);
        const int huge = rng_next() % 4 == 0;
        for (int64_t k = 0; k < n; k++) {
            const unsigned r = (unsigned)(rng_next() % 10);
            v[k] = r < 2 ? -INFINITY : r < 3 && huge ? -1e30f
                 : (float)(3.0 * rng_unit());
            absorbing |= r == 2 && huge;
        }
        data = v;
    } else {
        uint8_t *v = malloc((size_t)n);
        for (int64_t k = 0; k < n; k++)
            v[k] = rng_next() % 4 == 0;
        data = v;
    }
    mk->data = data;
    return data;
}

/* Reads a configuration from the bytes; 0 when it is one to skip. */
static int case_make(bytes *in, fcase *f)
{
    memset(f, 0, sizeof *f);
    absorbing = 0;
    mha_config *c = &f->c;
    const int64_t H = 1 + pick(in, 4);
    int64_t divisors[4], nd = 0;
    for (int64_t d = 1; d <= H; d++)
        if (H % d == 0)
            divisors[nd++] = d;
    c->num_heads = H;
    c->num_kv_heads = divisors[pick(in, (unsigned)nd)];
    const int64_t dh = 1 + pick(in, 8);
    const unsigned shape = pick(in, 8);
    c->embed_dim = H * dh;
    if (shape & 1) {                 /* heads of a width of their own */
        c->head_dim = dh;
        c->embed_dim = 1 + pick(in, 12);
    }
    const int cross = (shape & 2) != 0;
    if (cross && (shape & 4)) {
        c->kdim = 1 + pick(in, 9);
        c->vdim = 1 + pick(in, 9);
    }
    const unsigned flags = pick(in, 16);
    c->no_bias = flags & 1;
    c->add_bias_kv = (flags & 2) != 0;
    c->add_zero_attn = (flags & 4) != 0;
    c->sinks = (flags & 8) != 0;
    static const float drops[] = {0.0f, 0.0f, 0.1f, 0.5f, 0.9f, 1.0f};
    c->dropout = drops[pick(in, 6)];
    static const float scales[] = {0.0f, 1.0f, 0.01f, 4.0f};
    const unsigned sc = pick(in, 5);
    if (sc < 4) {
        c->scale = scales[sc];
        c->given = MHA_GIVEN_SCALE;
    }
    /* The modifiers. */
    const unsigned mods = pick(in, 64);
    static const float caps[] = {0.0f, 0.5f, 5.0f, 30.0f};
    c->mods.softcap = caps[mods & 3];
    c->mods.alibi = (mods & 4) != 0;
    if (c->mods.alibi && (mods & 8)) {
        for (int64_t h = 0; h < H; h++)
            f->slopes[h] = (float)(0.5 + 0.5 * rng_unit());
        c->mods.alibi_slopes = f->slopes;
    }
    c->mods.window = (mods & 16) != 0;
    c->mods.window_left = (int64_t)pick(in, 5) - 1;
    c->mods.window_right = (int64_t)pick(in, 5) - 1;
    const unsigned rope = (mods >> 5) % 3 ? pick(in, 3) : 0;
    c->mods.rope.style = (mha_rope_style)rope;
    if (rope) {
        c->mods.rope.dims = 2 * (int64_t)pick(in, (unsigned)dh / 2 + 1);
        c->mods.rope.theta = pick(in, 2) ? 100.0f : 0.0f;
    }
    c->seed = rng_next();
    if (mha_create(c, &f->m) != MHA_OK) {
        CHECK(*mha_last_error(), "mha_create refused with no message");
        return 0;
    }
    mha_get_config(f->m, c);

    /* The parameters: the Xavier ones scaled, biases and sinks random. */
    const double mag[] = {1.0, 8.0, 0.05};
    const double pm = mag[pick(in, 3)];
    for (int k = 0; k < mha_param_count(f->m); k++) {
        mha_param_info pi;
        mha_param_info_at(f->m, k, &pi);
        float *v = malloc((size_t)pi.numel * sizeof *v);
        mha_param_get(f->m, pi.name, v, pi.numel);
        for (int64_t e = 0; e < pi.numel; e++)
            v[e] = strstr(pi.name, "weight") ? (float)(v[e] * pm)
                                             : (float)(pm * rng_unit());
        CHECK(mha_param_set(f->m, pi.name, v, pi.numel) == MHA_OK,
              "mha_param_set %s: %s", pi.name, mha_last_error());
        free(v);
    }

    /* The call. */
    mha_forward_args *a = &f->a;
    const int64_t B = 1 + pick(in, 3), Lq = 1 + pick(in, 8);
    const int64_t Lk = cross ? 1 + pick(in, 8) : Lq;
    const int64_t E = c->embed_dim;
    a->batch = B;
    a->q_len = Lq;
    a->kv_len = cross || pick(in, 2) ? Lk : 0;
    f->nq = B * Lq * E;
    f->x = malloc((size_t)f->nq * sizeof *f->x);
    const double xm = mag[pick(in, 3)];
    fill(f->x, f->nq, xm);
    a->query = f->x;
    if (cross) {
        f->nk = B * Lk * c->kdim;
        f->nv = B * Lk * c->vdim;
        f->key = malloc((size_t)f->nk * sizeof *f->key);
        f->value = malloc((size_t)f->nv * sizeof *f->value);
        fill(f->key, f->nk, xm);
        fill(f->value, f->nv, xm);
        a->key = f->key;
        a->value = f->value;
    }
    a->causal = (mha_causal)pick(in, 3);
    const unsigned masks = pick(in, 64);
    if (masks & 3) {
        static const mha_mask_kind kinds[] = {
            MHA_MASK_NONE, MHA_MASK_ALLOW, MHA_MASK_BLOCK, MHA_MASK_ADDITIVE};
        const int ndim = 2 + (int)pick(in, 3);
        const int64_t shape4[4] = {pick(in, 2) ? B : 1, pick(in, 2) ? H : 1,
                                   Lq, Lk};
        const int64_t shape3[3] = {pick(in, 2) ? B : 1, Lq, Lk};
        const int64_t shape2[2] = {Lq, Lk};
        f->attn_mask = make_mask(&a->attn_mask, kinds[masks & 3], ndim,
                                 ndim == 4 ? shape4 : ndim == 3 ? shape3
                                                                : shape2);
    }
    if ((masks >> 2) & 3) {
        static const mha_mask_kind kinds[] = {
            MHA_MASK_NONE, MHA_MASK_BLOCK, MHA_MASK_ALLOW, MHA_MASK_ADDITIVE};
        const int64_t pshape[2] = {B, Lk};
        const int batched = pick(in, 2);
        f->pad_mask = make_mask(&a->key_padding_mask, kinds[(masks >> 2) & 3],
                                batched ? 2 : 1, batched ? pshape : pshape + 1);
    }
    if (masks & 16) {
        for (int64_t b = 0; b < B; b++)
            f->key_lengths[b] = (int64_t)pick(in, (unsigned)Lk + 1);
        a->key_lengths = f->key_lengths;
    }
    if (masks & 32) {
        for (int64_t h = 0; h < H; h++)
            f->head_mask[h] = pick(in, 3) ? (float)(1.0 + rng_unit()) : 0.0f;
        a->head_mask = f->head_mask;
    }
    const unsigned run = pick(in, 16);
    a->training = (run & 1) != 0;
    a->dropout_seed = rng_next();
    if (run & 2) {                 /* one NaN in the data */
        /* In the query, the key or the value (in self-attention the one
         * tensor is all three).  A NaN value whose key's weight underflows
         * to 0 in float32 (exp below -87.3) still reaches the row, as in
         * the float64 reference (weight ~1e-40): the flash tiers once
         * skipped it. */
        f->has_nan = 1;
        float *t = !cross ? f->x : (run & 4) ? f->key
                          : (run & 8) ? f->value : f->x;
        const int64_t n = t == f->x ? f->nq : t == f->key ? f->nk : f->nv;
        t[rng_next() % (uint64_t)n] = NAN;
    }
    a->need_weights = MHA_WEIGHTS_PER_HEAD;
    a->num_threads = 1;
    f->Lt = mha_total_keys(f->m, a->kv_len ? a->kv_len : Lq);
    f->no = B * Lq * E;
    f->nw = B * H * Lq * f->Lt;
    f->out = malloc((size_t)f->no * sizeof *f->out);
    f->w = malloc((size_t)f->nw * sizeof *f->w);
    f->out2 = malloc((size_t)f->no * sizeof *f->out2);
    f->w2 = malloc((size_t)f->nw * sizeof *f->w2);
    DEBUGF("H %lld/%lld dh %lld E %lld B %lld Lq %lld Lk %lld cross %d "
           "flags %u drop %g scale %u mods %u causal %d masks %u run %u\n",
           (long long)H, (long long)c->num_kv_heads, (long long)dh,
           (long long)E, (long long)B, (long long)Lq, (long long)Lk, cross,
           flags, (double)c->dropout, sc, mods, (int)a->causal, masks, run);
    return 1;
}

/* ---- the forward -------------------------------------------------------- */

/* got against the float64 reference: non-finite exactly where it is, and
 * within the suite's tolerance elsewhere, "the error of naive float32"
 * taken as the largest of the ns float32 results in `naive`. */
static void expect_close(const char *what, const float *got,
                         const double *ref, const float *const *naive, int ns,
                         double extra, int64_t n)
{
    double err = 0.0, naive_err = 0.0, big = 0.0;
    for (int64_t k = 0; k < n; k++) {
        CHECK(isfinite(got[k]) == isfinite(ref[k]),
              "%s[%lld] = %g, the reference %g", what, (long long)k,
              (double)got[k], ref[k]);
        if (!isfinite(ref[k]))
            continue;
        err = fmax(err, fabs(got[k] - ref[k]));
        for (int t = 0; t < ns; t++)
            if (isfinite(naive[t][k]))
                naive_err = fmax(naive_err, fabs(naive[t][k] - ref[k]));
        big = fmax(big, fabs(ref[k]));
        if (debug > 1)
            DEBUGF("  %s[%lld] ref %.9g got %.9g naive %.9g\n", what,
                   (long long)k, ref[k], (double)got[k], (double)naive[0][k]);
    }
    const double tol = ref_tolerance(naive_err, big) + extra * big;
    DEBUGF("%s: error %.3g, naive float32 %.3g, tolerance %.3g\n", what,
           err, naive_err, tol);
    CHECK(err <= tol,
          "%s: error %.3g against the float64 reference, tolerance %.3g "
          "(naive float32 %.3g, max |ref| %.3g)", what, err, tol, naive_err,
          big);
}

/* Moves every element of x by a random one unit in the last place or
 * none, keeping a copy in keep. */
static void jiggle(float *x, float *keep, int64_t n)
{
    memcpy(keep, x, (size_t)n * sizeof *x);
    for (int64_t k = 0; k < n; k++) {
        const uint64_t r = rng_next() % 3;
        if (r)
            x[k] = nextafterf(x[k], r == 1 ? INFINITY : -INFINITY);
    }
}

/*
 * The float64 forward of the case with every input and parameter moved
 * by a random ulp: how far rounding at the start alone moves the result,
 * the problem's own sensitivity.  Where it is ill-conditioned (scores of
 * thousands cancelling, a softcap's steep part), float32 codes that round
 * q, k and v differently disagree by about this much, and the naive
 * float32 run may happen to be luckier than this; its error joins the
 * naive ones.  Results as floats.
 */
static void perturbed64(fcase *f, float *out, float *w)
{
    const int64_t np = mha_param_numel(f->m);
    float *p = mha_param_data(f->m);
    float *kp = malloc((size_t)np * sizeof *kp);
    float *kx = malloc((size_t)f->nq * sizeof *kx);
    float *kk = malloc((size_t)(f->nk ? f->nk : 1) * sizeof *kk);
    float *kv = malloc((size_t)(f->nv ? f->nv : 1) * sizeof *kv);
    jiggle(p, kp, np);
    jiggle(f->x, kx, f->nq);
    if (f->key)
        jiggle(f->key, kk, f->nk);
    if (f->value)
        jiggle(f->value, kv, f->nv);
    double *o64 = malloc((size_t)f->no * sizeof *o64);
    double *w64 = malloc((size_t)f->nw * sizeof *w64);
    CHECK(ref_forward_f64(f->m, &f->a, o64, w64) == 0, "reference failed");
    for (int64_t k = 0; k < f->no; k++)
        out[k] = (float)o64[k];
    for (int64_t k = 0; k < f->nw; k++)
        w[k] = (float)w64[k];
    memcpy(p, kp, (size_t)np * sizeof *kp);
    memcpy(f->x, kx, (size_t)f->nq * sizeof *kx);
    if (f->key)
        memcpy(f->key, kk, (size_t)f->nk * sizeof *kk);
    if (f->value)
        memcpy(f->value, kv, (size_t)f->nv * sizeof *kv);
    free(kp);
    free(kx);
    free(kk);
    free(kv);
    free(o64);
    free(w64);
}

/* ---- the backward ------------------------------------------------------- */

static double loss64(const fcase *f, const double *dout, double *out64)
{
    CHECK(ref_forward_f64(f->m, &f->a, out64, NULL) == 0, "reference failed");
    double L = 0.0;
    for (int64_t k = 0; k < f->no; k++)
        L += dout[k] * out64[k];
    return L;
}

/*
 * e(h) = [L(x+) - L(x-)] - <grad, x+ - x->, x+- = fl(x +- h u): the
 * central difference's error, for the tensor x (n floats) moved in place
 * (restored after); param names a parameter to push the moved values
 * into (NULL for an input, read through the args' pointers).  *scale is
 * sum |grad_i (x+ - x-)_i|, *l1 sum |dout_k out_k| at x+, and *terms
 * sum_k |dout_k (out_k(x+) - out_k(x-))|: the size of the terms whose
 * signed sum L(x+) - L(x-) is (directional, below, says why it matters).
 */
static double fd_error(fcase *f, float *x, const float *keep, const float *u,
                       double h, const float *grad, int64_t n,
                       const double *dout, double *out64, const char *param,
                       double *scale, double *l1, double *terms)
{
    float *plus = malloc((size_t)n * sizeof *plus);
    float *minus = malloc((size_t)n * sizeof *minus);
    double *out_plus = malloc((size_t)(f->no ? f->no : 1) * sizeof *out_plus);
    double predicted = 0.0;
    *scale = 0.0;
    for (int64_t k = 0; k < n; k++) {
        plus[k] = (float)(keep[k] + h * u[k]);
        minus[k] = (float)(keep[k] - h * u[k]);
        const double step = (double)plus[k] - (double)minus[k];
        predicted += (double)grad[k] * step;
        *scale += fabs((double)grad[k] * step);
    }
    double L[2];
    for (int s = 0; s < 2; s++) {
        const float *v = s ? minus : plus;
        if (param)
            CHECK(mha_param_set(f->m, param, v, n) == MHA_OK,
                  "mha_param_set %s: %s", param, mha_last_error());
        else
            memcpy(x, v, (size_t)n * sizeof *x);
        L[s] = loss64(f, dout, out64);
        if (s == 0) {
            *l1 = 0.0;
            for (int64_t k = 0; k < f->no; k++)
                *l1 += fabs(dout[k] * out64[k]);
            memcpy(out_plus, out64, (size_t)f->no * sizeof *out64);
        }
    }
    *terms = 0.0;
    for (int64_t k = 0; k < f->no; k++)
        *terms += fabs(dout[k] * (out_plus[k] - out64[k]));
    free(out_plus);
    if (param)
        mha_param_set(f->m, param, keep, n);
    else
        memcpy(x, keep, (size_t)n * sizeof *x);
    free(plus);
    free(minus);
    return (L[0] - L[1]) - predicted;
}

/*
 * The gradient of the tensor x along a random direction u.  The central
 * difference's error is e(h) = a h + c h^3 + ...: a h from the gradient's
 * own error, c h^3 and beyond the difference's truncation (large where
 * the softmax or a softcap is sharp).  Richardson's step removes the cubic
 * term, a h = (8 e(h/2) - e(h)) / 3, and that must be small: within 1e-3
 * of sum |grad_i step_i|, plus the float64 rounding of L (1e-11 of
 * sum |dout out|), plus float32's own floor, 1e-4 of the gradient a
 * tensor of this size has when L moves by sum |dout out| as x moves by
 * max |x| (a gradient far below that is the difference of large float32
 * terms), plus 1e-4 of sum_k |dout_k (out_k(x+) - out_k(x-))|: the
 * gradient is a signed sum over the outputs k, each term carrying
 * float32's relative error (a few eps per operation on its path, 1e-4
 * ~ 1700 eps), and where those terms cancel (a fuzzed case: the sum 25x
 * smaller than its terms) the error is the terms', not the sum's.  The
 * floor's 1e-4 grows by twice f->ds, a weight's relative error from the
 * rounding of its scores (the forward's bound, below): the backward
 * recomputes P = exp(s - lse) from float32 scores and a float32 lse, so
 * where scores are in the thousands a saturated row's P = 1 comes back as
 * 1 +- a few 2^-24 |s|, and dS = P (dP - delta) keeps that share of dP
 * where the float64 reference has dS = 0 (a fuzzed case: scores ~1.3e4,
 * the reference flat in the query, the gradient 7e-6 against a floor of
 * 5.5e-6).  Where the truncation has not yet fallen below that, h is
 * halved, up to 8 times: a gradient error stays the same fraction of
 * sum |grad step| at every h, so a wrong gradient fails at all of them.
 */
static void directional(fcase *f, const char *what, float *x,
                        const float *grad, int64_t n, const double *dout,
                        double *out64, const char *param)
{
    if (n == 0)
        return;
    float *keep = malloc((size_t)n * sizeof *keep);
    float *u = malloc((size_t)n * sizeof *u);
    memcpy(keep, x, (size_t)n * sizeof *x);
    double big = 0.0;
    for (int64_t k = 0; k < n; k++) {
        big = fmax(big, fabs(keep[k]));
        u[k] = (float)rng_unit();
    }
    double h = 1e-4 * (big > 1.0 ? big : 1.0);
    double scale, l1, scale2, l1b, terms, terms2, e1 = 0.0, lin = 0.0,
           tol = 0.0;
    double e2 = fd_error(f, x, keep, u, h, grad, n, dout, out64, param,
                         &scale2, &l1b, &terms2);
    for (int level = 0; level < 8; level++) {
        e1 = e2;
        scale = scale2;
        l1 = l1b;
        terms = terms2;
        double steps = 0.0;   /* sum |step|: scale's size without grad */
        for (int64_t k = 0; k < n; k++)
            steps += 2.0 * h * fabs((double)u[k]);
        tol = 1e-3 * scale + 1e-11 * l1 +
              (1e-4 + 2.0 * f->ds) * l1 / (big > 0.0 ? big : 1.0) * steps +
              1e-4 * terms + 1e-30;
        if (fabs(e1) <= tol) {
            lin = e1;
            break;
        }
        e2 = fd_error(f, x, keep, u, h / 2, grad, n, dout, out64, param,
                      &scale2, &l1b, &terms2);
        lin = (8.0 * e2 - e1) / 3.0;
        if (fabs(lin) <= tol)
            break;
        h /= 2;
    }
    CHECK(fabs(lin) <= tol,
          "gradient of %s: the central difference's error %.3g, after "
          "Richardson %.3g, tolerance %.3g; sum |grad step| %.3g, "
          "sum |dout out| %.3g, sum |dout (out+ - out-)| %.3g", what, e1,
          lin, tol, scale, l1, terms);
    free(keep);
    free(u);
}

static void check_backward(fcase *f)
{
    const int64_t np = mha_param_numel(f->m);
    double *dout = malloc((size_t)f->no * sizeof *dout);
    float *dout32 = malloc((size_t)f->no * sizeof *dout32);
    for (int64_t k = 0; k < f->no; k++)
        dout32[k] = (float)rng_unit(), dout[k] = dout32[k];
    float *g[2][5];   /* per thread count: query, key, value, params, hm */
    const int64_t n[5] = {f->nq, f->nk, f->nv, np, f->c.num_heads};
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < 5; k++)
            g[t][k] = calloc((size_t)(n[k] ? n[k] : 1), sizeof(float));
    mha_status st = MHA_OK;
    for (int t = 0; t < 2 && st == MHA_OK; t++) {
        mha_forward_args a = f->a;
        a.need_weights = MHA_WEIGHTS_NONE;
        a.attn_weights = NULL;
        a.out = f->out2;
        a.num_threads = t ? 3 : 1;
        mha_backward_args b;
        memset(&b, 0, sizeof b);
        b.grad_out = dout32;
        b.grad_query = g[t][0];
        b.grad_key = f->nk ? g[t][1] : NULL;
        b.grad_value = f->nv ? g[t][2] : NULL;
        b.grad_params = g[t][3];
        b.grad_head_mask = f->a.head_mask ? g[t][4] : NULL;
        st = mha_backward(f->m, &a, &b);
        CHECK(st == MHA_OK || *mha_last_error(),
              "mha_backward refused with no message");
    }
    if (st == MHA_OK) {
        for (int k = 0; k < 5; k++)
            CHECK(!memcmp(g[0][k], g[1][k], (size_t)n[k] * sizeof(float)),
                  "gradient %d: 1 and 3 threads differ", k);
    }
    DEBUGF("backward: %s%s; scores' relative rounding %.3g\n",
           st == MHA_OK ? "ran" : mha_last_error(),
           absorbing ? "; -1e30 in a mask: no gradient check" : "", f->ds);
    if (st == MHA_OK && !absorbing) {
        double *out64 = malloc((size_t)f->no * sizeof *out64);
        directional(f, "query", f->x, g[0][0], f->nq, dout, out64, NULL);
        directional(f, "key", f->key, g[0][1], f->nk, dout, out64, NULL);
        directional(f, "value", f->value, g[0][2], f->nv, dout, out64, NULL);
        for (int k = 0; k < mha_param_count(f->m); k++) {
            mha_param_info pi;
            mha_param_info_at(f->m, k, &pi);
            float *v = malloc((size_t)pi.numel * sizeof *v);
            mha_param_get(f->m, pi.name, v, pi.numel);
            directional(f, pi.name, v, g[0][3] + pi.offset, pi.numel, dout,
                        out64, pi.name);
            free(v);
        }
        if (f->a.head_mask)
            directional(f, "head_mask", f->head_mask, g[0][4],
                        f->c.num_heads, dout, out64, NULL);
        free(out64);
    }
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < 5; k++)
            free(g[t][k]);
    free(dout);
    free(dout32);
}

/* ---- one input ---------------------------------------------------------- */

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    debug = getenv("MHA_FUZZ_DEBUG") ? atoi(getenv("MHA_FUZZ_DEBUG")) : 0;
    if (!mha_kernel_tier()) {
        fprintf(stderr, "fuzz_tiers: %s: skipped\n", mha_last_error());
        exit(77);
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    rng_seed_bytes(data, size);
    bytes in = {data, size, 0};
    fcase f;
    if (!case_make(&in, &f)) {
        case_free(&f);
        return 0;
    }
    mha_forward_args a = f.a;
    a.out = f.out;
    a.attn_weights = f.w;
    if (mha_forward(f.m, &a) != MHA_OK) {
        CHECK(*mha_last_error(), "mha_forward refused with no message");
        DEBUGF("refused: %s\n", mha_last_error());
        case_free(&f);
        return 0;
    }
    double *out64 = malloc((size_t)f.no * sizeof *out64);
    double *w64 = malloc((size_t)f.nw * sizeof *w64);
    float *out32 = malloc((size_t)f.no * sizeof *out32);
    float *w32 = malloc((size_t)f.nw * sizeof *w32);
    float *out32r = malloc((size_t)f.no * sizeof *out32r);
    float *w32r = malloc((size_t)f.nw * sizeof *w32r);
    float *out32p = malloc((size_t)(3 * f.no) * sizeof *out32p);
    float *w32p = malloc((size_t)(3 * f.nw) * sizeof *w32p);
    CHECK(ref_forward_f64(f.m, &f.a, out64, w64) == 0, "reference failed");
    const double score_mag = ref_score_magnitude();
    CHECK(ref_forward_f32(f.m, &f.a, out32, w32) == 0, "reference failed");
    CHECK(ref_forward_f32_reversed(f.m, &f.a, out32r, w32r) == 0,
          "reference failed");
    enum { NP = 3 };   /* perturbed samples */
    const float *naive_out[2 + NP] = {out32, out32r};
    const float *naive_w[2 + NP] = {w32, w32r};
    for (int t = 0; t < NP; t++) {
        perturbed64(&f, out32p + t * f.no, w32p + t * f.nw);
        naive_out[2 + t] = out32p + t * f.no;
        naive_w[2 + t] = w32p + t * f.nw;
    }
    /* The scores' own rounding: each is rounded to ~2^-24 of its terms'
     * magnitudes (a few roundings: 4 units; score_mag is the largest,
     * with what a softcap passes on, ref.h), the softcap's vector tanh is
     * within 4 ulp of c (docs/KERNELS.md); a weight moves by at most
     * twice its scores' error (relative), an output row by about as much
     * of its size. */
    const double cap = (double)f.c.mods.softcap;
    const double ds = 4.0 * 0x1p-24 * score_mag +
                      (cap > 0.0 ? 4.0 * 0x1p-23 * cap : 0.0);
    f.ds = ds;
    expect_close("out", f.out, out64, naive_out, 2 + NP, 2.0 * ds, f.no);
    expect_close("weights", f.w, w64, naive_w, 2 + NP, 2.0 * ds, f.nw);
    free(out32r);
    free(w32r);
    free(out32p);
    free(w32p);
    free(out64);
    free(w64);
    free(out32);
    free(w32);

    /* Three threads: the same bits. */
    a.out = f.out2;
    a.attn_weights = f.w2;
    a.num_threads = 3;
    CHECK(mha_forward(f.m, &a) == MHA_OK, "3 threads: %s", mha_last_error());
    CHECK(!memcmp(f.out, f.out2, (size_t)f.no * sizeof *f.out) &&
          !memcmp(f.w, f.w2, (size_t)f.nw * sizeof *f.w),
          "the forward differs between 1 and 3 threads");

    if (!f.has_nan)
        check_backward(&f);
    case_free(&f);
    return 0;
}
