/*
 * mha_io.h -- libmha's file formats: safetensors and .npy tensors, and a
 * module's parameters loaded from and saved to a PyTorch state_dict.
 *
 * The layer above the core API (mha.h, which this header includes): a
 * program that only computes attention never needs it.  Every call is
 * stable API (see "API layers" in mha.h).  Files are written atomically:
 * a temporary file beside the target, renamed into place at the end.
 */
#ifndef MHA_IO_H
#define MHA_IO_H

#include "mha.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Tensors in files: safetensors and .npy                                   */
/* ------------------------------------------------------------------------ */

/* Element types as stored in a file: mha_dtype (mha.h). */

/* "F32", "F64", "F16", "BF16", "BOOL", "I32", "I64" (safetensors names). */
MHA_API const char *mha_dtype_name(mha_dtype dtype);

#define MHA_MAX_NDIM 8

/*
 * A tensor read from a file, converted for use in C:
 *   F32, F64, F16, BF16  ->  data is float *   (float32)
 *   BOOL                 ->  data is uint8_t * (0 or 1)
 *   I32, I64             ->  data is int64_t *
 * `dtype` says what the file held.  Data is C-order (row-major).
 */
typedef struct mha_tensor {
    const char *name;     /* safetensors: the tensor's name; npy: "" */
    mha_dtype dtype;
    int ndim;             /* 0 (a scalar) .. MHA_MAX_NDIM */
    int64_t shape[MHA_MAX_NDIM];
    int64_t numel;
    void *data;
} mha_tensor;

/* A tensor to write: data in the C type of its dtype (float for F32,
 * double for F64, uint8_t for BOOL, int32_t for I32, int64_t for I64;
 * F16 and BF16 as uint16_t bit patterns). */
typedef struct mha_tensor_view {
    const char *name;
    mha_dtype dtype;
    int ndim;
    int64_t shape[MHA_MAX_NDIM];
    const void *data;
} mha_tensor_view;

/* Every tensor of a safetensors file, with its metadata.  Opaque. */
typedef struct mha_tensor_file mha_tensor_file;

/*
 * Reads a safetensors file (8-byte little-endian header length N, N bytes
 * of JSON header, then the data buffer) and checks every rule of the
 * format; each violation has its own message.  Limits: header <= 100 MB,
 * file size as given by the file system.
 */
MHA_API mha_status mha_safetensors_load(const char *path,
                                        mha_tensor_file **out);
/* The same from memory (bytes, size). */
MHA_API mha_status mha_safetensors_parse(const void *bytes, size_t size,
                                         mha_tensor_file **out);
MHA_API void mha_tensor_file_free(mha_tensor_file *file);
MHA_API int mha_tensor_file_count(const mha_tensor_file *file);
/* Tensors in file order (sorted by data offset); NULL if out of range. */
MHA_API const mha_tensor *mha_tensor_file_at(const mha_tensor_file *file,
                                             int index);
MHA_API const mha_tensor *mha_tensor_file_find(const mha_tensor_file *file,
                                               const char *name);
/* The __metadata__ value for key, or NULL. */
MHA_API const char *mha_tensor_file_metadata(const mha_tensor_file *file,
                                             const char *key);

/*
 * Writes tensors (in the given order) and optional metadata (n_meta
 * key/value string pairs) as a safetensors file.  Writes to a temporary
 * file beside `path` and renames it at the end: on failure nothing is left.
 */
MHA_API mha_status mha_safetensors_save(const char *path,
                                        const mha_tensor_view *tensors,
                                        int n_tensors,
                                        const char *const *meta_keys,
                                        const char *const *meta_values,
                                        int n_meta);

/*
 * A module from a PyTorch nn.MultiheadAttention state_dict: in_proj_weight
 * or q/k/v_proj_weight, biases present or absent, bias_k/bias_v.  E, kdim,
 * vdim, bias and add_bias_kv are inferred from the shapes; num_heads is
 * `num_heads` if > 0 (refused if __metadata__ "num_heads" says another
 * count), else __metadata__ "num_heads".  add_zero_attn,
 * dropout and scale come from __metadata__ when present (files saved by
 * mha_module_save have them), else defaults; a nonzero field of `base`
 * (which may be NULL) overrides either, and base->seed is kept.  So do
 * the modifiers (mods), each block whole: base->mods.rope when its style
 * is not NONE, ALiBi when base->mods.alibi or alibi_slopes is set (its
 * slopes, or the defaults when NULL, replacing the file's), the window
 * when base->mods.window, the softcap when nonzero.  Slopes are copied.
 * Every missing tensor, unexpected tensor, wrong shape and malformed
 * metadata value is named.
 */
MHA_API mha_status mha_module_from_file_sized(const mha_tensor_file *file,
                                              int64_t num_heads,
                                              const mha_config *base,
                                              size_t base_size,
                                              mha_module **out);
static inline mha_status mha_module_from_file(const mha_tensor_file *file,
                                              int64_t num_heads,
                                              const mha_config *base,
                                              mha_module **out)
{
    return mha_module_from_file_sized(file, num_heads, base, sizeof *base,
                                      out);
}
MHA_API mha_status mha_module_load(const char *path, int64_t num_heads,
                                   mha_module **out);
/* Saves every parameter under its PyTorch name, float32, with the config
 * in __metadata__ ("format": "pt", embed_dim, num_heads, kdim, vdim, bias,
 * add_bias_kv, add_zero_attn, dropout, and scale when it was chosen rather
 * than left to its default; num_kv_heads for grouped-query modules; the
 * modifiers that are on: rope "neox"/"gptj" with rope_dims, rope_theta and
 * rope_scale resolved, alibi "true" and alibi_slopes "s0,s1,..." when not
 * the defaults, window "LEFT,RIGHT", softcap).  Atomic: on failure no file
 * is left. */
MHA_API mha_status mha_module_save(const mha_module *module, const char *path);

/*
 * Reads a .npy file (format versions 1.0, 2.0 and 3.0): dtypes <f4, <f8,
 * <f2 (float16, widened exactly: dtype F16), |b1, <i4, <i8 (and |u1 as
 * bool), C order; a Fortran-order array is transposed into C order.
 * Truncated or inconsistent headers are refused.
 */
MHA_API mha_status mha_npy_load(const char *path, mha_tensor **out);
MHA_API mha_status mha_npy_parse(const void *bytes, size_t size,
                                 mha_tensor **out);
/* A .npy file's dtype (as loaded), ndim and shape in *info (data NULL),
 * its header checked as mha_npy_load checks it, the data not read. */
MHA_API mha_status mha_npy_info(const char *path, mha_tensor_view *info);
/*
 * Part of a .npy array of 2 or more dimensions (..., L, w): for every
 * index of the leading dimensions, rows [starts[i], starts[i] + counts[i])
 * of its L, for i = 0 .. nranges - 1 in that order -- shape (..., sum of
 * counts, w), converted as mha_npy_load converts -- reading only those
 * rows' bytes from the file (a Fortran-order array is read whole first).
 * What a rank of an MPI job reads of a sequence split across ranks.
 */
MHA_API mha_status mha_npy_load_rows(const char *path, int nranges,
                                     const int64_t *starts,
                                     const int64_t *counts, mha_tensor **out);
/* Frees a tensor from mha_npy_load / mha_npy_parse.  NULL is ignored. */
MHA_API void mha_tensor_free(mha_tensor *tensor);
/* Writes a .npy (version 1.0) file, atomically like mha_safetensors_save:
 * F32, F64, F16 (<f2), BOOL, I32, I64; BF16 is refused (NumPy has no
 * bfloat16 type: safetensors holds it). */
MHA_API mha_status mha_npy_save(const char *path, const mha_tensor_view *t);

/*
 * Writes `size` bytes to `path` by the rules of every save above: through
 * NAME.tmp.<random> in the same directory, fsync'ed, given the old file's
 * mode and owner, renamed over NAME when complete (on failure NAME is as
 * it was and the temporary file is gone); a symbolic link is followed to
 * its target; a FIFO, a device or /dev/stdout is written through, never
 * replaced; a file of several hard links is rewritten in place.  For
 * files of the caller's own format (`mha viz` writes its PNG so).
 */
MHA_API mha_status mha_file_save(const char *path, const void *data,
                                 size_t size);

/*
 * An atomic save writes NAME.tmp.<random> beside NAME and renames it over
 * NAME when complete.  A process killed by a signal in between would leave
 * that temporary file behind; a signal handler that calls this first
 * removes the temporary files of every save in progress (at most 64 at
 * once are tracked; past that a save still works, untracked).  It is
 * async-signal-safe (it only unlinks, through lock-free atomics) and the
 * saves it interrupts then fail or leave NAME as it was: call it only when
 * the process is about to end.  The `mha` command calls it on SIGINT,
 * SIGTERM, SIGHUP and SIGPIPE before dying of the signal.
 */
MHA_API void mha_io_discard_temporaries(void);

#ifdef __cplusplus
}
#endif

#endif /* MHA_IO_H */
