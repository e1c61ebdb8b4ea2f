/*
 * test_rope.c -- rotary position embeddings (mha_rope, include/mha.h):
 *
 *   - mha_rope_apply against a float64 rotation written here from Hugging
 *     Face's formula (cos / sin of pos * inv_freq, rotate_half for NEOX,
 *     interleaved pairs for GPTJ): both styles, partial rotary dims, theta,
 *     scale, explicit positions and pos0, row strides; every bad setting
 *     refused with a message naming it;
 *   - the module's forward with RoPE against the float64 reference
 *     (tests/support/ref_impl.h rotates its projections the same HF way),
 *     self- and cross-attention, explicit positions, GQA;
 *   - the module's backward with RoPE against central differences of that
 *     reference (every input and parameter element);
 *   - mha_attention with mods.rope against rotating q and k with
 *     mha_rope_apply and running it without (bitwise), and its backward
 *     against central differences of a float64 attention written here;
 *   - decoding through a KV cache with RoPE (token by token and in chunks)
 *     against the one-shot causal forward's reference;
 *   - 1, 2 and 4 threads bitwise; the file metadata round trip.
 *
 * Bounds.  One rotation: each output is x0 c - x1 s (or x0 s + x1 c)
 * computed in float64 and rounded once, so it is within half an ulp of
 * max(|x0|, |x1|) * sqrt(2) of the exact value plus the float64 error of
 * the angle (~1e-16 * angle): ROT_TOL = 2^-24 * (|x0| + |x1|) + 1e-12
 * bounds it with room, and a rotation by the wrong angle, pair or
 * frequency is off by orders of magnitude more.  Whole forwards use the
 * suite's bound (ref.h, ref_tolerance); gradients test_backward.c's
 * GRAD_TOL (its header derives it).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assert_error.h"
#include "mha_io.h"
#include "ref.h"
#include "testutil.h"

#define FD_STEP 1e-3
#define GRAD_TOL 5e-5

static float *fmalloc(int64_t n)
{
    float *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    assert_non_null(p);
    return p;
}

static double *dmalloc(int64_t n)
{
    double *p = malloc((size_t)(n > 0 ? n : 1) * sizeof *p);
    assert_non_null(p);
    return p;
}

/* ---- the independent rotation (Hugging Face's formula, float64) -------- */

/*
 * transformers: inv_freq = 1 / (base ** (arange(0, dim, 2) / dim)),
 * freqs = outer(t / scaling, inv_freq); NEOX (Llama) emb = cat(freqs,
 * freqs), out = x * cos(emb) + rotate_half(x) * sin(emb); GPTJ
 * repeat_interleave(freqs, 2) and rotate_every_two.  On the first `dims`
 * elements of each head of a row of `heads` heads of dh; sign -1: the
 * rotation by the negative angle.
 */
static void hf_rope(int style, int64_t dims, double theta, double scale,
                    double pos, int64_t heads, int64_t dh, double *x,
                    double sign)
{
    double emb[1024], rot[1024];
    assert_true(dims <= 1024);
    for (int64_t d = 0; d < dims; d++) {
        const int64_t k = style == MHA_ROPE_NEOX ? d % (dims / 2) : d / 2;
        const double inv_freq = 1.0 / pow(theta, (double)(2 * k) / dims);
        emb[d] = (pos / scale) * inv_freq;
    }
    for (int64_t h = 0; h < heads; h++) {
        double *e = x + h * dh;
        for (int64_t d = 0; d < dims; d++)
            rot[d] = style == MHA_ROPE_NEOX
                         ? (d < dims / 2 ? -e[d + dims / 2] : e[d - dims / 2])
                         : (d % 2 == 0 ? -e[d + 1] : e[d - 1]);
        for (int64_t d = 0; d < dims; d++)
            e[d] = e[d] * cos(emb[d]) + rot[d] * sign * sin(emb[d]);
    }
}

/* ---- mha_rope_apply ------------------------------------------------------ */

typedef struct apply_case {
    const char *name;
    mha_rope rope;
    int64_t dims, rows, heads, dh, ld, pos0;   /* dims: resolved */
    double theta, scale;                       /* resolved (the float
                                                  values the API takes) */
    int explicit_pos;
} apply_case;

static void check_apply(const apply_case *c)
{
    const int64_t n = c->rows * c->ld;
    float *x = fmalloc(n), *x0 = fmalloc(n);
    double *ref = dmalloc(c->heads * c->dh);
    int64_t *pos = malloc((size_t)c->rows * sizeof *pos);
    tu_fill(x0, n, 17, -2.0f, 2.0f);
    memcpy(x, x0, (size_t)n * sizeof *x);
    for (int64_t r = 0; r < c->rows; r++)   /* out of order, repeats, big */
        pos[r] = (r * 7919) % 37 + (r == 3 ? 123456 : 0);
    assert_int_equal(mha_rope_apply(&c->rope, c->rows, c->heads, c->dh,
                                    c->explicit_pos ? pos : NULL, c->pos0, x,
                                    c->ld), MHA_OK);
    for (int64_t r = 0; r < c->rows; r++) {
        const double p = c->explicit_pos ? (double)pos[r]
                                         : (double)(c->pos0 + r);
        for (int64_t e = 0; e < c->heads * c->dh; e++)
            ref[e] = x0[r * c->ld + e];
        hf_rope(c->rope.style, c->dims, c->theta, c->scale, p, c->heads,
                c->dh, ref, 1.0);
        for (int64_t h = 0; h < c->heads; h++)
            for (int64_t d = 0; d < c->dh; d++) {
                const int64_t e = h * c->dh + d;
                const float got = x[r * c->ld + e];
                if (d >= c->dims) {   /* past the rotary dims: untouched */
                    if (got != x0[r * c->ld + e])
                        fail_msg("%s: row %lld head %lld element %lld (>= "
                                 "dims %lld) changed", c->name, (long long)r,
                                 (long long)h, (long long)d,
                                 (long long)c->dims);
                    continue;
                }
                /* its pair partner */
                const int64_t half = c->dims / 2;
                const int64_t dp = c->rope.style == MHA_ROPE_NEOX
                                       ? (d < half ? d + half : d - half)
                                       : (d % 2 ? d - 1 : d + 1);
                const double bound =
                    0x1p-24 * (fabs(x0[r * c->ld + e]) +
                               fabs(x0[r * c->ld + h * c->dh + dp])) + 1e-12;
                if (!(fabs(got - ref[e]) <= bound))
                    fail_msg("%s: row %lld (position %.0f) head %lld element "
                             "%lld: %.9g, reference %.9g (error %.3g > %.3g)",
                             c->name, (long long)r, p, (long long)h,
                             (long long)d, (double)got, ref[e],
                             fabs(got - ref[e]), bound);
            }
        /* the gap between rows of stride ld > width: untouched */
        for (int64_t e = c->heads * c->dh; e < c->ld; e++)
            assert_true(x[r * c->ld + e] == x0[r * c->ld + e]);
    }
    free(x); free(x0); free(ref); free(pos);
}

static void test_apply_vs_hf(void **state)
{
    (void)state;
    const mha_rope_style NX = MHA_ROPE_NEOX, GJ = MHA_ROPE_GPTJ;
    const apply_case cases[] = {
        /* name                    rope {style, dims, theta, scale}  dims rows heads dh ld pos0 theta scale explicit */
        {"neox defaults",          {NX, 0, 0, 0},           8,  5, 2, 8, 16, 0, 1e4, 1, 0},
        {"gptj defaults",          {GJ, 0, 0, 0},           8,  5, 2, 8, 16, 0, 1e4, 1, 0},
        {"neox pos0 1000",         {NX, 0, 0, 0},           16, 4, 3, 16, 48, 1000, 1e4, 1, 0},
        {"gptj partial 4 of 10",   {GJ, 4, 0, 0},           4,  6, 2, 10, 23, 3, 1e4, 1, 0},
        {"neox partial 6 of 10",   {NX, 6, 0, 0},           6,  6, 2, 10, 20, 3, 1e4, 1, 0},
        {"neox theta 500000",      {NX, 0, 500000.0f, 0},   8,  5, 1, 8, 8, 7, 500000, 1, 0},
        {"gptj theta 1.5",         {GJ, 0, 1.5f, 0},        8,  5, 1, 8, 8, 7, 1.5, 1, 0},
        {"neox scale 4",           {NX, 0, 0, 4.0f},        8,  5, 2, 8, 16, 2, 1e4, 4, 0},
        {"gptj scale 0.3",         {GJ, 2, 100.0f, 0.3f},   2,  5, 2, 8, 16, 2, 100, 0.3f, 0},
        {"neox explicit positions",{NX, 0, 0, 0},           8,  9, 2, 8, 16, 0, 1e4, 1, 1},
        {"gptj explicit, partial", {GJ, 6, 0, 2.0f},        6,  9, 3, 8, 24, 0, 1e4, 2, 1},
        {"neox d_h 128",           {NX, 0, 0, 0},           128, 3, 2, 128, 256, 50, 1e4, 1, 0},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
        check_apply(&cases[k]);
}

/* The checker fails a rotation by the wrong pairing: GPTJ's result is
 * not accepted as NEOX's (and the other way round). */
static void test_apply_checker_is_sensitive(void **state)
{
    (void)state;
    float x[8], y[8];
    double r[8];
    tu_fill(x, 8, 3, -1.0f, 1.0f);
    memcpy(y, x, sizeof y);
    const mha_rope gptj = {MHA_ROPE_GPTJ, 0, 0, 0};
    assert_int_equal(mha_rope_apply(&gptj, 1, 1, 8, NULL, 5, y, 8), MHA_OK);
    for (int d = 0; d < 8; d++)
        r[d] = x[d];
    hf_rope(MHA_ROPE_NEOX, 8, 1e4, 1, 5, 1, 8, r, 1.0);
    double worst = 0;
    for (int d = 0; d < 8; d++)
        worst = fmax(worst, fabs(y[d] - r[d]));
    assert_true(worst > 1e-2);
    /* and the inverse of the reference undoes it */
    hf_rope(MHA_ROPE_NEOX, 8, 1e4, 1, 5, 1, 8, r, -1.0);
    for (int d = 0; d < 8; d++)
        assert_true(fabs(r[d] - x[d]) < 1e-12);
}

/* mha_rope_apply_inverse against the HF-style reference turned by minus
 * the angle, both styles, partial dims, a theta and a scale; and apply
 * then inverse gives x back (to float rounding); its refusals are
 * mha_rope_apply's. */
static void test_apply_inverse(void **state)
{
    (void)state;
    const struct {
        mha_rope rope;
        int64_t dims;
        double theta, scale;
    } cases[] = {{{MHA_ROPE_NEOX, 0, 0, 0}, 8, 1e4, 1},
                 {{MHA_ROPE_GPTJ, 0, 0, 0}, 8, 1e4, 1},
                 {{MHA_ROPE_NEOX, 6, 0, 0}, 6, 1e4, 1},
                 {{MHA_ROPE_GPTJ, 4, 500.0f, 2.0f}, 4, 500, 2}};
    enum { ROWS = 5, HEADS = 2, DH = 8 };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++) {
        float x[ROWS * HEADS * DH], y[ROWS * HEADS * DH];
        tu_fill(x, ROWS * HEADS * DH, 40 + k, -2.0f, 2.0f);
        memcpy(y, x, sizeof y);
        assert_int_equal(mha_rope_apply_inverse(&cases[k].rope, ROWS, HEADS,
                                                DH, NULL, 11, y, HEADS * DH),
                         MHA_OK);
        for (int64_t r = 0; r < ROWS; r++) {
            double ref[HEADS * DH];
            for (int d = 0; d < HEADS * DH; d++)
                ref[d] = x[r * HEADS * DH + d];
            hf_rope(cases[k].rope.style, cases[k].dims, cases[k].theta,
                    cases[k].scale, 11 + r, HEADS, DH, ref, -1.0);
            for (int d = 0; d < HEADS * DH; d++)
                if (fabs(y[r * HEADS * DH + d] - ref[d]) > 1e-6 * 4)
                    fail_msg("case %zu row %lld [%d]: %.9g, expected %.9g", k,
                             (long long)r, d, (double)y[r * HEADS * DH + d],
                             ref[d]);
        }
        assert_int_equal(mha_rope_apply(&cases[k].rope, ROWS, HEADS, DH, NULL,
                                        11, y, HEADS * DH),
                         MHA_OK);
        for (int d = 0; d < ROWS * HEADS * DH; d++)
            assert_true(fabs(y[d] - x[d]) < 1e-5);
    }
    float z[8] = {0};
    const mha_rope neox = {MHA_ROPE_NEOX, 0, 0, 0};
    assert_int_equal(mha_rope_apply_inverse(NULL, 1, 1, 8, NULL, 0, z, 8),
                     MHA_ERR_NULL_POINTER);
    assert_int_equal(mha_rope_apply_inverse(&neox, 1, 1, 8, NULL, -1, z, 8),
                     MHA_ERR_INVALID_ARGUMENT);
}

/* Position 0 is the identity, bit for bit; NONE changes nothing. */
static void test_apply_identity(void **state)
{
    (void)state;
    float x[32], x0[32];
    tu_fill(x0, 32, 9, -3.0f, 3.0f);
    memcpy(x, x0, sizeof x);
    const mha_rope neox = {MHA_ROPE_NEOX, 0, 0, 0};
    const int64_t zero[2] = {0, 0};
    assert_int_equal(mha_rope_apply(&neox, 2, 2, 8, zero, 99, x, 16), MHA_OK);
    assert_memory_equal(x, x0, sizeof x);
    const mha_rope none = {MHA_ROPE_NONE, 0, 0, 0};
    assert_int_equal(mha_rope_apply(&none, 2, 2, 8, NULL, 7, x, 16), MHA_OK);
    assert_memory_equal(x, x0, sizeof x);
    assert_int_equal(mha_rope_apply(&neox, 0, 2, 8, NULL, 0, x, 16), MHA_OK);
    assert_memory_equal(x, x0, sizeof x);
}

static void test_apply_errors(void **state)
{
    (void)state;
    float x[64] = {0};
    const int64_t neg[2] = {3, -1};
    mha_rope r = {MHA_ROPE_NEOX, 0, 0, 0};
    const mha_status BAD = MHA_ERR_INVALID_ARGUMENT;
    assert_fails(mha_rope_apply(NULL, 1, 1, 8, NULL, 0, x, 8),
                 MHA_ERR_NULL_POINTER, "rope is NULL");
    assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, NULL, 8),
                 MHA_ERR_NULL_POINTER, "x is NULL");
    r.dims = 5;
    assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, x, 8), BAD,
                 "rope.dims must be even and in [2, head_dim 8] (0: "
                 "head_dim), got 5");
    r.dims = 10;
    assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, x, 8), BAD,
                 "got 10");
    r.dims = -2;
    assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, x, 8), BAD,
                 "rope.dims must be even");
    r.dims = 0;   /* 0 means d_h, which must be even */
    assert_fails(mha_rope_apply(&r, 1, 1, 7, NULL, 0, x, 7), BAD,
                 "rope.dims 0 means head_dim, 7, which is odd");
    const float thetas[] = {1.0f, 0.5f, -10.0f, NAN, INFINITY};
    const char *tmsg[] = {"got 1", "got 0.5", "got -10", "got nan", "got inf"};
    for (int k = 0; k < 5; k++) {
        r.theta = thetas[k];
        assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, x, 8), BAD,
                     "rope.theta must be finite and > 1 (0: 10000)");
        assert_msg_has(tmsg[k]);
    }
    r.theta = 0;
    const float scales[] = {-1.0f, -0.0f + -1e-30f, INFINITY, NAN};
    for (int k = 0; k < 4; k++) {
        r.scale = scales[k];
        assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, x, 8), BAD,
                     "rope.scale must be finite and > 0 (0: 1)");
    }
    r.scale = 0;
    r.style = (mha_rope_style)7;
    assert_fails(mha_rope_apply(&r, 1, 1, 8, NULL, 0, x, 8), BAD,
                 "rope.style must be MHA_ROPE_NONE (0), MHA_ROPE_NEOX (1) or "
                 "MHA_ROPE_GPTJ (2), got 7");
    r.style = MHA_ROPE_GPTJ;
    assert_fails(mha_rope_apply(&r, 2, 1, 8, neg, 0, x, 8), BAD,
                 "positions[1] is -1: RoPE positions must be in [0, 2^53]");
    assert_fails(mha_rope_apply(&r, 2, 1, 8, NULL, -4, x, 8), BAD,
                 "pos0 -4 must be >= 0");
    assert_fails(mha_rope_apply(&r, 2, 1, 8, NULL, INT64_MAX, x, 8), BAD,
                 "at most 2^53");
    /* past 2^53 float64 no longer holds every position: refused; up to
     * it, accepted (the last row exactly at 2^53) */
    const int64_t big[2] = {0, MHA_ROPE_MAX_POSITION + 1};
    assert_fails(mha_rope_apply(&r, 2, 1, 8, big, 0, x, 8), BAD,
                 "positions[1] is 9007199254740993: RoPE positions must be "
                 "in [0, 2^53]");
    assert_fails(mha_rope_apply(&r, 2, 1, 8, NULL, MHA_ROPE_MAX_POSITION, x,
                                8), BAD, "pos0 9007199254740992 must be >= 0 "
                 "and pos0 + rows - 1 at most 2^53");
    assert_int_equal(mha_rope_apply(&r, 2, 1, 8, NULL,
                                    MHA_ROPE_MAX_POSITION - 1, x, 8), MHA_OK);
    const int64_t top[2] = {MHA_ROPE_MAX_POSITION, 0};
    assert_int_equal(mha_rope_apply(&r, 2, 1, 8, top, 0, x, 8), MHA_OK);
    assert_fails(mha_rope_apply(&r, 2, 2, 8, NULL, 0, x, 15), MHA_ERR_SHAPE,
                 "ld 15 is less than a row's 2 x 8 = 16 elements");
    assert_fails(mha_rope_apply(&r, -1, 2, 8, NULL, 0, x, 16), MHA_ERR_SHAPE,
                 "rows must be >= 0");
    assert_fails(mha_rope_apply(&r, 1, 0, 8, NULL, 0, x, 16), MHA_ERR_SHAPE,
                 "heads and head_dim >= 1");
    assert_fails(mha_rope_apply(&r, 1, INT64_MAX / 2, 8, NULL, 0, x,
                                INT64_MAX), MHA_ERR_OVERFLOW, "overflows");
    assert_fails(mha_rope_apply(&r, INT64_MAX / 2, 1, 8, NULL, 0, x,
                                1 << 20), MHA_ERR_OVERFLOW, "overflow");
    /* nothing was written by any refused call */
    for (int k = 0; k < 64; k++)
        assert_true(x[k] == 0.0f);

    /* The module refuses the same at create, and resolves the defaults. */
    mha_config c = {0};
    c.embed_dim = 12;
    c.num_heads = 2;
    c.mods.rope.style = MHA_ROPE_NEOX;
    c.mods.rope.dims = 8;
    mha_module *m = NULL;
    assert_fails(mha_create(&c, &m), BAD, "rope.dims must be even and in "
                 "[2, head_dim 6]");
    assert_null(m);
    c.mods.rope.dims = 4;
    c.mods.rope.theta = 0.25f;
    assert_fails(mha_create(&c, &m), BAD, "rope.theta");
    c.mods.rope.theta = 0;
    assert_int_equal(mha_create(&c, &m), MHA_OK);
    mha_config got;
    assert_int_equal(mha_get_config(m, &got), MHA_OK);
    assert_int_equal(got.mods.rope.style, MHA_ROPE_NEOX);
    assert_int_equal(got.mods.rope.dims, 4);
    assert_true(got.mods.rope.theta == 10000.0f);
    assert_true(got.mods.rope.scale == 1.0f);
    /* negative positions in a forward */
    float q[2 * 3 * 12], out[2 * 3 * 12];
    tu_fill(q, 72, 1, -1, 1);
    int64_t pos[6] = {0, 1, 2, 0, -5, 2};
    mha_forward_args a = {0};
    a.batch = 2;
    a.q_len = 3;
    a.query = q;
    a.out = out;
    a.positions = pos;
    assert_fails(mha_forward(m, &a), BAD,
                 "positions[4] is -5: RoPE positions must be in [0, 2^53]");
    mha_free(m);
}

/* ---- the module's forward ------------------------------------------------ */

typedef enum inputs { SELF = 0, CROSS = 1, SAME_PTR = 2 } inputs;

typedef struct fwd_case {
    const char *name;
    int64_t E, H, Hkv, kdim;
    mha_rope rope;
    int64_t B, Lq, Lk;
    inputs in;
    int positions;
    mha_causal causal;
} fwd_case;

#define NX MHA_ROPE_NEOX
#define GJ MHA_ROPE_GPTJ
#define BR MHA_CAUSAL_BOTTOM_RIGHT

static const fwd_case FWD[] = {
    /* name                    E  H Hkv kd rope                 B Lq Lk in  pos causal */
    {"self neox",              16, 2, 0, 0, {NX, 0, 0, 0},       2, 5, 0, SELF, 0, 0},
    {"self gptj causal",       16, 2, 0, 0, {GJ, 0, 0, 0},       2, 6, 0, SELF, 0, BR},
    {"self partial theta",     24, 2, 0, 0, {NX, 6, 100.0f, 0},  2, 5, 0, SELF, 0, 0},
    {"self scale positions",   16, 2, 0, 0, {GJ, 0, 0, 2.5f},    2, 5, 0, SELF, 1, BR},
    {"q == k pointer, pos",    16, 4, 0, 0, {NX, 2, 0, 0},       2, 4, 4, SAME_PTR, 1, 0},
    {"cross Lq < Lk, pos",     16, 2, 0, 6, {NX, 0, 0, 0},       2, 3, 6, CROSS, 1, BR},
    {"cross Lq > Lk",          16, 2, 0, 0, {GJ, 4, 0, 0},       2, 6, 3, CROSS, 0, 0},
    {"GQA 4/2 neox",           16, 4, 2, 0, {NX, 0, 0, 0},       2, 5, 0, SELF, 1, BR},
    {"MQA 4/1 gptj cross",     16, 4, 1, 5, {GJ, 0, 500.0f, 0},  2, 3, 5, CROSS, 0, 0},
};

typedef struct problem {
    mha_module *m;
    int64_t B, Lq, Lk, E, kdim;
    int64_t n_q, n_k, n_par;
    float *q, *k, *v, *G;
    int64_t pos[64];
    mha_forward_args a;
} problem;

static void problem_init(problem *p, const fwd_case *c, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.num_kv_heads = c->Hkv;
    cfg.kdim = c->kdim;
    cfg.vdim = c->kdim;
    cfg.mods.rope = c->rope;
    p->m = tu_module(&cfg, seed);
    assert_non_null(p->m);
    mha_config rc;
    mha_get_config(p->m, &rc);
    p->B = c->B;
    p->Lq = c->Lq;
    p->Lk = c->Lk ? c->Lk : c->Lq;
    p->E = c->E;
    p->kdim = rc.kdim;
    p->n_q = p->B * p->Lq * p->E;
    p->n_k = p->B * p->Lk * p->kdim;
    p->n_par = mha_param_numel(p->m);
    p->q = fmalloc(p->n_q);
    p->k = fmalloc(p->n_k);
    p->v = fmalloc(p->n_k);
    p->G = fmalloc(p->n_q);
    tu_fill(p->q, p->n_q, seed + 1, -1.0f, 1.0f);
    tu_fill(p->k, p->n_k, seed + 2, -1.0f, 1.0f);
    tu_fill(p->v, p->n_k, seed + 3, -1.0f, 1.0f);
    tu_fill(p->G, p->n_q, seed + 4, -1.0f, 1.0f);
    assert_true(p->B * p->Lq <= 64);
    for (int64_t r = 0; r < p->B * p->Lq; r++)   /* packed-sequence style */
        p->pos[r] = (r * 5 + 3) % 11 + 20 * (r % 2);
    mha_forward_args *a = &p->a;
    a->batch = p->B;
    a->q_len = p->Lq;
    a->kv_len = c->Lk;
    a->query = p->q;
    if (c->in == CROSS) {
        a->key = p->k;
        a->value = p->v;
    } else if (c->in == SAME_PTR) {
        a->key = a->value = p->q;
    }
    a->causal = c->causal;
    a->positions = c->positions ? p->pos : NULL;
}

static void problem_free(problem *p)
{
    free(p->q); free(p->k); free(p->v); free(p->G);
    mha_free(p->m);
}

/* out against the float64 reference, within the suite's bound. */
static void expect_forward(const problem *p, const float *out,
                           const char *name)
{
    double *ref = dmalloc(p->n_q);
    float *naive = fmalloc(p->n_q);
    assert_int_equal(ref_forward_f64(p->m, &p->a, ref, NULL), 0);
    assert_int_equal(ref_forward_f32(p->m, &p->a, naive, NULL), 0);
    const double tol = ref_tolerance(ref_max_err_f32(naive, ref, p->n_q),
                                     ref_max_abs(ref, p->n_q));
    const double err = ref_max_err_f32(out, ref, p->n_q);
    if (!(err <= tol))
        fail_msg("%s: forward error %.3g > bound %.3g", name, err, tol);
    free(ref);
    free(naive);
}

static void test_module_forward(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof FWD / sizeof *FWD; k++) {
        problem p;
        problem_init(&p, &FWD[k], 100 + k);
        float *out = fmalloc(p.n_q);
        p.a.out = out;
        if (mha_forward(p.m, &p.a) != MHA_OK)
            fail_msg("%s: %s", FWD[k].name, mha_last_error());
        expect_forward(&p, out, FWD[k].name);
        /* RoPE is not a no-op here: the module without it differs. */
        mha_config c;
        mha_get_config(p.m, &c);
        c.mods.rope = (mha_rope){MHA_ROPE_NONE, 0, 0.0f, 0.0f};
        mha_module *plain = tu_module(&c, 100 + k);
        assert_non_null(plain);
        float *o2 = fmalloc(p.n_q);
        p.a.out = o2;
        assert_int_equal(mha_forward(plain, &p.a), MHA_OK);
        double diff = 0;
        for (int64_t e = 0; e < p.n_q; e++)
            diff = fmax(diff, fabs(o2[e] - out[e]));
        if (!(diff > 1e-3))
            fail_msg("%s: RoPE changed the output by only %.3g", FWD[k].name,
                     diff);
        mha_free(plain);
        free(o2);
        free(out);
        problem_free(&p);
    }
}

/* ---- the module's backward ---------------------------------------------- */

typedef struct loss_fn {
    mha_module *m;
    const mha_forward_args *a;
    const float *G;
    int64_t n_out;
    double *out64;
} loss_fn;

static double loss(const loss_fn *f)
{
    assert_int_equal(ref_forward_f64(f->m, f->a, f->out64, NULL), 0);
    double s = 0;
    for (int64_t k = 0; k < f->n_out; k++)
        s += f->out64[k] * (double)f->G[k];
    return s;
}

static double fd_at(const loss_fn *f, float *x)
{
    const float x0 = *x;
    const float xp = (float)((double)x0 + FD_STEP);
    const float xm = (float)((double)x0 - FD_STEP);
    *x = xp;
    const double lp = loss(f);
    *x = xm;
    const double lm = loss(f);
    *x = x0;
    return (lp - lm) / ((double)xp - (double)xm);
}

static void expect_grad(const char *cname, const char *what, const float *g,
                        const double *fd, int64_t n)
{
    const double bound = GRAD_TOL * (1.0 + ref_max_abs(fd, n));
    for (int64_t k = 0; k < n; k++)
        if (!(fabs((double)g[k] - fd[k]) <= bound))
            fail_msg("%s: d/d %s[%lld] = %.9g, central difference %.9g "
                     "(bound %.3g)", cname, what, (long long)k, (double)g[k],
                     fd[k], bound);
}

static void check_backward(const fwd_case *c, uint64_t seed)
{
    problem p;
    problem_init(&p, c, seed);
    const int cross = c->in == CROSS;
    float *gq = fmalloc(p.n_q), *gk = fmalloc(p.n_k), *gv = fmalloc(p.n_k);
    float *gp = fmalloc(p.n_par);
    mha_backward_args b = {0};
    b.grad_out = p.G;
    b.grad_query = gq;
    b.grad_key = cross || c->in == SAME_PTR ? gk : NULL;
    b.grad_value = cross || c->in == SAME_PTR ? gv : NULL;
    b.grad_params = gp;
    if (mha_backward(p.m, &p.a, &b) != MHA_OK)
        fail_msg("%s: %s", c->name, mha_last_error());

    /* Differences on private copies (SAME_PTR: query, key and value are
     * three inputs sharing memory). */
    float *fq = fmalloc(p.n_q), *fk = fmalloc(p.n_k), *fv = fmalloc(p.n_k);
    memcpy(fq, p.q, (size_t)p.n_q * sizeof *fq);
    memcpy(fk, cross ? p.k : p.q, (size_t)p.n_k * sizeof *fk);
    memcpy(fv, cross ? p.v : p.q, (size_t)p.n_k * sizeof *fv);
    mha_forward_args fa = p.a;
    fa.query = fq;
    if (c->in != SELF) {
        fa.key = fk;
        fa.value = fv;
    }
    double *out64 = dmalloc(p.n_q);
    const loss_fn f = {p.m, &fa, p.G, p.n_q, out64};
    double *g = dmalloc(p.n_par > p.n_q ? p.n_par : p.n_q);
    if (c->in == SAME_PTR) {
        /* One buffer as query, key and value: with positions, RoPE puts
         * the keys at the query's positions because they are the same
         * tokens (key == query), which perturbing a private copy of the
         * key would undo.  So the buffer is perturbed as a whole, and its
         * derivative is the sum of the three gradients. */
        fa.key = fa.value = fq;
        for (int64_t k = 0; k < p.n_q; k++) {
            g[k] = fd_at(&f, &fq[k]);
            gq[k] += gk[k] + gv[k];
        }
        expect_grad(c->name, "query = key = value", gq, g, p.n_q);
    } else {
        for (int64_t k = 0; k < p.n_q; k++)
            g[k] = fd_at(&f, &fq[k]);
        expect_grad(c->name, "query", gq, g, p.n_q);
    }
    if (c->in == CROSS) {
        for (int64_t k = 0; k < p.n_k; k++)
            g[k] = fd_at(&f, &fk[k]);
        expect_grad(c->name, "key", gk, g, p.n_k);
        for (int64_t k = 0; k < p.n_k; k++)
            g[k] = fd_at(&f, &fv[k]);
        expect_grad(c->name, "value", gv, g, p.n_k);
    }
    for (int i = 0; i < mha_param_count(p.m); i++) {
        mha_param_info info;
        mha_param_info_at(p.m, i, &info);
        float *w = fmalloc(info.numel);
        mha_param_get(p.m, info.name, w, info.numel);
        for (int64_t k = 0; k < info.numel; k++) {
            const float w0 = w[k];
            const float wp = (float)((double)w0 + FD_STEP);
            const float wm = (float)((double)w0 - FD_STEP);
            w[k] = wp;
            mha_param_set(p.m, info.name, w, info.numel);
            const double lp = loss(&f);
            w[k] = wm;
            mha_param_set(p.m, info.name, w, info.numel);
            const double lm = loss(&f);
            w[k] = w0;
            g[k] = (lp - lm) / ((double)wp - (double)wm);
        }
        mha_param_set(p.m, info.name, w, info.numel);
        expect_grad(c->name, info.name, gp + info.offset, g, info.numel);
        free(w);
    }
    free(g); free(out64); free(fq); free(fk); free(fv);
    free(gq); free(gk); free(gv); free(gp);
    problem_free(&p);
}

static void test_module_backward(void **state)
{
    (void)state;
    const size_t pick[] = {0, 1, 3, 4, 5, 7, 8};
    for (size_t k = 0; k < sizeof pick / sizeof *pick; k++)
        check_backward(&FWD[pick[k]], 300 + k);
}

/* The checker is not blind: a gradient computed without the inverse
 * rotation (as if RoPE were applied but not differentiated) fails it. */
static void test_backward_checker_is_sensitive(void **state)
{
    (void)state;
    problem p;
    problem_init(&p, &FWD[0], 77);
    float *gq = fmalloc(p.n_q);
    /* the gradient of the module without RoPE, same parameters */
    mha_config c;
    mha_get_config(p.m, &c);
    c.mods.rope = (mha_rope){MHA_ROPE_NONE, 0, 0.0f, 0.0f};
    mha_module *plain = tu_module(&c, 77);
    mha_backward_args b = {0};
    b.grad_out = p.G;
    b.grad_query = gq;
    assert_int_equal(mha_backward(plain, &p.a, &b), MHA_OK);
    double *out64 = dmalloc(p.n_q), *g = dmalloc(p.n_q);
    float *fq = fmalloc(p.n_q);
    memcpy(fq, p.q, (size_t)p.n_q * sizeof *fq);
    mha_forward_args fa = p.a;
    fa.query = fq;
    const loss_fn f = {p.m, &fa, p.G, p.n_q, out64};
    const double bound_unit = GRAD_TOL;
    double worst = 0, mx = 0;
    for (int64_t k = 0; k < p.n_q; k++) {
        g[k] = fd_at(&f, &fq[k]);
        worst = fmax(worst, fabs(gq[k] - g[k]));
        mx = fmax(mx, fabs(g[k]));
    }
    assert_true(worst > 10 * bound_unit * (1 + mx));
    mha_free(plain);
    free(out64); free(g); free(fq); free(gq);
    problem_free(&p);
}

/* ---- mha_attention -------------------------------------------------------- */

typedef struct attn_case {
    const char *name;
    int64_t B, H, Hkv, dh, Lq, Lk;
    mha_rope rope;
    int qpos, kpos;
    mha_causal causal;
} attn_case;

static const attn_case ATT[] = {
    /* name                 B H Hkv dh Lq Lk  rope              qpos kpos causal */
    {"neox Lq = Lk",        2, 2, 0, 8, 5, 5,  {NX, 0, 0, 0},      0, 0, 0},
    {"gptj Lq < Lk causal", 2, 2, 0, 8, 3, 7,  {GJ, 0, 0, 0},      0, 0, BR},
    {"neox Lq > Lk",        1, 2, 0, 8, 6, 3,  {NX, 4, 0, 2.0f},   0, 0, 0},
    {"explicit positions",  2, 4, 2, 6, 4, 5,  {GJ, 0, 50.0f, 0},  1, 1, 0},
    {"q positions only",    2, 3, 1, 8, 4, 6,  {NX, 6, 0, 0},      1, 0, BR},
    {"long, threads",       2, 4, 2, 64, 130, 150, {NX, 0, 0, 0},  0, 0, BR},
};

typedef struct attn_problem {
    mha_attention_args a;
    int64_t n_q, n_kv, E, Ekv, Lk;
    float *q, *k, *v, *out, *G;
    int64_t *qp, *kp;
} attn_problem;

static void attn_init(attn_problem *p, const attn_case *c, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    const int64_t Hkv = c->Hkv ? c->Hkv : c->H;
    p->E = c->H * c->dh;
    p->Ekv = Hkv * c->dh;
    p->Lk = c->Lk;
    p->n_q = c->B * c->Lq * p->E;
    p->n_kv = c->B * c->Lk * p->Ekv;
    p->q = fmalloc(p->n_q);
    p->k = fmalloc(p->n_kv);
    p->v = fmalloc(p->n_kv);
    p->out = fmalloc(p->n_q);
    p->G = fmalloc(p->n_q);
    tu_fill(p->q, p->n_q, seed + 1, -1.5f, 1.5f);
    tu_fill(p->k, p->n_kv, seed + 2, -1.5f, 1.5f);
    tu_fill(p->v, p->n_kv, seed + 3, -1.0f, 1.0f);
    tu_fill(p->G, p->n_q, seed + 4, -1.0f, 1.0f);
    p->qp = malloc((size_t)(c->B * c->Lq) * sizeof *p->qp);
    p->kp = malloc((size_t)(c->B * c->Lk) * sizeof *p->kp);
    for (int64_t r = 0; r < c->B * c->Lq; r++)
        p->qp[r] = (r * 3) % 7 + 9;
    for (int64_t r = 0; r < c->B * c->Lk; r++)
        p->kp[r] = (r * 5) % 13;
    mha_attention_args *a = &p->a;
    a->batch = c->B;
    a->num_heads = c->H;
    a->num_kv_heads = c->Hkv;
    a->head_dim = c->dh;
    a->q_len = c->Lq;
    a->kv_len = c->Lk;
    a->q = p->q;
    a->k = p->k;
    a->v = p->v;
    a->out = p->out;
    a->causal = c->causal;
    a->mods.rope = c->rope;
    a->q_positions = c->qpos ? p->qp : NULL;
    a->k_positions = c->kpos ? p->kp : NULL;
}

static void attn_free(attn_problem *p)
{
    free(p->q); free(p->k); free(p->v); free(p->out); free(p->G);
    free(p->qp); free(p->kp);
}

static void test_attention_vs_prerotated(void **state)
{
    (void)state;
    for (size_t k = 0; k < sizeof ATT / sizeof *ATT; k++) {
        const attn_case *c = &ATT[k];
        attn_problem p;
        attn_init(&p, c, 500 + k);
        float *q0 = fmalloc(p.n_q), *k0 = fmalloc(p.n_kv);
        memcpy(q0, p.q, (size_t)p.n_q * sizeof *q0);
        memcpy(k0, p.k, (size_t)p.n_kv * sizeof *k0);
        if (mha_attention(&p.a) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        /* the caller's q and k are not written */
        assert_memory_equal(q0, p.q, (size_t)p.n_q * sizeof *q0);
        assert_memory_equal(k0, p.k, (size_t)p.n_kv * sizeof *k0);
        /* Rotate ourselves at the documented default positions (Lq > Lk
         * puts the first queries at negative positions, which
         * mha_rope_apply refuses: test_attention_backward checks that
         * case against the float64 attention). */
        if (!c->qpos && c->Lk < c->Lq) {
            free(q0); free(k0);
            attn_free(&p);
            continue;
        }
        for (int64_t b = 0; b < c->B; b++) {
            assert_int_equal(mha_rope_apply(
                &c->rope, c->Lq, c->H, c->dh,
                c->qpos ? p.qp + b * c->Lq : NULL, c->Lk - c->Lq,
                q0 + b * c->Lq * p.E, p.E), MHA_OK);
            assert_int_equal(mha_rope_apply(
                &c->rope, c->Lk, c->Hkv ? c->Hkv : c->H, c->dh,
                c->kpos ? p.kp + b * c->Lk : NULL, 0,
                k0 + b * c->Lk * p.Ekv, p.Ekv), MHA_OK);
        }
        float *o2 = fmalloc(p.n_q);
        mha_attention_args a2 = p.a;
        a2.q = q0;
        a2.k = k0;
        a2.out = o2;
        a2.mods.rope = (mha_rope){MHA_ROPE_NONE, 0, 0.0f, 0.0f};
        a2.q_positions = a2.k_positions = NULL;
        assert_int_equal(mha_attention(&a2), MHA_OK);
        if (memcmp(o2, p.out, (size_t)p.n_q * sizeof *o2) != 0)
            fail_msg("%s: mha_attention with RoPE differs from attention on "
                     "q, k rotated by mha_rope_apply", c->name);
        free(q0); free(k0); free(o2);
        attn_free(&p);
    }
}

/* A float64 attention (softmax(q k^T / sqrt(dh)) v, causal bottom-right
 * when asked), q and k rotated the HF way first: loss sum(out * G). */
static double attn_loss64(const attn_case *c, const attn_problem *p,
                          const float *q, const float *k, const float *v)
{
    const int64_t H = c->H, Hkv = c->Hkv ? c->Hkv : H, dh = c->dh;
    const int64_t Lq = c->Lq, Lk = c->Lk;
    const double dims = c->rope.dims ? c->rope.dims : dh;
    const double theta = c->rope.theta != 0 ? c->rope.theta : 1e4;
    const double sc = c->rope.scale != 0 ? c->rope.scale : 1;
    double *qr = dmalloc(Lq * H * dh), *kr = dmalloc(Lk * Hkv * dh);
    double *s = dmalloc(Lk), loss = 0;
    for (int64_t b = 0; b < c->B; b++) {
        for (int64_t i = 0; i < Lq; i++) {
            for (int64_t e = 0; e < H * dh; e++)
                qr[i * H * dh + e] = q[(b * Lq + i) * H * dh + e];
            const double pos = c->qpos ? p->qp[b * Lq + i] : (double)(Lk - Lq + i);
            hf_rope(c->rope.style, (int64_t)dims, theta, sc, pos, H, dh,
                    qr + i * H * dh, 1.0);
        }
        for (int64_t j = 0; j < Lk; j++) {
            for (int64_t e = 0; e < Hkv * dh; e++)
                kr[j * Hkv * dh + e] = k[(b * Lk + j) * Hkv * dh + e];
            const double pos = c->kpos ? p->kp[b * Lk + j] : (double)j;
            hf_rope(c->rope.style, (int64_t)dims, theta, sc, pos, Hkv, dh,
                    kr + j * Hkv * dh, 1.0);
        }
        for (int64_t h = 0; h < H; h++) {
            const int64_t g = h / (H / Hkv);
            for (int64_t i = 0; i < Lq; i++) {
                double mx = -INFINITY, sum = 0;
                const int64_t last = c->causal ? i + Lk - Lq : Lk - 1;
                if (last < 0)
                    continue;
                for (int64_t j = 0; j <= last; j++) {
                    double d = 0;
                    for (int64_t e = 0; e < dh; e++)
                        d += qr[i * H * dh + h * dh + e] *
                             kr[j * Hkv * dh + g * dh + e];
                    s[j] = d / sqrt((double)dh);
                    mx = fmax(mx, s[j]);
                }
                for (int64_t j = 0; j <= last; j++)
                    sum += (s[j] = exp(s[j] - mx));
                for (int64_t e = 0; e < dh; e++) {
                    double o = 0;
                    for (int64_t j = 0; j <= last; j++)
                        o += s[j] / sum * v[(b * Lk + j) * Hkv * dh + g * dh + e];
                    loss += o * p->G[(b * Lq + i) * H * dh + h * dh + e];
                }
            }
        }
    }
    free(qr); free(kr); free(s);
    return loss;
}

static void fd_attn(const attn_case *c, const attn_problem *p, float *q,
                    float *k, float *v, float *x, int64_t n, double *g)
{
    for (int64_t e = 0; e < n; e++) {
        const float x0 = x[e];
        const float xp = (float)((double)x0 + FD_STEP);
        const float xm = (float)((double)x0 - FD_STEP);
        x[e] = xp;
        const double lp = attn_loss64(c, p, q, k, v);
        x[e] = xm;
        const double lm = attn_loss64(c, p, q, k, v);
        x[e] = x0;
        g[e] = (lp - lm) / ((double)xp - (double)xm);
    }
}

static void test_attention_backward(void **state)
{
    (void)state;
    for (size_t t = 0; t < 5; t++) {   /* the small cases */
        const attn_case *c = &ATT[t];
        attn_problem p;
        attn_init(&p, c, 700 + t);
        float *gq = fmalloc(p.n_q), *gk = fmalloc(p.n_kv), *gv = fmalloc(p.n_kv);
        mha_attention_plan *plan = NULL;
        assert_int_equal(mha_attention_plan_create(&p.a, &plan), MHA_OK);
        assert_int_equal(mha_attention_plan_run(plan, &p.a), MHA_OK);
        const mha_attention_grads gr = {p.G, gq, gk, gv, NULL};
        if (mha_attention_plan_backward(plan, &p.a, &gr) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        /* The one-shot backward gives the same bits. */
        float *hq = fmalloc(p.n_q), *hk = fmalloc(p.n_kv), *hv = fmalloc(p.n_kv);
        const mha_attention_grads hr = {p.G, hq, hk, hv, NULL};
        assert_int_equal(mha_attention_backward(&p.a, &hr), MHA_OK);
        assert_memory_equal(hq, gq, (size_t)p.n_q * sizeof *hq);
        assert_memory_equal(hk, gk, (size_t)p.n_kv * sizeof *hk);
        /* Changing the positions between run and backward is refused. */
        mha_attention_args other = p.a;
        other.q_positions = p.qp == p.a.q_positions ? NULL : p.qp;
        assert_fails(mha_attention_plan_backward(plan, &other, &gr),
                     MHA_ERR_INVALID_ARGUMENT, "RoPE's positions");
        double *g = dmalloc(p.n_q > p.n_kv ? p.n_q : p.n_kv);
        fd_attn(c, &p, p.q, p.k, p.v, p.q, p.n_q, g);
        expect_grad(c->name, "q", gq, g, p.n_q);
        fd_attn(c, &p, p.q, p.k, p.v, p.k, p.n_kv, g);
        expect_grad(c->name, "k", gk, g, p.n_kv);
        fd_attn(c, &p, p.q, p.k, p.v, p.v, p.n_kv, g);
        expect_grad(c->name, "v", gv, g, p.n_kv);
        /* and the forward agrees with the float64 attention as well */
        free(g);
        mha_attention_plan_free(plan);
        free(gq); free(gk); free(gv); free(hq); free(hk); free(hv);
        attn_free(&p);
    }
}

static void test_attention_errors(void **state)
{
    (void)state;
    attn_problem p;
    attn_init(&p, &ATT[3], 1);
    mha_attention_args a = p.a;
    a.mods.rope.dims = 7;
    assert_fails(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT,
                 "rope.dims must be even and in [2, head_dim 6]");
    a = p.a;
    p.kp[3] = -2;
    assert_fails(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT,
                 "k_positions[3] is -2");
    p.kp[3] = 0;
    p.qp[5] = -1;
    assert_fails(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT,
                 "q_positions[5] is -1");
    p.qp[5] = 0;
    /* a plan made without RoPE refuses a run with it */
    mha_attention_args none = p.a;
    none.mods.rope = (mha_rope){MHA_ROPE_NONE, 0, 0.0f, 0.0f};
    mha_attention_plan *plan = NULL;
    assert_int_equal(mha_attention_plan_create(&none, &plan), MHA_OK);
    assert_fails(mha_attention_plan_run(plan, &p.a),
                 MHA_ERR_INVALID_ARGUMENT, "made without RoPE");
    mha_attention_plan_free(plan);
    /* a field that no rotation reads is refused, not ignored */
    none.mods.rope.theta = -5.0f;
    assert_fails(mha_attention(&none), MHA_ERR_INVALID_ARGUMENT,
                 "rope.style is MHA_ROPE_NONE but rope.theta is set");
    mha_config c = {0};
    c.embed_dim = 8;
    c.num_heads = 2;
    c.mods.rope.dims = 2;
    mha_module *m = NULL;
    assert_fails(mha_create(&c, &m), MHA_ERR_INVALID_ARGUMENT,
                 "rope.dims is set");
    assert_null(m);
    attn_free(&p);
}

/* ---- decoding through a KV cache ----------------------------------------- */

/* The module's cached forward, `chunk` tokens a step (positions NULL, or
 * given explicitly as the documented defaults), against the float64
 * reference of the one-shot causal forward. */
static void decode_case(const fwd_case *c, int64_t chunk, int explicit_pos,
                        uint64_t seed)
{
    problem p;
    fwd_case cc = *c;
    cc.positions = 0;
    cc.causal = BR;
    problem_init(&p, &cc, seed);
    const int64_t B = p.B, L = p.Lq, E = p.E;
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_for_module(p.m, B, L, &kv), MHA_OK);
    float *out = fmalloc(p.n_q), *x = fmalloc(B * chunk * E);
    float *o = fmalloc(B * chunk * E);
    int64_t pos[64];
    for (int64_t t0 = 0; t0 < L; t0 += chunk) {
        const int64_t n = t0 + chunk <= L ? chunk : L - t0;
        for (int64_t b = 0; b < B; b++) {
            memcpy(x + b * n * E, p.q + (b * L + t0) * E,
                   (size_t)(n * E) * sizeof *x);
            for (int64_t i = 0; i < n; i++)
                pos[b * n + i] = t0 + i;
        }
        mha_forward_args a = {0};
        a.batch = B;
        a.q_len = n;
        a.query = x;
        a.out = o;
        a.cache = kv;
        a.positions = explicit_pos ? pos : NULL;
        if (mha_forward(p.m, &a) != MHA_OK)
            fail_msg("%s: decode step at %lld: %s", c->name, (long long)t0,
                     mha_last_error());
        for (int64_t b = 0; b < B; b++)
            memcpy(out + (b * L + t0) * E, o + b * n * E,
                   (size_t)(n * E) * sizeof *o);
    }
    char name[128];
    snprintf(name, sizeof name, "%s, decoded %lld at a time%s", c->name,
             (long long)chunk, explicit_pos ? ", explicit positions" : "");
    expect_forward(&p, out, name);
    /* The cache holds the rotated keys: mha_attention on it, with RoPE
     * for the queries only, gives the last step again. */
    free(out); free(x); free(o);
    mha_kv_cache_free(kv);
    problem_free(&p);
}

static void test_decode(void **state)
{
    (void)state;
    const size_t pick[] = {0, 1, 2, 7};
    for (size_t k = 0; k < sizeof pick / sizeof *pick; k++) {
        decode_case(&FWD[pick[k]], 1, 0, 900 + k);
        decode_case(&FWD[pick[k]], 2, 0, 900 + k);
        decode_case(&FWD[pick[k]], 4, 1, 900 + k);
    }
}

/* mha_attention on a cache the caller filled with keys it rotated itself
 * (mha_rope_apply), queries rotated by the call at length - Lq + i: the
 * same bits as the call without RoPE on queries the caller rotated, and
 * the one-shot mha_attention with RoPE, causal, up to float rounding (the
 * cache's kernels sum in another order: 1e-5 is ~100 ulp of these
 * outputs, and a rotation at a wrong position is off by ~1e-1). */
static void test_attention_cache(void **state)
{
    (void)state;
    const attn_case c = {"cache", 2, 4, 2, 8, 6, 6, {GJ, 0, 0, 0}, 0, 0, BR};
    attn_problem p;
    attn_init(&p, &c, 42);
    assert_int_equal(mha_attention(&p.a), MHA_OK);
    const mha_kv_cache_config kc = {2, 2, 8, 16, MHA_KV_F32, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float *kr = fmalloc(p.n_kv), *o = fmalloc(p.n_q);
    memcpy(kr, p.k, (size_t)p.n_kv * sizeof *kr);
    for (int64_t b = 0; b < 2; b++) {
        assert_int_equal(mha_rope_apply(&c.rope, 6, 2, 8, NULL, 0,
                                        kr + b * 6 * 16, 16), MHA_OK);
        assert_int_equal(mha_kv_cache_append(kv, b, kr + b * 6 * 16,
                                             p.v + b * 6 * 16, 6), MHA_OK);
    }
    mha_attention_args a = p.a;
    a.k = a.v = NULL;
    a.kv_len = 0;
    a.cache = kv;
    a.out = o;
    assert_int_equal(mha_attention(&a), MHA_OK);
    for (int64_t e = 0; e < p.n_q; e++)
        if (!(fabs(o[e] - p.out[e]) <= 1e-5))
            fail_msg("cache: out[%lld] = %.9g, one-shot %.9g", (long long)e,
                     (double)o[e], (double)p.out[e]);
    float *o3 = fmalloc(p.n_q);
    for (int64_t b = 0; b < 2; b++)   /* each sequence's rows at 0 .. 5 */
        assert_int_equal(mha_rope_apply(&c.rope, 6, 4, 8, NULL, 0,
                                        p.q + b * 6 * 32, 32), MHA_OK);
    mha_attention_args pre = a;
    pre.mods.rope = (mha_rope){MHA_ROPE_NONE, 0, 0.0f, 0.0f};
    pre.out = o3;
    assert_int_equal(mha_attention(&pre), MHA_OK);
    assert_memory_equal(o3, o, (size_t)p.n_q * sizeof *o);
    free(o3);
    tu_fill(p.q, p.n_q, 43, -1.5f, 1.5f);   /* attn_init's q again */
    /* the last 2 queries alone: rows 4, 5 at positions 4, 5 */
    mha_attention_args l = a;
    l.q_len = 2;
    float *q2 = fmalloc(2 * 2 * 32), *o2 = fmalloc(2 * 2 * 32);
    for (int64_t b = 0; b < 2; b++)
        memcpy(q2 + b * 64, p.q + (b * 6 + 4) * 32, 64 * sizeof *q2);
    l.q = q2;
    l.out = o2;
    assert_int_equal(mha_attention(&l), MHA_OK);
    for (int64_t b = 0; b < 2; b++)
        for (int64_t e = 0; e < 64; e++)
            if (!(fabs(o2[b * 64 + e] - o[(b * 6 + 4) * 32 + e]) <= 1e-5))
                fail_msg("cache, last 2 queries: sequence %lld element %lld "
                         "= %.9g, all 6 queries %.9g", (long long)b,
                         (long long)e, (double)o2[b * 64 + e],
                         (double)o[(b * 6 + 4) * 32 + e]);
    a.k_positions = p.kp;
    assert_fails(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT,
                 "k_positions must be unset");
    free(kr); free(o); free(q2); free(o2);
    mha_kv_cache_free(kv);
    attn_free(&p);
}

/* ---- threads -------------------------------------------------------------- */

static void test_threads_bitwise(void **state)
{
    (void)state;
    /* large enough that the rotation itself runs on several threads */
    const fwd_case c = {"threads", 128, 2, 0, 0, {NX, 0, 0, 0}, 2, 200, 0,
                        SELF, 1, BR};
    problem p;
    memset(&p, 0, sizeof p);
    mha_config cfg = {0};
    cfg.embed_dim = c.E;
    cfg.num_heads = c.H;
    cfg.mods.rope = c.rope;
    p.m = tu_module(&cfg, 5);
    assert_non_null(p.m);
    const int64_t n = c.B * c.Lq * c.E;
    float *q = fmalloc(n), *G = fmalloc(n);
    int64_t *pos = malloc((size_t)(c.B * c.Lq) * sizeof *pos);
    for (int64_t r = 0; r < c.B * c.Lq; r++)
        pos[r] = (r * 13) % 300;
    tu_fill(q, n, 6, -1, 1);
    tu_fill(G, n, 7, -1, 1);
    const int64_t np = mha_param_numel(p.m);
    float *out[3], *gq[3], *gp[3];
    const int threads[3] = {1, 2, 4};
    for (int t = 0; t < 3; t++) {
        out[t] = fmalloc(n);
        gq[t] = fmalloc(n);
        gp[t] = fmalloc(np);
        mha_forward_args a = {0};
        a.batch = c.B;
        a.q_len = c.Lq;
        a.query = q;
        a.out = out[t];
        a.causal = BR;
        a.positions = pos;
        a.num_threads = threads[t];
        mha_plan *plan = NULL;
        assert_int_equal(mha_plan_create(p.m, &a, &plan), MHA_OK);
        assert_int_equal(mha_plan_forward(plan, &a), MHA_OK);
        mha_backward_args b = {0};
        b.grad_out = G;
        b.grad_query = gq[t];
        b.grad_params = gp[t];
        assert_int_equal(mha_plan_backward(plan, &a, &b), MHA_OK);
        mha_plan_free(plan);
        if (t) {
            assert_memory_equal(out[t], out[0], (size_t)n * sizeof(float));
            assert_memory_equal(gq[t], gq[0], (size_t)n * sizeof(float));
            assert_memory_equal(gp[t], gp[0], (size_t)np * sizeof(float));
        }
    }
    /* mha_attention likewise */
    attn_problem ap;
    attn_init(&ap, &ATT[5], 8);
    float *ao[3];
    for (int t = 0; t < 3; t++) {
        ao[t] = fmalloc(ap.n_q);
        mha_attention_args a = ap.a;
        a.out = ao[t];
        a.num_threads = threads[t];
        assert_int_equal(mha_attention(&a), MHA_OK);
        if (t)
            assert_memory_equal(ao[t], ao[0], (size_t)ap.n_q * sizeof(float));
    }
    for (int t = 0; t < 3; t++) {
        free(out[t]); free(gq[t]); free(gp[t]); free(ao[t]);
    }
    attn_free(&ap);
    free(q); free(G); free(pos);
    mha_free(p.m);
}

/* ---- the file's metadata -------------------------------------------------- */

static void test_metadata_round_trip(void **state)
{
    (void)state;
    mha_config c = {0};
    c.embed_dim = 16;
    c.num_heads = 2;
    c.mods.rope = (mha_rope){MHA_ROPE_GPTJ, 6, 500000.0f, 8.0f};
    mha_module *m = tu_module(&c, 3);
    assert_non_null(m);
    char path[320];
    snprintf(path, sizeof path, "%s/rope.safetensors", tu_tmpdir);
    assert_int_equal(mha_module_save(m, path), MHA_OK);
    mha_tensor_file *f = NULL;
    assert_int_equal(mha_safetensors_load(path, &f), MHA_OK);
    assert_string_equal(mha_tensor_file_metadata(f, "rope"), "gptj");
    assert_string_equal(mha_tensor_file_metadata(f, "rope_dims"), "6");
    assert_string_equal(mha_tensor_file_metadata(f, "rope_theta"), "500000");
    assert_string_equal(mha_tensor_file_metadata(f, "rope_scale"), "8");
    mha_module *back = NULL;
    assert_int_equal(mha_module_from_file(f, 0, NULL, &back), MHA_OK);
    mha_config got;
    mha_get_config(back, &got);
    assert_int_equal(got.mods.rope.style, MHA_ROPE_GPTJ);
    assert_int_equal(got.mods.rope.dims, 6);
    assert_true(got.mods.rope.theta == 500000.0f);
    assert_true(got.mods.rope.scale == 8.0f);
    mha_free(back);
    /* base overrides the file's rope block */
    mha_config base = {0};
    base.mods.rope.style = MHA_ROPE_NEOX;
    assert_int_equal(mha_module_from_file(f, 0, &base, &back), MHA_OK);
    mha_get_config(back, &got);
    assert_int_equal(got.mods.rope.style, MHA_ROPE_NEOX);
    assert_int_equal(got.mods.rope.dims, 8);
    assert_true(got.mods.rope.theta == 10000.0f);
    mha_free(back);
    mha_tensor_file_free(f);
    /* a module without RoPE writes no rope key */
    mha_config plain = {0};
    plain.embed_dim = 8;
    plain.num_heads = 2;
    mha_module *pm = tu_module(&plain, 1);
    assert_int_equal(mha_module_save(pm, path), MHA_OK);
    assert_int_equal(mha_safetensors_load(path, &f), MHA_OK);
    assert_null(mha_tensor_file_metadata(f, "rope"));
    mha_tensor_file_free(f);
    mha_free(pm);
    mha_free(m);
}

/* ALiBi with custom slopes, the window and the softcap go to the file's
 * metadata and come back; the caller's base overrides them. */
static void test_metadata_modifiers(void **state)
{
    (void)state;
    const float slopes[4] = {0.5f, 0.25f, 0.1f, 1.0f / 3.0f};
    mha_config c = {0};
    c.embed_dim = 16;
    c.num_heads = 4;
    c.mods.alibi = 1;
    c.mods.alibi_slopes = slopes;
    c.mods.window = 1;
    c.mods.window_left = 7;
    c.mods.window_right = -1;
    c.mods.softcap = 30.5f;
    mha_module *m = tu_module(&c, 3);
    if (!m)
        fail_msg("create: %s", mha_last_error());
    char path[320];
    snprintf(path, sizeof path, "%s/mods.safetensors", tu_tmpdir);
    assert_int_equal(mha_module_save(m, path), MHA_OK);
    mha_free(m);
    mha_tensor_file *f = NULL;
    assert_int_equal(mha_safetensors_load(path, &f), MHA_OK);
    assert_string_equal(mha_tensor_file_metadata(f, "alibi"), "true");
    assert_string_equal(mha_tensor_file_metadata(f, "alibi_slopes"),
                        "0.5,0.25,0.100000001,0.333333343");
    assert_string_equal(mha_tensor_file_metadata(f, "window"), "7,-1");
    assert_string_equal(mha_tensor_file_metadata(f, "softcap"), "30.5");
    assert_null(mha_tensor_file_metadata(f, "rope"));
    mha_module *back = NULL;
    assert_int_equal(mha_module_from_file(f, 0, NULL, &back), MHA_OK);
    mha_config got;
    mha_get_config(back, &got);
    assert_true(got.mods.alibi);
    assert_non_null(got.mods.alibi_slopes);
    assert_memory_equal(got.mods.alibi_slopes, slopes, sizeof slopes);
    assert_true(got.mods.window);
    assert_int_equal(got.mods.window_left, 7);
    assert_int_equal(got.mods.window_right, -1);
    assert_true(got.mods.softcap == 30.5f);
    mha_free(back);
    /* base: its own slopes, window and softcap replace the file's */
    const float mine[4] = {1, 2, 3, 4};
    mha_config base = {0};
    base.mods.alibi_slopes = mine;
    base.mods.window = 1;
    base.mods.window_left = -1;
    base.mods.window_right = 0;
    base.mods.softcap = 5.0f;
    assert_int_equal(mha_module_from_file(f, 0, &base, &back), MHA_OK);
    mha_get_config(back, &got);
    assert_memory_equal(got.mods.alibi_slopes, mine, sizeof mine);
    assert_int_equal(got.mods.window_left, -1);
    assert_int_equal(got.mods.window_right, 0);
    assert_true(got.mods.softcap == 5.0f);
    mha_free(back);
    /* base alibi without slopes: the default slopes */
    mha_config b2 = {0};
    b2.mods.alibi = 1;
    assert_int_equal(mha_module_from_file(f, 0, &b2, &back), MHA_OK);
    mha_get_config(back, &got);
    assert_true(got.mods.alibi);
    assert_null(got.mods.alibi_slopes);
    mha_free(back);
    mha_tensor_file_free(f);
}

/* Bad modifier metadata is refused, naming the key and the value. */
static void test_metadata_errors(void **state)
{
    (void)state;
    float w_in[3 * 8 * 8] = {0}, w_out[8 * 8] = {0};
    const mha_tensor_view t[2] = {
        {"in_proj_weight", MHA_DTYPE_F32, 2, {24, 8}, w_in},
        {"out_proj.weight", MHA_DTYPE_F32, 2, {8, 8}, w_out}};
    const struct {
        const char *k1, *v1, *k2, *v2, *msg;
    } bad[] = {
        {"rope", "llama", NULL, NULL,
         "rope = 'llama' is not valid: expected neox or gptj"},
        {"rope", "NEOX", NULL, NULL, "rope = 'NEOX' is not valid"},
        {"rope_dims", "2", NULL, NULL,
         "rope_dims = '2' is not valid: there is no rope key"},
        {"rope", "neox", "rope_dims", "2.5",
         "rope_dims = '2.5' is not valid: expected an integer"},
        {"rope", "neox", "rope_theta", "nan",
         "rope_theta = 'nan' is not valid: expected a finite number"},
        {"rope", "neox", "rope_scale", " 2",
         "rope_scale = ' 2' is not valid"},
        {"rope", "gptj", "rope_dims", "3", "rope.dims must be even"},
        {"rope", "gptj", "rope_theta", "0.5", "rope.theta must be finite "
         "and > 1"},
        {"alibi", "yes", NULL, NULL, "alibi = 'yes' is not valid"},
        {"alibi_slopes", "1,2", NULL, NULL,
         "alibi_slopes = '1,2' is not valid: alibi is not on"},
        {"alibi", "true", "alibi_slopes", "1",
         "alibi_slopes has 1 values, expected num_heads 2"},
        {"alibi", "true", "alibi_slopes", "1,2,3",
         "alibi_slopes has more than num_heads 2 values"},
        {"alibi", "true", "alibi_slopes", "1,,2",
         "alibi_slopes = '1,,2' is not valid"},
        {"alibi", "true", "alibi_slopes", "1,inf",
         "alibi_slopes = '1,inf' is not valid"},
        {"window", "3", NULL, NULL, "window = '3' is not valid: expected "
         "LEFT,RIGHT"},
        {"window", "3,-2", NULL, NULL, "window = '3,-2' is not valid"},
        {"window", "a,1", NULL, NULL, "window = 'a,1' is not valid"},
        {"softcap", "0", NULL, NULL, "softcap = '0' is not valid: expected "
         "a finite number > 0"},
        {"softcap", "-1", NULL, NULL, "softcap = '-1' is not valid"},
    };
    char path[320];
    snprintf(path, sizeof path, "%s/bad.safetensors", tu_tmpdir);
    for (size_t k = 0; k < sizeof bad / sizeof *bad; k++) {
        const char *keys[3] = {"num_heads", bad[k].k1, bad[k].k2};
        const char *vals[3] = {"2", bad[k].v1, bad[k].v2};
        const int n = bad[k].k2 ? 3 : 2;
        assert_int_equal(mha_safetensors_save(path, t, 2, keys, vals, n),
                         MHA_OK);
        mha_tensor_file *f = NULL;
        assert_int_equal(mha_safetensors_load(path, &f), MHA_OK);
        mha_module *m = NULL;
        const mha_status st = mha_module_from_file(f, 0, NULL, &m);
        if (st == MHA_OK)
            fail_msg("metadata %s = '%s' was accepted", bad[k].k2 ? bad[k].k2
                     : bad[k].k1, bad[k].k2 ? bad[k].v2 : bad[k].v1);
        assert_null(m);
        assert_msg_has(bad[k].msg);
        mha_tensor_file_free(f);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_apply_vs_hf),
        cmocka_unit_test(test_apply_checker_is_sensitive),
        cmocka_unit_test(test_apply_identity),
        cmocka_unit_test(test_apply_errors),
        cmocka_unit_test(test_module_forward),
        cmocka_unit_test(test_module_backward),
        cmocka_unit_test(test_backward_checker_is_sensitive),
        cmocka_unit_test(test_attention_vs_prerotated),
        cmocka_unit_test(test_attention_backward),
        cmocka_unit_test(test_attention_errors),
        cmocka_unit_test(test_decode),
        cmocka_unit_test(test_attention_cache),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_metadata_round_trip),
        cmocka_unit_test(test_metadata_modifiers),
        cmocka_unit_test(test_metadata_errors),
        cmocka_unit_test(test_apply_inverse),
    };
    if (tu_tier_unavailable())
        return TU_SKIP;
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
