/*
 * testutil.h -- small helpers shared by the C tests.
 */
#ifndef MHA_TESTUTIL_H
#define MHA_TESTUTIL_H

#include "mha.h"

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

/*
 * A scratch directory for a test group: tu_tmpdir_setup / _teardown are
 * cmocka group fixtures; the teardown removes every file (and empty
 * subdirectory) the tests left in tu_tmpdir.
 */
extern char tu_tmpdir[256];
int tu_tmpdir_setup(void **state);
int tu_tmpdir_teardown(void **state);

#endif
