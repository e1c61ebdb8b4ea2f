/*
 * mask.h -- the mask plan (mask.c): every kind of mask, causal masking,
 * key lengths, the window and the chunks reduced to one internal form, a
 * row of additive biases per (batch, head, query), computed by index.
 * The first of the engine's headers (attention.h lists them).
 */
#ifndef MHA_MASK_H
#define MHA_MASK_H

#include "core/core.h"

/* ---- masks (mask.c): every mask kind -> one row of additive biases ----- */

/* A boolean key padding mask of up to this many rows is read as bounds
 * where each of its rows allows one run of keys (mha_mask_plan.pad_from,
 * pad_to); more rows keep the mask itself. */
enum { MHA_PAD_BOUNDS_MAX = 256 };
typedef struct mha_mask_plan {
    int64_t batch, heads, q_len, kv_len, total_keys;
    mha_mask attn;             /* kind NONE if absent */
    int64_t attn_stride_b, attn_stride_h;   /* 0 where broadcast */
    mha_mask pad;              /* kind NONE if absent */
    int64_t pad_stride_b;
    const int64_t *key_lengths;
    int pad_rows;                /* > 0: the key padding mask was boolean
                                    and each of its pad_rows rows (1: one
                                    for every batch) allowed the keys
                                    pad_from[row] .. pad_to[row] - 1 and
                                    no other (padding at the end, at the
                                    start, or both): it is kept as these
                                    bounds, masking by index (tiles
                                    outside them never visited), and pad
                                    is kind NONE.  The same bits as the
                                    mask itself: a masked score is -inf
                                    either way, its weight 0, and 0 added
                                    to a sum or times a finite value in
                                    pv changes nothing (non-finite values
                                    take the exact pv, which skips a zero
                                    weight) */
    int64_t pad_from[MHA_PAD_BOUNDS_MAX], pad_to[MHA_PAD_BOUNDS_MAX];
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

/* The last real key that causal masking, key_lengths, the window, the
 * chunks and a padding mask kept as bounds leave to query row i of batch
 * b (-1: none).  Explicit masks may block more. */
int64_t mha_mask_last(const mha_mask_plan *plan, int64_t b, int64_t i);
/* The first real key the window, the chunks and a padding mask kept as
 * bounds leave to row i (0 without them); a row whose first is past its
 * last sees no real key. */
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

#endif /* MHA_MASK_H */
