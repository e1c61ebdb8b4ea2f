/*
 * kv_cache.h -- the KV cache's calls (kv_cache.c) that the engine and the
 * module's plans make: views, checks before an append, tiles, the
 * rotation, the keys a step reads, appending.  Its layout is
 * kv_layout.h's, its page pool kv_pages.h's.
 */
#ifndef MHA_KV_CACHE_H
#define MHA_KV_CACHE_H

#include "kv_pages.h"

/* A read-only view of sequences b .. b + n - 1 of c as a cache of n
 * sequences (their tiles, flags, lengths, page tables), for attention on
 * those sequences alone. */
void mha_kv_cache_view(const mha_kv_cache *c, int64_t b, int64_t n,
                       mha_kv_cache *view);

/* Refuses n tokens' keys and values (rows ldk, ldv apart, H_kv d_h each)
 * that sequence b of an f16 cache cannot hold: a finite |x| >= 65520,
 * which f16 would store as Inf.  MHA_OK for the other dtypes. */
mha_status mha_kv_cache_check_values(const mha_kv_cache *c, int64_t b,
                                     const float *k, int64_t ldk,
                                     const float *v, int64_t ldv, int64_t n);

/* The rotation of a cache made with `rotate` (none without): each of
 * `heads` heads of dh floats of `rows` rows (ld apart) turned in place by
 * the normalized Walsh-Hadamard transform of each block of rot_block
 * elements.  Symmetric and orthogonal, so its own inverse: what turns
 * queries to the stored keys' basis and the outputs back. */
void mha_kv_cache_turn(const mha_kv_cache *c, float *x, int64_t rows,
                       int64_t heads, int64_t ld);

/* The keys a step attends once `more` tokens are appended to every
 * sequence: the longest sequence, or with a window the most slots a
 * sequence fills (min(length, capacity)); its Lk. */
int64_t mha_kv_cache_keys(const mha_kv_cache *c, int64_t more);

/* A plan made for caches of capacity <= plan_capacity (its workspace is
 * sized for that many keys): refused, naming both, for a larger cache. */
mha_status mha_kv_cache_check_plan(const mha_kv_cache *c,
                                   int64_t plan_capacity);

/* A step of q_len queries per sequence on a window cache, after `more`
 * new tokens are appended (0: the caller appended them): refused unless
 * q_len + W - 1 <= capacity and the ring holds every position each
 * sequence's queries see.  MHA_OK for an ordinary cache. */
mha_status mha_kv_cache_check_window(const mha_kv_cache *c, int64_t q_len,
                                     int64_t more);
/* A window cache's keys are slots of a ring, not positions 0 .. Lk-1:
 * masks written over positions have no column to stand on, and weights
 * no position to land on.  MHA_ERR_UNSUPPORTED naming the first of these
 * arguments that is set (kv_len: nonzero). */
mha_status mha_kv_cache_window_args(const mha_mask *attn_mask,
                                    const mha_mask *key_padding_mask,
                                    const int64_t *key_lengths,
                                    mha_weights_mode need_weights,
                                    int64_t kv_len);

/* Points problem `at` (its q, ctx, bias_k, zero_attn set) at the cache:
 * keys are each sequence's cached ones (Lk = mha_kv_cache_keys), read in
 * place, masked causally bottom-right per sequence (and, with a window,
 * by position: key column j is slot j).  `mask` is the request's plan
 * (mha_attn_request_masks, for that Lk), to which the per-sequence
 * causal masking is added; it must outlive the run. */
void mha_attn_use_cache(mha_attn *at, const mha_kv_cache *kv,
                        mha_mask_plan *mask);

/* Appends n keys and values to sequence b: row r of k and v (row stride
 * ldk, ldv; head g at g * dh) at positions len[b] + r (in slot
 * (len[b] + r) % capacity with a window).  The caller has checked the
 * capacity. */
void mha_kv_cache_put(mha_kv_cache *c, int64_t b, const float *k,
                      int64_t ldk, const float *v, int64_t ldv, int64_t n);

#endif /* MHA_KV_CACHE_H */
