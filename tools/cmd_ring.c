/*
 * cmd_ring.c -- `mha forward --ring`, `mha backward --ring` and `mha bench
 * --ring`: the module's forward and backward, and the attention alone,
 * across the ranks of an MPI job
 * (`mpirun -np P mha ...`), on libmha_mpi.  Built with MPI only; without
 * it both say so and fail.
 *
 * Every rank parses the same options and reads the inputs; a rank's own
 * failure (a missing file) is printed by that rank, and every rank exits
 * non-zero.  Library errors are the same on every rank (libmha_mpi checks
 * collectively) and printed once, by rank 0.  Rank 0 gathers the output
 * and writes it, only when every rank succeeded.
 */
#include "args.h"
#include "commands.h"
#include "fail.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MHA_HAVE_MPI

int cmd_forward_ring(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return tool_fail("forward", "--ring: this mha was built without MPI "
                     "(install libopenmpi-dev and configure with "
                     "-DMHA_MPI=ON)");
}

int cmd_backward_ring(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return tool_fail("backward", "--ring: this mha was built without MPI "
                     "(install libopenmpi-dev and configure with "
                     "-DMHA_MPI=ON)");
}

int cmd_bench_ring(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return tool_fail("bench", "--ring: this mha was built without MPI "
                     "(install libopenmpi-dev and configure with "
                     "-DMHA_MPI=ON)");
}

#else

#include "mha_io.h"
#include "mha_mpi.h"

#include <math.h>
#include <sys/resource.h>

static int g_rank, g_P;

/* 1 on every rank when any rank's rc is non-zero. */
static int any_failed(int rc)
{
    int any = 0;
    MPI_Allreduce(&rc, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return any != 0;
}

static int parse_split(const char *cmd, const char *s, int causal,
                       mha_seq_split *out)
{
    if (!s)
        *out = causal ? MHA_SPLIT_ZIGZAG : MHA_SPLIT_CONTIGUOUS;
    else if (!strcmp(s, "contiguous"))
        *out = MHA_SPLIT_CONTIGUOUS;
    else if (!strcmp(s, "zigzag"))
        *out = MHA_SPLIT_ZIGZAG;
    else
        return tool_fail(cmd, "--split must be contiguous or zigzag, got "
                         "'%s'", s);
    return 0;
}

static int64_t global_row(const mha_shard *s, int64_t x)
{
    return x < s->length[0] ? s->offset[0] + x
                            : s->offset[1] + (x - s->length[0]);
}

/* An input .npy's header: (B, L, w) or unbatched (L, w), float.  The
 * data is not read (load_shard reads this rank's rows of it). */
static int input_info(const char *cmd, const char *path, const char *what,
                      mha_tensor_view *x, int64_t *B, int64_t *L)
{
    if (mha_npy_info(path, x) != MHA_OK)
        return tool_fail(cmd, "%s %s: %s", what, path, mha_last_error());
    if ((x->ndim != 2 && x->ndim != 3) ||
        (x->dtype != MHA_DTYPE_F32 && x->dtype != MHA_DTYPE_F64))
        return tool_fail(cmd, "%s %s: expected a float (B, L, E) or (L, E) "
                         "array", what, path);
    *B = x->ndim == 3 ? x->shape[0] : 1;
    *L = x->shape[x->ndim - 2];
    return 0;
}

/* This rank's rows of an input (B, L, w): its shard's pieces, read from
 * the file alone, (B, len, w) float32. */
static int load_shard(const char *cmd, const char *path, const char *what,
                      const mha_shard *s, mha_tensor **t)
{
    if (mha_npy_load_rows(path, s->n_pieces, s->offset, s->length, t) !=
        MHA_OK)
        return tool_fail(cmd, "%s %s: %s", what, path, mha_last_error());
    return 0;
}

static const char FORWARD_RING_HELP[] =
    "usage: mpirun -np P mha forward --ring [--ulysses]\n"
    "         --weights W.safetensors [--heads H] --query Q.npy\n"
    "         [--key K.npy [--value V.npy]] [--key-lengths KL.npy]\n"
    "         [--causal | --causal-top-left] [--split contiguous|zigzag]\n"
    "         [--threads T] --out OUT.npy\n"
    "\n"
    "The module's forward (self-attention on one sequence) across the ranks\n"
    "of an MPI job (--ulysses alone implies --ring): each rank keeps its\n"
    "shard of the sequence (--split; default zigzag with --causal, else\n"
    "contiguous), projects it, the\n"
    "attention runs round the ring (or by all-to-all with --ulysses, which\n"
    "needs the head counts to be multiples of P), and rank 0 gathers and\n"
    "writes --out.  Each rank reads only its shard's rows of the input\n"
    "files.  No masks but --key-lengths and causal; modules with\n"
    "add_bias_kv, add_zero_attn or sinks are refused (RoPE, ALiBi, the\n"
    "window and a softcap are kept).\n";

static const char BACKWARD_RING_HELP[] =
    "usage: mpirun -np P mha backward --ring [--ulysses]\n"
    "         --weights W.safetensors [--heads H] --query Q.npy\n"
    "         [--key K.npy [--value V.npy]] [--key-lengths KL.npy]\n"
    "         [--causal | --causal-top-left] [--split contiguous|zigzag]\n"
    "         [--threads T] --grad-output DY.npy --out GRADS.safetensors\n"
    "\n"
    "The gradients of `mha forward --ring` (the same inputs and options)\n"
    "given dL/d output, across the ranks (mha_ring_backward): each rank\n"
    "its shard's input gradients and its share of the parameters'\n"
    "gradients, summed over the ranks; rank 0 gathers and writes --out,\n"
    "the file `mha backward` writes (query, key, value when given, then\n"
    "in_proj_weight ... out_proj.bias; without --key, `query` holds the sum\n"
    "of the three inputs' gradients, with --key but no --value `key` holds\n"
    "both), atomically, only when every rank succeeded.\n";

/* What the module commands across ranks share: the module, the inputs
 * (whole, as read) and this rank's shards of them. */
typedef struct ring_inputs {
    mha_module *m;
    mha_config c;
    mha_tensor_view iq, ik, iv;   /* the files' shapes (ndim 0: none) */
    mha_tensor *tq, *tk, *tv, *tl;  /* this rank's rows; the key lengths */
    const float *xq, *xk, *xv;
    int64_t B, L, E, threads;
    mha_seq_split split;
    mha_shard s;
    int causal;
} ring_inputs;

#define RING_OPTS                                                       \
    {"ring", 0, 0}, {"ulysses", 0, 0}, {"split", 1, 0},                 \
        {"weights", 1, 0}, {"heads", 1, 0}, {"query", 1, 0},            \
        {"key", 1, 0}, {"value", 1, 0}, {"key-lengths", 1, 0},          \
        {"causal", 0, 0}, {"causal-top-left", 0, 0}, {"threads", 1, 0}, \
        {"out", 1, 0}

static void ring_inputs_free(ring_inputs *in)
{
    mha_tensor_free(in->tq);
    mha_tensor_free(in->tk);
    mha_tensor_free(in->tv);
    mha_tensor_free(in->tl);
    mha_free(in->m);
}

/* Reads the module, checks the inputs the options name by their headers,
 * and reads this rank's shards of them (nothing else of the files).  Returns 0 or non-zero (printed by this
 * rank). */
static int ring_inputs_load(const char *cmd, tool_opt *o, int nopts,
                            ring_inputs *in)
{
#define OPT(name) tool_get(o, nopts, name)
    memset(in, 0, sizeof *in);
    in->causal = OPT("causal") || OPT("causal-top-left");
    int64_t heads = 0;
    if (OPT("causal") && OPT("causal-top-left"))
        return tool_fail(cmd, "--causal and --causal-top-left are the same "
                         "here (one sequence): give one");
    if ((OPT("heads") &&
         tool_int(cmd, "heads", OPT("heads"), 1, 1 << 20, &heads)) ||
        (OPT("threads") &&
         tool_int(cmd, "threads", OPT("threads"), 0, 4096, &in->threads)) ||
        parse_split(cmd, OPT("split"), in->causal, &in->split))
        return 1;
    if (mha_module_load(OPT("weights"), heads, &in->m) != MHA_OK)
        return tool_fail(cmd, "--weights %s: %s", OPT("weights"),
                         mha_last_error());
    mha_get_config(in->m, &in->c);
    if (input_info(cmd, OPT("query"), "--query", &in->iq, &in->B, &in->L))
        return 1;
    for (int t = 0; t < 2; t++) {
        const char *name = t ? "value" : "key";
        mha_tensor_view *x = t ? &in->iv : &in->ik;
        int64_t b2 = 0, l2 = 0;
        if (!OPT(name))
            continue;
        if (input_info(cmd, OPT(name), t ? "--value" : "--key", x, &b2, &l2))
            return 1;
        if (b2 != in->B || l2 != in->L)
            return tool_fail(cmd, "--%s has batch %lld and length %lld; the "
                             "query %lld and %lld (one sequence split "
                             "across the ranks)", name, (long long)b2,
                             (long long)l2, (long long)in->B,
                             (long long)in->L);
    }
    if (OPT("key-lengths")) {
        const mha_tensor *tl;
        if (mha_npy_load(OPT("key-lengths"), &in->tl) != MHA_OK)
            return tool_fail(cmd, "--key-lengths %s: %s", OPT("key-lengths"),
                             mha_last_error());
        tl = in->tl;
        if (tl->ndim != 1 || tl->shape[0] != in->B ||
            (tl->dtype != MHA_DTYPE_I32 && tl->dtype != MHA_DTYPE_I64))
            return tool_fail(cmd, "--key-lengths must hold %lld integers "
                             "(B), one per sequence", (long long)in->B);
    }
    in->E = in->c.embed_dim;
    const mha_tensor_view *q = &in->iq;
    if (q->shape[q->ndim - 1] != in->E)
        return tool_fail(cmd, "--query has width %lld, the module embed_dim "
                         "%lld", (long long)q->shape[q->ndim - 1],
                         (long long)in->E);
    if (mha_shard_of(in->split, in->L, g_P, g_rank, &in->s) != MHA_OK)
        return tool_fail(cmd, "%s", mha_last_error());
    if (load_shard(cmd, OPT("query"), "--query", &in->s, &in->tq) ||
        (OPT("key") &&
         load_shard(cmd, OPT("key"), "--key", &in->s, &in->tk)) ||
        (OPT("value") &&
         load_shard(cmd, OPT("value"), "--value", &in->s, &in->tv)))
        return 1;
    in->xq = in->tq->data;
    in->xk = in->tk ? in->tk->data : NULL;
    in->xv = in->tv ? in->tv->data : NULL;
    return 0;
#undef OPT
}

static mha_ring_forward_args forward_args_of(const ring_inputs *in,
                                             int ulysses, float *out)
{
    mha_ring_forward_args a = {0};
    a.comm = MPI_COMM_WORLD;
    a.split = in->split;
    a.seq_len = in->L;
    a.batch = in->B;
    a.query = in->xq;
    a.key = in->xk;
    a.value = in->xv;
    a.causal = in->causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    a.key_lengths = in->tl ? (const int64_t *)in->tl->data : NULL;
    a.num_threads = (int)in->threads;
    a.ulysses = ulysses;
    a.out = out;
    return a;
}

/* Every rank's rows (B, len_r, w) of x into *all (B, L, w) on rank 0, in
 * sequence order (*all NULL elsewhere).  Collective.  Returns non-zero on
 * every rank when memory ran out on any. */
static int gather_rows(const char *cmd, const ring_inputs *in,
                       const float *x, int64_t w, float **all)
{
    const int64_t B = in->B, L = in->L;
    int *cnt = malloc((size_t)g_P * 2 * sizeof *cnt);
    float *recv = g_rank == 0 ? malloc((size_t)(B * L * w + 1) * 4) : NULL;
    *all = g_rank == 0 ? malloc((size_t)(B * L * w + 1) * 4) : NULL;
    if (any_failed(!cnt || (g_rank == 0 && (!recv || !*all)))) {
        free(cnt);
        free(recv);
        free(*all);
        *all = NULL;
        return g_rank == 0 ? tool_fail(cmd, "out of memory for the gathered "
                                       "rows") : 1;
    }
    int64_t off = 0;
    for (int r = 0; r < g_P; r++) {
        mha_shard o2;
        mha_shard_of(in->split, L, g_P, r, &o2);
        cnt[r] = (int)(B * o2.len * w);
        cnt[g_P + r] = (int)off;
        off += cnt[r];
    }
    MPI_Gatherv(x, (int)(B * in->s.len * w), MPI_FLOAT, recv, cnt, cnt + g_P,
                MPI_FLOAT, 0, MPI_COMM_WORLD);
    for (int r = 0; g_rank == 0 && r < g_P; r++) {
        mha_shard o2;
        mha_shard_of(in->split, L, g_P, r, &o2);
        const float *src = recv + cnt[g_P + r];
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < o2.len; i++)
                memcpy(*all + (b * L + global_row(&o2, i)) * w,
                       src + (b * o2.len + i) * w, (size_t)w * 4);
    }
    free(cnt);
    free(recv);
    return 0;
}

/* The view of a gathered (B, L, w) array in the shape of input t. */
static mha_tensor_view view_like(const char *name, const mha_tensor_view *t,
                                 const float *data)
{
    mha_tensor_view v = {name, MHA_DTYPE_F32, t->ndim, {0}, data};
    for (int d = 0; d < t->ndim; d++)
        v.shape[d] = t->shape[d];
    return v;
}

/* A failure met while the ranks parse and load (tool_fail_capture):
 * every rank meets the same one when the files are shared, and it is
 * printed once, by rank 0 (told_once), not once per rank, interleaved. */
static char g_msg[1024];

/* MPI up, this process's rank and the rank count; failures captured. */
static void mpi_start(int *argc, char ***argv)
{
    int provided;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_P);
    tool_fail_capture(g_msg, sizeof g_msg);
}

/* Collective: 1 on every rank when any rank's rc is non-zero, and rank 0
 * prints the captured message of the lowest failing rank (naming that
 * rank if not itself).  Capturing ends here: later failures are printed
 * as they come (the library's, by rank 0 alone). */
static int told_once(int rc)
{
    tool_fail_capture(NULL, 0);
    const int mine = rc ? g_rank : g_P;
    int first = g_P;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first == g_P)
        return 0;
    MPI_Bcast(g_msg, (int)sizeof g_msg, MPI_CHAR, first, MPI_COMM_WORLD);
    g_msg[sizeof g_msg - 1] = '\0';
    if (g_rank == 0) {
        if (first)
            fprintf(stderr, "%s (rank %d of %d)\n", g_msg, first, g_P);
        else
            fprintf(stderr, "%s\n", g_msg);
    }
    return 1;
}

/* The ring commands, as the ranks compare them. */
enum { RING_FORWARD = 1, RING_BACKWARD = 2, RING_BENCH = 3 };

/*
 * After parsing, before anything collective of the command: every rank
 * learns which command each runs and whether its options were taken
 * (`done`: tool_options ended the command, with `status` 0 after --help),
 * so that a rank that stops early, or runs another command's
 * collectives, cannot leave the others waiting for ever.  Returns -1 to
 * go on, else the exit status of every rank (0 when all asked for
 * --help); rank 0 says what the ranks disagree on, a rank whose options
 * were refused has said why itself.
 */
static int agree_on_start(const char *cmd, int which, int done, int status)
{
    const int64_t state = !done ? 0 : status == 0 ? 1 : 2;  /* go, help, bad */
    const int64_t mine[4] = {which, -which, state, -state};
    int64_t all[4];
    MPI_Allreduce(mine, all, 4, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    if (all[0] != -all[1]) {
        tool_fail_capture(NULL, 0);
        if (g_rank == 0)
            tool_fail(cmd, "the ranks do not all run the same command (mha "
                      "forward --ring, backward --ring, bench --ring): every "
                      "rank of the job must run the same command");
        return 1;
    }
    if (all[2] == 2)   /* the first refused rank's message, once */
        return told_once(state == 2);
    if (all[2] == 1 && -all[3] == 1)
        return 0;   /* --help on every rank */
    if (all[2] == 1) {
        tool_fail_capture(NULL, 0);
        if (g_rank == 0)
            tool_fail(cmd, "--help was given to some ranks only: every rank "
                      "must be given the same options");
        return 1;
    }
    return -1;
}

int cmd_forward_ring(int argc, char **argv)
{
    tool_opt o[] = {RING_OPTS};
    int status = 0;
    mpi_start(&argc, &argv);
    int done = tool_options("forward", argc, argv, o, NOPTS(o),
                            g_rank == 0 ? FORWARD_RING_HELP : "", &status);
    const int start = agree_on_start("forward", RING_FORWARD, done, status);
    if (start >= 0) {
        MPI_Finalize();
        return start;
    }
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"weights", "query", "out"};
    static const char *const outs[] = {"out"};
    ring_inputs in;
    memset(&in, 0, sizeof in);
    float *out = NULL, *all = NULL;
    if (!done)
        status = tool_require("forward", o, NOPTS(o), need, 3) ||
                 tool_outputs_apart("forward", o, NOPTS(o), outs, 1) ||
                 ring_inputs_load("forward", o, NOPTS(o), &in);
    if (!done && !status &&
        !(out = malloc((size_t)(in.B * in.s.len * in.E + 1) * sizeof *out)))
        status = tool_fail("forward", "out of memory for the output");
    /* Every rank learns of any rank's failure here. */
    int rc = told_once(status);   /* (done is 0 here: agree_on_start) */
    if (!done && !rc) {
        const mha_ring_forward_args a =
            forward_args_of(&in, OPT("ulysses") != NULL, out);
        if (mha_ring_forward(in.m, &a) != MHA_OK) {
            /* the same on every rank */
            if (g_rank == 0)
                tool_fail("forward", "%s", mha_last_error());
            rc = 1;
        }
    }
    if (!done && !rc) {
        rc = gather_rows("forward", &in, out, in.E, &all);
        if (!rc && g_rank == 0) {
            const mha_tensor_view v = view_like("", &in.iq, all);
            if (mha_npy_save(OPT("out"), &v) != MHA_OK)
                rc = tool_fail("forward", "--out: %s", mha_last_error());
        }
        rc = any_failed(rc);
    }
#undef OPT
    free(out);
    free(all);
    ring_inputs_free(&in);
    MPI_Finalize();
    return rc;
}

int cmd_backward_ring(int argc, char **argv)
{
    tool_opt o[] = {RING_OPTS, {"grad-output", 1, 0}};
    int status = 0;
    mpi_start(&argc, &argv);
    int done = tool_options("backward", argc, argv, o, NOPTS(o),
                            g_rank == 0 ? BACKWARD_RING_HELP : "", &status);
    const int start = agree_on_start("backward", RING_BACKWARD, done, status);
    if (start >= 0) {
        MPI_Finalize();
        return start;
    }
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"weights", "query", "grad-output",
                                       "out"};
    static const char *const outs[] = {"out"};
    ring_inputs in;
    memset(&in, 0, sizeof in);
    mha_tensor *dy = NULL;
    float *g[3] = {NULL, NULL, NULL}, *gp = NULL;
    float *all[3] = {NULL, NULL, NULL};
    mha_tensor_view *views = NULL;
    if (!done)
        status = tool_require("backward", o, NOPTS(o), need, 4) ||
                 tool_outputs_apart("backward", o, NOPTS(o), outs, 1) ||
                 ring_inputs_load("backward", o, NOPTS(o), &in);
    if (!done && !status) {
        int64_t b2 = 0, l2 = 0;
        mha_tensor_view id;
        status = input_info("backward", OPT("grad-output"), "--grad-output",
                            &id, &b2, &l2);
        if (!status && (id.ndim != in.iq.ndim || b2 != in.B ||
                        l2 != in.L || id.shape[id.ndim - 1] != in.E))
            status = tool_fail("backward", "--grad-output %s must have the "
                               "forward output's shape, the query's",
                               OPT("grad-output"));
        if (!status)
            status = load_shard("backward", OPT("grad-output"),
                                "--grad-output", &in.s, &dy);
    }
    /* the inputs' gradients: query, and key / value when given (each
     * input's own; a missing one's go to the input that served for it) */
    const mha_tensor_view *ins[3] = {&in.iq, in.ik.ndim ? &in.ik : NULL,
                                     in.iv.ndim ? &in.iv : NULL};
    int64_t w[3] = {in.E, 0, 0};
    const int64_t np = in.m ? mha_param_numel(in.m) : 0;
    if (!done && !status) {
        for (int t = 0; t < 3; t++) {
            if (!ins[t])
                continue;
            w[t] = ins[t]->shape[ins[t]->ndim - 1];
            g[t] = malloc((size_t)(in.B * in.s.len * w[t] + 1) * 4);
        }
        gp = malloc((size_t)(np + 1) * 4);
        if (!g[0] || (ins[1] && !g[1]) || (ins[2] && !g[2]) || !gp)
            status = tool_fail("backward", "out of memory for the "
                               "gradients");
    }
    int rc = told_once(status);   /* (done is 0 here: agree_on_start) */
    if (!done && !rc) {
        const mha_ring_forward_args a =
            forward_args_of(&in, OPT("ulysses") != NULL, NULL);
        const mha_ring_backward_args b = {dy->data, g[0], g[1], g[2], gp,
                                          0};
        if (mha_ring_backward(in.m, &a, &b) != MHA_OK) {
            if (g_rank == 0)
                tool_fail("backward", "%s", mha_last_error());
            rc = 1;
        }
    }
    for (int t = 0; !done && !rc && t < 3; t++)
        if (ins[t])
            rc = gather_rows("backward", &in, g[t], w[t], &all[t]);
    if (!done && !rc && g_rank == 0) {
        static const char *const names[3] = {"query", "key", "value"};
        const int nparams = mha_param_count(in.m);
        int n = 0;
        if (!(views = calloc((size_t)(3 + nparams), sizeof *views)))
            rc = tool_fail("backward", "out of memory for the gradients");
        for (int t = 0; !rc && t < 3; t++)
            if (ins[t])
                views[n++] = view_like(names[t], ins[t], all[t]);
        for (int p = 0; !rc && p < nparams; p++) {
            mha_param_info info;
            mha_param_info_at(in.m, p, &info);
            mha_tensor_view *pv = &views[n++];
            *pv = (mha_tensor_view){info.name, MHA_DTYPE_F32, info.ndim, {0},
                                    gp + info.offset};
            for (int d = 0; d < info.ndim; d++)
                pv->shape[d] = info.shape[d];
        }
        if (!rc && mha_safetensors_save(OPT("out"), views, n, NULL, NULL,
                                        0) != MHA_OK)
            rc = tool_fail("backward", "--out: %s", mha_last_error());
    }
    if (!done)
        rc = any_failed(rc);
#undef OPT
    for (int t = 0; t < 3; t++) {
        free(g[t]);
        free(all[t]);
    }
    free(views);
    free(gp);
    mha_tensor_free(dy);
    ring_inputs_free(&in);
    MPI_Finalize();
    return rc;
}

/* ---- bench --ring ------------------------------------------------------- */

static const char BENCH_RING_HELP[] =
    "usage: mpirun -np P mha bench --ring [--ulysses] --seq L --embed-dim E\n"
    "         --heads H [--kv-heads H_kv] [--batch B] [--causal]\n"
    "         [--split contiguous|zigzag] [--backward] [--threads T]\n"
    "         [--repeat N] [--warmup W] [--check ROWS]\n"
    "\n"
    "Times the attention alone (heads already projected, random inputs)\n"
    "across the ranks: each rank holds its shard of L tokens.  Rank 0\n"
    "prints the slowest rank's median time per call, per-rank peak memory\n"
    "(the call's workspace and the process's maximum resident set after\n"
    "the timed calls), bytes sent per rank, and the share of the\n"
    "communication hidden behind the compute: 1 - (time blocked in\n"
    "MPI_Wait*) / (time of the same transfers alone, measured by a ring\n"
    "pass without compute).  The inputs are a function of each element's\n"
    "global index (the same for every P), so with --check ROWS the forward\n"
    "output of ROWS query rows spread over the sequence (every batch row\n"
    "and head) is compared with a float64 attention of that row over the\n"
    "regenerated keys, within the test suite's bound: twice the error of a\n"
    "naive float32 attention of the same row, plus 1e-6 (1 + max |ref|).\n"
    "The check streams over the keys: it needs no memory of its own.\n";

static int cmp_double(const void *a, const void *b)
{
    const double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The ring's transfers alone: P - 1 steps of Isend / Irecv of the blocks
 * the attention sends (2 B len Ekv floats of each rank's shard). */
static double transfers_alone(mha_seq_split split, int64_t L, int64_t B,
                              int64_t Ekv, float *buf[2])
{
    MPI_Barrier(MPI_COMM_WORLD);
    const double t0 = MPI_Wtime();
    const int next = (g_rank + 1) % g_P, prev = (g_rank + g_P - 1) % g_P;
    for (int s = 0; s + 1 < g_P; s++) {
        mha_shard a, b;
        mha_shard_of(split, L, g_P, (g_rank - s + g_P) % g_P, &a);
        mha_shard_of(split, L, g_P, (g_rank - s - 1 + 2 * g_P) % g_P, &b);
        MPI_Request req[2];
        MPI_Irecv(buf[(s + 1) % 2], (int)(2 * B * b.len * Ekv), MPI_FLOAT,
                  prev, s, MPI_COMM_WORLD, &req[0]);
        MPI_Isend(buf[s % 2], (int)(2 * B * a.len * Ekv), MPI_FLOAT, next, s,
                  MPI_COMM_WORLD, &req[1]);
        MPI_Waitall(2, req, MPI_STATUSES_IGNORE);
    }
    return MPI_Wtime() - t0;
}

/* The bench's inputs: element i of tensor t (0 q, 1 k, 2 v, 3 dO, each
 * (B, L, w) over the whole sequence) is a hash of (t, i), uniform in
 * [-0.5, 0.5): every rank makes its shard alone, the same for every P,
 * and the check below regenerates any key it needs. */
static float input_at(int t, uint64_t i)
{
    uint64_t x = i + 0x9e3779b97f4a7c15ull * (uint64_t)(t + 1);
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;   /* splitmix64's finaliser */
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return (float)((double)(x >> 40) * (1.0 / (1 << 24))) - 0.5f;
}

/* This rank's rows of tensor t (B, L, w) into x (B, len, w). */
static void fill_shard(float *x, int t, const mha_shard *s, int64_t B,
                       int64_t L, int64_t w)
{
    for (int64_t b = 0; b < B; b++)
        for (int64_t r = 0; r < s->len; r++) {
            const uint64_t g = (uint64_t)((b * L + global_row(s, r)) * w);
            float *y = x + (b * s->len + r) * w;
            for (int64_t c = 0; c < w; c++)
                y[c] = input_at(t, g + (uint64_t)c);
        }
}

/* One query row's attention, head h of batch b at global position i,
 * over the regenerated keys 0 .. n-1, in float64 (ref) and as a naive
 * float32 program (naive: scores, max, exp and sums in float): the test
 * suite's reference and its float32 twin. */
static void check_row(int64_t b, int64_t i, int64_t h, int64_t L,
                      int64_t n, int64_t dh, int64_t E, int64_t Ekv,
                      int64_t group, double *ref, float *naive)
{
    const int64_t hk = h / group;
    const double scale = 1.0 / sqrt((double)dh);
    const uint64_t qi = (uint64_t)((b * L + i) * E + h * dh);
    double m = -INFINITY, l = 0.0;
    float mf = -INFINITY, lf = 0.0f;
    for (int64_t d = 0; d < dh; d++) {
        ref[d] = 0.0;
        naive[d] = 0.0f;
    }
    for (int pass = 0; pass < 2; pass++)
        for (int64_t j = 0; j < n; j++) {
            const uint64_t kj = (uint64_t)((b * L + j) * Ekv + hk * dh);
            double s = 0.0;
            float sf = 0.0f;
            for (int64_t d = 0; d < dh; d++) {
                const float qd = input_at(0, qi + (uint64_t)d);
                const float kd = input_at(1, kj + (uint64_t)d);
                s += (double)qd * kd;
                sf += qd * kd;
            }
            s *= scale;
            sf *= (float)scale;
            if (pass == 0) {   /* float64 online; the naive max */
                const double mn = s > m ? s : m, c = exp(m - mn),
                             p = exp(s - mn);
                l = l * c + p;
                for (int64_t d = 0; d < dh; d++)
                    ref[d] = ref[d] * c + p * input_at(2, kj + (uint64_t)d);
                m = mn;
                mf = sf > mf ? sf : mf;
            } else {           /* the naive sums */
                const float p = expf(sf - mf);
                lf += p;
                for (int64_t d = 0; d < dh; d++)
                    naive[d] += p * input_at(2, kj + (uint64_t)d);
            }
        }
    for (int64_t d = 0; d < dh; d++) {
        ref[d] /= l;
        naive[d] /= lf;
    }
}

/* The local row of global position i in shard s, or -1. */
static int64_t local_row(const mha_shard *s, int64_t i)
{
    for (int p = 0; p < s->n_pieces; p++)
        if (i >= s->offset[p] && i < s->offset[p] + s->length[p])
            return (p ? s->length[0] : 0) + i - s->offset[p];
    return -1;
}

enum { CHECK_MAX_DH = 1024 };

/* --check: the query rows i_k = round(k (L - 1) / (ROWS - 1)), k < ROWS,
 * that this rank holds, compared with check_row.  This rank's max errors
 * (mha, naive) and max |ref| in e[3]. */
static void check_rows(int64_t rows, const mha_shard *s, int64_t B,
                       int64_t L, int64_t H, int64_t Hkv, int64_t dh,
                       int causal, const float *out, double e[3])
{
    double ref[CHECK_MAX_DH];
    float naive[CHECK_MAX_DH];
    const int64_t E = H * dh, Ekv = Hkv * dh;
    e[0] = e[1] = e[2] = 0.0;
    for (int64_t k = 0; k < rows; k++) {
        const int64_t i = rows == 1 ? 0
                                    : (k * (L - 1) + (rows - 1) / 2) /
                                          (rows - 1);
        const int64_t x = local_row(s, i);
        if (x < 0 || (k > 0 && i == (((k - 1) * (L - 1) + (rows - 1) / 2) /
                                     (rows - 1))))
            continue;   /* another rank's, or the same row again */
        for (int64_t b = 0; b < B; b++)
            for (int64_t h = 0; h < H; h++) {
                check_row(b, i, h, L, causal ? i + 1 : L, dh, E, Ekv, H / Hkv,
                          ref, naive);
                const float *o = out + (b * s->len + x) * E + h * dh;
                for (int64_t d = 0; d < dh; d++) {
                    const double em = fabs(o[d] - ref[d]),
                                 en = fabs(naive[d] - ref[d]);
                    e[0] = em > e[0] ? em : e[0];
                    e[1] = en > e[1] ? en : e[1];
                    e[2] = fabs(ref[d]) > e[2] ? fabs(ref[d]) : e[2];
                }
            }
    }
}

int cmd_bench_ring(int argc, char **argv)
{
    tool_opt o[] = {{"ring", 0, 0}, {"ulysses", 0, 0}, {"split", 1, 0},
                    {"seq", 1, 0}, {"embed-dim", 1, 0}, {"heads", 1, 0},
                    {"kv-heads", 1, 0}, {"batch", 1, 0}, {"causal", 0, 0},
                    {"backward", 0, 0}, {"threads", 1, 0},
                    {"repeat", 1, 0}, {"warmup", 1, 0}, {"check", 1, 0}};
    int status = 0;
    mpi_start(&argc, &argv);
    int done = tool_options("bench", argc, argv, o, NOPTS(o),
                            g_rank == 0 ? BENCH_RING_HELP : "", &status);
    const int start = agree_on_start("bench", RING_BENCH, done, status);
    if (start >= 0) {
        MPI_Finalize();
        return start;
    }
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"seq", "embed-dim", "heads"};
    int64_t L = 0, E = 0, H = 0, Hkv = 0, B = 1, threads = 0, repeat = 5,
            warmup = 1, check = 0;
    if (!done)
        status = tool_require("bench", o, NOPTS(o), need, 3);
    if (!done && !status)
        status = tool_int("bench", "seq", OPT("seq"), 1, INT64_MAX / 2, &L) ||
                 tool_int("bench", "embed-dim", OPT("embed-dim"), 1, 1 << 20,
                          &E) ||
                 tool_int("bench", "heads", OPT("heads"), 1, E, &H) ||
                 (OPT("kv-heads") &&
                  tool_int("bench", "kv-heads", OPT("kv-heads"), 1, H, &Hkv)) ||
                 (OPT("batch") &&
                  tool_int("bench", "batch", OPT("batch"), 1, 1 << 20, &B)) ||
                 (OPT("threads") &&
                  tool_int("bench", "threads", OPT("threads"), 0, 4096,
                           &threads)) ||
                 (OPT("repeat") &&
                  tool_int("bench", "repeat", OPT("repeat"), 1, 1000,
                           &repeat)) ||
                 (OPT("warmup") &&
                  tool_int("bench", "warmup", OPT("warmup"), 0, 1000,
                           &warmup)) ||
                 (OPT("check") &&
                  tool_int("bench", "check", OPT("check"), 1, 1 << 20,
                           &check));
    if (!done && !status && E % H)
        status = tool_fail("bench", "--heads %lld must divide --embed-dim "
                           "%lld", (long long)H, (long long)E);
    if (!done && !status && Hkv && H % Hkv)
        status = tool_fail("bench", "--kv-heads %lld must divide --heads "
                           "%lld", (long long)Hkv, (long long)H);
    if (!done && !status && check && E / H > CHECK_MAX_DH)
        status = tool_fail("bench", "--check: head width %lld > %d",
                           (long long)(E / H), CHECK_MAX_DH);
    mha_seq_split split = MHA_SPLIT_CONTIGUOUS;
    const int causal = OPT("causal") != NULL;
    if (!done && !status)
        status = parse_split("bench", OPT("split"), causal, &split);
    if (!Hkv)
        Hkv = H;
    const int64_t dh = H ? E / H : 1, Ekv = Hkv * dh;
    mha_shard s;
    memset(&s, 0, sizeof s);
    if (!done && !status &&
        mha_shard_of(split, L, g_P, g_rank, &s) != MHA_OK)
        status = tool_fail("bench", "%s", mha_last_error());
    float *q = NULL, *k = NULL, *v = NULL, *out = NULL, *lse = NULL,
          *go = NULL, *dq = NULL, *dk = NULL, *dv = NULL, *buf[2] = {0, 0};
    const int uly = OPT("ulysses") != NULL, bwd = OPT("backward") != NULL;
    if (!done && !status) {
        /* what a caller holds: the shards of q, k, v, out and lse, and
         * for the backward dO, dq, dk and dv */
        const size_t nq = (size_t)(B * s.len * E + 1),
                     nk = (size_t)(B * s.len * Ekv + 1);
        q = malloc(nq * 4);
        k = malloc(nk * 4);
        v = malloc(nk * 4);
        out = malloc(nq * 4);
        lse = malloc((size_t)(B * H * s.len + 1) * 4);
        if (bwd) {
            go = malloc(nq * 4);
            dq = malloc(nq * 4);
            dk = malloc(nk * 4);
            dv = malloc(nk * 4);
        }
        if (!q || !k || !v || !out || !lse ||
            (bwd && (!go || !dq || !dk || !dv)))
            status = tool_fail("bench", "out of memory for the shards");
    }
    int rc = told_once(status);   /* (done is 0 here: agree_on_start) */
    if (!done && !rc) {
        fill_shard(q, 0, &s, B, L, E);
        fill_shard(k, 1, &s, B, L, Ekv);
        fill_shard(v, 2, &s, B, L, Ekv);
        if (bwd)
            fill_shard(go, 3, &s, B, L, E);
        mha_ring_args a = {0};
        a.comm = MPI_COMM_WORLD;
        a.split = split;
        a.seq_len = L;
        a.batch = B;
        a.num_heads = H;
        a.num_kv_heads = Hkv;
        a.head_dim = dh;
        a.q = q;
        a.k = k;
        a.v = v;
        a.causal = causal ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
        a.num_threads = (int)threads;
        a.out = out;
        a.lse = lse;
        const mha_ring_grads g = {go, dq, dk, dv};
        double *times = malloc((size_t)repeat * sizeof *times);
        mha_ring_stats st, sum = {0};
        mha_status err = times ? MHA_OK : MHA_ERR_OUT_OF_MEMORY;
        for (int64_t it = 0; err == MHA_OK && it < warmup + repeat; it++) {
            MPI_Barrier(MPI_COMM_WORLD);
            const double t0 = MPI_Wtime();
            a.stats = &st;
            err = uly ? mha_ulysses_attention(&a) : mha_ring_attention(&a);
            if (err == MHA_OK && bwd) {
                mha_ring_stats fs = st;
                err = uly ? mha_ulysses_attention_backward(&a, &g)
                          : mha_ring_attention_backward(&a, &g);
                st.bytes_sent += fs.bytes_sent;
                st.messages_sent += fs.messages_sent;
                st.seconds_waiting += fs.seconds_waiting;
                st.workspace_bytes = st.workspace_bytes > fs.workspace_bytes
                                         ? st.workspace_bytes
                                         : fs.workspace_bytes;
            }
            double t = MPI_Wtime() - t0, tmax;
            MPI_Allreduce(&t, &tmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it >= warmup) {
                times[it - warmup] = tmax;
                sum.seconds_waiting += st.seconds_waiting;
                sum.bytes_sent = st.bytes_sent;
                sum.messages_sent = st.messages_sent;
                sum.workspace_bytes = st.workspace_bytes;
            }
        }
        if (err != MHA_OK) {
            if (g_rank == 0)
                tool_fail("bench", "%s", mha_last_error());
            rc = 1;
        } else {
            qsort(times, (size_t)repeat, sizeof *times, cmp_double);
            const double med = times[repeat / 2];
            /* the peak of the timed calls, before the probes below */
            struct rusage ru;
            getrusage(RUSAGE_SELF, &ru);
            const size_t nb = (size_t)(2 * B * (L / g_P + 2) * Ekv + 1);
            buf[0] = calloc(nb, 4);
            buf[1] = calloc(nb, 4);
            double alone = 0.0;   /* 0: no memory left for the probe */
            const int probe = !any_failed(!buf[0] || !buf[1]);
            for (int r = 0; probe && r < 3; r++)
                alone += transfers_alone(split, L, B, Ekv, buf) / 3;
            /* with the backward: P - 1 K/V blocks again and P dK/dV
             * blocks of the same sizes */
            if (bwd && g_P > 1)
                alone *= (3.0 * g_P - 2) / (g_P - 1);
            const double wait = sum.seconds_waiting / (double)repeat;
            double hidden = alone > 0 ? 1.0 - wait / alone : 1.0;
            hidden = hidden < 0 ? 0 : hidden > 1 ? 1 : hidden;
            if (uly)
                hidden = 0.0;   /* all-to-alls: nothing overlaps */
            double e[3] = {0, 0, 0}, emax[3] = {0, 0, 0};
            if (check)
                check_rows(check, &s, B, L, H, Hkv, dh, causal, out, e);
            MPI_Reduce(e, emax, 3, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            double row[6] = {(double)sum.workspace_bytes, (double)ru.ru_maxrss,
                             (double)sum.bytes_sent, hidden, wait, alone};
            double mx[6], mn[6];
            MPI_Reduce(row, mx, 6, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
            MPI_Reduce(row, mn, 6, MPI_DOUBLE, MPI_MIN, 0, MPI_COMM_WORLD);
            if (g_rank == 0) {
                printf("%s %s, P=%d, B=%lld L=%lld E=%lld H=%lld H_kv=%lld "
                       "%ssplit=%s threads/rank=%lld\n",
                       uly ? "ulysses" : "ring", bwd ? "forward+backward"
                                                     : "forward",
                       g_P, (long long)B, (long long)L, (long long)E,
                       (long long)H, (long long)Hkv, causal ? "causal " : "",
                       split == MHA_SPLIT_ZIGZAG ? "zigzag" : "contiguous",
                       (long long)threads);
                printf("  time per call (median of %lld, slowest rank): "
                       "%.4f s\n", (long long)repeat, med);
                printf("  workspace per rank: %.1f .. %.1f MiB; peak "
                       "resident set: %.1f .. %.1f MiB\n",
                       mn[0] / 1048576.0, mx[0] / 1048576.0, mn[1] / 1024.0,
                       mx[1] / 1024.0);
                printf("  bytes sent per rank per call: %.0f .. %.0f\n",
                       mn[2], mx[2]);
                if (!uly)
                    printf("  the ring's transfers alone (no compute): %.4f "
                           ".. %.4f s\n", mn[5], mx[5]);
                printf("  blocked on communication: %.4f .. %.4f s per call; "
                       "share hidden: %.0f%% .. %.0f%%\n", mn[4], mx[4],
                       100 * mn[3], 100 * mx[3]);
            }
            if (check && g_rank == 0) {
                /* the suite's bound (tests/support/ref.c) */
                const double bound = 2.0 * emax[1] + 1e-6 * (1.0 + emax[2]);
                printf("  check of %lld rows x %lld batch x %lld heads vs "
                       "float64: max error %.3g (naive float32 %.3g, bound "
                       "%.3g, max |ref| %.3g): %s\n", (long long)check,
                       (long long)B, (long long)H, emax[0], emax[1], bound,
                       emax[2], emax[0] <= bound ? "ok" : "FAILED");
                if (emax[0] > bound)
                    rc = 1;
            }
        }
        free(times);
    }
#undef OPT
    free(q); free(k); free(v); free(out); free(lse); free(go);
    free(dq); free(dk); free(dv); free(buf[0]); free(buf[1]);
    MPI_Finalize();
    return rc;
}

#endif /* MHA_HAVE_MPI */
