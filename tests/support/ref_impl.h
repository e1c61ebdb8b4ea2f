/*
 * ref_impl.h -- the reference multi-head attention forward pass, written
 * for clarity, not speed, and independently of the library's own code:
 * it reads the module only through the public API, interprets every
 * mask from its definition in mha.h and draws dropout with its own
 * generator (ref_dropout_keep, from the definition in docs/semantics.md).
 *
 * Included twice by ref.c: with REAL = double it is the oracle the tests
 * measure against; with REAL = float it is "a naive float32
 * implementation", whose own error sets the tolerance of the tests.
 *
 * Requires REAL, FN(name) and TANH (tanh or tanhf) to be defined before
 * inclusion, and REF_ORDER(t, n): the index the t-th step of every sum of
 * n terms adds (t, or n - 1 - t for the sums in reverse order).
 */

/* y (n, out) = x (n, in) W^T + b, everything in REAL. */
static void FN(linear)(const REAL *x, int64_t n, int64_t in, const REAL *W,
                       const REAL *b, int64_t out, REAL *y)
{
    for (int64_t r = 0; r < n; r++)
        for (int64_t o = 0; o < out; o++) {
            REAL acc = b ? b[o] : 0;
            for (int64_t t = 0; t < in; t++) {
                const int64_t c = REF_ORDER(t, in);
                acc += x[r * in + c] * W[o * in + c];
            }
            y[r * out + o] = acc;
        }
}

static REAL *FN(param)(const mha_module *m, const char *name)
{
    mha_param_info info;
    if (mha_param_info_by_name(m, name, &info) != MHA_OK)
        return NULL;
    float *f = malloc((size_t)info.numel * sizeof *f);
    REAL *r = malloc((size_t)info.numel * sizeof *r);
    mha_param_get(m, name, f, info.numel);
    for (int64_t k = 0; k < info.numel; k++)
        r[k] = f[k];
    free(f);
    return r;
}

static REAL *FN(widen)(const float *x, int64_t n)
{
    REAL *r = malloc((size_t)(n ? n : 1) * sizeof *r);
    for (int64_t k = 0; k < n; k++)
        r[k] = x[k];
    return r;
}

/* Index into a mask given its own shape; a dimension of 1 broadcasts. */
static int64_t FN(attn_index)(const mha_mask *mk, int64_t b, int64_t h,
                              int64_t i, int64_t j)
{
    const int64_t *s = mk->shape;
    if (mk->ndim == 2)
        return i * s[1] + j;
    if (mk->ndim == 3)
        return ((s[0] == 1 ? 0 : b) * s[1] + i) * s[2] + j;
    return (((s[0] == 1 ? 0 : b) * s[1] + (s[1] == 1 ? 0 : h)) * s[2] + i) *
               s[3] + j;
}

/* 1 = blocked; otherwise *add receives the additive term. */
static int FN(mask_value)(const mha_mask *mk, int64_t idx, REAL *add)
{
    switch (mk->kind) {
    case MHA_MASK_ALLOW: return ((const uint8_t *)mk->data)[idx] == 0;
    case MHA_MASK_BLOCK: return ((const uint8_t *)mk->data)[idx] != 0;
    case MHA_MASK_ADDITIVE: {
        float v = ((const float *)mk->data)[idx];
        if (v == -INFINITY)
            return 1;
        *add += v;
        return 0;
    }
    default: return 0;
    }
}

/*
 * RoPE as Hugging Face writes it (transformers' Llama / GPT-J), not as
 * src/attention/rope.c does: inv_freq[k] = 1 / theta^(2k / dims), the
 * angles pos / scale * inv_freq, cos and sin repeated to the rotary width
 * (NEOX: cat(f, f); GPTJ: each twice, interleaved), then
 *     x <- x * cos + rotate(x) * sin
 * with rotate_half(x) = cat(-x2, x1) (NEOX) or the interleaved
 * (-x1, x0, -x3, x2, ...) (GPTJ), on the first dims elements of each of
 * the `heads` heads of row x.  Zero fields take mha.h's defaults.
 */
static void FN(rope_row)(const mha_rope *rp, int64_t dh, int64_t heads,
                         int64_t pos, REAL *x)
{
    const int64_t dims = rp->dims ? rp->dims : dh, half = dims / 2;
    const REAL theta = rp->theta != 0.0f ? (REAL)rp->theta : (REAL)10000;
    const REAL scale = rp->scale != 0.0f ? (REAL)rp->scale : (REAL)1;
    REAL *cs = malloc((size_t)(2 * dims) * sizeof *cs), *sn = cs + dims;
    REAL *rot = malloc((size_t)dims * sizeof *rot);
    for (int64_t d = 0; d < dims; d++) {
        const int64_t k = rp->style == MHA_ROPE_NEOX ? d % half : d / 2;
        const REAL inv_freq = 1 / pow(theta, (REAL)(2 * k) / (REAL)dims);
        const REAL ang = ((REAL)pos / scale) * inv_freq;
        cs[d] = cos(ang);
        sn[d] = sin(ang);
    }
    for (int64_t h = 0; h < heads; h++) {
        REAL *e = x + h * dh;
        for (int64_t d = 0; d < dims; d++) {
            if (rp->style == MHA_ROPE_NEOX)
                rot[d] = d < half ? -e[d + half] : e[d - half];
            else
                rot[d] = d % 2 == 0 ? -e[d + 1] : e[d - 1];
        }
        for (int64_t d = 0; d < dims; d++)
            e[d] = e[d] * cs[d] + rot[d] * sn[d];
    }
    free(cs);
    free(rot);
}

/*
 * ALiBi's slopes (docs/semantics.md): given, or the paper's for H heads --
 * for H a power of two 2^(-8k/H), k = 1..H; else the n = 2^floor(log2 H)
 * slopes of n, then the odd-numbered ones (k = 1, 3, 5, ...) of 2n's
 * sequence 2^(-4k/n) until there are H.  Rounded to float, as a module
 * stores them.
 */
static void FN(alibi_slopes)(const mha_modifiers *md, int64_t H, REAL *out)
{
    int64_t n = 1;
    while (2 * n <= H)
        n *= 2;
    for (int64_t h = 0; h < H; h++) {
        double s;
        if (md->alibi_slopes)
            s = md->alibi_slopes[h];
        else if (h < n)
            s = pow(2.0, -8.0 * (double)(h + 1) / (double)n);
        else
            s = pow(2.0, -4.0 * (double)(2 * (h - n) + 1) / (double)n);
        out[h] = (REAL)(float)s;
    }
}

/*
 * out (B, Lq, E); weights (B, H, Lq, Lt) always per head (or NULL).
 * The score modifiers (softcap, ALiBi, the window, chunks, sinks) as
 * docs/semantics.md defines them, in its order.  Returns 0 on success.
 */
static int FN(forward)(const mha_module *m, const mha_forward_args *a,
                       REAL *out, REAL *weights)
{
    mha_config c;
    mha_get_config(m, &c);
    const int64_t B = a->batch, Lq = a->q_len;
    const int64_t Lk = a->kv_len ? a->kv_len : Lq;
    const int64_t E = c.embed_dim, H = c.num_heads, dh = c.head_dim;
    const int64_t D = H * dh;   /* the heads side by side (E unless pruned) */
    /* Grouped-query attention: query head h reads K/V head h / (H / Hkv). */
    const int64_t Hkv = c.num_kv_heads ? c.num_kv_heads : H;
    const int64_t Dkv = Hkv * dh, group = H / Hkv;
    /* The values' heads are d_v wide (d_h unless configured). */
    const int64_t dv = c.v_head_dim ? c.v_head_dim : dh;
    const int64_t Dv = H * dv, Dvkv = Hkv * dv;
    const int64_t kdim = c.kdim, vdim = c.vdim;
    const int64_t Lt = Lk + (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
    const float *key = a->key ? a->key : a->query;
    const float *value = a->value ? a->value : key;

    /* Parameters as separate W_q, W_k, W_v whatever the storage. */
    REAL *Wq, *Wk, *Wv;
    REAL *packed = FN(param)(m, "in_proj_weight");
    if (packed) {
        Wq = packed;
        Wk = packed + D * E;
        Wv = packed + (D + Dkv) * E;
    } else {
        Wq = FN(param)(m, "q_proj_weight");
        Wk = FN(param)(m, "k_proj_weight");
        Wv = FN(param)(m, "v_proj_weight");
    }
    REAL *bin = FN(param)(m, "in_proj_bias");
    REAL *Wo = FN(param)(m, "out_proj.weight");
    REAL *bo = FN(param)(m, "out_proj.bias");
    REAL *bk = FN(param)(m, "bias_k");
    REAL *bv = FN(param)(m, "bias_v");
    REAL *sinks = FN(param)(m, "sinks");
    const mha_modifiers *md = &c.mods;
    REAL *slopes = malloc((size_t)H * sizeof *slopes);
    if (md->alibi)
        FN(alibi_slopes)(md, H, slopes);

    REAL *xq = FN(widen)(a->query, B * Lq * E);
    REAL *xk = FN(widen)(key, B * Lk * kdim);
    REAL *xv = FN(widen)(value, B * Lk * vdim);
    REAL *q = malloc((size_t)(B * Lq * D) * sizeof *q);
    REAL *k = malloc((size_t)(B * Lt * Dkv) * sizeof *k);   /* with extras */
    REAL *v = malloc((size_t)(B * Lt * Dvkv) * sizeof *v);
    REAL *ctx = calloc((size_t)(B * Lq * Dv), sizeof *ctx);
    REAL *tmp = malloc((size_t)(Lk * (Dkv > Dvkv ? Dkv : Dvkv)) * sizeof *tmp);
    REAL *s = malloc((size_t)Lt * sizeof *s);
    int *blocked = malloc((size_t)Lt * sizeof *blocked);

    FN(linear)(xq, B * Lq, E, Wq, bin, D, q);
    /* Keys and values per batch, then the appended bias / zero rows. */
    for (int64_t b = 0; b < B; b++) {
        FN(linear)(xk + b * Lk * kdim, Lk, kdim, Wk, bin ? bin + D : NULL,
                   Dkv, tmp);
        memcpy(k + b * Lt * Dkv, tmp, (size_t)(Lk * Dkv) * sizeof *tmp);
        FN(linear)(xv + b * Lk * vdim, Lk, vdim, Wv,
                   bin ? bin + D + Dkv : NULL, Dvkv, tmp);
        memcpy(v + b * Lt * Dvkv, tmp, (size_t)(Lk * Dvkv) * sizeof *tmp);
        int64_t row = Lk;
        if (c.add_bias_kv) {
            for (int64_t e = 0; e < Dkv; e++)
                k[(b * Lt + row) * Dkv + e] = bk[e];
            for (int64_t e = 0; e < Dvkv; e++)
                v[(b * Lt + row) * Dvkv + e] = bv[e];
            row++;
        }
        if (c.add_zero_attn) {
            for (int64_t e = 0; e < Dkv; e++)
                k[(b * Lt + row) * Dkv + e] = 0;
            for (int64_t e = 0; e < Dvkv; e++)
                v[(b * Lt + row) * Dvkv + e] = 0;
        }
    }

    /* RoPE after the projections: query i at positions[b][i] (else i);
     * the real keys at the same positions in self-attention, else j. */
    if (c.mods.rope.style != MHA_ROPE_NONE) {
        const int self = !a->key || (a->key == a->query && Lk == Lq);
        for (int64_t b = 0; b < B; b++) {
            for (int64_t i = 0; i < Lq; i++)
                FN(rope_row)(&c.mods.rope, dh, H,
                             a->positions ? a->positions[b * Lq + i] : i,
                             q + (b * Lq + i) * D);
            for (int64_t j = 0; j < Lk; j++)
                FN(rope_row)(&c.mods.rope, dh, Hkv,
                             self && a->positions ? a->positions[b * Lq + j]
                                                  : j,
                             k + (b * Lt + j) * Dkv);
        }
    }

    const REAL scale = (REAL)c.scale;
    const int dropout = a->training && c.dropout > 0.0f;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < Lq; i++) {
                /* The mask, straight from the definitions. */
                REAL mx = -INFINITY;
                int64_t live = 0;
                for (int64_t j = 0; j < Lt; j++) {
                    REAL add = 0;
                    int blk = 0;
                    /* Positions aligned bottom-right: the query's
                     * i + Lk - Lq, the key's j; the extra keys have none. */
                    const int64_t qpos = i + Lk - Lq;
                    if (j < Lk) {
                        /* (distances compared, not qpos +- a bound,
                         * which overflows for bounds near INT64_MAX) */
                        if (md->window)
                            blk |= (md->window_left >= 0 &&
                                    qpos - j > md->window_left) ||
                                   (md->window_right >= 0 &&
                                    j - qpos > md->window_right);
                        /* chunks: the same floor(position / C) */
                        if (c.attention_chunk) {
                            const int64_t C = c.attention_chunk;
                            const int64_t cq = qpos >= 0 ? qpos / C
                                             : -((-qpos + C - 1) / C);
                            blk |= cq != j / C;
                        }
                        if (a->causal == MHA_CAUSAL_BOTTOM_RIGHT)
                            blk |= j > i + (Lk - Lq);
                        if (a->causal == MHA_CAUSAL_TOP_LEFT)
                            blk |= j > i;
                        if (a->key_lengths)
                            blk |= j >= a->key_lengths[b];
                        const mha_mask *pm = &a->key_padding_mask;
                        if (pm->kind != MHA_MASK_NONE) {
                            int64_t pb = pm->ndim == 2 && pm->shape[0] != 1
                                             ? b : 0;
                            blk |= FN(mask_value)(pm, pb * Lk + j, &add);
                        }
                        if (a->attn_mask.kind != MHA_MASK_NONE)
                            blk |= FN(mask_value)(
                                &a->attn_mask,
                                FN(attn_index)(&a->attn_mask, b, h, i, j),
                                &add);
                    }
                    blocked[j] = blk;
                    if (blk)
                        continue;
                    REAL dot = 0;
                    double terms = 0.0;   /* sum |q_d k_d|: its rounding */
                    for (int64_t t = 0; t < dh; t++) {
                        const int64_t d = REF_ORDER(t, dh);
                        const REAL qk = q[(b * Lq + i) * D + h * dh + d] *
                                        k[(b * Lt + j) * Dkv + h / group * dh + d];
                        dot += qk;
                        terms += fabs((double)qk);
                    }
                    REAL sc = dot * scale;
                    /* The largest rounding scale of a score (and additive
                     * term) a float32 code has: ref_score_magnitude(). */
                    double rs = terms * fabs((double)scale);
                    if (md->softcap > 0.0f) {
                        const double t = tanh((double)sc / md->softcap);
                        rs *= 1.0 - t * t;
                    }
                    if (rs > ref_max_score)
                        ref_max_score = rs;
                    if (fabs((double)add) > ref_max_score &&
                        fabs((double)add) < 1e4)
                        ref_max_score = fabs((double)add);
                    if (md->softcap > 0.0f)
                        sc = (REAL)md->softcap * TANH(sc / (REAL)md->softcap);
                    if (md->alibi && j < Lk)
                        sc -= slopes[h] * (REAL)(qpos > j ? qpos - j
                                                           : j - qpos);
                    s[j] = sc + add;
                    if (s[j] > mx)
                        mx = s[j];
                    live++;
                }
                /* A sink is a key of score sinks[h] and no value: it
                 * joins the denominator only. */
                if (sinks && live && sinks[h] > mx)
                    mx = sinks[h];
                REAL sum = sinks && live ? exp(sinks[h] - mx) : 0;
                for (int64_t t = 0; t < Lt; t++) {
                    const int64_t j = REF_ORDER(t, Lt);
                    if (!blocked[j]) {
                        s[j] = exp(s[j] - mx);
                        sum += s[j];
                    }
                }
                for (int64_t t = 0; t < Lt; t++) {
                    const int64_t j = REF_ORDER(t, Lt);
                    /* Excluded and dropped keys are never read. */
                    int use = live && !blocked[j];
                    if (use && dropout)
                        use = ref_dropout_keep(a->dropout_seed, c.dropout, b,
                                               h, i, j);
                    REAL p = 0;
                    if (use)
                        p = s[j] / sum / (dropout ? 1 - (REAL)c.dropout : 1);
                    if (weights)
                        weights[((b * H + h) * Lq + i) * Lt + j] = p;
                    if (use)
                        for (int64_t d = 0; d < dv; d++)
                            ctx[(b * Lq + i) * Dv + h * dv + d] +=
                                p * v[(b * Lt + j) * Dvkv + h / group * dv + d];
                }
                /* A NaN anywhere in the softmax (a NaN score of a live
                 * key): the row's context is NaN, even when dropout
                 * removed every key (docs/semantics.md). */
                if (live && isnan(sum))
                    for (int64_t d = 0; d < dv; d++)
                        ctx[(b * Lq + i) * Dv + h * dv + d] = NAN;
            }
    /* The head mask scales each head's context before W_O. */
    if (a->head_mask)
        for (int64_t r = 0; r < B * Lq; r++)
            for (int64_t h = 0; h < H; h++)
                for (int64_t d = 0; d < dv; d++)
                    /* m_h = 0 removes the head, NaN context and all
                     * (docs/semantics.md, "Head masks"). */
                    ctx[r * Dv + h * dv + d] =
                        a->head_mask[h] == 0.0f
                            ? 0 : ctx[r * Dv + h * dv + d] *
                                      (REAL)a->head_mask[h];
    FN(linear)(ctx, B * Lq, Dv, Wo, bo, E, out);

    if (packed)
        free(packed);
    else {
        free(Wq);
        free(Wk);
        free(Wv);
    }
    free(bin); free(Wo); free(bo); free(bk); free(bv); free(sinks);
    free(slopes);
    free(xq); free(xk); free(xv); free(q); free(k); free(v); free(ctx);
    free(tmp); free(s); free(blocked);
    return 0;
}
