/*
 * mha.h -- the core public header of libmha, multi-head attention in C.
 *
 *     MultiHead(Q, K, V) = Concat(m_1 head_1, ..., m_H head_H) W_O^T + b_O
 *     head_h             = softmax(Q_h K_h^T * scale + mask) V_h
 *     Q_h, K_h, V_h      = the h-th d_h-wide column block of
 *                          query W_q^T + b_q, key W_k^T + b_k, value W_v^T + b_v
 *     m_h                = the head mask (1 unless one is given)
 *
 * Conventions:
 *   - Row-major, batch first.  Shapes are written (dim0, dim1, ...).
 *   - E = embed_dim, H = num_heads, d_h = head_dim (E / H unless set),
 *     D = H * d_h the inner width (= E except in pruned modules),
 *     H_kv = num_kv_heads, kdim/vdim = key/value widths, Lq/Lk = query/key
 *     lengths.
 *   - Parameters have the names and layouts of PyTorch's
 *     nn.MultiheadAttention; a linear layer is y = x W^T + b, W [out, in].
 *   - Zero in a struct field means its default.
 *   - Every call that can fail returns an mha_status; mha_last_error()
 *     says what was wrong (queries return a value, frees nothing:
 *     docs/semantics.md#errors).  The library never prints, exits or aborts.
 *   - The full rules are in docs/semantics.md; each comment names its
 *     section there as docs/semantics.md#<section anchor>.
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
 * API layers (docs/semantics.md#api-layers-and-versions):
 *   stable        all of this header and mha_io.h not marked experimental;
 *                 a call being replaced is MHA_DEPRECATED for one minor
 *                 version first.
 *   experimental  declared only when MHA_EXPERIMENTAL is defined before
 *                 the include; may change in any minor version.
 *
 * The ABI rule (docs/semantics.md#the-abi-structs-travel-with-their-size):
 * each call that takes or fills a struct is an inline wrapper passing
 * sizeof the struct to an exported NAME_sized call.  Structs only grow, at
 * their end, and zero is every field's default, so programs built against
 * older or newer headers run; a set field this library does not know is
 * refused.  Structs embedded in others or passed in arrays are frozen.
 * libmha_mpi (mha_mpi.h) follows the same rule; its soname is its own ABI
 * version, MHA_MPI_ABI_VERSION (libmha_mpi.so.1).
 */

/* This header's version; MHA_ABI_VERSION is the soname's (libmha.so.1). */
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
/* Nonzero when the linked library keeps this header's ABI. */
#define MHA_ABI_OK() (mha_abi_version() == MHA_ABI_VERSION)

/* Marks a call due to be replaced; the compiler warns where it is used. */
#if defined(__GNUC__) || defined(__clang__)
#define MHA_DEPRECATED(msg) __attribute__((deprecated(msg)))
#else
#define MHA_DEPRECATED(msg)
#endif

/* ------------------------------------------------------------------------ */
/* Status codes.  The values are pinned: they are never renumbered.         */
/* (docs/semantics.md#errors)                                               */
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

/* The message of this thread's last failed call; read it right after the
 * failure (docs/semantics.md#errors). */
MHA_API const char *mha_last_error(void);

/* For libraries layered on libmha: sets this thread's message and returns
 * status (docs/semantics.md#errors). */
MHA_API mha_status mha_error_set(mha_status status, const char *message);

/* ------------------------------------------------------------------------ */
/* Positions and score modifiers                                            */
/* (docs/semantics.md#score-modifiers-and-positions)                        */
/* ------------------------------------------------------------------------ */

/* Rotary embeddings' pairing: NEOX pairs element k with k + dims/2 (Llama's
 * rotate_half), GPTJ 2k with 2k + 1 (interleaved). */
typedef enum mha_rope_style {
    MHA_ROPE_NONE = 0,
    MHA_ROPE_NEOX = 1,
    MHA_ROPE_GPTJ = 2
} mha_rope_style;

/* Rotary position embeddings (RoPE) of Q and K, after the projections
 * (docs/semantics.md#rotary-position-embeddings-rope). */
typedef struct mha_rope {
    mha_rope_style style;  /* NONE: no rotation; the other fields 0       */
    int64_t dims;          /* rotated elements per head, even; 0 -> d_h    */
    float theta;           /* frequency base, > 1; 0 -> 10000              */
    float scale;           /* positions are divided by it, > 0; 0 -> 1     */
} mha_rope;

/* What changes the scores; zero is "none" in every field
 * (docs/semantics.md#softcap-alibi-the-window-chunks-and-sinks). */
typedef struct mha_modifiers {
    float softcap;              /* c: s <- c tanh(s / c); 0: none         */
    int alibi;                  /* nonzero: ALiBi's distance penalty      */
    const float *alibi_slopes;  /* (H), or NULL: mha_alibi_slopes's       */
    int window;                 /* nonzero: the window below applies      */
    int64_t window_left;        /* positions seen before the query's,
                                   >= -1 (-1: no bound)                   */
    int64_t window_right;       /* positions seen after it, >= -1         */
    mha_rope rope;              /* rotary embeddings of Q and K           */
} mha_modifiers;

/* The default ALiBi slopes of H heads (Press et al. 2022) into slopes[H]
 * (docs/semantics.md#softcap-alibi-the-window-chunks-and-sinks). */
MHA_API mha_status mha_alibi_slopes(int64_t num_heads, float *slopes);

/* The largest RoPE position, 2^53; larger or negative ones are refused. */
#define MHA_ROPE_MAX_POSITION (INT64_C(1) << 53)

/* Rotates x in place: `rows` rows, ld apart, of `heads` heads of head_dim
 * floats, row r at positions[r] (NULL: pos0 + r)
 * (docs/semantics.md#rotary-position-embeddings-rope). */
MHA_API mha_status mha_rope_apply(const mha_rope *rope, int64_t rows,
                                  int64_t heads, int64_t head_dim,
                                  const int64_t *positions, int64_t pos0,
                                  float *x, int64_t ld);
/* The inverse rotation, the same arguments: turns a gradient back. */
MHA_API mha_status mha_rope_apply_inverse(const mha_rope *rope, int64_t rows,
                                          int64_t heads, int64_t head_dim,
                                          const int64_t *positions,
                                          int64_t pos0, float *x, int64_t ld);

/* ------------------------------------------------------------------------ */
/* The module                                                               */
/* ------------------------------------------------------------------------ */

/* Bits of a struct's `given`: the field means exactly what it holds, 0
 * included (docs/semantics.md#zero-that-means-zero). */
#define MHA_GIVEN_SCALE   (1u << 0)  /* scale as written, 0 included       */
#define MHA_GIVEN_DROPOUT (1u << 1)  /* dropout as written: 0 overrides
                                        a file's p                        */
#define MHA_GIVEN_Q_OFFSET (1u << 2) /* mha_attention_args.q_offset as
                                        written, 0 included               */

/* A module's configuration; `mha_config c = {0};` plus E and H is complete
 * (docs/semantics.md#mha_config). */
typedef struct mha_config {
    int64_t embed_dim;  /* E, required, > 0                                 */
    int64_t num_heads;  /* H, required, > 0; divides E unless head_dim set  */
    int64_t kdim;       /* width of key inputs;   0 -> E                    */
    int64_t vdim;       /* width of value inputs; 0 -> E                    */
    int no_bias;        /* nonzero: no in_proj_bias and no out_proj.bias    */
    int add_bias_kv;    /* nonzero: a learned extra key/value (bias_k/v)    */
    int add_zero_attn;  /* nonzero: an all-zero key/value appended last     */
    float dropout;      /* p in [0, 1] on the probabilities, training only  */
    float scale;        /* softmax scale; 0 -> 1/sqrt(d_h) (MHA_GIVEN_SCALE) */
    uint64_t seed;      /* seed of the initialisation at create             */
    int64_t head_dim;   /* experimental.  d_h; 0 -> E / H                   */
    unsigned given;     /* MHA_GIVEN_SCALE, MHA_GIVEN_DROPOUT (above)        */
    int64_t num_kv_heads;  /* H_kv, dividing H; 0 -> H (grouped-query)     */
    mha_modifiers mods; /* RoPE, ALiBi, window, softcap; slopes copied     */
    int sinks;          /* nonzero: a learned logit per head (gpt-oss)    */
    int64_t attention_chunk;  /* C: a query sees only its chunk; 0: none */
    int64_t v_head_dim; /* d_v, the values' head width; 0 -> head_dim
                           (MLA: keys 192, values 128)                   */
} mha_config;

/* Opaque handle.  Forwards may share it across threads; changing its
 * parameters must not overlap one (docs/semantics.md#mha_create). */
typedef struct mha_module mha_module;

/* Validates config, creates the module and initialises its parameters from
 * config->seed; *out is NULL on failure (docs/semantics.md#mha_create). */
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

/* Parameters have PyTorch's state_dict names, shapes and order
 * (docs/semantics.md#shapes-and-parameters); the calls that describe and
 * copy them: docs/semantics.md#mha_param_info. */
#define MHA_MAX_PARAM_NDIM 3
typedef struct mha_param_info {
    const char *name;                  /* static string, e.g. "in_proj_bias" */
    int ndim;
    int64_t shape[MHA_MAX_PARAM_NDIM];
    int64_t numel;
    int64_t offset;                    /* its first element in the flat
                                          layout of all parameters          */
} mha_param_info;

/* The number of parameters. */
MHA_API int mha_param_count(const mha_module *module);
/* Elements of all parameters: the gradient buffer's size; -1 for NULL. */
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
/* Copies numel finite floats from src into parameter `name`. */
MHA_API mha_status mha_param_set(mha_module *module, const char *name,
                                 const float *src, int64_t numel);

/* One of the module's projections alone, y = x W^T + b, for analysis and
 * caching (docs/semantics.md#mha_project). */
typedef enum mha_projection {
    MHA_PROJ_QUERY = 0,
    MHA_PROJ_KEY = 1,
    MHA_PROJ_VALUE = 2,
    MHA_PROJ_OUT = 3   /* x is the concatenated heads (rows, D) */
} mha_projection;
MHA_API mha_status mha_project(const mha_module *module, mha_projection which,
                               const float *x, int64_t rows, float *y);

/* The backward of mha_project: dx = dy W and the projection's parameter
 * gradients (docs/semantics.md#mha_project). */
MHA_API mha_status mha_project_backward(const mha_module *module,
                                        mha_projection which, const float *x,
                                        int64_t rows, const float *dy,
                                        float *dx, int dx_accumulate,
                                        float *grad_params, int accumulate,
                                        int num_threads);

/* ------------------------------------------------------------------------ */
/* Masks: every mask says what kind it is.  (docs/semantics.md#masks)       */
/* ------------------------------------------------------------------------ */
typedef enum mha_mask_kind {
    MHA_MASK_NONE = 0,     /* no mask; the other fields are ignored         */
    MHA_MASK_ALLOW = 1,    /* uint8, nonzero = may attend (SDPA's bool)     */
    MHA_MASK_BLOCK = 2,    /* uint8, nonzero = blocked (MHA's bool masks)   */
    MHA_MASK_ADDITIVE = 3  /* float added to the scaled scores; -INFINITY
                              blocks                                        */
} mha_mask_kind;

/* A mask: attention (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk); key padding
 * (Lk) or (B, Lk).  A dimension of 1 broadcasts. */
typedef struct mha_mask {
    mha_mask_kind kind;
    const void *data;   /* const uint8_t * or const float *, contiguous */
    int ndim;
    int64_t shape[4];
} mha_mask;

/* Causal masking, computed from indices: it needs no mask memory. */
typedef enum mha_causal {
    MHA_CAUSAL_NONE = 0,
    /* Key j visible from query i iff j <= i + (Lk - Lq): the last query sees
     * every key (decoding with a KV cache). */
    MHA_CAUSAL_BOTTOM_RIGHT = 1,
    /* Key j visible from query i iff j <= i (PyTorch SDPA's is_causal). */
    MHA_CAUSAL_TOP_LEFT = 2
} mha_causal;

/* What to write into attn_weights (docs/semantics.md#attention-weights). */
typedef enum mha_weights_mode {
    MHA_WEIGHTS_NONE = 0,
    MHA_WEIGHTS_AVERAGE = 1,  /* (B, Lq, Lk_total), mean over heads        */
    MHA_WEIGHTS_PER_HEAD = 2  /* (B, H, Lq, Lk_total)                       */
} mha_weights_mode;

/* A KV cache (below, "Inference"); declared here for mha_forward_args. */
typedef struct mha_kv_cache mha_kv_cache;

/* Element types: of the data of mha_forward and mha_attention (F32, F16,
 * BF16) and of tensors in files (all) (docs/semantics.md#mha_dtype). */
typedef enum mha_dtype {
    MHA_DTYPE_F32 = 0,
    MHA_DTYPE_F64 = 1,
    MHA_DTYPE_F16 = 2,    /* IEEE binary16 bits in a uint16_t             */
    MHA_DTYPE_BF16 = 3,   /* bfloat16 bits in a uint16_t                  */
    MHA_DTYPE_BOOL = 4,
    MHA_DTYPE_I32 = 5,
    MHA_DTYPE_I64 = 6
} mha_dtype;

/* One forward pass; zero-initialise, then fill what you use
 * (docs/semantics.md#mha_forward_args). */
typedef struct mha_forward_args {
    int64_t batch;        /* B >= 1                                        */
    int64_t q_len;        /* Lq >= 1                                       */
    int64_t kv_len;       /* Lk >= 1; 0 -> Lq, in self-attention only      */

    const float *query;   /* (B, Lq, E)                                    */
    const float *key;     /* (B, Lk, kdim); NULL -> query                  */
    const float *value;   /* (B, Lk, vdim); NULL -> key                    */

    mha_mask attn_mask;        /* (Lq,Lk), (B,Lq,Lk) or (B,H,Lq,Lk)        */
    mha_mask key_padding_mask; /* (Lk) or (B, Lk): which keys are real     */
    const int64_t *key_lengths;/* (B): keys j >= key_lengths[b] masked     */
    mha_causal causal;

    mha_weights_mode need_weights;
    float *attn_weights;  /* the probabilities applied to V, after dropout;
                             Lk_total = mha_total_keys(module, Lk)       */

    int num_threads;      /* 0 -> the OpenMP default; same bits for any    */

    int training;         /* nonzero: apply dropout (config.dropout)       */
    uint64_t dropout_seed;/* key of the counter-based dropout generator    */

    const float *head_mask;/* experimental.  (H) factors of the heads'
                             contexts, or NULL (all ones)                 */

    float *out;           /* (B, Lq, E); may alias query                   */

    mha_kv_cache *cache;  /* NULL, or decoding as mha_decode does (this
                             field stays for one minor version)          */
    const int64_t *positions; /* (B, Lq) RoPE positions, or NULL          */

    /* A slice: rows q_start .. q_start + Lq - 1 of q_total query rows
     * (q_total 0: the Lq rows are the whole problem). */
    int64_t q_start;
    int64_t q_total;

    /* F32 (0): the float pointers above.  BF16 or F16: these instead. */
    mha_dtype dtype;
    const uint16_t *query16, *key16, *value16;
    uint16_t *out16;
} mha_forward_args;

/* Lk + (add_bias_kv ? 1 : 0) + (add_zero_attn ? 1 : 0): the key axis of
 * the attention weights.  Returns -1 for a NULL module or kv_len < 0. */
MHA_API int64_t mha_total_keys(const mha_module *module, int64_t kv_len);

/* Runs one forward pass (docs/semantics.md#mha_forward_args). */
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

/* Attention alone on projected heads, PyTorch's SDPA: q (B, Lq, H*d_h), k
 * and v (B, Lk, H_kv*d_h) (docs/semantics.md#mha_attention_args). */
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
    int64_t num_kv_heads; /* H_kv, dividing num_heads; 0 -> num_heads     */
    float *lse;           /* (B, H, Lq) or NULL: each row's log-sum-exp   */
    mha_kv_cache *cache;  /* NULL, or decoding as mha_attention_decode
                             does (stays for one minor version)          */
    mha_modifiers mods;   /* score modifiers and RoPE (above)             */
    const float *sinks;   /* (H) or NULL: a learned logit per head        */
    const int64_t *q_positions;   /* (B, Lq) or NULL: RoPE positions of
                                     the queries                         */
    const int64_t *k_positions;   /* (B, Lk) or NULL (j): of the keys     */
    int64_t q_offset;     /* query i at key position q_offset + i, with
                             MHA_GIVEN_Q_OFFSET                          */
    mha_layout layout;    /* MHA_LAYOUT_ROWS (0) or _HEADS_FIRST          */
    mha_dtype dtype;      /* F32 (0): q, k, v, out.  BF16 or F16: the
                             16-bit pointers below instead               */
    const uint16_t *q16, *k16, *v16;
    uint16_t *out16;
    int64_t attention_chunk;  /* C: a query sees only its chunk; 0: none */
    int64_t v_head_dim;   /* d_v, the values' head width; 0 -> head_dim   */
} mha_attention_args;
MHA_API mha_status mha_attention_sized(const mha_attention_args *args,
                                       size_t args_size);
static inline mha_status mha_attention(const mha_attention_args *args)
{
    return mha_attention_sized(args, sizeof *args);
}
/* The kernels of bf16 attention: "amx", "avx512bf16" (x86), "bfdot"
 * (aarch64) or "float32"; NULL for a bad MHA_BF16
 * (docs/semantics.md#bf16-and-f16-attention-on-16-bit-data). */
MHA_API const char *mha_bf16_kernel(void);

/* Attention on heads, planned (no allocation per run), and its backward
 * (docs/semantics.md#attention-on-heads-mha_attention-and-its-backward). */
typedef struct mha_attention_plan mha_attention_plan;
typedef struct mha_attention_grads {
    const float *grad_out;  /* (B, Lq, H*d_h), dL/d out, required */
    float *grad_q;          /* (B, Lq, H*d_h), required           */
    float *grad_k, *grad_v; /* (B, Lk, H_kv*d_h), required        */
    float *grad_sinks;      /* (H) or NULL: dL/d sinks            */
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

/* The backward of mha_attention on 16-bit data: dq, dk, dv of the data's
 * type, shape and layout
 * (docs/semantics.md#bf16-and-f16-attention-on-16-bit-data). */
typedef struct mha_attention_grads16 {
    const uint16_t *grad_out;   /* like out                               */
    uint16_t *grad_q;           /* like q                                 */
    uint16_t *grad_k, *grad_v;  /* like k and v, summed over each group   */
    float *grad_sinks;          /* (H) or NULL: dL/d sinks, float32       */
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

/* The backward of a 16-bit plan's last run (a plan made with dtype BF16
 * or F16 runs with mha_attention_plan_run; its forward is kept, not
 * computed again) (docs/semantics.md#bf16-and-f16-attention-on-16-bit-data). */
MHA_API mha_status mha_attention_plan_backward16_sized(
    mha_attention_plan *plan, const mha_attention_args *args, size_t args_size,
    const mha_attention_grads16 *grads, size_t grads_size);
static inline mha_status mha_attention_plan_backward16(
    mha_attention_plan *plan, const mha_attention_args *args,
    const mha_attention_grads16 *grads)
{
    return mha_attention_plan_backward16_sized(plan, args, sizeof *args,
                                               grads, sizeof *grads);
}

/* The backward of one part of a split-key problem, given the lse and out
 * merged over all parts (docs/semantics.md#the-backward-of-one-part). */
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

/* Merges the (out, lse) of parts whose keys split one problem into the
 * attention over all keys
 * (docs/semantics.md#splitting-the-keys-lse-and-the-merge). */
typedef struct mha_attention_part {
    const float *out;    /* (B, Lq, H*d_h) */
    const float *lse;    /* (B, H, Lq)     */
} mha_attention_part;
MHA_API mha_status mha_attention_merge(const mha_attention_part *parts,
                                       int n_parts, int64_t batch,
                                       int64_t num_heads, int64_t head_dim,
                                       int64_t q_len, float *out, float *lse);

/* A module's forward, planned: checks and sizes once, then runs without
 * allocating (docs/semantics.md#mha_plan). */
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

/* The gradients of a forward pass, from dL/d out; what is NULL is not
 * computed (docs/semantics.md#gradients). */
typedef struct mha_backward_args {
    const float *grad_out;  /* (B, Lq, E), required                       */
    float *grad_query;      /* (B, Lq, E) or NULL                         */
    float *grad_key;        /* (B, Lk, kdim) or NULL                      */
    float *grad_value;      /* (B, Lk, vdim) or NULL                      */
    float *grad_params;     /* mha_param_numel(module) floats, or NULL    */
    int accumulate;         /* nonzero: grad_params += instead of =       */
    float *grad_head_mask;  /* (H) or NULL; follows accumulate            */

    /* After a 16-bit forward: the data's gradients in that type instead
     * (docs/semantics.md#16-bit-modules-mha_forward-on-bf16-or-f16-data). */
    const uint16_t *grad_out16;
    uint16_t *grad_query16, *grad_key16, *grad_value16;
} mha_backward_args;

/* The forward of `fwd` and its backward in one call; it allocates, so a
 * training loop uses a plan (docs/semantics.md#gradients). */
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

/* The backward of the plan's last mha_plan_forward, called with the same
 * `fwd` (docs/semantics.md#gradients). */
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
/* Inference: the KV cache, the projected keys and values of each sequence  */
/* in the kernels' layout.  A failed call leaves it unchanged.              */
/* (docs/semantics.md#the-kv-cache-and-incremental-decoding)                */
/* ------------------------------------------------------------------------ */

/* How the cache stores K and V: rounded once, at append; attention runs on
 * exactly the stored values ("Storage types" in the section above). */
typedef enum mha_kv_dtype {
    MHA_KV_F32 = 0,    /* float32: 4 bytes an element, exact            */
    MHA_KV_F16 = 1,    /* IEEE half: 2 bytes; |x| >= 65520 refused      */
    MHA_KV_BF16 = 2,   /* bfloat16: 2 bytes, float32's range            */
    MHA_KV_Q8 = 3,     /* 8-bit codes, a float scale per 32 elements    */
    MHA_KV_Q4 = 4      /* 4-bit codes, a float scale per 32; d_h even   */
} mha_kv_dtype;

/* A cache's shape and kind (docs/semantics.md#mha_kv_cache_config). */
typedef struct mha_kv_cache_config {
    int64_t batch;         /* sequences, >= 1                          */
    int64_t num_kv_heads;  /* H_kv, >= 1                               */
    int64_t head_dim;      /* d_h, >= 1                                */
    int64_t capacity;      /* tokens per sequence, >= 1 (a window's
                              ring: >= window)                        */
    mha_kv_dtype dtype;    /* MHA_KV_F32 (0), _F16, _BF16, _Q8 or _Q4  */
    int64_t window;        /* 0: an ordinary cache; W >= 1: a sliding-
                              window ring of the last tokens           */
    int64_t page_size;     /* 0: contiguous; P (16, 32 or a multiple of
                              64): paged                               */
    int64_t num_pages;     /* paged: the pool's pages; 0: room for
                              every sequence at its capacity           */
    int rotate;            /* nonzero: stored Hadamard-rotated         */
    int64_t v_head_dim;    /* d_v, the values' head width; 0 -> d_h    */
    int latent;            /* nonzero: MLA's latent cache, each value
                              the first d_v elements of its key        */
} mha_kv_cache_config;

/* Creates a cache; *out is NULL on failure. */
MHA_API mha_status mha_kv_cache_create_sized(const mha_kv_cache_config *config,
                                             size_t config_size,
                                             mha_kv_cache **out);
static inline mha_status mha_kv_cache_create(const mha_kv_cache_config *config,
                                             mha_kv_cache **out)
{
    return mha_kv_cache_create_sized(config, sizeof *config, out);
}
/* A float32 cache shaped for `module` (self-attention only)
 * (docs/semantics.md#calls-on-a-cache). */
MHA_API mha_status mha_kv_cache_for_module(const mha_module *module,
                                           int64_t batch, int64_t capacity,
                                           mha_kv_cache **out);
/* Frees the cache.  NULL is accepted and ignored. */
MHA_API void mha_kv_cache_free(mha_kv_cache *cache);
/* Tokens held by sequence `seq`; -1 for a NULL cache or a bad seq. */
MHA_API int64_t mha_kv_cache_length(const mha_kv_cache *cache, int64_t seq);
/* Appends n tokens to sequence seq: k and v (n, H_kv * d_h), projected
 * (and rotated) (docs/semantics.md#calls-on-a-cache). */
MHA_API mha_status mha_kv_cache_append(mha_kv_cache *cache, int64_t seq,
                                       const float *k, const float *v,
                                       int64_t n);
/* Keeps the first `length` tokens of sequence seq: a rollback. */
MHA_API mha_status mha_kv_cache_truncate(mha_kv_cache *cache, int64_t seq,
                                         int64_t length);
/* Empties sequence seq (-1: every sequence). */
MHA_API mha_status mha_kv_cache_reset(mha_kv_cache *cache, int64_t seq);
/* Sequence dst becomes a copy of sequence src; a paged cache shares the
 * pages (docs/semantics.md#calls-on-a-cache). */
MHA_API mha_status mha_kv_cache_fork(mha_kv_cache *cache, int64_t src,
                                     int64_t dst);
/* What a cache holds and takes (docs/semantics.md#calls-on-a-cache). */
typedef struct mha_kv_cache_usage {
    int64_t tokens;        /* tokens held, summed over the sequences   */
    int64_t token_bytes;   /* what those tokens' keys and values take  */
    int64_t bytes;         /* the key/value storage held               */
    int64_t bytes_total;   /* the key/value storage allocated          */
    int64_t page_size;     /* 0 for a contiguous cache                 */
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
 * them, into k and v (n, H_kv * d_h); either may be NULL. */
MHA_API mha_status mha_kv_cache_read(const mha_kv_cache *cache, int64_t seq,
                                     int64_t start, int64_t n, float *k,
                                     float *v);

/* Decoding, the module: projects the q_len new tokens of every sequence,
 * appends their K/V to the cache, attends causally and writes out
 * (docs/semantics.md#mha_decode_args-and-mha_attention_decode_args). */
typedef struct mha_decode_args {
    int64_t batch;              /* B: the cache's sequences, said again  */
    int64_t q_len;              /* new tokens per sequence, >= 1         */
    const float *query;         /* (B, q_len, E)                         */
    float *out;                 /* (B, q_len, E); may alias query        */
    mha_kv_cache *cache;        /* required                              */
    mha_mask attn_mask;         /* (q_len, Lk), (B, ..) or (B, H, ..)    */
    mha_mask key_padding_mask;  /* (Lk) or (B, Lk)                       */
    const int64_t *key_lengths; /* (B) or NULL                           */
    mha_weights_mode need_weights;
    float *attn_weights;        /* given iff need_weights is not NONE    */
    const int64_t *positions;   /* (B, q_len) RoPE positions, or NULL:
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
/* Planned decoding: sized once for caches of at most shape->cache's
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

/* Decoding, on heads: projected queries attend to the keys the caller
 * appended to the cache
 * (docs/semantics.md#mha_decode_args-and-mha_attention_decode_args). */
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
    /* BF16 or F16: queries and output in q16 and out16 (q, out NULL). */
    mha_dtype dtype;
    const uint16_t *q16;
    uint16_t *out16;
    /* (B + 1) offsets of ragged queries, or NULL; q_len 0 with it
     * (docs/semantics.md#paged-kv-caches, "Ragged steps"). */
    const int64_t *q_start;
    /* Nonzero, with q_start on a paged cache: shared prefix pages read
     * once (cascade attention). */
    int share_prefix;
    /* C: a query sees only its chunk of positions; 0: none. */
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

/* A new module of the n_keep heads keep[0..n_keep) of `module`, in that
 * order (docs/semantics.md#head-masks-ablation-and-pruning). */
MHA_API mha_status mha_prune_heads(const mha_module *module,
                                   const int64_t *keep, int64_t n_keep,
                                   mha_module **out);

/* The module's parameter memory, mha_param_numel floats, unchecked writes
 * allowed; valid until mha_free (docs/semantics.md#mha_param_data). */
MHA_API float *mha_param_data(mha_module *module);

/* The attention kernels in use ("avx512", "avx2", "neon", "scalar" or
 * "ref"); MHA_ISA forces one (docs/semantics.md#mha_kernel_tier). */
MHA_API const char *mha_kernel_tier(void);

/* The GEMM backend of the projections, "onednn" or "cblas"; MHA_GEMM
 * forces one (docs/semantics.md#gemm-backends). */
MHA_API const char *mha_gemm_backend(void);

/* 1 if the probability at (batch b, head h, query i, key j) is kept by
 * dropout for `seed` and p, 0 if dropped (docs/semantics.md#dropout). */
MHA_API int mha_dropout_keep(uint64_t seed, float p, int64_t b, int64_t h,
                             int64_t i, int64_t j);

#endif /* MHA_EXPERIMENTAL */

#ifdef __cplusplus
}
#endif

#endif /* MHA_H */
