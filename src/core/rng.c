/*
 * rng.c -- counter-based random numbers.
 *
 * Nothing here has state: every random number is a hash of its
 * coordinates, so results do not depend on the order in which work is
 * done or on how many threads do it.  The mixer is the SplitMix64
 * finaliser (Steele, Lea, Flood 2014), which passes BigCrush when fed a
 * counter; chaining it over the coordinates gives an independent stream
 * for every (seed, b, h, i, j).
 */
#include "core.h"

#define GOLDEN 0x9e3779b97f4a7c15ULL

uint64_t mha_mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

double mha_u01(uint64_t bits) { return (double)(bits >> 11) * 0x1.0p-53; }

/* Each coordinate is folded in by its own mixing round, so (1, 2) and
 * (2, 1) give unrelated values. */
static uint64_t dropout_bits(uint64_t seed, int64_t b, int64_t h, int64_t i,
                             int64_t j)
{
    uint64_t x = mha_mix64(seed + GOLDEN);
    x = mha_mix64(x ^ ((uint64_t)b + 1 * GOLDEN));
    x = mha_mix64(x ^ ((uint64_t)h + 2 * GOLDEN));
    x = mha_mix64(x ^ ((uint64_t)i + 3 * GOLDEN));
    x = mha_mix64(x ^ ((uint64_t)j + 4 * GOLDEN));
    return x;
}

int mha_dropout_keep(uint64_t seed, float p, int64_t b, int64_t h, int64_t i,
                     int64_t j)
{
    if (!(p > 0.0f))
        return 1;
    if (p >= 1.0f)
        return 0;
    /* Keep with probability 1 - p: compare 32 uniform bits with p * 2^32. */
    uint64_t threshold = (uint64_t)((double)p * 4294967296.0);
    return (dropout_bits(seed, b, h, i, j) >> 32) >= threshold;
}
