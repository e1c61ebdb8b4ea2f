/*
 * bench.h -- what the timings of `mha bench` share: a clock, random
 * inputs, the median, the BLAS's thread count; and the decoding benchmark
 * (bench_decode.c), which cmd_bench.c runs for --decode.
 */
#ifndef MHA_TOOL_BENCH_H
#define MHA_TOOL_BENCH_H

#include "args.h"

#include <stdint.h>

/* Seconds on CLOCK_MONOTONIC. */
double bench_now_s(void);

/* Uniform in [-1, 1) from a 64-bit LCG (top 24 bits). */
void bench_fill_random(float *x, int64_t n, uint64_t *state);

/* Sorts ms[0..n) and returns its median (n >= 1). */
double bench_median(double *ms, int64_t n);

/* Online CPUs, clamped to the library's thread range [1, 4096]. */
int64_t bench_online_cpus(void);

/*
 * The BLAS fixes its thread count from the environment when it is loaded,
 * before main: sets OPENBLAS_NUM_THREADS and OMP_NUM_THREADS to `threads`
 * and re-executes `mha bench` (argv[0] is "bench"), once.  Returns only
 * if nothing had to change or re-executing failed (then it warns).
 */
void bench_pin_blas_threads(int argc, char **argv, int64_t threads);

/* OPENBLAS_NUM_THREADS as the BLAS was loaded with, or NULL if unset. */
const char *bench_blas_env(void);

/*
 * What every timing does before it starts: pins the BLAS's threads
 * (bench_pin_blas_threads, which may re-execute), reads the thread count
 * the BLAS was loaded with (0 if unset) and the kernel tier, and warns on
 * stderr (text mode) when `threads` oversubscribes the ncpu online CPUs.
 * Returns 1 after printing why when no kernel tier can run, else 0.
 */
int bench_setup(int argc, char **argv, int64_t threads, int64_t ncpu,
                int json, long *blas_threads, const char **tier);

/* Single-thread multiply-add GFLOP/s of the widest vectors the kernel
 * tier uses (the best of ~0.2 s of short runs); *kind names the loop. */
double bench_fma_peak(const char **kind);

/* `mha bench --decode`, on the options cmd_bench parsed (o, n). */
int bench_decode(int argc, char **argv, const tool_opt *o, int n);

#endif
