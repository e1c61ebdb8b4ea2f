/*
 * core.h -- what every room of the library shares: errors, checked size
 * arithmetic, counter-based random numbers.  Never installed.
 */
#ifndef MHA_CORE_H
#define MHA_CORE_H

#include "mha.h"

#include <stddef.h>
#include <stdint.h>

/* ---- errors (error.c) ---------------------------------------------------
 * mha_set_error records a printf-style message in the thread-local buffer
 * and returns `status`, so a check is one line:
 *     if (x < 0) return mha_set_error(MHA_ERR_SHAPE, "x is %d", x);
 */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
mha_status mha_set_error(mha_status status, const char *fmt, ...);

/* The message buffer's size: room for a path of PATH_MAX (4096) bytes and
 * the reason after it (a message names the file first and says what was
 * wrong last; a buffer that cut it would lose the reason).  A copy of the
 * message, to prefix it with context, takes this many bytes. */
#define MHA_ERROR_CAP 8192

#define MHA_CHECK(expr)                           \
    do {                                          \
        mha_status mha_check_st_ = (expr);        \
        if (mha_check_st_ != MHA_OK)              \
            return mha_check_st_;                 \
    } while (0)

/* ---- checked size arithmetic (checked.c) -------------------------------- */
/* *out = a * b; returns 0 on overflow of int64_t (a, b >= 0). */
int mha_mul_ok(int64_t a, int64_t b, int64_t *out);
/* Allocates n floats, n*4 checked against SIZE_MAX; NULL + error on failure. */
float *mha_alloc_floats(int64_t n, const char *what);

/* ---- the ABI rule's structs (checked.c) ---------------------------------
 * A caller's struct of `size` bytes (sizeof as its program was compiled)
 * copied into the library's `copy` of copy_size bytes: a smaller one (an
 * older mha.h) is zero-extended, its missing fields their defaults; a
 * larger one (a newer mha.h) must be zero past copy_size, or the call is
 * refused naming the struct.  NULL user: copy zeroed, MHA_OK (the call
 * reports the NULL itself). */
mha_status mha_struct_in(void *copy, size_t copy_size, const void *user,
                         size_t size, const char *type);
/* In a NAME_sized call: `type name_`, the library's copy of the caller's
 * `name` (of name_size bytes), or the call returns the refusal. */
#define MHA_STRUCT_IN(type, name)                                        \
    type name##_;                                                        \
    MHA_CHECK(mha_struct_in(&name##_, sizeof name##_, name, name##_size, \
                            #type))
/* An output struct of `size` bytes: nonzero (the library writes the first
 * min(size, its own) bytes). */
mha_status mha_struct_out_size(const void *user, size_t size,
                               const char *type);

/* ---- counter-based random numbers (rng.c) ------------------------------ */
uint64_t mha_mix64(uint64_t x);
/* A uniform double in [0, 1) from the 53 high bits of a 64-bit hash. */
double mha_u01(uint64_t bits);

/* A 64-bit fingerprint of `bytes` bytes at p, mixed into `h`: every byte
 * of a buffer up to 16 KiB, and 1024 evenly spaced 8-byte words (the
 * first and the last among them) of a larger one: O(1) per buffer.  It tells a
 * buffer refilled with other data from the one seen before, not a single
 * changed element of a large one.  NULL hashes as empty. */
uint64_t mha_fingerprint(uint64_t h, const void *p, size_t bytes);

/* ---- input scans (scan.c) --------------------------------------------- */
/* A scan of `rows` rows of `cols` floats, ld apart: the largest finite |x|
 * (0 for none), and *finite = whether every element is finite.  The SIMD
 * tiers' (kernels.h, `amax`) or mha_amax_portable. */
typedef float (*mha_amax_fn)(const float *x, int64_t rows, int64_t cols,
                             int64_t ld, int *finite);
float mha_amax_portable(const float *x, int64_t rows, int64_t cols,
                        int64_t ld, int *finite);
/* The largest finite |x| of `rows` rows of `cols` floats, ld apart (0
 * for none), on up to `threads` threads, each piece scanned by amax (NULL:
 * the portable loop; a max is exact, so any scan gives the same value):
 * non-finite values are NaN in, NaN out, or masked, and are not the
 * scale's to answer for. */
double mha_max_abs_finite(const float *x, int64_t rows, int64_t cols,
                          int64_t ld, int threads, mha_amax_fn amax);
/* The same of 16-bit elements: bfloat16 (bf) or IEEE half. */
double mha_max_abs_finite16(const uint16_t *x, int64_t rows, int64_t cols,
                            int64_t ld, int bf, int threads);
/* Refuses a problem whose scaled scores could overflow float32: the bound
 * |scale| * d_h * max|q| * max|k| of every |scale q.k| (each over finite
 * elements) above FLT_MAX.  The kernels would see Inf scores and the
 * softmax NaN where the float64 result is finite. */
mha_status mha_check_score_range(float scale, int64_t dh, double qmax,
                                 double kmax);
/* The same test without the message (for a team of threads to agree). */
int mha_score_range_ok(float scale, int64_t dh, double qmax, double kmax);

/* The fingerprint of a call's inputs, what a plan's backward checks its
 * run against (the one used by mha_plan_backward and
 * mha_attention_plan_backward): each buffer of `bufs` (NULL data: absent)
 * in order, then the masks' contents and the B key lengths. */
typedef struct mha_print_buf {
    const void *data;
    size_t bytes;
} mha_print_buf;
uint64_t mha_inputs_fingerprint(const mha_print_buf *bufs, int n,
                                const mha_mask *attn_mask,
                                const mha_mask *key_padding_mask,
                                const int64_t *key_lengths, int64_t B);

#endif /* MHA_CORE_H */
