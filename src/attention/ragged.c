/*
 * ragged.c -- a ragged decoding step (mha_attention_decode_args.q_start):
 * the queries of many sequences packed back to back, each sequence with
 * its own count of new tokens, so that prefill chunks and single decode
 * tokens share one call (continuous batching with chunked prefill).
 *
 * Each sequence is computed by the one-sequence attention on a view of
 * the cache holding that sequence alone (mha_kv_cache_view): the bits
 * are, by construction, those of a call on that sequence alone, whatever
 * the other sequences hold (a batched call splits its keys by the batch's
 * longest sequence, which would change them).  The rows are written to a
 * scratch buffer and copied out only once every sequence succeeded, so a
 * refusal leaves out and lse untouched.
 */
#include "attention.h"

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
                               int64_t *rows, int64_t *E)
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
    if (d->num_heads < 1 || d->head_dim < 1 ||
        !mha_mul_ok(d->num_heads, d->head_dim, E))
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
    int64_t n, nl;
    if (!mha_mul_ok(*rows, *E, &n) || n > INT64_MAX / 4 ||
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
    const int64_t bytes = n * (half ? 2 : 4);
    if (overlap(out, bytes, q, bytes) ||
        overlap(d->lse, 4 * nl, q, bytes) ||
        overlap(d->lse, 4 * nl, out, bytes))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s overlaps %s: outputs must not name an input"
                             " or each other",
                             overlap(out, bytes, q, bytes) ? "out" : "lse",
                             overlap(d->lse, 4 * nl, out, bytes) ? "out"
                                                                 : "q");
    return MHA_OK;
}

mha_status mha_attention_decode_ragged(const mha_attention_decode_args *d)
{
    int64_t rows = 0, E = 0;
    MHA_CHECK(check_ragged(d, &rows, &E));
    const mha_kv_cache *c = d->cache;
    const int half = d->dtype != MHA_DTYPE_F32;
    const size_t esize = half ? 2 : 4;
    void *out = malloc((size_t)(rows * E) * esize + 1);
    float *lse = d->lse ? malloc((size_t)(rows * d->num_heads) * 4 + 1)
                        : NULL;
    float *extra = mha_alloc_floats(mha_packed_floats(1, c->Hkv, 0, c->dh),
                                    "a ragged step's view of the cache");
    mha_status st = out && (lse || !d->lse) && extra
                        ? MHA_OK
                        : mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                        "cannot allocate a ragged step's "
                                        "%lld rows", (long long)rows);
    for (int64_t b = 0; st == MHA_OK && b < c->B; b++) {
        const int64_t r0 = d->q_start[b], n = d->q_start[b + 1] - r0;
        if (n == 0)
            continue;
        mha_kv_cache view;
        mha_kv_cache_view(c, b, extra, &view);
        mha_attention_args a;
        memset(&a, 0, sizeof a);
        a.batch = 1;
        a.num_heads = d->num_heads;
        a.num_kv_heads = c->Hkv;
        a.head_dim = d->head_dim;
        a.q_len = n;
        a.cache = &view;
        a.scale = d->scale;
        a.given = d->given;
        a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
        a.lse = lse ? lse + r0 * d->num_heads : NULL;
        a.mods = d->mods;
        a.sinks = d->sinks;
        a.q_positions = d->q_positions ? d->q_positions + r0 : NULL;
        a.num_threads = d->num_threads;
        a.dtype = d->dtype;
        if (half) {
            a.q16 = d->q16 + r0 * E;
            a.out16 = (uint16_t *)out + r0 * E;
        } else {
            a.q = d->q + r0 * E;
            a.out = (float *)out + r0 * E;
        }
        st = mha_attention(&a);
        if (st != MHA_OK) {   /* which sequence, before its own message */
            char msg[MHA_ERROR_CAP];
            snprintf(msg, sizeof msg, "%s", mha_last_error());
            mha_set_error(st, "sequence %lld of the ragged step: %s",
                          (long long)b, msg);
        }
    }
    if (st == MHA_OK && rows > 0) {
        memcpy(half ? (void *)d->out16 : (void *)d->out, out,
               (size_t)(rows * E) * esize);
        if (lse)
            memcpy(d->lse, lse, (size_t)(rows * d->num_heads) * 4);
    }
    free(out);
    free(lse);
    free(extra);
    return st;
}
