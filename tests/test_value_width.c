/*
 * test_value_width.c -- attention whose values (and output) have another
 * head width than the queries and keys (mha_attention_args.v_head_dim,
 * PyTorch SDPA's Ev != E; DeepSeek's MLA: keys of 192, values of 128):
 *
 *   - out, lse and the weights against an attention written here from the
 *     definitions in float64, within the suite's tolerance (twice the
 *     error of the same loops in float32, ref.h), for d_v below and above
 *     d_h, grouped-query and not, causal, key lengths, a window, chunks,
 *     sinks, decoding shapes (one row against 1,100 keys: the key split,
 *     read in place), in the rows layout and heads first;
 *   - with d_v = d_h the same bits as the call without v_head_dim;
 *   - 1, 2 and 4 threads bitwise; a plan's runs bitwise the one-shot call;
 *   - dq, dk and dv by central differences of the float64 attention, and
 *     the backward of a part (mha_attention_backward_part) equal to the
 *     whole backward;
 *   - a KV cache of values d_v wide, in every storage type: bitwise the
 *     step on an f32 cache of the values read back, 1 and 2 threads, and
 *     that within float rounding of the plain call;
 *   - MLA's latent cache (values the keys' first d_v elements, stored
 *     once): the absorbed decode of 70 heads equals the naive attention,
 *     bitwise a cache of the same keys and values kept apart;
 *   - refusals by name: a negative width, a cache of another width, a
 *     rotated one, odd q4 values, a module of other widths or on a
 *     latent cache, bf16.
 *
 * Every tier runs it (CTest, MHA_ISA).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "assert_error.h"
#include "ref.h"
#include "testutil.h"

typedef struct vcase {
    const char *name;
    int64_t B, H, Hkv, dh, dv, Lq, Lk;
    mha_causal causal;
    int key_lengths, window, sinks;
    int64_t chunk;
    int heads_first;
} vcase;

static const vcase CASES[] = {
    /* name                          B  H Hkv dh  dv  Lq   Lk  causal lens win sinks chunk hf */
    {"d_v < d_h",                    2, 4, 4, 24, 16, 9,  70,  0, 0, 0, 0, 0, 0},
    {"d_v > d_h, GQA, causal",       2, 4, 2, 16, 40, 33, 140, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0},
    {"MLA-like 12/8, lengths",       2, 2, 1, 12, 8,  20, 90,  MHA_CAUSAL_BOTTOM_RIGHT, 1, 0, 0, 0, 0},
    {"window, sinks, chunks",        1, 3, 3, 8,  20, 70, 70,  MHA_CAUSAL_BOTTOM_RIGHT, 0, 1, 1, 24, 0},
    {"decoding, split keys",         2, 8, 2, 16, 8,  1,  1100, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0},
    {"decoding, MQA, in place",      1, 1, 1, 32, 20, 1,  700, 0, 0, 0, 0, 0, 0},
    {"heads first",                  2, 4, 2, 16, 24, 17, 80,  MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 1},
    /* more query heads per K/V head than a block holds: runs of heads */
    {"80 heads on 1, decoding",      1, 80, 1, 12, 8, 1,  1100, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0},
    {"2 x 40 heads, 3 rows",         1, 80, 2, 8,  12, 3, 1030, MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 1, 0, 0},
};

typedef struct prob {
    const vcase *c;
    int64_t nq, nk, nv, no, nl;
    float *q, *k, *v, *out, *lse, *sinks;
    int64_t *lens;
    mha_attention_args a;
} prob;

/* Element (b, h, i, d) of a tensor of L rows, heads of width w, in the
 * case's layout. */
static int64_t at(const vcase *c, int64_t heads, int64_t L, int64_t w,
                  int64_t b, int64_t h, int64_t i, int64_t d)
{
    return c->heads_first ? ((b * heads + h) * L + i) * w + d
                          : ((b * L + i) * heads + h) * w + d;
}

static void prob_init(prob *p, const vcase *c, uint64_t seed)
{
    memset(p, 0, sizeof *p);
    p->c = c;
    p->nq = c->B * c->Lq * c->H * c->dh;
    p->nk = c->B * c->Lk * c->Hkv * c->dh;
    p->nv = c->B * c->Lk * c->Hkv * c->dv;
    p->no = c->B * c->Lq * c->H * c->dv;
    p->nl = c->B * c->H * c->Lq;
    p->q = malloc((size_t)p->nq * 4);
    p->k = malloc((size_t)p->nk * 4);
    p->v = malloc((size_t)p->nv * 4);
    p->out = malloc((size_t)p->no * 4);
    p->lse = malloc((size_t)p->nl * 4);
    p->sinks = malloc((size_t)c->H * 4);
    p->lens = malloc((size_t)c->B * sizeof *p->lens);
    tu_fill(p->q, p->nq, seed + 1, -2.0f, 2.0f);
    tu_fill(p->k, p->nk, seed + 2, -2.0f, 2.0f);
    tu_fill(p->v, p->nv, seed + 3, -1.5f, 1.5f);
    tu_fill(p->sinks, c->H, seed + 4, -1.0f, 2.0f);
    for (int64_t b = 0; b < c->B; b++)
        p->lens[b] = c->Lk - 7 * (b + 1);
    mha_attention_args *a = &p->a;
    a->batch = c->B;
    a->num_heads = c->H;
    a->num_kv_heads = c->Hkv;
    a->head_dim = c->dh;
    a->v_head_dim = c->dv;
    a->q_len = c->Lq;
    a->kv_len = c->Lk;
    a->q = p->q;
    a->k = p->k;
    a->v = p->v;
    a->out = p->out;
    a->lse = p->lse;
    a->causal = c->causal;
    a->key_lengths = c->key_lengths ? p->lens : NULL;
    a->mods.window = c->window;
    a->mods.window_left = c->window ? 30 : 0;
    a->sinks = c->sinks ? p->sinks : NULL;
    a->attention_chunk = c->chunk;
    a->layout = c->heads_first ? MHA_LAYOUT_HEADS_FIRST : MHA_LAYOUT_ROWS;
}

static void prob_free(prob *p)
{
    free(p->q), free(p->k), free(p->v), free(p->out), free(p->lse);
    free(p->sinks), free(p->lens);
}

/* Key j visible from row i (bottom-right positions). */
static int visible(const prob *p, int64_t b, int64_t i, int64_t j)
{
    const vcase *c = p->c;
    const int64_t qpos = i + c->Lk - c->Lq;
    if (c->causal && j > qpos)
        return 0;
    if (c->key_lengths && j >= p->lens[b])
        return 0;
    if (c->window && j < qpos - 30)
        return 0;
    if (c->chunk && (qpos < 0 || qpos / c->chunk != j / c->chunk))
        return 0;
    return 1;
}

/* out (B, Lq, H, dv) and lse (B, H, Lq) in T (double: the reference,
 * float: single precision's own error), from q, k, v as given (dq, dk,
 * dv overriding them in float64 when not NULL). */
#define DEFINE_ATTEND(T, NAME, EXP, LOG)                                       \
    static void NAME(const prob *p, const double *dq, const double *dk,        \
                     const double *dv, T *out, T *lse)                         \
    {                                                                          \
        const vcase *c = p->c;                                                 \
        const double scale = 1.0 / sqrt((double)c->dh);                        \
        T *s = malloc((size_t)c->Lk * sizeof *s);                              \
        for (int64_t b = 0; b < c->B; b++)                                     \
            for (int64_t h = 0; h < c->H; h++)                                 \
                for (int64_t i = 0; i < c->Lq; i++) {                          \
                    const int64_t g = h / (c->H / c->Hkv);                     \
                    T mx = c->sinks ? (T)p->sinks[h] : (T)-INFINITY;           \
                    int any = c->sinks;                                        \
                    for (int64_t j = 0; j < c->Lk; j++) {                      \
                        s[j] = (T)-INFINITY;                                   \
                        if (!visible(p, b, i, j))                              \
                            continue;                                          \
                        T dot = 0;                                             \
                        for (int64_t d = 0; d < c->dh; d++) {                  \
                            const int64_t iq =                                 \
                                at(c, c->H, c->Lq, c->dh, b, h, i, d);         \
                            const int64_t ik =                                 \
                                at(c, c->Hkv, c->Lk, c->dh, b, g, j, d);       \
                            dot += (dq ? (T)dq[iq] : (T)p->q[iq]) *            \
                                   (dk ? (T)dk[ik] : (T)p->k[ik]);             \
                        }                                                      \
                        s[j] = dot * (T)scale;                                 \
                        mx = s[j] > mx ? s[j] : mx;                            \
                        any = 1;                                               \
                    }                                                          \
                    T *l = lse + (b * c->H + h) * c->Lq + i;                   \
                    T sum = c->sinks ? EXP((T)p->sinks[h] - mx) : 0;           \
                    for (int64_t j = 0; any && j < c->Lk; j++)                 \
                        if (s[j] != (T)-INFINITY)                              \
                            sum += s[j] = EXP(s[j] - mx);                      \
                    *l = any ? mx + LOG(sum) : (T)-INFINITY;                   \
                    for (int64_t d = 0; d < c->dv; d++) {                      \
                        T acc = 0;                                             \
                        for (int64_t j = 0; any && j < c->Lk; j++) {           \
                            if (s[j] == (T)-INFINITY)                          \
                                continue;                                      \
                            const int64_t iv =                                 \
                                at(c, c->Hkv, c->Lk, c->dv, b, g, j, d);       \
                            acc += s[j] * (dv ? (T)dv[iv] : (T)p->v[iv]);      \
                        }                                                      \
                        out[at(c, c->H, c->Lq, c->dv, b, h, i, d)] =           \
                            any ? acc / sum : 0;                               \
                    }                                                          \
                }                                                              \
        free(s);                                                               \
    }
DEFINE_ATTEND(double, attend64, exp, log)
DEFINE_ATTEND(float, attend32, expf, logf)

static double max_err(const float *x, const double *ref, int64_t n)
{
    double e = 0.0;
    for (int64_t k = 0; k < n; k++) {
        const double d = fabs((double)x[k] - ref[k]);
        if (!(d <= e))
            e = d != d ? INFINITY : d;
    }
    return e;
}

static double max_err32(const float *x, const double *ref, int64_t n)
{
    return max_err(x, ref, n);
}

static void test_forward(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const vcase *c = &CASES[t];
        prob p;
        prob_init(&p, c, 100 * t);
        if (mha_attention(&p.a) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        double *ref = malloc((size_t)p.no * sizeof *ref);
        double *rlse = malloc((size_t)p.nl * sizeof *rlse);
        float *naive = malloc((size_t)p.no * 4);
        float *nlse = malloc((size_t)p.nl * 4);
        attend64(&p, NULL, NULL, NULL, ref, rlse);
        attend32(&p, NULL, NULL, NULL, naive, nlse);
        const double tol = ref_tolerance(max_err32(naive, ref, p.no),
                                         ref_max_abs(ref, p.no));
        const double err = max_err(p.out, ref, p.no);
        if (!(err <= tol))
            fail_msg("%s: out error %.3g > tolerance %.3g", c->name, err, tol);
        for (int64_t r = 0; r < p.nl; r++)
            if (!(fabs((double)p.lse[r] - rlse[r]) <= 1e-5 * (1 + fabs(rlse[r]))))
                fail_msg("%s: lse[%lld] %g, float64 %g", c->name,
                         (long long)r, (double)p.lse[r], rlse[r]);
        /* the weights times V give the output */
        if (!c->heads_first) {
            float *w = malloc((size_t)(p.nl * c->Lk) * 4);
            float *out2 = malloc((size_t)p.no * 4);
            p.a.need_weights = MHA_WEIGHTS_PER_HEAD;
            p.a.attn_weights = w;
            p.a.out = out2;
            assert_int_equal(mha_attention(&p.a), MHA_OK);
            assert_memory_equal(out2, p.out, (size_t)p.no * 4);
            double werr = 0.0;
            for (int64_t b = 0; b < c->B; b++)
                for (int64_t h = 0; h < c->H; h++)
                    for (int64_t i = 0; i < c->Lq; i++)
                        for (int64_t d = 0; d < c->dv; d++) {
                            double acc = 0.0;
                            const int64_t g = h / (c->H / c->Hkv);
                            for (int64_t j = 0; j < c->Lk; j++)
                                acc += (double)w[((b * c->H + h) * c->Lq + i) *
                                                     c->Lk + j] *
                                       p.v[at(c, c->Hkv, c->Lk, c->dv, b, g,
                                              j, d)];
                            werr = fmax(werr, fabs(acc - ref[at(c, c->H, c->Lq,
                                                              c->dv, b, h, i,
                                                              d)]));
                        }
            if (!(werr <= 1e-5 * (1.0 + ref_max_abs(ref, p.no))))
                fail_msg("%s: weights times V off by %.3g", c->name, werr);
            free(w);
            free(out2);
        }
        free(ref), free(rlse), free(naive), free(nlse);
        prob_free(&p);
    }
}

/* With d_v = d_h, v_head_dim changes nothing: the same bits as 0. */
static void test_equal_widths(void **state)
{
    (void)state;
    vcase c = CASES[1];
    c.dv = c.dh;
    prob p;
    prob_init(&p, &c, 7);
    assert_int_equal(mha_attention(&p.a), MHA_OK);
    float *first = malloc((size_t)p.no * 4);
    memcpy(first, p.out, (size_t)p.no * 4);
    p.a.v_head_dim = 0;
    assert_int_equal(mha_attention(&p.a), MHA_OK);
    assert_memory_equal(first, p.out, (size_t)p.no * 4);
    free(first);
    prob_free(&p);
}

/* 1, 2 and 4 threads, and a plan's second run: the same bits. */
static void test_threads_and_plans(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        prob p;
        prob_init(&p, &CASES[t], 50 + t);
        float *first = malloc((size_t)p.no * 4);
        const int threads[3] = {1, 2, 4};
        for (int n = 0; n < 3; n++) {
            p.a.num_threads = threads[n];
            assert_int_equal(mha_attention(&p.a), MHA_OK);
            if (n == 0)
                memcpy(first, p.out, (size_t)p.no * 4);
            else if (memcmp(first, p.out, (size_t)p.no * 4))
                fail_msg("%s: %d threads differ from 1", CASES[t].name,
                         threads[n]);
        }
        mha_attention_plan *plan = NULL;
        assert_int_equal(mha_attention_plan_create(&p.a, &plan), MHA_OK);
        for (int run = 0; run < 2; run++) {
            memset(p.out, 0xff, (size_t)p.no * 4);
            assert_int_equal(mha_attention_plan_run(plan, &p.a), MHA_OK);
            assert_memory_equal(first, p.out, (size_t)p.no * 4);
        }
        /* a plan refuses another value width */
        p.a.v_head_dim = CASES[t].dv + 1;
        assert_fails(mha_attention_plan_run(plan, &p.a), MHA_ERR_SHAPE,
                     "d_v");
        mha_attention_plan_free(plan);
        free(first);
        prob_free(&p);
    }
}

/* L = sum(g * out) of the float64 attention. */
static double loss64(const prob *p, const double *q, const double *k,
                     const double *v, const float *g)
{
    double *out = malloc((size_t)p->no * sizeof *out);
    double *lse = malloc((size_t)p->nl * sizeof *lse);
    attend64(p, q, k, v, out, lse);
    double L = 0.0;
    for (int64_t e = 0; e < p->no; e++)
        L += out[e] * g[e];
    free(out);
    free(lse);
    return L;
}

static double *widen(const float *x, int64_t n)
{
    double *y = malloc((size_t)n * sizeof *y);
    for (int64_t e = 0; e < n; e++)
        y[e] = x[e];
    return y;
}

static const vcase GCASES[] = {
    {"grad d_v < d_h",               1, 2, 2, 6,  4,  5,  9,  0, 0, 0, 0, 0, 0},
    {"grad d_v > d_h, GQA, causal",  1, 4, 2, 4,  7,  6,  8,  MHA_CAUSAL_BOTTOM_RIGHT, 0, 0, 0, 0, 0},
    {"grad heads first, sinks",      2, 2, 1, 5,  3,  4,  7,  0, 0, 0, 1, 0, 1},
};

/* dq, dk and dv against central differences of the float64 attention;
 * then the backward of a part (the whole row's lse and its output) equal
 * to the whole backward. */
static void test_gradients(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof GCASES / sizeof *GCASES; t++) {
        const vcase *c = &GCASES[t];
        prob p;
        prob_init(&p, c, 300 + 10 * t);
        float *g = malloc((size_t)p.no * 4), *dq = malloc((size_t)p.nq * 4);
        float *dk = malloc((size_t)p.nk * 4), *dv = malloc((size_t)p.nv * 4);
        float ds[8];
        tu_fill(g, p.no, 77 + t, -1.0f, 1.0f);
        const mha_attention_grads gr = {g, dq, dk, dv, c->sinks ? ds : NULL};
        if (mha_attention_backward(&p.a, &gr) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());
        double *x[3] = {widen(p.q, p.nq), widen(p.k, p.nk), widen(p.v, p.nv)};
        const float *got[3] = {dq, dk, dv};
        const int64_t n[3] = {p.nq, p.nk, p.nv};
        const char *names[3] = {"dq", "dk", "dv"};
        const double step = 1e-4;
        for (int w = 0; w < 3; w++) {
            double mx = 0.0, err = 0.0;
            for (int64_t e = 0; e < n[w]; e++) {
                const double x0 = x[w][e];
                x[w][e] = x0 + step;
                const double up = loss64(&p, x[0], x[1], x[2], g);
                x[w][e] = x0 - step;
                const double down = loss64(&p, x[0], x[1], x[2], g);
                x[w][e] = x0;
                const double want = (up - down) / (2 * step);
                mx = fmax(mx, fabs(want));
                err = fmax(err, fabs((double)got[w][e] - want));
            }
            /* (central differences of step 1e-4: their own error ~1e-8) */
            if (!(err <= 1e-4 * (1.0 + mx)))
                fail_msg("%s: %s error %.3g (max |grad| %.3g)", c->name,
                         names[w], err, mx);
        }
        /* the backward of the whole problem as one part */
        if (!c->sinks) {
            float *dq2 = malloc((size_t)p.nq * 4);
            float *dk2 = malloc((size_t)p.nk * 4);
            float *dv2 = malloc((size_t)p.nv * 4);
            assert_int_equal(mha_attention(&p.a), MHA_OK);
            const mha_attention_grads gr2 = {g, dq2, dk2, dv2, NULL};
            assert_int_equal(mha_attention_backward_part(&p.a, p.lse, p.out,
                                                         &gr2), MHA_OK);
            double e = 0.0, mx = 0.0;
            for (int64_t i = 0; i < p.nv; i++) {
                e = fmax(e, fabs((double)dv2[i] - dv[i]));
                mx = fmax(mx, fabs((double)dv[i]));
            }
            for (int64_t i = 0; i < p.nq; i++) {
                e = fmax(e, fabs((double)dq2[i] - dq[i]));
                mx = fmax(mx, fabs((double)dq[i]));
            }
            if (!(e <= 1e-5 * (1.0 + mx)))
                fail_msg("%s: the part's backward differs by %.3g", c->name,
                         e);
            free(dq2), free(dk2), free(dv2);
        }
        for (int w = 0; w < 3; w++)
            free(x[w]);
        free(g), free(dq), free(dk), free(dv);
        prob_free(&p);
    }
}

/* A KV cache whose values have another width (mha_kv_cache_config.
 * v_head_dim) in every storage type: a decoding step of 2 rows per
 * sequence is bitwise the step on an f32 cache holding the values read
 * back, on 1 and 2 threads, and the f32 cache's step within float
 * rounding of mha_attention on the same keys and values; values read
 * back d_v wide. */
static void test_cache(void **state)
{
    (void)state;
    enum { B = 2, H = 4, HKV = 2, DH = 24, DV = 40, LQ = 2, LEN = 300 };
    const mha_kv_dtype dts[] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16,
                                MHA_KV_Q8, MHA_KV_Q4};
    const int64_t nk = LEN * HKV * DH, nv = LEN * HKV * DV;
    float *k = malloc((size_t)(B * nk) * 4), *v = malloc((size_t)(B * nv) * 4);
    float *q = malloc((size_t)(B * LQ * H * DH) * 4);
    float *kr = malloc((size_t)(B * nk) * 4), *vr = malloc((size_t)(B * nv) * 4);
    const int64_t no = B * LQ * H * DV;
    float *out = malloc((size_t)no * 4), *want = malloc((size_t)no * 4);
    float *plain = malloc((size_t)no * 4);
    tu_fill(k, B * nk, 61, -1, 1);
    tu_fill(v, B * nv, 62, -1, 1);
    tu_fill(q, B * LQ * H * DH, 63, -1, 1);
    /* the plain attention on the same keys and values */
    mha_attention_args pa = {0};
    pa.batch = B, pa.num_heads = H, pa.num_kv_heads = HKV, pa.head_dim = DH;
    pa.v_head_dim = DV, pa.q_len = LQ, pa.kv_len = LEN, pa.q = q, pa.k = k;
    pa.v = v, pa.out = plain, pa.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_int_equal(mha_attention(&pa), MHA_OK);
    for (size_t t = 0; t < sizeof dts / sizeof *dts; t++) {
        mha_kv_cache_config kc = {B, HKV, DH, LEN, dts[t], 0, 0, 0, 0, DV, 0};
        mha_kv_cache *kv = NULL, *f32 = NULL;
        assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
        for (int64_t b = 0; b < B; b++) {
            assert_int_equal(mha_kv_cache_append(kv, b, k + b * nk,
                                                 v + b * nv, LEN), MHA_OK);
            assert_int_equal(mha_kv_cache_read(kv, b, 0, LEN, kr + b * nk,
                                               vr + b * nv), MHA_OK);
        }
        kc.dtype = MHA_KV_F32;
        assert_int_equal(mha_kv_cache_create(&kc, &f32), MHA_OK);
        for (int64_t b = 0; b < B; b++)
            assert_int_equal(mha_kv_cache_append(f32, b, kr + b * nk,
                                                 vr + b * nv, LEN), MHA_OK);
        mha_attention_decode_args d = {0};
        d.batch = B, d.num_heads = H, d.head_dim = DH, d.q_len = LQ;
        d.q = q, d.out = want, d.cache = f32;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        d.cache = kv, d.out = out;
        for (int threads = 1; threads <= 2; threads++) {
            d.num_threads = threads;
            memset(out, 0xff, (size_t)no * 4);
            if (mha_attention_decode(&d) != MHA_OK)
                fail_msg("dtype %d: %s", (int)dts[t], mha_last_error());
            assert_memory_equal(out, want, (size_t)no * 4);
        }
        if (dts[t] == MHA_KV_F32) {
            assert_memory_equal(vr, v, (size_t)(B * nv) * 4);
            double e = 0.0, mx = 0.0;
            for (int64_t i = 0; i < no; i++) {
                e = fmax(e, fabs((double)out[i] - plain[i]));
                mx = fmax(mx, fabs((double)plain[i]));
            }
            /* (two float32 computations of one attention: a few ulps) */
            if (!(e <= 1e-6 * (1.0 + mx)))
                fail_msg("f32 cache differs from the plain call by %.3g", e);
        }
        mha_kv_cache_free(kv);
        mha_kv_cache_free(f32);
    }
    /* a module whose values are d_h wide refuses such a cache, a latent
     * one too (test_module_widths runs a module of d_v on its own) */
    mha_config mc = {0};
    mc.embed_dim = H * DH, mc.num_heads = H, mc.num_kv_heads = HKV;
    mha_module *m = tu_module(&mc, 3);
    mha_kv_cache_config kc = {B, HKV, DH, 8, MHA_KV_F32, 0, 0, 0, 0, DV, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    mha_forward_args fa = {0};
    fa.batch = B, fa.q_len = 1, fa.query = q, fa.out = out, fa.cache = kv;
    assert_fails(mha_forward(m, &fa), MHA_ERR_SHAPE, "the cache's values");
    mha_kv_cache_free(kv);
    kc.v_head_dim = DH - 2, kc.latent = 1;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    fa.cache = kv;
    assert_fails(mha_forward(m, &fa), MHA_ERR_UNSUPPORTED, "latent");
    mha_kv_cache_free(kv);
    mha_free(m);
    free(k), free(v), free(q), free(kr), free(vr), free(out), free(want);
    free(plain);
}

/*
 * Multi-head latent attention (DeepSeek's MLA), absorbed: 70 query heads
 * (runs of 64 and 6 in a decoding block) read one latent cache whose
 * keys are [c (16), k_rope (8)] and whose values are c, the keys' first
 * 16 elements, stored once.  Its step, with each head's output then
 * multiplied by W_uv, equals the naive attention (per-head keys [W_uk c,
 * k_rope] of 12 + 8 and values W_uv c of 10) within float rounding; a
 * latent f16 cache is bitwise a cache holding keys and values apart, on 1
 * and 2 threads, and so are its weights; it holds half the bytes; its
 * misuse is refused.
 */
/* q8 and q4: the storage types that quantise in blocks with a scale. */
static int quantised(mha_kv_dtype t)
{
    return t == MHA_KV_Q8 || t == MHA_KV_Q4;
}

static void test_latent(void **state)
{
    (void)state;
    enum { H = 70, R = 16, RO = 8, N = 12, DVN = 10, L = 1100, DK = R + RO };
    float *c = malloc((size_t)(L * DK) * 4);   /* [c, k_rope] per token */
    float *wuk = malloc((size_t)(H * N * R) * 4);
    float *wuv = malloc((size_t)(H * DVN * R) * 4);
    float *qn = malloc((size_t)(H * (N + RO)) * 4);   /* [q_nope, q_rope] */
    tu_fill(c, L * DK, 81, -1, 1);
    tu_fill(wuk, H * N * R, 82, -0.3f, 0.3f);
    tu_fill(wuv, H * DVN * R, 83, -0.3f, 0.3f);
    tu_fill(qn, H * (N + RO), 84, -1, 1);
    const float scale = (float)(1.0 / sqrt((double)(N + RO)));
    /* naive: every head its own keys and values */
    float *kn = malloc((size_t)(L * H * (N + RO)) * 4);
    float *vn = malloc((size_t)(L * H * DVN) * 4);
    for (int64_t j = 0; j < L; j++)
        for (int64_t h = 0; h < H; h++) {
            float *kr = kn + (j * H + h) * (N + RO);
            for (int64_t n = 0; n < N; n++) {
                double acc = 0.0;
                for (int64_t r = 0; r < R; r++)
                    acc += (double)wuk[(h * N + n) * R + r] * c[j * DK + r];
                kr[n] = (float)acc;
            }
            for (int64_t r = 0; r < RO; r++)
                kr[N + r] = c[j * DK + R + r];
            for (int64_t d = 0; d < DVN; d++) {
                double acc = 0.0;
                for (int64_t r = 0; r < R; r++)
                    acc += (double)wuv[(h * DVN + d) * R + r] * c[j * DK + r];
                vn[(j * H + h) * DVN + d] = (float)acc;
            }
        }
    float naive[H * DVN];
    mha_attention_args na = {0};
    na.batch = 1, na.num_heads = H, na.head_dim = N + RO, na.v_head_dim = DVN;
    na.q_len = 1, na.kv_len = L, na.q = qn, na.k = kn, na.v = vn;
    na.out = naive, na.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    assert_int_equal(mha_attention(&na), MHA_OK);
    /* absorbed: q' = [W_uk^T q_nope, q_rope] on the latent cache */
    float *qa = malloc((size_t)(H * DK) * 4);
    for (int64_t h = 0; h < H; h++) {
        for (int64_t r = 0; r < R; r++) {
            double acc = 0.0;
            for (int64_t n = 0; n < N; n++)
                acc += (double)wuk[(h * N + n) * R + r] * qn[h * (N + RO) + n];
            qa[h * DK + r] = (float)acc;
        }
        for (int64_t r = 0; r < RO; r++)
            qa[h * DK + R + r] = qn[h * (N + RO) + N + r];
    }
    const mha_kv_dtype dts[5] = {MHA_KV_F32, MHA_KV_F16, MHA_KV_BF16,
                                 MHA_KV_Q8, MHA_KV_Q4};
    float lat[H * R], apart[H * R];
    for (int t = 0; t < 5; t++) {
        mha_kv_cache_config kc = {1, 1, DK, L, dts[t], 0, 0, 0, 0, R, 1};
        mha_kv_cache *kv = NULL, *sep = NULL;
        assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
        assert_int_equal(mha_kv_cache_append(kv, 0, c, NULL, L), MHA_OK);
        mha_attention_decode_args d = {0};
        d.batch = 1, d.num_heads = H, d.head_dim = DK, d.q_len = 1;
        d.q = qa, d.out = lat, d.cache = kv, d.scale = scale;
        d.given = MHA_GIVEN_SCALE;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        if (dts[t] == MHA_KV_F32) {
            /* out (H x R floats) just below q in one buffer: disjoint,
             * taken; one float more of out over q: refused (out's extent
             * is its d_v wide rows, not q's) */
            float *buf = malloc((size_t)(H * R + H * DK) * 4);
            memcpy(buf + H * R, qa, (size_t)(H * DK) * 4);
            mha_attention_decode_args e = d;
            e.q = buf + H * R, e.out = buf;
            assert_int_equal(mha_attention_decode(&e), MHA_OK);
            assert_memory_equal(buf, lat, sizeof lat);
            e.out = buf + 1;
            assert_fails(mha_attention_decode(&e), MHA_ERR_INVALID_ARGUMENT,
                         "out overlaps q");
            free(buf);
        }
        if (dts[t] == MHA_KV_F32) {   /* o_h = W_uv o'_h: the naive one */
            double err = 0.0, mx = 0.0;
            for (int64_t h = 0; h < H; h++)
                for (int64_t dd = 0; dd < DVN; dd++) {
                    double acc = 0.0;
                    for (int64_t r = 0; r < R; r++)
                        acc += (double)wuv[(h * DVN + dd) * R + r] *
                               lat[h * R + r];
                    err = fmax(err, fabs(acc - naive[h * DVN + dd]));
                    mx = fmax(mx, fabs((double)naive[h * DVN + dd]));
                }
            /* (two float32 computations, sums of 1,100 terms) */
            if (!(err <= 1e-5 * (1.0 + mx)))
                fail_msg("absorbed decode differs from the naive by %.3g",
                         err);
        }
        /* the same values kept apart: the same bits, 1 and 2 threads */
        float *kr = malloc((size_t)(L * DK) * 4);
        float *vr = malloc((size_t)(L * R) * 4);
        assert_int_equal(mha_kv_cache_read(kv, 0, 0, L, kr, vr), MHA_OK);
        for (int64_t j = 0; j < L; j++)
            for (int64_t r = 0; r < R; r++)
                assert_true(vr[j * R + r] == kr[j * DK + r]);
        const int qmax = dts[t] == MHA_KV_Q8 ? 127 : 7;
        if (quantised(dts[t]))
            /* each key's block (DK <= 32) within half its step max|x| /
             * qmax (127 q8, 7 q4) */
            for (int64_t j = 0; j < L; j++) {
                double amax = 0.0;
                for (int64_t r = 0; r < DK; r++)
                    amax = fmax(amax, fabs((double)c[j * DK + r]));
                for (int64_t r = 0; r < DK; r++)
                    if (!(fabs((double)kr[j * DK + r] - c[j * DK + r]) <=
                          amax / (2.0 * qmax) * (1.0 + 1e-6)))
                        fail_msg("quantised latent key %lld, element %lld: %g "
                                 "read back for %g", (long long)j,
                                 (long long)r, (double)kr[j * DK + r],
                                 (double)c[j * DK + r]);
            }
        kc.latent = 0;
        if (quantised(dts[t]))   /* the floats it holds */
            kc.dtype = MHA_KV_F32;
        assert_int_equal(mha_kv_cache_create(&kc, &sep), MHA_OK);
        assert_int_equal(mha_kv_cache_append(sep, 0, kr, vr, L), MHA_OK);
        d.cache = sep, d.out = apart;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        for (int threads = 1; threads <= 2; threads++) {
            d.cache = kv, d.out = lat, d.num_threads = threads;
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
            assert_memory_equal(lat, apart, sizeof lat);
        }
        /* the weights on a latent cache (its rows gathered, not tiles):
         * the bits of the cache holding values apart, and in float32 the
         * naive attention's weights within rounding */
        float *wl = malloc((size_t)(H * L) * 4);
        float *wa = malloc((size_t)(H * L) * 4);
        d.need_weights = MHA_WEIGHTS_PER_HEAD;
        d.cache = kv, d.out = lat, d.attn_weights = wl;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        d.cache = sep, d.out = apart, d.attn_weights = wa;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        assert_memory_equal(wl, wa, (size_t)(H * L) * 4);
        assert_memory_equal(lat, apart, sizeof lat);
        if (dts[t] == MHA_KV_F32) {
            float *wn = malloc((size_t)(H * L) * 4);
            na.need_weights = MHA_WEIGHTS_PER_HEAD, na.attn_weights = wn;
            assert_int_equal(mha_attention(&na), MHA_OK);
            na.need_weights = MHA_WEIGHTS_NONE, na.attn_weights = NULL;
            double err = 0.0;
            for (int64_t i = 0; i < H * L; i++)
                err = fmax(err, fabs((double)wl[i] - wn[i]));
            /* weights <= 1 from scores of two float32 computations */
            if (!(err <= 1e-6))
                fail_msg("latent weights differ from the naive by %.3g",
                         err);
            free(wn);
        }
        d.need_weights = MHA_WEIGHTS_NONE, d.attn_weights = NULL;
        free(wl), free(wa);
        mha_kv_cache_usage u1, u2;
        assert_int_equal(mha_kv_cache_get_usage(kv, &u1), MHA_OK);
        assert_int_equal(mha_kv_cache_get_usage(sep, &u2), MHA_OK);
        if (quantised(dts[t]))   /* one plane against
                                                    two of f32 */
            assert_true(4 * u1.bytes_total < u2.bytes_total);
        else
            assert_int_equal(2 * u1.bytes_total, u2.bytes_total);
        /* misuse: values given, a module, a window, q8 */
        assert_fails(mha_kv_cache_append(kv, 0, c, c, 1),
                     MHA_ERR_INVALID_ARGUMENT, "v must be NULL");
        mha_kv_cache_free(kv);
        mha_kv_cache_free(sep);
        free(kr);
        free(vr);
    }
    mha_kv_cache_config bad = {1, 1, DK, 64, MHA_KV_F32, 0, 0, 0, 0, R, 1};
    mha_kv_cache *kv = NULL;
    bad.rotate = 1;
    assert_fails(mha_kv_cache_create(&bad, &kv), MHA_ERR_UNSUPPORTED,
                 "latent");
    bad.rotate = 0, bad.v_head_dim = DK + 2;
    assert_fails(mha_kv_cache_create(&bad, &kv), MHA_ERR_UNSUPPORTED,
                 "latent");
    assert_null(kv);
    free(c), free(wuk), free(wuv), free(qn), free(kn), free(vn), free(qa);
}

/*
 * A latent cache in pages of 64 (and of 16: a kernel's tile is then four
 * pages, widened page by page): filled 64 positions at a time across the
 * sequences (no sequence's pages side by side), a fork sharing the pages
 * and then diverging (copy on write of the shared last page), a
 * truncate.  After each, a decode step is the bits of a contiguous latent
 * cache holding the same tokens, on 1 and 2 threads; so is a ragged step,
 * each sequence's rows those of a cache of it alone, and with a shared
 * prefix within rounding; the pages hold half the bytes of a paged cache
 * keeping values apart.
 */
static void latent_paged(int64_t page)
{
    enum { B = 3, H = 6, R = 16, DK = 24, CAP = 320, N0 = 200, N1 = 130,
           OWN = 20 };
    float *keys = malloc((size_t)(B * CAP * DK) * 4);
    tu_fill(keys, B * CAP * DK, 101, -1, 1);
    mha_kv_cache_config kc = {B, 1, DK, CAP, MHA_KV_F16, 0, 0, 0, 0, R, 1};
    mha_kv_cache *flat = NULL, *paged = NULL, *apart = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &flat), MHA_OK);
    kc.page_size = page;
    assert_int_equal(mha_kv_cache_create(&kc, &paged), MHA_OK);
    const int64_t len[2] = {N0, N1};
    for (int64_t b = 0; b < 2; b++)
        assert_int_equal(mha_kv_cache_append(flat, b, keys + b * CAP * DK,
                                             NULL, len[b]),
                         MHA_OK);
    for (int64_t at = 0; at < N0; at += 64)   /* page by page, in turn */
        for (int64_t b = 0; b < 2; b++) {
            const int64_t n = len[b] - at < 64 ? len[b] - at : 64;
            if (n > 0)
                assert_int_equal(
                    mha_kv_cache_append(paged, b,
                                        keys + (b * CAP + at) * DK, NULL, n),
                    MHA_OK);
        }
    float q[B * H * DK], want[B * H * R], got[B * H * R];
    tu_fill(q, B * H * DK, 102, -1, 1);
    mha_attention_decode_args d = {0};
    d.batch = B, d.num_heads = H, d.head_dim = DK, d.q_len = 1, d.q = q;
    for (int step = 0; step < 3; step++) {
        if (step == 1) {   /* sequence 2: sequence 0's tokens, then its own */
            for (int i = 0; i < 2; i++) {
                mha_kv_cache *c = i ? paged : flat;
                assert_int_equal(mha_kv_cache_fork(c, 0, 2), MHA_OK);
                assert_int_equal(mha_kv_cache_append(
                                     c, 2, keys + 2 * CAP * DK, NULL, OWN),
                                 MHA_OK);
            }
        }
        if (step == 2)   /* a rollback of sequence 0 */
            for (int i = 0; i < 2; i++)
                assert_int_equal(mha_kv_cache_truncate(i ? paged : flat, 0,
                                                       150),
                                 MHA_OK);
        d.cache = flat, d.out = want, d.num_threads = 1;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        for (int threads = 1; threads <= 2; threads++) {
            d.cache = paged, d.out = got, d.num_threads = threads;
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
            assert_memory_equal(got, want, sizeof got);
        }
    }
    /* a ragged step (2, 0 and 3 new rows), on the pages and contiguous:
     * the same bits, and each sequence's rows those of a latent cache of
     * that sequence alone; with share_prefix (sequences 0 and 2 share
     * their first pages: one read of them, the two parts merged) within
     * a few roundings of the rows */
    int64_t q_start[B + 1] = {0, 2, 2, 5};
    float qr[5 * H * DK], o_pg[5 * H * R], o_fl[5 * H * R], o_sh[5 * H * R];
    float o1[3 * H * R];
    tu_fill(qr, 5 * H * DK, 103, -1, 1);
    mha_attention_decode_args rg = {0};
    rg.batch = B, rg.num_heads = H, rg.head_dim = DK, rg.q = qr;
    rg.q_start = q_start;
    rg.cache = paged, rg.out = o_pg;
    assert_int_equal(mha_attention_decode(&rg), MHA_OK);
    rg.cache = flat, rg.out = o_fl;
    assert_int_equal(mha_attention_decode(&rg), MHA_OK);
    assert_memory_equal(o_pg, o_fl, sizeof o_pg);
    float *kb = malloc((size_t)(CAP * DK) * 4);
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = q_start[b + 1] - q_start[b];
        const int64_t held = mha_kv_cache_length(paged, b);
        if (!n)
            continue;
        mha_kv_cache_config one = kc;
        one.batch = 1, one.page_size = 0;
        mha_kv_cache *alone = NULL;
        assert_int_equal(mha_kv_cache_create(&one, &alone), MHA_OK);
        assert_int_equal(mha_kv_cache_read(paged, b, 0, held, kb, NULL),
                         MHA_OK);
        assert_int_equal(mha_kv_cache_append(alone, 0, kb, NULL, held),
                         MHA_OK);
        mha_attention_decode_args s1 = {0};
        s1.batch = 1, s1.num_heads = H, s1.head_dim = DK, s1.q_len = n;
        s1.q = qr + q_start[b] * H * DK, s1.out = o1, s1.cache = alone;
        assert_int_equal(mha_attention_decode(&s1), MHA_OK);
        assert_memory_equal(o_pg + q_start[b] * H * R, o1,
                            (size_t)(n * H * R) * 4);
        mha_kv_cache_free(alone);
    }
    free(kb);
    rg.cache = paged, rg.out = o_sh, rg.share_prefix = 1;
    assert_int_equal(mha_attention_decode(&rg), MHA_OK);
    double worst = 0.0;
    for (int64_t i = 0; i < 5 * H * R; i++)
        worst = fmax(worst, fabs((double)o_sh[i] - o_pg[i]));
    /* outputs below 1 in size, merged in float64 from two float32 parts */
    if (!(worst <= 1e-5))
        fail_msg("the shared prefix's rows differ by %.3g", worst);
    mha_kv_cache_usage u_lat, u_apart;
    kc.latent = 0, kc.v_head_dim = 0;
    assert_int_equal(mha_kv_cache_create(&kc, &apart), MHA_OK);
    assert_int_equal(mha_kv_cache_get_usage(paged, &u_lat), MHA_OK);
    assert_int_equal(mha_kv_cache_get_usage(apart, &u_apart), MHA_OK);
    assert_int_equal(2 * u_lat.bytes_total, u_apart.bytes_total);
    mha_kv_cache_free(flat);
    mha_kv_cache_free(paged);
    mha_kv_cache_free(apart);
    free(keys);
}

static void test_latent_paged(void **state)
{
    (void)state;
    latent_paged(64);
    latent_paged(16);
}

static void test_refusals(void **state)
{
    (void)state;
    prob p;
    prob_init(&p, &CASES[0], 9);
    p.a.v_head_dim = -3;
    assert_fails(mha_attention(&p.a), MHA_ERR_SHAPE, "v_head_dim");
    p.a.v_head_dim = CASES[0].dv;
    /* a cache whose values have another width than the call says */
    mha_kv_cache_config kc = {2, 4, 24, 80, MHA_KV_F32, 0, 0, 0, 0, 20, 0};
    mha_kv_cache *kv = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
    mha_attention_args a = p.a;
    a.k = a.v = NULL;
    a.kv_len = 0;
    a.cache = kv;
    assert_fails(mha_attention(&a), MHA_ERR_SHAPE, "the cache's values");
    mha_kv_cache_free(kv);
    /* caches: a negative width, rotation, odd q4 values; a module */
    kc.v_head_dim = -1;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "v_head_dim");
    kc.v_head_dim = 16, kc.rotate = 1;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_UNSUPPORTED,
                 "rotated");
    kc.rotate = 0, kc.dtype = MHA_KV_Q4, kc.v_head_dim = 15;
    assert_fails(mha_kv_cache_create(&kc, &kv), MHA_ERR_INVALID_ARGUMENT,
                 "even");
    assert_null(kv);
    prob_free(&p);
}

/* bfloat16 bits of x, rounded to nearest even (x finite), and back. */
static uint16_t to_bf16(float x)
{
    uint32_t u;
    memcpy(&u, &x, 4);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
static float of_bf16(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

/* n random bf16 numbers in [-1, 1), and the floats they are. */
static void fill_bf16(uint16_t *h, float *f, int64_t n, uint64_t seed)
{
    tu_fill(f, n, seed, -1, 1);
    for (int64_t i = 0; i < n; i++) {
        h[i] = to_bf16(f[i]);
        f[i] = of_bf16(h[i]);
    }
}

/* out16 (n values, then a canary of 8) against the float32 result on the
 * same numbers, rounded once: the 16-bit call widens, runs the float32
 * attention and rounds, so every bit must agree. */
static void expect_rounded(const uint16_t *out16, const float *want,
                           int64_t n, const char *what)
{
    for (int64_t i = 0; i < n; i++)
        if (out16[i] != to_bf16(want[i]))
            fail_msg("%s: out16[%lld] = 0x%04x, the float32 result rounded "
                     "0x%04x", what, (long long)i, out16[i],
                     to_bf16(want[i]));
    for (int i = 0; i < 8; i++)
        if (out16[n + i] != 0xABCD)
            fail_msg("%s: out16 written %d past its d_v-wide rows", what,
                     i + 1);
}

/*
 * 16-bit data with values of another width: the forward on given k and v
 * and the decoding on a cache of d_v-wide values and on a latent cache
 * (each query's output d_v wide) give the float32 result rounded, and
 * write nothing past out16's d_v-wide rows; the 16-bit backward gives
 * the float32 gradients rounded.
 */
static void test_half_widths(void **state)
{
    (void)state;
    enum { B = 2, H = 4, HKV = 2, DH = 24, DV = 16, LQ = 5, LK = 70 };
    enum { NQ = B * LQ * H * DH, NK = B * LK * HKV * DH,
           NV = B * LK * HKV * DV, NO = B * LQ * H * DV };
    static uint16_t q16[NQ], k16[NK], v16[NV], out16[NO + 8];
    static float q[NQ], k[NK], v[NV], out[NO];
    fill_bf16(q16, q, NQ, 91);
    fill_bf16(k16, k, NK, 92);
    fill_bf16(v16, v, NV, 93);
    mha_attention_args a = {0};
    a.batch = B, a.num_heads = H, a.num_kv_heads = HKV, a.head_dim = DH;
    a.v_head_dim = DV, a.q_len = LQ, a.kv_len = LK;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a.q = q, a.k = k, a.v = v, a.out = out;
    assert_int_equal(mha_attention(&a), MHA_OK);
    mha_attention_args h = a;
    h.dtype = MHA_DTYPE_BF16;
    h.q = h.k = h.v = NULL, h.out = NULL;
    h.q16 = q16, h.k16 = k16, h.v16 = v16, h.out16 = out16;
    for (int i = 0; i < 8; i++)
        out16[NO + i] = 0xABCD;
    assert_int_equal(mha_attention(&h), MHA_OK);
    expect_rounded(out16, out, NO, "forward");
    /* the backward on 16-bit data: the float32 backward on the same
     * numbers, each gradient rounded once (it widens too), d_v-wide
     * grad_out and grad_v, nothing written past them (the float32
     * backward itself is checked against float64 in test_gradients) */
    static uint16_t go16[NO], gq[NQ + 8], gk[NK + 8], gv[NV + 8];
    static float go[NO], fq[NQ], fk[NK], fv[NV];
    fill_bf16(go16, go, NO, 94);
    const mha_attention_grads fg = {.grad_out = go, .grad_q = fq,
                                    .grad_k = fk, .grad_v = fv};
    assert_int_equal(mha_attention_backward(&a, &fg), MHA_OK);
    for (int i = 0; i < 8; i++)
        gq[NQ + i] = gk[NK + i] = gv[NV + i] = 0xABCD;
    const mha_attention_grads16 g = {go16, gq, gk, gv, NULL};
    h.out16 = NULL;   /* (the forward's out and lse not given: recomputed) */
    assert_int_equal(mha_attention_backward16(&h, &g), MHA_OK);
    expect_rounded(gq, fq, NQ, "16-bit backward, grad_q");
    expect_rounded(gk, fk, NK, "16-bit backward, grad_k");
    expect_rounded(gv, fv, NV, "16-bit backward, grad_v (d_v wide)");
    h.out16 = out16;

    /* decoding: a cache of d_v-wide values, then a latent one (values
     * the keys' first d_v elements) */
    for (int latent = 0; latent <= 1; latent++) {
        mha_kv_cache_config kc = {B, HKV, DH, LK, MHA_KV_F32, 0, 0, 0, 0,
                                  DV, latent};
        if (latent)
            kc.batch = 1, kc.num_kv_heads = 1;
        mha_kv_cache *kv = NULL;
        assert_int_equal(mha_kv_cache_create(&kc, &kv), MHA_OK);
        const int64_t nb = kc.batch, g_heads = kc.num_kv_heads;
        for (int64_t b = 0; b < nb; b++)
            assert_int_equal(mha_kv_cache_append(
                                 kv, b, k + b * LK * g_heads * DH,
                                 latent ? NULL : v + b * LK * g_heads * DV,
                                 LK),
                             MHA_OK);
        mha_attention_decode_args d = {0};
        d.batch = nb, d.num_heads = H, d.head_dim = DH, d.q_len = LQ;
        d.q = q, d.out = out, d.cache = kv;
        assert_int_equal(mha_attention_decode(&d), MHA_OK);
        mha_attention_decode_args d16 = d;
        d16.dtype = MHA_DTYPE_BF16;
        d16.q = NULL, d16.out = NULL, d16.q16 = q16, d16.out16 = out16;
        const int64_t no = nb * LQ * H * DV;
        for (int i = 0; i < 8; i++)
            out16[no + i] = 0xABCD;
        assert_int_equal(mha_attention_decode(&d16), MHA_OK);
        expect_rounded(out16, out, no, latent ? "latent decode"
                                              : "decode on d_v values");
        mha_kv_cache_free(kv);
    }
}

/*
 * A q8 (and a q4) latent cache in pages of 64 (and of 32), filled 64
 * positions at a time across two sequences: each decode step bitwise the
 * contiguous latent cache's of that dtype, on 1 and 2 threads.
 */
static void latent_paged_quantised(mha_kv_dtype dtype, int64_t page)
{
    enum { B = 2, H = 6, R = 16, DK = 40, CAP = 300, N = 250 };
    float *keys = malloc((size_t)(B * CAP * DK) * 4);
    tu_fill(keys, B * CAP * DK, 131, -1, 1);
    mha_kv_cache_config kc = {B, 1, DK, CAP, dtype, 0, 0, 0, 0, R, 1};
    mha_kv_cache *flat = NULL, *paged = NULL;
    assert_int_equal(mha_kv_cache_create(&kc, &flat), MHA_OK);
    kc.page_size = page;
    assert_int_equal(mha_kv_cache_create(&kc, &paged), MHA_OK);
    float q[B * H * DK], o1[B * H * R], o2[B * H * R];
    for (int64_t at = 0; at < N; at += 64) {
        for (int64_t b = 0; b < B; b++) {
            const int64_t n = N - at < 64 ? N - at : 64;
            const float *k = keys + (b * CAP + at) * DK;
            assert_int_equal(mha_kv_cache_append(flat, b, k, NULL, n),
                             MHA_OK);
            assert_int_equal(mha_kv_cache_append(paged, b, k, NULL, n),
                             MHA_OK);
        }
        tu_fill(q, B * H * DK, 132 + (uint64_t)at, -1, 1);
        for (int threads = 1; threads <= 2; threads++) {
            mha_attention_decode_args d = {0};
            d.batch = B, d.num_heads = H, d.head_dim = DK, d.q_len = 1;
            d.q = q, d.out = o1, d.cache = flat, d.num_threads = threads;
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
            d.out = o2, d.cache = paged;
            assert_int_equal(mha_attention_decode(&d), MHA_OK);
            if (memcmp(o1, o2, sizeof o1))
                fail_msg("latent pages, dtype %d, %lld tokens, %d threads: "
                         "not the contiguous cache's bits", (int)dtype,
                         (long long)(at + 64), threads);
        }
    }
    mha_kv_cache_free(flat);
    mha_kv_cache_free(paged);
    free(keys);
}

static void test_latent_q8_paged(void **state)
{
    (void)state;
    latent_paged_quantised(MHA_KV_Q8, 64);
    latent_paged_quantised(MHA_KV_Q4, 64);
    latent_paged_quantised(MHA_KV_Q8, 32);
    latent_paged_quantised(MHA_KV_Q4, 32);
}

/*
 * A latent cache with a sliding window (a ring of slots): each step's
 * decode of 1 and 3 rows bitwise that of a window cache holding the same
 * keys and, apart, their first d_v elements as values, as the ring wraps
 * many times (f32, f16, bf16; 1 and 2 threads).
 */
static void test_latent_window(void **state)
{
    (void)state;
    enum { H = 5, DK = 24, DV = 16, W = 45, STEPS = 40 };
    for (int t = 0; t < 3; t++)
        for (int64_t lq = 1; lq <= 3; lq += 2) {
            const mha_kv_dtype dt = t == 0   ? MHA_KV_F32
                                    : t == 1 ? MHA_KV_F16
                                             : MHA_KV_BF16;
            const int64_t cap = W + lq - 1;
            mha_kv_cache_config lc = {1, 1, DK, cap, dt, W, 0, 0, 0, DV, 1};
            mha_kv_cache_config ac = lc;
            ac.latent = 0;
            mha_kv_cache *lat = NULL, *apart = NULL;
            assert_int_equal(mha_kv_cache_create(&lc, &lat), MHA_OK);
            assert_int_equal(mha_kv_cache_create(&ac, &apart), MHA_OK);
            float k[3 * DK], v[3 * DV], q[3 * H * DK];
            float o1[3 * H * DV], o2[3 * H * DV], o3[3 * H * DV];
            uint64_t seed = 300 + (uint64_t)(10 * t + lq);
            for (int step = 0; step < STEPS; step++) {
                /* a prompt of 20 first, then lq tokens a step */
                const int64_t n = step ? lq : 20;
                for (int64_t x = 0; x < n; x += lq) {
                    const int64_t m = n - x < lq ? n - x : lq;
                    tu_fill(k, m * DK, seed++, -1, 1);
                    for (int64_t j = 0; j < m; j++)
                        memcpy(v + j * DV, k + j * DK, DV * sizeof *v);
                    assert_int_equal(mha_kv_cache_append(lat, 0, k, NULL, m),
                                     MHA_OK);
                    assert_int_equal(mha_kv_cache_append(apart, 0, k, v, m),
                                     MHA_OK);
                }
                tu_fill(q, lq * H * DK, seed++, -1, 1);
                mha_attention_decode_args d = {0};
                d.batch = 1, d.num_heads = H, d.head_dim = DK, d.q_len = lq;
                d.q = q, d.out = o1, d.cache = lat, d.num_threads = 1;
                assert_int_equal(mha_attention_decode(&d), MHA_OK);
                d.out = o3, d.num_threads = 2;
                assert_int_equal(mha_attention_decode(&d), MHA_OK);
                d.out = o2, d.cache = apart, d.num_threads = 1;
                assert_int_equal(mha_attention_decode(&d), MHA_OK);
                const size_t bytes = (size_t)(lq * H * DV) * sizeof *o1;
                if (memcmp(o1, o2, bytes) || memcmp(o1, o3, bytes))
                    fail_msg("latent window cache, dtype %d, %lld rows, step "
                             "%d: not the bits of the cache keeping values "
                             "apart (or of 2 threads)", (int)dt,
                             (long long)lq, step);
            }
            mha_kv_cache_free(lat);
            mha_kv_cache_free(apart);
        }
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_forward),
        cmocka_unit_test(test_equal_widths),
        cmocka_unit_test(test_threads_and_plans),
        cmocka_unit_test(test_gradients),
        cmocka_unit_test(test_cache),
        cmocka_unit_test(test_latent),
        cmocka_unit_test(test_latent_paged),
        cmocka_unit_test(test_latent_window),
        cmocka_unit_test(test_latent_q8_paged),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_half_widths),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
