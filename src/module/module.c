/*
 * module.c -- configuration, parameter storage and initialisation.
 */
#include "module.h"
#include "attention/rope.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ---- configuration ----------------------------------------------------- */

static mha_status resolve_config(const mha_config *in, mha_config *out)
{
    if (!in)
        return mha_set_error(MHA_ERR_NULL_POINTER, "config is NULL");
    mha_config c = *in;
    if (c.embed_dim <= 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "embed_dim must be > 0, got %lld",
                             (long long)c.embed_dim);
    if (c.num_heads <= 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "num_heads must be > 0, got %lld",
                             (long long)c.num_heads);
    if (c.head_dim < 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "head_dim must be >= 0 (0 = embed_dim / "
                             "num_heads), got %lld", (long long)c.head_dim);
    if (c.head_dim == 0 && c.embed_dim % c.num_heads != 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "embed_dim %lld is not divisible by num_heads %lld",
                             (long long)c.embed_dim, (long long)c.num_heads);
    if (c.kdim < 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "kdim must be >= 0 (0 = embed_dim), got %lld",
                             (long long)c.kdim);
    if (c.vdim < 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "vdim must be >= 0 (0 = embed_dim), got %lld",
                             (long long)c.vdim);
    if (!(c.dropout >= 0.0f && c.dropout <= 1.0f))
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "dropout must be in [0, 1], got %g",
                             (double)c.dropout);
    if (!isfinite(c.scale))
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "scale must be finite, got %g", (double)c.scale);
    /* CBLAS takes int dimensions: keep every width within INT32_MAX. */
    const int64_t widest = 0x7fffffff;
    if (c.embed_dim > widest || c.kdim > widest || c.vdim > widest)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "embed_dim, kdim and vdim must be <= %lld, got "
                             "%lld, %lld, %lld", (long long)widest,
                             (long long)c.embed_dim, (long long)c.kdim,
                             (long long)c.vdim);
    if (c.head_dim == 0)
        c.head_dim = c.embed_dim / c.num_heads;
    if (c.num_kv_heads < 0 ||
        (c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads != 0))
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "num_kv_heads %lld must divide num_heads %lld "
                             "(0 = num_heads)", (long long)c.num_kv_heads,
                             (long long)c.num_heads);
    if (c.num_kv_heads == 0)
        c.num_kv_heads = c.num_heads;
    /* ... and the widest of all, the fused q|k|v projection of 3 D
     * columns (k|v: 2 D), where D = num_heads * head_dim. */
    if (c.num_heads > widest / 3 || c.head_dim > widest / (3 * c.num_heads))
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "3 * num_heads * head_dim (the width of the "
                             "fused q|k|v projection) must be <= %lld, got "
                             "3 * %lld * %lld", (long long)widest,
                             (long long)c.num_heads, (long long)c.head_dim);
    if (c.v_head_dim < 0)
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "v_head_dim must be >= 0 (0 = head_dim), got "
                             "%lld", (long long)c.v_head_dim);
    if (c.v_head_dim == 0)
        c.v_head_dim = c.head_dim;
    /* the values' heads side by side, H * d_v, within the same bound */
    if (c.v_head_dim > widest / (3 * c.num_heads))
        return mha_set_error(MHA_ERR_INVALID_CONFIG,
                             "3 * num_heads * v_head_dim must be <= %lld, "
                             "got 3 * %lld * %lld", (long long)widest,
                             (long long)c.num_heads, (long long)c.v_head_dim);
    if (c.kdim == 0)
        c.kdim = c.embed_dim;
    if (c.vdim == 0)
        c.vdim = c.embed_dim;
    if (c.scale == 0.0f && !(c.given & MHA_GIVEN_SCALE))
        c.scale = (float)(1.0 / sqrt((double)c.head_dim));
    MHA_CHECK(mha_modifiers_check(&c.mods, c.num_heads, "config"));
    MHA_CHECK(mha_chunk_check(c.attention_chunk, "config"));
    /* RoPE's defaults filled in: mha_get_config and the file say them. */
    MHA_CHECK(mha_rope_resolve(&c.mods.rope, c.head_dim, &c.mods.rope));
    c.mods.alibi = c.mods.alibi != 0;
    c.mods.window = c.mods.window != 0;
    if (!c.mods.alibi)
        c.mods.alibi_slopes = NULL;
    if (!c.mods.window)
        c.mods.window_left = c.mods.window_right = 0;
    c.sinks = c.sinks != 0;
    c.no_bias = c.no_bias != 0;
    c.add_bias_kv = c.add_bias_kv != 0;
    c.add_zero_attn = c.add_zero_attn != 0;
    *out = c;
    return MHA_OK;
}

/* ---- the parameter table ----------------------------------------------- */

static mha_status add_param(mha_module *m, const char *name, int ndim,
                            int64_t d0, int64_t d1, int64_t d2)
{
    mha_param *p = &m->param[m->nparams++];
    int64_t dims[3] = {d0, d1, d2}, n = 1;
    p->info.name = name;
    p->info.ndim = ndim;
    for (int k = 0; k < ndim; k++) {
        p->info.shape[k] = dims[k];
        if (!mha_mul_ok(n, dims[k], &n))
            return mha_set_error(MHA_ERR_OVERFLOW,
                                 "parameter %s: element count overflows", name);
    }
    p->info.numel = n;
    p->offset = m->params_numel;
    p->info.offset = p->offset;
    if (m->params_numel > INT64_MAX - n)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "parameters: total element count overflows");
    m->params_numel += n;
    return MHA_OK;
}

static const mha_param *find_param(const mha_module *m, const char *name)
{
    for (int k = 0; k < m->nparams; k++)
        if (strcmp(m->param[k].info.name, name) == 0)
            return &m->param[k];
    return NULL;
}

static float *param_data(const mha_module *m, const char *name)
{
    const mha_param *p = find_param(m, name);
    return p ? m->params + p->offset : NULL;
}

/* The table, in PyTorch's state_dict order (D = E but in pruned modules;
 * Dkv = D but in grouped-query modules; the values' Dv and Dvkv = D and
 * Dkv but where d_v != d_h). */
static mha_status build_table(mha_module *m)
{
    const int64_t E = m->cfg.embed_dim, D = m->inner_dim, Dkv = m->kv_dim;
    const int64_t Dv = m->v_inner_dim, Dvkv = m->kv_vdim;
    const int64_t inD = D + Dkv + Dvkv;  /* <= 3 max(D, Dv) <= INT32_MAX */
    if (m->packed) {
        MHA_CHECK(add_param(m, "in_proj_weight", 2, inD, E, 0));
    } else {
        MHA_CHECK(add_param(m, "q_proj_weight", 2, D, E, 0));
        MHA_CHECK(add_param(m, "k_proj_weight", 2, Dkv, m->cfg.kdim, 0));
        MHA_CHECK(add_param(m, "v_proj_weight", 2, Dvkv, m->cfg.vdim, 0));
    }
    if (!m->cfg.no_bias)
        MHA_CHECK(add_param(m, "in_proj_bias", 1, inD, 0, 0));
    if (m->cfg.add_bias_kv) {
        MHA_CHECK(add_param(m, "bias_k", 3, 1, 1, Dkv));
        MHA_CHECK(add_param(m, "bias_v", 3, 1, 1, Dvkv));
    }
    MHA_CHECK(add_param(m, "out_proj.weight", 2, E, Dv, 0));
    if (!m->cfg.no_bias)
        MHA_CHECK(add_param(m, "out_proj.bias", 1, E, 0, 0));
    if (m->cfg.sinks)   /* gpt-oss's name; PyTorch's module has none */
        MHA_CHECK(add_param(m, "sinks", 1, m->cfg.num_heads, 0, 0));
    return MHA_OK;
}

static void set_views(mha_module *m)
{
    const int64_t E = m->cfg.embed_dim, D = m->inner_dim;
    if (m->packed) {
        const float *w = param_data(m, "in_proj_weight");
        m->w_q = w;
        m->w_k = w + D * E;
        m->w_v = w + 2 * D * E;
    } else {
        m->w_q = param_data(m, "q_proj_weight");
        m->w_k = param_data(m, "k_proj_weight");
        m->w_v = param_data(m, "v_proj_weight");
    }
    const float *b = param_data(m, "in_proj_bias");
    m->b_q = b;
    m->b_k = b ? b + D : NULL;
    m->b_v = b ? b + D + m->kv_dim : NULL;
    m->w_o = param_data(m, "out_proj.weight");
    m->b_o = param_data(m, "out_proj.bias");
    m->bias_k = param_data(m, "bias_k");
    m->bias_v = param_data(m, "bias_v");
    m->sinks = param_data(m, "sinks");
}

/* ---- initialisation ---------------------------------------------------- */

/* Each parameter draws from its own stream, keyed by its name, so adding
 * a parameter to a configuration does not change the others' values. */
static uint64_t name_stream(uint64_t seed, const char *name)
{
    uint64_t h = 0xcbf29ce484222325ULL;           /* FNV-1a */
    for (const char *c = name; *c; c++)
        h = (h ^ (unsigned char)*c) * 0x100000001b3ULL;
    return mha_mix64(seed ^ mha_mix64(h));
}

static double draw(uint64_t stream, uint64_t k)
{
    return mha_u01(mha_mix64(stream + k * 0x9e3779b97f4a7c15ULL));
}

/* Xavier (Glorot) uniform: U(-a, a), a = sqrt(6 / (fan_in + fan_out)). */
static void xavier_uniform(float *w, const mha_param_info *info,
                           uint64_t stream)
{
    const double fan_out = (double)info->shape[0];
    const double fan_in = (double)info->shape[1];
    const double a = sqrt(6.0 / (fan_in + fan_out));
    for (int64_t k = 0; k < info->numel; k++)
        w[k] = (float)((2.0 * draw(stream, (uint64_t)k) - 1.0) * a);
}

/* Xavier normal for bias_k / bias_v, shape (1, 1, D): PyTorch counts
 * fan_in = fan_out = D (the last dimension is the receptive field), so
 * std = sqrt(2 / (2D)).  Box-Muller on two uniforms per value. */
static void xavier_normal_kv(float *w, const mha_param_info *info,
                             uint64_t stream)
{
    const double E = (double)info->shape[2];
    const double sd = sqrt(2.0 / (E + E));
    const double two_pi = 6.283185307179586476925;
    for (int64_t k = 0; k < info->numel; k++) {
        double u1 = 1.0 - draw(stream, 2 * (uint64_t)k); /* (0, 1] */
        double u2 = draw(stream, 2 * (uint64_t)k + 1);
        w[k] = (float)(sd * sqrt(-2.0 * log(u1)) * cos(two_pi * u2));
    }
}

mha_status mha_reset_parameters(mha_module *m, uint64_t seed)
{
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    for (int k = 0; k < m->nparams; k++) {
        const mha_param_info *info = &m->param[k].info;
        float *w = m->params + m->param[k].offset;
        uint64_t stream = name_stream(seed, info->name);
        if (info->ndim == 2)
            xavier_uniform(w, info, stream);
        else if (info->ndim == 3)
            xavier_normal_kv(w, info, stream);
        else
            memset(w, 0, (size_t)info->numel * sizeof(float));
    }
    m->cfg.seed = seed;
    return MHA_OK;
}

/* ---- lifecycle ---------------------------------------------------------- */

static mha_status mha_create_impl(const mha_config *config, mha_module **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output handle is NULL");
    *out = NULL;
    mha_config c;
    MHA_CHECK(resolve_config(config, &c));
    mha_module *m = calloc(1, sizeof *m);
    if (!m)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate module");
    m->cfg = c;
    m->scale_given =
        config->scale != 0.0f || (config->given & MHA_GIVEN_SCALE);
    m->head_dim = c.head_dim;
    m->inner_dim = c.num_heads * c.head_dim;
    m->kv_dim = c.num_kv_heads * c.head_dim;
    m->v_head_dim = c.v_head_dim;
    m->v_inner_dim = c.num_heads * c.v_head_dim;
    m->kv_vdim = c.num_kv_heads * c.v_head_dim;
    m->packed = c.kdim == c.embed_dim && c.vdim == c.embed_dim &&
                c.num_kv_heads == c.num_heads && c.v_head_dim == c.head_dim;
    mha_status st = build_table(m);
    if (st == MHA_OK) {
        m->params = mha_alloc_floats(m->params_numel, "parameters");
        m->slopes = c.mods.alibi ? mha_alloc_floats(c.num_heads, "ALiBi slopes")
                                 : NULL;
        if (!m->params || (c.mods.alibi && !m->slopes))
            st = MHA_ERR_OUT_OF_MEMORY;
    }
    if (st != MHA_OK) {
        free(m->params);
        free(m->slopes);
        free(m);
        return st;
    }
    if (m->slopes) {
        /* The caller's slopes are copied; the config points at the copy. */
        if (c.mods.alibi_slopes) {
            memcpy(m->slopes, c.mods.alibi_slopes,
                   (size_t)c.num_heads * sizeof *m->slopes);
            m->cfg.mods.alibi_slopes = m->slopes;
        } else {
            mha_alibi_slopes(c.num_heads, m->slopes);
        }
    }
    set_views(m);
    mha_reset_parameters(m, c.seed);
    *out = m;
    return MHA_OK;
}

mha_status mha_create_sized(const mha_config *config, size_t config_size,
                            mha_module **out)
{
    MHA_STRUCT_IN(mha_config, config);
    return mha_create_impl(config ? &config_ : NULL, out);
}

void mha_free(mha_module *m)
{
    if (!m)
        return;
    free(m->params);
    free(m->slopes);
    free(m);
}

static mha_status mha_get_config_impl(const mha_module *m, mha_config *out)
{
    if (!m || !out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             m ? "output config" : "module");
    *out = m->cfg;
    return MHA_OK;
}

mha_status mha_get_config_sized(const mha_module *module, mha_config *out,
                                size_t out_size)
{
    mha_config out_ = {0};
    MHA_CHECK(mha_struct_out_size(out, out_size, "mha_config"));
    const mha_status st = mha_get_config_impl(module, out ? &out_ : NULL);
    if (st == MHA_OK)
        memcpy(out, &out_, out_size < sizeof out_ ? out_size : sizeof out_);
    return st;
}

int64_t mha_total_keys(const mha_module *m, int64_t kv_len)
{
    if (!m) {
        mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
        return -1;
    }
    if (kv_len < 0) {
        mha_set_error(MHA_ERR_INVALID_ARGUMENT, "kv_len %lld is negative",
                      (long long)kv_len);
        return -1;
    }
    const int64_t extra = m->cfg.add_bias_kv + m->cfg.add_zero_attn;
    if (kv_len > INT64_MAX - extra) {   /* callers take -1 as "too large" */
        mha_set_error(MHA_ERR_OVERFLOW, "kv_len %lld and the extra keys "
                      "overflow", (long long)kv_len);
        return -1;
    }
    return kv_len + extra;
}

/* ---- parameter access --------------------------------------------------- */

int mha_param_count(const mha_module *m) { return m ? m->nparams : 0; }

int64_t mha_param_numel(const mha_module *m)
{
    if (!m) {
        mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
        return -1;
    }
    return m->params_numel;
}

static mha_status mha_param_info_at_impl(const mha_module *m, int index,
                                         mha_param_info *out)
{
    if (!m || !out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             m ? "output info" : "module");
    if (index < 0 || index >= m->nparams)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "parameter index %d out of range [0, %d)", index,
                             m->nparams);
    *out = m->param[index].info;
    return MHA_OK;
}

mha_status mha_param_info_at_sized(const mha_module *module, int index,
                                   mha_param_info *out, size_t out_size)
{
    mha_param_info out_ = {0};
    MHA_CHECK(mha_struct_out_size(out, out_size, "mha_param_info"));
    const mha_status st = mha_param_info_at_impl(module, index,
                                                 out ? &out_ : NULL);
    if (st == MHA_OK)
        memcpy(out, &out_, out_size < sizeof out_ ? out_size : sizeof out_);
    return st;
}

/* Finds `name` and, when `counted`, checks the caller's element count and
 * buffer against it (any negative count is refused, never skipped). */
static mha_status lookup(const mha_module *m, const char *name, int counted,
                         int64_t numel, const void *buf,
                         const mha_param **out)
{
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    if (!name)
        return mha_set_error(MHA_ERR_NULL_POINTER, "parameter name is NULL");
    const mha_param *p = find_param(m, name);
    if (!p)
        return mha_set_error(MHA_ERR_NOT_FOUND,
                             "this module has no parameter named '%s'", name);
    if (counted && numel != p->info.numel)
        return mha_set_error(MHA_ERR_SHAPE,
                             "parameter %s has %lld elements, caller gave %lld",
                             name, (long long)p->info.numel, (long long)numel);
    if (counted && !buf)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "buffer for parameter %s is NULL", name);
    *out = p;
    return MHA_OK;
}

static mha_status mha_param_info_by_name_impl(const mha_module *m,
                                              const char *name,
                                              mha_param_info *out)
{
    const mha_param *p = NULL;
    MHA_CHECK(lookup(m, name, 0, 0, NULL, &p));
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output info is NULL");
    *out = p->info;
    return MHA_OK;
}

mha_status mha_param_info_by_name_sized(const mha_module *module,
                                        const char *name, mha_param_info *out,
                                        size_t out_size)
{
    mha_param_info out_ = {0};
    MHA_CHECK(mha_struct_out_size(out, out_size, "mha_param_info"));
    const mha_status st = mha_param_info_by_name_impl(module, name,
                                                      out ? &out_ : NULL);
    if (st == MHA_OK)
        memcpy(out, &out_, out_size < sizeof out_ ? out_size : sizeof out_);
    return st;
}

mha_status mha_param_get(const mha_module *m, const char *name, float *dst,
                         int64_t numel)
{
    const mha_param *p = NULL;
    MHA_CHECK(lookup(m, name, 1, numel, dst, &p));
    memcpy(dst, m->params + p->offset, (size_t)numel * sizeof(float));
    return MHA_OK;
}

float *mha_param_data(mha_module *m)
{
    return m ? m->params : NULL;
}

mha_status mha_param_set(mha_module *m, const char *name, const float *src,
                         int64_t numel)
{
    const mha_param *p = NULL;
    MHA_CHECK(lookup(m, name, 1, numel, src, &p));
    for (int64_t k = 0; k < numel; k++)
        if (!isfinite(src[k]))
            return mha_set_error(MHA_ERR_NON_FINITE,
                                 "parameter %s: element %lld is %g", name,
                                 (long long)k, (double)src[k]);
    memcpy(m->params + p->offset, src, (size_t)numel * sizeof(float));
    return MHA_OK;
}

/* Projection `which` of `rows` rows: its weight (n_out, n_in) and bias
 * (or NULL), the row count checked (messages prefixed by `who`). */
static mha_status projection_of(const mha_module *m, mha_projection which,
                                int64_t rows, const char *who,
                                const float **w, const float **b,
                                int64_t *n_in, int64_t *n_out)
{
    if (rows <= 0)
        return mha_set_error(MHA_ERR_SHAPE, "%srows must be > 0, got %lld",
                             who, (long long)rows);
    const int64_t E = m->cfg.embed_dim, D = m->inner_dim;
    *n_out = D;
    switch (which) {
    case MHA_PROJ_QUERY: *w = m->w_q; *b = m->b_q; *n_in = E; break;
    case MHA_PROJ_KEY:
        *w = m->w_k; *b = m->b_k; *n_in = m->cfg.kdim; *n_out = m->kv_dim;
        break;
    case MHA_PROJ_VALUE:
        *w = m->w_v; *b = m->b_v; *n_in = m->cfg.vdim; *n_out = m->kv_vdim;
        break;
    case MHA_PROJ_OUT:
        *w = m->w_o; *b = m->b_o; *n_in = m->v_inner_dim; *n_out = E;
        break;
    default:
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%sunknown projection %d", who, (int)which);
    }
    MHA_CHECK(mha_gemm_check());
    int64_t n;
    if (!mha_mul_ok(rows, *n_in > *n_out ? *n_in : *n_out, &n) ||
        (uint64_t)n > SIZE_MAX / sizeof(float))
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "%sprojection of %lld rows overflows", who,
                             (long long)rows);
    return MHA_OK;
}

mha_status mha_project(const mha_module *m, mha_projection which,
                       const float *x, int64_t rows, float *y)
{
    if (!m || !x || !y)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s is NULL",
                             !m ? "module" : !x ? "input x" : "output y");
    const float *w = NULL, *b = NULL;
    int64_t n_in = 0, n_out = 0;
    MHA_CHECK(projection_of(m, which, rows, "", &w, &b, &n_in, &n_out));
    mha_linear(x, rows, n_in, n_in, w, n_out, b, y, n_out, 0);
    return MHA_OK;
}

mha_status mha_project_backward(const mha_module *m, mha_projection which,
                                const float *x, int64_t rows, const float *dy,
                                float *dx, int dx_accumulate,
                                float *grad_params, int accumulate,
                                int num_threads)
{
    if (!m || !x || !dy)
        return mha_set_error(MHA_ERR_NULL_POINTER, "project_backward: %s is "
                             "NULL", !m ? "module" : !x ? "input x" : "dy");
    if (num_threads < 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT, "project_backward: "
                             "num_threads must be >= 0, got %d", num_threads);
    const float *w = NULL, *b = NULL;
    int64_t n_in = 0, n_out = 0;
    MHA_CHECK(projection_of(m, which, rows, "project_backward: ", &w, &b,
                            &n_in, &n_out));
    if (dx)
        mha_linear_grad_input(dy, rows, n_out, n_out, w, n_in,
                              dx_accumulate ? 1.0f : 0.0f, dx, n_in,
                              num_threads);
    if (grad_params)   /* the gradients sit where the parameters do */
        mha_linear_grad_params(dy, rows, n_out, n_out, x, n_in, n_in,
                               accumulate ? 1.0f : 0.0f,
                               grad_params + (w - m->params),
                               b ? grad_params + (b - m->params) : NULL,
                               num_threads);
    return MHA_OK;
}

mha_status mha_module_check_self_attention(const mha_module *m)
{
    if (m->cfg.kdim != m->cfg.embed_dim || m->cfg.vdim != m->cfg.embed_dim)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "a KV cache needs self-attention: this module's "
                             "kdim %lld / vdim %lld differ from E %lld",
                             (long long)m->cfg.kdim, (long long)m->cfg.vdim,
                             (long long)m->cfg.embed_dim);
    return MHA_OK;
}

mha_status mha_kv_cache_for_module(const mha_module *m, int64_t batch,
                                   int64_t capacity, mha_kv_cache **out)
{
    if (out)
        *out = NULL;   /* as mha_kv_cache_create leaves it on a failure */
    if (!m)
        return mha_set_error(MHA_ERR_NULL_POINTER, "module is NULL");
    MHA_CHECK(mha_module_check_self_attention(m));
    const mha_kv_cache_config c = {batch, m->cfg.num_kv_heads, m->head_dim,
                                   capacity, MHA_KV_F32, 0, 0, 0, 0,
                                   m->v_head_dim, 0};
    return mha_kv_cache_create(&c, out);
}

/* (declared in module.h: the forwards, 32- and 16-bit, and the backward
 * fingerprint their inputs) */
uint64_t mha_fwd_fingerprint(const mha_module *m, const fwd_shape *s,
                             const mha_forward_args *a)
{
    const mha_config *c = &m->cfg;
    const size_t f = sizeof(float);
    const size_t e = a->dtype == MHA_DTYPE_F32 ? f : 2;   /* the data's */
    const int64_t rows_k = s->B * s->Lk;
    const mha_print_buf bufs[] = {
        {mha_fwd_query(a), (size_t)s->n_q * e},
        {mha_fwd_key(a), (size_t)(rows_k * c->kdim) * e},
        {mha_fwd_value(a), (size_t)(rows_k * c->vdim) * e},
        {a->head_mask, (size_t)s->H * f},
        {c->mods.rope.style != MHA_ROPE_NONE ? a->positions : NULL,
         (size_t)(s->B * s->Lq) * sizeof(int64_t)}};
    return mha_inputs_fingerprint(bufs, (int)(sizeof bufs / sizeof *bufs),
                                  &a->attn_mask, &a->key_padding_mask,
                                  a->key_lengths, s->B);
}

mha_status mha_plan_buffer(float **buf, int64_t *have, int64_t floats,
                           const char *what)
{
    if (*have >= floats)
        return MHA_OK;
    if (floats > INT64_MAX / (int64_t)sizeof(float) - 64)
        return mha_set_error(MHA_ERR_OVERFLOW, "%s overflows", what);
    free(*buf);
    *have = 0;
    /* (aligned_alloc wants a multiple of the alignment) */
    const size_t bytes = ((size_t)floats * sizeof(float) + 63) / 64 * 64;
    *buf = aligned_alloc(64, bytes);
    if (!*buf)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "cannot allocate %s (%lld bytes)", what,
                             (long long)bytes);
    *have = floats;
    return MHA_OK;
}
