/*
 * test_npy.c -- the .npy reader and writer (src/io/npy.c).
 *
 *   - every file in $MHA_FIXTURES/npy, written by NumPy itself
 *     (tests/fixtures/make_npy_fixtures.py), loads with the right dtype,
 *     shape and values; the values follow from the file name (the script's
 *     docstring has the formulas), so they are computed here independently;
 *   - mha_npy_save of the same values writes the C-order version-1.0 files
 *     byte for byte as np.save did;
 *   - save -> load round trips for every dtype and several shapes, with the
 *     data bytes in the file compared bitwise;
 *   - header spellings NumPy accepts (quotes, key order, whitespace, Python 2
 *     "3L") are accepted;
 *   - a table of malformed inputs built in memory, each refused with its
 *     status and a keyword of its message, and nothing returned;
 *   - load and save errors: missing file, missing directory, a directory as
 *     the target (no temporary file left), unsupported dtypes, bad views;
 *   - mha_file_save (the same file rules for the caller's own bytes): the
 *     bytes written, a 0600 file kept 0600, a symbolic link followed, an
 *     empty file, its refusals.
 */
#define _POSIX_C_SOURCE 200809L

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <setjmp.h>
#include <cmocka.h>

#include <dirent.h>
#include <signal.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "mha_io.h"
#include "testutil.h"
#include "core/half.h"

/* ------------------------------------------------------------------------ */
/* Helpers                                                                  */
/* ------------------------------------------------------------------------ */

/* Where a failing call must write NULL over it. */
static mha_tensor sentinel;


static void tmp_path(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", tu_tmpdir, name);
}

static unsigned char *read_all(const char *path, size_t *size)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    *size = (size_t)n;
    return b;
}

static int file_exists(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0;
}

/* Entries of tu_tmpdir whose name contains `part`. */
static int count_in_tmpdir(const char *part)
{
    int n = 0;
    DIR *d = opendir(tu_tmpdir);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (strstr(e->d_name, part))
            n++;
    closedir(d);
    return n;
}

/* The data offset of a .npy image (after magic, version, length, header). */
static size_t data_offset(const unsigned char *b)
{
    if (b[6] == 1)
        return 10 + (size_t)(b[8] | b[9] << 8);
    return 12 + (size_t)(b[8] | b[9] << 8 | b[10] << 16 |
                         (size_t)b[11] << 24);
}

#define assert_error(st_, want_, keyword_)                                  \
    do {                                                                    \
        mha_status got_ = (st_);                                            \
        const char *msg_ = mha_last_error();                                \
        if (got_ != (want_) || !strstr(msg_, (keyword_))) {                 \
            print_error("status %d (want %d), message \"%s\" (want "        \
                        "\"%s\")\n", (int)got_, (int)(want_), msg_,         \
                        (keyword_));                                        \
            fail();                                                         \
        }                                                                   \
    } while (0)

/* ------------------------------------------------------------------------ */
/* Expected values: the formulas of make_npy_fixtures.py                    */
/* ------------------------------------------------------------------------ */

typedef enum kind { K_F4, K_F8, K_F2, K_B1, K_U1, K_I4, K_I8 } kind;

static float want_float(kind k, int64_t i)
{
    if (k == K_F4)
        return (float)i * 0.5f - 3.0f;
    if (k == K_F2)
        return (float)i * 0.25f - 2.0f;   /* exact in float16 */
    return (float)((double)i * 0.1 - 1.0);   /* f8, rounded by libmha */
}

static double want_f8(int64_t i) { return (double)i * 0.1 - 1.0; }

static int64_t want_int(kind k, int64_t i)
{
    if (k == K_I4)
        return (i - 3) * 1000003;
    return (i - 3) * ((int64_t)1 << 40) + 7;
}

static uint8_t want_bool(kind k, int64_t i)
{
    if (k == K_B1)
        return i % 3 == 0;
    return i % 4 != 0;   /* u1: nonzero -> 1 */
}

typedef struct fixture {
    const char *file;
    kind k;
    mha_dtype dtype;
    int ndim;
    int64_t shape[4];
    int np_save_c_order;   /* np.save, C order, v1.0: we must match bytes */
} fixture;

static const fixture fixtures[] = {
    {"f4_2x3.npy", K_F4, MHA_DTYPE_F32, 2, {2, 3}, 1},
    {"f8_3x4.npy", K_F8, MHA_DTYPE_F64, 2, {3, 4}, 1},
    {"f2_2x5.npy", K_F2, MHA_DTYPE_F16, 2, {2, 5}, 1},
    {"b1_2x3x4.npy", K_B1, MHA_DTYPE_BOOL, 3, {2, 3, 4}, 1},
    {"u1_7.npy", K_U1, MHA_DTYPE_BOOL, 1, {7}, 0},
    {"i4_5.npy", K_I4, MHA_DTYPE_I32, 1, {5}, 1},
    {"i8_2x2x2x3.npy", K_I8, MHA_DTYPE_I64, 4, {2, 2, 2, 3}, 1},
    {"f4_scalar.npy", K_F4, MHA_DTYPE_F32, 0, {0}, 1},
    {"f8_scalar.npy", K_F8, MHA_DTYPE_F64, 0, {0}, 1},
    {"f4_2x0x3.npy", K_F4, MHA_DTYPE_F32, 3, {2, 0, 3}, 1},
    {"f4_fortran_3x4.npy", K_F4, MHA_DTYPE_F32, 2, {3, 4}, 0},
    {"f4_fortran_2x3x4.npy", K_F4, MHA_DTYPE_F32, 3, {2, 3, 4}, 0},
    {"i8_fortran_3x5.npy", K_I8, MHA_DTYPE_I64, 2, {3, 5}, 0},
    {"b1_fortran_2x3.npy", K_B1, MHA_DTYPE_BOOL, 2, {2, 3}, 0},
    {"f4_v2_2x3.npy", K_F4, MHA_DTYPE_F32, 2, {2, 3}, 0},
    {"f4_v3_2x2.npy", K_F4, MHA_DTYPE_F32, 2, {2, 2}, 0},
};
#define N_FIXTURES (sizeof fixtures / sizeof fixtures[0])

static void fixture_path(char *buf, size_t cap, const char *file)
{
    const char *dir = getenv("MHA_FIXTURES");
    assert_non_null(dir);
    snprintf(buf, cap, "%s/npy/%s", dir, file);
}

static int64_t numel_of(const int64_t *shape, int ndim)
{
    int64_t n = 1;
    for (int k = 0; k < ndim; k++)
        n *= shape[k];
    return n;
}

static void test_numpy_fixtures(void **state)
{
    (void)state;
    for (size_t f = 0; f < N_FIXTURES; f++) {
        const fixture *fx = &fixtures[f];
        char path[512];
        fixture_path(path, sizeof path, fx->file);
        mha_tensor *t = NULL;
        mha_status st = mha_npy_load(path, &t);
        if (st != MHA_OK)
            fail_msg("%s: %s", fx->file, mha_last_error());
        assert_string_equal(t->name, "");
        assert_int_equal(t->dtype, fx->dtype);
        assert_int_equal(t->ndim, fx->ndim);
        for (int k = 0; k < fx->ndim; k++)
            assert_int_equal(t->shape[k], fx->shape[k]);
        const int64_t n = numel_of(fx->shape, fx->ndim);
        assert_int_equal(t->numel, n);
        assert_non_null(t->data);
        for (int64_t i = 0; i < n; i++) {
            switch (fx->k) {
            case K_F4:
            case K_F8:
            case K_F2: {
                const float got = ((const float *)t->data)[i];
                const float want = want_float(fx->k, i);
                if (memcmp(&got, &want, sizeof got) != 0)
                    fail_msg("%s[%lld] = %.9g, want %.9g", fx->file,
                             (long long)i, got, want);
                break;
            }
            case K_B1:
            case K_U1:
                if (((const uint8_t *)t->data)[i] != want_bool(fx->k, i))
                    fail_msg("%s[%lld] = %u", fx->file, (long long)i,
                             ((const uint8_t *)t->data)[i]);
                break;
            case K_I4:
            case K_I8:
                if (((const int64_t *)t->data)[i] != want_int(fx->k, i))
                    fail_msg("%s[%lld] = %lld", fx->file, (long long)i,
                             (long long)((const int64_t *)t->data)[i]);
                break;
            }
        }
        mha_tensor_free(t);
    }

    /* Every .npy in the directory is in the table: none goes unchecked. */
    char dirpath[512];
    fixture_path(dirpath, sizeof dirpath, "");
    DIR *d = opendir(dirpath);
    assert_non_null(d);
    struct dirent *e;
    size_t n_files = 0;
    while ((e = readdir(d)) != NULL) {
        const size_t len = strlen(e->d_name);
        if (len < 4 || strcmp(e->d_name + len - 4, ".npy") != 0)
            continue;
        n_files++;
        size_t f = 0;
        while (f < N_FIXTURES && strcmp(fixtures[f].file, e->d_name) != 0)
            f++;
        if (f == N_FIXTURES)
            fail_msg("fixture %s is not in test_npy.c's table", e->d_name);
    }
    closedir(d);
    assert_int_equal(n_files, N_FIXTURES);
}

/* Our writer against np.save: the same values give the same bytes. */
static void test_save_matches_numpy(void **state)
{
    (void)state;
    int compared = 0;
    for (size_t f = 0; f < N_FIXTURES; f++) {
        const fixture *fx = &fixtures[f];
        if (!fx->np_save_c_order)
            continue;
        const int64_t n = numel_of(fx->shape, fx->ndim);
        void *buf = malloc((size_t)(n > 0 ? n : 1) * 8);
        assert_non_null(buf);
        for (int64_t i = 0; i < n; i++) {
            switch (fx->k) {
            case K_F4: ((float *)buf)[i] = want_float(K_F4, i); break;
            case K_F8: ((double *)buf)[i] = want_f8(i); break;
            case K_F2:   /* written as float16 bit patterns */
                ((uint16_t *)buf)[i] = mha_f16_from_float(want_float(K_F2, i));
                break;
            case K_B1:
            case K_U1: ((uint8_t *)buf)[i] = want_bool(fx->k, i); break;
            case K_I4: ((int32_t *)buf)[i] = (int32_t)want_int(K_I4, i); break;
            case K_I8: ((int64_t *)buf)[i] = want_int(K_I8, i); break;
            }
        }
        mha_tensor_view v;
        memset(&v, 0, sizeof v);
        v.name = "x";
        v.dtype = fx->dtype;
        v.ndim = fx->ndim;
        for (int k = 0; k < fx->ndim; k++)
            v.shape[k] = fx->shape[k];
        v.data = buf;
        char ours[512], theirs[512];
        tmp_path(ours, sizeof ours, fx->file);
        fixture_path(theirs, sizeof theirs, fx->file);
        if (mha_npy_save(ours, &v) != MHA_OK)
            fail_msg("%s: %s", fx->file, mha_last_error());
        size_t na, nb;
        unsigned char *a = read_all(ours, &na);
        unsigned char *b = read_all(theirs, &nb);
        assert_non_null(a);
        assert_non_null(b);
        if (na != nb || memcmp(a, b, na) != 0)
            fail_msg("%s: mha_npy_save differs from np.save (%zu vs %zu "
                     "bytes)", fx->file, na, nb);
        free(a);
        free(b);
        free(buf);
        remove(ours);
        compared++;
    }
    assert_true(compared >= 7);
}

/* ------------------------------------------------------------------------ */
/* Round trips                                                              */
/* ------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void round_trip(mha_dtype dtype, int ndim, const int64_t *shape,
                       uint64_t seed)
{
    const int64_t n = numel_of(shape, ndim);
    const size_t isz = dtype == MHA_DTYPE_BOOL ? 1
                     : (dtype == MHA_DTYPE_F32 || dtype == MHA_DTYPE_I32) ? 4
                     : 8;
    unsigned char *src = malloc((size_t)(n > 0 ? n : 1) * isz);
    assert_non_null(src);
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = rng_next(&s);
        switch (dtype) {
        case MHA_DTYPE_F32: {
            /* Any bit pattern but NaN (whose payload could be quieted). */
            uint32_t u = (uint32_t)r;
            float f;
            memcpy(&f, &u, 4);
            if (isnan(f))
                f = (i & 1) ? INFINITY : -0.0f;
            ((float *)src)[i] = f;
            break;
        }
        case MHA_DTYPE_F64: {
            /* Within float range, plus the edges. */
            double d = ((double)(r >> 11) / 9007199254740992.0 - 0.5) *
                       ldexp(1.0, (int)(r & 63) - 32);
            if (i == 1) d = -0.0;
            if (i == 2) d = INFINITY;
            if (i == 3) d = 1e300;  /* beyond float: becomes inf */
            ((double *)src)[i] = d;
            break;
        }
        case MHA_DTYPE_BOOL: src[i] = (uint8_t)(r & 1); break;
        case MHA_DTYPE_I32: {
            int32_t v = (int32_t)(uint32_t)r;
            if (i == 0) v = INT32_MIN;
            if (i == 1) v = INT32_MAX;
            ((int32_t *)src)[i] = v;
            break;
        }
        case MHA_DTYPE_I64: {
            int64_t v = (int64_t)r;
            if (i == 0) v = INT64_MIN;
            if (i == 1) v = INT64_MAX;
            ((int64_t *)src)[i] = v;
            break;
        }
        default: fail();
        }
    }
    mha_tensor_view v;
    memset(&v, 0, sizeof v);
    v.dtype = dtype;
    v.ndim = ndim;
    for (int k = 0; k < ndim; k++)
        v.shape[k] = shape[k];
    v.data = src;
    char path[512];
    tmp_path(path, sizeof path, "rt.npy");
    if (mha_npy_save(path, &v) != MHA_OK)
        fail_msg("save %s ndim %d: %s", mha_dtype_name(dtype), ndim,
                 mha_last_error());

    /* The file: 64-aligned version 1.0, and the data bytes bitwise. */
    size_t fsize;
    unsigned char *file = read_all(path, &fsize);
    assert_non_null(file);
    assert_memory_equal(file, "\x93NUMPY\x01\x00", 8);
    const size_t off = data_offset(file);
    assert_int_equal(off % 64, 0);
    assert_int_equal(file[off - 1], '\n');
    assert_int_equal(fsize - off, (size_t)n * isz);
    if (n > 0)
        assert_memory_equal(file + off, src, (size_t)n * isz);

    /* Parsing the image and loading the file agree, and give the values. */
    mha_tensor *t = NULL, *t2 = NULL;
    if (mha_npy_load(path, &t) != MHA_OK)
        fail_msg("load %s ndim %d: %s", mha_dtype_name(dtype), ndim,
                 mha_last_error());
    assert_int_equal(mha_npy_parse(file, fsize, &t2), MHA_OK);
    assert_int_equal(t->dtype, dtype);
    assert_int_equal(t->ndim, ndim);
    for (int k = 0; k < ndim; k++)
        assert_int_equal(t->shape[k], shape[k]);
    assert_int_equal(t->numel, n);
    for (int64_t i = 0; i < n; i++) {
        switch (dtype) {
        case MHA_DTYPE_F32:
            assert_memory_equal((float *)t->data + i, (float *)src + i, 4);
            break;
        case MHA_DTYPE_F64: {
            const float want = (float)((double *)src)[i];
            assert_memory_equal((float *)t->data + i, &want, 4);
            break;
        }
        case MHA_DTYPE_BOOL:
            assert_int_equal(((uint8_t *)t->data)[i], src[i]);
            break;
        case MHA_DTYPE_I32:
            assert_true(((int64_t *)t->data)[i] == ((int32_t *)src)[i]);
            break;
        case MHA_DTYPE_I64:
            assert_true(((int64_t *)t->data)[i] == ((int64_t *)src)[i]);
            break;
        default: fail();
        }
    }
    const size_t osz = dtype == MHA_DTYPE_BOOL ? 1
                     : (dtype == MHA_DTYPE_I32 || dtype == MHA_DTYPE_I64) ? 8
                     : 4;
    if (n > 0)
        assert_memory_equal(t->data, t2->data, (size_t)n * osz);
    mha_tensor_free(t);
    mha_tensor_free(t2);
    free(file);
    free(src);
    remove(path);
}

static void test_round_trips(void **state)
{
    (void)state;
    static const mha_dtype dtypes[] = {MHA_DTYPE_F32, MHA_DTYPE_F64,
                                       MHA_DTYPE_BOOL, MHA_DTYPE_I32,
                                       MHA_DTYPE_I64};
    static const struct { int ndim; int64_t shape[8]; } shapes[] = {
        {0, {0}},                       /* scalar */
        {1, {7}},
        {1, {0}},                       /* empty */
        {3, {2, 3, 4}},
        {4, {2, 1, 3, 5}},
        {8, {1, 2, 1, 2, 1, 2, 1, 3}},  /* MHA_MAX_NDIM */
        {2, {1000000000000LL, 0}},      /* empty, huge first dim */
    };
    uint64_t seed = 1;
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            round_trip(dtypes[d], shapes[s].ndim, shapes[s].shape, seed++);
    assert_int_equal(count_in_tmpdir(".tmp."), 0);
}

/* A bool view with bytes other than 0 / 1 is written as 0 / 1. */
static void test_save_normalises_bool(void **state)
{
    (void)state;
    const uint8_t src[5] = {0, 1, 2, 255, 0};
    mha_tensor_view v;
    memset(&v, 0, sizeof v);
    v.dtype = MHA_DTYPE_BOOL;
    v.ndim = 1;
    v.shape[0] = 5;
    v.data = src;
    char path[512];
    tmp_path(path, sizeof path, "bool.npy");
    assert_int_equal(mha_npy_save(path, &v), MHA_OK);
    mha_tensor *t;
    assert_int_equal(mha_npy_load(path, &t), MHA_OK);
    const uint8_t want[5] = {0, 1, 1, 1, 0};
    assert_memory_equal(t->data, want, 5);
    mha_tensor_free(t);
    remove(path);
}

/* ------------------------------------------------------------------------ */
/* Building .npy images in memory                                           */
/* ------------------------------------------------------------------------ */

typedef struct image {
    unsigned char b[4096];
    size_t n;
} image;

/*
 * magic, version major.minor, header length (+ hlen_delta), `dict` padded
 * with spaces to `align` and ended by '\n' (or a space when no_newline),
 * then data_len bytes of `fill`.
 */
static void build(image *im, unsigned major, unsigned minor, const char *dict,
                  size_t align, int no_newline, long hlen_delta,
                  size_t data_len, unsigned char fill)
{
    const size_t lenb = major == 1 ? 2 : 4;
    const size_t pre = 8 + lenb;
    size_t hlen = strlen(dict) + 1;
    hlen += (align - (pre + hlen) % align) % align;
    assert_true(pre + hlen + data_len <= sizeof im->b);
    memcpy(im->b, "\x93NUMPY", 6);
    im->b[6] = (unsigned char)major;
    im->b[7] = (unsigned char)minor;
    const uint64_t field = (uint64_t)((long)hlen + hlen_delta);
    for (size_t k = 0; k < lenb; k++)
        im->b[8 + k] = (unsigned char)(field >> (8 * k));
    memset(im->b + pre, ' ', hlen);
    memcpy(im->b + pre, dict, strlen(dict));
    im->b[pre + hlen - 1] = no_newline ? ' ' : '\n';
    memset(im->b + pre + hlen, fill, data_len);
    im->n = pre + hlen + data_len;
}

/* A '<f4' C-order header dict with the given shape text. */
#define D(shape) "{'descr': '<f4', 'fortran_order': False, 'shape': " \
                 shape ", }"

static void simple(image *im, const char *dict, size_t data_len)
{
    build(im, 1, 0, dict, 64, 0, 0, data_len, 0);
}

/* Spellings NumPy reads (it uses ast.literal_eval) and so do we. */
static void test_header_variants(void **state)
{
    (void)state;
    static const struct {
        const char *dict;
        unsigned major;
        size_t align;
        mha_dtype dtype;
        int ndim;
        int64_t d0, d1;
    } ok[] = {
        {"{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", 1,
         64, MHA_DTYPE_F32, 2, 2, 3},
        {"{\"shape\": (2, 3), \"fortran_order\": False, \"descr\": \"<f4\"}",
         1, 16, MHA_DTYPE_F32, 2, 2, 3},
        {"{ 'fortran_order' :False,'shape':( 2 ,3 , ),\t'descr':'=f4' }", 2,
         16, MHA_DTYPE_F32, 2, 2, 3},
        {"{'descr': '|u1', 'fortran_order': False, 'shape': (6,)}", 1, 1,
         MHA_DTYPE_BOOL, 1, 6, 0},
        {"{'descr': '<b1', 'fortran_order': True, 'shape': (6,)}", 1, 64,
         MHA_DTYPE_BOOL, 1, 6, 0},
        /* Python 2 longs, which NumPy filters out for versions 1 and 2. */
        {"{'descr': '<i4', 'fortran_order': False, 'shape': (3L, 2L), }", 1,
         64, MHA_DTYPE_I32, 2, 3, 2},
        {"{'descr': '<i8', 'fortran_order': False, 'shape': (1, 6), }", 3,
         64, MHA_DTYPE_I64, 2, 1, 6},
        {"{'descr':'<f8','fortran_order':False,'shape':(1,6)}\r", 1, 64,
         MHA_DTYPE_F64, 2, 1, 6},
    };
    for (size_t c = 0; c < sizeof ok / sizeof ok[0]; c++) {
        image im;
        const int64_t n = ok[c].ndim == 1 ? ok[c].d0 : ok[c].d0 * ok[c].d1;
        const size_t isz = ok[c].dtype == MHA_DTYPE_BOOL ? 1
                         : ok[c].dtype == MHA_DTYPE_F32 ||
                           ok[c].dtype == MHA_DTYPE_I32 ? 4 : 8;
        build(&im, ok[c].major, 0, ok[c].dict, ok[c].align, 0, 0,
              (size_t)n * isz, 1);
        mha_tensor *t = NULL;
        if (mha_npy_parse(im.b, im.n, &t) != MHA_OK)
            fail_msg("variant %zu: %s", c, mha_last_error());
        assert_int_equal(t->dtype, ok[c].dtype);
        assert_int_equal(t->ndim, ok[c].ndim);
        assert_int_equal(t->shape[0], ok[c].d0);
        if (ok[c].ndim == 2)
            assert_int_equal(t->shape[1], ok[c].d1);
        assert_int_equal(t->numel, n);
        mha_tensor_free(t);
    }

    /* An empty array is empty however large its other dimensions (NumPy
     * ignores zero dimensions in its overflow check too). */
    image im;
    simple(&im, D("(4611686018427387904, 8, 0)"), 0);
    mha_tensor *t = NULL;
    if (mha_npy_parse(im.b, im.n, &t) != MHA_OK)
        fail_msg("empty huge: %s", mha_last_error());
    assert_int_equal(t->numel, 0);
    assert_int_equal(t->ndim, 3);
    assert_true(t->shape[0] == ((int64_t)1 << 62));
    assert_non_null(t->data);
    mha_tensor_free(t);

    /* The same in Fortran order (found by libFuzzer: the transposition's
     * strides overflowed). */
    simple(&im, "{'descr': '<i8', 'fortran_order': True, "
                "'shape': (461168601842738790, 68601842738, 708, 0), }", 0);
    t = NULL;
    if (mha_npy_parse(im.b, im.n, &t) != MHA_OK)
        fail_msg("empty huge fortran: %s", mha_last_error());
    assert_int_equal(t->numel, 0);
    assert_int_equal(t->ndim, 4);
    mha_tensor_free(t);
}

/* ------------------------------------------------------------------------ */
/* Malformed inputs                                                         */
/* ------------------------------------------------------------------------ */

typedef struct bad_case {
    const char *what;
    const char *raw;      /* non-NULL: these raw_len bytes, nothing built */
    size_t raw_len;
    unsigned major, minor;
    const char *dict;
    int no_newline;
    long hlen_delta;
    size_t data_len;
    unsigned char fill;
    mha_status status;
    const char *keyword;
} bad_case;

static const bad_case bad_cases[] = {
    {"empty", "", 0, 0, 0, NULL, 0, 0, 0, 0, MHA_ERR_FORMAT, "empty"},
    {"short magic", "\x93NUM", 4, 0, 0, NULL, 0, 0, 0, 0, MHA_ERR_FORMAT,
     "truncated"},
    {"magic and version only", "\x93NUMPY\x01\x00\x10", 9, 0, 0, NULL, 0, 0,
     0, 0, MHA_ERR_FORMAT, "truncated"},
    {"wrong magic", "\x93NUMPX\x01\x00\x10\x00{}", 12, 0, 0, NULL, 0, 0, 0,
     0, MHA_ERR_FORMAT, "bad magic"},
    {"PNG renamed", "\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01", 20, 0, 0,
     NULL, 0, 0, 0, 0, MHA_ERR_FORMAT, "bad magic"},
    {"header length 0", "\x93NUMPY\x01\x00\x00\x00", 10, 0, 0, NULL, 0, 0, 0,
     0, MHA_ERR_FORMAT, "newline"},
    {"version 9.0", NULL, 0, 9, 0, D("(2,)"), 0, 0, 8, 0,
     MHA_ERR_UNSUPPORTED, "version 9.0"},
    {"version 1.1", NULL, 0, 1, 1, D("(2,)"), 0, 0, 8, 0,
     MHA_ERR_UNSUPPORTED, "version 1.1"},
    {"header length past EOF", NULL, 0, 1, 0, D("(2,)"), 0, 1000, 8, 0,
     MHA_ERR_FORMAT, "past the end"},
    {"header length past EOF, v2", NULL, 0, 2, 0, D("(2,)"), 0, 0x7fffffff,
     8, 0, MHA_ERR_FORMAT, "past the end"},
    {"header without newline", NULL, 0, 1, 0, D("(2,)"), 1, 0, 8, 0,
     MHA_ERR_FORMAT, "newline"},
    {"missing shape", NULL, 0, 1, 0,
     "{'descr': '<f4', 'fortran_order': False, }", 0, 0, 0, 0,
     MHA_ERR_FORMAT, "no 'shape'"},
    {"missing descr", NULL, 0, 1, 0,
     "{'fortran_order': False, 'shape': (), }", 0, 0, 4, 0,
     MHA_ERR_FORMAT, "no 'descr'"},
    {"duplicate key", NULL, 0, 1, 0,
     "{'descr': '<f4', 'descr': '<f4', 'fortran_order': False, "
     "'shape': (), }", 0, 0, 4, 0, MHA_ERR_FORMAT, "duplicate key 'descr'"},
    {"unknown key", NULL, 0, 1, 0,
     "{'descr': '<f4', 'fortran_order': False, 'shape': (), 'extra': 1}", 0,
     0, 4, 0, MHA_ERR_FORMAT, "unknown key 'extra'"},
    {"big-endian f4", NULL, 0, 1, 0,
     "{'descr': '>f4', 'fortran_order': False, 'shape': (2,), }", 0, 0, 8,
     0, MHA_ERR_UNSUPPORTED, "big-endian"},
    {"complex64", NULL, 0, 1, 0,
     "{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", 0, 0, 16,
     0, MHA_ERR_UNSUPPORTED, "'<c8'"},
    {"complex64", NULL, 0, 1, 0,
     "{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", 0, 0, 16,
     0, MHA_ERR_UNSUPPORTED, "'<c8'"},
    {"object array", NULL, 0, 1, 0,
     "{'descr': '|O', 'fortran_order': False, 'shape': (2,), }", 0, 0, 16,
     0, MHA_ERR_UNSUPPORTED, "object"},
    {"structured dtype", NULL, 0, 1, 0,
     "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }",
     0, 0, 8, 0, MHA_ERR_UNSUPPORTED, "structured"},
    {"'|f4' without byte order", NULL, 0, 1, 0,
     "{'descr': '|f4', 'fortran_order': False, 'shape': (2,), }", 0, 0, 8,
     0, MHA_ERR_FORMAT, "no byte order"},
    {"negative dim", NULL, 0, 1, 0, D("(2, -3)"), 0, 0, 0, 0,
     MHA_ERR_FORMAT, "negative"},
    {"(2**62, 8) overflows", NULL, 0, 1, 0,
     D("(4611686018427387904, 8)"), 0, 0, 0, 0, MHA_ERR_OVERFLOW,
     "overflow"},
    {"(2**61, 2) <f8 bytes overflow", NULL, 0, 1, 0,
     "{'descr': '<f8', 'fortran_order': False, "
     "'shape': (2305843009213693952, 2), }", 0, 0, 0, 0, MHA_ERR_OVERFLOW,
     "data size"},
    {"dim beyond int64", NULL, 0, 1, 0, D("(99999999999999999999,)"), 0, 0,
     0, 0, MHA_ERR_OVERFLOW, "64 bits"},
    {"(2**40,) with no data", NULL, 0, 1, 0, D("(1099511627776,)"), 0, 0, 0,
     0, MHA_ERR_FORMAT, "truncated data"},
    {"9 dims", NULL, 0, 1, 0, D("(1, 1, 1, 1, 1, 1, 1, 1, 1)"), 0, 0, 4, 0,
     MHA_ERR_UNSUPPORTED, "9 dimensions"},
    {"truncated data", NULL, 0, 1, 0, D("(2, 3)"), 0, 0, 20, 0,
     MHA_ERR_FORMAT, "truncated data"},
    {"trailing data", NULL, 0, 1, 0, D("(2, 3)"), 0, 0, 28, 0,
     MHA_ERR_FORMAT, "4 trailing bytes"},
    {"shape (2, x)", NULL, 0, 1, 0, D("(2, x)"), 0, 0, 8, 0, MHA_ERR_FORMAT,
     "not a non-negative integer: 'x'"},
    {"shape (2.5,)", NULL, 0, 1, 0, D("(2.5,)"), 0, 0, 8, 0, MHA_ERR_FORMAT,
     "after its digits"},
    {"shape (5) not a tuple", NULL, 0, 1, 0, D("(5)"), 0, 0, 20, 0,
     MHA_ERR_FORMAT, "trailing comma"},
    {"shape unclosed", NULL, 0, 1, 0, D("(2, 3"), 0, 0, 24, 0,
     MHA_ERR_FORMAT, "dimension 2 is not a non-negative integer"},
    {"shape unclosed at the end", NULL, 0, 1, 0,
     "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3", 0, 0, 24, 0,
     MHA_ERR_FORMAT, "found the end of the header"},
    {"shape is a list", NULL, 0, 1, 0, D("[2, 3]"), 0, 0, 24, 0,
     MHA_ERR_FORMAT, "to open 'shape'"},
    {"3L in version 3.0", NULL, 0, 3, 0, D("(3L,)"), 0, 0, 12, 0,
     MHA_ERR_FORMAT, "after its digits"},
    {"fortran_order 0", NULL, 0, 1, 0,
     "{'descr': '<f4', 'fortran_order': 0, 'shape': (), }", 0, 0, 4, 0,
     MHA_ERR_FORMAT, "True or False"},
    {"bool byte 2", NULL, 0, 1, 0,
     "{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }", 0, 0, 3,
     2, MHA_ERR_FORMAT, "not 0 or 1"},
    {"unterminated string", NULL, 0, 1, 0,
     "{'fortran_order': False, 'shape': (), 'descr': '<f4}", 0, 0, 4, 0,
     MHA_ERR_FORMAT, "unterminated string in 'descr'"},
    {"quote mismatch", NULL, 0, 1, 0,
     "{'descr': '<f4, 'fortran_order': False, 'shape': (), }", 0, 0, 4, 0,
     MHA_ERR_UNSUPPORTED, "dtype '<f4, '"},
    {"escape in string", NULL, 0, 1, 0,
     "{'descr': '<f\\x34', 'fortran_order': False, 'shape': (), }", 0, 0, 4,
     0, MHA_ERR_FORMAT, "escape"},
    {"non-ASCII in string", NULL, 0, 1, 0,
     "{'descr': '<f\xe9', 'fortran_order': False, 'shape': (), }", 0, 0, 4,
     0, MHA_ERR_FORMAT, "0xe9"},
    {"not a dict", NULL, 0, 1, 0, "[1, 2]", 0, 0, 0, 0, MHA_ERR_FORMAT,
     "expected '{'"},
    {"bytes after the dict", NULL, 0, 1, 0, D("()") " x", 0, 0, 4, 0,
     MHA_ERR_FORMAT, "after the closing"},
    {"missing comma between entries", NULL, 0, 1, 0,
     "{'descr': '<f4' 'fortran_order': False, 'shape': (), }", 0, 0, 4, 0,
     MHA_ERR_FORMAT, "between the entries"},
};

static void test_malformed(void **state)
{
    (void)state;
    const size_t n = sizeof bad_cases / sizeof bad_cases[0];
    assert_true(n >= 15);
    for (size_t c = 0; c < n; c++) {
        const bad_case *bc = &bad_cases[c];
        image im;
        const unsigned char *bytes;
        size_t size;
        if (bc->raw) {
            bytes = (const unsigned char *)bc->raw;
            size = bc->raw_len;
        } else {
            build(&im, bc->major, bc->minor, bc->dict, 64, bc->no_newline,
                  bc->hlen_delta, bc->data_len, bc->fill);
            bytes = im.b;
            size = im.n;
        }
        mha_tensor *t = &sentinel;   /* must be reset to NULL */
        const mha_status st = mha_npy_parse(bytes, size, &t);
        const char *msg = mha_last_error();
        if (st != bc->status || !strstr(msg, bc->keyword) || t != NULL)
            fail_msg("case '%s': status %d (want %d), message \"%s\" (want "
                     "\"%s\")%s", bc->what, (int)st, (int)bc->status, msg,
                     bc->keyword, t ? ", out not NULL" : "");
    }
}

/* Every prefix of a valid file is refused cleanly (no crash, no leak). */
static void test_every_truncation(void **state)
{
    (void)state;
    image im;
    simple(&im, D("(2, 3)"), 24);
    for (size_t n = 0; n < im.n; n++) {
        mha_tensor *t = NULL;
        assert_int_not_equal(mha_npy_parse(im.b, n, &t), MHA_OK);
        assert_null(t);
        assert_true(mha_last_error()[0] != 0);
    }
    mha_tensor *t = NULL;
    assert_int_equal(mha_npy_parse(im.b, im.n, &t), MHA_OK);
    mha_tensor_free(t);
}

/* ------------------------------------------------------------------------ */
/* Arguments and files                                                      */
/* ------------------------------------------------------------------------ */

static void test_null_arguments(void **state)
{
    (void)state;
    image im;
    simple(&im, D("()"), 4);
    mha_tensor *t = NULL;
    assert_error(mha_npy_parse(im.b, im.n, NULL), MHA_ERR_NULL_POINTER,
                 "out");
    assert_error(mha_npy_parse(NULL, 10, &t), MHA_ERR_NULL_POINTER, "bytes");
    assert_null(t);
    assert_error(mha_npy_parse(NULL, 0, &t), MHA_ERR_FORMAT, "empty");
    assert_error(mha_npy_load(NULL, &t), MHA_ERR_NULL_POINTER, "path");
    assert_error(mha_npy_load("x.npy", NULL), MHA_ERR_NULL_POINTER, "out");
    mha_tensor_free(NULL);

    float x = 1.0f;
    mha_tensor_view v;
    memset(&v, 0, sizeof v);
    v.dtype = MHA_DTYPE_F32;
    v.data = &x;
    assert_error(mha_npy_save(NULL, &v), MHA_ERR_NULL_POINTER, "path");
    assert_error(mha_npy_save("x.npy", NULL), MHA_ERR_NULL_POINTER,
                 "tensor");
}

static void test_load_errors(void **state)
{
    (void)state;
    char path[512];
    tmp_path(path, sizeof path, "does_not_exist.npy");
    mha_tensor *t = &sentinel;
    assert_error(mha_npy_load(path, &t), MHA_ERR_IO, path);
    assert_null(t);

    /* A directory is not a file. */
    assert_error(mha_npy_load(tu_tmpdir, &t), MHA_ERR_IO, tu_tmpdir);

    /* A malformed file: the message names the file and the problem. */
    tmp_path(path, sizeof path, "trailing.npy");
    image im;
    simple(&im, D("(2,)"), 9);
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(im.b, 1, im.n, f), im.n);
    fclose(f);
    assert_error(mha_npy_load(path, &t), MHA_ERR_FORMAT, path);
    assert_error(mha_npy_load(path, &t), MHA_ERR_FORMAT, "1 trailing bytes");
    assert_null(t);
    remove(path);

    /* A long path (3,000 bytes, under PATH_MAX) keeps the reason after it
     * in the message; a message too long for the buffer ends in "...". */
    char *lp = malloc(12000);
    assert_non_null(lp);
    int n = snprintf(lp, 12000, "%s/missing", tu_tmpdir);
    while (n < 3000)
        n += snprintf(lp + n, (size_t)(12000 - n), "/%0200d", 7);
    snprintf(lp + n, (size_t)(12000 - n), "/x.npy");
    assert_error(mha_npy_load(lp, &t), MHA_ERR_IO, "No such file");
    while (n < 11000)
        n += snprintf(lp + n, (size_t)(12000 - n), "/%0200d", 7);
    assert_int_equal(mha_npy_load(lp, &t), MHA_ERR_IO);
    const char *msg = mha_last_error();
    assert_int_equal(strlen(msg), 8191);
    assert_string_equal(msg + 8188, "...");
    free(lp);
}

/* mha_npy_load_rows and mha_npy_info on every NumPy fixture of 2 or more
 * dimensions (C and Fortran order, float, bool, int, 4-D, an empty axis):
 * for several sets of row ranges (in order, reversed, none, empty), the
 * rows equal the same rows of mha_npy_load's whole array, byte for byte;
 * then its refusals. */
static void test_load_rows(void **state)
{
    (void)state;
    for (size_t f = 0; f < N_FIXTURES; f++) {
        const fixture *fx = &fixtures[f];
        char path[512];
        fixture_path(path, sizeof path, fx->file);
        mha_tensor_view info;
        assert_int_equal(mha_npy_info(path, &info), MHA_OK);
        assert_int_equal(info.ndim, fx->ndim);
        for (int k = 0; k < fx->ndim; k++)
            assert_int_equal(info.shape[k], fx->shape[k]);
        if (fx->ndim < 2) {
            mha_tensor *t = NULL;
            const int64_t s0 = 0, c0 = 1;
            assert_error(mha_npy_load_rows(path, 1, &s0, &c0, &t),
                         MHA_ERR_SHAPE, "at least 2 dimensions");
            assert_null(t);
            continue;
        }
        mha_tensor *all = NULL;
        assert_int_equal(mha_npy_load(path, &all), MHA_OK);
        const int nd = fx->ndim;
        const int64_t L = fx->shape[nd - 2], w = fx->shape[nd - 1];
        const size_t item = all->dtype == MHA_DTYPE_BOOL ? 1
                          : (all->dtype == MHA_DTYPE_I32 ||
                             all->dtype == MHA_DTYPE_I64) ? 8 : 4;
        int64_t lead = 1;
        for (int k = 0; k + 2 < nd; k++)
            lead *= fx->shape[k];
        const int64_t sets[5][2][2] = {
            {{0, L}, {0, 0}},                       /* all rows */
            {{L > 0 ? L - 1 : 0, L > 0}, {0, L > 0}}, /* last, then first */
            {{L > 1, L > 1 ? L - 1 : 0}, {0, 0}},   /* all but the first */
            {{0, 0}, {0, 0}},                       /* an empty range */
            {{0, 0}, {0, 0}}};                      /* no range at all */
        const int nr[5] = {1, 2, 1, 1, 0};
        for (int c = 0; c < 5; c++) {
            int64_t st[2], cn[2], rows = 0;
            for (int i = 0; i < nr[c]; i++) {
                st[i] = sets[c][i][0];
                cn[i] = sets[c][i][1];
                rows += cn[i];
            }
            mha_tensor *t = NULL;
            mha_status s = mha_npy_load_rows(path, nr[c], st, cn, &t);
            if (s != MHA_OK)
                fail_msg("%s, set %d: %s", fx->file, c, mha_last_error());
            assert_int_equal(t->dtype, all->dtype);
            assert_int_equal(t->ndim, nd);
            assert_int_equal(t->shape[nd - 2], rows);
            assert_int_equal(t->numel, lead * rows * w);
            const unsigned char *y = t->data;
            for (int64_t b = 0; b < lead; b++)
                for (int i = 0; i < nr[c]; i++) {
                    const size_t n = (size_t)(cn[i] * w) * item;
                    if (n && memcmp(y, (const unsigned char *)all->data +
                                           (size_t)((b * L + st[i]) * w) *
                                               item, n) != 0)
                        fail_msg("%s, set %d: rows of batch %lld differ",
                                 fx->file, c, (long long)b);
                    y += n;
                }
            mha_tensor_free(t);
        }
        mha_tensor_free(all);
    }
    char path[512];
    fixture_path(path, sizeof path, "f4_2x3.npy");
    mha_tensor *t = NULL;
    const int64_t s2[2] = {1, 0}, c2[2] = {2, 1};
    assert_error(mha_npy_load_rows(path, 1, s2, c2, &t), MHA_ERR_SHAPE,
                 "rows [1, 3) outside the 2 rows");
    assert_null(t);
    assert_error(mha_npy_load_rows(path, -1, s2, c2, &t),
                 MHA_ERR_INVALID_ARGUMENT, "nranges");
    assert_error(mha_npy_load_rows(path, 1, NULL, c2, &t),
                 MHA_ERR_NULL_POINTER, "starts or counts");
    assert_error(mha_npy_load_rows(NULL, 1, s2, c2, &t),
                 MHA_ERR_NULL_POINTER, "path");
    assert_error(mha_npy_load_rows(path, 1, s2, c2, NULL),
                 MHA_ERR_NULL_POINTER, "out");
    char missing[512];
    tmp_path(missing, sizeof missing, "no_such.npy");
    assert_error(mha_npy_load_rows(missing, 1, s2, c2, &t), MHA_ERR_IO,
                 "cannot open");
    assert_error(mha_npy_load_rows(tu_tmpdir, 1, s2, c2, &t), MHA_ERR_IO,
                 "not a regular file");
    /* a file whose data is cut short: refused from its header alone */
    const unsigned char *all;
    FILE *in = fopen(path, "rb");
    assert_non_null(in);
    unsigned char bytes[512];
    const size_t n = fread(bytes, 1, sizeof bytes, in);
    fclose(in);
    all = bytes;
    char cut[512];
    tmp_path(cut, sizeof cut, "cut.npy");
    FILE *out = fopen(cut, "wb");
    assert_non_null(out);
    assert_int_equal(fwrite(all, 1, n - 4, out), n - 4);
    fclose(out);
    assert_error(mha_npy_load_rows(cut, 1, s2, c2, &t), MHA_ERR_FORMAT,
                 "truncated data");
    mha_tensor_view info;
    assert_error(mha_npy_info(cut, &info), MHA_ERR_FORMAT, "truncated data");
    remove(cut);
}

/* mha_file_save: the bytes given, by the rules of every save (atomic, a
 * symbolic link followed, the old file's mode kept); its refusals. */
static void test_file_save(void **state)
{
    (void)state;
    char path[512], target[512], link[512];
    const char bytes[] = "not a tensor, the caller's own format\n";
    tmp_path(path, sizeof path, "raw.bin");
    assert_int_equal(mha_file_save(path, bytes, sizeof bytes), MHA_OK);
    size_t n = 0;
    unsigned char *got = read_all(path, &n);
    assert_non_null(got);
    assert_int_equal(n, sizeof bytes);
    assert_memory_equal(got, bytes, sizeof bytes);
    free(got);
    /* an existing file keeps its mode */
    assert_int_equal(chmod(path, 0600), 0);
    assert_int_equal(mha_file_save(path, bytes, 5), MHA_OK);
    struct stat st;
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_mode & 0777, 0600);
    assert_int_equal(st.st_size, 5);
    /* a symbolic link is followed: the link stays, its target is written */
    tmp_path(target, sizeof target, "raw_target.bin");
    tmp_path(link, sizeof link, "raw_link.bin");
    assert_int_equal(symlink("raw_target.bin", link), 0);
    assert_int_equal(mha_file_save(link, bytes, 7), MHA_OK);
    assert_int_equal(lstat(link, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_int_equal(stat(target, &st), 0);
    assert_int_equal(st.st_size, 7);
    /* nothing to write is an empty file */
    assert_int_equal(mha_file_save(path, NULL, 0), MHA_OK);
    assert_int_equal(stat(path, &st), 0);
    assert_int_equal(st.st_size, 0);
    /* refused, the file as it was, no temporary left */
    assert_error(mha_file_save(path, NULL, 3), MHA_ERR_NULL_POINTER, "data");
    assert_error(mha_file_save(NULL, bytes, 3), MHA_ERR_NULL_POINTER, "path");
    char dir[512];
    tmp_path(dir, sizeof dir, "raw_dir");
    assert_int_equal(mkdir(dir, 0755), 0);
    assert_error(mha_file_save(dir, bytes, 3), MHA_ERR_IO, dir);
    assert_int_equal(count_in_tmpdir(".tmp."), 0);
    rmdir(dir);
    unlink(link);
    unlink(target);
    unlink(path);
}

static void test_save_errors(void **state)
{
    (void)state;
    float x[6] = {0};
    mha_tensor_view v;
    memset(&v, 0, sizeof v);
    v.dtype = MHA_DTYPE_F32;
    v.ndim = 2;
    v.shape[0] = 2;
    v.shape[1] = 3;
    v.data = x;
    char path[512];

    /* A directory that does not exist: MHA_ERR_IO, nothing written. */
    tmp_path(path, sizeof path, "no_such_dir/out.npy");
    assert_error(mha_npy_save(path, &v), MHA_ERR_IO, path);
    assert_false(file_exists(path));
    char dir[512];
    tmp_path(dir, sizeof dir, "no_such_dir");
    assert_false(file_exists(dir));

    /* The target is a directory: the rename fails, the temporary file is
     * removed and the directory is untouched. */
    tmp_path(dir, sizeof dir, "a_directory");
    assert_int_equal(mkdir(dir, 0755), 0);
    assert_error(mha_npy_save(dir, &v), MHA_ERR_IO, dir);
    assert_int_equal(count_in_tmpdir(".tmp."), 0);
    rmdir(dir);

    tmp_path(path, sizeof path, "bad.npy");
    v.dtype = MHA_DTYPE_BF16;   /* (F16 is written: test_save_matches_numpy) */
    assert_error(mha_npy_save(path, &v), MHA_ERR_UNSUPPORTED, "BF16");
    v.dtype = (mha_dtype)42;
    assert_error(mha_npy_save(path, &v), MHA_ERR_INVALID_ARGUMENT, "42");
    v.dtype = MHA_DTYPE_F32;
    v.ndim = 9;
    assert_error(mha_npy_save(path, &v), MHA_ERR_INVALID_ARGUMENT, "ndim 9");
    v.ndim = -1;
    assert_error(mha_npy_save(path, &v), MHA_ERR_INVALID_ARGUMENT,
                 "ndim -1");
    v.ndim = 2;
    v.shape[1] = -3;
    assert_error(mha_npy_save(path, &v), MHA_ERR_INVALID_ARGUMENT,
                 "negative");
    v.shape[0] = INT64_MAX / 2;
    v.shape[1] = 3;
    assert_error(mha_npy_save(path, &v), MHA_ERR_OVERFLOW, "overflow");
    v.shape[0] = 2;
    v.data = NULL;
    assert_error(mha_npy_save(path, &v), MHA_ERR_NULL_POINTER, "data");
    assert_false(file_exists(path));
    assert_int_equal(count_in_tmpdir(".tmp."), 0);

    /* An existing file is replaced whole. */
    v.data = x;
    assert_int_equal(mha_npy_save(path, &v), MHA_OK);
    v.ndim = 1;
    v.shape[0] = 1;
    assert_int_equal(mha_npy_save(path, &v), MHA_OK);
    mha_tensor *t;
    assert_int_equal(mha_npy_load(path, &t), MHA_OK);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->numel, 1);
    mha_tensor_free(t);
    remove(path);
}

/* ---- a save interrupted by a signal ---------------------------------- */

static volatile sig_atomic_t in_save;

static void discard_and_exit(int sig)
{
    (void)sig;
    const int was = in_save;
    mha_io_discard_temporaries();
    _exit(was ? 10 : 11);
}

/* A child saves a 16 MB array in a loop until a timer's signal, whose
 * handler calls mha_io_discard_temporaries and exits: whenever it lands,
 * no NAME.tmp.* may be left (before the registry, one was whenever the
 * signal landed inside a save: in nearly every run).  Five delays; the
 * signal must have landed inside a save at least once. */
static void test_interrupted_save_leaves_no_temp(void **state)
{
    (void)state;
    enum { N = 4 << 20 };
    float *x = calloc(N, sizeof *x);
    assert_non_null(x);
    mha_tensor_view v;
    memset(&v, 0, sizeof v);
    v.name = "x";
    v.dtype = MHA_DTYPE_F32;
    v.ndim = 2;
    v.shape[0] = 1024;
    v.shape[1] = N / 1024;
    v.data = x;
    char path[512];
    tmp_path(path, sizeof path, "interrupted.npy");
    static const long delays_us[] = {3000, 7000, 13000, 29000, 61000};
    int landed = 0;
    for (size_t k = 0; k < sizeof delays_us / sizeof *delays_us; k++) {
        fflush(NULL);
        const pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = discard_and_exit;
            sigemptyset(&sa.sa_mask);
            sigaction(SIGALRM, &sa, NULL);
            struct itimerval it;
            memset(&it, 0, sizeof it);
            it.it_value.tv_usec = delays_us[k];
            setitimer(ITIMER_REAL, &it, NULL);
            for (;;) {
                in_save = 1;
                mha_npy_save(path, &v);
                in_save = 0;
            }
        }
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        assert_true(WIFEXITED(status));
        landed += WEXITSTATUS(status) == 10;
        if (count_in_tmpdir("interrupted.npy.tmp.") != 0)
            fail_msg("a save interrupted after %ld us left its temporary "
                     "file", delays_us[k]);
    }
    assert_true(landed > 0);
    remove(path);
    free(x);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_numpy_fixtures),
        cmocka_unit_test(test_save_matches_numpy),
        cmocka_unit_test(test_round_trips),
        cmocka_unit_test(test_save_normalises_bool),
        cmocka_unit_test(test_header_variants),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_every_truncation),
        cmocka_unit_test(test_null_arguments),
        cmocka_unit_test(test_load_errors),
        cmocka_unit_test(test_save_errors),
        cmocka_unit_test(test_file_save),
        cmocka_unit_test(test_load_rows),
        cmocka_unit_test(test_interrupted_save_leaves_no_temp),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
