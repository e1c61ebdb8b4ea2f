/*
 * half.h -- the compact number formats of a KV cache, converted in plain
 * C: IEEE binary16 (f16) and bfloat16 (bf16), each a uint16_t of bits.
 *
 * float -> f16 and float -> bf16 round to nearest, ties to even (what
 * F16C's vcvtps2ph, NumPy's astype(float16) and PyTorch's .to(bfloat16)
 * do); overflow gives +-Inf, NaN stays NaN (quiet, sign and the top
 * payload bits kept); f16's subnormals are produced and read exactly.
 * The other direction is exact.  Header-only: the cache's stores and the
 * scalar tier's loads both use it, and the SIMD tiers' in-register
 * conversions (vcvtph2ps, a 16-bit shift) give the same floats.
 */
#ifndef MHA_HALF_H
#define MHA_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t mha_float_bits(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    return x;
}

static inline float mha_bits_float(uint32_t x)
{
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

/* x >> s rounded to nearest, ties to even (1 <= s <= 31). */
static inline uint32_t mha_shift_rne(uint32_t x, int s)
{
    const uint32_t q = x >> s, rem = x & ((1u << s) - 1u),
                   half = 1u << (s - 1);
    return q + (rem > half || (rem == half && (q & 1u)));
}

static inline uint16_t mha_f16_from_float(float f)
{
    const uint32_t x = mha_float_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)                    /* NaN: quiet, payload's top */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u)                   /* >= 65520: rounds to Inf  */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u)                   /* a normal f16: rebias the
                                                exponent (127 -> 15); a
                                                carry out of the mantissa
                                                moves into it, as it must */
        return (uint16_t)(sign | mha_shift_rne(ax - 0x38000000u, 13));
    if (ax <= 0x33000000u)                   /* <= 2^-25: rounds to zero */
        return (uint16_t)sign;
    /* A subnormal f16, m 2^-24 with m < 1024: the float's 24-bit
     * significand shifted down by 126 - exponent (14 .. 24). */
    const uint32_t e = ax >> 23, sig = (ax & 0x7fffffu) | 0x800000u;
    return (uint16_t)(sign | mha_shift_rne(sig, (int)(126u - e)));
}

static inline float mha_f16_to_float(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0x1fu)
        return mha_bits_float(sign | 0x7f800000u | (m << 13));
    if (e)
        return mha_bits_float(sign | ((e + 112u) << 23) | (m << 13));
    const float sub = (float)m * 0x1p-24f;   /* exact: m < 2^10 */
    return sign ? -sub : sub;
}

static inline uint16_t mha_bf16_from_float(float f)
{
    const uint32_t x = mha_float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)     /* NaN: quiet, kept          */
        return (uint16_t)((x >> 16) | 0x40u);
    /* Rounding the low 16 bits away; a carry reaches the exponent, and
     * from the largest finite values +-Inf, as it must. */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

static inline float mha_bf16_to_float(uint16_t h)
{
    return mha_bits_float((uint32_t)h << 16);
}

/* x rounded to the nearest bf16 (bf = 1) or f16 (bf = 0) value, as a
 * float: what a parameter of a module moved to that type holds. */
static inline float mha_half_round(float x, int bf)
{
    return bf ? mha_bf16_to_float(mha_bf16_from_float(x))
              : mha_f16_to_float(mha_f16_from_float(x));
}

#endif /* MHA_HALF_H */
