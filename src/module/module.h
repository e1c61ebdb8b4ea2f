/*
 * module.h -- the module room: parameters, the linear layer (the only
 * caller of the GEMM library), plans, forward, backward, pruning.
 * Never installed.
 */
#ifndef MHA_MODULE_H
#define MHA_MODULE_H

#include "core/core.h"
#include "attention/kv_cache.h"

#include <stdint.h>

/* ---- the module (module.c) --------------------------------------------- */
enum { MHA_MAX_PARAMS = 9 };

typedef struct mha_param {
    mha_param_info info;
    int64_t offset;              /* into mha_module.params, in floats */
} mha_param;

struct mha_module {
    mha_config cfg;              /* resolved: kdim, vdim, scale filled in */
    int scale_given;             /* cfg.scale was chosen, not the default */
    int64_t head_dim;            /* d_h (E / H unless configured) */
    int64_t inner_dim;           /* D = H * d_h, the heads side by side */
    int64_t kv_dim;              /* Dkv = H_kv * d_h, of k (= D but in
                                    grouped-query modules) */
    int64_t v_head_dim;          /* d_v (d_h unless configured) */
    int64_t v_inner_dim;         /* Dv = H * d_v: ctx, W_o's columns */
    int64_t kv_vdim;             /* Dvkv = H_kv * d_v, of v */
    int packed;                  /* kdim == vdim == E, d_v == d_h, no
                                    grouping: in_proj_weight */
    int nparams;
    mha_param param[MHA_MAX_PARAMS];
    float *params;               /* every parameter, one allocation */
    int64_t params_numel;

    /* Views into params, set once at create (NULL when absent). */
    const float *w_q, *w_k, *w_v;  /* [D, E], [Dkv, kdim], [Dvkv, vdim] */
    const float *b_q, *b_k, *b_v;  /* [D], [Dkv], [Dvkv] */
    const float *w_o, *b_o;        /* [E, Dv], [E] */
    const float *bias_k, *bias_v;  /* [Dkv], [Dvkv] */
    const float *sinks;            /* [H], with cfg.sinks */
    float *slopes;                 /* [H] ALiBi's slopes (cfg.mods.alibi):
                                      the caller's copy, or the defaults */
};

/* ---- the GEMM backends (gemm.c: the only file that calls a BLAS) ------- */

typedef enum { MHA_GEMM_CBLAS = 0, MHA_GEMM_ONEDNN = 1 } mha_gemm_kind;

/* The backend resolved (MHA_GEMM read once): an error naming MHA_GEMM for
 * an unknown one or oneDNN in a build without it.  Every entry point that
 * reaches the linear layer checks it first (mha_engine_init does). */
mha_status mha_gemm_check(void);

/* A BLAS with a thread pool of its own set to one thread (before a
 * parallel region of GEMM blocks). */
void mha_gemm_serial(void);

/* Row-major C = alpha op(A) op(B) + beta C, op = transpose when trans_*,
 * on the calling thread; and y = alpha A x + beta y for A (m, n). */
void mha_sgemm(int trans_a, int trans_b, int m, int n, int k, float alpha,
               const float *a, int lda, const float *b, int ldb, float beta,
               float *c, int ldc);
void mha_sgemv(int m, int n, float alpha, const float *a, int lda,
               const float *x, float beta, float *y);

/* ---- the linear layer (linear.c) ---------------------------------------- */
/*
 * Every call runs on `threads` OpenMP threads (0: the OpenMP default) over
 * a grid of blocks fixed by the shapes, one single-threaded GEMM call per
 * block, so the result bits do not depend on the thread count (linear.c).
 * (They depend on the backend and the CPU.)
 *
 * y (rows, n_out), row stride ldy  =  x (rows, n_in), row stride ldx
 *                                     times w^T, w (n_out, n_in) row-major,
 *                                     plus b (n_out) broadcast over rows
 *                                     (b may be NULL).
 */
void mha_linear(const float *x, int64_t rows, int64_t n_in, int64_t ldx,
                const float *w, int64_t n_out, const float *b,
                float *y, int64_t ldy, int threads);

/*
 * mha_linear with x's n_in columns (and w's) in nblk equal blocks, block t
 * scaled by scale[t] (scale NULL: all 1), blocks scaled by 0 skipped:
 *   y = x_0 w_0^T s_0 + ... + b.   The output projection under a head mask.
 */
void mha_linear_blocks(const float *x, int64_t rows, int64_t n_in,
                       int64_t ldx, const float *w, int64_t n_out,
                       const float *b, const float *scale, int64_t nblk,
                       float *y, int64_t ldy, int threads);

/* The gradients of mha_linear (beta 0: overwrite, 1: add):
 *   dx = dy w,   dw = dy^T x,   db = column sums of dy (db may be NULL). */
void mha_linear_grad_input(const float *dy, int64_t rows, int64_t n_out,
                           int64_t lddy, const float *w, int64_t n_in,
                           float beta, float *dx, int64_t lddx, int threads);
void mha_linear_grad_params(const float *dy, int64_t rows, int64_t n_out,
                            int64_t lddy, const float *x, int64_t n_in,
                            int64_t ldx, float beta, float *dw, float *db,
                            int threads);
/* mha_linear_grad_params of mha_linear_blocks: dw's column block t is
 * scale[t] dy^T x_t (+ itself when beta = 1); db is unscaled. */
void mha_linear_grad_params_blocks(const float *dy, int64_t rows,
                                   int64_t n_out, int64_t lddy,
                                   const float *x, int64_t n_in, int64_t ldx,
                                   const float *scale, int64_t nblk,
                                   float beta, float *dw, float *db,
                                   int threads);

/* The linear layer on 16-bit data (bf = 1: bf16, 0: f16), y = x w^T + b,
 * x and y 16-bit, w and b the module's float32 rounded to the dtype:
 * kernel = 1 on the bf16 kernels (bf16 only, mha_bf16_tier() AMX or
 * AVX512), 0 widened to float32 around the SGEMM backend.
 * mha_linear16_prepare writes w, rounded, as the kernels read it into
 * mha_linear16_weight_floats(kernel, n_out, n_in) floats of wt and
 * returns the largest |w| (the range check, in the same pass); b is
 * given rounded already (or NULL).  scratch: each of the threads' share,
 * mha_linear16_scratch_floats(kernel, n_in) floats, 64-byte aligned.
 * mha_linear16 returns how many outputs of the widened path rounded a
 * finite sum to +-inf (past f16's 65504; bf16 holds float32's range,
 * and its kernels do not count). */
int64_t mha_linear16_weight_floats(int kernel, int64_t n_out, int64_t n_in);
int64_t mha_linear16_scratch_floats(int kernel, int64_t n_in);
float mha_linear16_prepare(const float *w, int64_t n_out, int64_t n_in,
                           int kernel, int bf, float *wt, int threads);
int64_t mha_linear16(const uint16_t *x, int64_t rows, int64_t n_in,
                     int64_t ldx, int bf, int kernel, const float *wt,
                     int64_t n_out, const float *b, uint16_t *y, int64_t ldy,
                     float *scratch, int threads);

/* Sums of several products rounded once, y = x_0 w_0^T + x_1 w_1^T + ...
 * + b (the parts in order, each block's float32 sums carried from part to
 * part): the input gradient of a tensor that served as several inputs.
 * scratch: mha_linear16_scratch_floats of the widest n_in, per thread. */
typedef struct mha_lin16_part {
    const uint16_t *x;       /* (rows, n_in), rows ldx apart              */
    int64_t n_in, ldx;
    const float *wt;         /* as mha_linear16_prepare(_t) wrote it      */
} mha_lin16_part;
int64_t mha_linear16_sum(const mha_lin16_part *parts, int nparts,
                         int64_t rows, int bf, int kernel, int64_t n_out,
                         const float *b, uint16_t *y, int64_t ldy,
                         float *scratch, int threads);

/* mha_linear16_prepare of up to 8 weights in one team of threads (one
 * parallel region instead of one each: a small call's barriers); returns
 * the largest |w| of them all. */
typedef struct mha_lin16_weight {
    const float *w;
    int64_t n_out, n_in;
    float *dst;
} mha_lin16_weight;
float mha_linear16_prepare_all(const mha_lin16_weight *w, int n, int kernel,
                               int bf, int threads);

/* The weight of the input gradient dx = dy w, w (n_out, n_in): prepared
 * as mha_linear16_prepare prepares the weight of a layer from n_out
 * inputs to n_in outputs (mha_linear16_weight_floats(kernel, n_in,
 * n_out) floats), for mha_linear16(dy, rows, n_out, ..., n_in, ...). */
void mha_linear16_prepare_t(const float *w, int64_t n_out, int64_t n_in,
                            int kernel, int bf, float *wt, int threads);

/* The weight gradient on 16-bit data, float32 results:
 *   dw (n_out, n_in) = dy^T x (+ dw when beta = 1),
 *   db (n_out) = column sums of dy, float64 in row order (db may be NULL),
 * dy (rows, n_out) rows lddy apart, x (rows, n_in) rows ldx apart.
 * scratch: mha_linear16_grad_floats(kernel, rows, n_out, n_in, threads)
 * floats, 64-byte aligned. */
int64_t mha_linear16_grad_floats(int kernel, int64_t rows, int64_t n_out,
                                 int64_t n_in, int threads);
void mha_linear16_grad_params(const uint16_t *dy, int64_t rows,
                              int64_t n_out, int64_t lddy, const uint16_t *x,
                              int64_t n_in, int64_t ldx, int bf, int kernel,
                              float beta, float *dw, float *db,
                              float *scratch, int threads);

/* ---- plans (forward.c, backward.c) -------------------------------------- */

/* Shapes of a forward call, checked and derived once. */
typedef struct fwd_shape {
    int64_t B, Lq, Lk, Lt, E, H, dh, D;  /* D = H * dh, the inner width */
    int64_t Hkv, Dkv;        /* K/V heads, Dkv = Hkv * dh: k's width     */
    int64_t dv, Dv, Dvkv;    /* the values' d_v; ctx's H d_v, v's Hkv d_v */
    int64_t n_q;             /* elements of query and out: B * Lq * E    */
    int64_t n_qd, n_kvd;     /* of projected q: * D; k: * Dkv            */
    int64_t n_ctx, n_vd;     /* of ctx: B Lq * Dv; projected v: B Lk * Dvkv */
    int64_t n_w;             /* of the attention weights                 */
} fwd_shape;

/* A KV cache is for self-attention: refused, by name, for a module whose
 * kdim or vdim differ from E (mha_kv_cache_for_module, a cached forward). */
mha_status mha_module_check_self_attention(const mha_module *m);

/* A forward's query, key and value, whatever their dtype (NULL when
 * not given). */
static inline const void *mha_fwd_query(const mha_forward_args *a)
{
    return a->dtype == MHA_DTYPE_F32 ? (const void *)a->query
                                     : (const void *)a->query16;
}
static inline const void *mha_fwd_key(const mha_forward_args *a)
{
    return a->dtype == MHA_DTYPE_F32 ? (const void *)a->key
                                     : (const void *)a->key16;
}
static inline const void *mha_fwd_value(const mha_forward_args *a)
{
    return a->dtype == MHA_DTYPE_F32 ? (const void *)a->value
                                     : (const void *)a->value16;
}

/* Checks everything about `a` but its data pointers. */
mha_status mha_fwd_check_shapes(const mha_module *m,
                                const mha_forward_args *a, fwd_shape *p);

struct mha_plan {
    const mha_module *m;
    fwd_shape shape;
    mha_dtype dtype;         /* of the data: F32, or 16-bit (forward16.c) */
    mha_engine eng;          /* tier and threads, chosen at create       */
    mha_attn_layout lay;     /* the attention's part of ws               */
    int64_t cache_capacity;  /* > 0: a plan for forwards with a KV cache
                                of at most this capacity                */
    int64_t n_proj;          /* projected q, k, v: the larger layout     */
    float *ws;               /* n_proj + n_ctx (ctx) + lay.total         */

    /* The last forward, kept for the backward: its arguments, a
     * fingerprint of their contents, where its projections are in ws and
     * how they were computed. */
    int has_saved;
    mha_forward_args saved;
    uint64_t saved_print;
    float *q, *k, *v;
    int64_t ldq, ldk, ldv;
    int fuse_qkv, fuse_kv;

    /* A 16-bit forward's workspace (forward16.c), n_ws16 floats: what
     * the backward reads of the last forward is in it (q16, k16, v16,
     * ctx16, lse at these pointers); and the 16-bit backward's own. */
    float *ws16;
    int64_t n_ws16;
    uint16_t *q16, *k16, *v16, *ctx16;
    float *lse16;
    float *bws16;
    int64_t n_bws16;
    mha_attention_plan *att16;   /* the 16-bit attention's own plan (first
                                    16-bit forward): its backward reuses
                                    the forward it kept */

    /* The backward's own workspace, allocated by its first call. */
    float *bws;
    mha_attn_layout blay;
};

/* A fingerprint of the contents of the forward's inputs, masks, key
 * lengths and head mask (mha_fingerprint of each). */
uint64_t mha_fwd_fingerprint(const mha_module *m, const fwd_shape *s,
                             const mha_forward_args *a);

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

/* The forward on 16-bit data (forward16.c): `a` checked by
 * mha_fwd_check_shapes and matching the plan's shape. */
mha_status mha_forward16(mha_plan *plan, const mha_forward_args *a);

/* Whether the 16-bit linear layer runs on the bf16 kernels (1: bf16
 * data where mha_bf16_kernel() is not "float32") or widened (0);
 * an error for a bad MHA_BF16. */
mha_status mha_linear16_kernel(mha_dtype dtype, int *kernel);

/* The attention of a 16-bit forward `a` on this plan: shapes, masks,
 * modifiers, threads and dtype; the caller sets the data (and sinks). */
mha_attention_args mha_attention16_args(const mha_plan *plan,
                                        const mha_forward_args *a);

/* *buf holding at least `floats` floats (64-byte aligned), grown when
 * *have is less (the old contents dropped); `what` names it in the
 * error.  A plan's 16-bit workspaces, kept until mha_plan_free. */
mha_status mha_plan_buffer(float **buf, int64_t *have, int64_t floats,
                           const char *what);

/* Its backward (backward16.c): `a` the plan's last forward (checked by
 * backward.c), g's 16-bit fields. */
mha_status mha_backward16(mha_plan *plan, const mha_forward_args *a,
                          const mha_backward_args *g);

/* The attention a forward with arguments `a` asks of the engine: the
 * plan's projections (q, k, v where the last forward put them), the
 * module's extra keys and modifiers, the call's masks and cache. */
mha_attn_request mha_fwd_request(const mha_plan *plan,
                                 const mha_forward_args *a);
/* The attention's part of the plan's workspace (its layout: lay). */
static inline float *mha_plan_attn_ws(const mha_plan *p)
{
    return p->ws + p->n_proj + p->shape.n_ctx;
}


#endif /* MHA_MODULE_H */
