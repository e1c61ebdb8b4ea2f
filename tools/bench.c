/*
 * bench.c -- the helpers of `mha bench`'s timings (bench.h).
 */
#define _POSIX_C_SOURCE 200809L
#include "bench.h"
#include "fail.h"
#include "mha.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

double bench_now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

void bench_fill_random(float *x, int64_t n, uint64_t *state)
{
    for (int64_t i = 0; i < n; i++) {
        *state = *state * 6364136223846793005ULL + 1442695040888963407ULL;
        x[i] = (float)(*state >> 40) * (2.0f / 16777216.0f) - 1.0f;
    }
}

static int cmp_double(const void *x, const void *y)
{
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

double bench_median(double *ms, int64_t n)
{
    qsort(ms, (size_t)n, sizeof *ms, cmp_double);
    return n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
}

int64_t bench_online_cpus(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > 4096 ? 4096 : (int64_t)n;
}

static const char *const THREAD_VARS[] = {"OPENBLAS_NUM_THREADS",
                                          "OMP_NUM_THREADS"};

const char *bench_blas_env(void) { return getenv(THREAD_VARS[0]); }

void bench_pin_blas_threads(int argc, char **argv, int64_t threads)
{
    char want[32];
    snprintf(want, sizeof want, "%lld", (long long)threads);
    int differ = 0;
    for (int k = 0; k < NOPTS(THREAD_VARS); k++) {
        const char *v = getenv(THREAD_VARS[k]);
        if (!v || strcmp(v, want))
            differ = 1;
    }
    if (!differ)
        return;
    if (getenv("MHA_BENCH_REEXEC")) {
        fprintf(stderr, "mha bench: warning: could not set the BLAS threads "
                "to %s; they may differ from --threads\n", want);
        return;
    }
    for (int k = 0; k < NOPTS(THREAD_VARS); k++)
        setenv(THREAD_VARS[k], want, 1);
    setenv("MHA_BENCH_REEXEC", "1", 1);
    char **args = calloc((size_t)argc + 2, sizeof *args);
    if (args) {
        args[0] = "mha";
        for (int i = 0; i < argc; i++)
            args[i + 1] = argv[i];   /* argv[0] is "bench" */
        fflush(NULL);
        execv("/proc/self/exe", args);
        free(args);
    }
    fprintf(stderr, "mha bench: warning: could not re-execute with %s=%s; "
            "set it yourself for an exact thread count\n", THREAD_VARS[0],
            want);
}

int bench_setup(int argc, char **argv, int64_t threads, int64_t ncpu,
                int json, long *blas_threads, const char **tier)
{
    bench_pin_blas_threads(argc, argv, threads);
    /* What the BLAS was loaded with (after the re-execution, if any). */
    const char *blas_env = bench_blas_env();
    *blas_threads = blas_env ? strtol(blas_env, NULL, 10) : 0;
    *tier = mha_kernel_tier();
    if (!*tier)
        return tool_fail("bench", "no attention kernels: %s",
                         mha_last_error());
    if (!mha_gemm_backend())
        return tool_fail("bench", "no GEMM backend: %s", mha_last_error());
    if (threads > ncpu && !json)
        fprintf(stderr, "mha bench: warning: %lld threads on %lld online "
                "CPUs: oversubscribed, the timings mean little\n",
                (long long)threads, (long long)ncpu);
    return 0;
}

/* ---- the FMA peak probe ------------------------------------------------- */

/*
 * Independent multiply-adds acc[k] = acc[k] * m + a over N accumulators,
 * which the compiler vectorises and keeps in registers: enough chains in
 * flight to cover the FMA latency on every pipe.  acc converges to
 * a / (1 - m) = 1, so there are neither overflows nor denormals.
 */
#define PROBE_BODY(N, MADD)                                               \
    float acc[N];                                                         \
    for (int k = 0; k < (N); k++)                                         \
        acc[k] = 0.5f + 0.001f * (float)k;                                \
    const float m = 0.999f, a = 0.001f;                                   \
    for (long it = 0; it < iters; it++)                                   \
        for (int k = 0; k < (N); k++)                                     \
            acc[k] = MADD(acc[k], m, a);                                  \
    float s = 0.0f;                                                       \
    for (int k = 0; k < (N); k++)                                         \
        s += acc[k];                                                      \
    *flops = 2.0 * (double)(N) * (double)iters;                           \
    return s;

#define PLAIN_MADD(x, y, z) ((x) * (y) + (z))

/* Portable: 48 accumulators (12 SSE registers on x86-64). */
static float probe_plain(long iters, double *flops)
{
    PROBE_BODY(48, PLAIN_MADD)
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#define HAVE_PROBE_AVX2 1
/* 96 accumulators = 12 ymm registers of FMA chains.  fmaf, because ISO C
 * mode does not contract a * b + c into one instruction. */
__attribute__((target("avx2,fma"))) static float probe_avx2(long iters,
                                                           double *flops)
{
    PROBE_BODY(96, fmaf)
}

/* 192 accumulators = 12 zmm registers: the peak of the avx512 tier. */
__attribute__((target("avx512f,avx2,fma"))) static float
probe_avx512(long iters, double *flops)
{
    PROBE_BODY(192, fmaf)
}
#endif

/* Single-thread multiply-add GFLOP/s: the best of ~0.2 s of short runs,
 * with the widest vectors the kernel tier in use has (AVX-512 for avx512,
 * else AVX2 + FMA where the CPU has them).  *kind names the loop that ran. */
double bench_fma_peak(const char **kind)
{
    float (*probe)(long, double *) = probe_plain;
    *kind = "portable C";
#ifdef HAVE_PROBE_AVX2
    __builtin_cpu_init();
    const char *tier = mha_kernel_tier();
    if (tier && !strcmp(tier, "avx512")) {
        probe = probe_avx512;
        *kind = "AVX-512";
    } else if (__builtin_cpu_supports("avx2") &&
               __builtin_cpu_supports("fma")) {
        probe = probe_avx2;
        *kind = "AVX2+FMA";
    }
#endif
    volatile float sink = 0.0f;
    double flops, t, best = 0.0;
    long iters = 1000;
    /* Calibrate: one run of at least 20 ms. */
    for (;;) {
        t = bench_now_s();
        sink += probe(iters, &flops);
        t = bench_now_s() - t;
        if (t >= 0.02 || iters > (1L << 40))
            break;
        iters *= 2;
    }
    const double start = bench_now_s();
    while (bench_now_s() - start < 0.2) {
        t = bench_now_s();
        sink += probe(iters, &flops);
        t = bench_now_s() - t;
        if (t > 0 && flops / t > best)
            best = flops / t;
    }
    (void)sink;
    return best * 1e-9;
}
