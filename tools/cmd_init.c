/*
 * cmd_init.c -- `mha init`: a freshly initialised module, saved as a
 * safetensors state_dict.
 */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "mha_io.h"
#include "run_setup.h"

#include <stdint.h>

static const char INIT_HELP[] =
    "usage: mha init --embed-dim E --heads H [--kv-heads Hkv] [--kdim K]\n"
    "                [--vdim V] [--v-head-dim Dv] [--no-bias] [--add-bias-kv]\n"
    "                [--add-zero-attn]\n"
    "                [--dropout P] [--scale S] [--sinks] --seed S\n"
    "                --out W.safetensors\n"
    MOD_USAGE MOD_WINDOW_USAGE "\n"
    "\n"
    "Writes a freshly initialised module (Xavier-uniform weights, zero biases)\n"
    "as a safetensors state_dict that PyTorch's nn.MultiheadAttention loads;\n"
    "the configuration is kept in __metadata__.\n"
    "  --kv-heads Hkv   grouped-query attention (Hkv = 1: multi-query): Hkv\n"
    "                   key/value heads, dividing H, each shared by H / Hkv\n"
    "                   query heads; k_proj_weight and v_proj_weight have\n"
    "                   Hkv * E / H rows and are kept apart from\n"
    "                   q_proj_weight, and num_kv_heads is written to\n"
    "                   __metadata__.  nn.MultiheadAttention cannot load\n"
    "                   such a module; mha forward, decode and info can.\n"
    "                   Default: Hkv = H (ordinary multi-head attention)\n"
    "  --v-head-dim Dv  values of their own head width (DeepSeek's MLA: 128\n"
    "                   beside keys of 192): v_proj_weight has Hkv * Dv rows,\n"
    "                   out_proj.weight H * Dv columns; the shapes say it, so\n"
    "                   mha forward, backward, decode and info read it back.\n"
    "                   nn.MultiheadAttention cannot load such a module.\n"
    "                   Default: E / H (the keys' width)\n"
    "  --sinks          a parameter `sinks` (H), gpt-oss's attention sinks:\n"
    "                   one logit per head in each softmax's denominator,\n"
    "                   written as 0 (nn.MultiheadAttention has no such\n"
    "                   tensor; mha forward, backward, decode and info\n"
    "                   read it)\n"
    MOD_HELP MOD_WINDOW_HELP
    "The modifiers are written to __metadata__ (rope, rope_dims, rope_theta,\n"
    "rope_scale, alibi, alibi_slopes, window, softcap); mha forward, decode\n"
    "and info read them back.\n";

int cmd_init(int argc, char **argv)
{
    tool_opt o[] = {{"embed-dim", 1, 0}, {"heads", 1, 0}, {"kdim", 1, 0},
                    {"vdim", 1, 0}, {"no-bias", 0, 0}, {"add-bias-kv", 0, 0},
                    {"add-zero-attn", 0, 0}, {"dropout", 1, 0},
                    {"scale", 1, 0}, {"seed", 1, 0}, {"out", 1, 0},
                    {"kv-heads", 1, 0}, {"sinks", 0, 0},
                    {"v-head-dim", 1, 0}, MOD_OPTS,
                    MOD_WINDOW_OPT};
    int status;
    if (tool_options("init", argc, argv, o, NOPTS(o), INIT_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"embed-dim", "heads", "seed", "out"};
    static const char *const outs[] = {"out"};
    if (tool_require("init", o, NOPTS(o), need, 4) ||
        tool_outputs_apart("init", o, NOPTS(o), outs, 1))
        return 1;
    mha_config c = {0};
    uint64_t seed;
    if (tool_int("init", "embed-dim", OPT("embed-dim"), 1, INT32_MAX,
                 &c.embed_dim) ||
        tool_int("init", "heads", OPT("heads"), 1, INT32_MAX, &c.num_heads) ||
        (OPT("kv-heads") && tool_int("init", "kv-heads", OPT("kv-heads"), 1,
                                     INT32_MAX, &c.num_kv_heads)) ||
        (OPT("kdim") &&
         tool_int("init", "kdim", OPT("kdim"), 1, INT32_MAX, &c.kdim)) ||
        (OPT("vdim") &&
         tool_int("init", "vdim", OPT("vdim"), 1, INT32_MAX, &c.vdim)) ||
        (OPT("v-head-dim") && tool_int("init", "v-head-dim", OPT("v-head-dim"),
                                       1, INT32_MAX, &c.v_head_dim)) ||
        (OPT("dropout") &&
         tool_float("init", "dropout", OPT("dropout"), &c.dropout)) ||
        (OPT("scale") && tool_scale("init", OPT("scale"), &c.scale)) ||
        tool_u64("init", "seed", OPT("seed"), &seed))
        return 1;
    /* The library refuses it too, but in its own terms ("0 = num_heads"),
     * which would mislead here: --kv-heads 0 is refused above. */
    if (c.num_kv_heads && c.num_heads % c.num_kv_heads)
        return tool_fail("init", "--kv-heads %lld must divide --heads %lld "
                         "(each K/V head serves the same number of query "
                         "heads)", (long long)c.num_kv_heads,
                         (long long)c.num_heads);
    c.seed = seed;
    c.no_bias = OPT("no-bias") != NULL;
    c.add_bias_kv = OPT("add-bias-kv") != NULL;
    c.add_zero_attn = OPT("add-zero-attn") != NULL;
    c.sinks = OPT("sinks") != NULL;
    tool_mods mods;
    if (tool_mods_parse("init", o, NOPTS(o), 1, &mods))
        return 1;
    if (tool_mods_heads("init", &mods, c.num_heads)) {
        tool_mods_free(&mods);
        return 1;
    }
    c.mods = mods.mods;
    c.attention_chunk = mods.chunk;
    mha_module *m;
    mha_status st = mha_create(&c, &m);   /* copies the slopes */
    tool_mods_free(&mods);
    if (st != MHA_OK)
        return tool_fail("init", "%s", mha_last_error());
    st = mha_module_save(m, OPT("out"));
    mha_free(m);
    if (st != MHA_OK)
        return tool_fail("init", "--out: %s", mha_last_error());
#undef OPT
    return 0;
}
