/*
 * test_module.c -- the module's public contract: configuration validation
 * and defaults, the PyTorch parameter table, parameter access, Xavier
 * initialisation, mha_project, mha_forward's argument validation, status
 * strings, the version, and the thread-local error message.
 */
#define _POSIX_C_SOURCE 200809L   /* pthread barriers under -std=c11 */

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha.h"
#include "testutil.h"

/* The out-of-memory case asks malloc for 2^60 bytes: under AddressSanitizer
 * that must come back as NULL (as it does from glibc), not abort. */
#if defined(__SANITIZE_ADDRESS__)
const char *__asan_default_options(void);
__attribute__((used, visibility("default")))
const char *__asan_default_options(void)
{
    return "allocator_may_return_null=1";
}
#endif

/* ---- helpers ------------------------------------------------------------ */

#include "assert_error.h"

static mha_config cfg(int64_t E, int64_t H)
{
    mha_config c;
    memset(&c, 0, sizeof c);
    c.embed_dim = E;
    c.num_heads = H;
    c.seed = 1;
    return c;
}

static mha_module *make(const mha_config *c)
{
    mha_module *m = NULL;
    mha_status st = mha_create(c, &m);
    if (st != MHA_OK)
        fail_msg("mha_create failed: %s", mha_last_error());
    assert_non_null(m);
    return m;
}

static mha_module *make_simple(int64_t E, int64_t H, int64_t kdim,
                               int64_t vdim, int no_bias, int bias_kv,
                               uint64_t seed)
{
    mha_config c = cfg(E, H);
    c.kdim = kdim;
    c.vdim = vdim;
    c.no_bias = no_bias;
    c.add_bias_kv = bias_kv;
    c.seed = seed;
    return make(&c);
}

/* A deterministic pseudo-random float in [-1, 1). */
static float frand(uint64_t *s)
{
    *s = *s * 6364136223846793005ULL + 1442695040888963407ULL;
    return (float)((double)(*s >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

static float *get_param(const mha_module *m, const char *name, int64_t *numel)
{
    mha_param_info info;
    assert_int_equal(mha_param_info_by_name(m, name, &info), MHA_OK);
    float *p = malloc((size_t)info.numel * sizeof(float));
    assert_non_null(p);
    assert_int_equal(mha_param_get(m, name, p, info.numel), MHA_OK);
    if (numel)
        *numel = info.numel;
    return p;
}

/* Every parameter, concatenated in table order. */
static float *snapshot(const mha_module *m, int64_t *total)
{
    int64_t n = 0;
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(m, k, &info), MHA_OK);
        n += info.numel;
    }
    float *all = malloc((size_t)n * sizeof(float));
    assert_non_null(all);
    int64_t off = 0;
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(m, k, &info), MHA_OK);
        assert_int_equal(mha_param_get(m, info.name, all + off, info.numel),
                         MHA_OK);
        off += info.numel;
    }
    *total = n;
    return all;
}

static void assert_same_params(const mha_module *m, const float *before,
                               int64_t n)
{
    int64_t n2;
    float *now = snapshot(m, &n2);
    assert_int_equal(n, n2);
    assert_memory_equal(before, now, (size_t)n * sizeof(float));
    free(now);
}

/* ---- configuration ------------------------------------------------------ */

/* mha_create must refuse `c` with `status`, a message naming `needle`,
 * and *out set to NULL. */
static void expect_bad_config(const mha_config *c, mha_status status,
                              const char *needle)
{
    mha_module *m = (mha_module *)(uintptr_t)0x1234;   /* must be cleared */
    assert_fails(mha_create(c, &m), status, needle);
    assert_null(m);
}

static void test_config_invalid(void **state)
{
    (void)state;
    mha_config c;

    expect_bad_config(NULL, MHA_ERR_NULL_POINTER, "config");

    c = cfg(8, 2);
    assert_fails(mha_create(&c, NULL), MHA_ERR_NULL_POINTER, "handle");

    c = cfg(0, 2);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "embed_dim");
    c = cfg(-8, 2);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "embed_dim");
    c = cfg(8, 0);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "num_heads");
    c = cfg(8, -2);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "num_heads");
    c = cfg(10, 4);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "divisible");
    c = cfg(8, 16);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "divisible");

    c = cfg(8, 2);
    c.kdim = -1;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "kdim");
    c = cfg(8, 2);
    c.vdim = -3;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "vdim");
    c = cfg(8, 2);
    c.v_head_dim = -1;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "v_head_dim");
    c.v_head_dim = INT32_MAX;   /* H d_v past the GEMMs' int widths */
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "v_head_dim");

    c = cfg(8, 2);
    c.dropout = -0.1f;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "dropout");
    c.dropout = 1.5f;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "dropout");
    c.dropout = NAN;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "dropout");
    c.dropout = INFINITY;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "dropout");

    c = cfg(8, 2);
    c.scale = NAN;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "scale");
    c.scale = INFINITY;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "scale");
    c.scale = -INFINITY;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "scale");

    /* Widths beyond what CBLAS's int dimensions can take. */
    c = cfg((int64_t)INT32_MAX + 1, 1);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "embed_dim");
    c = cfg(INT64_MAX, 1);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "embed_dim");
    c = cfg(8, 2);
    c.kdim = (int64_t)INT32_MAX + 1;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "kdim");
    c = cfg(8, 2);
    c.vdim = INT64_MAX;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "vdim");

    /* E = 2^31 - 1 fits an int, but the fused q|k|v projection's 3E
     * columns do not: refused at config time, before any size product
     * (3E * E would not even fit int64). */
    c = cfg(INT32_MAX, 1);
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "fused q|k|v");
    /* With kdim != E the q/k/v weights are separate, but the same GEMM
     * widths apply. */
    c = cfg(INT32_MAX, 1);
    c.kdim = 3;
    expect_bad_config(&c, MHA_ERR_INVALID_CONFIG, "fused q|k|v");
    /* The largest E whose 3E columns fit: configured, then too large to
     * allocate (3E * E floats), and reported. */
    c = cfg(INT32_MAX / 3, 1);
    {
        mha_module *m = (mha_module *)(uintptr_t)0x1234;
        mha_status st = mha_create(&c, &m);
        assert_true(st == MHA_ERR_OVERFLOW || st == MHA_ERR_OUT_OF_MEMORY);
        assert_null(m);
        assert_true(strlen(mha_last_error()) > 0);
    }
    /* 2^28: ~2^58 floats (2^60 bytes) fit int64 and size_t but no address
     * space: the allocation fails and is reported. */
    c = cfg((int64_t)1 << 28, 1);
    expect_bad_config(&c, MHA_ERR_OUT_OF_MEMORY, "allocate");
}

static void test_config_valid_edges(void **state)
{
    (void)state;
    mha_config c = cfg(8, 8);   /* d_h = 1 */
    c.dropout = 1.0f;           /* both ends of [0, 1] are valid */
    mha_module *m = make(&c);
    mha_free(m);
    c = cfg(8, 1);
    c.dropout = 0.0f;
    c.scale = -0.5f;            /* any finite nonzero scale is kept */
    m = make(&c);
    mha_config r;
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_true(r.scale == -0.5f);
    mha_free(m);
}

static void test_config_defaults(void **state)
{
    (void)state;
    mha_config c = cfg(48, 4);
    c.no_bias = 5;   /* nonzero flags are normalised to 1 */
    c.add_bias_kv = 7;
    c.add_zero_attn = -1;
    c.dropout = 0.25f;
    c.seed = 99;
    mha_module *m = make(&c);
    mha_config r;
    memset(&r, 0xab, sizeof r);
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_int_equal(r.embed_dim, 48);
    assert_int_equal(r.num_heads, 4);
    assert_int_equal(r.kdim, 48);
    assert_int_equal(r.vdim, 48);
    float expect = (float)(1.0 / sqrt(12.0));
    assert_true(r.scale == expect);
    assert_true(r.dropout == 0.25f);
    assert_int_equal(r.seed, 99);
    assert_int_equal(r.no_bias, 1);
    assert_int_equal(r.add_bias_kv, 1);
    assert_int_equal(r.add_zero_attn, 1);
    assert_fails(mha_get_config(m, NULL), MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_get_config(NULL, &r), MHA_ERR_NULL_POINTER, "module");
    mha_free(m);

    /* Given kdim, vdim and scale are kept. */
    c = cfg(32, 2);
    c.kdim = 7;
    c.vdim = 5;
    c.scale = 0.3f;
    m = make(&c);
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_int_equal(r.kdim, 7);
    assert_int_equal(r.vdim, 5);
    assert_true(r.scale == 0.3f);
    mha_free(m);

    /* d_h = 1: scale 1. */
    c = cfg(6, 6);
    m = make(&c);
    assert_int_equal(mha_get_config(m, &r), MHA_OK);
    assert_true(r.scale == 1.0f);
    mha_free(m);
}

/* ---- the parameter table ------------------------------------------------ */

typedef struct expect_param {
    const char *name;
    int ndim;
    int64_t shape[3];
} expect_param;

static void check_table(const mha_module *m, const expect_param *want, int n)
{
    assert_int_equal(mha_param_count(m), n);
    for (int k = 0; k < n; k++) {
        mha_param_info info;
        memset(&info, 0, sizeof info);
        assert_int_equal(mha_param_info_at(m, k, &info), MHA_OK);
        assert_non_null(info.name);
        if (strcmp(info.name, want[k].name) != 0)
            fail_msg("parameter %d is %s, expected %s", k, info.name,
                     want[k].name);
        assert_int_equal(info.ndim, want[k].ndim);
        int64_t numel = 1;
        for (int d = 0; d < want[k].ndim; d++) {
            assert_int_equal(info.shape[d], want[k].shape[d]);
            numel *= want[k].shape[d];
        }
        assert_int_equal(info.numel, numel);

        mha_param_info by;
        assert_int_equal(mha_param_info_by_name(m, want[k].name, &by), MHA_OK);
        assert_string_equal(by.name, want[k].name);
        assert_int_equal(by.ndim, info.ndim);
        assert_int_equal(by.numel, info.numel);
        for (int d = 0; d < info.ndim; d++)
            assert_int_equal(by.shape[d], info.shape[d]);
    }
    mha_param_info info;
    assert_fails(mha_param_info_at(m, n, &info), MHA_ERR_INVALID_ARGUMENT,
                 "index");
    assert_fails(mha_param_info_at(m, -1, &info), MHA_ERR_INVALID_ARGUMENT,
                 "index");
    assert_fails(mha_param_info_at(m, 0, NULL), MHA_ERR_NULL_POINTER, "NULL");
}

static void test_table_packed(void **state)
{
    (void)state;
    mha_module *m = make_simple(12, 3, 0, 0, 0, 0, 1);
    const expect_param want[] = {
        {"in_proj_weight", 2, {36, 12, 0}},
        {"in_proj_bias", 1, {36, 0, 0}},
        {"out_proj.weight", 2, {12, 12, 0}},
        {"out_proj.bias", 1, {12, 0, 0}},
    };
    check_table(m, want, 4);
    mha_free(m);
    /* kdim = vdim = E given explicitly is the packed layout too. */
    m = make_simple(12, 3, 12, 12, 0, 0, 1);
    check_table(m, want, 4);
    mha_free(m);
}

static void test_table_no_bias(void **state)
{
    (void)state;
    mha_module *m = make_simple(12, 3, 0, 0, 1, 0, 1);
    const expect_param want[] = {
        {"in_proj_weight", 2, {36, 12, 0}},
        {"out_proj.weight", 2, {12, 12, 0}},
    };
    check_table(m, want, 2);
    mha_param_info info;
    assert_fails(mha_param_info_by_name(m, "in_proj_bias", &info),
                 MHA_ERR_NOT_FOUND, "in_proj_bias");
    assert_fails(mha_param_info_by_name(m, "out_proj.bias", &info),
                 MHA_ERR_NOT_FOUND, "out_proj.bias");
    mha_free(m);
}

static void test_table_separate(void **state)
{
    (void)state;
    mha_module *m = make_simple(12, 3, 5, 7, 0, 0, 1);
    const expect_param want[] = {
        {"q_proj_weight", 2, {12, 12, 0}},
        {"k_proj_weight", 2, {12, 5, 0}},
        {"v_proj_weight", 2, {12, 7, 0}},
        {"in_proj_bias", 1, {36, 0, 0}},
        {"out_proj.weight", 2, {12, 12, 0}},
        {"out_proj.bias", 1, {12, 0, 0}},
    };
    check_table(m, want, 6);
    mha_param_info info;
    assert_fails(mha_param_info_by_name(m, "in_proj_weight", &info),
                 MHA_ERR_NOT_FOUND, "in_proj_weight");
    mha_free(m);

    /* Only vdim differs: still separate (PyTorch's _qkv_same_embed_dim). */
    m = make_simple(12, 3, 0, 4, 1, 0, 1);
    const expect_param want2[] = {
        {"q_proj_weight", 2, {12, 12, 0}},
        {"k_proj_weight", 2, {12, 12, 0}},
        {"v_proj_weight", 2, {12, 4, 0}},
        {"out_proj.weight", 2, {12, 12, 0}},
    };
    check_table(m, want2, 4);
    mha_free(m);
}

static void test_table_bias_kv(void **state)
{
    (void)state;
    mha_module *m = make_simple(12, 3, 0, 0, 0, 1, 1);
    const expect_param want[] = {
        {"in_proj_weight", 2, {36, 12, 0}},
        {"in_proj_bias", 1, {36, 0, 0}},
        {"bias_k", 3, {1, 1, 12}},
        {"bias_v", 3, {1, 1, 12}},
        {"out_proj.weight", 2, {12, 12, 0}},
        {"out_proj.bias", 1, {12, 0, 0}},
    };
    check_table(m, want, 6);
    mha_free(m);

    /* All of it: separate weights, bias_kv, no bias. */
    m = make_simple(12, 3, 5, 7, 1, 1, 1);
    const expect_param want2[] = {
        {"q_proj_weight", 2, {12, 12, 0}},
        {"k_proj_weight", 2, {12, 5, 0}},
        {"v_proj_weight", 2, {12, 7, 0}},
        {"bias_k", 3, {1, 1, 12}},
        {"bias_v", 3, {1, 1, 12}},
        {"out_proj.weight", 2, {12, 12, 0}},
    };
    check_table(m, want2, 6);
    mha_free(m);
}

static void test_table_lookup_errors(void **state)
{
    (void)state;
    mha_module *m = make_simple(8, 2, 0, 0, 0, 0, 1);
    mha_param_info info;
    float buf[8];
    assert_fails(mha_param_info_by_name(m, "no_such_weight", &info),
                 MHA_ERR_NOT_FOUND, "no_such_weight");
    assert_fails(mha_param_get(m, "out_proj.weigh", buf, 8),
                 MHA_ERR_NOT_FOUND, "out_proj.weigh");
    assert_fails(mha_param_set(m, "bias_k", buf, 8), MHA_ERR_NOT_FOUND,
                 "bias_k");
    assert_fails(mha_param_info_by_name(m, NULL, &info),
                 MHA_ERR_NULL_POINTER, "name");
    assert_fails(mha_param_info_by_name(NULL, "in_proj_bias", &info),
                 MHA_ERR_NULL_POINTER, "module");
    assert_fails(mha_param_info_by_name(m, "in_proj_bias", NULL),
                 MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_param_info_at(NULL, 0, &info), MHA_ERR_NULL_POINTER,
                 "module");
    assert_int_equal(mha_param_count(NULL), 0);
    mha_free(m);
}

/* ---- get / set ---------------------------------------------------------- */

static void test_param_roundtrip(void **state)
{
    (void)state;
    mha_module *m = make_simple(16, 4, 6, 10, 0, 1, 3);
    uint64_t s = 42;
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(m, k, &info), MHA_OK);
        float *src = malloc((size_t)info.numel * sizeof(float));
        float *dst = malloc((size_t)info.numel * sizeof(float));
        for (int64_t i = 0; i < info.numel; i++)
            src[i] = frand(&s) * 100.0f;
        src[0] = -0.0f;       /* bit patterns survive */
        src[info.numel - 1] = 3.0e38f;
        assert_int_equal(mha_param_set(m, info.name, src, info.numel), MHA_OK);
        memset(dst, 0x5a, (size_t)info.numel * sizeof(float));
        assert_int_equal(mha_param_get(m, info.name, dst, info.numel), MHA_OK);
        assert_memory_equal(src, dst, (size_t)info.numel * sizeof(float));
        free(src);
        free(dst);
    }
    /* Setting one parameter left the others as they were set. */
    int64_t n;
    float *all = snapshot(m, &n);
    float one[16];
    for (int i = 0; i < 16; i++)
        one[i] = (float)i;
    assert_int_equal(mha_param_set(m, "out_proj.bias", one, 16), MHA_OK);
    float *after = snapshot(m, &n);
    assert_memory_equal(all, after, (size_t)(n - 16) * sizeof(float));
    assert_memory_equal(after + n - 16, one, sizeof one);
    free(all);
    free(after);
    mha_free(m);
}

/* mha_param_data is the memory mha_param_get reads and mha_param_set
 * writes, each parameter at its offset; a write through it is what the
 * next forward uses. */
static void test_param_data(void **state)
{
    (void)state;
    assert_null(mha_param_data(NULL));
    mha_module *m = make_simple(16, 4, 16, 16, 0, 1, 3);
    float *data = mha_param_data(m);
    assert_non_null(data);
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        assert_int_equal(mha_param_info_at(m, k, &info), MHA_OK);
        float *got = malloc((size_t)info.numel * sizeof(float));
        assert_int_equal(mha_param_get(m, info.name, got, info.numel), MHA_OK);
        assert_memory_equal(got, data + info.offset,
                            (size_t)info.numel * sizeof(float));
        free(got);
    }
    mha_param_info ob;
    assert_int_equal(mha_param_info_by_name(m, "out_proj.bias", &ob), MHA_OK);
    float x[2 * 16], y0[2 * 16], y1[2 * 16], y2[2 * 16];
    uint64_t s = 7;
    for (int i = 0; i < 2 * 16; i++)
        x[i] = frand(&s);
    mha_forward_args a = {.batch = 1, .q_len = 2, .query = x};
    a.out = y0;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    data[ob.offset + 3] += 1.0f;           /* out_proj.bias[3] += 1 */
    a.out = y1;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    for (int i = 0; i < 2; i++)
        for (int e = 0; e < 16; e++)
            assert_float_equal(y1[i * 16 + e],
                               y0[i * 16 + e] + (e == 3 ? 1.0f : 0.0f), 1e-6);
    float b[16];
    assert_int_equal(mha_param_get(m, "out_proj.bias", b, 16), MHA_OK);
    assert_memory_equal(b, data + ob.offset, sizeof b);
    a.out = y2;
    assert_int_equal(mha_forward(m, &a), MHA_OK);
    assert_memory_equal(y1, y2, sizeof y1);
    mha_free(m);
}

static void test_param_set_errors(void **state)
{
    (void)state;
    mha_module *m = make_simple(32, 4, 0, 0, 0, 1, 5);
    int64_t n;
    float *before = snapshot(m, &n);
    int64_t numel;
    float *w = get_param(m, "in_proj_weight", &numel);
    assert_int_equal(numel, 3 * 32 * 32);
    for (int64_t i = 0; i < numel; i++)
        w[i] = 0.5f;

    /* Wrong element counts: refused, module unchanged. */
    assert_fails(mha_param_set(m, "in_proj_weight", w, numel - 1),
                 MHA_ERR_SHAPE, "in_proj_weight");
    assert_msg_has("3072");
    assert_fails(mha_param_set(m, "in_proj_weight", w, numel + 1),
                 MHA_ERR_SHAPE, "in_proj_weight");
    assert_fails(mha_param_get(m, "in_proj_weight", w, 32 * 32),
                 MHA_ERR_SHAPE, "in_proj_weight");
    assert_fails(mha_param_set(m, "in_proj_weight", NULL, numel),
                 MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_param_get(m, "in_proj_weight", NULL, numel),
                 MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_param_set(NULL, "in_proj_weight", w, numel),
                 MHA_ERR_NULL_POINTER, "module");
    /* A negative count is a wrong count, not "unchecked" (it used to reach
     * memcpy as a huge size_t). */
    assert_fails(mha_param_set(m, "in_proj_weight", w, -1), MHA_ERR_SHAPE,
                 "in_proj_weight");
    assert_fails(mha_param_get(m, "out_proj.bias", w, -1), MHA_ERR_SHAPE,
                 "out_proj.bias");
    assert_fails(mha_param_get(m, "out_proj.bias", w, INT64_MIN),
                 MHA_ERR_SHAPE, "out_proj.bias");
    assert_fails(mha_param_set(m, "bias_v", NULL, -5), MHA_ERR_SHAPE,
                 "bias_v");
    assert_same_params(m, before, n);

    /* One non-finite value anywhere: refused, naming the parameter and the
     * index, and nothing is copied (not even the finite prefix). */
    w[1234] = NAN;
    assert_fails(mha_param_set(m, "in_proj_weight", w, numel),
                 MHA_ERR_NON_FINITE, "in_proj_weight");
    assert_msg_has("1234");
    assert_same_params(m, before, n);
    w[1234] = 0.5f;
    w[numel - 1] = INFINITY;
    assert_fails(mha_param_set(m, "in_proj_weight", w, numel),
                 MHA_ERR_NON_FINITE, "in_proj_weight");
    assert_msg_has("3071");
    assert_same_params(m, before, n);

    float bk[32];
    for (int i = 0; i < 32; i++)
        bk[i] = 1.0f;
    bk[17] = -INFINITY;
    assert_fails(mha_param_set(m, "bias_k", bk, 32), MHA_ERR_NON_FINITE,
                 "bias_k");
    assert_msg_has("17");
    assert_same_params(m, before, n);

    free(w);
    free(before);
    mha_free(m);
}

/* ---- Xavier initialisation ---------------------------------------------- */

static void test_init_seeded(void **state)
{
    (void)state;
    mha_module *a = make_simple(24, 4, 0, 0, 0, 1, 1234);
    mha_module *b = make_simple(24, 4, 0, 0, 0, 1, 1234);
    mha_module *c = make_simple(24, 4, 0, 0, 0, 1, 1235);
    int64_t na, nb, nc;
    float *pa = snapshot(a, &na), *pb = snapshot(b, &nb), *pc = snapshot(c, &nc);
    assert_int_equal(na, nb);
    assert_memory_equal(pa, pb, (size_t)na * sizeof(float));

    /* A different seed changes every random parameter almost everywhere. */
    const char *random_params[] = {"in_proj_weight", "bias_k", "bias_v",
                                   "out_proj.weight"};
    for (size_t k = 0; k < 4; k++) {
        int64_t n;
        float *x = get_param(a, random_params[k], &n);
        float *y = get_param(c, random_params[k], &n);
        int64_t same = 0;
        for (int64_t i = 0; i < n; i++)
            same += x[i] == y[i];
        if (same > n / 100)
            fail_msg("%s: %lld of %lld values equal across seeds",
                     random_params[k], (long long)same, (long long)n);
        free(x);
        free(y);
    }

    /* Seeds that differ only in their high bits give different values:
     * all 64 bits of the seed count. */
    const uint64_t seed_pairs[3][2] = {{1, 1 + ((uint64_t)1 << 32)},
                                       {0, (uint64_t)1 << 63},
                                       {1234, 1234 + ((uint64_t)1 << 48)}};
    for (int k = 0; k < 3; k++) {
        mha_module *x = make_simple(8, 2, 0, 0, 0, 0, seed_pairs[k][0]);
        mha_module *y = make_simple(8, 2, 0, 0, 0, 0, seed_pairs[k][1]);
        int64_t n;
        float *wx = get_param(x, "in_proj_weight", &n);
        float *wy = get_param(y, "in_proj_weight", &n);
        if (memcmp(wx, wy, (size_t)n * sizeof(float)) == 0)
            fail_msg("seeds %llu and %llu give the same weights",
                     (unsigned long long)seed_pairs[k][0],
                     (unsigned long long)seed_pairs[k][1]);
        free(wx);
        free(wy);
        mha_free(x);
        mha_free(y);
    }

    /* reset_parameters(seed) reproduces mha_create's values exactly. */
    float junk[24];
    for (int i = 0; i < 24; i++)
        junk[i] = 7.0f;
    assert_int_equal(mha_param_set(c, "out_proj.bias", junk, 24), MHA_OK);
    assert_int_equal(mha_param_set(c, "bias_v", junk, 24), MHA_OK);
    assert_int_equal(mha_reset_parameters(c, 1234), MHA_OK);
    assert_same_params(c, pa, na);
    mha_config rc;
    assert_int_equal(mha_get_config(c, &rc), MHA_OK);
    assert_int_equal(rc.seed, 1234);
    assert_int_equal(mha_reset_parameters(c, 1235), MHA_OK);
    assert_same_params(c, pc, nc);
    assert_fails(mha_reset_parameters(NULL, 1), MHA_ERR_NULL_POINTER,
                 "module");

    /* The weights do not depend on which other parameters exist. */
    mha_module *d = make_simple(24, 4, 0, 0, 1, 0, 1234);
    int64_t n;
    float *x = get_param(a, "in_proj_weight", &n);
    float *y = get_param(d, "in_proj_weight", &n);
    assert_memory_equal(x, y, (size_t)n * sizeof(float));
    free(x);
    free(y);

    free(pa);
    free(pb);
    free(pc);
    mha_free(a);
    mha_free(b);
    mha_free(c);
    mha_free(d);
}

/* Checks that `name` is U(-bound, bound): every value inside, the extremes
 * reaching near the bound, mean ~0 and variance bound^2/3 within `tol`. */
static void check_uniform(const mha_module *m, const char *name, double bound,
                          double tol)
{
    int64_t n;
    float *w = get_param(m, name, &n);
    double sum = 0, sq = 0, mx = 0;
    for (int64_t i = 0; i < n; i++) {
        double v = w[i];
        if (!(fabs(v) <= bound * (1 + 1e-6)))
            fail_msg("%s[%lld] = %g outside +-%g", name, (long long)i, v,
                     bound);
        sum += v;
        sq += v * v;
        if (fabs(v) > mx)
            mx = fabs(v);
    }
    double mean = sum / (double)n;
    double var = sq / (double)n - mean * mean;
    double want = bound * bound / 3.0;
    if (fabs(var / want - 1.0) > tol)
        fail_msg("%s: variance %g, expected %g (+-%g%%)", name, var, want,
                 tol * 100);
    /* sd of the mean is bound/sqrt(3n); allow 5 sd */
    if (fabs(mean) > 5.0 * bound / sqrt(3.0 * (double)n))
        fail_msg("%s: mean %g too far from 0", name, mean);
    if (mx < 0.95 * bound)
        fail_msg("%s: largest |value| %g, expected close to %g", name, mx,
                 bound);
    free(w);
}

static void check_zero(const mha_module *m, const char *name)
{
    int64_t n;
    float *w = get_param(m, name, &n);
    for (int64_t i = 0; i < n; i++)
        if (w[i] != 0.0f)
            fail_msg("%s[%lld] = %g, expected 0", name, (long long)i,
                     (double)w[i]);
    free(w);
}

static void test_init_xavier_packed(void **state)
{
    (void)state;
    const double E = 256;
    mha_module *m = make_simple(256, 8, 0, 0, 0, 0, 2024);
    /* [3E, E] as one matrix: fan_in = E, fan_out = 3E (PyTorch). */
    check_uniform(m, "in_proj_weight", sqrt(6.0 / (E + 3 * E)), 0.03);
    check_uniform(m, "out_proj.weight", sqrt(6.0 / (2 * E)), 0.03);
    check_zero(m, "in_proj_bias");
    check_zero(m, "out_proj.bias");

    /* reset to another seed keeps the biases zero even after a set. */
    float *ones = malloc(3 * 256 * sizeof(float));
    for (int i = 0; i < 3 * 256; i++)
        ones[i] = 1.0f;
    assert_int_equal(mha_param_set(m, "in_proj_bias", ones, 768), MHA_OK);
    assert_int_equal(mha_reset_parameters(m, 5), MHA_OK);
    check_zero(m, "in_proj_bias");
    free(ones);
    mha_free(m);
}

static void test_init_xavier_separate(void **state)
{
    (void)state;
    const double E = 64, kd = 32, vd = 96;
    mha_module *m = make_simple(64, 4, 32, 96, 0, 0, 77);
    check_uniform(m, "q_proj_weight", sqrt(6.0 / (E + E)), 0.10);
    check_uniform(m, "k_proj_weight", sqrt(6.0 / (E + kd)), 0.10);
    check_uniform(m, "v_proj_weight", sqrt(6.0 / (E + vd)), 0.10);
    check_uniform(m, "out_proj.weight", sqrt(6.0 / (E + E)), 0.10);
    check_zero(m, "in_proj_bias");
    check_zero(m, "out_proj.bias");
    mha_free(m);
}

/* bias_k / bias_v: Xavier normal on (1, 1, E), fan_in = fan_out = E, so
 * N(0, 1/E).  Pooled over seeds for a large sample at a small E. */
static void test_init_bias_kv_normal(void **state)
{
    (void)state;
    const int64_t E = 512;
    const int seeds = 16;
    const double sd = sqrt(1.0 / (double)E);
    const char *names[] = {"bias_k", "bias_v"};
    for (int w = 0; w < 2; w++) {
        double sum = 0, sq = 0, quad = 0;
        int64_t n = 0, within1 = 0, beyond2_5 = 0;
        for (int s = 0; s < seeds; s++) {
            mha_module *m = make_simple(E, 8, 0, 0, 1, 1, 1000 + (uint64_t)s);
            int64_t k;
            float *x = get_param(m, names[w], &k);
            for (int64_t i = 0; i < k; i++) {
                double v = x[i];
                assert_true(isfinite(v));
                sum += v;
                sq += v * v;
                quad += v * v * v * v;
                within1 += fabs(v) <= sd;
                beyond2_5 += fabs(v) > 2.5 * sd;
            }
            n += k;
            free(x);
            mha_free(m);
        }
        double mean = sum / (double)n;
        double std = sqrt(sq / (double)n - mean * mean);
        if (fabs(std / sd - 1.0) > 0.05)
            fail_msg("%s: sample std %g, expected %g", names[w], std, sd);
        if (fabs(mean) > 5.0 * sd / sqrt((double)n))
            fail_msg("%s: mean %g", names[w], mean);
        /* Normal, not uniform: kurtosis ~3 (uniform 1.8), 68% within 1 sd
         * (uniform of that sd: 58%), ~1.2% beyond 2.5 sd (uniform: 0). */
        double kurt = (quad / (double)n) / ((sq / (double)n) * (sq / (double)n));
        if (fabs(kurt - 3.0) > 0.3)
            fail_msg("%s: kurtosis %g, expected 3", names[w], kurt);
        double f1 = (double)within1 / (double)n;
        if (fabs(f1 - 0.6827) > 0.02)
            fail_msg("%s: %g within 1 sd, expected 0.683", names[w], f1);
        double f25 = (double)beyond2_5 / (double)n;
        if (f25 < 0.006 || f25 > 0.02)
            fail_msg("%s: %g beyond 2.5 sd, expected 0.0124", names[w], f25);
    }
    /* bias_k and bias_v are different streams. */
    mha_module *m = make_simple(E, 8, 0, 0, 1, 1, 9);
    int64_t k;
    float *x = get_param(m, "bias_k", &k);
    float *y = get_param(m, "bias_v", &k);
    int64_t same = 0;
    for (int64_t i = 0; i < k; i++)
        same += x[i] == y[i];
    assert_true(same < 5);
    free(x);
    free(y);
    mha_free(m);
}

/* ---- mha_project -------------------------------------------------------- */

/* y = x W^T + b, in double, from the module's own parameters. */
static void ref_linear(const float *x, int64_t rows, int64_t n_in,
                       const float *w, const float *b, int64_t n_out,
                       double *y)
{
    for (int64_t r = 0; r < rows; r++)
        for (int64_t o = 0; o < n_out; o++) {
            double acc = b ? (double)b[o] : 0.0;
            for (int64_t i = 0; i < n_in; i++)
                acc += (double)x[r * n_in + i] * (double)w[o * n_in + i];
            y[r * n_out + o] = acc;
        }
}

/* mha_project_backward of projection `which` at x (rows, n_in) against
 * float64 sums written here: dx = dy W, dW = dy^T x, db = column sums of
 * dy, at their places in the gradient layout (the weight's and bias's
 * offsets; every other entry untouched); accumulate and dx_accumulate add
 * the same again; the same bits on 1 and 3 threads. */
static void check_project_backward(const mha_module *m, mha_projection which,
                                   int64_t rows, int64_t n_in, int64_t n_out,
                                   const float *w, int has_bias,
                                   const float *x, uint64_t *s)
{
    static const char *const wname[4][2] = {
        {"q_proj_weight", "in_proj_weight"}, {"k_proj_weight",
                                              "in_proj_weight"},
        {"v_proj_weight", "in_proj_weight"}, {"out_proj.weight",
                                              "out_proj.weight"}};
    mha_config c;
    mha_get_config(m, &c);
    const int packed = c.kdim == c.embed_dim && c.vdim == c.embed_dim;
    mha_param_info wi, bi;
    assert_int_equal(mha_param_info_by_name(m, wname[which][packed], &wi),
                     MHA_OK);
    const int64_t D = c.num_heads * c.head_dim;
    int64_t woff = wi.offset, boff = -1;
    if (which != MHA_PROJ_OUT && packed)
        woff += (int64_t)which * D * c.embed_dim;
    if (has_bias) {
        assert_int_equal(mha_param_info_by_name(
                             m, which == MHA_PROJ_OUT ? "out_proj.bias"
                                                      : "in_proj_bias", &bi),
                         MHA_OK);
        boff = bi.offset + (which == MHA_PROJ_OUT ? 0 : (int64_t)which * D);
    }
    const int64_t np = mha_param_numel(m);
    float *dy = malloc((size_t)(rows * n_out) * sizeof(float));
    float *dx = malloc((size_t)(rows * n_in) * sizeof(float));
    float *dx3 = malloc((size_t)(rows * n_in) * sizeof(float));
    float *g = malloc((size_t)np * sizeof(float));
    float *g3 = malloc((size_t)np * sizeof(float));
    for (int64_t i = 0; i < rows * n_out; i++)
        dy[i] = frand(s);
    for (int64_t i = 0; i < np; i++)
        g[i] = g3[i] = -99.0f;
    assert_int_equal(mha_project_backward(m, which, x, rows, dy, dx, 0, g, 0,
                                          1), MHA_OK);
    assert_int_equal(mha_project_backward(m, which, x, rows, dy, dx3, 0, g3,
                                          0, 3), MHA_OK);
    assert_memory_equal(dx, dx3, (size_t)(rows * n_in) * sizeof(float));
    assert_memory_equal(g, g3, (size_t)np * sizeof(float));
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < n_in; i++) {
            double ref = 0.0;
            for (int64_t o = 0; o < n_out; o++)
                ref += (double)dy[r * n_out + o] * w[o * n_in + i];
            if (fabs(dx[r * n_in + i] - ref) > 1e-5 * (1.0 + fabs(ref)))
                fail_msg("project_backward %d: dx[%lld] = %.9g, expected "
                         "%.9g", (int)which, (long long)(r * n_in + i),
                         (double)dx[r * n_in + i], ref);
        }
    for (int64_t k = 0; k < np; k++) {
        double ref;
        if (k >= woff && k < woff + n_out * n_in) {
            const int64_t o = (k - woff) / n_in, i = (k - woff) % n_in;
            ref = 0.0;
            for (int64_t r = 0; r < rows; r++)
                ref += (double)dy[r * n_out + o] * x[r * n_in + i];
        } else if (has_bias && k >= boff && k < boff + n_out) {
            ref = 0.0;
            for (int64_t r = 0; r < rows; r++)
                ref += dy[r * n_out + (k - boff)];
        } else {
            if (g[k] != -99.0f)
                fail_msg("project_backward %d: gradient entry %lld outside "
                         "the projection's written", (int)which,
                         (long long)k);
            continue;
        }
        if (fabs(g[k] - ref) > 1e-5 * (1.0 + fabs(ref)))
            fail_msg("project_backward %d: gradient entry %lld = %.9g, "
                     "expected %.9g", (int)which, (long long)k, (double)g[k],
                     ref);
    }
    /* accumulating: the same sums added, so exactly twice (or -99 twice
     * away from nothing where nothing is written) -- where the backend
     * forms each sum before adding it, as OpenBLAS does at these sizes.
     * oneDNN's kernels may add each term to the destination instead (its
     * one-row kernel does here; which others do depends on the CPU):
     * twice within the sums' rounding (docs/semantics.md, "GEMM
     * backends"). */
    memcpy(g3, g, (size_t)np * sizeof(float));
    memcpy(dx3, dx, (size_t)(rows * n_in) * sizeof(float));
    assert_int_equal(mha_project_backward(m, which, x, rows, dy, dx3, 1, g3,
                                          1, 2), MHA_OK);
    const int exact = !strcmp(mha_gemm_backend(), "cblas");
    for (int64_t i = 0; i < rows * n_in; i++)
        if (exact ? dx3[i] != 2.0f * dx[i]
                  : !(fabsf(dx3[i] - 2.0f * dx[i]) <=
                      1e-5f * (1.0f + fabsf(dx[i]))))
            fail_msg("project_backward %d accumulated: dx[%lld] = %.9g, "
                     "expected %s2 x %.9g", (int)which, (long long)i,
                     (double)dx3[i], exact ? "" : "about ", (double)dx[i]);
    for (int64_t k = 0; k < np; k++)
        if (g[k] == -99.0f ? g3[k] != -99.0f
            : exact        ? g3[k] != 2.0f * g[k]
                           : !(fabsf(g3[k] - 2.0f * g[k]) <=
                               1e-5f * (1.0f + fabsf(g[k]))))
            fail_msg("project_backward %d accumulated: gradient entry %lld "
                     "= %.9g, expected %s2 x %.9g", (int)which, (long long)k,
                     (double)g3[k], exact ? "" : "about ", (double)g[k]);
    free(dy);
    free(dx);
    free(dx3);
    free(g);
    free(g3);
}

/* head_dim 0: E / H; otherwise the heads' width D = H * head_dim, and the
 * input projections map to D columns, the output projection from D. */
static void check_projections(int64_t E, int64_t H, int64_t kdim,
                              int64_t vdim, int no_bias, int64_t head_dim)
{
    mha_config c = cfg(E, H);
    c.kdim = kdim;
    c.vdim = vdim;
    c.no_bias = no_bias;
    c.seed = 31;
    c.head_dim = head_dim;
    mha_module *m = make(&c);
    assert_int_equal(mha_get_config(m, &c), MHA_OK);
    kdim = c.kdim;
    vdim = c.vdim;
    const int64_t D = H * c.head_dim;
    uint64_t s = 7;
    /* Nonzero biases, so that a wrong bias slice shows. */
    float *bias_in = NULL, *bias_out = NULL;
    if (!no_bias) {
        bias_in = malloc((size_t)(3 * D) * sizeof(float));
        bias_out = malloc((size_t)E * sizeof(float));
        for (int64_t i = 0; i < 3 * D; i++)
            bias_in[i] = frand(&s);
        for (int64_t i = 0; i < E; i++)
            bias_out[i] = frand(&s);
        assert_int_equal(mha_param_set(m, "in_proj_bias", bias_in, 3 * D),
                         MHA_OK);
        assert_int_equal(mha_param_set(m, "out_proj.bias", bias_out, E),
                         MHA_OK);
    }
    const int packed = kdim == E && vdim == E;
    float *win = NULL, *wq, *wk, *wv;
    if (packed) {
        win = get_param(m, "in_proj_weight", NULL);
        wq = win;
        wk = win + D * E;
        wv = win + 2 * D * E;
    } else {
        wq = get_param(m, "q_proj_weight", NULL);
        wk = get_param(m, "k_proj_weight", NULL);
        wv = get_param(m, "v_proj_weight", NULL);
    }
    float *wo = get_param(m, "out_proj.weight", NULL);

    /* 5 rows, then one: a single row is a matrix-vector product (gemv
     * in the cblas backend, an M = 1 GEMM in oneDNN's) */
    for (int64_t rows = 5; rows >= 1; rows -= 4) {
    const struct {
        mha_projection which;
        int64_t n_in, n_out;
        const float *w, *b;
    } cases[4] = {
        {MHA_PROJ_QUERY, E, D, wq, bias_in},
        {MHA_PROJ_KEY, kdim, D, wk, bias_in ? bias_in + D : NULL},
        {MHA_PROJ_VALUE, vdim, D, wv, bias_in ? bias_in + 2 * D : NULL},
        {MHA_PROJ_OUT, D, E, wo, bias_out},
    };
    for (int k = 0; k < 4; k++) {
        const int64_t n_in = cases[k].n_in, n_out = cases[k].n_out;
        float *x = malloc((size_t)(rows * n_in) * sizeof(float));
        float *y = malloc((size_t)(rows * n_out + 1) * sizeof(float));
        double *ref = malloc((size_t)(rows * n_out) * sizeof(double));
        for (int64_t i = 0; i < rows * n_in; i++)
            x[i] = frand(&s) * 2.0f;
        y[rows * n_out] = 12345.0f;   /* guard past the end */
        assert_int_equal(mha_project(m, cases[k].which, x, rows, y), MHA_OK);
        assert_true(y[rows * n_out] == 12345.0f);
        ref_linear(x, rows, n_in, cases[k].w, cases[k].b, n_out, ref);
        for (int64_t i = 0; i < rows * n_out; i++) {
            double err = fabs((double)y[i] - ref[i]);
            if (err > 1e-5 * (1.0 + fabs(ref[i])))
                fail_msg("projection %d (E=%lld kdim=%lld vdim=%lld): y[%lld]"
                         " = %.9g, expected %.9g", (int)cases[k].which,
                         (long long)E, (long long)kdim, (long long)vdim,
                         (long long)i, (double)y[i], ref[i]);
        }
        check_project_backward(m, cases[k].which, rows, n_in, n_out,
                               cases[k].w, cases[k].b != NULL, x, &s);
        free(x);
        free(y);
        free(ref);
    }
    }
    if (packed) {
        free(win);
    } else {
        free(wq);
        free(wk);
        free(wv);
    }
    free(wo);
    free(bias_in);
    free(bias_out);
    mha_free(m);
}

static void test_project_values(void **state)
{
    (void)state;
    check_projections(16, 4, 8, 12, 0, 0);   /* kdim, vdim != E */
    check_projections(16, 4, 24, 5, 1, 0);   /* no bias */
    check_projections(16, 2, 0, 0, 0, 0);    /* packed in_proj_weight */
    check_projections(12, 3, 0, 7, 0, 0);    /* only vdim differs */
    check_projections(16, 3, 0, 0, 0, 2);    /* D = 6 < E, packed */
    check_projections(8, 2, 5, 0, 0, 7);     /* D = 14 > E, separate */
}

static void test_project_errors(void **state)
{
    (void)state;
    mha_module *m = make_simple(8, 2, 0, 0, 0, 0, 1);
    float x[16], y[16];
    for (int i = 0; i < 16; i++) {
        x[i] = 1.0f;
        y[i] = -7.0f;
    }
    assert_fails(mha_project(NULL, MHA_PROJ_QUERY, x, 2, y),
                 MHA_ERR_NULL_POINTER, "module");
    assert_fails(mha_project(m, MHA_PROJ_QUERY, NULL, 2, y),
                 MHA_ERR_NULL_POINTER, "x");
    assert_fails(mha_project(m, MHA_PROJ_QUERY, x, 2, NULL),
                 MHA_ERR_NULL_POINTER, "y");
    assert_fails(mha_project(m, MHA_PROJ_KEY, x, 0, y), MHA_ERR_SHAPE,
                 "rows");
    assert_fails(mha_project(m, MHA_PROJ_VALUE, x, -3, y), MHA_ERR_SHAPE,
                 "rows");
    assert_fails(mha_project(m, (mha_projection)4, x, 2, y),
                 MHA_ERR_INVALID_ARGUMENT, "projection");
    assert_fails(mha_project(m, (mha_projection)-1, x, 2, y),
                 MHA_ERR_INVALID_ARGUMENT, "projection");
    assert_fails(mha_project(m, MHA_PROJ_OUT, x, INT64_MAX / 2, y),
                 MHA_ERR_OVERFLOW, "rows");
    for (int i = 0; i < 16; i++)
        assert_true(y[i] == -7.0f);
    /* its backward: the same refusals, and num_threads */
    assert_fails(mha_project_backward(NULL, MHA_PROJ_QUERY, x, 2, y, y, 0,
                                      NULL, 0, 0),
                 MHA_ERR_NULL_POINTER, "module");
    assert_fails(mha_project_backward(m, MHA_PROJ_QUERY, NULL, 2, y, y, 0,
                                      NULL, 0, 0),
                 MHA_ERR_NULL_POINTER, "x");
    assert_fails(mha_project_backward(m, MHA_PROJ_QUERY, x, 2, NULL, y, 0,
                                      NULL, 0, 0),
                 MHA_ERR_NULL_POINTER, "dy");
    assert_fails(mha_project_backward(m, MHA_PROJ_KEY, x, 0, y, y, 0, NULL,
                                      0, 0),
                 MHA_ERR_SHAPE, "rows");
    assert_fails(mha_project_backward(m, (mha_projection)4, x, 2, y, y, 0,
                                      NULL, 0, 0),
                 MHA_ERR_INVALID_ARGUMENT, "projection");
    assert_fails(mha_project_backward(m, MHA_PROJ_OUT, x, INT64_MAX / 2, y,
                                      y, 0, NULL, 0, 0),
                 MHA_ERR_OVERFLOW, "rows");
    assert_fails(mha_project_backward(m, MHA_PROJ_OUT, x, 2, y, y, 0, NULL,
                                      0, -1),
                 MHA_ERR_INVALID_ARGUMENT, "num_threads");
    for (int i = 0; i < 16; i++)
        assert_true(y[i] == -7.0f);
    mha_free(m);
}

/* ---- mha_forward argument validation ------------------------------------ */

enum { FB = 2, FLQ = 3, FLK = 4, FE = 8, FH = 2, FKD = 6, FVD = 5 };
#define OUT_N (FB * FLQ * FE)
#define W_N (FB * FH * FLQ * (FLK + 2))
static const float SENTINEL = -12345.0f;

typedef struct fwd_fixture {
    mha_module *m;        /* E = 8, H = 2, kdim 6, vdim 5 */
    mha_module *self;     /* E = 8, H = 2, packed */
    float query[FB * FLQ * FE];
    float key[FB * FLK * FKD];
    float value[FB * FLK * FVD];
    float out[OUT_N];
    float weights[W_N];
    uint8_t bmask[FB * FH * FLQ * FLK];
    float amask[FB * FH * FLQ * FLK];
    int64_t lengths[FB];
} fwd_fixture;

static int fwd_setup(void **state)
{
    fwd_fixture *f = calloc(1, sizeof *f);
    if (!f)
        return -1;
    mha_config c = cfg(FE, FH);
    c.kdim = FKD;
    c.vdim = FVD;
    if (mha_create(&c, &f->m) != MHA_OK)
        return -1;
    c = cfg(FE, FH);
    if (mha_create(&c, &f->self) != MHA_OK)
        return -1;
    uint64_t s = 3;
    for (size_t i = 0; i < sizeof f->query / sizeof(float); i++)
        f->query[i] = frand(&s);
    for (size_t i = 0; i < sizeof f->key / sizeof(float); i++)
        f->key[i] = frand(&s);
    for (size_t i = 0; i < sizeof f->value / sizeof(float); i++)
        f->value[i] = frand(&s);
    for (int b = 0; b < FB; b++)
        f->lengths[b] = FLK;
    *state = f;
    return 0;
}

static int fwd_teardown(void **state)
{
    fwd_fixture *f = *state;
    mha_free(f->m);
    mha_free(f->self);
    free(f);
    return 0;
}

/* Valid cross-attention arguments for f->m. */
static mha_forward_args fwd_args(fwd_fixture *f)
{
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = FB;
    a.q_len = FLQ;
    a.kv_len = FLK;
    a.query = f->query;
    a.key = f->key;
    a.value = f->value;
    a.out = f->out;
    /* Weights asked for too, so that every failure also shows whether
     * attn_weights was written. */
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = f->weights;
    for (int i = 0; i < OUT_N; i++)
        f->out[i] = SENTINEL;
    for (int i = 0; i < W_N; i++)
        f->weights[i] = SENTINEL;
    memset(f->bmask, 0, sizeof f->bmask);
    memset(f->amask, 0, sizeof f->amask);
    return a;
}

static void assert_untouched(const fwd_fixture *f)
{
    for (int i = 0; i < OUT_N; i++)
        if (memcmp(&f->out[i], &SENTINEL, sizeof(float)) != 0)
            fail_msg("out[%d] was written on a failed call", i);
    for (int i = 0; i < W_N; i++)
        if (memcmp(&f->weights[i], &SENTINEL, sizeof(float)) != 0)
            fail_msg("attn_weights[%d] was written on a failed call", i);
}

#define expect_fwd_fail(mod, args, status, needle)                          \
    do {                                                                    \
        assert_fails(mha_forward((mod), (args)), status, needle);           \
        assert_untouched(f);                                                \
    } while (0)

static void test_forward_valid_baseline(void **state)
{
    fwd_fixture *f = *state;
    /* The arguments the failure tests start from are accepted. */
    mha_forward_args a = fwd_args(f);
    assert_int_equal(mha_forward(f->m, &a), MHA_OK);
    for (int i = 0; i < OUT_N; i++)
        assert_true(isfinite(f->out[i]) && f->out[i] != SENTINEL);
}

static void test_forward_null_and_sizes(void **state)
{
    fwd_fixture *f = *state;
    mha_forward_args a = fwd_args(f);
    expect_fwd_fail(NULL, &a, MHA_ERR_NULL_POINTER, "module");
    expect_fwd_fail(f->m, NULL, MHA_ERR_NULL_POINTER, "args");
    a.query = NULL;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "query");
    a = fwd_args(f);
    a.out = NULL;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "out");

    a = fwd_args(f);
    a.batch = 0;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "batch");
    a.batch = -1;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "batch");
    a = fwd_args(f);
    a.q_len = 0;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "q_len");
    a = fwd_args(f);
    a.kv_len = -1;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "kv_len");
    /* A key of its own and kv_len 0: its length is not the query's to
     * guess (it was read as q_len rows). */
    a = fwd_args(f);
    a.kv_len = 0;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE,
                    "key is given (and is not the query) but kv_len is 0");

    /* key NULL means key = query, whose width is E, not kdim. */
    a = fwd_args(f);
    a.key = NULL;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "kdim");
    /* value NULL means value = key, whose width is kdim, not vdim. */
    a = fwd_args(f);
    a.value = NULL;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "vdim");
    /* Self-attention with a kv_len that is not q_len. */
    a = fwd_args(f);
    a.key = a.value = NULL;
    expect_fwd_fail(f->self, &a, MHA_ERR_SHAPE, "kv_len");

    a = fwd_args(f);
    a.need_weights = MHA_WEIGHTS_AVERAGE;
    a.attn_weights = NULL;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "attn_weights");
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "attn_weights");
    /* A weights buffer with no weights asked for: refused, not ignored. */
    a.need_weights = MHA_WEIGHTS_NONE;
    a.attn_weights = f->weights;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT,
                    "need_weights is MHA_WEIGHTS_NONE");
}

static void test_forward_bad_enums(void **state)
{
    fwd_fixture *f = *state;
    mha_forward_args a = fwd_args(f);
    a.need_weights = (mha_weights_mode)7;
    a.attn_weights = f->weights;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "need_weights");
    a = fwd_args(f);
    a.causal = (mha_causal)9;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "causal");
    a = fwd_args(f);
    a.causal = (mha_causal)-1;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "causal");
    a = fwd_args(f);
    a.attn_mask.kind = (mha_mask_kind)9;
    a.attn_mask.data = f->bmask;
    a.attn_mask.ndim = 2;
    a.attn_mask.shape[0] = FLQ;
    a.attn_mask.shape[1] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "attn_mask");
    assert_msg_has("kind");
    a = fwd_args(f);
    a.key_padding_mask.kind = (mha_mask_kind)9;
    a.key_padding_mask.data = f->bmask;
    a.key_padding_mask.ndim = 1;
    a.key_padding_mask.shape[0] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "key_padding_mask");
    assert_msg_has("kind");
}

static void test_forward_attn_mask_shapes(void **state)
{
    fwd_fixture *f = *state;
    mha_forward_args a = fwd_args(f);
    a.attn_mask.kind = MHA_MASK_BLOCK;
    a.attn_mask.data = NULL;
    a.attn_mask.ndim = 2;
    a.attn_mask.shape[0] = FLQ;
    a.attn_mask.shape[1] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "attn_mask");
    assert_msg_has("NULL");
    a.attn_mask.kind = MHA_MASK_ADDITIVE;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "attn_mask");

    const mha_mask good2 = {MHA_MASK_ALLOW, f->bmask, 2, {FLQ, FLK, 0, 0}};
    memset(f->bmask, 1, sizeof f->bmask);
    a = fwd_args(f);
    memset(f->bmask, 1, sizeof f->bmask);
    a.attn_mask = good2;
    assert_int_equal(mha_forward(f->m, &a), MHA_OK);   /* the base is valid */

    a = fwd_args(f);
    a.attn_mask = good2;
    a.attn_mask.ndim = 1;
    a.attn_mask.shape[0] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "dimensions");
    a.attn_mask.ndim = 5;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "dimensions");
    a.attn_mask.ndim = 0;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "dimensions");

    /* Wrong (Lq, Lk), for each rank. */
    const int64_t bad_last[3][4] = {
        {FLK, FLQ, 0, 0}, {FB, FLQ, FLK + 1, 0}, {FB, FH, FLQ - 1, FLK}};
    for (int r = 0; r < 3; r++) {
        a = fwd_args(f);
        a.attn_mask = good2;
        a.attn_mask.ndim = r + 2;
        memcpy(a.attn_mask.shape, bad_last[r], sizeof bad_last[r]);
        expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "last dimensions");
    }

    /* Batch dimension neither 1 nor B; head dimension neither 1 nor H. */
    a = fwd_args(f);
    a.attn_mask = good2;
    a.attn_mask.ndim = 3;
    a.attn_mask.shape[0] = FB + 1;
    a.attn_mask.shape[1] = FLQ;
    a.attn_mask.shape[2] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "batch dimension");
    a.attn_mask.ndim = 4;
    a.attn_mask.shape[0] = FB * FH;   /* PyTorch's (B*H, ...) is not ours */
    a.attn_mask.shape[1] = 1;
    a.attn_mask.shape[2] = FLQ;
    a.attn_mask.shape[3] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "batch dimension");
    a.attn_mask.shape[0] = 1;
    a.attn_mask.shape[1] = FH + 1;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "head dimension");
    a.attn_mask.shape[0] = FB;
    a.attn_mask.shape[1] = 0;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "head dimension");

    /* Broadcast forms are accepted. */
    const int64_t ok_shapes[4][4] = {
        {1, FLQ, FLK, 0}, {FB, FLQ, FLK, 0}, {1, 1, FLQ, FLK},
        {FB, FH, FLQ, FLK}};
    const int ok_nd[4] = {3, 3, 4, 4};
    for (int k = 0; k < 4; k++) {
        a = fwd_args(f);
        memset(f->bmask, 1, sizeof f->bmask);
        a.attn_mask = good2;
        a.attn_mask.ndim = ok_nd[k];
        memcpy(a.attn_mask.shape, ok_shapes[k], sizeof ok_shapes[k]);
        assert_int_equal(mha_forward(f->m, &a), MHA_OK);
    }
}

static void test_forward_padding_and_lengths(void **state)
{
    fwd_fixture *f = *state;
    mha_forward_args a = fwd_args(f);
    a.key_padding_mask.kind = MHA_MASK_BLOCK;
    a.key_padding_mask.data = f->bmask;
    a.key_padding_mask.ndim = 2;
    a.key_padding_mask.shape[0] = FB;
    a.key_padding_mask.shape[1] = FLK - 1;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "key_padding_mask");
    assert_msg_has("Lk");
    a.key_padding_mask.ndim = 1;
    a.key_padding_mask.shape[0] = FLK + 1;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "key_padding_mask");
    a.key_padding_mask.ndim = 2;
    a.key_padding_mask.shape[0] = FB + 1;
    a.key_padding_mask.shape[1] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "batch dimension");
    a.key_padding_mask.ndim = 3;
    a.key_padding_mask.shape[0] = FB;
    a.key_padding_mask.shape[1] = FLQ;
    a.key_padding_mask.shape[2] = FLK;
    expect_fwd_fail(f->m, &a, MHA_ERR_SHAPE, "key_padding_mask");
    a.key_padding_mask.ndim = 1;
    a.key_padding_mask.shape[0] = FLK;
    a.key_padding_mask.data = NULL;
    expect_fwd_fail(f->m, &a, MHA_ERR_NULL_POINTER, "key_padding_mask");

    a = fwd_args(f);
    a.key_lengths = f->lengths;
    f->lengths[1] = -1;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "key_lengths");
    f->lengths[1] = FLK + 1;
    expect_fwd_fail(f->m, &a, MHA_ERR_INVALID_ARGUMENT, "key_lengths");
    f->lengths[1] = 0;                    /* both ends are valid */
    f->lengths[0] = FLK;
    assert_int_equal(mha_forward(f->m, &a), MHA_OK);
    f->lengths[1] = FLK;
}

static void test_forward_additive_non_finite(void **state)
{
    fwd_fixture *f = *state;
    const mha_mask am = {MHA_MASK_ADDITIVE, f->amask, 4, {FB, FH, FLQ, FLK}};
    const int last = FB * FH * FLQ * FLK - 1;

    mha_forward_args a = fwd_args(f);
    a.attn_mask = am;
    f->amask[last] = NAN;
    expect_fwd_fail(f->m, &a, MHA_ERR_NON_FINITE, "attn_mask");
    a = fwd_args(f);
    a.attn_mask = am;
    f->amask[7] = INFINITY;
    expect_fwd_fail(f->m, &a, MHA_ERR_NON_FINITE, "attn_mask");
    assert_msg_has("7");

    /* -inf blocks; large finite values are fine. */
    a = fwd_args(f);
    a.attn_mask = am;
    f->amask[0] = -INFINITY;
    f->amask[1] = 3.0e38f;
    f->amask[2] = -3.0e38f;
    assert_int_equal(mha_forward(f->m, &a), MHA_OK);
    for (int i = 0; i < OUT_N; i++)
        assert_true(isfinite(f->out[i]));

    const mha_mask kp = {MHA_MASK_ADDITIVE, f->amask, 2, {FB, FLK, 0, 0}};
    a = fwd_args(f);
    a.key_padding_mask = kp;
    f->amask[FB * FLK - 1] = NAN;
    expect_fwd_fail(f->m, &a, MHA_ERR_NON_FINITE, "key_padding_mask");
    a = fwd_args(f);
    a.key_padding_mask = kp;
    f->amask[0] = -INFINITY;
    assert_int_equal(mha_forward(f->m, &a), MHA_OK);
}

static void test_forward_overflow(void **state)
{
    fwd_fixture *f = *state;
    /* Products that do not fit in 64 bits: refused before any memory is
     * touched (the buffers are tiny). */
    mha_forward_args a = fwd_args(f);
    a.batch = (int64_t)1 << 40;
    a.q_len = (int64_t)1 << 40;
    a.kv_len = 0;
    a.key = a.value = NULL;
    expect_fwd_fail(f->self, &a, MHA_ERR_OVERFLOW, "overflow");
    a = fwd_args(f);
    a.batch = 1;
    a.q_len = (int64_t)1 << 32;
    a.kv_len = (int64_t)1 << 32;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = f->weights;
    a.key_padding_mask.kind = MHA_MASK_ADDITIVE;  /* never scanned */
    a.key_padding_mask.data = f->amask;
    a.key_padding_mask.ndim = 1;
    a.key_padding_mask.shape[0] = a.kv_len;
    expect_fwd_fail(f->m, &a, MHA_ERR_OVERFLOW, "B=");
    a = fwd_args(f);
    a.batch = INT64_MAX;
    a.q_len = INT64_MAX;
    a.kv_len = INT64_MAX;
    expect_fwd_fail(f->m, &a, MHA_ERR_OVERFLOW, "B=");
    /* Lk + the bias_kv and zero keys past INT64_MAX. */
    {
        mha_config c = cfg(FE, FH);
        c.add_bias_kv = 1;
        c.add_zero_attn = 1;
        mha_module *kv = make(&c);
        a = fwd_args(f);
        a.batch = 1;
        a.q_len = 1;
        a.kv_len = INT64_MAX;
        a.key = a.value = f->query;
        expect_fwd_fail(kv, &a, MHA_ERR_OVERFLOW, "B=");
        mha_free(kv);
    }
    /* Fits in 64 bits but not in memory: too large, still untouched. */
    a = fwd_args(f);
    a.batch = (int64_t)1 << 20;
    a.q_len = (int64_t)1 << 20;
    a.kv_len = 0;
    a.key = a.value = NULL;
    expect_fwd_fail(f->self, &a, MHA_ERR_OVERFLOW, "B=");
}

/* ---- status strings, version, small functions --------------------------- */

static void test_status_strings(void **state)
{
    (void)state;
    const char *s[13];
    for (int k = 0; k <= 12; k++) {
        s[k] = mha_status_string((mha_status)k);
        assert_non_null(s[k]);
        assert_true(strlen(s[k]) > 0);
        for (int j = 0; j < k; j++)
            if (strcmp(s[j], s[k]) == 0)
                fail_msg("status %d and %d share the string \"%s\"", j, k,
                         s[k]);
    }
    assert_non_null(mha_status_string((mha_status)13));
    assert_non_null(mha_status_string((mha_status)-1));
    assert_non_null(mha_status_string((mha_status)1000));
    /* The pinned values. */
    assert_int_equal(MHA_OK, 0);
    assert_int_equal(MHA_ERR_NULL_POINTER, 1);
    assert_int_equal(MHA_ERR_INVALID_CONFIG, 2);
    assert_int_equal(MHA_ERR_INVALID_ARGUMENT, 3);
    assert_int_equal(MHA_ERR_SHAPE, 4);
    assert_int_equal(MHA_ERR_OVERFLOW, 5);
    assert_int_equal(MHA_ERR_OUT_OF_MEMORY, 6);
    assert_int_equal(MHA_ERR_NOT_FOUND, 7);
    assert_int_equal(MHA_ERR_NON_FINITE, 8);
    assert_int_equal(MHA_ERR_IO, 9);
    assert_int_equal(MHA_ERR_FORMAT, 10);
    assert_int_equal(MHA_ERR_UNSUPPORTED, 11);
    assert_int_equal(MHA_ERR_COMM, 12);
}

static void test_version(void **state)
{
    (void)state;
    char want[64];
    snprintf(want, sizeof want, "%d.%d.%d", MHA_VERSION_MAJOR,
             MHA_VERSION_MINOR, MHA_VERSION_PATCH);
    assert_non_null(mha_version_string());
    assert_string_equal(mha_version_string(), want);
    assert_int_equal(mha_version_number(), MHA_VERSION_NUMBER);
    assert_int_equal(MHA_VERSION_NUMBER, MHA_VERSION_MAJOR * 10000 +
                                             MHA_VERSION_MINOR * 100 +
                                             MHA_VERSION_PATCH);
}

static void test_free_null_and_total_keys(void **state)
{
    (void)state;
    mha_free(NULL);
    for (int bkv = 0; bkv < 2; bkv++)
        for (int zero = 0; zero < 2; zero++) {
            mha_config c = cfg(8, 2);
            c.add_bias_kv = bkv;
            c.add_zero_attn = zero;
            mha_module *m = make(&c);
            assert_int_equal(mha_total_keys(m, 5), 5 + bkv + zero);
            assert_int_equal(mha_total_keys(m, 0), bkv + zero);
            assert_int_equal(mha_total_keys(m, -1), -1);
            assert_msg_has("kv_len -1");
            /* The extra keys must not overflow int64 (UB) into garbage. */
            assert_int_equal(mha_total_keys(m, INT64_MAX),
                             bkv + zero ? -1 : INT64_MAX);
            mha_free(m);
        }
    assert_int_equal(mha_total_keys(NULL, 5), -1);
    assert_msg_has("module is NULL");
}

/* ---- the error message is thread-local ---------------------------------- */

typedef struct thread_result {
    pthread_barrier_t *barrier;
    char initial[64];     /* the message before this thread failed */
    mha_status st;
    char own[256];        /* right after its own failure */
    char later[256];      /* after the other thread failed too */
} thread_result;

static void *fail_on_thread(void *arg)
{
    thread_result *r = arg;
    snprintf(r->initial, sizeof r->initial, "%s", mha_last_error());
    mha_config c = cfg(8, 3);    /* not divisible */
    mha_module *m = NULL;
    r->st = mha_create(&c, &m);
    snprintf(r->own, sizeof r->own, "%s", mha_last_error());
    pthread_barrier_wait(r->barrier);   /* 1: both threads have failed */
    pthread_barrier_wait(r->barrier);   /* 2: main failed again */
    snprintf(r->later, sizeof r->later, "%s", mha_last_error());
    return NULL;
}

static void test_error_thread_local(void **state)
{
    (void)state;
    mha_module *m = make_simple(8, 2, 0, 0, 0, 0, 1);
    float buf[8];
    assert_fails(mha_param_get(m, "main_thread_name", buf, 8),
                 MHA_ERR_NOT_FOUND, "main_thread_name");

    pthread_barrier_t barrier;
    assert_int_equal(pthread_barrier_init(&barrier, NULL, 2), 0);
    thread_result r;
    memset(&r, 0, sizeof r);
    r.barrier = &barrier;
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, fail_on_thread, &r), 0);
    pthread_barrier_wait(&barrier);   /* 1 */
    /* The other thread's failure left this thread's message alone. */
    assert_msg_has("main_thread_name");
    assert_null(strstr(mha_last_error(), "divisible"));
    mha_config c = cfg(-1, 2);
    mha_module *bad = NULL;
    assert_fails(mha_create(&c, &bad), MHA_ERR_INVALID_CONFIG, "embed_dim");
    pthread_barrier_wait(&barrier);   /* 2 */
    assert_int_equal(pthread_join(t, NULL), 0);
    pthread_barrier_destroy(&barrier);

    assert_string_equal(r.initial, "");   /* a fresh thread: no message */
    assert_int_equal(r.st, MHA_ERR_INVALID_CONFIG);
    assert_non_null(strstr(r.own, "divisible"));
    assert_string_equal(r.later, r.own);  /* main's failure did not leak */
    assert_msg_has("embed_dim");
    mha_free(m);
}

int main(void)
{
    if (tu_backend_unavailable())
        return TU_SKIP;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_invalid),
        cmocka_unit_test(test_config_valid_edges),
        cmocka_unit_test(test_config_defaults),
        cmocka_unit_test(test_table_packed),
        cmocka_unit_test(test_table_no_bias),
        cmocka_unit_test(test_table_separate),
        cmocka_unit_test(test_table_bias_kv),
        cmocka_unit_test(test_table_lookup_errors),
        cmocka_unit_test(test_param_roundtrip),
        cmocka_unit_test(test_param_data),
        cmocka_unit_test(test_param_set_errors),
        cmocka_unit_test(test_init_seeded),
        cmocka_unit_test(test_init_xavier_packed),
        cmocka_unit_test(test_init_xavier_separate),
        cmocka_unit_test(test_init_bias_kv_normal),
        cmocka_unit_test(test_project_values),
        cmocka_unit_test(test_project_errors),
        cmocka_unit_test_setup_teardown(test_forward_valid_baseline,
                                        fwd_setup, fwd_teardown),
        cmocka_unit_test_setup_teardown(test_forward_null_and_sizes,
                                        fwd_setup, fwd_teardown),
        cmocka_unit_test_setup_teardown(test_forward_bad_enums, fwd_setup,
                                        fwd_teardown),
        cmocka_unit_test_setup_teardown(test_forward_attn_mask_shapes,
                                        fwd_setup, fwd_teardown),
        cmocka_unit_test_setup_teardown(test_forward_padding_and_lengths,
                                        fwd_setup, fwd_teardown),
        cmocka_unit_test_setup_teardown(test_forward_additive_non_finite,
                                        fwd_setup, fwd_teardown),
        cmocka_unit_test_setup_teardown(test_forward_overflow, fwd_setup,
                                        fwd_teardown),
        cmocka_unit_test(test_status_strings),
        cmocka_unit_test(test_version),
        cmocka_unit_test(test_free_null_and_total_keys),
        cmocka_unit_test(test_error_thread_local),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
