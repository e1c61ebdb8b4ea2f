/*
 * cmd_prune.c -- `mha prune`: a module with only some of its heads
 * (mha_prune_heads).
 */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "mha_io.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

static const char PRUNE_HELP[] =
    "usage: mha prune --weights W.safetensors [--heads H] --keep 0,2,5\n"
    "                 --out W2.safetensors\n"
    "\n"
    "Writes the module with only the heads listed in --keep, in that order\n"
    "(mha_prune_heads): their rows of W_q, W_k, W_v (and of the biases,\n"
    "bias_k, bias_v), their columns of out_proj.weight; out_proj.bias\n"
    "unchanged.  Its output equals the original's under --head-mask with\n"
    "1 for the kept heads and 0 for the others, at n_keep / H of the\n"
    "projection and attention work.  Its heads are narrower than\n"
    "embed_dim / num_heads would say (out_proj.weight is [E, n_keep * d_h]),\n"
    "which libmha loads and PyTorch's nn.MultiheadAttention cannot.\n";

int cmd_prune(int argc, char **argv)
{
    tool_opt o[] = {{"weights", 1, 0}, {"heads", 1, 0}, {"keep", 1, 0},
                    {"out", 1, 0}};
    int status;
    if (tool_options("prune", argc, argv, o, NOPTS(o), PRUNE_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"weights", "keep", "out"};
    static const char *const outs[] = {"out"};
    if (tool_require("prune", o, NOPTS(o), need, 3) ||
        tool_outputs_apart("prune", o, NOPTS(o), outs, 1))
        return 1;
    int64_t heads = 0;
    if (OPT("heads") &&
        tool_int("prune", "heads", OPT("heads"), 1, INT32_MAX, &heads))
        return 1;
    mha_module *m = NULL, *p = NULL;
    if (mha_module_load(OPT("weights"), heads, &m) != MHA_OK)
        return tool_fail("prune", "--weights %s: %s", OPT("weights"),
                         mha_last_error());
    mha_config c;
    mha_get_config(m, &c);
    int64_t n_keep = 0, *keep = NULL;
    int rc = tool_ints("prune", "keep", OPT("keep"), 0, c.num_heads - 1,
                       &n_keep, &keep);
    if (!rc && mha_prune_heads(m, keep, n_keep, &p) != MHA_OK)
        rc = tool_fail("prune", "--keep %s: %s", OPT("keep"),
                       mha_last_error());
    if (!rc && mha_module_save(p, OPT("out")) != MHA_OK)
        rc = tool_fail("prune", "--out: %s", mha_last_error());
    if (!rc)
        printf("kept %lld of %lld heads (%s): heads' width %lld -> %lld, "
               "%lld -> %lld parameters\n", (long long)n_keep,
               (long long)c.num_heads, OPT("keep"),
               (long long)(c.num_heads * c.head_dim),
               (long long)(n_keep * c.head_dim),
               (long long)mha_param_numel(m), (long long)mha_param_numel(p));
#undef OPT
    free(keep);
    mha_free(p);
    mha_free(m);
    return rc;
}
