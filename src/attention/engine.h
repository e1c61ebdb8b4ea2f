/*
 * engine.h -- inside the engine (src/attention/ only): K and V packed by
 * tile, the tile descriptor and walk, masking and scoring a tile, the
 * tiers' work items, the bf16 driver.  The last of the engine's headers
 * (attention.h lists them).
 */
#ifndef MHA_ENGINE_H
#define MHA_ENGINE_H

#include "kv_cache.h"

#include <stdatomic.h>

/* Below this many multiply-adds (B H Lq Lt dh) a problem runs on one
 * thread: waking a second costs more than it saves.  (2^20 until a short
 * decoding call, B 1 or 4, Lk 190, 8 heads of 64, was measured 1.6x
 * faster on two: docs/BENCHMARKS.md.)  Results do not depend on the
 * thread count, so this changes speed only. */
#define MHA_THREADS_MIN_WORK ((double)(1 << 16))

/*
 * K and V of every (b, g) (g a K/V head), packed once per call by key tile
 * into two planes and a flag per tile:
 *     a     [B][Hkv][tiles][MHA_BC * dh]
 *     b     [B][Hkv][tiles][MHA_BC * dh]
 *     flag  [B][Hkv][tiles]               1.0f or 0.0f
 *     state [B][Hkv][tiles]               an atomic int (below)
 * tiles = ceil(Lk / MHA_BC) + 1; the last tile holds the extra keys.  The
 * forward packs kt (keys transposed, [dh][MHA_BC]) into a, v ([nc][dh])
 * into b, "v is finite" into flag; the backward packs k ([nc][dh]), vt
 * ([dh][MHA_BC]) and "k is finite".  The forward packs a tile when a
 * block first reads it (mha_attn.lazy_pack), state telling the threads
 * whether it is packed (MHA_PACK_DONE), being packed, or not yet.
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
    return B * Hkv * mha_packed_tiles(Lk) * (2 * MHA_BC * dh + 2);
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

enum { MHA_PACK_NOT = 0, MHA_PACK_BUSY = 1, MHA_PACK_DONE = 2 };
static inline _Atomic int *mha_packed_state(const mha_packed *p, int64_t b,
                                            int64_t g, int64_t t)
{
    return (_Atomic int *)(void *)(p->base + 2 * p->plane +
                                   p->plane / p->tile +
                                   (b * p->Hkv + g) * p->tiles + t);
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

/* The same rows of a problem on 16-bit data (mha_attn.x16): the float
 * rows' element offsets in the caller's 16-bit arrays (real keys only). */
static inline const uint16_t *mha_q_row16(const mha_attn *a, int64_t b,
                                          int64_t h, int64_t i)
{
    return (const uint16_t *)(const void *)a->q +
           mha_row_at(a->dh, a->Lq, a->ldq, a->hsq, a->bsq, b, h, i);
}
static inline uint16_t *mha_ctx_row16(const mha_attn *a, int64_t b,
                                      int64_t h, int64_t i)
{
    return (uint16_t *)(void *)a->ctx +
           mha_row_at(mha_dv(a), a->Lq, a->ldc, a->hsc, a->bsc, b, h, i);
}
static inline const uint16_t *mha_key_row16(const mha_attn *a, int64_t b,
                                            int64_t g, int64_t j)
{
    return (const uint16_t *)(const void *)a->k +
           mha_row_at(a->dh, a->Lk, a->ldk, a->hsk, a->bsk, b, g, j);
}
static inline const uint16_t *mha_value_row16(const mha_attn *a, int64_t b,
                                              int64_t g, int64_t j)
{
    return (const uint16_t *)(const void *)a->v +
           mha_row_at(mha_dv(a), a->Lk, a->ldv, a->hsv, a->bsv, b, g, j);
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
    return !a->prepacked && !a->pack_only && a->x16 == MHA_KV_F32 &&
           a->Lq * (a->H / a->Hkv) <= MHA_IN_PLACE_ROWS &&
           a->ldk < (INT64_C(1) << 24) && a->ldv < (INT64_C(1) << 24);
}

/* A kernel tile of a paged cache whose pages are smaller than it (16 or
 * 32 keys) is up to this many stored tiles, one per page. */
enum { MHA_TILE_SEGS = 4 };

typedef struct mha_tile_src {
    const void *kt, *v;     /* [dh][MHA_BC] and [MHA_BC][dh], or with
                               rows: the tile's first key and value rows,
                               ldk and ldv floats apart                 */
    mha_kv_dtype dtype;
    int finite;             /* every value finite: the fast pv is exact */
    int unscanned;          /* read in place, its values not scanned yet:
                               finite says nothing (flash_forward.c)    */
    int rows;               /* read in place (mha_attn.in_place)        */
    int ldk, ldv;
    const void *next_kt,    /* a cache's next tile (paged: wherever it */
               *next_v;     /* lies), or NULL: asked for ahead         */
    int segs, tw;           /* pages smaller than a tile: its columns are
                               segs stored tiles of tw, kt and v below
                               (0: kt and v above)                      */
    const void *seg_kt[MHA_TILE_SEGS], *seg_v[MHA_TILE_SEGS];
    const void *next_seg_kt[MHA_TILE_SEGS],   /* the same segment of the */
               *next_seg_v[MHA_TILE_SEGS];    /* next tile, or NULL      */
} mha_tile_src;
mha_tile_src mha_tile_source(const mha_attn *a, const mha_tile *t,
                             float *kvt);

/* s = q k^T for mr query rows against the tile's first nc keys, and o +=
 * p v over them: the micro-kernel for where the tile is read from (the
 * same bits from each).  A tile in segments (pages of 16 or 32) is one
 * call per segment: a score is one chain over d whatever the columns
 * around it, and each output of pv one chain over the keys in order,
 * carried through o from call to call (stored and reloaded exactly), so
 * the bits are those of the whole tile in one call. */
static inline void mha_tile_qk(const mha_attn *a, const mha_tile_src *src,
                               int mr, int nc, const float *q, float *s,
                               int lds)
{
    if (src->rows) {
        a->uk->qk_rows(mr, nc, (int)a->dh, q, (const float *)src->kt,
                       src->ldk, s, lds);
    } else if (src->segs) {
        for (int i = 0; i < src->segs && i * src->tw < nc; i++) {
            const int c0 = i * src->tw,
                      n = nc - c0 < src->tw ? nc - c0 : src->tw;
            a->uk->qk_kv(src->dtype, mr, n, (int)a->dh, q, src->seg_kt[i],
                         src->tw, src->next_seg_kt[i], s + c0, lds);
        }
    } else {
        a->uk->qk_kv(src->dtype, mr, nc, (int)a->dh, q, src->kt, MHA_BC,
                     src->next_kt, s, lds);
    }
}
static inline void mha_tile_pv(const mha_attn *a, const mha_tile_src *src,
                               int mr, int nc, const float *p, int ldp,
                               float *o, int ldo)
{
    if (src->rows) {
        a->uk->pv_rows(!src->finite, mr, nc, (int)mha_dv(a), p, ldp,
                       (const float *)src->v, src->ldv, o, ldo);
    } else if (src->segs) {
        for (int i = 0; i < src->segs && i * src->tw < nc; i++) {
            const int c0 = i * src->tw,
                      n = nc - c0 < src->tw ? nc - c0 : src->tw;
            a->uk->pv_kv(src->dtype, !src->finite, mr, n, (int)mha_dv(a),
                         p + c0, ldp, src->seg_v[i], src->tw,
                         src->next_seg_v[i], o, ldo);
        }
    } else {
        a->uk->pv_kv(src->dtype, !src->finite, mr, nc, (int)mha_dv(a), p,
                     ldp, src->v, MHA_BC, src->next_v, o, ldo);
    }
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

/* qs[r][d] = q[i0 + r][head h][d] * scale, r < mr. */
/* dst[d] = src[d] * *mult for d < n (mult NULL: src itself), rounded
 * to the problem's 16-bit type (x16) to nearest even: a float row as the
 * float path would store it (its scale kernel), then rounded. */
void mha_store_row16(const mha_attn *a, uint16_t *dst, const float *src,
                     int64_t n, const float *mult);

void mha_load_q(const mha_attn *a, int64_t b, int64_t h, int64_t i0, int mr,
                float *qs);

/* Packs work item `item` (b, h, tile) of the forward's layout. */
void mha_pack_forward_tile(const mha_attn *a, int64_t item);
void mha_pack_forward_on_use(const mha_attn *a, const mha_packed *p,
                             int64_t b, int64_t g, int64_t t);

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
    float *qt;    /* [dh][mr]  qs transposed (a latent cache's scores)  */
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
int mha_decode_stacked(const mha_attn *a, int threads);
int64_t mha_decode_stacks(const mha_attn *a, int nh);
void mha_decode_chunk_stacked(const mha_attn *a, int nh, int64_t item,
                              int64_t c, int64_t chunks, flash_scratch *f);
/* Keys not split (one chunk): a run of stacked heads over all the keys,
 * finished in place (no partials), when the (b, K/V head) pairs are at
 * least the threads (fewer would leave threads idle that per-head items
 * keep busy; the same bits either way, so the choice may follow them). */
void mha_decode_block_stacked(const mha_attn *a, int nh, int64_t item,
                              flash_scratch *f);

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
mha_status mha_attn_bf16(const mha_engine *e, const mha_half_problem *p);

/* The backward of that forward: out and lse (given, the forward's) and
 * dout in; dq, dk, dv out. */
mha_status mha_attn_bf16_backward(const mha_engine *e,
                                 const mha_half_problem *p);

#endif /* MHA_ENGINE_H */
