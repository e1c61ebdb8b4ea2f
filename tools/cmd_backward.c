/*
 * cmd_backward.c -- `mha backward`: the gradients of mha forward's pass,
 * given dL/d output, into one safetensors file.
 */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "run_setup.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static const char BACKWARD_HELP[] =
    "usage: mha backward " RUN_USAGE_INPUTS
    "         --grad-output DY.npy --out GRADS.safetensors\n"
    "\n"
    "The gradients of nn.MultiheadAttention's forward pass (the inputs and\n"
    "options are those of mha forward) given dL/d output, by mha_backward.\n"
    RUN_HELP_INPUTS
    "  --grad-output DY   dL/d output, float, the shape of the forward's\n"
    "                     output: (B, Lq, E), or (Lq, E) for an unbatched\n"
    "                     query\n"
    "  --out GRADS        a safetensors file of float32 tensors:\n"
    "                       query         dL/d query, the query's shape\n"
    "                       key, value    dL/d key, dL/d value (when given)\n"
    "                       in_proj_weight, ..., out_proj.bias\n"
    "                                     dL/d each parameter, named and\n"
    "                                     shaped as in the state_dict\n"
    "                       head_mask     dL/d head mask (H), with\n"
    "                                     --head-mask (use all ones for\n"
    "                                     the heads' importance scores)\n"
    "One tensor serving several roles gets the sum of their gradients:\n"
    "without --key, `query` is dL/d query + dL/d key + dL/d value; with\n"
    "--key but no --value, `key` is dL/d key + dL/d value.  Dropout\n"
    "(--train) is regenerated from --seed: the same mask as mha forward\n"
    "--train with the same seed.  The attention weights are not\n"
    "differentiated; a float --attn-mask is a constant.  A query row with\n"
    "no key left contributes zero gradients.  The file is written only on\n"
    "success (atomically).\n"
    MOD_NOTE;

int cmd_backward(int argc, char **argv)
{
    /* across the ranks of an MPI job: --ring, or --ulysses alone */
    for (int k = 1; k < argc; k++)
        if (!strcmp(argv[k], "--ring") || !strcmp(argv[k], "--ulysses"))
            return cmd_backward_ring(argc, argv);
    tool_opt o[] = {RUN_OPTS, {"grad-output", 1, 0}, {"out", 1, 0}};
    int status;
    if (tool_options("backward", argc, argv, o, NOPTS(o), BACKWARD_HELP,
                     &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"grad-output", "out"};
    static const char *const outs[] = {"out"};
    if (tool_require("backward", o, NOPTS(o), need, 2) ||
        tool_outputs_apart("backward", o, NOPTS(o), outs, 1))
        return 1;
    run_setup r;
    if (run_setup_load("backward", o, NOPTS(o), &r))
        return 1;
    const mha_config *c = &r.c;
    mha_forward_args *a = &r.a;
    const mha_tensor *q = r.in.q, *k = r.in.k, *v = r.in.v;
    const int64_t E = c->embed_dim, nq = q->numel, nk = k ? k->numel : 0,
                  nv = v ? v->numel : 0, np = mha_param_numel(r.m);

    mha_tensor *dy = NULL;
    int rc = 0;
    if (mha_npy_load(OPT("grad-output"), &dy) != MHA_OK)
        rc = tool_fail("backward", "--grad-output: %s", mha_last_error());
    if (!rc) {
        /* The forward's output has the query's shape, last dimension E. */
        mha_tensor_view want = tool_view_like("", q, E, NULL);
        if (r.seq_first && want.ndim == 3) {    /* the file's (L, B, E) */
            want.shape[0] = q->shape[1];
            want.shape[1] = q->shape[0];
        }
        int same = dy->ndim == want.ndim;
        for (int d = 0; same && d < want.ndim; d++)
            same = dy->shape[d] == want.shape[d];
        char got[160], exp[160];
        tool_shape_str(dy, got, sizeof got);
        tool_dims_str(want.ndim, want.shape, exp, sizeof exp);
        if (!tool_is_float(dy))
            rc = tool_fail("backward", "--grad-output must hold floats, got "
                           "%s", tool_dtype_of(dy));
        else if (!same)
            rc = tool_fail("backward", "--grad-output %s has shape %s, "
                           "expected the forward output's shape %s%s",
                           OPT("grad-output"), got, exp,
                           r.seq_first ? " (--seq-first)" : "");
        else if (r.seq_first)
            rc = tool_swap01("backward", dy->data, dy->ndim, dy->shape);
    }

    /* One buffer: dq, dk, dv, then the parameters' gradients.  A NULL key
     * (value) makes the query (key) receive the sum of the gradients of
     * the inputs it serves as. */
    float *g = NULL, *ghm = NULL;
    if (!rc && (!(g = malloc((size_t)(nq + nk + nv + np) * sizeof *g)) ||
                (a->head_mask &&
                 !(ghm = malloc((size_t)c->num_heads * sizeof *ghm)))))
        rc = tool_fail("backward", "out of memory for the gradients");
    mha_backward_args b = {0};
    if (!rc) {
        b.grad_out = dy->data;
        b.grad_query = g;
        b.grad_key = k ? g + nq : NULL;
        b.grad_value = v ? g + nq + nk : NULL;
        b.grad_params = g + nq + nk + nv;
        b.grad_head_mask = ghm;   /* with --head-mask */
        if (mha_backward(r.m, a, &b) != MHA_OK)
            rc = tool_fail("backward", "%s", mha_last_error());
    }
    const int nparams = mha_param_count(r.m), nin = 1 + !!k + !!v;
    const int nhm = ghm != NULL;
    mha_tensor_view *views = NULL;
    if (!rc && !(views = calloc((size_t)(nin + nparams + nhm), sizeof *views)))
        rc = tool_fail("backward", "out of memory for the gradients");
    if (!rc) {
        views[0] = tool_view_like("query", q, E, b.grad_query);
        if (k)
            views[1] = tool_view_like("key", k, c->kdim, b.grad_key);
        if (v)
            views[2] = tool_view_like("value", v, c->vdim, b.grad_value);
        /* --seq-first: the inputs' gradients in the inputs' (L, B, .) */
        float *const gin[3] = {b.grad_query, b.grad_key, b.grad_value};
        for (int t = 0; r.seq_first && t < nin && !rc; t++)
            rc = tool_swap01("backward", gin[t], views[t].ndim,
                             views[t].shape);
        for (int p = 0; p < nparams; p++) {
            mha_param_info info;
            mha_param_info_at(r.m, p, &info);
            mha_tensor_view *pv = &views[nin + p];
            *pv = (mha_tensor_view){info.name, MHA_DTYPE_F32, info.ndim, {0},
                                    b.grad_params + info.offset};
            for (int d = 0; d < info.ndim; d++)
                pv->shape[d] = info.shape[d];
        }
        if (ghm)
            views[nin + nparams] = (mha_tensor_view){
                "head_mask", MHA_DTYPE_F32, 1, {c->num_heads}, ghm};
        if (!rc && mha_safetensors_save(OPT("out"), views,
                                        nin + nparams + nhm, NULL, NULL,
                                        0) != MHA_OK)
            rc = tool_fail("backward", "--out: %s", mha_last_error());
    }
#undef OPT
    free(views);
    free(g);
    free(ghm);
    mha_tensor_free(dy);
    run_free(&r);
    return rc;
}
