/*
 * args.c -- the option parser of the `mha` commands (args.h).
 */
#define _POSIX_C_SOURCE 200809L   /* lstat */
#include "args.h"

#include "fail.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int tool_parse(const char *cmd, int argc, char **argv, tool_opt *opts, int n,
               const char **positional, int max_pos, int *n_pos, int *help)
{
    *n_pos = 0;
    *help = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help = 1;
            return 0;
        }
        if (strncmp(a, "--", 2) != 0) {
            if (*n_pos >= max_pos)
                return tool_fail(cmd, "unexpected argument '%s'", a);
            positional[(*n_pos)++] = a;
            continue;
        }
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        tool_opt *o = NULL;
        for (int k = 0; k < n; k++)
            if (strlen(opts[k].name) == len && !strncmp(opts[k].name, name, len))
                o = &opts[k];
        if (!o)
            return tool_fail(cmd, "unknown option '--%.*s' (see mha %s --help)",
                             (int)len, name, cmd);
        if (o->value)
            return tool_fail(cmd, "option --%s given twice", o->name);
        if (!o->takes_value) {
            if (eq)
                return tool_fail(cmd, "option --%s takes no value", o->name);
            o->value = "";
        } else if (eq) {
            o->value = eq + 1;
        } else {
            if (i + 1 >= argc)
                return tool_fail(cmd, "option --%s needs a value", o->name);
            o->value = argv[++i];
        }
    }
    return 0;
}

int tool_options(const char *cmd, int argc, char **argv, tool_opt *opts,
                 int n, const char *help, int *status)
{
    const char *pos[1];
    int npos, want_help;
    *status = tool_parse(cmd, argc, argv, opts, n, pos, 0, &npos, &want_help);
    if (!*status && want_help)
        fputs(help, stdout);
    return *status || want_help;
}

const char *tool_get(const tool_opt *opts, int n, const char *name)
{
    for (int k = 0; k < n; k++)
        if (!strcmp(opts[k].name, name))
            return opts[k].value;
    return NULL;
}

int tool_require(const char *cmd, const tool_opt *opts, int n,
                 const char *const *names, int count)
{
    for (int k = 0; k < count; k++)
        if (!tool_get(opts, n, names[k]))
            return tool_fail(cmd, "--%s is required (see mha %s --help)",
                             names[k], cmd);
    return 0;
}

int tool_int(const char *cmd, const char *name, const char *s, int64_t lo,
             int64_t hi, int64_t *out)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (!*s || *end || errno || v < lo || v > hi)
        return tool_fail(cmd, "--%s must be an integer in [%lld, %lld], got "
                         "'%s'", name, (long long)lo, (long long)hi, s);
    *out = v;
    return 0;
}

int tool_u64(const char *cmd, const char *name, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    /* strtoull takes "-1" as 2^64 - 1: only digits are a seed */
    unsigned long long v = strtoull(s, &end, 10);
    if (*s < '0' || *s > '9' || *end || errno)
        return tool_fail(cmd, "--%s must be an integer in [0, %llu], got "
                         "'%s'", name, (unsigned long long)UINT64_MAX, s);
    *out = (uint64_t)v;
    return 0;
}

int tool_float(const char *cmd, const char *name, const char *s, float *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (!*s || *end || errno || !isfinite((float)v))
        return tool_fail(cmd, "--%s must be a finite number, got '%s'", name,
                         s);
    *out = (float)v;
    return 0;
}

int tool_scale(const char *cmd, const char *s, float *out)
{
    if (tool_float(cmd, "scale", s, out))
        return 1;
    if (*out == 0.0f)
        return strtod(s, NULL) == 0.0
                   ? tool_fail(cmd, "--scale must be nonzero")
                   : tool_fail(cmd, "--scale %s rounds to 0 in float32 "
                               "(the smallest nonzero is about 1.4e-45)", s);
    return 0;
}

/* Splits a comma-separated list into a malloc'ed copy whose commas are NULs;
 * *n receives the number of items (an empty item is kept, and refused by
 * the conversion). */
static char *split_list(const char *s, int64_t *n)
{
    const size_t len = strlen(s);
    char *copy = malloc(len + 1);
    *n = 1;
    if (!copy)
        return NULL;
    memcpy(copy, s, len + 1);
    for (char *c = copy; *c; c++)
        if (*c == ',') {
            *c = '\0';
            ++*n;
        }
    return copy;
}

int tool_floats(const char *cmd, const char *name, const char *s,
                int64_t count, float **out)
{
    int64_t n;
    char *items = split_list(s, &n);
    float *v = items && n == count ? malloc((size_t)n * sizeof *v) : NULL;
    int rc = 0;
    if (!items || (n == count && !v))
        rc = tool_fail(cmd, "out of memory for --%s", name);
    else if (n != count)
        rc = tool_fail(cmd, "--%s has %lld values, expected %lld (one per "
                       "head)", name, (long long)n, (long long)count);
    const char *item = items;
    for (int64_t k = 0; !rc && k < n; item += strlen(item) + 1, k++)
        rc = tool_float(cmd, name, item, &v[k]);
    free(items);
    if (rc) {
        free(v);
        return 1;
    }
    *out = v;
    return 0;
}

int tool_ints(const char *cmd, const char *name, const char *s, int64_t lo,
              int64_t hi, int64_t *count, int64_t **out)
{
    int64_t n;
    char *items = split_list(s, &n);
    int64_t *v = items ? malloc((size_t)n * sizeof *v) : NULL;
    int rc = !v ? tool_fail(cmd, "out of memory for --%s", name) : 0;
    const char *item = items;
    for (int64_t k = 0; !rc && k < n; item += strlen(item) + 1, k++)
        rc = tool_int(cmd, name, item, lo, hi, &v[k]);
    free(items);
    if (rc) {
        free(v);
        return 1;
    }
    *count = n;
    *out = v;
    return 0;
}

int tool_kv_dtype(const char *cmd, const char *s, mha_kv_dtype *out)
{
    static const struct {
        const char *name;
        mha_kv_dtype dtype;
    } names[] = {{"f32", MHA_KV_F32}, {"f16", MHA_KV_F16},
                 {"bf16", MHA_KV_BF16}, {"q8", MHA_KV_Q8},
                 {"q4", MHA_KV_Q4}};
    for (int k = 0; k < NOPTS(names); k++)
        if (!strcmp(s, names[k].name)) {
            *out = names[k].dtype;
            return 0;
        }
    return tool_fail(cmd, "--kv-dtype must be f32, f16, bf16, q8 or q4, got "
                     "'%s'", s);
}

/* The directory part of `path` ("." without one) and its last name. */
static int dir_and_name(const char *path, char *dir, size_t cap,
                        const char **name)
{
    const char *slash = strrchr(path, '/');
    *name = slash ? slash + 1 : path;
    if (!slash)
        return snprintf(dir, cap, ".") < 0;
    if (slash == path)
        return snprintf(dir, cap, "/") < 0;
    return snprintf(dir, cap, "%.*s", (int)(slash - path), path) < 0;
}

int tool_same_file(const char *a, const char *b)
{
    struct stat sa, sb;
    const int ea = stat(a, &sa) == 0, eb = stat(b, &sb) == 0;
    if (ea && eb)
        return sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
    if (ea != eb)
        return 0;
    char da[4096], db[4096];
    const char *na, *nb;
    if (dir_and_name(a, da, sizeof da, &na) ||
        dir_and_name(b, db, sizeof db, &nb) || strcmp(na, nb))
        return 0;
    return stat(da, &sa) == 0 && stat(db, &sb) == 0 &&
           sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

static int is_output(const char *name, const char *const *outs, int n_out)
{
    for (int k = 0; k < n_out; k++)
        if (!strcmp(name, outs[k]))
            return 1;
    return 0;
}

int tool_outputs_apart(const char *cmd, const tool_opt *opts, int n,
                       const char *const *outs, int n_out)
{
    for (int k = 0; k < n_out; k++) {
        const char *out = tool_get(opts, n, outs[k]);
        if (!out || !out[0])
            continue;
        for (int j = 0; j < k; j++) {
            const char *other = tool_get(opts, n, outs[j]);
            if (other && other[0] && tool_same_file(out, other))
                return tool_fail(cmd, "--%s and --%s name the same file "
                                 "(%s): give each output its own",
                                 outs[j], outs[k], out);
        }
        /* Inputs: any other option whose value is an existing file (so
         * `--heads 4` is never taken for a file named 4 not there). */
        struct stat st;
        for (int i = 0; i < n; i++) {
            const char *in = opts[i].value;
            if (!opts[i].takes_value || !in || !in[0] ||
                is_output(opts[i].name, outs, n_out) || stat(in, &st) != 0)
                continue;
            if (tool_same_file(out, in))
                return tool_fail(cmd, "--%s %s names the same file as --%s "
                                 "%s: an output may not replace an input",
                                 outs[k], out, opts[i].name, in);
        }
    }
    return 0;
}
