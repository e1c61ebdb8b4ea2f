/*
 * attention.h -- the attention engine as its callers see it: scaled
 * dot-product attention over heads that are already projected, the part
 * of the work that is O(Lq x Lk).  The problem (mha_attn), the engine that
 * runs it, their workspaces, and the request a front door hands the
 * engine (request.c).  The headers of src/attention/, by role, each
 * including the one before:
 *
 *   mask.h       the mask plan: every mask kind, by index (mask.c)
 *   attention.h  the problem, the engine, the request: what the module's
 *                plans (src/module/) and the heads call (sdpa.c) use
 *   kv_cache.h   the KV cache's layout and calls (kv_cache.c, kv_pages.c)
 *   engine.h     inside the engine: packed K/V, tiles, the tiers' work
 *                items (src/attention/ only)
 *
 * The engine's files:
 *   mask.c            every mask kind -> additive biases, by index
 *   tiles.c           K/V packed by tile, the tile walk, masking a tile
 *   flash_forward.c   the FlashAttention forward of one query block
 *   decode.c          few query rows, many keys: split keys, merge
 *   weights.c         the attention weights, a second pass from the stats
 *   ref_forward.c     the float64 reference tier (the oracle)
 *   flash_backward.c  the flash backward of one (batch, head)
 *   ref_backward.c    the float64 reference backward
 *   run.c             engines, workspaces, threads: who runs what
 *   sdpa.c            mha_attention and its plan (the public calls)
 */
#ifndef MHA_ATTENTION_H
#define MHA_ATTENTION_H

#include "core/core.h"
#include "kernels/kernels.h"
#include "mask.h"

/* ======================================================================
 * The problem and the engine that runs it (what the callers use)
 * ====================================================================== */

/* Query rows per block and keys per tile of the flash tiers. */
enum { MHA_BR = 64, MHA_BC = 64 };
_Static_assert((int)MHA_BR <= (int)MHA_UK_ROWS,
               "a block's rows fit one softmax_rows call");

/*
 * One attention problem.  H query heads share Hkv key/value heads (Hkv
 * divides H; grouped-query attention, Hkv = H without it): query head h
 * reads K/V head g = h / (H / Hkv).  Element d of
 *     query head h of row i of batch b     q[(b * Lq + i) * ldq + h * dh + d]
 *     K/V head g of key row j of batch b   k[(b * Lk + j) * ldk + g * dh + d]
 *                                          (v likewise)
 *     the output of query head h           ctx[(b * Lq + i) * ldc + h * dh + d]
 * in the rows layout; with head strides hs and batch strides bs set
 * (heads first: ld = dh, hs = L * dh, bs = heads * L * dh), row i of head
 * h of batch b is at b * bs + i * ld + h * hs (mha_q_row and the rest).
 * bias_k / bias_v ([Hkv * dh], or NULL) and zero_attn append one key each
 * after the Lk real ones, in that order, as PyTorch does: Lt keys in all.
 */
typedef struct mha_attn {
    int64_t B, H, Hkv, Lq, Lk, Lt, dh;
    int64_t dv;             /* the values' (and the output's) head width;
                               0: dh (mha_dv) */
    const float *q, *k, *v;
    int64_t ldq, ldk, ldv;
    int64_t hsq, hsk, hsv, hsc;  /* head strides: 0 -> dh (rows layout)  */
    int64_t bsq, bsk, bsv, bsc;  /* batch strides: 0 -> L * ld           */
    const float *bias_k, *bias_v;
    int zero_attn;
    float scale;
    const mha_mask_plan *mask;   /* masks, causal, the window modifier */
    float softcap;          /* c > 0: scores s <- c tanh(s / c); 0: none */
    const float *alibi;     /* (H) ALiBi slopes, or NULL: real key j of row
                               i gets -slope_h |qpos - kpos| (after the
                               softcap, before the masks)               */
    const float *sinks;     /* (H) sink logits, or NULL: each row's
                               softmax denominator gains exp(sinks[h]),
                               a key with no value.  The row stats (m,
                               1/l) include it                          */
    int dropout;            /* training with p > 0 */
    float p_drop;
    uint64_t seed;
    int64_t drop_row0;      /* the dropout draw of row i is that of row
                               drop_row0 + i (a slice of the query rows,
                               mha_forward_args.q_start); 0 */
    float *ctx;
    int64_t ldc;
    float *stats;           /* [B][H][Lq][2]: the row's max m and 1 / l,
                               its softmax normaliser exp(m) * l; m is
                               -INFINITY for a row with no key.  (Kept
                               apart: m + log(l) loses l when |m| is huge) */
    mha_weights_mode weights;
    float *w;               /* (B, H, Lq, Lt) or (B, Lq, Lt), zeroed */
    float *partials;        /* the layout's partials, for decoding */
    float *packed;          /* the layout's packed K and V (flash tiers) */
    int64_t packed_tiles;   /* tiles per (b, g) in `packed`; 0: the count
                               for Lk keys.  1 with a KV cache: `packed`
                               then holds only the extra keys' tile */
    int prepacked;          /* K and V are held already (a KV cache): the
                               run writes only the extra keys' tile, and
                               k, v are unused */
    int in_place;           /* the flash tiers read the real keys and
                               values where they lie (mha_attn_run sets
                               it for decoding steps on given K and V):
                               no packed tiles, only their finite flags */
    int lazy_pack;          /* (set by mha_attn_run) each packed tile
                               is packed by the first block that reads
                               it, while its rows are in that core's
                               cache, rather than all before the blocks */
    int pack_only;          /* only pack K and V for a backward (the
                               flash tiers; nothing for ref): no ctx, no
                               stats (mha_attention_backward_part sets
                               the stats itself) */
    mha_kv_dtype x16;       /* MHA_KV_F32 (0): q, k, v and ctx are float.
                               MHA_KV_F16 or _BF16: they are arrays of that
                               16-bit type (the pointers cast; never read
                               as float), widened as a block's q rows are
                               loaded and K and V packed, ctx rounded as it
                               is written: sdpa.c's 16-bit calls on the
                               float32 kernels, no widened copies.  Flash
                               tiers only, no extra keys, no cache */
    const struct mha_kv_cache *kv;  /* that cache, or NULL: the real keys'
                               tiles are read from it in its dtype, and
                               `packed` holds one f32 tile per (b, g), the
                               extra keys' (packed_tiles 1) */
    const mha_microkernels *uk;  /* the tier's kernels: set by mha_attn_run
                                    and mha_attn_backward from the engine */
} mha_attn;

/* The factor of a kept probability under dropout: 1 / (1 - p), 0 when
 * p >= 1 (everything dropped), 1 without dropout.  The one place the
 * formula is written; float users round it once. */
static inline double mha_keep_scale(const mha_attn *a)
{
    if (!a->dropout)
        return 1.0;
    return a->p_drop < 1.0f ? 1.0 / (1.0 - (double)a->p_drop) : 0.0;
}

/* What runs a problem: the tier and the thread count, chosen once (by a
 * plan's create). */
typedef struct mha_engine {
    mha_isa isa;
    const mha_microkernels *uk;
    int threads;
} mha_engine;

/* The tier (mha_isa_get) and `num_threads` checked and resolved: 0 means
 * OpenMP's default (OMP_NUM_THREADS), 1 without OpenMP. */
mha_status mha_engine_init(mha_engine *e, int num_threads);

/* num_threads is in [0, 4096]. */
mha_status mha_check_threads(int num_threads);
/* need_weights is one of the three modes. */
mha_status mha_check_weights_mode(mha_weights_mode mode);
/* attn_weights is given iff need_weights asks for weights (a buffer the
 * call would not write is refused, not ignored). */
mha_status mha_check_mode_fields(mha_weights_mode need,
                                 const float *attn_weights);


/*
 * The forward's workspace, in floats from one base: the row stats,
 * decoding partials, packed K/V, then `threads` slices of per-thread
 * scratch.  Every part, and every thread's slice, starts at a multiple of
 * 16 floats (64 bytes): no thread's scratch shares a cache line with
 * another's, and the float64 scratch of the ref tier stays aligned.
 * dh and dv are the keys' and the values' head widths; the buffers are
 * sized for the wider.
 */
typedef struct mha_attn_layout {
    int64_t stats, partials, packed, scratch;   /* offsets            */
    int64_t per_thread;                         /* floats per thread  */
    int64_t total;                              /* floats in all      */
} mha_attn_layout;
mha_status mha_attn_layout_forward(const mha_engine *e, int64_t B, int64_t H,
                                   int64_t Hkv, int64_t Lq, int64_t Lk,
                                   int64_t Lt, int64_t dh, int64_t dv,
                                   int prepacked, mha_attn_layout *out);
/* The backward's own workspace: K and V packed its way (offset `packed`,
 * flash tiers), then per-thread scratch (more with a softcap); stats and
 * partials unused. */
mha_status mha_attn_layout_backward(const mha_engine *e, int64_t B,
                                    int64_t Hkv, int64_t Lk, int64_t Lt,
                                    int64_t dh, int64_t dv, int softcap,
                                    mha_attn_layout *out);

/* Runs the whole problem: ctx, the row stats and, when asked, the weights.
 * scratch is the layout's per-thread part.  Results do not depend on the
 * thread count. */
void mha_attn_run(const mha_engine *e, const mha_attn *a, float *scratch,
                  int64_t per_thread);

/*
 * The backward of a problem whose forward ran with the same mha_attn (its
 * stats and, for the flash tiers, packed K/V kept).  dctx is the gradient
 * of ctx; dq, dk, dv (laid out as q, k, v with their own row strides) are
 * overwritten, dk and dv summed over the query heads of each K/V head's
 * group; dbias_k / dbias_v ([B][Hkv][dh], or NULL) receive each (b, g)'s
 * gradient of bias_k / bias_v, summed over b by the caller.
 */
typedef struct mha_attn_grad {
    const float *dctx;
    int64_t lddc;
    float *dq, *dk, *dv;   /* with the problem's x16: dctx, dq, dk and dv
                              that 16-bit type's arrays, cast (dctx widened
                              as a block's rows load, the gradients
                              rounded as they are stored)              */
    int64_t lddq, lddk, lddv;
    /* head and batch strides as mha_attn's (0: the rows layout's): the
     * layout of dctx and dq is q's, of dk and dv k's */
    int64_t hsdc, hsdq, hsdk, hsdv, bsdc, bsdq, bsdk, bsdv;
    float *dbias_k, *dbias_v;
    float *dsinks;   /* [B][H], or NULL: dL/d sinks[h] of each (b, h),
                        summed over b by the caller (with sinks)       */
    float *packed;   /* the backward layout's packed K and V */
    /* A part of a split-key problem (mha_attention_backward_part), or
     * NULL / NULL: each row's statistics over ALL parts, [B][H][Lq].
     * row_lse: the global log-sum-exp (the flash tiers read it through
     * the stats, set to (lse, 1) by the caller; the ref tier here);
     * row_delta: delta_i = dO_i . out_i in float64, used in place of the
     * sum over this part's keys. */
    const float *row_lse;
    const double *row_delta;
} mha_attn_grad;

/* One work item per (b, g), each computed by one thread in a fixed order
 * (the group's query heads in ascending order, each one's query blocks in
 * order): bitwise the same for every thread count. */
void mha_attn_backward(const mha_engine *e, const mha_attn *a,
                       const mha_attn_grad *g, float *scratch,
                       int64_t per_thread);

/* ---- the score modifiers' settings (modifiers.c) ---------------------- */
/* Checks the softcap, ALiBi slopes and window of `m` for H heads (RoPE is
 * rope.c's); `who` prefixes the message. */
mha_status mha_modifiers_check(const mha_modifiers *m, int64_t H,
                               const char *who);
/* Whether two calls' modifiers are the same, RoPE's included (the
 * window's bounds only when it is on). */
int mha_modifiers_same(const mha_modifiers *a, const mha_modifiers *b);
/* Whether `m` changes nothing: no softcap, ALiBi, window or RoPE. */
int mha_modifiers_none(const mha_modifiers *m);
/* attention_chunk C is >= 0 (0: none). */
mha_status mha_chunk_check(int64_t chunk, const char *who);
/* The sinks (H) are finite. */
mha_status mha_sinks_check(const float *sinks, int64_t H, const char *who);

/* ======================================================================
 * The request (request.c): what a front door hands the engine
 * ====================================================================== */

/*
 * One attention, as a caller states it: the heads call (mha_attention and
 * its plans, sdpa.c) and the module's plans (forward.c, backward.c) each
 * fill one, and the checks every attention shares (the cache read, the
 * masks, the modifiers, the weights asked for, the score range) and the
 * problem the tiers run are written once, in request.c.  Each caller
 * checks only its own inputs: the module its projections, the heads call
 * its layout, dtype and buffers.
 */
typedef struct mha_attn_request {
    int64_t B, H, Hkv, dh, dv, Lq;
    int64_t Lk;            /* the real keys a run reads: of k and v, or
                              with a cache the longest sequence once the
                              append is in (mha_attn_request_masks sets
                              it; the cache's capacity before)        */
    int64_t kv_len;        /* the caller's kv_len: with a cache 0 or Lk */
    const float *q, *k, *v;   /* with a cache k, v: NULL, or the `append`
                                 new tokens of every sequence           */
    int64_t ldq, ldk, ldv;
    int64_t hsq, hsk, hsv, hso, bsq, bsk, bsv, bso;  /* heads first; 0 */
    float *out;
    int64_t ldo;
    const float *bias_k, *bias_v;  /* [Hkv dh], or NULL: one extra key */
    int zero_attn;                 /* a zero key after it              */
    float scale;
    const mha_modifiers *mods;     /* softcap, ALiBi, window (RoPE is the
                                      caller's, applied before); NULL   */
    const float *slopes;           /* (H) ALiBi's slopes in use          */
    const float *sinks;            /* (H), or NULL                       */
    int64_t chunk;                 /* attention_chunk; 0                 */
    mha_mask attn_mask, key_padding_mask;
    const int64_t *key_lengths;
    mha_causal causal;
    int64_t q_start, q_total;      /* a slice of the query rows; 0 0     */
    int q_offset_given;            /* a part of a split problem: query i */
    int64_t q_offset;              /* at q_offset + i                    */
    int dropout;                   /* training with p_drop > 0           */
    float p_drop;
    uint64_t seed;
    mha_weights_mode need_weights;
    float *attn_weights;
    mha_kv_cache *cache;
    int64_t append;        /* with a cache: k and v hold this many new
                              tokens per sequence, which the run appends
                              (the module's step); 0: appended already */
    double q_growth;       /* what |q| may grow by after its scan (RoPE
                              applied later turns each pair: 2); 1     */
    mha_kv_dtype x16;      /* q, k, v and out 16-bit (mha_attn.x16) */
} mha_attn_request;

/* The keys after the real ones: bias_k, then the zero key. */
static inline int64_t mha_request_extra(const mha_attn_request *r)
{
    return (r->bias_k != NULL) + (r->zero_attn != 0);
}

/* What holds for every run of a plan, from the shapes and options: the
 * cache's shape and window, the causal mode, the modifiers and chunks,
 * the weights' mode.  `who` begins a modifier's refusal. */
mha_status mha_attn_request_check(const mha_attn_request *r,
                                  const char *who);

/* The first checks of a run: the weights' buffer given iff asked for,
 * with a cache Lk set to its longest sequence once the append is in (and
 * kv_len checked against it), the masks. */
mha_status mha_attn_request_masks(mha_attn_request *r, mha_mask_plan *mask);

/* The floats of the weights a run writes, once its masks set Lk: (B, H,
 * Lq, Lt) per head, (B, Lq, Lt) averaged. */
int64_t mha_attn_request_weights_floats(const mha_attn_request *r);

/* The checks of a run's data, after its masks, before anything is
 * written: the score range (q, the keys given, the cache's keys), and for
 * an append the values an f16 cache can hold and a paged cache's pages
 * (taken: the last check). */
mha_status mha_attn_request_prepare(const mha_attn_request *r,
                                    const mha_microkernels *uk, int threads);

/* The problem the tiers run: the request with its masks, on workspace
 * `ws` of layout `lay` (stats, partials, packed K/V). */
mha_attn mha_attn_request_problem(const mha_attn_request *r,
                                  const mha_mask_plan *mask, float *ws,
                                  const mha_attn_layout *lay);

/* Runs a prepared request: the append, the weights zeroed, the problem
 * run on `at` (from mha_attn_request_problem; with a cache pointed at it
 * here).  A rotated cache turns q (copied into qbuf, n_q floats, unless
 * at->q is qbuf already) to the stored keys' basis and out back. */
void mha_attn_request_run(const mha_engine *e, const mha_attn_request *r,
                          mha_attn *at, mha_mask_plan *mask, float *qbuf,
                          float *scratch, int64_t per_thread);

#endif /* MHA_ATTENTION_H */
