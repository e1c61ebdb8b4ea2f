/*
 * file.c -- whole-file reads and atomic writes, shared by every format.
 */
#define _POSIX_C_SOURCE 200809L   /* fdopen, fstat, clock_gettime */
#include "io.h"

#include <errno.h>
#include <stdatomic.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

mha_status mha_open_regular(const char *path, const char *what, FILE **f)
{
    *f = NULL;
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "%s: path is NULL", what);
    /* O_NONBLOCK: opening a FIFO with no writer returns at once (a plain
     * open would wait for a writer forever); anything not a regular file
     * is then refused before a byte is read. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        return mha_set_error(MHA_ERR_IO, "%s: cannot open '%s': %s", what,
                             path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return mha_set_error(MHA_ERR_IO, "%s: '%s' is not a regular file",
                             what, path);
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl != -1)
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    if (!(*f = fdopen(fd, "rb"))) {
        close(fd);
        return mha_set_error(MHA_ERR_IO, "%s: cannot open '%s': %s", what,
                             path, strerror(errno));
    }
    return MHA_OK;
}

mha_status mha_read_file(const char *path, size_t max_size, const char *what,
                         unsigned char **data, size_t *size)
{
    *data = NULL;
    *size = 0;
    FILE *f;
    MHA_CHECK(mha_open_regular(path, what, &f));
    struct stat st;
    if (fstat(fileno(f), &st) != 0) {
        fclose(f);
        return mha_set_error(MHA_ERR_IO, "%s: cannot stat '%s': %s", what,
                             path, strerror(errno));
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

/* ---- writing -------------------------------------------------------------
 * A save must leave the named file either complete or as it was, and must
 * not change what the name is.  So (mha_write_file_atomic):
 *   - a name that is a symbolic link is followed, link by link, to the
 *     file it names, and that file is written (the link stays a link);
 *   - a name that is a FIFO, a character device or a socket (or a file
 *     reached through /proc: /dev/stdout, /dev/fd/N, /proc/self/fd/N) is
 *     written through, as `cat > name` would (no temporary file, no rename, which
 *     would put a regular file in the node's place); a FIFO with no reader
 *     is refused rather than waited on;
 *   - a regular file with more than one hard link is rewritten in place
 *     (a rename would cut the links): not atomic, said in semantics.md;
 *   - otherwise the bytes go to a temporary file beside the target, which
 *     gets the target's mode and owner, is fsync'ed, and is renamed over
 *     the target; the directory is then fsync'ed.  A failure removes the
 *     temporary file and leaves the target as it was. */

/*
 * The temporary files of the saves in progress, for
 * mha_io_discard_temporaries (a signal handler's): a fixed table of
 * atomic pointers, so registering, unregistering and discarding need no
 * lock and no allocation.  A save registers its temporary path's buffer
 * before creating the file and unregisters it after the rename (a discard
 * in between unlinks a name that no longer exists: harmless) or after
 * removing it.  (A name collision rewrites the buffer with the next
 * candidate; a discard at that instant may read a mix of two candidate
 * names, which no file has.)
 */
enum { TEMP_SLOTS = 64 };
static _Atomic(char *) temps[TEMP_SLOTS];

static void temp_register(char *tmp)
{
    for (int i = 0; i < TEMP_SLOTS; i++) {
        char *none = NULL;
        if (atomic_compare_exchange_strong(&temps[i], &none, tmp))
            return;
    }   /* full: this save is not tracked */
}

/* 1 if tmp was still registered (now not), 0 if a discard took it. */
static int temp_unregister(char *tmp)
{
    for (int i = 0; i < TEMP_SLOTS; i++) {
        char *want = tmp;
        if (atomic_compare_exchange_strong(&temps[i], &want, NULL))
            return 1;
    }
    return 0;
}

void mha_io_discard_temporaries(void)
{
    const int saved = errno;
    for (int i = 0; i < TEMP_SLOTS; i++) {
        /* the path is not freed: free() is not async-signal-safe, and the
         * process is about to end */
        char *tmp = atomic_exchange(&temps[i], NULL);
        if (tmp)
            unlink(tmp);
    }
    errno = saved;
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

/* Writes every chunk to fd (restarting after short writes and signals);
 * 0 or -1 with errno set. */
static int write_all(int fd, const void *const *chunks, const size_t *sizes,
                     int n)
{
    for (int k = 0; k < n; k++) {
        const char *p = chunks[k];
        size_t left = sizes[k];
        while (left > 0) {
            ssize_t w = write(fd, p, left > (1u << 30) ? (1u << 30) : left);
            if (w < 0 && errno == EINTR)
                continue;
            if (w <= 0) {
                if (w == 0)
                    errno = EIO;
                return -1;
            }
            p += w;
            left -= (size_t)w;
        }
    }
    return 0;
}

/* The file that `path` names, symbolic links followed (at most 40, as
 * the kernel does), in *out (malloc'ed).  The last name need not exist (a
 * link to a file not yet written: that file is created). */
static mha_status follow_links(const char *path, char **out)
{
    *out = NULL;
    char *cur = strdup(path);
    for (int hops = 0; cur && hops <= 40; hops++) {
        struct stat st;
        if (lstat(cur, &st) != 0 || !S_ISLNK(st.st_mode)) {
            *out = cur;
            return MHA_OK;
        }
        char target[4096];
        ssize_t n = readlink(cur, target, sizeof target - 1);
        if (n < 0 || n >= (ssize_t)sizeof target - 1) {
            mha_status s = mha_set_error(MHA_ERR_IO, "cannot read the "
                                         "symbolic link '%s'", cur);
            free(cur);
            return s;
        }
        target[n] = 0;
        /* a relative target is relative to the link's directory */
        const char *slash = target[0] == '/' ? NULL : strrchr(cur, '/');
        const size_t dir = slash ? (size_t)(slash - cur) + 1 : 0;
        char *next = malloc(dir + (size_t)n + 1);
        if (next) {
            memcpy(next, cur, dir);
            memcpy(next + dir, target, (size_t)n + 1);
        }
        free(cur);
        cur = next;
    }
    if (!cur)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate a path");
    free(cur);
    return mha_set_error(MHA_ERR_IO, "too many symbolic links in '%s'", path);
}

/* fsyncs the directory holding `path` (best effort: some file systems
 * refuse it, and the data itself is already synced). */
static void sync_dir(const char *path)
{
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash)
        snprintf(dir, sizeof dir, ".");
    else if (slash == path)
        snprintf(dir, sizeof dir, "/");
    else
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd);
        close(fd);
    }
}

/* Whether `path` reaches its file through /proc's links to open files
 * (/dev/stdout, /dev/fd/N, /proc/self/fd/N): a regular file there is some
 * process's open file, to be written, never replaced. */
static int via_proc(const char *path)
{
    static const char *const prefixes[] = {"/dev/stdout", "/dev/stderr",
                                           "/dev/fd/", "/proc/"};
    for (size_t k = 0; k < sizeof prefixes / sizeof *prefixes; k++)
        if (!strncmp(path, prefixes[k], strlen(prefixes[k])))
            return 1;
    return 0;
}

/* Writes through an existing node (not replaced): a FIFO, a device, or a
 * regular file kept in place.  `trunc` for a regular file. */
static mha_status write_through(const char *path, int trunc,
                                const void *const *chunks,
                                const size_t *sizes, int n)
{
    int fd = open(path, O_WRONLY | O_NONBLOCK | O_CLOEXEC |
                            (trunc ? O_TRUNC : 0));
    if (fd < 0)
        return mha_set_error(MHA_ERR_IO, "cannot write '%s': %s", path,
                             errno == ENXIO ? "a FIFO with no reader"
                                            : strerror(errno));
    int fl = fcntl(fd, F_GETFL);
    if (fl != -1)
        fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
    int ok = write_all(fd, chunks, sizes, n) == 0;
    int err = errno;
    if (close(fd) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    if (!ok)
        return mha_set_error(MHA_ERR_IO, "cannot write '%s': %s", path,
                             strerror(err));
    return MHA_OK;
}

mha_status mha_write_file_atomic(const char *path, const void *const *chunks,
                                 const size_t *sizes, int n)
{
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output path is NULL");
    struct stat st;
    const int exists = stat(path, &st) == 0;   /* the node, links followed */
    if (exists && S_ISDIR(st.st_mode))
        return mha_set_error(MHA_ERR_IO, "cannot write '%s': it is a "
                             "directory", path);
    if (exists && (!S_ISREG(st.st_mode) || via_proc(path)))
        return write_through(path, S_ISREG(st.st_mode), chunks, sizes, n);
    if (exists && st.st_nlink > 1)
        return write_through(path, 1, chunks, sizes, n);
    char *target;
    MHA_CHECK(follow_links(path, &target));
    const size_t cap = strlen(target) + 32;
    char *tmp = malloc(cap);
    if (!tmp) {
        free(target);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "cannot allocate a path");
    }
    /* Registered before the file exists (an empty name until then: a
     * discard's unlink("") fails), so no moment has a file that a discard
     * would miss. */
    tmp[0] = '\0';
    temp_register(tmp);
    int fd = create_temp(target, tmp, cap);
    if (fd < 0) {
        mha_status s = mha_set_error(MHA_ERR_IO,
                                     "cannot create a temporary file beside "
                                     "'%s': %s", target, strerror(errno));
        if (temp_unregister(tmp))
            free(tmp);
        free(target);
        return s;
    }
    if (exists) {   /* the replacement keeps the file's owner and mode */
        if (fchown(fd, st.st_uid, st.st_gid) != 0) {
            /* not ours to give away: the mode still applies */
        }
        fchmod(fd, st.st_mode & 07777);   /* after: chown clears setuid */
    }
    int ok = write_all(fd, chunks, sizes, n) == 0 && fsync(fd) == 0;
    int err = errno;
    if (close(fd) != 0 && ok) {
        ok = 0;
        err = errno;
    }
    if (ok && rename(tmp, target) != 0) {
        ok = 0;
        err = errno;
    }
    mha_status s = MHA_OK;
    if (ok) {
        sync_dir(target);
    } else {
        s = mha_set_error(MHA_ERR_IO, "cannot write '%s': %s", path,
                          strerror(err));
        remove(tmp);
    }
    if (temp_unregister(tmp))
        free(tmp);   /* (else a discard holds it, and the process ends) */
    free(target);
    return s;
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

mha_status mha_file_save(const char *path, const void *data, size_t size)
{
    if (!data && size)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "data is NULL but size is %zu", size);
    const void *chunks[1] = {data};
    const size_t sizes[1] = {size};
    return mha_write_file_atomic(path, chunks, sizes, size ? 1 : 0);
}
