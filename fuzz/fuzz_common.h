/*
 * fuzz_common.h -- what the fuzz targets that check a contract share: a
 * CHECK that names the target and traps (libFuzzer keeps the input), and
 * a SplitMix64 generator seeded from a hash of the whole input, so that
 * each input always means the same values.  Header-only (static).
 */
#ifndef MHA_FUZZ_COMMON_H
#define MHA_FUZZ_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* The including target defines, before inclusion,
 *     static const char *fuzz_who(void);
 * its name as the failure messages start. */
static const char *fuzz_who(void);

#define CHECK(ok, ...)                                                     \
    do {                                                                   \
        if (!(ok)) {                                                       \
            fprintf(stderr, "%s: ", fuzz_who());                           \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            __builtin_trap();                                              \
        }                                                                  \
    } while (0)

static uint64_t rng_state;

/* Seeds the generator with the FNV-1a hash of the input. */
static inline void rng_seed_bytes(const uint8_t *data, size_t size)
{
    uint64_t h = UINT64_C(1469598103934665603);
    for (size_t k = 0; k < size; k++)
        h = (h ^ data[k]) * UINT64_C(1099511628211);
    rng_state = h;
}

/* SplitMix64 (Steele, Lea & Flood 2014). */
static inline uint64_t rng_next(void)
{
    uint64_t z = (rng_state += UINT64_C(0x9e3779b97f4a7c15));
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static inline double rng_unit(void)
{
    return (double)(rng_next() >> 11) * 0x1p-52 - 1.0;
}

#endif
