"""Attention from scratch: each idea of docs/LEARN.md in a few lines of
NumPy, and each one checked against libmha (``import mha``) on random
input.

    .venv/bin/python python/examples/attention_from_scratch.py

runs every step and prints how far NumPy and mha are apart;
python/tests/test_learn.py runs the same checks in the test suite.

Shapes are written next to the code: L is a sequence length, E the model
width, H the number of heads, d (= d_h = E / H) a head's width.  Weights
are stored as PyTorch and mha store them, [out, in], so a linear layer is
``x @ W.T + b``.  (Tutorials that write ``Q = X W_Q`` keep W as [in, out];
it is the same map with W transposed.)
"""
import numpy as np

import mha

# How close float32 (mha) must come to float64 (NumPy): every value here
# is a sum of at most a few hundred products of O(1) numbers, each term
# rounded to float32 (relative 6e-8), so the error stays well under 1e-5
# of the result's size; a wrong index or a missing scale misses by O(1).
TOL = 1e-5


def check(ours, ref, what):
    """Asserts mha's float32 result equals the float64 reference."""
    ours = np.asarray(ours, np.float64)
    ref = np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err = float(np.abs(ours - ref).max())
    bound = TOL * (1.0 + float(np.abs(ref).max()))
    assert err <= bound, "%s: differs by %.3g (bound %.3g)" % (what, err,
                                                               bound)
    return err


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


# ---- step 1: one head ---------------------------------------------------

def softmax(s):
    """Softmax over the last axis.  Subtracting the row's max changes
    nothing mathematically (it cancels in the division) but keeps exp()
    from overflowing: exp(1000) is inf in float64, exp(0) is 1."""
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def one_head(x, w_q, w_k, w_v):
    """x (L, E); w_q, w_k, w_v (d, E).  Returns (L, d)."""
    q = x @ w_q.T                          # (L, d) what each token looks for
    k = x @ w_k.T                          # (L, d) what each token offers
    v = x @ w_v.T                          # (L, d) what each token passes on
    d = q.shape[1]
    scores = q @ k.T / np.sqrt(d)          # (L, L) scores[i, j] = q_i . k_j / sqrt(d)
    weights = softmax(scores)              # (L, L) each row sums to 1
    return weights @ v                     # (L, d) row i: a weighted mean of v


def check_one_head(seed=0):
    rng = np.random.default_rng(seed)
    L, E = 5, 8
    m = mha.Module(E, 1, bias=False, seed=seed)       # one head, d = E
    w_q, w_k, w_v = np.split(m["in_proj_weight"].astype(np.float64), 3)
    w_o = m["out_proj.weight"].astype(np.float64)
    x = rng.standard_normal((L, E))
    ours = one_head(x, w_q, w_k, w_v) @ w_o.T         # then the output layer
    return check(m.forward(f32(x)), ours, "one head")


# ---- step 2: why divide by sqrt(d) -------------------------------------

def dot_product_spread(d, n=20000, seed=0):
    """The variance of q . k for q, k with independent unit-variance
    entries is d (a sum of d terms of variance 1): returns the measured
    variance, and the mean largest softmax weight of 16 keys at scale 1
    and at scale 1/sqrt(d)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n, d))
    k = rng.standard_normal((n, d))
    var = float(((q * k).sum(1)).var())
    keys = rng.standard_normal((16, d))
    s = q[:1000] @ keys.T                  # (1000, 16) scores at scale 1
    top_raw = float(softmax(s).max(1).mean())
    top_scaled = float(softmax(s / np.sqrt(d)).max(1).mean())
    return var, top_raw, top_scaled


def check_scale():
    var, top_raw, top_scaled = dot_product_spread(64)
    # 20000 samples: the variance's own standard error is ~1% of it
    assert 0.95 * 64 < var < 1.05 * 64, var
    # unscaled, the softmax is nearly one-hot (gradients vanish);
    # scaled, the weights are spread over several keys
    assert top_raw > 0.75 and top_scaled < 0.5, (top_raw, top_scaled)
    return ("var(q.k) = %.1f at d = 64; mean top weight %.2f at scale 1, "
            "%.2f at 1/sqrt(d)" % (var, top_raw, top_scaled))


# ---- step 3: masks --------------------------------------------------------

def masked_softmax(s, allow):
    """Softmax of s over the keys where allow is True.  A blocked key
    gets exactly zero weight (exp(-inf) = 0); a row with no allowed key
    gets all zeros, as mha gives it (not NaN, not a uniform row)."""
    s = np.where(allow, s, -np.inf)
    top = s.max(axis=-1, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)     # a row with no key
    e = np.exp(s - top)
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def causal(L):
    """(L, L): query i may see keys j <= i, its past and itself."""
    return np.tril(np.ones((L, L), dtype=bool))


def check_masks(seed=0):
    rng = np.random.default_rng(seed)
    L, d = 4, 8
    q, k, v = (rng.standard_normal((L, d)) for _ in range(3))
    allow = causal(L)
    allow[3, :] = False                    # query 3: every key blocked
    w = masked_softmax(q @ k.T / np.sqrt(d), allow)
    assert np.all(w[3] == 0) and np.allclose(w[:3].sum(1), 1)
    # the -1e9 fill of many tutorials: a row with no key becomes the
    # uniform average over the keys it was told to ignore
    filled = softmax(np.where(allow, q @ k.T / np.sqrt(d), -1e9))
    assert np.allclose(filled[3], 1 / L)
    out, weights = mha.attention(f32(q[None]), f32(k[None]), f32(v[None]),
                                 num_heads=1, attn_mask=mha.allow(allow),
                                 need_weights="per_head")
    check(weights[0, 0], w, "masked weights")
    return check(out[0], w @ v, "masked output (row 3: zeros)")


# ---- step 4: heads, concatenation, W_O ----------------------------------

def multi_head(x, params, H):
    """Self-attention of x (L, E) with nn.MultiheadAttention's parameters
    (the names mha and PyTorch share).  Returns (L, E)."""
    E = x.shape[1]
    d = E // H
    w_q, w_k, w_v = np.split(params["in_proj_weight"], 3)    # each (E, E)
    b_q, b_k, b_v = np.split(params["in_proj_bias"], 3)      # each (E,)
    q, k, v = x @ w_q.T + b_q, x @ w_k.T + b_k, x @ w_v.T + b_v   # (L, E)
    heads = []
    for h in range(H):
        cols = slice(h * d, (h + 1) * d)   # head h owns these d columns
        w = softmax(q[:, cols] @ k[:, cols].T / np.sqrt(d))  # (L, L)
        heads.append(w @ v[:, cols])                         # (L, d)
    concat = np.concatenate(heads, axis=1)                   # (L, E)
    return concat @ params["out_proj.weight"].T + params["out_proj.bias"]


def random_module(E, H, seed=0, **kw):
    """An mha.Module with random biases too (they start at zero)."""
    rng = np.random.default_rng(seed + 1)
    m = mha.Module(E, H, seed=seed, **kw)
    for name in ("in_proj_bias", "out_proj.bias"):
        m[name] = f32(0.1 * rng.standard_normal(m.parameter_shapes()[name]))
    return m


def check_multi_head(seed=0):
    rng = np.random.default_rng(seed)
    L, E, H = 6, 16, 4
    m = random_module(E, H, seed)
    params = {n: a.astype(np.float64) for n, a in m.state_dict().items()}
    x = rng.standard_normal((L, E))
    return check(m.forward(f32(x)), multi_head(x, params, H), "multi-head")


# ---- step 5: the online softmax (flash attention) ----------------------

def attention(q, k, v):
    """The plain way: q (Lq, d), k (Lk, d), v (Lk, dv).  Builds the whole
    (Lq, Lk) matrix of scores."""
    return softmax(q @ k.T / np.sqrt(q.shape[1])) @ v


def online_attention(q, k, v, tile=4):
    """The same result from key tiles of `tile` keys: memory (Lq, tile),
    never (Lq, Lk).  Per query row it keeps m (the largest score so far),
    l (the sum of exp(score - m)) and o (the sum of exp(score - m) v).
    Invariant after each tile: o / l is the attention over the keys seen
    so far.  Returns the output (Lq, dv) and lse = m + log l (Lq,)."""
    Lq, d = q.shape
    m = np.full(Lq, -np.inf)
    l = np.zeros(Lq)
    o = np.zeros((Lq, v.shape[1]))
    for j in range(0, k.shape[0], tile):
        s = q @ k[j:j + tile].T / np.sqrt(d)       # (Lq, tile)
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)                  # rescale the old sums
        p = np.exp(s - m_new[:, None])             # (Lq, tile)
        l = l * alpha + p.sum(axis=1)
        o = o * alpha[:, None] + p @ v[j:j + tile]
        m = m_new
    return o / l[:, None], m + np.log(l)


def merge(o1, lse1, o2, lse2):
    """Two partial results over disjoint key sets -> the result over both.
    lse = log(sum of exp(scores)) over a part's keys, so each part's
    share of the whole softmax is exp(lse_part - lse_all)."""
    lse = np.logaddexp(lse1, lse2)
    return (np.exp(lse1 - lse)[:, None] * o1 +
            np.exp(lse2 - lse)[:, None] * o2), lse


def three_key_trace(q, k, v):
    """One query q (d,) and three keys, one key per tile: the (m, l, o)
    after each key, and the attention over the keys seen so far."""
    m, l, o = -np.inf, 0.0, np.zeros(v.shape[1])
    rows = []
    for j in range(3):
        s = q @ k[j] / np.sqrt(len(q))
        m_new = max(m, s)
        l = l * np.exp(m - m_new) + np.exp(s - m_new)
        o = o * np.exp(m - m_new) + np.exp(s - m_new) * v[j]
        m = m_new
        rows.append((m, l, o.copy(), attention(q[None], k[:j + 1],
                                               v[:j + 1])[0]))
    return rows


def check_online(seed=0):
    rng = np.random.default_rng(seed)
    Lq, Lk, d = 5, 11, 8                   # 11 keys: tiles of 4, 4 and 3
    q, k, v = (rng.standard_normal((n, d)) for n in (Lq, Lk, Lk))
    k[3] *= 40                             # one big score: the max moves
    ref = attention(q, k, v)
    out, lse = online_attention(q, k, v)
    assert np.allclose(out, ref, atol=1e-12, rtol=0)
    for m, l, o, seen in three_key_trace(q[0], k, v):
        assert np.allclose(o / l, seen, atol=1e-12, rtol=0)
    # mha: the two halves of the keys apart, each with its lse, merged
    halves = [(0, 6), (6, Lk)]
    parts = [mha.attention(f32(q[None]), f32(k[None, a:b]),
                           f32(v[None, a:b]), num_heads=1, return_lse=True)
             for a, b in halves]
    (o1, lse1), (o2, lse2) = [(o[0], s[0, 0]) for o, s in parts]
    merged, lse_all = merge(o1.astype(np.float64), lse1.astype(np.float64),
                            o2.astype(np.float64), lse2.astype(np.float64))
    check(lse_all, lse, "merged lse")
    return check(merged, ref, "merged halves")


# ---- step 6: the KV cache -----------------------------------------------

def project(x, params, H):
    """q, k, v of x (L, E), each (L, H, d)."""
    L, E = x.shape
    qkv = x @ params["in_proj_weight"].T + params["in_proj_bias"]  # (L, 3E)
    return [t.reshape(L, H, E // H) for t in np.split(qkv, 3, axis=1)]


def out_layer(ctx, params):
    """ctx (L, H, d) -> (L, E): concatenate the heads, apply W_O."""
    return (ctx.reshape(ctx.shape[0], -1) @ params["out_proj.weight"].T +
            params["out_proj.bias"])


def causal_multi_head(x, params, H):
    """Causal self-attention of the whole sequence at once: (L, E)."""
    q, k, v = project(x, params, H)
    L, _, d = q.shape
    ctx = np.zeros_like(q)
    for h in range(H):
        w = masked_softmax(q[:, h] @ k[:, h].T / np.sqrt(d), causal(L))
        ctx[:, h] = w @ v[:, h]
    return out_layer(ctx, params)


def decode(x, params, H):
    """The same, one token at a time with a cache: token t projects only
    itself, appends its k and v, and attends over the cache.  Valid
    because under a causal mask no later token changes an earlier
    token's k or v, nor what an earlier query sees."""
    k_cache, v_cache, outs = [], [], []
    for t in range(x.shape[0]):
        q, k, v = project(x[t:t + 1], params, H)         # (1, H, d) each
        k_cache.append(k[0])
        v_cache.append(v[0])
        K, V = np.stack(k_cache), np.stack(v_cache)      # (t+1, H, d)
        ctx = np.stack([attention(q[:, h], K[:, h], V[:, h])[0]
                        for h in range(H)])              # (H, d)
        outs.append(out_layer(ctx[None], params)[0])
    return np.stack(outs)


def check_kv_cache(seed=0):
    rng = np.random.default_rng(seed)
    L, E, H, prompt = 7, 16, 2, 3
    m = random_module(E, H, seed)
    params = {n: a.astype(np.float64) for n, a in m.state_dict().items()}
    x = rng.standard_normal((L, E))
    ref = causal_multi_head(x, params, H)
    assert np.allclose(decode(x, params, H), ref, atol=1e-12, rtol=0)
    # mha: the prompt in one call, then token by token through its cache
    cache = mha.KVCache.for_module(m, batch=1, capacity=L)
    xs = f32(x[None])
    steps = [m.forward(xs[:, :prompt], cache=cache)]
    steps += [m.forward(xs[:, t:t + 1], cache=cache) for t in range(prompt, L)]
    check(m.forward(xs, causal="top_left")[0], ref, "mha causal")
    return check(np.concatenate(steps, axis=1)[0], ref, "mha KV cache")


# ---- step 7: grouped-query attention ----------------------------------

def gqa(q, k, v, H, H_kv):
    """q (L, H*d); k, v (Lk, H_kv*d).  Query head h reads KV head
    h // (H / H_kv): repeat each KV head H / H_kv times, then attend as
    usual.  The cache holds H_kv heads, H / H_kv times smaller."""
    d = q.shape[1] // H
    group = H // H_kv
    k = np.repeat(k.reshape(-1, H_kv, d), group, axis=1)   # (Lk, H, d)
    v = np.repeat(v.reshape(-1, H_kv, d), group, axis=1)
    q = q.reshape(-1, H, d)
    return np.concatenate([attention(q[:, h], k[:, h], v[:, h])
                           for h in range(H)], axis=1)     # (L, H*d)


def check_gqa(seed=0):
    rng = np.random.default_rng(seed)
    L, H, H_kv, d = 6, 8, 2, 4
    q = rng.standard_normal((L, H * d))
    k, v = (rng.standard_normal((L, H_kv * d)) for _ in range(2))
    out = mha.attention(f32(q[None]), f32(k[None]), f32(v[None]),
                        num_heads=H, num_kv_heads=H_kv)
    return check(out[0], gqa(q, k, v, H, H_kv), "grouped-query attention")


# ---- step 8: rotary position embeddings ----------------------------------

def rope(x, pos, theta=10000.0):
    """x (L, d) of one head, pos (L,) positions.  Turns pair k of token p,
    (x[k], x[k + d/2]) in the NeoX / Llama layout, by the angle
    p * theta^(-2k/d)."""
    half = x.shape[1] // 2
    angle = pos[:, None] * theta ** (-2.0 * np.arange(half) / x.shape[1])
    c, s = np.cos(angle), np.sin(angle)
    x0, x1 = x[:, :half], x[:, half:]
    return np.concatenate([x0 * c - x1 * s, x0 * s + x1 * c], axis=1)


def check_rope(seed=0):
    rng = np.random.default_rng(seed)
    L, d = 6, 8
    x = rng.standard_normal((L, d))
    pos = np.arange(L, dtype=np.float64)
    err = check(mha.rope_apply(f32(x), 1, "neox"), rope(x, pos), "rope")
    # a rotation by angle a then b: q rotated by p, k by p', their dot
    # product depends on p - p' only (R_p^T R_p' = R_(p'-p))
    q, k = rng.standard_normal((2, 1, d))
    near = rope(q, np.array([5.0])) @ rope(k, np.array([2.0])).T
    far = rope(q, np.array([105.0])) @ rope(k, np.array([102.0])).T
    assert np.allclose(near, far, atol=1e-12, rtol=0)
    return err


# ---- step 9: sliding windows and sinks ----------------------------------

def window_sink_attention(q, k, v, window, sink):
    """Each query i sees keys i - window + 1 .. i, and one more term
    exp(sink) joins the denominator with no value: a row may put part
    of its weight nowhere."""
    L = q.shape[0]
    i, j = np.arange(L)[:, None], np.arange(L)[None, :]
    allow = (j <= i) & (j > i - window)
    s = np.where(allow, q @ k.T / np.sqrt(q.shape[1]), -np.inf)
    m = np.maximum(s.max(axis=1), sink)
    e = np.exp(s - m[:, None])
    return e @ v / (e.sum(axis=1) + np.exp(sink - m))[:, None]


def check_window_sink(seed=0):
    rng = np.random.default_rng(seed)
    L, d, window, sink = 9, 8, 3, 0.5
    q, k, v = (rng.standard_normal((L, d)) for _ in range(3))
    out = mha.attention(f32(q[None]), f32(k[None]), f32(v[None]),
                        num_heads=1, window=(window - 1, 0),
                        sinks=f32([sink]))
    return check(out[0], window_sink_attention(q, k, v, window, sink),
                 "window and sink")


STEPS = [("1 one head", check_one_head),
         ("2 why sqrt(d)", check_scale),
         ("3 masks", check_masks),
         ("4 heads and W_O", check_multi_head),
         ("5 online softmax", check_online),
         ("6 KV cache", check_kv_cache),
         ("7 grouped-query", check_gqa),
         ("8 RoPE", check_rope),
         ("9 window and sink", check_window_sink)]


def main():
    for name, fn in STEPS:
        r = fn()
        if isinstance(r, float):
            r = "max |mha - NumPy float64| = %.1e" % r
        print("step %-19s ok: %s" % (name, r))


if __name__ == "__main__":
    main()
