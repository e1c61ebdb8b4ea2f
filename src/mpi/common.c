/*
 * common.c -- what the strategies of libmha_mpi share: errors, shards,
 * the collective argument check (every rank returns the same status and
 * message), buffers and timing.
 */
#include "common.h"

#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ------------------------------------------------------------- */

mha_status mha_mpi_fail(mha_status st, const char *fmt, ...)
{
    char msg[8192];   /* libmha's error buffer's size (MHA_ERROR_CAP, core.h) */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return mha_error_set(st, msg);
}

mha_status mha_mpi_mpi_fail(int rc, const char *what)
{
    char s[MPI_MAX_ERROR_STRING];
    int n = 0;
    if (MPI_Error_string(rc, s, &n) != MPI_SUCCESS)
        snprintf(s, sizeof s, "MPI error %d", rc);
    return mha_mpi_fail(MHA_ERR_COMM, "%s failed: %s", what, s);
}

/* ---- the ABI rule (mha_mpi.h) ------------------------------------------- */

int mha_mpi_abi_version(void) { return MHA_MPI_ABI_VERSION; }

mha_status mha_mpi_struct_in(void *copy, size_t copy_size, const void *user,
                             size_t size, const char *type)
{
    memset(copy, 0, copy_size);
    if (!user)
        return MHA_OK;
    if (size == 0)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "%s has size 0: pass sizeof the struct (the "
                            "inline calls of mha_mpi.h do)", type);
    memcpy(copy, user, size < copy_size ? size : copy_size);
    const unsigned char *u = user;
    for (size_t i = copy_size; i < size; i++)
        if (u[i])
            return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                                "%s of %zu bytes sets byte %zu, past the "
                                "%zu that this libmha_mpi (%d.%d.%d) knows: "
                                "a field of a newer mha_mpi.h that this "
                                "library cannot honour", type, size, i,
                                copy_size, MHA_VERSION_MAJOR,
                                MHA_VERSION_MINOR, MHA_VERSION_PATCH);
    return MHA_OK;
}

mha_status mha_mpi_struct_out_size(const void *user, size_t size,
                                   const char *type)
{
    if (user && size == 0)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "%s has size 0: pass sizeof the struct (the "
                            "inline calls of mha_mpi.h do)", type);
    return MHA_OK;
}

void mha_mpi_struct_out(void *user, size_t size, const void *mine,
                        size_t mine_size)
{
    const size_t n = size < mine_size ? size : mine_size;
    memcpy(user, mine, n);
    if (size > n)
        memset((unsigned char *)user + n, 0, size - n);
}

/* ---- shards ------------------------------------------------------------- */

static void chunk(int64_t L, int64_t n, int64_t c, int64_t *off, int64_t *len)
{
    const int64_t base = L / n, extra = L % n;
    *len = base + (c < extra ? 1 : 0);
    *off = c * base + (c < extra ? c : extra);
}

static mha_status shard_of(mha_seq_split split, int64_t L, int nranks,
                           int rank, mha_shard *out)
{
    if (split != MHA_SPLIT_CONTIGUOUS && split != MHA_SPLIT_ZIGZAG)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                    "split must be MHA_SPLIT_CONTIGUOUS (0) or "
                    "MHA_SPLIT_ZIGZAG (1), got %d", (int)split);
    if (L < 1 || nranks < 1 || rank < 0 || rank >= nranks)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
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

mha_status mha_shard_of_sized(mha_seq_split split, int64_t L, int nranks,
                              int rank, mha_shard *out, size_t out_size)
{
    if (!out)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "out is NULL");
    MHA_STATUS_CHECK(mha_mpi_struct_out_size(out, out_size, "mha_shard"));
    mha_shard s = {0};
    const mha_status st = shard_of(split, L, nranks, rank, &s);
    mha_mpi_struct_out(out, out_size, &s, sizeof s);
    return st;
}

/* ---- the collective check ----------------------------------------------- */

enum {
    F_OP, F_SPLIT, F_L, F_B, F_H, F_HKV, F_DH, F_CAUSAL, F_SCALE, F_GIVEN,
    F_LENGTHS, F_LENGTHS_SUM, F_SOFTCAP, F_ALIBI, F_SLOPES, F_WINDOW, F_WL,
    F_WR, F_DV, F_CHUNK, F_N
};
static const char *const FIELD[F_N] = {
    "the call (ring or Ulysses, forward or backward)", "split", "seq_len",
    "batch",
    "num_heads", "num_kv_heads", "head_dim", "causal", "scale",
    "the explicit scale (MHA_GIVEN_SCALE)", "whether key_lengths is given",
    "the key_lengths values", "softcap", "ALiBi", "the ALiBi slopes",
    "the window", "window_left", "window_right", "v_head_dim",
    "attention_chunk"};

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


/* a * b, or INT64_MAX past it (a, b >= 0 once check_local accepts). */
static int64_t mul_sat(int64_t a, int64_t b)
{
    int64_t x;
    return __builtin_mul_overflow(a, b, &x) || x < 0 ? INT64_MAX : x;
}

/* This rank's arguments alone (no communication). */
static mha_status check_local(const mha_ring_args *a, ring *r, int op,
                              const mha_ring_grads *g)
{
    if (a->batch < 1 || a->num_heads < 1 || a->head_dim < 1)
        return mha_mpi_fail(MHA_ERR_SHAPE,
                    "batch, num_heads and head_dim must be >= 1, got %lld, "
                    "%lld, %lld", (long long)a->batch,
                    (long long)a->num_heads, (long long)a->head_dim);
    if (a->v_head_dim < 0)
        return mha_mpi_fail(MHA_ERR_SHAPE,
                    "v_head_dim must be >= 0 (0: head_dim), got %lld",
                    (long long)a->v_head_dim);
    if (a->attention_chunk < 0)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                    "attention_chunk must be >= 0 (0: none), got %lld",
                    (long long)a->attention_chunk);
    if (r->Hkv < 1 || r->H % r->Hkv)
        return mha_mpi_fail(MHA_ERR_SHAPE,
                    "num_kv_heads %lld must divide num_heads %lld",
                    (long long)a->num_kv_heads, (long long)a->num_heads);
    if (a->causal != MHA_CAUSAL_NONE && a->causal != MHA_CAUSAL_TOP_LEFT &&
        a->causal != MHA_CAUSAL_BOTTOM_RIGHT)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT, "causal %d is not an "
                    "mha_causal", (int)a->causal);
    if (!(a->mods.softcap >= 0.0f) || a->mods.softcap == INFINITY)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                    "softcap must be finite and >= 0, got %g",
                    (double)a->mods.softcap);
    if (a->mods.rope.style != MHA_ROPE_NONE)
        return mha_mpi_fail(MHA_ERR_UNSUPPORTED,
                    "mods.rope must be NONE across ranks: rotate q and k "
                    "at their global positions first (mha_rope_apply)");
    if (a->mods.window && (a->mods.window_left < -1 ||
                           a->mods.window_right < -1))
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                    "window bounds must be >= -1, got (%lld, %lld)",
                    (long long)a->mods.window_left,
                    (long long)a->mods.window_right);
    for (int64_t h = 0; a->mods.alibi && a->mods.alibi_slopes &&
                        h < a->num_heads; h++)
        if (!isfinite(a->mods.alibi_slopes[h]))
            return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                    "alibi_slopes[%lld] is %g; slopes must be finite",
                    (long long)h, (double)a->mods.alibi_slopes[h]);
    if (!isfinite(a->scale))
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT, "scale must be finite");
    mha_status s = mha_shard_of(a->split, a->seq_len, r->P, r->rank, &r->me);
    if (s != MHA_OK)
        return s;
    /* (the widest of a K/V block, q, out and their gradients, per row) */
    int64_t n, w = r->Ekv > INT64_MAX - r->Evkv ? INT64_MAX : r->Ekv + r->Evkv;
    w = r->E > w ? r->E : w;
    w = r->Ev > w ? r->Ev : w;
    if (__builtin_mul_overflow(r->B, r->L, &n) ||
        __builtin_mul_overflow(n, w, &n) || n > INT_MAX)
        return mha_mpi_fail(MHA_ERR_OVERFLOW,
                    "a block of B * L * max(Ekv + Evkv, E, Ev) = %lld x %lld "
                    "x %lld floats is past MPI's int count",
                    (long long)r->B, (long long)r->L, (long long)w);
    for (int64_t b = 0; a->key_lengths && b < r->B; b++)
        if (a->key_lengths[b] < 0 || a->key_lengths[b] > r->L)
            return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                        "key_lengths[%lld] is %lld, outside [0, seq_len "
                        "%lld]", (long long)b, (long long)a->key_lengths[b],
                        (long long)r->L);
    const int needs_out = op != MHA_OP_ULYSSES_BACKWARD;
    if (r->me.len > 0 && (!a->q || !a->k || !a->v || (needs_out && !a->out)))
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "%s is NULL",
                    !a->q ? "q" : !a->k ? "k" : !a->v ? "v" : "out");
    if (op == MHA_OP_RING_BACKWARD || op == MHA_OP_ULYSSES_BACKWARD) {
        const int needs_lse = op == MHA_OP_RING_BACKWARD;
        if (!g)
            return mha_mpi_fail(MHA_ERR_NULL_POINTER, "grads is NULL");
        if (r->me.len > 0 && ((needs_lse && !a->lse) || !g->grad_out ||
                              !g->grad_q || !g->grad_k || !g->grad_v))
            return mha_mpi_fail(MHA_ERR_NULL_POINTER, "%s is NULL",
                        needs_lse && !a->lse
                            ? "lse (the forward's, needed by the backward)"
                        : !g->grad_out ? "grad_out"
                        : !g->grad_q   ? "grad_q"
                        : !g->grad_k   ? "grad_k" : "grad_v");
    }
    if ((op == MHA_OP_ULYSSES_FORWARD || op == MHA_OP_ULYSSES_BACKWARD) &&
        (r->H % r->P || r->Hkv % r->P))
        return mha_mpi_fail(MHA_ERR_UNSUPPORTED,
                    "Ulysses splits the heads over the ranks: num_heads "
                    "%lld and num_kv_heads %lld must both be multiples of "
                    "the rank count %d (use the ring otherwise)",
                    (long long)r->H, (long long)r->Hkv, r->P);
    if (a->num_threads < 0)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "num_threads must be >= 0");
    return MHA_OK;
}

/*
 * The verdict of all ranks on `local` (this rank's status, its message in
 * mha_last_error): MHA_OK on every rank when all are, else on every rank
 * the status and message of the lowest failing rank.
 */
mha_status mha_mpi_agree(const ring *r, mha_status local)
{
    const int64_t mine = local != MHA_OK ? -(int64_t)r->rank : -(int64_t)r->P;
    int64_t first;
    int rc = MPI_Allreduce(&mine, &first, 1, MPI_INT64_T, MPI_MAX, r->comm);
    if (rc != MPI_SUCCESS)
        return mha_mpi_mpi_fail(rc, "MPI_Allreduce of the ranks' statuses");
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
        return mha_mpi_mpi_fail(rc, "MPI_Bcast of a rank's error");
    int32_t s32;
    memcpy(&s32, buf, 4);
    buf[sizeof buf - 1] = '\0';
    if (r->rank == first_bad && local == MHA_ERR_COMM)
        return local;   /* its own message, as it was */
    return mha_mpi_fail((mha_status)s32, "rank %d of %d: %s", first_bad, r->P,
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
    f[F_SOFTCAP] = float_bits(a->mods.softcap);
    f[F_ALIBI] = a->mods.alibi != 0;
    f[F_SLOPES] = 0;
    if (local == MHA_OK && a->mods.alibi && a->mods.alibi_slopes) {
        uint64_t h = 1469598103934665603ull;
        for (int64_t x = 0; x < a->num_heads; x++) {
            h ^= (uint64_t)float_bits(a->mods.alibi_slopes[x]);
            h *= 1099511628211ull;
        }
        f[F_SLOPES] = (int64_t)(h >> 1);
    }
    f[F_WINDOW] = a->mods.window != 0;
    f[F_WL] = a->mods.window ? a->mods.window_left : 0;
    f[F_WR] = a->mods.window ? a->mods.window_right : 0;
    f[F_DV] = r->dv;
    f[F_CHUNK] = a->attention_chunk;
    /* A rank's own failure first (its message, on every rank). */
    MHA_STATUS_CHECK(mha_mpi_agree(r, local));
    /* [0, F_N): max; [F_N, 2 F_N): -min. */
    int64_t send[2 * F_N], recv[2 * F_N];
    for (int i = 0; i < F_N; i++) {
        send[i] = f[i];
        send[F_N + i] = -f[i];
    }
    const int rc = MPI_Allreduce(send, recv, 2 * F_N, MPI_INT64_T, MPI_MAX,
                                 r->comm);
    if (rc != MPI_SUCCESS)
        return mha_mpi_mpi_fail(rc, "MPI_Allreduce of the ranks' shapes");
    for (int i = 0; i < F_N; i++)
        if (recv[i] != -recv[F_N + i]) {
            if (i == F_SCALE || i == F_SOFTCAP || i == F_LENGTHS_SUM ||
                i == F_SLOPES)
                return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "the ranks disagree on %s: every rank of the "
                            "communicator must pass the same", FIELD[i]);
            return mha_mpi_fail(i == F_OP ? MHA_ERR_INVALID_ARGUMENT
                                          : MHA_ERR_SHAPE,
                        "the ranks disagree on %s (values from %lld to "
                        "%lld): every rank of the communicator must pass "
                        "the same", FIELD[i], (long long)-recv[F_N + i],
                        (long long)recv[i]);
        }
    return MHA_OK;
}

/* Sets up r (the copies of the caller's structs and the duplicate
 * communicator) and runs both checks.  NULL args, or args of size 0, are
 * answered on this rank alone (no communicator to read); any other
 * refusal goes through the agreement.  On failure r->comm is
 * MPI_COMM_NULL or freed by the caller. */
mha_status mha_mpi_ring_open(const mha_ring_args *args, size_t args_size,
                             const mha_ring_grads *grads, size_t grads_size,
                             size_t stats_size, int op, ring *r)
{
    memset(r, 0, sizeof *r);
    r->comm = MPI_COMM_NULL;
    if (!args)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "ring args are NULL");
    mha_status abi = mha_mpi_struct_in(&r->a, sizeof r->a, args, args_size,
                                       "mha_ring_args");
    if (args_size == 0)
        return abi;
    if (abi == MHA_OK)
        abi = mha_mpi_struct_in(&r->g, sizeof r->g, grads, grads_size,
                                "mha_ring_grads");
    if (abi == MHA_OK)
        abi = mha_mpi_struct_out_size(r->a.stats, stats_size,
                                      "mha_ring_stats");
    const mha_ring_args *a = &r->a;
    int ok = 0;
    if (MPI_Initialized(&ok) != MPI_SUCCESS || !ok)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "MPI is not initialised: call "
                    "MPI_Init first");
    if (MPI_Finalized(&ok) != MPI_SUCCESS || ok)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "MPI is finalised already");
    if (a->comm == MPI_COMM_NULL)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT, "comm is MPI_COMM_NULL");
    r->t0 = MPI_Wtime();
    int rc = MPI_Comm_dup(a->comm, &r->comm);
    if (rc != MPI_SUCCESS) {
        r->comm = MPI_COMM_NULL;
        return mha_mpi_mpi_fail(rc, "MPI_Comm_dup of the communicator");
    }
    MPI_Comm_set_errhandler(r->comm, MPI_ERRORS_RETURN);
    MPI_Comm_size(r->comm, &r->P);
    MPI_Comm_rank(r->comm, &r->rank);
    r->B = a->batch;
    r->H = a->num_heads;
    r->Hkv = a->num_kv_heads ? a->num_kv_heads : a->num_heads;
    r->dh = a->head_dim;
    /* (a negative v_head_dim is refused by check_local: head_dim meanwhile;
     * a width past int64 saturates there, and check_local refuses it) */
    r->dv = a->v_head_dim > 0 ? a->v_head_dim : a->head_dim;
    r->E = mul_sat(r->H, r->dh);
    r->Ekv = mul_sat(r->Hkv, r->dh);
    r->Ev = mul_sat(r->H, r->dv);
    r->Evkv = mul_sat(r->Hkv, r->dv);
    r->C = a->attention_chunk > 0 ? a->attention_chunk : 0;
    r->L = a->seq_len;
    r->causal = a->causal != MHA_CAUSAL_NONE;
    if (abi == MHA_OK) {   /* a refused call writes nothing of the caller's */
        r->stats = a->stats;
        r->stats_size = stats_size;
    }
    const mha_status local =
        abi != MHA_OK ? abi : check_local(a, r, op, grads ? &r->g : NULL);
    return check_all(a, r, op, local);
}

void mha_mpi_ring_close(ring *r)
{
    if (r->comm != MPI_COMM_NULL)
        MPI_Comm_free(&r->comm);
    if (r->stats) {
        r->st.seconds = MPI_Wtime() - r->t0;
        mha_mpi_struct_out(r->stats, r->stats_size, &r->st, sizeof r->st);
    }
}

/* Copies rows [r0, r0 + n) of every batch of x (B, Lx, w) to y (B, n, w),
 * or back when `back`. */
void mha_mpi_rows_copy(float *y, const float *x, int64_t B, int64_t Lx,
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

double mha_mpi_now(void) { return MPI_Wtime(); }

/* Waits for n requests, the time counted as waiting. */
int mha_mpi_wait_all(ring *r, int n, MPI_Request *req)
{
    const double t = mha_mpi_now();
    const int rc = MPI_Waitall(n, req, MPI_STATUSES_IGNORE);
    r->st.seconds_waiting += mha_mpi_now() - t;
    return rc;
}

/* Requests still pending after an MPI failure: cancelled and freed (best
 * effort: the communicator is failing already). */
void mha_mpi_free_requests(MPI_Request *req, int n)
{
    for (int i = 0; i < n; i++)
        if (req[i] != MPI_REQUEST_NULL) {
            MPI_Cancel(&req[i]);
            MPI_Request_free(&req[i]);
        }
}

void *mha_mpi_alloc_bytes(ring *r, int64_t bytes)
{
    void *p = malloc(bytes > 0 ? (size_t)bytes : 1);
    if (p)
        r->st.workspace_bytes += bytes;
    return p;
}

