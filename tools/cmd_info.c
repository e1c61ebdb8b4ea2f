/*
 * cmd_info.c -- `mha info`: the tensors and metadata of a safetensors
 * file, and the module in it.
 */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "run_setup.h"

#include <stdint.h>
#include <stdio.h>

int cmd_info(int argc, char **argv)
{
    tool_opt o[] = {{"heads", 1, 0}};
    const char *pos[2];
    int npos, help;
    if (tool_parse("info", argc, argv, o, NOPTS(o), pos, 1, &npos, &help))
        return 1;
    if (help) {
        fputs("usage: mha info [--heads H] W.safetensors\n\n"
              "Prints every tensor's name, dtype and shape, the metadata, and\n"
              "the module configuration inferred from them.\n", stdout);
        return 0;
    }
    if (npos != 1)
        return tool_fail("info", "expected one safetensors file");
    int64_t heads = 0;
    const char *h = tool_get(o, NOPTS(o), "heads");
    if (h && tool_int("info", "heads", h, 1, INT32_MAX, &heads))
        return 1;
    mha_tensor_file *f;
    if (mha_safetensors_load(pos[0], &f) != MHA_OK)
        return tool_fail("info", "%s", mha_last_error());
    printf("%s: %d tensors\n", pos[0], mha_tensor_file_count(f));
    for (int k = 0; k < mha_tensor_file_count(f); k++) {
        const mha_tensor *t = mha_tensor_file_at(f, k);
        char s[160];
        tool_shape_str(t, s, sizeof s);
        printf("  %-16s %-5s %s\n", t->name, mha_dtype_name(t->dtype), s);
    }
    const char *keys[] = {"format", "embed_dim", "num_heads", "kdim", "vdim",
                          "bias", "add_bias_kv", "add_zero_attn", "dropout",
                          "scale"};
    int shown = 0;
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
        const char *v = mha_tensor_file_metadata(f, keys[k]);
        if (v)
            printf("%s  %s = %s\n", shown++ ? "" : "metadata:\n", keys[k], v);
    }
    mha_module *m;
    mha_status st = mha_module_from_file(f, heads, NULL, &m);
    mha_tensor_file_free(f);
    if (st != MHA_OK)
        return tool_fail("info", "not a loadable nn.MultiheadAttention: %s",
                         mha_last_error());
    mha_config c;
    mha_get_config(m, &c);
    mha_free(m);
    printf("module: embed_dim=%lld num_heads=%lld head_dim=%lld kdim=%lld "
           "vdim=%lld bias=%s add_bias_kv=%s add_zero_attn=%s dropout=%g "
           "scale=%g\n", (long long)c.embed_dim, (long long)c.num_heads,
           (long long)c.head_dim, (long long)c.kdim,
           (long long)c.vdim, c.no_bias ? "false" : "true",
           c.add_bias_kv ? "true" : "false", c.add_zero_attn ? "true" : "false",
           (double)c.dropout, (double)c.scale);
    return 0;
}
