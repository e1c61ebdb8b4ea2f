/*
 * bench_decode.c -- `mha bench --decode`: one decoding step, Lq new tokens
 * of each sequence attending to Lk cached ones, timed; and how much of the
 * machine's read bandwidth it reaches, since reading the cache is what
 * bounds a step at large Lk.  The read bandwidth is measured by a probe
 * of its own, in the same run, on the same threads.  The step is the
 * module's (projections and attention, mha_plan_decode) or, with
 * --attention-only, the attention alone on the cache
 * (mha_attention_plan_decode); with --ragged the sequences hold different
 * numbers of keys.
 */
#define _DEFAULT_SOURCE   /* madvise, MADV_HUGEPAGE (Linux) */
#include "core/half.h"
#include "bench.h"
#include "fail.h"
#include "mha.h"

#ifdef __linux__
#include <sys/mman.h>
#endif

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---- the read-bandwidth probe ------------------------------------------- */

/* Floats per work item of the probe (64 KiB), a multiple of READ_LANES. */
enum { READ_BLOCK = 16384, READ_LANES = 32, READ_PASSES = 5 };

/* The bytes of one cache of cpu0 at `level` times the number of such
 * caches (online CPUs over the CPUs sharing one), or 0 if unknown. */
static int64_t cache_bytes(int level)
{
    const char *dir = "/sys/devices/system/cpu/cpu0/cache";
    for (int k = 0; k < 16; k++) {
        char path[96], unit = 0, map[1024];
        long long size = 0;
        int lv = 0;
        snprintf(path, sizeof path, "%s/index%d/level", dir, k);
        FILE *f = fopen(path, "r");
        if (!f)
            return 0;
        const int ok = fscanf(f, "%d", &lv) == 1;
        fclose(f);
        if (!ok || lv != level)
            continue;
        snprintf(path, sizeof path, "%s/index%d/size", dir, k);
        if (!(f = fopen(path, "r")))
            return 0;
        const int got = fscanf(f, "%lld%c", &size, &unit);
        fclose(f);
        if (got < 1 || size <= 0)
            return 0;
        size *= unit == 'K' ? 1024 : unit == 'M' ? 1048576 : 1;
        /* shared_cpu_map: a hex mask of the CPUs sharing this cache. */
        int sharing = 0;
        snprintf(path, sizeof path, "%s/index%d/shared_cpu_map", dir, k);
        if ((f = fopen(path, "r"))) {
            if (fgets(map, sizeof map, f))
                for (const char *c = map; *c; c++) {
                    unsigned d = *c >= '0' && *c <= '9'   ? (unsigned)(*c - '0')
                               : *c >= 'a' && *c <= 'f' ? (unsigned)(*c - 'a')
                                                            + 10u
                                                        : 0u;
                    for (; d; d >>= 1)
                        sharing += (int)(d & 1u);
                }
            fclose(f);
        }
        const int64_t cpus = bench_online_cpus();
        const int64_t copies = sharing > 0 ? (cpus + sharing - 1) / sharing
                                           : 1;
        return (int64_t)size * copies;
    }
    return 0;
}

/* The sum of n floats (a multiple of READ_LANES) over READ_LANES
 * accumulators: the compiler vectorises the inner loop, and the chains
 * are independent, so the loads are the only limit. */
static float sum_block(const float *x, int64_t n)
{
    float acc[READ_LANES] = {0};
    for (int64_t i = 0; i < n; i += READ_LANES)
        for (int k = 0; k < READ_LANES; k++)
            acc[k] += x[i + k];
    float s = 0.0f;
    for (int k = 0; k < READ_LANES; k++)
        s += acc[k];
    return s;
}

/*
 * The streaming-read probe: `threads` threads summing a buffer of
 * max(1 GiB, 4x the last-level cache), or --read-mib's size, each thread
 * its own contiguous share (OpenMP static schedule, first touched by the
 * same threads; huge pages asked for, as for a KV cache).  Kept open through the run: its
 * best of READ_PASSES passes is read_gbps, and the paired passes (below)
 * read a prefix of it between the timed steps.
 */
typedef struct read_probe {
    float *x;
    int64_t blocks;   /* of READ_BLOCK floats            */
    int64_t bytes;    /* blocks * READ_BLOCK * 4         */
    double total;     /* every pass's sum, checked at the close */
    double expected;  /* what those sums must add up to  */
} read_probe;

/* A buffer of `mib` MiB, or of the default size when `mib` is 0: 0, or
 * -1 when it cannot be allocated (p->bytes says its size). */
static int probe_open(read_probe *p, int threads, int64_t mib)
{
    int64_t want = (int64_t)1 << 30;
    const int64_t llc = cache_bytes(3);
    want = 4 * llc > want ? 4 * llc : want;
    want = mib ? mib << 20 : want;
    p->blocks = want / (READ_BLOCK * (int64_t)sizeof(float));
    p->bytes = p->blocks * READ_BLOCK * (int64_t)sizeof(float);
    p->total = p->expected = 0.0;
    p->x = malloc((size_t)p->bytes);
    if (!p->x)
        return -1;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    /* Huge pages where the kernel allows them, as libmha asks for its KV
     * caches: the bandwidth of the best streaming read, not of 4 KiB
     * pages' TLB misses.  (Only the 2 MiB-aligned interior.) */
    {
        const uintptr_t huge = (uintptr_t)2 << 20;
        const uintptr_t lo = ((uintptr_t)p->x + huge - 1) & ~(huge - 1);
        const uintptr_t hi = ((uintptr_t)p->x + (uintptr_t)p->bytes) &
                             ~(huge - 1);
        if (hi > lo)
            (void)madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    float *x = p->x;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < p->blocks; b++)
        for (int64_t i = 0; i < READ_BLOCK; i++)
            x[b * READ_BLOCK + i] = (float)(i & 7);
    return 0;
}

/* GB/s (1e9 bytes) of one pass over the first `blocks` blocks. */
static double probe_pass(read_probe *p, int threads, int64_t blocks)
{
    const float *x = p->x;
    double total = 0.0;
    const double t0 = bench_now_s();
#pragma omp parallel for num_threads(threads) schedule(static) \
    reduction(+ : total)
    for (int64_t b = 0; b < blocks; b++)
        total += sum_block(x + b * READ_BLOCK, READ_BLOCK);
    const double t = bench_now_s() - t0;
    p->total += total;
    /* Each block holds READ_BLOCK / 8 runs of 0..7, summing to 28 each,
     * exactly in float: the close checks that every pass read everything. */
    p->expected += (double)(READ_BLOCK / 8 * 28) * (double)blocks;
    return t > 0 ? (double)blocks * READ_BLOCK * sizeof(float) / t * 1e-9
                 : 0.0;
}

/* 0 if every pass read what it should have; frees the buffer. */
static int probe_close(read_probe *p)
{
    free(p->x);
    p->x = NULL;
    return p->total == p->expected ? 0 : -1;
}

/* ---- the arithmetic probe ------------------------------------------------
 *
 * What a step's arithmetic costs per cached element with memory out of
 * the way: ARITH_N elements of the cache's type (8-16 KiB: in L1), each
 * converted to float as the kernels convert it (f16 vcvtph2ps, bf16 a
 * 16-bit shift, q8 widened and times its block's scale) and multiplied-
 * and-added into `rows` accumulators (a grouped-query step's stacked
 * query rows share each converted vector), 8 / rows independent chains of
 * them: 8 FMA chains in flight, enough for two pipes' latency.  The same
 * work as the step's two products per element of K and of V; the
 * softmax is left out (at d_h 128 about 20 vector operations per 16 keys
 * and row against 256 multiply-adds).  The widest ISA of the kernel tier
 * in use, on the step's threads at once, each on its own buffer.
 */
enum { ARITH_N = 8192 };

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_ARITH_SIMD 1

#define T512 __attribute__((target("avx512f,avx2,fma,f16c"))) static inline
#define T256 __attribute__((target("avx2,fma,f16c"))) static inline
#define ALWAYS __attribute__((always_inline))

T512 ALWAYS __m512 cvt512(const int T, const void *x, const float *s, int e)
{
    switch (T) {
    case MHA_KV_F16:
        return _mm512_cvtph_ps(_mm256_loadu_si256(
            (const __m256i *)((const uint16_t *)x + e)));
    case MHA_KV_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                (const __m256i *)((const uint16_t *)x + e))),
            16));
    case MHA_KV_Q8:
        return _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                _mm_loadu_si128((const __m128i *)((const int8_t *)x + e)))),
            _mm512_set1_ps(s[e / 32]));
    case MHA_KV_Q4: {   /* element e: the kernels' nibble of a byte row */
        const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(
            (const __m128i *)((const int8_t *)x + e / 32 * 16)));
        const __m512i c = e / 16 % 2 ? _mm512_srai_epi32(b, 4)
                        : _mm512_srai_epi32(_mm512_slli_epi32(b, 28), 28);
        return _mm512_mul_ps(_mm512_cvtepi32_ps(c),
                             _mm512_set1_ps(s[e / 32]));
    }
    default: return _mm512_loadu_ps((const float *)x + e);
    }
}

T256 ALWAYS __m256 cvt256(const int T, const void *x, const float *s, int e)
{
    switch (T) {
    case MHA_KV_F16:
        return _mm256_cvtph_ps(
            _mm_loadu_si128((const __m128i *)((const uint16_t *)x + e)));
    case MHA_KV_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(
                _mm_loadu_si128((const __m128i *)((const uint16_t *)x + e))),
            16));
    case MHA_KV_Q8:
        return _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                _mm_loadl_epi64((const __m128i *)((const int8_t *)x + e)))),
            _mm256_set1_ps(s[e / 32]));
    case MHA_KV_Q4: {
        const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(
            (const __m128i *)((const int8_t *)x + e / 16 * 8)));
        const __m256i c = e / 8 % 2 ? _mm256_srai_epi32(b, 4)
                        : _mm256_srai_epi32(_mm256_slli_epi32(b, 28), 28);
        return _mm256_mul_ps(_mm256_cvtepi32_ps(c),
                             _mm256_set1_ps(s[e / 32]));
    }
    default: return _mm256_loadu_ps((const float *)x + e);
    }
}

/* `iters` passes over the ARITH_N elements; R rows, 8 / R chains. */
#define ARITH_PASSES(vec, VL, zero, set1, fma, add, cvt, store)             \
    const int CH = 8 / R;   /* (constants once inlined: registers) */     \
    vec acc[8][8];                                                          \
    for (int c = 0; c < CH; c++)                                            \
        for (int r = 0; r < R; r++)                                         \
            acc[c][r] = zero();                                             \
    /* each row its own multiplier, as each query head has: with one for  \
     * all, the compiler merged the rows' identical chains into one */      \
    vec q[8];                                                               \
    for (int r = 0; r < R; r++)                                             \
        q[r] = set1(1e-3f * (float)(r + 1));                                \
    for (long it = 0; it < iters; it++)                                     \
        for (int e = 0; e < ARITH_N; e += CH * (VL))                        \
            for (int c = 0; c < CH; c++) {                                  \
                const vec x = cvt(T, buf, s, e + c * (VL));                 \
                for (int r = 0; r < R; r++)                                 \
                    acc[c][r] = fma(q[r], x, acc[c][r]);                    \
            }                                                               \
    vec t = zero();                                                         \
    for (int c = 0; c < CH; c++)                                            \
        for (int r = 0; r < R; r++)                                         \
            t = add(t, acc[c][r]);                                          \
    float lanes[VL];                                                        \
    store(lanes, t);                                                        \
    return lanes[0];

T512 ALWAYS float arith512_r(const int T, const int R, const void *buf,
                             const float *s, long iters)
{
    ARITH_PASSES(__m512, 16, _mm512_setzero_ps, _mm512_set1_ps,
                 _mm512_fmadd_ps, _mm512_add_ps, cvt512, _mm512_storeu_ps)
}

T256 ALWAYS float arith256_r(const int T, const int R, const void *buf,
                             const float *s, long iters)
{
    ARITH_PASSES(__m256, 8, _mm256_setzero_ps, _mm256_set1_ps,
                 _mm256_fmadd_ps, _mm256_add_ps, cvt256, _mm256_storeu_ps)
}

/* Each (type, rows) its own loop, the rows' count a constant in it. */
#define ARITH_DISPATCH(fn)                                                  \
    switch (t * 16 + rows) {                                                \
    case MHA_KV_F16 * 16 + 1: return fn(MHA_KV_F16, 1, buf, s, iters);     \
    case MHA_KV_F16 * 16 + 2: return fn(MHA_KV_F16, 2, buf, s, iters);     \
    case MHA_KV_F16 * 16 + 4: return fn(MHA_KV_F16, 4, buf, s, iters);     \
    case MHA_KV_F16 * 16 + 8: return fn(MHA_KV_F16, 8, buf, s, iters);     \
    case MHA_KV_BF16 * 16 + 1: return fn(MHA_KV_BF16, 1, buf, s, iters);   \
    case MHA_KV_BF16 * 16 + 2: return fn(MHA_KV_BF16, 2, buf, s, iters);   \
    case MHA_KV_BF16 * 16 + 4: return fn(MHA_KV_BF16, 4, buf, s, iters);   \
    case MHA_KV_BF16 * 16 + 8: return fn(MHA_KV_BF16, 8, buf, s, iters);   \
    case MHA_KV_Q8 * 16 + 1: return fn(MHA_KV_Q8, 1, buf, s, iters);       \
    case MHA_KV_Q8 * 16 + 2: return fn(MHA_KV_Q8, 2, buf, s, iters);       \
    case MHA_KV_Q8 * 16 + 4: return fn(MHA_KV_Q8, 4, buf, s, iters);       \
    case MHA_KV_Q8 * 16 + 8: return fn(MHA_KV_Q8, 8, buf, s, iters);       \
    case MHA_KV_Q4 * 16 + 1: return fn(MHA_KV_Q4, 1, buf, s, iters);       \
    case MHA_KV_Q4 * 16 + 2: return fn(MHA_KV_Q4, 2, buf, s, iters);       \
    case MHA_KV_Q4 * 16 + 4: return fn(MHA_KV_Q4, 4, buf, s, iters);       \
    case MHA_KV_Q4 * 16 + 8: return fn(MHA_KV_Q4, 8, buf, s, iters);       \
    case MHA_KV_F32 * 16 + 1: return fn(MHA_KV_F32, 1, buf, s, iters);     \
    case MHA_KV_F32 * 16 + 2: return fn(MHA_KV_F32, 2, buf, s, iters);     \
    case MHA_KV_F32 * 16 + 4: return fn(MHA_KV_F32, 4, buf, s, iters);     \
    default: return fn(MHA_KV_F32, 8, buf, s, iters);                      \
    }

__attribute__((target("avx512f,avx2,fma,f16c"))) static float
arith512(int t, int rows, const void *buf, const float *s, long iters)
{
    ARITH_DISPATCH(arith512_r)
}

__attribute__((target("avx2,fma,f16c"))) static float
arith256(int t, int rows, const void *buf, const float *s, long iters)
{
    ARITH_DISPATCH(arith256_r)
}
#endif

/* q4 element e of the probe's buffer, as cvt512 lays them out. */
static int q4_plain(const void *buf, int e)
{
    const int8_t x = ((const int8_t *)buf)[e / 32 * 16 + e % 16];
    return e / 16 % 2 ? x >> 4 : (int8_t)(uint8_t)((uint8_t)x << 4) >> 4;
}

/* Portable C: one row's element at a time (the compiler may vectorise). */
static float arith_plain(int t, int rows, const void *buf, const float *s,
                         long iters)
{
    float acc[8] = {0};
    for (long it = 0; it < iters; it++)
        for (int e = 0; e < ARITH_N; e++) {
            const float x =
                t == MHA_KV_F16  ? mha_f16_to_float(((const uint16_t *)buf)[e])
              : t == MHA_KV_BF16 ? mha_bf16_to_float(((const uint16_t *)buf)[e])
              : t == MHA_KV_Q8   ? (float)((const int8_t *)buf)[e] * s[e / 32]
              : t == MHA_KV_Q4   ? (float)q4_plain(buf, e) * s[e / 32]
                                 : ((const float *)buf)[e];
            for (int r = 0; r < rows; r++)
                acc[r] += 1e-3f * x;
        }
    return acc[0];
}

/*
 * Cached elements per second (1e9) that `threads` threads convert and
 * multiply-add into `rows` accumulators (1, 2, 4 or 8), each on its own
 * buffer, the best of ~0.1 s of timed rounds; *kind names the loop.
 */
static double arith_gelems(mha_kv_dtype t, int rows, int threads,
                           const char **kind)
{
    float (*probe)(int, int, const void *, const float *, long) = arith_plain;
    *kind = "portable C";
#ifdef HAVE_ARITH_SIMD
    __builtin_cpu_init();
    const char *tier = mha_kernel_tier();
    if (tier && !strcmp(tier, "avx512")) {
        probe = arith512;
        *kind = "AVX-512";
    } else if (tier && !strcmp(tier, "avx2")) {
        probe = arith256;
        *kind = "AVX2+FMA";
    }
#endif
    /* each thread's buffer: every element 1.0 (f16 0x3C00, bf16 0x3F80,
     * q8 code 1 with scale 1) */
    const size_t bytes = (size_t)ARITH_N * 4 + ARITH_N / 32 * sizeof(float);
    char *all = malloc((size_t)threads * bytes);
    if (!all)
        return 0.0;
    for (int k = 0; k < threads; k++) {
        void *buf = all + (size_t)k * bytes;
        float *s = (float *)((char *)buf + (size_t)ARITH_N * 4);
        for (int e = 0; e < ARITH_N; e++) {
            if (t == MHA_KV_F16 || t == MHA_KV_BF16)
                ((uint16_t *)buf)[e] = t == MHA_KV_F16 ? 0x3C00 : 0x3F80;
            else if (t == MHA_KV_Q8)
                ((int8_t *)buf)[e] = 1;
            else if (t == MHA_KV_Q4)   /* codes 1 in both nibbles */
                ((int8_t *)buf)[e] = 0x11;
            else
                ((float *)buf)[e] = 1.0f;
        }
        for (int b = 0; b < ARITH_N / 32; b++)
            s[b] = 1.0f;
    }
    double best = 0.0, t0 = 0.0;
    long iters = 16;   /* shared: the master doubles it, between barriers */
    float total = 0.0f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        int k = 0;
#ifdef _OPENMP
        k = omp_get_thread_num();
#endif
        const void *buf = all + (size_t)k * bytes;
        const float *s = (const float *)((const char *)buf + (size_t)ARITH_N * 4);
        for (int round = 0; round < 12; round++) {
#pragma omp barrier
#pragma omp master
            t0 = bench_now_s();
#pragma omp barrier
            total += probe(t, rows, buf, s, iters);
#pragma omp barrier
#pragma omp master
            {
                const double dt = bench_now_s() - t0;
                const double rate = (double)threads * iters * ARITH_N / dt;
                if (dt > 0 && rate > best)
                    best = rate;
                if (dt < 0.01 && iters < (1L << 30))
                    iters *= 2;
            }
        }
    }
    free(all);
    return total == total ? best * 1e-9 : 0.0;   /* (a use of the sums) */
}

/* ---- mha bench --decode ------------------------------------------------- */

/* Bytes of one key's (or value's) d_h elements as the cache stores
 * them: q8 keeps a float scale per 32 elements beside its 8-bit codes
 * (include/mha.h). */
static double kv_row_bytes(mha_kv_dtype t, int64_t dh)
{
    return t == MHA_KV_F32 ? 4.0 * (double)dh
         : t == MHA_KV_Q8  ? (double)dh + 4.0 * (double)((dh + 31) / 32)
         : t == MHA_KV_Q4  ? (double)dh / 2 + 4.0 * (double)((dh + 31) / 32)
                           : 2.0 * (double)dh;
}

static const char *kv_dtype_name(mha_kv_dtype t)
{
    return t == MHA_KV_F32 ? "f32" : t == MHA_KV_F16 ? "f16"
         : t == MHA_KV_BF16 ? "bf16" : t == MHA_KV_Q8 ? "q8" : "q4";
}

/* What one run times, read from the options. */
typedef struct decode_bench {
    int64_t B, Lq, Lk, E, H, Hkv, dh;
    int64_t dv;        /* --v-head-dim: the values' head width (d_h)     */
    int latent;        /* --kv-latent: values the keys' first dv, stored
                          once (MLA's latent cache)                     */
    int64_t threads, repeat, warmup, ncpu;
    mha_kv_dtype dtype;
    int json, threads_default;
    int attn_only;     /* time mha_attention on the cache, no module     */
    int ragged;        /* sequence b holds round(Lk (b + 1) / B) keys    */
    int64_t page;      /* a paged cache's page size; 0: contiguous       */
    int rotate;        /* --kv-rotate: the cache's Hadamard rotation      */
    int64_t shared;    /* --shared-prefix N: every sequence's first N
                          tokens sequence 0's, forked (pages shared), the
                          step one ragged call with share_prefix      */
    int64_t read_mib;  /* --read-mib: the read probe's buffer; 0 default */
    int64_t *len;      /* (B): the keys each sequence holds before a step */
    int64_t kv_keys;   /* their sum: the cached keys one step reads      */
    int64_t all_keys;  /* the keys the step multiplies: kv_keys, and a
                          shared prefix once per sequence              */
} decode_bench;

/* What a run allocates, and the arguments of its step. */
typedef struct decode_state {
    mha_module *m;               /* the module's step; NULL attention-only */
    mha_plan *plan;
    mha_attention_plan *aplan;   /* attention only                        */
    mha_kv_cache *kv;
    float *q, *out;              /* (B, Lq, E), E = H d_h; out H d_v wide  */
    float *kv_new;               /* attention only: the step's keys
                                    (B, Lq, H_kv d_h), then values
                                    (B, Lq, H_kv d_v; none if latent)     */
    double *ms;                  /* (repeat) timings                      */
    double *pair_ms;             /* (repeat) the paired steps' timings    */
    double *pass_gbps;           /* (repeat + 1) the passes around them   */
    int64_t pass_bytes;          /* the bytes each of those passes reads  */
    double *pair_gbps, *pair_read, *pair_roof;   /* (repeat) each step's
                                    faster pass, read and roofline share  */
    mha_decode_args a;
    mha_attention_decode_args aa;
} decode_state;

/* What it measured. */
typedef struct decode_result {
    long blas_threads;
    const char *tier;
    double read_gbps;
    int64_t read_bytes;
    double median_ms, min_ms, kv_bytes, kv_gbps, read_percent, weight_bytes;
    mha_kv_cache_usage usage;   /* the cache once filled (before a step) */
    /* the roofline: the arithmetic probe's rate, the step's time at the
     * read probe's bandwidth and at that rate, the larger of the two, and
     * the share of it the step reaches */
    const char *arith_kind;
    int arith_rows;
    double arith_gelems, memory_ms, arith_ms, roofline_ms, roofline_percent;
    /* the step's multiply-adds (every query row of a group against every
     * cached element: (d_h + d_v) per key) at the FMA probe's rate: the
     * arithmetic bound where a group stacks more rows than the element
     * probe's 8 (MLA: 128 heads on one latent head) */
    const char *fma_kind;
    double fma_gflops, fma_ms;
    double elem_ms;    /* the element probe's time; arith_ms the larger */
    /* the paired steps (time_steps): medians over them of the faster
     * pass around each, of each step's read share and roofline share;
     * the last's range */
    double paired_read_gbps, paired_read_percent, paired_roofline_percent;
    double paired_roofline_lo, paired_roofline_hi, paired_median_ms;
    int64_t paired_pass_bytes;
} decode_result;

static int parse_decode(const tool_opt *o, int n, decode_bench *d)
{
#define OPT(name) tool_get(o, n, name)
    static const char *const need[] = {"kv-seq", "embed-dim", "heads"};
    if (tool_require("bench", o, n, need, 3))
        return 1;
    static const char *const excluded[] = {"backward", "need-weights"};
    for (int k = 0; k < NOPTS(excluded); k++)
        if (OPT(excluded[k]))
            return tool_fail("bench", "--decode excludes --%s", excluded[k]);
    *d = (decode_bench){.B = 1, .Lq = 1, .repeat = 10, .warmup = 2,
                        .dtype = MHA_KV_F32};
    d->ncpu = d->threads = bench_online_cpus();
    if ((OPT("batch") &&
         tool_int("bench", "batch", OPT("batch"), 1, INT32_MAX, &d->B)) ||
        (OPT("seq") &&
         tool_int("bench", "seq", OPT("seq"), 1, INT32_MAX, &d->Lq)) ||
        tool_int("bench", "kv-seq", OPT("kv-seq"), 1, INT32_MAX, &d->Lk) ||
        tool_int("bench", "embed-dim", OPT("embed-dim"), 1, INT32_MAX,
                 &d->E) ||
        tool_int("bench", "heads", OPT("heads"), 1, INT32_MAX, &d->H) ||
        (OPT("kv-heads") &&
         tool_int("bench", "kv-heads", OPT("kv-heads"), 1, INT32_MAX,
                  &d->Hkv)) ||
        (OPT("kv-dtype") &&
         tool_kv_dtype("bench", OPT("kv-dtype"), &d->dtype)) ||
        (OPT("threads") &&
         tool_int("bench", "threads", OPT("threads"), 1, 4096,
                  &d->threads)) ||
        (OPT("repeat") &&
         tool_int("bench", "repeat", OPT("repeat"), 1, 1000000,
                  &d->repeat)) ||
        (OPT("warmup") &&
         tool_int("bench", "warmup", OPT("warmup"), 0, 1000000, &d->warmup)) ||
        (OPT("page-size") &&
         tool_int("bench", "page-size", OPT("page-size"), 1, INT32_MAX,
                  &d->page)) ||
        (OPT("read-mib") &&
         tool_int("bench", "read-mib", OPT("read-mib"), 1, 1 << 20,
                  &d->read_mib)))
        return 1;
    /* a buffer that the machine cannot hold beside the cache would be
     * first touched into swap or the OOM killer, not refused by malloc */
    const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    if (d->read_mib && pages > 0 && page > 0 &&
        (double)d->read_mib * 1048576.0 > 0.5 * (double)pages * (double)page)
        return tool_fail("bench", "--read-mib %lld is more than half this "
                         "machine's %.0f MiB of memory",
                         (long long)d->read_mib,
                         (double)pages * (double)page / 1048576.0);
    d->rotate = OPT("kv-rotate") != NULL;
    d->latent = OPT("kv-latent") != NULL;
    if (OPT("v-head-dim") &&
        tool_int("bench", "v-head-dim", OPT("v-head-dim"), 1, INT32_MAX,
                 &d->dv))
        return 1;
    if ((OPT("v-head-dim") || d->latent) && !OPT("attention-only"))
        return tool_fail("bench", "--%s needs --attention-only (the module "
                         "has one head width)",
                         d->latent ? "kv-latent" : "v-head-dim");
    if (OPT("shared-prefix") &&
        tool_int("bench", "shared-prefix", OPT("shared-prefix"), 1,
                 INT32_MAX, &d->shared))
        return 1;
    if (d->shared && (!OPT("paged") || !OPT("attention-only")))
        return tool_fail("bench", "--shared-prefix needs --paged and "
                         "--attention-only");
    if (d->page && !OPT("paged"))
        return tool_fail("bench", "--page-size needs --paged");
    if (OPT("paged") && !d->page)
        d->page = 64;
    d->json = OPT("json") != NULL;
    d->threads_default = OPT("threads") == NULL;
    d->attn_only = OPT("attention-only") != NULL;
    d->ragged = OPT("ragged") != NULL;
#undef OPT
    if (d->E % d->H)
        return tool_fail("bench", "embed_dim %lld is not divisible by "
                         "num_heads %lld", (long long)d->E, (long long)d->H);
    /* The module's defaults, which mha_attention shares: d_h = E / H,
     * H_kv = H.  Whether H_kv divides H is the library's to check. */
    d->dh = d->E / d->H;
    if (!d->dv)
        d->dv = d->dh;
    if (!d->Hkv)
        d->Hkv = d->H;
    return 0;
}

/*
 * The keys each sequence holds before a step: Lk, or with --ragged
 * round(Lk (b + 1) / B), halves rounded up, so that the lengths climb
 * evenly to Lk (B = 8, Lk = 4096: 512, 1024, ..., 4096) and a step reads
 * about (B + 1) / 2B of the keys of B full sequences.  Lk (b + 1) < 2^62,
 * both factors being below 2^31.
 */
static int64_t sequence_length(const decode_bench *d, int64_t b)
{
    return d->ragged ? (d->Lk * (b + 1) + d->B / 2) / d->B : d->Lk;
}

static int sequence_lengths(decode_bench *d)
{
    d->len = malloc((size_t)d->B * sizeof *d->len);
    if (!d->len)
        return tool_fail("bench", "out of memory for %lld sequence lengths",
                         (long long)d->B);
    d->kv_keys = d->all_keys = 0;
    for (int64_t b = 0; b < d->B; b++) {
        d->len[b] = sequence_length(d, b);
        if (d->len[b] < d->shared)
            return tool_fail("bench", "--shared-prefix %lld is longer than "
                             "sequence %lld's %lld keys",
                             (long long)d->shared, (long long)b,
                             (long long)d->len[b]);
        /* (a shared prefix's whole pages are stored, and read, once; a
         * partial last page is copied by each fork's first append) */
        d->all_keys += d->len[b];
        d->kv_keys += d->len[b] - (b > 0 && d->shared
                                       ? d->shared / d->page * d->page
                                       : 0);
    }
    return 0;
}

/* Fills sequence b of kv with len[b] random keys and values, appended at
 * most 1024 tokens at a time; a paged cache (page > 0) a page's tokens at
 * a time, the sequences in turn, as a server interleaves them: no
 * sequence's pages lie side by side. */
static int prefill(mha_kv_cache *kv, const int64_t *len, int64_t B,
                   int64_t Lk, int64_t Dkv, int64_t Dvkv, int64_t page)
{
    const int64_t step = page ? page : Lk < 1024 ? Lk : 1024;
    float *k = malloc((size_t)(step * (Dkv + Dvkv)) * sizeof *k);
    if (!k)
        return tool_fail("bench", "out of memory for the cache's prefill");
    uint64_t state = 7;
    int rc = 0;
    const int64_t rounds = page ? (Lk + step - 1) / step : 1;
    for (int64_t r = 0; !rc && r < rounds; r++)
        for (int64_t b = 0; !rc && b < B; b++)
            for (int64_t t = page ? r * step : 0;
                 !rc && t < len[b] && (!page || t < (r + 1) * step);
                 t += step) {
                const int64_t n = len[b] - t < step ? len[b] - t : step;
                bench_fill_random(k, n * (Dkv + Dvkv), &state);
                if (mha_kv_cache_append(kv, b, k, Dvkv ? k + n * Dkv : NULL,
                                        n) != MHA_OK)
                    rc = tool_fail("bench", "prefill: %s", mha_last_error());
            }
    free(k);
    return rc;
}

/* The cache: room for the step's Lq tokens after the longest sequence;
 * paged, a pool of the pages the sequences fill with them. */
static int create_cache(const decode_bench *d, decode_state *s)
{
    mha_kv_cache_config kc = {d->B, d->Hkv, d->dh, d->Lk + d->Lq,
                              d->dtype, 0, d->page, 0, d->rotate, d->dv,
                              d->latent};
    for (int64_t b = 0; d->page && b < d->B; b++)
        kc.num_pages += (sequence_length(d, b) + d->Lq + d->page - 1) /
                        d->page;
    const mha_status st = mha_kv_cache_create(&kc, &s->kv);
    if (st == MHA_OK)
        return 0;
    char what[64];
    snprintf(what, sizeof what, "%s%s",
             d->latent ? "--kv-latent with --kv-dtype "
             : d->dv != d->dh ? "--v-head-dim with --kv-dtype "
                              : "--kv-dtype ",
             kv_dtype_name(d->dtype));
    return tool_fail_status("bench", st == MHA_ERR_UNSUPPORTED ? what
                                                               : "KV cache",
                            st);
}

/* The step's arguments and its plan: the module's cached forward, or with
 * attention only mha_attention on the cache (q already projected). */
static int plan_step(const decode_bench *d, decode_state *s)
{
    mha_decode_args *a = &s->a;
    a->batch = d->B;
    a->q_len = d->Lq;
    a->query = s->q;
    a->out = s->out;
    a->cache = s->kv;
    a->num_threads = (int)d->threads;
    mha_attention_decode_args *aa = &s->aa;
    aa->batch = d->B;
    aa->num_heads = d->H;
    aa->head_dim = d->dh;
    aa->q_len = d->Lq;
    aa->q = s->q;
    aa->out = s->out;
    aa->cache = s->kv;
    aa->num_threads = (int)d->threads;
    const mha_status st =
        d->attn_only ? mha_attention_plan_create_decode(aa, &s->aplan)
                     : mha_plan_create_decode(s->m, a, &s->plan);
    return st == MHA_OK ? 0 : tool_fail("bench", "%s", mha_last_error());
}

/* Everything a run needs: the sequences' lengths, the step planned, the
 * cache prefilled (untimed). */
static int setup(decode_bench *d, decode_state *s)
{
    if (!d->attn_only) {
        mha_config c = {0};
        c.embed_dim = d->E;
        c.num_heads = d->H;
        c.num_kv_heads = d->Hkv;
        c.seed = 1;
        if (mha_create(&c, &s->m) != MHA_OK)
            return tool_fail("bench", "%s", mha_last_error());
    }
    /* The lengths after the cache: a batch too large for memory is
     * refused by the cache's allocation before B lengths are written. */
    if (create_cache(d, s) || sequence_lengths(d))
        return 1;
    /* B*Lq*E fits: the cache of B*(Lk+Lq)*Hkv*d_h <= B*(Lk+Lq)*E floats
     * was allocated. */
    const int64_t Dkv = d->Hkv * d->dh, nq = d->B * d->Lq * d->E,
                  Dvkv = d->latent ? 0 : d->Hkv * d->dv,
                  nkv = d->B * d->Lq * (Dkv + Dvkv),
                  nout = d->B * d->Lq * d->H * d->dv;
    s->q = malloc((size_t)nq * sizeof *s->q);
    s->out = malloc((size_t)nout * sizeof *s->out);
    s->ms = malloc((size_t)d->repeat * sizeof *s->ms);
    s->pair_ms = malloc((size_t)d->repeat * sizeof *s->pair_ms);
    s->pass_gbps = malloc((size_t)(d->repeat + 1) * sizeof *s->pass_gbps);
    s->pair_gbps = malloc((size_t)d->repeat * sizeof *s->pair_gbps);
    s->pair_read = malloc((size_t)d->repeat * sizeof *s->pair_read);
    s->pair_roof = malloc((size_t)d->repeat * sizeof *s->pair_roof);
    s->kv_new = d->attn_only ? malloc((size_t)nkv * sizeof *s->kv_new)
                             : NULL;
    if (!s->q || !s->out || !s->ms || !s->pair_ms || !s->pass_gbps ||
        !s->pair_gbps || !s->pair_read || !s->pair_roof ||
        (d->attn_only && !s->kv_new))
        return tool_fail("bench", "out of memory for the inputs and outputs");
    uint64_t state = 1;
    bench_fill_random(s->q, nq, &state);
    if (s->kv_new)
        bench_fill_random(s->kv_new, nkv, &state);
    if (plan_step(d, s))
        return 1;
    if (!d->shared)
        return prefill(s->kv, d->len, d->B, d->Lk, Dkv, Dvkv, d->page);
    /* sequence 0's first N tokens, forked into every other sequence, then
     * each sequence's own (len[b] - N), a page at a time in turn */
    int64_t *own = malloc((size_t)d->B * sizeof *own);
    if (!own)
        return tool_fail("bench", "out of memory for the lengths");
    const int64_t first = d->shared;
    int rc = prefill(s->kv, &first, 1, first, Dkv, Dvkv, d->page);
    for (int64_t b = 1; !rc && b < d->B; b++)
        if (mha_kv_cache_fork(s->kv, 0, b) != MHA_OK)
            rc = tool_fail("bench", "fork: %s", mha_last_error());
    int64_t most = 0;
    for (int64_t b = 0; b < d->B; b++) {
        own[b] = d->len[b] - d->shared;
        most = own[b] > most ? own[b] : most;
    }
    if (!rc && most > 0)
        rc = prefill(s->kv, own, d->B, most, Dkv, Dvkv, d->page);
    free(own);
    return rc;
}

static void free_state(decode_state *s)
{
    mha_attention_plan_free(s->aplan);
    mha_plan_free(s->plan);
    free(s->ms);
    free(s->pair_ms);
    free(s->pass_gbps);
    free(s->pair_gbps);
    free(s->pair_read);
    free(s->pair_roof);
    free(s->kv_new);
    free(s->out);
    free(s->q);
    mha_kv_cache_free(s->kv);
    mha_free(s->m);
}

/* Attention only: appends each sequence's Lq new keys and values, what
 * the caller of a real step does (mha_kv_cache_append) before
 * mha_attention, as the module's step does inside its call. */
static mha_status append_new_tokens(const decode_bench *d, decode_state *s)
{
    const int64_t per_seq = d->Lq * d->Hkv * d->dh,
                  per_seq_v = d->Lq * d->Hkv * d->dv;
    const float *values = s->kv_new + d->B * per_seq;
    mha_status st = MHA_OK;
    for (int64_t b = 0; st == MHA_OK && b < d->B; b++)
        st = mha_kv_cache_append(s->kv, b, s->kv_new + b * per_seq,
                                 d->latent ? NULL : values + b * per_seq_v,
                                 d->Lq);
    return st;
}

/* One step as the bench times it: only the step's call.  Before it
 * (attention only) the new tokens are appended, after it every sequence
 * is truncated back to the keys it held, so that each step finds the same
 * cache.  With a shared prefix the step is one ragged call (no plan takes
 * q_start), each sequence's Lq rows in turn: `ragged`, set up by the
 * caller. */
static int one_step(const decode_bench *d, decode_state *s,
                    const mha_attention_decode_args *ragged, double *ms)
{
    mha_status st = d->attn_only ? append_new_tokens(d, s) : MHA_OK;
    const double t0 = bench_now_s();
    if (st == MHA_OK)
        st = d->shared ? mha_attention_decode(ragged)
             : d->attn_only ? mha_attention_plan_decode(s->aplan, &s->aa)
                            : mha_plan_decode(s->plan, &s->a);
    const double t1 = bench_now_s();
    for (int64_t b = 0; st == MHA_OK && b < d->B; b++)
        st = mha_kv_cache_truncate(s->kv, b, d->len[b]);
    if (st != MHA_OK)
        return tool_fail("bench", "%s", mha_last_error());
    *ms = (t1 - t0) * 1e3;
    return 0;
}

/* W + R steps back to back (s->ms: the R timed), then the paired steps:
 * R more, each between two passes of the read probe over as many bytes
 * as the step reads (at least 4x the L3, at most the whole
 * buffer), so that each step's share of the bandwidth is taken against
 * what the machine read just before and just after it (s->pair_ms,
 * and R + 1 s->pass_gbps).  On a shared machine whose bandwidth drifts
 * by 2x within minutes, one probe at the start judges nothing; the paired
 * shares do.  The passes also leave the step's cache out of the L3, as a
 * large cache is. */
static int time_steps(const decode_bench *d, decode_state *s, read_probe *p,
                      double step_bytes)
{
    int64_t *q_start = d->shared ? malloc((size_t)(d->B + 1) * 8) : NULL;
    if (d->shared && !q_start)
        return tool_fail("bench", "out of memory for q_start");
    mha_attention_decode_args ragged = s->aa;
    for (int64_t b = 0; q_start && b <= d->B; b++)
        q_start[b] = b * d->Lq;
    ragged.q_len = 0;
    ragged.q_start = q_start;
    ragged.share_prefix = 1;
    int rc = 0;
    for (int64_t r = 0; !rc && r < d->warmup + d->repeat; r++) {
        double ms = 0.0;
        rc = one_step(d, s, &ragged, &ms);
        if (r >= d->warmup)
            s->ms[r - d->warmup] = ms;
    }
    const int64_t llc_blocks =
        4 * cache_bytes(3) / (READ_BLOCK * (int64_t)sizeof(float));
    int64_t blocks = (int64_t)(step_bytes / (READ_BLOCK * sizeof(float)));
    blocks = blocks < llc_blocks ? llc_blocks : blocks;
    blocks = blocks < 1 ? 1 : blocks > p->blocks ? p->blocks : blocks;
    s->pass_bytes = blocks * READ_BLOCK * (int64_t)sizeof(float);
    for (int64_t r = 0; !rc && r <= d->repeat; r++) {
        s->pass_gbps[r] = probe_pass(p, (int)d->threads, blocks);
        if (r < d->repeat)
            rc = one_step(d, s, &ragged, &s->pair_ms[r]);
    }
    free(q_start);
    if (rc)
        return rc;
    double sum = 0.0;
    for (int64_t i = 0; i < d->B * d->Lq * d->H * d->dv; i++)
        sum += s->out[i];
    return isfinite(sum) ? 0 : tool_fail("bench", "the output is not finite");
}

/* The bytes a step reads (before it runs: the paired passes read as
 * many).  The cached keys and values, each K/V head once (the query
 * heads of a group share its reads; the step's own Lq tokens are not
 * counted), and the module's parameters, which its projections read once
 * per step. */
static void count_bytes(const decode_bench *d, const decode_state *s,
                        decode_result *res)
{
    res->kv_bytes = (double)d->kv_keys * (double)d->Hkv *
                    (kv_row_bytes(d->dtype, d->dh) +
                     (d->latent ? 0.0 : kv_row_bytes(d->dtype, d->dv)));
    res->weight_bytes = s->m ? (double)mha_param_numel(s->m) * sizeof(float)
                             : 0.0;
}

static void summarise(const decode_bench *d, decode_state *s,
                      decode_result *res)
{
    res->median_ms = bench_median(s->ms, d->repeat);
    res->min_ms = s->ms[0];
    res->kv_gbps = res->kv_bytes / (res->median_ms * 1e-3) * 1e-9;
    res->read_percent = 100.0 * res->kv_gbps / res->read_gbps;
    /* K and V: all_keys * Hkv * d_h elements each (a shared prefix read
     * once is still multiplied by every sequence's rows), every one converted
     * once and multiplied into each of the group's stacked rows */
    const double elems = (double)d->all_keys * (double)d->Hkv *
                         (double)(d->dh + (d->latent ? 0 : d->dv));
    const double bytes = res->kv_bytes + res->weight_bytes;
    res->memory_ms = bytes / (res->read_gbps * 1e9) * 1e3;
    res->arith_ms = res->elem_ms = elems / (res->arith_gelems * 1e9) * 1e3;
    const double flops = 2.0 * (double)d->all_keys * (double)d->H *
                         (double)d->Lq * (double)(d->dh + d->dv);
    res->fma_ms = flops / (res->fma_gflops * (double)d->threads * 1e9) * 1e3;
    if (res->fma_ms > res->arith_ms)
        res->arith_ms = res->fma_ms;
    res->roofline_ms = res->memory_ms > res->arith_ms ? res->memory_ms
                                                      : res->arith_ms;
    res->roofline_percent = 100.0 * res->roofline_ms / res->median_ms;
    /* Each paired step against the faster of the passes around it (the
     * stricter of the two): its read share and its roofline share, with
     * the arithmetic ceiling as above; the medians and the roofline
     * shares' range. */
    const double *pass = s->pass_gbps;
    for (int64_t r = 0; r < d->repeat; r++) {
        const double g = pass[r] > pass[r + 1] ? pass[r] : pass[r + 1],
                     ms = s->pair_ms[r], mem = bytes / (g * 1e9) * 1e3;
        s->pair_gbps[r] = g;
        s->pair_read[r] = 100.0 * res->kv_bytes / (ms * 1e-3) * 1e-9 / g;
        s->pair_roof[r] = 100.0 * (mem > res->arith_ms ? mem : res->arith_ms)
                          / ms;
    }
    res->paired_read_gbps = bench_median(s->pair_gbps, d->repeat);
    res->paired_read_percent = bench_median(s->pair_read, d->repeat);
    res->paired_roofline_percent = bench_median(s->pair_roof, d->repeat);
    res->paired_roofline_lo = s->pair_roof[0];   /* (sorted by the median) */
    res->paired_roofline_hi = s->pair_roof[d->repeat - 1];
    res->paired_median_ms = bench_median(s->pair_ms, d->repeat);
    res->paired_pass_bytes = s->pass_bytes;
}

static const char *json_bool(int x)
{
    return x ? "true" : "false";
}

static void print_json(const decode_bench *d, const decode_result *r)
{
    printf("{\"decode\": true, \"attention_only\": %s, \"ragged\": %s, "
           "\"batch\": %lld, \"seq\": %lld, \"kv_seq\": %lld, "
           "\"kv_keys\": %lld, \"embed_dim\": %lld, \"heads\": %lld, "
           "\"kv_heads\": %lld, \"head_dim\": %lld, "
           "\"kv_dtype\": \"%s\", \"threads\": %lld, "
           "\"threads_default\": %s, \"online_cpus\": %lld, "
           "\"blas_threads\": %ld, \"tier\": \"%s\", \"gemm\": \"%s\", "
           "\"repeat\": %lld, \"warmup\": %lld, "
           "\"median_ms\": %.6g, \"min_ms\": %.6g, "
           "\"kv_bytes\": %.0f, \"kv_gbps\": %.6g, "
           "\"read_gbps\": %.6g, \"read_percent\": %.6g, "
           "\"read_bytes\": %lld, \"weight_bytes\": %.0f, "
           "\"arith_kind\": \"%s\", \"arith_rows\": %d, "
           "\"arith_gelems\": %.6g, \"memory_ms\": %.6g, "
           "\"arith_ms\": %.6g, \"roofline_ms\": %.6g, "
           "\"roofline_percent\": %.6g, \"v_head_dim\": %lld, "
           "\"kv_latent\": %s, \"fma_gflops\": %.6g, \"elem_ms\": %.6g, "
           "\"fma_ms\": %.6g, "
           "\"page_size\": %lld, \"shared_prefix\": %lld, "
           "\"cache_bytes\": %lld, "
           "\"token_bytes\": %lld, "
           "\"paired_median_ms\": %.6g, \"paired_read_gbps\": %.6g, "
           "\"paired_read_percent\": %.6g, "
           "\"paired_roofline_percent\": %.6g, "
           "\"paired_roofline_lo\": %.6g, \"paired_roofline_hi\": %.6g, "
           "\"paired_pass_bytes\": %lld, "
           "\"library\": \"%s\"}\n",
           json_bool(d->attn_only), json_bool(d->ragged), (long long)d->B,
           (long long)d->Lq, (long long)d->Lk, (long long)d->kv_keys,
           (long long)d->E, (long long)d->H, (long long)d->Hkv,
           (long long)d->dh, kv_dtype_name(d->dtype), (long long)d->threads,
           json_bool(d->threads_default), (long long)d->ncpu,
           r->blas_threads, r->tier, mha_gemm_backend(), (long long)d->repeat,
           (long long)d->warmup, r->median_ms, r->min_ms, r->kv_bytes,
           r->kv_gbps, r->read_gbps, r->read_percent,
           (long long)r->read_bytes, r->weight_bytes, r->arith_kind,
           r->arith_rows, r->arith_gelems, r->memory_ms, r->arith_ms,
           r->roofline_ms, r->roofline_percent, (long long)d->dv,
           json_bool(d->latent), r->fma_gflops * (double)d->threads,
           r->elem_ms, r->fma_ms, (long long)d->page,
           (long long)d->shared,
           (long long)r->usage.bytes, (long long)r->usage.token_bytes,
           r->paired_median_ms, r->paired_read_gbps, r->paired_read_percent,
           r->paired_roofline_percent, r->paired_roofline_lo,
           r->paired_roofline_hi, (long long)r->paired_pass_bytes,
           mha_version_string());
}

static void print_text(const decode_bench *d, const decode_result *r)
{
    const char *s = d->threads == 1 ? "" : "s";
    printf("mha bench --decode: B=%lld Lq=%lld Lk=%lld E=%lld H=%lld "
           "H_kv=%lld d_h=%lld d_v=%lld, %s%s cache, %lld thread%s%s\n",
           (long long)d->B, (long long)d->Lq, (long long)d->Lk,
           (long long)d->E, (long long)d->H, (long long)d->Hkv,
           (long long)d->dh, (long long)d->dv, kv_dtype_name(d->dtype),
           d->latent ? " latent" : "", (long long)d->threads,
           s, d->threads_default ? " (default: the online CPUs)" : "");
    printf("  timed   %s: %lld new token%s per sequence on %s%lld cached\n",
           d->attn_only ? "mha_attention_plan_decode" : "mha_plan_decode",
           (long long)d->Lq, d->Lq == 1 ? "" : "s", d->ragged ? "up to " : "",
           (long long)d->Lk);
    if (d->attn_only)
        printf("          (attention only, on the cache: the step's K/V "
               "appended before\n           and truncated away after, "
               "untimed)\n");
    else
        printf("          (each step's tokens truncated away again, "
               "untimed)\n");
    printf("  kernels %s (mha_kernel_tier), %lld attention thread%s, "
           "GEMMs %s (mha_gemm_backend), OPENBLAS_NUM_THREADS=%s\n", r->tier,
           (long long)d->threads, s, mha_gemm_backend(), bench_blas_env() ? bench_blas_env() : "(unset)");
    printf("  time    median %.4f ms, min %.4f ms over %lld runs (after %lld "
           "warm-up)\n", r->median_ms, r->min_ms, (long long)d->repeat,
           (long long)d->warmup);
    printf("  cache   %.1f MiB of K and V per step: %.2f GB/s at the "
           "median\n", r->kv_bytes / 1048576.0, r->kv_gbps);
    if (d->ragged)
        printf("          ragged: %lld to %lld keys per sequence, %lld in "
               "all\n", (long long)d->len[0], (long long)d->Lk,
               (long long)d->kv_keys);
    if (d->shared)
        printf("  shared  every sequence's first %lld tokens one prompt's "
               "(forks: pages shared),\n          its whole pages read once: "
               "one ragged call with share_prefix\n",
               (long long)d->shared);
    if (d->page)
        printf("  pages   %lld of %lld positions: %.1f MiB held for %.1f "
               "MiB of tokens (%.4fx)\n", (long long)r->usage.pages_used,
               (long long)d->page, r->usage.bytes / 1048576.0,
               r->usage.token_bytes / 1048576.0,
               (double)r->usage.bytes / (double)r->usage.token_bytes);
    else
        printf("  cache   contiguous: %.1f MiB held for %.1f MiB of tokens "
               "(%.4fx)\n", r->usage.bytes / 1048576.0,
               r->usage.token_bytes / 1048576.0,
               (double)r->usage.bytes / (double)r->usage.token_bytes);
    if (d->attn_only)
        printf("  weights none read: q and the new K/V come projected\n");
    else
        printf("  weights %.1f MiB of parameters, read by the projections "
               "in the same time\n", r->weight_bytes / 1048576.0);
    printf("  memory  %.2f GB/s streaming read (%lld MiB, %lld thread%s, "
           "best of %d): the step reaches %.1f%%\n", r->read_gbps,
           (long long)(r->read_bytes >> 20), (long long)d->threads, s,
           READ_PASSES, r->read_percent);
    printf("  arith   %.2f G cached elements/s converted and multiplied into "
           "%d row%s (%s, %lld thread%s,\n          in L1): the step's K and "
           "V in %.3f ms\n",
           r->arith_gelems, r->arith_rows, r->arith_rows == 1 ? "" : "s",
           r->arith_kind, (long long)d->threads, s, r->elem_ms);
    printf("  fma     %.1f GFLOP/s (%s multiply-add probe, %lld thread%s): "
           "the step's multiply-adds\n          (%lld query row%s a K/V "
           "head, d_h %lld + d_v %lld a key) in %.3f ms\n",
           r->fma_gflops * (double)d->threads, r->fma_kind,
           (long long)d->threads, s, (long long)(d->H / d->Hkv * d->Lq),
           d->H / d->Hkv * d->Lq == 1 ? "" : "s", (long long)d->dh,
           (long long)d->dv, r->fma_ms);
    printf("  roofline max(memory %.3f ms, arithmetic %.3f ms) = %.3f ms: "
           "the step reaches %.1f%%\n", r->memory_ms, r->arith_ms,
           r->roofline_ms, r->roofline_percent);
    printf("  paired  %lld more steps, each between two read passes of %.1f "
           "MiB (its bytes, at\n          least 4x the L3, at most the "
           "probe's): median %.4f ms, the faster\n          pass around "
           "each %.2f GB/s: read %.1f%%, roofline %.1f%% (%.1f-%.1f)\n",
           (long long)d->repeat, (double)r->paired_pass_bytes / 1048576.0,
           r->paired_median_ms, r->paired_read_gbps,
           r->paired_read_percent, r->paired_roofline_percent,
           r->paired_roofline_lo, r->paired_roofline_hi);
}

int bench_decode(int argc, char **argv, const tool_opt *o, int n)
{
    decode_bench d = {0};
    decode_result res = {0};
    if (parse_decode(o, n, &d) ||
        bench_setup(argc, argv, d.threads, d.ncpu, d.json, &res.blas_threads,
                    &res.tier))
        return 1;
    decode_state s = {0};
    int rc = setup(&d, &s);
    if (!rc && mha_kv_cache_get_usage(s.kv, &res.usage) != MHA_OK)
        rc = tool_fail("bench", "%s", mha_last_error());
#ifndef __OPTIMIZE__
    if (!rc)
        fprintf(stderr, "mha bench: warning: this mha was built without "
                "optimisation; the read probe and the timings mean little\n");
#endif
    read_probe probe = {0};
    if (!rc && probe_open(&probe, (int)d.threads, d.read_mib))
        rc = tool_fail("bench", "out of memory for the read probe's %lld MiB",
                       (long long)(probe.bytes >> 20));
    for (int pass = 0; !rc && pass < READ_PASSES; pass++) {
        const double g = probe_pass(&probe, (int)d.threads, probe.blocks);
        res.read_gbps = g > res.read_gbps ? g : res.read_gbps;
    }
    res.read_bytes = probe.bytes;
    if (!rc) {
        /* the group's stacked rows per converted element: (H / Hkv) Lq,
         * as a power of two up to 8 (the probe's loops) */
        const int64_t g = d.H / d.Hkv * d.Lq;
        res.arith_rows = g >= 8 ? 8 : g >= 4 ? 4 : g >= 2 ? 2 : 1;
        res.arith_gelems = arith_gelems(d.dtype, res.arith_rows,
                                        (int)d.threads, &res.arith_kind);
        if (!(res.arith_gelems > 0.0))
            rc = tool_fail("bench", "the arithmetic probe failed (out of "
                           "memory?)");
        res.fma_gflops = rc ? 0.0 : bench_fma_peak(&res.fma_kind);
        if (!rc && !(res.fma_gflops > 0.0))
            rc = tool_fail("bench", "the FMA probe failed");
    }
    if (!rc) {
        count_bytes(&d, &s, &res);
        rc = time_steps(&d, &s, &probe, res.kv_bytes + res.weight_bytes);
    }
    if (probe_close(&probe) && !rc)
        rc = tool_fail("bench", "the read probe's sums are wrong: a pass "
                       "did not read its whole buffer");
    if (!rc && !(res.read_gbps > 0.0))
        rc = tool_fail("bench", "the read probe timed no pass");
    if (!rc) {
        summarise(&d, &s, &res);
        if (d.json)
            print_json(&d, &res);
        else
            print_text(&d, &res);
    }
    free_state(&s);
    free(d.len);
    return rc;
}
