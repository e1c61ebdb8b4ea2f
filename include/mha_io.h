/*
 * mha_io.h -- libmha's file formats: safetensors and .npy tensors, and a
 * module's parameters loaded from and saved to a PyTorch state_dict.
 *
 * The layer above the core API (mha.h, included here); stable API.  Every
 * save is atomic (docs/semantics.md#mha_ioh-files).
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

/* A tensor read from a file, in C order: data is float * (F32, F64, F16,
 * BF16), uint8_t * (BOOL) or int64_t * (I32, I64)
 * (docs/semantics.md#mha_tensor). */
typedef struct mha_tensor {
    const char *name;     /* safetensors: the tensor's name; npy: "" */
    mha_dtype dtype;      /* what the file held */
    int ndim;             /* 0 (a scalar) .. MHA_MAX_NDIM */
    int64_t shape[MHA_MAX_NDIM];
    int64_t numel;
    void *data;
} mha_tensor;

/* A tensor to write, data in its dtype's C type (F16 and BF16 as uint16_t
 * bits) (docs/semantics.md#mha_tensor). */
typedef struct mha_tensor_view {
    const char *name;
    mha_dtype dtype;
    int ndim;
    int64_t shape[MHA_MAX_NDIM];
    const void *data;
} mha_tensor_view;

/* Every tensor of a safetensors file, with its metadata.  Opaque. */
typedef struct mha_tensor_file mha_tensor_file;

/* Reads a safetensors file, checking every rule of the format
 * (docs/semantics.md#mha_safetensors_load). */
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

/* Writes tensors, in the given order, and n_meta key/value strings of
 * metadata as a safetensors file, atomically. */
MHA_API mha_status mha_safetensors_save(const char *path,
                                        const mha_tensor_view *tensors,
                                        int n_tensors,
                                        const char *const *meta_keys,
                                        const char *const *meta_values,
                                        int n_meta);

/* A module from a PyTorch nn.MultiheadAttention state_dict; num_heads > 0
 * or the file's, `base` (or NULL) overriding the file's settings
 * (docs/semantics.md#mha_module_from_file). */
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
/* Loads the safetensors file at `path` as mha_module_from_file, no base. */
MHA_API mha_status mha_module_load(const char *path, int64_t num_heads,
                                   mha_module **out);
/* Saves every parameter under its PyTorch name, float32, and the config in
 * __metadata__, atomically (docs/semantics.md#mha_module_save). */
MHA_API mha_status mha_module_save(const mha_module *module, const char *path);

/* Reads a .npy file (versions 1.0 to 3.0; float, bool and integer dtypes;
 * either order) (docs/semantics.md#mha_npy_load). */
MHA_API mha_status mha_npy_load(const char *path, mha_tensor **out);
MHA_API mha_status mha_npy_parse(const void *bytes, size_t size,
                                 mha_tensor **out);
/* A .npy file's dtype, ndim and shape in *info (data NULL), the data not
 * read. */
MHA_API mha_status mha_npy_info(const char *path, mha_tensor_view *info);
/* Rows [starts[i], starts[i] + counts[i]) of the L of an array (..., L, w),
 * reading only their bytes (docs/semantics.md#mha_npy_load). */
MHA_API mha_status mha_npy_load_rows(const char *path, int nranges,
                                     const int64_t *starts,
                                     const int64_t *counts, mha_tensor **out);
/* Frees a tensor from mha_npy_load / mha_npy_parse.  NULL is ignored. */
MHA_API void mha_tensor_free(mha_tensor *tensor);
/* Writes a .npy (version 1.0) file, atomically; BF16 is refused (NumPy
 * has no bfloat16). */
MHA_API mha_status mha_npy_save(const char *path, const mha_tensor_view *t);

/* Writes `size` bytes to `path` by the rules of every save above, for
 * files of the caller's own format (docs/semantics.md#mha_file_save). */
MHA_API mha_status mha_file_save(const char *path, const void *data,
                                 size_t size);

/* Removes the temporary files of the saves in progress: async-signal-safe,
 * for a handler of the signals that end the process
 * (docs/semantics.md#files-read-without-waiting-written-without-loss). */
MHA_API void mha_io_discard_temporaries(void);

#ifdef __cplusplus
}
#endif

#endif /* MHA_IO_H */
