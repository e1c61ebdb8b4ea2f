/*
 * test_kv_cache_window.c -- the sliding-window KV cache: a ring of
 * `capacity` slots per sequence keeping the last tokens, each query at
 * position P attending to positions max(0, P - W + 1) .. P.
 *
 *   - three sequences of different lengths (a rollback by truncation, a
 *     reset) decoded token by token (a ring as small as the window) and
 *     in chunks of 7 (W + 6 slots) far past the capacity, for plain,
 *     grouped-query, multi-query and bias_kv + zero_attn modules: every
 *     output row within the float64 bound of the one-shot forward of its
 *     whole sequence under the explicit band mask (key j visible to query
 *     i iff i - W < j <= i; tests/support's reference);
 *   - a long decode (1,300 steps, a window of 1,030: the keys split in
 *     chunks of 512, the grouped-query heads stacked), planned;
 *   - f16, bf16 and q8 caches, through the module and through
 *     mha_attention on heads (several queries per step), against a
 *     float64 attention written here over the values the cache stores
 *     (read back while they are held);
 *   - NaN and Inf in a key and value: they reach the rows whose window
 *     holds them and no other, before and after their slot is
 *     overwritten (the tiles' finite flags follow the ring);
 *   - while nothing has wrapped, bitwise equal to an ordinary cache
 *     given the same band as an explicit mask (and to an ordinary cache
 *     alone when the window covers everything);
 *   - 1, 2 and 4 threads bitwise equal on shapes where the threads run;
 *   - every misuse refused, naming what was wrong, the cache unchanged.
 *
 * The ring sums keys in slot order, which after a wrap-around is not the
 * position order of the one-shot forward: equal up to float rounding,
 * hence the float64 bound (not bits) once the ring has wrapped.
 * Every tier runs it (CTest, MHA_ISA).
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
#include "ref.h"
#include "testutil.h"

enum { B = 3 };

/* ---- the windowed attention of one query row, float64 and float32 ----
 * The reference this file writes for the compact dtypes: q (H * dh, in T)
 * against the stored keys and values of positions lo .. hi (rows of Ekv =
 * Hkv * dh floats; K/V head g = h / (H / Hkv)), softmax(q k * scale) v
 * into ctx (H * dh).  The float32 twin measures what plain single
 * precision errs on the same case (the suite's bound, ref.h). */
#define WINDOW_ROW(NAME, T, EXP)                                              \
    static void NAME(const T *q, int64_t H, int64_t Hkv, int64_t dh,          \
                     const float *K, const float *V, int64_t lo, int64_t hi,  \
                     T scale, T *ctx, T *s)                                   \
    {                                                                         \
        const int64_t Ekv = Hkv * dh;                                         \
        for (int64_t h = 0; h < H; h++) {                                     \
            const int64_t g = h / (H / Hkv);                                  \
            T mx = -INFINITY, sum = 0;                                        \
            for (int64_t j = lo; j <= hi; j++) {                              \
                T dot = 0;                                                    \
                for (int64_t d = 0; d < dh; d++)                              \
                    dot += q[h * dh + d] * (T)K[j * Ekv + g * dh + d];        \
                s[j - lo] = dot * scale;                                      \
                mx = s[j - lo] > mx ? s[j - lo] : mx;                         \
            }                                                                 \
            for (int64_t j = lo; j <= hi; j++)                                \
                sum += s[j - lo] = EXP(s[j - lo] - mx);                       \
            for (int64_t d = 0; d < dh; d++) {                                \
                T acc = 0;                                                    \
                for (int64_t j = lo; j <= hi; j++)                            \
                    acc += s[j - lo] * (T)V[j * Ekv + g * dh + d];            \
                ctx[h * dh + d] = acc / sum;                                  \
            }                                                                 \
        }                                                                     \
    }
WINDOW_ROW(window_row64, double, exp)
WINDOW_ROW(window_row32, float, expf)

/* The bound of a group of results: every error within
 * ref_tolerance(naive float32's worst error, the largest |ref|). */
typedef struct bound {
    double naive, max_abs;
} bound;

static void bound_add(bound *bd, const float *r32, const double *r64,
                      int64_t n)
{
    const double e = ref_max_err_f32(r32, r64, n), a = ref_max_abs(r64, n);
    bd->naive = e > bd->naive ? e : bd->naive;
    bd->max_abs = a > bd->max_abs ? a : bd->max_abs;
}

/* ---- a module decoding through a window cache ----------------------------- */

typedef struct wseq {
    float *x;        /* [maxlen][E] inputs, by position                   */
    float *k, *v;    /* [maxlen][Ekv] what the cache stored, by position  */
    int64_t len;
    float *out;      /* [n_out][E] outputs, output r for position pos[r]  */
    int64_t *pos;
    int64_t n_out;
} wseq;

typedef struct wdec {
    mha_module *m;
    mha_kv_cache *kv;
    mha_plan *plan;        /* for single-token steps, when use_plan */
    int64_t E, Ekv, W, maxlen;
    int threads, use_plan;
    uint64_t seed;
    wseq s[B];
} wdec;

static void wdec_init(wdec *d, const mha_config *cfg, int64_t W,
                      int64_t cap, mha_kv_dtype dtype, int64_t maxlen,
                      int threads)
{
    memset(d, 0, sizeof *d);
    d->m = tu_module(cfg, 99);
    assert_non_null(d->m);
    mha_config r;
    assert_int_equal(mha_get_config(d->m, &r), MHA_OK);
    const int64_t dh = r.embed_dim / r.num_heads;
    d->E = r.embed_dim;
    d->Ekv = r.num_kv_heads * dh;
    d->W = W;
    d->maxlen = maxlen;
    d->threads = threads;
    d->seed = 500;
    const mha_kv_cache_config kc = {B, r.num_kv_heads, dh, cap, dtype, W, 0, 0, 0, 0, 0};
    assert_int_equal(mha_kv_cache_create(&kc, &d->kv), MHA_OK);
    for (int b = 0; b < B; b++) {
        wseq *s = &d->s[b];
        s->x = malloc((size_t)(maxlen * d->E) * sizeof(float));
        s->k = malloc((size_t)(maxlen * d->Ekv) * sizeof(float));
        s->v = malloc((size_t)(maxlen * d->Ekv) * sizeof(float));
        s->out = malloc((size_t)(maxlen * d->E) * sizeof(float));
        s->pos = malloc((size_t)maxlen * sizeof(int64_t));
        assert_true(s->x && s->k && s->v && s->out && s->pos);
    }
}

static void wdec_free(wdec *d)
{
    for (int b = 0; b < B; b++) {
        free(d->s[b].x);
        free(d->s[b].k);
        free(d->s[b].v);
        free(d->s[b].out);
        free(d->s[b].pos);
    }
    mha_plan_free(d->plan);
    mha_kv_cache_free(d->kv);
    mha_free(d->m);
}

/* One cached forward of n new tokens for every sequence; the outputs and
 * the stored keys and values (read back: they are held now) recorded by
 * position. */
static void wdec_step(wdec *d, int64_t n)
{
    const int64_t E = d->E;
    float *x = malloc((size_t)(B * n * E) * sizeof *x);
    float *y = malloc((size_t)(B * n * E) * sizeof *y);
    tu_fill(x, B * n * E, d->seed++, -1.5f, 1.5f);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = n;
    a.query = x;
    a.cache = d->kv;
    a.num_threads = d->threads;
    a.out = y;
    mha_status st;
    if (d->use_plan && n == 1) {
        if (!d->plan)
            assert_int_equal(mha_plan_create(d->m, &a, &d->plan), MHA_OK);
        st = mha_plan_forward(d->plan, &a);
    } else {
        st = mha_forward(d->m, &a);
    }
    if (st != MHA_OK)
        fail_msg("window forward of %lld tokens: %s", (long long)n,
                 mha_last_error());
    for (int b = 0; b < B; b++) {
        wseq *s = &d->s[b];
        assert_true(s->len + n <= d->maxlen);
        memcpy(s->x + s->len * E, x + b * n * E, (size_t)(n * E) * 4);
        assert_int_equal(mha_kv_cache_read(d->kv, b, s->len, n,
                                           s->k + s->len * d->Ekv,
                                           s->v + s->len * d->Ekv),
                         MHA_OK);
        for (int64_t r = 0; r < n; r++) {
            memcpy(s->out + s->n_out * E, y + (b * n + r) * E,
                   (size_t)E * 4);
            s->pos[s->n_out++] = s->len + r;
        }
        s->len += n;
        assert_int_equal(mha_kv_cache_length(d->kv, b), s->len);
    }
    free(x);
    free(y);
}

/* A rollback: the outputs of the positions removed are forgotten. */
static void wdec_truncate(wdec *d, int b, int64_t len)
{
    if (mha_kv_cache_truncate(d->kv, b, len) != MHA_OK)
        fail_msg("truncate %d to %lld: %s", b, (long long)len,
                 mha_last_error());
    wseq *s = &d->s[b];
    int64_t keep = 0;
    for (int64_t r = 0; r < s->n_out; r++)
        if (s->pos[r] < len) {
            memmove(s->out + keep * d->E, s->out + r * d->E,
                    (size_t)d->E * 4);
            s->pos[keep++] = s->pos[r];
        }
    s->n_out = keep;
    s->len = len;
}

/* The band of width W over n positions, as an allow mask: query i sees
 * keys i - W < j <= i. */
static uint8_t *band(int64_t n, int64_t W)
{
    uint8_t *m = malloc((size_t)(n * n));
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < n; j++)
            m[i * n + j] = j <= i && j > i - W;
    return m;
}

/* Every output against the suite's float64 reference of its sequence's
 * one-shot forward under the band mask (f32 caches: the reference
 * projects the keys itself). */
static void wdec_check_band(const wdec *d, const char *name)
{
    const int64_t E = d->E;
    for (int b = 0; b < B; b++) {
        const wseq *s = &d->s[b];
        if (s->len == 0)
            continue;
        const int64_t n = s->len * E;
        double *r64 = malloc((size_t)n * sizeof *r64);
        float *r32 = malloc((size_t)n * sizeof *r32);
        uint8_t *mask = band(s->len, d->W);
        mha_forward_args a = {0};
        a.batch = 1;
        a.q_len = s->len;
        a.query = s->x;
        a.attn_mask.kind = MHA_MASK_ALLOW;
        a.attn_mask.data = mask;
        a.attn_mask.ndim = 2;
        a.attn_mask.shape[0] = a.attn_mask.shape[1] = s->len;
        assert_int_equal(ref_forward_f64(d->m, &a, r64, NULL), 0);
        assert_int_equal(ref_forward_f32(d->m, &a, r32, NULL), 0);
        const double tol = ref_tolerance(ref_max_err_f32(r32, r64, n),
                                         ref_max_abs(r64, n));
        for (int64_t r = 0; r < s->n_out; r++) {
            const double err = ref_max_err_f32(s->out + r * E,
                                               r64 + s->pos[r] * E, E);
            if (!(err <= tol))
                fail_msg("%s: sequence %d position %lld: error %.3g > bound "
                         "%.3g", name, b, (long long)s->pos[r], err, tol);
        }
        free(mask);
        free(r64);
        free(r32);
    }
}

/* The module's parameters the reference below needs (no bias_kv, no
 * zero_attn): W_q [D][E] and b_q, W_o [E][D] and b_o (NULL: no bias). */
typedef struct qo_params {
    float *wq, *bq, *wo, *bo;
    int64_t H, Hkv, dh, D;
    float scale;
} qo_params;

static void qo_get(const mha_module *m, qo_params *p)
{
    mha_config c;
    assert_int_equal(mha_get_config(m, &c), MHA_OK);
    const int64_t E = c.embed_dim;
    p->H = c.num_heads;
    p->Hkv = c.num_kv_heads;
    p->dh = E / p->H;
    p->D = E;
    p->scale = c.scale;
    mha_param_info info;
    p->wq = malloc((size_t)(E * E) * 4);
    p->wo = malloc((size_t)(E * E) * 4);
    if (mha_param_info_by_name(m, "in_proj_weight", &info) == MHA_OK) {
        float *w = malloc((size_t)info.numel * 4);
        assert_int_equal(mha_param_get(m, info.name, w, info.numel), MHA_OK);
        memcpy(p->wq, w, (size_t)(E * E) * 4);   /* rows [W_q; W_k; W_v] */
        free(w);
    } else {
        assert_int_equal(mha_param_get(m, "q_proj_weight", p->wq, E * E),
                         MHA_OK);
    }
    assert_int_equal(mha_param_get(m, "out_proj.weight", p->wo, E * E),
                     MHA_OK);
    p->bq = p->bo = NULL;
    if (mha_param_info_by_name(m, "in_proj_bias", &info) == MHA_OK) {
        float *bias = malloc((size_t)info.numel * 4);
        assert_int_equal(mha_param_get(m, info.name, bias, info.numel),
                         MHA_OK);
        p->bq = malloc((size_t)E * 4);
        memcpy(p->bq, bias, (size_t)E * 4);      /* [b_q; b_k; b_v] */
        free(bias);
        p->bo = malloc((size_t)E * 4);
        assert_int_equal(mha_param_get(m, "out_proj.bias", p->bo, E),
                         MHA_OK);
    }
}

static void qo_free(qo_params *p)
{
    free(p->wq);
    free(p->bq);
    free(p->wo);
    free(p->bo);
}

/* out (E) of the module at position P of a sequence, from its input row
 * x and the stored keys and values: q = x W_q^T + b_q, the windowed
 * attention, out = ctx W_o^T + b_o, all in T. */
#define MODULE_ROW(NAME, T, ROW)                                              \
    static void NAME(const qo_params *p, const float *x, const float *K,      \
                     const float *V, int64_t lo, int64_t P, T *out, T *q,     \
                     T *ctx, T *s)                                            \
    {                                                                         \
        const int64_t D = p->D;                                               \
        for (int64_t o = 0; o < D; o++) {                                     \
            T acc = p->bq ? (T)p->bq[o] : 0;                                  \
            for (int64_t e = 0; e < D; e++)                                   \
                acc += (T)x[e] * (T)p->wq[o * D + e];                         \
            q[o] = acc;                                                       \
        }                                                                     \
        ROW(q, p->H, p->Hkv, p->dh, K, V, lo, P, (T)p->scale, ctx, s);       \
        for (int64_t o = 0; o < D; o++) {                                     \
            T acc = p->bo ? (T)p->bo[o] : 0;                                  \
            for (int64_t c = 0; c < D; c++)                                   \
                acc += ctx[c] * (T)p->wo[o * D + c];                          \
            out[o] = acc;                                                     \
        }                                                                     \
    }
MODULE_ROW(module_row64, double, window_row64)
MODULE_ROW(module_row32, float, window_row32)

/* Every output against the float64 module row above, on the keys and
 * values the cache stored (any dtype). */
static void wdec_check_stored(const wdec *d, const char *name)
{
    qo_params p;
    qo_get(d->m, &p);
    const int64_t E = d->E;
    for (int b = 0; b < B; b++) {
        const wseq *s = &d->s[b];
        const int64_t n = s->n_out * E;
        double *r64 = malloc((size_t)(n + 1) * sizeof *r64);
        float *r32 = malloc((size_t)(n + 1) * sizeof *r32);
        double *q64 = malloc((size_t)(2 * E + d->W) * sizeof *q64);
        float *q32 = malloc((size_t)(2 * E + d->W) * sizeof *q32);
        for (int64_t r = 0; r < s->n_out; r++) {
            const int64_t P = s->pos[r], lo = P - d->W + 1 > 0 ? P - d->W + 1
                                                                : 0;
            module_row64(&p, s->x + P * E, s->k, s->v, lo, P, r64 + r * E,
                         q64, q64 + E, q64 + 2 * E);
            module_row32(&p, s->x + P * E, s->k, s->v, lo, P, r32 + r * E,
                         q32, q32 + E, q32 + 2 * E);
        }
        const double tol = ref_tolerance(ref_max_err_f32(r32, r64, n),
                                         ref_max_abs(r64, n));
        for (int64_t r = 0; r < s->n_out; r++) {
            const double err = ref_max_err_f32(s->out + r * E, r64 + r * E,
                                               E);
            if (!(err <= tol))
                fail_msg("%s: sequence %d position %lld: error %.3g > bound "
                         "%.3g", name, b, (long long)s->pos[r], err, tol);
        }
        free(r64);
        free(r32);
        free(q64);
        free(q32);
    }
    qo_free(&p);
}

/* ---- the module, f32, against the one-shot forward under the band -------- */

typedef struct wcase {
    const char *name;
    int64_t E, H, Hkv;
    int bias_kv, zero_attn, no_bias;
    int64_t W;
} wcase;

static const wcase CASES[] = {
    {"plain, W 20", 32, 4, 0, 0, 0, 0, 20},
    {"GQA 4/2, W 100 (a ring of two tiles)", 32, 4, 2, 0, 0, 0, 100},
    {"MQA 4/1, no bias, W 64", 32, 4, 1, 0, 0, 1, 64},
    {"bias_kv + zero_attn, GQA 6/3, W 33", 24, 6, 3, 1, 1, 0, 33},
};

static mha_config case_config(const wcase *c)
{
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.num_kv_heads = c->Hkv;
    cfg.add_bias_kv = c->bias_kv;
    cfg.add_zero_attn = c->zero_attn;
    cfg.no_bias = c->no_bias;
    return cfg;
}

/* Sequences of three lengths: a prefill, a rollback of sequence 1, a
 * reset of sequence 2; then `steps` steps of `chunk` tokens, with a
 * rollback of `back` tokens of sequence 0 half way (a ring of W + back
 * slots or more holds what that needs). */
static void run_decode(wdec *d, int64_t chunk, int steps, int64_t back)
{
    wdec_step(d, chunk);
    wdec_step(d, chunk);
    wdec_truncate(d, 1, chunk + 3 < 2 * chunk ? chunk + 3 : chunk);
    assert_int_equal(mha_kv_cache_reset(d->kv, 2), MHA_OK);
    wdec_truncate(d, 2, 0);
    for (int step = 0; step < steps; step++) {
        wdec_step(d, chunk);
        if (step == steps / 2 && back)   /* rejected speculative tokens */
            wdec_truncate(d, 0, d->s[0].len - back);
    }
}

static void test_decode_equals_band(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const wcase *c = &CASES[t];
        const mha_config cfg = case_config(c);
        /* Token by token in the smallest ring (W slots: no rollback),
         * and with 3 spare slots (a rollback of 3); chunks of 7 in
         * W + 6 slots (a rollback of 6). */
        static const int64_t runs[3][2] = {{1, 0}, {1, 3}, {7, 6}};
        for (int run = 0; run < 3; run++) {
            const int64_t chunk = runs[run][0], back = runs[run][1];
            const int64_t cap = c->W + (chunk > back + 1 ? chunk - 1 : back);
            const int steps = chunk == 1 ? 260 : 50;
            wdec d;
            wdec_init(&d, &cfg, c->W, cap, MHA_KV_F32,
                      2 * chunk + steps * chunk, 0);
            run_decode(&d, chunk, steps, back);
            for (int b = 0; b < B; b++)   /* the rings wrapped */
                assert_true(d.s[b].len > cap);
            char name[160];
            snprintf(name, sizeof name, "%s, chunks of %lld, %lld slots",
                     c->name, (long long)chunk, (long long)cap);
            wdec_check_band(&d, name);
            wdec_free(&d);
        }
    }
}

/* 1,300 tokens one by one through a window of 1,030 (a ring of as many
 * slots): more than 1,024 keys, so the keys split in chunks of 512 and the
 * grouped-query heads stack; the steps planned. */
static void test_long_decode(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 32;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    wdec d;
    wdec_init(&d, &cfg, 1030, 1030, MHA_KV_F32, 1400, 0);
    d.use_plan = 1;
    wdec_truncate(&d, 0, 0);
    wdec_step(&d, 1);
    assert_int_equal(mha_kv_cache_reset(d.kv, 1), MHA_OK);
    wdec_truncate(&d, 1, 0);
    for (int step = 0; step < 1300; step++) {
        wdec_step(&d, 1);
        if (step == 40)
            wdec_truncate(&d, 2, 20);   /* three lengths */
    }
    assert_true(d.s[2].len > 1030);
    wdec_check_band(&d, "GQA 4/2, window 1030, 1300 steps");
    wdec_free(&d);
}

/* The compact dtypes, through the module: the same as attention on what
 * the cache stores. */
static void test_dtypes_module(void **state)
{
    (void)state;
    static const mha_kv_dtype types[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16,
                                         MHA_KV_Q8};
    static const char *const names[] = {"f32", "f16", "bf16", "q8"};
    mha_config cfg = {0};
    cfg.embed_dim = 64;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;   /* d_h 16; q8's one block of 16 */
    for (int t = 0; t < 4; t++)
        for (int64_t chunk = 1; chunk <= 7; chunk += 6) {
            const int steps = chunk == 1 ? 150 : 30;
            wdec d;
            wdec_init(&d, &cfg, 40, 40 + 6, types[t],
                      2 * chunk + steps * chunk, 0);
            run_decode(&d, chunk, steps, 6);
            char name[80];
            snprintf(name, sizeof name, "GQA 4/2, %s cache, chunks of %lld",
                     names[t], (long long)chunk);
            wdec_check_stored(&d, name);
            wdec_free(&d);
        }
}

/* ---- attention on heads ------------------------------------------------- */

/* Lq queries per sequence and step on a window cache the test fills:
 * every output within the bound of the float64 window over the stored
 * values.  Sequences start 0, 5 and 11 tokens long. */
static void heads_decode(mha_kv_dtype dtype, int64_t Hkv, int64_t Lq,
                         const char *name)
{
    enum { H = 4, DH = 16, E = H * DH, W = 45, STEPS = 150 };
    const int64_t Ekv = Hkv * DH, cap = W + Lq - 1;
    const int64_t maxlen = 11 + STEPS * Lq;
    const mha_kv_cache_config kc = {B, Hkv, DH, cap, dtype, W, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float *K[B], *V[B];
    int64_t len[B] = {0, 5, 11};
    float *k = malloc((size_t)(maxlen * Ekv) * 4);
    float *v = malloc((size_t)(maxlen * Ekv) * 4);
    float *q = malloc((size_t)(B * Lq * E) * 4);
    float *out = malloc((size_t)(B * Lq * E) * 4);
    double *r64 = malloc((size_t)(Lq * E) * sizeof *r64);
    float *r32 = malloc((size_t)(Lq * E) * 4);
    double q64[E], s64[W];
    float s32[W];
    uint64_t seed = 70;
    for (int b = 0; b < B; b++) {
        K[b] = malloc((size_t)(maxlen * Ekv) * 4);
        V[b] = malloc((size_t)(maxlen * Ekv) * 4);
        tu_fill(k, len[b] * Ekv, seed++, -2, 2);
        tu_fill(v, len[b] * Ekv, seed++, -2, 2);
        assert_int_equal(mha_kv_cache_append(kv, b, k, v, len[b]), MHA_OK);
        assert_int_equal(mha_kv_cache_read(kv, b, 0, len[b], K[b], V[b]),
                         MHA_OK);
    }
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.num_kv_heads = Hkv;
    a.head_dim = DH;
    a.q_len = Lq;
    a.q = q;
    a.cache = kv;
    a.out = out;
    mha_attention_plan *plan = NULL;
    assert_int_equal(mha_attention_plan_create(&a, &plan), MHA_OK);
    const float scale = 0.25f;   /* 1 / sqrt(16) */
    for (int step = 0; step < STEPS; step++) {
        for (int b = 0; b < B; b++) {
            tu_fill(k, Lq * Ekv, seed++, -2, 2);
            tu_fill(v, Lq * Ekv, seed++, -2, 2);
            assert_int_equal(mha_kv_cache_append(kv, b, k, v, Lq), MHA_OK);
            assert_int_equal(mha_kv_cache_read(kv, b, len[b], Lq,
                                               K[b] + len[b] * Ekv,
                                               V[b] + len[b] * Ekv),
                             MHA_OK);
            len[b] += Lq;
        }
        tu_fill(q, B * Lq * E, seed++, -2, 2);
        if (mha_attention_plan_run(plan, &a) != MHA_OK)
            fail_msg("%s: step %d: %s", name, step, mha_last_error());
        for (int b = 0; b < B; b++) {
            bound bd = {0, 0};
            for (int64_t i = 0; i < Lq; i++) {
                const int64_t P = len[b] - Lq + i;
                const int64_t lo = P - W + 1 > 0 ? P - W + 1 : 0;
                const float *qi = q + (b * Lq + i) * E;
                float q32[E];
                for (int d = 0; d < E; d++)
                    q64[d] = q32[d] = qi[d];
                window_row64(q64, H, Hkv, DH, K[b], V[b], lo, P, scale,
                             r64 + i * E, s64);
                window_row32(q32, H, Hkv, DH, K[b], V[b], lo, P, scale,
                             r32 + i * E, s32);
            }
            bound_add(&bd, r32, r64, Lq * E);
            const double tol = ref_tolerance(bd.naive, bd.max_abs);
            const double err = ref_max_err_f32(out + b * Lq * E, r64, Lq * E);
            if (!(err <= tol))
                fail_msg("%s: step %d sequence %d: error %.3g > bound %.3g",
                         name, step, b, err, tol);
        }
    }
    assert_true(len[0] > cap);
    mha_attention_plan_free(plan);
    for (int b = 0; b < B; b++) {
        free(K[b]);
        free(V[b]);
    }
    free(k);
    free(v);
    free(q);
    free(out);
    free(r64);
    free(r32);
    mha_kv_cache_free(kv);
}

static void test_attention_on_heads(void **state)
{
    (void)state;
    heads_decode(MHA_KV_F32, 2, 1, "f32, GQA 4/2, one query");
    heads_decode(MHA_KV_F32, 4, 3, "f32, 4 heads, three queries");
    heads_decode(MHA_KV_F16, 2, 3, "f16, GQA 4/2, three queries");
    heads_decode(MHA_KV_F16, 1, 1, "f16, MQA 4/1, one query");
}

/* ---- non-finite values -------------------------------------------------- */

/* A NaN key and value (f32) or Inf ones (f16) at
 * position 30 of sequence 1, a window of W in a ring of 80: the rows at
 * positions 30 .. 29 + W are not finite, every other row is, while the
 * bad slot stays in the ring outside the window (its tile must take the
 * exact pv, which skips the weights of 0: with W = 50, the row at 80
 * reads slots 0 and 31 .. 63 of tile 0 after position 80 overwrote slot
 * 0) and after it is overwritten (position 110). */
static void nonfinite(mha_kv_dtype dtype, float bad, int64_t W)
{
    enum { H = 2, DH = 8, E = H * DH, CAP = 80, L = 200 };
    const mha_kv_cache_config kc = {B, H, DH, CAP, dtype, W, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float k[E], v[E], q[B * E], out[B * E];
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.head_dim = DH;
    a.q_len = 1;
    a.q = q;
    a.cache = kv;
    a.out = out;
    for (int64_t p = 0; p < L; p++) {
        for (int b = 0; b < B; b++) {
            tu_fill(k, E, 1000 + (uint64_t)(p * B + b), -1, 1);
            tu_fill(v, E, 5000 + (uint64_t)(p * B + b), -1, 1);
            if (b == 1 && p == 30) {
                k[3] = bad;
                v[E - 2] = bad;
                v[1] = bad;   /* both heads' values */
            }
            assert_int_equal(mha_kv_cache_append(kv, b, k, v, 1), MHA_OK);
        }
        tu_fill(q, B * E, 9000 + (uint64_t)p, -1, 1);
        assert_int_equal(mha_attention(&a), MHA_OK);
        for (int b = 0; b < B; b++) {
            int finite = 1;
            for (int d = 0; d < E; d++)
                finite &= isfinite(out[b * E + d]) != 0;
            const int sees = b == 1 && p >= 30 && p < 30 + W;
            if (finite == sees)
                fail_msg("dtype %d, window %lld: sequence %d position %lld: "
                         "output %s", (int)dtype, (long long)W, b,
                         (long long)p,
                         finite ? "finite" : "not finite");
        }
    }
    mha_kv_cache_free(kv);
}

static void test_nonfinite(void **state)
{
    (void)state;
    for (int64_t W = 10; W <= 50; W += 40) {
        nonfinite(MHA_KV_F32, NAN, W);
        nonfinite(MHA_KV_F16, INFINITY, W);
    }
}

/* ---- before any wrap: the bits of an ordinary cache ------------------------ */

/* Four caches decode the same tokens: a window of 20 and an ordinary
 * cache given the band as a (B, Lq, Lk) mask; a window as long as the
 * capacity and an ordinary cache alone.  Until the ring wraps the slot
 * order is the position order: the same bits.  Lk passes 1,024 (split
 * keys; stacked heads for the window, not under an explicit mask). */
static void test_unwrapped_bitwise(void **state)
{
    (void)state;
    enum { CAP = 1100, E = 32 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    mha_module *m = tu_module(&cfg, 31);
    assert_non_null(m);
    mha_kv_cache *kv[4];
    /* (a step of 64 tokens needs 63 more slots than the window) */
    const int64_t windows[4] = {20, 0, CAP, 0};
    const int64_t caps[4] = {CAP, CAP, CAP + 63, CAP};
    for (int c = 0; c < 4; c++) {
        const mha_kv_cache_config kc = {B, 2, 8, caps[c], MHA_KV_F32,
                                        windows[c], 0, 0, 0, 0, 0};
        assert_int_equal(mha_kv_cache_create(&kc, &kv[c]), MHA_OK);
    }
    int64_t len[B] = {0, 0, 0};
    float *x = malloc((size_t)(B * 64 * E) * 4);
    float *y[4];
    for (int c = 0; c < 4; c++)
        y[c] = malloc((size_t)(B * 64 * E) * 4);
    uint8_t *mask = malloc((size_t)(64 * CAP));
    uint64_t seed = 3;
    for (int step = 0; len[0] < 1060; step++) {
        const int64_t n = len[0] < 960 ? 64 : 1;
        tu_fill(x, B * n * E, seed++, -1.5f, 1.5f);
        int64_t Lk = 0;
        for (int b = 0; b < B; b++)
            Lk = len[b] + n > Lk ? len[b] + n : Lk;
        /* The band for each sequence's own positions (its new token i is
         * position len + i); columns past its length attend (masked
         * anyway). */
        uint8_t *mk = realloc(mask, (size_t)(B * n * Lk));
        assert_non_null(mk);
        mask = mk;
        for (int b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < Lk; j++) {
                    const int64_t P = len[b] + i;
                    mask[(b * n + i) * Lk + j] = j > P - 20;
                }
        for (int c = 0; c < 4; c++) {
            mha_forward_args a = {0};
            a.batch = B;
            a.q_len = n;
            a.query = x;
            a.cache = kv[c];
            a.out = y[c];
            if (c == 1) {
                a.attn_mask.kind = MHA_MASK_ALLOW;
                a.attn_mask.data = mask;
                a.attn_mask.ndim = 3;
                a.attn_mask.shape[0] = B;
                a.attn_mask.shape[1] = n;
                a.attn_mask.shape[2] = Lk;
            }
            if (mha_forward(m, &a) != MHA_OK)
                fail_msg("cache %d, step %d: %s", c, step, mha_last_error());
        }
        assert_memory_equal(y[0], y[1], (size_t)(B * n * E) * 4);
        assert_memory_equal(y[2], y[3], (size_t)(B * n * E) * 4);
        for (int b = 0; b < B; b++)
            len[b] += n;
        if (step == 0)
            for (int c = 0; c < 4; c++) {   /* three lengths */
                assert_int_equal(mha_kv_cache_truncate(kv[c], 1, 30), MHA_OK);
                assert_int_equal(mha_kv_cache_reset(kv[c], 2), MHA_OK);
                len[1] = 30;
                len[2] = 0;
            }
    }
    for (int c = 0; c < 4; c++) {
        mha_kv_cache_free(kv[c]);
        free(y[c]);
    }
    free(x);
    free(mask);
    mha_free(m);
}

/* ---- threads ------------------------------------------------------------ */

/* A window of 1,030 in a ring of 1,036 filled by the caller, then steps
 * of 1 and 7 tokens through the module past the wrap: B H Lq Lt d_h >=
 * 2^20, so the threads run (the split keys, the stacked heads, and the
 * query blocks of 7).  1, 2 and 4 threads: the same bits. */
static void threaded(int threads, float *outs)
{
    enum { BT = 4, E = 256, H = 4, HKV = 2, DH = 64, EKV = HKV * DH,
           W = 1030, CAP = 1036 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.num_kv_heads = HKV;
    mha_module *m = tu_module(&cfg, 41);
    assert_non_null(m);
    const mha_kv_cache_config kc = {BT, HKV, DH, CAP, MHA_KV_F32, W, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float *k = malloc((size_t)(CAP * EKV) * 4);
    float *v = malloc((size_t)(CAP * EKV) * 4);
    for (int b = 0; b < BT; b++) {
        const int64_t n = CAP - 3 * b;   /* four lengths */
        tu_fill(k, n * EKV, 60 + (uint64_t)b, -1, 1);
        tu_fill(v, n * EKV, 70 + (uint64_t)b, -1, 1);
        assert_int_equal(mha_kv_cache_append(kv, b, k, v, n), MHA_OK);
    }
    float x[BT * 7 * E];
    for (int step = 0; step < 24; step++) {
        const int64_t n = step % 8 == 7 ? 7 : 1;
        tu_fill(x, BT * n * E, 80 + (uint64_t)step, -1, 1);
        mha_forward_args a = {0};
        a.batch = BT;
        a.q_len = n;
        a.query = x;
        a.cache = kv;
        a.num_threads = threads;
        a.out = outs;
        assert_int_equal(mha_forward(m, &a), MHA_OK);
        outs += BT * n * E;
    }
    free(k);
    free(v);
    mha_kv_cache_free(kv);
    mha_free(m);
}

static void test_threads_bitwise(void **state)
{
    (void)state;
    const size_t n = (size_t)4 * (21 + 3 * 7) * 256;
    float *one = malloc(n * 4), *many = malloc(n * 4);
    threaded(1, one);
    for (int t = 2; t <= 4; t += 2) {
        threaded(t, many);
        assert_memory_equal(one, many, n * 4);
    }
    free(one);
    free(many);
}

/* ---- misuse --------------------------------------------------------------- */

/* The lengths and the held keys of the cache, to see that a refused call
 * changed nothing. */
typedef struct snapshot {
    int64_t len[B];
    float k[B][26 * 8], v[B][26 * 8];
} snapshot;

static void snap(const mha_kv_cache *kv, snapshot *s)
{
    memset(s, 0, sizeof *s);
    for (int b = 0; b < B; b++) {
        s->len[b] = mha_kv_cache_length(kv, b);
        const int64_t held = s->len[b] < 20 ? s->len[b] : 20;
        assert_int_equal(mha_kv_cache_read(kv, b, s->len[b] - held, held,
                                           s->k[b], s->v[b]),
                         MHA_OK);
    }
}

static void assert_unchanged(const mha_kv_cache *kv, const snapshot *before)
{
    snapshot now;
    snap(kv, &now);
    assert_memory_equal(&now, before, sizeof now);
}

static void test_misuse(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 16;
    cfg.num_heads = 4;
    cfg.num_kv_heads = 2;
    mha_module *m = tu_module(&cfg, 7);
    mha_kv_cache *kv = NULL;
    /* Windows the ring cannot hold. */
    mha_kv_cache_config kc = {B, 2, 4, 19, MHA_KV_F32, 20, 0, 0, 0, 0, 0};
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "window 20");
    assert_null(kv);
    kc.window = -1;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "window -1");
    /* W 20 in a ring of 26: steps of up to 7 tokens. */
    kc.capacity = 26;
    kc.window = 20;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float x[B * 30 * 16], y[B * 30 * 16], k[30 * 8], w[B * 4 * 30 * 40];
    tu_fill(x, B * 30 * 16, 8, -1, 1);
    tu_fill(k, 30 * 8, 9, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = 7;
    a.query = x;
    a.cache = kv;
    a.out = y;
    for (int s = 0; s < 6; s++)
        assert_int_equal(mha_forward(m, &a), MHA_OK);   /* 42: wrapped */
    assert_int_equal(mha_kv_cache_length(kv, 0), 42);
    snapshot before;
    snap(kv, &before);

    /* A step too large for the ring: 8 + 20 - 1 > 26. */
    mha_forward_args b = a;
    b.q_len = 8;
    assert_fails(mha_forward(m, &b), MHA_ERR_INVALID_ARGUMENT,
                 "more than its capacity 26");
    assert_unchanged(kv, &before);
    mha_plan *p = NULL;
    assert_fails(mha_plan_create(m, &b, &p), MHA_ERR_INVALID_ARGUMENT,
                 "capacity 26");
    assert_null(p);
    /* What composes with an ordinary cache but not with a window. */
    uint8_t allow[7 * 49];
    memset(allow, 1, sizeof allow);
    b = a;
    b.attn_mask.kind = MHA_MASK_ALLOW;
    b.attn_mask.data = allow;
    b.attn_mask.ndim = 2;
    b.attn_mask.shape[0] = 7;
    b.attn_mask.shape[1] = 49;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "attn_mask");
    b = a;
    b.key_padding_mask.kind = MHA_MASK_ALLOW;
    b.key_padding_mask.data = allow;
    b.key_padding_mask.ndim = 1;
    b.key_padding_mask.shape[0] = 49;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED,
                 "key_padding_mask");
    const int64_t kl[B] = {1, 1, 1};
    b = a;
    b.key_lengths = kl;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "key_lengths");
    b = a;
    b.need_weights = MHA_WEIGHTS_PER_HEAD;
    b.attn_weights = w;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "need_weights");
    b = a;
    b.kv_len = 26;
    assert_fails(mha_forward(m, &b), MHA_ERR_UNSUPPORTED, "kv_len");
    assert_unchanged(kv, &before);

    /* Appending more than the ring at once; up to it is fine. */
    assert_fails(mha_kv_cache_append(kv, 0, k, k, 27),
                 MHA_ERR_INVALID_ARGUMENT, "capacity 26");
    assert_unchanged(kv, &before);

    /* Reading what the ring overwrote: 42 - 26 = 16 is the oldest. */
    float r[8];
    assert_fails(mha_kv_cache_read(kv, 0, 15, 1, r, NULL),
                 MHA_ERR_INVALID_ARGUMENT, "positions 16 .. 41");
    assert_int_equal(mha_kv_cache_read(kv, 0, 16, 1, r, NULL), MHA_OK);

    /* Truncating past what is held: length 35 needs positions 15 .. 34. */
    assert_fails(mha_kv_cache_truncate(kv, 0, 35), MHA_ERR_INVALID_ARGUMENT,
                 "oldest position the ring holds is 16");
    assert_unchanged(kv, &before);
    assert_int_equal(mha_kv_cache_truncate(kv, 0, 36), MHA_OK);  /* 16.. */
    assert_int_equal(mha_kv_cache_length(kv, 0), 36);
    /* The oldest held stays 16: truncation brings nothing back. */
    assert_fails(mha_kv_cache_read(kv, 0, 15, 1, r, NULL),
                 MHA_ERR_INVALID_ARGUMENT, "positions 16 .. 35");
    assert_fails(mha_kv_cache_truncate(kv, 0, 35), MHA_ERR_INVALID_ARGUMENT,
                 "is 16");

    /* Attention on heads: three queries on sequence 0 at 34 .. 36 would
     * see from 15 (after one more token each): refused; so are windows'
     * unsupported arguments and steps too large for the ring. */
    float hk[8], hv[8];
    tu_fill(hk, 8, 11, -1, 1);
    tu_fill(hv, 8, 12, -1, 1);
    for (int s = 0; s < B; s++)
        assert_int_equal(mha_kv_cache_append(kv, s, hk, hv, 1), MHA_OK);
    snap(kv, &before);
    float q[B * 3 * 16], o[B * 3 * 16];
    tu_fill(q, B * 3 * 16, 13, -1, 1);
    mha_attention_args h = {0};
    h.batch = B;
    h.num_heads = 4;
    h.num_kv_heads = 2;
    h.head_dim = 4;
    h.q_len = 3;
    h.q = q;
    h.cache = kv;
    h.out = o;
    assert_fails(mha_attention(&h), MHA_ERR_INVALID_ARGUMENT,
                 "sequence 0: its queries at positions 34 .. 36 see keys "
                 "from position 15");
    h.q_len = 2;
    assert_int_equal(mha_attention(&h), MHA_OK);
    h.q_len = 8;
    assert_fails(mha_attention(&h), MHA_ERR_INVALID_ARGUMENT,
                 "more than its capacity 26");
    h.q_len = 1;
    h.key_lengths = kl;
    assert_fails(mha_attention(&h), MHA_ERR_UNSUPPORTED, "key_lengths");
    h.key_lengths = NULL;
    h.need_weights = MHA_WEIGHTS_AVERAGE;
    h.attn_weights = w;
    assert_fails(mha_attention(&h), MHA_ERR_UNSUPPORTED, "need_weights");
    assert_unchanged(kv, &before);

    /* Truncating to 0 starts the sequence again; reset likewise. */
    assert_int_equal(mha_kv_cache_truncate(kv, 0, 0), MHA_OK);
    assert_int_equal(mha_kv_cache_append(kv, 0, k, k, 26), MHA_OK);
    assert_int_equal(mha_kv_cache_read(kv, 0, 0, 1, r, NULL), MHA_OK);
    assert_int_equal(mha_kv_cache_reset(kv, -1), MHA_OK);
    assert_int_equal(mha_kv_cache_length(kv, 2), 0);
    assert_int_equal(mha_kv_cache_append(kv, 2, k, k, 26), MHA_OK);
    assert_int_equal(mha_kv_cache_read(kv, 2, 0, 1, NULL, r), MHA_OK);
    assert_int_equal(mha_kv_cache_length(kv, 2), 26);
    mha_kv_cache_free(kv);
    mha_free(m);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_decode_equals_band),
        cmocka_unit_test(test_long_decode),
        cmocka_unit_test(test_dtypes_module),
        cmocka_unit_test(test_attention_on_heads),
        cmocka_unit_test(test_nonfinite),
        cmocka_unit_test(test_unwrapped_bitwise),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
