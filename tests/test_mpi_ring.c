/*
 * test_mpi_ring.c -- libmha_mpi's ring attention, run by CTest under
 * `mpirun -np P` (P = 1, 2, 3, 4; tests/CMakeLists.txt).  Every rank
 * builds the whole problem from fixed seeds, takes its shard
 * (mha_shard_of), runs the ring forward and backward, and checks its rows:
 *
 *   - out and lse against a float64 attention written here from the
 *     definition, within the suite's bound (ref_tolerance: twice the error
 *     of the same code in naive float32, plus 1e-6 (1 + max |ref|)); dq,
 *     dk, dv against the float64 analytic gradients within the suite's
 *     gradient bound, 1e-4 (1 + max |grad|);
 *   - against the single-process mha_attention / mha_attention_backward
 *     of the whole problem, within the same bounds;
 *   - a second run, and a run on another thread count, bitwise equal;
 *   - the messages and bytes each rank sent: P - 1 K/V blocks forward, of
 *     the sizes of the shards they carry; backward P - 1 K/V blocks and P
 *     gradient blocks;
 *   - cases: contiguous and zig-zag, causal and not, lengths that do not
 *     divide by P or 2P (and shorter than 2P: empty pieces), GQA, key
 *     lengths (a batch whose keys are all padding), a softcap, ALiBi, a
 *     window, and all three; values of another head width (d_v above and
 *     below d_h); chunks (attention_chunk) that cut the shards, with a
 *     window, ALiBi and d_v, and one wider than the sequence;
 *   - the module across ranks (mha_ring_forward: ring and Ulysses, with
 *     and without RoPE, chunks with it) against the float64 reference
 *     module forward;
 *   - mismatches refused on all ranks with the same status and message:
 *     one rank with another num_heads, another split, causal, scale,
 *     attention_chunk, v_head_dim; one rank with a NULL q (its message,
 *     on every rank); a negative v_head_dim or attention_chunk.
 *
 * `test_mpi_ring kill`: rank 1 kills itself (SIGKILL) before the ring; the
 * others call it.  The test (tests/mpi_kill_test.sh) passes when mpirun
 * ends non-zero within a bounded time.
 *
 * A failure prints "rank R: ..." and the program exits 1 on every rank.
 */
#include "mha_mpi.h"

#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ref.h"
#include "testutil.h"

static int g_rank, g_P, g_failed;

#define CHECK(cond, ...)                                       \
    do {                                                       \
        if (!(cond)) {                                         \
            fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank,   \
                    __FILE__, __LINE__);                       \
            fprintf(stderr, __VA_ARGS__);                      \
            fprintf(stderr, "\n");                             \
            g_failed = 1;                                      \
        }                                                      \
    } while (0)

typedef struct tcase {
    const char *name;
    int64_t B, H, Hkv, dh, L;
    int causal, lengths;
    float softcap;
    int alibi;
    int64_t wl, wr;    /* a window unless both are 0; -1: unbounded */
    int64_t dv;        /* the values' head width, 0: dh */
    int64_t chunk;     /* attention_chunk, 0: none */
} tcase;

/* The values' head width of a case, and the rows' widths of v and out. */
static int64_t dv_of(const tcase *c) { return c->dv ? c->dv : c->dh; }

static const tcase CASES[] = {
    {"plain", 2, 2, 2, 8, 37, 0, 0, 0.0f, 0, 0, 0, 0, 0},
    {"GQA 4/2, key lengths", 2, 4, 2, 8, 29, 0, 1, 0.0f, 0, 0, 0, 0, 0},
    {"MQA 3/1", 1, 3, 1, 16, 64, 0, 0, 0.0f, 0, 0, 0, 0, 0},
    {"softcap", 1, 2, 2, 8, 19, 0, 0, 4.0f, 0, 0, 0, 0, 0},
    {"short: L = 5 (empty pieces)", 2, 2, 1, 4, 5, 0, 1, 0.0f, 0, 0, 0, 0, 0},
    {"long: L = 301 (pieces of several tiles)", 1, 2, 2, 32, 301, 0, 1, 0.0f,
     0, 0, 0, 0, 0},
    {"12 heads, 6 K/V heads (Ulysses for every P)", 1, 12, 6, 4, 23, 0, 1,
     0.0f, 0, 0, 0, 0, 0},
    {"ALiBi, 4 heads, key lengths", 2, 4, 4, 8, 41, 0, 1, 0.0f, 1, 0, 0, 0, 0},
    {"window (9, 3), GQA 4/2", 1, 4, 2, 8, 53, 0, 0, 0.0f, 0, 9, 3, 0, 0},
    {"ALiBi + window (6, -1) + softcap", 1, 4, 4, 8, 47, 0, 0, 3.0f, 1, 6,
     -1, 0, 0},
    {"d_v 12 != d_h 8, GQA 4/2, key lengths", 2, 4, 2, 8, 31, 0, 1, 0.0f, 0,
     0, 0, 12, 0},
    {"d_v 4 < d_h 16, MQA 2/1", 1, 2, 1, 16, 26, 0, 0, 0.0f, 0, 0, 0, 4, 0},
    {"chunks of 7, GQA 4/2, key lengths", 2, 4, 2, 8, 45, 0, 1, 0.0f, 0, 0,
     0, 0, 7},
    {"chunks of 16 + window (5, 2) + ALiBi + d_v 6", 1, 4, 4, 8, 61, 0, 0,
     0.0f, 1, 5, 2, 6, 16},
    {"chunks of 50 (past every shard)", 1, 2, 2, 8, 37, 0, 0, 0.0f, 0, 0, 0,
     0, 50},
};

/* The ALiBi slopes of the test's heads (mha_alibi_slopes is checked
 * against the paper's code in test_modifiers). */
static double slope_of(const tcase *c, int64_t h)
{
    float s[16];
    mha_alibi_slopes(c->H, s);
    return s[h];
}

/* Do the window and the chunks leave key j to query i? */
static int in_window(const tcase *c, int64_t i, int64_t j)
{
    if (c->chunk && i / c->chunk != j / c->chunk)
        return 0;
    if (!c->wl && !c->wr)
        return 1;
    return (c->wl < 0 || j >= i - c->wl) && (c->wr < 0 || j <= i + c->wr);
}

/* ---- the float64 reference (and its naive float32 twin) ----------------- */

/* Is key j visible from query i of batch b? */
static int visible(const int64_t *len, int64_t b, int64_t i,
                   int64_t j, int causal)
{
    if (causal && j > i)
        return 0;
    if (len && j >= len[b])
        return 0;
    return 1;
}

/* out (B, L, E), lse (B, H, L) in REAL; the whole problem. */
#define REF_FORWARD(NAME, REAL, EXP, LOG, TANH)                                \
    static void NAME(const tcase *c, int causal, const int64_t *len,          \
                     const float *q, const float *k, const float *v,          \
                     REAL *out, REAL *lse)                                    \
    {                                                                         \
        const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh, L = c->L;       \
        const int64_t dv = dv_of(c), Ev = c->H * dv, Evkv = c->Hkv * dv;      \
        const REAL scale = (REAL)1 / (REAL)sqrt((double)c->dh);               \
        REAL *s = malloc((size_t)L * sizeof *s);                              \
        for (int64_t b = 0; b < c->B; b++)                                    \
            for (int64_t h = 0; h < c->H; h++) {                              \
                const int64_t g = h / (c->H / c->Hkv);                        \
                for (int64_t i = 0; i < L; i++) {                             \
                    const float *qi = q + (b * L + i) * E + h * c->dh;        \
                    REAL mx = -INFINITY;                                      \
                    for (int64_t j = 0; j < L; j++) {                         \
                        s[j] = -INFINITY;                                     \
                        if (!visible(len, b, i, j, causal) ||               \
                            !in_window(c, i, j))                              \
                            continue;                                         \
                        const float *kj = k + (b * L + j) * Ekv + g * c->dh;  \
                        REAL dot = 0;                                         \
                        for (int64_t d = 0; d < c->dh; d++)                   \
                            dot += (REAL)qi[d] * kj[d];                       \
                        dot *= scale;                                         \
                        if (c->softcap > 0)                                   \
                            dot = c->softcap * TANH(dot / c->softcap);        \
                        if (c->alibi)                                         \
                            dot -= (REAL)slope_of(c, h) *                     \
                                   (REAL)(i > j ? i - j : j - i);             \
                        s[j] = dot;                                           \
                        mx = dot > mx ? dot : mx;                             \
                    }                                                         \
                    REAL *o = out + (b * L + i) * Ev + h * dv;                \
                    for (int64_t d = 0; d < dv; d++)                          \
                        o[d] = 0;                                             \
                    if (mx == -INFINITY) {                                    \
                        lse[(b * c->H + h) * L + i] = -INFINITY;              \
                        continue;                                             \
                    }                                                         \
                    REAL sum = 0;                                             \
                    for (int64_t j = 0; j < L; j++)                           \
                        if (s[j] != -INFINITY)                                \
                            sum += s[j] = EXP(s[j] - mx);                     \
                        else                                                  \
                            s[j] = 0;                                         \
                    for (int64_t j = 0; j < L; j++) {                         \
                        const float *vj = v + (b * L + j) * Evkv + g * dv;    \
                        for (int64_t d = 0; s[j] != 0 && d < dv; d++)         \
                            o[d] += s[j] / sum * vj[d];                       \
                    }                                                         \
                    lse[(b * c->H + h) * L + i] = mx + LOG(sum);              \
                }                                                             \
            }                                                                 \
        free(s);                                                              \
    }
REF_FORWARD(ref64, double, exp, log, tanh)
REF_FORWARD(ref32, float, expf, logf, tanhf)

/* dq (B, L, E), dk, dv (B, L, Ekv) in float64, from dO = gout. */
static void ref64_backward(const tcase *c, int causal, const int64_t *len,
                           const float *q, const float *k, const float *v,
                           const float *gout, double *dq, double *dk,
                           double *dv)
{
    const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh, L = c->L;
    const int64_t wv = dv_of(c), Ev = c->H * wv, Evkv = c->Hkv * wv;
    const double scale = 1.0 / sqrt((double)c->dh);
    memset(dq, 0, (size_t)(c->B * L * E) * sizeof *dq);
    memset(dk, 0, (size_t)(c->B * L * Ekv) * sizeof *dk);
    memset(dv, 0, (size_t)(c->B * L * Evkv) * sizeof *dv);
    double *p = malloc((size_t)L * sizeof *p), *du = malloc((size_t)L * 8);
    double *dcap = malloc((size_t)L * 8);
    for (int64_t b = 0; b < c->B; b++)
        for (int64_t h = 0; h < c->H; h++) {
            const int64_t g = h / (c->H / c->Hkv);
            for (int64_t i = 0; i < L; i++) {
                const float *qi = q + (b * L + i) * E + h * c->dh;
                const float *dO = gout + (b * L + i) * Ev + h * wv;
                double mx = -INFINITY;
                for (int64_t j = 0; j < L; j++) {
                    p[j] = -INFINITY;
                    dcap[j] = 1.0;
                    if (!visible(len, b, i, j, causal) || !in_window(c, i, j))
                        continue;
                    const float *kj = k + (b * L + j) * Ekv + g * c->dh;
                    double dot = 0;
                    for (int64_t d = 0; d < c->dh; d++)
                        dot += (double)qi[d] * kj[d];
                    dot *= scale;
                    if (c->softcap > 0) {
                        const double t = tanh(dot / c->softcap);
                        dot = c->softcap * t;
                        dcap[j] = 1.0 - t * t;
                    }
                    if (c->alibi)
                        dot -= slope_of(c, h) * (double)(i > j ? i - j : j - i);
                    p[j] = dot;
                    mx = dot > mx ? dot : mx;
                }
                if (mx == -INFINITY)
                    continue;
                double sum = 0;
                for (int64_t j = 0; j < L; j++)
                    sum += p[j] = p[j] == -INFINITY ? 0.0 : exp(p[j] - mx);
                double delta = 0;
                for (int64_t j = 0; j < L; j++) {
                    p[j] /= sum;
                    const float *vj = v + (b * L + j) * Evkv + g * wv;
                    double dp = 0;
                    for (int64_t d = 0; d < wv; d++)
                        dp += (double)dO[d] * vj[d];
                    du[j] = dp;
                    delta += p[j] * dp;
                }
                for (int64_t j = 0; j < L; j++) {
                    if (p[j] == 0.0)
                        continue;
                    const double ds = p[j] * (du[j] - delta) * dcap[j] * scale;
                    const float *kj = k + (b * L + j) * Ekv + g * c->dh;
                    double *dqi = dq + (b * L + i) * E + h * c->dh;
                    double *dkj = dk + (b * L + j) * Ekv + g * c->dh;
                    double *dvj = dv + (b * L + j) * Evkv + g * wv;
                    for (int64_t d = 0; d < c->dh; d++) {
                        dqi[d] += ds * kj[d];
                        dkj[d] += ds * qi[d];
                    }
                    for (int64_t d = 0; d < wv; d++)
                        dvj[d] += p[j] * dO[d];
                }
            }
        }
    free(p);
    free(du);
    free(dcap);
}

/* ---- shards ------------------------------------------------------------- */

/* The global row of local row x of a shard. */
static int64_t global_row(const mha_shard *s, int64_t x)
{
    return x < s->length[0] ? s->offset[0] + x
                            : s->offset[1] + (x - s->length[0]);
}

/* This rank's rows of x (B, L, w) into y (B, len, w). */
static void take(float *y, const float *x, const mha_shard *s, int64_t B,
                 int64_t L, int64_t w)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < s->len; r++)
            memcpy(y + (b * s->len + r) * w,
                   x + (b * L + global_row(s, r)) * w, (size_t)w * 4);
}

/* max |got - want(rows of the shard)| and max |want| over those rows. */
static void compare(const float *got, const double *want, const mha_shard *s,
                    int64_t B, int64_t L, int64_t w, double *err, double *mx)
{
    *err = 0.0;
    *mx = 0.0;
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < s->len; r++)
            for (int64_t d = 0; d < w; d++) {
                const double x = want[(b * L + global_row(s, r)) * w + d];
                const double e =
                    fabs((double)got[(b * s->len + r) * w + d] - x);
                *err = e > *err || e != e ? e : *err;
                *mx = fabs(x) > *mx ? fabs(x) : *mx;
            }
}

static double *widen(const float *x, int64_t n)
{
    double *y = malloc((size_t)n * sizeof *y);
    for (int64_t i = 0; i < n; i++)
        y[i] = x[i];
    return y;
}

/* ---- one case ----------------------------------------------------------- */

typedef struct result {
    float *out, *lse, *dq, *dk, *dv;
    mha_ring_stats fs, bs;
} result;

static int run_ring(const tcase *c, mha_seq_split split, int causal,
                    const int64_t *len, const float *q, const float *k,
                    const float *v, const float *go, int threads,
                    const mha_shard *s, result *r, int ulysses)
{
    const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh;
    const int64_t Ev = c->H * dv_of(c), Evkv = c->Hkv * dv_of(c);
    r->out = calloc((size_t)(c->B * s->len * Ev) + 1, 4);
    r->lse = calloc((size_t)(c->B * c->H * s->len) + 1, 4);
    r->dq = calloc((size_t)(c->B * s->len * E) + 1, 4);
    r->dk = calloc((size_t)(c->B * s->len * Ekv) + 1, 4);
    r->dv = calloc((size_t)(c->B * s->len * Evkv) + 1, 4);
    mha_ring_args a = {0};
    a.comm = MPI_COMM_WORLD;
    a.split = split;
    a.seq_len = c->L;
    a.batch = c->B;
    a.num_heads = c->H;
    a.num_kv_heads = c->Hkv;
    a.head_dim = c->dh;
    a.v_head_dim = c->dv;
    a.attention_chunk = c->chunk;
    a.q = q;
    a.k = k;
    a.v = v;
    a.causal = causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    a.key_lengths = len;
    a.mods.softcap = c->softcap;
    a.mods.alibi = c->alibi;
    a.mods.window = c->wl || c->wr;
    a.mods.window_left = c->wl;
    a.mods.window_right = c->wr;
    a.num_threads = threads;
    a.out = r->out;
    a.lse = r->lse;
    a.stats = &r->fs;
    mha_status st = ulysses ? mha_ulysses_attention(&a)
                            : mha_ring_attention(&a);
    CHECK(st == MHA_OK, "%s: forward: %s", c->name, mha_last_error());
    if (st != MHA_OK)
        return 0;
    const mha_ring_grads g = {go, r->dq, r->dk, r->dv};
    a.stats = &r->bs;
    st = ulysses ? mha_ulysses_attention_backward(&a, &g)
                 : mha_ring_attention_backward(&a, &g);
    CHECK(st == MHA_OK, "%s: backward: %s", c->name, mha_last_error());
    return st == MHA_OK;
}

static void free_result(result *r)
{
    free(r->out);
    free(r->lse);
    free(r->dq);
    free(r->dk);
    free(r->dv);
}

static void test_case(const tcase *c, mha_seq_split split, int causal)
{
    const int64_t E = c->H * c->dh, Ekv = c->Hkv * c->dh, L = c->L;
    const int64_t Ev = c->H * dv_of(c), Evkv = c->Hkv * dv_of(c);
    const int64_t nq = c->B * L * E, nk = c->B * L * Ekv;
    const int64_t no = c->B * L * Ev, nv = c->B * L * Evkv;
    const int64_t rows = c->B * c->H * L;
    char name[160];
    snprintf(name, sizeof name, "%s, %s%s, P=%d", c->name,
             split == MHA_SPLIT_ZIGZAG ? "zig-zag" : "contiguous",
             causal ? ", causal" : "", g_P);
    float *q = malloc((size_t)nq * 4), *k = malloc((size_t)nk * 4);
    float *v = malloc((size_t)nv * 4), *go = malloc((size_t)no * 4);
    tu_fill(q, nq, 11, -1.5f, 1.5f);
    tu_fill(k, nk, 12, -1.5f, 1.5f);
    tu_fill(v, nv, 13, -1.5f, 1.5f);
    tu_fill(go, no, 14, -1, 1);
    const int64_t lens[2] = {c->L * 2 / 3, 0};   /* batch 1: no key */
    const int64_t *len = c->lengths ? lens : NULL;

    mha_shard s;
    CHECK(mha_shard_of(split, L, g_P, g_rank, &s) == MHA_OK, "shard");
    float *sq = malloc((size_t)(c->B * s.len * E) * 4 + 4);
    float *sk = malloc((size_t)(c->B * s.len * Ekv) * 4 + 4);
    float *sv = malloc((size_t)(c->B * s.len * Evkv) * 4 + 4);
    float *sg = malloc((size_t)(c->B * s.len * Ev) * 4 + 4);
    take(sq, q, &s, c->B, L, E);
    take(sk, k, &s, c->B, L, Ekv);
    take(sv, v, &s, c->B, L, Evkv);
    take(sg, go, &s, c->B, L, Ev);

    result r1, r2, r3;
    memset(&r1, 0, sizeof r1);
    memset(&r2, 0, sizeof r2);
    memset(&r3, 0, sizeof r3);
    if (!run_ring(c, split, causal, len, sq, sk, sv, sg, 1, &s, &r1, 0))
        goto out;

    /* The float64 reference and the naive float32 error. */
    double *o64 = malloc((size_t)no * 8), *l64 = malloc((size_t)rows * 8);
    float *o32 = malloc((size_t)no * 4), *l32 = malloc((size_t)rows * 4);
    ref64(c, causal, len, q, k, v, o64, l64);
    ref32(c, causal, len, q, k, v, o32, l32);
    const double naive = ref_max_err_f32(o32, o64, no);
    double err, mx;
    compare(r1.out, o64, &s, c->B, L, Ev, &err, &mx);
    const double tol = ref_tolerance(naive, ref_max_abs(o64, no));
    CHECK(err <= tol, "%s: out error %.3g > %.3g", name, err, tol);
    /* lse, rows (b, h, i): compared as (B*H, L, 1). */
    {
        double e = 0.0;
        for (int64_t bh = 0; bh < c->B * c->H; bh++)
            for (int64_t x = 0; x < s.len; x++) {
                const double w = l64[bh * L + global_row(&s, x)];
                const float got = r1.lse[bh * s.len + x];
                if (w == -INFINITY) {
                    CHECK(got == -INFINITY, "%s: lse of a row with no key "
                          "is %g", name, (double)got);
                    continue;
                }
                const double d = fabs(got - w) / (1.0 + fabs(w));
                e = d > e || d != d ? d : e;
            }
        CHECK(e <= 1e-5, "%s: lse relative error %.3g", name, e);
    }
    double *dq64 = malloc((size_t)nq * 8), *dk64 = malloc((size_t)nk * 8);
    double *dv64 = malloc((size_t)nv * 8);
    ref64_backward(c, causal, len, q, k, v, go, dq64, dk64, dv64);
    compare(r1.dq, dq64, &s, c->B, L, E, &err, &mx);
    CHECK(err <= 1e-4 * (1 + mx), "%s: dq error %.3g (max %.3g)", name, err,
          mx);
    compare(r1.dk, dk64, &s, c->B, L, Ekv, &err, &mx);
    CHECK(err <= 1e-4 * (1 + mx), "%s: dk error %.3g (max %.3g)", name, err,
          mx);
    compare(r1.dv, dv64, &s, c->B, L, Evkv, &err, &mx);
    CHECK(err <= 1e-4 * (1 + mx), "%s: dv error %.3g (max %.3g)", name, err,
          mx);

    /* The single-process result, within the same bounds. */
    {
        float *so = malloc((size_t)no * 4), *sdq = malloc((size_t)nq * 4);
        float *sdk = malloc((size_t)nk * 4), *sdv = malloc((size_t)nv * 4);
        float *slse = malloc((size_t)rows * 4);
        mha_attention_args a = {0};
        a.batch = c->B;
        a.num_heads = c->H;
        a.num_kv_heads = c->Hkv;
        a.head_dim = c->dh;
        a.v_head_dim = c->dv;
        a.attention_chunk = c->chunk;
        a.q_len = L;
        a.q = q;
        a.k = k;
        a.v = v;
        a.causal = causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
        a.key_lengths = len;
        a.mods.softcap = c->softcap;
        a.mods.alibi = c->alibi;
        a.mods.window = c->wl || c->wr;
        a.mods.window_left = c->wl;
        a.mods.window_right = c->wr;
        a.out = so;
        a.lse = slse;
        const mha_attention_grads g = {go, sdq, sdk, sdv, NULL};
        CHECK(mha_attention(&a) == MHA_OK &&
              mha_attention_backward(&a, &g) == MHA_OK, "%s: single: %s",
              name, mha_last_error());
        double *w = widen(so, no);
        compare(r1.out, w, &s, c->B, L, Ev, &err, &mx);
        CHECK(err <= tol, "%s: out vs single process %.3g > %.3g", name, err,
              tol);
        free(w);
        w = widen(sdq, nq);
        compare(r1.dq, w, &s, c->B, L, E, &err, &mx);
        CHECK(err <= 1e-4 * (1 + mx), "%s: dq vs single process %.3g", name,
              err);
        free(w);
        w = widen(sdk, nk);
        compare(r1.dk, w, &s, c->B, L, Ekv, &err, &mx);
        CHECK(err <= 1e-4 * (1 + mx), "%s: dk vs single process %.3g", name,
              err);
        free(w);
        w = widen(sdv, nv);
        compare(r1.dv, w, &s, c->B, L, Evkv, &err, &mx);
        CHECK(err <= 1e-4 * (1 + mx), "%s: dv vs single process %.3g", name,
              err);
        free(w);
        /* Ulysses, where the heads split: bitwise the single process. */
        if (c->H % g_P == 0 && c->Hkv % g_P == 0) {
            result u;
            memset(&u, 0, sizeof u);
            if (run_ring(c, split, causal, len, sq, sk, sv, sg, 1, &s, &u,
                         1)) {
                const int64_t wmax = E > Ev ? E : Ev;
                float *t = malloc((size_t)(c->B * s.len * wmax) * 4 + 4);
                float *tl = malloc((size_t)(c->B * c->H * s.len) * 4 + 4);
                take(t, so, &s, c->B, L, Ev);
                CHECK(!memcmp(t, u.out, (size_t)(c->B * s.len * Ev) * 4),
                      "%s: Ulysses out differs from the single process",
                      name);
                for (int64_t bh = 0; bh < c->B * c->H; bh++)
                    for (int64_t x = 0; x < s.len; x++)
                        tl[bh * s.len + x] = slse[bh * L + global_row(&s, x)];
                CHECK(!memcmp(tl, u.lse, (size_t)(c->B * c->H * s.len) * 4),
                      "%s: Ulysses lse differs from the single process",
                      name);
                take(t, sdq, &s, c->B, L, E);
                CHECK(!memcmp(t, u.dq, (size_t)(c->B * s.len * E) * 4),
                      "%s: Ulysses dq differs from the single process", name);
                take(t, sdk, &s, c->B, L, Ekv);
                CHECK(!memcmp(t, u.dk, (size_t)(c->B * s.len * Ekv) * 4),
                      "%s: Ulysses dk differs from the single process", name);
                take(t, sdv, &s, c->B, L, Evkv);
                CHECK(!memcmp(t, u.dv, (size_t)(c->B * s.len * Evkv) * 4),
                      "%s: Ulysses dv differs from the single process", name);
                /* all-to-alls: forward q, k, v, out, lse; backward q, k,
                 * v, dO, dq, dk, dv: P - 1 messages each */
                CHECK(u.fs.messages_sent == 5 * (g_P - 1) &&
                          u.bs.messages_sent == 7 * (g_P - 1),
                      "%s: Ulysses sent %lld + %lld messages", name,
                      (long long)u.fs.messages_sent,
                      (long long)u.bs.messages_sent);
                free(t);
                free(tl);
            }
            free_result(&u);
        }
        free(so); free(sdq); free(sdk); free(sdv); free(slse);
    }

    /* Run to run, and on 2 threads: the same bits. */
    if (run_ring(c, split, causal, len, sq, sk, sv, sg, 1, &s, &r2, 0) &&
        run_ring(c, split, causal, len, sq, sk, sv, sg, 2, &s, &r3, 0)) {
        const size_t bq = (size_t)(c->B * s.len * E) * 4;
        const size_t bk = (size_t)(c->B * s.len * Ekv) * 4;
        const size_t bo = (size_t)(c->B * s.len * Ev) * 4;
        const size_t bv = (size_t)(c->B * s.len * Evkv) * 4;
        const size_t bl = (size_t)(c->B * c->H * s.len) * 4;
        for (int t = 0; t < 2; t++) {
            const result *x = t ? &r3 : &r2;
            CHECK(!memcmp(r1.out, x->out, bo) && !memcmp(r1.lse, x->lse, bl) &&
                  !memcmp(r1.dq, x->dq, bq) && !memcmp(r1.dk, x->dk, bk) &&
                  !memcmp(r1.dv, x->dv, bv),
                  "%s: %s not bitwise equal", name,
                  t ? "2 threads" : "a second run");
        }
    }

    /* Messages and bytes: at step s this rank forwards the block of rank
     * (rank - s) mod P, s = 0 .. P - 2. */
    {
        int64_t bytes = 0;
        for (int st = 0; st + 1 < g_P; st++) {
            mha_shard o;
            mha_shard_of(split, L, g_P, (g_rank - st + g_P) % g_P, &o);
            bytes += c->B * o.len * (Ekv + Evkv) * 4;
        }
        CHECK(r1.fs.messages_sent == g_P - 1 && r1.fs.bytes_sent == bytes,
              "%s: forward sent %lld messages, %lld bytes; expected %d, %lld",
              name, (long long)r1.fs.messages_sent,
              (long long)r1.fs.bytes_sent, g_P - 1, (long long)bytes);
        /* backward: the same K/V blocks, and P gradient blocks of the same
         * shards' sizes (the last one the block of rank + 1, going home) */
        int64_t gbytes = 0;
        for (int st = 0; g_P > 1 && st < g_P; st++) {
            mha_shard o;
            mha_shard_of(split, L, g_P, (g_rank - st + g_P) % g_P, &o);
            gbytes += c->B * o.len * (Ekv + Evkv) * 4;
        }
        const int64_t want_msgs = g_P > 1 ? 2 * g_P - 1 : 0;
        CHECK(r1.bs.messages_sent == want_msgs &&
                  r1.bs.bytes_sent == bytes + gbytes,
              "%s: backward sent %lld messages, %lld bytes; expected %lld, "
              "%lld", name, (long long)r1.bs.messages_sent,
              (long long)r1.bs.bytes_sent, (long long)want_msgs,
              (long long)(bytes + gbytes));
        CHECK(r1.fs.seconds >= r1.fs.seconds_compute &&
                  r1.fs.workspace_bytes > 0,
              "%s: stats: seconds %g, compute %g, workspace %lld", name,
              r1.fs.seconds, r1.fs.seconds_compute,
              (long long)r1.fs.workspace_bytes);
    }
    free(o64); free(l64); free(o32); free(l32);
    free(dq64); free(dk64); free(dv64);
out:
    free_result(&r1);
    free_result(&r2);
    free_result(&r3);
    free(q); free(k); free(v); free(go);
    free(sq); free(sk); free(sv); free(sg);
}

/* ---- the module across ranks -------------------------------------------- */

static void expect_all(const char *what, mha_status got, mha_status want,
                       const char *needle);

/* mha_ring_forward (ring and Ulysses) against the float64 reference of
 * the whole module forward (tests/support) within ref_tolerance. */
static void test_module(mha_seq_split split, int causal, int rope)
{
    mha_config cfg = {0};
    cfg.embed_dim = 24;
    cfg.num_heads = 12;
    cfg.num_kv_heads = 6;
    if (rope) {
        cfg.embed_dim = 48;   /* d_h 4: RoPE on pairs */
        cfg.mods.rope.style = MHA_ROPE_NEOX;
        cfg.attention_chunk = 5;   /* chunks of global positions too */
        cfg.v_head_dim = 6;        /* and values of their own width */
    }
    mha_module *m = tu_module(&cfg, 7);
    CHECK(m != NULL, "module: %s", mha_last_error());
    if (!m)
        return;
    enum { B = 2, L = 23 };
    const int64_t E = cfg.embed_dim;
    float *x = malloc(B * L * E * 4);
    tu_fill(x, B * L * E, 21, -1, 1);
    const int64_t lens[B] = {L, 9};
    mha_forward_args fa = {0};
    fa.batch = B;
    fa.q_len = L;
    fa.query = x;
    fa.key_lengths = lens;
    fa.causal = causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    double *o64 = malloc(B * L * E * 8);
    float *o32 = malloc(B * L * E * 4);
    CHECK(ref_forward_f64(m, &fa, o64, NULL) == 0 &&
              ref_forward_f32(m, &fa, o32, NULL) == 0,
          "module reference failed");
    const double tol = ref_tolerance(ref_max_err_f32(o32, o64, B * L * E),
                                     ref_max_abs(o64, B * L * E));
    mha_shard s;
    mha_shard_of(split, L, g_P, g_rank, &s);
    float *xs = malloc((size_t)(B * s.len * E) * 4 + 4);
    float *out = malloc((size_t)(B * s.len * E) * 4 + 4);
    take(xs, x, &s, B, L, E);
    for (int u = 0; u < 2; u++) {
        if (u && cfg.num_heads % g_P + cfg.num_kv_heads % g_P)
            continue;
        mha_ring_forward_args a = {0};
        a.comm = MPI_COMM_WORLD;
        a.split = split;
        a.seq_len = L;
        a.batch = B;
        a.query = xs;
        a.causal = fa.causal;
        a.key_lengths = lens;
        a.ulysses = u;
        a.out = out;
        const mha_status st = mha_ring_forward(m, &a);
        CHECK(st == MHA_OK, "module %s: %s", u ? "Ulysses" : "ring",
              mha_last_error());
        double err, mx;
        compare(out, o64, &s, B, L, E, &err, &mx);
        CHECK(err <= tol, "module %s, split %d, causal %d, rope %d, P=%d: "
              "error %.3g > %.3g", u ? "Ulysses" : "ring", (int)split, causal,
              rope, g_P, err, tol);
    }
    /* A module the ring refuses: every rank says why. */
    mha_config bad = cfg;
    bad.add_zero_attn = 1;
    mha_module *mb = tu_module(&bad, 8);
    mha_ring_forward_args a = {0};
    a.comm = MPI_COMM_WORLD;
    a.split = split;
    a.seq_len = L;
    a.batch = B;
    a.query = xs;
    a.out = out;
    expect_all("module with add_zero_attn", mha_ring_forward(mb, &a),
               MHA_ERR_UNSUPPORTED, "add_zero_attn");
    mha_free(mb);
    free(x); free(o64); free(o32); free(xs); free(out);
    mha_free(m);
}

/* max |got - want| over n and max |want|, want in float32 */
static void diff32(const float *got, const float *want, int64_t n,
                   double *err, double *mx)
{
    *err = 0.0;
    *mx = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double e = fabs((double)got[i] - want[i]);
        *err = e > *err || e != e ? e : *err;
        *mx = fabs(want[i]) > *mx ? fabs(want[i]) : *mx;
    }
}

/* mha_ring_backward (ring and Ulysses; self-attention, and a key of its
 * own that is also the value) against one process's mha_backward on the
 * whole sequence (itself checked against float64 references in
 * test_backward), within the suite's gradient bound 1e-4 (1 + max |g|):
 * the input gradient rows of this rank's shard and every parameter's
 * gradient (summed over the ranks); accumulate adds exactly; refusals. */
static void test_module_backward(mha_seq_split split, int causal, int rope)
{
    mha_config cfg = {0};
    cfg.embed_dim = 24;
    cfg.num_heads = 12;
    cfg.num_kv_heads = 6;
    if (rope) {
        cfg.embed_dim = 48;
        cfg.mods.rope.style = MHA_ROPE_NEOX;
        cfg.v_head_dim = 3;   /* values narrower than keys */
    }
    mha_module *m = tu_module(&cfg, 9);
    CHECK(m != NULL, "module: %s", mha_last_error());
    if (!m)
        return;
    enum { B = 2, L = 19 };
    const int64_t E = cfg.embed_dim, np = mha_param_numel(m);
    const int64_t lens[B] = {L, 11};
    float *x = malloc(B * L * E * 4), *kx = malloc(B * L * E * 4);
    float *G = malloc(B * L * E * 4);
    tu_fill(x, B * L * E, 31, -1, 1);
    tu_fill(kx, B * L * E, 32, -1, 1);
    tu_fill(G, B * L * E, 33, -1, 1);
    mha_shard s;
    mha_shard_of(split, L, g_P, g_rank, &s);
    const int64_t nl = B * s.len * E;
    float *xs = malloc((size_t)nl * 4 + 4), *ks = malloc((size_t)nl * 4 + 4);
    float *Gs = malloc((size_t)nl * 4 + 4), *gq = malloc((size_t)nl * 4 + 4);
    float *gk = malloc((size_t)nl * 4 + 4), *sq = malloc((size_t)nl * 4 + 4);
    float *sk = malloc((size_t)nl * 4 + 4);
    float *gq1 = malloc(B * L * E * 4), *gk1 = malloc(B * L * E * 4);
    float *gp1 = malloc((size_t)np * 4), *gp = malloc((size_t)np * 4);
    float *gp2 = malloc((size_t)np * 4);
    take(xs, x, &s, B, L, E);
    take(ks, kx, &s, B, L, E);
    take(Gs, G, &s, B, L, E);
    for (int cross = 0; cross < 2; cross++) {
        /* one process, the whole sequence */
        mha_forward_args fa = {0};
        fa.batch = B;
        fa.q_len = L;
        fa.kv_len = L;
        fa.query = x;
        fa.key = cross ? kx : NULL;
        fa.key_lengths = lens;
        fa.causal = causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
        mha_backward_args ba = {0};
        ba.grad_out = G;
        ba.grad_query = gq1;
        ba.grad_key = cross ? gk1 : NULL;
        ba.grad_params = gp1;
        CHECK(mha_backward(m, &fa, &ba) == MHA_OK, "single backward: %s",
              mha_last_error());
        take(sq, gq1, &s, B, L, E);
        take(sk, gk1, &s, B, L, E);
        for (int u = 0; u < 2; u++) {
            if (u && cfg.num_heads % g_P + cfg.num_kv_heads % g_P)
                continue;
            mha_ring_forward_args a = {0};
            a.comm = MPI_COMM_WORLD;
            a.split = split;
            a.seq_len = L;
            a.batch = B;
            a.query = xs;
            a.key = cross ? ks : NULL;
            a.causal = fa.causal;
            a.key_lengths = lens;
            a.ulysses = u;
            mha_ring_backward_args g = {Gs, gq, cross ? gk : NULL, NULL, gp,
                                        0};
            CHECK(mha_ring_backward(m, &a, &g) == MHA_OK,
                  "module backward %s: %s", u ? "Ulysses" : "ring",
                  mha_last_error());
            double err, mx;
            const char *what[3] = {"grad_query", "grad_key", "grad_params"};
            for (int t = 0; t < 3; t++) {
                if (t == 1 && !cross)
                    continue;
                if (t < 2)
                    diff32(t ? gk : gq, t ? sk : sq, nl, &err, &mx);
                else
                    diff32(gp, gp1, np, &err, &mx);
                CHECK(err <= 1e-4 * (1.0 + mx),
                      "module backward %s, cross %d, split %d, causal %d, "
                      "rope %d, P=%d: %s differs from one process's by "
                      "%.3g (max %.3g)", u ? "Ulysses" : "ring", cross,
                      (int)split, causal, rope, g_P, what[t], err, mx);
            }
            /* accumulate: the same sum added, so exactly twice */
            memcpy(gp2, gp, (size_t)np * 4);
            g.accumulate = 1;
            CHECK(mha_ring_backward(m, &a, &g) == MHA_OK,
                  "module backward, accumulate: %s", mha_last_error());
            int same = 1;
            for (int64_t i = 0; i < np; i++)
                same &= gp[i] == 2.0f * gp2[i];
            CHECK(same, "module backward: accumulate does not add the same "
                  "bits (P=%d)", g_P);
        }
    }
    /* self-attention: grad_query takes every input's gradient */
    mha_ring_forward_args a = {0};
    a.comm = MPI_COMM_WORLD;
    a.split = split;
    a.seq_len = L;
    a.batch = B;
    a.query = xs;
    mha_ring_backward_args g = {Gs, gq, gk, NULL, NULL, 0};
    expect_all("module backward, self-attention with grad_key",
               mha_ring_backward(m, &a, &g), MHA_ERR_INVALID_ARGUMENT,
               "grad_key and grad_value must be NULL");
    free(x); free(kx); free(G); free(xs); free(ks); free(Gs); free(gq);
    free(gk); free(sq); free(sk); free(gq1); free(gk1); free(gp1);
    free(gp); free(gp2);
    mha_free(m);
}

/* ---- refusals ----------------------------------------------------------- */

/* Every rank got `want` and the same message (rank 0's, broadcast). */
static void expect_all(const char *what, mha_status got, mha_status want,
                       const char *needle)
{
    char msg[512], zero[512];
    snprintf(msg, sizeof msg, "%s", mha_last_error());
    memcpy(zero, msg, sizeof zero);
    MPI_Bcast(zero, (int)sizeof zero, MPI_CHAR, 0, MPI_COMM_WORLD);
    CHECK(got == want, "%s: status %d (%s), expected %d", what, (int)got,
          msg, (int)want);
    CHECK(strcmp(msg, zero) == 0, "%s: message \"%s\" differs from rank "
          "0's \"%s\"", what, msg, zero);
    CHECK(strstr(msg, needle) != NULL, "%s: message \"%s\" lacks \"%s\"",
          what, msg, needle);
}

static void test_refusals(void)
{
    enum { B = 1, H = 2, DH = 4, L = 12 };
    float q[B * L * H * DH], k[B * L * H * DH], v[B * L * H * DH];
    float out[B * L * H * DH], lse[B * H * L];
    tu_fill(q, B * L * H * DH, 1, -1, 1);
    tu_fill(k, B * L * H * DH, 2, -1, 1);
    tu_fill(v, B * L * H * DH, 3, -1, 1);
    mha_ring_args a = {0};
    a.comm = MPI_COMM_WORLD;
    a.seq_len = L;
    a.batch = B;
    a.num_heads = H;
    a.head_dim = DH;
    a.q = q;   /* a shard is at most L rows: the arrays are big enough */
    a.k = k;
    a.v = v;
    a.out = out;
    a.lse = lse;
    const int odd = g_P > 1 ? 1 : 0;   /* the rank that differs */

    mha_ring_args x = a;
    if (g_rank == odd) {
        x.num_heads = 1;
        x.head_dim = 8;
    }
    if (g_P > 1)
        expect_all("num_heads differs", mha_ring_attention(&x),
                   MHA_ERR_SHAPE, "disagree on num_heads (values from 1 to 2)");
    x = a;
    if (g_rank == odd)
        x.split = MHA_SPLIT_ZIGZAG;
    if (g_P > 1)
        expect_all("split differs", mha_ring_attention(&x), MHA_ERR_SHAPE,
                   "disagree on split");
    x = a;
    if (g_rank == odd)
        x.causal = MHA_CAUSAL_TOP_LEFT;
    if (g_P > 1)
        expect_all("causal differs", mha_ring_attention(&x), MHA_ERR_SHAPE,
                   "disagree on causal");
    x = a;
    if (g_rank == odd)
        x.scale = 0.5f;
    if (g_P > 1)
        expect_all("scale differs", mha_ring_attention(&x),
                   MHA_ERR_INVALID_ARGUMENT, "disagree on scale");
    x = a;
    if (g_rank == odd)
        x.attention_chunk = 4;
    if (g_P > 1)
        expect_all("attention_chunk differs", mha_ring_attention(&x),
                   MHA_ERR_SHAPE, "disagree on attention_chunk");
    x = a;
    if (g_rank == odd)
        x.v_head_dim = 2;
    if (g_P > 1)
        expect_all("v_head_dim differs", mha_ring_attention(&x),
                   MHA_ERR_SHAPE, "disagree on v_head_dim (values from 2 to 4)");
    x = a;
    x.v_head_dim = -3;
    expect_all("a negative v_head_dim", mha_ring_attention(&x), MHA_ERR_SHAPE,
               "v_head_dim must be >= 0");
    x = a;
    x.attention_chunk = -1;
    expect_all("a negative attention_chunk", mha_ring_attention(&x),
               MHA_ERR_INVALID_ARGUMENT, "attention_chunk must be >= 0");
    /* One rank's own error, on every rank. */
    x = a;
    if (g_rank == g_P - 1)
        x.q = NULL;
    char want[64];
    snprintf(want, sizeof want, "rank %d of %d: q is NULL", g_P - 1, g_P);
    expect_all("NULL q on the last rank", mha_ring_attention(&x),
               MHA_ERR_NULL_POINTER, want);
    x = a;
    x.num_kv_heads = 3;
    expect_all("num_kv_heads not dividing", mha_ring_attention(&x),
               MHA_ERR_SHAPE, "num_kv_heads 3 must divide num_heads 2");
    /* Forward on one rank, backward on the others. */
    if (g_P > 1) {
        float g[B * L * H * DH], dq[B * L * H * DH], dk[B * L * H * DH],
            dv[B * L * H * DH];
        tu_fill(g, B * L * H * DH, 4, -1, 1);
        const mha_ring_grads gr = {g, dq, dk, dv};
        const mha_status st = g_rank == 0 ? mha_ring_attention(&a)
                                          : mha_ring_attention_backward(&a,
                                                                        &gr);
        expect_all("forward against backward", st, MHA_ERR_INVALID_ARGUMENT,
                   "disagree on the call");
    }
    /* Ulysses needs heads that split over the ranks. */
    if (g_P > 2) {
        char uw[128];
        snprintf(uw, sizeof uw, "must both be multiples of the rank count %d",
                 g_P);
        expect_all("Ulysses with 2 heads", mha_ulysses_attention(&a),
                   MHA_ERR_UNSUPPORTED, uw);
    }
    /* A good call still works after the refusals. */
    CHECK(mha_ring_attention(&a) == MHA_OK, "after refusals: %s",
          mha_last_error());
    mha_shard s;
    CHECK(mha_shard_of(MHA_SPLIT_ZIGZAG, 10, 4, 4, &s) ==
              MHA_ERR_INVALID_ARGUMENT, "rank out of range accepted");
    /* 8 chunks of 10: lengths 2 2 1 1 1 1 1 1; rank 1: chunks 1 and 6 */
    CHECK(mha_shard_of(MHA_SPLIT_ZIGZAG, 10, 4, 1, &s) == MHA_OK &&
              s.offset[0] == 2 && s.length[0] == 2 && s.offset[1] == 8 &&
              s.length[1] == 1 && s.len == 3,
          "zig-zag shard of rank 1 of 4, L 10: %lld+%lld, %lld+%lld",
          (long long)s.offset[0], (long long)s.length[0],
          (long long)s.offset[1], (long long)s.length[1]);
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_P);
    if (argc > 1 && strcmp(argv[1], "kill") == 0) {
        /* A rank dies before the ring: the job must end, not hang. */
        if (g_rank == 1 % g_P)
            raise(SIGKILL);
        enum { B = 1, H = 2, DH = 4, L = 64 };
        static float q[B * L * H * DH], out[B * L * H * DH];
        mha_ring_args a = {0};
        a.comm = MPI_COMM_WORLD;
        a.seq_len = L;
        a.batch = B;
        a.num_heads = H;
        a.head_dim = DH;
        a.q = a.k = a.v = q;
        a.out = out;
        const mha_status st = mha_ring_attention(&a);
        fprintf(stderr, "rank %d: the ring returned %d (%s)\n", g_rank,
                (int)st, mha_last_error());
        MPI_Finalize();
        return 1;   /* reaching here is a failure too: not all ranks ran */
    }
    for (size_t t = 0; t < sizeof CASES / sizeof *CASES; t++)
        for (int split = 0; split < 2; split++)
            for (int causal = 0; causal < 2; causal++)
                test_case(&CASES[t], (mha_seq_split)split, causal);
    for (int split = 0; split < 2; split++)
        for (int causal = 0; causal < 2; causal++)
            for (int rope = 0; rope < 2; rope++)
                test_module((mha_seq_split)split, causal, rope);
    for (int split = 0; split < 2; split++)
        for (int causal = 0; causal < 2; causal++)
            for (int rope = 0; rope < 2; rope++)
                test_module_backward((mha_seq_split)split, causal, rope);
    test_refusals();
    int any = 0;
    MPI_Allreduce(&g_failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("test_mpi_ring, P=%d: %s\n", g_P, any ? "FAILED" : "ok");
    MPI_Finalize();
    return any ? 1 : 0;
}
