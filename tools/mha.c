/*
 * mha.c -- the `mha` command: dispatch, help, and shared output helpers.
 */
#include "tool.h"

#include <stdarg.h>
#include <string.h>

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

void tool_heatmaps(FILE *f, const float *const *maps, const char *const *titles,
                   int n, int rows, int cols, const char *row_labels,
                   const char *col_labels)
{
    static const char *shade[] = {" ", "░", "▒", "▓", "█"};
    const int width = 2 * cols + 5;   /* "x [ " + cells + "]", then 4 blanks */
    for (int m = 0; m < n; m++)
        fprintf(f, "%-*.*s    ", width, width, titles[m]);
    fputc('\n', f);
    if (col_labels) {
        for (int m = 0; m < n; m++) {
            fputs("    ", f);
            for (int j = 0; j < cols; j++)
                fprintf(f, "%c ", col_labels[j]);
            fputs("     ", f);
        }
        fputc('\n', f);
    }
    for (int i = 0; i < rows; i++) {
        for (int m = 0; m < n; m++) {
            float mx = 0.0f;
            for (int k = 0; k < rows * cols; k++)
                if (maps[m][k] > mx)
                    mx = maps[m][k];
            fprintf(f, "%c [ ", row_labels ? row_labels[i] : ' ');
            for (int j = 0; j < cols; j++) {
                float w = maps[m][i * cols + j];
                /* Five levels of w / max: ' ' below 1/10, then quarters. */
                int lvl = mx <= 0.0f || w < 0.1f * mx ? 0
                        : w < 0.25f * mx ? 1
                        : w < 0.5f * mx ? 2
                        : w < 0.75f * mx ? 3 : 4;
                fprintf(f, "%s ", shade[lvl]);
            }
            fputs("]    ", f);
        }
        fputc('\n', f);
    }
}

static void usage(FILE *f)
{
    fputs("usage: mha <command> [options]\n"
          "\n"
          "commands:\n"
          "  example    the seeds' worked example (h=2, d=4), with true\n"
          "             values and heatmaps, then a larger random demo\n"
          "  forward    run a PyTorch state_dict (safetensors) on .npy inputs\n"
          "  backward   the gradients of that forward pass, given dL/d output:\n"
          "             inputs and parameters, into one safetensors file\n"
          "  init       write a freshly initialised module (safetensors)\n"
          "  info       describe a safetensors file and the module in it\n"
          "  bench      time the forward pass (or --attention-only, or\n"
          "             forward + backward with --backward): ms, GFLOP/s,\n"
          "             share of the FMA peak\n"
          "  viz        every head's attention weights as labelled heatmaps:\n"
          "             a PNG (--png) or the terminal (--ascii)\n"
          "  prune      keep some heads of a module, drop the others\n"
          "\n"
          "  mha --version     print the version\n"
          "  mha <command> --help\n", f);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--version") || !strcmp(cmd, "version")) {
        printf("mha %s\n", mha_version_string());
        return 0;
    }
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h") || !strcmp(cmd, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(cmd, "example"))
        return cmd_example(argc - 1, argv + 1);
    if (!strcmp(cmd, "forward"))
        return cmd_forward(argc - 1, argv + 1);
    if (!strcmp(cmd, "backward"))
        return cmd_backward(argc - 1, argv + 1);
    if (!strcmp(cmd, "prune"))
        return cmd_prune(argc - 1, argv + 1);
    if (!strcmp(cmd, "init"))
        return cmd_init(argc - 1, argv + 1);
    if (!strcmp(cmd, "info"))
        return cmd_info(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench"))
        return cmd_bench(argc - 1, argv + 1);
    if (!strcmp(cmd, "viz"))
        return cmd_viz(argc - 1, argv + 1);
    fprintf(stderr, "mha: unknown command '%s' (try mha --help)\n", cmd);
    return 2;
}
