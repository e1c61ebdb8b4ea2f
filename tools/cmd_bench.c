/*
 * cmd_bench.c -- `mha bench`: times a planned forward pass (mha_plan_forward),
 * with --backward a planned forward + backward (mha_plan_backward), or,
 * with --attention-only, mha_attention on pre-projected heads, on random
 * inputs, and reports milliseconds, GFLOP/s, the share of the
 * machine's FMA peak (measured by a built-in probe) and the kernel tier.
 * --decode (one decoding step on a KV cache) is bench_decode.c's.
 */
#include "core/half.h"
#include "args.h"
#include "bench.h"
#include "commands.h"
#include "fail.h"
#include "mha.h"
#include "run_setup.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char BENCH_HELP[] =
    "usage: mha bench --batch B --seq L [--kv-seq Lk] --embed-dim E --heads H\n"
    "                 [--causal] [--need-weights]\n"
    "                 [--attention-only] [--backward]\n"
    "                 [--threads T] [--repeat R] [--warmup W] [--json]\n"
    MOD_USAGE MOD_WINDOW_USAGE " [--sinks]\n"
    "       mha bench --decode --kv-seq Lk --embed-dim E --heads H\n"
    "                 [--kv-heads Hkv] [--kv-dtype f32|f16|bf16|q8|q4] [--kv-rotate]\n"
    "                 [--v-head-dim Dv [--kv-latent]]\n"
    "                 [--batch B] [--seq L] [--ragged] [--attention-only]\n"
    "                 [--paged [--page-size P] [--shared-prefix N]]\n"
    "                 [--threads T] [--repeat R] [--warmup W] [--read-mib M]\n"
    "                 [--json]\n"
    "\n"
    "Times the forward pass of a module with Xavier-initialised weights\n"
    "(seed 1) on random inputs in [-1, 1): the plan is made once\n"
    "(mha_plan_create), then W warm-up and R timed calls of\n"
    "mha_plan_forward, which allocates nothing (CLOCK_MONOTONIC).  Prints\n"
    "the median and minimum time, GFLOP/s at the median, the share of the\n"
    "FMA peak measured by a built-in probe, and the attention kernel tier.\n"
    "  --batch B, --seq L    query shape (B, L, E)\n"
    "  --kv-seq Lk           cross-attention: key = value = another random\n"
    "                        (B, Lk, E) tensor; default self-attention\n"
    "  --embed-dim E, --heads H   the module (H must divide E; d_h = E/H)\n"
    "  --causal              query i sees keys j <= i + Lk - L (bottom right)\n"
    "  --need-weights        also write the head-averaged weights (B, L, Lk)\n"
    "  --attention-only      time mha_attention alone on random q (B, L, E)\n"
    "                        and k, v (B, Lk, E), already projected: H heads\n"
    "                        of d_h = E/H side by side; no module, no\n"
    "                        projections (mha_attention allocates its\n"
    "                        workspace on each call: row stats, K and V\n"
    "                        packed by tile, per-thread tiles)\n"
    "  --dtype f32|bf16|f16  with --attention-only: q, k, v and out (and\n"
    "                        with --backward dL/d out and the gradients:\n"
    "                        a 16-bit plan's run and its backward16, on the\n"
    "                        forward it kept) in that\n"
    "                        type (rounded once, untimed); without it the\n"
    "                        module's forward on 16-bit query, key and out\n"
    "                        (with --backward mha_plan_backward too: 16-bit\n"
    "                        gradients of the data, float32 of the\n"
    "                        parameters); bf16 runs on AMX\n"
    "                        tiles or AVX512-BF16 where the CPU has them\n"
    "                        (mha_bf16_kernel; MHA_BF16 caps it), otherwise\n"
    "                        widened\n"
    "  --backward            time a training step's work: each timed call is\n"
    "                        mha_plan_forward then mha_plan_backward, with\n"
    "                        a random dL/d output and every gradient asked\n"
    "                        for (the inputs' and the parameters'); the\n"
    "                        plan's first backward allocates its workspace\n"
    "                        (in the warm-up unless --warmup 0).  With\n"
    "                        --attention-only: mha_attention_plan_run then\n"
    "                        mha_attention_plan_backward (dq, dk, dv) on a\n"
    "                        plan made once, each half timed on its own\n"
    "                        too (JSON: forward_ms, backward_ms and the\n"
    "                        backward's backward_gflops, backward_percent)\n"
    "  --threads T           threads for the attention and the projections'\n"
    "                        GEMM blocks (num_threads = T); default: the\n"
    "                        number of online CPUs\n"
    "  --repeat R            timed passes (default 10)\n"
    "  --warmup W            untimed passes first (default 2)\n"
    "  --json                one JSON object instead of the text report\n"
    "The score modifiers (not with --decode) go to the module's config, or\n"
    "with --attention-only to mha_attention's mods:\n"
    MOD_HELP MOD_WINDOW_HELP
    "  --sinks               a sink logit per head (the module's `sinks`\n"
    "                        parameter, 0 at create; with --attention-only\n"
    "                        H values of 0.5)\n"
    "FLOPs counted (one multiply-add = 2): the projections\n"
    "2*B*L*E*E (Q) + 2*B*Lk*E*(kdim+vdim) (K, V) + 2*B*L*E*E (out), none\n"
    "with --attention-only, and the attention 4*d_h per allowed\n"
    "(query, key) pair of each batch and head: 4*B*H*L*Lk*d_h, or with\n"
    "--causal the exact count of allowed pairs (about half).  Softmax,\n"
    "bias and weight averaging are not counted.  --backward adds the\n"
    "backward's: 2x the projections' (dL/dx and dL/dW, each a matmul of\n"
    "the forward's size) and 2.5x the attention's, 10*d_h per allowed\n"
    "pair (Q K^T recomputed, dV, dP, dQ, dK): 3x projections + 3.5x\n"
    "attention in all.\n"
    "The peak is a single-thread multiply-add loop (AVX-512 with the\n"
    "avx512 kernel tier, else AVX2+FMA when the CPU has them, else plain\n"
    "C) times T.  mha bench also sets OPENBLAS_NUM_THREADS and\n"
    "OMP_NUM_THREADS to T and re-executes itself when they differ (libmha\n"
    "runs each BLAS call on one thread: they change no result).\n"
    "\n"
    "--decode times one decoding step: a module of E, H and Hkv K/V heads\n"
    "(grouped-query when Hkv < H; default Hkv = H), a KV cache of\n"
    "Lk + Lq tokens per sequence filled (untimed) with Lk random keys and\n"
    "values, then W + R calls of mha_plan_decode on Lq new tokens of each\n"
    "of B sequences (default B = 1, Lq = 1), each followed (untimed) by\n"
    "mha_kv_cache_truncate back to the keys it held, so every step finds\n"
    "the same cache: Lk keys in each sequence unless --ragged.\n"
    "  --ragged              sequence b (from 0) of B holds round(Lk*(b+1)/B)\n"
    "                        cached keys (halves up): the longest Lk, the\n"
    "                        others evenly shorter (B = 8, Lk = 4096: 512,\n"
    "                        1024, ..., 4096); kv_keys is their sum, and\n"
    "                        the JSON says \"ragged\": true\n"
    "  --paged               a paged cache (mha_kv_cache_config.page_size):\n"
    "                        pages of P positions (--page-size P: 16, 32\n"
    "                        or a multiple of 64; default 64), a pool of\n"
    "                        just the pages the sequences and the step's\n"
    "                        tokens fill, filled a page at a time, the\n"
    "                        sequences in turn (as a server interleaves\n"
    "                        them: no sequence's pages side by side); it\n"
    "                        reports the bytes the pages hold against the\n"
    "                        bytes of the tokens stored (JSON: page_size,\n"
    "                        cache_bytes, token_bytes)\n"
    "  --shared-prefix N     with --paged --attention-only: every sequence's\n"
    "                        first N tokens are one prompt's (sequence 0's,\n"
    "                        forked into the others: pages shared), and the\n"
    "                        step is one ragged call (mha_attention_decode\n"
    "                        with q_start and share_prefix: the prefix read\n"
    "                        once); kv_keys counts its whole pages once\n"
    "  --attention-only      time the attention of the step alone,\n"
    "                        mha_attention_plan_decode on the cache, random\n"
    "                        q (B, Lq, H*d_h) already projected: no module,\n"
    "                        no projections (weight_bytes 0).  As a caller\n"
    "                        decoding on heads does, each step's Lq new\n"
    "                        keys and values are appended to the cache\n"
    "                        (mha_kv_cache_append) before the call and\n"
    "                        truncated away after it, both untimed; the\n"
    "                        queries attend causally (bottom right) to the\n"
    "                        cached keys and the new ones, as in the\n"
    "                        module's step (JSON: \"attention_only\": true)\n"
    "At large Lk a step is bound by memory reads: it reports kv_keys, the\n"
    "cached keys of all sequences (B*Lk, or the ragged lengths' sum),\n"
    "kv_bytes, the bytes of K and V they hold, each K/V head once\n"
    "(kv_keys*Hkv*d_h*2 x 4 for f32; the step's own Lq new tokens are not\n"
    "counted), kv_gbps = kv_bytes / the median time, and read_percent,\n"
    "that as a share of read_gbps, the machine's streaming-read bandwidth\n"
    "measured in the same run (T threads summing a buffer of max(1 GiB,\n"
    "4x the L3), best of 5; --read-mib M: a buffer of M MiB, at most half\n"
    "the memory, quicker, but one under 4x the L3 reads partly from the\n"
    "cache and its GB/s are not the memory's; JSON: read_bytes).  Its\n"
    "arithmetic ceiling: arith_gelems, the\n"
    "cached elements per second (1e9) that the same threads convert from\n"
    "the cache's type and multiply-add into the (H/Hkv)*Lq stacked rows\n"
    "(as a power of two up to 8), on 8-16 KiB in L1 with the kernel\n"
    "tier's widest vectors (no softmax); memory_ms = (kv_bytes +\n"
    "weight_bytes, the module's parameters; 0 with --attention-only) /\n"
    "read_gbps,\n"
    "elem_ms = the step's kv_keys*Hkv*(d_h + d_v) elements at that rate,\n"
    "fma_ms = its 2*kv_keys*H*Lq*(d_h + d_v) flops at the FMA probe's\n"
    "fma_gflops (the bound where a K/V head's group stacks many rows:\n"
    "MLA's 128 heads on one latent head), arith_ms the larger of the two,\n"
    "roofline_ms the larger of memory_ms and arith_ms, and\n"
    "roofline_percent = roofline_ms / the median time: the share of the\n"
    "roofline the step reaches.  On a shared machine the bandwidth drifts\n"
    "between one minute and the next, so one probe judges little: R more\n"
    "steps are each timed between two passes of the read probe over as\n"
    "many bytes as the step reads (at least 4x the L3, at most the probe's\n"
    "buffer: paired_pass_bytes), and each is taken\n"
    "against the faster pass around it: paired_median_ms, the median of\n"
    "those passes' GB/s (paired_read_gbps), of the steps' read shares\n"
    "(paired_read_percent) and of their roofline shares\n"
    "(paired_roofline_percent, from paired_roofline_lo to _hi).  The\n"
    "passes also push the cache out of the L3 before each paired step.\n"
    "Without --attention-only the time includes the projections of the Lq\n"
    "new tokens (q, k, v, out), which read every parameter once:\n"
    "weight_bytes, small next to the cache only when kv_keys*Hkv*d_h*2 is\n"
    "well above E*(2E + 2*Hkv*d_h) (at E = 4096, Hkv = 8, Lk = 32768: 160\n"
    "MiB of weights, 256 MiB of cache).  --kv-dtype f16, bf16, q8 or q4:\n"
    "the cache stored so (q8: 1.125 bytes an element with its scales, q4\n"
    "0.625); --kv-rotate: its Hadamard rotation (the queries and outputs\n"
    "turned too).  With --attention-only, --v-head-dim Dv: values (and\n"
    "the output) of Dv per head, keys of d_h; --kv-latent: the values\n"
    "are the keys' first Dv, stored once (MLA's latent cache; DeepSeek-V3:\n"
    "--embed-dim 73728 --heads 128 --kv-heads 1 --v-head-dim 512).\n";

/* ---- work counts -------------------------------------------------------- */

/* (query, key) pairs that attention computes, per (batch, head): row i
 * (at position i + Lk - Lq) sees keys lo .. hi, causal bottom-right, the
 * window (m, when on) and the chunks (chunk > 0) bounding them, clamped
 * to [0, Lk). */
static double allowed_pairs(int64_t Lq, int64_t Lk, int causal,
                            const mha_modifiers *m, int64_t chunk)
{
    double n = 0.0;
    for (int64_t i = 0; i < Lq; i++) {
        const int64_t pos = i + Lk - Lq;
        int64_t lo = 0, hi = Lk - 1;
        if (causal && pos < hi)
            hi = pos;
        if (m->window && m->window_left >= 0 && pos - m->window_left > lo)
            lo = pos - m->window_left;
        if (m->window && m->window_right >= 0 && pos + m->window_right < hi)
            hi = pos + m->window_right;
        if (chunk && pos >= 0) {
            lo = pos / chunk * chunk > lo ? pos / chunk * chunk : lo;
            hi = pos / chunk * chunk + chunk - 1 < hi
                     ? pos / chunk * chunk + chunk - 1 : hi;
        } else if (chunk) {
            hi = -1;   /* (a chunk of negative positions holds no key) */
        }
        n += (double)(hi >= lo ? hi - lo + 1 : 0);
    }
    return n;
}

/* a * b * c as a size_t count of floats, or 0 if it does not fit. */
static size_t count3(int64_t a, int64_t b, int64_t c)
{
    const int64_t lim = (int64_t)(SIZE_MAX / sizeof(float) / 2 < INT64_MAX / 2
                                      ? SIZE_MAX / sizeof(float) / 2
                                      : INT64_MAX / 2);
    if (a > lim / b || a * b > lim / c)
        return 0;
    return (size_t)(a * b * c);
}

/* ---- mha bench ---------------------------------------------------------- */

int cmd_bench(int argc, char **argv)
{
    /* across the ranks of an MPI job: --ring, or --ulysses alone */
    for (int k = 1; k < argc; k++)
        if (!strcmp(argv[k], "--ring") || !strcmp(argv[k], "--ulysses"))
            return cmd_bench_ring(argc, argv);
    tool_opt o[] = {{"batch", 1, 0}, {"seq", 1, 0}, {"kv-seq", 1, 0},
                    {"embed-dim", 1, 0}, {"heads", 1, 0}, {"causal", 0, 0},
                    {"need-weights", 0, 0}, {"attention-only", 0, 0},
                    {"backward", 0, 0}, {"threads", 1, 0}, {"repeat", 1, 0},
                    {"warmup", 1, 0}, {"json", 0, 0}, {"decode", 0, 0},
                    {"kv-heads", 1, 0}, {"kv-dtype", 1, 0},
                    {"ragged", 0, 0}, {"sinks", 0, 0}, {"dtype", 1, 0},
                    {"paged", 0, 0}, {"page-size", 1, 0},
                    {"shared-prefix", 1, 0}, {"kv-rotate", 0, 0},
                    {"v-head-dim", 1, 0}, {"kv-latent", 0, 0},
                    {"read-mib", 1, 0}, MOD_OPTS, MOD_WINDOW_OPT};
    int status;
    if (tool_options("bench", argc, argv, o, NOPTS(o), BENCH_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const mod_opts[] = {"rope", "rope-theta", "rope-dim",
                                           "rope-scale", "alibi",
                                           "alibi-slopes", "window",
                                           "softcap", "sinks",
                                           "attention-chunk"};
    for (int k = 0; OPT("decode") && k < NOPTS(mod_opts); k++)
        if (OPT(mod_opts[k]))
            return tool_fail("bench", "--%s is not supported with --decode",
                             mod_opts[k]);
    if (OPT("decode"))
        return bench_decode(argc, argv, o, NOPTS(o));
    static const char *const decode_only[] = {"kv-heads", "kv-dtype",
                                              "ragged", "paged", "page-size",
                                              "shared-prefix", "kv-rotate",
                                              "v-head-dim", "kv-latent",
                                              "read-mib"};
    for (int k = 0; k < NOPTS(decode_only); k++)
        if (OPT(decode_only[k]))
            return tool_fail("bench", "--%s needs --decode", decode_only[k]);
    static const char *const need[] = {"batch", "seq", "embed-dim", "heads"};
    if (tool_require("bench", o, NOPTS(o), need, 4))
        return 1;
    const int64_t ncpu = bench_online_cpus();
    int64_t B, Lq, Lk = 0, threads = ncpu, repeat = 10, warmup = 2;
    mha_config c = {0};
    if (tool_int("bench", "batch", OPT("batch"), 1, INT32_MAX, &B) ||
        tool_int("bench", "seq", OPT("seq"), 1, INT32_MAX, &Lq) ||
        (OPT("kv-seq") &&
         tool_int("bench", "kv-seq", OPT("kv-seq"), 1, INT32_MAX, &Lk)) ||
        tool_int("bench", "embed-dim", OPT("embed-dim"), 1, INT32_MAX,
                 &c.embed_dim) ||
        tool_int("bench", "heads", OPT("heads"), 1, INT32_MAX,
                 &c.num_heads) ||
        (OPT("threads") &&
         tool_int("bench", "threads", OPT("threads"), 1, 4096, &threads)) ||
        (OPT("repeat") &&
         tool_int("bench", "repeat", OPT("repeat"), 1, 1000000, &repeat)) ||
        (OPT("warmup") &&
         tool_int("bench", "warmup", OPT("warmup"), 0, 1000000, &warmup)))
        return 1;
    const int cross = OPT("kv-seq") != NULL, causal = OPT("causal") != NULL,
              weights = OPT("need-weights") != NULL,
              json = OPT("json") != NULL,
              attn_only = OPT("attention-only") != NULL,
              backward = OPT("backward") != NULL,
              sinks = OPT("sinks") != NULL,
              threads_default = OPT("threads") == NULL;
    /* --dtype bf16|f16: mha_attention on 16-bit q, k, v, out */
    const char *dtype_s = OPT("dtype");
    const mha_dtype dtype = !dtype_s                  ? MHA_DTYPE_F32
                          : !strcmp(dtype_s, "bf16")  ? MHA_DTYPE_BF16
                          : !strcmp(dtype_s, "f16")   ? MHA_DTYPE_F16
                          : !strcmp(dtype_s, "f32")   ? MHA_DTYPE_F32
                                                      : (mha_dtype)-1;
    if ((int)dtype < 0)
        return tool_fail("bench", "--dtype must be f32, bf16 or f16, got "
                         "'%s'", dtype_s);
    if (dtype != MHA_DTYPE_F32 && weights)
        return tool_fail("bench", "--dtype %s times mha_attention or the "
                         "module (and their backward): not with "
                         "--need-weights", dtype_s);
    if (!cross)
        Lk = Lq;
#undef OPT
    if (c.embed_dim % c.num_heads)
        return tool_fail("bench", "embed_dim %lld is not divisible by "
                         "num_heads %lld", (long long)c.embed_dim,
                         (long long)c.num_heads);
    /* The modifiers (their slopes live until the end). */
    tool_mods mods;
    if (tool_mods_parse("bench", o, NOPTS(o), 1, &mods))
        return 1;
    if (tool_mods_heads("bench", &mods, c.num_heads)) {
        tool_mods_free(&mods);
        return 1;
    }
    c.mods = mods.mods;
    c.attention_chunk = mods.chunk;
    c.sinks = sinks;
    long blas_threads;
    const char *tier;
    if (bench_setup(argc, argv, threads, ncpu, json, &blas_threads, &tier)) {
        tool_mods_free(&mods);
        return 1;
    }

    mha_module *m = NULL;
    int64_t E = c.embed_dim, H = c.num_heads, dh = E / H, Lt = Lk;
    if (!attn_only) {
        c.seed = 1;
        if (mha_create(&c, &m) != MHA_OK) {
            tool_mods_free(&mods);
            return tool_fail("bench", "%s", mha_last_error());
        }
        mha_get_config(m, &c);   /* kdim, vdim and scale resolved */
        Lt = mha_total_keys(m, Lk);
    }

    const size_t nq = count3(B, Lq, E), nkv = count3(B, Lk, E),
                 nw = count3(B, Lq, Lt);
    if (!nq || !nkv || (weights && !nw)) {
        mha_free(m);
        tool_mods_free(&mods);
        return tool_fail("bench", "B=%lld L=%lld Lk=%lld E=%lld: the inputs "
                         "are too large", (long long)B, (long long)Lq,
                         (long long)Lk, (long long)E);
    }
    /* Whole module: key = value = kv (NULL for self-attention).
     * Attention only: q, then k = kv and v = vv (their own tensors). */
    const int need_kv = cross || attn_only;
    float *q = malloc(nq * sizeof *q), *out = malloc(nq * sizeof *out);
    float *kv = need_kv ? malloc(nkv * sizeof *kv) : NULL;
    float *vv = attn_only ? malloc(nkv * sizeof *vv) : NULL;
    float *w = weights ? malloc(nw * sizeof *w) : NULL;
    /* --backward, in one buffer: dL/d out, then the gradients of the query
     * (which is key and value too in self-attention), of the key (which is
     * the value too) in cross-attention, and of the parameters; with
     * --attention-only dL/d out, dq, dk, dv. */
    const size_t np = backward && !attn_only ? (size_t)mha_param_numel(m)
                                             : 0,
                 ng = !backward ? 0
                      : attn_only ? 2 * nq + 2 * nkv   /* dq, dk, dv */
                                  : 2 * nq + (cross ? nkv : 0) + np;
    float *g = backward && ng <= SIZE_MAX / sizeof *g ? malloc(ng * sizeof *g)
                                                      : NULL;
    /* The timed calls, then (attention-only backward) each half's. */
    double *ms = malloc((size_t)repeat * 3 * sizeof *ms);
    int rc = 0;
    if (!q || !out || (need_kv && !kv) || (attn_only && !vv) ||
        (weights && !w) || (backward && !g) || !ms)
        rc = tool_fail("bench", "out of memory for the inputs and outputs "
                       "(%.1f MiB)", (double)(2 * nq +
                                              (need_kv ? nkv : 0) +
                                              (attn_only ? nkv : 0) +
                                              (weights ? nw : 0) + ng) *
                                         sizeof(float) / 1048576.0);
    uint64_t state = 1;
    if (!rc) {
        bench_fill_random(q, (int64_t)nq, &state);
        if (need_kv)
            bench_fill_random(kv, (int64_t)nkv, &state);
        if (attn_only)
            bench_fill_random(vv, (int64_t)nkv, &state);
        if (backward)
            bench_fill_random(g, (int64_t)nq, &state);   /* dL/d out */
    }
    mha_backward_args b = {0};
    if (backward && !attn_only) {
        b.grad_out = g;
        b.grad_query = g + nq;
        b.grad_key = cross ? g + 2 * nq : NULL;
        b.grad_params = g + ng - np;
    }

    const mha_causal cmode = causal ? MHA_CAUSAL_BOTTOM_RIGHT
                                    : MHA_CAUSAL_NONE;
    const mha_weights_mode wmode = weights ? MHA_WEIGHTS_AVERAGE
                                           : MHA_WEIGHTS_NONE;
    mha_forward_args a = {0};
    a.batch = B;
    a.q_len = Lq;
    a.kv_len = Lk;
    a.query = q;
    a.key = cross ? kv : NULL;   /* NULL: self-attention */
    a.causal = cmode;
    a.need_weights = wmode;
    a.attn_weights = w;
    a.num_threads = (int)threads;
    a.out = out;

    mha_attention_args aa = {0};
    aa.batch = B;
    aa.num_heads = H;
    aa.head_dim = dh;
    aa.q_len = Lq;
    aa.kv_len = Lk;
    aa.q = q;
    aa.k = kv;
    aa.v = vv;
    aa.causal = cmode;
    aa.need_weights = wmode;
    aa.attn_weights = w;
    aa.num_threads = (int)threads;
    aa.out = out;
    aa.mods = mods.mods;
    aa.attention_chunk = mods.chunk;
    float *sink_logits = sinks ? malloc((size_t)H * sizeof *sink_logits)
                               : NULL;
    for (int64_t h = 0; sink_logits && h < H; h++)
        sink_logits[h] = 0.5f;
    aa.sinks = sink_logits;
    /* 16-bit copies of q, k, v, rounded once before the timing (and for
     * --backward dL/d out and the gradients) */
    uint16_t *h16 = NULL;
    mha_attention_grads16 g16 = {0};
    if (dtype != MHA_DTYPE_F32) {
        h16 = malloc((2 * nq + 2 * nkv + (backward ? 2 * nq + 2 * nkv : 0)) *
                     sizeof *h16);
        if (!h16)
            rc = tool_fail("bench", "cannot allocate the 16-bit inputs");
        for (size_t i = 0; h16 && i < nq + 2 * nkv; i++) {
            const float x = i < nq         ? q[i]
                          : i < nq + nkv   ? (kv ? kv[i - nq] : 0.0f)
                                           : (vv ? vv[i - nq - nkv] : 0.0f);
            h16[i] = dtype == MHA_DTYPE_BF16 ? mha_bf16_from_float(x)
                                              : mha_f16_from_float(x);
        }
        aa.dtype = dtype;
        aa.q = aa.k = aa.v = NULL;
        aa.out = NULL;
        aa.q16 = h16;
        aa.k16 = h16 + nq;
        aa.v16 = h16 + nq + nkv;
        aa.out16 = h16 + nq + 2 * nkv;
        a.dtype = dtype;   /* the module's forward: query (and key) 16-bit */
        a.query = a.key = NULL;
        a.out = NULL;
        a.query16 = h16;
        a.key16 = cross ? h16 + nq : NULL;
        a.out16 = h16 + nq + 2 * nkv;
        if (h16 && backward) {
            uint16_t *gb = h16 + 2 * nq + 2 * nkv;
            for (size_t i = 0; i < nq; i++)
                gb[i] = dtype == MHA_DTYPE_BF16 ? mha_bf16_from_float(g[i])
                                                : mha_f16_from_float(g[i]);
            g16 = (mha_attention_grads16){.grad_out = gb, .grad_q = gb + nq,
                                          .grad_k = gb + 2 * nq,
                                          .grad_v = gb + 2 * nq + nkv};
            memset(g + nq, 0, (ng - nq) * sizeof *g);   /* (unused here) */
            if (!attn_only)   /* the module's: 16-bit data, float32 params */
                b = (mha_backward_args){
                    .grad_out16 = gb, .grad_query16 = gb + nq,
                    .grad_key16 = cross ? gb + 2 * nq : NULL,
                    .grad_params = g + ng - np};
        }
    }

    mha_attention_grads ag = {0};
    if (backward && attn_only) {
        ag.grad_out = g;
        ag.grad_q = g + nq;
        ag.grad_k = g + 2 * nq;
        ag.grad_v = g + 2 * nq + nkv;
    }

    mha_plan *plan = NULL;
    mha_attention_plan *aplan = NULL;
    if (!rc && !attn_only && mha_plan_create(m, &a, &plan) != MHA_OK)
        rc = tool_fail("bench", "%s", mha_last_error());
    if (!rc && attn_only && backward &&
        mha_attention_plan_create(&aa, &aplan) != MHA_OK)
        rc = tool_fail("bench", "%s", mha_last_error());

#ifndef __OPTIMIZE__
    if (!rc)
        fprintf(stderr, "mha bench: warning: this mha was built without "
                "optimisation; the peak probe and the timings mean little\n");
#endif
    const char *probe_kind = "";
    const double peak1 = rc ? 0.0 : bench_fma_peak(&probe_kind);
    double *fwd_ms = ms + repeat, *bwd_ms = ms + 2 * repeat;
    for (int64_t r = 0; !rc && r < warmup + repeat; r++) {
        const double t0 = bench_now_s();
        mha_status st = aplan       ? mha_attention_plan_run(aplan, &aa)
                        : attn_only ? mha_attention(&aa)
                                    : mha_plan_forward(plan, &a);
        const double tf = bench_now_s();
        if (st == MHA_OK && backward)
            st = aplan && h16 ? mha_attention_plan_backward16(aplan, &aa, &g16)
                 : aplan      ? mha_attention_plan_backward(aplan, &aa, &ag)
                              : mha_plan_backward(plan, &a, &b);
        const double t1 = bench_now_s();
        if (st != MHA_OK)
            rc = tool_fail("bench", "%s", mha_last_error());
        else if (r >= warmup) {
            ms[r - warmup] = (t1 - t0) * 1e3;
            fwd_ms[r - warmup] = (tf - t0) * 1e3;
            bwd_ms[r - warmup] = (t1 - tf) * 1e3;
        }
    }
    if (!rc && h16)   /* the 16-bit output, for the check below */
        for (size_t i = 0; i < nq; i++)
            out[i] = dtype == MHA_DTYPE_BF16
                         ? mha_bf16_to_float(h16[nq + 2 * nkv + i])
                         : mha_f16_to_float(h16[nq + 2 * nkv + i]);
    if (!rc) {
        double sum = 0.0;
        for (size_t i = 0; i < nq; i++)
            sum += out[i];
        for (size_t i = nq; i < ng; i++)
            sum += g[i];
        if (!isfinite(sum))
            rc = tool_fail("bench", "the output %sis not finite",
                           backward ? "or a gradient " : "");
    }
    if (!rc) {
        const double med = bench_median(ms, repeat);
        const double mn = ms[0];
        const double kvw = (double)(c.kdim + c.vdim);
        /* The backward: 2x the projections, 2.5x the attention. */
        const double proj = (backward ? 3.0 : 1.0) *
                            (attn_only ? 0.0
                                       : 2.0 * B * Lq * E * E +
                                             2.0 * B * Lk * E * kvw +
                                             2.0 * B * Lq * E * E);
        const double attn = (backward ? 3.5 : 1.0) * 4.0 * B * H * dh *
                            allowed_pairs(Lq, Lk, causal, &c.mods,
                                          c.attention_chunk);
        const double total = proj + attn;
        const double gflops = total / (med * 1e-3) * 1e-9;
        const double peak = peak1 * (double)threads;
        /* Each half alone: the forward's work, and the backward's (2x the
         * projections', 2.5x the attention's), at their own medians. */
        const double fmed = bench_median(fwd_ms, repeat),
                     bmed = backward ? bench_median(bwd_ms, repeat) : 0.0,
                     bwork = backward ? (2.0 / 3.0) * proj + (2.5 / 3.5) * attn
                                      : 0.0,
                     bgflops = bmed > 0 ? bwork / (bmed * 1e-3) * 1e-9 : 0.0;
        if (json) {
            printf("{\"batch\": %lld, \"seq\": %lld, \"kv_seq\": %lld, "
                   "\"embed_dim\": %lld, \"heads\": %lld, \"head_dim\": %lld, "
                   "\"causal\": %s, \"need_weights\": %s, "
                   "\"attention_only\": %s, \"backward\": %s, "
                   "\"threads\": %lld, "
                   "\"threads_default\": %s, \"online_cpus\": %lld, "
                   "\"blas_threads\": %ld, \"tier\": \"%s\", \"gemm\": \"%s\", "
                   "\"repeat\": %lld, \"warmup\": %lld, "
                   "\"median_ms\": %.6g, \"min_ms\": %.6g, "
                   "\"gflop\": %.9g, \"proj_gflop\": %.9g, "
                   "\"attn_gflop\": %.9g, \"gflops\": %.6g, "
                   "\"peak_gflops\": %.6g, \"peak_percent\": %.4g, "
                   "\"probe\": \"%s\", \"library\": \"%s\", "
                   "\"forward_ms\": %.6g",
                   (long long)B, (long long)Lq, (long long)Lk, (long long)E,
                   (long long)H, (long long)dh, causal ? "true" : "false",
                   weights ? "true" : "false", attn_only ? "true" : "false",
                   backward ? "true" : "false", (long long)threads, threads_default ? "true" : "false",
                   (long long)ncpu, blas_threads, tier, mha_gemm_backend(), (long long)repeat,
                   (long long)warmup, med, mn, total * 1e-9, proj * 1e-9,
                   attn * 1e-9, gflops, peak, 100.0 * gflops / peak,
                   probe_kind, mha_version_string(), fmed);
            if (backward)
                printf(", \"backward_ms\": %.6g, \"backward_gflops\": %.6g, "
                       "\"backward_percent\": %.4g", bmed, bgflops,
                       100.0 * bgflops / peak);
            printf("}\n");
        } else {
            printf("mha bench: B=%lld L=%lld Lk=%lld E=%lld H=%lld d_h=%lld, "
                   "%s%s%s, %lld thread%s%s\n", (long long)B, (long long)Lq,
                   (long long)Lk, (long long)E, (long long)H, (long long)dh,
                   cross ? "cross-attention" : "self-attention",
                   causal ? ", causal" : "",
                   weights ? ", averaged weights" : "", (long long)threads,
                   threads == 1 ? "" : "s",
                   threads_default ? " (default: the online CPUs)" : "");
            if (attn_only && backward)
                printf(h16 ? "  timed   mha_attention_plan_run + "
                             "mha_attention_plan_backward16 on projected "
                             "%s q, k, v (attention only, planned once)\n"
                           : "  timed   mha_attention_plan_run + "
                             "mha_attention_plan_backward on projected%s "
                             "q, k, v (attention only, planned once)\n",
                       h16 ? dtype_s : "");
            else if (attn_only)
                printf("  timed   mha_attention on projected q, k, v "
                       "(attention only)\n");
            else if (backward)
                printf("  timed   mha_plan_forward + mha_plan_backward "
                       "(forward and every gradient, planned once)\n");
            else
                printf("  timed   mha_plan_forward (whole forward pass, "
                       "planned once)\n");
            printf("  kernels %s (mha_kernel_tier), %lld attention "
                   "thread%s, GEMMs %s (mha_gemm_backend), "
                   "OPENBLAS_NUM_THREADS=%s\n", tier,
                   (long long)threads, threads == 1 ? "" : "s",
                   mha_gemm_backend(), bench_blas_env() ? bench_blas_env() : "(unset)");
            printf("  time    median %.4f ms, min %.4f ms over %lld runs "
                   "(after %lld warm-up)\n", med, mn, (long long)repeat,
                   (long long)warmup);
            if (attn_only)
                printf("  work    %.4g GFLOP per call (attention: %s*d_h "
                       "per allowed pair per head)\n", attn * 1e-9,
                       backward ? "(4 + 10)" : "4");
            else
                printf("  work    %.4g GFLOP per %s: projections %.4g, "
                       "attention %.4g (%.1f%%)\n", total * 1e-9,
                       backward ? "forward + backward (3x and 3.5x the "
                                  "forward's)"
                                : "forward",
                       proj * 1e-9, attn * 1e-9, 100.0 * attn / total);
            printf("  speed   %.2f GFLOP/s at the median (%.2f at the min) "
                   "= %.1f%% of peak\n", gflops,
                   total / (mn * 1e-3) * 1e-9, 100.0 * gflops / peak);
            if (backward)
                printf("  halves  forward median %.4f ms; backward median "
                       "%.4f ms, %.4g GFLOP, %.2f GFLOP/s = %.1f%% of peak\n",
                       fmed, bmed, bwork * 1e-9, bgflops,
                       100.0 * bgflops / peak);
            printf("  peak    %.1f GFLOP/s: %s multiply-add probe, %.1f x "
                   "%lld thread%s\n", peak, probe_kind, peak1,
                   (long long)threads, threads == 1 ? "" : "s");
        }
    }
    mha_plan_free(plan);
    mha_attention_plan_free(aplan);
    free(g);
    free(ms);
    free(w);
    free(vv);
    free(kv);
    free(out);
    free(q);
    free(sink_logits);
    free(h16);
    mha_free(m);
    tool_mods_free(&mods);
    return rc;
}
