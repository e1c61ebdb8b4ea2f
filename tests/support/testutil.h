/*
 * testutil.h -- small helpers shared by the C tests.
 */
#ifndef MHA_TESTUTIL_H
#define MHA_TESTUTIL_H

#include "mha_io.h"

#include <stdint.h>

/* Deterministic uniform values in [lo, hi). */
void tu_fill(float *x, int64_t n, uint64_t seed, float lo, float hi);

/*
 * A module from `cfg` whose every parameter, biases included, is random
 * (Xavier init leaves biases at zero, which would hide bias bugs).
 * Returns NULL on failure.
 */
mha_module *tu_module(const mha_config *cfg, uint64_t seed);

/* Total elements of a parameter-free tensor shape. */
int64_t tu_numel(const int64_t *shape, int ndim);

/* A mask of a test case: kind, rank, and which dimensions broadcast. */
typedef struct tu_mask_spec {
    mha_mask_kind kind;
    int ndim;        /* attn: 2, 3, 4; key padding: 1, 2 */
    int bcast_b;     /* batch dimension of size 1 */
    int bcast_h;     /* head dimension of size 1 */
} tu_mask_spec;

/* A random mask for spec (attention mask if is_attn, else key padding);
 * bools block ~30%, additive gets ~20% -inf and finite values in [-3, 3)
 * elsewhere.  Fills *out and returns its malloc'ed data (NULL for kind
 * NONE), which the caller frees. */
void *tu_make_mask(const tu_mask_spec *s, int64_t B, int64_t H, int64_t Lq,
                   int64_t Lk, int is_attn, uint64_t seed, mha_mask *out);

/*
 * A scratch directory for a test group: tu_tmpdir_setup / _teardown are
 * cmocka group fixtures; the teardown removes every file (and empty
 * subdirectory) the tests left in tu_tmpdir.
 */
/* A cmocka test: the kernel tier in use is the one MHA_ISA asks for (and
 * prints it); for tests linked with cmocka. */
void tu_test_tier(void **state);

/* The exit status CTest reads as "skipped" (SKIP_RETURN_CODE). */
enum { TU_SKIP = 77 };

/* Nonzero when MHA_ISA asks for a tier this CPU cannot run (avx2 without
 * AVX2 + FMA, avx512 without AVX-512F, neon off aarch64): the test's main
 * then prints why and returns TU_SKIP, so the per-tier CTest runs skip on
 * older machines and on the other CPU family. */
int tu_tier_unavailable(void);

/* tu_tier_unavailable, and MHA_GEMM=onednn in a build without oneDNN (a
 * skip too); a backend other than the one MHA_GEMM asks for exits 1. */
int tu_backend_unavailable(void);

extern char tu_tmpdir[256];
int tu_tmpdir_setup(void **state);
int tu_tmpdir_teardown(void **state);

#endif
