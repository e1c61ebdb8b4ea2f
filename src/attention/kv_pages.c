/*
 * kv_pages.c -- the paged KV cache's pool (mha_kv_cache_config.page_size).
 *
 * A contiguous cache gives every sequence room for `capacity` tokens up
 * front.  A paged one keeps a pool of pages, each holding `page`
 * positions (page / MHA_BC whole tiles, so the kernels read a page's
 * tiles exactly as they read a contiguous cache's) of every K/V head, and
 * gives each sequence a table of the pages it holds, in position order:
 *
 *   position p of sequence b:  page table[b][p / page], column p % page
 *   tile t of (b, g):          tile (pg * H_kv + g) * tpp + t % tpp of
 *                              the planes, pg = table[b][t / tpp]
 *                              (mha_kv_tile_index)
 *
 * so memory follows the tokens held, not the capacity.  A fork gives a
 * second sequence the first one's pages by reference (refs counts the
 * table entries naming a page); whichever sequence then writes into a
 * shared page first gets its own copy of it (copy on write), and a page
 * returns to the pool when no table names it.  Entries past a sequence's
 * pages name the null page (id `pages`, zeros), so a kernel reading a
 * tile past a short sequence's end reads zeros, as in a contiguous cache.
 *
 * Every function here either does all it was asked or, refused, nothing.
 */
#include "attention.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* One page's bytes in one plane (K or V): tpp tiles of every K/V head. */
static int64_t page_bytes(const mha_kv_cache *c)
{
    return c->Hkv * c->tpp * c->tile_bytes;
}

static int32_t *entry(const mha_kv_cache *c, int64_t b, int64_t i)
{
    return c->table + b * c->table_len + i;
}

/* A page off the free stack, zeroed as a new contiguous cache is (a
 * tile's unused columns hold finite zeros) and flagged finite. */
static int32_t take(mha_kv_cache *c)
{
    const int32_t pg = c->free_pages[--c->n_free];
    const int64_t pb = page_bytes(c), flags = c->Hkv * c->tpp;
    memset(c->k + pg * pb, 0, (size_t)pb);
    memset(c->v + pg * pb, 0, (size_t)pb);
    for (int64_t f = 0; f < flags; f++)
        c->finite[pg * flags + f] = 1.0f;
    c->refs[pg] = 1;
    return pg;
}

/* One table entry fewer names page pg: back to the pool at none. */
static void drop(mha_kv_cache *c, int32_t pg)
{
    if (--c->refs[pg] == 0)
        c->free_pages[c->n_free++] = pg;
}

/* The first and last page index of positions len[b] .. len[b] + n - 1. */
static void span_of(const mha_kv_cache *c, int64_t b, int64_t n,
                    int64_t *first, int64_t *last)
{
    *first = c->len[b] / c->page;
    *last = (c->len[b] + n - 1) / c->page;
}

mha_status mha_kv_pages_reserve(mha_kv_cache *c, int64_t b, int64_t n)
{
    if (!c->page || n <= 0)
        return MHA_OK;
    const int64_t b0 = b < 0 ? 0 : b, b1 = b < 0 ? c->B : b + 1;
    int64_t need = 0;   /* pages absent, or shared and to be copied */
    for (int64_t s = b0; s < b1; s++) {
        int64_t first, last;
        span_of(c, s, n, &first, &last);
        for (int64_t i = first; i <= last; i++) {
            const int32_t pg = *entry(c, s, i);
            need += pg == c->pages || c->refs[pg] > 1;
        }
    }
    if (need > c->n_free) {
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
    const int64_t pb = page_bytes(c), flags = c->Hkv * c->tpp;
    for (int64_t s = b0; s < b1; s++) {
        int64_t first, last;
        span_of(c, s, n, &first, &last);
        for (int64_t i = first; i <= last; i++) {
            int32_t *e = entry(c, s, i);
            if (*e == c->pages) {
                *e = take(c);
            } else if (c->refs[*e] > 1) {   /* shared: a copy of its own */
                const int32_t pg = take(c);
                memcpy(c->k + pg * pb, c->k + *e * pb, (size_t)pb);
                memcpy(c->v + pg * pb, c->v + *e * pb, (size_t)pb);
                /* (the other holder's flags: finite over its columns,
                 * ours among them, or 0, which only takes the slow path) */
                memcpy(c->finite + pg * flags, c->finite + *e * flags,
                       (size_t)flags * sizeof *c->finite);
                drop(c, *e);
                *e = pg;
            }
        }
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
        const int64_t held = (c->len[b] + c->page - 1) / c->page;
        for (int64_t i = 0; ok && i < c->table_len; i++) {
            const int32_t pg = *entry(c, b, i);
            ok = pg >= 0 && pg <= c->pages &&
                 (pg == c->pages || i < held);   /* none past its length */
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
        ok = pg >= 0 && pg < c->pages && c->refs[pg] == 0 && named[pg] == 0;
        if (ok)
            named[pg] = -1;
    }
    free(named);
    return ok;
}
