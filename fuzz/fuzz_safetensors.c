/*
 * fuzz_safetensors.c -- fuzz target for the safetensors reader
 * (mha_safetensors_parse).
 *
 * Built two ways:
 *   - with -fsanitize=fuzzer,address,undefined
 *     (cmake -DMHA_FUZZ=ON -DCMAKE_C_COMPILER=clang; see fuzz/CMakeLists.txt),
 *     libFuzzer supplies main():
 *         build-fuzz/fuzz/fuzz_safetensors -max_total_time=180 \
 *             NEW_DIR fuzz/corpus/safetensors
 *   - without it (every build), fuzz/replay_main.c runs each file given, or
 *     every file in each directory given, through the same target; CTest's
 *     fuzz_replay_safetensors replays fuzz/corpus/safetensors.
 *
 * Besides "no crash, no leak, no undefined behaviour", the target checks
 * the reader's contract and traps if it is broken: on failure *out is NULL
 * and there is a message; on success every tensor is consistent (a unique
 * name that find() returns, ndim in range, numel = product of the shape,
 * data present, bools 0 / 1), the tensors' bytes fit in the input, and the
 * metadata lookups return strings.
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

static size_t file_size(mha_dtype dt)
{
    switch (dt) {
    case MHA_DTYPE_F32: case MHA_DTYPE_I32: return 4;
    case MHA_DTYPE_F64: case MHA_DTYPE_I64: return 8;
    case MHA_DTYPE_F16: case MHA_DTYPE_BF16: return 2;
    case MHA_DTYPE_BOOL: return 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    mha_tensor_file *f = (mha_tensor_file *)(uintptr_t)1;
    mha_status st = mha_safetensors_parse(data, size, &f);
    if (st != MHA_OK) {
        check(f == NULL);
        check(mha_last_error()[0] != 0);
        return 0;
    }
    check(f != NULL);
    const int n = mha_tensor_file_count(f);
    check(n >= 0);
    check(mha_tensor_file_at(f, -1) == NULL);
    check(mha_tensor_file_at(f, n) == NULL);
    uint64_t bytes = 0;
    for (int k = 0; k < n; k++) {
        const mha_tensor *t = mha_tensor_file_at(f, k);
        check(t != NULL && t->name != NULL && t->data != NULL);
        check(mha_tensor_file_find(f, t->name) == t);   /* names unique */
        check(t->ndim >= 0 && t->ndim <= MHA_MAX_NDIM);
        const size_t es = file_size(t->dtype);
        check(es != 0);
        int64_t numel = 1;
        for (int d = 0; d < t->ndim; d++) {
            check(t->shape[d] >= 0);
            /* numel <= size, so this product cannot overflow unless a
             * later dimension is 0 -- then numel is 0 anyway. */
            numel = t->shape[d] == 0 ? 0 : numel * t->shape[d];
        }
        check(numel == t->numel);
        bytes += (uint64_t)numel * es;
        check(bytes <= size);
        /* Touch every converted element (uninitialised memory would show
         * under MSan / valgrind). */
        if (t->dtype == MHA_DTYPE_BOOL) {
            const uint8_t *b = t->data;
            for (int64_t i = 0; i < numel; i++)
                check(b[i] <= 1);
        } else if (t->dtype == MHA_DTYPE_I32 || t->dtype == MHA_DTYPE_I64) {
            const int64_t *v = t->data;
            volatile int64_t acc = 0;
            for (int64_t i = 0; i < numel; i++)
                acc ^= v[i];
            if (t->dtype == MHA_DTYPE_I32)
                for (int64_t i = 0; i < numel; i++)
                    check(v[i] >= INT32_MIN && v[i] <= INT32_MAX);
            (void)acc;
        } else {
            const float *v = t->data;
            volatile float acc = 0;
            for (int64_t i = 0; i < numel; i++)
                acc += v[i] * 0.0f;
            (void)acc;
        }
    }
    check(mha_tensor_file_find(f, "__metadata__") == NULL);
    static const char *const keys[] = {"format", "num_heads", "embed_dim",
                                       "kdim", "vdim", "", "__metadata__"};
    for (size_t k = 0; k < sizeof keys / sizeof *keys; k++) {
        const char *v = mha_tensor_file_metadata(f, keys[k]);
        if (v)
            check(strlen(v) < size);
    }
    mha_tensor_file_free(f);
    return 0;
}
