/*
 * scalar.c -- the portable tier: plain C loops, no intrinsics.
 * Accumulation order is fixed (ascending index), so results do not depend
 * on the tile's shape or position.
 */
#include "kernels.h"
#include "core/core.h"   /* (mha_amax_portable: the scans' loop) */

#include <math.h>

/* s[r][c] = sum_d q[r][d] * k(d, c), k(d, c) = k[d sd + c sc]: the
 * packed kt tile (sd = ldkt, sc = 1) or keys where they lie (sd = 1,
 * sc = ldk).  d outermost, each sum from 0 in ascending d. */
static void qk_strided(int mr, int nc, int dh, const float *q,
                       const float *k, size_t sd, size_t sc, float *s,
                       int lds)
{
    for (int r = 0; r < mr; r++) {
        float *sr = s + r * lds;
        for (int c = 0; c < nc; c++)
            sr[c] = 0.0f;
        for (int d = 0; d < dh; d++) {
            const float qd = q[r * dh + d];
            for (int c = 0; c < nc; c++)
                sr[c] += qd * k[d * sd + c * sc];
        }
    }
}

static void qk_scalar(int mr, int nc, int dh, const float *q, const float *kt,
                      int ldkt, float *s, int lds)
{
    qk_strided(mr, nc, dh, q, kt, (size_t)ldkt, 1, s, lds);
}

/* o[r][d] += p[r][c] v[c][d], value rows ldv apart; with exact, a weight
 * p[r][c] == 0 adds nothing (NaN or Inf in v[c] stays out). */
static void pv_strided(int exact, int mr, int nc, int dh, const float *p,
                       int ldp, const float *v, size_t ldv, float *o, int ldo)
{
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            const float pc = p[r * ldp + c];
            if (exact && pc == 0.0f)
                continue;
            const float *vc = v + c * ldv;
            float *orow = o + r * ldo;
            for (int d = 0; d < dh; d++)
                orow[d] += pc * vc[d];
        }
}

static void pv_scalar(int mr, int nc, int dh, const float *p, int ldp,
                      const float *v, float *o, int ldo)
{
    pv_strided(0, mr, nc, dh, p, ldp, v, (size_t)dh, o, ldo);
}

static void pv_exact_scalar(int mr, int nc, int dh, const float *p, int ldp,
                            const float *v, float *o, int ldo)
{
    pv_strided(1, mr, nc, dh, p, ldp, v, (size_t)dh, o, ldo);
}

/*
 * o[i][d] += (sum_k A[i][k] * B[k][d]) for i < M, d < dh, k < K, the sum
 * formed from zero in ascending k, then added: A[i][k] = a[i*sa + k*sk].
 * pv_add reads p along its rows, pvt down its columns.  One output element
 * at a time (a strided walk: this tier is the readable one, not the fast
 * one).
 */
static void add_sums(int exact, int M, int K, int dh, const float *a, int sa,
                     int sk, const float *b, float *o, int ldo)
{
    for (int i = 0; i < M; i++)
        for (int d = 0; d < dh; d++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                const float w = a[i * sa + k * sk];
                if (exact && w == 0.0f)
                    continue;
                acc += w * b[k * dh + d];
            }
            o[i * ldo + d] += acc;
        }
}

static void pv_add_scalar(int mr, int nc, int dh, const float *p, int ldp,
                          const float *v, float *o, int ldo)
{
    add_sums(0, mr, nc, dh, p, ldp, 1, v, o, ldo);
}

static void pv_add_exact_scalar(int mr, int nc, int dh, const float *p,
                                int ldp, const float *v, float *o, int ldo)
{
    add_sums(1, mr, nc, dh, p, ldp, 1, v, o, ldo);
}

static void pvt_scalar(int mr, int nc, int dh, const float *p, int ldp,
                       const float *x, float *o, int ldo)
{
    add_sums(0, nc, mr, dh, p, 1, ldp, x, o, ldo);
}

static void pvt_exact_scalar(int mr, int nc, int dh, const float *p, int ldp,
                             const float *x, float *o, int ldo)
{
    add_sums(1, nc, mr, dh, p, 1, ldp, x, o, ldo);
}

static float exp_sum_scalar(float *x, int n, float m)
{
    float sum = 0.0f;
    for (int c = 0; c < n; c++) {
        x[c] = expf(x[c] - m);
        sum += x[c];
    }
    return sum;
}

static void scale_scalar(float *dst, const float *src, int n, float a)
{
    for (int c = 0; c < n; c++)
        dst[c] = src[c] * a;
}

static int copy_finite_scalar(float *dst, const float *src, int n)
{
    int finite = 1;
    for (int c = 0; c < n; c++) {
        dst[c] = src[c];
        finite &= isfinite(src[c]) != 0;
    }
    return finite;
}

/* Four interleaved partial sums, added in a fixed order at the end. */
static double dot_nonzero_scalar(const float *p, const float *d, int n)
{
    double s[4] = {0.0, 0.0, 0.0, 0.0};
    int c = 0;
    for (; c + 4 <= n; c += 4)
        for (int k = 0; k < 4; k++)
            if (p[c + k] != 0.0f)
                s[k] += (double)p[c + k] * d[c + k];
    for (; c < n; c++)
        if (p[c] != 0.0f)
            s[0] += (double)p[c] * d[c];
    return (s[0] + s[1]) + (s[2] + s[3]);
}

/* The three calls it stands for, in turn: their bits by construction. */
static double probs_scalar(float *x, int n, float m, float a, const float *d)
{
    exp_sum_scalar(x, n, m);
    scale_scalar(x, x, n, a);
    return d ? dot_nonzero_scalar(x, d, n) : 0.0;
}

static void dscore_scalar(const float *p, const float *d, float delta,
                          float *ds, int n)
{
    for (int c = 0; c < n; c++)
        ds[c] = p[c] == 0.0f ? 0.0f : p[c] * (d[c] - delta);
}

static float max_scalar(const float *x, int n);

static void softmax_rows_scalar(int mr, int nc, float *s, int lds, float *m,
                                float *l, float *alpha)
{
    for (int r = 0; r < mr; r++) {
        float *x = s + (size_t)r * lds;
        const float mt = max_scalar(x, nc);
        const float mn = mt > m[r] ? mt : m[r];
        if (mn == -INFINITY) {
            alpha[r] = -1.0f;
            continue;
        }
        alpha[r] = mn == m[r] ? 1.0f : expf(m[r] - mn);
        const float sum = exp_sum_scalar(x, nc, mn);
        l[r] = l[r] * alpha[r];
        l[r] = l[r] + sum;
        m[r] = mn;
    }
}

static float max_scalar(const float *x, int n)
{
    float m = -INFINITY;
    for (int c = 0; c < n; c++)
        if (x[c] > m)
            m = x[c];
    return m;
}

static void softcap_scalar(float *x, int n, float c, float *dcap)
{
    const float inv = 1.0f / c;
    for (int k = 0; k < n; k++) {
        const float t = tanhf(x[k] * inv);
        x[k] = c * t;
        if (dcap)
            dcap[k] = 1.0f - t * t;
    }
}

/* qk and pv on a KV cache's tiles: the same loops, each element converted
 * as it is read (mha_kt_load, mha_v_load). */
static void qk_kv_scalar(mha_kv_dtype dtype, int mr, int nc, int dh,
                         const float *q, const void *kt, int cols,
                         const void *next, float *s, int lds)
{
    (void)next;   /* (no prefetching here) */
    if (dtype == MHA_KV_F32) {
        qk_scalar(mr, nc, dh, q, kt, cols, s, lds);
        return;
    }
    for (int r = 0; r < mr; r++) {
        float *sr = s + r * lds;
        for (int c = 0; c < nc; c++)
            sr[c] = 0.0f;
        for (int d = 0; d < dh; d++) {
            const float qd = q[r * dh + d];
            for (int c = 0; c < nc; c++)
                sr[c] += qd * mha_kt_load(dtype, kt, cols, dh, d, c);
        }
    }
}

static void pv_kv_scalar(mha_kv_dtype dtype, int exact, int mr, int nc,
                         int dh, const float *p, int ldp, const void *v,
                         int cols, const void *next, float *o, int ldo)
{
    (void)next;
    if (dtype == MHA_KV_F32) {
        (exact ? pv_exact_scalar : pv_scalar)(mr, nc, dh, p, ldp, v, o, ldo);
        return;
    }
    for (int r = 0; r < mr; r++)
        for (int c = 0; c < nc; c++) {
            const float pc = p[r * ldp + c];
            if (exact && pc == 0.0f)
                continue;
            float *orow = o + r * ldo;
            for (int d = 0; d < dh; d++)
                orow[d] += pc * mha_v_load(dtype, v, cols, dh, c, d);
        }
}

/* qk and pv on keys and values where they lie, rows ldk / ldv apart. */
static void qk_rows_scalar(int mr, int nc, int dh, const float *q,
                           const float *k, int ldk, float *s, int lds)
{
    qk_strided(mr, nc, dh, q, k, 1, (size_t)ldk, s, lds);
}

static void pv_rows_scalar(int exact, int mr, int nc, int dh, const float *p,
                           int ldp, const float *v, int ldv, float *o,
                           int ldo)
{
    pv_strided(exact, mr, nc, dh, p, ldp, v, (size_t)ldv, o, ldo);
}

static void widen_t_scalar(mha_kv_dtype dtype, const void *x, int64_t ldx,
                           int n, int dh, float *kt, int ldkt, float *v,
                           int dv)
{
    const int scaled = mha_kv_scaled(dtype);   /* (q8, q4: kt NULL) */
    for (int c = 0; c < n; c++)
        for (int d = 0; d < (kt ? dh : dv); d++) {
            const float e = scaled ? mha_v_load(dtype, x, n, dh, c, d)
                                   : mha_kv_elem(dtype, x,
                                                 (int64_t)c * ldx + d);
            if (kt)
                kt[(size_t)d * ldkt + c] = e;
            if (v && d < dv)
                v[(size_t)c * dv + d] = e;
        }
}

static void narrow_scalar(int bf, const float *x, int n, const float *mult,
                          uint16_t *y)
{
    for (int i = 0; i < n; i++) {
        const float v = mult ? x[i] * *mult : x[i];
        y[i] = bf ? mha_bf16_from_float(v) : mha_f16_from_float(v);
    }
}

const mha_microkernels mha_microkernels_scalar = {
    "scalar",           qk_scalar,      pv_scalar,    pv_exact_scalar,
    pv_add_scalar,      pv_add_exact_scalar, pvt_scalar, pvt_exact_scalar,
    exp_sum_scalar,     probs_scalar,   scale_scalar,   copy_finite_scalar, max_scalar, softmax_rows_scalar,     softcap_scalar,
    qk_kv_scalar,       pv_kv_scalar,   dot_nonzero_scalar, dscore_scalar,
    qk_rows_scalar,     pv_rows_scalar, widen_t_scalar, mha_amax_portable,
    narrow_scalar,      64 /* latent_slab */};
