/*
 * attention.h -- the attention engine: scaled dot-product attention over
 * heads that are already projected, the part of the work that is
 * O(Lq x Lk).  One private header for the engine's files (src/attention/)
 * and for its callers, the module's plans (src/module/) and the public
 * mha_attention calls (sdpa.c).
 *
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

/* ---- masks (mask.c): every mask kind -> one row of additive biases ----- */
typedef struct mha_mask_plan {
    int64_t batch, heads, q_len, kv_len, total_keys;
    mha_mask attn;             /* kind NONE if absent */
    int64_t attn_stride_b, attn_stride_h;   /* 0 where broadcast */
    mha_mask pad;              /* kind NONE if absent */
    int64_t pad_stride_b;
    const int64_t *key_lengths;
    mha_causal causal;
    const int64_t *seq_lengths;  /* (B) or NULL: each sequence's own key
                                    count, to which bottom-right causal
                                    masking aligns instead of Lk (the
                                    sequences of a KV cache) */
    int64_t window, ring;        /* window > 0: a sliding-window KV cache.
                                    Key column j is then slot j of a ring
                                    of `ring` slots, holding the position
                                    mha_ring_position gives, and row i of
                                    batch b sees the positions
                                    mha_mask_window gives (seq_lengths
                                    set, no explicit mask, no key
                                    lengths) */
    int band;                    /* nonzero: the window score modifier
                                    (mha_modifiers.window): row i sees
                                    keys whose position lies in
                                    [qpos - band_left, qpos + band_right],
                                    qpos its own (mha_mask_qpos); -1: no
                                    bound on that side */
    int64_t band_left, band_right;
    int64_t chunk;               /* > 0: chunked attention (attention_
                                    chunk): row i sees keys whose position
                                    lies in qpos's own chunk of `chunk`
                                    positions; 0: none */
    int64_t qpos_shift;          /* added to every query's position (a
                                    part of a split problem, given as
                                    mha_attention_args.q_offset, or a
                                    slice of the query rows); 0 */
    int64_t row_shift;           /* added to the row index by top-left
                                    causal masking: a slice's q_start; 0 */
} mha_mask_plan;

/* The largest |shift| of the query positions a caller may give
 * (mha_attention_args.q_offset, a slice's q_total): 2^61.  With Lq and Lk
 * below 2^60 (their tensors' sizes are checked to 2^60 floats), a query's
 * position, its distance to a key, and either plus or minus a window
 * bound under 2^62 then all stay inside int64. */
#define MHA_MAX_POSITION_SHIFT (INT64_C(1) << 61)

struct mha_attn_request;
/* The mask plan of a request (request.c): its masks, key lengths and
 * causal mode validated against B, H, Lq and Lk (Lk: the keys a run
 * reads; with a cache the longest sequence, its refusals saying so),
 * a slice's or a part's query shift, the window and the chunks. */
mha_status mha_mask_plan_of(mha_mask_plan *plan,
                            const struct mha_attn_request *r);

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

/* The key padding mask alone on columns j0 .. j0+n-1 of batch b (the same
 * for every head and row): 0 or -INFINITY, or the additive values as they
 * are (finite or -inf, checked by the plan).  Returns the number of keys
 * not excluded. */
int64_t mha_mask_key_cols(const mha_mask_plan *plan, int64_t b, int64_t j0,
                          int64_t n, float *row);

/* The first position of the chunk of C positions holding `pos` (which
 * may be negative: floor division). */
static inline int64_t mha_chunk_start(int64_t pos, int64_t C)
{
    const int64_t q = pos / C;
    return (q - (pos % C < 0)) * C;
}

/* The position of query row i of batch b, aligned bottom-right: i + Lk -
 * Lq, Lk the sequence's own length with a KV cache.  Key j's position is
 * j (with a sliding-window cache, the position its slot holds). */
static inline int64_t mha_mask_qpos(const mha_mask_plan *p, int64_t b,
                                    int64_t i)
{
    return i + (p->seq_lengths ? p->seq_lengths[b] : p->kv_len) - p->q_len +
           p->qpos_shift;
}

/* The last real key that causal masking, key_lengths and the window leave
 * to query row i of batch b (-1: none).  Explicit masks may block more. */
int64_t mha_mask_last(const mha_mask_plan *plan, int64_t b, int64_t i);
/* The first real key the window leaves to row i (0 without one); a row
 * whose first is past its last sees no real key. */
int64_t mha_mask_first(const mha_mask_plan *plan, int64_t b, int64_t i);

/*
 * A sliding-window cache's ring: the position held by slot s of a sequence
 * of length n (positions 0 .. n-1, position p in slot p % ring), < 0 for
 * a slot never written.  head = n % ring is the slot the next position
 * takes: slots before it hold this lap's positions, the others the last
 * lap's.  Positions rise by one from slot to slot except at head.
 */
static inline int64_t mha_ring_position(int64_t n, int64_t ring, int64_t s)
{
    const int64_t head = n % ring;
    return n - head + s - (s < head ? 0 : ring);
}

/* With a window: the positions row i of batch b sees, *lo .. the one
 * returned, its own (none when that is < 0). */
int64_t mha_mask_window(const mha_mask_plan *plan, int64_t b, int64_t i,
                        int64_t *lo);

/* Whether the plan has an explicit (memory) mask, as opposed to masking
 * that follows from indices alone. */
static inline int mha_mask_has_explicit(const mha_mask_plan *p)
{
    return p->attn.kind != MHA_MASK_NONE || p->pad.kind != MHA_MASK_NONE;
}

/* Whether the only explicit mask is the key padding mask: one bias row
 * per batch and tile then serves every row (MHA_TILE_KEYS). */
static inline int mha_mask_keys_only(const mha_mask_plan *p)
{
    return p->attn.kind == MHA_MASK_NONE && p->pad.kind != MHA_MASK_NONE;
}


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
    int pack_only;          /* only pack K and V for a backward (the
                               flash tiers; nothing for ref): no ctx, no
                               stats (mha_attention_backward_part sets
                               the stats itself) */
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
 */
typedef struct mha_attn_layout {
    int64_t stats, partials, packed, scratch;   /* offsets            */
    int64_t per_thread;                         /* floats per thread  */
    int64_t total;                              /* floats in all      */
} mha_attn_layout;
mha_status mha_attn_layout_forward(const mha_engine *e, int64_t B, int64_t H,
                                   int64_t Hkv, int64_t Lq, int64_t Lk,
                                   int64_t Lt, int64_t dh, int prepacked,
                                   mha_attn_layout *out);
/* The backward's own workspace: K and V packed its way (offset `packed`,
 * flash tiers), then per-thread scratch (more with a softcap); stats and
 * partials unused. */
mha_status mha_attn_layout_backward(const mha_engine *e, int64_t B,
                                    int64_t Hkv, int64_t Lk, int64_t Lt,
                                    int64_t dh, int softcap,
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
    float *dq, *dk, *dv;
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

/* The checks of a run's data, after its masks, before anything is
 * written: the score range (q, the keys given, the cache's keys), and for
 * an append the values an f16 cache can hold and a paged cache's pages
 * (taken: the last check). */
mha_status mha_attn_request_prepare(const mha_attn_request *r, int threads);

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

/*
 * The KV cache (kv_cache.c): keys and values already projected, stored in
 * the engine's tile layout (mha_packed below: kt tiles, v tiles, a finite
 * flag per tile) in the cache's dtype (kernels.h), with room for
 * `capacity` keys per sequence, so attending reads it as it is: no
 * repacking, no conversion, no copy, no allocation.  The extra keys of a
 * module (bias_k, the zero key) have an f32 tile of their own per (b, g).
 */
struct mha_kv_cache {
    int64_t B, Hkv, dh, capacity;
    int64_t dv;             /* the values' head width (dh unless
                               v_head_dim says otherwise); a value tile
                               has a key tile's room, tile_bytes      */
    int latent;             /* the values are the keys' first dv
                               elements: one plane (v = k) of key tiles
                               stored as rows, [MHA_BC][dh]; the
                               attention widens a tile at a time
                               (mha_tile_source)                      */
    int64_t window;         /* 0, or W: a ring of `capacity` slots (mha.h) */
    int64_t *start;         /* [B] the oldest position held (window only:
                               the ring overwrote the ones before)        */
    int64_t tiles;          /* per (b, g): ceil(capacity / MHA_BC)        */
    mha_kv_dtype dtype;
    int64_t rot_block;      /* rotate: the Hadamard blocks' size (a power
                               of two dividing dh); 0: not rotated     */
    int64_t tile_bytes;     /* one kt or v tile: mha_kv_tile_bytes        */
    int64_t *len;           /* [B] keys held per sequence                 */
    unsigned char *k, *v;   /* [B][Hkv][tiles] kt tiles, then v tiles     */
    float *finite;          /* [B][Hkv][tiles] 1.0f: every value finite
                               (of the columns 0 .. len - 1 a sequence
                               fills; with a window, of the whole tile,
                               since a ring's tile holds any of its
                               columns, older positions included)      */
    float *extra;           /* mha_packed_floats(B, Hkv, 0, dh): one tile */
    double key_amax;        /* the largest finite |k| ever appended since
                               the last reset of every sequence (an upper
                               bound of what the cache holds): what
                               mha_check_score_range reads of the keys  */
    /* Paged (page > 0, kv_pages.c): the planes are a pool of pages, a
     * page `page` positions (tpp tiles) of every K/V head; sequence b's
     * i-th page is table[b][i].  A page held by several sequences (a
     * fork) is copied before one of them writes it (copy on write).
     * Page `pages` is the null page, zeros, never written: what a table
     * holds past a sequence's pages, so a read there is harmless. */
    int64_t page, tpp;      /* positions and tiles per page; 0 0: contiguous */
    int64_t pages;          /* the pool's pages (the null page not counted) */
    int64_t table_len;      /* pages per sequence: ceil(capacity / page)  */
    int32_t *table;         /* [B][table_len] page ids                    */
    int32_t *refs;          /* [pages] the table entries holding each page */
    int32_t *free_pages;    /* [pages] a stack of the free ones ...       */
    int64_t n_free;         /* ... n_free deep                            */
    int64_t view_shift;     /* a view's (mha_kv_cache_view): its queries
                               sit this many positions past its end; 0.
                               A cascade's shared prefix sets q_len, so
                               that every query sees every key           */
};

/* Index of tile t of (b, g) among its plane's tiles (and flags): the
 * contiguous [B][Hkv][tiles], or through the page table, [Hkv][pages +
 * 1][tpp] (each head's pages side by side, so that a sequence whose pages
 * were taken in order streams as from a contiguous cache). */
static inline int64_t mha_kv_tile_index(const mha_kv_cache *c, int64_t b,
                                        int64_t g, int64_t t)
{
    if (!c->page)
        return (b * c->Hkv + g) * c->tiles + t;
    const int64_t pg = c->table[b * c->table_len + t / c->tpp];
    return (g * (c->pages + 1) + pg) * c->tpp + t % c->tpp;
}

/* A read-only view of sequence b of c as a cache of one sequence (its
 * tiles, flags, length, page table), for attention on that sequence
 * alone; `extra` is the view's own extra-key tile (one (b, g) set of
 * mha_packed_floats(1, Hkv, 0, dh), zeros), since the cache's lies in
 * planes of all B. */
void mha_kv_cache_view(const mha_kv_cache *c, int64_t b, float *extra,
                       mha_kv_cache *view);

/* The pages a paged sequence of `len` positions holds: ceil(len / page). */
static inline int64_t mha_kv_pages_of(const mha_kv_cache *c, int64_t len)
{
    return len / c->page + (len % c->page != 0);
}

/* ---- the page pool (kv_pages.c) ----
 * Sequence b's positions len[b] .. len[b] + n - 1 made writable: pages
 * added where it has none, a page it shares copied; all of them, for
 * every sequence (b = -1) or one, or none and the pool's shortage named.
 * MHA_OK without doing anything for a contiguous cache. */
mha_status mha_kv_pages_reserve(mha_kv_cache *c, int64_t b, int64_t n);
/* Sequence b keeps its first `keep` pages; the rest go back to the pool
 * once no sequence holds them. */
void mha_kv_pages_release(mha_kv_cache *c, int64_t b, int64_t keep);
/* Whether the tables and counts agree: every page's refs is the number
 * of table entries naming it, the free stack is exactly the pages no one
 * holds, and no sequence holds a page past its length.  For tests. */
int mha_kv_pages_consistent(const mha_kv_cache *c);

/* Refuses n tokens' keys and values (rows ldk, ldv apart, H_kv d_h each)
 * that sequence b of an f16 cache cannot hold: a finite |x| >= 65520,
 * which f16 would store as Inf.  MHA_OK for the other dtypes. */
mha_status mha_kv_cache_check_values(const mha_kv_cache *c, int64_t b,
                                     const float *k, int64_t ldk,
                                     const float *v, int64_t ldv, int64_t n);

/* Tile t of (b, g) of the cache's keys (kt) and values (v): the pointer
 * the kernels take (a q8 tile's codes, its scales just before). */
const unsigned char *mha_kv_cache_k_tile(const mha_kv_cache *c, int64_t b,
                                         int64_t g, int64_t t);
const unsigned char *mha_kv_cache_v_tile(const mha_kv_cache *c, int64_t b,
                                         int64_t g, int64_t t);

/* Element d of key (value) column col of a cache tile, as the float it
 * stands for: the kernels' layouts, or a latent cache's rows (its value
 * the key's first dv elements, the same tile). */
static inline float mha_kv_cache_key_at(const mha_kv_cache *c,
                                        const void *kt, int64_t col,
                                        int64_t d)
{
    return c->latent ? mha_kv_elem(c->dtype, kt, col * c->dh + d)
                     : mha_kt_load(c->dtype, kt, MHA_BC, c->dh, d, col);
}
static inline float mha_kv_cache_value_at(const mha_kv_cache *c,
                                          const void *vt, int64_t col,
                                          int64_t d)
{
    return c->latent ? mha_kv_elem(c->dtype, vt, col * c->dh + d)
                     : mha_v_load(c->dtype, vt, MHA_BC, c->dv, col, d);
}

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

/* ======================================================================
 * Inside the engine (src/attention/ only)
 * ====================================================================== */

/* Below this many multiply-adds (B H Lq Lt dh) a problem runs on one
 * thread: waking a second costs more than it saves.  Results do not depend
 * on the thread count, so this changes speed only. */
#define MHA_THREADS_MIN_WORK ((double)(1 << 20))

/*
 * K and V of every (b, g) (g a K/V head), packed once per call by key tile
 * into two planes and a flag per tile:
 *     a     [B][Hkv][tiles][MHA_BC * dh]
 *     b     [B][Hkv][tiles][MHA_BC * dh]
 *     flag  [B][Hkv][tiles]               1.0f or 0.0f
 * tiles = ceil(Lk / MHA_BC) + 1; the last tile holds the extra keys.  The
 * forward packs kt (keys transposed, [dh][MHA_BC]) into a, v ([nc][dh])
 * into b, "v is finite" into flag; the backward packs k ([nc][dh]), vt
 * ([dh][MHA_BC]) and "k is finite".
 */
typedef struct mha_packed {
    float *base;
    int64_t Hkv, tiles, tile, plane;   /* tile = MHA_BC * dh */
} mha_packed;

static inline int64_t mha_packed_tiles(int64_t Lk)
{
    return (Lk + MHA_BC - 1) / MHA_BC + 1;
}
static inline int64_t mha_packed_floats(int64_t B, int64_t Hkv, int64_t Lk,
                                        int64_t dh)
{
    return B * Hkv * mha_packed_tiles(Lk) * (2 * MHA_BC * dh + 1);
}
/* Tiles per (b, g) of a problem's packed K/V; the last holds the extra
 * keys. */
static inline int64_t mha_tiles_of(const mha_attn *a)
{
    return a->packed_tiles ? a->packed_tiles : mha_packed_tiles(a->Lk);
}
/* The values' head width (mha_attn.dv, 0: the keys' dh), and the wider
 * of the two: what the layouts size a head's row and a packed tile by,
 * so that a K tile and a V tile take the same room. */
static inline int64_t mha_dv(const mha_attn *a)
{
    return a->dv ? a->dv : a->dh;
}
static inline int64_t mha_dmax(const mha_attn *a)
{
    return mha_dv(a) > a->dh ? mha_dv(a) : a->dh;
}
static inline mha_packed mha_packed_at(float *base, const mha_attn *a)
{
    const int64_t tiles = mha_tiles_of(a), tile = MHA_BC * mha_dmax(a);
    const mha_packed p = {base, a->Hkv, tiles, tile,
                          a->B * a->Hkv * tiles * tile};
    return p;
}
static inline float *mha_packed_a(const mha_packed *p, int64_t b, int64_t g,
                                  int64_t t)
{
    return p->base + ((b * p->Hkv + g) * p->tiles + t) * p->tile;
}
static inline float *mha_packed_b(const mha_packed *p, int64_t b, int64_t g,
                                  int64_t t)
{
    return mha_packed_a(p, b, g, t) + p->plane;
}
static inline float *mha_packed_flag(const mha_packed *p, int64_t b,
                                     int64_t g, int64_t t)
{
    return p->base + 2 * p->plane + (b * p->Hkv + g) * p->tiles + t;
}

/* The K/V head that query head h reads. */
static inline int64_t mha_kv_head(const mha_attn *a, int64_t h)
{
    return h / (a->H / a->Hkv);
}

/* The offset of row i of head h of batch b in a tensor of L rows, row
 * stride ld, head stride hs and batch stride bs (0: the rows layout's,
 * heads of w side by side: dh for queries and keys, dv for values and
 * outputs). */
static inline int64_t mha_row_at(int64_t w, int64_t L, int64_t ld,
                                 int64_t hs, int64_t bs, int64_t b,
                                 int64_t h, int64_t i)
{
    return b * (bs ? bs : L * ld) + i * ld + h * (hs ? hs : w);
}

/* Query row i of head h of batch b, and the output row it gives. */
static inline const float *mha_q_row(const mha_attn *a, int64_t b,
                                     int64_t h, int64_t i)
{
    return a->q + mha_row_at(a->dh, a->Lq, a->ldq, a->hsq, a->bsq, b, h, i);
}
static inline float *mha_ctx_row(const mha_attn *a, int64_t b, int64_t h,
                                 int64_t i)
{
    return a->ctx +
           mha_row_at(mha_dv(a), a->Lq, a->ldc, a->hsc, a->bsc, b, h, i);
}

/* Key row j of K/V head g of batch b: a real key (j < Lk), bias_k (j = Lk
 * with add_bias_kv), or NULL for the zero key of add_zero_attn. */
static inline const float *mha_key_row(const mha_attn *a, int64_t b,
                                       int64_t g, int64_t j)
{
    return j < a->Lk ? a->k + mha_row_at(a->dh, a->Lk, a->ldk, a->hsk,
                                         a->bsk, b, g, j)
         : j == a->Lk && a->bias_k ? a->bias_k + g * a->dh : NULL;
}
static inline const float *mha_value_row(const mha_attn *a, int64_t b,
                                         int64_t g, int64_t j)
{
    return j < a->Lk ? a->v + mha_row_at(mha_dv(a), a->Lk, a->ldv, a->hsv,
                                         a->bsv, b, g, j)
         : j == a->Lk && a->bias_v ? a->bias_v + g * mha_dv(a) : NULL;
}

/* Keys in packed tile t of a problem: MHA_BC, fewer in the last real
 * tile, the extra keys' count in the extra tile. */
static inline int mha_tile_keys(const mha_attn *a, int64_t t)
{
    if (t == mha_tiles_of(a) - 1)
        return (a->bias_k != NULL) + (a->zero_attn != 0);
    const int64_t left = a->Lk - t * MHA_BC;
    return (int)(left < MHA_BC ? left : MHA_BC);
}

/* How a tile's scores are masked: not at all, by index only (causal,
 * key_lengths: each row's keys past its limit), by an explicit mask (the
 * tile's bias rows), by position (a sliding-window cache: each key's
 * position, from its slot, outside the row's window), or by the key
 * padding mask alone (one bias row shared by the tile's rows, then each
 * row's index bounds). */
enum { MHA_TILE_OPEN = 0, MHA_TILE_BY_INDEX = 1, MHA_TILE_EXPLICIT = 2,
       MHA_TILE_WINDOW = 3, MHA_TILE_KEYS = 4 };

/*
 * One tile of work: query rows i0 .. i0+mr-1 of head h of batch b against
 * keys j0 .. j0+nc-1 (j0 >= Lk: the extra keys; on a sliding-window cache
 * the keys of slots j0 .. j0+nc-1, whose positions follow from the slot,
 * the sequence's length and the ring).  The descriptor is what
 * every tile algorithm (forward, weights, the backward's two sweeps)
 * reads; per-tile state that a future score modifier needs (key
 * positions, windows, offsets) belongs here.
 */
typedef struct mha_tile {
    int64_t b, h;
    int64_t g;           /* the K/V head query head h reads              */
    int64_t i0;
    int mr;
    int64_t j0;
    int nc;
    int64_t index;       /* its tile in the packed layout               */
    int extra;           /* the tile of the extra keys (never masked)  */
    int how;             /* MHA_TILE_OPEN, _BY_INDEX, _EXPLICIT or
                            _WINDOW                                     */
    const float *bias;   /* [mr][MHA_BC] additive mask (EXPLICIT only) */
    int stack;           /* 0, or the block stacks the query heads of K/V
                            head g (decoding with grouped-query attention:
                            one K/V load serves them all): row r is query
                            i0 + r % stack of head g * (H / Hkv) + r / stack.
                            Never with dropout or an explicit mask.      */
} mha_tile;

/* Where a tile's keys and values are read: the packed f32 planes, or for
 * the real keys of a problem on a KV cache, the cache in its dtype (the
 * kernels' qk_kv and pv_kv read both). */
/* Query rows per K/V head up to which mha_attn_run reads given keys and
 * values in place (mha_attn.in_place) rather than packing them: a
 * decoding step, where each key meets one row, so packing it (a
 * transposed copy) costs more than the products.  The keys' columns are
 * gathered then, which at 4 rows was slower than packing on a Sapphire
 * Rapids (docs/BENCHMARKS.md).  The backward, which reads the forward's
 * packed tiles, then packs them itself first. */
#define MHA_IN_PLACE_ROWS 1
static inline int mha_attn_reads_in_place(const mha_attn *a)
{
    /* (row strides below 2^24: the kernels take them as int, and a
     * gather's lane offsets, up to 15 strides, stay in int32) */
    return !a->prepacked && !a->pack_only &&
           a->Lq * (a->H / a->Hkv) <= MHA_IN_PLACE_ROWS &&
           a->ldk < (INT64_C(1) << 24) && a->ldv < (INT64_C(1) << 24);
}

typedef struct mha_tile_src {
    const void *kt, *v;     /* [dh][MHA_BC] and [MHA_BC][dh], or with
                               rows: the tile's first key and value rows,
                               ldk and ldv floats apart                 */
    mha_kv_dtype dtype;
    int finite;             /* every value finite: the fast pv is exact */
    int rows;               /* read in place (mha_attn.in_place)        */
    int ldk, ldv;
} mha_tile_src;
mha_tile_src mha_tile_source(const mha_attn *a, const mha_tile *t,
                             float *kvt);
/* On a paged cache, when tile t's successor starts another page: the
 * start of that page's K and V tiles asked for now (a page lies anywhere,
 * so the hardware's prefetchers, which follow addresses, cannot). */
void mha_tile_prefetch_next(const mha_attn *a, const mha_tile *t);

/* s = q k^T for mr query rows against the tile's first nc keys, and o +=
 * p v over them: the micro-kernel for where the tile is read from (the
 * same bits from each). */
static inline void mha_tile_qk(const mha_attn *a, const mha_tile_src *src,
                               int mr, int nc, const float *q, float *s,
                               int lds)
{
    if (src->rows)
        a->uk->qk_rows(mr, nc, (int)a->dh, q, (const float *)src->kt,
                       src->ldk, s, lds);
    else
        a->uk->qk_kv(src->dtype, mr, nc, (int)a->dh, q, src->kt, MHA_BC, s,
                     lds);
}
static inline void mha_tile_pv(const mha_attn *a, const mha_tile_src *src,
                               int mr, int nc, const float *p, int ldp,
                               float *o, int ldo)
{
    if (src->rows)
        a->uk->pv_rows(!src->finite, mr, nc, (int)mha_dv(a), p, ldp,
                       (const float *)src->v, src->ldv, o, ldo);
    else
        a->uk->pv_kv(src->dtype, !src->finite, mr, nc, (int)mha_dv(a), p,
                     ldp, src->v, MHA_BC, o, ldo);
}

/* Key j's element d and value j's element d of K/V head g of batch b, read
 * where the problem keeps them (the caller's rows, the packed tiles or a
 * KV cache), as the kernels see them: the reference tier's reads.  0 for
 * the zero key. */
float mha_key_elem(const mha_attn *a, int64_t b, int64_t g, int64_t j,
                   int64_t d);
float mha_value_elem(const mha_attn *a, int64_t b, int64_t g, int64_t j,
                     int64_t d);

/* A tile algorithm: called once per tile that has a live key, with the
 * caller's per-item state in ctx. */
typedef void (*mha_tile_fn)(const mha_attn *a, const mha_tile *t, void *ctx);

/*
 * Visits the tiles of rows i0 .. i0+mr-1 of (b, h) over keys k0 .. k1-1
 * in ascending order, then the extra keys' tile when with_extra.  Keys
 * past the last one any row may see are never visited, nor an explicitly
 * masked tile with no live key, nor (a window cache: k0, k1 are slots) a
 * slot tile holding no position a row sees.  bias: [MHA_BR][MHA_BC]
 * floats for the explicit mask of a tile.
 */
void mha_for_each_tile(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                       int mr, int64_t k0, int64_t k1, int with_extra,
                       float *bias, mha_tile_fn fn, void *ctx);
/* The same for a block that stacks query heads of one K/V head: `stack`
 * query rows i0 .. i0+stack-1 of each of the nh heads h0 .. h0+nh-1 (all
 * of one K/V head's group, or a run of them), mr = stack * nh rows in
 * all (mha_tile.stack). */
void mha_for_each_tile_stacked(const mha_attn *a, int64_t b, int64_t h0,
                               int nh, int64_t i0, int stack, int64_t k0,
                               int64_t k1, int with_extra, mha_tile_fn fn,
                               void *ctx);

/* The scores s[r][c] (row stride MHA_BC) of a tile, as qk left them,
 * made final: softcapped, ALiBi-biased, then masked as t->how says.
 * dcap (row stride ldd), or NULL: receives the softcap's derivative
 * 1 - tanh^2 (with a softcap; the backward's). */
void mha_score_tile(const mha_attn *a, const mha_tile *t, float *s,
                    float *dcap, int ldd);

/*
 * A tile masked by index (causal, key lengths) on the diagonal has keys
 * that no row sees at its end.  The products skip them panel by panel:
 * rows r0 .. r0+n-1 need only the first mha_tile_panel_cols() columns
 * (their largest live count; nc for any other tile), the rest being
 * excluded by the mask anyway.  A panel is MHA_PANEL rows, the last one
 * up to twice that (mha_panel_rows): two of the avx2 and avx512 kernels'
 * 6-row register blocks at least, because a call of 6 rows or fewer is
 * what the kernels take for a decoding step and walk in slabs.  A
 * diagonal tile's products then cost ~60% of a whole tile's.  Each
 * element of a product is the same chain of FMAs whatever the panel
 * (docs/KERNELS.md), so computed elements keep their bits.
 */
enum { MHA_PANEL = 12 };
static inline int mha_panel_rows(int mr, int r0)
{
    return mr - r0 < 2 * MHA_PANEL ? mr - r0 : MHA_PANEL;
}
int mha_tile_panel_cols(const mha_attn *a, const mha_tile *t, int r0, int n);
/* The same seen down a column (the backward's dk, dv): the first row of
 * tile t that sees its key c (rows before it see none of keys c ..:
 * their weights there are 0); 0 for a tile not masked by index, mr when
 * no row does. */
int mha_tile_first_row(const mha_attn *a, const mha_tile *t, int c);

/* Query head of row r of a tile (stacked blocks hold several heads). */
static inline int64_t mha_tile_head(const mha_attn *a, const mha_tile *t,
                                    int r)
{
    (void)a;
    return t->stack ? t->h + r / t->stack : t->h;
}
/* Query row of row r of a tile. */
static inline int64_t mha_tile_row(const mha_tile *t, int r)
{
    return t->i0 + (t->stack ? r % t->stack : r);
}

/* Checks the softcap, ALiBi slopes and window of `m` for H heads (RoPE is
 * rope.c's); `who` prefixes the message. */
mha_status mha_modifiers_check(const mha_modifiers *m, int64_t H,
                               const char *who);
/* attention_chunk C is >= 0 (0: none). */
mha_status mha_chunk_check(int64_t chunk, const char *who);
/* The sinks (H) are finite. */
mha_status mha_sinks_check(const float *sinks, int64_t H, const char *who);

/* qs[r][d] = q[i0 + r][head h][d] * scale, r < mr. */
void mha_load_q(const mha_attn *a, int64_t b, int64_t h, int64_t i0, int mr,
                float *qs);

/* Packs work item `item` (b, h, tile) of the forward's layout. */
void mha_pack_forward_tile(const mha_attn *a, int64_t item);

/* The flash tiers' per-thread scratch: what one query block needs. */
typedef struct flash_scratch {
    float *qs;    /* [BR][dh]  query rows * scale      */
    float *o;     /* [BR][dh]  running output          */
    float *s;     /* [BR][BC]  scores, then p          */
    float *bias;  /* [BR][BC]  mask of an explicit tile */
    float *m, *l; /* [BR]      running max and sum     */
    /* A cache's runs only (the layout of a cache's run has room for
     * them: mha_attn_layout_forward with prepacked): */
    float *kvt;   /* [BC][dh]  a latent cache's tile widened to f32 rows */
    float *qt;    /* [dh][BR]  qs transposed (a latent cache's scores)  */
    float *st;    /* [BC][BR]  those scores, transposed                 */
} flash_scratch;
int64_t mha_flash_scratch_floats(int64_t dh);
flash_scratch mha_flash_scratch_at(float *base, int64_t dh);

/* flash_forward.c: the online softmax of rows i0 .. i0+mr-1 of (b, h) over
 * keys k0 .. k1-1 (and the extra keys if with_extra) into f->m, f->l and
 * the unnormalised f->o; then ctx = o / l and the row stats. */
void mha_flash_rows(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                    int mr, int64_t k0, int64_t k1, int with_extra,
                    flash_scratch *f);
void mha_flash_finish(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                      int mr, const float *m, const float *l, const float *o);
void mha_flash_block(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                     int mr, flash_scratch *f);
/* mha_flash_rows for rows 0 .. stack-1 of query heads h0 .. h0+nh-1 (of
 * one K/V head), stacked head after head (mha_tile.stack). */
void mha_flash_rows_stacked(const mha_attn *a, int64_t b, int64_t h0,
                            int nh, int stack, int64_t k0, int64_t k1,
                            int with_extra, flash_scratch *f);

/* decode.c: key chunks of a split problem (1: not split), the floats of
 * their partial results, one chunk, and the merge of (b, h)'s chunks. */
int64_t mha_decode_chunks(int64_t Lq, int64_t Lk);
int64_t mha_decode_partials(int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                            int64_t dh);
void mha_decode_chunk(const mha_attn *a, int64_t bh, int64_t c,
                      int64_t chunks, flash_scratch *f);
void mha_decode_merge(const mha_attn *a, int64_t bh, int64_t chunks,
                      flash_scratch *f);
/* Whether the chunks run per (b, K/V head), the group's query heads
 * stacked into one block (grouped-query decoding: each K/V tile read once
 * for the whole group): 0, or the heads a block stacks, all of the group
 * when its rows fit a block (MHA_BR), else runs of MHA_BR / Lq heads
 * (128 query heads on one K/V head, as MLA decodes: 2 blocks, not 128
 * passes over the keys); the runs a group takes; and one chunk of one
 * run.  The same bits as per head (the kernels' results do not depend on
 * the row count). */
int mha_decode_stacked(const mha_attn *a);
int64_t mha_decode_stacks(const mha_attn *a, int nh);
void mha_decode_chunk_stacked(const mha_attn *a, int nh, int64_t item,
                              int64_t c, int64_t chunks, flash_scratch *f);

/* weights.c: the weights of rows i0 .. i0+mr-1 of batch b, every head. */
void mha_weights_block(const mha_attn *a, int64_t b, int64_t i0, int mr,
                       flash_scratch *f);

/* ref_forward.c: row i of every head of batch b, in float64. */
int64_t mha_ref_scratch_floats(int64_t dh, int64_t Lt);
/* The modifiers on key j's scaled score s for row i of head h (float64):
 * softcap, then ALiBi for a real key; dcap, or NULL, receives the
 * softcap's derivative (1 without one). */
double mha_ref_modify(const mha_attn *a, int64_t b, int64_t h, int64_t i,
                      int64_t j, double s, double *dcap);
void mha_ref_row(const mha_attn *a, int64_t b, int64_t i, float *scratch);

/* flash_backward.c: the backward's packing, scratch, and one (b, g):
 * every query head of K/V head g's group. */
void mha_pack_backward_tile(const mha_attn *a, const mha_attn_grad *g,
                            int64_t item);
int64_t mha_flash_bwd_scratch_floats(int64_t dh, int64_t Lt, int softcap);
void mha_flash_bwd_item(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                        int64_t kvh, float *scratch);

/* ref_backward.c: one (b, g) in float64. */
int64_t mha_ref_bwd_scratch_floats(int64_t dh, int64_t Lt);
void mha_ref_bwd_item(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                      int64_t kvh, float *scratch);

/* ---- bf16 attention on AMX tiles or AVX512-BF16 (half.c) -----------------
 * q, k, v and out of 16-bit elements; element (b, h, i, d) of q at
 * q[b bsq + h hsq + i ldq + d] (so both of mha_attention's layouts);
 * causal and key_lengths as mha_attention takes them; lse (B, H, Lq) or
 * NULL.  dh a multiple of 32; the caller checked everything else. */
typedef struct mha_half_problem {
    int64_t B, H, Hkv, Lq, Lk, dh;
    const uint16_t *q, *k, *v;
    uint16_t *out;
    const uint16_t *dout;          /* the backward's: dL/d out, like out   */
    uint16_t *dq, *dk, *dv;        /* like q, k and v                      */
    int64_t ldq, ldk, ldv, ldo, hsq, hsk, hsv, hso, bsq, bsk, bsv, bso;
    float scale;
    mha_causal causal;
    const int64_t *key_lengths;
    float *lse;
    int tiles;                     /* AMX tiles, else AVX512-BF16 (amx.c)  */
} mha_half_problem;
mha_status mha_attn_amx(const mha_engine *e, const mha_half_problem *p);

/* The backward of that forward: out and lse (given, the forward's) and
 * dout in; dq, dk, dv out. */
mha_status mha_attn_amx_backward(const mha_engine *e,
                                 const mha_half_problem *p);

#endif /* MHA_ATTENTION_H */
