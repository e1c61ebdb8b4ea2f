/*
 * fail.c -- failure reporting for the commands of `mha` (fail.h).
 */
#include "fail.h"

#include <stdarg.h>
#include <stdio.h>

static char *g_capture;   /* tool_fail_capture's buffer, or NULL */
static size_t g_capture_cap;

void tool_fail_capture(char *buf, size_t cap)
{
    g_capture = buf;
    g_capture_cap = cap;
    if (buf && cap)
        buf[0] = '\0';
}

int tool_fail(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    if (g_capture) {
        if (!g_capture[0]) {   /* the first failure is the one to tell */
            const int n = snprintf(g_capture, g_capture_cap, "mha %s: ",
                                   cmd);
            va_start(ap, fmt);
            if (n >= 0 && (size_t)n < g_capture_cap)
                vsnprintf(g_capture + n, g_capture_cap - (size_t)n, fmt, ap);
            va_end(ap);
        }
        return 1;
    }
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
