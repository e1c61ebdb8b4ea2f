/*
 * test_kv_cache_compose.c -- a forward with a KV cache composes with every
 * other option: attention masks (bool and additive, every rank), key
 * padding masks, key lengths, attention weights (per head and averaged),
 * head masks, bias_k / add_zero_attn, threads.
 *
 * The masks of every step are drawn from functions of absolute positions
 * (sequence b, head h, query position p, key position j), so the steps of
 * a decode and the one-shot forward of the whole sequence can be given
 * the same masks: each step's (B, Lq, Lk), (B, H, Lq, Lk), (B, Lk) or (Lk)
 * masks with Lk = the longest sequence after the step, and the whole
 * sequence's (1, n, n), (1, H, n, n), (1, n) or (n) ones.  Columns past a
 * shorter sequence's length are filled with "attend" (or a finite value):
 * they must be masked regardless.
 *
 *   - three sequences of different lengths (a rollback by truncation, a
 *     reset) prefilled in chunks of 7, then decoded step by step with
 *     chunks of 3, across key tiles, for plain, grouped-query and
 *     bias_kv + zero_attn modules; and a long decode (Lk > 1024: the keys
 *     split in chunks, grouped-query stacking with key lengths only):
 *     every output row against the float64 reference of its sequence's
 *     one-shot forward (tests/support), and every weight row too (exact
 *     zeros past the sequence's length);
 *   - mha_attention on a cache with masks, key lengths and weights: each
 *     sequence the same as mha_attention on its own keys;
 *   - 1, 2 and 4 threads bitwise equal (outputs and weights), planned;
 *   - every misuse refused with the cache's lengths unchanged.
 *
 * Every tier runs it (CTest, MHA_ISA).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "assert_error.h"
#include "ref.h"
#include "testutil.h"

enum { B = 3, MAXH = 8 };

/* ---- masks as functions of absolute positions ----------------------------- */

static uint64_t mix(uint64_t z)
{
    z += UINT64_C(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

static uint64_t hash(uint64_t salt, int64_t a, int64_t b, int64_t c,
                     int64_t d)
{
    uint64_t x = mix(salt);
    x = mix(x ^ (uint64_t)a);
    x = mix(x ^ (uint64_t)b);
    x = mix(x ^ (uint64_t)c);
    return mix(x ^ (uint64_t)d);
}

/* Bool attn_mask (ALLOW): query p of sequence b may attend key j. */
static uint8_t allow_at(int64_t b, int64_t p, int64_t j)
{
    return hash(1, b, p, j, 0) % 10 < 7;
}

/* Additive attn_mask of head h: -inf one time in five, else [-3, 3). */
static float add_at(int64_t b, int64_t h, int64_t p, int64_t j)
{
    const uint64_t u = hash(2, b, h, p, j);
    if (u % 5 == 0)
        return -INFINITY;
    return (float)((double)(u >> 11) * 0x1p-53 * 6.0 - 3.0);
}

/* key_padding_mask (B, Lk), BLOCK: key j of sequence b is padding. */
static uint8_t padded_at(int64_t b, int64_t j)
{
    return hash(3, b, j, 0, 0) % 4 == 0;
}

/* key_padding_mask (Lk), ALLOW, shared by the sequences. */
static uint8_t real_at(int64_t j)
{
    return hash(4, j, 0, 0, 0) % 5 != 0;
}

/* Head mask factors: one head removed, one negative, one fractional. */
static float head_factor(int64_t h)
{
    static const float f[4] = {1.0f, 0.5f, 0.0f, -1.25f};
    return f[h % 4];
}

typedef struct variant {
    const char *name;
    mha_mask_kind attn;   /* NONE, ALLOW (B, Lq, Lk), ADDITIVE (B, H, Lq, Lk) */
    int pad;              /* 0; 1: (B, Lk) BLOCK; 2: (Lk) ALLOW          */
    int klen;             /* key_lengths[b] = min(K[b], Lk)               */
    mha_weights_mode weights;
    int head_mask;
} variant;

static const variant VARIANTS[] = {
    {"bool attn_mask (B,Lq,Lk)", MHA_MASK_ALLOW, 0, 0, MHA_WEIGHTS_NONE, 0},
    {"additive attn_mask (B,H,Lq,Lk)", MHA_MASK_ADDITIVE, 0, 0,
     MHA_WEIGHTS_NONE, 0},
    {"key_padding_mask (B,Lk)", MHA_MASK_NONE, 1, 0, MHA_WEIGHTS_NONE, 0},
    {"key_padding_mask (Lk)", MHA_MASK_NONE, 2, 0, MHA_WEIGHTS_NONE, 0},
    {"key_lengths", MHA_MASK_NONE, 0, 1, MHA_WEIGHTS_NONE, 0},
    {"weights per head", MHA_MASK_NONE, 0, 0, MHA_WEIGHTS_PER_HEAD, 0},
    {"weights average + bool mask", MHA_MASK_ALLOW, 0, 0, MHA_WEIGHTS_AVERAGE,
     0},
    {"head_mask", MHA_MASK_NONE, 0, 0, MHA_WEIGHTS_NONE, 1},
    {"everything: additive, padding, lengths, weights, head mask",
     MHA_MASK_ADDITIVE, 1, 1, MHA_WEIGHTS_PER_HEAD, 1},
};
enum { N_VARIANTS = sizeof VARIANTS / sizeof *VARIANTS };

/* ---- a decoder that records what it produced ------------------------------ */

typedef struct seq {
    float *x;        /* [cap][E] the inputs of the tokens in the cache  */
    int64_t len;
    float *out;      /* [max_out][E], output k for position pos[k]      */
    int64_t *pos;
    int64_t *wslot;  /* output k's weights slot, or -1                  */
    int64_t n_out;
    float *w;        /* [max_w][Hw][cap + 2]: real keys, then extras    */
    int64_t n_w;
} seq;

typedef struct dec {
    mha_module *m;
    mha_kv_cache *kv;
    mha_plan *plan;       /* for Lq = 1 steps when use_plan */
    const variant *v;
    const int64_t *K;     /* key_lengths limits per sequence */
    int64_t E, H, extra, cap, Hw, max_out, max_w, wrow;
    int threads, use_plan;
    uint64_t seed;
    seq s[B];
} dec;

static void dec_init(dec *d, const mha_config *cfg, const variant *v,
                     const int64_t *K, int64_t cap, int64_t max_w,
                     int threads, int use_plan)
{
    memset(d, 0, sizeof *d);
    d->m = tu_module(cfg, 77);
    assert_non_null(d->m);
    d->v = v;
    d->K = K;
    d->E = cfg->embed_dim;
    d->H = cfg->num_heads;
    d->extra = (cfg->add_bias_kv != 0) + (cfg->add_zero_attn != 0);
    d->cap = cap;
    d->Hw = v->weights == MHA_WEIGHTS_PER_HEAD ? d->H : 1;
    d->max_out = 4 * cap;
    d->max_w = max_w;
    d->wrow = cap + 2;
    d->threads = threads;
    d->use_plan = use_plan;
    d->seed = 1000;
    assert_int_equal(mha_kv_cache_for_module(d->m, B, cap, &d->kv), MHA_OK);
    for (int b = 0; b < B; b++) {
        seq *s = &d->s[b];
        s->x = calloc((size_t)(cap * d->E), sizeof(float));
        s->out = malloc((size_t)(d->max_out * d->E) * sizeof(float));
        s->pos = malloc((size_t)d->max_out * sizeof(int64_t));
        s->wslot = malloc((size_t)d->max_out * sizeof(int64_t));
        s->w = malloc((size_t)(max_w * d->Hw * d->wrow) * sizeof(float) + 1);
        assert_true(s->x && s->out && s->pos && s->wslot && s->w);
    }
}

static void dec_free(dec *d)
{
    for (int b = 0; b < B; b++) {
        free(d->s[b].x);
        free(d->s[b].out);
        free(d->s[b].pos);
        free(d->s[b].wslot);
        free(d->s[b].w);
    }
    mha_plan_free(d->plan);
    mha_kv_cache_free(d->kv);
    mha_free(d->m);
}

/* The masks of a step of n new tokens, lb[b] the lengths before it and Lk
 * the longest after; NULL where the variant has none.  Columns past
 * sequence b's length (lb[b] + n) say "attend". */
typedef struct step_masks {
    uint8_t *allow;   /* (B, n, Lk)    */
    float *add;       /* (B, H, n, Lk) */
    uint8_t *pad;     /* (B, Lk) or (Lk) */
    int64_t kl[B];
    float hm[MAXH];
} step_masks;

static void make_step_masks(const dec *d, const int64_t *lb, int64_t n,
                            int64_t Lk, step_masks *sm, mha_forward_args *a)
{
    const variant *v = d->v;
    const int64_t H = d->H;
    memset(sm, 0, sizeof *sm);
    if (v->attn == MHA_MASK_ALLOW) {
        sm->allow = malloc((size_t)(B * n * Lk));
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < n; i++)
                for (int64_t j = 0; j < Lk; j++)
                    sm->allow[(b * n + i) * Lk + j] =
                        j < lb[b] + n ? allow_at(b, lb[b] + i, j) : 1;
        a->attn_mask = (mha_mask){MHA_MASK_ALLOW, sm->allow, 3, {B, n, Lk}};
    } else if (v->attn == MHA_MASK_ADDITIVE) {
        sm->add = malloc((size_t)(B * H * n * Lk) * sizeof(float));
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < n; i++)
                    for (int64_t j = 0; j < Lk; j++)
                        sm->add[((b * H + h) * n + i) * Lk + j] =
                            j < lb[b] + n ? add_at(b, h, lb[b] + i, j) : 2.0f;
        a->attn_mask =
            (mha_mask){MHA_MASK_ADDITIVE, sm->add, 4, {B, H, n, Lk}};
    }
    if (v->pad == 1) {
        sm->pad = malloc((size_t)(B * Lk));
        for (int64_t b = 0; b < B; b++)
            for (int64_t j = 0; j < Lk; j++)
                sm->pad[b * Lk + j] = j < lb[b] + n ? padded_at(b, j) : 0;
        a->key_padding_mask = (mha_mask){MHA_MASK_BLOCK, sm->pad, 2, {B, Lk}};
    } else if (v->pad == 2) {
        sm->pad = malloc((size_t)Lk);
        for (int64_t j = 0; j < Lk; j++)
            sm->pad[j] = real_at(j);
        a->key_padding_mask = (mha_mask){MHA_MASK_ALLOW, sm->pad, 1, {Lk}};
    }
    if (v->klen) {
        for (int64_t b = 0; b < B; b++)
            sm->kl[b] = d->K[b] < Lk ? d->K[b] : Lk;
        a->key_lengths = sm->kl;
    }
    if (v->head_mask) {
        for (int64_t h = 0; h < H; h++)
            sm->hm[h] = head_factor(h);
        a->head_mask = sm->hm;
    }
}

static void free_step_masks(step_masks *sm)
{
    free(sm->allow);
    free(sm->add);
    free(sm->pad);
}

/* One cached forward of n new tokens for every sequence, with the
 * variant's masks (and its weights when want_w). */
static void dec_step(dec *d, int64_t n, int want_w)
{
    const int64_t E = d->E, Hw = d->Hw;
    int64_t lb[B], Lk = 0;
    for (int b = 0; b < B; b++) {
        lb[b] = d->s[b].len;
        Lk = lb[b] + n > Lk ? lb[b] + n : Lk;
    }
    const int64_t Lt = Lk + d->extra;
    float *x = malloc((size_t)(B * n * E) * sizeof *x);
    float *y = malloc((size_t)(B * n * E) * sizeof *y);
    tu_fill(x, B * n * E, d->seed++, -1.5f, 1.5f);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = n;
    a.kv_len = d->seed % 2 ? Lk : 0;   /* either says the same */
    a.query = x;
    a.cache = d->kv;
    a.num_threads = d->threads;
    a.out = y;
    step_masks sm;
    make_step_masks(d, lb, n, Lk, &sm, &a);
    float *w = NULL;
    const int64_t n_w = B * Hw * n * Lt;
    if (want_w && d->v->weights != MHA_WEIGHTS_NONE) {
        w = malloc((size_t)n_w * sizeof *w);
        for (int64_t k = 0; k < n_w; k++)
            w[k] = NAN;   /* every entry must be written */
        a.need_weights = d->v->weights;
        a.attn_weights = w;
    }
    mha_status st;
    if (d->use_plan && n == 1) {
        if (!d->plan && mha_plan_create(d->m, &a, &d->plan) != MHA_OK)
            fail_msg("plan with a cache: %s", mha_last_error());
        st = mha_plan_forward(d->plan, &a);
    } else {
        st = mha_forward(d->m, &a);
    }
    if (st != MHA_OK)
        fail_msg("%s: cached forward of %lld tokens: %s", d->v->name,
                 (long long)n, mha_last_error());
    for (int b = 0; b < B; b++) {
        seq *s = &d->s[b];
        const int64_t la = lb[b] + n;
        assert_int_equal(mha_kv_cache_length(d->kv, b), la);
        for (int64_t r = 0; r < n; r++) {
            assert_true(s->n_out < d->max_out);
            memcpy(s->x + (lb[b] + r) * E, x + (b * n + r) * E,
                   (size_t)E * sizeof *x);
            memcpy(s->out + s->n_out * E, y + (b * n + r) * E,
                   (size_t)E * sizeof *y);
            s->pos[s->n_out] = lb[b] + r;
            s->wslot[s->n_out] = -1;
            if (w) {
                assert_true(s->n_w < d->max_w);
                const int64_t slot = s->n_w++;
                s->wslot[s->n_out] = slot;
                for (int64_t hw = 0; hw < Hw; hw++) {
                    const float *src = w + ((b * Hw + hw) * n + r) * Lt;
                    float *dst = s->w + (slot * Hw + hw) * d->wrow;
                    memset(dst, 0, (size_t)d->wrow * sizeof *dst);
                    memcpy(dst, src, (size_t)la * sizeof *dst);
                    for (int64_t j = la; j < Lk; j++)
                        if (src[j] != 0.0f)
                            fail_msg("%s: weight (b %d, head %lld, row %lld, "
                                     "key %lld) past the sequence's %lld "
                                     "keys is %g, not 0", d->v->name, b,
                                     (long long)hw, (long long)r,
                                     (long long)j, (long long)la,
                                     (double)src[j]);
                    for (int64_t e = 0; e < d->extra; e++)
                        dst[d->cap + e] = src[Lk + e];
                }
            }
            s->n_out++;
        }
        s->len = la;
    }
    free_step_masks(&sm);
    free(w);
    free(x);
    free(y);
}

/* A rollback: outputs of the positions removed are forgotten with them. */
static void dec_truncate(dec *d, int b, int64_t len)
{
    assert_int_equal(mha_kv_cache_truncate(d->kv, b, len), MHA_OK);
    seq *s = &d->s[b];
    int64_t keep = 0;
    for (int64_t k = 0; k < s->n_out; k++)
        if (s->pos[k] < len) {
            memmove(s->out + keep * d->E, s->out + k * d->E,
                    (size_t)d->E * sizeof(float));
            s->pos[keep] = s->pos[k];
            s->wslot[keep++] = s->wslot[k];
        }
    s->n_out = keep;
    s->len = len;
}

/* Every output (and weight row) against the float64 reference of its
 * sequence's one-shot causal forward with the whole sequence's masks. */
static void dec_check(const dec *d, const char *cfg_name)
{
    const variant *v = d->v;
    const int64_t E = d->E, H = d->H;
    for (int b = 0; b < B; b++) {
        const seq *s = &d->s[b];
        const int64_t n = s->len;
        if (n == 0)
            continue;
        const int64_t Lt = n + d->extra;
        mha_forward_args a = {0};
        a.batch = 1;
        a.q_len = n;
        a.query = s->x;
        a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        uint8_t *allow = NULL, *pad = NULL;
        float *add = NULL, hm[MAXH];
        int64_t kl;
        if (v->attn == MHA_MASK_ALLOW) {
            allow = malloc((size_t)(n * n));
            for (int64_t p = 0; p < n; p++)
                for (int64_t j = 0; j < n; j++)
                    allow[p * n + j] = allow_at(b, p, j);
            a.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 3, {1, n, n}};
        } else if (v->attn == MHA_MASK_ADDITIVE) {
            add = malloc((size_t)(H * n * n) * sizeof *add);
            for (int64_t h = 0; h < H; h++)
                for (int64_t p = 0; p < n; p++)
                    for (int64_t j = 0; j < n; j++)
                        add[(h * n + p) * n + j] = add_at(b, h, p, j);
            a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 4, {1, H, n, n}};
        }
        if (v->pad == 1) {
            pad = malloc((size_t)n);
            for (int64_t j = 0; j < n; j++)
                pad[j] = padded_at(b, j);
            a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {1, n}};
        } else if (v->pad == 2) {
            pad = malloc((size_t)n);
            for (int64_t j = 0; j < n; j++)
                pad[j] = real_at(j);
            a.key_padding_mask = (mha_mask){MHA_MASK_ALLOW, pad, 1, {n}};
        }
        if (v->klen) {
            kl = d->K[b] < n ? d->K[b] : n;
            a.key_lengths = &kl;
        }
        if (v->head_mask) {
            for (int64_t h = 0; h < H; h++)
                hm[h] = head_factor(h);
            a.head_mask = hm;
        }
        double *r64 = malloc((size_t)(n * E) * sizeof *r64);
        float *r32 = malloc((size_t)(n * E) * sizeof *r32);
        double *w64 = NULL;
        float *w32 = NULL;
        if (v->weights != MHA_WEIGHTS_NONE) {
            w64 = malloc((size_t)(H * n * Lt) * sizeof *w64);
            w32 = malloc((size_t)(H * n * Lt) * sizeof *w32);
        }
        assert_int_equal(ref_forward_f64(d->m, &a, r64, w64), 0);
        assert_int_equal(ref_forward_f32(d->m, &a, r32, w32), 0);
        const double tol = ref_tolerance(ref_max_err_f32(r32, r64, n * E),
                                         ref_max_abs(r64, n * E));
        for (int64_t k = 0; k < s->n_out; k++) {
            const double err =
                ref_max_err_f32(s->out + k * E, r64 + s->pos[k] * E, E);
            if (!(err <= tol))
                fail_msg("%s, %s: sequence %d position %lld: error %.3g > "
                         "bound %.3g", cfg_name, v->name, b,
                         (long long)s->pos[k], err, tol);
        }
        if (w64) {
            /* The reference's weights, and naive float32's, as the
             * variant asks for them (Hw rows per position). */
            const int64_t Hw = d->Hw;
            double *ref = w64;
            float *naive = w32;
            if (v->weights == MHA_WEIGHTS_AVERAGE) {
                ref = malloc((size_t)(n * Lt) * sizeof *ref);
                naive = calloc((size_t)(n * Lt), sizeof *naive);
                ref_average_heads(w64, 1, H, n, Lt, ref);
                for (int64_t h = 0; h < H; h++)
                    for (int64_t t = 0; t < n * Lt; t++)
                        naive[t] += w32[h * n * Lt + t] / (float)H;
            }
            const double wtol =
                ref_tolerance(ref_max_err_f32(naive, ref, Hw * n * Lt),
                              ref_max_abs(ref, Hw * n * Lt));
            for (int64_t k = 0; k < s->n_out; k++) {
                if (s->wslot[k] < 0)
                    continue;
                const int64_t p = s->pos[k];
                for (int64_t hw = 0; hw < Hw; hw++) {
                    const float *got =
                        s->w + (s->wslot[k] * Hw + hw) * d->wrow;
                    const double *want = ref + (hw * n + p) * Lt;
                    double err = ref_max_err_f32(got, want, n);
                    if (d->extra) {
                        const double e2 =
                            ref_max_err_f32(got + d->cap, want + n, d->extra);
                        err = e2 > err ? e2 : err;
                    }
                    if (!(err <= wtol))
                        fail_msg("%s, %s: sequence %d position %lld head "
                                 "%lld: weights error %.3g > bound %.3g",
                                 cfg_name, v->name, b, (long long)p,
                                 (long long)hw, err, wtol);
                }
            }
            if (ref != w64) {
                free(ref);
                free(naive);
            }
        }
        free(w64);
        free(w32);
        free(r64);
        free(r32);
        free(allow);
        free(add);
        free(pad);
    }
}

typedef struct ccase {
    const char *name;
    int64_t E, H, Hkv;
    int bias_kv, zero_attn;
} ccase;

static const ccase CASES[] = {
    {"plain 4 heads", 32, 4, 0, 0, 0},
    {"GQA 4/2", 32, 4, 2, 0, 0},
    {"bias_kv + zero_attn, GQA 4/2", 32, 4, 2, 1, 1},
};

static mha_config config_of(const ccase *c)
{
    mha_config cfg = {0};
    cfg.embed_dim = c->E;
    cfg.num_heads = c->H;
    cfg.num_kv_heads = c->Hkv;
    cfg.add_bias_kv = c->bias_kv;
    cfg.add_zero_attn = c->zero_attn;
    return cfg;
}

/* Short sequences, many steps: prefill in chunks of 7, a rollback and a
 * reset (lengths 14, 3, 0), then 70 steps of 1 token (every tenth of 3):
 * final lengths 98, 87, 84, across the 64-key tiles. */
static void test_decode_equals_full_forward(void **state)
{
    (void)state;
    static const int64_t K[B] = {5, 1 << 30, 40};
    for (size_t c = 0; c < sizeof CASES / sizeof *CASES; c++) {
        const mha_config cfg = config_of(&CASES[c]);
        for (int vi = 0; vi < N_VARIANTS; vi++) {
            dec d;
            dec_init(&d, &cfg, &VARIANTS[vi], K, 128, 256, 0, vi % 2);
            dec_step(&d, 7, 1);
            dec_step(&d, 7, 1);
            dec_truncate(&d, 1, 3);
            dec_truncate(&d, 2, 0);
            for (int step = 0; step < 70; step++)
                dec_step(&d, step % 10 == 9 ? 3 : 1, 1);
            dec_check(&d, CASES[c].name);
            dec_free(&d);
        }
    }
}

/* Lk > 1024: the decoding steps split the keys in chunks (decode.c);
 * grouped-query heads are stacked when no explicit mask is given (key
 * lengths only), and not with one. */
static void test_long_decode(void **state)
{
    (void)state;
    static const int64_t K[B] = {900, 1 << 30, 3};
    static const int pick[] = {4, 6, 8};   /* lengths; bool + avg; all */
    const mha_config cfg = config_of(&CASES[1]);
    for (size_t k = 0; k < sizeof pick / sizeof *pick; k++) {
        dec d;
        dec_init(&d, &cfg, &VARIANTS[pick[k]], K, 1100, 16, 0, 1);
        dec_step(&d, 520, 0);
        dec_step(&d, 520, 0);
        dec_truncate(&d, 1, 600);
        dec_truncate(&d, 2, 0);
        static const int64_t steps[] = {1, 1, 3, 1, 1};
        for (size_t t = 0; t < sizeof steps / sizeof *steps; t++)
            dec_step(&d, steps[t], 1);
        dec_check(&d, "long, GQA 4/2");
        dec_free(&d);
    }
}

/* mha_attention on a cache: for each sequence, the same as mha_attention
 * on its own keys with the masks cut to its length. */
static void test_attention_on_cache(void **state)
{
    (void)state;
    enum { H = 4, HKV = 2, DH = 8, LQ = 2, CAP = 1400, E = H * DH,
           EKV = HKV * DH };
    static const int64_t lens[B] = {70, 1300, 5};
    const int64_t Lk = 1300;
    mha_kv_cache_config kc = {B, HKV, DH, CAP, MHA_KV_F32, 0, 0, 0, 0, 0, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    float *k = malloc((size_t)(CAP * EKV) * 4);
    float *v = malloc((size_t)(CAP * EKV) * 4);
    for (int b = 0; b < B; b++) {
        tu_fill(k, lens[b] * EKV, 51 + (uint64_t)b, -1, 1);
        tu_fill(v, lens[b] * EKV, 61 + (uint64_t)b, -1, 1);
        assert_int_equal(mha_kv_cache_append(kv, b, k, v, lens[b]), MHA_OK);
    }
    float q[B * LQ * E], out[B * LQ * E], one[LQ * E], lse[B * H * LQ];
    float lse1[H * LQ];
    tu_fill(q, B * LQ * E, 50, -1, 1);
    float *w = malloc((size_t)(B * H * LQ * Lk) * sizeof *w);
    float *w1 = malloc((size_t)(H * LQ * Lk) * sizeof *w1);
    uint8_t *allow = malloc((size_t)(LQ * Lk)), *pad = malloc((size_t)(B * Lk));
    float *add = malloc((size_t)(B * H * LQ * Lk) * sizeof *add);
    uint8_t *allow1 = malloc((size_t)(LQ * Lk)), *pad1 = malloc((size_t)Lk);
    float *add1 = malloc((size_t)(H * LQ * Lk) * sizeof *add1);
    for (int64_t i = 0; i < LQ; i++)
        for (int64_t j = 0; j < Lk; j++)
            allow[i * Lk + j] = allow_at(0, i, j);
    for (int64_t b = 0; b < B; b++) {
        for (int64_t j = 0; j < Lk; j++)
            pad[b * Lk + j] = padded_at(b, j);
        for (int64_t t = 0; t < H * LQ * Lk; t++) {
            const int64_t h = t / (LQ * Lk), i = t / Lk % LQ, j = t % Lk;
            add[b * H * LQ * Lk + t] = add_at(b, h, i, j);
        }
    }
    static const int64_t K[B] = {40, 1300, 2};
    /* 0: 2-D bool + average weights; 1: 4-D additive + padding + lengths +
     * per-head weights; 2: lengths only (stacked heads) + per-head
     * weights; 3: no mask, per-head weights. */
    for (int mode = 0; mode < 4; mode++) {
        mha_attention_args a = {0};
        a.batch = B;
        a.num_heads = H;
        a.num_kv_heads = HKV;
        a.head_dim = DH;
        a.q_len = LQ;
        a.kv_len = mode == 1 ? Lk : 0;
        a.q = q;
        a.cache = kv;
        a.out = out;
        a.lse = lse;
        a.attn_weights = w;
        a.need_weights = mode == 0 ? MHA_WEIGHTS_AVERAGE
                                      : MHA_WEIGHTS_PER_HEAD;
        if (mode == 0)
            a.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 2, {LQ, Lk}};
        if (mode == 1) {
            a.attn_mask =
                (mha_mask){MHA_MASK_ADDITIVE, add, 4, {B, H, LQ, Lk}};
            a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {B, Lk}};
        }
        if (mode == 1 || mode == 2)
            a.key_lengths = K;
        const int64_t Hw = mode == 0 ? 1 : H;
        for (int64_t t = 0; t < B * Hw * LQ * Lk; t++)
            w[t] = NAN;
        if (mha_attention(&a) != MHA_OK)
            fail_msg("mode %d: %s", mode, mha_last_error());
        for (int b = 0; b < B; b++) {
            const int64_t n = lens[b];
            tu_fill(k, n * EKV, 51 + (uint64_t)b, -1, 1);
            tu_fill(v, n * EKV, 61 + (uint64_t)b, -1, 1);
            mha_attention_args s = a;
            s.batch = 1;
            s.kv_len = n;
            s.k = k;
            s.v = v;
            s.q = q + b * LQ * E;
            s.cache = NULL;
            s.causal = MHA_CAUSAL_BOTTOM_RIGHT;
            s.out = one;
            s.lse = lse1;
            s.attn_weights = w1;
            int64_t kl = K[b] < n ? K[b] : n;
            if (s.key_lengths)
                s.key_lengths = &kl;
            if (mode == 0) {
                for (int64_t i = 0; i < LQ; i++)
                    memcpy(allow1 + i * n, allow + i * Lk, (size_t)n);
                s.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow1, 2, {LQ, n}};
            }
            if (mode == 1) {
                for (int64_t r = 0; r < H * LQ; r++)
                    memcpy(add1 + r * n, add + (b * H * LQ + r) * Lk,
                           (size_t)n * sizeof *add1);
                s.attn_mask =
                    (mha_mask){MHA_MASK_ADDITIVE, add1, 4, {1, H, LQ, n}};
                memcpy(pad1, pad + b * Lk, (size_t)n);
                s.key_padding_mask =
                    (mha_mask){MHA_MASK_BLOCK, pad1, 2, {1, n}};
            }
            if (mha_attention(&s) != MHA_OK)
                fail_msg("mode %d sequence %d alone: %s", mode, b,
                         mha_last_error());
            /* The same kernels on the same tiles: the same bits. */
            if (memcmp(one, out + b * LQ * E, sizeof one) != 0)
                fail_msg("mode %d sequence %d: output differs from "
                         "mha_attention on its own keys", mode, b);
            for (int64_t h = 0; h < H; h++)
                for (int64_t i = 0; i < LQ; i++)
                    if (memcmp(&lse1[h * LQ + i], &lse[(b * H + h) * LQ + i],
                               sizeof *lse) != 0)
                        fail_msg("mode %d sequence %d: lse differs",
                                 mode, b);
            for (int64_t hw = 0; hw < Hw; hw++)
                for (int64_t i = 0; i < LQ; i++) {
                    const float *got = w + ((b * Hw + hw) * LQ + i) * Lk;
                    const float *want = w1 + (hw * LQ + i) * n;
                    if (memcmp(got, want, (size_t)n * sizeof *got) != 0)
                        fail_msg("mode %d sequence %d: weights of row "
                                 "%lld differ", mode, b, (long long)i);
                    for (int64_t j = n; j < Lk; j++)
                        if (got[j] != 0.0f)
                            fail_msg("mode %d sequence %d: weight at key "
                                     "%lld past its length is %g", mode,
                                     b, (long long)j, (double)got[j]);
                }
        }
    }
    free(k);
    free(v);
    free(w);
    free(w1);
    free(allow);
    free(pad);
    free(add);
    free(allow1);
    free(pad1);
    free(add1);
    mha_kv_cache_free(kv);
}

/* 1, 2 and 4 threads: the same bits, outputs and weights, on a shape
 * where the threads run (B H Lq Lt d_h >= 2^20: split decoding); the
 * cache filled by the caller, then planned single-token steps and a
 * chunk of 3, and mha_attention on the same cache. */
typedef struct run_bits {
    float *outs, *ws, *att;   /* outputs, weights, mha_attention's */
    size_t n_outs, n_ws, n_att;
} run_bits;

static void threaded_run(const variant *v, int threads, run_bits *r)
{
    static const int64_t K[B] = {1000, 1 << 30, 7};
    static const int64_t lens[B] = {1100, 700, 1050};
    mha_config cfg = {0};
    cfg.embed_dim = 512;
    cfg.num_heads = 8;
    cfg.num_kv_heads = 2;
    dec d;
    dec_init(&d, &cfg, v, K, 1200, 16, threads, 1);
    enum { EKV = 2 * 64 };
    float *kv = malloc((size_t)(1100 * EKV) * 2 * sizeof *kv);
    for (int b = 0; b < B; b++) {
        tu_fill(kv, lens[b] * EKV * 2, 200 + (uint64_t)b, -1, 1);
        assert_int_equal(mha_kv_cache_append(d.kv, b, kv, kv + lens[b] * EKV,
                                             lens[b]), MHA_OK);
        d.s[b].len = lens[b];
    }
    free(kv);
    static const int64_t steps[] = {1, 1, 3, 1};
    for (size_t t = 0; t < sizeof steps / sizeof *steps; t++)
        dec_step(&d, steps[t], 1);
    /* 6 outputs per sequence, each with weights if the variant has them. */
    const size_t no = (size_t)(6 * d.E);
    const size_t nw = v->weights ? (size_t)(6 * d.Hw * d.wrow) : 0;
    r->n_outs = B * no;
    r->n_ws = B * nw;
    r->outs = malloc(r->n_outs * sizeof(float));
    r->ws = malloc(r->n_ws * sizeof(float) + 1);
    for (int b = 0; b < B; b++) {
        assert_int_equal(d.s[b].n_out, 6);
        memcpy(r->outs + b * no, d.s[b].out, no * sizeof(float));
        memcpy(r->ws + b * nw, d.s[b].w, nw * sizeof(float));
    }
    /* mha_attention on this cache, with the variant's masks. */
    int64_t Lk = 0, lb[B];
    for (int b = 0; b < B; b++) {
        lb[b] = d.s[b].len - 2;   /* 2 queries: the last 2 positions */
        Lk = d.s[b].len > Lk ? d.s[b].len : Lk;
    }
    mha_forward_args fa = {0};
    step_masks sm;
    make_step_masks(&d, lb, 2, Lk, &sm, &fa);
    enum { E = 512 };
    float *q = malloc((size_t)(B * 2 * E) * sizeof *q);
    tu_fill(q, B * 2 * E, 300, -1, 1);
    const int64_t Hw = d.Hw;
    r->n_att = (size_t)(B * 2 * E + (v->weights ? B * Hw * 2 * Lk : 0));
    r->att = malloc(r->n_att * sizeof(float));
    float *att = r->att;
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = 8;
    a.num_kv_heads = 2;
    a.head_dim = 64;
    a.q_len = 2;
    a.q = q;
    a.cache = d.kv;
    a.attn_mask = fa.attn_mask;
    a.key_padding_mask = fa.key_padding_mask;
    a.key_lengths = fa.key_lengths;
    a.need_weights = v->weights;
    a.attn_weights = v->weights ? att + B * 2 * E : NULL;
    a.num_threads = threads;
    a.out = att;
    if (mha_attention(&a) != MHA_OK)
        fail_msg("%s: mha_attention on the cache: %s", v->name,
                 mha_last_error());
    free_step_masks(&sm);
    free(q);
    dec_free(&d);
}

static void test_threads_bitwise(void **state)
{
    (void)state;
    static const int pick[] = {8, 6, 4};   /* all; bool + avg; lengths */
    for (size_t k = 0; k < sizeof pick / sizeof *pick; k++) {
        const variant *v = &VARIANTS[pick[k]];
        run_bits one;
        threaded_run(v, 1, &one);
        for (int threads = 2; threads <= 4; threads += 2) {
            run_bits r;
            threaded_run(v, threads, &r);
            if (memcmp(one.outs, r.outs, r.n_outs * sizeof(float)) != 0)
                fail_msg("%s: outputs differ at %d threads", v->name,
                         threads);
            if (memcmp(one.ws, r.ws, r.n_ws * sizeof(float)) != 0)
                fail_msg("%s: weights differ at %d threads", v->name,
                         threads);
            if (memcmp(one.att, r.att, r.n_att * sizeof(float)) != 0)
                fail_msg("%s: mha_attention differs at %d threads", v->name,
                         threads);
            free(r.outs);
            free(r.ws);
            free(r.att);
        }
        free(one.outs);
        free(one.ws);
        free(one.att);
    }
}

static void assert_lengths(const mha_kv_cache *kv, const int64_t *want)
{
    for (int b = 0; b < B; b++)
        assert_int_equal(mha_kv_cache_length(kv, b), want[b]);
}

/* What a forward with a cache refuses, and that the cache's lengths stay
 * as they were. */
static void test_misuse(void **state)
{
    (void)state;
    enum { E = 16, H = 4, CAP = 20 };
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.num_kv_heads = 2;
    mha_module *m = tu_module(&cfg, 7);
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_for_module(m, B, CAP, &kv), MHA_OK);
    float x[B * 4 * E], y[B * 4 * E], w[B * H * 4 * CAP];
    tu_fill(x, B * 4 * E, 8, -1, 1);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = 4;
    a.query = x;
    a.cache = kv;
    a.out = y;
    assert_int_equal(mha_forward(m, &a), MHA_OK);          /* 4, 4, 4 */
    assert_int_equal(mha_kv_cache_truncate(kv, 1, 1), MHA_OK);
    assert_int_equal(mha_kv_cache_truncate(kv, 2, 0), MHA_OK);
    const int64_t lens[B] = {4, 1, 0};

    /* A step of 1: Lk = 5. */
    uint8_t allow[B * 6] = {0};
    float add[B * H * 6] = {0};
    mha_forward_args s = a;
    s.q_len = 1;
    s.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 3, {B, 1, 4}};
    assert_fails(mha_forward(m, &s), MHA_ERR_SHAPE, "Lk = 5");
    assert_lengths(kv, lens);
    s.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 2, {1, 6}};
    assert_fails(mha_forward(m, &s), MHA_ERR_SHAPE, "attn_mask");
    assert_lengths(kv, lens);
    s.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 4, {B, H, 1, 5}};
    add[7] = NAN;
    assert_fails(mha_forward(m, &s), MHA_ERR_NON_FINITE, "attn_mask");
    assert_lengths(kv, lens);
    add[7] = 0.0f;
    s.attn_mask = (mha_mask){0};
    s.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, allow, 2, {B, 4}};
    assert_fails(mha_forward(m, &s), MHA_ERR_SHAPE, "key_padding_mask");
    assert_lengths(kv, lens);
    s.key_padding_mask = (mha_mask){0};
    const int64_t kl_bad[B] = {5, 6, 0};
    s.key_lengths = kl_bad;
    assert_fails(mha_forward(m, &s), MHA_ERR_INVALID_ARGUMENT,
                 "key_lengths[1] = 6");
    assert_msg_has("Lk = 5");
    assert_lengths(kv, lens);
    s.key_lengths = NULL;
    s.kv_len = 4;
    assert_fails(mha_forward(m, &s), MHA_ERR_SHAPE, "kv_len 4");
    assert_msg_has("Lk = 5");
    assert_lengths(kv, lens);
    s.kv_len = CAP + 1;
    assert_fails(mha_forward(m, &s), MHA_ERR_SHAPE, "capacity");
    assert_lengths(kv, lens);
    s.kv_len = 0;
    s.causal = MHA_CAUSAL_TOP_LEFT;
    assert_fails(mha_forward(m, &s), MHA_ERR_INVALID_ARGUMENT, "TOP_LEFT");
    assert_lengths(kv, lens);
    s.causal = MHA_CAUSAL_NONE;
    s.need_weights = MHA_WEIGHTS_AVERAGE;
    assert_fails(mha_forward(m, &s), MHA_ERR_NULL_POINTER, "attn_weights");
    assert_lengths(kv, lens);
    s.need_weights = MHA_WEIGHTS_NONE;
    s.training = 1;
    assert_fails(mha_forward(m, &s), MHA_ERR_INVALID_ARGUMENT, "training");
    assert_lengths(kv, lens);
    s.training = 0;

    /* A plan: the masks and weights of a run follow the cache's lengths,
     * so a mask that fitted the last step is refused at the next. */
    mha_plan *p = NULL;
    s.kv_len = 5;   /* a plan's kv_len is not kept: each run says its own */
    s.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 3, {B, 1, 5}};
    s.need_weights = MHA_WEIGHTS_PER_HEAD;
    s.attn_weights = w;
    assert_int_equal(mha_plan_create(m, &s, &p), MHA_OK);
    assert_int_equal(mha_plan_forward(p, &s), MHA_OK);      /* 5, 2, 1 */
    const int64_t after[B] = {5, 2, 1};
    assert_lengths(kv, after);
    assert_fails(mha_plan_forward(p, &s), MHA_ERR_SHAPE, "kv_len 5");
    assert_lengths(kv, after);
    s.kv_len = 0;
    assert_fails(mha_plan_forward(p, &s), MHA_ERR_SHAPE, "Lk = 6");
    assert_lengths(kv, after);
    s.attn_mask.shape[2] = 6;
    assert_int_equal(mha_plan_forward(p, &s), MHA_OK);      /* 6, 3, 2 */
    mha_plan_free(p);

    /* mha_attention on the cache (lengths 6, 3, 2: Lk = 6). */
    float q[B * 2 * 8 * 4], out[B * 2 * 8 * 4];
    tu_fill(q, B * 2 * 32, 9, -1, 1);
    mha_attention_args t = {0};
    t.batch = B;
    t.num_heads = H;
    t.num_kv_heads = 2;
    t.head_dim = 4;
    t.q_len = 2;
    t.q = q;
    t.cache = kv;
    t.out = out;
    t.kv_len = 5;
    assert_fails(mha_attention(&t), MHA_ERR_SHAPE, "kv_len 5");
    t.kv_len = CAP + 1;
    assert_fails(mha_attention(&t), MHA_ERR_SHAPE, "capacity");
    t.kv_len = 6;
    t.attn_mask = (mha_mask){MHA_MASK_ALLOW, allow, 2, {2, 5}};
    assert_fails(mha_attention(&t), MHA_ERR_SHAPE, "Lk = 6");
    t.attn_mask = (mha_mask){0};
    t.need_weights = MHA_WEIGHTS_PER_HEAD;
    assert_fails(mha_attention(&t), MHA_ERR_NULL_POINTER, "attn_weights");
    t.attn_weights = q;
    assert_fails(mha_attention(&t), MHA_ERR_INVALID_ARGUMENT, "overlaps");
    t.attn_weights = w;
    t.causal = MHA_CAUSAL_TOP_LEFT;
    assert_fails(mha_attention(&t), MHA_ERR_INVALID_ARGUMENT, "TOP_LEFT");
    t.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_int_equal(mha_attention(&t), MHA_OK);
    const int64_t last[B] = {6, 3, 2};
    assert_lengths(kv, last);
    mha_kv_cache_free(kv);
    mha_free(m);
}

int main(void)
{
    if (tu_backend_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_decode_equals_full_forward),
        cmocka_unit_test(test_long_decode),
        cmocka_unit_test(test_attention_on_cache),
        cmocka_unit_test(test_threads_bitwise),
        cmocka_unit_test(test_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
