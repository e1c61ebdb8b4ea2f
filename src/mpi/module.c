/*
 * module.c -- the module across ranks: projections local to each rank
 * (mha_project), the attention across them (ring.c or ulysses.c), the
 * output projection local again.
 */
#include "common.h"

#include <stdlib.h>
#include <string.h>

/* The verdict of all ranks of comm on `local` (mha_mpi_agree on a
 * duplicate of comm). */
static mha_status agree_on(MPI_Comm comm, mha_status local)
{
    ring r;
    memset(&r, 0, sizeof r);
    int rc = MPI_Comm_dup(comm, &r.comm);
    if (rc != MPI_SUCCESS)
        return mha_mpi_mpi_fail(rc, "MPI_Comm_dup of the communicator");
    MPI_Comm_set_errhandler(r.comm, MPI_ERRORS_RETURN);
    MPI_Comm_size(r.comm, &r.P);
    MPI_Comm_rank(r.comm, &r.rank);
    const mha_status st = mha_mpi_agree(&r, local);
    MPI_Comm_free(&r.comm);
    return st;
}

/* What this rank can check alone: the module's options and the inputs. */
static mha_status check_module(const mha_module *m,
                               const mha_ring_forward_args *a,
                               const mha_config *c, int64_t nloc)
{
    if (!m)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "module is NULL");
    if (c->add_bias_kv || c->add_zero_attn || c->sinks)
        return mha_mpi_fail(MHA_ERR_UNSUPPORTED,
                            "the module across ranks takes no %s (an extra "
                            "key or logit belongs to no rank's shard)",
                            c->add_bias_kv     ? "add_bias_kv"
                            : c->add_zero_attn ? "add_zero_attn"
                                               : "sinks");
    if (nloc > 0 && (!a->query || !a->out))
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "%s is NULL",
                            !a->query ? "query" : "out");
    return MHA_OK;
}

mha_status mha_ring_forward(const mha_module *m,
                            const mha_ring_forward_args *a)
{
    if (!a)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "ring forward args are "
                            "NULL");
    int ok = 0, P = 1, rank = 0;
    if (MPI_Initialized(&ok) != MPI_SUCCESS || !ok)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "MPI is not initialised: call MPI_Init first");
    if (a->comm == MPI_COMM_NULL)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "comm is MPI_COMM_NULL");
    MPI_Comm_size(a->comm, &P);
    MPI_Comm_rank(a->comm, &rank);
    mha_config c;
    memset(&c, 0, sizeof c);
    mha_shard s;
    memset(&s, 0, sizeof s);
    mha_status st = m ? mha_get_config(m, &c) : MHA_OK;
    if (st == MHA_OK)
        st = mha_shard_of(a->split, a->seq_len, P, rank, &s);
    const int64_t nloc = s.len, B = a->batch;
    if (st == MHA_OK && B < 1)
        st = mha_mpi_fail(MHA_ERR_SHAPE, "batch must be >= 1, got %lld",
                          (long long)B);
    if (st == MHA_OK)
        st = check_module(m, a, &c, nloc);
    const int64_t H = c.num_heads, dh = c.head_dim ? c.head_dim
                                                   : (H ? c.embed_dim / H : 0);
    const int64_t Hkv = c.num_kv_heads ? c.num_kv_heads : H;
    const int64_t D = H * dh, Dkv = Hkv * dh, rows = B * nloc;
    float *q = NULL, *k = NULL, *v = NULL, *ctx = NULL;
    if (st == MHA_OK) {
        q = malloc((size_t)(rows * D + 1) * sizeof *q);
        k = malloc((size_t)(rows * Dkv + 1) * sizeof *k);
        v = malloc((size_t)(rows * Dkv + 1) * sizeof *v);
        ctx = malloc((size_t)(rows * D + 1) * sizeof *ctx);
        if (!q || !k || !v || !ctx)
            st = mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                              "out of memory for the projected heads "
                              "(%lld rows)", (long long)rows);
    }
    const float *key = a->key ? a->key : a->query;
    const float *value = a->value ? a->value : key;
    if (st == MHA_OK && rows > 0)
        st = mha_project(m, MHA_PROJ_QUERY, a->query, rows, q);
    if (st == MHA_OK && rows > 0)
        st = mha_project(m, MHA_PROJ_KEY, key, rows, k);
    if (st == MHA_OK && rows > 0)
        st = mha_project(m, MHA_PROJ_VALUE, value, rows, v);
    /* RoPE at each token's global position, here, before the ring: the
     * blocks then travel rotated already. */
    if (st == MHA_OK && rows > 0 && c.mods.rope.style != MHA_ROPE_NONE) {
        int64_t *pos = malloc((size_t)rows * sizeof *pos);
        if (!pos)
            st = mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                              "out of memory for RoPE's positions");
        for (int64_t b = 0; pos && b < B; b++)
            for (int64_t x = 0; x < nloc; x++)
                pos[b * nloc + x] = x < s.length[0]
                                        ? s.offset[0] + x
                                        : s.offset[1] + (x - s.length[0]);
        if (st == MHA_OK)
            st = mha_rope_apply(&c.mods.rope, rows, H, dh, pos, 0, q, D);
        if (st == MHA_OK)
            st = mha_rope_apply(&c.mods.rope, rows, Hkv, dh, pos, 0, k, Dkv);
        free(pos);
    }
    /* Every rank learns of any rank's failure before the attention. */
    st = agree_on(a->comm, st);
    if (st == MHA_OK) {
        mha_ring_args r = {0};
        r.comm = a->comm;
        r.split = a->split;
        r.seq_len = a->seq_len;
        r.batch = B;
        r.num_heads = H;
        r.num_kv_heads = Hkv;
        r.head_dim = dh;
        r.q = q;
        r.k = k;
        r.v = v;
        r.scale = c.scale;
        r.given = c.given & MHA_GIVEN_SCALE;
        r.causal = a->causal;
        r.key_lengths = a->key_lengths;
        r.mods = c.mods;
        r.mods.rope.style = MHA_ROPE_NONE;   /* applied above */
        r.num_threads = a->num_threads;
        r.out = ctx;
        r.stats = a->stats;
        st = a->ulysses ? mha_ulysses_attention(&r) : mha_ring_attention(&r);
    }
    mha_status local = MHA_OK;
    if (st == MHA_OK && rows > 0)
        local = mha_project(m, MHA_PROJ_OUT, ctx, rows, a->out);
    if (st == MHA_OK)
        st = agree_on(a->comm, local);
    free(q);
    free(k);
    free(v);
    free(ctx);
    return st;
}
