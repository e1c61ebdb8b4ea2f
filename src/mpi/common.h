/*
 * common.h -- what the strategies of libmha_mpi share (common.c): errors,
 * the collective argument check, buffers and timing.  Private.
 */
#ifndef MHA_MPI_COMMON_H
#define MHA_MPI_COMMON_H

#include "mha_mpi.h"

#include <stddef.h>
#include <stdint.h>

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
            st = mha_mpi_mpi_fail(rc_, what);              \
            goto done;                             \
        }                                          \
    } while (0)


#define MHA_GOTO_IF(expr)                          \
    do {                                           \
        st = (expr);                               \
        if (st != MHA_OK)                          \
            goto done;                             \
    } while (0)

/* The operations the ranks must agree on (the fingerprint's first field). */
enum {
    MHA_OP_RING_FORWARD = 0,
    MHA_OP_RING_BACKWARD = 1,
    MHA_OP_ULYSSES_FORWARD = 2,
    MHA_OP_ULYSSES_BACKWARD = 3
};

/* One call's state: the library's copies of the caller's structs, the
 * duplicate communicator, the shapes, this rank's shard, the statistics
 * (written to `stats`, stats_size bytes, once the structs are accepted). */
typedef struct ring {
    mha_ring_args a;
    mha_ring_grads g;
    mha_ring_stats *stats;
    size_t stats_size;
    MPI_Comm comm;
    int P, rank;
    int64_t B, H, Hkv, dh, E, Ekv, L;
    int64_t dv, Ev, Evkv;    /* the values' head width, H dv, Hkv dv */
    int64_t C;               /* attention_chunk, 0 for none          */
    float scale;
    mha_shard me;
    int causal;
    mha_ring_stats st;
    double t0;
} ring;

/* Sets the message mha_last_error returns; returns st. */
mha_status mha_mpi_fail(mha_status st, const char *fmt, ...);
/* The ABI rule (mha_mpi.h): the caller's struct `user` of `size` bytes
 * into the library's `copy` of copy_size, zero-extended.  Refused when
 * size is 0 or when a byte past copy_size is set; the known prefix is
 * copied even then, so that the communicator can carry the refusal to
 * the other ranks.  NULL user: copy zeroed, MHA_OK. */
mha_status mha_mpi_struct_in(void *copy, size_t copy_size, const void *user,
                             size_t size, const char *type);
/* An output struct of `size` bytes at `user`: refused when user is set
 * and size is 0. */
mha_status mha_mpi_struct_out_size(const void *user, size_t size,
                                   const char *type);
/* The library's `mine` (mine_size bytes) into the caller's `user` of
 * `size` bytes: min(size, mine_size) bytes, zero past them. */
void mha_mpi_struct_out(void *user, size_t size, const void *mine,
                        size_t mine_size);
/* An MPI error code as MHA_ERR_COMM and MPI's own words. */
mha_status mha_mpi_mpi_fail(int rc, const char *what);
/* The verdict of all ranks on `local`: the same status and message on
 * every rank (the lowest failing rank's). */
mha_status mha_mpi_agree(const ring *r, mha_status local);
/* Copies the caller's args and grads (NULL for a forward) into r->a and
 * r->g, duplicates the communicator (MPI_ERRORS_RETURN), checks this
 * rank's arguments, then compares all ranks' (op: MHA_OP_*): a struct
 * refused by the ABI rule is this rank's argument error, agreed on. */
mha_status mha_mpi_ring_open(const mha_ring_args *args, size_t args_size,
                             const mha_ring_grads *grads, size_t grads_size,
                             size_t stats_size, int op, ring *r);
/* Frees the communicator and writes the statistics. */
void mha_mpi_ring_close(ring *r);
/* Rows [r0, r0 + n) of every batch of x (B, Lx, w) to y (B, n, w), or
 * back when `back`. */
void mha_mpi_rows_copy(float *y, const float *x, int64_t B, int64_t Lx,
                       int64_t w, int64_t r0, int64_t n, int back);
double mha_mpi_now(void);
/* MPI_Waitall, its time counted as waiting. */
int mha_mpi_wait_all(ring *r, int n, MPI_Request *req);
/* Pending requests after a failure: cancelled and freed. */
void mha_mpi_free_requests(MPI_Request *req, int n);
/* malloc, counted in the statistics' workspace. */
void *mha_mpi_alloc_bytes(ring *r, int64_t bytes);

#endif
