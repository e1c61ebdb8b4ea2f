/*
 * kv_cache.c -- the KV cache: per sequence, the keys and values of the
 * tokens seen so far, already projected, kept in the layout the kernels
 * read (keys transposed by tiles of MHA_BC, values in rows; attention.h,
 * mha_packed), so decoding never repacks or copies them.
 *
 *   data   [B][H_kv][tiles][MHA_BC * d_h]   key tiles, kt[d][c]
 *          [B][H_kv][tiles][MHA_BC * d_h]   value tiles, v[c][d]
 *          [B][H_kv][tiles]                 1.0f if the value tile is finite
 *
 * tiles = ceil(capacity / MHA_BC) + 1: the last tile of every (b, g)
 * holds a module's extra keys (bias_k, the zero key), written by each
 * forward.  Key position p of sequence b is column p % MHA_BC of tile
 * p / MHA_BC.
 */
#include "attention.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static mha_packed packed_of(const mha_kv_cache *c)
{
    const int64_t tile = MHA_BC * c->dh;
    const mha_packed p = {c->data, c->Hkv, c->tiles, tile,
                          c->B * c->Hkv * c->tiles * tile};
    return p;
}

mha_status mha_kv_cache_create(const mha_kv_cache_config *cfg,
                               mha_kv_cache **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output cache is NULL");
    *out = NULL;
    if (!cfg)
        return mha_set_error(MHA_ERR_NULL_POINTER, "cache config is NULL");
    if (cfg->batch < 1 || cfg->num_kv_heads < 1 || cfg->head_dim < 1 ||
        cfg->capacity < 1)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cache batch, num_kv_heads, head_dim and "
                             "capacity must be >= 1, got %lld, %lld, %lld, "
                             "%lld", (long long)cfg->batch,
                             (long long)cfg->num_kv_heads,
                             (long long)cfg->head_dim,
                             (long long)cfg->capacity);
    if (cfg->dtype != MHA_KV_F32)
        return mha_set_error(cfg->dtype == MHA_KV_F16 ||
                                     cfg->dtype == MHA_KV_BF16 ||
                                     cfg->dtype == MHA_KV_Q8
                                 ? MHA_ERR_UNSUPPORTED
                                 : MHA_ERR_INVALID_ARGUMENT,
                             "cache dtype %d: this build stores f32 only",
                             (int)cfg->dtype);
    int64_t n, t;
    if (!mha_mul_ok(cfg->batch, cfg->num_kv_heads, &t) ||
        !mha_mul_ok(t, mha_packed_tiles(cfg->capacity), &t) ||
        !mha_mul_ok(t, 2 * MHA_BC * cfg->head_dim + 1, &n) ||
        n > INT64_MAX / 8)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "a cache of %lld sequences x %lld tokens x "
                             "%lld heads x %lld overflows",
                             (long long)cfg->batch, (long long)cfg->capacity,
                             (long long)cfg->num_kv_heads,
                             (long long)cfg->head_dim);
    mha_kv_cache *c = calloc(1, sizeof *c);
    int64_t *len = calloc((size_t)cfg->batch, sizeof *len);
    float *data = mha_alloc_floats(n, "KV cache");
    if (!c || !len || !data) {
        free(c);
        free(len);
        free(data);
        return data ? mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                    "cannot allocate a cache")
                    : MHA_ERR_OUT_OF_MEMORY;
    }
    /* Zero, so a tile's unused columns hold finite values. */
    memset(data, 0, (size_t)n * sizeof *data);
    c->B = cfg->batch;
    c->Hkv = cfg->num_kv_heads;
    c->dh = cfg->head_dim;
    c->capacity = cfg->capacity;
    c->tiles = mha_packed_tiles(cfg->capacity);
    c->dtype = cfg->dtype;
    c->len = len;
    c->data = data;
    *out = c;
    return MHA_OK;
}

void mha_kv_cache_free(mha_kv_cache *c)
{
    if (!c)
        return;
    free(c->len);
    free(c->data);
    free(c);
}

int64_t mha_kv_cache_length(const mha_kv_cache *c, int64_t seq)
{
    if (!c || seq < 0 || seq >= c->B)
        return -1;
    return c->len[seq];
}

/* Whether every value of the first `cols` columns of tile t of (b, g) is
 * finite: the flag the kernels read to take the fast pv. */
static float tile_finite(const mha_kv_cache *c, int64_t b, int64_t g,
                         int64_t t, int64_t cols)
{
    const mha_packed p = packed_of(c);
    const float *v = mha_packed_b(&p, b, g, t);
    for (int64_t x = 0; x < cols * c->dh; x++)
        if (!isfinite(v[x]))
            return 0.0f;
    return 1.0f;
}

void mha_kv_cache_put(mha_kv_cache *c, int64_t b, const float *k,
                      int64_t ldk, const float *v, int64_t ldv, int64_t n)
{
    const mha_packed p = packed_of(c);
    const int64_t dh = c->dh;
    for (int64_t r = 0; r < n; r++) {
        const int64_t pos = c->len[b] + r;
        const int64_t t = pos / MHA_BC, col = pos % MHA_BC;
        for (int64_t g = 0; g < c->Hkv; g++) {
            const float *kr = k + r * ldk + g * dh, *vr = v + r * ldv + g * dh;
            float *kt = mha_packed_a(&p, b, g, t);
            float *vt = mha_packed_b(&p, b, g, t) + col * dh;
            int finite = 1;
            for (int64_t d = 0; d < dh; d++) {
                kt[d * MHA_BC + col] = kr[d];
                vt[d] = vr[d];
                finite &= isfinite(vr[d]) != 0;
            }
            float *flag = mha_packed_flag(&p, b, g, t);
            *flag = col == 0 ? (float)finite : *flag * (float)finite;
        }
    }
    c->len[b] += n;
}

void mha_attn_use_cache(mha_attn *at, const mha_kv_cache *kv,
                        mha_mask_plan *mask)
{
    int64_t longest = 0;
    for (int64_t b = 0; b < kv->B; b++)
        longest = kv->len[b] > longest ? kv->len[b] : longest;
    const int64_t extra = (at->bias_k != NULL) + (at->zero_attn != 0);
    at->Lk = longest;
    at->Lt = longest + extra;
    at->k = at->v = NULL;
    at->ldk = at->ldv = 0;
    at->packed = kv->data;
    at->packed_tiles = kv->tiles;
    at->prepacked = 1;
    /* The caller's masks (for Lk = longest) stay; causal becomes
     * bottom-right per sequence: new query i of sequence b sees keys
     * j <= len_b - Lq + i, so never a key past its length, whatever the
     * masks allow.  An empty cache (longest 0) leaves every row with no
     * key. */
    mask->causal = MHA_CAUSAL_BOTTOM_RIGHT;
    mask->seq_lengths = kv->len;
    at->mask = mask;
}

static mha_status check_seq(const mha_kv_cache *c, int64_t seq)
{
    if (!c)
        return mha_set_error(MHA_ERR_NULL_POINTER, "cache is NULL");
    if (seq < 0 || seq >= c->B)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "sequence %lld is not in the cache (0 .. %lld)",
                             (long long)seq, (long long)(c->B - 1));
    return MHA_OK;
}

mha_status mha_kv_cache_append(mha_kv_cache *c, int64_t seq, const float *k,
                               const float *v, int64_t n)
{
    MHA_CHECK(check_seq(c, seq));
    if (n < 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "n must be >= 0, got %lld", (long long)n);
    if (n > 0 && (!k || !v))
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !k ? "k" : "v");
    if (n > c->capacity - c->len[seq])
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "appending %lld tokens to sequence %lld of "
                             "length %lld exceeds the capacity %lld",
                             (long long)n, (long long)seq,
                             (long long)c->len[seq], (long long)c->capacity);
    const int64_t Ekv = c->Hkv * c->dh;
    mha_kv_cache_put(c, seq, k, Ekv, v, Ekv, n);
    return MHA_OK;
}

mha_status mha_kv_cache_truncate(mha_kv_cache *c, int64_t seq,
                                 int64_t length)
{
    MHA_CHECK(check_seq(c, seq));
    if (length < 0 || length > c->len[seq])
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "cannot truncate sequence %lld of length %lld "
                             "to %lld", (long long)seq,
                             (long long)c->len[seq], (long long)length);
    c->len[seq] = length;
    /* The tile the sequence now ends in keeps only finite-or-not of its
     * remaining columns; a whole tile is flagged anew by its next put. */
    const int64_t t = length / MHA_BC, cols = length % MHA_BC;
    if (cols) {
        const mha_packed p = packed_of(c);
        for (int64_t g = 0; g < c->Hkv; g++)
            *mha_packed_flag(&p, seq, g, t) = tile_finite(c, seq, g, t, cols);
    }
    return MHA_OK;
}

mha_status mha_kv_cache_reset(mha_kv_cache *c, int64_t seq)
{
    if (c && seq == -1) {
        memset(c->len, 0, (size_t)c->B * sizeof *c->len);
        return MHA_OK;
    }
    MHA_CHECK(check_seq(c, seq));
    c->len[seq] = 0;
    return MHA_OK;
}
