/*
 * tool.h -- what the files of the `mha` command share.
 */
#ifndef MHA_TOOL_H
#define MHA_TOOL_H

#include "mha.h"

#include <stdio.h>

/* Prints "mha <cmd>: <message>" on stderr; returns 1 (the exit status). */
int tool_fail(const char *cmd, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;
/* The same for a failed library call: adds the status and last error. */
int tool_fail_status(const char *cmd, const char *what, mha_status st);

/*
 * Prints n maps side by side, each (rows, cols), row-major, shaded
 * " ░▒▓█" relative to that map's largest value, with titles above and
 * optional one-character labels for rows and columns.
 */
void tool_heatmaps(FILE *f, const float *const *maps, const char *const *titles,
                   int n, int rows, int cols, const char *row_labels,
                   const char *col_labels);

int cmd_example(int argc, char **argv);
int cmd_forward(int argc, char **argv);
int cmd_backward(int argc, char **argv);
int cmd_init(int argc, char **argv);
int cmd_info(int argc, char **argv);
int cmd_bench(int argc, char **argv);

#endif
