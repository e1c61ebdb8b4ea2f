/*
 * attention.h -- scaled dot-product attention over already projected
 * heads: the part of the forward pass that is O(Lq x Lk).  Shared by
 * forward.c (the module) and mha_attention() (heads given directly).
 */
#ifndef MHA_ATTENTION_H
#define MHA_ATTENTION_H

#include "core/core.h"
#include "kernels/kernels.h"

/* ---- masks (mask.c): every mask kind -> one row of additive biases ----- */
typedef struct mha_mask_plan {
    int64_t batch, heads, q_len, kv_len, total_keys;
    mha_mask attn;             /* kind NONE if absent */
    int64_t attn_stride_b, attn_stride_h;   /* 0 where broadcast */
    mha_mask pad;              /* kind NONE if absent */
    int64_t pad_stride_b;
    const int64_t *key_lengths;
    mha_causal causal;
} mha_mask_plan;

/* Validates every mask argument of `args` (batch, q_len, kv_len and the
 * mask fields) and fills the plan; extra_keys follow the real ones. */
mha_status mha_mask_plan_init(mha_mask_plan *plan, int64_t heads,
                              int64_t extra_keys,
                              const mha_forward_args *args);

/*
 * Fills row[0 .. total_keys) for (b, h, i) with what is added to the scaled
 * scores: 0 (plain), a finite additive value, or -INFINITY (excluded).
 * Returns the number of keys that are not excluded.
 */
int64_t mha_mask_row(const mha_mask_plan *plan, int64_t b, int64_t h,
                     int64_t i, float *row);

/* The same for real-key columns j0 .. j0+n-1 only (j0 + n <= Lk). */
int64_t mha_mask_cols(const mha_mask_plan *plan, int64_t b, int64_t h,
                      int64_t i, int64_t j0, int64_t n, float *row);

/* The last real key that causal masking and key_lengths leave to query
 * row i of batch b (-1: none).  Explicit masks may block more. */
int64_t mha_mask_last(const mha_mask_plan *plan, int64_t b, int64_t i);

/* Whether the plan has an explicit (memory) mask, as opposed to masking
 * that follows from indices alone. */
static inline int mha_mask_has_explicit(const mha_mask_plan *p)
{
    return p->attn.kind != MHA_MASK_NONE || p->pad.kind != MHA_MASK_NONE;
}


/* Query rows per block and keys per tile of the flash tiers. */
enum { MHA_BR = 64, MHA_BC = 64 };

/*
 * One attention problem.  Element d of head h of row i of batch b is at
 *     q[(b * Lq + i) * ldq + h * dh + d]     (k, v likewise with Lk)
 *     ctx[(b * Lq + i) * ldc + h * dh + d]   (the output)
 * bias_k / bias_v ([H * dh], or NULL) and zero_attn append one key each
 * after the Lk real ones, in that order, as PyTorch does.
 */
typedef struct mha_attn {
    int64_t B, H, Lq, Lk, Lt, dh;
    const float *q, *k, *v;
    int64_t ldq, ldk, ldv;
    const float *bias_k, *bias_v;
    int zero_attn;
    float scale;
    const mha_mask_plan *mask;
    int dropout;            /* training with p > 0 */
    float p_drop;
    uint64_t seed;
    float *ctx;
    int64_t ldc;
    float *stats;           /* [B][H][Lq][2]: the row's max m and 1 / l,
                               its softmax normaliser exp(m) * l; m is
                               -INFINITY for a row with no key.  (Kept
                               apart: m + log(l) loses l when |m| is huge) */
    mha_weights_mode weights;
    float *w;               /* (B, H, Lq, Lt) or (B, Lq, Lt), zeroed */
    float *partials;        /* mha_attn_partials() floats, for decoding */
    float *packed;          /* mha_attn_packed() floats: K, V by tile   */
} mha_attn;

/* The tier chosen at start-up (MHA_ISA=ref|scalar|avx2 forces one). */
mha_status mha_isa_get(mha_isa *isa, const mha_microkernels **uk);

/* Key chunks of a split (decoding) problem, 1 when not split, and the
 * floats of the shared buffer for the chunks' partial results. */
int64_t mha_attn_chunks(int64_t Lq, int64_t Lk);
int64_t mha_attn_partials(int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                          int64_t dh);

/* Floats of the packed K and V of the flash tiers (none for ref). */
int64_t mha_attn_packed(int64_t B, int64_t H, int64_t Lk, int64_t dh);

/* Floats of per-thread scratch for a tier. */
int64_t mha_attn_scratch(mha_isa isa, int64_t dh, int64_t Lt);

/* Runs the whole problem on `threads` threads (OpenMP), each with its own
 * `scratch` slice of mha_attn_scratch() floats.  Results do not depend on
 * the thread count. */
void mha_attn_run(mha_isa isa, const mha_microkernels *uk, const mha_attn *a,
                  int threads, float *scratch, int64_t scratch_per_thread);

/*
 * The backward of a problem whose forward ran with the same mha_attn (its
 * ctx, stats and, for the flash tiers, packed K/V kept).  dctx is the
 * gradient of ctx; dq, dk, dv (laid out as q, k, v with their own row
 * strides) are overwritten; dbias_k / dbias_v ([B][H][dh], or NULL) receive
 * each (b, h)'s gradient of bias_k / bias_v, summed over b by the caller.
 */
typedef struct mha_attn_grad {
    const float *dctx;
    int64_t lddc;
    float *dq, *dk, *dv;
    int64_t lddq, lddk, lddv;
    float *dbias_k, *dbias_v;
    float *packed;   /* mha_attn_bwd_packed() floats (flash tiers) */
} mha_attn_grad;

/* Floats of the backward's own packing of K and V (flash tiers). */
int64_t mha_attn_bwd_packed(int64_t B, int64_t H, int64_t Lk, int64_t dh);

/* Floats of per-thread scratch for the backward of a tier. */
int64_t mha_attn_bwd_scratch(mha_isa isa, int64_t dh, int64_t Lt);

/* One work item per (b, h), each computed by one thread in a fixed order:
 * bitwise the same for every thread count. */
void mha_attn_backward(mha_isa isa, const mha_microkernels *uk,
                       const mha_attn *a, const mha_attn_grad *g, int threads,
                       float *scratch, int64_t scratch_per_thread);

#endif
