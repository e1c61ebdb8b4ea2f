/*
 * avx2.c -- the AVX2 + FMA tier (Zen 3 / Haswell class): the micro-kernels
 * of simd_tier.h on 8 lanes.  This file, and only this file, is compiled
 * with -mavx2 -mfma -mf16c; it is called only when the CPU reports all
 * three (dispatch.c).
 *
 * 16 registers: blocks of 6 rows x 2 vectors (12 accumulators, 2 of B, a
 * broadcast), 4 rows for the _exact forms (the compare and the blend need
 * registers too); one row takes 8 vectors, two rows 4 (decoding: eight or
 * four independent chains keep the FMA units busy where 16-wide blocks of
 * one row would wait on their latency).  A lone panel walks K in slabs.
 * The K loop unrolled by 4 (at d_h 64 a block's 64 trips ended in a
 * mispredicted exit: 2-4% of the forward, docs/BENCHMARKS.md).  MLA's
 * scores over the 576 in slabs of 64, q^T's slab kept in L1.
 */
#define MHA_SIMD_AVX2
#define TIER_NAME "avx2"
#define TIER_TABLE mha_microkernels_avx2
#define TIER_RMAX 6
#define TIER_RMAX_EXACT 4
#define TIER_W1 8
#define TIER_W2 4
#define TIER_WM 2
#define TIER_WIDE_EXACT 0
#define TIER_SLABS 1
#define TIER_LATENT_SLAB 64
#define TIER_KUNROLL 4
#include "simd_tier.h"
