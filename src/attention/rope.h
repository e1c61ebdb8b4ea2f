/*
 * rope.h -- rotary position embeddings (RoPE) of projected heads: the
 * settings' checks and defaults, and the rotation of rows of heads,
 * forward and inverse.  Private to libmha: the module's forward and
 * backward (src/module/) and mha_attention (sdpa.c) call it; the public
 * door is mha_rope_apply (include/mha.h).
 */
#ifndef MHA_ROPE_H
#define MHA_ROPE_H

#include "core/core.h"

#include <stdint.h>

/*
 * Checks `in` for heads of head_dim elements and writes it with its
 * defaults filled in (dims 0 -> head_dim, theta 0 -> 10000, scale 0 -> 1)
 * to `out`, which may be `in`.  A style of MHA_ROPE_NONE is copied as
 * {NONE, 0, 0, 0}.  MHA_ERR_INVALID_ARGUMENT names the bad field.
 */
mha_status mha_rope_resolve(const mha_rope *in, int64_t head_dim,
                            mha_rope *out);

/* Every one of the n positions is >= 0; `who` names the array. */
mha_status mha_rope_check_positions(const int64_t *positions, int64_t n,
                                    const char *who);

/*
 * Rotates the B * L rows of x in place: row r = b * L + i (at x + r * ld)
 * holds `heads` heads of head_dim elements side by side and sits at
 * position positions[r] ((B, L), or NULL: starts[b] + i, or start + i
 * when starts is NULL too).  `rope` is resolved (mha_rope_resolve) and
 * not NONE.  inverse: the rotation by the negative angle (the transpose),
 * which takes a gradient with respect to the rotated values back to the
 * values before the rotation.  Each element is computed alone (no
 * reduction), so any thread count (0: the OpenMP default) gives the same
 * bits.
 */
void mha_rope_rows(const mha_rope *rope, int64_t B, int64_t L,
                   int64_t heads, int64_t head_dim, const int64_t *positions,
                   const int64_t *starts, int64_t start, float *x,
                   int64_t ld, int inverse, int threads);

#endif /* MHA_ROPE_H */
