/*
 * test_attention_part.c -- mha_attention_backward_part: the keys of a
 * problem cut into parts, each part's forward (with its lse) merged by
 * mha_attention_merge, each part's backward from the merged lse and out.
 * The shares of dq summed over the parts, and the parts' dk and dv side
 * by side, must equal the backward of the whole problem within the
 * suite's gradient bound (1e-4 (1 + max |grad|), the bound the whole
 * problem's backward meets against central differences in
 * test_attention_backward.c).  Cases: plain, GQA, key lengths with a
 * batch that has no key (zero gradients), causal (the first part
 * top-left, the later ones bottom-right: the split of a causal row),
 * three parts, a softcap.  Then misuse: NULL lse or out, a NaN lse,
 * sinks.  Every tier runs it (CTest, MHA_ISA).
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

#include "testutil.h"

typedef struct pcase {
    const char *name;
    int64_t B, H, Hkv, dh, L;
    int causal, lengths, n_parts;
    float softcap;
    int offset;                 /* parts placed by q_offset (= -k0) */
    int alibi;
    int64_t wl, wr;             /* a window, unless both are 0 */
} pcase;

static const pcase CASES[] = {
    {"plain, two parts", 2, 2, 2, 8, 37, 0, 0, 2, 0.0f, 0, 0, 0, 0},
    {"GQA 4/2, three parts", 1, 4, 2, 16, 70, 0, 0, 3, 0.0f, 0, 0, 0, 0},
    {"key lengths (a batch with no key)", 2, 2, 1, 8, 29, 0, 1, 2, 0.0f, 0,
     0, 0, 0},
    {"causal, two parts", 2, 3, 3, 8, 67, 1, 0, 2, 0.0f, 0, 0, 0, 0},
    {"causal GQA 6/2, three parts, lengths", 2, 6, 2, 4, 40, 1, 1, 3, 0.0f,
     0, 0, 0, 0},
    {"softcap, two parts", 1, 2, 2, 8, 33, 0, 0, 2, 5.0f, 0, 0, 0, 0},
    /* q_offset: every part bottom-right at its keys' true distance */
    {"q_offset: causal, three parts", 2, 2, 2, 8, 70, 1, 1, 3, 0.0f, 1, 0,
     0, 0},
    {"q_offset: ALiBi, three parts", 1, 4, 2, 8, 70, 0, 0, 3, 0.0f, 1, 1, 0,
     0},
    {"q_offset: causal ALiBi + window (20, 0)", 2, 4, 4, 8, 90, 1, 1, 3,
     0.0f, 1, 1, 20, 0},
    {"q_offset: window (7, 5), GQA, lengths", 2, 4, 1, 8, 61, 0, 1, 2, 0.0f,
     1, 0, 7, 5},
};

/* Copies keys k0 .. k1-1 of every batch: x (B, L, w) -> (B, k1 - k0, w). */
static float *slice(const float *x, int64_t B, int64_t L, int64_t w,
                    int64_t k0, int64_t k1)
{
    float *y = malloc((size_t)(B * (k1 - k0) * w) * sizeof *y);
    for (int64_t b = 0; b < B; b++)
        memcpy(y + b * (k1 - k0) * w, x + (b * L + k0) * w,
               (size_t)((k1 - k0) * w) * sizeof *y);
    return y;
}

static void expect_close(const char *name, const char *what, const float *got,
                         const float *want, int64_t n)
{
    double mx = 0.0, err = 0.0;
    for (int64_t e = 0; e < n; e++)
        mx = fabs(want[e]) > mx ? fabs(want[e]) : mx;
    for (int64_t e = 0; e < n; e++) {
        const double d = fabs((double)got[e] - want[e]);
        err = d > err || d != d ? d : err;
    }
    if (!(err <= 1e-4 * (1.0 + mx)))
        fail_msg("%s: %s max error %.3g (max |grad| %.3g)", name, what, err,
                 mx);
}

static void test_parts(void **state)
{
    (void)state;
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++) {
        const pcase *c = &CASES[t];
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh, L = c->L;
        const int64_t nq = c->B * L * E, nk = c->B * L * Ekv;
        const int64_t rows = c->B * c->H * L;
        float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
        float *v = malloc((size_t)nk * 4), *g = malloc((size_t)nq * 4);
        float *out = malloc((size_t)nq * 4), *dq = malloc((size_t)nq * 4);
        float *dk = malloc((size_t)nk * 4), *dv = malloc((size_t)nk * 4);
        float *lse = malloc((size_t)rows * 4);
        tu_fill(q, nq, 10 * t + 1, -1.5f, 1.5f);
        tu_fill(k, nk, 10 * t + 2, -1.5f, 1.5f);
        tu_fill(v, nk, 10 * t + 3, -1.5f, 1.5f);
        tu_fill(g, nq, 10 * t + 4, -1, 1);
        const int64_t lens[2] = {L - 7, 0};

        mha_attention_args a = {0};
        a.batch = c->B;
        a.num_heads = c->H;
        a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh;
        a.q_len = L;
        a.kv_len = L;
        a.q = q;
        a.k = k;
        a.v = v;
        a.causal = c->causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
        a.key_lengths = c->lengths ? lens : NULL;
        a.mods.softcap = c->softcap;
        a.mods.alibi = c->alibi;
        a.mods.window = c->wl || c->wr;
        a.mods.window_left = c->wl;
        a.mods.window_right = c->wr;
        a.out = out;
        a.lse = lse;
        const mha_attention_grads whole = {g, dq, dk, dv, NULL};
        if (mha_attention(&a) != MHA_OK ||
            mha_attention_backward(&a, &whole) != MHA_OK)
            fail_msg("%s: %s", c->name, mha_last_error());

        /* The parts: keys [k0, k1), each a problem of its own. */
        const int P = c->n_parts;
        mha_attention_part parts[3];
        float *pk[3], *pv[3], *po[3], *pl[3], *pdq[3], *pdk[3], *pdv[3];
        int64_t plen[3][2], kb[4];
        for (int p = 0; p <= P; p++)
            kb[p] = L * p / P;
        mha_attention_args pa[3];
        for (int p = 0; p < P; p++) {
            const int64_t n = kb[p + 1] - kb[p];
            pk[p] = slice(k, c->B, L, Ekv, kb[p], kb[p + 1]);
            pv[p] = slice(v, c->B, L, Ekv, kb[p], kb[p + 1]);
            po[p] = malloc((size_t)nq * 4);
            pl[p] = malloc((size_t)rows * 4);
            pdq[p] = malloc((size_t)nq * 4);
            pdk[p] = malloc((size_t)(c->B * n * Ekv) * 4);
            pdv[p] = malloc((size_t)(c->B * n * Ekv) * 4);
            for (int64_t b = 0; b < c->B; b++) {
                const int64_t x = lens[b] - kb[p];
                plen[p][b] = x < 0 ? 0 : x > n ? n : x;
            }
            pa[p] = a;
            pa[p].kv_len = n;
            pa[p].k = pk[p];
            pa[p].v = pv[p];
            pa[p].key_lengths = c->lengths ? plen[p] : NULL;
            /* Causal: key kb[p] + j is visible from row i iff
             * j <= i - kb[p]: top-left for the first part (kb = 0),
             * bottom-right for the last (kb[p] = L - n). */
            pa[p].causal = !c->causal ? MHA_CAUSAL_NONE
                           : p == 0   ? MHA_CAUSAL_TOP_LEFT
                                      : MHA_CAUSAL_BOTTOM_RIGHT;
            if (c->offset) {
                /* queries at 0 .. L-1, keys at kb[p] ..: q_offset -kb[p] */
                pa[p].given |= MHA_GIVEN_Q_OFFSET;
                pa[p].q_offset = -kb[p];
                if (c->causal)
                    pa[p].causal = MHA_CAUSAL_BOTTOM_RIGHT;
            }
            pa[p].out = po[p];
            pa[p].lse = pl[p];
            parts[p] = (mha_attention_part){po[p], pl[p]};
        }
        /* A middle part's edge j <= i - kb[1] is bottom-right only for
         * keys kb[1] .. L - 1: so with causal the middle part is given
         * those keys, cut at kb[2] - kb[1] by key_lengths. */
        if (c->causal && P == 3 && !c->offset) {
            const int64_t n = L - kb[1];
            free(pk[1]);
            free(pv[1]);
            free(pdk[1]);
            free(pdv[1]);
            pk[1] = slice(k, c->B, L, Ekv, kb[1], L);
            pv[1] = slice(v, c->B, L, Ekv, kb[1], L);
            pdk[1] = malloc((size_t)(c->B * n * Ekv) * 4);
            pdv[1] = malloc((size_t)(c->B * n * Ekv) * 4);
            for (int64_t b = 0; b < c->B; b++) {
                const int64_t cut = kb[2] - kb[1];
                const int64_t x = c->lengths ? lens[b] - kb[1] : n;
                plen[1][b] = x < 0 ? 0 : x > cut ? cut : x;
            }
            pa[1].kv_len = n;
            pa[1].k = pk[1];
            pa[1].v = pv[1];
            pa[1].key_lengths = plen[1];
        }
        for (int p = 0; p < P; p++)
            if (mha_attention(&pa[p]) != MHA_OK)
                fail_msg("%s: part %d: %s", c->name, p, mha_last_error());
        float *mout = malloc((size_t)nq * 4), *mlse = malloc((size_t)rows * 4);
        assert_int_equal(mha_attention_merge(parts, P, c->B, c->H, c->dh, L,
                                             mout, mlse), MHA_OK);
        expect_close(c->name, "merged out", mout, out, nq);
        for (int64_t r = 0; r < rows; r++)
            assert_true(lse[r] == -INFINITY ? mlse[r] == -INFINITY
                                            : fabsf(mlse[r] - lse[r]) <=
                                                  1e-5f * (1 + fabsf(lse[r])));

        float *sdq = calloc((size_t)nq, 4), *cdk = malloc((size_t)nk * 4);
        float *cdv = malloc((size_t)nk * 4);
        for (int p = 0; p < P; p++) {
            const mha_attention_grads pg = {g, pdq[p], pdk[p], pdv[p], NULL};
            if (mha_attention_backward_part(&pa[p], mlse, mout, &pg) != MHA_OK)
                fail_msg("%s: part %d backward: %s", c->name, p,
                         mha_last_error());
            for (int64_t x = 0; x < nq; x++)
                sdq[x] += pdq[p][x];
            const int64_t n = kb[p + 1] - kb[p], ld = pa[p].kv_len;
            for (int64_t b = 0; b < c->B; b++) {
                memcpy(cdk + (b * L + kb[p]) * Ekv, pdk[p] + b * ld * Ekv,
                       (size_t)(n * Ekv) * 4);
                memcpy(cdv + (b * L + kb[p]) * Ekv, pdv[p] + b * ld * Ekv,
                       (size_t)(n * Ekv) * 4);
            }
        }
        expect_close(c->name, "sum of parts' dq", sdq, dq, nq);
        expect_close(c->name, "parts' dk", cdk, dk, nk);
        expect_close(c->name, "parts' dv", cdv, dv, nk);
        if (c->lengths)   /* batch 1 has no key: zero gradients */
            for (int64_t x = L * E; x < nq; x++)
                assert_true(sdq[x] == 0.0f);
        /* A second run gives the same bits. */
        {
            float *again = malloc((size_t)nq * 4);
            const mha_attention_grads pg = {g, again, pdk[0], pdv[0], NULL};
            assert_int_equal(mha_attention_backward_part(&pa[0], mlse, mout,
                                                         &pg), MHA_OK);
            assert_memory_equal(again, pdq[0], (size_t)nq * 4);
            free(again);
        }
        for (int p = 0; p < P; p++) {
            free(pk[p]); free(pv[p]); free(po[p]); free(pl[p]);
            free(pdq[p]); free(pdk[p]); free(pdv[p]);
        }
        free(mout); free(mlse); free(sdq); free(cdk); free(cdv);
        free(q); free(k); free(v); free(g); free(out); free(dq); free(dk);
        free(dv); free(lse);
    }
}

static void test_misuse(void **state)
{
    (void)state;
    enum { B = 1, H = 2, DH = 4, L = 5 };
    float q[B * L * H * DH], k[B * L * H * DH], v[B * L * H * DH];
    float g[B * L * H * DH], out[B * L * H * DH], lse[B * H * L];
    float dq[B * L * H * DH], dk[B * L * H * DH], dv[B * L * H * DH];
    const float sinks[H] = {0.5f, -0.5f};
    tu_fill(q, B * L * H * DH, 1, -1, 1);
    tu_fill(k, B * L * H * DH, 2, -1, 1);
    tu_fill(v, B * L * H * DH, 3, -1, 1);
    tu_fill(g, B * L * H * DH, 4, -1, 1);
    mha_attention_args a = {0};
    a.batch = B;
    a.num_heads = H;
    a.head_dim = DH;
    a.q_len = L;
    a.q = q;
    a.k = k;
    a.v = v;
    a.out = out;
    a.lse = lse;
    assert_int_equal(mha_attention(&a), MHA_OK);
    const mha_attention_grads gr = {g, dq, dk, dv, NULL};
    assert_int_equal(mha_attention_backward_part(&a, NULL, out, &gr),
                     MHA_ERR_NULL_POINTER);
    assert_non_null(strstr(mha_last_error(), "lse"));
    assert_int_equal(mha_attention_backward_part(&a, lse, NULL, &gr),
                     MHA_ERR_NULL_POINTER);
    assert_non_null(strstr(mha_last_error(), "out"));
    float bad[B * H * L];
    memcpy(bad, lse, sizeof bad);
    bad[3] = NAN;
    assert_int_equal(mha_attention_backward_part(&a, bad, out, &gr),
                     MHA_ERR_NON_FINITE);
    assert_non_null(strstr(mha_last_error(), "lse[3] is NaN"));
    mha_attention_args s = a;
    s.sinks = sinks;
    assert_int_equal(mha_attention_backward_part(&s, lse, out, &gr),
                     MHA_ERR_UNSUPPORTED);
    assert_non_null(strstr(mha_last_error(), "sinks"));
    /* An output overlapping lse is refused. */
    const mha_attention_grads ov = {g, dq, (float *)lse, dv, NULL};
    assert_int_equal(mha_attention_backward_part(&a, lse, out, &ov),
                     MHA_ERR_INVALID_ARGUMENT);
    /* One part = the whole problem: the plain backward's bits. */
    float dq2[B * L * H * DH], dk2[B * L * H * DH], dv2[B * L * H * DH];
    const mha_attention_grads g2 = {g, dq2, dk2, dv2, NULL};
    assert_int_equal(mha_attention_backward_part(&a, lse, out, &gr), MHA_OK);
    assert_int_equal(mha_attention_backward(&a, &g2), MHA_OK);
    for (int x = 0; x < B * L * H * DH; x++) {
        assert_true(fabsf(dq[x] - dq2[x]) <= 1e-5f);
        assert_true(fabsf(dk[x] - dk2[x]) <= 1e-5f);
        assert_true(fabsf(dv[x] - dv2[x]) <= 1e-5f);
    }
}

int main(void)
{
    if (tu_tier_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(tu_test_tier),
        cmocka_unit_test(test_parts),
        cmocka_unit_test(test_misuse),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
