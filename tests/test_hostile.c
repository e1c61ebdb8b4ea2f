/*
 * test_hostile.c -- the surfaces added after the first release, attacked
 * as a hostile user would (the Reliability issue): the KV cache and
 * decoding through it, grouped-query modules and their files, RoPE
 * positions, the score modifiers' settings, the merge of partial results.
 * One table, one row an attack: the call, the status it must return and
 * a word its message must contain.  Every row runs on a fresh fixture (a
 * grouped-query module, an ordinary cache and a sliding-window cache with
 * a few tokens in them), and after it the caches must hold exactly what
 * they held before: a refused call changes nothing.  Crashes, hangs and
 * leaks are the sanitizer and valgrind runs' to catch (this test runs in
 * both).  The Python package's attacks are in python/tests/
 * test_hostile.py; the MPI ranks' (a killed rank, ranks that disagree) in
 * tests/test_mpi_ring.c and tests/mpi_kill_test.sh; docs/TESTING.md
 * lists them all.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "assert_error.h"
#include "mha_io.h"
#include "testutil.h"

enum { E = 16, H = 4, HKV = 2, DH = 4, CAP = 8, HELD = 3, WCAP = 6, W = 4 };

typedef struct fixture {
    mha_module *m;           /* E 16, 4 heads, 2 K/V heads, RoPE (NeoX) */
    mha_kv_cache *kv;        /* batch 2, capacity 8, f32, 3 tokens each */
    mha_kv_cache *wkv;       /* batch 1, ring of 6, window 4, 5 tokens   */
    float x[2 * CAP * E], y[2 * CAP * E], w[2 * H * CAP * CAP];
    float k[CAP * HKV * DH], v[CAP * HKV * DH];
    int64_t pos[2 * CAP];
} fixture;

static void fixture_make(fixture *f)
{
    memset(f, 0, sizeof *f);
    mha_config c = {0};
    c.embed_dim = E;
    c.num_heads = H;
    c.num_kv_heads = HKV;
    c.mods.rope.style = MHA_ROPE_NEOX;
    f->m = tu_module(&c, 11);
    assert_non_null(f->m);
    assert_int_equal(mha_kv_cache_for_module(f->m, 2, CAP, &f->kv), MHA_OK);
    const mha_kv_cache_config wc = {1, HKV, DH, WCAP, MHA_KV_F16, W, 0, 0, 0, 0, 0};
    assert_int_equal(mha_kv_cache_create(&wc, &f->wkv), MHA_OK);
    tu_fill(f->x, 2 * CAP * E, 3, -1, 1);
    tu_fill(f->k, CAP * HKV * DH, 4, -1, 1);
    tu_fill(f->v, CAP * HKV * DH, 5, -1, 1);
    for (int s = 0; s < 2; s++)
        assert_int_equal(mha_kv_cache_append(f->kv, s, f->k, f->v, HELD),
                         MHA_OK);
    assert_int_equal(mha_kv_cache_append(f->wkv, 0, f->k, f->v, 5), MHA_OK);
}

static void fixture_free(fixture *f)
{
    mha_kv_cache_free(f->kv);
    mha_kv_cache_free(f->wkv);
    mha_free(f->m);
}

/* A decoding step of one token per sequence through f->kv. */
static mha_forward_args step(fixture *f)
{
    mha_forward_args a = {0};
    a.batch = 2;
    a.q_len = 1;
    a.query = f->x;
    a.out = f->y;
    a.cache = f->kv;
    return a;
}

/* Attention on heads against f->kv (the caller's own K/V appended). */
static mha_attention_args heads_step(fixture *f)
{
    mha_attention_args a = {0};
    a.batch = 2;
    a.num_heads = H;
    a.num_kv_heads = HKV;
    a.head_dim = DH;
    a.q_len = 1;
    a.q = f->x;
    a.out = f->y;
    a.cache = f->kv;
    return a;
}

/* A safetensors file in memory: header JSON, then `floats` zeros. */
static mha_status parse_module(const char *json, size_t floats,
                               int64_t heads, mha_module **out)
{
    const size_t hl = strlen(json), n = 8 + hl + 4 * floats;
    unsigned char *b = calloc(n, 1);
    for (int i = 0; i < 8; i++)
        b[i] = (unsigned char)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, json, hl);
    mha_tensor_file *tf = NULL;
    mha_status st = mha_safetensors_parse(b, n, &tf);
    free(b);
    if (st != MHA_OK)
        return st;
    st = mha_module_from_file(tf, heads, NULL, out);
    mha_tensor_file_free(tf);
    return st;
}

/* The tensors of an E = 8, 2-head module with W_k, W_v of `kv_rows` rows
 * each (a grouped-query module has 4 or 8; d_h = 4), no bias; metadata
 * as given (a JSON fragment after "format":"pt"). */
static mha_status gqa_file(int kv_rows_k, int kv_rows_v, const char *meta,
                           mha_module **out)
{
    char json[1024];
    const int q = 8 * 8, k = kv_rows_k * 8, v = kv_rows_v * 8, o = 8 * 8;
    snprintf(json, sizeof json,
             "{\"__metadata__\":{\"format\":\"pt\",\"bias\":\"false\"%s},"
             "\"q_proj_weight\":{\"dtype\":\"F32\",\"shape\":[8,8],"
             "\"data_offsets\":[0,%d]},"
             "\"k_proj_weight\":{\"dtype\":\"F32\",\"shape\":[%d,8],"
             "\"data_offsets\":[%d,%d]},"
             "\"v_proj_weight\":{\"dtype\":\"F32\",\"shape\":[%d,8],"
             "\"data_offsets\":[%d,%d]},"
             "\"out_proj.weight\":{\"dtype\":\"F32\",\"shape\":[8,8],"
             "\"data_offsets\":[%d,%d]}}",
             meta, 4 * q, kv_rows_k, 4 * q, 4 * (q + k), kv_rows_v,
             4 * (q + k), 4 * (q + k + v), 4 * (q + k + v),
             4 * (q + k + v + o));
    return parse_module(json, (size_t)(q + k + v + o), 2, out);
}

/* A module of E = 8, 2 heads, made with one setting changed. */
static mha_status config_with(void (*change)(mha_config *), mha_module **m)
{
    mha_config c = {0};
    c.embed_dim = 8;
    c.num_heads = 2;
    change(&c);
    return mha_create(&c, m);
}

/* ---- the attacks -------------------------------------------------------- */

#define ATTACK(name) static mha_status name(fixture *f)

/* The cache itself: mha_kv_cache_create with a bad configuration (a
 * cache made all the same is freed, and the row fails on its status). */
#define CACHE_ATTACK(name, ...)                                              \
    ATTACK(name)                                                             \
    {                                                                        \
        mha_kv_cache *c = NULL;                                              \
        const mha_kv_cache_config kc = {__VA_ARGS__, 0, 0, 0, 0, 0};         \
        (void)f;                                                             \
        const mha_status st = mha_kv_cache_create(&kc, &c);                  \
        mha_kv_cache_free(c);                                                \
        return st;                                                           \
    }
CACHE_ATTACK(cache_capacity_zero, 1, 2, 4, 0, MHA_KV_F32, 0)
CACHE_ATTACK(cache_batch_negative, -1, 2, 4, 8, MHA_KV_F32, 0)
CACHE_ATTACK(cache_head_dim_zero, 1, 2, 0, 8, MHA_KV_F32, 0)
CACHE_ATTACK(cache_absurd_size, INT64_C(1) << 20, 64, 128, INT64_C(1) << 40,
             MHA_KV_F32, 0)
CACHE_ATTACK(cache_dtype_unknown, 1, 2, 4, 8, (mha_kv_dtype)7, 0)
CACHE_ATTACK(cache_window_over_capacity, 1, 2, 4, 4, MHA_KV_F32, 5)
CACHE_ATTACK(cache_window_negative, 1, 2, 4, 8, MHA_KV_F32, -2)
/* capacity + 63 would overflow in rounding it up to whole tiles */
CACHE_ATTACK(cache_capacity_int64_max, 1, 1, 8, INT64_MAX, MHA_KV_F32, 0)
ATTACK(cache_for_module_int64_max)
{
    mha_kv_cache *c = NULL;
    const mha_status st =
        mha_kv_cache_for_module(f->m, 1, INT64_MAX - 10, &c);
    mha_kv_cache_free(c);
    return st;
}
ATTACK(cache_for_cross_module)
{
    mha_config c = {0};   /* keys of width 8, not E */
    c.embed_dim = E;
    c.num_heads = H;
    c.kdim = 8;
    c.vdim = 8;
    mha_module *m = tu_module(&c, 5);
    mha_kv_cache *kv = NULL;
    (void)f;
    const mha_status st = mha_kv_cache_for_module(m, 1, CAP, &kv);
    mha_kv_cache_free(kv);
    mha_free(m);
    return st;
}
ATTACK(cache_config_null)
{
    mha_kv_cache *c = NULL;
    (void)f;
    return mha_kv_cache_create(NULL, &c);
}
ATTACK(cache_for_null_module)
{
    /* refused, and *out set to NULL, as mha_kv_cache_create does (a
     * pointer left as it was fails the row) */
    mha_kv_cache *c = (mha_kv_cache *)f;
    const mha_status st = mha_kv_cache_for_module(NULL, 1, 8, &c);
    return c ? MHA_OK : st;
}
ATTACK(append_past_capacity)
{
    return mha_kv_cache_append(f->kv, 0, f->k, f->v, CAP - HELD + 1);
}
ATTACK(append_bad_sequence)
{
    return mha_kv_cache_append(f->kv, 2, f->k, f->v, 1);
}
ATTACK(append_negative_count)
{
    return mha_kv_cache_append(f->kv, 0, f->k, f->v, -1);
}
ATTACK(append_null_values)
{
    return mha_kv_cache_append(f->kv, 0, f->k, NULL, 1);
}
ATTACK(append_null_cache)
{
    return mha_kv_cache_append(NULL, 0, f->k, f->v, 1);
}
ATTACK(truncate_grows)
{
    return mha_kv_cache_truncate(f->kv, 1, HELD + 1);
}
ATTACK(truncate_negative)
{
    return mha_kv_cache_truncate(f->kv, 0, -1);
}
ATTACK(truncate_window_lost)
{
    /* the ring of 6 holds positions 0..4 still; a window of 4 keeps
     * only what the next step needs, but the ring wrapped nothing yet:
     * rolling back below what it can restore is refused once it has */
    mha_kv_cache_append(f->wkv, 0, f->k, f->v, 4);   /* 9 tokens: wrapped */
    return mha_kv_cache_truncate(f->wkv, 0, 2);
}
ATTACK(reset_bad_sequence)
{
    return mha_kv_cache_reset(f->kv, -2);
}
ATTACK(read_past_length)
{
    return mha_kv_cache_read(f->kv, 0, 2, 2, f->k, f->v);
}
ATTACK(read_negative_start)
{
    return mha_kv_cache_read(f->kv, 0, -1, 1, f->k, f->v);
}
ATTACK(read_negative_count)
{
    return mha_kv_cache_read(f->kv, 0, 0, -1, f->k, f->v);
}
/* (the message once printed start + n - 1, which overflows here) */
ATTACK(read_huge_count)
{
    return mha_kv_cache_read(f->kv, 0, 2, INT64_MAX, f->k, f->v);
}
ATTACK(read_huge_start)
{
    return mha_kv_cache_read(f->kv, 0, INT64_MAX, 1, f->k, f->v);
}

/* The weights written over the forward's out, or over its query. */
static mha_status weights_over(fixture *f, float *w)
{
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = 2;
    a.query = f->x;
    a.out = f->y;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    return mha_forward(f->m, &a);
}
ATTACK(forward_weights_over_out)
{
    return weights_over(f, f->y + 8);
}
ATTACK(forward_weights_over_query)
{
    return weights_over(f, f->x + 31);
}

/* Decoding through the cache. */
ATTACK(decode_wrong_module)
{
    mha_config c = {0};   /* 4 K/V heads: not this cache's 2 */
    c.embed_dim = E;
    c.num_heads = H;
    mha_module *m = tu_module(&c, 3);
    mha_forward_args a = step(f);
    const mha_status st = mha_forward(m, &a);
    mha_free(m);
    return st;
}
ATTACK(decode_wrong_head_dim)
{
    mha_config c = {0};   /* d_h 8, 2 heads of 2 K/V... of d_h 8 */
    c.embed_dim = E;
    c.num_heads = 2;
    c.num_kv_heads = 2;
    mha_module *m = tu_module(&c, 3);
    mha_forward_args a = step(f);
    const mha_status st = mha_forward(m, &a);
    mha_free(m);
    return st;
}
ATTACK(decode_batch_mismatch)
{
    mha_forward_args a = step(f);
    a.batch = 1;
    return mha_forward(f->m, &a);
}
ATTACK(decode_overflows_capacity)
{
    mha_forward_args a = step(f);
    a.q_len = CAP - HELD + 1;
    return mha_forward(f->m, &a);
}
ATTACK(decode_with_key)
{
    mha_forward_args a = step(f);
    a.key = f->x;
    return mha_forward(f->m, &a);
}
ATTACK(decode_training)
{
    mha_forward_args a = step(f);
    a.training = 1;
    return mha_forward(f->m, &a);
}
ATTACK(decode_top_left)
{
    mha_forward_args a = step(f);
    a.causal = MHA_CAUSAL_TOP_LEFT;
    return mha_forward(f->m, &a);
}
ATTACK(decode_kv_len_wrong)
{
    mha_forward_args a = step(f);
    a.kv_len = 2;   /* the longest sequence after the append is 4 */
    return mha_forward(f->m, &a);
}
ATTACK(decode_weights_no_buffer)
{
    mha_forward_args a = step(f);
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    return mha_forward(f->m, &a);
}
ATTACK(decode_window_with_mask)
{
    uint8_t allow[CAP] = {1, 1, 1, 1, 1, 1, 1, 1};
    mha_attention_args a = heads_step(f);
    a.batch = 1;
    a.cache = f->wkv;
    a.attn_mask.kind = MHA_MASK_ALLOW;
    a.attn_mask.data = allow;
    a.attn_mask.ndim = 2;
    a.attn_mask.shape[0] = 1;
    a.attn_mask.shape[1] = 5;
    return mha_attention(&a);
}
ATTACK(decode_window_weights)
{
    mha_attention_args a = heads_step(f);
    a.batch = 1;
    a.cache = f->wkv;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = f->w;
    return mha_attention(&a);
}
ATTACK(decode_window_too_many_queries)
{
    mha_attention_args a = heads_step(f);
    a.batch = 1;
    a.cache = f->wkv;
    a.q_len = 4;   /* Lq + W - 1 = 7 > the ring's 6 */
    return mha_attention(&a);
}
ATTACK(decode_heads_with_k)
{
    mha_attention_args a = heads_step(f);
    a.k = f->k;
    return mha_attention(&a);
}
ATTACK(decode_heads_backward)
{
    const mha_attention_args a = heads_step(f);
    mha_attention_grads g = {0};
    g.grad_out = f->x;
    g.grad_q = f->y;
    return mha_attention_backward(&a, &g);
}
ATTACK(decode_heads_plan_other_cache)
{
    mha_attention_args a = heads_step(f);
    mha_attention_plan *p = NULL;
    if (mha_attention_plan_create(&a, &p) != MHA_OK)
        return MHA_OK;   /* (the row then fails: creating must work) */
    mha_kv_cache *big = NULL;
    mha_kv_cache_for_module(f->m, 2, 2 * CAP, &big);
    a.cache = big;
    const mha_status st = mha_attention_plan_run(p, &a);
    mha_kv_cache_free(big);
    mha_attention_plan_free(p);
    return st;
}
ATTACK(decode_plan_other_cache)
{
    mha_forward_args a = step(f);
    mha_plan *p = NULL;
    mha_status st = mha_plan_create(f->m, &a, &p);
    if (st != MHA_OK)
        return MHA_OK;   /* (the row then fails: creating must work) */
    mha_kv_cache *big = NULL;
    mha_kv_cache_for_module(f->m, 2, 2 * CAP, &big);
    a.cache = big;
    st = mha_plan_forward(p, &a);
    mha_kv_cache_free(big);
    mha_plan_free(p);
    return st;
}
ATTACK(decode_then_backward)
{
    mha_forward_args a = step(f);
    mha_plan *p = NULL;
    if (mha_plan_create(f->m, &a, &p) != MHA_OK ||
        mha_plan_forward(p, &a) != MHA_OK) {
        mha_plan_free(p);
        return MHA_OK;
    }
    mha_kv_cache_truncate(f->kv, 0, HELD);   /* (as the fixture had it) */
    mha_kv_cache_truncate(f->kv, 1, HELD);
    float g[2 * E];
    tu_fill(g, 2 * E, 6, -1, 1);
    mha_backward_args b = {0};
    b.grad_out = g;
    b.grad_query = f->y;
    const mha_status st = mha_plan_backward(p, &a, &b);
    mha_plan_free(p);
    return st;
}

/* RoPE positions. */
ATTACK(positions_negative)
{
    mha_forward_args a = {0};
    a.batch = 1;
    a.q_len = 2;
    a.query = f->x;
    a.out = f->y;
    f->pos[0] = 0;
    f->pos[1] = -5;
    a.positions = f->pos;
    return mha_forward(f->m, &a);
}
ATTACK(rope_apply_short_rows)
{
    const mha_rope r = {MHA_ROPE_NEOX, 0, 0.0f, 0.0f};
    /* rows of 4 heads of d_h 4 are 16 floats: a stride of 8 overlaps */
    return mha_rope_apply(&r, 2, H, DH, NULL, 0, f->x, 8);
}
ATTACK(rope_apply_negative_position)
{
    const mha_rope r = {MHA_ROPE_NEOX, 0, 0.0f, 0.0f};
    return mha_rope_apply(&r, 2, H, DH, NULL, -3, f->x, H * DH);
}

/* Grouped-query files. */
/* A call that makes a module (freed if it is made after all). */
#define MODULE_ATTACK(name, call)                                            \
    ATTACK(name)                                                             \
    {                                                                        \
        mha_module *m = NULL;                                                \
        (void)f;                                                             \
        const mha_status st = (call);                                        \
        mha_free(m);                                                         \
        return st;                                                           \
    }
/* 6 rows: not whole heads of d_h 4 */
MODULE_ATTACK(gqa_rows_not_heads, gqa_file(6, 6, "", &m))
MODULE_ATTACK(gqa_k_v_disagree, gqa_file(4, 8, "", &m))
/* 4 rows: 1 K/V head of d_h 4; the metadata says 2 */
MODULE_ATTACK(gqa_metadata_contradicts,
              gqa_file(4, 4, ",\"num_kv_heads\":\"2\"", &m))
MODULE_ATTACK(gqa_metadata_not_a_number,
              gqa_file(4, 4, ",\"num_kv_heads\":\"one\"", &m))
static void kv_heads_not_dividing(mha_config *c)
{
    c->embed_dim = 12;
    c->num_heads = 3;
    c->num_kv_heads = 2;
}
MODULE_ATTACK(gqa_config_not_dividing, config_with(kv_heads_not_dividing, &m))
MODULE_ATTACK(rope_file_unknown_style,
              gqa_file(8, 8, ",\"rope\":\"sideways\"", &m))
MODULE_ATTACK(softcap_file_negative,
              gqa_file(8, 8, ",\"softcap\":\"-1\"", &m))
MODULE_ATTACK(window_file_malformed,
              gqa_file(8, 8, ",\"window\":\"3\"", &m))

/* The modifiers' settings. */
static void softcap_nan(mha_config *c) { c->mods.softcap = NAN; }
static void window_below(mha_config *c)
{
    c->mods.window = 1;
    c->mods.window_left = -2;
}
static void rope_odd(mha_config *c)
{
    c->mods.rope.style = MHA_ROPE_NEOX;
    c->mods.rope.dims = 3;
}
static void rope_wide(mha_config *c)
{
    c->mods.rope.style = MHA_ROPE_GPTJ;
    c->mods.rope.dims = 6;   /* d_h is 4 */
}
static void rope_theta_one(mha_config *c)
{
    c->mods.rope.style = MHA_ROPE_NEOX;
    c->mods.rope.theta = 1.0f;
}
static void rope_style_unknown(mha_config *c)
{
    c->mods.rope.style = (mha_rope_style)9;
}
static const float nan_slopes[2] = {0.5f, NAN};
static void alibi_nan_slope(mha_config *c)
{
    c->mods.alibi = 1;
    c->mods.alibi_slopes = nan_slopes;
}
MODULE_ATTACK(modifier_softcap_nan, config_with(softcap_nan, &m))
MODULE_ATTACK(modifier_window_below, config_with(window_below, &m))
MODULE_ATTACK(modifier_rope_odd, config_with(rope_odd, &m))
MODULE_ATTACK(modifier_rope_wide, config_with(rope_wide, &m))
MODULE_ATTACK(modifier_rope_theta, config_with(rope_theta_one, &m))
MODULE_ATTACK(modifier_rope_style, config_with(rope_style_unknown, &m))
MODULE_ATTACK(modifier_alibi_nan, config_with(alibi_nan_slope, &m))
ATTACK(sinks_on_attention_nan)
{
    const float sinks[H] = {0, 0, INFINITY, 0};
    mha_attention_args a = heads_step(f);
    a.sinks = sinks;
    return mha_attention(&a);
}

/* The merge of partial results. */
ATTACK(merge_zero_parts)
{
    float o1[4] = {0}, l1[1] = {0}, out[4], lse[1];
    mha_attention_part p = {o1, l1};
    (void)f;
    return mha_attention_merge(&p, 0, 1, 1, 4, 1, out, lse);
}
ATTACK(merge_no_parts)
{
    float out[4], lse[1];
    (void)f;
    return mha_attention_merge(NULL, 0, 1, 1, 4, 1, out, lse);
}
ATTACK(merge_null_lse)
{
    float o1[4] = {0}, out[4], lse[1];
    mha_attention_part p = {o1, NULL};
    (void)f;
    return mha_attention_merge(&p, 1, 1, 1, 4, 1, out, lse);
}
ATTACK(merge_overflowing_shape)
{
    float o1[4] = {0}, l1[1] = {0}, out[4], lse[1];
    mha_attention_part p = {o1, l1};
    (void)f;
    return mha_attention_merge(&p, 1, INT64_C(1) << 40, 1 << 20, 1 << 20, 1,
                               out, lse);
}

typedef struct attack {
    const char *name;
    mha_status (*run)(fixture *f);
    mha_status status;
    const char *needle;   /* a word the message must contain */
} attack;

#define ROW(fn, st, needle) {#fn, fn, st, needle}

static const attack ATTACKS[] = {
    ROW(cache_capacity_zero, MHA_ERR_INVALID_ARGUMENT, "capacity"),
    ROW(cache_batch_negative, MHA_ERR_INVALID_ARGUMENT, "batch"),
    ROW(cache_head_dim_zero, MHA_ERR_INVALID_ARGUMENT, "head_dim"),
    ROW(cache_absurd_size, MHA_ERR_OVERFLOW, "overflows"),
    ROW(cache_dtype_unknown, MHA_ERR_INVALID_ARGUMENT, "dtype 7"),
    ROW(cache_window_over_capacity, MHA_ERR_INVALID_ARGUMENT, "window"),
    ROW(cache_window_negative, MHA_ERR_INVALID_ARGUMENT, "window"),
    ROW(cache_config_null, MHA_ERR_NULL_POINTER, "config"),
    ROW(cache_capacity_int64_max, MHA_ERR_OVERFLOW, "overflows"),
    ROW(cache_for_module_int64_max, MHA_ERR_OVERFLOW, "overflows"),
    ROW(cache_for_cross_module, MHA_ERR_INVALID_ARGUMENT, "self-attention"),
    ROW(cache_for_null_module, MHA_ERR_NULL_POINTER, "module"),
    ROW(append_past_capacity, MHA_ERR_INVALID_ARGUMENT, "capacity 8"),
    ROW(append_bad_sequence, MHA_ERR_INVALID_ARGUMENT, "sequence 2"),
    ROW(append_negative_count, MHA_ERR_INVALID_ARGUMENT, "-1"),
    ROW(append_null_values, MHA_ERR_NULL_POINTER, "v is NULL"),
    ROW(append_null_cache, MHA_ERR_NULL_POINTER, "cache"),
    ROW(truncate_grows, MHA_ERR_INVALID_ARGUMENT, "length 3"),
    ROW(truncate_negative, MHA_ERR_INVALID_ARGUMENT, "-1"),
    ROW(truncate_window_lost, MHA_ERR_INVALID_ARGUMENT, "window"),
    ROW(reset_bad_sequence, MHA_ERR_INVALID_ARGUMENT, "sequence -2"),
    ROW(read_past_length, MHA_ERR_INVALID_ARGUMENT, "length 3"),
    ROW(read_negative_start, MHA_ERR_INVALID_ARGUMENT, "-1"),
    ROW(read_negative_count, MHA_ERR_INVALID_ARGUMENT, "n >= 0"),
    ROW(read_huge_count, MHA_ERR_INVALID_ARGUMENT, "length 3"),
    ROW(read_huge_start, MHA_ERR_INVALID_ARGUMENT, "length 3"),
    ROW(forward_weights_over_out, MHA_ERR_INVALID_ARGUMENT, "overlaps out"),
    ROW(forward_weights_over_query, MHA_ERR_INVALID_ARGUMENT,
        "overlaps query"),
    ROW(decode_wrong_module, MHA_ERR_SHAPE, "K/V heads"),
    ROW(decode_wrong_head_dim, MHA_ERR_SHAPE, "head"),
    ROW(decode_batch_mismatch, MHA_ERR_SHAPE, "2 sequences"),
    ROW(decode_overflows_capacity, MHA_ERR_INVALID_ARGUMENT, "do not fit"),
    ROW(decode_with_key, MHA_ERR_INVALID_ARGUMENT, "key"),
    ROW(decode_training, MHA_ERR_INVALID_ARGUMENT, "training"),
    ROW(decode_top_left, MHA_ERR_INVALID_ARGUMENT, "TOP_LEFT"),
    ROW(decode_kv_len_wrong, MHA_ERR_SHAPE, "kv_len"),
    ROW(decode_weights_no_buffer, MHA_ERR_NULL_POINTER, "attn_weights"),
    ROW(decode_window_with_mask, MHA_ERR_UNSUPPORTED, "window"),
    ROW(decode_window_weights, MHA_ERR_UNSUPPORTED, "window"),
    ROW(decode_window_too_many_queries, MHA_ERR_INVALID_ARGUMENT, "window"),
    ROW(decode_heads_with_k, MHA_ERR_INVALID_ARGUMENT, "cache"),
    ROW(decode_heads_backward, MHA_ERR_UNSUPPORTED, "no backward"),
    ROW(decode_heads_plan_other_cache, MHA_ERR_INVALID_ARGUMENT,
        "capacity <= 8"),
    ROW(decode_plan_other_cache, MHA_ERR_INVALID_ARGUMENT, "capacity"),
    ROW(decode_then_backward, MHA_ERR_INVALID_ARGUMENT, "no forward"),
    ROW(positions_negative, MHA_ERR_INVALID_ARGUMENT, "position"),
    ROW(rope_apply_short_rows, MHA_ERR_SHAPE, "ld 8"),
    ROW(rope_apply_negative_position, MHA_ERR_INVALID_ARGUMENT, "pos0"),
    ROW(gqa_rows_not_heads, MHA_ERR_SHAPE, "k_proj_weight"),
    ROW(gqa_k_v_disagree, MHA_ERR_SHAPE, "k_proj_weight"),
    ROW(gqa_metadata_contradicts, MHA_ERR_FORMAT, "num_kv_heads"),
    ROW(gqa_metadata_not_a_number, MHA_ERR_FORMAT, "num_kv_heads"),
    ROW(gqa_config_not_dividing, MHA_ERR_INVALID_CONFIG, "num_kv_heads"),
    ROW(rope_file_unknown_style, MHA_ERR_FORMAT, "rope"),
    ROW(softcap_file_negative, MHA_ERR_FORMAT, "softcap"),
    ROW(window_file_malformed, MHA_ERR_FORMAT, "window"),
    ROW(modifier_softcap_nan, MHA_ERR_INVALID_ARGUMENT, "softcap"),
    ROW(modifier_window_below, MHA_ERR_INVALID_ARGUMENT, "window"),
    ROW(modifier_rope_odd, MHA_ERR_INVALID_ARGUMENT, "dims"),
    ROW(modifier_rope_wide, MHA_ERR_INVALID_ARGUMENT, "dims"),
    ROW(modifier_rope_theta, MHA_ERR_INVALID_ARGUMENT, "theta"),
    ROW(modifier_rope_style, MHA_ERR_INVALID_ARGUMENT, "style"),
    ROW(modifier_alibi_nan, MHA_ERR_NON_FINITE, "slope"),
    ROW(sinks_on_attention_nan, MHA_ERR_NON_FINITE, "sinks"),
    ROW(merge_no_parts, MHA_ERR_NULL_POINTER, "parts"),
    ROW(merge_zero_parts, MHA_ERR_INVALID_ARGUMENT, "n_parts"),
    ROW(merge_null_lse, MHA_ERR_NULL_POINTER, "lse"),
    ROW(merge_overflowing_shape, MHA_ERR_OVERFLOW, "overflow"),
};

/* Every row: its status and message, and the caches as they were. */
static void test_attacks(void **state)
{
    (void)state;
    const int n = (int)(sizeof ATTACKS / sizeof ATTACKS[0]);
    assert_true(n >= 40);
    int bad = 0;
    for (int r = 0; r < n; r++) {
        const attack *t = &ATTACKS[r];
        fixture f;
        fixture_make(&f);
        float k0[HELD * HKV * DH], v0[HELD * HKV * DH];
        float k1[HELD * HKV * DH], v1[HELD * HKV * DH];
        assert_int_equal(mha_kv_cache_read(f.kv, 0, 0, HELD, k0, v0), MHA_OK);
        const mha_status st = t->run(&f);
        const char *msg = mha_last_error();
        if (st != t->status || !msg || !strstr(msg, t->needle)) {
            print_error("%s: status %d (%s), expected %d with \"%s\"; "
                        "message: %s\n", t->name, (int)st,
                        mha_status_string(st), (int)t->status, t->needle,
                        msg ? msg : "(none)");
            bad++;
        }
        /* A refused call changes nothing (decode_then_backward's own
         * successful step truncated back). */
        const int wkv_len = !strcmp(t->name, "truncate_window_lost") ? 9 : 5;
        if (mha_kv_cache_length(f.kv, 0) != HELD ||
            mha_kv_cache_length(f.kv, 1) != HELD ||
            mha_kv_cache_length(f.wkv, 0) != wkv_len ||
            mha_kv_cache_read(f.kv, 0, 0, HELD, k1, v1) != MHA_OK ||
            memcmp(k0, k1, sizeof k0) || memcmp(v0, v1, sizeof v0)) {
            print_error("%s: the cache changed\n", t->name);
            bad++;
        }
        fixture_free(&f);
    }
    if (bad)
        fail_msg("%d of %d attacks were not refused as they must be", bad, n);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attacks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
