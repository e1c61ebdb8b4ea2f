/*
 * test_safetensors.c -- the safetensors reader and writer
 * (src/io/safetensors.c) and a module to and from a PyTorch
 * nn.MultiheadAttention state_dict (src/io/module_io.c).
 *
 *   - a table of malformed files built in memory, each refused by
 *     mha_safetensors_parse and (written to a temporary file) by
 *     mha_safetensors_load with its status and a keyword of its message,
 *     and nothing returned; missing files and directories;
 *   - valid files: no tensors, zero-size tensors, scalars, every dtype the
 *     reader converts (F16 and BF16 checked bit for bit over all 65536
 *     patterns against an independent conversion), metadata, file order,
 *     padded headers;
 *   - the writer: round trips, the 8-aligned header, atomicity (nothing
 *     left behind on any failure), bad arguments;
 *   - modules: save -> load for every configuration, init -> save -> load
 *     -> save byte for byte, every error of mha_module_from_file naming its
 *     tensor, q/k/v_proj_weight with kdim = vdim = E packed.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mha_io.h"
#include "testutil.h"

/* ------------------------------------------------------------------------ */
/* Helpers                                                                  */
/* ------------------------------------------------------------------------ */



static void tmp_path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", tu_tmpdir, name);
}

/* Number of entries in tu_tmpdir (".", ".." not counted). */
static int tmpdir_entries(void)
{
    DIR *d = opendir(tu_tmpdir);
    int n = 0;
    if (!d)
        return -1;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

static int file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

#include "assert_error.h"

#define assert_ok(call)                                                     \
    do {                                                                    \
        mha_status st_ = (call);                                            \
        if (st_ != MHA_OK)                                                  \
            fail_msg("%s returned %d (%s): %s", #call, (int)st_,            \
                     mha_status_string(st_), mha_last_error());             \
    } while (0)

/* A byte buffer of exactly n bytes (so a read past it is caught). */
typedef struct bytes {
    unsigned char *p;
    size_t n;
} bytes;

/* The file: 8-byte little-endian `hdr_len`, hlen header bytes, ndata data
 * bytes (a counting pattern when data is NULL). */
static bytes st_bytes(uint64_t hdr_len, const void *hdr, size_t hlen,
                      const void *data, size_t ndata)
{
    bytes b;
    b.n = 8 + hlen + ndata;
    b.p = malloc(b.n);
    assert_non_null(b.p);
    for (int k = 0; k < 8; k++)
        b.p[k] = (unsigned char)(hdr_len >> (8 * k));
    if (hlen)
        memcpy(b.p + 8, hdr, hlen);
    for (size_t k = 0; k < ndata; k++)
        b.p[8 + hlen + k] = data ? ((const unsigned char *)data)[k]
                                 : (unsigned char)(k * 7 + 1);
    return b;
}

/* The usual case: the header's real length, then the data. */
static bytes st_file(const char *hdr, const void *data, size_t ndata)
{
    return st_bytes(strlen(hdr), hdr, strlen(hdr), data, ndata);
}

static void write_bytes(const char *path, const void *p, size_t n)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    if (n)
        assert_int_equal(fwrite(p, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static bytes read_bytes(const char *path)
{
    bytes b = {NULL, 0};
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    long n = ftell(f);
    assert_true(n >= 0);
    rewind(f);
    b.n = (size_t)n;
    b.p = malloc(b.n ? b.n : 1);
    assert_non_null(b.p);
    assert_int_equal(fread(b.p, 1, b.n, f), b.n);
    fclose(f);
    return b;
}

static mha_tensor_file *parse_ok(const char *hdr, const void *data,
                                 size_t ndata)
{
    bytes b = st_file(hdr, data, ndata);
    mha_tensor_file *f = NULL;
    mha_status st = mha_safetensors_parse(b.p, b.n, &f);
    free(b.p);
    if (st != MHA_OK)
        fail_msg("parse of %s failed: %s", hdr, mha_last_error());
    assert_non_null(f);
    return f;
}

static uint32_t float_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* One tensor entry of a header. */
#define T(name, dtype, shape, b, e)                                         \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape                \
    ",\"data_offsets\":[" #b "," #e "]}"

/* ------------------------------------------------------------------------ */
/* Malformed files                                                          */
/* ------------------------------------------------------------------------ */

typedef struct bad_case {
    const char *what;
    const char *header;   /* JSON header, its real length written first */
    size_t hlen;          /* header bytes when it holds a NUL; 0: strlen */
    size_t ndata;         /* data bytes after the header                */
    bytes (*build)(void); /* or: the whole file                        */
    mha_status status;
    const char *keyword;
} bad_case;

static bytes b_empty(void) { return (bytes){malloc(1), 0}; }

static bytes b_seven(void)
{
    bytes b = {malloc(7), 7};
    memcpy(b.p, "\x02\0\0\0\0\0\0", 7);
    return b;
}

static bytes b_len_max(void) { return st_bytes(UINT64_MAX, "{}", 2, NULL, 0); }

static bytes b_len_over_limit(void)
{
    return st_bytes(100000001ULL, "{}", 2, NULL, 0);
}

/* Exactly the limit is allowed by the limit check, then runs past EOF. */
static bytes b_len_at_limit(void)
{
    return st_bytes(100000000ULL, "{}", 2, NULL, 0);
}

static bytes b_len_past_eof(void) { return st_bytes(3, "{}", 2, NULL, 0); }

static bytes b_len_zero(void) { return st_bytes(0, "", 0, NULL, 0); }

/* {"a": then 100000 '[' (and as many ']'): nesting far past cJSON's limit. */
static bytes b_deep(void)
{
    const size_t depth = 100000;
    size_t n = 5 + 2 * depth + 1;
    char *h = malloc(n);
    assert_non_null(h);
    memcpy(h, "{\"a\":", 5);
    memset(h + 5, '[', depth);
    memset(h + 5 + depth, ']', depth);
    h[n - 1] = '}';
    bytes b = st_bytes(n, h, n, NULL, 0);
    free(h);
    return b;
}

/* The 8 PNG magic bytes and the start of an IHDR chunk, as a file renamed
 * to .safetensors would begin. */
static bytes b_png(void)
{
    static const unsigned char png[] = {
        0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d,
        'I',  'H', 'D', 'R', 0x00, 0x00, 0x00, 0x10, 0x00, 0x00, 0x00, 0x10,
        0x08, 0x06, 0x00, 0x00, 0x00, 0x1f, 0xf3, 0xff, 0x61};
    bytes b = {malloc(sizeof png), sizeof png};
    memcpy(b.p, png, sizeof png);
    return b;
}

#define F MHA_ERR_FORMAT
#define U MHA_ERR_UNSUPPORTED

static const bad_case BAD[] = {
    /* ---- the length prefix ---- */
    {"empty file", NULL, 0, 0, b_empty, F, "too short"},
    {"7 bytes", NULL, 0, 0, b_seven, F, "too short"},
    {"header length 2^64-1", NULL, 0, 0, b_len_max, F, "exceeds the limit"},
    {"header length > 100 MB", NULL, 0, 0, b_len_over_limit, F,
     "exceeds the limit"},
    {"header length = 100 MB, past EOF", NULL, 0, 0, b_len_at_limit, F,
     "runs past the end"},
    {"header length past EOF", NULL, 0, 0, b_len_past_eof, F,
     "runs past the end"},
    {"header length 0", NULL, 0, 0, b_len_zero, F, "start with '{'"},
    {"PNG renamed", NULL, 0, 0, b_png, F, "exceeds the limit"},
    /* ---- UTF-8 ---- */
    {"overlong UTF-8", "{\"\xc0\xaf\":{}}", 0, 0, NULL, F, "UTF-8"},
    {"overlong 3-byte UTF-8", "{\"\xe0\x80\xaf\":{}}", 0, 0, NULL, F,
     "UTF-8"},
    {"lone continuation byte", "{\"\x80\":{}}", 0, 0, NULL, F, "UTF-8"},
    {"UTF-16 surrogate", "{\"\xed\xa0\x80\":{}}", 0, 0, NULL, F, "UTF-8"},
    {"code point > U+10FFFF", "{\"\xf4\x90\x80\x80\":{}}", 0, 0, NULL, F,
     "UTF-8"},
    {"truncated sequence at the end", "{}  \xe2\x82", 0, 0, NULL, F,
     "UTF-8"},
    {"byte 0xff", "{\"\xff\":{}}", 0, 0, NULL, F, "UTF-8"},
    /* ---- JSON ---- */
    {"leading space", " {}", 0, 0, NULL, F, "start with '{'"},
    {"JSON array", "[{}]", 0, 0, NULL, F, "start with '{'"},
    {"JSON string", "\"{}\"", 0, 0, NULL, F, "start with '{'"},
    {"invalid JSON", "{\"a\":}", 0, 0, NULL, F, "not valid JSON"},
    {"truncated JSON", "{\"a\":{\"dtype\":\"F32\"", 0, 0, NULL, F,
     "not valid JSON"},
    {"deeply nested JSON", NULL, 0, 0, b_deep, F, "not valid JSON"},
    {"trailing garbage", "{} x", 0, 0, NULL, F, "trailing bytes"},
    {"two objects", "{}{}", 0, 0, NULL, F, "trailing bytes"},
    /* cJSON alone would take these: it skips any byte <= 0x20 as space,
     * keeps raw control characters in strings and reads numbers with
     * strtod. */
    {"NUL after the object", "{}\0  ", 5, 0, NULL, F, "control character"},
    {"NUL inside the object", "{\0}", 3, 0, NULL, F, "control character"},
    {"control character as space", "{\x01}", 0, 0, NULL, F,
     "control character"},
    {"raw newline in a name", "{\"a\nb\":{}}", 0, 0, NULL, F,
     "control character in a string"},
    /* \u0000 would cut a name or a value short as a C string */
    {"NUL escape in a name", "{" T("a\\u0000b", "F32", "[1]", 0, 4) "}", 0, 4,
     NULL, F, "NUL character (\\u0000)"},
    {"NUL escape in metadata", "{\"__metadata__\":{\"k\":\"v\\u0000w\"}}", 0,
     0, NULL, F, "NUL character"},
    {"number with '+'", "{" T("a", "F32", "[+1]", 0, 4) "}", 0, 4, NULL, F,
     "malformed number"},
    {"number with a leading 0", "{" T("a", "F32", "[01]", 0, 4) "}", 0, 4,
     NULL, F, "malformed number"},
    {"number starting with '.'", "{" T("a", "F32", "[1]", .0, 4) "}", 0, 4,
     NULL, F, "malformed number"},
    {"number ending with '.'", "{" T("a", "F32", "[1.]", 0, 4) "}", 0, 4,
     NULL, F, "malformed number"},
    {"number ending with 'e'", "{" T("a", "F32", "[1]", 0, 4e) "}", 0, 4,
     NULL, F, "malformed number"},
    {"lone '-'", "{" T("a", "F32", "[-]", 0, 4) "}", 0, 4, NULL, F,
     "malformed number"},
    /* ---- dtype ---- */
    {"unknown dtype", "{" T("a", "F31", "[1]", 0, 4) "}", 0, 4, NULL, F,
     "unknown dtype 'F31'"},
    {"lower-case dtype", "{" T("a", "f32", "[1]", 0, 4) "}", 0, 4, NULL, F,
     "unknown dtype"},
    {"missing dtype", "{\"a\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 0, 4,
     NULL, F, "dtype"},
    {"dtype a number",
     "{\"a\":{\"dtype\":1,\"shape\":[1],\"data_offsets\":[0,4]}}", 0, 4, NULL,
     F, "dtype"},
    {"U8 dtype", "{" T("a", "U8", "[4]", 0, 4) "}", 0, 4, NULL, U, "U8"},
    {"F8_E4M3 dtype", "{" T("a", "F8_E4M3", "[4]", 0, 4) "}", 0, 4, NULL, U,
     "F8_E4M3"},
    /* ---- shape ---- */
    {"negative dim", "{" T("a", "F32", "[-1]", 0, 4) "}", 0, 4, NULL, F,
     "non-negative integer"},
    {"fractional dim", "{" T("a", "F32", "[1.5]", 0, 4) "}", 0, 4, NULL, F,
     "not written as an integer"},
    {"dim written 1.0", "{" T("a", "F32", "[1.0]", 0, 4) "}", 0, 4, NULL, F,
     "not written as an integer"},
    {"dim written 1e0", "{" T("a", "F32", "[1e0]", 0, 4) "}", 0, 4, NULL, F,
     "not written as an integer"},
    {"dim as string", "{" T("a", "F32", "[\"1\"]", 0, 4) "}", 0, 4, NULL, F,
     "non-negative integer"},
    {"dim null", "{" T("a", "F32", "[null]", 0, 4) "}", 0, 4, NULL, F,
     "non-negative integer"},
    {"dim above 2^53", "{" T("a", "F32", "[9007199254740994]", 0, 4) "}", 0,
     4, NULL, F, "non-negative integer"},
    {"shape not an array", "{" T("a", "F32", "4", 0, 16) "}", 0, 16, NULL, F,
     "'shape'"},
    {"shape missing",
     "{\"a\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 0, 4, NULL, F,
     "'shape'"},
    {"9 dimensions", "{" T("a", "F32", "[1,1,1,1,1,1,1,1,1]", 0, 4) "}", 0,
     4, NULL, U, "9 dimensions"},
    {"element count overflows 64 bits",
     "{" T("a", "F32", "[4294967296,4294967296]", 0, 4) "}", 0, 4, NULL, F,
     "overflows 64 bits"},
    {"byte size overflows 64 bits",
     "{" T("a", "F64", "[4503599627370496,1024]", 0, 8) "}", 0, 8, NULL, F,
     "overflows 64 bits"},
    {"overflow hidden by a later 0",
     "{" T("a", "F32", "[4294967296,4294967296,0]", 0, 0) "}", 0, 0, NULL, F,
     "overflows 64 bits"},
    /* ---- data_offsets ---- */
    {"missing data_offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1]}}", 0,
     4, NULL, F, "data_offsets"},
    {"data_offsets with 3 entries",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4,8]}}", 0,
     4, NULL, F, "data_offsets"},
    {"data_offsets with 1 entry",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4]}}", 0, 4,
     NULL, F, "data_offsets"},
    {"data_offsets not an array",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":\"0,4\"}}", 0,
     4, NULL, F, "data_offsets"},
    {"negative offset", "{" T("a", "F32", "[1]", -4, 0) "}", 0, 4, NULL, F,
     "data_offsets"},
    {"end < begin", "{" T("a", "F32", "[0]", 4, 0) "}", 0, 4, NULL, F,
     "end before begin"},
    {"size mismatch", "{" T("a", "F32", "[2]", 0, 4) "}", 0, 4, NULL, F,
     "span 4 bytes"},
    {"hole between tensors",
     "{" T("a", "F32", "[1]", 0, 4) "," T("b", "F32", "[1]", 8, 12) "}", 0,
     12, NULL, F, "contiguous"},
    {"first tensor not at 0", "{" T("a", "F32", "[1]", 4, 8) "}", 0, 8, NULL,
     F, "contiguous"},
    {"overlapping tensors",
     "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[1]", 4, 8) "}", 0, 8,
     NULL, F, "contiguous"},
    {"same range twice",
     "{" T("a", "F32", "[1]", 0, 4) "," T("b", "F32", "[1]", 0, 4) "}", 0, 4,
     NULL, F, "contiguous"},
    {"offsets past the end of the file", "{" T("a", "F32", "[2]", 0, 8) "}",
     0, 4, NULL, F, "data buffer has 4"},
    {"trailing bytes after the last tensor",
     "{" T("a", "F32", "[1]", 0, 4) "}", 0, 8, NULL, F, "data buffer has 8"},
    {"data but no tensors", "{}", 0, 4, NULL, F, "data buffer has 4"},
    /* ---- names, metadata, entries ---- */
    {"duplicate tensor names",
     "{" T("a", "F32", "[1]", 0, 4) "," T("a", "F32", "[1]", 4, 8) "}", 0, 8,
     NULL, F, "duplicate tensor name 'a'"},
    {"__metadata__ not an object", "{\"__metadata__\":\"pt\"}", 0, 0, NULL,
     F, "__metadata__ is not an object"},
    {"__metadata__ an array", "{\"__metadata__\":[\"a\",\"b\"]}", 0, 0, NULL,
     F, "__metadata__ is not an object"},
    {"__metadata__ with a number value",
     "{\"__metadata__\":{\"num_heads\":2}}", 0, 0, NULL, F,
     "'num_heads' is not a string"},
    {"__metadata__ with an object value",
     "{\"__metadata__\":{\"x\":{}}}", 0, 0, NULL, F, "'x' is not a string"},
    {"duplicate __metadata__",
     "{\"__metadata__\":{},\"__metadata__\":{}}", 0, 0, NULL, F,
     "duplicate __metadata__"},
    {"duplicate __metadata__ key",
     "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, 0, NULL, F,
     "duplicate __metadata__ key 'k'"},
    {"tensor not an object", "{\"a\":[0,4]}", 0, 4, NULL, F,
     "'a' is not an object"},
    {"tensor a number", "{\"a\":4}", 0, 0, NULL, F, "'a' is not an object"},
};

#undef F
#undef U

static bytes build_bad(const bad_case *c)
{
    if (c->build)
        return c->build();
    size_t hlen = c->hlen ? c->hlen : strlen(c->header);
    return st_bytes(hlen, c->header, hlen, NULL, c->ndata);
}

/* "\\u0000" is a backslash and the text u0000, not a NUL: taken. */
static void test_escaped_backslash_is_no_nul(void **state)
{
    (void)state;
    static const char h[] = "{" T("a\\\\u0000", "F32", "[1]", 0, 4) "}";
    bytes b = st_bytes(sizeof h - 1, h, sizeof h - 1, NULL, 4);
    mha_tensor_file *f = NULL;
    assert_int_equal(mha_safetensors_parse(b.p, b.n, &f), MHA_OK);
    assert_non_null(mha_tensor_file_find(f, "a\\u0000"));
    mha_tensor_file_free(f);
    free(b.p);
}

static void test_malformed_table(void **state)
{
    (void)state;
    const int n = (int)(sizeof BAD / sizeof *BAD);
    assert_true(n >= 30);
    for (int k = 0; k < n; k++) {
        const bad_case *c = &BAD[k];
        bytes b = build_bad(c);
        mha_tensor_file *f = (mha_tensor_file *)&b;   /* must become NULL */
        mha_status st = mha_safetensors_parse(b.p, b.n, &f);
        if (st != c->status)
            fail_msg("case %d (%s): parse returned %d (%s), expected %d; "
                     "message: %s", k, c->what, (int)st,
                     mha_status_string(st), (int)c->status, mha_last_error());
        if (f != NULL)
            fail_msg("case %d (%s): *out not NULL after failure", k, c->what);
        if (!strstr(mha_last_error(), c->keyword))
            fail_msg("case %d (%s): message \"%s\" does not mention \"%s\"",
                     k, c->what, mha_last_error(), c->keyword);

        char path[512], name[64];
        snprintf(name, sizeof name, "bad_%02d.safetensors", k);
        tmp_path(path, sizeof path, name);
        write_bytes(path, b.p, b.n);
        free(b.p);
        f = (mha_tensor_file *)&b;
        st = mha_safetensors_load(path, &f);
        if (st != c->status)
            fail_msg("case %d (%s): load returned %d (%s), expected %d; "
                     "message: %s", k, c->what, (int)st,
                     mha_status_string(st), (int)c->status, mha_last_error());
        if (f != NULL)
            fail_msg("case %d (%s): load: *out not NULL", k, c->what);
        if (!strstr(mha_last_error(), c->keyword) ||
            !strstr(mha_last_error(), path))
            fail_msg("case %d (%s): load message \"%s\" does not mention "
                     "\"%s\" and the path", k, c->what, mha_last_error(),
                     c->keyword);
        /* mha_module_load goes through the same reader. */
        mha_module *m = (mha_module *)&b;
        st = mha_module_load(path, 2, &m);
        assert_int_equal(st, c->status);
        assert_null(m);
        remove(path);
    }
}

/* PyTorch's torch.save files are named as such, with what to do; a real
 * safetensors file whose header length starts with the same bytes (640 =
 * 0x280: 0x80 0x02) still loads. */
static void test_torch_save_files(void **state)
{
    (void)state;
    unsigned char zip[64] = "PK\3\4";
    unsigned char pkl[64] = {0x80, 0x02, '}', 'q', 0x00, '(', 'X'};
    const struct {
        const unsigned char *p;
        const char *kind;
    } cases[] = {{zip, "zip archive"}, {pkl, "pickle"}};
    for (int k = 0; k < 2; k++) {
        mha_tensor_file *f = NULL;
        assert_int_equal(mha_safetensors_parse(cases[k].p, 64, &f),
                         MHA_ERR_FORMAT);
        assert_null(f);
        assert_non_null(strstr(mha_last_error(), "torch.save"));
        assert_non_null(strstr(mha_last_error(), cases[k].kind));
        assert_non_null(strstr(mha_last_error(), "save_file"));
    }
    /* header of exactly 640 bytes: {"x":...} padded with spaces */
    const char *json = "{\"x\":{\"dtype\":\"F32\",\"shape\":[1],"
                       "\"data_offsets\":[0,4]}}";
    size_t n = 640, size = 8 + n + 4;
    unsigned char *b = calloc(1, size);
    assert_non_null(b);
    b[0] = 0x80;
    b[1] = 0x02;
    memset(b + 8, ' ', n);
    memcpy(b + 8, json, strlen(json));
    float one = 1.0f;
    memcpy(b + 8 + n, &one, 4);
    mha_tensor_file *f = NULL;
    assert_int_equal(mha_safetensors_parse(b, size, &f), MHA_OK);
    assert_non_null(f);
    mha_tensor_file_free(f);
    free(b);
}

static void test_load_io_errors(void **state)
{
    (void)state;
    char path[512];
    mha_tensor_file *f = (mha_tensor_file *)path;
    tmp_path(path, sizeof path, "no_such_file.safetensors");
    assert_fails(mha_safetensors_load(path, &f), MHA_ERR_IO, path);
    assert_null(f);
    mha_module *m = (mha_module *)path;
    assert_fails(mha_module_load(path, 2, &m), MHA_ERR_IO, path);
    assert_null(m);

    /* A directory, even one named like a file. */
    tmp_path(path, sizeof path, "dir.safetensors");
    assert_int_equal(mkdir(path, 0700), 0);
    f = (mha_tensor_file *)path;
    assert_fails(mha_safetensors_load(path, &f), MHA_ERR_IO, path);
    assert_null(f);
    assert_int_equal(rmdir(path), 0);

    /* Arguments. */
    assert_fails(mha_safetensors_load(NULL, &f), MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_safetensors_load(path, NULL), MHA_ERR_NULL_POINTER,
                 "NULL");
    assert_fails(mha_safetensors_parse(NULL, 10, &f), MHA_ERR_NULL_POINTER,
                 "NULL");
    assert_fails(mha_safetensors_parse("12345678", 8, NULL),
                 MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_safetensors_parse(NULL, 0, &f), MHA_ERR_FORMAT,
                 "too short");
    assert_fails(mha_module_load(path, 2, NULL), MHA_ERR_NULL_POINTER,
                 "NULL");
    assert_fails(mha_module_from_file(NULL, 2, NULL, &m),
                 MHA_ERR_NULL_POINTER, "NULL");

    /* Accessors on NULL. */
    assert_int_equal(mha_tensor_file_count(NULL), 0);
    assert_null(mha_tensor_file_at(NULL, 0));
    assert_null(mha_tensor_file_find(NULL, "a"));
    assert_null(mha_tensor_file_metadata(NULL, "a"));
    mha_tensor_file_free(NULL);
}

/* ------------------------------------------------------------------------ */
/* Valid files                                                              */
/* ------------------------------------------------------------------------ */

static void test_valid_empty(void **state)
{
    (void)state;
    mha_tensor_file *f = parse_ok("{}", NULL, 0);
    assert_int_equal(mha_tensor_file_count(f), 0);
    assert_null(mha_tensor_file_at(f, 0));
    assert_null(mha_tensor_file_at(f, -1));
    assert_null(mha_tensor_file_find(f, "a"));
    assert_null(mha_tensor_file_find(f, NULL));
    assert_null(mha_tensor_file_metadata(f, "format"));
    mha_tensor_file_free(f);

    /* Only metadata; padded with spaces, tabs and newlines. */
    f = parse_ok("{\"__metadata__\":{\"format\":\"pt\"}} \t\r\n   ", NULL, 0);
    assert_int_equal(mha_tensor_file_count(f), 0);
    assert_string_equal(mha_tensor_file_metadata(f, "format"), "pt");
    assert_null(mha_tensor_file_metadata(f, NULL));
    mha_tensor_file_free(f);

    /* Empty metadata object and empty strings. */
    f = parse_ok("{\"__metadata__\":{\"\":\"\"}}", NULL, 0);
    assert_string_equal(mha_tensor_file_metadata(f, ""), "");
    mha_tensor_file_free(f);
}

static void test_valid_zero_size_and_scalar(void **state)
{
    (void)state;
    const float one = 1.5f;
    /* Zero-size tensors at offset 0 and at the end; a scalar between. */
    mha_tensor_file *f = parse_ok(
        "{" T("s", "F32", "[]", 0, 4) "," T("z", "F32", "[0,3]", 0, 0) ","
        T("e", "I64", "[2,0,5]", 4, 4) "}", &one, 4);
    assert_int_equal(mha_tensor_file_count(f), 3);
    const mha_tensor *z = mha_tensor_file_at(f, 0);
    const mha_tensor *s = mha_tensor_file_at(f, 1);
    const mha_tensor *e = mha_tensor_file_at(f, 2);
    assert_string_equal(z->name, "z");
    assert_int_equal(z->ndim, 2);
    assert_int_equal(z->shape[0], 0);
    assert_int_equal(z->shape[1], 3);
    assert_int_equal(z->numel, 0);
    assert_non_null(z->data);
    assert_string_equal(s->name, "s");
    assert_int_equal(s->ndim, 0);
    assert_int_equal(s->numel, 1);
    assert_int_equal(s->dtype, MHA_DTYPE_F32);
    assert_true(((const float *)s->data)[0] == 1.5f);
    assert_string_equal(e->name, "e");
    assert_int_equal(e->ndim, 3);
    assert_int_equal(e->numel, 0);
    assert_int_equal(e->dtype, MHA_DTYPE_I64);
    assert_ptr_equal(mha_tensor_file_find(f, "s"), s);
    mha_tensor_file_free(f);

    /* Two zero-size tensors at the same offset keep their header order. */
    f = parse_ok("{" T("z2", "F32", "[0]", 0, 0) ","
                 T("z1", "BOOL", "[0]", 0, 0) "}", NULL, 0);
    assert_string_equal(mha_tensor_file_at(f, 0)->name, "z2");
    assert_string_equal(mha_tensor_file_at(f, 1)->name, "z1");
    mha_tensor_file_free(f);
}

/* An independent float16 -> float32 conversion, on the bit patterns. */
static uint32_t ref_half_bits(uint16_t h)
{
    uint32_t s = (uint32_t)(h >> 15) << 31, e = (h >> 10) & 0x1f,
             m = h & 0x3ff;
    if (e == 0x1f)
        return s | 0x7f800000u | (m << 13);
    if (e == 0) {
        if (m == 0)
            return s;
        e = 1;
        while (!(m & 0x400)) {
            m <<= 1;
            e--;
        }
        m &= 0x3ff;
        return s | ((e + 112) << 23) | (m << 13);
    }
    return s | ((e + 112) << 23) | (m << 13);
}

static void test_valid_f16_bf16(void **state)
{
    (void)state;
    /* Known conversions. */
    static const struct { uint16_t h; uint32_t f; } known[] = {
        {0x0000, 0x00000000}, {0x8000, 0x80000000}, /* +0, -0         */
        {0x0001, 0x33800000}, {0x8001, 0xb3800000}, /* +-2^-24        */
        {0x03ff, 0x387fc000},                       /* max subnormal  */
        {0x0200, 0x38000000},                       /* 2^-15          */
        {0x0400, 0x38800000},                       /* min normal     */
        {0x3c00, 0x3f800000}, {0xc000, 0xc0000000}, /* 1, -2          */
        {0x3555, 0x3eaaa000},                       /* ~1/3           */
        {0x7bff, 0x477fe000},                       /* 65504          */
        {0x7c00, 0x7f800000}, {0xfc00, 0xff800000}, /* +-inf          */
    };
    const size_t nk = sizeof known / sizeof *known;
    uint16_t h[sizeof known / sizeof *known + 2];
    for (size_t k = 0; k < nk; k++)
        h[k] = known[k].h;
    h[nk] = 0x7e00;       /* NaN */
    h[nk + 1] = 0xfc01;   /* NaN, sign set */
    char hdr[256];
    snprintf(hdr, sizeof hdr, "{" T("h", "F16", "[%zu]", 0, %zu) "}", nk + 2,
             2 * (nk + 2));
    mha_tensor_file *f = parse_ok(hdr, h, sizeof h);
    const mha_tensor *t = mha_tensor_file_find(f, "h");
    assert_int_equal(t->dtype, MHA_DTYPE_F16);
    const float *v = t->data;
    for (size_t k = 0; k < nk; k++)
        if (float_bits(v[k]) != known[k].f)
            fail_msg("F16 0x%04x -> 0x%08x, expected 0x%08x", known[k].h,
                     float_bits(v[k]), known[k].f);
    assert_true(isnan(v[nk]) && isnan(v[nk + 1]));
    mha_tensor_file_free(f);

    /* Every one of the 65536 patterns, F16 and BF16. */
    uint16_t *all = malloc(65536 * 2);
    assert_non_null(all);
    for (uint32_t k = 0; k < 65536; k++)
        all[k] = (uint16_t)k;
    unsigned char *data = malloc(262144);
    assert_non_null(data);
    memcpy(data, all, 131072);
    memcpy(data + 131072, all, 131072);
    f = parse_ok("{" T("h", "F16", "[65536]", 0, 131072) ","
                 T("b", "BF16", "[256,256]", 131072, 262144) "}", data,
                 262144);
    free(data);
    const float *hv = mha_tensor_file_find(f, "h")->data;
    const float *bv = mha_tensor_file_find(f, "b")->data;
    assert_int_equal(mha_tensor_file_find(f, "b")->dtype, MHA_DTYPE_BF16);
    for (uint32_t k = 0; k < 65536; k++) {
        uint32_t want = ref_half_bits((uint16_t)k);
        int nan = ((k >> 10) & 0x1f) == 0x1f && (k & 0x3ff);
        if (nan ? !isnan(hv[k]) || !!signbit(hv[k]) != !!(k & 0x8000)
                : float_bits(hv[k]) != want)
            fail_msg("F16 0x%04x -> 0x%08x, expected 0x%08x", k,
                     float_bits(hv[k]), want);
        uint32_t bw = k << 16;
        int bnan = ((k >> 7) & 0xff) == 0xff && (k & 0x7f);
        if (bnan ? !isnan(bv[k]) : float_bits(bv[k]) != bw)
            fail_msg("BF16 0x%04x -> 0x%08x, expected 0x%08x", k,
                     float_bits(bv[k]), bw);
    }
    mha_tensor_file_free(f);
    free(all);
}

static void test_valid_dtypes(void **state)
{
    (void)state;
    unsigned char data[256];
    size_t off = 0;
    const float f32[2] = {-1.25f, 3.0e-39f};          /* one subnormal */
    const double f64[4] = {0.1, 1.0 / 3.0, -0.0, 1e300};
    const uint8_t b8[4] = {0, 1, 2, 255};
    const int32_t i32[3] = {-1, INT32_MIN, INT32_MAX};
    const int64_t i64[2] = {INT64_MIN, INT64_MAX};
    memcpy(data + off, f32, sizeof f32), off += sizeof f32;     /* 0..8   */
    memcpy(data + off, f64, sizeof f64), off += sizeof f64;     /* 8..40  */
    memcpy(data + off, b8, sizeof b8), off += sizeof b8;        /* 40..44 */
    memcpy(data + off, i32, sizeof i32), off += sizeof i32;     /* 44..56 */
    memcpy(data + off, i64, sizeof i64), off += sizeof i64;     /* 56..72 */
    assert_int_equal(off, 72);
    /* Listed out of order: the file's order is the data order. */
    mha_tensor_file *f = parse_ok(
        "{" T("i64", "I64", "[2]", 56, 72) "," T("f64", "F64", "[2,2]", 8, 40)
        "," T("bool", "BOOL", "[4]", 40, 44) "," T("f32", "F32", "[2]", 0, 8)
        "," T("i32", "I32", "[3,1]", 44, 56) "}", data, off);
    static const char *const order[] = {"f32", "f64", "bool", "i32", "i64"};
    assert_int_equal(mha_tensor_file_count(f), 5);
    for (int k = 0; k < 5; k++)
        assert_string_equal(mha_tensor_file_at(f, k)->name, order[k]);

    const mha_tensor *t = mha_tensor_file_find(f, "f32");
    assert_int_equal(t->dtype, MHA_DTYPE_F32);
    assert_memory_equal(t->data, f32, sizeof f32);

    t = mha_tensor_file_find(f, "f64");
    assert_int_equal(t->dtype, MHA_DTYPE_F64);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->numel, 4);
    const float *fv = t->data;
    assert_int_equal(float_bits(fv[0]), 0x3dcccccdu);
    assert_int_equal(float_bits(fv[1]), 0x3eaaaaabu);
    assert_int_equal(float_bits(fv[2]), 0x80000000u);
    assert_true(isinf(fv[3]) && fv[3] > 0);

    t = mha_tensor_file_find(f, "bool");
    assert_int_equal(t->dtype, MHA_DTYPE_BOOL);
    const uint8_t *bv = t->data;
    assert_int_equal(bv[0], 0);
    assert_int_equal(bv[1], 1);
    assert_int_equal(bv[2], 1);
    assert_int_equal(bv[3], 1);

    t = mha_tensor_file_find(f, "i32");
    assert_int_equal(t->dtype, MHA_DTYPE_I32);
    assert_int_equal(t->ndim, 2);
    const int64_t *iv = t->data;
    assert_true(iv[0] == -1 && iv[1] == INT32_MIN && iv[2] == INT32_MAX);

    t = mha_tensor_file_find(f, "i64");
    assert_int_equal(t->dtype, MHA_DTYPE_I64);
    iv = t->data;
    assert_true(iv[0] == INT64_MIN && iv[1] == INT64_MAX);
    assert_null(mha_tensor_file_find(f, "F32"));   /* names are exact */
    mha_tensor_file_free(f);
}

static void test_valid_metadata_and_padding(void **state)
{
    (void)state;
    const float x[1] = {2.0f};
    /* Metadata after the tensor, header padded with 13 spaces, UTF-8
     * names, an escaped character. */
    mha_tensor_file *f = parse_ok(
        "{" T("w\xc3\xa9ight", "F32", "[1]", 0, 4)
        ",\"__metadata__\":{\"format\":\"pt\",\"num_heads\":\"8\","
        "\"q\":\"a\\\"b\"}}             ", x, 4);
    assert_int_equal(mha_tensor_file_count(f), 1);
    assert_non_null(mha_tensor_file_find(f, "w\xc3\xa9ight"));
    assert_string_equal(mha_tensor_file_metadata(f, "format"), "pt");
    assert_string_equal(mha_tensor_file_metadata(f, "num_heads"), "8");
    assert_string_equal(mha_tensor_file_metadata(f, "q"), "a\"b");
    assert_null(mha_tensor_file_metadata(f, "missing"));
    assert_null(mha_tensor_file_metadata(f, "w\xc3\xa9ight"));
    mha_tensor_file_free(f);

    /* The same through a file. */
    char path[512];
    tmp_path(path, sizeof path, "valid.safetensors");
    bytes b = st_file("{" T("a", "F32", "[1]", 0, 4) "}    ", x, 4);
    write_bytes(path, b.p, b.n);
    free(b.p);
    assert_ok(mha_safetensors_load(path, &f));
    assert_true(((const float *)mha_tensor_file_at(f, 0)->data)[0] == 2.0f);
    mha_tensor_file_free(f);
    remove(path);
}

/* Many metadata keys and many tensors: the duplicate checks must not be
 * quadratic (a 100 MB header holds millions of keys). */
static void test_many_entries(void **state)
{
    (void)state;
    const int n = 50000;
    const size_t cap = (size_t)n * 128 + 64;
    char *h = malloc(cap);
    assert_non_null(h);
    for (int dup = 0; dup < 2; dup++) {
        size_t len = (size_t)snprintf(h, cap, "{\"__metadata__\":{");
        for (int k = 0; k < n; k++)
            len += (size_t)snprintf(h + len, cap - len, "%s\"key%d\":\"%d\"",
                                    k ? "," : "", dup && k == n - 1 ? 17 : k,
                                    k);
        len += (size_t)snprintf(h + len, cap - len, "}");
        for (int k = 0; k < n; k++)
            len += (size_t)snprintf(h + len, cap - len,
                                    ",\"t%d\":{\"dtype\":\"F32\",\"shape\":[0],"
                                    "\"data_offsets\":[0,0]}", k);
        len += (size_t)snprintf(h + len, cap - len, "}");
        assert_true(len < cap);
        bytes b = st_file(h, NULL, 0);
        mha_tensor_file *f = NULL;
        mha_status st = mha_safetensors_parse(b.p, b.n, &f);
        free(b.p);
        if (dup) {
            assert_int_equal(st, MHA_ERR_FORMAT);
            assert_msg_has("duplicate __metadata__ key 'key17'");
            continue;
        }
        assert_ok(st);
        assert_int_equal(mha_tensor_file_count(f), n);
        assert_string_equal(mha_tensor_file_metadata(f, "key4321"), "4321");
        /* Equal (empty) ranges keep the header's order. */
        assert_string_equal(mha_tensor_file_at(f, 0)->name, "t0");
        assert_string_equal(mha_tensor_file_at(f, n - 1)->name, "t49999");
        mha_tensor_file_free(f);
    }
    free(h);
}

/* The parse's memory is bounded by the header's count of JSON values
 * (2^20: each is one of cJSON's nodes): a header of 2^20 - 1 values
 * parses, one of 2^20 + 1 is refused before cJSON sees it. */
static void test_value_limit(void **state)
{
    (void)state;
    const int limit = 1 << 20;
    /* '{', "__metadata__", '{', then two values an entry */
    const int fits = (limit - 3) / 2;            /* 2^20 - 1 values */
    const size_t cap = (size_t)(fits + 1) * 24 + 64;
    char *h = malloc(cap);
    assert_non_null(h);
    for (int over = 0; over < 2; over++) {
        const int n = fits + over;
        size_t len = (size_t)snprintf(h, cap, "{\"__metadata__\":{");
        for (int k = 0; k < n; k++)
            len += (size_t)snprintf(h + len, cap - len, "%s\"k%d\":\"\"",
                                    k ? "," : "", k);
        len += (size_t)snprintf(h + len, cap - len, "}}");
        assert_true(len < cap);
        bytes b = st_file(h, NULL, 0);
        mha_tensor_file *f = NULL;
        const mha_status st = mha_safetensors_parse(b.p, b.n, &f);
        free(b.p);
        if (over) {
            assert_int_equal(st, MHA_ERR_FORMAT);
            assert_null(f);
            assert_msg_has("more than 1048576 JSON values");
        } else {
            assert_ok(st);
            assert_string_equal(mha_tensor_file_metadata(f, "k77"), "");
            mha_tensor_file_free(f);
        }
    }
    free(h);
}

/* ------------------------------------------------------------------------ */
/* The writer                                                               */
/* ------------------------------------------------------------------------ */

static mha_tensor_view view(const char *name, mha_dtype dt, int ndim,
                            int64_t d0, int64_t d1, int64_t d2,
                            const void *data)
{
    mha_tensor_view v;
    memset(&v, 0, sizeof v);
    v.name = name;
    v.dtype = dt;
    v.ndim = ndim;
    v.shape[0] = d0;
    v.shape[1] = d1;
    v.shape[2] = d2;
    v.data = data;
    return v;
}

static void test_writer_round_trip(void **state)
{
    (void)state;
    const float f32[6] = {1, -2, 3.5f, 0, -0.0f, 1e-40f};
    const double f64[2] = {0.5, -1e10};
    const uint16_t f16[3] = {0x3c00, 0x7c00, 0x0001};
    const uint16_t bf16[2] = {0x3f80, 0xc049};
    const uint8_t b8[4] = {1, 0, 1, 1};
    const int32_t i32[3] = {7, -8, INT32_MIN};
    const int64_t i64[2] = {INT64_MAX, -5};
    const float scalar = 42.0f;
    const mha_tensor_view v[] = {
        view("f32", MHA_DTYPE_F32, 2, 2, 3, 0, f32),
        view("z1", MHA_DTYPE_F32, 2, 0, 4, 0, NULL),
        view("z0", MHA_DTYPE_I64, 1, 0, 0, 0, NULL),
        view("f64", MHA_DTYPE_F64, 1, 2, 0, 0, f64),
        view("f16", MHA_DTYPE_F16, 1, 3, 0, 0, f16),
        view("bf16", MHA_DTYPE_BF16, 2, 1, 2, 0, bf16),
        view("bool", MHA_DTYPE_BOOL, 3, 2, 1, 2, b8),
        view("i32", MHA_DTYPE_I32, 1, 3, 0, 0, i32),
        view("i64", MHA_DTYPE_I64, 1, 2, 0, 0, i64),
        view("scalar", MHA_DTYPE_F32, 0, 0, 0, 0, &scalar),
    };
    const int n = (int)(sizeof v / sizeof *v);
    const char *keys[] = {"format", "note"};
    const char *vals[] = {"pt", "caf\xc3\xa9 \"quoted\""};
    char path[512];
    tmp_path(path, sizeof path, "rt.safetensors");
    assert_ok(mha_safetensors_save(path, v, n, keys, vals, 2));
    assert_int_equal(tmpdir_entries(), 1);   /* no temporary file left */

    /* The layout: N is a multiple of 8, the JSON is padded with spaces,
     * the data follows in the given order, nothing after it. */
    bytes b = read_bytes(path);
    uint64_t hl = 0;
    for (int k = 7; k >= 0; k--)
        hl = (hl << 8) | b.p[k];
    assert_int_equal(hl % 8, 0);
    assert_int_equal(b.p[8], '{');
    size_t end = 8 + (size_t)hl;
    while (end > 8 && b.p[end - 1] == ' ')
        end--;
    assert_int_equal(b.p[end - 1], '}');
    assert_true(8 + hl - end < 8);
    const size_t nbytes = sizeof f32 + sizeof f64 + sizeof f16 + sizeof bf16 +
                          sizeof b8 + sizeof i32 + sizeof i64 + sizeof scalar;
    assert_int_equal(b.n, 8 + hl + nbytes);
    assert_memory_equal(b.p + 8 + hl, f32, sizeof f32);
    assert_memory_equal(b.p + b.n - 4, &scalar, 4);

    /* Parsing the bytes gives everything back. */
    mha_tensor_file *f = NULL;
    assert_ok(mha_safetensors_parse(b.p, b.n, &f));
    free(b.p);
    assert_int_equal(mha_tensor_file_count(f), n);
    for (int k = 0; k < n; k++) {
        const mha_tensor *t = mha_tensor_file_at(f, k);
        assert_string_equal(t->name, v[k].name);
        assert_int_equal(t->dtype, v[k].dtype);
        assert_int_equal(t->ndim, v[k].ndim);
        for (int d = 0; d < t->ndim; d++)
            assert_int_equal(t->shape[d], v[k].shape[d]);
    }
    assert_memory_equal(mha_tensor_file_find(f, "f32")->data, f32,
                        sizeof f32);
    const float *fv = mha_tensor_file_find(f, "f64")->data;
    assert_true(fv[0] == 0.5f && fv[1] == -1e10f);
    fv = mha_tensor_file_find(f, "f16")->data;
    assert_true(fv[0] == 1.0f && isinf(fv[1]) && fv[2] == ldexpf(1, -24));
    fv = mha_tensor_file_find(f, "bf16")->data;
    assert_true(fv[0] == 1.0f && fv[1] == -3.140625f);
    assert_memory_equal(mha_tensor_file_find(f, "bool")->data, b8, 4);
    const int64_t *iv = mha_tensor_file_find(f, "i32")->data;
    assert_true(iv[0] == 7 && iv[1] == -8 && iv[2] == INT32_MIN);
    assert_memory_equal(mha_tensor_file_find(f, "i64")->data, i64,
                        sizeof i64);
    assert_true(*(const float *)mha_tensor_file_find(f, "scalar")->data ==
                42.0f);
    assert_string_equal(mha_tensor_file_metadata(f, "note"), vals[1]);
    assert_string_equal(mha_tensor_file_metadata(f, "format"), "pt");
    mha_tensor_file_free(f);

    /* Saving again over the file replaces it; an empty file is "{}". */
    assert_ok(mha_safetensors_save(path, NULL, 0, NULL, NULL, 0));
    b = read_bytes(path);
    assert_int_equal(b.n, 16);
    assert_memory_equal(b.p, "\x08\0\0\0\0\0\0\0{}      ", 16);
    free(b.p);
    remove(path);
}

static void test_writer_errors(void **state)
{
    (void)state;
    char path[1024], dir[512];
    const float x[4] = {1, 2, 3, 4};
    mha_tensor_view v[2] = {view("a", MHA_DTYPE_F32, 1, 2, 0, 0, x),
                            view("b", MHA_DTYPE_F32, 1, 2, 0, 0, x + 2)};
    const int before = tmpdir_entries();

    /* A directory that does not exist: IO error naming it, nothing made. */
    tmp_path(dir, sizeof dir, "no_such_dir");
    snprintf(path, sizeof path, "%s/out.safetensors", dir);
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0), MHA_ERR_IO,
                 path);
    assert_false(file_exists(dir));
    assert_false(file_exists(path));

    tmp_path(path, sizeof path, "w.safetensors");
    /* Duplicate names. */
    v[1].name = "a";
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "duplicate");
    assert_false(file_exists(path));
    v[1].name = "__metadata__";
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "reserved");
    v[1].name = "";
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "name");
    v[1].name = NULL;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "name");
    /* A name that is not UTF-8 would make a file no reader accepts. */
    v[1].name = "b\xff";
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "UTF-8");
    v[1].name = "b";

    /* Bad views. */
    v[1].ndim = MHA_MAX_NDIM + 1;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "'b'");
    v[1].ndim = -1;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "'b'");
    v[1].ndim = 1;
    v[1].dtype = (mha_dtype)99;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "'b'");
    v[1].dtype = MHA_DTYPE_F32;
    v[1].shape[0] = -2;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "'b'");
    v[1].shape[0] = 2;
    v[1].data = NULL;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "'b'");
    v[1].data = x + 2;
    /* A dimension the JSON header cannot hold exactly (> 2^53). */
    v[1].ndim = 2;
    v[1].shape[0] = 0;
    v[1].shape[1] = (int64_t)1 << 60;
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "'b'");
    v[1].ndim = 1;
    v[1].shape[0] = 2;

    /* Arguments and metadata. */
    assert_fails(mha_safetensors_save(NULL, v, 2, NULL, NULL, 0),
                 MHA_ERR_NULL_POINTER, "NULL");
    assert_fails(mha_safetensors_save(path, v, -1, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "");
    assert_fails(mha_safetensors_save(path, NULL, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "");
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 1),
                 MHA_ERR_INVALID_ARGUMENT, "metadata");
    const char *keys[] = {"k", "k"}, *vals[] = {"1", NULL};
    assert_fails(mha_safetensors_save(path, v, 2, keys, vals, 2),
                 MHA_ERR_INVALID_ARGUMENT, "metadata");
    vals[1] = "2";
    assert_fails(mha_safetensors_save(path, v, 2, keys, vals, 2),
                 MHA_ERR_INVALID_ARGUMENT, "duplicate");
    keys[1] = "bad\xc3";
    assert_fails(mha_safetensors_save(path, v, 2, keys, vals, 2),
                 MHA_ERR_INVALID_ARGUMENT, "UTF-8");
    keys[1] = "__metadata__";
    vals[1] = "\xed\xa0\x80";
    assert_fails(mha_safetensors_save(path, v, 2, keys, vals, 2),
                 MHA_ERR_INVALID_ARGUMENT, "UTF-8");
    assert_false(file_exists(path));
    assert_int_equal(tmpdir_entries(), before);

    /* A failed save leaves an existing file as it was. */
    assert_ok(mha_safetensors_save(path, v, 2, NULL, NULL, 0));
    bytes orig = read_bytes(path);
    v[1].name = "a";
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0),
                 MHA_ERR_INVALID_ARGUMENT, "duplicate");
    bytes now = read_bytes(path);
    assert_int_equal(now.n, orig.n);
    assert_memory_equal(now.p, orig.p, orig.n);
    free(orig.p);
    free(now.p);
    /* A directory as the target: IO, no temporary file left. */
    remove(path);
    assert_int_equal(mkdir(path, 0700), 0);
    v[1].name = "b";
    assert_fails(mha_safetensors_save(path, v, 2, NULL, NULL, 0), MHA_ERR_IO,
                 path);
    assert_int_equal(rmdir(path), 0);
    assert_int_equal(tmpdir_entries(), before);
}

/* ------------------------------------------------------------------------ */
/* Modules                                                                  */
/* ------------------------------------------------------------------------ */

static mha_config cfg(int64_t E, int64_t H)
{
    mha_config c;
    memset(&c, 0, sizeof c);
    c.embed_dim = E;
    c.num_heads = H;
    return c;
}

/* Every configuration combination worth a file of its own. */
static int configs(mha_config *out)
{
    int n = 0;
    out[n++] = cfg(8, 2);
    out[n] = cfg(8, 2), out[n].kdim = 5, out[n].vdim = 3, n++;
    out[n] = cfg(8, 4), out[n].kdim = 8, out[n].vdim = 3, n++;
    out[n] = cfg(8, 8), out[n].kdim = 8, out[n].vdim = 8, n++;
    out[n] = cfg(6, 3), out[n].no_bias = 1, n++;
    out[n] = cfg(6, 3), out[n].no_bias = 1, out[n].kdim = 2, n++;
    out[n] = cfg(8, 2), out[n].add_bias_kv = 1, n++;
    out[n] = cfg(8, 2), out[n].add_zero_attn = 1, n++;
    out[n] = cfg(8, 2), out[n].dropout = 0.25f, n++;
    out[n] = cfg(8, 2), out[n].scale = 0.3f, n++;
    out[n] = cfg(4, 1), out[n].kdim = 2, out[n].vdim = 7, out[n].no_bias = 1,
    out[n].add_bias_kv = 1, out[n].add_zero_attn = 1,
    out[n].dropout = 0.1f, out[n].scale = 1.7f, n++;
    out[n] = cfg(12, 3), out[n].add_bias_kv = 1, out[n].add_zero_attn = 1,
    out[n].dropout = 1.0f, n++;
    /* values of their own width (q_proj_weight's rows and out_proj's
     * columns tell d_h and d_v apart), grouped-query, a pruned-like
     * D != E */
    out[n] = cfg(8, 2), out[n].v_head_dim = 6, n++;
    out[n] = cfg(8, 4), out[n].v_head_dim = 1, out[n].num_kv_heads = 2,
    out[n].add_bias_kv = 1, out[n].kdim = 5, n++;
    out[n] = cfg(8, 2), out[n].head_dim = 3, out[n].v_head_dim = 5,
    out[n].no_bias = 1, n++;
    return n;
}

static void assert_same_config(const mha_module *a, const mha_module *b)
{
    mha_config x, y;
    assert_ok(mha_get_config(a, &x));
    assert_ok(mha_get_config(b, &y));
    assert_int_equal(x.embed_dim, y.embed_dim);
    assert_int_equal(x.num_heads, y.num_heads);
    assert_int_equal(x.kdim, y.kdim);
    assert_int_equal(x.vdim, y.vdim);
    assert_int_equal(x.head_dim, y.head_dim);
    assert_int_equal(x.v_head_dim, y.v_head_dim);
    assert_int_equal(x.num_kv_heads, y.num_kv_heads);
    assert_int_equal(!!x.no_bias, !!y.no_bias);
    assert_int_equal(!!x.add_bias_kv, !!y.add_bias_kv);
    assert_int_equal(!!x.add_zero_attn, !!y.add_zero_attn);
    assert_int_equal(float_bits(x.dropout), float_bits(y.dropout));
    assert_int_equal(float_bits(x.scale), float_bits(y.scale));
}

static void assert_same_params(const mha_module *a, const mha_module *b)
{
    assert_int_equal(mha_param_count(a), mha_param_count(b));
    for (int k = 0; k < mha_param_count(a); k++) {
        mha_param_info ia, ib;
        assert_ok(mha_param_info_at(a, k, &ia));
        assert_ok(mha_param_info_at(b, k, &ib));
        assert_string_equal(ia.name, ib.name);
        assert_int_equal(ia.ndim, ib.ndim);
        assert_int_equal(ia.numel, ib.numel);
        float *pa = malloc((size_t)ia.numel * sizeof *pa);
        float *pb = malloc((size_t)ib.numel * sizeof *pb);
        assert_ok(mha_param_get(a, ia.name, pa, ia.numel));
        assert_ok(mha_param_get(b, ib.name, pb, ib.numel));
        assert_memory_equal(pa, pb, (size_t)ia.numel * sizeof *pa);
        free(pa);
        free(pb);
    }
}

static int same_file(const char *p, const char *q)
{
    bytes a = read_bytes(p), b = read_bytes(q);
    int same = a.n == b.n && !memcmp(a.p, b.p, a.n);
    free(a.p);
    free(b.p);
    return same;
}

static void test_module_round_trip(void **state)
{
    (void)state;
    mha_config cs[16];
    const int n = configs(cs);
    char p1[512], p2[512];
    tmp_path(p1, sizeof p1, "m1.safetensors");
    tmp_path(p2, sizeof p2, "m2.safetensors");
    for (int k = 0; k < n; k++) {
        /* Random parameters (biases too): save -> load is exact. */
        mha_module *a = tu_module(&cs[k], 100 + (uint64_t)k), *b = NULL;
        assert_non_null(a);
        assert_ok(mha_module_save(a, p1));
        assert_ok(mha_module_load(p1, 0, &b));
        assert_same_config(a, b);
        assert_same_params(a, b);
        /* The file is the PyTorch state_dict: names and float32. */
        mha_tensor_file *f = NULL;
        assert_ok(mha_safetensors_load(p1, &f));
        assert_int_equal(mha_tensor_file_count(f), mha_param_count(a));
        for (int j = 0; j < mha_param_count(a); j++) {
            mha_param_info info;
            assert_ok(mha_param_info_at(a, j, &info));
            const mha_tensor *t = mha_tensor_file_find(f, info.name);
            assert_non_null(t);
            assert_int_equal(t->dtype, MHA_DTYPE_F32);
            assert_int_equal(t->ndim, info.ndim);
        }
        assert_string_equal(mha_tensor_file_metadata(f, "format"), "pt");
        mha_tensor_file_free(f);
        mha_free(a);
        mha_free(b);

        /* init -> save -> load -> save: byte for byte. */
        cs[k].seed = 7 + (uint64_t)k;
        assert_ok(mha_create(&cs[k], &a));
        assert_ok(mha_module_save(a, p1));
        assert_ok(mha_module_load(p1, 0, &b));
        assert_ok(mha_module_save(b, p2));
        if (!same_file(p1, p2))
            fail_msg("config %d: save -> load -> save is not byte-identical",
                     k);
        assert_same_params(a, b);
        /* An explicit num_heads agrees with the file's. */
        mha_free(b);
        assert_ok(mha_module_load(p1, cs[k].num_heads, &b));
        assert_same_config(a, b);
        mha_free(a);
        mha_free(b);
    }
    remove(p1);
    remove(p2);
    assert_fails(mha_module_save(NULL, p1), MHA_ERR_NULL_POINTER, "NULL");
    assert_false(file_exists(p1));
}

/* ---- mha_module_from_file's errors ---- */

/* A state_dict with E = 4 (kdim 3, vdim 2 for q/k/v), values in [-1, 1). */
static float W_IN[48], B_IN[12], W_O[16], B_O[4], BK[4], BV[4], WQ[16],
    WK[12], WV[8];

static void fill_weights(void)
{
    tu_fill(W_IN, 48, 1, -1, 1);
    tu_fill(B_IN, 12, 2, -1, 1);
    tu_fill(W_O, 16, 3, -1, 1);
    tu_fill(B_O, 4, 4, -1, 1);
    tu_fill(BK, 4, 5, -1, 1);
    tu_fill(BV, 4, 6, -1, 1);
    tu_fill(WQ, 16, 7, -1, 1);
    tu_fill(WK, 12, 8, -1, 1);
    tu_fill(WV, 8, 9, -1, 1);
}

#define V_IN view("in_proj_weight", MHA_DTYPE_F32, 2, 12, 4, 0, W_IN)
#define V_BIN view("in_proj_bias", MHA_DTYPE_F32, 1, 12, 0, 0, B_IN)
#define V_O view("out_proj.weight", MHA_DTYPE_F32, 2, 4, 4, 0, W_O)
#define V_BO view("out_proj.bias", MHA_DTYPE_F32, 1, 4, 0, 0, B_O)
#define V_BK view("bias_k", MHA_DTYPE_F32, 3, 1, 1, 4, BK)
#define V_BV view("bias_v", MHA_DTYPE_F32, 3, 1, 1, 4, BV)
#define V_Q view("q_proj_weight", MHA_DTYPE_F32, 2, 4, 4, 0, WQ)
#define V_K view("k_proj_weight", MHA_DTYPE_F32, 2, 4, 3, 0, WK)
#define V_VV view("v_proj_weight", MHA_DTYPE_F32, 2, 4, 2, 0, WV)

/* Saves the views and metadata, loads them, builds a module; on success
 * the module is in *out (else NULL). */
static mha_status from_views(const mha_tensor_view *v, int n,
                             const char *const *mk, const char *const *mv,
                             int nm, int64_t heads, mha_module **out)
{
    char path[512];
    tmp_path(path, sizeof path, "sd.safetensors");
    assert_ok(mha_safetensors_save(path, v, n, mk, mv, nm));
    mha_tensor_file *f = NULL;
    assert_ok(mha_safetensors_load(path, &f));
    remove(path);
    mha_module *m = (mha_module *)path;
    mha_status st = mha_module_from_file(f, heads, NULL, &m);
    mha_tensor_file_free(f);
    if (st != MHA_OK)
        assert_null(m);
    if (out)
        *out = m;
    else
        mha_free(m);
    return st;
}

#define N_OF(a) ((int)(sizeof(a) / sizeof *(a)))

#define assert_sd_fails(views, heads, status, needle)                       \
    do {                                                                    \
        const mha_tensor_view vs_[] = views;                                \
        assert_fails(from_views(vs_, N_OF(vs_), NULL, NULL, 0, heads, NULL),\
                     status, needle);                                       \
    } while (0)

#define L(...) {__VA_ARGS__}

static void test_module_from_file_errors(void **state)
{
    (void)state;
    fill_weights();
    /* The valid baselines load. */
    {
        const mha_tensor_view ok1[] = {V_IN, V_BIN, V_O, V_BO, V_BK, V_BV};
        assert_ok(from_views(ok1, N_OF(ok1), NULL, NULL, 0, 2, NULL));
        const mha_tensor_view ok2[] = {V_Q, V_K, V_VV, V_O};
        assert_ok(from_views(ok2, N_OF(ok2), NULL, NULL, 0, 4, NULL));
    }
    /* Missing tensors. */
    assert_sd_fails(L(V_IN, V_BIN, V_BO), 2, MHA_ERR_FORMAT,
                    "out_proj.weight is missing");
    assert_sd_fails(L(V_O), 2, MHA_ERR_FORMAT, "in_proj_weight");
    assert_sd_fails(L(V_O, V_BIN, V_BO), 2, MHA_ERR_FORMAT,
                    "in_proj_weight");
    assert_sd_fails(L(V_Q, V_K, V_O), 2, MHA_ERR_FORMAT, "v_proj_weight");
    assert_sd_fails(L(V_Q, V_VV, V_O), 2, MHA_ERR_FORMAT, "k_proj_weight");
    assert_sd_fails(L(V_IN, V_BIN, V_O), 2, MHA_ERR_FORMAT,
                    "out_proj.bias is missing");
    assert_sd_fails(L(V_IN, V_O, V_BO), 2, MHA_ERR_FORMAT,
                    "in_proj_bias is missing");
    assert_sd_fails(L(V_IN, V_O, V_BK), 2, MHA_ERR_FORMAT,
                    "bias_v is missing");
    assert_sd_fails(L(V_IN, V_O, V_BV), 2, MHA_ERR_FORMAT,
                    "bias_k is missing");
    /* Wrong shapes, each named. */
    assert_sd_fails(L(view("in_proj_weight", MHA_DTYPE_F32, 2, 12, 3, 0, W_IN),
                      V_O), 2, MHA_ERR_SHAPE, "in_proj_weight has shape [12, 3]");
    assert_sd_fails(L(view("in_proj_weight", MHA_DTYPE_F32, 1, 48, 0, 0, W_IN),
                      V_O), 2, MHA_ERR_SHAPE, "in_proj_weight");
    assert_sd_fails(L(V_Q, view("k_proj_weight", MHA_DTYPE_F32, 2, 3, 4, 0, WK),
                      V_VV, V_O), 2, MHA_ERR_SHAPE, "k_proj_weight");
    assert_sd_fails(L(V_Q, V_K, view("v_proj_weight", MHA_DTYPE_F32, 1, 8, 0,
                                     0, WV), V_O), 2, MHA_ERR_SHAPE,
                    "v_proj_weight");
    assert_sd_fails(L(view("q_proj_weight", MHA_DTYPE_F32, 2, 4, 3, 0, WQ),
                      V_K, V_VV, V_O), 2, MHA_ERR_SHAPE, "q_proj_weight");
    /* v's rows stand to k's as out_proj's columns to q's rows (H_kv d_v
     * to H_kv d_h); a d_v that splits into no whole heads */
    assert_sd_fails(L(V_Q, V_K, view("v_proj_weight", MHA_DTYPE_F32, 2, 2, 2,
                                     0, WV), V_O), 2, MHA_ERR_SHAPE,
                    "in the ratio of q_proj_weight's 4 rows");
    {
        const mha_tensor_view narrow[] = {
            V_Q, V_K, view("v_proj_weight", MHA_DTYPE_F32, 2, 2, 2, 0, WV),
            view("out_proj.weight", MHA_DTYPE_F32, 2, 4, 2, 0, W_O)};
        assert_ok(from_views(narrow, N_OF(narrow), NULL, NULL, 0, 2, NULL));
        /* rows whose product with q's rows passes 2^63 (an empty
         * tensor's rows, up to the format's 2^53, times 2048): an error,
         * not an overflow */
        float *wq = calloc(2048, sizeof *wq);
        assert_non_null(wq);
        assert_sd_fails(
            L(view("q_proj_weight", MHA_DTYPE_F32, 2, 2048, 1, 0, wq),
              view("k_proj_weight", MHA_DTYPE_F32, 2, 1, 0, 0, NULL),
              view("v_proj_weight", MHA_DTYPE_F32, 2, (int64_t)1 << 53, 0,
                   0, NULL),
              view("out_proj.weight", MHA_DTYPE_F32, 2, 1, 4, 0, W_O)),
            2, MHA_ERR_SHAPE, "k_proj_weight has 1 rows and v_proj_weight");
        free(wq);
        assert_sd_fails(L(V_Q, V_K, view("v_proj_weight", MHA_DTYPE_F32, 2,
                                         3, 2, 0, WV),
                          view("out_proj.weight", MHA_DTYPE_F32, 2, 4, 3, 0,
                               W_O)), 2, MHA_ERR_SHAPE,
                        "out_proj.weight has 3 columns");
    }
    assert_sd_fails(L(V_IN, view("in_proj_bias", MHA_DTYPE_F32, 1, 8, 0, 0,
                                 B_IN), V_O, V_BO), 2, MHA_ERR_SHAPE,
                    "in_proj_bias");
    assert_sd_fails(L(V_IN, V_BIN, V_O, view("out_proj.bias", MHA_DTYPE_F32,
                                             2, 1, 4, 0, B_O)), 2,
                    MHA_ERR_SHAPE, "out_proj.bias");
    assert_sd_fails(L(V_IN, V_O, view("bias_k", MHA_DTYPE_F32, 2, 1, 4, 0, BK),
                      V_BV), 2, MHA_ERR_SHAPE, "bias_k");
    assert_sd_fails(L(V_IN, V_O, V_BK, view("bias_v", MHA_DTYPE_F32, 3, 1, 2,
                                            2, BV)), 2, MHA_ERR_SHAPE,
                    "bias_v");
    assert_sd_fails(L(V_IN, view("out_proj.weight", MHA_DTYPE_F32, 2, 4, 2, 0,
                                 W_O)), 2, MHA_ERR_SHAPE, "out_proj.weight");
    assert_sd_fails(L(V_IN, view("out_proj.weight", MHA_DTYPE_F32, 1, 16, 0, 0,
                                 W_O)), 2, MHA_ERR_SHAPE, "out_proj.weight");
    /* Zero widths: E = 0, kdim = 0 (0 would otherwise mean "E"). */
    assert_sd_fails(L(view("in_proj_weight", MHA_DTYPE_F32, 2, 0, 0, 0, NULL),
                      view("out_proj.weight", MHA_DTYPE_F32, 2, 0, 0, 0,
                           NULL)), 1, MHA_ERR_SHAPE, "out_proj.weight");
    assert_sd_fails(L(V_Q, view("k_proj_weight", MHA_DTYPE_F32, 2, 4, 0, 0,
                                NULL),
                      view("v_proj_weight", MHA_DTYPE_F32, 2, 4, 0, 0, NULL),
                      V_O), 2, MHA_ERR_SHAPE, "k_proj_weight");
    assert_sd_fails(L(V_Q, V_K, view("v_proj_weight", MHA_DTYPE_F32, 2, 4, 0,
                                     0, NULL), V_O), 2, MHA_ERR_SHAPE,
                    "v_proj_weight");
    /* Conflicts and strangers. */
    assert_sd_fails(L(V_IN, V_Q, V_O), 2, MHA_ERR_FORMAT,
                    "both in_proj_weight and q/k/v_proj_weight");
    assert_sd_fails(L(V_IN, V_O, view("encoder.weight", MHA_DTYPE_F32, 1, 4, 0,
                                      0, B_O)), 2, MHA_ERR_FORMAT,
                    "unexpected tensor 'encoder.weight'");
    assert_sd_fails(L(view("attn.in_proj_weight", MHA_DTYPE_F32, 2, 12, 4, 0,
                           W_IN), V_O), 2, MHA_ERR_FORMAT,
                    "'attn.in_proj_weight'");
    /* Non-float dtypes. */
    {
        static const uint8_t ones[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                         1, 1, 1, 1, 1, 1, 1, 1};
        static const int64_t i12[12] = {0};
        assert_sd_fails(L(V_IN, view("out_proj.weight", MHA_DTYPE_BOOL, 2, 4,
                                     4, 0, ones)), 2, MHA_ERR_FORMAT,
                        "out_proj.weight has dtype BOOL");
        assert_sd_fails(L(V_IN, view("in_proj_bias", MHA_DTYPE_I64, 1, 12, 0,
                                     0, i12), V_O, V_BO), 2, MHA_ERR_FORMAT,
                        "in_proj_bias has dtype I64");
    }
    /* Non-finite values name the tensor. */
    {
        float w[48];
        memcpy(w, W_IN, sizeof w);
        w[17] = NAN;
        assert_sd_fails(L(view("in_proj_weight", MHA_DTYPE_F32, 2, 12, 4, 0,
                               w), V_O), 2, MHA_ERR_NON_FINITE,
                        "in_proj_weight");
        float bk[4] = {0, 0, INFINITY, 0};
        assert_sd_fails(L(V_IN, V_O, view("bias_k", MHA_DTYPE_F32, 3, 1, 1, 4,
                                          bk), V_BV), 2, MHA_ERR_NON_FINITE,
                        "bias_k");
        const uint16_t h[16] = {0, 0, 0, 0x7e00};   /* F16 NaN */
        assert_sd_fails(L(V_IN, view("out_proj.weight", MHA_DTYPE_F16, 2, 4, 4,
                                     0, h)), 2, MHA_ERR_NON_FINITE,
                        "out_proj.weight");
        float q[16];
        memcpy(q, WQ, sizeof q);
        q[0] = -INFINITY;
        /* In q_proj_weight that gets packed (kdim = vdim = E). */
        assert_sd_fails(L(view("q_proj_weight", MHA_DTYPE_F32, 2, 4, 4, 0, q),
                          view("k_proj_weight", MHA_DTYPE_F32, 2, 4, 4, 0, WQ),
                          view("v_proj_weight", MHA_DTYPE_F32, 2, 4, 4, 0, WQ),
                          V_O), 2, MHA_ERR_NON_FINITE, "q_proj_weight");
    }
    /* The number of heads. */
    {
        const mha_tensor_view v[] = {V_IN, V_O};
        assert_fails(from_views(v, 2, NULL, NULL, 0, 0, NULL),
                     MHA_ERR_INVALID_ARGUMENT, "num_heads");
        assert_fails(from_views(v, 2, NULL, NULL, 0, -3, NULL),
                     MHA_ERR_INVALID_ARGUMENT, "num_heads");
        const char *k1[] = {"num_heads"};
        const char *bad[] = {"abc", "0", "-2", "2x", "", " 2", "1e0",
                             "99999999999999999999"};
        for (size_t j = 0; j < sizeof bad / sizeof *bad; j++) {
            const char *v1[] = {bad[j]};
            mha_status st = from_views(v, 2, k1, v1, 1, 0, NULL);
            if (st != MHA_ERR_FORMAT || !strstr(mha_last_error(), "num_heads"))
                fail_msg("num_heads '%s': %d, %s", bad[j], (int)st,
                         mha_last_error());
        }
        /* Heads that do not divide E, from metadata or from the caller. */
        const char *v3[] = {"3"};
        assert_fails(from_views(v, 2, k1, v3, 1, 0, NULL),
                     MHA_ERR_INVALID_CONFIG, "divisible");
        assert_fails(from_views(v, 2, NULL, NULL, 0, 3, NULL),
                     MHA_ERR_INVALID_CONFIG, "divisible");
        /* A scale float32 cannot hold is refused, not made 0 or inf. */
        const char *ks[] = {"num_heads", "scale"};
        const char *tiny[] = {"2", "1e-50"}, *huge[] = {"2", "1e39"};
        assert_fails(from_views(v, 2, ks, tiny, 2, 0, NULL), MHA_ERR_FORMAT,
                     "scale = '1e-50' is not valid: expected a finite "
                     "number that float32 holds");
        assert_fails(from_views(v, 2, ks, huge, 2, 0, NULL), MHA_ERR_FORMAT,
                     "scale = '1e39'");
        /* A caller's num_heads that the file contradicts is refused (one
         * of the two is wrong); the same count is taken. */
        const char *v4[] = {"4"};
        mha_module *m = NULL;
        assert_fails(from_views(v, 2, k1, v4, 1, 2, &m),
                     MHA_ERR_INVALID_ARGUMENT,
                     "num_heads 2 was given but __metadata__ says "
                     "num_heads 4");
        assert_null(m);
        assert_ok(from_views(v, 2, k1, v4, 1, 4, &m));
        mha_config c;
        assert_ok(mha_get_config(m, &c));
        assert_int_equal(c.num_heads, 4);
        mha_free(m);
    }
    /* Metadata that disagrees with the shapes, or is not valid. */
    {
        const mha_tensor_view v[] = {V_IN, V_BIN, V_O, V_BO};
        static const struct { const char *k, *v, *needle; mha_status st; }
        meta[] = {
            {"embed_dim", "5", "embed_dim", MHA_ERR_FORMAT},
            {"embed_dim", "four", "embed_dim", MHA_ERR_FORMAT},
            {"kdim", "3", "kdim", MHA_ERR_FORMAT},
            {"vdim", "8", "vdim", MHA_ERR_FORMAT},
            {"bias", "false", "bias", MHA_ERR_FORMAT},
            {"add_bias_kv", "true", "add_bias_kv", MHA_ERR_FORMAT},
            {"add_zero_attn", "maybe", "add_zero_attn", MHA_ERR_FORMAT},
            {"dropout", "x", "dropout", MHA_ERR_FORMAT},
            {"dropout", "nan", "dropout", MHA_ERR_FORMAT},
            {"dropout", "1.5", "dropout", MHA_ERR_INVALID_CONFIG},
            {"scale", "inf", "scale", MHA_ERR_FORMAT},
            {"scale", "1e999", "scale", MHA_ERR_FORMAT},
        };
        for (size_t j = 0; j < sizeof meta / sizeof *meta; j++) {
            const char *mk[] = {"num_heads", meta[j].k};
            const char *mv[] = {"2", meta[j].v};
            mha_status st = from_views(v, 4, mk, mv, 2, 0, NULL);
            if (st != meta[j].st || !strstr(mha_last_error(), meta[j].needle))
                fail_msg("metadata %s = '%s': %d, %s", meta[j].k, meta[j].v,
                         (int)st, mha_last_error());
        }
        /* Agreeing metadata and the optional fields are taken. */
        const char *mk[] = {"num_heads", "embed_dim", "kdim", "vdim", "bias",
                            "add_bias_kv", "add_zero_attn", "dropout",
                            "scale"};
        const char *mv[] = {"4", "4", "4", "4", "True", "False", "1", "0.5",
                            "0.25"};
        mha_module *m = NULL;
        assert_ok(from_views(v, 4, mk, mv, 9, 0, &m));
        mha_config c;
        assert_ok(mha_get_config(m, &c));
        assert_int_equal(c.num_heads, 4);
        assert_int_equal(c.add_zero_attn, 1);
        assert_true(c.dropout == 0.5f && c.scale == 0.25f);
        mha_free(m);
    }
}

static void test_module_from_file_base(void **state)
{
    (void)state;
    fill_weights();
    char path[512];
    tmp_path(path, sizeof path, "base.safetensors");
    const mha_tensor_view v[] = {V_IN, V_O};
    assert_ok(mha_safetensors_save(path, v, 2, NULL, NULL, 0));
    mha_tensor_file *f = NULL;
    assert_ok(mha_safetensors_load(path, &f));
    remove(path);
    mha_config base = cfg(0, 0);
    base.add_zero_attn = 1;
    base.dropout = 0.125f;
    base.scale = 3.0f;
    base.seed = 99;
    mha_module *m = NULL;
    assert_ok(mha_module_from_file(f, 1, &base, &m));
    mha_config c;
    assert_ok(mha_get_config(m, &c));
    assert_int_equal(c.embed_dim, 4);
    assert_int_equal(c.num_heads, 1);
    assert_int_equal(c.no_bias, 1);
    assert_int_equal(c.add_zero_attn, 1);
    assert_true(c.dropout == 0.125f && c.scale == 3.0f);
    assert_int_equal(c.seed, 99);
    mha_free(m);
    assert_fails(mha_module_from_file(f, 1, NULL, NULL),
                 MHA_ERR_NULL_POINTER, "NULL");
    mha_tensor_file_free(f);
}

/* q/k/v_proj_weight with kdim = vdim = E are packed into in_proj_weight,
 * and F64 / F16 / BF16 weights load as their float32 values. */
static void test_module_qkv_packed(void **state)
{
    (void)state;
    const int64_t E = 8, L = 3;
    mha_config c = cfg(E, 2);
    c.add_bias_kv = 1;
    mha_module *a = tu_module(&c, 5);
    assert_non_null(a);
    float w_in[3 * 8 * 8], b_in[24], w_o[64], b_o[8], bk[8], bv[8];
    assert_ok(mha_param_get(a, "in_proj_weight", w_in, 3 * E * E));
    assert_ok(mha_param_get(a, "in_proj_bias", b_in, 3 * E));
    assert_ok(mha_param_get(a, "out_proj.weight", w_o, E * E));
    assert_ok(mha_param_get(a, "out_proj.bias", b_o, E));
    assert_ok(mha_param_get(a, "bias_k", bk, E));
    assert_ok(mha_param_get(a, "bias_v", bv, E));
    /* out_proj.weight as F64: the same float32 values. */
    double w_o64[64];
    for (int k = 0; k < 64; k++)
        w_o64[k] = w_o[k];
    const mha_tensor_view v[] = {
        view("q_proj_weight", MHA_DTYPE_F32, 2, E, E, 0, w_in),
        view("k_proj_weight", MHA_DTYPE_F32, 2, E, E, 0, w_in + E * E),
        view("v_proj_weight", MHA_DTYPE_F32, 2, E, E, 0, w_in + 2 * E * E),
        view("in_proj_bias", MHA_DTYPE_F32, 1, 3 * E, 0, 0, b_in),
        view("bias_k", MHA_DTYPE_F32, 3, 1, 1, E, bk),
        view("bias_v", MHA_DTYPE_F32, 3, 1, 1, E, bv),
        view("out_proj.weight", MHA_DTYPE_F64, 2, E, E, 0, w_o64),
        view("out_proj.bias", MHA_DTYPE_F32, 1, E, 0, 0, b_o),
    };
    mha_module *b = NULL;
    assert_ok(from_views(v, N_OF(v), NULL, NULL, 0, 2, &b));
    mha_param_info info;
    assert_ok(mha_param_info_by_name(b, "in_proj_weight", &info));
    assert_int_equal(mha_param_info_by_name(b, "q_proj_weight", &info),
                     MHA_ERR_NOT_FOUND);
    assert_same_config(a, b);
    assert_same_params(a, b);

    /* The forward passes agree exactly. */
    float x[3 * 8], ya[3 * 8], yb[3 * 8];
    tu_fill(x, L * E, 11, -1, 1);
    mha_forward_args args;
    memset(&args, 0, sizeof args);
    args.batch = 1;
    args.q_len = L;
    args.query = x;
    args.out = ya;
    assert_ok(mha_forward(a, &args));
    args.out = yb;
    assert_ok(mha_forward(b, &args));
    assert_memory_equal(ya, yb, sizeof ya);
    mha_free(b);

    /* BF16 weights: exactly their values. */
    uint16_t h[64];
    float hf[64];
    for (int k = 0; k < 64; k++) {
        uint32_t u = float_bits(w_o[k]) & 0xffff0000u;
        h[k] = (uint16_t)(u >> 16);
        memcpy(&hf[k], &u, 4);
    }
    const mha_tensor_view v2[] = {
        view("in_proj_weight", MHA_DTYPE_F32, 2, 3 * E, E, 0, w_in),
        view("out_proj.weight", MHA_DTYPE_BF16, 2, E, E, 0, h),
    };
    assert_ok(from_views(v2, 2, NULL, NULL, 0, 4, &b));
    float got[64];
    assert_ok(mha_param_get(b, "out_proj.weight", got, 64));
    assert_memory_equal(got, hf, sizeof got);
    mha_free(b);
    mha_free(a);
}

/* Saved files get the mode any new file gets (0666 less the umask), and no
 * temporary file is left beside them. */
static void test_saved_file_mode(void **state)
{
    (void)state;
    mha_config cfg = {0};
    cfg.embed_dim = 4;
    cfg.num_heads = 2;
    mha_module *m = NULL;
    assert_int_equal(mha_create(&cfg, &m), MHA_OK);
    const mode_t masks[2] = {077, 022};
    for (int k = 0; k < 2; k++) {
        char path[512];
        snprintf(path, sizeof path, "%s/mode%d.safetensors", tu_tmpdir, k);
        mode_t old = umask(masks[k]);
        mha_status st = mha_module_save(m, path);
        umask(old);
        assert_int_equal(st, MHA_OK);
        struct stat sb;
        assert_int_equal(stat(path, &sb), 0);
        assert_int_equal(sb.st_mode & 0777, 0666 & ~masks[k]);
        remove(path);
    }
    DIR *d = opendir(tu_tmpdir);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        assert_null(strstr(e->d_name, ".tmp."));
    closedir(d);
    mha_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_escaped_backslash_is_no_nul),
        cmocka_unit_test(test_malformed_table),
        cmocka_unit_test(test_torch_save_files),
        cmocka_unit_test(test_load_io_errors),
        cmocka_unit_test(test_valid_empty),
        cmocka_unit_test(test_valid_zero_size_and_scalar),
        cmocka_unit_test(test_valid_f16_bf16),
        cmocka_unit_test(test_valid_dtypes),
        cmocka_unit_test(test_valid_metadata_and_padding),
        cmocka_unit_test(test_many_entries),
        cmocka_unit_test(test_value_limit),
        cmocka_unit_test(test_writer_round_trip),
        cmocka_unit_test(test_writer_errors),
        cmocka_unit_test(test_module_round_trip),
        cmocka_unit_test(test_module_from_file_errors),
        cmocka_unit_test(test_module_from_file_base),
        cmocka_unit_test(test_module_qkv_packed),
        cmocka_unit_test(test_saved_file_mode),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
