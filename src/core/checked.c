/*
 * checked.c -- size arithmetic that cannot overflow silently, and the one
 * allocator of float buffers, whose failure names what was being made.
 */
#include "core.h"

#include <stdint.h>
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
