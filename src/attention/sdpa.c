/*
 * sdpa.c -- attention on heads the caller has already projected (what
 * PyTorch calls scaled_dot_product_attention), without a module: the
 * public mha_attention calls and their plan.
 *
 *   create    checks the shapes and options, chooses the engine, sizes
 *             one workspace (the same layout as the module's plans)
 *   run       checks the data pointers and runs, allocating nothing; keeps
 *             the row stats and packed K/V for a backward
 *   backward  dq, dk, dv of the last run, from what it kept
 */
#include "engine.h"
#include "rope.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Shapes of a call, checked and derived once. */
typedef struct sdpa_shape {
    int64_t B, H, Hkv, dh, Lq, Lk;
    int64_t dv;                    /* the values' head width (dh unless
                                      v_head_dim says otherwise)        */
    int64_t E, Ekv;                /* H dh: a row of q; Hkv dh: of k     */
    int64_t Ev, Evkv;              /* H dv: a row of out; Hkv dv: of v   */
    int64_t n_q, n_kv, n_w;        /* floats of q, k, weights */
    int64_t n_o, n_v;              /* floats of out, v */
} sdpa_shape;

/* How a 16-bit plan's run goes ("16-bit plans" below); its backward
 * takes the same route. */
typedef enum run_route { RUN_TILES, RUN_WIDE, RUN_BF16 } run_route;

struct mha_attention_plan {
    sdpa_shape shape;
    int64_t cache_capacity;   /* > 0: a plan for decoding on a cache */
    mha_engine eng;
    mha_attn_layout lay, blay;
    float *ws;            /* the forward's layout                          */
    float *bws;           /* the backward's, allocated by its first call   */
    float *slopes;        /* (H) ALiBi's default slopes                    */
    float *dsinks;        /* [B][H] per-batch sink gradients, with bws     */
    float *rot;           /* with RoPE: q (n_q) and k (n_kv) rotated, kept
                             for the backward (NULL: a plan without RoPE) */
    int has_saved;        /* the last run, kept for the backward           */
    mha_attention_args saved;
    uint64_t saved_print;
    int one_shot;         /* made by mha_attention for one run, which no
                             backward can follow: no fingerprint taken   */
    /* A 16-bit plan (dtype BF16 or F16; "16-bit plans" below) */
    mha_dtype dtype;      /* the data's type: F32, or BF16 / F16          */
    run_route route;      /* the last 16-bit run's                        */
    int amx;              /* RUN_BF16 on AMX tiles (else AVX512-BF16 /
                             BFDOT dot products)                         */
    float *lse16;         /* BF16: (B, H, Lq) the bf16 kernels' row lse   */
    float *wide;          /* RUN_WIDE: q, k, v, out widened               */
    float *wide_g;        /* its backward's dL/d out, dq, dk, dv (first
                             backward)                                   */
};

static float resolved_scale(const mha_attention_args *a, int64_t dh)
{
    if (a->scale != 0.0f || (a->given & MHA_GIVEN_SCALE))
        return a->scale;
    return (float)(1.0 / sqrt((double)dh));
}

/* The request of arguments `a` with shapes s (slopes: ALiBi's default
 * ones, when the call gives none). */
static mha_attn_request request_of(const mha_attention_args *a,
                                   const sdpa_shape *s, const float *slopes)
{
    mha_attn_request r = {
        .B = s->B, .H = s->H, .Hkv = s->Hkv, .dh = s->dh, .dv = s->dv,
        .Lq = s->Lq, .Lk = s->Lk, .kv_len = a->kv_len, .q = a->q, .k = a->k,
        .v = a->v, .ldq = s->E, .ldk = s->Ekv, .ldv = s->Evkv, .out = a->out,
        .ldo = s->Ev, .scale = resolved_scale(a, s->dh), .mods = &a->mods,
        .slopes = a->mods.alibi_slopes ? a->mods.alibi_slopes : slopes,
        .sinks = a->sinks, .chunk = a->attention_chunk,
        .attn_mask = a->attn_mask, .key_padding_mask = a->key_padding_mask,
        .key_lengths = a->key_lengths, .causal = a->causal,
        .q_offset_given = (a->given & MHA_GIVEN_Q_OFFSET) != 0,
        .q_offset = a->q_offset, .dropout = a->training && a->dropout > 0.0f,
        .p_drop = a->dropout, .seed = a->dropout_seed,
        .need_weights = a->need_weights,
        .attn_weights = a->attn_weights,
        .cache = a->cache,
        .q_growth = a->mods.rope.style != MHA_ROPE_NONE ? 2.0 : 1.0};
    if (a->layout == MHA_LAYOUT_HEADS_FIRST) {
        /* (B, heads, L, d_h): rows d_h apart, heads L rows apart (d_v
         * for v and out) */
        r.ldq = r.ldk = s->dh;
        r.ldv = r.ldo = s->dv;
        r.hsq = s->Lq * s->dh;
        r.hso = s->Lq * s->dv;
        r.hsk = s->Lk * s->dh;
        r.hsv = s->Lk * s->dv;
        r.bsq = s->H * r.hsq;
        r.bso = s->H * r.hso;
        r.bsk = s->Hkv * r.hsk;
        r.bsv = s->Hkv * r.hsv;
    }
    return r;
}

/* Everything about `a` but its data pointers. */
static mha_status check_shape(const mha_attention_args *a, sdpa_shape *s)
{
    if (a->dtype != MHA_DTYPE_F32)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype %d: a part's backward and the float32 "
                             "calls take MHA_DTYPE_F32 only; bf16 and f16 "
                             "go through mha_attention, its plans and "
                             "mha_attention_backward16", (int)a->dtype);
    if (a->q16 || a->k16 || a->v16 || a->out16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s is set but dtype is MHA_DTYPE_F32: give "
                             "float data in q, k, v and out, or set dtype",
                             a->q16 ? "q16" : a->k16 ? "k16"
                             : a->v16 ? "v16" : "out16");
    s->B = a->batch;
    s->H = a->num_heads;
    s->dh = a->head_dim;
    s->Lq = a->q_len;
    s->Lk = a->kv_len ? a->kv_len : a->q_len;
    s->Hkv = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    s->dv = a->v_head_dim ? a->v_head_dim : a->head_dim;
    if (s->B < 1 || s->H < 1 || s->dh < 1 || s->Lq < 1 || s->Lk < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "batch, num_heads, head_dim, q_len and kv_len "
                             "must be >= 1, got %lld, %lld, %lld, %lld, %lld",
                             (long long)s->B, (long long)s->H,
                             (long long)s->dh, (long long)s->Lq,
                             (long long)s->Lk);
    if (a->v_head_dim < 0 || s->dv > (INT64_C(1) << 24))
        return mha_set_error(MHA_ERR_SHAPE,
                             "v_head_dim must be >= 1 (0: head_dim) and at "
                             "most 2^24, got %lld",
                             (long long)a->v_head_dim);
    if (a->cache) {   /* the values' width is the cache's */
        if (a->v_head_dim && a->v_head_dim != a->cache->dv)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "v_head_dim %lld differs from the cache's "
                                 "values' head width %lld (0: the cache's)",
                                 (long long)a->v_head_dim,
                                 (long long)a->cache->dv);
        s->dv = a->cache->dv;
    }
    if (a->cache) {
        const char *bad = a->k ? "k" : a->v ? "v"
                        : a->training ? "training" : NULL;
        if (bad)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "with a KV cache, %s must be unset: the keys "
                                 "are the cache's, masked causally per "
                                 "sequence", bad);
        s->Lk = a->cache->capacity;   /* the most keys a run can read */
    }
    if (s->Hkv < 1 || s->H % s->Hkv != 0)
        return mha_set_error(MHA_ERR_SHAPE,
                             "num_kv_heads %lld must divide num_heads %lld "
                             "(0 = num_heads)", (long long)a->num_kv_heads,
                             (long long)s->H);
    if (!isfinite(a->scale))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "scale must be finite, got %g", (double)a->scale);
    if (!(a->dropout >= 0.0f && a->dropout <= 1.0f))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dropout must be in [0, 1], got %g",
                             (double)a->dropout);
    MHA_CHECK(mha_check_threads(a->num_threads));
    MHA_CHECK(mha_sinks_check(a->sinks, s->H, "attention"));
    mha_rope rope;
    MHA_CHECK(mha_rope_resolve(&a->mods.rope, s->dh, &rope));
    if (a->layout != MHA_LAYOUT_ROWS && a->layout != MHA_LAYOUT_HEADS_FIRST)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "layout must be MHA_LAYOUT_ROWS (0) or "
                             "MHA_LAYOUT_HEADS_FIRST (1), got %d",
                             (int)a->layout);
    if (a->layout == MHA_LAYOUT_HEADS_FIRST &&
        (a->cache || rope.style != MHA_ROPE_NONE))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "layout MHA_LAYOUT_HEADS_FIRST is not supported "
                             "with %s: give q, k, v and out in rows "
                             "(MHA_LAYOUT_ROWS)",
                             a->cache ? "a KV cache" : "RoPE");
    if (a->cache && a->k_positions && rope.style != MHA_ROPE_NONE)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "with a KV cache, k_positions must be unset: "
                             "the cache holds keys rotated already");
    int64_t t, w;
    if (!mha_mul_ok(s->H, s->dh, &s->E) || !mha_mul_ok(s->Hkv, s->dh, &s->Ekv) ||
        !mha_mul_ok(s->H, s->dv, &s->Ev) ||
        !mha_mul_ok(s->Hkv, s->dv, &s->Evkv) ||
        !mha_mul_ok(s->B, s->Lq, &t) || !mha_mul_ok(t, s->Ev, &s->n_o) ||
        !mha_mul_ok(t, s->E, &s->n_q) || !mha_mul_ok(s->B, s->Lk, &t) ||
        !mha_mul_ok(t, s->Evkv, &s->n_v) ||
        !mha_mul_ok(t, s->Ekv, &s->n_kv) || !mha_mul_ok(s->B, s->H, &t) ||
        !mha_mul_ok(t, s->Lq, &t) || !mha_mul_ok(t, s->Lk, &w) ||
        s->n_q > INT64_MAX / 8 || s->n_kv > INT64_MAX / 8 ||
        s->n_o > INT64_MAX / 8 || s->n_v > INT64_MAX / 8 ||
        w > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "attention sizes B=%lld H=%lld d_h=%lld "
                             "Lq=%lld Lk=%lld overflow 64 bits",
                             (long long)s->B, (long long)s->H,
                             (long long)s->dh, (long long)s->Lq,
                             (long long)s->Lk);
    s->n_w = a->need_weights == MHA_WEIGHTS_AVERAGE ? w / s->H : w;
    const mha_attn_request r = request_of(a, s, NULL);
    return mha_attn_request_check(&r, "attention");
}

/* Whether [a, a + na) and [b, b + nb) (floats) share memory. */
static int overlaps(const void *a, int64_t na, const void *b, int64_t nb)
{
    if (!a || !b)
        return 0;
    const uintptr_t a0 = (uintptr_t)a, a1 = a0 + (uintptr_t)na * sizeof(float);
    const uintptr_t b0 = (uintptr_t)b, b1 = b0 + (uintptr_t)nb * sizeof(float);
    return a0 < b1 && b0 < a1;
}

/* Outputs written while inputs are read must not share memory with them,
 * nor with one another. */
typedef struct span {
    const char *name;
    const void *p;
    int64_t n;
} span;

static mha_status check_disjoint(const span *out, int n_out, const span *in,
                                 int n_in)
{
    for (int o = 0; o < n_out; o++) {
        for (int i = 0; i < n_in; i++)
            if (overlaps(out[o].p, out[o].n, in[i].p, in[i].n))
                return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                     "%s overlaps %s: an output may not "
                                     "share memory with an input",
                                     out[o].name, in[i].name);
        for (int p = 0; p < o; p++)
            if (overlaps(out[o].p, out[o].n, out[p].p, out[p].n))
                return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                     "%s overlaps %s: outputs may not share "
                                     "memory", out[o].name, out[p].name);
    }
    return MHA_OK;
}

/* The fingerprint of a call's inputs (the data in its dtype: 16-bit
 * arrays as their bytes); with_out: out16 too, which the bf16 kernels'
 * backward reads. */
static uint64_t fingerprint(const mha_attention_args *a, const sdpa_shape *s,
                            int with_out)
{
    const int h = a->dtype != MHA_DTYPE_F32;
    const size_t f = sizeof(float), e = h ? sizeof(uint16_t) : f,
                 i8 = sizeof(int64_t);
    const int rope = a->mods.rope.style != MHA_ROPE_NONE;
    const mha_print_buf bufs[] = {
        {h ? (const void *)a->q16 : (const void *)a->q, (size_t)s->n_q * e},
        {h ? (const void *)a->k16 : (const void *)a->k, (size_t)s->n_kv * e},
        {h ? (const void *)a->v16 : (const void *)a->v, (size_t)s->n_v * e},
        {with_out ? a->out16 : NULL, (size_t)s->n_o * e},
        {a->sinks, (size_t)s->H * f},
        {a->mods.alibi ? a->mods.alibi_slopes : NULL, (size_t)s->H * f},
        {rope ? a->q_positions : NULL, (size_t)(s->B * s->Lq) * i8},
        {rope ? a->k_positions : NULL, (size_t)(s->B * s->Lk) * i8}};
    return mha_inputs_fingerprint(bufs, (int)(sizeof bufs / sizeof *bufs),
                                  &a->attn_mask, &a->key_padding_mask,
                                  a->key_lengths, s->B);
}

static mha_status plan_create16(const mha_attention_args *a,
                                mha_attention_plan **out);

static mha_status mha_attention_plan_create_impl(const mha_attention_args *a,
                                                 mha_attention_plan **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output plan is NULL");
    *out = NULL;
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    if (a->dtype == MHA_DTYPE_BF16 || a->dtype == MHA_DTYPE_F16)
        return plan_create16(a, out);
    if (a->dtype != MHA_DTYPE_F32)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype must be MHA_DTYPE_F32 (0), _F16 (2) or "
                             "_BF16 (3), got %d", (int)a->dtype);
    sdpa_shape s;
    MHA_CHECK(check_shape(a, &s));
    mha_engine eng;
    MHA_CHECK(mha_engine_init(&eng, a->num_threads));
    mha_attn_layout lay;
    MHA_CHECK(mha_attn_layout_forward(&eng, s.B, s.H, s.Hkv, s.Lq, s.Lk,
                                      s.Lk, s.dh, s.dv, a->cache != NULL,
                                      &lay));
    mha_attention_plan *p = calloc(1, sizeof *p);
    if (!p)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate a plan");
    p->ws = mha_alloc_floats(lay.total, "attention workspace");
    p->slopes = mha_alloc_floats(s.H, "ALiBi slopes");
    /* rotated q (RoPE, or a cache's Hadamard rotation: any cache may be
     * a rotated one), and k unless the keys are a cache's */
    const int rope = a->mods.rope.style != MHA_ROPE_NONE || a->cache;
    if (rope)
        p->rot = mha_alloc_floats(s.n_q + (a->cache ? 0 : s.n_kv),
                                  "RoPE's rotated q and k");
    if (!p->ws || !p->slopes || (rope && !p->rot)) {
        free(p->ws);
        free(p->slopes);
        free(p->rot);
        free(p);
        return MHA_ERR_OUT_OF_MEMORY;
    }
    mha_alibi_slopes(s.H, p->slopes);
    p->shape = s;
    p->eng = eng;
    p->lay = lay;
    p->cache_capacity = a->cache ? a->cache->capacity : 0;
    *out = p;
    return MHA_OK;
}

mha_status mha_attention_plan_create_sized(const mha_attention_args *shape,
                                           size_t shape_size,
                                           mha_attention_plan **out)
{
    MHA_STRUCT_IN(mha_attention_args, shape);
    return mha_attention_plan_create_impl(shape ? &shape_ : NULL, out);
}

void mha_attention_plan_free(mha_attention_plan *p)
{
    if (!p)
        return;
    free(p->ws);
    free(p->bws);
    free(p->slopes);
    free(p->dsinks);
    free(p->rot);
    free(p->lse16);
    free(p->wide);
    free(p->wide_g);
    free(p);
}

/* ---- RoPE -------------------------------------------------------------
 * With mods.rope, the attention reads copies of q and k rotated in the
 * plan's buffer (p->rot: q, then k), which the backward reads again; the
 * caller's q and k are never written.  Query row i of sequence b is at
 * q_positions[b][i], else Lk - Lq + i (bottom-right, as the causal mask
 * and ALiBi align), with a cache the sequence's length - Lq + i; key j at
 * k_positions[b][j], else j.  A cache's keys are rotated already. */

/* Refuses a run with RoPE on a plan made without it, and negative
 * positions. */
static mha_status rope_check(const mha_attention_plan *p,
                             const mha_attention_args *a,
                             const sdpa_shape *s)
{
    if (a->mods.rope.style == MHA_ROPE_NONE)
        return MHA_OK;
    if (!p->rot)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "mods.rope is set but this plan was made "
                             "without RoPE (give the plan's shape the same "
                             "mods)");
    MHA_CHECK(mha_rope_check_positions(a->q_positions, s->B * s->Lq,
                                       "q_positions"));
    if (!a->cache)
        MHA_CHECK(mha_rope_check_positions(a->k_positions, s->B * s->Lk,
                                           "k_positions"));
    return MHA_OK;
}

/* Points `at` at q and k rotated (Lk: the run's keys). */
static void rope_rotate(mha_attention_plan *p, const mha_attention_args *a,
                        int64_t Lk, mha_attn *at)
{
    const sdpa_shape *s = &p->shape;
    mha_rope r;
    mha_rope_resolve(&a->mods.rope, s->dh, &r);   /* checked at the run */
    const int nt = p->eng.threads;
    float *q = p->rot;
    memcpy(q, a->q, (size_t)s->n_q * sizeof *q);
    if (a->cache) {
        for (int64_t b = 0; b < s->B; b++)
            mha_rope_rows(&r, 1, s->Lq, s->H, s->dh,
                          a->q_positions ? a->q_positions + b * s->Lq : NULL,
                          NULL, a->cache->len[b] - s->Lq,
                          q + b * s->Lq * s->E, s->E, 0, nt);
        at->q = q;
        return;
    }
    float *k = p->rot + s->n_q;
    memcpy(k, a->k, (size_t)s->n_kv * sizeof *k);
    mha_rope_rows(&r, s->B, s->Lq, s->H, s->dh, a->q_positions, NULL,
                  Lk - s->Lq, q, s->E, 0, nt);
    mha_rope_rows(&r, s->B, Lk, s->Hkv, s->dh, a->k_positions, NULL, 0, k,
                  s->Ekv, 0, nt);
    at->q = q;
    at->k = k;
}

/* dq and dk with respect to the rotated copies, turned back in place. */
static void rope_grads(const mha_attention_plan *p,
                       const mha_attention_args *a,
                       const mha_attention_grads *g)
{
    const sdpa_shape *s = &p->shape;
    mha_rope r;
    mha_rope_resolve(&a->mods.rope, s->dh, &r);
    mha_rope_rows(&r, s->B, s->Lq, s->H, s->dh, a->q_positions, NULL,
                  s->Lk - s->Lq, g->grad_q, s->E, 1, p->eng.threads);
    mha_rope_rows(&r, s->B, s->Lk, s->Hkv, s->dh, a->k_positions, NULL, 0,
                  g->grad_k, s->Ekv, 1, p->eng.threads);
}

/* lse = m + log(l) from the row stats (m, 1/l), in float64. */
static void write_lse(const float *stats, int64_t rows, float *lse)
{
    for (int64_t r = 0; r < rows; r++) {
        const float m = stats[2 * r], inv_l = stats[2 * r + 1];
        lse[r] = m == -INFINITY ? -INFINITY
                                : (float)((double)m - log((double)inv_l));
    }
}

/* Do the run's shapes s fit the plan's ps? */
static mha_status plan_fits(const sdpa_shape *ps, const sdpa_shape *s)
{
    if (s->B != ps->B || s->H != ps->H || s->Hkv != ps->Hkv ||
        s->dh != ps->dh || s->dv != ps->dv || s->Lq != ps->Lq ||
        s->Lk != ps->Lk)
        return mha_set_error(MHA_ERR_SHAPE,
                             "arguments (B=%lld, H=%lld, H_kv=%lld, d_h=%lld, "
                             "d_v=%lld, Lq=%lld, Lk=%lld) do not match the "
                             "plan (B=%lld, H=%lld, H_kv=%lld, d_h=%lld, "
                             "d_v=%lld, Lq=%lld, Lk=%lld)",
                             (long long)s->B, (long long)s->H,
                             (long long)s->Hkv, (long long)s->dh,
                             (long long)s->dv, (long long)s->Lq,
                             (long long)s->Lk, (long long)ps->B,
                             (long long)ps->H, (long long)ps->Hkv,
                             (long long)ps->dh, (long long)ps->dv,
                             (long long)ps->Lq, (long long)ps->Lk);
    return MHA_OK;
}

/* The plan's run; pack_only: K and V packed (and RoPE applied, the
 * arguments kept) for a backward, no output (mha_attention_backward_part). */
/* x16 (MHA_KV_F32 but from attention_widened): q, k, v and out of `a`
 * are that 16-bit type's arrays, cast, which the engine widens per tile
 * (mha_attn.x16); the caller checked their overlaps, in 16-bit units. */
static mha_status plan_run(mha_attention_plan *p, const mha_attention_args *a,
                           int pack_only, mha_kv_dtype x16)
{
    if (!p)
        return mha_set_error(MHA_ERR_NULL_POINTER, "plan is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    p->has_saved = 0;
    sdpa_shape s;
    MHA_CHECK(check_shape(a, &s));
    const sdpa_shape *ps = &p->shape;
    if (!a->cache != !p->cache_capacity)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "this plan was made %s a KV cache",
                             p->cache_capacity ? "for" : "without");
    if (a->cache) {
        MHA_CHECK(mha_kv_cache_check_plan(a->cache, p->cache_capacity));
        s.Lk = ps->Lk;   /* a smaller cache fits the plan's layout */
    }
    MHA_CHECK(plan_fits(ps, &s));
    if (!a->q || (!a->cache && (!a->k || !a->v)) || !a->out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !a->q ? "q" : !a->cache && !a->k ? "k"
                             : !a->cache && !a->v ? "v" : "out");
    mha_attn_request r = request_of(a, &s, p->slopes);
    r.x16 = x16;
    mha_mask_plan mask;
    MHA_CHECK(mha_attn_request_masks(&r, &mask));
    s.Lk = r.Lk;   /* with a cache: its longest sequence now */
    s.n_w = mha_attn_request_weights_floats(&r);
    const span outs[3] = {{"out", a->out, s.n_o},
                          {"attn_weights", r.attn_weights, s.n_w},
                          {"lse", a->lse, s.B * s.H * s.Lq}};
    const span ins[3] = {{"q", a->q, s.n_q}, {"k", a->k, s.n_kv},
                         {"v", a->v, s.n_v}};
    if (x16 == MHA_KV_F32)
        MHA_CHECK(check_disjoint(outs, 3, ins, a->cache ? 1 : 3));
    MHA_CHECK(rope_check(p, a, &s));
    MHA_CHECK(mha_attn_request_prepare(&r, p->eng.uk, p->eng.threads));
    const uint64_t print =
        p->one_shot || a->cache || p->dtype != MHA_DTYPE_F32
            ? 0   /* (a 16-bit plan prints the 16-bit data: plan_run16) */
            : fingerprint(a, &s, 0);
    mha_attn at = mha_attn_request_problem(&r, &mask, p->ws, &p->lay);
    at.pack_only = pack_only;
    if (a->mods.rope.style != MHA_ROPE_NONE)
        rope_rotate(p, a, s.Lk, &at);
    mha_attn_request_run(&p->eng, &r, &at, &mask, p->rot,
                         p->ws + p->lay.scratch, p->lay.per_thread);
    if (a->lse && !pack_only)
        write_lse(at.stats, s.B * s.H * s.Lq, a->lse);
    if (a->cache)
        return MHA_OK;   /* no backward */
    p->saved = *a;
    p->saved_print = print;
    p->has_saved = 1;
    return MHA_OK;
}

static mha_status plan_run16(mha_attention_plan *p,
                             const mha_attention_args *a);

static const char *dtype_name(mha_dtype d)
{
    return d == MHA_DTYPE_F32    ? "MHA_DTYPE_F32"
         : d == MHA_DTYPE_F16    ? "MHA_DTYPE_F16"
         : d == MHA_DTYPE_BF16   ? "MHA_DTYPE_BF16"
                                 : "not an attention dtype";
}

/* A plan runs calls of the dtype it was made for. */
static mha_status same_dtype(const mha_attention_plan *p,
                             const mha_attention_args *a)
{
    if (a->dtype != p->dtype)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "this plan was made for dtype %s; the call has "
                             "dtype %d (%s): make a plan for it",
                             dtype_name(p->dtype), (int)a->dtype,
                             dtype_name(a->dtype));
    return MHA_OK;
}

static mha_status mha_attention_plan_run_impl(mha_attention_plan *p,
                                              const mha_attention_args *a)
{
    if (!p)
        return mha_set_error(MHA_ERR_NULL_POINTER, "plan is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    p->has_saved = 0;
    MHA_CHECK(same_dtype(p, a));
    return p->dtype == MHA_DTYPE_F32 ? plan_run(p, a, 0, MHA_KV_F32)
                                     : plan_run16(p, a);
}

mha_status mha_attention_plan_run_sized(mha_attention_plan *plan,
                                        const mha_attention_args *args,
                                        size_t args_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    return mha_attention_plan_run_impl(plan, args ? &args_ : NULL);
}

static int same_mask(const mha_mask *x, const mha_mask *y)
{
    return x->kind == y->kind &&
           (x->kind == MHA_MASK_NONE || x->data == y->data);
}

/* Is `a` the run whose stats and packed K/V the plan holds (its data,
 * in the plan's dtype, fingerprinted unless the plan is a one-shot's)? */
static mha_status check_saved(const mha_attention_plan *p,
                              const mha_attention_args *a)
{
    if (!p->has_saved)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "no run to differentiate: call "
                             "mha_attention_plan_run on this plan first (a "
                             "failed run leaves nothing either)");
    const mha_attention_args *s = &p->saved;
    if (a->q != s->q || a->k != s->k || a->v != s->v || a->q16 != s->q16 ||
        a->k16 != s->k16 || a->v16 != s->v16 || a->layout != s->layout ||
        !same_mask(&a->attn_mask, &s->attn_mask) ||
        !same_mask(&a->key_padding_mask, &s->key_padding_mask) ||
        a->key_lengths != s->key_lengths || a->causal != s->causal ||
        (a->given & MHA_GIVEN_Q_OFFSET) != (s->given & MHA_GIVEN_Q_OFFSET) ||
        ((a->given & MHA_GIVEN_Q_OFFSET) && a->q_offset != s->q_offset) ||
        resolved_scale(a, p->shape.dh) != resolved_scale(s, p->shape.dh) ||
        (a->training != 0) != (s->training != 0) ||
        a->dropout != s->dropout || a->dropout_seed != s->dropout_seed ||
        a->sinks != s->sinks || !mha_modifiers_same(&a->mods, &s->mods) ||
        a->attention_chunk != s->attention_chunk ||
        (a->mods.rope.style != MHA_ROPE_NONE &&
         (a->q_positions != s->q_positions ||
          a->k_positions != s->k_positions)))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "the arguments differ from those of the plan's "
                             "last run (q, k, v, the layout, masks, "
                             "key_lengths, causal, q_offset, scale, dropout, "
                             "training, dropout_seed, sinks, the modifiers "
                             "and RoPE's positions must be the same)");
    /* (the bf16 kernels' backward reads the run's out16 again) */
    const int with_out = p->dtype != MHA_DTYPE_F32 && p->route == RUN_BF16;
    if (with_out && a->out16 != s->out16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "out16 differs from the plan's last run's: the "
                             "backward of the bf16 kernels reads the "
                             "output the run wrote");
    if (!p->one_shot &&
        fingerprint(a, &p->shape, with_out) != p->saved_print)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "the contents of %s, the masks or key_lengths "
                             "changed since the plan's last run: run it "
                             "again on the new data before its backward",
                             with_out ? "q16, k16, v16, out16" : "q, k, v");
    return MHA_OK;
}

/* The gradient arrays a backward of `a` takes: the four, and dL/d sinks
 * only where `a` has sinks. */
static mha_status grads_check(const mha_attention_args *a,
                              const void *grad_out, const void *grad_q,
                              const void *grad_k, const void *grad_v,
                              const float *grad_sinks)
{
    if (!grad_out || !grad_q || !grad_k || !grad_v)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !grad_out ? "grad_out" : !grad_q ? "grad_q"
                             : !grad_k ? "grad_k" : "grad_v");
    if (grad_sinks && !a->sinks)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "grad_sinks is set but the arguments have no "
                             "sinks");
    return MHA_OK;
}

/* The backward differentiates attention on given k and v (either
 * layout), never on a KV cache. */
static mha_status no_cache_backward(const mha_attention_args *a)
{
    if (a->cache)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "attention on a KV cache has no backward "
                             "(decoding is inference): give k and v, not a "
                             "cache, to differentiate");
    return MHA_OK;
}

/* The plan's backward; row_lse / row_delta ([B][H][Lq], both or
 * neither): a part of a split-key problem (mha_attention_backward_part),
 * whose stats the caller has set to (lse, 1).  x16 as plan_run's: the
 * data and the gradients 16-bit arrays, cast, checked by the caller. */
static mha_status plan_backward(mha_attention_plan *p,
                                const mha_attention_args *a,
                                const mha_attention_grads *g,
                                const float *row_lse,
                                const double *row_delta, mha_kv_dtype x16)
{
    if (!p)
        return mha_set_error(MHA_ERR_NULL_POINTER, "plan is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    if (!g)
        return mha_set_error(MHA_ERR_NULL_POINTER, "gradient args are NULL");
    MHA_CHECK(grads_check(a, g->grad_out, g->grad_q, g->grad_k, g->grad_v,
                          g->grad_sinks));
    const sdpa_shape *s = &p->shape;
    const span outs[3] = {{"grad_q", g->grad_q, s->n_q},
                          {"grad_k", g->grad_k, s->n_kv},
                          {"grad_v", g->grad_v, s->n_v}};
    const span ins[4] = {{"q", a->q, s->n_q}, {"k", a->k, s->n_kv},
                         {"v", a->v, s->n_v},
                         {"grad_out", g->grad_out, s->n_o}};
    if (x16 == MHA_KV_F32)
        MHA_CHECK(check_disjoint(outs, 3, ins, 4));
    if (!p->bws) {
        /* (sized for every modifier: any later run may have one) */
        MHA_CHECK(mha_attn_layout_backward(&p->eng, s->B, s->Hkv, s->Lk,
                                           s->Lk, s->dh, s->dv, 1,
                                           &p->blay));
        p->bws = mha_alloc_floats(p->blay.total, "attention backward "
                                                 "workspace");
        p->dsinks = mha_alloc_floats(s->B * s->H, "sink gradients");
        if (!p->bws || !p->dsinks) {
            free(p->bws);
            free(p->dsinks);
            p->bws = p->dsinks = NULL;
            return MHA_ERR_OUT_OF_MEMORY;
        }
    }
    mha_attn_request r = request_of(a, s, p->slopes);
    r.x16 = x16;
    mha_mask_plan mask;
    MHA_CHECK(mha_attn_request_masks(&r, &mask));
    mha_attn at = mha_attn_request_problem(&r, &mask, p->ws, &p->lay);
    at.weights = MHA_WEIGHTS_NONE;
    at.w = NULL;
    if (a->mods.rope.style != MHA_ROPE_NONE) {   /* the run's rotated q, k */
        at.q = p->rot;
        at.k = p->rot + s->n_q;
    }
    /* each gradient in the layout of its input (dL/d out: out's) */
    const mha_attn_grad ag = {
        .dctx = g->grad_out, .lddc = at.ldc, .dq = g->grad_q,
        .dk = g->grad_k, .dv = g->grad_v, .lddq = at.ldq, .lddk = at.ldk,
        .lddv = at.ldv, .hsdc = at.hsc, .hsdq = at.hsq, .hsdk = at.hsk,
        .hsdv = at.hsv, .bsdc = at.bsc, .bsdq = at.bsq, .bsdk = at.bsk,
        .bsdv = at.bsv, .dsinks = a->sinks ? p->dsinks : NULL,
        .packed = p->bws + p->blay.packed, .row_lse = row_lse,
        .row_delta = row_delta};
    mha_attn_backward(&p->eng, &at, &ag, p->bws + p->blay.scratch,
                      p->blay.per_thread);
    if (a->mods.rope.style != MHA_ROPE_NONE)
        rope_grads(p, a, g);
    /* dL/d sinks[h]: the batch's shares summed in order, in float64. */
    for (int64_t h = 0; a->sinks && g->grad_sinks && h < s->H; h++) {
        double sum = 0.0;
        for (int64_t b = 0; b < s->B; b++)
            sum += p->dsinks[b * s->H + h];
        g->grad_sinks[h] = (float)sum;
    }
    return MHA_OK;
}

/* The checks a plan's backward makes first: its arguments, the plan's
 * kind (is16: the 16-bit backward's) and the run's dtype. */
static mha_status backward_start(const mha_attention_plan *p,
                                 const mha_attention_args *a, const void *g,
                                 int is16)
{
    if (!p)
        return mha_set_error(MHA_ERR_NULL_POINTER, "plan is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    if (!g)
        return mha_set_error(MHA_ERR_NULL_POINTER, "gradient args are NULL");
    if ((p->dtype != MHA_DTYPE_F32) != is16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             is16 ? "this plan is a float32 one: its "
                                    "backward is mha_attention_plan_backward"
                                  : "this plan is a 16-bit one: its "
                                    "backward is "
                                    "mha_attention_plan_backward16");
    return same_dtype(p, a);
}

static mha_status mha_attention_plan_backward_impl(
    mha_attention_plan *p, const mha_attention_args *a,
    const mha_attention_grads *g)
{
    MHA_CHECK(backward_start(p, a, g, 0));
    MHA_CHECK(grads_check(a, g->grad_out, g->grad_q, g->grad_k, g->grad_v,
                          g->grad_sinks));
    MHA_CHECK(no_cache_backward(a));
    MHA_CHECK(check_saved(p, a));
    return plan_backward(p, a, g, NULL, NULL, MHA_KV_F32);
}

mha_status mha_attention_plan_backward_sized(mha_attention_plan *plan,
                                             const mha_attention_args *args,
                                             size_t args_size,
                                             const mha_attention_grads *grads,
                                             size_t grads_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    MHA_STRUCT_IN(mha_attention_grads, grads);
    return mha_attention_plan_backward_impl(plan, args ? &args_ : NULL,
                                            grads ? &grads_ : NULL);
}

/* ---- bf16 and f16 q, k, v, out ------------------------------------------ */

const char *mha_bf16_kernel(void)
{
    mha_isa isa;
    const mha_microkernels *uk;
    if (mha_isa_get(&isa, &uk) != MHA_OK)
        return NULL;
    const int tier = mha_bf16_tier();
    if (tier < 0) {
        mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                      "MHA_BF16=%s: expected amx, avx512bf16, bfdot or float32",
                      getenv("MHA_BF16"));
        return NULL;
    }
    return mha_bf16_tier_name(tier, isa);
}

/* Which bf16 kernel takes call a (shape s): MHA_BF16_AMX or _DOT for
 * bf16, plain or causal with key lengths, no other mask, modifier,
 * weights or dropout, d_h a multiple of 32; MHA_BF16_FLOAT32 (widen) for
 * anything else; -1, the error set, for a bad MHA_BF16. */
static int bf16_takes(const mha_attention_args *a, const sdpa_shape *s)
{
    const char *k = mha_bf16_kernel();
    if (!k)
        return -1;
    const int tier = !strcmp(k, "amx")          ? MHA_BF16_AMX
                   : !strcmp(k, "float32")      ? MHA_BF16_FLOAT32
                                                : MHA_BF16_DOT;
    return tier != MHA_BF16_FLOAT32 && a->dtype == MHA_DTYPE_BF16 &&
           s->dh % 32 == 0 && s->dv == s->dh && a->attn_mask.kind == MHA_MASK_NONE &&
           a->key_padding_mask.kind == MHA_MASK_NONE &&
           a->need_weights == MHA_WEIGHTS_NONE &&
           !(a->training && a->dropout > 0.0f) && !a->sinks &&
           mha_modifiers_none(&a->mods) && !a->attention_chunk &&
           !(a->given & MHA_GIVEN_Q_OFFSET)
               ? tier
               : MHA_BF16_FLOAT32;
}

/* The checks of a 16-bit call: its dtype and pointers, then every shape
 * and option as a float32 call's (check_shape on a copy). */
static mha_status half_shape(const mha_attention_args *a, sdpa_shape *s)
{
    if (a->dtype != MHA_DTYPE_BF16 && a->dtype != MHA_DTYPE_F16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype must be MHA_DTYPE_F32 (0), _F16 (2) or "
                             "_BF16 (3), got %d", (int)a->dtype);
    if (a->q || a->k || a->v || a->out)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype %s takes its data in q16, k16, v16 and "
                             "out16; %s must be NULL",
                             a->dtype == MHA_DTYPE_BF16 ? "BF16" : "F16",
                             a->q ? "q" : a->k ? "k" : a->v ? "v" : "out");
    if (!a->q16 || !a->k16 || !a->v16)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !a->q16 ? "q16" : !a->k16 ? "k16" : "v16");
    mha_attention_args f = *a;
    f.dtype = MHA_DTYPE_F32;
    f.q16 = f.k16 = f.v16 = NULL;
    f.out16 = NULL;
    MHA_CHECK(check_shape(&f, s));
    mha_attn_request r = request_of(&f, s, NULL);
    mha_mask_plan mask;
    return mha_attn_request_masks(&r, &mask);   /* key_lengths' values */
}

/* The problem of a 16-bit call in either layout (element (b, h, i, d) at
 * b bs + h hs + i ld + d). */
static mha_half_problem half_problem(const mha_attention_args *a,
                                     const sdpa_shape *s)
{
    const int hf = a->layout == MHA_LAYOUT_HEADS_FIRST;
    return (mha_half_problem){
        .B = s->B, .H = s->H, .Hkv = s->Hkv, .Lq = s->Lq, .Lk = s->Lk,
        .dh = s->dh, .q = a->q16, .k = a->k16, .v = a->v16, .out = a->out16,
        .ldq = hf ? s->dh : s->E, .ldo = hf ? s->dh : s->E,
        .ldk = hf ? s->dh : s->Ekv, .ldv = hf ? s->dh : s->Ekv,
        .hsq = hf ? s->Lq * s->dh : s->dh, .hso = hf ? s->Lq * s->dh : s->dh,
        .hsk = hf ? s->Lk * s->dh : s->dh, .hsv = hf ? s->Lk * s->dh : s->dh,
        .bsq = s->Lq * s->E, .bso = s->Lq * s->E,
        .bsk = s->Lk * s->Ekv, .bsv = s->Lk * s->Ekv,
        .scale = resolved_scale(a, s->dh), .causal = a->causal,
        .key_lengths = a->key_lengths, .lse = a->lse};
}

/* n elements, 16-bit <-> float32 (to_float: h -> f, else f -> h), each
 * type and direction in its own loop (so that the compiler vectorises
 * it), on no thread team (the callers share the work out). */
static void row16(uint16_t *h, float *f, int64_t n, int bf, int to_float)
{
    if (to_float && bf)
        for (int64_t i = 0; i < n; i++)
            f[i] = mha_bf16_to_float(h[i]);
    else if (to_float)
        for (int64_t i = 0; i < n; i++)
            f[i] = mha_f16_to_float(h[i]);
    else if (bf)
        for (int64_t i = 0; i < n; i++)
            h[i] = mha_bf16_from_float(f[i]);
    else
        for (int64_t i = 0; i < n; i++)
            h[i] = mha_f16_from_float(f[i]);
}

/* The same over a whole array in blocks of 64 Ki elements on `threads`
 * threads: the bits do not depend on how many. */
enum { CONVERT_BLOCK = 1 << 16 };

static void convert16(uint16_t *h, float *f, int64_t n, int bf, int to_float,
                      int threads)
{
    const int64_t blocks = (n + CONVERT_BLOCK - 1) / CONVERT_BLOCK;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (blocks > 1)
    for (int64_t c = 0; c < blocks; c++) {
        const int64_t i0 = c * CONVERT_BLOCK,
                      i1 = i0 + CONVERT_BLOCK < n ? i0 + CONVERT_BLOCK : n;
        row16(h + i0, f + i0, i1 - i0, bf, to_float);
    }
}

static void widen_t(const uint16_t *x, int64_t n, int bf, float *y,
                    int threads)
{
    convert16((uint16_t *)x, y, n, bf, 1, threads);   /* (x only read) */
}

static void narrow_t(const float *x, int64_t n, int bf, uint16_t *y,
                     int threads)
{
    convert16(y, (float *)x, n, bf, 0, threads);      /* (x only read) */
}

/* The float32 arguments of 16-bit call `a` for the engine widening per
 * tile: q, k, v and out (out16) its 16-bit arrays, cast, never read as
 * float; returns their type (mha_attn.x16). */
static mha_kv_dtype cast_args(const mha_attention_args *a, uint16_t *out16,
                              mha_attention_args *f)
{
    *f = *a;
    f->dtype = MHA_DTYPE_F32;
    f->q16 = f->k16 = f->v16 = NULL;
    f->out16 = NULL;
    f->q = (const float *)(const void *)a->q16;
    f->k = (const float *)(const void *)a->k16;
    f->v = (const float *)(const void *)a->v16;
    f->out = (float *)(void *)out16;
    return a->dtype == MHA_DTYPE_BF16 ? MHA_KV_BF16 : MHA_KV_F16;
}

/* The checks of a 16-bit run: half_shape's, then out16, the weights'
 * buffer and the overlaps (16-bit arrays as spans of floats: overlaps()
 * counts floats). */
static mha_status half_run_checks(const mha_attention_args *a, sdpa_shape *s)
{
    MHA_CHECK(half_shape(a, s));
    if (!a->out16)
        return mha_set_error(MHA_ERR_NULL_POINTER, "out16 is NULL");
    if (a->need_weights != MHA_WEIGHTS_NONE && !a->attn_weights)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "need_weights is set but attn_weights is NULL");
    const float *w = a->need_weights != MHA_WEIGHTS_NONE ? a->attn_weights
                                                         : NULL;
    const span outs[3] = {{"out16", a->out16, (s->n_o + 1) / 2},
                          {"attn_weights", w, s->n_w},
                          {"lse", a->lse, s->B * s->H * s->Lq}};
    const span ins[3] = {{"q16", a->q16, (s->n_q + 1) / 2},
                         {"k16", a->k16, (s->n_kv + 1) / 2},
                         {"v16", a->v16, (s->n_v + 1) / 2}};
    return check_disjoint(outs, 3, ins, 3);
}

/* ---- 16-bit plans -------------------------------------------------------
 * A plan made with dtype BF16 or F16 runs calls of that dtype (and
 * mha_attention's 16-bit calls are one-shot plans), each on one of three
 * routes, chosen by the call's options; a run's backward takes its run's:
 *   RUN_BF16   bf16 on the CPU's bf16 kernels (bf16_takes): the plan
 *              keeps the rows' lse, the backward reads out16 again
 *   RUN_TILES  the float32 engine on the 16-bit arrays where they lie,
 *              each element widened where the float path loads or packs
 *              it, each result rounded (to nearest even) where it is
 *              stored (mha_attn.x16): RUN_WIDE's bits without its copies
 *              (their 4-byte arrays cost a fifth of a B 8 L 512 call)
 *   RUN_WIDE   RoPE (which rotates float copies of q and k) or the ref
 *              tier: q, k, v widened into the plan's float copies, the
 *              float32 plan on them, out and the gradients narrowed
 * Either float32 route keeps K, V packed and the row statistics, so a
 * backward never computes the forward again. */
static mha_status plan_create16(const mha_attention_args *a,
                                mha_attention_plan **out)
{
    if (a->q || a->k || a->v || a->out)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype %s takes its data in q16, k16, v16 and "
                             "out16; %s must be NULL",
                             a->dtype == MHA_DTYPE_BF16 ? "BF16" : "F16",
                             a->q ? "q" : a->k ? "k" : a->v ? "v" : "out");
    mha_attention_args f = *a;
    f.dtype = MHA_DTYPE_F32;
    f.q16 = f.k16 = f.v16 = NULL;
    f.out16 = NULL;
    MHA_CHECK(mha_attention_plan_create_impl(&f, out));
    mha_attention_plan *p = *out;
    const sdpa_shape *s = &p->shape;
    p->dtype = a->dtype;
    int ok = 1;
    if (a->dtype == MHA_DTYPE_BF16 && !a->cache)   /* (decoding: float32) */
        ok = (p->lse16 = mha_alloc_floats(s->B * s->H * s->Lq,
                                          "the bf16 kernels' lse")) != NULL;
    if (ok && a->cache)   /* decoding: the queries and out widened */
        ok = (p->wide = mha_alloc_floats(s->n_q + s->n_o,
                                         "widened queries and out")) != NULL;
    else if (ok && (p->rot || p->eng.isa == MHA_ISA_REF))
        ok = (p->wide = mha_alloc_floats(s->n_q + s->n_kv + s->n_v + s->n_o,
                                         "widened q, k, v and out")) != NULL;
    if (!ok) {
        mha_attention_plan_free(p);
        *out = NULL;
        return MHA_ERR_OUT_OF_MEMORY;
    }
    return MHA_OK;
}

/* The route of run `a` (shapes s) on 16-bit plan p; *amx: RUN_BF16 on
 * AMX tiles. */
static mha_status route_of(const mha_attention_plan *p,
                           const mha_attention_args *a, const sdpa_shape *s,
                           run_route *route, int *amx)
{
    const int tier = bf16_takes(a, s);
    if (tier < 0)
        return MHA_ERR_INVALID_ARGUMENT;   /* (the message is set) */
    *amx = tier == MHA_BF16_AMX;
    /* (the bf16 kernels count rows in 32 bits) */
    *route = tier != MHA_BF16_FLOAT32 && s->Lq <= INT32_MAX - 64 &&
                     s->Lk <= INT32_MAX - 64
                 ? RUN_BF16
             : p->wide ? RUN_WIDE
                       : RUN_TILES;
    return MHA_OK;
}

/* RUN_WIDE: *f, the float32 arguments of `a` on the plan's copies
 * (widen: q, k and v widened into them first; out is the copy the run
 * writes and narrows). */
static void wide_args(mha_attention_plan *p, const mha_attention_args *a,
                      int widen, mha_attention_args *f)
{
    const sdpa_shape *s = &p->shape;
    float *q = p->wide, *k = q + s->n_q, *v = k + s->n_kv, *o = v + s->n_v;
    if (widen) {
        const int bf = a->dtype == MHA_DTYPE_BF16, nt = p->eng.threads;
        widen_t(a->q16, s->n_q, bf, q, nt);
        widen_t(a->k16, s->n_kv, bf, k, nt);
        widen_t(a->v16, s->n_v, bf, v, nt);
    }
    *f = *a;
    f->dtype = MHA_DTYPE_F32;
    f->q16 = f->k16 = f->v16 = NULL;
    f->out16 = NULL;
    f->q = q, f->k = k, f->v = v, f->out = o;
}

/*
 * 16-bit queries against a KV cache (decoding; a 16-bit plan made with a
 * cache): the cache's keys and values are read where they are, in its
 * storage type, by the float32 decode kernels; the queries (B x q_len
 * rows, a step's new tokens) are widened into the plan's float copy and
 * the context rounded into out16 (which may be q16 itself).
 */
static mha_status decode_run16(mha_attention_plan *p,
                               const mha_attention_args *a)
{
    if (a->q || a->k || a->v || a->out || a->k16 || a->v16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "16-bit queries against a KV cache take q16 "
                             "and out16 only (the keys are the cache's): "
                             "%s must be NULL",
                             a->q ? "q" : a->k ? "k" : a->v ? "v"
                             : a->out ? "out" : a->k16 ? "k16" : "v16");
    if (!a->q16 || !a->out16)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !a->q16 ? "q16" : "out16");
    mha_attention_args f = *a;
    f.dtype = MHA_DTYPE_F32;
    f.q16 = NULL;
    f.out16 = NULL;
    sdpa_shape s;
    MHA_CHECK(check_shape(&f, &s));
    s.Lk = p->shape.Lk;   /* (plan_run: a smaller cache fits the plan) */
    MHA_CHECK(plan_fits(&p->shape, &s));
    if ((const void *)a->out16 < (const void *)(a->q16 + s.n_q) &&
        (const void *)a->q16 < (const void *)(a->out16 + s.n_o) &&
        a->out16 != a->q16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "out16 overlaps q16 without being it");
    const int bf = a->dtype == MHA_DTYPE_BF16, nt = p->eng.threads;
    f.q = p->wide;
    f.out = p->wide + s.n_q;
    widen_t(a->q16, s.n_q, bf, p->wide, nt);
    MHA_CHECK(plan_run(p, &f, 0, MHA_KV_F32));
    narrow_t(f.out, s.n_o, bf, a->out16, nt);
    return MHA_OK;
}

static mha_status plan_run16(mha_attention_plan *p,
                             const mha_attention_args *a)
{
    if (!a->cache != !p->cache_capacity)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "this plan was made %s a KV cache",
                             p->cache_capacity ? "for" : "without");
    if (p->cache_capacity)
        return decode_run16(p, a);
    sdpa_shape s;
    MHA_CHECK(half_run_checks(a, &s));
    MHA_CHECK(plan_fits(&p->shape, &s));
    run_route route;
    int amx;
    MHA_CHECK(route_of(p, a, &s, &route, &amx));
    mha_attention_args f;
    mha_status st;
    if (route == RUN_BF16) {
        /* (mha_attn_bf16 refuses scores that could overflow float32, as
         * plan_run does, before it writes anything) */
        mha_half_problem hp = half_problem(a, &s);
        hp.tiles = amx;
        hp.lse = p->lse16;
        st = mha_attn_bf16(&p->eng, &hp);
        if (st == MHA_OK && a->lse)
            memcpy(a->lse, p->lse16,
                   (size_t)(s.B * s.H * s.Lq) * sizeof *a->lse);
    } else if (route == RUN_TILES) {
        const mha_kv_dtype x16 = cast_args(a, a->out16, &f);
        st = plan_run(p, &f, 0, x16);
    } else {
        wide_args(p, a, 1, &f);
        st = plan_run(p, &f, 0, MHA_KV_F32);
        if (st == MHA_OK)
            narrow_t(f.out, s.n_o, a->dtype == MHA_DTYPE_BF16, a->out16,
                     p->eng.threads);
    }
    p->has_saved = 0;
    if (st != MHA_OK)
        return st;
    p->saved = *a;
    p->route = route;
    p->amx = amx;
    p->saved_print = p->one_shot ? 0 : fingerprint(a, &s, route == RUN_BF16);
    p->has_saved = 1;
    return MHA_OK;
}

/* The bf16 kernels' backward of call a (shapes s; amx: on AMX tiles)
 * from its forward's out16 and lse. */
static mha_status bf16_backward(const mha_engine *e,
                                const mha_attention_args *a,
                                const sdpa_shape *s, int amx, float *lse,
                                const mha_attention_grads16 *g)
{
    mha_half_problem hp = half_problem(a, s);
    hp.tiles = amx;
    hp.lse = lse;
    hp.dout = g->grad_out;
    hp.dq = g->grad_q;
    hp.dk = g->grad_k;
    hp.dv = g->grad_v;
    return mha_attn_bf16_backward(e, &hp);
}

/* The backward of a 16-bit plan's last run, on its route (checked by
 * the caller: the same arguments, the gradients given). */
static mha_status plan_backward16(mha_attention_plan *p,
                                  const mha_attention_args *a,
                                  const mha_attention_grads16 *g)
{
    const sdpa_shape *s = &p->shape;
    const int bf = a->dtype == MHA_DTYPE_BF16;
    const span outs[4] = {{"grad_q", g->grad_q, (s->n_q + 1) / 2},
                          {"grad_k", g->grad_k, (s->n_kv + 1) / 2},
                          {"grad_v", g->grad_v, (s->n_v + 1) / 2},
                          {"grad_sinks", g->grad_sinks, s->H}};
    const span ins[5] = {
        {"q16", a->q16, (s->n_q + 1) / 2},
        {"k16", a->k16, (s->n_kv + 1) / 2},
        {"v16", a->v16, (s->n_v + 1) / 2},
        {"grad_out", g->grad_out, (s->n_o + 1) / 2},
        {"out16", p->route == RUN_BF16 ? a->out16 : NULL, (s->n_o + 1) / 2}};
    MHA_CHECK(check_disjoint(outs, 4, ins, 5));
    if (p->route == RUN_BF16)
        return bf16_backward(&p->eng, a, s, p->amx, p->lse16, g);
    mha_attention_args f;
    if (p->route == RUN_TILES) {
        const mha_kv_dtype x16 = cast_args(a, a->out16, &f);
        const mha_attention_grads fg = {
            .grad_out = (const float *)(const void *)g->grad_out,
            .grad_q = (float *)(void *)g->grad_q,
            .grad_k = (float *)(void *)g->grad_k,
            .grad_v = (float *)(void *)g->grad_v,
            .grad_sinks = g->grad_sinks};
        return plan_backward(p, &f, &fg, NULL, NULL, x16);
    }
    if (!p->wide_g) {
        p->wide_g = mha_alloc_floats(s->n_o + s->n_q + s->n_kv + s->n_v,
                                     "widened dL/d out and gradients");
        if (!p->wide_g)
            return MHA_ERR_OUT_OF_MEMORY;
    }
    float *go = p->wide_g, *gq = go + s->n_o, *gk = gq + s->n_q,
          *gv = gk + s->n_kv;
    const int nt = p->eng.threads;
    widen_t(g->grad_out, s->n_o, bf, go, nt);
    wide_args(p, a, 0, &f);
    const mha_attention_grads fg = {.grad_out = go, .grad_q = gq,
                                    .grad_k = gk, .grad_v = gv,
                                    .grad_sinks = g->grad_sinks};
    MHA_CHECK(plan_backward(p, &f, &fg, NULL, NULL, MHA_KV_F32));
    narrow_t(gq, s->n_q, bf, g->grad_q, nt);
    narrow_t(gk, s->n_kv, bf, g->grad_k, nt);
    narrow_t(gv, s->n_v, bf, g->grad_v, nt);
    return MHA_OK;
}

static mha_status mha_attention_plan_backward16_impl(
    mha_attention_plan *p, const mha_attention_args *a,
    const mha_attention_grads16 *g)
{
    MHA_CHECK(backward_start(p, a, g, 1));
    MHA_CHECK(grads_check(a, g->grad_out, g->grad_q, g->grad_k, g->grad_v,
                          g->grad_sinks));
    MHA_CHECK(no_cache_backward(a));
    MHA_CHECK(check_saved(p, a));
    return plan_backward16(p, a, g);
}

mha_status mha_attention_plan_backward16_sized(
    mha_attention_plan *plan, const mha_attention_args *args,
    size_t args_size, const mha_attention_grads16 *grads, size_t grads_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    MHA_STRUCT_IN(mha_attention_grads16, grads);
    return mha_attention_plan_backward16_impl(plan, args ? &args_ : NULL,
                                              grads ? &grads_ : NULL);
}

/* mha_attention on 16-bit data: a one-shot plan. */
static mha_status attention_half(const mha_attention_args *a)
{
    mha_attention_plan *p;
    MHA_CHECK(mha_attention_plan_create_impl(a, &p));
    p->one_shot = 1;
    const mha_status st = plan_run16(p, a);
    mha_attention_plan_free(p);
    return st;
}

/* The backward on 16-bit data: a one-shot plan's run (the forward again,
 * its out in a scratch array) and backward; on the bf16 kernels with
 * args.out16 and args.lse given (the forward's), those instead.  (The
 * float32 routes always compute the forward again, so that their bits do
 * not depend on what is given.) */
static mha_status attention_half_backward(const mha_attention_args *a,
                                          const mha_attention_grads16 *g)
{
    MHA_CHECK(grads_check(a, g->grad_out, g->grad_q, g->grad_k, g->grad_v,
                          g->grad_sinks));
    MHA_CHECK(no_cache_backward(a));
    mha_attention_args f = *a;
    f.need_weights = MHA_WEIGHTS_NONE;
    f.attn_weights = NULL;
    f.lse = NULL;
    sdpa_shape s;
    MHA_CHECK(half_shape(&f, &s));
    const int given = a->out16 && a->lse;   /* the forward's, to reuse */
    const span outs[4] = {{"grad_q", g->grad_q, (s.n_q + 1) / 2},
                          {"grad_k", g->grad_k, (s.n_kv + 1) / 2},
                          {"grad_v", g->grad_v, (s.n_v + 1) / 2},
                          {"grad_sinks", g->grad_sinks, s.H}};
    const span ins[6] = {{"q16", a->q16, (s.n_q + 1) / 2},
                         {"k16", a->k16, (s.n_kv + 1) / 2},
                         {"v16", a->v16, (s.n_v + 1) / 2},
                         {"grad_out", g->grad_out, (s.n_o + 1) / 2},
                         {"out16", given ? a->out16 : NULL, (s.n_o + 1) / 2},
                         {"lse", given ? a->lse : NULL, s.B * s.H * s.Lq}};
    MHA_CHECK(check_disjoint(outs, 4, ins, 6));
    mha_attention_plan *p;
    MHA_CHECK(mha_attention_plan_create_impl(&f, &p));
    p->one_shot = 1;
    run_route route;
    int amx;
    mha_status st = route_of(p, &f, &s, &route, &amx);
    uint16_t *out = NULL;
    if (st == MHA_OK && route == RUN_BF16 && given) {
        st = bf16_backward(&p->eng, a, &s, amx, a->lse, g);
    } else if (st == MHA_OK) {
        out = malloc((size_t)s.n_o * sizeof *out);
        st = out ? MHA_OK
                 : mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                 "cannot allocate the forward's output");
        f.out16 = out;
        if (st == MHA_OK)
            st = plan_run16(p, &f);
        if (st == MHA_OK)
            st = plan_backward16(p, &f, g);
    }
    free(out);
    mha_attention_plan_free(p);
    return st;
}

static mha_status mha_attention_backward16_impl(const mha_attention_args *a,
                                                const mha_attention_grads16 *g)
{
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    if (!g)
        return mha_set_error(MHA_ERR_NULL_POINTER, "gradient args are NULL");
    if (a->dtype == MHA_DTYPE_F32)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "args.dtype is MHA_DTYPE_F32: its backward is "
                             "mha_attention_backward");
    return attention_half_backward(a, g);
}

mha_status mha_attention_backward16_sized(const mha_attention_args *args,
                                          size_t args_size,
                                          const mha_attention_grads16 *grads,
                                          size_t grads_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    MHA_STRUCT_IN(mha_attention_grads16, grads);
    return mha_attention_backward16_impl(args ? &args_ : NULL,
                                         grads ? &grads_ : NULL);
}

static mha_status mha_attention_impl(const mha_attention_args *a)
{
    if (a && a->dtype != MHA_DTYPE_F32)
        return attention_half(a);
    mha_attention_plan *p;
    MHA_CHECK(mha_attention_plan_create(a, &p));
    p->one_shot = 1;
    const mha_status st = mha_attention_plan_run(p, a);
    mha_attention_plan_free(p);
    return st;
}

mha_status mha_attention_sized(const mha_attention_args *args,
                               size_t args_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    return mha_attention_impl(args ? &args_ : NULL);
}

static mha_status mha_attention_backward_impl(const mha_attention_args *a,
                                              const mha_attention_grads *g)
{
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    if (!g)
        return mha_set_error(MHA_ERR_NULL_POINTER, "gradient args are NULL");
    if (a->dtype != MHA_DTYPE_F32)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "args.dtype is %d: the backward of 16-bit data "
                             "is mha_attention_backward16", (int)a->dtype);
    MHA_CHECK(no_cache_backward(a));
    mha_attention_args f = *a;
    f.need_weights = MHA_WEIGHTS_NONE;
    f.attn_weights = NULL;
    f.num_threads = a->num_threads;
    mha_attention_plan *p;
    MHA_CHECK(mha_attention_plan_create(&f, &p));
    f.out = mha_alloc_floats(p->shape.n_o, "forward output");
    mha_status st = f.out ? MHA_OK : MHA_ERR_OUT_OF_MEMORY;
    if (st == MHA_OK)
        st = mha_attention_plan_run(p, &f);
    if (st == MHA_OK)
        st = mha_attention_plan_backward(p, &f, g);
    free(f.out);
    mha_attention_plan_free(p);
    return st;
}

mha_status mha_attention_backward_sized(const mha_attention_args *args,
                                        size_t args_size,
                                        const mha_attention_grads *grads,
                                        size_t grads_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    MHA_STRUCT_IN(mha_attention_grads, grads);
    return mha_attention_backward_impl(args ? &args_ : NULL,
                                       grads ? &grads_ : NULL);
}

/*
 * One part of a split-key problem: the plan runs with pack_only (K and V
 * packed as a forward packs them, RoPE applied; no attention computed),
 * its row stats are set to (global lse, 1), so P = exp(s - lse) is the
 * global probability, and delta = dO . out (the merged output) is the
 * whole row's, in float64 in the order of d.
 */
static mha_status mha_attention_backward_part_impl(
    const mha_attention_args *a, const float *lse, const float *out,
    const mha_attention_grads *g)
{
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "attention args are NULL");
    if (!g)
        return mha_set_error(MHA_ERR_NULL_POINTER, "gradient args are NULL");
    if (!lse || !out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !lse ? "lse (the rows' log-sum-exp over all "
                                    "parts)"
                                  : "out (the output merged over all parts)");
    if (!g->grad_out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "grad_out is NULL");
    MHA_CHECK(no_cache_backward(a));
    if (a->layout != MHA_LAYOUT_ROWS)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "a part's backward takes q, k, v, out and the "
                             "gradients in rows (MHA_LAYOUT_ROWS), got "
                             "layout %d", (int)a->layout);
    if (a->sinks || g->grad_sinks)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "a part's backward takes no sinks (a sink "
                             "belongs to no part of the keys)");
    mha_attention_args f = *a;
    f.need_weights = MHA_WEIGHTS_NONE;
    f.attn_weights = NULL;
    f.lse = NULL;
    mha_attention_plan *p;
    MHA_CHECK(mha_attention_plan_create(&f, &p));
    const sdpa_shape *s = &p->shape;
    const int64_t rows = s->B * s->H * s->Lq;
    for (int64_t r = 0; r < rows; r++)
        if (lse[r] != lse[r] || lse[r] == INFINITY) {
            mha_attention_plan_free(p);
            return mha_set_error(MHA_ERR_NON_FINITE,
                                 "lse[%lld] is %s: a row's log-sum-exp must "
                                 "be finite or -inf (no key)",
                                 (long long)r, lse[r] != lse[r] ? "NaN"
                                                                : "+inf");
        }
    f.out = mha_alloc_floats(s->n_o, "the part's forward output");
    double *delta = malloc((size_t)rows * sizeof *delta);
    mha_status st = MHA_OK;
    if (!f.out || !delta)
        st = mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                           "out of memory for a part's backward (%lld "
                           "floats)", (long long)(s->n_o + 2 * rows));
    if (st == MHA_OK) {
        const span outs[3] = {{"grad_q", g->grad_q, s->n_q},
                              {"grad_k", g->grad_k, s->n_kv},
                              {"grad_v", g->grad_v, s->n_v}};
        const span ins[2] = {{"lse", lse, rows}, {"out", out, s->n_o}};
        st = check_disjoint(outs, 3, ins, 2);
    }
    if (st == MHA_OK)
        st = plan_run(p, &f, 1, MHA_KV_F32);   /* K and V packed, no forward */
    if (st == MHA_OK) {
        float *stats = p->ws + p->lay.stats;
        for (int64_t b = 0; b < s->B; b++)
            for (int64_t h = 0; h < s->H; h++)
                for (int64_t i = 0; i < s->Lq; i++) {
                    const int64_t r = (b * s->H + h) * s->Lq + i;
                    const float *o = out + (b * s->Lq + i) * s->Ev +
                                     h * s->dv;
                    const float *d = g->grad_out + (b * s->Lq + i) * s->Ev +
                                     h * s->dv;
                    double sum = 0.0;
                    for (int64_t x = 0; x < s->dv; x++)
                        sum += (double)d[x] * o[x];
                    delta[r] = sum;
                    stats[2 * r] = lse[r];
                    stats[2 * r + 1] = lse[r] == -INFINITY ? 0.0f : 1.0f;
                }
        st = plan_backward(p, &f, g, lse, delta, MHA_KV_F32);
    }
    free(delta);
    free(f.out);
    mha_attention_plan_free(p);
    return st;
}

mha_status mha_attention_backward_part_sized(const mha_attention_args *args,
                                             size_t args_size,
                                             const float *lse,
                                             const float *out,
                                             const mha_attention_grads *grads,
                                             size_t grads_size)
{
    MHA_STRUCT_IN(mha_attention_args, args);
    MHA_STRUCT_IN(mha_attention_grads, grads);
    return mha_attention_backward_part_impl(args ? &args_ : NULL, lse, out,
                                            grads ? &grads_ : NULL);
}

/* ---- merging partial results ---------------------------------------------- */

mha_status mha_attention_merge(const mha_attention_part *parts, int n_parts,
                               int64_t B, int64_t H, int64_t dh, int64_t Lq,
                               float *out, float *lse)
{
    if (!parts || !out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !parts ? "parts" : "out");
    if (n_parts < 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "n_parts must be >= 1, got %d", n_parts);
    if (B < 1 || H < 1 || dh < 1 || Lq < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "batch, num_heads, head_dim and q_len must be "
                             ">= 1, got %lld, %lld, %lld, %lld", (long long)B,
                             (long long)H, (long long)dh, (long long)Lq);
    int64_t E, rows, n_out;
    if (!mha_mul_ok(H, dh, &E) || !mha_mul_ok(B, Lq, &rows) ||
        !mha_mul_ok(rows, E, &n_out) || !mha_mul_ok(rows, H, &rows) ||
        n_out > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW, "merge sizes overflow");
    for (int p = 0; p < n_parts; p++) {
        if (!parts[p].out || !parts[p].lse)
            return mha_set_error(MHA_ERR_NULL_POINTER,
                                 "parts[%d].%s is NULL", p,
                                 !parts[p].out ? "out" : "lse");
        /* In place means exactly one part's buffer, element for element. */
        if (parts[p].out != out && overlaps(out, n_out, parts[p].out, n_out))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "out overlaps parts[%d].out without being "
                                 "it", p);
        if (lse && parts[p].lse != lse &&
            overlaps(lse, rows, parts[p].lse, rows))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "lse overlaps parts[%d].lse without being "
                                 "it", p);
        if (overlaps(out, n_out, parts[p].lse, rows) ||
            (lse && overlaps(lse, rows, parts[p].out, n_out)))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "an output overlaps parts[%d]'s other "
                                 "buffer", p);
    }
    if (lse && overlaps(out, n_out, lse, rows))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT, "out overlaps lse");

    /* Row (b, h, i) of the lse is d_h entries of row (b, i) of out. */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Lq; i++) {
                const int64_t r = (b * H + h) * Lq + i;
                const int64_t o = (b * Lq + i) * E + h * dh;
                double mx = -INFINITY;
                int nan = 0;
                for (int p = 0; p < n_parts; p++) {
                    const double x = parts[p].lse[r];
                    nan |= x != x;
                    mx = x > mx ? x : mx;
                }
                double sum = 0.0;
                if (!nan && mx != -INFINITY)
                    for (int p = 0; p < n_parts; p++)
                        sum += exp((double)parts[p].lse[r] - mx);
                /* Every part read at d before out[o + d] is written: in
                 * place is safe element by element. */
                for (int64_t d = 0; d < dh; d++) {
                    double acc = 0.0;
                    if (nan) {
                        acc = NAN;
                    } else if (mx != -INFINITY) {
                        for (int p = 0; p < n_parts; p++) {
                            const double w =
                                exp((double)parts[p].lse[r] - mx) / sum;
                            if (w != 0.0)
                                acc += w * parts[p].out[o + d];
                        }
                    }
                    out[o + d] = (float)acc;
                }
                if (lse)
                    lse[r] = nan ? NAN
                           : mx == -INFINITY ? -INFINITY
                                             : (float)(mx + log(sum));
            }
    return MHA_OK;
}

