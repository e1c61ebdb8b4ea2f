/*
 * internal.h -- what the library's own files share; never installed.
 */
#ifndef MHA_INTERNAL_H
#define MHA_INTERNAL_H

#include "mha_io.h"

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

#define MHA_CHECK(expr)                           \
    do {                                          \
        mha_status mha_check_st_ = (expr);        \
        if (mha_check_st_ != MHA_OK)              \
            return mha_check_st_;                 \
    } while (0)

/* ---- checked size arithmetic (module.c) -------------------------------- */
/* *out = a * b; returns 0 on overflow of int64_t (a, b >= 0). */
int mha_mul_ok(int64_t a, int64_t b, int64_t *out);
/* Allocates n floats, n*4 checked against SIZE_MAX; NULL + error on failure. */
float *mha_alloc_floats(int64_t n, const char *what);

/* ---- counter-based random numbers (rng.c) ------------------------------ */
uint64_t mha_mix64(uint64_t x);
/* A uniform double in [0, 1) from the 53 high bits of a 64-bit hash. */
double mha_u01(uint64_t bits);

/* ---- the module (module.c) --------------------------------------------- */
enum { MHA_MAX_PARAMS = 8 };

typedef struct mha_param {
    mha_param_info info;
    int64_t offset;              /* into mha_module.params, in floats */
} mha_param;

struct mha_module {
    mha_config cfg;              /* resolved: kdim, vdim, scale filled in */
    int scale_given;             /* cfg.scale was chosen, not the default */
    int64_t head_dim;            /* d_h (E / H unless configured) */
    int64_t inner_dim;           /* D = H * d_h, the heads side by side */
    int packed;                  /* kdim == vdim == E: in_proj_weight */
    int nparams;
    mha_param param[MHA_MAX_PARAMS];
    float *params;               /* every parameter, one allocation */
    int64_t params_numel;

    /* Views into params, set once at create (NULL when absent). */
    const float *w_q, *w_k, *w_v;  /* [D, E], [D, kdim], [D, vdim] */
    const float *b_q, *b_k, *b_v;  /* [D] each */
    const float *w_o, *b_o;        /* [E, D], [E] */
    const float *bias_k, *bias_v;  /* [D] each */
};

/* ---- GEMM (gemm.c: the only file that calls CBLAS) --------------------- */
/*
 * y (rows, n_out), row stride ldy  =  x (rows, n_in), row stride ldx
 *                                     times w^T, w (n_out, n_in) row-major,
 *                                     plus b (n_out) broadcast over rows
 *                                     (b may be NULL).
 */
void mha_linear(const float *x, int64_t rows, int64_t n_in, int64_t ldx,
                const float *w, int64_t n_out, const float *b,
                float *y, int64_t ldy);

/*
 * mha_linear with x's n_in columns (and w's) in nblk equal blocks, block t
 * scaled by scale[t] (scale NULL: all 1), blocks scaled by 0 skipped:
 *   y = x_0 w_0^T s_0 + ... + b.   The output projection under a head mask.
 */
void mha_linear_blocks(const float *x, int64_t rows, int64_t n_in,
                       int64_t ldx, const float *w, int64_t n_out,
                       const float *b, const float *scale, int64_t nblk,
                       float *y, int64_t ldy);

/* The gradients of mha_linear (beta 0: overwrite, 1: add):
 *   dx = dy w,   dw = dy^T x,   db = column sums of dy (db may be NULL). */
void mha_linear_grad_input(const float *dy, int64_t rows, int64_t n_out,
                           int64_t lddy, const float *w, int64_t n_in,
                           float beta, float *dx, int64_t lddx);
void mha_linear_grad_params(const float *dy, int64_t rows, int64_t n_out,
                            int64_t lddy, const float *x, int64_t n_in,
                            int64_t ldx, float beta, float *dw, float *db);
/* mha_linear_grad_params of mha_linear_blocks: dw's column block t is
 * scale[t] dy^T x_t (+ itself when beta = 1); db is unscaled. */
void mha_linear_grad_params_blocks(const float *dy, int64_t rows,
                                   int64_t n_out, int64_t lddy,
                                   const float *x, int64_t n_in, int64_t ldx,
                                   const float *scale, int64_t nblk,
                                   float beta, float *dw, float *db);

/* ---- masks (mask.c): every mask kind -> one row of additive biases ----- */
typedef struct mha_mask_plan {
    int64_t batch, heads, q_len, kv_len, total_keys;
    mha_mask attn;             /* kind NONE if absent */
    int64_t attn_stride_b, attn_stride_h;   /* 0 where broadcast */
    mha_mask pad;              /* kind NONE if absent */
    int64_t pad_stride_b;
    const int64_t *key_lengths;
    mha_causal causal;
} mha_mask_plan;

/* Validates every mask argument of `args` (batch, q_len, kv_len and the
 * mask fields) and fills the plan; extra_keys follow the real ones. */
mha_status mha_mask_plan_init(mha_mask_plan *plan, int64_t heads,
                              int64_t extra_keys,
                              const mha_forward_args *args);

/*
 * Fills row[0 .. total_keys) for (b, h, i) with what is added to the scaled
 * scores: 0 (plain), a finite additive value, or -INFINITY (excluded).
 * Returns the number of keys that are not excluded.
 */
int64_t mha_mask_row(const mha_mask_plan *plan, int64_t b, int64_t h,
                     int64_t i, float *row);

/* The same for real-key columns j0 .. j0+n-1 only (j0 + n <= Lk). */
int64_t mha_mask_cols(const mha_mask_plan *plan, int64_t b, int64_t h,
                      int64_t i, int64_t j0, int64_t n, float *row);

/* The last real key that causal masking and key_lengths leave to query
 * row i of batch b (-1: none).  Explicit masks may block more. */
int64_t mha_mask_last(const mha_mask_plan *plan, int64_t b, int64_t i);

/* Whether the plan has an explicit (memory) mask, as opposed to masking
 * that follows from indices alone. */
static inline int mha_mask_has_explicit(const mha_mask_plan *p)
{
    return p->attn.kind != MHA_MASK_NONE || p->pad.kind != MHA_MASK_NONE;
}

/* ---- files (io/file.c) ---------------------------------------------------
 * Reads a whole file into a malloc'ed buffer (*size bytes, plus one NUL
 * byte after the end that is not counted).  Refuses files larger than
 * max_size with MHA_ERR_FORMAT, naming `what`.
 */
mha_status mha_read_file(const char *path, size_t max_size, const char *what,
                         unsigned char **data, size_t *size);
/*
 * Writes n chunks to `path` through a temporary file in the same directory
 * and a rename, so that `path` is either the complete new file or
 * untouched; on failure the temporary file is removed.
 */
mha_status mha_write_file_atomic(const char *path, const void *const *chunks,
                                 const size_t *sizes, int n);
/* Size in bytes of one element of dtype in a file; 0 if unknown. */
size_t mha_dtype_size(mha_dtype dtype);

#endif /* MHA_INTERNAL_H */
