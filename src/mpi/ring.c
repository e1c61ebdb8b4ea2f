/*
 * ring.c -- exact attention over a sequence split across MPI ranks (Ring
 * Attention), forward and backward, on libmha's public API only.
 *
 *   check     (common.c) every rank's arguments checked alone, then
 *             compared across ranks (one MPI_Allreduce of a fingerprint):
 *             the same status and message on every rank, before any block
 *             moves
 *   forward   step s = 0 .. P-1: this rank holds the K/V block of rank
 *             (r - s) mod P; the next block's receive and this block's
 *             send are posted first, then each (query piece, key piece)
 *             pair of the step runs mha_attention with its lse and is
 *             merged into the running (out, lse) by mha_attention_merge
 *             (float64 inside, rounded once per merge), in step order
 *   backward  the same walk with mha_attention_backward_part; each block's
 *             dK/dV accumulator follows its block one step behind and
 *             comes home at the end
 *
 * A block in flight is one buffer: [k of piece 0][k of piece 1][v of
 * piece 0][v of piece 1], the k (B, n_piece, Ekv), the v (B, n_piece,
 * Evkv); its gradient the same with dk, dv.  Pieces are the runs of
 * consecutive positions of a shard (mha_shard_of): with causal masking a
 * pair of pieces is either wholly visible (the keys end before the
 * queries start), the same run (top-left causal on it) or wholly hidden
 * (skipped, no work).
 *
 * Chunked attention (attention_chunk C, chunks of C global positions):
 * a pair of pieces is cut into the runs of its queries and keys that
 * share a chunk (a "part"), each a call without chunks, since within one
 * chunk every query sees every key the other masks leave; a part's rows
 * are merged into the running (out, lse) of those rows.  Without chunks
 * a pair is one part.
 */
#include "common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- the walk ----------------------------------------------------------- */

/* How queries (qo, qn) see keys (ko, kn), a pair of pieces or a part of
 * one: 0 not at all, 1 wholly, 2 the same run of positions (causal
 * top-left on it). */
static int visibility(const ring *r, int64_t qo, int64_t qn, int64_t ko,
                      int64_t kn)
{
    if (qn == 0 || kn == 0)
        return 0;
    if (!r->causal || ko + kn - 1 <= qo)
        return 1;
    if (ko > qo + qn - 1)
        return 0;
    return 2;   /* the same run: ko == qo, kn == qn (one partition) */
}

/* The lse rows [r0, r0 + n) of (B, H, Lx) to (B, H, n), or back. */
static void lse_copy(float *y, const float *x, int64_t BH, int64_t Lx,
                     int64_t r0, int64_t n, int back)
{
    mha_mpi_rows_copy(y, x, BH, Lx, 1, r0, n, back);
}

/* Floats of one block in flight: K and V of a shard of len rows. */
static int64_t block_floats(const ring *r, int64_t len)
{
    return r->B * len * (r->Ekv + r->Evkv);
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
    return x + (p ? r->B * s->length[0] * (is_v ? r->Evkv : r->Ekv) : 0);
}

/* A part of a pair (the file's note): query rows [q0, q0 + qn) of piece
 * qpi and keys [k0, k0 + kn) of piece kp, in global positions, that share
 * chunk c (or the whole pair, without chunks). */
typedef struct part {
    int64_t q0, qn, k0, kn;
} part;

/* The parts of a query piece (qo, qn) and key piece (ko, kn): n_parts()
 * of them, part_at(i) the i-th in order of the chunks. */
static int64_t first_chunk(const ring *r, int64_t qo, int64_t ko)
{
    const int64_t a = qo / r->C, b = ko / r->C;
    return a > b ? a : b;
}

static int64_t n_parts(const ring *r, int64_t qo, int64_t qn, int64_t ko,
                       int64_t kn)
{
    if (!r->C)
        return 1;
    if (qn == 0 || kn == 0)
        return 0;
    const int64_t a = (qo + qn - 1) / r->C, b = (ko + kn - 1) / r->C;
    const int64_t last = a < b ? a : b, first = first_chunk(r, qo, ko);
    return last >= first ? last - first + 1 : 0;
}

static part part_at(const ring *r, int64_t qo, int64_t qn, int64_t ko,
                    int64_t kn, int64_t i)
{
    if (!r->C) {
        const part p = {qo, qn, ko, kn};
        return p;
    }
    const int64_t c = first_chunk(r, qo, ko) + i;
    const int64_t lo = c * r->C, hi = lo + r->C;
    part p;
    p.q0 = qo > lo ? qo : lo;
    p.qn = (qo + qn < hi ? qo + qn : hi) - p.q0;
    p.k0 = ko > lo ? ko : lo;
    p.kn = (ko + kn < hi ? ko + kn : hi) - p.k0;
    return p;
}

/* The parts of this rank's query piece qpi and key piece kp of shard ks,
 * and part i of them. */
static int64_t pair_parts(const ring *r, int qpi, const mha_shard *ks, int kp)
{
    return n_parts(r, r->me.offset[qpi], r->me.length[qpi], ks->offset[kp],
                   ks->length[kp]);
}

static part pair_part(const ring *r, int qpi, const mha_shard *ks, int kp,
                      int64_t i)
{
    return part_at(r, r->me.offset[qpi], r->me.length[qpi], ks->offset[kp],
                   ks->length[kp], i);
}

/* Where a part lies in a step: batch row b, this rank's query piece qpi
 * (qn rows from local row r0; the part's from x0 of them) against key
 * piece kp of shard ks; vis: visibility() of the part. */
typedef struct site {
    int64_t b;
    int qpi, kp;
    const mha_shard *ks;
    part x;
    int vis;
    int64_t qn, r0, x0;
} site;

/* The arguments of the part at `at`, its K/V block at `block` (one batch
 * row a call: a zig-zag query piece is then a contiguous run of the
 * caller's q, read in place). */
static mha_attention_args pair_args(const ring *r, const mha_ring_args *a,
                                    const site *at, float *block,
                                    int64_t *kl)
{
    const part *x = &at->x;
    const int64_t kn = at->ks->length[at->kp];
    const int64_t kx = x->k0 - at->ks->offset[at->kp];
    mha_attention_args p = {0};
    p.batch = 1;
    p.num_heads = r->H;
    p.num_kv_heads = r->Hkv;
    p.head_dim = r->dh;
    p.v_head_dim = r->dv;
    p.q_len = x->qn;
    p.kv_len = x->kn;
    p.q = a->q + (at->b * r->me.len + at->r0 + at->x0) * r->E;
    p.k = piece_of(r, block, at->ks, at->kp, 0) + (at->b * kn + kx) * r->Ekv;
    p.v = piece_of(r, block, at->ks, at->kp, 1) + (at->b * kn + kx) * r->Evkv;
    p.scale = a->scale;
    p.given = a->given;
    p.causal = at->vis == 2 ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    if (a->key_lengths) {
        const int64_t left = a->key_lengths[at->b] - x->k0;
        *kl = left < 0 ? 0 : left > x->kn ? x->kn : left;
        p.key_lengths = kl;
    }
    p.mods = a->mods;
    /* ALiBi and the window measure between global positions: the part's
     * queries start at q0, its keys at k0. */
    p.given |= MHA_GIVEN_Q_OFFSET;
    p.q_offset = x->q0 - x->k0;
    p.num_threads = a->num_threads;
    return p;
}

/* Every visible part of a step whose block is shard ks's, in a fixed
 * order (batch row, query piece, key piece, chunk), each given to fn;
 * between parts the nreq requests in flight are let progress.  Stops at
 * the first failure. */
typedef mha_status (*part_fn)(const ring *r, const site *at, void *ctx);
static mha_status walk_parts(const ring *r, const mha_shard *ks, part_fn fn,
                             void *ctx, MPI_Request *req, int nreq)
{
    for (int64_t b = 0; b < r->B; b++)
        for (int qpi = 0; qpi < r->me.n_pieces; qpi++)
            for (int kp = 0; kp < ks->n_pieces; kp++)
                for (int64_t i = 0; i < pair_parts(r, qpi, ks, kp); i++) {
                    site at = {b, qpi, kp, ks,
                               pair_part(r, qpi, ks, kp, i), 0,
                               r->me.length[qpi],
                               qpi ? r->me.length[0] : 0, 0};
                    at.vis = visibility(r, at.x.q0, at.x.qn, at.x.k0,
                                        at.x.kn);
                    if (!at.vis)
                        continue;
                    at.x0 = at.x.q0 - r->me.offset[qpi];
                    const mha_status st = fn(r, &at, ctx);
                    int flag;
                    MPI_Testall(nreq, req, &flag, MPI_STATUSES_IGNORE);
                    if (st != MHA_OK)
                        return st;
                }
    return MHA_OK;
}

/* Rows [x0, x0 + n) of an lse piece (H, qn) to (H, n), or back: a part's
 * rows of a piece's lse.  In place (the same buffer) when they are all of
 * them. */
static void lse_rows(float *y, float *piece, int64_t H, int64_t qn,
                     int64_t x0, int64_t n, int back)
{
    if (y == piece)
        return;
    mha_mpi_rows_copy(y, piece, H, qn, 1, x0, n, back);
}

/* The running lse of query piece qpi of batch row b: (H, qn) floats, each
 * piece's rows together, as mha_attention_merge reads an lse. */
static float *piece_lse(const ring *r, float *al, int64_t b, int qpi)
{
    return al + (b * r->me.len + (qpi ? r->me.length[0] : 0)) * r->H;
}

/* Packs this rank's K and V into a block buffer. */
static void pack_own(const ring *r, const mha_ring_args *a, float *buf)
{
    for (int p = 0; p < r->me.n_pieces; p++) {
        const int64_t r0 = p ? r->me.length[0] : 0, n = r->me.length[p];
        mha_mpi_rows_copy(piece_of(r, buf, &r->me, p, 0), a->k, r->B, r->me.len,
                  r->Ekv, r0, n, 0);
        mha_mpi_rows_copy(piece_of(r, buf, &r->me, p, 1), a->v, r->B, r->me.len,
                  r->Evkv, r0, n, 0);
    }
}

/* ---- forward ------------------------------------------------------------ */

/* A step's buffers: the K/V block, one part's (out, lse), the running lse
 * and a part's rows of it. */
typedef struct fwd_step {
    const mha_ring_args *a;
    float *block, *po, *pl, *al, *tl;
} fwd_step;

/* One part: its attention, merged into the running (out, lse) of its
 * rows. */
static mha_status forward_part(const ring *r, const site *at, void *ctx)
{
    const fwd_step *f = ctx;
    int64_t kl;
    mha_attention_args pa = pair_args(r, f->a, at, f->block, &kl);
    pa.out = f->po;
    pa.lse = f->pl;
    MHA_STATUS_CHECK(mha_attention(&pa));
    float *ao = f->a->out + (at->b * r->me.len + at->r0 + at->x0) * r->Ev;
    float *lp = piece_lse(r, f->al, at->b, at->qpi);
    float *lx = at->x.qn == at->qn ? lp : f->tl;
    lse_rows(lx, lp, r->H, at->qn, at->x0, at->x.qn, 0);
    const mha_attention_part pt[2] = {{ao, lx}, {f->po, f->pl}};
    const mha_status st =
        mha_attention_merge(pt, 2, 1, r->H, r->dv, at->x.qn, ao, lx);
    lse_rows(lx, lp, r->H, at->qn, at->x0, at->x.qn, 1);
    return st;
}

mha_status mha_ring_attention_sized(const mha_ring_args *args,
                                   size_t args_size, size_t stats_size)
{
    ring r;
    mha_status st = mha_mpi_ring_open(args, args_size, NULL, 0, stats_size,
                                      MHA_OP_RING_FORWARD, &r);
    const mha_ring_args *a = &r.a;
    float *kv[2] = {NULL, NULL}, *po = NULL, *pl = NULL, *al = NULL;
    float *tl = NULL;
    MPI_Request req[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    if (st != MHA_OK)
        goto done;

    int64_t maxlen = 0;
    for (int x = 0; x < r.P; x++) {
        const mha_shard s = shard(&r, a, x);
        maxlen = s.len > maxlen ? s.len : maxlen;
    }
    const int64_t nloc = r.me.len;
    const int64_t maxpiece = r.me.length[0] > r.me.length[1]
                                 ? r.me.length[0] : r.me.length[1];
    /* The workspace: the two K/V blocks (the one computed on, the one
     * arriving), one part's (out, lse), the running lse (piece_lse) and a
     * part's rows of it (tl, with chunks); the running out is the
     * caller's out itself. */
    kv[0] = mha_mpi_alloc_bytes(&r, block_floats(&r, maxlen) * 4);
    kv[1] = mha_mpi_alloc_bytes(&r, block_floats(&r, maxlen) * 4);
    po = mha_mpi_alloc_bytes(&r, maxpiece * r.Ev * 4);
    pl = mha_mpi_alloc_bytes(&r, r.H * maxpiece * 4);
    al = mha_mpi_alloc_bytes(&r, r.B * r.H * nloc * 4);
    tl = mha_mpi_alloc_bytes(&r, r.H * maxpiece * 4);
    /* No rank starts a ring that another cannot finish. */
    st = !kv[0] || !kv[1] || !po || !pl || !al || !tl
             ? mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                            "out of memory for the ring's buffers (%lld "
                            "bytes)", (long long)r.st.workspace_bytes)
             : MHA_OK;
    st = mha_mpi_agree(&r, st);
    if (st != MHA_OK)
        goto done;
    for (int64_t x = 0; x < r.B * r.H * nloc; x++)
        al[x] = -INFINITY;
    memset(a->out, 0, (size_t)(r.B * nloc * r.Ev) * sizeof *a->out);
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
        const double t = mha_mpi_now();
        fwd_step f = {a, cur, po, pl, al, tl};
        if (st == MHA_OK)
            st = walk_parts(&r, &ks, forward_part, &f, req, 2);
        r.st.seconds_compute += mha_mpi_now() - t;
        if (s + 1 < r.P)
            MPI_TRY(mha_mpi_wait_all(&r, 2, req), "MPI_Waitall of a K/V block");
    }
    st = mha_mpi_agree(&r, st);
    if (st != MHA_OK)
        goto done;
    if (a->lse)
        for (int64_t b = 0; b < r.B; b++)
            for (int qpi = 0; qpi < r.me.n_pieces; qpi++) {
                const int64_t qn = r.me.length[qpi];
                const int64_t r0 = qpi ? r.me.length[0] : 0;
                const float *lp = piece_lse(&r, al, b, qpi);
                for (int64_t h = 0; h < r.H; h++)
                    memcpy(a->lse + (b * r.H + h) * nloc + r0, lp + h * qn,
                           (size_t)qn * sizeof *lp);
            }

done:
    mha_mpi_free_requests(req, 2);
    free(kv[0]);
    free(kv[1]);
    free(po);
    free(pl);
    free(al);
    free(tl);
    mha_mpi_ring_close(&r);
    return st;
}

/* ---- backward ----------------------------------------------------------- */

/* y[x] += x[x] for n floats, in index order. */
static void add_floats(float *y, const float *x, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        y[i] += x[i];
}

/* A step's buffers: the K/V block computed on, this rank's dK/dV share of
 * it (loc), the regrouped lse, one part's gradients, a part's lse rows and
 * dq in float64. */
typedef struct bwd_step {
    const mha_ring_args *a;
    const mha_ring_grads *g;
    float *block, *loc, *lsep, *pdq, *pdk, *pdv, *tl;
    double *dq;
} bwd_step;

/* One part: its backward, dq summed in float64, dK/dV added to the
 * block's share. */
static mha_status backward_part(const ring *r, const site *at, void *ctx)
{
    const bwd_step *w = ctx;
    const mha_shard *ks = at->ks;
    const int64_t nloc = r->me.len, kn = ks->length[at->kp];
    const int64_t kx = at->x.k0 - ks->offset[at->kp];
    const int64_t row = at->b * nloc + at->r0 + at->x0;
    float *lp = w->lsep + at->b * r->H * nloc + r->H * at->r0;
    float *lx = at->x.qn == at->qn ? lp : w->tl;
    lse_rows(lx, lp, r->H, at->qn, at->x0, at->x.qn, 0);
    int64_t kl;
    const mha_attention_args pa = pair_args(r, w->a, at, w->block, &kl);
    const mha_attention_grads pg = {w->g->grad_out + row * r->Ev, w->pdq,
                                    w->pdk, w->pdv, NULL};
    MHA_STATUS_CHECK(mha_attention_backward_part(&pa, lx,
                                                 w->a->out + row * r->Ev,
                                                 &pg));
    for (int64_t e = 0; e < at->x.qn * r->E; e++)
        w->dq[row * r->E + e] += w->pdq[e];
    add_floats(piece_of(r, w->loc, ks, at->kp, 0) + (at->b * kn + kx) * r->Ekv,
               w->pdk, at->x.kn * r->Ekv);
    add_floats(piece_of(r, w->loc, ks, at->kp, 1) +
                   (at->b * kn + kx) * r->Evkv,
               w->pdv, at->x.kn * r->Evkv);
    return MHA_OK;
}

mha_status mha_ring_attention_backward_sized(const mha_ring_args *args,
                                            size_t args_size,
                                            const mha_ring_grads *grads,
                                            size_t grads_size,
                                            size_t stats_size)
{
    ring r;
    mha_status st = mha_mpi_ring_open(args, args_size, grads, grads_size,
                                      stats_size, MHA_OP_RING_BACKWARD, &r);
    const mha_ring_args *a = &r.a;
    const mha_ring_grads *g = &r.g;
    float *kv[2] = {NULL, NULL}, *dkv[2] = {NULL, NULL}, *loc = NULL;
    float *lsep = NULL, *pdq = NULL, *pdk = NULL, *pdv = NULL, *tl = NULL;
    double *dq = NULL;
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
        kv[i] = mha_mpi_alloc_bytes(&r, nblock * 4);
        dkv[i] = mha_mpi_alloc_bytes(&r, nblock * 4);
    }
    loc = mha_mpi_alloc_bytes(&r, nblock * 4);
    lsep = mha_mpi_alloc_bytes(&r, BH * nloc * 4);
    pdq = mha_mpi_alloc_bytes(&r, maxpiece * r.E * 4);
    pdk = mha_mpi_alloc_bytes(&r, maxlen * r.Ekv * 4);
    pdv = mha_mpi_alloc_bytes(&r, maxlen * r.Evkv * 4);
    tl = mha_mpi_alloc_bytes(&r, r.H * maxpiece * 4);
    dq = mha_mpi_alloc_bytes(&r, nq * 8);
    st = !kv[0] || !kv[1] || !dkv[0] || !dkv[1] || !loc || !lsep || !pdq ||
                 !pdk || !pdv || !tl || !dq
             ? mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                            "out of memory for the ring's buffers (%lld "
                            "bytes)", (long long)r.st.workspace_bytes)
             : MHA_OK;
    st = mha_mpi_agree(&r, st);
    if (st != MHA_OK)
        goto done;
    /* q, out and dO of a (batch row, query piece) are contiguous runs of
     * the caller's arrays, read in place; its lse rows (H, n) are not
     * (the heads are nloc apart): regrouped once, piece after piece (and
     * a part's rows of them into tl, with chunks). */
    for (int64_t b = 0; b < r.B; b++)
        for (int p = 0; p < r.me.n_pieces; p++) {
            const int64_t r0 = p ? r.me.length[0] : 0, n = r.me.length[p];
            lse_copy(lsep + b * r.H * nloc + r.H * r0,
                     a->lse + b * r.H * nloc, r.H, nloc, r0, n, 0);
        }
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
            MPI_TRY(mha_mpi_wait_all(&r, 1, &req[3 + s % 2]),
                    "MPI_Wait of a dK/dV send");
            MPI_TRY(MPI_Irecv(acc, (int)nks, MPI_FLOAT, prev, r.P + s,
                              r.comm, &req[2]), "MPI_Irecv of a dK/dV block");
            r.st.messages_received++;
            r.st.bytes_received += nks * 4;
        }
        const double t = mha_mpi_now();
        memset(loc, 0, (size_t)nks * sizeof *loc);
        bwd_step w = {a, g, cur, loc, lsep, pdq, pdk, pdv, tl, dq};
        if (st == MHA_OK)
            st = walk_parts(&r, &ks, backward_part, &w, req, 3);
        r.st.seconds_compute += mha_mpi_now() - t;
        if (s == 0) {
            memcpy(acc, loc, (size_t)nks * sizeof *acc);
        } else {
            MPI_TRY(mha_mpi_wait_all(&r, 1, &req[2]),
                    "MPI_Wait of a dK/dV block");
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
            MPI_TRY(mha_mpi_wait_all(&r, 2, req), "MPI_Waitall of a K/V block");
    }
    /* This rank's own block comes home, complete. */
    float *home = r.P > 1 ? loc : dkv[0];
    if (r.P > 1) {
        const int64_t n = block_floats(&r, nloc);
        MPI_TRY(MPI_Irecv(loc, (int)n, MPI_FLOAT, prev, 2 * r.P, r.comm,
                          &req[2]), "MPI_Irecv of this rank's dK/dV");
        r.st.messages_received++;
        r.st.bytes_received += n * 4;
        MPI_TRY(mha_mpi_wait_all(&r, 3, &req[2]),
                "MPI_Waitall of the dK/dV sends");
    }
    st = mha_mpi_agree(&r, st);
    if (st != MHA_OK)
        goto done;
    for (int p = 0; p < r.me.n_pieces; p++) {
        const int64_t r0 = p ? r.me.length[0] : 0, n = r.me.length[p];
        mha_mpi_rows_copy(piece_of(&r, home, &r.me, p, 0), g->grad_k, r.B, nloc,
                  r.Ekv, r0, n, 1);
        mha_mpi_rows_copy(piece_of(&r, home, &r.me, p, 1), g->grad_v, r.B, nloc,
                  r.Evkv, r0, n, 1);
    }
    for (int64_t x = 0; x < nq; x++)
        g->grad_q[x] = (float)dq[x];

done:
    mha_mpi_free_requests(req, 5);
    for (int i = 0; i < 2; i++) {
        free(kv[i]);
        free(dkv[i]);
    }
    free(loc);
    free(lsep);
    free(pdq);
    free(pdk);
    free(pdv);
    free(tl);
    free(dq);
    mha_mpi_ring_close(&r);
    return st;
}
