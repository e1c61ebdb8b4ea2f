/*
 * cmd_decode.c -- `mha decode`: the causal self-attention of a sequence run
 * incrementally through a KV cache, a prefill and then a few tokens at a
 * time, as a generating model runs it.  The outputs, concatenated, are
 * those of `mha forward --causal` on the same input (up to rounding), or
 * with --window W those of causal attention limited to the last W keys
 * (a sliding-window cache: a ring of W - 1 + max(P, C) slots).
 */
#include "args.h"
#include "commands.h"
#include "fail.h"
#include "run_setup.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char DECODE_HELP[] =
    "usage: mha decode --weights W.safetensors [--heads H] --query X.npy\n"
    "                  [--prefill P] [--chunk C] [--kv-dtype f32|f16|bf16|q8|q4]\n"
    "                  [--kv-rotate]\n"
    "                  [--window W | --window L,R] [--threads T] [--seq-first]\n"
    "                  --out OUT.npy\n"
    MOD_USAGE "\n"
    "\n"
    "Runs the causal self-attention of X through a KV cache, as a model\n"
    "generating text does: the first P tokens of every sequence in one\n"
    "forward (the prefill), then C tokens per forward, each new token\n"
    "attending to the keys cached so far and to the new ones up to itself\n"
    "(a cache of L tokens per sequence, mha_plan_decode).\n"
    "The outputs, concatenated, equal `mha forward --causal` on X up to\n"
    "float rounding (with --window W, `mha forward --attn-mask` of the\n"
    "causal band of width W).\n"
    "  --heads H          number of heads (default: __metadata__ num_heads);\n"
    "                     grouped-query modules (num_kv_heads) work as they\n"
    "                     are, the cache holding their K/V heads only\n"
    "  --query X.npy      (B, L, E) or unbatched (L, E), float\n"
    "  --seq-first        X and OUT are (L, B, E), nn.MultiheadAttention's\n"
    "                     default batch_first=False layout\n"
    "  --prefill P        tokens of the first forward (default: C)\n"
    "  --chunk C          tokens of each later forward (default 1: token by\n"
    "                     token); the last may be shorter.  P >= L runs X\n"
    "                     in one forward\n"
    "  --kv-dtype T       the cache's storage: f32 (default), f16, bf16, q8\n"
    "                     or q4 (8- or 4-bit codes, a scale per 32\n"
    "                     elements): K and V rounded once when cached, the\n"
    "                     attention exact on what is stored\n"
    "  --kv-rotate        store K and V turned by a Hadamard rotation of\n"
    "                     the head dimension (queries and outputs turned\n"
    "                     alike): a channel's outliers spread before q4 or\n"
    "                     q8 rounds them\n"
    "  --window W         a sliding-window cache: each query attends to\n"
    "                     itself and the W - 1 keys before it (Mistral's\n"
    "                     sliding_window), and the cache is a ring of\n"
    "                     W - 1 + max(P, C) tokens, however long X is.\n"
    "                     The window modifier's form LEFT,RIGHT (of\n"
    "                     forward and the others) is taken too: decoding\n"
    "                     is causal, so RIGHT changes nothing and LEFT is\n"
    "                     W - 1 (-1: no window).  A window in the file's\n"
    "                     __metadata__ applies without the flag, through\n"
    "                     an ordinary cache; the flag replaces it\n"
    "  --threads T        attention threads, 1..4096 (default: OpenMP's)\n"
    "  --out OUT.npy      (B, L, E) float32, or (L, E) for an unbatched X;\n"
    "                     written only on success\n"
    MOD_HELP
    "RoPE rotates each token at its position in the sequence; the cache\n"
    "holds the rotated keys.  " MOD_NOTE;

/* At most three forward lengths: the prefill, the chunk, the last chunk. */
typedef struct decode_plans {
    int64_t q_len[3];
    mha_plan *plan[3];
    int n;
} decode_plans;

/* The plan for `shape` (its q_len), made on first use. */
static mha_plan *plan_for(decode_plans *p, const mha_module *m,
                          const mha_decode_args *shape)
{
    for (int k = 0; k < p->n; k++)
        if (p->q_len[k] == shape->q_len)
            return p->plan[k];
    if (p->n == 3 ||
        mha_plan_create_decode(m, shape, &p->plan[p->n]) != MHA_OK)
        return NULL;
    p->q_len[p->n] = shape->q_len;
    return p->plan[p->n++];
}

/*
 * Runs x (B, L, E) through the cache kv: forwards of P, then C tokens of
 * every sequence (the rows [t, t + n) of each, gathered into one (B, n, E)
 * block), their outputs scattered into out (B, L, E).
 */
static int decode_all(const run_setup *r, mha_kv_cache *kv, int64_t P,
                      int64_t C, float *out)
{
    const int64_t B = r->a.batch, L = r->a.q_len, E = r->c.embed_dim;
    const int64_t most = P > C ? P : C;
    const float *x = r->a.query;
    float *xc = malloc((size_t)(B * most * E) * sizeof *xc);
    float *yc = malloc((size_t)(B * most * E) * sizeof *yc);
    decode_plans plans = {{0}, {0}, 0};
    int rc = !xc || !yc ? tool_fail("decode", "out of memory for a chunk of "
                                    "%lld tokens", (long long)most)
                        : 0;
    for (int64_t t = 0; !rc && t < L;) {
        const int64_t n = t == 0 ? P : C < L - t ? C : L - t;
        mha_decode_args a = {0};
        a.batch = B;
        a.q_len = n;
        a.query = xc;
        a.out = yc;
        a.cache = kv;
        a.num_threads = r->a.num_threads;
        mha_plan *plan = plan_for(&plans, r->m, &a);
        for (int64_t b = 0; b < B; b++)
            memcpy(xc + b * n * E, x + (b * L + t) * E,
                   (size_t)(n * E) * sizeof *xc);
        if (!plan || mha_plan_decode(plan, &a) != MHA_OK) {
            rc = tool_fail("decode", "tokens %lld..%lld: %s", (long long)t,
                           (long long)(t + n - 1), mha_last_error());
            break;
        }
        for (int64_t b = 0; b < B; b++)
            memcpy(out + (b * L + t) * E, yc + b * n * E,
                   (size_t)(n * E) * sizeof *out);
        t += n;
    }
    for (int k = 0; k < plans.n; k++)
        mha_plan_free(plans.plan[k]);
    free(xc);
    free(yc);
    return rc;
}

int cmd_decode(int argc, char **argv)
{
    tool_opt o[] = {{"weights", 1, 0}, {"heads", 1, 0}, {"query", 1, 0},
                    {"threads", 1, 0}, {"prefill", 1, 0}, {"chunk", 1, 0},
                    {"kv-dtype", 1, 0}, {"window", 1, 0}, {"out", 1, 0},
                    {"kv-rotate", 0, 0},
                    {"seq-first", 0, 0}, MOD_OPTS};
    int status;
    if (tool_options("decode", argc, argv, o, NOPTS(o), DECODE_HELP, &status))
        return status;
#define OPT(name) tool_get(o, NOPTS(o), name)
    static const char *const need[] = {"weights", "query", "out"};
    static const char *const outs[] = {"out"};
    if (tool_require("decode", o, NOPTS(o), need, 3) ||
        tool_outputs_apart("decode", o, NOPTS(o), outs, 1))
        return 1;
    int64_t C = 1, P = 0, window = 0;
    if ((OPT("chunk") &&
         tool_int("decode", "chunk", OPT("chunk"), 1, INT32_MAX, &C)) ||
        (OPT("prefill") &&
         tool_int("decode", "prefill", OPT("prefill"), 1, INT32_MAX, &P)) ||
        (OPT("window") && !strchr(OPT("window"), ',') &&
         tool_int("decode", "window", OPT("window"), 1, INT32_MAX, &window)))
        return 1;
    if (OPT("window") && strchr(OPT("window"), ',')) {
        /* LEFT,RIGHT: the keys a causal query sees are LEFT before it. */
        int64_t count = 0, *lr = NULL;
        if (tool_ints("decode", "window", OPT("window"), -1, INT32_MAX - 1,
                      &count, &lr))
            return 1;
        const int64_t left = lr[0];
        free(lr);
        if (count != 2)
            return tool_fail("decode", "--window must be W or LEFT,RIGHT "
                             "(two integers >= -1), got '%s'",
                             OPT("window"));
        window = left < 0 ? 0 : left + 1;
    }
    mha_kv_dtype dtype = MHA_KV_F32;
    if (OPT("kv-dtype") && tool_kv_dtype("decode", OPT("kv-dtype"), &dtype))
        return 1;

    run_setup r;
    if (run_setup_load("decode", o, NOPTS(o), &r))
        return 1;
    const int64_t B = r.a.batch, L = r.a.q_len, E = r.c.embed_dim;
    P = P ? P : C;
    P = P < L ? P : L;
    C = C < L ? C : L;
    /* A window of W >= L sees every earlier key, as one of L does; a step
     * of n tokens needs n + W - 1 slots of the ring. */
    window = window < L ? window : L;
    const int64_t cap = window ? window - 1 + (P > C ? P : C) : L;
    mha_kv_cache *kv = NULL;
    /* (values of their own width, d_v, as the module's: --v-head-dim) */
    const mha_kv_cache_config kc = {B, r.c.num_kv_heads, r.c.head_dim, cap,
                                    dtype, window, 0, 0,
                                    OPT("kv-rotate") != NULL,
                                    r.c.v_head_dim, 0};
    const mha_status st = kc.dtype == MHA_KV_F32 && !window && !kc.rotate
                              ? mha_kv_cache_for_module(r.m, B, L, &kv)
                              : mha_kv_cache_create(&kc, &kv);
    int rc = 0;
    if (st != MHA_OK) {
        char what[64];
        if (window)
            snprintf(what, sizeof what, "--window %lld", (long long)window);
        else
            snprintf(what, sizeof what, "--kv-dtype %s",
                     OPT("kv-dtype") ? OPT("kv-dtype") : "f32");
        rc = tool_fail_status("decode", what, st);
    }
    /* Sizes were checked by the loaders; the library checks again. */
    float *out = rc ? NULL : malloc((size_t)(B * L * E) * sizeof *out);
    if (!rc && !out)
        rc = tool_fail("decode", "out of memory for the output");
    if (!rc)
        rc = decode_all(&r, kv, P, C, out);
    if (!rc) {
        /* An unbatched input gives an unbatched output, as in forward. */
        mha_tensor_view ov = tool_view_like("", r.in.q, E, out);
        if (r.seq_first)        /* (B, L, E) -> the query's (L, B, E) */
            rc = tool_swap01("decode", out, ov.ndim, ov.shape);
        if (!rc && mha_npy_save(OPT("out"), &ov) != MHA_OK)
            rc = tool_fail("decode", "--out: %s", mha_last_error());
    }
#undef OPT
    free(out);
    mha_kv_cache_free(kv);
    run_free(&r);
    return rc;
}
