/*
 * bsrc.h -- how the SIMD tiers' GEMM reads its B operand (simd_tier.h):
 * float, or a KV cache's compact formats, each vector
 * converted to the floats it stands for as it is loaded (kernels.h):
 * f16 by the ISA's half conversion, bf16 by a 16-bit shift, q8 codes widened and
 * multiplied by their scale, which varies along the columns in a kt tile
 * (Q8K: one per key) and is one per 32 columns of a row in a v tile
 * (Q8V); q4 the same with two codes a byte (Q4K, Q4V: a nibble picked by
 * a shift).  The conversion is exact for f16 and bf16 and one rounding of
 * c * s for q8 and q4, as the scalar mha_kt_load / mha_v_load do it.  Plain C:
 * simd_tier.h adds the vector loads (simd.h).
 */
#ifndef MHA_BSRC_H
#define MHA_BSRC_H

#include "kernels.h"

#include <stddef.h>

enum { B_F32, B_F16, B_BF16, B_Q8K, B_Q8V, B_Q4K, B_Q4V };

typedef struct bsrc {
    const void *x;      /* the elements, ld per row of B               */
    const float *s;     /* q8, q4: the scales                          */
    int ld;             /* (q4: bytes per pair of rows)                */
    int blocks;         /* Q8V, Q4V: scales per row                    */
    const char *next;   /* F16, BF16: the tile read next, laid out as
                           this one, or NULL (simd_tier.h's ahead)     */
} bsrc;

/* B[k][j] of a compact B (T: B_F16 .. B_Q4V), one element (the tails). */
static inline __attribute__((always_inline)) float
bsrc_elem(const int T, const bsrc *b, int k, int j)
{
    const size_t at = (size_t)k * b->ld + j;
    switch (T) {
    case B_Q4K:
        return (float)mha_q4_code(b->x, b->ld, k, j) *
               b->s[(size_t)(k / MHA_Q8_BLOCK) * b->ld + j];
    case B_Q4V:
        return (float)mha_q4_code(b->x, b->ld, k, j) *
               b->s[(size_t)k * b->blocks + j / MHA_Q8_BLOCK];
    case B_F16: return mha_f16_to_float(((const uint16_t *)b->x)[at]);
    case B_BF16: return mha_bf16_to_float(((const uint16_t *)b->x)[at]);
    case B_Q8K:
        return (float)((const int8_t *)b->x)[at] *
               b->s[(size_t)(k / MHA_Q8_BLOCK) * b->ld + j];
    default:
        return (float)((const int8_t *)b->x)[at] *
               b->s[(size_t)k * b->blocks + j / MHA_Q8_BLOCK];
    }
}

#endif /* MHA_BSRC_H */
