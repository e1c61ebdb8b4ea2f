/*
 * module.c -- the module across ranks: projections local to each rank
 * (mha_project), the attention across them (ring.c or ulysses.c), the
 * output projection local again.
 */
#include "common.h"

#include <stdint.h>
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
                               const mha_config *c, int64_t nloc,
                               int need_out)
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
    if (nloc > 0 && (!a->query || (need_out && !a->out)))
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "%s is NULL",
                            !a->query ? "query" : "out");
    return MHA_OK;
}

/* The communicator and MPI itself, before anything collective. */
static mha_status check_comm(const mha_ring_forward_args *a)
{
    if (!a)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "ring forward args are "
                            "NULL");
    int ok = 0;
    if (MPI_Initialized(&ok) != MPI_SUCCESS || !ok)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "MPI is not initialised: call MPI_Init first");
    if (a->comm == MPI_COMM_NULL)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "comm is MPI_COMM_NULL");
    return MHA_OK;
}

/* ---- the module every rank holds must be the same -------------------- */

/* FNV-1a, 64 bits, over n bytes: a fingerprint, not a defence against an
 * adversary (ranks of one job are trusted; they may be mistaken). */
static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t k = 0; k < n; k++) {
        h ^= b[k];
        h *= 1099511628211ull;
    }
    return h;
}

static uint64_t fnv_i64(uint64_t h, int64_t x) { return fnv(h, &x, sizeof x); }

/* The configuration as it acts (defaults resolved), field by field: every
 * option that changes the output, RoPE's and the modifiers' included. */
static uint64_t config_print(const mha_config *c)
{
    const int64_t dh = c->head_dim ? c->head_dim
                                   : c->num_heads ? c->embed_dim / c->num_heads
                                                  : 0;
    const mha_rope *r = &c->mods.rope;
    const float theta = r->theta != 0.0f ? r->theta : 10000.0f;
    const float rscale = r->scale != 0.0f ? r->scale : 1.0f;
    const int64_t f[] = {
        c->embed_dim, c->num_heads, c->kdim, c->vdim, c->no_bias != 0,
        c->add_bias_kv != 0, c->add_zero_attn != 0, dh,
        c->v_head_dim ? c->v_head_dim : dh,
        c->num_kv_heads ? c->num_kv_heads : c->num_heads, c->sinks != 0,
        c->mods.alibi != 0, c->mods.window != 0,
        c->mods.window ? c->mods.window_left : 0,
        c->mods.window ? c->mods.window_right : 0, r->style,
        r->style != MHA_ROPE_NONE ? (r->dims ? r->dims : dh) : 0};
    uint64_t h = 1469598103934665603ull;
    for (size_t k = 0; k < sizeof f / sizeof f[0]; k++)
        h = fnv_i64(h, f[k]);
    h = fnv(h, &c->scale, sizeof c->scale);   /* resolved by mha_get_config */
    h = fnv(h, &c->dropout, sizeof c->dropout);
    h = fnv(h, &c->mods.softcap, sizeof c->mods.softcap);
    if (r->style != MHA_ROPE_NONE) {
        h = fnv(h, &theta, sizeof theta);
        h = fnv(h, &rscale, sizeof rscale);
    }
    if (c->mods.alibi && c->mods.alibi_slopes)
        h = fnv(h, c->mods.alibi_slopes,
                (size_t)c->num_heads * sizeof(float));
    return h;
}

/* Every parameter, by name and value.  Returns MHA_OK or out of memory. */
static mha_status params_print(const mha_module *m, uint64_t *out)
{
    uint64_t h = 1469598103934665603ull;
    float *buf = NULL;
    int64_t cap = 0;
    for (int i = 0; i < mha_param_count(m); i++) {
        mha_param_info pi;
        MHA_STATUS_CHECK(mha_param_info_at(m, i, &pi));
        if (pi.numel > cap) {
            float *nb = realloc(buf, (size_t)pi.numel * sizeof *buf);
            if (!nb) {
                free(buf);
                return mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY, "out of memory "
                                    "for the parameters' fingerprint");
            }
            buf = nb;
            cap = pi.numel;
        }
        const mha_status st = mha_param_get(m, pi.name, buf, pi.numel);
        if (st != MHA_OK) {
            free(buf);
            return st;
        }
        h = fnv(h, pi.name, strlen(pi.name));
        h = fnv(h, buf, (size_t)pi.numel * sizeof *buf);
    }
    free(buf);
    *out = h;
    return MHA_OK;
}

/*
 * Whether every rank of comm holds the same module: its configuration
 * and its parameters, each compared by a fingerprint (max and min over
 * the ranks).  A rank with another weights file or another RoPE would
 * otherwise compute an output that matches neither model.  Collective;
 * the same status and message on every rank.
 */
static mha_status agree_on_module(MPI_Comm comm, const mha_module *m,
                                  const mha_config *c)
{
    uint64_t print[2] = {config_print(c), 0};
    mha_status local = params_print(m, &print[1]);
    local = agree_on(comm, local);
    if (local != MHA_OK)
        return local;
    /* [0, 2): max; [2, 4): -min, of the prints halved to fit int64 */
    int64_t send[4], recv[4];
    for (int k = 0; k < 2; k++) {
        send[k] = (int64_t)(print[k] >> 1);
        send[2 + k] = -send[k];
    }
    const int rc = MPI_Allreduce(send, recv, 4, MPI_INT64_T, MPI_MAX, comm);
    if (rc != MPI_SUCCESS)
        return mha_mpi_mpi_fail(rc, "MPI_Allreduce of the modules' "
                                "fingerprints");
    if (recv[0] != -recv[2])
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "the ranks disagree on the module's "
                            "configuration (shapes, scale, RoPE, ALiBi, the "
                            "window, softcap or dropout): every rank must "
                            "load the same module");
    if (recv[1] != -recv[3])
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "the ranks disagree on the module's parameters "
                            "(a weights file that differs on some rank?): "
                            "every rank must load the same module");
    return MHA_OK;
}

/* One call's state: the module's shapes, this rank's shard, its
 * projected heads (q, k, v rotated when the module has RoPE), the
 * attention's output ctx and, for the backward, its lse. */
typedef struct proj {
    mha_config c;
    mha_shard s;
    int64_t B, nloc, rows, H, Hkv, dh, D, Dkv;
    int64_t dv, Dv, Dvkv;   /* the values' heads: d_v, H d_v, H_kv d_v */
    float *q, *k, *v, *ctx, *lse;
    int64_t *pos;   /* global positions of the rows (RoPE), or NULL */
} proj;

static void proj_free(proj *p)
{
    free(p->q);
    free(p->k);
    free(p->v);
    free(p->ctx);
    free(p->lse);
    free(p->pos);
}

/* The attention's arguments for this rank's heads. */
static void ring_args_of(const mha_module *m, const mha_ring_forward_args *a,
                         const proj *p, mha_ring_args *r)
{
    (void)m;
    r->comm = a->comm;
    r->split = a->split;
    r->seq_len = a->seq_len;
    r->batch = p->B;
    r->num_heads = p->H;
    r->num_kv_heads = p->Hkv;
    r->head_dim = p->dh;
    r->v_head_dim = p->dv;
    r->q = p->q;
    r->k = p->k;
    r->v = p->v;
    r->scale = p->c.scale;
    r->given = p->c.given & MHA_GIVEN_SCALE;
    r->causal = a->causal;
    r->key_lengths = a->key_lengths;
    r->mods = p->c.mods;
    const mha_rope none = {MHA_ROPE_NONE, 0, 0.0f, 0.0f};
    r->mods.rope = none;   /* applied before the ring */
    r->num_threads = a->num_threads;
    r->out = p->ctx;
    r->attention_chunk = p->c.attention_chunk;   /* global positions */
}

/* Checks what this rank can alone (`local`: what the caller found
 * already), agrees with the others, projects this rank's rows and runs
 * the attention across the ranks (with its lse when `with_lse`: for the
 * backward, which needs no out), its statistics to `stats` (stats_size
 * bytes).  On failure every rank returns the same status. */
static mha_status forward_part(const mha_module *m,
                               const mha_ring_forward_args *a, int with_lse,
                               mha_status local, mha_ring_stats *stats,
                               size_t stats_size, proj *p)
{
    memset(p, 0, sizeof *p);
    int P = 1, rank = 0;
    MPI_Comm_size(a->comm, &P);
    MPI_Comm_rank(a->comm, &rank);
    mha_status st = local;
    if (st == MHA_OK && m)
        st = mha_get_config(m, &p->c);
    if (st == MHA_OK)
        st = mha_shard_of(a->split, a->seq_len, P, rank, &p->s);
    const mha_config *c = &p->c;
    p->nloc = p->s.len;
    p->B = a->batch;
    if (st == MHA_OK && p->B < 1)
        st = mha_mpi_fail(MHA_ERR_SHAPE, "batch must be >= 1, got %lld",
                          (long long)p->B);
    if (st == MHA_OK)
        st = check_module(m, a, c, p->nloc, !with_lse);
    /* Every rank's failure known to all, then the same module on all. */
    st = agree_on(a->comm, st);
    if (st == MHA_OK)
        st = agree_on_module(a->comm, m, c);
    if (st != MHA_OK)
        return st;
    p->H = c->num_heads;
    p->dh = c->head_dim ? c->head_dim : (p->H ? c->embed_dim / p->H : 0);
    p->Hkv = c->num_kv_heads ? c->num_kv_heads : p->H;
    p->D = p->H * p->dh;
    p->Dkv = p->Hkv * p->dh;
    p->dv = c->v_head_dim ? c->v_head_dim : p->dh;
    p->Dv = p->H * p->dv;
    p->Dvkv = p->Hkv * p->dv;
    p->rows = p->B * p->nloc;
    const int64_t rows = p->rows;
    if (st == MHA_OK) {
        p->q = malloc((size_t)(rows * p->D + 1) * sizeof *p->q);
        p->k = malloc((size_t)(rows * p->Dkv + 1) * sizeof *p->k);
        p->v = malloc((size_t)(rows * p->Dvkv + 1) * sizeof *p->v);
        p->ctx = malloc((size_t)(rows * p->Dv + 1) * sizeof *p->ctx);
        p->lse = with_lse ? malloc((size_t)(rows * p->H + 1) *
                                   sizeof *p->lse)
                          : NULL;
        if (!p->q || !p->k || !p->v || !p->ctx || (with_lse && !p->lse))
            st = mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                              "out of memory for the projected heads "
                              "(%lld rows)", (long long)rows);
    }
    const float *key = a->key ? a->key : a->query;
    const float *value = a->value ? a->value : key;
    if (st == MHA_OK && rows > 0)
        st = mha_project(m, MHA_PROJ_QUERY, a->query, rows, p->q);
    if (st == MHA_OK && rows > 0)
        st = mha_project(m, MHA_PROJ_KEY, key, rows, p->k);
    if (st == MHA_OK && rows > 0)
        st = mha_project(m, MHA_PROJ_VALUE, value, rows, p->v);
    /* RoPE at each token's global position, here, before the ring: the
     * blocks then travel rotated already. */
    if (st == MHA_OK && rows > 0 && c->mods.rope.style != MHA_ROPE_NONE) {
        p->pos = malloc((size_t)rows * sizeof *p->pos);
        if (!p->pos)
            st = mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY,
                              "out of memory for RoPE's positions");
        for (int64_t b = 0; p->pos && b < p->B; b++)
            for (int64_t x = 0; x < p->nloc; x++)
                p->pos[b * p->nloc + x] =
                    x < p->s.length[0] ? p->s.offset[0] + x
                                       : p->s.offset[1] + (x - p->s.length[0]);
        if (st == MHA_OK)
            st = mha_rope_apply(&c->mods.rope, rows, p->H, p->dh, p->pos, 0,
                                p->q, p->D);
        if (st == MHA_OK)
            st = mha_rope_apply(&c->mods.rope, rows, p->Hkv, p->dh, p->pos, 0,
                                p->k, p->Dkv);
    }
    /* Every rank learns of any rank's failure before the attention. */
    st = agree_on(a->comm, st);
    if (st != MHA_OK)
        return st;
    mha_ring_args r = {0};
    ring_args_of(m, a, p, &r);
    r.lse = p->lse;
    r.stats = stats;
    return a->ulysses ? mha_ulysses_attention_sized(&r, sizeof r, stats_size)
                      : mha_ring_attention_sized(&r, sizeof r, stats_size);
}

/* The library's copy of the caller's forward args (the ABI rule) in
 * *copy, then the communicator checked.  Returns what this rank must
 * answer alone (NULL args, size 0, no MPI); *abi is a refusal of the
 * struct or of the stats' size, for the ranks to agree on. */
static mha_status forward_args_in(mha_ring_forward_args *copy,
                                  const mha_ring_forward_args *args,
                                  size_t args_size, size_t stats_size,
                                  mha_status *abi)
{
    *abi = mha_mpi_struct_in(copy, sizeof *copy, args, args_size,
                             "mha_ring_forward_args");
    if (args && args_size == 0)
        return *abi;
    MHA_STATUS_CHECK(check_comm(args ? copy : NULL));
    if (*abi == MHA_OK)
        *abi = mha_mpi_struct_out_size(copy->stats, stats_size,
                                       "mha_ring_stats");
    return MHA_OK;
}

mha_status mha_ring_forward_sized(const mha_module *m,
                                  const mha_ring_forward_args *args,
                                  size_t args_size, size_t stats_size)
{
    mha_ring_forward_args a_;
    const mha_ring_forward_args *a = &a_;
    mha_status abi;
    mha_status st = forward_args_in(&a_, args, args_size, stats_size, &abi);
    if (st != MHA_OK)
        return st;
    proj p;
    st = forward_part(m, a, 0, abi, a->stats, stats_size, &p);
    mha_status local = MHA_OK;
    if (st == MHA_OK && p.rows > 0)
        local = mha_project(m, MHA_PROJ_OUT, p.ctx, p.rows, a->out);
    if (st == MHA_OK)
        st = agree_on(a->comm, local);
    proj_free(&p);
    return st;
}

/* The gradient targets, as mha_backward takes them: with the forward's
 * key NULL grad_query receives all three input gradients, with only its
 * value NULL grad_key receives the key's and the value's. */
static mha_status check_grads(const mha_ring_forward_args *a,
                              const mha_ring_backward_args *g, int64_t nloc)
{
    if (!g)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "backward args are NULL");
    if (nloc > 0 && !g->grad_out)
        return mha_mpi_fail(MHA_ERR_NULL_POINTER, "grad_out is NULL");
    if (!a->key && (g->grad_key || g->grad_value))
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "self-attention (key NULL): grad_query receives "
                            "every input's gradient; grad_key and grad_value "
                            "must be NULL");
    if (!a->value && g->grad_value)
        return mha_mpi_fail(MHA_ERR_INVALID_ARGUMENT,
                            "value NULL (the key is the value): grad_key "
                            "receives both; grad_value must be NULL");
    return MHA_OK;
}

mha_status mha_ring_backward_sized(const mha_module *m,
                                   const mha_ring_forward_args *args,
                                   size_t args_size,
                                   const mha_ring_backward_args *grads,
                                   size_t grads_size, size_t stats_size)
{
    mha_ring_forward_args a_;
    mha_ring_backward_args g_ = {0};
    const mha_ring_forward_args *a = &a_;
    mha_status abi;
    mha_status st = forward_args_in(&a_, args, args_size, stats_size, &abi);
    if (st != MHA_OK)
        return st;
    if (abi == MHA_OK)
        abi = mha_mpi_struct_in(&g_, sizeof g_, grads, grads_size,
                                "mha_ring_backward_args");
    const mha_ring_backward_args *g = grads ? &g_ : NULL;
    proj p;
    float *dctx = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *gp = NULL;
    int64_t np = m ? mha_param_numel(m) : 0;
    {
        /* what this rank can check before any work, agreed on */
        mha_shard s;
        int P = 1, rank = 0;
        MPI_Comm_size(a->comm, &P);
        MPI_Comm_rank(a->comm, &rank);
        mha_status local = abi;
        if (local == MHA_OK)
            local = mha_shard_of(a->split, a->seq_len, P, rank, &s);
        if (local == MHA_OK)
            local = check_grads(a, g, s.len);
        if (local == MHA_OK && g->grad_params && np > 0 &&
            !(gp = malloc((size_t)np * sizeof *gp)))
            local = mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY, "out of memory for "
                                 "the parameters' gradients");
        st = agree_on(a->comm, local);
        if (st != MHA_OK) {
            free(gp);
            return st;
        }
    }
    st = forward_part(m, a, 1, MHA_OK, NULL, 0, &p);
    const int64_t rows = p.rows;
    mha_status local = MHA_OK;
    if (st == MHA_OK) {
        dctx = malloc((size_t)(rows * p.Dv + 1) * sizeof *dctx);
        dq = malloc((size_t)(rows * p.D + 1) * sizeof *dq);
        dk = malloc((size_t)(rows * p.Dkv + 1) * sizeof *dk);
        dv = malloc((size_t)(rows * p.Dvkv + 1) * sizeof *dv);
        if (!dctx || !dq || !dk || !dv)
            local = mha_mpi_fail(MHA_ERR_OUT_OF_MEMORY, "out of memory for "
                                 "the heads' gradients (%lld rows)",
                                 (long long)rows);
        if (gp)
            memset(gp, 0, (size_t)np * sizeof *gp);
        /* out_proj: dW_o, db_o and d ctx */
        if (local == MHA_OK && rows > 0)
            local = mha_project_backward(m, MHA_PROJ_OUT, p.ctx, rows,
                                         g->grad_out, dctx, 0, gp, 0,
                                         a->num_threads);
        st = agree_on(a->comm, local);
    }
    if (st == MHA_OK) {
        /* the attention's backward across the ranks */
        mha_ring_args r = {0};
        ring_args_of(m, a, &p, &r);
        r.lse = p.lse;
        r.stats = a->stats;
        const mha_ring_grads rg = {dctx, dq, dk, dv};
        st = a->ulysses
                 ? mha_ulysses_attention_backward_sized(&r, sizeof r, &rg,
                                                        sizeof rg, stats_size)
                 : mha_ring_attention_backward_sized(&r, sizeof r, &rg,
                                                     sizeof rg, stats_size);
    }
    if (st == MHA_OK && rows > 0) {
        /* RoPE's rotation turned back, then the input projections */
        const mha_config *c = &p.c;
        if (p.pos)
            local = mha_rope_apply_inverse(&c->mods.rope, rows, p.H, p.dh,
                                           p.pos, 0, dq, p.D);
        if (local == MHA_OK && p.pos)
            local = mha_rope_apply_inverse(&c->mods.rope, rows, p.Hkv, p.dh,
                                           p.pos, 0, dk, p.Dkv);
        const float *key = a->key ? a->key : a->query;
        const float *value = a->value ? a->value : key;
        /* where each input's gradient goes, and whether it adds */
        float *gk = a->key ? g->grad_key : g->grad_query;
        float *gv = a->value ? g->grad_value : gk;
        if (local == MHA_OK)
            local = mha_project_backward(m, MHA_PROJ_QUERY, a->query, rows,
                                         dq, g->grad_query, 0, gp, 0,
                                         a->num_threads);
        if (local == MHA_OK)
            local = mha_project_backward(m, MHA_PROJ_KEY, key, rows, dk, gk,
                                         !a->key, gp, 0, a->num_threads);
        if (local == MHA_OK)
            local = mha_project_backward(m, MHA_PROJ_VALUE, value, rows, dv,
                                         gv, !a->value, gp, 0,
                                         a->num_threads);
    }
    if (st == MHA_OK)
        st = agree_on(a->comm, local);
    if (st == MHA_OK && gp) {
        /* the parameters' gradients summed over the ranks (MPI's order:
         * fixed for a given P and size, so bitwise from run to run) */
        int rc = MPI_Allreduce(MPI_IN_PLACE, gp, (int)np, MPI_FLOAT, MPI_SUM,
                               a->comm);
        if (rc != MPI_SUCCESS)
            st = mha_mpi_mpi_fail(rc, "MPI_Allreduce of the parameters' "
                                  "gradients");
        st = agree_on(a->comm, st);
        for (int64_t i = 0; st == MHA_OK && i < np; i++)
            g->grad_params[i] = g->accumulate ? g->grad_params[i] + gp[i]
                                              : gp[i];
    }
    free(dctx);
    free(dq);
    free(dk);
    free(dv);
    free(gp);
    proj_free(&p);
    return st;
}
