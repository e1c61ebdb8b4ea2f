/*
 * neon.c -- the aarch64 tier (Advanced SIMD, every ARMv8-A CPU): the
 * micro-kernels of simd_tier.h on 4 lanes.  Compiled on aarch64 only;
 * dispatch.c takes it where the kernel reports ASIMD in its HWCAPs.
 *
 * 32 registers: blocks of 6 rows x 4 vectors (24 accumulators, 4 of B, a
 * broadcast), 4 rows for the _exact forms (their zero test and select
 * need vector registers); one or two rows take 8 vectors.  A lone panel
 * walks K in slabs, as on AVX2.  No aarch64 timing exists yet: these
 * choices follow the register count, not a measurement.
 */
#define MHA_SIMD_NEON
#define TIER_NAME "neon"
#define TIER_TABLE mha_microkernels_neon
#define TIER_RMAX 6
#define TIER_RMAX_EXACT 4
#define TIER_W1 8
#define TIER_W2 8
#define TIER_WM 4
#define TIER_WIDE_EXACT 1
#define TIER_SLABS 1
#define TIER_LATENT_SLAB 64
#include "simd_tier.h"
