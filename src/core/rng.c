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

#include <string.h>

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

/* ---- fingerprints ---------------------------------------------------------- */

enum { PRINT_SAMPLES = 1024 };

static uint64_t word_at(const unsigned char *p, size_t at, size_t bytes)
{
    uint64_t w = 0;
    memcpy(&w, p + at, bytes - at < 8 ? bytes - at : 8);
    return w;
}

uint64_t mha_fingerprint(uint64_t h, const void *data, size_t bytes)
{
    const unsigned char *p = data;
    h = mha_mix64(h ^ (uint64_t)bytes ^ (p ? GOLDEN : 0));
    if (!p || bytes == 0)
        return h;
    const size_t words = (bytes + 7) / 8;
    if (words <= 2 * PRINT_SAMPLES) {
        for (size_t w = 0; w < words; w++)
            h = mha_mix64(h ^ word_at(p, 8 * w, bytes));
        return h;
    }
    /* Samples every `step` words from the first, then the last word. */
    const size_t step = (words - 1) / (PRINT_SAMPLES - 1);
    for (size_t k = 0; k < PRINT_SAMPLES; k++) {
        const size_t w = k + 1 < PRINT_SAMPLES ? k * step : words - 1;
        h = mha_mix64(h ^ word_at(p, 8 * w, bytes) ^ (uint64_t)w);
    }
    return h;
}
