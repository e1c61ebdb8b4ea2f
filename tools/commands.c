/*
 * commands.c -- `mha forward`, `mha init`, `mha info`: the library driven
 * from files (safetensors weights, .npy tensors).
 */
#define _POSIX_C_SOURCE 200809L
#include "args.h"
#include "tool.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NOPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

static int is_float(const mha_tensor *t)
{
    return t->dtype == MHA_DTYPE_F32 || t->dtype == MHA_DTYPE_F64 ||
           t->dtype == MHA_DTYPE_F16 || t->dtype == MHA_DTYPE_BF16;
}

static void shape_str(const mha_tensor *t, char *buf, size_t n)
{
    size_t len = 0;
    buf[len++] = '(';
    buf[len] = 0;
    for (int k = 0; k < t->ndim && len < n; k++)
        len += (size_t)snprintf(buf + len, n - len, "%s%lld", k ? ", " : "",
                                (long long)t->shape[k]);
    if (len < n - 1)
        snprintf(buf + len, n - len, ")");
}

/* Loads an .npy input; `kind` says what it must hold. */
static int load_npy(const char *cmd, const char *opt, const char *path,
                    mha_tensor **out)
{
    mha_status st = mha_npy_load(path, out);
    if (st != MHA_OK)
        return tool_fail(cmd, "--%s: %s", opt, mha_last_error());
    return 0;
}

/* ---- mha forward ------------------------------------------------------- */

static const char FORWARD_HELP[] =
    "usage: mha forward --weights W.safetensors [--heads H] --query Q.npy\n"
    "                   [--key K.npy [--value V.npy]] [--attn-mask M.npy]\n"
    "                   [--key-mask KM.npy] [--key-lengths KL.npy]\n"
    "                   [--causal | --causal-top-left] [--scale S]\n"
    "                   [--add-zero-attn] --out OUT.npy\n"
    "                   [--attn-weights A.npy [--per-head]]\n"
    "                   [--train --dropout P --seed S]\n"
    "\n"
    "Runs nn.MultiheadAttention's forward pass with the weights of a PyTorch\n"
    "state_dict saved as safetensors.\n"
    "  --heads H          number of heads (default: __metadata__ num_heads)\n"
    "  --query Q.npy      (B, Lq, E) or unbatched (Lq, E), float\n"
    "  --key, --value     (B, Lk, kdim), (B, Lk, vdim); default: the query\n"
    "                     (self-attention); --value defaults to --key\n"
    "  --attn-mask M.npy  bool: ALLOW mask, true = may attend (the seeds' and\n"
    "                     SDPA's convention; NOT nn.MultiheadAttention's);\n"
    "                     float: added to the scores (-inf blocks).\n"
    "                     Shape (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk)\n"
    "  --key-mask KM.npy  (B, Lk) or (Lk) bool, true = real key\n"
    "  --key-lengths KL   (B) integers: keys past each length are masked\n"
    "  --causal           query i sees keys j <= i + Lk - Lq (bottom right)\n"
    "  --causal-top-left  query i sees keys j <= i\n"
    "  --scale S          softmax scale (default 1/sqrt(E/H))\n"
    "  --add-zero-attn    the module was built with add_zero_attn=True\n"
    "  --out OUT.npy      (B, Lq, E) float32, or (Lq, E) for an unbatched query\n"
    "  --attn-weights A   (B, Lq, Lk') averaged over heads, or (B, H, Lq, Lk')\n"
    "                     with --per-head; Lk' counts bias_k / zero keys\n"
    "  --train            apply dropout P (default: the file's) keyed by --seed\n"
    "A query row with no key left gives out_proj.bias and zero weights\n"
    "(PyTorch gives NaN there). Outputs are written only on success.\n";

typedef struct fwd_inputs {
    mha_tensor *q, *k, *v, *mask, *kmask, *klen;
} fwd_inputs;

static void free_inputs(fwd_inputs *in)
{
    mha_tensor_free(in->q);
    mha_tensor_free(in->k);
    mha_tensor_free(in->v);
    mha_tensor_free(in->mask);
    mha_tensor_free(in->kmask);
    mha_tensor_free(in->klen);
}

/* Checks an input's rank and width, and returns its (B, L). */
static int input_dims(const char *opt, const mha_tensor *t, int64_t width,
                      const char *wname, int64_t *B, int64_t *L)
{
    char s[128];
    shape_str(t, s, sizeof s);
    if (!is_float(t))
        return tool_fail("forward", "--%s must hold floats, got %s", opt,
                         mha_dtype_name(t->dtype));
    if (t->ndim != 2 && t->ndim != 3)
        return tool_fail("forward", "--%s must be (B, L, %s) or (L, %s), got "
                         "%s", opt, wname, wname, s);
    if (t->shape[t->ndim - 1] != width)
        return tool_fail("forward", "--%s has last dimension %lld, expected "
                         "%s = %lld (shape %s)", opt,
                         (long long)t->shape[t->ndim - 1], wname,
                         (long long)width, s);
    *B = t->ndim == 3 ? t->shape[0] : 1;
    *L = t->shape[t->ndim - 2];
    if (*B < 1 || *L < 1)
        return tool_fail("forward", "--%s is empty: shape %s", opt, s);
    return 0;
}

/* Writes the outputs; if any write fails, removes what was written. */
static int write_outputs(const char *out_path, const mha_tensor_view *out,
                         const char *w_path, const mha_tensor_view *w)
{
    mha_status st = mha_npy_save(out_path, out);
    if (st != MHA_OK)
        return tool_fail("forward", "--out: %s", mha_last_error());
    if (w_path && (st = mha_npy_save(w_path, w)) != MHA_OK) {
        remove(out_path);
        return tool_fail("forward", "--attn-weights: %s", mha_last_error());
    }
    return 0;
}

int cmd_forward(int argc, char **argv)
{
    tool_opt o[] = {
        {"weights", 1, 0}, {"heads", 1, 0}, {"query", 1, 0}, {"key", 1, 0},
        {"value", 1, 0}, {"attn-mask", 1, 0}, {"key-mask", 1, 0},
        {"key-lengths", 1, 0}, {"causal", 0, 0}, {"causal-top-left", 0, 0},
        {"scale", 1, 0}, {"add-zero-attn", 0, 0}, {"out", 1, 0},
        {"attn-weights", 1, 0}, {"per-head", 0, 0}, {"train", 0, 0},
        {"dropout", 1, 0}, {"seed", 1, 0}};
    const char *pos[1];
    int npos, help;
    if (tool_parse("forward", argc, argv, o, NOPTS(o), pos, 0, &npos, &help))
        return 1;
    if (help) {
        fputs(FORWARD_HELP, stdout);
        return 0;
    }
#define OPT(name) tool_get(o, NOPTS(o), name)
    const char *need[] = {"weights", "query", "out"};
    for (int k = 0; k < 3; k++)
        if (!OPT(need[k]))
            return tool_fail("forward", "--%s is required (see mha forward "
                             "--help)", need[k]);
    if (OPT("value") && !OPT("key"))
        return tool_fail("forward", "--value needs --key");
    if (OPT("per-head") && !OPT("attn-weights"))
        return tool_fail("forward", "--per-head needs --attn-weights");
    if (OPT("causal") && OPT("causal-top-left"))
        return tool_fail("forward", "--causal and --causal-top-left exclude "
                         "each other");
    if ((OPT("dropout") || OPT("seed")) && !OPT("train"))
        return tool_fail("forward", "--dropout and --seed apply only with "
                         "--train");

    mha_config base = {0};
    int64_t heads = 0, seed = 0;
    if (OPT("heads") &&
        tool_int("forward", "heads", OPT("heads"), 1, INT32_MAX, &heads))
        return 1;
    if (OPT("scale")) {
        if (tool_float("forward", "scale", OPT("scale"), &base.scale))
            return 1;
        if (base.scale == 0.0f)
            return tool_fail("forward", "--scale must be nonzero");
    }
    if (OPT("dropout") &&
        tool_float("forward", "dropout", OPT("dropout"), &base.dropout))
        return 1;
    if (!(base.dropout >= 0.0f && base.dropout <= 1.0f))
        return tool_fail("forward", "--dropout must be in [0, 1], got %s",
                         OPT("dropout"));
    if (OPT("attn-weights") && !strcmp(OPT("attn-weights"), OPT("out")))
        return tool_fail("forward", "--out and --attn-weights name the same "
                         "file");
    if (OPT("seed") &&
        tool_int("forward", "seed", OPT("seed"), 0, INT64_MAX, &seed))
        return 1;
    base.add_zero_attn = OPT("add-zero-attn") != NULL;

    mha_tensor_file *file = NULL;
    mha_status st = mha_safetensors_load(OPT("weights"), &file);
    if (st != MHA_OK)
        return tool_fail("forward", "--weights: %s", mha_last_error());
    mha_module *m = NULL;
    st = mha_module_from_file(file, heads, &base, &m);
    mha_tensor_file_free(file);
    if (st != MHA_OK)
        return tool_fail("forward", "--weights %s: %s", OPT("weights"),
                         mha_last_error());
    mha_config c;
    mha_get_config(m, &c);

    fwd_inputs in = {0};
    int rc = load_npy("forward", "query", OPT("query"), &in.q);
    if (!rc && OPT("key"))
        rc = load_npy("forward", "key", OPT("key"), &in.k);
    if (!rc && OPT("value"))
        rc = load_npy("forward", "value", OPT("value"), &in.v);
    if (!rc && OPT("attn-mask"))
        rc = load_npy("forward", "attn-mask", OPT("attn-mask"), &in.mask);
    if (!rc && OPT("key-mask"))
        rc = load_npy("forward", "key-mask", OPT("key-mask"), &in.kmask);
    if (!rc && OPT("key-lengths"))
        rc = load_npy("forward", "key-lengths", OPT("key-lengths"), &in.klen);

    int64_t B = 0, Lq = 0, Bk = 0, Lk = 0, Bv = 0, Lv = 0;
    if (!rc)
        rc = input_dims("query", in.q, c.embed_dim, "E", &B, &Lq);
    const mha_tensor *kt = in.k ? in.k : in.q, *vt = in.v ? in.v : kt;
    if (!rc && in.k)
        rc = input_dims("key", in.k, c.kdim, "kdim", &Bk, &Lk);
    if (!rc && in.v)
        rc = input_dims("value", in.v, c.vdim, "vdim", &Bv, &Lv);
    if (!rc && !in.k && c.kdim != c.embed_dim)
        rc = tool_fail("forward", "the module has kdim %lld != E %lld: give "
                       "--key", (long long)c.kdim, (long long)c.embed_dim);
    if (!rc && !in.v && c.vdim != (in.k ? c.kdim : c.embed_dim))
        rc = tool_fail("forward", "the module has vdim %lld: give --value",
                       (long long)c.vdim);
    if (!rc && in.k && (kt->ndim != in.q->ndim || Bk != B))
        rc = tool_fail("forward", "--key must have the query's batch (%lld) "
                       "and rank", (long long)B);
    if (!rc && in.v && (vt->ndim != kt->ndim || Bv != B || Lv != Lk))
        rc = tool_fail("forward", "--value must have the key's batch and "
                       "length (%lld, %lld)", (long long)B, (long long)Lk);
    if (!in.k)
        Lk = Lq;

    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.query = in.q ? in.q->data : NULL;
    a.key = in.k ? in.k->data : NULL;
    a.value = in.v ? in.v->data : NULL;
    if (!rc && in.mask) {
        if (in.mask->dtype == MHA_DTYPE_BOOL)
            a.attn_mask.kind = MHA_MASK_ALLOW;
        else if (is_float(in.mask))
            a.attn_mask.kind = MHA_MASK_ADDITIVE;
        else
            rc = tool_fail("forward", "--attn-mask must be bool (allow) or "
                           "float (additive), got %s",
                           mha_dtype_name(in.mask->dtype));
        a.attn_mask.data = in.mask->data;
        a.attn_mask.ndim = in.mask->ndim;
        for (int d = 0; d < in.mask->ndim && d < 4; d++)
            a.attn_mask.shape[d] = in.mask->shape[d];
    }
    if (!rc && in.kmask) {
        if (in.kmask->dtype != MHA_DTYPE_BOOL)
            rc = tool_fail("forward", "--key-mask must be bool (true = real "
                           "key), got %s", mha_dtype_name(in.kmask->dtype));
        a.key_padding_mask = (mha_mask){MHA_MASK_ALLOW, in.kmask->data,
                                        in.kmask->ndim, {0}};
        for (int d = 0; d < in.kmask->ndim && d < 4; d++)
            a.key_padding_mask.shape[d] = in.kmask->shape[d];
    }
    if (!rc && in.klen) {
        if (in.klen->dtype != MHA_DTYPE_I32 && in.klen->dtype != MHA_DTYPE_I64)
            rc = tool_fail("forward", "--key-lengths must hold integers, got "
                           "%s", mha_dtype_name(in.klen->dtype));
        else if (in.klen->numel != B || in.klen->ndim > 1)
            rc = tool_fail("forward", "--key-lengths must be (B) = (%lld), "
                           "got %lld values", (long long)B,
                           (long long)in.klen->numel);
        a.key_lengths = in.klen->data;
    }
    a.causal = OPT("causal") ? MHA_CAUSAL_BOTTOM_RIGHT
             : OPT("causal-top-left") ? MHA_CAUSAL_TOP_LEFT : MHA_CAUSAL_NONE;
    /* --dropout 0 means no dropout, whatever the file's config says (a
     * zero in `base` reads as "not given" to mha_module_from_file). */
    a.training = OPT("train") != NULL &&
                 !(OPT("dropout") && base.dropout == 0.0f);
    a.dropout_seed = (uint64_t)seed;

    const int64_t Lt = mha_total_keys(m, Lk), H = c.num_heads;
    float *out = NULL, *w = NULL;
    if (!rc) {
        /* Sizes were checked by the loaders; the library checks again. */
        out = malloc((size_t)(B * Lq * c.embed_dim) * sizeof *out);
        if (OPT("attn-weights")) {
            a.need_weights = OPT("per-head") ? MHA_WEIGHTS_PER_HEAD
                                             : MHA_WEIGHTS_AVERAGE;
            w = malloc((size_t)(B * (OPT("per-head") ? H : 1) * Lq * Lt) *
                       sizeof *w);
        }
        if (!out || (OPT("attn-weights") && !w))
            rc = tool_fail("forward", "out of memory for the outputs");
    }
    a.out = out;
    a.attn_weights = w;
    if (!rc && (st = mha_forward(m, &a)) != MHA_OK)
        rc = tool_fail("forward", "%s", mha_last_error());
    if (!rc) {
        /* An unbatched query gives unbatched outputs, as in PyTorch. */
        const int batched = in.q->ndim == 3;
        mha_tensor_view ov = {"", MHA_DTYPE_F32, 0, {0}, out};
        if (batched)
            ov.shape[ov.ndim++] = B;
        ov.shape[ov.ndim++] = Lq;
        ov.shape[ov.ndim++] = c.embed_dim;
        mha_tensor_view wv = {"", MHA_DTYPE_F32, 0, {0}, w};
        if (batched)
            wv.shape[wv.ndim++] = B;
        if (OPT("per-head"))
            wv.shape[wv.ndim++] = H;
        wv.shape[wv.ndim++] = Lq;
        wv.shape[wv.ndim++] = Lt;
        rc = write_outputs(OPT("out"), &ov, OPT("attn-weights"), &wv);
    }
#undef OPT
    free(out);
    free(w);
    free_inputs(&in);
    mha_free(m);
    return rc;
}

/* ---- mha init ----------------------------------------------------------- */

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
    const char *pos[1];
    int npos, help;
    if (tool_parse("init", argc, argv, o, NOPTS(o), pos, 0, &npos, &help))
        return 1;
    if (help) {
        fputs(INIT_HELP, stdout);
        return 0;
    }
#define OPT(name) tool_get(o, NOPTS(o), name)
    const char *need[] = {"embed-dim", "heads", "seed", "out"};
    for (int k = 0; k < 4; k++)
        if (!OPT(need[k]))
            return tool_fail("init", "--%s is required (see mha init --help)",
                             need[k]);
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

/* ---- mha info ----------------------------------------------------------- */

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
        shape_str(t, s, sizeof s);
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
           (long long)(c.embed_dim / c.num_heads), (long long)c.kdim,
           (long long)c.vdim, c.no_bias ? "false" : "true",
           c.add_bias_kv ? "true" : "false", c.add_zero_attn ? "true" : "false",
           (double)c.dropout, (double)c.scale);
    return 0;
}
