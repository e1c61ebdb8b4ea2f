/*
 * mha.h -- the one public header of libmha, multi-head attention in C.
 *
 *     MultiHead(Q, K, V) = Concat(m_1 head_1, ..., m_H head_H) W_O^T + b_O
 *     head_h             = softmax(Q_h K_h^T * scale + mask) V_h
 *     Q_h, K_h, V_h      = the h-th d_h-wide column block of
 *                          query W_q^T + b_q, key W_k^T + b_k, value W_v^T + b_v
 *     m_h                = the head mask (1 unless one is given)
 *
 * Conventions used throughout:
 *   - Row-major, batch first.  Shapes are written (dim0, dim1, ...).
 *   - E = embed_dim, H = num_heads, d_h = head_dim (E / H unless set),
 *     D = H * d_h the inner width (= E except in pruned modules),
 *     kdim/vdim = key/value widths.
 *   - Parameters are stored exactly as PyTorch's nn.MultiheadAttention stores
 *     them (names and layouts below), so a state_dict loads with no conversion.
 *   - A linear layer is y = x W^T + b with W stored as [out, in].
 *   - Every call returns an mha_status.  On failure mha_last_error() names
 *     what was wrong.  The library never prints, exits or aborts.
 */
#ifndef MHA_H
#define MHA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MHA_STATIC_DEFINE)
#define MHA_API
#elif defined(_WIN32)
#ifdef MHA_BUILDING
#define MHA_API __declspec(dllexport)
#else
#define MHA_API __declspec(dllimport)
#endif
#elif defined(__GNUC__) || defined(__clang__)
#define MHA_API __attribute__((visibility("default")))
#else
#define MHA_API
#endif

/*
 * API layers.
 *   stable        everything in this header and in mha_io.h that is not
 *                 marked experimental.  Calls and meanings stay; a call
 *                 that is replaced is first marked MHA_DEPRECATED for one
 *                 minor version (the compiler warns where it is used).
 *   experimental  declared only when MHA_EXPERIMENTAL is defined before
 *                 this header is included (zstd's ZSTD_STATIC_LINKING_ONLY):
 *                 head pruning, the kernel tier, the dropout hash.  Struct
 *                 fields that are experimental (head_dim, head_mask) say so
 *                 where they are declared.  These may change in any minor
 *                 version.
 *
 * The ABI rule (libmha's ABI version, MHA_ABI_VERSION, is the soname's
 * number: libmha.so.1).  Every call that takes or fills a struct of this
 * header or mha_io.h is an inline wrapper that passes the struct's size
 * as the program was compiled (sizeof) to an exported NAME_sized call,
 * as Linux's openat2 and clone3 take theirs.  Structs only grow, at their
 * end, and zero is every field's default, so:
 *   - a program built against an older mha.h passes a smaller struct: the
 *     library reads what it passed and takes the fields after it as zero;
 *   - a program built against a newer mha.h passes a larger one: it runs
 *     when the fields this library does not know are zero, and is refused
 *     (MHA_ERR_INVALID_ARGUMENT, naming the struct and the byte) when one
 *     is set, never silently ignored;
 *   - a struct the library fills (mha_get_config, mha_param_info_*) is
 *     filled up to the caller's size.
 * Frozen, never to grow: structs embedded in others or passed in arrays
 * (mha_rope, mha_modifiers, mha_mask, mha_attention_part, mha_tensor_view)
 * and handles the library owns.  The soname changes only on a real break
 * (a call removed or a meaning changed).  A program loading libmha by
 * other means checks MHA_ABI_OK().  libmha_mpi (mha_mpi.h) is not under
 * this rule yet: its soname carries MAJOR.MINOR.
 */
#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 6
#define MHA_VERSION_PATCH 0
#define MHA_VERSION_NUMBER \
    (MHA_VERSION_MAJOR * 10000 + MHA_VERSION_MINOR * 100 + MHA_VERSION_PATCH)
#define MHA_ABI_VERSION 1

/* The version of the library actually linked, e.g. "0.6.0". */
MHA_API const char *mha_version_string(void);
/* MHA_VERSION_NUMBER of the library actually linked. */
MHA_API int mha_version_number(void);
/* MHA_ABI_VERSION of the library actually linked. */
MHA_API int mha_abi_version(void);
/* Nonzero when the linked library keeps this header's ABI (the soname
 * makes this so for programs linked the usual way). */
#define MHA_ABI_OK() (mha_abi_version() == MHA_ABI_VERSION)

#if defined(__GNUC__) || defined(__clang__)
#define MHA_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define MHA_DEPRECATED(msg)
#endif

/* ------------------------------------------------------------------------ */
/* Status codes.  The values are pinned: they are never renumbered.         */
/* ------------------------------------------------------------------------ */
typedef enum mha_status {
    MHA_OK = 0,
    MHA_ERR_NULL_POINTER = 1,     /* a required pointer argument was NULL    */
    MHA_ERR_INVALID_CONFIG = 2,   /* impossible module configuration         */
    MHA_ERR_INVALID_ARGUMENT = 3, /* a value out of its range                */
    MHA_ERR_SHAPE = 4,            /* tensor shapes do not fit together       */
    MHA_ERR_OVERFLOW = 5,         /* a size product does not fit in 64 bits  */
    MHA_ERR_OUT_OF_MEMORY = 6,    /* an allocation failed                    */
    MHA_ERR_NOT_FOUND = 7,        /* no parameter of that name               */
    MHA_ERR_NON_FINITE = 8,       /* NaN or Inf where a finite value is due  */
    MHA_ERR_IO = 9,               /* reading or writing a file failed        */
    MHA_ERR_FORMAT = 10,          /* a file is malformed                     */
    MHA_ERR_UNSUPPORTED = 11,     /* valid, but not supported by this build  */
    MHA_ERR_COMM = 12             /* communication between processes failed
                                     (libmha_mpi: an MPI call, a lost peer)  */
} mha_status;

/* A short constant description of a status ("shape mismatch"). */
MHA_API const char *mha_status_string(mha_status status);

/*
 * The message of the last failed call on this thread, naming what was wrong
 * ("key has last dimension 510, expected kdim 512").  Empty after a success
 * only if no call failed before; read it right after the failing call.
 * The pointer is thread-local and valid until the next call on this thread.
 */
MHA_API const char *mha_last_error(void);

/*
 * For libraries layered on libmha (libmha_mpi): records `message` as the
 * message mha_last_error() returns on this thread (cut to 8191 bytes,
 * ending in "...") and returns `status`, so one message store serves them
 * all.
 */
MHA_API mha_status mha_error_set(mha_status status, const char *message);

/* ------------------------------------------------------------------------ */
/* Positions and score modifiers (docs/semantics.md, "Score modifiers")     */
/* ------------------------------------------------------------------------ */

/*
 * Rotary position embeddings (RoPE, Su et al. 2021) of Q and K, after
 * their projections and biases, before the scores.  The first `dims`
 * elements of each head are rotated in pairs by angle
 *     position / scale * theta^(-2k / dims),  k = 0 .. dims/2 - 1,
 * the rest pass through.  NEOX pairs element k with k + dims/2 (Hugging
 * Face Llama's rotate_half); GPTJ pairs 2k with 2k + 1 (interleaved).
 */
typedef enum mha_rope_style {
    MHA_ROPE_NONE = 0,
    MHA_ROPE_NEOX = 1,
    MHA_ROPE_GPTJ = 2
} mha_rope_style;

typedef struct mha_rope {
    mha_rope_style style;  /* NONE: no rotation, the other fields unused  */
    int64_t dims;          /* rotary dims: even, <= d_h; 0 -> d_h          */
    float theta;           /* base, > 1 and finite; 0 -> 10000             */
    float scale;           /* linear position scaling (positions are
                              divided by it), > 0 and finite; 0 -> 1       */
} mha_rope;

/*
 * What changes the scores s_ij = scale q_i.k_j, in this order:
 *   softcap c > 0    s <- c tanh(s / c)                      (Gemma 2)
 *   alibi            s <- s - slope_h |i + Lk - Lq - j|      (BLOOM, MPT)
 *   the masks        as elsewhere in this header
 *   window           key j visible from query i iff
 *                    i + Lk - Lq - left <= j <= i + Lk - Lq + right
 *                    (FlashAttention's window_size; -1: no bound on that
 *                    side), from indices: keys outside are never read
 *   chunk C > 0      key j visible from query i iff floor(pos_i / C) ==
 *                    floor(j / C), pos_i = i + Lk - Lq (Llama 4's
 *                    attention_chunk: a query sees only its own chunk of
 *                    C positions), from indices like the window.  Not a
 *                    field here (this struct is frozen): attention_chunk
 *                    of mha_config, mha_attention_args and
 *                    mha_attention_decode_args.
 * Positions are aligned bottom-right, with a KV cache per sequence (Lk
 * its own length).  The keys bias_k and the zero key appended by
 * add_bias_kv / add_zero_attn have no position: softcapped, never biased
 * or windowed.  Zero is "none" for every field.
 */
typedef struct mha_modifiers {
    float softcap;              /* c > 0 and finite; 0: none              */
    int alibi;                  /* nonzero: ALiBi                         */
    const float *alibi_slopes;  /* (H) finite, or NULL: the paper's
                                   geometric slopes for H heads
                                   (mha_alibi_slopes)                    */
    int window;                 /* nonzero: the window below applies      */
    int64_t window_left;        /* >= -1                                  */
    int64_t window_right;       /* >= -1                                  */
    mha_rope rope;              /* rotary embeddings of Q and K           */
} mha_modifiers;

/* The default ALiBi slopes of H heads (Press et al. 2022): for H a power
 * of two, 2^(-8 (h + 1) / H); otherwise those of the largest power of two
 * n < H, followed by the 1st, 3rd, 5th, ... slopes of 2n's sequence
 * until there are H.  slopes receives H floats. */
MHA_API mha_status mha_alibi_slopes(int64_t num_heads, float *slopes);

/* The largest RoPE position: 2^53, up to which float64 (the precision of
 * the angles) holds every integer.  Larger ones, and negative ones, are
 * refused (MHA_ERR_INVALID_ARGUMENT) wherever positions are given. */
#define MHA_ROPE_MAX_POSITION (INT64_C(1) << 53)

/*
 * Rotates x in place: `rows` rows of `heads` heads of head_dim elements
 * (row r, head h, element d at x[r * ld + h * head_dim + d]), row r at
 * position positions[r] (NULL: pos0 + r).  What the module does to Q and
 * K; for the keys a caller appends to a KV cache itself.
 */
MHA_API mha_status mha_rope_apply(const mha_rope *rope, int64_t rows,
                                  int64_t heads, int64_t head_dim,
                                  const int64_t *positions, int64_t pos0,
                                  float *x, int64_t ld);
/*
 * The inverse rotation (each pair turned by minus its angle), the same
 * arguments: what carries a gradient with respect to rotated q or k back
 * to the unrotated one (the rotation is orthogonal: R^-1 = R^T).
 */
MHA_API mha_status mha_rope_apply_inverse(const mha_rope *rope, int64_t rows,
                                          int64_t heads, int64_t head_dim,
                                          const int64_t *positions,
                                          int64_t pos0, float *x, int64_t ld);

/* ------------------------------------------------------------------------ */
/* The module                                                               */
/* ------------------------------------------------------------------------ */

/*
 * Zero means "the default" in every options struct, so that
 * `mha_config c = {0};` is complete.  Where zero is also a value one may
 * want to say, a bit of the struct's `given` field makes the field mean
 * exactly what it holds:
 */
#define MHA_GIVEN_SCALE   (1u << 0)  /* scale as written, 0 included       */
#define MHA_GIVEN_DROPOUT (1u << 1)  /* dropout as written: 0 overrides a
                                        file's p in mha_module_from_file  */
#define MHA_GIVEN_Q_OFFSET (1u << 2) /* mha_attention_args.q_offset as
                                        written, 0 included               */

/*
 * Configuration.  Zero in any field means "the default", so
 * `mha_config c = {0}; c.embed_dim = 512; c.num_heads = 8;` is complete.
 */
typedef struct mha_config {
    int64_t embed_dim;  /* E, required, > 0                                 */
    int64_t num_heads;  /* H, required, > 0, must divide E unless head_dim
                           is set                                           */
    int64_t kdim;       /* width of key inputs;   0 -> E                    */
    int64_t vdim;       /* width of value inputs; 0 -> E                    */
    int no_bias;        /* nonzero: no in_proj_bias and no out_proj.bias    */
    int add_bias_kv;    /* nonzero: learned bias_k / bias_v appended as one
                           extra key / value after the real ones (PyTorch)  */
    int add_zero_attn;  /* nonzero: an all-zero key / value appended last,
                           after bias_k/bias_v (PyTorch)                    */
    float dropout;      /* p in [0, 1] on attention probabilities, applied
                           only in training mode; 0 -> no dropout           */
    float scale;        /* softmax scale; 0 -> 1 / sqrt(d_h) unless
                           MHA_GIVEN_SCALE.  Finite.                        */
    uint64_t seed;      /* seed of the Xavier initialisation at create      */
    int64_t head_dim;   /* experimental.  d_h; 0 -> E / H (then H must
                           divide E).  Set, the heads' inner width
                           D = H * d_h may differ from E: what
                           mha_prune_heads makes.  PyTorch's
                           nn.MultiheadAttention has no such module.        */
    unsigned given;     /* MHA_GIVEN_SCALE, MHA_GIVEN_DROPOUT (above)        */
    int64_t num_kv_heads;  /* H_kv, dividing num_heads; 0 -> num_heads.
                           Grouped-query attention (1: multi-query): W_k
                           and W_v have H_kv * d_h rows, query head h
                           reads K/V head h / (H / H_kv) (Llama).  Such a
                           module keeps q/k/v_proj_weight apart.           */
    mha_modifiers mods; /* RoPE, ALiBi, window, softcap (above).  The
                           slopes are copied at create; mha_get_config
                           points at the module's copy.                   */
    int sinks;          /* nonzero: a parameter `sinks` (H) of learned
                           logits, one per head, joins each softmax's
                           denominator with no value (gpt-oss):
                           p_ij = exp(s_ij) / (sum_j' exp(s_ij') +
                           exp(sinks_h)).  Zero at create.               */
    int64_t attention_chunk;  /* C >= 0; 0: none.  Chunked attention
                           (Llama 4): a query sees only the keys of its
                           own chunk of C positions (mha_modifiers
                           above), beside causal masking and the window. */
} mha_config;

/* Opaque handle.  One module may be used by several threads at once for
 * forward passes; changing its parameters must not overlap a forward. */
typedef struct mha_module mha_module;

/*
 * Validates `config`, allocates the parameters and initialises them from
 * config->seed: Xavier-uniform weights (in_proj_weight as one [3E, E]
 * matrix, as PyTorch does), zero biases, Xavier-normal bias_k / bias_v.
 * On failure *out is set to NULL.
 */
MHA_API mha_status mha_create_sized(const mha_config *config,
                                    size_t config_size, mha_module **out);
static inline mha_status mha_create(const mha_config *config, mha_module **out)
{
    return mha_create_sized(config, sizeof *config, out);
}

/* Frees the module.  NULL is accepted and ignored. */
MHA_API void mha_free(mha_module *module);

/* The resolved configuration (defaults filled in: kdim, vdim, scale). */
MHA_API mha_status mha_get_config_sized(const mha_module *module,
                                        mha_config *out, size_t out_size);
static inline mha_status mha_get_config(const mha_module *module,
                                        mha_config *out)
{
    return mha_get_config_sized(module, out, sizeof *out);
}

/* Re-initialises every parameter from `seed`, exactly as mha_create does. */
MHA_API mha_status mha_reset_parameters(mha_module *module, uint64_t seed);

/*
 * Parameters, named and laid out as in PyTorch's state_dict, in its order:
 *
 *   in_proj_weight   [3D, E]      rows [W_q; W_k; W_v]  when kdim = vdim = E
 *   q_proj_weight    [D, E]                             otherwise,
 *   k_proj_weight    [D, kdim]                          instead of
 *   v_proj_weight    [D, vdim]                          in_proj_weight
 *   in_proj_bias     [3D]         [b_q; b_k; b_v]       unless no_bias
 *   bias_k, bias_v   [1, 1, D]                          with add_bias_kv
 *   out_proj.weight  [E, D]
 *   out_proj.bias    [E]                                unless no_bias
 *
 * (D = E in every module PyTorch can make.)
 * Head h owns rows h*d_h .. (h+1)*d_h - 1 of W_q, W_k, W_v (and the same
 * entries of the biases), and columns h*d_h .. (h+1)*d_h - 1 of out_proj.
 */
#define MHA_MAX_PARAM_NDIM 3
typedef struct mha_param_info {
    const char *name;                  /* static string, e.g. "in_proj_bias" */
    int ndim;
    int64_t shape[MHA_MAX_PARAM_NDIM];
    int64_t numel;
    int64_t offset;                    /* first element of this parameter in
                                          the flat layout of all parameters
                                          (mha_param_numel floats, table
                                          order): where mha_backward writes
                                          its gradient                       */
} mha_param_info;

MHA_API int mha_param_count(const mha_module *module);
/* Elements of all parameters together (the sum of every numel); the size
 * of the gradient buffer of mha_backward.  -1 for a NULL module. */
MHA_API int64_t mha_param_numel(const mha_module *module);
/* Describes parameter `index`, 0 <= index < mha_param_count(). */
MHA_API mha_status mha_param_info_at_sized(const mha_module *module, int index,
                                           mha_param_info *out,
                                           size_t out_size);
static inline mha_status mha_param_info_at(const mha_module *module, int index,
                                           mha_param_info *out)
{
    return mha_param_info_at_sized(module, index, out, sizeof *out);
}
/* Describes the parameter called `name`; MHA_ERR_NOT_FOUND if none. */
MHA_API mha_status mha_param_info_by_name_sized(const mha_module *module,
                                                const char *name,
                                                mha_param_info *out,
                                                size_t out_size);
static inline mha_status mha_param_info_by_name(const mha_module *module,
                                                const char *name,
                                                mha_param_info *out)
{
    return mha_param_info_by_name_sized(module, name, out, sizeof *out);
}
/* Copies parameter `name` (numel floats) into dst.  `numel` must be exact. */
MHA_API mha_status mha_param_get(const mha_module *module, const char *name,
                                 float *dst, int64_t numel);
/*
 * Copies numel floats from src into parameter `name`.  Every value must be
 * finite; on any error the module is left unchanged.
 */
MHA_API mha_status mha_param_set(mha_module *module, const char *name,
                                 const float *src, int64_t numel);

/*
 * Projection by one of the input projections, for analysis and caching:
 * y (rows, out) = x (rows, in) W^T + b, with in = E, kdim or vdim, and
 * out = D for the query and H_kv * d_h for the key and the value (D
 * without grouped-query attention, where H_kv = H); or by the output
 * projection, y (rows, E) = x (rows, D) W_O^T + b_O.  Runs on the OpenMP
 * default number of threads; the same bits for any.
 */
typedef enum mha_projection {
    MHA_PROJ_QUERY = 0,
    MHA_PROJ_KEY = 1,
    MHA_PROJ_VALUE = 2,
    MHA_PROJ_OUT = 3   /* x is the concatenated heads (rows, D) */
} mha_projection;
MHA_API mha_status mha_project(const mha_module *module, mha_projection which,
                               const float *x, int64_t rows, float *y);

/*
 * The backward of mha_project: given dy (rows, out) = dL/dy at the input
 * x (rows, in) of the same projection,
 *     dx (rows, in)  = dy W           (NULL: not computed); dx_accumulate
 *                                      nonzero adds it to dx instead
 *     grad_params    the projection's weight and bias gradients, dy^T x
 *                    and the column sums of dy, at their places in the
 *                    module's gradient layout (mha_param_info.offset;
 *                    mha_param_numel floats, NULL: not computed); only
 *                    those entries are touched, overwritten or, with
 *                    accumulate nonzero, added to.
 * What a caller that runs the attention itself (libmha_mpi's module
 * across ranks) needs around it.  The bias sums are in float64, row
 * order; the same bits for any num_threads (0: OpenMP's default).
 */
MHA_API mha_status mha_project_backward(const mha_module *module,
                                        mha_projection which, const float *x,
                                        int64_t rows, const float *dy,
                                        float *dx, int dx_accumulate,
                                        float *grad_params, int accumulate,
                                        int num_threads);

/* ------------------------------------------------------------------------ */
/* Masks: every mask says what kind it is.                                  */
/* ------------------------------------------------------------------------ */
typedef enum mha_mask_kind {
    MHA_MASK_NONE = 0,     /* no mask; the other fields are ignored         */
    MHA_MASK_ALLOW = 1,    /* uint8 bool, nonzero = may attend (the seeds'
                              `mask == 0 -> blocked`, PyTorch SDPA's bool)  */
    MHA_MASK_BLOCK = 2,    /* uint8 bool, nonzero = blocked (PyTorch
                              nn.MultiheadAttention's bool attn_mask and
                              key_padding_mask)                             */
    MHA_MASK_ADDITIVE = 3  /* float added to the scaled scores; -INFINITY
                              blocks; NaN and +INFINITY are refused         */
} mha_mask_kind;

/*
 * A mask tensor.  As an attention mask, shape is one of
 *     (Lq, Lk)   (B, Lq, Lk)   (B, H, Lq, Lk)
 * and a B or H dimension of 1 broadcasts.  (PyTorch's 3-D attn_mask is
 * (B*H, Lq, Lk); that is the same memory as our (B, H, Lq, Lk).)
 * As a key-padding mask, shape is (Lk) or (B, Lk), B may be 1.
 * Lk always counts the real keys only: bias_k and the zero key appended
 * by add_bias_kv / add_zero_attn are never masked, as in PyTorch.
 */
typedef struct mha_mask {
    mha_mask_kind kind;
    const void *data;   /* const uint8_t * or const float *, contiguous */
    int ndim;
    int64_t shape[4];
} mha_mask;

/* Causal masking, computed from indices: it needs no mask memory. */
typedef enum mha_causal {
    MHA_CAUSAL_NONE = 0,
    /* Query i may attend to key j iff j <= i + (Lk - Lq): the last query
     * sees every key.  This is the alignment of incremental decoding with a
     * KV cache (PyTorch 2's causal_lower_right, FlashAttention >= 2.1).
     * When Lq > Lk the first Lq - Lk queries see no key at all.  */
    MHA_CAUSAL_BOTTOM_RIGHT = 1,
    /* Query i may attend to key j iff j <= i (PyTorch SDPA's is_causal,
     * torch.tril(ones(Lq, Lk))).  Same as BOTTOM_RIGHT when Lq = Lk. */
    MHA_CAUSAL_TOP_LEFT = 2
} mha_causal;

/* What to write into attn_weights. */
typedef enum mha_weights_mode {
    MHA_WEIGHTS_NONE = 0,
    MHA_WEIGHTS_AVERAGE = 1,  /* (B, Lq, Lk_total), mean over heads        */
    MHA_WEIGHTS_PER_HEAD = 2  /* (B, H, Lq, Lk_total)                       */
} mha_weights_mode;

/* A KV cache (below, "Inference"); declared here for mha_forward_args. */
typedef struct mha_kv_cache mha_kv_cache;

/* Element types: of mha_forward's and mha_attention's data (F32, F16,
 * BF16),
 * and of tensors in files (mha_io.h: all of them). */
typedef enum mha_dtype {
    MHA_DTYPE_F32 = 0,
    MHA_DTYPE_F64 = 1,
    MHA_DTYPE_F16 = 2,    /* IEEE binary16 bits in a uint16_t             */
    MHA_DTYPE_BF16 = 3,   /* bfloat16 bits in a uint16_t                  */
    MHA_DTYPE_BOOL = 4,
    MHA_DTYPE_I32 = 5,
    MHA_DTYPE_I64 = 6
} mha_dtype;

/*
 * One forward pass.  Zero-initialise, then fill what you use.
 *
 * A query row that has no key left to attend to (every key masked) gives a
 * zero context vector, so its output row is out_proj.bias, and zero
 * attention weights: never NaN, never an average over padding.  A masked-out
 * key or value is never read into the arithmetic, so NaN or Inf sitting in
 * it cannot leak into the output.
 */
typedef struct mha_forward_args {
    int64_t batch;        /* B >= 1; an unbatched (L, E) input is B = 1    */
    int64_t q_len;        /* Lq >= 1                                       */
    int64_t kv_len;       /* Lk >= 1; 0 -> Lq for self-attention only (key
                             NULL or the query itself): with a key of its
                             own, 0 is refused (its length is the caller's
                             to say)                                      */

    const float *query;   /* (B, Lq, E)                                    */
    const float *key;     /* (B, Lk, kdim); NULL -> query                  */
    const float *value;   /* (B, Lk, vdim); NULL -> key                    */

    mha_mask attn_mask;        /* (Lq,Lk), (B,Lq,Lk) or (B,H,Lq,Lk)        */
    mha_mask key_padding_mask; /* (Lk) or (B, Lk): which keys are real     */
    const int64_t *key_lengths;/* (B): keys j >= key_lengths[b] masked     */
    mha_causal causal;

    mha_weights_mode need_weights;
    float *attn_weights;  /* see mha_weights_mode; Lk_total =
                             mha_total_keys(module, Lk) with the resolved
                             Lk (q_len when kv_len is 0).  These are the
                             probabilities actually applied to V, i.e. after
                             dropout (scaled by 1/(1-p)), as PyTorch returns;
                             must not overlap query, key, value, out or a
                             mask's data                                 */

    int num_threads;      /* threads for the attention and the
                             projections; 0 -> the OpenMP default
                             (OMP_NUM_THREADS).  Results are bitwise the
                             same for every thread count, whatever sets
                             it (OPENBLAS_NUM_THREADS included): each GEMM
                             runs as a fixed grid of blocks on these
                             threads, one single-threaded BLAS call per
                             block.  With OpenBLAS's pthread build libmha
                             sets openblas_set_num_threads(1) (README,
                             "Threads").                                  */

    int training;         /* nonzero: apply dropout (config.dropout)       */
    uint64_t dropout_seed;/* key of the counter-based dropout generator    */

    const float *head_mask;/* experimental.  (H) finite, or NULL (all
                             ones): head h's
                             context is multiplied by head_mask[h] before
                             W_O; 0 removes the head's contribution (head
                             ablation), and a head of mask 0 costs no
                             output-projection work.  All ones gives the
                             same bits as NULL.  The attention weights
                             are not affected.                            */

    float *out;           /* (B, Lq, E); may alias query                   */

    mha_kv_cache *cache;  /* NULL, or incremental self-attention (below;
                             mha_decode is this mode's own entry, and
                             this field stays for one minor version):
                             the Lq new tokens of every sequence are
                             projected, their keys and values appended to
                             the cache, and each new token attends to its
                             sequence's cached keys and the new ones
                             before it (causal, bottom-right per sequence).
                             The masks, key_lengths and attn_weights are
                             for Lk = the longest sequence after the
                             append (rows: the new tokens; columns: key
                             positions; keys past a sequence's length are
                             masked whatever they say); kv_len 0 or that
                             Lk.  key, value and training must be unset;
                             causal NONE or BOTTOM_RIGHT (the same).  A
                             refused call leaves the cache unchanged.  A
                             cached forward has no backward.  A sliding-
                             window cache (mha_kv_cache_config.window W)
                             attends each new token to the W positions
                             up to itself; it takes no masks, key_lengths
                             or weights, and Lq + W - 1 <= its capacity. */
    const int64_t *positions; /* (B, Lq) or NULL: the RoPE position of
                             each query token, and of each key token in
                             self-attention (packed sequences).  NULL:
                             token i is at position i, with a cache at
                             the sequence's length before the step + i. */

    /* A slice of the query rows (q_total > 0; 0: the Lq rows are the whole
     * problem).  The Lq rows given are rows q_start .. q_start + Lq - 1 of
     * a problem of q_total queries against the same keys, and every rule
     * that depends on a query's index reads q_start + i: top-left causal
     * (key j visible iff j <= q_start + i), bottom-right causal, ALiBi's
     * and the window's position (q_start + i + Lk - q_total), RoPE's
     * default position (q_start + i) and the dropout draw.  So slices that
     * cover 0 .. q_total - 1 give the whole problem's rows (up to float
     * rounding: the GEMMs' blocks and the kernels' tiles follow the number
     * of rows) in a fraction of the memory of its weights (`mha viz` draws
     * long sequences so).  The masks, key_lengths, positions, attn_weights and
     * out are the slice's own (Lq rows).  The key must be given (the
     * slice's rows are not its keys; RoPE's key j is at j) with kv_len
     * >= 1; no cache; a sliced forward has no backward.                 */
    int64_t q_start;
    int64_t q_total;

    /* 16-bit data.  dtype F32 (0): query, key, value and out above.  BF16
     * or F16: query16, key16, value16 and out16 instead (the same shapes,
     * each element its 2-byte pattern; NULL key16 -> query16, NULL
     * value16 -> key16; out16 may alias query16), and the float pointers
     * NULL.  The module's parameters are used rounded to that type (as
     * PyTorch's module.to(dtype) rounds them); each projection sums in
     * float32 and rounds its output (q, k, v, the heads' context, out) to
     * the type; the attention is mha_attention's on 16-bit heads.  bf16
     * runs on AMX tiles or AVX512-BF16 where mha_bf16_kernel() says so,
     * f16 and other CPUs widen blocks of rows to float32 (docs/
     * semantics.md, "16-bit modules").  Not yet with a cache, weights,
     * training, head_mask, RoPE, add_bias_kv, add_zero_attn, positions or
     * a slice of the query rows (each refused by name); no backward.    */
    mha_dtype dtype;
    const uint16_t *query16, *key16, *value16;
    uint16_t *out16;
} mha_forward_args;

/* Lk + (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0): the key axis of
 * the attention weights.  Returns -1 for a NULL module or kv_len < 0. */
MHA_API int64_t mha_total_keys(const mha_module *module, int64_t kv_len);

MHA_API mha_status mha_forward_sized(const mha_module *module,
                                     const mha_forward_args *args,
                                     size_t args_size);
static inline mha_status mha_forward(const mha_module *module,
                                     const mha_forward_args *args)
{
    return mha_forward_sized(module, args, sizeof *args);
}


/* How mha_attention's q, k, v and out are laid out in memory. */
typedef enum mha_layout {
    MHA_LAYOUT_ROWS = 0,         /* a row of all heads per token (below) */
    MHA_LAYOUT_HEADS_FIRST = 1   /* (B, heads, L, d_h): each head's rows
                                    together, as PyTorch SDPA's tensors */
} mha_layout;

/*
 * Attention alone, on heads that are already projected (what PyTorch calls
 * scaled_dot_product_attention, with heads side by side in the last
 * dimension as nn.MultiheadAttention keeps them):
 *
 *   out[b, i, h*d_h ..] = softmax(q_h k_g^T * scale + mask) v_g,
 *                         g = h / (H / H_kv)
 *   q (B, Lq, H*d_h), k and v (B, Lk, H_kv*d_h), out (B, Lq, H*d_h)
 *
 * Masks, causal, key lengths, weights ((B, H, Lq, Lk) or (B, Lq, Lk)),
 * dropout and threads behave exactly as in mha_forward.  Zero fields are
 * defaults: scale 0 -> 1/sqrt(d_h), kv_len 0 -> q_len, num_kv_heads 0 ->
 * num_heads.
 */
typedef struct mha_attention_args {
    int64_t batch, num_heads, head_dim, q_len, kv_len;
    const float *q, *k, *v;
    float scale;          /* 0 -> 1/sqrt(d_h) unless MHA_GIVEN_SCALE     */
    mha_mask attn_mask;
    mha_mask key_padding_mask;
    const int64_t *key_lengths;
    mha_causal causal;
    mha_weights_mode need_weights;
    float *attn_weights;  /* must not overlap q, k, v or out              */
    float dropout;        /* p, applied when training is nonzero */
    int training;
    uint64_t dropout_seed;
    int num_threads;
    float *out;           /* must not overlap q, k, v or attn_weights     */
    unsigned given;       /* MHA_GIVEN_SCALE: scale as written, 0 too     */
    int64_t num_kv_heads; /* H_kv, dividing num_heads; 0 -> num_heads.
                             Grouped-query attention (H_kv = 1: multi-
                             query): k and v are (B, Lk, H_kv*d_h), and
                             query head h reads K/V head h / (H / H_kv),
                             as PyTorch SDPA's enable_gqa and Llama.     */
    float *lse;           /* (B, H, Lq) or NULL: each row's log-sum-exp
                             of its scaled, masked scores (natural log;
                             -INFINITY for a row with no key), what
                             mha_attention_merge needs.  Must not overlap
                             another input or output.                    */
    mha_kv_cache *cache;  /* NULL, or decoding on heads (the mode's own
                             entry is mha_attention_decode; this field
                             stays for one minor version): the Lq queries
                             of every sequence attend to its keys in the
                             cache (the caller appended the new tokens'
                             K/V first, mha_kv_cache_append), causally
                             bottom-right per sequence, read in place.
                             Masks, key_lengths and attn_weights are for
                             Lk = the longest sequence in the cache (keys
                             past a sequence's length are masked); kv_len
                             0 or that Lk.  k, v and training must be
                             unset, causal not TOP_LEFT; no backward.
                             With a sliding-window cache the queries are
                             each sequence's last Lq positions, each
                             seeing the W keys up to itself (the ring
                             must still hold them); no masks,
                             key_lengths or weights.                     */
    mha_modifiers mods;   /* score modifiers and RoPE (above).  RoPE
                             rotates q and k (never a cache: it holds
                             keys rotated already) in the workspace.     */
    const float *sinks;   /* (H) finite, or NULL: a learned logit per
                             head in each softmax's denominator (above,
                             mha_config.sinks).  lse then includes it.   */
    const int64_t *q_positions;   /* (B, Lq) or NULL (Lk - Lq + i, with a
                                     cache the sequence's length - Lq + i):
                                     RoPE positions of the queries       */
    const int64_t *k_positions;   /* (B, Lk) or NULL (j): of the keys     */
    int64_t q_offset;     /* with MHA_GIVEN_Q_OFFSET in `given`: query i
                             sits at key position q_offset + i (default:
                             Lk - Lq + i, bottom-right).  Bottom-right
                             causal (key j visible iff j <= q_offset + i),
                             ALiBi's distance and the window are measured
                             from there; TOP_LEFT and RoPE's positions are
                             not affected.  For a part of a split problem
                             whose queries start at position q0 and keys
                             at k0: q_offset = q0 - k0.  Not with a cache. */
    mha_layout layout;    /* MHA_LAYOUT_ROWS (0, above) or
                             MHA_LAYOUT_HEADS_FIRST: q and out (B, H, Lq,
                             d_h), k and v (B, H_kv, Lk, d_h), PyTorch
                             SDPA's layout, read and written in place;
                             the backward reads dL/d out and writes dq,
                             dk, dv in it too.  Not with a cache or
                             RoPE.                                       */
    mha_dtype dtype;      /* of q, k, v and out.  MHA_DTYPE_F32 (0): the
                             float pointers above.  BF16 or F16: q16, k16,
                             v16 and out16 instead (each element the
                             2-byte pattern, same shapes and layouts; q,
                             k, v and out NULL); softmax, row statistics
                             and sums in float32, out rounded to nearest
                             even; lse and attn_weights stay float.  With
                             AMX (bf16; plain, causal and key_lengths;
                             d_h a multiple of 32) the weights are rounded
                             to bf16 before P V (docs/semantics.md);
                             otherwise the inputs are widened to float32
                             and the float32 kernels run.  mha_attention
                             and mha_attention_backward16 only: no plan,
                             cache or merge yet.                         */
    const uint16_t *q16, *k16, *v16;
    uint16_t *out16;
    int64_t attention_chunk;  /* C >= 0; 0: none.  Chunked attention: key
                             j visible from query i only when both sit in
                             the same chunk of C positions (mha_modifiers
                             above; the positions are those of causal
                             masking, q_offset included).  Tiles outside
                             the chunk are never visited.               */
    int64_t v_head_dim;   /* d_v >= 1, the values' (and the output's) head
                             width; 0 -> head_dim.  v is then (B, Lk,
                             H_kv*d_v) and out (B, Lq, H*d_v) (heads
                             first: (B, H_kv, Lk, d_v), (B, H, Lq, d_v)),
                             as PyTorch SDPA's Ev != E (DeepSeek's MLA:
                             keys of 192, values of 128).  float32, no
                             cache yet.                                 */
} mha_attention_args;
MHA_API mha_status mha_attention_sized(const mha_attention_args *args,
                                       size_t args_size);
static inline mha_status mha_attention(const mha_attention_args *args)
{
    return mha_attention_sized(args, sizeof *args);
}
/* Which kernels mha_attention's bf16 calls run on: "amx" (AMX tiles),
 * "avx512bf16" (AVX512-BF16 dot products, the same code without tiles) or
 * "float32" (the inputs widened).  MHA_BF16=amx|avx512bf16|float32 in the
 * environment caps the choice; NULL, with the error set, for another
 * value (every bf16 call is then refused). */
MHA_API const char *mha_bf16_kernel(void);

/*
 * Attention on heads, planned, and its backward (for autograd of scaled
 * dot-product attention).  mha_attention_plan_create checks `shape` (its
 * data pointers may be NULL) and sizes one workspace; _run then computes
 * any arguments of the same batch, num_heads, head_dim, q_len and kv_len
 * without allocating (with a cache: any cache of at most the plan's
 * capacity, kv_len following its lengths), and keeps one (max, 1/sum)
 * pair per row and head and the packed K and V.  _backward
 * differentiates the plan's last run, which must have had the same q, k,
 * v, masks, key_lengths, causal, scale, dropout, training and
 * dropout_seed, over the same contents (a fingerprint taken by the run is
 * checked): dL/dq, dL/dk, dL/dv from dL/d out, all three overwritten,
 * none overlapping an input or another.
 * The first backward allocates its workspace, later ones nothing.
 * Dropout is regenerated from the hash, never stored.  Bitwise identical
 * for every num_threads.  mha_attention is create + run + free, and
 * mha_attention_backward create + run + backward + free.
 */
typedef struct mha_attention_plan mha_attention_plan;
typedef struct mha_attention_grads {
    const float *grad_out;  /* (B, Lq, H*d_h), dL/d out, required */
    float *grad_q;          /* (B, Lq, H*d_h), required           */
    float *grad_k, *grad_v; /* (B, Lk, H_kv*d_h), required: each
                               K/V head's gradient is summed over
                               the query heads that read it      */
    float *grad_sinks;      /* (H) or NULL: dL/d sinks, overwritten
                               (with sinks in the arguments)     */
} mha_attention_grads;
MHA_API mha_status mha_attention_plan_create_sized(
    const mha_attention_args *shape, size_t shape_size,
    mha_attention_plan **out);
static inline mha_status mha_attention_plan_create(
    const mha_attention_args *shape, mha_attention_plan **out)
{
    return mha_attention_plan_create_sized(shape, sizeof *shape, out);
}
MHA_API mha_status mha_attention_plan_run_sized(mha_attention_plan *plan,
                                                const mha_attention_args *args,
                                                size_t args_size);
static inline mha_status mha_attention_plan_run(mha_attention_plan *plan,
                                                const mha_attention_args *args)
{
    return mha_attention_plan_run_sized(plan, args, sizeof *args);
}
MHA_API mha_status mha_attention_plan_backward_sized(
    mha_attention_plan *plan, const mha_attention_args *args, size_t args_size,
    const mha_attention_grads *grads, size_t grads_size);
static inline mha_status mha_attention_plan_backward(
    mha_attention_plan *plan, const mha_attention_args *args,
    const mha_attention_grads *grads)
{
    return mha_attention_plan_backward_sized(plan, args, sizeof *args, grads,
                                             sizeof *grads);
}
MHA_API void mha_attention_plan_free(mha_attention_plan *plan);
MHA_API mha_status mha_attention_backward_sized(
    const mha_attention_args *args, size_t args_size,
    const mha_attention_grads *grads, size_t grads_size);
static inline mha_status mha_attention_backward(
    const mha_attention_args *args, const mha_attention_grads *grads)
{
    return mha_attention_backward_sized(args, sizeof *args, grads,
                                        sizeof *grads);
}

/*
 * The backward of mha_attention on 16-bit data (args.dtype BF16 or F16,
 * args.q16, k16, v16): dL/d out in, dq, dk, dv out, each of the type and
 * the shape and layout (both layouts) of q, k and v.  Plain, causal and
 * key_lengths attention with d_h a multiple of 32 runs on AMX tiles or
 * AVX512-BF16 where mha_bf16_kernel() says so: the forward again (for out and the row
 * statistics), then the flash backward's two sweeps, P and scale dS
 * rounded to bf16 before their products (as the forward rounds P), every
 * sum float32; anything else widens to float32 and runs
 * mha_attention_backward.  No sinks, dropout or weights.  With args.out16
 * and args.lse both set (what mha_attention wrote for these arguments)
 * the AMX path takes them instead of running the forward again, as
 * FlashAttention's backward takes the forward's output and lse; they are
 * only read.
 */
typedef struct mha_attention_grads16 {
    const uint16_t *grad_out;   /* like out                               */
    uint16_t *grad_q;           /* like q                                 */
    uint16_t *grad_k, *grad_v;  /* like k and v, summed over each group   */
} mha_attention_grads16;
MHA_API mha_status mha_attention_backward16_sized(
    const mha_attention_args *args, size_t args_size,
    const mha_attention_grads16 *grads, size_t grads_size);
static inline mha_status mha_attention_backward16(
    const mha_attention_args *args, const mha_attention_grads16 *grads)
{
    return mha_attention_backward16_sized(args, sizeof *args, grads,
                                          sizeof *grads);
}

/*
 * The backward of one part of a split-key problem (the keys cut into parts
 * whose results mha_attention_merge joins: chunks of a long sequence, the
 * blocks of ring attention).  `args` is the part as its forward computed
 * it (q and the part's k, v, masks, causal, modifiers; lse and weights are
 * ignored); `lse` (B, H, Lq) is each row's log-sum-exp over ALL parts and
 * `out` (B, Lq, H*d_h) the output merged over all parts, as
 * mha_attention_merge returns them.  With P = exp(s - lse) on the part's
 * keys and delta = rowsum(dO * out) (float64), writes (overwrites)
 *     grad_q              this part's share of dL/dq: the shares of all
 *                         parts sum to dL/dq
 *     grad_k, grad_v      dL/dk, dL/dv of the part's keys through these
 *                         query rows
 * The gradients of a row with lse -INFINITY are zero.  No sinks, no cache;
 * dropout, as the forward drew it, keyed by the part's own indices.  K and
 * V are packed as a forward packs them, but no forward runs: a part costs
 * the backward's two sweeps alone.  Bitwise the same for every
 * num_threads.
 */
MHA_API mha_status mha_attention_backward_part_sized(
    const mha_attention_args *args, size_t args_size, const float *lse,
    const float *out, const mha_attention_grads *grads, size_t grads_size);
static inline mha_status mha_attention_backward_part(
    const mha_attention_args *args, const float *lse, const float *out,
    const mha_attention_grads *grads)
{
    return mha_attention_backward_part_sized(args, sizeof *args, lse, out,
                                             grads, sizeof *grads);
}

/*
 * The merge of partial attention results: when the keys of a problem are
 * split into parts (chunks of a long sequence, ranks of a ring, a cache and
 * new tokens) and each part's attention is computed apart with its lse,
 * the attention over all keys is, row by row,
 *
 *     lse = log sum_p exp(lse_p),   out = sum_p exp(lse_p - lse) out_p
 *
 * computed here in float64, parts in the given order (so the result is
 * the same bits every time).  Each part: out (B, Lq, H*d_h) and lse
 * (B, H, Lq) as mha_attention writes them.  A row whose every part has no
 * key (lse -INFINITY) gives a zero row and lse -INFINITY; a NaN lse gives
 * NaN.  out (and lse, which may be NULL) may be exactly one of the parts'
 * buffers (merging in place), but not overlap them otherwise.  Dropout
 * inside the parts is kept as it was drawn (keyed by each part's own key
 * indices).
 */
typedef struct mha_attention_part {
    const float *out;    /* (B, Lq, H*d_h) */
    const float *lse;    /* (B, H, Lq)     */
} mha_attention_part;
MHA_API mha_status mha_attention_merge(const mha_attention_part *parts,
                                       int n_parts, int64_t batch,
                                       int64_t num_heads, int64_t head_dim,
                                       int64_t q_len, float *out, float *lse);

/*
 * Planning apart from running.  mha_plan_create checks the shapes, flags
 * and thread count of `shape` (its data pointers may be NULL) and sizes one
 * workspace; mha_plan_forward then runs any arguments of the same batch,
 * q_len and kv_len without allocating (masks, weights mode, inputs and
 * outputs may change between runs; the thread count is the plan's).  A
 * plan made with a cache runs with any cache of at most that capacity,
 * and each run's kv_len, masks and weights follow the cache's lengths.  A
 * plan belongs to one module, which must outlive it, and runs one call at
 * a time.  mha_forward is create + forward + free.
 */
typedef struct mha_plan mha_plan;
MHA_API mha_status mha_plan_create_sized(const mha_module *module,
                                         const mha_forward_args *shape,
                                         size_t shape_size, mha_plan **out);
static inline mha_status mha_plan_create(const mha_module *module,
                                         const mha_forward_args *shape,
                                         mha_plan **out)
{
    return mha_plan_create_sized(module, shape, sizeof *shape, out);
}
MHA_API mha_status mha_plan_forward_sized(mha_plan *plan,
                                          const mha_forward_args *args,
                                          size_t args_size);
static inline mha_status mha_plan_forward(mha_plan *plan,
                                          const mha_forward_args *args)
{
    return mha_plan_forward_sized(plan, args, sizeof *args);
}
MHA_API void mha_plan_free(mha_plan *plan);

/*
 * The backward pass: the gradients of a forward pass, given the gradient
 * of its output (dL/d out, (B, Lq, E)).
 *
 * Every field may be NULL except grad_out; what is NULL is not computed.
 *   grad_query (B, Lq, E), grad_key (B, Lk, kdim), grad_value (B, Lk, vdim)
 *       are always overwritten.  When the forward's key was NULL -- one
 *       tensor serving as query, key and value -- grad_query receives the
 *       sum of the three gradients and grad_key / grad_value must be NULL;
 *       when only its value was NULL (the key is also the value), grad_key
 *       receives both and grad_value must be NULL.  When key == value as
 *       pointers they are still separate inputs with separate gradients.
 *   grad_params (mha_param_numel floats) holds the gradient of every
 *       parameter at mha_param_info.offset, in the layout of the parameter
 *       (PyTorch's names and order).  accumulate = 0 overwrites it,
 *       nonzero adds to it (gradient accumulation over micro-batches).
 *   grad_head_mask (H floats): dL/d head_mask[h] = sum over rows of
 *       dL/d(m_h head_h) . head_h, at the forward's head_mask (all ones
 *       when it had none: the "head importance" of Michel et al. 2019).
 *       Overwritten or accumulated as grad_params is.
 *
 * Dropout is regenerated from (dropout_seed, b, h, i, j): the same keep mask
 * as the forward, never stored.  The attention weights are not
 * differentiated (need_weights is ignored); additive masks are constants.
 * A query row with no key to attend to contributes zero gradients.  A
 * masked key's or value's own gradient rows are zero and its NaN reaches
 * no input gradient, but the weight gradients (dW_k = dk^T key, ...) read
 * every input row, as PyTorch's do: NaN or Inf in a masked key or value
 * row makes dW_k / dW_v non-finite.  Keep padding finite when training.
 * Results are bitwise identical for every num_threads.
 */
typedef struct mha_backward_args {
    const float *grad_out;  /* (B, Lq, E), required                       */
    float *grad_query;      /* (B, Lq, E) or NULL                         */
    float *grad_key;        /* (B, Lk, kdim) or NULL                      */
    float *grad_value;      /* (B, Lk, vdim) or NULL                      */
    float *grad_params;     /* mha_param_numel(module) floats, or NULL    */
    int accumulate;         /* nonzero: grad_params += instead of =       */
    float *grad_head_mask;  /* (H) or NULL; follows accumulate            */

    /* The forward's dtype BF16 or F16 (mha_forward_args.dtype): the data's
     * gradients are 2-byte patterns of that type, in these four fields
     * (grad_out16 required; grad_out, grad_query, grad_key and grad_value
     * NULL), with the same shapes and rules as above.  grad_params stays
     * float32 (the module's parameters are float32): each element's float32
     * sum, unrounded.  docs/semantics.md, "16-bit modules". */
    const uint16_t *grad_out16;
    uint16_t *grad_query16, *grad_key16, *grad_value16;
} mha_backward_args;

/*
 * The forward of `fwd` and its backward in one call (the forward's out and
 * attn_weights are not written; fwd->out may be NULL).  It allocates its
 * workspace; a training loop uses a plan instead.
 */
MHA_API mha_status mha_backward_sized(const mha_module *module,
                                      const mha_forward_args *fwd,
                                      size_t fwd_size,
                                      const mha_backward_args *bwd,
                                      size_t bwd_size);
static inline mha_status mha_backward(const mha_module *module,
                                      const mha_forward_args *fwd,
                                      const mha_backward_args *bwd)
{
    return mha_backward_sized(module, fwd, sizeof *fwd, bwd, sizeof *bwd);
}

/*
 * The backward of the last mha_plan_forward of this plan, which must have
 * been called with the same `fwd` (the same input pointers, masks,
 * head_mask, training and dropout_seed; its out must not alias query, key or value).  The
 * plan keeps what the forward computed (the projections, the context and
 * one (max, 1/sum) pair per row and head: O(L * D), never O(L^2)), so only
 * the backward's own work is done.  The first call allocates the backward
 * workspace, later calls allocate nothing.
 */
MHA_API mha_status mha_plan_backward_sized(mha_plan *plan,
                                           const mha_forward_args *fwd,
                                           size_t fwd_size,
                                           const mha_backward_args *bwd,
                                           size_t bwd_size);
static inline mha_status mha_plan_backward(mha_plan *plan,
                                           const mha_forward_args *fwd,
                                           const mha_backward_args *bwd)
{
    return mha_plan_backward_sized(plan, fwd, sizeof *fwd, bwd, sizeof *bwd);
}

/* ------------------------------------------------------------------------ */
/* Inference: the KV cache                                                  */
/* ------------------------------------------------------------------------ */

/*
 * A KV cache holds, for each of `batch` sequences, the projected keys and
 * values of up to `capacity` tokens, H_kv heads of d_h, in the layout the
 * attention kernels read, so decoding never repacks or copies it.  Give it
 * to mha_forward / mha_plan_forward (args.cache) to prefill a prompt and
 * then generate token by token, or fill it yourself (mha_kv_cache_append)
 * with keys already projected (and rotated).  Sequences have their own
 * lengths.  Every failed call leaves the cache unchanged.  One cache is
 * used by one call at a time.
 */
/*
 * How the cache stores K and V.  Values are rounded once, when appended
 * (round to nearest, ties to even); attention then runs on exactly the
 * stored values, converted back to float in registers by the kernels, so
 * its result is the f32 attention on those values.  docs/semantics.md has
 * the definitions; mha_kv_cache_read returns the stored values.
 */
typedef enum mha_kv_dtype {
    MHA_KV_F32 = 0,    /* float32: 4 bytes an element, exact            */
    MHA_KV_F16 = 1,    /* IEEE half: 2 bytes; a finite |x| >= 65520
                          (past 65504) is refused at append, not Inf */
    MHA_KV_BF16 = 2,   /* bfloat16: 2 bytes, float32's range            */
    MHA_KV_Q8 = 3,     /* 8-bit codes, one float scale per block of 32
                          elements of a key's (value's) d_h: 1.125 bytes
                          an element; amax / 127 steps; a block holding
                          NaN or Inf reads as NaN                        */
    MHA_KV_Q4 = 4      /* 4-bit codes in [-7, 7], one float scale per
                          block of 32 as q8's: 0.625 bytes an element;
                          amax / 7 steps.  d_h must be even.  With
                          outliers in a few channels, give the cache
                          `rotate` (mha_kv_cache_config)               */
} mha_kv_dtype;

/*
 * A sliding-window cache (window W >= 1, Mistral-style models): the query
 * at absolute position P attends to the keys at positions
 * max(0, P - W + 1) .. P, itself included, and the cache is a ring of
 * `capacity` >= W slots per sequence that keeps only the last tokens:
 * position p sits in slot p % capacity, overwriting position
 * p - capacity.  A sequence's length still counts every token it was
 * given (positions 0 .. length - 1), so a window cache decodes for ever
 * in a fixed memory.  A step of n new tokens needs n + W - 1 <= capacity
 * (the ring must hold every key its queries see): a decoder of chunks of
 * C tokens uses capacity W - 1 + C.  Masks, key_lengths and attention
 * weights are refused with a window (MHA_ERR_UNSUPPORTED); kv_len must
 * be 0.  The attention sums the keys in slot order, which after the ring
 * wraps around is not position order: results equal the windowed
 * attention of the whole sequence up to float rounding (bitwise while
 * nothing has wrapped).  docs/semantics.md has the details.
 */
typedef struct mha_kv_cache_config {
    int64_t batch;         /* sequences, >= 1                          */
    int64_t num_kv_heads;  /* H_kv, >= 1                               */
    int64_t head_dim;      /* d_h, >= 1                                */
    int64_t capacity;      /* tokens per sequence, >= 1; with a window,
                              the ring's slots per sequence, >= window */
    mha_kv_dtype dtype;    /* MHA_KV_F32 (0), _F16, _BF16, _Q8 or _Q4  */
    int64_t window;        /* 0: an ordinary cache; W >= 1: a sliding-
                              window cache (above)                      */
    int64_t page_size;     /* 0: contiguous; P: paged (below), a
                              multiple of 64, the kernels' key tile     */
    int64_t num_pages;     /* paged: the pool's pages; 0: batch x
                              ceil(capacity / P), room for every
                              sequence at its capacity                 */
    int rotate;            /* nonzero: keys and values are stored turned
                              by an orthogonal Hadamard rotation of the
                              head dimension (blocks of the largest power
                              of two dividing d_h; d_h even, <= 4096),
                              queries turned alike and outputs turned
                              back: attention unchanged in exact
                              arithmetic, a channel's outlier spread over
                              its block before rounding (q4, q8).
                              mha_kv_cache_read turns values back.     */
    int64_t v_head_dim;    /* d_v: the values' head width, 0 -> head_dim
                              (mha_attention_args.v_head_dim): values
                              appended and read as (n, H_kv*d_v), the
                              attention's output H*d_v wide.  Each value
                              tile takes a key tile's room (the wider
                              of the two).  Not with rotate, nor with a
                              module's cached forward.                 */
    int latent;            /* nonzero: multi-head latent attention's cache
                              (DeepSeek's MLA, absorbed): each token's
                              value is the first v_head_dim <= head_dim
                              elements of its key, stored once (append
                              with v NULL; read gives that prefix).
                              f32, f16 or bf16, contiguous, no window,
                              no rotation.  With one K/V head of 576
                              (a 512 latent and 64 rotary) and values
                              of 512, 128 query heads decode from 1/71
                              of the naive cache's bytes.              */
} mha_kv_cache_config;

/*
 * A paged cache (page_size P): instead of `capacity` tokens reserved for
 * each sequence, a pool of num_pages pages of P positions (every K/V
 * head) and a table of pages per sequence, so memory follows the tokens
 * held.  `batch` is then the number of sequence slots and `capacity` the
 * most tokens one sequence may hold.  A slot is a sequence while it holds
 * tokens: append to an empty one to add a sequence, reset it to free its
 * pages.  mha_kv_cache_fork gives a slot another's tokens by sharing its
 * pages; a shared page is copied when one of its holders appends into it
 * (copy on write).  An append that needs more pages than are free is
 * refused, MHA_ERR_OUT_OF_MEMORY naming the pool, nothing appended.
 * Attention reads a paged cache exactly as a contiguous one, with the
 * same bits.  With a window, `capacity` (the ring) must be whole pages;
 * a page whose positions all fell out of the window (older than the
 * length - W) is given back at the sequence's next append, so a sequence
 * holds about W + P positions, and a rollback reaches only positions its
 * pages still hold (refused past them, naming the oldest).
 */

MHA_API mha_status mha_kv_cache_create_sized(const mha_kv_cache_config *config,
                                             size_t config_size,
                                             mha_kv_cache **out);
static inline mha_status mha_kv_cache_create(const mha_kv_cache_config *config,
                                             mha_kv_cache **out)
{
    return mha_kv_cache_create_sized(config, sizeof *config, out);
}
/* A cache shaped for `module` (its H_kv and d_h), f32, no window.  For
 * another dtype or a window, mha_kv_cache_create with the module's
 * num_kv_heads and head_dim (mha_get_config).  Refused for a module
 * whose kdim or vdim differ from E (a cache is for self-attention); on
 * any failure *out is NULL, as with mha_kv_cache_create. */
MHA_API mha_status mha_kv_cache_for_module(const mha_module *module,
                                           int64_t batch, int64_t capacity,
                                           mha_kv_cache **out);
/* Frees the cache.  NULL is accepted and ignored. */
MHA_API void mha_kv_cache_free(mha_kv_cache *cache);
/* Tokens held by sequence `seq`; -1 for a NULL cache or a bad seq.  With
 * a window: every token appended since the last reset (a ring holds the
 * last min(length, capacity) of them). */
MHA_API int64_t mha_kv_cache_length(const mha_kv_cache *cache, int64_t seq);
/* Appends n tokens to sequence seq: k and v (n, H_kv * d_h), projected
 * (and rotated).  Past the capacity: refused, nothing appended.  With a
 * window, any n <= capacity: the oldest positions are overwritten. */
MHA_API mha_status mha_kv_cache_append(mha_kv_cache *cache, int64_t seq,
                                       const float *k, const float *v,
                                       int64_t n);
/* Keeps the first `length` tokens of sequence seq (0 <= length <= its
 * length): the rollback after rejected speculative tokens.  With a
 * window W, only while the ring still holds positions max(0, length - W)
 * .. length - 1 (what the last kept token attends to); else refused, naming
 * the oldest position held. */
MHA_API mha_status mha_kv_cache_truncate(mha_kv_cache *cache, int64_t seq,
                                         int64_t length);
/* Empties sequence seq (-1: every sequence); a paged cache's pages go
 * back to the pool once no sequence holds them. */
MHA_API mha_status mha_kv_cache_reset(mha_kv_cache *cache, int64_t seq);
/* Sequence dst becomes a copy of sequence src (what dst held is dropped
 * first): its length and every stored token.  A paged cache shares src's
 * pages (no copy, no new page: parallel sampling, beam search, a common
 * prompt); a contiguous one copies the tokens.  dst == src is refused. */
MHA_API mha_status mha_kv_cache_fork(mha_kv_cache *cache, int64_t src,
                                     int64_t dst);
/* What a cache holds and takes (mha_kv_cache_usage). */
typedef struct mha_kv_cache_usage {
    int64_t tokens;        /* tokens held, summed over the sequences (a
                              shared token once per sequence)          */
    int64_t token_bytes;   /* what those tokens' keys and values take at
                              the cache's dtype, nothing else          */
    int64_t bytes;         /* the key/value storage held: the pages in
                              use (a shared page once), or all of a
                              contiguous cache                         */
    int64_t bytes_total;   /* the key/value storage allocated          */
    int64_t page_size;     /* 0 for a contiguous cache, as below       */
    int64_t pages_used;    /* pages at least one sequence holds        */
    int64_t pages_free;
} mha_kv_cache_usage;
MHA_API mha_status mha_kv_cache_get_usage_sized(const mha_kv_cache *cache,
                                                mha_kv_cache_usage *out,
                                                size_t out_size);
static inline mha_status mha_kv_cache_get_usage(const mha_kv_cache *cache,
                                                mha_kv_cache_usage *out)
{
    return mha_kv_cache_get_usage_sized(cache, out, sizeof *out);
}
/* Copies tokens start .. start+n-1 of sequence seq, as the attention reads
 * them (the stored values, converted to float), into k and v (n, H_kv *
 * d_h); either may be NULL.  With a window, positions the ring no longer
 * holds are refused. */
MHA_API mha_status mha_kv_cache_read(const mha_kv_cache *cache, int64_t seq,
                                     int64_t start, int64_t n, float *k,
                                     float *v);

/*
 * Decoding: the entry points of the KV-cache mode.  Each new token of a
 * sequence attends to that sequence's cached keys and to the new ones up
 * to itself (causal, bottom-right per sequence: there is no other choice,
 * so no causal field); the K/V heads are the cache's, and the batch
 * must be (a mismatch is refused: the buffers are sized by it).  The
 * struct holds only what this mode reads (no key, value, dropout or
 * slices): mha_forward / mha_attention with .cache set do the same work
 * and stay for one minor version.  Masks, key_lengths and weights are for
 * Lk = the longest sequence after the step (docs/semantics.md).
 *
 * Module: mha_decode projects the q_len new tokens of every sequence,
 * appends their K/V to the cache, and writes out (B, q_len, E).
 */
typedef struct mha_decode_args {
    int64_t batch;              /* B: the cache's sequences, said again
                                   (the buffers below are sized by it)   */
    int64_t q_len;              /* new tokens per sequence, >= 1         */
    const float *query;         /* (B, q_len, E)                         */
    float *out;                 /* (B, q_len, E); may alias query        */
    mha_kv_cache *cache;        /* required                              */
    mha_mask attn_mask;         /* (q_len, Lk), (B, ..) or (B, H, ..)    */
    mha_mask key_padding_mask;  /* (Lk) or (B, Lk)                       */
    const int64_t *key_lengths; /* (B) or NULL                           */
    mha_weights_mode need_weights;
    float *attn_weights;        /* given iff need_weights is not NONE    */
    const int64_t *positions;   /* (B, q_len) RoPE positions of the new
                                   tokens (left-padded prompts), or NULL:
                                   the sequence's length + i            */
    const float *head_mask;     /* experimental, as in mha_forward_args  */
    int num_threads;            /* 0 -> the OpenMP default               */
} mha_decode_args;
MHA_API mha_status mha_decode_sized(const mha_module *module,
                                    const mha_decode_args *args,
                                    size_t args_size);
static inline mha_status mha_decode(const mha_module *module,
                                    const mha_decode_args *args)
{
    return mha_decode_sized(module, args, sizeof *args);
}
/* Planned: the plan sized once for caches of at most shape->cache's
 * capacity and this q_len; each mha_plan_decode allocates nothing. */
MHA_API mha_status mha_plan_create_decode_sized(const mha_module *module,
                                                const mha_decode_args *shape,
                                                size_t shape_size,
                                                mha_plan **out);
static inline mha_status mha_plan_create_decode(const mha_module *module,
                                                const mha_decode_args *shape,
                                                mha_plan **out)
{
    return mha_plan_create_decode_sized(module, shape, sizeof *shape, out);
}
MHA_API mha_status mha_plan_decode_sized(mha_plan *plan,
                                         const mha_decode_args *args,
                                         size_t args_size);
static inline mha_status mha_plan_decode(mha_plan *plan,
                                         const mha_decode_args *args)
{
    return mha_plan_decode_sized(plan, args, sizeof *args);
}

/* Heads: the q_len queries of every sequence (already projected and, for
 * RoPE, rotated here at q_positions) attend to its keys in the cache,
 * which the caller appended first (mha_kv_cache_append). */
typedef struct mha_attention_decode_args {
    int64_t batch;              /* B: the cache's sequences, said again  */
    int64_t num_heads, head_dim, q_len;
    const float *q;             /* (B, q_len, H*d_h)                     */
    float *out;                 /* (B, q_len, H*d_h)                     */
    mha_kv_cache *cache;        /* required; H_kv is its                 */
    float scale;                /* 0 -> 1/sqrt(d_h) unless MHA_GIVEN_SCALE */
    unsigned given;
    mha_mask attn_mask;
    mha_mask key_padding_mask;
    const int64_t *key_lengths;
    mha_weights_mode need_weights;
    float *attn_weights;
    float *lse;                 /* (B, H, q_len) or NULL                 */
    mha_modifiers mods;         /* RoPE rotates q only: the cache holds
                                   rotated keys                         */
    const float *sinks;         /* (H) or NULL                           */
    const int64_t *q_positions; /* (B, q_len) or NULL                    */
    int num_threads;
    /* dtype BF16 or F16: q and out are 16-bit, in q16 and out16 (q and out
     * NULL), against a cache of any storage type; the queries are widened
     * and the context rounded, the keys and values read where they are.
     * Plans take float32 only. */
    mha_dtype dtype;
    const uint16_t *q16;
    uint16_t *out16;
    /* Ragged (continuous batching): q_start (B + 1) offsets, FlashAttention's
     * cu_seqlens: sequence b's queries are rows q_start[b] .. q_start[b+1]-1
     * of q and out, (q_start[B], H*d_h) each, so prefill chunks and single
     * decode tokens mix in one call; q_len must be 0.  Each sequence's
     * q_start[b+1] - q_start[b] >= 0 new tokens were appended first, as
     * for any step; its rows get the bits of a call on that sequence alone.
     * lse (H q_start[B] floats) holds sequence b's (H, n_b) block at lse
     * + H q_start[b]; q_positions is (q_start[B]).  Masks, key_lengths,
     * weights and plans are refused with it (MHA_ERR_UNSUPPORTED). */
    const int64_t *q_start;
    /* With q_start on a paged cache, nonzero: sequences whose page tables
     * begin with the same pages (forks of one prompt) attend to those
     * pages once for all of their queries, and each to the rest of its
     * own; the two parts are merged as mha_attention_merge does (cascade
     * attention).  The rows then equal the separate calls' up to float
     * rounding, not bit for bit; still the same bits for every thread
     * count.  Not with ALiBi, the window modifier or sinks (refused). */
    int share_prefix;
    /* Chunked attention (mha_attention_args.attention_chunk), positions
     * being those in each sequence.  A layer that only ever chunks needs
     * no more than a sliding-window cache of W = C. */
    int64_t attention_chunk;
} mha_attention_decode_args;
MHA_API mha_status mha_attention_decode_sized(
    const mha_attention_decode_args *args, size_t args_size);
static inline mha_status mha_attention_decode(
    const mha_attention_decode_args *args)
{
    return mha_attention_decode_sized(args, sizeof *args);
}
MHA_API mha_status mha_attention_plan_create_decode_sized(
    const mha_attention_decode_args *shape, size_t shape_size,
    mha_attention_plan **out);
static inline mha_status mha_attention_plan_create_decode(
    const mha_attention_decode_args *shape, mha_attention_plan **out)
{
    return mha_attention_plan_create_decode_sized(shape, sizeof *shape, out);
}
MHA_API mha_status mha_attention_plan_decode_sized(
    mha_attention_plan *plan, const mha_attention_decode_args *args,
    size_t args_size);
static inline mha_status mha_attention_plan_decode(
    mha_attention_plan *plan, const mha_attention_decode_args *args)
{
    return mha_attention_plan_decode_sized(plan, args, sizeof *args);
}

/* ------------------------------------------------------------------------ */
/* Experimental: declared only with MHA_EXPERIMENTAL defined (see the top). */
/* ------------------------------------------------------------------------ */
#if defined(MHA_EXPERIMENTAL) || defined(MHA_BUILDING)

/*
 * Head pruning: a new module with the n_keep heads keep[0..n_keep) of
 * `module`, in that order (distinct, each in [0, H)): the rows of W_q, W_k,
 * W_v, of in_proj_bias and of bias_k / bias_v that the head owns, and the
 * columns of out_proj.weight; out_proj.bias, E, kdim, vdim, d_h, the scale
 * and the flags unchanged.  Its inner width is D' = n_keep * d_h, so every
 * projection and the attention cost n_keep / H of the original's, and its
 * forward equals the original's with head_mask[h] = 1 for a kept head and
 * 0 for the others (up to float rounding: the sums run over fewer terms).
 * Removing every head is refused (the output would be out_proj.bias).
 */
MHA_API mha_status mha_prune_heads(const mha_module *module,
                                   const int64_t *keep, int64_t n_keep,
                                   mha_module **out);

/*
 * The module's parameter memory: mha_param_numel(module) floats, each
 * parameter at its mha_param_info.offset in the layout of its shape, read
 * by every forward and backward as they are then (nothing is derived from
 * them and kept).  Writing through it changes the parameters without
 * mha_param_set's checks (finiteness); valid until mha_free.  For bindings
 * that expose the parameters without copies (the Python package's
 * nn.Parameters are views of it).  NULL for a NULL module.
 */
MHA_API float *mha_param_data(mha_module *module);

/*
 * The attention kernels in use: "avx512" (AVX-512F, chosen when the CPU and
 * OS support it), "avx2" (AVX2 + FMA, the same otherwise), "scalar"
 * (portable C) or "ref" (float64 row loop).  The environment variable
 * MHA_ISA=ref|scalar|avx2|avx512, read once, forces a tier.
 * NULL if MHA_ISA names an unknown or unsupported tier (then every forward
 * fails with a message saying so).
 */
MHA_API const char *mha_kernel_tier(void);

/*
 * The GEMM backend of the projections: "onednn" (oneDNN's dnnl_sgemm, the
 * default in a build that found oneDNN, on a CPU with AVX-512) or "cblas"
 * (the CBLAS the build linked, OpenBLAS by default; the default
 * otherwise).  The environment variable
 * MHA_GEMM=cblas|onednn, read once, forces one.  Results are bitwise the
 * same for every thread count with either; the two backends' bits differ.
 * NULL, with mha_last_error() saying why, if MHA_GEMM names an unknown
 * backend or oneDNN in a build without it (then every forward and
 * projection fails with that message).
 */
MHA_API const char *mha_gemm_backend(void);

/*
 * The dropout generator, exposed so a caller can reproduce the mask:
 * returns 1 if the attention probability at (batch b, head h, query row i,
 * key column j) is kept for `seed` and probability p, 0 if it is dropped.
 * It is a pure function of its arguments (a counter-based hash), so the
 * mask does not depend on the thread count or the order of work.
 */
MHA_API int mha_dropout_keep(uint64_t seed, float p, int64_t b, int64_t h,
                             int64_t i, int64_t j);

#endif /* MHA_EXPERIMENTAL */

#ifdef __cplusplus
}
#endif

#endif /* MHA_H */
