/*
 * module_io.c -- a module to and from a PyTorch nn.MultiheadAttention
 * state_dict saved as safetensors.
 */
#include "io.h"
#include "module/module.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const KNOWN[] = {
    "in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
    "in_proj_bias",   "bias_k",        "bias_v",        "out_proj.weight",
    "out_proj.bias",  "sinks"};

/* A float tensor of exactly this shape, or an error naming it. */
static mha_status expect(const mha_tensor *t, const char *name, int ndim,
                         int64_t d0, int64_t d1, int64_t d2)
{
    const int64_t want[3] = {d0, d1, d2};
    int ok = t->ndim == ndim;
    for (int k = 0; ok && k < ndim; k++)
        ok = want[k] < 0 || t->shape[k] == want[k];
    if (t->dtype == MHA_DTYPE_BOOL || t->dtype == MHA_DTYPE_I32 ||
        t->dtype == MHA_DTYPE_I64)
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: %s has dtype %s, expected a float "
                             "type", name, mha_dtype_name(t->dtype));
    if (ok)
        return MHA_OK;
    char got[128] = "", exp[128] = "";
    for (int k = 0; k < t->ndim; k++)
        snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld",
                 k ? ", " : "", (long long)t->shape[k]);
    for (int k = 0; k < ndim; k++) {
        if (want[k] < 0)
            snprintf(exp + strlen(exp), sizeof exp - strlen(exp), "%s?",
                     k ? ", " : "");
        else
            snprintf(exp + strlen(exp), sizeof exp - strlen(exp), "%s%lld",
                     k ? ", " : "", (long long)want[k]);
    }
    return mha_set_error(MHA_ERR_SHAPE, "state_dict: %s has shape [%s], "
                         "expected [%s]", name, got, exp);
}

/* expect() for a tensor whose shape involves D, the heads' width, read from
 * out_proj.weight [E, D]: when D != E the error says where D came from. */
static mha_status expect_d(const mha_tensor *t, const char *name, int ndim,
                           int64_t d0, int64_t d1, int64_t d2,
                           const mha_tensor *o_w)
{
    mha_status st = expect(t, name, ndim, d0, d1, d2);
    if (st == MHA_OK || o_w->shape[0] == o_w->shape[1])
        return st;
    char msg[MHA_ERROR_CAP];
    snprintf(msg, sizeof msg, "%s", mha_last_error());
    return mha_set_error(st, "%s (the heads' width %lld is the column count "
                         "of out_proj.weight [%lld, %lld])", msg,
                         (long long)o_w->shape[1], (long long)o_w->shape[0],
                         (long long)o_w->shape[1]);
}

/* A strict integer / float / boolean from a metadata string: the whole
 * string, no leading space or '+' (which strtoll / strtod would skip). */
static int meta_int(const char *s, int64_t *out)
{
    if (!s || !(*s == '-' || (*s >= '0' && *s <= '9')))
        return 0;
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (*end || errno)
        return 0;
    *out = v;
    return 1;
}

static int meta_float(const char *s, float *out)
{
    if (!s || !(*s == '-' || *s == '.' || (*s >= '0' && *s <= '9')))
        return 0;
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    /* a value float32 cannot hold (3e39, or 1e-50 rounding to 0) is not
     * silently replaced by infinity or zero */
    if (*end || errno || !isfinite(v) || !isfinite((float)v) ||
        ((float)v == 0.0f && v != 0.0))
        return 0;
    *out = (float)v;
    return 1;
}

static int meta_bool(const char *s, int *out)
{
    if (!s)
        return 0;
    if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "1"))
        return *out = 1, 1;
    if (!strcmp(s, "false") || !strcmp(s, "False") || !strcmp(s, "0"))
        return *out = 0, 1;
    return 0;
}

static mha_status bad_meta(const char *key, const char *value)
{
    return mha_set_error(MHA_ERR_FORMAT,
                         "state_dict: __metadata__ %s = '%s' is not valid",
                         key, value);
}

static mha_status bad_meta_why(const char *key, const char *value,
                               const char *why)
{
    return mha_set_error(MHA_ERR_FORMAT,
                         "state_dict: __metadata__ %s = '%s' is not valid: "
                         "%s", key, value, why);
}

/*
 * The score modifiers and RoPE in __metadata__ (mha_module_save writes
 * those that are not the default):
 *   rope          "neox" or "gptj"; rope_dims (integer), rope_theta and
 *                 rope_scale (floats) only beside it
 *   alibi         a boolean; alibi_slopes "s0,s1,..." (num_heads floats,
 *                 read by slopes_from_metadata once num_heads is known)
 *   window        "LEFT,RIGHT", integers >= -1
 *   softcap       a float > 0
 * and (mha_config's own, beside them) attention_chunk, an integer >= 1.
 * Each value is parsed strictly; what the values mean is checked by
 * mha_create.
 */
static mha_status mods_from_metadata(const mha_tensor_file *f,
                                     mha_modifiers *mods)
{
    const char *v;
    if ((v = mha_tensor_file_metadata(f, "rope"))) {
        if (!strcmp(v, "neox"))
            mods->rope.style = MHA_ROPE_NEOX;
        else if (!strcmp(v, "gptj"))
            mods->rope.style = MHA_ROPE_GPTJ;
        else
            return bad_meta_why("rope", v, "expected neox or gptj");
    }
    const char *rk[3] = {"rope_dims", "rope_theta", "rope_scale"};
    for (int k = 0; k < 3; k++) {
        if (!(v = mha_tensor_file_metadata(f, rk[k])))
            continue;
        if (mods->rope.style == MHA_ROPE_NONE)
            return bad_meta_why(rk[k], v, "there is no rope key (neox or "
                                "gptj) for it to go with");
        const int ok = k == 0 ? meta_int(v, &mods->rope.dims)
                     : meta_float(v, k == 1 ? &mods->rope.theta
                                            : &mods->rope.scale);
        if (!ok)
            return bad_meta_why(rk[k], v, k == 0 ? "expected an integer"
                                                 : "expected a finite "
                                                   "number");
    }
    int b;
    if ((v = mha_tensor_file_metadata(f, "alibi"))) {
        if (!meta_bool(v, &b))
            return bad_meta_why("alibi", v, "expected true or false");
        mods->alibi = b;
    }
    if ((v = mha_tensor_file_metadata(f, "alibi_slopes")) && !mods->alibi)
        return bad_meta_why("alibi_slopes", v, "alibi is not on");
    if ((v = mha_tensor_file_metadata(f, "window"))) {
        char a[32], c[32];
        const char *comma = strchr(v, ',');
        const size_t n = comma ? (size_t)(comma - v) : 0;
        if (!comma || n >= sizeof a || strlen(comma + 1) >= sizeof c)
            return bad_meta_why("window", v, "expected LEFT,RIGHT");
        memcpy(a, v, n);
        a[n] = '\0';
        strcpy(c, comma + 1);
        if (!meta_int(a, &mods->window_left) ||
            !meta_int(c, &mods->window_right) || mods->window_left < -1 ||
            mods->window_right < -1)
            return bad_meta_why("window", v, "expected LEFT,RIGHT, integers "
                                ">= -1 (-1: no bound)");
        mods->window = 1;
    }
    if ((v = mha_tensor_file_metadata(f, "softcap")) &&
        (!meta_float(v, &mods->softcap) || !(mods->softcap > 0.0f)))
        return bad_meta_why("softcap", v, "expected a finite number > 0");
    return MHA_OK;
}

/* alibi_slopes "s0,s1,...": exactly H finite floats into a new array
 * (*out, the caller frees it), or *out NULL when the key is absent. */
static mha_status slopes_from_metadata(const mha_tensor_file *f, int64_t H,
                                       float **out)
{
    *out = NULL;
    const char *v = mha_tensor_file_metadata(f, "alibi_slopes");
    if (!v)
        return MHA_OK;
    float *s = mha_alloc_floats(H, "ALiBi slopes");
    if (!s)
        return MHA_ERR_OUT_OF_MEMORY;
    int64_t n = 0;
    const char *p = v;
    for (;;) {
        const char *comma = strchr(p, ',');
        const size_t len = comma ? (size_t)(comma - p) : strlen(p);
        char tok[64];
        if (len >= sizeof tok || n >= H) {
            free(s);
            return n >= H ? mha_set_error(MHA_ERR_FORMAT,
                                          "state_dict: __metadata__ "
                                          "alibi_slopes has more than "
                                          "num_heads %lld values",
                                          (long long)H)
                          : bad_meta_why("alibi_slopes", v,
                                         "a value is too long");
        }
        memcpy(tok, p, len);
        tok[len] = '\0';
        if (!meta_float(tok, &s[n])) {
            free(s);
            return bad_meta_why("alibi_slopes", v, "expected num_heads "
                                "finite numbers separated by commas");
        }
        n++;
        if (!comma)
            break;
        p = comma + 1;
    }
    if (n != H) {
        free(s);
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: __metadata__ alibi_slopes has %lld "
                             "values, expected num_heads %lld", (long long)n,
                             (long long)H);
    }
    *out = s;
    return MHA_OK;
}

/* Fills the config fields that the shapes do not decide. */
static mha_status config_from_metadata(const mha_tensor_file *f,
                                       mha_config *c)
{
    const char *v;
    int b;
    if ((v = mha_tensor_file_metadata(f, "add_zero_attn"))) {
        if (!meta_bool(v, &b))
            return bad_meta("add_zero_attn", v);
        c->add_zero_attn = b;
    }
    if ((v = mha_tensor_file_metadata(f, "dropout")) &&
        !meta_float(v, &c->dropout))
        return bad_meta("dropout", v);
    if ((v = mha_tensor_file_metadata(f, "scale"))) {
        if (!meta_float(v, &c->scale))
            return bad_meta_why("scale", v, "expected a finite number that "
                                "float32 holds (not 0 after rounding)");
        c->given |= MHA_GIVEN_SCALE;   /* written only when chosen */
    }
    if ((v = mha_tensor_file_metadata(f, "attention_chunk")) &&
        (!meta_int(v, &c->attention_chunk) || c->attention_chunk < 1))
        return bad_meta_why("attention_chunk", v, "expected an integer >= 1");
    return mods_from_metadata(f, &c->mods);
}

/* Config keys in __metadata__ that the shapes decide must agree. */
static mha_status check_metadata_agrees(const mha_tensor_file *f,
                                        const mha_config *c)
{
    const char *ikeys[3] = {"embed_dim", "kdim", "vdim"};
    const int64_t ivals[3] = {c->embed_dim, c->kdim, c->vdim};
    for (int k = 0; k < 3; k++) {
        const char *v = mha_tensor_file_metadata(f, ikeys[k]);
        int64_t x;
        if (v && (!meta_int(v, &x) || x != ivals[k]))
            return mha_set_error(MHA_ERR_FORMAT,
                                 "state_dict: __metadata__ %s = '%s' but the "
                                 "tensors say %lld", ikeys[k], v,
                                 (long long)ivals[k]);
    }
    const char *kv = mha_tensor_file_metadata(f, "num_kv_heads");
    int64_t kvx;
    const int64_t hkv = c->num_kv_heads ? c->num_kv_heads : c->num_heads;
    if (kv && (!meta_int(kv, &kvx) || kvx != hkv))
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: __metadata__ num_kv_heads = '%s' "
                             "but the tensors say %lld", kv, (long long)hkv);
    const char *bkeys[2] = {"bias", "add_bias_kv"};
    const int bvals[2] = {!c->no_bias, c->add_bias_kv};
    for (int k = 0; k < 2; k++) {
        const char *v = mha_tensor_file_metadata(f, bkeys[k]);
        int x;
        if (v && (!meta_bool(v, &x) || x != bvals[k]))
            return mha_set_error(MHA_ERR_FORMAT,
                                 "state_dict: __metadata__ %s = '%s' but the "
                                 "tensors say %s", bkeys[k], v,
                                 bvals[k] ? "true" : "false");
    }
    return MHA_OK;
}

static mha_status mha_module_from_file_impl(const mha_tensor_file *f,
                                            int64_t num_heads,
                                            const mha_config *base,
                                            mha_module **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output handle is NULL");
    *out = NULL;
    if (!f)
        return mha_set_error(MHA_ERR_NULL_POINTER, "tensor file is NULL");
    for (int k = 0; k < mha_tensor_file_count(f); k++) {
        const char *name = mha_tensor_file_at(f, k)->name;
        int known = 0;
        for (size_t j = 0; j < sizeof KNOWN / sizeof *KNOWN; j++)
            known |= !strcmp(name, KNOWN[j]);
        if (!known)
            return mha_set_error(MHA_ERR_FORMAT,
                                 "state_dict: unexpected tensor '%s' (an "
                                 "nn.MultiheadAttention has in_proj_weight or "
                                 "q/k/v_proj_weight, in_proj_bias, bias_k, "
                                 "bias_v, out_proj.weight, out_proj.bias; "
                                 "mha adds sinks)",
                                 name);
    }
    const mha_tensor *in_w = mha_tensor_file_find(f, "in_proj_weight");
    const mha_tensor *q_w = mha_tensor_file_find(f, "q_proj_weight");
    const mha_tensor *k_w = mha_tensor_file_find(f, "k_proj_weight");
    const mha_tensor *v_w = mha_tensor_file_find(f, "v_proj_weight");
    const mha_tensor *in_b = mha_tensor_file_find(f, "in_proj_bias");
    const mha_tensor *o_w = mha_tensor_file_find(f, "out_proj.weight");
    const mha_tensor *o_b = mha_tensor_file_find(f, "out_proj.bias");
    const mha_tensor *b_k = mha_tensor_file_find(f, "bias_k");
    const mha_tensor *b_v = mha_tensor_file_find(f, "bias_v");
    const mha_tensor *sinks = mha_tensor_file_find(f, "sinks");

    mha_config c = {0};
    MHA_CHECK(config_from_metadata(f, &c));
    if (base) {
        c.add_zero_attn = base->add_zero_attn ? 1 : c.add_zero_attn;
        if (base->dropout != 0.0f || (base->given & MHA_GIVEN_DROPOUT))
            c.dropout = base->dropout;
        if (base->scale != 0.0f || (base->given & MHA_GIVEN_SCALE)) {
            c.scale = base->scale;
            c.given |= MHA_GIVEN_SCALE;
        }
        c.seed = base->seed;
        /* The modifiers a caller sets replace the file's, block by
         * block (the command line's --rope, --alibi, ... over the
         * metadata). */
        const mha_modifiers *bm = &base->mods;
        if (bm->rope.style != MHA_ROPE_NONE)
            c.mods.rope = bm->rope;
        if (bm->alibi || bm->alibi_slopes)
            c.mods.alibi = 1;
        if (bm->window) {
            c.mods.window = 1;
            c.mods.window_left = bm->window_left;
            c.mods.window_right = bm->window_right;
        }
        if (bm->softcap != 0.0f)
            c.mods.softcap = bm->softcap;
        if (base->attention_chunk)
            c.attention_chunk = base->attention_chunk;
    }
    const int base_slopes = base && (base->mods.alibi || base->mods.alibi_slopes);
    if (!o_w)
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: out_proj.weight is missing");
    MHA_CHECK(expect(o_w, "out_proj.weight", 2, -1, -1, 0));
    /* out_proj.weight is [E, Dv]: Dv = E in every PyTorch module; a pruned
     * module (mha_prune_heads) has fewer heads side by side, Dv < E.  The
     * queries' D = H d_h is Dv but where values are d_v != d_h wide (q's
     * rows say it). */
    const int64_t E = o_w->shape[0], Dv = o_w->shape[1];
    int64_t D = Dv;
    int64_t Dkv = D, Dvkv = Dv;   /* the rows of W_k and W_v: H_kv d_h, d_v */
    if (E < 1 || Dv < 1)
        return mha_set_error(MHA_ERR_SHAPE,
                             "state_dict: out_proj.weight has shape [%lld, "
                             "%lld]: embed_dim and the heads' width must be "
                             "> 0", (long long)E, (long long)Dv);
    if (in_w && (q_w || k_w || v_w))
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: both in_proj_weight and "
                             "q/k/v_proj_weight are present");
    if (in_w) {
        MHA_CHECK(expect_d(in_w, "in_proj_weight", 2, 3 * D, E, 0, o_w));
        c.kdim = c.vdim = E;
    } else {
        const char *missing = !q_w ? "q_proj_weight" : !k_w ? "k_proj_weight"
                            : !v_w ? "v_proj_weight" : NULL;
        if (missing)
            return mha_set_error(MHA_ERR_FORMAT,
                                 "state_dict: neither in_proj_weight nor %s "
                                 "is present", missing);
        MHA_CHECK(expect(q_w, "q_proj_weight", 2, -1, E, 0));
        if (q_w->shape[0] < 1)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "state_dict: q_proj_weight has no rows");
        D = q_w->shape[0];
        /* k and v may have fewer rows than q: grouped-query attention,
         * H_kv = rows / d_h; v's rows H_kv d_v stand to k's as out_proj's
         * columns to q's rows (checked below, once num_heads is known). */
        int64_t kx = 0, vx = -1;   /* (an empty tensor's rows are any
                                      number up to 2^53: products checked) */
        if (k_w->ndim == 2 && v_w->ndim == 2 && k_w->shape[0] >= 1 &&
            v_w->shape[0] >= 1 && mha_mul_ok(k_w->shape[0], Dv, &kx) &&
            mha_mul_ok(v_w->shape[0], D, &vx) && kx == vx) {
            Dkv = k_w->shape[0];
            Dvkv = v_w->shape[0];
        } else if (k_w->ndim == 2 && v_w->ndim == 2) {  /* say what differs */
            return mha_set_error(MHA_ERR_SHAPE,
                                 "state_dict: k_proj_weight has %lld rows "
                                 "and v_proj_weight %lld: they must be H_kv "
                                 "* d_h and H_kv * d_v, in the ratio of "
                                 "q_proj_weight's %lld rows (H * d_h) to "
                                 "out_proj.weight's %lld columns (H * d_v)",
                                 (long long)k_w->shape[0],
                                 (long long)v_w->shape[0], (long long)D,
                                 (long long)Dv);
        }
        MHA_CHECK(expect(k_w, "k_proj_weight", 2, Dkv, -1, 0));
        MHA_CHECK(expect(v_w, "v_proj_weight", 2, Dvkv, -1, 0));
        /* A width of 0 would mean "E" to mha_create, and the packing below
         * would then read E * E floats from an empty tensor. */
        if (k_w->shape[1] < 1 || v_w->shape[1] < 1)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "state_dict: %s has shape [%lld, 0]: kdim "
                                 "and vdim must be > 0",
                                 k_w->shape[1] < 1 ? "k_proj_weight"
                                                   : "v_proj_weight",
                                 (long long)D);
        c.kdim = k_w->shape[1];
        c.vdim = v_w->shape[1];
    }
    if (!in_b != !o_b)
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: %s is present but %s is missing "
                             "(PyTorch's bias flag governs both)",
                             in_b ? "in_proj_bias" : "out_proj.bias",
                             in_b ? "out_proj.bias" : "in_proj_bias");
    if (in_b) {
        MHA_CHECK(expect_d(in_b, "in_proj_bias", 1, D + Dkv + Dvkv, 0, 0,
                           o_w));
        MHA_CHECK(expect(o_b, "out_proj.bias", 1, E, 0, 0));
    }
    if (!b_k != !b_v)
        return mha_set_error(MHA_ERR_FORMAT,
                             "state_dict: %s is present but %s is missing",
                             b_k ? "bias_k" : "bias_v",
                             b_k ? "bias_v" : "bias_k");
    if (b_k) {
        MHA_CHECK(expect_d(b_k, "bias_k", 3, 1, 1, Dkv, o_w));
        MHA_CHECK(expect_d(b_v, "bias_v", 3, 1, 1, Dvkv, o_w));
    }
    c.embed_dim = E;
    c.no_bias = !in_b;
    c.add_bias_kv = b_k != NULL;
    if (num_heads > 0) {
        /* A given count that the file contradicts is refused, not
         * silently preferred: one of the two is wrong. */
        const char *v = mha_tensor_file_metadata(f, "num_heads");
        int64_t meta = 0;
        if (v && meta_int(v, &meta) && meta > 0 && meta != num_heads)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "state_dict: num_heads %lld was given but "
                                 "__metadata__ says num_heads %lld: give "
                                 "the file's count (or none), or fix the "
                                 "file", (long long)num_heads,
                                 (long long)meta);
        c.num_heads = num_heads;
    } else {
        const char *v = mha_tensor_file_metadata(f, "num_heads");
        if (!v)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "state_dict: the number of heads is not "
                                 "given and __metadata__ has no num_heads");
        if (!meta_int(v, &c.num_heads) || c.num_heads <= 0)
            return bad_meta("num_heads", v);
    }
    /* Both widths split into whole heads (D = Dv = E not divisible:
     * mha_create says so). */
    const struct {
        const char *name, *dim;
        int64_t n;
    } width[2] = {{"out_proj.weight", "columns", Dv},
                  {"q_proj_weight", "rows", D}};
    for (int i = 0; i < 2 && (Dv != E || D != E); i++)
        if (width[i].n % c.num_heads != 0)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "state_dict: %s has %lld %s (the heads side "
                                 "by side), not divisible by num_heads %lld",
                                 width[i].name, (long long)width[i].n,
                                 width[i].dim, (long long)c.num_heads);
    if (D != E)
        c.head_dim = D / c.num_heads;
    if (Dv != D)
        c.v_head_dim = Dv / c.num_heads;
    if (Dkv != D) {
        const int64_t dh = D / c.num_heads;
        if (D % c.num_heads != 0 || Dkv % dh != 0 ||
            c.num_heads % (Dkv / dh) != 0)
            return mha_set_error(MHA_ERR_SHAPE,
                                 "state_dict: k_proj_weight has %lld rows: "
                                 "for grouped-query attention they must be "
                                 "H_kv * d_h with d_h = %lld / %lld heads "
                                 "and H_kv dividing the heads",
                                 (long long)Dkv, (long long)D,
                                 (long long)c.num_heads);
        c.num_kv_heads = Dkv / dh;
    }
    /* (v's rows are then H_kv d_v: k's rows times Dv / D, checked) */

    if (sinks) {   /* one learned logit per query head (gpt-oss) */
        MHA_CHECK(expect(sinks, "sinks", 1, c.num_heads, 0, 0));
        c.sinks = 1;
    }
    MHA_CHECK(check_metadata_agrees(f, &c));
    /* Every value finite, named as the file names it (q/k/v_proj_weight
     * may be packed into in_proj_weight below). */
    for (int k = 0; k < mha_tensor_file_count(f); k++) {
        const mha_tensor *t = mha_tensor_file_at(f, k);
        const float *x = t->data;
        for (int64_t i = 0; i < t->numel; i++)
            if (!isfinite(x[i]))
                return mha_set_error(MHA_ERR_NON_FINITE,
                                     "state_dict: %s element %lld is %g",
                                     t->name, (long long)i, (double)x[i]);
    }

    /* ALiBi's slopes: the caller's (base), else the file's, else the
     * defaults; the module copies them at create. */
    float *file_slopes = NULL;
    if (base_slopes)
        c.mods.alibi_slopes = base->mods.alibi_slopes;
    else
        MHA_CHECK(slopes_from_metadata(f, c.num_heads, &file_slopes));
    if (file_slopes)
        c.mods.alibi_slopes = file_slopes;
    mha_module *m;
    mha_status cst = mha_create(&c, &m);
    free(file_slopes);
    MHA_CHECK(cst);
    /* PyTorch stores separate q/k/v weights only when kdim or vdim != E;
     * a file that has them with kdim = vdim = E is packed here into the
     * module's in_proj_weight. */
    const int pack = !in_w && m->packed;
    mha_status st = MHA_OK;
    for (int k = 0; k < mha_tensor_file_count(f) && st == MHA_OK; k++) {
        const mha_tensor *t = mha_tensor_file_at(f, k);
        if (!(pack && (t == q_w || t == k_w || t == v_w)))
            st = mha_param_set(m, t->name, t->data, t->numel);
    }
    if (st == MHA_OK && pack) {
        const int64_t n = D * E;
        float *w = mha_alloc_floats(3 * n, "in_proj_weight");
        if (!w) {
            st = MHA_ERR_OUT_OF_MEMORY;
        } else {
            memcpy(w, q_w->data, (size_t)n * sizeof(float));
            memcpy(w + n, k_w->data, (size_t)n * sizeof(float));
            memcpy(w + 2 * n, v_w->data, (size_t)n * sizeof(float));
            st = mha_param_set(m, "in_proj_weight", w, 3 * n);
            free(w);
        }
    }
    if (st != MHA_OK) {
        mha_free(m);
        return st;
    }
    *out = m;
    return MHA_OK;
}

mha_status mha_module_from_file_sized(const mha_tensor_file *file,
                                      int64_t num_heads,
                                      const mha_config *base, size_t base_size,
                                      mha_module **out)
{
    MHA_STRUCT_IN(mha_config, base);
    return mha_module_from_file_impl(file, num_heads, base ? &base_ : NULL,
                                     out);
}

mha_status mha_module_load(const char *path, int64_t num_heads,
                           mha_module **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output handle is NULL");
    *out = NULL;
    mha_tensor_file *f;
    MHA_CHECK(mha_safetensors_load(path, &f));
    mha_status st = mha_module_from_file(f, num_heads, NULL, out);
    mha_tensor_file_free(f);
    return st;
}

mha_status mha_module_save(const mha_module *m, const char *path)
{
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    mha_tensor_view views[MHA_MAX_PARAMS];
    for (int k = 0; k < m->nparams; k++) {
        const mha_param_info *info = &m->param[k].info;
        views[k] = (mha_tensor_view){info->name, MHA_DTYPE_F32, info->ndim,
                                     {0}, m->params + m->param[k].offset};
        for (int d = 0; d < info->ndim; d++)
            views[k].shape[d] = info->shape[d];
    }
    const mha_config *c = &m->cfg;
    enum { MAX_KEYS = 20 };
    char v[MAX_KEYS][48];
    const char *keys[MAX_KEYS], *vals[MAX_KEYS];
    int n = 0;
#define PUT(key, ...)                                    \
    do {                                                 \
        snprintf(v[n], sizeof v[n], __VA_ARGS__);        \
        keys[n] = (key);                                 \
        vals[n] = v[n];                                  \
        n++;                                             \
    } while (0)
    PUT("format", "pt");
    PUT("embed_dim", "%lld", (long long)c->embed_dim);
    PUT("num_heads", "%lld", (long long)c->num_heads);
    PUT("kdim", "%lld", (long long)c->kdim);
    PUT("vdim", "%lld", (long long)c->vdim);
    PUT("bias", "%s", c->no_bias ? "false" : "true");
    PUT("add_bias_kv", "%s", c->add_bias_kv ? "true" : "false");
    PUT("add_zero_attn", "%s", c->add_zero_attn ? "true" : "false");
    PUT("dropout", "%.9g", (double)c->dropout);
    /* A default scale is not written: it follows num_heads, so a file
     * loaded with another head count gets that count's default. */
    if (m->scale_given)
        PUT("scale", "%.9g", (double)c->scale);
    /* num_kv_heads only for a grouped-query module, which PyTorch's
     * nn.MultiheadAttention cannot load anyway. */
    if (c->num_kv_heads != c->num_heads)
        PUT("num_kv_heads", "%lld", (long long)c->num_kv_heads);
    /* The modifiers that are on, RoPE's resolved settings in full. */
    const mha_modifiers *md = &c->mods;
    if (md->rope.style != MHA_ROPE_NONE) {
        PUT("rope", "%s", md->rope.style == MHA_ROPE_GPTJ ? "gptj" : "neox");
        PUT("rope_dims", "%lld", (long long)md->rope.dims);
        PUT("rope_theta", "%.9g", (double)md->rope.theta);
        PUT("rope_scale", "%.9g", (double)md->rope.scale);
    }
    if (md->alibi)
        PUT("alibi", "true");
    if (md->window)
        PUT("window", "%lld,%lld", (long long)md->window_left,
            (long long)md->window_right);
    if (md->softcap > 0.0f)
        PUT("softcap", "%.9g", (double)md->softcap);
    if (c->attention_chunk)
        PUT("attention_chunk", "%lld", (long long)c->attention_chunk);
#undef PUT
    /* Custom slopes (the defaults follow num_heads and are not written):
     * H values of up to 16 characters and a comma each. */
    char *slopes = NULL;
    if (md->alibi && md->alibi_slopes) {
        const int64_t H = c->num_heads;
        if (H > (int64_t)(SIZE_MAX / 32))
            return mha_set_error(MHA_ERR_OVERFLOW, "alibi_slopes: %lld heads",
                                 (long long)H);
        slopes = malloc((size_t)H * 32 + 1);
        if (!slopes)
            return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate the "
                                 "alibi_slopes metadata");
        size_t at = 0;
        for (int64_t h = 0; h < H; h++)
            at += (size_t)snprintf(slopes + at, 32, "%s%.9g", h ? "," : "",
                                   (double)md->alibi_slopes[h]);
        keys[n] = "alibi_slopes";
        vals[n] = slopes;
        n++;
    }
    const mha_status st =
        mha_safetensors_save(path, views, m->nparams, keys, vals, n);
    free(slopes);
    return st;
}
