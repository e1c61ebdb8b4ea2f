/*
 * kv_layout.h -- the KV cache's layout: the struct the tiers read in
 * place (tiles in the cache's dtype, finite flags, page tables) and the
 * index arithmetic over it.  What kv_cache.c (storing and reading) and
 * kv_pages.c (the page pool) both build on.
 */
#ifndef MHA_KV_LAYOUT_H
#define MHA_KV_LAYOUT_H

#include "attention.h"

/*
 * The KV cache (kv_cache.c): keys and values already projected, stored in
 * the engine's tile layout (mha_packed below: kt tiles, v tiles, a finite
 * flag per tile) in the cache's dtype (kernels.h), with room for
 * `capacity` keys per sequence, so attending reads it as it is: no
 * repacking, no conversion, no copy, no allocation.  (The extra keys of
 * a module, bias_k and the zero key, are packed by each run in its own
 * workspace: attention never writes a cache.)
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
    int64_t tiles;          /* stored tiles per (b, g): ceil(capacity / tw)
                               (paged: table_len * tpp)                */
    int64_t tw;             /* a stored tile's columns (keys): MHA_BC,
                               or a page's when pages are smaller (16,
                               32): then a kernel's tile of MHA_BC keys
                               is several stored tiles, one per page
                               (mha_kv_split)                          */
    mha_kv_dtype dtype;
    int64_t rot_block;      /* rotate: the Hadamard blocks' size (a power
                               of two dividing dh); 0: not rotated     */
    int64_t tile_bytes;     /* one stored kt or v tile of tw columns:
                               mha_kv_tile_bytes                       */
    int64_t *len;           /* [B] keys held per sequence                 */
    unsigned char *k, *v;   /* [B][Hkv][tiles] kt tiles, then v tiles     */
    void *block;            /* the allocation k and v lie in            */
    float *finite;          /* [B][Hkv][tiles] 1.0f: every value finite
                               (of the columns 0 .. len - 1 a sequence
                               fills; with a window, of the whole tile,
                               since a ring's tile holds any of its
                               columns, older positions included)      */
    double key_amax;        /* the largest finite |k| ever appended since
                               the last reset of every sequence (an upper
                               bound of what the cache holds): what
                               mha_check_score_range reads of the keys  */
    /* Paged (page > 0, kv_pages.c): the planes are a pool of pages, a
     * page `page` positions (tpp stored tiles) of every K/V head;
     * sequence b's i-th page is table[b][i].  A page held by several sequences (a
     * fork) is copied before one of them writes it (copy on write).
     * Page `pages` is the null page, zeros, never written: what a table
     * holds past a sequence's pages, so a read there is harmless. */
    int64_t page, tpp;      /* positions and tiles per page; 0 0: contiguous */
    int64_t pages;          /* the pool's pages (the null page not counted) */
    int64_t table_len;      /* pages per sequence: ceil(capacity / page)  */
    int32_t *table;         /* [B][table_len] page ids                    */
    int32_t *refs;          /* [pages] the table entries holding each page
                               (the pool's one allocation: kv_pages.c) */
    int32_t *free_pages;    /* [pages] a stack of the free ones ...       */
    int64_t n_free;         /* ... n_free deep                            */
    int32_t *free_at;       /* [pages] a free page's place in it; -1: held */
    int64_t run;            /* pages per run: the pool's pages in aligned
                               runs of MHA_PAGE_RUN positions, so that a
                               sequence's pages can lie side by side   */
    int32_t *run_free;      /* [runs] free pages in each run            */
    int32_t *whole;         /* [runs] a stack of the wholly free runs ... */
    int64_t n_whole;        /* ... n_whole deep                           */
    int32_t *whole_at;      /* [runs] a wholly free run's place; -1: not  */
    int64_t view_shift;     /* a view's (mha_kv_cache_view): its queries
                               sit this many positions past its end; 0.
                               A cascade's shared prefix sets q_len, so
                               that every query sees every key           */
};

/* Index of stored tile t of (b, g) among its plane's tiles (and flags): the
 * contiguous [B][Hkv][tiles], or through the page table, [Hkv][pages +
 * 1][tpp] (each head's pages side by side, so that a sequence whose pages
 * were taken in order streams as from a contiguous cache). */
static inline int64_t mha_kv_tile_index(const mha_kv_cache *c, int64_t b,
                                        int64_t g, int64_t t)
{
    if (!c->page)
        return (b * c->Hkv + g) * c->tiles + t;
    if (c->tpp == 1)   /* pages of 16 to 64 keys: no division (a paged
                        * step asks for several indices a tile) */
        return g * (c->pages + 1) + c->table[b * c->table_len + t];
    const int64_t pg = c->table[b * c->table_len + t / c->tpp];
    return (g * (c->pages + 1) + pg) * c->tpp + t % c->tpp;
}

/* Tile t of (b, g) in one plane of heads w wide: the pointer the kernels
 * take (a q8 or q4 tile's codes, its scales just before).  Inline: a
 * kernel's tile in pages of 16 asks for four key and four value tiles
 * and the next four of each. */
static inline const unsigned char *mha_kv_tile_at(const mha_kv_cache *c,
                                                  const unsigned char *plane,
                                                  int64_t w, int64_t b,
                                                  int64_t g, int64_t t)
{
    const int64_t skip =
        mha_kv_scaled(c->dtype) ? mha_q8_scale_bytes(c->tw, w) : 0;
    return plane + mha_kv_tile_index(c, b, g, t) * c->tile_bytes + skip;
}

/* Tile t of (b, g) of the cache's keys (kt) and values (v). */
static inline const unsigned char *mha_kv_cache_k_tile(const mha_kv_cache *c,
                                                       int64_t b, int64_t g,
                                                       int64_t t)
{
    return mha_kv_tile_at(c, c->k, c->dh, b, g, t);
}
static inline const unsigned char *mha_kv_cache_v_tile(const mha_kv_cache *c,
                                                       int64_t b, int64_t g,
                                                       int64_t t)
{
    /* (a latent cache's value tile is its key tile, scaled by d_h-wide
     * rows) */
    return mha_kv_tile_at(c, c->v, c->latent ? c->dh : c->dv, b, g, t);
}

/* The stored tiles a kernel's tile of MHA_BC keys spans: 1, or 2 or 4
 * pages of 32 or 16. */
static inline int64_t mha_kv_split(const mha_kv_cache *c)
{
    return MHA_BC / c->tw;
}

/* The pages a paged sequence of `len` positions holds: ceil(len / page). */
static inline int64_t mha_kv_pages_of(const mha_kv_cache *c, int64_t len)
{
    return len / c->page + (len % c->page != 0);
}

/* Element d of key (value) column col of a stored tile, as the float it
 * stands for: the kernels' layouts, or a latent cache's rows, laid out as
 * a value tile of d_h-wide rows (its value the key's first dv elements,
 * the same tile). */
static inline float mha_kv_cache_key_at(const mha_kv_cache *c,
                                        const void *kt, int64_t col,
                                        int64_t d)
{
    return c->latent ? mha_v_load(c->dtype, kt, c->tw, c->dh, col, d)
                     : mha_kt_load(c->dtype, kt, c->tw, c->dh, d, col);
}
static inline float mha_kv_cache_value_at(const mha_kv_cache *c,
                                          const void *vt, int64_t col,
                                          int64_t d)
{
    return c->latent ? mha_v_load(c->dtype, vt, c->tw, c->dh, col, d)
                     : mha_v_load(c->dtype, vt, c->tw, c->dv, col, d);
}

#endif /* MHA_KV_LAYOUT_H */
