/*
 * npy.c -- NumPy .npy files: a strict reader and an atomic writer.
 *
 * The format (numpy/lib/format.py, NEP 1):
 *
 *     "\x93NUMPY"  major  minor  header_len  header  data
 *
 * header_len is a little-endian uint16 in version 1.0 and a uint32 in
 * versions 2.0 and 3.0.  The header is the repr of a Python dict,
 *
 *     {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
 *
 * padded with spaces and ended by '\n' so that the data starts at a multiple
 * of 64 bytes (16 in old files; any alignment is accepted when reading).
 * Versions 1.0 and 2.0 encode the header in latin1, 3.0 in UTF-8; every
 * header we accept is plain ASCII, so the difference never matters here.
 *
 * The header is parsed by a small strict parser for exactly that dict
 * syntax: the three keys in any order, each exactly once; strings in single
 * or double quotes without escapes; True / False; a tuple of non-negative
 * decimal integers, like (), (5,) or (2, 3); whitespace anywhere between
 * tokens and an optional trailing comma.  Versions 1.0 and 2.0 may carry
 * Python 2's long suffix ("(2L, 3L)"), which NumPy itself still filters
 * out, so it is accepted there.  Anything else is refused with a message.
 *
 * Byte order: the data is copied with memcpy between the file's
 * little-endian layout and native integers and floats, so this file assumes
 * a little-endian host (x86, ARM, RISC-V as everyone runs them).  The #error
 * below stops a build on a big-endian host instead of silently misreading.
 */
#define _POSIX_C_SOURCE 200809L   /* fseeko, fstat */
#include "io.h"
#include "core/half.h"

#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#if defined(__BYTE_ORDER__) && defined(__ORDER_LITTLE_ENDIAN__) && \
    __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "npy.c assumes a little-endian host"
#endif

#define NPY_MAGIC "\x93NUMPY"
#define NPY_MAGIC_LEN 6
#define NPY_ALIGN 64
/* NumPy pads the header so that the first (C order) or last (Fortran
 * order) dimension can grow in place to this many digits; we write the same
 * padding, so our files are byte-identical to np.save's. */
#define NPY_GROWTH_AXIS_MAX_DIGITS 21

/* What the bytes of one element are, in the file. */
typedef enum npy_kind {
    NPY_F4, NPY_F8, NPY_F2, NPY_B1, NPY_U1, NPY_I4, NPY_I8
} npy_kind;

typedef struct npy_header {
    npy_kind kind;
    mha_dtype dtype;
    size_t itemsize;
    int fortran;
    int ndim;
    int64_t shape[MHA_MAX_NDIM];
} npy_header;

/* ------------------------------------------------------------------------ */
/* The header dict                                                          */
/* ------------------------------------------------------------------------ */

typedef struct npy_lexer {
    const unsigned char *p;
    const unsigned char *end;
    int allow_long_suffix;  /* versions 1.0 and 2.0: "3L" */
} npy_lexer;

static void skip_ws(npy_lexer *lx)
{
    while (lx->p < lx->end && (*lx->p == ' ' || *lx->p == '\t' ||
                               *lx->p == '\n' || *lx->p == '\r'))
        lx->p++;
}

/* Skips whitespace and reports whether the next byte is c (not consumed). */
static int peek(npy_lexer *lx, unsigned char c)
{
    skip_ws(lx);
    return lx->p < lx->end && *lx->p == c;
}

/* Skips whitespace and consumes c, or fails naming `where`. */
static mha_status expect(npy_lexer *lx, unsigned char c, const char *where)
{
    if (peek(lx, c)) {
        lx->p++;
        return MHA_OK;
    }
    if (lx->p >= lx->end)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: malformed header: expected '%c' %s, "
                             "found the end of the header", c, where);
    if (*lx->p >= 0x20 && *lx->p < 0x7f)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: malformed header: expected '%c' %s, "
                             "found '%c'", c, where, *lx->p);
    return mha_set_error(MHA_ERR_FORMAT,
                         "npy: malformed header: expected '%c' %s, "
                         "found byte 0x%02x", c, where, *lx->p);
}

/* A quoted string, no escapes, printable ASCII only; at most cap-1 bytes
 * are kept in buf (longer strings are truncated, then fail to match). */
static mha_status lex_string(npy_lexer *lx, char *buf, size_t cap,
                             const char *what)
{
    skip_ws(lx);
    if (lx->p >= lx->end || (*lx->p != '\'' && *lx->p != '"'))
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: malformed header: %s is not a quoted "
                             "string", what);
    const unsigned char quote = *lx->p++;
    size_t n = 0;
    for (;;) {
        /* A Python string literal cannot span lines. */
        if (lx->p >= lx->end || *lx->p == '\n')
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: malformed header: unterminated "
                                 "string in %s", what);
        const unsigned char c = *lx->p++;
        if (c == quote)
            break;
        if (c == '\\')
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: malformed header: escape sequence in "
                                 "%s is not supported", what);
        if (c < 0x20 || c >= 0x7f)
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: malformed header: byte 0x%02x in the "
                                 "string of %s", c, what);
        if (n + 1 < cap)
            buf[n++] = (char)c;
        else
            n = cap;   /* too long: mark, keep scanning to the quote */
    }
    if (n >= cap) {
        buf[cap - 1] = 0;
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: malformed header: string in %s is too "
                             "long (starts '%s')", what, buf);
    }
    buf[n] = 0;
    return MHA_OK;
}

/* An identifier-like bare word (True, False, ...), for messages too. */
static size_t lex_word(npy_lexer *lx, char *buf, size_t cap)
{
    skip_ws(lx);
    size_t n = 0;
    while (lx->p < lx->end && ((*lx->p >= 'a' && *lx->p <= 'z') ||
                               (*lx->p >= 'A' && *lx->p <= 'Z') ||
                               (*lx->p >= '0' && *lx->p <= '9') ||
                               *lx->p == '_')) {
        if (n + 1 < cap)
            buf[n] = (char)*lx->p;
        n++;
        lx->p++;
    }
    buf[n < cap ? n : cap - 1] = 0;
    return n;
}

static mha_status parse_descr(npy_lexer *lx, npy_header *h)
{
    if (peek(lx, '['))
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "npy: structured (record) dtypes are not "
                             "supported");
    char d[40];
    MHA_CHECK(lex_string(lx, d, sizeof d, "'descr'"));

    /* The byte-order character, then the type code and its size. */
    const char order = d[0];
    if (order != '<' && order != '>' && order != '=' && order != '|')
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "npy: dtype '%s' is not supported (expected "
                             "'<f4', '<f8', '<f2', '|b1', '|u1', '<i4' or "
                             "'<i8')", d);
    const char *code = d + 1;
    static const struct {
        const char *code;
        npy_kind kind;
        mha_dtype dtype;
        size_t size;
    } known[] = {
        {"f4", NPY_F4, MHA_DTYPE_F32, 4}, {"f8", NPY_F8, MHA_DTYPE_F64, 8},
        {"f2", NPY_F2, MHA_DTYPE_F16, 2},
        {"b1", NPY_B1, MHA_DTYPE_BOOL, 1}, {"u1", NPY_U1, MHA_DTYPE_BOOL, 1},
        {"i4", NPY_I4, MHA_DTYPE_I32, 4}, {"i8", NPY_I8, MHA_DTYPE_I64, 8},
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        if (strcmp(code, known[k].code) != 0)
            continue;
        /* Byte order means nothing for one-byte types: any is fine.  For
         * wider ones '<' is little-endian, '=' native (= little here),
         * '|' "not applicable", which NumPy never writes for them. */
        if (known[k].size > 1 && order == '>')
            return mha_set_error(MHA_ERR_UNSUPPORTED,
                                 "npy: big-endian dtype '%s' is not "
                                 "supported (only little-endian)", d);
        if (known[k].size > 1 && order == '|')
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: dtype '%s' has no byte order, but "
                                 "its elements are %zu bytes", d,
                                 known[k].size);
        h->kind = known[k].kind;
        h->dtype = known[k].dtype;
        h->itemsize = known[k].size;
        return MHA_OK;
    }
    if (code[0] == 'O')
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "npy: object arrays (dtype '%s') are not "
                             "supported", d);
    return mha_set_error(MHA_ERR_UNSUPPORTED,
                         "npy: dtype '%s' is not supported (expected '<f4', "
                         "'<f8', '<f2', '|b1', '|u1', '<i4' or '<i8')", d);
}

static mha_status parse_fortran(npy_lexer *lx, npy_header *h)
{
    char w[16];
    const size_t n = lex_word(lx, w, sizeof w);
    if (n == 4 && strcmp(w, "True") == 0) {
        h->fortran = 1;
        return MHA_OK;
    }
    if (n == 5 && strcmp(w, "False") == 0) {
        h->fortran = 0;
        return MHA_OK;
    }
    return mha_set_error(MHA_ERR_FORMAT,
                         "npy: malformed header: 'fortran_order' must be "
                         "True or False%s%s%s", n ? ", not '" : "",
                         n ? w : "", n ? (n < sizeof w ? "'" : "...'") : "");
}

/* One dimension: a non-negative decimal integer that fits int64_t. */
static mha_status parse_dim(npy_lexer *lx, int64_t index, int64_t *out)
{
    skip_ws(lx);
    if (lx->p < lx->end && *lx->p == '-') {
        const unsigned char *q = lx->p + 1;
        if (q < lx->end && *q >= '0' && *q <= '9') {
            long long v = 0;
            while (q < lx->end && *q >= '0' && *q <= '9' && v < 1000000000LL)
                v = v * 10 + (*q++ - '0');
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: shape dimension %lld is negative "
                                 "(-%lld%s)", (long long)index, v,
                                 (q < lx->end && *q >= '0' && *q <= '9')
                                     ? "..." : "");
        }
    }
    if (lx->p >= lx->end || *lx->p < '0' || *lx->p > '9') {
        char w[24];
        const size_t n = lex_word(lx, w, sizeof w);
        if (n)
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: shape dimension %lld is not a "
                                 "non-negative integer: '%s'",
                                 (long long)index, w);
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: shape dimension %lld is not a "
                             "non-negative integer", (long long)index);
    }
    uint64_t v = 0;
    int too_big = 0;
    while (lx->p < lx->end && *lx->p >= '0' && *lx->p <= '9') {
        const unsigned d = (unsigned)(*lx->p++ - '0');
        if (v > ((uint64_t)INT64_MAX - d) / 10)
            too_big = 1;
        else
            v = v * 10 + d;
    }
    if (lx->allow_long_suffix && lx->p < lx->end && *lx->p == 'L')
        lx->p++;
    if (lx->p < lx->end && ((*lx->p >= 'a' && *lx->p <= 'z') ||
                            (*lx->p >= 'A' && *lx->p <= 'Z') ||
                            *lx->p == '_' || *lx->p == '.'))
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: shape dimension %lld is not a non-negative "
                             "decimal integer (found '%c' after its digits)",
                             (long long)index, *lx->p);
    if (too_big)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "npy: shape dimension %lld does not fit in 64 "
                             "bits", (long long)index);
    *out = (int64_t)v;
    return MHA_OK;
}

static mha_status parse_shape(npy_lexer *lx, npy_header *h)
{
    MHA_CHECK(expect(lx, '(', "to open 'shape'"));
    int64_t n = 0;   /* a 4 GiB header could hold 2**31 dimensions */
    int trailing_comma = 0;
    while (!peek(lx, ')')) {
        int64_t dim = 0;
        MHA_CHECK(parse_dim(lx, n, &dim));
        if (n < MHA_MAX_NDIM)
            h->shape[n] = dim;
        n++;
        trailing_comma = 0;
        if (peek(lx, ',')) {
            lx->p++;
            trailing_comma = 1;
        } else if (!peek(lx, ')')) {
            return expect(lx, ',', "between the dimensions of 'shape'");
        }
    }
    lx->p++; /* ')' */
    if (n == 1 && !trailing_comma)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: malformed header: 'shape' (%lld) is not "
                             "a tuple (a 1-tuple needs a trailing comma)",
                             (long long)h->shape[0]);
    if (n > MHA_MAX_NDIM)
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "npy: the array has %lld dimensions, more than "
                             "the %d supported", (long long)n, MHA_MAX_NDIM);
    h->ndim = (int)n;
    return MHA_OK;
}

static mha_status parse_dict(npy_lexer *lx, npy_header *h)
{
    enum { K_DESCR, K_FORTRAN, K_SHAPE, K_COUNT };
    static const char *const names[K_COUNT] = {"descr", "fortran_order",
                                               "shape"};
    int seen[K_COUNT] = {0, 0, 0};

    MHA_CHECK(expect(lx, '{', "at the start of the header dict"));
    while (!peek(lx, '}')) {
        char key[32];
        MHA_CHECK(lex_string(lx, key, sizeof key, "a key of the header"));
        int k = 0;
        while (k < K_COUNT && strcmp(key, names[k]) != 0)
            k++;
        if (k == K_COUNT)
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: unknown key '%s' in the header "
                                 "(expected 'descr', 'fortran_order', "
                                 "'shape')", key);
        if (seen[k])
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: duplicate key '%s' in the header", key);
        seen[k] = 1;
        MHA_CHECK(expect(lx, ':', "after a key of the header"));
        if (k == K_DESCR)
            MHA_CHECK(parse_descr(lx, h));
        else if (k == K_FORTRAN)
            MHA_CHECK(parse_fortran(lx, h));
        else
            MHA_CHECK(parse_shape(lx, h));
        if (peek(lx, ','))
            lx->p++;
        else if (!peek(lx, '}'))
            return expect(lx, ',', "between the entries of the header dict");
    }
    lx->p++; /* '}' */
    skip_ws(lx);
    if (lx->p != lx->end)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: malformed header: unexpected bytes after "
                             "the closing '}'");
    for (int k = 0; k < K_COUNT; k++)
        if (!seen[k])
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: the header has no '%s' key", names[k]);
    return MHA_OK;
}

/* ------------------------------------------------------------------------ */
/* Reading                                                                  */
/* ------------------------------------------------------------------------ */

/* Element s of the file (kind) -> element c of dst (the C type of the
 * converted tensor).  Returns 0 for a |b1 byte other than 0 or 1. */
static int convert_one(npy_kind kind, const unsigned char *src, int64_t s,
                       void *dst, int64_t c)
{
    switch (kind) {
    case NPY_F4: {
        float v;
        memcpy(&v, src + (size_t)s * 4, 4);
        ((float *)dst)[c] = v;
        return 1;
    }
    case NPY_F2: {   /* IEEE binary16, widened exactly */
        uint16_t v;
        memcpy(&v, src + (size_t)s * 2, 2);
        ((float *)dst)[c] = mha_f16_to_float(v);
        return 1;
    }
    case NPY_F8: {
        /* Out-of-range values round to +-inf, as IEEE conversion does. */
        double v;
        memcpy(&v, src + (size_t)s * 8, 8);
        ((float *)dst)[c] = (float)v;
        return 1;
    }
    case NPY_B1: {
        /* NumPy's bool is one byte 0 or 1.  Any other byte means the file
         * is not what it says it is, so it is refused rather than guessed. */
        const unsigned char v = src[s];
        ((uint8_t *)dst)[c] = v;
        return v <= 1;
    }
    case NPY_U1:
        /* uint8 read as a bool mask: nonzero is 1. */
        ((uint8_t *)dst)[c] = src[s] != 0;
        return 1;
    case NPY_I4: {
        int32_t v;
        memcpy(&v, src + (size_t)s * 4, 4);
        ((int64_t *)dst)[c] = v;
        return 1;
    }
    case NPY_I8: {
        int64_t v;
        memcpy(&v, src + (size_t)s * 8, 8);
        ((int64_t *)dst)[c] = v;
        return 1;
    }
    }
    return 1;
}

/* Converts numel elements of data into dst in C order.  A Fortran-order
 * array's element (i0, ..., i_{n-1}) sits at i0 + d0 * (i1 + d1 * (...)):
 * the multi-index of the C-order position is kept and the Fortran offset
 * follows it incrementally. */
static mha_status convert_all(const npy_header *h, const unsigned char *data,
                              int64_t numel, void *dst)
{
    /* numel > 0: every partial product of the shape is <= numel, so the
     * strides cannot overflow (an empty array may have huge dimensions). */
    const int transpose = h->fortran && h->ndim > 1 && numel > 0;
    int64_t fstride[MHA_MAX_NDIM];
    int64_t idx[MHA_MAX_NDIM];
    int64_t s = 0;
    if (transpose) {
        int64_t st = 1;
        for (int k = 0; k < h->ndim; k++) {
            fstride[k] = st;
            idx[k] = 0;
            st *= h->shape[k];
        }
    }
    for (int64_t c = 0; c < numel; c++) {
        if (!convert_one(h->kind, data, transpose ? s : c, dst, c))
            return mha_set_error(MHA_ERR_FORMAT,
                                 "npy: bool element %lld is %u, not 0 or 1",
                                 (long long)(transpose ? s : c),
                                 (unsigned)data[transpose ? s : c]);
        if (transpose) {
            for (int k = h->ndim - 1; k >= 0; k--) {
                s += fstride[k];
                if (++idx[k] < h->shape[k])
                    break;
                s -= idx[k] * fstride[k];
                idx[k] = 0;
            }
        }
    }
    return MHA_OK;
}

static const char *shape_string(const int64_t *shape, int ndim, char *buf,
                                size_t cap)
{
    size_t n = (size_t)snprintf(buf, cap, "(");
    for (int k = 0; k < ndim && n < cap; k++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", k ? ", " : "",
                              (long long)shape[k]);
    if (n < cap)
        snprintf(buf + n, cap - n, "%s)", ndim == 1 ? "," : "");
    return buf;
}

/*
 * The preamble and header of a .npy file whose first `size` bytes are at
 * b, the whole file `file_size` bytes: every check of the header, and of
 * the data's length against the file's, before any data is read.  Sets
 * *h, *data_off (where the data starts) and *numel.
 */
static mha_status npy_header_of(const unsigned char *b, size_t size,
                                uint64_t file_size, npy_header *h,
                                size_t *data_off, int64_t *numel_out)
{
    /* ---- preamble: magic, version, header length ---- */
    if (size == 0)
        return mha_set_error(MHA_ERR_FORMAT, "npy: the input is empty");
    const size_t head = size < NPY_MAGIC_LEN ? size : NPY_MAGIC_LEN;
    if (memcmp(b, NPY_MAGIC, head) != 0)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: not a .npy file (bad magic; expected "
                             "\\x93NUMPY)");
    if (size < NPY_MAGIC_LEN + 2)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: truncated: %zu bytes, too short for the "
                             "magic and version", size);
    const unsigned major = b[6], minor = b[7];
    size_t len_bytes;
    if (major == 1 && minor == 0)
        len_bytes = 2;
    else if ((major == 2 || major == 3) && minor == 0)
        len_bytes = 4;
    else
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "npy: unsupported format version %u.%u "
                             "(supported: 1.0, 2.0, 3.0)", major, minor);
    const size_t preamble = NPY_MAGIC_LEN + 2 + len_bytes;
    if (size < preamble)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: truncated: %zu bytes, too short for the "
                             "version %u.0 header length", size, major);
    uint64_t hlen = (uint64_t)b[8] | (uint64_t)b[9] << 8;
    if (len_bytes == 4)
        hlen |= (uint64_t)b[10] << 16 | (uint64_t)b[11] << 24;
    if (hlen > size - preamble)
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: header length %llu runs past the end of "
                             "the file (%zu bytes after the preamble)",
                             (unsigned long long)hlen, size - preamble);
    if (hlen == 0 || b[preamble + hlen - 1] != '\n')
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: the header does not end in a newline "
                             "(header length %llu)",
                             (unsigned long long)hlen);

    /* ---- the dict ---- */
    memset(h, 0, sizeof *h);
    npy_lexer lx = {b + preamble, b + preamble + hlen, major <= 2};
    MHA_CHECK(parse_dict(&lx, h));

    /* ---- sizes, all checked before anything is allocated ---- */
    int64_t numel = 1;
    for (int k = 0; k < h->ndim; k++)
        if (h->shape[k] == 0)
            numel = 0;   /* empty, however large the other dimensions */
    for (int k = 0; k < h->ndim && numel != 0; k++)
        if (!mha_mul_ok(numel, h->shape[k], &numel)) {
            char s[256];
            return mha_set_error(MHA_ERR_OVERFLOW,
                                 "npy: the element count of shape %s "
                                 "overflows 64 bits",
                                 shape_string(h->shape, h->ndim, s, sizeof s));
        }
    int64_t nbytes;
    if (!mha_mul_ok(numel, (int64_t)h->itemsize, &nbytes)) {
        char s[256];
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "npy: the data size of shape %s (%lld elements "
                             "of %zu bytes) overflows 64 bits",
                             shape_string(h->shape, h->ndim, s, sizeof s),
                             (long long)numel, h->itemsize);
    }
    *data_off = preamble + (size_t)hlen;
    const uint64_t have = file_size - *data_off;
    if ((uint64_t)nbytes > have) {
        char s[256];
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: truncated data: shape %s needs %lld bytes, "
                             "the file has %llu",
                             shape_string(h->shape, h->ndim, s, sizeof s),
                             (long long)nbytes, (unsigned long long)have);
    }
    if ((uint64_t)nbytes < have) {
        char s[256];
        return mha_set_error(MHA_ERR_FORMAT,
                             "npy: %llu trailing bytes after the data of "
                             "shape %s (%lld bytes)",
                             (unsigned long long)(have - (uint64_t)nbytes),
                             shape_string(h->shape, h->ndim, s, sizeof s),
                             (long long)nbytes);
    }
    *numel_out = numel;
    return MHA_OK;
}

/* The size of one element as loaded (float32, uint8 bool or int64). */
static size_t out_item_of(const npy_header *h)
{
    return h->dtype == MHA_DTYPE_BOOL ? 1
         : (h->dtype == MHA_DTYPE_I32 || h->dtype == MHA_DTYPE_I64)
               ? sizeof(int64_t)
               : sizeof(float);
}

mha_status mha_npy_parse(const void *bytes, size_t size, mha_tensor **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: out is NULL");
    *out = NULL;
    if (!bytes && size > 0)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: bytes is NULL");
    const unsigned char *b = bytes;
    npy_header h;
    size_t data_off;
    int64_t numel;
    MHA_CHECK(npy_header_of(b, size, size, &h, &data_off, &numel));

    /* numel <= size here, so the output size overflows only where size_t
     * is narrower than 8 * size. */
    const size_t out_item = out_item_of(&h);
    if ((uint64_t)numel > SIZE_MAX / out_item)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "npy: %lld elements do not fit in memory",
                             (long long)numel);
    const size_t out_bytes = (size_t)numel * out_item;

    mha_tensor *t = malloc(sizeof *t);
    void *dst = malloc(out_bytes ? out_bytes : 1);
    if (!t || !dst) {
        free(t);
        free(dst);
        return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                             "npy: cannot allocate %zu bytes for the tensor",
                             out_bytes);
    }
    mha_status st = convert_all(&h, b + data_off, numel, dst);
    if (st != MHA_OK) {
        free(t);
        free(dst);
        return st;
    }
    memset(t, 0, sizeof *t);
    t->name = "";   /* static: mha_tensor_free does not free it */
    t->dtype = h.dtype;
    t->ndim = h.ndim;
    for (int k = 0; k < h.ndim; k++)
        t->shape[k] = h.shape[k];
    t->numel = numel;
    t->data = dst;
    *out = t;
    return MHA_OK;
}

mha_status mha_npy_load(const char *path, mha_tensor **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: out is NULL");
    *out = NULL;
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: path is NULL");
    unsigned char *buf;
    size_t size;
    /* No format limit on the size: the file is read whole, so the limit is
     * memory (a failed allocation is MHA_ERR_OUT_OF_MEMORY with the size);
     * SIZE_MAX - 1 only keeps mha_read_file's size + 1 from wrapping. */
    MHA_CHECK(mha_read_file(path, SIZE_MAX - 1, "npy", &buf, &size));
    mha_status st = mha_npy_parse(buf, size, out);
    free(buf);
    if (st != MHA_OK) {
        /* Name the file: "npy: x" -> "'path': x". */
        char msg[MHA_ERROR_CAP];
        const char *e = mha_last_error();
        if (strncmp(e, "npy: ", 5) == 0)
            e += 5;
        snprintf(msg, sizeof msg, "%s", e);
        return mha_set_error(st, "npy: '%s': %s", path, msg);
    }
    return MHA_OK;
}

/* ---- reading part of a file ----------------------------------------- */

/* Opens path (a regular file), reads and checks its header: *f open at
 * the caller's charge on success. */
static mha_status open_header(const char *path, FILE **f, npy_header *h,
                              size_t *data_off, int64_t *numel)
{
    *f = NULL;
    FILE *fp;
    MHA_CHECK(mha_open_regular(path, "npy", &fp));
    struct stat st;
    if (fstat(fileno(fp), &st) != 0) {
        fclose(fp);
        return mha_set_error(MHA_ERR_IO, "npy: cannot stat '%s': %s", path,
                             strerror(errno));
    }
    /* the preamble, then as much of the header as it says (a header of
     * more than 16 MiB is no header NumPy writes) */
    unsigned char pre[12] = {0};
    size_t n = fread(pre, 1, sizeof pre, fp);
    uint64_t hlen = n >= 10 ? ((uint64_t)pre[8] | (uint64_t)pre[9] << 8) : 0;
    if (n >= 12 && pre[6] >= 2)
        hlen |= (uint64_t)pre[10] << 16 | (uint64_t)pre[11] << 24;
    size_t want = (size_t)(hlen < (16u << 20) ? hlen : 16u << 20) + 12;
    if ((uint64_t)want > (uint64_t)st.st_size)
        want = (size_t)st.st_size;
    unsigned char *b = malloc(want + 1);
    mha_status r = MHA_OK;
    if (!b)
        r = mha_set_error(MHA_ERR_OUT_OF_MEMORY, "npy: '%s': cannot allocate "
                          "its header", path);
    else if (fseeko(fp, 0, SEEK_SET) != 0 || fread(b, 1, want, fp) != want)
        r = mha_set_error(MHA_ERR_IO, "npy: short read on '%s'", path);
    if (r == MHA_OK)
        r = npy_header_of(b, want, (uint64_t)st.st_size, h, data_off, numel);
    free(b);
    if (r != MHA_OK) {
        fclose(fp);
        if (strncmp(mha_last_error(), "npy: '", 6) != 0) {
            char msg[MHA_ERROR_CAP];
            snprintf(msg, sizeof msg, "%s", mha_last_error() + 5);
            return mha_set_error(r, "npy: '%s': %s", path, msg);
        }
        return r;
    }
    *f = fp;
    return MHA_OK;
}

mha_status mha_npy_info(const char *path, mha_tensor_view *info)
{
    if (!path || !info)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: %s is NULL",
                             !path ? "path" : "info");
    FILE *f;
    npy_header h;
    size_t off;
    int64_t numel;
    MHA_CHECK(open_header(path, &f, &h, &off, &numel));
    fclose(f);
    memset(info, 0, sizeof *info);
    info->name = "";
    info->dtype = h.dtype;
    info->ndim = h.ndim;
    for (int k = 0; k < h.ndim; k++)
        info->shape[k] = h.shape[k];
    return MHA_OK;
}

mha_status mha_npy_load_rows(const char *path, int nranges,
                             const int64_t *starts, const int64_t *counts,
                             mha_tensor **out)
{
    if (!out)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: out is NULL");
    *out = NULL;
    if (!path || (nranges > 0 && (!starts || !counts)))
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy: %s is NULL",
                             !path ? "path" : "starts or counts");
    if (nranges < 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT, "npy: nranges %d < 0",
                             nranges);
    FILE *f;
    npy_header h;
    size_t off;
    int64_t numel;
    MHA_CHECK(open_header(path, &f, &h, &off, &numel));
    mha_status st = MHA_OK;
    if (h.ndim < 2)
        st = mha_set_error(MHA_ERR_SHAPE, "npy: '%s': rows of a %d-D array: "
                           "need at least 2 dimensions", path, h.ndim);
    const int64_t L = h.ndim >= 2 ? h.shape[h.ndim - 2] : 0;
    const int64_t w = h.ndim >= 2 ? h.shape[h.ndim - 1] : 0;
    int64_t rows = 0, lead = 1;
    for (int i = 0; st == MHA_OK && i < nranges; i++) {
        if (starts[i] < 0 || counts[i] < 0 || starts[i] > L ||
            counts[i] > L - starts[i])
            st = mha_set_error(MHA_ERR_SHAPE, "npy: '%s': rows [%lld, %lld) "
                               "outside the %lld rows", path,
                               (long long)starts[i],
                               (long long)(starts[i] + counts[i]),
                               (long long)L);
        rows += counts[i];   /* <= nranges * L: no overflow for sane n */
    }
    for (int k = 0; st == MHA_OK && k + 2 < h.ndim; k++)
        lead *= h.shape[k];
    if (st == MHA_OK && h.fortran && h.ndim > 1) {
        /* Fortran order keeps no row together: read it whole */
        fclose(f);
        f = NULL;
        mha_tensor *all;
        MHA_CHECK(mha_npy_load(path, &all));
        const size_t item = out_item_of(&h);
        unsigned char *dst = malloc((size_t)(lead * rows * w) * item + 1);
        if (!dst) {
            mha_tensor_free(all);
            return mha_set_error(MHA_ERR_OUT_OF_MEMORY, "npy: '%s': cannot "
                                 "allocate its rows", path);
        }
        unsigned char *y = dst;
        for (int64_t b = 0; b < lead; b++)
            for (int i = 0; i < nranges; i++) {
                const size_t n = (size_t)(counts[i] * w) * item;
                memcpy(y, (const unsigned char *)all->data +
                              (size_t)((b * L + starts[i]) * w) * item, n);
                y += n;
            }
        free((void *)all->data);
        all->data = dst;
        all->shape[all->ndim - 2] = rows;
        all->numel = lead * rows * w;
        *out = all;
        return MHA_OK;
    }
    const size_t item = out_item_of(&h);
    mha_tensor *t = st == MHA_OK ? malloc(sizeof *t) : NULL;
    void *dst = st == MHA_OK ? malloc((size_t)(lead * rows * w) * item + 1)
                             : NULL;
    unsigned char *buf = st == MHA_OK ? malloc((size_t)w * h.itemsize + 1)
                                      : NULL;
    if (st == MHA_OK && (!t || !dst || !buf))
        st = mha_set_error(MHA_ERR_OUT_OF_MEMORY, "npy: '%s': cannot "
                           "allocate %lld rows", path, (long long)rows);
    /* row by row: a row's bytes read into buf, converted into place */
    int64_t c = 0;
    for (int64_t b = 0; st == MHA_OK && b < lead; b++)
        for (int i = 0; st == MHA_OK && i < nranges; i++) {
            const int64_t r0 = b * L + starts[i];
            if (counts[i] > 0 &&
                fseeko(f, (off_t)(off + (size_t)(r0 * w) * h.itemsize),
                       SEEK_SET) != 0)
                st = mha_set_error(MHA_ERR_IO, "npy: seek failed on '%s'",
                                   path);
            for (int64_t r = 0; st == MHA_OK && r < counts[i]; r++) {
                if (fread(buf, h.itemsize, (size_t)w, f) != (size_t)w) {
                    st = mha_set_error(MHA_ERR_IO, "npy: short read on "
                                       "'%s'", path);
                    break;
                }
                for (int64_t x = 0; x < w; x++, c++)
                    if (!convert_one(h.kind, buf, x, dst, c))
                        st = mha_set_error(MHA_ERR_FORMAT, "npy: '%s': a "
                                           "bool element is %u, not 0 or 1",
                                           path, (unsigned)buf[x]);
            }
        }
    fclose(f);
    free(buf);
    if (st != MHA_OK) {
        free(t);
        free(dst);
        return st;
    }
    memset(t, 0, sizeof *t);
    t->name = "";
    t->dtype = h.dtype;
    t->ndim = h.ndim;
    for (int k = 0; k < h.ndim; k++)
        t->shape[k] = h.shape[k];
    t->shape[h.ndim - 2] = rows;
    t->numel = lead * rows * w;
    t->data = dst;
    *out = t;
    return MHA_OK;
}

void mha_tensor_free(mha_tensor *tensor)
{
    if (!tensor)
        return;
    free(tensor->data);
    free(tensor);
}

/* ------------------------------------------------------------------------ */
/* Writing                                                                  */
/* ------------------------------------------------------------------------ */

mha_status mha_npy_save(const char *path, const mha_tensor_view *t)
{
    if (!path)
        return mha_set_error(MHA_ERR_NULL_POINTER, "npy save: path is NULL");
    if (!t)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "npy save: tensor is NULL");
    const char *descr;
    switch (t->dtype) {
    case MHA_DTYPE_F32: descr = "<f4"; break;
    case MHA_DTYPE_F64: descr = "<f8"; break;
    case MHA_DTYPE_F16: descr = "<f2"; break;   /* uint16 patterns */
    case MHA_DTYPE_BOOL: descr = "|b1"; break;
    case MHA_DTYPE_I32: descr = "<i4"; break;
    case MHA_DTYPE_I64: descr = "<i8"; break;
    case MHA_DTYPE_BF16:   /* NumPy has no bfloat16 of its own */
        return mha_set_error(MHA_ERR_UNSUPPORTED,
                             "npy save: dtype BF16 has no .npy type (NumPy "
                             "has no bfloat16): write it to safetensors");
    default:
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "npy save: unknown dtype %d", (int)t->dtype);
    }
    if (t->ndim < 0 || t->ndim > MHA_MAX_NDIM)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "npy save: ndim %d is outside 0..%d", t->ndim,
                             MHA_MAX_NDIM);
    int64_t numel = 1;
    for (int k = 0; k < t->ndim; k++) {
        if (t->shape[k] < 0)
            return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                                 "npy save: dimension %d is negative (%lld)",
                                 k, (long long)t->shape[k]);
        if (t->shape[k] == 0)
            numel = 0;
    }
    for (int k = 0; k < t->ndim && numel != 0; k++)
        if (!mha_mul_ok(numel, t->shape[k], &numel))
            return mha_set_error(MHA_ERR_OVERFLOW,
                                 "npy save: the element count overflows");
    const size_t itemsize = mha_dtype_size(t->dtype);
    int64_t nbytes;
    if (!mha_mul_ok(numel, (int64_t)itemsize, &nbytes) ||
        (uint64_t)nbytes > SIZE_MAX)
        return mha_set_error(MHA_ERR_OVERFLOW,
                             "npy save: the data size overflows");
    if (!t->data && nbytes > 0)
        return mha_set_error(MHA_ERR_NULL_POINTER,
                             "npy save: tensor data is NULL");

    /* Bools go out as 0 / 1 bytes; a mask with other nonzero bytes is
     * normalised in a copy (NumPy would misread them). */
    const void *data = t->data;
    uint8_t *bool_copy = NULL;
    if (t->dtype == MHA_DTYPE_BOOL) {
        const uint8_t *u = t->data;
        int64_t k = 0;
        while (k < numel && u[k] <= 1)
            k++;
        if (k < numel) {
            bool_copy = malloc((size_t)numel);
            if (!bool_copy)
                return mha_set_error(MHA_ERR_OUT_OF_MEMORY,
                                     "npy save: cannot allocate %lld bytes",
                                     (long long)numel);
            for (k = 0; k < numel; k++)
                bool_copy[k] = u[k] != 0;
            data = bool_copy;
        }
    }

    /* The header, exactly as NumPy's np.save writes it (sorted keys, a
     * trailing ", ", the growth padding, spaces, '\n'). */
    char dict[512];
    char shp[256];
    int n = snprintf(dict, sizeof dict,
                     "{'descr': '%s', 'fortran_order': False, 'shape': %s, }",
                     descr, shape_string(t->shape, t->ndim, shp, sizeof shp));
    if (t->ndim > 0) {
        char first[24];
        const int digits = snprintf(first, sizeof first, "%lld",
                                    (long long)t->shape[0]);
        for (int k = digits; k < NPY_GROWTH_AXIS_MAX_DIGITS; k++)
            dict[n++] = ' ';
        dict[n] = 0;
    }
    /* At most 8 dims of 19 digits: the dict is < 300 bytes, far below
     * version 1.0's 65535, so version 2.0 is never needed.  The check
     * stays in case MHA_MAX_NDIM grows. */
    size_t hlen = (size_t)n + 1;   /* + '\n' */
    const size_t len_bytes = hlen + NPY_ALIGN + 10 > 65535 ? 4 : 2;
    const size_t pre = NPY_MAGIC_LEN + 2 + len_bytes;
    const size_t pad = NPY_ALIGN - (pre + hlen) % NPY_ALIGN;
    hlen += pad;
    unsigned char head[12 + sizeof dict + NPY_ALIGN];
    memcpy(head, NPY_MAGIC, NPY_MAGIC_LEN);
    head[6] = len_bytes == 2 ? 1 : 2;
    head[7] = 0;
    head[8] = (unsigned char)(hlen & 0xff);
    head[9] = (unsigned char)(hlen >> 8 & 0xff);
    if (len_bytes == 4) {
        head[10] = (unsigned char)(hlen >> 16 & 0xff);
        head[11] = (unsigned char)(hlen >> 24 & 0xff);
    }
    memcpy(head + pre, dict, (size_t)n);
    memset(head + pre + n, ' ', pad);
    head[pre + hlen - 1] = '\n';

    const void *chunks[2] = {head, data};
    const size_t sizes[2] = {pre + hlen, (size_t)nbytes};
    mha_status st = mha_write_file_atomic(path, chunks, sizes, 2);
    free(bool_copy);
    return st;
}
