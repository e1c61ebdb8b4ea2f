/*
 * kv_pages.c -- the paged KV cache's pool (mha_kv_cache_config.page_size).
 *
 * A contiguous cache gives every sequence room for `capacity` tokens up
 * front.  A paged one keeps a pool of pages, each holding `page`
 * positions (page / MHA_BC whole tiles, so the kernels read a page's
 * tiles exactly as they read a contiguous cache's; or, pages of 16 or
 * 32, one stored tile of that many columns, a kernel's tile then being
 * several pages: tiles.c) of every K/V head, and gives each sequence a
 * table of the pages it holds, in position order:
 *
 *   position p of sequence b:  page table[b][p / page], column p % page
 *   tile t of (b, g):          tile (g * (pages + 1) + pg) * tpp + t % tpp
 *                              of the planes, pg = table[b][t / tpp]
 *                              (mha_kv_tile_index: each head's pages side
 *                              by side, so a sequence whose pages were
 *                              taken in order streams as a contiguous
 *                              cache does)
 *
 * so memory follows the tokens held, not the capacity.  Where the pool
 * allows, a sequence's next page is the one after its last (the pool's
 * pages lie in aligned runs of MHA_PAGE_RUN positions; a sequence's first
 * page, or one whose neighbour is taken, starts a wholly free run, else
 * any free page): pages side by side are one stream of memory for the
 * kernels, where pages scattered one by one cost a memory latency each
 * (pages of 16: 4 KiB of a head; docs/BENCHMARKS.md).  A fork gives a
 * second sequence the first one's pages by reference (refs counts the
 * table entries naming a page); whichever sequence then writes into a
 * shared page first gets its own copy of it (copy on write), and a page
 * returns to the pool when no table names it.  Entries past a sequence's
 * pages name the null page (id `pages`, zeros), so a kernel reading a
 * tile past a short sequence's end reads zeros, as in a contiguous cache.
 *
 * Every function here either does all it was asked or, refused, nothing.
 */
#include "kv_pages.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The index of head g's first tile in page pg, in the planes and flags
 * ([Hkv][pages + 1][tpp] tiles: mha_kv_tile_index). */
static int64_t first_tile(const mha_kv_cache *c, int64_t g, int64_t pg)
{
    return (g * (c->pages + 1) + pg) * c->tpp;
}

/* Page `to` becomes a copy of page `from` (every head's tiles and flags),
 * or (from < 0) zeros flagged finite, as a new contiguous cache is (a
 * tile's unused columns hold finite zeros). */
static void fill_page(mha_kv_cache *c, int32_t to, int32_t from)
{
    const size_t bytes = (size_t)(c->tpp * c->tile_bytes);
    for (int64_t g = 0; g < c->Hkv; g++) {
        const int64_t t = first_tile(c, g, to);
        if (from < 0) {
            memset(c->k + t * c->tile_bytes, 0, bytes);
            if (!c->latent)   /* (a latent cache's one plane is both) */
                memset(c->v + t * c->tile_bytes, 0, bytes);
            for (int64_t i = 0; i < c->tpp; i++)
                c->finite[t + i] = 1.0f;
        } else {
            const int64_t f = first_tile(c, g, from);
            memcpy(c->k + t * c->tile_bytes, c->k + f * c->tile_bytes, bytes);
            if (!c->latent)
                memcpy(c->v + t * c->tile_bytes, c->v + f * c->tile_bytes,
                       bytes);
            memcpy(c->finite + t, c->finite + f,
                   (size_t)c->tpp * sizeof *c->finite);
        }
    }
}

static int32_t *entry(const mha_kv_cache *c, int64_t b, int64_t i)
{
    return c->table + b * c->table_len + i;
}

/* Run r's pages: `run`, or fewer for the pool's last. */
static int64_t run_pages(const mha_kv_cache *c, int64_t r)
{
    const int64_t rest = c->pages - r * c->run;
    return rest < c->run ? rest : c->run;
}

/* Removes entry `at` of a stack of n whose places are kept in where[]:
 * its top moves into the gap. */
static void unstack(int32_t *stack, int64_t *n, int32_t *where, int64_t at)
{
    const int32_t top = stack[--*n];
    stack[at] = top;
    where[top] = (int32_t)at;
}

mha_status mha_kv_pages_init(mha_kv_cache *c, int64_t pages)
{
    c->run = c->page < MHA_PAGE_RUN ? MHA_PAGE_RUN / c->page : 1;
    const int64_t runs = pages / c->run + (pages % c->run != 0);
    /* refs, the free stack, its places; per run its free count, the
     * stack of whole ones, their places (pages < 2^31) */
    int32_t *pool = malloc((size_t)(3 * pages + 3 * runs) * sizeof *pool);
    if (!pool)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "cannot allocate a paged cache's pool of %lld "
                             "pages", (long long)pages);
    c->pages = pages;
    c->refs = pool;
    c->free_pages = pool + pages;
    c->free_at = pool + 2 * pages;
    c->run_free = pool + 3 * pages;
    c->whole = c->run_free + runs;
    c->whole_at = c->whole + runs;
    for (int64_t i = 0; i < pages; i++) {   /* page 0 on top */
        c->refs[i] = 0;
        c->free_pages[i] = (int32_t)(pages - 1 - i);
        c->free_at[pages - 1 - i] = (int32_t)i;
    }
    for (int64_t r = 0; r < runs; r++) {    /* run 0 on top */
        c->run_free[r] = (int32_t)run_pages(c, r);
        c->whole[r] = (int32_t)(runs - 1 - r);
        c->whole_at[runs - 1 - r] = (int32_t)r;
    }
    c->n_free = pages;
    c->n_whole = runs;
    return MHA_OK;
}

/* Where entry i of sequence s goes: after its entry i - 1's page if that
 * one is free, else at the start of a wholly free run, else any free
 * page (the stack's top). */
static int32_t place(const mha_kv_cache *c, int64_t s, int64_t i)
{
    const int32_t prev = i > 0 ? *entry(c, s, i - 1) : (int32_t)c->pages;
    if (prev + 1 < c->pages && c->refs[prev + 1] == 0)
        return prev + 1;
    if (c->n_whole)
        return (int32_t)(c->whole[c->n_whole - 1] * c->run);
    return c->free_pages[c->n_free - 1];
}

/* A free page for entry i of sequence s, held once: a copy of page
 * `from`, or (from < 0) zeroed. */
static int32_t take(mha_kv_cache *c, int64_t s, int64_t i, int32_t from)
{
    const int32_t pg = place(c, s, i);
    const int64_t r = pg / c->run;
    unstack(c->free_pages, &c->n_free, c->free_at, c->free_at[pg]);
    c->free_at[pg] = -1;
    if (c->run_free[r]-- == run_pages(c, r)) {   /* no longer whole */
        unstack(c->whole, &c->n_whole, c->whole_at, c->whole_at[r]);
        c->whole_at[r] = -1;
    }
    fill_page(c, pg, from);
    c->refs[pg] = 1;
    return pg;
}

/* One table entry fewer names page pg: back to the pool at none. */
static void drop(mha_kv_cache *c, int32_t pg)
{
    if (--c->refs[pg] != 0)
        return;
    const int64_t r = pg / c->run;
    c->free_at[pg] = (int32_t)c->n_free;
    c->free_pages[c->n_free++] = pg;
    if (++c->run_free[r] == run_pages(c, r)) {
        c->whole_at[r] = (int32_t)c->n_whole;
        c->whole[c->n_whole++] = (int32_t)r;
    }
}

/* The table entry of position p: its page, or with a window the page of
 * its ring slot (p mod capacity; the capacity is whole pages). */
static int64_t page_of(const mha_kv_cache *c, int64_t p)
{
    return (c->window ? p % c->capacity : p) / c->page;
}

/* With a window: the newest position ring page i of sequence b holds
 * (-1: none yet).  Positions rise by one from slot to slot around the
 * ring, from the oldest at slot len % capacity to the newest just before
 * it, so a page's newest is at its last slot unless the newest of all
 * lies inside it. */
static int64_t newest_in(const mha_kv_cache *c, int64_t b, int64_t i)
{
    const int64_t n = c->len[b], C = c->capacity, a = i * c->page;
    const int64_t last = (n + C - 1) % C;   /* the newest's slot */
    if (n == 0)
        return -1;
    if (last >= a && last < a + c->page)
        return n - 1;
    return mha_ring_position(n, C, a + c->page - 1);
}

/* With a window: whether ring page i of sequence b (held) holds only
 * positions older than len - W, which no query needs any more (nor a
 * rollback to the present length): a page to give back. */
static int stale(const mha_kv_cache *c, int64_t b, int64_t i)
{
    return c->window && *entry(c, b, i) != c->pages &&
           newest_in(c, b, i) < c->len[b] - c->window;
}

/* Gives back sequence b's stale pages, and moves start[b] (the oldest
 * position held) to the oldest of the unbroken run of positions, back
 * from the newest, whose pages are still held.  (Walked before any page
 * is taken again for new positions: a page taken for a slot is zeroed,
 * and its other slots hold none of the positions the ring assigns them,
 * all older than this run.) */
static void drop_stale(mha_kv_cache *c, int64_t b)
{
    int dropped = 0;
    for (int64_t i = 0; i < c->table_len; i++)
        if (stale(c, b, i)) {
            drop(c, *entry(c, b, i));
            *entry(c, b, i) = (int32_t)c->pages;
            dropped = 1;
        }
    if (!dropped)
        return;
    const int64_t n = c->len[b], floor = n > c->capacity ? n - c->capacity
                                                         : 0;
    int64_t lo = n;
    while (lo > floor && lo > c->start[b] &&
           *entry(c, b, page_of(c, lo - 1)) != c->pages)
        lo--;
    c->start[b] = lo > c->start[b] ? lo : c->start[b];
}

/* Runs body with i each table entry that positions len[s] .. len[s] + n
 * - 1 fall in, once each (n <= capacity with a window, so only the first
 * and last pages of the span can be the same ring page). */
#define FOR_PAGES(c, s, n, i, body)                                      \
    do {                                                                 \
        const int64_t p0_ = (c)->len[s], p1_ = p0_ + (n) - 1;            \
        const int64_t first_ = page_of(c, p0_);                          \
        for (int64_t at_ = p0_; at_ <= p1_;                              \
             at_ = (at_ / (c)->page + 1) * (c)->page) {                  \
            const int64_t i = page_of(c, at_);                           \
            if (at_ != p0_ && i == first_)                               \
                continue;   /* (the ring came round to the first) */     \
            body                                                         \
        }                                                                \
    } while (0)

mha_status mha_kv_pages_reserve(mha_kv_cache *c, int64_t b, int64_t n)
{
    if (!c->page || n <= 0)
        return MHA_OK;
    const int64_t b0 = b < 0 ? 0 : b, b1 = b < 0 ? c->B : b + 1;
    /* pages absent (or stale: given back, then taken), or shared and to
     * be copied; against the free ones and the stale ones held alone */
    int64_t need = 0, freed = 0;
    for (int64_t s = b0; s < b1; s++) {
        for (int64_t i = 0; c->window && i < c->table_len; i++)
            freed += stale(c, s, i) && c->refs[*entry(c, s, i)] == 1;
        FOR_PAGES(c, s, n, i, {
            const int32_t pg = *entry(c, s, i);
            need += pg == c->pages || stale(c, s, i) || c->refs[pg] > 1;
        });
    }
    if (need > c->n_free + freed) {
        char who[64];
        if (b < 0)
            snprintf(who, sizeof who, "in each of the %lld sequences",
                     (long long)c->B);
        else
            snprintf(who, sizeof who, "in sequence %lld", (long long)b);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "the paged KV cache's pool is full: %lld new "
                             "token(s) %s need %lld free page(s) of %lld "
                             "positions, and %lld of its %lld pages are free "
                             "(free or truncate a sequence, or create the "
                             "cache with more pages)", (long long)n, who,
                             (long long)need, (long long)c->page,
                             (long long)c->n_free, (long long)c->pages);
    }
    for (int64_t s = b0; s < b1; s++) {
        if (c->window)
            drop_stale(c, s);
        FOR_PAGES(c, s, n, i, {
            int32_t *e = entry(c, s, i);
            if (*e == c->pages) {
                *e = take(c, s, i, -1);
            } else if (c->refs[*e] > 1) {   /* shared: a copy of its own */
                /* (the other holder's flags come too: finite over its
                 * columns, ours among them, or 0: only the slow path) */
                const int32_t pg = take(c, s, i, *e);
                drop(c, *e);
                *e = pg;
            }
        });
    }
    return MHA_OK;
}

void mha_kv_pages_release(mha_kv_cache *c, int64_t b, int64_t keep)
{
    if (!c->page)
        return;
    for (int64_t i = keep; i < c->table_len; i++) {
        int32_t *e = entry(c, b, i);
        if (*e != c->pages) {
            drop(c, *e);
            *e = (int32_t)c->pages;
        }
    }
}

int mha_kv_pages_consistent(const mha_kv_cache *c)
{
    if (!c->page)
        return 1;
    int32_t *named = calloc((size_t)c->pages + 1, sizeof *named);
    int ok = named != NULL;
    for (int64_t b = 0; ok && b < c->B; b++) {
        const int64_t held = mha_kv_pages_of(c, c->len[b]);
        for (int64_t i = 0; ok && i < c->table_len; i++) {
            const int32_t pg = *entry(c, b, i);
            ok = pg >= 0 && pg <= c->pages &&
                 (pg == c->pages || i < held ||   /* none past its length */
                  c->window);                     /* (a ring: any)       */
            if (ok && pg != c->pages)
                named[pg]++;
        }
    }
    int64_t in_use = 0;
    for (int64_t pg = 0; ok && pg < c->pages; pg++) {
        ok = named[pg] == c->refs[pg];
        in_use += c->refs[pg] > 0;
    }
    ok = ok && c->n_free == c->pages - in_use;
    for (int64_t f = 0; ok && f < c->n_free; f++) {   /* each free once */
        const int32_t pg = c->free_pages[f];
        ok = pg >= 0 && pg < c->pages && c->refs[pg] == 0 &&
             named[pg] == 0 && c->free_at[pg] == f;
        if (ok)
            named[pg] = -1;
    }
    for (int64_t pg = 0; ok && pg < c->pages; pg++)   /* held: no place */
        ok = c->refs[pg] > 0 ? c->free_at[pg] == -1 : named[pg] == -1;
    /* every run's free count, and the whole ones stacked, once each */
    const int64_t runs = c->pages / c->run + (c->pages % c->run != 0);
    int64_t n_whole = 0;
    for (int64_t r = 0; ok && r < runs; r++) {
        int64_t n = 0;
        for (int64_t pg = r * c->run; pg < r * c->run + run_pages(c, r); pg++)
            n += c->refs[pg] == 0;
        const int whole = n == run_pages(c, r);
        const int32_t at = c->whole_at[r];
        ok = c->run_free[r] == n &&
             (whole ? at >= 0 && at < c->n_whole && c->whole[at] == r
                    : at == -1);
        n_whole += whole;
    }
    ok = ok && n_whole == c->n_whole;
    free(named);
    return ok;
}
