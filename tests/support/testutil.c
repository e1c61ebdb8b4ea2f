#define _POSIX_C_SOURCE 200809L
#include "testutil.h"

#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static uint64_t mix(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void tu_fill(float *x, int64_t n, uint64_t seed, float lo, float hi)
{
    uint64_t s = mix(seed + 0x1234567ULL);
    for (int64_t k = 0; k < n; k++) {
        double u = (double)(mix(s + (uint64_t)k * 0x9e3779b97f4a7c15ULL) >> 11) *
                   0x1.0p-53;
        x[k] = (float)(lo + (hi - lo) * u);
    }
}

mha_module *tu_module(const mha_config *cfg, uint64_t seed)
{
    mha_module *m = NULL;
    if (mha_create(cfg, &m) != MHA_OK)
        return NULL;
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        mha_param_info_at(m, k, &info);
        float *v = malloc((size_t)info.numel * sizeof *v);
        tu_fill(v, info.numel, seed * 131 + (uint64_t)k, -0.6f, 0.6f);
        mha_param_set(m, info.name, v, info.numel);
        free(v);
    }
    return m;
}

int64_t tu_numel(const int64_t *shape, int ndim)
{
    int64_t n = 1;
    for (int k = 0; k < ndim; k++)
        n *= shape[k];
    return n;
}

char tu_tmpdir[256];

int tu_tmpdir_setup(void **state)
{
    (void)state;
    const char *base = getenv("TMPDIR");
    snprintf(tu_tmpdir, sizeof tu_tmpdir, "%s/mha_test_XXXXXX",
             base && *base ? base : "/tmp");
    return mkdtemp(tu_tmpdir) ? 0 : -1;
}

int tu_tmpdir_teardown(void **state)
{
    (void)state;
    DIR *d = opendir(tu_tmpdir);
    if (d) {
        struct dirent *e;
        char p[512];
        while ((e = readdir(d)) != NULL) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
                continue;
            snprintf(p, sizeof p, "%s/%s", tu_tmpdir, e->d_name);
            if (remove(p) != 0)
                rmdir(p);   /* a subdirectory made by a test */
        }
        closedir(d);
    }
    rmdir(tu_tmpdir);
    return 0;
}

void *tu_make_mask(const tu_mask_spec *s, int64_t B, int64_t H, int64_t Lq,
                   int64_t Lk, int is_attn, uint64_t seed, mha_mask *out)
{
    memset(out, 0, sizeof *out);
    if (s->kind == MHA_MASK_NONE)
        return NULL;
    out->kind = s->kind;
    out->ndim = s->ndim;
    int64_t b = s->bcast_b ? 1 : B, h = s->bcast_h ? 1 : H;
    if (is_attn) {
        int64_t shape4[4] = {b, h, Lq, Lk};
        memcpy(out->shape, shape4 + (4 - s->ndim), (size_t)s->ndim * 8);
        if (s->ndim == 3)
            out->shape[0] = b;
    } else {
        out->shape[0] = s->ndim == 2 ? b : Lk;
        out->shape[1] = Lk;
    }
    int64_t n = tu_numel(out->shape, out->ndim);
    float *u = malloc((size_t)n * sizeof *u);
    tu_fill(u, n, seed, 0.0f, 1.0f);
    void *data;
    if (s->kind == MHA_MASK_ADDITIVE) {
        float *v = malloc((size_t)n * sizeof *v);
        float *g = malloc((size_t)n * sizeof *g);
        tu_fill(g, n, seed + 99, -3.0f, 3.0f);
        for (int64_t k = 0; k < n; k++)
            v[k] = u[k] < 0.2f ? -INFINITY : g[k];
        free(g);
        data = v;
    } else {
        uint8_t *v = malloc((size_t)n);
        for (int64_t k = 0; k < n; k++) {
            int blocked = u[k] < 0.3f;
            v[k] = (uint8_t)(s->kind == MHA_MASK_BLOCK ? blocked : !blocked);
        }
        data = v;
    }
    free(u);
    out->data = data;
    return data;
}

int tu_tier_unavailable(void)
{
    const char *want = getenv("MHA_ISA");
    if (!want)
        return 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const int avx2 =
        __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const int avx512 = avx2 && __builtin_cpu_supports("avx512f");
#else
    const int avx2 = 0, avx512 = 0;
#endif
#if defined(__aarch64__)   /* (every aarch64 Linux CPU has Advanced SIMD) */
    const int neon = 1;
#else
    const int neon = 0;
#endif
    if ((!strcmp(want, "avx2") && !avx2) ||
        (!strcmp(want, "avx512") && !avx512) ||
        (!strcmp(want, "neon") && !neon)) {
        printf("skipped: MHA_ISA=%s, which this CPU lacks\n", want);
        return 1;
    }
    return 0;
}

int tu_backend_unavailable(void)
{
    if (tu_tier_unavailable())
        return 1;
    const char *want = getenv("MHA_GEMM");
    if (!want || !*want)
        return 0;
    const char *got = mha_gemm_backend();
    if (!got && !strcmp(want, "onednn")) {
        printf("skipped: MHA_GEMM=onednn in a build without oneDNN\n");
        return 1;
    }
    if (!got || strcmp(got, want)) {
        /* not a skip: the test would run another backend than asked */
        fprintf(stderr, "MHA_GEMM=%s, but the backend is %s\n", want,
                got ? got : mha_last_error());
        exit(1);
    }
    printf("GEMM backend: %s\n", got);
    return 0;
}

void tu_test_tier(void **state)
{
    (void)state;
    const char *want = getenv("MHA_ISA"), *got = mha_kernel_tier();
    assert_non_null(got);
    if (want && *want)
        assert_string_equal(got, want);
    print_message("kernel tier: %s\n", got);
}
