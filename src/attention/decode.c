/*
 * decode.c -- few query rows against many keys (decoding).  (b, h) alone
 * then gives too few work items to share among threads, so the keys are
 * split in chunks of MHA_SPLIT, each chunk's (m, l, o) computed apart and
 * the chunks merged in ascending order:
 *
 *     m = max_c m_c,   l = sum_c l_c e^(m_c - m),   o = sum_c o_c e^(m_c - m)
 *
 * Whether to split depends on the shape only, never on the thread count,
 * and the merge order is fixed: results are bitwise the same for every
 * thread count.  With grouped-query attention the chunks of the query
 * heads that share a K/V head run as one block (their rows stacked), so
 * each K/V tile is read once for the whole group, not once per head; so
 * do unsplit keys when the (b, K/V head) pairs give every thread one.
 */
#include "engine.h"

#include <math.h>
#include <string.h>

enum { MHA_SPLIT = 512 };

int64_t mha_decode_chunks(int64_t Lq, int64_t Lk)
{
    return Lq <= MHA_BR && Lk >= 2 * MHA_SPLIT
               ? (Lk + MHA_SPLIT - 1) / MHA_SPLIT : 1;
}

int64_t mha_decode_partials(int64_t B, int64_t H, int64_t Lq, int64_t Lk,
                            int64_t dh)
{
    const int64_t chunks = mha_decode_chunks(Lq, Lk);
    return chunks > 1 ? B * H * chunks * Lq * (dh + 2) : 0;
}

/* Slot of chunk c of (b, h): Lq rows of [m, l, o[dh]]. */
static float *partial_slot(const mha_attn *a, int64_t bh, int64_t c,
                           int64_t chunks)
{
    return a->partials + (bh * chunks + c) * a->Lq * (mha_dv(a) + 2);
}

void mha_decode_chunk(const mha_attn *a, int64_t bh, int64_t c,
                      int64_t chunks, flash_scratch *f)
{
    const int64_t k0 = c * MHA_SPLIT;
    const int64_t k1 = k0 + MHA_SPLIT < a->Lk ? k0 + MHA_SPLIT : a->Lk;
    const int mr = (int)a->Lq, dh = (int)mha_dv(a);
    mha_flash_rows(a, bh / a->H, bh % a->H, 0, mr, k0, k1, c == chunks - 1,
                   f);
    float *slot = partial_slot(a, bh, c, chunks);
    for (int r = 0; r < mr; r++) {
        float *row = slot + r * (dh + 2);
        row[0] = f->m[r];
        row[1] = f->l[r];
        memcpy(row + 2, f->o + r * dh, (size_t)dh * sizeof *row);
    }
}

int mha_decode_stacked(const mha_attn *a, int threads)
{
    /* unsplit keys stack too where the (b, K/V head) items give every
     * thread one (a ragged step's short sequences: each tile read once
     * for the group, not once per head; the same bits either way) */
    if (!(a->Hkv < a->H && a->Lq <= MHA_BR / 2 && !a->dropout &&
          !mha_mask_has_explicit(a->mask) &&
          (mha_decode_chunks(a->Lq, a->Lk) > 1 ||
           a->B * a->Hkv >= threads)))
        return 0;
    const int64_t group = a->H / a->Hkv, fit = MHA_BR / a->Lq;
    return (int)(group < fit ? group : fit);
}

int64_t mha_decode_stacks(const mha_attn *a, int nh)
{
    const int64_t group = a->H / a->Hkv;
    return (group + nh - 1) / nh;
}

/* Run `item` of the stacked blocks ((b, K/V head), then the group's runs
 * of nh heads) over keys k0 .. k1-1: its batch *b, first head *h0 and
 * head count (the rows of head h0 + hh are hh * Lq .. of f). */
static int stacked_rows(const mha_attn *a, int nh, int64_t item, int64_t k0,
                        int64_t k1, int with_extra, flash_scratch *f,
                        int64_t *b, int64_t *h0)
{
    const int64_t group = a->H / a->Hkv, stacks = mha_decode_stacks(a, nh);
    const int64_t bg = item / stacks, s = item % stacks;
    const int n = (int)(group - s * nh < nh ? group - s * nh : nh);
    *b = bg / a->Hkv;
    *h0 = bg % a->Hkv * group + s * nh;
    mha_flash_rows_stacked(a, *b, *h0, n, (int)a->Lq, k0, k1, with_extra, f);
    return n;
}

void mha_decode_chunk_stacked(const mha_attn *a, int nh, int64_t item,
                              int64_t c, int64_t chunks, flash_scratch *f)
{
    const int64_t k0 = c * MHA_SPLIT;
    const int64_t k1 = k0 + MHA_SPLIT < a->Lk ? k0 + MHA_SPLIT : a->Lk;
    const int Lq = (int)a->Lq, dh = (int)mha_dv(a);
    int64_t b, h0;
    const int n = stacked_rows(a, nh, item, k0, k1, c == chunks - 1, f, &b,
                               &h0);
    for (int64_t hh = 0; hh < n; hh++) {
        float *slot = partial_slot(a, b * a->H + h0 + hh, c, chunks);
        for (int i = 0; i < Lq; i++) {
            const int64_t r = hh * Lq + i;
            float *row = slot + i * (dh + 2);
            row[0] = f->m[r];
            row[1] = f->l[r];
            memcpy(row + 2, f->o + r * dh, (size_t)dh * sizeof *row);
        }
    }
}

void mha_decode_block_stacked(const mha_attn *a, int nh, int64_t item,
                              flash_scratch *f)
{
    const int Lq = (int)a->Lq;
    const int64_t dv = mha_dv(a);
    int64_t b, h0;
    const int n = stacked_rows(a, nh, item, 0, a->Lk, 1, f, &b, &h0);
    for (int hh = 0; hh < n; hh++)
        mha_flash_finish(a, b, h0 + hh, 0, Lq, f->m + hh * Lq,
                         f->l + hh * Lq, f->o + hh * Lq * dv);
}

void mha_decode_merge(const mha_attn *a, int64_t bh, int64_t chunks,
                      flash_scratch *f)
{
    const int mr = (int)a->Lq, dh = (int)mha_dv(a);
    for (int r = 0; r < mr; r++) {
        float m = -INFINITY;
        for (int64_t c = 0; c < chunks; c++) {
            const float mc = partial_slot(a, bh, c, chunks)[r * (dh + 2)];
            if (mc > m || isnan(mc))   /* a NaN chunk makes the row NaN */
                m = isnan(m) ? m : mc;
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
                continue;   /* (with m NaN, w below is NaN: NaN throughout) */
            const float w = expf(row[0] - m);
            l += row[1] * w;
            for (int d = 0; d < dh; d++)
                o[d] += row[2 + d] * w;
        }
        f->l[r] = l;
    }
    mha_flash_finish(a, bh / a->H, bh % a->H, 0, mr, f->m, f->l, f->o);
}
