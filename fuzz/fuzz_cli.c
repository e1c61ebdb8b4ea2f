/*
 * fuzz_cli.c -- fuzz target for the `mha` command's argument parsing
 * (tools/args.c): the option parser and every value conversion (integers
 * in a range, 64-bit seeds, finite floats, the scale, comma-separated
 * lists of floats and of integers, KV cache dtypes).
 *
 * The input is split at NUL bytes into an argv (argv[0] is "mha"), parsed
 * against a table of options with and without values, and every string
 * of it is given to every conversion.  tool_fail is this file's: it keeps
 * the message instead of printing it.  Contract checks (trap if broken):
 *   - every call returns 0 or 1, and 1 exactly when it left a message
 *     naming the option (or the argument) it refused;
 *   - tool_parse: each option's value is NULL, "" (a flag), or a string
 *     of argv (after "--name=" or the next argument); at most max_pos
 *     positional arguments, each an argv string not starting with "--";
 *     "--help" anywhere before an error sets help;
 *   - tool_int: the value within [lo, hi] and what strtoll reads;
 *     tool_u64: only digits, and what strtoull reads; tool_float: finite,
 *     what strtod reads rounded to float; tool_scale: that, and nonzero;
 *     tool_floats: exactly `count` finite values, one per comma-separated
 *     item; tool_ints: one integer in range per item; tool_kv_dtype: one
 *     of the five names.
 * Built two ways, as the other targets (fuzz/CMakeLists.txt); CTest's
 * fuzz_replay_cli replays fuzz/corpus/cli.
 */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "fail.h"

static const char *fuzz_who(void) { return "fuzz_cli"; }
#include "fuzz_common.h"

/* The last failure's message (tool_fail's, here). */
static char msg[4096];
/* Messages so far: 64 bits, as a run of 10^8 inputs makes ~10^10 (an int
 * overflowed after 18 million inputs: the target's own finding). */
static uint64_t failures;

int tool_fail(const char *cmd, const char *fmt, ...)
{
    va_list ap;
    int n = snprintf(msg, sizeof msg, "mha %s: ", cmd);
    va_start(ap, fmt);
    vsnprintf(msg + n, sizeof msg - (size_t)n, fmt, ap);
    va_end(ap);
    failures++;
    return 1;
}

int tool_fail_status(const char *cmd, const char *what, mha_status st)
{
    return tool_fail(cmd, "%s: %d", what, (int)st);
}

/* rc from a conversion: 0 with no new message, or 1 with one naming
 * `needle`. */
static void expect_rc(int rc, uint64_t before, const char *needle,
                      const char *s)
{
    CHECK(rc == 0 || rc == 1, "returned %d for '%s'", rc, s);
    CHECK((rc == 1) == (failures > before),
          "returned %d for '%s' with %llu messages", rc, s,
          (unsigned long long)(failures - before));
    if (rc)
        CHECK(strstr(msg, needle) != NULL,
              "the message for '%s' does not name %s: %s", s, needle, msg);
}

static void conversions(const char *s)
{
    uint64_t before = failures;
    int64_t i = 0;
    int rc = tool_int("x", "count", s, -5, 1000, &i);
    expect_rc(rc, before, "--count", s);
    if (!rc) {
        char *end;
        errno = 0;
        CHECK(i >= -5 && i <= 1000 && strtoll(s, &end, 10) == i && !*end,
              "tool_int('%s') = %lld", s, (long long)i);
    }

    before = failures;
    uint64_t u = 0;
    rc = tool_u64("x", "seed", s, &u);
    expect_rc(rc, before, "--seed", s);
    if (!rc) {
        for (const char *c = s; *c; c++)
            CHECK(*c >= '0' && *c <= '9', "tool_u64 took '%s'", s);
        CHECK(strtoull(s, NULL, 10) == u, "tool_u64('%s') = %llu", s,
              (unsigned long long)u);
    }

    before = failures;
    float f = 0.0f;
    rc = tool_float("x", "theta", s, &f);
    expect_rc(rc, before, "--theta", s);
    if (!rc)
        CHECK(isfinite(f) && f == (float)strtod(s, NULL),
              "tool_float('%s') = %g", s, (double)f);

    before = failures;
    rc = tool_scale("x", s, &f);
    expect_rc(rc, before, "--scale", s);
    if (!rc)
        CHECK(isfinite(f) && f != 0.0f, "tool_scale('%s') = %g", s,
              (double)f);

    /* Lists: the items are the comma-separated pieces. */
    int64_t items = 1;
    for (const char *c = s; *c; c++)
        items += *c == ',';
    before = failures;
    float *fl = NULL;
    rc = tool_floats("x", "slopes", s, 3, &fl);
    expect_rc(rc, before, "--slopes", s);
    if (!rc) {
        CHECK(items == 3, "tool_floats('%s') took %lld items as 3", s,
              (long long)items);
        for (int k = 0; k < 3; k++)
            CHECK(isfinite(fl[k]), "tool_floats('%s'): a non-finite", s);
        free(fl);
    }

    before = failures;
    int64_t count = 0, *il = NULL;
    rc = tool_ints("x", "keep", s, 0, 63, &count, &il);
    expect_rc(rc, before, "--keep", s);
    if (!rc) {
        CHECK(count == items, "tool_ints('%s'): %lld of %lld items", s,
              (long long)count, (long long)items);
        for (int64_t k = 0; k < count; k++)
            CHECK(il[k] >= 0 && il[k] <= 63, "tool_ints('%s') = %lld", s,
                  (long long)il[k]);
        free(il);
    }

    before = failures;
    mha_kv_dtype dt;
    rc = tool_kv_dtype("x", s, &dt);
    expect_rc(rc, before, "--kv-dtype", s);
    if (!rc)
        CHECK(!strcmp(s, "f32") || !strcmp(s, "f16") || !strcmp(s, "bf16") ||
              !strcmp(s, "q8") || !strcmp(s, "q4"),
              "tool_kv_dtype took '%s'", s);
}

/* Whether p is one of argv's strings, or points inside one (after "="). */
static int from_argv(const char *p, int argc, char **argv)
{
    for (int k = 0; k < argc; k++) {
        const size_t len = strlen(argv[k]);
        if (p >= argv[k] && p <= argv[k] + len)
            return 1;
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    enum { MAXARGS = 64 };
    char *buf = malloc(size + 1);
    memcpy(buf, data, size);
    buf[size] = '\0';
    char *argv[MAXARGS + 1];
    int argc = 0;
    argv[argc++] = (char *)"mha";
    for (char *p = buf; p <= buf + size && argc < MAXARGS;
         p += strlen(p) + 1)
        argv[argc++] = p;
    argv[argc] = NULL;

    tool_opt opts[] = {{"heads", 1, NULL},  {"seq-first", 0, NULL},
                       {"scale", 1, NULL},  {"keep", 1, NULL},
                       {"out", 1, NULL},    {"causal", 0, NULL},
                       {"h", 1, NULL},      {"", 1, NULL}};
    const char *pos[2] = {NULL, NULL};
    int npos = -1, help = -1;
    const uint64_t before = failures;
    const int rc = tool_parse("fuzz", argc, argv, opts, NOPTS(opts), pos, 2,
                              &npos, &help);
    CHECK(rc == 0 || rc == 1, "tool_parse returned %d", rc);
    CHECK((rc == 1) == (failures > before), "tool_parse: rc %d, %llu messages",
          rc, (unsigned long long)(failures - before));
    CHECK(npos >= 0 && npos <= 2 && (help == 0 || help == 1),
          "tool_parse: %d positional, help %d", npos, help);
    if (rc)
        CHECK(strstr(msg, "mha fuzz: ") == msg && strlen(msg) > 10,
              "tool_parse's message: %s", msg);
    for (int k = 0; k < npos; k++)
        CHECK(from_argv(pos[k], argc, argv) && strncmp(pos[k], "--", 2),
              "positional %d is not an argument: %s", k, pos[k]);
    for (int k = 0; k < NOPTS(opts); k++) {
        const char *v = opts[k].value;
        if (!v)
            continue;
        if (!opts[k].takes_value)
            CHECK(!*v, "flag --%s has the value '%s'", opts[k].name, v);
        else
            CHECK(from_argv(v, argc, argv),
                  "--%s's value is not from argv", opts[k].name);
        CHECK(tool_get(opts, NOPTS(opts), opts[k].name) == v,
              "tool_get(%s) differs", opts[k].name);
    }
    const char *need[] = {"heads", "out"};
    const uint64_t rb = failures;
    const int rq = tool_require("fuzz", opts, NOPTS(opts), need, 2);
    CHECK((rq == 1) == (failures > rb) &&
          rq == (!opts[0].value || !opts[4].value),
          "tool_require returned %d", rq);

    for (int k = 1; k < argc; k++)
        conversions(argv[k]);
    free(buf);
    return 0;
}
