/*
 * mha.c -- the `mha` command: its table of commands, and main.
 *
 * The table drives both the dispatch and `mha --help`.  Each command lives
 * in its own file (cmd_*.c, declared in commands.h) and shares helpers
 * with the others through their own headers (fail.h, args.h, heatmap.h,
 * font.h, run_setup.h); none of them calls back into this file.
 */
#define _POSIX_C_SOURCE 200809L   /* sigaction */

#include "commands.h"
#include "mha.h"
#include "mha_io.h"

#include <signal.h>
#include <stdio.h>
#include <string.h>

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);   /* argv[0] is the command's name */
    const char *summary;                 /* one line of mha --help */
} command;

static const command COMMANDS[] = {
    {"example", cmd_example,
     "the seeds' worked example (h=2, d=4), then a larger random demo"},
    {"forward", cmd_forward,
     "run a PyTorch state_dict (safetensors) on .npy inputs"},
    {"backward", cmd_backward,
     "the gradients of that forward pass, given dL/d output"},
    {"decode", cmd_decode,
     "causal self-attention through a KV cache, token by token"},
    {"init", cmd_init, "write a freshly initialised module (safetensors)"},
    {"info", cmd_info, "describe a safetensors file and the module in it"},
    {"bench", cmd_bench,
     "time the forward pass (or the attention, or forward + backward)"},
    {"viz", cmd_viz,
     "every head's attention weights as heatmaps: PNG or terminal"},
    {"prune", cmd_prune, "keep some heads of a module, drop the others"},
};
enum { NCOMMANDS = (int)(sizeof COMMANDS / sizeof COMMANDS[0]) };

static void usage(FILE *f)
{
    fputs("usage: mha <command> [options]\n\ncommands:\n", f);
    for (int k = 0; k < NCOMMANDS; k++)
        fprintf(f, "  %-10s %s\n", COMMANDS[k].name, COMMANDS[k].summary);
    fputs("\n"
          "  mha --version     print the version\n"
          "  mha <command> --help\n", f);
}

/* A signal that ends the process: first the temporary files of the saves
 * in progress go (an interrupted save leaves NAME as it was and no
 * NAME.tmp.* beside it), then the process dies of the signal as it would
 * have (the default action, re-raised: the caller sees the signal). */
static void on_fatal_signal(int sig)
{
    mha_io_discard_temporaries();
    signal(sig, SIG_DFL);
    raise(sig);
}

static void catch_fatal_signals(void)
{
    static const int sigs[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
    for (size_t i = 0; i < sizeof sigs / sizeof sigs[0]; i++) {
        struct sigaction sa, old;
        /* a signal the caller ignores (nohup, a shell's SIGPIPE) stays
         * ignored */
        if (sigaction(sigs[i], NULL, &old) == 0 && old.sa_handler == SIG_IGN)
            continue;
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = on_fatal_signal;
        sigemptyset(&sa.sa_mask);
        sigaction(sigs[i], &sa, NULL);
    }
}

int main(int argc, char **argv)
{
    catch_fatal_signals();
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
    for (int k = 0; k < NCOMMANDS; k++)
        if (!strcmp(cmd, COMMANDS[k].name))
            return COMMANDS[k].run(argc - 1, argv + 1);
    fprintf(stderr, "mha: unknown command '%s' (try mha --help)\n", cmd);
    return 2;
}
