/*
 * commands.c -- `mha forward`, `mha backward`, `mha init`, `mha info`: the
 * library driven from files (safetensors weights, .npy tensors).
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

/* "(2, 3, 8)" */
static void dims_str(int ndim, const int64_t *shape, char *buf, size_t n)
{
    size_t len = 0;
    buf[len++] = '(';
    buf[len] = 0;
    for (int k = 0; k < ndim && len < n; k++)
        len += (size_t)snprintf(buf + len, n - len, "%s%lld", k ? ", " : "",
                                (long long)shape[k]);
    if (len < n - 1)
        snprintf(buf + len, n - len, ")");
}

static void shape_str(const mha_tensor *t, char *buf, size_t n)
{
    dims_str(t->ndim, t->shape, buf, n);
}

/* ---- what mha forward, mha backward and mha viz share ------------------- */

/* RUN_USAGE_INPUTS, RUN_HELP_INPUTS, RUN_OPTS and run_setup: tool.h. */

void run_free(run_setup *r)
{
    mha_tensor_free(r->in.q);
    mha_tensor_free(r->in.k);
    mha_tensor_free(r->in.v);
    mha_tensor_free(r->in.mask);
    mha_tensor_free(r->in.kmask);
    mha_tensor_free(r->in.klen);
    free(r->head_mask);
    mha_free(r->m);
    memset(r, 0, sizeof *r);
}

/* Checks an input's rank and width, and returns its (B, L). */
static int input_dims(const char *cmd, const char *opt, const mha_tensor *t,
                      int64_t width, const char *wname, int64_t *B,
                      int64_t *L)
{
    char s[128];
    shape_str(t, s, sizeof s);
    if (!is_float(t))
        return tool_fail(cmd, "--%s must hold floats, got %s", opt,
                         mha_dtype_name(t->dtype));
    if (t->ndim != 2 && t->ndim != 3)
        return tool_fail(cmd, "--%s must be (B, L, %s) or (L, %s), got %s",
                         opt, wname, wname, s);
    if (t->shape[t->ndim - 1] != width)
        return tool_fail(cmd, "--%s has last dimension %lld, expected %s = "
                         "%lld (shape %s)", opt,
                         (long long)t->shape[t->ndim - 1], wname,
                         (long long)width, s);
    *B = t->ndim == 3 ? t->shape[0] : 1;
    *L = t->shape[t->ndim - 2];
    if (*B < 1 || *L < 1)
        return tool_fail(cmd, "--%s is empty: shape %s", opt, s);
    return 0;
}

/* Checks the option values of RUN_OPTS and loads the module. */
static int run_module(const char *cmd, const tool_opt *o, int n,
                      run_setup *r)
{
#define OPT(name) tool_get(o, n, name)
    static const char *const need[] = {"weights", "query"};
    if (tool_require(cmd, o, n, need, 2))
        return 1;
    if (OPT("value") && !OPT("key"))
        return tool_fail(cmd, "--value needs --key");
    if (OPT("causal") && OPT("causal-top-left"))
        return tool_fail(cmd, "--causal and --causal-top-left exclude each "
                         "other");
    if ((OPT("dropout") || OPT("seed")) && !OPT("train"))
        return tool_fail(cmd, "--dropout and --seed apply only with --train");

    mha_config base = {0};
    int64_t heads = 0, seed = 0, threads = 0;
    if (OPT("heads") &&
        tool_int(cmd, "heads", OPT("heads"), 1, INT32_MAX, &heads))
        return 1;
    if (OPT("scale")) {
        if (tool_float(cmd, "scale", OPT("scale"), &base.scale))
            return 1;
        if (base.scale == 0.0f)
            return tool_fail(cmd, "--scale must be nonzero");
    }
    if (OPT("dropout") &&
        tool_float(cmd, "dropout", OPT("dropout"), &base.dropout))
        return 1;
    if (!(base.dropout >= 0.0f && base.dropout <= 1.0f))
        return tool_fail(cmd, "--dropout must be in [0, 1], got %s",
                         OPT("dropout"));
    if (OPT("seed") && tool_int(cmd, "seed", OPT("seed"), 0, INT64_MAX, &seed))
        return 1;
    if (OPT("threads") &&
        tool_int(cmd, "threads", OPT("threads"), 1, 4096, &threads))
        return 1;
    base.add_zero_attn = OPT("add-zero-attn") != NULL;

    mha_tensor_file *file = NULL;
    mha_status st = mha_safetensors_load(OPT("weights"), &file);
    if (st != MHA_OK)
        return tool_fail(cmd, "--weights: %s", mha_last_error());
    st = mha_module_from_file(file, heads, &base, &r->m);
    mha_tensor_file_free(file);
    if (st != MHA_OK)
        return tool_fail(cmd, "--weights %s: %s", OPT("weights"),
                         mha_last_error());
    mha_get_config(r->m, &r->c);

    r->a.causal = OPT("causal") ? MHA_CAUSAL_BOTTOM_RIGHT
                : OPT("causal-top-left") ? MHA_CAUSAL_TOP_LEFT
                                         : MHA_CAUSAL_NONE;
    /* --dropout 0 means no dropout, whatever the file's config says (a
     * zero in `base` reads as "not given" to mha_module_from_file). */
    r->a.training = OPT("train") != NULL &&
                    !(OPT("dropout") && base.dropout == 0.0f);
    r->a.dropout_seed = (uint64_t)seed;
    r->a.num_threads = (int)threads;
    if (OPT("head-mask")) {
        if (tool_floats(cmd, "head-mask", OPT("head-mask"), r->c.num_heads,
                        &r->head_mask))
            return 1;
        r->a.head_mask = r->head_mask;
    }
    return 0;
#undef OPT
}

/* Loads the .npy inputs of RUN_OPTS and fills r->a from them. */
static int run_inputs(const char *cmd, const tool_opt *o, int n,
                      run_setup *r)
{
#define OPT(name) tool_get(o, n, name)
    static const char *const files[] = {"query", "key", "value", "attn-mask",
                                        "key-mask", "key-lengths"};
    fwd_inputs *in = &r->in;
    mha_tensor **slot[] = {&in->q, &in->k, &in->v, &in->mask, &in->kmask,
                           &in->klen};
    for (int k = 0; k < 6; k++)
        if (OPT(files[k]) && mha_npy_load(OPT(files[k]), slot[k]) != MHA_OK)
            return tool_fail(cmd, "--%s: %s", files[k], mha_last_error());
#undef OPT
    const mha_config *c = &r->c;
    int64_t B = 0, Lq = 0, Bk = 0, Lk = 0, Bv = 0, Lv = 0;
    if (input_dims(cmd, "query", in->q, c->embed_dim, "E", &B, &Lq) ||
        (in->k && input_dims(cmd, "key", in->k, c->kdim, "kdim", &Bk, &Lk)) ||
        (in->v && input_dims(cmd, "value", in->v, c->vdim, "vdim", &Bv, &Lv)))
        return 1;
    if (!in->k && c->kdim != c->embed_dim)
        return tool_fail(cmd, "the module has kdim %lld != E %lld: give --key",
                         (long long)c->kdim, (long long)c->embed_dim);
    if (!in->v && c->vdim != (in->k ? c->kdim : c->embed_dim))
        return tool_fail(cmd, "the module has vdim %lld: give --value",
                         (long long)c->vdim);
    if (in->k && (in->k->ndim != in->q->ndim || Bk != B))
        return tool_fail(cmd, "--key must have the query's batch (%lld) and "
                         "rank", (long long)B);
    if (in->v && (in->v->ndim != in->k->ndim || Bv != B || Lv != Lk))
        return tool_fail(cmd, "--value must have the key's batch and length "
                         "(%lld, %lld)", (long long)B, (long long)Lk);

    mha_forward_args *a = &r->a;
    a->batch = B;
    a->q_len = Lq;
    a->kv_len = in->k ? Lk : Lq;
    a->query = in->q->data;
    a->key = in->k ? in->k->data : NULL;
    a->value = in->v ? in->v->data : NULL;
    if (in->mask) {
        if (in->mask->dtype == MHA_DTYPE_BOOL)
            a->attn_mask.kind = MHA_MASK_ALLOW;
        else if (is_float(in->mask))
            a->attn_mask.kind = MHA_MASK_ADDITIVE;
        else
            return tool_fail(cmd, "--attn-mask must be bool (allow) or float "
                             "(additive), got %s",
                             mha_dtype_name(in->mask->dtype));
        a->attn_mask.data = in->mask->data;
        a->attn_mask.ndim = in->mask->ndim;
        for (int d = 0; d < in->mask->ndim && d < 4; d++)
            a->attn_mask.shape[d] = in->mask->shape[d];
    }
    if (in->kmask) {
        if (in->kmask->dtype != MHA_DTYPE_BOOL)
            return tool_fail(cmd, "--key-mask must be bool (true = real key), "
                             "got %s", mha_dtype_name(in->kmask->dtype));
        a->key_padding_mask = (mha_mask){MHA_MASK_ALLOW, in->kmask->data,
                                         in->kmask->ndim, {0}};
        for (int d = 0; d < in->kmask->ndim && d < 4; d++)
            a->key_padding_mask.shape[d] = in->kmask->shape[d];
    }
    if (in->klen) {
        if (in->klen->dtype != MHA_DTYPE_I32 &&
            in->klen->dtype != MHA_DTYPE_I64)
            return tool_fail(cmd, "--key-lengths must hold integers, got %s",
                             mha_dtype_name(in->klen->dtype));
        if (in->klen->numel != B || in->klen->ndim > 1)
            return tool_fail(cmd, "--key-lengths must be (B) = (%lld), got "
                             "%lld values", (long long)B,
                             (long long)in->klen->numel);
        a->key_lengths = in->klen->data;
    }
    return 0;
}

/* See tool.h. */
int run_setup_load(const char *cmd, const tool_opt *o, int n,
                   run_setup *r)
{
    memset(r, 0, sizeof *r);
    if (run_module(cmd, o, n, r) || run_inputs(cmd, o, n, r)) {
        run_free(r);
        return 1;
    }
    return 0;
}

/* A view of `data` with the shape of the input `like`'s leading dimensions
 * and last dimension `last` (an unbatched input gives an unbatched view). */
static mha_tensor_view view_like(const char *name, const mha_tensor *like,
                                 int64_t last, const float *data)
{
    mha_tensor_view v = {name, MHA_DTYPE_F32, like->ndim, {0}, data};
    for (int d = 0; d < like->ndim; d++)
        v.shape[d] = like->shape[d];
    v.shape[like->ndim - 1] = last;
    return v;
}

/* ---- mha forward ------------------------------------------------------- */

static const char FORWARD_HELP[] =
    "usage: mha forward " RUN_USAGE_INPUTS
    "         --out OUT.npy [--attn-weights A.npy [--per-head]]\n"
    "\n"
    "Runs nn.MultiheadAttention's forward pass with the weights of a PyTorch\n"
    "state_dict saved as safetensors.\n"
    RUN_HELP_INPUTS
    "  --out OUT.npy      (B, Lq, E) float32, or (Lq, E) for an unbatched query\n"
    "  --attn-weights A   (B, Lq, Lk') averaged over heads, or (B, H, Lq, Lk')\n"
    "                     with --per-head; Lk' counts bias_k / zero keys\n"
    "A query row with no key left gives out_proj.bias and zero weights\n"
    "(PyTorch gives NaN there). Outputs are written only on success.\n";

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
    tool_opt o[] = {RUN_OPTS, {"out", 1, 0}, {"attn-weights", 1, 0},
                    {"per-head", 0, 0}};
    int status;
    if (tool_options("forward", argc, argv, o, NOPTS(o), FORWARD_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"out"};
    if (tool_require("forward", o, NOPTS(o), need, 1))
        return 1;
    if (OPT("per-head") && !OPT("attn-weights"))
        return tool_fail("forward", "--per-head needs --attn-weights");
    if (OPT("attn-weights") && !strcmp(OPT("attn-weights"), OPT("out")))
        return tool_fail("forward", "--out and --attn-weights name the same "
                         "file");
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
    if (!rc && mha_forward(r.m, a) != MHA_OK)
        rc = tool_fail("forward", "%s", mha_last_error());
    if (!rc) {
        /* An unbatched query gives unbatched outputs, as in PyTorch. */
        const int batched = r.in.q->ndim == 3;
        const mha_tensor_view ov = view_like("", r.in.q, E, out);
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
    run_free(&r);
    return rc;
}

/* ---- mha backward ------------------------------------------------------ */

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
    "success (atomically).\n";

int cmd_backward(int argc, char **argv)
{
    tool_opt o[] = {RUN_OPTS, {"grad-output", 1, 0}, {"out", 1, 0}};
    int status;
    if (tool_options("backward", argc, argv, o, NOPTS(o), BACKWARD_HELP,
                     &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"grad-output", "out"};
    if (tool_require("backward", o, NOPTS(o), need, 2))
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
        const mha_tensor_view want = view_like("", q, E, NULL);
        int same = dy->ndim == want.ndim;
        for (int d = 0; same && d < want.ndim; d++)
            same = dy->shape[d] == want.shape[d];
        char got[160], exp[160];
        shape_str(dy, got, sizeof got);
        dims_str(want.ndim, want.shape, exp, sizeof exp);
        if (!is_float(dy))
            rc = tool_fail("backward", "--grad-output must hold floats, got "
                           "%s", mha_dtype_name(dy->dtype));
        else if (!same)
            rc = tool_fail("backward", "--grad-output %s has shape %s, "
                           "expected the forward output's shape %s",
                           OPT("grad-output"), got, exp);
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
        views[0] = view_like("query", q, E, b.grad_query);
        if (k)
            views[1] = view_like("key", k, c->kdim, b.grad_key);
        if (v)
            views[2] = view_like("value", v, c->vdim, b.grad_value);
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
        if (mha_safetensors_save(OPT("out"), views, nin + nparams + nhm, NULL,
                                 NULL, 0) != MHA_OK)
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
           (long long)c.head_dim, (long long)c.kdim,
           (long long)c.vdim, c.no_bias ? "false" : "true",
           c.add_bias_kv ? "true" : "false", c.add_zero_attn ? "true" : "false",
           (double)c.dropout, (double)c.scale);
    return 0;
}

/* ---- mha prune ---------------------------------------------------------- */

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
    if (tool_require("prune", o, NOPTS(o), need, 3))
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
