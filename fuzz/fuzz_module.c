/*
 * fuzz_module.c -- fuzz target for a module from a PyTorch
 * nn.MultiheadAttention state_dict in safetensors (mha_module_from_file),
 * and a forward pass through what it accepts.
 *
 * The input is one byte, then a safetensors file.  The byte mod 9 is the
 * num_heads given to mha_module_from_file (0: from __metadata__
 * "num_heads"); the rest is parsed with mha_safetensors_parse.  (The seeds
 * in fuzz/corpus/module are files from `mha init` with that byte in front:
 * `{ printf '\0'; cat W.safetensors; } > fuzz/corpus/module/NAME`.)
 * When the module is made and kdim = vdim = E <= 64, a tiny self-attention
 * forward pass runs (B = 1, L = 2), in eval mode and in training mode with
 * the per-head attention weights.
 *
 * Built two ways, as fuzz_npy.c and fuzz_safetensors.c:
 *   - with -fsanitize=fuzzer,address,undefined:
 *         build-fuzz/fuzz/fuzz_module -max_total_time=180 \
 *             NEW_DIR fuzz/corpus/module
 *   - without it, fuzz/replay_main.c replays files / directories; CTest's
 *     fuzz_replay_module replays fuzz/corpus/module.
 *
 * Contract checks (trap if broken): on failure *out is NULL and there is a
 * message; on success the config agrees with the tensors (E from
 * out_proj.weight, heads divide E), every parameter reads back, and the
 * forward pass succeeds (or refuses weights whose scores could overflow
 * float32, with that message).
 */
#define _POSIX_C_SOURCE 200809L

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mha_io.h"

static void check(int ok)
{
    if (!ok)
        __builtin_trap();
}

/* A forward succeeds, or (weights so large that the scaled scores could
 * pass FLT_MAX: semantics.md, "scores that could overflow") is refused
 * with that message and nothing else. */
static int forward_ok(mha_status st)
{
    return st == MHA_OK ||
           (st == MHA_ERR_INVALID_ARGUMENT &&
            strstr(mha_last_error(), "past float32's") != NULL);
}

static void forward(const mha_module *m, const mha_config *c)
{
    enum { L = 2, EMAX = 64, HMAX = 64, KMAX = L + 2 };
    float x[L * EMAX], y[L * EMAX], w[HMAX * L * KMAX];
    for (int k = 0; k < L * (int)c->embed_dim; k++)
        x[k] = (float)((k * 37) % 11) / 8.0f - 0.6f;
    mha_forward_args a;
    memset(&a, 0, sizeof a);
    a.batch = 1;
    a.q_len = L;
    a.query = x;
    a.out = y;
    const mha_status st = mha_forward(m, &a);
    check(forward_ok(st));
    if (st != MHA_OK)
        return;
    /* Training mode (dropout from the file's metadata), causal, and the
     * per-head weights, whose key axis holds bias_k and the zero key. */
    const int64_t total = mha_total_keys(m, L);
    check(total >= L && total <= KMAX);
    check(c->num_heads <= HMAX);
    a.training = 1;
    a.dropout_seed = 7;
    a.causal = MHA_CAUSAL_BOTTOM_RIGHT;
    a.need_weights = MHA_WEIGHTS_PER_HEAD;
    a.attn_weights = w;
    check(forward_ok(mha_forward(m, &a)));
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size < 1)
        return 0;
    const int64_t heads = data[0] % 9;
    mha_tensor_file *f = NULL;
    if (mha_safetensors_parse(data + 1, size - 1, &f) != MHA_OK)
        return 0;
    mha_module *m = (mha_module *)(uintptr_t)1;
    mha_status st = mha_module_from_file(f, heads, NULL, &m);
    if (st != MHA_OK) {
        check(m == NULL);
        check(mha_last_error()[0] != 0);
        mha_tensor_file_free(f);
        return 0;
    }
    check(m != NULL);
    mha_config c;
    check(mha_get_config(m, &c) == MHA_OK);
    const mha_tensor *ow = mha_tensor_file_find(f, "out_proj.weight");
    check(ow != NULL && ow->ndim == 2 && ow->shape[0] == c.embed_dim);
    check(c.embed_dim > 0 && c.num_heads > 0 && c.kdim > 0 && c.vdim > 0);
    check(c.embed_dim % c.num_heads == 0);
    check(heads == 0 || c.num_heads == heads);
    for (int k = 0; k < mha_param_count(m); k++) {
        mha_param_info info;
        check(mha_param_info_at(m, k, &info) == MHA_OK);
        /* Small modules only: the file held these floats already. */
        if (info.numel <= 4096) {
            float buf[4096];
            check(mha_param_get(m, info.name, buf, info.numel) == MHA_OK);
        }
    }
    if (c.kdim == c.embed_dim && c.vdim == c.embed_dim && c.embed_dim <= 64)
        forward(m, &c);
    mha_free(m);
    mha_tensor_file_free(f);
    return 0;
}
