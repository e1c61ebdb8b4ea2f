/*
 * fuzz_npy.c -- fuzz target for the .npy reader (mha_npy_parse).
 *
 * Built two ways:
 *   - with -DMHA_LIBFUZZER and -fsanitize=fuzzer,address,undefined
 *     (cmake -DMHA_FUZZ=ON -DCMAKE_C_COMPILER=clang; see fuzz/CMakeLists.txt),
 *     libFuzzer supplies main():
 *         build-fuzz/fuzz/fuzz_npy -max_total_time=180 NEW_DIR fuzz/corpus/npy
 *   - without it (every build), a replay main() runs each file given, or
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

#include "mha.h"

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

#ifndef MHA_LIBFUZZER
#include <dirent.h>
#include <sys/stat.h>

static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "fuzz_npy: cannot open %s\n", path);
        return 1;
    }
    size_t cap = 4096, n = 0;
    unsigned char *buf = malloc(cap);
    for (;;) {
        if (!buf) {
            fclose(f);
            fprintf(stderr, "fuzz_npy: out of memory on %s\n", path);
            return 1;
        }
        n += fread(buf + n, 1, cap - n, f);
        if (n < cap)
            break;
        unsigned char *nb = realloc(buf, cap * 2);
        if (!nb)
            free(buf);
        buf = nb;
        cap *= 2;
    }
    const int err = ferror(f);
    fclose(f);
    if (err) {
        free(buf);
        fprintf(stderr, "fuzz_npy: read error on %s\n", path);
        return 1;
    }
    /* An exact-size copy, so that a read past the end is caught by the
     * sanitizers or valgrind as it would be under libFuzzer. */
    unsigned char *exact = malloc(n ? n : 1);
    if (!exact) {
        free(buf);
        return 1;
    }
    if (n)
        memcpy(exact, buf, n);
    free(buf);
    LLVMFuzzerTestOneInput(exact, n);
    free(exact);
    return 0;
}

int main(int argc, char **argv)
{
    int files = 0, failures = 0;
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE_OR_DIR...\n", argv[0]);
        return 2;
    }
    for (int a = 1; a < argc; a++) {
        struct stat st;
        if (stat(argv[a], &st) != 0) {
            fprintf(stderr, "fuzz_npy: no such file or directory: %s\n",
                    argv[a]);
            failures++;
            continue;
        }
        if (!S_ISDIR(st.st_mode)) {
            failures += run_file(argv[a]);
            files++;
            continue;
        }
        DIR *d = opendir(argv[a]);
        if (!d) {
            fprintf(stderr, "fuzz_npy: cannot open directory %s\n", argv[a]);
            failures++;
            continue;
        }
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            if (e->d_name[0] == '.')
                continue;
            char path[4096];
            snprintf(path, sizeof path, "%s/%s", argv[a], e->d_name);
            if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
                continue;
            failures += run_file(path);
            files++;
        }
        closedir(d);
    }
    printf("fuzz_npy: replayed %d inputs, %d unreadable\n", files, failures);
    if (files == 0) {
        fprintf(stderr, "fuzz_npy: no inputs found\n");
        return 1;
    }
    return failures ? 1 : 0;
}
#endif
