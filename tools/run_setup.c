/*
 * run_setup.c -- what mha forward, mha backward and mha viz share: the
 * module from --weights, the .npy inputs, the forward's arguments
 * (run_setup.h); and a few helpers on loaded tensors.
 */
#include "run_setup.h"

#include "fail.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int tool_is_float(const mha_tensor *t)
{
    return t->dtype == MHA_DTYPE_F32 || t->dtype == MHA_DTYPE_F64 ||
           t->dtype == MHA_DTYPE_F16 || t->dtype == MHA_DTYPE_BF16;
}

void tool_dims_str(int ndim, const int64_t *shape, char *buf, size_t n)
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

void tool_shape_str(const mha_tensor *t, char *buf, size_t n)
{
    tool_dims_str(t->ndim, t->shape, buf, n);
}

/* ---- the score modifiers ------------------------------------------------- */

/* --NAME s as a float32 that must be > lo: a value above lo that rounds
 * to lo or below in float32 (1e-46 to 0, 1.00000001 to 1) says so. */
static int float_above(const char *cmd, const char *name, const char *s,
                       float lo, float *out)
{
    if (tool_float(cmd, name, s, out))
        return 1;
    if (*out > lo)
        return 0;
    if (strtod(s, NULL) > (double)lo)
        return tool_fail(cmd, "--%s %s rounds to %g in float32, and must be "
                         "> %g", name, s, (double)*out, (double)lo);
    return tool_fail(cmd, "--%s must be > %g, got '%s'", name, (double)lo, s);
}

int tool_mods_parse(const char *cmd, const tool_opt *o, int n, int window,
                    tool_mods *t)
{
#define OPT(name) tool_get(o, n, name)
    memset(t, 0, sizeof *t);
    mha_modifiers *m = &t->mods;
    static const char *const rope_opts[] = {"rope-theta", "rope-dim",
                                            "rope-scale"};
    for (int k = 0; k < 3; k++)
        if (OPT(rope_opts[k]) && !OPT("rope"))
            return tool_fail(cmd, "--%s needs --rope neox|gptj",
                             rope_opts[k]);
    if (OPT("rope")) {
        if (!strcmp(OPT("rope"), "neox"))
            m->rope.style = MHA_ROPE_NEOX;
        else if (!strcmp(OPT("rope"), "gptj"))
            m->rope.style = MHA_ROPE_GPTJ;
        else
            return tool_fail(cmd, "--rope must be neox or gptj, got '%s'",
                             OPT("rope"));
    }
    if (OPT("rope-theta") &&
        float_above(cmd, "rope-theta", OPT("rope-theta"), 1.0f,
                    &m->rope.theta))
        return 1;
    if (OPT("rope-dim") &&
        (tool_int(cmd, "rope-dim", OPT("rope-dim"), 2, INT32_MAX,
                  &m->rope.dims) ||
         (m->rope.dims % 2 &&
          tool_fail(cmd, "--rope-dim must be even (dims rotate in pairs), "
                    "got '%s'", OPT("rope-dim")))))
        return 1;
    if (OPT("rope-scale") &&
        float_above(cmd, "rope-scale", OPT("rope-scale"), 0.0f,
                    &m->rope.scale))
        return 1;
    if (OPT("softcap") &&
        float_above(cmd, "softcap", OPT("softcap"), 0.0f, &m->softcap))
        return 1;
    if (OPT("attention-chunk") &&
        tool_int(cmd, "attention-chunk", OPT("attention-chunk"), 1,
                 INT64_MAX, &t->chunk))
        return 1;
    if (window && OPT("window")) {
        int64_t count = 0, *lr = NULL;
        if (tool_ints(cmd, "window", OPT("window"), -1, INT64_MAX, &count,
                      &lr))
            return 1;
        if (count != 2) {
            free(lr);
            return tool_fail(cmd, "--window must be LEFT,RIGHT (two integers "
                             ">= -1, -1: no bound), got '%s'", OPT("window"));
        }
        m->window = 1;
        m->window_left = lr[0];
        m->window_right = lr[1];
        free(lr);
    }
    m->alibi = OPT("alibi") || OPT("alibi-slopes");
    if (OPT("alibi-slopes")) {
        if (mha_npy_load(OPT("alibi-slopes"), &t->slopes) != MHA_OK)
            return tool_fail(cmd, "--alibi-slopes: %s", mha_last_error());
        if (t->slopes->ndim != 1 || t->slopes->dtype != MHA_DTYPE_F32) {
            char s[64];
            tool_shape_str(t->slopes, s, sizeof s);
            const int rc = tool_fail(cmd, "--alibi-slopes must be a 1-D "
                                     "float32 array of H values, got %s %s",
                                     tool_dtype_of(t->slopes), s);
            tool_mods_free(t);
            return rc;
        }
        m->alibi_slopes = t->slopes->data;
    }
    return 0;
#undef OPT
}

int tool_mods_heads(const char *cmd, const tool_mods *t, int64_t H)
{
    if (t->slopes && t->slopes->numel != H)
        return tool_fail(cmd, "--alibi-slopes has %lld values, expected one "
                         "per head, H = %lld", (long long)t->slopes->numel,
                         (long long)H);
    return 0;
}

void tool_mods_free(tool_mods *t)
{
    mha_tensor_free(t->slopes);
    memset(t, 0, sizeof *t);
}

/* ---- the module and its inputs ------------------------------------------ */

void run_free(run_setup *r)
{
    mha_tensor_free(r->in.q);
    mha_tensor_free(r->in.k);
    mha_tensor_free(r->in.v);
    mha_tensor_free(r->in.mask);
    mha_tensor_free(r->in.kmask);
    mha_tensor_free(r->in.klen);
    free(r->head_mask);
    tool_mods_free(&r->mods);
    mha_free(r->m);
    memset(r, 0, sizeof *r);
}

const char *tool_dtype_of(const mha_tensor *t)
{
    /* .npy's uint8 loads as a bool mask (nonzero = true): say so, or a
     * uint8 file would be called BOOL */
    return t->dtype == MHA_DTYPE_BOOL ? "BOOL (a bool or uint8 file)"
                                      : mha_dtype_name(t->dtype);
}

int tool_swap01(const char *cmd, float *data, int ndim, int64_t *shape)
{
    return tool_swap01_bytes(cmd, data, sizeof *data, ndim, shape);
}

int tool_swap01_bytes(const char *cmd, void *data, size_t elem, int ndim,
                      int64_t *shape)
{
    if (ndim != 3)
        return 0;
    const int64_t A = shape[0], B = shape[1], w = shape[2];
    const size_t row = (size_t)w * elem, n = (size_t)(A * B) * row;
    char *copy = malloc(n + 1), *d = data;
    if (!copy)
        return tool_fail(cmd, "out of memory for --seq-first's transpose");
    memcpy(copy, data, n);
    for (int64_t a = 0; a < A; a++)
        for (int64_t b = 0; b < B; b++)
            memcpy(d + (size_t)(b * A + a) * row,
                   copy + (size_t)(a * B + b) * row, row);
    free(copy);
    shape[0] = B;
    shape[1] = A;
    return 0;
}

/* Checks an input's rank and width, and returns its (B, L): the file's
 * shape, read in the layout --seq-first says (and every message says
 * which one was assumed). */
static int input_dims(const char *cmd, const char *opt, const mha_tensor *t,
                      int64_t width, const char *wname, int seq_first,
                      int64_t *B, int64_t *L)
{
    char s[128];
    tool_shape_str(t, s, sizeof s);
    const char *as = seq_first ? "(L, B, w) with --seq-first"
                               : "(B, L, w); --seq-first reads (L, B, w)";
    if (!tool_is_float(t))
        return tool_fail(cmd, "--%s must hold floats, got %s", opt,
                         tool_dtype_of(t));
    if (t->ndim != 2 && t->ndim != 3)
        return tool_fail(cmd, "--%s must be %s, %s) or (L, %s), got %s",
                         opt, seq_first ? "(L, B" : "(B, L", wname, wname, s);
    if (t->shape[t->ndim - 1] != width)
        return tool_fail(cmd, "--%s has last dimension %lld, expected %s = "
                         "%lld (shape %s, read as %s)", opt,
                         (long long)t->shape[t->ndim - 1], wname,
                         (long long)width, s, as);
    *B = t->ndim == 3 ? t->shape[seq_first ? 1 : 0] : 1;
    *L = t->shape[t->ndim == 3 && !seq_first ? 1 : 0];
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
    int64_t heads = 0, threads = 0;
    uint64_t seed = 0;
    if (OPT("heads") &&
        tool_int(cmd, "heads", OPT("heads"), 1, INT32_MAX, &heads))
        return 1;
    if (OPT("scale") && tool_scale(cmd, OPT("scale"), &base.scale))
        return 1;
    if (OPT("dropout") &&
        tool_float(cmd, "dropout", OPT("dropout"), &base.dropout))
        return 1;
    if (!(base.dropout >= 0.0f && base.dropout <= 1.0f))
        return tool_fail(cmd, "--dropout must be in [0, 1], got %s",
                         OPT("dropout"));
    if (OPT("seed") && tool_u64(cmd, "seed", OPT("seed"), &seed))
        return 1;
    if (OPT("threads") &&
        tool_int(cmd, "threads", OPT("threads"), 1, 4096, &threads))
        return 1;
    base.add_zero_attn = OPT("add-zero-attn") != NULL;
    /* mha decode's --window is its sliding-window cache, not the
     * modifier's LEFT,RIGHT. */
    if (tool_mods_parse(cmd, o, n, strcmp(cmd, "decode") != 0, &r->mods))
        return 1;
    base.mods = r->mods.mods;
    base.attention_chunk = r->mods.chunk;
    /* ... and it replaces the file's window modifier: the window (-1, -1),
     * unbounded on both sides, is no window, and the cache's ring is
     * then the only one (with --window -1,-1 there is none). */
    if (!strcmp(cmd, "decode") && OPT("window")) {
        base.mods.window = 1;
        base.mods.window_left = -1;
        base.mods.window_right = -1;
    }

    mha_tensor_file *file = NULL;
    mha_status st = mha_safetensors_load(OPT("weights"), &file);
    if (st != MHA_OK)
        return tool_fail(cmd, "--weights: %s", mha_last_error());
    /* The slopes' count against H: --heads, else the file's num_heads
     * (without either the load below says what is missing). */
    const char *meta_h = mha_tensor_file_metadata(file, "num_heads");
    int64_t H = heads;
    if (!H && meta_h)
        H = strtoll(meta_h, NULL, 10);
    if (H > 0 && tool_mods_heads(cmd, &r->mods, H)) {
        mha_tensor_file_free(file);
        return 1;
    }
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
    r->a.dropout_seed = seed;
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
    /* --block-mask is --attn-mask's slot in PyTorch MHA's polarity. */
    const int block = OPT("block-mask") != NULL;
    if (block && OPT("attn-mask"))
        return tool_fail(cmd, "give --attn-mask (true = may attend) or "
                         "--block-mask (true = blocked), not both");
    const char *const files[] = {"query", "key", "value",
                                 block ? "block-mask" : "attn-mask",
                                 "key-mask", "key-lengths"};
    fwd_inputs *in = &r->in;
    mha_tensor **slot[] = {&in->q, &in->k, &in->v, &in->mask, &in->kmask,
                           &in->klen};
    for (int k = 0; k < 6; k++)
        if (OPT(files[k]) && mha_npy_load(OPT(files[k]), slot[k]) != MHA_OK)
            return tool_fail(cmd, "--%s: %s", files[k], mha_last_error());
    const int sf = r->seq_first = OPT("seq-first") != NULL;
#undef OPT
    const mha_config *c = &r->c;
    int64_t B = 0, Lq = 0, Bk = 0, Lk = 0, Bv = 0, Lv = 0;
    if (input_dims(cmd, "query", in->q, c->embed_dim, "E", sf, &B, &Lq) ||
        (in->k &&
         input_dims(cmd, "key", in->k, c->kdim, "kdim", sf, &Bk, &Lk)) ||
        (in->v &&
         input_dims(cmd, "value", in->v, c->vdim, "vdim", sf, &Bv, &Lv)))
        return 1;
    /* (L, B, .) files into the library's (B, L, .) */
    mha_tensor *const ins[3] = {in->q, in->k, in->v};
    for (int k = 0; sf && k < 3; k++)
        if (ins[k] &&
            tool_swap01(cmd, ins[k]->data, ins[k]->ndim, ins[k]->shape))
            return 1;
    /* A command without --key (decode) runs self-attention only. */
    int has_key = 0;
    for (int k = 0; k < n; k++)
        has_key |= !strcmp(o[k].name, "key");
    if (!has_key && (c->kdim != c->embed_dim || c->vdim != c->embed_dim))
        return tool_fail(cmd, "the module has kdim %lld, vdim %lld: mha %s "
                         "runs self-attention, kdim = vdim = E = %lld",
                         (long long)c->kdim, (long long)c->vdim, cmd,
                         (long long)c->embed_dim);
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
    if (in->mask && block && in->mask->dtype != MHA_DTYPE_BOOL)
        return tool_fail(cmd, "--block-mask must be bool (true = blocked), "
                         "got %s", tool_dtype_of(in->mask));
    if (in->mask) {
        if (block)
            a->attn_mask.kind = MHA_MASK_BLOCK;
        else if (in->mask->dtype == MHA_DTYPE_BOOL)
            a->attn_mask.kind = MHA_MASK_ALLOW;
        else if (tool_is_float(in->mask))
            a->attn_mask.kind = MHA_MASK_ADDITIVE;
        else
            return tool_fail(cmd, "--attn-mask must be bool (allow) or float "
                             "(additive), got %s",
                             tool_dtype_of(in->mask));
        a->attn_mask.data = in->mask->data;
        a->attn_mask.ndim = in->mask->ndim;
        for (int d = 0; d < in->mask->ndim && d < 4; d++)
            a->attn_mask.shape[d] = in->mask->shape[d];
    }
    if (in->kmask) {
        if (in->kmask->dtype != MHA_DTYPE_BOOL)
            return tool_fail(cmd, "--key-mask must be bool (true = real key), "
                             "got %s", tool_dtype_of(in->kmask));
        a->key_padding_mask = (mha_mask){MHA_MASK_ALLOW, in->kmask->data,
                                         in->kmask->ndim, {0}};
        for (int d = 0; d < in->kmask->ndim && d < 4; d++)
            a->key_padding_mask.shape[d] = in->kmask->shape[d];
    }
    if (in->klen) {
        if (in->klen->dtype != MHA_DTYPE_I32 &&
            in->klen->dtype != MHA_DTYPE_I64)
            return tool_fail(cmd, "--key-lengths must hold integers, got %s",
                             tool_dtype_of(in->klen));
        if (in->klen->numel != B || in->klen->ndim > 1) {
            char got[96];
            tool_shape_str(in->klen, got, sizeof got);
            return tool_fail(cmd, "--key-lengths must have shape (B) = "
                             "(%lld), got %s", (long long)B, got);
        }
        a->key_lengths = in->klen->data;
    }
    return 0;
}

/* See run_setup.h. */
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

mha_tensor_view tool_view_like(const char *name, const mha_tensor *like,
                               int64_t last, const float *data)
{
    mha_tensor_view v = {name, MHA_DTYPE_F32, like->ndim, {0}, data};
    for (int d = 0; d < like->ndim; d++)
        v.shape[d] = like->shape[d];
    v.shape[like->ndim - 1] = last;
    return v;
}
