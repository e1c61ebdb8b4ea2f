/*
 * kv_pages.h -- a paged KV cache's pool (kv_pages.c): pages taken and
 * given back, copy on write after a fork.
 */
#ifndef MHA_KV_PAGES_H
#define MHA_KV_PAGES_H

#include "kv_layout.h"

/* The positions of an aligned run of pages (kv_pages.c: where a
 * sequence's next page goes). */
enum { MHA_PAGE_RUN = 256 };

/* The pool's bookkeeping for `pages` pages of c->page positions, all
 * free: c->pages, refs and the free stacks, in one allocation (freed with
 * c->refs), or MHA_ERR_OUT_OF_MEMORY and c unchanged. */
mha_status mha_kv_pages_init(mha_kv_cache *c, int64_t pages);

/* Sequence b's positions len[b] .. len[b] + n - 1 made writable: pages
 * added where it has none, a page it shares copied; all of them, for
 * every sequence (b = -1) or one, or none and the pool's shortage named.
 * MHA_OK without doing anything for a contiguous cache. */
mha_status mha_kv_pages_reserve(mha_kv_cache *c, int64_t b, int64_t n);
/* Sequence b keeps its first `keep` pages; the rest go back to the pool
 * once no sequence holds them. */
void mha_kv_pages_release(mha_kv_cache *c, int64_t b, int64_t keep);
/* Whether the tables and counts agree: every page's refs is the number
 * of table entries naming it, the free stack is exactly the pages no one
 * holds (their places kept), every run's free count is right and the
 * stack of whole runs exactly those wholly free, and no sequence holds a
 * page past its length.  For tests. */
int mha_kv_pages_consistent(const mha_kv_cache *c);

#endif /* MHA_KV_PAGES_H */
