/*
 * fail.h -- how the commands of `mha` report a failure: one line on
 * stderr, "mha <cmd>: <message>", and the exit status 1.
 */
#ifndef MHA_TOOL_FAIL_H
#define MHA_TOOL_FAIL_H

#include "mha.h"

#include <stddef.h>

/* Prints "mha <cmd>: <message>" on stderr; returns 1 (the exit status). */
int tool_fail(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Until called again with NULL, tool_fail writes its line (without the
 * newline) into buf, the first failure's only, instead of stderr: the
 * ring commands print a failure every rank meets once, from rank 0. */
void tool_fail_capture(char *buf, size_t cap);

/* The same for a failed library call: adds the status and last error. */
int tool_fail_status(const char *cmd, const char *what, mha_status st);

#endif
