/*
 * mha_mpi.h -- libmha_mpi: exact attention over a sequence split across
 * MPI ranks (Ring Attention, Liu et al. 2023).  A separate library, built
 * when CMake finds MPI (option MHA_MPI); libmha itself never depends on
 * MPI.  Link with mha::mha_mpi (or -lmha_mpi -lmha and MPI's flags).
 *
 * Every rank holds a shard of one sequence of seq_len = L tokens: its
 * queries, keys and values (already projected into heads, as
 * mha_attention takes them).  K/V blocks travel round the ring of ranks
 * (rank r sends to r + 1 and receives from r - 1), each step's transfer
 * posted (MPI_Isend / MPI_Irecv into a second buffer) before the step's
 * block is computed; each query row's partial results are merged by
 * log-sum-exp in float64, in a fixed order (the ring's steps), so a
 * result is bitwise the same run to run and for every num_threads, for
 * a given rank count.  Results for different rank counts differ by
 * float rounding only.
 *
 * Every call is collective over `comm`: every rank of it must make the
 * same call.  The shapes and options of all ranks are compared first (an
 * MPI_Allreduce): when they disagree, or when any rank's own arguments
 * are wrong, every rank returns the same status and the same message
 * (naming the field, or the first failing rank and its message), and no
 * block is sent.  MPI calls run on a duplicate of `comm` with
 * MPI_ERRORS_RETURN: a failing MPI call becomes MHA_ERR_COMM and a
 * message, never an abort.  (Whether the others notice a rank that dies
 * is up to the MPI runtime: Open MPI's mpirun ends the whole job.)
 * MPI must be initialised (MPI_Init_thread with at least
 * MPI_THREAD_FUNNELED when num_threads > 1: libmha's OpenMP threads make
 * no MPI calls).
 *
 * The ABI rule, mha.h's (MHA_MPI_ABI_VERSION is the soname's number:
 * libmha_mpi.so.1).  Every call that takes or fills a struct of this
 * header is an inline wrapper that passes the struct's size as the
 * program was compiled (sizeof) to an exported NAME_sized call.  Structs
 * only grow, at their end, and zero is every field's default, so:
 *   - a smaller struct (an older mha_mpi.h) is read up to its size, the
 *     fields after it taken as zero;
 *   - a larger one (a newer mha_mpi.h) runs when the bytes this library
 *     does not know are zero, and is refused (MHA_ERR_INVALID_ARGUMENT,
 *     naming the struct and the byte) when one is set.  The refusal is
 *     this rank's argument error like any other: every rank returns it,
 *     and a rank with a newer struct never leaves the others waiting;
 *   - mha_shard (mha_shard_of) is filled up to the caller's size;
 *   - mha_ring_stats, reached through the args' `stats` pointer, has its
 *     size passed as an argument of its own (stats_size: the inline calls
 *     pass sizeof(mha_ring_stats)), so a stats struct of any header's
 *     size can hang off args of any other.
 * A struct the library fills gets its fields up to the caller's size and
 * zero past the library's own (fields of a newer header it does not
 * measure); bytes past the caller's size are never written.  A size of 0
 * is refused (for the args themselves on that rank alone: there is no
 * communicator to read).  Frozen, as in mha.h: mha_modifiers inside
 * mha_ring_args.  The soname changes only on a real break; a program
 * loading libmha_mpi by other means checks MHA_MPI_ABI_OK().
 */
#ifndef MHA_MPI_H
#define MHA_MPI_H

#include <mpi.h>

#include "mha.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MHA_MPI_ABI_VERSION 1

/* MHA_MPI_ABI_VERSION of the libmha_mpi actually linked. */
MHA_API int mha_mpi_abi_version(void);
/* Nonzero when the linked libmha_mpi keeps this header's ABI. */
#define MHA_MPI_ABI_OK() (mha_mpi_abi_version() == MHA_MPI_ABI_VERSION)

/*
 * How the L tokens are cut into shards.
 *   CONTIGUOUS  P chunks: rank r holds chunk r.
 *   ZIGZAG      2P chunks: rank r holds chunks r and 2P - 1 - r, in that
 *               order (head and tail), so that with causal masking every
 *               rank does the same work.
 * Chunk c of n has L / n tokens, one more for c < L % n, in order: a
 * shard may be empty when L < n.
 */
typedef enum mha_seq_split {
    MHA_SPLIT_CONTIGUOUS = 0,
    MHA_SPLIT_ZIGZAG = 1
} mha_seq_split;

/* Where one rank's shard lies: its rows are piece 0's tokens, then piece
 * 1's (zig-zag), each a run of consecutive positions. */
typedef struct mha_shard {
    int n_pieces;        /* 1 (contiguous) or 2 (zig-zag)                  */
    int64_t offset[2];   /* global position of each piece's first token   */
    int64_t length[2];   /* its tokens (0 when L is shorter than the cut) */
    int64_t len;         /* length[0] + length[1]: the shard's rows       */
} mha_shard;

/* The shard of `rank` of `nranks` for a sequence of seq_len tokens
 * (*out zeroed on failure). */
MHA_API mha_status mha_shard_of_sized(mha_seq_split split, int64_t seq_len,
                                      int nranks, int rank, mha_shard *out,
                                      size_t out_size);
static inline mha_status mha_shard_of(mha_seq_split split, int64_t seq_len,
                                      int nranks, int rank, mha_shard *out)
{
    return mha_shard_of_sized(split, seq_len, nranks, rank, out,
                              sizeof *out);
}

/* What one call did on this rank, written when args->stats is set
 * (stats_size bytes of it, the ABI rule above), unless that rule refused
 * one of the call's structs. */
typedef struct mha_ring_stats {
    int64_t messages_sent, bytes_sent;         /* by this rank           */
    int64_t messages_received, bytes_received;
    int64_t workspace_bytes;   /* allocated by the call on this rank     */
    double seconds;            /* the whole call, checks included        */
    double seconds_compute;    /* the blocks' attention and the merges   */
    double seconds_waiting;    /* blocked in MPI_Wait*: communication
                                  that the compute did not hide          */
} mha_ring_stats;

/*
 * One rank's arguments.  Zero-initialise, then fill.  With Lloc = this
 * rank's mha_shard_of(...).len, E = num_heads * head_dim,
 * Ekv = num_kv_heads * head_dim, and with values of another head width
 * (v_head_dim = d_v) Ev = num_heads * d_v, Evkv = num_kv_heads * d_v
 * (E and Ekv without it):
 *     q    (B, Lloc, E)     k (B, Lloc, Ekv)   v (B, Lloc, Evkv)
 *     out  (B, Lloc, Ev)
 *     lse  (B, H, Lloc) or NULL: each row's log-sum-exp over all L keys
 * Self-attention on one sequence: queries and keys share the positions
 * and the split.  causal: NONE, or TOP_LEFT / BOTTOM_RIGHT (the same
 * here, Lq = Lk = L): token i sees tokens j <= i.  key_lengths (B), the
 * same on every rank: keys at global positions >= key_lengths[b] are
 * masked.  mods: the softcap, ALiBi (its distance and the window's
 * measured between global positions) and the window, as in
 * mha_attention; RoPE must be NONE (rotate q and k at their global
 * positions first, mha_rope_apply; mha_ring_forward does).
 * attention_chunk: Llama 4's chunked attention, chunks counted from
 * global position 0 (the ring cuts each pair of pieces at the chunks'
 * edges; Ulysses runs the whole sequence).  No other mask, no sinks,
 * dropout or weights (a rank never holds a whole row).
 */
typedef struct mha_ring_args {
    MPI_Comm comm;
    mha_seq_split split;
    int64_t seq_len;                 /* L >= 1, over all ranks           */
    int64_t batch, num_heads, num_kv_heads, head_dim;  /* H_kv 0 -> H    */
    const float *q, *k, *v;
    float scale;                     /* 0 -> 1/sqrt(d_h) unless given    */
    unsigned given;                  /* MHA_GIVEN_SCALE                  */
    mha_causal causal;
    const int64_t *key_lengths;      /* (B) or NULL                      */
    mha_modifiers mods;              /* softcap, ALiBi, window; no RoPE  */
    int num_threads;                 /* libmha's threads for each block  */
    float *out;                      /* forward: written; backward: the
                                        forward's output, read          */
    float *lse;                      /* forward: written when not NULL;
                                        backward: the forward's, read
                                        (required)                      */
    mha_ring_stats *stats;           /* NULL, or this rank's counts      */
    int64_t v_head_dim;              /* d_v, the values' head width; 0 ->
                                        head_dim (Ev = H * d_v below)    */
    int64_t attention_chunk;         /* C: a token sees only the tokens of
                                        its chunk of C global positions;
                                        0: none                         */
} mha_ring_args;

/*
 * The forward: out (and lse) of this rank's queries against all L keys.
 * Each rank sends P - 1 blocks (its K and V shard, then each one it
 * received), one message per step, of B * Lsrc * (Ekv + Evkv) floats.
 */
MHA_API mha_status mha_ring_attention_sized(const mha_ring_args *args,
                                            size_t args_size,
                                            size_t stats_size);
static inline mha_status mha_ring_attention(const mha_ring_args *args)
{
    return mha_ring_attention_sized(args, sizeof *args,
                                    sizeof(mha_ring_stats));
}

/*
 * The backward of mha_ring_attention (same args, out and lse the
 * forward's): dL/dq of this rank's queries, dL/dk and dL/dv of its keys
 * and values, all overwritten.  K/V blocks travel the ring as in the
 * forward; each block's dK/dV accumulator travels one step behind it,
 * each rank adding its share (mha_attention_backward_part) in ring
 * order, and comes home after P steps: P - 1 K/V messages and P
 * gradient messages per rank.  dq sums its shares in float64 in step
 * order.
 */
typedef struct mha_ring_grads {
    const float *grad_out;   /* (B, Lloc, Ev)   */
    float *grad_q;           /* (B, Lloc, E)    */
    float *grad_k;           /* (B, Lloc, Ekv)  */
    float *grad_v;           /* (B, Lloc, Evkv) */
} mha_ring_grads;
MHA_API mha_status mha_ring_attention_backward_sized(
    const mha_ring_args *args, size_t args_size, const mha_ring_grads *grads,
    size_t grads_size, size_t stats_size);
static inline mha_status mha_ring_attention_backward(
    const mha_ring_args *args, const mha_ring_grads *grads)
{
    return mha_ring_attention_backward_sized(args, sizeof *args, grads,
                                             sizeof *grads,
                                             sizeof(mha_ring_stats));
}

/*
 * Ulysses (DeepSpeed-Ulysses), the second strategy, for num_heads and
 * num_kv_heads both multiples of P: an all-to-all turns the sequence
 * split into a head split (each rank then holds all L tokens of H / P
 * query heads and H_kv / P K/V heads), mha_attention runs locally, and an
 * all-to-all turns the output (and lse) back into this rank's shard.
 * Same arguments and results as the ring; each (batch, head) is computed
 * as one process computes it, so out and lse are bitwise the single-
 * process mha_attention's, for every P.  Per rank: memory O(B L E / P),
 * all-to-alls of about (P - 1) / P of the shard per tensor (q, k, v
 * and out forward; q, k, v, dO, dq, dk, dv backward), not overlapped with
 * compute.  The backward runs mha_attention_backward on the local heads
 * (it recomputes the forward; out and lse are not read).
 */
MHA_API mha_status mha_ulysses_attention_sized(const mha_ring_args *args,
                                               size_t args_size,
                                               size_t stats_size);
static inline mha_status mha_ulysses_attention(const mha_ring_args *args)
{
    return mha_ulysses_attention_sized(args, sizeof *args,
                                       sizeof(mha_ring_stats));
}
MHA_API mha_status mha_ulysses_attention_backward_sized(
    const mha_ring_args *args, size_t args_size, const mha_ring_grads *grads,
    size_t grads_size, size_t stats_size);
static inline mha_status mha_ulysses_attention_backward(
    const mha_ring_args *args, const mha_ring_grads *grads)
{
    return mha_ulysses_attention_backward_sized(args, sizeof *args, grads,
                                                sizeof *grads,
                                                sizeof(mha_ring_stats));
}

/*
 * The module across ranks: each rank projects its shard of the inputs
 * with the module's weights (mha_project, local), the attention runs
 * across the ranks (the ring, or Ulysses), and each rank projects its
 * rows of the result by out_proj (local).  Self-attention on one sequence
 * split as above; key and value NULL -> the query.  RoPE rotates each
 * rank's q and k at their global positions before the attention; the
 * softcap, ALiBi and the window are kept (measured between global
 * positions); modules with add_bias_kv, add_zero_attn or sinks are
 * refused (MHA_ERR_UNSUPPORTED).  No dropout; mha_ring_backward below
 * is its backward.
 *     query (B, Lloc, E), key (B, Lloc, kdim), value (B, Lloc, vdim),
 *     out (B, Lloc, E)
 */
typedef struct mha_ring_forward_args {
    MPI_Comm comm;
    mha_seq_split split;
    int64_t seq_len, batch;
    const float *query, *key, *value;
    mha_causal causal;
    const int64_t *key_lengths;   /* (B) or NULL, as in mha_ring_args */
    int num_threads;
    int ulysses;                  /* nonzero: Ulysses instead of the ring */
    float *out;
    mha_ring_stats *stats;        /* NULL, or the attention's statistics */
} mha_ring_forward_args;
MHA_API mha_status mha_ring_forward_sized(const mha_module *module,
                                          const mha_ring_forward_args *args,
                                          size_t args_size,
                                          size_t stats_size);
static inline mha_status mha_ring_forward(const mha_module *module,
                                          const mha_ring_forward_args *args)
{
    return mha_ring_forward_sized(module, args, sizeof *args,
                                  sizeof(mha_ring_stats));
}

/*
 * The backward of mha_ring_forward (the same forward args; its out is not
 * read): the forward again, this rank's rows through out_proj's backward
 * (mha_project_backward), the attention's backward across the ranks (the
 * ring or Ulysses, as args->ulysses says), RoPE's rotation turned back,
 * then the input projections' backward.
 *   grad_out (B, Lloc, E) required; grad_query (B, Lloc, E), grad_key
 *   (B, Lloc, kdim), grad_value (B, Lloc, vdim) overwritten, or NULL;
 *   as in mha_backward, with the forward's key NULL grad_query receives
 *   all three input gradients (grad_key, grad_value must be NULL), with
 *   only its value NULL grad_key receives the key's and the value's.
 *   grad_params (mha_param_numel floats) or NULL: the parameters'
 *   gradients summed over every rank's rows (MPI_Allreduce), the same on
 *   every rank; overwritten, or added to with accumulate.
 * Bitwise the same from run to run for a given rank count; against one
 * process's mha_backward it differs by the order of the sums (within the
 * test suite's bound).  args->stats receives the attention backward's.
 */
typedef struct mha_ring_backward_args {
    const float *grad_out;
    float *grad_query, *grad_key, *grad_value;
    float *grad_params;
    int accumulate;
} mha_ring_backward_args;
MHA_API mha_status mha_ring_backward_sized(
    const mha_module *module, const mha_ring_forward_args *args,
    size_t args_size, const mha_ring_backward_args *grads, size_t grads_size,
    size_t stats_size);
static inline mha_status mha_ring_backward(
    const mha_module *module, const mha_ring_forward_args *args,
    const mha_ring_backward_args *grads)
{
    return mha_ring_backward_sized(module, args, sizeof *args, grads,
                                   sizeof *grads, sizeof(mha_ring_stats));
}

#ifdef __cplusplus
}
#endif

#endif /* MHA_MPI_H */
