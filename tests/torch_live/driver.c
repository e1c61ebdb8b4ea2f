/*
 * driver.c -- the live PyTorch parity test through the C API, not the CLI:
 * loads a state_dict saved as safetensors with mha_module_load, .npy inputs
 * with mha_npy_load, runs mha_forward and writes .npy with mha_npy_save.
 *
 *   torch_live_driver --weights W.safetensors [--heads H] --query Q.npy
 *       [--key K.npy] [--value V.npy]
 *       [--attn-mask M.npy --mask-kind allow|block|additive]
 *       [--key-padding KP.npy --key-padding-kind allow|block|additive]
 *       [--key-lengths KL.npy] [--causal top_left|bottom_right]
 *       --out OUT.npy [--weights-out A.npy [--per-head]]
 *       [--grad-out G.npy --grads-out GRADS.safetensors]
 *
 * Unlike `mha forward`, a bool mask may be given with PyTorch's polarity
 * (block: true = masked), so MHA_MASK_BLOCK is exercised too.
 *
 * With --grad-out (dL/d out, the shape of OUT) the driver also runs the
 * backward: mha_plan_create, mha_plan_forward (which writes OUT and the
 * weights) and mha_plan_backward, the training loop's calls; then
 * mha_backward (the one-shot call) on the same arguments, whose gradients
 * must be bitwise the same.  GRADS.safetensors receives, float32, "query"
 * (and "key", "value" for the inputs given: a tensor not given is the one
 * before it, whose gradient then includes its share) and every parameter's
 * gradient under the parameter's name, in mha_param_info order.
 *
 * Exit 0 on success; otherwise one line on stderr and exit 1.
 */
#include "mha_io.h"

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
               *out_path = NULL, *w_path = NULL, *causal = NULL,
               *go_path = NULL, *grads_path = NULL;
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
        else if (!strcmp(a, "--causal")) causal = v;
        else if (!strcmp(a, "--grad-out")) go_path = v;
        else if (!strcmp(a, "--grads-out")) grads_path = v;
        else return usage("unknown option");
    }
    if (!weights || !q_path || !out_path)
        return usage("--weights, --query and --out are required");
    if (kind_of(m_kind) == MHA_MASK_NONE || kind_of(kp_kind) == MHA_MASK_NONE)
        return usage("a mask kind is allow, block or additive");
    if (causal && strcmp(causal, "top_left") && strcmp(causal, "bottom_right"))
        return usage("--causal is top_left or bottom_right");
    if (!go_path != !grads_path)
        return usage("--grad-out and --grads-out go together");

    int rc = 1;
    mha_module *m = NULL;
    mha_tensor *q = NULL, *k = NULL, *v = NULL, *mask = NULL, *kp = NULL,
               *kl = NULL, *go = NULL;
    float *out = NULL, *w = NULL;
    float *grads[2][4] = {{NULL}};   /* [plan, one-shot][query, key, value,
                                        parameters] */
    mha_plan *plan = NULL;
    mha_status st;

    if ((st = mha_module_load(weights, heads, &m)) != MHA_OK) {
        fail("mha_module_load", st);
        goto done;
    }
    mha_config c;
    mha_get_config(m, &c);
    const char *paths[7] = {q_path, k_path, v_path, m_path, kp_path, kl_path,
                            go_path};
    mha_tensor **dst[7] = {&q, &k, &v, &mask, &kp, &kl, &go};
    for (int j = 0; j < 7; j++)
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
    if (causal)
        a.causal = strcmp(causal, "top_left") ? MHA_CAUSAL_BOTTOM_RIGHT
                                              : MHA_CAUSAL_TOP_LEFT;
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
    if (!go) {
        if ((st = mha_forward(m, &a)) != MHA_OK) {
            fail("mha_forward", st);
            goto done;
        }
    } else {
        /* The backward, twice: the plan's calls, then mha_backward. */
        if (go->dtype != MHA_DTYPE_F32 || go->numel != B * Lq * E) {
            usage("--grad-out must be float32 with the shape of the output");
            goto done;
        }
        const mha_tensor *in[3] = {q, k, v};
        const int64_t np = mha_param_numel(m);
        for (int r = 0; r < 2; r++) {
            for (int j = 0; j < 3; j++)
                if (in[j] &&
                    !(grads[r][j] = malloc((size_t)in[j]->numel *
                                           sizeof(float)))) {
                    usage("out of memory");
                    goto done;
                }
            if (!(grads[r][3] = malloc((size_t)np * sizeof(float)))) {
                usage("out of memory");
                goto done;
            }
        }
        mha_backward_args g = {0};
        g.grad_out = go->data;
        g.grad_query = grads[0][0];
        g.grad_key = grads[0][1];
        g.grad_value = grads[0][2];
        g.grad_params = grads[0][3];
        if ((st = mha_plan_create(m, &a, &plan)) != MHA_OK) {
            fail("mha_plan_create", st);
            goto done;
        }
        if ((st = mha_plan_forward(plan, &a)) != MHA_OK) {
            fail("mha_plan_forward", st);
            goto done;
        }
        if ((st = mha_plan_backward(plan, &a, &g)) != MHA_OK) {
            fail("mha_plan_backward", st);
            goto done;
        }
        g.grad_query = grads[1][0];
        g.grad_key = grads[1][1];
        g.grad_value = grads[1][2];
        g.grad_params = grads[1][3];
        if ((st = mha_backward(m, &a, &g)) != MHA_OK) {
            fail("mha_backward", st);
            goto done;
        }
        static const char *const what[4] = {"query", "key", "value",
                                             "parameters"};
        for (int j = 0; j < 4; j++) {
            const int64_t n = j < 3 ? (in[j] ? in[j]->numel : 0) : np;
            if (n && memcmp(grads[0][j], grads[1][j],
                            (size_t)n * sizeof(float))) {
                fprintf(stderr, "torch_live_driver: the gradients of %s from "
                        "mha_plan_backward and mha_backward differ\n",
                        what[j]);
                goto done;
            }
        }
        /* Inputs, then parameters, under their names. */
        mha_tensor_view views[3 + 16];
        int nv = 0;
        for (int j = 0; j < 3; j++) {
            if (!in[j])
                continue;
            mha_tensor_view *t = &views[nv++];
            memset(t, 0, sizeof *t);
            t->name = what[j];
            t->dtype = MHA_DTYPE_F32;
            t->ndim = in[j]->ndim;
            for (int d = 0; d < in[j]->ndim; d++)
                t->shape[d] = in[j]->shape[d];
            t->data = grads[0][j];
        }
        for (int i = 0; i < mha_param_count(m) && nv < 3 + 16; i++) {
            mha_param_info info;
            if ((st = mha_param_info_at(m, i, &info)) != MHA_OK) {
                fail("mha_param_info_at", st);
                goto done;
            }
            mha_tensor_view *t = &views[nv++];
            memset(t, 0, sizeof *t);
            t->name = info.name;
            t->dtype = MHA_DTYPE_F32;
            t->ndim = info.ndim;
            for (int d = 0; d < info.ndim; d++)
                t->shape[d] = info.shape[d];
            t->data = grads[0][3] + info.offset;
        }
        if ((st = mha_safetensors_save(grads_path, views, nv, NULL, NULL,
                                       0)) != MHA_OK) {
            fail(grads_path, st);
            goto done;
        }
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
    mha_plan_free(plan);
    for (int r = 0; r < 2; r++)
        for (int j = 0; j < 4; j++)
            free(grads[r][j]);
    free(out);
    free(w);
    mha_tensor_free(go);
    mha_tensor_free(q);
    mha_tensor_free(k);
    mha_tensor_free(v);
    mha_tensor_free(mask);
    mha_tensor_free(kp);
    mha_tensor_free(kl);
    mha_free(m);
    return rc;
}
