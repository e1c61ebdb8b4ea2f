/*
 * tiles.c -- what every flash algorithm shares: K and V packed by tile
 * once per call, the walk over a query block's key tiles, and the masking
 * of one tile's scores.
 *
 * Masking by index costs nothing: tiles past the last key that causal
 * masking and key_lengths leave are never visited, and a tile wholly
 * before the first row's limit needs no mask at all.  Only tiles on the
 * diagonal, or under an explicit mask, are masked element by element.
 *
 * The window score modifier is masking by index too: a block's tiles
 * before its first row's first key are never visited either, so the cost
 * follows the window's width, not Lk.
 *
 * A sliding-window KV cache is walked by slot: its keys are a ring, slot
 * s holding the position mha_ring_position says, so a block's window of
 * positions is one or two runs of slots (two once it wraps around the
 * ring).  Slot tiles holding no position of the window are never
 * visited; a tile whose every key is seen by every row is open; the
 * others (the window's two edges) are masked by position, key by key.
 */
#define _POSIX_C_SOURCE 200809L   /* sched_yield */
#include "engine.h"

#include <float.h>
#include <math.h>
#include <sched.h>
#include <string.h>

/* (dh: the wider of the keys' and the values' head widths, mha_dmax) */
int64_t mha_flash_scratch_floats(int64_t dh)
{
    return 2 * MHA_BR * dh + 2 * MHA_BR * MHA_BC + 2 * MHA_BR;
}

flash_scratch mha_flash_scratch_at(float *base, int64_t dh)
{
    flash_scratch f;
    f.qs = base;   /* [MHA_BR][d_h], then o [MHA_BR][d_v] */
    f.o = f.qs + MHA_BR * dh;
    f.s = f.o + MHA_BR * dh;
    f.bias = f.s + MHA_BR * MHA_BC;
    f.m = f.bias + MHA_BR * MHA_BC;
    f.l = f.m + MHA_BR;
    /* (past the region: a cache's runs only) */
    f.kvt = f.l + MHA_BR;
    f.qt = f.kvt + MHA_BC * dh;
    f.st = f.qt + MHA_BR * dh;
    return f;
}

void mha_store_row16(const mha_attn *a, uint16_t *dst, const float *src,
                     int64_t n, const float *mult)
{
    enum { PIECE = 1 << 20 };   /* (the kernel counts in int) */
    for (int64_t d0 = 0; d0 < n; d0 += PIECE)
        a->uk->narrow(a->x16 == MHA_KV_BF16, src + d0,
                      (int)(n - d0 < PIECE ? n - d0 : PIECE), mult, dst + d0);
}

void mha_load_q(const mha_attn *a, int64_t b, int64_t h, int64_t i0, int mr,
                float *qs)
{
    const int dh = (int)a->dh;
    for (int r = 0; r < mr; r++) {
        float *row = qs + r * dh;
        if (a->x16 != MHA_KV_F32) {   /* widened (exact), then scaled */
            a->uk->widen_t(a->x16, mha_q_row16(a, b, h, i0 + r), 0, 1, dh,
                           NULL, 0, row, dh);
            a->uk->scale(row, row, dh, a->scale);
        } else {
            a->uk->scale(row, mha_q_row(a, b, h, i0 + r), dh, a->scale);
        }
    }
}

/* The forward's packing of tile t of (b, g), g a K/V head: kt [dh][MHA_BC]
 * the keys transposed (VL x VL blocks in registers), v [nc][dv] the values
 * copied, and whether every value is finite (then the fast pv kernel is
 * exact).  (Values read where they lie instead, their rows strides of the
 * whole tensor apart, made the products 30% slower than the copy costs:
 * docs/BENCHMARKS.md.)  The extra keys' tile, whose rows are the bias or
 * zero keys, element by element. */
void mha_pack_forward_tile(const mha_attn *a, int64_t item)
{
    const mha_packed p = mha_packed_at(a->packed, a);
    const int64_t t = item % p.tiles, bg = item / p.tiles;
    const int64_t b = bg / a->Hkv, g = bg % a->Hkv, dh = a->dh,
                  dv = mha_dv(a);
    const int64_t j0 = t == p.tiles - 1 ? a->Lk : t * MHA_BC;
    const int nc = mha_tile_keys(a, t);
    float *kt = mha_packed_a(&p, b, g, t), *v = mha_packed_b(&p, b, g, t);
    int finite = 1;
    if (a->in_place && t != p.tiles - 1)
        return;   /* read in place (mha_tile_source), never packed */
    if (a->x16 != MHA_KV_F32 && t != p.tiles - 1) {
        /* 16-bit keys and values widened as they are packed (exact: the
         * tiles a float copy of them would give), the values' flag from
         * the widened tile */
        if (nc > 0) {
            a->uk->widen_t(a->x16, mha_key_row16(a, b, g, j0), a->ldk, nc,
                           (int)dh, kt, MHA_BC, NULL, 0);
            a->uk->widen_t(a->x16, mha_value_row16(a, b, g, j0), a->ldv, nc,
                           (int)dv, NULL, 0, v, (int)dv);
            (void)a->uk->amax(v, nc, dv, dv, &finite);
        }
        *mha_packed_flag(&p, b, g, t) = (float)finite;
        return;
    }
    if (t != p.tiles - 1) {
        if (nc > 0)
            a->uk->widen_t(MHA_KV_F32, mha_key_row(a, b, g, j0), a->ldk, nc,
                           (int)dh, kt, MHA_BC, NULL, 0);
        for (int c = 0; c < nc; c++)
            finite &= a->uk->copy_finite(v + c * dv,
                                         mha_value_row(a, b, g, j0 + c),
                                         (int)dv);
        *mha_packed_flag(&p, b, g, t) = (float)finite;
        return;
    }
    for (int c = 0; c < nc; c++) {
        const float *kr = mha_key_row(a, b, g, j0 + c);
        const float *vr = mha_value_row(a, b, g, j0 + c);
        for (int64_t d = 0; d < dh; d++)
            kt[d * MHA_BC + c] = kr ? kr[d] : 0.0f;
        if (vr)
            finite &= a->uk->copy_finite(v + c * dv, vr, (int)dv);
        else
            memset(v + c * dv, 0, (size_t)dv * sizeof *v);
    }
    *mha_packed_flag(&p, b, g, t) = (float)finite;
}

/* Tile t of (b, g) packed if this thread claims it first; 1 if it did. */
static int pack_if_first(const mha_attn *a, const mha_packed *p, int64_t b,
                         int64_t g, int64_t t)
{
    _Atomic int *st = mha_packed_state(p, b, g, t);
    int s = MHA_PACK_NOT;
    if (atomic_load_explicit(st, memory_order_relaxed) != MHA_PACK_NOT ||
        !atomic_compare_exchange_strong_explicit(st, &s, MHA_PACK_BUSY,
                                                 memory_order_acquire,
                                                 memory_order_relaxed))
        return 0;
    mha_pack_forward_tile(a, (b * a->Hkv + g) * p->tiles + t);
    atomic_store_explicit(st, MHA_PACK_DONE, memory_order_release);
    return 1;
}

/* Packing on first use (mha_attn.lazy_pack): the first thread to claim
 * the tile packs it.  Another that needs it meanwhile packs the next
 * tiles of the head nobody has claimed (two threads on one head's blocks
 * walk its tiles together: they take turns instead of one waiting on
 * the other), and only when none is left waits, yielding the CPU now and
 * then in case the packer is not running.  Release / acquire: the tile's
 * floats and flag are seen by whoever sees it done.  Packing is a copy:
 * the bits of a tile do not depend on who packed it or when. */
void mha_pack_forward_on_use(const mha_attn *a, const mha_packed *p,
                             int64_t b, int64_t g, int64_t t)
{
    _Atomic int *st = mha_packed_state(p, b, g, t);
    if (atomic_load_explicit(st, memory_order_acquire) == MHA_PACK_DONE ||
        pack_if_first(a, p, b, g, t))
        return;
    int64_t u = t + 1;
    for (unsigned spins = 1;
         atomic_load_explicit(st, memory_order_acquire) != MHA_PACK_DONE;) {
        while (u < p->tiles && !pack_if_first(a, p, b, g, u))
            u++;
        if (u < p->tiles)
            continue;   /* one packed: look again */
        if (spins++ % 1024 == 0)
            sched_yield();
    }
}

/* The flag of stored tile u of (b, g): 1 if every value it holds is
 * finite. */
static int stored_finite(const mha_kv_cache *c, const mha_tile *t, int64_t u)
{
    return c->finite[mha_kv_tile_index(c, t->b, t->g, u)] != 0.0f;
}

/* The next tile's rows are asked for, so is its flag: a page's flag lies
 * where its page does among the pool's, a line of its own, and waiting
 * for it from memory was a tenth of a paged step (docs/BENCHMARKS.md). */
static void next_flag(const mha_kv_cache *c, const mha_tile *t, int64_t u)
{
    if (c->page)
        __builtin_prefetch(c->finite + mha_kv_tile_index(c, t->b, t->g, u));
}

mha_tile_src mha_tile_source(const mha_attn *a, const mha_tile *t,
                             float *kvt)
{
    mha_tile_src src = {0};
    if (a->in_place && !t->extra) {
        src.kt = mha_key_row(a, t->b, t->g, t->j0);
        src.v = mha_value_row(a, t->b, t->g, t->j0);
        src.ldk = (int)a->ldk;
        src.ldv = (int)a->ldv;
        src.rows = 1;
        src.dtype = MHA_KV_F32;
        /* No flag: the output pass learns the values' finiteness where
         * it needs it, mostly from o after the fast pv (flash_forward.c),
         * so a decoding step reads each value once, not twice (it was
         * scanned here, then read again by pv: docs/BENCHMARKS.md); the
         * weights' pass reads no value. */
        src.unscanned = 1;
        src.finite = 1;   /* (the fast pv, unless a scan says otherwise) */
        return src;
    }
    if (a->kv && !t->extra && a->kv->latent) {
        /* A latent cache's tile, [MHA_BC][dh] rows in its dtype, read as
         * rows: the keys, and their first dv elements the values.  16-bit
         * rows are widened into kvt first (exact), q8 and q4 rows times
         * their blocks' scales (the tier's widen_t), once per tile for
         * all the rows a block stacks. */
        const mha_kv_cache *c = a->kv;
        const int64_t split = mha_kv_split(c), u0 = t->index * split;
        const void *tile = mha_kv_cache_k_tile(c, t->b, t->g, u0);
        src.finite = stored_finite(c, t, u0);
        if (split > 1) {   /* pages of 16 or 32: rows, page by page */
            for (int64_t i = 0; i < split && i * c->tw < t->nc; i++) {
                a->uk->widen_t(c->dtype,
                               mha_kv_cache_k_tile(c, t->b, t->g, u0 + i),
                               c->dh, (int)c->tw, (int)c->dh, NULL, 0,
                               kvt + i * c->tw * c->dh, (int)c->dh);
                src.finite &= stored_finite(c, t, u0 + i);
            }
            tile = kvt;
        } else if (c->dtype != MHA_KV_F32) {
            a->uk->widen_t(c->dtype, tile, c->dh, MHA_BC, (int)c->dh, NULL,
                           0, kvt, (int)c->dh);
            tile = kvt;
        }
        src.kt = src.v = tile;
        src.ldk = src.ldv = (int)c->dh;
        src.rows = 1;
        src.dtype = MHA_KV_F32;
        return src;
    }
    if (a->kv && !t->extra) {
        const mha_kv_cache *c = a->kv;
        const int64_t split = mha_kv_split(c), u0 = t->index * split;
        src.kt = mha_kv_cache_k_tile(c, t->b, t->g, u0);
        src.v = mha_kv_cache_v_tile(c, t->b, t->g, u0);
        src.dtype = c->dtype;
        src.finite = stored_finite(c, t, u0);
        /* The next tile's rows are asked for, into L2, as this one's are
         * read (simd_tier.h's ahead): on a paged cache (a jump the
         * hardware cannot follow), and on a contiguous one where several
         * rows meet each key or the tile is not 16-bit, where
         * mha_next_prefetch says (GQA f16 steps 1.2-1.3x faster on Zen 4,
         * 10% slower on Zen 3; a lone row's f16 stream 6-11% slower with
         * them on Zen 4, 1.08x faster on Zen 5, its q8 stream 1.17x and
         * f32 1.04x faster on Zen 4: docs/BENCHMARKS.md). */
        const int64_t un = (t->index + 1) * split;
        const int half = c->dtype == MHA_KV_F16 || c->dtype == MHA_KV_BF16;
        const int level = mha_next_prefetch();
        if (split == 1 && un < c->tiles &&
            (c->page || level > 1 || (level && (t->mr > 1 || !half)))) {
            src.next_kt = mha_kv_cache_k_tile(c, t->b, t->g, un);
            src.next_v = mha_kv_cache_v_tile(c, t->b, t->g, un);
            next_flag(c, t, un);
        }
        if (split > 1) {   /* pages of 16 or 32: the tile's segments, */
            src.segs = (int)split;   /* each with the same of the next */
            src.tw = (int)c->tw;
            for (int64_t i = 0; i < split && i * c->tw < t->nc; i++) {
                const int64_t u = u0 + i;
                src.seg_kt[i] = mha_kv_cache_k_tile(c, t->b, t->g, u);
                src.seg_v[i] = mha_kv_cache_v_tile(c, t->b, t->g, u);
                src.finite &= stored_finite(c, t, u);
                if (un + i < c->tiles) {
                    src.next_seg_kt[i] =
                        mha_kv_cache_k_tile(c, t->b, t->g, un + i);
                    src.next_seg_v[i] =
                        mha_kv_cache_v_tile(c, t->b, t->g, un + i);
                    next_flag(c, t, un + i);
                }
            }
        }
        return src;
    }
    const mha_packed p = mha_packed_at(a->packed, a);
    if (a->lazy_pack)
        mha_pack_forward_on_use(a, &p, t->b, t->g, t->index);
    src.kt = mha_packed_a(&p, t->b, t->g, t->index);
    src.v = mha_packed_b(&p, t->b, t->g, t->index);
    src.dtype = MHA_KV_F32;
    src.finite = *mha_packed_flag(&p, t->b, t->g, t->index) != 0.0f;
    return src;
}

/* Key or value j (x: 0 key, 1 value) of (b, g), element d. */
static float kv_elem(const mha_attn *a, int x, int64_t b, int64_t g,
                     int64_t j, int64_t d)
{
    if (!a->prepacked) {
        const float *row = x ? mha_value_row(a, b, g, j)
                             : mha_key_row(a, b, g, j);
        return row ? row[d] : 0.0f;
    }
    if (a->kv && j < a->Lk) {
        const mha_kv_cache *c = a->kv;
        const int64_t t = j / c->tw, col = j % c->tw;
        return x ? mha_kv_cache_value_at(c, mha_kv_cache_v_tile(c, b, g, t),
                                         col, d)
                 : mha_kv_cache_key_at(c, mha_kv_cache_k_tile(c, b, g, t),
                                       col, d);
    }
    /* The packed f32 tiles (the extra keys' tile last, column j - Lk). */
    const mha_packed p = mha_packed_at(a->packed, a);
    const int64_t t = j < a->Lk ? j / MHA_BC : p.tiles - 1;
    const int64_t col = j < a->Lk ? j % MHA_BC : j - a->Lk;
    return x ? mha_packed_b(&p, b, g, t)[col * mha_dv(a) + d]
             : mha_packed_a(&p, b, g, t)[d * MHA_BC + col];
}

float mha_key_elem(const mha_attn *a, int64_t b, int64_t g, int64_t j,
                   int64_t d)
{
    return kv_elem(a, 0, b, g, j, d);
}

float mha_value_elem(const mha_attn *a, int64_t b, int64_t g, int64_t j,
                     int64_t d)
{
    return kv_elem(a, 1, b, g, j, d);
}

int mha_tile_panel_cols(const mha_attn *a, const mha_tile *t, int r0, int n)
{
    if (t->how != MHA_TILE_BY_INDEX)
        return t->nc;
    int64_t live = 0;
    for (int r = r0; r < r0 + n; r++) {
        const int64_t l =
            mha_mask_last(a->mask, t->b, mha_tile_row(t, r)) - t->j0 + 1;
        live = l > live ? l : live;
    }
    return (int)(live < t->nc ? live : t->nc);
}

int mha_tile_first_row(const mha_attn *a, const mha_tile *t, int c)
{
    if (t->how != MHA_TILE_BY_INDEX)
        return 0;
    int r = 0;
    while (r < t->mr &&
           mha_mask_last(a->mask, t->b, mha_tile_row(t, r)) < t->j0 + c)
        r++;
    return r;
}

/* s + bias, where bias -inf excludes, a score that is not finite stays
 * and finite sums saturate: selects, no branch (the loop vectorises). */
static inline float masked(float s, float bias)
{
    const float x = s + bias;
    const float sum = x < -FLT_MAX ? -FLT_MAX : x > FLT_MAX ? FLT_MAX : x;
    const float kept = fabsf(s) <= FLT_MAX ? sum : s;   /* (NaN: s) */
    return bias == -INFINITY ? -INFINITY : kept;
}

/* A window tile: each key whose position (from its slot) is outside the
 * row's window is excluded. */
static void mask_window(const mha_attn *a, const mha_tile *t, float *s)
{
    const mha_mask_plan *mk = a->mask;
    const int64_t n = mk->seq_lengths[t->b];
    for (int r = 0; r < t->mr; r++) {
        float *sr = s + r * MHA_BC;
        int64_t lo;
        const int64_t hi = mha_mask_window(
            mk, t->b, t->i0 + (t->stack ? r % t->stack : r), &lo);
        for (int c = 0; c < t->nc; c++) {
            const int64_t pos = mha_ring_position(n, mk->ring, t->j0 + c);
            if (pos < lo || pos > hi)
                sr[c] = -INFINITY;
        }
    }
}

/* ALiBi: each real key's score less slope_h times its distance from the
 * row, |qpos - kpos| (positions: mha_mask_qpos; a window cache's keys at
 * the positions their slots hold). */
static void alibi_tile(const mha_attn *a, const mha_tile *t, float *s)
{
    const mha_mask_plan *mk = a->mask;
    const int64_t n = mk->window ? mk->seq_lengths[t->b] : 0;
    /* 0, 1, ..., MHA_BC - 1 as floats: distances in float arithmetic,
     * exact below 2^24 (and so the same floats), which vectorises. */
    float iota[MHA_BC];
    for (int c = 0; c < MHA_BC; c++)
        iota[c] = (float)c;
    for (int r = 0; r < t->mr; r++) {
        float *sr = s + r * MHA_BC;
        const float slope = a->alibi[mha_tile_head(a, t, r)];
        const int64_t qpos = mha_mask_qpos(mk, t->b, mha_tile_row(t, r));
        const int64_t base = qpos - t->j0;
        if (!mk->window && base < ((int64_t)1 << 24) - MHA_BC &&
            base > -((int64_t)1 << 24)) {
            const float fb = (float)base;
            for (int c = 0; c < t->nc; c++)
                sr[c] -= slope * fabsf(fb - iota[c]);
            continue;
        }
        for (int c = 0; c < t->nc; c++) {
            const int64_t kpos = mk->window
                                     ? mha_ring_position(n, mk->ring,
                                                         t->j0 + c)
                                     : t->j0 + c;
            const int64_t d = qpos - kpos;
            sr[c] -= slope * (float)(d < 0 ? -d : d);
        }
    }
}

void mha_score_tile(const mha_attn *a, const mha_tile *t, float *s,
                    float *dcap, int ldd)
{
    if (a->softcap > 0.0f)
        for (int r = 0; r < t->mr; r++)
            a->uk->softcap(s + r * MHA_BC, t->nc, a->softcap,
                           dcap ? dcap + (int64_t)r * ldd : NULL);
    if (a->alibi && !t->extra)
        alibi_tile(a, t, s);
    if (t->how == MHA_TILE_OPEN)
        return;
    if (t->how == MHA_TILE_WINDOW) {
        mask_window(a, t, s);
        return;
    }
    /* Boolean masks alone give bias 0 or -inf: a select, which
     * vectorises (s + 0 = s, up to the sign of a zero score, which no
     * result can show) */
    const mha_mask_plan *mk = a->mask;
    const int select = mk->attn.kind != MHA_MASK_ADDITIVE &&
                       mk->pad.kind != MHA_MASK_ADDITIVE;
    for (int r = 0; r < t->mr; r++) {
        float *sr = s + r * MHA_BC;
        const float *br = t->how == MHA_TILE_EXPLICIT ? t->bias + r * MHA_BC
                        : t->bias;   /* KEYS: the shared key row */
        if (t->how == MHA_TILE_EXPLICIT || t->how == MHA_TILE_KEYS) {
            if (select)
                for (int c = 0; c < t->nc; c++)
                    sr[c] = br[c] == 0.0f ? sr[c] : -INFINITY;
            else
                for (int c = 0; c < t->nc; c++)
                    sr[c] = masked(sr[c], br[c]);
        }
        if (t->how != MHA_TILE_EXPLICIT) {
            /* Keys before the row's first (the window) and after its
             * last (causal, key lengths, the window) are excluded. */
            const int64_t i = mha_tile_row(t, r);
            const int64_t first = mha_mask_first(a->mask, t->b, i) - t->j0;
            const int64_t live = mha_mask_last(a->mask, t->b, i) - t->j0 + 1;
            for (int64_t c = 0; c < t->nc && c < first; c++)
                sr[c] = -INFINITY;
            for (int64_t c = live < 0 ? 0 : live; c < t->nc; c++)
                sr[c] = -INFINITY;
        }
    }
}

/* The extra keys' tile (bias_k, the zero key), never masked. */
static void extra_tile(const mha_attn *a, mha_tile *t, mha_tile_fn fn,
                       void *ctx)
{
    const int extra = (a->bias_k != NULL) + (a->zero_attn != 0);
    if (!extra)
        return;
    t->j0 = a->Lk;
    t->nc = extra;
    t->index = mha_tiles_of(a) - 1;
    t->extra = 1;
    t->how = MHA_TILE_OPEN;
    fn(a, t, ctx);
}

/*
 * Slots s0 .. s1-1 holding consecutive positions q0, q0 + 1, ... (one run
 * of the ring, no wrap inside): the last of them whose position is in
 * [lo, hi], or -1.
 */
static int64_t run_last(int64_t s0, int64_t s1, int64_t q0, int64_t lo,
                        int64_t hi)
{
    const int64_t q1 = q0 + (s1 - s0) - 1;
    const int64_t top = q1 < hi ? q1 : hi;
    return s0 < s1 && top >= lo && top >= q0 ? s0 + (top - q0) : -1;
}

/* Whether slots s0 .. s1-1 of such a run all hold positions in [lo, hi]
 * (true when the run is empty). */
static int run_within(int64_t s0, int64_t s1, int64_t q0, int64_t lo,
                      int64_t hi)
{
    return s0 >= s1 || (q0 >= lo && q0 + (s1 - s0) - 1 <= hi);
}

/*
 * The walk of a sliding-window cache, rows i0 .. i0+n_i-1 over slots
 * k0 .. k1-1.  The rows see positions [lo, hi] together (the first row's
 * window start, the last row's own position) and [clo, chi] each (the
 * last row's start, the first row's position).  Each slot tile of the
 * sequence's filled slots is at most two runs of consecutive positions,
 * split at head, the slot the next position takes: a tile is visited
 * when a run reaches into [lo, hi], with nc up to its last such slot, and
 * left open when every slot before that lies in [clo, chi].
 */
static void walk_window(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                        int n_i, int mr, int stack, int64_t k0, int64_t k1,
                        int with_extra, mha_tile_fn fn, void *ctx)
{
    const mha_mask_plan *mk = a->mask;
    const int64_t n = mk->seq_lengths[b], ring = mk->ring;
    int64_t lo, clo;
    const int64_t chi = mha_mask_window(mk, b, i0, &lo);
    const int64_t hi = mha_mask_window(mk, b, i0 + n_i - 1, &clo);
    const int64_t filled = n < ring ? n : ring, head = n % ring;
    const int64_t end = k1 < filled ? k1 : filled;
    mha_tile t = {.b = b, .h = h, .g = mha_kv_head(a, h), .i0 = i0,
                  .mr = mr, .stack = stack};
    for (int64_t j0 = k0; hi >= lo && j0 < end; j0 += MHA_BC) {
        const int64_t j1 = end - j0 < MHA_BC ? end : j0 + MHA_BC;
        /* Run A: slots j0 .. split-1; run B: split .. j1-1 (one of them
         * empty unless head falls inside the tile). */
        const int64_t split = head < j0 ? j0 : head > j1 ? j1 : head;
        const int64_t qa = mha_ring_position(n, ring, j0);
        const int64_t qb = mha_ring_position(n, ring, split);
        const int64_t la = run_last(j0, split, qa, lo, hi);
        const int64_t lb = run_last(split, j1, qb, lo, hi);
        const int64_t last = la > lb ? la : lb;
        if (last < 0)
            continue;   /* no position of the window in this tile */
        t.j0 = j0;
        t.nc = (int)(last - j0 + 1);
        t.index = j0 / MHA_BC;
        const int64_t cut = last + 1;
        t.how = run_within(j0, split < cut ? split : cut, qa, clo, chi) &&
                        run_within(split, cut, qb, clo, chi)
                    ? MHA_TILE_OPEN : MHA_TILE_WINDOW;
        fn(a, &t, ctx);
    }
    if (with_extra)
        extra_tile(a, &t, fn, ctx);
}

/* The walk of rows i0 .. i0+n_i-1, the tile's mr rows (stacked heads:
 * mr = n_i * group, stack = n_i). */
static void walk(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                 int n_i, int mr, int stack, int64_t k0, int64_t k1,
                 int with_extra, float *bias, mha_tile_fn fn, void *ctx)
{
    const mha_mask_plan *mk = a->mask;
    if (mk->window) {
        walk_window(a, b, h, i0, n_i, mr, stack, k0, k1, with_extra, fn,
                    ctx);
        return;
    }
    /* Rows see keys first(i) .. last(i), both rising with i: the block
     * sees first(i0) .. last(i0 + n_i - 1), and a tile inside
     * first(last row) .. last(first row) needs no masking. */
    const int64_t first_last = mha_mask_last(mk, b, i0);
    const int64_t last_first = mha_mask_first(mk, b, i0 + n_i - 1);
    int64_t end = mha_mask_last(mk, b, i0 + n_i - 1) + 1;
    if (end > k1)
        end = k1;
    int64_t start = mha_mask_first(mk, b, i0) / MHA_BC * MHA_BC;
    if (start < k0)
        start = k0;   /* (k0: a multiple of MHA_BC) */
    const int explicit_mask = mha_mask_has_explicit(mk);
    const int keys_only = mha_mask_keys_only(mk) && bias;
    mha_tile t = {.b = b, .h = h, .g = mha_kv_head(a, h), .i0 = i0,
                  .mr = mr, .bias = bias, .stack = stack};
    for (int64_t j0 = start; j0 < end; j0 += MHA_BC) {
        t.j0 = j0;
        t.nc = (int)(end - j0 < MHA_BC ? end - j0 : MHA_BC);
        t.index = j0 / MHA_BC;
        t.how = keys_only ? MHA_TILE_KEYS
              : explicit_mask ? MHA_TILE_EXPLICIT
              : j0 + t.nc - 1 > first_last || j0 < last_first
                  ? MHA_TILE_BY_INDEX
                  : MHA_TILE_OPEN;
        if (t.how == MHA_TILE_KEYS &&
            mha_mask_key_cols(mk, b, j0, t.nc, bias) == 0)
            continue;   /* every key of the tile is padding */
        if (t.how == MHA_TILE_EXPLICIT) {
            int64_t live = 0;
            for (int r = 0; r < mr; r++)
                live += mha_mask_cols(mk, b, h, i0 + r, j0, t.nc,
                                      bias + r * MHA_BC);
            if (live == 0)
                continue;
        }
        fn(a, &t, ctx);
    }
    if (with_extra)
        extra_tile(a, &t, fn, ctx);
}

void mha_for_each_tile(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                       int mr, int64_t k0, int64_t k1, int with_extra,
                       float *bias, mha_tile_fn fn, void *ctx)
{
    walk(a, b, h, i0, mr, mr, 0, k0, k1, with_extra, bias, fn, ctx);
}

void mha_for_each_tile_stacked(const mha_attn *a, int64_t b, int64_t h0,
                               int nh, int64_t i0, int stack, int64_t k0,
                               int64_t k1, int with_extra, mha_tile_fn fn,
                               void *ctx)
{
    walk(a, b, h0, i0, stack, stack * nh, stack, k0, k1, with_extra, NULL,
         fn, ctx);
}
