/*
 * mask.c -- every kind of mask, reduced to one internal form: for each
 * (batch b, head h, query row i) a row of values added to the scaled
 * scores, where -INFINITY means "excluded: never read, never weighted".
 *
 * Five sources combine, each optional:
 *   attn_mask          (Lq,Lk) | (B,Lq,Lk) | (B,H,Lq,Lk), B and H may be 1
 *   key_padding_mask   (Lk) | (B,Lk), B may be 1
 *   key_lengths        (B): keys j >= key_lengths[b] are excluded
 *   causal             from indices, no memory
 *   the window         (the score modifier) from indices too
 *   chunks             (attention_chunk) from indices: a row's own chunk
 * The keys appended by add_bias_kv / add_zero_attn (columns Lk and up) are
 * never masked, as in PyTorch, which pads its masks with a zero column.
 */
#include "attention.h"

#include <float.h>
#include <math.h>
#include <stdio.h>

static const char *kind_name(mha_mask_kind k)
{
    switch (k) {
    case MHA_MASK_ALLOW: return "allow";
    case MHA_MASK_BLOCK: return "block";
    case MHA_MASK_ADDITIVE: return "additive";
    default: return "none";
    }
}

/* Additive values must be finite or -inf: NaN has no meaning as a mask and
 * +inf would turn the softmax into inf - inf = NaN. */
static mha_status check_additive(const char *what, const mha_mask *mk,
                                 int64_t n)
{
    const float *v = mk->data;
    for (int64_t k = 0; k < n; k++)
        if (isnan(v[k]) || v[k] == INFINITY)
            return mha_set_error(MHA_ERR_NON_FINITE,
                                 "%s: element %lld is %g; an additive mask "
                                 "must be finite or -inf", what, (long long)k,
                                 (double)v[k]);
    return MHA_OK;
}

static mha_status check_common(const char *what, const mha_mask *mk)
{
    if (mk->kind != MHA_MASK_ALLOW && mk->kind != MHA_MASK_BLOCK &&
        mk->kind != MHA_MASK_ADDITIVE)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: unknown mask kind %d", what, (int)mk->kind);
    if (!mk->data)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s: %s mask data is NULL",
                             what, kind_name(mk->kind));
    return MHA_OK;
}

static mha_status plan_attn(mha_mask_plan *p, const mha_mask *mk)
{
    const char *what = "attn_mask";
    MHA_CHECK(check_common(what, mk));
    const int nd = mk->ndim;
    if (nd < 2 || nd > 4)
        return mha_set_error(MHA_ERR_SHAPE,
                             "%s must have 2, 3 or 4 dimensions "
                             "((Lq,Lk), (B,Lq,Lk), (B,H,Lq,Lk)), got %d",
                             what, nd);
    const int64_t *s = mk->shape;
    if (s[nd - 2] != p->q_len || s[nd - 1] != p->kv_len)
        return mha_set_error(MHA_ERR_SHAPE,
                             "%s has last dimensions (%lld, %lld), expected "
                             "(Lq=%lld, Lk=%lld)", what, (long long)s[nd - 2],
                             (long long)s[nd - 1], (long long)p->q_len,
                             (long long)p->kv_len);
    const int64_t mat = p->q_len * p->kv_len;   /* checked by the caller */
    int64_t mb = 1, mh = 1;
    if (nd >= 3) {
        mb = s[0];
        if (mb != 1 && mb != p->batch)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "%s has batch dimension %lld, expected 1 or "
                                 "B=%lld", what, (long long)mb,
                                 (long long)p->batch);
    }
    if (nd == 4) {
        mh = s[1];
        if (mh != 1 && mh != p->heads)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "%s has head dimension %lld, expected 1 or "
                                 "H=%lld", what, (long long)mh,
                                 (long long)p->heads);
    }
    p->attn = *mk;
    p->attn_stride_h = mh == 1 ? 0 : mat;
    p->attn_stride_b = mb == 1 ? 0 : mh * mat;
    if (mk->kind == MHA_MASK_ADDITIVE)
        MHA_CHECK(check_additive(what, mk, mb * mh * mat));
    return MHA_OK;
}

/* A boolean key padding mask whose rows each allow one run of keys
 * (padding at the end, the usual batch of sequences of several lengths;
 * at the start, a left-padded batch; or both) becomes bounds (pad_rows,
 * pad_from, pad_to): the tiles outside them are then never visited, where
 * the mask itself had each tile's bias row built and applied.  Any other
 * row keeps the mask. */
static void pad_as_bounds(mha_mask_plan *p, int64_t rows)
{
    if (rows > MHA_PAD_BOUNDS_MAX)
        return;
    const uint8_t *m = p->pad.data;
    const int keep = p->pad.kind == MHA_MASK_ALLOW;
    for (int64_t r = 0; r < rows; r++) {
        const uint8_t *row = m + r * p->kv_len;
        int64_t from = 0;
        while (from < p->kv_len && (row[from] != 0) != keep)
            from++;
        int64_t to = from;
        while (to < p->kv_len && (row[to] != 0) == keep)
            to++;
        for (int64_t j = to; j < p->kv_len; j++)
            if ((row[j] != 0) == keep)
                return;   /* a second run of allowed keys */
        if (from == p->kv_len)   /* no key allowed: the run [0, 0) */
            from = to = 0;
        p->pad_from[r] = from;
        p->pad_to[r] = to;
    }
    p->pad_rows = (int)rows;
    p->pad = (mha_mask){0};   /* (kind NONE) */
    p->pad_stride_b = 0;
}

/* The row of pad_from / pad_to batch b reads (one row: every batch's). */
static int64_t pad_row(const mha_mask_plan *p, int64_t b)
{
    return p->pad_rows == 1 ? 0 : b;
}

static mha_status plan_pad(mha_mask_plan *p, const mha_mask *mk)
{
    const char *what = "key_padding_mask";
    MHA_CHECK(check_common(what, mk));
    const int nd = mk->ndim;
    if (nd != 1 && nd != 2)
        return mha_set_error(MHA_ERR_SHAPE,
                             "%s must have 1 or 2 dimensions ((Lk) or "
                             "(B,Lk)), got %d", what, nd);
    if (mk->shape[nd - 1] != p->kv_len)
        return mha_set_error(MHA_ERR_SHAPE,
                             "%s has last dimension %lld, expected Lk=%lld",
                             what, (long long)mk->shape[nd - 1],
                             (long long)p->kv_len);
    int64_t mb = nd == 2 ? mk->shape[0] : 1;
    if (mb != 1 && mb != p->batch)
        return mha_set_error(MHA_ERR_SHAPE,
                             "%s has batch dimension %lld, expected 1 or "
                             "B=%lld", what, (long long)mb,
                             (long long)p->batch);
    p->pad = *mk;
    p->pad_stride_b = mb == 1 ? 0 : p->kv_len;
    if (mk->kind == MHA_MASK_ADDITIVE)
        MHA_CHECK(check_additive(what, mk, mb * p->kv_len));
    else
        pad_as_bounds(p, mb);
    return MHA_OK;
}

/* The window modifier's bounds (>= -1) and the chunks (>= 0): a bound or
 * a chunk of 2^62 or more is none, no key being that far (see
 * MHA_MAX_POSITION_SHIFT), and qpos +- it would overflow. */
static void plan_band(mha_mask_plan *p, const mha_modifiers *mods,
                      int64_t chunk)
{
    const int64_t far = INT64_C(1) << 62;
    if (mods && mods->window) {
        p->band = 1;
        p->band_left = mods->window_left >= far ? -1 : mods->window_left;
        p->band_right = mods->window_right >= far ? -1 : mods->window_right;
    }
    p->chunk = chunk >= far ? 0 : chunk;
}

static mha_status plan_of(mha_mask_plan *p, const mha_attn_request *r)
{
    *p = (mha_mask_plan){0};
    p->batch = r->B;
    p->heads = r->H;
    p->q_len = r->Lq;
    p->kv_len = r->Lk;
    p->total_keys = r->Lk + mha_request_extra(r);
    if (r->causal != MHA_CAUSAL_NONE && r->causal != MHA_CAUSAL_BOTTOM_RIGHT &&
        r->causal != MHA_CAUSAL_TOP_LEFT)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "causal must be NONE, BOTTOM_RIGHT or TOP_LEFT, "
                             "got %d", (int)r->causal);
    p->causal = r->causal;
    if (r->q_total) {   /* rows q_start.. of q_total (checked by the caller) */
        p->row_shift = r->q_start;
        p->qpos_shift = r->q_start + r->Lq - r->q_total;
    }
    if (r->q_offset_given) {
        if (r->cache)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "q_offset (MHA_GIVEN_Q_OFFSET) is not taken "
                                 "with a KV cache: its queries sit at each "
                                 "sequence's end");
        if (r->q_offset > MHA_MAX_POSITION_SHIFT ||
            r->q_offset < -MHA_MAX_POSITION_SHIFT)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "q_offset %lld is outside [-2^61, 2^61]: "
                                 "positions that far apart overflow 64-bit "
                                 "position arithmetic", (long long)r->q_offset);
        p->qpos_shift = r->q_offset - (r->Lk - r->Lq);
    }
    if (r->attn_mask.kind != MHA_MASK_NONE)
        MHA_CHECK(plan_attn(p, &r->attn_mask));
    if (r->key_padding_mask.kind != MHA_MASK_NONE)
        MHA_CHECK(plan_pad(p, &r->key_padding_mask));
    if (r->key_lengths) {
        for (int64_t b = 0; b < p->batch; b++)
            if (r->key_lengths[b] < 0 || r->key_lengths[b] > p->kv_len)
                return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                     "key_lengths[%lld] = %lld is outside "
                                     "[0, Lk=%lld]", (long long)b,
                                     (long long)r->key_lengths[b],
                                     (long long)p->kv_len);
        p->key_lengths = r->key_lengths;
    }
    plan_band(p, r->mods, r->chunk);
    return MHA_OK;
}

mha_status mha_mask_plan_of(mha_mask_plan *p, const mha_attn_request *r)
{
    const mha_status st = plan_of(p, r);
    if (!r->cache || (st != MHA_ERR_SHAPE && st != MHA_ERR_INVALID_ARGUMENT))
        return st;
    /* Say what Lk is: it changes with every step. */
    char why[400];
    snprintf(why, sizeof why, "%s", mha_last_error());
    return mha_set_error(st, "%s (with a KV cache, Lk = %lld: the longest "
                         "sequence in the cache, this step's tokens "
                         "included)", why, (long long)r->Lk);
}

int64_t mha_mask_last(const mha_mask_plan *p, int64_t b, int64_t i)
{
    const int64_t Lk = p->kv_len;
    int64_t last = Lk - 1;
    if (p->causal == MHA_CAUSAL_BOTTOM_RIGHT)
        last = mha_mask_qpos(p, b, i);
    else if (p->causal == MHA_CAUSAL_TOP_LEFT)
        last = i + p->row_shift;
    if (p->key_lengths && p->key_lengths[b] - 1 < last)
        last = p->key_lengths[b] - 1;
    if (p->pad_rows && p->pad_to[pad_row(p, b)] - 1 < last)
        last = p->pad_to[pad_row(p, b)] - 1;   /* a padding mask's bounds */
    if (p->band && p->band_right >= 0 &&
        mha_mask_qpos(p, b, i) + p->band_right < last)
        last = mha_mask_qpos(p, b, i) + p->band_right;
    if (p->chunk) {   /* (start + C - 1 < 2^62 + 2^62: no overflow) */
        const int64_t end =
            mha_chunk_start(mha_mask_qpos(p, b, i), p->chunk) + p->chunk - 1;
        last = end < last ? end : last;
    }
    if (last > Lk - 1)
        last = Lk - 1;
    return last < -1 ? -1 : last;
}

int64_t mha_mask_first(const mha_mask_plan *p, int64_t b, int64_t i)
{
    const int64_t qpos = mha_mask_qpos(p, b, i);
    int64_t first = 0;
    if (p->band && p->band_left >= 0 && qpos - p->band_left > first)
        first = qpos - p->band_left;
    if (p->chunk && mha_chunk_start(qpos, p->chunk) > first)
        first = mha_chunk_start(qpos, p->chunk);
    if (p->pad_rows && p->pad_from[pad_row(p, b)] > first)
        first = p->pad_from[pad_row(p, b)];
    return first;
}

int64_t mha_mask_window(const mha_mask_plan *p, int64_t b, int64_t i,
                        int64_t *lo)
{
    /* Bottom-right per sequence: row i is position n_b - Lq + i, and it
     * sees itself and the window - 1 positions before it (and, with the
     * window modifier, none before its left bound; its right bound is
     * past the row's own position, which causal masking already keeps). */
    const int64_t hi = mha_mask_qpos(p, b, i);
    int64_t first = hi - p->window + 1;
    if (p->band && p->band_left >= 0 && hi - p->band_left > first)
        first = hi - p->band_left;
    if (p->chunk && mha_chunk_start(hi, p->chunk) > first)
        first = mha_chunk_start(hi, p->chunk);
    *lo = first > 0 ? first : 0;
    return hi;
}

/* Columns j0 .. j0+n-1 of row i of a sliding-window cache: slots, each
 * live when the position it holds is in the row's window. */
static int64_t window_cols(const mha_mask_plan *p, int64_t b, int64_t i,
                           int64_t j0, int64_t n, float *row)
{
    int64_t lo;
    const int64_t hi = mha_mask_window(p, b, i, &lo);
    int64_t live = 0;
    for (int64_t c = 0; c < n; c++) {
        const int64_t pos = mha_ring_position(p->seq_lengths[b], p->ring,
                                              j0 + c);
        row[c] = pos >= lo && pos <= hi ? 0.0f : -INFINITY;
        live += row[c] == 0.0f;
    }
    return live;
}

/* Folds one mask's values into the running biases of n columns: a
 * boolean one excludes keys; an additive one adds (two large finite
 * values saturate instead of summing to +-inf: only an explicit -inf
 * excludes a key).  A loop per kind, without a branch per element, so
 * that each vectorises (a switch per element cost ~4 ns a score, four
 * times a dense-mask forward's arithmetic: docs/BENCHMARKS.md). */
static void apply_cols(mha_mask_kind kind, const void *data, int64_t k,
                       int64_t n, float *row)
{
    if (kind == MHA_MASK_ALLOW || kind == MHA_MASK_BLOCK) {
        const uint8_t *m = (const uint8_t *)data + k;
        const uint8_t keep = kind == MHA_MASK_ALLOW;
        for (int64_t c = 0; c < n; c++)
            row[c] = (m[c] != 0) == keep ? row[c] : -INFINITY;
    } else if (kind == MHA_MASK_ADDITIVE) {
        const float *x = (const float *)data + k;
        for (int64_t c = 0; c < n; c++) {
            const float v = row[c] + x[c];
            const float s = v > FLT_MAX ? FLT_MAX : v < -FLT_MAX ? -FLT_MAX : v;
            row[c] = row[c] == -INFINITY || x[c] == -INFINITY ? -INFINITY : s;
        }
    }
}

int64_t mha_mask_cols(const mha_mask_plan *p, int64_t b, int64_t h, int64_t i,
                      int64_t j0, int64_t n, float *row)
{
    if (p->window)   /* (no explicit mask composes with a window) */
        return window_cols(p, b, i, j0, n, row);
    const int64_t Lk = p->kv_len;
    const int64_t last = mha_mask_last(p, b, i);
    const int64_t first = mha_mask_first(p, b, i);
    for (int64_t c = 0; c < n; c++)
        row[c] = j0 + c <= last && j0 + c >= first ? 0.0f : -INFINITY;
    apply_cols(p->pad.kind, p->pad.data, b * p->pad_stride_b + j0, n, row);
    apply_cols(p->attn.kind, p->attn.data,
               b * p->attn_stride_b + h * p->attn_stride_h + i * Lk + j0, n,
               row);
    int64_t live = 0;
    for (int64_t c = 0; c < n; c++)
        live += row[c] != -INFINITY;
    return live;
}

int64_t mha_mask_key_cols(const mha_mask_plan *p, int64_t b, int64_t j0,
                          int64_t n, float *row)
{
    const int64_t off = b * p->pad_stride_b + j0;
    int64_t live = 0;
    /* apply_cols()'s cases for biases of 0, one loop per kind (an
     * additive value is finite or -inf, checked by plan_pad: 0 + x = x) */
    if (p->pad.kind == MHA_MASK_ADDITIVE) {
        const float *x = (const float *)p->pad.data + off;
        for (int64_t c = 0; c < n; c++)
            row[c] = x[c];
    } else {
        const uint8_t *m = (const uint8_t *)p->pad.data + off;
        const uint8_t keep = p->pad.kind == MHA_MASK_ALLOW;
        for (int64_t c = 0; c < n; c++)
            row[c] = (m[c] != 0) == keep ? 0.0f : -INFINITY;
    }
    for (int64_t c = 0; c < n; c++)
        live += row[c] != -INFINITY;
    return live;
}

int64_t mha_mask_row(const mha_mask_plan *p, int64_t b, int64_t h, int64_t i,
                     float *row)
{
    int64_t live = mha_mask_cols(p, b, h, i, 0, p->kv_len, row);
    for (int64_t j = p->kv_len; j < p->total_keys; j++)
        row[j] = 0.0f;
    return live + (p->total_keys - p->kv_len);
}
