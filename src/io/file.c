/*
 * file.c -- whole-file reads and atomic writes, shared by every format.
 */
#define _POSIX_C_SOURCE 200809L   /* fdopen, fstat, clock_gettime */
#include "io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

mha_status mha_read_file(const char *path, size_t max_size, const char *what,
                         unsigned char **data, size_t *size)
{
    *data = NULL;
    *size = 0;
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s: path is NULL", what);
    FILE *f = fopen(path, "rb");
    if (!f)
        return mha_set_error(MHA_ERR_IO, "%s: cannot open '%s': %s", what,
                             path, strerror(errno));
    struct stat st;
    if (fstat(fileno(f), &st) != 0 || !S_ISREG(st.st_mode)) {
        fclose(f);
        return mha_set_error(MHA_ERR_IO, "%s: '%s' is not a regular file",
                             what, path);
    }
    if ((uint64_t)st.st_size > max_size) {
        fclose(f);
        return mha_set_error(MHA_ERR_FORMAT,
                             "%s: '%s' is %lld bytes, more than the %zu "
                             "allowed", what, path, (long long)st.st_size,
                             max_size);
    }
    const size_t n = (size_t)st.st_size;
    unsigned char *buf = malloc(n + 1);
    if (!buf) {
        fclose(f);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "%s: cannot allocate %zu bytes for '%s'", what,
                             n + 1, path);
    }
    size_t got = fread(buf, 1, n, f);
    int err = ferror(f);
    fclose(f);
    if (got != n || err) {
        free(buf);
        return mha_set_error(MHA_ERR_IO, "%s: short read on '%s'", what,
                             path);
    }
    buf[n] = 0;
    *data = buf;
    *size = n;
    return MHA_OK;
}

/* Creates path.tmp.<random> exclusively, mode 0666 less the umask (as any
 * new file gets).  The name is a hash of the time, the process and a stack
 * address; O_EXCL makes a collision a retry, never a shared file. */
static int create_temp(const char *path, char *tmp, size_t cap)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                 ((uint64_t)getpid() << 16) ^ (uint64_t)(uintptr_t)&ts;
    for (int attempt = 0; attempt < 64; attempt++) {
        x = mha_mix64(x + (uint64_t)attempt);
        snprintf(tmp, cap, "%s.tmp.%012llx", path,
                 (unsigned long long)(x & 0xffffffffffffULL));
        int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd >= 0 || errno != EEXIST)
            return fd;
    }
    return -1;
}

mha_status mha_write_file_atomic(const char *path, const void *const *chunks,
                                 const size_t *sizes, int n)
{
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output path is NULL");
    const size_t cap = strlen(path) + 32;
    char *tmp = malloc(cap);
    if (!tmp)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate a path");
    int fd = create_temp(path, tmp, cap);
    if (fd < 0) {
        mha_status st = mha_set_error(MHA_ERR_IO,
                                      "cannot create a temporary file beside "
                                      "'%s': %s", path, strerror(errno));
        free(tmp);
        return st;
    }
    FILE *f = fdopen(fd, "wb");
    int ok = f != NULL;
    for (int k = 0; ok && k < n; k++)
        ok = sizes[k] == 0 || fwrite(chunks[k], 1, sizes[k], f) == sizes[k];
    if (f) {
        ok = fflush(f) == 0 && ok;
        ok = fclose(f) == 0 && ok;
    } else {
        close(fd);
    }
    if (ok && rename(tmp, path) == 0) {
        free(tmp);
        return MHA_OK;
    }
    mha_status st = mha_set_error(MHA_ERR_IO, "cannot write '%s': %s", path,
                                  strerror(errno));
    remove(tmp);
    free(tmp);
    return st;
}

size_t mha_dtype_size(mha_dtype dtype)
{
    switch (dtype) {
    case MHA_DTYPE_F32: return 4;
    case MHA_DTYPE_F64: return 8;
    case MHA_DTYPE_F16: return 2;
    case MHA_DTYPE_BF16: return 2;
    case MHA_DTYPE_BOOL: return 1;
    case MHA_DTYPE_I32: return 4;
    case MHA_DTYPE_I64: return 8;
    }
    return 0;
}

const char *mha_dtype_name(mha_dtype dtype)
{
    switch (dtype) {
    case MHA_DTYPE_F32: return "F32";
    case MHA_DTYPE_F64: return "F64";
    case MHA_DTYPE_F16: return "F16";
    case MHA_DTYPE_BF16: return "BF16";
    case MHA_DTYPE_BOOL: return "BOOL";
    case MHA_DTYPE_I32: return "I32";
    case MHA_DTYPE_I64: return "I64";
    }
    return "unknown";
}
