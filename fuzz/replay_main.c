/*
 * replay_main.c -- the main() of every fuzz target built without libFuzzer:
 * runs each file given, or each regular file in each directory given,
 * through LLVMFuzzerTestOneInput.  The test suite uses it to replay the
 * committed corpora (fuzz/corpus/<target>/) on every run.
 */
#define _POSIX_C_SOURCE 200809L
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
/* libFuzzer calls a target's LLVMFuzzerInitialize, when it has one, once
 * before the first input; so does the replay (weak: most targets have
 * none). */
int LLVMFuzzerInitialize(int *argc, char ***argv) __attribute__((weak));

static const char *prog = "replay";
/* MHA_REPLAY_NAMES in the environment: each input's path on stderr before
 * it runs, so that a check that traps names its input (scripts/test.sh's
 * seeded mutants: the name and the seed make it again). */
static int names;

/* Reads the file into an exact-size buffer, so that a read past the end is
 * caught by the sanitizers or valgrind as it would be under libFuzzer. */
static int run_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    struct stat st;
    if (!f || fstat(fileno(f), &st) != 0) {
        fprintf(stderr, "%s: cannot open %s\n", prog, path);
        if (f)
            fclose(f);
        return 1;
    }
    size_t n = (size_t)st.st_size;
    unsigned char *buf = malloc(n ? n : 1);
    int bad = !buf || fread(buf, 1, n, f) != n;
    fclose(f);
    if (bad) {
        fprintf(stderr, "%s: cannot read %s\n", prog, path);
        free(buf);
        return 1;
    }
    if (names)
        fprintf(stderr, "%s: input %s\n", prog, path);
    LLVMFuzzerTestOneInput(buf, n);
    free(buf);
    return 0;
}

int main(int argc, char **argv)
{
    int files = 0, failures = 0;
    prog = argv[0];
    names = getenv("MHA_REPLAY_NAMES") != NULL;
    if (argc < 2) {
        fprintf(stderr, "usage: %s FILE_OR_DIR...\n", prog);
        return 2;
    }
    if (LLVMFuzzerInitialize)
        LLVMFuzzerInitialize(&argc, &argv);
    for (int a = 1; a < argc; a++) {
        struct stat st;
        if (stat(argv[a], &st) == 0 && !S_ISDIR(st.st_mode)) {
            failures += run_file(argv[a]);
            files++;
            continue;
        }
        /* In name order: the same sequence on every file system. */
        struct dirent **list = NULL;
        const int n = scandir(argv[a], &list, NULL, alphasort);
        if (n < 0) {
            fprintf(stderr, "%s: cannot open %s\n", prog, argv[a]);
            failures++;
            continue;
        }
        for (int i = 0; i < n; i++) {
            char path[4096];
            if (list[i]->d_name[0] != '.') {
                snprintf(path, sizeof path, "%s/%s", argv[a],
                         list[i]->d_name);
                if (stat(path, &st) == 0 && S_ISREG(st.st_mode)) {
                    failures += run_file(path);
                    files++;
                }
            }
            free(list[i]);
        }
        free(list);
    }
    printf("%s: replayed %d inputs, %d unreadable\n", prog, files, failures);
    if (files == 0) {
        fprintf(stderr, "%s: no inputs found\n", prog);
        return 1;
    }
    return failures ? 1 : 0;
}
