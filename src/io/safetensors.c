/*
 * safetensors.c -- the safetensors format, read and written exactly:
 *
 *   bytes 0..7      N, the header length, unsigned 64-bit little-endian
 *   bytes 8..8+N    a JSON object (UTF-8), possibly padded with spaces:
 *                     "name": {"dtype": "F32", "shape": [2, 3],
 *                              "data_offsets": [begin, end]}
 *                     "__metadata__": {"key": "value", ...}  (optional)
 *   bytes 8+N..     the data buffer; offsets are relative to its start
 *
 * Every rule of the reference implementation is enforced, each with its
 * own message: N <= 100 MB and within the file (and, ours, at most 2^20
 * JSON values, which bounds the parse's memory); valid UTF-8; a JSON object;
 * known dtypes; non-negative integer dimensions; element count times
 * element size (checked) equal to the byte range; ranges sorted,
 * contiguous, non-overlapping and covering the buffer exactly; no
 * duplicate names; __metadata__ maps strings to strings.  JSON is parsed
 * by cJSON, whose nesting limit refuses absurdly deep documents, after a
 * lexical scan that refuses what cJSON alone would wrongly accept (control
 * characters, numbers such as "+1", "01", ".5").
 *
 * Assumes a little-endian host (x86-64, AArch64), as the format does.
 */
#include "io.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "safetensors.c reads little-endian data in place: a big-endian host needs byte swaps"
#endif

#include <cJSON.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_HEADER 100000000ULL
/* cJSON spends ~64 bytes and a string allocation on every value: an 89 MB
 * header of 1.5 million tensors took 1.5 GB to parse.  At most 2^20
 * values (a tensor's entry is about 12: ~85,000 tensors, ~100 MB). */
#define MAX_JSON_VALUES 1048576
/* JSON numbers are doubles: integers are exact up to 2^53. */
#define MAX_JSON_INT 9007199254740992.0
#define MAX_JSON_INT_I ((int64_t)1 << 53)

struct mha_tensor_file {
    int count;
    mha_tensor *tensors;        /* sorted by data offset */
    int n_meta;
    char **meta_keys, **meta_values;
};

/* ---- dtypes and conversions ------------------------------------------- */

/* Every dtype name of the format; those mha does not read are refused as
 * unsupported rather than unknown. */
static const char *const OTHER_DTYPES[] = {"U8", "I8", "I16", "U16", "U32",
                                           "U64", "F8_E5M2", "F8_E4M3"};

static int dtype_from_name(const char *s, mha_dtype *out)
{
    for (int d = MHA_DTYPE_F32; d <= MHA_DTYPE_I64; d++)
        if (!strcmp(s, mha_dtype_name((mha_dtype)d))) {
            *out = (mha_dtype)d;
            return 1;
        }
    for (size_t k = 0; k < sizeof OTHER_DTYPES / sizeof *OTHER_DTYPES; k++)
        if (!strcmp(s, OTHER_DTYPES[k]))
            return 2;
    return 0;
}

static float half_to_float(uint16_t h)
{
    const int sign = h >> 15, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0)
        v = ldexpf((float)man, -24);                  /* zero, subnormal */
    else if (exp == 31)
        v = man ? NAN : INFINITY;
    else
        v = ldexpf((float)(man | 0x400), exp - 25);
    return sign ? -v : v;
}

static float bf16_to_float(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Converts n elements of dtype at src into the C form of mha_tensor. */
static void convert(mha_dtype dt, const unsigned char *src, int64_t n,
                    void *dst)
{
    float *f = dst;
    int64_t *i = dst;
    uint8_t *b = dst;
    for (int64_t k = 0; k < n; k++) {
        const unsigned char *p = src + k * (int64_t)mha_dtype_size(dt);
        uint16_t u16;
        uint32_t u32;
        uint64_t u64;
        double d;
        switch (dt) {
        case MHA_DTYPE_F32: memcpy(&f[k], p, 4); break;
        case MHA_DTYPE_F64: memcpy(&d, p, 8); f[k] = (float)d; break;
        case MHA_DTYPE_F16: memcpy(&u16, p, 2); f[k] = half_to_float(u16); break;
        case MHA_DTYPE_BF16: memcpy(&u16, p, 2); f[k] = bf16_to_float(u16); break;
        case MHA_DTYPE_BOOL: b[k] = *p != 0; break;
        case MHA_DTYPE_I32: memcpy(&u32, p, 4); i[k] = (int32_t)u32; break;
        case MHA_DTYPE_I64: memcpy(&u64, p, 8); i[k] = (int64_t)u64; break;
        }
    }
}

static size_t c_size(mha_dtype dt)
{
    return dt == MHA_DTYPE_BOOL ? 1
         : dt == MHA_DTYPE_I32 || dt == MHA_DTYPE_I64 ? 8 : 4;
}

/* ---- reading ------------------------------------------------------------ */

/* Strict UTF-8: no overlongs, no surrogates, nothing above U+10FFFF. */
static int64_t utf8_invalid_at(const unsigned char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        size_t len;
        unsigned lo = 0x80, hi = 0xbf;
        if (c < 0x80) { i++; continue; }
        else if (c >= 0xc2 && c <= 0xdf) len = 2;
        else if (c == 0xe0) { len = 3; lo = 0xa0; }
        else if (c >= 0xe1 && c <= 0xec) len = 3;
        else if (c == 0xed) { len = 3; hi = 0x9f; }
        else if (c >= 0xee && c <= 0xef) len = 3;
        else if (c == 0xf0) { len = 4; lo = 0x90; }
        else if (c >= 0xf1 && c <= 0xf3) len = 4;
        else if (c == 0xf4) { len = 4; hi = 0x8f; }
        else return (int64_t)i;
        if (i + len > n)
            return (int64_t)i;
        for (size_t k = 1; k < len; k++) {
            unsigned cc = s[i + k];
            if (cc < (k == 1 ? lo : 0x80) || cc > (k == 1 ? hi : 0xbf))
                return (int64_t)i;
        }
        i += len;
    }
    return -1;
}

/*
 * cJSON is more lenient than JSON (RFC 8259) and the reference reader: it
 * skips every byte <= 0x20 as whitespace (so "{\0}" parses as {}), keeps
 * raw control characters inside strings, and reads numbers with strtod
 * ("+1", "01", ".5", "1." pass).  This scan refuses those before cJSON
 * sees the header.  Returns the offset of the first offence, or -1.
 */
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

/* The scan's reason when the header holds more than MAX_JSON_VALUES. */
static const char too_many_values[] = "too many values";

static int64_t json_lexically_invalid_at(const unsigned char *s, size_t n,
                                         const char **why)
{
    size_t i = 0, values = 0;
    while (i < n) {
        const unsigned char c = s[i];
        /* each string (a name too), number, literal, object and array
         * becomes one of cJSON's nodes */
        if (c == '"' || c == '{' || c == '[' || c == '-' || is_digit(c) ||
            ((c == 't' || c == 'f' || c == 'n') &&
             (i == 0 || !(s[i - 1] >= 'a' && s[i - 1] <= 'z')))) {
            if (++values > MAX_JSON_VALUES) {
                *why = too_many_values;
                return (int64_t)i;
            }
        }
        if (c == '"') {
            for (i++; i < n && s[i] != '"'; i++) {
                if (s[i] < 0x20) {
                    *why = "a raw control character in a string";
                    return (int64_t)i;
                }
                /* \u0000 would end a name or a metadata value early as a C
                 * string: "a\u0000b" and "a" would be one name */
                if (s[i] == '\\' && i + 5 < n && s[i + 1] == 'u' &&
                    !memcmp(s + i + 2, "0000", 4)) {
                    *why = "a NUL character (\\u0000) in a string (names "
                           "and metadata are C strings)";
                    return (int64_t)i;
                }
                if (s[i] == '\\')
                    i++;   /* the escaped byte: cJSON checks which it is */
            }
            i++;
        } else if (c < 0x20 && c != '\t' && c != '\n' && c != '\r') {
            *why = "a control character";
            return (int64_t)i;
        } else if (c == '-' || c == '+' || c == '.' || is_digit(c)) {
            /* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)? and then no
             * character that could continue a number. */
            const size_t start = i;
            int ok = 1;
            if (s[i] == '-')
                i++;
            if (i < n && s[i] == '0')
                i++;
            else if (i < n && s[i] >= '1' && s[i] <= '9')
                while (i < n && is_digit(s[i]))
                    i++;
            else
                ok = 0;
            if (ok && i < n && s[i] == '.') {
                ok = ++i < n && is_digit(s[i]);
                while (i < n && is_digit(s[i]))
                    i++;
            }
            if (ok && i < n && (s[i] == 'e' || s[i] == 'E')) {
                if (++i < n && (s[i] == '+' || s[i] == '-'))
                    i++;
                ok = i < n && is_digit(s[i]);
                while (i < n && is_digit(s[i]))
                    i++;
            }
            if (!ok || (i < n && (is_digit(s[i]) || s[i] == '.' ||
                                  s[i] == '+' || s[i] == '-' ||
                                  s[i] == 'e' || s[i] == 'E'))) {
                *why = "a malformed number";
                return (int64_t)start;
            }
            /* Every number of a safetensors header is a dimension or an
             * offset, an integer in the reference's u64 fields: "2.0" and
             * "1e2" are refused as it refuses them. */
            for (size_t k = start; k < i; k++)
                if (s[k] == '.' || s[k] == 'e' || s[k] == 'E') {
                    *why = "a number that is not written as an integer";
                    return (int64_t)start;
                }
        } else {
            i++;
        }
    }
    return -1;
}

/* A JSON number that is an exact integer in [0, 2^53]. */
static int json_uint(const cJSON *j, int64_t *out)
{
    if (!cJSON_IsNumber(j))
        return 0;
    double v = j->valuedouble;
    if (!(v >= 0.0 && v <= MAX_JSON_INT) || v != floor(v))
        return 0;
    *out = (int64_t)v;
    return 1;
}

void mha_tensor_file_free(mha_tensor_file *f)
{
    if (!f)
        return;
    for (int k = 0; k < f->count; k++) {
        free((char *)f->tensors[k].name);
        free(f->tensors[k].data);
    }
    for (int k = 0; k < f->n_meta; k++) {
        free(f->meta_keys[k]);
        free(f->meta_values[k]);
    }
    free(f->tensors);
    free(f->meta_keys);
    free(f->meta_values);
    free(f);
}

static char *dup_str(const char *s)
{
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static int by_string(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static mha_status parse_metadata(mha_tensor_file *f, const cJSON *meta)
{
    if (!cJSON_IsObject(meta))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: __metadata__ is not an object");
    int n = cJSON_GetArraySize(meta);
    f->meta_keys = calloc((size_t)n + 1, sizeof *f->meta_keys);
    f->meta_values = calloc((size_t)n + 1, sizeof *f->meta_values);
    if (!f->meta_keys || !f->meta_values)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "safetensors: cannot allocate metadata");
    for (const cJSON *e = meta->child; e; e = e->next) {
        if (!cJSON_IsString(e))
            return mha_set_error(MHA_ERR_FORMAT,
                                 "safetensors: __metadata__ value of '%s' is "
                                 "not a string", e->string);
        f->meta_keys[f->n_meta] = dup_str(e->string);
        f->meta_values[f->n_meta] = dup_str(e->valuestring);
        f->n_meta++;
        if (!f->meta_keys[f->n_meta - 1] || !f->meta_values[f->n_meta - 1])
            return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                 "safetensors: cannot allocate metadata");
    }
    /* Duplicate keys: sorted, neighbours compared (a pairwise check is
     * quadratic, and a 100 MB header holds millions of keys). */
    char **sorted = malloc(((size_t)f->n_meta + 1) * sizeof *sorted);
    if (!sorted)
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "safetensors: cannot allocate metadata");
    memcpy(sorted, f->meta_keys, (size_t)f->n_meta * sizeof *sorted);
    qsort(sorted, (size_t)f->n_meta, sizeof *sorted, by_string);
    mha_status st = MHA_OK;
    for (int k = 1; k < f->n_meta && st == MHA_OK; k++)
        if (!strcmp(sorted[k], sorted[k - 1]))
            st = mha_set_error(MHA_ERR_FORMAT,
                               "safetensors: duplicate __metadata__ key '%s'",
                               sorted[k]);
    free(sorted);
    return st;
}

typedef struct entry {
    const cJSON *json;
    int index;         /* position in the header: ties keep header order */
    int64_t begin, end;
    mha_tensor t;      /* every field but name and data */
} entry;

static int by_name(const void *a, const void *b)
{
    return strcmp((*(const entry *const *)a)->json->string,
                  (*(const entry *const *)b)->json->string);
}

static int by_offset(const void *a, const void *b)
{
    const entry *x = a, *y = b;
    return x->begin < y->begin ? -1 : x->begin > y->begin ? 1
         : x->end < y->end ? -1 : x->end > y->end ? 1
         : (x->index > y->index) - (x->index < y->index);
}

/* Checks one tensor entry's fields and fills t (without data). */
static mha_status parse_entry(const cJSON *e, mha_tensor *t, entry *span)
{
    const char *name = e->string;
    if (!cJSON_IsObject(e))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' is not an object", name);
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(e, "dtype");
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(e, "shape");
    const cJSON *off = cJSON_GetObjectItemCaseSensitive(e, "data_offsets");
    if (!cJSON_IsString(dt))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' has no string 'dtype'",
                             name);
    int known = dtype_from_name(dt->valuestring, &t->dtype);
    if (known == 0)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' has unknown dtype '%s'",
                             name, dt->valuestring);
    if (known == 2)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "safetensors: tensor '%s' has dtype %s, which "
                             "mha does not read (F32, F64, F16, BF16, BOOL, "
                             "I32, I64)", name, dt->valuestring);
    if (!cJSON_IsArray(sh))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' has no 'shape' array",
                             name);
    int nd = cJSON_GetArraySize(sh);
    if (nd > MHA_MAX_NDIM)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "safetensors: tensor '%s' has %d dimensions, "
                             "more than %d", name, nd, MHA_MAX_NDIM);
    t->ndim = nd;
    t->numel = 1;
    int k = 0;
    int overflow = 0;
    for (const cJSON *d = sh->child; d; d = d->next, k++) {
        if (!json_uint(d, &t->shape[k]))
            return mha_set_error(MHA_ERR_FORMAT,
                                 "safetensors: tensor '%s' dimension %d is not "
                                 "a non-negative integer", name, k);
        if (!mha_mul_ok(t->numel, t->shape[k], &t->numel))
            overflow = 1;
    }
    int64_t bytes = 0;
    if (overflow || !mha_mul_ok(t->numel, (int64_t)mha_dtype_size(t->dtype),
                                &bytes))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s': the byte size of its "
                             "shape overflows 64 bits", name);
    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2 ||
        !json_uint(off->child, &span->begin) ||
        !json_uint(off->child->next, &span->end))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' needs 'data_offsets' "
                             "[begin, end] of non-negative integers", name);
    if (span->end < span->begin)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' has data_offsets [%lld, "
                             "%lld] with end before begin", name,
                             (long long)span->begin, (long long)span->end);
    if (span->end - span->begin != bytes)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: tensor '%s' is %s with %lld "
                             "elements (%lld bytes) but data_offsets span %lld "
                             "bytes", name, dt->valuestring,
                             (long long)t->numel, (long long)bytes,
                             (long long)(span->end - span->begin));
    span->json = e;
    return MHA_OK;
}

static mha_status parse_header(mha_tensor_file *f, const cJSON *root,
                               const unsigned char *buffer, uint64_t buf_len)
{
    int n = 0, has_meta = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (!strcmp(e->string, "__metadata__")) {
            if (has_meta++)
                return mha_set_error(MHA_ERR_FORMAT,
                                     "safetensors: duplicate __metadata__");
            MHA_CHECK(parse_metadata(f, e));
        } else {
            n++;
        }
    }
    entry *spans = calloc((size_t)n + 1, sizeof *spans);
    f->tensors = calloc((size_t)n + 1, sizeof *f->tensors);
    if (!spans || !f->tensors) {
        free(spans);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "safetensors: cannot allocate %d tensors", n);
    }
    mha_status st = MHA_OK;
    int k = 0;
    for (const cJSON *e = root->child; e && st == MHA_OK; e = e->next)
        if (strcmp(e->string, "__metadata__"))
            spans[k].index = k, st = parse_entry(e, &spans[k].t, &spans[k]),
            k++;
    /* Duplicate names: sort pointers by name, compare neighbours. */
    entry **names = st == MHA_OK ? malloc(((size_t)n + 1) * sizeof *names)
                                 : NULL;
    if (st == MHA_OK && !names)
        st = mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                           "safetensors: cannot allocate %d names", n);
    if (st == MHA_OK) {
        for (k = 0; k < n; k++)
            names[k] = &spans[k];
        qsort(names, (size_t)n, sizeof *names, by_name);
        for (k = 1; k < n && st == MHA_OK; k++)
            if (!strcmp(names[k]->json->string, names[k - 1]->json->string))
                st = mha_set_error(MHA_ERR_FORMAT,
                                   "safetensors: duplicate tensor name '%s'",
                                   names[k]->json->string);
    }
    free(names);
    if (st == MHA_OK) {
        /* Sorted by offset, the ranges must tile [0, buf_len) exactly. */
        qsort(spans, (size_t)n, sizeof *spans, by_offset);
        int64_t pos = 0;
        for (k = 0; k < n && st == MHA_OK; k++) {
            if (spans[k].begin != pos)
                st = mha_set_error(MHA_ERR_FORMAT,
                                   "safetensors: tensor '%s' starts at byte "
                                   "%lld of the data buffer, expected %lld "
                                   "(ranges must be contiguous, without "
                                   "holes or overlaps)",
                                   spans[k].json->string,
                                   (long long)spans[k].begin, (long long)pos);
            pos = spans[k].end;
        }
        if (st == MHA_OK && (uint64_t)pos != buf_len)
            st = mha_set_error(MHA_ERR_FORMAT,
                               "safetensors: the tensors cover %lld bytes but "
                               "the data buffer has %llu", (long long)pos,
                               (unsigned long long)buf_len);
    }
    /* Only now that every range is known to be inside the buffer: data. */
    for (k = 0; k < n && st == MHA_OK; k++) {
        mha_tensor *t = &f->tensors[k];
        *t = spans[k].t;
        t->name = dup_str(spans[k].json->string);
        t->data = malloc(t->numel ? (size_t)t->numel * c_size(t->dtype) : 1);
        f->count = k + 1;
        if (!t->name || !t->data)
            st = mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                               "safetensors: cannot allocate tensor '%s'",
                               spans[k].json->string);
        else
            convert(t->dtype, buffer + spans[k].begin, t->numel, t->data);
    }
    free(spans);
    return st;
}

mha_status mha_safetensors_parse(const void *bytes, size_t size,
                                 mha_tensor_file **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output handle is NULL");
    *out = NULL;
    if (!bytes && size)
        return mha_set_error(MHA_ERR_NULL_POINTER, "safetensors: data is NULL");
    const unsigned char *p = bytes;
    if (size < 8)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: %zu bytes, too short for the "
                             "8-byte header length", size);
    /* What people give instead: PyTorch's torch.save files, a zip archive
     * (PK\3\4) since 1.6 or a bare pickle (protocol 2+: 0x80, version).
     * Either could also be a header length, so only when byte 8 is not the
     * '{' a header must begin with. */
    if ((size < 9 || p[8] != '{') &&
        (!memcmp(p, "PK\3\4", 4) || (p[0] == 0x80 && p[1] >= 2 && p[1] <= 5)))
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: this is a PyTorch torch.save file "
                             "(%s), not safetensors; convert it in Python: "
                             "safetensors.torch.save_file(torch.load(path), "
                             "'w.safetensors')",
                             p[0] == 'P' ? "a zip archive" : "a pickle");
    uint64_t n = 0;
    for (int k = 7; k >= 0; k--)
        n = (n << 8) | p[k];
    if (n > MAX_HEADER)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header length %llu exceeds the "
                             "limit of %llu bytes", (unsigned long long)n,
                             MAX_HEADER);
    if (n > size - 8)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header length %llu runs past the "
                             "end of the %zu-byte file", (unsigned long long)n,
                             size);
    int64_t bad = utf8_invalid_at(p + 8, (size_t)n);
    if (bad >= 0)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header is not valid UTF-8 (byte "
                             "%lld)", (long long)bad);
    if (n == 0 || p[8] != '{')
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header does not start with '{'");
    const char *why = NULL;
    bad = json_lexically_invalid_at(p + 8, (size_t)n, &why);
    if (bad >= 0 && why == too_many_values)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: the header holds more than %d "
                             "JSON values (names, numbers, objects; about "
                             "12 a tensor), refused to bound the memory its "
                             "parse takes (~100 bytes a value)",
                             MAX_JSON_VALUES);
    if (bad >= 0)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header is not valid JSON: %s at "
                             "byte %lld", why, (long long)bad);
    /* cJSON's parse writes a process-wide error record (cJSON_GetErrorPtr)
     * on every call: threads loading files at once would race on it, so
     * parses take turns (the position comes back through `end`). */
    static pthread_mutex_t parse_lock = PTHREAD_MUTEX_INITIALIZER;
    const char *end = NULL;
    pthread_mutex_lock(&parse_lock);
    cJSON *root = cJSON_ParseWithLengthOpts((const char *)p + 8, (size_t)n,
                                            &end, 0);
    pthread_mutex_unlock(&parse_lock);
    if (!root)
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header is not valid JSON (or nests "
                             "too deeply), near byte %lld",
                             (long long)(end ? end - (const char *)p - 8 : 0));
    for (const char *c = end; c < (const char *)p + 8 + n; c++)
        if (*c != ' ' && *c != '\t' && *c != '\n' && *c != '\r') {
            cJSON_Delete(root);
            return mha_set_error(MHA_ERR_FORMAT,
                                 "safetensors: trailing bytes after the JSON "
                                 "header object");
        }
    if (!cJSON_IsObject(root)) {
        cJSON_Delete(root);
        return mha_set_error(MHA_ERR_FORMAT,
                             "safetensors: header is not a JSON object");
    }
    mha_tensor_file *f = calloc(1, sizeof *f);
    if (!f) {
        cJSON_Delete(root);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "safetensors: cannot allocate");
    }
    mha_status st = parse_header(f, root, p + 8 + n, size - 8 - n);
    cJSON_Delete(root);
    if (st != MHA_OK) {
        mha_tensor_file_free(f);
        return st;
    }
    *out = f;
    return MHA_OK;
}

mha_status mha_safetensors_load(const char *path, mha_tensor_file **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output handle is NULL");
    *out = NULL;
    unsigned char *data;
    size_t size;
    MHA_CHECK(mha_read_file(path, SIZE_MAX - 1, "safetensors", &data, &size));
    mha_status st = mha_safetensors_parse(data, size, out);
    free(data);
    if (st != MHA_OK) {
        /* Prefix the path to the parser's message. */
        char msg[MHA_ERROR_CAP];
        snprintf(msg, sizeof msg, "%s", mha_last_error());
        mha_set_error(st, "%s: %s", path, msg);
    }
    return st;
}

int mha_tensor_file_count(const mha_tensor_file *f) { return f ? f->count : 0; }

const mha_tensor *mha_tensor_file_at(const mha_tensor_file *f, int index)
{
    return f && index >= 0 && index < f->count ? &f->tensors[index] : NULL;
}

const mha_tensor *mha_tensor_file_find(const mha_tensor_file *f,
                                       const char *name)
{
    if (!f || !name)
        return NULL;
    for (int k = 0; k < f->count; k++)
        if (!strcmp(f->tensors[k].name, name))
            return &f->tensors[k];
    return NULL;
}

const char *mha_tensor_file_metadata(const mha_tensor_file *f, const char *key)
{
    if (!f || !key)
        return NULL;
    for (int k = 0; k < f->n_meta; k++)
        if (!strcmp(f->meta_keys[k], key))
            return f->meta_values[k];
    return NULL;
}

/* ---- writing ------------------------------------------------------------ */

static int utf8_ok(const char *s)
{
    return utf8_invalid_at((const unsigned char *)s, strlen(s)) < 0;
}

/* An integer as a raw JSON token: cJSON would print 1e15 and up in
 * exponent form, which readers of the format refuse.  NULL on failure. */
static cJSON *json_int(int64_t v)
{
    char buf[24];
    snprintf(buf, sizeof buf, "%lld", (long long)v);
    return cJSON_CreateRaw(buf);
}

mha_status mha_safetensors_save(const char *path, const mha_tensor_view *t,
                                int n, const char *const *meta_keys,
                                const char *const *meta_values, int n_meta)
{
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "output path is NULL");
    if (n < 0 || n_meta < 0 || (n && !t) ||
        (n_meta && (!meta_keys || !meta_values)))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "safetensors: bad tensor or metadata list");
    /* Refuse what would make a file that no reader accepts: names and
     * metadata that are not UTF-8, duplicate metadata keys. */
    for (int k = 0; k < n_meta; k++) {
        if (!meta_keys[k] || !meta_values[k])
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "safetensors: metadata entry %d has a NULL "
                                 "key or value", k);
        if (!utf8_ok(meta_keys[k]) || !utf8_ok(meta_values[k]))
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "safetensors: metadata entry %d is not "
                                 "valid UTF-8", k);
        for (int j = 0; j < k; j++)
            if (!strcmp(meta_keys[j], meta_keys[k]))
                return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                     "safetensors: duplicate metadata key "
                                     "'%s'", meta_keys[k]);
    }
    cJSON *root = cJSON_CreateObject();
    mha_status st = root ? MHA_OK
                         : mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                         "safetensors: cannot build header");
    if (st == MHA_OK && n_meta > 0) {
        cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
        for (int k = 0; meta && k < n_meta; k++)
            if (!cJSON_AddStringToObject(meta, meta_keys[k], meta_values[k]))
                meta = NULL;
        if (!meta)
            st = mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                               "safetensors: cannot build the metadata");
    }
    int64_t offset = 0;
    for (int k = 0; st == MHA_OK && k < n; k++) {
        const mha_tensor_view *v = &t[k];
        size_t es = mha_dtype_size(v->dtype);
        int64_t numel = 1, bytes;
        if (!v->name || !*v->name || !strcmp(v->name, "__metadata__") ||
            cJSON_GetObjectItemCaseSensitive(root, v->name)) {
            st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                               "safetensors: tensor %d has a missing, "
                               "reserved or duplicate name", k);
            break;
        }
        if (!utf8_ok(v->name)) {
            st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                               "safetensors: the name of tensor %d is not "
                               "valid UTF-8", k);
            break;
        }
        if (!es || v->ndim < 0 || v->ndim > MHA_MAX_NDIM) {
            st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                               "safetensors: tensor '%s' has a bad dtype or "
                               "rank", v->name);
            break;
        }
        /* JSON numbers are doubles: the reader takes integers up to
         * 2^53, so no dimension or offset may be larger. */
        for (int d = 0; d < v->ndim && st == MHA_OK; d++)
            if (v->shape[d] < 0 || v->shape[d] > MAX_JSON_INT_I)
                st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                   "safetensors: tensor '%s' dimension %d is "
                                   "%lld, outside 0 .. 2^53", v->name, d,
                                   (long long)v->shape[d]);
            else if (!mha_mul_ok(numel, v->shape[d], &numel))
                st = mha_set_error(MHA_ERR_OVERFLOW,
                                   "safetensors: tensor '%s' shape overflows",
                                   v->name);
        if (st == MHA_OK && (!mha_mul_ok(numel, (int64_t)es, &bytes) ||
                             (numel && !v->data)))
            st = mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                               "safetensors: tensor '%s' has no data or too "
                               "many bytes", v->name);
        if (st == MHA_OK && bytes > MAX_JSON_INT_I - offset)
            st = mha_set_error(MHA_ERR_OVERFLOW,
                               "safetensors: tensor '%s' ends past byte 2^53 "
                               "of the data buffer", v->name);
        if (st != MHA_OK)
            break;
        cJSON *e = cJSON_AddObjectToObject(root, v->name);
        cJSON *shape = e ? cJSON_AddArrayToObject(e, "shape") : NULL;
        cJSON *offs = e ? cJSON_AddArrayToObject(e, "data_offsets") : NULL;
        int ok = e && shape && offs &&
                 cJSON_AddStringToObject(e, "dtype", mha_dtype_name(v->dtype));
        for (int d = 0; ok && d < v->ndim; d++)
            ok = cJSON_AddItemToArray(shape, json_int(v->shape[d]));
        ok = ok && cJSON_AddItemToArray(offs, json_int(offset)) &&
             cJSON_AddItemToArray(offs, json_int(offset + bytes));
        if (!ok)
            st = mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                               "safetensors: cannot build header");
        offset += bytes;
    }
    char *json = st == MHA_OK ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    if (st == MHA_OK && !json)
        st = mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                           "safetensors: cannot print header");
    if (st != MHA_OK) {
        free(json);
        return st;
    }
    /* Pad the header with spaces so the data buffer starts 8-aligned. */
    size_t jl = strlen(json), hl = (jl + 7) / 8 * 8;
    char *header = malloc(8 + hl);
    const void **chunks = malloc(((size_t)n + 1) * sizeof *chunks);
    size_t *sizes = malloc(((size_t)n + 1) * sizeof *sizes);
    if (!header || !chunks || !sizes) {
        free(json); free(header); free(chunks); free(sizes);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "safetensors: cannot allocate header");
    }
    for (int k = 0; k < 8; k++)
        header[k] = (char)((uint64_t)hl >> (8 * k));
    memcpy(header + 8, json, jl);
    memset(header + 8 + jl, ' ', hl - jl);
    free(json);
    chunks[0] = header;
    sizes[0] = 8 + hl;
    for (int k = 0; k < n; k++) {
        int64_t numel = 1;
        for (int d = 0; d < t[k].ndim; d++)
            numel *= t[k].shape[d];
        chunks[k + 1] = t[k].data;
        sizes[k + 1] = (size_t)numel * mha_dtype_size(t[k].dtype);
    }
    st = mha_write_file_atomic(path, chunks, sizes, n + 1);
    free(header);
    free(chunks);
    free(sizes);
    return st;
}
