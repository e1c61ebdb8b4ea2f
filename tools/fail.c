/*
 * fail.c -- failure reporting for the commands of `mha` (fail.h).
 */
#include "fail.h"

#include <stdarg.h>
#include <stdio.h>

int tool_fail(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "mha %s: ", cmd);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    return 1;
}

int tool_fail_status(const char *cmd, const char *what, mha_status st)
{
    return tool_fail(cmd, "%s: %s: %s", what, mha_status_string(st),
                     mha_last_error());
}
