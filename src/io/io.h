/*
 * io.h -- the file helpers of the io room (file.c), shared by the
 * safetensors and .npy readers and writers.  Never installed.
 */
#ifndef MHA_IO_INTERNAL_H
#define MHA_IO_INTERNAL_H

#include "mha_io.h"
#include "core/core.h"

#include <stddef.h>
#include <stdio.h>

/* ---- files (io/file.c) ---------------------------------------------------
 * Opens `path` for reading if it is a regular file, without ever waiting
 * on it (a FIFO with no writer is refused at once, not waited on); *f at
 * the caller's charge.  Errors name `what`.
 */
mha_status mha_open_regular(const char *path, const char *what, FILE **f);
/*
 * Reads a whole file into a malloc'ed buffer (*size bytes, plus one NUL
 * byte after the end that is not counted).  Refuses files larger than
 * max_size with MHA_ERR_FORMAT, naming `what`.
 */
mha_status mha_read_file(const char *path, size_t max_size, const char *what,
                         unsigned char **data, size_t *size);
/*
 * Writes n chunks to `path` through a temporary file in the same directory
 * (fsync'ed, given the old file's mode and owner) and a rename, so that
 * `path` is either the complete new file or untouched; on failure the
 * temporary file is removed.  Symbolic links are followed to the file
 * they name; FIFOs, devices and /dev/stdout-like paths are written
 * through, and a file with several hard links is rewritten in place
 * (file.c says why).
 */
mha_status mha_write_file_atomic(const char *path, const void *const *chunks,
                                 const size_t *sizes, int n);
/* Size in bytes of one element of dtype in a file; 0 if unknown. */
size_t mha_dtype_size(mha_dtype dtype);

#endif /* MHA_IO_INTERNAL_H */
