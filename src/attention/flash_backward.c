/*
 * flash_backward.c -- the backward of the flash tiers.  With
 * P = softmax(S), S = scale q k^T + mask, dropout keep mask D and
 * P~ = P * D / (1 - p) (P~ = P without dropout), ctx = P~ v, and dO the
 * gradient of ctx:
 *
 *     dv  = P~^T dO
 *     dP~ = dO v^T,   dP = dP~ * D / (1 - p)
 *     dS  = P * (dP - delta),  delta_i = sum_j P_ij dP_ij
 *     dq  = scale dS k,   dk = scale dS^T q
 *
 * P is recomputed tile by tile from the forward's row stats (m, 1/l),
 * exactly as the forward computed it, so nothing of size Lq x Lk is ever
 * stored: a block of 64 query rows (128 from Lk = 4096, block_rows)
 * caches its own P and dP~ (rows x Lk each, O(L) per thread) between two
 * sweeps over its key tiles, the first for delta, the second for the
 * gradients.  One work item is one (batch, K/V head g): it owns the rows
 * of dk and dv of g and of dq of the query heads that read g (one head
 * without grouped-query attention), and walks those heads in ascending
 * order, each one's query blocks in order, each block against its key
 * tiles in order, adding into dk and dv (summed in the item's own
 * contiguous rows, copied out at the end).  Every sum therefore has one
 * fixed order, whatever the thread count.  dS is set to 0 wherever P
 * is 0 (masked keys, rows with no key), so a masked key's NaN cannot
 * reach any gradient.
 *
 * The score modifiers: with a softcap s = c tanh(u / c) of the raw score
 * u, dS is taken through it, dU = dS (1 - tanh^2) (the derivative cached
 * beside P); ALiBi and the window are constants.  A sink adds
 * exp(sink - m) / l to nothing but the denominator: P already includes
 * it through the stats, and dL/d sink = -P_sink delta.
 */
#include "engine.h"

#include <math.h>
#include <string.h>

/*
 * Query rows per block of the backward: the forward's 64, or 128 (BRB)
 * from Lk = 4096 keys on.  A block streams every key tile it sees (K and
 * V in both packings) and the item's dk and dv rows once per sweep,
 * whatever its height, while its cache of P and dP~ costs the same per
 * row: at Lk = 4096, 64-row blocks stream 64 KiB of K and V and 64 KiB
 * of dk, dv per row, 128-row blocks half that (the cache: 64 KiB a row
 * either way).  Taller blocks pay from Lk = 4096 on and lose below, where
 * the streams still sit in L2 and L3 (docs/BENCHMARKS.md, "The
 * attention's backward").  The height depends on the shape
 * alone, so the results stay bitwise the same for every thread count.
 */
enum { BRB = 2 * MHA_BR, TALL_FROM_LK = 4096, PVT_ROWS = MHA_BR };

static int block_rows(const mha_attn *a)
{
    return a->Lk >= TALL_FROM_LK ? BRB : MHA_BR;
}

typedef struct bwd_scratch {
    float *qs;         /* [BRB][dh]  the block's q rows, scaled            */
    float *o;          /* [BRB][dh]  the block's dq (unscaled)             */
    float *s;          /* [BRB][BC]  P~ of a tile, under dropout           */
    float *bias;       /* [BRB][BC]  an explicit mask's tile               */
    float *dout;       /* [BRB][dv]  dO of the block                       */
    float *dp;         /* [BRB][BC]  dP, then dS                           */
    float *pc, *dpc;   /* [tiles][BRB][BC]  the block's P and dP~, tile by
                          tile (each tile's rows one run of memory)       */
    float *cc;         /* [tiles][BRB][BC]  with a softcap: its
                          derivative 1 - tanh^2 at each score, or NULL    */
    double delta[BRB];
    int rows;          /* block_rows: the height of a block and of a
                          cache tile                                     */
    float *extra;      /* [2][2][d]  dk ([dh]), dv ([dv]) of the extra keys */
    float *dkc, *dvc;  /* [Lk][dh], [Lk][dv]  the item's dk and dv        */
    mha_packed fwd, bwd;   /* the forward's packing and the backward's    */
    int dout_finite, q_finite;
} bwd_scratch;

/* Floats of a block's cache of P or dP~: a BRB x BC tile for every tile
 * of the keys (and one to spare). */
static int64_t cache_floats(int64_t Lt)
{
    return ((Lt + MHA_BC - 1) / MHA_BC + 1) * (BRB * MHA_BC);
}

/* Tile t's part of a block's cache ([rows][BC], contiguous). */
static float *cache_tile(const bwd_scratch *w, float *cache,
                         const mha_tile *t)
{
    return cache + t->index * (w->rows * MHA_BC);
}

/* (dh: the wider of the keys' and the values' head widths, mha_dmax) */
int64_t mha_flash_bwd_scratch_floats(int64_t dh, int64_t Lt, int softcap)
{
    return 3 * BRB * dh + 3 * BRB * MHA_BC +
           (softcap ? 3 : 2) * cache_floats(Lt) + 4 * dh + 2 * Lt * dh;
}

static bwd_scratch bwd_scratch_at(float *base, int64_t dh, int64_t Lt,
                                  int softcap)
{
    bwd_scratch w;
    w.qs = base;
    w.o = w.qs + BRB * dh;
    w.dout = w.o + BRB * dh;
    w.s = w.dout + BRB * dh;
    w.bias = w.s + BRB * MHA_BC;
    w.dp = w.bias + BRB * MHA_BC;
    w.pc = w.dp + BRB * MHA_BC;
    w.dpc = w.pc + cache_floats(Lt);
    w.extra = w.dpc + cache_floats(Lt);
    w.dkc = w.extra + 4 * dh;
    w.dvc = w.dkc + Lt * dh;
    w.cc = softcap ? w.dvc + Lt * dh : NULL;
    return w;
}

/* The backward reads each key tile as rows (for dq = dS k) and each value
 * tile transposed (for dP~ = dO v^T): the transposes of the forward's
 * packing, made once per call from it. */
void mha_pack_backward_tile(const mha_attn *a, const mha_attn_grad *g,
                            int64_t item)
{
    const mha_packed fp = mha_packed_at(a->packed, a);
    const mha_packed bp = mha_packed_at(g->packed, a);
    const int64_t t = item % fp.tiles, bg = item / fp.tiles;
    const int64_t b = bg / a->Hkv, kvh = bg % a->Hkv, dh = a->dh,
                  dv = mha_dv(a);
    const int nc = mha_tile_keys(a, t);
    const float *kt = mha_packed_a(&fp, b, kvh, t);
    const float *v = mha_packed_b(&fp, b, kvh, t);
    float *kc = mha_packed_a(&bp, b, kvh, t), *vt = mha_packed_b(&bp, b, kvh, t);
    int finite = 1;
    if (t != fp.tiles - 1) {
        /* the real keys' rows copied (16-bit: widened), the values' tile
         * transposed (VL x VL blocks in registers): the same floats as
         * the forward's tiles */
        if (a->x16 != MHA_KV_F32 && nc > 0) {
            a->uk->widen_t(a->x16, mha_key_row16(a, b, kvh, t * MHA_BC),
                           a->ldk, nc, (int)dh, NULL, 0, kc, (int)dh);
            (void)a->uk->amax(kc, nc, dh, dh, &finite);
        }
        for (int c = 0; a->x16 == MHA_KV_F32 && c < nc; c++)
            finite &= a->uk->copy_finite(kc + c * dh,
                                         mha_key_row(a, b, kvh, t * MHA_BC + c),
                                         (int)dh);
        if (nc > 0)
            a->uk->widen_t(MHA_KV_F32, v, dv, nc, (int)dv, vt, MHA_BC, NULL,
                           0);
        *mha_packed_flag(&bp, b, kvh, t) = (float)finite;
        return;
    }
    for (int c = 0; c < nc; c++) {   /* the extra keys' tile */
        for (int64_t d = 0; d < dh; d++) {
            kc[c * dh + d] = kt[d * MHA_BC + c];
            finite &= isfinite(kc[c * dh + d]) != 0;
        }
        for (int64_t d = 0; d < dv; d++)
            vt[d * MHA_BC + c] = v[c * dv + d];
    }
    *mha_packed_flag(&bp, b, kvh, t) = (float)finite;
}

/*
 * First sweep over a block's tiles: P (exactly as the forward computed it)
 * and dP~ = dO v^T into the block's cache, and delta_i = sum_j P_ij dP_ij
 * summed in float64.  delta is computed here rather than as dO_i . ctx_i:
 * ctx carries the forward's rounding, and an error in delta_i shifts dq_i
 * by delta's error times a P-weighted mean of k, which does not cancel.
 */
static void probs_tile(const mha_attn *a, const mha_tile *t, void *ctx)
{
    bwd_scratch *w = ctx;
    const mha_microkernels *uk = a->uk;
    const int dh = (int)a->dh, dv = (int)mha_dv(a), mr = t->mr, nc = t->nc;
    const int64_t b = t->b, h = t->h;
    float *pc = cache_tile(w, w->pc, t), *dpc = cache_tile(w, w->dpc, t);
    const double keep = mha_keep_scale(a);

    /* The scores, then P, in the cache itself, and dP~; on a diagonal
     * tile panel by panel, over the keys each panel sees (the others:
     * -inf and 0 without a product, mha_tile_panel_cols). */
    const float *kt = mha_packed_a(&w->fwd, b, t->g, t->index);
    const float *vt = mha_packed_b(&w->bwd, b, t->g, t->index);
    for (int r0 = 0, n; r0 < mr; r0 += n) {
        n = mha_panel_rows(mr, r0);
        const int cols = mha_tile_panel_cols(a, t, r0, n);
        if (cols > 0) {
            uk->qk(n, cols, dh, w->qs + r0 * dh, kt, MHA_BC,
                   pc + r0 * MHA_BC, MHA_BC);
            uk->qk(n, cols, dv, w->dout + r0 * dv, vt, MHA_BC,
                   dpc + r0 * MHA_BC, MHA_BC);
        }
        for (int r = r0; r < r0 + n; r++)
            for (int c = cols; c < nc; c++) {
                pc[r * MHA_BC + c] = -INFINITY;
                dpc[r * MHA_BC + c] = 0.0f;
            }
    }
    mha_score_tile(a, t, pc, w->cc ? cache_tile(w, w->cc, t) : NULL, MHA_BC);
    for (int r = 0; r < mr; r++) {
        const int64_t i = t->i0 + r;
        const float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i);
        float *pr = pc + r * MHA_BC;
        if (st[0] == -INFINITY) {
            memset(pr, 0, (size_t)nc * sizeof *pr);
            continue;
        }
        const float *dr = dpc + r * MHA_BC;
        if (!a->dropout) {   /* P and its share of delta in one pass */
            w->delta[r] += uk->probs(pr, nc, st[0], st[1], dr);
            continue;
        }
        (void)uk->probs(pr, nc, st[0], st[1], NULL);
        double sum = 0.0;
        for (int c = 0; c < nc; c++)
            if (pr[c] != 0.0f &&
                mha_dropout_keep(a->seed, a->p_drop, b, h, i, t->j0 + c))
                sum += (double)pr[c] * dr[c];
        w->delta[r] += sum * keep;
    }
}

/* Second sweep: dS = P * (dP - delta), and the tile's shares of dv, dq
 * and dk. */
static void grads_tile(const mha_attn *a, const mha_tile *t, void *ctx)
{
    bwd_scratch *w = ctx;
    const mha_microkernels *uk = a->uk;
    const int dh = (int)a->dh, dv = (int)mha_dv(a), mr = t->mr, nc = t->nc;
    const int64_t b = t->b, h = t->h, j0 = t->j0;
    const float *pc = cache_tile(w, w->pc, t), *dpc = cache_tile(w, w->dpc, t);
    const float *cc = w->cc ? cache_tile(w, w->cc, t) : NULL;
    const float *kc = mha_packed_a(&w->bwd, b, t->g, t->index);
    const int k_finite = *mha_packed_flag(&w->bwd, b, t->g, t->index) != 0.0f;
    const float keep = (float)mha_keep_scale(a);

    /* dS = P * (dP - delta) into dp (times the softcap's derivative
     * with one); under dropout also P~ (P with the dropped keys zeroed,
     * kept ones scaled) into s for dv.  Without dropout dv reads P from
     * the cache as it is. */
    for (int r = 0; r < mr; r++) {
        const int64_t i = t->i0 + r;
        const float *pr = pc + r * MHA_BC, *dpr = dpc + r * MHA_BC;
        const float delta = (float)w->delta[r];
        float *dr = w->dp + r * MHA_BC;
        if (cc) {
            const float *cr = cc + r * MHA_BC;
            for (int c = 0; c < nc; c++) {
                float dp = dpr[c];
                if (a->dropout)
                    dp = mha_dropout_keep(a->seed, a->p_drop, b, h, i, j0 + c)
                             ? dp * keep : 0.0f;
                const float ds = pr[c] * (dp - delta) * cr[c];
                dr[c] = pr[c] == 0.0f ? 0.0f : ds;
            }
            if (a->dropout) {
                float *ptr = w->s + r * MHA_BC;
                for (int c = 0; c < nc; c++)
                    ptr[c] = mha_dropout_keep(a->seed, a->p_drop, b, h, i,
                                              j0 + c)
                                 ? pr[c] * keep : 0.0f;
            }
            continue;
        }
        if (!a->dropout) {
            uk->dscore(pr, dpr, delta, dr, nc);
            continue;
        }
        float *ptr = w->s + r * MHA_BC;
        for (int c = 0; c < nc; c++) {
            float pd = pr[c] * keep, dp = dpr[c] * keep;
            if (!mha_dropout_keep(a->seed, a->p_drop, b, h, i, j0 + c))
                pd = dp = 0.0f;
            ptr[c] = pd;
            dr[c] = pr[c] == 0.0f ? 0.0f : pr[c] * (dp - delta);
        }
    }
    /* (P~ and the cache's P both have rows MHA_BC floats apart) */
    const float *pt = a->dropout ? w->s : pc;
    float *dk_dst, *dv_dst;
    int64_t lddk, lddv;
    if (t->extra) {
        dk_dst = w->extra;
        dv_dst = w->extra + 2 * dh;
    } else {
        dk_dst = w->dkc + j0 * dh;
        dv_dst = w->dvc + j0 * dv;
    }
    lddk = dh;
    lddv = dv;
    /* Each (block, tile)'s share of dv, dq and dk is summed apart, then
     * added (the kernels' pv_add / pvt): two levels of float sums (over a
     * block's rows or a tile's keys, then over the blocks or tiles)
     * instead of one chain as long as Lq or Lk. */
    /* On a diagonal tile the products skip what P = 0 leaves out: dv and
     * dk panel by panel of keys, each from the first row that sees the
     * panel's first key (the sums start from 0 and the rows before add
     * only zeros: the same bits), dq panel by panel of rows, over the
     * keys the panel sees.  Any other tile: one call each.  dv and dk
     * are summed over at most PVT_ROWS rows a call (rows q0 .. q0 +
     * PVT_ROWS - 1 of the block, fixed whatever the tile): 128 rows of
     * dO or q (32 KiB, rows 256 bytes apart) filled the L1 sets they map
     * to, and the rows of P read beside them evicted them. */
    const int diag = t->how == MHA_TILE_BY_INDEX;
    for (int c0 = 0, n; c0 < nc; c0 += n) {
        n = diag ? mha_panel_rows(nc, c0) : nc;
        const int first = mha_tile_first_row(a, t, c0);
        for (int q0 = 0; q0 < mr; q0 += PVT_ROWS) {
            const int r0 = first > q0 ? first : q0,
                      r1 = q0 + PVT_ROWS < mr ? q0 + PVT_ROWS : mr;
            if (r0 >= r1)
                continue;
            (w->dout_finite ? uk->pvt : uk->pvt_exact)(
                r1 - r0, n, dv, pt + r0 * MHA_BC + c0, MHA_BC,
                w->dout + r0 * dv, dv_dst + c0 * lddv, (int)lddv);
            /* dk += dS^T (scale q): qs already holds the scaled rows. */
            (w->q_finite ? uk->pvt : uk->pvt_exact)(
                r1 - r0, n, dh, w->dp + r0 * MHA_BC + c0, MHA_BC,
                w->qs + r0 * dh, dk_dst + c0 * lddk, (int)lddk);
        }
    }
    /* dq (unscaled: the block's dq is scaled once at the end) += dS k. */
    for (int r0 = 0, n; r0 < mr; r0 += n) {
        n = diag ? mha_panel_rows(mr, r0) : mr;
        const int cols = mha_tile_panel_cols(a, t, r0, n);
        if (cols > 0)
            (k_finite ? uk->pv_add : uk->pv_add_exact)(
                n, cols, dh, w->dp + r0 * MHA_BC, MHA_BC, kc,
                w->o + r0 * dh, dh);
    }
}

/* dO of the block's rows, packed, and whether it and the block's q are
 * finite; delta starts at 0 (the first sweep sums it). */
static void load_block(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                       int64_t h, int64_t i0, int mr, bwd_scratch *w)
{
    const int64_t dh = a->dh, dv = mha_dv(a);
    int fin = 1;
    for (int r = 0; r < mr; r++) {
        const int64_t at = mha_row_at(dv, a->Lq, g->lddc, g->hsdc, g->bsdc, b,
                                      h, i0 + r);
        float *dst = w->dout + r * dv;
        if (a->x16 != MHA_KV_F32) {   /* widened, then its flag */
            int f;
            a->uk->widen_t(a->x16,
                           (const uint16_t *)(const void *)g->dctx + at, 0,
                           1, (int)dv, NULL, 0, dst, (int)dv);
            (void)a->uk->amax(dst, 1, dv, dv, &f);
            fin &= f;
        } else {
            fin &= a->uk->copy_finite(dst, g->dctx + at, (int)dv);
        }
        w->delta[r] = 0.0;
    }
    w->dout_finite = fin;
    fin = 1;
    for (int64_t x = 0; x < mr * dh; x++)
        fin &= isfinite(w->qs[x]) != 0;
    w->q_finite = fin;
}

/* The item's dk and dv, summed in contiguous rows (a tile's 64 rows one
 * run of memory, not 64 rows a row stride apart in dk), into the (b, g)
 * slices of dk and dv. */
static void store_item(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                       int64_t kvh, const float *dkc, const float *dvc)
{
    const int64_t dh = a->dh, dv = mha_dv(a);
    for (int64_t j = 0; j < a->Lk; j++) {
        const int64_t ak = mha_row_at(dh, a->Lk, g->lddk, g->hsdk, g->bsdk, b,
                                      kvh, j),
                      av = mha_row_at(dv, a->Lk, g->lddv, g->hsdv, g->bsdv, b,
                                      kvh, j);
        if (a->x16 != MHA_KV_F32) {   /* rounded as they are stored */
            mha_store_row16(a, (uint16_t *)(void *)g->dk + ak, dkc + j * dh,
                            dh, NULL);
            mha_store_row16(a, (uint16_t *)(void *)g->dv + av, dvc + j * dv,
                            dv, NULL);
            continue;
        }
        memcpy(g->dk + ak, dkc + j * dh, (size_t)dh * sizeof(float));
        memcpy(g->dv + av, dvc + j * dv, (size_t)dv * sizeof(float));
    }
}

/* The extra keys' gradients: bias_k / bias_v of this (b, g), or nothing
 * for the zero key (a constant). */
static void store_extra(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                        int64_t kvh, const float *dk, const float *dv)
{
    if (!a->bias_k || !g->dbias_k)
        return;
    const int64_t dh = a->dh, dvw = mha_dv(a);
    memcpy(g->dbias_k + (b * a->Hkv + kvh) * dh, dk, (size_t)dh * sizeof *dk);
    memcpy(g->dbias_v + (b * a->Hkv + kvh) * dvw, dv,
           (size_t)dvw * sizeof *dv);
}

/* Query head h's share: its dq, and its additions to dk, dv of its K/V
 * head (and with sinks, dL/d sinks[h] of batch b: -sum_i P_sink,i
 * delta_i, the sink's P from the row stats, summed in float64). */
static void bwd_head(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                     int64_t h, bwd_scratch *w)
{
    const int64_t dh = a->dh;
    double dsink = 0.0;
    const int rows = w->rows;
    for (int64_t i0 = 0; i0 < a->Lq; i0 += rows) {
        const int mr = (int)(a->Lq - i0 < rows ? a->Lq - i0 : rows);
        mha_load_q(a, b, h, i0, mr, w->qs);
        load_block(a, g, b, h, i0, mr, w);
        memset(w->o, 0, (size_t)(mr * dh) * sizeof *w->o);
        mha_for_each_tile(a, b, h, i0, mr, 0, a->Lk, 1, w->bias, probs_tile,
                          w);
        /* A part of a split-key problem: delta is the whole row's. */
        for (int r = 0; g->row_delta && r < mr; r++)
            w->delta[r] = g->row_delta[(b * a->H + h) * a->Lq + i0 + r];
        for (int r = 0; a->sinks && r < mr; r++) {
            const float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i0 + r);
            dsink -= exp((double)a->sinks[h] - st[0]) * st[1] * w->delta[r];
        }
        mha_for_each_tile(a, b, h, i0, mr, 0, a->Lk, 1, w->bias, grads_tile,
                          w);
        for (int r = 0; r < mr; r++) {
            const int64_t at = mha_row_at(a->dh, a->Lq, g->lddq, g->hsdq,
                                          g->bsdq, b, h, i0 + r);
            if (a->x16 != MHA_KV_F32)
                mha_store_row16(a, (uint16_t *)(void *)g->dq + at,
                                w->o + r * dh, dh, &a->scale);
            else
                a->uk->scale(g->dq + at, w->o + r * dh, (int)dh, a->scale);
        }
    }
    if (a->sinks && g->dsinks)
        g->dsinks[b * a->H + h] = (float)dsink;
}

void mha_flash_bwd_item(const mha_attn *a, const mha_attn_grad *g, int64_t b,
                        int64_t kvh, float *scratch)
{
    const int64_t dh = a->dh, group = a->H / a->Hkv;
    bwd_scratch w = bwd_scratch_at(scratch, mha_dmax(a), a->Lt,
                                   a->softcap > 0.0f);
    w.fwd = mha_packed_at(a->packed, a);
    w.bwd = mha_packed_at(g->packed, a);
    w.rows = block_rows(a);
    memset(w.dkc, 0, (size_t)(a->Lk * dh) * sizeof *w.dkc);
    memset(w.dvc, 0, (size_t)(a->Lk * mha_dv(a)) * sizeof *w.dvc);
    memset(w.extra, 0, (size_t)(4 * mha_dmax(a)) * sizeof *w.extra);
    for (int64_t h = kvh * group; h < (kvh + 1) * group; h++)
        bwd_head(a, g, b, h, &w);
    store_item(a, g, b, kvh, w.dkc, w.dvc);
    store_extra(a, g, b, kvh, w.extra, w.extra + 2 * dh);
}
