/*
 * test_mpi_abi.c -- the ABI rule of include/mha_mpi.h, run by CTest under
 * `mpirun -np P` (P = 1, 2, 3; tests/CMakeLists.txt).  Every struct
 * travels with its size (test_abi.c is libmha's twin of this test):
 *
 *   - an older layout (a prefix of today's struct) runs, the bytes past
 *     its size never read: they hold garbage that would crash or change
 *     the result if read, and the result is bitwise the normal call's;
 *   - a newer layout with a zero tail runs, bitwise the normal call's;
 *   - a newer layout with a set tail is refused with
 *     MHA_ERR_INVALID_ARGUMENT on every rank, the same message naming the
 *     struct and the byte, before any work (out and stats untouched);
 *     also when only one rank passes it (the others must not hang);
 *   - output structs (mha_shard, mha_ring_stats) are written up to the
 *     caller's size, zero past the library's own, nothing past the
 *     caller's; a size of 0 is refused.
 *
 * Each call is run the normal way first: results are bitwise the same run
 * to run for a given P, so every comparison is exact.  A failure prints
 * "rank R: ..." and the program exits 1 on every rank.
 */
#include "mha_mpi.h"

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* 12 heads: Ulysses splits them for every P of the test. */
enum { B = 2, H = 12, HKV = 6, DH = 4, L = 13, E = H * DH, EKV = HKV * DH };

/* Every rank got `want` and the same message (rank 0's, broadcast), and
 * it contains `needle`. */
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

static int all_zero(const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i])
            return 0;
    return 1;
}

static int all_byte(const void *p, size_t n, unsigned char x)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i] != x)
            return 0;
    return 1;
}

/* A newer mha_mpi.h's structs: today's, then fields this library does not
 * know. */
typedef struct {
    mha_ring_args a;
    int64_t future[2];
} newer_ring_args;
typedef struct {
    mha_ring_grads g;
    int64_t future[2];
} newer_ring_grads;
typedef struct {
    mha_ring_forward_args a;
    int64_t future[2];
} newer_forward_args;
typedef struct {
    mha_ring_backward_args g;
    int64_t future[2];
} newer_backward_args;

/* "NAME of SIZE bytes sets byte BYTE": the refusal of future[1] = 3. */
static void refusal_text(char *buf, size_t n, const char *type, size_t size,
                         size_t known)
{
    snprintf(buf, n, "%s of %zu bytes sets byte %zu", type, size,
             known + sizeof(int64_t));
}

/* ---- this rank's shard of one problem ----------------------------------- */

typedef struct shard_data {
    mha_shard s;
    float *q, *k, *v, *go;   /* inputs */
    size_t nq, nk, nl;       /* floats of q (and out), k, lse */
} shard_data;

static void shard_make(shard_data *d)
{
    mha_shard_of(MHA_SPLIT_ZIGZAG, L, g_P, g_rank, &d->s);
    d->nq = (size_t)(B * d->s.len * E);
    d->nk = (size_t)(B * d->s.len * EKV);
    d->nl = (size_t)(B * H * d->s.len);
    d->q = malloc((d->nq + 1) * 4);
    d->k = malloc((d->nk + 1) * 4);
    d->v = malloc((d->nk + 1) * 4);
    d->go = malloc((d->nq + 1) * 4);
    tu_fill(d->q, (int64_t)d->nq, 100 + (uint64_t)g_rank, -1, 1);
    tu_fill(d->k, (int64_t)d->nk, 200 + (uint64_t)g_rank, -1, 1);
    tu_fill(d->v, (int64_t)d->nk, 300 + (uint64_t)g_rank, -1, 1);
    tu_fill(d->go, (int64_t)d->nq, 400 + (uint64_t)g_rank, -1, 1);
}

static void shard_free(shard_data *d)
{
    free(d->q);
    free(d->k);
    free(d->v);
    free(d->go);
}

static const int64_t LENGTHS[B] = {L, 8};

static void ring_args_fill(mha_ring_args *a, const shard_data *d, float *out,
                           float *lse, mha_ring_stats *stats)
{
    memset(a, 0, sizeof *a);
    a->comm = MPI_COMM_WORLD;
    a->split = MHA_SPLIT_ZIGZAG;
    a->seq_len = L;
    a->batch = B;
    a->num_heads = H;
    a->num_kv_heads = HKV;
    a->head_dim = DH;
    a->q = d->q;
    a->k = d->k;
    a->v = d->v;
    a->causal = MHA_CAUSAL_TOP_LEFT;
    a->key_lengths = LENGTHS;
    a->num_threads = 1;
    a->out = out;
    a->lse = lse;
    a->stats = stats;
}

/* The forward (ring or Ulysses) at any struct and stats size. */
static mha_status forward_sized(int uly, const mha_ring_args *a, size_t size,
                                size_t stats_size)
{
    return uly ? mha_ulysses_attention_sized(a, size, stats_size)
               : mha_ring_attention_sized(a, size, stats_size);
}

static mha_status backward_sized(int uly, const mha_ring_args *a, size_t size,
                                 const mha_ring_grads *g, size_t gsize)
{
    return uly ? mha_ulysses_attention_backward_sized(a, size, g, gsize,
                                                      sizeof(mha_ring_stats))
               : mha_ring_attention_backward_sized(a, size, g, gsize,
                                                   sizeof(mha_ring_stats));
}

/* ---- mha_ring_args and mha_ring_grads ----------------------------------- */

static void test_ring_args(int uly)
{
    const char *name = uly ? "Ulysses" : "ring";
    shard_data d;
    shard_make(&d);
    float *want = calloc(d.nq + 1, 4), *got = calloc(d.nq + 1, 4);
    float *wlse = calloc(d.nl + 1, 4), *glse = calloc(d.nl + 1, 4);
    mha_ring_stats ws;
    mha_ring_args a;
    ring_args_fill(&a, &d, want, wlse, &ws);
    CHECK(forward_sized(uly, &a, sizeof a, sizeof ws) == MHA_OK,
          "%s: the normal call: %s", name, mha_last_error());

    /* (a) an older layout, without `stats`: the garbage pointer past its
     * size would be written to if it were read. */
    const size_t older = offsetof(mha_ring_args, stats);
    mha_ring_args old;
    memset(&old, 0x5A, sizeof old);
    ring_args_fill(&a, &d, got, glse, NULL);
    memcpy(&old, &a, older);
    CHECK(forward_sized(uly, &old, older, sizeof(mha_ring_stats)) == MHA_OK,
          "%s: older args: %s", name, mha_last_error());
    CHECK(memcmp(got, want, d.nq * 4) == 0 &&
              memcmp(glse, wlse, d.nl * 4) == 0,
          "%s: older args: out or lse differ from the normal call's", name);

    /* (b) a newer layout with a zero tail: runs, the same bits. */
    newer_ring_args n;
    memset(&n, 0, sizeof n);
    memset(got, 0, d.nq * 4);
    memset(glse, 0, d.nl * 4);
    mha_ring_stats gs;
    ring_args_fill(&n.a, &d, got, glse, &gs);
    CHECK(forward_sized(uly, &n.a, sizeof n, sizeof gs) == MHA_OK,
          "%s: newer args, zero tail: %s", name, mha_last_error());
    CHECK(memcmp(got, want, d.nq * 4) == 0 &&
              memcmp(glse, wlse, d.nl * 4) == 0,
          "%s: newer args: out or lse differ from the normal call's", name);
    CHECK(gs.messages_sent == ws.messages_sent &&
              gs.bytes_sent == ws.bytes_sent &&
              gs.workspace_bytes == ws.workspace_bytes,
          "%s: newer args: other statistics", name);

    /* (c) a newer layout with a set field, on every rank: refused before
     * any work, out, lse and stats untouched. */
    char text[160];
    refusal_text(text, sizeof text, "mha_ring_args", sizeof n,
                 sizeof(mha_ring_args));
    n.future[1] = 3;
    memset(got, 0, d.nq * 4);
    memset(glse, 0, d.nl * 4);
    memset(&gs, 0xEE, sizeof gs);
    expect_all("newer args, set tail", forward_sized(uly, &n.a, sizeof n,
                                                     sizeof gs),
               MHA_ERR_INVALID_ARGUMENT, text);
    CHECK(all_zero(got, d.nq * 4) && all_zero(glse, d.nl * 4),
          "%s: refused args: out or lse written", name);
    CHECK(all_byte(&gs, sizeof gs, 0xEE), "%s: refused args: stats written",
          name);

    /* ... on the last rank only: every rank returns its refusal. */
    n.future[1] = g_rank == g_P - 1 ? 3 : 0;
    char last[200];
    snprintf(last, sizeof last, "rank %d of %d: %s", g_P - 1, g_P, text);
    expect_all("newer args on the last rank",
               forward_sized(uly, &n.a, sizeof n, sizeof gs),
               MHA_ERR_INVALID_ARGUMENT, last);
    CHECK(all_zero(got, d.nq * 4), "%s: refused on one rank: out written",
          name);

    /* size 0 (no inline call passes it): refused on each rank alone */
    expect_all("args of size 0", forward_sized(uly, &a, 0, sizeof gs),
               MHA_ERR_INVALID_ARGUMENT, "mha_ring_args has size 0");

    /* The backward: older args with today's grads, then newer grads. */
    float *wdq = calloc(d.nq + 1, 4), *wdk = calloc(d.nk + 1, 4),
          *wdv = calloc(d.nk + 1, 4);
    float *dq = calloc(d.nq + 1, 4), *dk = calloc(d.nk + 1, 4),
          *dv = calloc(d.nk + 1, 4);
    ring_args_fill(&a, &d, want, wlse, NULL);
    const mha_ring_grads wg = {d.go, wdq, wdk, wdv};
    CHECK(backward_sized(uly, &a, sizeof a, &wg, sizeof wg) == MHA_OK,
          "%s: the normal backward: %s", name, mha_last_error());
    memset(&old, 0x5A, sizeof old);
    memcpy(&old, &a, older);
    const mha_ring_grads gg = {d.go, dq, dk, dv};
    CHECK(backward_sized(uly, &old, older, &gg, sizeof gg) == MHA_OK,
          "%s: backward, older args: %s", name, mha_last_error());
    CHECK(memcmp(dq, wdq, d.nq * 4) == 0 && memcmp(dk, wdk, d.nk * 4) == 0 &&
              memcmp(dv, wdv, d.nk * 4) == 0,
          "%s: backward, older args: gradients differ", name);
    newer_ring_grads ng;
    memset(&ng, 0, sizeof ng);
    ng.g = gg;
    memset(dq, 0, d.nq * 4);
    CHECK(backward_sized(uly, &a, sizeof a, &ng.g, sizeof ng) == MHA_OK,
          "%s: backward, newer grads, zero tail: %s", name, mha_last_error());
    CHECK(memcmp(dq, wdq, d.nq * 4) == 0 && memcmp(dk, wdk, d.nk * 4) == 0 &&
              memcmp(dv, wdv, d.nk * 4) == 0,
          "%s: backward, newer grads: gradients differ", name);
    ng.future[1] = 3;
    memset(dq, 0, d.nq * 4);
    refusal_text(text, sizeof text, "mha_ring_grads", sizeof ng,
                 sizeof(mha_ring_grads));
    expect_all("newer grads, set tail",
               backward_sized(uly, &a, sizeof a, &ng.g, sizeof ng),
               MHA_ERR_INVALID_ARGUMENT, text);
    CHECK(all_zero(dq, d.nq * 4), "%s: refused grads: dq written", name);

    free(want); free(got); free(wlse); free(glse);
    free(wdq); free(wdk); free(wdv); free(dq); free(dk); free(dv);
    shard_free(&d);
}

/* ---- output structs: mha_ring_stats and mha_shard ----------------------- */

static void test_stats(void)
{
    shard_data d;
    shard_make(&d);
    float *out = calloc(d.nq + 1, 4), *lse = calloc(d.nl + 1, 4);
    mha_ring_stats ws;
    mha_ring_args a;
    ring_args_fill(&a, &d, out, lse, &ws);
    CHECK(mha_ring_attention(&a) == MHA_OK, "stats: %s", mha_last_error());

    /* An older mha_ring_stats, without the timings: written up to its
     * size, nothing past it. */
    unsigned char buf[sizeof(mha_ring_stats) + 32];
    const size_t older = offsetof(mha_ring_stats, seconds);
    memset(buf, 0xAB, sizeof buf);
    a.stats = (mha_ring_stats *)(void *)buf;
    CHECK(mha_ring_attention_sized(&a, sizeof a, older) == MHA_OK,
          "older stats: %s", mha_last_error());
    CHECK(memcmp(buf, &ws, older) == 0, "older stats: counts differ");
    CHECK(all_byte(buf + older, sizeof buf - older, 0xAB),
          "older stats: written past its size");

    /* A newer one: the fields this library does not measure are zero. */
    const size_t newer = sizeof(mha_ring_stats) + 16;
    memset(buf, 0xAB, sizeof buf);
    CHECK(mha_ring_attention_sized(&a, sizeof a, newer) == MHA_OK,
          "newer stats: %s", mha_last_error());
    CHECK(memcmp(buf, &ws, older) == 0, "newer stats: counts differ");
    CHECK(all_zero(buf + sizeof(mha_ring_stats), 16),
          "newer stats: the unknown fields are not zero");
    CHECK(all_byte(buf + newer, sizeof buf - newer, 0xAB),
          "newer stats: written past its size");

    /* size 0 with stats set is refused on every rank; without stats it
     * is not read. */
    memset(buf, 0xAB, sizeof buf);
    expect_all("stats of size 0", mha_ring_attention_sized(&a, sizeof a, 0),
               MHA_ERR_INVALID_ARGUMENT, "mha_ring_stats has size 0");
    CHECK(all_byte(buf, sizeof buf, 0xAB), "refused stats: written");
    a.stats = NULL;
    CHECK(mha_ring_attention_sized(&a, sizeof a, 0) == MHA_OK,
          "no stats, size 0: %s", mha_last_error());

    /* mha_shard: an older layout (without len) and a newer one. */
    mha_shard s;
    CHECK(mha_shard_of(MHA_SPLIT_ZIGZAG, 10, 4, 1, &s) == MHA_OK,
          "shard: %s", mha_last_error());
    unsigned char sb[sizeof(mha_shard) + 32];
    const size_t sold = offsetof(mha_shard, len);
    memset(sb, 0xCD, sizeof sb);
    CHECK(mha_shard_of_sized(MHA_SPLIT_ZIGZAG, 10, 4, 1,
                             (mha_shard *)(void *)sb, sold) == MHA_OK,
          "older shard: %s", mha_last_error());
    CHECK(memcmp(sb, &s, sold) == 0 &&
              all_byte(sb + sold, sizeof sb - sold, 0xCD),
          "older shard: not its prefix alone");
    const size_t snew = sizeof(mha_shard) + 8;
    memset(sb, 0xCD, sizeof sb);
    CHECK(mha_shard_of_sized(MHA_SPLIT_ZIGZAG, 10, 4, 1,
                             (mha_shard *)(void *)sb, snew) == MHA_OK,
          "newer shard: %s", mha_last_error());
    CHECK(memcmp(sb, &s, sizeof s) == 0 &&
              all_zero(sb + sizeof s, 8) &&
              all_byte(sb + snew, sizeof sb - snew, 0xCD),
          "newer shard: not today's, zero, then untouched");
    CHECK(mha_shard_of_sized(MHA_SPLIT_ZIGZAG, 10, 4, 1, &s, 0) ==
              MHA_ERR_INVALID_ARGUMENT &&
              strstr(mha_last_error(), "mha_shard has size 0"),
          "shard of size 0: %s", mha_last_error());
    /* a failing call zeroes the caller's size, as before */
    memset(sb, 0xCD, sizeof sb);
    CHECK(mha_shard_of_sized(MHA_SPLIT_ZIGZAG, 10, 4, 4,
                             (mha_shard *)(void *)sb, snew) ==
              MHA_ERR_INVALID_ARGUMENT &&
              all_zero(sb, snew) &&
              all_byte(sb + snew, sizeof sb - snew, 0xCD),
          "failed shard: not zeroed up to its size");
    free(out);
    free(lse);
    shard_free(&d);
}

/* ---- the module across ranks -------------------------------------------- */

static void forward_args_fill(mha_ring_forward_args *a, const float *x,
                              float *out, mha_ring_stats *stats)
{
    memset(a, 0, sizeof *a);
    a->comm = MPI_COMM_WORLD;
    a->split = MHA_SPLIT_ZIGZAG;
    a->seq_len = L;
    a->batch = B;
    a->query = x;
    a->causal = MHA_CAUSAL_TOP_LEFT;
    a->key_lengths = LENGTHS;
    a->num_threads = 1;
    a->out = out;
    a->stats = stats;
}

static void test_module(void)
{
    mha_config cfg = {0};
    cfg.embed_dim = E;
    cfg.num_heads = H;
    cfg.num_kv_heads = HKV;
    mha_module *m = tu_module(&cfg, 11);
    CHECK(m != NULL, "module: %s", mha_last_error());
    if (!m)
        return;
    mha_shard s;
    mha_shard_of(MHA_SPLIT_ZIGZAG, L, g_P, g_rank, &s);
    const size_t n = (size_t)(B * s.len * E);
    const int64_t np = mha_param_numel(m);
    float *x = malloc((n + 1) * 4), *go = malloc((n + 1) * 4);
    float *want = calloc(n + 1, 4), *got = calloc(n + 1, 4);
    tu_fill(x, (int64_t)n, 500 + (uint64_t)g_rank, -1, 1);
    tu_fill(go, (int64_t)n, 600 + (uint64_t)g_rank, -1, 1);

    mha_ring_forward_args a;
    mha_ring_stats ws;
    forward_args_fill(&a, x, want, &ws);
    CHECK(mha_ring_forward(m, &a) == MHA_OK, "module forward: %s",
          mha_last_error());

    /* (a) older forward args, without `stats` (garbage past them) */
    const size_t older = offsetof(mha_ring_forward_args, stats);
    mha_ring_forward_args old;
    memset(&old, 0x5A, sizeof old);
    forward_args_fill(&a, x, got, NULL);
    memcpy(&old, &a, older);
    CHECK(mha_ring_forward_sized(m, &old, older, sizeof(mha_ring_stats)) ==
              MHA_OK, "module, older args: %s", mha_last_error());
    CHECK(memcmp(got, want, n * 4) == 0, "module, older args: out differs");

    /* (b) newer, zero tail; (c) newer, set tail on every rank */
    newer_forward_args nf;
    memset(&nf, 0, sizeof nf);
    memset(got, 0, n * 4);
    forward_args_fill(&nf.a, x, got, NULL);
    CHECK(mha_ring_forward_sized(m, &nf.a, sizeof nf,
                                 sizeof(mha_ring_stats)) == MHA_OK,
          "module, newer args: %s", mha_last_error());
    CHECK(memcmp(got, want, n * 4) == 0, "module, newer args: out differs");
    nf.future[1] = 3;
    memset(got, 0, n * 4);
    char text[160];
    refusal_text(text, sizeof text, "mha_ring_forward_args", sizeof nf,
                 sizeof(mha_ring_forward_args));
    expect_all("module, newer args, set tail",
               mha_ring_forward_sized(m, &nf.a, sizeof nf,
                                      sizeof(mha_ring_stats)),
               MHA_ERR_INVALID_ARGUMENT, text);
    CHECK(all_zero(got, n * 4), "module, refused args: out written");

    /* The backward: an older mha_ring_backward_args, without
     * `accumulate` (garbage there would add to grad_params). */
    float *wgq = calloc(n + 1, 4), *gq = calloc(n + 1, 4);
    float *wgp = calloc((size_t)np + 1, 4), *gp = calloc((size_t)np + 1, 4);
    forward_args_fill(&a, x, NULL, NULL);
    mha_ring_backward_args wb = {go, wgq, NULL, NULL, wgp, 0};
    CHECK(mha_ring_backward(m, &a, &wb) == MHA_OK, "module backward: %s",
          mha_last_error());
    const size_t bolder = offsetof(mha_ring_backward_args, accumulate);
    mha_ring_backward_args bold;
    memset(&bold, 0x5A, sizeof bold);
    const mha_ring_backward_args gb = {go, gq, NULL, NULL, gp, 0};
    memcpy(&bold, &gb, bolder);
    tu_fill(gp, np, 7, -1, 1);   /* an accumulate would add to these */
    CHECK(mha_ring_backward_sized(m, &a, sizeof a, &bold, bolder,
                                  sizeof(mha_ring_stats)) == MHA_OK,
          "module backward, older grads: %s", mha_last_error());
    CHECK(memcmp(gq, wgq, n * 4) == 0 &&
              memcmp(gp, wgp, (size_t)np * 4) == 0,
          "module backward, older grads: gradients differ");
    newer_backward_args nb;
    memset(&nb, 0, sizeof nb);
    nb.g = gb;
    tu_fill(gp, np, 8, -1, 1);
    CHECK(mha_ring_backward_sized(m, &a, sizeof a, &nb.g, sizeof nb,
                                  sizeof(mha_ring_stats)) == MHA_OK,
          "module backward, newer grads: %s", mha_last_error());
    CHECK(memcmp(gq, wgq, n * 4) == 0 &&
              memcmp(gp, wgp, (size_t)np * 4) == 0,
          "module backward, newer grads: gradients differ");
    nb.future[1] = 3;
    memset(gq, 0, n * 4);
    refusal_text(text, sizeof text, "mha_ring_backward_args", sizeof nb,
                 sizeof(mha_ring_backward_args));
    expect_all("module backward, newer grads, set tail",
               mha_ring_backward_sized(m, &a, sizeof a, &nb.g, sizeof nb,
                                       sizeof(mha_ring_stats)),
               MHA_ERR_INVALID_ARGUMENT, text);
    CHECK(all_zero(gq, n * 4), "module backward, refused: grad written");
    /* and newer forward args with a set tail, given to the backward */
    nf.a.out = NULL;
    refusal_text(text, sizeof text, "mha_ring_forward_args", sizeof nf,
                 sizeof(mha_ring_forward_args));
    expect_all("module backward, newer forward args, set tail",
               mha_ring_backward_sized(m, &nf.a, sizeof nf, &gb, sizeof gb,
                                       sizeof(mha_ring_stats)),
               MHA_ERR_INVALID_ARGUMENT, text);
    CHECK(all_zero(gq, n * 4), "module backward, refused: grad written");

    free(x); free(go); free(want); free(got);
    free(wgq); free(gq); free(wgp); free(gp);
    mha_free(m);
}

int main(int argc, char **argv)
{
    int provided;
    MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_P);
    CHECK(MHA_MPI_ABI_OK(), "linked libmha_mpi's ABI %d, header's %d",
          mha_mpi_abi_version(), MHA_MPI_ABI_VERSION);
    test_ring_args(0);
    test_ring_args(1);
    test_stats();
    test_module();
    int any = 0;
    MPI_Allreduce(&g_failed, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (g_rank == 0)
        printf("test_mpi_abi, P=%d: %s\n", g_P, any ? "FAILED" : "ok");
    MPI_Finalize();
    return any ? 1 : 0;
}
