/*
 * ragged.c -- the decoding entry points on heads (mha_attention_decode and
 * its plan: a step as mha_attention on the cache), and a ragged decoding
 * step (mha_attention_decode_args.q_start):
 * the queries of many sequences packed back to back, each sequence with
 * its own count of new tokens, so that prefill chunks and single decode
 * tokens share one call (continuous batching with chunked prefill).
 *
 * Each run of neighbouring sequences with the same count of new tokens
 * and the same split of their keys (mha_decode_chunks: decode.c) is one
 * batched attention call on a view of the cache holding that run
 * (mha_kv_cache_view), one parallel region for all of them; any other
 * sequence is a call on a view of itself alone.  The bits are those of a
 * call on each sequence alone either way: every other choice a batched
 * call makes follows each sequence's own length (its tiles, its causal
 * limit, the columns its sums run over) or gives the same bits (the
 * thread count, stacking).  A batched call splits its keys by the run's
 * longest sequence, which is why runs hold one split.  The rows are
 * written to a scratch buffer and copied out only once every sequence
 * succeeded, so a refusal leaves out and lse untouched; a run refused is
 * run again sequence by sequence, so that the error names its sequence.
 */
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Whether [a, a + na) and [b, b + nb) (bytes) overlap. */
static int overlap(const void *a, int64_t na, const void *b, int64_t nb)
{
    const char *x = a, *y = b;
    return a && b && na > 0 && nb > 0 && x < y + nb && y < x + na;
}

/* Everything a per-sequence call cannot see: the offsets, the fields
 * this mode refuses, the buffers' overlaps. */
static mha_status check_ragged(const mha_attention_decode_args *d,
                               int64_t *rows, int64_t *E, int64_t *Eo)
{
    const mha_kv_cache *c = d->cache;
    if (!c)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "cache is NULL: decoding reads a KV cache");
    if (d->batch != c->B)
        return mha_set_error(MHA_ERR_SHAPE,
                             "batch %lld differs from the cache's %lld "
                             "sequences (q_start has batch + 1 entries)",
                             (long long)d->batch, (long long)c->B);
    if (d->q_len != 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "q_len is %lld with q_start: each sequence's "
                             "count is q_start[b + 1] - q_start[b], and "
                             "q_len must be 0", (long long)d->q_len);
    const char *no = d->attn_mask.kind ? "attn_mask"
                   : d->key_padding_mask.kind ? "key_padding_mask"
                   : d->key_lengths ? "key_lengths"
                   : d->need_weights != MHA_WEIGHTS_NONE ? "need_weights"
                                                         : NULL;
    if (no)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "%s with q_start (a ragged step) is not "
                             "supported: call per sequence", no);
    if (d->share_prefix && (d->mods.alibi || d->mods.window || d->sinks ||
                            d->attention_chunk))
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "share_prefix with %s is not supported: the "
                             "shared part's queries are stacked apart from "
                             "their positions",
                             d->mods.alibi    ? "ALiBi"
                             : d->mods.window ? "the window"
                             : d->sinks       ? "sinks"
                                              : "attention_chunk");
    if (d->num_heads < 1 || d->head_dim < 1 ||
        !mha_mul_ok(d->num_heads, d->head_dim, E) ||
        !mha_mul_ok(d->num_heads, c->dv, Eo))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "num_heads %lld and head_dim %lld must be >= 1",
                             (long long)d->num_heads,
                             (long long)d->head_dim);
    if (d->q_start[0] != 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "q_start[0] is %lld: the first sequence's rows "
                             "start at 0", (long long)d->q_start[0]);
    for (int64_t b = 0; b < c->B; b++)
        if (d->q_start[b + 1] < d->q_start[b])
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "q_start[%lld] = %lld is below q_start[%lld]"
                                 " = %lld: offsets never decrease",
                                 (long long)(b + 1),
                                 (long long)d->q_start[b + 1], (long long)b,
                                 (long long)d->q_start[b]);
    *rows = d->q_start[c->B];
    int64_t n, n_o, nl;
    if (!mha_mul_ok(*rows, *E, &n) || n > INT64_MAX / 4 ||
        !mha_mul_ok(*rows, *Eo, &n_o) || n_o > INT64_MAX / 4 ||
        !mha_mul_ok(*rows, d->num_heads, &nl) || nl > INT64_MAX / 4)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "%lld query rows of %lld overflow",
                             (long long)*rows, (long long)*E);
    const int half = d->dtype != MHA_DTYPE_F32;
    const void *q = half ? (const void *)d->q16 : (const void *)d->q;
    const void *out = half ? (void *)d->out16 : (void *)d->out;
    if (n > 0 && (!q || !out))
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !q ? (half ? "q16" : "q") : (half ? "out16"
                                                                : "out"));
    /* (out's rows are the cache's values' width, d_v) */
    const int64_t bytes = n * (half ? 2 : 4), obytes = n_o * (half ? 2 : 4);
    const char *pair = overlap(out, obytes, q, bytes) ? "out overlaps q"
                     : overlap(d->lse, 4 * nl, q, bytes) ? "lse overlaps q"
                     : overlap(d->lse, 4 * nl, out, obytes) ? "lse overlaps out"
                                                            : NULL;
    if (pair)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: outputs must not name an input or each "
                             "other", pair);
    return MHA_OK;
}

/* A decode step's fields as attention arguments on its cache: the
 * cache's K/V heads, bottom-right causal, no keys of its own, no
 * training. */
static void decode_fields(const mha_attention_decode_args *d,
                          mha_attention_args *a)
{
    memset(a, 0, sizeof *a);
    a->batch = d->batch;
    a->num_heads = d->num_heads;
    a->num_kv_heads = d->cache->Hkv;
    a->head_dim = d->head_dim;
    a->q_len = d->q_len;
    a->q = d->q;
    a->out = d->out;
    a->cache = d->cache;
    a->scale = d->scale;
    a->given = d->given;
    a->attn_mask = d->attn_mask;
    a->key_padding_mask = d->key_padding_mask;
    a->key_lengths = d->key_lengths;
    a->causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a->need_weights = d->need_weights;
    a->attn_weights = d->attn_weights;
    a->lse = d->lse;
    a->mods = d->mods;
    a->attention_chunk = d->attention_chunk;
    a->sinks = d->sinks;
    a->q_positions = d->q_positions;
    a->num_threads = d->num_threads;
    a->dtype = d->dtype;
    a->q16 = d->q16;
    a->out16 = d->out16;
}

/* The attention of rows q (n of them) on cache view `kv` into out and lse
 * ((1, H, n) or NULL): a one-sequence call with the step's fields. */
static mha_status attend(const mha_attention_decode_args *d,
                         mha_kv_cache *kv, int64_t n, const void *q,
                         void *out, float *lse, const int64_t *q_positions)
{
    mha_attention_args a;
    decode_fields(d, &a);
    a.batch = 1;
    a.q_len = n;
    a.cache = kv;
    a.lse = lse;
    a.q_positions = q_positions;
    if (d->dtype != MHA_DTYPE_F32) {
        a.q16 = q;
        a.out16 = out;
    } else {
        a.q = q;
        a.out = out;
    }
    return mha_attention(&a);
}

/* The pages sequences a and b of a paged cache share from their start,
 * whole pages only, and none holding a new token of either (n_a, n_b). */
static int64_t shared_pages(const mha_kv_cache *c, int64_t a, int64_t na,
                            int64_t b, int64_t nb)
{
    const int64_t la = c->len[a] - na, lb = c->len[b] - nb;
    const int64_t most = (la < lb ? la : lb) / c->page;
    int64_t s = 0;
    while (s < most && c->table[a * c->table_len + s] ==
                           c->table[b * c->table_len + s])
        s++;
    return s;
}

/* The most sequences one batched call takes: its workspace (the split
 * keys' partials, B H chunks (d_v + 2) floats) grows with them, and 64
 * sequences give any machine's threads work enough. */
enum { RUN_MAX = 64 };

typedef struct ragged {
    const mha_attention_decode_args *d;
    const mha_kv_cache *c;
    int64_t E, Eo, H;   /* a row of q: H d_h; of out: H d_v         */
    size_t esize;
    char *out;      /* the scratch rows, (rows, Eo) of esize bytes */
    float *lse;     /* (rows, H) in the caller's layout, or NULL   */
} ragged;

static const char *q_at(const ragged *r, int64_t row)
{
    const mha_attention_decode_args *d = r->d;
    return (d->dtype != MHA_DTYPE_F32 ? (const char *)d->q16
                                      : (const char *)d->q) +
           row * r->E * (int64_t)r->esize;
}

/* The new tokens of sequence b. */
static int64_t fresh(const mha_attention_decode_args *d, int64_t b)
{
    return d->q_start[b + 1] - d->q_start[b];
}

/* The chunks a call on sequence b alone splits its keys in. */
static int64_t chunks_alone(const ragged *r, int64_t b)
{
    mha_kv_cache view;
    mha_kv_cache_view(r->c, b, 1, &view);
    return mha_decode_chunks(fresh(r->d, b), mha_kv_cache_keys(&view, 0));
}

/* The end of the run from sequence b that one batched call takes: its
 * neighbours with as many new tokens and keys split alike (not yet
 * taken by a cascade). */
static int64_t run_end(const ragged *r, int64_t b, const unsigned char *done)
{
    const int64_t n = fresh(r->d, b), chunks = chunks_alone(r, b);
    int64_t e = b + 1;
    while (e < r->c->B && e - b < RUN_MAX && !done[e] &&
           fresh(r->d, e) == n && chunks_alone(r, e) == chunks)
        e++;
    return e;
}

/* Sequences b .. e-1, each with n new tokens, in one call on a view of
 * them (the same bits as each alone: above). */
static mha_status batched(const ragged *r, int64_t b, int64_t e)
{
    const mha_attention_decode_args *d = r->d;
    const int64_t r0 = d->q_start[b], n = fresh(d, b);
    mha_kv_cache view;
    mha_kv_cache_view(r->c, b, e - b, &view);
    mha_attention_args a;
    decode_fields(d, &a);
    a.batch = e - b;
    a.q_len = n;
    a.cache = &view;
    a.lse = r->lse ? r->lse + r0 * r->H : NULL;   /* (e-b, H, n): in order */
    a.q_positions = d->q_positions ? d->q_positions + r0 : NULL;
    if (d->dtype != MHA_DTYPE_F32) {
        a.q16 = (const void *)q_at(r, r0);
        a.out16 = (void *)(r->out + r0 * r->Eo * (int64_t)r->esize);
    } else {
        a.q = (const void *)q_at(r, r0);
        a.out = (void *)(r->out + r0 * r->Eo * (int64_t)r->esize);
    }
    return mha_attention(&a);
}

/* The error of a step refused at sequence b, which it names. */
static mha_status name_sequence(mha_status st, int64_t b)
{
    char msg[MHA_ERROR_CAP];
    snprintf(msg, sizeof msg, "%s", mha_last_error());
    return mha_set_error(st, "sequence %lld of the ragged step: %s",
                         (long long)b, msg);
}

/* Sequences b .. e-1 in one call; refused, one by one, so that the error
 * is the first refused sequence's. */
static mha_status run(const ragged *r, int64_t b, int64_t e)
{
    if (e - b > 1 && batched(r, b, e) == MHA_OK)
        return MHA_OK;
    for (int64_t x = b; x < e; x++) {
        const mha_status st = batched(r, x, x + 1);
        if (st != MHA_OK)
            return name_sequence(st, x);
    }
    return MHA_OK;
}

/* The own keys of cascade members b .. b + n - 1 (each past the S pages
 * they share, own[i] of them) as a cache of n sequences: their tables
 * past those pages, and fewer of them (no read past a table's row). */
static void own_view(const ragged *r, int64_t b, int64_t n, int64_t S,
                     int64_t *own, mha_kv_cache *view)
{
    mha_kv_cache_view(r->c, b, n, view);
    view->len = own;
    view->table += S;
    view->tiles = (r->c->table_len - S) * r->c->tpp;
}

/* The chunks cascade member b's own keys split in, alone. */
static int64_t own_chunks(const ragged *r, int64_t b, int64_t own)
{
    return mha_decode_chunks(fresh(r->d, b), own);
}

/*
 * A group of sequences (mem[0 .. m-1], ascending) sharing their first S
 * pages: the shared keys once for all their rows stacked (a view of the
 * first member cut to S pages, its queries placed past its end so that
 * each sees every key), then the members' own keys (views of their
 * tables past those pages; neighbouring members with as many new tokens
 * and own keys split alike in one call, as run_end's runs), the two
 * parts merged (mha_attention_merge).  float32 rows only (16-bit rows go
 * as any ragged step's).
 */
static mha_status cascade(const ragged *r, const int64_t *mem, int m,
                          int64_t S)
{
    const mha_attention_decode_args *d = r->d;
    const int64_t E = r->E, Eo = r->Eo, H = r->H;
    int64_t Ls = S * r->c->page;   /* (the shared view's length) */
    int64_t T = 0;
    for (int i = 0; i < m; i++)
        T += fresh(d, mem[i]);
    /* the stacked rows, the shared part's out and lse, the own parts'
     * out and lse and their rows of the shared lse, the own lengths */
    float *q = mha_alloc_floats(T * E, "a cascade's rows");
    float *o1 = mha_alloc_floats(T * Eo, "a cascade's shared part");
    float *l1 = mha_alloc_floats(T * H, "a cascade's shared part");
    float *o2 = mha_alloc_floats(T * Eo, "a cascade's own parts");
    float *l2 = mha_alloc_floats(2 * T * H, "a cascade's own parts");
    int64_t *own = malloc((size_t)m * sizeof *own + 1);
    mha_status st = q && o1 && l1 && o2 && l2 && own
                        ? MHA_OK
                        : mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                        "cannot allocate a cascade's %lld "
                                        "rows", (long long)T);
    for (int64_t i = 0, at = 0; st == MHA_OK && i < m; i++) {
        const int64_t r0 = d->q_start[mem[i]], n = fresh(d, mem[i]);
        memcpy(q + at * E, d->q + r0 * E, (size_t)(n * E) * sizeof *q);
        own[i] = r->c->len[mem[i]] - Ls;
        at += n;
    }
    if (st == MHA_OK) {   /* the shared keys, once */
        mha_kv_cache view;
        mha_kv_cache_view(r->c, mem[0], 1, &view);
        view.len = &Ls;
        view.view_shift = T;
        st = attend(d, &view, T, q, o1, l1, NULL);
    }
    float *l1b = l2 + T * H;   /* the run's rows of l1, (members, H, n) */
    for (int64_t i = 0, at = 0, j = 0; st == MHA_OK && i < m; i = j) {
        const int64_t b = mem[i], r0 = d->q_start[b], n = fresh(d, b);
        const int64_t chunks = own_chunks(r, b, own[i]);
        j = i + 1;   /* the run of neighbouring members from i */
        while (j < m && j - i < RUN_MAX && mem[j] == mem[j - 1] + 1 &&
               fresh(d, mem[j]) == n && own_chunks(r, mem[j], own[j]) == chunks)
            j++;
        mha_kv_cache view;
        own_view(r, b, j - i, S, own + i, &view);
        mha_attention_args a;
        decode_fields(d, &a);
        a.batch = j - i, a.q_len = n, a.cache = &view;
        a.q = q + at * E, a.out = o2, a.lse = l2;
        st = mha_attention(&a);
        for (int64_t x = 0; st == MHA_OK && x < j - i; x++)
            for (int64_t h = 0; h < H; h++)
                memcpy(l1b + (x * H + h) * n, l1 + h * T + at + x * n,
                       (size_t)n * sizeof *l1);
        const mha_attention_part parts[2] = {{o1 + at * Eo, l1b}, {o2, l2}};
        if (st == MHA_OK)
            st = mha_attention_merge(parts, 2, j - i, H, r->c->dv, n,
                                     (float *)r->out + r0 * Eo,
                                     r->lse ? r->lse + r0 * H : NULL);
        at += (j - i) * n;
    }
    free(q);
    free(o1);
    free(l1);
    free(o2);
    free(l2);
    free(own);
    return st;
}

static mha_status decode_ragged(const mha_attention_decode_args *d)
{
    int64_t rows = 0, E = 0, Eo = 0;
    MHA_CHECK(check_ragged(d, &rows, &E, &Eo));
    const mha_kv_cache *c = d->cache;
    const int half = d->dtype != MHA_DTYPE_F32;
    const ragged r = {
        d, c, E, Eo, d->num_heads, half ? 2 : 4,
        malloc((size_t)(rows * Eo) * (half ? 2 : 4) + 1),
        d->lse ? malloc((size_t)(rows * d->num_heads) * 4 + 1) : NULL};
    int64_t *mem = malloc((size_t)c->B * sizeof *mem + 1);
    unsigned char *done = calloc((size_t)c->B + 1, 1);
    mha_status st = r.out && (r.lse || !d->lse) && mem && done
                        ? MHA_OK
                        : mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                        "cannot allocate a ragged step's "
                                        "%lld rows", (long long)rows);
    /* With share_prefix, first each group of sequences sharing their
     * first pages (the pages all of them share), a cascade (a window's
     * ring pages hold no prefix: none there). */
    const int share = d->share_prefix && c->page && !c->window && !half;
    for (int64_t b = 0; share && st == MHA_OK && b < c->B; b++) {
        const int64_t nb = fresh(d, b);
        if (nb == 0 || done[b])
            continue;
        int m = 1;
        int64_t S = 0;
        mem[0] = b;
        for (int64_t x = b + 1; x < c->B; x++) {
            const int64_t nx = fresh(d, x);
            const int64_t sx = nx && !done[x] ? shared_pages(c, b, nb, x, nx)
                                              : 0;
            if (sx > 0) {
                S = m == 1 || sx < S ? sx : S;
                mem[m++] = x;
                done[x] = 1;
            }
        }
        if (m > 1) {
            done[b] = 1;
            st = cascade(&r, mem, m, S);
            if (st != MHA_OK)
                st = name_sequence(st, b);
        }
    }
    /* Then the others, in runs. */
    for (int64_t b = 0, e; st == MHA_OK && b < c->B; b = e) {
        e = b + 1;
        if (fresh(d, b) == 0 || done[b])
            continue;
        e = run_end(&r, b, done);
        st = run(&r, b, e);
    }
    if (st == MHA_OK && rows > 0) {
        memcpy(half ? (void *)d->out16 : (void *)d->out, r.out,
               (size_t)(rows * Eo) * r.esize);
        if (r.lse)
            memcpy(d->lse, r.lse, (size_t)(rows * d->num_heads) * 4);
    }
    free(r.out);
    free(r.lse);
    free(mem);
    free(done);
    return st;
}

/* ---- the decoding entry points ------------------------------------------ */

/* A decode step (the caller's struct, copied by the ABI rule, or NULL)
 * as attention arguments: decode_fields once the cache is there (the
 * batch is checked against the cache's by the attention). */
static mha_status decode_as_attention(const mha_attention_decode_args *d,
                                      mha_attention_args *a)
{
    if (!d)
        return mha_set_error(MHA_ERR_NULL_POINTER, "args is NULL");
    if (!d->cache)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "cache is NULL: decoding reads a KV cache "
                             "(mha_attention runs without one)");
    if (d->q_start)   /* (mha_attention_decode takes it before here) */
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "q_start (a ragged step) has no plan: call "
                             "mha_attention_decode");
    decode_fields(d, a);
    return MHA_OK;
}

mha_status mha_attention_decode_sized(const mha_attention_decode_args *args,
                                      size_t args_size)
{
    MHA_STRUCT_IN(mha_attention_decode_args, args);
    if (args && args_.q_start)   /* ragged: sequence by sequence */
        return decode_ragged(&args_);
    mha_attention_args a;
    MHA_CHECK(decode_as_attention(args ? &args_ : NULL, &a));
    return mha_attention(&a);
}

mha_status mha_attention_plan_create_decode_sized(
    const mha_attention_decode_args *shape, size_t shape_size,
    mha_attention_plan **out)
{
    if (out)
        *out = NULL;
    MHA_STRUCT_IN(mha_attention_decode_args, shape);
    mha_attention_args a;
    MHA_CHECK(decode_as_attention(shape ? &shape_ : NULL, &a));
    return mha_attention_plan_create(&a, out);
}

mha_status mha_attention_plan_decode_sized(
    mha_attention_plan *plan, const mha_attention_decode_args *args,
    size_t args_size)
{
    MHA_STRUCT_IN(mha_attention_decode_args, args);
    mha_attention_args a;
    MHA_CHECK(decode_as_attention(args ? &args_ : NULL, &a));
    return mha_attention_plan_run(plan, &a);
}
