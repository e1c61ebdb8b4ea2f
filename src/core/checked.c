/*
 * checked.c -- size arithmetic that cannot overflow silently, and the one
 * allocator of float buffers, whose failure names what was being made.
 */
#include "core.h"

#include <stdint.h>
#include <string.h>
#include <stdlib.h>

int mha_mul_ok(int64_t a, int64_t b, int64_t *out)
{
    if (a < 0 || b < 0)
        return 0;
    if (a != 0 && b > INT64_MAX / a)
        return 0;
    *out = a * b;
    return 1;
}

float *mha_alloc_floats(int64_t n, const char *what)
{
    if (n < 0 || (uint64_t)n > SIZE_MAX / sizeof(float)) {
        mha_set_error(MHA_ERR_OVERFLOW, "%s: %lld floats do not fit in memory",
                      what, (long long)n);
        return NULL;
    }
    float *p = malloc(n > 0 ? (size_t)n * sizeof(float) : 1);
    if (!p)
        mha_set_error(MHA_ERR_OUT_OF_MEMORY, "%s: cannot allocate %lld floats "
                      "(%.3g bytes)", what, (long long)n,
                      (double)n * sizeof(float));
    return p;
}

mha_status mha_struct_in(void *copy, size_t copy_size, const void *user,
                         size_t size, const char *type)
{
    memset(copy, 0, copy_size);
    if (!user)
        return MHA_OK;
    if (size == 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s has size 0: pass sizeof the struct (the "
                             "inline calls of mha.h do)", type);
    const unsigned char *u = user;
    for (size_t i = copy_size; i < size; i++)
        if (u[i])
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "%s of %zu bytes sets byte %zu, past the "
                                 "%zu that this libmha (%s) knows: a field "
                                 "of a newer mha.h that this library cannot "
                                 "honour", type, size, i, copy_size,
                                 mha_version_string());
    memcpy(copy, user, size < copy_size ? size : copy_size);
    return MHA_OK;
}

mha_status mha_struct_out_size(const void *user, size_t size,
                               const char *type)
{
    if (user && size == 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s has size 0: pass sizeof the struct (the "
                             "inline calls of mha.h do)", type);
    return MHA_OK;
}
