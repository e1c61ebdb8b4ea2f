/*
 * modifiers.c -- the score modifiers' settings: their checks, and ALiBi's
 * default slopes.  What they do to the scores is in tiles.c
 * (mha_score_tile) and ref_forward.c (mha_ref_modify); the window and
 * the chunks are masks by index (mask.c); a sink is where a row's softmax starts
 * (flash_forward.c).  RoPE is rope.c's.
 */
#include "attention.h"

#include <math.h>

mha_status mha_modifiers_check(const mha_modifiers *m, int64_t H,
                               const char *who)
{
    if (!(m->softcap >= 0.0f) || isinf(m->softcap))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: softcap must be finite and > 0 (0: none), "
                             "got %g", who, (double)m->softcap);
    if (!m->window && (m->window_left || m->window_right))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: window_left / window_right are set but "
                             "window is 0: set window to apply them", who);
    if (!m->alibi && m->alibi_slopes)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: alibi_slopes is set but alibi is 0: set "
                             "alibi to apply them", who);
    if (m->window && (m->window_left < -1 || m->window_right < -1))
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: window bounds must be >= -1 (-1: no "
                             "bound), got left %lld, right %lld", who,
                             (long long)m->window_left,
                             (long long)m->window_right);
    if (m->alibi && m->alibi_slopes)
        for (int64_t h = 0; h < H; h++)
            if (!isfinite(m->alibi_slopes[h]))
                return mha_set_error(MHA_ERR_NON_FINITE,
                                     "%s: alibi_slopes[%lld] is %g; slopes "
                                     "must be finite", who, (long long)h,
                                     (double)m->alibi_slopes[h]);
    return MHA_OK;
}

int mha_modifiers_same(const mha_modifiers *a, const mha_modifiers *b)
{
    return a->softcap == b->softcap && !a->alibi == !b->alibi &&
           a->alibi_slopes == b->alibi_slopes && !a->window == !b->window &&
           (!a->window || (a->window_left == b->window_left &&
                           a->window_right == b->window_right)) &&
           a->rope.style == b->rope.style && a->rope.dims == b->rope.dims &&
           a->rope.theta == b->rope.theta && a->rope.scale == b->rope.scale;
}

int mha_modifiers_none(const mha_modifiers *m)
{
    return !m->softcap && !m->alibi && !m->window &&
           m->rope.style == MHA_ROPE_NONE;
}

mha_status mha_chunk_check(int64_t chunk, const char *who)
{
    if (chunk < 0)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "%s: attention_chunk must be >= 0 (0: none), "
                             "got %lld", who, (long long)chunk);
    return MHA_OK;
}

mha_status mha_sinks_check(const float *sinks, int64_t H, const char *who)
{
    for (int64_t h = 0; sinks && h < H; h++)
        if (!isfinite(sinks[h]))
            return mha_set_error(MHA_ERR_NON_FINITE,
                                 "%s: sinks[%lld] is %g; sink logits must be "
                                 "finite", who, (long long)h,
                                 (double)sinks[h]);
    return MHA_OK;
}

/*
 * Press et al. (2022): for n a power of two, slope k (k = 1 .. n) is
 * 2^(-8k / n), a geometric sequence from 2^(-8/n).  For other H, the n =
 * 2^floor(log2 H) slopes of n, then the odd-numbered slopes (k = 1, 3,
 * 5, ...) of 2n's sequence, 2^(-4k / n), until there are H.  Each is
 * computed in float64 and rounded once.
 */
mha_status mha_alibi_slopes(int64_t H, float *slopes)
{
    if (!slopes)
        return mha_set_error(MHA_ERR_NULL_POINTER, "alibi slopes: output is "
                             "NULL");
    if (H < 1 || H > (int64_t)1 << 30)
        return mha_set_error(MHA_ERR_INVALID_ARGUMENT,
                             "alibi slopes: num_heads must be in [1, 2^30], "
                             "got %lld", (long long)H);
    int64_t n = 1;
    while (n * 2 <= H)
        n *= 2;
    for (int64_t k = 1; k <= n; k++)
        slopes[k - 1] = (float)exp2(-8.0 * (double)k / (double)n);
    for (int64_t k = 1, h = n; h < H; k += 2, h++)
        slopes[h] = (float)exp2(-4.0 * (double)k / (double)n);
    return MHA_OK;
}
