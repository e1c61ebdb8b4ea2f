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

/* The usage lines of the options they all take, and their descriptions. */
#define RUN_USAGE_INPUTS                                                     \
    "--weights W.safetensors [--heads H] --query Q.npy\n"                   \
    "         [--key K.npy [--value V.npy]] [--attn-mask M.npy]\n"          \
    "         [--key-mask KM.npy] [--key-lengths KL.npy]\n"                 \
    "         [--causal | --causal-top-left] [--scale S] [--add-zero-attn]\n" \
    "         [--train [--dropout P] [--seed S]] [--threads T]\n"           \
    "         [--head-mask M0,M1,...]\n"
#define RUN_HELP_INPUTS                                                      \
    "  --heads H          number of heads (default: __metadata__ num_heads)\n" \
    "  --query Q.npy      (B, Lq, E) or unbatched (Lq, E), float\n"          \
    "  --key, --value     (B, Lk, kdim), (B, Lk, vdim); default: the query\n" \
    "                     (self-attention); --value defaults to --key\n"     \
    "  --attn-mask M.npy  bool: ALLOW mask, true = may attend (the seeds' and\n" \
    "                     SDPA's convention; NOT nn.MultiheadAttention's);\n" \
    "                     float: added to the scores (-inf blocks).\n"        \
    "                     Shape (Lq, Lk), (B, Lq, Lk) or (B, H, Lq, Lk)\n"   \
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
    "                     (ablation), 1 keeps it\n"

/* The options of all three, first in each one's table (tool_opt, args.h). */
#define RUN_OPTS                                                             \
    {"weights", 1, 0}, {"heads", 1, 0}, {"query", 1, 0}, {"key", 1, 0},     \
    {"value", 1, 0}, {"attn-mask", 1, 0}, {"key-mask", 1, 0},                \
    {"key-lengths", 1, 0}, {"causal", 0, 0}, {"causal-top-left", 0, 0},     \
    {"scale", 1, 0}, {"add-zero-attn", 0, 0}, {"train", 0, 0},               \
    {"dropout", 1, 0}, {"seed", 1, 0}, {"threads", 1, 0},                   \
    {"head-mask", 1, 0}

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

/* ---- loaded tensors ------------------------------------------------------ */

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
