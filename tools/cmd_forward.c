/*
 * cmd_forward.c -- `mha forward`: nn.MultiheadAttention's forward pass on
 * a safetensors state_dict and .npy inputs, its outputs written as .npy.
 */
#define _XOPEN_SOURCE 700   /* link, realpath */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "run_setup.h"
#include "core/half.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

static const char FORWARD_HELP[] =
    "usage: mha forward " RUN_USAGE_INPUTS
    "         --out OUT.npy [--attn-weights A.npy [--per-head]]\n"
    "         [--dtype f32|bf16|f16]\n"
    "\n"
    "Runs nn.MultiheadAttention's forward pass with the weights of a PyTorch\n"
    "state_dict saved as safetensors.\n"
    RUN_HELP_INPUTS
    "  --out OUT.npy      (B, Lq, E) float32 ((Lq, B, E) with --seq-first), or\n"
    "                     (Lq, E) for an unbatched query; OUT.safetensors:\n"
    "                     the same as a tensor named \"out\"\n"
    "  --dtype bf16|f16   the module on 16-bit data, as a module moved to\n"
    "                     that dtype computes: the inputs (float32 files,\n"
    "                     or <f2 for f16, read exactly) and the weights\n"
    "                     rounded to it, out written in it (<f2 .npy for\n"
    "                     f16; bf16 only to .safetensors: NumPy has no\n"
    "                     bfloat16); no attention weights, dropout,\n"
    "                     head mask or RoPE (docs/semantics.md)\n"
    "  --attn-weights A   (B, Lq, Lk') averaged over heads, or (B, H, Lq, Lk')\n"
    "                     with --per-head; Lk' counts bias_k / zero keys\n"
    "A query row with no key left gives out_proj.bias and zero weights\n"
    "(PyTorch gives NaN there). Outputs are written only on success.\n"
    MOD_NOTE;

/* Copies the regular file `from` to a new file `to` with `mode`: 0 or -1
 * (`to` then removed). */
static int copy_file(const char *from, const char *to, mode_t mode)
{
    int in = open(from, O_RDONLY | O_CLOEXEC);
    int out = in < 0 ? -1
                     : open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    int ok = out >= 0 && fchmod(out, mode & 07777) == 0;
    char buf[1 << 16];
    ssize_t n;
    while (ok && (n = read(in, buf, sizeof buf)) != 0)
        ok = n > 0 && write(out, buf, (size_t)n) == n;
    if (out >= 0 && close(out) != 0)
        ok = 0;
    if (in >= 0)
        close(in);
    if (!ok && out >= 0)
        unlink(to);
    return ok ? 0 : -1;
}

/*
 * Writes both outputs or neither.  Each save alone is atomic (the library
 * renames a complete temporary file into place); for the pair, a file
 * already at out_path is copied aside while the weights are written, and
 * put back if they fail (a new out_path is removed).  (A file with several
 * hard links is rewritten in place by the library, and not copied aside.)
 */
static int write_outputs(const char *out_path, const mha_tensor_view *out,
                         const char *w_path, const mha_tensor_view *w)
{
    char *keep = NULL;       /* the old out_path's bytes, copied aside */
    struct stat st;
    const int existed = stat(out_path, &st) == 0;
    char *target = existed && w_path ? realpath(out_path, NULL) : NULL;
    if (target && S_ISREG(st.st_mode) && st.st_nlink == 1 &&
        (keep = malloc(strlen(target) + 32))) {
        snprintf(keep, strlen(target) + 32, "%s.keep.%ld", target,
                 (long)getpid());
        if (copy_file(target, keep, st.st_mode) != 0) {
            free(keep);
            keep = NULL;
        }
    }
    int rc = 0;
    const size_t len = strlen(out_path);
    const int sft = len > 12 && !strcmp(out_path + len - 12, ".safetensors");
    mha_tensor_view named = *out;
    named.name = "out";
    if (sft ? mha_safetensors_save(out_path, &named, 1, NULL, NULL, 0) != MHA_OK
           : mha_npy_save(out_path, out) != MHA_OK) {
        rc = tool_fail("forward", "--out: %s", mha_last_error());
    } else if (w_path && mha_npy_save(w_path, w) != MHA_OK) {
        rc = tool_fail("forward", "--attn-weights: %s", mha_last_error());
        if (keep && rename(keep, target) == 0) {
            free(keep);
            keep = NULL;                        /* out_path is as it was */
        } else if (!existed) {
            remove(out_path);
        }
    }
    if (keep)
        unlink(keep);
    free(keep);
    free(target);
    return rc;
}

/*
 * --dtype bf16 / f16: the loaded inputs (float32 in memory) rounded to
 * the type into one buffer -- query, key, value, then room for out --
 * and the forward's arguments pointed at them.  A float16 file's values
 * round to themselves.  0, or 1 after printing.
 */
static int to_half(run_setup *r, mha_dtype dt, uint16_t **buf)
{
    mha_forward_args *a = &r->a;
    const mha_tensor *t[3] = {r->in.q, r->in.k, r->in.v};
    const int64_t n_out = a->batch * a->q_len * r->c.embed_dim;
    int64_t total = n_out;
    for (int i = 0; i < 3; i++)
        total += t[i] ? t[i]->numel : 0;
    uint16_t *h = malloc((size_t)total * sizeof *h);
    if (!h)
        return tool_fail("forward", "out of memory for the 16-bit inputs");
    const uint16_t *in[3] = {NULL, NULL, NULL};
    uint16_t *p = h;
    for (int i = 0; i < 3; i++) {
        if (!t[i])
            continue;
        const float *x = t[i]->data;
        for (int64_t k = 0; k < t[i]->numel; k++)
            p[k] = dt == MHA_DTYPE_BF16 ? mha_bf16_from_float(x[k])
                                        : mha_f16_from_float(x[k]);
        in[i] = p;
        p += t[i]->numel;
    }
    a->dtype = dt;
    a->query16 = in[0];
    a->key16 = a->key ? in[1] : NULL;
    a->value16 = a->value ? in[2] : NULL;
    a->out16 = p;
    a->query = a->key = a->value = NULL;
    a->out = NULL;
    *buf = h;
    return 0;
}

int cmd_forward(int argc, char **argv)
{
    /* across the ranks of an MPI job: --ring, or --ulysses alone */
    for (int k = 1; k < argc; k++)
        if (!strcmp(argv[k], "--ring") || !strcmp(argv[k], "--ulysses"))
            return cmd_forward_ring(argc, argv);
    tool_opt o[] = {RUN_OPTS, {"out", 1, 0}, {"attn-weights", 1, 0},
                    {"per-head", 0, 0}, {"dtype", 1, 0}};
    int status;
    if (tool_options("forward", argc, argv, o, NOPTS(o), FORWARD_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"out"};
    if (tool_require("forward", o, NOPTS(o), need, 1))
        return 1;
    if (OPT("per-head") && !OPT("attn-weights"))
        return tool_fail("forward", "--per-head needs --attn-weights");
    const char *ds = OPT("dtype");
    const mha_dtype dt = !ds || !strcmp(ds, "f32") ? MHA_DTYPE_F32
                       : !strcmp(ds, "bf16")       ? MHA_DTYPE_BF16
                       : !strcmp(ds, "f16")        ? MHA_DTYPE_F16
                                                   : (mha_dtype)-1;
    if ((int)dt < 0)
        return tool_fail("forward", "--dtype must be f32, bf16 or f16, got "
                         "'%s'", ds);
    static const char *const outs[] = {"out", "attn-weights"};
    if (tool_outputs_apart("forward", o, NOPTS(o), outs, 2))
        return 1;
    run_setup r;
    if (run_setup_load("forward", o, NOPTS(o), &r))
        return 1;
    mha_forward_args *a = &r.a;
    const int64_t B = a->batch, Lq = a->q_len, E = r.c.embed_dim,
                  H = r.c.num_heads, Lt = mha_total_keys(r.m, a->kv_len);
    int rc = 0;
    /* Sizes were checked by the loaders; the library checks again. */
    float *out = malloc((size_t)(B * Lq * E) * sizeof *out), *w = NULL;
    if (OPT("attn-weights")) {
        a->need_weights = OPT("per-head") ? MHA_WEIGHTS_PER_HEAD
                                          : MHA_WEIGHTS_AVERAGE;
        w = malloc((size_t)(B * (OPT("per-head") ? H : 1) * Lq * Lt) *
                   sizeof *w);
    }
    if (!out || (OPT("attn-weights") && !w))
        rc = tool_fail("forward", "out of memory for the outputs");
    a->out = out;
    a->attn_weights = w;
    uint16_t *h16 = NULL;   /* --dtype: query, key, value, out rounded */
    if (!rc && dt != MHA_DTYPE_F32)
        rc = to_half(&r, dt, &h16);
    if (!rc && mha_forward(r.m, a) != MHA_OK)
        rc = tool_fail("forward", "%s", mha_last_error());
    if (!rc) {
        /* An unbatched query gives unbatched outputs, as in PyTorch. */
        const int batched = r.in.q->ndim == 3;
        mha_tensor_view ov = tool_view_like("", r.in.q, E, out);
        if (dt != MHA_DTYPE_F32) {   /* the 16-bit out, as bit patterns */
            ov.dtype = dt;
            ov.data = a->out16;
        }
        if (r.seq_first)        /* (B, Lq, E) -> the query's (Lq, B, E) */
            rc = tool_swap01_bytes("forward", (void *)ov.data,
                                   dt == MHA_DTYPE_F32 ? 4 : 2, ov.ndim,
                                   ov.shape);
        mha_tensor_view wv = {"", MHA_DTYPE_F32, 0, {0}, w};
        if (batched)
            wv.shape[wv.ndim++] = B;
        if (OPT("per-head"))
            wv.shape[wv.ndim++] = H;
        wv.shape[wv.ndim++] = Lq;
        wv.shape[wv.ndim++] = Lt;
        if (!rc)
            rc = write_outputs(OPT("out"), &ov, OPT("attn-weights"), &wv);
    }
#undef OPT
    free(out);
    free(w);
    free(h16);
    run_free(&r);
    return rc;
}
