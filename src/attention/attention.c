/*
 * attention.c -- softmax(q k^T * scale + mask) v for every (batch, head,
 * query row), two ways:
 *
 *   ref      one query row at a time, the whole score row materialised,
 *            every sum in float64: slow, obviously right, never deleted.
 *   flash    (scalar and avx2 tiers) the FlashAttention algorithm: a block
 *            of MHA_BR query rows walks the keys in tiles of MHA_BC with a
 *            running max m, running sum l and a rescaled accumulator o:
 *
 *                s   = q k_tile^T (+ mask)        (micro-kernel qk)
 *                m'  = max(m, rowmax(s));  p = exp(s - m')
 *                l   = l * exp(m - m') + rowsum(p)
 *                o   = o * exp(m - m') + p v_tile (micro-kernel pv)
 *                ctx = o / l;  the row statistics (m, 1/l) are kept
 *
 *            Scores never exist beyond one tile: extra memory is
 *            O(MHA_BR * (MHA_BC + d_h)) per thread, whatever Lk is.
 *
 * Masking by index costs nothing: tiles past the last key that causal
 * masking and key_lengths leave are never visited, and a tile wholly
 * before the first row's limit needs no mask at all.  Only tiles on the
 * diagonal, or under an explicit mask, are masked element by element.
 *
 * Attention weights, when asked for, are a second pass over the tiles
 * that recomputes p = exp(s - m) / l from the saved row statistics, so the
 * output is bitwise the same whether weights are asked for or not.
 *
 * Work is split into items that one thread computes alone, in a fixed
 * order: (b, h, query block) for the output, (b, query block) for the
 * weights (heads summed in order for the average).  Results are therefore
 * bitwise identical for any thread count.
 */
#include "attention.h"

#include <float.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* s + bias, where bias -inf excludes and finite sums saturate. */
static inline float masked(float s, float bias)
{
    if (bias == -INFINITY)
        return -INFINITY;
    if (!isfinite(s))
        return s;
    const float x = s + bias;
    return x < -FLT_MAX ? -FLT_MAX : x > FLT_MAX ? FLT_MAX : x;
}

/* ---- the flash tiers ------------------------------------------------------ */

typedef struct flash_scratch {
    float *qs;    /* [BR][dh]  query rows * scale      */
    float *o;     /* [BR][dh]  running output          */
    float *s;     /* [BR][BC]  scores, then p          */
    float *bias;  /* [BR][BC]  mask of a partial tile  */
    float *m, *l; /* [BR]      running max and sum     */
} flash_scratch;

static flash_scratch carve(float *base, int64_t dh)
{
    flash_scratch f;
    f.qs = base;
    f.o = f.qs + MHA_BR * dh;
    f.s = f.o + MHA_BR * dh;
    f.bias = f.s + MHA_BR * MHA_BC;
    f.m = f.bias + MHA_BR * MHA_BC;
    f.l = f.m + MHA_BR;
    return f;
}

static void pack_q(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                   int mr, float *qs)
{
    const int64_t dh = a->dh;
    for (int r = 0; r < mr; r++) {
        const float *src = a->q + (b * a->Lq + i0 + r) * a->ldq + h * dh;
        for (int64_t d = 0; d < dh; d++)
            qs[r * dh + d] = src[d] * a->scale;
    }
}

/*
 * Packs keys j0 .. j0+nc-1 (real ones, or the extra keys when extra is
 * set) of head h: kt [dh][MHA_BC] transposed, v [nc][dh] contiguous.
 * Returns whether every value is finite (then the fast pv kernel is
 * exact).
 */
static int pack_kv(const mha_attn *a, int64_t b, int64_t h, int64_t j0,
                   int nc, int extra, float *kt, float *v)
{
    const int64_t dh = a->dh;
    int finite = 1;
    for (int c = 0; c < nc; c++) {
        const float *kr, *vr;
        if (!extra) {
            kr = a->k + (b * a->Lk + j0 + c) * a->ldk + h * dh;
            vr = a->v + (b * a->Lk + j0 + c) * a->ldv + h * dh;
        } else if (c == 0 && a->bias_k) {
            kr = a->bias_k + h * dh;
            vr = a->bias_v + h * dh;
        } else {
            kr = vr = NULL;   /* the zero key of add_zero_attn */
        }
        for (int64_t d = 0; d < dh; d++)
            kt[d * MHA_BC + c] = kr ? kr[d] : 0.0f;
        if (vr)
            memcpy(v + c * dh, vr, (size_t)dh * sizeof *v);
        else
            memset(v + c * dh, 0, (size_t)dh * sizeof *v);
        for (int64_t d = 0; d < dh; d++)
            finite &= isfinite(v[c * dh + d]) != 0;
    }
    return finite;
}

/*
 * K and V are packed once per call, before any attention, into
 *   kt  [B][H][tiles + 1][dh][MHA_BC]   each key tile transposed
 *   v   [B][H][tiles + 1][MHA_BC][dh]   each value tile contiguous
 *   fin [B][H][tiles + 1]               1.0 if the value tile is finite
 * where tile `tiles` holds the extra keys (bias_k, zero key).  Every
 * query block then reads the same packed tiles.
 */
static int64_t tiles_of(const mha_attn *a)
{
    return (a->Lk + MHA_BC - 1) / MHA_BC + 1;
}

int64_t mha_attn_packed(int64_t B, int64_t H, int64_t Lk, int64_t dh)
{
    const int64_t tiles = (Lk + MHA_BC - 1) / MHA_BC + 1;
    return B * H * tiles * (2 * MHA_BC * dh + 1);
}

static float *packed_kt(const mha_attn *a, int64_t b, int64_t h, int64_t t)
{
    return a->packed + ((b * a->H + h) * tiles_of(a) + t) * MHA_BC * a->dh;
}

static float *packed_v(const mha_attn *a, int64_t b, int64_t h, int64_t t)
{
    const int64_t all = a->B * a->H * tiles_of(a) * MHA_BC * a->dh;
    return a->packed + all +
           ((b * a->H + h) * tiles_of(a) + t) * MHA_BC * a->dh;
}

static float *packed_finite(const mha_attn *a, int64_t b, int64_t h,
                            int64_t t)
{
    const int64_t all = a->B * a->H * tiles_of(a) * MHA_BC * a->dh;
    return a->packed + 2 * all + (b * a->H + h) * tiles_of(a) + t;
}

static void pack_tile(const mha_attn *a, int64_t item)
{
    const int64_t tiles = tiles_of(a), t = item % tiles, bh = item / tiles;
    const int64_t b = bh / a->H, h = bh % a->H;
    const int extra = t == tiles - 1;
    const int64_t j0 = extra ? a->Lk : t * MHA_BC;
    const int nc = extra ? (a->bias_k != NULL) + (a->zero_attn != 0)
                 : (int)(a->Lk - j0 < MHA_BC ? a->Lk - j0 : MHA_BC);
    *packed_finite(a, b, h, t) =
        (float)pack_kv(a, b, h, j0, nc, extra, packed_kt(a, b, h, t),
                       packed_v(a, b, h, t));
}

/* How a tile is masked: not at all, by index only (causal, key_lengths:
 * each row's keys past its limit), or by an explicit mask (f->bias). */
enum { TILE_OPEN = 0, TILE_BY_INDEX = 1, TILE_EXPLICIT = 2 };

static void mask_tile(const mha_attn *a, int64_t b, int64_t i0, int mr,
                      int64_t j0, int nc, int how, flash_scratch *f)
{
    if (how == TILE_OPEN)
        return;
    for (int r = 0; r < mr; r++) {
        float *sr = f->s + r * MHA_BC;
        if (how == TILE_EXPLICIT) {
            for (int c = 0; c < nc; c++)
                sr[c] = masked(sr[c], f->bias[r * MHA_BC + c]);
        } else {
            const int64_t live = mha_mask_last(a->mask, b, i0 + r) - j0 + 1;
            for (int64_t c = live < 0 ? 0 : live; c < nc; c++)
                sr[c] = -INFINITY;
        }
    }
}

/* One key tile against the block's rows: the online-softmax update. */
static void flash_tile(const mha_microkernels *uk, const mha_attn *a,
                       int64_t b, int64_t h, int64_t i0, int mr, int64_t j0,
                       int nc, int partial, const float *kt, const float *v,
                       int finite_v, flash_scratch *f)
{
    const int dh = (int)a->dh;
    uk->qk(mr, nc, dh, f->qs, kt, MHA_BC, f->s, MHA_BC);
    mask_tile(a, b, i0, mr, j0, nc, partial, f);
    for (int r = 0; r < mr; r++) {
        float *sr = f->s + r * MHA_BC;
        /* NaN never wins the comparison but reaches the sum: it propagates */
        const float mt = uk->max(sr, nc);
        const float mn = mt > f->m[r] ? mt : f->m[r];
        if (mn == -INFINITY) {            /* nothing live in this row yet */
            memset(sr, 0, (size_t)nc * sizeof *sr);
            continue;
        }
        const float alpha = expf(f->m[r] - mn);   /* 0 on the first tile */
        const float sum = uk->exp_sum(sr, nc, mn);
        if (alpha != 1.0f) {
            uk->scale(f->o + r * dh, dh, alpha);
            f->l[r] *= alpha;
        }
        f->l[r] += sum;
        f->m[r] = mn;
        if (a->dropout)
            for (int c = 0; c < nc; c++)
                if (!mha_dropout_keep(a->seed, a->p_drop, b, h, i0 + r,
                                      j0 + c))
                    sr[c] = 0.0f;
    }
    (finite_v ? uk->pv : uk->pv_exact)(mr, nc, dh, f->s, MHA_BC, v, f->o, dh);
}

/* Visits the tiles of one query block, calling fn on each non-empty one.
 * Fills f->bias for partial tiles.  Keys past the last one any row may
 * see are never visited; the extra keys come last, never masked. */
typedef void (*tile_fn)(const mha_microkernels *uk, const mha_attn *a,
                        int64_t b, int64_t h, int64_t i0, int mr, int64_t j0,
                        int nc, int partial, const float *kt, const float *v,
                        int finite_v, flash_scratch *f);

static void for_each_tile(const mha_microkernels *uk, const mha_attn *a,
                          int64_t b, int64_t h, int64_t i0, int mr,
                          int64_t k0, int64_t k1, int with_extra,
                          flash_scratch *f, tile_fn fn)
{
    const mha_mask_plan *mk = a->mask;
    const int64_t first_last = mha_mask_last(mk, b, i0);
    int64_t end = mha_mask_last(mk, b, i0 + mr - 1) + 1;
    if (end > k1)
        end = k1;
    const int explicit_mask = mha_mask_has_explicit(mk);
    for (int64_t j0 = k0; j0 < end; j0 += MHA_BC) {
        const int nc = (int)(end - j0 < MHA_BC ? end - j0 : MHA_BC);
        const int partial = explicit_mask ? TILE_EXPLICIT
                          : j0 + nc - 1 > first_last ? TILE_BY_INDEX
                                                     : TILE_OPEN;
        if (partial == TILE_EXPLICIT) {
            int64_t live = 0;
            for (int r = 0; r < mr; r++)
                live += mha_mask_cols(mk, b, h, i0 + r, j0, nc,
                                      f->bias + r * MHA_BC);
            if (live == 0)
                continue;
        }
        const int64_t t = j0 / MHA_BC;
        fn(uk, a, b, h, i0, mr, j0, nc, partial, packed_kt(a, b, h, t),
           packed_v(a, b, h, t), *packed_finite(a, b, h, t) != 0.0f, f);
    }
    const int extra = (a->bias_k != NULL) + (a->zero_attn != 0);
    if (extra && with_extra) {
        const int64_t t = tiles_of(a) - 1;
        fn(uk, a, b, h, i0, mr, a->Lk, extra, 0, packed_kt(a, b, h, t),
           packed_v(a, b, h, t), *packed_finite(a, b, h, t) != 0.0f, f);
    }
}

static void output_tile(const mha_microkernels *uk, const mha_attn *a,
                        int64_t b, int64_t h, int64_t i0, int mr, int64_t j0,
                        int nc, int partial, const float *kt, const float *v,
                        int finite_v, flash_scratch *f)
{
    flash_tile(uk, a, b, h, i0, mr, j0, nc, partial, kt, v, finite_v, f);
}

/* The online softmax of rows i0 .. i0+mr-1 of head h over keys k0 ..
 * k1-1 (and the extra keys if with_extra): f->m, f->l and the unnormalised
 * f->o. */
static void flash_run(const mha_microkernels *uk, const mha_attn *a,
                      int64_t b, int64_t h, int64_t i0, int mr, int64_t k0,
                      int64_t k1, int with_extra, flash_scratch *f)
{
    pack_q(a, b, h, i0, mr, f->qs);
    memset(f->o, 0, (size_t)(mr * a->dh) * sizeof *f->o);
    for (int r = 0; r < mr; r++) {
        f->m[r] = -INFINITY;
        f->l[r] = 0.0f;
    }
    for_each_tile(uk, a, b, h, i0, mr, k0, k1, with_extra, f, output_tile);
}

/* ctx = o / l (and the dropout scale) and the row stats, from m, l, o of
 * rows i0 .. i0+mr-1 (o with row stride dh). */
static void flash_finish(const mha_attn *a, int64_t b, int64_t h, int64_t i0,
                         int mr, const float *m, const float *l,
                         const float *o)
{
    const int64_t dh = a->dh;
    const int all_dropped = a->dropout && a->p_drop >= 1.0f;
    for (int r = 0; r < mr; r++) {
        float *dst = a->ctx + (b * a->Lq + i0 + r) * a->ldc + h * dh;
        float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i0 + r);
        if (m[r] == -INFINITY || l[r] == 0.0f) {
            /* No key to attend to: zero context, zero weights. */
            memset(dst, 0, (size_t)dh * sizeof *dst);
            st[0] = -INFINITY;
            st[1] = 0.0f;
            continue;
        }
        st[0] = m[r];
        st[1] = 1.0f / l[r];
        float inv = st[1];
        if (a->dropout)
            inv = all_dropped ? 0.0f : inv / (1.0f - a->p_drop);
        for (int64_t d = 0; d < dh; d++)
            dst[d] = o[r * dh + d] * inv;
    }
}

/* Rows i0 .. i0+mr-1 of head h of batch b: ctx and the row stats. */
static void flash_block(const mha_microkernels *uk, const mha_attn *a,
                        int64_t b, int64_t h, int64_t i0, int mr,
                        flash_scratch *f)
{
    flash_run(uk, a, b, h, i0, mr, 0, a->Lk, 1, f);
    flash_finish(a, b, h, i0, mr, f->m, f->l, f->o);
}

/*
 * Decoding: with few query rows and many keys, (b, h) alone gives too few
 * work items, so the keys are split in chunks of MHA_SPLIT, each chunk's
 * (m, l, o) computed apart and the chunks merged in order:
 *     m = max_c m_c,  l = sum_c l_c e^(m_c - m),  o = sum_c o_c e^(m_c - m)
 * Whether to split depends on the shape only, never on the thread count.
 */
enum { MHA_SPLIT = 512 };

int64_t mha_attn_chunks(int64_t Lq, int64_t Lk)
{
    return Lq <= MHA_BR && Lk >= 2 * MHA_SPLIT
               ? (Lk + MHA_SPLIT - 1) / MHA_SPLIT : 1;
}

int64_t mha_attn_partials(int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                          int64_t dh)
{
    const int64_t chunks = mha_attn_chunks(Lq, Lk);
    return chunks > 1 ? B * H * chunks * Lq * (dh + 2) : 0;
}

/* Slot of chunk c of (b, h): Lq rows of [m, l, o[dh]]. */
static float *partial_slot(const mha_attn *a, int64_t bh, int64_t c,
                           int64_t chunks)
{
    return a->partials + (bh * chunks + c) * a->Lq * (a->dh + 2);
}

static void split_chunk(const mha_microkernels *uk, const mha_attn *a,
                        int64_t bh, int64_t c, int64_t chunks,
                        flash_scratch *f)
{
    const int64_t k0 = c * MHA_SPLIT;
    const int64_t k1 = k0 + MHA_SPLIT < a->Lk ? k0 + MHA_SPLIT : a->Lk;
    const int mr = (int)a->Lq, dh = (int)a->dh;
    flash_run(uk, a, bh / a->H, bh % a->H, 0, mr, k0, k1, c == chunks - 1,
              f);
    float *slot = partial_slot(a, bh, c, chunks);
    for (int r = 0; r < mr; r++) {
        float *row = slot + r * (dh + 2);
        row[0] = f->m[r];
        row[1] = f->l[r];
        memcpy(row + 2, f->o + r * dh, (size_t)dh * sizeof *row);
    }
}

static void split_merge(const mha_attn *a, int64_t bh, int64_t chunks,
                        flash_scratch *f)
{
    const int mr = (int)a->Lq, dh = (int)a->dh;
    for (int r = 0; r < mr; r++) {
        float m = -INFINITY;
        for (int64_t c = 0; c < chunks; c++) {
            const float mc = partial_slot(a, bh, c, chunks)[r * (dh + 2)];
            if (mc > m)
                m = mc;
        }
        float l = 0.0f;
        float *o = f->o + r * dh;
        memset(o, 0, (size_t)dh * sizeof *o);
        f->m[r] = m;
        if (m == -INFINITY) {
            f->l[r] = 0.0f;
            continue;
        }
        for (int64_t c = 0; c < chunks; c++) {
            const float *row = partial_slot(a, bh, c, chunks) + r * (dh + 2);
            if (row[0] == -INFINITY)
                continue;
            const float w = expf(row[0] - m);
            l += row[1] * w;
            for (int d = 0; d < dh; d++)
                o[d] += row[2 + d] * w;
        }
        f->l[r] = l;
    }
    flash_finish(a, bh / a->H, bh % a->H, 0, mr, f->m, f->l, f->o);
}

/* The weights pass: p = exp(s - m) / l, dropout as in the output pass. */
static void weights_tile(const mha_microkernels *uk, const mha_attn *a,
                         int64_t b, int64_t h, int64_t i0, int mr, int64_t j0,
                         int nc, int partial, const float *kt, const float *v,
                         int finite_v, flash_scratch *f)
{
    (void)v;
    (void)finite_v;
    const int dh = (int)a->dh;
    uk->qk(mr, nc, dh, f->qs, kt, MHA_BC, f->s, MHA_BC);
    mask_tile(a, b, i0, mr, j0, nc, partial, f);
    const float keep_scale =
        a->dropout ? (a->p_drop < 1.0f ? 1.0f / (1.0f - a->p_drop) : 0.0f)
                   : 1.0f;
    const float inv_h = 1.0f / (float)a->H;
    for (int r = 0; r < mr; r++) {
        const int64_t i = i0 + r;
        const float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i);
        if (st[0] == -INFINITY)
            continue;
        float *sr = f->s + r * MHA_BC;
        uk->exp_sum(sr, nc, st[0]);
        const float inv_l = st[1] * keep_scale;
        float *w = a->weights == MHA_WEIGHTS_PER_HEAD
                       ? a->w + ((b * a->H + h) * a->Lq + i) * a->Lt + j0
                       : a->w + (b * a->Lq + i) * a->Lt + j0;
        for (int c = 0; c < nc; c++) {
            float p = sr[c] * inv_l;
            if (a->dropout &&
                !mha_dropout_keep(a->seed, a->p_drop, b, h, i, j0 + c))
                p = 0.0f;
            if (a->weights == MHA_WEIGHTS_PER_HEAD)
                w[c] = p;
            else
                w[c] += p * inv_h;
        }
    }
}

static void weights_block(const mha_microkernels *uk, const mha_attn *a,
                          int64_t b, int64_t i0, int mr, flash_scratch *f)
{
    for (int64_t h = 0; h < a->H; h++) {
        pack_q(a, b, h, i0, mr, f->qs);
        for_each_tile(uk, a, b, h, i0, mr, 0, a->Lk, 1, f, weights_tile);
    }
}

/* ---- the reference tier --------------------------------------------------- */

/*
 * Row i of every head of batch b, in float64: scores, softmax, dropout,
 * context, row stats and weights.  scratch: Lt floats (the mask row), then Lt
 * doubles (the scores) and dh doubles (the context), 8-byte aligned.
 */
static void ref_row(const mha_attn *a, int64_t b, int64_t i, float *scratch)
{
    const int64_t dh = a->dh, Lk = a->Lk, Lt = a->Lt;
    float *bias = scratch;
    double *s = (double *)(void *)(scratch + ((Lt + 1) & ~(int64_t)1));
    double *acc = s + Lt;
    for (int64_t h = 0; h < a->H; h++) {
        const float *q = a->q + (b * a->Lq + i) * a->ldq + h * dh;
        const int64_t live = mha_mask_row(a->mask, b, h, i, bias);
        double mx = -INFINITY;
        for (int64_t j = 0; j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            const float *kj = j < Lk ? a->k + (b * Lk + j) * a->ldk + h * dh
                            : j == Lk && a->bias_k ? a->bias_k + h * dh : NULL;
            double dot = 0.0;
            if (kj)
                for (int64_t d = 0; d < dh; d++)
                    dot += (double)q[d] * kj[d];
            s[j] = dot * a->scale + bias[j];
            if (s[j] > mx)
                mx = s[j];
        }
        double sum = 0.0;
        for (int64_t j = 0; j < Lt; j++)
            if (bias[j] != -INFINITY)
                sum += s[j] = exp(s[j] - mx);
        memset(acc, 0, (size_t)dh * sizeof *acc);
        float *dst = a->ctx + (b * a->Lq + i) * a->ldc + h * dh;
        float *w = a->weights == MHA_WEIGHTS_PER_HEAD
                       ? a->w + ((b * a->H + h) * a->Lq + i) * Lt
                       : a->w ? a->w + (b * a->Lq + i) * Lt : NULL;
        for (int64_t j = 0; live && j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            if (a->dropout &&
                !mha_dropout_keep(a->seed, a->p_drop, b, h, i, j))
                continue;
            const double p = s[j] / sum / (a->dropout ? 1.0 - a->p_drop : 1.0);
            const float *vj = j < Lk ? a->v + (b * Lk + j) * a->ldv + h * dh
                            : j == Lk && a->bias_v ? a->bias_v + h * dh : NULL;
            if (vj)
                for (int64_t d = 0; d < dh; d++)
                    acc[d] += p * vj[d];
            if (a->weights == MHA_WEIGHTS_PER_HEAD)
                w[j] = (float)p;
            else if (w)
                w[j] += (float)(p / (double)a->H);
        }
        for (int64_t d = 0; d < dh; d++)
            dst[d] = (float)acc[d];
        float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i);
        st[0] = live ? (float)mx : -INFINITY;
        st[1] = live ? (float)(1.0 / sum) : 0.0f;
    }
}

/* ---- scheduling ----------------------------------------------------------- */

int64_t mha_attn_scratch(mha_isa isa, int64_t dh, int64_t Lt)
{
    if (isa == MHA_ISA_REF)   /* Lt floats, (Lt + dh) doubles, aligned */
        return (Lt + 2) + 2 * (Lt + dh) + 2;
    return 2 * MHA_BR * dh + 2 * MHA_BR * MHA_BC + 2 * MHA_BR;
}

void mha_attn_run(mha_isa isa, const mha_microkernels *uk, const mha_attn *a,
                  int threads, float *scratch, int64_t per_thread)
{
    const int64_t blocks = (a->Lq + MHA_BR - 1) / MHA_BR;
    /* Below ~4 MFLOP a second thread costs more to wake (and leaves a
     * spinning worker beside the BLAS's own) than it saves.  Results do
     * not depend on the thread count, so this changes speed only. */
    if ((double)a->B * a->H * a->Lq * a->Lt * a->dh < (double)(1 << 20))
        threads = 1;
    if (isa == MHA_ISA_REF) {
        const int64_t rows = a->B * a->Lq;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 4)
        for (int64_t t = 0; t < rows; t++) {
            int tid = 0;
#ifdef _OPENMP
            tid = omp_get_thread_num();
#endif
            ref_row(a, t / a->Lq, t % a->Lq, scratch + tid * per_thread);
        }
        return;
    }
    const int64_t items = a->B * a->H * blocks;
    const int64_t chunks = mha_attn_chunks(a->Lq, a->Lk);
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        flash_scratch f = carve(scratch + tid * per_thread, a->dh);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < a->B * a->H * tiles_of(a); t++)
            pack_tile(a, t);
        /* (the implicit barrier: every tile is packed) */
        if (chunks > 1) {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < a->B * a->H * chunks; t++)
                split_chunk(uk, a, t / chunks, t % chunks, chunks, &f);
#pragma omp for schedule(dynamic, 1)
            for (int64_t bh = 0; bh < a->B * a->H; bh++)
                split_merge(a, bh, chunks, &f);
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < items; t++) {
                const int64_t blk = t % blocks, bh = t / blocks;
                const int64_t i0 = blk * MHA_BR;
                const int mr = (int)(a->Lq - i0 < MHA_BR ? a->Lq - i0
                                                         : MHA_BR);
                flash_block(uk, a, bh / a->H, bh % a->H, i0, mr, &f);
            }
        }
        if (a->weights != MHA_WEIGHTS_NONE) {
            /* The implicit barrier above: every row's stats are written. */
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < a->B * blocks; t++) {
                const int64_t i0 = (t % blocks) * MHA_BR;
                const int mr = (int)(a->Lq - i0 < MHA_BR ? a->Lq - i0
                                                         : MHA_BR);
                weights_block(uk, a, t / blocks, i0, mr, &f);
            }
        }
    }
}

/* ==== the backward ========================================================
 *
 * With P = softmax(S), S = scale q k^T + mask, dropout keep mask D and
 * P~ = P * D / (1 - p) (P~ = P without dropout), ctx = P~ v, and dO the
 * gradient of ctx:
 *
 *     dv  = P~^T dO
 *     dP~ = dO v^T,   dP = dP~ * D / (1 - p)
 *     dS  = P * (dP - delta),  delta_i = sum_j P_ij dP_ij
 *     dq  = scale dS k,   dk = scale dS^T q
 *
 * The flash tiers recompute P tile by tile from the forward's row stats
 * (m, 1/l), exactly as the forward computed it, so nothing of size Lq x Lk
 * is ever stored: a block of 64 query rows caches its own P and dP~ (64 x
 * Lk each, O(L) per thread) between two sweeps over its key tiles, the
 * first for delta, the second for the gradients.  One work item is one
 * (batch, head): it owns the rows of dq, dk and dv of its head, and walks
 * the query blocks in order, each against its key tiles in order (the
 * forward's for_each_tile), adding into dk and dv.  Every sum therefore has one fixed order, whatever the
 * thread count.  dS is set to 0 wherever P is 0 (masked keys, rows with no
 * key), so a masked key's NaN cannot reach any gradient.
 */

typedef struct bwd_scratch {
    flash_scratch f;   /* qs (scaled q), o (the block's dq), s (P~), bias */
    float *dout;       /* [BR][dh]  dO of the block                       */
    float *dp;         /* [BR][BC]  dP, then dS                            */
    float *pc, *dpc;   /* [BR][bwd_cache_width]  the block's P and dP~    */
    double delta[MHA_BR];
    float *extra;      /* [2][2][dh]  dk, dv of the extra keys            */
    const mha_attn_grad *g;
    int dout_finite, q_finite;
} bwd_scratch;

/* Columns of a block's cache of P and dP~: every tile of the keys. */
static int64_t bwd_cache_width(int64_t Lt)
{
    return ((Lt + MHA_BC - 1) / MHA_BC + 1) * MHA_BC;
}

int64_t mha_attn_bwd_scratch(mha_isa isa, int64_t dh, int64_t Lt)
{
    if (isa == MHA_ISA_REF)   /* bias row; s, P, dq doubles; dk, dv doubles */
        return (Lt + 2) + 2 * (2 * Lt + dh + 2 * Lt * dh) + 2;
    return mha_attn_scratch(isa, dh, Lt) + MHA_BR * dh + MHA_BR * MHA_BC +
           2 * MHA_BR * bwd_cache_width(Lt) + 4 * dh;
}

static bwd_scratch carve_bwd(float *base, int64_t dh, int64_t Lt)
{
    bwd_scratch w;
    w.f = carve(base, dh);
    w.dout = base + mha_attn_scratch(MHA_ISA_SCALAR, dh, Lt);
    w.dp = w.dout + MHA_BR * dh;
    w.pc = w.dp + MHA_BR * MHA_BC;
    w.dpc = w.pc + MHA_BR * bwd_cache_width(Lt);
    w.extra = w.dpc + MHA_BR * bwd_cache_width(Lt);
    return w;
}

/*
 * The backward reads each key tile as rows (for dq = dS k) and each value
 * tile transposed (for dP~ = dO v^T): the transposes of the forward's
 * packing.  Made once per call from the forward's packed tiles,
 *   kc  [B][H][tiles + 1][MHA_BC][dh]
 *   vt  [B][H][tiles + 1][dh][MHA_BC]
 *   fin [B][H][tiles + 1]               1.0 if the key tile is finite
 */
int64_t mha_attn_bwd_packed(int64_t B, int64_t H, int64_t Lk, int64_t dh)
{
    return mha_attn_packed(B, H, Lk, dh);
}

static const float *bwd_packed_kc(const mha_attn *a, const mha_attn_grad *g,
                                  int64_t b, int64_t h, int64_t t)
{
    return g->packed + ((b * a->H + h) * tiles_of(a) + t) * MHA_BC * a->dh;
}

static const float *bwd_packed_vt(const mha_attn *a, const mha_attn_grad *g,
                                  int64_t b, int64_t h, int64_t t)
{
    const int64_t all = a->B * a->H * tiles_of(a) * MHA_BC * a->dh;
    return g->packed + all +
           ((b * a->H + h) * tiles_of(a) + t) * MHA_BC * a->dh;
}

static const float *bwd_packed_finite(const mha_attn *a,
                                      const mha_attn_grad *g, int64_t b,
                                      int64_t h, int64_t t)
{
    const int64_t all = a->B * a->H * tiles_of(a) * MHA_BC * a->dh;
    return g->packed + 2 * all + (b * a->H + h) * tiles_of(a) + t;
}

static void bwd_pack_tile(const mha_attn *a, const mha_attn_grad *g,
                          int64_t item)
{
    const int64_t tiles = tiles_of(a), t = item % tiles, bh = item / tiles;
    const int64_t b = bh / a->H, h = bh % a->H, dh = a->dh;
    const int extra = t == tiles - 1;
    const int nc = extra ? (a->bias_k != NULL) + (a->zero_attn != 0)
                 : (int)(a->Lk - t * MHA_BC < MHA_BC ? a->Lk - t * MHA_BC
                                                     : MHA_BC);
    const float *kt = packed_kt(a, b, h, t), *v = packed_v(a, b, h, t);
    float *kc = (float *)bwd_packed_kc(a, g, b, h, t);
    float *vt = (float *)bwd_packed_vt(a, g, b, h, t);
    int finite = 1;
    for (int c = 0; c < nc; c++)
        for (int64_t d = 0; d < dh; d++) {
            kc[c * dh + d] = kt[d * MHA_BC + c];
            vt[d * MHA_BC + c] = v[c * dh + d];
            finite &= isfinite(kc[c * dh + d]) != 0;
        }
    *(float *)bwd_packed_finite(a, g, b, h, t) = (float)finite;
}

/* sum_c p[c] * d[c] over the c with p[c] != 0 (so an Inf or NaN in d
 * under a zero p stays out), in float64: four interleaved partial sums,
 * added in a fixed order at the end. */
static double dot_nonzero(const float *p, const float *d, int n)
{
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int c = 0;
    for (; c + 4 <= n; c += 4)
        for (int k = 0; k < 4; k++) {
            const double t = (double)p[c + k] * d[c + k];
            s[k] += p[c + k] != 0.0f ? t : 0.0;
        }
    for (; c < n; c++)
        if (p[c] != 0.0f)
            s[0] += (double)p[c] * d[c];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/*
 * First sweep over a block's tiles: P (exactly as the forward computed it)
 * and dP~ = dO v^T into the block's cache, and delta_i = sum_j P_ij dP_ij
 * summed in float64.  delta is computed here rather than as dO_i . ctx_i:
 * ctx carries the forward's rounding, and an error in delta_i shifts dq_i
 * by delta's error times a P-weighted mean of k, which does not cancel.
 */
static void bwd_probs_tile(const mha_microkernels *uk, const mha_attn *a,
                           int64_t b, int64_t h, int64_t i0, int mr,
                           int64_t j0, int nc, int partial, const float *kt,
                           const float *v, int finite_v, flash_scratch *f)
{
    (void)v;
    (void)finite_v;
    bwd_scratch *w = (bwd_scratch *)(void *)f;   /* f is its first member */
    const int dh = (int)a->dh;
    const int64_t tile = j0 >= a->Lk ? tiles_of(a) - 1 : j0 / MHA_BC;
    const int64_t ldc = bwd_cache_width(a->Lt);
    float *pc = w->pc + tile * MHA_BC, *dpc = w->dpc + tile * MHA_BC;
    const float keep_scale =
        a->dropout ? (a->p_drop < 1.0f ? 1.0f / (1.0f - a->p_drop) : 0.0f)
                   : 1.0f;

    uk->qk(mr, nc, dh, f->qs, kt, MHA_BC, f->s, MHA_BC);
    mask_tile(a, b, i0, mr, j0, nc, partial, f);
    uk->qk(mr, nc, dh, w->dout, bwd_packed_vt(a, w->g, b, h, tile), MHA_BC,
           dpc, (int)ldc);
    for (int r = 0; r < mr; r++) {
        const int64_t i = i0 + r;
        const float *st = a->stats + 2 * ((b * a->H + h) * a->Lq + i);
        float *sr = f->s + r * MHA_BC;
        float *pr = pc + r * ldc;
        if (st[0] == -INFINITY) {
            memset(pr, 0, (size_t)nc * sizeof *pr);
            continue;
        }
        uk->exp_sum(sr, nc, st[0]);
        uk->scale(sr, nc, st[1]);
        memcpy(pr, sr, (size_t)nc * sizeof *pr);
        const float *dr = dpc + r * ldc;
        if (!a->dropout) {
            w->delta[r] += dot_nonzero(pr, dr, nc);
            continue;
        }
        double sum = 0.0;
        for (int c = 0; c < nc; c++)
            if (pr[c] != 0.0f &&
                mha_dropout_keep(a->seed, a->p_drop, b, h, i, j0 + c))
                sum += (double)pr[c] * dr[c];
        w->delta[r] += sum * keep_scale;
    }
}

/* Second sweep: dS = P * (dP - delta), and the tile's shares of dv, dq
 * and dk. */
static void bwd_grads_tile(const mha_microkernels *uk, const mha_attn *a,
                           int64_t b, int64_t h, int64_t i0, int mr,
                           int64_t j0, int nc, int partial, const float *kt,
                           const float *v, int finite_v, flash_scratch *f)
{
    (void)partial;
    (void)kt;
    (void)v;
    (void)finite_v;
    bwd_scratch *w = (bwd_scratch *)(void *)f;   /* f is its first member */
    const mha_attn_grad *g = w->g;
    const int dh = (int)a->dh;
    const int extra = j0 >= a->Lk;
    const int64_t tile = extra ? tiles_of(a) - 1 : j0 / MHA_BC;
    const int64_t ldc = bwd_cache_width(a->Lt);
    const float *pc = w->pc + tile * MHA_BC, *dpc = w->dpc + tile * MHA_BC;
    const float *kc = bwd_packed_kc(a, g, b, h, tile);
    const int k_finite = *bwd_packed_finite(a, g, b, h, tile) != 0.0f;
    const float keep_scale =
        a->dropout ? (a->p_drop < 1.0f ? 1.0f / (1.0f - a->p_drop) : 0.0f)
                   : 1.0f;

    /* dS = P * (dP - delta) into dp; under dropout also P~ (P with the
     * dropped keys zeroed, kept ones scaled) into s for dv.  Without
     * dropout dv reads P from the cache as it is. */
    for (int r = 0; r < mr; r++) {
        const int64_t i = i0 + r;
        const float *pr = pc + r * ldc, *dpr = dpc + r * ldc;
        const float delta = (float)w->delta[r];
        float *dr = w->dp + r * MHA_BC;
        if (!a->dropout) {
            /* branch-free, so the compiler vectorises it */
            for (int c = 0; c < nc; c++) {
                const float ds = pr[c] * (dpr[c] - delta);
                dr[c] = pr[c] == 0.0f ? 0.0f : ds;
            }
            continue;
        }
        float *ptr = f->s + r * MHA_BC;
        for (int c = 0; c < nc; c++) {
            float pd = pr[c] * keep_scale, dp = dpr[c] * keep_scale;
            if (!mha_dropout_keep(a->seed, a->p_drop, b, h, i, j0 + c))
                pd = dp = 0.0f;
            ptr[c] = pd;
            dr[c] = pr[c] == 0.0f ? 0.0f : pr[c] * (dp - delta);
        }
    }
    const float *pt = a->dropout ? f->s : pc;
    const int ldpt = a->dropout ? MHA_BC : (int)ldc;
    float *dk_dst, *dv_dst;
    int64_t lddk, lddv;
    if (extra) {
        dk_dst = w->extra;
        dv_dst = w->extra + 2 * dh;
        lddk = lddv = dh;
    } else {
        dk_dst = g->dk + (b * a->Lk + j0) * g->lddk + h * dh;
        dv_dst = g->dv + (b * a->Lk + j0) * g->lddv + h * dh;
        lddk = g->lddk;
        lddv = g->lddv;
    }
    /* Each (block, tile)'s share of dv, dq and dk is summed apart, then
     * added (the kernels' pv_add / pvt): two levels of float sums (over 64
     * rows or keys, then over the blocks or tiles) instead of one chain as
     * long as Lq or Lk. */
    (w->dout_finite ? uk->pvt : uk->pvt_exact)(mr, nc, dh, pt, ldpt,
                                               w->dout, dv_dst, (int)lddv);
    /* dq (unscaled: the block's dq is scaled once at the end) += dS k. */
    (k_finite ? uk->pv_add : uk->pv_add_exact)(mr, nc, dh, w->dp, MHA_BC, kc,
                                               f->o, dh);
    /* dk += dS^T (scale q): qs already holds the scaled rows. */
    (w->q_finite ? uk->pvt : uk->pvt_exact)(mr, nc, dh, w->dp, MHA_BC, f->qs,
                                            dk_dst, (int)lddk);
}

/* dO of the block's rows, packed, and whether it and the block's q are
 * finite; delta starts at 0 (the first sweep sums it). */
static void bwd_load_block(const mha_attn *a, const mha_attn_grad *g,
                           int64_t b, int64_t h, int64_t i0, int mr,
                           bwd_scratch *w)
{
    const int64_t dh = a->dh;
    int fin = 1;
    for (int r = 0; r < mr; r++) {
        const float *src = g->dctx + (b * a->Lq + i0 + r) * g->lddc + h * dh;
        for (int64_t d = 0; d < dh; d++) {
            w->dout[r * dh + d] = src[d];
            fin &= isfinite(src[d]) != 0;
        }
        w->delta[r] = 0.0;
    }
    w->dout_finite = fin;
    fin = 1;
    for (int64_t x = 0; x < mr * dh; x++)
        fin &= isfinite(w->f.qs[x]) != 0;
    w->q_finite = fin;
}

/* Zeroes the (b, h) slices of dk and dv. */
static void bwd_zero_item(const mha_attn *a, const mha_attn_grad *g,
                          int64_t b, int64_t h)
{
    const size_t row = (size_t)a->dh * sizeof(float);
    for (int64_t j = 0; j < a->Lk; j++) {
        memset(g->dk + (b * a->Lk + j) * g->lddk + h * a->dh, 0, row);
        memset(g->dv + (b * a->Lk + j) * g->lddv + h * a->dh, 0, row);
    }
}

/* The extra keys' gradients: bias_k / bias_v of this (b, h), or nothing
 * for the zero key (a constant). */
static void bwd_store_extra(const mha_attn *a, const mha_attn_grad *g,
                            int64_t b, int64_t h, const float *dk,
                            const float *dv)
{
    if (!a->bias_k || !g->dbias_k)
        return;
    const int64_t dh = a->dh;
    memcpy(g->dbias_k + (b * a->H + h) * dh, dk, (size_t)dh * sizeof *dk);
    memcpy(g->dbias_v + (b * a->H + h) * dh, dv, (size_t)dh * sizeof *dv);
}

static void bwd_item(const mha_microkernels *uk, const mha_attn *a,
                     const mha_attn_grad *g, int64_t b, int64_t h,
                     bwd_scratch *w)
{
    const int64_t dh = a->dh;
    bwd_zero_item(a, g, b, h);
    memset(w->extra, 0, (size_t)(4 * dh) * sizeof *w->extra);
    for (int64_t i0 = 0; i0 < a->Lq; i0 += MHA_BR) {
        const int mr = (int)(a->Lq - i0 < MHA_BR ? a->Lq - i0 : MHA_BR);
        pack_q(a, b, h, i0, mr, w->f.qs);
        bwd_load_block(a, g, b, h, i0, mr, w);
        memset(w->f.o, 0, (size_t)(mr * dh) * sizeof *w->f.o);
        for_each_tile(uk, a, b, h, i0, mr, 0, a->Lk, 1, &w->f,
                      bwd_probs_tile);
        for_each_tile(uk, a, b, h, i0, mr, 0, a->Lk, 1, &w->f,
                      bwd_grads_tile);
        for (int r = 0; r < mr; r++) {
            float *dst = g->dq + (b * a->Lq + i0 + r) * g->lddq + h * dh;
            for (int64_t d = 0; d < dh; d++)
                dst[d] = w->f.o[r * dh + d] * a->scale;
        }
    }
    bwd_store_extra(a, g, b, h, w->extra, w->extra + 2 * dh);
}

/*
 * The reference backward of (b, h), in float64 row by row: P recomputed
 * from the scores (not from the saved stats), dk and dv summed over rows in
 * float64 and rounded once.
 */
static void ref_bwd_item(const mha_attn *a, const mha_attn_grad *g,
                         int64_t b, int64_t h, float *scratch)
{
    const int64_t dh = a->dh, Lk = a->Lk, Lt = a->Lt;
    float *bias = scratch;
    double *s = (double *)(void *)(scratch + ((Lt + 1) & ~(int64_t)1));
    double *ds = s + Lt, *dq = ds + Lt, *dk = dq + dh, *dv = dk + Lt * dh;
    memset(dk, 0, (size_t)(2 * Lt * dh) * sizeof *dk);
    const double keep_scale =
        a->dropout ? (a->p_drop < 1.0f ? 1.0 / (1.0 - a->p_drop) : 0.0) : 1.0;
    for (int64_t i = 0; i < a->Lq; i++) {
        const float *q = a->q + (b * a->Lq + i) * a->ldq + h * dh;
        const float *dO = g->dctx + (b * a->Lq + i) * g->lddc + h * dh;
        float *dqd = g->dq + (b * a->Lq + i) * g->lddq + h * dh;
        const int64_t live = mha_mask_row(a->mask, b, h, i, bias);
        memset(dq, 0, (size_t)dh * sizeof *dq);
        double mx = -INFINITY, sum = 0.0, delta = 0.0;
        for (int64_t j = 0; live && j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            const float *kj = j < Lk ? a->k + (b * Lk + j) * a->ldk + h * dh
                            : j == Lk && a->bias_k ? a->bias_k + h * dh : NULL;
            double dot = 0.0;
            for (int64_t d = 0; kj && d < dh; d++)
                dot += (double)q[d] * kj[d];
            s[j] = dot * a->scale + bias[j];
            if (s[j] > mx)
                mx = s[j];
        }
        for (int64_t j = 0; live && j < Lt; j++)
            if (bias[j] != -INFINITY)
                sum += s[j] = exp(s[j] - mx);
        /* ds[j] = dP~_j * keep * scale_keep; delta = sum_j P~_j dP~_j */
        for (int64_t j = 0; live && j < Lt; j++) {
            ds[j] = 0.0;
            if (bias[j] == -INFINITY)
                continue;
            s[j] /= sum;
            if (a->dropout &&
                !mha_dropout_keep(a->seed, a->p_drop, b, h, i, j))
                continue;
            const float *vj = j < Lk ? a->v + (b * Lk + j) * a->ldv + h * dh
                            : j == Lk && a->bias_v ? a->bias_v + h * dh : NULL;
            double dp = 0.0;
            for (int64_t d = 0; vj && d < dh; d++)
                dp += (double)dO[d] * vj[d];
            ds[j] = dp * keep_scale;
            delta += s[j] * ds[j];
            for (int64_t d = 0; d < dh; d++)
                dv[j * dh + d] += s[j] * keep_scale * dO[d];
        }
        for (int64_t j = 0; live && j < Lt; j++) {
            if (bias[j] == -INFINITY)
                continue;
            const double dsj = s[j] * (ds[j] - delta) * a->scale;
            const float *kj = j < Lk ? a->k + (b * Lk + j) * a->ldk + h * dh
                            : j == Lk && a->bias_k ? a->bias_k + h * dh : NULL;
            for (int64_t d = 0; d < dh; d++) {
                if (kj)
                    dq[d] += dsj * kj[d];
                dk[j * dh + d] += dsj * q[d];
            }
        }
        for (int64_t d = 0; d < dh; d++)
            dqd[d] = (float)dq[d];
    }
    for (int64_t j = 0; j < Lk; j++)
        for (int64_t d = 0; d < dh; d++) {
            g->dk[(b * Lk + j) * g->lddk + h * dh + d] = (float)dk[j * dh + d];
            g->dv[(b * Lk + j) * g->lddv + h * dh + d] = (float)dv[j * dh + d];
        }
    if (a->bias_k && g->dbias_k)
        for (int64_t d = 0; d < dh; d++) {
            g->dbias_k[(b * a->H + h) * dh + d] = (float)dk[Lk * dh + d];
            g->dbias_v[(b * a->H + h) * dh + d] = (float)dv[Lk * dh + d];
        }
}

void mha_attn_backward(mha_isa isa, const mha_microkernels *uk,
                       const mha_attn *a, const mha_attn_grad *g, int threads,
                       float *scratch, int64_t per_thread)
{
    const int64_t items = a->B * a->H;
    if ((double)a->B * a->H * a->Lq * a->Lt * a->dh < (double)(1 << 20))
        threads = 1;   /* as in the forward: speed only */
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *mine = scratch + tid * per_thread;
        if (isa != MHA_ISA_REF) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < items * tiles_of(a); t++)
                bwd_pack_tile(a, g, t);
        }
        /* (the implicit barrier: every tile is packed) */
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < items; t++) {
            if (isa == MHA_ISA_REF) {
                ref_bwd_item(a, g, t / a->H, t % a->H, mine);
            } else {
                bwd_scratch w = carve_bwd(mine, a->dh, a->Lt);
                w.g = g;
                bwd_item(uk, a, g, t / a->H, t % a->H, &w);
            }
        }
    }
}
