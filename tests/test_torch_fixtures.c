/*
 * test_torch_fixtures.c -- libmha against PyTorch's nn.MultiheadAttention.
 *
 * Every .txt file in $MHA_FIXTURES/torch was written by
 * tests/fixtures/make_torch_fixtures.py (run with /usr/bin/python3, which
 * has torch 1.13).  A file holds a module configuration, every parameter of
 * the torch module's state_dict under its PyTorch name, the inputs, the
 * masks, and torch's outputs (and attention weights) computed in float32
 * and in float64.  For each file this test builds the module with
 * mha_create, loads every parameter by name with mha_param_set, runs
 * mha_forward and checks, for out and weights separately:
 *
 *   where torch's float64 value is defined:
 *       |ours - ref64| <= 2 * max|ref32 - ref64| + 1e-6 * (1 + max|ref64|)
 *   (the maxima over the defined elements of that tensor): we must be about
 *   as close to the float64 truth as torch's own float32 run is;
 *
 *   where torch gives NaN (a query row whose keys are all masked): our
 *   output equals out_proj.bias exactly (0 without bias) and our weights
 *   are exactly 0, as mha.h documents.
 *
 * Nothing we output may be NaN.  One line per case reports the errors.
 *
 * The backward: each file also holds a random grad_out G and torch
 * autograd's gradients of sum(out * G) in float32 and float64
 * (grad32.<name>, grad64.<name> for every parameter and for query, key,
 * value; only the summed grad32.query / grad64.query when one tensor is
 * query, key and value).
 * mha_backward (grad_out G, every gradient requested, the outputs filled
 * with NaN first so that an element it fails to write shows) must give, for
 * every gradient tensor separately,
 *
 *       |ours - ref64| <= 3 * max|ref32 - ref64| + FLT_EPSILON * max|ref64|
 *
 * (the acceptance criterion of the backward: within 3 x torch-float32's own
 * error against float64; the floor, one float32 epsilon of the largest
 * value, only matters where torch32 is nearly exact on a few elements).
 * Self-attention runs twice: key = value = NULL (grad_query receives the
 * sum) and key = value = query as pointers (three separate gradients,
 * summed here).  In the fully masked cases torch's
 * gradients are NaN; the generator stores those of the documented semantics
 * there (see make_torch_fixtures.py).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "testutil.h"

#define MIN_FIXTURES 8
#define MAX_TENSORS 64
#define MAX_MASKS 2
#define MAX_NDIM 4
#define ERRLEN 512

/* ------------------------------------------------------------------------ */
/* The parsed file                                                          */
/* ------------------------------------------------------------------------ */

typedef struct fx_tensor {
    char name[64];
    int ndim;
    int64_t shape[MAX_NDIM];
    int64_t numel;
    double *v;
} fx_tensor;

typedef struct fx_mask {
    char which[16];   /* "attn" or "key_padding" */
    mha_mask_kind kind;
    int ndim;
    int64_t shape[MAX_NDIM];
    int64_t numel;
    double *v;
} fx_mask;

typedef struct fixture {
    int64_t embed_dim, num_heads, kdim, vdim, batch, q_len, kv_len;
    int bias, add_bias_kv, add_zero_attn;
    mha_weights_mode weights;
    mha_causal causal;
    fx_tensor t[MAX_TENSORS];
    int nt;
    fx_mask m[MAX_MASKS];
    int nm;
} fixture;

static void fixture_free(fixture *f)
{
    for (int i = 0; i < f->nt; i++)
        free(f->t[i].v);
    for (int i = 0; i < f->nm; i++)
        free(f->m[i].v);
    memset(f, 0, sizeof *f);
}

static const fx_tensor *find_tensor(const fixture *f, const char *name)
{
    for (int i = 0; i < f->nt; i++)
        if (strcmp(f->t[i].name, name) == 0)
            return &f->t[i];
    return NULL;
}

static const fx_mask *find_mask(const fixture *f, const char *which)
{
    for (int i = 0; i < f->nm; i++)
        if (strcmp(f->m[i].which, which) == 0)
            return &f->m[i];
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Tokenizer: whitespace-separated tokens, with line numbers for messages   */
/* ------------------------------------------------------------------------ */

typedef struct lexer {
    const char *p;
    int line;         /* line of the last token returned */
    int next_line;    /* line at p */
    char tok[128];
    char *err;        /* ERRLEN bytes */
} lexer;

/* Next token into lx->tok; 0 at end of input.  Fails on a huge token. */
static int lex_next(lexer *lx)
{
    while (*lx->p && isspace((unsigned char)*lx->p)) {
        if (*lx->p == '\n')
            lx->next_line++;
        lx->p++;
    }
    if (!*lx->p)
        return 0;
    lx->line = lx->next_line;
    size_t n = 0;
    while (*lx->p && !isspace((unsigned char)*lx->p)) {
        if (n + 1 >= sizeof lx->tok) {
            snprintf(lx->err, ERRLEN, "line %d: token too long", lx->line);
            return -1;
        }
        lx->tok[n++] = *lx->p++;
    }
    lx->tok[n] = '\0';
    return 1;
}

/* Peek: is the next token `word`?  Does not consume. */
static int lex_peek_is(const lexer *lx, const char *word)
{
    const char *p = lx->p;
    while (*p && isspace((unsigned char)*p))
        p++;
    size_t n = strlen(word);
    return strncmp(p, word, n) == 0 &&
           (p[n] == '\0' || isspace((unsigned char)p[n]));
}

static int lex_int(lexer *lx, const char *what, int64_t lo, int64_t hi,
                   int64_t *out)
{
    if (lex_next(lx) != 1) {
        if (!lx->err[0])
            snprintf(lx->err, ERRLEN, "line %d: end of file, expected %s",
                     lx->next_line, what);
        return 0;
    }
    char *end;
    errno = 0;
    long long v = strtoll(lx->tok, &end, 10);
    if (errno || end == lx->tok || *end || v < lo || v > hi) {
        snprintf(lx->err, ERRLEN,
                 "line %d: %s must be an integer in [%lld, %lld], got '%s'",
                 lx->line, what, (long long)lo, (long long)hi, lx->tok);
        return 0;
    }
    *out = (int64_t)v;
    return 1;
}

static int lex_double(lexer *lx, const char *what, int64_t index, double *out)
{
    if (lex_next(lx) != 1) {
        if (!lx->err[0])
            snprintf(lx->err, ERRLEN,
                     "line %d: end of file in %s, value %lld missing",
                     lx->next_line, what, (long long)index);
        return 0;
    }
    char *end;
    double v = strtod(lx->tok, &end);
    if (end == lx->tok || *end) {
        snprintf(lx->err, ERRLEN,
                 "line %d: %s value %lld is not a number: '%s'", lx->line,
                 what, (long long)index, lx->tok);
        return 0;
    }
    *out = v;
    return 1;
}

/* "<ndim> <d0> ... " then numel; 1 on success. */
static int lex_shape(lexer *lx, const char *what, int *ndim, int64_t *shape,
                     int64_t *numel)
{
    int64_t nd;
    if (!lex_int(lx, "ndim", 0, MAX_NDIM, &nd))
        return 0;
    *ndim = (int)nd;
    *numel = 1;
    for (int d = 0; d < *ndim; d++) {
        if (!lex_int(lx, "a dimension", 1, 1 << 20, &shape[d]))
            return 0;
        *numel *= shape[d];
        if (*numel > (1 << 24)) {
            snprintf(lx->err, ERRLEN, "line %d: %s is implausibly large",
                     lx->line, what);
            return 0;
        }
    }
    return 1;
}

static double *lex_values(lexer *lx, const char *what, int64_t numel,
                          int boolean)
{
    double *v = malloc((size_t)(numel ? numel : 1) * sizeof *v);
    if (!v) {
        snprintf(lx->err, ERRLEN, "out of memory reading %s", what);
        return NULL;
    }
    for (int64_t i = 0; i < numel; i++) {
        if (!lex_double(lx, what, i, &v[i])) {
            free(v);
            return NULL;
        }
        if (boolean && v[i] != 0.0 && v[i] != 1.0) {
            snprintf(lx->err, ERRLEN,
                     "line %d: %s value %lld must be 0 or 1, got '%s'",
                     lx->line, what, (long long)i, lx->tok);
            free(v);
            return NULL;
        }
    }
    return v;
}

/* The index of value among three names, or -1. */
static int choice(const char *const names[3], const char *value)
{
    for (int k = 0; k < 3; k++)
        if (strcmp(names[k], value) == 0)
            return k;
    return -1;
}

static int parse_config(lexer *lx, fixture *f)
{
    enum { N_KEYS = 12 };
    static const char *const keys[N_KEYS] = {
        "embed_dim", "num_heads", "kdim", "vdim", "bias", "add_bias_kv",
        "add_zero_attn", "batch", "q_len", "kv_len", "weights", "causal"};
    int seen[N_KEYS] = {0};
    int64_t val[N_KEYS] = {0};

    while (!lex_peek_is(lx, "tensor") && !lex_peek_is(lx, "mask")) {
        int r = lex_next(lx);
        if (r != 1) {
            if (r == 0)
                snprintf(lx->err, ERRLEN,
                         "end of file inside the config line");
            return 0;
        }
        char *eq = strchr(lx->tok, '=');
        if (!eq) {
            snprintf(lx->err, ERRLEN,
                     "line %d: config entry '%s' is not key=value", lx->line,
                     lx->tok);
            return 0;
        }
        *eq = '\0';
        const char *key = lx->tok, *value = eq + 1;
        int k = 0;
        while (k < N_KEYS && strcmp(keys[k], key) != 0)
            k++;
        if (k == N_KEYS) {
            snprintf(lx->err, ERRLEN, "line %d: unknown config key '%s'",
                     lx->line, key);
            return 0;
        }
        if (seen[k]) {
            snprintf(lx->err, ERRLEN, "line %d: config key '%s' repeated",
                     lx->line, key);
            return 0;
        }
        seen[k] = 1;
        static const char *const weights[3] = {"none", "average",
                                               "per_head"};
        static const char *const causal[3] = {"none", "bottom_right",
                                              "top_left"};
        if (strcmp(key, "weights") == 0 || strcmp(key, "causal") == 0) {
            const int is_w = key[0] == 'w';
            const int c = choice(is_w ? weights : causal, value);
            if (c < 0) {
                snprintf(lx->err, ERRLEN, "line %d: %s must be %s, %s or %s, "
                         "got '%s'", lx->line, key,
                         (is_w ? weights : causal)[0],
                         (is_w ? weights : causal)[1],
                         (is_w ? weights : causal)[2], value);
                return 0;
            }
            if (is_w)
                f->weights = (mha_weights_mode)c;   /* NONE, AVERAGE, PER_HEAD */
            else
                f->causal = (mha_causal)c;   /* NONE, BOTTOM_RIGHT, TOP_LEFT */
            continue;
        }
        char *end;
        errno = 0;
        long long v = strtoll(value, &end, 10);
        if (errno || end == value || *end || v < 0 || v > 4096) {
            snprintf(lx->err, ERRLEN,
                     "line %d: config %s=%s is not an integer in [0, 4096]",
                     lx->line, key, value);
            return 0;
        }
        val[k] = v;
    }
    for (int k = 0; k < N_KEYS; k++)
        if (!seen[k]) {
            snprintf(lx->err, ERRLEN, "config lacks '%s'", keys[k]);
            return 0;
        }
    f->embed_dim = val[0];
    f->num_heads = val[1];
    f->kdim = val[2];
    f->vdim = val[3];
    f->bias = val[4] != 0;
    f->add_bias_kv = val[5] != 0;
    f->add_zero_attn = val[6] != 0;
    f->batch = val[7];
    f->q_len = val[8];
    f->kv_len = val[9];
    return 1;
}

/* Parses `text` into *f; on failure fills err and returns 0 (f is freed). */
static int parse_fixture(const char *text, fixture *f, char *err)
{
    lexer lx = {text, 1, 1, {0}, err};
    memset(f, 0, sizeof *f);
    err[0] = '\0';

    if (lex_next(&lx) != 1 || strcmp(lx.tok, "config") != 0) {
        snprintf(err, ERRLEN, "the file must start with 'config'");
        return 0;
    }
    if (!parse_config(&lx, f))
        goto fail;

    for (;;) {
        int r = lex_next(&lx);
        if (r == 0)
            break;
        if (r < 0)
            goto fail;
        if (strcmp(lx.tok, "tensor") == 0) {
            if (f->nt == MAX_TENSORS) {
                snprintf(err, ERRLEN, "line %d: more than %d tensors",
                         lx.line, MAX_TENSORS);
                goto fail;
            }
            fx_tensor *t = &f->t[f->nt];
            if (lex_next(&lx) != 1) {
                snprintf(err, ERRLEN, "line %d: tensor without a name",
                         lx.line);
                goto fail;
            }
            if (strlen(lx.tok) >= sizeof t->name) {
                snprintf(err, ERRLEN, "line %d: tensor name too long",
                         lx.line);
                goto fail;
            }
            strcpy(t->name, lx.tok);
            if (find_tensor(f, t->name)) {
                snprintf(err, ERRLEN, "line %d: tensor '%s' repeated",
                         lx.line, t->name);
                goto fail;
            }
            if (!lex_shape(&lx, t->name, &t->ndim, t->shape, &t->numel))
                goto fail;
            t->v = lex_values(&lx, t->name, t->numel, 0);
            if (!t->v)
                goto fail;
            f->nt++;
        } else if (strcmp(lx.tok, "mask") == 0) {
            if (f->nm == MAX_MASKS) {
                snprintf(err, ERRLEN, "line %d: more than %d masks", lx.line,
                         MAX_MASKS);
                goto fail;
            }
            fx_mask *m = &f->m[f->nm];
            if (lex_next(&lx) != 1 || (strcmp(lx.tok, "attn") != 0 &&
                                       strcmp(lx.tok, "key_padding") != 0)) {
                snprintf(err, ERRLEN,
                         "line %d: mask must be 'attn' or 'key_padding'",
                         lx.line);
                goto fail;
            }
            strcpy(m->which, lx.tok);
            if (find_mask(f, m->which)) {
                snprintf(err, ERRLEN, "line %d: %s mask repeated", lx.line,
                         m->which);
                goto fail;
            }
            if (lex_next(&lx) != 1) {
                snprintf(err, ERRLEN, "line %d: mask without a kind",
                         lx.line);
                goto fail;
            }
            if (strcmp(lx.tok, "block") == 0)
                m->kind = MHA_MASK_BLOCK;
            else if (strcmp(lx.tok, "allow") == 0)
                m->kind = MHA_MASK_ALLOW;
            else if (strcmp(lx.tok, "additive") == 0)
                m->kind = MHA_MASK_ADDITIVE;
            else {
                snprintf(err, ERRLEN,
                         "line %d: mask kind must be block, allow or "
                         "additive, got '%s'", lx.line, lx.tok);
                goto fail;
            }
            if (!lex_shape(&lx, m->which, &m->ndim, m->shape, &m->numel))
                goto fail;
            m->v = lex_values(&lx, m->which, m->numel,
                              m->kind != MHA_MASK_ADDITIVE);
            if (!m->v)
                goto fail;
            f->nm++;
        } else {
            snprintf(err, ERRLEN,
                     "line %d: expected 'tensor' or 'mask', got '%s'",
                     lx.line, lx.tok);
            goto fail;
        }
    }
    return 1;
fail:
    if (!err[0])
        snprintf(err, ERRLEN, "line %d: malformed", lx.line);
    fixture_free(f);
    return 0;
}

static char *read_file(const char *path, char *err)
{
    FILE *fp = fopen(path, "rb");
    if (!fp) {
        snprintf(err, ERRLEN, "cannot open: %s", strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n + 1 == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - 1 - n, fp);
        n += got;
        if (got == 0)
            break;
    }
    int bad = ferror(fp);
    fclose(fp);
    if (!buf || bad) {
        free(buf);
        snprintf(err, ERRLEN, "%s", bad ? "read error" : "out of memory");
        return NULL;
    }
    buf[n] = '\0';
    if (strlen(buf) != n) {
        free(buf);
        snprintf(err, ERRLEN, "file contains a NUL byte");
        return NULL;
    }
    return buf;
}

/* ------------------------------------------------------------------------ */
/* Checking one case                                                        */
/* ------------------------------------------------------------------------ */

static int is_param_name(const char *name)
{
    static const char *const io[] = {"query", "key", "value", "out32",
                                     "out64", "weights32", "weights64",
                                     "grad_out"};
    for (size_t i = 0; i < sizeof io / sizeof io[0]; i++)
        if (strcmp(name, io[i]) == 0)
            return 0;
    return strncmp(name, "grad32.", 7) != 0 && strncmp(name, "grad64.", 7) != 0;
}

static int shape_is(const fx_tensor *t, int ndim, int64_t d0, int64_t d1,
                    int64_t d2, int64_t d3)
{
    const int64_t want[4] = {d0, d1, d2, d3};
    if (t->ndim != ndim)
        return 0;
    for (int d = 0; d < ndim; d++)
        if (t->shape[d] != want[d])
            return 0;
    return 1;
}

static float *to_floats(const double *v, int64_t n)
{
    float *f = malloc((size_t)(n ? n : 1) * sizeof *f);
    if (f)
        for (int64_t i = 0; i < n; i++)
            f[i] = (float)v[i];
    return f;
}

/* The bound of a comparison: factor * max|ref32 - ref64|
 * + floor_rel * max|ref64| + floor_abs. */
typedef struct tolerance {
    double factor, floor_rel, floor_abs;
} tolerance;
static const tolerance TOL_FORWARD = {2.0, 1e-6, 1e-6};
/* Gradients: 3 x torch32's error, plus one float32 epsilon of the largest
 * value (the grain of float32 at that size) for the tensors where torch32
 * happens to be almost exact over a handful of elements. */
static const tolerance TOL_GRAD = {3.0, FLT_EPSILON, 0.0};

/* The check of one output tensor against torch; see the top of the file. */
typedef struct cmp_result {
    double err, bound, torch32;   /* torch32: max|ref32 - ref64| */
    int64_t undefined;   /* elements where torch's float64 value is NaN */
    int failures;
} cmp_result;

static void compare(const char *cname, const char *what, const float *ours,
                    const fx_tensor *r32, const fx_tensor *r64,
                    const float *nan_value, int64_t nan_period,
                    const tolerance *tol, cmp_result *res)
{
    const int64_t n = r64->numel;
    double e32 = 0.0, m64 = 0.0, err = 0.0;
    int64_t worst = -1;
    memset(res, 0, sizeof *res);
    for (int64_t i = 0; i < n; i++) {
        if (isnan(ours[i])) {
            if (res->failures++ < 3)
                print_error("%s: %s[%lld] is NaN (torch64 %.17g)\n", cname,
                            what, (long long)i, r64->v[i]);
        }
        if (isnan(r64->v[i]))
            continue;
        if (isnan(r32->v[i])) {
            if (res->failures++ < 3)
                print_error("%s: fixture %s32[%lld] is NaN but %s64 is "
                            "%.17g\n", cname, what, (long long)i, what,
                            r64->v[i]);
            continue;
        }
        e32 = fmax(e32, fabs(r32->v[i] - r64->v[i]));
        m64 = fmax(m64, fabs(r64->v[i]));
    }
    const double bound =
        tol->factor * e32 + tol->floor_rel * m64 + tol->floor_abs;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(r64->v[i])) {
            /* A query row with no key: torch says NaN, we say bias / 0. */
            res->undefined++;
            const float want = nan_value ? nan_value[i % nan_period] : 0.0f;
            if (ours[i] != want && res->failures++ < 3)
                print_error("%s: %s[%lld] = %.9g where torch gives NaN (a "
                            "query row with no key), expected exactly "
                            "%.9g\n", cname, what, (long long)i,
                            (double)ours[i], (double)want);
            continue;
        }
        const double d = fabs((double)ours[i] - r64->v[i]);
        if (!isnan(err) && (isnan(d) || d > err)) {   /* NaN sticks */
            err = d;
            worst = i;
        }
    }
    res->err = err;
    res->bound = bound;
    res->torch32 = e32;
    if (!(err <= bound)) {
        res->failures++;
        print_error("%s: %s[%lld] = %.9g, torch64 %.17g, torch32 %.9g: "
                    "error %.3g exceeds bound %.3g\n", cname, what,
                    (long long)worst, (double)ours[worst], r64->v[worst],
                    r32->v[worst], err, bound);
    }
}

/* The gradient checks of one case: the worst of the per-tensor results. */
typedef struct grad_summary {
    double ratio;         /* max over gradients of err / bound            */
    double vs_torch32;    /* max over gradients of err / max|ref32-ref64| */
    char worst[128];      /* the gradient with the largest err / bound     */
    int tensors;          /* gradient tensors compared                     */
} grad_summary;

/* Compares one gradient we computed with grad32.<name> / grad64.<name>. */
static int check_grad(const char *cname, const char *variant,
                      const fixture *f, const char *name, const float *ours,
                      int64_t numel, grad_summary *sum)
{
    char n32[96], n64[96], what[128];
    snprintf(n32, sizeof n32, "grad32.%s", name);
    snprintf(n64, sizeof n64, "grad64.%s", name);
    snprintf(what, sizeof what, "%sgrad %s", variant, name);
    const fx_tensor *r32 = find_tensor(f, n32), *r64 = find_tensor(f, n64);
    if (!r32 || !r64) {
        print_error("%s: fixture lacks %s / %s\n", cname, n32, n64);
        return 1;
    }
    if (r32->numel != numel || r64->numel != numel) {
        print_error("%s: %s has %lld values, libmha's gradient %lld\n", cname,
                    n64, (long long)r64->numel, (long long)numel);
        return 1;
    }
    cmp_result r;
    compare(cname, what, ours, r32, r64, NULL, 1, &TOL_GRAD, &r);
    if (r.undefined) {
        print_error("%s: %s has %lld NaN values in the fixture\n", cname, n64,
                    (long long)r.undefined);
        r.failures++;
    }
    const double ratio = r.err / r.bound;
    if (!(ratio <= sum->ratio)) {
        sum->ratio = ratio;
        snprintf(sum->worst, sizeof sum->worst, "%s", what);
    }
    if (r.torch32 > 0.0)
        sum->vs_torch32 = fmax(sum->vs_torch32, r.err / r.torch32);
    sum->tensors++;
    return r.failures;
}

static float *nan_floats(int64_t n)
{
    float *p = malloc((size_t)(n ? n : 1) * sizeof *p);
    if (p)
        for (int64_t i = 0; i < n; i++)
            p[i] = NAN;
    return p;
}

/*
 * mha_backward against torch's gradients.  `a` is the forward of the case
 * (key = value = query as pointers when `self`).  Returns the failures.
 */
static int check_backward(const char *cname, const fixture *f,
                          const mha_module *mod, const mha_forward_args *a,
                          int self, grad_summary *sum)
{
    int failures = 0;
    const int64_t E = f->embed_dim, B = f->batch, Lq = f->q_len;
    const int64_t Lk = f->kv_len;
    const int64_t nq = B * Lq * E, nk = B * Lk * f->kdim, nv = B * Lk * f->vdim;
    const int64_t np = mha_param_numel(mod);
    float *g = NULL, *gp = NULL, *gq = NULL, *gk = NULL, *gv = NULL;
    memset(sum, 0, sizeof *sum);

#define BFAIL(...)                                                          \
    do {                                                                    \
        print_error("%s: ", cname);                                         \
        print_error(__VA_ARGS__);                                           \
        print_error("\n");                                                  \
        failures++;                                                         \
        goto done;                                                          \
    } while (0)

    const fx_tensor *tg = find_tensor(f, "grad_out");
    if (!tg)
        BFAIL("no grad_out: regenerate the fixtures (/usr/bin/python3 "
              "tests/fixtures/make_torch_fixtures.py)");
    if (!shape_is(tg, 3, B, Lq, E, 0))
        BFAIL("grad_out is not (B, Lq, E)");
    /* Every gradient in the file is checked: the parameters', query's and,
     * unless one tensor is all three, key's and value's. */
    int in_file = 0;
    for (int i = 0; i < f->nt; i++)
        in_file += strncmp(f->t[i].name, "grad64.", 7) == 0;
    if (in_file != mha_param_count(mod) + (self ? 1 : 3))
        BFAIL("the fixture has %d grad64 tensors, expected %d", in_file,
              mha_param_count(mod) + (self ? 1 : 3));
    g = to_floats(tg->v, tg->numel);
    gp = nan_floats(np);
    gq = nan_floats(nq);
    gk = nan_floats(nk);
    gv = nan_floats(nv);
    if (!g || !gp || !gq || !gk || !gv)
        BFAIL("out of memory");

    /* The documented way: key = value = NULL for one tensor. */
    mha_forward_args fa = *a;
    fa.out = NULL;
    fa.attn_weights = NULL;
    fa.need_weights = MHA_WEIGHTS_NONE;
    if (self)
        fa.key = fa.value = NULL;
    mha_backward_args ba = {0};
    ba.grad_out = g;
    ba.grad_query = gq;
    ba.grad_key = self ? NULL : gk;
    ba.grad_value = self ? NULL : gv;
    ba.grad_params = gp;
    mha_status st = mha_backward(mod, &fa, &ba);
    if (st != MHA_OK)
        BFAIL("mha_backward: %s: %s", mha_status_string(st), mha_last_error());
    for (int i = 0; i < mha_param_count(mod); i++) {
        mha_param_info info;
        if (mha_param_info_at(mod, i, &info) != MHA_OK)
            BFAIL("mha_param_info_at(%d): %s", i, mha_last_error());
        failures += check_grad(cname, "", f, info.name, gp + info.offset,
                               info.numel, sum);
    }
    failures += check_grad(cname, "", f, "query", gq, nq, sum);
    if (!self) {
        failures += check_grad(cname, "", f, "key", gk, nk, sum);
        failures += check_grad(cname, "", f, "value", gv, nv, sum);
    }

    if (self) {
        /* The same tensor as three inputs (pointers equal): three separate
         * gradients, whose sum is torch's. */
        fa.key = fa.value = a->query;
        for (int64_t i = 0; i < np; i++)
            gp[i] = NAN;
        for (int64_t i = 0; i < nq; i++)
            gq[i] = gk[i] = gv[i] = NAN;
        ba.grad_key = gk;
        ba.grad_value = gv;
        st = mha_backward(mod, &fa, &ba);
        if (st != MHA_OK)
            BFAIL("mha_backward (key = value = query): %s: %s",
                  mha_status_string(st), mha_last_error());
        for (int64_t i = 0; i < nq; i++)
            gq[i] = (float)((double)gq[i] + (double)gk[i] + (double)gv[i]);
        for (int i = 0; i < mha_param_count(mod); i++) {
            mha_param_info info;
            if (mha_param_info_at(mod, i, &info) != MHA_OK)
                BFAIL("mha_param_info_at(%d): %s", i, mha_last_error());
            failures += check_grad(cname, "3-pointer ", f, info.name,
                                   gp + info.offset, info.numel, sum);
        }
        failures += check_grad(cname, "3-pointer ", f, "query", gq, nq, sum);
    }
#undef BFAIL
done:
    free(g);
    free(gp);
    free(gq);
    free(gk);
    free(gv);
    return failures;
}

/* Runs one parsed case; returns the number of failures (0 = pass). */
static int run_case(const char *cname, const fixture *f)
{
    int failures = 0;
    mha_module *mod = NULL;
    float *fq = NULL, *fk = NULL, *fv = NULL, *out = NULL, *w = NULL;
    float *attn_f = NULL, *obias = NULL;
    uint8_t *attn_u8 = NULL, *kpm_u8 = NULL;

#define FAIL(...)                                                           \
    do {                                                                    \
        print_error("%s: ", cname);                                         \
        print_error(__VA_ARGS__);                                           \
        print_error("\n");                                                  \
        failures++;                                                         \
        goto done;                                                          \
    } while (0)

    const int64_t E = f->embed_dim, H = f->num_heads, B = f->batch;
    const int64_t Lq = f->q_len, Lk = f->kv_len;

    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.kdim = f->kdim;
    cfg.vdim = f->vdim;
    cfg.no_bias = !f->bias;
    cfg.add_bias_kv = f->add_bias_kv;
    cfg.add_zero_attn = f->add_zero_attn;
    mha_status st = mha_create(&cfg, &mod);
    if (st != MHA_OK)
        FAIL("mha_create: %s: %s", mha_status_string(st), mha_last_error());

    /* Every state_dict entry, by its PyTorch name and shape. */
    int nparams = 0;
    for (int i = 0; i < f->nt; i++) {
        const fx_tensor *t = &f->t[i];
        if (!is_param_name(t->name))
            continue;
        nparams++;
        mha_param_info info;
        st = mha_param_info_by_name(mod, t->name, &info);
        if (st != MHA_OK)
            FAIL("torch parameter '%s' unknown to libmha: %s: %s", t->name,
                 mha_status_string(st), mha_last_error());
        if (info.numel != t->numel || info.ndim != t->ndim)
            FAIL("parameter '%s': torch has ndim %d numel %lld, libmha ndim "
                 "%d numel %lld", t->name, t->ndim, (long long)t->numel,
                 info.ndim, (long long)info.numel);
        for (int d = 0; d < t->ndim; d++)
            if (info.shape[d] != t->shape[d])
                FAIL("parameter '%s': dimension %d is %lld in torch, %lld in "
                     "libmha", t->name, d, (long long)t->shape[d],
                     (long long)info.shape[d]);
        float *pv = to_floats(t->v, t->numel);
        if (!pv)
            FAIL("out of memory");
        st = mha_param_set(mod, t->name, pv, t->numel);
        free(pv);
        if (st != MHA_OK)
            FAIL("mha_param_set('%s'): %s: %s", t->name,
                 mha_status_string(st), mha_last_error());
    }
    if (nparams != mha_param_count(mod))
        FAIL("torch's state_dict has %d entries, libmha has %d parameters",
             nparams, mha_param_count(mod));

    /* Inputs. */
    const fx_tensor *tq = find_tensor(f, "query"), *tk = find_tensor(f, "key");
    const fx_tensor *tv = find_tensor(f, "value");
    const fx_tensor *o32 = find_tensor(f, "out32");
    const fx_tensor *o64 = find_tensor(f, "out64");
    if (!tq || !tk || !tv || !o32 || !o64)
        FAIL("fixture lacks one of query, key, value, out32, out64");
    if (!shape_is(tq, 3, B, Lq, E, 0) || !shape_is(tk, 3, B, Lk, f->kdim, 0) ||
        !shape_is(tv, 3, B, Lk, f->vdim, 0))
        FAIL("query/key/value shapes do not match the config");
    if (!shape_is(o32, 3, B, Lq, E, 0) || !shape_is(o64, 3, B, Lq, E, 0))
        FAIL("out32/out64 are not (B, Lq, E) = (%lld, %lld, %lld)",
             (long long)B, (long long)Lq, (long long)E);
    fq = to_floats(tq->v, tq->numel);
    fk = to_floats(tk->v, tk->numel);
    fv = to_floats(tv->v, tv->numel);
    out = malloc((size_t)o64->numel * sizeof *out);
    if (!fq || !fk || !fv || !out)
        FAIL("out of memory");

    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.query = fq;
    /* torch's self-attention cases pass the same tensor three times; do the
     * same, which exercises the fused projection path. */
    int self = tk->numel == tq->numel && tv->numel == tq->numel &&
               memcmp(tk->v, tq->v, (size_t)tq->numel * sizeof(double)) == 0 &&
               memcmp(tv->v, tq->v, (size_t)tq->numel * sizeof(double)) == 0;
    a.key = self ? fq : fk;
    a.value = self ? fq : fv;
    a.out = out;

    const fx_mask *am = find_mask(f, "attn");
    if (am) {
        a.attn_mask.kind = am->kind;
        a.attn_mask.ndim = am->ndim;
        memcpy(a.attn_mask.shape, am->shape, sizeof am->shape);
        if (am->kind == MHA_MASK_ADDITIVE) {
            attn_f = to_floats(am->v, am->numel);
            a.attn_mask.data = attn_f;
        } else {
            attn_u8 = malloc((size_t)am->numel);
            if (attn_u8)
                for (int64_t i = 0; i < am->numel; i++)
                    attn_u8[i] = am->v[i] != 0.0;
            a.attn_mask.data = attn_u8;
        }
        if (!a.attn_mask.data)
            FAIL("out of memory");
    }
    const fx_mask *km = find_mask(f, "key_padding");
    if (km) {
        if (km->kind == MHA_MASK_ADDITIVE)
            FAIL("an additive key_padding mask is not expected in fixtures");
        kpm_u8 = malloc((size_t)km->numel);
        if (!kpm_u8)
            FAIL("out of memory");
        for (int64_t i = 0; i < km->numel; i++)
            kpm_u8[i] = km->v[i] != 0.0;
        a.key_padding_mask.kind = km->kind;
        a.key_padding_mask.data = kpm_u8;
        a.key_padding_mask.ndim = km->ndim;
        memcpy(a.key_padding_mask.shape, km->shape, sizeof km->shape);
    }

    const fx_tensor *w32 = NULL, *w64 = NULL;
    const int64_t Lt = mha_total_keys(mod, Lk);
    if (Lt != Lk + f->add_bias_kv + f->add_zero_attn)
        FAIL("mha_total_keys(%lld) = %lld, expected %lld", (long long)Lk,
             (long long)Lt,
             (long long)(Lk + f->add_bias_kv + f->add_zero_attn));
    a.causal = f->causal;
    a.need_weights = f->weights;
    if (f->weights != MHA_WEIGHTS_NONE) {
        w32 = find_tensor(f, "weights32");
        w64 = find_tensor(f, "weights64");
        if (!w32 || !w64)
            FAIL("weights requested but weights32/weights64 missing");
        int ok = f->weights == MHA_WEIGHTS_AVERAGE
                     ? shape_is(w64, 3, B, Lq, Lt, 0) &&
                           shape_is(w32, 3, B, Lq, Lt, 0)
                     : shape_is(w64, 4, B, H, Lq, Lt) &&
                           shape_is(w32, 4, B, H, Lq, Lt);
        if (!ok)
            FAIL("torch's weights do not have libmha's %s shape with "
                 "Lk_total = %lld",
                 f->weights == MHA_WEIGHTS_AVERAGE ? "(B, Lq, Lk_total)"
                                                   : "(B, H, Lq, Lk_total)",
                 (long long)Lt);
        w = malloc((size_t)w64->numel * sizeof *w);
        if (!w)
            FAIL("out of memory");
        a.attn_weights = w;
    } else if (find_tensor(f, "weights32") || find_tensor(f, "weights64")) {
        FAIL("weights=none but the fixture has weights");
    }

    st = mha_forward(mod, &a);
    if (st != MHA_OK)
        FAIL("mha_forward: %s: %s", mha_status_string(st), mha_last_error());

    /* Where torch gives NaN, our output row is out_proj.bias (or 0). */
    if (f->bias) {
        const fx_tensor *ob = find_tensor(f, "out_proj.bias");
        if (!ob || ob->numel != E)
            FAIL("bias=1 but no out_proj.bias of %lld values", (long long)E);
        obias = to_floats(ob->v, E);
        if (!obias)
            FAIL("out of memory");
    }
    cmp_result ro, rw = {0};
    compare(cname, "out", out, o32, o64, obias, E, &TOL_FORWARD,
            &ro);
    failures += ro.failures;
    if (w) {
        compare(cname, "weights", w, w32, w64, NULL, 1, &TOL_FORWARD, &rw);
        failures += rw.failures;
    }
    grad_summary gs;
    failures += check_backward(cname, f, mod, &a, self, &gs);
    print_message("%-26s out err %.2g / bound %.2g (ratio %.3f, torch32 "
                  "err %.2g)", cname, ro.err, ro.bound, ro.err / ro.bound,
                  ro.torch32);
    if (w)
        print_message("; weights err %.2g / bound %.2g (ratio %.3f, torch32 "
                      "err %.2g)", rw.err, rw.bound, rw.err / rw.bound,
                      rw.torch32);
    if (ro.undefined)
        print_message("; %lld torch-NaN outputs%s", (long long)ro.undefined,
                      f->bias ? " = out_proj.bias" : " = 0");
    print_message("\n    %d gradients: worst err/bound %.3f (%s), max "
                  "err / torch32 err %.2f", gs.tensors, gs.ratio, gs.worst,
                  gs.vs_torch32);
    print_message("%s\n", failures ? "  FAILED" : "");

#undef FAIL
done:
    mha_free(mod);
    free(fq);
    free(fk);
    free(fv);
    free(out);
    free(w);
    free(attn_f);
    free(attn_u8);
    free(kpm_u8);
    free(obias);
    return failures;
}

/* ------------------------------------------------------------------------ */
/* The test                                                                 */
/* ------------------------------------------------------------------------ */

static int cmp_names(const void *x, const void *y)
{
    return strcmp(*(char *const *)x, *(char *const *)y);
}

static void test_torch_fixtures(void **state)
{
    (void)state;
    const char *root = getenv("MHA_FIXTURES");
    if (!root || !root[0])
        fail_msg("MHA_FIXTURES is not set (ctest sets it to tests/fixtures)");
    char dir[4096];
    int n = snprintf(dir, sizeof dir, "%s/torch", root);
    assert_true(n > 0 && (size_t)n < sizeof dir);

    DIR *d = opendir(dir);
    if (!d)
        fail_msg("cannot open %s: %s", dir, strerror(errno));
    char **names = NULL;
    size_t count = 0, cap = 0;
    int oom = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        size_t len = strlen(e->d_name);
        if (len < 5 || strcmp(e->d_name + len - 4, ".txt") != 0)
            continue;
        if (count == cap) {
            size_t nc = cap ? 2 * cap : 16;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn) {
                oom = 1;
                break;
            }
            names = nn;
            cap = nc;
        }
        names[count] = malloc(len + 1);
        if (!names[count]) {
            oom = 1;
            break;
        }
        memcpy(names[count++], e->d_name, len + 1);
    }
    closedir(d);
    if (count)
        qsort(names, count, sizeof *names, cmp_names);

    int failed_cases = 0;
    for (size_t i = 0; i < count && !oom; i++) {
        char path[8192], err[ERRLEN], cname[128];
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        snprintf(cname, sizeof cname, "%.*s", (int)(strlen(names[i]) - 4),
                 names[i]);
        char *text = read_file(path, err);
        fixture f;
        if (!text) {
            print_error("%s: %s\n", path, err);
            failed_cases++;
            continue;
        }
        int ok = parse_fixture(text, &f, err);
        free(text);
        if (!ok) {
            print_error("%s: %s\n", path, err);
            failed_cases++;
            continue;
        }
        if (run_case(cname, &f) != 0)
            failed_cases++;
        fixture_free(&f);
    }
    for (size_t i = 0; i < count; i++)
        free(names[i]);
    free(names);

    assert_false(oom);
    if (count < MIN_FIXTURES)
        fail_msg("found %zu fixtures in %s, expected at least %d (run "
                 "/usr/bin/python3 tests/fixtures/make_torch_fixtures.py)",
                 count, dir, MIN_FIXTURES);
    if (failed_cases)
        fail_msg("%d of %zu torch fixtures failed", failed_cases, count);
}

int main(void)
{
    if (tu_backend_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_torch_fixtures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
