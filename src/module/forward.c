/*
 * forward.c -- projections -> attention -> output projection.
 *
 * Data flow, with B = batch, Lq / Lk query / key lengths, E = embed_dim,
 * H heads of width d_h side by side in D = H * d_h columns (D = E unless
 * the module was pruned):
 *
 *   query (B,Lq,E)    -- W_q -->  q (B*Lq rows of D, row stride ldq)
 *   key   (B,Lk,kdim) -- W_k -->  k (B*Lk rows of Dkv, row stride ldk)
 *   value (B,Lk,vdim) -- W_v -->  v (B*Lk rows of Dvkv, row stride ldv)
 *       (Dkv = H_kv * d_h: D, or less under grouped-query attention;
 *        the values' heads may be d_v wide: Dvkv = H_kv * d_v, MLA's 128
 *        beside keys of 192)
 *       (RoPE: q and k rotated in place here, rope_qk below)
 *       (self-attention with one packed in_proj_weight: one GEMM writes
 *        q | k | v side by side, ldq = ldk = ldv = 3D; key == value: one
 *        GEMM writes k | v)
 *   attention (attention.c): ctx[b,i, h*d_v ..] = softmax(q k^T s + mask) v
 *   ctx (B*Lq, Dv)    -- W_o -->  out (B, Lq, E)      (Dv = H * d_v)
 *       (under a head mask, head h's columns of ctx scaled by m_h: one
 *        GEMM per head, none for a head of mask 0)
 *
 * Planning is apart from running: mha_plan_create checks the shapes and
 * sizes one workspace; mha_plan_forward checks the data and runs without
 * allocating.  mha_forward is the two in one call.
 */
#include "module.h"
#include "attention/rope.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>


/* A forward with a KV cache is incremental self-attention: what it
 * leaves unset, and the cache's shape.  Its masks, key lengths and
 * weights are for Lk keys, the longest sequence once the new tokens are
 * in, which only the run knows (mha_kv_cache_keys). */
static mha_status check_cache_args(const mha_module *m,
                                   const mha_forward_args *a)
{
    const mha_kv_cache *kv = a->cache;
    const char *bad = mha_fwd_key(a) ? "key" : mha_fwd_value(a) ? "value"
                    : a->training ? "training" : NULL;
    if (bad)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "with a KV cache, %s must be unset: the keys "
                             "are the cache's and the new tokens', masked "
                             "causally per sequence", bad);
    MHA_CHECK(mha_module_check_self_attention(m));
    if (kv->latent)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "the cache is latent (MLA's compressed rows, "
                             "each value a prefix of its key): a module "
                             "caches its own keys and values apart; decode "
                             "a latent cache with mha_attention");
    /* The masks and weights of a run span up to the capacity's keys. */
    const int64_t Lt = mha_total_keys(m, kv->capacity);
    int64_t w;
    if (!mha_mul_ok(a->batch, m->cfg.num_heads, &w) ||
        !mha_mul_ok(w, a->q_len, &w) || !mha_mul_ok(w, Lt, &w) ||
        w > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "batch %lld x q_len %lld x %lld keys (the "
                             "cache's capacity) overflow",
                             (long long)a->batch, (long long)a->q_len,
                             (long long)Lt);
    return MHA_OK;
}

/* A slice of the query rows (q_start, q_total): where it lies, and what it
 * cannot be combined with. */
static mha_status check_slice(const mha_forward_args *a)
{
    if (a->q_total < 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "q_start is %lld but q_total is %lld: a slice "
                             "of the query rows needs q_total >= 1 (0: no "
                             "slice, and then q_start must be 0)",
                             (long long)a->q_start, (long long)a->q_total);
    if (a->q_total > MHA_MAX_POSITION_SHIFT)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "q_total %lld is over 2^61: positions that far "
                             "apart overflow 64-bit position arithmetic",
                             (long long)a->q_total);
    if (a->q_start < 0 || a->q_start > a->q_total - a->q_len)
        return mha_set_error(MHA_ERR_SHAPE,
                             "the slice's rows q_start=%lld .. +q_len=%lld "
                             "are not within the q_total=%lld rows of the "
                             "problem", (long long)a->q_start,
                             (long long)a->q_len, (long long)a->q_total);
    if (a->cache)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a slice of the query rows (q_total) is not "
                             "taken with a KV cache: its queries sit at "
                             "each sequence's end");
    if (!mha_fwd_key(a) || a->kv_len < 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a slice of the query rows (q_total) needs the "
                             "key given, with kv_len >= 1: the slice's rows "
                             "are not the problem's keys");
    return MHA_OK;
}

/* The attention `a` asks of the engine on the module's heads, shapes s;
 * the run points it at the projections (mha_fwd_request). */
static mha_attn_request fwd_request(const mha_module *m, const fwd_shape *s,
                                    const mha_forward_args *a)
{
    const mha_config *c = &m->cfg;
    const mha_attn_request r = {
        .B = s->B, .H = s->H, .Hkv = s->Hkv, .dh = s->dh, .dv = s->dv,
        .Lq = s->Lq, .Lk = s->Lk, .kv_len = a->kv_len, .ldo = s->Dv,
        .bias_k = m->bias_k, .bias_v = m->bias_v,
        .zero_attn = c->add_zero_attn, .scale = c->scale, .mods = &c->mods,
        .slopes = m->slopes, .sinks = m->sinks,
        .chunk = c->attention_chunk, .attn_mask = a->attn_mask,
        .key_padding_mask = a->key_padding_mask,
        .key_lengths = a->key_lengths, .causal = a->causal,
        .q_start = a->q_start, .q_total = a->q_total,
        .dropout = a->training && c->dropout > 0.0f, .p_drop = c->dropout,
        .seed = a->dropout_seed, .need_weights = a->need_weights,
        .attn_weights = a->attn_weights,
        .cache = a->cache, .append = a->cache ? s->Lq : 0, .q_growth = 1.0};
    return r;
}

/* Checks everything about `a` but its data pointers. */
mha_status mha_fwd_check_shapes(const mha_module *m,
                                const mha_forward_args *a, fwd_shape *p)
{
    const mha_config *c = &m->cfg;
    if (a->dtype != MHA_DTYPE_F32 && a->dtype != MHA_DTYPE_BF16 &&
        a->dtype != MHA_DTYPE_F16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype must be MHA_DTYPE_F32 (0), _F16 (2) or "
                             "_BF16 (3), got %d", (int)a->dtype);
    if (a->batch < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "batch must be >= 1 (unbatched input is batch "
                             "1), got %lld", (long long)a->batch);
    if (a->q_len < 1)
        return mha_set_error(MHA_ERR_SHAPE, "q_len must be >= 1, got %lld",
                             (long long)a->q_len);
    if (a->kv_len < 0)
        return mha_set_error(MHA_ERR_SHAPE,
                             "kv_len must be >= 1 (0 = q_len), got %lld",
                             (long long)a->kv_len);
    /* kv_len 0 means Lq for self-attention only: a separate key tensor's
     * length is the caller's to say (a key of Lk rows read as Lq rows
     * would be a plausible wrong answer, or a read past its end). */
    const void *key = mha_fwd_key(a), *value = mha_fwd_value(a);
    if (key && key != mha_fwd_query(a) && a->kv_len == 0 && !a->cache)
        return mha_set_error(MHA_ERR_SHAPE,
                             "key is given (and is not the query) but "
                             "kv_len is 0: set kv_len to the key's length "
                             "(0 means q_len only in self-attention, key "
                             "NULL or the query itself)");
    if (a->q_total || a->q_start)
        MHA_CHECK(check_slice(a));
    p->B = a->batch;
    p->Lq = a->q_len;
    /* With a cache, the keys projected here are the Lq new tokens'. */
    p->Lk = a->kv_len && !a->cache ? a->kv_len : a->q_len;
    p->Lt = mha_total_keys(m, p->Lk);
    p->E = c->embed_dim;
    p->H = c->num_heads;
    p->dh = m->head_dim;
    p->D = m->inner_dim;
    p->Hkv = c->num_kv_heads;
    p->Dkv = m->kv_dim;
    p->dv = m->v_head_dim;
    p->Dv = m->v_inner_dim;
    p->Dvkv = m->kv_vdim;
    if (a->cache)
        MHA_CHECK(check_cache_args(m, a));

    if (!key && c->kdim != c->embed_dim)
        return mha_set_error(MHA_ERR_SHAPE,
                             "key is NULL, so the query (width E=%lld) is the "
                             "key, but kdim is %lld", (long long)c->embed_dim,
                             (long long)c->kdim);
    if (!key && p->Lk != p->Lq)
        return mha_set_error(MHA_ERR_SHAPE,
                             "key is NULL (self-attention), but kv_len %lld "
                             "differs from q_len %lld", (long long)p->Lk,
                             (long long)p->Lq);
    if (!value && c->vdim != c->kdim)
        return mha_set_error(MHA_ERR_SHAPE,
                             "value is NULL, so the key (width kdim=%lld) is "
                             "the value, but vdim is %lld",
                             (long long)c->kdim, (long long)c->vdim);

    const mha_attn_request r = fwd_request(m, p, a);
    MHA_CHECK(mha_attn_request_check(&r, "config"));
    MHA_CHECK(mha_check_threads(a->num_threads));

    /* Every size product that indexes memory, checked once here. */
    int64_t rows_q, rows_k, t, lql;
    int64_t wide = p->E > p->D ? p->E : p->D;
    wide = wide > p->Dv ? wide : p->Dv;
    if (!mha_mul_ok(p->B, p->Lq, &rows_q) || !mha_mul_ok(p->B, p->Lk, &rows_k) ||
        !mha_mul_ok(rows_q, 3 * wide, &t) || !mha_mul_ok(rows_k, 3 * wide, &t) ||
        !mha_mul_ok(rows_k, c->kdim > c->vdim ? c->kdim : c->vdim, &t) ||
        !mha_mul_ok(p->Lq, p->Lt, &lql) || !mha_mul_ok(lql, p->B, &t) ||
        !mha_mul_ok(t, p->H, &t))
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "sizes B=%lld Lq=%lld Lk=%lld overflow 64 bits",
                             (long long)p->B, (long long)p->Lq,
                             (long long)p->Lk);
    /* Keep every count below 2^60 so that the workspace sums below cannot
     * overflow either. */
    const int64_t limit = INT64_MAX / 8;
    if (rows_q * 3 * wide > limit || rows_k * 3 * wide > limit || t > limit)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "sizes B=%lld Lq=%lld Lk=%lld are too large",
                             (long long)p->B, (long long)p->Lq,
                             (long long)p->Lk);
    p->n_q = rows_q * p->E;
    p->n_qd = rows_q * p->D;
    p->n_kvd = rows_k * p->Dkv;
    p->n_ctx = rows_q * p->Dv;
    p->n_vd = rows_k * p->Dvkv;
    p->n_w = a->need_weights == MHA_WEIGHTS_PER_HEAD ? t : lql * p->B;

    return MHA_OK;
}


static mha_status mha_plan_create_impl(const mha_module *m,
                                       const mha_forward_args *a,
                                       mha_plan **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output plan is NULL");
    *out = NULL;
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "forward args are NULL");
    fwd_shape s;
    MHA_CHECK(mha_fwd_check_shapes(m, a, &s));
    mha_engine eng;
    MHA_CHECK(mha_engine_init(&eng, a->num_threads));
    MHA_CHECK(mha_gemm_check());
    mha_attn_layout lay;
    /* With a cache the attention reads up to its capacity of keys, packed
     * by the cache itself. */
    const int64_t Lk = a->cache ? a->cache->capacity : s.Lk;
    if (a->cache && mha_total_keys(m, Lk) < 0)
        return mha_set_error(MHA_ERR_OVERFLOW, "cache capacity overflows");
    MHA_CHECK(mha_attn_layout_forward(&eng, s.B, s.H, s.Hkv, s.Lq, Lk,
                                      mha_total_keys(m, Lk), s.dh, s.dv,
                                      a->cache != NULL, &lay));

    /* Self-attention with Lk = Lq may fuse q|k|v (3 n_qd, packed modules
     * only); otherwise q, k and v apart (n_qd + n_kvd + n_vd).  The
     * workspace holds the larger. */
    const int64_t fused = s.Lk == s.Lq && m->packed ? 3 * s.n_qd : 0;
    const int64_t split = s.n_qd + s.n_kvd + s.n_vd;
    const int64_t n_proj = fused > split ? fused : split;
    mha_plan *p = calloc(1, sizeof *p);
    if (!p)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate a plan");
    p->dtype = a->dtype;   /* 16-bit: forward16.c's own workspace */
    p->ws = a->dtype != MHA_DTYPE_F32
                ? NULL
                : mha_alloc_floats(n_proj + s.n_ctx + lay.total,
                                   "forward workspace");
    if (!p->ws && a->dtype == MHA_DTYPE_F32) {
        free(p);
        return MHA_ERR_OUT_OF_MEMORY;
    }
    p->m = m;
    p->shape = s;
    p->eng = eng;
    p->lay = lay;
    p->n_proj = n_proj;
    p->cache_capacity = a->cache ? a->cache->capacity : 0;
    *out = p;
    return MHA_OK;
}

mha_status mha_plan_create_sized(const mha_module *module,
                                 const mha_forward_args *shape,
                                 size_t shape_size, mha_plan **out)
{
    MHA_STRUCT_IN(mha_forward_args, shape);
    return mha_plan_create_impl(module, shape ? &shape_ : NULL, out);
}

void mha_plan_free(mha_plan *p)
{
    if (!p)
        return;
    free(p->ws);
    free(p->ws16);
    free(p->bws16);
    mha_attention_plan_free(p->att16);
    free(p->bws);
    free(p);
}

/* The workspace, in order: projections (n_proj), ctx (n_ctx), then the
 * attention's layout (row stats, decoding partials, packed K/V,
 * per-thread scratch). */
static float *ws_ctx(const mha_plan *p) { return p->ws + p->n_proj; }

/* A request pointed at the projections where the last forward put them,
 * and at the plan's ctx. */
static void point_at(mha_attn_request *r, const mha_plan *plan)
{
    r->q = plan->q;
    r->k = plan->k;
    r->v = plan->v;
    r->ldq = plan->ldq;
    r->ldk = plan->ldk;
    r->ldv = plan->ldv;
    r->out = ws_ctx(plan);
}

mha_attn_request mha_fwd_request(const mha_plan *plan,
                                 const mha_forward_args *a)
{
    mha_attn_request r = fwd_request(plan->m, &plan->shape, a);
    point_at(&r, plan);
    return r;
}

/*
 * RoPE (rope.c): q, and k, rotated in place right after their projections
 * and biases, so the attention, the KV cache (which stores rotated keys)
 * and the saved state for the backward all hold rotated values.  Query
 * token i of sequence b is at positions[b][i], else at i, or with a cache
 * at the sequence's length before this step + i, or in a slice of the
 * query rows (q_total) at q_start + i.  The keys take the same positions
 * in self-attention (key NULL or the query itself: the same tokens, never
 * in a slice); a separate key input's token j is at j.
 */
static void rope_qk(const mha_plan *plan, const mha_forward_args *a,
                    float *q, int64_t ldq, float *k, int64_t ldk)
{
    const mha_module *m = plan->m;
    const fwd_shape *s = &plan->shape;
    const mha_rope *r = &m->cfg.mods.rope;
    const int self = !a->q_total &&
                     (!a->key || (a->key == a->query && s->Lk == s->Lq));
    const int64_t *starts = a->cache ? a->cache->len : NULL;
    mha_rope_rows(r, s->B, s->Lq, s->H, s->dh, a->positions, starts,
                  a->q_start, q, ldq, 0, plan->eng.threads);
    mha_rope_rows(r, s->B, s->Lk, s->Hkv, s->dh, self ? a->positions : NULL,
                  self ? starts : NULL, 0, k, ldk, 0, plan->eng.threads);
}

/* A head mask may hold any finite factors; NULL is all ones. */
static mha_status check_head_mask(const float *head_mask, int64_t H)
{
    if (head_mask)
        for (int64_t h = 0; h < H; h++)
            if (!isfinite(head_mask[h]))
                return mha_set_error(MHA_ERR_NON_FINITE,
                                     "head_mask[%lld] is %g, must be finite",
                                     (long long)h, (double)head_mask[h]);
    return MHA_OK;
}

/* The weights are written while the masks are read and before out is:
 * attn_weights may share no byte with query, key, value, out or a mask
 * (with out it would be overwritten, with a mask it would corrupt it). */
static int bytes_overlap(const void *a, size_t na, const void *b, size_t nb)
{
    const uintptr_t a0 = (uintptr_t)a, b0 = (uintptr_t)b;
    return a && b && na && nb && a0 < b0 + nb && b0 < a0 + na;
}

static mha_status check_weights_apart(const mha_forward_args *a,
                                      const mha_config *c, const fwd_shape *s,
                                      int64_t n_w)
{
    const size_t f = sizeof(float), w = (size_t)n_w * f;
    const size_t rows_k = (size_t)(s->B * s->Lk);
    const mha_mask *mk[2] = {&a->attn_mask, &a->key_padding_mask};
    size_t mn[2] = {0, 0};
    for (int k = 0; k < 2; k++) {
        if (mk[k]->kind == MHA_MASK_NONE)
            continue;
        mn[k] = mk[k]->kind == MHA_MASK_ADDITIVE ? f : 1;
        for (int d = 0; d < mk[k]->ndim; d++)
            mn[k] *= (size_t)mk[k]->shape[d];
    }
    const struct {
        const char *name;
        const void *p;
        size_t n;
    } in[] = {
        {"query", a->query, (size_t)s->n_q * f},
        {"key", a->key, rows_k * (size_t)c->kdim * f},
        {"value", a->value, rows_k * (size_t)c->vdim * f},
        {"out", a->out, (size_t)s->n_q * f},
        {"attn_mask", mk[0]->data, mn[0]},
        {"key_padding_mask", mk[1]->data, mn[1]},
    };
    for (size_t i = 0; i < sizeof in / sizeof in[0]; i++)
        if (bytes_overlap(a->attn_weights, w, in[i].p, in[i].n))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "attn_weights overlaps %s: the weights may "
                                 "not share memory with the inputs or out",
                                 in[i].name);
    return MHA_OK;
}

static mha_status mha_plan_forward_impl(mha_plan *plan,
                                        const mha_forward_args *a)
{
    if (!plan)
        return mha_set_error(MHA_ERR_NULL_POINTER, "plan is NULL");
    if (!a)
        return mha_set_error(MHA_ERR_NULL_POINTER, "forward args are NULL");
    const mha_module *m = plan->m;
    const mha_config *c = &m->cfg;
    fwd_shape s;
    MHA_CHECK(mha_fwd_check_shapes(m, a, &s));
    const fwd_shape *ps = &plan->shape;
    plan->has_saved = 0;
    if (s.B != ps->B || s.Lq != ps->Lq || s.Lk != ps->Lk)
        return mha_set_error(MHA_ERR_SHAPE,
                             "arguments (B=%lld, Lq=%lld, Lk=%lld) do not "
                             "match the plan (B=%lld, Lq=%lld, Lk=%lld)",
                             (long long)s.B, (long long)s.Lq, (long long)s.Lk,
                             (long long)ps->B, (long long)ps->Lq,
                             (long long)ps->Lk);
    if (a->dtype != plan->dtype)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "this plan was made for dtype %d, the call has "
                             "dtype %d", (int)plan->dtype, (int)a->dtype);
    if (a->dtype != MHA_DTYPE_F32)
        return mha_forward16(plan, a);
    if (a->query16 || a->key16 || a->value16 || a->out16)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "dtype F32 takes its data in query, key, value "
                             "and out; %s must be NULL",
                             a->query16 ? "query16" : a->key16 ? "key16"
                             : a->value16 ? "value16" : "out16");
    if (!a->query)
        return mha_set_error(MHA_ERR_NULL_POINTER, "query is NULL");
    if (!a->out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "out is NULL");
    if (!a->cache != !plan->cache_capacity)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "this plan was made %s a KV cache",
                             plan->cache_capacity ? "for" : "without");
    if (a->cache)
        MHA_CHECK(mha_kv_cache_check_plan(a->cache, plan->cache_capacity));
    /* Masks and weights span Lk keys: with a cache, its longest
     * sequence once this step's tokens are in.  Every check passes
     * before the append. */
    mha_attn_request r = fwd_request(m, &s, a);
    mha_mask_plan mask;
    MHA_CHECK(mha_attn_request_masks(&r, &mask));
    const int64_t n_w = mha_attn_request_weights_floats(&r);
    MHA_CHECK(check_head_mask(a->head_mask, s.H));
    if (c->mods.rope.style != MHA_ROPE_NONE)
        MHA_CHECK(mha_rope_check_positions(a->positions, s.B * s.Lq,
                                           "positions"));
    if (a->need_weights != MHA_WEIGHTS_NONE)
        MHA_CHECK(check_weights_apart(a, c, &s, n_w));

    /* Taken before out (which may alias the query) is written. */
    const uint64_t print = mha_fwd_fingerprint(m, &s, a);
    const float *query = a->query;
    const float *key = a->key ? a->key : query;
    const float *value = a->value ? a->value : key;
    const int64_t E = s.E, D = s.D, Dkv = s.Dkv, Dvkv = s.Dvkv;
    const int64_t rows_q = s.B * s.Lq, rows_k = s.B * s.Lk;
    /* One GEMM over the query rows serves as keys only when they are the
     * same rows: same pointer and same length. */
    const int fuse_qkv = m->packed && key == query && value == query &&
                         s.Lk == s.Lq;
    const int fuse_kv = m->packed && !fuse_qkv && key == value;

    const int nt = plan->eng.threads;   /* the projections' threads too */
    float *ws = plan->ws;
    float *qp, *kp, *vp;
    int64_t ldq, ldk, ldv;
    if (fuse_qkv) {
        /* Rows of in_proj_weight are [W_q; W_k; W_v]. */
        mha_linear(query, rows_q, E, E, m->w_q, 3 * D, m->b_q, ws, 3 * D, nt);
        qp = ws; kp = ws + D; vp = ws + 2 * D;
        ldq = ldk = ldv = 3 * D;
    } else {
        qp = ws; ldq = D;
        mha_linear(query, rows_q, E, E, m->w_q, D, m->b_q, qp, D, nt);
        if (fuse_kv) {
            kp = ws + s.n_qd; vp = kp + D; ldk = ldv = 2 * D;
            mha_linear(key, rows_k, E, E, m->w_k, 2 * D, m->b_k, kp, 2 * D,
                       nt);
        } else {
            kp = ws + s.n_qd; vp = kp + s.n_kvd; ldk = Dkv; ldv = Dvkv;
            mha_linear(key, rows_k, c->kdim, c->kdim, m->w_k, Dkv, m->b_k, kp,
                       Dkv, nt);
            mha_linear(value, rows_k, c->vdim, c->vdim, m->w_v, Dvkv, m->b_v,
                       vp, Dvkv, nt);
        }
    }
    if (c->mods.rope.style != MHA_ROPE_NONE)
        rope_qk(plan, a, qp, ldq, kp, ldk);
    plan->q = qp; plan->k = kp; plan->v = vp;
    plan->ldq = ldq; plan->ldk = ldk; plan->ldv = ldv;
    plan->fuse_qkv = fuse_qkv;
    plan->fuse_kv = fuse_kv;
    point_at(&r, plan);
    /* the score range, before the cache or an output is written (the
     * projections are the plan's); the cache's keys then, with this
     * step's appended (no backward: has_saved stays 0) */
    MHA_CHECK(mha_attn_request_prepare(&r, plan->eng.uk, nt));
    mha_attn at = mha_attn_request_problem(&r, &mask, mha_plan_attn_ws(plan),
                                           &plan->lay);
    mha_attn_request_run(&plan->eng, &r, &at, &mask, qp,
                         mha_plan_attn_ws(plan) + plan->lay.scratch,
                         plan->lay.per_thread);

    const float *hm = mha_head_mask_in_use(a->head_mask, s.H);
    mha_linear_blocks(at.ctx, rows_q, s.Dv, s.Dv, m->w_o, E, m->b_o, hm,
                      hm ? s.H : 1, a->out, E, nt);
    if (a->cache || a->q_total)   /* neither has a backward */
        return MHA_OK;
    /* What the backward needs is now in the workspace. */
    plan->saved = *a;
    plan->saved_print = print;
    plan->has_saved = 1;
    return MHA_OK;
}

mha_status mha_plan_forward_sized(mha_plan *plan, const mha_forward_args *args,
                                  size_t args_size)
{
    MHA_STRUCT_IN(mha_forward_args, args);
    return mha_plan_forward_impl(plan, args ? &args_ : NULL);
}

static mha_status mha_forward_impl(const mha_module *m,
                                   const mha_forward_args *a)
{
    mha_plan *plan;
    MHA_CHECK(mha_plan_create(m, a, &plan));
    mha_status st = mha_plan_forward(plan, a);
    mha_plan_free(plan);
    return st;
}

mha_status mha_forward_sized(const mha_module *module,
                             const mha_forward_args *args, size_t args_size)
{
    MHA_STRUCT_IN(mha_forward_args, args);
    return mha_forward_impl(module, args ? &args_ : NULL);
}

/* ---- the decoding entry points ------------------------------------------ */

/* The forward a decode step is: the caller's mha_decode_args (of `size`
 * bytes, the ABI rule's copy) as bottom-right causal forward arguments,
 * nothing of the other modes (mha_forward checks the batch against the
 * cache). */
static mha_status decode_as_forward(const mha_decode_args *args,
                                    size_t args_size, mha_forward_args *a)
{
    MHA_STRUCT_IN(mha_decode_args, args);
    const mha_decode_args *d = &args_;
    if (!args)
        return mha_set_error(MHA_ERR_NULL_POINTER, "args is NULL");
    if (!d->cache)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "cache is NULL: decoding reads and appends to a "
                             "KV cache (mha_forward runs without one)");
    memset(a, 0, sizeof *a);
    a->batch = d->batch;
    a->q_len = d->q_len;
    a->query = d->query;
    a->out = d->out;
    a->cache = d->cache;
    a->attn_mask = d->attn_mask;
    a->key_padding_mask = d->key_padding_mask;
    a->key_lengths = d->key_lengths;
    a->causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a->need_weights = d->need_weights;
    a->attn_weights = d->attn_weights;
    a->positions = d->positions;
    a->head_mask = d->head_mask;
    a->num_threads = d->num_threads;
    return MHA_OK;
}

mha_status mha_decode_sized(const mha_module *module,
                            const mha_decode_args *args, size_t args_size)
{
    mha_forward_args a;
    MHA_CHECK(decode_as_forward(args, args_size, &a));
    return mha_forward_impl(module, &a);
}

mha_status mha_plan_create_decode_sized(const mha_module *module,
                                        const mha_decode_args *shape,
                                        size_t shape_size, mha_plan **out)
{
    mha_forward_args a;
    if (out)
        *out = NULL;
    MHA_CHECK(decode_as_forward(shape, shape_size, &a));
    return mha_plan_create_impl(module, &a, out);
}

mha_status mha_plan_decode_sized(mha_plan *plan, const mha_decode_args *args,
                                 size_t args_size)
{
    mha_forward_args a;
    MHA_CHECK(decode_as_forward(args, args_size, &a));
    return mha_plan_forward_impl(plan, &a);
}
