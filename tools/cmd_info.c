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
#include <string.h>

static int listed(const char *name, const char *const *names, int n)
{
    for (int k = 0; k < n; k++)
        if (!strcmp(name, names[k]))
            return 1;
    return 0;
}

/*
 * If f is a file of gradients as mha backward writes it (float32 tensors:
 * dL/d query, and key and value when given; dL/d each parameter under its
 * state_dict name; head_mask with --head-mask), prints what it holds and
 * returns 1; else returns 0.
 */
static int describe_gradients(const mha_tensor_file *f)
{
    static const char *const inputs[] = {"query", "key", "value"};
    static const char *const params[] = {
        "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
        "in_proj_bias", "bias_k", "bias_v", "out_proj.weight",
        "out_proj.bias"};
    const int n = mha_tensor_file_count(f);
    int nparams = 0, head_mask = 0;
    if (!mha_tensor_file_find(f, "query"))
        return 0;
    for (int k = 0; k < n; k++) {
        const mha_tensor *t = mha_tensor_file_at(f, k);
        if (t->dtype != MHA_DTYPE_F32)
            return 0;
        if (listed(t->name, params, NOPTS(params)))
            nparams++;
        else if (!strcmp(t->name, "head_mask"))
            head_mask = 1;
        else if (!listed(t->name, inputs, NOPTS(inputs)))
            return 0;
    }
    printf("gradients (mha backward): ");
    for (int k = 0, shown = 0; k < NOPTS(inputs); k++)
        if (mha_tensor_file_find(f, inputs[k]))
            printf("%s%s", shown++ ? ", " : "", inputs[k]);
    printf("; %d parameter%s%s\n", nparams, nparams == 1 ? "" : "s",
           head_mask ? "; head_mask" : "");
    return 1;
}

/* The score modifiers and RoPE of a resolved config, one line, or none
 * when no modifier is on. */
static void print_modifiers(const mha_config *c)
{
    const mha_modifiers *m = &c->mods;
    if (m->rope.style == MHA_ROPE_NONE && !m->alibi && !m->window &&
        !(m->softcap > 0.0f) && !c->sinks && !c->attention_chunk)
        return;
    printf("modifiers:");
    if (m->rope.style != MHA_ROPE_NONE)
        printf(" rope=%s rope_dims=%lld rope_theta=%g rope_scale=%g",
               m->rope.style == MHA_ROPE_GPTJ ? "gptj" : "neox",
               (long long)m->rope.dims, (double)m->rope.theta,
               (double)m->rope.scale);
    if (m->alibi) {
        printf(" alibi=%s", m->alibi_slopes ? "custom" : "default");
        if (m->alibi_slopes) {
            printf(" alibi_slopes=");
            for (int64_t h = 0; h < c->num_heads; h++)
                printf("%s%g", h ? "," : "", (double)m->alibi_slopes[h]);
        }
    }
    if (m->window)
        printf(" window=%lld,%lld", (long long)m->window_left,
               (long long)m->window_right);
    if (m->softcap > 0.0f)
        printf(" softcap=%g", (double)m->softcap);
    if (c->attention_chunk)
        printf(" attention_chunk=%lld", (long long)c->attention_chunk);
    if (c->sinks)
        printf(" sinks");
    printf("\n");
}

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
              "the module configuration inferred from them; for a file of\n"
              "gradients written by mha backward, which gradients it holds.\n",
              stdout);
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
    const char *keys[] = {"format", "embed_dim", "num_heads", "num_kv_heads",
                          "kdim", "vdim", "bias", "add_bias_kv",
                          "add_zero_attn", "dropout", "scale", "rope",
                          "rope_dims", "rope_theta", "rope_scale", "alibi",
                          "alibi_slopes", "window", "softcap",
                          "attention_chunk"};
    int shown = 0;
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
        const char *v = mha_tensor_file_metadata(f, keys[k]);
        if (v)
            printf("%s  %s = %s\n", shown++ ? "" : "metadata:\n", keys[k], v);
    }
    /* Gradients name their tensors as a state_dict does, plus the inputs:
     * not a module, but nothing wrong either. */
    if (describe_gradients(f)) {
        mha_tensor_file_free(f);
        return 0;
    }
    mha_module *m;
    mha_status st = mha_module_from_file(f, heads, NULL, &m);
    mha_tensor_file_free(f);
    if (st != MHA_OK)
        return tool_fail("info", "not a loadable nn.MultiheadAttention: %s",
                         mha_last_error());
    mha_config c;
    mha_get_config(m, &c);
    /* num_kv_heads as resolved: H when not grouped-query, and inferred
     * from k_proj_weight's rows when the metadata does not say it (the
     * loader refuses metadata that disagrees with the tensors). */
    printf("module: embed_dim=%lld num_heads=%lld num_kv_heads=%lld "
           "head_dim=%lld v_head_dim=%lld kdim=%lld vdim=%lld bias=%s "
           "add_bias_kv=%s add_zero_attn=%s dropout=%g scale=%g\n",
           (long long)c.embed_dim, (long long)c.num_heads,
           (long long)c.num_kv_heads, (long long)c.head_dim,
           (long long)c.v_head_dim, (long long)c.kdim,
           (long long)c.vdim, c.no_bias ? "false" : "true",
           c.add_bias_kv ? "true" : "false", c.add_zero_attn ? "true" : "false",
           (double)c.dropout, (double)c.scale);
    print_modifiers(&c);
    mha_free(m);   /* after: c.mods.alibi_slopes points into it */
    return 0;
}
