/*
 * cmd_init.c -- `mha init`: a freshly initialised module, saved as a
 * safetensors state_dict.
 */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "mha_io.h"

#include <stdint.h>

static const char INIT_HELP[] =
    "usage: mha init --embed-dim E --heads H [--kdim K] [--vdim V] [--no-bias]\n"
    "                [--add-bias-kv] [--add-zero-attn] [--dropout P]\n"
    "                [--scale S] --seed S --out W.safetensors\n"
    "\n"
    "Writes a freshly initialised module (Xavier-uniform weights, zero biases)\n"
    "as a safetensors state_dict that PyTorch's nn.MultiheadAttention loads;\n"
    "the configuration is kept in __metadata__.\n";

int cmd_init(int argc, char **argv)
{
    tool_opt o[] = {{"embed-dim", 1, 0}, {"heads", 1, 0}, {"kdim", 1, 0},
                    {"vdim", 1, 0}, {"no-bias", 0, 0}, {"add-bias-kv", 0, 0},
                    {"add-zero-attn", 0, 0}, {"dropout", 1, 0},
                    {"scale", 1, 0}, {"seed", 1, 0}, {"out", 1, 0}};
    int status;
    if (tool_options("init", argc, argv, o, NOPTS(o), INIT_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"embed-dim", "heads", "seed", "out"};
    if (tool_require("init", o, NOPTS(o), need, 4))
        return 1;
    mha_config c = {0};
    int64_t seed;
    if (tool_int("init", "embed-dim", OPT("embed-dim"), 1, INT32_MAX,
                 &c.embed_dim) ||
        tool_int("init", "heads", OPT("heads"), 1, INT32_MAX, &c.num_heads) ||
        (OPT("kdim") &&
         tool_int("init", "kdim", OPT("kdim"), 1, INT32_MAX, &c.kdim)) ||
        (OPT("vdim") &&
         tool_int("init", "vdim", OPT("vdim"), 1, INT32_MAX, &c.vdim)) ||
        (OPT("dropout") &&
         tool_float("init", "dropout", OPT("dropout"), &c.dropout)) ||
        (OPT("scale") && (tool_float("init", "scale", OPT("scale"), &c.scale) ||
                          (c.scale == 0.0f &&
                           tool_fail("init", "--scale must be nonzero")))) ||
        tool_int("init", "seed", OPT("seed"), 0, INT64_MAX, &seed))
        return 1;
    c.seed = (uint64_t)seed;
    c.no_bias = OPT("no-bias") != NULL;
    c.add_bias_kv = OPT("add-bias-kv") != NULL;
    c.add_zero_attn = OPT("add-zero-attn") != NULL;
    mha_module *m;
    mha_status st = mha_create(&c, &m);
    if (st != MHA_OK)
        return tool_fail("init", "%s", mha_last_error());
    st = mha_module_save(m, OPT("out"));
    mha_free(m);
    if (st != MHA_OK)
        return tool_fail("init", "--out: %s", mha_last_error());
#undef OPT
    return 0;
}
