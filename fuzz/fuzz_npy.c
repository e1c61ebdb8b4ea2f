/*
 * fuzz_npy.c -- fuzz target for the .npy reader (mha_npy_parse).
 *
 * Built two ways:
 *   - with -fsanitize=fuzzer,address,undefined
 *     (cmake -DMHA_FUZZ=ON -DCMAKE_C_COMPILER=clang; see fuzz/CMakeLists.txt),
 *     libFuzzer supplies main():
 *         build-fuzz/fuzz/fuzz_npy -max_total_time=180 NEW_DIR fuzz/corpus/npy
 *   - without it (every build), fuzz/replay_main.c runs each file given, or
 *     every file in each directory given, through the same target; CTest's
 *     fuzz_replay_npy replays fuzz/corpus/npy so the seeds and any input
 *     that once crashed stay checked.
 *
 * Besides "no crash, no leak, no undefined behaviour", the target checks
 * the reader's contract and traps if it is broken: on success the tensor is
 * consistent (ndim in range, numel = product of the shape, data present,
 * bools 0 / 1); on failure *out is NULL and there is a message.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha_io.h"

static void check(int ok)
{
    if (!ok)
        __builtin_trap();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static mha_tensor sentinel;
    mha_tensor *t = &sentinel;   /* must become NULL or a tensor */
    mha_status st = mha_npy_parse(data, size, &t);
    if (st != MHA_OK) {
        check(t == NULL);
        check(mha_last_error()[0] != 0);
        return 0;
    }
    check(t != NULL && t->data != NULL && t->name != NULL);
    check(t->ndim >= 0 && t->ndim <= MHA_MAX_NDIM);
    int64_t n = 1;
    for (int k = 0; k < t->ndim; k++) {
        check(t->shape[k] >= 0);
        if (t->shape[k] == 0)
            n = 0;
    }
    for (int k = 0; k < t->ndim && n != 0; k++)
        check(!__builtin_mul_overflow(n, t->shape[k], &n));
    check(n == t->numel);
    check((uint64_t)n <= size);   /* never more elements than bytes */
    if (t->dtype == MHA_DTYPE_BOOL) {
        const uint8_t *b = t->data;
        for (int64_t i = 0; i < n; i++)
            check(b[i] <= 1);
    }
    mha_tensor_free(t);
    return 0;
}
