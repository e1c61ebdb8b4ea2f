/*
 * error.c -- status strings, the thread-local error message, the version.
 */
#include "core.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#define MHA_STR2(x) #x
#define MHA_STR(x) MHA_STR2(x)

static _Thread_local char last_error[MHA_ERROR_CAP];

/* A message that did not fit ends in "..." (n: what it would have been). */
static void mark_cut(int n)
{
    if (n >= MHA_ERROR_CAP)
        memcpy(last_error + MHA_ERROR_CAP - 4, "...", 4);
}

mha_status mha_set_error(mha_status status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    mark_cut(vsnprintf(last_error, sizeof last_error, fmt, ap));
    va_end(ap);
    return status;
}

const char *mha_last_error(void) { return last_error; }

mha_status mha_error_set(mha_status status, const char *message)
{
    mark_cut(snprintf(last_error, sizeof last_error, "%s",
                      message ? message : ""));
    return status;
}

const char *mha_status_string(mha_status status)
{
    switch (status) {
    case MHA_OK: return "ok";
    case MHA_ERR_NULL_POINTER: return "null pointer";
    case MHA_ERR_INVALID_CONFIG: return "invalid configuration";
    case MHA_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MHA_ERR_SHAPE: return "shape mismatch";
    case MHA_ERR_OVERFLOW: return "size overflow";
    case MHA_ERR_OUT_OF_MEMORY: return "out of memory";
    case MHA_ERR_NOT_FOUND: return "not found";
    case MHA_ERR_NON_FINITE: return "non-finite value";
    case MHA_ERR_IO: return "i/o error";
    case MHA_ERR_FORMAT: return "malformed file";
    case MHA_ERR_UNSUPPORTED: return "unsupported";
    case MHA_ERR_COMM: return "communication failed";
    }
    return "unknown status";
}

const char *mha_version_string(void)
{
    return MHA_STR(MHA_VERSION_MAJOR) "." MHA_STR(MHA_VERSION_MINOR) "."
        MHA_STR(MHA_VERSION_PATCH);
}

int mha_version_number(void) { return MHA_VERSION_NUMBER; }

int mha_abi_version(void) { return MHA_ABI_VERSION; }
