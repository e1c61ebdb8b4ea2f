/*
 * avx512.c -- the AVX-512 tier (Zen 4 / Zen 5 / Skylake-X class and
 * later): the micro-kernels of simd_tier.h on 16 lanes.  This file, and
 * only this file, is compiled with -mavx512f -mavx2 -mfma -mf16c; it is
 * called only when the CPU and the OS report AVX-512F (dispatch.c).
 * AVX-512F instructions only (no BW / DQ / VL), so any AVX-512 CPU runs it.
 *
 * 32 registers and mask registers: blocks of 6 rows x 4 vectors (24
 * accumulators, 4 of B, a broadcast), the _exact forms alike (their zero
 * test lives in a mask register); one or two rows take 8 vectors.  A lone
 * panel whose columns span several blocks walks K in slabs, as on AVX2,
 * and four rows against a 128-wide value tile go as two pairs
 * (simd_tier.h's panel and gemm; docs/KERNELS.md).  MLA's scores over
 * all 576 in one call (faster here than slabs: docs/BENCHMARKS.md).
 */
#define MHA_SIMD_AVX512
#define TIER_NAME "avx512"
#define TIER_TABLE mha_microkernels_avx512
#define TIER_RMAX 6
#define TIER_RMAX_EXACT 6
#define TIER_W1 8
#define TIER_W2 8
#define TIER_WM 4
#define TIER_WIDE_EXACT 1
#define TIER_SLABS 1
#define TIER_LATENT_SLAB 0
#include "simd_tier.h"
