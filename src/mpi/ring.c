/*
 * ring.c -- exact attention over a sequence split across MPI ranks (Ring
 * Attention), forward and backward, on libmha's public API only.
 *
 *   check     every rank's arguments checked alone, then compared across
 *             ranks (one MPI_Allreduce of a fingerprint): the same status
 *             and message on every rank, before any block moves
 *   forward   step s = 0 .. P-1: this rank holds the K/V block of rank
 *             (r - s) mod P; the next block's receive and this block's
 *             send are posted first, then each (query piece, key piece)
 *             pair of the step runs mha_attention with its lse and is
 *             merged into a float64 (out, lse) accumulator, in step order
 *   backward  the same walk with mha_attention_backward_part; each block's
 *             dK/dV accumulator follows its block one step behind and
 *             comes home at the end
 *
 * A block in flight is one buffer: [k of piece 0][k of piece 1][v of
 * piece 0][v of piece 1], each (B, n_piece, Ekv); its gradient the same
 * with dk, dv.  Pieces are the runs of consecutive positions of a shard
 * (mha_shard_of): with causal masking a pair of pieces is either wholly
 * visible (the keys end before the queries start), the same chunk (top-
 * left causal on it) or wholly hidden (skipped, no work).
 */
#include "mha_mpi.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ---------------------------------------------------------------- */

static mha_status fail(mha_status st, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return mha_error_set(st, msg);
}

static mha_status mpi_fail(int rc, const char *what)
{
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS)
        snprintf(s, sizeof s, "MPI error %d", rc);
    return fail(MHA_ERR_COMM, "%s failed: %s", what, s);
}

#define MHA_STATUS_CHECK(expr)                     \
    do {                                           \
        const mha_status s_ = (expr);              \
        if (s_ != MHA_OK)                          \
            return s_;                             \
    } while (0)

#define MPI_TRY(call, what)                        \
    do {                                           \
        const int rc_ = (call);                    \
        if (rc_ != MPI_SUCCESS) {                  \
            st = mpi_fail(rc_, what);              \
            goto done;                             \
        }                                          \
    } while (0)

/* ---- shards ---------------------------------------------------------------- */

static void chunk(int64_t L, int64_t n, int64_t c, int64_t *off, int64_t *len)
{
    const int64_t base = L / n, extra = L % n;
    *len = base + (c < extra ? 1 : 0);
    *off = c * base + (c < extra ? c : extra);
}

mha_status mha_shard_of(mha_seq_split split, int64_t L, int nranks, int rank,
                        mha_shard *out)
{
    if (!out)
        return fail(MHA_ERR_NULL_POINTER, "out is NULL");
    memset(out, 0, sizeof *out);
    if (split != MHA_SPLIT_CONTIGUOUS && split != MHA_SPLIT_ZIGZAG)
        return fail(MHA_ERR_INVALID_ARGUMENT,
                    "split must be MHA_SPLIT_CONTIGUOUS (0) or "
                    "MHA_SPLIT_ZIGZAG (1), got %d", (int)split);
    if (L < 1 || nranks < 1 || rank < 0 || rank >= nranks)
        return fail(MHA_ERR_INVALID_ARGUMENT,
                    "seq_len must be >= 1, nranks >= 1 and 0 <= rank < "
                    "nranks, got seq_len %lld, nranks %d, rank %d",
                    (long long)L, nranks, rank);
    if (split == MHA_SPLIT_CONTIGUOUS) {
        out->n_pieces = 1;
        chunk(L, nranks, rank, &out->offset[0], &out->length[0]);
    } else {
        out->n_pieces = 2;
        chunk(L, 2 * (int64_t)nranks, rank, &out->offset[0],
              &out->length[0]);
        chunk(L, 2 * (int64_t)nranks, 2 * (int64_t)nranks - 1 - rank,
              &out->offset[1], &out->length[1]);
    }
    out->len = out->length[0] + out->length[1];
    return MHA_OK;
}

/* ---- the collective check ---------------------------------------------------- */

enum {
    F_OP, F_SPLIT, F_L, F_B, F_H, F_HKV, F_DH, F_CAUSAL, F_SCALE, F_GIVEN,
    F_LENGTHS, F_LENGTHS_SUM, F_SOFTCAP, F_N
};
static const char *const FIELD[F_N] = {
    "the call (forward or backward)", "split", "seq_len", "batch",
    "num_heads", "num_kv_heads", "head_dim", "causal", "scale",
    "the explicit scale (MHA_GIVEN_SCALE)", "whether key_lengths is given",
    "the key_lengths values", "softcap"};

static int64_t float_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (int64_t)u;
}

static int64_t lengths_print(const int64_t *len, int64_t B)
{
    uint64_t h = 1469598103934665603ull;
    for (int64_t b = 0; len && b < B; b++) {
        h ^= (uint64_t)len[b];
        h *= 1099511628211ull;
    }
    return (int64_t)(h >> 1);
}

typedef struct ring {
    MPI_Comm comm;
    int P, rank;
    int64_t B, H, Hkv, dh, E, Ekv, L;
    float scale;
    mha_shard me;
    int causal;
    mha_ring_stats st;
    double t0;
} ring;

/* This rank's arguments alone (no communication). */
static mha_status check_local(const mha_ring_args *a, ring *r, int op,
                              const mha_ring_grads *g)
{
    if (a->batch < 1 || a->num_heads < 1 || a->head_dim < 1)
        return fail(MHA_ERR_SHAPE,
                    "batch, num_heads and head_dim must be >= 1, got %lld, "
                    "%lld, %lld", (long long)a->batch,
                    (long long)a->num_heads, (long long)a->head_dim);
    if (r->Hkv < 1 || r->H % r->Hkv)
        return fail(MHA_ERR_SHAPE,
                    "num_kv_heads %lld must divide num_heads %lld",
                    (long long)a->num_kv_heads, (long long)a->num_heads);
    if (a->causal != MHA_CAUSAL_NONE && a->causal != MHA_CAUSAL_TOP_LEFT &&
        a->causal != MHA_CAUSAL_BOTTOM_RIGHT)
        return fail(MHA_ERR_INVALID_ARGUMENT, "causal %d is not an "
                    "mha_causal", (int)a->causal);
    if (!(a->softcap >= 0.0f) || a->softcap == INFINITY)
        return fail(MHA_ERR_INVALID_ARGUMENT,
                    "softcap must be finite and >= 0, got %g",
                    (double)a->softcap);
    if (!isfinite(a->scale))
        return fail(MHA_ERR_INVALID_ARGUMENT, "scale must be finite");
    mha_status s = mha_shard_of(a->split, a->seq_len, r->P, r->rank, &r->me);
    if (s != MHA_OK)
        return s;
    int64_t n;
    if (__builtin_mul_overflow(r->B, r->L, &n) ||
        __builtin_mul_overflow(n, 2 * (r->E > r->Ekv ? r->E : r->Ekv), &n) ||
        n > INT_MAX)
        return fail(MHA_ERR_OVERFLOW,
                    "a block of B * L * 2 * max(E, Ekv) = %lld x %lld x 2 x "
                    "%lld floats is past MPI's int count",
                    (long long)r->B, (long long)r->L,
                    (long long)(r->E > r->Ekv ? r->E : r->Ekv));
    for (int64_t b = 0; a->key_lengths && b < r->B; b++)
        if (a->key_lengths[b] < 0 || a->key_lengths[b] > r->L)
            return fail(MHA_ERR_INVALID_ARGUMENT,
                        "key_lengths[%lld] is %lld, outside [0, seq_len "
                        "%lld]", (long long)b, (long long)a->key_lengths[b],
                        (long long)r->L);
    if (r->me.len > 0 && (!a->q || !a->k || !a->v || !a->out))
        return fail(MHA_ERR_NULL_POINTER, "%s is NULL",
                    !a->q ? "q" : !a->k ? "k" : !a->v ? "v" : "out");
    if (op == 1) {
        if (!g)
            return fail(MHA_ERR_NULL_POINTER, "grads is NULL");
        if (r->me.len > 0 && (!a->lse || !g->grad_out || !g->grad_q ||
                              !g->grad_k || !g->grad_v))
            return fail(MHA_ERR_NULL_POINTER, "%s is NULL",
                        !a->lse ? "lse (the forward's, needed by the "
                                  "backward)"
                        : !g->grad_out ? "grad_out"
                        : !g->grad_q   ? "grad_q"
                        : !g->grad_k   ? "grad_k" : "grad_v");
    }
    if (a->num_threads < 0)
        return fail(MHA_ERR_INVALID_ARGUMENT, "num_threads must be >= 0");
    return MHA_OK;
}

/*
 * The verdict of all ranks on `local` (this rank's status, its message in
 * mha_last_error): MHA_OK on every rank when all are, else on every rank
 * the status and message of the lowest failing rank.
 */
static mha_status agree(const ring *r, mha_status local)
{
    const int64_t mine = local != MHA_OK ? -(int64_t)r->rank : -(int64_t)r->P;
    int64_t first;
    int rc = MPI_Allreduce(&mine, &first, 1, MPI_INT64_T, MPI_MAX, r->comm);
    if (rc != MPI_SUCCESS)
        return mpi_fail(rc, "MPI_Allreduce of the ranks' statuses");
    const int first_bad = (int)-first;
    if (first_bad >= r->P)
        return MHA_OK;
    /* [status][message] from the lowest failing rank. */
    char buf[4 + 512];
    memset(buf, 0, sizeof buf);
    if (r->rank == first_bad) {
        const int32_t s32 = (int32_t)local;
        memcpy(buf, &s32, 4);
        snprintf(buf + 4, 512, "%s", mha_last_error());
    }
    rc = MPI_Bcast(buf, (int)sizeof buf, MPI_CHAR, first_bad, r->comm);
    if (rc != MPI_SUCCESS)
        return mpi_fail(rc, "MPI_Bcast of a rank's error");
    int32_t s32;
    memcpy(&s32, buf, 4);
    buf[sizeof buf - 1] = '\0';
    if (r->rank == first_bad && local == MHA_ERR_COMM)
        return local;   /* its own message, as it was */
    return fail((mha_status)s32, "rank %d of %d: %s", first_bad, r->P,
                buf + 4);
}

/*
 * The collective part: every rank learns whether any rank failed (the
 * lowest such rank's status and message are broadcast) and whether the
 * fingerprints agree (max and min of each field).  Returns the same on
 * every rank.
 */
static mha_status check_all(const mha_ring_args *a, ring *r, int op,
                            mha_status local)
{
    int64_t f[F_N] = {0};
    f[F_OP] = op;
    f[F_SPLIT] = a->split;
    f[F_L] = a->seq_len;
    f[F_B] = a->batch;
    f[F_H] = a->num_heads;
    f[F_HKV] = r->Hkv;
    f[F_DH] = a->head_dim;
    f[F_CAUSAL] = a->causal != MHA_CAUSAL_NONE;
    f[F_SCALE] = float_bits(a->scale);
    f[F_GIVEN] = (a->given & MHA_GIVEN_SCALE) != 0;
    f[F_LENGTHS] = a->key_lengths != NULL;
    f[F_LENGTHS_SUM] = local == MHA_OK ? lengths_print(a->key_lengths,
                                                        a->batch) : 0;
    f[F_SOFTCAP] = float_bits(a->softcap);
    /* A rank's own failure first (its message, on every rank). */
    MHA_STATUS_CHECK(agree(r, local));
    /* [0, F_N): max; [F_N, 2 F_N): -min. */
    int64_t send[2 * F_N], recv[2 * F_N];
    for (int i = 0; i < F_N; i++) {
        send[i] = f[i];
        send[F_N + i] = -f[i];
    }
    const int rc = MPI_Allreduce(send, recv, 2 * F_N, MPI_INT64_T, MPI_MAX,
                                 r->comm);
    if (rc != MPI_SUCCESS)
        return mpi_fail(rc, "MPI_Allreduce of the ranks' shapes");
    for (int i = 0; i < F_N; i++)
        if (recv[i] != -recv[F_N + i]) {
            if (i == F_SCALE || i == F_SOFTCAP || i == F_LENGTHS_SUM)
                return fail(MHA_ERR_INVALID_ARGUMENT,
                            "the ranks disagree on %s: every rank of the "
                            "communicator must pass the same", FIELD[i]);
            return fail(i == F_OP ? MHA_ERR_INVALID_ARGUMENT : MHA_ERR_SHAPE,
                        "the ranks disagree on %s (values from %lld to "
                        "%lld): every rank of the communicator must pass "
                        "the same", FIELD[i], (long long)-recv[F_N + i],
                        (long long)recv[i]);
        }
    return MHA_OK;
}

/* Sets up r (the duplicate communicator included) and runs both checks.
 * On failure r->comm is MPI_COMM_NULL or freed by the caller. */
static mha_status ring_open(const mha_ring_args *a, const mha_ring_grads *g,
                            int op, ring *r)
{
    memset(r, 0, sizeof *r);
    r->comm = MPI_COMM_NULL;
    if (!a)
        return fail(MHA_ERR_NULL_POINTER, "ring args are NULL");
    int ok = 0;
    if (MPI_Initialized(&ok) != MPI_SUCCESS || !ok)
        return fail(MHA_ERR_INVALID_ARGUMENT, "MPI is not initialised: call "
                    "MPI_Init first");
    if (MPI_Finalized(&ok) != MPI_SUCCESS || ok)
        return fail(MHA_ERR_INVALID_ARGUMENT, "MPI is finalised already");
    if (a->comm == MPI_COMM_NULL)
        return fail(MHA_ERR_INVALID_ARGUMENT, "comm is MPI_COMM_NULL");
    r->t0 = MPI_Wtime();
    int rc = MPI_Comm_dup(a->comm, &r->comm);
    if (rc != MPI_SUCCESS) {
        r->comm = MPI_COMM_NULL;
        return mpi_fail(rc, "MPI_Comm_dup of the communicator");
    }
    MPI_Comm_set_errhandler(r->comm, MPI_ERRORS_RETURN);
    MPI_Comm_size(r->comm, &r->P);
    MPI_Comm_rank(r->comm, &r->rank);
    r->B = a->batch;
    r->H = a->num_heads;
    r->Hkv = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    r->dh = a->head_dim;
    r->E = r->H * r->dh;
    r->Ekv = r->Hkv * r->dh;
    r->L = a->seq_len;
    r->causal = a->causal != MHA_CAUSAL_NONE;
    const mha_status local = check_local(a, r, op, g);
    return check_all(a, r, op, local);
}

static void ring_close(ring *r, const mha_ring_args *a)
{
    if (r->comm != MPI_COMM_NULL)
        MPI_Comm_free(&r->comm);
    if (a && a->stats) {
        r->st.seconds = MPI_Wtime() - r->t0;
        *a->stats = r->st;
    }
}

/* ---- the walk -------------------------------------------------------------- */

/* How query piece (qo, qn) sees key piece (ko, kn): 0 not at all, 1
 * wholly, 2 the same chunk (causal top-left on it). */
static int visibility(const ring *r, int64_t qo, int64_t qn, int64_t ko,
                      int64_t kn)
{
    if (qn == 0 || kn == 0)
        return 0;
    if (!r->causal || ko + kn - 1 <= qo)
        return 1;
    if (ko > qo + qn - 1)
        return 0;
    return 2;   /* the same chunk: ko == qo, kn == qn (one partition) */
}

/* Copies rows [r0, r0 + n) of every batch of x (B, Lx, w) to y (B, n, w),
 * or back when `back`. */
static void rows_copy(float *y, const float *x, int64_t B, int64_t Lx,
                      int64_t w, int64_t r0, int64_t n, int back)
{
    for (int64_t b = 0; n > 0 && b < B; b++) {
        float *yy = y + b * n * w;
        float *xx = (float *)x + (b * Lx + r0) * w;
        if (back)
            memcpy(xx, yy, (size_t)(n * w) * sizeof *y);
        else
            memcpy(yy, xx, (size_t)(n * w) * sizeof *y);
    }
}

/* The lse rows [r0, r0 + n) of (B, H, Lx) to (B, H, n), or back. */
static void lse_copy(float *y, const float *x, int64_t BH, int64_t Lx,
                     int64_t r0, int64_t n, int back)
{
    rows_copy(y, x, BH, Lx, 1, r0, n, back);
}

/* Floats of one block in flight: K and V of a shard of len rows. */
static int64_t block_floats(const ring *r, int64_t len)
{
    return 2 * r->B * len * r->Ekv;
}

static mha_shard shard(const ring *r, const mha_ring_args *a, int rank)
{
    mha_shard s;
    mha_shard_of(a->split, r->L, r->P, rank, &s);
    return s;
}

/* The k (is_v 0) or v (1) of piece p of a block of shard s at buf. */
static float *piece_of(const ring *r, float *buf, const mha_shard *s, int p,
                       int is_v)
{
    float *x = buf + (is_v ? r->B * s->len * r->Ekv : 0);
    return x + (p ? r->B * s->length[0] * r->Ekv : 0);
}

/* The arguments of one pair: query piece (q, qn) against key piece
 * (k, v, kn) at key offset ko. */
static mha_attention_args pair_args(const ring *r, const mha_ring_args *a,
                                    const float *q, int64_t qn,
                                    const float *k, const float *v,
                                    int64_t ko, int64_t kn, int vis,
                                    int64_t *kl)
{
    mha_attention_args p = {0};
    p.batch = r->B;
    p.num_heads = r->H;
    p.num_kv_heads = r->Hkv;
    p.head_dim = r->dh;
    p.q_len = qn;
    p.kv_len = kn;
    p.q = q;
    p.k = k;
    p.v = v;
    p.scale = a->scale;
    p.given = a->given;
    p.causal = vis == 2 ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    if (a->key_lengths) {
        for (int64_t b = 0; b < r->B; b++) {
            const int64_t x = a->key_lengths[b] - ko;
            kl[b] = x < 0 ? 0 : x > kn ? kn : x;
        }
        p.key_lengths = kl;
    }
    p.mods.softcap = a->softcap;
    p.num_threads = a->num_threads;
    return p;
}

/* Rows [r0, r0 + n) of the accumulator (out (B, nloc, E) and lse
 * (B, H, nloc), float64) merged with a part (po (B, n, E), pl (B, H, n)):
 * lse = log(e^acc + e^part), out weighted, in float64. */
static void merge_into(const ring *r, int64_t nloc, int64_t r0, int64_t n,
                       double *ao, double *al, const float *po,
                       const float *pl)
{
    for (int64_t b = 0; b < r->B; b++)
        for (int64_t h = 0; h < r->H; h++)
            for (int64_t i = 0; i < n; i++) {
                const int64_t xp = (b * r->H + h) * n + i;
                const int64_t x = (b * r->H + h) * nloc + r0 + i;
                double *o = ao + (b * nloc + r0 + i) * r->E + h * r->dh;
                const float *p = po + (b * n + i) * r->E + h * r->dh;
                const double lp = pl[xp], la = al[x];
                if (lp == -INFINITY)
                    continue;
                if (la == -INFINITY) {
                    for (int64_t d = 0; d < r->dh; d++)
                        o[d] = p[d];
                    al[x] = lp;
                    continue;
                }
                const double m = la > lp ? la : lp;
                const double wa = exp(la - m), wp = exp(lp - m);
                const double s = wa + wp;
                for (int64_t d = 0; d < r->dh; d++)
                    o[d] = (o[d] * wa + p[d] * wp) / s;
                al[x] = m + log(s);
            }
}

static double now(void) { return MPI_Wtime(); }

/* Waits for n requests, the time counted as waiting. */
static int wait_all(ring *r, int n, MPI_Request *req)
{
    const double t = now();
    const int rc = MPI_Waitall(n, req, MPI_STATUSES_IGNORE);
    r->st.seconds_waiting += now() - t;
    return rc;
}

/* Packs this rank's K and V into a block buffer. */
static void pack_own(const ring *r, const mha_ring_args *a, float *buf)
{
    for (int p = 0; p < r->me.n_pieces; p++) {
        const int64_t r0 = p ? r->me.length[0] : 0, n = r->me.length[p];
        rows_copy(piece_of(r, buf, &r->me, p, 0), a->k, r->B, r->me.len,
                  r->Ekv, r0, n, 0);
        rows_copy(piece_of(r, buf, &r->me, p, 1), a->v, r->B, r->me.len,
                  r->Ekv, r0, n, 0);
    }
}

/* Requests still pending after an MPI failure: cancelled and freed (best
 * effort: the communicator is failing already). */
static void free_requests(MPI_Request *req, int n)
{
    for (int i = 0; i < n; i++)
        if (req[i] != MPI_REQUEST_NULL) {
            MPI_Cancel(&req[i]);
            MPI_Request_free(&req[i]);
        }
}

static void *alloc_bytes(ring *r, int64_t bytes)
{
    void *p = malloc(bytes > 0 ? (size_t)bytes : 1);
    if (p)
        r->st.workspace_bytes += bytes;
    return p;
}

/* ---- forward ------------------------------------------------------------------ */

mha_status mha_ring_attention(const mha_ring_args *a)
{
    ring r;
    mha_status st = ring_open(a, NULL, 0, &r);
    float *kv[2] = {NULL, NULL}, *qp[2] = {NULL, NULL};
    float *po = NULL, *pl = NULL;
    double *ao = NULL, *al = NULL;
    int64_t *kl = NULL;
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (st != MHA_OK)
        goto done;

    int64_t maxlen = 0;
    for (int x = 0; x < r.P; x++) {
        const mha_shard s = shard(&r, a, x);
        maxlen = s.len > maxlen ? s.len : maxlen;
    }
    const int64_t nloc = r.me.len, nq = r.B * nloc * r.E;
    const int64_t maxpiece = r.me.length[0] > r.me.length[1]
                                 ? r.me.length[0] : r.me.length[1];
    kv[0] = alloc_bytes(&r, block_floats(&r, maxlen) * 4);
    kv[1] = alloc_bytes(&r, block_floats(&r, maxlen) * 4);
    po = alloc_bytes(&r, r.B * maxpiece * r.E * 4);
    pl = alloc_bytes(&r, r.B * r.H * maxpiece * 4);
    ao = alloc_bytes(&r, nq * 8);
    al = alloc_bytes(&r, r.B * r.H * nloc * 8);
    kl = alloc_bytes(&r, r.B * 8);
    int fail_alloc = !kv[0] || !kv[1] || !po || !pl || !ao || !al || !kl;
    /* Query pieces as problems of their own: zig-zag pieces copied. */
    const float *qpiece[2] = {a->q, NULL};
    for (int p = 0; r.me.n_pieces == 2 && p < 2 && !fail_alloc; p++) {
        qp[p] = alloc_bytes(&r, r.B * r.me.length[p] * r.E * 4);
        fail_alloc |= !qp[p];
        if (qp[p])
            rows_copy(qp[p], a->q, r.B, nloc, r.E, p ? r.me.length[0] : 0,
                      r.me.length[p], 0);
        qpiece[p] = qp[p];
    }
    /* No rank starts a ring that another cannot finish. */
    st = fail_alloc ? fail(MHA_ERR_OUT_OF_MEMORY,
                           "out of memory for the ring's buffers (%lld "
                           "bytes)", (long long)r.st.workspace_bytes)
                    : MHA_OK;
    st = agree(&r, st);
    if (st != MHA_OK)
        goto done;
    for (int64_t x = 0; x < r.B * r.H * nloc; x++)
        al[x] = -INFINITY;
    memset(ao, 0, (size_t)nq * sizeof *ao);
    if (nloc > 0)
        pack_own(&r, a, kv[0]);

    /* A block that fails here (out of memory inside mha_attention) stops
     * this rank's compute, not its part in the ring: the others are not
     * left waiting, and the verdict after the ring is everyone's. */
    const int next = (r.rank + 1) % r.P, prev = (r.rank + r.P - 1) % r.P;
    for (int s = 0; s < r.P; s++) {
        const int src = (r.rank - s + r.P) % r.P;
        const mha_shard ks = shard(&r, a, src);
        float *cur = kv[s % 2];
        if (s + 1 < r.P) {
            const mha_shard ns = shard(&r, a, (src - 1 + r.P) % r.P);
            const int64_t nsend = block_floats(&r, ks.len);
            const int64_t nrecv = block_floats(&r, ns.len);
            MPI_TRY(MPI_Irecv(kv[(s + 1) % 2], (int)nrecv, MPI_FLOAT, prev,
                              s, r.comm, &req[0]), "MPI_Irecv of a K/V block");
            MPI_TRY(MPI_Isend(cur, (int)nsend, MPI_FLOAT, next, s, r.comm,
                              &req[1]), "MPI_Isend of a K/V block");
            r.st.messages_sent++;
            r.st.bytes_sent += nsend * 4;
            r.st.messages_received++;
            r.st.bytes_received += nrecv * 4;
        }
        const double t = now();
        for (int qpi = 0; st == MHA_OK && qpi < r.me.n_pieces; qpi++) {
            const int64_t qo = r.me.offset[qpi], qn = r.me.length[qpi];
            const int64_t r0 = qpi ? r.me.length[0] : 0;
            for (int kp = 0; st == MHA_OK && kp < ks.n_pieces; kp++) {
                const int vis = visibility(&r, qo, qn, ks.offset[kp],
                                           ks.length[kp]);
                if (!vis)
                    continue;
                mha_attention_args pa = pair_args(
                    &r, a, qpiece[qpi], qn, piece_of(&r, cur, &ks, kp, 0),
                    piece_of(&r, cur, &ks, kp, 1), ks.offset[kp],
                    ks.length[kp], vis, kl);
                pa.out = po;
                pa.lse = pl;
                st = mha_attention(&pa);
                if (st == MHA_OK)
                    merge_into(&r, nloc, r0, qn, ao, al, po, pl);
                /* Let the transfers progress between blocks. */
                int flag;
                MPI_Testall(2, req, &flag, MPI_STATUSES_IGNORE);
            }
        }
        r.st.seconds_compute += now() - t;
        if (s + 1 < r.P)
            MPI_TRY(wait_all(&r, 2, req), "MPI_Waitall of a K/V block");
    }
    st = agree(&r, st);
    if (st != MHA_OK)
        goto done;
    for (int64_t x = 0; x < nq; x++)
        a->out[x] = (float)ao[x];
    if (a->lse)
        for (int64_t x = 0; x < r.B * r.H * nloc; x++)
            a->lse[x] = (float)al[x];

done:
    free_requests(req, 2);
    free(kv[0]);
    free(kv[1]);
    free(qp[0]);
    free(qp[1]);
    free(po);
    free(pl);
    free(ao);
    free(al);
    free(kl);
    ring_close(&r, a);
    return st;
}

/* ---- backward ----------------------------------------------------------------- */

/* y[x] += x[x] for n floats, in index order. */
static void add_floats(float *y, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] += x[i];
}

mha_status mha_ring_attention_backward(const mha_ring_args *a,
                                       const mha_ring_grads *g)
{
    ring r;
    mha_status st = ring_open(a, g, 1, &r);
    float *kv[2] = {NULL, NULL}, *dkv[2] = {NULL, NULL}, *loc = NULL;
    float *cp[4][2] = {{NULL, NULL}, {NULL, NULL}, {NULL, NULL},
                       {NULL, NULL}};
    float *pdq = NULL, *pdk = NULL, *pdv = NULL;
    double *dq = NULL;
    int64_t *kl = NULL;
    /* kv receive, kv send, dkv receive, dkv send from dkv[0], dkv[1] */
    MPI_Request req[5] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                          MPI_REQUEST_NULL, MPI_REQUEST_NULL,
                          MPI_REQUEST_NULL};
    if (st != MHA_OK)
        goto done;

    int64_t maxlen = 0;
    for (int x = 0; x < r.P; x++) {
        const mha_shard s = shard(&r, a, x);
        maxlen = s.len > maxlen ? s.len : maxlen;
    }
    const int64_t nloc = r.me.len, nq = r.B * nloc * r.E;
    const int64_t BH = r.B * r.H;
    const int64_t maxpiece = r.me.length[0] > r.me.length[1]
                                 ? r.me.length[0] : r.me.length[1];
    const int64_t nblock = block_floats(&r, maxlen);
    for (int i = 0; i < 2; i++) {
        kv[i] = alloc_bytes(&r, nblock * 4);
        dkv[i] = alloc_bytes(&r, nblock * 4);
    }
    loc = alloc_bytes(&r, nblock * 4);
    pdq = alloc_bytes(&r, r.B * maxpiece * r.E * 4);
    pdk = alloc_bytes(&r, r.B * maxlen * r.Ekv * 4);
    pdv = alloc_bytes(&r, r.B * maxlen * r.Ekv * 4);
    dq = alloc_bytes(&r, nq * 8);
    kl = alloc_bytes(&r, r.B * 8);
    int fail_alloc = !kv[0] || !kv[1] || !dkv[0] || !dkv[1] || !loc ||
                     !pdq || !pdk || !pdv || !dq || !kl;
    /* Per query piece: q, out, grad_out and lse as problems of their own
     * (the caller's arrays with one piece; copies with two). */
    const float *qv[2] = {a->q, NULL}, *ov[2] = {a->out, NULL};
    const float *gv[2] = {g ? g->grad_out : NULL, NULL}, *lv[2] = {a->lse,
                                                                    NULL};
    for (int p = 0; r.me.n_pieces == 2 && p < 2 && !fail_alloc; p++) {
        const int64_t n = r.me.length[p], r0 = p ? r.me.length[0] : 0;
        for (int c = 0; c < 4; c++) {
            cp[c][p] = alloc_bytes(&r, (c == 3 ? BH * n : r.B * n * r.E) * 4);
            fail_alloc |= !cp[c][p];
        }
        if (fail_alloc)
            break;
        rows_copy(cp[0][p], a->q, r.B, nloc, r.E, r0, n, 0);
        rows_copy(cp[1][p], a->out, r.B, nloc, r.E, r0, n, 0);
        rows_copy(cp[2][p], g->grad_out, r.B, nloc, r.E, r0, n, 0);
        lse_copy(cp[3][p], a->lse, BH, nloc, r0, n, 0);
        qv[p] = cp[0][p];
        ov[p] = cp[1][p];
        gv[p] = cp[2][p];
        lv[p] = cp[3][p];
    }
    st = fail_alloc ? fail(MHA_ERR_OUT_OF_MEMORY,
                           "out of memory for the ring's buffers (%lld "
                           "bytes)", (long long)r.st.workspace_bytes)
                    : MHA_OK;
    st = agree(&r, st);
    if (st != MHA_OK)
        goto done;
    memset(dq, 0, (size_t)nq * sizeof *dq);
    if (nloc > 0)
        pack_own(&r, a, kv[0]);

    const int next = (r.rank + 1) % r.P, prev = (r.rank + r.P - 1) % r.P;
    for (int s = 0; s < r.P; s++) {
        const int src = (r.rank - s + r.P) % r.P;
        const mha_shard ks = shard(&r, a, src);
        const int64_t nks = block_floats(&r, ks.len);
        float *cur = kv[s % 2], *acc = dkv[s % 2];
        if (s + 1 < r.P) {
            const mha_shard ns = shard(&r, a, (src - 1 + r.P) % r.P);
            const int64_t nrecv = block_floats(&r, ns.len);
            MPI_TRY(MPI_Irecv(kv[(s + 1) % 2], (int)nrecv, MPI_FLOAT, prev,
                              s, r.comm, &req[0]), "MPI_Irecv of a K/V block");
            MPI_TRY(MPI_Isend(cur, (int)nks, MPI_FLOAT, next, s, r.comm,
                              &req[1]), "MPI_Isend of a K/V block");
            r.st.messages_sent++;
            r.st.bytes_sent += nks * 4;
            r.st.messages_received++;
            r.st.bytes_received += nrecv * 4;
        }
        if (s >= 1) {
            /* block src's gradient so far, from the rank before: into a
             * buffer whose send of two steps ago has completed */
            MPI_TRY(wait_all(&r, 1, &req[3 + s % 2]),
                    "MPI_Wait of a dK/dV send");
            MPI_TRY(MPI_Irecv(acc, (int)nks, MPI_FLOAT, prev, r.P + s,
                              r.comm, &req[2]), "MPI_Irecv of a dK/dV block");
            r.st.messages_received++;
            r.st.bytes_received += nks * 4;
        }
        const double t = now();
        memset(loc, 0, (size_t)nks * sizeof *loc);
        for (int qpi = 0; st == MHA_OK && qpi < r.me.n_pieces; qpi++) {
            const int64_t qo = r.me.offset[qpi], qn = r.me.length[qpi];
            const int64_t r0 = qpi ? r.me.length[0] : 0;
            for (int kp = 0; st == MHA_OK && kp < ks.n_pieces; kp++) {
                const int64_t kn = ks.length[kp];
                const int vis = visibility(&r, qo, qn, ks.offset[kp], kn);
                if (!vis)
                    continue;
                const mha_attention_args pa = pair_args(
                    &r, a, qv[qpi], qn, piece_of(&r, cur, &ks, kp, 0),
                    piece_of(&r, cur, &ks, kp, 1), ks.offset[kp], kn, vis,
                    kl);
                const mha_attention_grads pg = {gv[qpi], pdq, pdk, pdv,
                                                NULL};
                st = mha_attention_backward_part(&pa, lv[qpi], ov[qpi], &pg);
                if (st != MHA_OK)
                    break;
                for (int64_t b = 0; b < r.B; b++)
                    for (int64_t i = 0; i < qn * r.E; i++)
                        dq[(b * nloc + r0) * r.E + i] += pdq[b * qn * r.E + i];
                add_floats(piece_of(&r, loc, &ks, kp, 0), pdk,
                           r.B * kn * r.Ekv);
                add_floats(piece_of(&r, loc, &ks, kp, 1), pdv,
                           r.B * kn * r.Ekv);
                int flag;
                MPI_Testall(3, req, &flag, MPI_STATUSES_IGNORE);
            }
        }
        r.st.seconds_compute += now() - t;
        if (s == 0) {
            memcpy(acc, loc, (size_t)nks * sizeof *acc);
        } else {
            MPI_TRY(wait_all(&r, 1, &req[2]), "MPI_Wait of a dK/dV block");
            add_floats(acc, loc, nks);   /* the ring's order: acc + mine */
        }
        if (r.P > 1) {
            /* on to the next rank (after the last step: home) */
            MPI_TRY(MPI_Isend(acc, (int)nks, MPI_FLOAT, next, r.P + s + 1,
                              r.comm, &req[3 + s % 2]),
                    "MPI_Isend of a dK/dV block");
            r.st.messages_sent++;
            r.st.bytes_sent += nks * 4;
        }
        if (s + 1 < r.P)
            MPI_TRY(wait_all(&r, 2, req), "MPI_Waitall of a K/V block");
    }
    /* This rank's own block comes home, complete. */
    float *home = r.P > 1 ? loc : dkv[0];
    if (r.P > 1) {
        const int64_t n = block_floats(&r, nloc);
        MPI_TRY(MPI_Irecv(loc, (int)n, MPI_FLOAT, prev, 2 * r.P, r.comm,
                          &req[2]), "MPI_Irecv of this rank's dK/dV");
        r.st.messages_received++;
        r.st.bytes_received += n * 4;
        MPI_TRY(wait_all(&r, 3, &req[2]), "MPI_Waitall of the dK/dV sends");
    }
    st = agree(&r, st);
    if (st != MHA_OK)
        goto done;
    for (int p = 0; p < r.me.n_pieces; p++) {
        const int64_t r0 = p ? r.me.length[0] : 0, n = r.me.length[p];
        rows_copy(piece_of(&r, home, &r.me, p, 0), g->grad_k, r.B, nloc,
                  r.Ekv, r0, n, 1);
        rows_copy(piece_of(&r, home, &r.me, p, 1), g->grad_v, r.B, nloc,
                  r.Ekv, r0, n, 1);
    }
    for (int64_t x = 0; x < nq; x++)
        g->grad_q[x] = (float)dq[x];

done:
    free_requests(req, 5);
    for (int i = 0; i < 2; i++) {
        free(kv[i]);
        free(dkv[i]);
        for (int c = 0; c < 4; c++)
            free(cp[c][i]);
    }
    free(loc);
    free(pdq);
    free(pdk);
    free(pdv);
    free(dq);
    free(kl);
    ring_close(&r, a);
    return st;
}
