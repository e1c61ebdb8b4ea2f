/*
 * driver.c -- the live PyTorch parity test through the C API, not the CLI:
 * loads a state_dict saved as safetensors with mha_module_load, .npy inputs
 * with mha_npy_load, runs mha_forward and writes .npy with mha_npy_save.
 *
 *   torch_live_driver --weights W.safetensors [--heads H] --query Q.npy
 *       [--key K.npy] [--value V.npy]
 *       [--attn-mask M.npy --mask-kind allow|block|additive]
 *       [--key-padding KP.npy --key-padding-kind allow|block|additive]
 *       [--key-lengths KL.npy] --out OUT.npy [--weights-out A.npy [--per-head]]
 *
 * Unlike `mha forward`, a bool mask may be given with PyTorch's polarity
 * (block: true = masked), so MHA_MASK_BLOCK is exercised too.  Exit 0 on
 * success; otherwise one line on stderr and exit 1.
 */
#include "mha.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(const char *what, mha_status st)
{
    fprintf(stderr, "torch_live_driver: %s: %s (%s)\n", what,
            mha_status_string(st), mha_last_error());
    return 1;
}

static int usage(const char *msg)
{
    fprintf(stderr, "torch_live_driver: %s\n", msg);
    return 1;
}

static mha_mask_kind kind_of(const char *s)
{
    if (!s || !strcmp(s, "allow"))
        return MHA_MASK_ALLOW;
    if (!strcmp(s, "block"))
        return MHA_MASK_BLOCK;
    if (!strcmp(s, "additive"))
        return MHA_MASK_ADDITIVE;
    return MHA_MASK_NONE;
}

static void to_mask(const mha_tensor *t, mha_mask_kind kind, mha_mask *m)
{
    m->kind = kind;
    m->data = t->data;
    m->ndim = t->ndim;
    for (int d = 0; d < t->ndim && d < 4; d++)
        m->shape[d] = t->shape[d];
}

int main(int argc, char **argv)
{
    const char *weights = NULL, *q_path = NULL, *k_path = NULL,
               *v_path = NULL, *m_path = NULL, *m_kind = NULL,
               *kp_path = NULL, *kp_kind = NULL, *kl_path = NULL,
               *out_path = NULL, *w_path = NULL;
    long heads = 0;
    int per_head = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--per-head")) {
            per_head = 1;
            continue;
        }
        if (i + 1 >= argc)
            return usage("an option lacks its value");
        const char *v = argv[++i];
        if (!strcmp(a, "--weights")) weights = v;
        else if (!strcmp(a, "--heads")) heads = strtol(v, NULL, 10);
        else if (!strcmp(a, "--query")) q_path = v;
        else if (!strcmp(a, "--key")) k_path = v;
        else if (!strcmp(a, "--value")) v_path = v;
        else if (!strcmp(a, "--attn-mask")) m_path = v;
        else if (!strcmp(a, "--mask-kind")) m_kind = v;
        else if (!strcmp(a, "--key-padding")) kp_path = v;
        else if (!strcmp(a, "--key-padding-kind")) kp_kind = v;
        else if (!strcmp(a, "--key-lengths")) kl_path = v;
        else if (!strcmp(a, "--out")) out_path = v;
        else if (!strcmp(a, "--weights-out")) w_path = v;
        else return usage("unknown option");
    }
    if (!weights || !q_path || !out_path)
        return usage("--weights, --query and --out are required");
    if (kind_of(m_kind) == MHA_MASK_NONE || kind_of(kp_kind) == MHA_MASK_NONE)
        return usage("a mask kind is allow, block or additive");

    int rc = 1;
    mha_module *m = NULL;
    mha_tensor *q = NULL, *k = NULL, *v = NULL, *mask = NULL, *kp = NULL,
               *kl = NULL;
    float *out = NULL, *w = NULL;
    mha_status st;

    if ((st = mha_module_load(weights, heads, &m)) != MHA_OK) {
        fail("mha_module_load", st);
        goto done;
    }
    mha_config c;
    mha_get_config(m, &c);
    const char *paths[6] = {q_path, k_path, v_path, m_path, kp_path, kl_path};
    mha_tensor **dst[6] = {&q, &k, &v, &mask, &kp, &kl};
    for (int j = 0; j < 6; j++)
        if (paths[j] && (st = mha_npy_load(paths[j], dst[j])) != MHA_OK) {
            fail(paths[j], st);
            goto done;
        }
    if (q->dtype != MHA_DTYPE_F32 || (q->ndim != 2 && q->ndim != 3)) {
        usage("the query must be float32 (B, L, E) or (L, E)");
        goto done;
    }
    const int batched = q->ndim == 3;
    mha_forward_args a = {0};
    a.batch = batched ? q->shape[0] : 1;
    a.q_len = q->shape[q->ndim - 2];
    a.kv_len = k ? k->shape[k->ndim - 2] : a.q_len;
    a.query = q->data;
    a.key = k ? k->data : NULL;
    a.value = v ? v->data : NULL;
    if (mask)
        to_mask(mask, kind_of(m_kind), &a.attn_mask);
    if (kp)
        to_mask(kp, kind_of(kp_kind), &a.key_padding_mask);
    if (kl) {
        if (kl->dtype != MHA_DTYPE_I64 && kl->dtype != MHA_DTYPE_I32) {
            usage("--key-lengths must hold integers");
            goto done;
        }
        a.key_lengths = kl->data;   /* int64_t after mha_npy_load */
    }
    const int64_t B = a.batch, Lq = a.q_len, E = c.embed_dim,
                  H = c.num_heads, Lt = mha_total_keys(m, a.kv_len);
    out = malloc((size_t)(B * Lq * E) * sizeof *out);
    if (w_path) {
        a.need_weights = per_head ? MHA_WEIGHTS_PER_HEAD : MHA_WEIGHTS_AVERAGE;
        w = malloc((size_t)(B * (per_head ? H : 1) * Lq * Lt) * sizeof *w);
    }
    if (!out || (w_path && !w)) {
        usage("out of memory");
        goto done;
    }
    a.out = out;
    a.attn_weights = w;
    if ((st = mha_forward(m, &a)) != MHA_OK) {
        fail("mha_forward", st);
        goto done;
    }

    mha_tensor_view ov = {"", MHA_DTYPE_F32, 0, {0}, out};
    if (batched)
        ov.shape[ov.ndim++] = B;
    ov.shape[ov.ndim++] = Lq;
    ov.shape[ov.ndim++] = E;
    if ((st = mha_npy_save(out_path, &ov)) != MHA_OK) {
        fail(out_path, st);
        goto done;
    }
    if (w_path) {
        mha_tensor_view wv = {"", MHA_DTYPE_F32, 0, {0}, w};
        if (batched)
            wv.shape[wv.ndim++] = B;
        if (per_head)
            wv.shape[wv.ndim++] = H;
        wv.shape[wv.ndim++] = Lq;
        wv.shape[wv.ndim++] = Lt;
        if ((st = mha_npy_save(w_path, &wv)) != MHA_OK) {
            fail(w_path, st);
            goto done;
        }
    }
    rc = 0;
done:
    free(out);
    free(w);
    mha_tensor_free(q);
    mha_tensor_free(k);
    mha_tensor_free(v);
    mha_tensor_free(mask);
    mha_tensor_free(kp);
    mha_tensor_free(kl);
    mha_free(m);
    return rc;
}
