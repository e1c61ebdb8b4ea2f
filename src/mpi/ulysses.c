/*
 * ulysses.c -- attention across MPI ranks by a head split (DeepSpeed-
 * Ulysses): an all-to-all turns each rank's shard of the sequence (all
 * heads) into the whole sequence for H / P query heads and H_kv / P K/V
 * heads; mha_attention runs there, alone; an all-to-all turns the output
 * back into shards.  Each (batch, head) is computed exactly as one
 * process computes it, so the result is bitwise the single-process
 * result, for every P.  The backward does the same with dO, and
 * mha_attention_backward on the local heads.
 *
 * Layouts: a shard x (B, Lloc, nh * hw), hw the head width (d_h, or
 * d_v for values and outputs); the head slice of rank j is columns
 * [j w, (j + 1) w), w = nh / P * hw; the whole sequence of a slice is
 * (B, L, w), rows in global order (the split's pieces put back in place).
 * Chunked attention needs nothing more: each rank runs the whole
 * sequence, whose key 0 is global position 0.
 */
#include "common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static mha_shard shard(const ring *r, const mha_ring_args *a, int rank)
{
    mha_shard s;
    mha_shard_of(a->split, r->L, r->P, rank, &s);
    return s;
}

static int64_t global_row(const mha_shard *s, int64_t x)
{
    return x < s->length[0] ? s->offset[0] + x
                            : s->offset[1] + (x - s->length[0]);
}

/* The all-to-all's counts: block j of this rank (rows of shard `mine` x
 * w) goes to rank j, and rank j's block (rows of its shard x w) comes
 * back, or the other way round (back). */
typedef struct a2a {
    int *sc, *sd, *rc, *rd;
    int64_t sent_bytes;
} a2a;

/*
 * x (B, Lloc, nh*hw) of every rank -> full (B, L, w) of this rank's head
 * slice (back = 0), or full -> x (back = 1).  tmp holds 2 B max(P Lloc,
 * L) w floats (P Lloc > L when the shards are uneven).
 */
static mha_status exchange(ring *r, const mha_ring_args *a, int64_t nh,
                           int64_t hw, float *x, float *full, float *tmp,
                           int back, a2a *c)
{
    const int64_t w = nh / r->P * hw, row = nh * hw, B = r->B;
    const int64_t nloc = r->me.len;
    const int64_t big = r->L > r->P * nloc ? r->L : r->P * nloc;
    float *snd = tmp, *rcv = tmp + B * big * w;
    int64_t off = 0;
    c->sent_bytes = 0;
    /* what goes where */
    for (int j = 0; j < r->P; j++) {
        const int64_t rows = back ? shard(r, a, j).len : nloc;
        c->sc[j] = (int)(B * rows * w);
        c->sd[j] = (int)off;
        off += B * rows * w;
        if (j != r->rank)
            c->sent_bytes += (int64_t)c->sc[j] * 4;
    }
    off = 0;
    for (int j = 0; j < r->P; j++) {
        const int64_t rows = back ? nloc : shard(r, a, j).len;
        c->rc[j] = (int)(B * rows * w);
        c->rd[j] = (int)off;
        off += B * rows * w;
    }
    /* pack */
    for (int j = 0; j < r->P; j++) {
        float *dst = snd + c->sd[j];
        if (!back) {
            /* my rows, rank j's heads */
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < nloc; i++)
                    memcpy(dst + (b * nloc + i) * w,
                           x + (b * nloc + i) * row + j * w,
                           (size_t)w * sizeof *dst);
        } else {
            /* rank j's rows, my heads */
            const mha_shard s = shard(r, a, j);
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < s.len; i++)
                    memcpy(dst + (b * s.len + i) * w,
                           full + (b * r->L + global_row(&s, i)) * w,
                           (size_t)w * sizeof *dst);
        }
    }
    const double t = mha_mpi_now();
    const int rc = MPI_Alltoallv(snd, c->sc, c->sd, MPI_FLOAT, rcv, c->rc,
                                 c->rd, MPI_FLOAT, r->comm);
    r->st.seconds_waiting += mha_mpi_now() - t;
    if (rc != MPI_SUCCESS)
        return mha_mpi_mpi_fail(rc, "MPI_Alltoallv of a head split");
    r->st.messages_sent += r->P - 1;
    r->st.messages_received += r->P - 1;
    r->st.bytes_sent += c->sent_bytes;
    for (int j = 0; j < r->P; j++)
        if (j != r->rank)
            r->st.bytes_received += (int64_t)c->rc[j] * 4;
    /* unpack */
    for (int j = 0; j < r->P; j++) {
        const float *src = rcv + c->rd[j];
        if (!back) {
            const mha_shard s = shard(r, a, j);
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < s.len; i++)
                    memcpy(full + (b * r->L + global_row(&s, i)) * w,
                           src + (b * s.len + i) * w, (size_t)w * sizeof *src);
        } else {
            for (int64_t b = 0; b < B; b++)
                for (int64_t i = 0; i < nloc; i++)
                    memcpy(x + (b * nloc + i) * row + j * w,
                           src + (b * nloc + i) * w, (size_t)w * sizeof *src);
        }
    }
    return MHA_OK;
}

/* The local problem: the whole sequence, this rank's heads (slopes: all
 * H heads' ALiBi slopes, or NULL without ALiBi). */
static mha_attention_args local_args(const ring *r, const mha_ring_args *a,
                                     const float *slopes)
{
    mha_attention_args p = {0};
    p.batch = r->B;
    p.num_heads = r->H / r->P;
    p.num_kv_heads = r->Hkv / r->P;
    p.head_dim = r->dh;
    p.v_head_dim = r->dv;
    p.attention_chunk = r->C;
    p.q_len = r->L;
    p.kv_len = r->L;
    p.scale = a->scale;
    p.given = a->given;
    p.causal = a->causal != MHA_CAUSAL_NONE ? MHA_CAUSAL_TOP_LEFT
                                            : MHA_CAUSAL_NONE;
    p.key_lengths = a->key_lengths;
    p.mods = a->mods;
    if (slopes)   /* this rank's heads' slopes, not H / P heads' defaults */
        p.mods.alibi_slopes = slopes + r->rank * (r->H / r->P);
    p.num_threads = a->num_threads;
    return p;
}

/* The buffers of a call: the whole sequence of this rank's heads for up
 * to 5 tensors, the exchange's scratch and counts. */
typedef struct bufs {
    float *f[5];   /* q/out/dq, k/dk, v/dv, dO, lse */
    float *tmp, *x;
    int *counts;
    float *slopes; /* (H) with ALiBi: given or the defaults for H heads */
} bufs;

static void bufs_free(bufs *b)
{
    for (int i = 0; i < 5; i++)
        free(b->f[i]);
    free(b->tmp);
    free(b->x);
    free(b->counts);
    free(b->slopes);
}

static int bufs_alloc(ring *r, const mha_ring_args *a, bufs *b, int n,
                      int lse)
{
    memset(b, 0, sizeof *b);
    if (a->mods.alibi) {
        b->slopes = mha_mpi_alloc_bytes(r, r->H * 4);
        if (!b->slopes)
            return 0;
        if (a->mods.alibi_slopes)
            memcpy(b->slopes, a->mods.alibi_slopes, (size_t)r->H * 4);
        else if (mha_alibi_slopes(r->H, b->slopes) != MHA_OK)
            return 0;
    }
    /* (every tensor's slice at most H / P heads of the wider width) */
    const int64_t wq = r->H / r->P * (r->dh > r->dv ? r->dh : r->dv);
    const int64_t nloc = r->me.len;
    const int64_t big = r->L > r->P * nloc ? r->L : r->P * nloc;
    int ok = 1;
    for (int i = 0; i < n; i++) {
        b->f[i] = mha_mpi_alloc_bytes(r, r->B * r->L * wq * 4);
        ok &= b->f[i] != NULL;
    }
    if (lse) {
        b->f[4] = mha_mpi_alloc_bytes(r, r->B * r->L * (r->H / r->P) * 4);
        b->x = mha_mpi_alloc_bytes(r, r->B * nloc * r->H * 4);
        ok &= b->f[4] && b->x;
    }
    b->tmp = mha_mpi_alloc_bytes(r, 2 * r->B * big * wq * 4);
    b->counts = mha_mpi_alloc_bytes(r, 4 * (int64_t)r->P * sizeof(int));
    return ok && b->tmp && b->counts;
}

/* q, k and v of every rank -> the whole sequence of this rank's heads, in
 * b->f[0 .. 2] (values d_v wide). */
static mha_status exchange_qkv(ring *r, const mha_ring_args *a, bufs *b,
                               a2a *c)
{
    MHA_STATUS_CHECK(exchange(r, a, r->H, r->dh, (float *)a->q, b->f[0],
                              b->tmp, 0, c));
    MHA_STATUS_CHECK(exchange(r, a, r->Hkv, r->dh, (float *)a->k, b->f[1],
                              b->tmp, 0, c));
    return exchange(r, a, r->Hkv, r->dv, (float *)a->v, b->f[2], b->tmp, 0,
                    c);
}

static a2a counts_of(const ring *r, bufs *b)
{
    a2a c = {b->counts, b->counts + r->P, b->counts + 2 * r->P,
             b->counts + 3 * r->P, 0};
    return c;
}

mha_status mha_ulysses_attention_sized(const mha_ring_args *args,
                                      size_t args_size, size_t stats_size)
{
    ring r;
    bufs b;
    memset(&b, 0, sizeof b);
    mha_status st = mha_mpi_ring_open(args, args_size, NULL, 0, stats_size,
                                      MHA_OP_ULYSSES_FORWARD, &r);
    const mha_ring_args *a = &r.a;
    if (st != MHA_OK)
        goto done;
    const int with_lse = a->lse != NULL;
    st = bufs_alloc(&r, a, &b, 3, 1)
             ? MHA_OK
             : mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                            "out of memory for Ulysses' buffers (%lld "
                            "bytes)", (long long)r.st.workspace_bytes);
    MHA_GOTO_IF(mha_mpi_agree(&r, st));
    a2a c = counts_of(&r, &b);
    MHA_GOTO_IF(exchange_qkv(&r, a, &b, &c));
    const double t = mha_mpi_now();
    mha_attention_args p = local_args(&r, a, b.slopes);
    p.q = b.f[0];
    p.k = b.f[1];
    p.v = b.f[2];
    p.out = b.f[3] = mha_mpi_alloc_bytes(&r, r.B * r.L * (r.Ev / r.P) * 4);
    p.lse = b.f[4];
    st = p.out ? mha_attention(&p)
               : mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                              "out of memory for Ulysses' output");
    r.st.seconds_compute += mha_mpi_now() - t;
    MHA_GOTO_IF(mha_mpi_agree(&r, st));
    MHA_GOTO_IF(exchange(&r, a, r.H, r.dv, a->out, b.f[3], b.tmp, 1, &c));
    if (with_lse) {
        /* (B, H/P, L) -> token-major (B, L, H/P), exchanged as heads of
         * width 1, then (B, Lloc, H) -> (B, H, Lloc). */
        const int64_t hp = r.H / r.P, nloc = r.me.len;
        float *tm = b.f[0];   /* q's buffer is free now */
        for (int64_t bb = 0; bb < r.B; bb++)
            for (int64_t h = 0; h < hp; h++)
                for (int64_t i = 0; i < r.L; i++)
                    tm[(bb * r.L + i) * hp + h] =
                        b.f[4][(bb * hp + h) * r.L + i];
        MHA_GOTO_IF(exchange(&r, a, r.H, 1, b.x, tm, b.tmp, 1, &c));
        for (int64_t bb = 0; bb < r.B; bb++)
            for (int64_t h = 0; h < r.H; h++)
                for (int64_t i = 0; i < nloc; i++)
                    a->lse[(bb * r.H + h) * nloc + i] =
                        b.x[(bb * nloc + i) * r.H + h];
    }
done:
    bufs_free(&b);
    mha_mpi_ring_close(&r);
    return st;
}

mha_status mha_ulysses_attention_backward_sized(const mha_ring_args *args,
                                               size_t args_size,
                                               const mha_ring_grads *grads,
                                               size_t grads_size,
                                               size_t stats_size)
{
    ring r;
    bufs b;
    memset(&b, 0, sizeof b);
    float *d[3] = {NULL, NULL, NULL};
    mha_status st = mha_mpi_ring_open(args, args_size, grads, grads_size,
                                      stats_size, MHA_OP_ULYSSES_BACKWARD, &r);
    const mha_ring_args *a = &r.a;
    const mha_ring_grads *g = &r.g;
    if (st != MHA_OK)
        goto done;
    int ok = bufs_alloc(&r, a, &b, 4, 0);
    for (int i = 0; i < 3; i++) {   /* dq, dk, dv: at most H / P heads */
        d[i] = mha_mpi_alloc_bytes(&r, r.B * r.L * (r.H / r.P) *
                                           (i == 2 ? r.dv : r.dh) * 4);
        ok &= d[i] != NULL;
    }
    st = ok ? MHA_OK
            : mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                           "out of memory for Ulysses' buffers (%lld bytes)",
                           (long long)r.st.workspace_bytes);
    MHA_GOTO_IF(mha_mpi_agree(&r, st));
    a2a c = counts_of(&r, &b);
    MHA_GOTO_IF(exchange_qkv(&r, a, &b, &c));
    MHA_GOTO_IF(exchange(&r, a, r.H, r.dv, (float *)g->grad_out, b.f[3],
                         b.tmp, 0, &c));
    const double t = mha_mpi_now();
    mha_attention_args p = local_args(&r, a, b.slopes);
    p.q = b.f[0];
    p.k = b.f[1];
    p.v = b.f[2];
    const mha_attention_grads lg = {b.f[3], d[0], d[1], d[2], NULL};
    st = mha_attention_backward(&p, &lg);
    r.st.seconds_compute += mha_mpi_now() - t;
    MHA_GOTO_IF(mha_mpi_agree(&r, st));
    MHA_GOTO_IF(exchange(&r, a, r.H, r.dh, g->grad_q, d[0], b.tmp, 1, &c));
    MHA_GOTO_IF(exchange(&r, a, r.Hkv, r.dh, g->grad_k, d[1], b.tmp, 1, &c));
    MHA_GOTO_IF(exchange(&r, a, r.Hkv, r.dv, g->grad_v, d[2], b.tmp, 1, &c));
done:
    for (int i = 0; i < 3; i++)
        free(d[i]);
    bufs_free(&b);
    mha_mpi_ring_close(&r);
    return st;
}
