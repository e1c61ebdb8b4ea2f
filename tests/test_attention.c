/*
 * test_attention.c -- mha_attention (heads already projected) against the
 * float64 reference: a module whose projections are identities computes
 * exactly attention(q, k, v), so the reference of that module is the
 * reference of mha_attention.  Every tier runs it (CTest, MHA_ISA).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ref.h"
#include "testutil.h"

/* A module with W_q = W_k = W_v = W_o = I and no bias (and dropout p and
 * the scale, which live in the config; scale 0 is 1/sqrt(d_h) in both). */
static mha_module *identity_module(int64_t E, int64_t H, float dropout,
                                   float scale)
{
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.no_bias = 1;
    cfg.dropout = dropout;
    cfg.scale = scale;
    mha_module *m = NULL;
    assert_int_equal(mha_create(&cfg, &m), MHA_OK);
    float *w = calloc((size_t)(3 * E * E), sizeof *w);
    for (int64_t p = 0; p < 3; p++)
        for (int64_t k = 0; k < E; k++)
            w[(p * E + k) * E + k] = 1.0f;
    assert_int_equal(mha_param_set(m, "in_proj_weight", w, 3 * E * E), MHA_OK);
    assert_int_equal(mha_param_set(m, "out_proj.weight", w, E * E), MHA_OK);
    free(w);
    return m;
}

typedef struct acase {
    const char *name;
    int64_t B, H, dh, Lq, Lk;
    mha_causal causal;
    int pad, lengths, additive;
    mha_weights_mode weights;
    float dropout;
    float scale;        /* 0: the default, 1/sqrt(d_h) */
} acase;

static const acase CASES[] = {
    {"self", 2, 3, 8, 17, 0, 0, 0, 0, 0, MHA_WEIGHTS_PER_HEAD, 0, 0},
    {"cross, causal", 2, 2, 16, 9, 150, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, MHA_WEIGHTS_AVERAGE, 0, 0},
    {"padding + lengths", 3, 2, 5, 70, 90, 0, 1, 1, 0, MHA_WEIGHTS_PER_HEAD, 0, 0},
    {"additive, top-left", 1, 4, 64, 130, 70, MHA_CAUSAL_TOP_LEFT, 0, 0, 1, MHA_WEIGHTS_NONE, 0, 0},
    {"dropout", 2, 2, 8, 20, 0, 0, 0, 0, 0, MHA_WEIGHTS_PER_HEAD, 0.25f, 0},
    {"head dim 1, one query", 2, 3, 1, 1, 33, 0, 1, 0, 0, MHA_WEIGHTS_AVERAGE, 0, 0},
    /* scales other than the default 1/sqrt(d_h) (0.25 and 0.35 here) */
    {"custom scale", 2, 2, 16, 33, 50, 0, 1, 0, 0, MHA_WEIGHTS_PER_HEAD, 0, 0.7f},
    {"custom scale, split keys", 1, 2, 8, 3, 1100, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 1, MHA_WEIGHTS_AVERAGE, 0.1f, -1.3f},
};

static void check(const char *name, const char *what, const float *got,
                  const double *ref64, const float *ref32, int64_t n)
{
    double err = ref_max_err_f32(got, ref64, n);
    double tol = ref_tolerance(ref_max_err_f32(ref32, ref64, n),
                               ref_max_abs(ref64, n));
    if (!(err <= tol))
        fail_msg("%s: %s error %.3g > bound %.3g", name, what, err, tol);
}

static void test_against_reference(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const acase *c = &CASES[t];
        const int64_t E = c->H * c->dh, Lk = c->Lk ? c->Lk : c->Lq;
        const int64_t nq = c->B * c->Lq * E, nk = c->B * Lk * E;
        const int64_t nwh = c->B * c->H * c->Lq * Lk;
        float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
        float *v = malloc((size_t)nk * 4), *out = malloc((size_t)nq * 4);
        float *w = malloc((size_t)nwh * 4), *o32 = malloc((size_t)nq * 4);
        float *w32 = malloc((size_t)nwh * 4);
        double *o64 = malloc((size_t)nq * 8), *w64 = malloc((size_t)nwh * 8);
        double *wa64 = malloc((size_t)nwh * 8), *wa32d = malloc((size_t)nwh * 8);
        uint8_t *pad = malloc((size_t)(c->B * Lk));
        float *add = malloc((size_t)(c->Lq * Lk) * 4);
        int64_t lens[4];
        tu_fill(q, nq, t + 1, -2, 2);
        tu_fill(k, nk, t + 2, -2, 2);
        tu_fill(v, nk, t + 3, -2, 2);
        tu_fill(add, c->Lq * Lk, t + 4, -3, 3);
        for (int64_t j = 0; j < c->Lq * Lk; j += 7)
            add[j] = -INFINITY;
        for (int64_t b = 0; b < c->B; b++) {
            lens[b] = Lk - 5 * b;
            for (int64_t j = 0; j < Lk; j++)
                pad[b * Lk + j] = (j + b) % 4 == 1;   /* block kind */
        }

        mha_attention_args a = {0};
        a.batch = c->B;
        a.num_heads = c->H;
        a.head_dim = c->dh;
        a.q_len = c->Lq;
        a.kv_len = c->Lk;
        a.q = q;
        a.k = c->Lk ? k : q;
        a.v = c->Lk ? v : q;
        a.causal = c->causal;
        if (c->pad)
            a.key_padding_mask = (mha_mask){MHA_MASK_BLOCK, pad, 2, {c->B, Lk}};
        if (c->additive)
            a.attn_mask = (mha_mask){MHA_MASK_ADDITIVE, add, 2, {c->Lq, Lk}};
        a.key_lengths = c->lengths ? lens : NULL;
        a.need_weights = c->weights;
        a.attn_weights = c->weights ? w : NULL;
        a.dropout = c->dropout;
        a.training = c->dropout > 0;
        a.dropout_seed = 9;
        a.scale = c->scale;
        a.out = out;
        if (mha_attention(&a) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());

        /* The same problem as a module forward with identity weights. */
        mha_module *m = identity_module(E, c->H, c->dropout, c->scale);
        mha_forward_args f = {0};
        f.batch = c->B;
        f.q_len = c->Lq;
        f.kv_len = c->Lk;
        f.query = q;
        f.key = c->Lk ? k : NULL;
        f.value = c->Lk ? v : NULL;
        f.attn_mask = a.attn_mask;
        f.key_padding_mask = a.key_padding_mask;
        f.key_lengths = a.key_lengths;
        f.causal = c->causal;
        f.training = a.training;
        f.dropout_seed = 9;
        ref_forward_f64(m, &f, o64, w64);
        ref_forward_f32(m, &f, o32, w32);
        check(c->name, "output", out, o64, o32, nq);
        if (c->weights == MHA_WEIGHTS_PER_HEAD) {
            check(c->name, "weights", w, w64, w32, nwh);
        } else if (c->weights == MHA_WEIGHTS_AVERAGE) {
            for (int64_t x = 0; x < nwh; x++)
                wa32d[x] = w32[x];
            ref_average_heads(w64, c->B, c->H, c->Lq, Lk, wa64);
            double *wa32 = malloc((size_t)nwh * 8);
            ref_average_heads(wa32d, c->B, c->H, c->Lq, Lk, wa32);
            const int64_t na = c->B * c->Lq * Lk;
            for (int64_t x = 0; x < na; x++)
                w32[x] = (float)wa32[x];
            check(c->name, "averaged weights", w, wa64, w32, na);
            free(wa32);
        }
        mha_free(m);
        free(q); free(k); free(v); free(out); free(w); free(o32); free(w32);
        free(o64); free(w64); free(wa64); free(wa32d); free(pad); free(add);
    }
}

/* Self-attention of 2 sequences of 3 tokens, 2 heads of 4, on x (48
 * floats), into out: the small valid call the refusals start from. */
static mha_attention_args small_args(const float *x, float *out)
{
    mha_attention_args a = {0};
    a.batch = 2;
    a.num_heads = 2;
    a.head_dim = 4;
    a.q_len = 3;
    a.q = a.k = a.v = x;
    a.out = out;
    return a;
}

/* (B, L, heads*dh) -> (B, heads, L, dh), and back when `back`. */
static void to_heads_first(const float *x, float *y, int64_t B, int64_t L,
                           int64_t nh, int64_t dh, int back)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < L; i++)
            for (int64_t h = 0; h < nh; h++) {
                const int64_t rows = ((b * L + i) * nh + h) * dh;
                const int64_t heads = ((b * nh + h) * L + i) * dh;
                memcpy(back ? y + rows : y + heads, back ? x + heads : x + rows,
                       (size_t)dh * sizeof *x);
            }
}

/* MHA_LAYOUT_HEADS_FIRST: q, k, v and out as (B, heads, L, d_h) give the
 * bits of the rows layout (the same arithmetic, other addresses), with
 * every option that composes with it: masks, key lengths, causal kinds,
 * weights, lse, dropout, GQA (decoding's stacked path too), the
 * modifiers and sinks, 1 and 2 threads; the backward's gradients too;
 * and what it does not take is refused before anything is written. */
static void test_heads_first(void **state)
{
    (void)state;
    typedef struct {
        int64_t B, H, Hkv, dh, Lq, Lk;
        mha_causal causal;
        int masks;
        mha_weights_mode weights;
        float dropout, softcap;
        int alibi, window, sinks, threads;
    } hcase;
    static const hcase HC[] = {
        {2, 3, 3, 8, 17, 17, 0, 1, MHA_WEIGHTS_PER_HEAD, 0, 0, 0, 0, 0, 1},
        {2, 4, 2, 16, 9, 150, MHA_CAUSAL_BOTTOM_RIGHT, 0, MHA_WEIGHTS_AVERAGE, 0, 0, 1, 0, 1, 2},
        {1, 4, 1, 64, 130, 70, MHA_CAUSAL_TOP_LEFT, 1, MHA_WEIGHTS_NONE, 0.2f, 0, 0, 0, 0, 2},
        {3, 2, 2, 5, 70, 90, 0, 1, MHA_WEIGHTS_PER_HEAD, 0, 30.0f, 0, 1, 0, 1},
        {2, 8, 2, 32, 1, 700, 0, 0, MHA_WEIGHTS_NONE, 0, 0, 0, 0, 1, 2},  /* decode, GQA */
        {1, 2, 2, 8, 3, 1100, MHA_CAUSAL_BOTTOM_RIGHT, 1, MHA_WEIGHTS_AVERAGE, 0, 0, 1, 0, 0, 2},
    };
    for (size_t t = 0; t < sizeof HC / sizeof *HC; t++) {
        const hcase *c = &HC[t];
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh;
        const int64_t nq = c->B * c->Lq * E, nk = c->B * c->Lk * Ekv;
        const int64_t nw = c->B * c->H * c->Lq * c->Lk, nl = c->B * c->H * c->Lq;
        float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
        float *v = malloc((size_t)nk * 4), *qh = malloc((size_t)nq * 4);
        float *kh = malloc((size_t)nk * 4), *vh = malloc((size_t)nk * 4);
        float *out = malloc((size_t)nq * 4), *outh = malloc((size_t)nq * 4);
        float *back = malloc((size_t)nq * 4);
        float *w = calloc((size_t)nw, 4), *wh = calloc((size_t)nw, 4);
        float *lse = malloc((size_t)nl * 4), *lseh = malloc((size_t)nl * 4);
        uint8_t *pad = malloc((size_t)(c->B * c->Lk));
        float *add = malloc((size_t)(c->Lq * c->Lk) * 4);
        float sinks[8];
        int64_t lens[3];
        tu_fill(q, nq, 40 + t, -2, 2);
        tu_fill(k, nk, 50 + t, -2, 2);
        tu_fill(v, nk, 60 + t, -2, 2);
        tu_fill(add, c->Lq * c->Lk, 70 + t, -3, 3);
        tu_fill(sinks, 8, 80 + t, -1, 1);
        for (int64_t b = 0; b < c->B; b++) {
            lens[b] = c->Lk - 3 * b;
            for (int64_t j = 0; j < c->Lk; j++)
                pad[b * c->Lk + j] = (j + b) % 5 == 2;
        }
        to_heads_first(q, qh, c->B, c->Lq, c->H, c->dh, 0);
        to_heads_first(k, kh, c->B, c->Lk, c->Hkv, c->dh, 0);
        to_heads_first(v, vh, c->B, c->Lk, c->Hkv, c->dh, 0);
        mha_attention_args a = {0};
        a.batch = c->B;
        a.num_heads = c->H;
        a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh;
        a.q_len = c->Lq;
        a.kv_len = c->Lk;
        a.causal = c->causal;
        if (c->masks) {
            a.key_padding_mask =
                (mha_mask){MHA_MASK_BLOCK, pad, 2, {c->B, c->Lk}};
            a.attn_mask =
                (mha_mask){MHA_MASK_ADDITIVE, add, 2, {c->Lq, c->Lk}};
            a.key_lengths = lens;
        }
        a.need_weights = c->weights;
        a.dropout = c->dropout;
        a.training = c->dropout > 0;
        a.dropout_seed = 5;
        a.mods.softcap = c->softcap;
        a.mods.alibi = c->alibi;
        if (c->window) {
            a.mods.window = 1;
            a.mods.window_left = 20;
            a.mods.window_right = 3;
        }
        a.sinks = c->sinks ? sinks : NULL;
        a.num_threads = c->threads;
        mha_attention_args r = a;
        r.q = q; r.k = k; r.v = v; r.out = out; r.lse = lse;
        r.attn_weights = c->weights ? w : NULL;
        if (mha_attention(&r) != MHA_OK)
            fail_msg("case %zu, rows: %s", t, mha_last_error());
        mha_attention_args h = a;
        h.layout = MHA_LAYOUT_HEADS_FIRST;
        h.q = qh; h.k = kh; h.v = vh; h.out = outh;
        h.attn_weights = c->weights ? wh : NULL;
        h.lse = lseh;
        if (mha_attention(&h) != MHA_OK)
            fail_msg("case %zu, heads first: %s", t, mha_last_error());
        to_heads_first(outh, back, c->B, c->Lq, c->H, c->dh, 1);
        if (memcmp(back, out, (size_t)nq * 4))
            fail_msg("case %zu: heads-first output differs", t);
        if (memcmp(w, wh, (size_t)nw * 4) || memcmp(lse, lseh, (size_t)nl * 4))
            fail_msg("case %zu: heads-first weights or lse differ", t);
        /* the backward in both layouts: the same gradients, bit for bit
         * (dL/d out: a random tensor, in each layout) */
        if (!c->weights || c->dropout == 0.0f) {
            float *go = malloc((size_t)nq * 4), *goh = malloc((size_t)nq * 4);
            float *gr[3], *gh[3], *gb = malloc((size_t)(nq > nk ? nq : nk) * 4);
            const int64_t gn[3] = {nq, nk, nk};
            for (int i = 0; i < 3; i++) {
                gr[i] = malloc((size_t)gn[i] * 4);
                gh[i] = malloc((size_t)gn[i] * 4);
            }
            tu_fill(go, nq, 100 + t, -1, 1);
            to_heads_first(go, goh, c->B, c->Lq, c->H, c->dh, 0);
            r.need_weights = h.need_weights = MHA_WEIGHTS_NONE;
            r.attn_weights = h.attn_weights = NULL;
            r.lse = h.lse = NULL;
            const mha_attention_grads g = {go, gr[0], gr[1], gr[2], NULL};
            const mha_attention_grads gg = {goh, gh[0], gh[1], gh[2], NULL};
            if (mha_attention_backward(&r, &g) != MHA_OK ||
                mha_attention_backward(&h, &gg) != MHA_OK)
                fail_msg("case %zu backward: %s", t, mha_last_error());
            for (int i = 0; i < 3; i++) {
                to_heads_first(gh[i], gb, c->B, i ? c->Lk : c->Lq,
                               i ? c->Hkv : c->H, c->dh, 1);
                if (memcmp(gb, gr[i], (size_t)gn[i] * 4))
                    fail_msg("case %zu: heads-first gradient %d differs", t,
                             i);
                free(gr[i]);
                free(gh[i]);
            }
            free(go); free(goh); free(gb);
        }
        free(q); free(k); free(v); free(qh); free(kh); free(vh); free(out);
        free(outh); free(back); free(w); free(wh); free(lse); free(lseh);
        free(pad); free(add);
    }
    /* refused: another layout value, RoPE, a KV cache */
    float x[2 * 3 * 8], out[2 * 3 * 8];
    tu_fill(x, 48, 1, -1, 1);
    memset(out, 0, sizeof out);
    mha_attention_args a = small_args(x, out);
    a.layout = (mha_layout)2;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "layout"));
    a.layout = MHA_LAYOUT_HEADS_FIRST;
    a.mods.rope.style = MHA_ROPE_NEOX;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "RoPE"));
    a.mods.rope = (mha_rope){MHA_ROPE_NONE, 0, 0.0f, 0.0f};
    mha_kv_cache_config cc = {0};
    cc.batch = 2;
    cc.num_kv_heads = 2;
    cc.head_dim = 4;
    cc.capacity = 8;
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&cc, &kv), MHA_OK);
    a.k = a.v = NULL;
    a.cache = kv;
    assert_int_equal(mha_attention(&a), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "KV cache"));
    mha_kv_cache_free(kv);
    for (size_t i = 0; i < sizeof out / sizeof *out; i++)
        assert_true(out[i] == 0.0f);
}

/* The arguments of attention on heads with no mask, output or
 * gradients yet (the masked tests below set them). */
static mha_attention_args heads_args(int64_t B, int64_t H, int64_t Hkv,
                                     int64_t dh, int64_t Lq, int64_t Lk,
                                     const float *q, const float *k,
                                     const float *v, mha_causal causal,
                                     int threads)
{
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.num_kv_heads = Hkv;
    a.head_dim = dh;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.q = q; a.k = k; a.v = v;
    a.causal = causal;
    a.num_threads = threads;
    return a;
}

/* mha_attention then mha_attention_backward of a (its masks set) into
 * buf, allocated here (n[i] floats each, zeroed): out, lse, the weights
 * per head, dq, dk, dv for dL/d out = go. */
static void masked_pass(mha_attention_args a, const float *go,
                        const int64_t n[6], float *buf[6], size_t t,
                        int pass)
{
    for (int i = 0; i < 6; i++)
        buf[i] = calloc((size_t)n[i], 4);
    a.out = buf[0];
    a.lse = buf[1];
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = buf[2];
    if (mha_attention(&a) != MHA_OK)
        fail_msg("case %zu pass %d: %s", t, pass, mha_last_error());
    a.need_weights = MHA_WEIGHTS_NONE;
    a.attn_weights = NULL;
    a.lse = NULL;
    const mha_attention_grads g = {go, buf[3], buf[4], buf[5], NULL};
    if (mha_attention_backward(&a, &g) != MHA_OK)
        fail_msg("case %zu pass %d backward: %s", t, pass, mha_last_error());
}

/* Two masked_pass results the same bits, each of the six; then freed. */
static void same_bits(float *x[6], float *y[6], const int64_t n[6],
                      size_t t, const char *a, const char *b)
{
    static const char *what[6] = {"out", "lse", "weights", "dq", "dk", "dv"};
    for (int i = 0; i < 6; i++)
        if (memcmp(x[i], y[i], (size_t)n[i] * 4))
            fail_msg("case %zu: %s differs between %s and %s", t, what[i],
                     a, b);
}

/* A key padding mask (one bias row per batch and tile, MHA_TILE_KEYS)
 * gives the bits of the same mask written out as an attn_mask (B, Lq, Lk)
 * (a bias row per query, MHA_TILE_EXPLICIT): forward, lse, weights and
 * the backward's three gradients, each mask kind, causal or not, GQA,
 * padding that covers whole tiles, 1 and 2 threads. */
static void test_key_mask_as_attn_mask(void **state)
{
    (void)state;
    typedef struct {
        int64_t B, H, Hkv, dh, Lq, Lk;
        mha_causal causal;
        mha_mask_kind kind;
        int threads;
    } kcase;
    static const kcase KC[] = {
        {2, 4, 2, 16, 40, 300, 0, MHA_MASK_ALLOW, 2},
        {3, 2, 2, 8, 130, 130, MHA_CAUSAL_TOP_LEFT, MHA_MASK_BLOCK, 1},
        {2, 3, 1, 32, 7, 200, MHA_CAUSAL_BOTTOM_RIGHT, MHA_MASK_ADDITIVE, 2},
    };
    for (size_t t = 0; t < sizeof KC / sizeof *KC; t++) {
        const kcase *c = &KC[t];
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh;
        const int64_t nq = c->B * c->Lq * E, nk = c->B * c->Lk * Ekv;
        const int64_t nw = c->B * c->H * c->Lq * c->Lk;
        const int64_t nl = c->B * c->H * c->Lq, nm = c->B * c->Lq * c->Lk;
        const int add = c->kind == MHA_MASK_ADDITIVE;
        float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
        float *v = malloc((size_t)nk * 4), *go = malloc((size_t)nq * 4);
        float *buf[2][6];
        uint8_t *pad8 = malloc((size_t)(c->B * c->Lk)), *full8 = malloc((size_t)nm);
        float *padf = malloc((size_t)(c->B * c->Lk) * 4), *fullf = malloc((size_t)nm * 4);
        tu_fill(q, nq, 90 + t, -2, 2);
        tu_fill(k, nk, 91 + t, -2, 2);
        tu_fill(v, nk, 92 + t, -2, 2);
        tu_fill(go, nq, 93 + t, -1, 1);
        tu_fill(padf, c->B * c->Lk, 94 + t, -2, 2);
        /* batch b pads keys 64..191 (two whole tiles) and every 7th key,
         * and in its last batch every key but the first */
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t j = 0; j < c->Lk; j++) {
                const int64_t at = b * c->Lk + j;
                const int off = (j >= 64 && j < 192) || j % 7 == 3 ||
                                (b == c->B - 1 && j > 0);
                pad8[at] = (uint8_t)(c->kind == MHA_MASK_BLOCK ? off : !off);
                if (off)
                    padf[at] = -INFINITY;
            }
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t i = 0; i < c->Lq; i++) {
                const int64_t row = (b * c->Lq + i) * c->Lk;
                memcpy(full8 + row, pad8 + b * c->Lk, (size_t)c->Lk);
                memcpy(fullf + row, padf + b * c->Lk, (size_t)c->Lk * 4);
            }
        const int64_t n[6] = {nq, nl, nw, nq, nk, nk};
        for (int pass = 0; pass < 2; pass++) {
            mha_attention_args a = heads_args(c->B, c->H, c->Hkv, c->dh,
                                              c->Lq, c->Lk, q, k, v,
                                              c->causal, c->threads);
            if (pass == 0)
                a.key_padding_mask = (mha_mask){c->kind,
                    add ? (const void *)padf : pad8, 2, {c->B, c->Lk}};
            else
                a.attn_mask = (mha_mask){c->kind,
                    add ? (const void *)fullf : full8, 3,
                    {c->B, c->Lq, c->Lk}};
            masked_pass(a, go, n, buf[pass], t, pass);
        }
        same_bits(buf[0], buf[1], n, t, "the key padding mask",
                  "the same attn_mask");
        /* the mask mattered: batch 0's last row weighs its padded key 3
         * zero and key 2 not */
        const float *wl = buf[0][2] + (c->Lq - 1) * c->Lk;
        assert_true(wl[3] == 0.0f && wl[2] > 0.0f);
        for (int p = 0; p < 2; p++)
            for (int i = 0; i < 6; i++)
                free(buf[p][i]);
        free(q); free(k); free(v); free(go); free(pad8); free(full8);
        free(padf); free(fullf);
    }
}

/* A boolean key padding mask whose rows each allow one run of keys is
 * run as bounds (mask.c's pad_as_bounds: the tiles outside them never
 * visited): forward, lse, weights and the backward's three gradients are
 * the bits of the same mask written out as an attn_mask (which is never
 * read as bounds) and, padding at the end, of key_lengths.  Padding at
 * the end, at the start (a left-padded batch) and at both; a row
 * allowing one more key apart from its run keeps the mask (else it would
 * lose that key); a (Lk) mask broadcast over the batch is one row of
 * bounds.  Each boolean kind, causal or not, GQA, 1 and 2 threads. */
static void test_padding_as_bounds(void **state)
{
    (void)state;
    enum { END, START, BOTH };
    typedef struct {
        int64_t B, H, Hkv, dh, Lq, Lk;
        mha_causal causal;
        mha_mask_kind kind;
        int threads, stray, broadcast, where;
    } pcase;
    static const pcase PC[] = {
        {4, 4, 2, 16, 40, 300, 0, MHA_MASK_ALLOW, 2, 0, 0, END},
        {4, 2, 2, 8, 130, 130, MHA_CAUSAL_TOP_LEFT, MHA_MASK_BLOCK, 1, 0, 0, END},
        {4, 3, 1, 32, 7, 200, MHA_CAUSAL_BOTTOM_RIGHT, MHA_MASK_ALLOW, 2, 1, 0, END},
        {3, 2, 1, 8, 1, 700, 0, MHA_MASK_BLOCK, 2, 0, 1, END},
        {4, 4, 2, 16, 9, 260, MHA_CAUSAL_BOTTOM_RIGHT, MHA_MASK_BLOCK, 2, 0, 0, START},
        {4, 2, 1, 8, 70, 200, 0, MHA_MASK_ALLOW, 1, 1, 0, START},
        {4, 2, 2, 16, 33, 333, 0, MHA_MASK_ALLOW, 2, 0, 0, BOTH},
    };
    for (size_t t = 0; t < sizeof PC / sizeof *PC; t++) {
        const pcase *c = &PC[t];
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh;
        const int64_t nq = c->B * c->Lq * E, nk = c->B * c->Lk * Ekv;
        const int64_t nw = c->B * c->H * c->Lq * c->Lk;
        const int64_t nl = c->B * c->H * c->Lq, nm = c->B * c->Lq * c->Lk;
        float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
        float *v = malloc((size_t)nk * 4), *go = malloc((size_t)nq * 4);
        uint8_t *pad8 = malloc((size_t)(c->B * c->Lk)), *full8 = malloc((size_t)nm);
        int64_t lens[4], from[4];
        float *buf[3][6];
        tu_fill(q, nq, 190 + t, -2, 2);
        tu_fill(k, nk, 191 + t, -2, 2);
        tu_fill(v, nk, 192 + t, -2, 2);
        tu_fill(go, nq, 193 + t, -1, 1);
        /* each batch's allowed run: all keys, mid-tile, a tile, none (or
         * one key), at the end, the start or the middle; the stray key
         * (the last batch) is the last one, or the first */
        for (int64_t b = 0; b < c->B; b++) {
            const int64_t l[4] = {c->Lk, c->Lk / 2 + 5, 64, b ? 0 : 1};
            lens[b] = c->broadcast ? c->Lk / 3 : l[b];
            from[b] = c->where == END ? 0
                    : c->where == START ? c->Lk - lens[b]
                                        : (c->Lk - lens[b]) / 2;
            const int64_t sj = c->where == START ? 0 : c->Lk - 1;
            for (int64_t j = 0; j < c->Lk; j++) {
                const int off = (j < from[b] || j >= from[b] + lens[b]) &&
                                !(c->stray && b == c->B - 1 && j == sj);
                pad8[b * c->Lk + j] =
                    (uint8_t)(c->kind == MHA_MASK_BLOCK ? off : !off);
            }
        }
        for (int64_t b = 0; b < c->B; b++)
            for (int64_t i = 0; i < c->Lq; i++)
                memcpy(full8 + (b * c->Lq + i) * c->Lk, pad8 + b * c->Lk,
                       (size_t)c->Lk);
        const int with_lengths = c->where == END && !c->stray;
        const int64_t n[6] = {nq, nl, nw, nq, nk, nk};
        for (int pass = 0; pass < 3; pass++) {
            mha_attention_args a = heads_args(c->B, c->H, c->Hkv, c->dh,
                                              c->Lq, c->Lk, q, k, v,
                                              c->causal, c->threads);
            if (pass == 0)
                a.key_padding_mask =
                    c->broadcast
                        ? (mha_mask){c->kind, pad8, 1, {c->Lk}}
                        : (mha_mask){c->kind, pad8, 2, {c->B, c->Lk}};
            else if (pass == 1 && with_lengths)
                a.key_lengths = lens;
            else
                a.attn_mask = (mha_mask){c->kind, full8, 3,
                                         {c->B, c->Lq, c->Lk}};
            masked_pass(a, go, n, buf[pass], t, pass);
        }
        for (int p = 1; p < 3; p++)
            same_bits(buf[0], buf[p], n, t, "the key padding mask",
                      p == 1 && with_lengths ? "key_lengths"
                                             : "the same attn_mask");
        /* the padding mattered: batch 1's last row weighs the key past
         * its run zero and the run's last key not */
        const float *w1 = buf[0][2] + ((1 * c->H + 0) * c->Lq + c->Lq - 1) *
                                          c->Lk;
        const int64_t e1 = from[1] + lens[1];
        if (e1 < c->Lk)
            assert_true(w1[e1] == 0.0f && w1[e1 - 1] > 0.0f);
        if (c->where != END)
            assert_true(w1[from[1] - 1] == 0.0f && w1[from[1]] > 0.0f);
        if (c->stray) {   /* (its last row: causal lets it see every key) */
            const float *wl =
                buf[0][2] + (((c->B - 1) * c->H + 1) * c->Lq + c->Lq - 1) *
                                c->Lk;
            assert_true(wl[c->where == START ? 0 : c->Lk - 1] > 0.0f);
        }
        for (int p = 0; p < 3; p++)
            for (int i = 0; i < 6; i++)
                free(buf[p][i]);
        free(q); free(k); free(v); free(go); free(pad8); free(full8);
    }
}

/* A decoding step's tile read in place learns whether its values are
 * finite from o after the fast pv (flash_forward.c).  A live key whose
 * weight exp underflows to 0 and whose value is +Inf must still reach
 * the row (the least subnormal weight times Inf), as in a call that
 * packs its tiles with their flags: the same bits, out[0] = +Inf, the
 * rest finite; a masked +Inf value beside it reaches nothing. */
static void test_in_place_underflow(void **state)
{
    (void)state;
    enum { DH = 8, LK = 100 };
    float q[2 * DH] = {0}, k[LK * DH], v[LK * DH], o1[DH], o2[2 * DH];
    tu_fill(v, LK * DH, 301, -1, 1);
    for (int j = 0; j < LK; j++) {
        for (int d = 0; d < DH; d++)
            k[j * DH + d] = d == 0 ? 1.0f : 0.0f;
        if (j == 37) {   /* score -100 against the others' 100 */
            k[j * DH] = -1.0f;
            v[j * DH] = INFINITY;
        }
    }
    v[80 * DH + 3] = INFINITY;   /* key 80: masked below */
    uint8_t keep[LK];
    for (int j = 0; j < LK; j++)
        keep[j] = j != 80 && j != 90;   /* two holes: a mask, not bounds */
    q[0] = q[DH] = 100.0f;
    for (int threads = 1; threads <= 2; threads++) {
        mha_attention_args a =
            heads_args(1, 1, 1, DH, 1, LK, q, k, v, MHA_CAUSAL_NONE, threads);
        a.scale = 1.0f;
        a.key_padding_mask = (mha_mask){MHA_MASK_ALLOW, keep, 2, {1, LK}};
        a.out = o1;
        if (mha_attention(&a) != MHA_OK)
            fail_msg("decode call: %s", mha_last_error());
        a.q_len = 2;   /* two rows: packed, with the tiles' flags */
        a.out = o2;
        if (mha_attention(&a) != MHA_OK)
            fail_msg("two rows: %s", mha_last_error());
        if (!(isinf(o1[0]) && o1[0] > 0))
            fail_msg("threads %d: out[0] = %g, not +Inf", threads, o1[0]);
        for (int d = 1; d < DH; d++)
            if (!isfinite(o1[d]))
                fail_msg("threads %d: out[%d] = %g", threads, d, o1[d]);
        if (memcmp(o1, o2 + DH, sizeof o1))
            fail_msg("threads %d: the decode row differs from the packed "
                     "call's", threads);
    }
}

/* A decoding step (one query row per K/V head) reads K and V where they
 * lie instead of packing them (MHA_IN_PLACE_ROWS): its rows are the bits
 * of the same rows inside a longer call, which packs (output, lse,
 * weights; and a call of two rows, which packs too), with bottom-right
 * causal, a key mask over an infinite value (the tile's finite flag) and
 * 1 and 2 threads. */
static void test_in_place_decode(void **state)
{
    (void)state;
    const int64_t B = 2, H = 3, Hkv = 3, dh = 24, Lq = 20, Lk = 150;
    const int64_t E = H * dh, Ekv = Hkv * dh;
    const int64_t nq = B * Lq * E, nk = B * Lk * Ekv;
    float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
    float *v = malloc((size_t)nk * 4), *out = malloc((size_t)nq * 4);
    float *lse = malloc((size_t)(B * H * Lq) * 4);
    float *w = malloc((size_t)(B * H * Lq * Lk) * 4);
    uint8_t *keep = malloc((size_t)(B * Lk));
    tu_fill(q, nq, 201, -2, 2);
    tu_fill(k, nk, 202, -2, 2);
    tu_fill(v, nk, 203, -2, 2);
    for (int64_t j = 0; j < B * Lk; j++)
        keep[j] = j % 11 != 5;
    for (int64_t d = 0; d < dh; d++)
        v[5 * Ekv + d] = INFINITY;   /* key 5 of batch 0: masked out */
    for (int masked = 0; masked < 2; masked++)
        for (int threads = 1; threads <= 2; threads++) {
            mha_attention_args a =
                heads_args(B, H, Hkv, dh, Lq, Lk, q, k, v,
                           MHA_CAUSAL_BOTTOM_RIGHT, threads);
            a.out = out;
            a.lse = lse;
            a.need_weights = MHA_WEIGHTS_PER_HEAD;
            a.attn_weights = w;
            if (masked)
                a.key_padding_mask =
                    (mha_mask){MHA_MASK_ALLOW, keep, 2, {B, Lk}};
            if (mha_attention(&a) != MHA_OK)
                fail_msg("long call: %s", mha_last_error());
            for (int64_t n = 1; n <= 2; n++) {   /* the last n rows */
                const int64_t i0 = Lq - n;
                float *q1 = malloc((size_t)(B * n * E) * 4);
                float *o1 = malloc((size_t)(B * n * E) * 4);
                float *l1 = malloc((size_t)(B * H * n) * 4);
                float *w1 = malloc((size_t)(B * H * n * Lk) * 4);
                for (int64_t b = 0; b < B; b++)
                    memcpy(q1 + b * n * E, q + (b * Lq + i0) * E,
                           (size_t)(n * E) * 4);
                mha_attention_args d = a;
                d.q_len = n;
                d.q = q1;
                d.out = o1;
                d.lse = l1;
                d.attn_weights = w1;
                if (mha_attention(&d) != MHA_OK)
                    fail_msg("decode call: %s", mha_last_error());
                for (int64_t b = 0; b < B; b++) {
                    if (memcmp(o1 + b * n * E, out + (b * Lq + i0) * E,
                               (size_t)(n * E) * 4))
                        fail_msg("masked %d threads %d rows %lld: output "
                                 "differs", masked, threads, (long long)n);
                    for (int64_t h = 0; h < H; h++) {
                        const int64_t bh = b * H + h;
                        if (memcmp(l1 + bh * n, lse + bh * Lq + i0,
                                   (size_t)n * 4) ||
                            memcmp(w1 + bh * n * Lk,
                                   w + (bh * Lq + i0) * Lk,
                                   (size_t)(n * Lk) * 4))
                            fail_msg("masked %d rows %lld: lse or weights "
                                     "differ", masked, (long long)n);
                    }
                }
                /* the infinite value reached the output unless masked */
                assert_true(masked ? isfinite(o1[0]) : !isfinite(o1[0]));
                free(q1); free(o1); free(l1); free(w1);
            }
        }
    free(q); free(k); free(v); free(out); free(lse); free(w); free(keep);
}

static void test_errors(void **state)
{
    (void)state;
    float x[2 * 3 * 8], out[2 * 3 * 8];
    tu_fill(x, 48, 1, -1, 1);
    mha_attention_args a = small_args(x, out);
    assert_int_equal(mha_attention(&a), MHA_OK);
    assert_int_equal(mha_attention(NULL), MHA_ERR_NULL_POINTER);
    mha_attention_args b = a;
    b.head_dim = 0;
    assert_int_equal(mha_attention(&b), MHA_ERR_SHAPE);
    assert_non_null(strstr(mha_last_error(), "head_dim"));
    b = a;
    b.v = NULL;
    assert_int_equal(mha_attention(&b), MHA_ERR_NULL_POINTER);
    assert_non_null(strstr(mha_last_error(), "v is NULL"));
    b = a;
    b.dropout = 1.5f;
    assert_int_equal(mha_attention(&b), MHA_ERR_INVALID_ARGUMENT);
    b = a;
    b.scale = NAN;
    assert_int_equal(mha_attention(&b), MHA_ERR_INVALID_ARGUMENT);
    b = a;
    b.need_weights = MHA_WEIGHTS_AVERAGE;
    assert_int_equal(mha_attention(&b), MHA_ERR_NULL_POINTER);
    /* a weights buffer that would not be written is refused */
    b = a;
    float wbuf[2 * 3 * 3];
    b.attn_weights = wbuf;
    assert_int_equal(mha_attention(&b), MHA_ERR_INVALID_ARGUMENT);
    assert_non_null(strstr(mha_last_error(), "need_weights is MHA_WEIGHTS_NONE"));
    b = a;
    uint8_t mask[3 * 4] = {0};
    b.attn_mask = (mha_mask){MHA_MASK_ALLOW, mask, 2, {3, 4}};
    assert_int_equal(mha_attention(&b), MHA_ERR_SHAPE);
    assert_non_null(strstr(mha_last_error(), "attn_mask"));
    b = a;
    b.batch = INT64_MAX / 2;
    b.q_len = 1 << 30;
    assert_int_equal(mha_attention(&b), MHA_ERR_OVERFLOW);
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_against_reference),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_heads_first),
        cmocka_unit_test(test_key_mask_as_attn_mask),
        cmocka_unit_test(test_padding_as_bounds),
        cmocka_unit_test(test_in_place_decode),
        cmocka_unit_test(test_in_place_underflow),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
