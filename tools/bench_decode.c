/*
 * bench_decode.c -- `mha bench --decode`: one decoding step, Lq new tokens
 * of each sequence attending to Lk cached ones, timed; and how much of the
 * machine's read bandwidth it reaches, since reading the cache is what
 * bounds a step at large Lk.  The read bandwidth is measured by a probe
 * of its own, in the same run, on the same threads.
 */
#include "bench.h"
#include "fail.h"
#include "mha.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
 * Streaming-read GB/s (1e9 bytes) of `threads` threads summing a buffer
 * of max(1 GiB, 4x the last-level cache), each thread its own contiguous
 * share (OpenMP static schedule, first touched by the same threads): the
 * best of READ_PASSES passes.  *bytes receives the buffer's size; 0 is
 * returned if it cannot be allocated.
 */
static double read_gbps(int threads, int64_t *bytes)
{
    int64_t want = (int64_t)1 << 30;
    const int64_t llc = cache_bytes(3);
    want = 4 * llc > want ? 4 * llc : want;
    const int64_t blocks = want / (READ_BLOCK * (int64_t)sizeof(float));
    *bytes = blocks * READ_BLOCK * (int64_t)sizeof(float);
    float *x = malloc((size_t)*bytes);
    if (!x)
        return 0.0;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t i = 0; i < READ_BLOCK; i++)
            x[b * READ_BLOCK + i] = (float)(i & 7);
    double best = 0.0, total = 0.0;
    for (int pass = 0; pass < READ_PASSES; pass++) {
        const double t0 = bench_now_s();
#pragma omp parallel for num_threads(threads) schedule(static) \
    reduction(+ : total)
        for (int64_t b = 0; b < blocks; b++)
            total += sum_block(x + b * READ_BLOCK, READ_BLOCK);
        const double t = bench_now_s() - t0;
        if (t > 0 && (double)*bytes / t > best)
            best = (double)*bytes / t;
    }
    free(x);
    /* Each block holds READ_BLOCK / 8 runs of 0..7, summing to 28 each,
     * exactly in float: a check that every pass read everything. */
    if (total != (double)(READ_BLOCK / 8 * 28) * (double)blocks * READ_PASSES)
        return 0.0;
    return best * 1e-9;
}

/* ---- mha bench --decode ------------------------------------------------- */

/* Bytes per cached element of each dtype. */
static double kv_elem_bytes(mha_kv_dtype t)
{
    return t == MHA_KV_F32 ? 4.0 : t == MHA_KV_Q8 ? 1.0 : 2.0;
}

static const char *kv_dtype_name(mha_kv_dtype t)
{
    return t == MHA_KV_F32 ? "f32" : t == MHA_KV_F16 ? "f16"
         : t == MHA_KV_BF16 ? "bf16" : "q8";
}

/* Fills every sequence of kv with Lk random keys and values, appended
 * 1024 tokens at a time. */
static int prefill(mha_kv_cache *kv, int64_t B, int64_t Lk, int64_t Dkv)
{
    const int64_t step = Lk < 1024 ? Lk : 1024;
    float *k = malloc((size_t)(2 * step * Dkv) * sizeof *k);
    if (!k)
        return tool_fail("bench", "out of memory for the cache's prefill");
    uint64_t state = 7;
    int rc = 0;
    for (int64_t b = 0; !rc && b < B; b++)
        for (int64_t t = 0; !rc && t < Lk; t += step) {
            const int64_t n = Lk - t < step ? Lk - t : step;
            bench_fill_random(k, 2 * n * Dkv, &state);
            if (mha_kv_cache_append(kv, b, k, k + n * Dkv, n) != MHA_OK)
                rc = tool_fail("bench", "prefill: %s", mha_last_error());
        }
    free(k);
    return rc;
}

int bench_decode(int argc, char **argv, const tool_opt *o, int n)
{
#define OPT(name) tool_get(o, n, name)
    static const char *const need[] = {"kv-seq", "embed-dim", "heads"};
    if (tool_require("bench", o, n, need, 3))
        return 1;
    static const char *const excluded[] = {"attention-only", "backward",
                                           "need-weights"};
    for (int k = 0; k < NOPTS(excluded); k++)
        if (OPT(excluded[k]))
            return tool_fail("bench", "--decode excludes --%s", excluded[k]);
    const int64_t ncpu = bench_online_cpus();
    int64_t B = 1, Lq = 1, Lk, threads = ncpu, repeat = 10, warmup = 2;
    mha_config c = {0};
    mha_kv_dtype dtype = MHA_KV_F32;
    if ((OPT("batch") &&
         tool_int("bench", "batch", OPT("batch"), 1, INT32_MAX, &B)) ||
        (OPT("seq") && tool_int("bench", "seq", OPT("seq"), 1, INT32_MAX,
                                &Lq)) ||
        tool_int("bench", "kv-seq", OPT("kv-seq"), 1, INT32_MAX, &Lk) ||
        tool_int("bench", "embed-dim", OPT("embed-dim"), 1, INT32_MAX,
                 &c.embed_dim) ||
        tool_int("bench", "heads", OPT("heads"), 1, INT32_MAX,
                 &c.num_heads) ||
        (OPT("kv-heads") &&
         tool_int("bench", "kv-heads", OPT("kv-heads"), 1, INT32_MAX,
                  &c.num_kv_heads)) ||
        (OPT("kv-dtype") && tool_kv_dtype("bench", OPT("kv-dtype"), &dtype)) ||
        (OPT("threads") &&
         tool_int("bench", "threads", OPT("threads"), 1, 4096, &threads)) ||
        (OPT("repeat") &&
         tool_int("bench", "repeat", OPT("repeat"), 1, 1000000, &repeat)) ||
        (OPT("warmup") &&
         tool_int("bench", "warmup", OPT("warmup"), 0, 1000000, &warmup)))
        return 1;
    const int json = OPT("json") != NULL,
              threads_default = OPT("threads") == NULL;
    if (c.embed_dim % c.num_heads)
        return tool_fail("bench", "embed_dim %lld is not divisible by "
                         "num_heads %lld", (long long)c.embed_dim,
                         (long long)c.num_heads);
    long blas_threads;
    const char *tier;
    if (bench_setup(argc, argv, threads, ncpu, json, &blas_threads, &tier))
        return 1;

    mha_module *m = NULL;
    c.seed = 1;
    if (mha_create(&c, &m) != MHA_OK)
        return tool_fail("bench", "%s", mha_last_error());
    mha_get_config(m, &c);   /* num_kv_heads and head_dim resolved */
    const int64_t E = c.embed_dim, H = c.num_heads, Hkv = c.num_kv_heads,
                  dh = c.head_dim;
    mha_kv_cache *kv = NULL;
    const mha_kv_cache_config kc = {B, Hkv, dh, Lk + Lq, dtype};
    mha_status st = mha_kv_cache_create(&kc, &kv);
    int rc = 0;
    if (st != MHA_OK) {
        char what[64];
        snprintf(what, sizeof what, "--kv-dtype %s", kv_dtype_name(dtype));
        rc = tool_fail_status("bench", what, st);
    }
    if (!rc)
        rc = prefill(kv, B, Lk, Hkv * dh);
    /* B*Lq*E fits: the cache of B*(Lk+Lq)*Hkv*d_h <= B*(Lk+Lq)*E floats
     * was allocated. */
    const size_t nq = (size_t)(B * Lq * E);
    float *q = rc ? NULL : malloc(nq * sizeof *q);
    float *out = rc ? NULL : malloc(nq * sizeof *out);
    double *ms = rc ? NULL : malloc((size_t)repeat * sizeof *ms);
    if (!rc && (!q || !out || !ms))
        rc = tool_fail("bench", "out of memory for the inputs and outputs");
    uint64_t state = 1;
    if (!rc)
        bench_fill_random(q, (int64_t)nq, &state);
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = Lq;
    a.query = q;
    a.out = out;
    a.cache = kv;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a.num_threads = (int)threads;
    mha_plan *plan = NULL;
    if (!rc && mha_plan_create(m, &a, &plan) != MHA_OK)
        rc = tool_fail("bench", "%s", mha_last_error());

#ifndef __OPTIMIZE__
    if (!rc)
        fprintf(stderr, "mha bench: warning: this mha was built without "
                "optimisation; the read probe and the timings mean little\n");
#endif
    int64_t read_bytes = 0;
    const double rgbps = rc ? 0.0 : read_gbps((int)threads, &read_bytes);
    if (!rc && !(rgbps > 0.0))
        rc = tool_fail("bench", "the read-bandwidth probe failed (out of "
                       "memory for %lld MiB?)",
                       (long long)(read_bytes >> 20));
    for (int64_t r = 0; !rc && r < warmup + repeat; r++) {
        const double t0 = bench_now_s();
        st = mha_plan_forward(plan, &a);
        const double t1 = bench_now_s();
        /* Untimed: every sequence back to Lk cached tokens. */
        for (int64_t b = 0; st == MHA_OK && b < B; b++)
            st = mha_kv_cache_truncate(kv, b, Lk);
        if (st != MHA_OK)
            rc = tool_fail("bench", "%s", mha_last_error());
        else if (r >= warmup)
            ms[r - warmup] = (t1 - t0) * 1e3;
    }
    if (!rc) {
        double sum = 0.0;
        for (size_t i = 0; i < nq; i++)
            sum += out[i];
        if (!isfinite(sum))
            rc = tool_fail("bench", "the output is not finite");
    }
    if (!rc) {
        const double med = bench_median(ms, repeat), mn = ms[0];
        const double kv_bytes = (double)B * (double)Lk * (double)Hkv *
                                (double)dh * 2.0 * kv_elem_bytes(dtype);
        const double kv_gbps = kv_bytes / (med * 1e-3) * 1e-9;
        const double pct = 100.0 * kv_gbps / rgbps;
        /* The projections read every parameter once per step as well. */
        const double w_bytes = (double)mha_param_numel(m) * sizeof(float);
        if (json) {
            printf("{\"decode\": true, \"batch\": %lld, \"seq\": %lld, "
                   "\"kv_seq\": %lld, \"embed_dim\": %lld, \"heads\": %lld, "
                   "\"kv_heads\": %lld, \"head_dim\": %lld, "
                   "\"kv_dtype\": \"%s\", \"threads\": %lld, "
                   "\"threads_default\": %s, \"online_cpus\": %lld, "
                   "\"blas_threads\": %ld, \"tier\": \"%s\", "
                   "\"repeat\": %lld, \"warmup\": %lld, "
                   "\"median_ms\": %.6g, \"min_ms\": %.6g, "
                   "\"kv_bytes\": %.0f, \"kv_gbps\": %.6g, "
                   "\"read_gbps\": %.6g, \"read_percent\": %.6g, "
                   "\"read_bytes\": %lld, \"weight_bytes\": %.0f, "
                   "\"library\": \"%s\"}\n",
                   (long long)B, (long long)Lq, (long long)Lk, (long long)E,
                   (long long)H, (long long)Hkv, (long long)dh,
                   kv_dtype_name(dtype), (long long)threads,
                   threads_default ? "true" : "false", (long long)ncpu,
                   blas_threads, tier, (long long)repeat, (long long)warmup,
                   med, mn, kv_bytes, kv_gbps, rgbps, pct,
                   (long long)read_bytes, w_bytes, mha_version_string());
        } else {
            printf("mha bench --decode: B=%lld Lq=%lld Lk=%lld E=%lld "
                   "H=%lld H_kv=%lld d_h=%lld, %s cache, %lld thread%s%s\n",
                   (long long)B, (long long)Lq, (long long)Lk, (long long)E,
                   (long long)H, (long long)Hkv, (long long)dh,
                   kv_dtype_name(dtype), (long long)threads,
                   threads == 1 ? "" : "s",
                   threads_default ? " (default: the online CPUs)" : "");
            printf("  timed   mha_plan_forward: %lld new token%s per "
                   "sequence on %lld cached\n"
                   "          (each step's tokens truncated away again, "
                   "untimed)\n", (long long)Lq, Lq == 1 ? "" : "s",
                   (long long)Lk);
            printf("  kernels %s (mha_kernel_tier), %lld attention "
                   "thread%s, OPENBLAS_NUM_THREADS=%s\n", tier,
                   (long long)threads, threads == 1 ? "" : "s",
                   bench_blas_env() ? bench_blas_env() : "(unset)");
            printf("  time    median %.4f ms, min %.4f ms over %lld runs "
                   "(after %lld warm-up)\n", med, mn, (long long)repeat,
                   (long long)warmup);
            printf("  cache   %.1f MiB of K and V per step: %.2f GB/s at "
                   "the median\n", kv_bytes / 1048576.0, kv_gbps);
            printf("  weights %.1f MiB of parameters, read by the "
                   "projections in the same time\n", w_bytes / 1048576.0);
            printf("  memory  %.2f GB/s streaming read (%lld MiB, %lld "
                   "thread%s, best of %d): the step reaches %.1f%%\n", rgbps,
                   (long long)(read_bytes >> 20), (long long)threads,
                   threads == 1 ? "" : "s", READ_PASSES, pct);
        }
    }
#undef OPT
    mha_plan_free(plan);
    free(ms);
    free(out);
    free(q);
    mha_kv_cache_free(kv);
    mha_free(m);
    return rc;
}
