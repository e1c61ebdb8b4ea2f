/*
 * run_setup.h -- what mha forward, mha backward and mha viz share: their
 * common options, and a module loaded from --weights with its .npy inputs
 * and the forward's arguments; with a few helpers on loaded tensors.
 */
#ifndef MHA_TOOL_RUN_SETUP_H
#define MHA_TOOL_RUN_SETUP_H

#include "args.h"
#include "mha_io.h"

#include <stddef.h>
#include <stdint.h>

/*
 * The score modifiers and RoPE (mha_modifiers): MOD_OPTS holds every one
 * but --window, which is MOD_WINDOW_OPT (mha decode's own --window is its
 * sliding-window cache).  Given with --weights, they replace the file's
 * __metadata__ (mha_module_from_file's base).
 */
#define MOD_OPTS                                                             \
    {"rope", 1, 0}, {"rope-theta", 1, 0}, {"rope-dim", 1, 0},                \
    {"rope-scale", 1, 0}, {"alibi", 0, 0}, {"alibi-slopes", 1, 0},           \
    {"softcap", 1, 0}, {"attention-chunk", 1, 0}
#define MOD_WINDOW_OPT {"window", 1, 0}
#define MOD_USAGE                                                            \
    "         [--rope neox|gptj [--rope-theta T] [--rope-dim N]\n"           \
    "         [--rope-scale S]] [--alibi | --alibi-slopes S.npy]\n"          \
    "         [--softcap C] [--attention-chunk N]"
#define MOD_HELP                                                             \
    "  --rope neox|gptj   rotary position embeddings of q and k after their\n" \
    "                     projections: neox pairs element k with k + N/2\n"  \
    "                     (Llama's rotate_half), gptj pairs 2k with 2k+1\n"   \
    "  --rope-theta T     RoPE's base, > 1 (default 10000)\n"                \
    "  --rope-dim N       rotary dims N, even, <= head_dim (default\n"       \
    "                     head_dim); the rest of each head passes through\n" \
    "  --rope-scale S     positions divided by S > 0 (linear scaling,\n"     \
    "                     default 1)\n"                                       \
    "  --alibi            ALiBi with the paper's slopes for H heads\n"        \
    "  --alibi-slopes S   ALiBi with the slopes of S.npy: 1-D, H floats\n"    \
    "  --softcap C        scores s <- C tanh(s / C), C > 0 (Gemma 2)\n"     \
    "  --attention-chunk N  chunked attention (Llama 4): a query sees only\n" \
    "                     the keys of its own chunk of N >= 1 positions\n"
#define MOD_WINDOW_HELP                                                      \
    "  --window L,R       query i sees keys j with i' - L <= j <= i' + R,\n" \
    "                     i' = i + Lk - Lq; -1: no bound on that side\n"
#define MOD_WINDOW_USAGE " [--window L,R]"
#define MOD_NOTE                                                             \
    "--rope, --alibi, --alibi-slopes, --window, --softcap and\n"             \
    "--attention-chunk replace the file's own settings (its __metadata__; mha info shows them).\n"

/* The parsed modifier options: mods points at slopes when given. */
typedef struct tool_mods {
    mha_modifiers mods;
    mha_tensor *slopes;   /* --alibi-slopes, or NULL */
    int64_t chunk;        /* --attention-chunk (mha_config's
                             attention_chunk), 0 when not given */
} tool_mods;

/* Parses the options of MOD_OPTS (and, when `window`, MOD_WINDOW_OPT)
 * into *t (zeroed first); prints and returns 1 on a bad value. */
int tool_mods_parse(const char *cmd, const tool_opt *o, int n, int window,
                    tool_mods *t);
/* --alibi-slopes holds H values; prints and returns 1 otherwise. */
int tool_mods_heads(const char *cmd, const tool_mods *t, int64_t H);
void tool_mods_free(tool_mods *t);

/* The usage lines of the options they all take, and their descriptions. */
#define RUN_USAGE_INPUTS                                                     \
    "--weights W.safetensors [--heads H] --query Q.npy\n"                   \
    "         [--key K.npy [--value V.npy]] [--seq-first]\n"              \
    "         [--attn-mask M.npy | --block-mask M.npy]\n"                  \
    "         [--key-mask KM.npy] [--key-lengths KL.npy]\n"                 \
    "         [--causal | --causal-top-left] [--scale S] [--add-zero-attn]\n" \
    "         [--train [--dropout P] [--seed S]] [--threads T]\n"           \
    "         [--head-mask M0,M1,...]\n"                                  \
    MOD_USAGE MOD_WINDOW_USAGE "\n"
#define RUN_HELP_INPUTS                                                      \
    "  --heads H          number of heads (default: __metadata__ num_heads)\n" \
    "  --query Q.npy      (B, Lq, E) or unbatched (Lq, E), float\n"          \
    "  --key, --value     (B, Lk, kdim), (B, Lk, vdim); default: the query\n" \
    "                     (self-attention); --value defaults to --key\n"     \
    "  --seq-first        3-D inputs and outputs are (L, B, .), as\n"        \
    "                     nn.MultiheadAttention's default batch_first=False\n" \
    "                     (the weights stay (B, Lq, Lk), as torch's do)\n"   \
    "  --attn-mask M.npy  bool: ALLOW mask, true = may attend (the seeds' and\n" \
    "                     SDPA's convention; NOT nn.MultiheadAttention's);\n" \
    "                     float: added to the scores (-inf blocks).\n"        \
    "                     Shape (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk)\n"   \
    "  --block-mask M.npy bool, true = blocked: nn.MultiheadAttention's bool\n" \
    "                     attn_mask as it is (its (B*H, Lq, Lk) is our\n"   \
    "                     (B, H, Lq, Lk)); shapes as --attn-mask\n"          \
    "  --key-mask KM.npy  (B, Lk) or (Lk) bool, true = real key\n"           \
    "  --key-lengths KL   (B) integers: keys past each length are masked\n"  \
    "  --causal           query i sees keys j <= i + Lk - Lq (bottom right)\n" \
    "  --causal-top-left  query i sees keys j <= i\n"                         \
    "  --scale S          softmax scale (default 1/sqrt(E/H))\n"              \
    "  --add-zero-attn    the module was built with add_zero_attn=True\n"     \
    "  --train            apply dropout P (default: the file's; 0 turns it\n" \
    "                     off) keyed by --seed S (default 0)\n"               \
    "  --threads T        attention threads, 1..4096 (default: OpenMP's)\n" \
    "  --head-mask M,...  H finite factors, one per head, applied to each\n" \
    "                     head's output before out_proj: 0 removes the head\n" \
    "                     (ablation), 1 keeps it\n"                    \
    MOD_HELP MOD_WINDOW_HELP

/* The options of all three, first in each one's table (tool_opt, args.h). */
#define RUN_OPTS                                                             \
    {"weights", 1, 0}, {"heads", 1, 0}, {"query", 1, 0}, {"key", 1, 0},     \
    {"value", 1, 0}, {"attn-mask", 1, 0}, {"block-mask", 1, 0},             \
    {"key-mask", 1, 0},                                                      \
    {"key-lengths", 1, 0}, {"causal", 0, 0}, {"causal-top-left", 0, 0},     \
    {"scale", 1, 0}, {"add-zero-attn", 0, 0}, {"train", 0, 0},               \
    {"dropout", 1, 0}, {"seed", 1, 0}, {"threads", 1, 0},                   \
    {"head-mask", 1, 0}, {"seq-first", 0, 0}, MOD_OPTS, MOD_WINDOW_OPT

typedef struct fwd_inputs {
    mha_tensor *q, *k, *v, *mask, *kmask, *klen;
} fwd_inputs;

/* A module loaded from --weights, its inputs, and the forward's arguments
 * (a.out and a.attn_weights are left to the command). */
typedef struct run_setup {
    mha_module *m;
    mha_config c;
    fwd_inputs in;
    float *head_mask;   /* --head-mask, or NULL */
    tool_mods mods;     /* --rope, --alibi, ...: the base of the load */
    int seq_first;      /* --seq-first: 3-D tensors in files are (L, B, .) */
    mha_forward_args a;
} run_setup;

/*
 * The module, the inputs and the forward's arguments from the options of
 * RUN_OPTS (o, n: the command's parsed table); on failure prints, frees
 * what it made and returns 1.  run_free releases what it loaded.
 */
int run_setup_load(const char *cmd, const tool_opt *o, int n,
                   run_setup *r);
void run_free(run_setup *r);

/*
 * --seq-first: the float data of a 3-D (A, B, w) tensor rearranged in
 * place as (B, A, w), shape[0] and shape[1] swapped (so (L, B, E) <-> (B,
 * L, E)); other ranks are left alone.  0, or 1 after printing when out of
 * memory.
 */
int tool_swap01(const char *cmd, float *data, int ndim, int64_t *shape);
/* The same for elements of `elem` bytes (a 16-bit output). */
int tool_swap01_bytes(const char *cmd, void *data, size_t elem, int ndim,
                      int64_t *shape);

/* ---- loaded tensors ------------------------------------------------------ */

/* The name of a loaded tensor's dtype for messages ("BOOL (a bool or
 * uint8 file)" for BOOL, as .npy's uint8 loads as bool). */
const char *tool_dtype_of(const mha_tensor *t);

/* Whether t holds floating-point values (F32, F64, F16, BF16). */
int tool_is_float(const mha_tensor *t);

/* A shape as "(2, 3, 8)" into buf (n bytes). */
void tool_dims_str(int ndim, const int64_t *shape, char *buf, size_t n);
void tool_shape_str(const mha_tensor *t, char *buf, size_t n);

/* A view of `data` with the shape of the input `like`'s leading dimensions
 * and last dimension `last` (an unbatched input gives an unbatched view). */
mha_tensor_view tool_view_like(const char *name, const mha_tensor *like,
                               int64_t last, const float *data);

#endif
