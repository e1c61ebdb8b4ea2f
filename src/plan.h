/*
 * plan.h -- a planned forward pass and what its backward reads of it
 * (forward.c, backward.c); never installed.
 */
#ifndef MHA_PLAN_H
#define MHA_PLAN_H

#include "attention.h"

/* Shapes of a forward call, checked and derived once. */
typedef struct fwd_shape {
    int64_t B, Lq, Lk, Lt, E, H, dh, D;  /* D = H * dh, the inner width */
    int64_t n_q;             /* elements of query and out: B * Lq * E    */
    int64_t n_qd, n_kvd;     /* of projected q (and ctx), of k or v: * D */
    int64_t n_w;             /* of the attention weights                 */
} fwd_shape;

/* Checks everything about `a` but its data pointers. */
mha_status mha_fwd_check_shapes(const mha_module *m,
                                const mha_forward_args *a, fwd_shape *p);

struct mha_plan {
    const mha_module *m;
    fwd_shape shape;
    mha_isa isa;
    const mha_microkernels *uk;
    int threads;
    int64_t n_proj;          /* projected q, k, v: the larger layout */
    int64_t per_thread;      /* attention scratch floats per thread  */
    float *ws;               /* n_proj + n_qd (ctx) + stats + partials
                                + packed K/V + scratch */
    int64_t n_partials, n_packed;

    /* The last forward, kept for the backward: its arguments, where its
     * projections are in ws and how they were computed. */
    int has_saved;
    mha_forward_args saved;
    float *q, *k, *v;
    int64_t ldq, ldk, ldv;
    int fuse_qkv, fuse_kv;

    /* The backward's own workspace, allocated by its first call. */
    float *bws;
    int64_t bwd_per_thread, n_bpacked;
};

/* The head mask as the output projection uses it: NULL when it is absent
 * or all ones (one GEMM; the same bits as no mask), else head_mask. */
static inline const float *mha_head_mask_in_use(const float *head_mask,
                                                int64_t H)
{
    if (head_mask)
        for (int64_t h = 0; h < H; h++)
            if (head_mask[h] != 1.0f)
                return head_mask;
    return NULL;
}

/* The attention problem of a forward with arguments `a` on this plan. */
void mha_plan_attn(const mha_plan *plan, const mha_forward_args *a,
                   const mha_mask_plan *mask, mha_attn *at);

/* The per-thread scratch of the forward's attention. */
float *mha_plan_scratch(const mha_plan *p);

#endif
