/*
 * flash_forward.c -- the FlashAttention forward (Dao et al., 2022) of one
 * block of query rows, the flash tiers' algorithm:
 *
 *   a block of MHA_BR query rows walks the keys in tiles of MHA_BC with a
 *   running max m, running sum l and a rescaled accumulator o:
 *
 *       s   = q k_tile^T (+ mask)        (micro-kernel qk)
 *       m'  = max(m, rowmax(s));  p = exp(s - m')
 *       l   = l * exp(m - m') + rowsum(p)
 *       o   = o * exp(m - m') + p v_tile (micro-kernel pv)
 *       ctx = o / l;  the row statistics (m, 1/l) are kept
 *
 * The score modifiers act on s (mha_score_tile: softcap, ALiBi, the
 * window with the masks); a sink is a first key of score sinks[h] and no
 * value: m and l start at (sink, 1) instead of (-inf, 0).
 *
 * Scores never exist beyond one tile: extra memory is
 * O(MHA_BR * (MHA_BC + d_h)) per thread, whatever Lk is.
 */
#include "engine.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* A latent cache's scores (MLA's absorbed decoding: 576-wide keys, each
 * met by every stacked head) as keys x q^T, the tile's rows the products'
 * A, whose elements are read once each, so the keys need no transposed
 * copy; then the w x mr result transposed into s.  The 576 elements are
 * walked in slabs of the tier's latent_slab, every key against every head
 * through one slab (q^T's slab of 64, 16 KiB, in L1) before the next, the
 * sums carried in st (pv's o += a b from st = 0): on the AVX2 tier, where
 * each block of keys walked all of q^T (147 KiB, from L2), the products
 * ran at about half the FMA peak; the AVX-512 tier takes all 576 at once
 * (faster there: docs/BENCHMARKS.md).  Each score is the same chain of
 * FMAs over d as in q k^T, stored and reloaded exactly (a product's
 * operands commute exactly): the same bits as a cache holding the keys
 * apart, whatever the slab. */
static void latent_scores(const mha_attn *a, const mha_tile_src *src, int mr,
                          int w, flash_scratch *f)
{
    const int dh = (int)a->dh;
    const int slab = a->uk->latent_slab > 0 ? a->uk->latent_slab : dh;
    const float *k = src->kt;
    for (int r = 0; r < w; r++)
        memset(f->st + r * MHA_BR, 0, (size_t)mr * sizeof *f->st);
    for (int d0 = 0; d0 < dh; d0 += slab)
        a->uk->pv(w, dh - d0 < slab ? dh - d0 : slab, mr,
                  k + d0, dh, f->qt + (size_t)d0 * mr, f->st, MHA_BR);
    a->uk->widen_t(MHA_KV_F32, f->st, MHA_BR, w, mr, f->s, MHA_BC, NULL, 0);
}

/* A block's q rows transposed into f->qt ([dh][mr]), for latent_scores. */
static void latent_q(const mha_attn *a, int mr, flash_scratch *f)
{
    if (a->kv && a->kv->latent)
        a->uk->widen_t(MHA_KV_F32, f->qs, a->dh, mr, (int)a->dh, f->qt, mr,
                       NULL, 0);
}

/* o += p v, each panel over the keys it sees (the others' weights are 0:
 * the same sums); where every panel sees every key, one call for all the
 * rows, so that a wide value tile (MLA's 512 columns) passes through L1
 * once for the block, not once a panel (an element's chain is the same
 * whatever the rows beside it: the same bits). */
static void tile_pv(const mha_attn *a, const mha_tile_src *src, int mr,
                    int nc, const int *cols, const float *s,
                    flash_scratch *f)
{
    const int dv = (int)mha_dv(a);
    int whole = 1;
    for (int r0 = 0, n, p = 0; r0 < mr; r0 += n, p++) {
        n = mha_panel_rows(mr, r0);
        whole &= cols[p] == nc;
    }
    if (whole) {
        mha_tile_pv(a, src, mr, nc, s, MHA_BC, f->o, dv);
        return;
    }
    for (int r0 = 0, n, p = 0; r0 < mr; r0 += n, p++) {
        n = mha_panel_rows(mr, r0);
        if (cols[p] > 0)
            mha_tile_pv(a, src, n, cols[p], s + r0 * MHA_BC, MHA_BC,
                        f->o + r0 * dv, dv);
    }
}

/* An underflowed live weight becomes the least subnormal float, which
 * adds nothing visible to a finite value's share but reads the value:
 * NaN or Inf there reaches the row, as in the reference tier (float64
 * weight ~1e-40) and in exact arithmetic.  Not in l: the sum stays the
 * one softmax_rows formed. */
static void keep_underflowed(float *sr, const unsigned char *live, int nc)
{
    for (int c = 0; c < nc; c++)
        if (live[c] && sr[c] == 0.0f)
            sr[c] = FLT_TRUE_MIN;
}

/* The o of a tile read in place kept for a second pv (below): floats. */
enum { O_KEPT = 1024 };

/* The keys each panel of a tile's rows sees: on a diagonal tile each
 * panel's up to its last live one, on any other all nc (the same blocks
 * the kernel would take).  Returns the widest. */
static int panel_cols(const mha_attn *a, const mha_tile *t, int *cols)
{
    int wmax = 0;
    for (int r0 = 0, n, p = 0; r0 < t->mr; r0 += n, p++) {
        n = mha_panel_rows(t->mr, r0);
        cols[p] = mha_tile_panel_cols(a, t, r0, n);
        wmax = cols[p] > wmax ? cols[p] : wmax;
    }
    return wmax;
}

/* A key tile's scores against the block's rows into s ([mr][MHA_BC]):
 * panel by panel, -inf past a panel's keys without a product; then the
 * modifiers. */
static void tile_scores(const mha_attn *a, const mha_tile *t,
                        const mha_tile_src *src, flash_scratch *f, float *s)
{
    const int dh = (int)a->dh, mr = t->mr, nc = t->nc;
    int cols[MHA_BR / MHA_PANEL + 1];
    const int wmax = panel_cols(a, t, cols);
    const int latent = a->kv && a->kv->latent && !t->extra;
    if (latent && wmax > 0)   /* every panel at once, over the widest */
        latent_scores(a, src, mr, wmax, f);   /* (into f->s: slot 0) */
    for (int r0 = 0, n, p = 0; r0 < mr; r0 += n, p++) {
        n = mha_panel_rows(mr, r0);
        const int w = cols[p];
        if (w > 0 && !latent)
            mha_tile_qk(a, src, n, w, f->qs + r0 * dh, s + r0 * MHA_BC,
                        MHA_BC);
        for (int r = r0; r < r0 + n; r++)
            for (int c = w; c < nc; c++)
                s[r * MHA_BC + c] = -INFINITY;
    }
    mha_score_tile(a, t, s, NULL, 0);
}

/* The online-softmax update of the block's rows by a tile whose scores
 * are in s: m, l, the weights, and o += p v. */
static void tile_values(const mha_attn *a, const mha_tile *t,
                        mha_tile_src src, flash_scratch *f, float *s)
{
    const mha_microkernels *uk = a->uk;
    const int dv = (int)mha_dv(a), mr = t->mr, nc = t->nc;
    int cols[MHA_BR / MHA_PANEL + 1];
    (void)panel_cols(a, t, cols);
    /* A tile read in place comes with no flag (tiles.c).  Where its rows
     * see every key of it and no dropout zeroes a weight, the fast pv runs
     * first and o says whether a value was NaN or Inf: each value read is
     * multiplied by a weight >= 0 into o, so one such value makes o NaN or
     * Inf (0 Inf is NaN), and o finite means the fast pv was exact.  Else
     * the values are scanned now, as a stored tile's flag is read. */
    int later = src.unscanned && !a->dropout && mr * dv <= O_KEPT;
    for (int r0 = 0, n, p = 0; r0 < mr; r0 += n, p++) {
        n = mha_panel_rows(mr, r0);
        later &= cols[p] == nc;
    }
    if (src.unscanned && !later)
        (void)uk->amax((const float *)src.v, nc, dv, src.ldv, &src.finite);
    /* Where the value tile holds NaN or Inf (pv_exact below: a zero
     * weight reads no value), the live keys are remembered, so that a
     * weight that exp underflows to 0 is told from a masked one. */
    unsigned char live[MHA_BR * MHA_BC];
    if (!src.finite || later)
        for (int r = 0; r < mr; r++)
            for (int c = 0; c < nc; c++)   /* NaN: live */
                live[r * MHA_BC + c] = s[r * MHA_BC + c] != -INFINITY;
    /* m, l and the weights p = exp(s - m) of every row that has a live
     * score; alpha = exp(m_old - m_new), exactly 1 when the max held
     * (most tiles of a long row), -1 for a row with nothing live yet. */
    float alpha[MHA_BR];
    uk->softmax_rows(mr, nc, s, MHA_BC, f->m, f->l, alpha);
    for (int r = 0; r < mr; r++) {
        float *sr = s + r * MHA_BC;
        if (alpha[r] == -1.0f) {          /* nothing live in this row yet */
            /* ... unless its scores are NaN (a NaN or Inf in the query or
             * in an attended key): NaN from here on, never "no key". */
            for (int c = 0; c < nc; c++)
                if (isnan(sr[c]))
                    f->m[r] = f->l[r] = NAN;
            memset(sr, 0, (size_t)nc * sizeof *sr);
            continue;
        }
        if (!src.finite)
            keep_underflowed(sr, live + r * MHA_BC, nc);
        if (alpha[r] != 1.0f)
            uk->scale(f->o + r * dv, f->o + r * dv, dv, alpha[r]);
        if (a->dropout)
            for (int c = 0; c < nc; c++)
                if (!mha_dropout_keep(a->seed, a->p_drop, t->b, t->h,
                                      a->drop_row0 + t->i0 + r, t->j0 + c))
                    sr[c] = 0.0f;
    }
    float kept[O_KEPT];
    if (later)
        memcpy(kept, f->o, (size_t)(mr * dv) * sizeof *kept);
    tile_pv(a, &src, mr, nc, cols, s, f);
    if (!later)
        return;
    int o_finite = 1, v_finite = 1;
    (void)uk->amax(f->o, mr, dv, dv, &o_finite);
    if (o_finite)
        return;
    (void)uk->amax((const float *)src.v, nc, dv, src.ldv, &v_finite);
    if (v_finite)
        return;   /* (NaN from q or k: the fast pv was the exact one) */
    /* a NaN or Inf value: o as it was, and the tile's pv as a flagged
     * tile's (the weights as the row loop above would have left them) */
    memcpy(f->o, kept, (size_t)(mr * dv) * sizeof *kept);
    src.finite = 0;
    for (int r = 0; r < mr; r++)
        if (alpha[r] != -1.0f)
            keep_underflowed(s + r * MHA_BC, live + r * MHA_BC, nc);
    tile_pv(a, &src, mr, nc, cols, s, f);
}


/* One key tile against the block's rows. */
static void output_tile(const mha_attn *a, const mha_tile *t, void *ctx)
{
    flash_scratch *f = ctx;
    const mha_tile_src src = mha_tile_source(a, t, f->kvt);
    tile_scores(a, t, &src, f, f->s);
    tile_values(a, t, src, f, f->s);
}

/*
 * Decoding on a cache, a lone query row reads each key and value tile
 * once: read one after the other, memory sees 16 KiB of keys, 16 KiB of
 * values, and again, two streams taking turns, which one core reads
 * slower than longer runs of either (docs/BENCHMARKS.md).  So the scores
 * of AHEAD tiles (a decoding chunk's) are formed first, each in its own
 * row of f->s, then their values read in turn: the same products and
 * updates in the same order, the same bits.  Only for lone rows of
 * 16-bit tiles (1.1-1.3x on Zen 4): blocks of several rows (GQA) already
 * ask for the next tile's rows as they read, and q8/q4 tiles for their
 * codes, which the reordering only moves; f32 tiles (32 KiB) gained
 * nothing sure (0.85-1.1x in noisy rounds).  A tile that
 * needs its own buffers at once (an explicit mask's bias, the extra
 * keys) first finishes those queued.
 */
enum { AHEAD = 8 };
typedef struct {
    flash_scratch *f;
    int n;               /* tiles queued: their scores in slots 0 .. n-1 */
    mha_tile t[AHEAD];
} ahead_queue;

static float *slot(const ahead_queue *q, int i, int mr)
{
    return q->f->s + (int64_t)i * mr * MHA_BC;
}

static void finish_queued(const mha_attn *a, ahead_queue *q)
{
    for (int i = 0; i < q->n; i++)
        tile_values(a, &q->t[i], mha_tile_source(a, &q->t[i], q->f->kvt),
                    q->f, slot(q, i, q->t[i].mr));
    q->n = 0;
}

static void queue_tile(const mha_attn *a, const mha_tile *t, void *ctx)
{
    ahead_queue *q = ctx;
    if (t->extra || t->how == MHA_TILE_EXPLICIT) {
        finish_queued(a, q);
        output_tile(a, t, q->f);
        return;
    }
    const mha_tile_src src = mha_tile_source(a, t, q->f->kvt);
    tile_scores(a, t, &src, q->f, slot(q, q->n, t->mr));
    q->t[q->n++] = *t;
    if (q->n == AHEAD)
        finish_queued(a, q);
}

/* The walk's callback and its context: tiles queued for a cache's lone
 * row, else each at once. */
static mha_tile_fn tile_fn(const mha_attn *a, int mr, flash_scratch *f,
                           ahead_queue *q, void **ctx)
{
    q->f = f;
    q->n = 0;
    if (mr == 1 && a->kv && !a->kv->latent && !a->dropout &&
        (a->kv->dtype == MHA_KV_F16 || a->kv->dtype == MHA_KV_BF16)) {
        *ctx = q;
        return queue_tile;
    }
    *ctx = f;
    return output_tile;
}

/*
 * The running (m, l, o) of mr rows before the first tile: nothing (m =
 * -inf, l = 0), or with sinks and the extra keys (the part of the keys
 * that holds them, once), the sink of the row's head as the first key,
 * m = sink, l = exp(0) = 1, with no value.  Row r's head is
 * h0 + r / stack (stack = 0: h0 for every row).
 */
static void start_rows(const mha_attn *a, int64_t h0, int stack, int mr,
                       int with_extra, flash_scratch *f)
{
    memset(f->o, 0, (size_t)(mr * mha_dv(a)) * sizeof *f->o);
    for (int r = 0; r < mr; r++) {
        const int sink = a->sinks && with_extra;
        f->m[r] = sink ? a->sinks[h0 + (stack ? r / stack : 0)] : -INFINITY;
        f->l[r] = sink ? 1.0f : 0.0f;
    }
}

void mha_flash_rows(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                    int mr, int64_t k0, int64_t k1, int with_extra,
                    flash_scratch *f)
{
    mha_load_q(a, b, h, i0, mr, f->qs);
    latent_q(a, mr, f);
    start_rows(a, h, 0, mr, with_extra, f);
    ahead_queue q;
    void *ctx;
    const mha_tile_fn fn = tile_fn(a, mr, f, &q, &ctx);
    mha_for_each_tile(a, b, h, i0, mr, k0, k1, with_extra, f->bias, fn,
                      ctx);
    finish_queued(a, &q);
}

void mha_flash_rows_stacked(const mha_attn *a, int64_t b, int64_t h0,
                            int nh, int stack, int64_t k0, int64_t k1,
                            int with_extra, flash_scratch *f)
{
    const int mr = stack * nh;
    for (int hh = 0; hh < nh; hh++)
        mha_load_q(a, b, h0 + hh, 0, stack,
                   f->qs + (int64_t)hh * stack * a->dh);
    latent_q(a, mr, f);
    start_rows(a, h0, stack, mr, with_extra, f);
    ahead_queue q;
    void *ctx;
    const mha_tile_fn fn = tile_fn(a, mr, f, &q, &ctx);
    mha_for_each_tile_stacked(a, b, h0, nh, 0, stack, k0, k1, with_extra,
                              fn, ctx);
    finish_queued(a, &q);
}

void mha_flash_finish(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                      int mr, const float *m, const float *l, const float *o)
{
    const int64_t dv = mha_dv(a);
    const float keep = (float)mha_keep_scale(a);
    for (int r = 0; r < mr; r++) {
        float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i0 + r);
        const int none = m[r] == -INFINITY || l[r] == 0.0f;
        st[0] = none ? -INFINITY : m[r];   /* no key: zero context, */
        st[1] = none ? 0.0f : 1.0f / l[r];  /* zero weights            */
        const float inv = a->dropout ? st[1] * keep : st[1];
        if (a->x16 != MHA_KV_F32) {   /* rounded as it is written */
            uint16_t *dst = mha_ctx_row16(a, b, h, i0 + r);
            if (none)
                memset(dst, 0, (size_t)dv * sizeof *dst);
            else
                mha_store_row16(a, dst, o + r * dv, dv, &inv);
            continue;
        }
        float *dst = mha_ctx_row(a, b, h, i0 + r);
        if (none)
            memset(dst, 0, (size_t)dv * sizeof *dst);
        else
            a->uk->scale(dst, o + r * dv, (int)dv, inv);
    }
}

void mha_flash_block(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                     int mr, flash_scratch *f)
{
    mha_flash_rows(a, b, h, i0, mr, 0, a->Lk, 1, f);
    mha_flash_finish(a, b, h, i0, mr, f->m, f->l, f->o);
}
