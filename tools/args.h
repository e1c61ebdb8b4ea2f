/*
 * args.h -- a small, strict option parser for the `mha` subcommands.
 *
 * Options are `--name value`, `--name=value`, or bare flags.  Each
 * subcommand lists its options in a table; anything else is an error.
 */
#ifndef MHA_TOOL_ARGS_H
#define MHA_TOOL_ARGS_H

#include "mha.h"

#include <stdint.h>

/* The number of entries of an option table (an array). */
#define NOPTS(a) ((int)(sizeof(a) / sizeof((a)[0])))

typedef struct tool_opt {
    const char *name;      /* without the leading "--" */
    int takes_value;
    const char *value;     /* set by tool_parse: the value, or "" for a flag */
} tool_opt;

/*
 * Parses argv[1..argc) against opts (n entries).  Positional arguments go
 * to positional[0..*n_pos) (at most max_pos).  Returns 0, or prints a
 * one-line error for `cmd` and returns 1.  A `--help` sets *help.
 */
int tool_parse(const char *cmd, int argc, char **argv, tool_opt *opts, int n,
               const char **positional, int max_pos, int *n_pos, int *help);

/*
 * tool_parse for a command that takes no positional arguments and prints
 * `help` on --help.  Returns 0 to go on; otherwise the command is done and
 * returns *status (0 after the help, 1 after an error, printed).
 */
int tool_options(const char *cmd, int argc, char **argv, tool_opt *opts,
                 int n, const char *help, int *status);

const char *tool_get(const tool_opt *opts, int n, const char *name);

/* 0 if every option of names[0..count) was given, else prints "--NAME is
 * required" for the first one missing and returns 1. */
int tool_require(const char *cmd, const tool_opt *opts, int n,
                 const char *const *names, int count);

/* Strict conversions of an option value; on failure print and return 1. */
/* An unsigned 64-bit integer (seeds: the API's whole uint64 range), digits
 * only; 0 or 1 (reported) as tool_int. */
int tool_u64(const char *cmd, const char *name, const char *s, uint64_t *out);
/* --scale: a finite float32 other than 0 (saying so when a nonzero number
 * rounds to 0); 0 or 1 (reported) as tool_int. */
int tool_scale(const char *cmd, const char *s, float *out);
int tool_int(const char *cmd, const char *name, const char *s, int64_t lo,
             int64_t hi, int64_t *out);
int tool_float(const char *cmd, const char *name, const char *s, float *out);
/* A comma-separated list of exactly `count` finite floats (or integers
 * in [lo, hi]) into a malloc'ed array *out. */
int tool_floats(const char *cmd, const char *name, const char *s,
                int64_t count, float **out);
int tool_ints(const char *cmd, const char *name, const char *s, int64_t lo,
              int64_t hi, int64_t *count, int64_t **out);
/* A KV cache dtype by name (--kv-dtype): f32, f16, bf16 or q8; whether
 * the library builds it is the library's to say. */
int tool_kv_dtype(const char *cmd, const char *s, mha_kv_dtype *out);
/* Whether two paths name one file however they are spelt: the same inode
 * when both exist (links followed), else the same directory (by inode)
 * and the same last name. */
int tool_same_file(const char *a, const char *b);
/* Outputs never replace inputs: each output option of outs[0..n_out)
 * given in opts must name another file (tool_same_file) than every other
 * output, and than the value of every other option that names an
 * existing file (an input: the weights, a query, a mask, slopes...).
 * Returns 0, or prints which two options collide and returns 1. */
int tool_outputs_apart(const char *cmd, const tool_opt *opts, int n,
                       const char *const *outs, int n_out);

#endif
