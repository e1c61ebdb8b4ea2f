#define _POSIX_C_SOURCE 200809L
#include "testutil.h"

#include <dirent.h>
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
